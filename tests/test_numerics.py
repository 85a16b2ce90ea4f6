"""The float64 judge of tests/numerics.py: accepts float32 rounding, rejects real errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numerics


def _loss(params, x, labels, key):
    """A tiny loss with a long float32 reduction, an int input and a PRNG-key input."""
    h = jnp.tanh(x @ params["w"] + params["b"])
    # drawn in float32 whatever h's dtype: float64 draws are other numbers, not better ones
    noise = jax.random.normal(key, h.shape, jnp.float32).astype(h.dtype) * 1e-3
    logits = (h + noise) @ params["v"]
    pick = jnp.take_along_axis(logits, labels[:, None], axis=1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=1) - pick[:, 0]) + jnp.sum(h) / 1e3


def _case():
    rng = np.random.default_rng(3)  # host arrays: eager jax.random would compile per op
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    params = {"w": f32(512, 32) / 8, "b": np.full((32,), 0.1, np.float32), "v": f32(32, 10)}
    labels = rng.integers(0, 10, (64,)).astype(np.int32)
    return params, f32(64, 512), labels, jax.random.key(5)


def test_accepts_single_device_rejects_perturbed_and_dropped_terms():
    args = _case()
    ref = numerics.reference(jax.value_and_grad(_loss), *args)
    # the float64 run really is float64, and the integer / key inputs went through unchanged
    assert jax.tree.leaves(ref.f64)[0].dtype == np.float64
    assert not jax.config.jax_enable_x64
    assert ref.f64[0] != ref.f32[0]
    single = ref.f32                                   # jax.jit(value_and_grad(_loss))(*args)
    numerics.check(single, ref)                        # the single-device result itself
    numerics.check(jax.tree.map(lambda a: a * np.float32(1 + 1e-6), single), ref)  # + 8 ulps
    with pytest.raises(AssertionError, match=r"\[1\]\['w'\].*bound") as e:
        bad = (single[0], {**single[1], "w": single[1]["w"] * np.float32(1 + 1e-3)})
        numerics.check(bad, ref)
    assert "['v']" not in str(e.value)                 # only the wrong leaf is named
    # a dropped term: the loss without its last summand (a missing all-reduce piece)
    params, x = jax.tree.map(np.asarray, args[:2])
    term = np.sum(np.tanh(x @ params["w"] + params["b"])) / 1e3
    assert abs(term) > 1e-3
    with pytest.raises(AssertionError, match=r"\[0\]"):
        numerics.check((single[0] - np.float32(term), single[1]), ref)
    with pytest.raises(AssertionError, match="structures differ"):
        numerics.check(single[1], ref)
    with pytest.raises(AssertionError):
        numerics.check(jax.tree.map(lambda a: a * np.nan, single), ref)


def test_floor_covers_an_exact_single_device_result():
    """A single-device result equal to the float64 one still leaves C ulps of room."""
    x = np.linspace(-1.0, 1.0, 9, dtype=np.float32)
    ref = numerics.Reference(f64=x.astype(np.float64), f32=x)
    numerics.check(x * np.float32(1 + 8 * numerics.EPS32), ref)
    with pytest.raises(AssertionError):
        numerics.check(x * np.float32(1 + 1e-4), ref)


def test_optimizer_steps_run_in_float64():
    import optax

    params, x, labels, key = _case()
    steps = numerics.optimizer_steps(_loss, optax.adam(1e-2), steps=2)
    ref = numerics.reference(steps, params, x, labels, key, jit=False)
    new, losses = ref.f64
    assert new["w"].dtype == np.float64 and len(losses) == 2
    assert losses[1] < losses[0]
    numerics.check(ref.f32, ref)
