"""Inspecting a lowered program: its StableHLO text, its compiled text, its collectives.

The one base of autopar's three compiled objects
(:class:`autopar.parallel_function.ParallelFunction`,
:class:`autopar.train.TrainStep`, :class:`autopar.pipeline.step.PipelineTrainStep`): each
says how it lowers its program for given arguments (``lower(*args)``, a
``jax.stages.Lowered``), and :class:`ProgramInspection` derives the rest from that, the same
way for all three.

>>> count_collectives('%0 = "stablehlo.all_reduce"(%a) ... "stablehlo.all_gather"(%b)')
{'all_reduce': 1, 'reduce_scatter': 0, 'all_gather': 1, 'all_to_all': 0, 'collective_permute': 0}
"""

from __future__ import annotations

import re
from typing import Any

from autopar.strategies.cost import COLLECTIVE_KINDS

__all__ = ["COLLECTIVES", "ProgramInspection", "count_collectives"]

COLLECTIVES = COLLECTIVE_KINDS  # the cost model's kinds: what the lowered text is counted by


def count_collectives(text: str) -> dict[str, int]:
    """``stablehlo.<kind>`` occurrences per collective kind in lowered StableHLO text."""
    return {k: len(re.findall(rf"stablehlo\.{k}\b", text)) for k in COLLECTIVES}


class ProgramInspection:
    """``as_text``, ``compiled_text`` and ``collective_counts`` of the program that
    ``lower(*args)`` gives, for the arguments the object is called with."""

    def lower(self, *args: Any) -> Any:
        """The ``jax.stages.Lowered`` program for these arguments (``.as_text()``,
        ``.compile().memory_analysis()``)."""
        raise NotImplementedError(f"{type(self).__name__} must define lower(*args)")

    def as_text(self, *args: Any) -> str:
        """The lowered StableHLO text of the whole program for these arguments."""
        return self.lower(*args).as_text()

    def compiled_text(self, *args: Any) -> str:
        """The compiled (optimised, scheduled) HLO text: what XLA runs, after its
        all-reduce combiner; the entry computation lists instructions in the order they
        are issued."""
        return self.lower(*args).compile().as_text()

    def collective_counts(self, *args: Any) -> dict[str, int]:
        """Collectives in the lowered program: ``stablehlo.<kind>`` occurrences per kind."""
        return count_collectives(self.as_text(*args))
