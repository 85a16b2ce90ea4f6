"""Fused matmul + reduce-scatter as a ring pipeline over one mesh axis.

Use inside ``jax.shard_map``. Every device of the axis holds a slice of the contraction
dimension: ``x`` of shape ``(m, k_local)`` and ``w`` of shape ``(k_local, n)``. The full
product ``sum_over_devices(x @ w)`` has shape ``(m, n)``; device ``i`` receives row block
``i`` of it, ``(m / p, n)`` -- exactly ``lax.psum_scatter(x @ w, axis_name,
scatter_dimension=0, tiled=True)`` -- plus ``bias`` added once.

How the ring works (``p`` devices, row blocks ``B_0 .. B_{p-1}`` of ``m / p`` rows each).
An accumulator for block ``b`` starts on device ``b + 1``, moves one hop to the right per
step (``lax.ppermute``) and picks up each device's partial product ``x[B_b] @ w`` on the
way, so after ``p - 1`` hops it lands, complete, on device ``b``. At step ``s`` device
``i`` therefore works on block ``(i - 1 - s) mod p``. The partial product of the block
that travels next does not depend on the accumulator in flight, so XLA is free to run the
matmul while the ``collective-permute`` moves the previous accumulator::

    step 0:  acc = x[B_{i-1}] @ w
    step s:  acc = ppermute(acc, i -> i+1) + x[B_{i-1-s}] @ w     (s = 1 .. p-1)
    result:  acc (+ bias)                                          == block i of the sum

The bidirectional variant collects each block from both sides: an accumulator for block
``b`` starts ``ceil((p - 1) / 2)`` devices to its left and travels right, a second one
starts the remaining ``floor((p - 1) / 2)`` devices to its right and travels left, and the
owner adds the two and its own partial product. Every device still sends ``p - 1``
accumulators (one ``collective-permute`` each), but both directions of every link carry
traffic at once, so the ring finishes in ``ceil((p - 1) / 2)`` rounds instead of ``p - 1``
(half the latency; on a full-duplex ring, half the time when the link is the bottleneck).

``chunks`` trades overlap for matmul efficiency without changing the communication: the
``p`` partial products of a ring are computed in ``chunks`` matmuls (default ``p``, one per
block as above; ``1``: the whole local ``x @ w`` first, each step then reads its block
with a dynamic slice fused into the add). Where a transfer cannot overlap a matmul anyway
-- 8 emulated devices on 2 CPU cores -- fewer, taller matmuls are simply cheaper.

Partial products are computed with ``preferred_element_type=float32`` (for fp16/bf16/fp32
inputs), accumulators travel in fp32 and the result is cast back to the input dtype once.

Worked example (4 devices, m=8, k_local=3, n=5)::

    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
    ...                      devices=jax.devices()[:4])
    >>> f = jax.shard_map(lambda x, w: mm_reduce_scatter(x, w, "tp"), mesh=mesh,
    ...                   in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
    >>> x = jnp.ones((8, 12)); w = jnp.ones((12, 5))      # global: k = 4 * 3
    >>> y = f(x, w); y.shape, float(y[0, 0])              # rows 0-1 on device 0, ...
    ((8, 5), 12.0)

Each device received its ``(2, 5)`` block of ``x @ w``: three ``collective-permute`` ops
moved ``(2, 5)`` fp32 accumulators and no all-reduce or reduce-scatter was issued.
"""

from __future__ import annotations

from typing import Any, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autopar.errors import AutoParallelError, AutoParallelTypeError

__all__ = ["mm_reduce_scatter"]

AxisName = Hashable | tuple[Hashable, ...]


# --------------------------------------------------------------------------- helpers
# (shared with all_gather_matmul.py; private to the package)

def axis_size(axis_name: AxisName, key: str = "axis_name") -> int:
    """Size of a mesh axis (or tuple of axes) of the enclosing ``shard_map``.

    Raises :class:`AutoParallelError` naming ``key`` when the axis is not bound, e.g. when
    a kernel is called outside ``jax.shard_map``.
    """
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise AutoParallelError(
            key, axis_name, "must name a mesh axis of the enclosing jax.shard_map",
            f"call the kernel inside jax.shard_map over a mesh with that axis ({e})") from None


