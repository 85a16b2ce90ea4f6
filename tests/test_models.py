"""The model zoo: shapes, parameter counts, NumPy references, gradients and argument errors."""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar.errors import AutoParallelError, AutoParallelTypeError, UnknownKeyError
from autopar.models import MODELS, Model, get_model, mlp, resnet50, tfm_stack, transformer

KEY = jax.random.key(0)

TINY: dict[str, dict[str, Any]] = {
    "mlp": dict(widths=(8, 16, 4), batch=4),
    "transformer": dict(layers=2, hidden=16, heads=2, seq=8, vocab=32, batch=2),
    "tfm_stack": dict(blocks=2, batch=2, seq=4, hidden=8, heads=2),
    "resnet50": dict(num_classes=10, batch=2, image_size=16),
}


FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""XLA options for tests: cheap passes; this CPU spends most test time compiling."""


def run(f: Any, *args: Any) -> Any:
    """Compile ``f`` for ``args`` with :data:`FAST` options and call it."""
    return jax.jit(f).lower(*args).compile(FAST)(*args)


@functools.lru_cache(maxsize=None)
def tiny(name: str) -> tuple[Model, tuple[Any, ...]]:
    """The tiny model ``name`` and its example args, built once per test session."""
    m = get_model(name, **TINY[name])
    return m, m.example_args(KEY)


@functools.lru_cache(maxsize=None)
def tiny_grad(name: str) -> tuple[tuple[Any, ...], Any, Any]:
    """(args with random layer-norm gamma / beta, loss, grads) of the tiny model ``name``."""
    m, (params, *batch) = tiny(name)
    args = (perturb_norms(params, jax.random.key(7)), *batch)
    value, grads = run(jax.value_and_grad(m.loss), *args)
    return args, value, grads


def paths(tree: Any) -> dict[str, tuple[int, ...]]:
    """``{"layer0/w": shape, ...}`` from a params pytree (in flatten order)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(k.key for k in path): tuple(leaf.shape) for path, leaf in leaves}


def count(tree: Any) -> tuple[int, int]:
    leaves = jax.tree_util.tree_leaves(tree)
    return len(leaves), sum(math.prod(leaf.shape) for leaf in leaves)


# ----------------------------------------------------------------------------- NumPy refs


def np_gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * gamma + beta


