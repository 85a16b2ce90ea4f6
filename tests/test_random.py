"""The random primitives: typed PRNG keys as values (arguments, pytree leaves, constants,
intermediate keys) and ``random_bits`` split like any output, each device drawing its block of
the same global random array -- so a dropout mask on 8 devices is the one-device mask bit for
bit, under a data-parallel plan, a feature split and a 2 x 4 mesh, in plain JAX and in a
flax.linen model, forward and through a training step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import autopar as ap
import numerics
from autopar.graph import prng
from autopar.graph.ops import op_spec
from clusters import COMPUTE_BOUND

KEY = jax.random.key(7)
W = jnp.cos(jnp.arange(16 * 32.0)).reshape(16, 32) / 4
X = jnp.sin(jnp.arange(8 * 16.0)).reshape(8, 16)
KEEP = np.float32(0.75)  # (a float32 constant: the float64 reference draws the same mask)


def _dropout(w, x, key):
    """``(dropout(x @ w), its mask)`` with ``jax.random.bernoulli``."""
    h = jnp.tanh(x @ w)
    mask = jax.random.bernoulli(key, KEEP, h.shape)
    return jnp.where(mask, h / KEEP, 0.0), mask


def _loss(w, x, key):
    return jnp.mean(_dropout(w, x, key)[0] ** 2)


def _parallel(fn, args, mode="auto_parallel", fixed=None, cluster=COMPUTE_BOUND):
    with ap.auto_parallel_context(device_num=8, parallel_mode=mode):
        return ap.parallelize(fn, *args, fixed=fixed, cluster=cluster)


def _draws(f):
    """The layouts of the parallel program's ``random_bits`` outputs."""
    pg = f.parallel_graph
    return [pg.values[n.outputs[0]].layout for n in pg.nodes if n.op == "random_bits"]


