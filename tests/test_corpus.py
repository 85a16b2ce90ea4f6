"""Library code through the search: models of the real-model corpus (benchmarks/corpus.py,
flax.linen, flax.nnx, equinox) trace, and the plan a search returns is never priced dearer
than autopar's data-parallel plan (its own parallel mode, built apart from the search) nor
than any hand plan it weighs."""

from __future__ import annotations

import pytest

import autopar as ap
from autopar.planner import ranked_candidates
from autopar.setup import resolve_setup
from autopar.strategies.baselines import HAND_PLAN_MARGIN
from benchmarks.corpus import CORPUS

# one model per library the dev extra installs (keras-hub, with TensorFlow, is the
# benchmark's: python -m benchmarks models)
MODELS = ("linen_decoder", "linen_decoder_scan", "nnx_mlp", "eqx_decoder")


@pytest.mark.parametrize("name", MODELS)
def test_library_code_is_never_priced_dearer_than_the_hand_plans(name):
    model = CORPUS[name]()
    graph = ap.trace(model.loss, model.params, *model.batch)
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel"):
        dp = ap.search(graph, cluster="cpu-emulated")
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        plan = ap.search(graph, cluster="cpu-emulated")
        ranked = ranked_candidates(graph, resolve_setup("cpu-emulated"))
    assert plan.cost.total <= dp.cost.total * (1 + 1e-9), (plan.cost.total, dp.cost.total)
    names = [n for n, _ in ranked]
    assert "data_parallel" in names and "dynamic_programming" in names
    # the search's own plan goes first only when cheaper than every hand plan by the margin
    assert plan.objective == ranked[0][1].objective
    own = dict(ranked)["dynamic_programming"].objective
    hands = min(p.objective for n, p in ranked if n != "dynamic_programming")
    assert (ranked[0][0] == "dynamic_programming") == (own < hands * (1 - HAND_PLAN_MARGIN))
    if name.endswith("decoder"):  # attention and MLP matmuls: Megatron's layout is weighed
        assert "megatron tp8" in names


def _one_sgd_step_is_jax_grads(model, rel, atol, rtol):
    """One SGD step (lr 1) of the default path's plan against jax.grad on one device; the
    step."""
    import jax
    import jax.numpy as jnp
    import optax

    want_loss, grads = jax.jit(jax.value_and_grad(model.loss))(model.params, *model.batch)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  gradients_mean=True):
        step = ap.train_step(model.loss, model.params, model.batch, optax.sgd(1.0),
                             cluster="cpu-emulated")
    new, _, loss = step(model.params, step.init(model.params), *model.batch)
    assert jax.tree.structure(new) == jax.tree.structure(model.params)
    assert float(loss) == pytest.approx(float(want_loss), rel=rel)
    for got, p, g in zip(jax.tree.leaves(new), jax.tree.leaves(model.params),
                         jax.tree.leaves(grads)):
        assert jnp.allclose(got, p - g, atol=atol, rtol=rtol)
    return step


def test_equinox_partitioned_parameters_train_exactly():
    """eqx.partition leaves None in the parameter tree (the MLP's activation function): the
    step keeps the tree as it is and one SGD step equals jax.grad's on one device."""
    import jax

    model = CORPUS["eqx_mlp"]()
    assert any(leaf is None for leaf in jax.tree.leaves(model.params,
                                                        is_leaf=lambda x: x is None))
    _one_sgd_step_is_jax_grads(model, 1e-6, 1e-6, 1e-5)


def test_a_scanned_linen_decoder_trains_exactly():
    """nn.scan over the blocks traces to one loop node; one SGD step of the searched plan
    equals jax.grad's on one device (float32, the loop's body planned once)."""
    model = CORPUS["linen_decoder_scan"]()
    graph = ap.trace(model.loss, model.params, *model.batch)
    assert sum(n.kind == "loop" for n in graph.nodes) == 1
    step = _one_sgd_step_is_jax_grads(model, 1e-5, 1e-5, 1e-4)
    assert "while" in step.as_text(model.params, step.init(model.params), *model.batch)
