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
graph, so the result is optimal under the cost model in every case.
"""

from __future__ import annotations

import heapq

import numpy as np

from autopar.strategies.problem import Problem

__all__ = ["solve"]

_CHUNK = 2_000_000  # floats per temporary in node elimination


def _eliminate_middle(a: np.ndarray, cx: np.ndarray, b: np.ndarray) -> tuple[np.ndarray,
                                                                              np.ndarray]:
    """min / argmin over t of a[s, t] + cx[t] + b[t, u]; chunked over s to bound memory."""
    sy, sx = a.shape
    sz = b.shape[1]
    if sy * sx * sz <= _CHUNK:
        t = a[:, :, None] + (cx[:, None] + b)[None, :, :]
        return t.min(axis=1), t.argmin(axis=1)
    best = np.empty((sy, sz))
    arg = np.empty((sy, sz), dtype=np.int32)
    step = max(1, _CHUNK // max(1, sx * sz))
    bc = cx[:, None] + b
    for lo in range(0, sy, step):
        t = a[lo:lo + step, :, None] + bc[None, :, :]
        arg[lo:lo + step] = t.argmin(axis=1)
        best[lo:lo + step] = np.take_along_axis(t, arg[lo:lo + step, None, :], axis=1)[:, 0, :]
    return best, arg


def solve(problem: Problem) -> list[int]:
    n = len(problem.vertices)
    cost = [v.cost.astype(np.float64).copy() for v in problem.vertices]
    adj: list[dict[int, np.ndarray]] = [dict() for _ in range(n)]  # adj[x][y]: [S_x, S_y]

    def add_edge(x: int, y: int, m: np.ndarray) -> None:
        if y in adj[x]:
            adj[x][y] = adj[x][y] + m
            adj[y][x] = adj[x][y].T
        else:
            adj[x][y] = m
            adj[y][x] = m.T

    for e in problem.edges:
        if e.u == e.v:  # a value consumed twice by its own producer cannot happen in a DAG
            continue
        add_edge(e.u, e.v, e.matrix)

    alive = [True] * n
    log: list[tuple] = []
    heap = [(len(adj[i]), i) for i in range(n)]
    heapq.heapify(heap)
    while heap:
        deg, x = heapq.heappop(heap)
        if not alive[x] or deg != len(adj[x]) or deg > 2:
            continue
        if deg == 0:
            continue  # a component's last vertex: chosen at the end
        if deg == 1:
            (y, m), = adj[x].items()            # m: [S_x, S_y]
            t = m.T + cost[x][None, :]          # [S_y, S_x]
            arg = t.argmin(axis=1)
            cost[y] = cost[y] + t[np.arange(t.shape[0]), arg]
            del adj[y][x]
            adj[x].clear()
            alive[x] = False
            log.append(("leaf", x, y, arg))
            heapq.heappush(heap, (len(adj[y]), y))
        else:
            (y, mx_y), (z, mx_z) = sorted(adj[x].items())
            best, arg = _eliminate_middle(mx_y.T, cost[x], mx_z)   # [S_y, S_z]
            del adj[y][x]
            del adj[z][x]
            adj[x].clear()
            alive[x] = False
            log.append(("node", x, y, z, arg))
            add_edge(y, z, best)
            heapq.heappush(heap, (len(adj[y]), y))
            heapq.heappush(heap, (len(adj[z]), z))

    picks = [-1] * n
    core = [i for i in range(n) if alive[i] and adj[i]]
    if core:
        from autopar.strategies.exact import solve_reduced

        sub = solve_reduced(core, cost, adj)
        for i, k in sub.items():
            picks[i] = k
    for i in range(n):
        if alive[i] and picks[i] < 0:
            picks[i] = int(np.argmin(cost[i]))
    for entry in reversed(log):
        if entry[0] == "leaf":
            _, x, y, arg = entry
            picks[x] = int(arg[picks[y]])
        else:
            _, x, y, z, arg = entry
            picks[x] = int(arg[picks[y], picks[z]])
    return picks
