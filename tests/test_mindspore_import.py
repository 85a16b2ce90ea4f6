"""MindSpore's own JSON strategy files imported as fixed strategies.

The real files in ``tests/data/mindspore/`` were written by MindSpore 2.10's own search for two
MLPs (their README gives the models); each imports with nothing skipped, gives a plan with
MindSpore's strategies and parameter layouts, and (scaled down, only the shapes changed) runs
a training step with single-device numerics. Synthetic files cover the rest: name mapping,
transposed weights, broadcasting types through a parameter's path, the old ``-op<N>`` keys.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import autopar as ap
import numerics
from autopar.checkpoint import StrategyFileError
from autopar.mindspore_import import MS_OPS, import_mindspore_strategy, match_parameter
from autopar.models import mlp, tfm_stack
from autopar.models.base import gelu, layer_norm

NET = "Default/network-WithLossCell/_backbone-Net"
DATA = Path(__file__).parent / "data" / "mindspore"
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "mindspore-strategies"
REAL = sorted(p.name for p in DATA.glob("*.json"))
#: The README's models, and the scaled-down shapes the numerics run with: (x, w1, w2).
SHAPES = {"mlp_wide": ((32, 4096), (4096, 16384), (16384, 4096)),
          "mlp_tall": ((65536, 256), (256, 1024), (1024, 256))}
SMALL = {"mlp_wide": ((32, 64), (64, 256), (256, 64)),
         "mlp_tall": ((256, 16), (16, 64), (64, 16))}


def ms_loss(params, x):
    """The README's models: ``mean(square(gelu(x @ w1) @ w2))``, parameters ``w1``, ``w2``."""
    return jnp.mean(jnp.square(gelu(x @ params["w1"]) @ params["w2"]))


def ms_graph(shapes) -> ap.Graph:
    x, w1, w2 = (jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)
    return ap.trace(ms_loss, {"w1": w1, "w2": w2}, x)


def model_of(name: str) -> str:
    return "mlp_wide" if name.startswith("mlp_wide") else "mlp_tall"


def ms_strategies(doc: dict) -> dict[str, tuple]:
    return {k: tuple(map(tuple, v["parallel_strategy"]))
            for k, v in doc["parallel_strategy_item"].items()}


def ms_split_counts(layout: dict) -> tuple[int, ...]:
    """Shards per dim of MindSpore's layout (tensor_map counts device-matrix dims from the
    right, -1: not split)."""
    dm = layout["dev_matrix"]
    return tuple(1 if t == -1 else dm[len(dm) - 1 - t] for t in layout["tensor_map"])


def full_batch(name: str) -> bool:
    return "_fb1" in name  # fb0 and the t0/t1 runs: the batch split over the devices


@pytest.fixture(scope="module")
def graph() -> ap.Graph:
    m = mlp(widths=(64, 256, 64), batch=64)
    return ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))


@pytest.fixture(scope="module")
def real_graphs() -> dict[str, ap.Graph]:
    return {name: ms_graph(shapes) for name, shapes in SHAPES.items()}


def _ms_file(tmp_path, items, layouts=None, name="ms.json"):
    doc = {"current_stage": 0, "parallel_strategy_item": {
        k: {"stage": 0, "parallel_strategy": v} for k, v in items.items()},
        "parallel_layout_item": layouts or {}}
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def _plan(graph, fixed, **ctx):
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel", **ctx):
        return ap.search(graph, fixed=fixed)


# ----------------------------------------------------------------------------- real files


def test_the_real_files_are_mindspores_own():
    assert len(REAL) == 21 and (DATA / "README.md").exists()
    if not SHARED.is_dir():
        pytest.skip("../shared is not beside this clone")
    for name in REAL + ["README.md"]:
        assert (DATA / name).read_bytes() == (SHARED / name).read_bytes(), name


@pytest.mark.parametrize("name", REAL)
def test_real_file_imports_and_plans_as_mindspore(name, real_graphs):
    doc = json.loads((DATA / name).read_text())
    g = real_graphs[model_of(name)]
    imp = import_mindspore_strategy(DATA / name, g)
    assert imp.skipped == {}
    assert imp.mapped == {"MatMul_w1": "dot_general_0", "MatMul_w2": "dot_general_1"}
    want = ms_strategies(doc)
    assert imp.fixed == {"dot_general_0": want["MatMul_w1"],
                         "dot_general_1": want["MatMul_w2"]}
    assert "2 strategies imported, 0 skipped" in imp.summary()
    plan = _plan(g, imp.fixed, full_batch=full_batch(name))
    for ms, node in imp.mapped.items():
        assert plan.strategy(node) == want[ms]
    for p in ("w1", "w2"):  # the parameters are laid out as MindSpore lays them out
        assert plan.split_counts(f"params/{p}") == \
            ms_split_counts(doc["parallel_layout_item"][p])


def _derived(tmp_path, name: str) -> Path:
    """The real file with only the shapes changed: the scaled-down model's."""
    doc = json.loads((DATA / name).read_text())
    _, w1, w2 = SMALL[model_of(name)]
    for key, lay in doc["parallel_layout_item"].items():
        lay["tensor_shape"] = list(w1 if key.endswith("w1") else w2)
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def _distinct_runs() -> list[str]:
    """One real file per (strategies, full_batch) pair."""
    seen, out = set(), []
    for name in REAL:
        doc = json.loads((DATA / name).read_text())
        key = (tuple(sorted(ms_strategies(doc).items())), full_batch(name))
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


