"""The search problem every mode solves: vertices with strategy choices, edges with costs.

Vertices are the graph's operators plus one per parameter and data input. A vertex's
:class:`Choice` s are its strategies (split counts per iteration dim, canonical mesh axes, the
layouts it needs and produces); its cost vector prices each choice (compute of forward and
backward, the backward all-reduce of input gradients over the axes where the input is
replicated while the operator is split — for a parameter, that is its gradient
synchronisation — and memory); an edge's matrix prices the redistribution of one value from
the producer's layout to the consumer's (forward steps and, when the value carries a
gradient, their transposes in backward). Costs are cached by operator signature, so the 96
identical blocks of a transformer cost one block's work.

A plan's price (:meth:`Problem.evaluate`, the objective) counts a value moved to one layout
once however many operators read it there, as the rewrite runs it
(:func:`redistribution_once`); the searches minimise an upper bound, every edge's entry (an
edge's matrix cannot see the other readers' choices), and
:mod:`~autopar.strategies.shared_moves` then moves single operators (and regions) while the
price drops.

The objective is one micro-batch of a step of ``micro_batches`` (``Problem(micro_batches=m)``:
gradient accumulation x pipeline micro-batches, the times one optimizer step runs the traced
graph): compute, activation communication and redistribution as every micro-batch runs them,
and what a step runs once -- the gradient synchronisation and the optimizer update -- at
``1/m`` of its price (:meth:`Problem.once_per_step`, the one rule). With ``m = 1`` (the
default) that is the whole step, bit for bit the prices of before.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from autopar.errors import AutoParallelError
from autopar.gc_pause import paused_gc
from autopar.graph.ir import Graph, Node
from autopar.graph.loops import LOOP_KIND, loop_body
from autopar.graph.ops import FUSED_PRODUCERS, FUSING_READERS, KINDS, NO_GRADIENT
from autopar.strategies.cost import CostModel
from autopar.strategies.edge_pricing import EdgePricer
from autopar.strategies.layout import DeviceMesh, TensorLayout
from autopar.strategies.memory import (ParamBytes, Residuals, StepMemory, recomputed_bytes,
                                       step_memory)
from autopar.strategies.op_pricing import OpForward, OpPricer
from autopar.strategies.optimizer_rule import param_shards
from autopar.strategies.precision import state_ratio, sync_factor
from autopar.strategies.opspec import OpSpec, legal_splits, op_spec, tensor_spec

__all__ = ["BodyInputs", "Choice", "Vertex", "Edge", "Problem", "Breakdown", "PriceBooks",
           "redistribution_once"]


@dataclass(frozen=True, slots=True)
class Choice:
    """One strategy of a vertex."""

    splits: tuple[int, ...]                 # per iteration dim (ops) / per tensor dim (inputs)
    in_layouts: tuple[TensorLayout, ...]
    out_layouts: tuple[TensorLayout, ...]
    used_axes: frozenset[str]
    # (mesh, strategy) of the last strategy() (a choice is shared by the operators of one
    # signature and splits: a plan asks once per operator)
    _strategy: Any = field(default=None, compare=False, hash=False, repr=False)

    def strategy(self, mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
        """MindSpore tuples: one per input, split count per dim."""
        hit = self._strategy
        if hit is None or hit[0] != mesh:
            hit = (mesh, tuple(lay.split_counts(mesh) for lay in self.in_layouts))
            object.__setattr__(self, "_strategy", hit)
        return hit[1]


@dataclass
class Vertex:
    name: str
    kind: str                       # "op" | "param" | "data"
    choices: list[Choice]
    cost: np.ndarray                # objective per choice
    compute: np.ndarray             # seconds per choice
    comm: np.ndarray                # backward all-reduce of activation grads
    grad_sync: np.ndarray           # backward all-reduce of parameter grads
    memory: np.ndarray              # bytes per device
    node: Node | None = None
    value: str | None = None        # for input vertices


@dataclass
class Edge:
    """A value read by an operator. ``matrix`` ([len(u.choices), len(v.choices)] seconds) is
    built on first use: recursive_programming and sharding_propagation never need all of it.
    The edge refers to its problem weakly: a problem and its edges in a cycle outlived every
    search until the cyclic collector walked them."""

    u: int
    v: int
    value: str
    in_index: int                   # position in the consumer's inputs
    out_index: int                  # position in the producer's outputs (0 for inputs)
    owner: "weakref.ReferenceType[Problem]" = field(repr=False)
    _matrix: np.ndarray | None = field(default=None, repr=False)

    @property
    def problem(self) -> "Problem":
        return self.owner()  # type: ignore[return-value]

    @property
    def matrix(self) -> np.ndarray:
        if self._matrix is None:
            self._matrix = self.problem._edge_matrix(self.u, self.v, self.value,
                                                     self.in_index, self.out_index)
        return self._matrix

    @matrix.setter
    def matrix(self, m: np.ndarray) -> None:
        self._matrix = m

    def vector(self, *, at: str, other: int) -> np.ndarray:
        """Costs over one end's choices with the other end fixed at choice ``other``."""
        if self._matrix is not None:
            return self._matrix[:, other] if at == "u" else self._matrix[other, :]
        p = self.problem
        key = (p._edge_key(self.u, self.v, self.in_index, self.out_index), at, other)
        hit = p._vector_cache.get(key)
        if hit is not None:
            return hit
        shared = p._shared_vector_key(self, at, other)
        if shared is not None:  # (the price book's: another problem of the graph priced it)
            hit = p._book.vectors.get(shared)  # type: ignore[union-attr]
            if hit is not None:
                p._vector_cache[key] = hit
                return hit
        cu, cv = p.vertices[self.u].choices, p.vertices[self.v].choices
        if at == "u":
            dst = cv[other].in_layouts[self.in_index]
            vec = np.array([p.edge_cost(self.value, c.out_layouts[self.out_index], dst)
                            for c in cu])
        else:
            src = cu[other].out_layouts[self.out_index]
            vec = np.array([p.edge_cost(self.value, src, c.in_layouts[self.in_index])
                            for c in cv])
        p._vector_cache[key] = vec
        if shared is not None:
            p._book.vectors[shared] = vec  # type: ignore[union-attr]
        return vec


@dataclass(frozen=True)
class Breakdown:
    """A plan's seconds by kind (and its memory), each at what it is *per*: ``compute``
    (forward and backward of every operator, plus the step's launch and the optimizer
    update), ``communication`` (activation gradients' all-reduces) and ``redistribution`` as
    one micro-batch runs them; ``gradient_sync`` (the parameters' gradient all-reduces) as
    the step runs it, once. Under ``micro_batches = m`` the step runs the first three m times
    (the launch and the update once) and the gradient sync once, and the objective
    (``Plan.objective``) charges one micro-batch with ``1/m`` of the update and the sync
    (:meth:`Problem.once_per_step`). ``total``: the sum as written, the step's time when
    ``m = 1`` (one micro-batch and the step's sync otherwise). Frozen, as the plan that
    holds it: a changed figure is a new breakdown (``dataclasses.replace``)."""

    compute: float = 0.0
    communication: float = 0.0
    redistribution: float = 0.0
    gradient_sync: float = 0.0
    memory_bytes: float = 0.0  # a plan's: the step's ordered peak (Problem.step_memory)

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.redistribution + self.gradient_sync


def redistribution_once(moves: Iterable[tuple[str, TensorLayout, float]]) -> float:
    """Seconds of a plan's redistributions, from each edge's ``(value, layout it is read in,
    seconds)``: a value moved to one layout is moved once, whatever number of operators read
    it there (the rewrite reuses it, :mod:`autopar.rewrite`; a value has one producer, so
    its source layout is the same on every edge). The one rule :meth:`Problem.evaluate`
    and the iteration simulator price a plan's redistributions by.

    >>> r = TensorLayout.replicated(2)
    >>> redistribution_once([("x", r, 1.0), ("x", r, 1.0), ("y", r, 2.0)])
    3.0
    """
    seen: set[tuple[str, TensorLayout]] = set()
    total = 0.0
    for value, dst, seconds in moves:
        if (value, dst) not in seen:
            seen.add((value, dst))
            total += seconds
    return total


