"""Real models: the default path against data parallelism, autopar's and plain ``jax.jit``'s.

For every model of the corpus (:data:`benchmarks.corpus.CORPUS`: flax.linen, flax.nnx,
equinox, keras-hub, a mixture-of-experts block), on 8 emulated CPU devices, Adam (``1e-3``),
``gradients_mean=True``, plans priced on this machine's calibration (``ap.calibrate(8)``, the
cluster the default path uses):

- a model autopar cannot trace gets one row, ``status`` the error type and the first sentence
  of its message; nothing is measured (so for a step that fails to build: its row's status);
- otherwise these training steps are built and timed together:

  - ``default``: ``ap.train_step`` under ``parallel_mode="auto_parallel"``, no cluster and no
    search mode named (what a user writes first);
  - ``data_parallel mode``: the same call under ``parallel_mode="data_parallel"``;
  - ``jax.jit DP``: ``jax.value_and_grad`` + the optax update in one ``jax.jit``, parameters
    and optimizer state replicated (``NamedSharding(mesh, P())``), every batch array split on
    dim 0 (``NamedSharding(mesh, P("d"))``, placed each step);
  - every other plan the search weighs (``autopar.planner.ranked_candidates``: the search's
    own, ``data_parallel``, ``megatron tp8``) and recursive_programming's own plan, each
    saved as a strategy file and built from it; a plan already built is not built again.

Timing: every step once to compile, one warm-up round, then ``rounds`` rounds (10; 3 with
``--quick``), each running every step once in a shuffled order (fixed seed); ``measured_ms``
is the median over rounds and each ratio the median over rounds of the two steps' ratio in
the same round. ``predicted_ms`` is the plan's ``cost.total`` on the calibrated cluster.
Goals are printed, not asserted. Writes ``benchmarks/results/models.json``,
``models_summary.json``, the tables of ``docs/models.md`` and the real-code table of
``docs/fidelity.md``.

The model libraries are the ``models`` extra of pyproject.toml; when they are missing, the
benchmark installs it (``pip install -e .[models]``) first.

    .venv/bin/python -m benchmarks models [--quick]
"""

from __future__ import annotations

import importlib
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._common import (
    ROOT,
    DocTables,
    DocTexts,
    markdown_table,
    out_dir,
    run_main,
    spearman,
    write_results,
)

os.environ.setdefault("KERAS_BACKEND", "jax")  # before anything imports keras (the corpus)

COLUMNS = ("model", "library", "plan", "predicted_ms", "measured_ms", "/autopar_dp", "/jit_dp",
           "default_pick", "status")
SUMMARY = ("model", "plans", "default/autopar_dp", "default/jit_dp", "pred_default/dp",
           "spearman", "median_abs_err", "status")
#: docs/fidelity.md's view of the summary: how well the model ranks real code's plans.
FIDELITY = ("model", "plans", "spearman", "median_abs_err", "pred_default/dp",
            "default/autopar_dp")
DEFAULT, AUTOPAR_DP, JIT_DP = "default", "data_parallel mode", "jax.jit DP"
#: Goals, printed at the end (not asserted).
GOALS = {"default/autopar_dp": 1.00, "default/jit_dp": 1.05, "spearman": 0.8,
         "pooled_spearman": 0.9, "median_abs_err": 0.20}
NONE = "-"
#: Search modes whose own plans are measured too (besides the default path's and the hand
#: plans): more plans per model for the fidelity figures.
OTHER_MODES = ("recursive_programming",)
#: The terms of a plan's price, kept in the JSON rows (``<term>_ms``) beside the total.
TERMS = ("compute", "communication", "redistribution", "gradient_sync")
COMMAND = "python -m benchmarks models"


def doc_tables(results: dict[str, dict]) -> DocTexts:
    """docs/models.md's ``summary`` and ``plans`` tables, from models_summary.json and
    models.json."""
    return {("docs/models.md", "summary"): _table(results["models_summary"], SUMMARY),
            ("docs/models.md", "plans"): _table(results["models"], COLUMNS),
            ("docs/fidelity.md", "real_code"): _table(results["models_summary"], FIDELITY)}


def _table(payload: Mapping[str, Any], columns: tuple[str, ...]) -> str:
    text = markdown_table(payload["rows"], columns, fmt=".3g")
    if not payload["rows"]:
        text += f"\n\n_No full run recorded yet: run `{COMMAND}`._"
    return text


DOC_TABLES = DocTables(("models", "models_summary"), doc_tables)


# ---- set-up ----------------------------------------------------------------------------------

def ensure_models_extra() -> None:
    """Install the ``models`` extra (flax, equinox, keras, keras-hub) when it is missing."""
    try:
        import equinox  # noqa: F401
        import flax  # noqa: F401
        import keras_hub  # noqa: F401
    except ImportError:
        print("installing the model libraries: pip install -e .[models]", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", ".[models]"],
                       cwd=ROOT, check=True)
        importlib.invalidate_caches()


