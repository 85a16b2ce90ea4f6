"""Search the training configuration with the layouts: pipeline stages, micro-batches, schedule.

MindSpore's ``set_auto_parallel_context(auto_pipeline=True)`` leaves the number of pipeline
stages to the search: at most ``pipeline_stages`` where it is set, any divisor of
``device_num`` otherwise. :func:`search_configuration` weighs, for every pipeline degree ``p``
and micro-batch count ``m`` (a divisor of the batch, at least ``p``):

- the loss traced at micro-batch size ``B / m``, cut into ``p`` stages and each stage
  searched for its ``device_num / p`` devices with the per-step objective, as the pipelined
  step plans them (:func:`autopar.pipeline.plan.search_stages`); with ``p = 1`` that is one
  plan, run ``m`` times a step by gradient accumulation (``grad_accumulation_step = m``);
- every schedule (``gpipe`` and ``1f1b``; only the one ``pipeline_config`` names where the
  user set it), priced by the pipeline simulator
  (:func:`autopar.pipeline.simulation.pipeline_trace`: the schedule in lockstep, the
  gradient sync and the optimizer update once a step, the forward recomputed in backward
  where ``p > 1``, as the pipelined step runs) -- one rule for every configuration;
- the memory per device: the largest stage plan's peak (:class:`~autopar.strategies.memory.
  StepMemory`, one micro-batch's activations: the pipelined step recomputes the rest) plus
  the stage's boundary stash, the ``act_slots + 1`` activation and ``grad_slots + 1``
  gradient buffers of the schedule (:class:`~autopar.pipeline.schedules.Schedule`), each
  the largest boundary's bytes per device, as the pipelined step allocates them.

Every pair (:func:`stage_counts` x :func:`micro_batch_counts`: micro-batches of a
power-of-two size, the sizes training recipes use) is weighed unless it cannot win or fit:
a pair whose memory floor is over the budget is not searched, and the others go cheapest
lower bound first, a pair whose step bound is above the best fitting step found so far not
searched (:meth:`_Weigher.bound`: both bounds sound, so the answer is the sweep's; the step
is not unimodal in ``m``, since a micro-batch too small to split over a stage's devices gets
other layouts). Where the caller asks (the user left ``enable_parallel_optimizer`` unset),
the fastest pairs are weighed again with the parallel optimizer (:func:`_sharded_tries`);
where the user left ``recompute`` unset, the one-stage counts that do not fit are weighed
again with selective, then full recomputation (:func:`_recompute_tries`: those whose
memory floor is over the budget without it and under with full recomputation too; a
pipelined step recomputes each stage already).
The fastest configuration within the cluster's ``memory_bytes`` wins; ties go to fewer
stages, then fewer micro-batches, then the schedule's name.
:class:`ConfigurationSearch` holds the winner and every configuration weighed, with what
each lost on (:meth:`ConfigurationSearch.table`); docs/design/0028 records the choices.

>>> c = Configuration(stages=2, micro_batches=4, schedule="gpipe", step_seconds=0.5,
...                   memory_bytes=1.0, budget_bytes=2.0, bubble=0.2, plans=())
>>> c.fits, c.context()
(True, {'pipeline_stages': 2, 'grad_accumulation_step': 1, 'pipeline_config': \
{'pipeline_scheduler': 'gpipe'}})
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from autopar.errors import AutoParallelError, AutoParallelWarning, MemoryBudgetError
from autopar.graph.ir import Graph
from autopar.graph.loops import loop_nodes
from autopar.graph.tracer import trace, traced_dtype
from autopar.limits import MAX_MICRO_BATCHES
from autopar.pipeline.buffers import check_elementwise_optimizer
from autopar.pipeline.plan import search_stages
from autopar.pipeline.schedules import SCHEDULES, schedule as build_schedule
from autopar.pipeline.simulation import (
    PipelineTrace,
    boundary_stash,
    pipeline_trace,
    simulate_schedule,
)
from autopar.resolve import pipeline_schedule
from autopar.setup import Setup, resolve_setup
from autopar.step_inputs import is_prng_key, step_arguments
from autopar.strategies.cost import BACKWARD_FACTOR, CostModel
from autopar.strategies.memory import Residuals, size
from autopar.strategies.modes import PIPELINE_MODES
from autopar.strategies.plan import Plan
from autopar.strategies.precision import fp32_sync_active
from autopar.strategies.problem import fused_values, operator_floor, requires_grad
from autopar.strategies.recompute import RECOMPUTE, with_recompute
from autopar.strategies.stages import partition_stages, send_time
from autopar.text import table

__all__ = ["Configuration", "ConfigurationSearch", "configured", "micro_batch_counts",
           "micro_graphs", "price_configuration", "search_configuration", "stage_counts",
           "weigh_configurations"]


@dataclass(frozen=True)
class Configuration:
    """One configuration weighed: ``stages`` x ``micro_batches`` under ``schedule``
    (``stages == 1``: ``micro_batches`` accumulated gradients), its predicted step, the
    memory per device of its largest stage against the budget, the bubble, the stage plans;
    ``failed``: why it has no plan (the search's error), else empty."""

    stages: int
    micro_batches: int
    schedule: str
    step_seconds: float
    memory_bytes: float
    budget_bytes: float
    bubble: float
    plans: tuple[Plan, ...]
    parts: Mapping[str, float] = field(default_factory=dict)
    failed: str = ""
    parallel_optimizer: bool = False
    recompute: str = "none"

    @property
    def fits(self) -> bool:
        return not self.failed and self.memory_bytes <= self.budget_bytes

    @property
    def grad_accumulation_step(self) -> int:
        return self.micro_batches if self.stages == 1 else 1

    def context(self) -> dict[str, Any]:
        """The context keys that build this configuration's step."""
        keys: dict[str, Any] = {"pipeline_stages": self.stages,
                                "grad_accumulation_step": self.grad_accumulation_step}
        if self.stages > 1:
            keys["pipeline_config"] = {"pipeline_scheduler": self.schedule}
        if self.parallel_optimizer:
            keys["enable_parallel_optimizer"] = True
        if self.recompute != "none":
            keys["recompute"] = self.recompute
        return keys

    def layout(self) -> str:
        """How the first stage plan uses its devices: ``DP d x model k``, ``d`` the split of
        the batch rows (its first data input's dim 0) and ``k`` the rest (tensor or other
        model parallelism); "-" without plans."""
        if not self.plans:
            return "-"
        plan = self.plans[0]
        data = [v for v in plan.inputs if v not in plan.parameters and v in plan.layouts]
        dp = plan.layouts[data[0]].split_counts(plan.mesh)[0] if data else 1
        return f"DP {dp} x model {plan.mesh.device_num // dp}"

    def lost_on(self, best: "Configuration") -> str:
        """What this configuration lost on against ``best``: its failure, the memory
        budget, or the part of the step (``work``, ``bubble``, ``sync and update``) that
        grew the most."""
        if self.failed:
            return self.failed
        if not self.fits:
            return f"memory {size(self.memory_bytes)} > {size(self.budget_bytes)}"
        if self is best:
            return "-"
        return max(self.parts, key=lambda k: (self.parts[k] - best.parts.get(k, 0.0), k))


@dataclass(frozen=True)
class ConfigurationSearch:
    """The configuration search's answer: ``best`` (the fastest that fits) and every
    configuration weighed, ``ranked`` (fitting ones fastest first, then by memory, then
    those that failed), with the search's ``seconds``; ``pruned``: the ``(stages,
    micro_batches, lower bound seconds)`` not searched, their bound above the best step."""

    best: Configuration
    ranked: tuple[Configuration, ...]
    seconds: float
    notes: tuple[str, ...] = ()
    pruned: tuple[tuple[int, int, float], ...] = ()

    def table(self, rows: int = 12) -> str:
        """The best configuration and the next ``rows - 1``, one line each."""
        head = ("stages", "micro-batches", "schedule", "par. opt.", "recompute", "stage layout",
                "step ms",
                "x best", "bubble", "memory", "fits", "lost on")
        out = [head]
        for c in self.ranked[:rows]:
            ok = not c.failed
            out.append((str(c.stages), str(c.micro_batches), c.schedule,
                        "yes" if c.parallel_optimizer else "no",
                        "stages" if c.stages > 1 else c.recompute, c.layout(),
                        f"{c.step_seconds * 1e3:.3f}" if ok else "-",
                        f"{c.step_seconds / self.best.step_seconds:.3f}" if ok else "-",
                        f"{c.bubble:.1%}" if ok else "-", size(c.memory_bytes) if ok else "-",
                        "yes" if c.fits else "no", c.lost_on(self.best)))
        return table(out, align="l" * len(head))

    def summary(self) -> str:
        b = self.best
        return (f"configuration: {b.stages} stage(s) x {b.micro_batches} micro-batch(es), "
                f"schedule {b.schedule}: step {b.step_seconds * 1e3:.3f} ms predicted, "
                f"{size(b.memory_bytes)} per device of {size(b.budget_bytes)}; "
                f"{len(self.ranked)} configurations weighed in {self.seconds:.2f} s")

    def __str__(self) -> str:
        return "\n".join([self.summary(), *self.notes, self.table()])


def stage_counts(device_num: int, max_stages: int) -> list[int]:
    """The pipeline degrees weighed: the divisors of ``device_num`` up to ``max_stages``.

    >>> stage_counts(8, 8), stage_counts(12, 4)
    ([1, 2, 4, 8], [1, 2, 3, 4])
    """
    return [p for p in range(1, min(device_num, max_stages) + 1) if device_num % p == 0]


def micro_batch_counts(batch_rows: Sequence[int], stages: int) -> list[int]:
    """The micro-batch counts weighed for ``stages``: those that cut every batch input into
    micro-batches of a power-of-two size ``g / m`` (``g`` the inputs' common rows), at least
    ``stages``, at most ``MAX_MICRO_BATCHES``.

    >>> micro_batch_counts([12], 1), micro_batch_counts([16, 8], 2), micro_batch_counts([1536], 16)
    ([3, 6, 12], [2, 4, 8], [24, 48, 96, 192, 384, 768, 1536])
    """
    g = math.gcd(*batch_rows) if batch_rows else 1
    return [g // s for s in sorted((1 << k for k in range(g.bit_length())), reverse=True)
            if g % s == 0 and stages <= g // s <= MAX_MICRO_BATCHES]


def _parts(trace: PipelineTrace) -> dict[str, float]:
    """The step in three parts: the stages' work, the bubble, the sync and update after."""
    span = trace.makespan
    return {"work": span * (1.0 - trace.bubble), "bubble": span * trace.bubble,
            "sync and update": trace.step_time - span}


class _Weigher:
    """The configurations of one search, weighed one (p, m) at a time."""

    def __init__(self, graph_at: Callable[[int], Graph], setup: Setup, mode: str | None,
                 schedules: Sequence[str], fixed: Mapping[str, Any] | None,
                 optimizer: Any = None) -> None:
        self.graph_at, self.mode, self.schedules = graph_at, mode, tuple(schedules)
        self.fixed, self.optimizer = fixed, optimizer
        cfg = setup.config
        self.n = cfg.device_num
        # candidates read and write no strategy file; the step built from the winner does
        self.setup = setup.with_config(strategy_ckpt_load_file="",
                                       strategy_ckpt_save_file="", grad_accumulation_step=1)
        self.fp32 = fp32_sync_active(cfg.gradient_fp32_sync, cfg.parallel_mode)
        self.budget = float(setup.cluster.memory_bytes)
        self.parallel_optimizer = bool(cfg.enable_parallel_optimizer)
        self.recompute = cfg.recompute

    def under(self, **keys: Any) -> "_Weigher":
        """This weigher with the context ``keys`` set (``recompute``, the parallel
        optimizer)."""
        return _Weigher(self.graph_at, self.setup.with_config(**keys), self.mode,
                        self.schedules, self.fixed, self.optimizer)

    def graph(self, p: int, m: int) -> Graph:
        """The loss at ``m`` micro-batches, with this weigher's recomputation on one stage
        (a pipelined step recomputes each stage whatever the key says)."""
        graph = self.graph_at(m)
        return with_recompute(graph, self.recompute) if p == 1 else graph

    def bound(self, p: int, m: int) -> "tuple[float, float] | Configuration":
        """Lower bounds of ``p`` stages x ``m`` micro-batches under any schedule and any
        stage layouts, from the stage cut alone: ``(step seconds, memory bytes per
        device)``, or the failed configuration when the graph cannot be cut into ``p``
        stages; ``(0, 0)`` for a graph with loop nodes (one stage only).

        The step by the simulator's own rules (:func:`~autopar.pipeline.simulation.
        pipeline_trace`, monotone in each): every operator at its floor on the stage's
        devices (:func:`~autopar.strategies.problem.operator_floor`), backward
        ``BACKWARD_FACTOR`` (+ 1 recomputed) times forward, the boundary sends, the
        optimizer update of every parameter split over the stage's devices; no activation
        communication, no gradient sync. The memory: the largest stage's parameters and
        the activations its backward reads under any plan
        (:meth:`~autopar.strategies.memory.Residuals.stored_anyway`), all split over its
        devices, plus the least boundary stash of the schedules."""
        graph = self.graph(p, m)
        if loop_nodes(graph):
            return 0.0, 0.0
        clus = self.setup.cluster
        try:
            part = partition_stages(graph, p, device_num=self.n, cluster=clus, micro_batches=m)
        except AutoParallelError as e:
            return Configuration(p, m, "-", math.inf, math.inf, self.budget, 1.0, (),
                                 failed=str(e).splitlines()[0])
        cm, d, fused = CostModel(clus), self.n // p, fused_values(graph)
        fwd = [sum(operator_floor(cm, graph, graph.node(name), d, fused) for name in names)
               for names in part.stage_nodes]
        bwd = [(BACKWARD_FACTOR + (1.0 if p > 1 else 0.0)) * t for t in fwd]
        sends = [send_time(b, cm, d) for b in part.crossing_bytes]
        grad = requires_grad(graph)
        params = [dict.fromkeys(v for name in names for v in graph.node(name).inputs
                                if graph.values[v].kind == "param") for names in part.stage_nodes]
        update = max(sum(cm.update_time(graph.spec(v).nbytes / d) for v in mine
                         if grad.get(v, False)) for mine in params)
        names = self.schedules if p > 1 else ("gpipe",)
        seconds = clus.step_overhead + update + min(simulate_schedule(
            fwd, bwd, micro_batches=m, schedule=name, sends=sends).makespan for name in names)
        res = Residuals(graph, grad, fused)
        memory = max(sum(graph.spec(v).nbytes for v in [*mine, *res.stored_anyway(nodes)])
                     for mine, nodes in zip(params, part.stage_nodes)) / d + min(
            boundary_stash(part, build_schedule(name, p, m), d) for name in names)
        return seconds, memory

    def weigh(self, p: int, m: int) -> list[Configuration]:
        """Every schedule of ``p`` stages x ``m`` micro-batches (one failed configuration
        when the stages cannot be planned: its reason)."""
        graph = self.graph(p, m)
        try:
            with warnings.catch_warnings():  # a candidate's slow fit: the table says it
                warnings.simplefilter("ignore", AutoParallelWarning)
                _, _, plans = search_stages(graph, p, setup=self.setup, micro_batches=m,
                                            boundaries=None, mode=self.mode,
                                            fixed=self.fixed, advise=False,
                                            optimizer=self.optimizer)
        except AutoParallelError as e:  # (MemoryBudgetError included): a finding, not a stop
            return [Configuration(p, m, "-", math.inf, math.inf, self.budget, 1.0, (),
                                  failed=str(e).splitlines()[0],
                                  parallel_optimizer=self.parallel_optimizer,
                                  recompute=self.recompute if p == 1 else "none")]
        out = []
        for name in (self.schedules if p > 1 else ("gpipe",)):  # (one stage: no schedule)
            trace = pipeline_trace(graph, p, device_num=self.n, cluster=self.setup.cluster,
                                   fp32=self.fp32, micro_batches=m, schedule=name,
                                   plans=list(plans), recompute=p > 1)
            # (its memory: the largest stage plan's peak plus the schedule's stash)
            out.append(Configuration(p, m, name, trace.step_time, float(trace.memory_bytes),
                                     self.budget, trace.bubble, plans, _parts(trace),
                                     parallel_optimizer=self.parallel_optimizer,
                                     recompute=self.recompute if p == 1 else "none"))
        return out


def _ranked(found: list[Configuration]) -> tuple[Configuration, ...]:
    def key(c: Configuration) -> tuple:
        return (0 if c.fits else 1 if not c.failed else 2,
                c.step_seconds if c.fits else c.memory_bytes, c.stages, c.micro_batches,
                c.schedule, RECOMPUTE.index(c.recompute), c.parallel_optimizer)
    return tuple(sorted(found, key=key))


#: what a configuration whose memory floor is over the budget failed on (its bytes follow)
FLOOR = "memory: at least"

#: the fastest configurations (distinct stages and micro-batches) the configuration search
#: weighs again under the parallel optimizer
SHARDED_TRIES = 3


def _sharded_tries(found: Sequence[Configuration], weigher: _Weigher) -> list[Configuration]:
    """The parallel optimizer tried on the :data:`SHARDED_TRIES` fastest stage and
    micro-batch counts found, or, when none fits the memory, on every count searched (it
    stores the parameters and their optimizer state split over each data-parallel group:
    the same gradient bytes sent, a smaller update and less memory), each with the
    recomputation it was weighed with."""
    fitting = sorted((c for c in found if c.fits), key=lambda c: (c.step_seconds, c.stages,
                                                                  c.micro_batches))
    pool = fitting or [c for c in found if c.plans or c.failed.startswith("memory:")
                       and math.isinf(c.memory_bytes)]
    tries = list(dict.fromkeys((c.stages, c.micro_batches, c.recompute) for c in pool))
    return [c for p, m, kind in tries[:SHARDED_TRIES if fitting else None]
            for c in weigher.under(enable_parallel_optimizer=True, recompute=kind).weigh(p, m)]


#: the one-stage micro-batch counts (least step bound first) the configuration search weighs
#: again with recomputation, where they do not fit without
RECOMPUTE_TRIES = 3


def _recompute_tries(found: Sequence[Configuration], weigher: _Weigher,
                     bounds: Mapping[tuple[int, int], float]) -> list[Configuration]:
    """Selective recomputation, then full, tried on the one-stage micro-batch counts that
    do not fit the memory without it (at most :data:`RECOMPUTE_TRIES`, least step bound
    first): it lowers what backward keeps and runs forward again."""
    def short(c: Configuration) -> bool:
        return c.stages == 1 and not c.fits and (bool(c.plans) or c.failed.startswith("memory"))

    todo = sorted({c.micro_batches for c in found if short(c) and (1, c.micro_batches) in
                   bounds}, key=lambda m: (bounds[1, m], m))[:RECOMPUTE_TRIES]
    out: list[Configuration] = []
    for kind in RECOMPUTE[1:]:
        confs = [c for m in todo for c in weigher.under(recompute=kind).weigh(1, m)]
        out += confs
        todo = [c.micro_batches for c in confs if short(c)]
    return out


def weigh_configurations(graph_at: Callable[[int], Graph], batch_rows: Sequence[int], *,
                         setup: Setup, max_stages: int | None = None,
                         schedules: Sequence[str] | None = None, mode: str | None = None,
                         fixed: Mapping[str, Any] | None = None,
                         notes: Sequence[str] = (), parallel_optimizer: bool = False,
                         optimizer: Any = None, recompute: bool = False
                         ) -> ConfigurationSearch:
    """Search stages, micro-batches and schedule with the layouts (see the module
    docstring). ``graph_at(m)``: the loss traced at ``1/m`` of the batch, whose inputs
    have ``batch_rows`` rows; ``max_stages``: at most this many stages (default
    ``device_num``; 1: no pipeline); ``schedules``: those weighed (default both); ``fixed``:
    strategies by node name; ``notes``: what the answer says beside it;
    ``parallel_optimizer``: also try ``enable_parallel_optimizer=True`` (where the setup
    leaves it off) on the fastest configurations (:func:`_sharded_tries`); ``optimizer``:
    the step's, its state priced per parameter (None: the cluster's factor);
    ``recompute``: also try recomputation on one stage where it does not fit without
    (:func:`_recompute_tries`; the setup's ``recompute`` is ``"none"``). Raises
    :class:`MemoryBudgetError` when no configuration fits, naming the smallest found."""
    t0 = time.perf_counter()
    n = setup.config.device_num
    names = tuple(schedules or SCHEDULES)
    weigher = _Weigher(graph_at, setup, mode, names, fixed, optimizer)
    full = weigher.under(recompute="full") if recompute else None
    found: list[Configuration] = []
    bounds, later = {}, {}  # (later: one stage, fits only with recomputation)
    for p in stage_counts(n, max_stages or n):
        for m in micro_batch_counts(batch_rows, p):
            low = weigher.bound(p, m)
            if isinstance(low, Configuration):
                found.append(low)  # too few units for p stages, whatever m
                break
            if low[1] > weigher.budget:  # (the memory floor alone is over the budget)
                found.append(Configuration(p, m, "-", math.inf, low[1], weigher.budget, 1.0,
                                           (), failed=f"{FLOOR} {size(low[1])}"))
                if full is not None and p == 1 and full.bound(p, m)[1] <= weigher.budget:
                    later[p, m] = low[0]
            else:
                bounds[p, m] = low[0]
    best, pruned = math.inf, []
    for (p, m), low in sorted(bounds.items(), key=lambda kv: (kv[1], kv[0])):
        if low > best:  # (its lower bound already prices it out; a tie may still win)
            pruned.append((p, m, low))
            continue
        confs = weigher.weigh(p, m)
        found += confs
        best = min([best] + [c.step_seconds for c in confs if c.fits])
    if recompute:
        found += _recompute_tries(found, weigher, {**bounds, **later})
    if parallel_optimizer and not weigher.parallel_optimizer:
        found += _sharded_tries(found, weigher)
    over = sum(1 for c in found if c.failed.startswith(FLOOR))
    if over:
        notes = (*notes, f"{over} stage and micro-batch counts not searched: their memory "
                 "floor alone is over the budget")
    if pruned:
        notes = (*notes, f"{len(pruned)} of {len(bounds)} stage and micro-batch counts not "
                 "searched: their lower bound prices them above the best")
    ranked = _ranked(found)
    result = ConfigurationSearch(ranked[0], ranked, time.perf_counter() - t0, tuple(notes),
                                 tuple(sorted(pruned)))
    if not ranked[0].fits:
        least = min((c for c in ranked if math.isfinite(c.memory_bytes)), default=None,
                    key=lambda c: c.memory_bytes)
        needed = least.memory_bytes if least is not None else math.inf
        raise MemoryBudgetError(
            f"memory: no configuration (stages x micro-batches x schedule) fits the "
            f"{size(weigher.budget)} per device of {weigher.setup.cluster.name}; the "
            f"smallest needs {size(needed)}\n{result.table()}", needed=needed,
            budget=weigher.budget)
    return result


def price_configuration(graph_at: Callable[[int], Graph], stages: int, micro_batches: int,
                        *, setup: Setup, schedule: str = "gpipe", mode: str | None = None,
                        fixed: Mapping[str, Any] | None = None,
                        optimizer: Any = None) -> Configuration:
    """One configuration priced as :func:`weigh_configurations` prices each: ``stages`` x
    ``micro_batches`` under ``schedule`` (ignored on one stage), every stage searched under
    ``mode`` with ``fixed`` (e.g. a hand layout:
    :func:`~autopar.strategies.baselines.megatron_strategies` under
    ``sharding_propagation``) and ``optimizer``. The failed configuration when it has no
    plan."""
    weigher = _Weigher(graph_at, setup, mode, (schedule,), fixed, optimizer)
    return weigher.weigh(stages, micro_batches)[0]


def micro_graphs(loss_fn: Callable[..., Any], params: Any, batch: tuple[Any, ...]
                 ) -> tuple[Callable[[int], Graph], list[int]]:
    """``(graph_at, batch_rows)`` for :func:`weigh_configurations`: ``graph_at(m)`` traces
    ``loss_fn(params, *micro)``, every batch leaf cut to ``1/m`` of its rows as a shape
    (traced once per ``m``)."""
    leaves, tree = jax.tree_util.tree_flatten(batch)
    for x in leaves:
        if not np.shape(x):
            raise AutoParallelError("batch", "a scalar input", "every batch input is cut "
                                    "into micro-batches along dim 0, and a scalar has no "
                                    "dim 0", "Pass it as a parameter or close over it")
    rows = [int(np.shape(x)[0]) for x in leaves]
    cache: dict[int, Graph] = {}

    def graph_at(m: int) -> Graph:
        if m not in cache:
            micro = [jax.ShapeDtypeStruct((np.shape(x)[0] // m,) + np.shape(x)[1:],
                                          traced_dtype(x)) for x in leaves]
            cache[m] = trace(loss_fn, params, *jax.tree_util.tree_unflatten(tree, micro))
        return cache[m]

    return graph_at, rows


def _why_one_stage(setup: Setup, params: Any, optimizer: Any, graph: Graph) -> list[str]:
    """Why this step cannot be pipelined (each reason a note), or nothing."""
    notes = []
    if setup.config.parallel_mode not in PIPELINE_MODES:
        notes.append(f"one stage only: parallel_mode {setup.config.parallel_mode!r} does not "
                     f"pipeline (one of {list(PIPELINE_MODES)} does)")
    if any(is_prng_key(x) for x in jax.tree_util.tree_leaves(params)):
        notes.append("one stage only: a typed PRNG key in params cannot be packed into a "
                     "pipelined step's buffers")
    if loop_nodes(graph):
        notes.append(f"one stage only: loop node {loop_nodes(graph)[0].name!r} runs as one "
                     "lax.scan and cannot be cut into stages")
    why = _not_elementwise(optimizer)
    if why:
        notes.append(f"one stage only: {why}")
    return notes


def _not_elementwise(optimizer: Any) -> str:
    """Why ``optimizer`` cannot run on packed or sharded buffers (what pipeline stages and
    the parallel optimizer's update need), or "" (None: the default SGD)."""
    if optimizer is None:
        return ""
    try:
        check_elementwise_optimizer(optimizer, 1, (2, 1))
    except AutoParallelError as e:
        return str(e).splitlines()[0]
    return ""


def _search(setup: Setup, loss_fn: Callable[..., Any], params: Any, batch: tuple[Any, ...],
            optimizer: Any, mode: str | None, fixed: Mapping[str, Any] | None
            ) -> ConfigurationSearch:
    """The configuration search under ``setup``'s context (see :func:`search_configuration`)."""
    cfg, explicit = setup.config, setup.explicit
    if cfg.grad_accumulation_step > 1:
        raise AutoParallelError("grad_accumulation_step", cfg.grad_accumulation_step,
                                "the configuration search chooses the micro-batches (and, on "
                                "one stage, the gradient accumulation) itself",
                                "Leave grad_accumulation_step at 1 with auto_pipeline")
    graph_at, rows = micro_graphs(loss_fn, params, batch)
    notes = _why_one_stage(setup, params, optimizer, graph_at(1))
    most = cfg.pipeline_stages if "pipeline_stages" in explicit else cfg.device_num
    names = (pipeline_schedule(cfg),) if "pipeline_config" in explicit else SCHEDULES
    # the parallel optimizer: tried where the user left it unset and the optimizer is
    # elementwise (what a sharded update needs)
    sharded = "enable_parallel_optimizer" not in explicit and not _not_elementwise(optimizer)
    return weigh_configurations(graph_at, rows, setup=setup, max_stages=1 if notes else most,
                                schedules=names, mode=mode, fixed=fixed, notes=notes,
                                parallel_optimizer=sharded, optimizer=optimizer,
                                recompute="recompute" not in explicit)


def search_configuration(loss_fn: Callable[..., Any], params: Any, batch: Any,
                         optimizer: Any = None, *, cluster: Any = None, mode: str | None = None,
                         fixed: Mapping[str, Any] | None = None) -> ConfigurationSearch:
    """Search the pipeline stages, the micro-batches (or, on one stage, the gradient
    accumulation) and the schedule with every stage's layouts for a training step of
    ``loss_fn(params, *batch)`` under the current context (see the module docstring):
    what ``train_step`` does under ``auto_pipeline=True``, without building the step.

    Stages: the divisors of ``device_num`` up to ``pipeline_stages`` where it is set (any
    otherwise); schedules: ``pipeline_config``'s scheduler where it is set, both otherwise.
    One stage only where the step cannot be pipelined (a loop node, a typed PRNG key in
    ``params``, an ``optimizer`` that is not elementwise: the answer's ``notes`` say which).
    ``mode`` / ``fixed`` / ``cluster``: as :func:`autopar.search`. Raises
    :class:`~autopar.errors.MemoryBudgetError` when nothing fits the cluster's memory."""
    batch, optimizer = step_arguments(loss_fn, batch, optimizer, "search_configuration needs a "
                              "callable")
    setup = resolve_setup(cluster)
    return _search(setup, loss_fn, params, batch, optimizer, mode, fixed)


def configured(setup: Setup, loss_fn: Callable[..., Any], params: Any, batch: tuple[Any, ...],
               optimizer: Any, mode: str | None, fixed: Mapping[str, Any] | None
               ) -> tuple[Setup, int | None, ConfigurationSearch]:
    """``train_step`` under ``auto_pipeline=True``: the search's best configuration as the
    setup to build the step with (its context keys set, ``auto_pipeline`` cleared), the
    pipelined step's micro-batches (None on one stage), and the search."""
    found = _search(setup, loss_fn, params, batch, optimizer, mode, fixed)
    best = found.best
    keys = best.context()
    if "pipeline_config" in keys:  # (the config's own record, not a dict)
        keys["pipeline_config"] = setup.config.pipeline_config.model_copy(
            update=keys["pipeline_config"])
    chosen = setup.with_config(auto_pipeline=False, **keys)
    return chosen, (best.micro_batches if best.stages > 1 else None), found
