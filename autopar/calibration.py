"""``autopar.calibrate``: measure the devices present and fit the cost model to them.

Measured on every device at once, as a plan runs them (so devices that share cores show it):

- **matmul**: square matmuls of random operands per device, chained, in each of
  ``MATMUL_DTYPES``. The sizes double from 64 past 512 while a product takes under a
  millisecond (on an accelerator a 512 x 512 one is launch-bound: the ladder reaches 8192
  on an H200); the largest, chained for at least ``_SUSTAIN_S``, gives ``peak_flops``
  (float32) and ``peak_flops_by_dtype`` -- sustained, as a step sees it, not a burst under
  a cold chip's clock. A chain of 64 tiny (8 x 8) ones -> ``op_overhead`` (what one more
  operator in a program costs);
- **elementwise** (``x * a + b`` into a new array) of 1 MiB per device and up, 4x at a time
  until a call takes a millisecond (a GPU's cache holds the small ones and its dispatch
  hides them) -> ``memory_bandwidth``: the slope between the two largest (first touch of
  new memory included, as a real step pays it);
- **launch**: a call that does nothing -> ``step_overhead`` (once per step);
- **shared compute**: one matmul on one device alone vs on every device at once (1 for
  independent devices; about devices / cores for emulated ones);
- **collectives**: each kind autopar lowers to (all_reduce, all_gather, reduce_scatter,
  all_to_all, collective_permute) over every group size the mesh can form, messages of
  4 KiB to 32 MiB (at least one element per device of the group: :func:`message_elements`)
  -> ``alpha + beta * n`` per kind and group size (:class:`CollectiveFit`, with the fit's
  largest relative residual);
- **overlap**: a matmul and an independent all-reduce in one step against each alone (0
  where devices share their cores, shared compute >= 2: the cores that compute move the data,
  and what the difference shows is noise).
- **in a step** (``barrier`` + ``barrier_per_byte`` x n): what a collective costs in a
  training step beyond its chained fit, from a step-like program -- forward segments of a
  matmul and a tanh, each followed by an all-gather of its output and the slice of this
  device's block back (the rewrite's move of a split value), differentiated, so backward
  runs the reduce-scatters and zero-filled slices -- against the same program without the
  moves, at two message sizes: per collective, the difference less the two fits, as a line
  in the message size. Devices that share cores drift apart over the computation between
  collectives and catch up at each; the glue around a collective grows with its message.
  Chained collectives show neither (0 where devices run on their own).

Operations are measured as straight-line programs, each operation writing a new buffer as a
real program's do (a loop over one buffer stays in cache and measured 5-15x faster than the
steps it should predict): the time per operation is ``(t(chain of 4) - t(one)) / 3``,
medians of interleaved pairs, so the call's dispatch cancels. Fits are non-negative least
squares on relative error (:func:`fit_alpha_beta`). Nothing about a backend is hard-coded:
sizes and group sizes come from the devices given; a budget (default 60 s) shares the time
out, dropping the largest message sizes first.

The result is a :class:`~autopar.strategies.cost.Cluster` whose ``calibration`` says what it
was measured on; :func:`autopar.calibrate` (:mod:`autopar.clusters`, which owns the cache)
caches it per device kind, count and host (:func:`host_identity`), so a second call returns
at once. This module measures and fits (:func:`measure`); it reads and writes no file.
Under ``jax.distributed`` every process measures together: each loop's length, each size
the budget skips and the fit returned are process 0's (:mod:`autopar.multihost`), so no
process runs a collective the others do not.
"""

from __future__ import annotations

import functools
import math
import os
import platform as _platform
import time
from typing import Any, Callable, Sequence

import numpy as np

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.multihost import agree_flag, agree_made, agree_text, is_lead, several
from autopar.strategies.cost import (COLLECTIVE_KINDS, Calibration, Cluster, CollectiveFit,
                                    CostModel)
from autopar.strategies.layout import DeviceMesh, jax_mesh

__all__ = ["CALIBRATION_VERSION", "calibrated_name", "check_settings", "fit_alpha_beta",
           "fit_with_knee", "group_sizes", "host_identity", "in_step_line", "measure",
           "message_elements",
           "line_residual", "select_devices"]

