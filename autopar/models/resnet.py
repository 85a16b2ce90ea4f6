"""ResNet-50 (torchvision v1.5 layout) in NHWC with HWIO kernels.

Stem: conv 7x7/2 (64) + batch norm + ReLU + max-pool 3x3/2. Four stages of bottleneck blocks
(3, 4, 6, 3) with widths 64, 128, 256, 512 and expansion 4: conv 1x1 -> BN -> ReLU ->
conv 3x3 (stride here, as in v1.5) -> BN -> ReLU -> conv 1x1 -> BN, plus identity (or
conv 1x1 + BN downsample in each stage's first block), then ReLU. Global average pool and a
dense layer. Convolutions have no bias; batch norm uses batch statistics over N, H, W in the
forward pass (training mode) and holds only ``scale`` and ``offset`` params (no running stats).
For 1000 classes the params are 161 arrays with 25,557,032 elements, like torchvision's
trainable parameters.

Param keys (insertion order = forward order): ``stem/conv/w``, ``stem/bn/scale``,
``stem/bn/offset``, ``layer1/block0/conv1/w``, ``layer1/block0/bn1/...``, ...,
``layer1/block0/conv3/w``, ``layer1/block0/bn3/...``, ``layer1/block0/downsample/conv/w``,
``layer1/block0/downsample/bn/...``, ..., ``fc/w``, ``fc/b``. Note ``jax.tree_util`` flattens
dicts in *sorted* key order (``fc`` first, then ``layer1``..``layer4``, then ``stem``; within a
block ``bn1, bn2, bn3, conv1, conv2, conv3, downsample``), so leaf order is not forward order;
the gradient production order comes from the traced graph.

>>> import jax
>>> m = resnet50(num_classes=10, batch=2, image_size=32)
>>> params, images, labels = m.example_args(jax.random.key(0))
>>> jax.eval_shape(m.apply, params, images).shape   # (running it eagerly takes seconds)
(2, 10)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from autopar.models.base import (
    LN_EPS,
    Init,
    Model,
    Params,
    check_dtype,
    check_int,
    cross_entropy,
    init_params,
    param_shapes,
    key_names,
    normal,
)

__all__ = ["resnet50", "STAGES"]

STAGES: tuple[tuple[int, int, int], ...] = ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2))
"""Per stage: (number of bottleneck blocks, bottleneck width, stride of the first block)."""

EXPANSION = 4
"""Output channels of a bottleneck block = width * EXPANSION."""

_DN = ("NHWC", "HWIO", "NHWC")


def _conv(x: jax.Array, w: jax.Array, stride: int) -> jax.Array:
    """Convolution with torchvision's padding ``k // 2`` on both sides (no bias)."""
    pad = w.shape[0] // 2
    return lax.conv_general_dilated(x, w, window_strides=(stride, stride),
                                    padding=((pad, pad), (pad, pad)), dimension_numbers=_DN)


def _batch_norm(x: jax.Array, p: Params) -> jax.Array:
    """Training-mode batch norm: statistics over N, H, W; ``scale`` and ``offset`` per channel."""
    mean = jnp.mean(x, axis=(0, 1, 2), keepdims=True)
    centred = x - mean
    var = jnp.mean(centred * centred, axis=(0, 1, 2), keepdims=True)
    return centred * lax.rsqrt(var + LN_EPS) * p["scale"] + p["offset"]


def _relu(x: jax.Array) -> jax.Array:
    return jnp.maximum(x, 0)


def _max_pool(x: jax.Array) -> jax.Array:
    """Max-pool 3x3, stride 2, padding 1 (``lax.reduce_window`` with ``-inf`` init)."""
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                             ((0, 0), (1, 1), (1, 1), (0, 0)))


