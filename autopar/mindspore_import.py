"""Import MindSpore's own JSON strategy file as fixed strategies for :func:`autopar.search`.

MindSpore (``strategy_ckpt_config={"save_file": "x.json"}``, or a ``.json``
``strategy_ckpt_save_file``) writes::

    {"current_stage": 0,
     "parallel_strategy_item": {"MatMul_blocks.0.w1": {"stage": 0,
                                                       "parallel_strategy": [[2, 1], [1, 4]]}},
     "parallel_layout_item": {"blocks.0.w1": {"dev_matrix": [...], "tensor_map": [...],
                                              "tensor_shape": [4096, 16384], ...}, ...}}

MindSpore 2.6's operator-strategy file (``set_op_strategy_config`` /
``save_operator_strategy_file``, sharding propagation) may instead hold Layouts,
``parallel_layout_value_item: {"Default/network-Net/MatMul-op0": {"0": {"dev_matrix": [2, 4],
"tensor_map": [[1], [-1]], "alias_name": [...], "interleaved_parallel": false}, "1": ...}}``:
each is read as the strategy of its split counts (the inputs keyed ``"0"`` to ``"n-1"``, a
device-matrix axis on one dim at most, ``interleaved_parallel`` a bool: else
:class:`StrategyFileError`). An entry MindSpore saved empty
(``"parallel_strategy": []``: the script shards that operator with a Layout, which the strategy
checkpoint does not record) is skipped with that reason, and a parameter's ``tensor_shape``
written expanded (a dim split over several axes becomes several dims) is grouped back.

Each entry is mapped onto one autopar node, in this order:

1. ``name_map={mindspore name: autopar node}`` when given (it wins), and names the graph has
   (a file autopar wrote): the strategy is taken as it is;
2. ``<OpType>_<parameter>`` (MindSpore 2.x: the operator of that type that reads the
   parameter): the parameter is found among the graph's by its name with separators (``.``,
   ``/``), list indices (``blocks.0`` = ``blocks/0`` = ``block0``) and leading scopes ignored
   (:func:`match_parameter`), then the node of the type's JAX primitives (:data:`MS_OPS`) that
   reads it, directly or through transposes, casts, broadcasts and size-1 reshapes (whose nodes
   are fixed too, with the parameter's layout);
3. ``.../<OpType>-op<N>`` (older files): by type and order — the k-th operator of a primitive
   (ordered by N) maps to the k-th autopar node of it, only when both sides have the same
   number (otherwise all are reported ambiguous). Types JAX decomposes into several nodes are
   counted by one node each: GeLU by its ``tanh``, Softmax by its ``exp``, LayerNorm by its
   ``rsqrt``, ReduceMean by its ``reduce_sum``.

A MindSpore strategy gives, per operator input as MindSpore stores it, the split of each dim.
It is carried onto the JAX node's inputs as traced: for MatMul / BatchMatMul / Dense by the
role of each dim (batch, rows, contracted, columns), with ``transpose_a`` / ``transpose_b``
taken from ``attrs=``, else from the parameter's ``tensor_shape`` in the file when only one
orientation fits, else from how the JAX program stores the input (a weight used as
``x @ w.T`` is stored transposed); for the other types by broadcasting (right-aligned, a
parameter through its path). The result is checked with the search's own rules for the node
(one entry per input, matched dims split alike, splits divide dims, the product fits the
devices: ``device_num=``, else the file's ``dev_matrix``, of its parameters' layouts and its
operators' Layouts). What cannot be mapped or does not fit goes to
:attr:`MindSporeImport.skipped` with the reason (or raises with ``strict=True``), never into
``fixed``. Use the result as ``autopar.search(graph, fixed=imported.fixed)`` under
``semi_auto_parallel`` or ``auto_parallel``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from autopar.checkpoint import StrategyFileError, max_file_bytes
from autopar.errors import AutoParallelError, AutoParallelTypeError, type_name
from autopar.errors import found as _found
from autopar.files import path_text, read_json
from autopar.graph.ir import Graph, Node, Strategy, check_strategy_shape
from autopar.limits import MAX_DEVICES
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.opspec import op_spec
from autopar.strategies.problem import splits_from_strategy

__all__ = ["MS_OPS", "MS_TO_JAX", "MsOp", "MindSporeImport", "import_mindspore_strategy",
           "match_parameter"]


@dataclass(frozen=True)
class MsOp:
    """How a MindSpore operator type lands on autopar's traced JAX nodes.

    ``prims``: the JAX primitives of the node that reads a parameter (``<Type>_<param>``
    keys); ``order_prim``: the one node per operator counted for ``<Type>-op<N>`` keys;
    ``arity``: MindSpore's tensor inputs (one strategy entry each; a scalar's may be left
    out); ``matmul``: MatMul
    semantics (transposes, batch dims) instead of broadcasting; ``inputs``: per primitive, the
    MindSpore inputs that fall on the node's tensor inputs (default: all, in order);
    ``params``: the inputs that are parameters in MindSpore."""

    prims: tuple[str, ...]
    order_prim: str
    arity: int = 1
    matmul: bool = False
    inputs: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    params: tuple[int, ...] = ()


def _unary(prim: str, *more: str) -> MsOp:
    return MsOp((prim, *more), prim)


def _binary(prim: str, *more: str) -> MsOp:
    return MsOp((prim, *more), prim, arity=2)


_MATMUL = MsOp(("dot_general",), "dot_general", arity=2, matmul=True)
#: MindSpore operator type -> how it maps (see :class:`MsOp`).
MS_OPS: dict[str, MsOp] = {
    "MatMul": _MATMUL, "BatchMatMul": _MATMUL, "Dense": _MATMUL,
    "Conv2D": _binary("conv_general_dilated"), "Gather": _binary("gather"),
    "Add": _binary("add", "add_any"), "BiasAdd": _binary("add"), "Sub": _binary("sub"),
    "Mul": _binary("mul"), "RealDiv": _binary("div"), "Div": _binary("div"),
    "Maximum": _binary("max"), "Minimum": _binary("min"), "Pow": _binary("pow", "integer_pow"),
    "Square": _unary("square", "integer_pow"), "Neg": _unary("neg"), "Exp": _unary("exp"),
    "Log": _unary("log"), "Sqrt": _unary("sqrt"), "Rsqrt": _unary("rsqrt"),
    "Tanh": _unary("tanh"), "Sigmoid": _unary("logistic"), "Erf": _unary("erf"),
    "ReLU": _unary("max"), "Cast": _unary("convert_element_type"),
    "Reshape": _unary("reshape"), "Transpose": _unary("transpose"),
    "ReduceSum": _unary("reduce_sum"), "ReduceMean": _unary("reduce_sum"),
    "ReduceMax": _unary("reduce_max"), "ReduceMin": _unary("reduce_min"),
    "GeLU": MsOp(("tanh", "erf"), "tanh"), "FastGeLU": _unary("logistic"),
    "Softmax": _unary("exp"), "LogSoftmax": _unary("exp"),
    "LayerNorm": MsOp(("mul", "add"), "rsqrt", arity=3, params=(1, 2),
                      inputs={"mul": (0, 1), "add": (0, 2), "rsqrt": (0,)}),
}
#: MindSpore operator type -> the JAX primitive counted for it (``<Type>-op<N>`` keys).
MS_TO_JAX: dict[str, str] = {t: op.order_prim for t, op in MS_OPS.items()}

_OP_RE = re.compile(r"([A-Za-z0-9_]+)-op([0-9]+)$")
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() takes "²", int() not
_PARAM_RE = re.compile(r"([A-Z][A-Za-z0-9]*)_(.+)$")
_FLAGS = ("transpose_a", "transpose_b")
_PASS = frozenset({"transpose", "convert_element_type", "copy", "copy_p", "reduce_precision",
                   "broadcast_in_dim", "reshape", "squeeze", "expand_dims"})
_MAX_HOPS = 8


@dataclass
class MindSporeImport:
    """The strategies that mapped (``fixed``, by autopar node name), how each MindSpore name was
    mapped, what was skipped and why, and the parameter names the file lists. ``via``: the
    nodes between a parameter and its operator (transpose, cast, broadcast) also fixed, with
    the parameter's layout; ``notes``: how an entry was read (e.g. an inferred transpose)."""

    fixed: dict[str, Strategy] = field(default_factory=dict)
    mapped: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    parameters: tuple[str, ...] = ()
    via: dict[str, tuple[str, ...]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [f"{len(self.mapped)} strategies imported, {len(self.skipped)} skipped"]
        for ms, node in sorted(self.mapped.items()):
            extra = [f"via {', '.join(self.via[ms])}"] if self.via.get(ms) else []
            extra += [self.notes[ms]] if ms in self.notes else []
            lines.append(f"  {ms} -> {node} {self.fixed[node]}"
                         + (f" ({'; '.join(extra)})" if extra else ""))
        lines += [f"  skipped {ms}: {why}" for ms, why in sorted(self.skipped.items())]
        return "\n".join(lines)


class _Skip(Exception):
    """An entry that maps onto no node (the reason is the message)."""


@dataclass
class _Mapped:
    node: str
    strategy: Strategy
    via: dict[str, Strategy] = field(default_factory=dict)
    note: str = ""


# ----------------------------------------------------------------------------- the file

_ITEMS = "an object of node name -> {stage, parallel_strategy}"
#: marks an entry made from parallel_layout_value_item (no JSON value is this object), whose
#: empty strategy means an interleaved Layout
_INTERLEAVED = object()


def _load(path: Any) -> Any:
    """The JSON the file at ``path`` holds."""
    what = "the path of MindSpore's JSON strategy file (a str or os.PathLike)"
    try:
        text = path_text(path, "path")  # (an os.PathLike giving bytes, or failing, too)
    except AutoParallelTypeError:
        raise AutoParallelTypeError("path", path, what) from None
    if "\0" in text:
        raise StrategyFileError(path, "<file>", "a path without a NUL byte", repr(path))
    # a regular file, capped, strict JSON (a duplicated key is refused, not the last kept)
    return read_json(path, limit=max_file_bytes(), error=StrategyFileError)


def _section(path: Any, data: dict[str, Any], key: str, expected: str,
             optional: bool) -> dict[str, Any]:
    """``data[key]``, an object (``optional``: {} when absent or null)."""
    value = data.get(key)
    if value is None and optional:
        return {}
    if not isinstance(value, dict):
        raise StrategyFileError(path, key, expected, value if key in data else "<missing>")
    return value


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's JSON, its sections checked (each an object), the Layouts of
    ``parallel_layout_value_item`` merged into ``parallel_strategy_item`` as strategies."""
    data = _load(path)
    if not isinstance(data, dict):
        raise StrategyFileError(path, "<root>", "an object with parallel_strategy_item",
                                type_name(data))
    values = "parallel_layout_value_item" in data
    items = _section(path, data, "parallel_strategy_item", _ITEMS, optional=values)
    for name, item in items.items():
        if not isinstance(item, dict) or "parallel_strategy" not in item:
            raise StrategyFileError(path, f"parallel_strategy_item.{name}",
                                    "{stage, parallel_strategy}", item)
        stage = item.get("stage", 0)
        if type(stage) is not int or stage < 0:
            raise StrategyFileError(path, f"parallel_strategy_item.{name}.stage",
                                    "an int >= 0 (the operator's pipeline stage)",
                                    f"{stage!r} ({type_name(stage)})")
    if values:
        items = {**items, **_layout_values(path, _section(
            path, data, "parallel_layout_value_item", "an object of node name -> {input "
            "index: layout}", optional=False))}
    layouts = _section(path, data, "parallel_layout_item", "an object of parameter name -> "
                       "layout", optional=True)
    for name, lay in layouts.items():
        _check_layout(path, name, lay)
    return {**data, "parallel_strategy_item": items, "parallel_layout_item": layouts}


def _layout_values(path: Any, section: Mapping[str, Any]) -> dict[str, Any]:
    """MindSpore 2.6's operator-strategy file (``set_op_strategy_config`` /
    ``save_operator_strategy_file``) stores an operator sharded with a Layout as
    ``parallel_layout_value_item: {node: {"0": layout, "1": layout, ...}}``, one layout per
    input, keyed ``"0"`` to ``"n-1"`` (``dev_matrix``, ``tensor_map`` nested per dim,
    ``alias_name``, ``interleaved_parallel``). Each becomes a strategy entry: per dim the
    product of the sizes of the device-matrix dims it is mapped to (counted from the right,
    -1 whole). An interleaved layout has no autopar counterpart: its entry is left empty, so
    it is skipped with the reason."""
    out: dict[str, Any] = {}
    for name, per_input in section.items():
        where = f"parallel_layout_value_item.{name}"
        n = len(per_input) if isinstance(per_input, dict) else 0
        if not n or set(per_input) != {str(i) for i in range(n)}:
            raise StrategyFileError(path, where, "an object of input index -> layout, one "
                                    "per input, keyed \"0\", \"1\", ... \"n-1\"", per_input)
        entries = [_layout_splits(path, f"{where}.{i}", per_input[str(i)]) for i in range(n)]
        out[name] = {"stage": 0, "layout": _INTERLEAVED,
                     "parallel_strategy": [] if None in entries else entries}
    return out


def _layout_splits(path: Any, where: str, lay: Any) -> list[int] | None:
    """One input's split counts from a MindSpore layout dict (None: interleaved). A
    device-matrix dim shards at most one tensor dim, once (as :class:`autopar.Layout`)."""
    if not isinstance(lay, dict) or not isinstance(lay.get("tensor_map"), list):
        raise StrategyFileError(path, where, "an object with dev_matrix and tensor_map", lay)
    interleaved = lay.get("interleaved_parallel", False)
    if not isinstance(interleaved, bool):
        raise StrategyFileError(path, f"{where}.interleaved_parallel", "true or false",
                                repr(interleaved))
    dev = lay.get("dev_matrix")
    if not isinstance(dev, list) or not dev:
        raise StrategyFileError(path, f"{where}.dev_matrix", "a non-empty list of ints >= 1",
                                dev)
    _check_sizes(path, f"{where}.dev_matrix", dev, devices=not interleaved)
    if interleaved:  # its dev_matrix holds the virtual interleaving axis too
        return None
    axes = [dim if isinstance(dim, list) else [dim] for dim in lay["tensor_map"]]
    used = [a for dim in axes for a in dim]
    if not all(isinstance(a, int) and not isinstance(a, bool) and -1 <= a < len(dev)
               for a in used):
        raise StrategyFileError(path, f"{where}.tensor_map", f"per dim a device-matrix "
                                f"index in [-1, {len(dev) - 1}] or a list of them",
                                lay["tensor_map"])
    used = [a for a in used if a != -1]
    if len(used) != len(set(used)):
        raise StrategyFileError(path, f"{where}.tensor_map", "each device-matrix index at "
                                "most once (an axis shards one dim)", lay["tensor_map"])
    return [math.prod(dev[len(dev) - 1 - a] for a in dim if a != -1) for dim in axes]


def _check_sizes(path: Any, where: str, sizes: Any, devices: bool = False) -> None:
    """``sizes`` is a list of ints >= 1; ``devices``: a device matrix, whose product (the
    devices it names) is at most ``MAX_DEVICES``."""
    if not isinstance(sizes, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
        raise StrategyFileError(path, where, "a list of ints >= 1", sizes)
    total = 1
    for n in sizes if devices else ():
        total *= n  # stops early: a long list of sizes makes a huge product
        if total > MAX_DEVICES:
            raise StrategyFileError(path, where, f"a device matrix of at most {MAX_DEVICES} "
                                    "devices (the product of its sizes)", sizes)


def _check_layout(path: Any, name: str, lay: Any) -> None:
    if not isinstance(lay, dict):
        raise StrategyFileError(path, f"parallel_layout_item.{name}", "an object with "
                                "dev_matrix, tensor_map, tensor_shape", lay)
    for key in ("dev_matrix", "tensor_shape"):
        if lay.get(key) is not None:
            _check_sizes(path, f"parallel_layout_item.{name}.{key}", lay[key],
                         devices=key == "dev_matrix")
    tmap, mat = lay.get("tensor_map"), lay.get("dev_matrix")
    if tmap is not None and isinstance(mat, list):
        dims = [x for e in tmap for x in (e if isinstance(e, list) else [e])] \
            if isinstance(tmap, list) else None
        if dims is None or any(type(x) is not int or not -1 <= x < len(mat) for x in dims):
            raise StrategyFileError(path, f"parallel_layout_item.{name}.tensor_map",
                                    f"per tensor dim -1 or a dim of the {len(mat)}-dim "
                                    f"dev_matrix, 0 to {len(mat) - 1} (or a list of them)",
                                    tmap)


def _file_devices(data: Mapping[str, Any]) -> int | None:
    """The device count the file's layouts name (their device matrix: parameters' layouts,
    operators' non-interleaved Layouts), if any."""
    mats = [lay.get("dev_matrix") for lay in data["parallel_layout_item"].values()]
    mats += [lay["dev_matrix"] for per in (data.get("parallel_layout_value_item") or {}).values()
             for lay in per.values() if not lay.get("interleaved_parallel")]
    counts = [math.prod(m) for m in mats if m]
    return max(counts) if counts else None


