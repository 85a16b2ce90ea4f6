"""Simulate one pipelined iteration: stages x micro-batches, the bubble, the gradient sync.

The pipeline counterpart of :func:`autopar.simulation.simulate` (one device's iteration
trace), and a model of what :func:`autopar.pipeline_train_step` runs: one SPMD program
stepping through the schedule's tick table (:func:`autopar.pipeline.schedules.schedule`) in
lockstep. At each tick every stage runs its cell (forward ``F(s, k)``, backward ``B(s, k)``
or nothing), then two ``collective_permute`` move the boundary buffers one stage on and
one stage back, which every stage joins:

- a tick lasts its slowest cell plus the two transfers (the largest boundary's
  :func:`autopar.strategies.stages.send_time` each: the buffers are padded to one size);
  a stage whose cell is shorter, or empty, waits;
- after the last tick, each stage all-reduces its gradients over its data-parallel devices
  (the alpha-beta all-reduce of the stage's parameter bytes), unless the stage plans give
  their own gradient-sync time (without, a bf16 / fp16 gradient is sent in fp32 where
  ``gradient_fp32_sync`` acts: :func:`~autopar.strategies.precision.sync_factor`).

So GPipe, whose forward and backward ticks never mix, takes ``(m + p - 1)`` ticks of each,
while 1F1B, whose steady state runs forwards beside backwards, pays a backward's length for
most of its ``2 (m + p - 1)`` ticks: it holds fewer activations, not less time. (Measured on
8 emulated CPU devices at ``pp4``, ``m = 8``, 1F1B's step took 0.5-9 % longer than GPipe's
in six runs: three of ``python -m benchmarks pipeline`` and three side-by-side timings.)

Stage times come from the cost model: the roofline time of each operator with its work
divided by its split product (every operator split ``D = device_num / p`` ways without
plans, the plans' splits with them), forward ``f_s``, backward ``2 f_s`` plus ``f_s`` when
the forward is recomputed (``recompute=True``, as autopar's pipelined step does).

The **bubble** is the idle share of the stages' compute time until the last backward ends:
``1 - sum_s busy_s / (p * makespan)``. With equal stages and free transfers, GPipe's is
``(p - 1) / (m + p - 1)``:

>>> t = simulate_schedule([1.0] * 4, [2.0] * 4, micro_batches=8, schedule="gpipe")
>>> round(t.bubble, 6) == round(3 / 11, 6)
True
>>> t.makespan
33.0

**Memory**: with the stages' plans, the trace records the memory per device the pipelined
step holds -- the largest stage plan's peak plus the boundary stash of the schedule
(:func:`boundary_stash`), as the configuration search weighs a configuration
(:mod:`autopar.pipeline.configure`) -- and the cluster's budget; :attr:`PipelineTrace.fits`
says whether it is within it and :func:`simulate_pipeline` warns
(:class:`~autopar.errors.AutoParallelWarning`) where it is not. Without plans nothing
prices it (``memory_bytes`` None).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from autopar.errors import AutoParallelError, AutoParallelTypeError, found
from autopar.limits import finite
from autopar.pipeline.schedules import FWD, IDLE, SCHEDULES, schedule as build_schedule

__all__ = ["PipelineBlock", "PipelineTrace", "boundary_stash", "pipeline_trace",
           "simulate_schedule", "simulate_pipeline"]


@dataclass(frozen=True, slots=True)
class PipelineBlock:
    """One forward or backward of one micro-batch on one stage (seconds)."""

    stage: int
    kind: str          # "F" or "B"
    micro: int
    start: float
    end: float

    @property
    def name(self) -> str:
        return f"{self.kind}{self.micro}"


@dataclass(frozen=True)
class PipelineTrace:
    """A simulated pipelined iteration (times in seconds from 0)."""

    schedule: str
    stages: int
    micro_batches: int
    blocks: tuple[PipelineBlock, ...]
    sync: tuple[tuple[float, float], ...]      # per stage: gradient all-reduce start, end
    cluster: str = ""
    device_num: int = 0
    update: float = 0.0        # the optimizer update after the gradient sync (slowest stage)
    launch: float = 0.0        # the step's launch, before the first tick (times start after)
    memory_bytes: float | None = None  # per device: stage plans' peak + stash (None: no plans)
    budget_bytes: float | None = None  # the cluster's memory per device

    @property
    def fits(self) -> bool:
        """Whether the memory per device is within the cluster's budget (True where nothing
        priced it: no stage plans)."""
        from autopar.timeline import within_budget

        return within_budget(self.memory_bytes, self.budget_bytes)

    @property
    def makespan(self) -> float:
        """When the last backward ends."""
        return max(b.end for b in self.blocks)

    @property
    def iteration_time(self) -> float:
        """Until the last stage's gradient sync ends."""
        return max([self.makespan] + [e for _, e in self.sync])

    @property
    def step_time(self) -> float:
        """The whole step: its launch, the iteration and the optimizer update (as
        :attr:`IterationTrace.step_time <autopar.timeline.IterationTrace.step_time>`)."""
        return self.launch + self.iteration_time + self.update

    def busy(self, stage: int) -> float:
        return sum(b.end - b.start for b in self.blocks if b.stage == stage)

    @property
    def bubble(self) -> float:
        """Idle share of the stages until the last backward: 1 - busy / (p x makespan)."""
        span = self.makespan
        if span == 0:  # nothing to run: no idle time either
            return 0.0
        return 1.0 - sum(self.busy(s) for s in range(self.stages)) / (self.stages * span)

    def summary(self) -> str:
        return (f"pipeline {self.schedule}: {self.stages} stages x {self.micro_batches} "
                f"micro-batches{f' on {self.device_num} devices' if self.device_num else ''}"
                f"{f' ({self.cluster})' if self.cluster else ''}: iteration "
                f"{self.iteration_time * 1e3:.3f} ms, last backward at "
                f"{self.makespan * 1e3:.3f} ms, bubble {self.bubble:.1%}; step (launch, "
                f"iteration, optimizer update) {self.step_time * 1e3:.3f} ms")

    def _check_finite(self) -> None:
        times = [(f"{b.name} of stage {b.stage} {k}", getattr(b, k)) for b in self.blocks
                 for k in ("start", "end")]
        times += [(f"gradient sync of stage {s}", x) for s, ab in enumerate(self.sync)
                  for x in ab]
        from autopar.files import require_finite

        require_finite(times, "Check the stage times and the cluster's figures")

    def to_chrome_trace(self) -> dict[str, Any]:
        """``{"traceEvents": [...]}``: one track per stage, a complete event (``"ph": "X"``,
        µs) per forward / backward block and per gradient all-reduce; Perfetto opens it. A
        non-finite time raises :class:`~autopar.errors.AutoParallelError` (JSON has no NaN
        or Infinity)."""
        self._check_finite()
        us, pid = 1e6, 1
        ev: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
             "args": {"name": f"autopar simulated pipeline ({self.schedule}, {self.stages} "
                              f"stages x {self.micro_batches} micro-batches)"}}]
        for s in range(self.stages):
            ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": s + 1,
                       "args": {"name": f"stage {s}"}})
            ev.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": s + 1,
                       "args": {"sort_index": s + 1}})
        for b in self.blocks:
            ev.append({"name": b.name, "cat": "forward" if b.kind == "F" else "backward",
                       "ph": "X", "pid": pid, "tid": b.stage + 1, "ts": b.start * us,
                       "dur": (b.end - b.start) * us, "args": {"micro_batch": b.micro}})
        for s, (a, e) in enumerate(self.sync):
            if e > a:
                ev.append({"name": "gradient allreduce", "cat": "allreduce", "ph": "X",
                           "pid": pid, "tid": s + 1, "ts": a * us, "dur": (e - a) * us,
                           "args": {}})
        return {"traceEvents": ev, "displayTimeUnit": "ms",
                "otherData": {"iteration_ms": self.iteration_time * 1e3,
                              "bubble": self.bubble}}

    def write_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write the Chrome trace JSON atomically (temp file + os.replace)."""
        from autopar.files import write_text_atomic

        return write_text_atomic(path, json.dumps(self.to_chrome_trace(), allow_nan=False))


def _times(name: str, values: Any, n: int) -> list[float]:
    """``values`` as ``n`` finite seconds >= 0; a typed error naming ``name`` otherwise."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise AutoParallelTypeError(name, values, f"a list of {n} seconds")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise AutoParallelTypeError(name, values, f"every entry must be a number of "
                                        f"seconds, {found(v, f'[{i}]')}")
        if not finite(v) or v < 0:
            raise AutoParallelError(name, values, f"every entry must be a finite number >= 0, "
                                    f"{found(v, f'[{i}]')}")
        out.append(float(v))
    return out