#: 2: the barrier, op_overhead measured directly; 3: the barrier pooled over three kinds;
#: 4: the barrier and barrier_per_byte measured in a step-like program; 5: matmul peaks per
#: dtype on random operands, the matmul and bandwidth ladders grown past launch-bound sizes.
#: A calibration of an older version is measured again.
CALIBRATION_VERSION = 5
#: Message sizes (bytes, as the model counts them), in the order they are measured: the
#: ends first, so a fit has its latency and its bandwidth whatever the budget cuts.
MESSAGE_SIZES = (2 ** 12, 2 ** 24, 2 ** 20, 2 ** 16, 2 ** 22, 2 ** 25)
#: Matmul sizes measured always; past them the ladder doubles while a product is short.
MATMUL_SIZES = (64, 128, 256, 512)
#: The dtypes whose matmul peak is measured (float32's is ``peak_flops``; the others go to
#: ``peak_flops_by_dtype``).
MATMUL_DTYPES = ("float32", "bfloat16", "float16")
_MATMUL_MAX = 16384
ELEMENTWISE_BYTES = (2 ** 20, 2 ** 22, 2 ** 24)
_ELEMENTWISE_MAX = 2 ** 34
#: An operation shorter than this is still launch- or cache-bound: the ladders go on.
_LONG_OP_S = 1e-3
#: The peak is the largest matmul chained for at least this long (seconds).
_SUSTAIN_S = 0.05
_MIN_SAMPLES = 2
#: The step-like program that measures a collective in a step: segments, the width of its
#: matmuls and the rows of each device's block at its two sizes (float32).
_STEP_SEGMENTS = 8
_STEP_WIDTH = 128
_STEP_ROWS = (64, 512)
#: Operations in the chain that measures an operator's launch (long: each costs microseconds).
_LAUNCH_CHAIN = 64
#: Operations in the long chain of a measurement, and what one measurement runs (warm-up
#: and three pairs of one and ``_CHAIN`` operations).
_CHAIN = 4
_MEASURE_COST = 4 * (1 + _CHAIN)


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]
                   ) -> tuple[float, float, float]:
    """Fit ``seconds = alpha + beta * size`` with alpha, beta >= 0, minimising the relative
    error; returns (alpha, beta, largest |fit / measured - 1|).

    >>> a, b, r = fit_alpha_beta([1e3, 1e6, 1e7], [1e-5 + 1e-9 * n for n in (1e3, 1e6, 1e7)])
    >>> round(a * 1e6, 3), round(b * 1e9, 3), r < 1e-9
    (10.0, 1.0, True)
    """
    from scipy.optimize import nnls

    x = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if x.shape != t.shape or x.size < _MIN_SAMPLES:
        raise AutoParallelError("samples", int(x.size), f"a fit needs at least {_MIN_SAMPLES} "
                                "(size, seconds) pairs of equal length")
    t = np.maximum(t, 1e-9)
    sol, _ = nnls(np.stack([1.0 / t, x / t], axis=1), np.ones_like(t))
    alpha, beta = float(sol[0]), float(sol[1])
    resid = float(np.max(np.abs((alpha + beta * x) / t - 1.0)))
    return alpha, beta, resid


def fit_with_knee(sizes: Sequence[float], seconds: Sequence[float]
                  ) -> tuple[float, float, float, float, float]:
    """Fit ``alpha + beta * min(n, knee) + beta_large * max(0, n - knee)`` (all >= 0): one
    slope while messages fit the caches, another past them. The knee is the measured size
    (or none) that gives the smallest largest relative residual; returns (alpha, beta, knee,
    beta_large, residual), knee 0 when one slope fits best.

    >>> t = [1e-4 + 1e-9 * min(n, 2**20) + 4e-9 * max(0, n - 2**20)
    ...      for n in (2**12, 2**16, 2**20, 2**22, 2**24)]
    >>> a, b, knee, bl, r = fit_with_knee([2**12, 2**16, 2**20, 2**22, 2**24], t)
    >>> knee == 2**20, round(bl / b, 3), r < 1e-6
    (True, 4.0, True)
    """
    from scipy.optimize import nnls

    x = np.asarray(sizes, dtype=np.float64)
    t = np.maximum(np.asarray(seconds, dtype=np.float64), 1e-9)
    alpha, beta, resid = fit_alpha_beta(x, t)
    best = (alpha, beta, 0.0, 0.0, resid)
    for knee in sorted(set(x.tolist()))[1:-1]:
        basis = np.stack([np.ones_like(x), np.minimum(x, knee), np.maximum(0.0, x - knee)],
                         axis=1)
        sol, _ = nnls(basis / t[:, None], np.ones_like(t))
        r = float(np.max(np.abs(basis @ sol / t - 1.0)))
        if r < 0.8 * best[4]:  # a knee must earn its place
            best = (float(sol[0]), float(sol[1]), float(knee), float(sol[2]), r)
    return best


def message_elements(kind: str, n: int, p: int) -> int:
    """The float32 elements each device of a group of ``p`` holds to move a message of about
    ``n`` bytes with ``kind``: an all-gather's block is ``n / p``; every other kind's is
    ``n``; a multiple of ``p`` (all-to-all and reduce-scatter split the block in ``p``), and
    never fewer than ``p`` -- at least one element per device, so a small message over a
    large group (4 KiB gathered from 64 devices) is measured a little larger, not empty.

    >>> message_elements("all_reduce", 4096, 8), message_elements("all_gather", 4096, 64)
    (1024, 64)
    """
    elems = n // 4 // (p if kind == "all_gather" else 1)
    return max(p, elems - elems % p)


