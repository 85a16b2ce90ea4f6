"""The strategy space of an operator: which split vectors of its loop nest are legal.

Each operator kind's loop nest (:class:`OpSpec`: iteration dims and how tensors map onto
them) is part of its record in the operator registry, :mod:`autopar.graph.ops`; this module
holds the one rule every search mode, strategy check and data layout applies to a split
vector: each iteration dim allows its count (:meth:`OpSpec.refuses`: not fixed, divides the
dim size and any reshaped dim it must also divide) and the counts fit the mesh's axes
(:meth:`DeviceMesh.assign <autopar.strategies.layout.DeviceMesh.assign>`: their product
divides ``device_num`` and canonical axes exist for them).

>>> import jax.numpy as jnp, autopar
>>> from autopar.strategies.layout import DeviceMesh
>>> g = autopar.trace(lambda w, x: x @ w, jnp.ones((8, 4)), jnp.ones((2, 8)))
>>> spec = op_spec(g.nodes[0], g)
>>> mesh = DeviceMesh.for_devices(8)
>>> legal_splits(spec, (2, 4, 1), mesh), legal_splits(spec, (4, 1, 1), mesh)
(True, False)
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from autopar.graph import ops
from autopar.graph.ir import Graph, Node
from autopar.graph.loops import LOOP_KIND, loop_spec
from autopar.graph.ops import OpSpec
from autopar.strategies.layout import DeviceMesh

__all__ = ["OpSpec", "op_spec", "legal_splits", "tensor_spec"]


def op_spec(node: Node, graph: Graph) -> OpSpec:
    """The loop nest of a node: its kind's (:func:`autopar.graph.ops.op_spec`), or for a
    loop node the dims of its body's data inputs (:func:`autopar.graph.loops.loop_spec`)."""
    if node.kind == LOOP_KIND:
        return loop_spec(node, graph)
    return ops.op_spec(node, graph)


def legal_splits(spec: OpSpec, splits: Sequence[int], mesh: DeviceMesh,
                 dims: Iterable[int] | None = None,
                 assign: Callable[[tuple[int, ...]], object] | None = None) -> bool:
    """Whether ``splits`` (one count per iteration dim) is a strategy of ``spec`` on
    ``mesh`` (see the module docstring). ``dims``: check only these iteration dims (the
    others are known to allow their counts); the mesh is always checked, by ``assign``
    when given (``mesh.assign`` kept by the caller, e.g. ``Problem.axes_of``: tuples)."""
    check = range(len(splits)) if dims is None else dims
    return all(spec.allows(d, splits[d]) for d in check) and \
        (mesh.assign(splits) if assign is None else assign(tuple(splits))) is not None


def tensor_spec(shape: Sequence[int]) -> OpSpec:
    """A tensor as a loop nest: one iteration dim per tensor dim, each splittable (the
    strategy space of a data input's layout).

    >>> tensor_spec((6, 4)).refuses(0, 4)
    'split 4 does not divide the dim size 6'
    """
    ident = tuple(range(len(shape)))
    return OpSpec(tuple(shape), (ident,), (ident,))
