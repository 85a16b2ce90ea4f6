"""Strategy files: round trips on every zoo model, byte-identical saves, atomic writes, and a
fuzz test that mutates valid files and only ever gets the documented error."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar as ap
from autopar.checkpoint import StrategyFileError, read_strategy_file, save_strategy
from autopar.models import mlp, resnet50, tfm_stack, transformer

import numerics

KEY = jax.random.key(0)
_GRAPHS: dict[str, ap.Graph] = {}
_MODELS = {
    "mlp": lambda: mlp(widths=(64, 256, 64), batch=64),
    "tfm_stack": lambda: tfm_stack(blocks=2, batch=2, seq=16, hidden=64, heads=4),
    "transformer": lambda: transformer(layers=1, hidden=32, heads=2, seq=8, vocab=64, batch=8),
    "resnet50": lambda: resnet50(num_classes=16, batch=8, image_size=32),
}


def graph(name: str) -> ap.Graph:
    if name not in _GRAPHS:
        m = _MODELS[name]()
        _GRAPHS[name] = ap.trace(m.loss, *jax.eval_shape(m.example_args, KEY))
    return _GRAPHS[name]


@pytest.fixture(autouse=True)
def _auto():
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel")


def same_plan(a: ap.Plan, b: ap.Plan) -> bool:
    return (a.nodes, a.layouts, a.cost, a.objective, a.mesh, a.mode, a.pricing.enable_alltoall,
            a.pricing.memory_weight) == (b.nodes, b.layouts, b.cost, b.objective, b.mesh,
                                         b.mode, b.pricing.enable_alltoall,
                                         b.pricing.memory_weight)


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(_MODELS))
@pytest.mark.parametrize("mode", ["dynamic_programming", "recursive_programming"])
def test_round_trip_every_zoo_model(tmp_path, name, mode):
    g = graph(name)
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    with ap.auto_parallel_context(search_mode=mode, strategy_ckpt_save_file=str(first)):
        plan = ap.search(g)
    with ap.auto_parallel_context(strategy_ckpt_load_file=str(first),
                                  strategy_ckpt_save_file=str(second)):
        loaded = ap.search(g)
    assert same_plan(plan, loaded)
    assert "loaded from" in loaded.notes[-1]
    assert first.read_bytes() == second.read_bytes()  # same plan, same bytes


def test_same_plan_same_bytes_and_canonical_text(tmp_path):
    g = graph("mlp")
    plan = ap.search(g)
    a = save_strategy(plan, g, tmp_path / "a.json").read_bytes()
    b = save_strategy(ap.search(g), g, tmp_path / "b.json").read_bytes()
    assert a == b
    doc = json.loads(a)
    assert list(doc) == sorted(doc) and a.endswith(b"\n")
    assert doc["format"] == "autopar-strategy" and doc["version"] == 1
    assert doc["device_num"] == 8 and doc["fingerprint"] == g.fingerprint()
    w = "params/layer0/w"
    entry = doc["parallel_layout_item"][w]
    assert entry["dev_matrix"] == [2, 2, 2] and entry["tensor_shape"] == [64, 256]
    counts = plan.split_counts(w)
    assert entry["slice_shape"] == [64 // counts[0], 256 // counts[1]]
    assert all(e["stage"] == 0 for e in doc["parallel_strategy_item"].values())
    node = next(n for n in plan.nodes.values() if n.op == "dot_general")
    assert doc["parallel_strategy_item"][node.name]["parallel_strategy"] == \
        [list(s) for s in node.strategy]


def test_memory_priced_plan_round_trips(tmp_path):
    g = graph("mlp")
    tight = ap.Cluster(**{**ap.CLUSTERS["accelerator-8x"].model_dump(), "name": "tight",
                          "memory_bytes": 2.6e5})
    with pytest.warns(ap.AutoParallelWarning, match="fits .* only at"):  # (3.3x)
        plan = ap.search(g, mode="dynamic_programming", cluster=tight)
    path = save_strategy(plan, g, tmp_path / "m.json")
    loaded = ap.load_strategy(path, g)  # the file's cluster is used: same cost
    assert same_plan(plan, loaded)
    assert json.loads(path.read_text())["cluster"]["name"] == "tight"


def test_a_parallel_mode_argument_that_ignores_strategy_files_says_so(tmp_path):
    """search(parallel_mode='data_parallel') under an auto_parallel context set with strategy
    files: the files are not used, and a warning says so (was silent)."""
    g = graph("mlp")
    path = tmp_path / "s.json"
    with ap.auto_parallel_context(strategy_ckpt_save_file=str(path)):
        with pytest.warns(ap.AutoParallelWarning, match="strategy_ckpt_save_file"):
            ap.search(g, parallel_mode="data_parallel")
        assert not path.exists()
        ap.search(g)  # auto_parallel: saved
    with ap.auto_parallel_context(strategy_ckpt_load_file=str(path)):
        with pytest.warns(ap.AutoParallelWarning, match="strategy_ckpt_load_file"):
            assert ap.search(g, parallel_mode="data_parallel").source == ""


def test_loaded_plan_runs_like_the_saved_one(tmp_path):
    m = mlp(widths=(16, 32, 16), batch=8)
    args = m.example_args(KEY)
    path = tmp_path / "s.json"
    with ap.auto_parallel_context(strategy_ckpt_save_file=str(path)):
        f = ap.parallelize(m.loss, *args)
    with ap.auto_parallel_context(strategy_ckpt_load_file=str(path)):
        h = ap.parallelize(m.loss, *args)
    assert same_plan(f.plan, h.plan)
    numerics.assert_close(h(*args), m.loss, *args)
    assert h.collective_counts(*args) == f.collective_counts(*args)


@pytest.mark.parametrize("how", ["fixed", "annotation"])
def test_semi_auto_parallel_saves_and_loads_the_users_strategies(tmp_path, how):
    """The user's strategy must agree with the file loaded; an annotation is one as fixed=
    is (the file's plan replaced a conflicting annotation silently)."""
    g = graph("mlp")
    first = next(n.name for n in g.nodes if n.op == "dot_general")

    def search(strategy):
        if how == "fixed":
            return ap.search(g, fixed={first: strategy})
        return ap.search(g.annotate({first: strategy}))

    path = tmp_path / "s.json"
    with ap.auto_parallel_context(parallel_mode="semi_auto_parallel",
                                  strategy_ckpt_save_file=str(path)):
        plan = search(((1, 1), (1, 8)))
    with ap.auto_parallel_context(parallel_mode="semi_auto_parallel",
                                  strategy_ckpt_load_file=str(path)):
        loaded = ap.search(g)
        again = search(((1, 1), (1, 8)))  # agrees with the file
        word = "fixed" if how == "fixed" else "annotated"
        with pytest.raises(ap.AutoParallelError, match=f"{word} strategy.*conflicts"):
            search(((8, 1), (1, 1)))
        # fixed= replaces an annotation, and is what must agree
        ap.search(g.annotate({first: ((8, 1), (1, 1))}), fixed={first: ((1, 1), (1, 8))})
    assert same_plan(plan, loaded) and same_plan(plan, again)


def test_data_parallel_mode_ignores_the_files_with_a_warning(tmp_path):
    g = graph("mlp")
    path = tmp_path / "never.json"
    with pytest.warns(ap.AutoParallelWarning, match="strategy files"):
        with ap.auto_parallel_context(parallel_mode="data_parallel",
                                      strategy_ckpt_save_file=str(path)):
            ap.search(g)
    assert not path.exists()


# ---------------------------------------------------------------------------- mismatches


@pytest.fixture()
def saved(tmp_path) -> Path:
    g = graph("mlp")
    return save_strategy(ap.search(g), g, tmp_path / "s.json")


def _edit(path: Path, fn) -> Path:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))
    return path


