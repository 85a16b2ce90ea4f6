"""Plan a 1000-GPU training job, shapes only: autopar's configuration search against the
hand configuration published for the same run, both priced by the same model, and against
the published step.

Cases (:data:`CASES`), bfloat16 parameters and activations, traced as shapes (nothing is
allocated), on the GPU presets (``dgx-a100-80gb``, ``dgx-h100-80gb``; docs/design/0020):

- GPT-3 175B (96 layers, hidden 12288, 96 heads, seq 2048, vocab 51200; the zoo
  ``transformer``), global batch 1536, on 1024 A100: Megatron-LM's TP 8 x PP 16 x DP 8,
  one sequence per micro-batch per replica (192), about 140 TFLOP/s per GPU counted with
  recomputation, a step of about 31.5 s (Narayanan et al. 2021).
- The same on 1024 H100: Megatron-Core's TP 4 x PP 8 for GPT-3 175B, 47 % MFU (its
  README's benchmark table); the published step is derived from that MFU.
- Llama-2 70B (80 layers, hidden 8192, 64 heads of which 8 key / value, MLP 28672, RoPE;
  ``benchmarks/llama_rope.py``), 4M tokens a step (1024 sequences of 4096) on 512 A100:
  323 tokens/s per GPU (Touvron et al. 2023, from its GPU-hours), a step of 25.4 s. Meta
  published no layout; the hand configuration is TP 8 x PP 8 x DP 8.
- Llama-2 7B (32 layers, hidden 4096), 4M tokens on 64 A100: 3,014 tokens/s per GPU, a step
  of 21.7 s; the hand configuration is data parallel over 64 with the parallel optimizer
  (ZeRO-1), 16 accumulated micro-batches of one sequence per GPU and selective
  recomputation (standing in for fused attention: neither keeps the ``[heads, s, s]``
  scores).

The hand configurations of the H100 and Llama-2 runs shard the optimizer state (Megatron's
distributed optimizer, MindSpore's parallel optimizer); the 2021 A100 run did not.

Per case, in a process of its own (its peak RSS is the search's):
``autopar`` is :func:`autopar.search_configuration` under ``auto_pipeline=True``, as
``train_step`` runs it with Adam (every pipeline degree, power-of-two micro-batch sizes,
GPipe and 1F1B, the parallel optimizer tried, the default search mode), and ``hand`` is
:func:`~autopar.pipeline.configure.price_configuration` of the published configuration:
Megatron's weight matmuls fixed at its tensor-parallel degree
(:func:`~autopar.strategies.baselines.megatron_strategies`), the rest propagated
(``sharding_propagation``), under the better of autopar's two schedules (Megatron runs an
interleaved 1F1B that neither models). MFU is the model's FLOPs (3 x the traced forward's,
no recomputation) over the devices' datasheet bfloat16 peak x the step.

    .venv/bin/python -m benchmarks scale [--quick]

``--quick``: the Llama-2 7B case at 4 layers on 8 devices, a smoke run.
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks._common import (
    ROOT,
    Col,
    DocTables,
    DocTexts,
    markdown_table,
    run_main,
    write_results,
)

COLUMNS = ("case", "devices", "who", "stages", "micro_batches", "schedule", "par_opt",
           "recompute", "mesh",
           "step_s", "mfu", "memory_GiB", "fits", "vs_hand", "vs_published", "published_s",
           "published_mfu", "search_s", "rss_MB", "status")

#: datasheet dense bfloat16 peaks (FLOP/s) the MFU is taken against
PEAK = {"dgx-a100-80gb": 312e12, "dgx-h100-80gb": 989.4e12}

GPT3 = dict(kind="gpt", layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
LLAMA70 = dict(kind="llama", layers=80, hidden=8192, heads=64, kv_heads=8, seq=4096,
               ffn=28672, vocab=32000)
LLAMA7 = dict(kind="llama", layers=32, hidden=4096, heads=32, seq=4096, ffn=11008,
              vocab=32000)


@dataclass(frozen=True)
class Case:
    """One training job: the model's shapes, the global batch (sequences), the devices and
    their preset, the hand configuration (``tp`` x ``pp`` with ``micro`` micro-batches, tp
    1: data parallel; ``zero``: with the parallel optimizer; ``recompute``: on one stage,
    the recomputation it runs with -- a pipelined step recomputes every stage) and the
    published step or MFU."""

    name: str
    model: dict[str, Any]
    batch: int
    devices: int
    cluster: str
    tp: int
    pp: int
    micro: int
    zero: bool
    recompute: str = "none"
    published_s: float | None = None
    published_mfu: float | None = None
    source: str = ""


CASES = (
    Case("GPT-3 175B / A100", GPT3, 1536, 1024, "dgx-a100-80gb", 8, 16, 192, False,
         published_s=31.5,
         source="Megatron-LM, Narayanan et al. 2021"),
    Case("GPT-3 175B / H100", GPT3, 1536, 1024, "dgx-h100-80gb", 4, 8, 48, True,
         published_mfu=0.47,
         source="Megatron-Core README"),
    Case("Llama-2 70B / A100", LLAMA70, 1024, 512, "dgx-a100-80gb", 8, 8, 128, True,
         published_s=4096 * 1024 / (512 * 323), source="Touvron et al. 2023 (GPU-hours)"),
    Case("Llama-2 7B / A100", LLAMA7, 1024, 64, "dgx-a100-80gb", 1, 1, 16, True, "selective",
         published_s=4096 * 1024 / (64 * 3014), source="Touvron et al. 2023 (GPU-hours)"),
)

QUICK = Case("Llama-2 7B x4 / A100 (quick)", dict(LLAMA7, layers=4), 64, 8, "dgx-a100-80gb",
             1, 1, 8, True)


def _loss_and_shapes(model: dict, batch: int) -> tuple[Any, tuple[Any, ...]]:
    """``(loss(params, tokens, targets), (params, tokens, targets) as shapes)``, bfloat16."""
    import functools

    import jax
    import jax.numpy as jnp

    sizes = {k: v for k, v in model.items() if k not in ("kind", "layers")}
    if model["kind"] == "gpt":
        from autopar.models import transformer

        m = transformer(layers=model["layers"], batch=batch, dtype=jnp.bfloat16, **sizes)
        return m.loss, jax.eval_shape(m.example_args, jax.random.key(0))
    from benchmarks.llama_rope import llama_loss, llama_shapes

    loss = functools.partial(llama_loss, heads=model["heads"])
    return loss, llama_shapes(model["layers"], batch=batch, dtype=jnp.bfloat16, **sizes)


def _row(case: Case, who: str, conf: Any, flops: float, seconds: float | None,
         rss: float) -> dict[str, Any]:
    ok = not conf.failed
    step = conf.step_seconds if ok else None
    return {"case": case.name, "devices": case.devices, "who": who, "stages": conf.stages,
            "micro_batches": conf.micro_batches, "schedule": conf.schedule if ok else "-",
            "mesh": conf.layout(), "par_opt": conf.parallel_optimizer,
            "recompute": "stages" if conf.stages > 1 else conf.recompute,
            "step_s": step, "mfu": flops / (case.devices * PEAK[case.cluster] * step)
            if ok else None, "memory_GiB": conf.memory_bytes / 2 ** 30 if ok else None,
            "fits": conf.fits, "search_s": seconds, "rss_MB": rss if seconds else None,
            "status": "ok" if conf.fits else conf.failed or "memory over the budget"}


def run_case(case: Case) -> list[dict[str, Any]]:
    """Both configurations of one case, priced (in this process)."""
    import optax

    import autopar as ap
    from autopar.pipeline.configure import Configuration, micro_graphs, price_configuration
    from autopar.setup import resolve_setup
    from autopar.strategies.baselines import megatron_strategies

    loss, (params, tokens, targets) = _loss_and_shapes(case.model, case.batch)
    adam = optax.adam(1e-4)
    t0 = time.perf_counter()
    with ap.auto_parallel_context(device_num=case.devices, parallel_mode="auto_parallel",
                                  auto_pipeline=True):
        try:
            best = ap.search_configuration(loss, params, (tokens, targets), adam,
                                           cluster=case.cluster).best
        except ap.MemoryBudgetError as e:  # (a finding: its row says so)
            best = Configuration(1, 1, "-", math.inf, e.needed, e.budget, 1.0, (),
                                 failed=str(e).splitlines()[0])
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    graph_at, _ = micro_graphs(loss, params, (tokens, targets))
    flops = 3.0 * sum(n.flops for n in graph_at(1).nodes)
    with ap.auto_parallel_context(device_num=case.devices, parallel_mode="auto_parallel",
                                  enable_parallel_optimizer=case.zero,
                                  recompute=case.recompute):
        setup = resolve_setup(case.cluster)
    # (tp 1: the weight matmuls split over the batch alone, data parallel)
    fixed = megatron_strategies(graph_at(case.micro), case.devices // case.pp, case.tp)
    hand = [price_configuration(graph_at, case.pp, case.micro, setup=setup, schedule=s,
                                mode="sharding_propagation", fixed=fixed, optimizer=adam)
            for s in (("gpipe", "1f1b") if case.pp > 1 else ("gpipe",))]
    best_hand = min(hand, key=lambda c: (not c.fits, c.step_seconds))
    rows = [_row(case, "autopar", best, flops, seconds, rss),
            _row(case, f"hand: TP {case.tp} x PP {case.pp}", best_hand, flops, None, rss)]
    return _with_ratios(case, rows, flops)


def _with_ratios(case: Case, rows: list[dict[str, Any]], flops: float
                 ) -> list[dict[str, Any]]:
    """The rows with the published step and MFU (the one derived from the other) and each
    step over the hand configuration's and over the published one (None where missing)."""
    hand = rows[1]
    peak = case.devices * PEAK[case.cluster]
    published = case.published_s
    if published is None and case.published_mfu is not None:
        published = flops / (peak * case.published_mfu)
    for r in rows:
        r["published_s"] = published
        r["published_mfu"] = flops / (peak * published) if published else None
        r["vs_hand"] = r["step_s"] / hand["step_s"] \
            if r["step_s"] and hand["step_s"] else None
        r["vs_published"] = r["step_s"] / published if r["step_s"] and published else None
    return rows


