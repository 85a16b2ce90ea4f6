"""The search: choose a strategy for every operator of a graph, from explicit settings.

``search_plan(graph, mode=..., device_num=..., cluster=..., fixed=..., settings=...)`` is the
planning step below :func:`autopar.search` (:mod:`autopar.planner`, which resolves the context,
loads or searches, then saves). ``settings.parallel_mode`` decides who chooses:

- ``stand_alone``: one device, nothing split.
- ``data_parallel``: every operator splits its batch dimension (traced from dim 0 of the data
  inputs) over all devices; parameters replicated, gradients all-reduced.
- ``semi_auto_parallel`` / ``hybrid_parallel``: the user's strategies (``fixed=`` and
  annotations) are honoured, every other operator is data parallel, as MindSpore does.
- ``auto_parallel``: the search mode's solver (:mod:`autopar.strategies.modes`) chooses,
  honouring fixed strategies.

All modes build the same :class:`~autopar.strategies.problem.Problem` (one cost model), so
their plans compare like for like. A plan over the cluster's memory budget (its step's ordered
peak, :mod:`autopar.strategies.memory`) is re-searched with memory priced into the objective
(the additive approximation, each vertex's memory; ``exact``'s constraint bounds it, tightened
by the peak's overshoot); if none fits, the error says how much is missing.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from autopar.errors import AutoParallelError, AutoParallelWarning, MemoryBudgetError
from autopar.graph.ir import Graph
from autopar.graph.ops import KINDS
from autopar.strategies.cost import Cluster, CostModel
from autopar.strategies.baselines import HAND_PLAN_MARGIN, megatron_degree, megatron_splits
from autopar.graph.loops import loop_body, split_by_loop
from autopar.strategies.edge_pricing import EdgePricer
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.loops import LoopChoices, has_loops
from autopar.strategies.memory import size
from autopar.strategies.modes import SOLVERS, USES_PARAMETER_PLANS, USES_USER_STRATEGIES
from autopar.strategies.plan import Plan
from autopar.strategies.precision import fp32_sync_active
from autopar.gc_pause import paused_gc
from autopar.strategies.problem import BodyInputs, PriceBooks, Problem

__all__ = ["SearchSettings", "data_parallel_splits", "hand_plans", "ranked_plans",
           "search_plan"]

_MEMORY_WEIGHTS = (0.0, 1e-12, 1e-11, 1e-10, 1e-9, 1e-8, 1e-7)
_FOLLOW_ROUNDS = 4


@dataclass(frozen=True)
class SearchSettings:
    """What a plan depends on besides the graph, the devices and the cluster: the context's
    keys the search prices (read once by the entry point: :meth:`from_config`)."""

    parallel_mode: str = "auto_parallel"
    enable_alltoall: bool = False
    dataset_strategy: Any = "data_parallel"
    parallel_optimizer_kb: int | None = None  # the parallel optimizer's threshold, None: off
    fully_use_devices: bool = True
    # MindSpore's algorithm parameter: under auto_parallel every elementwise operator takes
    # the split counts of the value it reads (see _follow_elementwise)
    elementwise_op_strategy_follow: bool = False
    # the parallel optimizer's shard group size (optimizer_weight_shard_size; -1: the whole
    # data-parallel group, and whenever the parallel optimizer is off)
    optimizer_weight_shard_size: int = -1
    # the search's own plan is kept over the cheapest hand plan only when priced cheaper by
    # more than this fraction (the hand_plan_margin algorithm parameter; see _ranked)
    hand_plan_margin: float = HAND_PLAN_MARGIN
    # gradient_fp32_sync as it acts (strategies.precision.fp32_sync_active): a bf16 / fp16
    # gradient's synchronisation sends and holds fp32
    fp32_sync: bool = True
    # per parameter value, optimizer state bytes per parameter byte as optimizer.init keeps
    # them (strategies.precision.optimizer_state); None: the cluster's optimizer_state_factor
    optimizer_state: tuple[tuple[str, float], ...] | None = None
    # the micro-batches one optimizer step runs the traced graph for (grad_accumulation_step
    # x the pipeline's micro-batches): the objective is one micro-batch's, the gradient sync
    # and the optimizer update charged 1/micro_batches of their step's price
    # (Problem.once_per_step); 1: the graph is the whole step
    micro_batches: int = 1

    @classmethod
    def from_config(cls, cfg: Any, *, parallel_mode: str | None = None,
                    fully_use_devices: bool = True,
                    elementwise_op_strategy_follow: bool = False,
                    hand_plan_margin: float = HAND_PLAN_MARGIN,
                    optimizer_state: tuple[tuple[str, float], ...] | None = None,
                    micro_batches: int = 1) -> "SearchSettings":
        """The settings of a (resolved) auto-parallel configuration (and, given by the entry
        point, of the algorithm parameters, the optimizer's state per parameter and the
        micro-batches a step runs the graph for: a training step's grad_accumulation_step,
        times the pipeline's micro-batches for a stage)."""
        pmode = cfg.parallel_mode if parallel_mode is None else parallel_mode
        po = cfg.parallel_optimizer_config
        po_kb = int(po.parallel_optimizer_threshold) if cfg.enable_parallel_optimizer else None
        shard = int(po.optimizer_weight_shard_size) if cfg.enable_parallel_optimizer else -1
        return cls(pmode, cfg.enable_alltoall, cfg.dataset_strategy, po_kb, fully_use_devices,
                   elementwise_op_strategy_follow, optimizer_weight_shard_size=shard,
                   hand_plan_margin=hand_plan_margin,
                   fp32_sync=fp32_sync_active(cfg.gradient_fp32_sync, pmode),
                   optimizer_state=optimizer_state, micro_batches=micro_batches)


def data_parallel_splits(problem_specs: Mapping[str, Any], graph: Graph,
                         device_num: int, mesh: DeviceMesh,
                         batch_of: Mapping[str, int | None] | None = None
                         ) -> dict[str, tuple[int, ...]]:
    """Per operator: split the loop dim carrying the batch (dim 0 of the data inputs; a loop
    body's: ``batch_of``, where its loop holds the batch)."""
    batch: dict[str, int | None] = dict(batch_of) if batch_of is not None else {
        v: (0 if graph.spec(v).rank else None) for v in graph.data_inputs()}
    out: dict[str, tuple[int, ...]] = {}
    for node in graph.nodes:
        spec = problem_specs[node.name]
        it = None
        for v, mp in zip(node.inputs, spec.in_maps):
            b = batch.get(v)
            if b is not None and mp[b] is not None:
                it = mp[b]
                break
        splits = [1] * len(spec.sizes)
        if it is not None and spec.splittable(it):
            limit = dict(spec.divides).get(it)
            for s in sorted((d for d in range(1, device_num + 1) if device_num % d == 0),
                            reverse=True):
                if spec.sizes[it] % s == 0 and (limit is None or limit % s == 0) and \
                        mesh.assign([s]) is not None:
                    splits[it] = s
                    break
        out[node.name] = tuple(splits)
        for v, mp in zip(node.outputs, spec.out_maps):
            batch[v] = mp.index(it) if it is not None and it in mp else None
    return out


def search_plan(graph: Graph, *, mode: str, device_num: int, cluster: Cluster,
                fixed: Mapping[str, Any] | None = None,
                settings: SearchSettings = SearchSettings()) -> Plan:
    """The plan of ``graph`` on ``device_num`` devices priced on ``cluster`` (checked values:
    the entry point validates them): the cheapest of :func:`ranked_plans`."""
    return ranked_plans(graph, mode=mode, device_num=device_num, cluster=cluster, fixed=fixed,
                        settings=settings)[0][1]


def ranked_plans(graph: Graph, *, mode: str, device_num: int, cluster: Cluster,
                 fixed: Mapping[str, Any] | None = None,
                 settings: SearchSettings = SearchSettings()) -> list[tuple[str, Plan]]:
    """The search's own plan and, under ``auto_parallel`` on several devices, the hand plans
    (:func:`hand_plans`), as (name, plan) cheapest first (the search's own first on a tie),
    each within the cluster's memory budget; the first is the plan the search returns, its
    notes naming every price. Memory is priced into the objective, at growing weights,
    until the first fits; if none does, the error says how much is missing."""
    pmode = settings.parallel_mode
    solver = SOLVERS[mode] if pmode == "auto_parallel" else SOLVERS["dynamic_programming"]
    label = mode if pmode == "auto_parallel" else pmode
    mesh, cm = DeviceMesh.for_devices(device_num), CostModel(cluster)
    fixed_map, bodies = split_by_loop(graph, fixed)
    budget = cluster.memory_bytes
    loops = _Loops(solver, budget, label, bodies)
    t0 = time.perf_counter()
    limit = budget  # a memory_constraint solver's bound on the objective's additive memory
    free = None  # the cheapest plan with memory not priced (weight 0)
    for weight in _MEMORY_WEIGHTS:
        with paused_gc():  # no cycles are made: the collections a traced heap owes wait
            problem, picks, follows = _solve(graph, mesh, cm, fixed_map, settings, weight,
                                             solver, limit, loops)
            plan = Plan.from_picks(problem, picks, label, 0.0)
            # what the solver says of its plan (dynamic_programming: a core too large to prove)
            plan = plan.with_notes(*problem.solver_cache(solver.name).get("notes", []))
            del problem  # freed inside the pause: the collector then has nothing of it to walk
            hands = hand_plans(graph, mesh, cm, fixed_map, settings, weight, label, budget,
                               loops) if _weighs_hand_plans(settings, device_num) else []
        ranked = _ranked(label, plan, hands, budget, settings.hand_plan_margin)
        kept, best = ranked[0]
        best = replace(best, search_seconds=time.perf_counter() - t0)
        free = free or best
        if follows:
            best = best.with_notes("elementwise_op_strategy_follow: elementwise operators "
                                   "take the split counts of the value they read")
        if best.cost.memory_bytes <= budget:
            if weight:
                best = best.with_notes(f"memory priced at {weight:g} s/byte to fit the budget")
                _warn_slow_fit(best, free, cluster)
            return [(kept, best), *ranked[1:]]
        if solver.memory_constraint and plan.cost.memory_bytes > budget:
            # its constraint bounds the additive memory (strategies.memory); the step's
            # ordered peak came out above the budget: tighten the bound by the overshoot
            limit -= plan.cost.memory_bytes - budget
    raise MemoryBudgetError(
        f"memory: {size(plan.cost.memory_bytes)} per device: no plan found within the "
        f"{cluster.name} budget of {size(cluster.memory_bytes)} per device",
        needed=plan.cost.memory_bytes, budget=budget)


#: a plan that fits the memory budget only at more than this times the step time of the
#: cheapest plan priced without the budget is warned about, not only noted
SLOW_FIT = 1.5


def _warn_slow_fit(best: Plan, free: Plan | None, cluster: Cluster) -> None:
    """Warn when ``best`` fits the budget only by giving up more than :data:`SLOW_FIT` x the
    step time of ``free``, the cheapest plan with memory unpriced."""
    if free is None or free.cost.total <= 0 or best.cost.total <= SLOW_FIT * free.cost.total:
        return
    warnings.warn(f"memory: the plan fits the {cluster.name} budget of "
                  f"{size(cluster.memory_bytes)} per device only at "
                  f"{best.cost.total / free.cost.total:.2f}x the step time of the cheapest "
                  f"plan ({free.cost.total * 1e3:.3f} ms, "
                  f"{size(free.cost.memory_bytes)} per device); pipeline stages, "
                  "gradient accumulation, recomputation, the parallel optimizer or more "
                  "devices may fit at less", AutoParallelWarning, stacklevel=2)


def _weighs_hand_plans(settings: SearchSettings, device_num: int) -> bool:
    """Whether a search weighs the hand plans: under ``auto_parallel`` on several devices,
    unless ``elementwise_op_strategy_follow`` asks for MindSpore's rule, which they do not
    keep."""
    return settings.parallel_mode == "auto_parallel" and device_num > 1 and \
        not settings.elementwise_op_strategy_follow


def _ranked(label: str, plan: Plan, hands: list[tuple[str, Plan]], memory: float,
            margin: float = 0.0) -> list[tuple[str, Plan]]:
    """The search's plan and the hand plans that fit ``memory``, cheapest first, except that
    the search's own goes before a hand plan only when priced below it by more than
    ``margin`` (a fraction of the hand plan's price; with 0, by more than rounding). The
    first's notes name every price.

    >>> from types import SimpleNamespace as P
    >>> def plan(ms):
    ...     p = P(objective=ms, cost=P(total=ms, memory_bytes=0))
    ...     p.with_notes = lambda *notes: p  # (a Plan: a new plan, the notes added)
    ...     return p
    >>> own, dp = plan(0.9), plan(1.0)
    >>> [n for n, _ in _ranked("search", own, [("data_parallel", dp)], 1e9, 0.15)]
    ['data_parallel', 'search']
    >>> [n for n, _ in _ranked("search", own, [("data_parallel", dp)], 1e9, 0.05)]
    ['search', 'data_parallel']
    """
    fits = [(name, hand) for name, hand in hands if hand.cost.memory_bytes <= memory]
    own_factor = 1.0 / (1.0 - margin)
    ranked = sorted([(label, plan), *fits], key=lambda item: item[1].objective * (
        own_factor if item[1] is plan else 1.0 + 1e-9))
    if hands:
        prices = ", ".join(f"{name} {hand.cost.total * 1e3:.4g} ms" for name, hand in hands)
        kept = ranked[0][0]
        why = f"the search's own is not cheaper by more than {margin:.0%}" \
            if plan.objective < ranked[0][1].objective else "the cheapest"
        ranked[0] = (kept, ranked[0][1].with_notes(
            f"hand plans priced: {prices}; the search's own {plan.cost.total * 1e3:.4g} ms"
            + ("" if ranked[0][1] is plan else f": kept {kept}, {why}")))
    return ranked


def hand_plans(graph: Graph, mesh: DeviceMesh, cm: CostModel, fixed: dict,
               settings: SearchSettings, weight: float, label: str,
               memory: float, loops: "_Loops | None" = None) -> list[tuple[str, Plan]]:
    """The hand plans (:mod:`autopar.strategies.baselines`) priced as the search prices its
    own: ``data_parallel`` (the user's fixed strategies kept, as ``semi_auto_parallel``) and
    Megatron's layout, tensor parallel over a node (its weight matmuls fixed unless the user
    fixed them, the rest propagated). Each is (name, plan). Every operator of the first is
    fixed and the second's matmuls seed it, so both are propagated (no search); a loop's
    body is planned the same way (data parallel; Megatron's matmuls, the rest propagated)."""
    loops = loops or _Loops(SOLVERS["dynamic_programming"], memory, label, {})
    semi = replace(settings, parallel_mode="semi_auto_parallel")
    out = [("data_parallel", _hand_plan(_problem(graph, mesh, cm, fixed, semi, weight,
                                                 lazy=False, loops=loops), label, memory))]
    user = set(fixed) | set(graph.annotations())
    tp = megatron_degree(mesh.device_num, cm.cluster.devices_per_node)
    splits = {k: v for k, v in megatron_splits(graph, mesh, tp).items() if k not in user} \
        if tp > 1 else {}
    if splits or (tp > 1 and has_loops(graph)):
        problem = _problem(graph, mesh, cm, fixed, settings, weight, lazy=False, follow=splits,
                           loops=loops.megatron(tp))
        out.append((f"megatron tp{tp}", _hand_plan(problem, label, memory)))
    return out


def _hand_plan(problem: Problem, label: str, memory: float) -> Plan:
    """The plan of a problem whose operators are fixed (propagated from them; searched
    where the graph has none)."""
    solver = SOLVERS["sharding_propagation" if problem.fixed else "dynamic_programming"]
    return Plan.from_picks(problem, solver.picks(problem, memory), label, 0.0)


def _problem(graph: Graph, mesh: DeviceMesh, cm: CostModel, fixed: dict, settings: SearchSettings,
             weight: float, *, lazy: bool,
             follow: Mapping[str, tuple[int, ...]] | None = None,
             loops: "_Loops | None" = None, body: BodyInputs | None = None) -> Problem:
    """The search problem; under a mode that derives the strategies (every mode but
    auto_parallel, on more than one device) every operator not fixed is data parallel;
    ``follow``: operators' splits fixed by elementwise_op_strategy_follow; ``loops``: how
    loop bodies are searched; ``body``: the problem is a loop body's, its inputs these."""
    pmode = settings.parallel_mode
    derived = pmode != "auto_parallel" and mesh.device_num > 1
    common = dict(enable_alltoall=settings.enable_alltoall,
                  dataset_strategy=settings.dataset_strategy, memory_weight=weight,
                  full_use=settings.fully_use_devices,
                  parallel_optimizer_kb=settings.parallel_optimizer_kb,
                  optimizer_weight_shard_size=settings.optimizer_weight_shard_size,
                  annotations=pmode in USES_USER_STRATEGIES,
                  parameter_plan=pmode in USES_PARAMETER_PLANS, body=body,
                  fp32_sync=settings.fp32_sync,
                  optimizer_state=None if settings.optimizer_state is None else
                  dict(settings.optimizer_state),
                  loops=None if loops is None else loops.planner(settings, weight),
                  edge_pricer=None if loops is None else loops.pricer(mesh, cm, settings),
                  prices=None if loops is None else loops.prices(),
                  micro_batches=settings.micro_batches)
    # (a derived mode only needs this first problem's loop nests and checked fixed strategies,
    # so it is built lazily: no choice lists)
    problem = Problem(graph, mesh, cm, fixed=fixed, fixed_splits=follow, lazy=derived or lazy,
                      **common)
    if not derived:
        return problem
    dp = data_parallel_splits(problem.specs, graph, mesh.device_num, mesh,
                              body.batch if body is not None else None)
    keep = set(problem.fixed) if pmode in USES_USER_STRATEGIES else set()
    return Problem(graph, mesh, cm, fixed={k: v for k, v in fixed.items() if k in keep},
                   fixed_splits={k: v for k, v in dp.items() if k not in keep}, **common)


def _solve(graph: Graph, mesh: DeviceMesh, cm: CostModel, fixed: dict, settings: SearchSettings,
           weight: float, solver: Any, memory: float,
           loops: "_Loops | None" = None) -> tuple[Problem, list[int], bool]:
    """Build and solve the problem; with ``elementwise_op_strategy_follow`` (auto_parallel)
    fix each elementwise operator to the split counts of the value it reads and solve again,
    until the values it reads are made with those split counts (at most
    ``_FOLLOW_ROUNDS`` solves; the last one also fixes the producers, so the rule holds).
    Returns the problem, the picks and whether any operator follows."""
    problem = _problem(graph, mesh, cm, fixed, settings, weight, lazy=solver.lazy_choices,
                       loops=loops)
    seeds = _loop_seeds(problem, solver, loops)
    if seeds:
        problem = _problem(graph, mesh, cm, fixed, settings, weight, lazy=solver.lazy_choices,
                           follow=seeds, loops=loops)
    picks = solver.picks(problem, memory)
    if not settings.elementwise_op_strategy_follow or settings.parallel_mode != "auto_parallel":
        return problem, picks, False
    follow: dict[str, tuple[int, ...]] = {}
    user = frozenset(problem.fixed)
    for rounds_left in range(_FOLLOW_ROUNDS, 0, -1):
        followers, producers = _follow_elementwise(graph, problem, picks, user)
        if followers == follow:
            break
        follow = followers
        fixed_splits = {**producers, **followers} if rounds_left == 1 else followers
        problem = _problem(graph, mesh, cm, fixed, settings, weight, lazy=solver.lazy_choices,
                           follow={**seeds, **fixed_splits}, loops=loops)
        picks = solver.picks(problem, memory)
    return problem, picks, bool(follow)


def _loop_seeds(problem: Problem, solver: Any, loops: "_Loops | None"
                ) -> dict[str, tuple[int, ...]]:
    """Where sharding_propagation has no operator of the graph fixed, each loop whose body
    fixes some (``fixed=`` ``loop/node`` keys, annotations) seeds it, at its cheapest
    candidate."""
    if solver.name != "sharding_propagation" or problem.fixed or loops is None:
        return {}
    out = {}
    for name, lc in problem.loops.items():
        if loops.bodies.get(name) or lc.body.graph.annotations():
            cands = lc.candidates()
            costs = problem.choice_costs(name, [problem.op_choice(lc.node, s) for s in cands])
            out[name] = cands[int(np.argmin(costs))]
    return out


def _follow_elementwise(graph: Graph, problem: Problem, picks: list[int], user: frozenset[str]
                        ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """MindSpore's ``elementwise_op_strategy_follow`` on a solved problem: in graph order, each
    elementwise operator gets the split counts its first full-rank array input has where that
    value is made (its producer's chosen output layout, chains followed through, or a data
    input's layout). Returns those splits and the chosen splits of the producers they follow.
    Operators with a user strategy (``user``: ``fixed=``, annotations) keep it.

    For ``y = tanh(x @ w)`` whose matmul is split ``(2, 4, 1)``, tanh gets ``(2, 4)``.
    """
    mesh = problem.mesh
    made: dict[str, Any] = {}  # value -> its layout where it is produced
    chosen: dict[str, tuple[int, ...]] = {}
    for vert, k in zip(problem.vertices, picks):
        choice = vert.choices[k]
        if vert.kind == "data":
            made[vert.value] = choice.out_layouts[0]  # type: ignore[index]
        elif vert.kind == "op":
            made.update(zip(vert.node.outputs, choice.out_layouts))  # type: ignore[union-attr]
            chosen[vert.name] = choice.splits
    followers: dict[str, tuple[int, ...]] = {}
    producers: dict[str, tuple[int, ...]] = {}
    for node in graph.nodes:
        if KINDS.get(node.op) != "elementwise" or node.name in user:
            continue
        spec = problem.specs[node.name]
        for v, mp in zip(node.inputs, spec.in_maps):
            value = graph.values[v]
            if value.kind not in ("activation", "data") or v not in made or \
                    len(mp) != len(spec.sizes) or None in mp:
                continue  # a literal, a parameter or a broadcast operand: not followed
            splits = [1] * len(spec.sizes)
            for dim, count in zip(mp, made[v].split_counts(mesh)):
                splits[dim] = count  # type: ignore[index]
            try:
                choice = problem.op_choice(node, splits)
            except AutoParallelError:
                break  # those split counts do not fit this operator: left to the search
            followers[node.name] = tuple(splits)
            made.update(zip(node.outputs, choice.out_layouts))
            producer = value.producer if value.kind == "activation" else None
            if producer is not None and producer not in user:
                producers[producer] = chosen[producer]
            break
    for name in followers:
        producers.pop(name, None)
    return followers, producers


class _Loops:
    """How one search plans its loop bodies (:mod:`autopar.strategies.loops`): each body
    candidate searched as the graph is -- the same solver (sharding_propagation, where the
    body fixes no operator, searches it by dynamic_programming: nothing to propagate from),
    settings and memory weight -- with its ``fixed=`` entries (``loop/body node`` keys);
    ``tp``: Megatron's hand plan, the body's matmuls at its splits, the rest propagated.
    Body plans are kept per (loop, settings, weight, inputs) for the whole search."""

    def __init__(self, solver: Any, budget: float, label: str,
                 bodies: Mapping[str, Mapping[str, Any]], tp: int = 0,
                 kept: dict | None = None) -> None:
        self.solver, self.budget, self.label, self.bodies, self.tp = \
            solver, budget, label, bodies, tp
        self.kept: dict = {} if kept is None else kept

    def megatron(self, tp: int) -> "_Loops":
        return _Loops(self.solver, self.budget, self.label, self.bodies, tp, self.kept)

    def pricer(self, mesh: DeviceMesh, cm: CostModel, settings: SearchSettings) -> Any:
        """The edge pricer every problem of the search shares (a cache of prices: the body
        searches of a loop price the same layouts again)."""
        key = ("pricer", mesh, id(cm), settings.enable_alltoall)
        hit = self.kept.get(key)
        if hit is None:
            hit = self.kept[key] = (shared_pricer(mesh, cm, settings.enable_alltoall), cm)
        return hit[0]

    def prices(self) -> PriceBooks:
        """The price books every problem of the search shares (per graph: the operators'
        Choices and raw prices, which no memory weight, candidate or hand plan changes)."""
        hit = self.kept.get("prices")
        if hit is None:
            hit = self.kept["prices"] = PriceBooks()
        return hit

    def planner(self, settings: SearchSettings, weight: float) -> "_Planner":
        return _Planner(self, settings, weight)


#: the edge pricers of the last searches, newest last: (mesh, cluster, enable_alltoall,
#: pricer); a pricer's coefficients depend on nothing else (not on shapes), so searches on
#: one mesh and cluster (a configuration search's stages and micro-batch sizes) share them
_PRICERS: list[tuple[DeviceMesh, Cluster, bool, EdgePricer]] = []
_PRICERS_KEPT = 4


def shared_pricer(mesh: DeviceMesh, cm: CostModel, enable_alltoall: bool) -> EdgePricer:
    """The :class:`EdgePricer` of ``(mesh, cm.cluster, enable_alltoall)``, shared with the
    last searches on them (a pure cache: every price is the same as a fresh pricer's)."""
    for k, (m, c, a, pricer) in enumerate(_PRICERS):
        if m == mesh and a == enable_alltoall and c == cm.cluster:
            _PRICERS.append(_PRICERS.pop(k))
            return pricer
    pricer = EdgePricer(mesh, cm, enable_alltoall)
    _PRICERS.append((mesh, cm.cluster, enable_alltoall, pricer))
    del _PRICERS[:-_PRICERS_KEPT]
    return pricer


class _Planner:
    """The loop planner of one problem (``Problem(loops=...)``)."""

    def __init__(self, loops: _Loops, settings: SearchSettings, weight: float) -> None:
        self.loops, self.settings, self.weight = loops, settings, weight

    def choices(self, problem: Problem, node: Any) -> LoopChoices:
        def search(node: Any, inputs: BodyInputs) -> tuple[Problem, list[int]]:
            return self.search(problem, node, inputs)
        return LoopChoices(problem, node, search)

    def search(self, outer: Problem, node: Any, inputs: BodyInputs
               ) -> tuple[Problem, list[int]]:
        """The body of loop ``node`` of ``outer`` searched at ``inputs`` (kept)."""
        loops, graph = self.loops, loop_body(node).graph
        key = (id(node), self.settings, self.weight, loops.tp, tuple(sorted(
            (v, str(lay)) for v, lay in inputs.layouts.items())), inputs.grads,
            tuple(sorted(inputs.batch.items(), key=lambda item: item[0])))
        hit = loops.kept.get(key)
        if hit is not None:
            return hit
        fixed, bodies = split_by_loop(graph, loops.bodies.get(node.name, {}))
        sub = _Loops(loops.solver, loops.budget, loops.label, bodies, loops.tp, loops.kept)
        follow = {k: v for k, v in megatron_splits(graph, outer.mesh, loops.tp).items()
                  if k not in fixed and graph.node(k).annotation is None} \
            if loops.tp > 1 else None
        derived = follow is not None or self.settings.parallel_mode != "auto_parallel"
        solver = loops.solver
        if derived:
            solver = SOLVERS["dynamic_programming"]  # (propagated below where fixed)
        elif solver.name == "sharding_propagation" and not (fixed or graph.annotations()):
            solver = SOLVERS["dynamic_programming"]
        problem = _problem(graph, outer.mesh, outer.cm, fixed, self.settings, self.weight,
                           lazy=solver.lazy_choices, follow=follow, loops=sub, body=inputs)
        if derived and problem.fixed:
            solver = SOLVERS["sharding_propagation"]
        hit = loops.kept[key] = (problem, solver.picks(problem, loops.budget))
        return hit
