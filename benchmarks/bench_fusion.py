"""Gradient split strategies in the iteration simulator (issue: communication fusion, part c).

ResNet-50 (per-device batch 32 and 256) and the zoo transformer (24 layers, hidden 1024,
16 heads, seq 512, vocab 32768, per-device batch 8), data parallel without a plan (every
device runs the traced graph; gradients = full parameter bytes, all-reduced over all devices)
on the accelerator-8x preset at 8, 64 and 512 devices. Every strategy is simulated in the same
model (autopar.timeline, hcom_parallel on): the advisor's split, HCCL's default 96.54/3.46,
one segment per gradient, one segment, MindSpore's auto fusion (64 MB), PyTorch DDP (1 MiB
then 25 MiB) and Horovod (128 MB buffer, 1 ms cycle).

Reported: iteration time and exposed communication (after bp_end) per strategy; the advisor's
time relative to the issue's lower bound max(FP+BP, all gradients in one all-reduce) (goal:
within 5 %), to a tight bound that adds what no split can avoid (communication cannot start
before the first gradient is ready; the last gradient's own all-reduce follows its
readiness), to the optimum over any number of segments, and to 96.54/3.46 (goal: better).

Writes benchmarks/results/fusion.json (summary), fusion_strategies.json (every strategy),
fusion_sync.json (the measured sync), fusion_trace.json (a Chrome trace),
docs/fusion_timeline.png and the tables between the markers of docs/fusion.md.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks._common import (
    ROOT,
    Col,
    DocTables,
    DocTexts,
    markdown_table,
    out_dir,
    run_main,
    write_results,
)

DOCS = ROOT / "docs"
#: The strategies of fusion_strategies.json, as the docs' column headers name them.
STRATEGIES = {"advised": "advised", "hccl_default_96.54/3.46": "96.54/3.46",
              "one_per_gradient": "per gradient", "one_segment": "one segment",
              "mindspore_auto_64MB": "MS auto 64MB", "pytorch_ddp_1+25MiB": "DDP 1+25MiB",
              "horovod_128MB": "Horovod 128MB"}
#: The rows of fusion_sync.json, as docs/fusion.md names them.
SYNCS = {"xla_combiner_161_psums": "XLA's combiner, 161 separate psums",
         "autopar_64MB_auto": "autopar 64 MB (auto)",
         "autopar_hccl_default_96.54/3.46": "autopar HCCL default 96.54/3.46",
         "autopar_advised": "autopar advised split"}


def _ms(ms: float) -> str:
    return f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def _advisor_table(rows: list[dict[str, Any]]) -> str:
    """The advisor against the bounds and against 96.54/3.46 (fusion.json)."""
    return markdown_table(rows, [
        "model", "devices", Col("FP+BP ms", lambda r: r["fp_ms"] + r["bp_ms"], ".1f"),
        Col("one all-reduce ms", "comm_1seg_ms", ".2f"),
        Col("lower bound ms", "lower_bound_ms", ".1f"),
        Col("tight bound ms", "tight_bound_ms", ".1f"),
        Col("advised ms (segments)",
            lambda r: f"{r['advised_ms']:.1f} ({r['advised_segments']})"),
        Col("advised split %", "advised_pct"), Col("x lower bound", "x_lower_bound", ".3f"),
        Col("x tight bound", "x_tight_bound", ".3f"),
        Col("x any #segments", "x_any_segments", ".3f"),
        Col("x 96.54/3.46", "x_default", ".3f")])


def _strategy_table(rows: list[dict[str, Any]], cell: Any) -> str:
    """One line per (model, devices), one column per strategy: ``cell(row)`` of its row in
    fusion_strategies.json."""
    cases: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        case = cases.setdefault((r["model"], r["devices"]),
                                {"model": r["model"], "devices": r["devices"]})
        case[STRATEGIES[r["strategy"]]] = cell(r)
    return markdown_table(list(cases.values()), ["model", "devices", *STRATEGIES.values()])


def _sync_table(rows: list[dict[str, Any]]) -> str:
    """The measured gradient sync (fusion_sync.json)."""
    return markdown_table(rows, [
        Col("sync", lambda r: SYNCS.get(r["sync"], r["sync"])), "buckets",
        Col("compiled all-reduces", "compiled_all_reduces"), Col("ms", fmt=".0f"),
        Col("x XLA", "x_xla", ".3f")])


def doc_tables(results: dict[str, dict]) -> DocTexts:
    """docs/fusion.md's ``fusion_advisor``, ``fusion_iteration``, ``fusion_exposed`` and
    ``fusion_sync`` tables."""
    every = results["fusion_strategies"]["rows"]
    return {("docs/fusion.md", "fusion_advisor"): _advisor_table(results["fusion"]["rows"]),
            ("docs/fusion.md", "fusion_iteration"): _strategy_table(
                every, lambda r: f"{_ms(r['iteration_ms'])} ({r['segments']})"),
            ("docs/fusion.md", "fusion_exposed"): _strategy_table(
                every, lambda r: _ms(r["exposed_ms"])),
            ("docs/fusion.md", "fusion_sync"): _sync_table(results["fusion_sync"]["rows"])}


DOC_TABLES = DocTables(("fusion", "fusion_strategies", "fusion_sync"), doc_tables)


def _models(quick: bool):
    from autopar.models import resnet50, transformer

    if quick:
        return [("resnet50 b32", resnet50(num_classes=1000, batch=32, image_size=224)),
                ("transformer L4", transformer(layers=4, hidden=1024, heads=16, seq=512,
                                               vocab=32768, batch=8))]
    return [("resnet50 b32", resnet50(num_classes=1000, batch=32, image_size=224)),
            ("resnet50 b256", resnet50(num_classes=1000, batch=256, image_size=224)),
            ("transformer L24", transformer(layers=24, hidden=1024, heads=16, seq=512,
                                            vocab=32768, batch=8))]


def main(quick: bool = False) -> None:
    rows = measure_sync(repeat=3 if quick else 15)
    write_results("fusion_sync", rows, ["sync", "buckets", "compiled_all_reduces", "ms",
                                        "x_xla"],
                  meta={"devices": 8, "model": "resnet50 (161 gradients, 97.5 MiB fp32)",
                        "goal": "x_xla <= 1.05", "quick": quick})
    simulate_splits(quick)
    DOC_TABLES.write()


def simulate_splits(quick: bool = False) -> None:
    import jax

    import autopar as ap

    devices = (8, 64) if quick else (8, 64, 512)
    summary, every = [], []
    plot_case = None
    for label, model in _models(quick):
        graph = ap.trace(model.loss, *jax.eval_shape(model.example_args, jax.random.key(0)))
        for n in devices:
            t0 = time.perf_counter()
            cmp = ap.simulation.compare_splits(graph, device_num=n, cluster="accelerator-8x")
            seconds = time.perf_counter() - t0
            adv = cmp.advice
            t = adv.trace
            default = cmp.traces["hccl_default_96.54/3.46"]
            alts = {k: v for k, v in cmp.traces.items() if k != "advised"}
            best_alt = min(alts, key=lambda k: alts[k].iteration_time)
            one = cmp.traces["one_segment"]
            summary.append({
                "model": label, "devices": n, "params": len(t.gradient_names),
                "grad_MB": sum(s.nbytes for s in t.segments) / 2**20,
                "fp_ms": t.fp_time * 1e3, "bp_ms": t.bp_time * 1e3,
                "comm_1seg_ms": one.comm_time * 1e3,
                "lower_bound_ms": adv.lower_bound * 1e3, "tight_bound_ms": adv.tight_bound * 1e3,
                "advised_ms": adv.iteration_time * 1e3, "advised_segments": len(adv.buckets),
                "advised_exposed_ms": t.exposed_comm * 1e3,
                "advised_pct": "/".join(f"{p:g}" for p in adv.percentages),
                "default_ms": default.iteration_time * 1e3,
                "x_lower_bound": adv.iteration_time / adv.lower_bound,
                "within_5pct": adv.iteration_time <= 1.05 * adv.lower_bound,
                "x_tight_bound": adv.iteration_time / adv.tight_bound,
                "x_any_segments": adv.iteration_time / adv.unbounded,
                "x_default": adv.iteration_time / default.iteration_time,
                "beats_default": adv.iteration_time < default.iteration_time,
                "best_alternative": best_alt,
                "x_best_alternative": adv.iteration_time / alts[best_alt].iteration_time,
                "advise_s": seconds,
            })
            for name, tr in cmp.traces.items():
                every.append({"model": label, "devices": n, "strategy": name,
                              "segments": len(tr.segments),
                              "iteration_ms": tr.iteration_time * 1e3,
                              "exposed_ms": tr.exposed_comm * 1e3,
                              "comm_ms": tr.comm_time * 1e3,
                              "x_advised": tr.iteration_time / adv.iteration_time,
                              "x_lower_bound": tr.iteration_time / adv.lower_bound})
            if label.startswith("transformer") and n == 64:
                plot_case = (label, n, adv)
    write_results("fusion", summary, [
        "model", "devices", "params", "grad_MB", "fp_ms", "bp_ms", "comm_1seg_ms",
        "lower_bound_ms", "tight_bound_ms", "advised_ms", "advised_segments",
        "advised_exposed_ms", "advised_pct", "default_ms", "x_lower_bound", "within_5pct",
        "x_tight_bound", "x_any_segments", "x_default", "beats_default", "best_alternative",
        "x_best_alternative", "advise_s"],
        meta={"cluster": "accelerator-8x", "overlap": True, "quick": quick,
              "note": "lower bound = max(FP+BP, one all-reduce of all gradients); tight bound "
                      "adds first-gradient-ready + all comm and last-gradient-ready + its own "
                      "all-reduce; x_any_segments: advised (<= 8 segments) / optimum over any "
                      "number of segments"})
    write_results("fusion_strategies", every, [
        "model", "devices", "strategy", "segments", "iteration_ms", "exposed_ms", "comm_ms",
        "x_advised", "x_lower_bound"], meta={"cluster": "accelerator-8x", "quick": quick})
    if plot_case is not None:
        label, n, adv = plot_case
        adv.trace.write_chrome_trace(out_dir() / "fusion_trace.json")
        png = adv.trace.plot((out_dir() if quick else DOCS) / "fusion_timeline.png",
                             title=f"{label}, {n} devices, advised split "
                                   f"{'/'.join(f'{p:g}' for p in adv.percentages)}: "
                                   f"{adv.iteration_time * 1e3:.1f} ms, exposed "
                                   f"{adv.trace.exposed_comm * 1e3:.1f} ms")
        print(f"(timeline written to {png})")


# ---------------------------------------------------------------------------- (b) measured cost


def measure_sync(repeat: int = 5) -> list[dict]:
    """Gradient sync of ResNet-50's 161 gradients on 8 emulated devices: XLA's own combining of
    161 separate psums vs autopar's buckets (64 MB auto, HCCL default 96.54/3.46, the advised
    split), each kept by XLA as one all-reduce (counted in the compiled program); timed
    side by side, interleaved, in one run."""
    import re

    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import autopar as ap
    from autopar.fusion import buckets_by_percent, buckets_by_size
    from autopar.grad_sync import _dependency, bucket_indices, sync_gradients
    from autopar.models import resnet50
    from benchmarks._common import timeit

    model = resnet50(num_classes=1000, batch=32, image_size=224)
    graph = ap.trace(model.loss, *jax.eval_shape(model.example_args, jax.random.key(0)))
    order = list(graph.gradient_order())
    grads = [(n, graph.spec(n).nbytes) for n in order]
    advice = ap.simulation.advise_split(graph, device_num=8)
    configs = {
        "xla_combiner_161_psums": None,
        "autopar_64MB_auto": buckets_by_size(grads, 64 * 2**20),
        "autopar_hccl_default_96.54/3.46": buckets_by_percent(grads, [96.54, 3.46]),
        "autopar_advised": advice.buckets,
    }
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    n = len(order)
    shapes = [graph.spec(v).shape for v in order]
    rng = np.random.default_rng(0)
    arrays = [jax.device_put(np.ones((8,), np.float32), NamedSharding(mesh, P("d")))] + [
        jax.device_put(rng.standard_normal((8,) + s).astype(np.float32),
                       NamedSharding(mesh, P("d"))) for s in shapes]

    def build(buckets):
        """Backward emulated as the training step runs it: the gradients of bucket k are
        produced (``x * c``) from a cotangent ``c`` that passed bucket k-1's sync point (a
        scalar dependency on its results, :func:`autopar.grad_sync.sync_point`'s rule); the
        XLA baseline produces the same gradients from one ``c`` and psums each alone."""
        idx = [list(range(n))] if buckets is None else bucket_indices(order, buckets)

        def body(c, *xs):
            c = c[0]
            out = [None] * n
            for members in idx:
                part = [xs[i][0] * c for i in members]
                if buckets is None:  # 161 separate psums, left to XLA's combiner
                    res = [lax.psum(x, "d") for x in part]
                else:
                    res = sync_gradients(part, [("d",)] * len(part), [list(range(len(part)))],
                                         chain=False)
                    c = c + _dependency(res, c)
                for i, r in zip(members, res):
                    out[i] = r
            return tuple(o[None] for o in out)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"),) * (n + 1),
                                     out_specs=(P("d"),) * n, check_vma=False))

    fns = {k: build(b) for k, b in configs.items()}
    rows = []
    for k, f in fns.items():
        text = f.lower(*arrays).compile().as_text()
        entry = text[text.index("ENTRY"):]
        ops = len(re.findall(r"\ball-reduce(-start)?\(", entry))
        out = f(*arrays)
        np.testing.assert_allclose(np.asarray(out[0][0]), np.asarray(arrays[1]).sum(0),
                                   rtol=1e-4, atol=1e-4)
        rows.append({"sync": k, "buckets": len(configs[k]) if configs[k] is not None else n,
                     "compiled_all_reduces": ops})
    times = {k: [] for k in fns}
    for _ in range(repeat):  # interleaved, so drift hits every variant alike
        for k, f in fns.items():
            times[k].append(timeit(lambda f=f: jax.block_until_ready(f(*arrays)), repeat=1))
    base = float(np.median(times["xla_combiner_161_psums"]))
    for r in rows:
        t = float(np.median(times[r["sync"]]))
        r["ms"] = t * 1e3
        r["x_xla"] = t / base
    return rows


if __name__ == "__main__":
    run_main(main)
