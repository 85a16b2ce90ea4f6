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
- dim 0 of its local block divides by the size of that group (MindSpore shards dim 0 too).

A sharded parameter is **stored** split along dim 0 over its layout's dim-0 axes followed by its
sync axes (:func:`storage_spec`): between steps each device holds ``1 / dp`` of it and of its
optimizer state (optax's state leaves mirror the parameter tree; :func:`state_shardings` maps the
storage layout onto them with ``optax.tree_map_params``). One step:

1. **all-gather** the sharded parameters over their sync axes at the start of the step (in
   forward order, bucketed by ``comm_fusion["allgather"]``);
2. forward and backward on the whole parameters;
3. **reduce-scatter** their gradients over the sync axes (in backward order, bucketed by
   ``comm_fusion["reducescatter"]``) instead of all-reducing them; the rest are all-reduced in
   the ``comm_fusion["allreduce"]`` buckets;
4. the optax update runs on the stored shards (outside the ``shard_map``, so optimizers with
   global reductions such as ``clip_by_global_norm`` stay exact: XLA adds the scalar
   all-reduce), and the new parameters stay sharded.

``gradient_accumulation_shard`` (with ``grad_accumulation_step > 1``): True (default) reduce-
scatters each micro-step's gradients and accumulates the shards (less memory, one
reduce-scatter per micro-step); False accumulates whole local gradients and reduce-scatters
once after the last micro-step.

``optimizer_weight_shard_size`` (a later MindSpore key) is not in seed 002 and not accepted by
autopar's context: the shard group is always the parameter's whole data-parallel group.

Reusable API (a pipelined step calls it inside its ``shard_map``)::

    gather_parameters(shards, axes, buckets, *, chain=False) -> list[Array]
    scatter_gradients(grads, axes, buckets, *, chain=False, fp32=False) -> list[Array]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.grad_sync import bucketed_collective, fp32_collective

__all__ = ["ShardDecision", "decide_sharding", "storage_spec", "gather_parameters",
           "scatter_gradients", "state_shardings", "device_bytes"]

KB = 1024


@dataclass(frozen=True, slots=True)
class ShardDecision:
    """Whether one parameter is sharded by the parallel optimizer, over which axes, and why."""

    name: str
    sharded: bool
    axes: tuple[str, ...]
    nbytes: int
    reason: str


def decide_sharding(name: str, shape: Sequence[int], local_shape: Sequence[int], itemsize: int,
                    sync_axes: Sequence[str], axis_sizes: dict[str, int], *, enabled: bool,
                    threshold_kb: int) -> ShardDecision:
    """The parallel optimizer's decision for one parameter (rules in the module docstring).

    >>> decide_sharding("w", (64, 512), (64, 512), 4, ("a0",), {"a0": 8}, enabled=True,
    ...                 threshold_kb=64).sharded
    True
    >>> decide_sharding("b", (512,), (512,), 4, ("a0",), {"a0": 8}, enabled=True,
    ...                 threshold_kb=64).reason
    'smaller than parallel_optimizer_threshold (2 KB < 64 KB)'
    """
    nbytes = math.prod(shape) * itemsize
    axes = tuple(sync_axes)
    if not enabled:
        return ShardDecision(name, False, axes, nbytes, "enable_parallel_optimizer is False")
    if nbytes < threshold_kb * KB:
        return ShardDecision(name, False, axes, nbytes, f"smaller than "
                             f"parallel_optimizer_threshold ({nbytes / KB:g} KB < "
                             f"{threshold_kb} KB)")
    if not axes:
        return ShardDecision(name, False, axes, nbytes, "split over every mesh axis: no "
                             "data-parallel group to shard over")
    group = math.prod(axis_sizes[a] for a in axes)
    if not local_shape or local_shape[0] % group:
        return ShardDecision(name, False, axes, nbytes, f"dim 0 of its local block "
                             f"({local_shape[0] if local_shape else 'scalar'}) does not divide "
                             f"by the data-parallel group size {group}")
    return ShardDecision(name, True, axes, nbytes, f"sharded {group} ways over {axes}")


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