def _child(index: int, quick: bool) -> None:
    """``python -m benchmarks.bench_scale --case K``: one case's rows as JSON on stdout."""
    from benchmarks._common import setup_devices

    setup_devices(8)
    case = QUICK if quick else CASES[index]
    print(json.dumps(run_case(case)))


def main(quick: bool = False) -> None:
    rows = []
    for k, case in enumerate((QUICK,) if quick else CASES):
        cmd = [sys.executable, "-m", "benchmarks.bench_scale", "--case", str(k)]
        done = subprocess.run(cmd + (["--quick"] if quick else []), cwd=ROOT,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{case.name}: {done.stderr.strip().splitlines()[-1]}")
        rows += json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{case.name}: done", flush=True)
    write_results("scale", rows, COLUMNS, meta={"quick": quick, "command": "python -m "
                                                "benchmarks scale"})
    DOC_TABLES.write()


def doc_tables(results: dict[str, dict]) -> DocTexts:
    """docs/scale.md's ``scale`` table."""
    rows = [{k: "-" if v is None else v for k, v in r.items()} for r in results["scale"]["rows"]]
    return {("docs/scale.md", "scale"): markdown_table(rows, [
        "case", "who", "stages", Col("m", "micro_batches"), "schedule",
        Col("par. opt.", lambda r: "yes" if r["par_opt"] else "no"),
        Col("recompute", lambda r: r.get("recompute", "-")), Col("stage mesh", "mesh"),
        Col("step s", "step_s", ".2f"), Col("MFU", "mfu", ".1%"),
        Col("memory GiB", "memory_GiB", ".1f"), Col("/ hand", "vs_hand", ".2f"),
        Col("/ published", "vs_published", ".2f"), Col("published s", "published_s", ".1f"),
        Col("search s", "search_s", ".1f"), Col("RSS MB", "rss_MB", ".0f"), "status"])}


DOC_TABLES = DocTables(("scale",), doc_tables)


if __name__ == "__main__":
    if "--case" in sys.argv:
        _child(int(sys.argv[sys.argv.index("--case") + 1]), "--quick" in sys.argv)
    else:
        run_main(main)
