"""Simulate one training iteration: forward, backward, and the bucketed gradient all-reduces.

The model (all times from :class:`~autopar.strategies.cost.CostModel`):

- **forward**: the step's launch, then the graph's operators in program order, each priced
  by the search's own rule (:func:`~autopar.strategies.problem.operator_time`: with a plan its
  strategy's local blocks, without one whole tensors), plus the plan's activation
  communication and redistribution (a third here, the rest in backward; on another cluster
  than the plan's, re-priced there: :func:`plan_communication`).
- **backward**: the rest of that communication, then the operators in reverse order, each
  taking ``BACKWARD_FACTOR`` (2) x its forward time (0 when nothing it reads is trained),
  one more where a ``jax.checkpoint`` policy recomputes it (:mod:`autopar.graph.remat`).
  A gradient is *ready* when backward has passed its parameter's first use in forward
  (unused parameters: at the start of backward).
  The optimizer update follows ``Iteration_end`` (``update``; ``step_time`` includes it): with
  ``overlap=False`` and one bucket per gradient, ``step_time`` is the plan's predicted step.
- **communication**: the buckets in order on one communication stream. Bucket k starts at
  ``max(its last gradient ready, end of bucket k-1)`` with ``overlap=True`` (HCCL's
  ``hcom_parallel``), or ``max(bp_end, end of bucket k-1)`` with ``overlap=False`` (the
  default follows the cluster: :attr:`CostModel.overlaps_communication
  <autopar.strategies.cost.CostModel.overlaps_communication>`; emulated CPU devices, whose
  cores compute and move the data, measure no overlap), and takes
  the alpha-beta all-reduce time of the bytes it sends over the data-parallel group: every
  device without a plan (gradient bytes = full parameter bytes), and with a plan, per group
  of gradients sharing the axes where they are replicated, their local bytes over those axes.
  Where ``gradient_fp32_sync`` acts a bf16 / fp16 gradient is sent in fp32, twice its bytes
  (:func:`~autopar.strategies.precision.sync_factor`, the search's rule): with a plan as the
  plan was priced (``plan.pricing.fp32_sync``, so the simulation agrees with the search),
  without one as the context sets it (:func:`~autopar.strategies.precision.fp32_sync_active`,
  read once, by :func:`simulate`). The buckets are made of the gradients as
  :func:`~autopar.fusion.gradients` gives them; a segment's ``nbytes`` is what it sends.
- ``Iteration_end = max(bp_end, end of the last all-reduce)``.

**Memory**: the trace records the plan's memory per device as the search priced it
(``plan.cost.memory_bytes``; None without a plan) and the cluster's budget
(``Cluster.memory_bytes``); :attr:`IterationTrace.fits` says whether it is within it, and
:func:`simulate` warns (:class:`~autopar.errors.AutoParallelWarning`) where it is not: the
times are those of a step that could not run there (a plan simulated on a cluster with less
memory than its own).

Events are named as seed 001's iteration trace: ``fp_start``, ``bp_end``,
``allreduce{k}_start`` / ``allreduce{k}_end`` (k = 1, 2, ... in issue order) and
``Iteration_end``. :meth:`IterationTrace.to_chrome_trace` gives a Chrome trace that Perfetto
(ui.perfetto.dev) and chrome://tracing open; :meth:`IterationTrace.plot` draws a PNG
(matplotlib, the optional ``plot`` extra).

>>> import jax.numpy as jnp, autopar
>>> g = autopar.trace(lambda params, x: ((x @ params["w"]) ** 2).sum(),
...                   {"w": jnp.ones((512, 512))}, jnp.ones((64, 512)))
>>> t = simulate(g, device_num=8)
>>> [name for name, _ in t.events()]
['fp_start', 'bp_end', 'allreduce1_start', 'allreduce1_end', 'Iteration_end']
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.fusion import BUCKET_POLICIES, Bucket, GradientBuckets, gradients

__all__ = ["CommSegment", "IterationModel", "IterationTrace", "bucket_ends", "simulate",
           "simulate_setup", "plot_timeline", "plan_communication", "sync_in_fp32",
           "within_budget", "warn_over_budget"]


@dataclass(frozen=True, slots=True)
class CommSegment:
    """One bucket's all-reduce on the communication stream (seconds from fp_start)."""

    index: int          # 0-based; its events are allreduce{index + 1}_start / _end
    ready: float        # when its last gradient is ready
    start: float
    end: float
    nbytes: int
    first: int          # backward-order index of its first gradient
    last: int           # ... and of its last (inclusive)

    @property
    def name(self) -> str:
        return f"allreduce{self.index + 1}"

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class IterationTrace:
    """The simulated iteration. Times in seconds from ``fp_start`` (= 0)."""

    cluster: str
    device_num: int
    overlap: bool
    source: str                         # which bucket setting was simulated
    fp_start: float
    fp_end: float
    bp_end: float
    iteration_end: float
    segments: tuple[CommSegment, ...]
    node_names: tuple[str, ...]         # forward order
    node_times: tuple[float, ...]       # forward seconds per node
    gradient_names: tuple[str, ...]     # backward order
    gradient_ready: tuple[float, ...]
    update: float = 0.0                 # the optimizer update after Iteration_end
    node_backward: tuple[float, ...] = ()  # backward seconds per node (forward order)
    launch: float = 0.0                 # the step's launch, at the start of forward
    fp_comm: float = 0.0                # the plan's activation communication in forward
    bp_comm: float = 0.0                # ... and in backward (before its operators)
    memory_bytes: float | None = None   # the plan's memory per device (None: no plan)
    budget_bytes: float | None = None   # the cluster's memory per device

    @property
    def fits(self) -> bool:
        """Whether the plan's memory per device is within the cluster's budget (True where
        nothing priced it: no plan)."""
        return within_budget(self.memory_bytes, self.budget_bytes)

    @property
    def step_time(self) -> float:
        """The whole training step: the iteration, then the optimizer update (what a plan's
        predicted step prices)."""
        return self.iteration_time + self.update

    @property
    def fp_time(self) -> float:
        return self.fp_end - self.fp_start

    @property
    def bp_time(self) -> float:
        return self.bp_end - self.fp_end

    @property
    def iteration_time(self) -> float:
        return self.iteration_end - self.fp_start

    @property
    def comm_time(self) -> float:
        """Total busy time of the communication stream."""
        return sum(s.duration for s in self.segments)

    @property
    def exposed_comm(self) -> float:
        """Communication after bp_end: the tail that computation does not hide."""
        return self.iteration_end - self.bp_end

    def events(self) -> tuple[tuple[str, float], ...]:
        """Seed 001's trace points, ordered by time (ties keep the logical order)."""
        ev: list[tuple[str, float]] = [("fp_start", self.fp_start), ("bp_end", self.bp_end)]
        for s in self.segments:
            ev += [(f"{s.name}_start", s.start), (f"{s.name}_end", s.end)]
        ev.append(("Iteration_end", self.iteration_end))
        return tuple(sorted(ev, key=lambda e: e[1]))

    def summary(self) -> str:
        """FP, BP, iteration time and exposed communication, in ms."""
        hidden = sum(1 for s in self.segments if s.end <= self.bp_end)
        return (f"iteration {self.iteration_time * 1e3:.3f} ms on {self.device_num} devices "
                f"({self.cluster}, overlap {'on' if self.overlap else 'off'}): FP "
                f"{self.fp_time * 1e3:.3f} ms, BP {self.bp_time * 1e3:.3f} ms, communication "
                f"{self.comm_time * 1e3:.3f} ms in {len(self.segments)} segment(s) "
                f"({hidden} end before bp_end), exposed after bp_end "
                f"{self.exposed_comm * 1e3:.3f} ms; then the optimizer update "
                f"{self.update * 1e3:.3f} ms: step {self.step_time * 1e3:.3f} ms; buckets: "
                f"{self.source}")

    def table(self) -> str:
        """The seed's trace points and each segment, one line each (ms)."""
        lines = [f"{name:<22} {t * 1e3:10.3f} ms" for name, t in self.events()]
        lines.append("")
        for s in self.segments:
            lines.append(f"{s.name:<12} gradients {s.first}..{s.last}  {s.nbytes / 2**20:9.3f} "
                         f"MB  ready {s.ready * 1e3:9.3f}  start {s.start * 1e3:9.3f}  end "
                         f"{s.end * 1e3:9.3f} ms")
        return "\n".join(lines)

    # ------------------------------------------------------------------ Chrome trace
    def compute_spans(self) -> tuple[list[tuple[str, str, float]], list[tuple[str, str, float]]]:
        """``(name, category, seconds)`` of what fills forward and of what fills backward, in
        order: the launch and the forward share of the plan's activation communication, then
        the operators; the backward share, then each operator's backward (0 when it reads
        nothing trained). Each list adds up to its phase, as the simulation adds it."""
        fwd = [("launch", "launch", self.launch),
               ("activation communication", "communication", self.fp_comm)]
        fwd = [x for x in fwd if x[2] > 0]
        fwd += [(n, "forward", d) for n, d in zip(self.node_names, self.node_times)]
        bwd = [("activation communication", "communication", self.bp_comm)] \
            if self.bp_comm > 0 else []
        bwd += [(f"{n} (grad)", "backward", d) for n, d in
                zip(reversed(self.node_names), reversed(self.node_backward))]
        return fwd, bwd

    def _check_finite(self) -> None:
        """A Chrome trace is JSON, which has no NaN or Infinity: refuse a non-finite time."""
        named = [("fp_start", self.fp_start), ("fp_end", self.fp_end), ("bp_end", self.bp_end),
                 ("Iteration_end", self.iteration_end), ("update", self.update),
                 ("launch", self.launch), ("fp_comm", self.fp_comm), ("bp_comm", self.bp_comm)]
        named += [(f"forward of {n}", x) for n, x in zip(self.node_names, self.node_times)]
        named += [(f"backward of {n}", x) for n, x in zip(self.node_names, self.node_backward)]
        named += [(f"ready of {n}", x) for n, x in zip(self.gradient_names, self.gradient_ready)]
        named += [(f"{s.name} {k}", getattr(s, k)) for s in self.segments
                  for k in ("ready", "start", "end")]
        from autopar.files import require_finite

        require_finite(named, "Check the cluster's figures (a calibration with extreme "
                       "values prices non-finite times)")

    def _compute_events(self, pid: int) -> list[dict[str, Any]]:
        """The compute track's per-operator events, back to back inside their phase."""
        us = 1e6
        ev: list[dict[str, Any]] = []
        for t, spans in zip((self.fp_start, self.fp_end), self.compute_spans()):
            for name, cat, d in spans:
                ev.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": 1,
                           "ts": t * us, "dur": d * us, "args": {}})
                t += d
        return ev

    def to_chrome_trace(self, *, detail: bool = True) -> dict[str, Any]:
        """``{"traceEvents": [...]}``: complete events (``"ph": "X"``, ts/dur in µs) on a
        compute track (forward / backward, and with ``detail`` what fills them: the launch,
        the activation communication, one event per operator), a communication track (one
        per segment), and instant events for the seed's points. A non-finite time raises
        :class:`~autopar.errors.AutoParallelError` (JSON has no NaN or Infinity)."""
        self._check_finite()
        us = 1e6
        pid = 1
        ev: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
             "args": {"name": f"autopar simulated iteration ({self.device_num} devices, "
                              f"{self.cluster})"}},
        ]
        for tid, name in ((1, "compute"), (2, "communication"), (3, "iteration trace")):
            ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": name}})
            ev.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"sort_index": tid}})
        ev.append({"name": "forward", "cat": "compute", "ph": "X", "pid": pid, "tid": 1,
                   "ts": self.fp_start * us, "dur": self.fp_time * us, "args": {}})
        ev.append({"name": "backward", "cat": "compute", "ph": "X", "pid": pid, "tid": 1,
                   "ts": self.fp_end * us, "dur": self.bp_time * us, "args": {}})
        if detail:
            ev += self._compute_events(pid)
        for s in self.segments:
            ev.append({"name": s.name, "cat": "allreduce", "ph": "X", "pid": pid, "tid": 2,
                       "ts": s.start * us, "dur": s.duration * us,
                       "args": {"bytes": s.nbytes, "gradients": f"{s.first}..{s.last}",
                                "first": self.gradient_names[s.first],
                                "last": self.gradient_names[s.last],
                                "ready_us": s.ready * us}})
        for name, t in self.events():
            ev.append({"name": name, "cat": "iteration_trace", "ph": "i", "s": "t",
                       "pid": pid, "tid": 3, "ts": t * us, "args": {}})
        return {"traceEvents": ev, "displayTimeUnit": "ms",
                "otherData": {"source": self.source, "iteration_ms": self.iteration_time * 1e3,
                              "exposed_comm_ms": self.exposed_comm * 1e3}}

    def write_chrome_trace(self, path: str | os.PathLike[str], *, detail: bool = True) -> Path:
        """Write the Chrome trace JSON atomically (temp file + os.replace)."""
        from autopar.files import write_text_atomic

        return write_text_atomic(path, json.dumps(self.to_chrome_trace(detail=detail),
                                                  allow_nan=False))

    def plot(self, path: str | os.PathLike[str], *, title: str | None = None) -> Path:
        """Draw the timeline to a PNG (see :func:`plot_timeline`)."""
        return plot_timeline(self, path, title=title)