def _load_error(path: Path, g: ap.Graph | None = None, **kw) -> StrategyFileError:
    with pytest.raises(StrategyFileError) as info:
        ap.load_strategy(path, g or graph("mlp"), **kw)
    assert str(path) in str(info.value)
    return info.value


def test_numbers_out_of_a_floats_range_are_refused(saved):
    # (1e999 was read as infinity: the plan loaded, then could not be saved again)
    text = saved.read_text()
    saved.write_text(text.replace('"memory_weight": 0.0', '"memory_weight": 1e999', 1))
    assert "1e999" in saved.read_text()
    assert _load_error(saved).field == "<json>"


def test_wrong_fingerprint(saved):
    other = graph("tfm_stack")
    e = _load_error(saved, other)
    assert e.field == "fingerprint" and other.fingerprint() in str(e)


def test_wrong_device_num(saved):
    e = _load_error(saved, device_num=4)
    assert e.field == "device_num" and "expected 4" in str(e) and "found 8" in str(e)


def test_wrong_enable_alltoall(saved):
    e = _load_error(saved, enable_alltoall=True)
    assert e.field == "enable_alltoall"


def test_unknown_version(saved):
    e = _load_error(_edit(saved, lambda d: d.update(version=2)))
    assert e.field == "version" and "found 2" in str(e)


