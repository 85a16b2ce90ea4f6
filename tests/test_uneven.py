"""Uneven batches (autopar/uneven.py): parallelize(..., uneven_batch="all_gather_v")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.uneven import UnevenBatch, batch_counts

import numerics


def mlp(p, x):
    """Per-row MLP: no operator mixes batch rows."""
    return jnp.tanh(x @ p["w1"]) @ p["w2"]


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (16, 32)), "w2": jax.random.normal(k2, (32, 8))}


def _batch(b, seed=1):
    return jax.random.normal(jax.random.key(seed), (b, 16))


def _uneven(fn, *args, n=4, mode="data_parallel", **kw):
    with ap.auto_parallel_context(device_num=n, parallel_mode=mode):
        return ap.parallelize(fn, *args, uneven_batch="all_gather_v", **kw)


def test_batch_counts_mindspore_style():
    assert batch_counts(6, 4) == (2, 2, 1, 1)
    assert batch_counts(7, 4) == (2, 2, 2, 1)
    assert batch_counts(10, 8) == (2, 2, 1, 1, 1, 1, 1, 1)
    assert batch_counts(3, 4) == (1, 1, 1, 0)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("b", [6, 7, 10])
def test_uneven_mlp_matches_one_device(n, b):
    p, x = _params(), _batch(b)
    f = _uneven(mlp, p, x, n=n)
    out = f(p, x)
    assert out.shape == (b, 8)
    numerics.assert_close(out, mlp, p, x)
    u = f.uneven
    assert isinstance(u, UnevenBatch)
    assert u.counts == batch_counts(b, n) and sum(u.counts) == b
    assert u.rows == -(-b // n) and u.ranks == n
    assert u.displs == tuple(np.cumsum((0,) + u.counts[:-1]))
    # the program runs at the padded batch, split n ways
    assert f.parallel_graph.values["x"].spec.shape == (n * u.rows, 16)
    assert f.parallel_graph.values["x"].local_shape == (u.rows, 16)
    # the only communication is all_gather_v's gather of the output (one all_gather)
    counts = f.collective_counts(p, x)
    assert counts["all_gather"] == 1
    assert counts["all_reduce"] == counts["all_to_all"] == counts["reduce_scatter"] == 0
    # all_gather_v ("padded" method at these sizes): each device sends its first
    # max(counts) rows flattened, one all_gather, cut to exactly b rows
    text = f.as_text(p, x)
    gathers = [ln for ln in text.splitlines() if "stablehlo.all_gather" in ln]
    assert len(gathers) == 1
    width = max(u.counts) * 8
    assert f"(tensor<1x{width}xf32>) -> tensor<{n}x{width}xf32>" in gathers[0]
    assert f"-> tensor<{b}x8xf32>" in text


def test_padding_rows_repeat_real_rows():
    u = _uneven(mlp, _params(), _batch(6)).uneven
    assert u.row_table().tolist() == [[0, 1], [2, 3], [4, 4], [5, 5]]
    u = _uneven(mlp, _params(), _batch(3)).uneven
    assert u.counts == (1, 1, 1, 0)
    assert u.row_table().tolist() == [[0], [1], [2], [2]]


def test_batch_smaller_than_devices_and_pytrees():
    p = _params()

    def two(p, batch):
        h = jnp.tanh(batch["x"] @ p["w1"])
        return {"y": h @ p["w2"], "z": h * batch["s"][:, None], "w": jnp.sum(p["w2"])}

    batch = {"x": _batch(3), "s": jnp.arange(3.0) + 1}
    f = _uneven(two, p, batch, n=8)
    out = f(p, batch)
    assert f.uneven.counts == (1, 1, 1, 0, 0, 0, 0, 0)
    assert f.uneven.outputs.count(True) == 2      # y and z gathered, w passes through
    numerics.assert_close(out, two, p, batch)     # every leaf, shapes included


@pytest.mark.parametrize("name, fn, node", [
    ("batch mean", lambda p, x: jnp.tanh(x @ p["w1"]) - jnp.mean(x @ p["w1"], axis=0),
     "reduce_sum_0"),
    ("mean loss", lambda p, x: jnp.mean(mlp(p, x)), "reduce_sum_0"),
    ("gram", lambda p, x: x @ x.T, "transpose_0"),
    ("batch softmax", lambda p, x: jax.nn.softmax(x @ p["w1"], axis=0), "all_gather_0"),
    ("reads batch size", lambda p, x: mlp(p, x) * x.shape[0], "mul_0"),
    ("row numbers", lambda p, x: x + jnp.arange(x.shape[0])[:, None], "iota_0"),
    ("dropout mask", lambda p, x: mlp(p, x * jax.random.bernoulli(jax.random.key(1), 0.5,
                                                                  x.shape)),
     "_bernoulli/_uniform/random_bits_0"),
    ("sum of a batch-shaped constant", lambda p, x: mlp(p, x) + jnp.sum(jnp.ones_like(x)),
     "reduce_sum_0"),
])
def test_row_mixing_is_refused(name, fn, node):
    p, x = _params(), _batch(6)
    with pytest.raises(AutoParallelError) as e:
        _uneven(fn, p, x)
    msg = str(e.value)
    assert "batch size 6" in msg and "data-parallel degree 4" in msg
    assert repr(node) in msg and "mixes batch rows" in msg
    assert 'uneven_batch="divisor"' in msg
    # the divisor default runs it (2-way) and is exact
    with ap.auto_parallel_context(device_num=4, parallel_mode="data_parallel"):
        f = ap.parallelize(fn, p, x)
    np.testing.assert_allclose(np.asarray(f(p, x)), np.asarray(jax.jit(fn)(p, x)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [
    lambda p, x: jnp.where(x > 1.0, x, 0.0) @ p["w1"],
    lambda p, x: (jnp.zeros_like(x) + x) @ p["w1"],
    lambda p, x: mlp(p, x * jnp.full(x.shape, 2.0)),
    lambda p, x: mlp(p, (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True)
                                                                  + 1e-5)),
], ids=["where", "zeros_like", "full", "layer_norm_var"])
def test_batch_shaped_constants_do_not_mix_rows(fn):
    """A broadcast constant of the padded batch's shape was refused as mixing rows (rule 5:
    its padded rows meet only padded rows); jnp.var's NaN literal differed from itself
    between the two traces (NaN != NaN), so a layer norm 'depended on the batch size'."""
    p, x = _params(), _batch(6)
    numerics.assert_close(_uneven(fn, p, x)(p, x), fn, p, x)
    with pytest.raises(AutoParallelError, match="output computed from no batch input"):
        _uneven(lambda p, x: (fn(p, x), jnp.zeros_like(x)), p, x)


def test_a_searched_plan_that_mixes_rows_gives_way_to_data_parallel(tmp_path):
    """A search mode's plan that moves the batch is replaced, with a warning, by every
    operator split along the batch (saved as the plan); a user's strategies are refused."""
    def rows_softmax(p, x):
        return jax.nn.softmax(x @ p["w1"], axis=-1)

    p, x, saved = _params(), _batch(6), tmp_path / "s.json"
    with pytest.warns(ap.AutoParallelWarning, match="mixes batch rows.*data-parallel plan"):
        with ap.auto_parallel_context(strategy_ckpt_save_file=str(saved)):
            f = _uneven(rows_softmax, p, x, n=8, mode="auto_parallel")
    assert all(s.splits[0] == 8 for s in f.plan.nodes.values() if len(s.splits) == 2)
    numerics.assert_close(f(p, x), rows_softmax, p, x)
    assert ap.load_strategy(saved, f.graph, device_num=8).nodes == f.plan.nodes  # it runs
    dot = next(n for n in f.plan.nodes if n.startswith("dot_general"))
    with pytest.raises(AutoParallelError, match="mixes batch rows"):  # the user's, refused
        _uneven(rows_softmax, p, x, n=8, mode="auto_parallel", fixed={dot: ((1, 1), (1, 8))})
    with pytest.raises(AutoParallelError, match="mixes batch rows"):  # no plan keeps rows
        _uneven(lambda p, x: jnp.mean(x @ p["w1"], axis=0), p, x, n=8, mode="auto_parallel")


