"""Recomputation autopar adds (autopar/strategies/recompute.py): the ``recompute`` key tags
the repeated layers ('full') or their attention cores ('selective'), the models price it
(memory down, time up), the lowered step recomputes and stays exact, and the configuration
search chooses it where nothing fits without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import autopar as ap
import numerics
from autopar.errors import AutoParallelError, MemoryBudgetError
from autopar.models import transformer
from autopar.strategies.cost import CostModel
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.problem import Problem
from autopar.strategies.recompute import attention_core, blocks, with_recompute
from clusters import COMPUTE_BOUND


def decoder(seq=8, batch=8, layers=2):
    m = transformer(layers=layers, hidden=16, heads=2, seq=seq, vocab=32, batch=batch)
    args = m.example_args(jax.random.key(0))
    return m, args, ap.trace(m.loss, *args)


def test_full_tags_each_repeated_layer_and_selective_its_attention_core():
    _, _, g = decoder()
    assert [top for top, _ in blocks(g)] == ["block0", "block1"]
    full = with_recompute(g, "full")
    for n in full.nodes:
        top = n.scope.split("/")[0]
        assert (n.remat.region if n.remat else None) == (
            f"recompute_{top}" if top in ("block0", "block1") else None)
    sel = with_recompute(g, "selective")
    core = [n for n in sel.nodes if n.remat is not None and n.remat.region == "recompute_block0"]
    params = set(g.parameters())
    assert core[0].op == core[-1].op == "dot_general"
    assert {"exp", "reduce_sum"} <= {n.op for n in core}
    # the attention core holds no matmul with a weight: the projections stay stored
    assert not any(n.op == "dot_general" and set(n.inputs) & params for n in core)
    assert core == attention_core(g, dict(blocks(g))["block0"]) or \
        [n.name for n in core] == [n.name for n in attention_core(g, dict(blocks(g))["block0"])]
    assert with_recompute(g, "none") is g


def test_a_layer_with_the_users_own_checkpoint_is_left_as_written():
    def layer(w, x):
        return jnp.tanh(x @ w)

    def loss(ws, x):
        with jax.named_scope("layer0"):
            x = jax.checkpoint(layer)(ws[0], x)
        with jax.named_scope("layer1"):
            x = layer(ws[1], x)
        return jnp.mean(x ** 2)

    g = ap.trace(loss, [jnp.ones((4, 4))] * 2, jnp.ones((2, 4)))
    regions = {n.scope.split("/")[0]: n.remat.region for n in with_recompute(g, "full").nodes
               if n.remat is not None}
    assert regions["layer0"].startswith("remat_") and regions["layer1"] == "recompute_layer1"


def test_numbered_layers_are_found_below_a_models_own_scope_and_none_is_said():
    def layer(w, x):
        return jnp.tanh(x @ w)

    def nested(ws, x):  # (flax's Decoder/block_0, keras-hub's backbone/transformer_layer_0)
        with jax.named_scope("model"):
            for i, w in enumerate(ws):
                with jax.named_scope(f"layer_{i}"):
                    x = layer(w, x)
        return jnp.mean(x ** 2)

    ws, x = [jnp.ones((4, 4))] * 3, jnp.ones((2, 4))
    g = ap.trace(nested, ws, x)
    assert [top for top, _ in blocks(g)] == ["model/layer_0", "model/layer_1", "model/layer_2"]
    flat = ap.trace(lambda ws, x: jnp.mean(layer(ws[0], x) ** 2), ws, x)
    with pytest.warns(ap.AutoParallelWarning, match="no repeated layers"):
        assert with_recompute(flat, "full") is flat


def test_a_bad_recompute_is_a_typed_error_naming_the_key():
    _, _, g = decoder()
    with pytest.raises(AutoParallelError, match="recompute"):
        with_recompute(g, "all")
    with pytest.raises(AutoParallelError, match="recompute='sometimes'"):
        ap.set_auto_parallel_context(recompute="sometimes")
    assert ap.get_auto_parallel_context("recompute") == "none"


def test_memory_goes_down_and_time_up_with_recomputation():
    _, _, g = decoder(seq=64, batch=16)
    out = {}
    for kind in ("none", "selective", "full"):
        p = Problem(with_recompute(g, kind), DeviceMesh.for_devices(1), CostModel(COMPUTE_BOUND),
                    lazy=True)
        picks = p.settle({i: (1,) * len(p.specs[v.name].sizes) for i, v in p.iter_ops()})
        p.pick_parameters(picks)
        out[kind] = (p.step_memory(picks, update=False).activations,
                     p.evaluate(picks)[0].compute)
    assert out["full"][0] < out["selective"][0] < out["none"][0]
    assert out["none"][1] < out["selective"][1] < out["full"][1]


@pytest.mark.parametrize("kind", ["selective", "full"])
def test_the_step_recomputes_and_its_gradients_stay_exact(kind):
    m, args, _ = decoder()
    params, batch = args[0], args[1:]
    texts = {}
    for k in ("none", kind):
        with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                      gradients_mean=True, recompute=k):
            step = ap.train_step(m.loss, params, batch, optax.sgd(0.1), cluster=COMPUTE_BOUND)
        texts[k] = step.lower(step.prepare(params), step.init(params), *batch).as_text()
    got = step.grads(step.prepare(params), *batch)
    numerics.assert_close(got, jax.value_and_grad(m.loss), params, *batch)
    # jax.checkpoint's backward runs behind optimization barriers: none without it
    assert texts["none"].count("optimization_barrier") == 0
    assert texts[kind].count("optimization_barrier") >= 2


def test_the_configuration_search_recomputes_where_nothing_else_fits():
    m = transformer(layers=2, hidden=16, heads=2, seq=64, vocab=32, batch=1)  # (no smaller
    params, *batch = jax.eval_shape(m.example_args, jax.random.key(0))    # micro-batch)
    prices = {}
    for kind in ("none", "full"):
        with ap.auto_parallel_context(device_num=1, parallel_mode="auto_parallel",
                                      recompute=kind):
            c = ap.search_configuration(m.loss, params, tuple(batch), cluster=COMPUTE_BOUND)
        prices[kind] = min((x.memory_bytes, x.step_seconds) for x in c.ranked if x.fits)
    budget = (prices["none"][0] + prices["full"][0]) / 2
    tight = COMPUTE_BOUND.model_copy(update={"memory_bytes": budget})
    with ap.auto_parallel_context(device_num=1, parallel_mode="auto_parallel",
                                  auto_pipeline=True):
        found = ap.search_configuration(m.loss, params, tuple(batch), cluster=tight)
    assert found.best.fits and found.best.recompute in ("selective", "full")
    assert found.best.step_seconds > prices["none"][1]  # (forward again in backward)
    assert found.best.context()["recompute"] == found.best.recompute
    assert found.best.recompute in found.table()
    with ap.auto_parallel_context(device_num=1, parallel_mode="auto_parallel",
                                  auto_pipeline=True, recompute="none"):
        with pytest.raises(MemoryBudgetError):
            ap.search_configuration(m.loss, params, tuple(batch), cluster=tight)


def between_full_and_none(g):
    """The cluster whose budget is halfway between the one-device plan's memory with full
    recomputation and without any."""
    with ap.auto_parallel_context(device_num=1, parallel_mode="auto_parallel"):
        plain = ap.search(g, cluster=COMPUTE_BOUND).cost.memory_bytes
        full = ap.search(with_recompute(g, "full"), cluster=COMPUTE_BOUND).cost.memory_bytes
    return COMPUTE_BOUND.model_copy(update={"memory_bytes": (plain + full) / 2})


def test_the_no_fit_error_tries_recomputation():
    _, _, g = decoder(seq=64, batch=1)
    tight = between_full_and_none(g)
    with ap.auto_parallel_context(device_num=1, parallel_mode="auto_parallel"):
        with pytest.raises(MemoryBudgetError) as e:
            ap.search(g, cluster=tight)
    assert "recompute='full'" in e.value.fits and e.value.fits["recompute='full'"] < \
        tight.memory_bytes
    assert "fits with" in str(e.value) and "recompute='full'" in str(e.value)


def test_train_step_under_auto_pipeline_builds_the_recomputation_it_chose():
    m, args, g = decoder(seq=64, batch=1)
    tight = between_full_and_none(g)
    with ap.auto_parallel_context(device_num=1, parallel_mode="auto_parallel",
                                  auto_pipeline=True):
        step = ap.train_step(m.loss, args[0], args[1:], optax.adam(0.1), cluster=tight)
    chosen = step.configuration.best.recompute
    assert chosen != "none" and step.setup.config.recompute == chosen
    state = (step.prepare(args[0]), step.init(args[0]))
    assert step.lower(*state, *args[1:]).as_text().count("optimization_barrier") >= 2
    _, _, loss = step(*state, *args[1:])
    assert float(loss) == pytest.approx(float(m.loss(*args)), rel=1e-6)
