"""Pipeline parallelism: step time and per-device memory on 8 emulated devices, and the
simulated step on the accelerator preset at 64 and 512 devices.

Measured (one run, side by side; the zoo transformer, Adam):

- ``dp8``: :func:`autopar.train_step` under ``data_parallel`` (every device holds the whole
  model and its optimizer state), with and without ``enable_parallel_optimizer``;
- ``dp4 x pp2`` / ``dp2 x pp4``: :func:`autopar.pipeline_train_step` (1F1B and GPipe,
  ``m = 2p`` micro-batches), data parallel inside each stage, parameters as packed
  stage buffers, with and without ``enable_parallel_optimizer`` (default threshold 64 KB).

Per device (device 0): ``state_MB`` = bytes of parameters + optimizer state actually stored on
it (summed over the arrays' shards); ``temp_MB`` / ``arg_MB`` = the compiled step's
``memory_analysis()`` (temporaries: activations, stashed micro-batch inputs, gradients;
arguments: parameters, state, batch). ``step_ms``: median wall time of a step, the
configurations timed round-robin (7 rounds) so that they share the machine's noise (2 CPU cores
shared by 8 emulated devices: compare ratios, not absolutes). ``sim_ms``: the same step
simulated on the cluster it was planned for (the default path: this machine's cached
calibration, else the ``cpu-emulated`` preset): :func:`autopar.simulation.simulate` for ``dp8``,
:func:`autopar.simulation.simulate_pipeline` with the step's own stage plans for the others.

Simulated: :func:`autopar.simulation.simulate` (data parallel, HCCL default split, all-reduce
overlapped with backward) vs :func:`autopar.simulation.simulate_pipeline` (1F1B and GPipe, the
stage search's cuts, data parallel inside stages, gradient all-reduce after the last backward),
a 24-layer GPT (hidden 1024, seq 512), global batch 4 x devices sequences in every configuration
(``m = 2p`` micro-batches, 2 sequences per device per micro-batch).

    .venv/bin/python -m benchmarks pipeline [--quick]
"""

from __future__ import annotations

from typing import Any

from benchmarks._common import (
    Col,
    DocTables,
    DocTexts,
    markdown_table,
    run_main,
    setup_devices,
    timeit,
    write_results,
)

COLUMNS = ("kind", "config", "devices", "schedule", "micro_batches", "parallel_optimizer",
           "step_ms", "state_MB", "temp_MB", "arg_MB", "loss_ok", "bubble", "sim_ms",
           "sim_vs_dp")


def _yes_no(key: str) -> Any:
    return lambda row: "yes" if row[key] else "no"


def _measured_table(rows: list[dict[str, Any]]) -> str:
    dp8 = next(r["step_ms"] for r in rows if r["config"] == "dp8" and not r["parallel_optimizer"])
    return markdown_table(rows, [
        Col("config (8 CPU devices)", "config"), "schedule", Col("m", "micro_batches"),
        Col("parallel optimizer", _yes_no("parallel_optimizer")),
        Col("step ms", "step_ms", ".0f"), Col("step / dp8", lambda r: r["step_ms"] / dp8, ".2f"),
        Col("simulated ms", "sim_ms", ".0f"),
        Col("simulated / measured", lambda r: r["sim_ms"] / r["step_ms"], ".2f"),
        Col("params + Adam state MB", "state_MB", ".2f"), Col("temp MB", "temp_MB", ".2f"),
        Col("loss = 1 device", _yes_no("loss_ok"))])


def _simulated_table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(rows, [
        Col("simulated (accelerator-8x)", "config"), "devices", "schedule",
        Col("m", "micro_batches"),
        Col("bubble", fmt=".1%"), Col("step ms", "sim_ms", ".1f"),
        Col("step / data parallel", "sim_vs_dp", ".3f")])


def doc_tables(results: dict[str, dict]) -> DocTexts:
    """docs/pipeline.md's ``pipeline_measured`` and ``pipeline_simulated`` tables."""
    rows = results["pipeline"]["rows"]
    return {("docs/pipeline.md", "pipeline_measured"):
            _measured_table([r for r in rows if r["kind"] == "measured"]),
            ("docs/pipeline.md", "pipeline_simulated"):
            _simulated_table([r for r in rows if r["kind"] == "simulated"])}


DOC_TABLES = DocTables(("pipeline",), doc_tables)


def _mb(x: float) -> float:
    return round(x / 2**20, 3)