def _optional_times(name: str, values: Any, default: list[float]) -> list[float]:
    """``values`` (any sequence of numbers) as a list, ``default`` for None; a typed error
    for anything else (checked before ``list()`` reads it)."""
    if values is None:
        return default
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise AutoParallelTypeError(name, values, f"a list of {len(default)} seconds or None")
    return list(values)


def simulate_schedule(forward: Sequence[float], backward: Sequence[float], *,
                      micro_batches: int, schedule: str = "1f1b",
                      sends: Sequence[float] | None = None,
                      sync: Sequence[float] | None = None, cluster: str = "",
                      device_num: int = 0) -> PipelineTrace:
    """Simulation of one iteration from per-stage times (seconds), tick by tick as the
    pipelined step runs it (see the module doc): ``forward[s]`` / ``backward[s]`` per
    micro-batch, ``sends[b]`` the one-way transfer across boundary ``b`` (default 0; every
    tick moves the largest, both ways), ``sync[s]`` the stage's gradient all-reduce
    (default 0), after the last tick."""
    if not isinstance(forward, (list, tuple)) or not forward:
        raise AutoParallelTypeError("forward", forward, "a non-empty list of stage seconds")
    p = len(forward)
    f = _times("forward", forward, p)
    b = _times("backward", backward, p)
    snd = _times("sends", _optional_times("sends", sends, [0.0] * (p - 1)), p - 1)
    syn = _times("sync", _optional_times("sync", sync, [0.0] * p), p)
    sched = build_schedule(schedule, p, micro_batches)   # validates name, p, m
    exchange = 2.0 * max(snd, default=0.0)  # the two ppermutes of a tick (padded buffers)
    now = 0.0
    blocks: list[PipelineBlock] = []
    for t in range(sched.ticks):
        longest = 0.0
        for s in range(p):
            op = int(sched.op[t, s])
            if op == IDLE:
                continue
            dur = f[s] if op == FWD else b[s]
            blocks.append(PipelineBlock(s, "F" if op == FWD else "B", int(sched.micro[t, s]),
                                        now, now + dur))
            longest = max(longest, dur)
        now += longest + exchange  # every stage waits for the tick's slowest, then sends
    sync_ev = tuple((now, now + syn[s]) for s in range(p))
    if not math.isfinite(now + max(syn)):
        raise AutoParallelError("forward / backward / sends / sync", f"up to {max(f + b):g} s",
                                "the iteration they add up to overflows a float: give stage "
                                "times in seconds")
    blocks.sort(key=lambda x: (x.stage, x.start))
    return PipelineTrace(sched.name, p, micro_batches, tuple(blocks), sync_ev, cluster,
                         device_num)


