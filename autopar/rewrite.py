"""``rewrite(graph, plan)``: insert the communication a plan needs, give every value its layout.

Walks the graph's nodes in order. Each input of a node is read in the layout the node's
strategy needs (``plan.nodes[node].in_layouts[j]``); when the value lives in another layout
(its producer's output layout, the placement of a parameter or data input, or replicated for
literals and constants), the redistribution table's steps become explicit communication nodes,
one per :class:`~autopar.strategies.redistribution.Step`; the layout after each step is its
kind's effect (:func:`~autopar.strategies.redistribution.apply_step_to_layout`). A value
redistributed to the same layout twice is redistributed once (later consumers reuse the
result). Graph outputs with a pending partial sum are all-reduced; splits of outputs are kept
(the caller receives a sharded global array).

>>> import jax.numpy as jnp, autopar
>>> g = autopar.trace(lambda w, x: jnp.sum(x @ w), jnp.ones((8, 4)), jnp.ones((2, 8)))
>>> plan = autopar.search(g, mode="dynamic_programming", device_num=2,
...                       parallel_mode="auto_parallel")
>>> pg = rewrite(g, plan)
>>> sum(pg.comm_counts().values()) >= 1       # the partial sum of the result is resolved
True
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Sequence

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.graph.ir import Graph, Node
from autopar.graph.loops import LOOP_KIND, loop_body
from autopar.kernel_rules import FusedKernels, check_fused_kernels, fuse_kernels
from autopar.parallel_graph import PNode, PValue, ParallelGraph
from autopar.strategies.layout import DeviceMesh, TensorLayout
from autopar.strategies.opspec import tensor_spec
from autopar.strategies.plan import Plan
from autopar.strategies.redistribution import apply_step_to_layout, redistribute

__all__ = ["rewrite", "apply_step_to_layout"]


def _check_local(name: str, shape: tuple[int, ...], layout: TensorLayout, mesh: DeviceMesh) -> None:
    if layout.rank != len(shape):
        raise AutoParallelError("layout", str(layout), f"value {name!r} has rank {len(shape)}, "
                                f"its layout has rank {layout.rank}")
    whole = tensor_spec(shape)
    for d, (n, axes) in enumerate(zip(shape, layout.dims)):
        unknown = [a for a in axes if a not in mesh.sizes]
        if unknown:
            raise AutoParallelError("layout", str(layout), f"value {name!r}: mesh axes "
                                    f"{unknown} are not in the mesh {mesh}")
        parts = mesh.size_of(axes)
        if not whole.allows(d, parts):
            raise AutoParallelError(
                "layout", str(layout), f"value {name!r}: dim {d} of size {n} cannot be split "
                f"into {parts} equal parts", "Choose a strategy whose splits divide the dims")


class _Rewriter:
    def __init__(self, graph: Graph, plan: Plan, enable_alltoall: bool) -> None:
        self.g, self.plan, self.mesh = graph, plan, plan.mesh
        self.enable_alltoall = enable_alltoall
        self.nodes: list[PNode] = []
        self.values: dict[str, PValue] = {}
        self.home: dict[str, str] = {}                 # graph value -> its own PValue name
        self.avail: dict[tuple[str, TensorLayout], str] = {}  # (graph value, layout) -> PValue name
        self.counters: dict[str, int] = {}

    def add_value(self, name: str, origin: str, layout: TensorLayout, kind: str,
                  data: Any = None) -> str:
        spec = self.g.spec(origin)
        _check_local(name, spec.shape, layout, self.mesh)
        self.values[name] = PValue(name, spec, layout, layout.local_shape(spec.shape, self.mesh),
                                   kind, origin, data)
        self.avail[(origin, layout)] = name
        return name

    def source_value(self, v: str) -> str:
        """The PValue of a graph value in its home layout (created on first use for constants)."""
        if v in self.home:
            return self.home[v]
        val = self.g.values[v]
        if val.kind not in ("literal", "const"):
            raise AutoParallelError("value", v, "is read before it is produced (the graph is "
                                    "not in topological order)")
        rank = val.spec.rank
        self.home[v] = self.add_value(v, v, TensorLayout.replicated(rank), val.kind, val.data)
        return self.home[v]

    def read(self, v: str, dst: TensorLayout, consumer: str) -> str:
        """The name of a PValue holding graph value ``v`` in layout ``dst``."""
        src_name = self.source_value(v)
        hit = self.avail.get((v, dst))
        if hit is not None:
            return hit
        src = self.values[src_name].layout
        spec = self.g.spec(v)
        try:
            steps = redistribute(spec.shape, spec.itemsize, src, dst, self.mesh,
                                 self.enable_alltoall)
        except AutoParallelError as e:
            raise AutoParallelError(f"cannot redistribute value {v!r} from {src} to {dst} for "
                                    f"node {consumer!r}: {e}") from None
        cur, cur_name = src, src_name
        for step in steps:
            cur = apply_step_to_layout(cur, step)
            hit = self.avail.get((v, cur))
            if hit is not None:  # an earlier consumer already made this intermediate layout
                cur_name = hit
                continue
            k = self.counters.get(step.kind, 0)
            self.counters[step.kind] = k + 1
            name = f"{step.kind}_{k}"
            while name in self.g.values or name in self.values:
                name += "'"
            out = self.add_value(name, v, cur, "comm")
            note = f"{v}: {self.values[cur_name].layout} -> {cur} for {consumer}"
            self.nodes.append(PNode(name, step.kind, "comm", (cur_name,), (out,), {},
                                    step=step, note=note))
            cur_name = out
        if cur != dst:  # pragma: no cover - the redistribution table guarantees this
            raise AutoParallelError("layout", f"{src} -> {dst}", f"the steps of value {v!r} end "
                                    f"in {cur}")
        return cur_name

    def run(self, out_layouts: Sequence[TensorLayout] | None = None) -> ParallelGraph:
        """The program; ``out_layouts``: the graph's outputs end in these layouts (a loop
        body's), else as made, partial sums resolved."""
        g, plan = self.g, self.plan
        for v in g.inputs:
            lay = plan.layouts.get(v, TensorLayout.replicated(g.spec(v).rank))
            if lay.partial:
                raise AutoParallelError("layout", str(lay), f"input {v!r} cannot be placed as a "
                                        f"partial sum")
            self.home[v] = self.add_value(v, v, lay, g.values[v].kind)
        for node in g.nodes:
            ns = plan.nodes.get(node.name)
            if ns is None:
                raise AutoParallelError("node", node.name, "the plan has no strategy for this "
                                        "node (plan and graph do not match)",
                                        "Search the plan on this graph")
            if len(ns.in_layouts) != len(node.inputs) or \
                    len(ns.out_layouts) != len(node.outputs):
                raise AutoParallelError("node", node.name, "the plan's layouts do not match "
                                        "the node's inputs and outputs")
            if node.kind == LOOP_KIND and node.op == "cond":
                _check_predicate(node, ns.in_layouts[0])
            ins = tuple(self.read(v, lay, node.name) for v, lay in zip(node.inputs,
                                                                       ns.in_layouts))
            for v, lay in zip(node.outputs, ns.out_layouts):
                if plan.layouts.get(v, lay) != lay:
                    raise AutoParallelError("layout", str(plan.layouts[v]), f"the plan gives "
                                            f"value {v!r} another layout than its producer's "
                                            f"output layout {lay}")
                self.home[v] = self.add_value(v, v, lay, "activation")
            params = dict(node.params)
            if node.kind == LOOP_KIND and node.op == "cond":  # one program per branch
                params["programs"] = _rewrite_branches(node, ns, self.enable_alltoall)
                params["program"] = params["programs"][0]
            elif node.kind == LOOP_KIND:  # the per-iteration program, under the body plan
                params["program"] = _rewrite_body(node, ns.body, self.enable_alltoall)
            self.nodes.append(PNode(node.name, node.op, node.kind, ins, node.outputs,
                                    params, node.primitive, strategy=ns.strategy,
                                    source=node.source, remat=node.remat))
        outs = []
        for k, v in enumerate(g.outputs):
            if out_layouts is not None:
                outs.append(self.read(v, out_layouts[k], "<output>"))
                continue
            lay = self.values[self.source_value(v)].layout
            outs.append(self.read(v, TensorLayout(lay.dims), "<output>") if lay.partial
                        else self.home[v])
        return ParallelGraph(g.name, self.mesh, tuple(self.nodes), MappingProxyType(self.values),
                             g.inputs, tuple(outs), g, plan, g.in_tree, g.out_tree)