def group_sizes(device_count: int) -> list[int]:
    """Every group size a mesh of ``device_count`` devices can form: the products of its
    prime axes' subsets, above 1 (8 -> [2, 4, 8]; 12 -> [2, 3, 4, 6, 12])."""
    sizes = {1}
    for _, s in DeviceMesh.for_devices(device_count).axes:
        sizes |= {k * s for k in sizes}
    return sorted(k for k in sizes if k > 1)


# ---------------------------------------------------------------------------- timing


class _Clock:
    """The budget: what is left, shared out over the measurements still to come."""

    def __init__(self, budget_s: float) -> None:
        self.t0, self.budget = time.perf_counter(), float(budget_s)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def share(self, remaining_items: int, reserve: float = 0.0) -> float:
        """Seconds for the next item: what is left (less ``reserve``) over the items left."""
        left = self.budget - reserve - self.elapsed()
        return max(0.0, left) / max(1, remaining_items)


def _chain(mesh: Any, body: Callable[[Any], Any], spec: Any, k: int) -> Any:
    """``f(x)``: ``body`` applied ``k`` times in a row to every device's block of ``x``, as
    straight-line code (each step writes a new buffer, as a real program's operators do)."""
    import jax

    def run(x: Any) -> Any:
        for _ in range(k):
            x = body(x)
        return x

    return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))


def _call(f: Any, x: Any) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    return time.perf_counter() - t0


def _per_op(short: Any, long: Any, x: Any, k: int, limit_s: float) -> float:
    """Seconds per operation: the median over interleaved pairs of
    ``(t(long) - t(short)) / (k - 1)`` (``long`` runs ``k`` operations, ``short`` one; the
    call's dispatch cancels), at least 3 pairs, at most 9 while ``limit_s`` lasts."""
    deadline = time.perf_counter() + limit_s
    _call(short, x), _call(long, x)  # compile and warm up
    pairs: list[float] = []
    while len(pairs) < 9 and (len(pairs) < 3 or agree_flag(time.perf_counter() < deadline)):
        a = _call(short, x)
        pairs.append((_call(long, x) - a) / (k - 1))
    return max(float(np.median(pairs)), 1e-9)


def _per_call(f: Any, x: Any, limit_s: float) -> float:
    """Median seconds of one call of ``f(x)`` (3 to 9 calls while ``limit_s`` lasts)."""
    deadline = time.perf_counter() + limit_s
    _call(f, x)
    ts: list[float] = []
    while len(ts) < 9 and (len(ts) < 3 or agree_flag(time.perf_counter() < deadline)):
        ts.append(_call(f, x))
    return float(np.median(ts))


# ---------------------------------------------------------------------------- what is run


def _collective_body(kind: str, axis: str, p: int) -> Callable[[Any], Any]:
    """One ``kind`` collective over ``axis``, chained so iteration i + 1 needs iteration i;
    the glue (a slice or an in-place update of one block) moves at most n / p bytes."""
    from jax import lax

    if kind == "all_reduce":
        return lambda x: lax.psum(x, axis)
    if kind == "all_gather":
        return lambda x: lax.dynamic_slice(lax.all_gather(x, axis, tiled=True), (0,),
                                           (x.shape[0],))
    if kind == "reduce_scatter":
        return lambda x: lax.dynamic_update_slice(x, lax.psum_scatter(x, axis, tiled=True),
                                                  (0,))
    if kind == "all_to_all":
        return lambda x: lax.all_to_all(x.reshape(p, -1), axis, 0, 0,
                                        tiled=True).reshape(-1)
    if kind == "collective_permute":
        perm = [(i, (i + 1) % p) for i in range(p)]
        return lambda x: lax.ppermute(x, axis, perm)
    raise AutoParallelError("kind", kind, f"one of {list(COLLECTIVE_KINDS)}")


