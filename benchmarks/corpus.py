"""A corpus of real models: small networks written the way each library's own docs write them.

Every entry of :data:`CORPUS` builds a :class:`CorpusModel`: a pure, deterministic loss
``loss(params, *batch)`` (no dropout, no RNG inside) over a pytree of JAX arrays, with the
example batch. The models are the libraries' own code — flax.linen, flax.nnx, equinox and
keras-hub layers called as their documentation calls them — so that autopar is tried on the
programs users actually write, not on hand-traced ones. Where autopar cannot trace or search a
model (an unsupported primitive), that is a finding to record, never a reason to rewrite the
library's layer by hand.

Sizes. The corpus must be cheap enough to build, differentiate, trace and search on 8 emulated
CPU devices in seconds per model, yet large enough that every dimension splits 8 ways and the
structure (attention heads, MLP expansion, tied output) is the real one: hidden 128, sequence
32, batch 16, 2 layers, 4 heads, vocabulary 512, MLP width 4x hidden; MLPs 256-1024-1024-256;
the CNN takes [16, 32, 32, 3] images (CIFAR-shaped) to 10 classes. Building is deterministic
(fixed seeds: ``jax.random.key(0)``, ``keras.utils.set_random_seed(0)``).

Importing this module imports no model library: each builder imports its own (the ``models``
extra of pyproject.toml pins the versions). ``python -m benchmarks.corpus`` builds every model,
runs ``jax.jit(jax.value_and_grad(loss))`` once, then tries ``autopar.trace`` and
``autopar.search`` (data parallel, 8 devices) and prints a table of what worked.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp

HIDDEN = 128
SEQ = 32
BATCH = 16
LAYERS = 2
HEADS = 4
VOCAB = 512
MLP_WIDTH = 4 * HIDDEN
MLP_SIZES = (256, 1024, 256)  # in, hidden (two layers of it), out: 3 Dense layers
IMAGES = (BATCH, 32, 32, 3)
CLASSES = 10
EXPERTS = 8


@dataclass(frozen=True)
class CorpusModel:
    """One model of the corpus: ``loss(params, *batch)`` is a scalar, pure and deterministic."""

    name: str
    library: str
    loss: Callable[..., jax.Array]
    params: Any
    batch: tuple[jax.Array, ...]
    note: str = ""


# ---- data -------------------------------------------------------------------------------------

def _token_batch() -> tuple[jax.Array, jax.Array]:
    """(tokens, next-token targets), int32 [BATCH, SEQ] each."""
    ids = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB, dtype=jnp.int32)
    return ids[:, :-1], ids[:, 1:]


def _regression_batch(shape: tuple[int, ...], out: int) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, shape), jax.random.normal(ky, shape[:-1] + (out,))


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ---- flax.linen -------------------------------------------------------------------------------

@cache
def _linen_modules() -> dict[str, type]:
    """The linen modules (defined here so that importing the corpus does not import flax)."""
    import flax.linen as nn

    class MLP(nn.Module):
        sizes: tuple[int, ...]

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(nn.Dense(self.sizes[1])(x))
            x = nn.relu(nn.Dense(self.sizes[1])(x))
            return nn.Dense(self.sizes[2])(x)

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for features in (32, 64):
                x = nn.Conv(features=features, kernel_size=(3, 3))(x)
                x = nn.BatchNorm(use_running_average=True)(x)
                x = nn.avg_pool(nn.relu(x), window_shape=(2, 2), strides=(2, 2))
            x = x.reshape((x.shape[0], -1))
            return nn.Dense(CLASSES)(nn.relu(nn.Dense(256)(x)))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, deterministic=True)(
                h, mask=mask)
            h = nn.Dense(HIDDEN)(nn.gelu(nn.Dense(MLP_WIDTH)(nn.LayerNorm()(x))))
            return x + h

    class ScanBlock(nn.Module):  # (carry, broadcast mask) -> (carry, no per-layer output)
        @nn.compact
        def __call__(self, x: jax.Array, mask: jax.Array) -> tuple[jax.Array, None]:
            return Block()(x, mask), None

    class Decoder(nn.Module):
        remat: bool = False
        scan: bool = False  # the blocks stacked by nn.scan (one lax.scan over the layers)

        @nn.compact
        def __call__(self, tokens: jax.Array) -> jax.Array:
            embed = nn.Embed(num_embeddings=VOCAB, features=HIDDEN)
            x = embed(tokens) + nn.Embed(SEQ, HIDDEN)(jnp.arange(tokens.shape[-1]))
            mask = nn.make_causal_mask(tokens)
            if self.scan:
                blocks = nn.scan(ScanBlock, variable_axes={"params": 0},
                                 split_rngs={"params": True}, in_axes=nn.broadcast,
                                 length=LAYERS)
                x, _ = blocks(name="blocks")(x, mask)
                return embed.attend(nn.LayerNorm()(x))
            block = nn.remat(Block) if self.remat else Block
            for i in range(LAYERS):
                x = block(name=f"block_{i}")(x, mask)
            return embed.attend(nn.LayerNorm()(x))

    return {"MLP": MLP, "CNN": CNN, "Decoder": Decoder}


def linen_mlp() -> CorpusModel:
    model = _linen_modules()["MLP"](MLP_SIZES)
    x, y = _regression_batch((BATCH, MLP_SIZES[0]), MLP_SIZES[2])
    params = model.init(jax.random.key(0), x)["params"]

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    return CorpusModel("linen_mlp", "flax.linen", loss, params, (x, y))


def linen_cnn() -> CorpusModel:
    model = _linen_modules()["CNN"]()
    images = jax.random.normal(jax.random.key(1), IMAGES)
    labels = jax.random.randint(jax.random.key(2), (BATCH,), 0, CLASSES, dtype=jnp.int32)
    variables = model.init(jax.random.key(0), images)
    batch_stats = variables["batch_stats"]  # frozen statistics: a constant, not trained

    def loss(params: Any, images: jax.Array, labels: jax.Array) -> jax.Array:
        logits = model.apply({"params": params, "batch_stats": batch_stats}, images)
        return _cross_entropy(logits, labels)

    return CorpusModel("linen_cnn", "flax.linen", loss, variables["params"], (images, labels),
                       "BatchNorm in inference mode (running statistics closed over)")


def _linen_decoder(name: str, remat: bool, scan: bool = False) -> CorpusModel:
    model = _linen_modules()["Decoder"](remat=remat, scan=scan)
    tokens, targets = _token_batch()
    params = model.init(jax.random.key(0), tokens)["params"]

    def loss(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        return _cross_entropy(model.apply({"params": params}, tokens), targets)

    note = "nn.remat on every block" if remat else \
        "nn.scan over the blocks (one loop node)" if scan else ""
    return CorpusModel(name, "flax.linen", loss, params, (tokens, targets), note)


def linen_decoder() -> CorpusModel:
    return _linen_decoder("linen_decoder", remat=False)


def linen_decoder_remat() -> CorpusModel:
    return _linen_decoder("linen_decoder_remat", remat=True)


def linen_decoder_scan() -> CorpusModel:
    return _linen_decoder("linen_decoder_scan", remat=False, scan=True)


# ---- mixture of experts (flax.linen) ----------------------------------------------------------

@cache
def _moe_module() -> type:
    import flax.linen as nn

    class MoEBlock(nn.Module):
        """LayerNorm + top-2 mixture-of-experts MLP with a residual; returns (y, aux loss)."""

        top_k: int = 2

        @nn.compact
        def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            h = nn.LayerNorm()(x)
            probs = jax.nn.softmax(nn.Dense(EXPERTS, use_bias=False, name="router")(h))
            gates, index = jax.lax.top_k(probs, self.top_k)  # [B, S, k]
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
            combine = jnp.einsum("bsk,bske->bse", gates, jax.nn.one_hot(index, EXPERTS))
            init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                    in_axis=-2, out_axis=-1, batch_axis=(0,))
            w_in = self.param("w_in", init, (EXPERTS, HIDDEN, MLP_WIDTH))
            w_out = self.param("w_out", init, (EXPERTS, MLP_WIDTH, HIDDEN))
            up = nn.gelu(jnp.einsum("bsh,ehf->bsef", h, w_in))
            out = jnp.einsum("bsef,efh,bse->bsh", up, w_out, combine)
            # Switch-style load balancing: fraction routed (top-1) x mean router probability.
            routed = jnp.mean(jax.nn.one_hot(jnp.argmax(probs, axis=-1), EXPERTS), axis=(0, 1))
            aux = EXPERTS * jnp.sum(routed * jnp.mean(probs, axis=(0, 1)))
            return x + out, aux

    return MoEBlock


def moe_block() -> CorpusModel:
    model = _moe_module()()
    x, y = _regression_batch((BATCH, SEQ, HIDDEN), HIDDEN)
    params = model.init(jax.random.key(0), x)["params"]

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        out, aux = model.apply({"params": params}, x)
        return jnp.mean((out - y) ** 2) + 0.01 * aux

    return CorpusModel("moe_block", "flax.linen", loss, params, (x, y),
                       f"{EXPERTS} experts [E, H, F] via einsum, top-2 gates by lax.top_k")


# ---- flax.nnx ---------------------------------------------------------------------------------

@cache
def _nnx_modules() -> dict[str, type]:
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, sizes: tuple[int, ...], rngs: nnx.Rngs) -> None:
            self.linear1 = nnx.Linear(sizes[0], sizes[1], rngs=rngs)
            self.linear2 = nnx.Linear(sizes[1], sizes[1], rngs=rngs)
            self.linear3 = nnx.Linear(sizes[1], sizes[2], rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            x = nnx.relu(self.linear1(x))
            return self.linear3(nnx.relu(self.linear2(x)))

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.ln1 = nnx.LayerNorm(HIDDEN, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(HEADS, HIDDEN, decode=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(HIDDEN, rngs=rngs)
            self.up = nnx.Linear(HIDDEN, MLP_WIDTH, rngs=rngs)
            self.down = nnx.Linear(MLP_WIDTH, HIDDEN, rngs=rngs)

        def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
            x = x + self.attn(self.ln1(x), mask=mask, deterministic=True)
            return x + self.down(nnx.gelu(self.up(self.ln2(x))))

    class Decoder(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
            self.pos = nnx.Embed(SEQ, HIDDEN, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
            self.ln = nnx.LayerNorm(HIDDEN, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[-1]))
            mask = nnx.make_causal_mask(tokens)
            for block in self.blocks:
                x = block(x, mask)
            return self.embed.attend(self.ln(x))

    return {"MLP": MLP, "Decoder": Decoder}


def _nnx_pure(model: Any) -> tuple[Callable[[Any], Any], Any]:
    """nnx.split into (graphdef, params, rest); returns (params -> model, params)."""
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return (lambda p: nnx.merge(graphdef, p, rest)), params


def nnx_mlp() -> CorpusModel:
    from flax import nnx

    merge, params = _nnx_pure(_nnx_modules()["MLP"](MLP_SIZES, nnx.Rngs(0)))
    x, y = _regression_batch((BATCH, MLP_SIZES[0]), MLP_SIZES[2])

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((merge(params)(x) - y) ** 2)

    return CorpusModel("nnx_mlp", "flax.nnx", loss, params, (x, y))


def nnx_decoder() -> CorpusModel:
    from flax import nnx

    merge, params = _nnx_pure(_nnx_modules()["Decoder"](nnx.Rngs(0)))
    tokens, targets = _token_batch()

    def loss(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        return _cross_entropy(merge(params)(tokens), targets)

    return CorpusModel("nnx_decoder", "flax.nnx", loss, params, (tokens, targets))


# ---- equinox ----------------------------------------------------------------------------------

@cache
def _eqx_modules() -> dict[str, type]:
    import equinox as eqx

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key: jax.Array) -> None:
            k1, k2 = jax.random.split(key)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(HIDDEN), eqx.nn.LayerNorm(HIDDEN)
            self.attn = eqx.nn.MultiheadAttention(HEADS, HIDDEN, key=k1)
            self.mlp = eqx.nn.MLP(HIDDEN, HIDDEN, MLP_WIDTH, depth=1, activation=jax.nn.gelu,
                                  key=k2)

        def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:  # x: [SEQ, HIDDEN]
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h, mask=mask)
            return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))

    class Decoder(eqx.Module):
        embed: eqx.nn.Embedding
        pos: eqx.nn.Embedding
        blocks: list[Block]
        ln: eqx.nn.LayerNorm

        def __init__(self, key: jax.Array) -> None:
            keys = jax.random.split(key, LAYERS + 2)
            self.embed = eqx.nn.Embedding(VOCAB, HIDDEN, key=keys[0])
            self.pos = eqx.nn.Embedding(SEQ, HIDDEN, key=keys[1])
            self.blocks = [Block(k) for k in keys[2:]]
            self.ln = eqx.nn.LayerNorm(HIDDEN)

        def __call__(self, tokens: jax.Array) -> jax.Array:  # one sequence: [SEQ]
            x = jax.vmap(self.embed)(tokens) + jax.vmap(self.pos)(jnp.arange(tokens.shape[0]))
            mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), dtype=bool))
            for block in self.blocks:
                x = block(x, mask)
            return jax.vmap(self.ln)(x) @ self.embed.weight.T  # tied output

    return {"Decoder": Decoder}


def eqx_mlp() -> CorpusModel:
    import equinox as eqx

    model = eqx.nn.MLP(MLP_SIZES[0], MLP_SIZES[2], MLP_SIZES[1], depth=2,
                       activation=jax.nn.relu, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    x, y = _regression_batch((BATCH, MLP_SIZES[0]), MLP_SIZES[2])

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        model = eqx.combine(params, static)
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    return CorpusModel("eqx_mlp", "equinox", loss, params, (x, y))


def eqx_decoder() -> CorpusModel:
    import equinox as eqx

    model = _eqx_modules()["Decoder"](jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    tokens, targets = _token_batch()

    def loss(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        model = eqx.combine(params, static)
        return _cross_entropy(jax.vmap(model)(tokens), targets)

    return CorpusModel("eqx_decoder", "equinox", loss, params, (tokens, targets),
                       "per-sequence model, jax.vmap over positions and over the batch")


# ---- keras-hub --------------------------------------------------------------------------------

@cache
def _keras() -> tuple[Any, Any]:
    """(keras, keras_hub) on the JAX backend."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    if keras.backend.backend() != "jax":
        raise RuntimeError(f"the keras models of the corpus need KERAS_BACKEND=jax; keras runs "
                           f"on {keras.backend.backend()!r} (set KERAS_BACKEND before importing "
                           f"keras)")
    import keras_hub

    return keras, keras_hub


