"""autopar's computation graph: tensor specs, values, operator nodes, and the Graph.

A :class:`Graph` is what :func:`autopar.trace` builds from a JAX function: operator
:class:`Node` s in topological order, each reading and writing named :class:`Value` s with
a :class:`TensorSpec` (shape, dtype). Parameters are told apart from data inputs by the
argument's pytree path (``params/layer0/w1``). Per node: FLOPs and bytes read/written for the
cost model, the user's source line, and an optional MindSpore-style strategy annotation.

>>> import jax.numpy as jnp, autopar
>>> g = autopar.trace(lambda params, x: jnp.tanh(x @ params["w"]),
...                   {"w": jnp.ones((8, 4))}, jnp.ones((2, 8)))
>>> [n.name for n in g.nodes]
['dot_general_0', 'tanh_0']
>>> g.parameters()
('params/w',)
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Literal, Mapping

import numpy as np

from autopar.errors import AutoParallelError, AutoParallelTypeError, found, safe_repr
from autopar.graph.ms_layout import layout_devices, to_strategy
from autopar.graph.prng import itemsize
from autopar.limits import MAX_DEVICES
from autopar.text import table as text_table

__all__ = ["TensorSpec", "Value", "Node", "Graph", "Strategy", "check_strategy_shape"]

Strategy = tuple[tuple[int, ...], ...]
ValueKind = Literal["param", "data", "const", "literal", "activation"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype of a tensor (global, before any split)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element: NumPy's, or a typed PRNG key's key data (``"key<fry>"``: 8)."""
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True, eq=False)
class Value:
    """A tensor in the graph: an input (param / data), a constant, or a node output."""

    name: str
    spec: TensorSpec
    kind: ValueKind
    producer: str | None = None  # node name for activations
    data: np.ndarray | None = None  # for const / literal values
    # a parameter's split counts per dim, fixed by shard(parameter_plan=...): the parameter is
    # stored so; the operators reading it stay free (the search prices any redistribution)
    layout: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Node:
    """One operator. ``params`` are the JAX primitive's own parameters (used to re-bind it)."""

    name: str
    op: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: Mapping[str, Any]
    scope: str
    source: str
    flops: int
    bytes_read: int
    bytes_written: int
    primitive: Any = field(repr=False, default=None)
    annotation: Strategy | None = None
    # its jax.checkpoint region and what the policy says of it (autopar/graph/remat.py)
    remat: Any = None


def check_strategy_shape(strategy: Any, ranks: list[int] | None, where: str) -> Strategy:
    """Validate a MindSpore strategy's form: one tuple of split counts (ints >= 1) per input,
    and, when ``ranks`` are given, one count per dimension of each input. An entry may be a
    MindSpore :class:`~autopar.graph.ms_layout.Layout` (its split counts are taken).

    >>> check_strategy_shape(((2, 1), (1, 4)), [2, 2], "matmul")
    ((2, 1), (1, 4))
    """
    strategy = to_strategy(strategy, where)
    if not isinstance(strategy, (tuple, list)) or len(strategy) == 0:
        raise AutoParallelTypeError(f"strategy for {where}", strategy,
                                    "a strategy is a non-empty tuple with one tuple of ints per "
                                    "input, e.g. ((2, 1), (1, 4))")
    out = []
    for i, entry in enumerate(strategy):
        if not isinstance(entry, (tuple, list)):
            raise AutoParallelTypeError(f"strategy for {where}", strategy,
                                        "each entry must be a tuple of ints, "
                                        + found(entry, f"[{i}]"))
        for j, s in enumerate(entry):
            if not isinstance(s, int) or isinstance(s, bool):
                raise AutoParallelTypeError(f"strategy for {where}", strategy,
                                            f"split counts must be ints, {found(s, f'[{i}][{j}]')}")
            if not 1 <= s <= MAX_DEVICES:
                raise AutoParallelError(f"strategy for {where}", strategy,
                                        f"split counts must be >= 1 and at most "
                                        f"{MAX_DEVICES}, found {safe_repr(s)} at [{i}][{j}]")
        out.append(tuple(int(s) for s in entry))  # (an IntEnum's count: a plain int)
    if ranks is not None and [len(e) for e in out] != list(ranks):
        raise AutoParallelError(
            f"strategy for {where}", strategy,
            f"it must have one entry per input with one split count per dimension: input "
            f"ranks are {list(ranks)}, the strategy gives {[len(e) for e in out]}")
    return tuple(out)


