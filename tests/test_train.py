"""Training steps: sharded SGD steps equal the single-device ones, and every context key that
acts on training (gradients_mean, loss_repeated_mean, gradient_fp32_sync, parameter_broadcast,
dataset_strategy/full_batch, enable_alltoall) changes what it should, observably."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar as ap
from autopar.lower import jax_mesh
from autopar.models import mlp, transformer
from clusters import COMPUTE_BOUND
import numerics
from autopar.strategies.layout import DeviceMesh

KEY = jax.random.key(0)
MODELS = {
    "mlp": lambda: mlp(widths=(16, 64, 16), batch=8),
    "transformer": lambda: transformer(layers=1, hidden=32, heads=2, seq=8, vocab=64, batch=8),
}
CONFIGS = {
    "data_parallel": dict(parallel_mode="data_parallel"),
    "semi_auto_parallel": dict(parallel_mode="semi_auto_parallel"),
    "dynamic_programming": dict(parallel_mode="auto_parallel", search_mode="dynamic_programming"),
}


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol,
                               atol=atol)


def collectives(text: str) -> dict[str, int]:
    kinds = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "collective_permute")
    return {k: len(re.findall(rf"stablehlo\.{k}\b", text)) for k in kinds}


def reference_steps(loss, params, batch, steps, opt=None, loss_scale=1.0):
    """(params, losses) after ``steps`` one-device optimizer steps, in float64 and float32."""
    return numerics.reference(numerics.optimizer_steps(loss, opt, steps, loss_scale),
                              params, *batch, jit=False)


_STEP_REFS: dict[str, numerics.Reference] = {}


def model_steps_reference(name, params, batch):
    """Three SGD steps of the zoo model ``name`` on one device, once per model."""
    if name not in _STEP_REFS:
        _STEP_REFS[name] = reference_steps(MODELS[name]().loss, params, batch, 3)
    return _STEP_REFS[name]


def run_steps(step, params, batch, steps):
    state = step.init(params)
    losses = []
    for _ in range(steps):
        params, state, l = step(params, state, *batch)
        losses.append(l)
    return params, losses


def column_fixed(loss, args, n):
    g = ap.trace(loss, *args)
    first = next(nd for nd in g.nodes if nd.op == "dot_general")
    lhs, rhs = (g.spec(v).rank for v in first.inputs)
    return {first.name: ((1,) * lhs, (1,) * (rhs - 1) + (n,))}


# ------------------------------------------------------------------ several steps == reference


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(MODELS))
def test_three_sgd_steps_equal_single_device(name, config):
    m = MODELS[name]()
    params, *batch = m.example_args(KEY)
    ap.set_auto_parallel_context(device_num=8, gradients_mean=True, **CONFIGS[config])
    fixed = column_fixed(m.loss, (params, *batch), 8) if config == "semi_auto_parallel" else None
    cluster = COMPUTE_BOUND if config == "dynamic_programming" else None
    step = ap.train_step(m.loss, params, tuple(batch), fixed=fixed, cluster=cluster)
    numerics.check(run_steps(step, params, batch, 3),
                   model_steps_reference(name, params, batch))
    if config != "data_parallel":  # the plan really is not pure data parallel
        assert any(pg_v.layout.used_axes() for v, pg_v in step.parallel_graph.values.items()
                   if pg_v.kind == "param")


@st.composite
def mlp_shapes(draw):
    devices = draw(st.sampled_from([1, 2, 4, 8]))
    depth = draw(st.integers(1, 3))
    widths = tuple(draw(st.sampled_from([4, 8, 16])) for _ in range(depth + 1))
    batch = draw(st.sampled_from([8, 16]))
    mode = draw(st.sampled_from(["data_parallel", "dynamic_programming"]))
    return devices, widths, batch, mode


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(mlp_shapes())
def test_random_mlp_gradients_match_reference(case):
    devices, widths, batch, mode = case
    m = mlp(widths=widths, batch=batch, loss="mse")
    params, *b = m.example_args(KEY)
    kw = (dict(parallel_mode="data_parallel") if mode == "data_parallel" else
          dict(parallel_mode="auto_parallel", search_mode="dynamic_programming"))
    with ap.auto_parallel_context(device_num=devices, gradients_mean=True, **kw):
        step = ap.train_step(m.loss, params, tuple(b),
                             cluster=COMPUTE_BOUND if mode != "data_parallel" else None)
    grad = jax.value_and_grad(m.loss)
    numerics.assert_close(step.grads(params, *b), grad, params, *b,
                          single=grad(params, *b), jit=False)


# ------------------------------------------------------------------ context keys


def _mlp():
    m = mlp(widths=(16, 32, 16), batch=16)
    params, x = m.example_args(KEY)
    return m, params, x


def test_gradients_mean_false_is_dp_times_the_global_gradient():
    m, params, x = _mlp()
    want = numerics.reference(jax.grad(m.loss), params, x)
    for mean, factor in ((True, 1.0), (False, 8.0)):
        with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                      gradients_mean=mean):
            step = ap.train_step(m.loss, params, (x,))
        assert step.data_parallel_degree == 8 and step.grad_scale == factor
        _, g = step.grads(params, x)
        numerics.check(jax.tree.map(lambda a: a / factor, g), want)  # / 8: exact


def test_loss_repeated_mean_scales_by_the_repeat_count():
    m, params, x = _mlp()
    want = numerics.reference(jax.grad(m.loss), params, x)
    fixed = column_fixed(m.loss, (params, x), 8)
    for repeated_mean, factor in ((True, 1.0), (False, 8.0)):
        with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                      dataset_strategy="full_batch", gradients_mean=True,
                                      loss_repeated_mean=repeated_mean):
            step = ap.train_step(m.loss, params, (x,), fixed=fixed)
        assert step.data_parallel_degree == 1 and step.repeat == 8
        _, g = step.grads(params, x)
        numerics.check(jax.tree.map(lambda a: a / factor, g), want)


def test_gradient_fp32_sync_all_reduces_in_f32_and_casts_back():
    m = mlp(widths=(16, 32, 16), batch=16, dtype=jnp.bfloat16)
    params, x = m.example_args(KEY)
    texts = {}
    for fp32 in (True, False):
        with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                      gradients_mean=True, gradient_fp32_sync=fp32):
            step = ap.train_step(m.loss, params, (x,))
        state = step.init(params)
        texts[fp32] = step.as_text(params, state, x)
        _, g = step.grads(params, x)
        assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(g))
        new, _, _ = step(params, state, x)
        assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(new))
        want = jax.grad(m.loss)(params, x)
        jax.tree.map(lambda a, b: close(a, b, rtol=5e-2, atol=5e-2), g, want)

    def reduced_types(text):  # element type of each all-reduce's reduction region
        return re.findall(r'stablehlo\.all_reduce"[^\n]*\n\s*\^bb0\(%\w+: tensor<(\w+)>', text)

    on, off = reduced_types(texts[True]), reduced_types(texts[False])
    n = len(jax.tree.leaves(params))
    assert len(on) == len(off) == collectives(texts[True])["all_reduce"]
    assert on.count("f32") >= n and on.count("bf16") <= 1  # gradients in f32 (loss: bf16)
    assert off.count("bf16") >= n  # bf16 gradient all-reduces without the key


def test_broadcast_parameters_takes_rank_zeros_copy():
    mesh = jax_mesh(DeviceMesh.for_devices(8))
    devices = list(mesh.devices.flat)
    shape = (4, 3)
    per_device = [jax.device_put(np.full(shape, float(i), np.float32), d)
                  for i, d in enumerate(devices)]
    differing = jax.make_array_from_single_device_arrays(
        shape, NamedSharding(mesh, P()), per_device)
    assert {float(s.data[0, 0]) for s in differing.addressable_shards} == set(range(8))
    out = ap.step_inputs.broadcast_parameters({"w": differing, "b": np.ones(3, np.float32)}, mesh)
    assert out["w"].sharding.is_fully_replicated
    assert all(np.all(np.asarray(s.data) == 0.0) for s in out["w"].addressable_shards)
    close(out["b"], np.ones(3))
    m, params, x = _mlp()
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  parameter_broadcast=True, gradients_mean=True):
        step = ap.train_step(m.loss, params, (x,))
    placed = step.prepare(params)
    jax.tree.map(close, placed, params)


def test_full_batch_replicates_and_data_parallel_splits_the_batch():
    m, params, x = _mlp()
    fixed = column_fixed(m.loss, (params, x), 8)
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  dataset_strategy="full_batch"):
        full = ap.train_step(m.loss, params, (x,), fixed=fixed)
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True):
        dp = ap.train_step(m.loss, params, (x,))
    assert full.plan.split_counts("x") == (1, 1)
    assert dp.plan.split_counts("x") == (8, 1)
    assert full.data_parallel_degree == 1 and dp.data_parallel_degree == 8


def test_enable_alltoall_decides_the_lowered_collectives():
    m = MODELS["transformer"]()
    params, *batch = m.example_args(KEY)
    counts = {}
    want = numerics.reference(jax.grad(m.loss), params, *batch)
    for flag in (True, False):
        with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                      search_mode="dynamic_programming", gradients_mean=True,
                                      enable_alltoall=flag):
            step = ap.train_step(m.loss, params, tuple(batch), cluster=COMPUTE_BOUND)
        counts[flag] = step.collective_counts(params, step.init(params), *batch)
        numerics.check(step.grads(params, *batch)[1], want)
    assert counts[True]["all_to_all"] > 0
    assert counts[False]["all_to_all"] == 0


# ------------------------------------------------------------------ communication, pmap, errors


def test_data_parallel_step_has_one_all_reduce_per_gradient_plus_the_loss():
    m, params, x = _mlp()
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=False):
        step = ap.train_step(m.loss, params, (x,))
    counts = step.collective_counts(params, step.init(params), x)
    assert counts == {"all_reduce": len(jax.tree.leaves(params)) + 1, "reduce_scatter": 0,
                      "all_gather": 0, "all_to_all": 0, "collective_permute": 0}


@pytest.mark.parametrize("mean", [True, False])
def test_pmap_backend_equals_shard_map(mean):
    m = mlp(widths=(16, 32, 16), batch=16, loss="mse")
    params, *batch = m.example_args(KEY)
    opt = optax.adam(1e-2)
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=mean):
        sm = ap.train_step(m.loss, params, tuple(batch), opt)
        pm = ap.train_step(m.loss, params, tuple(batch), opt, backend="pmap")
    # without gradients_mean both sum the 8 replicas' gradients: 8 x the global gradient
    want = reference_steps(m.loss, params, batch, 3, opt, loss_scale=1.0 if mean else 8.0)
    numerics.check(run_steps(sm, params, batch, 3), want, "shard_map step")
    numerics.check(run_steps(pm, params, batch, 3), want, "pmap step")
    assert "all_reduce" in pm.as_text(params, pm.init(params), *batch)


def test_pmap_backend_syncs_in_the_context_buckets():
    m = mlp(widths=(16, 32, 32, 16), batch=16, loss="mse")
    params, *batch = m.example_args(KEY)
    n = len(jax.tree.leaves(params))
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True, all_reduce_fusion_config=[2]):
        pm = ap.train_step(m.loss, params, tuple(batch), backend="pmap", sync_method="concat")
        sm = ap.train_step(m.loss, params, tuple(batch), sync_method="concat")
    buckets = len(pm.buckets["allreduce"])
    assert buckets == 2 < n
    # one all-reduce per bucket, plus the loss (pmean); the shard_map step agrees
    assert pm.collective_counts(params, pm.init(params), *batch)["all_reduce"] == buckets + 1
    assert sm.collective_counts(params, sm.init(params), *batch)["all_reduce"] == buckets + 1
    numerics.check(run_steps(pm, params, batch, 2), reference_steps(m.loss, params, batch, 2))
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  enable_parallel_optimizer=True,
                                  parallel_optimizer_config={"parallel_optimizer_threshold": 0}):
        with pytest.raises(ap.AutoParallelError, match="parallel optimizer"):
            ap.train_step(m.loss, params, tuple(batch), backend="pmap")


def test_pmap_backend_needs_data_parallel(tmp_path):
    m, params, x = _mlp()
    plan_file = tmp_path / "plan.json"
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  strategy_ckpt_save_file=str(plan_file), gradients_mean=True):
        with pytest.raises(ap.AutoParallelError, match="pmap"):
            ap.train_step(m.loss, params, (x,), backend="pmap")
        assert not plan_file.exists()  # a step refused after its search saves no plan
        with pytest.raises(ap.AutoParallelError, match="scalar"):
            ap.train_step(lambda p, x: x @ p["layer0"]["w"], params, (x,))
        assert not plan_file.exists()
        ap.train_step(m.loss, params, (x,))
        assert plan_file.exists()  # once the step is built


def test_non_array_inputs_and_integer_parameters_are_refused_by_name():
    m, params, x = _mlp()
    for build in (ap.trace, ap.parallelize):
        with pytest.raises(ap.AutoParallelTypeError, match=r"args\[1\]='x'"):
            build(m.loss, params, "x")
    ints = jax.tree.map(lambda a: a.astype(jnp.int32), params)  # (one is carried: all, none)
    with pytest.raises(ap.AutoParallelTypeError, match=r"params\['layer0'\]\['b'\].*int32"):
        ap.train_step(m.loss, ints, (x,))
    assert len(ap.trace(lambda p, x, none: m.loss(p, x), params, x, None).nodes)  # (a pytree)
    for key in (jax.random.key(0), jax.eval_shape(jax.random.key, 0)):  # (a raw TypeError once)
        g = ap.trace(lambda p, k, x: m.loss(p, x), params, key, x)  # a key is a value
        assert g.spec("k").dtype == "key<fry>"  # (tests/test_random.py)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_every_call_checks_the_parameters_and_batch_against_the_example(backend):
    """Parameter shapes were never checked (a (1,) bias ran silently, others gave a raw JAX
    IndivisibleError), and the pmap backend checked nothing (a raw reshape TypeError)."""
    m, params, x = _mlp()
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True):
        step = ap.train_step(m.loss, params, (x,), backend=backend)
    state = step.init(params)
    short = jax.tree.map(lambda a: a[:1] if a.ndim == 1 else a, params)
    cases = [((short, x), r"argument 'params/layer0/b'=\(1,\).*shape must be \(32,\)"),
             ((params, x[:12]), r"batch=\[\(12, 16\)\].*shapes must be"),
             ((params, x.astype(jnp.int32)), r"dtype must be float32"),
             ((params,), r"batch='0 leaves'.*structure of the example batch")]
    for (p, *batch), text in cases:
        for call in (lambda: step(p, state, *batch), lambda: step.grads(p, *batch)):
            with pytest.raises(ap.AutoParallelError, match=text):
                call()


def test_uneven_batch_matches_reference_or_is_rejected():
    m = mlp(widths=(16, 32, 16), batch=6)
    params, x = m.example_args(KEY)
    with ap.auto_parallel_context(device_num=4, parallel_mode="data_parallel",
                                  gradients_mean=True):
        step = ap.train_step(m.loss, params, (x,))
        # shard_map: the search splits the batch only as far as it divides (6 -> 2 ways)
        assert step.data_parallel_degree == 2 and 6 % step.data_parallel_degree == 0
        numerics.check(run_steps(step, params, (x,), 2),
                       reference_steps(m.loss, params, (x,), 2))
        # pmap cannot split 6 rows over 4 devices: a clear error naming both numbers
        with pytest.raises(ap.AutoParallelError, match=r"batch size 6 .*degree 4"):
            ap.train_step(m.loss, params, (x,), backend="pmap")


def test_bad_arguments_are_refused():
    m, params, x = _mlp()
    ap.set_auto_parallel_context(device_num=8, parallel_mode="data_parallel", gradients_mean=True)
    with pytest.raises(TypeError):
        ap.train_step(m.loss, params, (x,), optimizer="sgd")
    with pytest.raises(ap.AutoParallelError, match="backend"):
        ap.train_step(m.loss, params, (x,), backend="xmap")
    with pytest.raises(ap.AutoParallelError, match="scalar"):
        ap.train_step(lambda p, x: x @ p["layer0"]["w"], params, (x,))
    for cast in (jnp.int32, jnp.bool_):  # jax.grad refuses them; the step trained on zeros
        with pytest.raises(ap.AutoParallelTypeError, match=f"floating-point loss.*found "
                                                           f"{jnp.dtype(cast)}"):
            ap.train_step(lambda p, x, cast=cast: m.loss(p, x).astype(cast), params, (x,))
    step = ap.train_step(m.loss, params, x)  # a bare array is a one-element batch
    assert "TrainStep" in repr(step)


def test_step_arguments_shared_by_both_step_builders():
    from autopar.step_inputs import DEFAULT_LEARNING_RATE, step_arguments

    x = jnp.ones(2)
    batch, opt = step_arguments(jnp.sum, x, None, "rule")
    assert batch == (x,) and isinstance(opt, optax.GradientTransformation)
    sgd = optax.sgd(DEFAULT_LEARNING_RATE)
    assert step_arguments(jnp.sum, (x, x), sgd, "rule") == ((x, x), sgd)
    with pytest.raises(ap.AutoParallelTypeError, match="train_step needs a callable loss"):
        ap.train_step(3, {}, (x,))
    with pytest.raises(ap.AutoParallelTypeError, match="optimizer"):
        step_arguments(jnp.sum, x, "sgd", "rule")


def test_bad_step_arguments_are_typed_errors():
    """Lists, None, strings and optimizer states of other parameters are refused by name,
    never a JAX traceback (and never applied silently)."""
    import optax

    def loss(p, x):
        return jnp.mean((x @ p["w"]) ** 2)

    p, x = {"w": jnp.ones((8, 8))}, jnp.ones((16, 8))
    ap.set_auto_parallel_context(device_num=8, parallel_mode="data_parallel", gradients_mean=True)
    with pytest.raises(ap.AutoParallelTypeError, match="tuple"):
        ap.train_step(loss, p, [x])
    with pytest.raises(ap.AutoParallelTypeError, match=r"batch\[0\]"):
        ap.train_step(loss, p, (None,))
    with pytest.raises(ap.AutoParallelTypeError, match=r"params\['w'\]"):
        ap.train_step(loss, {"w": "abc"}, (x,))
    step = ap.train_step(loss, p, (x,), optax.adam(1e-3))
    for bad in ("xyz", optax.sgd(0.1).init(p), step.init({"w": jnp.ones(3)})):
        with pytest.raises(ap.AutoParallelTypeError, match="opt_state"):
            step(step.prepare(p), bad, x)
    with pytest.raises(ap.AutoParallelError, match="UTF-8"):
        ap.hccl.create_group("a\ud800", [0, 1])


def test_number_leaves_and_numpy_float64_examples_run_as_jax_traces_them():
    """A Python float among the parameters raised AttributeError ('float' has no dtype);
    NumPy float64 examples (float32 once traced, x64 off) built a step and a function that
    then refused those very arrays ('dtype must be float32, as in the example')."""
    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(8, 4)), rng.normal(size=(16, 8))  # float64
    loss = lambda p, x: jnp.mean(jax.nn.log_softmax((x @ p["w"]) / p["t"]))  # noqa: E731
    params = {"w": w, "t": 2.0}
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True):
        f = ap.parallelize(loss, params, x)
        step = ap.train_step(loss, params, (x,))
    numerics.assert_close(f(params, x), loss, params, x)
    f32 = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
    numerics.check(run_steps(step, f32, (x,), 2),
                   reference_steps(loss, f32, (np.float32(x),), 2))


@jax.custom_vjp
def _clip_gradient(x):
    return x


_clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1e-3, 1e-3),))


@jax.custom_jvp
def _ste_round(x):
    return jnp.round(x)


_ste_round.defjvp(lambda p, t: (_ste_round(p[0]), t[0]))


_rint = jax.custom_jvp(jnp.rint)  # a user's rule around JAX's own function
_rint.defjvp(lambda p, t: (jnp.rint(p[0]), t[0]))


@pytest.mark.parametrize("inner, name", [(_clip_gradient, "_clip_gradient"),
                                         (lambda h: _ste_round(h * 4.0) / 4.0, "_ste_round"),
                                         (lambda h: _rint(h * 4.0) / 4.0, "rint")])
def test_a_custom_derivative_rule_is_never_silently_replaced(inner, name):
    """The tracer inlines a custom_jvp / custom_vjp body; the sharded step differentiated the
    body (round's 0, an ignored clip): max|dw1| 13.25 against jax.grad's 0.019. The forward
    still runs; any gradient through the rule is a typed error naming the function."""
    m, params, x = _mlp()
    loss = lambda p, x: jnp.mean(inner(x @ p["layer0"]["w"]) ** 2)  # noqa: E731
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True):
        f = ap.parallelize(loss, params, x)
        numerics.assert_close(f(params, x), loss, params, x)
        for grads in (lambda: ap.train_step(loss, params, (x,)).grads(params, x),
                      lambda: jax.grad(f)(params, x)):
            with pytest.raises(ap.AutoParallelError, match=f"{name}.*custom_(jvp|vjp)"):
                grads()


def _dp_grads_match(loss, params, x, fn=jax.value_and_grad):
    """A data-parallel step's loss and gradients (or gradients, ``fn=jax.grad``) against the
    float64 reference of ``fn(loss)``."""
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True):
        step = ap.train_step(loss, params, (x,))
    got = step.grads(params, x)
    want = numerics.reference(fn(loss), params, x, jit=False)
    numerics.check(got if fn is jax.value_and_grad else got[1], want, "gradients")


@pytest.mark.parametrize("act", [
    lambda h: optax.sigmoid_binary_cross_entropy(h, jnp.ones_like(h)),  # logaddexp inside
    jax.nn.softplus, jax.nn.mish, lambda h: jax.nn.relu6(h * 10), jax.nn.hard_swish],
    ids=["sigmoid_bce", "softplus", "mish", "relu6", "hard_swish"])
def test_jaxs_own_custom_jvp_functions_train_exactly(act):
    """JAX's own custom_jvp functions (logaddexp, relu6) were refused along with the user's:
    their rules are their bodies' derivative (relu6's ties: applied exactly)."""
    m, params, x = _mlp()
    x = x.at[8:].set(0.0)  # (rows at relu6's kink)
    loss = lambda p, x: jnp.mean(act(x @ p["layer0"]["w"]))  # noqa: E731
    _dp_grads_match(loss, params, x)


def test_relu_keeps_its_derivative_rule_at_zero():
    """jax.nn.relu's custom_jvp gives 0 at 0; the inlined max split the tie 0.5 / 0.5 (a
    zero bias on rows of zeros: the bias gradient was off by 0.22)."""
    m, params, x = _mlp()
    x = x.at[8:].set(0.0)
    params = jax.tree.map(jnp.zeros_like, params) | {"layer0": {
        "w": params["layer0"]["w"], "b": jnp.zeros_like(params["layer0"]["b"])}}
    loss = lambda p, x: jnp.sum(jax.nn.relu(x @ p["layer0"]["w"] + p["layer0"]["b"]))  # noqa
    _dp_grads_match(loss, params, x, fn=jax.grad)


def test_a_custom_function_no_gradient_passes_through_is_not_refused():
    """The refusal fired on any tangent reaching the body (an integer output, a
    stop_gradient after it): nothing is differentiated through those."""
    m, params, x = _mlp()
    loss = lambda p, x: jnp.mean(jax.lax.stop_gradient(_ste_round(x @ p["layer0"]["w"])) *  # noqa
                                 (x @ p["layer0"]["w"]))
    _dp_grads_match(loss, params, x)


def test_a_fused_kernel_never_carries_a_custom_rules_body():
    """fused_kernels=True turned a custom_vjp matmul into mm_reduce_scatter, which bypassed
    the refusal: a silently different gradient (2.63 where the rule gives 0)."""
    mm = ap.shard(jnp.matmul, ((1, 8), (8, 1)))

    @jax.custom_vjp
    def frozen(x, w):
        return mm(x, w)

    frozen.defvjp(lambda x, w: (mm(x, w), (x, w)), lambda r, g: (g @ r[1].T,
                                                                  jnp.zeros_like(r[1])))
    w, x = jnp.ones((64, 16)) / 64, jnp.ones((16, 64))
    loss = lambda w, x: jnp.sum(jnp.tanh(frozen(x, w)) ** 2)  # noqa: E731
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  gradients_mean=True):
        step = ap.train_step(loss, w, (x,), fused_kernels=True)
    assert not [n for n in step.parallel_graph.nodes if n.is_fused]
    with pytest.raises(ap.AutoParallelError, match="'frozen'"):
        step.grads(w, x)


def test_arguments_jax_cannot_take_are_typed_errors_at_the_call():
    """A string or date argument gave JAX's 'not a valid JAX array type' TypeError."""
    m, params, x = _mlp()
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel"):
        f = ap.parallelize(m.loss, params, x)
    for bad in (np.array("a"), np.datetime64("2020-01-01"), "2.0"):
        with pytest.raises(ap.AutoParallelError, match="argument 'x'.*(dtype|shape) must"):
            f(params, np.broadcast_to(bad, x.shape) if not isinstance(bad, str) else bad)