def _keras_causal_lm(name: str, make: Callable[[Any], Any]) -> CorpusModel:
    """A keras-hub CausalLM (random init, no preprocessor) as a pure loss via stateless_call;
    ``make(keras_hub)`` builds it. Non-trainable variables are closed over as constants."""
    keras, keras_hub = _keras()
    keras.utils.set_random_seed(0)
    task = make(keras_hub)
    params = [v.value for v in task.trainable_variables]
    frozen = [v.value for v in task.non_trainable_variables]
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tokens, targets = _token_batch()
    padding_mask = jnp.ones_like(tokens)

    def loss(params: list[jax.Array], token_ids: jax.Array, padding_mask: jax.Array,
             targets: jax.Array) -> jax.Array:
        inputs = {"token_ids": token_ids, "padding_mask": padding_mask}
        logits, _ = task.stateless_call(params, frozen, inputs)
        return cross_entropy(targets, logits)

    return CorpusModel(name, "keras-hub", loss, params, (tokens, padding_mask, targets),
                       f"{type(task).__name__}(preprocessor=None).stateless_call")


def keras_gpt2() -> CorpusModel:
    def make(keras_hub: Any) -> Any:
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, hidden_dim=HIDDEN,
            intermediate_dim=MLP_WIDTH, dropout=0.0, max_sequence_length=SEQ)
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

    return _keras_causal_lm("keras_gpt2", make)


