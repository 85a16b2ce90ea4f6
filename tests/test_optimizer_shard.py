"""The parallel optimizer: large parameters reduce-scattered / sharded / all-gathered, equal to
one device, ~1/dp of the memory, bucketed by comm_fusion allgather / reducescatter."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import autopar as ap
from autopar.models import mlp
from autopar.optimizer_shard import decide_sharding, device_bytes, storage_spec
from jax.sharding import PartitionSpec as P

import numerics

KEY = jax.random.key(0)
OPT = optax.sgd(0.1, momentum=0.9)  # state: one parameter-shaped trace per parameter


def _model():
    m = mlp(widths=(16, 256, 256, 16), batch=32)
    params, x = m.example_args(KEY)
    return m, params, x


def _step(m, params, x, opt=OPT, mode="semi_auto_parallel", **ctx):
    with ap.auto_parallel_context(device_num=8, parallel_mode=mode, gradients_mean=True,
                                  **ctx):
        return ap.train_step(m.loss, params, (x,), opt)


_REFS: dict[tuple, numerics.Reference] = {}


def _reference(m, params, x, opt, steps):
    """Parameters after ``steps`` one-device updates, float64 and float32; cached for OPT."""
    key = (repr(m.config), steps) if opt is OPT else None
    if key in _REFS:
        return _REFS[key]
    run = numerics.optimizer_steps(m.loss, opt, steps)
    ref = numerics.reference(lambda *a: run(*a)[0], params, x, jit=False)
    if key is not None:
        _REFS[key] = ref
    return ref


def _run(step, params, x, steps):
    p, s = step.prepare(params), step.init(params)
    for _ in range(steps):
        p, s, _ = step(p, s, x)
    return p, s


@pytest.mark.parametrize("ctx", [
    dict(),
    dict(grad_accumulation_step=2),
    dict(grad_accumulation_step=2, parallel_optimizer_config={
        "gradient_accumulation_shard": False}),
    dict(comm_fusion={"allreduce": {"mode": "auto"}, "allgather": {"mode": "auto"},
                      "reducescatter": {"mode": "auto"}}),
])
def test_parallel_optimizer_equals_one_device(ctx):
    m, params, x = _model()
    step = _step(m, params, x, enable_parallel_optimizer=True, **ctx)
    assert [d.sharded for d in step.sharding] == [False, False, False, True, False, False]
    got, _ = _run(step, params, x, 3)
    numerics.check(got, _reference(m, params, x, OPT, 3))


def test_adam_and_data_parallel_mode():
    m, params, x = _model()
    opt = optax.adam(1e-3)
    step = _step(m, params, x, opt, mode="data_parallel", enable_parallel_optimizer=True,
                 parallel_optimizer_config={"parallel_optimizer_threshold": 0})
    assert all(d.sharded for d in step.sharding if d.nbytes >= 8 * 4)
    got, _ = _run(step, params, x, 2)
    numerics.check(got, _reference(m, params, x, opt, 2))


def test_per_device_memory_is_about_one_over_dp_for_large_parameters():
    m, params, x = _model()
    dev = jax.devices()[0]
    sizes = {}
    for on in (False, True):
        cfg = dict(parallel_optimizer_config={"parallel_optimizer_threshold": 16}) if on else {}
        step = _step(m, params, x, enable_parallel_optimizer=on, **cfg)
        p, s = _run(step, params, x, 1)
        large = [k for k, d in enumerate(step.sharding) if d.nbytes >= 16 * 1024]
        leaves = jax.tree.leaves(p)
        trace = jax.tree.leaves(s[0].trace)
        sizes[on] = (device_bytes([leaves[k] for k in large], dev),
                     device_bytes([trace[k] for k in large], dev))
        for k in large:  # the stored shard is 1/8 along dim 0, state likewise
            shard = leaves[k].addressable_shards[0].data.shape
            assert shard[0] == leaves[k].shape[0] // (8 if on else 1)
            assert trace[k].addressable_shards[0].data.shape == shard
    assert sizes[True][0] * 8 == sizes[False][0]
    assert sizes[True][1] * 8 == sizes[False][1]


def test_reduce_scatter_and_all_gather_counts_follow_comm_fusion():
    m, params, x = _model()
    cfg = dict(enable_parallel_optimizer=True,
               parallel_optimizer_config={"parallel_optimizer_threshold": 16})
    sharded = 3  # the three weights
    plain = _step(m, params, x, **cfg)
    fused = _step(m, params, x, comm_fusion={"allgather": {"mode": "auto"},
                                             "reducescatter": {"mode": "size", "config": 64}},
                  **cfg)
    for step, want in ((plain, sharded), (fused, 1)):
        assert sum(d.sharded for d in step.sharding) == sharded
        c = step.collective_counts(params, step.init(params), x)
        assert c["reduce_scatter"] == want and c["all_gather"] == want, c
        # the small parameters keep their all-reduce (+ the loss)
        assert c["all_reduce"] == len(jax.tree.leaves(params)) - sharded + 1
    got, _ = _run(fused, params, x, 2)
    numerics.check(got, _reference(m, params, x, OPT, 2))


def test_gradient_accumulation_shard_keeps_the_accumulator_sharded():
    m, params, x = _model()
    texts = {}
    for flag in (True, False):
        step = _step(m, params, x, enable_parallel_optimizer=True, grad_accumulation_step=2,
                     parallel_optimizer_config={"gradient_accumulation_shard": flag})
        texts[flag] = next(ln for ln in step.as_text(params, step.init(params), x)
                           .split("\n") if "stablehlo.while" in ln)
    # the scan carries the 1/8 shard (32 x 256) of the 256 x 256 weight's accumulator, or not
    assert "tensor<32x256xf32>" in texts[True]
    assert "tensor<32x256xf32>" not in texts[False]


def test_sharding_decisions():
    sizes = {"a0": 4, "a1": 2}
    d = decide_sharding("w", (64, 256), (64, 256), 4, ("a0",), sizes, enabled=True,
                        threshold_kb=64)
    assert d.sharded and d.axes == ("a0",)
    assert not decide_sharding("w", (64, 256), (64, 256), 4, ("a0",), sizes, enabled=True,
                               threshold_kb=65).sharded  # 64 KB < 65 KB: not sharded
    assert decide_sharding("w", (64, 256), (64, 256), 4, ("a0",), sizes, enabled=True,
                           threshold_kb=64).sharded  # not smaller than the threshold
    assert "divide" in decide_sharding("w", (6, 4096), (6, 4096), 4, ("a0",), sizes,
                                       enabled=True, threshold_kb=0).reason
    assert "every mesh axis" in decide_sharding("w", (64, 64), (16, 32), 4, (), sizes,
                                                enabled=True, threshold_kb=0).reason
    assert not decide_sharding("w", (64, 64), (64, 64), 4, ("a0",), sizes, enabled=False,
                               threshold_kb=0).sharded
    assert storage_spec(P(), ("a0", "a1"), 2) == P(("a0", "a1"), None)
    assert storage_spec(P("a1"), ("a0",), 1) == P(("a1", "a0"))


def test_parallel_optimizer_config_is_validated():
    with pytest.raises(ap.AutoParallelError):
        ap.set_auto_parallel_context(parallel_optimizer_config={
            "parallel_optimizer_threshold": -1})
    with pytest.raises(TypeError):
        ap.set_auto_parallel_context(parallel_optimizer_config={
            "gradient_accumulation_shard": 1})
    with pytest.raises(ValueError):
        ap.set_auto_parallel_context(parallel_optimizer_config={
            "optimizer_weight_shard_size": 2})


def test_adafactor_factored_state_is_replicated_not_sharded():
    """R1 #3: a state leaf of another shape than its parameter (adafactor's factored row /
    column statistics) used to get the parameter's storage sharding: IndivisibleError."""
    m = mlp(widths=(16, 64, 64, 16), batch=16)
    params, x = m.example_args(KEY)
    opt = optax.adafactor(1e-2, min_dim_size_to_factor=8)
    step = _step(m, params, x, opt, enable_parallel_optimizer=True,
                 parallel_optimizer_config={"parallel_optimizer_threshold": 0})
    assert any(d.sharded for d in step.sharding)
    got, _ = _run(step, params, x, 2)
    numerics.check(got, _reference(m, params, x, opt, 2))