def _status(e: BaseException) -> str:
    """The error type and the first line of its message, up to its first sentence's end
    (paths relative to the checkout, or to site-packages)."""
    first = (str(e).strip().splitlines() or [""])[0].replace(f"{ROOT}{os.sep}", "")
    first = re.sub(r"\S*site-packages/", "", first)
    sentence = re.split(r"(?<=[.!?])\s", first, maxsplit=1)[0]
    return f"{type(e).__name__}: {sentence}"



# ---- the steps -------------------------------------------------------------------------------

@dataclass
class Entry:
    """One row: a built step (``call`` runs it once and waits) or the error building it."""

    label: str
    role: str = ""  # DEFAULT, AUTOPAR_DP, JIT_DP or "" (another candidate)
    call: Callable[[], None] | None = None
    predicted: float | None = None  # seconds on the calibrated cluster
    key: tuple | None = None  # Plan.decisions() of an autopar plan
    terms: dict[str, float] = field(default_factory=dict)  # the price's terms, ms
    collectives: int | None = None  # forward collectives of the program (slices aside)
    error: str = ""
    times: list[float] = field(default_factory=list)


def _runner(step: Callable[..., Any], state: list[Any], batch: Callable[[], tuple]
            ) -> Callable[[], None]:
    """One training step per call, state carried over, waiting for every output."""
    import jax

    def call() -> None:
        params, opt, loss = step(*state, *batch())
        jax.block_until_ready((params, opt, loss))
        state[:] = [params, opt]

    call()  # compile
    return call


def _context(pmode: str, load: Path | None = None) -> Any:
    import autopar as ap

    extra = {} if load is None else {"strategy_ckpt_load_file": str(load)}
    return ap.auto_parallel_context(device_num=8, parallel_mode=pmode, gradients_mean=True,
                                    **extra)


def autopar_entry(label: str, role: str, model: Any, pmode: str, *,
                  load: Path | None = None, cluster: Any = None) -> tuple[Entry, Any]:
    """ap.train_step under ``pmode`` (from the strategy file ``load`` when given), and its
    plan; ``cluster`` None: the default path's."""
    import optax

    import autopar as ap

    extra = {} if cluster is None else {"cluster": cluster}
    with _context(pmode, load):
        step = ap.train_step(model.loss, model.params, model.batch, optax.adam(1e-3), **extra)
    state = [step.prepare(model.params), step.init(model.params)]
    call = _runner(step, state, lambda: model.batch)
    comm = step.parallel_graph.comm_counts()
    return Entry(label, role, call, key=step.plan.decisions(),
                 collectives=sum(n for k, n in comm.items() if k != "slice")), step.plan


