"""MindSpore's own JSON strategy file imported as fixed strategies (name mapping, checks)."""

from __future__ import annotations

import json

import jax
import pytest

import autopar as ap
from autopar.checkpoint import StrategyFileError
from autopar.mindspore_import import import_mindspore_strategy
from autopar.models import mlp

NET = "Default/network-WithLossCell/_backbone-Net"


@pytest.fixture(scope="module")
def graph() -> ap.Graph:
    m = mlp(widths=(64, 256, 64), batch=64)
    return ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))


def _ms_file(tmp_path, items, layouts=None):
    doc = {"current_stage": 0, "parallel_strategy_item": {
        k: {"stage": 0, "parallel_strategy": v} for k, v in items.items()},
        "parallel_layout_item": layouts or {}}
    p = tmp_path / "ms.json"
    p.write_text(json.dumps(doc))
    return p


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
    assert "BiasAdd-op4" in next(iter(imp.skipped))  # no JAX counterpart in the table
    assert imp.parameters == ("dense1.weight",)
    ap.set_auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel")
    plan = ap.search(graph, fixed=imp.fixed)
    assert plan.strategy("layer0/dot_general_0") == ((1, 1), (1, 8))
    assert "2 strategies imported" in imp.summary()


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


def test_ambiguous_and_misfit_strategies_are_skipped_or_strict(tmp_path, graph):
    p = _ms_file(tmp_path, {f"{NET}/MatMul-op1": [[1, 1], [1, 8]],
                            f"{NET}/Tanh-op2": [[3, 1]]})
    imp = import_mindspore_strategy(p, graph)
    assert "ambiguous" in imp.skipped[f"{NET}/MatMul-op1"]  # 1 in the file, 2 in the graph
    assert "does not fit" in imp.skipped[f"{NET}/Tanh-op2"]  # 3 does not divide 64
    assert imp.fixed == {}
    with pytest.raises(StrategyFileError, match="parallel_strategy_item"):
        import_mindspore_strategy(p, graph, strict=True)


def test_two_entries_on_one_node_do_not_overwrite(tmp_path, graph):
    p = _ms_file(tmp_path, {"a_matmul": [[8, 1], [1, 1]], "b_matmul": [[1, 1], [1, 8]]})
    both = {"a_matmul": "layer0/dot_general_0", "b_matmul": "layer0/dot_general_0"}
    imp = import_mindspore_strategy(p, graph, name_map=both)
    assert imp.fixed == {"layer0/dot_general_0": ((8, 1), (1, 1))}  # the first entry's
    assert imp.mapped == {"a_matmul": "layer0/dot_general_0"}
    assert "like 'a_matmul'" in imp.skipped["b_matmul"]
    with pytest.raises(StrategyFileError, match="b_matmul"):
        import_mindspore_strategy(p, graph, name_map=both, strict=True)


def test_bad_files(tmp_path, graph):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(StrategyFileError, match="<json>"):
        import_mindspore_strategy(p, graph)
    p.write_text('{"parallel_strategy_item": {"a": 1}}')
    with pytest.raises(StrategyFileError, match="parallel_strategy_item.a"):
        import_mindspore_strategy(p, graph)
    p.write_text("[]")
    with pytest.raises(StrategyFileError):
        import_mindspore_strategy(p, graph)
    with pytest.raises(StrategyFileError, match="<file>"):
        import_mindspore_strategy(tmp_path / "missing.json", graph)
    with pytest.raises(ap.AutoParallelTypeError):
        import_mindspore_strategy(p, "graph")
