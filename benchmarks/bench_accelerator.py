"""The GPU presets checked on a GPU: calibration against the datasheet, and a one-device
training step's time and memory, predicted against measured.

Run where an accelerator is present (``JAX_PLATFORMS=cuda python -m benchmarks
accelerator``); on CPUs it refuses in one line and the committed table stays. Three parts:

- **calibration**: ``ap.calibrate`` on the device (fresh, nothing cached): each dtype's
  matmul peak, the memory bandwidth and the launch costs, beside the device's datasheet
  (dense figures; float32 matmuls run on TF32 tensor cores, JAX's default on NVIDIA GPUs)
  and the figure of the preset autopar prices the device with when nothing was measured
  (:func:`autopar.clusters.default_preset`: ``dgx-h100-80gb`` for an H100 or H200);
- **step**: a Llama-style decoder (``benchmarks/llama_rope.py``: RMSNorm, RoPE, SwiGLU;
  bfloat16 weights and activations, Adam) trained on one device: ``jax.jit`` of
  ``value_and_grad`` + optax and :func:`autopar.train_step`, timed in interleaved rounds;
  autopar's predicted step on the calibrated cluster and on the preset;
- **memory**: XLA's ``compiled.memory_analysis()`` against the model, as
  ``python -m benchmarks memory`` does (:mod:`benchmarks.bench_memory`): the two steps
  above, the decoder's gradient function, and a float32 decoder with and without
  ``jax.checkpoint`` (scanned and unrolled), where a GPU compiler keeps the recomputation.

Writes ``benchmarks/results/accelerator.json`` and the tables between the
``accelerator_*`` markers of docs/scale.md.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from typing import Any

from benchmarks._common import (Col, DocTables, DocTexts, markdown_table, run_main,
                                write_results)

#: Dense datasheet figures (NVIDIA's SXM parts): matmul FLOP/s per dtype (float32 on TF32
#: tensor cores) and memory bytes/s; keyed by a word of ``device_kind``.
DATASHEETS = {
    "H200": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12,
             "bandwidth": 4.8e12},
    "H100": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12,
             "bandwidth": 3.35e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12,
             "bandwidth": 2.039e12},
}
#: The decoder of the step (quick: a smoke size that runs on a CPU).
STEP = dict(layers=4, hidden=2048, heads=16, seq=2048, ffn=5632, vocab=32000, batch=8)
QUICK = dict(layers=1, hidden=64, heads=4, seq=32, ffn=128, vocab=256, batch=2)
ROUNDS = 10
COLUMNS = ("part", "what", "measured", "model", "model/measured", "datasheet",
           "measured/datasheet", "note")
MB = 2 ** 20


def doc_tables(results: dict[str, dict]) -> DocTexts:
    """docs/scale.md's ``accelerator`` table, from accelerator.json."""
    payload = results["accelerator"]
    cols = ["part", "what", Col("measured", fmt=".4g"), Col("model", fmt=".4g"),
            Col("model/measured", fmt=".3f"), Col("datasheet", fmt=".4g"),
            Col("measured/datasheet", fmt=".3f"), "note"]
    meta = payload["meta"]
    head = (f"{meta.get('device_kind', '?')}, jax {meta.get('jax', '?')}, "
            f"calibrated in {meta.get('calibration_s', 0):.0f} s\n\n")
    return {("docs/scale.md", "accelerator"): head + markdown_table(payload["rows"], cols)}


DOC_TABLES = DocTables(("accelerator",), doc_tables)


def _sheet(kind: str) -> dict[str, float]:
    return next((sheet for word, sheet in DATASHEETS.items() if word in kind), {})