def test_a_steps_own_outputs_are_fed_back_without_placing_them_again():
    """The next step takes the parameters a step returns as they are (equivalent layouts,
    e.g. P() and P(None,), count as the same); host arrays are placed."""
    from autopar.lower import put_on

    m = transformer(layers=1, hidden=16, heads=2, seq=4, vocab=16, batch=8)
    params, *batch = m.example_args(KEY)
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True):
        step = ap.train_step(m.loss, params, tuple(batch))
    new, state, _ = step(step.prepare(params), step.init(params), *batch)
    placed, _ = step._place(new, batch)
    assert all(a is b for a, b in zip(placed, jax.tree.leaves(new)))
    host = np.ones((8, 2), np.float32)
    sh = NamedSharding(jax_mesh(DeviceMesh.for_devices(8)), P("a0"))
    out = put_on([host, placed[0]], [sh, step.storage_shardings[0]])
    assert out[0].sharding == sh and out[1] is placed[0]


def test_a_batch_of_another_structure_is_refused():
    """The batch's leaves were checked by shape alone: a dict with its keys in another order
    swapped x and y silently (loss 1.0 for 64.0)."""
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel", gradients_mean=True)

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] - y) ** 2)

    p = {"w": jnp.ones((8, 8))}
    x, y = jnp.ones((16, 8)), jnp.zeros((16, 8))
    step = ap.train_step(loss, p, (x, y))
    state = step.init(p)
    assert float(step(p, state, x, y)[2]) == 64.0
    for batch in (({"b": x, "a": y},), ((x, y),)):
        with pytest.raises(ap.AutoParallelError, match="structure of the example batch"):
            step(p, state, *batch)


