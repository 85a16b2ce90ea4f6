"""Pipeline stages: cut a traced graph into ``p`` consecutive stages (Alpa's inter-op pass).

The graph's operators are first grouped into **units**: maximal runs of consecutive nodes
with the same top-level named scope (``embed``, ``block0``, ``block1``, ..., ``head``,
``loss`` in the zoo transformer). Stages are cut only between units, so a boundary falls
between layers, where few activations cross (the residual stream), never inside attention.

**Search** (``boundaries=None``): Alpa's inter-op objective. With ``m`` micro-batches a
pipelined step takes about ``sum_s (compute_s + send_s) + (m - 1) * max_s compute_s`` (the
first term is one micro-batch's trip through every stage, the fill and drain of the
pipeline; the second is the steady state, paced by the slowest stage), where

- ``compute_s``: the roofline time (:class:`~autopar.strategies.cost.CostModel`) of the
  stage's operators, forward + backward (2x) + the forward recomputed in backward (the
  pipelined step rematerialises each stage, see docs/pipeline.md), with the work divided
  over the stage's ``device_num / p`` devices;
- ``send_s``: the point-to-point (``collective_permute``) time of the activations crossing
  the stage's outgoing boundary and of their gradients coming back: ``alpha + bytes / B``
  per device, on the inter-node link when a stage fills a node or more.

The cuts minimising it are found exactly: for each candidate bottleneck (ascending) a
dynamic programme over (units placed, stages used) finds the least total send with every
stage under it, as Alpa's stage-construction DP enumerates ``t_max``.

**Fixed** (``boundaries=[...]``): the ``p - 1`` unit names (or unit indices) where stages
``1 .. p-1`` begin, e.g. ``["block1"]`` for two stages of the 2-layer transformer.

>>> import jax, autopar as ap
>>> from autopar.models import transformer
>>> m = transformer(layers=4, hidden=32, heads=2, seq=8, vocab=64, batch=4)
>>> g = ap.trace(m.loss, *m.example_args(jax.random.key(0)))
>>> part = partition_stages(g, 2, device_num=8, cluster=ap.CLUSTERS["accelerator-8x"])
>>> [u.name for u in part.units][:3]
['embed', 'block0', 'block1']
>>> part.first_units()
('embed', 'block2')
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.graph.ir import Graph, Value
from autopar.limits import MAX_MICRO_BATCHES
from autopar.graph.loops import loop_body, loop_nodes
from autopar.strategies.cost import BACKWARD_FACTOR, Cluster, CostModel
from autopar.strategies.precision import compute_dtype

__all__ = ["Unit", "StagePartition", "stage_units", "partition_stages", "stage_graph",
           "send_time"]


@dataclass(frozen=True, slots=True)
class Unit:
    """A run of consecutive nodes with the same top-level scope: the atom of a stage cut."""

    index: int
    name: str               # the scope ('' for unscoped nodes), made unique with '#k'
    start: int              # first node index (in graph order)
    stop: int               # one past the last
    seconds: float          # forward + backward + recompute, per device of a stage


@dataclass(frozen=True)
class StagePartition:
    """``p`` stages of a graph: which nodes each runs and what crosses each boundary."""

    stages: int
    device_num: int                         # all devices; each stage has device_num / stages
    units: tuple[Unit, ...]
    cuts: tuple[int, ...]                   # unit index where stage 1 .. p-1 begins
    stage_nodes: tuple[tuple[str, ...], ...]
    crossing: tuple[tuple[str, ...], ...]   # per boundary b (stage b -> b+1): value names
    crossing_bytes: tuple[int, ...]         # per boundary, per micro-batch (global bytes)
    stage_seconds: tuple[float, ...]        # compute per stage (fwd + bwd + recompute)
    send_seconds: tuple[float, ...]         # per boundary: activations + their gradients
    source: str                             # "search" or "user"
    cluster: str

    @property
    def devices_per_stage(self) -> int:
        return self.device_num // self.stages

    @property
    def bottleneck(self) -> float:
        """The slowest stage's seconds per micro-batch, including its outgoing send (one
        term of the search objective, not the objective itself)."""
        return max(self._stage_total(s) for s in range(self.stages))

    def _stage_total(self, s: int) -> float:
        return self.stage_seconds[s] + (self.send_seconds[s] if s < self.stages - 1 else 0.0)

    def first_units(self) -> tuple[str, ...]:
        """The name of each stage's first unit."""
        return tuple(self.units[i].name for i in (0,) + self.cuts)

    def stage_of(self, node: str) -> int:
        for s, names in enumerate(self.stage_nodes):
            if node in names:
                return s
        raise AutoParallelError("node", node, "not a node of this partition")

    def summary(self) -> str:
        lines = [f"{self.stages} pipeline stages on {self.device_num} devices "
                 f"({self.devices_per_stage} per stage, cluster {self.cluster}, boundaries "
                 f"from {self.source}):"]
        bounds = (0,) + self.cuts + (len(self.units),)
        for s in range(self.stages):
            us = self.units[bounds[s]:bounds[s + 1]]
            span = us[0].name if len(us) == 1 else f"{us[0].name} .. {us[-1].name}"
            send = (f", sends {len(self.crossing[s])} tensor(s) "
                    f"{self.crossing_bytes[s] / 2**10:.1f} KiB in "
                    f"{self.send_seconds[s] * 1e6:.1f} us") if s < self.stages - 1 else ""
            lines.append(f"  stage {s}: {span} ({len(self.stage_nodes[s])} nodes, "
                         f"{self.stage_seconds[s] * 1e3:.4f} ms per micro-batch{send})")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- units