def _check_args(path: Any, items: Mapping[str, Any], name_map: Any, attrs: Any) -> None:
    if name_map is not None and not isinstance(name_map, Mapping):
        raise AutoParallelTypeError("name_map", name_map, "a mapping of MindSpore name -> "
                                    "autopar node name")
    for ms, node in (name_map or {}).items():
        if not isinstance(ms, str) or not isinstance(node, str):
            raise AutoParallelTypeError("name_map", name_map, (
                f"MindSpore names must be str, {_found(ms)}" if not isinstance(ms, str) else
                f"autopar node names must be str, {_found(node, f'[{ms!r}]')}"))
        if ms not in items:
            raise AutoParallelError("name_map", ms, f"not an operator of {str(path)!r}")
    if attrs is not None and not isinstance(attrs, Mapping):
        raise AutoParallelTypeError("attrs", attrs, "a mapping of MindSpore name -> "
                                    "{'transpose_a': bool, 'transpose_b': bool}")
    for ms, a in (attrs or {}).items():
        if ms not in items:
            raise AutoParallelError("attrs", ms, f"not an operator of {str(path)!r}")
        if not isinstance(a, Mapping) or any(k not in _FLAGS or not isinstance(v, bool)
                                             for k, v in a.items()):
            raise AutoParallelTypeError(f"attrs[{ms!r}]", a, "a mapping of transpose_a / "
                                        "transpose_b -> bool (MindSpore's MatMul attributes)")


