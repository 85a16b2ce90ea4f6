"""The configuration search (auto_pipeline): stages, micro-batches and schedule with the
layouts, against a brute-force sweep of the same prices; train_step under auto_pipeline."""

import jax
import numpy as np
import optax
import pytest

import autopar as ap
from autopar.errors import AutoParallelError, ContextConflictError, MemoryBudgetError
from autopar.models import transformer
from autopar.pipeline.configure import _Weigher, micro_graphs, weigh_configurations
from autopar.setup import resolve_setup

CLUSTER = ap.CLUSTERS["accelerator-8x"]


def tiny():
    """A 2-layer decoder (4 units: embedding, 2 blocks, head) and its shapes."""
    m = transformer(layers=2, hidden=32, heads=4, seq=16, vocab=64, batch=8)
    params, *batch = jax.eval_shape(m.example_args, jax.random.key(0))
    return m, params, tuple(batch)


def _brute_force(setup, graph_at, rows):
    """Every stages x micro-batches x schedule the search may weigh, each priced."""
    w = _Weigher(graph_at, setup, None, ("gpipe", "1f1b"), None)
    b = rows[0]
    return [c for p in range(1, 9) if 8 % p == 0 for m in range(p, b + 1) if b % m == 0
            and (b // m) & (b // m - 1) == 0 for c in w.weigh(p, m)]


@pytest.mark.parametrize("budget_mib", [None, 0.6])
def test_the_search_finds_what_a_brute_force_sweep_finds(budget_mib):
    m, params, batch = tiny()
    clus = CLUSTER if budget_mib is None else CLUSTER.model_copy(
        update={"memory_bytes": budget_mib * 2 ** 20})
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  auto_pipeline=True):
        setup = resolve_setup(clus)
    graph_at, rows = micro_graphs(m.loss, params, batch)
    found = weigh_configurations(graph_at, rows, setup=setup)
    sweep = [c for c in _brute_force(setup, graph_at, rows) if c.fits]
    best = min(sweep, key=lambda c: (c.step_seconds, c.stages, c.micro_batches, c.schedule))
    got = found.best
    assert (got.stages, got.micro_batches, got.schedule) == \
        (best.stages, best.micro_batches, best.schedule)
    assert got.step_seconds == best.step_seconds and got.fits
    if budget_mib is not None:  # the budget rules the unconstrained best out
        assert got.memory_bytes <= budget_mib * 2 ** 20
        with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
            free = weigh_configurations(graph_at, rows, setup=resolve_setup(CLUSTER)).best
        assert free.memory_bytes > budget_mib * 2 ** 20 > got.memory_bytes
    table = found.table(rows=100)
    assert table.splitlines()[2].split()[:3] == [str(got.stages), str(got.micro_batches),
                                                 got.schedule]
    assert len(table.splitlines()) == len(found.ranked) + 2


def test_nothing_fits_raises_with_the_table():
    m, params, batch = tiny()
    clus = CLUSTER.model_copy(update={"memory_bytes": 1024.0})
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        with pytest.raises(MemoryBudgetError, match="no configuration") as e:
            ap.search_configuration(m.loss, params, batch, cluster=clus)
    assert e.value.budget == 1024.0 and e.value.needed > 1024.0
    assert "stages  micro-batches" in str(e.value)


def test_the_search_is_deterministic_and_says_why_one_stage():
    m, params, batch = tiny()
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  pipeline_stages=2):
        a = ap.search_configuration(m.loss, params, batch, cluster=CLUSTER)
        b = ap.search_configuration(m.loss, params, batch, cluster=CLUSTER)
        one = ap.search_configuration(m.loss, params, batch, clipped, cluster=CLUSTER)
    assert a.table(100) == b.table(100)
    weighed = [c.stages for c in a.ranked] + [p for p, _, _ in a.pruned]
    assert max(weighed) == 2   # pipeline_stages caps the degree
    assert {c.stages for c in one.ranked} == {1} and "not elementwise" in one.notes[0]


def test_auto_pipeline_rules():
    m, params, batch = tiny()
    with pytest.raises(ContextConflictError, match="auto_pipeline"):
        with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                      auto_pipeline=True):
            ap.search_configuration(m.loss, params, batch, cluster=CLUSTER)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  auto_pipeline=True, grad_accumulation_step=2):
        with pytest.raises(AutoParallelError, match="grad_accumulation_step"):
            ap.search_configuration(m.loss, params, batch, cluster=CLUSTER)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  auto_pipeline=True):
        with pytest.raises(AutoParallelError, match="search_configuration"):
            ap.search(ap.trace(m.loss, params, *batch), cluster=CLUSTER)
        with pytest.raises(AutoParallelError, match="tune"):
            ap.train_step(m.loss, params, batch, tune=2, cluster=CLUSTER)


def test_train_step_builds_the_configuration_it_chose():
    m, _, _ = tiny()
    params, *batch = m.example_args(jax.random.key(0))
    clus = CLUSTER.model_copy(update={"memory_bytes": 0.6 * 2 ** 20})
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  auto_pipeline=True, gradients_mean=True):
        step = ap.train_step(m.loss, params, tuple(batch), optax.adam(1e-3), cluster=clus)
    best = step.configuration.best
    assert best.stages > 1 and isinstance(step, ap.pipeline.PipelineTrainStep)
    assert (step.stages, step.micro_batches, step.schedule_table.name) == \
        (best.stages, best.micro_batches, best.schedule)
    _, _, loss = step(params, step.init(params), *batch)
    # (the pipelined step's gradients against float64 references: tests/test_pipeline.py)
    np.testing.assert_allclose(float(loss), float(m.loss(params, *batch)), rtol=1e-5)


