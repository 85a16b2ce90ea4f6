"""Typed PRNG keys as graph values, and each device's block of a split random draw.

A key array (``jax.random.key``) is a value like any other: its :class:`TensorSpec` has the
key array's shape and the dtype's name, ``"key<fry>"`` for the default threefry keys; its
:func:`itemsize` is its key data's (two ``uint32`` words for threefry, four for ``rbg``). A
key closed over as a constant keeps its key data (:func:`key_data`) and is rebuilt from it
(:func:`wrap_key`).

``random_bits(keys, bit_width, shape)`` draws ``(*keys.shape, *shape)`` bits. With the default
threefry keys and ``jax_threefry_partitionable`` on (JAX's default), the bits at global
index ``i`` of the drawn dims depend only on the key and ``i``: ``threefry2x32(key, hi(i),
lo(i))`` of the row-major flat index ``i`` as two ``uint32`` words. So a device whose output
is split computes just its block (:func:`draw_block`): the counters of its block's global
indices (:func:`block_counters`), hashed by JAX's own ``threefry2x32`` primitive -- the
same bits as the corresponding block of the one-device draw. Any other key or mode draws the
whole array on each device and keeps its block: exact, at the whole draw's cost.

>>> import jax, numpy as np
>>> key = jax.random.key(0)
>>> itemsize("key<fry>"), itemsize("float32")
(8, 4)
>>> hi, lo = block_counters((4, 6), (2, 3), (2, 3))
>>> np.asarray(lo).tolist()
[[15, 16, 17], [21, 22, 23]]
>>> whole = jax.random.bits(key, (4, 6))
>>> block = draw_block(key, "key<fry>", 32, (4, 6), (2, 3), (2, 3), whole=None)
>>> bool((block == whole[2:, 3:]).all())
True
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from autopar.errors import AutoParallelError

__all__ = ["is_key", "key_impl", "itemsize", "key_data", "wrap_key", "block_counters",
           "draw_block", "partitionable"]

_U32 = np.dtype("uint32")


def is_key(dtype: Any) -> bool:
    """Whether ``dtype`` (a dtype or its name) is a typed PRNG key's.

    >>> import jax
    >>> is_key("key<fry>"), is_key(jax.random.key(0).dtype), is_key("uint32")
    (True, True, False)
    """
    if isinstance(dtype, str):
        return dtype.startswith("key<") and dtype.endswith(">")
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


@functools.lru_cache(maxsize=None)
def key_impl(name: str) -> Any:
    """The registered PRNG implementation of a key dtype name (``"key<fry>"``: threefry2x32);
    a name no implementation has is an :class:`~autopar.errors.AutoParallelError`."""
    from jax._src.random import prng as jax_prng  # (JAX's registry of implementations)

    for impl in jax_prng.prngs.values():
        if f"key<{impl.tag}>" == name:
            return impl
    raise AutoParallelError("dtype", name, "no PRNG implementation registered with JAX has "
                            "this key type", "Register it (jax.extend.random.define_prng_impl)"
                            " before tracing or loading a graph that holds such keys")


@functools.lru_cache(maxsize=None)
def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name: NumPy's, or a typed PRNG key's key data."""
    if is_key(dtype):
        return math.prod(key_impl(dtype).key_shape) * _U32.itemsize
    return np.dtype(dtype).itemsize


def key_data(keys: Any) -> np.ndarray:
    """A key array's key data on the host (``uint32``, the key shape appended)."""
    return np.asarray(jax.random.key_data(keys))


def wrap_key(data: Any, dtype: str) -> Any:
    """The key array of dtype name ``dtype`` whose key data is ``data``."""
    return jax.random.wrap_key_data(jnp.asarray(data, _U32), impl=key_impl(dtype).name)


def partitionable(dtype: str) -> bool:
    """Whether draws from keys of this dtype name are computed block by block: threefry2x32
    keys with ``jax_threefry_partitionable`` on (read when the program is traced)."""
    return key_impl(dtype).name == "threefry2x32" and bool(jax.config.jax_threefry_partitionable)


# ---------------------------------------------------------------------------- counters


