"""Why a plan gives an operator its strategy: every strategy the operator could take, the rest
of the plan held, each priced whole.

The operator's alternatives are the strategies its search space holds (``full_use``: as the
search saw them); a loop node's, the candidate its plan holds (its other candidates are
body searches, not re-run here). For each, every other operator keeps the plan's splits,
the parameters take their cheapest layouts for the consumers as they then read them (as
every search mode ends), and the whole step is priced by :meth:`Problem.evaluate
<autopar.strategies.problem.Problem.evaluate>`, so an alternative's figures are the plan's
own had the search picked it: its compute, the communication it brings (its own
collectives, the redistributions on the values it reads and makes, the gradient syncs of
the parameters it reads) and the memory per device. The step is the plan's price (a value
moved to one layout counted once); the order and 'vs chosen' are the objective, that price
with memory priced in where it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.graph.ir import Graph
from autopar.strategies.cost import CostModel
from autopar.strategies.loops import PlannedLoops
from autopar.strategies.plan import Plan
from autopar.strategies.problem import Breakdown, Problem
from autopar.text import table as text_table

__all__ = ["Alternative", "Explanation", "alternatives"]


@dataclass(frozen=True)
class Alternative:
    """One strategy of the operator, priced with the rest of the plan held."""

    strategy: tuple[tuple[int, ...], ...]  # MindSpore: one tuple of split counts per input
    splits: tuple[int, ...]                # per loop dimension
    cost: Breakdown                        # the whole step's
    objective: float                       # the price, memory priced in where it was
    chosen: bool                           # the plan's own


def alternatives(graph: Graph, plan: Plan, node: str, cm: CostModel, *, full_use: bool,
                 dataset_strategy: Any) -> list[Alternative]:
    """Operator ``node``'s alternatives in ``plan`` (checked arguments: the entry point
    validates them), cheapest first (ties: the plan's own first, then by splits)."""
    held = {name: ns.splits for name, ns in plan.nodes.items() if name != node}
    mine = plan.nodes[node].splits
    for use in (full_use, False):  # (a plan's own strategy outside that space: all of them)
        problem = Problem(graph, plan.mesh, cm, dataset_strategy=dataset_strategy,
                          full_use=use, fixed_splits=held, **plan.pricing.problem_args(),
                          annotations=False,  # (an annotated operator's every alternative)
                          loops=PlannedLoops.of(plan))
        i = problem.index[node]
        if any(c.splits == mine for c in problem.vertices[i].choices):
            break
    out = []
    for k, choice in enumerate(problem.vertices[i].choices):
        picks = [0] * len(problem.vertices)  # (every other operator: its one choice)
        picks[i] = k
        problem.pick_parameters(picks)
        cost, objective = problem.evaluate(picks, peak=True)
        out.append(Alternative(choice.strategy(plan.mesh), choice.splits, cost, objective,
                               choice.splits == mine))
    out.sort(key=lambda a: (a.objective, not a.chosen, a.splits))
    return out


@dataclass(frozen=True)
class Explanation:
    """:func:`autopar.explain`'s answer: the operator's alternatives, cheapest first."""

    node: str
    op: str
    mode: str                       # the plan's
    cluster: str                    # the cost model that priced the alternatives
    rows: tuple[Alternative, ...]
    notes: tuple[str, ...] = ()

    @property
    def chosen(self) -> Alternative:
        return next(a for a in self.rows if a.chosen)

    def text(self, limit: int = 10) -> str:
        """A table of the ``limit`` cheapest alternatives (and the plan's own), in ms."""
        c = self.chosen
        lines = [f"{self.node} ({self.op}) takes {c.strategy} in plan[{self.mode}]: "
                 f"{len(self.rows)} strategies, the rest of the plan held, priced on "
                 f"{self.cluster}", *self.notes, ""]
        head = ("strategy", "step ms", "vs chosen", "compute", "communication",
                "redistribution", "gradient sync", "memory MiB")
        table = [head]
        shown = [a for k, a in enumerate(self.rows) if k < limit or a.chosen]
        for a in shown:
            b = a.cost
            table.append((str(a.strategy) + (" *" if a.chosen else ""), _ms(b.total),
                          f"{(a.objective - c.objective) * 1e3:+.4g}", _ms(b.compute),
                          _ms(b.communication), _ms(b.redistribution), _ms(b.gradient_sync),
                          f"{b.memory_bytes / 2**20:.4g}"))
        lines.append(text_table(table))
        if len(shown) < len(self.rows):
            lines.append(f"... {len(self.rows) - len(shown)} dearer strategies not shown")
        lines.append("(* the plan's; 'vs chosen': the objective the search minimised, "
                     "memory priced in where it was)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"