def test_none_parameters_are_empty_subtrees_and_reading_one_is_a_typed_error():
    """equinox's eqx.partition(model, eqx.is_array) leaves None where a field is no array:
    to JAX (jax.grad, optax) an empty subtree. The step keeps them where they are; a loss
    that reads one as an array fails typed, naming the leaf (it failed inside the user's
    function with a bare TypeError)."""
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel", gradients_mean=True)
    x, y = jnp.ones((16, 8)), jnp.zeros((16, 8))

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] - y) ** 2)

    p = {"w": jnp.ones((8, 8)), "frozen": None, "act": [None, None]}
    step = ap.train_step(loss, p, (x, y))
    new, state, value = step(p, step.init(p), x, y)
    assert float(value) == 64.0 and new["frozen"] is None and new["act"] == [None, None]
    assert jax.tree.structure(new) == jax.tree.structure(p)

    def reads_none(p, x, y):
        return jnp.mean((x @ p["w"] + p["frozen"] - y) ** 2)

    with pytest.raises(ap.AutoParallelTypeError, match=r"p\['frozen'\].*read one"):
        ap.train_step(reads_none, p, (x, y))


def test_a_batching_transformation_of_a_parallel_function_is_a_typed_error():
    """vmap / jacfwd of a parallel function failed inside JAX's sharding checks."""
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel")
    w, x = jnp.ones((8, 8)) / 8, jnp.arange(128.0).reshape(16, 8) / 100
    f = ap.parallelize(lambda p, x: jnp.mean(jnp.tanh(x @ p) ** 2), w, x)
    for transformed in (lambda: jax.vmap(f, in_axes=(None, 0))(w, jnp.stack([x, x])),
                        lambda: jax.jacfwd(f)(w, x)):
        with pytest.raises(ap.AutoParallelError, match="batching transformations"):
            transformed()
    assert jax.grad(f)(w, x).shape == (8, 8)