def test_not_a_strategy_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"hello": 1}')
    assert _load_error(p).field == "format"
    p.write_text("[1, 2]")
    assert _load_error(p).field == "<root>"
    p.write_bytes(b"\xff\xfe\x00garbage")
    assert _load_error(p).field == "<json>"
    assert _load_error(tmp_path / "missing.json").field == "<file>"


def test_truncated_file(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2])
    e = _load_error(saved)
    assert e.field == "<json>" and "truncated" in str(e)


def test_an_unknown_mode_is_refused_without_a_graph_too(saved):
    """What needs no graph is checked where no graph is given (``autopar show``)."""
    from autopar.checkpoint import read_strategy_file

    _edit(saved, lambda d: d.update(mode="nosuch"))
    with pytest.raises(StrategyFileError, match="field 'mode'") as info:
        read_strategy_file(saved)
    assert "nosuch" in str(info.value)
    assert _load_error(saved).field == "mode"


def test_unknown_field_is_an_error(saved):
    e = _load_error(_edit(saved, lambda d: d.update(extra=1)))
    assert e.field == "extra"


def test_invalid_strategy_for_shapes(saved):
    g = graph("mlp")
    dot = next(n for n in g.nodes if n.op == "dot_general").name

    def bad(d):
        d["parallel_strategy_item"][dot]["parallel_strategy"] = [[3, 1], [1, 1]]

    e = _load_error(_edit(saved, bad))
    assert e.field == f"parallel_strategy_item.{dot}.parallel_strategy"


def test_strategy_inconsistent_with_splits(saved):
    g = graph("mlp")
    dot = next(n for n in g.nodes if n.op == "dot_general").name

    def bad(d):
        e = d["parallel_strategy_item"][dot]
        e["parallel_strategy"] = [[8, 1], [1, 1]] if e["parallel_strategy"] != [[8, 1], [1, 1]] \
            else [[1, 1], [1, 8]]  # valid for the shapes, but not the strategy of the splits

    e = _load_error(_edit(saved, bad))
    assert e.field.startswith(f"parallel_strategy_item.{dot}")


def test_bad_splits(saved):
    g = graph("mlp")
    dot = next(n for n in g.nodes if n.op == "dot_general").name
    e = _load_error(_edit(saved, lambda d: d["parallel_strategy_item"][dot].update(
        splits=[3, 1, 1])))
    assert e.field == f"parallel_strategy_item.{dot}.splits"


def test_missing_operator(saved):
    g = graph("mlp")
    e = _load_error(_edit(saved, lambda d: d["parallel_strategy_item"].pop(g.nodes[0].name)))
    assert e.field == "parallel_strategy_item" and g.nodes[0].name in str(e)


