"""The `autopar` command: demo, search, compare, run, tune, simulate, show, calibrate (verbs
named after the API functions they call: autopar.search, autopar.simulation.simulate, ...).

    autopar demo                                   the main job end to end on 8 emulated devices
    autopar search  --model transformer -o layers=2 --devices 8 --mode dynamic_programming
    autopar compare --model mlp --devices 8 [--measure] [--out DIR]
    autopar run     --model mlp --devices 8 --steps 3 --check [--save FILE | --load FILE]
    autopar tune    --model mlp --devices 8 -k 4 [--steps 5] [--save FILE | --load FILE]
    autopar simulate --model transformer --devices 8 [--out trace.json] [--png trace.png]
    autopar show    strategy.json
    autopar reshard CKPT OUT (--to-strategy FILE | --devices N) [--from-strategy FILE]

``--model`` is a zoo name (mlp, transformer, tfm_stack, resnet50; builder options with
``-o KEY=VALUE``) or ``MODULE:FUNCTION`` naming a function that returns ``(fn, example_args)``.
``python -m autopar`` is the same command. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import json
import math
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Sequence

from autopar.files import write_text_atomic
from autopar.cli_util import (CLIError, compare_with_reference, dir_path, drop_gloo_lines,
                              escape_breaks, file_path, load_model, non_negative_float,
                              one_device_steps, one_line, parse_options, positive_int,
                              setup_devices)
from autopar.gc_pause import paused_gc
from autopar.text import Progress, table

with paused_gc():  # the planning modules bring JAX, NumPy and SciPy: most of the start-up
    from autopar.strategies.modes import PARALLEL_MODES
    from autopar.strategies.modes import SEARCH_MODES as MODES

__all__ = ["main", "build_parser"]

COORDINATOR_TIMEOUT_S = 60


def _out(*a: Any) -> None:
    print(*a, flush=True)


def _graph(args: argparse.Namespace, *, concrete: bool = False) -> tuple[Any, Any, Any, str]:
    import autopar as ap

    fn, ex, desc = load_model(args.model, parse_options(args.option), concrete=concrete)
    with Progress("trace", 1) as bar:
        with _users_function(args):
            graph = ap.trace(fn, *ex)
        bar.advance(f"{len(graph.nodes)} nodes")
    return fn, ex, graph, desc


@contextlib.contextmanager
def _users_function(args: argparse.Namespace) -> Iterator[None]:
    """The user's function traced inside: its own error (not autopar's) in one line."""
    from autopar.errors import AutoparError

    try:
        yield
    except AutoparError:
        raise
    except Exception as e:  # the user's function does not trace: say so in one line
        raise CLIError(f"--model {args.model!r}: tracing the function failed: "
                       f"{one_line(e)}") from None


def _context(args: argparse.Namespace, **extra: Any) -> Any:
    import autopar as ap

    pmode = getattr(args, "parallel_mode", None) or "auto_parallel"
    keys = dict(device_num=args.devices, parallel_mode=pmode)
    keys.update({k: v for k, v in extra.items() if v is not None})
    if pmode == "stand_alone":  # one device: the command's parallel defaults do not apply
        keys = {k: v for k, v in keys.items() if k not in ("device_num", "gradients_mean")}
    return ap.auto_parallel_context(**keys)


def _cluster(args: argparse.Namespace) -> Any:
    """The command's cost model, resolved once (:func:`autopar.clusters.resolve_cluster`):
    ``--cluster`` (a preset, ``calibrated`` or a calibration file) or the default of the
    devices present; None for a ``--load`` without ``--cluster`` (the file's own)."""
    if args.cluster is None and getattr(args, "load", None):
        return None
    from autopar.clusters import resolve_cluster

    return resolve_cluster(args.cluster)


def _inputs_first(args: argparse.Namespace) -> None:
    """A --load file read and checked as far as it can be without the graph, before the
    trace: a bad file fails at once."""
    if getattr(args, "load", None):
        from autopar.checkpoint import read_strategy_file

        read_strategy_file(args.load)


def _check_plan_files(args: argparse.Namespace) -> None:
    """--save / --load only where the search reads them; --mode only where a search mode is
    used (auto_parallel, the default) and not with a load."""
    pmode = args.parallel_mode
    if args.mode and pmode not in (None, "auto_parallel"):
        raise CLIError(f"--mode applies to --parallel-mode auto_parallel only (under {pmode} "
                       "the strategies are not searched by a mode; drop --mode)")
    for flag in ("save", "load"):
        if getattr(args, flag, None) and pmode not in ("semi_auto_parallel", "auto_parallel"):
            raise CLIError(f"--{flag} needs --parallel-mode auto_parallel or "
                           f"semi_auto_parallel (strategy files are not used under {pmode})")
    if args.load and args.mode:
        raise CLIError("--mode does not apply with --load: the plan comes from the file "
                       "(drop --mode, or drop --load to search)")


# ---------------------------------------------------------------------------- search


def cmd_search(args: argparse.Namespace) -> int:
    from autopar.planner import explain_node, search_graph
    from autopar.setup import resolve_setup

    _check_plan_files(args)
    _outputs_first(("--save", args.save), inputs=(("--load", args.load),
                                                   ("--cluster", args.cluster)))
    save = str(args.save) if args.save else None
    load = str(args.load) if args.load else None
    _inputs_first(args)
    cluster = _cluster(args)
    with paused_gc():  # a one-shot command: its imports and graph are long-lived
        _, _, graph, desc = _graph(args)
        _check_node_names("--explain", args.explain or (), graph)
        fixed = _fixed_strategies(args.fix or (), graph)
        with _context(args, strategy_ckpt_save_file=save, strategy_ckpt_load_file=load):
            with Progress("search", 1) as bar:
                setup = resolve_setup(cluster)  # the stores, read once for the command
                plan = search_graph(graph, setup, mode=args.mode, fixed=fixed or None)
                bar.advance(plan.mode)
            explained = [explain_node(graph, plan, name, setup) for name in args.explain or ()]
    _out(f"{desc}: {len(graph.nodes)} operators, {len(graph.parameters())} parameters, "
         f"fingerprint {graph.fingerprint()[:12]}")
    _out(plan.summary())
    if args.full:  # the operator table (the summary is printed above)
        _out("\n" + str(plan)[len(plan.summary()):].lstrip("\n"))
    else:
        rows = [("parameter", "shape", "layout", "splits")]
        rows += [(v, str(graph.spec(v).shape), str(plan.layouts[v]),
                  str(plan.split_counts(v))) for v in graph.parameters()[:args.limit]]
        _out("\n" + table(rows, align="llll"))
        if len(graph.parameters()) > args.limit:
            _out(f"... {len(graph.parameters()) - args.limit} more (--limit, --full)")
    for note in plan.notes:
        _out(f"note: {note}")
    for explanation in explained:
        _out("\n" + explanation.text(limit=args.limit))
    if save:
        _out(f"\nstrategy file written: {save}")
    return 0


def _check_node_names(flag: str, names: Sequence[str], graph: Any) -> None:
    """Operators an option names, checked before anything is searched or written."""
    import difflib

    known = [n.name for n in graph.nodes]
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            raise CLIError(f"{flag} {name!r}: no such operator in the model"
                           + (f" (did you mean {close[0]!r}?)" if close else
                              " (`autopar search --full` lists them)"))


def _fixed_strategies(items: Sequence[str], graph: Any) -> dict[str, Any]:
    """``--fix OPERATOR=STRATEGY`` -> ``fixed=``: MindSpore strategy tuples, one per input
    (checked by the search itself, as ``autopar.search(fixed=...)``)."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        try:
            strategy = ast.literal_eval(raw) if sep else None
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            strategy = None
        if not name or strategy is None:
            raise CLIError(f"--fix {item!r} must look like OPERATOR=STRATEGY, e.g. "
                           "'layer0/dot_general_0=((1, 1), (1, 8))'")
        if name in out:
            raise CLIError(f"--fix {name!r} is given twice; give it once")
        out[name] = strategy
    _check_node_names("--fix", list(out), graph)
    return out


# ---------------------------------------------------------------------------- compare


def _build_step(fn: Any, ex: tuple, plan: Any, graph: Any, devices: int) -> Any:
    """A compiled, warmed-up training step (forward, backward, sync, SGD) running ``plan``
    (saved to a strategy file and loaded, so exactly that plan runs)."""
    import jax

    import autopar as ap

    with tempfile.TemporaryDirectory() as tmp:
        path = ap.save_strategy(plan, graph, Path(tmp) / "plan.json")
        with ap.auto_parallel_context(device_num=devices, parallel_mode="auto_parallel",
                                      strategy_ckpt_load_file=str(path), gradients_mean=True):
            step = ap.train_step(fn, ex[0], tuple(ex[1:]))
    state = [step.prepare(ex[0]), step.init(ex[0])]
    params, opt, loss = step(*state, *ex[1:])
    jax.block_until_ready(loss)
    return step, [params, opt]


def _measure_all(fn: Any, ex: tuple, rows: list, graph: Any, devices: int,
                 steps: int) -> None:
    """Median step time of every plan, timed round-robin (one step of each plan per round) so
    that noise from a shared machine hits every plan alike."""
    import jax

    built = []
    with Progress("compile", len(rows)) as bar:
        for r in rows:
            built.append(_build_step(fn, ex, r.plan, graph, devices))
            bar.advance(r.mode)
    times: list[list[float]] = [[] for _ in rows]
    with Progress("measure rounds", steps) as bar:
        for _ in range(steps):
            for k, (step, state) in enumerate(built):
                t0 = time.perf_counter()
                params, opt, loss = step(*state, *ex[1:])
                jax.block_until_ready(loss)
                times[k].append(time.perf_counter() - t0)
                state[:] = [params, opt]
            bar.advance()
    for r, ts in zip(rows, times):
        r.measured_step_seconds = sorted(ts)[len(ts) // 2]


def cmd_compare(args: argparse.Namespace) -> int:
    from autopar.compare import (check_comparison_dir, compare_modes, comparison_rows,
                                 write_comparison)
    from autopar.setup import resolve_setup

    modes = args.modes or list(MODES)
    if args.steps is not None and not args.measure:
        raise CLIError("--steps applies with --measure only (the timed steps); add --measure "
                       "or drop --steps")
    args.steps = 3 if args.steps is None else args.steps
    check_comparison_dir(args.out, "--out")  # before any work: nothing written on a refusal
    args.cluster = _cluster(args)
    fn, ex, graph, desc = _graph(args, concrete=args.measure)
    with Progress("search modes", len(modes)) as bar:
        with _context(args):
            setup = resolve_setup(args.cluster)  # the stores, read once for the command
            rows = compare_modes(graph, device_num=args.devices, modes=modes,
                                 on_done=bar.advance, setup=setup)
    if args.measure:
        _measure_all(fn, ex, rows, graph, args.devices, args.steps)
    title = f"search modes: {desc} on {args.devices} devices, cluster {args.cluster.name}"
    _out(title)
    _out(table(comparison_rows(rows, measured=args.measure)))
    meta = {"model": desc, "devices": args.devices, "cluster": args.cluster.name,
            "command": "autopar " + " ".join(args.argv)}
    paths = write_comparison(rows, args.out, title=title, meta=meta)
    _out("\nwritten: " + ", ".join(str(p) for p in paths.values()))
    if "png" not in paths:
        _out("(no PNG: install the plot extra, pip install 'autopar[plot]')")
    return 0


# ---------------------------------------------------------------------------- run


def _distributed(args: argparse.Namespace) -> None:
    """Multi-process set-up (before any JAX computation): CPU devices, gloo, initialize."""
    import jax

    if args.num_processes == 1:
        if args.coordinator is not None or args.process_id is not None:
            raise CLIError("--coordinator / --process-id need --num-processes > 1")
        if args.backend == "cpu":
            setup_devices(args.devices)
        return
    if args.coordinator is None or args.process_id is None:
        raise CLIError("--num-processes > 1 needs --coordinator HOST:PORT and --process-id")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not (port.isascii() and port.isdigit() and len(port) <= 5) or \
            not 1 <= int(port) <= 65535:
        raise CLIError(f"--coordinator {args.coordinator!r}: expected HOST:PORT with a port in "
                       "[1, 65535], e.g. 127.0.0.1:12355")
    if not 0 <= args.process_id < args.num_processes:
        raise CLIError(f"--process-id must be in [0, {args.num_processes}), got "
                       f"{args.process_id}")
    if args.devices % args.num_processes:
        raise CLIError(f"--devices {args.devices} must divide evenly over "
                       f"--num-processes {args.num_processes}")
    if args.backend == "cpu":  # emulated CPU devices, connected with gloo
        setup_devices(args.devices // args.num_processes)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        drop_gloo_lines()
    from autopar.errors import AutoparError
    from autopar.multihost import join

    try:  # (the processes meet first: where XLA's client would abort, one line says why)
        join(args.coordinator, args.num_processes, args.process_id,
             timeout_s=COORDINATOR_TIMEOUT_S, on_lost=_lost_line(args.command),
             facts={"--devices": args.devices, "--backend": args.backend})
    except AutoparError as e:
        raise CLIError(f"--coordinator {args.coordinator}: {e}") from None
    except Exception as e:  # jax raises RuntimeError/XlaRuntimeError here
        raise CLIError(f"--coordinator {args.coordinator}: could not form the "
                       f"{args.num_processes}-process cluster within "
                       f"{COORDINATOR_TIMEOUT_S} s ({one_line(e)})") from None
    if jax.device_count() != args.devices:  # (another process was given other --devices)
        raise CLIError(f"--devices {args.devices}: the {args.num_processes} processes hold "
                       f"{jax.device_count()} devices in all; give every process the same "
                       "--devices")
    _same_arguments(args)


#: Arguments each process of a job may give its own: who it is, the files it writes or reads
#: (process 0 writes; a plan loaded is compared by its text) and its cluster (process 0's
#: prices every plan, with a notice): :mod:`autopar.multihost`.
_OWN_ARGUMENTS = frozenset({"process_id", "func", "argv", "json", "save", "load", "out",
                            "cluster"})


def _same_arguments(args: argparse.Namespace) -> None:
    """Every process of the job was given the same command (other --steps, --mode or
    --model options made one process wait for the others forever): where any differs,
    every process fails at once, naming it."""
    from autopar.multihost import check_same

    given = sorted((k, repr(v)) for k, v in vars(args).items() if k not in _OWN_ARGUMENTS)
    check_same(repr(given), "arguments", f"the arguments of `autopar {args.command}` (all but "
               "--process-id, --cluster and the files it writes or reads)")


def _lost_line(command: str) -> Callable[[str, int], None]:
    """What a process of a job does when another one is lost (or it is stopped by a
    signal): its one error line, then it ends at once (no collective to wait in, no
    ``jax.distributed`` shutdown to wait for the lost one)."""
    def lost(message: str, status: int) -> None:
        sys.stdout.flush()
        sys.stderr.write(f"autopar {command}: error: {escape_breaks(message)}\n")
        sys.stderr.flush()
        os._exit(status)
    return lost


def _global_numpy(tree: Any) -> Any:
    import jax
    import numpy as np

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        tree = multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(np.asarray, tree)


def _run_arguments(args: argparse.Namespace) -> None:
    """run's checks that need no device: before a multi-process run joins its cluster."""
    _check_plan_files(args)
    _inputs_first(args)
    if args.atol is not None and not args.check:
        raise CLIError("--atol applies with --check only (its tolerance); add --check or drop "
                       "--atol")
    _outputs_first(("--json", args.json), ("--save", args.save),
                   inputs=(("--load", args.load), ("--cluster", args.cluster)))


def cmd_run(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    import autopar as ap

    fn, ex, desc = load_model(args.model, parse_options(args.option), concrete=True)
    if not ex:
        raise CLIError(f"--model {args.model!r}: run trains fn(params, *batch): the example "
                       "arguments are empty")
    ex = tuple(jax.tree.map(np.asarray, ex))  # host arrays: identical on every process
    lead = jax.process_index() == 0
    save = str(args.save) if args.save else None
    load = str(args.load) if args.load else None
    with _context(args, strategy_ckpt_save_file=save if lead else None,
                  strategy_ckpt_load_file=load, gradients_mean=True):
        with _users_function(args):
            step = ap.train_step(fn, ex[0], tuple(ex[1:]), mode=args.mode,
                                 cluster=_cluster(args))
    params, state = step.prepare(ex[0]), step.init(ex[0])
    losses = []
    with Progress("train steps", args.steps, quiet=not lead) as bar:
        for k in range(args.steps):
            params, state, loss = step(params, state, *ex[1:])
            losses.append(float(loss))
            bar.advance(f"loss {losses[-1]:.6f}")
    final = _global_numpy(params)
    result: dict[str, Any] = {
        "model": desc, "devices": args.devices, "processes": jax.process_count(),
        "mode": step.plan.mode, "losses": losses,
        "param_sums": [float(np.sum(x, dtype=np.float64)) for x in jax.tree.leaves(final)],
        "collectives": {k: v for k, v in step.parallel_graph.comm_counts().items()}}
    ok = True
    if args.check:
        ref_losses, ref = one_device_steps(fn, ex, args.steps, step.optimizer)
        diff, loss_diff, ok = compare_with_reference(losses, final, ref_losses, ref,
                                                     atol=args.atol)
        result.update(reference_losses=ref_losses, max_param_diff=diff,
                      max_loss_diff=loss_diff, match=ok)
    if lead:
        _out(f"{desc} on {step.device_num} device(s) ({jax.process_count()} process(es)): "
             f"{step.plan.summary()}")
        rows = [("step", "loss") + (("one device",) if args.check else ())]
        for k, loss in enumerate(losses):
            rows.append((str(k + 1), f"{loss:.6f}") + ((f"{result['reference_losses'][k]:.6f}",)
                                                      if args.check else ()))
        _out(table(rows))
        if args.check:
            _out(f"max parameter difference vs one device {result['max_param_diff']:.2e} -> "
                 f"{'OK' if ok else 'MISMATCH'}")
        if save:
            _out(f"strategy file written: {save}")
        if args.json:  # (strict JSON: a loss that is not finite is null)
            write_text_atomic(args.json, json.dumps(_finite_or_null(result), indent=1,
                                                    sort_keys=True, allow_nan=False) + "\n")
    return 0 if ok else 1


# ---------------------------------------------------------------------------- tune


def cmd_tune(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    from autopar.tune import check_tune, tuned_train_step

    check_tune(args.k, "k", 2)  # before any work
    if args.load and args.mode:
        raise CLIError("--mode does not apply with --load: the plan comes from the file "
                       "(drop --mode, or drop --load to measure)")
    _outputs_first(("--save", args.save), inputs=(("--load", args.load),
                                                   ("--cluster", args.cluster)))
    _inputs_first(args)
    fn, ex, desc = load_model(args.model, parse_options(args.option), concrete=True)
    if not ex:
        raise CLIError(f"--model {args.model!r}: tune trains fn(params, *batch): the example "
                       "arguments are empty")
    ex = tuple(jax.tree.map(np.asarray, ex))
    save = str(args.save) if args.save else None
    load = str(args.load) if args.load else None
    with _context(args, strategy_ckpt_save_file=save, strategy_ckpt_load_file=load,
                  gradients_mean=True):
        with _users_function(args):
            step = tuned_train_step(fn, ex[0], tuple(ex[1:]), k=args.k, steps=args.steps,
                                    mode=args.mode, cluster=_cluster(args))
    _out(f"{desc} on {step.device_num} devices: kept {step.tuning.chosen.name}")
    _out(str(step.tuning))
    _out("\n" + step.plan.summary())
    if save:
        _out(f"strategy file written: {save}")
    return 0


# ---------------------------------------------------------------------------- trace / show


def _finite_or_null(x: Any) -> Any:
    """``x`` with every float that is not finite (a diverged loss) as None: JSON has no NaN."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_null(v) for v in x]
    return x


def _outputs_first(*named: tuple[str, Any], inputs: Sequence[tuple[str, Any]] = ()) -> None:
    """Every output path given is checked before any work (so none is written when another
    is refused afterwards, and a bad one fails at once), and no two name one file, nor an
    output a file the command reads (a --load file replaced by the --json report); --save
    may name the --load file (the same plan, as strategy_ckpt_config allows)."""
    from autopar.files import writable_target

    seen: dict[str, str] = {}
    for flag, path in [*named, *inputs]:
        if path is None or (flag, path) in inputs and not Path(str(path)).exists():
            continue  # (an input that is no file: a preset's name)
        where = writable_target(path, flag) if (flag, path) in named else Path(str(path))
        real = os.path.realpath(where)
        if real in seen and {seen[real], flag} != {"--save", "--load"}:  # (one plan: allowed)
            raise CLIError(f"{seen[real]} and {flag} name the same file {str(path)!r}: "
                           "give each its own")
        seen[real] = flag


def cmd_simulate(args: argparse.Namespace) -> int:
    from autopar.planner import search_graph
    from autopar.setup import resolve_setup
    from autopar.timeline import simulate_setup

    _outputs_first(("--out", args.out), ("--png", args.png),
                   inputs=(("--cluster", args.cluster),))
    _, _, graph, desc = _graph(args)
    cluster = _cluster(args)
    with _context(args):
        with Progress("search + simulate", 2) as bar:
            setup = resolve_setup(cluster)  # the stores, read once for the command
            plan = search_graph(graph, setup, mode=args.mode)
            bar.advance(plan.mode)
            it = simulate_setup(graph, plan, setup, buckets=args.buckets)
            bar.advance("iteration trace")
    _out(f"{desc}: {plan.summary()}\n")
    _out(it.summary())
    _out(it.table())
    if args.out:
        it.write_chrome_trace(args.out)
        _out(f"\nChrome trace written: {args.out} (open in ui.perfetto.dev)")
    if args.png:
        try:
            it.plot(args.png)
            _out(f"PNG written: {args.png}")
        except ImportError:
            _out("(no PNG: install the plot extra, pip install 'autopar[plot]')")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from autopar.checkpoint import read_strategy_file

    f = read_strategy_file(args.file)
    p = f.predicted
    _out(f"strategy file {args.file} (format {f.format} v{f.version})")
    _out(table([("field", "value"),
                ("fingerprint", f.fingerprint), ("device_num", f.device_num),
                ("mesh", " x ".join(f"{a.name}:{a.size}" for a in f.mesh)),
                ("mode", f.mode), ("cluster", f.cluster.get("name", "?")),
                ("enable_alltoall", f.enable_alltoall), ("memory_weight", f.memory_weight),
                ("predicted step", f"{p.step_seconds * 1e3:.3f} ms (compute "
                 f"{p.compute * 1e3:.3f}, communication {p.communication * 1e3:.3f}, "
                 f"redistribution {p.redistribution * 1e3:.3f}, gradient sync "
                 f"{p.gradient_sync * 1e3:.3f})"),
                ("memory per device", f"{p.memory_bytes / 2**20:.1f} MiB"),
                ("operators", len(f.parallel_strategy_item)),
                ("parameters", len(f.parallel_layout_item)),
                ("data inputs", len(f.data_layout_item))], align="ll"))
    if f.tuning is not None:
        t = f.tuning
        _out(f"\ntuning: median of {t.steps} round(s) on {t.machine}; priced on {t.cluster}")
        _out(table([("plan", "predicted ms", "measured ms", "chosen")] + [
            (r.name, f"{r.predicted_ms:.4g}", "-" if r.measured_ms is None else
             f"{r.measured_ms:.4g}", "*" if r.chosen else "") for r in t.rows], align="lrrl"))
    ops = list(f.parallel_strategy_item.items())
    rows = [("operator", "op", "stage", "strategy", "splits")]
    rows += [(k, e.op, e.stage, str([tuple(s) for s in e.parallel_strategy]).replace(" ", ""),
              str(tuple(e.splits)).replace(" ", "")) for k, e in ops[:args.limit]]
    _out("\n" + table(rows, align="lllll"))
    if len(ops) > args.limit:
        _out(f"... {len(ops) - args.limit} more operators (--limit)")
    for what, layouts in (("parameter", f.parallel_layout_item),
                          ("data input", f.data_layout_item)):
        items = list(layouts.items())
        rows = [(what, "tensor_shape", "dev_matrix", "tensor_map", "slice_shape")]
        rows += [(k, e.tensor_shape, e.dev_matrix, e.tensor_map, e.slice_shape)
                 for k, e in items[:args.limit]]
        _out("\n" + table(rows, align="lllll"))
        if len(items) > args.limit:
            _out(f"... {len(items) - args.limit} more {what}s (--limit)")
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    """A checkpoint (``autopar.save_checkpoint``) rewritten under another plan's layouts."""
    from autopar.checkpoint import read_strategy_file

    n = read_strategy_file(args.to_strategy).device_num if args.to_strategy else args.devices
    setup_devices(n)  # (JAX is not running yet: the target's devices, emulated)
    from autopar.weights import read_manifest, reshard

    t0 = time.perf_counter()
    out = reshard(args.src, args.dst, to_strategy=args.to_strategy, devices=args.devices,
                  from_strategy=args.from_strategy)
    m = read_manifest(out)
    _out(f"resharded {args.src} ({m.source}) -> {out} on {m.device_num} devices: "
         f"{len(m.params)} parameters, {len(m.opt_state)} optimizer-state arrays "
         f"({time.perf_counter() - t0:.2f} s)")
    return 0


# ---------------------------------------------------------------------------- parser


def _calibrate_arguments(args: argparse.Namespace) -> None:
    """calibrate's checks that need no device: before a multi-process run joins its cluster."""
    if not (args.budget > 0 and args.budget < 1e6):
        raise CLIError(f"--budget: must be a number of seconds in (0, 1e6), got {args.budget}")
    _outputs_first(("--out", args.out))  # before the cache is touched or anything measured


def cmd_calibrate(args: argparse.Namespace) -> int:
    import jax

    import autopar as ap
    from autopar.clusters import cached_calibration, describe_cluster, save_cluster
    from autopar.multihost import is_lead

    t0 = time.perf_counter()
    # --fresh: the cached calibration is replaced once the new one is measured, not before
    cluster = ap.calibrate(args.devices, budget_s=args.budget, fresh=args.fresh,
                           max_message_bytes=2 ** 20 if args.quick else 2 ** 25)
    if not is_lead():  # process 0 reports, keeps and writes
        return 0
    kept = cached_calibration(jax.devices()[:args.devices]) == cluster
    _out(describe_cluster(cluster))
    _out(f"\n{cluster.name}: {time.perf_counter() - t0:.1f} s; " + (
        "cached: plans on these devices are priced on it when no cluster is named" if kept
        else "not cached (AUTOPAR_CACHE_DIR is off or cannot be written): name it with "
        "--cluster FILE, written by --out"))
    if args.out:
        _out(f"calibration file written: {save_cluster(cluster, args.out)}")
    return 0


def _process_args(p: argparse.ArgumentParser) -> None:
    """The options of a command that runs on devices, as one process or several."""
    p.add_argument("--num-processes", type=positive_int, default=1,
                   help="processes (jax.distributed); devices are split evenly")
    p.add_argument("--process-id", type=int, help="this process's index")
    p.add_argument("--coordinator", help="HOST:PORT of process 0")
    p.add_argument("--backend", choices=("cpu", "other"), default="cpu",
                   help="cpu (default): emulate --devices CPU devices, gloo between "
                   "processes; other: leave JAX's platform alone (GPU/TPU hosts)")


def _model_args(p: argparse.ArgumentParser, *, devices: bool = True,
                load: bool = False) -> None:
    p.add_argument("--model", required=True,
                   help="zoo model (mlp, transformer, tfm_stack, resnet50) or MODULE:FUNCTION "
                   "returning (fn, example_args)")
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE",
                   help="model builder option, repeatable (e.g. -o layers=2 -o hidden=64)")
    if devices:
        p.add_argument("--devices", type=positive_int, default=8, help="device_num (default 8)")
    p.add_argument("--cluster", default=None,
                   help="cost model: a preset (accelerator-8x, cpu-emulated), 'calibrated' "
                   "or a calibration file (.json); default: the cached calibration of these "
                   "devices, else their platform's preset"
                   + (" (the strategy file's with --load)" if load else ""))


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line (the usage is in ``--help``); the subcommands'
    parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {escape_breaks(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from autopar.demo import add_demo_parser

    parser = _Parser(prog="autopar", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_parser(sub)

    p = sub.add_parser("search", help="search a plan for a model and print it")
    _model_args(p, load=True)
    p.add_argument("--mode", choices=MODES,
                   help="search mode (default: the context's search_mode, dynamic_programming)")
    p.add_argument("--parallel-mode", choices=PARALLEL_MODES, default="auto_parallel",
                   help="MindSpore's parallel_mode (default auto_parallel)")
    p.add_argument("--save", type=file_path, help="write the strategy file here")
    p.add_argument("--load", type=file_path, help="load the plan from this strategy file")
    p.add_argument("--full", action="store_true", help="print every operator's strategy")
    p.add_argument("--limit", type=positive_int, default=20,
                   help="parameter rows, and alternatives per --explain (default 20)")
    p.add_argument("--fix", action="append", metavar="OPERATOR=STRATEGY",
                   help="fix an operator's strategy, MindSpore's tuples, e.g. "
                        "'layer0/dot_general_0=((1, 1), (1, 8))' (repeatable; what "
                        "sharding_propagation starts from)")
    p.add_argument("--explain", action="append", metavar="OPERATOR",
                   help="why the plan gives this operator its strategy: its alternatives, "
                        "the rest of the plan held, priced whole (repeatable)")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("compare", help="every search mode side by side")
    _model_args(p)
    p.add_argument("--modes", nargs="+", choices=MODES, help="default: all four")
    p.add_argument("--measure", action="store_true",
                   help="also run each plan's training step on emulated devices")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="timed steps with --measure (default 3)")
    p.add_argument("--out", type=dir_path, default=Path("autopar-compare"),
                   help="directory for compare.json / .md / .png (default autopar-compare)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("run", help="train a few steps on emulated devices (or processes)")
    _model_args(p, load=True)
    p.add_argument("--mode", choices=MODES, help="search mode (auto_parallel only)")
    p.add_argument("--parallel-mode", choices=PARALLEL_MODES, default="auto_parallel",
                   help="MindSpore's parallel_mode (default auto_parallel)")
    p.add_argument("--steps", type=positive_int, default=3, help="training steps (default 3)")
    p.add_argument("--check", action="store_true", help="compare with one device")
    p.add_argument("--atol", type=non_negative_float, default=None,
                   help="tolerance of --check (a finite number >= 0; default per parameter "
                        "dtype: 1e-4, four epsilons of bfloat16 / float16)")
    p.add_argument("--save", type=file_path, help="write the strategy file here")
    p.add_argument("--load", type=file_path, help="load the plan from this strategy file")
    p.add_argument("--json", type=file_path, help="write losses and parameter sums as JSON")
    _process_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("tune", help="measure the k cheapest priced plans' training steps on "
                       "these devices and keep the fastest")
    _model_args(p, load=True)
    p.add_argument("-k", type=int, default=4,
                   help="plans to measure, the cheapest priced first (default 4; 2 to 16)")
    p.add_argument("--mode", choices=MODES, help="search mode of the search's own plan")
    p.add_argument("--steps", type=positive_int, default=5,
                   help="timed rounds, each running every plan once (default 5)")
    p.add_argument("--save", type=file_path,
                   help="write the chosen plan's strategy file here, with the measurements")
    p.add_argument("--load", type=file_path,
                   help="a strategy file saved by tune: its plan and measurements, nothing "
                   "measured")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("simulate", help="simulate one iteration (autopar.simulation.simulate): "
                       "the seed's trace points")
    _model_args(p)
    p.add_argument("--mode", choices=MODES, help="search mode (auto_parallel only)")
    p.add_argument("--buckets", choices=("context", "hccl", "none"), default="context",
                   help="gradient buckets: the context's comm_fusion (default), HCCL's split "
                   "strategy, or one per gradient")
    p.add_argument("--out", type=file_path, help="write the Chrome trace JSON here")
    p.add_argument("--png", type=file_path, help="draw the timeline PNG here (plot extra)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("calibrate", help="measure these devices and fit the cost model")
    p.add_argument("--devices", type=positive_int, default=8,
                   help="devices to measure (default 8; CPU devices are emulated)")
    p.add_argument("--out", type=file_path, help="also write the calibration file here")
    p.add_argument("--budget", type=float, default=60.0,
                   help="seconds to aim for (default 60)")
    p.add_argument("--fresh", action="store_true",
                   help="measure even when a calibration of these devices is cached")
    p.add_argument("--quick", action="store_true",
                   help="coarser and faster: collective messages up to 1 MiB only")
    _process_args(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("show", help="pretty-print a strategy file")
    p.add_argument("file", type=file_path, help="a strategy file (--save, strategy_ckpt_save_file)")
    p.add_argument("--limit", type=positive_int, default=30, help="rows per table (default 30)")
    p.set_defaults(func=cmd_show)
    _reshard_parser(sub)
    return parser


def _reshard_parser(sub: Any) -> None:
    p = sub.add_parser("reshard", help="rewrite a checkpoint under another plan's layouts "
                       "(autopar.transform_checkpoints)")
    p.add_argument("src", help="a checkpoint directory (autopar.save_checkpoint)")
    p.add_argument("dst", help="the checkpoint directory to write")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-strategy", type=file_path, metavar="FILE",
                    help="the target plan's strategy file")
    to.add_argument("--devices", type=positive_int, metavar="N",
                    help="spread every array over N devices (its first dim N divides)")
    p.add_argument("--from-strategy", type=file_path, metavar="FILE",
                   help="the strategy file the checkpoint was trained with (checked)")
    p.set_defaults(func=cmd_reshard, setup=0)


#: The commands that run on devices, as one process or several (``_process_args``), and
#: their checks before the processes join.
_JOINS = {cmd_run: _run_arguments, cmd_calibrate: _calibrate_arguments}


def main(argv: Sequence[str] | None = None) -> int:
    """The command (``argv``: its arguments, default ``sys.argv[1:]``); returns the exit
    status (the console script is :func:`autopar.__main__.run`)."""

    if argv is None:  # the command's own process: what it imported lives until it exits
        gc.freeze()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's own name, as for its other errors
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    with warnings.catch_warnings():
        warnings.showwarning = _warning_line(args.command)
        return _run_command(args)


def _warning_line(command: str) -> Callable[..., None]:
    """Warnings as the command's own lines on stderr (not Python's source-line format)."""
    def show(message: Any, category: type, *_: Any, **__: Any) -> None:
        print(f"autopar {command}: warning: {escape_breaks(str(message))}", file=sys.stderr)
    return show


def _run_command(args: argparse.Namespace) -> int:
    """:func:`main` once the arguments are parsed: the command, its errors in one line. A
    process of a multi-process job tells the others how it ended (:func:`autopar.multihost.
    leave`); one that failed ends at once (``jax.distributed``'s shutdown at exit would wait
    for the others, which go on without it only to be stopped)."""
    from autopar.multihost import leave

    status = _command_status(args)
    if leave(ok=status == 0) and status:  # (a process of a job that joined, and failed)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _command_status(args: argparse.Namespace) -> int:
    """The command's exit status, its errors in one line on stderr."""
    from autopar.errors import AutoparError

    try:
        if args.func in _JOINS:
            _JOINS[args.func](args)  # before joining: a bad flag fails here, not its peers
            _distributed(args)
        else:  # the plans are for --devices devices: emulate them (CPU), as a run would
            setup_devices(getattr(args, "setup", getattr(args, "devices", 8)))
        return int(args.func(args))
    except (CLIError, AutoparError) as e:  # (a list of unsupported primitives: its summary)
        _error_line(args.command, str(getattr(e, "summary", e)))
        return 2
    except OSError as e:  # a file that cannot be read or written: the path and the reason
        where = f"{e.filename}: " if e.filename else ""
        _error_line(args.command, f"{where}{e.strerror or e}")
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a failure autopar did not foresee: one line, the cause named
        if os.environ.get("AUTOPAR_DEBUG"):
            raise
        _error_line(args.command, f"{one_line(e)} (set AUTOPAR_DEBUG=1 for the traceback)",
                    "internal error", wait_s=2.0)
        return 1


def _error_line(command: str, message: str, kind: str = "error", wait_s: float = 0.0) -> None:
    """The command's one error line on stderr (a line break in it escaped). In a job of
    several processes, only where the job's watch has not found a process lost first
    (within ``wait_s``: :func:`autopar.multihost.end_first`); else the watch's line is the
    one, and it ends this process."""
    from autopar.multihost import end_first

    if not end_first(wait_s):
        threading.Event().wait()
    print(f"autopar {command}: {kind}: {escape_breaks(message)}", file=sys.stderr)
