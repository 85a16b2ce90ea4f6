"""Primitives real code emits: ``name`` (``checkpoint_name``), ``sort`` (``jnp.sort``,
``jnp.argsort``, ``lax.sort`` of several operands), ``scatter-add`` / ``scatter``
(``x.at[i].add``, ``.set``, embedding gradients, MoE dispatch) and ``select_and_scatter_add``
(max-pool's transpose). Each runs split on 8 devices as its strategy space allows -- the
result against a float64 one-device run (``tests/numerics.py``), and the gradient of a
training step through it against ``jax.grad``'s -- and refuses the splits it does not allow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import autopar as ap
import numerics
from autopar.graph.ops import op_spec

X = jnp.sin(jnp.arange(64.0)).reshape(8, 8) / 2
W = jnp.cos(jnp.arange(64.0)).reshape(8, 8) / 3


def _node(fn, args, op):
    g = ap.trace(fn, *args)
    return g, next(n for n in g.nodes if n.op == op)


def _parallel(fn, args, op, strategy):
    """``fn`` parallelised on 8 devices with the ``op`` node split as ``strategy``, checked
    against the float64 run."""
    _, node = _node(fn, args, op)
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel"):
        f = ap.parallelize(fn, *args, fixed={node.name: strategy})
    assert f.plan.nodes[node.name].strategy == strategy
    numerics.assert_close(f(*args), fn, *args)
    return f


def _step_grads_match(loss, params, batch, op, strategy):
    """A training step's gradients with the ``op`` node split as ``strategy`` equal
    ``jax.grad``'s (float64 reference)."""
    _, node = _node(loss, (params, *batch), op)
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                  gradients_mean=True):
        step = ap.train_step(loss, params, tuple(batch), fixed={node.name: strategy})
    assert step.plan.nodes[node.name].strategy == strategy
    grad = jax.value_and_grad(loss)
    numerics.assert_close(step.grads(params, *batch), grad, params, *batch,
                          single=grad(params, *batch), jit=False)


# ---------------------------------------------------------------------------- name


def _named(w, x):
    inner = jax.checkpoint(lambda h: jnp.tanh(checkpoint_name(h @ w, "hw")) @ w,
                           policy=jax.checkpoint_policies.save_only_these_names("hw"))
    return inner(x)


def test_checkpoint_name_is_an_identity_that_splits_like_its_operand():
    g, node = _node(_named, (W, X), "name")
    assert node.kind == "identity" and node.params["name"] == "hw"
    assert op_spec(node, g).fixed == ()
    _parallel(_named, (W, X), "name", ((8, 1),))
    _parallel(_named, (W, X), "name", ((2, 4),))
    _step_grads_match(lambda w, x: jnp.mean(_named(w, x) ** 2), W, (X,), "name", ((1, 8),))


# ---------------------------------------------------------------------------- sort


def test_sort_splits_every_dim_but_the_sorted_one():
    def f(w, x):
        return jnp.sort(x @ w, axis=1)

    g, node = _node(f, (W, X), "sort")
    assert op_spec(node, g).fixed == (1,)
    _parallel(f, (W, X), "sort", ((8, 1),))
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel"):
        with pytest.raises(ap.AutoParallelError):
            ap.parallelize(f, W, X, fixed={node.name: ((1, 8),)})
    weights = jnp.arange(8.0)
    _step_grads_match(lambda w, x: jnp.sum(f(w, x) * weights), W, (X,), "sort", ((8, 1),))


def test_argsort_and_a_sort_of_several_operands():
    def argsort(w, x):
        return jnp.argsort(x @ w, axis=0)

    g, node = _node(argsort, (W, X), "sort")
    assert len(node.inputs) == 2 and node.params["num_keys"] == 1
    assert g.spec(node.inputs[1]).dtype == "int32"  # the iota operand
    _parallel(argsort, (W, X), "sort", ((1, 8), (1, 8)))

    def by_two_keys(w, x):
        h = x @ w
        keys = jnp.round(h * 2)  # ties in the first key, broken by the second
        return lax.sort((keys, h, jnp.cos(h)), dimension=1, num_keys=2)

    _parallel(by_two_keys, (W, X), "sort", ((4, 1),) * 3)
    _step_grads_match(lambda w, x: jnp.sum(by_two_keys(w, x)[2] * jnp.arange(8.0)), W, (X,),
                      "sort", ((2, 1),) * 3)


# ---------------------------------------------------------------------------- scatter

IDS = jnp.array([1, 3, 1, 0, 7, 2, 2, 5, 1, 3, 4, 6, 0, 0, 5, 7], jnp.int32)
G = jnp.sin(jnp.arange(128.0)).reshape(16, 8)


def _embedding_grad(p, ids, g):
    """An embedding table's gradient: each token's row added at its id (repeated ids)."""
    return p["table"].at[ids].add(g @ p["w"])


def test_scatter_add_splits_window_dims_and_sums_over_split_updates():
    params = {"table": W, "w": X}
    g, node = _node(_embedding_grad, (params, IDS, G), "scatter-add")
    spec = op_spec(node, g)
    assert spec.sizes == (8, 8, 16) and spec.summed == (2,) and spec.fixed == (0,)
    assert spec.in_maps == ((0, 1), (2, None), (2, 1))
    # the updates split along the scattered tokens: a partial sum, all-reduced, with the
    # table added once
    f = _parallel(_embedding_grad, (params, IDS, G), "scatter-add", ((1, 1), (8, 1), (8, 1)))
    assert f.parallel_graph.comm_counts().get("all_reduce", 0) >= 1
    _parallel(_embedding_grad, (params, IDS, G), "scatter-add", ((1, 8), (1, 1), (1, 8)))
    _parallel(_embedding_grad, (params, IDS, G), "scatter-add", ((1, 2), (4, 1), (4, 2)))
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel"):
        with pytest.raises(ap.AutoParallelError):  # the rows the ids address stay whole
            ap.parallelize(_embedding_grad, params, IDS, G,
                           fixed={node.name: ((2, 1), (1, 1), (1, 1))})

    def loss(p, ids, g):
        return jnp.mean(jnp.tanh(_embedding_grad(p, ids, g)) ** 2)

    _step_grads_match(loss, params, (IDS, G), "scatter-add", ((1, 1), (8, 1), (8, 1)))
    _step_grads_match(loss, params, (IDS, G), "scatter-add", ((1, 2), (4, 1), (4, 2)))