def test_parameter_layout_no_consumer_uses_loads_priced(saved):
    """A parameter stored in a layout none of its consumers reads (recursive_programming's
    wider choices make such plans) loads, with the redistribution to its consumer priced;
    a layout that cannot hold the tensor is still refused."""
    def moved(d):
        entry = d["parallel_layout_item"]["params/layer0/b"]
        entry["tensor_map"] = [0]
        entry["slice_shape"] = [entry["tensor_shape"][0] // 2]

    base = ap.load_strategy(saved, graph("mlp"), cluster="accelerator-8x")
    # re-priced on a named cluster (the file's own prediction no longer holds)
    plan = ap.load_strategy(_edit(saved, moved), graph("mlp"), cluster="accelerator-8x")
    assert plan.split_counts("params/layer0/b") == (2,)
    assert plan.cost.redistribution > base.cost.redistribution

    def bad(d):
        d["parallel_layout_item"]["params/layer0/b"]["slice_shape"] = [3]

    e = _load_error(_edit(saved, bad))
    assert e.field.startswith("parallel_layout_item.params/layer0/b")


def test_stage_out_of_range(saved):
    g = graph("mlp")
    e = _load_error(_edit(saved, lambda d: d["parallel_strategy_item"][g.nodes[0].name]
                          .update(stage=1)))
    assert e.field.endswith(".stage") and "pipeline_stages" in str(e)


@pytest.mark.parametrize("edit,field", [
    (lambda d: d["predicted"].update(step_seconds=123.0), "predicted.step_seconds"),
    (lambda d: d.update(memory_weight=1e-6), "predicted.objective"),
    (lambda d: d.update(mode="garbage"), "mode"),
    (lambda d: d.update(current_stage=7), "current_stage"),
    (lambda d: d.update(parallel_optimizer_kb=0), "parallel_optimizer_kb"),
    (lambda d: d["parallel_layout_item"]["params/layer0/w"].update(opt_weight_shard_size=99),
     "parallel_layout_item.params/layer0/w.opt_weight_shard_size"),
])
def test_self_contradicting_file_is_refused(saved, edit, field):
    e = _load_error(_edit(saved, edit))
    assert e.field == field


def test_a_file_saved_with_the_parallel_optimizer_needs_it_on(tmp_path):
    g = graph("mlp")
    with ap.auto_parallel_context(enable_parallel_optimizer=True):
        path = save_strategy(ap.search(g), g, tmp_path / "po.json")
        ap.load_strategy(path, g)  # same threshold: loads
    e = _load_error(path)
    assert e.field == "parallel_optimizer_kb" and "None" in str(e)


def test_missing_data_input_layout_names_a_data_input(saved):
    e = _load_error(_edit(saved, lambda d: d["data_layout_item"].clear()))
    assert e.field == "data_layout_item" and "per data input" in str(e)
    assert "per parameter" not in str(e)


def test_saved_file_has_umask_permissions(tmp_path):
    g = graph("mlp")
    old = os.umask(0o022)
    try:
        path = save_strategy(ap.search(g), g, tmp_path / "perm.json")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_bad_paths_and_types():
    g = graph("mlp")
    plan = ap.search(g)
    with pytest.raises(ap.AutoParallelTypeError):
        save_strategy(plan, g, 3)
    with pytest.raises(ap.AutoParallelTypeError):
        save_strategy("plan", g, "x.json")
    with pytest.raises(ap.AutoParallelError, match="does not exist"):
        save_strategy(plan, g, "/nonexistent-dir/x.json")
    with pytest.raises(ap.AutoParallelError, match="fingerprint"):
        save_strategy(plan, graph("tfm_stack"), "x.json")
    with pytest.raises(ap.AutoParallelTypeError):
        ap.load_strategy("x.json", "graph")
    with pytest.raises(ap.AutoParallelTypeError):
        read_strategy_file(None)


# ---------------------------------------------------------------------------- atomic writes


def test_crash_during_save_leaves_the_old_file(tmp_path, monkeypatch):
    g = graph("mlp")
    path = save_strategy(ap.search(g), g, tmp_path / "s.json")
    before = path.read_bytes()
    other = ap.search(g, mode="recursive_programming", device_num=4)

    def boom(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(ap.AutoParallelError, match="disk full") as info:
        save_strategy(other, g, path)
    assert str(path) in str(info.value) and ".tmp" not in str(info.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]  # no temporary left


# ---------------------------------------------------------------------------- fuzz

_VALID: dict[str, bytes] = {}


def _valid_bytes() -> bytes:
    if "mlp" not in _VALID:
        g = graph("mlp")
        doc = ap.checkpoint.strategy_document(ap.search(g), g)
        _VALID["mlp"] = ap.checkpoint.dumps_strategy(doc).encode()
    return _VALID["mlp"]


def _mutate_json(data: bytes, choice: int, path_pick: int, value) -> bytes:
    doc = json.loads(data)
    # walk to a random container
    node = doc
    for _ in range(path_pick % 4):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        k = keys[choice % len(keys)]
        if not isinstance(node[k], (dict, list)):
            break
        node = node[k]
    keys = list(node) if isinstance(node, dict) else list(range(len(node)))
    if not keys:
        return json.dumps(doc).encode()
    k = keys[(choice * 7 + path_pick) % len(keys)]
    if path_pick % 2 and isinstance(node, dict):
        del node[k]               # a missing field
    else:
        node[k] = value           # a wrong type / value
    return json.dumps(doc).encode()


#: ``make stress`` runs 10,000 (AUTOPAR_FUZZ_EXAMPLES); ``make test`` a deterministic 200.
FUZZ_EXAMPLES = int(os.environ.get("AUTOPAR_FUZZ_EXAMPLES", "200"))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=FUZZ_EXAMPLES <= 200,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["truncate", "flip", "json", "nest"]), pos=st.integers(0, 10**6),
       byte=st.integers(0, 255), choice=st.integers(0, 50), path_pick=st.integers(0, 7),
       value=st.one_of(st.none(), st.booleans(), st.integers(-3, 10**9), st.floats(),
                       st.text(max_size=5), st.lists(st.integers(-2, 9), max_size=3)))
