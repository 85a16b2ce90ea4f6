"""What every training step takes and checks alike: the loss, the batch, the optimizer, the
parameters -- for :func:`autopar.train_step` and :func:`autopar.pipeline_train_step`.

:func:`step_arguments` checks the loss and the batch (a tuple of arrays) and defaults the
optimizer (``optax.sgd(DEFAULT_LEARNING_RATE)``); :func:`check_arrays` names a leaf that is
not an array; :func:`broadcast_parameters` is MindSpore's ``parameter_broadcast`` (rank 0's
values on every device), which both steps' ``prepare`` apply when the key is set.

>>> import jax.numpy as jnp, optax
>>> batch, optimizer = step_arguments(jnp.sum, jnp.ones(2), None, "needs a callable")
>>> len(batch), isinstance(optimizer, optax.GradientTransformation)
(1, True)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.context import current_config
from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.graph.tracer import check_arrays
from autopar.lower import jax_mesh
from autopar.strategies.layout import DeviceMesh

__all__ = ["DEFAULT_LEARNING_RATE", "broadcast_parameters", "check_arrays", "check_floating",
           "check_loss", "check_opt_state", "step_arguments"]

#: The default optimizer of the training steps is ``optax.sgd(DEFAULT_LEARNING_RATE)``.
DEFAULT_LEARNING_RATE = 0.1


def check_floating(key: str, tree: Any) -> None:
    """Every leaf of ``tree`` (arrays, checked by :func:`check_arrays`) has a floating dtype:
    parameters are trained by their gradients, which an integer leaf does not have."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.result_type(leaf)
        if not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
            raise AutoParallelTypeError(f"{key}{jax.tree_util.keystr(path)}",
                                        jax.ShapeDtypeStruct(np.shape(leaf), dtype),
                                        f"a floating-point array (parameters are trained by "
                                        f"gradients), not {dtype}")


def check_loss(loss_fn: Any, specs: list[Any]) -> None:
    """The loss a training step differentiates: one real floating-point scalar (``specs``:
    the traced outputs' shape-dtype specs); an integer or boolean loss has no gradient
    (``jax.grad`` refuses it) and a complex one no order.

    >>> import jax.numpy as jnp
    >>> check_loss(jnp.sum, [jax.ShapeDtypeStruct((), jnp.int32)])
    Traceback (most recent call last):
    autopar.errors.AutoParallelTypeError: loss_fn='sum' is invalid: ...
    """
    name = getattr(loss_fn, "__name__", "fn")
    if len(specs) != 1 or tuple(specs[0].shape) != ():
        raise AutoParallelError("loss_fn", name, "must return one scalar loss",
                                "Return jnp.mean(...) etc.")
    if not jax.numpy.issubdtype(specs[0].dtype, jax.numpy.floating):
        raise AutoParallelTypeError("loss_fn", name, "must return a floating-point loss (a "
                                    "training step differentiates it); found "
                                    f"{np.dtype(specs[0].dtype)}: cast it, e.g. "
                                    ".astype(jnp.float32)")


def check_opt_state(optimizer: optax.GradientTransformation, params: Any, opt_state: Any,
                    cache: dict) -> None:
    """``opt_state`` must be what ``optimizer.init(params)`` makes: the same structure and
    leaf shapes (a state of other parameters would be applied silently otherwise). What
    ``init`` makes is traced once per parameter structure and kept in ``cache``."""
    p_leaves, p_tree = jax.tree_util.tree_flatten(params)
    key = (p_tree, tuple(np.shape(x) for x in p_leaves))
    if key not in cache:  # init traced, nothing run
        want = jax.eval_shape(optimizer.init, jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)), params))
        w_leaves, w_tree = jax.tree_util.tree_flatten(want)
        cache[key] = (w_tree, tuple(w.shape for w in w_leaves))
    want_tree, want_shapes = cache[key]
    got_leaves, got_tree = jax.tree_util.tree_flatten(opt_state)
    if got_tree != want_tree or tuple(np.shape(g) for g in got_leaves) != want_shapes:
        raise AutoParallelTypeError("opt_state", opt_state, "the optimizer state of these "
                                    "parameters, as step.init(params) makes it")


def step_arguments(loss_fn: Any, batch: Any, optimizer: Any, loss_rule: str
                   ) -> tuple[tuple[Any, ...], optax.GradientTransformation]:
    """The arguments every step builder checks alike: ``(batch as a tuple, optimizer or the
    default SGD)``; a ``loss_fn`` that is not callable raises with ``loss_rule``."""
    if not callable(loss_fn):
        raise AutoParallelTypeError("loss_fn", loss_fn, loss_rule)
    if isinstance(batch, list):
        raise AutoParallelTypeError("batch", batch, "a tuple of example arrays (or one array); "
                                    "a list is ambiguous: pass tuple(batch)")
    if not isinstance(batch, tuple):
        batch = (batch,)
    check_arrays("batch", batch)
    if optimizer is None:
        optimizer = optax.sgd(DEFAULT_LEARNING_RATE)
    if not isinstance(optimizer, optax.GradientTransformation):
        raise AutoParallelTypeError("optimizer", optimizer, "an optax GradientTransformation")
    return batch, optimizer


def broadcast_parameters(params: Any, mesh: Mesh | None = None) -> Any:
    """Every leaf of ``params`` placed replicated on ``mesh``, with the values of its first
    device (rank 0): MindSpore's ``parameter_broadcast``.

    A leaf whose per-device copies differ (e.g. built with
    ``jax.make_array_from_single_device_arrays``) comes back equal to rank 0's copy on every
    device; a split leaf is gathered whole first. Under ``jax.distributed`` each process's
    host values are replaced by process 0's (every process calls this, as a collective).
    ``mesh`` defaults to the first ``device_num`` devices of the current context.
    """
    if mesh is None:
        mesh = jax_mesh(DeviceMesh.for_devices(current_config().device_num))
    if not isinstance(mesh, Mesh):
        raise AutoParallelTypeError("mesh", mesh, "a jax.sharding.Mesh (or None)")
    rank0 = mesh.devices.flat[0]
    target = NamedSharding(mesh, PartitionSpec())

    def one(x: Any) -> Any:
        value = None
        if isinstance(x, jax.Array) and x.sharding.is_fully_replicated:
            for s in x.addressable_shards:
                if s.device == rank0:
                    value = np.asarray(s.data)
                    break
        if value is None:
            value = np.asarray(x)
        if jax.process_count() > 1:  # each process's host value: process 0's for all
            from jax.experimental import multihost_utils

            value = np.asarray(multihost_utils.broadcast_one_to_all(value))
        return jax.device_put(value, target)

    return jax.tree.map(one, params)
