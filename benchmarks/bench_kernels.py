"""Fused communication kernels vs their unfused equivalents, side by side on 8 devices.

* mm_reduce_scatter (ring, one way / both ways, pipelined or in fewer matmuls) vs
  ``x @ w`` followed by ``lax.psum_scatter``; per device x (m, k), w (k, n).
* all_gather_matmul vs ``lax.all_gather`` followed by the matmul; per device x (m/8, k),
  w (k, n) -- the mirror of the above (same global matmul).
* all_gather_v vs padding every rank to the largest count + ``all_gather``, and vs an
  ``all_gather`` of equal-size inputs that produces the same number of elements.
* all_gather / reduce_scatter along a strided dim (dim 1 of a matrix): ``jax.lax``'s own vs
  :mod:`autopar.collectives`' form (a leading-axis collective and a transpose), beside the
  same bytes along dim 0.

The machine is noisy (2 cores run 8 emulated devices, other jobs come and go), so every
round times each variant once, in a shuffled order, and a ratio is the median over rounds
of (variant / baseline of the same round). ``cpu ratio`` compares process CPU seconds the
same way: it is the steadier measure of work done when other jobs steal the cores.

Run: ``python -m benchmarks kernels`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks._common import (
    DocTables,
    DocTexts,
    markdown_table,
    run_main,
    setup_devices,
    timeit,
    write_results,
)

DEVICES = 8
COLUMNS = ["kernel", "variant", "ms", "ratio", "cpu ratio", "goal",
           "predicted ratio accelerator-8x", "predicted ratio cpu-emulated", "rewrite picks on"]
#: The ring schedules measured: (bidirectional, chunks) -- every one the rewrite can pick.
SCHEDULES: dict[str, dict[str, Any]] = {
    "ring one way, pipelined (chunks=8)": {"bidirectional": False, "chunks": None},
    "ring both ways, pipelined (chunks=8)": {"bidirectional": True, "chunks": None},
    "ring one way, one matmul (chunks=1)": {"bidirectional": False, "chunks": 1},
    "ring both ways, one matmul (chunks=1)": {"bidirectional": True, "chunks": 1},
}


def doc_tables(results: dict[str, dict]) -> DocTexts:
    """docs/kernels.md's ``kernels`` table, from kernels.json."""
    return {("docs/kernels.md", "kernels"): markdown_table(results["kernels"]["rows"], COLUMNS,
                                                          fmt=".3g")}


DOC_TABLES = DocTables(("kernels",), doc_tables)


def _shapes(kernel: str, m: int, k: int, n: int) -> dict[str, float]:
    if kernel == "mm_reduce_scatter":   # per device x (m, k), w (k, n) -> (m / p, n)
        return {"flops": 2.0 * m * k * n, "x_bytes": 4.0 * m * k, "out_bytes": 4.0 * m * n,
                "comm_bytes": 4.0 * m * n}
    return {"flops": 2.0 * m * k * n, "x_bytes": 4.0 * m * k, "out_bytes": 4.0 * m * n,  # mirror
            "comm_bytes": 4.0 * m * k}


def _predicted(kernel: str, variant: str, m: int, k: int, n: int, cluster: str) -> Any:
    """fused / unfused time from the alpha-beta model with overlap (autopar.kernel_rules)."""
    from autopar.kernel_rules import predict

    if "unfused" in variant:
        return 1.0
    if variant not in SCHEDULES:
        return ""
    r = predict(kernel, p=DEVICES, intra=True, cluster=cluster, **SCHEDULES[variant],
                **_shapes(kernel, m, k, n))
    return r["fused"] / r["unfused"]


def _picked_by(kernel: str, variant: str, m: int, k: int, n: int) -> str:
    """The clusters on which the rewrite would run this schedule for these shapes."""
    from autopar.kernel_rules import best_schedule

    return ", ".join(c for c in ("accelerator-8x", "cpu-emulated") if variant in SCHEDULES and
                     best_schedule(kernel, DEVICES, c, intra=True, **_shapes(kernel, m, k, n))[0]
                     == SCHEDULES[variant])


@dataclass
class Case:
    kernel: str
    variant: str
    fn: Callable[[], Any]
    baseline: bool = False
    goal: str = ""