# ------------------------------------------------------------------ the libraries' conventions


def test_an_equinox_models_integer_step_counter_is_carried_not_trained():
    """An integer leaf (an equinox model's step counter) is carried: the loss reads its
    current value, the optimizer never sees it (AdamW's weight decay would move it), the
    step hands it back unchanged and ``grads`` holds None there, as eqx.filter_grad does."""
    import equinox as eqx

    class Net(eqx.Module):
        lin: eqx.nn.Linear
        steps: jax.Array  # int32: read by the loss, never trained

        def __call__(self, x):
            return jax.vmap(self.lin)(x) * (1.0 + self.steps.astype(jnp.float32) / 4)

    k = jax.random.split(KEY, 3)
    net = Net(eqx.nn.Linear(16, 8, key=k[0]), jnp.int32(2))
    x, y = jax.random.normal(k[1], (16, 16)), jax.random.normal(k[2], (16, 8))

    def loss(net, x, y):
        return jnp.mean((net(x) - y) ** 2)

    opt = optax.adamw(1e-2, weight_decay=0.5)
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True):
        step = ap.train_step(loss, net, (x, y), opt)
    state = step.init(net)
    trained, carried = eqx.partition(net, eqx.is_inexact_array)
    assert jax.tree.structure(state) == jax.tree.structure(opt.init(trained))
    new, losses = run_steps(step, net, (x, y), 2)
    assert new.steps.dtype == jnp.int32 and int(new.steps) == 2
    ref = reference_steps(lambda t, x, y: loss(eqx.combine(t, carried), x, y), trained,
                          (x, y), 2, opt)
    numerics.check((eqx.filter(new, eqx.is_inexact_array), losses), ref)
    # the counter is an input of the program, not the example's value frozen in it
    net5 = eqx.tree_at(lambda n: n.steps, net, jnp.int32(5))
    value, g = step.grads(net5, x, y)
    assert g.steps is None and g.lin.weight is not None
    numerics.check((value, eqx.filter(g, eqx.is_inexact_array)), numerics.reference(
        eqx.filter_value_and_grad(loss), net5, x, y, jit=False))


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_prng_key_and_boolean_leaves_are_carried_and_a_loss_can_draw_with_a_key(backend):
    """Typed (jax.random.key) and raw (uint32) PRNG keys and booleans among the parameters are
    carried through a step unchanged; a loss that draws with a typed key trains as jax.grad
    (shard_map: each device draws its block of the same array) or, under pmap, whose
    replicas would each draw the whole array, is refused by name."""
    k = jax.random.split(KEY, 2)
    params = {"w": jax.random.normal(k[0], (16, 8)) / 4, "key": jax.random.key(3),
              "raw": jax.random.PRNGKey(4), "double": jnp.array(True)}
    x = jax.random.normal(k[1], (16, 16))

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"]) ** 2) * jnp.where(p["double"], 2.0, 1.0)

    ap.set_auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                 gradients_mean=True)
    step = ap.train_step(loss, params, (x,), optax.adam(1e-2), backend=backend)
    state = step.init(params)
    assert [state[0].mu[n] is None for n in ("key", "raw", "double", "w")] == [
        True, True, True, False]
    new, _, value = step(params, state, x)
    for name in ("key", "raw"):
        raw = (lambda a: jax.random.key_data(a)) if name == "key" else np.asarray
        np.testing.assert_array_equal(raw(new[name]), raw(params[name]))
    assert new["key"].dtype == params["key"].dtype and bool(new["double"])
    carried = {n: params[n] for n in ("key", "raw", "double")}
    numerics.check((new["w"], [value]), reference_steps(
        lambda w, x: loss({**carried, "w": w}, x), params["w"], (x,), 1, optax.adam(1e-2)))
    once = {**params, "double": jnp.array(False)}  # (read at the call: half the loss)
    numerics.assert_close(step.grads(once, x)[0], loss, once, x)
    with pytest.raises(ap.AutoParallelError, match=r"key.*key<rbg>.*key<fry>" if
                       backend == "shard_map" else r"params\['key'\].*PRNG key"):
        step(params | {"key": jax.random.key(0, impl="rbg")}, state, x)

    def draws(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"]) * jax.random.normal(p["key"], (16, 8)))

    if backend == "pmap":
        with pytest.raises(ap.AutoParallelTypeError, match=r"params\['key'\].*PRNG key.*reads"):
            ap.train_step(draws, params, (x,), backend=backend)
        return
    step = ap.train_step(draws, params, (x,), optax.sgd(0.1), backend=backend)
    new, _, value = step(params, step.init(params), x)
    np.testing.assert_array_equal(jax.random.key_data(new["key"]),
                                  jax.random.key_data(params["key"]))
    numerics.check((new["w"], [value]), reference_steps(
        lambda w, x: draws({**params, "w": w}, x), params["w"], (x,), 1, optax.sgd(0.1)))


def _batch_norm_net():
    """A flax.linen Dense-BatchNorm-Dense net in training mode: ``(loss, new batch_stats)``."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            h = nn.Dense(32)(x)
            h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
            return nn.Dense(8)(nn.relu(h))

    model = Net()
    k = jax.random.split(KEY, 3)
    x, y = jax.random.normal(k[0], (16, 16)), jax.random.normal(k[1], (16, 8))

    def loss(variables, x, y):
        out, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
        return jnp.mean((out - y) ** 2), updates["batch_stats"]

    return loss, model.init(k[2], x, train=False), x, y


@pytest.mark.parametrize("split", ["data_parallel", "columns"])
def test_has_aux_returns_new_batch_norm_statistics_as_one_device_does(split):
    """flax BatchNorm in training mode: ``loss_fn`` returns ``(loss, new batch_stats)``; the
    step returns ``(params, opt_state, (loss, aux))`` and ``grads`` ``((loss, aux), grads)``,
    the values of jax.value_and_grad(has_aux=True) on one device (the statistics of the whole
    batch, gathered where the plan splits them: 'columns' splits the features 8 ways)."""
    loss, variables, x, y = _batch_norm_net()
    mode = "data_parallel" if split == "data_parallel" else "semi_auto_parallel"
    fixed = column_fixed(lambda v, x, y: loss(v, x, y)[0], (variables, x, y), 8) \
        if split == "columns" else None
    with ap.auto_parallel_context(device_num=8, parallel_mode=mode, gradients_mean=True):
        step = ap.train_step(loss, variables, (x, y), has_aux=True, fixed=fixed)
    if split == "columns":  # (a parameter really is split)
        assert any(v.layout.used_axes() for v in step.parallel_graph.values.values()
                   if v.kind == "param")
    numerics.check(step.grads(variables, x, y), numerics.reference(
        jax.value_and_grad(loss, has_aux=True), variables, x, y))

    def sgd_step(v, x, y):
        (value, aux), g = jax.value_and_grad(loss, has_aux=True)(v, x, y)
        return jax.tree.map(lambda p, d: p - ap.train.DEFAULT_LEARNING_RATE * d, v, g), \
            (value, aux)

    new, _, (value, aux) = step(variables, step.init(variables), x, y)
    assert all(isinstance(a, jax.Array) and a.shape == (32,) for a in jax.tree.leaves(aux))
    numerics.check((new, (value, aux)), numerics.reference(sgd_step, variables, x, y))


def _two_micro_batches(loss):
    """The reference of a step of two micro-batches of 8 rows: the mean loss, each
    micro-batch's aux stacked along a new leading dim, the mean gradients."""
    def per_micro_batch(v, x, y):
        outs = [jax.value_and_grad(loss, has_aux=True)(v, x[i:i + 8], y[i:i + 8])
                for i in (0, 8)]
        (l0, a0), g0 = outs[0]
        (l1, a1), g1 = outs[1]
        return ((l0 + l1) / 2, jax.tree.map(lambda a, b: jnp.stack([a, b]), a0, a1)), \
            jax.tree.map(lambda a, b: (a + b) / 2, g0, g1)
    return per_micro_batch


def test_has_aux_under_gradient_accumulation_stacks_each_micro_batchs_aux():
    """grad_accumulation_step = 2: the loss is the micro-batches' mean, the gradients their
    mean, and the aux each micro-batch's, stacked along a new leading dim."""
    loss, variables, x, y = _batch_norm_net()
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  gradients_mean=True, grad_accumulation_step=2):
        step = ap.train_step(loss, variables, (x, y), has_aux=True)

    per_micro_batch = _two_micro_batches(loss)
    (value, aux), g = step.grads(variables, x, y)
    assert all(a.shape == (2, 32) for a in jax.tree.leaves(aux))
    numerics.check(((value, aux), g), numerics.reference(per_micro_batch, variables, x, y))


