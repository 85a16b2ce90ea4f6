"""Multi-layer perceptron: ``len(widths) - 1`` dense layers with an activation between them.

The ANCHORS "Wide MLP" is ``mlp(widths=(4096, 16384, 4096), batch=32, bias=False)``:
x [32, 4096], w1 [4096, 16384], w2 [16384, 4096], loss ``mean(square(gelu(x @ w1) @ w2))``.

>>> import jax
>>> m = mlp(widths=(8, 32, 4), batch=2, loss="mse")
>>> params, x, y = m.example_args(jax.random.key(0))
>>> {k: v["w"].shape for k, v in params.items()}
{'layer0': (8, 32), 'layer1': (32, 4)}
>>> m.loss(params, x, y).shape
()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from autopar.models.base import (
    Init,
    Model,
    Params,
    check_bool,
    check_choice,
    check_dtype,
    check_int,
    check_widths,
    gelu,
    init_params,
    param_shapes,
    key_names,
    normal,
)

__all__ = ["mlp", "ACTIVATIONS", "LOSSES"]


def _relu(x: jax.Array) -> jax.Array:
    return jnp.maximum(x, 0)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": gelu,
    "relu": _relu,
    "tanh": jnp.tanh,
    "identity": lambda x: x,
}
"""Activation name -> function (plain primitives only)."""

LOSSES: tuple[str, ...] = ("mean_square", "mse")
"""``mean_square``: ``mean(square(out))``, batch ``(x,)``.
``mse``: ``mean(square(out - y))``, batch ``(x, y)``."""


def mlp(widths: Sequence[int] = (64, 256, 64), batch: int = 32, activation: str = "gelu",
        bias: bool = True, loss: str = "mean_square", dtype: Any = jnp.float32) -> Model:
    """Build an MLP with layers ``widths[i] -> widths[i+1]``.

    Args:
        widths: feature sizes, at least two; ``len(widths) - 1`` dense layers.
        batch: rows of the example input ``x [batch, widths[0]]``.
        activation: one of ``gelu`` (tanh approximation), ``relu``, ``tanh``, ``identity``;
            applied between layers, not after the last.
        bias: whether each layer has a bias ``b [widths[i+1]]`` (zeros at init).
        loss: ``mean_square`` (``mean(square(out))``) or ``mse`` (``mean(square(out - y))``
            with a target ``y [batch, widths[-1]]`` in the batch).
        dtype: floating dtype of params and inputs.

    Params are ``{"layer0": {"w": [widths[0], widths[1]], "b": [widths[1]]}, ...}`` (paths
    ``layer0/w``, ``layer0/b``; zero-padded names past 10 layers so sorted order is layer
    order). Weights are Normal(0, 1/sqrt(fan_in)).

    Raises:
        AutoParallelTypeError / AutoParallelError: naming the bad argument, value and rule.

    >>> import jax
    >>> m = mlp(widths=(4, 8), batch=3, bias=False)
    >>> jax.tree_util.tree_map(lambda a: a.shape, m.init(jax.random.key(0)))
    {'layer0': {'w': (4, 8)}}
    """
    widths_t = check_widths("widths", widths)
    batch = check_int("batch", batch)
    activation = check_choice("activation", activation, tuple(ACTIVATIONS))
    bias = check_bool("bias", bias)
    loss_name = check_choice("loss", loss, LOSSES)
    dtype_name = check_dtype("dtype", dtype)

    act = ACTIVATIONS[activation]
    names = key_names("layer", len(widths_t) - 1)
    config: dict[str, Any] = {"widths": list(widths_t), "batch": batch, "activation": activation,
                              "bias": bias, "loss": loss_name, "dtype": dtype_name}

    spec: dict[str, Any] = {}
    for i, name in enumerate(names):
        fan_in, fan_out = widths_t[i], widths_t[i + 1]
        spec[name] = {"w": Init.normal((fan_in, fan_out), 1.0 / math.sqrt(fan_in))}
        if bias:
            spec[name]["b"] = Init.zeros((fan_out,))

    def init(key: jax.Array) -> Params:
        return init_params(key, spec, dtype_name)

    def apply(params: Params, x: jax.Array) -> jax.Array:
        h = x
        for i, name in enumerate(names):
            with jax.named_scope(name):
                h = h @ params[name]["w"]
                if bias:
                    h = h + params[name]["b"]
                if i < len(names) - 1:
                    h = act(h)
        return h

    if loss_name == "mean_square":
        def loss_fn(params: Params, x: jax.Array) -> jax.Array:
            out = apply(params, x)
            with jax.named_scope("loss"):
                return jnp.mean(jnp.square(out))

        def example_batch(key: jax.Array) -> tuple[jax.Array, ...]:
            return (normal(key, (batch, widths_t[0]), 1.0, dtype_name),)
    else:
        def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:  # type: ignore[misc]
            out = apply(params, x)
            with jax.named_scope("loss"):
                return jnp.mean(jnp.square(out - y))

        def example_batch(key: jax.Array) -> tuple[jax.Array, ...]:
            kx, ky = jax.random.split(key)
            return (normal(kx, (batch, widths_t[0]), 1.0, dtype_name),
                    normal(ky, (batch, widths_t[-1]), 1.0, dtype_name))

    return Model(name="mlp", init=init, apply=apply, loss=loss_fn,
                 example_batch=example_batch, config=config,
                 param_shapes=lambda: param_shapes(spec, dtype_name))