def _measure(cases: list[Case], rounds: int, repeat: int, seed: int) -> list[dict[str, Any]]:
    """Interleaved rounds; per case the median ms and paired wall / CPU ratios."""
    rng = random.Random(seed)
    wall: dict[str, list[float]] = {c.variant: [] for c in cases}
    cpu: dict[str, list[float]] = {c.variant: [] for c in cases}
    for c in cases:                                           # compile + warm up
        c.fn()
    for _ in range(rounds):
        order = list(cases)
        rng.shuffle(order)
        for c in order:
            c0 = time.process_time()
            wall[c.variant].append(timeit(c.fn, repeat=repeat, warmup=0))
            cpu[c.variant].append((time.process_time() - c0) / repeat)
    base = next(c for c in cases if c.baseline).variant
    rows = []
    for c in cases:
        ratio = statistics.median(a / b for a, b in zip(wall[c.variant], wall[base]))
        cpu_ratio = statistics.median(a / b for a, b in zip(cpu[c.variant], cpu[base]))
        rows.append({"kernel": c.kernel, "variant": c.variant,
                     "ms": statistics.median(wall[c.variant]) * 1e3,
                     "ratio": ratio, "cpu ratio": cpu_ratio, "goal": c.goal})
    return rows


def _check(got: Any, want: Any, what: str) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-3, atol=2e-3 * float(np.abs(np.asarray(want)).max() + 1),
                               err_msg=what)


