"""The parallel optimizer: large parameters reduce-scattered / sharded / all-gathered, equal to
one device, ~1/dp of the memory, bucketed by comm_fusion allgather / reducescatter."""

from __future__ import annotations

import json
import math
import re

import jax
import numpy as np
import optax
import pytest

import autopar as ap
from autopar.models import mlp
from autopar.optimizer_shard import decide_sharding, device_bytes, shard_group, storage_spec
from jax.sharding import PartitionSpec as P

import numerics

KEY = jax.random.key(0)
OPT = optax.sgd(0.1, momentum=0.9)  # state: one parameter-shaped trace per parameter


def _model():
    m = mlp(widths=(16, 256, 256, 16), batch=32)
    params, x = m.example_args(KEY)
    return m, params, x


def _step(m, params, x, opt=OPT, mode="semi_auto_parallel", fixed=None, **ctx):
    with ap.auto_parallel_context(device_num=8, parallel_mode=mode, gradients_mean=True,
                                  **ctx):
        return ap.train_step(m.loss, params, (x,), opt, fixed=fixed)


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
    # optimizer_weight_shard_size: a group of that many devices, innermost sync axes first
    d = decide_sharding("w", (64, 256), (64, 256), 4, ("a0", "a1"), sizes, enabled=True,
                        threshold_kb=0, shard_size=2)
    assert (d.sharded, d.axes, d.replicas, d.fallback) == (True, ("a1",), ("a0",), "")
    d = decide_sharding("w", (64, 256), (64, 256), 4, ("a0", "a1"), sizes, enabled=True,
                        threshold_kb=0, shard_size=8)  # the whole group: the default
    assert (d.axes, d.replicas, d.reason) == (("a0", "a1"), (), "sharded 8 ways over "
                                              "('a0', 'a1')")
    d = decide_sharding("w", (64, 256), (64, 256), 4, ("a0", "a1"), sizes, enabled=True,
                        threshold_kb=0, shard_size=16)  # exceeds the group: falls back
    assert d.sharded and d.axes == ("a0", "a1") and d.replicas == ()
    assert "optimizer_weight_shard_size=16 does not divide" in d.reason and "8" in d.fallback
    assert shard_group(("a0", "a1", "a2"), {"a0": 2, "a1": 3, "a2": 2}, 6) == ("a1", "a2")
    assert shard_group(("a0", "a1", "a2"), {"a0": 2, "a1": 3, "a2": 2}, 4) == ("a0", "a2")
    assert shard_group(("a0", "a1"), {"a0": 4, "a1": 4}, 2) is None  # no axis of size 2
    assert storage_spec(P(), ("a0", "a1"), 2) == P(("a0", "a1"), None)
    assert storage_spec(P("a1"), ("a0",), 1) == P(("a1", "a0"))


def test_parallel_optimizer_config_is_validated():
    with pytest.raises(ap.AutoParallelError):
        ap.set_auto_parallel_context(parallel_optimizer_config={
            "parallel_optimizer_threshold": -1})
    with pytest.raises(TypeError):
        ap.set_auto_parallel_context(parallel_optimizer_config={
            "gradient_accumulation_shard": 1})
    with pytest.raises(ValueError):  # accepted: -1 or an int in [2, 4096]
        ap.set_auto_parallel_context(parallel_optimizer_config={
            "optimizer_weight_shard_size": 5000})


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


# ---------------------------------------------------------------- optimizer_weight_shard_size

# the 256 x 256 weight (leaf 3) split 2 ways on dim 1 over a2: its data-parallel group is a0 x a1
_TP = {"layer1/dot_general_0": ((4, 1), (1, 2))}


def _collectives(text):
    """``(kind, replica groups, text, function)`` of every all-reduce / reduce-scatter /
    all-gather in a lowered program (text: the op's lines up to its type signature;
    function: the ``func.func`` it is in)."""
    out, func = [], ""
    lines = text.split("\n")
    for i, ln in enumerate(lines):
        f = re.search(r"func\.func \w+ @(\w+)", ln)
        func = f.group(1) if f else func
        m = re.search(r'"stablehlo\.(all_reduce|reduce_scatter|all_gather)".*replica_groups = '
                      r'dense<(\[.*?\])>', ln)
        if m:
            end = next(j for j in range(i, len(lines)) if " -> " in lines[j])
            out.append((m.group(1), json.loads(m.group(2)), " ".join(lines[i:end + 1]), func))
    return out


