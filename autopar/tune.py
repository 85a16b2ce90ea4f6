"""Measured tuning: ``train_step(..., tune=k)`` runs the ``k`` cheapest priced plans and keeps
the fastest measured (``autopar tune`` on the command line).

The cost model can mis-rank plans on the devices that run them. Every ``auto_parallel``
search prices the hand plans beside its own (:func:`autopar.planner.ranked_candidates`:
``dynamic_programming``, ``data_parallel``, ``megatron tp8``, ...); a tuning takes the first
``k`` distinct ones (by every operator's split counts and every value's layout), builds one
:class:`~autopar.train.TrainStep` per plan (the plan given, nothing searched again), runs
each ``WARMUP`` times (the first call compiles), then times them in ``steps`` interleaved
rounds -- each round runs every candidate once, in an order shuffled with a fixed seed, so
that a noisy machine slows them alike -- and keeps the one of least median step time
(:func:`choose`; on equal times the cheaper priced). The steps train copies of the
parameters and optimizer state like real steps; the caller's arrays are untouched.

The step returned is the fastest candidate's, with ``.tuning``: a :class:`Tuning` record
(print it for the table). With ``strategy_ckpt_save_file`` set, the chosen plan is saved
with the measurements and the machine they were taken on; a ``tune=k`` step under a
``strategy_ckpt_load_file`` holding them loads that plan and measures nothing (its
``.tuning`` shows the saved rows, marked loaded). A file saved without a tuning is refused
under ``tune=k`` (it holds nothing to choose from): drop ``tune=`` to run its plan.

Tuning applies to ``parallel_mode="auto_parallel"``, the mode that chooses plans; under
another mode (one plan: the user's strategies or data parallel) ``tune`` is ignored with an
:class:`~autopar.errors.AutoParallelWarning`, as ``mode=`` is. ``pipeline_stages > 1`` is
refused (the pipelined step searches its stages itself).

>>> rows = (TuningRow("dynamic_programming", 0.03, 0.9), TuningRow("megatron tp4", 0.08, 0.7))
>>> choose(rows)      # the priced-cheaper plan measured slower: the other is kept
1
"""

from __future__ import annotations

import json
import random
import statistics
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import jax
import optax

from autopar import train as _train
from autopar.calibration import host_identity
from autopar.checkpoint import read_strategy_file
from autopar.config import AutoParallelConfig
from autopar.errors import (AutoParallelError, AutoParallelTypeError, AutoParallelWarning,
                            user_stacklevel)
from autopar.graph.tracer import trace
from autopar.multihost import agree_text, is_lead, together
from autopar.planner import ranked_candidates, save_strategies
from autopar.setup import Setup, resolve_setup
from autopar.step_inputs import ParamSplit, warn_gradients_mean
from autopar.strategies.plan import Plan
from autopar.text import Progress, table
from autopar.train import TrainStep

__all__ = ["DEFAULT_STEPS", "MAX_TUNE", "WARMUP", "Tuning", "TuningRow", "choose",
           "distinct_plans", "train_step", "tune_step", "tuned_train_step"]

#: Timed rounds of a tuning (each runs every candidate once), unless given.
DEFAULT_STEPS = 5
#: Untimed calls of each candidate before the rounds (the first compiles).
WARMUP = 2
#: The most candidates a tuning measures (``tune`` / ``k``).
MAX_TUNE = 16
#: The most timed rounds.
MAX_STEPS = 1000
#: The seed of the rounds' shuffled orders.
SEED = 0


@dataclass(frozen=True, slots=True)
class TuningRow:
    """One candidate: its name, predicted and measured (median) step in ms -- None when it
    was not run -- and whether it was kept."""

    name: str
    predicted_ms: float
    measured_ms: float | None
    chosen: bool = False


