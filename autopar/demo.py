"""`autopar demo`: the README's main job end to end on emulated devices.

1. configure the auto-parallel context as a MindSpore user does, and resolve it;
2. trace the zoo transformer and compare the search modes (predicted step, communication,
   memory, search time, ratio to exact);
3. save the best plan as a strategy file, load it back (same plan, same bytes);
4. lower the plan of the best mode for a small transformer and train a few SGD steps on
   ``--devices`` emulated devices, checking losses and parameters against one device; then
   the same pipelined (``--pipeline-stages``, 1F1B, each stage searched on its devices);
5. simulate the iteration (seed 001's trace points) and write the Chrome trace JSON;
6. print a summary. ``make demo`` runs it (about a minute on two cores).
"""

from __future__ import annotations

import argparse
import os
import warnings
import time
from pathlib import Path
from typing import Any

from autopar.cli_util import (CLIError, compare_with_reference, dir_path, one_device_steps,
                              positive_int)
from autopar.text import Progress, table

__all__ = ["add_demo_parser", "cmd_demo"]


def _out(*a: Any) -> None:
    print(*a, flush=True)


def add_demo_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="the main job end to end on emulated devices")
    p.add_argument("--devices", type=positive_int, default=8, help="emulated devices (default 8)")
    p.add_argument("--layers", type=positive_int, default=2, help="transformer layers (default 2)")
    p.add_argument("--steps", type=positive_int, default=3, help="training steps (default 3)")
    p.add_argument("--pipeline-stages", type=positive_int, default=None,
                   help="stages of the pipelined run (default 2, or 1 where 2 does not divide "
                        "--devices; 1 skips it)")
    p.add_argument("--cluster", default=None,
                   help="cost model: a preset (accelerator-8x, cpu-emulated), 'calibrated' or "
                   "a calibration file; default: $AUTOPAR_CLUSTER when set, else 'calibrated' "
                   "(these devices, measured once, then cached)")
    p.add_argument("--out", type=dir_path, default=Path("autopar-demo"),
                   help="directory for the strategy file and trace (default autopar-demo)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """The demo under its own auto-parallel context (the caller's context is restored)."""
    import autopar as ap

    if args.pipeline_stages is None:
        args.pipeline_stages = 2 if args.devices % 2 == 0 else 1
    if args.pipeline_stages > 1 and args.devices % args.pipeline_stages:
        raise CLIError(f"--pipeline-stages {args.pipeline_stages} must divide --devices "
                       f"{args.devices} (or be 1 to skip the pipelined run)")
    out = _out_dir(args.out)
    args.cluster = _demo_cluster(args.cluster)  # a bad --cluster fails before anything is made
    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    _out("autopar demo: configure the auto-parallel context as MindSpore users do\n")
    _out('  ap.set_auto_parallel_context(device_num=%d, parallel_mode="auto_parallel",\n'
         '      search_mode="dynamic_programming", gradients_mean=True,\n'
         '      comm_fusion={"allreduce": {"mode": "size", "config": 32}})\n' % args.devices)
    with ap.auto_parallel_context(device_num=args.devices, parallel_mode="auto_parallel",
                                  search_mode="dynamic_programming", gradients_mean=True,
                                  comm_fusion={"allreduce": {"mode": "size", "config": 32}}):
        return _demo(args, out, t_start)


#: What the demo writes into --out (the reloaded plan's file only for a moment).
_STRATEGY, _RELOADED, _TRACE = _WRITES = ("strategy.json", "strategy.reloaded.json",
                                          "trace.json")


def _out_dir(out: Path) -> Path:
    """``--out``: a directory (made if absent) whose files the demo writes are each
    writable, checked before any work."""
    from autopar.files import writable_target

    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {str(out)!r} is not a directory; give a directory for the "
                       "strategy file and the trace")
    if out.is_dir():
        for name in _WRITES:
            writable_target(out / name, f"--out {name}")
    return out


def _demo_cluster(cluster: str | None) -> Any:
    """The cost model (these devices, measured once, then cached, unless named)."""
    import autopar as ap
    from autopar.clusters import CLUSTER_ENV

    if cluster is None and not os.environ.get(CLUSTER_ENV):
        cluster = "calibrated"
    return ap.clusters.resolve_cluster(cluster)


def _demo(args: argparse.Namespace, out: Path, t_start: float) -> int:
    import autopar as ap

    _show_context(args)
    graph, best = _compare_modes(args)                        # 2. trace + search modes
    plan = best.plan
    path, round_trip = _strategy_round_trip(graph, plan, out)  # 3. strategy file
    ok, predicted, measured = _train(args, best.mode)         # 4. train vs one device
    piped = _train_pipeline(args, best.mode)                  # 4b. the same, pipelined
    it = ap.simulation.simulate(graph, plan, cluster=args.cluster)       # 5. iteration trace
    trace_path = it.write_chrome_trace(out / _TRACE)
    _out(f"\niteration trace of the best plan: {it.summary()}")
    _out(f"Chrome trace written: {trace_path} (open in ui.perfetto.dev)")
    _out("\nsummary:")                                         # 6. summary
    _out(table([("step", "result"),
                ("search", f"{best.mode}: {best.step_seconds * 1e3:.3f} ms predicted, "
                 f"{best.ratio_to_exact:.4f} x exact"),
                ("strategy file", f"{path} round trip {'OK' if round_trip else 'FAIL'}"),
                ("training", f"{args.steps} steps on {args.devices} devices vs one device: "
                 f"{'OK' if ok else 'MISMATCH'}"),
                ("cost model", f"{args.cluster.name}: step {predicted * 1e3:.2f} ms predicted, "
                 f"{measured * 1e3:.2f} ms measured"),
                ("pipeline", "skipped" if piped is None else
                 f"{args.pipeline_stages} stages x {args.devices // args.pipeline_stages} "
                 f"devices, 1F1B, vs one device: {'OK' if piped else 'MISMATCH'}"),
                ("iteration trace", str(trace_path)),
                ("wall time", f"{time.perf_counter() - t_start:.1f} s")], align="ll"))
    return 0 if ok and round_trip and piped is not False else 1


def _show_context(args: argparse.Namespace) -> None:
    """1. The resolved context, the cost model (``args.cluster``, resolved) and the HCCL
    gradient split."""
    import autopar as ap
    from autopar.clusters import describe_cluster

    resolved = ap.resolve_context()
    _out(resolved.table())
    _out(f"\ncost model: {describe_cluster(args.cluster).splitlines()[0]}")
    split = ap.hccl.get_split_strategy()
    _out(f"\nHCCL gradient split ({split.group}): {split.mode} {list(split.values)}"
         f"{' (default)' if split.is_default else ''}\n")


def _compare_modes(args: argparse.Namespace) -> tuple[Any, Any]:
    """2. Trace the zoo transformer and compare the search modes: ``(graph, best row)``."""
    import jax

    import autopar as ap
    from autopar.compare import compare_modes, comparison_rows
    from autopar.models import transformer

    model = transformer(layers=args.layers, hidden=256, heads=8, seq=128, vocab=1024, batch=8)
    t0 = time.perf_counter()
    graph = ap.trace(model.loss, *jax.eval_shape(model.example_args, jax.random.key(0)))
    _out(f"traced the zoo transformer ({args.layers} layers, hidden 256, seq 128): "
         f"{len(graph.nodes)} nodes, {len(graph.parameters())} parameters, fingerprint "
         f"{graph.fingerprint()[:12]} in {time.perf_counter() - t0:.2f} s\n")
    with Progress("search modes", 4) as bar:
        rows = compare_modes(graph, device_num=args.devices, cluster=args.cluster,
                             on_done=bar.advance)
    _out(f"search modes on {args.devices} devices, cluster {args.cluster.name} (every mode prices "
         "with the same cost model; exact is the integer-program referee):")
    _out(table(comparison_rows(rows)))
    best = min(rows, key=lambda r: (r.objective, r.mode != "dynamic_programming"))
    assert best.plan is not None
    _out(f"\nbest: {best.mode}\n" + best.plan.summary())
    for p in graph.parameters()[:6]:
        _out(f"  {p}: {best.plan.layout(p)} (splits {best.plan.split_counts(p)})")
    return graph, best


def _strategy_round_trip(graph: Any, plan: Any, out: Path) -> tuple[Path, bool]:
    """3. Save the plan as a strategy file and load it back: ``(path, same plan and same
    bytes)``."""
    import autopar as ap

    path = ap.save_strategy(plan, graph, out / _STRATEGY)
    loaded = ap.load_strategy(path, graph)
    same = (loaded.nodes, loaded.layouts, loaded.cost) == (plan.nodes, plan.layouts, plan.cost)
    again = ap.save_strategy(loaded, graph, out / _RELOADED)
    same_bytes = path.read_bytes() == again.read_bytes()
    again.unlink()
    _out(f"\nstrategy file {path} ({path.stat().st_size / 1024:.0f} KiB): reloaded -> same "
         f"plan {same}, same bytes {same_bytes}  (autopar show {path})")
    return path, same and same_bytes


def _train(args: argparse.Namespace, mode: str) -> tuple[bool, float, float]:
    import jax

    import autopar as ap
    from autopar.models import transformer

    small = transformer(layers=args.layers, hidden=64, heads=4, seq=16, vocab=128, batch=8)
    ex = tuple(small.example_args(jax.random.key(0)))
    with Progress("lower + compile", 1) as bar:
        step = ap.train_step(small.loss, ex[0], tuple(ex[1:]), mode=mode, cluster=args.cluster)
        bar.advance(mode)
    _out(f"\ntraining a small transformer (hidden 64, seq 16, batch 8) with {mode} on "
         f"{args.devices} devices; communication in the program: "
         f"{step.parallel_graph.comm_counts()}")
    losses, ref_losses, err, ok = _run_and_compare(step, step.prepare(ex[0]), small.loss, ex,
                                                   args.steps, "train steps")
    predicted, measured = step.plan.cost.total, _step_seconds(step, ex)
    _out(f"predicted beside measured ({args.cluster.name}): step {predicted * 1e3:.2f} ms "
         f"predicted, {measured * 1e3:.2f} ms measured (median of 5; predicted / measured "
         f"{predicted / measured:.2f})")
    rows = [("step", f"{args.devices} devices", "one device")]
    rows += [(str(k + 1), f"{a:.6f}", f"{b:.6f}") for k, (a, b) in
             enumerate(zip(losses, ref_losses))]
    _out(table(rows))
    _out(f"max parameter difference after {args.steps} steps {err:.2e} -> "
         f"{'OK' if ok else 'MISMATCH'}")
    return ok, predicted, measured


def _step_seconds(step: Any, ex: tuple[Any, ...]) -> float:
    """Median wall seconds of 5 steps (compiled and warmed up by the run before)."""
    import jax

    params, state = step.prepare(ex[0]), step.init(ex[0])
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        params, state, loss = step(params, state, *ex[1:])
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[2]


def _train_pipeline(args: argparse.Namespace, mode: str) -> bool | None:
    """A few pipelined SGD steps of the small transformer, checked against one device; None
    when ``--pipeline-stages`` is 1 or does not divide ``--devices``."""
    import jax

    import autopar as ap
    from autopar.models import transformer

    p = args.pipeline_stages
    if p == 1 or args.devices % p:
        _out(f"\npipeline: skipped (--pipeline-stages {p} with {args.devices} devices)")
        return None
    # at least a block per stage, and a batch that makes p equal micro-batches
    small = transformer(layers=_pipeline_layers(args), hidden=64, heads=4, seq=16, vocab=128,
                        batch=8 if 8 % p == 0 else 8 * p)
    ex = tuple(small.example_args(jax.random.key(0)))
    with ap.auto_parallel_context(pipeline_stages=p), warnings.catch_warnings():
        # the demo's comm_fusion is not applied by a pipelined step (said below)
        warnings.filterwarnings("ignore", "comm_fusion", ap.AutoParallelWarning)
        with Progress("pipeline: stages + lower", 1) as bar:
            step = ap.train_step(small.loss, ex[0], tuple(ex[1:]), mode=mode,
                                 cluster=args.cluster)
            bar.advance(mode)
    _out(f"\npipelined training of a {_pipeline_layers(args)}-layer transformer: {p} stages "
         f"x {args.devices // p} devices, "
         f"{step.plan.micro_batches} micro-batches, {step.plan.schedule.name} (comm_fusion "
         "is not applied here: one psum per stage's gradient-sync group)")
    _out(step.plan.summary())
    losses, ref_losses, err, ok = _run_and_compare(step, ex[0], small.loss, ex, args.steps,
                                                   "pipelined steps")
    _out(f"pipelined losses {[round(x, 6) for x in losses]} vs one device "
         f"{[round(x, 6) for x in ref_losses]}; max parameter difference {err:.2e} -> "
         f"{'OK' if ok else 'MISMATCH'}")
    return ok


def _pipeline_layers(args: argparse.Namespace) -> int:
    """The pipelined transformer's layers: --layers, at least 2 and one per stage."""
    return max(2, args.layers, args.pipeline_stages)


def _run_and_compare(step: Any, params: Any, loss_fn: Any, ex: tuple[Any, ...], steps: int,
                     label: str) -> tuple[list[float], list[float], float, bool]:
    """Run ``steps`` steps; (losses, one-device losses, max parameter difference, ok) with
    the rule of ``run --check`` (:func:`autopar.cli_util.compare_with_reference`)."""
    state, losses = step.init(ex[0]), []
    with Progress(label, steps) as bar:
        for _ in range(steps):
            params, state, loss = step(params, state, *ex[1:])
            losses.append(float(loss))
            bar.advance(f"loss {losses[-1]:.6f}")
    ref_losses, ref = one_device_steps(loss_fn, ex, steps, step.optimizer)
    err, _, ok = compare_with_reference(losses, params, ref_losses, ref)
    return losses, ref_losses, err, ok
