"""The operator registry: every supported JAX primitive, grouped into operator kinds.

A kind groups primitives that split the same way. Each kind is one :class:`OpKind` record in
:data:`OPERATORS`, holding everything the rest of autopar knows about it:

- ``primitives``: the JAX primitives of the kind (the tracer accepts exactly these);
- ``spec``: the operator as a loop nest (:class:`OpSpec`, read by the search);
- ``flops``: FLOPs of one forward application (read by the tracer for the cost model);
- ``local_params``: how its shape-carrying params change when its tensors are split (shape
  arithmetic only; :func:`autopar.lower.lower.local_params` applies it before re-binding);
- ``no_grad``: its primitives whose outputs carry no gradient (comparisons, argmax, iota);
- ``fusion``: how XLA fuses it (``"loop"``: into the operator that reads it, and it takes
  such producers in; ``"input"``: it only takes them in, as a reduction does).

Adding an operator kind is one record here (+ a test case in tests/test_registry.py, which
checks that every kind has every part). A primitive not listed, and not a call that the
tracer inlines, is unsupported: tracing raises :class:`~autopar.errors.UnsupportedOperatorError`.

The loop nest (like an einsum): ``sizes`` are the iteration dims, ordered output dims first
(in output order) then reduced dims; each input and output maps each of its dims to an
iteration dim, or to None when that dim cannot be split (a broadcast size-1 dim, a
convolution's spatial dim, a concatenated axis, a gathered table dim...). A strategy splits
iteration dims; MindSpore's per-input tuples are read off the input maps, so matched splits
on contracted and broadcast dims hold by construction. Splitting a ``summed`` dim (matmul K,
conv in-features, reduce_sum axes, scatter-add's updates) leaves the outputs partial sums;
other reduced dims (max, argmax, sort) cannot be split.

>>> KINDS["dot_general"], KINDS["exp"], KINDS["reduce_sum"]
('matmul', 'elementwise', 'reduce')
>>> import jax.numpy as jnp, autopar
>>> g = autopar.trace(lambda w, x: x @ w, jnp.ones((8, 4)), jnp.ones((2, 8)))
>>> spec = op_spec(g.nodes[0], g)
>>> spec.sizes, spec.in_maps, spec.out_maps, spec.summed
((2, 4, 8), ((0, 2), (2, 1)), ((0, 1),), (2,))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from autopar.graph.ir import Graph, Node, TensorSpec

__all__ = ["KINDS", "INLINED", "UNSUPPORTED_HINTS", "OPERATORS", "OpKind", "OpSpec",
           "NO_GRADIENT", "FUSED_PRODUCERS", "FUSING_READERS", "flops", "op_spec",
           "supported_primitives"]

Shape = tuple[int, ...]
Map = tuple[int | None, ...]
#: (local shape, global shape) of one input or output of a node
Shapes = tuple[Shape, Shape]


# ---------------------------------------------------------------------------- loop nests


@dataclass(frozen=True, slots=True)
class OpSpec:
    """An operator as a loop nest: what a strategy may split (see the module docstring)."""

    sizes: tuple[int, ...]
    in_maps: tuple[Map, ...]
    out_maps: tuple[Map, ...]
    summed: tuple[int, ...] = ()       # reduced dims whose split leaves a partial sum
    fixed: tuple[int, ...] = ()        # iteration dims that must not be split
    divides: tuple[tuple[int, int], ...] = ()  # (iter dim, n): its split must also divide n
    reasons: tuple[tuple[int, int, str], ...] = ()  # (input, dim, why it cannot be split)

    def splittable(self, d: int) -> bool:
        return d not in self.fixed

    def refuses(self, d: int, count: int) -> str:
        """Why iteration dim ``d`` cannot be split ``count`` ways ("" when it can): the one
        rule of a legal split of a dim (a count of 1 is always legal).

        >>> OpSpec((8, 6), (), (), fixed=(1,), divides=((0, 12),)).refuses(0, 8)
        'split 8 must also divide 12 (the reshaped dim)'
        """
        if count == 1:
            return ""
        if d in self.fixed:
            return f"iteration dim {d} cannot be split"
        if self.sizes[d] % count:
            return f"split {count} does not divide the dim size {self.sizes[d]}"
        for e, n in self.divides:
            if e == d and n % count:
                return f"split {count} must also divide {n} (the reshaped dim)"
        return ""

    def allows(self, d: int, count: int) -> bool:
        """Whether iteration dim ``d`` may be split ``count`` ways (:meth:`refuses`)."""
        return not self.refuses(d, count)

    def why_whole(self, i: int, d: int) -> str:
        """Why dim ``d`` of input ``i`` cannot be split (for error messages)."""
        for j, e, why in self.reasons:
            if (j, e) == (i, d):
                return why
        return "it is broadcast, windowed, gathered or concatenated"


def _ident(rank: int) -> Map:
    return tuple(range(rank))


def _whole(shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    """A loop nest with nothing splittable (always correct, maybe slow)."""
    return OpSpec(outs[0], tuple(tuple(None for _ in s) for s in shapes),
                  tuple(tuple(None for _ in o) for o in outs), fixed=_ident(len(outs[0])))


def _elementwise_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    out = outs[0]
    rank = len(out)
    maps = []
    for s in shapes:
        off = rank - len(s)
        maps.append(tuple(off + i if n == out[off + i] else None for i, n in enumerate(s)))
    return OpSpec(out, tuple(maps), tuple(_ident(rank) for _ in outs))


def _reduce_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    in_shape, axes = shapes[0], tuple(node.params["axes"])
    summed = node.op == "reduce_sum"
    keep = [d for d in range(len(in_shape)) if d not in axes]
    order = keep + sorted(axes)
    pos = {d: i for i, d in enumerate(order)}
    red = tuple(pos[d] for d in sorted(axes))
    in_map = tuple(pos[d] for d in range(len(in_shape)))
    return OpSpec(tuple(in_shape[d] for d in order), tuple(in_map for _ in shapes),
                  (tuple(pos[d] for d in keep),), summed=red if summed else (),
                  fixed=() if summed else red)


def _dot_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = shapes
    lfree = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    sizes = [lhs[d] for d in lb] + [lhs[d] for d in lfree] + [rhs[d] for d in rfree] + \
            [lhs[d] for d in lc]
    nb, nl, nr = len(lb), len(lfree), len(rfree)
    lmap: list[int | None] = [None] * len(lhs)
    rmap: list[int | None] = [None] * len(rhs)
    for i, (a, b) in enumerate(zip(lb, rb)):
        lmap[a], rmap[b] = i, i
    for i, d in enumerate(lfree):
        lmap[d] = nb + i
    for i, d in enumerate(rfree):
        rmap[d] = nb + nl + i
    for i, (a, b) in enumerate(zip(lc, rc)):
        lmap[a], rmap[b] = nb + nl + nr + i, nb + nl + nr + i
    summed = tuple(range(nb + nl + nr, len(sizes)))
    return OpSpec(tuple(sizes), (tuple(lmap), tuple(rmap)), (_ident(nb + nl + nr),),
                  summed=summed)


def _conv_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    out = outs[0]
    dn = node.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    groups = node.params["feature_group_count"] * node.params["batch_group_count"]
    rank = len(out)
    # iteration: output dims (in output order), then in-features, then kernel spatial
    sizes = list(out) + [shapes[1][rhs_spec[1]]] + [shapes[1][d] for d in rhs_spec[2:]]
    c_it = rank
    fixed = [out_spec[i] for i in range(2, rank)] + list(range(rank + 1, len(sizes)))
    if groups != 1:
        fixed += [c_it, out_spec[1]]
    lmap: list[int | None] = [None] * len(shapes[0])
    rmap: list[int | None] = [None] * len(shapes[1])
    lmap[lhs_spec[0]] = out_spec[0]
    lmap[lhs_spec[1]] = c_it if groups == 1 else None
    rmap[rhs_spec[0]] = out_spec[1]
    rmap[rhs_spec[1]] = c_it if groups == 1 else None
    for i, d in enumerate(rhs_spec[2:]):
        rmap[d] = rank + 1 + i
    return OpSpec(tuple(sizes), (tuple(lmap), tuple(rmap)), (_ident(rank),),
                  summed=(c_it,) if groups == 1 else (), fixed=tuple(sorted(set(fixed))))


def _gather_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    out = outs[0]
    dn = node.params["dimension_numbers"]
    operand, indices = shapes
    slice_sizes = node.params["slice_sizes"]
    offset = list(dn.offset_dims)
    batch_out = [d for d in range(len(out)) if d not in offset]
    op_batch = list(getattr(dn, "operand_batching_dims", ()) or ())
    idx_batch = list(getattr(dn, "start_indices_batching_dims", ()) or ())
    op_offset = [d for d in range(len(operand)) if d not in dn.collapsed_slice_dims
                 and d not in op_batch]
    omap: list[int | None] = [None] * len(operand)
    for od, o in zip(op_offset, offset):
        if slice_sizes[od] == operand[od] and od not in dn.start_index_map:
            omap[od] = o
    idx_dims = [d for d in range(len(indices)) if d != len(indices) - 1]
    imap: list[int | None] = [None] * len(indices)
    for idim, o in zip(idx_dims, batch_out):
        imap[idim] = o
    for ob, ib in zip(op_batch, idx_batch):
        omap[ob] = imap[ib]
    fixed = tuple(o for o in offset if o not in omap)
    return OpSpec(out, (tuple(omap), tuple(imap)), (_ident(len(out)),), fixed=fixed)


def _inner_reason(in_shape: Shape, out_shape: Shape, gi: int, go: int) -> str:
    return (f"the reshape {in_shape} -> {out_shape} merges it into output dim {go} as an "
            f"inner factor, so a split of it would leave each device a strided, "
            f"non-contiguous piece of dim {go}, which no layout describes; split dim {gi} "
            f"(the leading dim of the merged group) instead")


def _reshape_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    """Only the leading dim of each merged/split group can be split (contiguous blocks)."""
    in_shape, out_shape = shapes[0], outs[0]
    imap: list[int | None] = [None] * len(in_shape)
    i = o = 0
    divides, reasons = [], []
    while i < len(in_shape) and o < len(out_shape):
        if in_shape[i] == 1 and out_shape[o] != 1:
            i += 1
            continue
        if out_shape[o] == 1 and in_shape[i] != 1:
            o += 1
            continue
        gi, go = i, o
        pi, po = in_shape[i], out_shape[o]
        i, o = i + 1, o + 1
        while pi != po:
            if pi < po:
                pi *= in_shape[i]
                i += 1
            else:
                po *= out_shape[o]
                o += 1
        imap[gi] = go
        if in_shape[gi] != out_shape[go]:
            divides.append((go, in_shape[gi]))
        reasons += [(0, inner, _inner_reason(in_shape, out_shape, gi, go))
                    for inner in range(gi + 1, i) if in_shape[inner] != 1]
    fixed = tuple(d for d in range(len(out_shape)) if d not in imap)
    return OpSpec(tuple(out_shape), (tuple(imap),), (_ident(len(out_shape)),), fixed=fixed,
                  divides=tuple(divides), reasons=tuple(reasons))


def _kept_dims(out: Shape, keep: Sequence[int], n_in: int) -> OpSpec:
    """Output dims ``keep`` follow the first input's dims; the others stay whole; other
    inputs (scalar operands) are not split."""
    m = tuple(d if d in keep else None for d in range(len(out)))
    fixed = tuple(d for d in range(len(out)) if d not in keep)
    return OpSpec(out, (m,) + tuple(() for _ in range(n_in - 1)), (_ident(len(out)),),
                  fixed=fixed)


def _broadcast_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    out = outs[0]
    m = tuple(o if shapes[0][i] == out[o] else None
              for i, o in enumerate(node.params["broadcast_dimensions"]))
    return OpSpec(out, (m,) + tuple(() for _ in shapes[1:]), (_ident(len(out)),))


def _transpose_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    perm = node.params["permutation"]  # out dim i = in dim perm[i]
    m = [0] * len(perm)
    for i, src in enumerate(perm):
        m[src] = i
    return OpSpec(outs[0], (tuple(m),), (_ident(len(outs[0])),))


def _slice_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    out, p = outs[0], node.params
    full = [d for d in range(len(out)) if out[d] == shapes[0][d]
            and (node.op != "slice" or (p["start_indices"][d] == 0
                                        and (p.get("strides") is None or p["strides"][d] == 1)))]
    return _kept_dims(out, full, len(shapes))


def _concatenate_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    out, ax = outs[0], node.params["dimension"]
    m = tuple(None if d == ax else d for d in range(len(out)))
    return OpSpec(out, tuple(m for _ in shapes), (_ident(len(out)),), fixed=(ax,))


def _stack_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    """``stack[axis]``: each input is one index of the new output dim ``axis`` (whole); the
    other output dims are the inputs' dims."""
    out, ax = outs[0], node.params["axis"]
    m = tuple(d if d < ax else d + 1 for d in range(len(out) - 1))
    return OpSpec(out, tuple(m for _ in shapes), (_ident(len(out)),), fixed=(ax,))


