"""autopar.collectives: a strided all-gather / reduce-scatter in its transposed form gives
lax's values and gradients, and its program holds a collective along a leading axis."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from autopar.collectives import all_gather_dim, psum_scatter_dim, strided

AXES = ("x", "y")


@functools.cache
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])


def run(body, x):
    """``body`` on each device's block of ``x`` (split 8 ways along dim 0 over both axes),
    the blocks it returns stacked along dim 0."""
    f = jax.shard_map(body, mesh=mesh(), in_specs=P(AXES), out_specs=P(AXES), check_vma=False)
    return jax.jit(f)


def data(shape, seed=0):
    """Small integers as float32: every sum is exact, whatever the order of summation."""
    return jnp.asarray(np.random.default_rng(seed).integers(-8, 9, shape), jnp.float32)


CASES = [((8 * 3, 4, 5), 1, "y"), ((8 * 2, 3, 8), 2, AXES), ((8 * 2, 1, 4), 2, "x"),
         ((8, 6), 1, AXES), ((8 * 4, 4), 0, "y")]


@pytest.mark.parametrize("shape,dim,name", CASES)
def test_the_gather_and_the_scatter_equal_laxs_values_and_gradients(shape, dim, name):
    size = {"x": 2, "y": 4}.get(name, 8)
    x = data(shape)
    pairs = [(lambda b: all_gather_dim(b, name, dim),
              lambda b: lax.all_gather(b, name, axis=dim, tiled=True))]
    if shape[dim] % size == 0 and (dim or shape[0] // 8 % size == 0):
        pairs.append((lambda b: psum_scatter_dim(b, name, dim, size),
                      lambda b: lax.psum_scatter(b, name, scatter_dimension=dim, tiled=True)))
    for ours, theirs in pairs:
        np.testing.assert_array_equal(run(ours, x)(x), run(theirs, x)(x))
        w = data(jax.eval_shape(run(theirs, x), x).shape, seed=1)

        def grad(f):
            return jax.jit(jax.grad(lambda v: jnp.sum(run(f, v)(v) * w)))(x)

        np.testing.assert_array_equal(grad(ours), grad(theirs))


def collective_dims(text: str, op: str) -> list[str]:
    return re.findall(op + r"(?:-start)?\(.*?dimensions=\{(\d+)\}", text)


def test_a_strided_dim_is_gathered_and_scattered_along_a_leading_axis():
    """What runs: on the CPU backend the collectives of a strided dim act on dim 0 of their
    operand (the compiled text's ``dimensions={0}``); a leading dim keeps lax's own."""
    assert jax.default_backend() == "cpu" and strided((3, 8), 1) and not strided((1, 8), 1)
    assert not strided((8, 3), 0)
    x = data((8 * 3, 8))
    for body, op in ((lambda b: all_gather_dim(b, "y", 1), "all-gather"),
                     (lambda b: psum_scatter_dim(b, "y", 1, 4), "reduce-scatter")):
        text = run(body, x).lower(x).compile().as_text()
        assert collective_dims(text, op) == ["0"], text
    plain = run(lambda b: lax.all_gather(b, "y", axis=1, tiled=True), x)
    assert collective_dims(plain.lower(x).compile().as_text(), "all-gather") == ["1"]
