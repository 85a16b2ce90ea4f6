"""recursive_programming: MindSpore's recursive (SAPP) idea — one cut per round, linear time.

``device_num`` is cut in rounds, one prime factor (one mesh axis) per round: log2(devices)
two-way cuts for powers of two. In a round every operator may multiply the split of one of its
loop dimensions by the round's factor, or — where the strategy space allows repeated work
(small operators, or ``fully_use_devices=False``) — keep its split. Where
SAPP visits operators greedily by weight, autopar solves each round's small cut problem —
at most (dims + 1) options per operator — exactly with the graph elimination of
:mod:`dynamic_programming`; with so few options per operator that is linear in the graph size,
and it avoids the greedy visit's inconsistent cuts between neighbours (ties go to the lower
loop dimension). Parameters finally take the cheapest layout of all those the strategy space
offers them — their memory (when priced) plus the redistribution to the consumers as cut —
so under a binding memory budget a parameter can be stored more finely split than it is
read.

Re-cuts: a round prices its cut on the devices cut so far, so it cannot see how the later
rounds' cuts combine with it (at 64 devices a transformer's third round completed the batch
split or began a hidden split of the residual stream on a 0.2% difference of the round's
objective; the hidden split ended 14% dearer on the whole mesh). After the last round each
operator may move one prime factor of its split from one loop dimension to another — one
earlier round's cut placed elsewhere, on the same devices (operators that may repeat their
work may also drop a factor or take one more), or take the splits another operator of its
signature holds (the rounds' ties can leave the identical blocks of a network apart: at 8
and 16 blocks on 64 devices a few blocks' attention ended on a cheaper layout than the
others', 0.25 % above dynamic_programming; now every block takes it) — priced on the whole
mesh, and that cut is again solved exactly, over all operators at once; repeated while it
lowers the objective (a few passes; 12-96 layers at 64 devices: within 0.02% of
dynamic_programming). Where they stop, one replication cut lets every operator that may repeat
its work stop splitting at once (one transformer block of hidden 256 on 64 devices: the
rounds split its attention 8-way, each re-cut dropping one factor of it was dearer, and the
plan stayed at 1.56x dynamic_programming's price; 1.07x with the replication cut), and the
re-cuts resume if it lowered the objective. Approximate still (one factor moves per pass);
the exact referee measures how far from optimal it lands.

Speed: every round's cut problem has the same structure (operators and data inputs, one link
per consumed value), so the elimination order is found once (:class:`dynamic_programming.Order
<autopar.strategies.dynamic_programming.Order>`) and compiled
(:class:`~autopar.strategies.dynamic_programming.Elimination`, the one elimination); a round
replays it, its arithmetic memoised on the identity of its operands — the identical blocks of
a deep network share their cost vectors and edge matrices, so most eliminations are computed
once, not once per block. The picks are exactly dynamic_programming's (the same elimination).
Operators are handled per state (signature, splits): candidates, cost vectors and link
matrices are built once per distinct state, not per operator; an operator's price comes from
its split counts (:mod:`~autopar.strategies.op_pricing`, kept per signature recipe and
splits), a matrix from the two layout lists at its ends (links of different kinds share it),
layouts from the tensor's map and the canonical axes. The cyclic garbage collector is paused
(the search makes no cycles).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from autopar.strategies.dynamic_programming import Elimination, Memo, Order
from autopar.strategies.layout import TensorLayout, prime_factors
from autopar.strategies.opspec import legal_splits
from autopar.gc_pause import paused_gc
from autopar.strategies.problem import Choice, Problem, enumerate_splits

__all__ = ["neighbourhood", "solve"]

Splits = tuple[int, ...]


def _loop_options(problem: Problem, i: int, cur: Splits) -> list[Splits] | None:
    """A loop node's options in any cut: ``cur`` and its other candidates (each a whole
    body plan on the whole mesh: :mod:`~autopar.strategies.loops`); None for an operator."""
    loop = problem.loops.get(problem.vertices[i].name)
    if loop is None:
        return None
    return [cur] + [s for s in loop.candidates() if s != cur]


def _candidates(problem: Problem, i: int, cur: Splits, p: int) -> list[Splits]:
    """A round's options of operator ``i``: one loop dim's split times ``p`` (where legal),
    or ``cur`` when the operator may repeat its work (or nothing else is legal); a loop
    node's: its candidates."""
    loop = _loop_options(problem, i, cur)
    if loop is not None:
        return loop
    spec = problem.specs[problem.vertices[i].node.name]
    out = []
    for d in range(len(cur)):
        new = cur[:d] + (cur[d] * p,) + cur[d + 1:]
        if legal_splits(spec, new, problem.mesh, (d,), problem.axes_of):
            out.append(new)
    if not out or problem.may_repeat(problem.vertices[i].node):
        out.append(cur)  # not cutting: the operator repeats its work on this axis
    return out


