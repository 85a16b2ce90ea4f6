"""dynamic_programming: OptCNN-style graph elimination, exact on the graphs it reduces.

The problem graph (vertices with cost vectors, edges with cost matrices) is reduced by
- edge elimination: parallel edges between two vertices are summed into one;
- leaf elimination: a vertex with one neighbour folds into it,
  ``cost[y][s] += min_t (E[s, t] + cost[x][t])``;
- node elimination: a vertex with two neighbours y, z becomes an edge,
  ``E'[s, u] = min_t (E_yx[s, t] + cost[x][t] + E_xz[t, u])``.
Series-parallel graphs (chains, residual blocks, attention, layer norm) reduce to one vertex
per connected component, whose best choice is then replayed backwards through the recorded
eliminations. What does not reduce (a core where every vertex has three or more neighbours)
is solved exactly by the integer program of :mod:`autopar.strategies.exact` on the reduced
graph, so the result is optimal for the pairwise objective (every edge's entry: a move
several readers share counted once per reader) in every case; the search then polishes it
under the plan's price (:mod:`~autopar.strategies.shared_moves`). :func:`solve_shared` runs
the same elimination with each value's moves shared by its readers, a second plan the search
polishes, keeping the cheaper.

The order of the eliminations depends on the graph's structure only (degrees and indices):
:class:`Order` finds it, :class:`Elimination` compiles it (slots for the vertex pairs, each
step's operands) and replays it on cost vectors and matrices, its arithmetic memoised on the
identity of the operands (:class:`Memo`: the blocks of a deep network share their arrays).
The one elimination of the project: :mod:`recursive_programming`, whose rounds all have one
structure, compiles the order once and replays it every round.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Sequence

import numpy as np

from autopar.strategies.problem import Problem

__all__ = ["solve", "solve_shared", "Order", "Memo", "Elimination", "eliminate",
           "core_columns", "CORE_COLUMNS"]

_CHUNK = 2_000_000  # floats per temporary in node elimination
_SMALL = 16_384     # node eliminations of at most this many sums: one temporary, as laid out
_MIN = np.minimum.reduce  # what ndarray.min computes, without its Python wrapper


def _eliminate_middle(a: np.ndarray, cx: np.ndarray, b: np.ndarray) -> tuple[np.ndarray,
                                                                              np.ndarray]:
    """min / argmin over t of a[s, t] + cx[t] + b[t, u] past :data:`_SMALL` sums; chunked
    over s to bound memory.

    The sums are laid out [s, u, t], t contiguous: numpy's argmin along the contiguous last
    axis is several times faster than along the middle one (which copies), and the minimum
    is read at the argmin. The sums are the same floats (``a[s, t] + (cx[t] + b[t, u])``)
    and argmin gives the first minimal t either way, so the results are those of the small
    layout (:meth:`Memo.middle`)."""
    sy, sx = a.shape
    sz = b.shape[1]
    a = np.ascontiguousarray(a)
    bc = np.ascontiguousarray((cx[:, None] + b).T)  # [S_u, S_t]
    best = np.empty((sy, sz))
    arg = np.empty((sy, sz), dtype=np.int64)
    step = max(1, _CHUNK // max(1, sx * sz))
    for lo in range(0, sy, step):
        t = a[lo:lo + step, None, :] + bc[None, :, :]
        k = t.argmin(axis=2)
        arg[lo:lo + step] = k
        best[lo:lo + step] = np.take_along_axis(t, k[:, :, None], axis=2)[:, :, 0]
    return best, arg


def _reduce(adj: list[set[int]]) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Eliminate leaves and degree-2 vertices of ``adj`` (in place: the core remains), lowest
    degree then lowest index first. Returns the steps -- (x, y, -1) folds leaf x into y,
    (x, y, z) with y < z turns x into an edge y-z -- and the edges those steps created, in
    creation order."""
    alive = [True] * len(adj)
    heap = [(len(a), i) for i, a in enumerate(adj)]
    heapq.heapify(heap)
    steps: list[tuple[int, int, int]] = []
    created: list[tuple[int, int]] = []
    while heap:
        deg, x = heapq.heappop(heap)
        if not alive[x] or deg != len(adj[x]) or deg > 2 or deg == 0:
            continue  # stale, not (yet) reducible, or a component's last vertex
        alive[x] = False
        ends = sorted(adj[x])
        adj[x].clear()
        for y in ends:
            adj[y].discard(x)
        if deg == 1:
            steps.append((x, ends[0], -1))
        else:
            y, z = ends
            steps.append((x, y, z))
            if z not in adj[y]:
                created.append((y, z))
            adj[y].add(z)
            adj[z].add(y)
        for y in ends:
            heapq.heappush(heap, (len(adj[y]), y))
    return steps, created