@dataclass(frozen=True)
class Tuning:
    """What a tuning measured: one row per candidate in priced order (cheapest first), the
    machine and cost model (cluster) of the measurements, the timed rounds, the seconds the
    tuning took (0 when loaded) and ``source``: the strategy file the rows were loaded from
    ("" when measured now). ``str(tuning)`` is the table."""

    rows: tuple[TuningRow, ...]
    machine: str
    cluster: str
    steps: int
    seconds: float = 0.0
    source: str = ""

    @property
    def loaded(self) -> bool:
        return bool(self.source)

    @property
    def chosen(self) -> TuningRow:
        return next(r for r in self.rows if r.chosen)

    def table(self) -> str:
        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x:.4g}"
        rows = [("plan", "predicted ms", "measured ms", "chosen")]
        rows += [(r.name, ms(r.predicted_ms), ms(r.measured_ms), "*" if r.chosen else "")
                 for r in self.rows]
        return table(rows, align="lrrl")

    def __str__(self) -> str:
        how = (f"loaded from {self.source} (measured earlier)" if self.loaded else
               f"measured in {self.seconds:.1f} s")
        return (f"tuning: {len(self.rows)} plan(s), median of {self.steps} interleaved "
                f"round(s) on {self.machine}; priced on {self.cluster}; {how}\n{self.table()}")

    def document(self) -> dict[str, Any]:
        """The strategy file's ``tuning`` field (:class:`autopar.checkpoint.TuningEntry`)."""
        return {"machine": self.machine, "cluster": self.cluster, "steps": self.steps,
                "rows": [{"name": r.name, "predicted_ms": float(r.predicted_ms),
                          "measured_ms": None if r.measured_ms is None else
                          float(r.measured_ms), "chosen": r.chosen} for r in self.rows]}

    @staticmethod
    def from_entry(entry: Any, source: str) -> "Tuning":
        """The record of a file's checked ``tuning`` field, loaded from ``source``."""
        rows = tuple(TuningRow(r.name, r.predicted_ms, r.measured_ms, r.chosen)
                     for r in entry.rows)
        return Tuning(rows, entry.machine, entry.cluster, entry.steps, 0.0, str(source))


def choose(rows: Sequence[TuningRow]) -> int:
    """The index of the plan a tuning keeps: the least measured time; on equal times the
    cheaper priced, then the first. Rows not measured count only when none is (then the
    cheapest priced).

    >>> choose([TuningRow("a", 1.0, 2.0), TuningRow("b", 2.0, 2.0)])   # equal: cheaper priced
    0
    """
    if not rows:
        raise AutoParallelError("rows", [], "a tuning chooses among one row or more")
    return min(range(len(rows)), key=lambda i: (rows[i].measured_ms is None,
                                                rows[i].measured_ms or 0.0,
                                                rows[i].predicted_ms, i))


def distinct_plans(ranked: Sequence[tuple[str, Plan]], k: int) -> list[tuple[str, Plan]]:
    """The first ``k`` plans of ``ranked`` that differ in some operator's split counts or
    some value's layout (the hand plan a search found itself runs once, under the first
    name it is ranked with)."""
    seen: set[Any] = set()
    out: list[tuple[str, Plan]] = []
    for name, plan in ranked:
        key = plan.decisions()
        if key not in seen and len(out) < k:
            seen.add(key)
            out.append((name, plan))
    return out


def measure_rounds(runners: Sequence[Callable[[], Any]], *, steps: int, seed: int = SEED,
                   clock: Callable[[], float] = time.perf_counter,
                   advance: Callable[[str], None] = lambda note: None) -> list[float]:
    """The median seconds of each runner over ``steps`` rounds; a round runs every runner
    once, in an order shuffled by a generator seeded ``seed`` (two ``clock()`` calls per
    run)."""
    order = list(range(len(runners)))
    rng = random.Random(seed)
    times: list[list[float]] = [[] for _ in runners]
    for r in range(steps):
        rng.shuffle(order)
        for i in order:
            t0 = clock()
            runners[i]()
            times[i].append(clock() - t0)
        advance(f"round {r + 1}/{steps}")
    return [statistics.median(t) for t in times]


def _runner(step: TrainStep, params: Any, batch: tuple[Any, ...]) -> Callable[[], None]:
    """One training step of ``step`` per call, on its own copy of the state (the caller's
    parameters placed on the step's layouts, a fresh optimizer state), waited for."""
    state = [step.prepare(params), step.init(params)]

    def run() -> None:
        new, opt, loss = step(state[0], state[1], *batch)
        jax.block_until_ready((new, opt, loss))
        state[:] = [new, opt]
    return run


