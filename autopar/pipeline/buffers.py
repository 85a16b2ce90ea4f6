"""Stage-local buffers of a pipelined step: parameters packed per stage, and boundary buffers.

**Parameters.** On the pipeline mesh ``('stage', a0, a1, ...)`` a device of stage ``s``
holds only stage ``s``'s parameters, and of each only its own block under the stage's plan.
The step keeps them as one flat buffer per dtype, global shape ``[p, D, N]``
(``PartitionSpec('stage', (a0, a1, ...), None)``, ``D = device_num / p``): row ``[s, d]`` is
the concatenation of device ``d``'s local blocks of stage ``s``'s parameters, zero-padded
to ``N`` (the largest stage). Per device this is ``N`` elements: the pipeline's memory
saving, measured from the arrays. Within a stage, parameters are ordered by the mesh axes
over which they are replicated, so each gradient-sync group (the parameters all-reduced
over the same data-parallel axes) is one contiguous slice: one ``psum`` per group.

**Boundaries.** What crosses from stage ``s`` to ``s + 1`` (the activations, and their
gradients backwards) travels as one flat buffer per dtype, padded to the largest boundary,
so every stage's branch of the SPMD program has the same signature.

>>> from autopar.strategies.layout import DeviceMesh, TensorLayout
>>> mesh = DeviceMesh.for_devices(4)
>>> device_block((8, 6), TensorLayout((("a0",), ())), mesh, 3)   # device 3 = (a0=1, a1=1)
(slice(4, 8, None), slice(0, 6, None))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopar.grad_sync import replicated_axes
from autopar.strategies.layout import DeviceMesh, TensorLayout

__all__ = ["PackedParams", "ParamSlot", "Segment", "StagePacking", "device_block",
           "BoundaryCodec", "check_elementwise_optimizer"]


class PackedParams(NamedTuple):
    """A pipelined step's parameters: one ``[p, D, N]`` buffer per dtype (see the module
    docstring). Optax treats it as any pytree; :meth:`PipelineTrainStep.unpack` gives the
    original pytree back."""

    buffers: tuple[jax.Array, ...]


def coords(d: int, mesh: DeviceMesh) -> dict[str, int]:
    """Mesh coordinates of device ``d`` (row-major over the axes)."""
    sizes = [s for _, s in mesh.axes]
    idx = np.unravel_index(d, sizes) if sizes else ()
    return {name: int(i) for (name, _), i in zip(mesh.axes, idx)}


def device_block(shape: Sequence[int], layout: TensorLayout, mesh: DeviceMesh, d: int
                 ) -> tuple[slice, ...]:
    """The block of a tensor that device ``d`` holds under ``layout``."""
    c = coords(d, mesh)
    out = []
    for n, axes in zip(shape, layout.dims):
        k, size = 0, 1
        for a in axes:
            k = k * mesh.sizes[a] + c[a]
            size *= mesh.sizes[a]
        loc = n // size
        out.append(slice(k * loc, (k + 1) * loc))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ParamSlot:
    leaf: int                       # index in the parameter pytree's leaves
    name: str                       # graph value name
    dtype: str
    offset: int                     # in the stage's working buffer of this dtype
    local_shape: tuple[int, ...]
    layout: TensorLayout
    sync_axes: tuple[str, ...]      # intra-stage axes the parameter is replicated over
    sharded: bool = False           # stored sharded by the parallel optimizer

    @property
    def size(self) -> int:
        return int(np.prod(self.local_shape, dtype=np.int64))


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous run of a stage's working buffer synchronised together: all-reduced, or
    (``sharded``) reduce-scattered and stored as ``1 / ways`` per device."""

    start: int
    stop: int
    axes: tuple[str, ...]
    sharded: bool
    ways: int
    store_start: int                # where its shard (or itself) sits in the storage row

    @property
    def padded(self) -> int:
        return -(-(self.stop - self.start) // self.ways) * self.ways

    @property
    def shard(self) -> int:
        return self.padded // self.ways


class StagePacking:
    """Where every parameter leaf lives in the packed buffers.

    The **working** row of a device (what its stage computes with) holds every local block;
    the **storage** row (what the ``[p, D, N]`` buffers keep between steps, and what the
    optimizer updates) equals it except that each sharded segment (parallel optimizer) is
    cut into ``ways`` pieces and the device keeps only its own: gathered at the start of a
    step, its gradient reduce-scattered at the end. Unsharded slots come first, so their
    offsets are the same in both rows.
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str],
                 stage_of: Sequence[int], layouts: Sequence[TensorLayout], names: Sequence[str],
                 stages: int, mesh: DeviceMesh, sharded: Sequence[bool] | None = None) -> None:
        self.stages, self.mesh = stages, mesh
        self.shapes = [tuple(s) for s in shapes]
        self.dtypes = sorted(set(dtypes))
        flags = list(sharded) if sharded is not None else [False] * len(shapes)
        self.slots: list[list[ParamSlot]] = [[] for _ in range(stages)]
        self.segments: list[dict[str, list[Segment]]] = []
        for s in range(stages):
            keyed = []
            for i in (i for i in range(len(shapes)) if stage_of[i] == s):
                sync = replicated_axes(layouts[i], mesh)
                keyed.append((dtypes[i], flags[i] and bool(sync), sync, i))
            offsets = {dt: 0 for dt in self.dtypes}
            for dt, shard, sync, i in sorted(keyed):
                local = layouts[i].local_shape(self.shapes[i], mesh)
                slot = ParamSlot(i, names[i], dt, offsets[dt], tuple(local), layouts[i], sync,
                                 shard)
                offsets[dt] += slot.size
                self.slots[s].append(slot)
            self.segments.append({dt: self._segments(s, dt) for dt in self.dtypes})
        self.sizes = {dt: max([sum(sl.size for sl in self.slots[s] if sl.dtype == dt)
                               for s in range(stages)] + [1]) for dt in self.dtypes}
        self.store_sizes = {dt: max([self.store_len(s, dt) for s in range(stages)] + [1])
                            for dt in self.dtypes}

    def _segments(self, s: int, dt: str) -> list[Segment]:
        segs: list[Segment] = []
        for sl in self.slots[s]:
            if sl.dtype != dt or not sl.sync_axes:
                continue
            last = segs[-1] if segs else None
            if last and (last.axes, last.sharded) == (sl.sync_axes, sl.sharded) \
                    and last.stop == sl.offset:
                segs[-1] = Segment(last.start, sl.offset + sl.size, last.axes, last.sharded,
                                   last.ways, last.store_start)
            else:
                segs.append(Segment(sl.offset, sl.offset + sl.size, sl.sync_axes, sl.sharded,
                                    self.mesh.size_of(sl.sync_axes), sl.offset))
        # shards are stored after the unsharded slots, one after another
        pos = self.plain_len(s, dt)
        out = []
        for g in segs:
            if g.sharded:
                g = Segment(g.start, g.stop, g.axes, True, g.ways, pos)
                pos += g.shard
            out.append(g)
        return out

    def plain_len(self, s: int, dt: str) -> int:
        """Length of the unsharded head of stage s's rows (same in working and storage)."""
        return sum(sl.size for sl in self.slots[s] if sl.dtype == dt and not sl.sharded)

    def store_len(self, s: int, dt: str) -> int:
        return self.plain_len(s, dt) + sum(g.shard for g in self.segments[s][dt] if g.sharded)

    @property
    def any_sharded(self) -> bool:
        return any(sl.sharded for slots in self.slots for sl in slots)

    # ------------------------------------------------------------------ global <-> packed
    def _member(self, d: int, axes: tuple[str, ...], r: int) -> int:
        """The device with ``d``'s coordinates except block ``r`` over ``axes``."""
        c = coords(d, self.mesh)
        for a in reversed(axes):
            c[a] = r % self.mesh.sizes[a]
            r //= self.mesh.sizes[a]
        idx = 0
        for name, size in self.mesh.axes:
            idx = idx * size + c[name]
        return idx

    def _block(self, d: int, axes: tuple[str, ...]) -> int:
        c, k = coords(d, self.mesh), 0
        for a in axes:
            k = k * self.mesh.sizes[a] + c[a]
        return k

    def pack(self, leaves: Sequence[Any]) -> tuple[Any, ...]:
        """Global leaves -> the ``[p, D, N]`` storage buffers (traceable; run it under jit)."""
        d_num = self.mesh.device_num
        out = []
        for dt in self.dtypes:
            rows = []
            for s in range(self.stages):
                per_dev = []
                for d in range(d_num):
                    parts = [jnp.ravel(leaves[sl.leaf][device_block(self.shapes[sl.leaf],
                                                                   sl.layout, self.mesh, d)])
                             for sl in self.slots[s] if sl.dtype == dt]
                    work = jnp.concatenate(parts) if parts else jnp.zeros((0,), dt)
                    store = [work[:self.plain_len(s, dt)]]
                    for g in self.segments[s][dt]:
                        if g.sharded:
                            seg = jnp.pad(work[g.start:g.stop], (0, g.padded - g.stop + g.start))
                            r = self._block(d, g.axes)
                            store.append(seg[r * g.shard:(r + 1) * g.shard])
                    flat = jnp.concatenate(store)
                    per_dev.append(jnp.pad(flat, (0, self.store_sizes[dt] - flat.shape[0])))
                rows.append(jnp.stack(per_dev))
            out.append(jnp.stack(rows).astype(dt))
        return tuple(out)

    def _working_row(self, buf: Any, s: int, d: int, dt: str) -> Any:
        parts = [buf[s, d, :self.plain_len(s, dt)]]
        for g in self.segments[s][dt]:
            if g.sharded:
                full = jnp.concatenate([buf[s, self._member(d, g.axes, r),
                                            g.store_start:g.store_start + g.shard]
                                        for r in range(g.ways)])
                parts.append(full[:g.stop - g.start])
        return jnp.concatenate(parts)

    def unpack(self, buffers: Sequence[Any]) -> list[Any]:
        """The ``[p, D, N]`` storage buffers -> global leaves (each block read from the first
        device holding it)."""
        leaves: list[Any] = [None] * len(self.shapes)
        for k, dt in enumerate(self.dtypes):
            for s in range(self.stages):
                rows: dict[int, Any] = {}
                for sl in self.slots[s]:
                    if sl.dtype != dt:
                        continue
                    full = jnp.zeros(self.shapes[sl.leaf], dt)
                    seen = set()
                    for d in range(self.mesh.device_num):
                        blk = device_block(self.shapes[sl.leaf], sl.layout, self.mesh, d)
                        key = tuple((b.start, b.stop) for b in blk)
                        if key in seen:
                            continue
                        seen.add(key)
                        if d not in rows:
                            rows[d] = self._working_row(buffers[k], s, d, dt)
                        part = rows[d][sl.offset:sl.offset + sl.size].reshape(sl.local_shape)
                        full = full.at[blk].set(part)
                    leaves[sl.leaf] = full
        return leaves

    # ------------------------------------------------------------------ local (in shard_map)
    def local_leaves(self, s: int, flats: dict[str, Any]) -> dict[int, Any]:
        """Stage s's local parameter blocks from this device's working buffers."""
        return {sl.leaf: flats[sl.dtype][sl.offset:sl.offset + sl.size].reshape(sl.local_shape)
                for sl in self.slots[s]}

    def gather(self, s: int, store: dict[str, Any]) -> dict[str, Any]:
        """Storage rows -> working rows on a device of stage s: all-gather every sharded
        segment over its axes (the parallel optimizer's parameter AllGather)."""
        from autopar.optimizer_shard import gather_parameters

        out = {}
        for dt, row in store.items():
            segs = [g for g in self.segments[s][dt] if g.sharded]
            full = gather_parameters([row[g.store_start:g.store_start + g.shard] for g in segs],
                                     [g.axes for g in segs], [[i] for i in range(len(segs))])
            parts = [row[:self.plain_len(s, dt)]] + [f[:g.stop - g.start]
                                                     for f, g in zip(full, segs)]
            flat = jnp.concatenate(parts)
            out[dt] = jnp.pad(flat, (0, self.sizes[dt] - flat.shape[0]))
        return out

    def scatter(self, s: int, dt: str, work: Any, fp32: bool) -> Any:
        """A working-layout gradient -> the storage layout, each sharded segment
        reduce-scattered over its axes (its unsharded head is returned as it is)."""
        from autopar.optimizer_shard import scatter_gradients

        segs = [g for g in self.segments[s][dt] if g.sharded]
        pieces = scatter_gradients([jnp.pad(work[g.start:g.stop],
                                            (0, g.padded - g.stop + g.start)) for g in segs],
                                   [g.axes for g in segs], [[i] for i in range(len(segs))],
                                   fp32=fp32)
        flat = jnp.concatenate([work[:self.plain_len(s, dt)]] + list(pieces))
        return jnp.pad(flat, (0, self.store_sizes[dt] - flat.shape[0]))


class BoundaryCodec:
    """Flatten named local arrays into one padded buffer per dtype, and back."""

    def __init__(self, per_boundary: Sequence[Sequence[tuple[str, tuple[int, ...], str]]]
                 ) -> None:
        self.per_boundary = [list(b) for b in per_boundary]
        dts = sorted({dt for b in self.per_boundary for _, _, dt in b})
        self.dtypes = dts or ["float32"]
        self.sizes = {dt: max([sum(int(np.prod(sh, dtype=np.int64)) for _, sh, t in b
                                   if t == dt) for b in self.per_boundary] + [1])
                      for dt in self.dtypes}

    def zeros(self) -> dict[str, Any]:
        return {dt: jnp.zeros((n,), dt) for dt, n in self.sizes.items()}

    def encode(self, b: int, values: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for dt in self.dtypes:
            parts = [jnp.ravel(values[name]).astype(dt) for name, _, t in self.per_boundary[b]
                     if t == dt]
            flat = jnp.concatenate(parts) if parts else jnp.zeros((0,), dt)
            out[dt] = jnp.pad(flat, (0, self.sizes[dt] - flat.shape[0]))
        return out

    def decode(self, b: int, bufs: dict[str, Any]) -> dict[str, Any]:
        out, offs = {}, {dt: 0 for dt in self.dtypes}
        for name, shape, dt in self.per_boundary[b]:
            n = int(np.prod(shape, dtype=np.int64))
            out[name] = bufs[dt][offs[dt]:offs[dt] + n].reshape(shape)
            offs[dt] += n
        return out


def check_elementwise_optimizer(optimizer: Any, n_buffers: int, lead: tuple[int, ...]) -> None:
    """Refuse an optimizer whose update of one element depends on other elements.

    A pipelined step runs the optimizer on the packed ``[p, D, N]`` buffers, not on the
    parameter pytree: an update must depend only on the same element's gradient, parameter
    and state (SGD, momentum, Adam, AdamW, RMSProp, ...). A transform that reduces over a
    parameter or over all of them (``clip_by_global_norm``, LAMB / LARS trust ratios,
    adafactor's factoring and RMS clipping) would see the packed layout, the zero padding and
    the ``D`` copies of replicated parameters and silently give a different answer.

    The probe (a few eager optax calls on tiny buffers of shape ``lead + (k,)``): two steps on
    buffers ``a``, on ``b`` and on ``concat(a, b)`` (last axis), with gradients large enough
    to trigger any clipping; an elementwise optimizer gives ``concat(update(a), update(b))``.

    >>> import optax
    >>> check_elementwise_optimizer(optax.adam(1e-3), 1, (2, 2))
    >>> check_elementwise_optimizer(optax.chain(optax.clip_by_global_norm(1.0),
    ...     optax.sgd(1.0)), 1, (2, 2))  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    autopar.errors.AutoParallelError: ...
    """
    from autopar.errors import AutoParallelError

    rng = np.random.default_rng(0)
    ka, kb = 3, 5
    shape = tuple(lead)

    def draw(k: int, scale: float) -> list[Any]:
        return [rng.standard_normal(shape + (k,)).astype(np.float32) * scale
                for _ in range(n_buffers)]

    pa, pb = draw(ka, 1.0), draw(kb, 1.0)
    ga = [draw(ka, 1e12) for _ in range(2)]
    gb = [draw(kb, 1e12) for _ in range(2)]
    cat = lambda x, y: [np.concatenate([u, v], axis=-1) for u, v in zip(x, y)]  # noqa: E731
    try:
        ua, ub = _probe_updates(optimizer, pa, ga), _probe_updates(optimizer, pb, gb)
        uab = _probe_updates(optimizer, cat(pa, pb), [cat(x, y) for x, y in zip(ga, gb)])
    except Exception as e:  # noqa: BLE001 - the user's optimizer: report any failure typed
        raise AutoParallelError("optimizer", type(optimizer).__name__, "fails on the packed "
                                f"parameter buffers of a pipelined step ({type(e).__name__}: "
                                f"{e})", "Use an elementwise optax optimizer (sgd, adam, "
                                "adamw, rmsprop, ...)") from e
    for x, y, z in zip(ua, ub, uab):
        if not _same_updates(np.concatenate([x, y], axis=-1), z):
            raise AutoParallelError("optimizer", type(optimizer).__name__, "is not elementwise "
                                    "(an update depends on other elements, e.g. "
                                    "clip_by_global_norm, LAMB/LARS, adafactor, a norm "
                                    "or a mask over the parameter tree): a pipelined step "
                                    "applies it to packed [p, D, N] buffers and would "
                                    "silently compute a different update",
                                    "Use an elementwise optax optimizer (sgd, adam, adamw, "
                                    "rmsprop, ...), or autopar.train_step without "
                                    "pipeline_stages")


def _probe_updates(optimizer: Any, params: list[Any], grads: list[list[Any]]
                   ) -> list[np.ndarray]:
    """The updates of ``len(grads)`` eager optimizer steps on packed buffers ``params``."""
    import optax

    pp = PackedParams(tuple(jnp.asarray(x) for x in params))
    state = optimizer.init(pp)
    out: list[np.ndarray] = []
    for g in grads:
        upd, state = optimizer.update(PackedParams(tuple(jnp.asarray(x) for x in g)),
                                      state, pp)
        pp = optax.apply_updates(pp, upd)
        out += [np.asarray(u, np.float64) for u in upd.buffers]
    return out


def _same_updates(want: np.ndarray, got: np.ndarray) -> bool:
    """``got`` equals ``want`` (shape, then values to 1e-4 of the largest)."""
    tol = 1e-4 * float(np.max(np.abs(want), initial=0.0)) + 1e-30
    return want.shape == got.shape and bool(np.allclose(want, got, rtol=1e-4, atol=tol,
                                                        equal_nan=True))
