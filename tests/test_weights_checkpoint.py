"""Trained weights move between plans (autopar.weights): 3 Adam steps under plan A on 8
devices, save, restore under plan B on 4 devices (another mode, another stage count), 3 more
steps: the parameters equal 6 uninterrupted single-device steps (float64-judged); and the
checks, the atomic save, MindSpore's words and the CLI verb."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import autopar as ap
import numerics
from autopar.models import mlp
from autopar.weights import (CheckpointMismatchError, CheckpointStrategyError,
                             load_distributed_checkpoint, read_manifest, transform_checkpoints)

KEY = jax.random.key(0)
OPT = optax.adam(1e-2)


def _model():
    return mlp(widths=(8, 16, 16, 8), batch=8)


_REF: dict[str, numerics.Reference] = {}


def _reference(m, params, x):
    if "ref" not in _REF:
        run = numerics.optimizer_steps(m.loss, OPT, 6)
        _REF["ref"] = numerics.reference(run, params, x, jit=False)
    return _REF["ref"]


def _step(m, params, x, devices, kind, path=None):
    """A step of one of the test matrix's plans on ``devices`` devices."""
    common = dict(device_num=devices, gradients_mean=True)
    if kind == "data_parallel":
        ctx = dict(parallel_mode="data_parallel")
    elif kind == "megatron_po":  # column split of the first matmul + the parallel optimizer
        ctx = dict(parallel_mode="semi_auto_parallel", enable_parallel_optimizer=True,
                   parallel_optimizer_config={"parallel_optimizer_threshold": 0})
    elif kind == "auto":
        ctx = dict(parallel_mode="auto_parallel", search_mode="recursive_programming")
    else:  # "pipeline": 2 stages, the parallel optimizer on
        ctx = dict(parallel_mode="semi_auto_parallel", pipeline_stages=2,
                   enable_parallel_optimizer=True,
                   parallel_optimizer_config={"parallel_optimizer_threshold": 0})
    fixed = None
    if kind == "megatron_po":
        g = ap.trace(m.loss, params, x)
        first = next(nd for nd in g.nodes if nd.op == "dot_general")
        fixed = {first.name: ((1, 1), (1, devices))}
    with ap.auto_parallel_context(**common, **ctx):
        if kind == "pipeline":
            return ap.pipeline_train_step(m.loss, params, (x,), OPT, micro_batches=2)
        return ap.train_step(m.loss, params, (x,), OPT, fixed=fixed)


def _train(step, params, state, x, n=3):
    for _ in range(n):
        params, state, _ = step(params, state, x)
    return params, state


@pytest.mark.parametrize("a, b", [("data_parallel", "pipeline"), ("megatron_po", "auto"),
                                  ("pipeline", "data_parallel")])
def test_resume_under_another_plan_equals_an_uninterrupted_run(a, b, tmp_path):
    m = _model()
    params, x = m.example_args(KEY)
    step_a = _step(m, params, x, 8, a)
    if a != "data_parallel":  # the parallel optimizer's shards really are saved
        decisions = step_a.shard_decisions if a == "pipeline" else step_a.sharding
        assert any(d.sharded for d in decisions)
    p, s = _train(step_a, params, step_a.init(params), x)
    ap.save_checkpoint(tmp_path / "ck", p, s, step_a)
    step_b = _step(m, params, x, 4, b)
    p2, s2 = ap.load_checkpoint(tmp_path / "ck", step_b)
    if b != "pipeline":  # restored straight into the step's storage layouts
        assert [leaf.sharding for leaf in jax.tree.leaves(p2)] == step_b.storage_shardings
    p2, _ = _train(step_b, p2, s2, x)
    ref = _reference(m, params, x)
    numerics.check(p2, numerics.Reference(ref.f64[0], ref.f32[0]), f"{a} -> {b}")


def _dp_checkpoint(tmp_path, m=None):
    m = m or _model()
    params, x = m.example_args(KEY)
    step = _step(m, params, x, 8, "data_parallel")
    ap.save_checkpoint(tmp_path / "ck", params, step.init(params), step)
    return step, params, x


def test_restore_refuses_other_shapes_dtypes_and_names(tmp_path):
    _dp_checkpoint(tmp_path)
    other = mlp(widths=(8, 16, 8, 8), batch=8)
    params, x = other.example_args(KEY)
    with pytest.raises(CheckpointMismatchError, match=r"layer1'\]\['b'\].*\(8,\).*\(16,\)"):
        ap.load_checkpoint(tmp_path / "ck", _step(other, params, x, 4, "data_parallel"))
    short = mlp(widths=(8, 16, 16), batch=8)
    params, x = short.example_args(KEY)
    with pytest.raises(CheckpointMismatchError, match="layer2.*the target does not have"):
        ap.load_checkpoint(tmp_path / "ck", _step(short, params, x, 4, "data_parallel"))
    half = mlp(widths=(8, 16, 16, 8), batch=8, dtype=jax.numpy.bfloat16)
    params, x = half.example_args(KEY)
    with pytest.raises(CheckpointMismatchError, match="bfloat16.*float32"):
        ap.load_checkpoint(tmp_path / "ck", _step(half, params, x, 4, "data_parallel"))
    assert issubclass(CheckpointMismatchError, ap.AutoParallelError)


