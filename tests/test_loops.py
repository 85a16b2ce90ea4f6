"""Loops as loops: a scan is one loop node, planned once, priced x its trip count, lowered as
one lax.scan inside the shard_map (autopar/graph/loops.py, strategies/loops.py,
autopar/lower_loops.py).

Three loops: an MLP stack written with ``lax.scan`` over stacked weights, a flax.linen
``nn.scan`` over decoder-ish blocks, a ``fori_loop`` indexing stacked weights. Each traces to
one loop node whose body is traced once, runs parallelised on 8 devices and trains one SGD
step within the float64 bound of tests/numerics.py, and lowers to one loop (not one copy of
the body per iteration).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import autopar as ap
import numerics
from autopar.checkpoint import load_strategy, save_strategy
from autopar.graph.loops import loop_body, loop_nodes
from autopar.strategies.cost import CostModel, get_cluster
from autopar.strategies.loops import loop_time
from autopar.strategies.modes import SEARCH_MODES

KEY = jax.random.key(0)


# ----------------------------------------------------------------------------- models


def mlp_scan(layers: int = 4, hidden: int = 16, batch: int = 8):
    """An input projection, then ``layers`` residual MLP blocks by lax.scan over stacked
    weights, then a mean square."""
    k = jax.random.split(KEY, 4)
    params = {"w_in": jax.random.normal(k[0], (8, hidden)) / 3,
              "w1": jax.random.normal(k[1], (layers, hidden, 2 * hidden)) / 4,
              "w2": jax.random.normal(k[2], (layers, 2 * hidden, hidden)) / 6}
    x = jax.random.normal(k[3], (batch, 8))

    def loss(p, x):
        def block(h, w):
            w1, w2 = w
            return h + jnp.tanh(h @ w1) @ w2, None

        h, _ = lax.scan(block, x @ p["w_in"], (p["w1"], p["w2"]))
        return jnp.mean(h ** 2)

    return loss, params, (x,)


class Block(nn.Module):
    """A pre-LN decoder-ish block: causal self-attention and an MLP, each residual."""

    hidden: int
    heads: int = 2

    @nn.compact
    def __call__(self, x, _):
        b, s, h = x.shape
        d = h // self.heads
        a = nn.LayerNorm()(x)
        qkv = nn.Dense(3 * h, use_bias=False)(a).reshape(b, s, 3, self.heads, d)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        mask = np.tril(np.ones((s, s), bool))
        scores = jnp.where(mask, scores, -1e9)
        w = jnp.exp(scores - scores.max(-1, keepdims=True))
        w = w / w.sum(-1, keepdims=True)
        c = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, h)
        x = x + nn.Dense(h, use_bias=False)(c)
        m = nn.LayerNorm()(x)
        return x + nn.Dense(h)(jnp.tanh(nn.Dense(2 * h)(m))), None


class Decoder(nn.Module):
    hidden: int
    layers: int

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=self.layers)
        x, _ = blocks(self.hidden)(x, None)
        return x


def flax_scan(layers: int = 4, hidden: int = 16, batch: int = 8, seq: int = 8):
    model = Decoder(hidden, layers)
    x = jax.random.normal(jax.random.key(1), (batch, seq, hidden))
    params = model.init(KEY, x)["params"]

    def loss(p, x):
        return jnp.mean(model.apply({"params": p}, x) ** 2)

    return loss, params, (x,)


def fori(layers: int = 3, hidden: int = 16, batch: int = 8):
    k = jax.random.split(KEY, 2)
    w = jax.random.normal(k[0], (layers, hidden, hidden)) / 4
    x = jax.random.normal(k[1], (batch, hidden))

    def loss(w, x):
        h = lax.fori_loop(0, layers, lambda i, h: jnp.tanh(h @ w[i]) + h, x)
        return jnp.mean(h ** 2)

    return loss, w, (x,)


MODELS = {"mlp_scan": mlp_scan, "flax_scan": flax_scan, "fori": fori}


def _context(**kw):
    return ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                    gradients_mean=True, **kw)


# ----------------------------------------------------------------------------- trace


@pytest.mark.parametrize("name", MODELS)
def test_a_loop_is_one_node_its_body_traced_once(name):
    loss, params, batch = MODELS[name]()
    g = ap.trace(loss, params, *batch)
    loops = loop_nodes(g)
    assert len(loops) == 1 and loops[0].op == "scan" and loops[0].kind == "loop"
    body = loop_body(loops[0])
    deeper = MODELS[name](layers=2 * body.length)
    g2 = ap.trace(deeper[0], deeper[1], *deeper[2])
    body2 = loop_body(loop_nodes(g2)[0])
    assert body2.length == 2 * body.length
    assert len(g2.nodes) == len(g.nodes) and len(body2.graph.nodes) == len(body.graph.nodes)
    assert loops[0].flops == body.length * body.graph.total_flops
    assert g.fingerprint() != g2.fingerprint()
    assert g.fingerprint() == ap.trace(loss, params, *batch).fingerprint()


def test_body_inputs_are_constants_carries_and_slices():
    loss, params, batch = mlp_scan()
    g = ap.trace(loss, params, *batch)
    body = loop_body(loop_nodes(g)[0])
    kinds = [body.graph.values[v].kind for v in body.graph.inputs]
    assert [body.role(k) for k in range(len(kinds))] == ["carry", "xs", "xs"]
    assert kinds == ["data", "param", "param"]  # the stacked weights' slices are parameters
    w1 = body.graph.inputs[1]
    assert body.graph.spec(w1).shape == params["w1"].shape[1:]


# ----------------------------------------------------------------------------- run


@pytest.mark.parametrize("name", MODELS)
def test_parallelize_and_train_step_are_exact_with_one_loop(name):
    loss, params, batch = MODELS[name]()
    with _context():
        f = ap.parallelize(loss, params, *batch)
        step = ap.train_step(loss, params, batch, optax.sgd(0.1))
    numerics.assert_close(f(params, *batch), loss, params, *batch)
    state = step.init(params)
    new, _, value = step(params, state, *batch)
    ref = numerics.reference(numerics.optimizer_steps(loss, optax.sgd(0.1), 1), params,
                             *batch, jit=False)
    numerics.check((new, [value]), ref, "train step")
    # one loop in the program (its transpose in the step's backward), not one per layer
    assert f.as_text(params, *batch).count("stablehlo.while") == 1
    assert step.lower(params, state, *batch).as_text().count("stablehlo.while") == 2


def test_program_size_is_flat_in_depth():
    sizes = []
    for layers in (4, 16):
        loss, params, batch = mlp_scan(layers=layers)
        with _context():
            f = ap.parallelize(loss, params, *batch)
        text = f.as_text(params, *batch)
        sizes.append((text.count("stablehlo.while"), text.count("stablehlo.dot_general")))
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("mode", SEARCH_MODES)
def test_every_search_mode_plans_and_runs_a_loop(mode):
    loss, params, batch = mlp_scan()
    g = ap.trace(loss, params, *batch)
    fixed = {"integer_pow_0": ((8, 1),)} if mode == "sharding_propagation" else None
    with _context(search_mode=mode):
        plan = ap.search(g, fixed=fixed)
        f = ap.parallelize(loss, params, *batch, fixed=fixed)
    assert plan.nodes["scan_0"].body is not None and plan.mode == mode
    assert f.plan.decisions() == plan.decisions()
    numerics.assert_close(f(params, *batch), loss, params, *batch)


@pytest.mark.parametrize("mode", SEARCH_MODES)
def test_a_plan_splitting_the_body_is_exact(mode):
    """Megatron inside the body (the first matmul column-split, fixed by its body name):
    the weights' slices are split every iteration, forward and gradients exact."""
    loss, params, batch = mlp_scan()
    fixed = {"scan_0/dot_general_0": ((1, 1), (1, 8))}
    with _context(search_mode=mode):
        f = ap.parallelize(loss, params, *batch, fixed=fixed)
        step = ap.train_step(loss, params, batch, optax.sgd(0.1), fixed=fixed)
    body = f.plan.nodes["scan_0"].body
    assert body.nodes["dot_general_0"].strategy == ((1, 1), (1, 8))
    assert f.plan.split_counts("p/w1")[1:] == (1, 8)  # stored as each slice is read
    assert step.plan.decisions() == f.plan.decisions()
    numerics.assert_close(f(params, *batch), loss, params, *batch)
    state = step.init(params)
    new, _, value = step(params, state, *batch)
    ref = numerics.reference(numerics.optimizer_steps(loss, optax.sgd(0.1), 1), params,
                             *batch, jit=False)
    numerics.check((new, [value]), ref, "train step")


