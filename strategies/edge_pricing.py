"""The redistribution prices of an edge's layout pairs, all at once.

The dynamic_programming search prices every (producer layout, consumer layout) pair of
every edge: tens of thousands of distinct pairs at 64 devices, hundreds of thousands at 512.
Planning each pair's steps (:func:`plan_steps <autopar.strategies.redistribution.plan_steps>`)
and pricing them (:meth:`CostModel.coefficients
<autopar.strategies.cost.CostModel.coefficients>`) one by one in Python was 85-97 % of the
search. :class:`EdgePricer` runs the planner
(:class:`~autopar.strategies.redistribution.CodedPlan`) on every pair of an edge at once, as
numpy arrays, and adds each step's price as soon as the step is decided, without building it:

- a layout's dim is the planner's code (its axes as 4-bit digits, outer axis first in the
  low digits), a length and a bit mask of its axes; "dim ``d`` is on its way to the target"
  is a masked comparison of codes, "the axis it takes next" a shift;
- the planner's loop runs in lock step over the pairs: in each round every pair still off
  its target takes the one action the planner would (all_to_all, the early slices, a
  gather, the final slices), selected by masks; a pair that is done drops out;
- a step's price depends on its kind and the *set* of its axes only (the group's size and
  link), so each kind has a table over the axis masks of its forward and backward
  collectives' :meth:`alpha_beta <autopar.strategies.cost.CostModel.alpha_beta>` terms;
- a slice is held back until the next step: the planner merges consecutive slices of one
  dim into one step (whose backward gather covers all their axes), so the price of a slice
  is known only when a different step follows or the plan ends.

Every pair's latency and per-byte sums get the very same terms in the very same order as
:meth:`CostModel.coefficients` adds them (a term that does not apply adds ``0.0``, which
leaves a non-negative float unchanged), so the coefficients are bit for bit those of
``plan_steps`` + ``coefficients`` (tests/test_edge_pricing.py checks random pairs). Pairs the
planner refuses (an invalid layout, a partial sum the target would create, more than 15 mesh
axes) return None and are priced one by one, where ``plan_steps`` raises its error.

Small edges (recursive_programming's: a few to a few dozen pairs) are priced pair by pair
(:meth:`EdgePricer.pair`, :meth:`EdgePricer.small`): the planner itself,
:class:`~autopar.strategies.redistribution.CodedPlan`, on Python ints, its coded steps priced
as they are (no ``Step`` built): numpy's fixed cost per call is more than a whole plan of a
few pairs. It adds the same terms in the same order too (tests/test_edge_pricing.py).

The lock-step form cannot give way to the coded planner on large edges: most pairs of an edge
plan differently, and pricing the 130,000 pairs of the large edges of a 32-block tfm_stack at
64 devices one by one (:meth:`EdgePricer.pair`, every cache on) took 1.2 s against 0.32 s at
once -- the whole search takes about 1.1 s.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from autopar.strategies.cost import CostModel
from autopar.strategies.layout import DeviceMesh, TensorLayout
from autopar.strategies.redistribution import (BITS, DIGIT, MAX_AXES, STEP_KINDS, CodedPlan,
                                               Step, mesh_codes, plan_steps, transpose_step)

__all__ = ["EdgePricer"]

#: A matrix's coefficients: latency [S, D], seconds per byte [S, D] and the knee terms (flat
#: entry indices, fraction, knee, extra), in the order the steps add them.
Coefficients = tuple[np.ndarray, np.ndarray, list]


class _Tables:
    """Per step kind, over every mask of mesh axes: the :meth:`CostModel.alpha_beta` terms of
    the step's forward collective (``fwd``) and, in backward, of its transpose (``bwd``):
    arrays (seconds, seconds per byte, knee, extra), all 0 where the kind has no such
    collective or the group is one device (:meth:`CostModel._step_parts`' rule)."""

    def __init__(self, mesh: DeviceMesh, cm: CostModel, backward: bool) -> None:
        names = mesh.names
        count = 1 << len(names)
        groups = [cm.group(tuple(n for i, n in enumerate(names) if m >> i & 1), mesh)
                  for m in range(count)]
        self.knees = False
        self.kinds: dict[str, tuple[tuple[np.ndarray, ...] | None, ...]] = {}
        for kind in STEP_KINDS:
            sample = Step(kind, ("x",), 0, src_dim=1)
            back = transpose_step(sample) if backward else None
            parts = []
            for step in (sample, back):
                coll = STEP_KINDS[step.kind].collective if step is not None else None
                if coll is None:
                    parts.append(None)
                    continue
                rows = np.zeros((4, count))
                for m, (p, intra) in enumerate(groups):
                    if p > 1:
                        rows[:, m] = cm.alpha_beta(coll, p, intra)
                self.knees = self.knees or bool(rows[3].any())
                parts.append(tuple(rows))
            self.kinds[kind] = tuple(parts)


class _Grid:
    """The layouts of one edge as arrays: per dim the code, length and mask of every source
    and target, the partial masks, and per target the prefix masks of each dim
    (``prefix[d][t * (K + 1) + j]``: the axes of its first ``j`` digits) and where each axis
    is wanted (``where[t * K + axis]``: its dim, -1 for none; ``pos``: its place there)."""

    def __init__(self, pricer: "EdgePricer", srcs: Sequence[TensorLayout],
                 dsts: Sequence[TensorLayout]) -> None:
        k, rank = len(pricer.mesh.names), srcs[0].rank
        es = [pricer.encode(s) for s in srcs]
        ed = [pricer.encode(t) for t in dsts]
        self.rank, self.k = rank, k
        self.src = [np.array([e[0][d] for e in es], dtype=np.int64).reshape(len(es), 3).T
                    for d in range(rank)]
        self.dst = [np.array([e[0][d] for e in ed], dtype=np.int64).reshape(len(ed), 3).T
                    for d in range(rank)]
        self.src_partial = np.array([e[1] for e in es], dtype=np.int64)
        self.dst_partial = np.array([e[1] for e in ed], dtype=np.int64)
        self.prefix = [np.array([e[2][d] for e in ed], dtype=np.int64).ravel()
                       for d in range(rank)]
        self.where = np.array([e[3] for e in ed], dtype=np.int64).ravel()
        self.pos = np.array([e[4] for e in ed], dtype=np.int64).ravel()


class EdgePricer:
    """The coefficients of :meth:`CostModel.coefficients` of ``plan_steps(src, dst, ...)``
    for every pair of a list of sources and one of targets, computed together (see the
    module docstring); one per (mesh, cost model, enable_alltoall)."""

    #: Edges with fewer pairs are priced pair by pair (:meth:`small`): numpy's fixed cost
    #: per call is more than the coded planner costs on a few hundred pairs (64 devices,
    #: cold pairs: 16 pairs 2.5 ms at once against 0.7 ms one by one, 256 pairs 5.3 against
    #: 4.7).
    MIN_PAIRS = 256

    def __init__(self, mesh: DeviceMesh, cm: CostModel, enable_alltoall: bool) -> None:
        self.mesh, self.cm, self.enable_alltoall = mesh, cm, enable_alltoall
        self.codes = mesh_codes(mesh)  # the planner's codes (and the layouts', kept)
        k = len(mesh.names)
        self.ok = self.codes.ok
        if self.ok:  # the vectorised planner's tables: the same numbers as numpy arrays
            self.fraction = np.array(self.codes.frac)  # as the planner: 1.0 / n
            self.count = np.array([m.bit_count() for m in range(1 << k)], dtype=np.int64)
            self.low = np.array(self.codes.low, dtype=np.int64)
            self.digit_bit = np.array([0] + [1 << i for i in range(MAX_AXES)],
                                      dtype=np.int64)
        self._codes: dict[TensorLayout, tuple | None] = {}
        self._tables: dict[bool, _Tables] = {}
        self._grids: dict[tuple, Coefficients | None] = {}
        # the one-pair path (:meth:`pair`): each (kind, axes code)'s collective terms per
        # backward (made when met)
        self._parts: tuple[dict, dict] = ({}, {})
        self._ids: dict[TensorLayout, int] = {}  # layout -> its number (from 1)
        self._pairs: tuple[dict, dict] = ({}, {})  # per grad: (numbers) -> coefficients
        self._enc: list[tuple | None] = [None]  # per layout number: its planner's codes
        self._shapes: tuple[dict, dict] = ({}, {})  # per grad: pair's split dims -> coef

    def tables(self, backward: bool) -> _Tables:
        hit = self._tables.get(backward)
        if hit is None:
            hit = self._tables[backward] = _Tables(self.mesh, self.cm, backward)
        return hit

    def encode(self, lay: TensorLayout) -> tuple | None:
        """(per dim (code, length, mask), partial mask, per dim prefix masks, per axis its
        dim and place) of a layout, from the planner's codes (:meth:`MeshCodes.encode
        <autopar.strategies.redistribution.MeshCodes.encode>`); None if it is not one the
        planner takes (an axis used twice or not on the mesh) or, as the lock-step planner
        was never made to, one with an axis both on a dim and in its partial sum (priced
        pair by pair)."""
        hit = self._codes.get(lay, False)
        if hit is not False:
            return hit
        e, out = self.codes.encode(lay), None
        if e is not None and not e[3] & e[4]:
            k = len(self.mesh.names)
            prefix, where, pos = [], [-1] * k, [0] * k
            for d, code in enumerate(e[0]):
                pm, mask, j = [0] * (k + 1), 0, 0
                while code:
                    i = (code & DIGIT) - 1
                    mask |= 1 << i
                    where[i], pos[i] = d, j
                    j += 1
                    pm[j:] = [mask] * (k + 1 - j)
                    code >>= BITS
                prefix.append(pm)
            out = (list(zip(e[0], e[1], e[2])), e[3], prefix, where, pos)
        self._codes[lay] = out
        return out

    def coefficients(self, srcs: Sequence[TensorLayout], dsts: Sequence[TensorLayout],
                     grad: bool) -> Coefficients | None:
        """(latency [S, D], seconds per byte [S, D], knee terms) of every pair, or None: price
        them one by one (layouts the vectorised planner does not take; see the module
        docstring). Kept per (sources, targets, grad)."""
        key = (tuple(srcs), tuple(dsts), grad)
        if key in self._grids:
            return self._grids[key]
        out = None
        if self.ok and srcs and dsts:
            us, si = _unique(srcs)
            ud, di = _unique(dsts)
            if all(self.encode(x) is not None for x in (*us, *ud)) and \
                    len({x.rank for x in (*us, *ud)}) == 1:
                out = self._price(us, ud, grad)
                if out is not None and (len(us) < len(srcs) or len(ud) < len(dsts)):
                    out = _expand(out, si, di, len(ud))
        self._grids[key] = out
        return out

    def _price(self, srcs: list[TensorLayout], dsts: list[TensorLayout], grad: bool
               ) -> Coefficients | None:
        grid = _Grid(self, srcs, dsts)
        if np.any(grid.dst_partial[None, :] & ~grid.src_partial[:, None]):
            return None  # a target creates a partial sum: plan_steps raises
        run = _Run(self, grid, self.tables(grad), len(srcs), len(dsts))
        if not run.plan():
            return None  # did not converge: plan_steps raises
        return (run.lat.reshape(len(srcs), len(dsts)),
                run.per_byte.reshape(len(srcs), len(dsts)), run.knees)

    def small(self, srcs: Sequence[TensorLayout], dsts: Sequence[TensorLayout], grad: bool,
              nbytes: float) -> np.ndarray:
        """The [S, D] seconds of a small edge, entry by entry as :meth:`Problem.edge_cost
        <autopar.strategies.problem.Problem.edge_cost>` computes them (0 for equal layouts,
        else :meth:`CostModel.steps_seconds` of :meth:`coef`). The layouts are numbered once
        per edge and the pairs kept by number: hashing two layouts per entry was most of the
        cost of an entry already priced."""
        ids = self._ids
        si = [ids.get(x) or self._number(x) for x in srcs]
        di = [ids.get(x) or self._number(x) for x in dsts]
        cache, rows = self._pairs[grad], []
        for i, src in zip(si, srcs):
            row = []
            for j, dst in zip(di, dsts):
                if i == j:
                    row.append(0.0)
                    continue
                coef = cache.get((i, j))
                if coef is None:
                    coef = cache[i, j] = self._coef(i, j, src, dst, grad)
                a, b, terms = coef
                t = a + b * nbytes
                for frac, knee, extra in terms:
                    t += extra * max(0.0, frac * nbytes - knee)
                row.append(t)
            rows.append(row)
        return np.array(rows, dtype=np.float64).reshape(len(srcs), len(dsts))

    def coef(self, src: TensorLayout, dst: TensorLayout, grad: bool) -> tuple:
        """:meth:`CostModel.coefficients` of ``plan_steps(src, dst, ...)`` (kept)."""
        ids = self._ids
        i, j = ids.get(src) or self._number(src), ids.get(dst) or self._number(dst)
        coef = self._pairs[grad].get((i, j))
        if coef is None:
            coef = self._pairs[grad][i, j] = self._coef(i, j, src, dst, grad)
        return coef

    def _number(self, lay: TensorLayout) -> int:
        """A new layout's number (from 1), its planner's codes kept by number."""
        n = self._ids[lay] = len(self._ids) + 1
        self._enc.append(self.codes.encode(lay))
        return n

    def _coef(self, i: int, j: int, src: TensorLayout, dst: TensorLayout, grad: bool) -> tuple:
        """:meth:`pair` of layouts numbered ``i`` and ``j``; where the planner does not take
        the pair, ``plan_steps`` raises its error."""
        coef = self._pair(self._enc[i], self._enc[j], grad)
        if coef is None:
            coef = self.cm.coefficients(plan_steps(src, dst, self.mesh, self.enable_alltoall),
                                        self.mesh, backward=grad)
        return coef

    def pair(self, src: TensorLayout, dst: TensorLayout, grad: bool
             ) -> tuple[float, float, tuple[tuple[float, float, float], ...]] | None:
        """:meth:`CostModel.coefficients` of ``plan_steps(src, dst, ...)`` for one pair, bit
        for bit: the coded steps of :class:`~autopar.strategies.redistribution.CodedPlan`,
        priced (no Step built, no numpy), or None: a pair the planner refuses or the codes
        do not take (``plan_steps`` raises on it)."""
        encode = self.codes.encode
        return self._pair(encode(src), encode(dst), grad)

    def _pair(self, es: tuple | None, ed: tuple | None, grad: bool) -> tuple | None:
        """:meth:`pair` of two layouts' planner's codes, kept per the pair's dims that
        are split on either side (codes, in order) and partial masks: a dim replicated on
        both sides takes no step and holds no axis, so it changes nothing (the prices do
        not depend on which dim a step acts on), and pairs of tensors of other ranks often
        plan alike (a third to a half of the pairs of a search)."""
        if es is None or ed is None or len(es[0]) != len(ed[0]):
            return None
        key = (tuple([x for x in zip(es[0], ed[0]) if x[0] or x[1]]), es[3], ed[3])
        shapes = self._shapes[grad]
        coef = shapes.get(key, False)
        if coef is False:
            coef = shapes[key] = self._plan_pair(es, ed, grad)
        return coef

    def _plan_pair(self, es: tuple, ed: tuple, grad: bool) -> tuple | None:
        """:meth:`pair` of two layouts' planner's codes, planned and priced."""
        plan = CodedPlan(self.codes, es, ed)
        if not plan.plan(self.enable_alltoall):
            return None
        parts_of = self._parts[grad]
        a = b = 0.0
        terms = []
        for kind, code, frac, _, _ in plan.steps:  # CostModel.coefficients' sums, in order
            parts = parts_of.get((kind, code))
            if parts is None:
                parts = parts_of[kind, code] = self.cm._step_parts(
                    Step(kind, self.codes.axes(code), 0, src_dim=1), self.mesh, grad)
            for ka, kb, knee, extra in parts:
                a += ka
                b += kb * frac
                if extra:
                    terms.append((frac, knee, extra))
        return a, b, tuple(terms)

    @staticmethod
    def seconds(coef: Coefficients, nbytes: float) -> np.ndarray:
        """The [S, D] seconds of a tensor of ``nbytes`` global bytes (each entry as
        :meth:`CostModel.steps_seconds`: ``a + b * nbytes``, then the knee terms in order)."""
        lat, per_byte, knees = coef
        m = lat + per_byte * nbytes
        flat = m.reshape(-1)
        for idx, frac, knee, extra in knees:
            flat[idx] = flat[idx] + extra * np.maximum(0.0, frac * nbytes - knee)
        return m


def _unique(items: Sequence[TensorLayout]) -> tuple[list[TensorLayout], np.ndarray]:
    """The distinct layouts in first-seen order and each item's index among them."""
    seen: dict[TensorLayout, int] = {}
    inv = [seen.setdefault(x, len(seen)) for x in items]
    return list(seen), np.array(inv, dtype=np.int64)


def _expand(coef: Coefficients, si: np.ndarray, di: np.ndarray, nd: int) -> Coefficients:
    """Coefficients over distinct layouts -> over the lists with repeats (rows ``si``,
    columns ``di``)."""
    lat, per_byte, knees = coef
    rows, cols = np.ix_(si, di)
    flat = (rows * nd + cols).ravel()
    out = []
    for idx, frac, knee, extra in knees:  # entry -> its place among the distinct pairs
        where = np.full(lat.size, -1, dtype=np.int64)
        where[idx] = np.arange(len(idx))
        take = where[flat]
        sel = np.flatnonzero(take >= 0)
        out.append((sel, frac[take[sel]], knee[take[sel]], extra[take[sel]]))
    return lat[rows, cols], per_byte[rows, cols], out


class _Run:
    """The planner (:class:`~autopar.strategies.redistribution.CodedPlan`, whose methods the
    docstrings below name) over every pair of a grid at once (pair ``i`` = source
    ``i // D``, target ``i % D``); the state arrays hold the pairs still being planned
    (``idx``: their entries)."""

    def __init__(self, pricer: EdgePricer, grid: _Grid, tables: _Tables, ns: int,
                 nd: int) -> None:
        self.p, self.g, self.t = pricer, grid, tables
        n = ns * nd
        self.k, self.rank = grid.k, grid.rank
        si = np.repeat(np.arange(ns), nd)
        self.di = np.tile(np.arange(nd), ns)
        self.idx = np.arange(n)
        self.c = [grid.src[d][0][si] for d in range(self.rank)]
        self.len = [grid.src[d][1][si] for d in range(self.rank)]
        self.m = [grid.src[d][2][si] for d in range(self.rank)]
        self.w = [grid.dst[d][0][self.di] for d in range(self.rank)]
        self.wlen = [grid.dst[d][1][self.di] for d in range(self.rank)]
        self.wm = [grid.dst[d][2][self.di] for d in range(self.rank)]
        self.ok = [self.is_prefix(d) for d in range(self.rank)]
        self.used = _or(self.m, n)
        self.wanted = _or(self.wm, n)
        self.early = np.zeros(n, dtype=bool)
        self.pend_dim = np.full(n, -1, dtype=np.int64)  # the held-back slice: its dim,
        self.pend_mask = np.zeros(n, dtype=np.int64)    # axes
        self.pend_frac = np.zeros(n)                    # and fraction
        self.a, self.b = np.zeros(n), np.zeros(n)
        self.lat, self.per_byte = np.zeros(n), np.zeros(n)
        self.knees: list = []
        self.partial = (grid.src_partial[si], grid.dst_partial[self.di])

    # ------------------------------------------------------------------ state
    def is_prefix(self, d: int) -> np.ndarray:
        """Whether cur[d] is a prefix of want[d] (the planner's per-dim ``ok``)."""
        ln = self.len[d]
        return (ln <= self.wlen[d]) & ((self.w[d] & self.p.low[ln]) == self.c[d])

    def next_digit(self, d: int, j: int | np.ndarray = 0) -> np.ndarray:
        """The digit of want[d] at place len(cur[d]) + j (0 past its end)."""
        shift = np.minimum(BITS * (self.len[d] + j), 60)
        return (self.w[d] >> shift) & DIGIT

    def last_digit(self, d: int) -> np.ndarray:
        """The digit of cur[d]'s innermost axis (garbage where it has none)."""
        return (self.c[d] >> (BITS * np.maximum(self.len[d] - 1, 0))) & DIGIT

    def wanted_prefix(self, d: int, sel: np.ndarray, allowed: np.ndarray) -> np.ndarray:
        """Per pair of ``sel``, the mask of the longest run of want[d]'s next axes that are
        all in ``allowed`` (0 elsewhere)."""
        take = np.zeros(len(sel), dtype=np.int64)
        go = sel.copy()
        for j in range(self.k):
            if not go.any():
                break
            bit = self.p.digit_bit[self.next_digit(d, j)]
            go &= (allowed & bit) != 0
            take |= np.where(go, bit, 0)
        return take

    def add(self, d: int, sel: np.ndarray, mask: np.ndarray) -> None:
        """Split dim ``d`` of the pairs of ``sel`` further over want[d]'s next axes
        ``mask`` (the dim stays on its way to the target)."""
        ln = self.len[d] + self.p.count[np.where(sel, mask, 0)]
        self.c[d] = np.where(sel, self.w[d] & self.p.low[ln], self.c[d])
        self.len[d] = ln
        self.m[d] = self.m[d] | np.where(sel, mask, 0)
        self.used = self.used | np.where(sel, mask, 0)

    def pop(self, d: int, sel: np.ndarray) -> np.ndarray:
        """Take cur[d]'s innermost axis off for the pairs of ``sel``; its bit."""
        bit = np.where(sel, self.p.digit_bit[self.last_digit(d)], 0)
        ln = self.len[d] - sel
        self.c[d] = np.where(sel, self.c[d] & self.p.low[ln], self.c[d])
        self.len[d] = ln
        self.m[d] = self.m[d] & ~bit
        self.used = self.used & ~bit
        self.ok[d] = np.where(sel, self.is_prefix(d), self.ok[d])
        return bit

    # ------------------------------------------------------------------ prices
    def emit(self, kind: str, sel: np.ndarray, mask: np.ndarray, frac: np.ndarray) -> None:
        """A step of ``kind`` over the axes ``mask`` moving ``frac`` of the tensor, for the
        pairs of ``sel``: the held-back slice first, then the step's terms."""
        self.flush(sel)
        self.price(kind, np.where(sel, mask, 0), frac)

    def price(self, kind: str, mask: np.ndarray, frac: np.ndarray) -> None:
        """Add each pair's terms of a step over ``mask`` (0: none) in :meth:`CostModel.
        coefficients`' order: a += seconds, b += per byte x fraction, per collective."""
        for part in self.t.kinds[kind]:
            if part is None:
                continue
            ka, kb, knee, extra = part
            self.a = self.a + ka[mask]
            self.b = self.b + kb[mask] * frac
            if self.t.knees:
                ex = extra[mask]
                sel = np.flatnonzero(ex)
                if len(sel):
                    self.knees.append((self.idx[sel], frac[sel], knee[mask][sel], ex[sel]))

    def slice(self, d: int, sel: np.ndarray, mask: np.ndarray) -> None:
        """Split dim ``d`` locally over ``mask``: merged into the held-back slice when it is
        of the same dim (which keeps its own fraction), else held back itself."""
        merge = sel & (self.pend_dim == d)
        new = sel & ~merge
        self.flush(new)
        self.pend_mask = np.where(sel, self.pend_mask | mask, self.pend_mask)
        self.pend_frac = np.where(new, self.p.fraction[self.used], self.pend_frac)
        self.pend_dim = np.where(new, d, self.pend_dim)
        self.add(d, sel, mask)

    def flush(self, sel: np.ndarray) -> None:
        """Price the held-back slices of the pairs of ``sel``."""
        hold = sel & (self.pend_dim >= 0)
        if hold.any():
            self.price("slice", np.where(hold, self.pend_mask, 0), self.pend_frac)
            self.pend_dim = np.where(hold, -1, self.pend_dim)
            self.pend_mask = np.where(hold, 0, self.pend_mask)

    # ------------------------------------------------------------------ the planner
    def plan(self) -> bool:
        """Every pair's steps, priced; False if some pair did not converge."""
        if self.partial[0].any():
            self.resolve_partials()
        for _ in range(4 * self.k + 4):
            done = np.ones(len(self.idx), dtype=bool)
            for d in range(self.rank):
                done &= self.c[d] == self.w[d]
            if done.all():
                self.finish(done)
                return True
            if np.count_nonzero(done) * 8 >= len(done):
                self.finish(done)
            self.move()
        return False

    def finish(self, done: np.ndarray) -> None:
        """Pairs at their targets: flush their slices, store their sums, drop them. (Pairs
        at their targets may also stay a few rounds: no action of the planner applies to
        them, so they take no step.)"""
        self.flush(done)
        at = self.idx[done]
        self.lat[at], self.per_byte[at] = self.a[done], self.b[done]
        keep = ~done
        for name in ("c", "len", "m", "w", "wlen", "wm", "ok"):
            setattr(self, name, [x[keep] for x in getattr(self, name)])
        for name in ("idx", "di", "used", "wanted", "early", "pend_dim", "pend_mask",
                     "pend_frac", "a", "b"):
            setattr(self, name, getattr(self, name)[keep])

    def resolve_partials(self) -> None:
        """The planner's ``resolve_partials``: a reduce_scatter into each dim on its way to
        the target whose next axes are pending partial axes, an all_reduce of the rest."""
        src_p, dst_p = self.partial
        pending = src_p & ~dst_p
        allowed = pending & ~self.used
        takes = [self.wanted_prefix(d, self.ok[d] & (pending != 0), allowed)
                 for d in range(self.rank)]
        reduce = pending & ~_or(takes, len(pending))
        self.emit("all_reduce", reduce != 0, reduce, self.p.fraction[self.used])
        for d in range(self.rank):
            sel = takes[d] != 0
            if sel.any():
                before = self.p.fraction[self.used]
                self.add(d, sel, takes[d])
                self.emit("reduce_scatter", sel, takes[d], before)

    def move(self) -> None:
        """One round of the planner's loop (``plan``) for every pair (none is done)."""
        n = len(self.idx)
        rest = ~self.all_to_all() if self.p.enable_alltoall else np.ones(n, dtype=bool)
        off = np.zeros(n, dtype=bool)  # some dim is off its way to the target
        for d in range(self.rank):
            off |= ~self.ok[d]
        off &= rest
        final = rest & ~off            # every dim on its way: the final slices
        first = off & ~self.early      # the early slices, once
        bad = off
        if first.any():
            self.early = self.early | first
            bad = off & ~self.early_slices(first)
        if bad.any():
            self.gather(bad)
        for d in range(self.rank):
            rem = np.where(final, self.wm[d] & ~self.m[d], 0)
            sel = rem != 0
            if sel.any():
                self.slice(d, sel, rem)

    def all_to_all(self) -> np.ndarray:
        """The planner's ``all_to_all``: the first dim off its target whose innermost axis
        another dim on its way takes next moves it there. Returns the pairs that moved."""
        found = np.zeros(len(self.idx), dtype=bool)
        for d1 in range(self.rank):
            cand = ~found & (self.len[d1] > 0) & ~self.ok[d1]
            if not cand.any():
                continue
            axis = np.maximum(self.last_digit(d1) - 1, 0)
            at = self.di * self.k + axis
            d2s, pos = self.g.where[at], self.g.pos[at]
            for d2 in range(self.rank):
                if d2 == d1:
                    continue
                sel = cand & (d2s == d2) & (pos == self.len[d2]) & self.ok[d2]
                if not sel.any():
                    continue
                before = self.p.fraction[self.used]
                bit = self.pop(d1, sel)
                self.add(d2, sel, bit)
                self.emit("all_to_all", sel, bit, before)
                found |= sel
        return found

    def early_slices(self, first: np.ndarray) -> np.ndarray:
        """The planner's ``early_slices`` for the pairs of ``first``: slice each dim on its
        way to the target over its next axes no dim uses. Returns the pairs that sliced."""
        moved = np.zeros(len(self.idx), dtype=bool)
        for d in range(self.rank):
            sel = first & self.ok[d]
            if not sel.any():
                continue
            add = self.wanted_prefix(d, sel, ~self.used)
            go = add != 0
            if go.any():
                self.slice(d, go, add)
                moved |= go
        return moved

    def gather(self, bad: np.ndarray) -> None:
        """The planner's ``gather`` of the first dim off its target, for the pairs of
        ``bad``: one all_gather of the axes past the agreement when the target wants none of
        them, else an all_gather of the innermost axis, sliced at once into the dim that
        takes it next (unless every dim is then on its way)."""
        todo = bad.copy()
        for d in range(self.rank):
            sel = todo & ~self.ok[d]
            if not sel.any():
                continue
            todo &= ~sel
            diff = np.where(sel, self.c[d] ^ self.w[d], 1)
            agree = np.log2((diff & -diff).astype(np.float64)).astype(np.int64) // BITS
            gone = self.m[d] & ~self.g.prefix[d][self.di * (self.k + 1) + agree]
            whole = sel & ((gone & self.wanted) == 0)
            if whole.any():
                self.c[d] = np.where(whole, self.c[d] & self.p.low[agree], self.c[d])
                self.len[d] = np.where(whole, agree, self.len[d])
                self.m[d] = np.where(whole, self.m[d] & ~gone, self.m[d])
                self.used = np.where(whole, self.used & ~gone, self.used)
                self.ok[d] = self.ok[d] | whole
                self.emit("all_gather", whole, gone, self.p.fraction[self.used])
            one = sel & ~whole
            if one.any():
                self.gather_one(d, one)

    def gather_one(self, d: int, one: np.ndarray) -> None:
        """All_gather dim ``d``'s innermost axis, then slice it into the dim (on its way)
        that takes it next, unless every dim is now on its way to the target."""
        bit = self.pop(d, one)
        self.emit("all_gather", one, bit, self.p.fraction[self.used])
        off = np.zeros(len(one), dtype=bool)
        for d2 in range(self.rank):
            off |= ~self.ok[d2]
        go = one & off
        if not go.any():
            return
        axis = np.log2(np.where(go, bit, 1).astype(np.float64)).astype(np.int64)
        at = self.di * self.k + axis
        d2s, pos = self.g.where[at], self.g.pos[at]
        for d2 in range(self.rank):
            if d2 == d:
                continue
            sel = go & (d2s == d2) & (pos == self.len[d2]) & self.ok[d2]
            if sel.any():
                self.slice(d2, sel, bit)


def _or(masks: Sequence[np.ndarray], n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.int64)
    for m in masks:
        out = out | m
    return out

