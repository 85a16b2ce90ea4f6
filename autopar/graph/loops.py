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

A ``while`` whose trip count is known at trace time (:func:`while_length`: ``i < n`` on a
counter carried from a constant start by a constant step -- ``lax.while_loop`` so written,
``fori_loop`` with bounds JAX lowers to a while) is the same loop node (op ``while``): its
body is a scan body with no ``xs`` (the while's body constants, then its carries), run its
trip count times; any other ``while`` is an unsupported primitive (named at the user's
line with the others, :mod:`autopar.graph.unsupported`). A ``cond`` /
``lax.switch`` is a loop node of one iteration (op ``cond``) whose body holds every branch
(``LoopBody.branches``): inputs the branch index, then the operands; branch ``i``'s operators
named ``branch{i}/...``; outputs every branch's results in turn. Its FLOPs are the dearer
branch's.

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
import operator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from autopar.errors import AutoParallelError
from autopar.graph.ir import Graph, Node, TensorSpec, Value
from autopar.graph.ops import OpSpec

__all__ = ["LOOP_KIND", "LOOP_PRIMITIVES", "LoopBody", "emit_loop", "is_loop", "loop_body",
           "loop_nodes", "loop_spec", "qualified", "split_by_loop", "UncountedWhile",
           "while_length"]

#: the node kind of a loop, and the JAX primitives traced into one
LOOP_KIND = "loop"
LOOP_PRIMITIVES = frozenset({"scan", "while", "cond"})
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
    #: a ``cond``'s branches: per branch, its operators' names and its outputs (empty for
    #: a loop)
    branches: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()

    def role(self, k: int) -> str:
        """``"const"``, ``"carry"`` or ``"xs"``: what body input ``k`` is."""
        if k < self.num_consts:
            return "const"
        return "carry" if k < self.num_consts + self.num_carry else "xs"

    def _asdict(self) -> dict[str, Any]:
        out = {"graph": self.graph.structure(), "num_consts": self.num_consts,
               "num_carry": self.num_carry, "length": self.length}
        if self.branches:
            out["branches"] = [[list(names), list(outs)] for names, outs in self.branches]
        return out

    def branch(self, i: int) -> Graph:
        """Branch ``i`` of a ``cond`` as a graph of its own: every body input, its
        operators, its outputs (what the rewrite lowers as one ``lax.switch`` branch)."""
        names, outs = self.branches[i]
        keep = set(names)
        g = self.graph
        return Graph([n for n in g.nodes if n.name in keep], g.values, g.inputs, outs,
                     name=f"branch{i}", layout_devices=g.layout_devices)

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
    missing = [k for k in ("jaxpr", "length", "num_consts", "num_carry") if k not in params]
    if missing:
        import jax

        raise AutoParallelError("scan parameters", sorted(params), f"a scan with "
                                f"{', '.join(missing)}: jax {jax.__version__}'s scan is not "
                                f"the one autopar traces (jax 0.10) (at {source})",
                                "Install jax 0.10.x, or unroll the loop with a Python for loop")
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


def _sub_builder(b: Any) -> Any:
    """A builder of ``b``'s kind (the tracer's) for a body: the outer trace's annotations."""
    sub = type(b)()
    sub.root, sub.rule = b.root, b.rule
    return sub


def _merge(b: Any, sub: Any) -> None:
    """What tracing a body found that the outer trace keeps (annotations, parameter plans)."""
    for ident, strategy in sub.pending.items():
        b.pending.setdefault(ident, strategy)
    b.done |= sub.done
    b.plans |= sub.plans


def _consts(sub: Any, closed: Any, env: dict[Any, str]) -> None:
    for var, c in zip(closed.jaxpr.constvars, closed.consts):
        env[var] = sub.add_value("const", Value("const", _spec(var.aval), "const",
                                                data=np.asarray(c)))


def _trace_body(b: Any, closed: Any, nc: int, nk: int, length: int, outer: list[str],
                source: str) -> LoopBody:
    """The body graph of a scan (or counted while) body ``closed``, traced by a builder of
    ``b``'s kind; its annotations and parameter plans are the outer trace's too."""
    body = closed.jaxpr
    sub = _sub_builder(b)
    env: dict[Any, str] = {}
    _consts(sub, closed, env)
    inputs = []
    for k, (var, o) in enumerate(zip(body.invars, outer)):
        role = "const" if k < nc else "carry" if k < nc + nk else "xs"
        label, value = _body_input(b, o, role, k, var.aval)
        env[var] = sub.add_value(label, value)
        inputs.append(env[var])
    sub.run(body, env, [], source)
    outputs = [sub.read(env, v) for v in body.outvars]
    _merge(b, sub)
    graph = Graph(sub.nodes, sub.values, inputs, outputs, name="body",
                  layout_devices=sub.devices)
    return LoopBody(graph, nc, nk, int(length))


def _trace_branches(b: Any, branches: Any, outer: list[str], source: str) -> LoopBody:
    """The branches of a ``cond`` traced into one body graph: its inputs the index, then the
    operands (every branch reads them); branch ``i``'s operators named under ``branch{i}/``;
    its outputs every branch's results in branch order (``LoopBody.branches`` says which)."""
    sub = _sub_builder(b)
    inputs = []
    for k, o in enumerate(outer):
        label, value = _body_input(b, o, "const", k, _aval(b.values[o]))
        inputs.append(sub.add_value(label, value))
    parts, outputs = [], []
    for i, closed in enumerate(branches):
        env: dict[Any, str] = {}
        _consts(sub, closed, env)
        env.update(zip(closed.jaxpr.invars, inputs[1:]))
        start = len(sub.nodes)
        sub.run(closed.jaxpr, env, [f"branch{i}"], source)
        outs = tuple(sub.read(env, v) for v in closed.jaxpr.outvars)
        parts.append((tuple(n.name for n in sub.nodes[start:]), outs))
        outputs += outs
    _merge(b, sub)
    graph = Graph(sub.nodes, sub.values, inputs, outputs, name="body",
                  layout_devices=sub.devices)
    return LoopBody(graph, len(inputs), 0, 1, tuple(parts))


def _aval(value: Value) -> Any:
    return SimpleNamespace(shape=value.spec.shape, dtype=value.spec.dtype)


#: a while's condition, the counter on the left: the comparison kept per primitive
_COMPARE = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
            "ne": operator.ne}