def _canonical(v: Any) -> Any:
    """A JSON-able, address-free form of a primitive parameter (for fingerprints)."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (tuple, list)):
        return [_canonical(x) for x in v]
    if isinstance(v, np.dtype) or type(v).__name__ in ("dtype", "DType"):
        return str(np.dtype(v))
    if isinstance(v, Mapping):
        return {str(k): _canonical(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if hasattr(v, "_asdict"):
        return {k: _canonical(x) for k, x in v._asdict().items()}
    text = repr(v)
    return type(v).__name__ if " at 0x" in text else text


class Graph:
    """A traced JAX function. Nodes are in topological (program) order."""

    def __init__(self, nodes: Iterable[Node], values: Mapping[str, Value],
                 inputs: Iterable[str], outputs: Iterable[str], *, in_tree: Any = None,
                 out_tree: Any = None, name: str = "fn",
                 layout_devices: Mapping[str, int] | None = None) -> None:
        self.nodes: tuple[Node, ...] = tuple(nodes)
        #: node or parameter -> the device count of the MindSpore Layouts its strategy was
        #: given with (``shard``, ``parameter_plan``, ``annotate``): a search checks it equals
        #: device_num, as for ``fixed=`` Layouts
        self.layout_devices: dict[str, int] = dict(layout_devices or {})
        self.values: dict[str, Value] = dict(values)
        self.inputs: tuple[str, ...] = tuple(inputs)
        self.outputs: tuple[str, ...] = tuple(outputs)
        self.in_tree = in_tree
        self.out_tree = out_tree
        self.name = name
        self._by_name = {n.name: n for n in self.nodes}
        self._fingerprint: str | None = None
        consumers: dict[str, list[str]] = {v: [] for v in self.values}
        for n in self.nodes:
            for v in n.inputs:
                consumers[v].append(n.name)
        self._consumers = {k: tuple(v) for k, v in consumers.items()}

    # ------------------------------------------------------------------ lookups
    def node(self, name: str) -> Node:
        try:
            return self._by_name[name]
        except KeyError:
            raise self._unknown_node(name) from None

    def _unknown_node(self, name: str) -> AutoParallelError:
        close = difflib.get_close_matches(name, list(self._by_name), n=3)
        hint = f"Did you mean {', '.join(map(repr, close))}?" if close else \
            "See graph.summary() for node names."
        return AutoParallelError("node", name, "no node of this name in the graph", hint)

    def consumers(self, value: str) -> tuple[str, ...]:
        """Names of the nodes that read a value."""
        return self._consumers[value]

    def producer(self, value: str) -> Node | None:
        p = self.values[value].producer
        return self._by_name[p] if p is not None else None

    def spec(self, value: str) -> TensorSpec:
        return self.values[value].spec

    def parameters(self) -> tuple[str, ...]:
        return tuple(v for v in self.inputs if self.values[v].kind == "param")

    def data_inputs(self) -> tuple[str, ...]:
        return tuple(v for v in self.inputs if self.values[v].kind == "data")

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self):
        return iter(self.nodes)

    @property
    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    def count_by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.op] = out.get(n.op, 0) + 1
        return dict(sorted(out.items()))

    def count_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.kind] = out.get(n.kind, 0) + 1
        return dict(sorted(out.items()))

    # ------------------------------------------------------------------ annotations
    def annotate(self, strategies: Mapping[str, Any]) -> "Graph":
        """A copy with MindSpore-style strategies attached to nodes by name.

        >>> g2 = g.annotate({"dot_general_0": ((2, 1), (1, 4))})  # doctest: +SKIP
        """
        if not isinstance(strategies, Mapping):
            raise AutoParallelTypeError("strategies", strategies,
                                        "a mapping of node name -> strategy tuple")
        new, devices = {}, dict(self.layout_devices)
        for name, strategy in strategies.items():
            if not isinstance(name, str):
                raise AutoParallelTypeError("node", name, "node names are str")
            node = self.node(name)
            ranks = [self.values[v].spec.rank for v in node.inputs]
            count = layout_devices(strategy, f"strategy for node {name!r}")
            new[name] = check_strategy_shape(strategy, ranks, f"node {name!r}")
            devices.pop(name, None)
            if count is not None:
                devices[name] = count
        nodes = [replace(n, annotation=new[n.name]) if n.name in new else n for n in self.nodes]
        return Graph(nodes, self.values, self.inputs, self.outputs, in_tree=self.in_tree,
                     out_tree=self.out_tree, name=self.name, layout_devices=devices)

    def annotations(self) -> dict[str, Strategy]:
        return {n.name: n.annotation for n in self.nodes if n.annotation is not None}

    def fix_parameters(self, layouts: Mapping[str, tuple[int, ...]],
                       devices: Mapping[str, int] | None = None) -> "Graph":
        """A copy whose parameters ``layouts`` names are stored at those split counts
        (checked by the caller: one count per dim, each dividing its size); ``devices``: the
        device count of the Layouts some were given as (:attr:`layout_devices`)."""
        values = dict(self.values)
        for v, splits in layouts.items():
            values[v] = replace(values[v], layout=tuple(splits))
        return Graph(self.nodes, values, self.inputs, self.outputs, in_tree=self.in_tree,
                     out_tree=self.out_tree, name=self.name,
                     layout_devices={**self.layout_devices, **(devices or {})})

    def parameter_layouts(self) -> dict[str, tuple[int, ...]]:
        """The parameters fixed by :meth:`fix_parameters`, with their split counts."""
        return {v: self.values[v].layout for v in self.parameters()  # type: ignore[misc]
                if self.values[v].layout is not None}

    # ------------------------------------------------------------------ gradient order
    def gradient_order(self) -> tuple[str, ...]:
        """Parameters in the order backward produces their gradients.

        A parameter's gradient is complete when backward has passed its first use in forward,
        so the order is by first use, latest first (ties: later operand first). Unused
        parameters (zero gradients, ready at once) come first, in argument order.
        """
        first_use: dict[str, tuple[int, int]] = {}
        for i, n in enumerate(self.nodes):
            for j, v in enumerate(n.inputs):
                if self.values[v].kind == "param" and v not in first_use:
                    first_use[v] = (i, j)
        params = self.parameters()
        unused = [p for p in params if p not in first_use]
        used = sorted((p for p in params if p in first_use), key=lambda p: first_use[p],
                      reverse=True)
        return tuple(unused + used)

    # ------------------------------------------------------------------ identity
    def structure(self) -> dict[str, Any]:
        """A canonical, JSON-able description: structure, shapes, dtypes (no source lines)."""
        def val(v: str) -> Any:
            x = self.values[v]
            entry: dict[str, Any] = {"name": v, "kind": x.kind, "shape": list(x.spec.shape),
                                     "dtype": x.spec.dtype}
            if x.kind in ("literal", "const") and x.data is not None:
                entry["data"] = hashlib.sha256(np.ascontiguousarray(x.data).tobytes()) \
                    .hexdigest()[:16]
            return entry

        return {
            "inputs": [val(v) for v in self.inputs],
            "nodes": [{"name": n.name, "op": n.op, "inputs": [val(v) if self.values[v].kind in
                                                              ("literal", "const") else v
                                                              for v in n.inputs],
                       "outputs": [val(v) for v in n.outputs],
                       "params": _canonical(dict(n.params))} for n in self.nodes],
            "outputs": list(self.outputs),
        }

    def fingerprint(self) -> str:
        """Stable hash of structure + shapes + dtypes: same graph, same string, any process."""
        if self._fingerprint is None:  # a graph never changes: hash it once
            blob = json.dumps(self.structure(), sort_keys=True, separators=(",", ":"))
            self._fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:32]
        return self._fingerprint

    # ------------------------------------------------------------------ printing
    def summary(self, max_rows: int | None = None) -> str:
        """A readable table: node, op, inputs -> outputs, GFLOP, MB moved, annotation."""
        rows = [("node", "op", "inputs -> outputs", "MFLOP", "KB r/w", "strategy")]
        nodes = self.nodes if max_rows is None else self.nodes[:max_rows]
        for n in nodes:
            ins = ", ".join(str(self.values[v].spec) for v in n.inputs
                            if self.values[v].kind != "literal")
            outs = ", ".join(str(self.values[v].spec) for v in n.outputs)
            rows.append((n.name, n.op, f"{ins} -> {outs}", f"{n.flops / 1e6:.3f}",
                         f"{n.bytes_read / 1024:.1f}/{n.bytes_written / 1024:.1f}",
                         str(n.annotation) if n.annotation else ""))
        lines = text_table(rows, align="l" * len(rows[0])).split("\n")
        if max_rows is not None and len(self.nodes) > max_rows:
            lines.append(f"... {len(self.nodes) - max_rows} more nodes")
        n_params = len(self.parameters())
        param_elems = sum(self.values[p].spec.size for p in self.parameters())
        lines.append(f"{len(self.nodes)} nodes, {n_params} parameters ({param_elems:,} "
                     f"elements), {len(self.data_inputs())} data inputs, "
                     f"{self.total_flops / 1e9:.3f} GFLOP forward, fingerprint "
                     f"{self.fingerprint()[:12]}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Graph({self.name!r}, {len(self.nodes)} nodes, {len(self.parameters())} params,"
                f" {len(self.data_inputs())} data inputs)")