def _along_axis_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    """An operator along one ``axis`` (cumulative sums, top-k; ``sort``'s ``dimension``, of
    one or several operands): that dim whole, every other dim of each input is the same dim
    of each output."""
    sizes, p = shapes[0], node.params
    ax = p["axis"] if "axis" in p else p["dimension"]
    m = tuple(None if d == ax else d for d in range(len(sizes)))
    return OpSpec(tuple(sizes), tuple(m for _ in shapes), tuple(m for _ in outs), fixed=(ax,))


def _split_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    sizes, ax = shapes[0], node.params["axis"]
    m = tuple(None if d == ax else d for d in range(len(sizes)))
    return OpSpec(sizes, (_ident(len(sizes)),), tuple(m for _ in outs), fixed=(ax,))


def _pad_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    cfg = node.params["padding_config"]
    padded = {d for d, (lo, hi, interior) in enumerate(cfg) if lo or hi or interior}
    return _kept_dims(outs[0], [d for d in range(len(outs[0])) if d not in padded], 2)


def _iota_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    return OpSpec(outs[0], (), (_ident(len(outs[0])),))


def _leading_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    """The output's leading dims are the first input's (and those of the other inputs of its
    rank; a rank-0 input is broadcast); a dim only one side has stays whole: the bytes
    ``bitcast_convert_type`` to a narrower type appends (to a wider one: drops), a key's data
    (``random_wrap`` reads it, ``random_unwrap`` appends it), ``random_split``'s new keys."""
    out = outs[0]
    n = min(len(shapes[0]), len(out))
    maps = tuple(tuple(d if d < n and s[d] == out[d] else None for d in range(len(s)))
                 if len(s) in (len(shapes[0]), 0) else tuple(None for _ in s) for s in shapes)
    return OpSpec(out, maps, (_ident(len(out)),), fixed=tuple(range(n, len(out))))


