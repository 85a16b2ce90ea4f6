"""A loop node in the search: one operator with a few candidates, each a body plan.

A loop node (:mod:`autopar.graph.loops`) is planned once for all its iterations: every
iteration runs the same body plan, as the stacked parameters of ``nn.scan`` share one layout
along the scanned dim, which is never split. To the graph around it the loop is one operator
whose strategies are *candidates*, each the plan of a body search
(:class:`~autopar.strategies.problem.Problem` of the body graph, solved by the same solver,
settings and memory weight as the graph's) priced times the trip count. Every search mode
then plans the graph around the loop as it plans any operator.

**The carry rule.** A carry enters and leaves the body in one layout. A candidate fixes the
layout of each data input of the body -- the carries and the activations passed in -- and
the body is searched with them fixed; the carries leave the body moved back to their
entering layout (priced per iteration). Its split counts, one per dim of those inputs in
order (an ``xs`` slice without its scanned dim), are the candidate's identity: the loop
node's ``splits``. The candidates are

1. every data input replicated;
2. every data input that holds the data batch (dim 0 of the graph's data inputs, followed
   through the operators) split along it as the data inputs are split (the largest divisor
   of ``device_num`` dividing it), the others replicated;
3. for each of those, the body's own: each carry at the layout its body plan makes it in
   (split counts of the carry output, partial sums resolved), the rest as in that
   candidate -- when that differs.

The loop's price is the body plan's times the trip count: compute, communication (the body's
collectives and redistributions, and moving each carry back to its entering layout) and
gradient synchronisation per iteration; memory per device of every iteration's activations
(what backward reads). The body's parameters are views of the stacked (or whole) parameters
outside: their storage, memory and optimizer update are the outer parameter's, and the loop
reads them in the layout its body plan gives each slice, the scanned dim whole. The other
operands and the ``ys`` get the body plan's layouts (``ys``: the scanned dim whole, a partial
sum left to resolve after the loop, once).

A plan's loop node holds its body plan (:attr:`NodeStrategy.body
<autopar.strategies.plan.NodeStrategy>`); :class:`PlannedLoops` re-prices a plan's bodies
without searching (strategy files, the simulators, ``explain``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from autopar.errors import AutoParallelError
from autopar.graph.ir import Graph, Node
from autopar.graph.loops import LOOP_KIND, LoopBody, data_inputs, loop_body, loop_nodes
from autopar.strategies.layout import DeviceMesh, TensorLayout
from autopar.strategies.opspec import legal_splits, tensor_spec
from autopar.strategies.plan import Plan
from autopar.strategies.problem import (BodyInputs, Choice, Problem, fused_values,
                                        operator_time)

__all__ = ["BodySearch", "Candidate", "LoopChoices", "PlannedLoops", "batch_dims",
           "has_loops", "loop_time", "planned_problem", "planned_time"]

Splits = tuple[int, ...]
#: searches a loop body for one candidate: (the loop node, its body's inputs) -> the solved
#: body problem and its picks
BodySearch = Callable[[Node, BodyInputs], tuple[Problem, list[int]]]


@dataclass(frozen=True)
class Candidate:
    """One strategy of a loop node: its choice (the layouts it reads and makes), its price
    (compute, communication, gradient sync, memory: the body's times the trip count), the
    body plan, and per operand the layouts the body's problem offered a parameter operand
    (its slice's, the scanned dim whole: where the outer parameter may be stored)."""

    splits: Splits
    choice: Choice
    costs: tuple[float, float, float, float]
    plan: Plan
    stored: tuple[tuple[TensorLayout, ...], ...] = ()


def batch_dims(problem: Problem) -> dict[str, int]:
    """Per value, the dim that holds the data batch: dim 0 of the graph's data inputs (a
    loop body's: its loop's), followed through each operator's loop nest as
    ``data_parallel_splits`` follows it (kept on the problem)."""
    hit = problem.__dict__.get("_batch_dims")
    if hit is not None:
        return hit
    g = problem.graph
    if problem.body is not None:
        dims = {v: d for v, d in problem.body.batch.items() if d is not None}
    else:
        dims = {v: 0 for v in g.data_inputs() if g.spec(v).rank}
    for node in g.nodes:
        spec = problem.specs[node.name]
        it = next((mp[dims[v]] for v, mp in zip(node.inputs, spec.in_maps)
                   if v in dims and dims[v] < len(mp) and mp[dims[v]] is not None), None)
        if it is None:
            continue
        for v, mp in zip(node.outputs, spec.out_maps):
            if it in mp:
                dims[v] = mp.index(it)
    problem.__dict__["_batch_dims"] = dims
    return dims


def _largest_split(size: int, mesh: DeviceMesh) -> int:
    """The data inputs' rule: the largest divisor of device_num dividing ``size`` that
    the mesh assigns."""
    return max(d for d in range(1, mesh.device_num + 1)
               if legal_splits(tensor_spec((size,)), (d,), mesh))


class LoopChoices:
    """The strategy space of one loop node of ``problem`` (see the module docstring):
    candidates by split counts, each found by ``search`` (or taken from ``plans``, body
    plans known by split counts) the first time it is asked for."""

    def __init__(self, problem: Problem, node: Node, search: BodySearch | None,
                 plans: Mapping[Splits, Plan] | None = None) -> None:
        self.problem, self.node, self.search = problem, node, search
        self.body: LoopBody = loop_body(node)
        self.plans = dict(plans or {})
        self.data = data_inputs(self.body)
        self.found: dict[Splits, Candidate] = {}
        self._candidates: list[Splits] | None = None

    # ------------------------------------------------------------------ inputs
    def ranks(self) -> list[int]:
        g = self.body.graph
        return [g.spec(g.inputs[k]).rank for k in self.data]

    def layouts(self, splits: Splits) -> dict[str, TensorLayout]:
        """The body's data inputs at ``splits`` (canonical axes, each on its own)."""
        g, mesh, out, at = self.body.graph, self.problem.mesh, {}, 0
        if len(splits) != sum(self.ranks()):
            raise AutoParallelError(f"splits of loop node {self.node.name!r}", splits,
                                    f"one split count per dim of its body's data inputs "
                                    f"({sum(self.ranks())})")
        for k in self.data:
            v = g.inputs[k]
            n = g.spec(v).rank
            counts = splits[at:at + n]
            at += n
            if any(s < 1 or d % s for s, d in zip(counts, g.spec(v).shape)):
                raise AutoParallelError(f"splits of loop node {self.node.name!r}", splits,
                                        f"body input {v!r} of shape {g.spec(v).shape} cannot "
                                        f"be split {counts}")
            out[v] = TensorLayout.from_strategy(tuple(counts), mesh)
        return out

    def inputs(self, splits: Splits) -> BodyInputs:
        """The body's inputs at ``splits``: layouts, gradients, batch dims."""
        g, node, body = self.body.graph, self.node, self.body
        outer_grad, outer_batch = self.problem.requires_grad, batch_dims(self.problem)
        trained = bool(g.parameters())
        grads, batch = set(), {}
        for k in self.data:
            v, o = g.inputs[k], node.inputs[k]
            floating = g.spec(v).dtype.startswith(("float", "bfloat", "complex"))
            if floating and (outer_grad.get(o, False) or
                             (body.role(k) == "carry" and trained)):
                grads.add(v)
            d = outer_batch.get(o)
            if body.role(k) == "xs":
                d = None if d is None or d == 0 else d - 1
            batch[v] = d
        return BodyInputs(self.layouts(splits), frozenset(grads), batch)

    # ------------------------------------------------------------------ candidates
    def get(self, splits: Splits) -> Candidate:
        """The candidate at ``splits``: its body plan known, or searched now."""
        splits = tuple(splits)
        hit = self.found.get(splits)
        if hit is None:
            inputs = self.inputs(splits)
            if splits in self.plans:
                bp, picks = planned_problem(self.body.graph, self.plans[splits],
                                            self.problem.cm, body=inputs)
            elif self.search is not None:
                bp, picks = self.search(self.node, inputs)
            else:
                raise AutoParallelError(f"splits of loop node {self.node.name!r}", splits,
                                        "the plan has no body plan at these splits",
                                        f"its planned splits: {sorted(self.plans)}")
            hit = self.found[splits] = self._candidate(splits, bp, picks)
        return hit

    def candidates(self) -> list[Splits]:
        """The candidates' split counts (the module docstring's rule), deduplicated in
        that order; a loop whose body plans are known: theirs."""
        if self._candidates is None:
            if self.search is None:
                self._candidates = sorted(self.plans)
            else:
                base = [self._replicated(), self._batched()]
                out = list(dict.fromkeys(base))
                for s in list(out):
                    own = self._own(s)
                    if own not in out:
                        out.append(own)
                self._candidates = out
        return list(self._candidates)

    def _replicated(self) -> Splits:
        return (1,) * sum(self.ranks())

    def _batched(self) -> Splits:
        """Every data input holding the data batch split along it as data inputs are."""
        g, mesh = self.body.graph, self.problem.mesh
        batch = self.inputs(self._replicated()).batch
        out: list[int] = []
        for k in self.data:
            v = g.inputs[k]
            counts = [1] * g.spec(v).rank
            d = batch.get(v)
            if d is not None:
                counts[d] = _largest_split(g.spec(v).shape[d], mesh)
            out += counts
        return tuple(out)

    def _own(self, splits: Splits) -> Splits:
        """``splits`` with each carry at the split counts its body plan makes it in."""
        g, body, mesh = self.body.graph, self.body, self.problem.mesh
        plan = self.get(splits).plan
        out, at = list(splits), 0
        for k in self.data:
            n = g.spec(g.inputs[k]).rank
            if body.role(k) == "carry":
                made = plan.layouts[g.outputs[k - body.num_consts]]
                counts = TensorLayout(made.dims).split_counts(mesh)
                if mesh.assign(counts) is not None:
                    out[at:at + n] = counts
            at += n
        return tuple(out)

    # ------------------------------------------------------------------ pricing
    def _candidate(self, splits: Splits, bp: Problem, picks: list[int]) -> Candidate:
        """A body problem solved at ``splits`` as a candidate (see the module docstring)."""
        plan = Plan.from_picks(bp, picks, "loop body", 0.0)
        g, body, n = self.body.graph, self.body, self.body.length
        if body.branches:
            return self._branches(splits, bp, picks, plan)
        cost, _ = bp.evaluate(picks)
        carries = 0.0
        for j in range(body.num_carry):
            v, home = g.outputs[j], g.inputs[body.num_consts + j]
            carries += bp.edge_cost(v, plan.layouts[v], plan.layouts[home]) \
                if g.values[v].kind not in ("literal", "const") else 0.0
        costs = (n * (cost.compute - bp.cm.cluster.step_overhead),
                 n * (cost.communication + cost.redistribution + carries),
                 n * cost.gradient_sync, n * cost.memory_bytes)
        outs = [plan.layouts[g.inputs[body.num_consts + j]] for j in range(body.num_carry)]
        for v in g.outputs[body.num_carry:]:
            lay = plan.layouts[v]
            outs.append(TensorLayout(((),) + lay.dims, lay.partial))
        return self._made(splits, bp, plan, costs, outs)

    def _made(self, splits: Splits, bp: Problem, plan: Plan,
              costs: tuple[float, float, float, float], outs: list[TensorLayout]) -> Candidate:
        """The candidate of a body plan priced ``costs`` making ``outs``."""
        g, body = self.body.graph, self.body
        ins = []
        for k, v in enumerate(g.inputs):
            lay = plan.layouts[v]
            ins.append(TensorLayout(((),) + lay.dims) if body.role(k) == "xs" else lay)
        used = frozenset().union(*(lay.used_axes() for lay in (*ins, *outs)))
        choice = Choice(splits, tuple(ins), tuple(outs), used)
        stored = []
        for k, v in enumerate(g.inputs):
            i = bp.index.get(f"<param>{v}")
            lays = [] if i is None else [c.out_layouts[0] for c in bp.vertices[i].choices]
            stored.append(tuple(TensorLayout(((),) + lay.dims) if body.role(k) == "xs" else lay
                                for lay in lays))
        return Candidate(splits, choice, costs, plan, tuple(stored))

    def _branches(self, splits: Splits, bp: Problem, picks: list[int],
                  plan: Plan) -> Candidate:
        """A ``cond``'s candidate: every branch planned (one body problem), each output
        made in branch 0's layout (a partial sum resolved; the other branches' moved
        there), priced as the dearer branch: its operators, its moves and the operands'."""
        g, body, verts = self.body.graph, self.body, bp.vertices
        outs = [TensorLayout(plan.layouts[v].dims) if v in plan.layouts else
                TensorLayout.replicated(g.spec(v).rank) for v in body.branches[0][1]]
        own = {name: i for i, (names, _) in enumerate(body.branches) for name in names}
        step = bp.cm.cluster.step_overhead
        best: tuple[float, tuple[float, float, float, float]] | None = None
        for i, (_, results) in enumerate(body.branches):
            keep = {j for j, vert in enumerate(verts)
                    if vert.node is None or own.get(vert.node.name, i) == i}
            c = [sum(getattr(verts[j], a).item(picks[j]) for j in keep)
                 for a in ("compute", "comm", "grad_sync", "memory")]
            c[1] += sum(x for e in bp.edges if e.v in keep
                        and (x := bp.pair_cost(e, picks[e.u], picks[e.v])))
            c[1] += sum(bp.edge_cost(v, plan.layouts[v], lay) for v, lay in zip(results, outs)
                        if v in plan.layouts and g.values[v].kind not in ("literal", "const"))
            total = c[0] + c[1] + bp.once_per_step(c[2])
            if best is None or total > best[0]:
                best = (total, (c[0], c[1], c[2], c[3]))
        assert best is not None
        return self._made(splits, bp, plan, best[1], list(outs))

    def stored_layouts(self, k: int) -> tuple[TensorLayout, ...]:
        """The layouts the outer parameter read as operand ``k`` may be stored in: those the
        body problems of the candidates found so far offered its slice (a parameter may be
        stored more finely split than the loop reads it, gathered once before the loop)."""
        return tuple(dict.fromkeys(lay for c in self.found.values() for lay in c.stored[k]))


class PlannedLoops:
    """The loop planner of a problem re-pricing a plan: each loop node's candidate is its
    body plan there (nothing searched). ``bodies``: loop node -> (splits, body plan); a body
    plan needs only its operators' splits, nested bodies and parameters' layouts (a strategy
    file's), the rest is re-priced."""

    def __init__(self, bodies: Mapping[str, tuple[Splits, Plan]]) -> None:
        self.bodies = dict(bodies)

    @classmethod
    def of(cls, plan: Plan) -> "PlannedLoops":
        """The body plans of ``plan``'s loop nodes."""
        return cls({k: (ns.splits, ns.body) for k, ns in plan.nodes.items()
                    if ns.body is not None})

    def choices(self, problem: Problem, node: Node) -> LoopChoices:
        hit = self.bodies.get(node.name)
        return LoopChoices(problem, node, None, {hit[0]: hit[1]} if hit else {})


def planned_problem(graph: Graph, plan: Plan, cm: Any, *, body: BodyInputs | None = None,
                    dataset_strategy: Any = "data_parallel"
                    ) -> tuple[Problem, list[int]]:
    """The problem of ``graph`` with every operator at ``plan``'s splits (loop bodies at
    its body plans) and the picks of its inputs' layouts: the plan re-priced on ``cm``."""
    problem = Problem(graph, plan.mesh, cm, dataset_strategy=dataset_strategy,
                      fixed_splits={k: ns.splits for k, ns in plan.nodes.items()},
                      **plan.pricing.problem_args(), loops=PlannedLoops.of(plan), body=body)
    picks = [0] * len(problem.vertices)
    for i, vert in enumerate(problem.vertices):
        if vert.kind != "param" or vert.value not in plan.layouts:
            continue
        lay = plan.layouts[vert.value]
        layouts = [c.out_layouts[0] for c in vert.choices]
        if lay not in layouts:
            problem.widen_param(vert.value, [lay])
            layouts = [c.out_layouts[0] for c in problem.vertices[i].choices]
        picks[i] = layouts.index(lay)
    return problem, picks


def has_loops(graph: Graph) -> bool:
    """Whether ``graph`` holds a loop node."""
    return bool(loop_nodes(graph))


def loop_time(cm: Any, node: Node, plan: Plan | None, mesh: DeviceMesh) -> float:
    """Forward seconds of loop ``node`` on one device: the trip count times each operator
    of its body priced by :func:`planned_time` under the body plan ``plan`` (None: whole
    tensors) -- the simulators' rule for a loop."""
    g = loop_body(node).graph
    fused = fused_values(g)
    return loop_body(node).length * sum(
        planned_time(cm, g, n, plan.nodes.get(n.name) if plan is not None else None, mesh,
                     fused) for n in g.nodes)


def planned_time(cm: Any, graph: Graph, n: Node, ns: Any, mesh: DeviceMesh,
                 fused: frozenset[str]) -> float:
    """Forward seconds of operator ``n`` of ``graph`` on one device under its plan entry
    ``ns`` (None: whole tensors), as :func:`~autopar.strategies.problem.operator_time`
    prices it; a loop node by :func:`loop_time`. The simulators' one rule per operator."""
    if n.kind == LOOP_KIND:
        return loop_time(cm, n, ns.body if ns is not None else None, mesh)
    if ns is None:
        rep = [TensorLayout.replicated(graph.spec(v).rank) for v in (*n.inputs, *n.outputs)]
        return operator_time(cm, graph, n, (1,), rep[:len(n.inputs)], rep[len(n.inputs):],
                             mesh, fused)
    return operator_time(cm, graph, n, ns.splits, ns.in_layouts, ns.out_layouts, mesh, fused)
