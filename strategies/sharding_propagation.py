"""sharding_propagation: start from the operators whose strategies are fixed, spread outward.

Breadth-first from the fixed operators (``fixed=`` or annotations): each newly reached vertex
takes the choice with the least operator cost plus redistribution cost on its edges to the
vertices already decided. Vertices no path reaches are decided last the same way. An error if
nothing is fixed: propagation needs a start, as in MindSpore.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from autopar.errors import AutoParallelError
from autopar.strategies.problem import Problem

__all__ = ["solve"]


def solve(problem: Problem) -> list[int]:
    verts, edges = problem.vertices, problem.edges
    adj = problem.adjacency()
    seeds = sorted(problem.index[name] for name in problem.fixed)
    if not seeds:
        raise AutoParallelError(
            "search_mode", "sharding_propagation", "propagation needs at least one operator "
            "with a fixed strategy", "Pass fixed={node name: strategy} to autopar.search "
            "(`autopar search --fix NODE=STRATEGY`), or annotate operators with autopar.shard / "
            "autopar.matmul(strategy=...)")
    picks = [-1] * len(verts)
    for i, v in enumerate(verts):
        if len(v.choices) == 1:
            picks[i] = 0
    queue = deque(seeds)

    def decide(i: int) -> None:
        total = verts[i].cost.copy()
        for k in adj[i]:
            e = edges[k]
            if e.u == i and picks[e.v] >= 0:
                total = total + e.vector(at="u", other=picks[e.v])
            elif e.v == i and picks[e.u] >= 0:
                total = total + e.vector(at="v", other=picks[e.u])
        picks[i] = int(np.argmin(total))

    def spread() -> None:
        while queue:
            i = queue.popleft()
            nbrs = sorted({edges[k].u if edges[k].v == i else edges[k].v for k in adj[i]})
            for j in nbrs:
                if picks[j] < 0:
                    decide(j)
                    queue.append(j)

    spread()
    for i in range(len(verts)):   # parts no fixed operator reaches
        if picks[i] < 0:
            decide(i)
            queue.append(i)
            spread()
    return picks