def _random_bits_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    """``random_bits(keys)`` draws ``(*keys.shape, *shape)``: the keys' dims split alike, and
    the drawn dims split too -- each device draws its block of the same global bits (the
    lowering, :mod:`autopar.graph.prng`)."""
    out = outs[0]
    return OpSpec(out, (_ident(len(shapes[0])),), (_ident(len(out)),))


def _unwindowed(p: dict[str, Any], rank: int) -> list[int]:
    """The dims a window (pooling, its transpose) does not span: window 1, stride 1, no
    padding; along them input and output are the same dim."""
    wd, ws, pad = p["window_dimensions"], p["window_strides"], p["padding"]
    return [d for d in range(rank) if wd[d] == 1 and ws[d] == 1 and tuple(pad[d]) == (0, 0)]


def _window_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    out = outs[0]
    return _kept_dims(out, _unwindowed(node.params, len(out)), 1)


def _select_scatter_spec(node: Node, shapes: Sequence[Shape],
                         outs: Sequence[Shape]) -> OpSpec:
    """``select_and_scatter_add(source, operand)`` (max-pool's transpose: each window's
    ``source`` value added where the window's ``operand`` maximum is): the dims the window
    does not span split, ``source`` and ``operand`` alike; the windowed dims stay whole."""
    out = outs[0]
    ok = _unwindowed(node.params, len(out))
    m = tuple(d if d in ok else None for d in range(len(out)))
    return OpSpec(out, (m, m), (_ident(len(out)),),
                  fixed=tuple(d for d in range(len(out)) if d not in ok))