def stage_units(graph: Graph, cm: CostModel | None = None, devices: int = 1) -> tuple[Unit, ...]:
    """The graph's units (see the module docstring), with their compute seconds on
    ``devices`` devices (forward + backward + recomputed forward); ``cm``: the cost model
    (default: the ``accelerator-8x`` preset, for listing units without a cluster)."""
    from autopar.strategies.cost import CLUSTERS

    cm = cm or CostModel(CLUSTERS["accelerator-8x"])
    units: list[Unit] = []
    seen: dict[str, int] = {}
    start = 0
    nodes = graph.nodes
    for i in range(1, len(nodes) + 1):
        top = nodes[start].scope.split("/")[0]
        if i < len(nodes) and nodes[i].scope.split("/")[0] == top:
            continue
        k = seen.get(top, 0)
        seen[top] = k + 1
        name = top if k == 0 else f"{top}#{k}"
        sec = (2.0 + BACKWARD_FACTOR) * sum(cm.compute_time(
            n.flops / devices, (n.bytes_read + n.bytes_written) / devices,
            dtype=compute_dtype(graph, n)) for n in nodes[start:i])
        units.append(Unit(len(units), name, start, i, sec))
        start = i
    return tuple(units)


def send_time(nbytes: float, cm: CostModel, devices_per_stage: int) -> float:
    """One ``collective_permute`` of a boundary: each of the stage's devices sends its share
    (``nbytes / devices_per_stage``, the batch dim being split inside a stage) to its peer in
    the next stage, on the inter-node link when a stage fills a node or more."""
    if nbytes <= 0:
        return 0.0
    return cm.collective_time("collective_permute", nbytes / devices_per_stage, 2,
                              intra=cm.intra_node(devices_per_stage + 1))


def _crossing(graph: Graph, units: Sequence[Unit]) -> list[tuple[list[str], int]]:
    """Per cut position c (between unit c-1 and unit c, c = 1 .. U-1): the activations made
    before it and read (or returned) after it, and their bytes."""
    n_units = len(units)
    unit_of_node = {}
    for u in units:
        for i in range(u.start, u.stop):
            unit_of_node[graph.nodes[i].name] = u.index
    last_use: dict[str, int] = {}
    for n in graph.nodes:
        for v in n.inputs:
            if graph.values[v].kind == "activation":
                last_use[v] = max(last_use.get(v, -1), unit_of_node[n.name])
    for v in graph.outputs:
        last_use[v] = n_units  # returned: crosses every later cut
    pos = {v: i for i, v in enumerate(graph.values)}
    out: list[tuple[list[str], int]] = [([], 0)]
    for c in range(1, n_units):
        names = [v for v, last in last_use.items()
                 if last >= c and graph.values[v].producer is not None
                 and unit_of_node[graph.values[v].producer] < c]
        names.sort(key=pos.__getitem__)
        out.append((names, sum(graph.values[v].spec.nbytes for v in names)))
    return out


# ---------------------------------------------------------------------------- the search


def check_stages(stages: Any, device_num: int) -> int:
    """``stages``, checked: an int >= 1 dividing ``device_num`` (the one rule)."""
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise AutoParallelTypeError("pipeline_stages", stages, "must be an int")
    if stages < 1:
        raise AutoParallelError("pipeline_stages", stages, "must be >= 1")
    if device_num % stages:
        raise AutoParallelError("pipeline_stages", stages, f"must divide device_num "
                                f"({device_num})", "Choose pipeline_stages dividing device_num")
    return stages