def tune_step(loss_fn: Callable[..., Any], params: Any, batch: tuple[Any, ...],
              optimizer: optax.GradientTransformation, *, setup: Setup, k: int,
              steps: int = DEFAULT_STEPS, progress: bool = True,
              clock: Callable[[], float] = time.perf_counter, **options: Any) -> TrainStep:
    """The tuning itself, on the setup its entry point resolved (nothing here reads a
    store): trace the loss at the step's micro-batch, rank the candidates
    (:func:`autopar.planner.ranked_candidates`), build the first ``k`` distinct, time them
    (:func:`measure_rounds`), keep the fastest (:func:`choose`); its step comes back with
    ``.tuning`` (its entry point saves ``strategy_ckpt_save_file``, if set, with the
    measurements: :func:`autopar.train.step_saves`).
    ``options``: the other :class:`~autopar.train.TrainStep` options (``mode``, ``fixed``,
    ``backend``, ``mesh``, ``sync_method``, ``fused_kernels``)."""
    start = time.perf_counter()
    mode, fixed = options.pop("mode", None), options.pop("fixed", None)
    with together():  # (under jax.distributed: process 0's cluster and measurements)
        clus = setup.cluster
        micro = _train.micro_batch(batch, setup.config.grad_accumulation_step)
        keys_in = options.get("backend", "shard_map") != "pmap"
        graph = trace(*ParamSplit(params, keys_in).traced(loss_fn, params, micro), *micro)
        cands = distinct_plans(ranked_candidates(
            graph, setup, mode=mode, fixed=fixed, optimizer=optimizer,
            micro_batches=setup.config.grad_accumulation_step), k)
        with Progress("tune", len(cands) + steps * (len(cands) > 1),
                      quiet=not (progress and is_lead())) as bar:
            built, runners = [], []
            for name, plan in cands:
                step = TrainStep(loss_fn, params, batch, optimizer, setup=setup, mode=None,
                                 fixed=None, plan=plan, **options)
                runners.append(_runner(step, params, batch))
                for _ in range(WARMUP if len(cands) > 1 else 0):
                    runners[-1]()
                built.append(step)
                bar.advance(f"built {name}")
            medians: list[Any] = [None]
            if len(cands) > 1:
                medians = measure_rounds(runners, steps=steps, clock=clock, advance=bar.advance)
                medians = json.loads(agree_text(json.dumps(medians)))
    rows = [TuningRow(name, plan.cost.total * 1e3, None if m is None else m * 1e3)
            for (name, plan), m in zip(cands, medians)]
    best = choose(rows)
    rows[best] = replace(rows[best], chosen=True)
    step = built[best]
    step.tuning = Tuning(tuple(rows), _machine(step), clus.name, steps,
                         time.perf_counter() - start)
    step.plan = step.function.plan = step.plan.with_notes(
        f"tuning: kept {rows[best].name}, the fastest measured of {len(rows)} plan(s) (.tuning)")
    return step


def _machine(step: TrainStep) -> str:
    """The machine a step's measurements were taken on: its devices and this host."""
    devices = list(step.mesh.devices.flat)
    return (f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform}), "
            f"{jax.process_count()} process(es), host {host_identity()}")


def check_tune(value: Any, key: str = "tune", low: int = 0) -> int:
    """``tune`` (None: 0) or ``k``: an int in ``[low, MAX_TUNE]``."""
    if value is None and key == "tune":
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise AutoParallelTypeError(key, value, f"the number of plans to measure, an int in "
                                    f"[{low}, {MAX_TUNE}]" + (" (or None)" if key == "tune"
                                                             else ""))
    if not low <= value <= MAX_TUNE:
        raise AutoParallelError(key, value, f"must be in [{low}, {MAX_TUNE}]: the number of "
                                "plans to measure" + ("; 0 and 1 (or None) measure nothing"
                                                      if key == "tune" else ""))
    return value


