"""AllGatherV: gather variable-length contributions of every rank into one layout.

Semantics (Ascend ``AllGatherV``): rank ``r`` contributes the first ``send_count[r]``
elements of its row-major data; ``recv_counts[r] == send_count[r]`` and ``rdispls[r]`` (in
elements, identical on every rank) say where rank ``r``'s data lands in the flattened
output of shape ``y_shape``; every element no rank writes is zero. Every rank receives the
whole output.

Worked example (the seed's, 2 ranks, last dim 4)::

    rank 0 data [[0, 1, 2, 3], [4, 5, 6, 7]]            send_count 4
    rank 1 data [[3, 2, 1, 0], [7, 6, 5, 4], [7, 6, 5, 4]]  send_count 2
    recv_counts [4, 2], rdispls [0, 4], y rows 2 + 3 = 5 -> y_shape (5, 4)
    output on both ranks:
        [[0, 1, 2, 3], [3, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]

Two entry points:

* :func:`all_gather_v` runs inside ``jax.shard_map``. SPMD needs one shape on every device,
  so each device passes its data padded to a common shape; the counts and displacements
  are static Python ints, so the whole output layout is known at trace time.
* :func:`allgatherv` runs on the host with one array per rank, of different sizes, as on
  the NPU; it builds a mesh of ``len(inputs)`` devices and returns one output per rank.

Two algorithms (``method``), chosen from the static counts when ``"auto"``:

* ``"padded"``: every rank sends its first ``max(recv_counts)`` elements in one
  ``all_gather``; the output is assembled from static slices in one fused copy. One
  collective, but ``p * max(count)`` elements move -- wasteful when counts are skewed.
* ``"balanced"``: the flat output is cut into ``p`` equal chunks; ranks first exchange the
  pieces of their data that belong to other ranks' chunks (one ``ppermute`` per ring
  distance that carries data, sized by the largest piece at that distance), then one
  ``all_gather`` of the equal chunks builds the output. About ``prod(y_shape)`` elements
  move in the gather, like an all_gather of equal-size inputs, plus the rebalancing.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.kernels.mm_reduce_scatter import AxisName, axis_size

__all__ = ["all_gather_v", "allgatherv", "AllGatherVLayout"]

Method = Literal["auto", "padded", "balanced"]
_METHODS = ("auto", "padded", "balanced")
#: ``method="auto"``: fixed cost of one collective, in elements moved per device.
COLLECTIVE_COST_ELEMENTS = 65536
#: ``method="auto"``: cost per element of a local re-layout pass, relative to a collective.
PASS_WEIGHT = 2


# --------------------------------------------------------------------------- layout

def _int_list(key: str, value: Any, length: int | None = None) -> tuple[int, ...]:
    """A sequence (or 1-D array) of non-negative ints, validated; ``key`` names it."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise AutoParallelTypeError(key, value, "must be a sequence of ints")
    try:
        items = (np.asarray(value).reshape(-1).tolist() if hasattr(value, "shape")
                 else list(value))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        raise AutoParallelTypeError(key, value, "must be static (Python ints or a concrete "
                                    "array), not a traced value") from None
    out = []
    for j, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise AutoParallelTypeError(f"{key}[{j}]", v, "must be an int")
        if v < 0:
            raise AutoParallelError(f"{key}[{j}]", int(v), "must be >= 0 (a count of elements)")
        out.append(int(v))
    if length is not None and len(out) != length:
        raise AutoParallelError(key, tuple(out), f"must have one entry per rank ({length})")
    return tuple(out)


def _shape(key: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) == 0:
        raise AutoParallelTypeError(key, value, "must be a non-empty sequence of ints")
    return _int_list(key, value)