def check_array(key: str, value: Any, ndim: int | None = None) -> None:
    """TypeError unless ``value`` is an array (jax, numpy or tracer) of ``ndim`` dims."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise AutoParallelTypeError(key, value, "must be a jax or numpy array")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise AutoParallelTypeError(key, value.dtype, "dtype must be a floating type "
                                    "(float32, bfloat16 or float16)")
    if ndim is not None and len(value.shape) != ndim:
        raise AutoParallelError(f"{key}.shape", tuple(value.shape), f"must have {ndim} dims")


def acc_dtype(dtype: Any) -> np.dtype:
    """Accumulation dtype: float32 for 16/32-bit floats, the dtype itself when wider."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize <= 4 else dtype


def ring_perm(p: int, shift: int) -> list[tuple[int, int]]:
    """Source->target pairs of a ring shift: device j sends to (j + shift) mod p."""
    return [(j, (j + shift) % p) for j in range(p)]


def block_start(index: jax.Array, offset: int, p: int, size: int) -> jax.Array:
    """Row offset ``((index + offset) mod p) * size`` for a non-negative traced index."""
    return lax.rem(index + (offset % p), p) * size


def check_flag(key: str, value: Any) -> bool:
    """A kernel's on/off option: a bool (``"no"`` or None is not read as a choice)."""
    if not isinstance(value, (bool, np.bool_)):
        raise AutoParallelTypeError(key, value, "must be a bool")
    return bool(value)


def check_chunks(chunks: int | None, p: int) -> int:
    """Number of matmuls per ring: a divisor of ``p`` (default ``p``, one per block)."""
    if chunks is None:
        return p
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)):
        raise AutoParallelTypeError("chunks", chunks, "must be an int or None")
    if chunks < 1 or p % int(chunks):
        raise AutoParallelError("chunks", chunks,
                                f"must be a divisor of the axis size {p}",
                                f"use one of {[d for d in range(1, p + 1) if p % d == 0]}")
    return int(chunks)


# --------------------------------------------------------------------------- kernel

def _validate(x: Any, w: Any, bias: Any, p: int) -> None:
    check_array("x", x, 2)
    check_array("w", w, 2)
    if w.dtype != x.dtype:
        raise AutoParallelTypeError("w", w.dtype, f"dtype must equal x.dtype ({x.dtype})",
                                    "cast both operands to one dtype")
    m, k = x.shape
    if w.shape[0] != k:
        raise AutoParallelError("w.shape", tuple(w.shape),
                                f"first dim must equal x.shape[1] = {k} (the local k)")
    if m % p:
        raise AutoParallelError("x.shape", tuple(x.shape),
                                f"rows m={m} must be divisible by the axis size {p}")
    if bias is not None:
        check_array("bias", bias, 1)
        if bias.shape[0] != w.shape[1]:
            raise AutoParallelError("bias.shape", tuple(bias.shape),
                                    f"must be (n,) = ({w.shape[1]},)")


def ring_hops(p: int, bidirectional: bool) -> tuple[int, int]:
    """Hops ``(right, left)`` a ring's blocks travel: ``(p - 1, 0)`` one way; both ways
    ``ceil((p - 1) / 2)`` to the right and the rest to the left, ``p - 1`` in all."""
    if not bidirectional:
        return p - 1, 0
    right = p // 2
    return right, p - 1 - right


class _Partials:
    """Partial products ``x[B_b] @ w`` in the order a ring uses them.

    ``offsets[j]`` is the block of use ``j`` relative to this device: block
    ``(axis_index + offsets[j]) mod p``. ``q`` consecutive uses share one matmul:

    * ``q == 1`` (one matmul per block, the fully pipelined ring): ``dynamic_slice(x) @ w``;
    * ``1 < q < p``: the rows of ``q`` uses are gathered (one fused copy) and multiplied
      at once; each use reads a static slice of the product;
    * ``q == p`` (``chunks=1``): the whole local ``x @ w`` first; each use is a dynamic
      slice of it that XLA fuses into the add that consumes it.
    """

    def __init__(self, x: jax.Array, w: jax.Array, index: jax.Array, p: int, q: int,
                 offsets: list[int], acc: np.dtype) -> None:
        self.x, self.w, self.index, self.p, self.q = x, w, index, p, q
        self.offsets, self.acc = offsets, acc
        self.mb = x.shape[0] // p
        self.prod = jnp.dot(x, w, preferred_element_type=acc) if q == p else None
        self.groups: dict[int, jax.Array] = {}

    def _start(self, j: int) -> jax.Array:
        return block_start(self.index, self.offsets[j], self.p, self.mb)

    def __call__(self, j: int) -> jax.Array:
        if self.prod is not None:
            return lax.dynamic_slice_in_dim(self.prod, self._start(j), self.mb, axis=0)
        if self.q == 1:
            blk = lax.dynamic_slice_in_dim(self.x, self._start(j), self.mb, axis=0)
            return jnp.dot(blk, self.w, preferred_element_type=self.acc)
        g, t = divmod(j, self.q)
        if g not in self.groups:
            offsets = jnp.arange(self.mb, dtype=jnp.int32)
            idx = jnp.concatenate([self._start(g * self.q + u).astype(jnp.int32) + offsets
                                   for u in range(self.q)])
            blk = self.x.at[idx].get(mode="promise_in_bounds", unique_indices=True)
            self.groups[g] = jnp.dot(blk, self.w, preferred_element_type=self.acc)
        return self.groups[g][t * self.mb:(t + 1) * self.mb]


