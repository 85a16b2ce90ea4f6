"""The :class:`Model` record every zoo builder returns, argument validators and shared layers.

A zoo model is five pure functions plus its configuration. The functions use only
``jax.numpy`` and ``jax.lax`` primitives written out by hand (no ``jax.nn`` helpers, which
hide ``custom_jvp`` or nested ``jit`` calls), so tracing a model gives a flat graph of plain
primitives for autopar's front end.

>>> import jax
>>> from autopar.models import mlp
>>> model = mlp(widths=(8, 16, 4), batch=2)
>>> params, x = model.example_args(jax.random.key(0))
>>> model.apply(params, x).shape
(2, 4)
>>> float(model.loss(params, x)) >= 0.0
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autopar.errors import AutoParallelError, AutoParallelTypeError

__all__ = [
    "Model",
    "Params",
    "PyTree",
    "check_int",
    "check_bool",
    "check_choice",
    "check_dtype",
    "check_widths",
    "key_names",
    "Init",
    "init_params",
    "param_shapes",
    "normal",
    "gelu",
    "softmax",
    "log_softmax",
    "layer_norm",
    "cross_entropy",
]

PyTree = Any
"""A JAX pytree (nested dicts / tuples / lists of arrays)."""

Params = dict[str, Any]
"""A nested dict of arrays with string keys, e.g. ``{"layer0": {"w": ..., "b": ...}}``."""

LN_EPS = 1e-5
"""Epsilon added to the variance in layer norm and batch norm."""

_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True, slots=True, eq=False)
class Model:
    """A zoo model: pure init / apply / loss / example-batch functions and its config.

    Attributes:
        name: registry name (``"mlp"``, ``"transformer"``, ...); ``get_model(m.name, **m.config)``
            rebuilds an equivalent model.
        init: PRNG key -> params, a nested dict of arrays with stable string keys.
        apply: ``apply(params, *inputs)`` -> the network output.
        loss: ``loss(params, *batch)`` -> scalar; differentiable in ``params`` with ``jax.grad``.
        example_batch: PRNG key -> tuple of batch arrays of the configured sizes.
        config: the builder's arguments, JSON-serialisable (dtype as its name, tuples as lists).
        param_shapes: ``() ->`` the params as ``jax.ShapeDtypeStruct`` s, read off the
            builder's initialiser spec (:func:`param_shapes`), or None (then
            :meth:`example_shapes` traces ``init``).

    Equality and hashing are by identity (the fields hold closures and a dict).

    >>> import jax
    >>> from autopar.models import tfm_stack
    >>> m = tfm_stack(blocks=1, batch=1, seq=4, hidden=8, heads=2)
    >>> params, x = m.example_args(jax.random.key(0))
    >>> x.shape, m.loss(params, x).shape
    ((4, 8), ())
    """

    name: str
    init: Callable[[jax.Array], Params]
    apply: Callable[..., jax.Array]
    loss: Callable[..., jax.Array]
    example_batch: Callable[[jax.Array], tuple[jax.Array, ...]]
    config: dict[str, Any]
    param_shapes: Callable[[], Params] | None = None

    def example_args(self, key: jax.Array) -> tuple[Any, ...]:
        """Return ``(params, *batch)`` from one PRNG key (split once: params, batch).

        >>> import jax
        >>> from autopar.models import mlp
        >>> params, x = mlp(widths=(4, 4), batch=3).example_args(jax.random.key(1))
        >>> x.shape
        (3, 4)
        """
        k_params, k_batch = jax.random.split(key)
        return (self.init(k_params), *self.example_batch(k_batch))

    def example_shapes(self) -> tuple[Any, ...]:
        """``(params, *batch)`` as ``jax.ShapeDtypeStruct`` s: what
        ``jax.eval_shape(self.example_args, key)`` gives, but with nothing run, compiled or
        traced beyond ``example_batch`` (no PRNG key is made on a device, so the backend is not
        started): enough to trace the model for a search.

        >>> from autopar.models import mlp
        >>> params, x = mlp(widths=(4, 2), batch=3).example_shapes()
        >>> params["layer0"]["w"].shape, x.shape
        ((4, 2), (3, 4))
        """
        batch = jax.eval_shape(lambda: self.example_batch(jax.random.key(0)))
        params = (self.param_shapes() if self.param_shapes is not None
                  else jax.eval_shape(lambda: self.init(jax.random.key(0))))
        return (params, *batch)


# ----------------------------------------------------------------------------- validation


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """Return ``value`` if it is an int (not a bool) ``>= minimum``, else raise.

    >>> check_int("batch", 4)
    4
    >>> check_int("batch", 0)
    Traceback (most recent call last):
    ...
    autopar.errors.AutoParallelError: batch=0 is invalid: must be an int >= 1.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise AutoParallelTypeError(name, value, f"must be an int >= {minimum}")
    if value < minimum:
        raise AutoParallelError(name, value, f"must be an int >= {minimum}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool, else raise :class:`AutoParallelTypeError`."""
    if not isinstance(value, (bool, np.bool_)):
        raise AutoParallelTypeError(name, value, "must be a bool")
    return bool(value)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """Return ``value`` if it is one of the string ``choices``, else raise.

    >>> check_choice("loss", "mse", ("mse", "mean_square"))
    'mse'
    """
    if not isinstance(value, str):
        raise AutoParallelTypeError(name, value, f"must be a str, one of {list(choices)}")
    if value not in choices:
        raise AutoParallelError(name, value, f"must be one of {list(choices)}")
    return value


def check_dtype(name: str, value: Any) -> str:
    """Return the canonical name of a floating dtype (``jnp.float32``, ``"bfloat16"``, ...).

    ``float64`` is accepted only when ``jax_enable_x64`` is on (JAX would otherwise silently
    compute in float32).

    >>> import jax.numpy as jnp
    >>> check_dtype("dtype", jnp.bfloat16)
    'bfloat16'
    """
    rule = f"must be a floating dtype, one of {list(_DTYPES)}"
    if value is None or isinstance(value, bool):
        raise AutoParallelTypeError(name, value, rule)
    try:
        dt = jnp.dtype(value)
    except TypeError:
        raise AutoParallelTypeError(name, value, rule) from None
    if dt.name not in _DTYPES:
        raise AutoParallelError(name, value, rule)
    if dt.name == "float64" and not jax.config.jax_enable_x64:
        raise AutoParallelError(name, value, "float64 needs 64-bit mode",
                                "call jax.config.update('jax_enable_x64', True) first "
                                "or use float32")
    return dt.name


def check_widths(name: str, value: Any, min_len: int = 2) -> tuple[int, ...]:
    """Return ``value`` as a tuple of positive ints of length ``>= min_len``.

    >>> check_widths("widths", [4, 8])
    (4, 8)
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise AutoParallelTypeError(name, value, f"must be a sequence of at least {min_len} ints")
    if len(value) < min_len:
        raise AutoParallelError(name, value, f"must hold at least {min_len} ints")
    return tuple(check_int(f"{name}[{i}]", v) for i, v in enumerate(value))


def key_names(prefix: str, n: int) -> list[str]:
    """Names ``prefix0 .. prefix{n-1}``, zero-padded so sorted order equals numeric order.

    ``jax.tree_util`` flattens dicts in sorted key order; padding keeps ``block10`` after
    ``block9`` (as ``block09``/``block10``). With ``n <= 10`` there is no padding.

    >>> key_names("layer", 3)
    ['layer0', 'layer1', 'layer2']
    >>> key_names("block", 12)[:2]
    ['block00', 'block01']
    """
    width = len(str(max(n - 1, 0)))
    return [f"{prefix}{i:0{width}d}" for i in range(n)]


# ----------------------------------------------------------------------------- init


@dataclass(frozen=True, slots=True)
class Init:
    """How to initialise one parameter: ``normal`` (mean 0, ``std``), ``ones`` or ``zeros``.

    >>> Init.normal((2, 3), 0.5)
    Init(kind='normal', shape=(2, 3), std=0.5)
    """

    kind: str
    shape: tuple[int, ...]
    std: float = 1.0

    @classmethod
    def normal(cls, shape: tuple[int, ...], std: float) -> Init:
        return cls("normal", tuple(shape), float(std))

    @classmethod
    def ones(cls, shape: tuple[int, ...]) -> Init:
        return cls("ones", tuple(shape))

    @classmethod
    def zeros(cls, shape: tuple[int, ...]) -> Init:
        return cls("zeros", tuple(shape))


def init_params(key: jax.Array, spec: dict[str, Any], dtype: str) -> Params:
    """Materialise a nested dict of :class:`Init` leaves into arrays, keeping insertion order.

    All ``normal`` leaves are cut, in insertion order, from ONE float32 normal draw of their
    total size. With a concrete key the cutting, scaling and casting happen in NumPy and each
    piece is put on the default device, so no per-shape XLA program is compiled (a
    ``jax.random.normal`` per shape costs a compile each, about 0.5 s on a small CPU, which
    made ResNet-50's init take 20 s). Under tracing (``jax.eval_shape``, ``jax.jit``) the same
    arithmetic runs in ``jax.numpy`` and gives bit-identical values. The peak host memory is
    about twice the params' size (for a full-size 48-block ``tfm_stack``, 2 x 2.4 GB: use
    ``jax.eval_shape(model.init, key)`` when only shapes are needed). The result is a plain
    dict built in the spec's order (note a ``jit`` output dict comes back key-sorted).

    >>> import jax
    >>> p = init_params(jax.random.key(0), {"b": Init.zeros((2,)), "a": Init.normal((2,), 1.0)},
    ...                 "float32")
    >>> list(p), p["b"].tolist()
    (['b', 'a'], [0.0, 0.0])
    """
    leaves: list[Init] = []

    def collect(node: dict[str, Any]) -> None:
        for value in node.values():
            if isinstance(value, Init):
                leaves.append(value)
            else:
                collect(value)

    collect(spec)
    dt = jnp.dtype(dtype)
    total = sum(math.prod(leaf.shape) for leaf in leaves if leaf.kind == "normal")
    flat = jax.random.normal(key, (max(total, 1),), jnp.float32)
    concrete = not isinstance(flat, jax.core.Tracer)
    xp: Any = np if concrete else jnp
    source: Any = flat
    if concrete:
        source = np.array(flat)  # writable host copy; scaled in place below
        del flat
    arrays: list[Any] = []
    offset = 0
    for leaf in leaves:
        if leaf.kind == "normal":
            n = math.prod(leaf.shape)
            piece = xp.reshape(source[offset:offset + n], leaf.shape)
            if concrete:
                piece *= np.float32(leaf.std)
                arrays.append(piece.astype(dt, copy=False))
            else:
                arrays.append((piece * np.float32(leaf.std)).astype(dt))
            offset += n
        elif leaf.kind == "ones":
            arrays.append(xp.ones(leaf.shape, dt))
        else:
            arrays.append(xp.zeros(leaf.shape, dt))
    it = iter([jnp.asarray(a) for a in arrays] if concrete else arrays)

    def build(node: dict[str, Any]) -> Params:
        return {k: next(it) if isinstance(v, Init) else build(v) for k, v in node.items()}

    return build(spec)


def param_shapes(spec: dict[str, Any], dtype: str) -> Params:
    """The params :func:`init_params` would make from ``spec``, as ``jax.ShapeDtypeStruct`` s
    (keys sorted, as ``jax.eval_shape`` returns a dict), without drawing them.

    >>> p = param_shapes({"b": Init.zeros((2,)), "a": Init.normal((3, 2), 1.0)}, "float32")
    >>> list(p), p["a"]
    (['a', 'b'], ShapeDtypeStruct(shape=(3, 2), dtype=float32))
    """
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, dt), spec)


def normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype: str) -> jax.Array:
    """Normal(0, std) samples of ``shape`` in ``dtype`` (sampled in float32, then cast)."""
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


# ----------------------------------------------------------------------------- layers


def gelu(x: jax.Array) -> jax.Array:
    """GELU, tanh approximation (``jax.nn.gelu``'s default), written with plain primitives.

    >>> float(gelu(jnp.float32(0.0)))
    0.0
    """
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + jnp.tanh(c * (x + 0.044715 * (x * x * x))))


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """Numerically stable softmax over ``axis`` (max subtracted, no ``custom_jvp``).

    >>> softmax(jnp.zeros(4)).tolist()
    [0.25, 0.25, 0.25, 0.25]
    """
    m = lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    e = jnp.exp(x - m)
    return e / jnp.sum(e, axis=axis, keepdims=True)


def log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """Numerically stable log-softmax over ``axis``."""
    m = lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    s = x - m
    return s - jnp.log(jnp.sum(jnp.exp(s), axis=axis, keepdims=True))


def layer_norm(x: jax.Array, gamma: jax.Array, beta: jax.Array) -> jax.Array:
    """Layer norm over the last axis: ``(x - mean) / sqrt(var + 1e-5) * gamma + beta``."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    return centred * lax.rsqrt(var + LN_EPS) * gamma + beta


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of ``logits [..., C]`` against int ``labels [...]``.

    The label pick is a one-hot product (compare with an iota), not a gather.

    >>> float(cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 3])))  # log(4)
    1.3862943649291992
    """
    classes = logits.shape[-1]
    logp = log_softmax(logits.astype(jnp.float32), axis=-1)
    one_hot = (labels[..., None] == lax.iota(labels.dtype, classes)).astype(logp.dtype)
    return -jnp.mean(jnp.sum(one_hot * logp, axis=-1))