def calibration_rows(cluster: Any, preset: Any) -> list[dict[str, Any]]:
    """What ``ap.calibrate`` measured, beside the datasheet and the preset."""
    sheet = _sheet(cluster.calibration.device_kind)
    rows = []
    for dtype in ("bfloat16", "float16", "float32"):
        got = cluster.peak_flops_by_dtype.get(dtype, cluster.peak_flops)
        pre = preset.peak_flops_by_dtype.get(dtype, preset.peak_flops)
        rows.append(_row("calibration", f"{dtype} matmul TFLOP/s", got / 1e12, pre / 1e12,
                         sheet.get(dtype, 0) / 1e12, f"preset {preset.name}"))
    rows.append(_row("calibration", "memory TB/s", cluster.memory_bandwidth / 1e12,
                     preset.memory_bandwidth / 1e12, sheet.get("bandwidth", 0) / 1e12,
                     "x * a + b, read + write"))
    for what, value, pre in (("operator launch us", cluster.op_overhead, preset.op_overhead),
                             ("step launch us", cluster.step_overhead, preset.step_overhead)):
        rows.append(_row("calibration", what, value * 1e6, pre * 1e6, 0, ""))
    return rows


def _row(part: str, what: str, measured: float, model: float | None, sheet: float,
         note: str) -> dict[str, Any]:
    row: dict[str, Any] = {"part": part, "what": what, "measured": measured, "note": note}
    if model is not None:
        row |= {"model": model, "model/measured": model / measured}
    if sheet:
        row |= {"datasheet": sheet, "measured/datasheet": measured / sheet}
    return row


def decoder(sizes: dict[str, int]) -> tuple[Any, Any, tuple]:
    """(loss, bfloat16 params, (tokens, targets)) of the Llama-style decoder, random init."""
    import jax
    import jax.numpy as jnp

    from benchmarks.llama_rope import llama_loss, llama_shapes

    shapes = llama_shapes(dtype=jnp.bfloat16, **sizes)
    leaves, tree = jax.tree.flatten(shapes[0])
    keys = jax.random.split(jax.random.key(0), len(leaves) + 1)
    params = jax.tree.unflatten(tree, [
        jnp.ones(s.shape, s.dtype) if len(s.shape) == 1
        else (0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype)
        for k, s in zip(keys, leaves)])
    tokens = jax.random.randint(keys[-1], shapes[1].shape, 0, sizes["vocab"], jnp.int32)
    return functools.partial(llama_loss, heads=sizes["heads"]), params, (tokens, tokens)


def _jit_step(loss: Any, optimizer: Any) -> Any:
    import jax
    import optax

    def step(params: Any, opt: Any, *batch: Any) -> tuple:
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt = optimizer.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    return jax.jit(step)


def _interleaved(steps: list[tuple[Any, list]], batch: tuple, rounds: int) -> list[float]:
    import jax

    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for k, (step, state) in enumerate(steps):
            t0 = time.perf_counter()
            params, opt, loss = step(*state, *batch)
            jax.block_until_ready(loss)
            times[k].append(time.perf_counter() - t0)
            state[:] = [params, opt]
    return [statistics.median(ts) for ts in times]


def step_rows(cluster: Any, preset: Any, sizes: dict[str, int], rounds: int
              ) -> list[dict[str, Any]]:
    """The decoder's training step on one device: time and memory, jax.jit and autopar."""
    import jax
    import optax

    import autopar as ap
    from benchmarks.bench_memory import xla_bytes

    loss, params, batch = decoder(sizes)
    optimizer = optax.adam(1e-4)
    plain = _jit_step(loss, optimizer)
    with ap.auto_parallel_context(device_num=1, parallel_mode="auto_parallel"):
        step = ap.train_step(loss, params, batch, optimizer, cluster=cluster)
        priced = ap.train_step(loss, params, batch, optimizer, cluster=preset)
    opt = optimizer.init(params)
    entries = [(plain, [params, opt]), (step, [step.prepare(params), step.init(params)])]
    for f, state in entries:  # compile and warm up
        jax.block_until_ready(f(*state, *batch)[2])
    t_jit, t_ap = _interleaved(entries, batch, rounds)
    tokens = sizes["batch"] * sizes["seq"]
    note = f"{sizes['layers']} layers, hidden {sizes['hidden']}, {tokens} tokens"
    rows = [_row("step", "jax.jit step ms", t_jit * 1e3, None, 0, note),
            _row("step", "autopar step ms", t_ap * 1e3, step.plan.cost.total * 1e3, 0,
                 "model: calibrated"),
            _row("step", "autopar step ms", t_ap * 1e3, priced.plan.cost.total * 1e3, 0,
                 f"model: {preset.name}")]
    jit_mb = xla_bytes(plain.lower(params, opt, *batch).compile())[0] / MB
    ap_mb = xla_bytes(step.lower(step.prepare(params), step.init(params),
                                 *batch).compile())[0] / MB
    rows += [_row("memory", "jax.jit step MiB", jit_mb, None, 0, "argument + output + temp"),
             _row("memory", "autopar step MiB", ap_mb, step.plan.cost.memory_bytes / MB, 0,
                  "plan.cost.memory_bytes")]
    return rows