def _placed(mesh: Any, spec: Any, per_device: int, dtype: Any = np.float32) -> Any:
    """A 1-D array of ``per_device`` elements per device, made on the devices (no host copy)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    shape = (per_device * mesh.size,)
    return jax.jit(lambda: jnp.full(shape, 1e-3, dtype),
                   out_shardings=NamedSharding(mesh, spec))()


def _group_meshes(devices: Sequence[Any]) -> list[tuple[int, bool, Any]]:
    """(group size, inside one process, mesh with the group on axis 'g') to measure: the
    inner (contiguous) group of every size, and with several processes the outer one too."""
    from jax.sharding import Mesh

    n = len(devices)
    arr = np.array(devices, dtype=object)
    out = []
    for p in group_sizes(n):
        inner = Mesh(arr.reshape(n // p, p), ("r", "g"))
        out.append((p, _one_process(inner.devices.reshape(-1, p)), inner))
        outer = Mesh(arr.reshape(p, n // p).T, ("r", "g"))
        if not _one_process(outer.devices.reshape(-1, p)) and \
                _one_process(inner.devices.reshape(-1, p)):
            out.append((p, False, outer))
    return out


def _one_process(groups: np.ndarray) -> bool:
    return all(len({d.process_index for d in row}) == 1 for row in groups)


def _measure_collectives(devices: Sequence[Any], sizes: Sequence[int], clock: _Clock,
                         bar: Any) -> list[CollectiveFit]:
    """Every kind over every group, in passes over the message ``sizes``: the first two
    passes always run (a fit needs two sizes), later ones while the budget lasts, so every
    fit gets the same sizes."""
    from jax.sharding import PartitionSpec

    spec = PartitionSpec(("r", "g"))
    cases = [(kind, p, intra, mesh) for p, intra, mesh in _group_meshes(devices)
             for kind in COLLECTIVE_KINDS]
    programs = [(_chain(mesh, _collective_body(kind, "g", p), spec, 1),
                 _chain(mesh, _collective_body(kind, "g", p), spec, _CHAIN))
                for kind, p, _, mesh in cases]
    samples: list[list[tuple[float, float]]] = [[] for _ in cases]
    todo = len(cases) * len(sizes)
    for k, n in enumerate(sizes):
        for i, (kind, p, intra, mesh) in enumerate(cases):
            share = clock.share(todo)
            todo -= 1
            if k >= _MIN_SAMPLES:  # skip what the fit so far says the budget cannot pay
                fa, fb, _ = fit_alpha_beta([x for x, _ in samples[i]],
                                           [t for _, t in samples[i]])
                if agree_flag(_MEASURE_COST * (fa + fb * n) > share):
                    bar.advance(f"{kind} x{p}: {n} B skipped (budget)")
                    continue
            elems = message_elements(kind, n, p)
            moved = 4 * elems * (p if kind == "all_gather" else 1)  # (n, or more: a minimum)
            samples[i].append((float(moved), _per_op(*programs[i], _placed(mesh, spec, elems),
                                                      _CHAIN, limit_s=share)))
            bar.advance(f"{kind} x{p}: {moved} B")
    fits = []
    for (kind, p, intra, _), pts in zip(cases, samples):
        a, b, knee, bl, r = fit_with_knee([x for x, _ in pts], [t for _, t in pts])
        fits.append(CollectiveFit(kind=kind, group=p, intra=intra, alpha=a, beta=b,
                                  residual=r, samples=len(pts), knee=knee, beta_large=bl))
    return fits


def _measure_compute(devices: Sequence[Any], share: float, bar: Any) -> dict[str, Any]:
    """peak_flops (and per dtype), memory_bandwidth, op_overhead, step_overhead, the
    residuals, shared_compute, overlap (see the module doc)."""
    from jax import lax
    from jax.sharding import PartitionSpec

    n = len(devices)
    mesh = jax_mesh(DeviceMesh((("g", n),)), devices)
    spec = PartitionSpec("g")
    limit = max(0.05, share / 24)
    room = _memory_per_device(devices)
    overhead = _op_overhead(mesh, spec, limit)
    peaks, resid, ladders = {}, 0.0, {}
    for dtype in MATMUL_DTYPES:
        ladders[dtype] = flops, ts = _matmul_ladder(mesh, spec, dtype, limit, room)
        peaks[dtype] = _sustained_peak(mesh, spec, dtype, flops[-1], ts[-1], limit)
        resid = max(resid, line_residual(flops, ts, overhead, peaks[dtype]))
    bar.advance("matmul")
    bandwidth, ew_resid = _bandwidth(mesh, spec, limit, room)
    step_overhead = _per_call(_chain(mesh, lambda x: x[:1], spec, 1), _placed(mesh, spec, 1),
                              limit)
    bar.advance("elementwise")
    # one device alone, the largest float32 matmul (each process's first: it can only run
    # its own), against every device at once
    flops, ts = ladders["float32"]
    solo = jax_mesh(DeviceMesh((("g", 1),)), _own(devices))
    t_solo = _per_op(_chain(solo, _product, spec, 1), _chain(solo, _product, spec, _CHAIN),
                     _operands(solo, spec, _side(flops[-1]), "float32"), _CHAIN, limit)
    shared = ts[-1] / t_solo
    # overlap: a matmul and an independent all-reduce in one step, against each alone
    m, ar_elems = MATMUL_SIZES[-2], 2 ** 20 // 4

    def both(v: Any) -> Any:
        return (*_product(v[:2]), lax.psum(v[2], "g"))

    def ar(v: Any) -> Any:
        return lax.psum(v, "g")

    t_ar = _per_op(_chain(mesh, ar, spec, 1), _chain(mesh, ar, spec, _CHAIN),
                   _placed(mesh, spec, ar_elems), _CHAIN, limit)
    t_both = _per_op(_chain(mesh, both, spec, 1), _chain(mesh, both, spec, _CHAIN),
                     (*_operands(mesh, spec, m, "float32"), _placed(mesh, spec, ar_elems)),
                     _CHAIN, limit)
    t_m = ts[MATMUL_SIZES.index(m)]
    overlap = (t_m + t_ar - t_both) / max(1e-12, min(t_m, t_ar))
    if shared >= 2.0:  # devices share their cores: the cores that compute move the data
        overlap = 0.0
    bar.advance("overlap")
    return {"peak_flops": peaks["float32"],
            "peak_flops_by_dtype": {k: v for k, v in peaks.items() if k != "float32"},
            "memory_bandwidth": bandwidth, "op_overhead": overhead,
            "step_overhead": step_overhead, "matmul_residual": resid,
            "memory_residual": ew_resid, "shared_compute": max(shared, 1e-3),
            "overlap": min(1.0, max(0.0, overlap))}


def _side(flops: float) -> int:
    """m of an m x m x m matmul of ``flops``."""
    return int(round((flops / 2.0) ** (1.0 / 3.0)))


def _sustained_peak(mesh: Any, spec: Any, dtype: str, flops: float, seconds: float,
                    limit: float) -> float:
    """FLOP/s of the ladder's largest matmul chained for at least ``_SUSTAIN_S`` (an
    accelerator's clock settles under its power limit: on an H200, 8192 x 8192 bfloat16
    products ran at 789 TFLOP/s four at a time and 690 forty at a time, what a training step
    sees)."""
    k = max(_CHAIN, math.ceil(_SUSTAIN_S / max(seconds, 1e-9)))
    k = int(agree_text(str(k)))
    t = _per_op(_chain(mesh, _product, spec, 1), _chain(mesh, _product, spec, k),
                _operands(mesh, spec, _side(flops), dtype), k, limit)
    return flops / t


def _matmul_ladder(mesh: Any, spec: Any, dtype: str, limit: float,
                   room: float) -> tuple[list[float], list[float]]:
    """(FLOPs, seconds) per device of square ``dtype`` matmuls of random operands: the
    sizes of ``MATMUL_SIZES``, then doubling while one product takes under
    ``_LONG_OP_S`` (launch-bound: on an accelerator a 512 x 512 product takes
    microseconds) and its operands fit a quarter of the device's memory."""
    chains = _chain(mesh, _product, spec, 1), _chain(mesh, _product, spec, _CHAIN)
    itemsize = np.dtype(_np_dtype(dtype)).itemsize
    flops: list[float] = []
    seconds: list[float] = []
    m = MATMUL_SIZES[0]
    while True:
        seconds.append(_per_op(*chains, _operands(mesh, spec, m, dtype), _CHAIN, limit))
        flops.append(2.0 * m ** 3)
        m *= 2
        more = m <= MATMUL_SIZES[-1] or (
            seconds[-1] < _LONG_OP_S and m <= _MATMUL_MAX
            and (_CHAIN + 2) * m * m * itemsize <= room / 4)
        if not agree_flag(more):
            return flops, seconds


