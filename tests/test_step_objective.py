"""The objective knows the step (issue 38, cause 1): a graph that one optimizer step runs for
``m`` micro-batches (gradient accumulation, pipeline micro-batches) is priced per
micro-batch with its gradient sync and optimizer update charged once per step -- ``1/m`` of
their price in the objective, the same per-step gradient sync in the plan's breakdown; a
larger ``m`` flips the choice toward data parallel exactly where a hand pricing of the two
candidates says; train_step under accumulation and the pipelined step's stage searches pass
it; strategy files record it only when it is not 1."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import optax
import pytest

import autopar as ap
from autopar.models import transformer
from autopar.pipeline.plan import plan_stages
from autopar.planner import plan_graph
from autopar.setup import resolve_setup
from autopar.strategies.cost import CLUSTERS, CostModel
from autopar.strategies.search import SearchSettings, ranked_plans, search_plan
from autopar.timeline import update_time

CLUSTER = CLUSTERS["accelerator-8x"]


def mlp_loss(p, x):
    return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])


def scoped_loss(p, x):
    with jax.named_scope("l1"):
        h = jnp.tanh(x @ p["w1"])
    with jax.named_scope("l2"):
        return jnp.sum(h @ p["w2"])


def mlp_graph(batch=64, hidden=512):
    params = {"w1": jnp.ones((hidden, hidden)), "w2": jnp.ones((hidden, hidden))}
    return ap.trace(mlp_loss, params, jnp.ones((batch, hidden)))


def per_step(graph, plan):
    """What a step of the plan runs once: its gradient sync and its optimizer update (the
    simulators' rule for the update)."""
    return plan.cost.gradient_sync + update_time(graph, graph.parameters(), plan,
                                                 CostModel(CLUSTER))


def by_hand(graph, plan, m):
    """A plan priced at ``m = 1``, re-priced per micro-batch of ``m`` by hand."""
    return plan.objective - (1 - 1 / m) * per_step(graph, plan)


def scanned_graph():
    m = transformer(layers=4, hidden=64, heads=4, seq=16, vocab=64, batch=16, scan=True)
    return ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))


@pytest.mark.parametrize("make", [mlp_graph, scanned_graph], ids=["mlp", "scanned"])
def test_a_plan_under_accumulation_charges_its_gradient_sync_once(make):
    """(A scanned model's body's sync too: the loop's price is its body's, x its trips.)"""
    g = make()
    dp = {m: search_plan(g, mode="dynamic_programming", device_num=8, cluster=CLUSTER,
                         settings=SearchSettings(parallel_mode="data_parallel",
                                                 micro_batches=m)) for m in (1, 8)}
    assert dp[1].decisions() == dp[8].decisions()
    assert dp[1].pricing.micro_batches == 1 and dp[8].pricing.micro_batches == 8
    # the breakdown is the same: one micro-batch's terms, the step's whole gradient sync
    assert dp[8].cost == dp[1].cost and dp[1].cost.gradient_sync > 0
    # the objective charges each micro-batch 1/8 of the sync and the update
    once = per_step(g, dp[1])
    assert dp[1].objective - dp[8].objective == pytest.approx(once * 7 / 8, rel=1e-9)
    assert dp[8].objective == pytest.approx(by_hand(g, dp[1], 8), rel=1e-9)


@pytest.mark.parametrize("state", [0.0, 2.0], ids=["sgd", "adam"])
def test_the_simulators_update_is_the_searchs_for_the_optimizer_it_priced(state):
    """The update the simulators charge (timeline.update_time) is the one the search priced,
    with the optimizer's own state (SGD: none), not the cluster's factor."""
    g = mlp_graph()
    states = tuple((v, state) for v in g.parameters())
    plans = {m: search_plan(g, mode="dynamic_programming", device_num=8, cluster=CLUSTER,
                            settings=SearchSettings(parallel_mode="data_parallel",
                                                    micro_batches=m, optimizer_state=states))
             for m in (1, 8)}
    once = per_step(g, plans[1])
    assert plans[1].objective - plans[8].objective == pytest.approx(once * 7 / 8, rel=1e-9)


@pytest.mark.parametrize("mode", ["dynamic_programming", "recursive_programming"])
def test_more_micro_batches_flip_the_choice_to_data_parallel_as_a_hand_pricing_does(mode):
    """At m = 1 the search splits the weights (no gradient sync, activations moved); at
    m = 16 a step's sync spread over 16 micro-batches is cheaper than moving activations in
    each: data parallel, as the two candidates priced by hand (each plan at m = 1, its
    per-step terms divided by m) say."""
    g = mlp_graph()
    own = search_plan(g, mode=mode, device_num=8, cluster=CLUSTER)
    dp = search_plan(g, mode=mode, device_num=8, cluster=CLUSTER,
                     settings=SearchSettings(parallel_mode="data_parallel"))
    assert own.decisions() != dp.decisions()
    hand = {m: min((by_hand(g, p, m), name) for name, p in (("own", own), ("dp", dp)))
            for m in (1, 16)}
    assert hand[1][1] == "own" and hand[16][1] == "dp"
    ranked = ranked_plans(g, mode=mode, device_num=8, cluster=CLUSTER,
                          settings=SearchSettings(micro_batches=16))
    best = ranked[0][1]
    assert best.decisions() == dp.decisions() and best.pricing.micro_batches == 16
    assert best.objective == pytest.approx(hand[16][0], rel=1e-9)
    # the trade: more gradient sync, less redistribution
    assert best.cost.gradient_sync > own.cost.gradient_sync
    assert best.cost.redistribution < own.cost.redistribution


def test_strategy_files_keep_the_micro_batches_only_when_not_one(tmp_path):
    g = mlp_graph(batch=16, hidden=64)
    files = {}
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        setup = resolve_setup("accelerator-8x")
        for m in (1, 4):
            path = tmp_path / f"m{m}.json"
            plan = plan_graph(g, setup, micro_batches=m)
            ap.save_strategy(plan, g, path)
            files[m] = (plan, json.loads(path.read_text()))
        assert "micro_batches" not in files[1][1] and files[4][1]["micro_batches"] == 4
        loaded = ap.load_strategy(tmp_path / "m4.json", g, cluster=None)
    assert loaded.pricing.micro_batches == 4 and loaded.objective == files[4][0].objective
    assert loaded.cost == files[4][0].cost


def test_train_step_and_stage_searches_price_their_micro_batches():
    """train_step under grad_accumulation_step = 2 searches the loss at the micro-batch as
    one of 2; a pipelined step of 4 micro-batches and accumulation 2 searches each stage as
    one of 8 (its plan the stage graph's own search at micro_batches = 8)."""
    params = {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 16))}
    x = jnp.ones((32, 16))
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  grad_accumulation_step=2, gradients_mean=True):
        step = ap.train_step(mlp_loss, params, (x,), optax.sgd(0.1))
    assert step.plan.pricing.micro_batches == 2
    g = ap.trace(scoped_loss, params, x[:4])
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  pipeline_stages=2, grad_accumulation_step=2):
        setup = resolve_setup("accelerator-8x")
        found = plan_stages(g, 2, setup=setup, micro_batches=4, boundaries=None, mode=None,
                            fixed=None)
        again = plan_graph(found.graphs[1], setup, device_num=4, micro_batches=8)
    assert [p.pricing.micro_batches for p in found.plans] == [8, 8]
    assert found.plans[1].objective == again.objective