# ----------------------------------------------------------------------------- parameters


def _tokens(name: str) -> tuple[str, ...]:
    """Words and indices of a name; separators, case and a plural before an index ignored:
    ``blocks.0.w1``, ``blocks/0/w1`` and ``block0/w1`` all give ``(block, 0, w, 1)``."""
    runs = [(r.lstrip("0") or "0") if _DIGITS.fullmatch(r) else r  # an index: 007 is 7
            for part in re.split(r"[./]", name) for r in re.findall(r"[0-9]+|[^0-9]+", part)]
    toks = [r.strip("_-").lower() for r in runs]
    toks = [t for t in toks if t]
    return tuple(t[:-1] if len(t) > 1 and t.endswith("s") and i + 1 < len(toks)
                 and _DIGITS.fullmatch(toks[i + 1]) else t for i, t in enumerate(toks))


def _common_suffix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def match_parameter(graph: Graph, name: str) -> str:
    """The graph parameter (value name) that a MindSpore parameter name denotes.

    Names match when one's words and indices (:func:`_tokens`) end the other's: all of the
    MindSpore name, or all of autopar's below the argument name (``params/``). The longest
    such match wins; a tie or no match raises :class:`AutoParallelError`.

    >>> import jax.numpy as jnp, autopar
    >>> g = autopar.trace(lambda p, x: x @ p["blocks"][0]["w1"], {"blocks": [{"w1":
    ...     jnp.ones((4, 4))}]}, jnp.ones((2, 4)))
    >>> match_parameter(g, "backbone.blocks.0.w1")
    'p/blocks/0/w1'
    """
    want = _tokens(name)
    scored = []
    for p in graph.parameters() or graph.inputs:
        below = _tokens(p.split("/", 1)[1]) if "/" in p else ()
        n = _common_suffix(want, _tokens(p))
        if n and (n == len(want) or n >= len(below)):
            scored.append((n, p))
    best = max((n for n, _ in scored), default=0)
    top = sorted(p for n, p in scored if n == best)
    if len(top) != 1:
        why = (f"ambiguous: it matches the graph's parameters {top}" if top else
               f"no parameter of the graph has this name (it has {list(graph.parameters())})")
        raise AutoParallelError("MindSpore parameter", name, why, "Pass name_map")
    return top[0]