def _bandwidth(mesh: Any, spec: Any, limit: float, room: float) -> tuple[float, float]:
    """(bytes/s, the line's largest relative residual): calls writing a new array of each
    size (``x * a + b``), ``ELEMENTWISE_BYTES`` then growing 4x until a call takes
    ``_LONG_OP_S`` (an accelerator's cache holds the small ones and its dispatch hides
    them) or would not fit; the bandwidth is the slope between the two largest (the
    intercept, the call's dispatch, is the launch of a step)."""
    ew = _chain(mesh, lambda x: x * np.float32(0.5) + np.float32(1e-3), spec, 1)
    nbytes: list[float] = []
    t_ew: list[float] = []
    b = ELEMENTWISE_BYTES[0]
    while True:
        t_ew.append(_per_call(ew, _placed(mesh, spec, b // 4), limit))
        nbytes.append(2.0 * b)  # read + write
        b *= 4
        more = b <= ELEMENTWISE_BYTES[-1] or (
            t_ew[-1] < _LONG_OP_S and b <= _ELEMENTWISE_MAX and 2 * b <= room / 4)
        if not agree_flag(more):
            break
    (n0, n1), (t0, t1) = nbytes[-2:], t_ew[-2:]
    if t1 <= t0:  # noise: the line through every size instead
        _, inv_bw, _ = fit_alpha_beta(nbytes, t_ew)
        bandwidth = 1.0 / max(inv_bw, 1e-30)
    else:
        bandwidth = (n1 - n0) / (t1 - t0)
    launch = max(0.0, t1 - n1 / bandwidth)
    return bandwidth, line_residual(nbytes, t_ew, launch, bandwidth)


def line_residual(work: Sequence[float], seconds: Sequence[float], launch: float,
                  rate: float) -> float:
    """The largest ``|(launch + work / rate) / measured - 1|`` over a ladder's sizes: how far
    the line the model uses is from what each size measured.

    >>> round(line_residual([1e6, 1e9], [4e-5, 1e-2], 1e-5, 1e11), 3)
    0.5
    """
    return float(max(abs((launch + w / rate) / max(t, 1e-9) - 1.0)
                     for w, t in zip(work, seconds)))


def _matmul(x: Any) -> Any:
    """A device's block of m * m elements times the m x m identity, flattened again."""
    import jax.numpy as jnp

    m = int(round(math.sqrt(x.shape[0])))
    return (x.reshape(m, m) @ jnp.eye(m, dtype=x.dtype)).reshape(-1)


def _product(ab: Any) -> Any:
    """``(a @ w, w)`` of a device's two blocks of m * m elements (the chain multiplies by the
    same random matrix again: values stay of one size, none of them zeros)."""
    a, w = ab[0], ab[1]
    m = int(round(math.sqrt(a.shape[0])))
    return (a.reshape(m, m) @ w.reshape(m, m)).reshape(-1), w


def _np_dtype(dtype: str) -> Any:
    import jax.numpy as jnp

    return jnp.dtype(dtype)


def _operands(mesh: Any, spec: Any, m: int, dtype: str) -> tuple[Any, Any]:
    """Random ``(a, w)`` of ``m * m`` elements per device in ``dtype``, made on the devices
    (normal; ``w`` scaled by ``1 / sqrt(m)`` so products keep the size of ``a``)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    shape = (m * m * mesh.size,)
    out = NamedSharding(mesh, spec)

    def make() -> tuple[Any, Any]:
        ka, kw = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, shape, jnp.float32)
        w = jax.random.normal(kw, shape, jnp.float32) / math.sqrt(m)
        return a.astype(dtype), w.astype(dtype)

    return jax.jit(make, out_shardings=(out, out))()


def _op_overhead(mesh: Any, spec: Any, limit: float) -> float:
    """What one more operator costs in a program however small (its launch): the time per
    operation of a chain of ``_LAUNCH_CHAIN`` 8 x 8 matmuls. Measured directly: the
    intercept of the matmul fit is a difference of the noisiest samples (0 to 51 us apart
    between runs on one machine, against 2-6 us measured this way)."""
    return _per_op(_chain(mesh, _matmul, spec, 1), _chain(mesh, _matmul, spec, _LAUNCH_CHAIN),
                   _placed(mesh, spec, 8 * 8), _LAUNCH_CHAIN, limit)


def _step_like(mesh: Any, spec: Any, rows: int, moves: bool) -> Any:
    """``f(x)``: a training step's shape on every device's block of ``x`` (``rows`` x
    ``_STEP_WIDTH``): ``_STEP_SEGMENTS`` segments (a matmul and a tanh), each followed, with
    ``moves``, by an all-gather of its output and the slice of this device's block back;
    differentiated (backward: reduce-scatters and zero-filled slices), the loss summed."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    width = _STEP_WIDTH

    def loss(h: Any) -> Any:
        w = jnp.full((width, width), 0.01, h.dtype)
        for _ in range(_STEP_SEGMENTS):
            h = jnp.tanh(h @ w) + h
            if moves:
                whole = lax.all_gather(h, "g", axis=0, tiled=True)
                h = lax.dynamic_slice_in_dim(whole, lax.axis_index("g") * rows, rows, 0)
        return jnp.sum(h * h)

    def run(x: Any) -> Any:
        value, grad = jax.value_and_grad(loss)(x.reshape(rows, width))
        return grad.reshape(-1) + lax.psum(value, "g")

    return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))


def _in_step(devices: Sequence[Any], comp: dict[str, float],
             fits: Sequence[CollectiveFit], limit: float) -> dict[str, float]:
    """``barrier`` and ``barrier_per_byte``: per collective of a step-like program
    (:func:`_step_like`), its time less the program without its moves, at ``_STEP_ROWS``'
    two sizes (:func:`in_step_line`). Zero on one device."""
    from jax.sharding import PartitionSpec

    p = len(devices)
    if p < 2 or not fits:
        return {"barrier": 0.0, "barrier_per_byte": 0.0}
    mesh, spec = jax_mesh(DeviceMesh((("g", p),)), devices), PartitionSpec("g")
    chained = CostModel(_cluster(devices, comp | {"barrier": 0.0, "barrier_per_byte": 0.0},
                                 fits, 0.0))
    intra = len({d.process_index for d in devices}) == 1
    sizes, measured, fitted = [], [], []
    for rows in _STEP_ROWS:
        n = p * rows * _STEP_WIDTH * 4
        sizes.append(float(n))
        measured.append(_per_op(_step_like(mesh, spec, rows, False),
                                _step_like(mesh, spec, rows, True),
                                _placed(mesh, spec, rows * _STEP_WIDTH),
                                2 * _STEP_SEGMENTS + 1, limit))
        fitted.append(sum(chained.collective_time(k, n, p, intra=intra)
                          for k in ("all_gather", "reduce_scatter")) / 2)
    barrier, per_byte = in_step_line(sizes, measured, fitted)
    return {"barrier": barrier, "barrier_per_byte": per_byte}


def in_step_line(sizes: Sequence[float], measured: Sequence[float],
                 fitted: Sequence[float]) -> tuple[float, float]:
    """``(barrier, barrier_per_byte)``: the line (non-negative, relative error) through
    what a collective measured in a step beyond its chained fit, at each message size.

    >>> b, per_byte = in_step_line([2**18, 2**21], [5e-4, 3.1e-3], [2e-4, 1e-3])
    >>> round(b * 1e6), round(per_byte * 2**20 * 1e6)
    (43, 1029)
    """
    excess = [max(m - f, 1e-9) for m, f in zip(measured, fitted)]
    barrier, per_byte, _ = fit_alpha_beta(sizes, excess)
    return barrier, per_byte


# ---------------------------------------------------------------------------- the entry


def calibrated_name(platform: str, device_count: int, process_count: int = 1) -> str:
    """``calibrated-cpu-8``; with several processes ``calibrated-gpu-2x8``."""
    per = device_count // process_count
    return f"calibrated-{platform}-" + (f"{process_count}x{per}" if process_count > 1
                                        else str(device_count))


def _cpu_model() -> str:
    """The processor's model name (Linux: /proc/cpuinfo; elsewhere what the platform says)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model", "Processor"):
                    return " ".join(value.split())
    except OSError:
        pass
    return _platform.processor() or "unknown processor"


@functools.lru_cache(maxsize=1)
def host_identity() -> str:
    """The machine this process runs on, as far as its speed goes: processor model and
    architecture, the CPUs this process may use and the memory, e.g. ``AMD EPYC (x86_64), 2
    CPUs, 23 GiB``. A calibration records it; the cache keeps one per identity and a
    calibration measured elsewhere is never taken for this machine's without a notice."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        mem = 0.0
    return (f"{_cpu_model()} ({_platform.machine() or 'unknown'}), {cpus or 1} CPUs, "
            f"{mem:.0f} GiB")


def select_devices(devices: Any) -> list[Any]:
    """The devices a calibration measures: None: every device present; an int: the first
    that many; or a list of jax devices."""
    import jax

    every = jax.devices()
    if devices is None:
        return list(every)
    if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple)):
        raise AutoParallelTypeError("devices", devices, "None, a device count or a list of "
                                    "jax devices")
    if isinstance(devices, int):
        if not 1 <= devices <= len(every):
            raise AutoParallelError("devices", devices, f"must be in [1, {len(every)}] (the "
                                    "devices present)")
        return list(every[:devices])
    if not devices or not all(d in every for d in devices):
        raise AutoParallelError("devices", devices, "a non-empty list of jax.devices()")
    if len(set(devices)) != len(devices):
        raise AutoParallelError("devices", devices, "each device once (a group of devices "
                                "measures their collectives)")
    return list(devices)


