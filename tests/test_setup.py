"""One read of each store per entry point: the context (resolve_context), the algorithm
parameters, the HCCL split strategy and the cluster are read once by the public entry point
into a Setup (autopar/setup.py) and handed down; nothing below reads them again."""

import sys

import jax
import jax.numpy as jnp
import pytest

import autopar as ap
from autopar import algo, clusters, hccl, resolve

STORES = {"resolve_context": resolve.resolve_context, "read_context": resolve.read_context,
          "current_algo_parameters": algo.current_algo_parameters,
          "get_split_strategy": hccl.get_split_strategy,
          "resolve_cluster": clusters.resolve_cluster}


@pytest.fixture
def reads(monkeypatch):
    """Per store, the calls made: every module of autopar that holds the reader (by
    ``from ... import``) is given a counting one."""
    seen = dict.fromkeys(STORES, 0)

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for mod in [m for k, m in sorted(sys.modules.items()) if k.startswith("autopar")]:
        for name, fn in STORES.items():
            if getattr(mod, name, None) is fn:
                monkeypatch.setattr(mod, name, counting(name, fn))
    return seen


def _mlp():
    params = {"w1": jnp.ones((16, 32)) * 0.1, "w2": jnp.ones((32, 8)) * 0.1}

    def loss(p, x):
        with jax.named_scope("layer0"):
            h = jnp.tanh(x @ p["w1"])
        with jax.named_scope("layer1"):
            return jnp.mean((h @ p["w2"]) ** 2)
    return loss, params, jnp.ones((16, 16))


@pytest.mark.parametrize("stages", [1, 2])
def test_one_train_step_reads_each_store_once(reads, stages):
    loss, params, x = _mlp()
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  gradients_mean=True, pipeline_stages=stages):
        step = ap.train_step(loss, params, (x,), cluster="accelerator-8x")
        step(params, step.init(params), x)
    once = {"resolve_context": 1, "read_context": 0, "current_algo_parameters": 1,
            "resolve_cluster": 1,
            "get_split_strategy": 1 if stages == 1 else 0}   # (the pipelined step: no buckets)
    assert reads == once


def test_parallelize_and_search_read_each_store_once(reads):
    loss, params, x = _mlp()
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        ap.parallelize(loss, params, x, cluster="accelerator-8x")
        assert reads == {"resolve_context": 1, "read_context": 0, "current_algo_parameters": 1,
                         "resolve_cluster": 1, "get_split_strategy": 0}
        ap.search(ap.trace(loss, params, x), cluster="accelerator-8x")
    assert reads == {"resolve_context": 2, "read_context": 0, "current_algo_parameters": 2,
                     "resolve_cluster": 2, "get_split_strategy": 0}


def test_compare_modes_reads_each_store_once(reads):
    """compare_modes searches every mode from one Setup: the stores are read once for all of
    them, not once per mode (and the CLI's own Setup, given, is read from alone)."""
    from autopar.compare import ORDER, compare_modes
    from autopar.setup import resolve_setup

    loss, params, x = _mlp()
    graph = ap.trace(loss, params, x)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        rows = compare_modes(graph, cluster="accelerator-8x")
        assert [r.mode for r in rows] == list(ORDER)
        once = {"resolve_context": 1, "read_context": 0, "current_algo_parameters": 1,
                "resolve_cluster": 1, "get_split_strategy": 0}
        assert reads == once
        setup = resolve_setup("accelerator-8x")
        given = compare_modes(graph, setup=setup)
    assert reads == {k: 2 * v for k, v in once.items()}
    assert [r.objective for r in given] == [r.objective for r in rows]


@pytest.mark.parametrize("planned", [False, True])
def test_simulate_and_the_split_advisor_read_each_store_once(reads, planned):
    """simulate, advise_split and compare_splits read the context as set (unchecked: a
    stand_alone context with device_num=8 neither warns nor raises), the algorithm
    parameters and the cluster once each (with a plan, its own cluster: none resolved);
    simulate also the split strategy (its buckets under the context's policy)."""
    from autopar.split_advisor import advise_split, compare_splits
    from autopar.timeline import simulate

    loss, params, x = _mlp()
    graph = ap.trace(loss, params, x)
    plan = None
    if planned:
        with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
            plan = ap.search(graph, cluster="accelerator-8x")
    cluster = 0 if planned else 1
    with ap.auto_parallel_context(device_num=8):
        for entry, split in ((simulate, 1), (advise_split, 0), (compare_splits, 0)):
            before = dict(reads)
            entry(graph, plan)
            assert {k: reads[k] - before[k] for k in reads} == {
                "resolve_context": 0, "read_context": 1, "current_algo_parameters": 1,
                "resolve_cluster": cluster, "get_split_strategy": split}, entry.__name__

def test_a_setup_is_frozen_and_keeps_what_it_read():
    from autopar.setup import resolve_setup
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        s = resolve_setup("accelerator-8x")
    with pytest.raises(Exception):
        s.resolved = None
    with ap.auto_parallel_context(device_num=4):  # a later context does not change it
        assert s.device_num == 8 and s.cluster is s.cluster
    stage = s.with_config(strategy_ckpt_save_file="/tmp/x.json")
    assert stage.cluster is s.cluster and stage.config.strategy_ckpt_save_file == "/tmp/x.json"
    assert s.config.strategy_ckpt_save_file != "/tmp/x.json"


def test_search_under_pipeline_stages_is_refused_not_ignored():
    loss, params, x = _mlp()
    g = ap.trace(loss, params, x)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  pipeline_stages=2):
        with pytest.raises(ap.AutoParallelError, match="pipeline_stages.*pipeline_train_step"):
            ap.search(g, cluster="accelerator-8x")
        plan = ap.search(g, device_num=4, cluster="accelerator-8x")  # a stage's share
    assert plan.mesh.device_num == 4