def test_has_aux_is_checked_and_refused_where_no_global_aux_exists():
    """pmap has no global aux; a pipelined step refuses an aux leaf that is an input
    returned as is (it does not travel the stages)."""
    m, params, x = _mlp()
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True):
        with pytest.raises(ap.AutoParallelError, match=r"has_aux=True.*\(loss, aux\)"):
            ap.train_step(m.loss, params, (x,), has_aux=True)  # a bare scalar
        with pytest.raises(ap.AutoParallelError, match=r"one scalar loss.*has_aux=True"):
            ap.train_step(lambda p, x: (m.loss(p, x), x), params, (x,))
        with pytest.raises(ap.AutoParallelTypeError, match="has_aux='yes'"):
            ap.train_step(m.loss, params, (x,), has_aux="yes")
        with pytest.raises(ap.AutoParallelError, match="has_aux=True.*pmap.*each device"):
            ap.train_step(lambda p, x: (m.loss(p, x), x), params, (x,), has_aux=True,
                          backend="pmap")
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  gradients_mean=True, pipeline_stages=2):
        with pytest.raises(ap.AutoParallelError, match="loss_fn aux.*pipeline_stages > 1"):
            ap.train_step(lambda p, x: (m.loss(p, x), x), params, (x,), has_aux=True)