def _same_bits(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _matmul(fn, args):
    return next(n.name for n in ap.trace(fn, *args).nodes if n.op == "dot_general")


# ---------------------------------------------------------------------------- keys as values


def test_typed_keys_are_values_with_their_key_datas_size():
    def noisy(params, x, key):
        return _dropout(params["w"], x, key)[0] + jax.random.normal(params["noise"], (8, 32))

    g = ap.trace(noisy, {"w": W, "noise": jax.random.key(1)}, X, KEY)
    assert str(g.spec("key")) == "key<fry>[]" and g.values["key"].kind == "data"
    assert g.spec("params/noise").dtype == "key<fry>" and g.values["params/noise"].kind == \
        "param"
    assert g.spec("key").itemsize == 8 and g.spec("key").nbytes == 8
    (draw,) = [n for n in g.nodes if n.op == "random_bits" and n.inputs == ("key",)]
    assert draw.bytes_read == 8 and draw.kind == "random_bits"
    assert op_spec(draw, g).out_maps == ((0, 1),) and op_spec(draw, g).fixed == ()
    split = ap.trace(lambda k: jax.random.split(k, 4), KEY)
    assert str(split.spec(split.outputs[0])) == "key<fry>[4]"
    assert op_spec(split.nodes[0], split).fixed == (0,)  # the new keys: whole
    abstract = ap.trace(lambda k, x: x * jax.random.uniform(k, x.shape),
                        jax.eval_shape(jax.random.key, 0), X)
    assert abstract.spec("k").dtype == "key<fry>"
    assert prng.itemsize("key<rbg>") == 16 and prng.itemsize("bfloat16") == 2
    with pytest.raises(ap.AutoParallelError, match="no PRNG implementation"):
        prng.itemsize("key<nope>")


def test_a_closed_over_key_is_a_constant_holding_its_key_data():
    def closed(x):
        return _dropout(W, x, KEY)

    g = ap.trace(closed, X)
    (const,) = [v for v in g.values.values() if v.kind == "const" and v.spec.dtype ==
                "key<fry>"]
    np.testing.assert_array_equal(const.data, jax.random.key_data(KEY))
    f = _parallel(closed, (X,))
    assert any(lay.used_axes() for lay in _draws(f))
    _same_bits(f(X)[1], closed(X)[1])
    numerics.assert_close(f(X), closed, X)


# ---------------------------------------------------------------------------- split draws


@pytest.mark.parametrize("split", ["data_parallel", "batch", "features", "2x4"])
def test_a_dropout_mask_is_the_one_device_mask_under_every_split(split):
    """``data_parallel``: the draw is whole on each device and sliced to the batch; the
    others split the draw itself (asserted), each device drawing its block."""
    args = (W, X, KEY)
    fixed = {"batch": ((8, 1), (1, 1)), "features": ((1, 1), (1, 8)),
             "2x4": ((2, 1), (1, 4))}.get(split)
    if fixed is None:
        f = _parallel(_dropout, args, mode="data_parallel", cluster=None)
    else:
        f = _parallel(_dropout, args, fixed={_matmul(_dropout, args): fixed})
        (draw,) = _draws(f)
        want = {"batch": (8, 1), "features": (1, 8), "2x4": (2, 4)}[split]
        assert draw.split_counts(f.parallel_graph.mesh) == want
    out, mask = f(*args)
    _same_bits(mask, _dropout(*args)[1])
    assert 0.6 < float(jnp.mean(mask)) < 0.9
    numerics.assert_close((out, mask), _dropout, *args)


def test_every_bit_width_and_distribution_and_per_key_draws_are_exact():
    def draws(x, key):
        k1, k2 = jax.random.split(key)
        k3 = jax.random.fold_in(k2, 5)
        per_row = jax.vmap(lambda k, r: r * jax.random.uniform(k, r.shape))(
            jax.random.split(k3, 8), x)  # keys [8]: the key dim and the drawn dim split
        return (x * jax.random.normal(k1, x.shape), jax.random.bits(k3, (8, 16), jnp.uint8),
                jax.random.bits(k1, (8, 16), jnp.uint16), per_row,
                jax.random.randint(k2, (8, 16), 0, 100))

    f = _parallel(draws, (X, KEY))
    assert all(lay.used_axes() for lay in _draws(f))
    _same_bits(f(X, KEY), jax.jit(draws)(X, KEY))


def test_a_block_equals_that_block_of_the_whole_draw():
    """:func:`prng.draw_block` against ``jax.random.bits`` for every bit width, a key array,
    and counters past 2**32 (a virtual shape, checked against Python integers)."""
    keys = jax.random.split(KEY, 3)
    with jax.enable_x64(True):
        for width in (8, 16, 32, 64):
            whole = jax.vmap(lambda k: jax.random.bits(k, (6, 10), f"uint{width}"))(keys)
            block = prng.draw_block(keys, "key<fry>", width, (6, 10), (3, 5), (3, 5), None)
            _same_bits(block, whole[:, 3:, 5:])
    shape, local, starts = (2 ** 20, 2 ** 14, 3), (3, 5, 2), (2 ** 19 + 7, 2 ** 13 + 1, 1)
    hi, lo = prng.block_counters(shape, local, starts)
    got = np.asarray(hi).astype(object) * 2 ** 32 + np.asarray(lo).astype(object)
    for i in np.ndindex(*local):
        g = [s + d for s, d in zip(starts, i)]
        assert got[i] == (g[0] * shape[1] + g[1]) * shape[2] + g[2]


@pytest.mark.parametrize("key, partitionable", [(jax.random.key(3, impl="rbg"), True),
                                                 (jax.random.key(3), False)],
                         ids=["rbg", "threefry_not_partitionable"])
def test_other_generators_draw_whole_and_keep_their_block(key, partitionable):
    """Keys whose bits are not a function of the index alone (rbg; threefry with
    ``jax_threefry_partitionable`` off) draw the whole array and keep their block: still
    the one-device bits."""
    def draws(x, key):
        return x * jax.random.uniform(key, x.shape), jax.random.bits(key, (8, 16), jnp.uint8)

    with jax.threefry_partitionable(partitionable):
        assert not prng.partitionable(str(key.dtype))
        f = _parallel(draws, (X, key))
        assert all(lay.used_axes() for lay in _draws(f))
        _same_bits(f(X, key), jax.jit(draws)(X, key))


def test_raw_keys_and_the_threefry_hash_itself():
    """A legacy ``uint32[2]`` key (``random_wrap`` / ``random_unwrap``) and the
    ``threefry2x32`` primitive (elementwise on its counters)."""
    from jax.extend.random import threefry_2x32

    raw = jax.random.PRNGKey(4)

    def hashed(x, raw):
        counts = lax.bitcast_convert_type(x, jnp.uint32)
        return threefry_2x32(raw, counts), jax.random.split(raw), x * jax.random.uniform(
            raw, x.shape)

    g = ap.trace(hashed, X, raw)
    assert {"threefry2x32", "random_wrap", "random_unwrap", "bitcast_convert_type"} <= {
        n.op for n in g.nodes}
    f = _parallel(hashed, (X, raw))
    _same_bits(f(X, raw), jax.jit(hashed)(X, raw))


# ---------------------------------------------------------------------------- flax, training


def _flax_net():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dropout(0.25, deterministic=False)(nn.Dense(64)(x))
            return nn.Dense(16)(nn.relu(h))

    net = Net()
    x = jnp.sin(jnp.arange(16 * 32.0)).reshape(16, 32)
    params = net.init(jax.random.key(0), x)

    def hidden(p, x, key):  # the dropped-out hidden layer: its zeros are the mask
        return net.apply(p, x, rngs={"dropout": key}, capture_intermediates=True,
                         mutable=["intermediates"])[1]["intermediates"]["Dropout_0"][
                             "__call__"][0]

    return (lambda p, x, key: net.apply(p, x, rngs={"dropout": key})), hidden, params, x


@pytest.mark.parametrize("mode", ["data_parallel", "auto_parallel"])
def test_a_flax_linen_dropout_is_the_one_device_dropout(mode):
    """``nn.Dropout(deterministic=False)`` with ``rngs={'dropout': key}``. (flax draws at its
    Python float rate, float64 under x64, so the reference is the float32 run: the mask
    bit for bit, the result to float32 rounding.)"""
    fwd, hidden, params, x = _flax_net()
    key = jax.random.key(5)
    both = lambda p, x, key: (fwd(p, x, key), hidden(p, x, key))  # noqa: E731
    f = _parallel(both, (params, x, key), mode=mode,
                  cluster=COMPUTE_BOUND if mode == "auto_parallel" else None)
    if mode == "auto_parallel":
        assert all(lay.used_axes() for lay in _draws(f))
    (out, h), (want_out, want_h) = f(params, x, key), jax.jit(both)(params, x, key)
    np.testing.assert_array_equal(np.asarray(h) == 0, np.asarray(want_h) == 0)
    assert 0.6 < float(np.mean(np.asarray(want_h) != 0)) < 0.9
    np.testing.assert_allclose(np.asarray(h), np.asarray(want_h), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(fwd(params, x, jax.random.key(6))),
                           np.asarray(want_out))  # (another key: another mask)


@pytest.mark.parametrize("mode", ["data_parallel", "auto_parallel"])
def test_a_training_step_with_the_key_in_the_batch_matches_jax_grad(mode):
    with ap.auto_parallel_context(device_num=8, parallel_mode=mode, gradients_mean=True):
        step = ap.train_step(_loss, W, (X, KEY), optax.sgd(0.1), cluster=COMPUTE_BOUND)
    if mode == "auto_parallel":
        assert all(lay.used_axes() for lay in _draws(step))
    grad = jax.value_and_grad(_loss)
    numerics.assert_close(step.grads(W, X, KEY), grad, W, X, KEY, single=grad(W, X, KEY),
                          jit=False)
    other = jax.random.key(8)  # the key is an input, not the example's frozen in
    numerics.assert_close(step.grads(W, X, other), grad, W, X, other,
                          single=grad(W, X, other), jit=False)
    new, _, value = step(W, step.init(W), X, other)
    numerics.check((new, [value]), numerics.reference(
        numerics.optimizer_steps(_loss, optax.sgd(0.1)), W, X, other, jit=False))


def test_a_flax_training_step_with_dropout_matches_jax_grad():
    fwd, _, params, x = _flax_net()
    y = jnp.cos(jnp.arange(16 * 16.0)).reshape(16, 16)

    def loss(p, x, y, key):
        return jnp.mean((fwd(p, x, key) - y) ** 2)

    key = jax.random.key(2)
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True):
        step = ap.train_step(loss, params, (x, y, key))
    value, grads = step.grads(params, x, y, key)
    want_value, want = jax.jit(jax.value_and_grad(loss))(params, x, y, key)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------- still refused