def test_derived_parallel_modes_split_the_loop_by_its_batch():
    loss, params, batch = flax_scan()
    for pmode in ("data_parallel", "semi_auto_parallel"):
        with ap.auto_parallel_context(device_num=8, parallel_mode=pmode):
            f = ap.parallelize(loss, params, *batch)
        name = loop_nodes(f.graph)[0].name
        assert f.plan.nodes[name].splits[:3] == (8, 1, 1)  # the carry's batch dim
        numerics.assert_close(f(params, *batch), loss, params, *batch)


def test_reverse_and_unroll_are_honoured():
    k = jax.random.split(KEY, 2)
    w, x = jax.random.normal(k[0], (4, 16, 16)) / 4, jax.random.normal(k[1], (8, 16))

    def loss(w, x):
        def block(h, wi):
            h = jnp.tanh(h @ wi)
            return h, h.sum(axis=1)

        h, ys = lax.scan(block, x, w, reverse=True, unroll=2)
        return jnp.mean(h ** 2) + jnp.mean(ys[0] * ys[-1])

    g = ap.trace(loss, w, x)
    node = loop_nodes(g)[0]
    assert node.params["reverse"] is True and node.params["unroll"] == 2
    with _context():
        f = ap.parallelize(loss, w, x)
    numerics.assert_close(f(w, x), loss, w, x)
    numerics.assert_close(jax.grad(f)(w, x), jax.grad(loss), w, x)