class KeptAssign:
    """``mesh.assign(splits)`` kept per split counts (the mesh's own cache hashes the mesh
    at every call; the searches ask for the same split counts again and again)."""

    __slots__ = ("mesh", "kept")

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.kept: dict[tuple[int, ...], tuple[tuple[str, ...], ...] | None] = {}

    def __call__(self, splits: tuple[int, ...]) -> tuple[tuple[str, ...], ...] | None:
        hit = self.kept.get(splits, False)
        if hit is False:
            hit = self.kept[splits] = self.mesh.assign(splits)
        return hit  # type: ignore[return-value]


class PriceBook:
    """What the problems of one graph price alike, whatever their memory weight, fixed
    operators, loop candidates and parameter options: per signature its operators' loop
    nest, per (signature, splits) the Choice and the raw (compute, comm, grad_sync, memory)
    price, per signature the full choice list and its raw prices (a memory weight re-weights
    them, :meth:`Problem._vertex_arrays`; the cost arrays are kept per weight, so the
    problems of one weight share the very arrays), the operator pricer, and the edge
    matrices by their ends' choices (:meth:`Problem._shared_edge_key`). A loop node's are
    never kept here (its candidates are its problem's body searches)."""

    __slots__ = ("graph", "cm", "sig", "specs", "choices", "costs", "nodes", "op_pricer",
                 "axes_of", "edges", "vectors", "fixed", "solvers")

    def __init__(self, graph: Graph, cm: CostModel, mesh: DeviceMesh) -> None:
        self.graph, self.cm = graph, cm  # (kept: the book is found by their ids)
        self.sig: dict[str, int] | None = None
        self.specs: dict[str, OpSpec] | None = None
        self.choices: dict[tuple, Choice] = {}
        self.costs: dict[tuple, tuple[float, float, float, float]] = {}
        # signature -> (choices, raw prices, memory weight -> cost arrays)
        self.nodes: dict[int, tuple[list[Choice], list[tuple[float, ...]], dict]] = {}
        self.fixed: dict[tuple, dict] = {}  # (signature, splits, weight) -> cost arrays
        self.op_pricer: Any = None
        self.axes_of = KeptAssign(mesh)
        self.edges: dict[tuple, np.ndarray] = {}  # (Problem._shared_edge_key) -> seconds
        self.vectors: dict[tuple, np.ndarray] = {}  # (.., at, other) -> Edge.vector
        #: what a solver keeps across the problems of the book (keyed by all else it
        #: depends on: a memory weight's prices under the weight; never a loop node's)
        self.solvers: dict[str, dict] = {}


class PriceBooks:
    """The price books of one search (``Problem(prices=...)``, like ``edge_pricer`` a pure
    cache the search's problems share and drop with it): a loop body is searched again at
    every memory weight, candidate and hand plan, and its operators' prices do not depend on
    those. A book is per graph and what its operators' signatures and prices depend on: the
    mesh, the cost model, the body inputs that carry a gradient, ``full_use``,
    ``enable_alltoall`` and the mixed-precision settings. TensorLayout pairs' move coefficients
    are kept per mesh, cost model and ``enable_alltoall``."""

    def __init__(self) -> None:
        self.books: dict[tuple, PriceBook] = {}
        self.pairs: dict[tuple, tuple[Any, dict]] = {}

    def book(self, problem: "Problem") -> PriceBook:
        body = problem.body
        key = (id(problem.graph), problem.mesh, id(problem.cm),
               None if body is None else body.grads, problem.full_use, problem.micro_batches,
               problem.enable_alltoall, problem.fp32_sync,
               None if problem.optimizer_state is None else
               tuple(sorted(problem.optimizer_state.items())))
        hit = self.books.get(key)
        if hit is None:
            hit = self.books[key] = PriceBook(problem.graph, problem.cm, problem.mesh)
        return hit

    def pair_cache(self, problem: "Problem") -> dict:
        key = (problem.mesh, id(problem.cm), problem.enable_alltoall)
        hit = self.pairs.get(key)
        if hit is None:
            hit = self.pairs[key] = (problem.cm, {})
        return hit[1]


