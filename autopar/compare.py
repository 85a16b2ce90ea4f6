"""Compare the search modes on one graph: every mode's plan side by side, like for like.

Every mode solves the same :class:`~autopar.strategies.problem.Problem` (one cost model), so
the predicted figures compare directly; ``exact`` (the integer program) is the referee.
``sharding_propagation`` needs at least one operator with a strategy (MindSpore propagates the
strategies the user set): the comparison seeds it with the strategy the ``exact`` plan (or,
without exact, the first other plan) gives the first matmul / convolution, as a user copying
one layer's strategy would.

>>> import jax.numpy as jnp, autopar as ap
>>> g = ap.trace(lambda p, x: jnp.sum(jnp.tanh(x @ p["w"])), {"w": jnp.ones((64, 256))},
...              jnp.ones((32, 64)))
>>> rows = compare_modes(g, device_num=8)
>>> [r.mode for r in rows]
['exact', 'dynamic_programming', 'recursive_programming', 'sharding_propagation']
>>> rows[1].ratio_to_exact
1.0
"""

from __future__ import annotations

import io
import json
import math
import os
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autopar.files import writable_target, write_files_atomic
from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.graph.ir import Graph
from autopar.strategies.plan import Plan

if TYPE_CHECKING:
    from autopar.setup import Setup

__all__ = ["ModeResult", "compare_modes", "comparison_rows", "write_comparison",
           "check_comparison_dir", "COMPARISON_FILES", "ORDER"]

ORDER = ("exact", "dynamic_programming", "recursive_programming", "sharding_propagation")
_SEEDED = ("dot_general", "conv_general_dilated")


@dataclass
class ModeResult:
    """One mode's plan in figures (times in seconds, sizes in bytes per device)."""

    mode: str
    step_seconds: float
    objective: float
    compute_seconds: float
    communication_seconds: float
    comm_bytes: int
    collectives: int
    collective_kinds: dict[str, int]
    memory_bytes: float
    search_seconds: float
    ratio_to_exact: float | None = None
    measured_step_seconds: float | None = None
    plan: Plan | None = None

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("plan")
        return d


def _figures(graph: Graph, plan: Plan) -> ModeResult:
    from autopar.rewrite import rewrite

    pg = rewrite(graph, plan)
    kinds = {k: v for k, v in pg.comm_counts().items() if k != "slice"}
    c = plan.cost
    return ModeResult(plan.mode, c.total, plan.objective, c.compute,
                      c.communication + c.redistribution + c.gradient_sync, pg.comm_bytes(),
                      sum(kinds.values()), kinds, c.memory_bytes, plan.search_seconds,
                      plan=plan)


def compare_modes(graph: Graph, *, device_num: int | None = None, cluster: Any = None,
                  modes: Sequence[str] = ORDER,
                  on_done: Callable[[str], None] | None = None,
                  setup: Setup | None = None) -> list[ModeResult]:
    """Search ``graph`` with every mode in ``modes`` (under ``parallel_mode="auto_parallel"``)
    and return one :class:`ModeResult` each, in ``modes`` order (exact first when present).

    The stores (the context, the algorithm parameters, the cluster) are read once, into one
    :class:`~autopar.setup.Setup` every mode plans from
    (:func:`autopar.planner.search_graph`); ``setup``: the one its caller's entry point
    resolved instead (the CLI's, once per command; then ``cluster`` is not given).
    ``on_done(mode)`` is called after each search (progress bars). The context's strategy
    files are not used here (each mode searches)."""
    from autopar.context import auto_parallel_context
    from autopar.planner import search_graph
    from autopar.setup import Setup, resolve_setup
    from autopar.strategies.modes import SOLVERS as MODES

    if not isinstance(graph, Graph):
        raise AutoParallelTypeError("graph", graph, "the Graph returned by autopar.trace")
    if not isinstance(modes, (list, tuple)) or not modes or not all(
            isinstance(m, str) for m in modes):
        raise AutoParallelTypeError("modes", modes, "a non-empty list of search mode names")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise AutoParallelError("modes", bad, f"unknown search modes; choose from {list(MODES)}")
    if setup is not None and not isinstance(setup, Setup):
        raise AutoParallelTypeError("setup", setup, "an autopar.setup.Setup (resolve_setup)")
    if setup is not None and cluster is not None:
        raise AutoParallelError("cluster", cluster, "the setup given prices the plans "
                                "(its own cluster)", "Give cluster= or setup=, not both")
    # the usual order first, then any other registered mode asked for (never dropped)
    order = [m for m in ORDER if m in modes] + [m for m in dict.fromkeys(modes)
                                                 if m not in ORDER]
    if setup is None:  # (checked as searched here: without the strategy files)
        with auto_parallel_context(strategy_ckpt_load_file="", strategy_ckpt_save_file=""):
            setup = resolve_setup(cluster)  # the stores, read once for every mode
    # strategy files would make every mode load (or overwrite) the same plan: off here
    planned = setup.with_config(strategy_ckpt_load_file="", strategy_ckpt_save_file="",
                                parallel_mode="auto_parallel")
    plans: dict[str, Plan] = {}
    for mode in order:
        fixed = None
        if mode == "sharding_propagation":
            fixed = _seed(graph, plans)
        plans[mode] = search_graph(graph, planned, mode=mode, device_num=device_num,
                                   fixed=fixed, parallel_mode="auto_parallel")
        if fixed:
            plans[mode] = plans[mode].with_notes(f"seeded with {fixed}")
        if on_done is not None:
            on_done(mode)
    rows = [_figures(graph, plans[m]) for m in order]
    if "exact" in plans:
        best = plans["exact"].objective
        for r in rows:
            r.ratio_to_exact = r.objective / best if best > 0 else 1.0
    return rows


