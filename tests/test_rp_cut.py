"""recursive_programming's compiled cut (cut_solver.CutSolver) replays dynamic_programming's
elimination: the same picks as ``eliminate`` on random cut problems (chains, extra, parallel and
reversed links, many exact ties, arrays shared between vertices and links so the memo hits),
round after round through one cut, and on large node eliminations."""

from __future__ import annotations

import random

import numpy as np
import pytest

from autopar.strategies import dynamic_programming
from autopar.strategies.cut_solver import CutSolver
from autopar.strategies.recursive_programming import _flatten
from cuts import random_cut


def _random_cut(rng: random.Random, n: int, big: bool = False, mixed: bool = False
                ) -> tuple[list[np.ndarray], list[tuple]]:
    sizes = [rng.choice((1, 30, 40)) if big else rng.choice((2, 3, 6)) if mixed else
             rng.randint(1, 4) for _ in range(n)]
    return random_cut(rng, sizes, lambda: rng.choice((0.0, 1.0, 2.5, 1e-3, 0.1 + 0.2)))


@pytest.mark.parametrize("seed", range(60))
def test_compiled_cut_equals_eliminate(seed):
    rng = random.Random(seed)
    costs, links = _random_cut(rng, rng.randint(2, 16))
    order = dynamic_programming.Order(len(costs), [(u, v) for u, v, _ in links])
    mats = [m for _, _, m in links]
    cut = CutSolver(order)
    want = dynamic_programming.eliminate(order, costs, mats)
    assert cut.solve(costs, mats, dynamic_programming.Memo()) == want
    # again through the same cut (every step a memo hit), then with other arrays
    assert cut.solve(costs, mats, dynamic_programming.Memo()) == want
    other = random.Random(seed + 1000)
    costs2 = [c + other.choice((0.0, 1.0)) for c in costs]
    mats2 = [m[::-1] * 2 if m.shape[0] == 1 else m * other.choice((1.0, 0.5)) for m in mats]
    assert cut.solve(costs2, mats2, dynamic_programming.Memo()) == \
        dynamic_programming.eliminate(order, costs2, mats2)


@pytest.mark.parametrize("seed", range(4))
def test_compiled_cut_equals_eliminate_on_large_eliminations(seed):
    rng = random.Random(seed)
    costs, links = _random_cut(rng, 6, big=True)
    order = dynamic_programming.Order(len(costs), [(u, v) for u, v, _ in links])
    mats = [m for _, _, m in links]
    assert CutSolver(order).solve(costs, mats, dynamic_programming.Memo()) == \
        dynamic_programming.eliminate(order, costs, mats)


@pytest.mark.parametrize("seed", range(30))
def test_compiled_cut_equals_eliminate_with_mixed_sizes(seed):
    rng = random.Random(seed)
    costs, links = _random_cut(rng, rng.randint(3, 14), mixed=True)
    order = dynamic_programming.Order(len(costs), [(u, v) for u, v, _ in links])
    mats = [m for _, _, m in links]
    cut = CutSolver(order)
    want = dynamic_programming.eliminate(order, costs, mats)
    assert cut.solve(costs, mats) == want
    assert cut.solve(costs, mats) == want


def test_irreducible_cut_uses_the_general_solver():
    rng = random.Random(7)
    costs = [np.array([float(rng.randint(0, 5)) for _ in range(3)]) for _ in range(4)]
    links = [(u, v, np.array([[float(rng.randint(0, 5)) for _ in range(3)] for _ in range(3)]))
             for u in range(4) for v in range(u + 1, 4)]
    order = dynamic_programming.Order(4, [(u, v) for u, v, _ in links])
    assert not order.reduces
    mats = [m for _, _, m in links]
    assert CutSolver(order).solve(costs, mats, dynamic_programming.Memo()) == \
        dynamic_programming.eliminate(order, costs, mats)


def test_flatten_gathers_entries_of_shared_arrays():
    a, b = np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[5.0, 6.0, 7.0]])
    flat, off, cols, w = _flatten([a, b, a])
    rows, cs = np.array([1, 0, 0]), np.array([0, 2, 1])
    assert flat[off[w] + rows * cols[w] + cs].tolist() == [3.0, 7.0, 2.0]
    flat, off, cols, w = _flatten([])
    assert len(w) == 0