_MAX_RECUTS = 16  # re-cut passes at most (each lowers the objective; a few suffice)


def _moves(problem: Problem, i: int, cur: Splits, peers: tuple[Splits, ...] = ()
           ) -> list[Splits]:
    """``cur`` first, then every split that moves one prime factor of ``cur`` from one loop
    dimension to another (the same devices, one round's cut placed elsewhere); an operator
    that may repeat its work (as a round lets it keep its split) may also drop one factor or
    take one more. For example the (8, 1, 8) residual add of a transformer (batch 8, sequence,
    hidden) on 64 devices may become (4, 2, 8), (4, 1, 16), (8, 2, 4) or (8, 1, 8) again —
    never (16, 1, 4): its batch has 8 rows. Last, ``peers``: the splits other operators of
    its signature hold (legal for it), so the blocks of a deep network that ended apart can
    all take the cheaper one. A loop node's: its candidates."""
    loop = _loop_options(problem, i, cur)
    if loop is not None:
        return loop
    spec = problem.specs[problem.vertices[i].node.name]
    mesh = problem.mesh
    out = [cur]

    def offer(t: Splits, changed: tuple[int, ...]) -> None:
        if t not in out and legal_splits(spec, t, mesh, changed, problem.axes_of):
            out.append(t)

    for a in range(len(cur)):
        for p in sorted(set(prime_factors(cur[a]))):
            for b in range(len(cur)):
                if b != a:
                    new = list(cur)
                    new[a] //= p
                    new[b] *= p
                    offer(tuple(new), (b,))
    if problem.may_repeat(problem.vertices[i].node):
        for a in range(len(cur)):
            for p in sorted(set(prime_factors(cur[a]))):
                offer(cur[:a] + (cur[a] // p,) + cur[a + 1:], ())
            for p in sorted(set(prime_factors(mesh.device_num // math.prod(cur)))):
                offer(cur[:a] + (cur[a] * p,) + cur[a + 1:], (a,))
    out += [t for t in peers if t not in out]
    return out


def _replicate(problem: Problem, i: int, cur: Splits) -> list[Splits]:
    """``cur``, then no split at all where operator ``i`` may repeat its work: the options of
    the replication cut (:meth:`_Rounds.recuts`). A re-cut drops one prime factor at a time,
    so a small operator split 8-way on 64 devices needs three re-cuts to stop splitting, the
    first two dearer; the replication cut drops every factor of any such operators at once."""
    out = [cur]
    if problem.may_repeat(problem.vertices[i].node) and any(x > 1 for x in cur):  # (not loops)
        out.append((1,) * len(cur))
    return out


def neighbourhood(problem: Problem, i: int, current: Choice) -> list[Choice]:
    """Operator ``i``'s re-cut moves from ``current`` (:func:`_moves`) as choices, ``current``
    first: the moves :mod:`~autopar.strategies.shared_moves` tries after the search."""
    name = problem.vertices[i].name
    return [problem._op_choice(name, s) for s in _moves(problem, i, current.splits)]


class _Rounds:
    """The cut problems of one solve: vertices (operators, then data inputs), links (one per
    consumed value; parameters follow at the end) and their elimination order, shared by
    every round. An operator's state is (signature, splits, fixed): operators in one state
    have the same candidates, costs and edge matrices in every round, so those are built
    once per state (costs are cached by signature and splits)."""

    _WIDE = 1 << 20  # link kinds and candidate-list ids stay far below this

    def __init__(self, problem: Problem) -> None:
        verts = problem.vertices
        self.problem = problem
        self.ops = [i for i, v in enumerate(verts) if v.kind == "op"]
        self.data = [i for i, v in enumerate(verts) if v.kind == "data"]
        self.local = {i: k for k, i in enumerate(self.ops + self.data)}
        self.links = [e for e in problem.edges if verts[e.u].kind != "param"]
        self.cut = Elimination(Order(len(self.local), [(self.local[e.u], self.local[e.v])
                                                  for e in self.links]))
        self.state_keys: list[tuple] = []
        self.state_id: dict[tuple, int] = {}
        self.rep: dict[int, int] = {}  # state -> one operator in it
        self.op_state = self._initial_states()
        self._index_links()
        self.memo = Memo()
        self.no_cost = np.zeros(1)
        # kept across the solves of the problems of one price book (Problem.solver_cache:
        # a loop body searched at every memory weight and candidate): what the candidate
        # lists, the tensors' maps and the layouts decide
        kept = problem.solver_cache("recursive_programming")
        self.interned: dict[tuple, int] = kept.setdefault("interned", {})  # cands -> int
        self.cands_of: dict[tuple, tuple[list[Splits], int]] = {}  # (state, round) -> cands
        # (state key, round, peers) -> cands: an operator's are its signature's and splits'
        self.cands_by_key: dict[tuple, tuple[list[Splits], int]] = kept.setdefault(
            "candidates", {})
        # the round costs, per memory weight and parameter pricing (a loop node's apart)
        weighted = kept.setdefault("weighted", {}).setdefault(
            (problem.memory_weight, problem.parallel_optimizer_kb,
             problem.optimizer_weight_shard_size), {})
        # (signature, candidate list) -> costs
        self.cost_cache: dict[tuple, np.ndarray] = weighted.setdefault("costs", {})
        self.loop_costs: dict[tuple, np.ndarray] = {}
        # (price recipe, splits) -> round cost
        self.split_cost: dict[tuple, float] = weighted.setdefault("splits", {})
        self.cache: dict[object, np.ndarray] = {}  # link matrices
        self.layout_cache: dict[tuple, int] = kept.setdefault("layout_cache", {})
        # (map, summed, candidates) -> list id; a loop node's (its problem's) apart:
        self.loop_layouts: dict[tuple, int] = {}
        self.layout_ids: dict[tuple[TensorLayout, ...], int] = kept.setdefault("layout_ids", {})
        self.layout_lists: list[list[TensorLayout]] = kept.setdefault("layout_lists", [])
        # (bytes, grad, lists) -> matrix
        self.by_layouts: dict[tuple, np.ndarray] = kept.setdefault("by_layouts", {})
        self.link_ends: np.ndarray | None = None  # [links, 2] cut vertices, for scores

    def intern(self, key: tuple) -> int:
        k = self.state_id.get(key)
        if k is None:
            k = self.state_id[key] = len(self.state_keys)
            self.state_keys.append(key)
        return k

    def _initial_states(self) -> np.ndarray:
        """Every operator unsplit, or at its fixed splits."""
        problem, verts = self.problem, self.problem.vertices
        fixed = {problem.index[name]: s for name, s in problem.fixed.items()}
        op_state = np.empty(len(self.ops), dtype=np.int64)
        for j, i in enumerate(self.ops):
            name = verts[i].node.name  # type: ignore[union-attr]
            s = fixed.get(i, tuple(1 for _ in problem.specs[name].sizes))
            op_state[j] = k = self.intern((problem._sig[name], s, i in fixed))
            self.rep.setdefault(k, i)
        return op_state

    def _index_links(self) -> None:
        """op -> op links by (producer signature, output, consumer signature, input): with
        the two ends' candidate lists, that decides the matrix. Data links apart."""
        verts, sig = self.problem.vertices, self.problem._sig
        link_kinds: dict[tuple, int] = {}
        op_links, self.data_links = [], []
        for k, e in enumerate(self.links):
            if verts[e.u].kind == "op":
                code = link_kinds.setdefault((sig[verts[e.u].name], e.out_index,
                                              sig[verts[e.v].name], e.in_index),
                                             len(link_kinds))
                op_links.append((k, self.local[e.u], self.local[e.v], code))
            else:
                self.data_links.append((k, e))
        self.lk, self.lu, self.lv, self.lcode = (
            np.array([x[c] for x in op_links], dtype=np.int64) for c in range(4))

    def _round_costs(self, node, cands: list[Splits]) -> np.ndarray:
        """Per candidate: the operator's cost plus what the parameters it reads cost in the
        layout it wants (parameters follow their consumers): their optimizer update, and
        their memory when memory is priced (memoised per price recipe and splits)."""
        problem = self.problem
        pricer, weight = problem._op_pricer, problem.memory_weight
        if node.name in problem.loops:
            return self._loop_costs(node, cands)
        recipe = pricer.recipe(problem._sig[node.name], node, problem.specs[node.name])
        done, out = self.split_cost, []
        for splits in cands:
            key = (recipe.klass, splits)
            hit = done.get(key)
            if hit is None:
                compute, comm, sync, mem = pricer.costs(recipe, splits)
                compute += problem.once_per_step(pricer.update(recipe, splits))
                if weight:
                    lays = problem.op_choice(node, splits).in_layouts
                    mem += sum([problem.param_memory(v, lays[j])
                                for j, v, _, _ in recipe.params])
                hit = done[key] = compute + comm + problem.once_per_step(sync) + weight * mem
            out.append(hit)
        return np.array(out)

    def _loop_costs(self, node, cands: list[Splits]) -> np.ndarray:
        """:meth:`_round_costs` of a loop node: each candidate's price plus the optimizer
        update (and memory, when priced) of the parameters it reads, at the layouts it reads
        them in."""
        problem, weight = self.problem, self.problem.memory_weight
        choices = [problem._op_choice(node.name, s) for s in cands]
        out = problem.choice_costs(node.name, choices)
        extra = []
        for c in choices:
            x = 0.0
            for v, lay in zip(node.inputs, c.in_layouts):
                if problem.graph.values[v].kind == "param":
                    x += problem.once_per_step(problem.param_update(v, lay))
                    x += weight * problem.param_memory(v, lay) if weight else 0.0
            extra.append(x)
        return out + np.array(extra)

    def _candidate_costs(self, candidates: Callable[[int, Splits], list[Splits]],
                         rkey: object, peers: dict[int, tuple[Splits, ...]]
                         ) -> tuple[dict[int, list[Splits]], np.ndarray, list[np.ndarray]]:
        """Per state its candidates and their id; per cut vertex its cost vector (the
        candidates kept per state, round and the peers of its signature)."""
        verts = self.problem.vertices
        cands: dict[int, list[Splits]] = {}
        cid_of = np.zeros(len(self.state_keys), dtype=np.int64)
        cost_of = np.empty(len(self.state_keys), dtype=object)
        loops = self.problem.loops
        for st in np.unique(self.op_state).tolist():
            s, cur, is_fixed = self.state_keys[st]
            ckey = (st, rkey, peers.get(s))
            got = self.cands_of.get(ckey)
            looped = verts[self.rep[st]].name in loops  # (a loop's candidates: its problem's)
            if got is None:
                shared = None if looped else (self.state_keys[st], rkey, peers.get(s))
                got = None if shared is None else self.cands_by_key.get(shared)
                if got is None:
                    cs = [cur] if is_fixed else candidates(self.rep[st], cur)
                    got = (cs, self.interned.setdefault(tuple(cs), len(self.interned)))
                    if shared is not None:
                        self.cands_by_key[shared] = got
                self.cands_of[ckey] = got
            cs, c = got
            costs = self.loop_costs if looped else self.cost_cache
            cost = costs.get((s, c))
            if cost is None:
                cost = costs[s, c] = self._round_costs(verts[self.rep[st]].node, cs)
            cands[st], cid_of[st], cost_of[st] = cs, c, cost
        sub_cost = cost_of[self.op_state].tolist() + [self.no_cost] * len(self.data)
        return cands, cid_of, sub_cost

    def _layouts(self, i: int, cands: list[Splits], cid: int, index: int, out: bool) -> int:
        """Operator ``i``'s layouts of output (or input) ``index`` over its candidates, as
        the small int of that list: built from the tensor's map and the canonical axes
        (``Problem.op_choice``'s layouts, without its Choice), kept per map, partial-sum
        dims and candidate list (operators of many signatures share them)."""
        name = self.problem.vertices[i].name
        if name in self.problem.loops:  # a loop node: its candidates' layouts
            key: tuple = ("loop", name, index, out, cid)
            hit = self.loop_layouts.get(key)
            if hit is None:
                chosen = [self.problem._op_choice(name, x) for x in cands]
                hit = self.loop_layouts[key] = self._layout_list(tuple(
                    c.out_layouts[index] if out else c.in_layouts[index] for c in chosen))
            return hit
        spec = self.problem.specs[name]
        mp = spec.out_maps[index] if out else spec.in_maps[index]
        key = (mp, spec.summed if out else None, cid)
        hit = self.layout_cache.get(key)
        if hit is None:
            assign, summed = self.problem.axes_of, sorted(spec.summed) if out else ()
            lays = []
            for x in cands:
                axes = assign(x)
                lays.append(TensorLayout(tuple(axes[m] if m is not None else () for m in mp),
                                         tuple(a for d in summed for a in axes[d])))
            hit = self.layout_cache[key] = self._layout_list(tuple(lays))
        return hit

    def _layout_list(self, lays: tuple[TensorLayout, ...]) -> int:
        lid = self.layout_ids.setdefault(lays, len(self.layout_lists))
        if lid == len(self.layout_lists):
            self.layout_lists.append(list(lays))
        return lid

    def _matrix(self, value: str, src: int, dst: int) -> np.ndarray:
        """The redistribution costs of ``value`` between two layout lists: a function of
        its size, whether it carries a gradient and the layouts only, so links of
        different kinds (an elementwise chain's) share it."""
        problem = self.problem
        key = (problem._nbytes[value], problem.requires_grad[value], src, dst)
        m = self.by_layouts.get(key)
        if m is None:
            m = self.by_layouts[key] = _edge_costs(problem, value, self.layout_lists[src],
                                                   self.layout_lists[dst])
        return m

    def _op_matrices(self, mats: np.ndarray, cands: dict[int, list[Splits]],
                     cid_of: np.ndarray, states: list[int]) -> None:
        """The op -> op links' matrices, one per (link kind, candidate lists)."""
        wide = self._WIDE
        lk, lu, lv = self.lk, self.lu, self.lv
        cid = cid_of[self.op_state]
        codes = (self.lcode * wide + cid[lu]) * wide + cid[lv]
        ucodes, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
        umats = np.empty(len(ucodes), dtype=object)
        for n, (code, f) in enumerate(zip(ucodes.tolist(), first.tolist())):
            m = self.cache.get(code)
            if m is None:
                e = self.links[int(lk[f])]
                su, sv = states[int(lu[f])], states[int(lv[f])]
                m = self.cache[code] = self._matrix(
                    e.value, self._layouts(e.u, cands[su], int(cid_of[su]), e.out_index, True),
                    self._layouts(e.v, cands[sv], int(cid_of[sv]), e.in_index, False))
            umats[n] = m
        mats[lk] = umats[inverse.reshape(-1)]

    def _matrices(self, cands: dict[int, list[Splits]], cid_of: np.ndarray,
                  data_layout: dict[int, TensorLayout], dkey: object) -> list[np.ndarray]:
        """One matrix per link: op -> op links, then data inputs (in ``data_layout``)."""
        verts, sig = self.problem.vertices, self.problem._sig
        states = self.op_state.tolist()
        mats = np.empty(len(self.links), dtype=object)
        if len(self.lk):
            self._op_matrices(mats, cands, cid_of, states)
        for k, e in self.data_links:
            st = states[self.local[e.v]]
            key = ((e.value, dkey), e.out_index, sig[verts[e.v].name], e.in_index,
                   int(cid_of[st]))
            m = self.cache.get(key)
            if m is None:
                m = self.cache[key] = self._matrix(
                    e.value, self._layout_list((data_layout[e.u],)),
                    self._layouts(e.v, cands[st], int(cid_of[st]), e.in_index, False))
            mats[k] = m
        return mats.tolist()

    def _next_states(self, cands: dict[int, list[Splits]], picks: list[int]) -> np.ndarray:
        """Each operator's next state: its candidate at the pick."""
        span = 1 + max((len(cs) for cs in cands.values()), default=0)  # (no operator: 1)
        moves = self.op_state * span + np.array(picks[:len(self.ops)], dtype=np.int64)
        umoves, inverse = np.unique(moves, return_inverse=True)
        nxt = []
        for mv in umoves.tolist():
            st, k = divmod(mv, span)
            key = self.state_keys[st]
            nxt.append(self.intern((key[0], cands[st][k], key[2])))
            self.rep.setdefault(nxt[-1], self.rep[st])
        return np.array(nxt, dtype=np.int64)[inverse.reshape(-1)]

    def _scores(self, sub_cost: list[np.ndarray], mats: list[np.ndarray],
                picks: list[int]) -> tuple[float, float]:
        """The cut's objective at candidate 0 of every vertex and at the picks: the very
        sums (same terms, same order) of each vertex's cost and each link's entry, the
        entries gathered by numpy from the distinct arrays."""
        at = np.array(picks, dtype=np.int64)
        flat, off, cols, w = _flatten(sub_cost)
        before_v, after_v = flat[off[w]].tolist(), flat[off[w] + at].tolist()
        if self.link_ends is None:
            self.link_ends = np.array(self.cut.order.links, dtype=np.int64).reshape(-1, 2)
        u, v = self.link_ends[:, 0], self.link_ends[:, 1]
        flat, off, cols, w = _flatten(mats)
        before_m = flat[off[w]].tolist()
        after_m = flat[off[w] + at[u] * cols[w] + at[v]].tolist()
        return sum(before_v) + sum(before_m), sum(after_v) + sum(after_m)

    def cut_once(self, candidates: Callable[[int, Splits], list[Splits]],
                 data_layout: dict[int, TensorLayout], dkey: object, score: bool = False,
                 peers: dict[int, tuple[Splits, ...]] | None = None
                 ) -> tuple[np.ndarray, float, float]:
        """Solve one cut exactly: every operator picks one of ``candidates(op, splits)``
        (which may depend on ``peers``, per signature). Returns the operators' next states
        and, with ``score``, the cut's objective at candidate 0 of every operator (its
        current splits, for a re-cut) and at the picks."""
        cands, cid_of, sub_cost = self._candidate_costs(candidates, dkey, peers or {})
        mats = self._matrices(cands, cid_of, data_layout, dkey)
        picks = self.cut.solve(sub_cost, mats, self.memo)
        before = after = 0.0
        if score:
            before, after = self._scores(sub_cost, mats, picks)
        return self._next_states(cands, picks), before, after

    def rounds(self) -> None:
        """One cut per prime factor of device_num, data inputs split as far as the round's
        axes allow."""
        problem, mesh, verts = self.problem, self.problem.mesh, self.problem.vertices
        for r, p in enumerate(prime_factors(mesh.device_num)):
            used = set(mesh.names[:r + 1])
            data_layout: dict[int, TensorLayout] = {}
            for i in self.data:
                lay = verts[i].choices[0].out_layouts[0]
                counts = tuple(mesh.size_of([a for a in d if a in used]) for d in lay.dims)
                data_layout[i] = TensorLayout(mesh.assign(counts) or lay.dims)
            self.op_state = self.cut_once(lambda i, cur, p=p: _candidates(problem, i, cur, p),
                                          data_layout, r)[0]

    def recuts(self) -> None:
        """Re-cuts: where each operator's factors went, revisited with the whole mesh known,
        while that lowers the objective; an operator may also take the splits another of its
        signature holds (:meth:`peers`). Where they stop, one replication cut: each operator
        that may repeat its work may stop splitting at all (:func:`_replicate`); if that
        lowers the objective, the re-cuts resume from there."""
        problem, verts, sig = self.problem, self.problem.vertices, self.problem._sig
        final_data = {i: verts[i].choices[0].out_layouts[0] for i in self.data}
        replicated = False
        for _ in range(_MAX_RECUTS):
            peers = self.peers()
            nxt, before, after = self.cut_once(
                lambda i, cur: _moves(problem, i, cur, peers.get(sig[verts[i].name], ())),
                final_data, "final", score=True, peers=peers)
            if not _lowers(before, after) and not replicated:
                replicated = True
                nxt, before, after = self.cut_once(
                    lambda i, cur: _replicate(problem, i, cur), final_data, "replicate",
                    score=True)
            if not _lowers(before, after):
                break
            self.op_state = nxt

    def peers(self) -> dict[int, tuple[Splits, ...]]:
        """Per signature held at more than one split vector, those split vectors (in state
        order): the rounds' ties can leave identical blocks of a network apart (at 16 blocks
        on 64 devices five blocks' attention ended on a cheaper layout than the others')."""
        held: dict[int, list[Splits]] = {}
        for st in np.unique(self.op_state).tolist():
            s, cur, _ = self.state_keys[st]
            held.setdefault(s, []).append(cur)
        return {s: tuple(v) for s, v in held.items() if len(v) > 1}

    def splits(self) -> dict[int, Splits]:
        return {i: self.state_keys[st][1] for i, st in zip(self.ops, self.op_state.tolist())}


def _lowers(before: float, after: float) -> bool:
    """Whether a cut's objective dropped by more than float noise."""
    return after < before - 1e-9 * abs(before)


def _edge_costs(problem: Problem, value: str, srcs: list[TensorLayout],
                dsts: list[TensorLayout]) -> np.ndarray:
    """[len(srcs), len(dsts)] ``Problem.edge_cost`` of ``value`` (``Problem._edge_costs``:
    at once (numpy) for many pairs, pair by pair for a few)."""
    return problem._edge_costs(value, srcs, dsts)


def _flatten(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                 np.ndarray]:
    """The distinct arrays of ``arrays`` (the blocks share them) raveled into one: (flat
    values, offset and columns of each distinct array, which distinct array each item is),
    so entries of every item are gathered at once."""
    ids: dict[int, int] = {}
    uniq: list[np.ndarray] = [np.zeros(0)]  # (one empty array: a cut may have no links)
    which = []
    for a in arrays:
        k = ids.get(id(a))
        if k is None:
            k = ids[id(a)] = len(uniq)
            uniq.append(a)
        which.append(k)
    sizes = np.array([a.size for a in uniq], dtype=np.int64)
    off = np.zeros(len(uniq), dtype=np.int64)
    np.cumsum(sizes[:-1], out=off[1:])
    cols = np.array([a.shape[-1] for a in uniq], dtype=np.int64)
    return (np.concatenate([a.ravel() for a in uniq]), off, cols,
            np.array(which, dtype=np.int64))


def _widen_parameters(problem: Problem) -> None:
    """Give every parameter vertex the layouts it has in the full problem: replicated plus
    every layout any strategy of its consumers reads it in (besides the settled ones), with
    their memory costs. A parameter may then be stored sharded more finely than its consumer
    reads it (gathered before use, its gradient reduce-scattered) when memory is priced —
    without this the last step only saw the consumers' settled layouts, and when the memory
    budget binds the plan kept whole copies that other modes shard (issue #4's 96 layers /
    8 devices case). The settled layouts: a settled lazy problem's consumers' own (its
    parameters keep no choices of their own: the choices are a sorted set, so these are
    simply added), else the parameter's current choices."""
    g, verts = problem.graph, problem.vertices
    wanted: dict[tuple, tuple[TensorLayout, ...]] = {}   # (consumer signature, input) -> layouts
    made: dict[tuple, tuple[list[Choice], dict]] = {}
    for v in g.parameters():
        spec = g.spec(v)
        vert = verts[problem.index[f"<param>{v}"]]
        keys, settled = [], {}
        for cname in g.consumers(v):
            cv = verts[problem.index[cname]]
            for j, inp in enumerate(cv.node.inputs):  # type: ignore[union-attr]
                if inp != v:
                    continue
                if problem.lazy:
                    settled[cv.choices[0].in_layouts[j]] = None
                key = (problem._sig[cname], j, cname in problem.fixed and cname)
                if key not in wanted:
                    wanted[key] = _read_layouts(problem, cv, j)
                keys.append(key)
        if not problem.lazy:
            settled = dict.fromkeys(c.out_layouts[0] for c in vert.choices)
        vkey = (spec.shape, spec.dtype, problem.requires_grad.get(v, False), tuple(keys),
                tuple(settled), problem.fixed_params.get(v))
        if vkey not in made:
            made[vkey] = problem.param_choice_set(v, (*settled, *(
                lay for key in keys for lay in wanted[key])))
        choices, arrays = made[vkey]
        vert.choices = list(choices)
        for name, arr in arrays.items():
            setattr(vert, name, arr)
    for e in problem.edges:  # matrices from parameters follow their new choice lists
        if verts[e.u].kind == "param":
            e._matrix = None


def _read_layouts(problem: Problem, consumer, j: int) -> tuple[TensorLayout, ...]:
    """The layouts operator ``consumer`` reads its input ``j`` in over its whole strategy
    space (or its fixed strategy), first-seen order: ``op_choice(node, s).in_layouts[j]``
    for each, built from the input's map and the canonical axes alone."""
    name = consumer.name
    if name in problem.loops:  # a loop node: the layouts its candidates read
        splits = [problem.fixed[name]] if name in problem.fixed else \
            problem.loops[name].candidates()
        return tuple(dict.fromkeys([problem._op_choice(name, s).in_layouts[j] for s in splits]
                                   + list(problem.loops[name].stored_layouts(j))))
    if name in problem.fixed:
        all_splits = [problem.fixed[name]]
    else:
        all_splits = enumerate_splits(problem.specs[name], problem.mesh.device_num,
                                      not problem.may_repeat(consumer.node))
    mp, assign = problem.specs[name].in_maps[j], problem.axes_of
    out: dict[TensorLayout, None] = {}
    for s in all_splits:
        axes = assign(s)
        out[TensorLayout(tuple(axes[m] if m is not None else () for m in mp))] = None
    return tuple(out)


def _settle(problem: Problem, splits: dict[int, Splits]) -> list[int]:
    """Picks with every operator at its splits (a lazy problem gets exactly those choices)."""
    if problem.lazy:  # (the parameters' choices are _widen_parameters')
        return problem.settle(splits, params=False)
    picks = [0] * len(problem.vertices)
    for i, s in splits.items():
        picks[i] = problem.choice_index(i, s)
    return picks


def solve(problem: Problem) -> list[int]:
    """One choice index per vertex of ``problem`` (see the module docstring).

    The cyclic garbage collector is paused meanwhile: the search allocates many small
    objects and no cycles, and full collections over a traced graph cost more than the cut."""
    with paused_gc():
        return _solve(problem)


def _solve(problem: Problem) -> list[int]:
    cuts = _Rounds(problem)
    cuts.rounds()
    cuts.recuts()
    picks = _settle(problem, cuts.splits())
    _widen_parameters(problem)
    problem.pick_parameters(picks)
    return picks