def simulate_pipeline(graph: Any, stages: int, *, micro_batches: int | None = None,
                      schedule: str = "1f1b", boundaries: Sequence[str | int] | None = None,
                      device_num: int | None = None, cluster: Any = None,
                      plans: Sequence[Any] | None = None,
                      recompute: bool = True) -> PipelineTrace:
    """Simulate ``graph`` (traced at micro-batch size) pipelined over ``stages`` stages of
    ``device_num / stages`` devices (see the module docstring). ``plans``: the stages'
    plans (e.g. ``PipelineTrainStep.plans``) for their splits and gradient-sync times;
    without, each stage is data parallel over its devices; they were priced on their own
    cluster, so a different ``cluster`` is refused (one cluster prices one answer). With
    plans, the trace records the memory per device and the budget
    (:attr:`PipelineTrace.fits`); over it, an :class:`~autopar.errors.AutoParallelWarning`
    names both, and the trace is returned all the same. ``device_num`` defaults to the
    context's, ``gradient_fp32_sync`` is the context's as it acts: the one read of the
    context (everything below takes resolved values)."""
    from autopar.clusters import cluster_for
    from autopar.context import current_config
    from autopar.strategies.precision import fp32_sync_active

    if not isinstance(recompute, bool):
        raise AutoParallelTypeError("recompute", recompute, "must be a bool")
    if schedule not in SCHEDULES:
        build_schedule(schedule, 1, 1)  # raises the typed error
    cfg = current_config()
    n = cfg.device_num if device_num is None else device_num
    fp32 = fp32_sync_active(cfg.gradient_fp32_sync, cfg.parallel_mode)
    # the stages' plans were priced on one cluster: simulate on it unless one is named
    clus = cluster_for(plans[0] if isinstance(plans, (list, tuple)) and plans else None,
                       cluster)
    trace = pipeline_trace(graph, stages, device_num=n, cluster=clus, fp32=fp32,
                           micro_batches=micro_batches, schedule=schedule,
                           boundaries=boundaries, plans=plans, recompute=recompute)
    from autopar.timeline import warn_over_budget

    warn_over_budget(trace.memory_bytes, trace.budget_bytes, trace.cluster,
                     f"the stage plans' pipelined step ({trace.schedule}, {trace.stages} stages "
                     f"x {trace.micro_batches} micro-batches)", "autopar.search_configuration "
                     "(auto_pipeline=True) weighs the stages, micro-batches and schedules, "
                     "stash included, within the budget")
    return trace


