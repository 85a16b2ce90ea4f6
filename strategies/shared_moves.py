"""Shared moves priced once: single-operator and region moves under the plan's price.

The rewrite moves a value to a layout once, whatever number of operators read it there
(:func:`~autopar.strategies.problem.redistribution_once`), but a search's edge matrices price
each reader's move: an edge cannot see the other readers' choices. So the searches minimise
an upper bound of the price, and where several readers share a move they over-price it: a
fused QKV matmul keeping the batch split, its output moved once for its three readers, is
priced three moves.

:func:`polish` takes a solved plan and moves single operators while that lowers the price
(:meth:`Problem.evaluate <autopar.strategies.problem.Problem.evaluate>`'s objective): each
operator in turn takes the choice of its neighbourhood (every strategy of its vertex, or the
mode's own moves) that prices lowest, the parameters it reads re-picked for their readers
(:meth:`~autopar.strategies.problem.Problem.param_totals`), the rest of the plan held. Only
what the operator touches is priced: its own cost, and each value it reads or makes at the
layouts its readers then want, each distinct move once.

Which operators: first those where sharing can make the two objectives differ -- the maker
of a value read in one layout by more than one edge, the readers of a value another reader
reads moved, the readers of a parameter read more than once; then the neighbours of every
operator moved (first in, first out, in vertex order: the same plan always polishes the same
way).

Where no single move lowers the price, regions move: operators joined by values read as made
(no move between them) drop a mesh axis they split over, or every one, all at once (they then
repeat their work on it). A split carried along a chain cannot be dropped one operator at a
time -- each would add a move on both its sides -- so single moves stop above the optimum
there: one transformer block on accelerator-8x, batch-split 2-way through its attention and
layer norm and gathered before its MLP, priced 1.13x the exact optimum, which dropping that
region reaches. After a region moves, single moves resume around it. Like an operator's
move, a region's is decided once per situation (its operators' signatures and splits, the
layouts around it), so the identical blocks of a deep network price theirs once.

Every move lowers the price, so it ends. Fixed operators never move.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable

import numpy as np

from autopar.strategies.layout import TensorLayout
from autopar.strategies.opspec import legal_splits
from autopar.strategies.problem import Choice, Problem

__all__ = ["Neighbourhood", "polish"]

#: A mode's moves for operator vertex ``i`` from its current choice: choices, that one first.
Neighbourhood = Callable[[Problem, int, Choice], list[Choice]]

_RELATIVE = 1e-12  # a move must lower the price by more than float noise


def polish(problem: Problem, picks: list[int],
           neighbourhood: Neighbourhood | None = None) -> list[int]:
    """``picks`` after single-operator and region moves that lower the price (a new list; the
    parameters picked by :meth:`Problem.pick_parameters` at the end). ``neighbourhood``:
    the choices an operator may take (default: every choice of its vertex)."""
    moves = _Moves(problem, list(picks), neighbourhood)
    work = deque(sorted(moves.sharing()))
    budget = 4 * len(problem.vertices) + 16  # (each move lowers the price: a guard only)
    while budget > 0:  # (a plan where no operator shares a move may still move a region)
        budget = _single_moves(moves, work, budget)
        work = deque(sorted(moves.region_moves()))
        if not work:
            break
    problem.pick_parameters(moves.picks)
    return moves.picks


def _single_moves(moves: "_Moves", work: deque, budget: int) -> int:
    """Single-operator moves from ``work`` (then the neighbours of each operator moved)
    until none lowers the price; the budget left."""
    queued = set(work)
    while work and budget > 0:
        i = work.popleft()
        queued.discard(i)
        if moves.improve(i):
            budget -= 1
            for j in sorted(moves.near(i) - queued):
                work.append(j)
                queued.add(j)
    return budget


class _Moves:
    """The plan being polished: per value its edges, per vertex the values it touches."""

    def __init__(self, problem: Problem, picks: list[int],
                 neighbourhood: Neighbourhood | None) -> None:
        self.problem, self.picks, self.neighbourhood = problem, picks, neighbourhood
        self.verts, self.edges = problem.vertices, problem.edges
        self.by_value: dict[str, list[int]] = {}
        self.touches: list[dict[str, None]] = [{} for _ in self.verts]
        for k, e in enumerate(self.edges):
            self.by_value.setdefault(e.value, []).append(k)
            self.touches[e.v][e.value] = None
            self.touches[e.u][e.value] = None
        fixed = {problem.index[name] for name in problem.fixed}
        self.movable = [v.kind == "op" and i not in fixed for i, v in enumerate(self.verts)]
        self.columns: dict[tuple, np.ndarray] = {}
        self.memo: dict[tuple, tuple[Any, list[int]]] = {}  # situation -> best, params
        self.drops: dict[tuple, Choice | None] = {}  # (signature, splits, axes) -> dropped
        self.region_memo: dict[tuple, Any] = {}  # region situation -> its move (None: none)

    def dst(self, k: int) -> TensorLayout:
        e = self.edges[k]
        return self.verts[e.v].choices[self.picks[e.v]].in_layouts[e.in_index]

    def src(self, k: int) -> TensorLayout:
        e = self.edges[k]
        return self.verts[e.u].choices[self.picks[e.u]].out_layouts[e.out_index]

    def sharing(self) -> set[int]:
        """The operators where a shared move can make the price differ from the edge sum."""
        out: set[int] = set()
        for ks in self.by_value.values():
            if len(ks) < 2:
                continue
            u = self.edges[ks[0]].u
            dsts = [self.dst(k) for k in ks]
            readers = {self.edges[k].v for k in ks}
            if len(set(dsts)) < len(dsts):
                out.add(u)          # a layout read more than once: its maker may move it once
            if self.verts[u].kind == "param" or any(d != self.src(ks[0]) for d in dsts):
                out |= readers      # a reader may join another's moved layout
        return {i for i in out if self.movable[i]}

    def near(self, i: int) -> set[int]:
        """The movable vertices that share a value with ``i``."""
        out = set()
        for x in self.touches[i]:
            ks = self.by_value[x]
            out.add(self.edges[ks[0]].u)
            out.update(self.edges[k].v for k in ks)
        out.discard(i)
        return {j for j in out if self.movable[j]}

    def improve(self, i: int) -> bool:
        """Move operator ``i`` to its cheapest choice if that lowers the price."""
        problem, vert = self.problem, self.verts[i]
        here = vert.choices[self.picks[i]]
        if self.neighbourhood is None:  # (the vertex's choices and costs, the current one)
            mine: object = (id(vert.cost), self.picks[i])
        else:
            mine = (problem._sig[vert.name], here.splits)
        key, roles = self.situation(i, mine)
        hit = self.memo.get(key)
        if hit is None:
            if self.neighbourhood is None:
                cs, cur = vert.choices, self.picks[i]
            else:
                cs, cur = self.neighbourhood(problem, i, here), 0
            hit = self.memo[key] = self.local(i, cs, roles, cur) if len(cs) > 1 else \
                (None, [])
        best, params = hit
        if best is None:
            return False
        self.picks[i] = best if self.neighbourhood is None else \
            problem.choice_index(i, best)
        for p, q in zip((p for role, _, _, p in roles if role == "p"), params):
            self.picks[p] = q
        return True

    def regions(self) -> list[list[int]]:
        """Movable operators joined by values read as made (no move between them), in
        sets of two or more that split something: a split carried along a chain."""
        parent = list(range(len(self.verts)))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = i = parent[parent[i]]
            return i

        movable, here = self.movable, self.current()
        for e in self.edges:
            if movable[e.u] and movable[e.v]:
                a, b = here[e.u].out_layouts[e.out_index], here[e.v].in_layouts[e.in_index]
                if a is b or a == b:
                    parent[root(e.u)] = root(e.v)
        out: dict[int, list[int]] = {}
        for i, c in enumerate(here):
            if movable[i] and c.used_axes:
                out.setdefault(root(i), []).append(i)
        return [r for r in out.values() if len(r) > 1]

    def current(self) -> list[Choice]:
        """Every vertex's choice at its pick."""
        return [v.choices[k] for v, k in zip(self.verts, self.picks)]

    def region_moves(self) -> set[int]:
        """Each region drops one mesh axis (or all it uses) at once where that lowers the
        price (its operators then repeat their work on it): what single moves cannot reach,
        where the first operator to drop it alone would add a move on each side. A region's
        move is decided once per situation (:meth:`region_situation`): the identical blocks
        of a deep network share it. Returns the operators in and next to every region moved
        (for single moves again)."""
        moved: set[int] = set()
        for region in self.regions():
            here = {i: self.verts[i].choices[self.picks[i]] for i in region}
            key, params = self.region_situation(region, here)
            hit = self.region_memo.get(key, False)
            if hit is False:
                hit = self.region_memo[key] = self._region_move(region, here, params)
            if hit is not None:
                splits, picked = hit
                changed = {i: t for i, t in zip(region, splits) if t != here[i].splits}
                for i, t in changed.items():
                    self.picks[i] = self.problem.choice_index(i, t)
                for p, q in zip(params, picked):
                    if q >= 0:
                        self.picks[p] = q
                moved.update(self.near_all(changed))
        return moved

    def _region_move(self, region: list[int], here: dict[int, Choice], params: list[int]
                     ) -> tuple[tuple, tuple[int, ...]] | None:
        """The region's first axis drop that lowers the price (single axes, then all it
        uses): every operator's splits there, and each parameter's pick (-1: kept)."""
        used = sorted(set().union(*(c.used_axes for c in here.values())))
        for axes in [frozenset({a}) for a in used] + \
                ([frozenset(used)] if len(used) > 1 else []):
            new = self._dropped(here, axes)
            picked = self._gain(new) if new else None
            if picked is not None:
                return (tuple(new.get(i, here[i]).splits for i in region),
                        tuple(picked.get(p, -1) for p in params))
        return None

    def region_situation(self, region: list[int], here: dict[int, Choice]
                         ) -> tuple[tuple, list[int]]:
        """What a region's move depends on: its operators' signatures and splits, and per
        value they touch its size, who makes it (a region operator, a parameter's costs, or
        its layout as made) and who reads it (a region operator's input, or the layout
        read). Also the parameters it reads, in that order."""
        problem, edges, verts = self.problem, self.edges, self.verts
        pos = {i: n for n, i in enumerate(region)}
        key: list = [tuple((problem._sig[verts[i].name], here[i].splits) for i in region)]
        params = []
        for x in dict.fromkeys(x for i in region for x in self.touches[i]):
            ks = self.by_value[x]
            reads = tuple((pos[edges[k].v], edges[k].in_index) if edges[k].v in pos
                          else self.dst(k) for k in ks)
            u, j = edges[ks[0]].u, edges[ks[0]].out_index
            if u in pos:
                maker: tuple = ("m", pos[u], j)
            elif verts[u].kind == "param":
                maker = ("p", id(verts[u].cost))
                params.append(u)
            else:
                maker = ("r", verts[u].choices[self.picks[u]].out_layouts[j])
            key.append((problem._nbytes[x], problem.requires_grad[x], maker, reads))
        return tuple(key), params

    def _dropped(self, here: dict[int, Choice], drop: frozenset[str]
                 ) -> dict[int, Choice] | None:
        """The region's choices with the mesh axes ``drop`` dropped (None where one
        cannot)."""
        out = {}
        for i, c in here.items():
            if drop & c.used_axes:
                name = self.verts[i].name
                key = (self.problem._sig[name], c.splits, drop)
                new = self.drops.get(key, False)
                if new is False:
                    new = self.drops[key] = self._drop(name, c.splits, drop)
                if new is None:
                    return None
                out[i] = new
        return out

    def _drop(self, name: str, splits: tuple[int, ...], drop: frozenset[str]
              ) -> Choice | None:
        """Operator ``name``'s choice at ``splits`` less the mesh axes ``drop``: repeated
        work, where it may repeat it (else None)."""
        problem, size = self.problem, dict(self.problem.mesh.axes)
        axes = problem.axes_of(splits)
        if axes is None or not problem.may_repeat(problem.graph.node(name)):
            return None
        new = tuple(s // math.prod(size[x] for x in a if x in drop)
                    for s, a in zip(splits, axes))
        if not legal_splits(problem.specs[name], new, problem.mesh, None, problem.axes_of):
            return None
        return problem._op_choice(name, new)

    def _gain(self, new: dict[int, Choice]) -> dict[int, int] | None:
        """Whether moving the operators of ``new`` together lowers the price (their own
        costs and every value they touch, priced before and after, parameters re-picked):
        the parameters' picks there if so, else None. Prices are never negative, so the
        sum after stops as soon as it reaches the price before (a region of a whole deep
        network dropping an axis repeats so much work that its own costs alone do)."""
        problem = self.problem
        values = list(dict.fromkeys(x for i in new for x in self.touches[i]))
        before = sum(self.verts[i].cost.item(self.picks[i]) for i in new)
        after = sum(problem.choice_costs(self.verts[i].name, [c]).item(0)
                    for i, c in new.items())
        for x in values:
            before += self._value(x, {})[0]
        bar = before - _RELATIVE * abs(before)
        params = {}
        for x in values:
            if not after < bar:
                return None
            price, param = self._value(x, new)
            after += price
            if param is not None:
                params[param[0]] = param[1]
        return params if after < bar else None

    def _value(self, x: str, new: dict[int, Choice]) -> tuple[float, tuple[int, int] | None]:
        """Value ``x``'s price with the operators of ``new`` moved there: each distinct
        layout read moved once; a parameter at its cheapest layout (and that pick)."""
        ks, edges = self.by_value[x], self.edges
        dsts = [new[edges[k].v].in_layouts[edges[k].in_index] if edges[k].v in new
                else self.dst(k) for k in ks]
        u = edges[ks[0]].u
        if self.verts[u].kind == "param":
            totals = self.problem.param_totals(u, dsts, self.columns)
            q = int(np.argmin(totals))
            return totals.item(q), (u, q)
        src = new[u].out_layouts[edges[ks[0]].out_index] if u in new else self.src(ks[0])
        cost = self.problem.edge_cost
        return sum(cost(x, src, t) for t in dict.fromkeys(dsts) if t != src), None

    def near_all(self, group: dict[int, Any]) -> set[int]:
        """The movable vertices that share a value with any of ``group``, and the group."""
        return set(group).union(*(self.near(i) for i in group))

    def situation(self, i: int, mine: object) -> tuple[tuple, list[tuple]]:
        """What operator ``i``'s best move depends on (its choices, and per value it
        touches the value's size and the layouts around it: identical blocks share it), and
        each value's role: made ("m"), read ("r") or a parameter read ("p")."""
        problem, edges = self.problem, self.edges
        key: list = [mine]
        roles = []
        for x in self.touches[i]:
            ks = self.by_value[x]
            u = edges[ks[0]].u
            size = (problem._nbytes[x], problem.requires_grad[x])
            if u == i:
                roles.append(("m", x, ks, u))
                key.append(("m", size, edges[ks[0]].out_index,
                            tuple(dict.fromkeys(self.dst(k) for k in ks))))
            elif self.verts[u].kind == "param":
                roles.append(("p", x, ks, u))
                key.append(("p", size, id(self.verts[u].cost), tuple(
                    edges[k].in_index if edges[k].v == i else self.dst(k) for k in ks)))
            else:
                roles.append(("r", x, ks, u))
                key.append(("r", size, self.src(ks[0]),
                            frozenset(self.dst(k) for k in ks if edges[k].v != i),
                            tuple(edges[k].in_index for k in ks if edges[k].v == i)))
        return tuple(key), roles

    def local(self, i: int, cs: list[Choice], roles: list[tuple], cur: int
              ) -> tuple[Any, list[int]]:
        """Operator ``i``'s cheapest choice of ``cs`` if it lowers the price (else None),
        and the parameters' picks there: per choice its cost plus the price of every value
        it reads or makes (each distinct move once, parameters re-picked)."""
        vert = self.verts[i]
        own = vert.cost if self.neighbourhood is None else \
            self.problem.choice_costs(vert.name, cs)
        total = np.array(own, dtype=np.float64)
        args = []
        for role, x, ks, u in roles:
            if role == "m":
                total += self._made(x, ks, cs)
            elif role == "p":
                price, arg = self._parameter(i, u, ks, cs)
                total += price
                args.append(arg)
            else:
                total += self._read(i, x, ks, cs)
        best = int(np.argmin(total))
        if not total[best] < total[cur] - _RELATIVE * abs(total[cur]):
            return None, []
        params = [int(arg[best]) for arg in args]
        return (best if self.neighbourhood is None else cs[best].splits), params

    def _made(self, x: str, ks: list[int], cs: list[Choice]) -> np.ndarray:
        """Value ``x`` made by the moving operator: moved once to each layout read."""
        groups = list(dict.fromkeys(self.dst(k) for k in ks))
        j = self.edges[ks[0]].out_index
        srcs, inv = _distinct([c.out_layouts[j] for c in cs])
        return self.problem._edge_costs(x, srcs, groups).sum(axis=1)[inv]

    def _read(self, i: int, x: str, ks: list[int], cs: list[Choice]) -> np.ndarray:
        """Value ``x`` read by the moving operator: its layouts the others do not read yet,
        moved once each."""
        src, others = self.src(ks[0]), {self.dst(k) for k in ks if self.edges[k].v != i}
        mine = [self.edges[k].in_index for k in ks if self.edges[k].v == i]
        reads, inv = _distinct([tuple(c.in_layouts[j] for j in mine) for c in cs])
        cost = self.problem.edge_cost
        extra = [sum(cost(x, src, t) for t in dict.fromkeys(r) if t not in others)
                 for r in reads]
        return np.array(extra, dtype=np.float64)[inv]

    def _parameter(self, i: int, p: int, ks: list[int], cs: list[Choice]
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Parameter vertex ``p`` read by the moving operator: per choice, its cheapest
        layout's cost with its readers as they would read it, and that layout."""
        edges = self.edges
        reads, inv = _distinct([tuple(c.in_layouts[edges[k].in_index] if edges[k].v == i
                                      else self.dst(k) for k in ks) for c in cs])
        price, arg = np.empty(len(reads)), np.empty(len(reads), dtype=np.int64)
        for n, r in enumerate(reads):
            totals = self.problem.param_totals(p, r, self.columns)
            arg[n] = k = int(np.argmin(totals))
            price[n] = totals[k]
        return price[inv], arg[inv]


def _distinct(items: list) -> tuple[list, np.ndarray]:
    """The distinct items (first-seen order) and, per item, its index among them."""
    index: dict = {}
    inv = [index.setdefault(t, len(index)) for t in items]
    return list(index), np.array(inv, dtype=np.int64)