def test_an_uneven_batch_refuses_a_draw_split_over_the_padded_batch():
    """An uneven batch runs padded (autopar/uneven.py): a draw of the padded batch's shape
    split over the batch would hand a device rows of the padded draw, not its own."""
    def fn(w, x):
        return jnp.tanh(x @ w) * jax.random.bernoulli(KEY, 0.5, (x.shape[0], 32))

    x = X[:6]
    with ap.auto_parallel_context(device_num=4, parallel_mode="auto_parallel"):
        with pytest.raises(ap.AutoParallelError, match="random_bits_0.*padded batch"):
            ap.parallelize(fn, W, x, uneven_batch="all_gather_v", cluster=COMPUTE_BOUND,
                           fixed={_matmul(fn, (W, x)): ((4, 1), (1, 1))})
        f = ap.parallelize(fn, W, x, cluster=COMPUTE_BOUND)  # (a divisor of the batch: exact)
    _same_bits(f(W, x) != 0, jax.jit(fn)(W, x) != 0)


def test_generators_without_keys_are_refused_with_a_way_forward():
    with pytest.raises(ap.UnsupportedOperatorError, match="rng_bit_generator.*jax.random"):
        ap.trace(lambda k: lax.rng_bit_generator(k, (8,))[1], jnp.zeros(4, jnp.uint32))
    with pytest.raises(ap.UnsupportedOperatorError, match="random_gamma"):
        ap.trace(lambda k: jax.random.gamma(k, 2.0, (8,)), KEY)