# ----------------------------------------------------------------------------- dataflow


def _pass_map(graph: Graph, node: Node) -> tuple[int | None, ...] | None:
    """For a node that only moves a tensor (transpose, cast, broadcast, size-1 reshape): per
    output dim, the input dim it holds (None: a new dim); None for any other node."""
    if node.op not in _PASS or not node.inputs:
        return None
    src = graph.spec(node.inputs[0]).shape
    out = graph.spec(node.outputs[0]).shape
    if node.op == "transpose":
        return tuple(node.params["permutation"])
    if node.op == "broadcast_in_dim":
        m: list[int | None] = [None] * len(out)
        for i, o in enumerate(node.params["broadcast_dimensions"]):
            m[o] = i if src[i] == out[o] else None
        return tuple(m)
    if node.op in ("reshape", "squeeze", "expand_dims"):
        a = [d for d, n in enumerate(src) if n != 1]
        b = [d for d, n in enumerate(out) if n != 1]
        if [src[d] for d in a] != [out[d] for d in b]:
            return None
        m = [None] * len(out)
        for i, o in zip(a, b):
            m[o] = i
        return tuple(m)
    return tuple(range(len(out)))


def _walk_back(graph: Graph, value: str) -> tuple[str, tuple[int | None, ...], list[Node]]:
    """The value ``value`` moves (through :func:`_pass_map` nodes), the source dim of each of
    its dims, and the moving nodes from the source outward."""
    m: tuple[int | None, ...] = tuple(range(graph.spec(value).rank))
    path: list[Node] = []
    while (p := graph.producer(value)) is not None and (pm := _pass_map(graph, p)) is not None:
        m = tuple(pm[d] if d is not None else None for d in m)
        path.append(p)
        value = p.inputs[0]
    return value, m, path[::-1]