def _scatter_spec(node: Node, shapes: Sequence[Shape], outs: Sequence[Shape]) -> OpSpec:
    """``scatter`` / ``scatter-add(operand, indices, updates)``; the output is the operand.

    An operand dim the updates' window covers whole, and that no index addresses, splits the
    operand and the updates alike (the indices are unchanged); a batching dim (``vmap``'s)
    splits the indices too; the dims the indices address stay whole. The updates' scatter
    dims (one per index, the indices' leading dims) are further iteration dims: summed for
    ``scatter-add`` -- each device adds its share of the updates, a partial sum over their
    axes (the lowering adds the operand on the first device of those axes only) -- and not
    split for ``scatter``, whose later updates overwrite earlier ones."""
    operand, indices, updates = shapes
    out, dn = outs[0], node.params["dimension_numbers"]
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()) or ())
    idx_batch = tuple(getattr(dn, "scatter_indices_batching_dims", ()) or ())
    window = [d for d in range(len(operand))
              if d not in dn.inserted_window_dims and d not in op_batch]
    umap: list[int | None] = [None] * len(updates)
    imap: list[int | None] = [None] * len(indices)
    for od, ud in zip(window, dn.update_window_dims):
        if updates[ud] == operand[od] and od not in dn.scatter_dims_to_operand_dims:
            umap[ud] = od
    sizes, summed = list(out), []
    scatter_dims = [d for d in range(len(updates)) if d not in dn.update_window_dims]
    for idim, ud in zip(range(len(indices) - 1), scatter_dims):  # (last: the index vector)
        if idim in idx_batch:
            imap[idim] = umap[ud] = op_batch[idx_batch.index(idim)]
        elif node.op == "scatter-add":
            imap[idim] = umap[ud] = len(sizes)
            summed.append(len(sizes))
            sizes.append(indices[idim])
    fixed = tuple(d for d in range(len(out)) if d not in umap)
    return OpSpec(tuple(sizes), (_ident(len(out)), tuple(imap), tuple(umap)),
                  (_ident(len(out)),), summed=tuple(summed), fixed=fixed,
                  reasons=tuple((0, d, "the scatter's indices address it, or the updates "
                                 "cover only part of it") for d in fixed))


