"""Transformers: a GPT-style decoder (:func:`transformer`) and the ANCHORS "tfmN" stack.

:func:`tfm_stack` is exactly the transformer-like stack MindSpore's search-time figures in
ANCHORS.md were measured on; :func:`transformer` is a small but complete language model
(embedding gather, causal attention, pre-LN blocks, LM head, cross-entropy).

>>> import jax
>>> m = transformer(layers=1, hidden=16, heads=2, seq=8, vocab=32, batch=2)
>>> params, tokens, targets = m.example_args(jax.random.key(0))
>>> m.apply(params, tokens).shape
(2, 8, 32)
>>> float(m.loss(params, tokens, targets)) > 0.0
True
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from autopar.errors import AutoParallelError
from autopar.models.base import (
    Init,
    Model,
    Params,
    check_bool,
    check_dtype,
    check_int,
    cross_entropy,
    gelu,
    init_params,
    param_shapes,
    key_names,
    layer_norm,
    normal,
    softmax,
)

__all__ = ["transformer", "tfm_stack"]


def _check_heads(hidden: int, heads: int) -> None:
    if hidden % heads != 0:
        raise AutoParallelError("hidden", hidden, f"must be divisible by heads={heads}",
                                "choose hidden as a multiple of heads")


def _split_heads(qkv: jax.Array, batch: int, seq: int, heads: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[B*S or B, S, 3H] -> reshape [B, S, 3*heads, d] -> transpose (0, 2, 1, 3) -> q, k, v.

    Each of q, k, v is [B, heads, S, d]; q takes the first H columns of the projection.
    """
    d = qkv.shape[-1] // (3 * heads)
    x = jnp.reshape(qkv, (batch, seq, 3 * heads, d))
    x = jnp.transpose(x, (0, 2, 1, 3))
    q, k, v = jnp.split(x, 3, axis=1)
    return q, k, v