def _consumer(graph: Graph, param: str, prims: Iterable[str]) -> tuple[Node, int]:
    """The node of ``prims`` that reads ``param`` (through moving nodes), and its input slot."""
    prims, frontier = tuple(prims), [param]
    for _ in range(_MAX_HOPS):
        found: list[tuple[Node, int]] = []
        nxt: list[str] = []
        for v in frontier:
            for node in map(graph.node, graph.consumers(v)):
                if node.op in prims:
                    found += [(node, j) for j, u in enumerate(node.inputs) if u == v]
                elif node.inputs[0] == v and _pass_map(graph, node) is not None:
                    nxt.append(node.outputs[0])
        if len(found) == 1:
            return found[0]
        if found:
            names = sorted({n.name for n, _ in found})
            raise _Skip(f"ambiguous: parameter {param!r} is read {len(found)} times by "
                        f"{'/'.join(prims)} nodes {names}; pass name_map")
        frontier = nxt
    raise _Skip(f"no {'/'.join(prims)} node reads parameter {param!r} (directly or through "
                "transpose, cast, broadcast or reshape)")


# ----------------------------------------------------------------------------- strategies


def _dot_roles(graph: Graph, node: Node) -> tuple[tuple[str, ...], ...]:
    """Per dot_general input, each dim's role: ``k`` (contracted), ``m`` / ``n`` (the last
    free dim of lhs / rhs), ``b1``, ``b2``, ... (the free dims before it, from the right)."""
    (lc, rc), _ = node.params["dimension_numbers"]
    out = []
    for v, contract, last in zip(node.inputs, (lc, rc), "mn"):
        rank = graph.spec(v).rank
        free = [d for d in range(rank) if d not in contract]
        if len(contract) != 1 or not free:
            raise AutoParallelError(f"node {node.name!r}", node.op, "a MatMul needs one "
                                    "contracted dim and a free dim in each input")
        roles = {contract[0]: "k"}
        for i, d in enumerate(reversed(free)):
            roles[d] = last if i == 0 else f"b{i}"
        out.append(tuple(roles[d] for d in range(rank)))
    return tuple(out)


def _ms_roles(i: int, rank: int, transposed: bool) -> tuple[str, ...]:
    """The roles of the dims of MindSpore's MatMul input ``i`` (0: a, 1: b) as stored."""
    pair = ("m", "k") if i == 0 else ("k", "n")
    return tuple(f"b{rank - 2 - d}" for d in range(rank - 2)) + \
        (pair[::-1] if transposed else pair)


def _transposed(graph: Graph, node: Node, j: int, roles: tuple[str, ...], given: bool | None,
                stored: list[int] | None) -> tuple[bool, str]:
    """Whether MindSpore stores MatMul input ``j`` transposed, and what decided it."""
    if given is not None:
        return given, "attrs"
    if stored is not None:
        size = dict(zip(roles, graph.spec(node.inputs[j]).shape))
        fits = [t for t in (False, True) if len(stored) == len(roles)
                and [size[r] for r in _ms_roles(j, len(roles), t)] == list(stored)]
        if not fits:
            raise AutoParallelError("tensor_shape", stored, f"the parameter is read as "
                                    f"{graph.spec(node.inputs[j]).shape} by {node.name!r}, in "
                                    "neither orientation of MindSpore's shape")
        if len(fits) == 1:
            return fits[0], "the file's tensor_shape"
    src, m, _ = _walk_back(graph, node.inputs[j])
    rank = graph.spec(src).rank
    by_src = {s: r for r, s in zip(roles, m) if s is not None}
    tail = tuple(by_src.get(d) for d in range(rank - 2, rank))
    plain = _ms_roles(j, 2, False)
    if tail in (plain, plain[::-1]):
        return tail != plain, f"{src!r} is stored so"
    return roles[-2:] != plain, "as the node reads it"


def _flags(graph: Graph, node: Node, given: Mapping[str, bool],
           param: tuple[int, Any] | None) -> tuple[tuple[bool, ...], str]:
    roles = _dot_roles(graph, node)
    flags, notes = [], []
    for j, flag in enumerate(_FLAGS):
        stored = param[1] if param is not None and param[0] == j else None
        t, how = _transposed(graph, node, j, roles[j], given.get(flag), stored)
        flags.append(t)
        if t:
            notes.append(f"{flag}: {how}")
    return tuple(flags), ", ".join(notes)