def _rewrite_body(node: Node, plan: Plan | None, enable_alltoall: bool) -> ParallelGraph:
    """A loop node's body under its body plan: the program of one iteration. Its carries
    leave it in the layouts they enter it in; its per-iteration results as made (a partial
    sum is resolved after the loop, once, on the stacked result)."""
    if plan is None:
        raise AutoParallelError("node", node.name, "the plan has no body plan for this loop "
                                "node (plan and graph do not match)",
                                "Search the plan on this graph")
    body = loop_body(node)
    g = body.graph
    outs = [plan.layouts[g.inputs[body.num_consts + j]] for j in range(body.num_carry)]
    outs += [plan.layouts[v] for v in g.outputs[body.num_carry:]]
    return _Rewriter(g, plan, enable_alltoall).run(outs)


def _check_predicate(node: Node, index: TensorLayout) -> None:
    """A ``cond``'s predicate (its branch index) is read replicated: every device takes the
    same branch (the collectives inside a branch need every member of their group)."""
    if index.partial or index.used_axes():
        raise AutoParallelError(f"layout of the predicate of cond node {node.name!r} (at "
                                f"{node.source})", str(index), "a cond's predicate (branch "
                                "index) must be replicated: the same on every device",
                                "Do not fix a split or partial layout for it")