@pytest.mark.parametrize("name", _distinct_runs())
def test_real_strategies_train_with_single_device_numerics(name, tmp_path):
    shapes = SMALL[model_of(name)]
    g = ms_graph(shapes)
    imp = import_mindspore_strategy(_derived(tmp_path, name), g)
    assert imp.skipped == {} and len(imp.fixed) == 2
    k1, k2, kx = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, shapes[1]) / math.sqrt(shapes[1][0]),
              "w2": jax.random.normal(k2, shapes[2]) / math.sqrt(shapes[2][0])}
    x = jax.random.normal(kx, shapes[0])
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  full_batch=full_batch(name), gradients_mean=True):
        step = ap.train_step(ms_loss, params, (x,), fixed=imp.fixed)
    assert {n: step.plan.strategy(n) for n in imp.fixed} == imp.fixed
    grad = jax.value_and_grad(ms_loss)
    numerics.assert_close(step.grads(params, x), grad, params, x, single=grad(params, x),
                          jit=False)


def test_a_real_file_on_other_shapes_is_skipped_with_the_reason(real_graphs):
    imp = import_mindspore_strategy(DATA / "mlp_tall_sharding_propagation_d8_step_fb1.json",
                                    real_graphs["mlp_wide"])
    assert imp.fixed == {}
    assert "tensor_shape=[256, 1024]" in imp.skipped["MatMul_w1"]


# ----------------------------------------------------------------------------- names


def test_parameter_names_match_across_separators_and_indices():
    w = jnp.ones((8, 8))
    g = ap.trace(lambda p, x: x @ p["blocks"][0]["w1"] @ p["blocks"][1]["w1"] @ p["block2"]["w1"],
                 {"blocks": [{"w1": w}, {"w1": w}], "block2": {"w1": w}}, jnp.ones((2, 8)))
    assert match_parameter(g, "blocks.0.w1") == "p/blocks/0/w1"
    assert match_parameter(g, "network.backbone.blocks.1.w1") == "p/blocks/1/w1"
    assert match_parameter(g, "blocks.2.w1") == "p/block2/w1"
    assert match_parameter(g, "block2/w1") == "p/block2/w1"
    with pytest.raises(ap.AutoParallelError, match="ambiguous"):
        match_parameter(g, "w1")
    with pytest.raises(ap.AutoParallelError, match="no parameter"):
        match_parameter(g, "blocks.0.weight")


def test_parameter_keys_map_onto_the_consuming_node(tmp_path):
    w = jnp.ones((16, 16))
    g = ap.trace(lambda p, x: jnp.sum(x @ p["blocks"][0]["w1"] @ p["blocks"][1]["w1"]),
                 {"blocks": [{"w1": w}, {"w1": w}]}, jnp.ones((8, 16)))
    p = _ms_file(tmp_path, {"MatMul_blocks.1.w1": [[1, 2], [2, 4]],
                            "MatMul_blocks.0.w1": [[8, 1], [1, 1]],
                            "MatMul_w1": [[8, 1], [1, 1]], "Tanh_blocks.0.w1": [[8, 1]],
                            "Frobnicate_blocks.0.w1": [[8, 1]], "whatever": [[1]]})
    imp = import_mindspore_strategy(p, g)
    assert imp.mapped == {"MatMul_blocks.0.w1": "dot_general_0",
                          "MatMul_blocks.1.w1": "dot_general_1"}
    assert imp.fixed == {"dot_general_0": ((8, 1), (1, 1)), "dot_general_1": ((1, 2), (2, 4))}
    assert "ambiguous" in imp.skipped["MatMul_w1"]
    assert "no tanh node reads parameter 'p/blocks/0/w1'" in imp.skipped["Tanh_blocks.0.w1"]
    assert "'Frobnicate' is no MindSpore operator type" in imp.skipped["Frobnicate_blocks.0.w1"]
    assert "pass name_map" in imp.skipped["whatever"]
    plan = _plan(g, imp.fixed)
    assert plan.strategy("dot_general_1") == ((1, 2), (2, 4))


def test_name_map_and_exact_names(tmp_path, graph):
    p = _ms_file(tmp_path, {"my_first_matmul": [[8, 1], [1, 1]],
                            "layer1/dot_general_0": [[8, 1], [1, 1]]})
    imp = import_mindspore_strategy(p, graph, name_map={"my_first_matmul":
                                                        "layer0/dot_general_0"})
    assert set(imp.fixed) == {"layer0/dot_general_0", "layer1/dot_general_0"}
    with pytest.raises(ap.AutoParallelError, match="did you mean|Did you mean"):
        import_mindspore_strategy(p, graph, name_map={"my_first_matmul": "layer0/dot_gen"})
    with pytest.raises(ap.AutoParallelError, match="not an operator"):
        import_mindspore_strategy(p, graph, name_map={"nope": "layer0/dot_general_0"})
    with pytest.raises(ap.AutoParallelTypeError):
        import_mindspore_strategy(p, graph, name_map=[("a", "b")])