def test_a_killed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    step, params, x = _dp_checkpoint(tmp_path)
    import autopar.weights as w

    def killed(files):
        raise KeyboardInterrupt  # the process dies after the arrays, before the manifest

    monkeypatch.setattr(w, "write_files_atomic", killed)
    bumped = jax.tree.map(lambda a: a + 1, params)
    with pytest.raises(KeyboardInterrupt):
        ap.save_checkpoint(tmp_path / "ck", bumped, step.init(bumped), step)
    monkeypatch.undo()
    p, _ = ap.load_checkpoint(tmp_path / "ck", step)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p),
                                                     jax.tree.leaves(params)))
    ap.save_checkpoint(tmp_path / "ck", bumped, step.init(bumped), step)  # and saves again
    assert len([d for d in (tmp_path / "ck").iterdir() if d.is_dir()]) == 1


def test_transform_checkpoints_with_strategy_files(tmp_path):
    m = _model()
    params, x = m.example_args(KEY)
    for devices, name in ((8, "src.json"), (4, "dst.json")):
        with ap.auto_parallel_context(device_num=devices, gradients_mean=True,
                                      parallel_mode="auto_parallel",
                                      strategy_ckpt_save_file=str(tmp_path / name)):
            step = ap.train_step(m.loss, params, (x,), OPT)
        if devices == 8:
            src = step
            ap.save_checkpoint(tmp_path / "ck", params, step.init(params), step)
    with pytest.raises(CheckpointStrategyError, match="device_num"):
        transform_checkpoints(tmp_path / "ck", tmp_path / "out", "rank-", tmp_path / "dst.json",
                              tmp_path / "dst.json")
    transform_checkpoints(tmp_path / "ck", tmp_path / "out", "rank-", tmp_path / "src.json",
                          tmp_path / "dst.json")
    assert read_manifest(tmp_path / "out").item == "rank-1"
    p, s = load_distributed_checkpoint(src, [str(tmp_path / "out")],
                                       train_strategy_filename=tmp_path / "dst.json")
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p),
                                                     jax.tree.leaves(params)))
    by_name, _ = ap.load_checkpoint(tmp_path / "out", tmp_path / "dst.json")
    assert sorted(by_name) == sorted(jax.tree_util.keystr(k) for k, _ in
                                     jax.tree_util.tree_flatten_with_path(params)[0])


def test_reshard_verb(tmp_path, capsys):
    from autopar.cli import main

    _dp_checkpoint(tmp_path)
    assert main(["reshard", str(tmp_path / "ck"), str(tmp_path / "out"), "--devices", "4"]) == 0
    e = read_manifest(tmp_path / "out").params[0]
    assert e.dev_matrix == [4] and 0 in e.tensor_map
    assert main(["reshard", str(tmp_path / "nowhere"), str(tmp_path / "o2"), "--devices",
                 "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "autopar reshard: error:" in err[0] and "manifest" in err[0]


def _dropout_loss(p, x):
    keep = jax.random.bernoulli(p["rng"], 0.5, x.shape)
    return ((jax.numpy.where(keep, x, 0.0) @ p["w"]) ** 2).mean() + 0.0 * p["more"].size


def test_typed_prng_keys_come_back_as_keys_of_their_impl(tmp_path):
    """orbax writes a typed key's raw data and its impl; the manifest names the impl, the
    restore makes keys of it again (a dropout key reads the same masks after the move)."""
    x = jax.numpy.ones((16, 8))
    params = {"w": jax.numpy.ones((8, 4)), "rng": jax.random.key(1, impl="rbg"),
              "more": jax.random.split(jax.random.key(2), 8)}
    steps = []
    for devices, mode in ((8, "data_parallel"), (4, "auto_parallel")):
        with ap.auto_parallel_context(device_num=devices, parallel_mode=mode,
                                      gradients_mean=True):
            steps.append(ap.train_step(_dropout_loss, params, (x,), OPT))
    p, s, _ = steps[0](params, steps[0].init(params), x)
    ap.save_checkpoint(tmp_path / "ck", p, s, steps[0])
    assert {e.name: e.key_impl for e in read_manifest(tmp_path / "ck").params} == {
        "['more']": "threefry2x32", "['rng']": "rbg", "['w']": None}
    p2, s2 = ap.load_checkpoint(tmp_path / "ck", steps[1])
    for k in ("rng", "more"):
        assert p2[k].dtype == p[k].dtype and np.array_equal(jax.random.key_data(p2[k]),
                                                            jax.random.key_data(p[k]))
    assert np.allclose(steps[1](p2, s2, x)[2], steps[0](p, s, x)[2], rtol=1e-6)
    by_name, _ = ap.load_checkpoint(tmp_path / "ck", steps[1].plan)
    assert by_name["rng"].dtype == p["rng"].dtype
    other = {**params, "rng": jax.random.key(1)}  # threefry, not rbg: refused by name
    with ap.auto_parallel_context(device_num=4, parallel_mode="data_parallel",
                                  gradients_mean=True):
        step = ap.train_step(_dropout_loss, other, (x,), OPT)
    with pytest.raises(CheckpointMismatchError, match=r"\['rng'\].*key<fry>.*key<rbg>"):
        ap.load_checkpoint(tmp_path / "ck", step)