def _blocking(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """``fn(*args)``, waiting for its result: what a :class:`Case` times."""
    return lambda: fn(*args).block_until_ready()


def _cases(kernel: str, fns: dict[str, Callable], args: tuple[Any, ...]) -> list[Case]:
    """One case per compiled variant; the first is the (unfused) baseline. Each variant's
    result is checked against the baseline's before anything is timed."""
    cases, want = [], None
    for j, (name, fn) in enumerate(fns.items()):
        out = fn(*args)
        want = out if want is None else want
        if not name.startswith("evidence"):   # evidence rows time pieces, not the result
            _check(out, want, f"{kernel}: {name}")
        cases.append(Case(kernel, name, _blocking(fn, *args), baseline=j == 0,
                          goal="<= 1.10" if name in SCHEDULES else ""))
    return cases


def _matmul_cases(m: int, k: int, n: int) -> tuple[list[Case], list[Case]]:
    import jax
    import jax.numpy as jnp
    from autopar.kernels import all_gather_matmul, mm_reduce_scatter
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    p = DEVICES
    mesh = jax.make_mesh((p,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    f32 = jnp.float32

    # mm_reduce_scatter: per device x (m, k), w (k, n) -> (m / p, n).
    def put(shape: tuple[int, int], spec: P) -> jax.Array:
        return jax.device_put(rng.standard_normal(shape, np.float32), NamedSharding(mesh, spec))

    x, w = put((m, k * p), P(None, "tp")), put((k * p, n), P("tp", None))

    def rs(body: Callable) -> Callable:
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                                     out_specs=P("tp", None)))

    def unfused_rs(a: jax.Array, b: jax.Array) -> jax.Array:
        return lax.psum_scatter(jnp.dot(a, b, preferred_element_type=f32), "tp",
                                scatter_dimension=0, tiled=True)

    blocks = [slice(j * (m // p), (j + 1) * (m // p)) for j in range(p)]

    def split_products(a: jax.Array, b: jax.Array) -> jax.Array:
        """Evidence: the pipelined ring's matmuls alone -- p block matmuls, no transfer."""
        return sum((jnp.dot(a[r], b, preferred_element_type=f32) for r in blocks[1:]),
                   jnp.dot(a[blocks[0]], b, preferred_element_type=f32))

    rs_variants: dict[str, Callable] = {"x @ w + psum_scatter (unfused)": unfused_rs}
    for label, kw in SCHEDULES.items():
        rs_variants[label] = functools.partial(mm_reduce_scatter, axis_name="tp", **kw)
    rs_variants["evidence: p block matmuls + adds, no transfer"] = split_products
    rs_cases = _cases("mm_reduce_scatter", {name: rs(body) for name, body in rs_variants.items()},
                      (x, w))

    # all_gather_matmul: per device x (m / p, k), w (k, n) -> (m, n).
    xg, wg = put((m, k), P("tp", None)), put((k, n * p), P(None, "tp"))

    def ag(body: Callable) -> Callable:
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                                     out_specs=P(None, "tp")))

    def unfused_ag(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.dot(lax.all_gather(a, "tp", axis=0, tiled=True), b,
                       preferred_element_type=f32)

    def gathered_then_products(a: jax.Array, b: jax.Array) -> jax.Array:
        """Evidence: all_gather, then p block matmuls written into row order (the pipelined
        ring's matmuls and output assembly without its transfers)."""
        full = lax.all_gather(a, "tp", axis=0, tiled=True)
        outs = jnp.stack([jnp.dot(full[r], b, preferred_element_type=f32) for r in blocks])
        order = lax.rem(jnp.arange(p) + lax.axis_index("tp"), p)   # a device-dependent order
        return outs.at[order].get(mode="promise_in_bounds", unique_indices=True).reshape(m, -1)

    ag_variants: dict[str, Callable] = {"all_gather + x @ w (unfused)": unfused_ag}
    for label, kw in SCHEDULES.items():
        ag_variants[label] = functools.partial(all_gather_matmul, axis_name="tp", **kw)
    ag_variants["evidence: all_gather + p block matmuls into row order"] = gathered_then_products
    ag_cases = _cases("all_gather_matmul", {name: ag(body) for name, body in ag_variants.items()},
                      (xg, wg))
    return rs_cases, ag_cases


def _gather_v_cases(label: str, rows: list[int], width: int) -> list[Case]:
    import jax
    import jax.numpy as jnp
    from autopar.kernels import AllGatherVLayout, all_gather_v
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    p = DEVICES
    mesh = jax.make_mesh((p,), ("r",), axis_types=(jax.sharding.AxisType.Auto,))
    counts = tuple(r * width for r in rows)
    displs = tuple(int(sum(counts[:j])) for j in range(p))
    total_rows = sum(rows)
    shape = (total_rows, width)
    rng = np.random.default_rng(1)
    top = max(rows)
    data = rng.standard_normal((p * top, width)).astype(np.float32)
    x = jax.device_put(data, NamedSharding(mesh, P("r", None)))
    equal_rows = -(-total_rows // p)
    xe = jax.device_put(rng.standard_normal((p * equal_rows, width)).astype(np.float32),
                        NamedSharding(mesh, P("r", None)))

    def shard(body: Callable) -> Callable:
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("r", None), out_specs=P("r")))

    def equal(a: jax.Array) -> jax.Array:                 # same output size, equal inputs
        return lax.all_gather(a, "r", axis=0, tiled=True)[None]

    def pad_to_max(a: jax.Array) -> jax.Array:            # what a user would write
        return lax.all_gather(a, "r", axis=0, tiled=True)[None]

    def agv(method: str) -> Callable:
        return lambda a: all_gather_v(a, None, counts, displs, shape, "r", method=method)[None]

    def chunk_pass(a: jax.Array) -> jax.Array:
        """The balanced method without its ppermute: one select pass builds this rank's 1/p
        of the output from its own data, one all_gather of the equal chunks."""
        c = total_rows * width // p
        keep = jnp.arange(c) < lax.axis_index("r") * 7 + c // 2   # a rank-dependent mask
        chunk = jnp.where(keep, a.reshape(-1)[:c], jnp.zeros((), a.dtype))
        return lax.all_gather(chunk, "r", axis=0, tiled=True).reshape(shape)[None]

    want = np.zeros((total_rows, width), np.float32)
    at = 0
    for j, r in enumerate(rows):
        want[at:at + r] = data[j * top:j * top + r]
        at += r
    kernel = f"all_gather_v {label}"
    cases = [Case(kernel, "all_gather, equal-size inputs", _blocking(shard(equal), xe),
                  baseline=True),
             Case(kernel, "pad to max + all_gather", _blocking(shard(pad_to_max), x))]
    if label == "(ragged batch)":  # what this backend charges for the pieces of a method
        cases += [
            Case(kernel, "evidence: all_gather + slice of its output", _blocking(shard(
                lambda a: lax.all_gather(a, "r", axis=0, tiled=True)[:total_rows][None]), x)),
            Case(kernel, "evidence: one tiny ppermute", _blocking(shard(
                lambda a: lax.ppermute(a[:4], "r", [(i, (i + 1) % p) for i in range(p)])[None]),
                x)),
            Case(kernel, "evidence: all_gather of a chunk built in one pass, no ppermute",
                 _blocking(shard(chunk_pass), x))]
    chosen = AllGatherVLayout.build(counts, displs, shape).choose("auto")
    other = "padded" if chosen == "balanced" else "balanced"
    for method, variant in (("auto", f"all_gather_v (auto: {chosen})"),
                            (other, f"all_gather_v ({other})")):
        fn = shard(agv(method))
        _check(fn(x)[0], want, f"{kernel} {method}")
        cases.append(Case(kernel, variant, _blocking(fn, x),
                          goal="<= 1.2" if method == "auto" else ""))
    return cases


def _strided_cases(kind: str, rows: int, cols: int) -> list[Case]:
    """``kind`` ("all_gather" / "reduce_scatter") of a (rows, cols) f32 block per device
    along dim 1: lax's own (the baseline), autopar.collectives', and the same bytes along
    dim 0."""
    import dataclasses

    import jax
    from autopar.collectives import all_gather_dim, psum_scatter_dim
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    p = DEVICES
    mesh = jax.make_mesh((p,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    cols = cols if kind == "all_gather" else cols * p
    x = jax.device_put(np.random.default_rng(2).standard_normal((p * rows, cols), np.float32),
                       NamedSharding(mesh, P("d")))
    if kind == "all_gather":
        fns = [lambda b: lax.all_gather(b, "d", axis=1, tiled=True),
               lambda b: all_gather_dim(b, "d", 1),
               lambda b: lax.all_gather(b, "d", axis=0, tiled=True)]
    else:
        fns = [lambda b: lax.psum_scatter(b, "d", scatter_dimension=1, tiled=True),
               lambda b: psum_scatter_dim(b, "d", 1, p),
               lambda b: lax.psum_scatter(b, "d", scatter_dimension=0, tiled=True)]

    def shard(body: Callable) -> Callable:
        return jax.jit(jax.shard_map(lambda b: body(b)[None], mesh=mesh, in_specs=P("d"),
                                     out_specs=P("d")))

    label = f"{kind} along dim 1, {rows}x{cols} f32 blocks"
    names = ("jax.lax (XLA's own)", "autopar.collectives (leading axis + transpose)")
    cases = _cases(label, {n: shard(f) for n, f in zip(names, fns)}, (x,))
    cases[1] = dataclasses.replace(cases[1], goal="< 1")
    return cases + [Case(label, "evidence: the same bytes along dim 0",
                         _blocking(shard(fns[2]), x))]


def main(quick: bool = False) -> None:
    setup_devices(DEVICES)
    import jax

    if len(jax.devices()) < DEVICES:
        raise SystemExit(f"bench_kernels needs {DEVICES} devices, found {len(jax.devices())}")
    m, k, n = (256, 128, 128) if quick else (2048, 512, 512)
    rounds, repeat = (3, 1) if quick else (15, 2)
    width = 128 if quick else 512
    ragged = [32, 32, 32, 32, 32, 32, 32, 28] if quick else [256] * 7 + [252]
    skewed = [128, 16, 16, 16, 16, 16, 16, 16] if quick else [1024] + [128] * 7

    rs_cases, ag_cases = _matmul_cases(m, k, n)
    rows = _measure(rs_cases, rounds, repeat, seed=1)
    rows += _measure(ag_cases, rounds, repeat, seed=2)
    for row in rows:
        for cluster in ("accelerator-8x", "cpu-emulated"):
            row[f"predicted ratio {cluster}"] = _predicted(row["kernel"], row["variant"],
                                                           m, k, n, cluster)
        row["rewrite picks on"] = _picked_by(row["kernel"], row["variant"], m, k, n)
    # all_gather_v runs take milliseconds: more rounds and repeats for the same noise.
    for seed, (label, counts) in enumerate((("(ragged batch)", ragged), ("(skewed)", skewed))):
        rows += _measure(_gather_v_cases(label, counts, width), 4 * rounds, 4 * repeat,
                         seed=3 + seed)
    for seed, kind in enumerate(("all_gather", "reduce_scatter")):
        rows += _measure(_strided_cases(kind, *((32, 64) if quick else (128, 512))), rounds,
                         repeat, seed=5 + seed)
    meta = {
        "devices": DEVICES, "quick": quick, "rounds": rounds, "repeat": repeat,
        "all_gather_v rounds": 4 * rounds, "all_gather_v repeat": 4 * repeat,
        "mm_reduce_scatter": {"x_per_device": [m, k], "w_per_device": [k, n]},
        "all_gather_matmul": {"x_per_device": [m // DEVICES, k], "w_per_device": [k, n]},
        "all_gather_v": {"row_width": width, "ragged_rows": ragged, "skewed_rows": skewed},
        "ratio": "median over rounds of variant / baseline wall time in the same round",
        "cpu ratio": "the same with process CPU time",
        "jax": jax.__version__,
    }
    write_results("kernels", rows, COLUMNS, meta)  # --quick: to the scratch directory
    DOC_TABLES.write()


if __name__ == "__main__":
    run_main(main)
