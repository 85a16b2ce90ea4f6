"""The price of an operator under split counts, without building its layouts.

:meth:`Problem.op_costs <autopar.strategies.problem.Problem.op_costs>` prices a strategy of
an operator: forward + backward compute by :class:`OpForward`, the one rule of an operator's
time (FLOPs over the split product, the memory passes of its local blocks, its launch; the
simulators price a plan's layouts by it through :func:`operator_time
<autopar.strategies.problem.operator_time>`), the backward all-reduce of each input gradient
over the axes where that input is replicated while the operator is split (gradient
synchronisation for a parameter or a value computed from parameters alone, which the training
step reduces with the parameters' gradients; activation communication otherwise), and the
memory of its outputs that backward reads (its kept residuals,
:mod:`~autopar.strategies.memory`). Every term depends on the operator's signature and split
counts only: a tensor's local block has each dim's size over the split of the loop dim it
follows, and the axes are the mesh's canonical assignment (:meth:`DeviceMesh.assign
<autopar.strategies.layout.DeviceMesh.assign>`). So :class:`OpRecipe` reads what an
operator's price needs from the graph once per signature, and :class:`OpPricer` prices a
split vector with a few integer products and the cost model's own formulas
(``compute_time``, ``all_reduce_time``, ``gradient_sync_time``, ``update_time``): the very
same arithmetic, in the same order, as pricing through the Choice's layouts
(tests/test_op_pricing.py checks it bit for bit), several times cheaper --
recursive_programming prices hundreds of candidates per round, and TensorLayout objects were most
of that.

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

import functools
import math
from typing import Callable, Mapping, Sequence

from autopar.graph.ir import Graph, Node
from autopar.graph.prng import itemsize
from autopar.strategies.precision import compute_dtype, state_ratio
from autopar.strategies.cost import BACKWARD_FACTOR, CostModel
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.opspec import OpSpec, op_spec

__all__ = ["Block", "OpForward", "OpRecipe", "OpPricer"]

Splits = tuple[int, ...]


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    """``TensorSpec.itemsize`` per dtype name (numpy's dtype lookup is slow to repeat)."""
    return itemsize(dtype)


class Block:
    """One tensor of an operator: its global shape, the loop dim each of its dims follows
    (None: never split) and its item size; :meth:`local_bytes` is the bytes of one device's
    block under split counts (``TensorLayout.local_shape``'s arithmetic: each dim's size over its
    split, floored; integers, so the product's order does not matter)."""

    __slots__ = ("shape", "dims", "itemsize", "refs", "whole", "split", "key")

    def __init__(self, shape: tuple[int, ...], dims: Sequence[int | None], itemsize: int):
        self.shape, self.dims, self.itemsize = shape, tuple(dims), itemsize
        self.refs = frozenset(d for d in self.dims if d is not None)
        self.whole = itemsize * math.prod(n for n, d in zip(shape, self.dims) if d is None)
        self.split = tuple((n, d) for n, d in zip(shape, self.dims) if d is not None)
        self.key = (shape, self.dims, itemsize)

    def local_bytes(self, splits: Splits) -> int:
        n = self.whole
        for size, d in self.split:
            n *= size // splits[d]
        return n


class OpForward:
    """The one rule of an operator's forward seconds on one device: its FLOPs over the
    product of its split counts, at the peak of its compute dtype, plus the memory passes of
    its local blocks -- its inputs but literals and values XLA fuses away, its outputs but
    fused ones -- plus a launch unless every output is fused into its reader
    (:meth:`CostModel.compute_time <autopar.strategies.cost.CostModel.compute_time>`). The
    search prices it from split counts (:class:`OpPricer`), the simulators from a plan's
    layouts (:func:`~autopar.strategies.problem.operator_time`); both read the blocks this
    selects (``ins`` / ``outs``: per input / output, whether it moves through memory) and
    call :meth:`seconds`."""

    __slots__ = ("flops", "dtype", "launch", "ins", "outs")

    def __init__(self, graph: Graph, node: Node, fused: frozenset[str]) -> None:
        self.flops = node.flops
        self.dtype = compute_dtype(graph, node)  # (the peak its FLOPs run at)
        self.launch = not all(v in fused for v in node.outputs)
        self.ins = tuple(graph.values[v].kind != "literal" and v not in fused
                         for v in node.inputs)
        self.outs = tuple(v not in fused for v in node.outputs)

    def seconds(self, cm: CostModel, splits: Sequence[int], nbytes: int) -> float:
        """Forward seconds under split counts ``splits`` moving ``nbytes`` (the local bytes
        of the blocks :attr:`ins` and :attr:`outs` select)."""
        return cm.compute_time(self.flops / math.prod(splits), nbytes, launch=self.launch,
                               dtype=self.dtype)


class OpRecipe:
    """What an operator's price depends on, read once per signature from one of its nodes:
    its forward rule (:class:`OpForward`), the backward factor, the blocks it moves
    through memory (the local blocks :class:`OpForward` selects), the inputs whose
    gradient is reduced (with whether each is a parameter), its outputs backward reads
    (``kept``: :class:`~autopar.strategies.memory.Residuals`' ``kept_outputs``; every output
    when None), and its parameter inputs (input position, value, block, whether trained)."""

    __slots__ = ("forward", "factor", "moved", "grads", "outs", "params", "key", "klass")

    def __init__(self, graph: Graph, node: Node, spec: OpSpec,
                 requires_grad: Mapping[str, bool], fused: frozenset[str],
                 param_like: frozenset[str] = frozenset(),
                 kept: frozenset[str] | None = None) -> None:
        def block(v: str, dims: Sequence[int | None]) -> Block:
            s = graph.values[v].spec
            return Block(s.shape, dims, _itemsize(s.dtype))

        ins = [block(v, mp) for v, mp in zip(node.inputs, spec.in_maps)]
        outs = [block(v, mp) for v, mp in zip(node.outputs, spec.out_maps)]
        kinds = [graph.values[v].kind for v in node.inputs]
        fwd = self.forward = OpForward(graph, node, fused)
        # (an operator a jax.checkpoint policy does not save runs its forward again in
        # backward: autopar/graph/remat.py)
        again = 1.0 if node.remat is not None and not node.remat.saved else 0.0
        self.factor = 1.0 + BACKWARD_FACTOR + again \
            if any(requires_grad[v] for v in node.inputs) else 1.0
        self.moved = tuple([b for b, keep in zip(ins, fwd.ins) if keep] +
                           [b for b, keep in zip(outs, fwd.outs) if keep])
        self.grads = tuple((b, k == "param" or v in param_like)  # (problem.parameter_values)
                           for v, b, k in zip(node.inputs, ins, kinds) if requires_grad[v])
        self.outs = tuple(b for v, b in zip(node.outputs, outs) if kept is None or v in kept)
        self.params = tuple((j, v, b, requires_grad.get(v, False))
                            for j, (v, b, k) in enumerate(zip(node.inputs, ins, kinds))
                            if k == "param")
        # what the price depends on: operators of different signatures (an add and a mul
        # of one shape) with equal keys have equal prices
        self.key = (fwd.flops, fwd.dtype, self.factor, fwd.launch,
                    tuple(b.key for b in self.moved),
                    tuple((b.key, p) for b, p in self.grads), tuple(b.key for b in self.outs),
                    tuple((b.key, t) for _, _, b, t in self.params))
        self.klass = -1  # the pricer's small int for ``key``


class OpPricer:
    """Operators' (compute, comm, grad_sync, memory) from split counts (see the module
    docstring); recipes are kept per signature (any hashable key)."""

    def __init__(self, graph: Graph, mesh: DeviceMesh, cm: CostModel,
                 requires_grad: Mapping[str, bool], fused: frozenset[str],
                 assign: Callable[[Splits], tuple | None] | None = None,
                 param_like: frozenset[str] = frozenset(),
                 kept: frozenset[str] | None = None, fp32_sync: bool = False,
                 optimizer_state: Mapping[str, float] | None = None) -> None:
        self.graph, self.mesh, self.cm = graph, mesh, cm
        # gradient_fp32_sync (a bf16 / fp16 gradient syncs in fp32: strategies.precision)
        # and each parameter's optimizer state per byte (None: the cluster's factor)
        self.fp32_sync, self.optimizer_state = fp32_sync, optimizer_state
        self.kept = kept  # the outputs priced in memory (None: all)
        self.assign = mesh.assign if assign is None else assign  # the canonical axes
        self.requires_grad, self.fused = requires_grad, fused
        self.param_like = param_like  # values priced as parameters (problem.parameter_values)
        self._recipes: dict[object, OpRecipe] = {}
        self._missing: dict[tuple, tuple[str, ...]] = {}
        self._classes: dict[tuple, int] = {}  # recipe key -> small int
        self._costs: dict[tuple, tuple[float, float, float, float]] = {}
        self._reduce: dict[tuple, float] = {}

    def recipe(self, sig: object, node: Node, spec: OpSpec | None = None) -> OpRecipe:
        r = self._recipes.get(sig)
        if r is None:
            r = self._recipes[sig] = OpRecipe(self.graph, node,
                                              spec or op_spec(node, self.graph),
                                              self.requires_grad, self.fused, self.param_like,
                                              self.kept)
            r.klass = self._classes.setdefault(r.key, len(self._classes))
        return r

    def missing(self, splits: Splits, refs: frozenset[int]) -> tuple[str, ...]:
        """The axes an operator split ``splits`` is split over (canonical axes) that a
        tensor following loop dims ``refs`` is not (in mesh order): where it is
        replicated."""
        key = (splits, refs)
        hit = self._missing.get(key)
        if hit is None:
            axes = self.assign(splits)
            have = {a for d in refs for a in axes[d]}  # type: ignore[index]
            used = {a for ax in axes for a in ax}  # type: ignore[union-attr]
            hit = self._missing[key] = tuple(a for a in self.mesh.names
                                             if a in used and a not in have)
        return hit

    def costs(self, r: OpRecipe, splits: Splits) -> tuple[float, float, float, float]:
        """(compute, comm, grad_sync, memory) of one split vector (legal on the mesh);
        memoised per recipe key and splits."""
        key = (r.klass, splits)
        hit = self._costs.get(key)
        if hit is None:
            hit = self._costs[key] = self._price(r, splits)
        return hit

    def _price(self, r: OpRecipe, splits: Splits) -> tuple[float, float, float, float]:
        cm = self.cm
        nbytes = 0
        for b in r.moved:
            n = b.whole
            for size, d in b.split:
                n *= size // splits[d]
            nbytes += n
        compute = r.forward.seconds(cm, splits, nbytes) * r.factor
        comm = sync = 0.0
        if r.grads:
            for b, is_param in r.grads:
                missing = self.missing(splits, b.refs)
                if not missing:
                    continue
                if is_param:  # (an fp32 sync of a 2-byte float: twice the bytes)
                    up = 2 if self.fp32_sync and b.itemsize == 2 else 1
                    sync += self.all_reduce(up * b.local_bytes(splits), missing, gradient=True)
                else:
                    comm += self.all_reduce(b.local_bytes(splits), missing)
        memory = float(sum([b.local_bytes(splits) for b in r.outs]))
        return compute, comm, sync, memory

    def all_reduce(self, nbytes: int, axes: tuple[str, ...], gradient: bool = False) -> float:
        """``CostModel.all_reduce_time``, or ``gradient_sync_time`` for a parameter's gradient
        (memoised: blocks of one size recur)."""
        key = (nbytes, axes, gradient)
        hit = self._reduce.get(key)
        if hit is None:
            cm = self.cm
            price = cm.gradient_sync_time if gradient else cm.all_reduce_time
            hit = self._reduce[key] = price(nbytes, axes, self.mesh)
        return hit

    def update(self, r: OpRecipe, splits: Splits) -> float:
        """The optimizer update of the parameters the operator reads, each in the block it
        reads it in (``Problem.param_update`` summed in input order)."""
        cm = self.cm
        states = self.optimizer_state
        return sum([cm.update_time(b.local_bytes(splits), state_ratio(states, v))
                    if trained else 0.0 for _, v, b, trained in r.params])
