"""Limits that several layers check, each defined once.

>>> MAX_DEVICES
4096
"""

from __future__ import annotations

import math

__all__ = ["MAX_DEVICES", "MAX_MICRO_BATCHES", "finite"]

#: The most devices a context, a mesh, a plan or a strategy file may name (MindSpore's).
MAX_DEVICES = 4096
#: The most micro-batches a pipeline schedule is built or simulated for (its tables hold an
#: entry per stage and micro-batch; a step of more would be a batch of over a million rows).
MAX_MICRO_BATCHES = 2 ** 20


def finite(v: int | float) -> bool:
    """Whether a number is finite; an int past a double's range is not (``math.isfinite``
    raises OverflowError on it).

    >>> finite(1.5), finite(float("inf")), finite(10 ** 400)
    (True, False, False)
    """
    try:
        return math.isfinite(v)
    except OverflowError:
        return False
