"""Bucketed gradient synchronisation in the training step: one collective per bucket in the
lowered and the compiled program, buckets issued during backward, every fusion mode equal to
one device, and gradient accumulation."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar as ap
from autopar.grad_sync import (bucket_indices, bucketed_collective, data_parallel_degree,
                               fp32_collective, fp32_sync_active, gradient_scale,
                               replicated_axes, sync_gradients, sync_groups)
from autopar.models import mlp

import numerics

KEY = jax.random.key(0)


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol,
                               atol=atol)


def _mlp(batch=16):
    m = mlp(widths=(16, 64, 64, 64, 16), batch=batch)
    params, x = m.example_args(KEY)
    return m, params, x


_GRAD_REF: list[numerics.Reference] = []


def _grad_reference() -> numerics.Reference:
    """The float64 / one-device gradients of ``_mlp()``, computed once."""
    if not _GRAD_REF:
        m, params, x = _mlp()
        _GRAD_REF.append(numerics.reference(jax.grad(m.loss), params, x))
    return _GRAD_REF[0]


def _step(m, params, x, **ctx):
    method = ctx.pop("sync_method", "tuple")
    mode = ctx.pop("parallel_mode", "data_parallel")
    with ap.auto_parallel_context(device_num=8, parallel_mode=mode, gradients_mean=True, **ctx):
        return ap.train_step(m.loss, params, (x,), sync_method=method)


def _entry(text: str) -> list[str]:
    return text[text.index("ENTRY"):].split("\n")


def _all_reduces(text: str) -> list[str]:
    return [ln for ln in _entry(text) if re.search(r"\ball-reduce(-start)?\(", ln)]


def _shapes(line: str) -> list[str]:
    head = re.split(r"\ball-reduce(-start)?\(", line.split("=", 1)[1])[0]
    return re.findall(r"f32\[[\d,]*\]", head)


def test_lowered_program_has_one_all_reduce_per_bucket_with_concat():
    m, params, x = _mlp()
    n = len(jax.tree.leaves(params))
    for method, want in (("concat", 3 + 1), ("tuple", n + 1)):
        step = _step(m, params, x, all_reduce_fusion_config=[2, 5], sync_method=method)
        assert len(step.buckets["allreduce"]) == 3
        counts = step.collective_counts(params, step.init(params), x)
        assert counts["all_reduce"] == want, (method, counts)  # + 1: the loss
        numerics.check(step.grads(params, x)[1], _grad_reference())


def test_compiled_program_keeps_exactly_the_configured_buckets():
    m, params, x = _mlp()
    step = _step(m, params, x, all_reduce_fusion_config=[2, 5])
    text = step.compiled_text(params, step.init(params), x)
    ars = _all_reduces(text)
    assert len(ars) == 3  # XLA's combiner did not re-merge them (the loss joins one)
    leaves = dict(zip(step.parallel_graph.inputs, jax.tree.leaves(params)))
    for line, bucket in zip(ars, step.buckets["allreduce"]):
        want = sorted(f"f32[{','.join(map(str, leaves[g].shape))}]" for g in bucket.gradients)
        got = sorted(s for s in _shapes(line) if s != "f32[]")
        assert got == want


def test_fusion_closed_lowers_one_all_reduce_per_gradient():
    m, params, x = _mlp()
    step = _step(m, params, x)
    assert step.buckets["allreduce"].mode == "none"
    n = len(jax.tree.leaves(params))
    assert step.collective_counts(params, step.init(params), x)["all_reduce"] == n + 1


def test_bucket_all_reduce_is_issued_during_backward():
    """In the compiled schedule, the first bucket's all-reduce (the last layer's gradients)
    comes before the backward matmuls of earlier layers; each bucket after its last
    gradient's matmul."""
    m, params, x = _mlp()
    step = _step(m, params, x, all_reduce_fusion_config=[2, 5])
    lines = _entry(step.compiled_text(params, step.init(params), x))
    ar = [i for i, ln in enumerate(lines) if re.search(r"\ball-reduce(-start)?\(", ln)]
    # weight gradients: dots whose result has a weight's shape (64x16, 64x64, 16x64)
    wgrad = [i for i, ln in enumerate(lines) if re.search(r"= f32\[(64,16|64,64|16,64)\]"
                                                          r"\{1,0\} dot\(", ln)]
    assert len(ar) == 3 and len(wgrad) >= 4
    assert ar[0] < wgrad[1] and ar[1] < wgrad[-1]  # not all at the end
    assert ar[0] > wgrad[0]