def pipeline_trace(graph: Any, stages: int, *, device_num: int, cluster: Any, fp32: bool,
                   micro_batches: int | None = None, schedule: str = "1f1b",
                   boundaries: Sequence[str | int] | None = None,
                   plans: Sequence[Any] | None = None,
                   recompute: bool = True) -> PipelineTrace:
    """:func:`simulate_pipeline` on resolved inputs (it reads nothing): ``cluster`` the
    :class:`~autopar.strategies.cost.Cluster` the plans were priced on, ``fp32`` whether
    gradients are synchronised in fp32 (``gradient_fp32_sync`` in effect). It records the
    memory per device and the budget, and warns of neither (the configuration search
    weighs configurations over the budget on purpose)."""
    from autopar.strategies.cost import BACKWARD_FACTOR, CostModel
    from autopar.strategies.stages import partition_stages, send_time

    n, clus = device_num, cluster
    m = stages if micro_batches is None else micro_batches
    part = partition_stages(graph, stages, boundaries=boundaries, device_num=n,
                            micro_batches=m, cluster=clus)
    cuts = _cuts_of(graph, part, plans) if boundaries is None else None
    if cuts is not None and cuts != part.cuts:  # the plans' stages: where they were cut
        part = partition_stages(graph, stages, boundaries=list(cuts), device_num=n,
                                micro_batches=m, cluster=clus)
    cm = CostModel(clus)
    d = n // stages
    if plans is not None and (not isinstance(plans, (list, tuple)) or len(plans) != stages):
        raise AutoParallelTypeError("plans", plans, f"a list of {stages} stage plans")
    _check_plans(plans, clus, graph, part)
    fwd, sync, again = _stage_times(graph, part.stage_nodes, plans, cm, d, fp32)
    bwd = [BACKWARD_FACTOR * t + (t if recompute else a) for t, a in zip(fwd, again)]
    sends = [send_time(b, cm, d) for b in part.crossing_bytes]
    trace = simulate_schedule(fwd, bwd, micro_batches=m, schedule=schedule, sends=sends,
                              sync=sync, cluster=clus.name, device_num=n)
    memory = None if plans is None else max(plan.cost.memory_bytes for plan in plans) + \
        boundary_stash(part, build_schedule(schedule, stages, m), d)
    return dataclasses.replace(trace, launch=clus.step_overhead,
                               update=_stage_update(graph, part.stage_nodes, plans, cm),
                               memory_bytes=memory, budget_bytes=float(clus.memory_bytes))


