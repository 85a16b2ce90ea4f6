"""Random cut problems for the elimination tests (tests/test_rp_cut.py,
tests/test_recursive_speed.py): a chain plus random extra, parallel and reversed links, small
costs (many exact ties) and arrays shared between vertices and links, so the memo hits as in
a network of identical blocks."""

from __future__ import annotations

import random
from typing import Callable

import numpy as np


def random_cut(rng: random.Random, sizes: list[int], edge_value: Callable[[], float]
               ) -> tuple[list[np.ndarray], list[tuple]]:
    """Cost vectors of ``sizes`` choices (integers 0-3) and links ``(u, v, matrix)`` whose
    entries ``edge_value()`` draws."""
    n = len(sizes)
    pool_v: dict[int, list[np.ndarray]] = {}
    pool_e: dict[tuple[int, int], list[np.ndarray]] = {}

    def vec(s: int) -> np.ndarray:
        arrs = pool_v.setdefault(s, [])
        if len(arrs) < 3 or rng.random() < 0.3:
            arrs.append(np.array([float(rng.randint(0, 3)) for _ in range(s)]))
        return rng.choice(arrs)

    def mat(a: int, b: int) -> np.ndarray:
        arrs = pool_e.setdefault((a, b), [])
        if len(arrs) < 3 or rng.random() < 0.3:
            arrs.append(np.array([[edge_value() for _ in range(b)] for _ in range(a)]))
        return rng.choice(arrs)

    pairs = [(i, i + 1) for i in range(n - 1)]
    for _ in range(rng.randint(0, n // 2)):
        u = rng.randrange(n - 1)
        pairs.append((u, rng.randrange(u + 1, min(n, u + 4))))
    pairs += [rng.choice(pairs) for _ in range(rng.randint(0, 3))]        # parallel links
    pairs = [(v, u) if rng.random() < 0.2 else (u, v) for u, v in pairs]  # some reversed
    return [vec(s) for s in sizes], [(u, v, mat(sizes[u], sizes[v])) for u, v in pairs]
