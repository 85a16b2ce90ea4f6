"""Bucketed gradient synchronisation inside ``jax.shard_map``: one collective per bucket.

A training step computes each device's local gradients with ``jax.vjp`` inside the
``shard_map`` program; a gradient is *partial* over the mesh axes on which its parameter is
replicated (:func:`replicated_axes`: the data-parallel axes of that parameter, plus any axis
its computation is repeated on, less those over which the training step finds it the same on
every device, :mod:`autopar.cotangents`; what is left are its **sync axes**) and must be summed
over them. :func:`sync_gradients` does that
sum in the buckets of :mod:`autopar.fusion`:

- **one collective per bucket and sync-axes group.** A bucket is a contiguous run of the
  backward order; inside it, gradients are grouped by their sync axes (first appearance
  first), because one collective runs over one device group: gradients with different sync
  axes can never share an AllReduce. Under pure data parallelism every gradient has the same
  axes and a bucket is one collective. Gradients with no sync axes (split over every axis)
  need no communication and are skipped.
- ``method="tuple"`` (default): ``lax.psum`` over the tuple of the group's arrays. JAX lowers
  that to one ``stablehlo.all_reduce`` per array; XLA's all-reduce combiner merges the
  independent ones into ONE tuple all-reduce in the compiled program. Measured fastest on this
  backend (no copies). ``method="concat"``: flatten + concatenate, one ``psum``, slice back:
  one ``stablehlo.all_reduce`` per group already in the lowered text, at the price of the
  copies (about 2x slower on CPU; ``benchmarks/bench_fusion.py``).
- ``chain=True``: every array of group k+1 takes a data dependency on every result of group
  k, so XLA's combiner (which merges all-reduces that do not depend on each other) cannot merge
  two configured buckets back into one; ``lax.optimization_barrier`` cannot do this, XLA's CPU
  pipeline removes it before the combiner runs. The dependency is ``x + d`` with
  ``d = sum_j min(|s_j|, 0)`` over one element ``s_j`` of each previous result: exact (adds
  0.0) unless some ``s_j`` is NaN, in which case the gradients are NaN already. It costs one
  elementwise pass per array (XLA fuses it into the producer where it can). The training
  step instead places :func:`sync_point` s in backward, where the dependency goes on the
  activation cotangents (one pass per bucket, not per gradient) and also orders the
  collective before the backward of earlier layers. Without ``chain``, XLA merges all
  independent all-reduces into one.

The same bucketing serves the parallel optimizer's reduce-scatters and all-gathers
(:mod:`autopar.optimizer_shard`): :func:`bucketed_collective` takes the collective kind.

Reusable API (for steps that build their own ``shard_map``; the pipelined step does not use
it: it sums each stage's contiguous gradient-sync groups with one ``lax.psum`` apiece and
ignores ``comm_fusion``)::

    sync_gradients(grads, sync_axes, buckets, *, method="tuple", chain=True,
                   fp32=False) -> list[Array]

The rules every training step (``train_step``, its pmap path, the pipelined step, the
parallel optimizer) shares: :func:`replicated_axes` (a parameter's sync axes),
:func:`data_parallel_degree` and :func:`gradient_scale` (gradients_mean /
loss_repeated_mean), :func:`fp32_sync_active` and :func:`fp32_collective`
(gradient_fp32_sync).

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jax.sharding import Mesh, PartitionSpec as P
>>> mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
>>> def body(a, b):
...     return tuple(sync_gradients([a, b], [("d",), ("d",)], [[0, 1]]))
>>> f = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(P(), P()),
...                   check_vma=False)
>>> [x.tolist() for x in f(jnp.arange(2.0), jnp.ones(2))]
[[1.0], [2.0]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autopar.collectives import all_gather_dim, psum_scatter_dim
from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.graph.prng import is_key
from autopar.graph.remat import spans
from autopar.strategies.layout import DeviceMesh, TensorLayout, axis_name
from autopar.strategies.precision import LOW_PRECISION, fp32_sync_active
from autopar.strategies.redistribution import STEP_KINDS

__all__ = ["SyncGroup", "sync_groups", "sync_gradients", "bucketed_collective",
           "bucket_indices", "sync_point", "sync_sites", "replicated_axes",
           "data_parallel_degree", "gradient_scale", "fp32_sync_active", "fp32_collective",
           "METHODS", "KINDS", "LOW_PRECISION"]

METHODS = ("tuple", "concat")
#: collective kinds of :func:`bucketed_collective`: those a ``comm_fusion`` key buckets
KINDS = tuple(k for k, r in STEP_KINDS.items() if r.comm_fusion)


def replicated_axes(layout: TensorLayout, mesh: DeviceMesh) -> tuple[str, ...]:
    """The sync axes of a parameter laid out as ``layout``: the mesh axes (in mesh order, of
    size > 1) it is not split over, so that its gradient is partial over them and must be
    summed over them.

    >>> mesh = DeviceMesh((("a0", 2), ("a1", 1), ("a2", 4)))
    >>> replicated_axes(TensorLayout((("a2",), ())), mesh)
    ('a0',)
    """
    if not isinstance(layout, TensorLayout):
        raise AutoParallelTypeError("layout", layout, "an autopar TensorLayout")
    if not isinstance(mesh, DeviceMesh):
        raise AutoParallelTypeError("mesh", mesh, "an autopar DeviceMesh")
    used = layout.used_axes()
    return tuple(a for a in mesh.names if a not in used and mesh.sizes[a] > 1)


def data_parallel_degree(values: Sequence[Any], mesh: DeviceMesh) -> int:
    """The data-parallel degree of a step: the most pieces dim 0 of any batch input (a
    ``PValue`` of ``values``; scalars ignored) is split into over ``mesh``; 1 if none is."""
    return max([mesh.size_of(v.layout.dims[0]) for v in values if v.spec.shape] + [1])


def gradient_scale(dp: int, devices: int, *, gradients_mean: bool,
                   loss_repeated_mean: bool) -> float:
    """The factor a step multiplies its synchronised gradients by, relative to the gradient
    of the global loss: ``dp`` (the data-parallel degree) unless ``gradients_mean``, times
    the repeat count ``max(1, devices // dp)`` unless ``loss_repeated_mean``.

    >>> gradient_scale(4, 8, gradients_mean=False, loss_repeated_mean=False)
    8.0
    >>> gradient_scale(4, 8, gradients_mean=True, loss_repeated_mean=True)
    1.0
    """
    for key, n in (("dp", dp), ("devices", devices)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise AutoParallelTypeError(key, n, "must be an int")
        if n < 1:
            raise AutoParallelError(key, n, "must be >= 1")
    repeat = max(1, devices // dp)
    return float((1 if gradients_mean else dp) * (1 if loss_repeated_mean else repeat))


def fp32_collective(collective: Callable[[list[Any]], list[Any]], xs: Sequence[Any],
                    fp32: bool | Sequence[bool]) -> list[Any]:
    """``collective(xs)`` with every bf16 / fp16 array whose flag is set cast to float32
    before it and every result cast back to its input's dtype (gradient_fp32_sync).
    ``fp32``: one flag per array, or one for all.

    >>> seen = []
    >>> out = fp32_collective(lambda xs: seen.extend(a.dtype for a in xs) or xs,
    ...                       [jnp.ones(2, jnp.bfloat16)], True)
    >>> str(seen[0]), str(out[0].dtype)
    ('float32', 'bfloat16')
    """
    xs = list(xs)
    flags = [bool(fp32)] * len(xs) if isinstance(fp32, bool) else [bool(f) for f in fp32]
    if len(flags) != len(xs):
        raise AutoParallelError("fp32", len(flags), f"needs one flag per gradient "
                                f"({len(xs)})")
    up = [x.astype(jnp.float32) if f and str(x.dtype) in LOW_PRECISION else x
          for x, f in zip(xs, flags)]
    return [o.astype(x.dtype) for o, x in zip(collective(up), xs)]


@dataclass(frozen=True, slots=True)
class SyncGroup:
    """One collective: the gradients ``members`` (indices into the gradient list) of bucket
    ``bucket``, all over the mesh axes ``axes``."""

    bucket: int
    members: tuple[int, ...]
    axes: tuple[str, ...]


def bucket_indices(order: Sequence[str], buckets: Any) -> list[list[int]]:
    """Buckets of names (a :class:`~autopar.fusion.GradientBuckets` or lists of names) as
    lists of indices into ``order``.

    >>> bucket_indices(["a", "b", "c"], [["c"], ["a", "b"]])
    [[2], [0, 1]]
    """
    pos = {n: i for i, n in enumerate(order)}
    out = []
    for b in buckets:
        names = getattr(b, "gradients", b)
        try:
            out.append([pos[n] for n in names])
        except KeyError as e:
            raise AutoParallelError("buckets", str(e), "names a gradient that is not in the "
                                    "gradient list") from None
    return out


def sync_groups(sync_axes: Sequence[tuple[str, ...] | None], buckets: Sequence[Sequence[int]]) \
        -> tuple[SyncGroup, ...]:
    """Split every bucket into one group per distinct sync axes (first appearance first),
    dropping gradients with no sync axes. Every gradient must be in exactly one bucket.

    >>> [(g.bucket, g.members, g.axes) for g in sync_groups([("a",), ("a", "b"), ("a",), ()],
    ...                                                    [[0, 1, 2], [3]])]
    [(0, (0, 2), ('a',)), (0, (1,), ('a', 'b'))]
    """
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, (list, tuple)):
        raise AutoParallelTypeError("buckets", buckets, "a list of lists of gradient indices")
    n = len(sync_axes)
    seen: set[int] = set()
    groups: list[SyncGroup] = []
    for k, bucket in enumerate(buckets):
        if isinstance(bucket, (str, bytes)) or not isinstance(bucket, (list, tuple)):
            raise AutoParallelTypeError("buckets", bucket, "each bucket is a list of indices")
        by_axes: dict[tuple[str, ...], list[int]] = {}
        for i in bucket:
            if isinstance(i, bool) or not isinstance(i, int):
                raise AutoParallelTypeError("buckets", i, "gradient indices are ints")
            if not 0 <= i < n or i in seen:
                raise AutoParallelError("buckets", i, f"each index in [0, {n}) must appear "
                                        f"in exactly one bucket")
            seen.add(i)
            axes = tuple(sync_axes[i] or ())
            if axes:
                by_axes.setdefault(axes, []).append(i)
        groups.extend(SyncGroup(k, tuple(m), a) for a, m in by_axes.items())
    if len(seen) != n:
        missing = sorted(set(range(n)) - seen)
        raise AutoParallelError("buckets", missing, "these gradients are in no bucket")
    return tuple(groups)


def _dependency(prev: Sequence[Any], like: Any) -> Any:
    """A zero of ``like``'s dtype that XLA cannot prove independent of any array of ``prev``
    (one element of each, ``min(|s|, 0)`` summed: scalars only)."""
    dep = jnp.zeros((), jnp.float32)
    for p in prev:
        if p.size:
            s = jnp.ravel(p)[0].astype(jnp.float32)
            dep = dep + jnp.minimum(jnp.abs(s), 0.0)
    return dep.astype(like.dtype)


def _collective(xs: list[Any], kind: str, axes: tuple[str, ...], method: str,
                dim: int) -> list[Any]:
    """One group's collective. all_reduce: tuple psum (``method="tuple"``) or one psum of the
    concatenation; reduce_scatter / all_gather of several arrays: always one collective over
    the arrays laid side by side as ``(group, -1)`` blocks (XLA's CPU pipeline has no
    combiner for them, so a bucket is one collective only if it is built as one)."""
    name = axis_name(axes)
    size = lax.psum(1, name) if kind != "all_reduce" else 1
    if kind == "all_reduce":
        if method == "concat" and len(xs) > 1:
            dtype = jnp.result_type(*xs)
            flat = jnp.concatenate([jnp.ravel(x).astype(dtype) for x in xs])
            red = lax.psum(flat, name)
            out, start = [], 0
            for x in xs:
                out.append(lax.reshape(lax.slice(red, (start,), (start + x.size,)),
                                       x.shape).astype(x.dtype))
                start += x.size
            return out
        return list(lax.psum(tuple(xs), name))
    if len(xs) > 1 and dim == 0:  # one collective: each array as (group, -1), side by side
        dtype = jnp.result_type(*xs)
        scatter = kind == "reduce_scatter"
        cols = [x.reshape(size if scatter else 1, -1).astype(dtype) for x in xs]
        flat = jnp.concatenate(cols, axis=1)
        res = lax.psum_scatter(flat, name, scatter_dimension=0, tiled=True) if scatter \
            else lax.all_gather(flat, name, axis=0, tiled=True)
        out, start = [], 0
        for x, c in zip(xs, cols):
            w = c.shape[1]
            lead = x.shape[0] // size if scatter else x.shape[0] * size
            out.append(res[:, start:start + w].reshape((lead,) + x.shape[1:]).astype(x.dtype))
            start += w
        return out
    if kind == "reduce_scatter":
        return [psum_scatter_dim(x, name, dim, size) for x in xs]
    return [all_gather_dim(x, name, dim) for x in xs]


def bucketed_collective(xs: Sequence[Any], axes: Sequence[tuple[str, ...] | None],
                        buckets: Sequence[Sequence[int]], *, kind: str = "all_reduce",
                        method: str = "tuple", chain: bool = True, dim: int = 0) -> list[Any]:
    """``kind`` (all_reduce / reduce_scatter / all_gather, the last two tiled along ``dim``)
    of every array over its axes, one collective group per bucket and axes; inside
    ``shard_map``. Arrays with no axes are returned unchanged. See the module docstring."""
    if kind not in KINDS:
        raise AutoParallelError("kind", kind, f"must be one of {list(KINDS)}")
    if method not in METHODS:
        raise AutoParallelError("method", method, f"must be one of {list(METHODS)}")
    xs = list(xs)
    if len(axes) != len(xs):
        raise AutoParallelError("sync_axes", len(axes), f"needs one entry per array "
                                f"({len(xs)})")
    out = list(xs)
    prev: list[Any] | None = None
    for group in sync_groups(axes, buckets):
        part = [xs[i] for i in group.members]
        if chain and prev is not None:  # every member: XLA combines independent ones
            part = [x + _dependency(prev, x) for x in part]
        res = _collective(part, kind, group.axes, method, dim)
        for i, r in zip(group.members, res):
            out[i] = r
        prev = res
    return out


def sync_gradients(grads: Sequence[Any], sync_axes: Sequence[tuple[str, ...] | None],
                   buckets: Sequence[Sequence[int]], *, method: str = "tuple",
                   chain: bool = True, fp32: bool | Sequence[bool] = False) -> list[Any]:
    """Sum every local gradient over its sync axes, one AllReduce per bucket and axes group.

    ``grads``: local gradients (inside ``shard_map``); ``sync_axes[i]``: the mesh axes where
    gradient i's parameter is replicated (empty / None: nothing to do); ``buckets``: lists of
    indices into ``grads`` in the order the collectives are issued (backward order), e.g.
    ``bucket_indices(names, autopar.simulation.gradient_buckets(...))``. ``fp32``: per gradient (or
    for all), bf16 / fp16 gradients are summed in fp32 and cast back (gradient_fp32_sync).
    ``method`` / ``chain``: see the module docstring. Returns the synchronised gradients in
    the order of ``grads``.
    """
    return fp32_collective(lambda up: bucketed_collective(
        up, sync_axes, buckets, kind="all_reduce", method=method, chain=chain), grads, fp32)


def sync_point(sync: Callable[[list[Any]], list[Any]]) -> Callable[..., tuple[Any, Any]]:
    """An identity ``(params, acts) -> (params, acts)`` whose backward synchronises the
    cotangents of ``params`` with ``sync`` as soon as they are complete.

    Put it in forward just before the first use of a bucket's parameters, with ``acts`` the
    activations live across that point: in backward, the cotangents of ``params`` are then
    complete (every use is behind), ``sync`` runs on them, and the cotangents of ``acts``
    take a zero data dependency on the result (``+ min(|s|, 0)``), so everything backward does
    for earlier layers -- including the next bucket's gradients -- comes after this
    collective: XLA issues it at once (overlapping the rest of backward on hardware with
    asynchronous collectives) and its combiner cannot merge two buckets.
    """

    @jax.custom_vjp
    def point(params: tuple[Any, ...], acts: tuple[Any, ...]) -> tuple[Any, Any]:
        return params, acts

    def fwd(params: tuple[Any, ...], acts: tuple[Any, ...]) -> tuple[Any, None]:
        return (params, acts), None

    def bwd(_: None, ct: tuple[Any, Any]) -> tuple[Any, Any]:
        ct_p, ct_a = ct
        done = sync(list(ct_p))
        ct_a = tuple(a + _dependency(done, a) for a in ct_a)
        return tuple(done), ct_a

    point.defvjp(fwd, bwd)
    return point


def sync_sites(pg: Any, buckets: Sequence[Sequence[int]]) \
        -> dict[int, list[tuple[int, tuple[str, ...]]]]:
    """Where each bucket's :func:`sync_point` goes in a ParallelGraph: node index of the first
    use of any of its parameters (``buckets`` hold indices into ``pg.inputs``; inside a
    ``jax.checkpoint`` region, the region's first node) ->
    ``[(bucket, activations live across that node)]``, later buckets first (their points
    are applied first in forward, so their backward runs last). Live activations: values
    produced before the node and read at or after it, floating point, not inputs."""
    index = {v: i for i, v in enumerate(pg.inputs)}
    producer: dict[str, int] = {}
    last_use: dict[str, int] = {}
    first_use: dict[int, int] = {}
    for i, node in enumerate(pg.nodes):
        for v in node.inputs:
            last_use[v] = i
            if v in index:
                first_use.setdefault(index[v], i)
        for v in node.outputs:
            producer[v] = i
    starts = {k: i for i, end in spans(pg.nodes).items() for k in range(i, end)}
    sites: dict[int, list[tuple[int, tuple[str, ...]]]] = {}
    for k, members in enumerate(buckets):
        uses = [first_use[m] for m in members if m in first_use]
        if not uses:
            continue
        at = min(uses)
        at = starts.get(at, at)  # (inside a recomputation region: at its start)
        live = tuple(v for v, j in producer.items() if j < at and last_use.get(v, -1) >= at
                     and not is_key(pg.values[v].spec.dtype)  # (keys: no NumPy dtype)
                     and np.dtype(pg.values[v].spec.dtype).kind in "fc")
        sites.setdefault(at, []).append((k, live))
    return {i: sorted(s, reverse=True) for i, s in sites.items()}
