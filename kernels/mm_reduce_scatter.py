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

The bidirectional variant splits every block in two halves (its columns when ``n`` is
even -- every matmul then keeps all ``m / p`` rows -- else its rows when ``m / p`` is even)
and runs two rings at once: the first halves travel to the right, the second halves to
the left, so each link carries half the bytes in each direction. When neither split is
possible it falls back to the one-way ring.

``chunks`` trades overlap for matmul efficiency without changing the communication: the
``p`` partial products of a ring are computed in ``chunks`` matmuls (default ``p``, one per
block as above; ``1``: the whole local ``x @ w`` first, each step then reads its block
with a dynamic slice fused into the add). Where a transfer cannot overlap a matmul anyway
-- 8 emulated devices on 2 CPU cores -- fewer, taller matmuls are simply cheaper.

Partial products are computed with ``preferred_element_type=float32`` (for fp16/bf16/fp32
inputs), accumulators travel in fp32 and the result is cast back to the input dtype once.

Worked example (4 devices, m=8, k_local=3, n=5)::

    >>> mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
    ...                      devices=jax.devices()[:4])
    >>> f = jax.shard_map(lambda x, w: mm_reduce_scatter(x, w, "tp"), mesh=mesh,
    ...                   in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
    >>> x = jnp.ones((8, 12)); w = jnp.ones((12, 5))      # global: k = 4 * 3
    >>> f(x, w).shape, float(f(x, w)[0, 0])                # rows 0-1 on device 0, ...
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


class _Matmuls:
    """Step partials of one ring, ``p / chunks`` steps per matmul (``chunks >= 2``).

    Step ``s`` of a ring with ``shift`` (+1: accumulators travel right, -1: left) works on
    block ``(i - shift * (1 + s)) mod p``, rows ``row0 : row0 + rows`` of that block:

    * one step per matmul (the default): ``dynamic_slice(x) @ w_part``;
    * ``q > 1`` steps per matmul: the rows of ``q`` consecutive steps are gathered (one
      fused copy) and multiplied at once; each step reads a static slice of the product.
    """

    def __init__(self, x: jax.Array, w_part: jax.Array, index: jax.Array, p: int, q: int,
                 shift: int, row0: int, rows: int, acc: np.dtype) -> None:
        self.x, self.w, self.index, self.p, self.q = x, w_part, index, p, q
        self.shift, self.row0, self.rows, self.acc = shift, row0, rows, acc
        self.mb = x.shape[0] // p
        self.group: tuple[int, jax.Array] | None = None

    def _start(self, step: int) -> jax.Array:
        return block_start(self.index, -self.shift * (1 + step), self.p, self.mb) + self.row0

    def __call__(self, step: int) -> jax.Array:
        if self.q == 1:
            blk = lax.dynamic_slice_in_dim(self.x, self._start(step), self.rows, axis=0)
            return jnp.dot(blk, self.w, preferred_element_type=self.acc)
        g, j = divmod(step, self.q)
        if self.group is None or self.group[0] != g:
            offsets = jnp.arange(self.rows, dtype=jnp.int32)
            idx = jnp.concatenate([self._start(g * self.q + t).astype(jnp.int32) + offsets
                                   for t in range(self.q)])
            blk = self.x.at[idx].get(mode="promise_in_bounds", unique_indices=True)
            self.group = (g, jnp.dot(blk, self.w, preferred_element_type=self.acc))
        return self.group[1][j * self.rows:(j + 1) * self.rows]


class _FromProduct:
    """Step partials read from the whole local product ``x @ w`` (``chunks == 1``).

    Each step's window (rows ``row0 : row0 + rows`` of its block, columns ``col0 : col0 +
    cols``) is a dynamic slice that XLA fuses into the add that consumes it.
    """

    def __init__(self, prod: jax.Array, index: jax.Array, p: int, shift: int, row0: int,
                 rows: int, col0: int, cols: int) -> None:
        self.prod, self.index, self.p, self.shift = prod, index, p, shift
        self.row0, self.rows, self.col0, self.cols = row0, rows, col0, cols
        self.mb = prod.shape[0] // p

    def __call__(self, step: int) -> jax.Array:
        start = block_start(self.index, -self.shift * (1 + step), self.p, self.mb) + self.row0
        return lax.dynamic_slice(self.prod, (start, jnp.int32(self.col0)),
                                 (self.rows, self.cols))


def _ring(partial: _Matmuls | _FromProduct, axis_name: AxisName, p: int, shift: int) -> jax.Array:
    """Run one ring: returns this device's complete block of the reduced product."""
    perm = ring_perm(p, shift)
    out = partial(0)
    for step in range(1, p):
        nxt = partial(step)                      # independent of the accumulator in flight
        out = lax.ppermute(out, axis_name, perm) + nxt
    return out


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
      bidirectional: split each block in halves and send them both ways round the ring.
      chunks: how many matmuls compute the ``p`` partial products of a ring, a divisor of
        the axis size ``p``. Default ``p``: one matmul per block, each overlapping the
        transfer of the previous accumulator (the fully pipelined ring). Fewer, larger
        matmuls are more efficient where the transfer cannot overlap the matmul anyway
        (CPU emulation); ``chunks=1`` computes the whole local product first. The
        communication (``p - 1`` ring steps per ring) is the same for every value.

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
    c = check_chunks(chunks, p)
    acc = acc_dtype(x.dtype)
    m, _ = x.shape
    n = w.shape[1]
    mb = m // p
    if p == 1:
        out = jnp.dot(x, w, preferred_element_type=acc)
        if bias is not None:
            out = out + bias.astype(acc)
        return out.astype(x.dtype)

    index = lax.axis_index(axis_name)
    prod = jnp.dot(x, w, preferred_element_type=acc) if c == 1 else None

    def ring(shift: int, row0: int, rows: int, col0: int, cols: int) -> jax.Array:
        """One ring over rows ``row0 : row0 + rows`` of every block, columns ``col0 ...``."""
        if prod is not None:
            part: _Matmuls | _FromProduct = _FromProduct(prod, index, p, shift, row0, rows,
                                                         col0, cols)
        else:
            w_part = w if cols == n else w[:, col0:col0 + cols]
            part = _Matmuls(x, w_part, index, p, p // c, shift, row0, rows, acc)
        return _ring(part, axis_name, p, shift)

    if bidirectional and n % 2 == 0:
        # Column halves: every matmul keeps all rows of its block (taller matmuls than
        # row halves); each ring moves (m/p, n/2) accumulators.
        h = n // 2
        out = jnp.concatenate([ring(+1, 0, mb, 0, h), ring(-1, 0, mb, h, h)], axis=1)
    elif bidirectional and mb % 2 == 0:
        h = mb // 2
        out = jnp.concatenate([ring(+1, 0, h, 0, n), ring(-1, h, h, 0, n)], axis=0)
    else:
        out = ring(+1, 0, mb, 0, n)
    if bias is not None:
        out = out + bias.astype(acc)
    return out.astype(x.dtype)