def test_two_entries_on_one_node_do_not_overwrite(tmp_path, graph):
    p = _ms_file(tmp_path, {"a_matmul": [[8, 1], [1, 1]], "b_matmul": [[1, 1], [1, 8]]})
    both = {"a_matmul": "layer0/dot_general_0", "b_matmul": "layer0/dot_general_0"}
    imp = import_mindspore_strategy(p, graph, name_map=both)
    assert imp.fixed == {"layer0/dot_general_0": ((8, 1), (1, 1))}  # the first entry's
    assert imp.mapped == {"a_matmul": "layer0/dot_general_0"}
    assert "like 'a_matmul'" in imp.skipped["b_matmul"]
    with pytest.raises(StrategyFileError, match="b_matmul"):
        import_mindspore_strategy(p, graph, name_map=both, strict=True)


# ----------------------------------------------------------------------------- transposes


def _dense(stored_nk: bool, einsum: bool = False):
    """``gelu(x @ w)`` with x [16, 32] and w stored [32, 64], or [64, 32] used transposed."""
    def loss(params, x):
        w = params["w"]
        y = jnp.einsum("mk,nk->mn", x, w) if einsum else x @ (w.T if stored_nk else w)
        return jnp.mean(gelu(y))
    shape = (64, 32) if stored_nk else (32, 64)
    return ap.trace(loss, {"w": jax.ShapeDtypeStruct(shape, jnp.float32)},
                    jax.ShapeDtypeStruct((16, 32), jnp.float32))


DENSE_NK = {"w": {"dev_matrix": [2, 4], "tensor_map": [0, -1], "tensor_shape": [64, 32]}}


def test_transposed_weight_maps_onto_the_dims_as_traced(tmp_path):
    # MindSpore's Dense: MatMul(transpose_b=True), w stored [n, k], strategy ((a, b), (c, b))
    p = _ms_file(tmp_path, {"MatMul_w": [[2, 1], [4, 1]]}, DENSE_NK)
    imp = import_mindspore_strategy(p, _dense(stored_nk=True))  # x @ w.T
    assert imp.fixed == {"dot_general_0": ((2, 1), (1, 4)), "transpose_0": ((4, 1),)}
    assert imp.via == {"MatMul_w": ("transpose_0",)}
    assert "transpose_b: the file's tensor_shape" in imp.summary()
    plan = _plan(_dense(stored_nk=True), imp.fixed)
    assert plan.split_counts("params/w") == (4, 1)  # stored [n, k] as MindSpore stores it
    imp = import_mindspore_strategy(p, _dense(stored_nk=False))  # JAX stores w [k, n]
    assert imp.fixed == {"dot_general_0": ((2, 1), (1, 4))}
    imp = import_mindspore_strategy(p, _dense(stored_nk=True, einsum=True))
    assert imp.fixed == {"mk,nk->mn/dot_general_0": ((2, 1), (4, 1))}  # rhs read as stored
    # without the file's shape: as the JAX program stores the weight
    p = _ms_file(tmp_path, {"MatMul_w": [[2, 1], [4, 1]]})
    assert import_mindspore_strategy(p, _dense(stored_nk=True)).fixed["dot_general_0"] == \
        ((2, 1), (1, 4))
    assert "does not fit" in import_mindspore_strategy(p, _dense(False)).skipped["MatMul_w"]


def test_square_weights_need_the_attribute(tmp_path):
    def loss(p, x):
        return jnp.mean(x @ p["w"])
    g = ap.trace(loss, {"w": jnp.ones((32, 32))}, jnp.ones((16, 32)))
    lay = {"w": {"dev_matrix": [2, 4], "tensor_map": [0, -1], "tensor_shape": [32, 32]}}
    p = _ms_file(tmp_path, {"MatMul_w": [[2, 1], [4, 1]]}, lay)
    imp = import_mindspore_strategy(p, g)  # both orientations fit the shape: as stored
    assert "transpose_b" in imp.skipped["MatMul_w"] and imp.fixed == {}
    imp = import_mindspore_strategy(p, g, attrs={"MatMul_w": {"transpose_b": True}})
    assert imp.fixed == {"dot_general_0": ((2, 1), (1, 4))}
    assert imp.notes == {"MatMul_w": "transpose_b: attrs"}
    with pytest.raises(ap.AutoParallelTypeError, match="attrs"):
        import_mindspore_strategy(p, g, attrs={"MatMul_w": {"transpose_c": True}})
    with pytest.raises(ap.AutoParallelError, match="not an operator"):
        import_mindspore_strategy(p, g, attrs={"MatMul_v": {"transpose_b": True}})


# ----------------------------------------------------------------------------- broadcasting


def _block(p, x):
    """A transposed dense layer with a bias, then layer norm: parameters behind transpose
    and broadcast nodes."""
    h = x @ p["blocks"][0]["w"].T + p["blocks"][0]["b"]
    h = layer_norm(gelu(h), p["ln"]["gamma"], p["ln"]["beta"])
    return jnp.mean(jnp.square(h))


def _block_args(key=jax.random.key(0)):
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"blocks": [{"w": jax.random.normal(k1, (64, 32)) / 8, "b": jnp.full((64,), .1)}],
              "ln": {"gamma": 1 + jax.random.normal(k2, (64,)) / 4, "beta": jnp.zeros(64)}}
    return params, jax.random.normal(k3, (16, 32))