def _divisors_of(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


SMALL_OP_BYTES = 4 * 2**20


def enumerate_splits(spec: OpSpec, device_num: int, full_use: bool) -> list[tuple[int, ...]]:
    """Split vectors (one count per iteration dim) whose product divides device_num; with
    ``full_use`` only those using every device (as MindSpore's fully_use_devices), unless
    none does."""
    divs = _divisors_of(device_num)
    cands = [[c for c in divs if spec.allows(d, c)] for d in range(len(spec.sizes))]
    grown: list[tuple[tuple[int, ...], int]] = [((), 1)]  # (splits so far, their product)
    for options in cands:  # (in order: the vectors come out lexicographically)
        grown = [(acc + (c,), prod * c) for acc, prod in grown for c in options
                 if device_num % (prod * c) == 0]
    out = [acc for acc, _ in grown]
    if full_use:
        full = [s for s in out if math.prod(s) == device_num]
        if full:
            return full
    return out


def splits_from_strategy(spec: OpSpec, strategy: Any, name: str,
                         mesh: DeviceMesh) -> tuple[int, ...]:
    """Iteration-dim splits of a MindSpore strategy (one tuple per input), checked with
    MindSpore's rules: each split divides its dim, matched splits agree, unsplittable dims
    stay whole, the product divides device_num."""
    where = f"strategy of node {name!r}"
    if not isinstance(strategy, (tuple, list)) or len(strategy) != len(spec.in_maps):
        raise AutoParallelError(where, strategy, f"needs one tuple per input "
                                f"({len(spec.in_maps)} inputs)")
    splits = [1] * len(spec.sizes)
    owner: dict[int, tuple[int, int]] = {}
    for i, (entry, mp) in enumerate(zip(strategy, spec.in_maps)):
        if not isinstance(entry, (tuple, list)) or len(entry) != len(mp):
            raise AutoParallelError(where, strategy, f"input {i} has rank {len(mp)}; its "
                                    f"entry must have {len(mp)} split counts")
        for d, (s, m) in enumerate(zip(entry, mp)):
            if not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= mesh.device_num:
                raise AutoParallelError(where, strategy, f"split counts must be ints in [1, "
                                        f"device_num={mesh.device_num}]")
            if m is None or not spec.splittable(m):
                if s != 1:
                    raise AutoParallelError(where, strategy, f"dim {d} of input {i} cannot be "
                                            f"split by this operator ({spec.why_whole(i, d)})")
                continue
            if m in owner and splits[m] != s:
                a, b = owner[m]
                raise AutoParallelError(where, strategy, f"dim {d} of input {i} and dim {b} of "
                                        f"input {a} are the same loop dimension and must be "
                                        f"split alike ({s} vs {splits[m]})")
            owner[m] = (i, d)
            splits[m] = s
    for d, s in enumerate(splits):
        why = spec.refuses(d, s)
        if why:
            raise AutoParallelError(where, strategy, why)
    if mesh.assign(splits) is None:
        raise AutoParallelError(where, strategy, f"the product of splits {math.prod(splits)} "
                                f"must divide device_num={mesh.device_num}")
    return tuple(splits)


def fused_values(graph: Graph) -> frozenset[str]:
    """Values XLA keeps in registers: made by a fusible operator, read only by operators
    that fuse it, and not an output of the graph (a pricing rule: such a value costs no
    memory pass and its producer no launch). Which kinds fuse is the operator registry's
    ``fusion`` (:mod:`autopar.graph.ops`).

    >>> import jax.numpy as jnp, autopar
    >>> g = autopar.trace(lambda w, x: jnp.tanh(x @ w * 2.0).sum(), jnp.ones((4, 4)),
    ...                   jnp.ones((2, 4)))
    >>> sorted(g.producer(v).op for v in fused_values(g))
    ['mul', 'tanh']
    """
    readers: dict[str, list[str]] = {}
    for n in graph.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(KINDS.get(n.op, n.op))
    outputs = set(graph.outputs)
    return frozenset(v for n in graph.nodes if KINDS.get(n.op, n.op) in FUSED_PRODUCERS
                     for v in n.outputs if v not in outputs and readers.get(v) and
                     all(k in FUSING_READERS for k in readers[v]))


def local_bytes(graph: Graph, value: str, layout: TensorLayout, mesh: DeviceMesh) -> int:
    """Bytes of one device's block of ``value`` under ``layout``."""
    spec = graph.spec(value)
    return math.prod(layout.local_shape(spec.shape, mesh)) * spec.itemsize


def operator_time(cm: CostModel, graph: Graph, node: Node, splits: Sequence[int],
                  in_layouts: Sequence[TensorLayout], out_layouts: Sequence[TensorLayout],
                  mesh: DeviceMesh, fused: frozenset[str]) -> float:
    """Forward seconds of one operator on one device under a strategy, the blocks given by
    its layouts: :class:`~autopar.strategies.op_pricing.OpForward`'s rule (FLOPs over the
    split product, the memory passes of its local blocks, values XLA fuses away excluded,
    its launch unless it is fused into its reader), the one the search prices operators by
    from split counts. The iteration and the pipeline simulators price operators by it."""
    fwd = OpForward(graph, node, fused)
    nbytes = sum(local_bytes(graph, v, lay, mesh) for v, lay, moved in
                 zip(node.inputs, in_layouts, fwd.ins) if moved)
    nbytes += sum(local_bytes(graph, v, lay, mesh) for v, lay, moved in
                  zip(node.outputs, out_layouts, fwd.outs) if moved)
    return fwd.seconds(cm, splits, nbytes)


def operator_floor(cm: CostModel, graph: Graph, node: Node, devices: int,
                   fused: frozenset[str]) -> float:
    """A lower bound of :func:`operator_time` under any layouts on ``devices`` devices: the
    same rule with its FLOPs and every block it moves split ``devices`` ways (no block on
    one device is smaller). The configuration search prunes by it."""
    fwd = OpForward(graph, node, fused)
    nbytes = sum(graph.spec(v).nbytes for v, moved in zip(node.inputs, fwd.ins) if moved)
    nbytes += sum(graph.spec(v).nbytes for v, moved in zip(node.outputs, fwd.outs) if moved)
    return fwd.seconds(cm, (devices,), nbytes / devices)


def parameter_values(graph: Graph) -> frozenset[str]:
    """Values computed from parameters (and constants) alone, no data input upstream: a
    parameter's broadcast, cast or transpose. Their gradients are the parameters' gradients:
    the training step reduces them in its gradient sync (buckets after backward), not where
    an operator that varies along more axes reads them, so the cost model prices that
    reduction as gradient synchronisation, like a parameter's."""
    out = {v for v, val in graph.values.items() if val.kind == "param"}
    for n in graph.nodes:
        kinds = [graph.values[v].kind for v in n.inputs]
        if any(v in out for v in n.inputs) and all(
                v in out or k in ("literal", "const") for v, k in zip(n.inputs, kinds)):
            out.update(n.outputs)
    return frozenset(out)


def requires_grad(graph: Graph, seeds: frozenset[str] = frozenset()) -> dict[str, bool]:
    """Per value, whether it carries a gradient: parameters do (and ``seeds``: a loop
    body's inputs that carry one), and the floating outputs of an operator that passes
    gradients (not in ``NO_GRADIENT``) from an input that does."""
    values = graph.values
    req = {v: val.kind == "param" or v in seeds for v, val in values.items()}
    floating: dict[str, bool] = {}  # per dtype name
    for n in graph.nodes:
        flows = n.op not in NO_GRADIENT and any(req[v] for v in n.inputs)
        for v in n.outputs:
            if not flows:
                req[v] = False
                continue
            dt = values[v].spec.dtype
            f = floating.get(dt)
            if f is None:
                f = floating[dt] = dt.startswith(("float", "bfloat", "complex"))
            req[v] = f
    return req


@dataclass(frozen=True)
class BodyInputs:
    """A loop body's inputs as one candidate of its loop gives them: the layouts of its data
    inputs (carries, activations passed in: fixed), those that carry a gradient, and the dim
    each holds the data batch along (None: none). The body's parameters are views of
    parameters stored outside it (stacked, or passed whole): they cost no memory and no
    optimizer update in its problem (the outer parameter does)."""

    layouts: Mapping[str, TensorLayout]
    grads: frozenset[str]
    batch: Mapping[str, int | None]


class Problem:
    """Build once per (graph, mesh, cost model, options); every search mode reads it."""

    def __init__(self, graph: Graph, mesh: DeviceMesh, cost_model: CostModel, *,
                 enable_alltoall: bool = False, dataset_strategy: Any = "data_parallel",
                 memory_weight: float = 0.0, full_use: bool = True,
                 fixed: Mapping[str, Any] | None = None,
                 fixed_splits: Mapping[str, tuple[int, ...]] | None = None,
                 lazy: bool = False, parallel_optimizer_kb: int | None = None,
                 optimizer_weight_shard_size: int = -1, annotations: bool = True,
                 parameter_plan: bool = True, loops: Any = None,
                 body: BodyInputs | None = None, edge_pricer: Any = None,
                 fp32_sync: bool = True,
                 optimizer_state: Mapping[str, float] | None = None,
                 prices: "PriceBooks | None" = None, micro_batches: int = 1) -> None:
        self.graph, self.mesh, self.cm = graph, mesh, cost_model
        # the micro-batches one optimizer step runs the graph for (see once_per_step)
        self.micro_batches = micro_batches
        self._prices = prices  # the search's price books (a pure cache: PriceBooks)
        # mixed precision (strategies.precision): gradient_fp32_sync as it acts, and per
        # parameter the optimizer state bytes per parameter byte (None: the cluster's factor)
        self.fp32_sync = fp32_sync
        self.optimizer_state = dict(optimizer_state) if optimizer_state is not None else None
        if edge_pricer is not None:  # shared by the problems of one search (a pure cache)
            self._pricer = edge_pricer
        # loop nodes: ``loops.choices(problem, node)`` gives each its candidates (a
        # strategies.loops.LoopChoices); ``body``: this is a loop body's problem
        self.loop_planner = loops
        self.loops: dict[str, Any] = {}
        self.body = body
        self.input_layouts = dict(body.layouts) if body is not None else {}
        self.view_params = body is not None
        self.enable_alltoall = enable_alltoall
        self.memory_weight = memory_weight
        # enable_parallel_optimizer's threshold (KB), None when it is off: parameters it shards
        # cost 1/dp of their stored copy and optimizer state per device (param_memory)
        self.parallel_optimizer_kb = parallel_optimizer_kb
        self.optimizer_weight_shard_size = optimizer_weight_shard_size  # its shard group size
        self.full_use = full_use
        self.lazy = lazy  # operators' choice lists left empty until settle() (for solvers that
        # build their own candidates, like recursive_programming)
        self.vertices: list[Vertex] = []
        self.index: dict[str, int] = {}
        self.edges: list[Edge] = []
        self.specs: dict[str, OpSpec] = {}
        self._sig: dict[str, int] = {}
        self._node_cache: dict[tuple, tuple] = {}
        self._edge_cache: dict[tuple, np.ndarray] = {}
        self._pair_cache: dict[tuple, tuple] = {}
        self._cost_cache: dict[tuple, tuple[float, float, float, float]] = {}
        self._vector_cache: dict[tuple, np.ndarray] = {}
        #: ``mesh.assign(splits)``, kept per problem (not a bound method: the pricers keep
        #: it, and a problem they referred back to would outlive its search in a cycle)
        self.axes_of = KeptAssign(mesh)
        self._reprs: dict[int, tuple[Any, str]] = {}
        with paused_gc():
            self.requires_grad = requires_grad(graph, body.grads if body else frozenset())
            self.fused = fused_values(graph)
            self.param_like = parameter_values(graph)
            # what backward reads (a loop body's: what reaches its outputs)
            self.residuals = Residuals(graph, self.requires_grad, self.fused,
                                       None if body is None else graph.outputs,
                                       self.param_like)
            self._op_pricer = OpPricer(graph, mesh, cost_model, self.requires_grad, self.fused,
                                       self.axes_of,
                                       param_like=self.param_like,
                                       kept=self.residuals.kept_outputs,
                                       fp32_sync=fp32_sync,
                                       optimizer_state=self.optimizer_state)
            itemsize: dict[str, int] = {}  # per dtype name (numpy's lookup is slow)
            self._nbytes = {v: math.prod(val.spec.shape) * (
                itemsize.get(val.spec.dtype) or itemsize.setdefault(val.spec.dtype,
                                                                    val.spec.itemsize))
                for v, val in graph.values.items()}
            self._build(dataset_strategy, dict(fixed or {}), dict(fixed_splits or {}),
                        annotations, parameter_plan)

    # ------------------------------------------------------------------ choices
    def op_choice(self, node: Node, splits: Sequence[int]) -> Choice:
        """The Choice of an operator for any split vector (canonical axes)."""
        return self._op_choice(node.name, tuple(splits))

    def _op_choice(self, name: str, splits: tuple[int, ...]) -> Choice:
        loop = self.loops.get(name)
        if loop is not None:  # a loop node: the candidate of its body plan
            return loop.get(splits).choice
        key = (self._sig[name], splits)
        hit = self._choice_cache.get(key)
        if hit is not None:
            return hit
        spec = self.specs[name]
        axes = self.axes_of(splits)
        if axes is None:
            raise AutoParallelError("strategy", splits, f"split counts do not fit the mesh "
                                    f"{self.mesh} of operator {name!r}")
        summed = set(spec.summed)
        partial = tuple(a for d in sorted(summed) for a in axes[d])
        ins = tuple(TensorLayout(tuple(axes[m] if m is not None else () for m in mp))
                    for mp in spec.in_maps)
        outs = tuple(TensorLayout(tuple(axes[m] if m is not None else () for m in mp), partial)
                     for mp in spec.out_maps)
        c = Choice(splits, ins, outs, frozenset(a for ax in axes for a in ax))
        self._choice_cache[key] = c
        return c

    def may_repeat(self, node: Node) -> bool:
        """Whether the operator may leave devices repeating its work (product of splits below
        device_num): always without ``full_use``; otherwise only small operators. A loop
        node never (its candidates are whole body plans)."""
        if node.name in self.loops:
            return False
        return not self.full_use or max(self._nbytes[v] for v in node.outputs) <= \
            SMALL_OP_BYTES

    def _signature(self, node: Node, described: dict[str, tuple] | None = None) -> tuple:
        """What an operator's strategies, costs and matrices depend on: kind, parameters,
        and per input (shape, dtype, gradient, value kind, fused) and per output (shape,
        dtype, fused). ``described``: those per-value tuples, kept across calls."""
        described = {} if described is None else described
        ins, outs = [], []
        for v in node.inputs:
            d = described.get(v)
            if d is None:
                d = described[v] = self._describe(v)
            ins.append(d)
        for v in node.outputs:
            d = described.get(v)
            if d is None:
                d = described[v] = self._describe(v)
            outs.append(d[:2] + d[4:])
        return (node.op, self._params_key(node.params), tuple(ins), tuple(outs))

    _PLAIN = (tuple, int, str, bool, float, type(None))

    def _params_key(self, params: Mapping[str, Any]) -> tuple:
        """The primitive's parameters by name and repr (the reprs of other objects than
        plain values -- dtypes, enums -- kept by identity: the same objects recur)."""
        reprs, plain, out = self._reprs, self._PLAIN, []
        for k, v in sorted(params.items()):
            if isinstance(v, plain):
                out.append((k, repr(v)))
                continue
            hit = reprs.get(id(v))
            if hit is None:
                hit = reprs[id(v)] = (v, repr(v))  # (v kept: its id is not reused)
            out.append((k, hit[1]))
        return tuple(out)

    def _describe(self, v: str) -> tuple:
        val = self.graph.values[v]
        return (val.spec.shape, val.spec.dtype, self.requires_grad[v], val.kind,
                v in self.fused, v in self.param_like, v in self.residuals.kept_outputs)

    # ------------------------------------------------------------------ costs
    def _local_bytes(self, value: str, layout: TensorLayout) -> int:
        return local_bytes(self.graph, value, layout, self.mesh)

    def state_of(self, value: str) -> float | None:
        """Optimizer state bytes per byte of parameter ``value`` (None: the cluster's
        ``optimizer_state_factor``)."""
        return state_ratio(self.optimizer_state, value)

    def param_memory(self, value: str, layout: TensorLayout) -> float:
        """Training bytes per device of parameter ``value`` stored in ``layout``: its copy,
        gradient and optimizer state (:meth:`CostModel.parameter_memory`), the copy and the
        state split over its shard group when the parallel optimizer takes it (the step's own
        rule, :func:`~autopar.strategies.optimizer_rule.decide_sharding`, over the axes the
        layout leaves it replicated on)."""
        nbytes, ways, sharded = self._param_shards(value, layout)
        return self.cm.parameter_memory(nbytes, ways, sharded=sharded,
                                        state=self.state_of(value))

    def _param_shards(self, value: str, layout: TensorLayout) -> tuple[int, int, bool]:
        """(local bytes, shard group size, sharded) of parameter ``value`` stored in
        ``layout``: the parallel optimizer's decision (1, False when it is off;
        :func:`~autopar.strategies.optimizer_rule.param_shards`)."""
        spec = self.graph.spec(value)
        return param_shards(value, spec.shape, spec.itemsize, layout, self.mesh,
                            self.parallel_optimizer_kb, self.optimizer_weight_shard_size)

    def param_bytes(self, value: str, layout: TensorLayout, *, update: bool = True,
                    donated: bool = False) -> ParamBytes:
        """Parameter ``value`` stored in ``layout``, for the ordered peak: its
        :meth:`CostModel.parameter_parts <autopar.strategies.cost.CostModel.parameter_parts>`
        under :meth:`param_memory`'s sharding rule, its gathered copy when sharded, its
        synchronised gradient (over the axes its layout leaves it replicated on) and what
        the update writes (its new copy and state; nothing when ``donated``: in place).
        ``update=False``: a gradient function (no optimizer state, sync or update). A loop
        body's parameters are views of those stored outside: nothing."""
        if self.view_params:
            return ParamBytes(0.0)
        nbytes, ways, sharded = self._param_shards(value, layout)
        spec = self.graph.spec(value)
        trained = self.requires_grad.get(value, False) and \
            spec.dtype.startswith(("float", "bfloat", "complex"))
        if not trained:
            return ParamBytes(float(nbytes))
        if not update:
            return ParamBytes(float(nbytes), gradient=float(nbytes))
        copy, state, grad = self.cm.parameter_parts(nbytes, ways, sharded=sharded,
                                                    state=self.state_of(value))
        used = layout.used_axes()
        synced = grad / ways if sharded else \
            grad if any(a not in used for a in self.mesh.names) else 0.0
        synced *= sync_factor(spec.dtype, self.fp32_sync)  # (gradient_fp32_sync's fp32 copy)
        return ParamBytes(copy + state, grad if sharded else 0.0, grad, synced,
                          0.0 if donated else copy + state, copy)

    def once_per_step(self, seconds: Any) -> Any:
        """The objective's share of what a step runs once (the gradient sync, the optimizer
        update), per micro-batch: ``seconds / micro_batches`` (a float or an array; unchanged,
        bit for bit, when ``micro_batches`` is 1). The one rule every mode's objective
        prices per-step terms by (:meth:`_vertex_arrays`, recursive_programming's candidate
        costs, a loop's dearer branch).

        >>> import types
        >>> Problem.once_per_step(types.SimpleNamespace(micro_batches=8), 0.8)
        0.1
        """
        m = self.micro_batches
        return seconds if m == 1 else seconds / m

    def param_update(self, value: str, layout: TensorLayout) -> float:
        """Seconds of the optimizer update of a trained parameter's block (0 if untrained),
        once per step (the objective takes :meth:`once_per_step` of it)."""
        if not self.requires_grad.get(value, False):
            return 0.0
        nbytes, ways, _ = self._param_shards(value, layout)  # (sharded: its share only)
        return self.cm.update_time(nbytes / ways, self.state_of(value))

    def op_costs(self, node: Node, choice: Choice) -> tuple[float, float, float, float]:
        """(compute, comm, grad_sync, memory) of one operator choice (memoised)."""
        return self.split_costs(node.name, choice.splits)

    def split_costs(self, name: str, splits: tuple[int, ...]
                    ) -> tuple[float, float, float, float]:
        """:meth:`op_costs` of operator ``name`` at legal split counts, without its Choice
        (memoised per signature and splits; a loop node's: its candidate's)."""
        loop = self.loops.get(name)
        if loop is not None:
            return loop.get(splits).costs
        key = (self._sig[name], splits)
        hit = self._cost_cache.get(key)
        if hit is None:
            pricer = self._op_pricer
            hit = self._cost_cache[key] = pricer.costs(
                pricer.recipe(key[0], self.graph.node(name), self.specs[name]), splits)
        return hit

    def choice_costs(self, name: str, choices: Sequence[Choice]) -> np.ndarray:
        """Operator ``name``'s cost per choice, as its vertex's ``cost`` array prices it."""
        return self._vertex_arrays([self.split_costs(name, c.splits) for c in choices])["cost"]

    def edge_cost(self, value: str, src: TensorLayout, dst: TensorLayout) -> float:
        """Seconds to move ``value`` from layout src to dst (forward + backward transposes)."""
        if src == dst:
            return 0.0
        grad = self.requires_grad[value]
        coef = self._pair_cache.get((src, dst, grad))
        if coef is None:
            coef = self._pair_coefficients(src, dst, grad)
        return CostModel.steps_seconds(coef, self._nbytes[value])

    def _pair_coefficients(self, src: TensorLayout, dst: TensorLayout, grad: bool) -> tuple:
        """:meth:`CostModel.coefficients` of the steps from ``src`` to ``dst`` (kept): from
        :meth:`EdgePricer.pair <autopar.strategies.edge_pricing.EdgePricer.pair>` (the same
        planner on bit masks, bit for bit the same numbers at half the cold cost: a search
        prices about a thousand distinct pairs per process), else (layouts it does not
        take) from the planner's steps, which also raises its errors."""
        coef = self._pair_cache[(src, dst, grad)] = self._edge_pricer().coef(src, dst, grad)
        return coef

    # ------------------------------------------------------------------ build
    def _add_vertex(self, vertex: Vertex) -> int:
        self.index[vertex.name] = len(self.vertices)
        self.vertices.append(vertex)
        return self.index[vertex.name]

    def _vertex_arrays(self, rows: list[tuple[float, float, float, float]], *,
                       update: bool = False) -> dict:
        """The cost arrays of a vertex from its (compute, comm, grad_sync, memory) rows; its
        objective ``cost`` per micro-batch (:meth:`once_per_step` of the gradient sync and,
        ``update``: a parameter's rows, whose compute is its optimizer update, of that)."""
        arr = np.array(rows, dtype=np.float64).reshape(-1, 4)
        compute, comm, sync, mem = arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3]
        once = self.once_per_step
        return {"compute": compute, "comm": comm, "grad_sync": sync, "memory": mem,
                "cost": (once(compute) if update else compute) + comm + once(sync)
                + self.memory_weight * mem}

    def _data_layout(self, value: str, position: int, dataset_strategy: Any) -> TensorLayout:
        spec = self.graph.spec(value)
        if value in self.input_layouts:  # a loop body's data input: its candidate's layout
            return self.input_layouts[value]
        if dataset_strategy == "full_batch" or spec.rank == 0:
            return TensorLayout.replicated(spec.rank)
        if isinstance(dataset_strategy, tuple):
            n_data = len(self.graph.data_inputs())
            if len(dataset_strategy) != n_data:
                raise AutoParallelError(
                    "dataset_strategy", dataset_strategy, f"needs one entry per data input; "
                    f"the function has {n_data}: {list(self.graph.data_inputs())}")
            entry = dataset_strategy[position]
            whole = tensor_spec(spec.shape)
            if len(entry) != spec.rank or any(whole.refuses(d, s) for d, s in enumerate(entry)):
                raise AutoParallelError(
                    "dataset_strategy", dataset_strategy,
                    f"entry {entry} does not fit data input {value!r} of shape {spec.shape}")
            return TensorLayout.from_strategy(entry, self.mesh)
        # data parallel: the batch dim split by the largest divisor of device_num dividing
        # it, on the canonical axes (repeats outermost), as operators place their splits
        batch = tensor_spec(spec.shape[:1])
        s = max(d for d in range(1, self.mesh.device_num + 1)
                if legal_splits(batch, (d,), self.mesh))
        return TensorLayout.from_strategy((s,) + (1,) * (spec.rank - 1), self.mesh)

    def _build(self, dataset_strategy: Any, fixed: dict[str, Any],
               given_splits: dict[str, tuple[int, ...]], annotations: bool,
               parameter_plan: bool) -> None:
        """The vertices and edges; ``annotations`` / ``parameter_plan``: the graph's
        annotated strategies / parameter layouts are fixed too (the parallel modes that use
        the user's strategies)."""
        g, mesh = self.graph, self.mesh
        self._share()
        self._intern_signatures()
        self._add_loops()
        for name in fixed:
            g.node(name)  # unknown names fail here, with suggestions
        for node in g.nodes if annotations else ():
            if node.annotation is not None and node.name not in fixed and \
                    node.name not in given_splits:
                fixed[node.name] = node.annotation
        fixed_splits = {name: splits_from_strategy(self.specs[name], strategy, name, mesh)
                        for name, strategy in sorted(fixed.items())}
        fixed_splits.update(given_splits)
        self.fixed = fixed_splits
        self.fixed_params = self._fixed_params() if parameter_plan else {}
        # data inputs: one fixed layout each
        for pos, v in enumerate(g.data_inputs()):
            lay = self._data_layout(v, pos, dataset_strategy)
            mem = float(self._local_bytes(v, lay))
            self._add_vertex(Vertex(f"<data>{v}", "data",
                                    [Choice(lay.split_counts(mesh), (), (lay,),
                                            lay.used_axes())],
                                    **self._vertex_arrays([(0.0, 0.0, 0.0, mem)]), value=v))
        self._op_vertices()
        # parameters: the layouts their consumers want, plus replicated
        self._add_param_vertices()
        self._add_edges()

    def _fixed_arrays(self, node: Node, c: Choice) -> dict[str, np.ndarray]:
        """The cost arrays of an operator fixed at choice ``c`` (kept per signature, splits
        and memory weight in the price book, a loop node's excepted)."""
        book = self._book
        if book is None or node.name in self.loops:
            return self._vertex_arrays([self.op_costs(node, c)])
        key = (self._sig[node.name], c.splits, self.memory_weight)
        hit = book.fixed.get(key)
        if hit is None:
            hit = book.fixed[key] = self._vertex_arrays([self.op_costs(node, c)])
        return hit

    def _add_loops(self) -> None:
        """Each loop node's candidates (:class:`~autopar.strategies.loops.LoopChoices`),
        from the problem's loop planner."""
        for node in self.graph.nodes:
            if node.kind == LOOP_KIND:
                if self.loop_planner is None:
                    raise AutoParallelError("loop node", node.name, "a graph with loops is "
                                            "searched with a loop planner (autopar.search "
                                            "gives one)")
                self.loops[node.name] = self.loop_planner.choices(self, node)

    def loop_plan(self, name: str, splits: tuple[int, ...]) -> Any:
        """The body plan of loop node ``name`` at ``splits`` (None for other operators)."""
        loop = self.loops.get(name)
        return None if loop is None else loop.get(splits).plan

    def _share(self) -> None:
        """Take the search's price book of this graph (:class:`PriceBooks`): its Choices,
        raw prices, operator pricer and layout pairs' coefficients stand for this problem's
        own caches (the same keys, the same values)."""
        self._choice_cache: dict[tuple, Choice] = {}
        prices = self._prices
        self._book: PriceBook | None = None if prices is None else prices.book(self)
        book = self._book
        if book is None:
            return
        if book.op_pricer is None:
            book.op_pricer = OpPricer(self.graph, self.mesh, self.cm, self.requires_grad,
                                      self.fused, book.axes_of, param_like=self.param_like,
                                      kept=self.residuals.kept_outputs,
                                      fp32_sync=self.fp32_sync,
                                      optimizer_state=self.optimizer_state)
        self._op_pricer, self.axes_of = book.op_pricer, book.axes_of
        self._choice_cache, self._cost_cache = book.choices, book.costs
        self._pair_cache = prices.pair_cache(self)  # type: ignore[union-attr]

    def solver_cache(self, name: str) -> dict:
        """Solver ``name``'s cache shared by the problems of this one's price book (a fresh
        dict without one): keep there only what the graph, mesh and cost model decide."""
        book = self._book
        return {} if book is None else book.solvers.setdefault(name, {})

    def _intern_signatures(self) -> None:
        """Each operator's signature as a small int (cheap to hash in every cache key) and
        its loop nest, derived once per signature (it depends on the signature only; kept
        in the price book, when the problem has one)."""
        book = self._book
        if book is not None and book.sig is not None:
            self._sig, self.specs = book.sig, book.specs  # type: ignore[assignment]
            return
        g, sig_of, specs = self.graph, self._sig, self.specs
        interned: dict[tuple, int] = {}
        described: dict[str, tuple] = {}
        spec_of: list[OpSpec] = []
        for node in g.nodes:
            key = self._signature(node, described)
            if node.kind == LOOP_KIND:  # (a loop's candidates are its own: never shared)
                key += (node.name,)
            sig = interned.setdefault(key, len(interned))
            if sig == len(spec_of):
                spec_of.append(op_spec(node, g))
            sig_of[node.name] = sig
            specs[node.name] = spec_of[sig]
        if book is not None:
            book.sig, book.specs = sig_of, specs

    def _op_vertices(self) -> None:
        """One vertex per operator: its fixed choice, no choices yet (``lazy``), or every
        strategy of its signature (built once per signature)."""
        fixed_splits, mesh = self.fixed, self.mesh
        none = self._vertex_arrays([])  # (empty arrays, shared: never written in place)
        empty = (none["cost"], none["compute"], none["comm"], none["grad_sync"],
                 none["memory"])
        index, vertices = self.index, self.vertices
        for node in self.graph.nodes:
            name = node.name
            if name in fixed_splits:
                c = self._op_choice(name, fixed_splits[name])
                self._add_vertex(Vertex(name, "op", [c], node=node,
                                        **self._fixed_arrays(node, c)))
                continue
            if self.lazy:
                index[name] = len(vertices)
                vertices.append(Vertex(name, "op", [], *empty, node))
                continue
            key = self._sig[name]
            cached = self._node_cache.get(key)
            if cached is None:
                shared = None if self._book is None or name in self.loops else \
                    self._book.nodes  # (a loop's candidates are this problem's)
                made = None if shared is None else shared.get(key)
                if made is None:
                    # small operators (biases, norms' scales, masks, losses) may also repeat
                    # their work on some axes, so they can match any neighbour cheaply
                    splits = self.loops[name].candidates() if name in self.loops else \
                        enumerate_splits(self.specs[name], mesh.device_num,
                                         not self.may_repeat(node))
                    choices = [self._op_choice(name, s) for s in splits]
                    made = (choices, [self.op_costs(node, c) for c in choices], {})
                    if shared is not None:
                        shared[key] = made
                weighted = made[2]  # (per memory weight: the problems of one weight share
                arrays = weighted.get(self.memory_weight)  # the very arrays)
                if arrays is None:
                    arrays = weighted[self.memory_weight] = self._vertex_arrays(made[1])
                cached = self._node_cache[key] = (made[0], arrays)
            choices, arrays = cached
            self._add_vertex(Vertex(name, "op", list(choices), node=node,
                                    **{k: a for k, a in arrays.items()}))

    def _add_edges(self) -> None:
        """Producer (op or input vertex) -> consumer op, one edge per consumed value."""
        values, index, vertices, edges = self.graph.values, self.index, self.vertices, \
            self.edges
        owner = weakref.ref(self)
        for node in self.graph.nodes:
            vi = index[node.name]
            for j, v in enumerate(node.inputs):
                val = values[v]
                kind = val.kind
                if kind == "literal" or kind == "const":
                    continue
                if kind == "activation" and val.producer is not None:
                    ui = index[val.producer]
                    out_index = vertices[ui].node.outputs.index(v)  # type: ignore
                else:
                    ui = index[("<param>" if kind == "param" else "<data>") + v]
                    out_index = 0
                edges.append(Edge(ui, vi, v, j, out_index, owner))

    def settle(self, splits: Mapping[int, tuple[int, ...]], *, params: bool = True
               ) -> list[int]:
        """Give every operator vertex exactly the choice of its splits and (``params``) every
        parameter the layouts its consumers now want; returns the operators' picks (all 0).
        A solver that gives the parameters their choices itself passes ``params=False``."""
        made: dict[tuple, dict[str, np.ndarray]] = {}  # per (signature, splits), shared
        for i, s in splits.items():
            vert = self.vertices[i]
            c = self._op_choice(vert.node.name, s)  # type: ignore[union-attr]
            vert.choices = [c]
            key = (self._sig[vert.name], s)
            arrays = made.get(key)
            if arrays is None:
                arrays = made[key] = self._vertex_arrays([self.op_costs(vert.node, c)])
            for name, arr in arrays.items():
                setattr(vert, name, arr)
        for e in self.edges:
            e._matrix = None
        if params:
            self._add_param_vertices(replace_existing=True)
        return [0] * len(self.vertices)

    def _fixed_params(self) -> dict[str, TensorLayout]:
        """The parameters stored at a fixed layout (``shard(parameter_plan=...)``)."""
        out = {}
        for v, splits in self.graph.parameter_layouts().items():
            try:
                out[v] = TensorLayout.from_strategy(splits, self.mesh)
            except AutoParallelError:
                raise AutoParallelError(f"parameter_plan for {v!r}", splits, "split counts "
                                        "must multiply to a divisor of device_num="
                                        f"{self.mesh.device_num}") from None
        return out

    def param_choice_set(self, v: str, layouts: Iterable[TensorLayout]
                         ) -> tuple[list[Choice], dict[str, np.ndarray]]:
        """Parameter ``v``'s choices -- replicated plus ``layouts``, deduplicated and ordered
        by split counts then name; only its fixed layout if it has one -- and their cost
        arrays (the optimizer update of a trained parameter's block, and memory)."""
        mesh = self.mesh
        if v in self.fixed_params:
            seen = {self.fixed_params[v]: None}
        else:
            seen = dict.fromkeys((TensorLayout.replicated(self.graph.spec(v).rank), *layouts))
        lays = sorted(seen, key=lambda lay: (lay.split_counts(mesh), str(lay)))
        rows = [(0.0, 0.0, 0.0, 0.0) if self.view_params else
                (self.param_update(v, lay), 0.0, 0.0, self.param_memory(v, lay))
                for lay in lays]
        return ([Choice(lay.split_counts(mesh), (), (lay,), lay.used_axes()) for lay in lays],
                self._vertex_arrays(rows, update=True))

    def widen_param(self, v: str, layouts: Iterable[TensorLayout]) -> None:
        """Add ``layouts`` to parameter ``v``'s choices (a plan searched with more choices,
        e.g. recursive_programming's, loaded back into a problem with fixed splits)."""
        i = self.index[f"<param>{v}"]
        vert = self.vertices[i]
        choices, arrays = self.param_choice_set(
            v, [*(c.out_layouts[0] for c in vert.choices), *layouts])
        vert.choices = list(choices)
        for name, arr in arrays.items():
            setattr(vert, name, arr)
        for e in self.edges:  # matrices from this parameter follow its new choice list
            if e.u == i:
                e._matrix = None

    def _add_param_vertices(self, replace_existing: bool = False) -> None:
        g = self.graph
        wanted: dict[tuple, tuple[TensorLayout, ...]] = {}  # (consumer signature, input) -> layouts
        made: dict[tuple, tuple[list[Choice], dict]] = {}
        for v in g.parameters():
            spec = g.spec(v)
            keys = []
            for cname in g.consumers(v):
                vert = self.vertices[self.index[cname]]
                for j, inp in enumerate(vert.node.inputs):  # type: ignore[union-attr]
                    if inp == v:
                        key = (self._sig[cname], j, len(vert.choices) == 1 and cname)
                        if key not in wanted:
                            wanted[key] = tuple(dict.fromkeys(c.in_layouts[j]
                                                              for c in vert.choices))
                            if cname in self.loops:  # (where a loop's body may store it)
                                wanted[key] = tuple(dict.fromkeys(
                                    wanted[key] + self.loops[cname].stored_layouts(j)))
                        keys.append(key)
            vkey = (spec.shape, spec.dtype, self.requires_grad.get(v, False), tuple(keys),
                    self.fixed_params.get(v))
            if vkey not in made:
                made[vkey] = self.param_choice_set(v, (lay for key in keys
                                                       for lay in wanted[key]))
            choices, arrays = made[vkey]
            if replace_existing:
                vert = self.vertices[self.index[f"<param>{v}"]]
                vert.choices = list(choices)
                for key, arr in arrays.items():
                    setattr(vert, key, arr)
            else:
                self._add_vertex(Vertex(f"<param>{v}", "param", list(choices), **arrays,
                                        value=v))

    def _edge_key(self, ui: int, vi: int, j: int, out_index: int) -> tuple:
        """Edges with equal keys have equal matrices (same signatures and choice lists)."""
        u, v = self.vertices[ui], self.vertices[vi]
        vkey = self._sig[v.name] if len(v.choices) != 1 else (self._sig[v.name], v.choices[0])
        if u.kind == "op":
            ukey: Any = self._sig[u.name] if len(u.choices) != 1 else (self._sig[u.name],
                                                                        u.choices[0])
        else:  # an input vertex: its layouts identify it
            ukey = tuple(c.out_layouts[0] for c in u.choices)
        return (ukey, out_index, vkey, j)

    def _edge_matrix(self, ui: int, vi: int, value: str, j: int, out_index: int) -> np.ndarray:
        u, v = self.vertices[ui], self.vertices[vi]
        key = self._edge_key(ui, vi, j, out_index)
        hit = self._edge_cache.get(key)
        if hit is not None:
            return hit
        shared = self._shared_edge_key(u, v, j, out_index)
        if shared is not None:
            hit = self._book.edges.get(shared)  # type: ignore[union-attr]
            if hit is not None:
                self._edge_cache[key] = hit
                return hit
        m = self._edge_costs(value, [cu.out_layouts[out_index] for cu in u.choices],
                             [cv.in_layouts[j] for cv in v.choices])
        self._edge_cache[key] = m
        if shared is not None:
            self._book.edges[shared] = m  # type: ignore[union-attr]
        return m

    def _shared_vector_key(self, e: Edge, at: str, other: int) -> tuple | None:
        """:meth:`Edge.vector`'s key in the price book (None without one): its edge's
        :meth:`_shared_edge_key` (from the ends' choices now), the end and the other end's
        choice."""
        if self._book is None:
            return None
        base = self._shared_edge_key(self.vertices[e.u], self.vertices[e.v], e.in_index,
                                     e.out_index)
        return None if base is None else (base, at, other)

    def _shared_edge_key(self, u: Vertex, v: Vertex, j: int, out_index: int) -> tuple | None:
        """An edge matrix's key in the price book: each end's signature and the split counts
        of its choices in order (an input vertex: its layouts), which decide its layouts;
        the consumer's signature and input ``j`` decide the value's bytes and gradient.
        None without a book, or where a loop node is an end (its choices are its
        problem's)."""
        if self._book is None or u.name in self.loops or v.name in self.loops:
            return None
        ukey: Any = (self._sig[u.name], tuple(c.splits for c in u.choices)) \
            if u.kind == "op" else tuple(c.out_layouts[0] for c in u.choices)
        return (ukey, out_index, self._sig[v.name], tuple(c.splits for c in v.choices), j)

    def _edge_costs(self, value: str, srcs: list[TensorLayout],
                    dsts: list[TensorLayout]) -> np.ndarray:
        """[len(srcs), len(dsts)] :meth:`edge_cost` of ``value``, bit for bit. A large edge's
        coefficients come from :meth:`_edge_pricer` all at once (numpy: ``a + b * nbytes``
        over the arrays, then the knee terms of the few pairs that have some); a small one's
        (or one of layouts the batch does not take) pair by pair from the same pricer's
        :meth:`~autopar.strategies.edge_pricing.EdgePricer.small` (numpy's fixed cost per
        call is more than a handful of pairs cost)."""
        grad, nbytes = self.requires_grad[value], self._nbytes[value]
        pricer = self._edge_pricer()
        if len(srcs) * len(dsts) >= pricer.MIN_PAIRS:
            coef = pricer.coefficients(srcs, dsts, grad)
            if coef is not None:
                return pricer.seconds(coef, nbytes)
        return pricer.small(srcs, dsts, grad, nbytes)

    def _edge_pricer(self) -> Any:
        """The problem's :class:`~autopar.strategies.edge_pricing.EdgePricer` (made on first
        use; it keeps the layouts' codes and the edges' coefficients)."""
        pricer = self.__dict__.get("_pricer")
        if pricer is None:
            pricer = self._pricer = EdgePricer(self.mesh, self.cm, self.enable_alltoall)
        return pricer

    def choice_index(self, i: int, splits: tuple[int, ...]) -> int:
        """Index of an operator choice with these splits; added to the vertex if missing
        (its cost arrays and edge matrices grow by one row / column)."""
        vert = self.vertices[i]
        for k, c in enumerate(vert.choices):
            if c.splits == splits:
                return k
        if vert.node is None:
            raise AutoParallelError("splits", splits, f"not a choice of {vert.name!r}")
        c = self._op_choice(vert.node.name, splits)
        row = self._vertex_arrays([self.op_costs(vert.node, c)])
        vert.choices = vert.choices + [c]
        for key in ("cost", "compute", "comm", "grad_sync", "memory"):
            setattr(vert, key, np.concatenate([getattr(vert, key), row[key]]))
        for k in self.adjacency()[i]:
            e = self.edges[k]
            if e._matrix is None:
                continue  # built lazily later, from the grown choice lists
            if e.u == i:
                col = np.array([[self.edge_cost(e.value, c.out_layouts[e.out_index],
                                                cv.in_layouts[e.in_index])
                                 for cv in self.vertices[e.v].choices]])
                e.matrix = np.vstack([e.matrix, col])
            elif e.v == i:
                col = np.array([[self.edge_cost(e.value, cu.out_layouts[e.out_index],
                                                c.in_layouts[e.in_index])]
                                for cu in self.vertices[e.u].choices])
                e.matrix = np.hstack([e.matrix, col])
        return len(vert.choices) - 1

    # ------------------------------------------------------------------ evaluation
    def adjacency(self) -> list[list[int]]:
        """Per vertex, the edges at it in edge order (kept: the edges never change once
        built; do not modify)."""
        adj = self.__dict__.get("_adjacency")
        if adj is None:
            adj = [[] for _ in self.vertices]
            for k, e in enumerate(self.edges):
                adj[e.u].append(k)
                adj[e.v].append(k)
            self._adjacency = adj
        return adj

    def evaluate(self, picks: Sequence[int], *, peak: bool = False) -> tuple[Breakdown, float]:
        """The cost breakdown of one choice index per vertex, and the objective: the plan's
        price per micro-batch (:meth:`once_per_step`) with memory priced in where it is
        (every vertex's cost, then each value's moves, a value moved to one layout counted
        once: :func:`redistribution_once`). The
        searches minimise an upper bound of it, every edge's entry
        (:mod:`~autopar.strategies.shared_moves` then prices the shared moves once).
        The breakdown's ``memory_bytes`` is the objective's additive memory (every vertex's:
        parameters, data inputs, each operator's kept residuals); ``peak``: the step's
        ordered peak instead (:meth:`step_memory`, what a plan reports)."""
        compute = self.cm.cluster.step_overhead  # the step's launch
        comm = grad_sync = memory = 0.0  # (Breakdown's defaults: the same sums, in order)
        for vert, k in zip(self.vertices, picks):  # (item: the entry as a Python float)
            compute += vert.compute.item(k)
            comm += vert.comm.item(k)
            grad_sync += vert.grad_sync.item(k)
            memory += vert.memory.item(k)
        verts = self.vertices
        moved = redistribution_once(  # (an edge that moves nothing adds nothing)
            [(e.value, verts[e.v].choices[picks[e.v]].in_layouts[e.in_index], x)
             for e in self.edges if (x := self.pair_cost(e, picks[e.u], picks[e.v]))])
        total = sum(vert.cost.item(k) for vert, k in zip(self.vertices, picks))
        if peak:
            memory = self.step_memory(picks).peak
        b = Breakdown(compute=compute, communication=comm, redistribution=moved,
                      gradient_sync=grad_sync, memory_bytes=memory)
        return b, total + moved

    def step_memory(self, picks: Sequence[int], *, update: bool = True,
                    donated: bool = False) -> StepMemory:
        """The memory one training step holds at its peak per device under the picks
        (:func:`~autopar.strategies.memory.step_memory`: parameters and state as stored,
        the batch, what backward reads in the layouts it is read in, gradients,
        transients, in the order the step runs them); ``update`` / ``donated``: see
        :meth:`param_bytes`. A loop node keeps its vertex's memory (its body's residuals
        times its trip count) until its backward."""
        layouts: dict[str, TensorLayout] = {}
        reads: dict[str, tuple[TensorLayout, ...]] = {}
        params: dict[str, ParamBytes] = {}
        opaque: dict[str, float] = {}
        again: dict[str, float] = {}
        for vert, k in zip(self.vertices, picks):
            c = vert.choices[k]
            if vert.kind == "op" and vert.node is not None:
                reads[vert.node.name] = c.in_layouts
                layouts.update(zip(vert.node.outputs, c.out_layouts))
                if vert.node.kind == LOOP_KIND:
                    opaque[vert.node.name] = vert.memory.item(k)
                    again[vert.node.name] = self._loop_recomputed(vert.node, c.splits)
            elif vert.value is not None:
                layouts[vert.value] = c.out_layouts[0]
                if vert.kind == "param":
                    params[vert.value] = self.param_bytes(vert.value, c.out_layouts[0],
                                                          update=update, donated=donated)
        for v, val in self.graph.values.items():
            layouts.setdefault(v, TensorLayout.replicated(val.spec.rank))
        sizes: dict[tuple[str, TensorLayout], float] = {}

        def local(v: str, lay: TensorLayout) -> float:
            hit = sizes.get((v, lay))
            if hit is None:
                hit = sizes[(v, lay)] = float(self._local_bytes(v, lay))
            return hit

        return step_memory(self.graph, self.residuals, self.requires_grad, layouts=layouts,
                           reads=reads, local=local, params=params, opaque=opaque,
                           update=update, again_loops=again)

    def _loop_recomputed(self, node: Node, splits: tuple[int, ...]) -> float:
        """What one iteration of a loop node's body recomputes in its backward under its
        body plan at ``splits`` (its ``jax.checkpoint`` regions' residuals:
        :func:`~autopar.strategies.memory.recomputed_bytes`; 0 without one)."""
        bg = loop_body(node).graph
        if all(n.remat is None for n in bg.nodes):
            return 0.0
        plan = self.loop_plan(node.name, splits)
        if plan is None:
            return 0.0
        seeds = frozenset(v for v in bg.inputs if bg.values[v].kind != "const")
        res = Residuals(bg, requires_grad(bg, seeds), fused_values(bg), bg.outputs,
                        parameter_values(bg))
        lay = {v: plan.layouts.get(v, TensorLayout.replicated(val.spec.rank))
               for v, val in bg.values.items()}
        return recomputed_bytes(res, lay, lambda v, la: float(local_bytes(bg, v, la,
                                                                          self.mesh)))

    def param_totals(self, i: int, dsts: Iterable[TensorLayout],
                     columns: dict[tuple, np.ndarray]) -> np.ndarray:
        """Parameter vertex ``i``'s cost per choice with its consumers reading it in
        ``dsts``: its cost vector plus the move to each distinct layout read, once (the
        rewrite moves it once per layout); ``columns`` keeps the moves (parameters of one
        choice set, one cost array, share them)."""
        v = self.vertices[i]
        total = v.cost
        value = v.value
        for dst in dict.fromkeys(dsts):
            key = (id(v.cost), self._nbytes[value], self.requires_grad[value], dst)
            col = columns.get(key)
            if col is None:
                col = columns[key] = self._edge_costs(
                    value, [c.out_layouts[0] for c in v.choices], [dst])[:, 0]
            total = total + col
        return total

    def pick_parameters(self, picks: list[int]) -> None:
        """Each parameter takes the layout cheapest for its consumers as picked (in place; a
        parameter only ever produces): :meth:`param_totals` at the layouts they read."""
        verts, edges = self.vertices, self.edges
        columns: dict[tuple, np.ndarray] = {}
        reads: dict[int, list[int]] = {}
        for k, e in enumerate(edges):
            if verts[e.u].kind == "param":
                reads.setdefault(e.u, []).append(k)
        for i, v in enumerate(verts):
            if v.kind != "param":
                continue
            dsts = [verts[edges[k].v].choices[picks[edges[k].v]].in_layouts[edges[k].in_index]
                    for k in reads.get(i, ())]
            picks[i] = int(np.argmin(self.param_totals(i, dsts, columns)))

    def pair_cost(self, e: Edge, a: int, b: int) -> float:
        """One entry of an edge's matrix, without building the matrix."""
        if e._matrix is not None:
            return e._matrix.item(a, b)
        src = self.vertices[e.u].choices[a].out_layouts[e.out_index]
        dst = self.vertices[e.v].choices[b].in_layouts[e.in_index]
        return self.edge_cost(e.value, src, dst)

    def iter_ops(self) -> Iterator[tuple[int, Vertex]]:
        for i, v in enumerate(self.vertices):
            if v.kind == "op":
                yield i, v