class Order:
    """The elimination order of a graph of ``n`` vertices and ``links`` (u, v): parallel
    links are merged (summed in link order), self-links ignored. It depends on the structure
    only, so every problem of one structure shares it."""

    def __init__(self, n: int, links: Sequence[tuple[int, int]]) -> None:
        self.n, self.links = n, list(links)
        groups: dict[tuple[int, int], list[tuple[int, bool]]] = {}
        for k, (u, v) in enumerate(self.links):
            if u != v:
                groups.setdefault((min(u, v), max(u, v)), []).append((k, u > v))
        self.groups = list(groups.items())
        self.singles = [(key, ms[0][0]) for key, ms in self.groups
                        if len(ms) == 1 and not ms[0][1]]
        self.multi = [(key, ms) for key, ms in self.groups if len(ms) > 1 or ms[0][1]]
        adj: list[set[int]] = [set() for _ in range(n)]
        for lo, hi in groups:
            adj[lo].add(hi)
            adj[hi].add(lo)
        self.steps, created = _reduce(adj)
        self.eliminated = {x for x, _, _ in self.steps}
        self.core = [i for i in range(n) if adj[i]]
        self.reduces = not self.core  # nothing left for the integer program
        core = set(self.core)  # the core's edges: by lower end, then in creation order
        self.core_edges = sorted(((lo, hi) for lo, hi in [*groups, *created]
                                  if lo in core and hi in core), key=lambda e: e[0])


