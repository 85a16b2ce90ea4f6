"""Search modes: DP equals the exact optimum, known optima, fixed strategies, parallel modes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autopar as ap
from autopar.models import mlp, resnet50, tfm_stack, transformer

KEY = jax.random.key(0)


def _abstract_args(model):
    shapes = jax.eval_shape(model.example_args, KEY)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


_GRAPHS: dict[str, ap.Graph] = {}


def graph(name: str) -> ap.Graph:
    if name not in _GRAPHS:
        m = {
            "mlp": lambda: mlp(widths=(64, 256, 64), batch=64),
            "tfm_stack": lambda: tfm_stack(blocks=2, batch=2, seq=16, hidden=64, heads=4),
            "tfm_small": lambda: tfm_stack(blocks=1, batch=2, seq=8, hidden=32, heads=2),
            "transformer": lambda: transformer(layers=1, hidden=32, heads=2, seq=8, vocab=64,
                                               batch=4),
            "resnet50": lambda: resnet50(num_classes=16, batch=4, image_size=32),
        }[name]()
        _GRAPHS[name] = ap.trace(m.loss, *_abstract_args(m))
    return _GRAPHS[name]


@pytest.fixture(autouse=True)
def _auto():
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel")


# (resnet50 at 4 devices: the integer program took 33 s at 8, 8 s at 4)
@pytest.mark.parametrize("name,devices", [("mlp", 8), ("mlp", 64), ("tfm_stack", 8),
                                          ("tfm_small", 64), ("transformer", 8),
                                          ("transformer", 64), ("resnet50", 4)])
def test_exact_is_the_least_price_and_dynamic_programming_the_least_edge_sum(name, devices):
    """The referee solves the plan's price (a shared move paid once) exactly, so no mode
    prices below it; dynamic_programming's solve is exact for its own objective, every
    edge's entry (the integer program of the edge matrices alone agrees), and its plan is
    that solve polished: never dearer."""
    from autopar.strategies import dynamic_programming, exact, search as search_mod
    from autopar.strategies.cost import CostModel, get_cluster
    from autopar.strategies.layout import DeviceMesh

    g = graph(name)
    dp = ap.search(g, mode="dynamic_programming", device_num=devices)
    ex = ap.search(g, mode="exact", device_num=devices)
    rp = ap.search(g, mode="recursive_programming", device_num=devices)
    assert ex.objective <= dp.objective * (1 + 1e-9)
    assert ex.objective <= rp.objective * (1 + 1e-9)
    assert dp.cost.total == pytest.approx(dp.objective, rel=1e-12)  # (no memory priced)
    problem = search_mod._problem(g, DeviceMesh.for_devices(devices),
                                  CostModel(get_cluster(dp.cluster)), {},
                                  search_mod.SearchSettings(), 0.0, lazy=False)
    picks = dynamic_programming.solve(problem)
    edges = [(e.u, e.v, e.matrix) for e in problem.edges]
    ilp = exact.milp_picks([v.cost for v in problem.vertices], edges)
    assert _edge_objective(problem, picks) == pytest.approx(_edge_objective(problem, ilp),
                                                            rel=1e-9, abs=1e-12)
    assert dp.objective <= problem.evaluate(picks)[1] * (1 + 1e-12)


def _edge_objective(problem, picks):
    """The searches' own objective: every vertex's cost and every edge's entry."""
    return (sum(v.cost.item(k) for v, k in zip(problem.vertices, picks)) +
            sum(problem.pair_cost(e, picks[e.u], picks[e.v]) for e in problem.edges))


def _wide_mlp(batch, width, hidden):
    m = mlp(widths=(width, hidden, width), batch=batch, bias=False)
    return ap.trace(m.loss, *_abstract_args(m))


