"""recursive_programming's cut problems, solved by dynamic_programming's elimination replayed.

Every round of :mod:`recursive_programming` solves one cut problem (a cost vector per
vertex, a matrix per link) of one structure, so :class:`CutSolver` compiles the elimination
:class:`~autopar.strategies.dynamic_programming.Order` of that structure once: the vertex
pairs get slots and each step its operands' slots, whether each is read transposed and
whether the edge it adds to exists yet -- all of which depend on the structure only -- and a
round replays the steps with no dictionary of pairs and no tests.

The arithmetic is :class:`~autopar.strategies.dynamic_programming.Memo`'s: a leaf folds
``min over x of a^T + cost[x]`` into its neighbour, a node of two neighbours becomes the
edge ``min over x of a^T[s, x] + (cost[x] + b[x, u])``, parallel edges add, each minimum
with its first argmin. It is memoised on the identity of the operands as stored (the
transposition a flag of the key: no transposed view is made unless the step is computed),
the operands kept alive with the result for as long as the solver lives (every round of a
search): the blocks of a deep network share their vectors and matrices, so most steps are
looked up, not computed. ``cost[x] + b`` is kept too (pristine matrices recur) and the
minimum is numpy's ``minimum.reduce`` itself (what ``ndarray.min`` calls through a Python
wrapper). The same operations on the same values as ``eliminate``, so the same picks
(tests/test_rp_cut.py checks it on random cut problems). (Tiny steps on Python lists
instead of numpy were tried: no faster once the conversions are counted.)
"""

from __future__ import annotations

import numpy as np

from autopar.strategies.dynamic_programming import Memo, Order, eliminate

__all__ = ["CutSolver"]

_SMALL_SUMS = 16_384   # node eliminations past this many sums: dynamic_programming's own
_MIN = np.minimum.reduce  # what ndarray.min computes, without its Python wrapper


class CutSolver:
    """The elimination of one :class:`Order`, replayed (see the module docstring)."""

    def __init__(self, order: Order) -> None:
        self.order = order
        slot: dict[tuple[int, int], int] = {}
        self.singles = [(slot.setdefault(key, len(slot)), k) for key, k in order.singles]
        self.multi = [(slot.setdefault(key, len(slot)), members)
                      for key, members in order.multi]
        steps = []
        for x, y, z in order.steps:
            sa = slot[min(x, y), max(x, y)]
            if z < 0:
                steps.append((x, y, -1, sa, x > y, -1, False, -1, False))
                continue
            sb = slot[min(x, z), max(x, z)]
            old = (y, z) in slot
            syz = slot.setdefault((y, z), len(slot))
            steps.append((x, y, z, sa, x > y, sb, x > z, syz, old))
        self.steps = steps
        self.back = [(x, y, z) for x, y, z in reversed(order.steps)]
        self.n_slots = len(slot)
        self.survivors = [i for i in range(order.n) if i not in order.eliminated]
        self.arith = Memo(on=False)
        self.leaves: dict[tuple, tuple] = {}    # (p, flip, cost) -> (best, arg, operands)
        self.middles: dict[tuple, tuple] = {}   # (p, flip, cost, q, flip) -> (best, arg, ...)
        self.sums: dict[tuple, tuple] = {}      # (a, b) -> (a + b, a, b)
        self.trans: dict[int, tuple] = {}       # id(m) -> (m.T, m)
        self.bcs: dict[tuple, tuple] = {}       # (cost, q, flip) -> (cost[:, None] + b, ...)

    def solve(self, costs: list[np.ndarray], mats: list[np.ndarray],
              memo: Memo | None = None) -> list[int]:
        """One choice per vertex, exactly ``eliminate(order, costs, mats)`` (a core that
        does not reduce is left to ``eliminate`` itself, with ``memo``)."""
        if not self.order.reduces:
            return eliminate(self.order, costs, mats, memo)
        leaves, middles, add = self.leaves, self.middles, self._add
        pair = self._pairs(mats)
        cost = list(costs)
        args = []
        for x, y, z, sa, fa, sb, fb, syz, old in self.steps:
            p, cx = pair[sa], cost[x]
            if z < 0:  # leaf: cost[y] += min over x of (a^T + cost[x]), a = [S_x, S_y]
                key = (id(p), fa, id(cx))
                hit = leaves.get(key)
                if hit is None:
                    hit = leaves[key] = (*self._leaf(p, fa, cx), p, cx)
                cost[y] = add(cost[y], hit[0])
            else:      # middle: edge y-z += min over x of (a^T + cost[x] + b)
                q = pair[sb]
                key = (id(p), fa, id(cx), id(q), fb)
                hit = middles.get(key)
                if hit is None:
                    hit = middles[key] = (*self._middle(p, fa, cx, q, fb), p, cx, q)
                pair[syz] = add(pair[syz], hit[0]) if old else hit[0]
            args.append(hit[1])
        return self._replay(cost, args)

    def _replay(self, cost: list[np.ndarray], args: list[np.ndarray]) -> list[int]:
        """The survivors at their cheapest, then each eliminated vertex at its argmin given
        its neighbours' picks, backwards."""
        picks = [-1] * self.order.n
        for i in self.survivors:
            picks[i] = int(np.argmin(cost[i]))
        for (x, y, z), arg in zip(self.back, reversed(args)):
            picks[x] = arg.item(picks[y]) if z < 0 else arg.item(picks[y], picks[z])
        return picks

    def _pairs(self, mats: list[np.ndarray]) -> list:
        """Slot -> [S_lo, S_hi] of its links (parallel links summed in link order)."""
        pair: list = [None] * self.n_slots
        for sl, k in self.singles:
            pair[sl] = mats[k]
        for sl, members in self.multi:
            acc = None
            for k, flip in members:
                m = self._t(mats[k]) if flip else mats[k]
                acc = m if acc is None else self._add(acc, m)
            pair[sl] = acc
        return pair

    def _t(self, m: np.ndarray) -> np.ndarray:
        """The transpose of ``m``, one object per array (so what is computed from it is
        memoised across rounds)."""
        hit = self.trans.get(id(m))
        if hit is None:
            hit = self.trans[id(m)] = (m.T, m)
        return hit[0]

    def _add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        key = (id(a), id(b))
        hit = self.sums.get(key)
        if hit is None:
            hit = self.sums[key] = (self.arith.add(a, b), a, b)
        return hit[0]

    def _leaf(self, p: np.ndarray, fa: bool, cx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """min / argmin over x of a^T + cx, a = [S_x, S_y] stored as ``p`` (``fa``: as p^T)."""
        s = (p if fa else p.T) + cx[None, :]
        return _MIN(s, axis=1), s.argmin(axis=1)

    def _middle(self, p: np.ndarray, fa: bool, cx: np.ndarray, q: np.ndarray,
                fb: bool) -> tuple[np.ndarray, np.ndarray]:
        """min / argmin over x of a^T[s, x] + (cx[x] + b[x, u]), a = [S_x, S_y] stored as
        ``p`` and b = [S_x, S_z] as ``q`` (each transposed when flagged)."""
        a = p if fa else p.T
        if a.shape[0] * q.size > _SMALL_SUMS:  # large: dynamic_programming's own layout
            return self.arith.middle(a.T, cx, q.T if fb else q)
        key = (id(cx), id(q), fb)
        bc = self.bcs.get(key)
        if bc is None:
            bc = self.bcs[key] = ((cx[:, None] + (q.T if fb else q))[None, :, :], cx, q)
        t = a[:, :, None] + bc[0]
        return _MIN(t, axis=1), t.argmin(axis=1)