_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "ne": "ne"}


def _scalar(b: Any, name: str) -> int | None:
    """The value of an outer integer scalar known at trace time (a literal or constant)."""
    val = b.values[name]
    if val.kind not in ("literal", "const") or val.data is None or val.spec.rank or \
            not val.spec.dtype.startswith(("int", "uint")):
        return None
    return int(np.asarray(val.data))


def _producer(jaxpr: Any, var: Any) -> Any:
    return next((e for e in jaxpr.eqns if any(o is var for o in e.outvars)), None)


def _step(body: Any, k: int, bn: int) -> int | None:
    """The constant step of carry ``k`` of a while body (``c + s`` / ``c - s`` on a literal
    ``s``), None when the body does not count it so."""
    var, out = body.invars[bn + k], body.outvars[k]
    e = _producer(body, out)
    if e is None or e.primitive.name not in ("add", "sub") or len(e.invars) != 2:
        return None
    a, c = e.invars
    lit = c if a is var else a if (c is var and e.primitive.name == "add") else None
    if type(lit).__name__ != "Literal":
        return None
    step = int(np.asarray(lit.val))
    return -step if e.primitive.name == "sub" else step


class UncountedWhile(Exception):
    """A ``while`` whose trip count is not known at trace time: the tracer turns it into
    the error naming every unsupported primitive (:mod:`autopar.graph.unsupported`)."""

    def __init__(self, eqn: Any) -> None:
        super().__init__("while")
        self.eqn = eqn