def _matmul_sourced(graph: Graph, node: Node, st: Strategy,
                    flags: tuple[bool, ...]) -> dict[tuple[int, int], int]:
    """The split of each (input, dim) of a dot_general from a MatMul strategy, by dim role."""
    sourced = {}
    for j, (roles, entry, t) in enumerate(zip(_dot_roles(graph, node), st, flags)):
        if len(entry) != len(roles):
            raise AutoParallelError(f"strategy for {node.name}", st, f"MindSpore's input {j} "
                                    f"has rank {len(entry)}, the node's {len(roles)}")
        split = dict(zip(_ms_roles(j, len(entry), t), entry))
        sourced.update(((j, d), split[r]) for d, r in enumerate(roles))
    return sourced


def _grouped(expanded: list[int], shape: Sequence[int]) -> list[int] | None:
    """``shape`` if consecutive runs of ``expanded`` multiply to its dims, in order."""
    out, i = [], 0
    for dim in shape:
        if i == len(expanded):
            return None
        prod, i = expanded[i], i + 1
        while i < len(expanded) and prod < dim:
            prod, i = prod * expanded[i], i + 1
        if prod != dim:
            return None
        out.append(dim)
    return out if i == len(expanded) else None


def _unexpanded(stored: list[int] | None, shape: tuple[int, ...]) -> list[int] | None:
    """A parameter's ``tensor_shape`` as MindSpore stores the tensor. MindSpore writes the
    shape of a dim split over several axes (a Layout's tuple alias) as several dims: the
    axes' sizes, then the rest (``[1024, 512]`` split ``(("dp", "sp"), "mp")`` is written
    ``[2, 512, 512]``). Such a shape is grouped back onto the graph's parameter, in its
    orientation or (rank 2) transposed; None when neither fits (the shape decides nothing)."""
    if stored is None or len(stored) == len(shape):
        return stored
    fits = {tuple(g) for g in (_grouped(stored, shape), _grouped(stored, shape[::-1])) if g}
    return list(fits.pop()) if len(fits) == 1 else None


def _stored_order(shape: tuple[int, ...], stored: list[int] | None) -> tuple[int, ...]:
    """Per dim of the graph's parameter, the dim of the tensor MindSpore stores (its
    ``tensor_shape`` in the file: the same, or a rank-2 tensor transposed)."""
    if stored is None or list(stored) == list(shape):
        return tuple(range(len(shape)))
    if len(shape) == 2 and list(stored) == list(shape)[::-1]:
        return (1, 0)
    raise AutoParallelError("tensor_shape", stored, f"the graph's parameter has shape {shape}")


def _generic_sourced(graph: Graph, node: Node, st: Strategy, op: MsOp,
                     param: tuple[int, Any] | None) -> dict[tuple[int, int], int]:
    """The split of each (input, dim) of the node from a broadcasting operator's strategy:
    MindSpore's entries on the node's tensor inputs in order, right-aligned; a parameter's
    entry through its path from the stored tensor."""
    slots = [j for j, v in enumerate(node.inputs) if graph.spec(v).rank > 0]
    ents = list(op.inputs.get(node.op, range(len(st))))
    if len(ents) != len(slots):  # MindSpore's scalar inputs have no node input
        ents = [e for e in ents if e < len(st) and st[e]]
    if len(ents) != len(slots) or any(e >= len(st) for e in ents):
        raise AutoParallelError(f"strategy for {node.name}", st, f"the node reads "
                                f"{len(slots)} tensors, MindSpore's operator {len(st)}")
    k = slots.index(param[0]) if param is not None else -1
    other = next((i for i, e in enumerate(ents) if e in op.params), None)
    if k >= 0 and other is not None and ents[k] not in op.params:  # LayerNorm's gamma, beta
        ents[k], ents[other] = ents[other], ents[k]
    sourced = {}
    for j, e in zip(slots, ents):
        entry, rank = st[e], graph.spec(node.inputs[j]).rank
        if param is not None and j == param[0]:
            src, m, _ = _walk_back(graph, node.inputs[j])
            to_ms = _stored_order(graph.spec(src).shape, param[1])
            if len(entry) != len(to_ms):
                raise AutoParallelError(f"strategy for {node.name}", st, f"entry {e} has rank "
                                        f"{len(entry)}, parameter {src!r} {len(to_ms)}")
            sourced.update(((j, d), entry[to_ms[s]]) for d, s in enumerate(m) if s is not None)
            continue
        if len(entry) > rank:
            raise AutoParallelError(f"strategy for {node.name}", st, f"entry {e} has rank "
                                    f"{len(entry)}, the node's input {j} {rank}")
        sourced.update(((j, d), entry[d - rank + len(entry)])
                       for d in range(rank - len(entry), rank))
    return sourced


def _assemble(graph: Graph, node: Node, sourced: Mapping[tuple[int, int], int]) -> Strategy:
    """The node's strategy from the splits of some of its (input, dim)s: each names the split
    of a loop dim of the node, read back onto every input that has that loop dim."""
    spec = op_spec(node, graph)
    split: dict[int, tuple[int, int, int]] = {}  # loop dim -> (split, input, dim) setting it
    for (j, d), s in sorted(sourced.items()):
        it = spec.in_maps[j][d]
        if it is None or not spec.splittable(it):
            if s != 1:
                raise AutoParallelError(f"split of dim {d} of input {j} of {node.name!r}", s,
                                        f"{node.op} cannot split it ({spec.why_whole(j, d)})")
            continue
        if split.setdefault(it, (s, j, d))[0] != s:
            s0, j0, d0 = split[it]
            raise AutoParallelError(f"split of dim {d} of input {j} of {node.name!r}", s,
                                    f"it is the dim that dim {d0} of input {j0} splits {s0}: "
                                    "the node reads them as one loop dim")
    return tuple(tuple(split[it][0] if it in split else 1 for it in mp)
                 for mp in spec.in_maps)


