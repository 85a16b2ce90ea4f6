"""Training-step time: autopar's shard_map lowering vs XLA's GSPMD on the same plan.

On 8 emulated CPU devices, for the zoo MLP and transformer (tiny sizes, fit 2 CPU cores), one
SGD step (loss, gradients, update; the same optax code on every side) is timed in one run:
``rounds`` rounds, each timing every side ``repeat`` times in a shuffled order; ms columns
are medians over rounds and ``autopar / gspmd`` is the median over rounds of the ratio in the
same round (the machine is shared, so paired ratios are steadier than ratios of medians):

- ``autopar``: ``jax.value_and_grad`` of the lowered ``shard_map`` program
  (the default path: plans priced on this machine's calibration, and :func:`autopar.rewrite.rewrite`
  deciding fused kernels on the same cluster; :func:`autopar.lower.lower`: explicit collectives,
  local shapes), arguments placed
  on the plan's layouts; the gradient synchronisation is the one ``shard_map``'s transpose
  inserts;
- ``gspmd``: ``jax.jit`` of the *same traced graph* evaluated on global arrays, every
  operator's operands and results pinned with ``with_sharding_constraint`` to the plan's
  layouts (the layout the strategy reads each operand in, the layout each result has; partial
  sums are left to GSPMD: a ``NamedSharding`` cannot say "partial"), inputs with the plan's
  ``in_shardings``. XLA's SPMD partitioner then inserts the communication for
  exactly the plan autopar runs, so ``autopar / gspmd`` compares the two lowerings
  (goal <= 1.10);
- ``gspmd_free``: the single-device step jitted with only the plan's input shardings (XLA
  chooses every intermediate layout itself). Not the same plan; it shows what the plan
  itself costs against XLA's own propagation;
- ``train_step``: :func:`autopar.train_step` called through its public API (its own gradient
  sync and update), for reference;
- ``single``: the single-device step on one device.

    .venv/bin/python -m benchmarks.bench_execute [--quick]
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import Any

from benchmarks._common import (
    DocTables,
    DocTexts,
    markdown_table,
    run_main,
    setup_devices,
    timeit,
    write_results,
)

COLUMNS = ("model", "plan", "autopar_ms", "gspmd_ms", "autopar/gspmd", "gspmd_free_ms",
           "train_step_ms", "single_ms", "hlo_collectives_autopar", "hlo_collectives_gspmd")


def doc_tables(results: dict[str, dict]) -> DocTexts:
    """docs/execution.md's ``execute`` table, from execute.json."""
    return {("docs/execution.md", "execute"): markdown_table(results["execute"]["rows"],
                                                            COLUMNS)}


DOC_TABLES = DocTables(("execute",), doc_tables)


def _cases(quick: bool) -> list[tuple[str, Callable[[], Any], dict]]:
    from autopar.models import mlp, transformer

    dp = {"parallel_mode": "data_parallel"}
    auto = {"parallel_mode": "auto_parallel", "search_mode": "dynamic_programming"}
    hidden = 64 if quick else 128
    mk_mlp = lambda: mlp(widths=(hidden, 4 * hidden, hidden), batch=64)
    mk_tfm = lambda: transformer(layers=2, hidden=hidden // 2, heads=4, seq=32,
                                 vocab=256, batch=16)
    cases = [("mlp", mk_mlp, dp), ("transformer", mk_tfm, dp)]
    if not quick:
        cases += [("mlp", mk_mlp, auto), ("transformer", mk_tfm, auto)]
    return cases


