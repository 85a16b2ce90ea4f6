"""The price of an operator under split counts, without building its layouts.

:meth:`Problem.op_costs <autopar.strategies.problem.Problem.op_costs>` prices a strategy of
an operator: forward + backward compute by :func:`operator_time
<autopar.strategies.problem.operator_time>`'s rule (FLOPs over the split product, the memory
passes of its local blocks, its launch), the backward all-reduce of each input gradient over
the axes where that input is replicated while the operator is split, and the memory of its
outputs. Every term depends on the operator's signature and split counts only: a tensor's
local block has each dim's size over the split of the loop dim it follows, and the axes are
the mesh's canonical assignment (:meth:`DeviceMesh.assign
<autopar.strategies.layout.DeviceMesh.assign>`). So :class:`OpRecipe` reads what an
operator's price needs from the graph once per signature, and :class:`OpPricer` prices a
split vector with a few integer products and the cost model's own formulas
(``compute_time``, ``all_reduce_time``, ``update_time``): the very same arithmetic, in the
same order, as pricing through the Choice's layouts (tests/test_op_pricing.py checks it bit
for bit), several times cheaper -- recursive_programming prices hundreds of candidates per
round, and Layout objects were most of that.

>>> import jax.numpy as jnp, autopar
>>> from autopar.strategies.cost import CLUSTERS, CostModel
>>> from autopar.strategies.layout import DeviceMesh
>>> g = autopar.trace(lambda w, x: x @ w, jnp.ones((8, 4)), jnp.ones((2, 8)))
>>> node, mesh = g.nodes[0], DeviceMesh.for_devices(8)
>>> pricer = OpPricer(g, mesh, CostModel(CLUSTERS["accelerator-8x"]),
...                   {v: g.values[v].kind == "param" for v in g.values}, frozenset())
>>> r = pricer.recipe(0, node, op_spec(node, g))
>>> compute, comm, sync, memory = pricer.costs(r, (2, 4, 1))
>>> memory   # the [2, 4] output split 2 x 4 ways: one float32
4.0
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from autopar.graph.ir import Graph, Node
from autopar.strategies.cost import BACKWARD_FACTOR, CostModel
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.opspec import OpSpec, op_spec

__all__ = ["Block", "OpRecipe", "OpPricer"]

Splits = tuple[int, ...]


class Block:
    """One tensor of an operator: its global shape, the loop dim each of its dims follows
    (None: never split) and its item size; :meth:`local_bytes` is the bytes of one device's
    block under split counts (``Layout.local_shape``'s arithmetic)."""

    __slots__ = ("shape", "dims", "itemsize", "refs")

    def __init__(self, shape: tuple[int, ...], dims: Sequence[int | None], itemsize: int):
        self.shape, self.dims, self.itemsize = shape, tuple(dims), itemsize
        self.refs = frozenset(d for d in self.dims if d is not None)

    def local_bytes(self, splits: Splits) -> int:
        n = 1
        for size, d in zip(self.shape, self.dims):
            n *= size if d is None else size // splits[d]
        return n * self.itemsize


class OpRecipe:
    """What an operator's price depends on, read once per signature from one of its nodes:
    FLOPs, the backward factor, whether it launches, the blocks it moves through memory
    (inputs but literals and fused values; outputs but fused ones), the inputs whose
    gradient is reduced (with whether each is a parameter), its outputs, and its
    parameter inputs (input position, value, block, whether trained)."""

    __slots__ = ("flops", "factor", "launch", "moved", "grads", "outs", "params")

    def __init__(self, graph: Graph, node: Node, spec: OpSpec,
                 requires_grad: Mapping[str, bool], fused: frozenset[str]) -> None:
        def block(v: str, dims: Sequence[int | None]) -> Block:
            s = graph.spec(v)
            return Block(s.shape, dims, s.itemsize)

        ins = [block(v, mp) for v, mp in zip(node.inputs, spec.in_maps)]
        outs = [block(v, mp) for v, mp in zip(node.outputs, spec.out_maps)]
        kinds = [graph.values[v].kind for v in node.inputs]
        self.flops = node.flops
        self.factor = 1.0 + BACKWARD_FACTOR if any(requires_grad[v] for v in node.inputs) \
            else 1.0
        self.launch = not all(v in fused for v in node.outputs)
        self.moved = tuple([b for v, b, k in zip(node.inputs, ins, kinds)
                            if k != "literal" and v not in fused] +
                           [b for v, b in zip(node.outputs, outs) if v not in fused])
        self.grads = tuple((b, k == "param") for v, b, k in zip(node.inputs, ins, kinds)
                           if requires_grad[v])
        self.outs = tuple(outs)
        self.params = tuple((j, v, b, requires_grad.get(v, False))
                            for j, (v, b, k) in enumerate(zip(node.inputs, ins, kinds))
                            if k == "param")


class OpPricer:
    """Operators' (compute, comm, grad_sync, memory) from split counts (see the module
    docstring); recipes are kept per signature (any hashable key)."""

    def __init__(self, graph: Graph, mesh: DeviceMesh, cm: CostModel,
                 requires_grad: Mapping[str, bool], fused: frozenset[str]) -> None:
        self.graph, self.mesh, self.cm = graph, mesh, cm
        self.requires_grad, self.fused = requires_grad, fused
        self._recipes: dict[object, OpRecipe] = {}
        self._missing: dict[tuple, tuple[str, ...]] = {}

    def recipe(self, sig: object, node: Node, spec: OpSpec | None = None) -> OpRecipe:
        r = self._recipes.get(sig)
        if r is None:
            r = self._recipes[sig] = OpRecipe(self.graph, node,
                                              spec or op_spec(node, self.graph),
                                              self.requires_grad, self.fused)
        return r

    def missing(self, axes: tuple[tuple[str, ...], ...], refs: frozenset[int]
                ) -> tuple[str, ...]:
        """The axes an operator with ``axes`` per loop dim is split over that a tensor
        following loop dims ``refs`` is not (in mesh order): where it is replicated."""
        key = (axes, refs)
        hit = self._missing.get(key)
        if hit is None:
            have = {a for d in refs for a in axes[d]}
            used = {a for ax in axes for a in ax}
            hit = self._missing[key] = tuple(a for a in self.mesh.names
                                             if a in used and a not in have)
        return hit

    def costs(self, r: OpRecipe, splits: Splits) -> tuple[float, float, float, float]:
        """(compute, comm, grad_sync, memory) of one split vector (legal on the mesh)."""
        cm, mesh = self.cm, self.mesh
        nbytes = 0
        for b in r.moved:
            nbytes += b.local_bytes(splits)
        compute = cm.compute_time(r.flops / math.prod(splits), nbytes,
                                  launch=r.launch) * r.factor
        comm = sync = 0.0
        if r.grads:
            axes = mesh.assign(splits)
            for b, is_param in r.grads:
                missing = self.missing(axes, b.refs)  # type: ignore[arg-type]
                if not missing:
                    continue
                t = cm.all_reduce_time(b.local_bytes(splits), missing, mesh)
                if is_param:
                    sync += t
                else:
                    comm += t
        memory = float(sum([b.local_bytes(splits) for b in r.outs]))
        return compute, comm, sync, memory

    def update(self, r: OpRecipe, splits: Splits) -> float:
        """The optimizer update of the parameters the operator reads, each in the block it
        reads it in (``Problem.param_update`` summed in input order)."""
        cm = self.cm
        return sum([cm.update_time(b.local_bytes(splits)) if trained else 0.0
                    for _, _, b, trained in r.params])