def _uses(p: int, right: int, left: int) -> list[int]:
    """Block offsets in use order: round ``t`` adds the right-travelling accumulator's block
    ``right - t`` and the left-travelling one's ``t - left``; this device's own block last."""
    order = []
    for t in range(max(right, left)):
        if t < right:
            order.append(right - t)
        if t < left:
            order.append(t - left)
    return order + [0]


def _chain(part: _Partials, uses: list[int], offset: int, hops: int, axis_name: AxisName,
           p: int, shift: int) -> jax.Array:
    """One accumulator travelling ``hops`` hops by ``shift``: starts with the block at
    ``offset`` (= ``shift * hops``), picks up each device's partial product on the way and
    arrives at the block's owner (before the owner's own partial is added)."""
    perm = ring_perm(p, shift)
    acc = part(uses.index(offset))
    for t in range(1, hops):
        nxt = part(uses.index(offset - shift * t))   # independent of the accumulator in flight
        acc = lax.ppermute(acc, axis_name, perm) + nxt
    return lax.ppermute(acc, axis_name, perm)


def mm_reduce_scatter(x: jax.Array, w: jax.Array, axis_name: AxisName, *,
                      bias: jax.Array | None = None, bidirectional: bool = False,
                      chunks: int | None = None) -> jax.Array:
    """Reduce-scatter (over ``axis_name``, along rows) of ``x @ w``, as a ring pipeline.

    Args:
      x: this device's ``(m, k_local)`` operand; ``m`` must be divisible by the axis size.
      w: this device's ``(k_local, n)`` operand, same dtype as ``x``.
      axis_name: the mesh axis (or tuple of axes) of the enclosing ``shard_map`` whose
        devices hold the k slices.
      bias: optional ``(n,)`` vector added once to the reduced result.
      bidirectional: collect each block's contributions from both sides of the ring: half
        of them travel right, half left, so the ring takes ``ceil((p - 1) / 2)`` rounds
        instead of ``p - 1`` with the same ``p - 1`` transfers per device.
      chunks: how many matmuls compute the ``p`` partial products, a divisor of the axis
        size ``p``. Default ``p``: one matmul per block, each overlapping the transfer of
        the previous accumulator (the fully pipelined ring). Fewer, larger matmuls are
        cheaper where the transfer cannot overlap the matmul anyway (CPU emulation: a
        block matmul first copies its rows of ``x``); ``chunks=1`` computes the whole local
        product first. The communication is the same for every value.

    Returns:
      ``(m / p, n)`` in ``x.dtype``: row block ``axis_index`` of ``sum_devices(x @ w)``
      (+ ``bias``), equal to ``lax.psum_scatter(x @ w, axis_name, scatter_dimension=0,
      tiled=True)``.

    Example (inside ``shard_map`` over an axis "tp" of size 2, each device's x is
    ``[[1, 1], [2, 2]]`` with ``w = [[1], [1]]``; the sum of products is ``[[4], [8]]``)::

        mm_reduce_scatter(x, w, "tp")   # device 0 -> [[4.]], device 1 -> [[8.]]
    """
    p = axis_size(axis_name)
    _validate(x, w, bias, p)
    bidirectional = check_flag("bidirectional", bidirectional)
    c = check_chunks(chunks, p)
    acc = acc_dtype(x.dtype)
    if p == 1:
        out = jnp.dot(x, w, preferred_element_type=acc)
        if bias is not None:
            out = out + bias.astype(acc)
        return out.astype(x.dtype)

    index = lax.axis_index(axis_name)
    right, left = ring_hops(p, bidirectional)
    uses = _uses(p, right, left)
    part = _Partials(x, w, index, p, p // c, uses, acc)
    out = _chain(part, uses, right, right, axis_name, p, +1)
    if left:
        out = out + _chain(part, uses, -left, left, axis_name, p, -1)
    out = out + part(len(uses) - 1)
    if bias is not None:
        out = out + bias.astype(acc)
    return out.astype(x.dtype)