def test_nested_loops_are_planned_and_exact():
    k = jax.random.split(KEY, 2)
    w, x = jax.random.normal(k[0], (2, 3, 16, 16)) / 4, jax.random.normal(k[1], (8, 16))

    def loss(w, x):
        def outer(h, wo):
            return lax.scan(lambda h, wi: (jnp.tanh(h @ wi) + h, None), h, wo)[0], None

        return jnp.mean(lax.scan(outer, x, w)[0] ** 2)

    g = ap.trace(loss, w, x)
    inner = loop_nodes(loop_body(loop_nodes(g)[0]).graph)
    assert len(loop_nodes(g)) == 1 and len(inner) == 1
    with _context():
        f = ap.parallelize(loss, w, x, fixed={"scan_0/scan_0/dot_general_0":
                                              ((1, 1), (1, 8))})
    inner_plan = f.plan.nodes["scan_0"].body.nodes["scan_0"].body
    assert inner_plan.nodes["dot_general_0"].strategy == ((1, 1), (1, 8))
    numerics.assert_close(f(w, x), loss, w, x)
    numerics.assert_close(jax.grad(f)(w, x), jax.grad(loss), w, x)


# ----------------------------------------------------------------------------- pricing


def test_the_loop_is_priced_as_its_body_times_its_trip_count():
    prices = []
    for layers in (4, 8):
        loss, params, batch = mlp_scan(layers=layers)
        g = ap.trace(loss, params, *batch)
        fixed = {"scan_0/dot_general_0": ((1, 1), (1, 8))}
        with _context():
            plan = ap.search(g, fixed=fixed)
        node = loop_nodes(g)[0]
        cm = CostModel(get_cluster(plan.cluster))
        body_time = loop_time(cm, node, plan.nodes["scan_0"].body, plan.mesh)
        trace = ap.simulation.simulate(g, plan)
        assert trace.node_times[trace.node_names.index("scan_0")] == pytest.approx(body_time)
        prices.append((body_time, plan.cost.communication))
    (t4, c4), (t8, c8) = prices
    assert t8 == pytest.approx(2 * t4) and c8 == pytest.approx(2 * c4)


def test_explain_print_and_inspect_a_loop():
    loss, params, batch = mlp_scan()
    g = ap.trace(loss, params, *batch)
    fixed = {"scan_0/dot_general_0": ((1, 1), (1, 8))}
    with _context():
        plan = ap.search(g, fixed=fixed)
        text = str(ap.explain(g, plan, "scan_0"))
        other = ap.explain(g, plan, "integer_pow_0")
        f = ap.parallelize(loss, params, *batch, fixed=fixed)
    assert "scan_0 (scan)" in text and other.chosen.objective == pytest.approx(plan.objective)
    assert "body of loop scan_0" in str(plan) and "body of loop scan_0" in str(f.parallel_graph)
    counts = f.collective_counts(params, *batch)  # the body's collectives, once
    assert counts["all_reduce"] + counts["reduce_scatter"] >= 1
    assert "while" in f.compiled_text(params, *batch)


# ----------------------------------------------------------------------------- files


def test_strategy_files_round_trip_byte_identical(tmp_path):
    loss, params, batch = flax_scan()
    g = ap.trace(loss, params, *batch)
    name = loop_nodes(g)[0].name  # Megatron's column split of the attention's projection
    fixed = {f"{name}/ScanBlock_0/Dense_0/dot_general_0": ((1, 1, 1), (1, 8))}
    with _context():
        for fix in (None, fixed):
            plan = ap.search(g, fixed=fix)
            first = save_strategy(plan, g, tmp_path / "a.json").read_bytes()
            again = load_strategy(tmp_path / "a.json", g)
            assert (again.nodes, again.layouts, again.cost) == \
                (plan.nodes, plan.layouts, plan.cost)
            assert save_strategy(again, g, tmp_path / "b.json").read_bytes() == first
            twice = ap.search(g, fixed=fix)  # the same inputs, the same plan and bytes
            assert save_strategy(twice, g, tmp_path / "c.json").read_bytes() == first


