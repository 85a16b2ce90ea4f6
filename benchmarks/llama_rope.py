"""A Llama-2-style decoder with rotary embeddings, in plain JAX, traced shapes only (issue 38).

Per block, on ``x [B, S, H]`` with ``d = H / heads``::

    h = rms_norm(x) ; q, k, v = h @ wq, h @ wk, h @ wv -> [B, S, heads, d]
    q, k = rope(q), rope(k)      # halves x1, x2: concat(x1 cos - x2 sin, x2 cos + x1 sin)
    x = x + softmax(q k^T / sqrt(d) + causal) v @ wo
    x = x + (silu(rms_norm(x) @ w1) * (rms_norm(x) @ w3)) @ w2

then a final norm, the LM head and the cross-entropy. RoPE's slice -> mul / sub ->
concatenate diamond is what makes the search graph not series-parallel.

>>> import jax
>>> g = trace_llama(layers=1, hidden=16, heads=2, seq=8, ffn=32, vocab=32, batch=2)
>>> sum(n.op == "concatenate" for n in g.nodes)
2
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["llama_loss", "llama_shapes", "trace_llama", "LLAMA_7B", "LLAMA_70B"]

#: Llama-2 7B (hidden 4096, 32 heads, MLP 11008, vocab 32000), one sequence of 4096 (a
#: micro-batch: at 32 layers a batch of 8 needs 122 GiB per device on 64, over any budget).
LLAMA_7B = dict(hidden=4096, heads=32, seq=4096, ffn=11008, vocab=32000, batch=1)
#: Llama-2 70B (hidden 8192, 64 heads of which 8 key / value heads, MLP 28672), one sequence
LLAMA_70B = dict(hidden=8192, heads=64, kv_heads=8, seq=4096, ffn=28672, vocab=32000, batch=1)


def _rms(x: jax.Array, g: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, S, heads, d]; cos, sin [S, 1, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _block(p: dict, x: jax.Array, heads: int, cos: jax.Array, sin: jax.Array) -> jax.Array:
    b, s, h_ = x.shape
    d = h_ // heads
    kv = p["wk"].shape[1] // d  # grouped-query attention: kv heads, each shared by heads / kv
    with jax.named_scope("attn"):
        h = _rms(x, p["norm1"])
        q = (h @ p["wq"]).reshape(b, s, heads, d)
        k, v = ((h @ p[w]).reshape(b, s, kv, d) for w in ("wk", "wv"))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if kv != heads:
            k, v = (jnp.repeat(t, heads // kv, axis=2) for t in (k, v))
        a = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        a = a + jnp.where(jnp.tril(jnp.ones((s, s), bool)), 0.0, -1e9)
        a = jnp.exp(a - lax.stop_gradient(jnp.max(a, axis=-1, keepdims=True)))
        a = a / jnp.sum(a, axis=-1, keepdims=True)
        c = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, s, h_)
        x = x + c @ p["wo"]
    with jax.named_scope("mlp"):
        h = _rms(x, p["norm2"])
        return x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]


def llama_loss(params: dict, tokens: jax.Array, targets: jax.Array, heads: int) -> jax.Array:
    """Mean cross-entropy of the decoder on ``tokens [B, S]``."""
    s = tokens.shape[1]
    blocks = sorted(k for k in params if k.startswith("block"))
    d = params[blocks[0]]["wq"].shape[0] // heads
    inv = 1.0 / (10000.0 ** (jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d))
    ang = jnp.arange(s, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x = params["embed"][tokens]
    for name in blocks:
        with jax.named_scope(name):
            x = _block(params[name], x, heads, cos, sin)
    logits = _rms(x, params["norm"]) @ params["head"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def llama_shapes(layers: int, hidden: int, heads: int, seq: int, ffn: int, vocab: int,
                 batch: int, dtype: Any = jnp.float32, kv_heads: int | None = None
                 ) -> tuple[Any, ...]:
    """``(params, tokens, targets)`` as ``jax.ShapeDtypeStruct`` s (nothing allocated);
    ``kv_heads``: grouped-query attention's key / value heads (default ``heads``)."""
    def sds(*shape: int, dt: Any = dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dt)

    kv = hidden // heads * (kv_heads or heads)
    block = {"norm1": sds(hidden), "wq": sds(hidden, hidden), "wk": sds(hidden, kv),
             "wv": sds(hidden, kv), "wo": sds(hidden, hidden), "norm2": sds(hidden),
             "w1": sds(hidden, ffn), "w3": sds(hidden, ffn), "w2": sds(ffn, hidden)}
    width = max(2, len(str(layers - 1)))
    params: dict[str, Any] = {f"block{i:0{width}d}": dict(block) for i in range(layers)}
    params |= {"embed": sds(vocab, hidden), "norm": sds(hidden),
               "head": sds(hidden, vocab)}
    tokens = sds(batch, seq, dt=jnp.int32)
    return params, tokens, tokens


def trace_llama(layers: int, **sizes: Any) -> Any:
    """The decoder's graph (``autopar.trace`` on shapes only), Llama-2 7B's sizes in bfloat16
    by default."""
    import autopar as ap

    kw: dict[str, Any] = dict(LLAMA_7B, dtype=jnp.bfloat16) | sizes
    loss = functools.partial(llama_loss, heads=kw["heads"])
    return ap.trace(loss, *llama_shapes(layers, **kw))
