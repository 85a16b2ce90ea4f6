"""The parallel optimizer (``enable_parallel_optimizer``): shard large parameters, their
gradients and their optimizer state over the parameter's data-parallel axes.

A parameter is **sharded** when all of these hold (else it stays as the plan lays it out and its
gradient is all-reduced as usual; :class:`ShardDecision` records why):

- ``enable_parallel_optimizer=True``;
- its size ``shape[0] * ... * shape[n] * itemsize`` is **not smaller** than
  ``parallel_optimizer_config["parallel_optimizer_threshold"]`` KB (seed 002: "parameters with
  size smaller than this threshold will not be sharded"; default 64 KB, 0 shards everything);
- it is replicated over some mesh axes (its *sync axes*, where its gradient would be
  all-reduced: the data-parallel group); a parameter split over every axis has nothing to
  shard over;
- dim 0 of its local block divides by the size of its shard group (MindSpore shards dim 0
  too).

**The shard group** (``optimizer_weight_shard_size``, MindSpore's key: the top-level one or
``parallel_optimizer_config["optimizer_weight_shard_size"]``, one setting). ``-1`` (default):
the whole data-parallel group, every sync axis. ``N``: the parameter and its optimizer state
are split over a group of ``N`` devices only (:func:`shard_group`): the sync axes whose sizes
multiply to ``N``, taken **innermost first** (walking the sync axes from the last mesh axis
outward, an axis is taken while its size divides what is left of ``N``; MindSpore's shard
groups are likewise runs of consecutive ranks of the data-parallel group). The other sync axes
(``ShardDecision.replicas``) hold copies of each shard: the ``dp / N`` groups are replicas of
one another. autopar's meshes are made of prime-size axes, so such a group exists exactly when
``N`` divides the data-parallel group size. When it does not (or ``N`` exceeds the group), the
parameter falls back to its whole group as MindSpore does, the decision's reason says so and
the step warns once (``AutoParallelWarning`` naming the key, the value and the group size,
:func:`warn_fallbacks`). ``N`` equal to the group size is the default.

A sharded parameter is **stored** split along dim 0 over its layout's dim-0 axes followed by its
shard-group axes (:func:`storage_spec`): between steps each device holds ``1 / N`` of it and of
its optimizer state (``N = dp`` by default; optax's state leaves mirror the parameter tree;
:func:`state_shardings` maps the storage layout onto them with ``optax.tree_map_params``). One
step:

1. **all-gather** the sharded parameters over their shard group at the start of the step (in
   forward order, bucketed by ``comm_fusion["allgather"]``);
2. forward and backward on the whole parameters;
3. **reduce-scatter** their gradients over the shard group (in backward order, bucketed by
   ``comm_fusion["reducescatter"]``) instead of all-reducing them, then, with a shard size
   below the group, **all-reduce the shards across the groups** (over the replica axes, in the
   same buckets); the rest are all-reduced in the ``comm_fusion["allreduce"]`` buckets;
4. the optax update runs on the stored shards (outside the ``shard_map``, so optimizers with
   global reductions such as ``clip_by_global_norm`` stay exact: XLA adds the scalar
   all-reduce), and the new parameters stay sharded.

``gradient_accumulation_shard`` (with ``grad_accumulation_step > 1``): True (default) reduce-
scatters each micro-step's gradients and accumulates the shards (less memory, one
reduce-scatter per micro-step; the all-reduce across groups runs once, after the last
micro-step); False accumulates whole local gradients and reduce-scatters once after the last
micro-step.

The search prices the same rule (:mod:`autopar.strategies.optimizer_rule`, where it lives;
:meth:`autopar.strategies.problem.Problem.param_memory`:
stored copy and state ``1 / N``), plans record the size
(``Plan.pricing.optimizer_weight_shard_size``; a strategy file carries it only when it is not
``-1``). The pipelined step
(:mod:`autopar.pipeline.step`) shards over the whole group only and refuses another size.

Reusable API (a pipelined step calls it inside its ``shard_map``)::

    shard_group(sync_axes, axis_sizes, size) -> tuple[str, ...] | None
    gather_parameters(shards, axes, buckets, *, chain=False) -> list[Array]
    scatter_gradients(grads, axes, buckets, *, chain=False, fp32=False) -> list[Array]
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.errors import AutoParallelWarning
from autopar.grad_sync import bucketed_collective, fp32_collective
from autopar.strategies.optimizer_rule import ShardDecision, decide_sharding, shard_group

__all__ = ["ShardDecision", "shard_group", "decide_sharding", "warn_fallbacks", "storage_spec",
           "gather_parameters", "scatter_gradients", "state_shardings", "device_bytes"]


def warn_fallbacks(decisions: Sequence[ShardDecision], *, stacklevel: int) -> None:
    """One ``AutoParallelWarning`` per distinct fallback note of ``decisions`` (an
    ``optimizer_weight_shard_size`` that could not be applied: the key, the value, the group
    size and the parameters it concerns)."""
    notes: dict[str, list[str]] = {}
    for d in decisions:
        if d.fallback:
            notes.setdefault(d.fallback, []).append(d.name)
    for note, names in notes.items():
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
        warnings.warn(f"{note}, as MindSpore does, for parameter(s) {shown}. Set "
                      "optimizer_weight_shard_size to a divisor of the data-parallel group "
                      "size (or -1) to silence this.", AutoParallelWarning,
                      stacklevel=stacklevel + 1)


def storage_spec(spec: PartitionSpec, axes: Sequence[str], ndim: int) -> PartitionSpec:
    """The layout a sharded parameter is stored in: ``spec`` with ``axes`` appended to dim 0.

    >>> storage_spec(PartitionSpec(None, "a1"), ("a0",), 2)
    P('a0', 'a1')
    """
    dims = list(spec) + [None] * (ndim - len(spec))
    first = dims[0]
    have = () if first is None else ((first,) if isinstance(first, str) else tuple(first))
    new = have + tuple(axes)
    dims[0] = new[0] if len(new) == 1 else new
    return PartitionSpec(*dims)


def gather_parameters(shards: Sequence[Any], axes: Sequence[Sequence[str]],
                      buckets: Sequence[Sequence[int]], *, chain: bool = False) -> list[Any]:
    """All-gather stored parameter shards along dim 0 over their axes, one collective group per
    bucket (indices into ``shards``, forward order); inside ``shard_map``. A bucket of several
    arrays is built as one collective; ``chain`` (off by default: XLA's CPU pipeline has no
    all-gather combiner that could merge buckets) orders bucket k+1 after bucket k."""
    return bucketed_collective(shards, [tuple(a) for a in axes], buckets, kind="all_gather",
                               chain=chain)


def scatter_gradients(grads: Sequence[Any], axes: Sequence[Sequence[str]],
                      buckets: Sequence[Sequence[int]], *, chain: bool = False,
                      fp32: bool | Sequence[bool] = False) -> list[Any]:
    """Reduce-scatter local gradients along dim 0 over their axes (the shard this device
    updates), one collective group per bucket (built as one collective); bf16/fp16 in fp32
    where ``fp32``. ``chain``: as for :func:`gather_parameters`."""
    return fp32_collective(lambda up: bucketed_collective(
        up, [tuple(a) for a in axes], buckets, kind="reduce_scatter", chain=chain), grads, fp32)


def state_shardings(optimizer: optax.GradientTransformation, state: Any,
                    param_shardings: Any, mesh: Mesh, param_shapes: Any = None) -> Any:
    """Shardings for an optax state: a parameter-mirroring leaf gets its parameter's storage
    sharding when it has the parameter's shape; everything else (step counts, scalars, and
    leaves of another shape such as adafactor's factored row / column statistics) is
    replicated.

    ``param_shapes``: the parameters' shapes (a tree like ``param_shardings`` of shape
    tuples). Without it, a leaf keeps the storage sharding only when that sharding can lay
    the leaf out (its rank, and every split dim divisible by its shard count).

    >>> import jax, numpy as np, optax
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    >>> opt = optax.adafactor(1e-2, min_dim_size_to_factor=2)
    >>> params = {"w": np.ones((4, 4), np.float32)}
    >>> sh = state_shardings(opt, opt.init(params), {"w": NamedSharding(mesh, P("d"))}, mesh,
    ...                      {"w": (4, 4)})
    >>> sorted({str(x.spec) for x in jax.tree.leaves(sh)})
    ['P()']
    """
    rep = NamedSharding(mesh, PartitionSpec())

    def fits(leaf: Any, sharding: Any, shape: Any) -> bool:
        got = tuple(np.shape(leaf))
        if shape is not None:
            return got == tuple(shape)
        spec = tuple(getattr(sharding, "spec", ()))
        if len(spec) > len(got):
            return False
        for n, axes in zip(got, spec):
            names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            if n % math.prod(mesh.shape[a] for a in names):
                return False
        return True

    if param_shapes is None:
        return optax.tree_map_params(
            optimizer, lambda leaf, sh: sh if fits(leaf, sh, None) else rep, state,
            param_shardings, transform_non_params=lambda _: rep)
    def is_shape(x: Any) -> bool:  # a shape tuple (not a tuple of parameters) or a struct
        return isinstance(x, jax.ShapeDtypeStruct) or (
            isinstance(x, tuple) and all(isinstance(i, (int, np.integer)) for i in x))

    shapes = jax.tree_util.tree_map(
        lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(
            tuple(x), np.float32), param_shapes, is_leaf=is_shape)
    return optax.tree_map_params(
        optimizer, lambda leaf, sh, shp: sh if fits(leaf, sh, shp.shape) else rep, state,
        param_shardings, shapes, transform_non_params=lambda _: rep)


def device_bytes(tree: Any, device: Any) -> int:
    """Bytes of ``tree``'s array shards stored on ``device`` (what the device really holds)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total
