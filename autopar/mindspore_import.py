"""Import MindSpore's own JSON strategy file as fixed strategies for :func:`autopar.search`.

MindSpore (``strategy_ckpt_config={"save_file": "x.json"}``, or a ``.json``
``strategy_ckpt_save_file``) writes::

    {"current_stage": 0,
     "parallel_strategy_item": {"Default/network-Net/MatMul-op0":
                                    {"stage": 0, "parallel_strategy": [[2, 1], [1, 4]]}, ...},
     "parallel_layout_item": {"w1": {"dev_matrix": [...], "tensor_map": [...], ...}, ...}}

Operator names are MindSpore's graph names, so they are mapped onto autopar's node names:

1. ``name_map={mindspore name: autopar node}`` when given (it wins);
2. the same name, when the file already uses autopar's names (an autopar-written file);
3. by operator type and order: the trailing ``<Type>-op<N>`` of a MindSpore name gives the
   type; the k-th operator of a type (ordered by N) maps to the k-th autopar node of the JAX
   primitive of that type (:data:`MS_TO_JAX`, e.g. ``MatMul``/``BatchMatMul`` ->
   ``dot_general``, ``Conv2D`` -> ``conv_general_dilated``) — only when both sides have the
   same number of operators of that type; otherwise the type is ambiguous and skipped.

Every mapped strategy is checked for the node's input shapes with MindSpore's rules (an
entry per input, a split count per dim, matched splits agree, splits divide dims) — a strategy
that does not fit (e.g. ``BiasAdd`` ``((a, b), (b,))`` against JAX's broadcast ``add`` of two
rank-2 inputs) is reported in :attr:`MindSporeImport.skipped` with the reason, or raised with
``strict=True``. ``parallel_layout_item`` is read for the report only: parameter layouts
follow from the operators' strategies, as in MindSpore. Use the result as
``autopar.search(graph, fixed=imported.fixed)`` under ``semi_auto_parallel`` or
``auto_parallel``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from autopar.checkpoint import StrategyFileError
from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.graph.ir import Graph, check_strategy_shape

__all__ = ["MS_TO_JAX", "MindSporeImport", "import_mindspore_strategy"]

#: MindSpore operator type -> the JAX primitive autopar traces for it.
MS_TO_JAX: dict[str, str] = {
    "MatMul": "dot_general", "BatchMatMul": "dot_general", "Dense": "dot_general",
    "Conv2D": "conv_general_dilated", "Add": "add", "Sub": "sub", "Mul": "mul",
    "RealDiv": "div", "Div": "div", "Tanh": "tanh", "Exp": "exp", "Log": "log",
    "Sqrt": "sqrt", "Rsqrt": "rsqrt", "Maximum": "max", "Minimum": "min", "Neg": "neg",
    "ReduceSum": "reduce_sum", "ReduceMax": "reduce_max", "Gather": "gather",
    "Transpose": "transpose", "Reshape": "reshape", "Cast": "convert_element_type",
    "Sigmoid": "logistic", "Erf": "erf",
}
_OP_RE = re.compile(r"([A-Za-z0-9_]+)-op(\d+)$")


@dataclass
class MindSporeImport:
    """The strategies that mapped (``fixed``, by autopar node name), how each MindSpore name was
    mapped, what was skipped and why, and the parameter names the file lists."""

    fixed: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    mapped: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    parameters: tuple[str, ...] = ()

    def summary(self) -> str:
        lines = [f"{len(self.fixed)} strategies imported, {len(self.skipped)} skipped"]
        lines += [f"  {ms} -> {node}" for ms, node in sorted(self.mapped.items())]
        lines += [f"  skipped {ms}: {why}" for ms, why in sorted(self.skipped.items())]
        return "\n".join(lines)


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StrategyFileError(path, "<file>", "a readable UTF-8 file", str(e)) from None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise StrategyFileError(path, "<json>", "MindSpore's JSON strategy file", str(e)) \
            from None
    if not isinstance(data, dict) or not isinstance(data.get("parallel_strategy_item"), dict):
        raise StrategyFileError(path, "parallel_strategy_item", "an object of node name -> "
                                "{stage, parallel_strategy}", type(data).__name__ if not
                                isinstance(data, dict) else data.get("parallel_strategy_item",
                                                                     "<missing>"))
    for name, item in data["parallel_strategy_item"].items():
        if not isinstance(item, dict) or "parallel_strategy" not in item:
            raise StrategyFileError(path, f"parallel_strategy_item.{name}",
                                    "{stage, parallel_strategy}", item)
    return data


def import_mindspore_strategy(path: str | os.PathLike[str], graph: Graph, *,
                              name_map: Mapping[str, str] | None = None,
                              strict: bool = False) -> MindSporeImport:
    """Map a MindSpore JSON strategy file onto ``graph`` (see the module docstring)."""
    if not isinstance(graph, Graph):
        raise AutoParallelTypeError("graph", graph, "the Graph returned by autopar.trace")
    if name_map is not None and not isinstance(name_map, Mapping):
        raise AutoParallelTypeError("name_map", name_map, "a mapping of MindSpore name -> "
                                    "autopar node name")
    data = _read(path)
    items: dict[str, Any] = data["parallel_strategy_item"]
    out = MindSporeImport(parameters=tuple(sorted(data.get("parallel_layout_item") or {})))
    nodes = {n.name: n for n in graph.nodes}
    for ms, node in (name_map or {}).items():
        if ms not in items:
            raise AutoParallelError("name_map", ms, f"not an operator of {str(path)!r}")
        graph.node(node)  # unknown names fail with suggestions
        out.mapped[ms] = node
    for ms in items:
        if ms not in out.mapped and ms in nodes:
            out.mapped[ms] = ms
    by_type: dict[str, list[tuple[int, str]]] = {}
    for ms in items:
        if ms in out.mapped:
            continue
        m = _OP_RE.search(ms)
        if m is None or m.group(1) not in MS_TO_JAX:
            out.skipped[ms] = ("no autopar node of this name and no known MindSpore operator "
                               "type at its end; pass name_map")
            continue
        by_type.setdefault(m.group(1), []).append((int(m.group(2)), ms))
    taken = set(out.mapped.values())
    prim_groups: dict[str, list[str]] = {}
    for ms_type, entries in by_type.items():
        prim_groups.setdefault(MS_TO_JAX[ms_type], []).extend(ms for _, ms in sorted(entries))
    for prim, names in prim_groups.items():
        names.sort(key=lambda ms: int(_OP_RE.search(ms).group(2)))  # type: ignore[union-attr]
        cands = [n.name for n in graph.nodes if n.op == prim and n.name not in taken]
        if len(cands) != len(names):
            for ms in names:
                out.skipped[ms] = (f"ambiguous: the file has {len(names)} operators of "
                                   f"primitive {prim!r}, the graph {len(cands)}; pass name_map")
            continue
        out.mapped.update(zip(names, cands))
    owner: dict[str, str] = {}  # autopar node -> the MindSpore entry that set its strategy
    for ms, node_name in sorted(out.mapped.items()):
        if node_name in owner:
            out.skipped[ms] = (f"maps to {node_name!r} like {owner[node_name]!r} before it; "
                               "one strategy per node (fix name_map)")
            continue
        node = nodes[node_name]
        strategy = items[ms]["parallel_strategy"]
        try:
            ranks = [graph.spec(v).rank for v in node.inputs]
            fixed = check_strategy_shape(strategy, ranks, node_name)
            _check_dims(graph, node, fixed)
        except (AutoParallelError, AutoParallelTypeError) as e:
            out.skipped[ms] = f"does not fit {node_name!r}: {e}"
            continue
        out.fixed[node_name] = fixed
        owner[node_name] = ms
    for ms in out.skipped:
        out.mapped.pop(ms, None)
    if strict and out.skipped:
        ms, why = sorted(out.skipped.items())[0]
        raise StrategyFileError(path, f"parallel_strategy_item.{ms}", "a strategy that maps "
                                "onto the graph", why)
    return out


def _check_dims(graph: Graph, node: Any, strategy: tuple[tuple[int, ...], ...]) -> None:
    for v, entry in zip(node.inputs, strategy):
        shape = graph.spec(v).shape
        for d, (n, s) in enumerate(zip(shape, entry)):
            if n % s:
                raise AutoParallelError(f"strategy for {node.name}", strategy,
                                        f"split {s} does not divide dim {d} (size {n}) of "
                                        f"input {v!r}")
