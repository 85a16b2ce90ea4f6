"""One owner per kind: the operator registry and the table of redistribution step kinds.

Every operator kind has every part (primitives, loop nest, FLOPs, local params, gradient
flags, fusion) and a traced example here that runs; every primitive the tracer accepts is in
exactly one kind. Every step kind has every part (layout effect, transpose, pricing,
display) and a lowering rule; the cost model prices each collective it names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import autopar as ap
from autopar.graph import ops
from autopar.graph.ops import KINDS, OPERATORS, op_spec
from autopar.lower import STEP_LOWERING
from autopar.strategies.cost import CLUSTERS, COLLECTIVE_KINDS, CostModel
from autopar.strategies.layout import DeviceMesh, TensorLayout
from autopar.strategies.redistribution import (STEP_KINDS, Step, apply_step_to_layout,
                                               plan_steps, transpose_step)

X = jnp.arange(32.0).reshape(4, 8) / 10


def _conv(x):
    img = x.reshape(1, 1, 4, 8)
    return lax.conv_general_dilated(img, jnp.ones((2, 1, 3, 3)), (1, 1), "SAME")


#: one traced example per operator kind (a new kind adds its line)
EXAMPLES = {
    "elementwise": lambda x: jnp.tanh(x) * 2.0,
    "matmul": lambda x: x @ x.T,
    "conv": _conv,
    "reduce": lambda x: jnp.sum(x, axis=1),
    "broadcast": lambda x: jnp.broadcast_to(x[None], (2, 4, 8)),
    "reshape": lambda x: x.reshape(8, 4),
    "transpose": lambda x: jnp.transpose(x),
    "slice": lambda x: x[:, 2:6],
    "concatenate": lambda x: jnp.concatenate([x, x], axis=1),
    "stack": lambda x: jnp.stack([x, x * 2.0], axis=1),
    "split": lambda x: jnp.split(x, 2, axis=1)[0],
    "cumulative": lambda x: jnp.cumsum(x, axis=1) + jnp.cumsum(x, axis=0),
    "top_k": lambda x: lax.top_k(x, 3)[0] * 2.0,
    "sort": lambda x: jnp.sort(x, axis=1) + jnp.argsort(x, axis=0),
    "pad": lambda x: jnp.pad(x, ((0, 0), (1, 1))),
    "gather": lambda x: x[jnp.array([1, 3])],
    "scatter": lambda x: x.at[jnp.array([2, 0])].set(x[:2] * 2.0),
    "scatter_add": lambda x: jnp.ones((5, 8)).at[jnp.array([1, 3, 1, 4])].add(x),
    "iota": lambda x: x + jnp.arange(8.0),
    "reduce_window": lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2), (1, 2), "VALID"),
    "select_and_scatter": lambda x: jax.grad(lambda h: lax.reduce_window(
        h, -jnp.inf, lax.max, (2, 1), (2, 1), "VALID").sum())(x),
    "identity": lambda x: checkpoint_name(lax.optimization_barrier(x), "x"),
    "bitcast": lambda x: lax.bitcast_convert_type(x, jnp.int32) % 7,
    "random_key": lambda x: jax.random.key_data(jax.random.fold_in(jax.random.key(1), 2)),
    "random_bits": lambda x: x * jax.random.uniform(jax.random.key(0), x.shape),
}


def test_every_operator_kind_has_every_part():
    assert set(EXAMPLES) == set(OPERATORS), "every kind needs a traced example here"
    for name, kind in OPERATORS.items():
        assert kind.name == name and kind.primitives
        assert callable(kind.spec) and callable(kind.flops) and callable(kind.local_params)
        assert kind.no_grad <= set(kind.primitives), name
        assert kind.fusion in ("", "loop", "input"), name


def test_every_primitive_the_tracer_accepts_is_in_exactly_one_kind():
    import importlib

    assert importlib.import_module("autopar.graph.tracer").KINDS is KINDS  # read, not copied
    seen: dict[str, str] = {}
    for kind in OPERATORS.values():
        for p in kind.primitives:
            assert p not in seen, f"{p} is in {seen[p]} and {kind.name}"
            seen[p] = kind.name
    assert seen == KINDS and sorted(seen) == ops.supported_primitives()
    assert not set(KINDS) & (set(ops.INLINED) | set(ops.UNSUPPORTED_HINTS))
    assert ops.NO_GRADIENT == {p for k in OPERATORS.values() for p in k.no_grad}


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_each_kind_traces_specs_and_runs(kind):
    fn = EXAMPLES[kind]
    g = ap.trace(fn, X)
    nodes = [n for n in g.nodes if n.kind == kind]
    assert nodes, f"the example of {kind} traced no {kind} node"
    for n in nodes:
        spec = op_spec(n, g)
        assert len(spec.in_maps) == len(n.inputs) or kind == "iota"
        for mp, v in zip(spec.in_maps, n.inputs):
            assert len(mp) in (0, g.spec(v).rank)
        for mp, v in zip(spec.out_maps, n.outputs):
            assert len(mp) == g.spec(v).rank
        assert all(0 <= d < len(spec.sizes) for d in spec.fixed + spec.summed)
        assert n.flops >= 0
        shapes = [(g.spec(v).shape, g.spec(v).shape) for v in n.inputs]
        outs = [(g.spec(v).shape, g.spec(v).shape) for v in n.outputs]
        params = dict(n.params)
        assert OPERATORS[kind].local_params(dict(params), shapes, outs).keys() == params.keys()
    with ap.auto_parallel_context(device_num=2, parallel_mode="auto_parallel"):
        f = ap.parallelize(fn, X)
    np.testing.assert_allclose(np.asarray(f(X)), np.asarray(jax.jit(fn)(X)), rtol=1e-5)


# ---------------------------------------------------------------------------- step kinds

MESH = DeviceMesh.for_devices(8)
#: per step kind a (source, target) layout pair whose plan is exactly one step of it
ONE_STEP = {
    "all_reduce": (TensorLayout(((), ()), ("a0",)), TensorLayout(((), ()))),
    "reduce_scatter": (TensorLayout(((), ()), ("a0",)), TensorLayout((("a0",), ()))),
    "all_gather": (TensorLayout((("a0",), ())), TensorLayout(((), ()))),
    "all_to_all": (TensorLayout((("a0",), ())), TensorLayout(((), ("a0",)))),
    "slice": (TensorLayout(((), ())), TensorLayout(((), ("a1",)))),
}


def test_every_step_kind_has_every_part():
    assert set(ONE_STEP) == set(STEP_KINDS), "every step kind needs an example here"
    assert set(STEP_LOWERING) == set(STEP_KINDS), "every step kind needs a lax rule"
    for name, kind in STEP_KINDS.items():
        assert kind.name == name and kind.display and kind.effect
        assert kind.collective is None or kind.collective in COLLECTIVE_KINDS, name
        src, dst = ONE_STEP[name]
        (step,) = plan_steps(src, dst, MESH, name == "all_to_all")
        assert step.kind == name
        assert apply_step_to_layout(src, step) == dst
        back = transpose_step(step)
        assert back is None or back.kind in STEP_KINDS
        if back is not None and not src.partial:  # backward undoes the forward's layout
            assert apply_step_to_layout(dst, back) == src


def test_the_cost_model_prices_steps_by_their_collective():
    cm = CostModel(CLUSTERS["accelerator-8x"])
    for name, kind in STEP_KINDS.items():
        step = Step(name, ("a0",), 0, src_dim=1, nbytes=1 << 20)
        t = cm.step_time(step, MESH)
        assert (t > 0) == (kind.collective is not None), name
        if kind.collective is not None:
            assert t == cm.collective_time(kind.collective, 1 << 20, 2, intra=True)


def test_step_display_names():
    pg_names = {k.display for k in STEP_KINDS.values()}
    assert pg_names == {"AllReduce", "ReduceScatter", "AllGather", "AlltoAll", "StridedSlice"}
    assert str(Step("all_to_all", ("a0",), 0, src_dim=1)) == "all_to_all[a0] dim 1->0"
    assert str(Step("all_reduce", ("a0", "a1"))) == "all_reduce[a0,a1]"


def test_docs_graph_lists_every_supported_primitive_under_its_kind():
    """docs/graph.md's operator table is the registry: every (kind, primitive) pair the
    tracer accepts, and no other (a parenthesised note's names aside)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "graph.md").read_text()
    table = text.split("## Supported operators", 1)[1].split("\n\n")[1]
    listed = set()
    for row in table.splitlines()[2:]:
        _, kind, prims, *_ = row.split("|")
        listed |= {(kind.strip(), p) for p in
                   re.findall(r"`([^`]+)`", re.sub(r"\(.*\)", "", prims))}
    assert listed == {(k, p) for p, k in KINDS.items()}