def test_an_unset_gradients_mean_is_warned_once_naming_the_factor():
    """MindSpore's default gradients_mean=False is kept (the gradients are dp x jax.grad of
    the global mean loss), but a step built with dp > 1 and the key left unset says so, once
    per process, at the caller's line (through autopar.train_step's tune facade too); set
    to either value, or with nothing summed (dp = 1), nothing is said."""
    from autopar.step_inputs import WARNED_ONCE

    m, params, x = _mlp()
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel"):
        with pytest.warns(ap.AutoParallelWarning, match=r"gradients_mean is not set.*its 8 "
                          r"data-parallel.*8 x jax.grad.*Set gradients_mean explicitly") as seen:
            step = ap.train_step(m.loss, params, (x,))
            ap.train_step(m.loss, params, (x,))  # (once per process)
    assert len(seen) == 1 and seen[0].filename == __file__
    assert step.grad_scale == 8.0  # (the semantics kept: MindSpore's sum)
    WARNED_ONCE.clear()
    fixed = column_fixed(m.loss, (params, x), 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for mean in (True, False):
            with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                          gradients_mean=mean):
                ap.train_step(m.loss, params, (x,))
        with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                      dataset_strategy="full_batch"):
            assert ap.train_step(m.loss, params, (x,), fixed=fixed).data_parallel_degree == 1
    deep = mlp(widths=(16, 32, 32, 16), batch=16)
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  pipeline_stages=2):  # the pipelined step: its stages' dp
        with pytest.warns(ap.AutoParallelWarning, match="gradients_mean is not set") as seen:
            ap.pipeline_train_step(deep.loss, deep.example_args(KEY)[0], (x,), micro_batches=2)
    assert len(seen) == 1 and seen[0].filename == __file__


def test_a_pipelined_step_returns_each_micro_batchs_aux():
    """pipeline_stages = 2, 2 micro-batches: ``has_aux`` gives ``(loss, aux)``, the new
    BatchNorm statistics of each micro-batch stacked along a new leading dim (made on the
    stage holding the BatchNorm, carried to the last), as one device computes them."""
    loss, variables, x, y = _batch_norm_net()
    with ap.auto_parallel_context(device_num=4, parallel_mode="semi_auto_parallel",
                                  gradients_mean=True, pipeline_stages=2):
        step = ap.train_step(loss, variables, (x, y), has_aux=True)

    per_micro_batch = _two_micro_batches(loss)
    (value, aux), g = step.grads(variables, x, y)
    assert all(a.shape == (2, 32) for a in jax.tree.leaves(aux))
    numerics.check(((value, aux), g), numerics.reference(per_micro_batch, variables, x, y))
    _, _, (value2, aux2) = step(variables, step.init(variables), x, y)
    numerics.check((value2, aux2), numerics.reference(
        lambda v, x, y: per_micro_batch(v, x, y)[0], variables, x, y))