def test_fuzz_mutated_files_only_raise_the_documented_error(tmp_path, kind, pos, byte, choice,
                                                            path_pick, value):
    g = graph("mlp")
    data = _valid_bytes()
    if kind == "truncate":
        mutated = data[: pos % len(data)]
    elif kind == "flip":
        i = pos % len(data)
        mutated = data[:i] + bytes([byte]) + data[i + 1:]
    elif kind == "json":
        mutated = _mutate_json(data, choice, path_pick, value)
    else:  # a value replaced by a deep nest of lists (a parser must not overflow its stack)
        depth = 1000 + pos % 200000
        mutated = _mutate_json(data, choice, path_pick, "NEST").replace(
            b'"NEST"', b"[" * depth + b"]" * depth)
    p = tmp_path / "fuzz.json"
    p.write_bytes(mutated)
    try:
        plan = ap.load_strategy(p, g)
    except StrategyFileError as e:
        assert str(p) in str(e) and e.field
        return
    # a mutation that still loads must be a valid plan: equal to what the file says
    assert set(plan.nodes) == {n.name for n in g.nodes}
    doc = json.loads(mutated)
    for name, n in plan.nodes.items():
        assert [list(s) for s in n.strategy] == doc["parallel_strategy_item"][name][
            "parallel_strategy"]


def test_no_partial_load_on_failure(saved):
    """A failing load changes nothing: the context and a later search are unaffected."""
    g = graph("mlp")
    before = ap.get_auto_parallel_context("device_num")
    _edit(saved, lambda d: d.update(device_num=4))
    with ap.auto_parallel_context(strategy_ckpt_load_file=str(saved)):
        with pytest.raises(StrategyFileError):
            ap.search(g)
    assert ap.get_auto_parallel_context("device_num") == before
    assert same_plan(ap.search(g), ap.search(g))


def test_to_jax_shardings_with_plain_jit():
    m = mlp(widths=(16, 32, 16), batch=8)
    args = m.example_args(KEY)
    g = ap.trace(m.loss, *args)
    plan = ap.search(g, mode="dynamic_programming")
    shardings = ap.to_jax_shardings(plan)
    assert set(shardings) == set(g.inputs)
    specs = plan.partition_specs()
    for v, sh in shardings.items():
        assert sh.spec == specs[v] == plan.layouts[v].partition_spec()
    f = jax.jit(m.loss, in_shardings=ap.in_shardings(plan))
    grad = jax.jit(jax.grad(m.loss), in_shardings=ap.in_shardings(plan))
    numerics.assert_close((f(*args), grad(*args)), lambda *a: (m.loss(*a), jax.grad(m.loss)(*a)),
                          *args)
    placed = jax.device_put(args, ap.in_shardings(plan))
    w = placed[0]["layer0"]["w"]
    assert w.sharding == shardings["params/layer0/w"]
    assert w.addressable_shards[0].data.shape == plan.layouts["params/layer0/w"].local_shape(
        (16, 32), plan.mesh)


