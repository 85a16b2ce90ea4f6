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
work may also drop a factor or take one more) — priced on the whole mesh, and that cut is
again solved exactly, over all operators at once; repeated while it lowers the objective (a
few passes; 12-96 layers at 64 devices: within 0.02% of dynamic_programming). Approximate still (one factor moves per pass); the exact referee
measures how far from optimal it lands.

Speed: every round's cut problem has the same structure (operators and data inputs, one link
per consumed value), so the elimination order is found once (:class:`_Cut`); a round replays
it, and the arithmetic of each elimination is memoised on the identity of its input arrays
(:class:`_Memo`) — the identical blocks of a deep network share their cost vectors and edge
matrices, so most eliminations are computed once per round rather than once per block. The
picks are exactly dynamic_programming's (same operations on the same values, same ties).
Operators are handled per state (signature, splits): candidates, costs and edge matrices are
built once per distinct state, not per operator.
"""

from __future__ import annotations

import gc
import heapq
import math
from types import SimpleNamespace
from typing import Callable

import numpy as np

from autopar.strategies import dynamic_programming
from autopar.strategies.layout import Layout, prime_factors
from autopar.strategies.opspec import legal_splits
from autopar.strategies.problem import Choice, Problem, enumerate_splits

__all__ = ["solve"]

Splits = tuple[int, ...]


def _candidates(problem: Problem, i: int, cur: Splits, p: int) -> list[Splits]:
    """A round's options of operator ``i``: one loop dim's split times ``p`` (where legal),
    or ``cur`` when the operator may repeat its work (or nothing else is legal)."""
    spec = problem.specs[problem.vertices[i].node.name]
    out = []
    for d in range(len(cur)):
        new = cur[:d] + (cur[d] * p,) + cur[d + 1:]
        if legal_splits(spec, new, problem.mesh, (d,)):
            out.append(new)
    if not out or problem.may_repeat(problem.vertices[i].node):
        out.append(cur)  # not cutting: the operator repeats its work on this axis
    return out


_MAX_RECUTS = 16  # re-cut passes at most (each lowers the objective; a few suffice)


def _moves(problem: Problem, i: int, cur: Splits) -> list[Splits]:
    """``cur`` first, then every split that moves one prime factor of ``cur`` from one loop
    dimension to another (the same devices, one round's cut placed elsewhere); an operator
    that may repeat its work (as a round lets it keep its split) may also drop one factor or
    take one more. For example the (8, 1, 8) residual add of a transformer (batch 8, sequence,
    hidden) on 64 devices may become (4, 2, 8), (4, 1, 16), (8, 2, 4) or (8, 1, 8) again —
    never (16, 1, 4): its batch has 8 rows."""
    spec = problem.specs[problem.vertices[i].node.name]
    mesh = problem.mesh
    out = [cur]

    def offer(t: Splits, changed: tuple[int, ...]) -> None:
        if t not in out and legal_splits(spec, t, mesh, changed):
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
    return out


def _round_cost(problem: Problem, node, splits: tuple[int, ...]) -> float:
    """Operator cost of a candidate, plus what the parameters it reads cost in the layout it
    wants (parameters follow their consumers): their optimizer update, and their memory when
    memory is priced."""
    c = problem.op_choice(node, splits)
    compute, comm, sync, mem = problem.op_costs(node, c)
    g = problem.graph
    params = [(v, lay) for v, lay in zip(node.inputs, c.in_layouts)
              if g.values[v].kind == "param"]
    compute += sum(problem.param_update(v, lay) for v, lay in params)
    if problem.memory_weight:
        mem += sum(problem.param_memory(v, lay) for v, lay in params)
    return compute + comm + sync + problem.memory_weight * mem


class _Memo:
    """Results of the elimination arithmetic keyed by the identity of its input arrays.

    The blocks of a deep network give identical cost vectors and edge matrices (the very
    same cached objects), so most eliminations recur once per block and round: each is
    computed once. Every key's arrays are kept alive here, so an ``id`` is never reused
    while the memo lives; no array is ever modified in place."""

    def __init__(self) -> None:
        self.keep: list[object] = []
        self.sums: dict[tuple[int, int], np.ndarray] = {}
        self.trans: dict[int, np.ndarray] = {}
        self.leaf: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.node: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        key = (id(a), id(b))
        hit = self.sums.get(key)
        if hit is None:
            hit = self.sums[key] = a + b
            self.keep += (a, b)
        return hit

    def t(self, m: np.ndarray) -> np.ndarray:
        hit = self.trans.get(id(m))
        if hit is None:
            hit = m.T
            self.trans[id(m)] = hit
            self.trans[id(hit)] = m
            self.keep += (m, hit)
        return hit


class _Cut:
    """The structure of a round's cut problem, which every round shares: vertices (operators,
    then data inputs), links (one per consumed value), and the order in which
    :func:`dynamic_programming.solve` eliminates them — (x, y, -1) folds leaf x into y,
    (x, y, z) with y < z turns x into an edge y-z. That order depends on the structure only
    (degrees and indices), so it is found once instead of once per round."""

    def __init__(self, n: int, links: list[tuple[int, int]]) -> None:
        self.n, self.links = n, links
        groups: dict[tuple[int, int], list[tuple[int, bool]]] = {}
        for k, (u, v) in enumerate(links):  # parallel links are summed in link order
            if u != v:
                groups.setdefault((min(u, v), max(u, v)), []).append((k, u > v))
        self.groups = list(groups.items())
        single = [(key, ms[0][0]) for key, ms in self.groups if len(ms) == 1 and not ms[0][1]]
        self.single_keys = [key for key, _ in single]
        self.single_links = [k for _, k in single]
        self.multi = [(key, ms) for key, ms in self.groups if len(ms) > 1 or ms[0][1]]
        adj: list[set[int]] = [set() for _ in range(n)]
        for lo, hi in groups:
            adj[lo].add(hi)
            adj[hi].add(lo)
        alive = [True] * n
        heap = [(len(adj[i]), i) for i in range(n)]
        heapq.heapify(heap)
        steps: list[tuple[int, int, int]] = []
        while heap:
            deg, x = heapq.heappop(heap)
            if not alive[x] or deg != len(adj[x]) or deg > 2 or deg == 0:
                continue
            alive[x] = False
            if deg == 1:
                (y,) = adj[x]
                adj[y].discard(x)
                adj[x].clear()
                steps.append((x, y, -1))
                heapq.heappush(heap, (len(adj[y]), y))
            else:
                y, z = sorted(adj[x])
                adj[y].discard(x)
                adj[z].discard(x)
                adj[x].clear()
                steps.append((x, y, z))
                adj[y].add(z)
                adj[z].add(y)
                heapq.heappush(heap, (len(adj[y]), y))
                heapq.heappush(heap, (len(adj[z]), z))
        self.steps = steps
        self.reduces = not any(adj)  # no irreducible core left for the integer program
        self.eliminated = {x for x, _, _ in steps}


def _eliminate(cut: _Cut, costs: list[np.ndarray], mats: list[np.ndarray],
               memo: _Memo) -> list[int]:
    """:func:`dynamic_programming.solve` on one round's cut problem (vertex costs, one
    matrix per link), replaying the precomputed order with memoised arithmetic: the same
    operations on the same values, hence the same picks."""
    if not cut.reduces:  # a core for the integer program: the general solver
        sub_v = [SimpleNamespace(cost=c) for c in costs]
        sub_e = [SimpleNamespace(u=u, v=v, matrix=m) for (u, v), m in zip(cut.links, mats)]
        return dynamic_programming.solve(SimpleNamespace(vertices=sub_v, edges=sub_e))
    add, t, keep = memo.add, memo.t, memo.keep
    pair = dict(zip(cut.single_keys, [mats[k] for k in cut.single_links]))  # (lo, hi) ->
    for key, members in cut.multi:                                          # [S_lo, S_hi]
        acc = None
        for k, flip in members:  # parallel links summed in link order
            m = t(mats[k]) if flip else mats[k]
            acc = m if acc is None else add(acc, m)
        pair[key] = acc  # type: ignore[assignment]
    cost = list(costs)
    log: list[tuple[int, int, int, np.ndarray]] = []
    leaf_memo, node_memo = memo.leaf, memo.node
    for x, y, z in cut.steps:
        a = pair[x, y] if x < y else t(pair[y, x])      # [S_x, S_y]
        cx = cost[x]
        if z < 0:  # leaf: cost[y] += min over x of (a^T + cost[x])
            key = (id(a), id(cx))
            hit = leaf_memo.get(key)
            if hit is None:
                s = t(a) + cx[None, :]                 # [S_y, S_x]
                hit = leaf_memo[key] = (s.min(axis=1), s.argmin(axis=1))
                keep += (a, cx)
            cost[y] = add(cost[y], hit[0])
        else:      # middle: edge y-z = min over x of (a^T + cost[x] + b)
            b = pair[x, z] if x < z else t(pair[z, x])  # [S_x, S_z]
            key3 = (id(a), id(cx), id(b))
            hit = node_memo.get(key3)
            if hit is None:
                if a.size * b.shape[1] > dynamic_programming._CHUNK:
                    hit = dynamic_programming._eliminate_middle(t(a), cx, b)
                else:  # the same arithmetic, inline for the small matrices of a cut
                    s3 = t(a)[:, :, None] + (cx[:, None] + b)[None, :, :]
                    hit = (s3.min(axis=1), s3.argmin(axis=1))
                node_memo[key3] = hit
                keep += (a, cx, b)
            old = pair.get((y, z))
            pair[y, z] = hit[0] if old is None else add(old, hit[0])
        log.append((x, y, z, hit[1]))
    picks = [-1] * cut.n
    for i in range(cut.n):
        if i not in cut.eliminated:
            picks[i] = int(np.argmin(cost[i]))
    for x, y, z, arg in reversed(log):
        picks[x] = int(arg[picks[y]]) if z < 0 else int(arg[picks[y], picks[z]])
    return picks


def _widen_parameters(problem: Problem) -> None:
    """Give every parameter vertex the layouts it has in the full problem: replicated plus
    every layout any strategy of its consumers reads it in (besides the settled ones), with
    their memory costs. A parameter may then be stored sharded more finely than its consumer
    reads it (gathered before use, its gradient reduce-scattered) when memory is priced —
    without this the last step only saw the consumers' settled layouts, and when the memory
    budget binds the plan kept whole copies that other modes shard (issue #4's 96 layers /
    8 devices case)."""
    g, mesh, verts = problem.graph, problem.mesh, problem.vertices
    wanted: dict[tuple, tuple[Layout, ...]] = {}   # (consumer signature, input) -> layouts
    made: dict[tuple, tuple[list[Choice], dict]] = {}
    for v in g.parameters():
        spec = g.spec(v)
        keys = []
        for cname in g.consumers(v):
            node = verts[problem.index[cname]].node
            for j, inp in enumerate(node.inputs):  # type: ignore[union-attr]
                if inp != v:
                    continue
                key = (problem._sig[cname], j, cname in problem.fixed and cname)
                if key not in wanted:
                    if cname in problem.fixed:
                        all_splits = [problem.fixed[cname]]
                    else:
                        all_splits = enumerate_splits(problem.specs[cname], mesh.device_num,
                                                      not problem.may_repeat(node))
                    wanted[key] = tuple(dict.fromkeys(problem.op_choice(node, s).in_layouts[j]
                                                      for s in all_splits))
                keys.append(key)
        vert = verts[problem.index[f"<param>{v}"]]
        settled = tuple(c.out_layouts[0] for c in vert.choices)
        vkey = (spec.shape, spec.dtype, problem.requires_grad.get(v, False), tuple(keys),
                settled)
        if vkey not in made:
            made[vkey] = problem.param_choice_set(v, settled + tuple(
                lay for key in keys for lay in wanted[key]))
        choices, arrays = made[vkey]
        vert.choices = list(choices)
        for name, arr in arrays.items():
            setattr(vert, name, arr)
    for e in problem.edges:  # matrices from parameters follow their new choice lists
        if verts[e.u].kind == "param":
            e._matrix = None


def solve(problem: Problem) -> list[int]:
    """One choice index per vertex of ``problem`` (see the module docstring).

    The cyclic garbage collector is paused meanwhile: the search allocates many small
    objects and no cycles, and full collections over a traced graph cost more than the cut."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _solve(problem)
    finally:
        if enabled:
            gc.enable()