@pytest.mark.parametrize("mode", ["dynamic_programming", "exact", "recursive_programming"])
@pytest.mark.parametrize("cluster", ["cpu-emulated", "accelerator-8x"])
def test_megatron_layout_for_few_tokens_and_wide_layers(mode, cluster):
    """The ANCHORS "Wide MLP": the weights sharded over every device, never synchronised
    (MindSpore's default plan splits the batch and syncs them); Megatron's layout exactly
    on cpu-emulated. On accelerator-8x the first matmul may also split its inputs' shared
    dim: its partial sum is then reduce-scattered once for the GELU's readers, within 0.5 %
    of Megatron's price. (The solvers' own plans: hand_plan_margin 0; with the default
    margin the search keeps Megatron's hand layout, which these plans do not beat by 15 %.)"""
    g = _wide_mlp(32, 4096, 16384)
    kept = ap.search(g, mode=mode, cluster=cluster)
    assert kept.split_counts("params/layer0/w") == (1, 8)
    with ap.algo_parameters_context(hand_plan_margin=0.0):
        plan = ap.search(g, mode=mode, cluster=cluster)
    w1, w2 = plan.split_counts("params/layer0/w"), plan.split_counts("params/layer1/w")
    assert w1[0] * w1[1] == 8 and w2 == (8, 1) and plan.cost.gradient_sync == 0
    second = [n for n in plan.nodes.values() if n.op == "dot_general"][1]
    assert second.out_layouts[0].partial  # one partial sum exchanged in forward
    dots = [n for n, s in plan.nodes.items() if s.op == "dot_general"]
    megatron = ap.search(g, mode="dynamic_programming", cluster=cluster,
                         fixed={dots[0]: ((1, 1), (1, 8)), dots[1]: ((1, 8), (8, 1))})
    slack = 1e-3 if mode == "recursive_programming" else 1e-9  # (approximate: its small ops)
    assert plan.objective <= megatron.objective * (1 + slack)
    if cluster == "cpu-emulated":
        assert w1 == (1, 8)  # column parallel
    else:
        assert plan.objective >= megatron.objective * 0.995


@pytest.mark.parametrize("mode", ["dynamic_programming", "exact", "recursive_programming"])
def test_pure_data_parallel_for_huge_batch_and_narrow_layers(mode):
    g = _wide_mlp(65536, 256, 256)
    plan = ap.search(g, mode=mode)
    assert plan.split_counts("params/layer0/w") == (1, 1)
    assert plan.split_counts("params/layer1/w") == (1, 1)
    for n in plan.nodes.values():
        if n.op == "dot_general":
            assert n.splits[0] == 8  # batch rows split over all devices


def test_sharding_propagation_needs_and_honours_fixed():
    g = graph("tfm_stack")
    with pytest.raises(ValueError, match="fixed strategy"):
        ap.search(g, mode="sharding_propagation")
    qkv = [n.name for n in g.nodes if n.op == "dot_general"][0]
    plan = ap.search(g, mode="sharding_propagation", fixed={qkv: ((2, 1), (1, 4))})
    assert plan.strategy(qkv) == ((2, 1), (1, 4))
    ex = ap.search(g, mode="exact", fixed={qkv: ((2, 1), (1, 4))})
    assert plan.objective >= ex.objective * (1 - 1e-9)
    assert ex.strategy(qkv) == ((2, 1), (1, 4))


def test_annotations_are_fixed_in_every_mode():
    def loss(params, x):
        h = ap.matmul(x, params["w1"], strategy=((4, 1), (1, 2)))
        return jnp.mean(jnp.tanh(h) @ params["w2"])

    g = ap.trace(loss, {"w1": jnp.ones((64, 64)), "w2": jnp.ones((64, 16))}, jnp.ones((32, 64)))
    for mode in ("dynamic_programming", "recursive_programming", "sharding_propagation",
                 "exact"):
        assert ap.search(g, mode=mode).strategy("dot_general_0") == ((4, 1), (1, 2))


@pytest.mark.parametrize("fixed,text", [
    ({"dot_general_0": ((3, 1), (1, 1))}, "does not divide"),
    ({"dot_general_0": ((2, 2), (4, 1))}, "split alike"),
    ({"dot_general_0": ((4, 1), (1, 4))}, "divide device_num"),
    ({"dot_general_0": ((2, 1),)}, "one tuple per input"),
    ({"dot_general_0": ((2, 1, 1), (1, 1))}, "split counts"),
    ({"reduce_max_0": ((1, 2),)}, "cannot be split"),
    ({"nosuch_0": ((1, 1), (1, 1))}, "no node"),
])
def test_invalid_fixed_strategies(fixed, text):
    def loss(params, x):
        h = x @ params["w"]
        return jnp.max(h, axis=1).sum()

    g = ap.trace(loss, {"w": jnp.ones((16, 16))}, jnp.ones((16, 16)))
    with pytest.raises(ValueError, match=text):
        ap.search(g, mode="dynamic_programming", fixed=fixed)


