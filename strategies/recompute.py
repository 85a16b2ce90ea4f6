"""Recomputation chosen for the user: the ``recompute`` context key, and a search dimension.

A training step keeps, from forward to backward, what each operator's derivative reads
(:mod:`autopar.strategies.memory`); recomputation trades that memory for running forward
again in backward. A user's own ``jax.checkpoint`` is kept as written
(:mod:`autopar.graph.remat`); this module makes the same regions where the user wrote none,
in the words of MindFormers' ``recompute_config``:

- ``"none"``: nothing recomputed beyond the user's own regions;
- ``"full"`` (``recompute=True``): every **layer** -- a run of consecutive operators under
  one named scope whose name but for its numbers repeats (``block00``, ``block01``; flax's
  ``Decoder/block_0``; keras-hub's ``.../transformer_layer_0``), or, where no scope is
  numbered, a top-level run whose operators repeat (:func:`blocks`) -- is one region that
  saves nothing: backward keeps its inputs and runs its forward again;
- ``"selective"`` (``select_recompute``; Megatron's selective recomputation): in each
  block, the **attention core** -- the operators from the first matmul of two computed
  operands (``q k^T``) to the last (``softmax(.) v``), on paths between them: the scores,
  the softmax, the mask -- is one region. The ``[heads, s, s]`` values are made again in
  backward from ``q``, ``k`` and ``v``, which are kept; matmuls with a weight stay stored.

The tags are :class:`~autopar.graph.remat.Remat` regions like a user's, so the memory and
time models price them and the lowering wraps them in ``jax.checkpoint`` (the compiled
program recomputes). A layer holding a user's region is left as the user wrote it; where
no layer is found (a function with no named scopes), an
:class:`~autopar.errors.AutoParallelWarning` says so.

>>> import jax, autopar as ap
>>> from autopar.models import transformer
>>> m = transformer(layers=2, hidden=16, heads=2, seq=8, vocab=32, batch=2)
>>> g = ap.trace(m.loss, *m.example_args(jax.random.key(0)))
>>> sorted({n.remat.region for n in with_recompute(g, "full").nodes if n.remat})
['recompute_block0', 'recompute_block1']
>>> core = [n.op for n in with_recompute(g, "selective").nodes if n.remat
...         and n.remat.region == 'recompute_block0']
>>> core[0], core[-1], "exp" in core
('dot_general', 'dot_general', True)
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from dataclasses import replace
from typing import Sequence

from autopar.errors import AutoParallelError, AutoParallelWarning
from autopar.graph.ir import Graph, Node
from autopar.graph.remat import Remat

__all__ = ["RECOMPUTE", "with_recompute", "blocks", "attention_core"]

#: The ``recompute`` key's values, cheapest in memory last.
RECOMPUTE = ("none", "selective", "full")


def blocks(graph: Graph) -> list[tuple[str, Sequence[Node]]]:
    """``(scope, nodes)`` of the repeated layers: runs of consecutive nodes under one scope
    prefix whose name but for its numbers occurs more than once (``block0``, ``block1``;
    flax's ``Decoder/block_0``; keras-hub's ``gpt2_backbone/transformer_layer_0``), at the
    shallowest depth where there are such; else the top-level runs whose operator sequence
    occurs more than once (equinox's per-module scopes)."""
    for depth in range(1, _DEPTHS + 1):
        runs = _runs(graph, depth)
        names = Counter(_numbered(top) for top, _ in runs if re.search(r"\d", top))
        found = [(top, nodes) for top, nodes in runs
                 if re.search(r"\d", top) and names[_numbered(top)] > 1]
        if found:
            return found
    runs = _runs(graph, 1)
    shapes = Counter(tuple(n.op for n in nodes) for _, nodes in runs)
    return [(top, nodes) for top, nodes in runs
            if top and shapes[tuple(n.op for n in nodes)] > 1]


#: how deep in the named scopes :func:`blocks` looks for numbered layers
_DEPTHS = 4


def _runs(graph: Graph, depth: int) -> list[tuple[str, list[Node]]]:
    """Maximal runs of consecutive nodes with one scope prefix of ``depth`` names."""
    runs: list[tuple[str, list[Node]]] = []
    for node in graph.nodes:
        top = "/".join(node.scope.split("/")[:depth])
        if runs and runs[-1][0] == top:
            runs[-1][1].append(node)
        else:
            runs.append((top, [node]))
    return runs


def _numbered(scope: str) -> str:
    """A scope with its numbers blanked: ``block00`` and ``block01`` are one name."""
    return re.sub(r"\d+", "#", scope)


def attention_core(graph: Graph, nodes: Sequence[Node]) -> list[Node]:
    """The nodes of ``nodes`` from the first matmul of two computed operands to the last,
    on a path from the one to the other; nothing where there are fewer than two."""
    computed = _computed(graph)
    mms = [i for i, n in enumerate(nodes) if n.op == "dot_general"
           and all(v in computed for v in n.inputs)]
    if len(mms) < 2:
        return []
    first, last = mms[0], mms[-1]
    after = set(nodes[first].outputs)  # values downstream of the first
    down = {first}
    for i in range(first + 1, last + 1):
        if any(v in after for v in nodes[i].inputs):
            after.update(nodes[i].outputs)
            down.add(i)
    before = set(nodes[last].inputs)  # values upstream of the last
    core = {last}
    for i in range(last - 1, first - 1, -1):
        if i in down and any(v in before for v in nodes[i].outputs):
            before.update(nodes[i].inputs)
            core.add(i)
    return [nodes[i] for i in sorted(core)]


def _computed(graph: Graph) -> set[str]:
    """Values that depend on a data input (not on parameters and constants alone)."""
    params = set(graph.parameters())
    out = {v for v in graph.inputs if v not in params}
    for node in graph.nodes:
        if any(v in out for v in node.inputs):
            out.update(node.outputs)
    return out


def with_recompute(graph: Graph, kind: str) -> Graph:
    """``graph`` with ``kind``'s regions tagged (see the module docstring); the graph itself
    for ``"none"`` or where no block is found."""
    if kind not in RECOMPUTE:
        raise AutoParallelError("recompute", kind, f"one of {list(RECOMPUTE)}")
    tags: dict[str, Remat] = {}
    if kind != "none":
        for top, nodes in blocks(graph):
            if any(n.remat is not None for n in nodes):
                continue  # (the user's own regions decide there)
            chosen = nodes if kind == "full" else attention_core(graph, nodes)
            tags.update((n.name, Remat(f"recompute_{top}")) for n in chosen)
    if not tags:
        if kind != "none":
            warnings.warn(f"recompute={kind!r}: no repeated layers found (runs of operators "
                          "under one named scope, numbered or alike) to recompute; name "
                          "each layer with jax.named_scope, or wrap it in jax.checkpoint",
                          AutoParallelWarning, stacklevel=2)
        return graph
    nodes = [replace(n, remat=tags[n.name]) if n.name in tags else n for n in graph.nodes]
    return Graph(nodes, graph.values, graph.inputs, graph.outputs, in_tree=graph.in_tree,
                 out_tree=graph.out_tree, name=graph.name, layout_devices=graph.layout_devices)
