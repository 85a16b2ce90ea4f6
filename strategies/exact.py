"""exact: the search objective as an integer program, solved with scipy.optimize.milp (HiGHS).

Variables: ``x[v, s]`` (binary) picks choice s of vertex v; ``y[e, s, t]`` in [0, 1] is the
product ``x[u, s] * x[v, t]`` for edge e = (u, v), enforced by ``sum_t y[e, s, t] = x[u, s]``
and ``sum_s y[e, s, t] = x[v, t]`` (with binary x these make y the exact product).
Objective: ``sum cost[v, s] x[v, s] + sum M_e[s, t] y[e, s, t]``; optionally a memory budget
``sum memory[v, s] x[v, s] <= limit``. This is the referee that proves the other modes'
quality: the same objective, solved to optimality.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from autopar.errors import AutoParallelError
from autopar.strategies.problem import Problem

__all__ = ["solve", "milp_picks"]


def milp_picks(costs: Sequence[np.ndarray], edges: Sequence[tuple[int, int, np.ndarray]], *,
               memory: Sequence[np.ndarray] | None = None, limit: float | None = None,
               time_limit: float | None = None) -> list[int]:
    """Exact choice per vertex for cost vectors and pairwise edge matrices."""
    if not costs:  # nothing to choose (a function of no input and no operator)
        return []
    # SciPy (0.3 s to import) only when an integer program is solved: every autopar command
    # imports the solver registry, few solve with the exact mode
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    offs, n = [], 0
    for c in costs:
        offs.append(n)
        n += len(c)
    nx = n
    edge_offs = []
    live_edges = []
    for (u, v, m) in edges:
        if not np.any(m):
            continue  # a zero matrix couples nothing
        edge_offs.append(n)
        live_edges.append((u, v, m))
        n += m.size
    c = np.zeros(n)
    for off, cv in zip(offs, costs):
        c[off:off + len(cv)] = cv
    for off, (_, _, m) in zip(edge_offs, live_edges):
        c[off:off + m.size] = m.ravel()
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    for off, cv in zip(offs, costs):          # one choice per vertex
        rows += [r] * len(cv)
        cols += list(range(off, off + len(cv)))
        vals += [1.0] * len(cv)
        lo.append(1.0)
        hi.append(1.0)
        r += 1
    for off, (u, v, m) in zip(edge_offs, live_edges):
        su, sv = m.shape
        for s in range(su):                    # sum_t y[s, t] - x[u, s] = 0
            rows += [r] * (sv + 1)
            cols += list(range(off + s * sv, off + (s + 1) * sv)) + [offs[u] + s]
            vals += [1.0] * sv + [-1.0]
            lo.append(0.0)
            hi.append(0.0)
            r += 1
        for t in range(sv):                    # sum_s y[s, t] - x[v, t] = 0
            rows += [r] * (su + 1)
            cols += list(range(off + t, off + su * sv, sv)) + [offs[v] + t]
            vals += [1.0] * su + [-1.0]
            lo.append(0.0)
            hi.append(0.0)
            r += 1
    if memory is not None and limit is not None:
        for off, mv in zip(offs, memory):
            rows += [r] * len(mv)
            cols += list(range(off, off + len(mv)))
            vals += list(map(float, mv))
        lo.append(-np.inf)
        hi.append(float(limit))
        r += 1
    a = coo_matrix((vals, (rows, cols)), shape=(r, n)).tocsr()
    integrality = np.zeros(n)
    integrality[:nx] = 1
    options = {"disp": False, "mip_rel_gap": 1e-9}
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    # seconds -> microseconds: HiGHS's absolute gap (1e-6) then cannot hide real differences
    res = milp(c * 1e6, constraints=LinearConstraint(a, lo, hi), integrality=integrality,
               bounds=Bounds(0, 1), options=options)
    if res.x is None:
        raise AutoParallelError("search", "exact", f"the integer program found no solution "
                                f"({res.message}); the memory budget may be too small")
    x = res.x
    return [int(np.argmax(x[off:off + len(cv)])) for off, cv in zip(offs, costs)]


def solve(problem: Problem, *, memory_limit: float | None = None,
          time_limit: float | None = None) -> list[int]:
    costs = [v.cost for v in problem.vertices]
    edges: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        key = (e.u, e.v)
        edges[key] = edges[key] + e.matrix if key in edges else e.matrix
    return milp_picks(costs, [(u, v, m) for (u, v), m in edges.items()],
                      memory=[v.memory for v in problem.vertices], limit=memory_limit,
                      time_limit=time_limit)