def test_divisor_default_unchanged():
    p, x = _params(), _batch(6)
    with ap.auto_parallel_context(device_num=4, parallel_mode="data_parallel"):
        f = ap.parallelize(mlp, p, x)
    assert f.uneven is None
    assert f.parallel_graph.values["x"].local_shape == (3, 16)      # 2-way split
    assert f.collective_counts(p, x)["all_gather"] == 0
    numerics.assert_close(f(p, x), mlp, p, x)


def test_even_batch_under_all_gather_v_runs_the_ordinary_program():
    p, x = _params(), _batch(8)
    f = _uneven(mlp, p, x)
    assert f.uneven is None
    assert f.collective_counts(p, x)["all_gather"] == 0
    assert f.parallel_graph.values["x"].local_shape == (2, 16)


def test_called_with_the_real_batch_only():
    p = _params()
    f = _uneven(mlp, p, _batch(6))
    with pytest.raises(AutoParallelError, match="shape must be"):
        f(p, _batch(8))


@pytest.mark.parametrize("value, error", [
    ("gather", AutoParallelError), ("", AutoParallelError), ("DIVISOR", AutoParallelError),
    (True, AutoParallelTypeError), (None, AutoParallelTypeError), (4, AutoParallelTypeError),
])
def test_bad_uneven_batch_option(value, error):
    with pytest.raises(error) as e:
        _ = ap.parallelize(mlp, _params(), _batch(6), uneven_batch=value)
    assert "uneven_batch" in str(e.value)
    if error is AutoParallelError:
        assert "all_gather_v" in str(e.value) and "divisor" in str(e.value)


def test_batch_inputs_must_agree_on_dim_0():
    def two(p, x, y):
        return x @ p["w1"], y

    with pytest.raises(AutoParallelError, match="same dim 0"):
        _uneven(two, _params(), _batch(6), jnp.ones((5, 2)))


def test_semi_auto_strategies():
    p, x = _params(), _batch(6)
    with pytest.raises(AutoParallelError, match="'dot_general_0' mixes batch rows"):
        _uneven(mlp, p, x, mode="semi_auto_parallel",
                fixed={"dot_general_0": ((2, 1), (1, 2))})
    f = _uneven(mlp, p, x, mode="semi_auto_parallel", fixed={"dot_general_0": ((4, 1), (1, 1))})
    assert f.uneven.counts == (2, 2, 1, 1)
    numerics.assert_close(f(p, x), mlp, p, x)


def test_gradients_through_the_uneven_forward():
    p, x = _params(), _batch(7)
    f = _uneven(mlp, p, x)

    def sq(fn):
        return lambda p, x: jnp.sum(fn(p, x) ** 2)

    got = jax.grad(sq(f), argnums=(0, 1))(p, x)
    numerics.assert_close(got, jax.grad(sq(mlp), argnums=(0, 1)), p, x)
