"""Memory fidelity: the predicted peak of a training step against XLA's compiled program.

For the zoo models (mlp, transformer, tfm_stack, resnet50, small), the corpus models
(benchmarks/corpus.py: flax.linen, flax.nnx, equinox and keras-hub decoders and MLPs) and a
small Llama (keras-hub's ``LlamaCausalLM``: hidden 1024, sequence 1024, 2 layers, batch 2,
16 heads, MLP 4096, float32), three programs each:

- ``1 device``: ``jax.jit(jax.value_and_grad(loss))`` of the user's function on one device
  (no optimizer), against the model's step priced as a gradient function
  (``Problem.step_memory(picks, update=False)`` of the one-device plan);
- ``dp 8``: :func:`autopar.train_step` (Adam) under data parallel on 8 emulated devices;
- ``auto 8``: the same under ``auto_parallel`` (the default search mode, cpu-emulated
  preset), against the plan's ``cost.memory_bytes``.

XLA's figure is ``argument + output + temp - alias`` of ``compiled.memory_analysis()`` per
device: everything the executable holds (the step does not donate its arguments, so the new
parameters and optimizer state are outputs beside them). On one device the table also shows
XLA's temporaries beside the activations the model keeps for backward and the old model's
(every operator output counted as kept).

The GPT-3 175B figure: one traced block at GPT-3's width (hidden 12288, 96 heads, sequence
2048, float16, ``jax.ShapeDtypeStruct`` inputs: nothing allocated), the bytes backward
keeps per layer per sequence (:class:`autopar.strategies.memory.Residuals`) against
Korthikanti et al. 2022's ``34 s h + 5 a s^2`` (with dropout) and ``32 s h + 2 a s^2``
(their terms without dropout, which the block has not).

Writes ``benchmarks/results/memory.json`` and the tables between the ``memory`` and
``memory_gpt3`` markers of docs/fidelity.md.

    .venv/bin/python -m benchmarks memory [--quick]
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

from benchmarks._common import Col, DocTables, DocTexts, markdown_table, run_main, write_results

COLUMNS = ("model", "program", "xla_mb", "predicted_mb", "pred/xla", "phase", "xla_temp_mb",
           "activations_mb", "old_activations_mb")
GPT3 = ("figure", "bytes_per_layer_per_seq", "gb", "ours/figure")
MB = 2 ** 20


def doc_tables(results: dict[str, dict]) -> DocTexts:
    """docs/fidelity.md's ``memory`` and ``memory_gpt3`` tables, from memory.json."""
    rows = results["memory"]["rows"]
    mb = [Col(c, fmt=".1f") for c in ("xla_mb", "predicted_mb", "xla_temp_mb",
                                       "activations_mb", "old_activations_mb")]
    cols = ["model", "program", mb[0], mb[1], Col("pred/xla", fmt=".3f"), "phase", *mb[2:]]
    gpt3 = results["memory"]["meta"]["gpt3"]
    return {("docs/fidelity.md", "memory"): markdown_table(rows, cols),
            ("docs/fidelity.md", "memory_gpt3"): markdown_table(
                gpt3, ["figure", Col("bytes_per_layer_per_seq", fmt=".4g"),
                       Col("gb", fmt=".3f"), Col("ours/figure", fmt=".3f")])}


DOC_TABLES = DocTables(("memory",), doc_tables)


# ---- the models ------------------------------------------------------------------------------