def test_state_shardings_keeps_storage_only_for_parameter_shaped_leaves():
    from jax.sharding import Mesh, NamedSharding

    from autopar.optimizer_shard import state_shardings

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    params = {"w": np.ones((4, 4), np.float32), "b": np.ones((4,), np.float32)}
    shs = {"w": NamedSharding(mesh, P("d")), "b": NamedSharding(mesh, P("d"))}
    opt = optax.adafactor(1e-2, min_dim_size_to_factor=2)
    state = opt.init(params)
    for shapes in (None, {"w": (4, 4), "b": (4,)}):
        sh = state_shardings(opt, state, shs, mesh, shapes)
        for leaf, s in zip(jax.tree.leaves(state), jax.tree.leaves(sh)):
            jax.device_put(leaf, s)  # every sharding lays its leaf out
            if np.shape(leaf) in ((), (1,)):
                assert s.spec == P()
    exact = state_shardings(opt, state, shs, mesh, {"w": (4, 4), "b": (4,)})
    # w's factored (4,) row/column statistics are replicated; b's full (4,) moment is sharded
    assert sorted(str(s.spec) for s in jax.tree.leaves(exact)).count("P('d',)") == 1


def test_scatter_gradients_checks_fp32_flags_length():
    from autopar.errors import AutoParallelError
    from autopar.optimizer_shard import scatter_gradients

    with pytest.raises(AutoParallelError, match="fp32"):
        scatter_gradients([np.ones(4, np.float32)] * 2, [("d",)] * 2, [[0, 1]], fp32=[True])