def keras_llama() -> CorpusModel:
    def make(keras_hub: Any) -> Any:
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=VOCAB, num_layers=LAYERS, num_query_heads=HEADS,
            num_key_value_heads=2, hidden_dim=HIDDEN, intermediate_dim=MLP_WIDTH, dropout=0.0)
        return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)

    return _keras_causal_lm("keras_llama", make)


def keras_gemma() -> CorpusModel:
    def make(keras_hub: Any) -> Any:
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=VOCAB, num_layers=LAYERS, num_query_heads=HEADS,
            num_key_value_heads=1, hidden_dim=HIDDEN, intermediate_dim=MLP_WIDTH,
            head_dim=HIDDEN // HEADS, dropout=0.0)
        return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)

    return _keras_causal_lm("keras_gemma", make)


def keras_mixtral() -> CorpusModel:
    def make(keras_hub: Any) -> Any:
        backbone = keras_hub.models.MixtralBackbone(
            vocabulary_size=VOCAB, num_layers=LAYERS, num_query_heads=HEADS,
            num_key_value_heads=2, hidden_dim=HIDDEN, intermediate_dim=MLP_WIDTH,
            num_experts=4, top_k=2, dropout=0.0)
        return keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)

    return _keras_causal_lm("keras_mixtral", make)