@dataclass(frozen=True, slots=True)
class AllGatherVLayout:
    """The validated, static layout of one AllGatherV: where each rank's data lands.

    >>> AllGatherVLayout.build([4, 2], [0, 4], (5, 4)).segments
    ((0, 0, 4), (1, 4, 2))
    """

    recv_counts: tuple[int, ...]
    rdispls: tuple[int, ...]
    y_shape: tuple[int, ...]

    @staticmethod
    def build(recv_counts: Any, rdispls: Any, y_shape: Any,
              ranks: int | None = None) -> "AllGatherVLayout":
        """Validate counts and displacements against each other and ``y_shape``."""
        counts = _int_list("recv_counts", recv_counts, ranks)
        displs = _int_list("rdispls", rdispls, len(counts))
        shape = _shape("y_shape", y_shape)
        size = math.prod(shape)
        for r, (c, d) in enumerate(zip(counts, displs)):
            if d + c > size:
                raise AutoParallelError(
                    "rdispls", displs,
                    f"rank {r}'s data [{d}, {d + c}) runs past the output's {size} elements "
                    f"(y_shape {shape})", "shrink recv_counts/rdispls or enlarge y_shape")
        spans = sorted((d, d + c, r) for r, (c, d) in enumerate(zip(counts, displs)) if c)
        for (lo0, hi0, r0), (lo1, hi1, r1) in zip(spans, spans[1:]):
            if lo1 < hi0:
                raise AutoParallelError(
                    "rdispls", displs, f"rank {r0}'s data [{lo0}, {hi0}) overlaps rank "
                    f"{r1}'s [{lo1}, {hi1})", "every output element may come from one rank")
        return AllGatherVLayout(counts, displs, shape)

    @property
    def ranks(self) -> int:
        return len(self.recv_counts)

    @property
    def size(self) -> int:
        return math.prod(self.y_shape)

    @property
    def segments(self) -> tuple[tuple[int, int, int], ...]:
        """``(rank, start, count)`` of every non-empty contribution, by output position."""
        return tuple(sorted(((r, d, c) for r, (c, d) in
                             enumerate(zip(self.recv_counts, self.rdispls)) if c),
                            key=lambda s: s[1]))

    def chunk(self) -> int:
        """Elements per rank in the balanced method's final all_gather."""
        return -(-self.size // self.ranks)

    def shift_pieces(self) -> dict[int, tuple[tuple[int, int, int], ...]]:
        """Balanced method: per ring distance ``d``, per source rank ``s``, the piece of
        ``s``'s data that belongs to chunk ``(s + d) mod p``: ``(src_off, dst_off, len)``."""
        p, c = self.ranks, self.chunk()
        out: dict[int, tuple[tuple[int, int, int], ...]] = {}
        for d in range(p):
            row = []
            for s in range(p):
                r = (s + d) % p
                lo = max(self.rdispls[s], r * c)
                hi = min(self.rdispls[s] + self.recv_counts[s], (r + 1) * c)
                row.append((lo - self.rdispls[s], lo - r * c, hi - lo) if hi > lo else (0, 0, 0))
            if any(piece[2] for piece in row):
                out[d] = tuple(row)
        return out

    def costs(self) -> dict[str, float]:
        """Estimated cost of each method, in elements moved per device.

        A collective's copy (``all_gather``, ``ppermute``) counts 1 per element, a local
        re-layout pass :data:`PASS_WEIGHT` per element (XLA's loop fusions copy at about
        half the speed of a collective's block copies on CPU), and each collective adds
        :data:`COLLECTIVE_COST_ELEMENTS`.
        """
        p, size = self.ranks, self.size
        cmax = max(self.recv_counts)
        identity = (size == p * cmax and self.recv_counts == (cmax,) * p
                    and self.rdispls == tuple(r * cmax for r in range(p)))
        padded = (p * cmax + (0 if identity else PASS_WEIGHT * size)
                  + COLLECTIVE_COST_ELEMENTS)
        chunk = self.chunk()
        pieces = self.shift_pieces()
        exchanges = [max(piece[2] for piece in row) for d, row in pieces.items() if d]
        balanced = (p * chunk + sum(exchanges) + PASS_WEIGHT * chunk
                    + (PASS_WEIGHT * size if p * chunk != size else 0)
                    + COLLECTIVE_COST_ELEMENTS * (1 + len(exchanges)))
        return {"padded": padded, "balanced": balanced}

    def choose(self, method: Method) -> Literal["padded", "balanced"]:
        if method not in _METHODS:
            raise AutoParallelError("method", method, f"must be one of {list(_METHODS)}")
        if method != "auto":
            return method
        costs = self.costs()
        return "balanced" if costs["balanced"] < costs["padded"] else "padded"


# --------------------------------------------------------------------------- device side

def _mask(piece: jax.Array, first: int, send_count: jax.Array | None) -> jax.Array:
    """Zero the elements of ``piece`` at data positions ``>= send_count``."""
    if send_count is None:
        return piece
    pos = first + jnp.arange(piece.shape[0], dtype=jnp.int32)
    return jnp.where(pos < send_count, piece, jnp.zeros((), piece.dtype))


def _padded(flat: jax.Array, layout: AllGatherVLayout, axis_name: AxisName,
            send_count: jax.Array | None) -> jax.Array:
    cmax = max(layout.recv_counts)
    mine = _mask(flat[:cmax], 0, send_count)
    every = lax.all_gather(mine, axis_name, axis=0, tiled=False)        # (p, cmax)
    parts, at = [], 0
    for r, start, count in layout.segments:
        if start > at:
            parts.append(jnp.zeros((start - at,), flat.dtype))
        parts.append(every[r, :count])
        at = start + count
    if at < layout.size:
        parts.append(jnp.zeros((layout.size - at,), flat.dtype))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _table(values: Sequence[int], index: jax.Array) -> jax.Array:
    """``values[index]`` for a traced device index (a tiny constant lookup)."""
    return jnp.asarray(np.asarray(values, dtype=np.int32))[index]


def _window(data: jax.Array, start: jax.Array, lo: int, hi: int, size: int) -> jax.Array:
    """``data[start : start + size]`` with zeros outside ``data``, for ``start`` known to lie
    in ``[lo, hi]``: pads only as much as those bounds need, so the slice never clamps."""
    front, back = max(0, -lo), max(0, hi + size - data.shape[0])
    if front or back:
        data = jnp.concatenate([jnp.zeros((front,), data.dtype), data,
                                jnp.zeros((back,), data.dtype)])
    return lax.dynamic_slice_in_dim(data, start + front, size)


def _balanced(flat: jax.Array, layout: AllGatherVLayout, axis_name: AxisName,
              send_count: jax.Array | None, index: jax.Array) -> jax.Array:
    p, c = layout.ranks, layout.chunk()
    pos = jnp.arange(c, dtype=jnp.int32)
    chunk = jnp.zeros((c,), flat.dtype)
    for d, row in layout.shift_pieces().items():
        src_rank = [(r - d) % p for r in range(p)]          # who sends to rank r at d
        dst = [row[s] for s in src_rank]                     # (src_off, dst_off, len) at r
        dst_off = _table([piece[1] for piece in dst], index)
        dst_len = _table([piece[2] for piece in dst], index)
        if d == 0:
            # Own data: chunk[j] = flat[j + src_off - dst_off], one shifted window.
            shift = [piece[0] - piece[1] for piece in row if piece[2]]
            data = _mask(flat, 0, send_count)
            placed = _window(data, _table([q[0] - q[1] for q in row], index),
                             min(shift), max(shift), c)
        else:
            # Source side: `width` elements from src_off go to rank index + d.
            width = max(piece[2] for piece in row)
            offs = [piece[0] for piece in row if piece[2]]
            src_off = _table([piece[0] for piece in row], index)
            piece = _window(flat, src_off, min(offs), max(offs), width)
            if send_count is not None:
                piece = _mask(piece, 0, send_count - src_off)
            piece = lax.ppermute(piece, axis_name, [(s, (s + d) % p) for s in range(p)])
            # Destination side: chunk[j] = piece[j - dst_off].
            offs = [piece_[1] for piece_ in row if piece_[2]]
            placed = _window(piece, -dst_off, -max(offs), -min(offs), c)
        inside = (pos >= dst_off) & (pos < dst_off + dst_len)
        chunk = jnp.where(inside, placed, chunk)
    out = lax.all_gather(chunk, axis_name, axis=0, tiled=True)          # (p * c,)
    return out[:layout.size] if p * c != layout.size else out


def all_gather_v(x: jax.Array, send_count: int | jax.Array | None, recv_counts: Sequence[int],
                 rdispls: Sequence[int], y_shape: Sequence[int] | int, axis_name: AxisName,
                 *, method: Method = "auto") -> jax.Array:
    """AllGatherV inside ``jax.shard_map``: every device gets the full ``y_shape`` output.

    Args:
      x: this device's data, padded to the shape common to all devices; only its first
        elements (row-major) are sent.
      send_count: this device's count: a traced per-device scalar (e.g. from a sharded
        array), or ``None`` to use ``recv_counts[axis_index]``. Data positions at or past
        ``send_count`` are sent as zeros; it must equal ``recv_counts[axis_index]`` for
        the NPU's semantics.
      recv_counts: static per-rank counts (elements), identical on every device.
      rdispls: static per-rank offsets (elements) into the flattened output.
      y_shape: the output shape; an int or 1-tuple when ``x`` has more dims means the
        first dim, the rest taken from ``x`` (the NPU's ``y`` gives only the rows).
      axis_name: the mesh axis (or tuple of axes) of the ranks.
      method: ``"padded"``, ``"balanced"`` or ``"auto"`` (the cheaper for these counts).

    Returns:
      ``y_shape`` array of ``x.dtype``; rank ``r``'s first ``recv_counts[r]`` elements at
      flat offset ``rdispls[r]``, zeros elsewhere.

    Example (2 devices, x padded to (3, 4), the seed's counts)::

        all_gather_v(x, None, [4, 2], [0, 4], (5, 4), "rank")
        # -> [[0,1,2,3],[3,2,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0]] on both devices
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise AutoParallelTypeError("x", x, "must be a jax or numpy array")
    p = axis_size(axis_name)
    shape = _shape("y_shape", y_shape)
    if len(shape) == 1 and len(x.shape) > 1:
        shape = shape + tuple(x.shape[1:])
    layout = AllGatherVLayout.build(recv_counts, rdispls, shape, ranks=p)
    size = math.prod(x.shape)
    if max(layout.recv_counts) > size:
        r = int(np.argmax(layout.recv_counts))
        raise AutoParallelError(
            f"recv_counts[{r}]", layout.recv_counts[r],
            f"exceeds the {size} elements of x (shape {tuple(x.shape)})",
            "pad x on every device to hold the largest contribution")
    flat = x.reshape(-1)
    if max(layout.recv_counts) == 0:
        return jnp.zeros(layout.y_shape, x.dtype)
    if send_count is not None:
        send_count = jnp.asarray(send_count, jnp.int32).reshape(())
    if layout.choose(method) == "padded":
        out = _padded(flat, layout, axis_name, send_count)
    else:
        out = _balanced(flat, layout, axis_name, send_count, lax.axis_index(axis_name))
    return out.reshape(layout.y_shape)


# --------------------------------------------------------------------------- host side

@functools.lru_cache(maxsize=64)
def _program(devices: tuple[Any, ...], layout: AllGatherVLayout, method: str) -> Any:
    """The mesh and jitted AllGatherV over ``devices`` (jit caches per input shape)."""
    mesh = jax.sharding.Mesh(np.asarray(devices, dtype=object), ("rank",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec("rank")

    def body(x: jax.Array, count: jax.Array) -> jax.Array:
        return all_gather_v(x[0], count[0], layout.recv_counts, layout.rdispls,
                            layout.y_shape, "rank", method=method)[None]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    return mesh, jax.jit(fn)


def allgatherv(inputs: Sequence[Any], send_counts: Sequence[int], recv_counts: Sequence[int],
               rdispls: Sequence[int], y_shape: Sequence[int] | int, *,
               method: Method = "auto") -> list[jax.Array]:
    """AllGatherV from the host: ``inputs[r]`` is rank ``r``'s array (sizes may differ).

    Runs on a mesh of ``jax.devices()[:len(inputs)]`` and returns one output per rank (a
    ``jax.Array`` on that rank's device; all equal). ``send_counts[r]`` must equal
    ``recv_counts[r]`` and fit in ``inputs[r]``; ``y_shape`` is the full output shape, or
    just its rows (int or 1-tuple) with the trailing dims taken from ``inputs[0]``.

    >>> outs = allgatherv([np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.float16),
    ...                    np.array([[3, 2, 1, 0], [7, 6, 5, 4], [7, 6, 5, 4]], np.float16)],
    ...                   [4, 2], [4, 2], [0, 4], (5, 4))
    >>> np.asarray(outs[1])[:2].tolist()
    [[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 0.0, 0.0]]
    """
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence) or not inputs:
        raise AutoParallelTypeError("inputs", inputs, "must be a non-empty list of arrays")
    p = len(inputs)
    devices = jax.devices()
    if p > len(devices):
        raise AutoParallelError("inputs", f"<{p} arrays>",
                                f"needs one device per rank but only {len(devices)} exist")
    arrays = []
    for r, a in enumerate(inputs):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise AutoParallelTypeError(f"inputs[{r}]", a, "must be a jax or numpy array")
        arrays.append(np.asarray(a))
    dtype = arrays[0].dtype
    if dtype.kind in "USOMm":  # strings, objects, dates: no JAX array holds them
        raise AutoParallelTypeError("inputs[0]", dtype, "dtype must be numeric or bool")
    for r, a in enumerate(arrays):
        if a.dtype != dtype:
            raise AutoParallelTypeError(f"inputs[{r}]", a.dtype,
                                        f"dtype must match inputs[0] ({dtype})")
        if a.ndim != arrays[0].ndim or a.shape[1:] != arrays[0].shape[1:]:
            raise AutoParallelError(f"inputs[{r}].shape", a.shape,
                                    f"trailing dims must match inputs[0] {arrays[0].shape}",
                                    "ranks may differ only in their first dim")
    counts = _int_list("recv_counts", recv_counts, p)
    sends = _int_list("send_counts", send_counts, p)
    for r, (s, c) in enumerate(zip(sends, counts)):
        if s != c:
            raise AutoParallelError(f"send_counts[{r}]", s,
                                    f"must equal recv_counts[{r}] = {c}",
                                    "a rank sends exactly what the others expect from it")
        if s > arrays[r].size:
            raise AutoParallelError(f"send_counts[{r}]", s,
                                    f"exceeds the {arrays[r].size} elements of inputs[{r}] "
                                    f"(shape {arrays[r].shape})")
    shape = _shape("y_shape", y_shape)
    if len(shape) == 1 and arrays[0].ndim > 1:
        shape = shape + arrays[0].shape[1:]
    layout = AllGatherVLayout.build(counts, rdispls, shape, ranks=p)
    layout.choose(method)                                    # validates `method`
    length = max(1, max(a.size for a in arrays))
    mesh, fn = _program(tuple(devices[:p]), layout, method)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rank"))
    flat = [np.pad(a.reshape(-1), (0, length - a.size))[None] for a in arrays]
    x = jax.make_array_from_single_device_arrays(
        (p, length), sharding, [jax.device_put(f, d) for f, d in zip(flat, devices[:p])])
    count = jax.make_array_from_single_device_arrays(
        (p,), sharding, [jax.device_put(np.asarray([s], np.int32), d)
                         for s, d in zip(sends, devices[:p])])
    out = fn(x, count)
    by_device = {shard.device: shard.data[0] for shard in out.addressable_shards}
    return [by_device[d] for d in devices[:p]]