@pytest.mark.parametrize("fusion", [
    dict(comm_fusion={"allreduce": {"mode": "size", "config": 0.02}}),
    dict(all_reduce_fusion_config=[1, 4, 7]),
    dict(comm_fusion={"allreduce": {"mode": "auto"}}),
])
def test_every_fusion_mode_equals_one_device_under_tensor_parallel(fusion):
    m, params, x = _mlp()
    g = ap.trace(m.loss, params, x)
    first = next(nd for nd in g.nodes if nd.op == "dot_general")
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  gradients_mean=True, **fusion):
        step = ap.train_step(m.loss, params, (x,),
                             fixed={first.name: ((2, 1), (1, 4))})
    axes = {a for a in step.sync_axes if a}
    assert len(axes) >= 2  # gradients with different sync axes: separate collectives
    assert len(step.sync_groups) >= len(step.buckets["allreduce"])
    numerics.check(step.grads(params, x)[1], _grad_reference())


def test_hccl_split_strategy_buckets_the_step():
    m, params, x = _mlp()
    ap.hccl.set_split_strategy_by_size([50, 50])
    step = _step(m, params, x)
    assert len(step.buckets["allreduce"]) == 2
    assert len(_all_reduces(step.compiled_text(params, step.init(params), x))) == 2


# ------------------------------------------------------------------ gradient accumulation


def test_grad_accumulation_equals_one_step_on_the_whole_batch():
    m, params, x = _mlp(batch=32)
    run = numerics.optimizer_steps(m.loss, optax.sgd(0.1), 2)
    want = numerics.reference(lambda *a: run(*a)[0], params, x, jit=False)
    for acc in (2, 4):
        step = _step(m, params, x, grad_accumulation_step=acc,
                     parallel_mode="semi_auto_parallel")
        assert step.parallel_graph.values[step.parallel_graph.inputs[-1]].spec.shape[0] == \
            32 // acc
        assert "stablehlo.while" in step.as_text(params, step.init(params), x)
        p, st = params, step.init(params)
        for _ in range(2):
            p, st, loss = step(p, st, x)
        numerics.check(p, want)


def _regression_loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"]) - y) ** 2)


@functools.lru_cache(maxsize=None)
def _regression_case() -> tuple:
    k1, k2, k3 = jax.random.split(KEY, 3)
    p = {"w": jax.random.normal(k1, (16, 8))}
    x, y = jax.random.normal(k2, (32, 16)), jax.random.normal(k3, (32, 8))
    return p, x, y, numerics.reference(jax.value_and_grad(_regression_loss), p, x, y)


@pytest.mark.parametrize("dataset", [((8, 1), (1, 1)), ((4, 1), (2, 1)), ((8, 1), (8, 1))])
def test_grad_accumulation_pairs_the_rows_of_inputs_split_differently(dataset):
    """Micro-batch k is global rows [k*B/g, (k+1)*B/g) of every input, however each input is
    split over the devices (a per-device reshape would pair x and y rows of other steps)."""
    p, x, y, want = _regression_case()
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  gradients_mean=True, grad_accumulation_step=2,
                                  dataset_strategy=dataset):
        step = ap.train_step(_regression_loss, p, (x, y))
    numerics.check(step.grads(p, x, y), want)
    # host arrays: the same rows
    numerics.check(step.grads(p, np.asarray(x), np.asarray(y)), want, "host-array result")


def test_grad_accumulation_restrictions():
    m, params, x = _mlp(batch=12)
    with pytest.raises(ap.AutoParallelError, match="grad_accumulation_step"):
        _step(m, params, x, grad_accumulation_step=5, parallel_mode="semi_auto_parallel")
    with pytest.raises(ap.ContextConflictError, match="grad_accumulation_step"):
        _step(m, params, x, grad_accumulation_step=2)  # data_parallel: refused by the seed
    step = _step(m, params, x, grad_accumulation_step=2, parallel_mode="semi_auto_parallel")
    with pytest.raises(ap.AutoParallelError, match="shapes"):
        step.grads(params, x[:6])
    with pytest.raises(ap.AutoParallelError, match="dtype"):
        step.grads(params, x.astype(jnp.float16))
    with pytest.raises(ap.AutoParallelError, match="structure"):
        step.grads({"w": x}, x)


# ------------------------------------------------------------------ the function API