def op_spec(node: Node, graph: Graph) -> OpSpec:
    """The loop nest of a node (see the module docstring); nothing splits for a kind that
    is not registered."""
    shapes = [graph.spec(v).shape for v in node.inputs]
    outs = [graph.spec(v).shape for v in node.outputs]
    kind = OPERATORS.get(node.kind)
    return kind.spec(node, shapes, outs) if kind is not None else _whole(shapes, outs)


# ---------------------------------------------------------------------------- FLOPs

FlopsRule = Callable[[Sequence[TensorSpec], Sequence[TensorSpec], dict[str, Any]], int]


def _no_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], p: dict[str, Any]) -> int:
    return 0  # data movement


def _output_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec],
                  p: dict[str, Any]) -> int:
    return sum(s.size for s in outs)


def _input_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec],
                 p: dict[str, Any]) -> int:
    return ins[0].size


def _dot_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], p: dict[str, Any]) -> int:
    (lhs_contract, _), _ = p["dimension_numbers"]
    k = math.prod(ins[0].shape[d] for d in lhs_contract)
    return 2 * outs[0].size * k


def _conv_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], p: dict[str, Any]) -> int:
    rhs_spec = p["dimension_numbers"].rhs_spec  # (out feature, in feature, *spatial)
    rhs = ins[1].shape
    per_output = rhs[rhs_spec[1]] * math.prod(rhs[d] for d in rhs_spec[2:])
    return 2 * outs[0].size * per_output


def _window_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], p: dict[str, Any]) -> int:
    return outs[0].size * math.prod(p["window_dimensions"])


def _source_window_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec],
                         p: dict[str, Any]) -> int:
    """Max-pool's transpose: one comparison per window element of each source element."""
    return ins[0].size * math.prod(p["window_dimensions"])


def _sort_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], p: dict[str, Any]) -> int:
    """A comparison sort: ``ceil(log2 n)`` comparisons per element along the sorted dim."""
    n = ins[0].shape[p["dimension"]]
    return ins[0].size * max(1, (n - 1).bit_length())


def _updates_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec],
                   p: dict[str, Any]) -> int:
    return ins[2].size  # scatter-add: one addition per update element


#: integer operations of one threefry2x32 hash (20 rounds of add, rotate and xor on two
#: words, 5 key injections) and the combining of its two words: one per drawn element
THREEFRY_OPS = 120


def _draw_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec],
                p: dict[str, Any]) -> int:
    return outs[0].size * THREEFRY_OPS  # random_bits: one hash per output element


def flops(kind: str, ins: Sequence[TensorSpec], outs: Sequence[TensorSpec],
          params: dict[str, Any]) -> int:
    """FLOPs of one forward application (data movement counts 0).

    >>> from autopar.graph.ir import TensorSpec as T
    >>> flops("matmul", [T((4, 8), "float32"), T((8, 16), "float32")], [T((4, 16), "float32")],
    ...       {"dimension_numbers": (((1,), (0,)), ((), ()))})
    1024
    """
    k = OPERATORS.get(kind)
    return int(k.flops(ins, outs, params)) if k is not None else 0