def _rewrite_branches(node: Node, ns: Any, enable_alltoall: bool
                      ) -> tuple[ParallelGraph, ...]:
    """A ``cond`` node's branches under its body plan: one program each, every branch
    making its results in the node's output layouts (the same local shapes, as
    ``lax.switch`` needs). Its index must be the same on every device."""
    if ns.body is None:
        raise AutoParallelError("node", node.name, "the plan has no body plan for this cond "
                                "node (plan and graph do not match)",
                                "Search the plan on this graph")
    body = loop_body(node)
    return tuple(_Rewriter(body.branch(i), ns.body, enable_alltoall).run(ns.out_layouts)
                 for i in range(len(body.branches)))


def rewrite(graph: Graph, plan: Plan, *, fused_kernels: FusedKernels = "auto",
            cluster: Any = None) -> ParallelGraph:
    """The parallel program of ``graph`` under ``plan`` (see the module docstring).

    Redistributions use the table the plan was priced with
    (``plan.pricing.enable_alltoall``: AlltoAll rather than AllGather + slice for moving a
    split between dims).

    ``fused_kernels``: replace a matmul whose partial output is reduce-scattered by
    ``autopar.kernels.mm_reduce_scatter`` and an all-gather feeding a matmul by
    ``all_gather_matmul`` (:mod:`autopar.kernel_rules`): ``True`` wherever they match,
    ``False`` never, ``"auto"`` (default) where the alpha-beta model with overlap predicts
    the fused ring is not slower on ``cluster`` (default: the plan's cluster preset).
    """
    mode = check_fused_kernels(fused_kernels)
    if not isinstance(graph, Graph):
        raise AutoParallelTypeError("graph", graph, "rewrite takes the Graph from autopar.trace")
    if not isinstance(plan, Plan):
        raise AutoParallelTypeError("plan", plan, "rewrite takes the Plan from autopar.search")
    if not plan.searched_on(graph):  # the very graph searched: no hashing
        raise AutoParallelError("plan", plan.fingerprint[:12], "the plan was searched on "
                                f"another graph (this graph's fingerprint is "
                                f"{graph.fingerprint()[:12]})", "Search the plan on this graph")
    return fuse_kernels(_Rewriter(graph, plan, plan.pricing.enable_alltoall).run(), mode, cluster)