def memory_rows(cluster: Any, sizes: dict[str, int], quick: bool) -> list[dict[str, Any]]:
    """Gradient functions on one device: XLA's bytes against the model's peak."""
    import jax

    from benchmarks.bench_memory import one_device, remat_decoder

    rows = []
    cases = [("decoder grad, bfloat16", lambda: decoder(sizes))]
    names = jax.checkpoint_policies.save_only_these_names("attn_out", "mlp_out")
    dims = dict(seq=64, hidden=64, batch=2) if quick else dict(seq=1024, hidden=1024, batch=8)
    for scan, policy, label in ((True, None, "scanned"), (True, "full", "scanned, remat"),
                                (True, names, "scanned, remat names"),
                                (False, None, "unrolled"), (False, "full", "unrolled, remat")):
        cases.append((f"float32 decoder grad, {label}",
                      functools.partial(remat_decoder, scan, policy, **dims)))
    for what, build in cases:
        try:
            loss, params, batch = build()
            r = one_device(loss, params, batch, cluster)
            rows.append(_row("memory", what + " MiB", r["xla_mb"], r["predicted_mb"], 0,
                             f"XLA temp {r['xla_temp_mb']:.0f} MiB, model activations "
                             f"{r['activations_mb']:.0f} MiB"))
        except Exception as e:  # noqa: BLE001 - a program that fails is a finding
            rows.append({"part": "memory", "what": what,
                         "note": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"})
    return rows


def main(quick: bool = False) -> None:
    import jax

    import autopar as ap
    from autopar.clusters import default_preset
    from autopar.strategies.cost import get_cluster

    kind = jax.devices()[0].device_kind
    if jax.devices()[0].platform == "cpu" and not quick:
        print("benchmarks accelerator: no accelerator here (JAX_PLATFORMS=cuda on a GPU "
              "machine); the committed table stays", file=sys.stderr)
        return
    t0 = time.perf_counter()
    preset = get_cluster(default_preset(jax.devices()[0].platform, kind))
    cluster = ap.calibrate(jax.devices()[:1], cache=False, budget_s=20 if quick else 60)
    seconds = time.perf_counter() - t0
    meta = {"device_kind": kind, "jax": jax.__version__, "calibration_s": seconds,
            "cluster": cluster.model_dump(mode="json")}
    rows = calibration_rows(cluster, preset)
    write_results("accelerator", rows, COLUMNS, meta)
    sizes = QUICK if quick else STEP
    for part in (lambda: step_rows(cluster, preset, sizes, 3 if quick else ROUNDS),
                 lambda: memory_rows(cluster, sizes, quick)):
        try:
            rows += part()
        except Exception as e:  # noqa: BLE001 - recorded, the other parts still run
            rows.append({"part": "error", "what": f"{type(e).__name__}",
                         "note": str(e).splitlines()[0][:120]})
        write_results("accelerator", rows, COLUMNS, meta)
    if not quick:
        DOC_TABLES.write()


if __name__ == "__main__":
    run_main(main)
