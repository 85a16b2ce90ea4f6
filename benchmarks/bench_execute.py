"""Training-step time: autopar's shard_map lowering vs XLA's GSPMD on the same shardings.

On 8 emulated CPU devices, for the zoo MLP and transformer (tiny sizes, fit 2 CPU cores), one
SGD step is timed three ways in one run:

- ``autopar``: :func:`autopar.train_step` (one jitted ``shard_map`` program, explicit
  collectives), arguments already placed on the plan's layouts;
- ``gspmd``: ``jax.jit`` of the single-device train step with ``in_shardings`` /
  ``out_shardings`` taken from the same plan (``Layout.partition_spec()`` of every parameter and
  batch input), so XLA's SPMD partitioner inserts the communication;
- ``single``: the single-device train step on one device.

``autopar / gspmd`` is the ratio to watch (goal <= 1.10).

    .venv/bin/python -m benchmarks.bench_execute [--quick]
"""

from __future__ import annotations

import sys

from benchmarks._common import setup_devices, timeit, write_results

COLUMNS = ("model", "plan", "autopar_ms", "gspmd_ms", "single_ms", "autopar/gspmd",
           "all_reduce", "all_gather", "all_to_all")


def _cases(quick: bool) -> list[tuple[str, object, dict]]:
    from autopar.models import mlp, transformer

    dp = dict(parallel_mode="data_parallel")
    auto = dict(parallel_mode="auto_parallel", search_mode="dynamic_programming")
    hidden = 64 if quick else 128
    mk_mlp = lambda: mlp(widths=(hidden, 4 * hidden, hidden), batch=64)  # noqa: E731
    mk_tfm = lambda: transformer(layers=2, hidden=hidden // 2, heads=4, seq=32,  # noqa: E731
                                 vocab=256, batch=16)
    cases = [("mlp", mk_mlp, dp), ("transformer", mk_tfm, dp)]
    if not quick:
        cases += [("mlp", mk_mlp, auto), ("transformer", mk_tfm, auto)]
    return cases


def main(quick: bool = False) -> None:
    setup_devices(8)
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import autopar as ap

    repeat = 5 if quick else 20
    rows = []
    for name, make, ctx in _cases(quick):
        m = make()
        params, *batch = m.example_args(jax.random.key(0))
        batch = tuple(batch)
        opt = optax.sgd(0.1)
        with ap.auto_parallel_context(device_num=8, gradients_mean=True, **ctx):
            step = ap.train_step(m.loss, params, batch, opt)
        state = step.init(params)
        p_leaves, b_leaves = step._place(params, batch)
        run_ap = lambda: jax.block_until_ready(step._step(p_leaves, state, b_leaves))  # noqa

        def single_step(p, s, *b):
            loss, g = jax.value_and_grad(m.loss)(p, *b)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        pg, mesh = step.parallel_graph, step.mesh
        shard = [NamedSharding(mesh, pg.values[v].layout.partition_spec()) for v in pg.inputs]
        n_p = len(jax.tree.leaves(params))
        tree = jax.tree_util.tree_structure(params)
        p_sh = jax.tree_util.tree_unflatten(tree, shard[:n_p])
        rep = NamedSharding(mesh, P())
        gspmd = jax.jit(single_step, in_shardings=(p_sh, rep, *shard[n_p:]),
                        out_shardings=(p_sh, rep, rep))
        g_params = jax.tree.map(jax.device_put, params, p_sh)
        g_batch = [jax.device_put(b, s) for b, s in zip(batch, shard[n_p:])]
        run_gspmd = lambda: jax.block_until_ready(gspmd(g_params, state, *g_batch))  # noqa

        dev0 = jax.devices()[0]
        single = jax.jit(single_step)
        s_params = jax.device_put(params, dev0)
        s_batch = [jax.device_put(b, dev0) for b in batch]
        run_single = lambda: jax.block_until_ready(single(s_params, state, *s_batch))  # noqa

        t_ap = t_g = t_s = float("inf")
        for _ in range(3):  # interleave the three to share the machine's noise
            t_ap = min(t_ap, timeit(run_ap, repeat=repeat, warmup=2))
            t_g = min(t_g, timeit(run_gspmd, repeat=repeat, warmup=2))
            t_s = min(t_s, timeit(run_single, repeat=repeat, warmup=2))
        counts = step.collective_counts(params, state, *batch)
        rows.append({"model": name, "plan": ctx.get("search_mode", ctx["parallel_mode"]),
                     "autopar_ms": t_ap * 1e3, "gspmd_ms": t_g * 1e3, "single_ms": t_s * 1e3,
                     "autopar/gspmd": t_ap / t_g, "all_reduce": counts["all_reduce"],
                     "all_gather": counts["all_gather"], "all_to_all": counts["all_to_all"]})
    write_results("execute", rows, COLUMNS, meta={"devices": 8, "quick": quick,
                                                  "repeat": repeat})


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