@pytest.mark.parametrize("mode,fixed,size,acc", [
    ("data_parallel", None, 2, 1), ("data_parallel", None, 4, 1),
    ("semi_auto_parallel", None, 2, 2),  # gradient accumulation (data-parallel plan)
    ("semi_auto_parallel", _TP, 2, 1), ("semi_auto_parallel", _TP, 4, 1)])
def test_optimizer_weight_shard_size_shards_over_a_smaller_group(mode, fixed, size, acc):
    """The weight and its momentum are stored 1/size along dim 0; its gradient is
    reduce-scattered in groups of ``size`` (innermost axes: consecutive ranks), the shards
    all-reduced across the groups, the weight all-gathered in its group: equal to one device."""
    m, params, x = _model()
    with ap.auto_parallel_context(device_num=8, parallel_mode=mode, gradients_mean=True,
                                  enable_parallel_optimizer=True, grad_accumulation_step=acc,
                                  optimizer_weight_shard_size=size):
        step = ap.train_step(m.loss, params, (x,), OPT, fixed=fixed)
    group = 8 if fixed is None else 4          # the weight's data-parallel group
    local = (256, 256) if fixed is None else (256, 128)
    d = step.sharding[3]
    assert [s.sharded for s in step.sharding] == [False, False, False, True, False, False]
    assert math.prod(step.mesh.shape[a] for a in d.axes) == size
    assert math.prod(step.mesh.shape[a] for a in d.replicas) == group // size
    p, s = _run(step, params, x, 2)
    shard = (local[0] // size, local[1])
    assert jax.tree.leaves(p)[3].addressable_shards[0].data.shape == shard
    assert jax.tree.leaves(s[0].trace)[3].addressable_shards[0].data.shape == shard
    numerics.check(p, _reference(m, params, x, OPT, 2))
    ops = _collectives(step.as_text(params, step.init(params), x))
    rs = [(g, f) for k, g, ln, f in ops if k == "reduce_scatter" and
          f"-> tensor<{shard[0]}x{shard[1]}xf32>" in ln]
    ag = [g for k, g, ln, _ in ops if k == "all_gather" and
          f"tensor<{shard[0]}x{shard[1]}xf32>)" in ln]
    across = [(g, f) for k, g, _, f in ops if k == "all_reduce" and len(g[0]) == group // size]
    assert len(rs) == 1 and len(ag) == 1
    assert all(len(grp) == size for g in [rs[0][0]] + ag for grp in g)
    assert len(across) == (1 if size < group else 0)
    if acc > 1:  # a reduce-scatter in the micro-step loop, the shards' all-reduce once after
        assert rs[0][1] != across[0][1] == "main"
    rs, across = [g for g, _ in rs], [g for g, _ in across]
    if fixed is None:  # the shard groups are runs of consecutive ranks
        assert rs[0] == [list(range(k, k + size)) for k in range(0, 8, size)] == ag[0]
        assert across[0] == [list(range(k, 8, size)) for k in range(size)]
    for a in (across[0] if across else []):  # a shard's copies: one in each shard group
        assert all(len(set(a) & set(r)) <= 1 for r in rs[0])


@pytest.mark.parametrize("size,group,fixed", [(3, 8, None), (8, 4, _TP)])
def test_optimizer_weight_shard_size_that_does_not_divide_the_group_falls_back(size, group,
                                                                                fixed):
    m, params, x = _model()
    with pytest.warns(ap.AutoParallelWarning, match=rf"optimizer_weight_shard_size={size} "
                      rf"does not divide its data-parallel group size {group}.*layer1/w"):
        step = _step(m, params, x, enable_parallel_optimizer=True, fixed=fixed,
                     optimizer_weight_shard_size=size)
    d = step.sharding[3]
    assert d.sharded and d.replicas == () and math.prod(2 for _ in d.axes) == group
    assert f"sharded {group} ways" in d.reason and "whole group" in d.reason and d.fallback
    shard = step.storage_shardings[3].shard_shape((256, 256))
    assert shard[0] == 256 // group


def test_optimizer_weight_shard_size_is_priced_and_recorded(tmp_path):
    """The search prices the stored copy and state 1/size; the plan and its strategy file
    carry the size (a file of the default has no such field); loading checks it."""
    from autopar.checkpoint import StrategyFileError

    m, params, x = _model()
    g = ap.trace(m.loss, params, x)
    state = ap.CLUSTERS["accelerator-8x"].optimizer_state_factor
    plans = {}
    for size in (-1, 2, 3):
        path = tmp_path / f"s{size}.json"
        ctx = dict(device_num=8, parallel_mode="semi_auto_parallel",
                   enable_parallel_optimizer=True, strategy_ckpt_save_file=str(path),
                   **({} if size == -1 else {"optimizer_weight_shard_size": size}))
        with ap.auto_parallel_context(**ctx):
            plans[size] = ap.search(g)
        assert ('"optimizer_weight_shard_size"' in path.read_text()) == (size != -1)
    assert plans[2].pricing.optimizer_weight_shard_size == 2
    w = 256 * 256 * 4  # the only weight over the 64 KB threshold
    # the copy and state held, and the new ones the update writes (the step's outputs)
    more = 2 * w * (1 + state) * (1 / 2 - 1 / 8)
    assert plans[2].cost.memory_bytes - plans[-1].cost.memory_bytes == pytest.approx(more)
    assert plans[3].cost.memory_bytes == plans[-1].cost.memory_bytes  # 3 falls back to 8
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  enable_parallel_optimizer=True, optimizer_weight_shard_size=2):
        loaded = ap.load_strategy(tmp_path / "s2.json", g)
        assert loaded.cost.memory_bytes == plans[2].cost.memory_bytes
        with pytest.raises(StrategyFileError) as e:
            ap.load_strategy(tmp_path / "s-1.json", g)
    assert e.value.field == "optimizer_weight_shard_size"


def test_pipelined_step_refuses_another_shard_size():
    m = mlp(widths=(8, 16, 16, 8), batch=8)
    params, x = m.example_args(KEY)
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  pipeline_stages=2, enable_parallel_optimizer=True,
                                  optimizer_weight_shard_size=2):
        with pytest.raises(ap.AutoParallelError, match="optimizer_weight_shard_size"):
            ap.train_step(m.loss, params, (x,))