def measured(quick: bool) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import autopar as ap
    from autopar.models import transformer
    from autopar.optimizer_shard import device_bytes

    model = transformer(layers=4, hidden=64 if quick else 128, heads=4, seq=32,
                        vocab=512 if quick else 1024, batch=32)
    params, *batch = model.example_args(jax.random.key(0))
    opt = optax.adam(1e-3)
    ref_loss = float(model.loss(params, *batch))
    graph = ap.trace(model.loss, params, *batch)
    dev0 = jax.devices()[0]

    runs: list[tuple[dict[str, Any], Any]] = []

    def row(config: str, sched: str, m: Any, po: bool, fn: Any, state: Any, lowered: Any,
            loss: float, sim: Any) -> None:
        stats = lowered.compile().memory_analysis()
        runs.append(({"kind": "measured", "config": config, "devices": 8, "schedule": sched,
                      "micro_batches": m, "parallel_optimizer": po,
                      "sim_ms": round(sim.step_time * 1e3, 3),
                      "state_MB": _mb(device_bytes(state, dev0)),
                      "temp_MB": _mb(stats.temp_size_in_bytes),
                      "arg_MB": _mb(stats.argument_size_in_bytes),
                      "loss_ok": bool(np.isclose(loss, ref_loss, rtol=1e-5))}, fn))
        print(runs[-1][0], flush=True)

    for po in (False, True):
        with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                      gradients_mean=True, enable_parallel_optimizer=po):
            step = ap.train_step(model.loss, params, tuple(batch), opt)
        p, s = step.prepare(params), step.init(params)
        _, _, loss = step(p, s, *batch)

        def run(step: Any = step, p: Any = p, s: Any = s) -> None:
            jax.block_until_ready(step(p, s, *batch))

        row("dp8", "-", 1, po, run, (p, s), step.lower(p, s, *batch), float(loss),
            ap.simulation.simulate(graph, step.plan))

    configs = [(2, "1f1b", False), (2, "1f1b", True), (4, "1f1b", False), (4, "1f1b", True),
               (4, "gpipe", False)]
    if quick:
        configs = configs[:3]
    for stages, sched, po in configs:
        m = 2 * stages
        with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                      gradients_mean=True, pipeline_stages=stages,
                                      enable_parallel_optimizer=po):
            step = ap.pipeline_train_step(model.loss, params, tuple(batch), opt,
                                          micro_batches=m, schedule=sched)
        p, s = step.pack(params), step.init(params)
        _, _, loss = step(p, s, *batch)

        def run(step: Any = step, p: Any = p, s: Any = s) -> None:
            jax.block_until_ready(step(p, s, *batch))

        row(f"dp{8 // stages} x pp{stages}", sched, m, po, run, (p, s),
            step.lower(p, s, *batch), float(loss),
            ap.simulation.simulate_pipeline(step.graph, stages, micro_batches=m,
                                            schedule=sched, device_num=8, plans=step.plans))
    # time side by side: round-robin over the configurations, median per configuration
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(3 if quick else 7):
        for i, (_, fn) in enumerate(runs):
            samples[i].append(timeit(fn, repeat=1, warmup=0))
    rows = []
    for (r, _), t in zip(runs, samples):
        r["step_ms"] = round(sorted(t)[len(t) // 2] * 1e3, 2)
        rows.append(r)
    del jnp
    return rows


def _simulated_row(dp: int, pp: int, n: int, sched: str, m: int, sim: float, bubble: float,
                   base: float) -> dict[str, Any]:
    row = {"kind": "simulated", "config": f"dp{dp}" + (f" x pp{pp}" if pp > 1 else ""),
           "devices": n, "schedule": sched, "micro_batches": m, "parallel_optimizer": False,
           "bubble": round(bubble, 4), "sim_ms": round(sim * 1e3, 3),
           "sim_vs_dp": round(sim / base, 3)}
    print(row, flush=True)
    return row


def simulated(quick: bool) -> list[dict[str, Any]]:
    import jax

    import autopar as ap
    from autopar.models import transformer

    layers = 8 if quick else 24
    rows = []
    for n in (64, 512):
        base = None
        for pp in (1, 2, 4, 8):
            dp = n // pp
            m = 1 if pp == 1 else 2 * pp
            rows_per_mb = 4 * n // m     # global batch 4 x n sequences, same for every row
            mdl = transformer(layers=layers, hidden=1024, heads=16, seq=512, vocab=32768,
                              batch=rows_per_mb)
            g = ap.trace(mdl.loss, *jax.eval_shape(mdl.example_args, jax.random.key(0)))
            if pp == 1:
                with ap.auto_parallel_context(device_num=n, parallel_mode="data_parallel"):
                    plan = ap.search(g, device_num=n, cluster="accelerator-8x")
                t = ap.simulation.simulate(g, plan, buckets="hccl", cluster="accelerator-8x")
                sim, bubble = t.step_time, 0.0  # (launch, iteration, optimizer update)
                base = sim
                rows.append(_simulated_row(dp, pp, n, "-", m, sim, bubble, base))
                continue
            for sched in ("1f1b", "gpipe"):
                t = ap.simulation.simulate_pipeline(g, pp, micro_batches=m, schedule=sched,
                                                    device_num=n, cluster="accelerator-8x")
                rows.append(_simulated_row(dp, pp, n, sched, m, t.step_time, t.bubble, base))
    return rows


def main(quick: bool = False) -> None:
    setup_devices(8)
    rows = measured(quick) + simulated(quick)
    write_results("pipeline", rows, COLUMNS, meta={"quick": quick})
    DOC_TABLES.write()


if __name__ == "__main__":
    run_main(main)
