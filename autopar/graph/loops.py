"""Loops as loops: a ``scan`` is one loop node whose body is a :class:`~autopar.graph.ir.Graph`.

``lax.scan`` -- and what lowers to it: flax's ``nn.scan`` / ``nnx.scan``, ``lax.fori_loop``
with static bounds, ``lax.map`` -- is traced into one node of kind ``"loop"`` (op ``scan``)
instead of being refused or unrolled. Its body is traced once into its own graph, whose
inputs are, in the scan's order, its constants (``num_consts``), its carries
(``num_carry``) and the per-iteration slices of its ``xs``; its outputs are the new carries
then the per-iteration ``ys``. The loop node reads the outer values of the same operands and
makes the final carries and the stacked ``ys`` (a leading dim of the trip count).

A body input is a parameter (kind ``param``) where the outer operand is one (the stacked
weights of ``nn.scan``: each iteration reads its slice), a constant where the outer operand
is a literal or a closed-over constant passed as a scan constant, and data otherwise (the
carries, activations passed in): the search gives each data input a layout per candidate
(:mod:`autopar.strategies.loops`).

The node's FLOPs are the body's times the trip count; ``reverse`` and ``unroll`` are kept
and honoured when the loop is lowered (a ``lax.scan`` with the same parameters).

>>> import jax, jax.numpy as jnp, autopar
>>> def loss(w, x):
...     h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)
...     return jnp.sum(h)
>>> g = autopar.trace(loss, jnp.ones((3, 4, 4)), jnp.ones((2, 4)))
>>> [n.name for n in g.nodes], g.nodes[0].kind
(['scan_0', 'reduce_sum_0'], 'loop')
>>> body = loop_body(g.nodes[0])
>>> [n.name for n in body.graph.nodes], body.graph.inputs
(['dot_general_0', 'tanh_0'], ('carry0', 'w'))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.errors import AutoParallelError
from autopar.graph.ir import Graph, Node, TensorSpec, Value
from autopar.graph.ops import OpSpec

__all__ = ["LOOP_KIND", "LOOP_PRIMITIVES", "LoopBody", "emit_loop", "is_loop", "loop_body",
           "loop_nodes", "loop_spec", "qualified", "split_by_loop"]

#: the node kind of a loop, and the JAX primitives traced into one
LOOP_KIND = "loop"
LOOP_PRIMITIVES = frozenset({"scan"})
#: scan parameters a loop node keeps (the body jaxpr becomes its body graph)
_KEPT = ("length", "reverse", "unroll", "num_consts", "num_carry")


@dataclass(frozen=True, eq=False)
class LoopBody:
    """A loop node's body: its graph and how the node's operands meet it (``num_consts``
    constants, ``num_carry`` carries, the rest per-iteration slices; outputs: the carries,
    then the per-iteration results). ``_asdict`` is its canonical form (graph fingerprints)."""

    graph: Graph
    num_consts: int
    num_carry: int
    length: int

    def role(self, k: int) -> str:
        """``"const"``, ``"carry"`` or ``"xs"``: what body input ``k`` is."""
        if k < self.num_consts:
            return "const"
        return "carry" if k < self.num_consts + self.num_carry else "xs"

    def _asdict(self) -> dict[str, Any]:
        return {"graph": self.graph.structure(), "num_consts": self.num_consts,
                "num_carry": self.num_carry, "length": self.length}

    def __repr__(self) -> str:
        return (f"LoopBody({self.graph.fingerprint()[:16]}, {len(self.graph.nodes)} nodes, "
                f"x{self.length})")


def is_loop(node: Node) -> bool:
    return node.kind == LOOP_KIND


def loop_body(node: Node) -> LoopBody:
    """The body of a loop node."""
    return node.params["body"]


def loop_nodes(graph: Graph) -> tuple[Node, ...]:
    return tuple(n for n in graph.nodes if n.kind == LOOP_KIND)


def qualified(loop: str, name: str) -> str:
    """How a body node is named outside its loop (``fixed=``, plans, files):
    ``scan_0/dot_general_0``."""
    return f"{loop}/{name}"


def split_by_loop(graph: Graph, names: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A mapping keyed by node names split into the graph's own entries and, per loop node,
    the entries of its body (``loop/body node`` keys, the loop's prefix removed). Keys that
    name neither stay with the graph's (its checks name them)."""
    loops = {n.name for n in loop_nodes(graph)}
    own: dict[str, Any] = {}
    bodies: dict[str, dict[str, Any]] = {}
    for key, value in dict(names or {}).items():
        head = next((lp for lp in sorted(loops, key=len, reverse=True)
                     if isinstance(key, str) and key.startswith(lp + "/")), None)
        if head is None:
            own[key] = value
        else:
            bodies.setdefault(head, {})[key[len(head) + 1:]] = value
    return own, bodies


def data_inputs(body: LoopBody) -> tuple[int, ...]:
    """Positions of the body inputs of kind data (carries, activations passed in): the
    inputs whose layouts make a loop candidate."""
    g = body.graph
    return tuple(k for k, v in enumerate(g.inputs) if g.values[v].kind == "data")


