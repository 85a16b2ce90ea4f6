"""A plan's input layouts as ``jax.sharding`` objects, for a plain ``jax.jit`` (GSPMD).

``to_jax_shardings(plan, mesh=None)`` gives the ``NamedSharding`` of every parameter and data
input by value name; ``in_shardings(plan, mesh=None)`` arranges them like the example arguments,
so ``jax.jit(fn, in_shardings=in_shardings(plan))`` runs the plan's data placement with XLA's
own partitioner doing the rest. ``mesh``: a ``jax.sharding.Mesh`` with the plan's axis names
and sizes (default: the first ``device_num`` devices, as :func:`autopar.lower.lower` builds it).
Kept beside lowering: planning (``autopar.strategies``) builds no JAX objects.

>>> shardings = to_jax_shardings(plan)                # doctest: +SKIP
>>> shardings["params/layer0/w"].spec                 # doctest: +SKIP
PartitionSpec(None, ('a0', 'a1', 'a2'))
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.lower import jax_mesh, user_mesh
from autopar.strategies.plan import Plan

__all__ = ["in_shardings", "to_jax_shardings"]


def to_jax_shardings(plan: Plan, mesh: Mesh | None = None) -> dict[str, NamedSharding]:
    """``NamedSharding`` of every parameter and data input of ``plan``, by value name."""
    if not isinstance(plan, Plan):
        raise AutoParallelTypeError("plan", plan, "an autopar.Plan from autopar.search")
    jmesh = _jax_mesh(plan, mesh)
    return {v: NamedSharding(jmesh, plan.layouts[v].partition_spec()) for v in plan.inputs}


def in_shardings(plan: Plan, mesh: Mesh | None = None) -> Any:
    """The shardings of :func:`to_jax_shardings` arranged like the example arguments (a tuple,
    one pytree per positional argument): ``jax.jit(fn, in_shardings=...)``."""
    by_name = to_jax_shardings(plan, mesh)
    if plan.in_tree is None:
        raise AutoParallelError("plan", plan.mode, "has no argument structure (it was not "
                                "built from a traced graph)",
                                "Use to_jax_shardings(plan, mesh) by value name instead")
    return jax.tree_util.tree_unflatten(plan.in_tree, [by_name[v] for v in plan.inputs])


def _jax_mesh(plan: Plan, mesh: Any) -> Mesh:
    if mesh is None:
        return jax_mesh(plan.mesh)
    return user_mesh(mesh, plan.mesh)