@pytest.mark.parametrize("config, want", [
    ([2], [("params/layer2/b",), ("params/layer1/b", "params/layer0/b")]),
    ([2, 5], [("params/layer2/b",), ("params/layer1/b", "params/layer0/b")]),
    ([1], [("params/layer2/b",), ("params/layer1/b", "params/layer0/b")]),
])
def test_fusion_indices_count_every_gradient_under_the_parallel_optimizer(config, want):
    """all_reduce_fusion_config indices count the whole backward order (docs/fusion.md); the
    step re-indexed only the gradients left to all-reduce ([2] split before layer0/b, and
    [2, 5] was refused as past 3 gradients)."""
    from autopar.models import mlp

    m = mlp(widths=(16, 64, 64, 16), batch=16)
    params, x = m.example_args(jax.random.key(0))
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  gradients_mean=True, enable_parallel_optimizer=True,
                                  parallel_optimizer_config={"parallel_optimizer_threshold": 1},
                                  all_reduce_fusion_config=config):
        step = ap.train_step(m.loss, params, (x,))
        full = ap.simulation.gradient_buckets(ap.trace(m.loss, params, x))
    assert [b.gradients for b in step.buckets["allreduce"]] == want
    assert [[g for g in b.gradients if g.endswith("/b")] for b in full] == [
        list(w) for w in want] + [[]] * (len(full) - len(want))


def test_the_sharded_update_is_priced_at_each_device_share():
    """Under the parallel optimizer each device updates its share of a sharded parameter:
    the search and both simulators price the update of a data-parallel plan's large
    parameters at 1/dp of their bytes, the small ones (under the threshold) whole."""
    from autopar.strategies.cost import CostModel
    from autopar.strategies.problem import requires_grad
    from autopar.timeline import update_time

    m, params, x = _model()
    g = ap.trace(m.loss, params, x)
    clus = ap.CLUSTERS["accelerator-8x"]
    plans = {}
    for on in (False, True):
        with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                      enable_parallel_optimizer=on):
            plans[on] = ap.search(g, cluster=clus)
    cm, grad = CostModel(clus), requires_grad(g)
    trained = [v for v in plans[True].parameters if grad.get(v, False)]
    kb = plans[True].pricing.parallel_optimizer_kb
    want = sum(cm.update_time(g.spec(v).nbytes / (8 if g.spec(v).nbytes >= kb * 1024 else 1))
               for v in trained)
    assert 0 < kb and any(g.spec(v).nbytes < kb * 1024 for v in trained)  # (both kinds)
    assert update_time(g, trained, plans[True], cm) == pytest.approx(want, rel=1e-12)
    assert update_time(g, trained, plans[False], cm) == pytest.approx(
        sum(cm.update_time(g.spec(v).nbytes) for v in trained), rel=1e-12)
    saved = update_time(g, trained, plans[False], cm) - want
    assert saved > 0 and plans[False].cost.compute - plans[True].cost.compute == \
        pytest.approx(saved, rel=1e-9)
