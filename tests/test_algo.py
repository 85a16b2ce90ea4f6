"""set_algo_parameters / get_algo_parameters / reset_algo_parameters: MindSpore's keys,
defaults and ranges; all-or-nothing, scoped, per thread; honoured by the search."""

from __future__ import annotations

import threading
import warnings

import jax
import jax.numpy as jnp
import pytest

import autopar as ap
from autopar.algo import (ALGO_KEYS, NO_EFFECT, algo_parameters_context, current_algo_parameters,
                          get_algo_parameters, reset_algo_parameters, set_algo_parameters)
from autopar.graph.ops import KINDS
from autopar.models import tfm_stack
from autopar.strategies.search import SearchSettings

MINDSPORE_DEFAULTS = {"fully_use_devices": True, "elementwise_op_strategy_follow": False,
                      "tensor_slice_align_enable": False, "tensor_slice_align_size": 16,
                      "enable_algo_approxi": False, "algo_approxi_epsilon": 0.1}
#: MindSpore's keys and autopar's own
DEFAULTS = {**MINDSPORE_DEFAULTS, "hand_plan_margin": 0.15}


@pytest.fixture(autouse=True)
def _fresh_algo_parameters():
    reset_algo_parameters()
    yield
    reset_algo_parameters()


def values() -> dict:
    return {k: get_algo_parameters(k) for k in ALGO_KEYS}


def test_keys_and_defaults_are_mindsporess():
    """MindSpore's keys with its defaults, and autopar's own ``hand_plan_margin``."""
    assert values() == DEFAULTS


T, V = TypeError, ValueError
BAD = [
    ({"fully_use_device": True}, V, "fully_use_device"),
    ({"Fully_use_devices": True}, V, "Fully_use_devices"),
    ({"fully_use_devices": 1}, T, "fully_use_devices"),
    ({"fully_use_devices": "True"}, T, "fully_use_devices"),
    ({"elementwise_op_strategy_follow": None}, T, "elementwise_op_strategy_follow"),
    ({"tensor_slice_align_enable": 0}, T, "tensor_slice_align_enable"),
    ({"tensor_slice_align_size": 0}, V, "tensor_slice_align_size"),
    ({"tensor_slice_align_size": 1025}, V, "tensor_slice_align_size"),
    ({"tensor_slice_align_size": -16}, V, "tensor_slice_align_size"),
    ({"tensor_slice_align_size": 16.0}, T, "tensor_slice_align_size"),
    ({"tensor_slice_align_size": True}, T, "tensor_slice_align_size"),
    ({"enable_algo_approxi": "yes"}, T, "enable_algo_approxi"),
    ({"algo_approxi_epsilon": 0.0}, V, "algo_approxi_epsilon"),
    ({"algo_approxi_epsilon": -0.1}, V, "algo_approxi_epsilon"),
    ({"algo_approxi_epsilon": 1.5}, V, "algo_approxi_epsilon"),
    ({"algo_approxi_epsilon": float("nan")}, V, "algo_approxi_epsilon"),
    ({"algo_approxi_epsilon": float("inf")}, V, "algo_approxi_epsilon"),
    ({"algo_approxi_epsilon": 1}, T, "algo_approxi_epsilon"),
    ({"algo_approxi_epsilon": "0.1"}, T, "algo_approxi_epsilon"),
    ({"hand_plan_margin": 1.0}, V, "hand_plan_margin"),
    ({"hand_plan_margin": -0.1}, V, "hand_plan_margin"),
    ({"hand_plan_margin": float("nan")}, V, "hand_plan_margin"),
    ({"hand_plan_margin": 0}, T, "hand_plan_margin"),
    ({"algo_approxi_epsilon": True}, T, "algo_approxi_epsilon"),
    ({"fully_use_devices": False, "tensor_slice_align_size": 0}, V, "tensor_slice_align_size"),
]


@pytest.mark.parametrize("kwargs,exc,key", BAD, ids=[repr(b[0])[:50] for b in BAD])
def test_bad_input_is_typed_names_key_and_changes_nothing(kwargs, exc, key):
    set_algo_parameters(elementwise_op_strategy_follow=True)
    before = values()
    with pytest.raises(exc) as info:
        set_algo_parameters(**kwargs)
    assert isinstance(info.value, ap.AutoparError) and key in str(info.value), str(info.value)
    assert values() == before
    with pytest.raises(exc):
        with algo_parameters_context(**kwargs):
            pass  # pragma: no cover - never entered
    assert values() == before


def test_unknown_key_suggests_and_get_checks_its_key():
    with pytest.raises(ap.UnknownKeyError, match="Did you mean 'fully_use_devices'"):
        set_algo_parameters(fully_use_device=True)
    with pytest.raises(ap.UnknownKeyError, match="tensor_slice_align_size"):
        get_algo_parameters("tensor_slice_align")
    with pytest.raises(ap.AutoParallelTypeError):
        get_algo_parameters(3)  # type: ignore[arg-type]


def test_set_get_reset_and_edges_of_the_ranges():
    set_algo_parameters(fully_use_devices=False)
    assert get_algo_parameters("fully_use_devices") is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.AutoParallelWarning)
        set_algo_parameters(tensor_slice_align_size=1)
        set_algo_parameters(tensor_slice_align_size=1024, algo_approxi_epsilon=1.0)
        set_algo_parameters(algo_approxi_epsilon=1e-9)
    assert (get_algo_parameters("tensor_slice_align_size"),
            get_algo_parameters("algo_approxi_epsilon")) == (1024, 1e-9)
    reset_algo_parameters()
    assert values() == DEFAULTS