# ---------------------------------------------------------------------------- the rules


def sync_in_fp32(plan: Any, setup: Any) -> bool:
    """Whether the gradient sync sends a bf16 / fp16 gradient in fp32 (``gradient_fp32_sync``
    as it acts): with a plan, as the plan was priced (``plan.pricing.fp32_sync``: a
    simulation agrees with the search, as it prices on the plan's own cluster); without,
    as ``setup``'s context sets it (:func:`~autopar.strategies.precision.fp32_sync_active`
    of its ``gradient_fp32_sync`` and ``parallel_mode``); False without either."""
    from autopar.strategies.precision import fp32_sync_active

    if plan is not None:
        return bool(plan.pricing.fp32_sync)
    if setup is None:
        return False
    return fp32_sync_active(setup.config.gradient_fp32_sync, setup.config.parallel_mode)


def within_budget(needed: float | None, budget: float | None) -> bool:
    """Whether ``needed`` bytes per device fit ``budget`` (True where either is unknown)."""
    return needed is None or budget is None or needed <= budget


def warn_over_budget(needed: float | None, budget: float | None, cluster: str,
                     what: str, hint: str) -> None:
    """An :class:`~autopar.errors.AutoParallelWarning` at the user's line when ``needed``
    bytes per device (of ``what``) are over the ``budget`` of ``cluster``, ending with
    ``hint``: the simulators' one rule (a simulation of it is still answered: what it would
    cost is a fair question)."""
    if needed is None or budget is None or needed <= budget:
        return
    import warnings

    from autopar.errors import AutoParallelWarning, user_stacklevel
    from autopar.strategies.memory import size

    warnings.warn(f"memory: {what} needs {size(needed)} ({needed:,.0f} bytes) per device, over "
                  f"the {cluster} budget of {size(budget)} ({budget:,.0f} bytes) per device: "
                  "it would not fit there, the simulated times are those of a step that "
                  f"could not run; {hint}", AutoParallelWarning, stacklevel=user_stacklevel())