def _user_cuts(boundaries: Any, units: Sequence[Unit], stages: int) -> tuple[int, ...]:
    if isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, (list, tuple)):
        raise AutoParallelTypeError("boundaries", boundaries, "a list of the unit names "
                                    "(top-level scopes) or unit indices where stages 1..p-1 "
                                    "begin")
    if len(boundaries) != stages - 1:
        raise AutoParallelError("boundaries", list(boundaries), f"{stages} stages need "
                                f"{stages - 1} boundaries, got {len(boundaries)}")
    names = [u.name for u in units]
    cuts = []
    for b in boundaries:
        if isinstance(b, str):
            if b not in names:
                raise AutoParallelError("boundaries", b, f"not a unit of the graph; units are "
                                        f"{names}")
            cuts.append(names.index(b))
        elif isinstance(b, int) and not isinstance(b, bool):
            if not 0 < b < len(units):
                raise AutoParallelError("boundaries", b, f"a unit index must be in "
                                        f"[1, {len(units) - 1}]")
            cuts.append(b)
        else:
            raise AutoParallelTypeError("boundaries", b, "each boundary is a unit name or index")
    if any(b <= a for a, b in zip([0] + cuts, cuts)):
        raise AutoParallelError("boundaries", list(boundaries), "must be strictly increasing "
                                "and after the first unit (every stage non-empty)")
    return tuple(cuts)


def _search_cuts(units: Sequence[Unit], sends: Sequence[float], stages: int,
                 micro_batches: int) -> tuple[int, ...]:
    """Alpa's inter-op objective for ``m`` micro-batches: minimise
    ``sum_s (compute_s + send_s) + (m - 1) * max_s compute_s``. The compute sum is the same
    for every cut, so for each candidate bottleneck ``t`` (a stage's compute, ascending) a
    dynamic programme finds the cuts of least total send with every stage's compute <= t;
    the enumeration stops once ``(m - 1) * t`` alone exceeds the best step found."""
    n = len(units)
    prefix = np.concatenate([[0.0], np.cumsum([u.seconds for u in units])])
    send = np.asarray(list(sends[:n]) + [0.0])
    total = float(prefix[-1])
    low = max(total / stages, max(u.seconds for u in units)) * (1 - 1e-12)
    cands = sorted({float(prefix[j] - prefix[i]) for i in range(n) for j in range(i + 1, n + 1)
                    if prefix[j] - prefix[i] >= low})
    # ties (equal sends) go to the most balanced cut: + lam * sum_s compute_s^2, too small
    # to outweigh a millionth of one send
    positive = send[send > 0]
    lam = (1e-6 * float(positive.min()) if positive.size else 1.0) / max(total, 1e-30) ** 2
    best_cost, best_cuts = math.inf, tuple(range(1, stages))
    for t in cands:
        if total + (micro_batches - 1) * t >= best_cost:
            break
        # cost[k][j]: least send of the first j units in k stages, each compute <= t
        cost = np.full((stages + 1, n + 1), math.inf)
        arg = np.full((stages + 1, n + 1), -1, dtype=np.int64)
        cost[0][0] = 0.0
        for k in range(1, stages + 1):
            for j in range(k, n - (stages - k) + 1):
                i = np.arange(k - 1, j)
                ok = prefix[j] - prefix[i] <= t * (1 + 1e-12)
                if not ok.any():
                    continue
                c = np.where(ok, cost[k - 1][i] + lam * (prefix[j] - prefix[i]) ** 2, math.inf)
                a = int(np.argmin(c))
                if c[a] < math.inf:
                    cost[k][j] = c[a] + (send[j] if j < n else 0.0)
                    arg[k][j] = i[a]
        if cost[stages][n] == math.inf:
            continue
        cuts, j = [], n
        for k in range(stages, 0, -1):
            j = int(arg[k][j])
            cuts.append(j)
        cut = tuple(sorted(cuts)[1:])
        bounds = (0,) + cut + (n,)
        slowest = max(prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:]))
        step = total + float(cost[stages][n]) + (micro_batches - 1) * float(slowest)
        if step < best_cost:
            best_cost, best_cuts = step, cut
    return best_cuts


def _refuse_loops(graph: Graph) -> None:
    """A loop node is one lax.scan: its iterations cannot be cut into pipeline stages."""
    loops = loop_nodes(graph)
    if loops:
        n = loops[0]
        raise AutoParallelError(
            "loop node", n.name, f"a loop ({n.op} at {n.source}, {loop_body(n).length} "
            "iterations) runs as one lax.scan and cannot be cut into pipeline stages",
            "Unroll it with a Python for loop to pipeline its iterations, or set "
            "pipeline_stages=1")