def _own(devices: Sequence[Any]) -> list[Any]:
    """This process's devices among ``devices`` (all of them in a single process)."""
    import jax

    return [d for d in devices if d.process_index == jax.process_index()]


def _check_processes(devices: Sequence[Any]) -> None:
    """Under ``jax.distributed`` every process measures together (each loop's length and
    each skip is process 0's decision, and the result is process 0's fit), so each must
    hold some of the devices."""
    import jax

    held = {d.process_index for d in devices}
    if several() and len(held) < jax.process_count():
        raise AutoParallelError("devices", f"{len(devices)} device(s) of process(es) "
                                f"{sorted(held)}", f"under jax.distributed every one of the "
                                f"{jax.process_count()} processes measures: give devices "
                                "that each process holds some of (None: every device)")


def _memory_per_device(devices: Sequence[Any]) -> float:
    own = _own(devices)  # (another process's device cannot be asked)
    stats = getattr(own[0], "memory_stats", lambda: None)()
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    local = max(1, len(own))
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * 2 ** 30
    return float(total) / local


def _link(fits: Sequence[CollectiveFit], intra: bool) -> tuple[float, float] | None:
    """(bandwidth, alpha per ring step) from the all_gather fit of the largest group: the
    figures the ring formulas use for groups and kinds not measured."""
    ag = [f for f in fits if f.kind == "all_gather" and f.intra == intra]
    if not ag:
        return None
    f = max(ag, key=lambda f: f.group)
    p = f.group
    return (p - 1) / p / max(f.beta, 1e-30), f.alpha / (p - 1)


