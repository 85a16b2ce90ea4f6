"""The one elimination (dynamic_programming.Elimination: the order compiled, replayed with
memoised arithmetic; recursive_programming's every round, dynamic_programming's every solve)
gives the picks of the elimination as first written (:func:`_reference_eliminate`, a dict of
vertex pairs, no memo) on random cut problems (chains, extra, parallel and reversed links, many
exact ties, arrays shared between vertices and links so the memo hits), round after round
through one compiled order and one memo, on large node eliminations and on a core that does
not reduce."""

from __future__ import annotations

import random

import numpy as np
import pytest

from autopar.strategies import dynamic_programming
from autopar.strategies.dynamic_programming import Elimination, Memo, Order
from autopar.strategies.exact import milp_picks
from autopar.strategies.recursive_programming import _flatten
from cuts import random_cut


def _random_cut(rng: random.Random, n: int, big: bool = False, mixed: bool = False
                ) -> tuple[list[np.ndarray], list[tuple]]:
    sizes = [rng.choice((1, 30, 40)) if big else rng.choice((2, 3, 6)) if mixed else
             rng.randint(1, 4) for _ in range(n)]
    return random_cut(rng, sizes, lambda: rng.choice((0.0, 1.0, 2.5, 1e-3, 0.1 + 0.2)))


def _reference_eliminate(order: Order, costs: list[np.ndarray],
                         mats: list[np.ndarray]) -> list[int]:
    """The elimination as first written: parallel links summed in link order, then leaves
    (``cost[y] += min_x a^T + cost[x]``) and degree-2 nodes (``E[y, z] += min_x a^T +
    cost[x] + b``) in the order's steps, the core by the integer program, the eliminated
    vertices replayed backwards at their first argmin."""
    pair: dict[tuple[int, int], np.ndarray] = {}
    for k, (u, v) in enumerate(order.links):
        if u != v:
            m = mats[k] if u < v else mats[k].T
            key = (min(u, v), max(u, v))
            pair[key] = m if key not in pair else pair[key] + m
    cost, log = list(costs), []
    for x, y, z in order.steps:
        a = pair[x, y] if x < y else pair[y, x].T                # [S_x, S_y]
        if z < 0:
            s = a.T + cost[x][None, :]
            cost[y] = cost[y] + s.min(axis=1)
        else:
            b = pair[x, z] if x < z else pair[z, x].T            # [S_x, S_z]
            s = a.T[:, :, None] + (cost[x][:, None] + b)[None, :, :]
            pair[y, z] = s.min(axis=1) if (y, z) not in pair else pair[y, z] + s.min(axis=1)
        log.append((x, y, z, s.argmin(axis=1)))
    picks = [-1] * order.n
    if order.core:
        local = {v: i for i, v in enumerate(order.core)}
        sub = milp_picks([cost[v] for v in order.core],
                         [(local[x], local[y], pair[x, y]) for x, y in order.core_edges])
        for v, k in zip(order.core, sub):
            picks[v] = k
    for i in range(order.n):
        if i not in order.eliminated and picks[i] < 0:
            picks[i] = int(np.argmin(cost[i]))
    for x, y, z, arg in reversed(log):
        picks[x] = int(arg[picks[y]]) if z < 0 else int(arg[picks[y], picks[z]])
    return picks


@pytest.mark.parametrize("seed", range(60))
def test_elimination_equals_the_reference(seed):
    rng = random.Random(seed)
    costs, links = _random_cut(rng, rng.randint(2, 16))
    order = Order(len(costs), [(u, v) for u, v, _ in links])
    mats = [m for _, _, m in links]
    cut, memo = Elimination(order), Memo()
    want = _reference_eliminate(order, costs, mats)
    assert cut.solve(costs, mats, memo) == want
    # again through the same cut and memo (every step a hit), then with other arrays
    assert cut.solve(costs, mats, memo) == want
    assert dynamic_programming.eliminate(order, costs, mats) == want
    other = random.Random(seed + 1000)
    costs2 = [c + other.choice((0.0, 1.0)) for c in costs]
    mats2 = [m[::-1] * 2 if m.shape[0] == 1 else m * other.choice((1.0, 0.5)) for m in mats]
    assert cut.solve(costs2, mats2, memo) == _reference_eliminate(order, costs2, mats2)


@pytest.mark.parametrize("seed", range(4))
def test_elimination_equals_the_reference_on_large_eliminations(seed):
    rng = random.Random(seed)
    costs, links = _random_cut(rng, 6, big=True)
    order = Order(len(costs), [(u, v) for u, v, _ in links])
    mats = [m for _, _, m in links]
    assert Elimination(order).solve(costs, mats, Memo()) == \
        _reference_eliminate(order, costs, mats)


@pytest.mark.parametrize("seed", range(30))
def test_elimination_equals_the_reference_with_mixed_sizes(seed):
    rng = random.Random(seed)
    costs, links = _random_cut(rng, rng.randint(3, 14), mixed=True)
    order = Order(len(costs), [(u, v) for u, v, _ in links])
    mats = [m for _, _, m in links]
    cut = Elimination(order)
    want = _reference_eliminate(order, costs, mats)
    assert cut.solve(costs, mats) == want
    assert cut.solve(costs, mats) == want


def test_irreducible_core_uses_the_integer_program():
    rng = random.Random(7)
    costs = [np.array([float(rng.randint(0, 5)) for _ in range(3)]) for _ in range(5)]
    links = [(u, v, np.array([[float(rng.randint(0, 5)) for _ in range(3)] for _ in range(3)]))
             for u in range(4) for v in range(u + 1, 4)] + [(3, 4, np.eye(3))]  # K4 + a leaf
    order = Order(5, [(u, v) for u, v, _ in links])
    assert not order.reduces and order.steps
    mats = [m for _, _, m in links]
    assert Elimination(order).solve(costs, mats, Memo()) == \
        _reference_eliminate(order, costs, mats)


def test_flatten_gathers_entries_of_shared_arrays():
    a, b = np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[5.0, 6.0, 7.0]])
    flat, off, cols, w = _flatten([a, b, a])
    rows, cs = np.array([1, 0, 0]), np.array([0, 2, 1])
    assert flat[off[w] + rows * cols[w] + cs].tolist() == [3.0, 7.0, 2.0]
    flat, off, cols, w = _flatten([])
    assert len(w) == 0