def _check_steps(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise AutoParallelTypeError("steps", steps, f"the timed rounds, an int in "
                                    f"[1, {MAX_STEPS}]")
    if not 1 <= steps <= MAX_STEPS:
        raise AutoParallelError("steps", steps, f"must be in [1, {MAX_STEPS}] (timed rounds)")
    return steps


def tuned_train_step(loss_fn: Callable[..., Any], params: Any, batch: Any,
                     optimizer: optax.GradientTransformation | None = None, *, k: int,
                     steps: int = DEFAULT_STEPS, progress: bool = True,
                     clock: Callable[[], float] = time.perf_counter,
                     **options: Any) -> TrainStep:
    """The tuned training step under the current context (the entry point of
    ``train_step(..., tune=k)`` and ``autopar tune``; see the module docstring): ``k`` in
    ``[2, MAX_TUNE]`` candidates, ``steps`` timed rounds, ``progress``: a bar on stderr,
    ``clock``: the timer of the rounds. ``options``: :func:`autopar.train.train_step`'s
    keywords (``mode``, ``fixed``, ``cluster``, ``backend``, ``mesh``, ``sync_method``,
    ``fused_kernels``, ``has_aux``)."""
    k, steps = check_tune(k, "k", 2), _check_steps(steps)
    if not isinstance(progress, bool):
        raise AutoParallelTypeError("progress", progress, "must be a bool")
    if not callable(clock):
        raise AutoParallelTypeError("clock", clock, "a function returning seconds")
    defaults = dict(mode=None, fixed=None, cluster=None, backend="shard_map", mesh=None,
                    sync_method="tuple", fused_kernels="auto", has_aux=False)
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise AutoParallelTypeError(unknown[0], options[unknown[0]], "not an option of "
                                    f"train_step (its options: {sorted(defaults)})")
    options = {**defaults, **options}
    batch, optimizer = _train.check_step_arguments(
        loss_fn, params, batch, optimizer, backend=options["backend"],
        sync_method=options["sync_method"], fused_kernels=options["fused_kernels"],
        has_aux=options["has_aux"])
    setup = resolve_setup(options.pop("cluster"))  # the stores, read once
    if not _tunes(setup.config, k):
        step = _train.build_train_step(setup, loss_fn, params, batch, optimizer, **options)
        save_strategies(_train.step_saves(step, setup))  # build; then save
    elif setup.config.strategy_ckpt_load_file:
        return _loaded(setup, k, loss_fn, params, batch, optimizer, options)
    else:
        step = tune_step(loss_fn, params, batch, optimizer, setup=setup, k=k, steps=steps,
                         progress=progress, clock=clock, **options)
        save_strategies(_train.step_saves(step, setup, tuning=step.tuning.document()))
    warn_gradients_mean(step.data_parallel_degree, "gradients_mean" in setup.explicit)
    return step


def _tunes(cfg: AutoParallelConfig, k: int) -> bool:
    """Whether the context lets a tuning choose: refused under pipeline_stages > 1 and
    auto_pipeline, ignored
    (warned) under every parallel mode but auto_parallel."""
    if cfg.auto_pipeline:
        raise AutoParallelError("tune", k, "auto_pipeline=True: the configuration search "
                                "chooses stages and micro-batches by their price, and a "
                                "tuning measures one-stage plans only",
                                "Drop tune= or set auto_pipeline=False")
    if cfg.pipeline_stages > 1:
        raise AutoParallelError("tune", k, f"pipeline_stages={cfg.pipeline_stages}: a tuning "
                                "measures one-stage plans; the pipelined step searches its "
                                "stages itself", "Drop tune= or set pipeline_stages=1")
    if cfg.parallel_mode != "auto_parallel":
        warnings.warn(f"tune={k} is only used by auto_parallel: parallel_mode="
                      f"{cfg.parallel_mode!r} runs one plan (nothing to choose); the step is "
                      "built without measuring", AutoParallelWarning,
                      stacklevel=user_stacklevel())
        return False
    return True


def _loaded(setup: Setup, k: int, loss_fn: Callable[..., Any], params: Any,
            batch: tuple[Any, ...], optimizer: optax.GradientTransformation,
            options: Mapping[str, Any]) -> TrainStep:
    """The step of ``strategy_ckpt_load_file``'s plan with the file's measurements as its
    ``.tuning`` (nothing measured); refused when the file holds none."""
    cfg = setup.config
    path = cfg.strategy_ckpt_load_file
    entry = read_strategy_file(path).tuning
    if entry is None:
        raise AutoParallelError("tune", k, f"strategy_ckpt_load_file {path!r} holds a plan "
                                "but no tuning measurements (it was saved without tune=), so "
                                "a tuned step has nothing to choose from without measuring",
                                "Drop tune= to run the file's plan, or drop "
                                "strategy_ckpt_load_file to measure (with "
                                "strategy_ckpt_save_file the measurements are kept)")
    step = _train.build_train_step(setup, loss_fn, params, batch, optimizer,
                                   **options)  # the file's plan
    warn_gradients_mean(step.data_parallel_degree, "gradients_mean" in setup.explicit)
    step.tuning = Tuning.from_entry(entry, path)
    # (saved again as loaded: the measurements kept)
    save_strategies(_train.step_saves(step, setup, tuning=step.tuning.document()))
    return step


def train_step(loss_fn: Callable[..., Any], params: Any, batch: Any,
               optimizer: optax.GradientTransformation | None = None, *,
               tune: int | None = None, mode: str | None = None,
               fixed: Mapping[str, Any] | None = None, cluster: Any = None,
               backend: str = "shard_map", mesh: Any = None, sync_method: str = "tuple",
               fused_kernels: Any = "auto", has_aux: bool = False) -> TrainStep:
    """:func:`autopar.train.train_step` (``autopar.train_step``), plus ``tune``: None, 0 or 1
    build the step as it is; ``k >= 2`` measures the ``k`` cheapest priced plans for a few
    interleaved steps and keeps the fastest (:func:`tuned_train_step`, with
    :data:`DEFAULT_STEPS` rounds and a progress bar on stderr; ``.tuning`` shows the table).
    The other arguments (``has_aux``, what is trained and what carried, the
    ``gradients_mean`` warning) are :func:`autopar.train.train_step`'s."""
    k = check_tune(tune)
    options = dict(mode=mode, fixed=fixed, cluster=cluster, backend=backend, mesh=mesh,
                   sync_method=sync_method, fused_kernels=fused_kernels, has_aux=has_aux)
    if k < 2:
        return _train.train_step(loss_fn, params, batch, optimizer, **options)
    return tuned_train_step(loss_fn, params, batch, optimizer, k=k, **options)
