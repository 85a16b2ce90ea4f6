"""One rule for pausing Python's cyclic garbage collector around bursts of allocation.

Importing JAX, NumPy and SciPy, tracing a graph and building and solving a search problem
allocate many long-lived or short-lived objects and no cycles; the full collections they
trigger meanwhile walk the whole heap again and again (0.06 s of a 0.1 s search of 16 blocks,
0.1 s of the 2 s ``autopar search`` command). Reference counting still frees everything
else, and what the pause leaves is collected once the collector is back on.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

__all__ = ["paused_gc"]


@contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector paused inside, its state restored after (nested pauses
    leave it as the outermost found it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
