"""Fused all-gather + matmul as a ring pipeline over one mesh axis.

Use inside ``jax.shard_map``. Every device of the axis holds one row block of ``x``,
``(m_local, k)``, and a ``w`` of shape ``(k, n)`` (its own column slice in tensor
parallelism, or a replicated matrix). The result is ``all_gather(x, tiled along rows) @ w``,
``(p * m_local, n)``, on every device -- without ever materialising the gathered ``x``.

How the ring works (``p`` devices). Blocks travel one hop to the left per step: at step
``s`` device ``i`` holds block ``(i + s) mod p``. Each step first hands the block it holds
to ``lax.ppermute`` and then multiplies that same block, so the matmul runs while the next
block is in flight::

    cur = x                                                  # block i
    step s:  nxt = ppermute(cur, j -> j-1)  (s < p-1)        # in flight ...
             out_s = cur @ w                                 # ... while this runs
             cur = nxt
    result:  rows of block b = out_{(b - i) mod p}          # one fused gather

The ``p`` products are written once into their final row order by a single gather over
the stacked products (XLA fuses the stacking into the gather, so this is one pass over the
output): no per-step ``dynamic_update_slice``, no zero-filled output buffer.

The bidirectional variant sends every block both ways at once: block ``b`` reaches the
``ceil((p - 1) / 2)`` devices to its right travelling right and the other
``floor((p - 1) / 2)`` travelling left, so every device still receives ``p - 1`` blocks
(one ``collective-permute`` each) but in ``ceil((p - 1) / 2)`` rounds, both directions of
every link busy at once.

``chunks`` trades overlap for matmul efficiency without changing the communication: the
``p`` blocks of a ring are multiplied in ``chunks`` matmuls (default ``p``, one per block
as it arrives; ``q = p / chunks`` arrived blocks are concatenated per matmul). With
``chunks=1`` the received blocks are first gathered in block order (one fused copy) and
multiplied once, so no output re-ordering is needed. Where a transfer cannot overlap a
matmul anyway -- 8 emulated devices on 2 CPU cores -- fewer, taller matmuls are cheaper.

Products are computed with ``preferred_element_type=float32`` for fp16/bf16/fp32 inputs
and cast back to the input dtype in the final copy.

Worked example (4 devices, m_local=2, k=3, n=5)::

    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
    ...                      devices=jax.devices()[:4])
    >>> f = jax.shard_map(lambda x, w: all_gather_matmul(x, w, "tp"), mesh=mesh,
    ...                   in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"))
    >>> x = jnp.arange(24.0).reshape(8, 3); w = jnp.ones((3, 20))  # w: 5 columns/device
    >>> bool(jnp.allclose(f(x, w), x @ w))
    True

Each device multiplied all four ``(2, 3)`` blocks of ``x`` by its ``(3, 5)`` slice of ``w``;
three ``collective-permute`` ops moved the blocks and no all-gather was issued.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.kernels.mm_reduce_scatter import (
    AxisName,
    acc_dtype,
    axis_size,
    check_array,
    check_chunks,
    check_flag,
    ring_hops,
    ring_perm,
)

__all__ = ["all_gather_matmul"]


def _validate(x: jax.Array, w: jax.Array) -> None:
    check_array("x", x, 2)
    check_array("w", w, 2)
    if w.dtype != x.dtype:
        raise AutoParallelTypeError("w", w.dtype, f"dtype must equal x.dtype ({x.dtype})",
                                    "cast both operands to one dtype")
    if w.shape[0] != x.shape[1]:
        raise AutoParallelError("w.shape", tuple(w.shape),
                                f"first dim must equal x.shape[1] = {x.shape[1]} (k)")


def _travel(x: jax.Array, axis_name: AxisName, p: int, bidirectional: bool
            ) -> tuple[list[jax.Array], list[int]]:
    """The blocks passing through this device in arrival order, and each one's block
    offset (block ``(axis_index + offset) mod p``); step 0 is the device's own block.

    One way, blocks travel left: step ``t`` holds block ``i + t``. Both ways, every block
    is sent left and right at once: round ``t`` brings block ``i - t`` from the left
    (``t <= ceil((p - 1) / 2)``) and block ``i + t`` from the right (the remaining
    ``floor((p - 1) / 2)`` rounds' worth). The transfer of round ``t + 1`` is issued before
    anything consumes round ``t``'s blocks.
    """
    right, left = ring_hops(p, bidirectional)
    if not bidirectional:
        right, left = 0, p - 1          # one way: everything travels left
    held, offsets = [x], [0]
    to_right, to_left = x, x
    for t in range(1, max(right, left) + 1):
        if t <= left:
            to_left = lax.ppermute(to_left, axis_name, ring_perm(p, -1))
            held.append(to_left)
            offsets.append(t)
        if t <= right:
            to_right = lax.ppermute(to_right, axis_name, ring_perm(p, +1))
            held.append(to_right)
            offsets.append(-t)
    return held, offsets


def _step_of_block(index: jax.Array, offsets: list[int], p: int) -> jax.Array:
    """For every block ``b`` (a length-p vector), its position in the arrival order."""
    table = np.zeros(p, np.int32)
    for pos, off in enumerate(offsets):
        table[off % p] = pos
    b = jnp.arange(p, dtype=jnp.int32)
    return jnp.asarray(table)[lax.rem(b - index.astype(jnp.int32) + p, p)]


def _by_block(pieces: jax.Array, order: jax.Array) -> jax.Array:
    """``pieces[order]`` along the leading dim: one gather that XLA fuses with the stacking."""
    return pieces.at[order].get(mode="promise_in_bounds", unique_indices=True)


def _products(held: list[jax.Array], w: jax.Array, q: int, acc: np.dtype) -> jax.Array:
    """``held[t] @ w`` for every step, ``q`` steps per matmul, stacked ``(p, rows, n)``."""
    rows = held[0].shape[0]
    outs = []
    for g in range(0, len(held), q):
        blk = held[g] if q == 1 else jnp.concatenate(held[g:g + q], axis=0)
        outs.append(jnp.dot(blk, w, preferred_element_type=acc).reshape(q, rows, -1))
    return jnp.concatenate(outs, axis=0)


def all_gather_matmul(x: jax.Array, w: jax.Array, axis_name: AxisName, *,
                      bidirectional: bool = False, chunks: int | None = None) -> jax.Array:
    """``all_gather(x, axis_name, axis=0, tiled=True) @ w``, as a ring pipeline.

    Args:
      x: this device's ``(m_local, k)`` row block; block ``i`` lives on axis index ``i``.
      w: this device's ``(k, n)`` operand (a column slice or a replicated matrix), same
        dtype as ``x``.
      axis_name: the mesh axis (or tuple of axes) of the enclosing ``shard_map``.
      bidirectional: send every block both ways round the ring, so the blocks arrive in
        ``ceil((p - 1) / 2)`` rounds instead of ``p - 1`` (same ``p - 1`` transfers).
      chunks: how many matmuls consume the ``p`` blocks of a ring, a divisor of ``p``.
        Default ``p``: one matmul per block as it arrives (the fully pipelined ring).
        ``chunks=1`` gathers the blocks in order and runs one matmul; fewer, larger
        matmuls are more efficient where transfers cannot overlap compute (CPU emulation).

    Returns:
      ``(p * m_local, n)`` in ``x.dtype``, identical on every device of the axis (when
      ``w`` is), equal to ``lax.all_gather(x, axis_name, axis=0, tiled=True) @ w``.

    Example (axis "tp" of size 2; device 0 holds ``x = [[1, 2]]``, device 1 holds
    ``[[3, 4]]``, both ``w = [[1], [1]]``)::

        all_gather_matmul(x, w, "tp")   # both devices -> [[3.], [7.]]
    """
    p = axis_size(axis_name)
    _validate(x, w)
    bidirectional = check_flag("bidirectional", bidirectional)
    c = check_chunks(chunks, p)
    q = p // c
    acc = acc_dtype(x.dtype)
    ml, k = x.shape
    n = w.shape[1]
    if ml == 0:  # empty row blocks gather to nothing
        return jnp.zeros((0, n), x.dtype)
    if p == 1:
        return jnp.dot(x, w, preferred_element_type=acc).astype(x.dtype)

    held, offsets = _travel(x, axis_name, p, bidirectional)
    order = _step_of_block(lax.axis_index(axis_name), offsets, p)
    if c == 1:   # assemble x in block order, one matmul
        gathered = _by_block(jnp.stack(held), order).reshape(p * ml, k)
        out = jnp.dot(gathered, w, preferred_element_type=acc)
    else:
        out = _by_block(_products(held, w, q, acc), order).reshape(p * ml, n)
    return out.astype(x.dtype)
