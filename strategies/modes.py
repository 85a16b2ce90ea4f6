"""The modes, in one place: who chooses the strategies (parallel modes) and, under
``auto_parallel``, which solver searches them (search modes).

The context's validation, the search, the strategy files, the CLI and the mode comparison all
read these tables, so a solver registered here is a ``search_mode`` everywhere at once.

A solver is a record: its ``solve(problem) -> picks`` and the two ways solvers differ in how
the search drives them (data, not special cases in the search):

- ``lazy_choices``: it builds each operator's choices itself, round by round, so the problem
  is built without the full choice lists;
- ``memory_constraint``: it takes the memory budget as a hard constraint
  (``solve(problem, memory_limit=...)``), so the search does not re-price memory and retry;
- ``polish``: it minimises every edge's entry, an upper bound of the price, so its plan is
  then polished under the price (:func:`~autopar.strategies.shared_moves.polish`), with
  ``moves`` its neighbourhood (None: every choice of the vertex);
- ``starts``: more plans to polish the same way (other objectives than the edge sum); the
  cheapest under the price is kept, the solve's own on a tie.

>>> SEARCH_MODES
('recursive_programming', 'dynamic_programming', 'sharding_propagation', 'exact')
>>> SOLVERS["exact"].memory_constraint, DEFAULT_SEARCH_MODE
(True, 'dynamic_programming')
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

from autopar.strategies import (dynamic_programming, exact, recursive_programming,
                                sharding_propagation)
from autopar.strategies.shared_moves import Neighbourhood, polish

__all__ = ["DEFAULT_PARALLEL_MODE", "DEFAULT_SEARCH_MODE", "PARALLEL_MODES", "PIPELINE_MODES",
           "SEARCH_MODES",
           "SOLVERS", "Solver", "USES_PARAMETER_PLANS", "USES_STRATEGY_FILES",
           "USES_USER_STRATEGIES"]


@dataclass(frozen=True)
class Solver:
    """One search mode."""

    name: str
    solve: Callable[..., list[int]]
    summary: str
    lazy_choices: bool = False
    memory_constraint: bool = False
    polish: bool = False
    moves: Neighbourhood | None = None
    starts: tuple[Callable[[Any], list[int]], ...] = ()

    def picks(self, problem: Any, memory_limit: float) -> list[int]:
        """The solver's pick per vertex of ``problem``."""
        if self.memory_constraint:
            return self.solve(problem, memory_limit=memory_limit)
        picks = self.solve(problem)
        if not self.polish:
            return picks
        best = polish(problem, picks, self.moves)
        if not self.starts:
            return best
        price = problem.evaluate(best)[1]
        for start in self.starts:
            began = start(problem)
            if began == picks:  # (the same start polishes to the same plan)
                continue
            other = polish(problem, began, self.moves)
            other_price = problem.evaluate(other)[1]
            if other_price < price:
                best, price = other, other_price
        return best


#: The note a plan of dynamic_programming gets when its core was too large to solve exactly.
CORE_FALLBACK_NOTE = (
    "dynamic_programming: the core the elimination leaves ({columns:,} integer-program "
    "columns) is over its bound ({bound:,}): planned from recursive_programming's cuts "
    "instead, then polished (not proven optimal)")


def _dp_fallback(problem: Any) -> list[int] | None:
    """recursive_programming's picks where ``problem``'s core is over
    :data:`~autopar.strategies.dynamic_programming.CORE_COLUMNS` (an integer program that
    grows with depth: RoPE's slice -> mul -> concatenate diamonds, whose tables every block
    reads), noted in the solver's cache; None where the core solves exactly."""
    columns = dynamic_programming.core_columns(problem)
    bound = dynamic_programming.CORE_COLUMNS
    if columns <= bound:
        return None
    kept = problem.solver_cache("dynamic_programming")
    note = CORE_FALLBACK_NOTE.format(columns=columns, bound=bound)
    if note not in kept.setdefault("notes", []):
        kept["notes"].append(note)
    last = kept.get("fallback")  # (the solve and the second start: one set of cuts)
    if last is not None and last[0]() is problem:
        return list(last[1])
    picks = recursive_programming.solve(problem)
    kept["fallback"] = (weakref.ref(problem), list(picks))
    return picks


def _dp_solve(problem: Any) -> list[int]:
    """dynamic_programming's solve, or its fallback (:func:`_dp_fallback`)."""
    picks = _dp_fallback(problem)
    return dynamic_programming.solve(problem) if picks is None else picks


def _dp_solve_shared(problem: Any) -> list[int]:
    """dynamic_programming's second start, or its fallback (:func:`_dp_fallback`)."""
    picks = _dp_fallback(problem)
    return dynamic_programming.solve_shared(problem) if picks is None else picks


SOLVERS: dict[str, Solver] = {s.name: s for s in (
    Solver("recursive_programming", recursive_programming.solve,
           "one prime factor of device_num per round (SAPP); for very large graphs or devices",
           lazy_choices=True, polish=True, moves=recursive_programming.neighbourhood),
    Solver("dynamic_programming", _dp_solve,
           "eliminations plus an exact solve of the core (recursive_programming's cuts where "
           "the core is too large), then shared moves priced once (from it and from the "
           "solve with each move shared by its readers)",
           polish=True, starts=(_dp_solve_shared,)),
    Solver("sharding_propagation", sharding_propagation.solve,
           "propagates the fixed strategies to their neighbours (needs at least one)"),
    Solver("exact", exact.solve,
           "integer program (HiGHS), memory as a hard constraint: the referee",
           memory_constraint=True),
)}
SEARCH_MODES: tuple[str, ...] = tuple(SOLVERS)
DEFAULT_SEARCH_MODE = "dynamic_programming"

#: MindSpore's parallel modes, in its order.
PARALLEL_MODES: tuple[str, ...] = ("stand_alone", "data_parallel", "hybrid_parallel",
                                   "semi_auto_parallel", "auto_parallel")
DEFAULT_PARALLEL_MODE = "stand_alone"
#: The modes that honour the user's strategies (``fixed=``, annotations).
USES_USER_STRATEGIES: tuple[str, ...] = ("hybrid_parallel", "semi_auto_parallel",
                                         "auto_parallel")
#: The modes that store parameters as a ``parameter_plan`` says: every one with more than one
#: device (data parallel too: a parameter stored split, gathered where it is read).
USES_PARAMETER_PLANS: tuple[str, ...] = tuple(m for m in PARALLEL_MODES if m != "stand_alone")
#: The modes a pipelined step (pipeline_stages > 1) runs under.
PIPELINE_MODES: tuple[str, ...] = ("semi_auto_parallel", "auto_parallel")
#: The modes whose plans strategy files load and save (MindSpore's rule).
USES_STRATEGY_FILES: tuple[str, ...] = ("semi_auto_parallel", "auto_parallel")