def test_bias_and_layer_norm_parameters_map_through_their_broadcast(tmp_path):
    params, x = _block_args()
    g = ap.trace(_block, params, x)
    p = _ms_file(tmp_path, {"MatMul_blocks.0.w": [[2, 1], [4, 1]],
                            "BiasAdd_blocks.0.b": [[2, 4], [4]],
                            "LayerNorm_ln.gamma": [[8, 1], [1], [1]]},
                 {"blocks.0.w": {"dev_matrix": [2, 4], "tensor_map": [0, -1],
                                 "tensor_shape": [64, 32]}})
    imp = import_mindspore_strategy(p, g)
    assert imp.skipped == {}
    gamma_mul = imp.mapped["LayerNorm_ln.gamma"]
    assert imp.fixed[imp.mapped["BiasAdd_blocks.0.b"]] == ((2, 4), (1, 4))
    assert imp.fixed[gamma_mul] == ((8, 1), (1, 1))
    for ms, layout in (("BiasAdd_blocks.0.b", (4,)), ("LayerNorm_ln.gamma", (1,))):
        assert imp.via[ms][-1].startswith("broadcast_in_dim")  # (after a cast, for b)
        assert all(imp.fixed[n] == (layout,) for n in imp.via[ms])
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  gradients_mean=True):
        step = ap.train_step(_block, params, (x,), fixed=imp.fixed)
    assert {n: step.plan.strategy(n) for n in imp.fixed} == imp.fixed
    assert step.plan.split_counts("p/blocks/0/b") == (4,)
    assert step.plan.split_counts("p/blocks/0/w") == (4, 1)
    grad = jax.value_and_grad(_block)
    numerics.assert_close(step.grads(params, x), grad, params, x, single=grad(params, x),
                          jit=False)


def test_strategies_that_do_not_fit_are_skipped_never_refused(tmp_path):
    params, x = _block_args()
    g = ap.trace(_block, params, x)
    p = _ms_file(tmp_path, {"BiasAdd_blocks.0.b": [[2, 4], [2]],        # b split unlike h
                            "LayerNorm_ln.gamma": [[8, 1], [1]],         # an entry short
                            "MatMul_blocks.0.w": [[3, 1], [1, 1]],       # 3 does not divide
                            "LayerNorm_ln.beta": [[16, 1], [1], [1]]})   # 16 > 8 devices
    imp = import_mindspore_strategy(p, g, device_num=8)
    assert imp.fixed == {} and len(imp.skipped) == 4
    assert "input 0 splits 4" in imp.skipped["BiasAdd_blocks.0.b"]
    assert "device_num=8" in imp.skipped["LayerNorm_ln.beta"]
    with pytest.raises(StrategyFileError, match="parallel_strategy_item.BiasAdd"):
        import_mindspore_strategy(p, g, strict=True)


# ----------------------------------------------------------------------------- -op<N> keys


def test_maps_matmuls_by_type_and_order(tmp_path, graph):
    p = _ms_file(tmp_path, {f"{NET}/dense2-Dense/MatMul-op7": [[1, 1], [1, 8]],
                            f"{NET}/dense1-Dense/MatMul-op3": [[1, 1], [1, 8]],
                            f"{NET}/dense1-Dense/BiasAdd-op4": [[1, 8], [8]]},
                 {"dense1.weight": {"dev_matrix": [8], "tensor_map": [-1, 0],
                                    "tensor_shape": [64, 256]}})
    imp = import_mindspore_strategy(p, graph)
    # op3 comes first in the program: it maps to layer0, op7 to layer1
    assert imp.mapped == {f"{NET}/dense1-Dense/MatMul-op3": "layer0/dot_general_0",
                          f"{NET}/dense2-Dense/MatMul-op7": "layer1/dot_general_0"}
    assert imp.fixed == {"layer0/dot_general_0": ((1, 1), (1, 8)),
                         "layer1/dot_general_0": ((1, 1), (1, 8))}
    assert "ambiguous" in imp.skipped[f"{NET}/dense1-Dense/BiasAdd-op4"]  # the graph has 4 adds
    assert imp.parameters == ("dense1.weight",)
    plan = _plan(graph, imp.fixed)
    assert plan.strategy("layer0/dot_general_0") == ((1, 1), (1, 8))
    assert "2 strategies imported" in imp.summary()


def test_transformer_operators_by_type_and_order(tmp_path):
    m = tfm_stack(blocks=1, batch=2, seq=16, hidden=32, heads=4)
    g = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    ops = {"MatMul-op0": [[2, 4], [4, 1]], "BatchMatMul-op1": [[2, 4, 1, 1], [2, 4, 1, 1]],
           "Softmax-op2": [[2, 4, 1, 1]], "BatchMatMul-op3": [[2, 4, 1, 1], [2, 4, 1, 1]],
           "MatMul-op4": [[2, 1], [1, 4]], "LayerNorm-op5": [[8, 1], [1], [1]],
           "MatMul-op6": [[1, 1], [1, 8]], "GeLU-op7": [[1, 8]], "MatMul-op8": [[1, 8], [8, 1]],
           "Square-op9": [[8, 1]], "ReduceMean-op10": [[8, 1]]}
    imp = import_mindspore_strategy(_ms_file(tmp_path, {f"{NET}/{k}": v for k, v in
                                                        ops.items()}), g)
    got = {ms.rsplit("/", 1)[1]: node for ms, node in imp.mapped.items()}
    assert got == {"MatMul-op0": "block0/attn/dot_general_0",
                   "BatchMatMul-op1": "block0/attn/dot_general_1",
                   "Softmax-op2": "block0/attn/exp_0",
                   "BatchMatMul-op3": "block0/attn/dot_general_2",
                   "MatMul-op4": "block0/attn/dot_general_3", "LayerNorm-op5": "block0/ln/rsqrt_0",
                   "MatMul-op6": "block0/mlp/dot_general_0", "GeLU-op7": "block0/mlp/tanh_0",
                   "MatMul-op8": "block0/mlp/dot_general_1", "Square-op9": "loss/square_0"}
    # q @ k^T: MindSpore's BatchMatMul(transpose_b=True) reads k as stored, [B, heads, S, d]
    assert imp.fixed["block0/attn/dot_general_1"] == ((2, 4, 1, 1), (2, 4, 1, 1))
    assert "transpose_b" in imp.notes[f"{NET}/BatchMatMul-op1"]
    assert imp.fixed["block0/ln/rsqrt_0"] == ((8, 1),)
    # LayerNorm, Softmax and the loss are all reduce_sum nodes in JAX: not told apart
    assert "ambiguous" in imp.skipped[f"{NET}/ReduceMean-op10"]
    plan = _plan(g, imp.fixed)
    assert {n: plan.strategy(n) for n in imp.fixed} == imp.fixed