def test_to_jax_shardings_bad_mesh():
    g = graph("mlp")
    plan = ap.search(g)
    with pytest.raises(ap.AutoParallelTypeError):
        ap.to_jax_shardings(plan, "mesh")
    wrong = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(4), ("x",))
    with pytest.raises(ap.AutoParallelError, match="axes"):
        ap.to_jax_shardings(plan, wrong)
    # a mesh with the user's own axis names: the plan's axes over its devices, in its order
    named = jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(8), ("x",))
    got = ap.to_jax_shardings(plan, named)["params/layer0/w"].mesh
    assert list(got.devices.flat) == jax.devices()[::-1]
    assert tuple(got.axis_names) == plan.mesh.names
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("a0", "a1", "a2"))
    assert ap.to_jax_shardings(plan, mesh)["params/layer0/w"].mesh is mesh


def test_pipeline_stages_round_trip(tmp_path):
    g = graph("mlp")
    plan = ap.search(g)
    half = len(g.nodes) // 2
    plan = dataclasses.replace(plan, stages={n.name: 1 for n in g.nodes[half:]})
    path = save_strategy(plan, g, tmp_path / "p.json")
    doc = json.loads(path.read_text())
    assert doc["parallel_strategy_item"][g.nodes[0].name]["stage"] == 0
    assert doc["parallel_strategy_item"][g.nodes[-1].name]["stage"] == 1
    loaded = ap.load_strategy(path, g, pipeline_stages=2)
    assert loaded.stages == plan.stages and same_plan(plan, loaded)
    with pytest.raises(StrategyFileError, match="pipeline_stages"):
        ap.load_strategy(path, g)  # the context has one stage


def test_malformed_fixed_strategy_with_a_load_file(saved):
    g = graph("mlp")
    with ap.auto_parallel_context(strategy_ckpt_load_file=str(saved)):
        with pytest.raises(ap.AutoParallelTypeError):
            ap.search(g, fixed={g.nodes[0].name: 3})


def _subset(shown, real, at="") -> list[str]:
    """Where ``shown`` (a trimmed copy) differs from ``real``: every field it keeps must be
    the real one."""
    if isinstance(shown, dict) and isinstance(real, dict):
        return [d for k, v in shown.items()
                for d in (_subset(v, real[k], f"{at}.{k}") if k in real else [f"{at}.{k}"])]
    return [] if shown == real else [f"{at}: {shown!r} != {real!r}"]


def test_the_trimmed_file_in_the_docs_is_what_a_save_writes(tmp_path):
    """docs/strategy_files.md's example is a real file, trimmed: it had drifted (a 4-way split
    where the search now picks 8)."""
    text = (Path(__file__).parents[1] / "docs" / "strategy_files.md").read_text()
    shown = json.loads(text.split("```json\n", 1)[1].split("```", 1)[0])
    m = mlp(widths=(1024, 4096, 1024), batch=16, bias=False)
    g = ap.trace(m.loss, *jax.eval_shape(m.example_args, KEY))
    path = tmp_path / "s.json"
    with ap.auto_parallel_context(search_mode="dynamic_programming",
                                  strategy_ckpt_save_file=str(path)):
        ap.search(g, cluster="accelerator-8x")
    assert _subset(shown, json.loads(path.read_text())) == []


def test_a_file_error_names_a_node_whose_name_has_brackets(tmp_path):
    """errors.validation_problems dropped location parts holding '[' (pydantic's union
    steps), and with them a node named block[0]/dot_general_0."""
    def f(x, w):
        with jax.named_scope("block[0]"):
            return (x @ w).sum()

    g = ap.trace(f, np.ones((8, 4), np.float32), np.ones((4, 4), np.float32))
    path = tmp_path / "s.json"
    with ap.auto_parallel_context(strategy_ckpt_save_file=str(path)):
        ap.search(g)
    doc = json.loads(path.read_text())
    doc["parallel_strategy_item"]["block[0]/dot_general_0"]["splits"] = "bad"
    path.write_text(json.dumps(doc))
    with pytest.raises(StrategyFileError) as info:
        ap.load_strategy(path, g)
    assert info.value.field == "parallel_strategy_item.block[0]/dot_general_0.splits"