def test_scatter_add_of_a_moe_dispatch():
    """Tokens [T, H] added into an expert buffer [E, C, H] at (expert, slot) pairs."""
    t, e, c, h = 16, 4, 4, 8
    e_idx = jnp.arange(t, dtype=jnp.int32) % e
    c_idx = (jnp.arange(t, dtype=jnp.int32) * 3) % c

    def dispatch(w, tok, e_idx, c_idx):
        return jnp.zeros((e, c, h)).at[e_idx, c_idx].add(tok @ w)

    args = (W, G, e_idx, c_idx)
    g, node = _node(dispatch, args, "scatter-add")
    assert op_spec(node, g).summed == (3,) and op_spec(node, g).fixed == (0, 1)
    _parallel(dispatch, args, "scatter-add", ((1, 1, 2), (4, 1), (4, 2)))
    _step_grads_match(lambda w, tok, e_idx, c_idx: jnp.sum(jnp.sin(dispatch(w, tok, e_idx,
                                                                             c_idx))),
                      W, (G, e_idx, c_idx), "scatter-add", ((1, 1, 1), (8, 1), (8, 1)))


def test_a_batched_scatter_splits_its_batch():
    """``vmap`` of ``.at[i].add``: operand, indices and updates share a batching dim."""
    ids = jnp.array([[1, 1, 3], [0, 2, 2], [3, 0, 1], [2, 2, 2]] * 2, jnp.int32)  # [8, 3]

    def rows(w, x, ids):
        upd = (x @ w)[:, :3]
        return jax.vmap(lambda r, i, u: r.at[i].add(u))(x, ids, upd)

    args = (W, X, ids)
    g, node = _node(rows, args, "scatter-add")
    spec = op_spec(node, g)
    assert 0 not in spec.fixed and 1 in spec.fixed and spec.summed == (2,)
    strategy = tuple((8,) + (1,) * (g.spec(v).rank - 1) for v in node.inputs)
    _parallel(rows, args, "scatter-add", strategy)


def test_scatter_set_splits_window_dims_only():
    ids = jnp.array([5, 1, 0, 7], jnp.int32)  # unique: which update wins is then defined

    def put(p, ids, v):
        return p["table"].at[ids].set(v @ p["w"])

    params, v = {"table": W, "w": X}, G[:4]
    g, node = _node(put, (params, ids, v), "scatter")
    spec = op_spec(node, g)
    assert spec.sizes == (8, 8) and spec.summed == () and spec.fixed == (0,)
    assert spec.in_maps[1:] == ((None, None), (None, 1))  # the updated rows never split
    _parallel(put, (params, ids, v), "scatter", ((1, 8), (1, 1), (1, 8)))
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel"):
        with pytest.raises(ap.AutoParallelError):
            ap.parallelize(put, params, ids, v, fixed={node.name: ((1, 1), (2, 1), (2, 1))})
    _step_grads_match(lambda p, ids, v: jnp.sum(jnp.tanh(put(p, ids, v)) ** 2), params,
                      (ids, v), "scatter", ((1, 4), (1, 1), (1, 4)))


# ---------------------------------------------------------------------------- max-pool's transpose


def _pool(h):
    return lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _pool_grad(w, x):
    """The gradient of a max-pool inside the function: ``select_and_scatter_add`` of the
    pooled values (the source depends on ``w``) at each window's maximum."""
    h = jnp.tanh(x @ w).reshape(2, 4, 8, 1) * jnp.arange(1.0, 5.0)  # [N, H, W, C]
    return jax.grad(lambda a: jnp.sum(_pool(a) ** 2) / 2)(h)


def test_select_and_scatter_add_splits_the_dims_its_window_does_not_span():
    g, node = _node(_pool_grad, (W, X), "select_and_scatter_add")
    spec = op_spec(node, g)
    assert spec.fixed == (1, 2) and spec.in_maps == ((0, None, None, 3),) * 2
    _parallel(_pool_grad, (W, X), "select_and_scatter_add", ((2, 1, 1, 4),) * 2)
    with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel"):
        with pytest.raises(ap.AutoParallelError):
            ap.parallelize(_pool_grad, W, X, fixed={node.name: ((1, 2, 1, 1),) * 2})
    _step_grads_match(lambda w, x: jnp.mean(jnp.sin(_pool_grad(w, x))), W, (X,),
                      "select_and_scatter_add", ((2, 1, 1, 4),) * 2)


def test_flops_of_the_new_operators():
    _, srt = _node(lambda x: jnp.sort(x, axis=1), (X,), "sort")
    assert srt.flops == 64 * 3  # log2(8) comparisons per element
    _, sca = _node(_embedding_grad, ({"table": W, "w": X}, IDS, G), "scatter-add")
    assert sca.flops == 16 * 8
    _, put = _node(lambda x: x.at[IDS[:4]].set(X[:4]), (X,), "scatter")
    assert put.flops == 0
    _, sel = _node(_pool_grad, (W, X), "select_and_scatter_add")
    assert sel.flops == 2 * 2 * 4 * 4 * 4  # source elements x window elements