def test_stages_of_one_structure_are_searched_once():
    """The middle stages of a stack of identical blocks differ only in their names: the
    first is searched, the others take its plan by position, which is their own search's."""
    from autopar.pipeline.plan import search_stages
    from autopar.planner import plan_graph

    m = transformer(layers=8, hidden=64, heads=4, seq=16, vocab=64, batch=8)
    g = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    with ap.auto_parallel_context(device_num=32, parallel_mode="auto_parallel"):
        setup = resolve_setup(CLUSTER)
    _, sgs, plans = search_stages(g, 4, setup=setup, micro_batches=4, boundaries=None,
                                  mode=None, fixed=None)
    reused = [s for s, plan in enumerate(plans) if plan.search_seconds == 0.0]
    assert reused and all(sgs[s].fingerprint() != sgs[s - 1].fingerprint() for s in reused)
    for s in reused:
        own = plan_graph(sgs[s], setup, device_num=8, micro_batches=4, stage=s)
        assert plans[s].decisions() == own.decisions() and plans[s].cost == own.cost
        assert plans[s].fingerprint == sgs[s].fingerprint()
        assert set(plans[s].stages.values()) == {s}


def test_the_lower_bounds_hold_for_every_configuration_weighed():
    """The step and memory floors the search prunes by are below what every configuration
    is priced at: the search's answer is then the sweep's."""
    m, params, batch = tiny()
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        setup = resolve_setup(CLUSTER)
    graph_at, rows = micro_graphs(m.loss, params, batch)
    w = _Weigher(graph_at, setup, None, ("gpipe", "1f1b"), None)
    checked = 0
    for c in _brute_force(setup, graph_at, rows):
        if c.failed:  # (too few units for its stages: the bound says so too)
            assert w.bound(c.stages, c.micro_batches).failed
            continue
        seconds, memory = w.bound(c.stages, c.micro_batches)
        assert seconds <= c.step_seconds * (1 + 1e-12)
        assert 0 < memory <= c.memory_bytes * (1 + 1e-12)
        checked += 1
    assert checked >= 10


def test_a_hand_configuration_is_priced_as_the_search_prices_it():
    """price_configuration prices one configuration as the sweep does; with Megatron's
    matmuls fixed, every stage plan splits them as Megatron does."""
    from autopar.pipeline.configure import price_configuration
    from autopar.strategies.baselines import megatron_strategies

    m, params, batch = tiny()
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        setup = resolve_setup(CLUSTER)
    graph_at, _ = micro_graphs(m.loss, params, batch)
    w = _Weigher(graph_at, setup, None, ("1f1b",), None)
    own = price_configuration(graph_at, 2, 4, setup=setup, schedule="1f1b")
    assert own.step_seconds == w.weigh(2, 4)[0].step_seconds
    fixed = megatron_strategies(graph_at(4), 4, 2)
    hand = price_configuration(graph_at, 2, 4, setup=setup, mode="sharding_propagation",
                               fixed=fixed)
    assert fixed and hand.fits
    for plan in hand.plans:
        mine = {k: v for k, v in fixed.items() if k in plan.nodes}
        assert mine and all(plan.strategy(k) == v for k, v in mine.items())


def test_the_parallel_optimizer_is_tried_where_the_user_left_it_unset():
    m, params, batch = tiny()
    small = {"parallel_optimizer_threshold": 0}  # (the tiny model's parameters are small)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  parallel_optimizer_config=small, auto_pipeline=True):
        tried = ap.search_configuration(m.loss, params, batch, optax.adam(1e-3),
                                        cluster=CLUSTER)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  auto_pipeline=True, enable_parallel_optimizer=False):
        left = ap.search_configuration(m.loss, params, batch, optax.adam(1e-3),
                                       cluster=CLUSTER)
    sharded = [c for c in tried.ranked if c.parallel_optimizer]
    assert sharded and not any(c.parallel_optimizer for c in left.ranked)
    plain = {(c.stages, c.micro_batches, c.schedule): c for c in left.ranked if c.fits}
    for c in sharded:  # the same counts, its state split: less memory per device
        assert c.memory_bytes < plain[c.stages, c.micro_batches, c.schedule].memory_bytes
    best = tried.best
    assert best.context().get("enable_parallel_optimizer", False) == best.parallel_optimizer
    assert best.step_seconds <= left.best.step_seconds


@pytest.mark.parametrize("budget_mib", [None, 0.6])
def test_train_step_runs_the_plans_the_search_chose_without_searching_again(budget_mib,
                                                                           monkeypatch):
    """Under auto_pipeline the step takes the chosen configuration's stage plans: building
    it runs no search beyond the configuration search's own."""
    import autopar.parallel_function as pf
    import autopar.pipeline.plan as pp

    m, _, _ = tiny()
    params, *batch = m.example_args(jax.random.key(0))
    clus = CLUSTER if budget_mib is None else CLUSTER.model_copy(
        update={"memory_bytes": budget_mib * 2 ** 20})
    calls = []
    for mod in (pf, pp):
        real = mod.plan_graph
        monkeypatch.setattr(mod, "plan_graph", lambda *a, real=real, **k: (
            calls.append(1), real(*a, **k))[1])
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  auto_pipeline=True, gradients_mean=True):
        found = ap.search_configuration(m.loss, params, tuple(batch), optax.adam(1e-3),
                                        cluster=clus)
        searches = len(calls)
        step = ap.train_step(m.loss, params, tuple(batch), optax.adam(1e-3), cluster=clus)
    assert searches > 0 and len(calls) == 2 * searches
    plans = step.plans if found.best.stages > 1 else (step.plan,)
    assert (found.best.stages > 1) == (budget_mib is not None)
    assert [p.decisions() for p in plans] == [p.decisions() for p in found.best.plans]