def test_ambiguous_and_misfit_strategies_are_skipped_or_strict(tmp_path, graph):
    p = _ms_file(tmp_path, {f"{NET}/MatMul-op1": [[1, 1], [1, 8]],
                            f"{NET}/Tanh-op2": [[3, 1]]})
    imp = import_mindspore_strategy(p, graph)
    assert "ambiguous" in imp.skipped[f"{NET}/MatMul-op1"]  # 1 in the file, 2 in the graph
    assert "does not fit" in imp.skipped[f"{NET}/Tanh-op2"]  # 3 does not divide 64
    assert imp.fixed == {}
    with pytest.raises(StrategyFileError, match="parallel_strategy_item"):
        import_mindspore_strategy(p, graph, strict=True)


# ----------------------------------------------------------------------------- Layouts


def _layout(dev, tensor_map, aliases, interleaved=False):
    """An input's entry as MindSpore 2.6's operator-strategy file writes it (tensor maps
    nested per dim)."""
    return {"dev_matrix": dev, "tensor_map": tensor_map, "alias_name": aliases,
            "interleaved_parallel": interleaved}


def test_operator_strategy_file_with_layouts(tmp_path):
    """MindSpore 2.6's ``save_operator_strategy_file``: Layout entries keyed by the node's
    scope name; tuple aliases multiply their axes, "None" (-1) leaves a dim whole. The plan
    takes them, and the step matches the float64 reference."""
    shapes = SMALL["mlp_wide"]
    g = ms_graph(shapes)
    aliases = ["dp", "sp", "mp"]
    doc = {"current_stage": 0, "parallel_layout_value_item": {
        f"{NET}/MatMul-op0": {"0": _layout([2, 2, 2], [[2, 1], [-1]], aliases),  # ("dp","sp")
                              "1": _layout([2, 2, 2], [[-1], [0]], aliases)},
        f"{NET}/MatMul-op1": {"1": _layout([2, 2, 2], [[0], [-1]], aliases),  # keys unordered
                              "0": _layout([2, 2, 2], [[2, 1], [0]], aliases)}}}
    p = tmp_path / "ops.json"
    p.write_text(json.dumps(doc))
    imp = import_mindspore_strategy(p, g)
    assert imp.skipped == {}
    assert imp.fixed == {"dot_general_0": ((4, 1), (1, 2)), "dot_general_1": ((4, 2), (2, 1))}
    k1, k2, kx = jax.random.split(jax.random.key(1), 3)
    params = {"w1": jax.random.normal(k1, shapes[1]) / 8,
              "w2": jax.random.normal(k2, shapes[2]) / 16}
    x = jax.random.normal(kx, shapes[0])
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel"):
        f = ap.parallelize(ms_loss, params, x, fixed=imp.fixed)
    assert {n: f.plan.strategy(n) for n in imp.fixed} == imp.fixed
    numerics.assert_close(f(params, x), ms_loss, params, x)
    doc["parallel_layout_value_item"][f"{NET}/MatMul-op1"]["0"]["interleaved_parallel"] = True
    p.write_text(json.dumps(doc))
    assert "interleaved_parallel" in import_mindspore_strategy(p, g).skipped[f"{NET}/MatMul-op1"]
    for bad, where in ((["x"], "op0"), ({"0": {"dev_matrix": [8], "tensor_map": [[3]]}},
                                         "op0.0.tensor_map")):
        doc["parallel_layout_value_item"][f"{NET}/MatMul-op0"] = bad
        p.write_text(json.dumps(doc))
        with pytest.raises(StrategyFileError, match=f"parallel_layout_value_item.*{where}"):
            import_mindspore_strategy(p, g)


