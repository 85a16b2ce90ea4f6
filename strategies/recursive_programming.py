"""recursive_programming: MindSpore's recursive (SAPP) idea — one cut per round, linear time.

``device_num`` is cut in rounds, one prime factor (one mesh axis) per round: log2(devices)
two-way cuts for powers of two. In a round every operator may multiply the split of one of its
loop dimensions by the round's factor, or — where the strategy space allows repeated work
(small operators, or ``fully_use_devices=False``) — keep its split. Where
SAPP visits operators greedily by weight, autopar solves each round's small cut problem —
at most (dims + 1) options per operator — exactly with the graph elimination of
:mod:`dynamic_programming`; with so few options per operator that is linear in the graph size,
and it avoids the greedy visit's inconsistent cuts between neighbours (ties go to the lower
loop dimension). Parameters finally take the layout cheapest for their consumers. Approximate (a cut chosen early is never revisited); the exact referee measures how
far from optimal it lands.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from autopar.strategies import dynamic_programming
from autopar.strategies.layout import Layout, prime_factors
from autopar.strategies.problem import Problem

__all__ = ["solve"]


def _candidates(problem: Problem, i: int, cur: tuple[int, ...], p: int) -> list[tuple[int, ...]]:
    spec = problem.specs[problem.vertices[i].node.name]
    limits = dict(spec.divides)
    mesh = problem.mesh
    out = []
    for d in range(len(cur)):
        new = cur[:d] + (cur[d] * p,) + cur[d + 1:]
        if spec.splittable(d) and spec.sizes[d] % new[d] == 0 and \
                (d not in limits or limits[d] % new[d] == 0) and \
                mesh.device_num % math.prod(new) == 0 and mesh.assign(new) is not None:
            out.append(new)
    if not out or problem.may_repeat(problem.vertices[i].node):
        out.append(cur)  # not cutting: the operator repeats its work on this axis
    return out


def _round_cost(problem: Problem, node, splits: tuple[int, ...]) -> float:
    """Operator cost of a candidate, plus the memory of the parameters it reads in the
    layout it wants (parameters follow their consumers), when memory is priced."""
    c = problem.op_choice(node, splits)
    compute, comm, sync, mem = problem.op_costs(node, c)
    if problem.memory_weight:
        g = problem.graph
        mem += sum(problem.param_memory(v, lay)
                   for v, lay in zip(node.inputs, c.in_layouts) if g.values[v].kind == "param")
    return compute + comm + sync + problem.memory_weight * mem


def solve(problem: Problem) -> list[int]:
    verts, edges, mesh = problem.vertices, problem.edges, problem.mesh
    ops = [i for i, v in enumerate(verts) if v.kind == "op"]
    fixed = {problem.index[name]: s for name, s in problem.fixed.items()}
    splits = {i: fixed.get(i, tuple(1 for _ in problem.specs[verts[i].node.name].sizes))
              for i in ops}
    factors = prime_factors(mesh.device_num)
    cache: dict[tuple, np.ndarray] = {}
    cand_cache: dict[tuple, list[tuple[int, ...]]] = {}
    cost_cache: dict[tuple, np.ndarray] = {}
    sig = problem._sig
    interned: dict[tuple, int] = {}   # candidate lists -> small ints, cheap in cache keys
    data = [i for i, v in enumerate(verts) if v.kind == "data"]
    links = [(e, sig[verts[e.u].name] if verts[e.u].kind == "op" else None,
              sig[verts[e.v].name]) for e in edges if verts[e.u].kind != "param"]
    for r, p in enumerate(factors):
        used = set(mesh.names[:r + 1])
        cands = {}
        for i in ops:
            if i in fixed:
                cands[i] = [splits[i]]
                continue
            key = (sig[verts[i].name], splits[i], p)
            if key not in cand_cache:
                cand_cache[key] = _candidates(problem, i, splits[i], p)
            cands[i] = cand_cache[key]
        sub_v, sub_e, local = [], [], {}
        cid = {i: interned.setdefault(tuple(cands[i]), len(interned)) for i in ops}
        for i in ops:
            node = verts[i].node
            key = (sig[node.name], cid[i])
            cost = cost_cache.get(key)
            if cost is None:
                cost = np.array([_round_cost(problem, node, s) for s in cands[i]])
                cost_cache[key] = cost
            local[i] = len(sub_v)
            sub_v.append(SimpleNamespace(cost=cost))
        data_layout: dict[int, Layout] = {}
        for i in data:
            lay = verts[i].choices[0].out_layouts[0]
            counts = tuple(mesh.size_of([a for a in d if a in used]) for d in lay.dims)
            data_layout[i] = Layout(mesh.assign(counts) or lay.dims)
            local[i] = len(sub_v)
            sub_v.append(SimpleNamespace(cost=np.zeros(1)))
        for e, su, sv in links:  # parameters follow their consumers at the end
            src_key = (e.value, r) if su is None else (su, cid[e.u])
            key = (src_key, e.out_index, sv, e.in_index, cid[e.v])
            m = cache.get(key)
            if m is None:
                cu = [data_layout[e.u]] if e.u in data_layout else [
                    problem.op_choice(verts[e.u].node, s).out_layouts[e.out_index]
                    for s in cands[e.u]]
                cv = [problem.op_choice(verts[e.v].node, s).in_layouts[e.in_index]
                      for s in cands[e.v]]
                m = np.array([[problem.edge_cost(e.value, a, b) for b in cv] for a in cu])
                cache[key] = m
            sub_e.append(SimpleNamespace(u=local[e.u], v=local[e.v], matrix=m))
        picks = dynamic_programming.solve(SimpleNamespace(vertices=sub_v, edges=sub_e))
        for i in ops:
            splits[i] = cands[i][picks[local[i]]]

    if problem.lazy:
        picks_all = problem.settle(splits)
    else:
        picks_all = [0] * len(verts)
        for i in ops:
            picks_all[i] = problem.choice_index(i, splits[i])
    adj = problem.neighbours()
    for i, v in enumerate(verts):
        if v.kind != "param":
            continue
        total = v.cost.copy()
        for k in adj[i]:
            e = edges[k]
            total = total + e.vector(at="u", other=picks_all[e.v])
        picks_all[i] = int(np.argmin(total))
    return picks_all
