"""Mixed precision in the price: optimizer state from ``optimizer.init``, gradient_fp32_sync
at the bytes it sends, per-dtype FLOP/s (strategies/precision.py)."""

import jax
import jax.numpy as jnp
import optax
import pytest

import autopar as ap
from autopar.strategies.precision import optimizer_state


def _graph(dtype):
    params = {"w1": jnp.ones((64, 256), dtype), "w2": jnp.ones((256, 64), dtype)}

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"]).astype(jnp.float32)
    return ap.trace(loss, params, jnp.ones((32, 64), dtype)), params


def _plan(g, *, optimizer=None, cluster="accelerator-8x", **ctx):
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel", **ctx):
        return ap.search(g, cluster=cluster, optimizer=optimizer)


def test_optimizer_state_is_what_init_keeps_per_parameter():
    p = {"a": jnp.ones((8, 4), jnp.bfloat16), "b": jnp.ones((3,), jnp.float32)}
    assert optimizer_state(optax.adam(1e-3), p) == (2.0, 2.0)
    assert optimizer_state(optax.adam(1e-3, mu_dtype=jnp.float32), p) == (3.0, 2.0)
    assert optimizer_state(optax.sgd(1e-3), p) == (0.0, 0.0)
    assert optimizer_state(optax.sgd(1e-3, momentum=0.9), p) == (1.0, 1.0)


def test_memory_prices_the_optimizers_state_not_a_factor():
    g, params = _graph(jnp.float32)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    default, adam = _plan(g), _plan(g, optimizer=optax.adam(1e-3))
    sgd, momentum = _plan(g, optimizer=optax.sgd(0.1)), _plan(
        g, optimizer=optax.sgd(0.1, momentum=0.9))
    # the cluster's factor (2) is Adam's fp32 state: the same bytes
    assert adam.cost.memory_bytes == default.cost.memory_bytes
    # each parameter's worth of state is held throughout the step (the peak may move
    # from backward to the update as it grows)
    assert momentum.cost.memory_bytes - sgd.cost.memory_bytes >= nbytes
    assert adam.cost.memory_bytes - momentum.cost.memory_bytes >= nbytes
    assert sgd.cost.compute < adam.cost.compute  # the update reads and writes less state


def test_bf16_parameters_with_fp32_moments_hold_more():
    g, _ = _graph(jnp.bfloat16)
    low = _plan(g, optimizer=optax.adam(1e-3))
    wide = _plan(g, optimizer=optax.adam(1e-3, mu_dtype=jnp.float32))
    assert wide.cost.memory_bytes > low.cost.memory_bytes


def test_gradient_fp32_sync_is_priced_at_the_bytes_it_sends():
    g, _ = _graph(jnp.bfloat16)
    semi = dict(parallel_mode="semi_auto_parallel")
    with ap.auto_parallel_context(device_num=8, gradient_fp32_sync=True, **semi):
        up = ap.search(g, cluster="accelerator-8x")
    with ap.auto_parallel_context(device_num=8, gradient_fp32_sync=False, **semi):
        own = ap.search(g, cluster="accelerator-8x")
    assert up.cost.gradient_sync > own.cost.gradient_sync > 0
    g32, _ = _graph(jnp.float32)  # an fp32 gradient is sent as it is either way
    with ap.auto_parallel_context(device_num=8, gradient_fp32_sync=True, **semi):
        a = ap.search(g32, cluster="accelerator-8x")
    with ap.auto_parallel_context(device_num=8, gradient_fp32_sync=False, **semi):
        b = ap.search(g32, cluster="accelerator-8x")
    assert a.cost.gradient_sync == b.cost.gradient_sync


def test_peak_flops_by_dtype_prices_a_bf16_matmul_at_its_own_rate():
    w, x = jnp.ones((1024, 1024), jnp.bfloat16), jnp.ones((4096, 1024), jnp.bfloat16)
    g = ap.trace(lambda w, x: jnp.sum((x @ w).astype(jnp.float32)), w, x)  # compute-bound
    base = ap.CLUSTERS["accelerator-8x"]
    fast = base.model_copy(update={"peak_flops_by_dtype": {"bfloat16": 100 * base.peak_flops}})
    slow = base.model_copy(update={"peak_flops_by_dtype": {"float16": 100 * base.peak_flops}})
    assert _plan(g, cluster=fast).cost.compute < _plan(g, cluster=base).cost.compute
    assert _plan(g, cluster=slow).cost.compute == _plan(g, cluster=base).cost.compute