def test_checkpoint_of_a_layout_sharded_script(tmp_path):
    """MindSpore's strategy checkpoint of a script that shards with Layouts: the operator's
    entry is empty (skipped, with the reason) and a parameter split over two axes has its
    tensor_shape written expanded ([2, 64, 256] for [128, 256]): grouped back, it still tells
    the orientation of the weight."""
    g = ms_graph(((32, 128), (128, 256), (256, 128)))
    p = _ms_file(tmp_path, {"MatMul_w1": [], "MatMul_w2": [[1, 4], [4, 2]]},
                 {"w1": {"dev_matrix": [2, 2, 2], "tensor_map": [2, 1, 0],
                         "tensor_shape": [2, 64, 256]},
                  "w2": {"dev_matrix": [2, 2, 2], "tensor_map": [1, 0, -1],
                         "tensor_shape": [2, 128, 128]}})
    imp = import_mindspore_strategy(p, g)
    assert "Layout" in imp.skipped["MatMul_w1"]
    assert imp.fixed == {"dot_general_1": ((1, 4), (4, 2))}
    # [2, 64, 256] is [128, 256]: w2 stored transposed (MatMul's transpose_b), so MindSpore's
    # (n, k) entry [2, 4] is autopar's (k, n) = (4, 2)
    p = _ms_file(tmp_path, {"MatMul_w2": [[1, 4], [2, 4]]},
                 {"w2": {"dev_matrix": [2, 2, 2], "tensor_map": [1, 0, -1],
                         "tensor_shape": [2, 64, 256]}})
    imp = import_mindspore_strategy(p, g)
    assert imp.fixed == {"dot_general_1": ((1, 4), (4, 2))}
    assert "tensor_shape" in imp.notes["MatMul_w2"]  # the expanded shape decided it


def test_the_common_operator_types_are_known():
    for t in ("MatMul", "BatchMatMul", "Add", "Mul", "GeLU", "FastGeLU", "Softmax",
              "ReduceMean", "ReduceSum", "LayerNorm", "Reshape", "Transpose", "Square", "Sub",
              "RealDiv", "Cast"):
        assert t in MS_OPS, t


# ----------------------------------------------------------------------------- bad input


def test_bad_files(tmp_path, graph):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(StrategyFileError, match="<json>"):
        import_mindspore_strategy(p, graph)
    p.write_text('{"parallel_strategy_item": {"a": 1}}')
    with pytest.raises(StrategyFileError, match="parallel_strategy_item.a"):
        import_mindspore_strategy(p, graph)
    p.write_text('{"parallel_strategy_item": {}, "parallel_layout_item": {"w": {'
                 '"tensor_shape": [4, "x"]}}}')
    with pytest.raises(StrategyFileError, match=r"parallel_layout_item.w.tensor_shape"):
        import_mindspore_strategy(p, graph)
    p.write_text("[]")
    with pytest.raises(StrategyFileError):
        import_mindspore_strategy(p, graph)
    with pytest.raises(StrategyFileError, match="<file>"):
        import_mindspore_strategy(tmp_path / "missing.json", graph)
    with pytest.raises(ap.AutoParallelTypeError):
        import_mindspore_strategy(p, "graph")
    p = _ms_file(tmp_path, {"MatMul_w": [[1, 1], [1, 1]], "MatMul_v": "x"})
    with pytest.raises(ap.AutoParallelTypeError, match="device_num"):
        import_mindspore_strategy(p, graph, device_num="8")
    assert "not a MindSpore strategy" in import_mindspore_strategy(p, graph).skipped["MatMul_v"]


def _two_matmuls() -> ap.Graph:
    """``tanh(x @ w1) @ w2``: two dot_generals, w1 [64, 128], w2 [128, 64]."""
    w1, w2, x = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((64, 128), (128, 64), (16, 64)))
    return ap.trace(lambda p, x: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]),
                    {"w1": w1, "w2": w2}, x)


def _doc_file(tmp_path, doc) -> Path:
    p = tmp_path / "doc.json"
    p.write_text(json.dumps(doc))
    return p


GOOD = {"parallel_strategy_item": {"MatMul_w1": {"parallel_strategy": [[1, 1], [1, 4]]}}}


@pytest.mark.parametrize("doc, field", [
    ({"parallel_strategy_item": [1], "parallel_layout_value_item": {}}, "parallel_strategy_item"),
    ({"parallel_strategy_item": [], "parallel_layout_value_item": {}}, "parallel_strategy_item"),
    ({"parallel_strategy_item": {}, "parallel_layout_value_item": [1]},
     "parallel_layout_value_item"),
    ({**GOOD, "parallel_layout_item": []}, "parallel_layout_item"),
    ([GOOD], "<root>"),
    ({"parallel_strategy_item": {"MatMul_w1": {"stage": -1, "parallel_strategy": [[1, 1],
                                                                              [1, 4]]}}},
     "parallel_strategy_item.MatMul_w1.stage"),
    ({"parallel_strategy_item": {"MatMul_w1": {"stage": True, "parallel_strategy": [[1, 1],
                                                                                [1, 4]]}}},
     "parallel_strategy_item.MatMul_w1.stage"),
    ({**GOOD, "parallel_layout_item": {"w1": {"dev_matrix": [4, 2], "tensor_map": [-1, 7],
                                               "tensor_shape": [64, 128]}}},
     "parallel_layout_item.w1.tensor_map"),
    ({**GOOD, "parallel_layout_item": {"w1": {"dev_matrix": [4, 2], "tensor_map": [[0, 2], -1],
                                               "tensor_shape": [64, 128]}}},
     "parallel_layout_item.w1.tensor_map"),
])
def test_sections_of_the_wrong_type_are_refused(tmp_path, doc, field):
    with pytest.raises(StrategyFileError, match=f"field '{field}'"):
        import_mindspore_strategy(_doc_file(tmp_path, doc), _two_matmuls())