def _wide_product(x: Any, c: int) -> tuple[Any, Any]:
    """``x * c`` exactly, as (hi, lo) ``uint32`` words, for ``uint32`` ``x`` and ``0 <= c <
    2**32``: the four 16-bit partial products, each below ``2**32``, with their carries."""
    xl, xh = x & 0xFFFF, x >> 16
    cl, ch = c & 0xFFFF, c >> 16
    ll, lh, hl, hh = xl * cl, xl * ch, xh * cl, xh * ch
    mid = lh + hl
    mid_carry = (mid < lh).astype(_U32)
    lo = ll + (mid << 16)
    carry = (lo < ll).astype(_U32)
    return hh + (mid >> 16) + (mid_carry << 16) + carry, lo


def block_counters(shape: Sequence[int], local: Sequence[int], starts: Sequence[Any]
                   ) -> tuple[Any, Any]:
    """The row-major flat indices into ``shape`` of the block of size ``local`` starting at
    ``starts`` (ints or traced scalars), as (hi, lo) ``uint32`` words of 64-bit counts:
    JAX's threefry counters of those elements (``iota_2x32_shape`` of the whole shape)."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    index = [lax.broadcasted_iota(_U32, tuple(local), d) + lax.convert_element_type(s, _U32)
             for d, s in enumerate(starts)]
    if math.prod(shape) < 2 ** 32:  # every index and partial sum fits one word
        lo = sum((g * stride for g, stride in zip(index, strides)), jnp.zeros(local, _U32))
        return jnp.zeros(local, _U32), lo
    hi, lo = jnp.zeros(local, _U32), jnp.zeros(local, _U32)
    for g, stride in zip(index, strides):
        p_hi, p_lo = _wide_product(g, stride & 0xFFFFFFFF)
        p_hi = p_hi + g * (stride >> 32)
        lo, lo_old = lo + p_lo, lo
        hi = hi + p_hi + (lo < lo_old).astype(_U32)
    return hi, lo


def _varying(x: Any) -> frozenset[str]:
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def _alike(xs: list[Any]) -> list[Any]:
    """``xs`` cast to vary over the same mesh axes (inside ``shard_map(check_vma=True)``)."""
    union = frozenset().union(*(_varying(x) for x in xs))
    return [lax.pcast(x, tuple(sorted(union - _varying(x))), to="varying")
            if union - _varying(x) else x for x in xs]


def _threefry_block(keys: Any, bit_width: int, local: Sequence[int],
                    counts: tuple[Any, Any]) -> Any:
    """``random_bits`` of partitionable threefry at the given counters, per key of
    ``keys`` (its dims lead): JAX's ``threefry2x32`` of the key words and the counters, the
    two results combined as JAX combines them for ``bit_width``."""
    data = jax.random.key_data(keys)
    k = keys.ndim
    full = (*keys.shape, *local)
    k1, k2 = (lax.broadcast_in_dim(data[..., i], full, tuple(range(k))) for i in (0, 1))
    hi, lo = (lax.broadcast_in_dim(c, full, tuple(range(k, len(full)))) for c in counts)
    bits1, bits2 = threefry2x32_p.bind(*_alike([k1, k2, hi, lo]))
    dtype = np.dtype(f"uint{bit_width}")
    if bit_width == 64:
        return (lax.convert_element_type(bits1, dtype) << 32) | lax.convert_element_type(
            bits2, dtype)
    return lax.convert_element_type(bits1 ^ bits2, dtype)


def draw_block(keys: Any, dtype: str, bit_width: int, shape: Sequence[int],
               local: Sequence[int], starts: Sequence[Any],
               whole: Callable[[], Any] | None) -> Any:
    """This device's block of ``random_bits(keys, bit_width, shape)``: the drawn dims'
    block of size ``local`` at ``starts`` (one per drawn dim), for each of the local
    ``keys`` -- the same bits as that block of the whole draw.

    Partitionable threefry keys (:func:`partitionable`) hash just the block's counters;
    otherwise ``whole()`` draws the whole array (on the local keys) and the block is cut
    from it."""
    if partitionable(dtype):
        return _threefry_block(keys, bit_width, local, block_counters(shape, local, starts))
    if whole is None:
        raise AutoParallelError("keys", dtype, "a draw from these keys cannot be computed "
                                "block by block, and no whole draw was given")
    k = keys.ndim
    return lax.dynamic_slice(whole(), (0,) * k + tuple(starts), (*keys.shape, *local))