def test_a_strategy_file_contradicting_its_body_plan_is_refused(tmp_path):
    import json

    loss, params, batch = mlp_scan()
    g = ap.trace(loss, params, *batch)
    with _context():
        plan = ap.search(g, fixed={"scan_0/dot_general_0": ((1, 1), (1, 8))})
        path = save_strategy(plan, g, tmp_path / "s.json")
        doc = json.loads(path.read_text())
        body = doc["parallel_strategy_item"]["scan_0"]["body"]
        body["parallel_strategy_item"]["dot_general_0"]["splits"] = [1, 1, 3]
        path.write_text(json.dumps(doc))
        with pytest.raises(ap.AutoParallelError, match="scan_0.body.parallel_strategy_item"):
            load_strategy(path, g)
        del doc["parallel_strategy_item"]["scan_0"]["body"]
        path.write_text(json.dumps(doc))
        with pytest.raises(ap.AutoParallelError, match="scan_0.body"):
            load_strategy(path, g)


# ----------------------------------------------------------------------------- refusals


def test_pipelining_a_loop_is_refused_naming_it():
    loss, params, batch = mlp_scan()
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  pipeline_stages=2):
        with pytest.raises(ap.AutoParallelError, match="loop node.*scan_0.*pipeline"):
            ap.train_step(loss, params, batch)


def _while(layers: int = 3, hidden: int = 16, batch: int = 8):
    """``lax.while_loop`` counting ``i`` from 0 to ``layers`` over stacked weights, and its
    ``fori_loop`` twin (static bounds: a scan, differentiable by jax.grad)."""
    k = jax.random.split(KEY, 2)
    w = jax.random.normal(k[0], (layers, hidden, hidden)) / 4
    x = jax.random.normal(k[1], (batch, hidden))

    def loss(w, x):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w[i]) + h
        return jnp.mean(lax.while_loop(lambda c: c[0] < layers, body, (0, x))[1] ** 2)

    def twin(w, x):
        return jnp.mean(lax.fori_loop(0, layers, lambda i, h: jnp.tanh(h @ w[i]) + h, x) ** 2)

    return loss, twin, w, x


def test_a_counted_while_is_a_loop_planned_and_exact():
    loss, twin, w, x = _while()
    g = ap.trace(loss, w, x)
    (node,) = loop_nodes(g)
    assert node.op == "while" and loop_body(node).length == 3
    deeper = ap.trace(_while(layers=6)[0], *_while(layers=6)[2:])
    assert len(deeper.nodes) == len(g.nodes) and \
        len(loop_body(loop_nodes(deeper)[0]).graph.nodes) == len(loop_body(node).graph.nodes)
    with _context():
        f = ap.parallelize(loss, w, x, fixed={"while_0/dot_general_0": ((1, 1), (1, 8))})
        step = ap.train_step(loss, w, (x,), optax.sgd(0.1))
    numerics.assert_close(f(w, x), loss, w, x)
    numerics.assert_close(jax.grad(f)(w, x), jax.grad(twin), w, x)  # (jax.grad refuses a while)
    new, _, value = step(w, step.init(w), x)
    ref = numerics.reference(numerics.optimizer_steps(twin, optax.sgd(0.1), 1), w, x, jit=False)
    numerics.check((new, [value]), ref, "train step")
    assert f.as_text(w, x).count("stablehlo.while") == 1


@pytest.mark.parametrize("cond, length", [
    (lambda c: c[0] < 7, 7), (lambda c: 7 > c[0], 7), (lambda c: c[0] <= 7, 8),
    (lambda c: c[0] != 6, 6), (lambda c: c[0] < 0, 0)])
def test_the_trip_count_of_a_while_is_read_from_its_condition(cond, length):
    def f(x):
        return lax.while_loop(cond, lambda c: (c[0] + 1, jnp.tanh(c[1])), (0, x))[1].sum()

    def bounded(x):  # fori_loop with array bounds: JAX lowers it to a while
        return lax.fori_loop(jnp.int32(2), jnp.int32(2 + length), lambda i, h: h * 0.5, x).sum()

    for fn in (f, bounded):
        assert loop_body(loop_nodes(ap.trace(fn, jnp.ones(4)))[0]).length == length