def _solve(problem: Problem) -> list[int]:
    verts, edges, mesh = problem.vertices, problem.edges, problem.mesh
    sig = problem._sig
    ops = [i for i, v in enumerate(verts) if v.kind == "op"]
    data = [i for i, v in enumerate(verts) if v.kind == "data"]
    fixed = {problem.index[name]: s for name, s in problem.fixed.items()}
    nops = len(ops)
    # the round's cut problem: operators first (position j), then data inputs
    local = {i: k for k, i in enumerate(ops + data)}
    links = [e for e in edges if verts[e.u].kind != "param"]  # parameters follow at the end
    cut = _Cut(len(local), [(local[e.u], local[e.v]) for e in links])
    # an operator's state: (signature, splits, fixed); operators in one state have the same
    # candidates, costs and edge matrices in every round (costs are cached by signature)
    state_keys: list[tuple] = []
    state_id: dict[tuple, int] = {}

    def intern(key: tuple) -> int:
        k = state_id.get(key)
        if k is None:
            k = state_id[key] = len(state_keys)
            state_keys.append(key)
        return k

    rep: dict[int, int] = {}  # state -> one operator in it
    op_state = np.empty(nops, dtype=np.int64)
    for j, i in enumerate(ops):
        name = verts[i].node.name  # type: ignore[union-attr]
        s = fixed.get(i, tuple(1 for _ in problem.specs[name].sizes))
        op_state[j] = k = intern((sig[name], s, i in fixed))
        rep.setdefault(k, i)
    # op -> op links by (producer signature, output, consumer signature, input): with the
    # two ends' candidate lists, that decides the matrix
    link_kinds: dict[tuple, int] = {}
    op_links, data_links = [], []
    for k, e in enumerate(links):
        if verts[e.u].kind == "op":
            code = link_kinds.setdefault((sig[verts[e.u].name], e.out_index, sig[verts[e.v].name],
                                          e.in_index), len(link_kinds))
            op_links.append((k, local[e.u], local[e.v], code))
        else:
            data_links.append((k, e))
    lk = np.array([x[0] for x in op_links], dtype=np.int64)
    lu = np.array([x[1] for x in op_links], dtype=np.int64)
    lv = np.array([x[2] for x in op_links], dtype=np.int64)
    lcode = np.array([x[3] for x in op_links], dtype=np.int64)
    memo = _Memo()
    no_cost = np.zeros(1)
    interned: dict[tuple, int] = {}   # candidate lists -> small ints
    cost_cache: dict[tuple, np.ndarray] = {}
    cache: dict[tuple, np.ndarray] = {}
    wide = 1 << 20  # link kinds and candidate-list ids stay far below this
    def cut_once(candidates: Callable[[int, tuple[int, ...]], list[tuple[int, ...]]],
                 data_layout: dict[int, Layout], dkey: object,
                 score: bool = False) -> tuple[np.ndarray, float, float]:
        """Solve one cut exactly: every operator picks one of ``candidates(op, splits)``.
        Returns the operators' next states and, with ``score``, the cut's objective at
        candidate 0 of every operator (its current splits, for a re-cut) and at the picks."""
        uniq = np.unique(op_state).tolist()
        cands: dict[int, list[tuple[int, ...]]] = {}
        cid_of = np.zeros(len(state_keys), dtype=np.int64)
        cost_of: dict[int, np.ndarray] = {}
        for st in uniq:
            s, cur, is_fixed = state_keys[st]
            i = rep[st]
            cs = [cur] if is_fixed else candidates(i, cur)
            c = interned.setdefault(tuple(cs), len(interned))
            cost = cost_cache.get((s, c))
            if cost is None:
                cost = np.array([_round_cost(problem, verts[i].node, x) for x in cs])
                cost_cache[s, c] = cost
            cands[st], cid_of[st], cost_of[st] = cs, c, cost
        states = op_state.tolist()
        sub_cost = [cost_of[st] for st in states] + [no_cost] * len(data)
        mats = np.empty(len(links), dtype=object)
        if len(lk):
            cid = cid_of[op_state]
            codes = (lcode * wide + cid[lu]) * wide + cid[lv]
            ucodes, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
            umats = np.empty(len(ucodes), dtype=object)
            for n, (code, f) in enumerate(zip(ucodes.tolist(), first.tolist())):
                m = cache.get(code)
                if m is None:
                    e = links[int(lk[f])]
                    cu = [problem.op_choice(verts[e.u].node, x).out_layouts[e.out_index]
                          for x in cands[states[int(lu[f])]]]
                    cv = [problem.op_choice(verts[e.v].node, x).in_layouts[e.in_index]
                          for x in cands[states[int(lv[f])]]]
                    m = cache[code] = np.array([[problem.edge_cost(e.value, a, b) for b in cv]
                                                for a in cu])
                umats[n] = m
            mats[lk] = umats[inverse.reshape(-1)]
        for k, e in data_links:
            key = ((e.value, dkey), e.out_index, sig[verts[e.v].name], e.in_index,
                   int(cid_of[states[local[e.v]]]))
            m = cache.get(key)
            if m is None:
                cv = [problem.op_choice(verts[e.v].node, x).in_layouts[e.in_index]
                      for x in cands[states[local[e.v]]]]
                m = cache[key] = np.array([[problem.edge_cost(e.value, data_layout[e.u], b)
                                            for b in cv]])
            mats[k] = m
        mat_list = mats.tolist()
        picks = _eliminate(cut, sub_cost, mat_list, memo)
        before = after = 0.0
        if score:
            before = sum(float(c[0]) for c in sub_cost) + sum(float(m[0, 0]) for m in mat_list)
            after = sum(float(c[x]) for c, x in zip(sub_cost, picks)) + \
                sum(float(m[picks[u], picks[v]]) for (u, v), m in zip(cut.links, mat_list))
        # each operator's next state: its candidate at the pick
        span = 1 + max(len(cs) for cs in cands.values())
        moves = op_state * span + np.array(picks[:nops], dtype=np.int64)
        umoves, inverse = np.unique(moves, return_inverse=True)
        nxt = []
        for mv in umoves.tolist():
            st, k = divmod(mv, span)
            nxt.append(intern((state_keys[st][0], cands[st][k], state_keys[st][2])))
            rep.setdefault(nxt[-1], rep[st])
        return np.array(nxt, dtype=np.int64)[inverse.reshape(-1)], before, after

    for r, p in enumerate(prime_factors(mesh.device_num)):
        used = set(mesh.names[:r + 1])
        data_layout: dict[int, Layout] = {}
        for i in data:
            lay = verts[i].choices[0].out_layouts[0]
            counts = tuple(mesh.size_of([a for a in d if a in used]) for d in lay.dims)
            data_layout[i] = Layout(mesh.assign(counts) or lay.dims)
        op_state = cut_once(lambda i, cur, p=p: _candidates(problem, i, cur, p),
                            data_layout, r)[0]
    # re-cuts: where each operator's factors went, revisited with the whole mesh known
    final_data = {i: verts[i].choices[0].out_layouts[0] for i in data}
    for _ in range(_MAX_RECUTS):
        nxt, before, after = cut_once(lambda i, cur: _moves(problem, i, cur), final_data,
                                      "final", score=True)
        if not after < before - 1e-9 * abs(before):
            break
        op_state = nxt

    splits = {i: state_keys[st][1] for i, st in zip(ops, op_state.tolist())}
    if problem.lazy:
        picks_all = problem.settle(splits)
    else:
        picks_all = [0] * len(verts)
        for i in ops:
            picks_all[i] = problem.choice_index(i, splits[i])
    _widen_parameters(problem)
    # parameters: the layout cheapest for their consumers (a parameter only ever produces)
    reads: dict[int, list[int]] = {}
    for k, e in enumerate(edges):
        if verts[e.u].kind == "param":
            reads.setdefault(e.u, []).append(k)
    for i, v in enumerate(verts):
        if v.kind != "param":
            continue
        total = v.cost.copy()
        for k in reads.get(i, ()):
            e = edges[k]
            total = total + e.vector(at="u", other=picks_all[e.v])
        picks_all[i] = int(np.argmin(total))
    return picks_all
