"""The simulators on mixed precision and memory: ``simulate`` prices the gradient sync at the
bytes ``gradient_fp32_sync`` sends, and both simulators record, and warn of, a step that does
not fit the cluster's memory; the no-fit error names the call that tries pipeline stages."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import autopar as ap
from autopar.errors import AutoParallelWarning
from autopar.models import transformer
from autopar.pipeline.configure import _Weigher, micro_graphs
from autopar.setup import resolve_setup

CLUSTER = ap.CLUSTERS["accelerator-8x"]
EXACT = {"buckets": "none", "overlap": False}  # one all-reduce per gradient, after backward


def _graph(dtype=jnp.float32, batch=8):
    m = transformer(layers=2, hidden=64, heads=4, seq=16, vocab=128, batch=batch, dtype=dtype)
    return ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))


def _sent(trace):
    return sum(s.nbytes for s in trace.segments)


def _no_warning(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", AutoParallelWarning)
        return fn(*args, **kwargs)


def _auto(**keys):
    return ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel", **keys)


# ---------------------------------------------------------------------------- fp32 sync


@pytest.fixture(scope="module")
def graphs():
    return _graph(jnp.bfloat16), _graph(jnp.float32)


def test_without_a_plan_the_context_sets_the_sync_precision(graphs):
    bf16, fp32 = graphs
    sim = {}
    for name, g in (("bf16", bf16), ("fp32", fp32)):
        for on in (True, False):
            with _auto(gradient_fp32_sync=on):
                sim[name, on] = ap.simulation.simulate(g, **EXACT)
    # a bf16 gradient sent in fp32: the fp32 model's bytes and price, twice its own bytes
    assert sim["bf16", True].comm_time > sim["bf16", False].comm_time
    assert _sent(sim["bf16", True]) == 2 * _sent(sim["bf16", False])
    assert _sent(sim["bf16", True]) == _sent(sim["fp32", False])
    assert sim["bf16", True].comm_time == pytest.approx(sim["fp32", False].comm_time,
                                                        rel=1e-12)
    # an fp32 gradient is sent as it is
    assert sim["fp32", True].comm_time == sim["fp32", False].comm_time
    assert _sent(sim["fp32", True]) == _sent(sim["fp32", False])
    # gradient_fp32_sync acts under semi_auto_parallel / auto_parallel only
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel"):
        dp = ap.simulation.simulate(bf16, **EXACT)
    assert _sent(dp) == _sent(sim["bf16", False])


def test_with_a_plan_the_simulation_agrees_with_the_search(graphs):
    bf16, _ = graphs
    plans = {}
    for on in (True, False):  # (semi_auto_parallel, nothing annotated: data parallel)
        with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                      gradient_fp32_sync=on):
            plans[on] = ap.search(bf16)
        assert plans[on].pricing.fp32_sync is on and plans[on].cost.gradient_sync > 0
    for on, plan in plans.items():
        t = ap.simulation.simulate(bf16, plan, **EXACT)  # (outside the context: the plan's)
        assert t.step_time == pytest.approx(plan.cost.total, rel=1e-9), on
        with _auto(gradient_fp32_sync=not on):  # the plan says how it was priced
            assert ap.simulation.simulate(bf16, plan, **EXACT).step_time == t.step_time
        # the split advisor prices the same bytes: its advice is simulate's on its buckets
        advice = ap.simulation.advise_split(bf16, plan)
        again = ap.simulation.simulate(bf16, plan, buckets=advice.buckets)
        assert again.iteration_time == advice.iteration_time
    assert ap.simulation.simulate(bf16, plans[True], **EXACT).comm_time > \
        ap.simulation.simulate(bf16, plans[False], **EXACT).comm_time


# ---------------------------------------------------------------------------- memory


def test_simulate_records_the_memory_and_warns_over_the_budget(graphs):
    _, g = graphs
    with _auto():
        plan = ap.search(g, cluster=CLUSTER)
    t = _no_warning(ap.simulation.simulate, g, plan)
    assert t.memory_bytes == plan.cost.memory_bytes > 0
    assert t.budget_bytes == CLUSTER.memory_bytes and t.fits
    tiny = CLUSTER.model_copy(update={"memory_bytes": plan.cost.memory_bytes / 2})
    with pytest.warns(AutoParallelWarning, match="memory: the plan needs") as rec:
        over = ap.simulation.simulate(g, plan, cluster=tiny)
    msg = str(rec[0].message)
    assert f"{plan.cost.memory_bytes:,.0f} bytes" in msg
    assert f"{tiny.memory_bytes:,.0f} bytes" in msg and f"the {tiny.name} budget" in msg
    assert rec[0].filename == __file__  # at the user's line
    assert not over.fits and over.budget_bytes == tiny.memory_bytes
    assert over.memory_bytes == plan.cost.memory_bytes and over.iteration_time > 0
    # without a plan nothing prices the memory: nothing to warn of
    bare = _no_warning(ap.simulation.simulate, g, device_num=8, cluster=tiny)
    assert bare.memory_bytes is None and bare.fits


@pytest.fixture(scope="module")
def stage_configs():
    """(graph at 4 micro-batches, the 2-stage configurations the configuration search weighs
    on ``CLUSTER`` and on a budget between their plans' peak and that plus the stash)."""
    m = transformer(layers=2, hidden=32, heads=4, seq=16, vocab=64, batch=8)
    params, *batch = jax.eval_shape(m.example_args, jax.random.key(0))
    graph_at, _ = micro_graphs(m.loss, params, tuple(batch))
    with _auto():
        setup = resolve_setup(CLUSTER)
    fits = {c.schedule: c for c in _Weigher(graph_at, setup, None, ("gpipe", "1f1b"),
                                            None).weigh(2, 4)}
    c = fits["1f1b"]
    peak = max(p.cost.memory_bytes for p in c.plans)
    assert c.memory_bytes > peak  # the boundary stash
    tight = CLUSTER.model_copy(update={"memory_bytes": (peak + c.memory_bytes) / 2})
    with _auto():
        setup = resolve_setup(tight)
    over = {c.schedule: c for c in _Weigher(graph_at, setup, None, ("gpipe", "1f1b"),
                                            None).weigh(2, 4)}
    return graph_at(4), fits, over, tight


def _pipeline(graph, config):
    with _auto():
        return ap.simulation.simulate_pipeline(graph, 2, micro_batches=4,
                                               schedule=config.schedule,
                                               plans=list(config.plans))


def test_simulate_pipeline_weighs_memory_as_the_configuration_search(stage_configs):
    graph, fits, over, tight = stage_configs
    for name, c in fits.items():
        t = _no_warning(_pipeline, graph, c)
        assert t.memory_bytes == c.memory_bytes and t.fits and c.fits, name
        assert t.budget_bytes == CLUSTER.memory_bytes
    # each stage plan fits the tight budget; with the schedule's stash the step does not
    c = over["1f1b"]
    assert max(p.cost.memory_bytes for p in c.plans) <= tight.memory_bytes
    with pytest.warns(AutoParallelWarning, match=r"memory: the stage plans' pipelined step "
                      r"\(1f1b, 2 stages x 4 micro-batches\) needs") as rec:
        t = _pipeline(graph, c)
    assert f"{tight.memory_bytes:,.0f} bytes" in str(rec[0].message)
    assert rec[0].filename == __file__
    assert not t.fits and not c.fits and t.memory_bytes == c.memory_bytes > tight.memory_bytes
    assert t.iteration_time > 0
    # without plans nothing prices the memory
    with _auto():
        bare = _no_warning(ap.simulation.simulate_pipeline, graph, 2, micro_batches=4,
                           cluster=tight)
    assert bare.memory_bytes is None and bare.fits


# ---------------------------------------------------------------------------- no fit


def test_the_no_fit_error_names_the_call_that_tries_pipeline_stages(graphs):
    _, g = graphs
    tiny = CLUSTER.model_copy(update={"memory_bytes": 1024.0})
    with _auto():
        with pytest.raises(ap.MemoryBudgetError) as e:
            ap.search(g, cluster=tiny)
    rest = str(e.value).split("not tried here: ")[1]
    assert "auto_pipeline=True" in rest and "autopar.search_configuration" in rest
    assert "train_step" in rest