def jit_entry(model: Any) -> Entry:
    """What a JAX user writes: replicated state, the batch split on dim 0, one jax.jit."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    opt = optax.adam(1e-3)

    @jax.jit
    def step(params: Any, opt_state: Any, *batch: Any) -> tuple[Any, Any, Any]:
        loss, grads = jax.value_and_grad(model.loss)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.device_put(model.params, replicated)
    state = [params, jax.device_put(opt.init(params), replicated)]
    return Entry(JIT_DP, JIT_DP, _runner(step, state, lambda: jax.device_put(model.batch, split)))


def _price(plan: Any, graph: Any, calibrated: Any, path: Path) -> tuple[float, dict]:
    """The plan's cost.total on the calibrated cluster (saved, then loaded there), and its
    terms in ms."""
    import autopar as ap

    ap.save_strategy(plan, graph, path)
    with _context("auto_parallel"):
        cost = ap.load_strategy(path, graph, device_num=8, cluster=calibrated).cost
    return cost.total, {k: getattr(cost, k) * 1e3 for k in TERMS}


def _attempt(label: str, role: str, build: Callable[[], Entry]) -> Entry:
    try:
        return build()
    except Exception as e:  # a finding to report, not to stop on
        return Entry(label, role, error=_status(e))


def build_entries(model: Any, graph: Any, calibrated: Any, tmp: Path) -> list[Entry]:
    """The default path, autopar's data_parallel mode, jax.jit DP and every other candidate
    the search weighs (one entry per distinct plan beyond the first two)."""
    from autopar.planner import ranked_candidates
    from autopar.setup import resolve_setup

    with _context("auto_parallel"):
        setup = resolve_setup(calibrated)
        ranked = ranked_candidates(graph, setup)
        ranked += [(mode, dict(ranked_candidates(graph, setup, mode=mode))[mode])
                   for mode in OTHER_MODES]
    names = {p.decisions(): name for name, p in reversed(ranked)}
    entries: list[Entry] = []

    def mode_entry(role: str, pmode: str) -> Entry:
        entry, plan = autopar_entry(role, role, model, pmode)
        entry.predicted, entry.terms = _price(plan, graph, calibrated, tmp / f"{pmode}.json")
        return entry

    entries.append(_attempt(DEFAULT, DEFAULT, lambda: mode_entry(DEFAULT, "auto_parallel")))
    if entries[0].key in names:
        entries[0].label = f"{DEFAULT}: {names[entries[0].key]}"
    entries.append(_attempt(AUTOPAR_DP, AUTOPAR_DP,
                            lambda: mode_entry(AUTOPAR_DP, "data_parallel")))
    entries.append(_attempt(JIT_DP, JIT_DP, lambda: jit_entry(model)))
    seen = {e.key for e in entries if e.key is not None}
    for k, (name, plan) in enumerate(ranked):
        if plan.decisions() in seen:
            continue
        seen.add(plan.decisions())
        path = tmp / f"candidate{k}.json"

        def candidate(name: str = name, plan: Any = plan, path: Path = path) -> Entry:
            predicted, terms = _price(plan, graph, calibrated, path)
            entry, _ = autopar_entry(name, "", model, "auto_parallel", load=path,
                                     cluster=calibrated)
            entry.predicted, entry.terms = predicted, terms
            return entry

        entries.append(_attempt(name, "", candidate))
    return _merge_failures(entries)


def _merge_failures(entries: list[Entry]) -> list[Entry]:
    """Candidates that failed with the same error: one row naming them all."""
    out: list[Entry] = []
    failed: dict[str, Entry] = {}
    for e in entries:
        if e.role or not e.error:
            out.append(e)
        elif e.error in failed:
            failed[e.error].label += f", {e.label}"
        else:
            failed[e.error] = e
            out.append(e)
    return out


# ---- timing and rows -------------------------------------------------------------------------

def measure(entries: list[Entry], rounds: int) -> None:
    """A warm-up round, then ``rounds`` interleaved rounds in a shuffled order (seed 0);
    each entry's times land in ``entry.times``."""
    built = [e for e in entries if e.call is not None]
    for e in built:
        e.call()
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(built)
        rng.shuffle(order)
        for e in order:
            t0 = time.perf_counter()
            e.call()
            e.times.append(time.perf_counter() - t0)


def paired(a: Entry | None, b: Entry | None) -> float | str:
    """The median over rounds of a's time over b's in the same round."""
    if a is None or b is None or not a.times or not b.times:
        return NONE
    return statistics.median(x / y for x, y in zip(a.times, b.times))


def _role(entries: list[Entry], role: str) -> Entry | None:
    """The measured entry of ``role``, if it was built."""
    return next((e for e in entries if e.role == role and e.times), None)


def _ms(seconds: float | None) -> float | str:
    return NONE if seconds is None else seconds * 1e3


def plan_rows(model: Any, entries: list[Entry]) -> list[dict[str, Any]]:
    dp, jit = _role(entries, AUTOPAR_DP), _role(entries, JIT_DP)
    default = _role(entries, DEFAULT)
    pick = None if default is None else default.key
    return [{"model": model.name, "library": model.library, "plan": e.label,
             "predicted_ms": _ms(e.predicted),
             "measured_ms": _ms(statistics.median(e.times) if e.times else None),
             "/autopar_dp": paired(e, dp), "/jit_dp": paired(e, jit),
             "default_pick": "yes" if pick is not None and e.key == pick else "",
             "status": e.error or "ok", "collectives": e.collectives if e.collectives
             is not None else NONE, **{f"{k}_ms": e.terms.get(k, NONE) for k in TERMS}}
            for e in entries]


def distinct_plans(entries: list[Entry]) -> list[Entry]:
    """The measured autopar entries, one per distinct plan (the first built)."""
    out: dict[tuple, Entry] = {}
    for e in entries:
        if e.key is not None and e.times and e.predicted is not None:
            out.setdefault(e.key, e)
    return list(out.values())


def fidelity(plans: list[Entry]) -> dict[str, Any]:
    """Over distinct plans: Spearman of predicted vs measured and the median
    |predicted / measured - 1|."""
    pred = [e.predicted for e in plans]
    meas = [statistics.median(e.times) for e in plans]
    rho = spearman(pred, meas)
    err = [abs(p / m - 1) for p, m in zip(pred, meas)]
    return {"plans": len(plans), "spearman": NONE if math.isnan(rho) else rho,
            "median_abs_err": statistics.median(err) if err else NONE}