def _merge_heads(c: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """[B, heads, S, d] -> transpose (0, 2, 1, 3) -> reshape to ``shape``."""
    return jnp.reshape(jnp.transpose(c, (0, 2, 1, 3)), shape)


def _causal_bias(seq: int, dtype: Any) -> jax.Array:
    """Additive causal mask ``[seq, seq]``: 0 where key <= query, the dtype's minimum above.

    Built from iotas (no ``where``), so it traces to plain elementwise primitives.

    >>> _causal_bias(2, jnp.float32)[0, 1] < -1e30
    Array(True, dtype=bool)
    """
    row = lax.broadcasted_iota(jnp.int32, (seq, seq), 0)
    col = lax.broadcasted_iota(jnp.int32, (seq, seq), 1)
    masked = (col > row).astype(dtype)
    return masked * jnp.finfo(dtype).min


# ----------------------------------------------------------------------------- tfmN stack


def _tfm_block(p: Params, x: jax.Array, batch: int, heads: int) -> jax.Array:
    """One block of :func:`tfm_stack` on ``x [B*S, H]``."""
    b, s, h_ = batch, x.shape[0] // batch, x.shape[1]
    with jax.named_scope("attn"):
        q, k, v = _split_heads(x @ p["attn"]["wqkv"], b, s, heads)
        c = softmax(q @ jnp.swapaxes(k, -1, -2)) @ v
        c = _merge_heads(c, (b * s, h_))
        h = x + c @ p["attn"]["wo"]
    with jax.named_scope("ln"):
        h = layer_norm(h, p["ln"]["gamma"], p["ln"]["beta"])
    with jax.named_scope("mlp"):
        return h + gelu(h @ p["mlp"]["w1"]) @ p["mlp"]["w2"]


def tfm_stack(blocks: int = 4, batch: int = 8, seq: int = 512, hidden: int = 1024,
              heads: int = 16, dtype: Any = jnp.float32) -> Model:
    """The ANCHORS.md "tfmN" transformer-like stack (MindSpore search-time benchmark).

    Data input ``x [B*S, H]``; per block, with ``d = H / heads``::

        qkv = x @ wqkv                        # wqkv [H, 3H]
        qkv -> reshape [B, S, 3*heads, d] -> transpose (0, 2, 1, 3) -> split q, k, v
        c = softmax(q @ k^T) @ v              # no scaling, no mask, no biases
        c -> transpose (0, 2, 1, 3) -> reshape [B*S, H]
        h = layer_norm(x + c @ wo)            # wo [H, H]; gamma, beta [H]
        x = h + gelu(h @ w1) @ w2             # w1 [H, 4H], w2 [4H, H]

    Loss ``mean(square(x_N))``. GELU is the tanh approximation; layer-norm epsilon 1e-5.
    Params per block (pytree paths): ``block0/attn/wqkv``, ``block0/attn/wo``,
    ``block0/ln/gamma``, ``block0/ln/beta``, ``block0/mlp/w1``, ``block0/mlp/w2`` (block
    names zero-padded past 10 blocks). Weights Normal(0, 1/sqrt(fan_in)), gamma 1, beta 0.

    Raises:
        AutoParallelTypeError / AutoParallelError: naming the bad argument, value and rule
        (sizes must be positive ints, ``hidden`` divisible by ``heads``).

    >>> import jax
    >>> m = tfm_stack(blocks=2, batch=2, seq=4, hidden=8, heads=2)
    >>> sorted(m.init(jax.random.key(0))["block1"]["mlp"])
    ['w1', 'w2']
    >>> m.example_batch(jax.random.key(1))[0].shape
    (8, 8)
    """
    blocks = check_int("blocks", blocks)
    batch = check_int("batch", batch)
    seq = check_int("seq", seq)
    hidden = check_int("hidden", hidden)
    heads = check_int("heads", heads)
    _check_heads(hidden, heads)
    dtype_name = check_dtype("dtype", dtype)

    h_ = hidden
    names = key_names("block", blocks)
    config: dict[str, Any] = {"blocks": blocks, "batch": batch, "seq": seq, "hidden": hidden,
                              "heads": heads, "dtype": dtype_name}

    spec = {name: {"attn": {"wqkv": Init.normal((h_, 3 * h_), 1.0 / math.sqrt(h_)),
                            "wo": Init.normal((h_, h_), 1.0 / math.sqrt(h_))},
                   "ln": {"gamma": Init.ones((h_,)), "beta": Init.zeros((h_,))},
                   "mlp": {"w1": Init.normal((h_, 4 * h_), 1.0 / math.sqrt(h_)),
                           "w2": Init.normal((4 * h_, h_), 1.0 / math.sqrt(4 * h_))}}
            for name in names}

    def init(key: jax.Array) -> Params:
        return init_params(key, spec, dtype_name)

    # one block function, jitted with inline=True: JAX traces it once and inlines the same
    # jaxpr for every block (a 48-block stack traces in about a third of the time), so the
    # model still traces to a flat jaxpr with the same equations and name scopes
    block = jax.jit(functools.partial(_tfm_block, batch=batch, heads=heads), inline=True)

    def apply(params: Params, x: jax.Array) -> jax.Array:
        for name in names:
            with jax.named_scope(name):
                x = block(params[name], x)
        return x

    def loss(params: Params, x: jax.Array) -> jax.Array:
        out = apply(params, x)
        with jax.named_scope("loss"):
            return jnp.mean(jnp.square(out))

    def example_batch(key: jax.Array) -> tuple[jax.Array, ...]:
        return (normal(key, (batch * seq, h_), 1.0, dtype_name),)

    return Model(name="tfm_stack", init=init, apply=apply, loss=loss,
                 example_batch=example_batch, config=config,
                 param_shapes=lambda: param_shapes(spec, dtype_name))


# ----------------------------------------------------------------------------- GPT decoder


def _gpt_spec(names: list[str], h_: int, f_: int, seq: int, vocab: int) -> dict[str, Any]:
    """The GPT's parameter initialisers, in forward order."""

    def ln_spec() -> dict[str, Init]:
        return {"gamma": Init.ones((h_,)), "beta": Init.zeros((h_,))}

    spec: dict[str, Any] = {"embed": {"tokens": Init.normal((vocab, h_), 0.02),
                                      "pos": Init.normal((seq, h_), 0.02)}}
    for name in names:
        spec[name] = {"ln1": ln_spec(),
                      "attn": {"wqkv": Init.normal((h_, 3 * h_), 1.0 / math.sqrt(h_)),
                               "wo": Init.normal((h_, h_), 1.0 / math.sqrt(h_))},
                      "ln2": ln_spec(),
                      "mlp": {"w1": Init.normal((h_, f_), 1.0 / math.sqrt(h_)),
                              "w2": Init.normal((f_, h_), 1.0 / math.sqrt(f_))}}
    spec["ln_f"] = ln_spec()
    spec["head"] = {"w": Init.normal((h_, vocab), 1.0 / math.sqrt(h_))}
    return spec


def _gpt_block(p: Params, x: jax.Array, heads: int) -> jax.Array:
    """One pre-LN block: causal self-attention, then the MLP, each with its residual."""
    b, s, h_ = x.shape
    with jax.named_scope("ln1"):
        a = layer_norm(x, p["ln1"]["gamma"], p["ln1"]["beta"])
    with jax.named_scope("attn"):
        q, k, v = _split_heads(a @ p["attn"]["wqkv"], b, s, heads)
        scores = (q @ jnp.swapaxes(k, -1, -2)) * (1.0 / math.sqrt(h_ // heads))
        c = softmax(scores + _causal_bias(s, scores.dtype)) @ v
        x = x + _merge_heads(c, (b, s, h_)) @ p["attn"]["wo"]
    with jax.named_scope("ln2"):
        m = layer_norm(x, p["ln2"]["gamma"], p["ln2"]["beta"])
    with jax.named_scope("mlp"):
        return x + gelu(m @ p["mlp"]["w1"]) @ p["mlp"]["w2"]


def transformer(layers: int = 2, hidden: int = 64, heads: int = 4, seq: int = 16,
                vocab: int = 128, batch: int = 4, mlp_ratio: int = 4,
                dtype: Any = jnp.float32, scan: bool = False) -> Model:
    """A GPT-style decoder-only language model.

    ``tokens [B, S] int32`` -> token embedding (a gather) + learned positional embedding ->
    ``layers`` pre-LN blocks::

        x = x + wo(causal_attention(ln1(x) @ wqkv))   # softmax(q k^T / sqrt(d) + mask)
        x = x + gelu(ln2(x) @ w1) @ w2                # w1 [H, mlp_ratio*H]

    -> final layer norm -> LM head ``head/w [H, vocab]`` (not tied) -> logits ``[B, S, vocab]``.
    Loss: mean softmax cross-entropy over all tokens against ``targets [B, S] int32``;
    ``example_batch`` draws ``seq + 1`` ids per row, tokens = ids[:, :-1], targets = ids[:, 1:].
    No biases. ``apply`` also accepts shorter sequences (``<= seq``).

    Params (pytree paths, insertion order = forward order): ``embed/tokens [vocab, H]``,
    ``embed/pos [seq, H]``, ``block0/ln1/{gamma,beta}``, ``block0/attn/{wqkv,wo}``,
    ``block0/ln2/{gamma,beta}``, ``block0/mlp/{w1,w2}``, ..., ``ln_f/{gamma,beta}``,
    ``head/w``. Embeddings Normal(0, 0.02), weights Normal(0, 1/sqrt(fan_in)).
    ``scan=True``: the blocks' parameters stacked along a leading dim of ``layers``
    (``blocks/ln1/gamma [layers, H]``, ...) and run by one ``lax.scan`` (as flax's
    ``nn.scan`` and MaxText do): traced as one loop node whose body is one block.

    Raises:
        AutoParallelTypeError / AutoParallelError: naming the bad argument, value and rule.

    >>> import jax
    >>> m = transformer(layers=2, hidden=8, heads=2, seq=4, vocab=16, batch=1)
    >>> list(m.init(jax.random.key(0)))
    ['embed', 'block0', 'block1', 'ln_f', 'head']
    """
    layers = check_int("layers", layers)
    hidden = check_int("hidden", hidden)
    heads = check_int("heads", heads)
    seq = check_int("seq", seq)
    vocab = check_int("vocab", vocab)
    batch = check_int("batch", batch)
    mlp_ratio = check_int("mlp_ratio", mlp_ratio)
    _check_heads(hidden, heads)
    dtype_name = check_dtype("dtype", dtype)
    scan = check_bool("scan", scan)

    names = ["blocks"] if scan else key_names("block", layers)
    config: dict[str, Any] = {"layers": layers, "hidden": hidden, "heads": heads, "seq": seq,
                              "vocab": vocab, "batch": batch, "mlp_ratio": mlp_ratio,
                              "dtype": dtype_name, "scan": scan}
    spec = _gpt_spec(names, hidden, mlp_ratio * hidden, seq, vocab)
    if scan:  # one stacked parameter per block parameter
        spec["blocks"] = jax.tree.map(lambda i: Init(i.kind, (layers,) + i.shape, i.std),
                                      spec["blocks"])

    def init(key: jax.Array) -> Params:
        return init_params(key, spec, dtype_name)

    # traced once, inlined in every block (see tfm_stack)
    block = jax.jit(functools.partial(_gpt_block, heads=heads), inline=True)

    def apply(params: Params, tokens: jax.Array) -> jax.Array:
        s = tokens.shape[1]
        with jax.named_scope("embed"):
            x = params["embed"]["tokens"].at[tokens].get(mode="clip")  # a gather
            x = x + params["embed"]["pos"][:s]
        if scan:
            with jax.named_scope("blocks"):
                x = lax.scan(lambda h, p: (block(p, h), None), x, params["blocks"])[0]
        else:
            for name in names:
                with jax.named_scope(name):
                    x = block(params[name], x)
        with jax.named_scope("ln_f"):
            x = layer_norm(x, params["ln_f"]["gamma"], params["ln_f"]["beta"])
        with jax.named_scope("head"):
            return x @ params["head"]["w"]

    def loss(params: Params, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        logits = apply(params, tokens)
        with jax.named_scope("loss"):
            return cross_entropy(logits, targets)

    def example_batch(key: jax.Array) -> tuple[jax.Array, ...]:
        ids = jax.random.randint(key, (batch, seq + 1), 0, vocab, dtype=jnp.int32)
        return (ids[:, :-1], ids[:, 1:])

    return Model(name="transformer", init=init, apply=apply, loss=loss,
                 example_batch=example_batch, config=config,
                 param_shapes=lambda: param_shapes(spec, dtype_name))