def _zoo(quick: bool) -> dict[str, Callable[[], tuple]]:
    import jax

    from autopar.models import mlp, resnet50, tfm_stack, transformer

    def built(make: Callable[[], Any]) -> Callable[[], tuple]:
        def build() -> tuple:
            m = make()
            params, *batch = m.example_args(jax.random.key(0))
            return m.loss, params, tuple(batch)
        return build

    s = 2 if quick else 1
    return {
        "mlp": built(lambda: mlp(widths=(256, 1024 // s, 1024 // s, 256), batch=512)),
        "transformer": built(lambda: transformer(layers=2, hidden=256, heads=4, seq=128 // s,
                                                 vocab=1024, batch=8)),
        "tfm_stack": built(lambda: tfm_stack(blocks=2, batch=8, seq=128 // s, hidden=256,
                                             heads=4)),
        "resnet50": built(lambda: resnet50(num_classes=10, batch=8, image_size=32)),
    }


def _corpus(quick: bool) -> dict[str, Callable[[], tuple]]:
    from benchmarks import corpus

    names = ("linen_mlp", "linen_decoder", "keras_llama") if quick else (
        "linen_mlp", "linen_decoder", "linen_decoder_remat", "nnx_decoder", "eqx_decoder",
        "keras_gpt2", "keras_llama")

    def built(name: str) -> Callable[[], tuple]:
        def build() -> tuple:
            m = corpus.CORPUS[name]()
            return m.loss, m.params, tuple(m.batch)
        return build

    return {name: built(name) for name in names}


def llama(seq: int = 1024, layers: int = 2) -> tuple:
    """keras-hub's LlamaCausalLM at hidden 1024 (16 heads, MLP 4096), batch 2, float32."""
    import jax.numpy as jnp

    from benchmarks import corpus

    def make(keras_hub: Any) -> Any:
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=corpus.VOCAB, num_layers=layers, num_query_heads=16,
            num_key_value_heads=16, hidden_dim=1024, intermediate_dim=4096, dropout=0.0)
        return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)

    m = corpus._keras_causal_lm("llama_1024", make)
    tokens = jnp.zeros((2, seq), jnp.int32)
    return m.loss, m.params, (tokens, jnp.ones_like(tokens), tokens)


def _remat(quick: bool) -> dict[str, Callable[[], tuple]]:
    """A small decoder (4 layers, hidden 256, 4 heads, sequence 128 -- 64 quick --, batch 8,
    float32) without recomputation, with ``jax.checkpoint`` per layer (save nothing) and
    with a names policy (``save_only_these_names("attn_out", "mlp_out")``); its layers
    scanned (``lax.scan``: XLA's CPU compiler recomputes there) and unrolled (it merges an
    unrolled recomputation back into forward on CPU)."""
    import jax

    names = jax.checkpoint_policies.save_only_these_names("attn_out", "mlp_out")
    seq = 64 if quick else 128
    out = {}
    for scan in (True, False):
        for label, policy in (("", None), ("_remat", "full"), ("_remat_names", names)):
            if not scan and label == "_remat_names":
                continue
            name = f"{'scan' if scan else 'unrolled'}_decoder{label}"
            out[name] = (lambda scan=scan, policy=policy: remat_decoder(scan, policy, seq))
    return out


def remat_decoder(scan: bool, policy: Any, seq: int = 128, layers: int = 4,
                  hidden: int = 256, heads: int = 4, batch: int = 8) -> tuple:
    """(loss, params, batch) of :func:`_remat`'s decoder (``policy``: None, no
    ``jax.checkpoint``; ``"full"``: the default policy; else the policy)."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    def norm(x: Any) -> Any:
        mu = x.mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)

    def block(p: dict, x: Any) -> Any:
        b, s, h = x.shape
        q, k, v = (jnp.reshape(norm(x) @ p[w], (b, s, heads, h // heads))
                   for w in ("wq", "wk", "wv"))
        att = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", q, k) / (h // heads) ** 0.5)
        a = jnp.reshape(jnp.einsum("bhst,bthd->bshd", att, v), (b, s, h))
        x = x + checkpoint_name(a @ p["wo"], "attn_out")
        return x + checkpoint_name(jax.nn.gelu(norm(x) @ p["w1"]) @ p["w2"], "mlp_out")

    step = block if policy is None else jax.checkpoint(
        block, policy=None if policy == "full" else policy)

    def loss(params: dict, x: Any) -> Any:
        if scan:
            x, _ = jax.lax.scan(lambda c, p: (step(p, c), None), x, params)
        else:
            for i in range(layers):
                x = step(jax.tree.map(lambda a: a[i], params), x)
        return jnp.mean(x ** 2)

    keys = jax.random.split(jax.random.key(0), 7)
    shapes = {"wq": (hidden, hidden), "wk": (hidden, hidden), "wv": (hidden, hidden),
              "wo": (hidden, hidden), "w1": (hidden, 4 * hidden), "w2": (4 * hidden, hidden)}
    params = {w: jax.random.normal(kk, (layers, *sh)) / sh[0] ** 0.5
              for kk, (w, sh) in zip(keys, shapes.items())}
    return loss, params, (jax.random.normal(keys[6], (batch, seq, hidden)),)


# ---- measuring -------------------------------------------------------------------------------

def xla_bytes(compiled: Any) -> tuple[float, float]:
    """(argument + output + temp - alias, temp) bytes of a compiled program, per device."""
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - \
        m.alias_size_in_bytes
    return float(total), float(m.temp_size_in_bytes)


def one_device(loss: Callable, params: Any, batch: tuple, cluster: Any) -> dict[str, Any]:
    """The gradient function on one device: XLA against the model, and the old model's
    activations (every operator output)."""
    import jax

    import autopar as ap
    from autopar.strategies.cost import CostModel
    from autopar.strategies.layout import DeviceMesh
    from autopar.strategies.loops import has_loops, planned_problem
    from autopar.strategies.problem import Problem

    total, temp = xla_bytes(jax.jit(jax.value_and_grad(loss)).lower(params, *batch).compile())
    graph = ap.trace(loss, params, *batch)
    if has_loops(graph):  # (the loop planner: its one-device plan, re-priced)
        plan = ap.search(graph, device_num=1, parallel_mode="auto_parallel", cluster=cluster)
        problem, picks = planned_problem(graph, plan, CostModel(cluster))
    else:
        problem = Problem(graph, DeviceMesh.for_devices(1), CostModel(cluster), lazy=True)
        picks = problem.settle({i: (1,) * len(problem.specs[v.name].sizes)
                                for i, v in problem.iter_ops()})
        problem.pick_parameters(picks)
    memory = problem.step_memory(picks, update=False)
    old = sum(graph.spec(v).nbytes for n in graph.nodes for v in n.outputs)
    return {"program": "1 device", "xla_mb": total / MB, "predicted_mb": memory.peak / MB,
            "pred/xla": memory.peak / total, "phase": memory.phase, "xla_temp_mb": temp / MB,
            "activations_mb": memory.activations / MB, "old_activations_mb": old / MB}


def eight_devices(loss: Callable, params: Any, batch: tuple, pmode: str,
                  cluster: Any) -> dict[str, Any]:
    """autopar's Adam training step on 8 devices under ``pmode``: XLA against the plan."""
    import optax

    import autopar as ap

    with ap.auto_parallel_context(device_num=8, parallel_mode=pmode, gradients_mean=True):
        step = ap.train_step(loss, params, batch, optax.adam(1e-3), cluster=cluster)
    total, temp = xla_bytes(step.lower(params, step.init(params), *batch).compile())
    predicted = step.plan.cost.memory_bytes
    memory = plan_memory(step.plan, step.function.graph, cluster)
    return {"program": "dp 8" if pmode == "data_parallel" else "auto 8", "xla_mb": total / MB,
            "predicted_mb": predicted / MB, "pred/xla": predicted / total,
            "phase": memory.phase, "xla_temp_mb": temp / MB,
            "activations_mb": memory.activations / MB}


def plan_memory(plan: Any, graph: Any, cluster: Any) -> Any:
    """The :class:`~autopar.strategies.memory.StepMemory` of a plan (its strategies priced
    again: the peak, its phase and its parts)."""
    from autopar.strategies.cost import CostModel
    from autopar.strategies.loops import has_loops, planned_problem
    from autopar.strategies.problem import Problem

    if has_loops(graph):  # (its loop nodes at the plan's body plans)
        problem, picks = planned_problem(graph, plan, CostModel(cluster))
        return problem.step_memory(picks)
    problem = Problem(graph, plan.mesh, CostModel(cluster), fixed_splits={
        k: ns.splits for k, ns in plan.nodes.items()})
    picks = [0] * len(problem.vertices)
    for v in graph.parameters():
        i = problem.index["<param>" + v]
        problem.widen_param(v, [plan.layouts[v]])
        picks[i] = [c.out_layouts[0] for c in problem.vertices[i].choices].index(
            plan.layouts[v])
    return problem.step_memory(picks)


def model_rows(name: str, build: Callable[[], tuple], cluster: Any) -> list[dict[str, Any]]:
    """The three programs of one model (a failure is a row that says so)."""
    rows = []
    t0 = time.perf_counter()
    loss, params, batch = build()
    for label, run in (("1 device", lambda: one_device(loss, params, batch, cluster)),
                       ("dp 8", lambda: eight_devices(loss, params, batch, "data_parallel",
                                                      cluster)),
                       ("auto 8", lambda: eight_devices(loss, params, batch, "auto_parallel",
                                                        cluster))):
        try:
            rows.append({"model": name, **run()})
        except Exception as e:  # noqa: BLE001 - a model that fails is a finding, recorded
            rows.append({"model": name, "program": label, "phase": f"{type(e).__name__}: "
                         f"{str(e).splitlines()[0][:80]}"})
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


# ---- GPT-3 -----------------------------------------------------------------------------------

def gpt3_block(hidden: int = 12288, heads: int = 96, seq: int = 2048) -> Any:
    """One pre-LN GPT block (layer norms, causal attention, a GELU MLP of 4 x hidden, two
    residual additions), float16, traced from abstract inputs; returns the Graph."""
    import jax
    import jax.numpy as jnp

    import autopar as ap

    def layer_norm(x: Any, g: Any, b: Any) -> Any:
        m = x.mean(-1, keepdims=True)
        xc = x - m
        return xc * jax.lax.rsqrt((xc * xc).mean(-1, keepdims=True) + 1e-5) * g + b

    def block(p: dict, x: Any) -> Any:
        s, h = x.shape[1], x.shape[2]
        y = layer_norm(x, p["g1"], p["b1"])
        q, k, v = jnp.split(y @ p["wqkv"], 3, axis=-1)
        q, k, v = (t.reshape(1, s, heads, h // heads).transpose(0, 2, 1, 3) for t in (q, k, v))
        scores = q @ k.transpose(0, 1, 3, 2) * (h // heads) ** -0.5
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e4)
        att = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(1, s, h)
        x = x + att @ p["wo"]
        y = layer_norm(x, p["g2"], p["b2"])
        x = x + jax.nn.gelu(y @ p["w1"]) @ p["w2"]
        return jnp.sum(x.astype(jnp.float32))

    f16 = jnp.float16
    shapes = {"g1": (hidden,), "b1": (hidden,), "wqkv": (hidden, 3 * hidden),
              "wo": (hidden, hidden), "g2": (hidden,), "b2": (hidden,),
              "w1": (hidden, 4 * hidden), "w2": (4 * hidden, hidden)}
    params = {k: jax.ShapeDtypeStruct(v, f16) for k, v in shapes.items()}
    return ap.trace(block, params, jax.ShapeDtypeStruct((1, seq, hidden), f16))


def gpt3_rows(hidden: int = 12288, heads: int = 96, seq: int = 2048) -> list[dict[str, Any]]:
    """The bytes backward keeps per layer per sequence, against Korthikanti's figures and
    the old model's (every operator output)."""
    from autopar.strategies.memory import ROW, Residuals
    from autopar.strategies.problem import fused_values, parameter_values, requires_grad

    g = gpt3_block(hidden, heads, seq)
    # the block's input is the previous layer's activation: a gradient flows through it
    req = requires_grad(g, frozenset(g.data_inputs()))
    res = Residuals(g, req, fused_values(g), None, parameter_values(g))
    kept = {(v, j == ROW) for refs in res.refs.values() for v, _, j in refs  # (one buffer
            if g.values[v].kind in ("activation", "data")}                  # each)
    ours = float(sum(g.spec(v).nbytes for v, _ in kept))
    old = float(sum(g.spec(v).nbytes for n in g.nodes for v in n.outputs))
    s, h, a = seq, hidden, heads
    figures = [("Korthikanti 34sh + 5as^2 (dropout)", 34 * s * h + 5 * a * s * s),
               ("Korthikanti 32sh + 2as^2 (no dropout)", 32 * s * h + 2 * a * s * s),
               ("autopar, what backward reads", ours),
               ("autopar before: every operator output", old)]
    return [{"figure": name, "bytes_per_layer_per_seq": float(b), "gb": b / 1e9,
             "ours/figure": ours / b} for name, b in figures]


def main(quick: bool = False) -> None:
    """All rows; with ``--remat``, only :func:`_remat`'s (the other rows kept from the last
    run's memory.json)."""
    import sys

    if "--remat" in sys.argv[1:]:
        return remat_main(quick)
    from benchmarks.bench_models import ensure_models_extra

    ensure_models_extra()
    warnings.simplefilter("ignore")  # (gradients_mean and the libraries' notices)
    from autopar.strategies.cost import CLUSTERS

    cluster = CLUSTERS["cpu-emulated"]
    models = {**_zoo(quick), **_corpus(quick),
              "llama_1024": (lambda: llama(seq=256)) if quick else llama, **_remat(quick)}
    rows = []
    for name, build in models.items():
        rows += model_rows(name, build, cluster)
    gpt3 = gpt3_rows(hidden=1536, heads=12, seq=512) if quick else gpt3_rows()
    for r in gpt3:
        print(f"{r['figure']}: {r['gb']:.3f} GB per layer per sequence")
    write_results("memory", rows, COLUMNS, meta={
        "cluster": cluster.name, "devices": 8, "gpt3": gpt3,
        "xla": "argument + output + temp - alias bytes of compiled.memory_analysis()"})
    DOC_TABLES.write()


def remat_main(quick: bool = False) -> None:
    """``python -m benchmarks memory --remat``: :func:`_remat`'s rows measured again and put
    in place of theirs in memory.json (the other rows and the GPT-3 figures kept)."""
    warnings.simplefilter("ignore")
    from autopar.strategies.cost import CLUSTERS
    from benchmarks._common import out_dir, read_results

    cluster = CLUSTERS["cpu-emulated"]
    models = _remat(quick)
    new = [r for name, build in models.items() for r in model_rows(name, build, cluster)]
    for r in new:
        print(f"{r['model']:>24} {r['program']:>8}: xla {r.get('xla_mb', 0):8.1f} MB, "
              f"predicted {r.get('predicted_mb', 0):8.1f} MB ({r.get('pred/xla', 0):.3f})")
    old = read_results("memory", out_dir())
    rows = [r for r in old["rows"] if r["model"] not in models] + new
    write_results("memory", rows, COLUMNS, meta=old["meta"])
    DOC_TABLES.write()


if __name__ == "__main__":
    run_main(main)