def test_parallel_modes():
    g = graph("mlp")
    with ap.auto_parallel_context(parallel_mode="stand_alone", device_num=1):
        plan = ap.search(g)
    assert plan.device_num == 1 and plan.mode == "stand_alone"
    with ap.auto_parallel_context(parallel_mode="data_parallel"):
        plan = ap.search(g)
    assert plan.mode == "data_parallel"
    for n in plan.nodes.values():
        if n.op == "dot_general":
            assert n.splits[0] == 8 and all(s == 1 for s in n.splits[1:])
    assert all(plan.split_counts(p) == (1,) * len(plan.split_counts(p))
               for p in g.parameters())
    first = [n.name for n in g.nodes if n.op == "dot_general"][0]
    with ap.auto_parallel_context(parallel_mode="semi_auto_parallel"):
        plan = ap.search(g, fixed={first: ((2, 1), (1, 4))})
    assert plan.strategy(first) == ((2, 1), (1, 4))
    second = [n.name for n in g.nodes if n.op == "dot_general"][1]
    assert plan.nodes[second].splits[0] == 8  # the rest: data parallel


def test_search_is_deterministic():
    g = graph("transformer")
    a = ap.search(g, mode="dynamic_programming")
    b = ap.search(g, mode="dynamic_programming")
    assert str(a).split("searched in")[0] == str(b).split("searched in")[0]
    assert str(a).split("\n", 1)[1] == str(b).split("\n", 1)[1]


def test_plan_reports():
    g = graph("mlp")
    plan = ap.search(g, mode="dynamic_programming")
    text = str(plan)
    assert "compute" in text and "gradient sync" in text and "params/layer0/w" in text
    c = plan.cost
    assert c.total == pytest.approx(c.compute + c.communication + c.redistribution +
                                    c.gradient_sync)
    assert c.memory_bytes > 0
    assert plan.split_counts("x") == (8, 1)  # data input, data_parallel dataset strategy
    with pytest.raises(ValueError, match="nosuch"):
        plan.split_counts("nosuch")


@pytest.mark.parametrize("kwargs,exc,text", [
    ({"mode": "greedy"}, ValueError, "mode"),
    ({"mode": 3}, TypeError, "mode"),
    ({"device_num": 0}, ValueError, "device_num"),
    ({"device_num": 8.0}, TypeError, "device_num"),
    ({"cluster": "tpu-v9"}, ValueError, "cluster"),
    ({"cluster": 5}, TypeError, "cluster"),
    ({"fixed": [("a", 1)]}, TypeError, "fixed"),
])
def test_bad_search_arguments(kwargs, exc, text):
    with pytest.raises(exc, match=text):
        ap.search(graph("mlp"), **kwargs)
    with pytest.raises(TypeError, match="Graph"):
        ap.search("graph")


def test_memory_budget_prices_memory_or_fails():
    m = mlp(widths=(2048, 2048, 2048), batch=8192, bias=False)
    g = ap.trace(m.loss, *_abstract_args(m))
    free = ap.search(g, mode="dynamic_programming")
    assert free.cost.memory_bytes > 120e6
    assert not any("memory priced" in n for n in free.notes)
    base = ap.CLUSTERS["accelerator-8x"].model_dump()
    tight = ap.Cluster(**{**base, "memory_bytes": 120e6})
    for mode in ("dynamic_programming", "exact"):
        plan = ap.search(g, mode=mode, cluster=tight)
        assert plan.cost.memory_bytes <= 120e6
        assert plan.cost.total > free.cost.total  # memory was bought with time
    with pytest.raises(ValueError, match="budget"):
        ap.search(g, mode="dynamic_programming", cluster=ap.Cluster(**{**base,
                                                                          "memory_bytes": 8e7}))
    with pytest.raises(ValueError, match="no solution"):
        ap.search(g, mode="exact", cluster=ap.Cluster(**{**base, "memory_bytes": 8e7}))


@pytest.mark.parametrize("name", ["mlp", "tfm_stack", "transformer", "resnet50"])
def test_propagation_runs_on_every_zoo_model(name):
    g = graph(name)
    first = next(n for n in g.nodes if n.op in ("dot_general", "conv_general_dilated"))
    entry = tuple((1,) * g.spec(v).rank for v in first.inputs)
    plan = ap.search(g, mode="sharding_propagation", fixed={first.name: entry})
    dp = ap.search(g, mode="dynamic_programming", fixed={first.name: entry})
    assert plan.strategy(first.name) == entry
    assert plan.objective >= dp.objective * (1 - 1e-9)
    assert set(plan.nodes) == {n.name for n in g.nodes}


