"""The parallel optimizer's rule for one parameter: whether ``enable_parallel_optimizer``
shards it, over which shard group, and why (:func:`decide_sharding`, :func:`shard_group`).

The rule, its keys and MindSpore's behaviour are documented in :mod:`autopar.optimizer_shard`,
which applies it to a training step; the search prices the stored copy and optimizer state by
the same decision (:meth:`autopar.strategies.problem.Problem.param_memory`). It lives here,
in the planning layer, so that both read one rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from autopar.strategies.layout import DeviceMesh, TensorLayout

__all__ = ["KB", "ShardDecision", "decide_sharding", "param_shards", "shard_group"]

KB = 1024


@dataclass(frozen=True, slots=True)
class ShardDecision:
    """Whether one parameter is sharded by the parallel optimizer, over which axes, and why.

    ``axes``: sharded, the shard group's axes (reduce-scatter, all-gather, storage); not
    sharded, the parameter's sync axes. ``replicas``: sharded, the sync axes outside the shard
    group (the shard's gradient is all-reduced over them; empty under the default shard size).
    ``fallback``: the note when ``optimizer_weight_shard_size`` could not be applied and the
    whole data-parallel group was used (empty otherwise)."""

    name: str
    sharded: bool
    axes: tuple[str, ...]
    nbytes: int
    reason: str
    replicas: tuple[str, ...] = ()
    fallback: str = ""


def shard_group(sync_axes: Sequence[str], axis_sizes: dict[str, int],
                size: int) -> tuple[str, ...] | None:
    """The axes of a shard group of ``size`` devices among ``sync_axes`` (mesh order), taken
    innermost first: from the last sync axis outward, an axis is taken while its size divides
    what is left of ``size``. ``-1``: every sync axis. ``None`` when the taken sizes do not
    multiply to ``size`` (with prime-size axes: exactly when ``size`` does not divide the
    group size). Returned in mesh order.

    >>> sizes = {"a0": 2, "a1": 2, "a2": 2}
    >>> shard_group(("a0", "a1", "a2"), sizes, 4), shard_group(("a0", "a2"), sizes, 2)
    (('a1', 'a2'), ('a2',))
    >>> shard_group(("a0", "a1"), sizes, 8) is None, shard_group(("a0",), sizes, -1)
    (True, ('a0',))
    """
    axes = tuple(sync_axes)
    if size == -1:
        return axes
    left, taken = size, set()
    for a in reversed(axes):
        n = axis_sizes[a]
        if n > 1 and left % n == 0:
            taken.add(a)
            left //= n
    return tuple(a for a in axes if a in taken) if left == 1 else None


def decide_sharding(name: str, shape: Sequence[int], local_shape: Sequence[int], itemsize: int,
                    sync_axes: Sequence[str], axis_sizes: dict[str, int], *, enabled: bool,
                    threshold_kb: int, shard_size: int = -1) -> ShardDecision:
    """The parallel optimizer's decision for one parameter (rules in the module docstring);
    ``shard_size``: ``optimizer_weight_shard_size`` (-1: the whole data-parallel group).

    >>> decide_sharding("w", (64, 512), (64, 512), 4, ("a0",), {"a0": 8}, enabled=True,
    ...                 threshold_kb=64).sharded
    True
    >>> decide_sharding("b", (512,), (512,), 4, ("a0",), {"a0": 8}, enabled=True,
    ...                 threshold_kb=64).reason
    'smaller than parallel_optimizer_threshold (2 KB < 64 KB)'
    >>> d = decide_sharding("w", (64, 512), (64, 512), 4, ("a0", "a1"), {"a0": 2, "a1": 4},
    ...                     enabled=True, threshold_kb=0, shard_size=4)
    >>> d.axes, d.replicas
    (('a1',), ('a0',))
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
    shard, note = axes, ""
    if shard_size not in (-1, group):
        found = shard_group(axes, axis_sizes, shard_size) if group % shard_size == 0 else None
        if found is None:
            why = (f"is not a product of the sizes of its sync axes {axes}"
                   if group % shard_size == 0 else "does not divide its data-parallel group "
                   f"size {group}")
            note = (f"optimizer_weight_shard_size={shard_size} {why}: sharded over the whole "
                    f"group ({group} devices) instead")
        else:
            shard = found
    ways = math.prod(axis_sizes[a] for a in shard)
    replicas = tuple(a for a in axes if a not in shard)
    suffix = f"; {note}" if note else ""
    if not local_shape or local_shape[0] % ways:
        what = "shard group" if replicas else "data-parallel group"
        return ShardDecision(name, False, axes, nbytes, f"dim 0 of its local block "
                             f"({local_shape[0] if local_shape else 'scalar'}) does not divide "
                             f"by the {what} size {ways}{suffix}", fallback=note)
    copies = f", {group // ways} copies over {replicas}" if replicas else ""
    return ShardDecision(name, True, shard, nbytes, f"sharded {ways} ways over {shard}"
                         f"{copies}{suffix}", replicas, note)


def param_shards(name: str, shape: Sequence[int], itemsize: int, layout: "TensorLayout",
                 mesh: "DeviceMesh", threshold_kb: int | None, shard_size: int = -1
                 ) -> tuple[int, int, bool]:
    """``(local bytes, shard group size, sharded)`` of a parameter stored in ``layout``:
    :func:`decide_sharding` over the mesh axes the layout leaves it replicated on
    (``threshold_kb`` None: the parallel optimizer is off, ``(bytes, 1, False)``). The rule
    the search prices a parameter's memory and update by, and the simulators its update."""
    local = layout.local_shape(tuple(shape), mesh)
    nbytes = math.prod(local) * itemsize
    if threshold_kb is None:
        return nbytes, 1, False
    used = layout.used_axes()
    d = decide_sharding(name, shape, local, itemsize, [a for a in mesh.names if a not in used],
                        mesh.sizes, enabled=True, threshold_kb=threshold_kb,
                        shard_size=shard_size)
    ways = math.prod(mesh.sizes[a] for a in d.axes) if d.sharded else 1
    return nbytes, ways, d.sharded