def schedule_note(graph: Any, stages: int, *, device_num: int, cluster: Any, fp32: bool,
                  micro_batches: int, schedule: str, plans: Sequence[Any]) -> str:
    """What the other schedule would change, when it is priced faster than ``schedule``
    (:func:`pipeline_trace` of both with the stage plans): a note for a step that runs the
    default schedule, else "". 1F1B runs in lockstep here (every stage waits for the
    tick's slowest cell), so GPipe is often faster at the price of holding every
    micro-batch's boundary activations."""
    times = {name: pipeline_trace(graph, stages, device_num=device_num, cluster=cluster,
                                  fp32=fp32, micro_batches=micro_batches, schedule=name,
                                  plans=list(plans)).step_time for name in SCHEDULES}
    other = min((n for n in SCHEDULES if n != schedule), key=lambda n: times[n])
    if times[other] >= times[schedule] * (1.0 - 1e-3):
        return ""
    return (f"schedule {schedule} (the default) is priced at {times[schedule] * 1e3:.4g} ms "
            f"a step, {other} at {times[other] * 1e3:.4g} ms "
            f"({1.0 - times[other] / times[schedule]:.0%} less; 1F1B runs in lockstep here, "
            f"GPipe holds every micro-batch's boundary activations): set pipeline_config="
            f"{{'pipeline_scheduler': '{other}'}} to run it")


def boundary_stash(part: Any, sched: Any, devices: int) -> float:
    """The boundary stash per device the pipelined step allocates: ``act_slots + 1``
    activation and ``grad_slots + 1`` gradient buffers of the schedule ``sched`` (a
    :class:`~autopar.pipeline.schedules.Schedule`), each the largest boundary's bytes of the
    partition ``part`` over a stage's ``devices`` (none on one stage)."""
    if part.stages == 1:
        return 0.0
    largest = max(part.crossing_bytes, default=0) / devices
    return float((sched.act_slots + sched.grad_slots + 2) * largest)


def _stage_update(graph: Any, stage_nodes: Sequence[Sequence[str]],
                  plans: Sequence[Any] | None, cm: Any) -> float:
    """The optimizer update of the slowest stage: its trained parameters' blocks under the
    stage plan's layouts (whole without plans), by the iteration simulator's rule
    (:func:`autopar.timeline.update_time`)."""
    from autopar.timeline import update_time

    return max(update_time(graph, dict.fromkeys(
        v for name in names for v in graph.node(name).inputs
        if graph.values[v].kind == "param"), plans[s] if plans is not None else None, cm)
        for s, names in enumerate(stage_nodes))


def _cuts_of(graph: Any, part: Any, plans: Any) -> tuple[int, ...] | None:
    """The unit index where each stage plan after the first begins (the boundaries the plans
    were made with; a search at other micro-batches may cut elsewhere), or None when the
    plans do not say (not plans, their first nodes not unit starts)."""
    if not isinstance(plans, (list, tuple)) or len(plans) != part.stages or not all(
            hasattr(p, "nodes") and p.nodes for p in plans):
        return None
    index = {nd.name: i for i, nd in enumerate(graph.nodes)}
    starts = {u.start: u.index for u in part.units}
    firsts = [min((index.get(n, -1) for n in p.nodes), default=-1) for p in plans[1:]]
    cuts = tuple(starts.get(f, -1) for f in firsts)
    return cuts if all(c > 0 for c in cuts) and list(cuts) == sorted(set(cuts)) else None