def test_fixed_strategies_under_data_parallel_warn():
    g = graph("mlp")
    first = [n.name for n in g.nodes if n.op == "dot_general"][0]
    with ap.auto_parallel_context(parallel_mode="data_parallel"):
        with pytest.warns(ap.AutoParallelWarning, match="not used"):
            plan = ap.search(g, fixed={first: ((2, 1), (1, 4))})
    assert plan.nodes[first].splits[0] == 8  # data parallel all the same
    # not used, so not checked against the devices (was refused after the warning)
    for pmode, n in (("stand_alone", 1), ("data_parallel", 4)):
        with ap.auto_parallel_context(parallel_mode=pmode, device_num=n):
            with pytest.warns(ap.AutoParallelWarning, match="not used"):
                ap.search(g, fixed={first: ((2, 1), (1, 4))})


def test_annotations_are_not_used_where_user_strategies_are_not():
    """stand_alone and data_parallel ignore annotations as they ignore fixed=, with a warning
    (an 8-way annotation failed on one device, and data parallel dropped it silently)."""
    g = graph("mlp")
    first = [n.name for n in g.nodes if n.op == "dot_general"][0]
    annotated = g.annotate({first: ((2, 1), (1, 4))})
    for pmode, n in (("stand_alone", 1), ("data_parallel", 1), ("data_parallel", 8)):
        with ap.auto_parallel_context(parallel_mode=pmode, device_num=n):
            with pytest.warns(ap.AutoParallelWarning, match="1 annotated operator.*not used"):
                plan = ap.search(annotated)
            assert plan.nodes == ap.search(g).nodes
    with ap.auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        assert ap.search(annotated).strategy(first) == ((2, 1), (1, 4))


@pytest.mark.parametrize("pmode", ["data_parallel", "semi_auto_parallel"])
def test_a_mode_argument_outside_auto_parallel_warns_as_the_context_key(pmode):
    """search(mode=...) / parallelize(mode=...) were ignored silently there."""
    with ap.auto_parallel_context(parallel_mode=pmode):
        with pytest.warns(ap.AutoParallelWarning, match="mode='exact' is only used by "
                                                        "auto_parallel") as seen:
            assert ap.search(graph("mlp"), mode="exact").mode == pmode
        m = mlp(widths=(8, 16, 8), batch=8)
        with pytest.warns(ap.AutoParallelWarning, match="mode='exact'") as deep:
            ap.parallelize(m.loss, *m.example_args(KEY), mode="exact")
    # at the user's line, however deep inside autopar it was issued
    assert {w.filename for w in [*seen, *deep] if "mode=" in str(w.message)} == {__file__}


def test_parallel_optimizer_is_priced_in_the_memory_term(tmp_path):
    """Under data parallel every weight is replicated 8 ways; the parallel optimizer stores
    its copy and optimizer state 1/8 per device (the gradient stays whole), small ones stay."""
    m = mlp(widths=(256, 256, 256), batch=64, bias=True)
    g = ap.trace(m.loss, *_abstract_args(m))
    state = ap.CLUSTERS["accelerator-8x"].optimizer_state_factor
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel"):
        off = ap.search(g)
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  enable_parallel_optimizer=True):
        on = ap.search(g)
    assert on.pricing.parallel_optimizer_kb == 64 and off.pricing.parallel_optimizer_kb is None
    big = [v for v in g.parameters() if g.spec(v).nbytes >= 64 * 1024]
    assert len(big) == 2  # the two 256 KB weights; the 1 KB biases stay replicated
    # the step's peak (strategies.memory): the copy and state held throughout are 1/8, less
    # the copy gathered for use; the new copy and state the update writes are 1/8 too
    held = sum(g.spec(v).nbytes * ((1 + state) * (1 - 1 / 8) - 1) for v in big)
    written = sum(g.spec(v).nbytes * (1 + state) * (1 - 1 / 8) for v in big)
    assert held < off.cost.memory_bytes - on.cost.memory_bytes <= held + written
    # the same communication volume; each device updates its 1/8 of the large weights
    assert on.cost.gradient_sync == pytest.approx(off.cost.gradient_sync)
    from autopar.strategies.cost import CostModel

    cm = CostModel(ap.CLUSTERS["accelerator-8x"])
    saved = sum(cm.update_time(g.spec(v).nbytes) - cm.update_time(g.spec(v).nbytes / 8)
                for v in big)
    assert off.cost.total - on.cost.total == pytest.approx(saved, rel=1e-9)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  enable_parallel_optimizer=True,
                                  strategy_ckpt_save_file=str(tmp_path / "s.json")):
        plan = ap.search(g, mode="dynamic_programming")
        loaded = ap.load_strategy(tmp_path / "s.json", g)  # under the same threshold
    assert loaded.pricing.parallel_optimizer_kb == 64
    assert loaded.cost.memory_bytes == plan.cost.memory_bytes


