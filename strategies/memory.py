"""The memory a training step holds at its peak, per device, under a plan.

Three parts, in the order a step runs them:

- **held throughout**: every parameter and its optimizer state as stored (split over its
  shard group where the parallel optimizer takes it: :meth:`CostModel.parameter_parts
  <autopar.strategies.cost.CostModel.parameter_parts>`, the rule of ``parameter_memory``),
  the parallel optimizer's gathered copies (from the start of the step to the end of
  backward) and the batch;
- **forward and backward**: what backward reads (:class:`Residuals`: the residuals of each
  operator's VJP by the kind's rule, :mod:`autopar.graph.residuals`; a value kept by several
  operators is one buffer; a value XLA fuses away is not stored where backward can recompute
  it cheaply, and its fused chain's stored inputs are kept instead) accumulates
  through forward and is released through backward, each buffer after the last backward
  operator that reads it, while the parameters' gradients accumulate and each activation's
  cotangent lives from its first contribution to its producer's backward; at each operator
  the values it makes (and the copies a redistribution makes for it) are live with
  everything held (the transient);
- **gradient sync and update**: the synchronised gradients beside the local ones (one
  merged all-reduce, as XLA runs it), then the optimizer writes the new parameters and
  state, one parameter after the other. autopar's training step does not donate its
  arguments, so those are outputs beside them, which XLA allocates for the whole program: a
  temporary shares one of their buffers while it is not yet written, and only if it fits
  (``Problem.param_bytes(..., donated=True)``: written in place, nothing reserved).

The peak is the largest total of that sequence (:func:`step_memory`), held throughout
included. It is what ``Plan.cost.memory_bytes`` reports and the memory budget of the
search checks (:mod:`autopar.strategies.search`). The search's objective keeps an additive
approximation, one term per vertex (:class:`~autopar.strategies.problem.Problem`): a
parameter's :meth:`~autopar.strategies.cost.CostModel.parameter_memory`, a data input's
block and an operator's :meth:`Residuals.kept_outputs` (its outputs backward reads, in its
own layout; a loop node: its body's, times its trip count); the ``exact`` mode's memory
constraint is on that sum.

XLA's ``compiled.memory_analysis()`` is the referee: ``argument + output + temp - alias``
bytes of the compiled step (``benchmarks/bench_memory.py``, docs/fidelity.md).

>>> import jax.numpy as jnp, autopar
>>> g = autopar.trace(lambda w, x: jnp.tanh(x @ w).sum(), jnp.ones((4, 4)), jnp.ones((2, 4)))
>>> from autopar.strategies.problem import fused_values, requires_grad
>>> r = Residuals(g, requires_grad(g), fused_values(g))
>>> sorted(r.kept_outputs)    # tanh's output (its derivative); x is a data input, stored
['tanh_0']
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from autopar.graph.ir import Graph
from autopar.graph.loops import LOOP_KIND
from autopar.graph.ops import NO_GRADIENT
from autopar.graph.residuals import DIVIDES_BY_ROW, NOT_RECOMPUTED, kept
from autopar.strategies.layout import TensorLayout

__all__ = ["ParamBytes", "Residuals", "StepMemory", "recomputed_bytes", "size", "step_memory"]

#: a buffer: (value, the layout it is stored in[, "row": a division's row in that shape])
Key = tuple
#: a value backward reads: (value, the operator reading it or None: its own, input position)
Ref = tuple[str, "str | None", int]
#: the position of a division's row in a Ref (value: the division's output, whose shape
#: and layout the row is kept in; :data:`~autopar.graph.residuals.DIVIDES_BY_ROW`)
ROW = -2


class Residuals:
    """What the backward of a graph reads.

    ``differentiated``: the operators whose backward runs (an input and an output carry a
    gradient, and the output reaches a seeded output, the loss, through operators that pass
    gradients); ``rules[node]``: the values its backward reads by its kind's rule
    (:func:`autopar.graph.residuals.kept`), each as ``(value, reader, position)`` -- the value
    as operator ``reader`` reads it at input ``position`` (in its layout there), or ``(value,
    None, -1)`` in its own layout. :meth:`resolve` turns a value XLA fuses away into the
    stored values its fused chain reads, under a plan (a value moved to another layout is
    stored by the move); ``refs`` is that with nothing moved, and ``kept_outputs`` the
    activations it keeps (the search charges each to its producer, in its own layout). A
    loop node's residuals are its body's (priced by its candidates), not listed here."""

    def __init__(self, graph: Graph, requires_grad: Mapping[str, bool],
                 fused: frozenset[str], seeds: Sequence[str] | None = None,
                 param_like: frozenset[str] = frozenset()) -> None:
        self.graph, self.fused, self.param_like = graph, fused, param_like
        values = graph.values
        self.static: set[str] = set()  # made from constants alone (iota, masks)
        for node in graph.nodes:
            if all(values[u].kind in ("literal", "const") or u in self.static
                   for u in node.inputs):
                self.static.update(node.outputs)
        seeded = set(graph.outputs[:1] if seeds is None else seeds)
        reach: set[str] = set()
        for node in reversed(graph.nodes):
            if node.op not in NO_GRADIENT and any(v in seeded for v in node.outputs):
                reach.add(node.name)
                seeded.update(node.inputs)
        self.differentiated = frozenset(
            n.name for n in graph.nodes if n.name in reach
            and any(requires_grad[v] for v in n.inputs)
            and any(requires_grad[v] for v in n.outputs))
        self.rules: dict[str, tuple[Ref, ...]] = {}
        for node in graph.nodes:
            if node.name not in self.differentiated or node.kind == LOOP_KIND:
                continue
            ins, outs = kept(node, [requires_grad[v] for v in node.inputs])
            shape = values[node.outputs[0]].spec.shape
            row = node.op in DIVIDES_BY_ROW
            self.rules[node.name] = tuple(dict.fromkeys(
                [(node.outputs[0], node.name, ROW) if row and self._row(node.inputs[j], shape)
                 else (node.inputs[j], node.name, j)
                 for j in ins] + [(node.outputs[i], None, -1) for i in outs]))
        self._regions(graph)
        self.refs, _ = self.split(self.resolve(lambda v, reader, j: False))
        self.kept_outputs = frozenset(
            [v for refs in self.refs.values() for v, _, _ in refs
             if graph.values[v].kind == "activation"] +
            [v for ins in self.region_inputs.values() for v in ins
             if graph.values[v].kind == "activation"])

    def _row(self, value: str, shape: tuple[int, ...]) -> bool:
        """Whether a division by ``value`` divides by a broadcast row XLA keeps at the
        division's shape: a computed value of another shape (not a constant or literal,
        which XLA folds into the division)."""
        v = self.graph.values[value]
        return v.spec.shape != shape and v.kind == "activation" and value not in self.static

    def stored_anyway(self, nodes: Sequence[str]) -> set[str]:
        """The activations the backward of operators ``nodes`` reads from forward under any
        plan: what each kind's rule keeps, except a value XLA may fuse away (a plan stores
        it or the values its chain reads), a division's row and what a ``jax.checkpoint``
        region makes again. A lower bound of what a step keeps: the configuration search's
        memory floor (:mod:`autopar.pipeline.configure`)."""
        out: set[str] = set()
        for name in nodes:
            rule = set(self.rules.get(name, ()))
            out.update(v for v, reader, j in self.refs.get(name, ())
                       if (v, reader, j) in rule and j != ROW and not self._recomputed(v)
                       and self.graph.values[v].kind == "activation")
        return out

    def _regions(self, graph: Graph) -> None:
        """The ``jax.checkpoint`` regions (:mod:`autopar.graph.remat`): ``region[node]``,
        ``saved`` (the values their policies save), and per differentiated region its
        inputs (what backward keeps to recompute it) and its first differentiated node."""
        self.region = {n.name: n.remat.region for n in graph.nodes if n.remat is not None}
        self.saved = frozenset(v for n in graph.nodes if n.remat is not None and n.remat.saved
                               for v in n.outputs)
        self.region_inputs: dict[str, tuple[str, ...]] = {}
        self.region_first: dict[str, str] = {}
        # loop nodes inside a region: their residuals are made again in their backward
        self.loops_again = frozenset(n.name for n in graph.nodes if n.kind == LOOP_KIND
                                     and n.remat is not None and not n.remat.saved)
        for n in graph.nodes:
            r = self.region.get(n.name)
            if r is None or n.name not in self.differentiated:
                continue
            self.region_first.setdefault(r, n.name)
        for n in graph.nodes:
            r = self.region.get(n.name)
            if r not in self.region_first:
                continue
            ins = [u for u in n.inputs if graph.values[u].kind not in ("literal", "const")
                   and self.region.get(graph.values[u].producer or "") != r]
            self.region_inputs[r] = tuple(dict.fromkeys(self.region_inputs.get(r, ()) +
                                                        tuple(ins)))

    def split(self, resolved: Mapping[str, tuple[Ref, ...]]
              ) -> tuple[dict[str, tuple[Ref, ...]], dict[str, tuple[Ref, ...]]]:
        """Resolved refs (:meth:`resolve`) split into what backward keeps from forward and
        what it recomputes: a value an operator of a ``jax.checkpoint`` region reads that the
        region made and its policy does not save."""
        kept: dict[str, tuple[Ref, ...]] = {}
        again: dict[str, tuple[Ref, ...]] = {}
        values = self.graph.values
        for name, refs in resolved.items():
            r = self.region.get(name)
            redo = tuple(ref for ref in refs if r is not None and ref[0] not in self.saved
                         and self.region.get(values[ref[0]].producer or "") == r)
            kept[name] = tuple(ref for ref in refs if ref not in redo)
            if redo:
                again[name] = redo
        return kept, again

    def resolve(self, moved: Callable[[str, str, int], bool]) -> dict[str, tuple[Ref, ...]]:
        """Per differentiated operator, the stored values its backward reads: a fused value
        it reads is recomputed from the values its chain reads (:meth:`_recomputed`),
        except where operator ``reader`` reads it moved (``moved(value, reader, position)``:
        in another layout than its own, which the redistribution stores)."""
        values, memo = self.graph.values, {}
        out: dict[str, tuple[Ref, ...]] = {}
        for name, rule in self.rules.items():
            refs: list[Ref] = []
            for ref in rule:
                v, reader, j = ref
                again = j != ROW and self._recomputed(v) and \
                    (reader is None or not moved(v, reader, j))
                refs += self._stored(v, moved, memo) if again else [ref]
            out[name] = tuple(dict.fromkeys(
                r for r in refs if values[r[0]].kind not in ("literal", "const")))
        return out

    def _recomputed(self, v: str) -> bool:
        """Whether backward recomputes ``v`` from the values its fused chain reads: a fused
        value made from operands of its own shape (or from parameters or constants alone: a
        broadcast scale, a causal mask), unless by an operation XLA does not recompute
        (:data:`NOT_RECOMPUTED`). A value that combines a broadcast row (a normalisation's
        mean or scale, a softmax's sum) is stored where backward reads it, as XLA does."""
        if v in self.saved:  # (a jax.checkpoint policy saves it: stored)
            return False
        if v not in self.fused or v in self.param_like or v in self.static:
            return v in self.fused
        node = self.graph.producer(v)
        if node is None or node.op in NOT_RECOMPUTED:
            return False
        values, shape = self.graph.values, self.graph.values[v].spec.shape
        return all(values[u].spec.shape == shape for u in node.inputs
                   if values[u].kind != "literal")

    def _stored(self, v: str, moved: Callable[[str, str, int], bool],
                memo: dict[str, tuple[Ref, ...]]) -> list[Ref]:
        """The stored values the fused chain of ``v`` reads (what its backward recomputes it
        from), as their fused readers read them."""
        hit = memo.get(v)
        if hit is None:
            node = self.graph.producer(v)
            out: list[Ref] = []
            for j, u in enumerate(node.inputs if node is not None else ()):
                name = node.name  # type: ignore[union-attr]
                if self._recomputed(u) and not moved(u, name, j):
                    out += self._stored(u, moved, memo)
                else:
                    out.append((u, name, j))
            hit = memo[v] = tuple(out)
        return list(hit)


@dataclass(frozen=True, slots=True)
class ParamBytes:
    """One parameter's bytes per device: ``stored`` (its copy and optimizer state as stored),
    ``gathered`` (the parallel optimizer's copy gathered for use; 0 when not sharded),
    ``gradient`` (its local gradient), ``synced`` (its synchronised gradient: the all-reduce's
    or the reduce-scatter's output; 0 when no axis sums it), ``output`` (what the update
    writes: the new copy and state; 0 when untrained or written in place) and ``block`` (one
    buffer of it: the new copy, and each state slot alike)."""

    stored: float
    gathered: float = 0.0
    gradient: float = 0.0
    synced: float = 0.0
    output: float = 0.0
    block: float = 0.0


@dataclass(frozen=True, slots=True)
class StepMemory:
    """Bytes per device of one training step: ``peak`` (the largest live total), where it is
    (``phase``: forward, backward, sync or update; ``at``: the operator or parameter), and
    the parts: ``held`` (parameters, optimizer state, gathered copies and the batch, held
    throughout), ``activations`` (what backward reads, all live at the end of forward),
    ``gradients`` (every parameter's local gradient) and ``outputs`` (what the update
    writes)."""

    peak: float
    phase: str
    at: str
    held: float
    activations: float
    gradients: float
    outputs: float


class _Live:
    """The live buffers of a sweep (their total and their sizes) and the largest total it
    reached, with where. ``reserved``: the step's output buffers (the new parameters and
    state), which XLA allocates for the whole program beside its temporaries; a temporary
    shares one of them while it is not yet written, if it fits in it (one at a time), so at
    each point the total is the reserved bytes plus the live bytes that no free output
    buffer takes (matched largest first, each into the smallest that fits)."""

    def __init__(self, reserved: Sequence[float] = ()) -> None:
        self.now = 0.0
        self.best = (0.0, "forward", "")
        self.sizes: Counter[float] = Counter()
        self.free_outputs: Counter[float] = Counter(x for x in reserved if x > 0)
        self.reserved = float(sum(reserved))

    def alloc(self, nbytes: float) -> None:
        if nbytes > 0:
            self.now += nbytes
            self.sizes[nbytes] += 1

    def free(self, nbytes: float) -> None:
        if nbytes > 0:
            self.now -= nbytes
            self.sizes[nbytes] -= 1
            if not self.sizes[nbytes]:
                del self.sizes[nbytes]

    def see(self, phase: str, at: str, extra: Sequence[float] = ()) -> None:
        total = self.reserved + self.now + sum(extra)
        if total <= self.best[0]:
            return  # (what the outputs take only lowers it)
        total -= self._absorbed(extra)
        if total > self.best[0]:
            self.best = (total, phase, at)

    def _absorbed(self, extra: Sequence[float]) -> float:
        """The live bytes the free output buffers take: the buffers from the smallest up,
        each taking the largest live temporary that fits in it (optimal: a temporary that
        fits a buffer fits every larger one)."""
        if not self.free_outputs:
            return 0.0
        temps = sorted(self.sizes.items())
        for x in extra:
            if x > 0:
                temps.append((x, 1))
        temps.sort()
        fitting: list[list[float]] = []  # [size, count] of the temporaries that fit, largest last
        i, taken = 0, 0.0
        for cap, n in sorted(self.free_outputs.items()):
            while i < len(temps) and temps[i][0] <= cap:
                fitting.append([temps[i][0], temps[i][1]])
                i += 1
            while n > 0 and fitting:
                top = fitting[-1]
                k = min(n, int(top[1]))
                taken += k * top[0]
                n -= k
                top[1] -= k
                if top[1] <= 0:
                    fitting.pop()
        return taken


@dataclass(frozen=True)
class _Plan:
    """Where a plan puts the values: ``layouts`` (each value's own), ``reads`` (per operator,
    the layouts it reads its inputs in) and ``local(value, layout)`` (a device's bytes)."""

    layouts: Mapping[str, TensorLayout]
    reads: Mapping[str, Sequence[TensorLayout]]
    local: Callable[[str, TensorLayout], float]


def step_memory(graph: Graph, res: Residuals, requires_grad: Mapping[str, bool], *,
                layouts: Mapping[str, TensorLayout], reads: Mapping[str, Sequence[TensorLayout]],
                local: Callable[[str, TensorLayout], float], params: Mapping[str, ParamBytes],
                opaque: Mapping[str, float] | None = None,
                update: bool = True, again_loops: Mapping[str, float] | None = None
                ) -> StepMemory:
    """The ordered peak of one step (see the module docstring). ``layouts``: every value's
    own layout (its producer's, or its input vertex's); ``reads[node]``: the layouts the
    operator reads its inputs in; ``local(value, layout)``: a device's bytes of it;
    ``params``: per parameter :class:`ParamBytes`; ``opaque[node]``: what a loop node keeps
    for its backward (its candidate's memory); ``update``: the step synchronises the
    gradients and applies the optimizer (else it returns the gradients, as
    ``jax.value_and_grad``: its outputs, which XLA allocates for the whole program apart
    from its temporaries, so they are held throughout here); ``again_loops[node]``: what a
    loop node's body recomputes in one iteration's backward (its ``jax.checkpoint``
    regions': :func:`recomputed_bytes`), live through the loop's backward."""
    plan = _Plan(layouts, reads, local)
    gradients = sum(p.gradient for p in params.values())
    held = sum(p.stored + p.gathered for p in params.values()) + sum(
        local(v, layouts[v]) for v in graph.data_inputs())
    if not update:
        held += gradients
        params = {v: ParamBytes(p.stored, p.gathered) for v, p in params.items()}
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    again: dict[str, dict[Key, int]] = {}
    kept = _kept_buffers(graph, res, plan, index, again)
    live = _Live([x for p in params.values() for x in _output_buffers(p)] if update else ())
    activations = _forward(graph, res, plan, kept, dict(opaque or {}), live)
    grads = _backward(graph, res, requires_grad, plan, params, kept, dict(opaque or {}),
                      index, live, again, again_loops or {})
    outputs = _update(params, grads, live) if update else 0.0
    peak, phase, at = live.best
    return StepMemory(held + peak, phase, at, held, activations, gradients, outputs)


def recomputed_bytes(res: Residuals, layouts: Mapping[str, TensorLayout],
                     local: Callable[[str, TensorLayout], float]) -> float:
    """The bytes of the residuals a graph's ``jax.checkpoint`` regions make again in
    backward (each value once, in its own layout): what one iteration of a loop body
    whose layers are remat'd holds beside the loop's kept residuals in its backward."""
    _, again = res.split(res.resolve(lambda v, reader, j: False))
    keys = dict.fromkeys((v, layouts[v]) for refs in again.values() for v, _, _ in refs)
    return sum(local(v, lay) for v, lay in keys)


def _held(graph: Graph, v: str, lay: TensorLayout, plan: _Plan) -> bool:
    """Whether a value in ``lay`` is held throughout anyway (a parameter or data input in its
    own layout) or is no buffer (a literal, a constant)."""
    kind = graph.values[v].kind
    return kind in ("literal", "const") or (kind in ("param", "data") and
                                            lay == plan.layouts[v])


def _kept_buffers(graph: Graph, res: Residuals, plan: _Plan, index: Mapping[str, int],
                  again: dict[str, dict[Key, int]] | None = None) -> dict[Key, int]:
    """Buffer -> the index of the first operator whose backward reads it (it is released
    after that operator's backward). A ``jax.checkpoint`` region keeps its inputs until its
    first operator's backward; what it recomputes goes to ``again[region]`` instead."""
    out: dict[Key, int] = {}
    layouts, reads = plan.layouts, plan.reads
    kept, redo = res.split(res.resolve(lambda v, reader, j: reads[reader][j] != layouts[v]))
    for into, resolved in ((out, kept), (None, redo)):
        for name, refs in resolved.items():
            k = index[name]
            dest = out if into is not None else (again if again is not None else {}) \
                .setdefault(res.region[name], {})
            for v, reader, j in refs:
                if j == ROW:  # a division's row, in its output's shape and layout
                    key: Key = (v, layouts[v], "row")
                else:
                    key = (v, layouts[v] if reader is None else reads[reader][j])
                    if _held(graph, v, key[1], plan):
                        continue
                dest[key] = min(dest.get(key, k), k)
    for r, ins in res.region_inputs.items():
        k = index[res.region_first[r]]
        for v in ins:
            if not _held(graph, v, layouts[v], plan):
                out[(v, layouts[v])] = min(out.get((v, layouts[v]), k), k)
    return out


def _forward(graph: Graph, res: Residuals, plan: _Plan, kept: Mapping[Key, int],
             opaque: Mapping[str, float], live: _Live) -> float:
    """Sweep forward: at each operator its outputs (not fused away) and the moved copies of
    its inputs are made; then every buffer no later operator and no backward reads is
    freed. Returns what is live at its end (the kept buffers, the loss)."""
    layouts, local = plan.layouts, plan.local
    made: dict[int, list[Key]] = {}
    last: dict[Key, int] = {}
    for i, node in enumerate(graph.nodes):
        for v, lay in zip(node.inputs, plan.reads[node.name]):
            if _held(graph, v, lay, plan):
                continue
            own = (v, layouts[v])
            if (v, lay) not in last and lay != layouts[v]:
                made.setdefault(i, []).append((v, lay))  # the redistribution's copy
            last[(v, lay)] = i
            if own in last:
                last[own] = i
        for v in node.outputs:
            if v not in res.fused or (v, layouts[v]) in kept:  # (a fused value backward
                made.setdefault(i, []).append((v, layouts[v]))  # reads is stored too)
                last[(v, layouts[v])] = i
            if (v, layouts[v], "row") in kept:
                made.setdefault(i, []).append((v, layouts[v], "row"))
    for v in graph.outputs:
        if (v, layouts.get(v)) in last:
            last[(v, layouts[v])] = len(graph.nodes)
    frees: dict[int, list[Key]] = {}
    for keys in made.values():
        for key in keys:
            if key not in kept:
                frees.setdefault(last[key], []).append(key)
    for i, node in enumerate(graph.nodes):
        for key in made.get(i, ()):
            live.alloc(local(key[0], key[1]))
        extra = opaque.get(node.name, 0.0)
        live.see("forward", node.name, [extra])
        for key in frees.get(i, ()):
            live.free(local(key[0], key[1]))
        if node.name in res.differentiated and node.name not in res.loops_again:
            live.alloc(extra)  # a loop node's residuals, until its backward
    return live.now


def _backward(graph: Graph, res: Residuals, requires_grad: Mapping[str, bool], plan: _Plan,
              params: Mapping[str, ParamBytes], kept: Mapping[Key, int],
              opaque: Mapping[str, float], index: Mapping[str, int],
              live: _Live, again: Mapping[str, Mapping[Key, int]] | None = None,
              again_loops: Mapping[str, float] | None = None) -> dict[str, float]:
    """Sweep backward over the differentiated operators: each operator's input cotangents
    are made (a parameter's gradient buffer at its first contribution, an activation's
    likewise; a later contribution, or one in a moved layout, is a transient partial), then
    its outputs' cotangents and the buffers no earlier backward reads are freed. A
    ``jax.checkpoint`` region's recomputed residuals (``again``) are made when its backward
    starts and released like kept ones. Returns each parameter's gradient bytes (all live
    at its end)."""
    values, layouts, local = graph.values, plan.layouts, plan.local
    release: dict[int, list[float]] = {}
    for key, k in kept.items():
        release.setdefault(k, []).append(local(key[0], key[1]))
    cots: dict[str, float] = {}
    grads: dict[str, float] = {}
    for node in reversed(graph.nodes):
        name = node.name
        if name not in res.differentiated:
            continue
        for key, k in (again or {}).pop(res.region.get(name, ""), {}).items():
            if key not in kept:  # (its forward again: the region's residuals)
                live.alloc(local(key[0], key[1]))
                release.setdefault(k, []).append(local(key[0], key[1]))
        if name in res.loops_again:  # (a recomputed loop: its residuals made again)
            live.alloc(opaque.get(name, 0.0))
        redo = (again_loops or {}).get(name, 0.0)  # (one iteration's recomputation)
        live.alloc(redo)
        partial = []
        for v, lay in zip(node.inputs, plan.reads[name]):
            kind = values[v].kind
            if not requires_grad[v] or v in res.fused or kind not in ("param", "activation"):
                continue
            held = grads if kind == "param" else cots
            if v in held or lay != layouts[v]:
                partial.append(local(v, lay))
            if v not in held:
                held[v] = params[v].gradient if v in params else local(v, layouts[v])
                live.alloc(held[v])
        live.see("backward", name, partial)
        for v in node.outputs:
            live.free(cots.pop(v, 0.0))
        for nbytes in release.get(index[name], ()):
            live.free(nbytes)
        live.free(opaque.get(name, 0.0))
        live.free(redo)
    for v, p in params.items():  # a parameter backward never reaches: a zero gradient
        if p.gradient and v not in grads:
            grads[v] = p.gradient
            live.alloc(p.gradient)
    for nbytes in cots.values():
        live.free(nbytes)
    return grads


def _output_buffers(p: ParamBytes) -> list[float]:
    """The buffers the update writes for one parameter: its new copy and each state slot
    (one block each; a fractional state, one smaller buffer)."""
    if p.output <= 0 or p.block <= 0:
        return [p.output] if p.output > 0 else []
    n, rest = divmod(p.output, p.block)
    return [p.block] * int(n) + ([rest] if rest > 1e-9 * p.block else [])


def _update(params: Mapping[str, ParamBytes], grads: Mapping[str, float], live: _Live) -> float:
    """The gradient sync (every synchronised gradient beside its local one, as one merged
    all-reduce), then the optimizer, parameter by parameter: its new copy and state are
    written (into their reserved buffers), its gradient freed. Returns the bytes written."""
    synced = [v for v, p in params.items() if p.synced and v in grads]
    if synced:
        live.see("sync", "gradient all-reduce", [params[v].synced for v in synced])
        for v in synced:
            live.alloc(params[v].synced)
            live.free(grads[v])
    written = 0.0
    for v, p in params.items():
        if v not in grads:
            continue
        live.free(p.synced if v in synced else grads[v])  # (read as its outputs are made)
        for nbytes in _output_buffers(p):  # written now: no longer free to share
            live.free_outputs[nbytes] -= 1
        written += p.output
        live.see("update", v)
    return written


def size(nbytes: float) -> str:
    """Bytes as a person reads them: GiB from 1 GiB up, else MiB.

    >>> size(3 * 2**30), size(5.5 * 2**20)
    ('3.00 GiB', '5.50 MiB')
    """
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