def _cluster(devs: Sequence[Any], comp: dict[str, float], fits: Sequence[CollectiveFit],
             seconds: float) -> Cluster:
    """The Cluster of the measured figures, with what it was measured on."""
    import jax

    platform, kind = devs[0].platform, devs[0].device_kind
    intra_link = _link(fits, True) or (1e12, 0.0)
    inter_link = _link(fits, False) or intra_link
    procs = len({d.process_index for d in devs})
    cal = Calibration(version=CALIBRATION_VERSION, platform=platform, device_kind=kind,
                      device_count=len(devs), process_count=procs,
                      jax_version=jax.__version__, host=host_identity(),
                      matmul_residual=comp["matmul_residual"],
                      memory_residual=comp["memory_residual"],
                      shared_compute=comp["shared_compute"], seconds=round(seconds, 3))
    return Cluster(
        name=calibrated_name(platform, len(devs), procs),
        devices_per_node=len(devs) // procs, peak_flops=comp["peak_flops"],
        memory_bandwidth=comp["memory_bandwidth"], memory_bytes=_memory_per_device(devs),
        intra_bandwidth=intra_link[0], intra_alpha=intra_link[1],
        inter_bandwidth=inter_link[0], inter_alpha=inter_link[1],
        peak_flops_by_dtype=comp["peak_flops_by_dtype"],
        op_overhead=comp["op_overhead"], step_overhead=comp["step_overhead"],
        overlap=comp["overlap"], barrier=comp["barrier"],
        barrier_per_byte=comp["barrier_per_byte"],
        collectives=tuple(sorted(fits, key=lambda f: (f.kind, f.group, f.intra))),
        calibration=cal)