def _seed(graph: Graph, plans: dict[str, Plan]) -> dict[str, Any]:
    first = next((n for n in graph.nodes if n.op in _SEEDED), graph.nodes[0] if graph.nodes
                 else None)
    if first is None:
        raise AutoParallelError("graph", graph.name, "has no operators to compare")
    ref = plans.get("exact") or next(iter(plans.values()), None)
    if ref is not None:
        return {first.name: ref.nodes[first.name].strategy}
    return {first.name: tuple((1,) * graph.spec(v).rank for v in first.inputs)}


def comparison_rows(rows: Sequence[ModeResult], *, measured: bool = False) -> list[tuple]:
    """Header + one row per mode, formatted for :func:`autopar.text.table`."""
    head = ["mode", "step ms", "vs exact", "comm MB", "collectives", "memory MiB",
            "search s"]
    if measured:
        head.append("measured ms")
    out: list[tuple] = [tuple(head)]
    for r in rows:
        row = [r.mode, f"{r.step_seconds * 1e3:.3f}",
               "-" if r.ratio_to_exact is None else f"{r.ratio_to_exact:.4f}",
               f"{r.comm_bytes / 2**20:.2f}", str(r.collectives),
               f"{r.memory_bytes / 2**20:.1f}", f"{r.search_seconds:.3f}"]
        if measured:
            row.append("-" if r.measured_step_seconds is None
                       else f"{r.measured_step_seconds * 1e3:.2f}")
        out.append(tuple(row))
    return out


#: what :func:`write_comparison` writes in its directory
COMPARISON_FILES = ("compare.json", "compare.md", "compare.png")


def check_comparison_dir(out_dir: Any, key: str = "out_dir") -> None:
    """Refuse ``out_dir`` unless :func:`write_comparison` can write every file there: a
    directory, or a path to make one at (its parent a directory), holding no directory or
    special file under the names it writes."""
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir) or "\0" in str(out_dir):
        raise AutoParallelTypeError(key, out_dir, "a directory path")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise AutoParallelError(key, str(out), "is not a directory (the comparison writes "
                                f"{', '.join(COMPARISON_FILES)} in it)")
    if out.is_dir():
        for name in COMPARISON_FILES:
            writable_target(out / name, f"{key} ({name})")
        return
    there = next(p for p in out.absolute().parents if p.exists())  # (made with its parents)
    if not there.is_dir():
        raise AutoParallelError(key, str(out), f"{str(there)!r} is not a directory")


def write_comparison(rows: Sequence[ModeResult], out_dir: str | os.PathLike[str], *,
                     title: str, meta: dict[str, Any]) -> dict[str, Path]:
    """Write ``compare.json``, ``compare.md`` and, when matplotlib is installed (the ``plot``
    extra), ``compare.png``; returns the paths written. The files are written all or
    nothing (:func:`autopar.files.write_files_atomic`), and a directory made for them is
    removed again when they cannot be written."""
    from autopar.text import markdown_table

    check_comparison_dir(out_dir)  # every target, before the first is written
    out = Path(out_dir)
    measured = any(r.measured_step_seconds is not None for r in rows)
    doc = {"title": title, **meta, "modes": [r.as_json() for r in rows]}
    md = f"# {title}\n\n" + markdown_table(comparison_rows(rows, measured=measured)) + "\n"
    md += "\n" + "\n".join(f"- {k}: {v}" for k, v in sorted(meta.items())) + "\n"
    files = {"json": (out / "compare.json", json.dumps(doc, indent=1, sort_keys=True) + "\n"),
             "markdown": (out / "compare.md", md)}
    png = _plot(rows, title, measured)
    if png is not None:
        files["png"] = (out / "compare.png", png)
    made = [p for p in (out, *out.parents) if not p.exists()]  # (made here, deepest first)
    out.mkdir(parents=True, exist_ok=True)
    try:
        written = write_files_atomic([(path, data, f"out_dir ({path.name})")
                                      for path, data in files.values()])
    except BaseException:
        for d in made:
            try:
                d.rmdir()
            except OSError:
                break
        raise
    return dict(zip(files, written))


def _plot(rows: Sequence[ModeResult], title: str, measured: bool) -> bytes | None:
    """The comparison drawn as a PNG; None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(8, 3.6))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    names = [r.mode.replace("_", "\n") for r in rows]
    x = range(len(rows))
    handles = [ax1.bar([i - 0.2 for i in x], [r.step_seconds * 1e3 for r in rows], 0.4,
                       label="predicted")]
    ax1.set_ylabel("predicted step (ms)")
    if measured:  # its own axis: a model of another machine can be 1000x off in absolute terms
        ax3 = ax1.twinx()
        handles.append(ax3.bar([i + 0.2 for i in x], [(r.measured_step_seconds or math.nan)
                                                      * 1e3 for r in rows], 0.4,
                               label="measured", color="tab:orange"))
        ax3.set_ylabel("measured step (ms)")
    ax1.set_xticks(list(x), names, fontsize=7)
    ax1.legend(handles=handles, fontsize=7)
    ax2.bar(list(x), [r.search_seconds for r in rows], 0.5, color="tab:gray")
    ax2.set_xticks(list(x), names, fontsize=7)
    ax2.set_ylabel("search time (s)")
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()