@pytest.mark.parametrize("key,value", [("tensor_slice_align_enable", True),
                                       ("tensor_slice_align_size", 8),
                                       ("enable_algo_approxi", True),
                                       ("algo_approxi_epsilon", 0.2)])
def test_parameters_without_effect_warn_the_reason(key, value):
    assert key in NO_EFFECT
    with pytest.warns(ap.AutoParallelWarning) as caught:
        set_algo_parameters(**{key: value})
    assert len(caught) == 1 and str(caught[0].message).startswith(f"{key}={value!r}")
    assert NO_EFFECT[key] in str(caught[0].message)
    assert get_algo_parameters(key) == value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_algo_parameters(**{key: MINDSPORE_DEFAULTS[key]})  # the default says nothing


def test_scoped_and_per_thread_like_the_context():
    set_algo_parameters(elementwise_op_strategy_follow=True)
    with algo_parameters_context(fully_use_devices=False) as params:
        assert params.fully_use_devices is False
        assert get_algo_parameters("elementwise_op_strategy_follow") is True
        set_algo_parameters(elementwise_op_strategy_follow=False)  # ends with the block
    assert values() == {**DEFAULTS, "elementwise_op_strategy_follow": True}
    with pytest.raises(RuntimeError):
        with algo_parameters_context(fully_use_devices=False):
            raise RuntimeError("boom")
    assert get_algo_parameters("fully_use_devices") is True

    seen = {}

    def worker() -> None:
        seen["default"] = current_algo_parameters().elementwise_op_strategy_follow
        set_algo_parameters(fully_use_devices=False)
        seen["set"] = get_algo_parameters("fully_use_devices")

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"default": False, "set": False}
    assert get_algo_parameters("fully_use_devices") is True  # the main thread untouched


# --------------------------------------------------------------------------- honoured by search
def _slow_links() -> ap.Cluster:
    base = ap.CLUSTERS["accelerator-8x"].model_dump()
    return ap.Cluster(**{**base, "name": "slow-links", "intra_bandwidth": 1e6,
                         "inter_bandwidth": 1e6, "intra_alpha": 1e-2, "inter_alpha": 1e-2})


def test_fully_use_devices_is_the_default_of_search():
    """On links so slow that any communication loses, only fully_use_devices=False may leave
    the operators replicated (repeating their work on every device)."""
    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"]))

    g = ap.trace(loss, {"w": jnp.ones((256, 8192))}, jnp.ones((256, 256)))
    slow = _slow_links()
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  dataset_strategy="full_batch"):
        full = ap.search(g, cluster=slow)
        assert full.nodes["dot_general_0"].strategy == ((1, 1), (1, 8))
        set_algo_parameters(fully_use_devices=False)
        repeat = ap.search(g, cluster=slow)
        assert repeat.nodes["dot_general_0"].strategy == ((1, 1), (1, 1))
        assert repeat.cost.total < full.cost.total
        assert ap.search(g, cluster=slow, fully_use_devices=True).nodes == full.nodes  # explicit
        assert ap.search(g, cluster=slow, fully_use_devices=False).nodes == repeat.nodes


def _violations(graph, plan) -> list[str]:
    """Elementwise operators whose first full-rank array input is not split as it was made."""
    bad = []
    for node in graph.nodes:
        if KINDS.get(node.op) != "elementwise":
            continue
        for j, v in enumerate(node.inputs):
            if graph.values[v].kind not in ("activation", "data") or \
                    graph.spec(v).shape != graph.spec(node.outputs[0]).shape:
                continue
            if plan.nodes[node.name].strategy[j] != plan.layouts[v].split_counts(plan.mesh):
                bad.append(node.name)
            break
    return bad


@pytest.mark.parametrize("mode", ["dynamic_programming", "recursive_programming"])
def test_elementwise_op_strategy_follow(mode):
    m = tfm_stack(blocks=1, batch=2, seq=8, hidden=32, heads=2)
    g = ap.trace(m.loss, *m.example_args(jax.random.key(0)))
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel", search_mode=mode):
        free = ap.search(g)
        with algo_parameters_context(elementwise_op_strategy_follow=True):
            follow = ap.search(g)
    assert _violations(g, free) == ["block0/attn/add_0"]  # the residual add reads the batch
    assert _violations(g, follow) == []
    assert follow.nodes["block0/attn/add_0"].strategy[0] == (8, 1)
    assert any("elementwise_op_strategy_follow" in n for n in follow.notes)
    assert not any("elementwise_op_strategy_follow" in n for n in free.notes)


def test_elementwise_follow_keeps_user_strategies_and_only_acts_in_auto_parallel():
    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"]))

    g = ap.trace(loss, {"w": jnp.ones((16, 32))}, jnp.ones((8, 16)))
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        with algo_parameters_context(elementwise_op_strategy_follow=True):
            plan = ap.search(g, fixed={"dot_general_0": ((2, 1), (1, 4)),
                                       "tanh_0": ((8, 1),)})
    assert plan.nodes["tanh_0"].strategy == ((8, 1),)  # the user's strategy wins
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel"):
        base = ap.search(g)
        with algo_parameters_context(elementwise_op_strategy_follow=True):
            assert ap.search(g).nodes == base.nodes


def test_search_settings_carry_the_parameters():
    assert SearchSettings().elementwise_op_strategy_follow is False
    cfg = ap.context.current_config()
    s = SearchSettings.from_config(cfg, fully_use_devices=False,
                                   elementwise_op_strategy_follow=True)
    assert (s.fully_use_devices, s.elementwise_op_strategy_follow) == (False, True)