def test_sync_groups_split_buckets_by_axes_and_refuse_bad_buckets():
    groups = sync_groups([("a",), ("a", "b"), ("a",), ()], [[0, 1], [2, 3]])
    assert [(g.bucket, g.members, g.axes) for g in groups] == [
        (0, (0,), ("a",)), (0, (1,), ("a", "b")), (1, (2,), ("a",))]
    with pytest.raises(ap.AutoParallelError, match="no bucket"):
        sync_groups([("a",), ("a",)], [[0]])
    with pytest.raises(ap.AutoParallelError, match="exactly one"):
        sync_groups([("a",), ("a",)], [[0, 1], [1]])
    with pytest.raises(TypeError):
        sync_groups([("a",)], "0")
    with pytest.raises(TypeError):
        sync_groups([("a",)], [[0.0]])
    with pytest.raises(ap.AutoParallelError, match="kind"):
        bucketed_collective([], [], [], kind="broadcast")
    with pytest.raises(ap.AutoParallelError, match="method"):
        bucketed_collective([], [], [], method="ring")
    with pytest.raises(ap.AutoParallelError, match="sync_axes"):
        sync_gradients([jnp.ones(2)], [], [[0]])
    with pytest.raises(ap.AutoParallelError, match="not in the gradient list"):
        bucket_indices(["a"], [["b"]])
    m, params, x = _mlp()
    with pytest.raises(ap.AutoParallelError, match="sync_method"):
        _step(m, params, x, sync_method="ring")


def test_replicated_axes_are_the_unsplit_mesh_axes_of_size_above_one():
    from autopar.strategies.layout import DeviceMesh, TensorLayout

    mesh = DeviceMesh((("a0", 2), ("a1", 1), ("a2", 4)))
    assert replicated_axes(TensorLayout(((), ())), mesh) == ("a0", "a2")     # size-1 a1 dropped
    assert replicated_axes(TensorLayout((("a2",), ())), mesh) == ("a0",)
    assert replicated_axes(TensorLayout((("a2",), ("a0",))), mesh) == ()
    assert replicated_axes(TensorLayout(((),), partial=("a0",)), mesh) == ("a2",)  # partial: used
    with pytest.raises(ap.AutoParallelTypeError, match="layout"):
        replicated_axes(((), ()), mesh)
    with pytest.raises(ap.AutoParallelTypeError, match="mesh"):
        replicated_axes(TensorLayout(((),)), {"a0": 2})


def test_gradient_scale_and_data_parallel_degree():
    from types import SimpleNamespace as NS

    from autopar.strategies.layout import DeviceMesh, TensorLayout

    for mean, rep_mean, want in ((True, True, 1.0), (False, True, 4.0), (True, False, 2.0),
                                 (False, False, 8.0)):   # dp 4 of 8 devices: 2 repeats
        got = gradient_scale(4, 8, gradients_mean=mean, loss_repeated_mean=rep_mean)
        assert got == want and isinstance(got, float)
    assert gradient_scale(8, 4, gradients_mean=False, loss_repeated_mean=False) == 8.0
    for bad, err in ((0, ap.AutoParallelError), (2.0, ap.AutoParallelTypeError),
                     (True, ap.AutoParallelTypeError)):
        with pytest.raises(err, match="dp"):
            gradient_scale(bad, 8, gradients_mean=True, loss_repeated_mean=True)
    with pytest.raises(ap.AutoParallelError, match="devices"):
        gradient_scale(1, -1, gradients_mean=True, loss_repeated_mean=True)
    mesh = DeviceMesh((("a0", 2), ("a1", 4)))
    val = lambda shape, dims: NS(spec=NS(shape=shape), layout=TensorLayout(dims))  # noqa: E731
    assert data_parallel_degree([], mesh) == 1
    assert data_parallel_degree([val((8, 3), (("a0",), ())), val((), ())], mesh) == 2
    assert data_parallel_degree([val((8,), (("a0",),)), val((8,), (("a0", "a1"),))], mesh) == 8
    assert data_parallel_degree([val((8,), ((),))], mesh) == 1


def test_fp32_collective_casts_low_precision_around_the_collective():
    seen = []

    def spy(xs):
        seen[:] = [str(x.dtype) for x in xs]
        return [x * 2 for x in xs]

    xs = [jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.float16), jnp.ones(2, jnp.float32)]
    out = fp32_collective(spy, xs, True)
    assert seen == ["float32", "float32", "float32"]
    assert [str(o.dtype) for o in out] == ["bfloat16", "float16", "float32"]
    close(out[0], 2.0)
    fp32_collective(spy, xs, [False, True, True])
    assert seen == ["bfloat16", "float32", "float32"]
    fp32_collective(spy, xs, False)
    assert seen == ["bfloat16", "float16", "float32"]
    with pytest.raises(ap.AutoParallelError, match="one flag per gradient"):
        fp32_collective(spy, xs, [True])
    assert fp32_sync_active(True, "semi_auto_parallel") and fp32_sync_active(True, "auto_parallel")
    assert not fp32_sync_active(True, "data_parallel") and not fp32_sync_active(False,
                                                                                "auto_parallel")