# ---------------------------------------------------------------------------- the model


class IterationModel:
    """Everything per (graph, plan, cluster, devices) that does not depend on the buckets:
    node times, gradient ready times, and the price of any contiguous run of gradients.

    :func:`simulate` builds one and runs it on one bucketing; the split advisor
    (:mod:`autopar.split_advisor`) builds one and searches the bucketings on it: ``grads``
    (backward order), ``ready`` (each gradient's ready time, seconds), ``bp_end``,
    ``overlap``, :meth:`price` / :meth:`price_matrix` (a bucket's all-reduce) and :meth:`run`
    (the trace of one bucketing) are what it reads. The arguments are :func:`simulate`'s,
    checked the same way; without a plan, ``device_num`` must be given (the entry points pass
    the context's). ``cluster``: as :func:`simulate`'s, or the entry point's
    :class:`~autopar.setup.Setup` (its cluster resolved once: :meth:`Setup.cluster_for`).
    ``fp32``: whether a bf16 / fp16 gradient is synchronised in fp32 (``gradient_fp32_sync``
    acting); None: as :func:`sync_in_fp32` resolves it from the plan, or from ``cluster``
    where it is a Setup (False otherwise).
    """

    def __init__(self, graph: Any, plan: Any, cluster: Any, device_num: Any,
                 overlap: Any, fp32: bool | None = None) -> None:
        from autopar.graph.ir import Graph
        from autopar.clusters import cluster_for
        from autopar.setup import Setup
        from autopar.strategies.cost import BACKWARD_FACTOR, CostModel
        from autopar.strategies.layout import DeviceMesh

        if not isinstance(graph, Graph):
            raise AutoParallelTypeError("graph", graph, "an autopar.Graph from autopar.trace")
        if overlap is not None and not isinstance(overlap, bool):
            raise AutoParallelTypeError("overlap", overlap, "must be a bool, or None (as the "
                                        "cluster measured)")
        grads = gradients(graph, plan) if plan is not None else None  # checks the plan
        clus = cluster.cluster_for(plan) if isinstance(cluster, Setup) \
            else cluster_for(plan, cluster)  # before pricing on its cluster
        self.cm = CostModel(clus)
        self.overlap = self.cm.overlaps_communication if overlap is None else overlap
        if device_num is not None and (isinstance(device_num, bool) or
                                       not isinstance(device_num, int)):
            raise AutoParallelTypeError("device_num", device_num, "must be an int")
        if plan is not None:
            self.grads = grads
            if device_num is not None and device_num != plan.mesh.device_num:
                raise AutoParallelError("device_num", device_num, f"the plan is for "
                                        f"{plan.mesh.device_num} devices",
                                        "Omit device_num when passing a plan")
            self.mesh = plan.mesh
        else:  # the entry point gave the context's device_num
            self.mesh = DeviceMesh.for_devices(device_num)
            self.grads = gradients(graph)
        self.device_num = self.mesh.device_num
        self.cluster = clus.name
        # forward / backward, priced as the search prices them
        times, back, extra, tail = _node_times(graph, plan, self.cm, self.mesh)
        self.node_names = tuple(n.name for n in graph.nodes)
        self.node_times, self.node_backward = tuple(times), tuple(back)
        self.launch = clus.step_overhead
        self.fp_comm = extra / (1 + BACKWARD_FACTOR)
        self.bp_comm = extra * BACKWARD_FACTOR / (1 + BACKWARD_FACTOR)
        fp_end = self.launch + self.fp_comm
        for x in times:
            fp_end += x
        t = fp_end + self.bp_comm
        bwd_end = [0.0] * len(times)  # when backward of node i ends
        for i in range(len(times) - 1, -1, -1):
            t += back[i]
            bwd_end[i] = t
        self.fp_end, self.bp_end, self.update = fp_end, t, tail
        first_use: dict[str, int] = {}
        for i, n in enumerate(graph.nodes):
            for v in n.inputs:
                first_use.setdefault(v, i)
        self.ready = np.array([bwd_end[first_use[g.name]] if g.name in first_use else fp_end
                               for g in self.grads])
        self.fp32 = sync_in_fp32(plan, cluster if isinstance(cluster, Setup) else None) \
            if fp32 is None else bool(fp32)
        self.memory_bytes = None if plan is None else float(plan.cost.memory_bytes)
        self.budget_bytes = float(clus.memory_bytes)
        self._prefix_prices(graph)

    def _prefix_prices(self, graph: Any) -> None:
        """Per all-reduce group, prefix sums of the bytes sent (a low-precision gradient's
        in fp32 where :attr:`fp32`) and of the gradients, and the group's alpha-beta
        coefficients."""
        from autopar.strategies.precision import sync_factor

        all_axes = self.mesh.names
        groups: dict[tuple[str, ...], int] = {}
        gid = []
        for g in self.grads:
            axes = all_axes if g.axes is None else g.axes
            gid.append(groups.setdefault(tuple(axes), len(groups)))
        self.groups = sorted(groups, key=lambda a: groups[a])
        n = len(self.grads)
        self.prefix_bytes = np.zeros((len(self.groups), n + 1), dtype=np.int64)
        self.prefix_count = np.zeros((len(self.groups), n + 1), dtype=np.int64)
        for i, (g, k) in enumerate(zip(self.grads, gid)):
            self.prefix_bytes[k, i + 1] = round(g.nbytes * sync_factor(graph.spec(g.name).dtype,
                                                                       self.fp32))
            self.prefix_count[k, i + 1] = 1
        self.prefix_bytes = np.cumsum(self.prefix_bytes, axis=1)
        self.prefix_count = np.cumsum(self.prefix_count, axis=1)
        self.coef = []  # (latency, seconds per byte) of an all-reduce per group
        self.synced = []  # whether the group has anything to sum (a group of one has not)
        for axes in self.groups:
            p, intra = self.cm.group(axes, self.mesh)
            self.synced.append(p > 1)
            self.coef.append(self.cm.alpha_beta("all_reduce", p, intra) if p > 1 else
                             (0.0, 0.0, 0.0, 0.0))

    def price(self, i: int, j: int) -> float:
        """All-reduce seconds of gradients i..j-1 fused in one bucket."""
        return float(self.price_matrix(np.array([i]), np.array([j]))[0, 0])

    def price_matrix(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Prices of buckets i..j-1 for every pair (rows i, columns j); inf where j <= i."""
        i, j = np.asarray(i)[:, None], np.asarray(j)[None, :]
        out = np.zeros(np.broadcast_shapes(i.shape, j.shape))
        for k, (a, b, knee, extra) in enumerate(self.coef):
            nb = (self.prefix_bytes[k][j] - self.prefix_bytes[k][i]).astype(np.float64)
            present = (self.prefix_count[k][j] - self.prefix_count[k][i]) > 0
            t = a + b * nb + extra * np.maximum(0.0, nb - knee)
            out += np.where(present, t, 0.0)
        return np.where(j > i, out, np.inf)

    def ready_of(self, i: int, j: int) -> float:
        """When bucket i..j-1 may start (its last gradient ready, or bp_end without overlap)."""
        return float(self.ready[i:j].max()) if self.overlap else self.bp_end

    def run(self, ends: Sequence[int], source: str) -> IterationTrace:
        """The trace of the buckets ending (exclusive) at ``ends``, issued in order on one
        stream; ``source`` names the bucketing in the trace."""
        segs = []
        prev_end, start_i = 0.0, 0
        for k, e in enumerate(ends):
            ready = self.ready_of(start_i, e)
            start = max(ready, prev_end)
            end = start + self.price(start_i, e)
            nbytes = int(sum(self.prefix_bytes[k, e] - self.prefix_bytes[k, start_i]
                             for k, synced in enumerate(self.synced) if synced))
            segs.append(CommSegment(k, ready, start, end, nbytes, start_i, e - 1))
            prev_end, start_i = end, e
        return IterationTrace(self.cluster, self.device_num, self.overlap, source, 0.0,
                              self.fp_end, self.bp_end, max(self.bp_end, prev_end), tuple(segs),
                              self.node_names, self.node_times,
                              tuple(g.name for g in self.grads), tuple(float(r) for r in
                                                                       self.ready),
                              self.update, self.node_backward, self.launch, self.fp_comm,
                              self.bp_comm, self.memory_bytes, self.budget_bytes)


def _node_times(graph: Any, plan: Any, cm: Any, mesh: Any
                ) -> tuple[list[float], list[float], float, float]:
    """Per node its forward and backward seconds (:func:`operator_time`, the search's rule:
    with a plan its strategy's local blocks, without one the whole tensors), the plan's
    activation communication and redistribution (spread over forward and backward), and the
    optimizer update of the parameters (the end of backward)."""
    from autopar.strategies.cost import BACKWARD_FACTOR
    from autopar.strategies.loops import planned_time
    from autopar.strategies.problem import fused_values, requires_grad

    fused, grad = fused_values(graph), requires_grad(graph)
    fwd, back = [], []
    for n in graph.nodes:  # (a loop: the trip count times its body's operators, as planned)
        t = planned_time(cm, graph, n, plan.nodes.get(n.name) if plan is not None else None,
                         mesh, fused)
        fwd.append(t)
        again = 1.0 if n.remat is not None and not n.remat.saved else 0.0  # (recomputed)
        back.append((BACKWARD_FACTOR + again) * t if any(grad[v] for v in n.inputs) else 0.0)
    extra = 0.0 if plan is None else sum(plan_communication(graph, plan, cm)[:2])
    return fwd, back, extra, update_time(graph, graph.parameters(), plan, cm)


def update_time(graph: Any, params: Any, plan: Any, cm: Any) -> float:
    """Seconds of the optimizer update of ``params`` on one device: each trained one's block
    under the plan's layout, its share only where the plan's parallel optimizer shards it
    (:func:`~autopar.strategies.optimizer_rule.param_shards`; without a plan: whole), its
    state as the plan priced it (the optimizer's own, where the search knew it; else the
    cluster's factor), :meth:`CostModel.update_time
    <autopar.strategies.cost.CostModel.update_time>`. The rule both simulators price the
    update by."""
    from autopar.strategies.optimizer_rule import param_shards
    from autopar.strategies.precision import state_ratio
    from autopar.strategies.problem import requires_grad

    grad = requires_grad(graph)
    states = None if plan is None or plan.pricing.optimizer_state is None else \
        dict(plan.pricing.optimizer_state)

    def share(v: str) -> float:
        spec = graph.spec(v)
        if plan is None:
            return float(spec.nbytes)
        nbytes, ways, _ = param_shards(v, spec.shape, spec.itemsize, plan.layouts[v],
                                       plan.mesh, plan.pricing.parallel_optimizer_kb,
                                       plan.pricing.optimizer_weight_shard_size)
        return nbytes / ways

    return sum(cm.update_time(share(v), state_ratio(states, v)) for v in params
               if grad.get(v, False))


def plan_communication(graph: Any, plan: Any, cm: Any) -> tuple[float, float, float]:
    """``(activation communication, redistribution, gradient sync)`` of ``plan`` on ``cm``'s
    cluster: the plan's own figures when that is the cluster it was priced on, else the plan
    re-priced there as :func:`autopar.load_strategy` re-prices a saved plan (the search's
    problem with every operator fixed to the plan's splits; the same sums, in the same order,
    as :meth:`~autopar.strategies.problem.Problem.evaluate`: a value moved to one layout once),
    so one cluster prices all."""
    own = plan.cluster_config
    if (own == cm.cluster) if own is not None else plan.cluster == cm.cluster.name:
        c = plan.cost
        return c.communication, c.redistribution, c.gradient_sync
    from autopar.strategies.loops import PlannedLoops
    from autopar.strategies.problem import Problem, redistribution_once

    missing = [n.name for n in graph.nodes if n.name not in plan.nodes]
    if missing:
        raise AutoParallelError("plan", f"no strategy for {missing[:3]}", "re-pricing a plan "
                                f"on cluster {cm.cluster.name!r} (it was priced on "
                                f"{plan.cluster!r}) needs a strategy for every operator",
                                "Simulate it on its own cluster (cluster=None)")
    priced = plan.pricing
    problem = Problem(graph, plan.mesh, cm, **priced.problem_args(),
                      fixed_splits={k: ns.splits for k, ns in plan.nodes.items()},
                      loops=PlannedLoops.of(plan))
    comm = sync = 0.0
    for _, vert in problem.iter_ops():  # one choice each: the plan's splits
        comm += vert.comm.item(0)
        sync += vert.grad_sync.item(0)
    verts = problem.vertices
    moves = []
    for e in problem.edges:
        dst = verts[e.v].choices[0].in_layouts[e.in_index]
        src = verts[e.u].choices[0].out_layouts[e.out_index] if verts[e.u].kind == "op" \
            else plan.layouts[e.value]
        moves.append((e.value, dst, problem.edge_cost(e.value, src, dst)))
    return comm, redistribution_once(moves), sync


def bucket_ends(model: IterationModel, buckets: Any) -> tuple[list[int], str]:
    """``(ends, source)`` of ``buckets`` (a :class:`GradientBuckets` or a list of
    :class:`Bucket`): each bucket's end (exclusive) in ``model``'s gradients, checked to hold
    every gradient once, in backward order; and the bucketing's name."""
    names = [g.name for g in model.grads]
    if isinstance(buckets, GradientBuckets):
        seq: Sequence[Bucket] = buckets.buckets
        source = buckets.source
    elif isinstance(buckets, (list, tuple)) and all(isinstance(b, Bucket) for b in buckets):
        seq, source = buckets, "explicit buckets"
    else:
        raise AutoParallelTypeError("buckets", buckets, "None, a policy name ('context', "
                                    "'hccl', 'none'), autopar.simulation.gradient_buckets(...) "
                                    "or a list of autopar.simulation.Bucket")
    flat = [name for b in seq for name in b.gradients]
    if flat != names:
        missing = sorted(set(names) - set(flat))[:3]
        extra = sorted(set(flat) - set(names))[:3]
        raise AutoParallelError(
            "buckets", f"{len(seq)} buckets over {len(flat)} gradients",
            f"the buckets must hold every gradient of the graph exactly once, in backward "
            f"order ({len(names)} gradients; missing {missing}, unknown {extra})",
            "Build them with autopar.simulation.gradient_buckets(graph, plan)")
    ends, acc = [], 0
    for b in seq:
        if len(b.gradients) == 0:
            raise AutoParallelError("buckets", b, "a bucket must hold at least one gradient")
        acc += len(b.gradients)
        ends.append(acc)
    return ends, source


def simulate(graph: Any, plan: Any = None, *, buckets: Any = None,
             cluster: Any = None, device_num: int | None = None,
             overlap: bool | None = None) -> IterationTrace:
    """Simulate one iteration (see the module doc) and return its trace.

    ``buckets``: ``None`` or a policy name (``"context"``, ``"hccl"``, ``"none"``) to build
    them with :func:`autopar.simulation.gradient_buckets`, or buckets you built (their
    boundaries are used; bytes are those of this simulation). ``device_num``: with a plan, the
    plan's; without, the context's unless given. ``cluster``: with a plan, the plan's own unless
    given; on another, everything is priced there (the plan's communication re-priced:
    :func:`plan_communication`). ``overlap``: whether the gradient all-reduces run beside
    backward; ``None``: as the cluster measured
    (:attr:`~autopar.strategies.cost.CostModel.overlaps_communication`).

    The trace records the plan's memory per device and the cluster's budget
    (:attr:`IterationTrace.fits`); over it, an :class:`~autopar.errors.AutoParallelWarning`
    names both (:func:`warn_over_budget`) and the trace is returned all the same.

    The stores (the context as set, unchecked; the HCCL split strategy; the cluster) are read
    once, here (:func:`autopar.setup.resolve_setup`); everything below takes that setup
    (:func:`simulate_setup`), whose context gives ``gradient_fp32_sync`` as it acts where
    no plan does (:func:`sync_in_fp32`).
    """
    from autopar.setup import resolve_setup

    _check_buckets(buckets)
    return simulate_setup(graph, plan, resolve_setup(cluster, check=False), buckets=buckets,
                          device_num=device_num, overlap=overlap)


def _check_buckets(buckets: Any) -> None:
    if isinstance(buckets, str) and buckets not in BUCKET_POLICIES:
        raise AutoParallelError("buckets", buckets, f"a policy name must be one of "
                                f"{list(BUCKET_POLICIES)}", "Or pass None (the context's), "
                                "autopar.simulation.gradient_buckets(...) or a list of Bucket")


def simulate_setup(graph: Any, plan: Any, setup: Any, *, buckets: Any = None,
                   device_num: int | None = None,
                   overlap: bool | None = None) -> IterationTrace:
    """:func:`simulate` on the setup its caller resolved (the CLI's, once per command),
    reading no store; it warns as :func:`simulate` does when the plan is over the budget."""
    _check_buckets(buckets)
    if plan is None and device_num is None:
        device_num = setup.config.device_num
    model = IterationModel(graph, plan, setup, device_num, overlap)  # (fp32: sync_in_fp32)
    if buckets is None or isinstance(buckets, str):
        from autopar.fusion import gradient_buckets

        policy = "context" if buckets is None else buckets
        buckets = gradient_buckets(list(model.grads), policy=policy, resolved=setup.resolved,
                                   split=setup.split if policy != "none" else None)
    ends, source = bucket_ends(model, buckets)
    trace = model.run(ends, source)
    warn_over_budget(trace.memory_bytes, trace.budget_bytes, trace.cluster, "the plan",
                     "a search on this cluster keeps within its budget, or raises a "
                     "MemoryBudgetError naming what would fit")
    return trace


# ---------------------------------------------------------------------------- PNG


def plot_timeline(trace: IterationTrace, path: str | os.PathLike[str], *,
                  title: str | None = None) -> Path:
    """Draw forward / backward on one row and the all-reduce segments on another, with the
    seed's bp_end and Iteration_end marked; write a PNG. Needs matplotlib (the ``plot``
    extra: ``pip install 'autopar[plot]'``); no pyplot global state is touched."""
    if not isinstance(trace, IterationTrace):
        raise AutoParallelTypeError("trace", trace,
                                    "an IterationTrace from autopar.simulation.simulate")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("plot_timeline needs matplotlib: pip install 'autopar[plot]'") \
            from err
    ms = 1e3
    fig = Figure(figsize=(11, 2.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.broken_barh([(trace.fp_start * ms, trace.fp_time * ms)], (1.6, 0.8),
                   facecolors="#4c72b0", label="forward")
    ax.broken_barh([(trace.fp_end * ms, trace.bp_time * ms)], (1.6, 0.8),
                   facecolors="#55a868", label="backward")
    colors = ("#c44e52", "#dd8452")
    for s in trace.segments:
        ax.broken_barh([(s.start * ms, max(s.duration * ms, 1e-6))], (0.2, 0.8),
                       facecolors=colors[s.index % 2], edgecolor="black", linewidth=0.3)
        if len(trace.segments) <= 12:
            ax.text((s.start + s.duration / 2) * ms, 0.6, f"AR{s.index + 1}", ha="center",
                    va="center", fontsize=7)
    ax.axvline(trace.bp_end * ms, color="black", linestyle="--", linewidth=0.8)
    ax.axvline(trace.iteration_end * ms, color="gray", linestyle=":", linewidth=0.8)
    ax.text(trace.bp_end * ms, 2.55, " bp_end", fontsize=7, va="bottom")
    ax.text(trace.iteration_end * ms, 2.55, " Iteration_end", fontsize=7, va="bottom",
            ha="left")
    ax.set_yticks([0.6, 2.0], ["communication", "compute"])
    ax.set_ylim(0, 3.0)
    ax.set_xlabel("ms")
    ax.set_xlim(0, trace.iteration_end * ms * 1.1)
    ax.legend(loc="lower left", fontsize=7)
    ax.set_title(title or f"{trace.iteration_time * ms:.2f} ms iteration, "
                 f"{len(trace.segments)} segment(s), exposed {trace.exposed_comm * ms:.2f} ms",
                 fontsize=9)
    fig.tight_layout()
    import io

    from autopar.files import write_bytes_atomic

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return write_bytes_atomic(path, buf.getvalue())