def loop_spec(node: Node, graph: Graph) -> OpSpec:
    """The loop node as a loop nest for the search's checks: one iteration dim per dim of
    each data input of its body (``xs``: without the scanned dim, which is never split), in
    input order. A strategy's split counts are those dims' (a candidate's identity); the
    carries' outputs follow their inputs. Other operands and the ``ys`` map to no dim (the
    body plan decides their layouts)."""
    body = loop_body(node)
    g = body.graph
    sizes: list[int] = []
    in_maps: list[tuple[int | None, ...]] = []
    at: dict[int, tuple[int, ...]] = {}
    for k, v in enumerate(g.inputs):
        outer_rank = graph.spec(node.inputs[k]).rank
        if g.values[v].kind != "data":
            in_maps.append((None,) * outer_rank)
            continue
        dims = tuple(range(len(sizes), len(sizes) + g.spec(v).rank))
        sizes.extend(g.spec(v).shape)
        at[k] = dims
        in_maps.append(((None,) + dims) if body.role(k) == "xs" else dims)
    out_maps = []
    for j, v in enumerate(node.outputs):
        k = body.num_consts + j
        if j < body.num_carry and k in at:
            out_maps.append(at[k])
        else:
            out_maps.append((None,) * graph.spec(v).rank)
    return OpSpec(tuple(sizes), tuple(in_maps), tuple(out_maps))


# ---------------------------------------------------------------------------- tracing


def _spec(aval: Any) -> TensorSpec:
    return TensorSpec(tuple(map(int, aval.shape)), str(np.dtype(aval.dtype)))


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * np.dtype(spec.dtype).itemsize


def _check_params(params: Any, source: str) -> None:
    """Scan parameters the lowering cannot honour raise a typed error naming them
    (``reverse`` and ``unroll`` are honoured: the loop is lowered with them)."""
    if params.get("_split_transpose", False):
        raise AutoParallelError("scan parameter '_split_transpose'", True, "autopar lowers a "
                                f"scan as lax.scan, which has no split transpose (at {source})",
                                "Leave _split_transpose off")


def _body_input(b: Any, outer: str, role: str, k: int, aval: Any) -> tuple[str, Value]:
    """Body input ``k``: a parameter where the outer operand is one, a constant where it is
    a literal or constant passed as a scan constant, data otherwise."""
    val = b.values[outer]
    data = None
    if val.kind == "param":
        kind, label = "param", outer
    elif role == "const" and val.kind in ("literal", "const"):
        kind, label, data = "const", f"const{k}", val.data
    else:
        kind = "data"
        label = f"carry{k}" if role == "carry" else (
            outer if val.kind not in ("literal", "const") else f"{role}{k}")
    return label, Value(label, _spec(aval), kind, data=data)


def _trace_body(b: Any, eqn: Any, outer: list[str], source: str) -> LoopBody:
    """The body graph of a scan equation, traced by a builder of ``b``'s kind (the tracer's);
    its annotations and parameter plans are the outer trace's too."""
    p = eqn.params
    closed = p["jaxpr"]
    body = closed.jaxpr
    sub = type(b)()
    sub.root, sub.rule = b.root, b.rule
    env: dict[Any, str] = {}
    for var, c in zip(body.constvars, closed.consts):
        env[var] = sub.add_value("const", Value("const", _spec(var.aval), "const",
                                                data=np.asarray(c)))
    nc, nk = p["num_consts"], p["num_carry"]
    inputs = []
    for k, (var, o) in enumerate(zip(body.invars, outer)):
        role = "const" if k < nc else "carry" if k < nc + nk else "xs"
        label, value = _body_input(b, o, role, k, var.aval)
        env[var] = sub.add_value(label, value)
        inputs.append(env[var])
    sub.run(body, env, [], source)
    outputs = [sub.read(env, v) for v in body.outvars]
    for ident, strategy in sub.pending.items():
        b.pending.setdefault(ident, strategy)
    b.done |= sub.done
    b.plans |= sub.plans
    graph = Graph(sub.nodes, sub.values, inputs, outputs, name="body",
                  layout_devices=sub.devices)
    return LoopBody(graph, nc, nk, int(p["length"]))


def emit_loop(b: Any, eqn: Any, env: dict[Any, str], stack: list[str], source: str) -> None:
    """Trace a ``scan`` equation into one loop node of builder ``b`` (the tracer's
    ``_Builder``): its body traced once (:func:`_trace_body`), named like any node."""
    _check_params(eqn.params, source)
    prim = eqn.primitive.name
    outer = [b.read(env, v) for v in eqn.invars]
    body = _trace_body(b, eqn, outer, source)
    scope, _ = b.scope(stack)
    idx = b.counters.get((scope, prim), 0)
    b.counters[(scope, prim)] = idx + 1
    name = f"{scope}/{prim}_{idx}" if scope else f"{prim}_{idx}"
    outputs = []
    for i, var in enumerate(eqn.outvars):
        vname = name if len(eqn.outvars) == 1 else f"{name}:{i}"
        vname = b.add_value(vname, Value(vname, _spec(var.aval), "activation", producer=name))
        if type(var).__name__ != "DropVar":
            env[var] = vname
        outputs.append(vname)
    params = {k: eqn.params[k] for k in _KEPT}
    params["body"] = body
    b.nodes.append(Node(
        name=name, op=prim, kind=LOOP_KIND, inputs=tuple(outer), outputs=tuple(outputs),
        params=params, scope=scope, source=source,
        flops=body.length * body.graph.total_flops,
        bytes_read=sum(_nbytes(b.values[v].spec) for v in outer
                       if b.values[v].kind != "literal"),
        bytes_written=sum(_nbytes(b.values[v].spec) for v in outputs),
        primitive=eqn.primitive))