# ---------------------------------------------------------------------------- local params

LocalRule = Callable[[dict[str, Any], Sequence[Shapes], Sequence[Shapes]], dict[str, Any]]


def _same(p: dict[str, Any], ins: Sequence[Shapes], outs: Sequence[Shapes]) -> dict[str, Any]:
    return p  # no param carries a global size of a dim the loop nest lets split


def _out_shape(key: str) -> LocalRule:
    def rule(p: dict[str, Any], ins: Sequence[Shapes], outs: Sequence[Shapes]) -> dict[str, Any]:
        p[key] = tuple(outs[0][0])
        return p
    return rule


def _reshape_local(p: dict[str, Any], ins: Sequence[Shapes],
                   outs: Sequence[Shapes]) -> dict[str, Any]:
    if "new_sizes" not in p:  # squeeze, expand_dims
        return p
    if p.get("dimensions") is not None:
        raise ValueError("a reshape with `dimensions` (a transposing reshape) cannot run on "
                         "split inputs")
    p["new_sizes"] = tuple(outs[0][0])
    return p


def _slice_local(p: dict[str, Any], ins: Sequence[Shapes],
                 outs: Sequence[Shapes]) -> dict[str, Any]:
    if "slice_sizes" in p:  # dynamic_slice
        return _slice_sizes(p, ins, outs)
    start, limit = list(p["start_indices"]), list(p["limit_indices"])
    strides = p.get("strides")
    for d, (loc, glob) in enumerate(zip(*ins[0])):
        if loc != glob:
            if start[d] != 0 or limit[d] != glob or (strides is not None and strides[d] != 1):
                raise ValueError(f"dim {d} is split but not taken whole by the slice")
            limit[d] = loc
    p["limit_indices"] = tuple(limit)
    return p


def _slice_sizes(p: dict[str, Any], ins: Sequence[Shapes],
                 outs: Sequence[Shapes]) -> dict[str, Any]:
    sizes = list(p["slice_sizes"])
    batching = tuple(getattr(p.get("dimension_numbers"), "operand_batching_dims", ()) or ())
    for d, (loc, glob) in enumerate(zip(*ins[0])):
        if loc != glob:
            if sizes[d] == glob:
                sizes[d] = loc
            elif not (sizes[d] == 1 and d in batching):
                raise ValueError(f"operand dim {d} is split but not taken whole")
    p["slice_sizes"] = tuple(sizes)
    return p


def _drawn_local(p: dict[str, Any], ins: Sequence[Shapes],
                 outs: Sequence[Shapes]) -> dict[str, Any]:
    """``random_bits``' ``shape``: the local block of the drawn dims (the lowering draws a
    split block as its part of the global draw, :func:`autopar.graph.prng.draw_block`)."""
    p["shape"] = tuple(outs[0][0][len(ins[0][0]):])
    return p


# ---------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class OpKind:
    """One operator kind: its primitives and every rule autopar applies to it."""

    name: str
    primitives: tuple[str, ...]
    spec: Callable[[Node, Sequence[Shape], Sequence[Shape]], OpSpec]
    flops: FlopsRule = _no_flops
    local_params: LocalRule = _same
    no_grad: frozenset[str] = frozenset()  # primitives whose outputs carry no gradient
    fusion: str = ""                       # "loop", "input" or "" (see the module docstring)


_UNARY = """neg exp exp2 log log1p expm1 tanh logistic sqrt rsqrt cbrt integer_pow erf erfc
erf_inv abs sign floor ceil round sin cos tan asin acos atan sinh cosh asinh acosh atanh not
square convert_element_type stop_gradient copy copy_p is_finite reduce_precision real imag
population_count clz""".split()
_NARY = """add add_any sub mul div rem pow max min atan2 and or xor eq ne lt le gt ge select_n
clamp nextafter shift_left shift_right_logical shift_right_arithmetic threefry2x32""".split()
_NO_GRAD_ELEMENTWISE = frozenset("""stop_gradient eq ne lt le gt ge and or not xor is_finite
population_count clz floor ceil round sign threefry2x32""".split())
#: the random primitives on keys: make keys from seeds and key data, split, fold in, clone
_KEY_OPS = ("random_seed", "random_wrap", "random_unwrap", "random_split", "random_fold_in",
            "random_clone")