def test_a_while_of_unknown_trip_count_is_refused_at_the_users_line():
    def f(x, n):
        return lax.fori_loop(0, n, lambda i, h: jnp.tanh(h), x).sum()

    with pytest.raises(ap.UnsupportedOperatorError,
                       match=r"'while' at .*test_loops.py:\d+ \(.*f\).*trip count known"):
        ap.trace(f, jnp.ones(4), 3)


def _cond():
    k = jax.random.split(KEY, 3)
    p = {"w": jax.random.normal(k[0], (16, 16)) / 4, "v": jax.random.normal(k[1], (16, 16)) / 4}
    x = jax.random.normal(k[2], (8, 16))

    def loss(p, x):
        h = lax.cond(x.sum() > 0, lambda h: jnp.tanh(h @ p["w"]),
                     lambda h: h * 2.0 + (h @ p["v"]) @ p["w"], x)
        return jnp.mean(h ** 2)

    return loss, p, x


@pytest.mark.parametrize("pmode", ["auto_parallel", "data_parallel"])
def test_a_cond_plans_both_branches_runs_one_and_is_exact(pmode):
    """Both branches planned (Megatron in branch 1 when fixed), the predicate made the same
    on every device (data parallel: the sum of a split batch, all-reduced), the taken branch
    run by one lax.switch; forward, gradients and a training step exact for either sign."""
    loss, p, x = _cond()
    g = ap.trace(loss, p, x)
    (node,) = loop_nodes(g)
    body = loop_body(node)
    assert node.op == "cond" and len(body.branches) == 2
    assert node.flops == max(sum(body.graph.node(n).flops for n in names)
                             for names, _ in body.branches)
    fixed = {"cond_0/branch1/dot_general_0": ((1, 1), (1, 8))} \
        if pmode == "auto_parallel" else None
    with ap.auto_parallel_context(device_num=8, parallel_mode=pmode, gradients_mean=True):
        f = ap.parallelize(loss, p, x, fixed=fixed)
        step = ap.train_step(loss, p, (x,), optax.sgd(0.1), fixed=fixed)
    assert f.plan.nodes["cond_0"].body is not None
    assert f.as_text(p, x).count("stablehlo.case") == 1
    for xx in (x, -x):
        numerics.assert_close(f(p, xx), loss, p, xx)
        numerics.assert_close(jax.grad(f)(p, xx), jax.grad(loss), p, xx)
        new, _, value = step(p, step.init(p), xx)
        ref = numerics.reference(numerics.optimizer_steps(loss, optax.sgd(0.1), 1), p, xx,
                                 jit=False)
        numerics.check((new, [value]), ref, "train step")


def test_a_cond_is_priced_as_its_dearer_branch_and_switch_runs():
    k = jax.random.split(KEY, 2)
    w, x = jax.random.normal(k[0], (16, 16)) / 4, jax.random.normal(k[1], (8, 16))

    def loss(w, i, x):
        return jnp.mean(lax.switch(i, [lambda h: h, lambda h: jnp.sin(h @ w),
                                       lambda h: (h @ w) @ w], x) ** 2)

    def light(w, i, x):
        return jnp.mean(lax.switch(i, [lambda h: h, lambda h: jnp.sin(h)], x) ** 2)

    i = jnp.int32(2)
    with _context():
        plans = [ap.search(ap.trace(fn, w, i, x)) for fn in (loss, light)]
        f = ap.parallelize(loss, w, i, x)
    assert plans[0].nodes["cond_0"].body is not None
    assert plans[0].cost.compute > plans[1].cost.compute
    for j in range(3):
        numerics.assert_close(f(w, jnp.int32(j), x), loss, w, jnp.int32(j), x)


def test_a_split_predicate_is_refused_typed():
    import dataclasses

    from autopar.rewrite import rewrite
    from autopar.strategies.layout import TensorLayout

    loss, p, x = _cond()
    g = ap.trace(loss, p, x)
    with _context():
        plan = ap.search(g)
    ns = plan.nodes["cond_0"]
    bad = dataclasses.replace(ns, in_layouts=(TensorLayout((), ("a0",)),) + ns.in_layouts[1:])
    plan = dataclasses.replace(plan, nodes={**plan.nodes, "cond_0": bad})
    with pytest.raises(ap.AutoParallelError, match="predicate of cond node 'cond_0'.*"
                                                   "replicated"):
        rewrite(g, plan)


def test_a_scan_of_another_jax_version_is_a_typed_error():
    from autopar.graph.loops import _check_params

    with pytest.raises(ap.AutoParallelError, match="num_consts.*jax 0.10"):
        _check_params({"jaxpr": None, "length": 2, "num_carry": 1}, "model.py:3")