def _check_plans(plans: Sequence[Any] | None, clus: Any, graph: Any, part: Any) -> None:
    """Every stage plan is a Plan of its stage's graph (in stage order), priced on ``clus``.
    The stage plans' communication and gradient sync were priced on their own cluster:
    simulating them on another would mix two clusters in one answer, so it is refused."""
    from autopar.clusters import cluster_for
    from autopar.strategies.plan import Plan
    from autopar.strategies.stages import stage_graph

    for s, plan in enumerate(plans or ()):
        if not isinstance(plan, Plan):
            raise AutoParallelTypeError("plans", plans, f"every entry must be a stage's Plan, "
                                        f"{found(plan, f'[{s}]')}")
    for s, plan in enumerate(plans or ()):
        own = cluster_for(plan, None)
        if own != clus:
            raise AutoParallelError("cluster", clus.name, f"stage {s}'s plan was priced on "
                                    f"cluster {own.name!r}; its communication and gradient "
                                    "sync cannot be mixed with another cluster's times",
                                    "Pass cluster=None (the plans' own), or plan the stages "
                                    "on this cluster")
    for s, plan in enumerate(plans or ()):
        if plan.fingerprint != stage_graph(graph, part, s).fingerprint():
            raise AutoParallelError("plans", f"[{s}]", f"it is not a plan of stage {s}'s "
                                    "graph (another model, stage or boundaries)",
                                    "Pass the stages' plans in order, with the boundaries "
                                    "they were made with (PipelineTrainStep.plans)")


def _stage_times(graph: Any, stage_nodes: Sequence[Sequence[str]], plans: Sequence[Any] | None,
                 cm: Any, d: int, fp32: bool = False
                 ) -> tuple[list[float], list[float], list[float]]:
    """``(forward seconds, gradient-sync seconds, forward seconds run again in backward)``
    of each stage on its ``d`` devices: the stage plan's operator times and communication,
    or data parallel without plans (its gradients sent in fp32 where ``fp32``:
    gradient_fp32_sync); run again: the operators of ``jax.checkpoint`` regions whose
    outputs the policy does not save."""
    from autopar.strategies.cost import BACKWARD_FACTOR
    from autopar.strategies.precision import compute_dtype, sync_factor
    from autopar.strategies.problem import fused_values, operator_time

    fwd, sync, again = [], [], []
    fused = fused_values(graph)
    for s, names in enumerate(stage_nodes):
        plan = plans[s] if plans is not None else None
        t = a = 0.0
        for name in names:
            node = graph.node(name)
            ns = plan.nodes.get(name) if plan is not None else None
            if ns is not None:  # the search's own rule on the stage plan's blocks
                dt = operator_time(cm, graph, node, ns.splits, ns.in_layouts, ns.out_layouts,
                                   plan.mesh, fused)
            else:  # data parallel over the stage's devices
                dt = cm.compute_time(node.flops / d, (node.bytes_read + node.bytes_written) / d,
                                     dtype=compute_dtype(graph, node))
            t += dt
            a += dt if node.remat is not None and not node.remat.saved else 0.0
        if plan is not None:
            t += (plan.cost.communication + plan.cost.redistribution) / (1 + BACKWARD_FACTOR)
            sync.append(plan.cost.gradient_sync)
        else:
            nbytes = sum(graph.spec(v).nbytes * sync_factor(graph.spec(v).dtype, fp32)
                         for v in dict.fromkeys(
                v for name in names for v in graph.node(name).inputs
                if graph.values[v].kind == "param"))
            sync.append(cm.collective_time("all_reduce", nbytes, d,
                                           intra=cm.intra_node(d)))
        fwd.append(t)
        again.append(a)
    return fwd, sync, again
