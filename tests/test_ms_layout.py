"""MindSpore's shard / Layout habits (issue 17 item 2): keyword ``shard``, the public
``Layout`` with alias tensor maps, Layouts in ``fixed=``, ``parameter_plan``, named meshes.

The tensor maps are MindSpore's documented ones (``mindspore/parallel/shard.py``, the
``Layout`` docstring and ``__call__``: index counted from the right, ``"None"`` -> -1).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
from autopar.errors import AutoParallelError, AutoParallelTypeError, AutoParallelWarning
import numerics


def _loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def _args():
    k = jax.random.split(jax.random.key(3), 3)
    params = {"w1": jax.random.normal(k[0], (16, 32)) / 4,
              "w2": jax.random.normal(k[1], (32, 8)) / 6}
    return params, jax.random.normal(k[2], (8, 16))


# ------------------------------------------------------------------ Layout


def test_layout_tensor_maps_match_mindspore_docstring():
    layout = ap.Layout((2, 2, 2), ("dp", "sp", "mp"))
    assert layout("dp", "mp").to_dict() == {"device_matrix": (2, 2, 2), "tensor_map": (2, 0),
                                            "interleaved_parallel": False}
    assert layout(("dp", "mp"), "sp").to_dict()["tensor_map"] == ((2, 0), 1)
    assert layout("None", ("sp", "None")).to_dict()["tensor_map"] == (-1, (1, -1))
    assert layout(("dp", "mp"), "None").split_counts() == (4, 1)
    assert layout("sp", "None", "mp").split_counts() == (2, 1, 2)
    # calling a layout leaves it reusable (MindSpore returns a copy)
    assert layout("mp").tensor_map == (0,) and layout("dp").tensor_map == (2,)


def test_layout_interleaved_is_described_then_refused_for_splits():
    layout = ap.Layout((2, 2, 2), ("dp", "sp", "interleaved_parallel"))
    lay = layout(("dp", "interleaved_parallel"), "sp")
    assert lay.to_dict() == {"device_matrix": (2, 2, 2), "tensor_map": ((2, 0), 1),
                             "interleaved_parallel": True}
    with pytest.raises(AutoParallelError, match="interleaved_parallel"):
        lay.split_counts()
    with pytest.raises(AutoParallelError, match="interleaved_parallel"):
        ap.shard(jnp.matmul, in_strategy=(lay, lay))


@pytest.mark.parametrize("args, error, words", [
    (([2, 4], ("dp", "mp")), AutoParallelTypeError, "device_matrix"),
    (((2, 4), ["dp", "mp"]), AutoParallelTypeError, "alias_name"),
    (((2, 4), ("dp",)), AutoParallelError, "one name per axis"),
    (((2, 4.0), ("dp", "mp")), AutoParallelTypeError, "ints"),
    (((2, 4), ("dp", 1)), AutoParallelTypeError, "str"),
    (((2, 4), ("dp", "")), AutoParallelError, "cannot name"),
    (((2, 4), ("dp", "None")), AutoParallelError, "'None'"),
    (((2, 4), ("dp", "dp")), AutoParallelError, "different"),
    (((2, 2, 2), ("interleaved_parallel", "a", "b")), AutoParallelError, "last"),
])
def test_layout_constructor_errors_are_typed(args, error, words):
    with pytest.raises(error, match=words):
        ap.Layout(*args)


def test_layout_call_errors_are_typed():
    layout = ap.Layout((2, 4), ("dp", "mp"))
    with pytest.raises(ValueError, match="not an axis"):
        layout("dp", "tp")
    with pytest.raises(AutoParallelError, match="only once"):
        layout("dp", "dp")
    with pytest.raises(AutoParallelError, match="only once"):
        layout(("dp", "mp"), "mp")
    with pytest.raises(AutoParallelError, match="tensor map is not set"):
        layout.to_dict()


# ------------------------------------------------------------------ shard


def test_keyword_shard_with_tuples_and_layouts():
    lay = ap.Layout((2, 4), ("dp", "mp"))

    def f(x, w, v):
        h = ap.shard(jnp.matmul, in_strategy=(lay("dp", "None"), lay("None", "mp")))(x, w)
        return ap.shard(fn=lambda a, b: a @ b, in_strategy=((2, 4), (4, 1)), device="GPU",
                        level=0)(h, v)

    g = ap.trace(f, jnp.ones((8, 16)), jnp.ones((16, 32)), jnp.ones((32, 8)))
    assert g.annotations() == {"dot_general_0": ((2, 1), (1, 4)),
                               "dot_general_1": ((2, 4), (4, 1))}
    # the old positional form still works
    g2 = ap.trace(lambda x, y: ap.shard(jnp.add, ((2, 1), (2, 1)))(x, y),
                  jnp.ones((32, 10)), jnp.ones((32, 10)))
    assert g2.annotations() == {"add_0": ((2, 1), (2, 1))}


def test_mindspore_shard_docstring_example_runs():
    """``ms.shard(test_shard, in_strategy=((2, 1), (2, 1)))(x, y)`` on 2 devices."""
    ap.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=2)

    def test_shard(x, y):
        return x + y

    x = np.ones((32, 10), np.float32)
    f = ap.parallelize(lambda x, y: ap.shard(test_shard, in_strategy=((2, 1), (2, 1)))(x, y),
                       x, x)
    assert f.plan.strategy("add_0") == ((2, 1), (2, 1))
    assert f(x, x).shape == (32, 10)
    np.testing.assert_array_equal(np.asarray(f(x, x)), 2 * x)


def test_out_strategy_is_checked_and_warned():
    with pytest.warns(AutoParallelWarning, match="out_strategy is checked but not enforced"):
        ap.shard(jnp.matmul, in_strategy=((2, 4), (4, 1)), out_strategy=((8, 1),))
    with pytest.raises(AutoParallelTypeError, match="out_strategy"):
        ap.shard(jnp.matmul, in_strategy=((2, 4), (4, 1)), out_strategy=[(8, 1)])


@pytest.mark.parametrize("kwargs, error, words", [
    ({"in_strategy": ((2, 1), None)}, AutoParallelError, "None"),
    ({"in_strategy": ((2, 1), (1, 4)), "device": 0}, AutoParallelTypeError, "device"),
    ({"in_strategy": ((2, 1), (1, 4)), "level": True}, AutoParallelTypeError, "level"),
    ({"in_strategy": ((2, 1), (1, 4)), "parameter_plan": [("w", (1, 2))]},
     AutoParallelTypeError, "parameter_plan"),
    ({"in_strategy": ((2, 1), (1, 4)), "parameter_plan": {"w": (0, 2)}},
     AutoParallelError, ">= 1"),
])
def test_shard_errors_are_typed(kwargs, error, words):
    with pytest.raises(error, match=words):
        ap.shard(jnp.matmul, **kwargs)


# ------------------------------------------------------------------ fixed=


def test_layout_in_fixed_and_device_matrix_checked_against_device_num():
    params, x = _args()
    ap.set_auto_parallel_context(parallel_mode="auto_parallel")
    g = ap.trace(_loss, params, x)
    lay = ap.Layout((2, 4), ("dp", "mp"))
    plan = ap.search(g, mode="sharding_propagation", device_num=8,
                     fixed={"dot_general_0": (lay("dp", "None"), lay("None", "mp"))})
    assert plan.strategy("dot_general_0") == ((2, 1), (1, 4))
    assert plan.split_counts("params/w1") == (1, 4)
    small = ap.Layout((2, 2), ("dp", "mp"))
    with pytest.raises(AutoParallelError, match="device_num=8"):
        ap.search(g, mode="sharding_propagation", device_num=8,
                  fixed={"dot_general_0": (small("dp", "None"), small("None", "mp"))})


def _laid_out_loss(lay):
    """The loss with its first matmul sharded by Layout ``lay`` and w2 planned by it."""
    def loss(p, x):
        h = ap.shard(jnp.matmul, in_strategy=(lay("dp", "None"), lay("None", "mp")),
                     parameter_plan={"w2": lay("mp", "None")})(x, p["w1"])
        return jnp.mean((jnp.tanh(h) @ p["w2"]) ** 2)
    return loss


def test_layouts_given_to_shard_and_annotate_are_checked_against_device_num():
    # (a 4-device Layout in shard() or annotate() was planned as 2-way splits on 8 devices)
    params, x = _args()
    small = ap.Layout((2, 2), ("dp", "mp"))
    g = ap.trace(_laid_out_loss(small), params, x)
    assert g.layout_devices == {"dot_general_0": 4, "p/w2": 4}
    annotated = ap.trace(_loss, params, x).annotate(
        {"dot_general_0": (small("dp", "None"), small("None", "mp"))})
    for graph in (g, annotated):
        with pytest.raises(AutoParallelError, match="4 devices; it must have device_num=8"):
            ap.search(graph, device_num=8, parallel_mode="semi_auto_parallel")
        plan = ap.search(graph, device_num=4, parallel_mode="semi_auto_parallel")
        assert plan.strategy("dot_general_0") == ((2, 1), (1, 2))
    with pytest.raises(AutoParallelError, match="different device counts"):
        ap.shard(jnp.matmul, in_strategy=(small("dp", "None"),
                                          ap.Layout((2, 4), ("dp", "mp"))("None", "mp")))


def test_a_parameter_plan_registered_again_is_not_kept_again():
    from autopar.graph import annotate
    ap.shard(jnp.matmul, ((1, 1), (1, 1)), parameter_plan={"w": (2, 1)})
    kept = len(annotate._PLANS)
    for _ in range(50):  # (a shard inside the traced function runs at every trace)
        ap.shard(jnp.matmul, ((1, 1), (1, 1)), parameter_plan={"w": (2, 1)})
    assert len(annotate._PLANS) == kept


# ------------------------------------------------------------------ parameter_plan


def _planned_loss(parameter_plan):
    def loss(params, x):
        h = jnp.tanh(x @ params["w1"])
        out = ap.shard(jnp.matmul, in_strategy=((2, 4), (4, 1)),
                       parameter_plan=parameter_plan)(h, params["w2"])
        return jnp.mean(out ** 2)
    return loss


def test_parameter_plan_fixes_only_the_parameter():
    """MindSpore's semantics: the plan sets the parameter's own layout (here one read by a
    matmul outside the wrapped function); the operators reading it are searched as usual and
    read it through a redistribution where they want another layout."""
    params, x = _args()
    ap.set_auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel")
    lay = ap.Layout((2, 4), ("dp", "mp"))
    g = ap.trace(_planned_loss({"w1": lay("None", "mp"), "self.w2": (1, 1)}), params, x)
    assert g.annotations() == {"dot_general_1": ((2, 4), (4, 1))}  # readers stay free
    assert g.parameter_layouts() == {"params/w1": (1, 4), "params/w2": (1, 1)}
    plan = ap.search(g)
    assert plan.split_counts("params/w1") == (1, 4)
    assert plan.strategy("dot_general_0") == ((8, 1), (1, 1))  # data parallel reads it whole
    assert plan.split_counts("params/w2") == (1, 1)  # stored whole, read (4, 1) by its matmul
    assert plan.strategy("dot_general_1") == ((2, 4), (4, 1))
    with pytest.warns(AutoParallelWarning, match="no parameter 'nope'"):
        ap.trace(_planned_loss({"nope": (2, 1)}), params, x)
    with pytest.raises(AutoParallelError, match="one split count per dimension"):
        ap.trace(_planned_loss({"w1": (2,)}), params, x)
    with pytest.raises(AutoParallelError, match="one split count per dimension"):
        ap.trace(_planned_loss({"w1": (3, 1)}), params, x)  # 3 does not divide 16
    with pytest.raises(AutoParallelError, match="divisor of device_num=8"):
        ap.search(ap.trace(_planned_loss({"w1": (1, 16)}), params, x))


def test_parameter_plan_leaves_the_search_free():
    """Under auto_parallel the readers of a planned parameter are searched: the search may
    read it in another layout (paying the redistribution), and a plan on one parameter never
    fixes an operator. Two plans disagreeing on one parameter are refused."""
    params, x = _args()
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                 search_mode="dynamic_programming")
    g = ap.trace(_planned_loss({"w1": (1, 8)}), params, x)
    assert g.parameter_layouts() == {"params/w1": (1, 8)}
    plan = ap.search(g)
    assert plan.split_counts("params/w1") == (1, 8)
    assert plan.strategy("dot_general_0")[1] != (1, 8)  # its reader chose another layout
    assert list(g.annotations()) == ["dot_general_1"]  # only the shard's own operator

    def twice(p, x):
        h = ap.shard(jnp.tanh, in_strategy=((1, 1),), parameter_plan={"w1": (2, 1)})(x @ p["w1"])
        return ap.shard(jnp.tanh, in_strategy=((1, 1),), parameter_plan={"w1": (1, 2)})(h).sum()
    with pytest.raises(AutoParallelError, match="already gives this parameter"):
        ap.trace(twice, params, x)


def test_parameter_plan_names_match_mindspore_paths_and_refuse_ambiguity():
    layers = {"layers": [{"w": jnp.ones((16, 16))}, {"w": jnp.ones((16, 16))}]}

    def make(plan_key):
        def loss(p, x):
            for layer in p["layers"]:
                x = ap.shard(jnp.tanh, in_strategy=((1, 1),),
                             parameter_plan={plan_key: (1, 2)})(x @ layer["w"])
            return x.sum()
        return loss

    g = ap.trace(make("layers.1.w"), layers, jnp.ones((4, 16)))  # MindSpore's dotted name
    assert g.parameter_layouts() == {"p/layers/1/w": (1, 2)}
    with pytest.raises(AutoParallelError, match="names several parameters.*'layers.0.w'"):
        ap.trace(make("w"), layers, jnp.ones((4, 16)))


def test_parameter_plan_trains_a_parameter_stored_apart_from_its_reader():
    """A parameter stored split (2, 1) while its data-parallel reader reads it whole: gathered
    in forward, its gradient reduce-scattered to the stored blocks, updated there. Two SGD
    steps match the float64 reference."""
    params, x = _args()
    ap.set_auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                 gradients_mean=True)

    def loss(p, x):
        h = ap.shard(jnp.tanh, in_strategy=((8, 1),), parameter_plan={"w1": (2, 1)})(x @ p["w1"])
        return jnp.mean((h @ p["w2"]) ** 2)

    with pytest.warns(ap.AutoParallelWarning, match="annotated operator"):  # (tanh's)
        step = ap.train_step(loss, params, (x,))
    assert step.plan.split_counts("p/w1") == (2, 1)
    assert step.plan.strategy("dot_general_0") == ((8, 1), (1, 1))
    run = numerics.optimizer_steps(loss, steps=2)
    want = numerics.reference(lambda *a: run(*a)[0], params, x, jit=False)
    p, st = params, step.init(params)
    for _ in range(2):
        p, st, _ = step(p, st, x)
    assert p["w1"].sharding.shard_shape(p["w1"].shape) == (8, 32)
    numerics.check(p, want)


def test_parameter_plan_numerics_against_float64():
    params, x = _args()
    ap.set_auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel")
    loss = _laid_out_loss(ap.Layout((2, 4), ("dp", "mp")))
    f = ap.parallelize(loss, params, x)
    assert f.plan.split_counts("p/w1") == (1, 4)
    assert f.plan.split_counts("p/w2") == (4, 1)
    numerics.check(f(params, x), numerics.reference(loss, params, x))


# ------------------------------------------------------------------ named meshes


def test_named_mesh_works_for_parallelize_train_step_and_shardings():
    params, x = _args()
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                 search_mode="dynamic_programming", gradients_mean=True)
    devices = jax.devices()[::-1]  # the user's device order is kept
    mesh = jax.make_mesh((2, 4), ("dp", "mp"), devices=devices,
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    f = ap.parallelize(_loss, params, x, mesh=mesh)
    assert list(f.mesh.devices.flat) == devices
    assert tuple(f.mesh.axis_names) == f.plan.mesh.names
    numerics.check(f(params, x), numerics.reference(_loss, params, x))
    lay = ap.Layout((2, 4), ("dp", "mp"))
    step = ap.train_step(_loss, params, (x,), mesh=mesh,
                         fixed={"dot_general_0": (lay("dp", "None"), lay("None", "mp"))})
    assert step.plan.strategy("dot_general_0") == ((2, 1), (1, 4))
    state = step.init(params)
    _, _, value = step(params, state, x)
    numerics.check(value, numerics.reference(_loss, params, x))
    shardings = ap.to_jax_shardings(f.plan, mesh)
    assert list(shardings["params/w1"].mesh.devices.flat) == devices
    with pytest.raises(AutoParallelError, match="4 devices"):
        ap.parallelize(_loss, params, x, mesh=jax.make_mesh((2, 2), ("dp", "mp"),
                                                            devices=devices[:4]))


def test_no_warning_without_out_strategy():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ap.shard(jnp.matmul, in_strategy=((2, 1), (1, 4)))


def test_shard_strategies_are_not_used_where_no_user_strategy_is():
    """stand_alone and data_parallel use no operator strategy of the user's: the shard's
    in_strategy is left out with a warning (it failed on one device); its parameter_plan
    too on one device, while data parallel stores the parameter as it says."""
    params, x = _args()
    g = ap.trace(_laid_out_loss(ap.Layout((2, 4), ("dp", "mp"))), params, x)
    plain = ap.trace(_loss, params, x)
    with pytest.warns(ap.AutoParallelWarning, match="1 annotated operator.*and 1 parameter "
                                                     "layout.*not used"):
        plan = ap.search(g, parallel_mode="stand_alone")
    assert plan.nodes == ap.search(plain, parallel_mode="stand_alone").nodes
    assert plan.split_counts("p/w2") == (1, 1)
    with pytest.warns(ap.AutoParallelWarning, match="1 annotated operator.*not used") as seen:
        plan = ap.search(g, device_num=8, parallel_mode="data_parallel")
    assert "parameter layout" not in str(seen[0].message)
    want = ap.search(plain, device_num=8, parallel_mode="data_parallel")
    assert plan.nodes == want.nodes and plan.split_counts("p/w2") == (4, 1)
    plan = ap.search(g, device_num=8, parallel_mode="semi_auto_parallel")
    assert plan.split_counts("p/w2") == (4, 1)
