"""jax.checkpoint / remat kept through trace -> rewrite -> lower, and priced
(autopar/graph/remat.py): nodes carry their region and what the policy saves, the compiled
program recomputes, the gradients stay exact, and the memory and time models see the
recomputation."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

import autopar as ap
import numerics
from autopar.graph.remat import spans
from autopar.strategies.problem import Problem
from autopar.strategies.cost import CostModel
from autopar.strategies.layout import DeviceMesh
from clusters import COMPUTE_BOUND

POLICIES = jax.checkpoint_policies
D = 16


def block(w, x):
    h = checkpoint_name(jnp.tanh(x @ w["a"]), "h")
    return jnp.sin(h @ w["b"]) + x


def make_loss(policy=None, remat=True, scan=False, layers=2):
    b = jax.checkpoint(block, policy=policy) if remat else block

    def loss(w, x):
        if scan:
            x, _ = jax.lax.scan(lambda c, wi: (b(wi, c), None), x, w)
        else:
            for i in range(layers):
                x = b(jax.tree.map(lambda a: a[i], w), x)
        return jnp.mean(x ** 2)
    return loss


def example(batch=64, layers=2):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = {"a": jax.random.normal(k1, (layers, D, 4 * D)) / 4,
         "b": jax.random.normal(k2, (layers, 4 * D, D)) / 8}
    return w, jax.random.normal(k3, (batch, D))


def tags(policy):
    w, x = example()
    g = ap.trace(make_loss(policy), w, x)
    return {(n.remat.region if n.remat else None, n.op): n.remat.saved if n.remat else None
            for n in g.nodes if n.op in ("dot_general", "tanh", "name", "sin")}


def test_regions_and_policies_are_traced():
    full = tags(None)
    assert set(full) >= {("remat_0", "tanh"), ("remat_1", "sin"), ("remat_1", "name")}
    assert not any(full.values())  # the default policy saves nothing
    names = tags(POLICIES.save_only_these_names("h"))
    assert names[("remat_0", "name")] and not names[("remat_0", "tanh")]
    but = tags(POLICIES.save_any_names_but_these("h"))
    assert not but[("remat_0", "name")]
    dots = tags(POLICIES.dots_saveable)
    assert dots[("remat_0", "dot_general")] and not dots[("remat_0", "sin")]
    assert all(tags(POLICIES.everything_saveable).values())
    assert not any(tags(POLICIES.nothing_saveable).values())
    w, x = example()
    g = ap.trace(make_loss(remat=False), w, x)
    assert all(n.remat is None for n in g.nodes)


def test_flax_and_equinox_remat_are_regions():
    eqx = pytest.importorskip("equinox")
    nn = pytest.importorskip("flax.linen")
    f = eqx.filter_checkpoint(lambda w, x: jnp.tanh(x @ w))
    g = ap.trace(lambda w, x: f(w, x).sum(), jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert [str(n.remat) for n in g.nodes] == ["remat_0[recomputed]"] * 2 + ["None"]

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.tanh(nn.Dense(4)(x))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.remat(Block, policy=POLICIES.dots_saveable)()(x).sum()

    m, x = Model(), jnp.ones((2, 4))
    g = ap.trace(lambda p, x: m.apply(p, x), m.init(jax.random.key(0), x), x)
    assert {n.op: str(n.remat) for n in g.nodes if n.op in ("dot_general", "tanh")} == \
        {"dot_general": "remat_0[saved]", "tanh": "remat_0[recomputed]"}


def test_offloading_policy_is_a_typed_error():
    policy = POLICIES.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"],
        offload_src="device", offload_dst="pinned_host")
    with pytest.raises(ap.AutoParallelError, match="offload"):
        ap.trace(make_loss(policy), *example())


def _step(loss, w, x, mode="data_parallel"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ap.auto_parallel_context(device_num=8, parallel_mode=mode, gradients_mean=True):
            return ap.train_step(loss, w, (x,), optax.sgd(0.1), cluster=COMPUTE_BOUND)


def test_lowered_step_recomputes_and_stays_exact():
    """Layers scanned (XLA's CPU compiler honours remat there; unrolled, it removes the
    optimization barriers and merges the recomputation back): the compiled step runs
    tanh twice (forward, and again in backward), holds less, and trains exactly."""
    w, x = example(batch=256)
    compiled = {}
    for name, policy, remat in (("none", None, False), ("full", None, True),
                                ("names", POLICIES.save_only_these_names("h"), True)):
        step = _step(make_loss(policy, remat, scan=True), w, x)
        c = step.lower(w, step.init(w), x).compile()
        compiled[name] = (c.as_text().count("tanh("), c.memory_analysis().temp_size_in_bytes,
                          step.plan.cost.memory_bytes)
        if name == "names":
            got = step(w, step.init(w), x)[0]

            def sgd(w, x):  # the reference: no remat, float64
                g = jax.grad(make_loss(remat=False, scan=True))(w, x)
                return jax.tree.map(lambda p, d: p - 0.1 * d, w, g)
            numerics.assert_close(got, sgd, w, x)
    assert compiled["none"][0] == 1 and compiled["full"][0] == 2 and compiled["names"][0] == 2
    assert compiled["full"][1] < compiled["names"][1] < compiled["none"][1]  # XLA's temp
    assert compiled["full"][2] < compiled["names"][2] < compiled["none"][2]  # predicted


def test_unrolled_regions_lower_as_checkpoints_under_tensor_parallel():
    """Each region's span (its operators and the collectives between them) is one
    jax.checkpoint in the lowered program; gradients stay exact under a split plan."""
    w, x = example(batch=8)
    loss = make_loss(POLICIES.dots_saveable)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  search_mode="dynamic_programming", gradients_mean=True):
        fn = ap.parallelize(jax.value_and_grad(loss), w, x, cluster=COMPUTE_BOUND)
    got = fn(w, x)
    numerics.assert_close(got, jax.value_and_grad(loss), w, x)
    step = _step(loss, w, x)
    assert len(spans(step.parallel_graph.nodes)) == 2
    text = step.lower(w, step.init(w), x).as_text()
    assert text.count("optimization_barrier") >= 2


def test_memory_and_time_price_the_recomputation():
    w, x = example(batch=512, layers=3)
    mesh, cm = DeviceMesh.for_devices(1), CostModel(COMPUTE_BOUND)
    out = {}
    for name, policy, remat in (("none", None, False), ("full", None, True),
                                ("names", POLICIES.save_only_these_names("h"), True)):
        g = ap.trace(make_loss(policy, remat, layers=3), w, x)
        p = Problem(g, mesh, cm, lazy=True)
        picks = p.settle({i: (1,) * len(p.specs[v.name].sizes) for i, v in p.iter_ops()})
        p.pick_parameters(picks)
        m = p.step_memory(picks, update=False)
        out[name] = (m.activations, m.peak, p.evaluate(picks)[0].compute)
    assert out["full"][0] < out["names"][0] < out["none"][0]  # kept from forward to backward
    assert out["full"][1] < out["none"][1]  # the recomputed residuals are a transient
    assert out["none"][2] < out["names"][2] <= out["full"][2]  # forward again in backward


def test_a_remat_loop_body_recomputes_one_iteration_in_backward():
    """Layers scanned with jax.checkpoint: the loop keeps each iteration's inputs, and its
    backward holds one iteration's recomputed residuals beside them (a transient)."""
    from autopar.strategies.loops import planned_problem

    w, x = example(batch=512, layers=3)
    out = {}
    for name, remat in (("none", False), ("full", True)):
        g = ap.trace(make_loss(remat=remat, scan=True), w, x)
        plan = ap.search(g, device_num=1, parallel_mode="auto_parallel", cluster=COMPUTE_BOUND)
        problem, picks = planned_problem(g, plan, CostModel(COMPUTE_BOUND))
        loop = next(n for n in g.nodes if n.kind == "loop")
        again = problem._loop_recomputed(loop, plan.nodes[loop.name].splits)
        out[name] = (again, problem.step_memory(picks, update=False))
    assert out["none"][0] == 0 and out["full"][0] >= 512 * 4 * D * 4  # tanh's output, at least
    assert out["full"][1].activations < out["none"][1].activations
    assert (out["full"][1].phase, out["full"][1].at) == ("backward", "scan_0")
