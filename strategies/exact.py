"""exact: the plan's price as an integer program, solved with scipy.optimize.milp (HiGHS).

Variables: ``x[v, s]`` (binary) picks choice s of vertex v; ``y[e, s, t]`` in [0, 1] is the
product ``x[u, s] * x[v, t]`` for edge e = (u, v), enforced by ``sum_t y[e, s, t] = x[u, s]``
and ``sum_s y[e, s, t] = x[v, t]`` (with binary x these make y the exact product).
Objective: ``sum cost[v, s] x[v, s]``, plus for a value read by one edge ``sum M_e[s, t]
y[e, s, t]``, and for a value read by several ``sum move[s, T] w[s, T]`` with ``w[s, T] >=
y[e, s, t]`` for every reading edge e and choice t that reads it in layout T: a value moved
to one layout is paid once, as the rewrite runs it and :meth:`Problem.evaluate
<autopar.strategies.problem.Problem.evaluate>` prices it. Optionally a memory budget
``sum memory[v, s] x[v, s] <= limit``. This is the referee that proves the other modes'
quality: their plans' price, solved to optimality.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autopar.errors import AutoParallelError
from autopar.strategies.problem import Problem

__all__ = ["SharedValue", "milp_picks", "solve"]


@dataclass
class SharedValue:
    """A value read by several edges, priced once per layout moved to: its maker ``u``, per
    reading edge (reader vertex, the target number each of the reader's choices reads it
    in) and the moves ``[len(u's choices), targets]`` (seconds)."""

    u: int
    reads: list[tuple[int, np.ndarray]]
    moves: np.ndarray


class _Program:
    """The integer program's columns (objective) and rows (constraints), built up."""

    def __init__(self, costs: Sequence[np.ndarray]) -> None:
        self.offs: list[int] = []
        n = 0
        for cv in costs:
            self.offs.append(n)
            n += len(cv)
        self.n, self.nx = n, n  # columns; the first nx pick choices (binary)
        self.c = [np.asarray(cv, dtype=np.float64) for cv in costs]
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def columns(self, cost: np.ndarray) -> int:
        off, self.n = self.n, self.n + cost.size
        self.c.append(cost.ravel())
        return off

    def row(self, cols: list[int], vals: list[float], lo: float, hi: float) -> None:
        r = len(self.lo)
        self.rows += [r] * len(cols)
        self.cols += cols
        self.vals += vals
        self.lo.append(lo)
        self.hi.append(hi)

    def product(self, u: int, v: int, m: np.ndarray) -> int:
        """Columns ``y[s, t] = x[u, s] * x[v, t]`` priced ``m``: ``sum_t y[s, t] = x[u, s]``
        and ``sum_s y[s, t] = x[v, t]`` (with binary x, y is then the exact product)."""
        off = self.columns(m)
        su, sv = m.shape
        for s in range(su):
            self.row(list(range(off + s * sv, off + (s + 1) * sv)) + [self.offs[u] + s],
                     [1.0] * sv + [-1.0], 0.0, 0.0)
        for t in range(sv):
            self.row(list(range(off + t, off + su * sv, sv)) + [self.offs[v] + t],
                     [1.0] * su + [-1.0], 0.0, 0.0)
        return off

    def shared(self, g: SharedValue, sizes: Sequence[int]) -> None:
        """A shared value: ``w[s, T]`` priced ``moves[s, T]`` is at least every reader's
        ``y[s, t]`` reading target T, so a move is paid once however many read it."""
        w = self.columns(g.moves)
        nt = g.moves.shape[1]
        for v, target in g.reads:
            y = self.product(g.u, v, np.zeros((sizes[g.u], sizes[v])))
            for s in range(sizes[g.u]):
                for t, tid in enumerate(target.tolist()):
                    if g.moves[s, tid]:
                        self.row([w + s * nt + tid, y + s * sizes[v] + t], [1.0, -1.0],
                                 0.0, np.inf)


def milp_picks(costs: Sequence[np.ndarray], edges: Sequence[tuple[int, int, np.ndarray]], *,
               shared: Sequence[SharedValue] = (),
               memory: Sequence[np.ndarray] | None = None, limit: float | None = None,
               time_limit: float | None = None) -> list[int]:
    """Exact choice per vertex for cost vectors, pairwise edge matrices and ``shared``
    values (each move paid once)."""
    if not costs:  # nothing to choose (a function of no input and no operator)
        return []
    # SciPy (0.3 s to import) only when an integer program is solved: every autopar command
    # imports the solver registry, few solve with the exact mode
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    prog = _Program(costs)
    for off, cv in zip(prog.offs, costs):          # one choice per vertex
        prog.row(list(range(off, off + len(cv))), [1.0] * len(cv), 1.0, 1.0)
    for (u, v, m) in edges:
        if np.any(m):  # (a zero matrix couples nothing)
            prog.product(u, v, m)
    for g in shared:
        if np.any(g.moves):
            prog.shared(g, [len(cv) for cv in costs])
    if memory is not None and limit is not None:
        cols = [off + k for off, mv in zip(prog.offs, memory) for k in range(len(mv))]
        prog.row(cols, [float(x) for mv in memory for x in mv], -np.inf, float(limit))
    a = coo_matrix((prog.vals, (prog.rows, prog.cols)), shape=(len(prog.lo), prog.n)).tocsr()
    integrality = np.zeros(prog.n)
    integrality[:prog.nx] = 1
    options = {"disp": False, "mip_rel_gap": 1e-9}
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    # seconds -> microseconds: HiGHS's absolute gap (1e-6) then cannot hide real differences
    res = milp(np.concatenate(prog.c) * 1e6,
               constraints=LinearConstraint(a, prog.lo, prog.hi), integrality=integrality,
               bounds=Bounds(0, 1), options=options)
    if res.x is None:
        raise AutoParallelError("search", "exact", f"the integer program found no solution "
                                f"({res.message}); the memory budget may be too small")
    x = res.x
    return [int(np.argmax(x[off:off + len(cv)])) for off, cv in zip(prog.offs, costs)]


def solve(problem: Problem, *, memory_limit: float | None = None,
          time_limit: float | None = None) -> list[int]:
    """The picks of least price: a value read by one edge priced by its matrix, one read
    by several by :class:`SharedValue` (each layout it is moved to paid once)."""
    verts = problem.vertices
    by_value: dict[str, list] = {}
    for e in problem.edges:
        by_value.setdefault(e.value, []).append(e)
    edges: dict[tuple[int, int], np.ndarray] = {}
    shared = []
    for value, es in by_value.items():
        if len(es) == 1:
            e = es[0]
            key = (e.u, e.v)
            edges[key] = edges[key] + e.matrix if key in edges else e.matrix
            continue
        e0 = es[0]
        index: dict = {}
        reads = [(e.v, np.array([index.setdefault(c.in_layouts[e.in_index], len(index))
                                 for c in verts[e.v].choices], dtype=np.int64)) for e in es]
        srcs = [c.out_layouts[e0.out_index] for c in verts[e0.u].choices]
        shared.append(SharedValue(e0.u, reads, problem._edge_costs(value, srcs, list(index))))
    return milp_picks([v.cost for v in verts], [(u, v, m) for (u, v), m in edges.items()],
                      shared=shared, memory=[v.memory for v in verts], limit=memory_limit,
                      time_limit=time_limit)
