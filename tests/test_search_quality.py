"""Plan quality of recursive_programming against dynamic_programming (one cost model).

At 64 devices recursive_programming's third round once began a hidden split of a
transformer's residual stream (cheaper for that round by 0.2%) instead of completing the batch
split; on the whole mesh that plan was 13-14% dearer than dynamic_programming's (12-96
layers). The re-cuts after the last round (one prime factor of an operator's split moved to
another dimension, priced on the whole mesh, solved exactly) bring it within 0.02%.
dynamic_programming itself is too slow at 64 devices on a transformer for a unit test (its
first search prices tens of thousands of layout pairs), so the transformer test checks the
plan's shape (dynamic_programming's, measured once: batch x sequence residual stream) and the
re-cuts' effect; small MLPs compare with dynamic_programming directly.
"""

from __future__ import annotations

import jax
import pytest

import autopar as ap
from autopar.models import mlp, tfm_stack, transformer
from autopar.planner import ranked_candidates
from autopar.setup import resolve_setup
from autopar.strategies import recursive_programming
from autopar.strategies.cost import CLUSTERS, CostModel
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.problem import Problem

_GRAPHS: dict[str, ap.Graph] = {}


def _graph(name: str) -> ap.Graph:
    if name not in _GRAPHS:
        m = {"tfm": lambda: transformer(layers=2, hidden=1024, heads=16, seq=512, vocab=1024,
                                        batch=8),
             "mlp": lambda: mlp(widths=(64, 256, 64), batch=64),
             "wide_mlp": lambda: mlp(widths=(4096, 16384, 4096), batch=32, bias=False)}[name]()
        _GRAPHS[name] = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    return _GRAPHS[name]


@pytest.mark.parametrize("name", ["mlp", "wide_mlp"])
def test_recursive_matches_dynamic_programming_on_mlps_at_64_devices(name):
    # before the re-cuts: 4% (mlp) and 7.7% (wide_mlp) above dynamic_programming
    g = _graph(name)
    ap.set_auto_parallel_context(device_num=64, parallel_mode="auto_parallel")
    rp = ap.search(g, mode="recursive_programming")
    dp = ap.search(g, mode="dynamic_programming")
    assert rp.objective <= 1.001 * dp.objective, (rp.objective, dp.objective)


def test_recursive_matches_dynamic_programming_on_a_block_stack_at_64_devices():
    # the rounds' ties left the blocks of the stack apart (three of eight blocks' attention on
    # a cheaper layout than the others', 0.25 % above dynamic_programming); a re-cut may now
    # give an operator the splits another of its signature holds, and every block takes the
    # cheaper layout
    m = tfm_stack(blocks=8)
    g = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    ap.set_auto_parallel_context(device_num=64, parallel_mode="auto_parallel")
    rp = ap.search(g, mode="recursive_programming", cluster="accelerator-8x")
    dp = ap.search(g, mode="dynamic_programming", cluster="accelerator-8x")
    assert rp.objective <= 1.0005 * dp.objective, (rp.objective, dp.objective)
    for op in ("attn/transpose_0", "attn/split_0", "attn/transpose_1"):
        held = {ns.splits for name, ns in rp.nodes.items() if name.endswith(op)}
        assert len(held) == 1, (op, held)


def test_small_operators_stop_splitting_at_once_on_64_devices():
    # one small block (hidden 256) on 64 devices: the rounds split its attention and layer
    # norm 8-way, and the re-cuts drop one factor at a time, each step dearer than the split,
    # so they stayed there (1.56x dynamic_programming's price, whose plan repeats them on
    # every device); the replication cut stops them splitting at once (1.07x)
    m = tfm_stack(blocks=1, batch=4, seq=64, hidden=256, heads=4)
    g = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    ap.set_auto_parallel_context(device_num=64, parallel_mode="auto_parallel")
    rp = ap.search(g, mode="recursive_programming", cluster="accelerator-8x")
    dp = ap.search(g, mode="dynamic_programming", cluster="accelerator-8x")
    assert rp.objective <= 1.10 * dp.objective, (rp.objective, dp.objective)
    assert rp.nodes["block0/attn/dot_general_1"].splits == (1,) * 5


def test_transformer_residual_stream_splits_batch_and_sequence_at_64_devices():
    # before the re-cuts the residual stream ended (8, 1, 8) (batch x hidden): 13.00 ms where
    # dynamic_programming's (8, 8, 1) plan costs 11.38 ms; now 11.44 ms
    g = _graph("tfm")
    ap.set_auto_parallel_context(device_num=64, parallel_mode="auto_parallel")
    ranked = ranked_candidates(g, resolve_setup(), mode="recursive_programming")
    rp = dict(ranked)["recursive_programming"]  # the solver's own plan, hand plans aside
    adds = [n.name for n in g.nodes if n.name.endswith(("attn/add_1", "mlp/add_2"))]
    assert len(adds) == 4
    for name in adds:
        assert rp.nodes[name].splits == (8, 8, 1), name


def test_recuts_lower_the_objective_and_are_deterministic(monkeypatch):
    g = _graph("tfm")
    mesh = DeviceMesh.for_devices(64)
    cm = CostModel(CLUSTERS["accelerator-8x"])

    def solve(recuts: int) -> tuple[list[int], float]:
        monkeypatch.setattr(recursive_programming, "_MAX_RECUTS", recuts)
        problem = Problem(g, mesh, cm, lazy=True)
        picks = recursive_programming.solve(problem)
        return picks, problem.evaluate(picks)[0].total

    rounds_only = solve(0)[1]
    picks, total = solve(16)
    assert total < 0.95 * rounds_only  # 13.00 -> 11.44 ms
    assert solve(16) == (picks, total)