def _validate(graph: Graph, node: Node, strategy: Any, mesh: DeviceMesh | None) -> Strategy:
    """``strategy`` checked with the search's own rules for the node."""
    fixed = check_strategy_shape(strategy, [graph.spec(v).rank for v in node.inputs], node.name)
    if mesh is None:
        n = math.prod(s for entry in fixed for s in entry)
        if n > MAX_DEVICES:
            raise AutoParallelError(f"strategy for {node.name}", fixed, f"splits {n} ways, "
                                    f"more than {MAX_DEVICES} devices")
        mesh = DeviceMesh.for_devices(n)
    splits_from_strategy(op_spec(node, graph), fixed, node.name, mesh)
    return fixed


def _via(graph: Graph, node: Node, j: int, strategy: Strategy) -> dict[str, Strategy]:
    """Strategies for the moving nodes between a parameter and input ``j`` of ``node``: the
    layout the node's strategy gives the parameter, carried along."""
    src, m, path = _walk_back(graph, node.inputs[j])
    per = [1] * graph.spec(src).rank
    for d, s in enumerate(m):
        if s is not None:
            per[s] = strategy[j][d]
    out, cur = {}, tuple(range(len(per)))  # cur: dims of the next node's input -> source dims
    for p in path:
        out[p.name] = _assemble(graph, p, {(0, d): per[s] if s is not None else 1
                                           for d, s in enumerate(cur)})
        cur = tuple(cur[i] if i is not None else None for i in _pass_map(graph, p) or ())
    return out


def _map_onto(graph: Graph, node: Node, op: MsOp, st: Strategy, given: Mapping[str, bool],
              mesh: DeviceMesh | None, param: tuple[int, Any] | None = None) -> _Mapped:
    """A MindSpore operator's strategy carried onto ``node`` (``param``: the input slot the
    named parameter reaches and MindSpore's ``tensor_shape`` of it)."""
    try:
        note = ""
        if len(st) > op.arity or (len(st) < op.arity and (op.matmul or op.params)):
            raise AutoParallelError(f"strategy for {node.name}", st, f"one entry per input of "
                                    f"MindSpore's operator ({op.arity}), found {len(st)}")
        if op.matmul:
            flags, note = _flags(graph, node, given, param)
            sourced = _matmul_sourced(graph, node, st, flags)
        else:
            sourced = _generic_sourced(graph, node, st, op, param)
        strategy = _validate(graph, node, _assemble(graph, node, sourced), mesh)
        via = {} if param is None else {
            n: _validate(graph, graph.node(n), s, mesh)
            for n, s in _via(graph, node, param[0], strategy).items()}
    except (AutoParallelError, AutoParallelTypeError) as e:
        hint = (" (if MindSpore's MatMul transposes an input, pass attrs={name: "
                "{'transpose_a' / 'transpose_b': True}})") if op.matmul else ""
        raise _Skip(f"does not fit {node.name!r}: {e}{hint}") from None
    return _Mapped(node.name, strategy, via, note)


# ----------------------------------------------------------------------------- entries


def _strategy_of(items: Mapping[str, Any], ms: str) -> Strategy:
    if items[ms]["parallel_strategy"] == [] and items[ms].get("layout") is _INTERLEAVED:
        raise _Skip("its Layout uses interleaved_parallel, which autopar refuses (a device "
                    "computes its block of an operator in one piece)")
    if items[ms]["parallel_strategy"] == []:
        raise _Skip("MindSpore saved no strategy for it: the script shards it with a Layout, "
                    "which MindSpore's strategy checkpoint does not record (its operator-"
                    "strategy file does: parallel_layout_value_item); give autopar the same "
                    "Layout with ap.shard or fixed=")
    try:
        return check_strategy_shape(items[ms]["parallel_strategy"], None, ms)
    except (AutoParallelError, AutoParallelTypeError) as e:
        raise _Skip(f"not a MindSpore strategy: {e}") from None


def _map_named(graph: Graph, items: Mapping[str, Any], name_map: Mapping[str, str],
               mesh: DeviceMesh | None, found: dict[str, _Mapped],
               skipped: dict[str, str]) -> None:
    """Entries named by ``name_map`` or by an autopar node name: taken as they are."""
    for node in name_map.values():
        graph.node(node)  # unknown names fail with suggestions
    nodes = {n.name for n in graph.nodes}
    for ms in items:
        node = name_map.get(ms, ms if ms in nodes else None)
        if node is None:
            continue
        try:
            found[ms] = _Mapped(node, _validate(graph, graph.node(node),
                                                _strategy_of(items, ms), mesh))
        except _Skip as e:
            skipped[ms] = str(e)
        except (AutoParallelError, AutoParallelTypeError) as e:
            skipped[ms] = f"does not fit {node!r}: {e}"


