"""The hand plans every search weighs: a search never returns a plan priced dearer than data
parallel or Megatron's layout, each built here on its own (a parallel mode, explicit
strategies), not through the search's own list."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autopar as ap
from autopar.models import mlp, resnet50, tfm_stack, transformer
from autopar.planner import ranked_candidates
from autopar.setup import resolve_setup
from autopar.strategies.baselines import megatron_splits
from autopar.strategies.layout import DeviceMesh

ZOO = {
    "mlp": lambda: mlp(widths=(64, 256, 64), batch=64),
    "mlp_wide": lambda: mlp(widths=(256, 1024, 256), batch=16),
    "tfm_stack": lambda: tfm_stack(blocks=1, batch=2, seq=16, hidden=64, heads=4),
    "transformer": lambda: transformer(layers=1, hidden=32, heads=4, seq=8, vocab=64, batch=8),
    "resnet50": lambda: resnet50(num_classes=16, batch=8, image_size=32),
}
_GRAPHS: dict[str, ap.Graph] = {}


def _graph(name: str) -> ap.Graph:
    if name not in _GRAPHS:
        m = ZOO[name]()
        args = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                            jax.eval_shape(m.example_args, jax.random.key(0)))
        _GRAPHS[name] = ap.trace(m.loss, *args)
    return _GRAPHS[name]


def _megatron_fixed(graph: ap.Graph, tp: int) -> dict:
    """Megatron's layout written as a user writes it: alternate column ((1.., 1), (1, tp))
    and row ((1.., tp), (tp, 1)) splits of the matmuls with a 2-D parameter weight."""
    dots = [n for n in graph.nodes if n.op == "dot_general" and
            graph.values[n.inputs[1]].kind == "param" and graph.spec(n.inputs[1]).rank == 2]
    fixed = {}
    for k, n in enumerate(dots):
        r = graph.spec(n.inputs[0]).rank
        fixed[n.name] = ((1,) * r, (1, tp)) if k % 2 == 0 else ((1,) * (r - 1) + (tp,), (tp, 1))
    return fixed


@pytest.mark.parametrize("mode", ["dynamic_programming", "recursive_programming"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_search_never_priced_dearer_than_data_parallel(name, mode):
    g = _graph(name)
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel"):
        dp = ap.search(g, cluster="accelerator-8x")
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        plan = ap.search(g, mode=mode, cluster="accelerator-8x")
    assert plan.cost.total <= dp.cost.total * (1 + 1e-9), (plan.cost.total, dp.cost.total)
    assert any(n.startswith("hand plans priced: data_parallel") for n in plan.notes)


@pytest.mark.parametrize("name", ["mlp", "mlp_wide"])
@pytest.mark.parametrize("cluster", ["accelerator-8x", "cpu-emulated"])
def test_search_never_priced_dearer_than_megatron(name, cluster):
    g = _graph(name)
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel"):
        megatron = ap.search(g, cluster=cluster, fixed=_megatron_fixed(g, 8))
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        plan = ap.search(g, mode="recursive_programming", cluster=cluster)
    assert plan.cost.total <= megatron.cost.total * (1 + 1e-9)


def test_megatron_splits_columns_then_rows():
    g = _graph("transformer")
    splits = megatron_splits(g, DeviceMesh.for_devices(8), 4)
    by_suffix = {name.split("/", 1)[1]: s for name, s in splits.items()}
    for name, s in by_suffix.items():
        assert 4 in s and s.count(4) == 1, (name, s)
    # the attention output and the MLP's second matmul contract the split dim: row splits,
    # a partial sum; the first matmuls keep theirs in the output
    for name in by_suffix:
        node = g.node(next(n for n in splits if n.endswith(name)))
        spec = ap.strategies.opspec.op_spec(node, g)
        split_dim = by_suffix[name].index(4)
        in_output = any(split_dim in m for m in spec.out_maps)
        assert in_output == (not name.endswith(("attn/dot_general_3", "mlp/dot_general_1"))), \
            name


def test_a_cheaper_hand_plan_replaces_the_solvers_own():
    # recursive_programming's own plan for this decoder on 64 devices is priced above a
    # hand plan: the search returns the hand plan, and its notes say so
    m = transformer(layers=2, hidden=1024, heads=16, seq=512, vocab=1024, batch=8)
    g = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    with ap.auto_parallel_context(device_num=64, parallel_mode="auto_parallel"):
        ranked = ranked_candidates(g, resolve_setup("accelerator-8x"),
                                   mode="recursive_programming")
        plan = ap.search(g, mode="recursive_programming", cluster="accelerator-8x")
    own = dict(ranked)["recursive_programming"]
    assert [p.objective for _, p in ranked] == sorted(p.objective for _, p in ranked)
    assert ranked[0][0] != "recursive_programming"
    assert plan.objective == ranked[0][1].objective < own.objective
    assert any(f"kept {ranked[0][0]}" in n for n in plan.notes)


def test_hand_plans_skipped_where_the_user_asks_for_mindspores_follow_rule():
    g = _graph("mlp")
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        with ap.algo_parameters_context(elementwise_op_strategy_follow=True):
            plan = ap.search(g)
    assert not any("hand plans" in n for n in plan.notes)


@pytest.mark.parametrize("name", ["tfm_stack", "transformer"])
def test_the_search_keeps_its_own_plan_only_past_the_hand_plan_margin(name):
    # the margin sits just above, then just below, the search's own saving over the
    # cheapest hand plan: the search returns that hand plan, then its own
    g = _graph(name)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        with ap.algo_parameters_context(hand_plan_margin=0.0):
            ranked = dict(ranked_candidates(g, resolve_setup("accelerator-8x")))
        own = ranked.pop("dynamic_programming")
        hand_name, hand = min(ranked.items(), key=lambda item: item[1].objective)
        saving = 1.0 - own.objective / hand.objective
        assert 0.0 < saving < 1.0, (own.objective, hand.objective)
        with ap.algo_parameters_context(hand_plan_margin=min(0.99, saving * 1.01)):
            kept = ap.search(g, cluster="accelerator-8x")
        with ap.algo_parameters_context(hand_plan_margin=saving * 0.99):
            searched = ap.search(g, cluster="accelerator-8x")
    assert kept.objective == hand.objective and kept.decisions() == hand.decisions()
    assert any(f"kept {hand_name}, the search's own is not cheaper" in n for n in kept.notes)
    assert searched.objective == own.objective and searched.decisions() == own.decisions()
