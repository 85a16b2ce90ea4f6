"""Plan: the chosen strategy of every operator, the layout of every tensor, the predicted cost.

A plan is a value: frozen, its mappings read-only. A change is a new plan
(``dataclasses.replace(plan, stages=...)``, :meth:`Plan.with_notes`).

>>> plan.split_counts("params/layer0/w")   # doctest: +SKIP
(1, 8)
>>> print(plan)                              # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.strategies.layout import DeviceMesh, TensorLayout
from autopar.strategies.problem import Breakdown, Problem
from autopar.text import table as text_table

if TYPE_CHECKING:
    from autopar.graph.ir import Graph

__all__ = ["Fingerprint", "NodeStrategy", "Plan", "Pricing", "ReadOnlyDict"]


class Fingerprint:
    """The fingerprint of the graph a plan was searched on, hashed when first read.

    Why lazy: hashing a graph's canonical structure costs ~3 / 10 / 30 ms at 4 / 16 / 48
    tfm_stack blocks, a large share of a small search, while only strategy files and the
    "searched on this graph?" checks read it. It holds the graph (a Graph never changes and
    caches its own fingerprint, so the string is the one hashing at search time gave) or a
    known string. Equal when both name the same graph object or their strings are equal (so a
    plan's equality still includes its graph's fingerprint). Immutable: copies share it, and a
    deep copy (``dataclasses.asdict`` of a holder) does not copy the graph.
    """

    __slots__ = ("_graph", "_value")

    def __init__(self, source: "str | Graph") -> None:
        self._graph = None if isinstance(source, str) else source
        self._value = source if isinstance(source, str) else None

    @property
    def value(self) -> str:
        """The 32 hex characters of ``Graph.fingerprint()`` (hashed now if not yet)."""
        if self._value is None:
            self._value = self._graph.fingerprint()
        return self._value

    def of(self, graph: "Graph") -> bool:
        """Whether ``graph`` is the graph fingerprinted: the same object needs no hashing."""
        return (self._graph is not None and self._graph is graph) or \
            self.value == graph.fingerprint()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fingerprint):
            return NotImplemented
        return (self._graph is not None and self._graph is other._graph) or \
            self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    def __copy__(self) -> "Fingerprint":
        return self

    def __deepcopy__(self, memo: dict) -> "Fingerprint":
        return self


class ReadOnlyDict(dict):
    """A dict that refuses every change after construction: a plan's mappings. It reads,
    compares, prints and serialises (JSON, pickle) as the dict it was built from.

    >>> d = ReadOnlyDict({"a": 1})
    >>> d["a"], d == {"a": 1}, d
    (1, True, {'a': 1})
    >>> d["b"] = 2
    Traceback (most recent call last):
    ...
    TypeError: a plan's mappings are read-only: make a new plan with dataclasses.replace
    """

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a plan's mappings are read-only: make a new plan with "
                        "dataclasses.replace")

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple:
        return (type(self), (dict(self),))


@dataclass(frozen=True, slots=True)
class Pricing:
    """The settings a plan was priced with, beside the cluster: the redistribution table
    (``enable_alltoall``), memory's weight in the objective (seconds per byte), the parallel
    optimizer (threshold in KiB, None: off; its shard group size, -1: the whole group), the
    gradient sync's precision (:mod:`~autopar.strategies.precision`), each parameter's
    optimizer state bytes per byte (None: the cluster's factor) and the micro-batches of a
    step (the plan's ``objective`` is one micro-batch's, with 1/that of the gradient sync and
    the optimizer update)."""

    enable_alltoall: bool = False
    memory_weight: float = 0.0
    parallel_optimizer_kb: int | None = None
    optimizer_weight_shard_size: int = -1
    fp32_sync: bool = True
    optimizer_state: tuple[tuple[str, float], ...] | None = None
    micro_batches: int = 1

    @staticmethod
    def of(problem: Problem) -> "Pricing":
        """The settings ``problem`` prices with."""
        state = problem.optimizer_state
        return Pricing(problem.enable_alltoall, problem.memory_weight,
                       problem.parallel_optimizer_kb, problem.optimizer_weight_shard_size,
                       problem.fp32_sync, None if state is None else tuple(sorted(state.items())),
                       problem.micro_batches)

    def problem_args(self) -> dict[str, Any]:
        """The settings as :class:`~autopar.strategies.problem.Problem` takes them (to price
        the plan again).

        >>> sorted(Pricing(optimizer_state=(("w", 1.0),)).problem_args()["optimizer_state"])
        ['w']
        """
        return {"enable_alltoall": self.enable_alltoall, "memory_weight": self.memory_weight,
                "parallel_optimizer_kb": self.parallel_optimizer_kb,
                "optimizer_weight_shard_size": self.optimizer_weight_shard_size,
                "fp32_sync": self.fp32_sync, "optimizer_state": None
                if self.optimizer_state is None else dict(self.optimizer_state),
                "micro_batches": self.micro_batches}


@dataclass(frozen=True, slots=True)
class NodeStrategy:
    name: str
    op: str
    strategy: tuple[tuple[int, ...], ...]   # MindSpore: one tuple per input
    splits: tuple[int, ...]                 # per iteration dim
    in_layouts: tuple[TensorLayout, ...]
    out_layouts: tuple[TensorLayout, ...]
    body: "Plan | None" = None              # a loop node's: the plan of its body


@dataclass(frozen=True)
class Plan:
    """A searched (or loaded) plan, frozen: a change is a new plan (``dataclasses.replace``,
    :meth:`with_notes`); ``nodes``, ``layouts`` and ``stages`` are read-only mappings
    (:class:`ReadOnlyDict`; any mapping given is copied into one), ``notes`` a tuple.
    ``fingerprint`` is its graph's, hashed only when read (see :class:`Fingerprint`);
    construct with the graph or the string in that position. Plans are equal when every
    compared field is, the graph fingerprint included (the same graph object is equal without
    hashing); ``in_tree`` and ``cluster_config`` are not compared."""

    mode: str
    mesh: DeviceMesh
    cluster: str
    graph_fingerprint: Fingerprint          # a str or Graph given here is wrapped
    nodes: Mapping[str, NodeStrategy]
    layouts: Mapping[str, TensorLayout]     # every value: producer's (or input's) layout
    # each term at what it is per (strategies.problem.Breakdown): under pricing.micro_batches
    # > 1, ``objective`` is one micro-batch's, with 1/that of the gradient sync and the update
    cost: Breakdown
    objective: float
    search_seconds: float = 0.0
    notes: tuple[str, ...] = ()             # a list given here is made a tuple
    parameters: tuple[str, ...] = ()
    pricing: Pricing = Pricing()            # the settings it was priced with, beside cluster
    inputs: tuple[str, ...] = ()            # the graph's inputs (parameters and data), in order
    in_tree: Any = field(default=None, repr=False, compare=False)  # pytree of the arguments
    cluster_config: Any = field(default=None, repr=False, compare=False)  # the priced Cluster
    stages: Mapping[str, int] = field(default_factory=dict)  # stage per operator; absent = 0
    source: str = ""                        # the strategy file a loaded plan came from

    def __post_init__(self) -> None:
        if not isinstance(self.graph_fingerprint, Fingerprint):
            object.__setattr__(self, "graph_fingerprint", Fingerprint(self.graph_fingerprint))
        for name in ("nodes", "layouts", "stages"):
            if not isinstance(getattr(self, name), ReadOnlyDict):
                object.__setattr__(self, name, ReadOnlyDict(getattr(self, name)))
        if not isinstance(self.notes, tuple):
            object.__setattr__(self, "notes", tuple(self.notes))

    def with_notes(self, *notes: str) -> "Plan":
        """This plan with ``notes`` added after its own."""
        return replace(self, notes=self.notes + notes)

    @property
    def fingerprint(self) -> str:
        """The searched graph's ``Graph.fingerprint()`` (the graph is hashed on first read)."""
        return self.graph_fingerprint.value

    def searched_on(self, graph: "Graph") -> bool:
        """Whether this plan was searched on ``graph`` (by fingerprint; no hashing when it is
        the very graph object searched)."""
        return self.graph_fingerprint.of(graph)

    @property
    def device_num(self) -> int:
        return self.mesh.device_num

    def decisions(self) -> tuple:
        """What the plan decides, hashable: every operator's split counts and every value's
        layout (two plans with equal decisions run the same program, whatever their names,
        prices or notes)."""
        return (tuple(sorted((k, v.splits, v.body.decisions() if v.body else None)
                             for k, v in self.nodes.items())),
                tuple(sorted(self.layouts.items(), key=lambda item: item[0])))

    @staticmethod
    def from_picks(problem: Problem, picks: Sequence[int], mode: str, seconds: float) -> "Plan":
        g, mesh = problem.graph, problem.mesh
        nodes: dict[str, NodeStrategy] = {}
        layouts: dict[str, TensorLayout] = {}
        for vert, k in zip(problem.vertices, picks):
            c = vert.choices[k]
            if vert.kind == "op" and vert.node is not None:
                n = vert.node
                nodes[n.name] = NodeStrategy(n.name, n.op, c.strategy(mesh), c.splits,
                                             c.in_layouts, c.out_layouts,
                                             problem.loop_plan(n.name, c.splits))
                for v, lay in zip(n.outputs, c.out_layouts):
                    layouts[v] = lay
            elif vert.value is not None:
                layouts[vert.value] = c.out_layouts[0]
        for v, val in g.values.items():
            if v not in layouts:
                layouts[v] = TensorLayout.replicated(val.spec.rank)
        cost, objective = problem.evaluate(picks, peak=True)
        return Plan(mode, mesh, problem.cm.cluster.name, Fingerprint(g), nodes,
                    ReadOnlyDict(sorted(layouts.items())), cost, objective, seconds,
                    parameters=g.parameters(), pricing=Pricing.of(problem),
                    inputs=g.inputs, in_tree=g.in_tree, cluster_config=problem.cm.cluster)

    def layout(self, name: str) -> TensorLayout:
        """The layout of a value; a node name means its (first) output."""
        if not isinstance(name, str):
            raise AutoParallelTypeError("name", name, "a value or node name (str)")
        if name in self.layouts:
            return self.layouts[name]
        if name in self.nodes:
            return self.nodes[name].out_layouts[0]
        import difflib

        known = {k.lower(): k for k in (*self.layouts, *self.nodes)}
        close = difflib.get_close_matches(str(name).lower(), list(known), n=1)
        raise AutoParallelError("name", name, "not a value or node of this plan",
                                f"Did you mean {known[close[0]]!r}?" if close else None)

    def split_counts(self, name: str) -> tuple[int, ...]:
        """Shards per dim of a parameter, input or node output, e.g. (1, 8)."""
        return self.layout(name).split_counts(self.mesh)

    def strategy(self, node: str) -> tuple[tuple[int, ...], ...]:
        if node not in self.nodes:
            raise AutoParallelError("node", node, "not an operator of this plan")
        return self.nodes[node].strategy

    def partition_specs(self) -> dict[str, Any]:
        """``jax.sharding.PartitionSpec`` of every parameter and data input, by value name."""
        return {v: self.layouts[v].partition_spec() for v in self.inputs}

    def summary(self) -> str:
        c = self.cost
        m = self.pricing.micro_batches
        step = "step" if m == 1 else f"micro-batch (of {m} a step; gradient sync once a step)"
        return (f"plan[{self.mode}] on {self.device_num} devices ({self.mesh}), cluster "
                f"{self.cluster}: {step} {c.total * 1e3:.3f} ms predicted = compute "
                f"{c.compute * 1e3:.3f} + communication {c.communication * 1e3:.3f} + "
                f"redistribution {c.redistribution * 1e3:.3f} + gradient sync "
                f"{c.gradient_sync * 1e3:.3f} ms; memory {c.memory_bytes / 2**20:.1f} MiB per "
                f"device; " + (f"loaded from {self.source} in" if self.source else
                               "searched in") + f" {self.search_seconds:.3f} s")

    def __str__(self) -> str:
        lines = [self.summary(), ""]
        rows = [("node", "op", "strategy", "output layout")]
        for n in self.nodes.values():
            rows.append((n.name, n.op, str(n.strategy),
                         ", ".join(str(lay) for lay in n.out_layouts)))
        lines.append(text_table(rows, align="llll"))
        params = [(v, self.layouts[v]) for v in self.parameters]
        if params:
            lines += ["", "parameters:"]
            lines += [f"  {v}: {lay} (splits {lay.split_counts(self.mesh)})" for v, lay in params]
        for n in self.nodes.values():  # a loop's body plan, each iteration's
            if n.body is not None:
                body = str(n.body).split("\n")[2:]
                lines += ["", f"body of loop {n.name} (splits {n.splits}), every iteration:"]
                lines += [f"  {x}" if x else x for x in body]
        return "\n".join(lines)