def while_length(eqn: Any, known_operand: Any) -> int | None:
    """The trip count of a ``while`` equation known at trace time, None when it is not: its
    condition compares a carry counted by a constant step from a known start with a
    literal, a known constant or a carry the body passes through unchanged from a known
    start. ``known_operand(i)``: operand ``i``'s integer value known at trace time, or None
    (always a number: whether the loop has that shape, whatever the values)."""
    p = eqn.params
    cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    first = cn + bn  # (operand index of carry 0)

    def known(var: Any) -> tuple[int | None, int | None]:  # (value, carry index)
        if type(var).__name__ == "Literal":
            return int(np.asarray(var.val)), None
        at = next((i for i, v in enumerate(cond.invars) if v is var), None)
        if at is None:
            return None, None
        if at < cn:
            return known_operand(at), None
        k = at - cn
        fixed = body.outvars[k] is body.invars[bn + k]
        return (known_operand(first + k) if fixed else None), k

    e = _producer(cond, cond.outvars[0])
    if e is None or e.primitive.name not in _COMPARE or len(e.invars) != 2:
        return None
    for side, op in ((0, e.primitive.name), (1, _FLIPPED[e.primitive.name])):
        _, k = known(e.invars[side])
        bound, _ = known(e.invars[1 - side])
        if k is None or bound is None:
            continue
        start, step = known_operand(first + k), _step(body, k, bn)
        if start is None or not step:
            continue
        n = _count(_COMPARE[op], start, step, bound)
        if n is not None:
            return n
    return None


def _count(cmp: Any, start: int, step: int, bound: int) -> int | None:
    """How many times ``cmp(i, bound)`` holds for ``i = start, start + step, ...`` before it
    first fails; None if it never does (an endless loop)."""
    if not cmp(start, bound):
        return 0
    if cmp in (operator.lt, operator.le) and step > 0 or \
            cmp in (operator.gt, operator.ge) and step < 0:
        gap = abs(bound - start) + (1 if cmp in (operator.le, operator.ge) else 0)
        return -(-gap // abs(step))
    if cmp is operator.ne and (bound - start) % step == 0 and (bound - start) // step > 0:
        return (bound - start) // step
    return None


def emit_loop(b: Any, eqn: Any, env: dict[Any, str], stack: list[str], source: str) -> None:
    """Trace a ``scan``, a counted ``while`` (:func:`while_length`: a scan of its body, with
    no ``xs``) or a ``cond`` (its branches, :func:`_trace_branches`) equation into one loop
    node of builder ``b`` (the tracer's ``_Builder``): its body traced once, named like any
    node."""
    prim = eqn.primitive.name
    outer = [b.read(env, v) for v in eqn.invars]
    p = eqn.params
    if prim == "scan":
        _check_params(p, source)
        body = _trace_body(b, p["jaxpr"], p["num_consts"], p["num_carry"], p["length"],
                           outer, source)
        params = {k: p[k] for k in _KEPT}
    elif prim == "while":
        length = while_length(eqn, lambda i: _scalar(b, outer[i]))
        if length is None:
            raise UncountedWhile(eqn)
        outer = outer[p["cond_nconsts"]:]
        body = _trace_body(b, p["body_jaxpr"], p["body_nconsts"],
                           len(outer) - p["body_nconsts"], length, outer, source)
        params = {"length": length, "reverse": False, "unroll": 1,
                  "num_consts": body.num_consts, "num_carry": body.num_carry}
    else:  # cond
        body = _trace_branches(b, p["branches"], outer, source)
        params = {"length": 1, "reverse": False, "unroll": 1,
                  "num_consts": body.num_consts, "num_carry": 0}
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
    params["body"] = body
    flops = body.length * (max(_branch_flops(body)) if body.branches else
                           body.graph.total_flops)
    b.nodes.append(Node(
        name=name, op=prim, kind=LOOP_KIND, inputs=tuple(outer), outputs=tuple(outputs),
        params=params, scope=scope, source=source, flops=flops,
        bytes_read=sum(_nbytes(b.values[v].spec) for v in outer
                       if b.values[v].kind != "literal"),
        bytes_written=sum(_nbytes(b.values[v].spec) for v in outputs),
        primitive=eqn.primitive))


def _branch_flops(body: LoopBody) -> list[int]:
    g = body.graph
    return [sum(g.node(n).flops for n in names) for names, _ in body.branches]