CORPUS: dict[str, Callable[[], CorpusModel]] = {
    "linen_mlp": linen_mlp,
    "linen_cnn": linen_cnn,
    "linen_decoder": linen_decoder,
    "linen_decoder_remat": linen_decoder_remat,
    "linen_decoder_scan": linen_decoder_scan,
    "moe_block": moe_block,
    "nnx_mlp": nnx_mlp,
    "nnx_decoder": nnx_decoder,
    "eqx_mlp": eqx_mlp,
    "eqx_decoder": eqx_decoder,
    "keras_gpt2": keras_gpt2,
    "keras_llama": keras_llama,
    "keras_gemma": keras_gemma,
    "keras_mixtral": keras_mixtral,
}


# ---- report -----------------------------------------------------------------------------------

def _error(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:120]}"


def _try(fn: Callable[[], Any]) -> tuple[Any, str, float]:
    """(result or None, "ok" or the error, seconds)."""
    t0 = time.perf_counter()
    try:
        out = fn()
        return out, "ok", time.perf_counter() - t0
    except Exception as e:  # a finding to report, not to stop on
        return None, _error(e), time.perf_counter() - t0


def report_row(name: str) -> dict[str, Any]:
    """Build ``name``, run value_and_grad once, then autopar.trace and autopar.search."""
    import autopar as ap

    t0 = time.perf_counter()
    m = CORPUS[name]()
    row: dict[str, Any] = {"model": name, "library": m.library, "build s": time.perf_counter() - t0,
                           "params": sum(x.size for x in jax.tree.leaves(m.params))}

    def grad_once() -> None:
        value, grads = jax.jit(jax.value_and_grad(m.loss))(m.params, *m.batch)
        jax.block_until_ready(grads)
        row["loss"] = float(value)

    _, row["value_and_grad"], row["grad s"] = _try(grad_once)
    graph, row["trace"], row["trace s"] = _try(lambda: ap.trace(m.loss, m.params, *m.batch))
    row["search"], row["search s"] = "-", 0.0
    if graph is not None:
        row["nodes"] = len(graph.nodes)

        def search() -> Any:
            with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel"):
                return ap.search(graph)

        _, row["search"], row["search s"] = _try(search)
    return row


def main() -> None:
    from benchmarks._common import markdown_table, setup_devices

    setup_devices(8)  # before any JAX computation
    t0 = time.perf_counter()
    _keras()
    print(f"import keras + keras_hub: {time.perf_counter() - t0:.1f} s")
    rows = [report_row(name) for name in CORPUS]
    print(markdown_table(rows, ["model", "library", "params", "build s", "value_and_grad",
                                "grad s", "trace", "trace s", "nodes", "search", "search s"],
                         fmt=".2f"))


if __name__ == "__main__":
    main()