def gspmd_program(graph: Any, plan: Any, mesh: Any) -> Callable[..., tuple[Any, ...]]:
    """The traced graph on global arrays, every operand and result pinned to the plan.

    Every operator is re-bound with its original (global) params; each input is pinned to
    the layout the plan's strategy reads it in and each output to the layout it produces:
    ``with_sharding_constraint(x, NamedSharding(mesh, layout.partition_spec()))``, except
    partial sums (a ``NamedSharding`` cannot say "partial": pinning a matmul's operands split
    on the contracted dim makes GSPMD produce and resolve the partial sum itself). Inputs
    (flat, in ``graph.inputs`` order) carry the caller's ``in_shardings``.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    def run(*flat: Any) -> tuple[Any, ...]:
        env: dict[str, Any] = dict(zip(graph.inputs, flat))

        def read(v: str) -> Any:
            if v in env:
                return env[v]
            val = graph.values[v]
            return jnp.asarray(val.data, dtype=val.spec.dtype)

        def pin(x: Any, lay: Any) -> Any:
            if lay.partial or not hasattr(x, "shape") or not x.shape:
                return x
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, lay.partition_spec()))

        for node in graph.nodes:
            ns = plan.nodes[node.name]
            args = [pin(read(v), lay) for v, lay in zip(node.inputs, ns.in_layouts)]
            if node.op == "sharding_constraint":
                outs = args
            else:
                out = node.primitive.bind(*args, **dict(node.params))
                outs = list(out) if node.primitive.multiple_results else [out]
            outs = [pin(x, lay) for x, lay in zip(outs, ns.out_layouts)]
            env.update(zip(node.outputs, outs))
        return tuple(read(v) for v in graph.outputs)

    return run


def _collectives(text: str) -> int:
    import re

    return len(re.findall(r" (?:all-reduce|all-gather|reduce-scatter|all-to-all|"
                          r"collective-permute)(?:-start)?\(", text))


def _sgd_step(opt: Any, loss_of: Callable[..., Any]) -> Callable[..., tuple]:
    """One step of ``opt`` on ``loss_of(*params, *batch)``: (params, state, loss)."""
    import jax
    import optax

    def step(p: list[Any], s: Any, b: list[Any]) -> tuple:
        loss, g = jax.value_and_grad(lambda q: loss_of(*q, *b))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss
    return step


def _programs(make: Callable[[], Any], ctx: dict) -> tuple[dict[str, Callable[[], Any]],
                                                          dict[str, int]]:
    """The five sides of one case (each a call that blocks until its step is done) and the
    collectives in the compiled autopar and gspmd steps."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import autopar as ap

    m = make()
    params, *batch = m.example_args(jax.random.key(0))
    batch = tuple(batch)
    opt = optax.sgd(0.1)
    with ap.auto_parallel_context(device_num=8, gradients_mean=True, **ctx):
        fn = ap.parallelize(m.loss, params, *batch)
        tstep = ap.train_step(m.loss, params, batch, opt)
    # the default path: the plan priced on this machine's calibration (or its platform's
    # preset), and the fused kernels decided on the same cluster
    pg = ap.rewrite.rewrite(fn.graph, fn.plan)
    lowered = ap.lower.lower(pg)
    mesh = lowered.mesh
    n_p = len(jax.tree.leaves(params))
    state = opt.init(jax.tree.leaves(params))
    placed = lowered.place(params, *batch)
    shard = list(lowered.in_shardings)
    p_sh, b_sh, rep = shard[:n_p], shard[n_p:], NamedSharding(mesh, P())
    ap_step = jax.jit(_sgd_step(opt, lambda *f: lowered.sharded(*f)[0]),
                      out_shardings=(p_sh, rep, rep))
    prog = gspmd_program(pg.graph, pg.plan, mesh)
    g_step = jax.jit(_sgd_step(opt, lambda *f: prog(*f)[0]), in_shardings=(p_sh, rep, b_sh),
                     out_shardings=(p_sh, rep, rep))

    def free_loss(*flat: Any) -> Any:
        tree = jax.tree_util.tree_structure(params)
        return m.loss(jax.tree_util.tree_unflatten(tree, list(flat[:n_p])), *flat[n_p:])

    f_step = jax.jit(_sgd_step(opt, free_loss), in_shardings=(p_sh, rep, b_sh),
                     out_shardings=(p_sh, rep, rep))
    pl, bl = placed[:n_p], placed[n_p:]
    s_args = jax.device_put((jax.tree.leaves(params), state, list(batch)), jax.devices()[0])
    single = jax.jit(_sgd_step(opt, free_loss))
    t_state = tstep.init(params)
    runs = {
        "autopar": lambda: jax.block_until_ready(ap_step(pl, state, bl)),
        "gspmd": lambda: jax.block_until_ready(g_step(pl, state, bl)),
        "gspmd_free": lambda: jax.block_until_ready(f_step(pl, state, bl)),
        "train_step": lambda: jax.block_until_ready(tstep(params, t_state, *batch)),
        "single": lambda: jax.block_until_ready(single(*s_args)),
    }
    return runs, {
        "hlo_collectives_autopar": _collectives(ap_step.lower(pl, state, bl).compile().as_text()),
        "hlo_collectives_gspmd": _collectives(g_step.lower(pl, state, bl).compile().as_text())}


def _time_rounds(runs: dict[str, Callable[[], Any]], rounds: int, repeat: int
                 ) -> tuple[dict[str, float], float]:
    """Median seconds per side over shuffled rounds, and the median over rounds of
    autopar / gspmd in the same round."""
    for run in runs.values():  # compile and warm up
        run()
        run()
    samples: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for r in range(rounds):  # shuffled rounds: every side sees the same machine noise
        random.Random(r).shuffle(order)
        for k in order:
            samples[k].append(timeit(runs[k], repeat=repeat, warmup=0))
    best = {k: statistics.median(v) for k, v in samples.items()}
    return best, statistics.median(a / g for a, g in zip(samples["autopar"], samples["gspmd"]))


def _measure(name: str, make: Callable[[], Any], ctx: dict, repeat: int, rounds: int) -> dict:
    runs, collectives = _programs(make, ctx)
    best, paired = _time_rounds(runs, rounds, repeat)
    return {"model": name, "plan": ctx.get("search_mode", ctx["parallel_mode"]),
            "autopar_ms": best["autopar"] * 1e3, "gspmd_ms": best["gspmd"] * 1e3,
            "autopar/gspmd": paired, "gspmd_free_ms": best["gspmd_free"] * 1e3,
            "train_step_ms": best["train_step"] * 1e3, "single_ms": best["single"] * 1e3,
            **collectives}


def main(quick: bool = False) -> None:
    setup_devices(8)
    repeat, rounds = (3, 5) if quick else (5, 25)
    rows = [_measure(name, make, ctx, repeat, rounds) for name, make, ctx in _cases(quick)]
    write_results("execute", rows, COLUMNS, meta={
        "devices": 8, "quick": quick, "repeat": repeat, "rounds": rounds,
        "ms": "median over rounds of the median of `repeat` runs",
        "autopar/gspmd": "median over rounds of autopar / gspmd in the same round"})
    DOC_TABLES.write()


if __name__ == "__main__":
    run_main(main)