def test_a_stage_given_as_text_is_shown_as_text(tmp_path):
    doc = {"parallel_strategy_item": {"MatMul_w1": {"stage": "0", "parallel_strategy": [
        [1, 1], [1, 4]]}}}
    with pytest.raises(StrategyFileError, match=r"found '0' \(str\)"):
        import_mindspore_strategy(_doc_file(tmp_path, doc), _two_matmuls())


def test_only_ascii_digits_are_indices(tmp_path):
    """``str.isdigit()`` takes "²", ``int()`` does not: an input index must be "0".."n-1", a
    "²" in a parameter name is a word, and ``-op²`` is no operator index."""
    g = _two_matmuls()
    bad = {"parallel_layout_value_item": {"Default/MatMul-op0": {"²": {
        "dev_matrix": [2, 4], "tensor_map": [1, -1]}}}}
    with pytest.raises(StrategyFileError, match="parallel_layout_value_item.Default/MatMul-op0"):
        import_mindspore_strategy(_doc_file(tmp_path, bad), g)
    st = {"parallel_strategy": [[1, 1], [1, 4]]}
    imp = import_mindspore_strategy(_doc_file(tmp_path, {"parallel_strategy_item": {
        "MatMul_blocks.².w1": st, "MatMul_w²": st, f"{NET}/MatMul-op²": st}}), g)
    assert imp.mapped == {"MatMul_blocks.².w1": "dot_general_0"}  # its words end "w1"
    assert "no parameter" in imp.skipped["MatMul_w²"]
    assert "no known MindSpore operator type" in imp.skipped[f"{NET}/MatMul-op²"]
    w = jnp.ones((8, 8))
    g = ap.trace(lambda p, x: x @ p["blocks"][0]["w1"] @ p["blocks"][1]["w1"],
                 {"blocks": [{"w1": w}, {"w1": w}]}, jnp.ones((2, 8)))
    with pytest.raises(ap.AutoParallelError, match="no parameter"):  # "²" is no index
        match_parameter(g, "blocks.².w1")
    assert match_parameter(g, "blocks.001.w1") == "p/blocks/1/w1"


def test_operator_indices_of_any_length_order_by_value(tmp_path):
    g = _two_matmuls()
    huge, small = "9" * 5000, "0" * 4400 + "7"  # past int()'s 4300 digits; 7 < 10
    doc = {"parallel_strategy_item": {
        f"{NET}/MatMul-op{huge}": {"parallel_strategy": [[1, 4], [4, 1]]},
        f"{NET}/MatMul-op{small}": {"parallel_strategy": [[1, 1], [1, 4]]},
        f"{NET}/Tanh-op10": {"parallel_strategy": [[2, 4]]}}}
    imp = import_mindspore_strategy(_doc_file(tmp_path, doc), g)
    assert imp.skipped == {}
    assert imp.mapped[f"{NET}/MatMul-op{small}"] == "dot_general_0"
    assert imp.mapped[f"{NET}/MatMul-op{huge}"] == "dot_general_1"


def test_json_nested_too_deep_is_a_file_error(tmp_path):
    p = tmp_path / "deep.json"
    p.write_text("[" * 200000 + "]" * 200000)
    with pytest.raises(StrategyFileError, match="<json>"):
        import_mindspore_strategy(p, _two_matmuls())


@pytest.mark.parametrize("text", [
    '{"parallel_strategy_item": {"MatMul_w1": {"stage": 0, "parallel_strategy": [[2, 1], '
    '[1, 4]]}, "MatMul_w1": {"stage": 0, "parallel_strategy": [[1, 1], [1, 8]]}}}',
    '{"current_stage": NaN, "parallel_strategy_item": {}}',
    '{"current_stage": Infinity, "parallel_strategy_item": {}}'])
def test_a_file_that_is_not_strict_json_is_refused(tmp_path, text):
    """A duplicated key kept its last entry silently, NaN and Infinity were read (json.loads);
    MindSpore's files are read by the one strict reader autopar's own files use."""
    p = tmp_path / "s.json"
    p.write_text(text)
    with pytest.raises(StrategyFileError, match="<json>"):
        import_mindspore_strategy(p, _two_matmuls())


def test_special_files_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "s.json"
    os.mkfifo(fifo)  # (read_text blocked until a writer came)
    with pytest.raises(StrategyFileError, match="regular file"):
        import_mindspore_strategy(fifo, _two_matmuls())


@pytest.mark.parametrize("path, error, match", [
    ("/tmp/a\x00b.json", StrategyFileError, "NUL byte"),
    (3, ap.AutoParallelTypeError, "path=3"),
    (b"/tmp/x.json", ap.AutoParallelTypeError, "path="),
    (None, ap.AutoParallelTypeError, "path=None"),
])
def test_bad_paths(path, error, match):
    with pytest.raises(error, match=match):
        import_mindspore_strategy(path, _two_matmuls())


@pytest.mark.parametrize("name_map, match", [
    ({"MatMul_w1": 3}, r"found 3 \(int\) at \['MatMul_w1'\]"),
    ({3: "dot_general_0"}, r"MindSpore names must be str, found 3 \(int\)"),
    ({"MatMul_w1": None}, "found None"),
])
def test_name_map_needs_str_names(tmp_path, name_map, match):
    with pytest.raises(ap.AutoParallelTypeError, match=f"name_map=.*{match}"):
        import_mindspore_strategy(_doc_file(tmp_path, GOOD), _two_matmuls(), name_map=name_map)