def partition_stages(graph: Graph, stages: int, *, device_num: int, cluster: Cluster,
                     boundaries: Sequence[str | int] | None = None,
                     micro_batches: int | None = None) -> StagePartition:
    """Cut ``graph`` into ``stages`` pipeline stages of ``device_num / stages`` devices each,
    priced on ``cluster`` (see the module docstring; :func:`autopar.pipeline.partition_stages`
    is the entry point that takes both from the context). ``boundaries``: fix the cuts instead of
    searching them. ``micro_batches``: ``m`` of the objective (default ``stages``).
    """
    if not isinstance(graph, Graph):
        raise AutoParallelTypeError("graph", graph, "an autopar.Graph from autopar.trace")
    if isinstance(device_num, bool) or not isinstance(device_num, int) or device_num < 1:
        raise AutoParallelError("device_num", device_num, "must be an int >= 1")
    if not isinstance(cluster, Cluster):
        raise AutoParallelTypeError("cluster", cluster, "an autopar.Cluster (resolved)")
    stages = check_stages(stages, device_num)
    if stages > 1:
        _refuse_loops(graph)
    clus = cluster
    cm = CostModel(clus)
    per_stage = device_num // stages
    units = stage_units(graph, cm, per_stage)
    if len(units) < stages:
        raise AutoParallelError("pipeline_stages", stages, f"the graph has only {len(units)} "
                                f"units (top-level named scopes: {[u.name for u in units]}) "
                                f"to cut into {stages} stages",
                                "Wrap layers in jax.named_scope or use fewer stages")
    cross = _crossing(graph, units)
    sends = [2.0 * send_time(b, cm, per_stage) for _, b in cross] + [0.0]
    if boundaries is None:
        m = stages if micro_batches is None else micro_batches
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= MAX_MICRO_BATCHES:
            raise AutoParallelError("micro_batches", m, f"must be an int in [1, "
                                    f"{MAX_MICRO_BATCHES}]")
        cuts, source = _search_cuts(units, sends, stages, m), "search"
    else:
        cuts, source = _user_cuts(boundaries, units, stages), "user"
    bounds = (0,) + cuts + (len(units),)
    stage_nodes, secs = [], []
    for s in range(stages):
        us = units[bounds[s]:bounds[s + 1]]
        stage_nodes.append(tuple(n.name for n in graph.nodes[us[0].start:us[-1].stop]))
        secs.append(sum(u.seconds for u in us))
    _check_params(graph, stage_nodes)
    return StagePartition(stages, device_num, units, cuts, tuple(stage_nodes),
                          tuple(tuple(cross[c][0]) for c in cuts),
                          tuple(cross[c][1] for c in cuts), tuple(secs),
                          tuple(sends[c] for c in cuts), source, clus.name)


def _check_params(graph: Graph, stage_nodes: Sequence[tuple[str, ...]]) -> None:
    owner: dict[str, int] = {}
    for s, names in enumerate(stage_nodes):
        for name in names:
            for v in graph.node(name).inputs:
                if graph.values[v].kind == "param" and owner.setdefault(v, s) != s:
                    raise AutoParallelError(
                        "boundaries", f"parameter {v!r}", f"is used by stages {owner[v]} and "
                        f"{s}; a parameter shared across pipeline stages (e.g. tied "
                        "embeddings) is not supported", "Choose boundaries that keep every "
                        "use of a parameter in one stage, or untie the weights")


# ---------------------------------------------------------------------------- stage graphs


def stage_graph(graph: Graph, part: StagePartition, s: int) -> Graph:
    """Stage ``s`` as a graph of its own: inputs are its parameters, the batch inputs it reads
    and the activations it receives (as data inputs, batch dim 0); outputs are the
    activations it produces for later stages (the loss for the last stage). Activations that
    only pass through the stage are not part of it (the pipeline forwards them)."""
    names = part.stage_nodes[s]
    nodes = [graph.node(n) for n in names]
    produced = {v for n in nodes for v in n.outputs}
    used = [v for n in nodes for v in n.inputs]
    values: dict[str, Value] = {}
    params, data, recv = [], [], []
    for v in dict.fromkeys(used):
        val = graph.values[v]
        if v in produced:
            continue
        if val.kind == "param":
            params.append(v)
        elif val.kind == "data":
            data.append(v)
        elif val.kind == "activation":
            recv.append(v)
            val = Value(v, val.spec, "data")
        values[v] = val
    for n in nodes:
        for v in n.outputs:
            values[v] = graph.values[v]
    order = list(graph.values)
    pos = {v: i for i, v in enumerate(order)}
    params.sort(key=pos.__getitem__)
    data.sort(key=pos.__getitem__)
    recv.sort(key=pos.__getitem__)
    later = set(part.crossing[s]) if s < part.stages - 1 else set(graph.outputs)
    outputs = [v for v in order if v in later and v in produced]
    names = {n.name for n in nodes} | set(params)
    return Graph(nodes, values, params + data + recv, outputs, name=f"{graph.name}/stage{s}",
                 layout_devices={k: d for k, d in graph.layout_devices.items() if k in names})