_MAX_BUDGET_S = 1e6  # a calibration's time budget (seconds) at most: about eleven days


def check_settings(budget_s: Any, progress: Any, max_message_bytes: Any) -> tuple[int, ...]:
    """Check :func:`measure`'s settings (before anything is measured or read from a cache);
    the message sizes to measure."""
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)):
        raise AutoParallelTypeError("budget_s", budget_s, "must be a number of seconds")
    if not 0 < budget_s <= _MAX_BUDGET_S:  # (compared: isfinite overflows on huge ints)
        raise AutoParallelError("budget_s", budget_s, f"must be a positive number of seconds, "
                                f"at most {_MAX_BUDGET_S:g}")
    if not isinstance(progress, bool):
        raise AutoParallelTypeError("progress", progress, "must be a bool")
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int):
        raise AutoParallelTypeError("max_message_bytes", max_message_bytes, "must be an int "
                                    "of bytes")
    sizes = tuple(n for n in MESSAGE_SIZES if n <= max_message_bytes)
    if len(sizes) < _MIN_SAMPLES:
        raise AutoParallelError("max_message_bytes", max_message_bytes, f"must be an int >= "
                                f"{sorted(MESSAGE_SIZES)[_MIN_SAMPLES - 1]} (a fit needs "
                                f"{_MIN_SAMPLES} message sizes)")
    return sizes


def measure(devs: Sequence[Any], *, budget_s: float = 60.0, progress: bool = True,
            max_message_bytes: int = MESSAGE_SIZES[-1]) -> Cluster:
    """Measure the devices ``devs`` and return the fitted Cluster (no cache: that is
    :func:`autopar.calibrate`'s step, in :mod:`autopar.clusters`).

    ``budget_s``: the wall time to aim for (the measurement plan shrinks to fit: fewer
    message sizes, never fewer than two per fit). ``progress``: a progress bar on stderr.
    ``max_message_bytes``: the largest collective message measured (default 32 MiB; smaller
    for a quick, coarser calibration).
    """
    from autopar.text import Progress

    sizes = check_settings(budget_s, progress, max_message_bytes)
    _check_processes(devs)
    sizes = tuple(int(n) for n in agree_text(" ".join(map(str, sizes))).split())
    clock = _Clock(0.92 * budget_s)  # the plan overruns its share a little: aim under
    cases = len(_group_meshes(devs)) * len(COLLECTIVE_KINDS) if len(devs) > 1 else 0
    total = 4 + cases * len(sizes)
    with Progress("calibrate", total, quiet=not (progress and is_lead())) as bar:
        comp = _measure_compute(devs, 0.25 * clock.budget, bar)
        fits = _measure_collectives(devs, sizes, clock, bar) if cases else []
        comp |= _in_step(devs, comp, fits, 0.05 * clock.budget)
        bar.advance("in a step")
    if not several():
        return _cluster(devs, comp, fits, clock.elapsed())
    # process 0's figures make the cluster (another's might not even validate)
    made = agree_made(lambda: _cluster(devs, comp, fits, clock.elapsed()).model_dump_json())
    return Cluster.model_validate_json(made)