def _op_layouts(**per_op):
    return {"parallel_layout_value_item": {f"{NET}/{k}": v for k, v in per_op.items()}}


def _lay(dev, tensor_map, **more):
    return {"dev_matrix": dev, "tensor_map": tensor_map, **more}


@pytest.mark.parametrize("doc, field", [
    ({**GOOD, "parallel_layout_item": {"w1": {"dev_matrix": [4097]}}},
     "parallel_layout_item.w1.dev_matrix"),
    ({**GOOD, "parallel_layout_item": {"w1": {"dev_matrix": [10 ** 30, 2]}}},
     "parallel_layout_item.w1.dev_matrix"),
    ({**GOOD, "parallel_layout_item": {"w1": {"dev_matrix": [2] * 13}}},
     "parallel_layout_item.w1.dev_matrix"),
    (_op_layouts(**{"MatMul-op0": {"0": _lay([8192], [0, -1]), "1": _lay([8192], [-1, -1])}}),
     f"parallel_layout_value_item.{NET}/MatMul-op0.0.dev_matrix"),
])
def test_a_device_matrix_names_at_most_4096_devices(tmp_path, doc, field):
    """Not blamed on ``device_num``, which the user did not pass."""
    with pytest.raises(StrategyFileError, match=f"field '{field}'.*at most 4096 devices"):
        import_mindspore_strategy(_doc_file(tmp_path, doc), _two_matmuls())


def test_a_layout_uses_a_device_axis_once_and_names_the_devices(tmp_path):
    """A device-matrix axis on two dims is no Layout (``ap.Layout`` refuses it): it never
    becomes a strategy. The Layouts' device matrix gives the devices the file's strategies
    must fit (an interleaved one's holds its virtual axis too: not counted)."""
    g = _two_matmuls()
    reused = _op_layouts(**{"MatMul-op0": {"0": _lay([2, 4], [0, 0]),
                                           "1": _lay([2, 4], [[1, 0], -1])}})
    with pytest.raises(StrategyFileError, match=r"MatMul-op0.0.tensor_map'.*once"):
        import_mindspore_strategy(_doc_file(tmp_path, reused), g)
    reused = _op_layouts(**{"MatMul-op0": {"0": _lay([2, 4], [-1, -1]),
                                           "1": _lay([2, 4], [[1, 1], -1])}})
    with pytest.raises(StrategyFileError, match=r"MatMul-op0.1.tensor_map'.*once"):
        import_mindspore_strategy(_doc_file(tmp_path, reused), g)
    doc = _op_layouts(**{"MatMul-op0": {"0": _lay([2, 4], [1, -1]), "1": _lay([2, 4], [-1, 0])},
                         "MatMul-op1": {"0": _lay([2, 4], [1, 0]), "1": _lay([2, 4], [0, -1])},
                         "Exp-op2": {"0": _lay([4096, 2], [1, 0], interleaved_parallel=True)}})
    doc["parallel_strategy_item"] = {"Tanh-op9": {"parallel_strategy": [[4, 4]]}}
    imp = import_mindspore_strategy(_doc_file(tmp_path, doc), g)
    assert imp.fixed == {"dot_general_0": ((2, 1), (1, 4)), "dot_general_1": ((2, 4), (4, 1))}
    assert "device_num=8" in imp.skipped["Tanh-op9"]  # 16 ways: more than the Layouts' 8


@pytest.mark.parametrize("per_input, field", [
    ({}, "MatMul-op0"),
    ({"0": _lay([2, 4], [1, -1]), "2": _lay([2, 4], [-1, 0])}, "MatMul-op0"),
    ({"0": _lay([2, 4], [1, -1]), "00": _lay([2, 4], [-1, 0])}, "MatMul-op0"),
    ({"1": _lay([2, 4], [-1, 0])}, "MatMul-op0"),
    ({"0": _lay([2, 4], [1, -1], interleaved_parallel=None)}, "MatMul-op0.0.interleaved_parallel"),
    ({"0": _lay([2, 4], [1, -1], interleaved_parallel=0)}, "MatMul-op0.0.interleaved_parallel"),
    ({"0": _lay([2, 4], [1, -1], interleaved_parallel="false")},
     "MatMul-op0.0.interleaved_parallel"),
])
def test_layout_inputs_are_keyed_0_to_n_and_interleaving_is_a_bool(tmp_path, per_input, field):
    doc = _op_layouts(**{"MatMul-op0": per_input})
    where = f"parallel_layout_value_item.{NET}/{field}"
    with pytest.raises(StrategyFileError, match=f"field '{where}'"):
        import_mindspore_strategy(_doc_file(tmp_path, doc), _two_matmuls())


def test_strict_is_a_bool_and_a_file_entry_cannot_pose_as_an_interleaved_layout(tmp_path):
    with pytest.raises(ap.AutoParallelTypeError, match="strict='no'"):
        import_mindspore_strategy(_doc_file(tmp_path, GOOD), _two_matmuls(), strict="no")
    # an entry of the file's own with a "layout" key is an empty strategy like any other
    doc = {"parallel_strategy_item": {"MatMul_w1": {"parallel_strategy": [], "layout": True}}}
    out = import_mindspore_strategy(_doc_file(tmp_path, doc), _two_matmuls())
    assert "interleaved" not in out.skipped["MatMul_w1"]
    assert "MindSpore saved no strategy" in out.skipped["MatMul_w1"]