def test_sync_gradients_inside_shard_map_matches_psum():
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    xs = [jnp.arange(8.0 * k).reshape(8, k) for k in (1, 2, 3)]

    def body(*loc):
        return tuple(sync_gradients(list(loc), [("a", "b"), ("a",), ("a", "b")],
                                    [[0, 1], [2]], method="concat"))

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(("a", "b")), P("a"), P(("a", "b"))),
                      out_specs=(P(), P(), P()), check_vma=False)
    out = f(*xs)
    close(out[0], xs[0].reshape(8, 1, 1).sum(0).reshape(1, 1))
    close(out[1], xs[1].reshape(4, 2, 2).sum(0))
    close(out[2], xs[2].reshape(8, 1, 3).sum(0))


def test_transformer_sync_points_equal_one_device():
    """Sync points in a graph with residual branches and a searched (non data-parallel)
    plan: gradients with several sync axes, every bucket synchronised inside backward."""
    from autopar.models import transformer
    from clusters import FLOP_BOUND

    m = transformer(layers=2, hidden=32, heads=2, seq=8, vocab=64, batch=8)
    params, *batch = m.example_args(KEY)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  search_mode="dynamic_programming", gradients_mean=True,
                                  comm_fusion={"allreduce": {"mode": "size", "config": 0.01}}):
        step = ap.train_step(m.loss, params, tuple(batch), cluster=FLOP_BOUND)
    assert len(step.buckets["allreduce"]) > 1
    assert len({g.axes for g in step.sync_groups}) > 1
    numerics.assert_close(step.grads(params, *batch)[1], jax.grad(m.loss), params, *batch)


# ------------------------------------------------------------------ repeated work (cotangents)


def _two_matmuls(p, x):
    return (jnp.tanh(x @ p["w1"]) @ p["w2"]).sum()


@functools.lru_cache(maxsize=None)
def _two_matmuls_case() -> tuple:
    k = jax.random.split(KEY, 3)
    p = {"w1": jax.random.normal(k[0], (32, 32)), "w2": jax.random.normal(k[1], (32, 32))}
    x = jax.random.normal(k[2], (16, 32))
    return p, x, numerics.reference(jax.grad(_two_matmuls), p, x)


def _two_matmuls_step(device_num, fixed, fused=False, **ctx):
    p, x, _ = _two_matmuls_case()
    with ap.auto_parallel_context(device_num=device_num, parallel_mode="auto_parallel",
                                  search_mode="dynamic_programming", gradients_mean=True, **ctx):
        return ap.train_step(_two_matmuls, p, (x,), fixed=fixed, fused_kernels=fused)


@pytest.mark.parametrize("repeated_mean, fused", [(True, False), (False, False), (True, True)])
def test_gradients_of_repeated_work_are_not_all_reduced(repeated_mean, fused):
    # both matmuls split over a1 (4 ways) only: a0 repeats all the work, so every device of
    # a0 holds the same gradient and summing over a0 would only double it
    step = _two_matmuls_step(8, {"dot_general_0": ((1, 1), (1, 4)), "tanh_0": ((1, 4),),
                                 "dot_general_1": ((1, 4), (4, 1)), "reduce_sum_0": ((1, 1),)},
                             fused, loss_repeated_mean=repeated_mean)
    p, x, ref = _two_matmuls_case()
    # fused: the batch's AllGather and the first matmul run as one ring kernel
    assert [n.op for n in step.parallel_graph.fused_nodes()] == (
        ["all_gather_matmul"] if fused else [])
    assert step.sync_axes == [(), ()]
    # the forward's AllReduce of the loss only: no gradient sync, no AllReduce in backward
    assert step.collective_counts(p, step.init(p), x)["all_reduce"] == 1
    # loss_repeated_mean=False multiplies by the repeat count (docs: autopar/train.py)
    assert step.grad_scale == gradient_scale(step.data_parallel_degree, 8, gradients_mean=True,
                                             loss_repeated_mean=repeated_mean)
    numerics.check(jax.tree.map(lambda g: g / step.grad_scale, step.grads(p, x)[1]), ref)


def test_a_slice_of_repeated_work_keeps_its_gradient_sum():
    # the first matmul repeats over a0, but the second takes its rows split over a0: the
    # cotangents reaching w1 differ along a0, so w1's gradient is still summed there
    step = _two_matmuls_step(2, {"dot_general_0": ((1, 1), (1, 1)), "tanh_0": ((1, 1),),
                                 "dot_general_1": ((2, 1), (1, 1)), "reduce_sum_0": ((2, 1),)})
    p, x, ref = _two_matmuls_case()
    assert step.sync_axes == [("a0",), ("a0",)]
    numerics.check(step.grads(p, x)[1], ref)


def test_alike_axes_takes_a_parallel_graph_only():
    from autopar.cotangents import alike_axes

    with pytest.raises(ap.AutoParallelTypeError, match="ParallelGraph"):
        alike_axes("pg")
