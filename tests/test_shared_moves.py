"""Shared moves priced once: the polish after the pairwise searches and the exact referee."""

from __future__ import annotations

import itertools
from collections import deque

import jax
import jax.numpy as jnp
import pytest

import autopar as ap
from autopar.models import tfm_stack
from autopar.strategies import dynamic_programming, exact, search
from autopar.strategies.cost import CostModel, get_cluster
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.shared_moves import _Moves, _single_moves, polish

CLUSTER = "accelerator-8x"


def _graph(**kw):
    m = tfm_stack(**kw)
    return ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))


def _problem(g, devices, **kw):
    return search._problem(g, DeviceMesh.for_devices(devices), CostModel(get_cluster(CLUSTER)),
                           dict(kw.pop("fixed", {})), search.SearchSettings(), 0.0, lazy=False)


def _moved(problem, picks, i, k):
    """``picks`` with vertex ``i`` at choice ``k``, the parameters re-picked."""
    trial = list(picks)
    trial[i] = k
    problem.pick_parameters(trial)
    return trial


def test_the_polish_ends_where_no_single_move_lowers_the_price():
    """Brute force: from the polished plan, every operator at every other choice (the
    parameters re-picked, the whole plan re-priced by Problem.evaluate) is no cheaper -- the
    polish's local prices (each value it touches, each distinct move once) are the price's."""
    problem = _problem(_graph(blocks=1, batch=2, seq=8, hidden=32, heads=2), 8)
    start = dynamic_programming.solve(problem)
    problem.pick_parameters(start)
    picks = polish(problem, start)
    price = problem.evaluate(picks)[1]
    assert price < problem.evaluate(start)[1] * 0.99  # (it moved: a test that can fail)
    for i, v in problem.iter_ops():
        for k in range(len(v.choices)):
            trial = problem.evaluate(_moved(problem, picks, i, k))[1]
            assert trial >= price * (1 - 1e-12), (v.name, v.choices[k].splits)


def test_the_polish_is_deterministic_and_leaves_fixed_operators_alone():
    g = _graph(blocks=2, batch=4, seq=64, hidden=256, heads=4)
    qkv = [n.name for n in g.nodes if n.op == "dot_general"][0]
    problem = _problem(g, 8, fixed={qkv: ((2, 1), (1, 4))})
    start = dynamic_programming.solve(problem)
    a, b = polish(problem, list(start)), polish(problem, list(start))
    assert a == b
    i = problem.index[qkv]
    assert problem.vertices[i].choices[a[i]].splits == problem.vertices[i].choices[start[i]].splits


def test_a_shared_move_lowers_the_plan_dynamic_programming_hands_over():
    """One block at hidden 256 on accelerator-8x: the fused QKV matmul takes the batch split,
    its output moved once for its three readers (the edge sum priced three moves)."""
    g = _graph(blocks=1, batch=4, seq=64, hidden=256, heads=4)
    problem = _problem(g, 8)
    solved = problem.evaluate(dynamic_programming.solve(problem))[1]
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        dp = ap.search(g, mode="dynamic_programming", cluster=CLUSTER)
        rp = ap.search(g, mode="recursive_programming", cluster=CLUSTER)
        ex = ap.search(g, mode="exact", cluster=CLUSTER)
    assert dp.objective < solved * 0.95 and rp.objective < solved * 0.95
    # (and with the region moves below, both reach the integer program's optimum here)
    assert dp.objective == pytest.approx(ex.objective, rel=1e-9)
    assert rp.objective == pytest.approx(ex.objective, rel=1e-9)
    assert dp.objective == pytest.approx(dp.cost.total, rel=1e-12)


def test_a_split_carried_along_a_chain_is_dropped_at_once():
    """The same block: the attention and layer norm carry the batch split 2-way, gathered
    before the MLP. Dropping it one operator at a time adds a move on both sides of that
    operator, so single moves stop there; the region (operators joined by values read as
    made) drops the split at once, every operator repeating its work, and the plan is
    cheaper by more than 10 %."""
    problem = _problem(_graph(blocks=1, batch=4, seq=64, hidden=256, heads=4), 8)
    picks = dynamic_programming.solve(problem)
    moves = _Moves(problem, picks, None)
    _single_moves(moves, deque(i for i, _ in problem.iter_ops()), 10 ** 6)
    problem.pick_parameters(moves.picks)
    single = problem.evaluate(moves.picks)[1]
    regions = moves.regions()
    carried = max(regions, key=len)
    assert len(carried) >= 10 and {problem.vertices[i].choices[moves.picks[i]].splits[0]
                                    for i in carried} == {2}
    assert moves.region_moves()
    assert all(not problem.vertices[i].choices[moves.picks[i]].used_axes for i in carried)
    problem.pick_parameters(moves.picks)
    assert problem.evaluate(moves.picks)[1] < single * 0.9