def summary_row(model: Any, entries: list[Entry]) -> dict[str, Any]:
    default, dp = _role(entries, DEFAULT), _role(entries, AUTOPAR_DP)
    failed = [e.label for e in entries if e.error]
    pred = NONE
    if default and dp and default.predicted and dp.predicted:
        pred = default.predicted / dp.predicted
    return {"model": model.name, **fidelity(distinct_plans(entries)),
            "default/autopar_dp": paired(default, dp),
            "default/jit_dp": paired(default, _role(entries, JIT_DP)),
            "pred_default/dp": pred,
            "status": "ok" if not failed else "failed: " + ", ".join(failed)}


# ---- per model, pooled, goals ----------------------------------------------------------------

def run_model(name: str, build: Callable[[], Any], calibrated: Any, rounds: int
              ) -> tuple[list[dict], dict, list[Entry]]:
    """One model: its plan rows, its summary row and its distinct measured autopar plans."""
    import autopar as ap

    model, library = None, NONE
    try:
        model = build()
        library = model.library
        graph = ap.trace(model.loss, model.params, *model.batch)
    except Exception as e:  # the model does not build or trace: one row, nothing measured
        status = ("build: " if model is None else "") + _status(e)
        row = {c: NONE for c in COLUMNS} | {"model": name, "library": library,
                                            "status": status, "default_pick": ""}
        return [row], {c: NONE for c in SUMMARY} | {"model": name, "plans": 0,
                                                    "status": status}, []
    with tempfile.TemporaryDirectory() as tmp:
        entries = build_entries(model, graph, calibrated, Path(tmp))
    measure(entries, rounds)
    return plan_rows(model, entries), summary_row(model, entries), distinct_plans(entries)


def pooled_row(summaries: list[dict], plans: list[Entry]) -> dict[str, Any]:
    """All models together: Spearman and median error over every model's distinct plans,
    the worst ratios."""

    def worst(col: str) -> float | str:
        vals = [s[col] for s in summaries if isinstance(s[col], float)]
        return max(vals) if vals else NONE

    return {"model": "pooled", **fidelity(plans), "default/autopar_dp":
            worst("default/autopar_dp"), "default/jit_dp": worst("default/jit_dp"),
            "pred_default/dp": worst("pred_default/dp"),
            "status": f"{sum(s['status'] == 'ok' for s in summaries)}/{len(summaries)} ok"}


def print_goals(summaries: list[dict], pooled: dict) -> None:
    """Each goal: met or missed, and where."""
    print("\ngoals (printed, not asserted):")
    for col, goal, better in (("default/autopar_dp", GOALS["default/autopar_dp"], "<="),
                              ("default/jit_dp", GOALS["default/jit_dp"], "<="),
                              ("spearman", GOALS["spearman"], ">=")):
        vals = {s["model"]: s[col] for s in summaries if isinstance(s[col], float)}
        miss = {m: v for m, v in vals.items() if (v > goal if better == "<=" else v < goal)}
        print(f"  {col} {better} {goal:.2f} per model: {len(vals) - len(miss)}/{len(vals)} met"
              + ("".join(f"; {m} {v:.2f}" for m, v in miss.items()) if miss else ""))
    for col, goal, better in (("spearman", GOALS["pooled_spearman"], ">="),
                              ("median_abs_err", GOALS["median_abs_err"], "<=")):
        v = pooled[col]
        ok = isinstance(v, float) and (v >= goal if better == ">=" else v <= goal)
        shown = f"{v:.2f}" if isinstance(v, float) else v
        print(f"  pooled {col} {better} {goal:.2f}: {shown} ({'met' if ok else 'missed'})")


def main(quick: bool = False) -> None:
    import autopar as ap
    from benchmarks.corpus import CORPUS

    t0 = time.perf_counter()
    ensure_models_extra()
    calibrated = ap.calibrate(8)  # cached: the cluster the default path prices on
    rounds = 3 if quick else 10
    rows, summaries, measured = [], [], []
    for name, build in CORPUS.items():
        t = time.perf_counter()
        r, s, entries = run_model(name, build, calibrated, rounds)
        rows += r
        summaries.append(s)
        measured += entries
        print(f"  {name}: {s['status']} ({time.perf_counter() - t:.0f} s)", flush=True)
    pooled = pooled_row(summaries, measured)
    meta = {"devices": 8, "rounds": rounds, "quick": quick, "cluster": calibrated.name,
            "optimizer": "optax.adam(1e-3)", "gradients_mean": True,
            "seconds": round(time.perf_counter() - t0),
            "command": COMMAND + (" --quick" if quick else "")}
    write_results("models", rows, COLUMNS, meta=meta)  # --quick: to the scratch directory
    write_results("models_summary", summaries + [pooled], SUMMARY, meta=meta)
    print_goals(summaries, pooled)
    DOC_TABLES.write()
    print(f"(results in {out_dir()}; {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    run_main(main)