def test_unknown_plan_names_suggest_the_closest():
    import jax.numpy as jnp

    g = ap.trace(lambda p, x: jnp.sum(x @ p["w"]), {"w": jnp.ones((8, 8))}, jnp.ones((8, 8)))
    plan = ap.search(g, device_num=8, parallel_mode="data_parallel")
    name = g.parameters()[0]
    with pytest.raises(ap.AutoParallelError, match=f"Did you mean '{name}'"):
        plan.split_counts(name.upper())


def test_compare_modes_keeps_a_newly_registered_mode(monkeypatch):
    import jax.numpy as jnp

    from autopar.strategies.modes import SOLVERS, Solver

    monkeypatch.setitem(SOLVERS, "my_mode", Solver("my_mode", SOLVERS["dynamic_programming"].solve,
                                                   "a copy of dynamic_programming"))
    g = ap.trace(lambda p, x: jnp.sum(x @ p["w"]), {"w": jnp.ones((8, 8))}, jnp.ones((8, 8)))
    rows = ap.compare_modes(g, device_num=8, modes=["my_mode", "dynamic_programming"])
    assert [r.mode for r in rows] == ["dynamic_programming", "my_mode"]


def test_a_registered_solver_is_a_search_mode_everywhere(monkeypatch):
    """One registry: the context, autopar.search and the comparison accept a new solver."""
    import jax.numpy as jnp

    from autopar.strategies.modes import SOLVERS, Solver

    monkeypatch.setitem(SOLVERS, "my_mode", Solver("my_mode", SOLVERS["exact"].solve,
                                                   "the referee again", memory_constraint=True))
    g = ap.trace(lambda p, x: jnp.sum(x @ p["w"]), {"w": jnp.ones((8, 8))}, jnp.ones((8, 8)))
    ap.set_auto_parallel_context(parallel_mode="auto_parallel", device_num=8,
                                 search_mode="my_mode")
    assert ap.search(g).mode == "my_mode"
    ap.set_auto_parallel_context(search_mode="exact")  # autopar's referee, from the context
    assert ap.search(g).mode == "exact"


@pytest.mark.parametrize("fn", [lambda p, x: x, lambda p, x: p, lambda p, x: jnp.ones(3)],
                         ids=["input", "parameter", "constant"])
def test_a_graph_without_operators_is_planned_by_every_exact_and_recursive_mode(fn):
    """recursive_programming raised max()'s ValueError on a graph of no operator."""
    f32 = jax.ShapeDtypeStruct
    g = ap.trace(fn, f32((4,), jnp.float32), f32((8,), jnp.float32))
    objectives = {mode: ap.search(g, mode=mode, cluster="accelerator-8x").objective
                  for mode in ("dynamic_programming", "recursive_programming", "exact")}
    assert len(set(objectives.values())) == 1, objectives
    nothing = ap.trace(lambda: jnp.float32(0.0))  # no input either (exact: scipy's error)
    assert {ap.search(nothing, mode=m).objective for m in objectives} == {0.0}


@pytest.mark.parametrize("call, key", [
    (lambda g, p: ap.search(g, fixed={0: ((2, 1), (1, 4))}), "fixed"),
    (lambda g, p: ap.compare_modes(g, modes=5), "modes"),
    (lambda g, p: ap.compare_modes(g, modes=[["exact"]]), "modes"),
    (lambda g, p: p.split_counts(["w"]), "name"),
])
def test_planner_arguments_of_the_wrong_type_are_typed_errors(call, key):
    """Each raised a raw TypeError from deep inside ('int' object is not iterable,
    unhashable type: 'list')."""
    g = graph("mlp")
    with pytest.raises(ap.AutoParallelTypeError) as info:
        call(g, ap.search(g))
    assert info.value.key == key