def _region_moves(monkeypatch, problem, start, memo=None, share=True):
    """Single moves from ``start``, then one round of region moves (``memo``: a region memo
    to start from; ``share=False``: every region its own situation). Returns the picks,
    the regions priced and the regions there were."""
    moves = _Moves(problem, list(start), None)
    _single_moves(moves, deque(i for i, _ in problem.iter_ops()), 10 ** 6)
    if memo is not None:
        moves.region_memo = memo
    priced, situation, original = [], _Moves.region_situation, _Moves._region_move

    def unique(self, region, here):
        key, params = situation(self, region, here)
        return (key if share else (key, len(priced))), params

    def counted(self, region, here, params):
        priced.append(region)
        return original(self, region, here, params)

    with monkeypatch.context() as m:
        m.setattr(_Moves, "region_situation", unique)
        m.setattr(_Moves, "_region_move", counted)
        regions = len(moves.regions())
        moves.region_moves()
    return moves, len(priced), regions


def test_identical_blocks_share_their_region_moves(monkeypatch):
    """Four identical blocks: their regions are priced once per situation, not once per
    block, and the plan is the one pricing every region on its own gives."""
    problem = _problem(_graph(blocks=4), 8)
    start = dynamic_programming.solve(problem)
    shared, priced, regions = _region_moves(monkeypatch, problem, start)
    alone, priced_alone, _ = _region_moves(monkeypatch, problem, start, share=False)
    assert shared.picks == alone.picks
    assert priced_alone == regions >= 12 and priced <= regions // 2, (priced, regions)


def test_a_region_move_kept_for_its_situation_is_made_again(monkeypatch):
    """The carried region of one block (above) moved from the memo, not priced again: the
    same plan as pricing it."""
    problem = _problem(_graph(blocks=1, batch=4, seq=64, hidden=256, heads=4), 8)
    start = dynamic_programming.solve(problem)
    first, priced, _ = _region_moves(monkeypatch, problem, start)
    assert priced == 1 and any(first.region_memo.values())  # (it moved)
    again, priced_again, _ = _region_moves(monkeypatch, problem, start, memo=first.region_memo)
    assert priced_again == 0 and again.picks == first.picks != start


def test_exact_is_the_least_price_of_every_plan():
    """A value read by three operators, every plan enumerated on 2 devices (the parameters
    picked for their readers, as every plan ends): the integer program's price is the least
    Problem.evaluate finds."""
    def f(w, x):
        h = x @ w
        return jnp.sum(h * h) + jnp.sum(jnp.tanh(h))

    g = ap.trace(f, jnp.ones((8, 8)), jnp.ones((4, 8)))
    problem = _problem(g, 2)
    ops = [i for i, v in problem.iter_ops()]
    best = float("inf")
    for combo in itertools.product(*(range(len(problem.vertices[i].choices)) for i in ops)):
        picks = [0] * len(problem.vertices)
        for i, k in zip(ops, combo):
            picks[i] = k
        problem.pick_parameters(picks)
        best = min(best, problem.evaluate(picks)[1])
    picks = exact.solve(problem)
    assert problem.evaluate(picks)[1] == pytest.approx(best, rel=1e-9)
    # and the edge sum would have counted h's shared move per reader: the plan differs
    edge = exact.milp_picks([v.cost for v in problem.vertices],
                            [(e.u, e.v, e.matrix) for e in problem.edges])
    problem.pick_parameters(edge)
    assert problem.evaluate(edge)[1] >= best


def test_the_shared_solve_finds_the_layout_the_edge_sum_over_prices():
    """One tiny block on 16 devices: the edge sum prices a layout its readers share once per
    reader, and its polished plan stops 1.3x above exact's price; the solve with each
    value's moves shared by its readers, polished, reaches it, and dynamic_programming
    keeps the cheaper of the two."""
    g = _graph(blocks=1, batch=2, seq=8, hidden=32, heads=2)
    problem = _problem(g, 16)

    def price(picks):
        return problem.evaluate(picks)[1]

    edge = price(polish(problem, dynamic_programming.solve(problem)))
    shared = price(polish(problem, dynamic_programming.solve_shared(problem)))
    best = price(exact.solve(problem))
    assert shared == pytest.approx(best, rel=1e-9) and edge > 1.2 * best, (edge, shared, best)
    with ap.auto_parallel_context(device_num=16, parallel_mode="auto_parallel"):
        plan = ap.search(g, mode="dynamic_programming", cluster=CLUSTER)
    assert plan.objective == pytest.approx(shared, rel=1e-12)