class Memo:
    """The elimination arithmetic, memoised on the identity of its operands as stored: a
    leaf folds ``min over x of a^T + cost[x]`` into its neighbour, a node of two neighbours
    becomes the edge ``min over x of a^T[s, x] + (cost[x] + b[x, u])``, parallel edges
    add, each minimum with its first argmin. A pair's matrix is stored once, [S_lo, S_hi];
    a step reads it transposed or not (a flag of the key: no transposed view is made unless
    the step is computed).

    The blocks of a deep network give identical cost vectors and edge matrices (the very
    same cached objects), so most eliminations recur once per block: each is computed once.
    Every key's operands are kept with its result for as long as the memo lives (every
    round of a recursive_programming search; a memory weight's problems in
    dynamic_programming), so an ``id`` is never reused while it lives; no array is ever
    modified in place. ``cost[x] + b`` is kept too (pristine matrices recur) and the minimum
    is numpy's ``minimum.reduce`` itself (what ``ndarray.min`` calls through a Python
    wrapper)."""

    __slots__ = ("leaves", "middles", "sums", "trans", "bcs")

    def __init__(self) -> None:
        self.leaves: dict[tuple, tuple] = {}   # (p, flip, cost) -> (best, arg, operands)
        self.middles: dict[tuple, tuple] = {}  # (p, flip, cost, q, flip) -> (best, arg, ...)
        self.sums: dict[tuple, tuple] = {}     # (a, b) -> (a + b, a, b)
        self.trans: dict[int, tuple] = {}      # id(m) -> (m.T, m)
        self.bcs: dict[tuple, tuple] = {}      # (cost, q, flip) -> (cost[:, None] + b, ...)

    def t(self, m: np.ndarray) -> np.ndarray:
        """The transpose of ``m``, one object per array (so what is computed from it is
        memoised too)."""
        hit = self.trans.get(id(m))
        if hit is None:
            hit = self.trans[id(m)] = (m.T, m)
        return hit[0]

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        key = (id(a), id(b))
        hit = self.sums.get(key)
        if hit is None:
            hit = self.sums[key] = (a + b, a, b)
        return hit[0]

    @staticmethod
    def leaf(p: np.ndarray, fa: bool, cx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """min / argmin over x of a^T + cx, a = [S_x, S_y] stored as ``p`` (``fa``: as
        p^T)."""
        s = (p if fa else p.T) + cx[None, :]
        return _MIN(s, axis=1), s.argmin(axis=1)

    def middle(self, p: np.ndarray, fa: bool, cx: np.ndarray, q: np.ndarray,
               fb: bool) -> tuple[np.ndarray, np.ndarray]:
        """min / argmin over x of a^T[s, x] + (cx[x] + b[x, u]), a = [S_x, S_y] stored as
        ``p`` and b = [S_x, S_z] as ``q`` (each transposed when flagged)."""
        a = p if fa else p.T
        if a.shape[0] * q.size > _SMALL:
            return _eliminate_middle(a, cx, q.T if fb else q)
        key = (id(cx), id(q), fb)
        bc = self.bcs.get(key)
        if bc is None:
            bc = self.bcs[key] = ((cx[:, None] + (q.T if fb else q))[None, :, :], cx, q)
        t = a[:, :, None] + bc[0]
        return _MIN(t, axis=1), t.argmin(axis=1)


class Elimination:
    """The eliminations of one :class:`Order`, compiled: the vertex pairs get slots and
    each step its operands' slots, whether each is read transposed and whether the edge it
    adds to exists yet -- all of which depend on the structure only -- so a solve replays
    the steps with no dictionary of pairs and no tests. recursive_programming solves every
    round's cut problem (one structure) through one; dynamic_programming each problem
    through its own (:func:`eliminate`)."""

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
        self.core_slots = [slot[e] for e in order.core_edges]

    def solve(self, costs: Sequence[np.ndarray], mats: Sequence[np.ndarray],
              memo: Memo | None = None) -> list[int]:
        """One choice per vertex: the eliminations on vertex ``costs`` and one matrix per
        link (``mats[k]``: [S_u, S_v] of ``order.links[k]``), then the core, then the
        eliminated vertices replayed backwards (:meth:`replay`)."""
        memo = Memo() if memo is None else memo
        leaves, middles, add = memo.leaves, memo.middles, memo.add
        pair = self._pairs(mats, memo)
        cost = list(costs)
        args = []
        for x, y, z, sa, fa, sb, fb, syz, old in self.steps:
            p, cx = pair[sa], cost[x]
            if z < 0:  # leaf: cost[y] += min over x of (a^T + cost[x]), a = [S_x, S_y]
                key = (id(p), fa, id(cx))
                hit = leaves.get(key)
                if hit is None:
                    hit = leaves[key] = (*memo.leaf(p, fa, cx), p, cx)
                cost[y] = add(cost[y], hit[0])
            else:      # middle: edge y-z += min over x of (a^T + cost[x] + b)
                q = pair[sb]
                key = (id(p), fa, id(cx), id(q), fb)
                hit = middles.get(key)
                if hit is None:
                    hit = middles[key] = (*memo.middle(p, fa, cx, q, fb), p, cx, q)
                pair[syz] = add(pair[syz], hit[0]) if old else hit[0]
            args.append(hit[1])
        return self.replay(cost, pair, args)

    def replay(self, cost: list[np.ndarray], pair: list, args: list[np.ndarray]) -> list[int]:
        """The core exactly (the integer program on the folded costs), the other survivors
        (a component's last vertex) at their cheapest, then each eliminated vertex at its
        argmin given its neighbours' picks, backwards."""
        order, picks = self.order, [-1] * self.order.n
        if order.core:
            from autopar.strategies.exact import milp_picks

            local = {v: i for i, v in enumerate(order.core)}
            sub = milp_picks([cost[v] for v in order.core],
                             [(local[x], local[y], pair[s]) for (x, y), s in
                              zip(order.core_edges, self.core_slots)])
            for v, k in zip(order.core, sub):
                picks[v] = k
        for i in self.survivors:
            if picks[i] < 0:
                picks[i] = int(np.argmin(cost[i]))
        for (x, y, z), arg in zip(self.back, reversed(args)):
            picks[x] = arg.item(picks[y]) if z < 0 else arg.item(picks[y], picks[z])
        return picks

    def _pairs(self, mats: Sequence[np.ndarray], memo: Memo) -> list:
        """Slot -> [S_lo, S_hi] of its links (parallel links summed in link order)."""
        pair: list = [None] * self.n_slots
        for sl, k in self.singles:
            pair[sl] = mats[k]
        for sl, members in self.multi:
            acc = None
            for k, flip in members:
                m = memo.t(mats[k]) if flip else mats[k]
                acc = m if acc is None else memo.add(acc, m)
            pair[sl] = acc
        return pair


def eliminate(order: Order, costs: Sequence[np.ndarray], mats: Sequence[np.ndarray],
              memo: Memo | None = None) -> list[int]:
    """One choice per vertex: :meth:`Elimination.solve` of ``order`` (``memo``: the
    arithmetic's, kept by the caller across solves; None: a fresh one)."""
    return Elimination(order).solve(costs, mats, memo)


#: The largest core the integer program is given (columns: :func:`core_columns`). The
#: 94,584-column core of one Llama block with RoPE (64 devices) solves in about 2 s; two
#: blocks (274,020) took 6 s, 32 blocks 675 s. Past it the search falls back
#: (:mod:`~autopar.strategies.modes`: recursive_programming's cuts, then the same polish).
CORE_COLUMNS = 100_000


def core_columns(problem: Problem) -> int:
    """The integer program's columns (a binary per choice, a product per pair of choices of
    an edge) of the core the elimination leaves in ``problem``: 0 for a series-parallel
    graph. Read off the structure alone, before any arithmetic."""
    order = Order(len(problem.vertices), [(e.u, e.v) for e in problem.edges])
    sizes = [len(v.choices) for v in problem.vertices]
    return sum(sizes[v] for v in order.core) + sum(sizes[x] * sizes[y]
                                                   for x, y in order.core_edges)


def solve(problem: Problem) -> list[int]:
    """The least sum of every vertex's cost and every edge's entry: an upper bound of the
    price, which counts a move that k readers share k times."""
    return _solve(problem, [e.matrix if e.u != e.v else None for e in problem.edges])


def solve_shared(problem: Problem) -> list[int]:
    """The same elimination with each value's moves shared by all its readers: every edge's
    entry divided by the number of edges reading its value (below the price where readers
    want different layouts). Where the edge sum over-prices a layout several readers share
    (a reshape reading a reduce-scattered partial sum beside the other readers of the
    residual stream), this solve finds it; the search polishes both under the price and
    keeps the cheaper (:mod:`~autopar.strategies.modes`)."""
    readers = Counter(e.value for e in problem.edges)
    # (matrix, readers) -> (shared matrix, matrix): one array per matrix, so the blocks still
    # share them, kept across the problems of the price book (the matrix kept: its id)
    shared = _kept(problem).setdefault("shared", {})
    mats = []
    for e in problem.edges:
        m, r = e.matrix, readers[e.value]
        if e.u == e.v or r == 1:
            mats.append(None if e.u == e.v else m)
            continue
        hit = shared.get((id(m), r))
        if hit is None:
            hit = shared[id(m), r] = (m / r, m)
        mats.append(hit[0])
    return _solve(problem, mats)


def _solve(problem: Problem, mats: list) -> list[int]:
    order = Order(len(problem.vertices), [(e.u, e.v) for e in problem.edges])
    # the blocks of a deep network share their cost vectors and edge matrices (the same
    # cached arrays): the memo computes each block's eliminations once
    costs = [v.cost.astype(np.float64, copy=False) for v in problem.vertices]
    return eliminate(order, costs, mats, _memo(problem))


def _kept(problem: Problem) -> dict:
    """What this solver keeps across the problems of ``problem``'s price book
    (:meth:`Problem.solver_cache`; a fresh dict for a problem without one)."""
    cache = getattr(problem, "solver_cache", None)  # (tests solve bare stand-ins)
    return {} if cache is None else cache("dynamic_programming")


def _memo(problem: Problem) -> Memo:
    """The memo of the problems of one memory weight of ``problem``'s price book (a fresh
    one without a book): a loop body's problems at one weight (its candidates, the solve
    with moves shared) share the price book's cost arrays and matrices, so the
    eliminations their inputs do not reach are computed once. A memo keyed by the arrays'
    identity is right for any problems (it keeps the arrays alive); one weight's is
    dropped at the next weight (the arrays of another weight differ: kept, they would only
    hold memory)."""
    cache = getattr(problem, "solver_cache", None)
    if cache is None:
        return Memo()
    kept = cache("dynamic_programming")
    if kept.get("weight") != problem.memory_weight or "memo" not in kept:
        kept["weight"], kept["memo"] = problem.memory_weight, Memo()
    return kept["memo"]
