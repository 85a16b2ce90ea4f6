"""The strategy space of each operator kind: its iteration space and how tensors map onto it.

Every operator is described as a loop nest (like an einsum): ``sizes`` are the iteration
dims, ordered output dims first (in output order) then reduced dims; each input and output
maps each of its dims to an iteration dim, or to None when that dim cannot be split (a
broadcast size-1 dim, a convolution's spatial dim, a concatenated axis, a gathered table
dim...). A strategy splits iteration dims; MindSpore's per-input tuples are read off the
input maps, so matched splits on contracted and broadcast dims hold by construction.
Splitting a ``summed`` dim (matmul K, conv in-features, reduce_sum axes) leaves the outputs
partial sums; other reduced dims (max, argmax) cannot be split.

>>> import jax.numpy as jnp, autopar
>>> g = autopar.trace(lambda w, x: x @ w, jnp.ones((8, 4)), jnp.ones((2, 8)))
>>> spec = op_spec(g.nodes[0], g)
>>> spec.sizes, spec.in_maps, spec.out_maps, spec.summed
((2, 4, 8), ((0, 2), (2, 1)), ((0, 1),), (2,))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from autopar.graph.ir import Graph, Node

__all__ = ["OpSpec", "op_spec"]

Map = tuple[int | None, ...]


@dataclass(frozen=True, slots=True)
class OpSpec:
    sizes: tuple[int, ...]
    in_maps: tuple[Map, ...]
    out_maps: tuple[Map, ...]
    summed: tuple[int, ...] = ()       # reduced dims whose split leaves a partial sum
    fixed: tuple[int, ...] = ()        # iteration dims that must not be split
    divides: tuple[tuple[int, int], ...] = ()  # (iter dim, n): its split must also divide n
    reasons: tuple[tuple[int, int, str], ...] = ()  # (input, dim, why it cannot be split)

    def splittable(self, d: int) -> bool:
        return d not in self.fixed

    def why_whole(self, i: int, d: int) -> str:
        """Why dim ``d`` of input ``i`` cannot be split (for error messages)."""
        for j, e, why in self.reasons:
            if (j, e) == (i, d):
                return why
        return "it is broadcast, windowed, gathered or concatenated"


def _elementwise(in_shapes: Sequence[tuple[int, ...]], out_shape: tuple[int, ...],
                 n_out: int = 1) -> OpSpec:
    rank = len(out_shape)
    maps = []
    for s in in_shapes:
        if len(s) == 0:
            maps.append(())
        else:
            off = rank - len(s)
            maps.append(tuple(off + i if n == out_shape[off + i] else None
                              for i, n in enumerate(s)))
    ident = tuple(range(rank))
    return OpSpec(out_shape, tuple(maps), tuple(ident for _ in range(n_out)))


def _reduce(in_shape: tuple[int, ...], axes: Sequence[int], summed: bool,
            n_in: int = 1) -> OpSpec:
    keep = [d for d in range(len(in_shape)) if d not in axes]
    order = keep + sorted(axes)
    pos = {d: i for i, d in enumerate(order)}
    sizes = tuple(in_shape[d] for d in order)
    red = tuple(pos[d] for d in sorted(axes))
    in_map = tuple(pos[d] for d in range(len(in_shape)))
    out_map = tuple(pos[d] for d in keep)
    return OpSpec(sizes, tuple(in_map for _ in range(n_in)), (out_map,),
                  summed=red if summed else (), fixed=() if summed else red)


def _dot(node: Node, shapes: list[tuple[int, ...]]) -> OpSpec:
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
    out = tuple(range(nb + nl + nr))
    summed = tuple(range(nb + nl + nr, len(sizes)))
    return OpSpec(tuple(sizes), (tuple(lmap), tuple(rmap)), (out,), summed=summed)


def _conv(node: Node, shapes: list[tuple[int, ...]], out: tuple[int, ...]) -> OpSpec:
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
    return OpSpec(tuple(sizes), (tuple(lmap), tuple(rmap)), (tuple(range(rank)),),
                  summed=(c_it,) if groups == 1 else (), fixed=tuple(sorted(set(fixed))))


def _gather(node: Node, shapes: list[tuple[int, ...]], out: tuple[int, ...]) -> OpSpec:
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
    return OpSpec(out, (tuple(omap), tuple(imap)), (tuple(range(len(out))),), fixed=fixed)


def _reshape(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> OpSpec:
    """Only the leading dim of each merged/split group can be split (contiguous blocks)."""
    imap: list[int | None] = [None] * len(in_shape)
    i = o = 0
    divides = []
    reasons = []
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
        for inner in range(gi + 1, i):
            if in_shape[inner] != 1:
                reasons.append((0, inner, (
                    f"the reshape {in_shape} -> {out_shape} merges it into output dim {go} "
                    f"as an inner factor, so a split of it would leave each device a strided, "
                    f"non-contiguous piece of dim {go}, which no layout describes; split dim "
                    f"{gi} (the leading dim of the merged group) instead")))
    sizes = tuple(out_shape)
    fixed = tuple(d for d in range(len(out_shape)) if d not in imap)
    return OpSpec(sizes, (tuple(imap),), (tuple(range(len(out_shape))),), fixed=fixed,
                  divides=tuple(divides), reasons=tuple(reasons))


def op_spec(node: Node, graph: Graph) -> OpSpec:
    """The iteration space of a node (see the module docstring)."""
    shapes = [graph.spec(v).shape for v in node.inputs]
    outs = [graph.spec(v).shape for v in node.outputs]
    out = outs[0]
    p: dict[str, Any] = dict(node.params)
    k, op = node.kind, node.op
    if k == "elementwise" or k == "identity":
        return _elementwise(shapes, out, len(outs))
    if k == "matmul":
        return _dot(node, shapes)
    if k == "conv":
        return _conv(node, shapes, out)
    if k == "reduce":
        return _reduce(shapes[0], tuple(p["axes"]), op == "reduce_sum", len(shapes))
    if k == "broadcast":
        bd = p["broadcast_dimensions"]
        m = tuple(o if shapes[0][i] == out[o] else None for i, o in enumerate(bd))
        return OpSpec(out, (m,) + tuple(() for _ in shapes[1:]), (tuple(range(len(out))),))
    if k == "transpose":
        perm = p["permutation"]  # out dim i = in dim perm[i]
        m = [0] * len(perm)
        for i, src in enumerate(perm):
            m[src] = i
        return OpSpec(out, (tuple(m),), (tuple(range(len(out))),))
    if k == "reshape":
        if op == "squeeze" or op == "expand_dims" or p.get("dimensions") is None:
            return _reshape(shapes[0], out)
        return _reshape(shapes[0], out)
    if k == "slice":
        full = [d for d in range(len(out)) if out[d] == shapes[0][d]
                and (op != "slice" or (p["start_indices"][d] == 0
                                       and (p.get("strides") is None or p["strides"][d] == 1)))]
        m = tuple(d if d in full else None for d in range(len(out)))
        fixed = tuple(d for d in range(len(out)) if d not in full)
        return OpSpec(out, (m,) + tuple(() for _ in shapes[1:]), (tuple(range(len(out))),),
                      fixed=fixed)
    if k == "concatenate":
        ax = p["dimension"]
        m = tuple(None if d == ax else d for d in range(len(out)))
        return OpSpec(out, tuple(m for _ in shapes), (tuple(range(len(out))),), fixed=(ax,))
    if k == "split":
        ax = p["axis"]
        sizes = shapes[0]
        m = tuple(None if d == ax else d for d in range(len(sizes)))
        return OpSpec(sizes, (tuple(range(len(sizes))),), tuple(m for _ in outs), fixed=(ax,))
    if k == "pad":
        cfg = p["padding_config"]
        fixed = tuple(d for d, (lo, hi, interior) in enumerate(cfg) if lo or hi or interior)
        m = tuple(None if d in fixed else d for d in range(len(out)))
        return OpSpec(out, (m, ()), (tuple(range(len(out))),), fixed=fixed)
    if k == "gather":
        return _gather(node, shapes, out)
    if k == "iota":
        return OpSpec(out, (), (tuple(range(len(out))),))
    if k == "reduce_window":
        wd, ws = p["window_dimensions"], p["window_strides"]
        pad = p["padding"]
        ok = [d for d in range(len(out)) if wd[d] == 1 and ws[d] == 1 and tuple(pad[d]) == (0, 0)]
        m = tuple(d if d in ok else None for d in range(len(out)))
        fixed = tuple(d for d in range(len(out)) if d not in ok)
        return OpSpec(out, (m,), (tuple(range(len(out))),), fixed=fixed)
    # Unknown kind: nothing can be split (always correct, maybe slow).
    return OpSpec(out, tuple(tuple(None for _ in s) for s in shapes),
                  tuple(tuple(None for _ in o) for o in outs), fixed=tuple(range(len(out))))