def resnet50(num_classes: int = 1000, batch: int = 2, image_size: int = 224,
             dtype: Any = jnp.float32) -> Model:
    """Build ResNet-50 for ``images [batch, image_size, image_size, 3]`` and int32 labels.

    Args:
        num_classes: size of the final dense layer ``fc/w [2048, num_classes]``, ``fc/b``.
        batch: example batch size.
        image_size: example image height and width. Any positive size works (32 is fast for
            tests), but below 64 the last stage sees 1x1 maps, where training-mode batch norm
            over ``batch`` values is nearly a sign function: the loss is then chaotic in
            rounding (eager vs ``jit`` differ). Compare numerics only at ``image_size >= 64``.
        dtype: floating dtype of params and images.

    Loss: mean softmax cross-entropy of the logits against ``labels [batch] int32``.
    Init: convolutions He-normal (std ``sqrt(2 / fan_in)``), BN scale 1 / offset 0, fc weight
    Normal(0, 1/sqrt(2048)) and bias 0.

    Raises:
        AutoParallelTypeError / AutoParallelError: naming the bad argument, value and rule.

    >>> import jax, math
    >>> shapes = jax.eval_shape(resnet50().init, jax.random.key(0))
    >>> leaves = jax.tree_util.tree_leaves(shapes)
    >>> len(leaves), sum(math.prod(a.shape) for a in leaves)
    (161, 25557032)
    """
    num_classes = check_int("num_classes", num_classes)
    batch = check_int("batch", batch)
    image_size = check_int("image_size", image_size)
    dtype_name = check_dtype("dtype", dtype)
    config: dict[str, Any] = {"num_classes": num_classes, "batch": batch,
                              "image_size": image_size, "dtype": dtype_name}
    stage_names = [f"layer{i + 1}" for i in range(len(STAGES))]

    def conv(k: int, cin: int, cout: int) -> dict[str, Init]:
        return {"w": Init.normal((k, k, cin, cout), math.sqrt(2.0 / (k * k * cin)))}

    def bn(c: int) -> dict[str, Init]:
        return {"scale": Init.ones((c,)), "offset": Init.zeros((c,))}

    spec: dict[str, Any] = {"stem": {"conv": conv(7, 3, 64), "bn": bn(64)}}
    cin = 64
    for stage_name, (n, width, _) in zip(stage_names, STAGES):
        cout = width * EXPANSION
        spec[stage_name] = {}
        for j, block_name in enumerate(key_names("block", n)):
            block: dict[str, Any] = {"conv1": conv(1, cin, width), "bn1": bn(width),
                                     "conv2": conv(3, width, width), "bn2": bn(width),
                                     "conv3": conv(1, width, cout), "bn3": bn(cout)}
            if j == 0:
                block["downsample"] = {"conv": conv(1, cin, cout), "bn": bn(cout)}
            spec[stage_name][block_name] = block
            cin = cout
    spec["fc"] = {"w": Init.normal((cin, num_classes), 1.0 / math.sqrt(cin)),
                  "b": Init.zeros((num_classes,))}

    def init(key: jax.Array) -> Params:
        return init_params(key, spec, dtype_name)

    def bottleneck(p: Params, x: jax.Array, stride: int) -> jax.Array:
        with jax.named_scope("conv1"):
            h = _relu(_batch_norm(_conv(x, p["conv1"]["w"], 1), p["bn1"]))
        with jax.named_scope("conv2"):
            h = _relu(_batch_norm(_conv(h, p["conv2"]["w"], stride), p["bn2"]))
        with jax.named_scope("conv3"):
            h = _batch_norm(_conv(h, p["conv3"]["w"], 1), p["bn3"])
        if "downsample" in p:
            with jax.named_scope("downsample"):
                x = _batch_norm(_conv(x, p["downsample"]["conv"]["w"], stride),
                                p["downsample"]["bn"])
        return _relu(h + x)

    def apply(params: Params, images: jax.Array) -> jax.Array:
        with jax.named_scope("stem"):
            x = _conv(images, params["stem"]["conv"]["w"], 2)
            x = _max_pool(_relu(_batch_norm(x, params["stem"]["bn"])))
        for stage_name, (n, _, stride) in zip(stage_names, STAGES):
            with jax.named_scope(stage_name):
                for j, block_name in enumerate(key_names("block", n)):
                    with jax.named_scope(block_name):
                        x = bottleneck(params[stage_name][block_name], x,
                                       stride if j == 0 else 1)
        with jax.named_scope("fc"):
            x = jnp.mean(x, axis=(1, 2))
            return x @ params["fc"]["w"] + params["fc"]["b"]

    def loss(params: Params, images: jax.Array, labels: jax.Array) -> jax.Array:
        logits = apply(params, images)
        with jax.named_scope("loss"):
            return cross_entropy(logits, labels)

    def example_batch(key: jax.Array) -> tuple[jax.Array, ...]:
        k_img, k_lab = jax.random.split(key)
        images = normal(k_img, (batch, image_size, image_size, 3), 1.0, dtype_name)
        labels = jax.random.randint(k_lab, (batch,), 0, num_classes, dtype=jnp.int32)
        return (images, labels)

    return Model(name="resnet50", init=init, apply=apply, loss=loss,
                 example_batch=example_batch, config=config,
                 param_shapes=lambda: param_shapes(spec, dtype_name))