def f64(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


def np_tfm_stack(params: dict, x: np.ndarray, b: int, s: int, heads: int) -> np.ndarray:
    """ANCHORS.md "tfmN", written out literally."""
    h_ = x.shape[1]
    for name in sorted(params):
        p = params[name]
        qkv = (x @ p["attn"]["wqkv"]).reshape(b, s, 3 * heads, h_ // heads).transpose(0, 2, 1, 3)
        q, k, v = qkv[:, :heads], qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
        c = np_softmax(q @ k.transpose(0, 1, 3, 2)) @ v
        c = c.transpose(0, 2, 1, 3).reshape(b * s, h_)
        h = np_layer_norm(x + c @ p["attn"]["wo"], p["ln"]["gamma"], p["ln"]["beta"])
        x = h + np_gelu(h @ p["mlp"]["w1"]) @ p["mlp"]["w2"]
    return x


def np_transformer_loss(params: dict, tokens: np.ndarray, targets: np.ndarray,
                        heads: int) -> float:
    b, s = tokens.shape
    x = params["embed"]["tokens"][tokens] + params["embed"]["pos"][:s]
    h_ = x.shape[-1]
    d = h_ // heads
    causal = np.tril(np.ones((s, s), bool))
    for name in sorted(k for k in params if k.startswith("block")):
        p = params[name]
        a = np_layer_norm(x, p["ln1"]["gamma"], p["ln1"]["beta"])
        qkv = (a @ p["attn"]["wqkv"]).reshape(b, s, 3, heads, d)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(d), -np.inf)
        c = (np_softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(b, s, h_)
        x = x + c @ p["attn"]["wo"]
        m = np_layer_norm(x, p["ln2"]["gamma"], p["ln2"]["beta"])
        x = x + np_gelu(m @ p["mlp"]["w1"]) @ p["mlp"]["w2"]
    x = np_layer_norm(x, params["ln_f"]["gamma"], params["ln_f"]["beta"])
    logits = x @ params["head"]["w"]
    logits = logits - logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return float(-np.take_along_axis(logp, targets[..., None], axis=-1).mean())


def perturb_norms(params: dict, key: jax.Array) -> dict:
    """Random gamma / beta so the reference checks they are used."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, leaf), k in zip(leaves, keys):
        name = path[-1].key
        if name in ("gamma", "beta"):
            leaf = leaf + 0.3 * jax.random.normal(k, leaf.shape, leaf.dtype)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


# ----------------------------------------------------------------------------- registry


def test_registry_and_model_record() -> None:
    assert MODELS == {"mlp": mlp, "transformer": transformer, "tfm_stack": tfm_stack,
                      "resnet50": resnet50}
    for name, kwargs in TINY.items():
        m = get_model(name, **kwargs)
        assert isinstance(m, Model) and m.name == name
        text = json.dumps(m.config)  # JSON-serialisable
        again = get_model(name, **json.loads(text))
        assert again.config == m.config
        with pytest.raises(AttributeError):
            m.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize("name", sorted(TINY))
def test_init_is_deterministic(name: str) -> None:
    """Same key -> identical params and batch, from a fresh builder (and under jit)."""
    m, (a, *batch_a) = tiny(name)
    fresh = get_model(name, **TINY[name])
    b, *batch_b = fresh.example_args(KEY)
    trees = [a, b]
    if name != "resnet50":  # jit(init) of 161 outputs compiles for seconds; same code path
        trees.append(jax.jit(fresh.init)(jax.random.split(KEY)[0]))
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for leaves in zip(*(jax.tree_util.tree_leaves(t) for t in trees)):
        for other in leaves[1:]:
            np.testing.assert_array_equal(leaves[0], other)
    for x, y in zip(batch_a, batch_b):
        np.testing.assert_array_equal(x, y)
    c = m.init(jax.random.key(1))
    assert any(not np.array_equal(x, y)
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(c)))


# ----------------------------------------------------------------------------- loss and grad


@pytest.mark.parametrize("name", sorted(TINY))
def test_loss_finite_and_grad(name: str) -> None:
    args, value, grads = tiny_grad(name)
    assert value.shape == () and bool(jnp.isfinite(value))
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(args[0])
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert all(float(jnp.sum(jnp.abs(g))) > 0.0 for g in leaves if g.ndim >= 2)
    assert paths(grads) == paths(args[0])


@pytest.mark.parametrize("name", sorted(TINY))
def test_traces_to_flat_primitives(name: str) -> None:
    """No nested jit / custom_jvp in the loss: the tracer sees plain primitives."""
    m, args = tiny(name)
    jaxpr = jax.make_jaxpr(m.loss)(*args).jaxpr
    prims = {e.primitive.name for e in jaxpr.eqns}
    assert not prims & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "closed_call"}
    if name != "mlp":
        stacks = {str(e.source_info.name_stack) for e in jaxpr.eqns}
        assert any(s.startswith(("block0", "layer1/block0")) for s in stacks)


# ----------------------------------------------------------------------------- MLP


def test_mlp_shapes_and_wide_mlp_anchor() -> None:
    m = mlp(widths=(8, 16, 32, 4), batch=3)
    assert paths(m.init(KEY)) == {"layer0/b": (16,), "layer0/w": (8, 16), "layer1/b": (32,),
                                  "layer1/w": (16, 32), "layer2/b": (4,), "layer2/w": (32, 4)}
    wide = mlp(widths=(4096, 16384, 4096), batch=32, bias=False)
    params, x = jax.eval_shape(wide.example_args, KEY)
    assert paths(params) == {"layer0/w": (4096, 16384), "layer1/w": (16384, 4096)}
    assert x.shape == (32, 4096)
    names = [f"layer{i:02d}" for i in range(11)]
    assert list(mlp(widths=(2,) * 12).init(KEY)) == names  # sorted order == layer order


@pytest.mark.parametrize("activation", ["gelu", "relu", "tanh", "identity"])
@pytest.mark.parametrize("loss", ["mean_square", "mse"])
def test_mlp_matches_numpy(activation: str, loss: str) -> None:
    m = mlp(widths=(8, 16, 12, 4), batch=5, activation=activation, loss=loss)
    params, *batch = m.example_args(KEY)
    params = jax.tree_util.tree_map(lambda a: a + 0.1, params)  # non-zero biases
    acts = {"gelu": np_gelu, "relu": lambda v: np.maximum(v, 0.0), "tanh": np.tanh,
            "identity": lambda v: v}
    p, b = f64(params), f64(batch)
    h = b[0]
    for i in range(3):
        h = h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"]
        h = acts[activation](h) if i < 2 else h
    out, value = run(lambda p, *bt: (m.apply(p, bt[0]), m.loss(p, *bt)), params, *batch)
    np.testing.assert_allclose(out, h, rtol=1e-5, atol=1e-6)
    want = np.mean(np.square(h if loss == "mean_square" else h - b[1]))
    assert len(batch) == (1 if loss == "mean_square" else 2)
    np.testing.assert_allclose(float(value), want, rtol=1e-5)


def test_mlp_bfloat16() -> None:
    m = mlp(widths=(8, 8), batch=2, dtype=jnp.bfloat16)
    params, x = m.example_args(KEY)
    assert params["layer0"]["w"].dtype == jnp.bfloat16 and x.dtype == jnp.bfloat16
    assert m.config["dtype"] == "bfloat16"


# ----------------------------------------------------------------------------- tfm_stack


def test_tfm_stack_shapes() -> None:
    m = tfm_stack(blocks=3, batch=2, seq=4, hidden=8, heads=2)
    params, x = m.example_args(KEY)
    assert x.shape == (8, 8)
    want = {"attn/wqkv": (8, 24), "attn/wo": (8, 8), "ln/gamma": (8,), "ln/beta": (8,),
            "mlp/w1": (8, 32), "mlp/w2": (32, 8)}
    assert paths(params) == {f"block{i}/{k}": v for i in range(3) for k, v in want.items()}
    full = jax.eval_shape(tfm_stack(blocks=4).init, KEY)
    assert count(full) == (24, 4 * (12 * 1024 * 1024 + 2 * 1024))


def test_tfm_stack_matches_anchor_formula() -> None:
    b, s, hidden, heads = 2, 4, 12, 3
    m = tfm_stack(blocks=2, batch=b, seq=s, hidden=hidden, heads=heads)
    params, x = m.example_args(KEY)
    params = perturb_norms(params, jax.random.key(7))
    want = np_tfm_stack(f64(params), np.asarray(x, np.float64), b, s, heads)
    out, value = run(lambda p, v: (m.apply(p, v), m.loss(p, v)), params, x)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(value), np.mean(want**2), rtol=1e-5)


# ----------------------------------------------------------------------------- transformer


def test_transformer_shapes() -> None:
    m = transformer(layers=2, hidden=16, heads=4, seq=8, vocab=32, batch=3, mlp_ratio=2)
    params, tokens, targets = m.example_args(KEY)
    assert list(params) == ["embed", "block0", "block1", "ln_f", "head"]
    assert list(params["block0"]) == ["ln1", "attn", "ln2", "mlp"]
    got = paths(params)
    assert got["embed/tokens"] == (32, 16) and got["embed/pos"] == (8, 16)
    assert got["block1/attn/wqkv"] == (16, 48) and got["block1/attn/wo"] == (16, 16)
    assert got["block0/mlp/w1"] == (16, 32) and got["block0/mlp/w2"] == (32, 16)
    assert got["block0/ln1/gamma"] == (16,) and got["ln_f/beta"] == (16,)
    assert got["head/w"] == (16, 32) and len(got) == 2 + 2 * 8 + 2 + 1
    assert tokens.dtype == targets.dtype == jnp.int32 and tokens.shape == (3, 8)
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])  # next-token targets
    assert jax.eval_shape(m.apply, params, tokens).shape == (3, 8, 32)


def test_transformer_matches_numpy_and_is_causal() -> None:
    m = tiny("transformer")[0]
    (params, tokens, targets), value, _ = tiny_grad("transformer")
    want = np_transformer_loss(f64(params), np.asarray(tokens), np.asarray(targets), heads=2)
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    changed = tokens.at[:, 5].set((tokens[:, 5] + 1) % 32)
    both = run(m.apply, params, jnp.concatenate([tokens, changed]))
    a, b = both[:2], both[2:]
    np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[:, 5:], b[:, 5:])


# ----------------------------------------------------------------------------- resnet50


def test_resnet50_full_size_counts() -> None:
    m = resnet50()
    params, images, labels = jax.eval_shape(m.example_args, KEY)
    assert count(params) == (161, 25_557_032)
    assert images.shape == (2, 224, 224, 3) and labels.shape == (2,)
    assert labels.dtype == jnp.int32
    assert jax.eval_shape(m.apply, params, images).shape == (2, 1000)
    convs = [p for p in paths(params) if p.endswith("/w") and not p.startswith("fc")]
    assert len(convs) == 53


def test_resnet50_keys_and_shapes() -> None:
    params = tiny("resnet50")[1][0]  # eager init keeps insertion order
    assert list(params) == ["stem", "layer1", "layer2", "layer3", "layer4", "fc"]
    assert [len(params[f"layer{i}"]) for i in range(1, 5)] == [3, 4, 6, 3]
    assert list(params["layer1"]["block0"]) == ["conv1", "bn1", "conv2", "bn2", "conv3", "bn3",
                                                "downsample"]
    assert "downsample" not in params["layer1"]["block1"]
    got = paths(params)
    assert got["stem/conv/w"] == (7, 7, 3, 64) and got["stem/bn/scale"] == (64,)
    assert got["stem/bn/offset"] == (64,)
    assert got["layer1/block0/conv1/w"] == (1, 1, 64, 64)
    assert got["layer1/block0/downsample/conv/w"] == (1, 1, 64, 256)
    assert got["layer2/block0/conv2/w"] == (3, 3, 128, 128)
    assert got["layer4/block2/conv3/w"] == (1, 1, 512, 2048)
    assert got["fc/w"] == (2048, 10) and got["fc/b"] == (10,)


def test_resnet50_small_batch() -> None:
    m, (params, images, labels) = tiny("resnet50")
    assert images.shape == (2, 16, 16, 3) and images.dtype == jnp.float32
    assert labels.dtype == jnp.int32 and bool(jnp.all((labels >= 0) & (labels < 10)))
    assert jax.eval_shape(m.apply, params, images).shape == (2, 10)


# ----------------------------------------------------------------------------- errors


def test_get_model_errors() -> None:
    with pytest.raises(AutoParallelError, match=r"model='vgg'.*\['mlp', 'resnet50', "
                                                r"'tfm_stack', 'transformer'\]"):
        get_model("vgg")
    with pytest.raises(AutoParallelTypeError, match="model=3"):
        get_model(3)  # type: ignore[arg-type]
    with pytest.raises(UnknownKeyError, match="depth=3.*not an argument of mlp"):
        get_model("mlp", depth=3)


BAD: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
    (mlp, dict(widths=(4,)), AutoParallelError, r"widths=\(4,\).*at least 2"),
    (mlp, dict(widths=(4, 0)), AutoParallelError, r"widths\[1\]=0.*>= 1"),
    (mlp, dict(widths=(4, 2.5)), AutoParallelTypeError, r"widths\[1\]=2.5.*int"),
    (mlp, dict(widths="48"), AutoParallelTypeError, r"widths='48'.*sequence"),
    (mlp, dict(batch=0), AutoParallelError, r"batch=0.*>= 1"),
    (mlp, dict(batch=True), AutoParallelTypeError, r"batch=True.*int.*got bool"),
    (mlp, dict(batch=2.0), AutoParallelTypeError, r"batch=2.0.*int"),
    (mlp, dict(activation="swish"), AutoParallelError, r"activation='swish'.*gelu"),
    (mlp, dict(activation=None), AutoParallelTypeError, r"activation=None"),
    (mlp, dict(loss="l1"), AutoParallelError, r"loss='l1'.*mean_square"),
    (mlp, dict(bias=1), AutoParallelTypeError, r"bias=1.*bool"),
    (mlp, dict(dtype=jnp.int32), AutoParallelError, r"dtype=.*floating"),
    (mlp, dict(dtype="nope"), AutoParallelTypeError, r"dtype='nope'.*floating"),
    (mlp, dict(dtype=None), AutoParallelTypeError, r"dtype=None"),
    (mlp, dict(dtype="float64"), AutoParallelError, r"dtype='float64'.*64-bit"),
    (transformer, dict(hidden=10, heads=4), AutoParallelError,
     r"hidden=10.*divisible by heads=4"),
    (transformer, dict(layers=-1), AutoParallelError, r"layers=-1"),
    (transformer, dict(vocab="128"), AutoParallelTypeError, r"vocab='128'"),
    (transformer, dict(mlp_ratio=0), AutoParallelError, r"mlp_ratio=0"),
    (transformer, dict(seq=0), AutoParallelError, r"seq=0"),
    (tfm_stack, dict(hidden=1000, heads=16), AutoParallelError,
     r"hidden=1000.*divisible by heads=16"),
    (tfm_stack, dict(blocks=0), AutoParallelError, r"blocks=0"),
    (tfm_stack, dict(heads=None), AutoParallelTypeError, r"heads=None"),
    (resnet50, dict(num_classes=0), AutoParallelError, r"num_classes=0"),
    (resnet50, dict(image_size=3.5), AutoParallelTypeError, r"image_size=3.5"),
    (resnet50, dict(batch=-2), AutoParallelError, r"batch=-2"),
]


@pytest.mark.parametrize(("builder", "kwargs", "error", "pattern"), BAD,
                         ids=[f"{b.__name__}-{'-'.join(k)}-{i}" for i, (b, k, _, _)
                              in enumerate(BAD)])
def test_bad_arguments(builder: Any, kwargs: dict[str, Any], error: type[Exception],
                       pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        builder(**kwargs)
    if error is AutoParallelTypeError:
        with pytest.raises(TypeError):
            builder(**kwargs)
    else:
        with pytest.raises(ValueError):
            builder(**kwargs)
