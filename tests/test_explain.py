"""autopar.explain: an operator's alternatives, the rest of the plan held, priced whole."""

from __future__ import annotations

import dataclasses

import jax
import pytest

import autopar as ap
from autopar.cli import main
from autopar.models import mlp, tfm_stack


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for name, m in (("mlp", mlp(widths=(64, 256, 64), batch=64)),
                    ("tfm", tfm_stack(blocks=1, batch=2, seq=16, hidden=64, heads=4))):
        out[name] = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    return out


@pytest.fixture(autouse=True)
def _auto():
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel")


def _dots(plan):
    return [n for n, s in plan.nodes.items() if s.op == "dot_general"]


@pytest.mark.parametrize("name", ["mlp", "tfm"])
def test_an_alternative_is_priced_as_the_search_prices_that_plan(graphs, name):
    """Each row equals the plan the search returns with every operator fixed at the plan's
    strategy but this one, fixed at the row's; the plan's own row equals the plan."""
    g = graphs[name]
    plan = ap.search(g, mode="recursive_programming")
    node = _dots(plan)[0]
    ex = ap.explain(g, plan, node)
    assert ex.chosen.objective == plan.objective and ex.chosen.splits == plan.nodes[node].splits
    assert len(ex.rows) > 3 and len({a.splits for a in ex.rows}) == len(ex.rows)
    held = {n: s.strategy for n, s in plan.nodes.items() if n != node}
    for alt in (ex.rows[0], ex.rows[len(ex.rows) // 2], ex.rows[-1]):
        again = ap.search(g, parallel_mode="semi_auto_parallel",
                          fixed={**held, node: alt.strategy})
        assert again.nodes[node].splits == alt.splits
        assert again.objective == pytest.approx(alt.objective, rel=1e-12)
        assert again.cost.redistribution == pytest.approx(alt.cost.redistribution, rel=1e-12)
        assert again.cost.memory_bytes == alt.cost.memory_bytes


def test_an_exact_plan_holds_no_cheaper_alternative(graphs):
    g = graphs["tfm"]
    plan = ap.search(g, mode="dynamic_programming")
    for node in _dots(plan):
        ex = ap.explain(g, plan, node)
        assert ex.rows[0].chosen  # (ties go to the plan's own)
        assert all(a.objective >= ex.chosen.objective for a in ex.rows)
    assert ex.cluster == "accelerator-8x" and ex.mode == "dynamic_programming"


def test_another_cluster_reprices_and_the_table_shows_it(graphs):
    g = graphs["mlp"]
    plan = ap.search(g)
    node = _dots(plan)[0]
    mine, other = ap.explain(g, plan, node), ap.explain(g, plan, node, cluster="cpu-emulated")
    assert other.cluster == "cpu-emulated" and other.chosen.splits == mine.chosen.splits
    assert other.chosen.objective != mine.chosen.objective
    text = mine.text(limit=2)
    assert f"{node} (dot_general) takes {mine.chosen.strategy}" in text
    assert text.count(" *") == 1 and "dearer strategies not shown" in text
    assert str(mine) == mine.text()


def test_bad_arguments_are_typed_errors(graphs):
    g, other = graphs["mlp"], graphs["tfm"]
    plan = ap.search(g)
    with pytest.raises(ap.AutoParallelError, match="Did you mean 'layer0/dot_general_0'"):
        ap.explain(g, plan, "layer0/dot_genral_0")
    with pytest.raises(ap.AutoParallelError, match="not searched on this graph"):
        ap.explain(other, plan, _dots(plan)[0])
    staged = dataclasses.replace(plan, stages={_dots(plan)[1]: 1})
    with pytest.raises(ap.AutoParallelError, match="stage_graphs"):
        ap.explain(g, staged, _dots(plan)[0])
    with pytest.raises(ap.AutoParallelTypeError, match="plan"):
        ap.explain(g, {"nodes": {}}, "x")
    with pytest.raises(ap.AutoParallelTypeError, match="graph"):
        ap.explain(None, plan, "x")


def test_the_command_line_explains_and_checks_names_first(tmp_path, capsys):
    args = ["search", "--model", "mlp", "-o", "widths=(16,32,16)", "-o", "batch=8",
            "--devices", "4"]
    assert main([*args, "--explain", "layer1/dot_general_0", "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert "layer1/dot_general_0 (dot_general) takes" in out and "vs chosen" in out
    saved = tmp_path / "plan.json"
    assert main([*args, "--save", str(saved), "--explain", "layer1/dot_genral_0"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]  # (progress lines aside)
    assert len(errors) == 1 and "did you mean 'layer1/dot_general_0'" in errors[0]
    assert "Traceback" not in err
    assert not saved.exists()  # refused before anything was searched or written


def test_a_strategy_outside_the_search_space_is_explained_among_all():
    """A user-fixed strategy that leaves devices repeating a large operator's work is not in
    fully_use_devices' space; the alternatives are then every legal strategy."""
    m = mlp(widths=(64, 2048, 64), batch=1024)  # layer0's output: 8 MiB, not a small op
    g = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    node = "layer0/dot_general_0"
    plan = ap.search(g, parallel_mode="semi_auto_parallel", fixed={node: ((2, 1), (1, 1))})
    ex = ap.explain(g, plan, node)
    assert ex.chosen.splits == (2, 1, 1) and ex.chosen.objective == plan.objective
    assert any(a.splits == (8, 1, 1) for a in ex.rows)


def test_an_annotated_operator_is_explained_among_all_its_alternatives(graphs):
    """The annotation does not narrow the table: under data_parallel (which does not use it)
    the plan's own strategy is a row; under auto_parallel the annotation is the plan's."""
    g = graphs["mlp"]
    node = [n.name for n in g.nodes if n.op == "dot_general"][0]
    annotated = g.annotate({node: ((2, 1), (1, 4))})
    with ap.auto_parallel_context(parallel_mode="data_parallel"):
        with pytest.warns(ap.AutoParallelWarning, match="annotated"):
            plan = ap.search(annotated)
        ex = ap.explain(annotated, plan, node)
    assert ex.chosen.splits == plan.nodes[node].splits == (8, 1, 1) and len(ex.rows) > 1
    plan = ap.search(annotated)
    ex = ap.explain(annotated, plan, node)
    assert ex.chosen.splits == plan.nodes[node].splits == (2, 4, 1) and len(ex.rows) > 1