OPERATORS: dict[str, OpKind] = {k.name: k for k in (
    OpKind("elementwise", tuple(_UNARY + _NARY), _elementwise_spec, _output_flops,
           no_grad=_NO_GRAD_ELEMENTWISE, fusion="loop"),
    OpKind("matmul", ("dot_general",), _dot_spec, _dot_flops),
    OpKind("conv", ("conv_general_dilated",), _conv_spec, _conv_flops),
    OpKind("reduce", ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                      "reduce_or", "argmax", "argmin"), _reduce_spec, _input_flops,
           no_grad=frozenset({"argmax", "argmin"}), fusion="input"),
    OpKind("broadcast", ("broadcast_in_dim",), _broadcast_spec,
           local_params=_out_shape("shape"), fusion="loop"),
    OpKind("reshape", ("reshape", "squeeze", "expand_dims"), _reshape_spec,
           local_params=_reshape_local, fusion="loop"),
    OpKind("transpose", ("transpose",), _transpose_spec),
    OpKind("slice", ("slice", "dynamic_slice"), _slice_spec, local_params=_slice_local),
    OpKind("concatenate", ("concatenate",), _concatenate_spec),
    OpKind("stack", ("stack",), _stack_spec),
    OpKind("split", ("split",), _split_spec),
    OpKind("cumulative", ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"),
           _along_axis_spec, _output_flops),
    OpKind("top_k", ("top_k",), _along_axis_spec, _input_flops),
    OpKind("sort", ("sort",), _along_axis_spec, _sort_flops),
    OpKind("pad", ("pad",), _pad_spec),
    OpKind("gather", ("gather",), _gather_spec, local_params=_slice_sizes),
    OpKind("scatter", ("scatter",), _scatter_spec),
    OpKind("scatter_add", ("scatter-add",), _scatter_spec, _updates_flops),
    OpKind("iota", ("iota",), _iota_spec, local_params=_out_shape("shape"),
           no_grad=frozenset({"iota"}), fusion="loop"),
    OpKind("reduce_window", ("reduce_window_sum", "reduce_window_max", "reduce_window_min"),
           _window_spec, _window_flops),
    OpKind("select_and_scatter", ("select_and_scatter_add",), _select_scatter_spec,
           _source_window_flops),
    OpKind("identity", ("sharding_constraint", "optimization_barrier", "name"),
           _elementwise_spec),
    OpKind("bitcast", ("bitcast_convert_type",), _leading_spec,
           no_grad=frozenset({"bitcast_convert_type"}), fusion="loop"),
    OpKind("random_key", _KEY_OPS, _leading_spec, no_grad=frozenset(_KEY_OPS)),
    OpKind("random_bits", ("random_bits",), _random_bits_spec, _draw_flops,
           local_params=_drawn_local, no_grad=frozenset({"random_bits"}), fusion="loop"),
)}

#: primitive -> its operator kind (the primitives the tracer accepts)
KINDS: dict[str, str] = {p: k.name for k in OPERATORS.values() for p in k.primitives}
#: primitives whose outputs carry no gradient
NO_GRADIENT: frozenset[str] = frozenset().union(*(k.no_grad for k in OPERATORS.values()))
#: kinds XLA fuses into the operator that reads them, and the kinds that take those in
FUSED_PRODUCERS: frozenset[str] = frozenset(k.name for k in OPERATORS.values()
                                            if k.fusion == "loop")
FUSING_READERS: frozenset[str] = FUSED_PRODUCERS | {k.name for k in OPERATORS.values()
                                                    if k.fusion == "input"}

#: Call-like primitives whose body the tracer inlines, with the param holding the body.
INLINED: dict[str, str] = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
}

UNSUPPORTED_HINTS: dict[str, str] = {
    "while": "use a Python loop with a static trip count, or give the loop a trip count "
             "known at trace time (a condition i < n on a counter from a constant start by a "
             "constant step, n a constant: lax.fori_loop with Python-int bounds), or lax.scan",
    "rng_bit_generator": "draw with jax.random and a jax.random.key (its primitives are "
                         "supported), or outside the traced function and pass the numbers in",
    "random_gamma": "draw outside the traced function and pass the numbers in (jax.random's "
                    "uniform, normal, bernoulli... are supported)",
}


def supported_primitives() -> list[str]:
    return sorted(KINDS)