def _map_by_parameter(graph: Graph, items: Mapping[str, Any], layouts: Mapping[str, Any],
                      attrs: Mapping[str, Mapping[str, bool]], mesh: DeviceMesh | None,
                      found: dict[str, _Mapped], skipped: dict[str, str]) -> None:
    """``<OpType>_<parameter>`` entries: the node of the type that reads the parameter."""
    for ms in items:
        m = _PARAM_RE.match(ms)
        if ms in found or ms in skipped or m is None or _OP_RE.search(ms):
            continue
        kind, pname = m.groups()
        if kind not in MS_OPS:
            skipped[ms] = (f"no autopar node of this name, and {kind!r} is no MindSpore "
                           "operator type autopar knows (MS_OPS); pass name_map")
            continue
        try:
            st = _strategy_of(items, ms)
            try:
                param = match_parameter(graph, pname)
            except AutoParallelError as e:
                raise _Skip(str(e)) from None
            node, j = _consumer(graph, param, MS_OPS[kind].prims)
            stored = _unexpanded((layouts.get(pname) or {}).get("tensor_shape"),
                                 graph.spec(param).shape)
            found[ms] = _map_onto(graph, node, MS_OPS[kind], st, attrs.get(ms, {}), mesh,
                                  param=(j, stored))
        except _Skip as e:
            skipped[ms] = str(e)


def _op_index(digits: str) -> tuple[int, str]:
    """The N of an ``-op<N>`` key as a sort key, by value however many digits it has (no
    int(): Python refuses to convert more than 4300)."""
    n = digits.lstrip("0") or "0"
    return len(n), n


def _map_by_order(graph: Graph, items: Mapping[str, Any],
                  attrs: Mapping[str, Mapping[str, bool]], mesh: DeviceMesh | None,
                  found: dict[str, _Mapped], skipped: dict[str, str]) -> None:
    """``.../<OpType>-op<N>`` entries: the k-th of a primitive onto the k-th node of it."""
    groups: dict[str, list[tuple[tuple[int, str], str]]] = {}
    for ms in items:
        if ms in found or ms in skipped:
            continue
        m = _OP_RE.search(ms)
        if m is None or m.group(1) not in MS_OPS:
            skipped[ms] = ("no autopar node of this name and no known MindSpore operator "
                           "type at its end; pass name_map")
            continue
        groups.setdefault(MS_TO_JAX[m.group(1)], []).append((_op_index(m.group(2)), ms))
    taken = {n for f in found.values() for n in (f.node, *f.via)}
    for prim, entries in sorted(groups.items()):
        names = [ms for _, ms in sorted(entries)]
        cands = [n for n in graph.nodes if n.op == prim and n.name not in taken]
        if len(cands) != len(names):
            for ms in names:
                skipped[ms] = (f"ambiguous: the file has {len(names)} operators of "
                               f"primitive {prim!r}, the graph {len(cands)}; pass name_map")
            continue
        for ms, node in zip(names, cands):
            op = MS_OPS[_OP_RE.search(ms).group(1)]  # type: ignore[union-attr]
            try:
                found[ms] = _map_onto(graph, node, op, _strategy_of(items, ms),
                                      attrs.get(ms, {}), mesh)
            except _Skip as e:
                skipped[ms] = str(e)


def _collect(out: MindSporeImport, found: Mapping[str, _Mapped]) -> None:
    """One strategy per node (the first entry in name order), then the moving nodes of each
    parameter where no entry set them."""
    owner: dict[str, str] = {}
    for ms, m in sorted(found.items()):
        if m.node in owner:
            out.skipped[ms] = (f"maps to {m.node!r} like {owner[m.node]!r} before it; one "
                               "strategy per node (fix name_map)")
            continue
        owner[m.node] = ms
        out.fixed[m.node], out.mapped[ms] = m.strategy, m.node
        if m.note:
            out.notes[ms] = m.note
    for ms, m in sorted(found.items()):
        if out.mapped.get(ms) == m.node:
            used = tuple(n for n in m.via if n not in out.fixed)
            out.fixed.update((n, m.via[n]) for n in used)
            if used:
                out.via[ms] = used


def import_mindspore_strategy(path: str | os.PathLike[str], graph: Graph, *,
                              name_map: Mapping[str, str] | None = None,
                              attrs: Mapping[str, Mapping[str, bool]] | None = None,
                              device_num: int | None = None,
                              strict: bool = False) -> MindSporeImport:
    """Map a MindSpore JSON strategy file onto ``graph`` (see the module docstring).

    ``name_map``: MindSpore name -> autopar node, taken as it is. ``attrs``: MindSpore name ->
    ``{"transpose_a": bool, "transpose_b": bool}``, the MatMul attributes the file does not
    record (default: inferred). ``device_num``: the devices the strategies must fit (default:
    the file's ``dev_matrix``). ``strict``: raise :class:`StrategyFileError` for the first
    entry that does not map, instead of listing it in ``skipped``."""
    if not isinstance(graph, Graph):
        raise AutoParallelTypeError("graph", graph, "the Graph returned by autopar.trace")
    if not isinstance(strict, bool):
        raise AutoParallelTypeError("strict", strict, "must be a bool")
    data = _read(path)
    items: dict[str, Any] = data["parallel_strategy_item"]
    layouts: dict[str, Any] = data["parallel_layout_item"]
    _check_args(path, items, name_map, attrs)
    n = device_num if device_num is not None else _file_devices(data)
    mesh = None if n is None else DeviceMesh.for_devices(n)
    out = MindSporeImport(parameters=tuple(sorted(layouts)))
    found: dict[str, _Mapped] = {}
    _map_named(graph, items, name_map or {}, mesh, found, out.skipped)
    _map_by_parameter(graph, items, layouts, attrs or {}, mesh, found, out.skipped)
    _map_by_order(graph, items, attrs or {}, mesh, found, out.skipped)
    _collect(out, found)
    if strict and out.skipped:
        ms, why = sorted(out.skipped.items())[0]
        raise StrategyFileError(path, f"parallel_strategy_item.{ms}", "a strategy that maps "
                                "onto the graph", why)
    return out
