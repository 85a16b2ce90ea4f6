"""recursive_programming: MindSpore's SAPP idea, linear in the graph size.

``device_num`` is cut in rounds, one prime factor (one mesh axis) per round: log2(devices)
two-way cuts for powers of two. In each round the operators are visited by weight (FLOPs,
heaviest first); each multiplies the split of one of its loop dimensions by the round's factor,
choosing the dimension with the least cost given its neighbours' current layouts (operator
cost + redistribution on its edges). Parameters then take the layout that is cheapest for
their consumers. Approximate but fast; the exact referee measures how far it is from optimal.
"""

from __future__ import annotations

import math

import numpy as np

from autopar.strategies.layout import prime_factors
from autopar.strategies.problem import Problem

__all__ = ["solve"]


def solve(problem: Problem) -> list[int]:
    g, mesh = problem.graph, problem.mesh
    verts = problem.vertices
    edges = problem.edges
    adj = problem.neighbours()
    ops = [i for i, v in enumerate(verts) if v.kind == "op"]
    fixed = {problem.index[name]: s for name, s in problem.fixed.items()}
    splits: dict[int, tuple[int, ...]] = {}
    for i in ops:
        splits[i] = fixed.get(i, tuple(1 for _ in problem.specs[verts[i].node.name].sizes))
    order = sorted((i for i in ops if i not in fixed),
                   key=lambda i: (-verts[i].node.flops, verts[i].node.name))

    def layout_of(i: int, out_index: int, s: tuple[int, ...]):
        return problem.op_choice(verts[i].node, s).out_layouts[out_index]

    def local_cost(i: int, s: tuple[int, ...]) -> float:
        node = verts[i].node
        c = problem.op_choice(node, s)
        compute, comm, sync, mem = problem.op_costs(node, c)
        total = compute + comm + sync + problem.memory_weight * mem
        for k in adj[i]:
            e = edges[k]
            if e.v == i:        # an input of i
                u = verts[e.u]
                if u.kind == "op":
                    src = layout_of(e.u, e.out_index, splits[e.u])
                elif u.kind == "data":
                    src = u.choices[0].out_layouts[0]
                else:
                    continue    # parameters follow their consumers
                total += problem.edge_cost(e.value, src, c.in_layouts[e.in_index])
            else:               # an output of i read by e.v
                dst = problem.op_choice(verts[e.v].node, splits[e.v]).in_layouts[e.in_index]
                total += problem.edge_cost(e.value, c.out_layouts[e.out_index], dst)
        return total

    for p in prime_factors(mesh.device_num):
        for i in order:
            spec = problem.specs[verts[i].node.name]
            cur = splits[i]
            limits = dict(spec.divides)
            best = None
            for d in range(len(cur)):
                new = cur[d] * p
                if not spec.splittable(d) or spec.sizes[d] % new or \
                        (d in limits and limits[d] % new) or \
                        mesh.device_num % math.prod(cur[:d] + (new,) + cur[d + 1:]) or \
                        mesh.assign(cur[:d] + (new,) + cur[d + 1:]) is None:
                    continue
                cand = cur[:d] + (new,) + cur[d + 1:]
                cost = local_cost(i, cand)
                if best is None or cost < best[0]:
                    best = (cost, cand)
            if best is not None:
                splits[i] = best[1]

    picks = [0] * len(verts)
    for i in ops:
        picks[i] = problem.choice_index(i, splits[i])
    for i, v in enumerate(verts):
        if v.kind != "param":
            continue
        total = v.cost.copy()
        for k in adj[i]:
            e = edges[k]
            total = total + e.matrix[:, picks[e.v]]
        picks[i] = int(np.argmin(total))
    return picks
