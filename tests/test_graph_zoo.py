"""Trace every zoo model at small sizes: node counts by kind, FLOPs, gradient order."""

from __future__ import annotations

import jax
import pytest

import autopar as ap
from autopar.models import mlp, resnet50, tfm_stack, transformer

KEY = jax.random.key(0)


def test_mlp_trace():
    m = mlp(widths=(16, 64, 32, 8), batch=4)
    g = ap.trace(m.loss, *m.example_args(KEY))
    dots = [n for n in g.nodes if n.op == "dot_general"]
    assert len(dots) == 3
    assert [d.flops for d in dots] == [2 * 4 * 16 * 64, 2 * 4 * 64 * 32, 2 * 4 * 32 * 8]
    assert len(g.parameters()) == 6 and g.data_inputs() == ("x",)
    # backward produces the last layer's gradients first
    order = g.gradient_order()
    assert order[0].startswith("params/layer2") and order[-1].startswith("params/layer0")


@pytest.mark.parametrize("layers", [1, 3])
def test_transformer_trace(layers):
    m = transformer(layers=layers, hidden=32, heads=4, seq=8, vocab=64, batch=2)
    g = ap.trace(m.loss, *m.example_args(KEY))
    kinds = g.count_by_kind()
    # per block: qkv, q@k^T, p@v, out proj, mlp in, mlp out = 6 matmuls; + LM head
    assert kinds["matmul"] == 6 * layers + 1
    assert kinds["gather"] >= 1  # embedding lookup (and the cross-entropy pick)
    names = [n.name for n in g.nodes]
    assert any(n.startswith("block0/") for n in names)
    assert any(n.startswith(f"block{layers - 1}/") for n in names)
    assert len(g.gradient_order()) == len(g.parameters()) == len(jax.tree.leaves(
        m.init(KEY)))
    lm_head = [n for n in g.nodes if n.op == "dot_general"][-1]
    assert lm_head.flops == 2 * 2 * 8 * 32 * 64


def test_tfm_stack_trace_matches_anchor_shapes():
    m = tfm_stack(blocks=2, batch=2, seq=8, hidden=32, heads=4)
    g = ap.trace(m.loss, *m.example_args(KEY))
    dots = [n for n in g.nodes if n.op == "dot_general"]
    assert len(dots) == 2 * 6
    specs = [tuple(g.spec(v).shape for v in d.inputs) for d in dots[:6]]
    assert specs[0] == ((16, 32), (32, 96))      # x @ wqkv
    assert specs[3] == ((16, 32), (32, 32))      # c @ wo
    assert specs[4] == ((16, 32), (32, 128))     # h @ w1
    assert specs[5] == ((16, 128), (128, 32))    # @ w2


def test_resnet50_trace_small():
    m = resnet50(num_classes=10, batch=2, image_size=32)
    g = ap.trace(m.loss, *m.example_args(KEY))
    kinds = g.count_by_kind()
    assert kinds["conv"] == 53
    assert kinds["matmul"] == 1
    assert kinds["reduce_window"] >= 1
    assert len(g.parameters()) == 161
    order = g.gradient_order()
    assert len(order) == 161 and order[0].startswith("params/fc")
    assert order[-1].startswith("params/stem")


def test_resnet50_full_size_flops():
    """Full size traced abstractly (make_jaxpr does not run it): ~4.1 GMACs per image."""
    m = resnet50(num_classes=1000, batch=1, image_size=224)
    shapes = jax.eval_shape(m.example_args, KEY)
    args = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), shapes)
    g = ap.trace(m.loss, *args)
    conv_and_fc = sum(n.flops for n in g.nodes if n.kind in ("conv", "matmul"))
    assert 8.0e9 < conv_and_fc < 8.4e9  # 2 x 4.1 GMAC (torchvision's published figure)
    assert sum(g.spec(p).size for p in g.parameters()) == 25_557_032