def test_train_step_prices_its_own_optimizer():
    _, params = _graph(jnp.float32)
    x = jnp.ones((32, 64))

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True):
        sgd = ap.train_step(loss, params, (x,), optax.sgd(0.1))
        adam = ap.train_step(loss, params, (x,), optax.adam(1e-3))
    assert adam.plan.cost.memory_bytes > sgd.plan.cost.memory_bytes


def test_an_optimizer_that_is_no_optimizer_is_refused_by_name():
    g, _ = _graph(jnp.float32)
    with pytest.raises(ap.AutoParallelTypeError, match="optimizer"):
        _plan(g, optimizer="adam")


# -------------------------------------------------------------- when nothing fits


def _wide():
    params = {"w1": jnp.ones((512, 1024)), "w2": jnp.ones((1024, 512))}

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])
    return ap.trace(loss, params, jnp.ones((64, 512))), sum(
        x.nbytes for x in jax.tree.leaves(params))


def _budget(nbytes):
    return ap.CLUSTERS["accelerator-8x"].model_copy(update={"memory_bytes": float(nbytes)})


def test_no_fit_names_its_lower_bound_and_the_knobs_that_fit():
    g, nbytes = _wide()
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel"):
        dp = ap.search(g, cluster="accelerator-8x", optimizer=optax.adam(1e-3))
    # data parallel holds every parameter, gradient and Adam state whole: give it a budget
    # under that but over the state split 8 ways; semi_auto_parallel (data parallel here)
    # then fits only with the parallel optimizer
    budget = _budget(0.8 * dp.cost.memory_bytes)
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel"):
        with pytest.raises(ap.MemoryBudgetError) as e:
            ap.search(g, cluster=budget, optimizer=optax.adam(1e-3))
    err = e.value
    assert err.lower_bound == pytest.approx(4 * nbytes / 8)   # (1 + 1 + 2) x params / 8
    assert "enable_parallel_optimizer=True" in err.fits
    assert err.fits["enable_parallel_optimizer=True"] <= budget.memory_bytes
    # every device holds the whole state under data parallel: more devices do not help
    assert not any(k.startswith("device_num") for k in err.fits)
    assert "fits with enable_parallel_optimizer=True" in str(err)
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  enable_parallel_optimizer=True,
                                  parallel_optimizer_config={
                                      "parallel_optimizer_threshold": 0}):
        assert ap.search(g, cluster=budget, optimizer=optax.adam(1e-3)).cost.memory_bytes \
            <= budget.memory_bytes


def test_no_fit_below_the_lower_bound_says_no_layout_fits():
    g, nbytes = _wide()
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        with pytest.raises(ap.MemoryBudgetError, match="no layout on these devices fits") as e:
            ap.search(g, cluster=_budget(0.5 * 4 * nbytes / 8), optimizer=optax.adam(1e-3))
    assert "enable_parallel_optimizer=True" not in e.value.fits   # it cannot beat the bound
    more = {k: v for k, v in e.value.fits.items() if k.startswith("device_num=")}
    assert len(more) == 1 and max(more.values()) <= 0.5 * 4 * nbytes / 8  # the fewest that fit


def test_a_fit_at_more_than_1_5x_the_step_time_warns(monkeypatch):
    import autopar.strategies.search as search
    g, _ = _wide()
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        free = ap.search(g, cluster="accelerator-8x")
        monkeypatch.setattr(search, "SLOW_FIT", 0.0)   # every priced fit is "slow" now
        with pytest.warns(ap.AutoParallelWarning, match="fits the .* budget .* only at"):
            fit = ap.search(g, cluster=_budget(0.99 * free.cost.memory_bytes))
    assert fit.cost.memory_bytes <= 0.99 * free.cost.memory_bytes


@pytest.mark.parametrize("name", ["dgx-a100-80gb", "dgx-h100-80gb"])
def test_gpu_presets_price_a_bf16_matmul_at_the_tensor_core_rate(name):
    from autopar.strategies.cost import CostModel
    c = ap.CLUSTERS[name]
    cm = CostModel(c)
    bf16 = cm.compute_time(1e12, 0.0, launch=False, dtype="bfloat16")
    assert bf16 == pytest.approx(1e12 / c.peak_flops_by_dtype["bfloat16"])
    assert 1.9 < cm.compute_time(1e12, 0.0, launch=False, dtype="float32") / bf16 < 2.1
    w, x = jnp.ones((4096, 4096), jnp.bfloat16), jnp.ones((8192, 4096), jnp.bfloat16)
    g = ap.trace(lambda w, x: jnp.sum((x @ w).astype(jnp.float32)), w, x)
    with ap.auto_parallel_context(device_num=16, parallel_mode="auto_parallel"):
        assert ap.search(g, cluster=name).cluster == name
