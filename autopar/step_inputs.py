"""What every training step takes and checks alike: the loss, the batch, the optimizer, the
parameters -- for :func:`autopar.train_step` and :func:`autopar.pipeline_train_step`.

:func:`step_arguments` checks the loss and the batch (a tuple of arrays) and defaults the
optimizer (``optax.sgd(DEFAULT_LEARNING_RATE)``); :func:`check_arrays` names a leaf that is
not an array; :func:`broadcast_parameters` is MindSpore's ``parameter_broadcast`` (rank 0's
values on every device), which both steps' ``prepare`` apply when the key is set.
:func:`is_trained` is the one rule of what a step trains (floating-point leaves; integer,
boolean and PRNG-key leaves are carried unchanged) and :class:`ParamSplit` applies it to a
parameter tree; :func:`warn_gradients_mean` is the once-per-process warning of a step built
under MindSpore's default ``gradients_mean=False`` without setting it.

>>> import jax.numpy as jnp, optax
>>> batch, optimizer = step_arguments(jnp.sum, jnp.ones(2), None, "needs a callable")
>>> len(batch), isinstance(optimizer, optax.GradientTransformation)
(1, True)
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.context import current_config
from autopar.errors import (AutoParallelError, AutoParallelTypeError, AutoParallelWarning,
                            user_stacklevel)
from autopar.graph.tracer import check_arrays
from autopar.lower import jax_mesh
from autopar.strategies.layout import DeviceMesh

__all__ = ["DEFAULT_LEARNING_RATE", "ParamSplit", "broadcast_parameters", "check_arrays",
           "check_loss", "check_opt_state", "check_trainable", "is_prng_key",
           "is_trained", "step_arguments", "warn_gradients_mean", "without_keys"]

#: The default optimizer of the training steps is ``optax.sgd(DEFAULT_LEARNING_RATE)``.
DEFAULT_LEARNING_RATE = 0.1

#: The keys of the once-per-process warnings already given (:func:`warn_gradients_mean`).
WARNED_ONCE: set[str] = set()


def is_prng_key(leaf: Any) -> bool:
    """Whether ``leaf`` is a typed PRNG key array (``jax.random.key``) or its shape."""
    return bool(jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key))


def is_trained(leaf: Any) -> bool:
    """Whether a training step trains the parameter leaf ``leaf``: a floating-point (or
    complex) array or number is trained; every other leaf -- an integer (a step counter), a
    boolean, a PRNG key, typed (``jax.random.key``) or raw (``uint32``) -- is carried: the
    loss receives it, the optimizer never sees it, the step returns it unchanged.

    >>> import jax, jax.numpy as jnp
    >>> [is_trained(x) for x in (jnp.ones(2), 2.0, jnp.int32(3), True, jax.random.key(0))]
    [True, True, False, False, False]
    """
    if is_prng_key(leaf):
        return False
    dtype = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.result_type(leaf)
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))


class ParamSplit:
    """A parameter pytree as a training step takes it (the rule of :func:`is_trained`).

    ``tree``: its structure (a None is an empty subtree, as to JAX); ``graph``: the positions
    (among its leaves) of those the traced program takes -- every leaf, typed PRNG keys
    included (a loss draws its dropout masks from them, each device its block of the same
    draw), unless ``keys_in_program`` is False (the pmap backend, whose replicas would each
    draw the whole array; the pipelined step, which packs its parameters): then typed keys
    stay out of the program, the step hands them back as it got them, and a loss that reads
    one is refused by name; ``trained``: the positions *in* ``graph`` of the leaves that
    are trained. The optimizer sees :meth:`optimizer_tree`: the tree with every carried
    leaf None.
    """

    def __init__(self, params: Any, keys_in_program: bool = True) -> None:
        paths_leaves, self.tree = jax.tree_util.tree_flatten_with_path(params)
        leaves = [x for _, x in paths_leaves]
        self.paths = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
        self.n = len(leaves)
        self.keys = () if keys_in_program else \
            tuple(i for i, x in enumerate(leaves) if is_prng_key(x))
        self.graph = tuple(i for i in range(self.n) if i not in self.keys)
        self.trained = tuple(k for k, i in enumerate(self.graph) if is_trained(leaves[i]))
        self.key_specs = [(tuple(np.shape(leaves[i])), str(leaves[i].dtype)) for i in self.keys]

    def graph_leaves(self, leaves: Sequence[Any]) -> list[Any]:
        """The leaves (all of them, flattened) the traced program takes."""
        return [leaves[i] for i in self.graph]

    def key_leaves(self, leaves: Sequence[Any]) -> list[Any]:
        """The typed PRNG keys among ``leaves``, checked against the example's (shape and
        key type); the step hands them back unchanged."""
        out = [leaves[i] for i in self.keys]
        for i, x, (shape, dtype) in zip(self.keys, out, self.key_specs):
            got = (tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__)))
            if got != (shape, dtype):
                raise AutoParallelError(f"params{self.paths[i]}", got, f"must be a PRNG key "
                                        f"of shape {shape} and type {dtype}, as in the example")
        return out

    def unflatten(self, graph_leaves: Sequence[Any], keys: Sequence[Any]) -> Any:
        """The parameter tree of the program's leaves and the keys."""
        it, kit = iter(graph_leaves), iter(keys)
        return jax.tree_util.tree_unflatten(self.tree, [next(kit) if i in self.keys else
                                                        next(it) for i in range(self.n)])

    def optimizer_tree(self, trained: Sequence[Any]) -> Any:
        """The tree the optimizer sees: ``trained`` (one value per trained leaf, in order) at
        the trained leaves' places, None (an empty subtree) at every carried one."""
        at = {self.graph[k]: x for k, x in zip(self.trained, trained)}
        return jax.tree_util.tree_unflatten(self.tree, [at.get(i) for i in range(self.n)])

    def masked(self, params: Any) -> Any:
        """``params`` as the optimizer sees it (:meth:`optimizer_tree`)."""
        leaves = self.graph_leaves(jax.tree_util.tree_leaves(params))
        return self.optimizer_tree([leaves[k] for k in self.trained])

    def without_keys(self, params: Any) -> Any:
        """``params`` with every typed PRNG key None (what the program is traced on)."""
        return without_keys(params)

    def traced(self, loss_fn: Callable[..., Any], params: Any, batch: Sequence[Any]
               ) -> tuple[Callable[..., Any], Any]:
        """``(function, parameters)`` to trace: ``loss_fn`` and ``params`` themselves, or,
        with typed PRNG keys among them, ``params`` without the keys and a function handing
        ``loss_fn`` the example's keys, which it must not read (refused by name: the step
        keeps them out of its program)."""
        if not self.keys:
            return loss_fn, params
        self._check_keys_unread(loss_fn, params, batch)
        leaves = jax.tree_util.tree_leaves(params)
        keys = [leaves[i] for i in self.keys]

        @functools.wraps(loss_fn)  # (the signature: the inputs keep their names)
        def loss_without_keys(p: Any, *b: Any) -> Any:
            return loss_fn(self.unflatten(jax.tree_util.tree_leaves(p), keys), *b)
        return loss_without_keys, self.without_keys(params)

    def _check_keys_unread(self, loss_fn: Callable[..., Any], params: Any,
                           batch: Sequence[Any]) -> None:
        """A typed error naming the first typed PRNG key ``loss_fn`` reads (or returns)."""
        leaves = jax.tree_util.tree_leaves(params)

        def probe(keys: list[Any], rest: list[Any], *b: Any) -> Any:
            return loss_fn(self.unflatten(rest, keys), *b)
        jaxpr = jax.make_jaxpr(probe)([leaves[i] for i in self.keys],
                                      self.graph_leaves(leaves), *batch).jaxpr
        used = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
        for i, var in zip(self.keys, jaxpr.invars):
            if id(var) in used:
                raise AutoParallelTypeError(
                    f"params{self.paths[i]}", leaves[i], "a PRNG key (jax.random.key) the "
                    "loss reads or returns: this step keeps key leaves out of its program "
                    "(the pmap backend: each replica would draw the whole array; the "
                    "pipelined step: its parameters are packed). Use backend='shard_map' "
                    "(one stage), or draw the random values outside the loss and pass them "
                    "in the batch")


def without_keys(params: Any) -> Any:
    """``params`` with every typed PRNG key None: an empty subtree, every other leaf keeping
    its path (what :func:`check_arrays` checks of a step's parameters, and what the program
    is traced on)."""
    return jax.tree.map(lambda x: None if is_prng_key(x) else x, params)


def check_trainable(key: str, tree: Any) -> None:
    """``tree`` (checked by :func:`check_arrays`) has a leaf a step trains
    (:func:`is_trained`); with none, ``jax.grad`` of the loss has nothing to differentiate
    (it refuses integer inputs), and the step is refused naming the first leaf."""
    found = jax.tree_util.tree_flatten_with_path(tree)[0]
    if found and not any(is_trained(x) for _, x in found):
        path, leaf = found[0]
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)
        raise AutoParallelTypeError(f"{key}{jax.tree_util.keystr(path)}",
                                    jax.ShapeDtypeStruct(np.shape(leaf), dtype),
                                    f"{key} holds no floating-point leaf, so the step has "
                                    f"nothing to train (integer, boolean and PRNG-key leaves "
                                    f"are carried unchanged, not trained); found {dtype}")


def warn_gradients_mean(dp: int, explicit: bool) -> None:
    """Once per process, an :class:`~autopar.errors.AutoParallelWarning` at the user's line
    when a training step was built with a data-parallel degree ``dp > 1`` and
    ``gradients_mean`` left at MindSpore's default (``explicit``: the user set the key)."""
    if explicit or dp <= 1 or "gradients_mean" in WARNED_ONCE:
        return
    WARNED_ONCE.add("gradients_mean")
    warnings.warn(f"gradients_mean is not set: with MindSpore's default gradients_mean=False "
                  f"the step sums its {dp} data-parallel replicas' gradients, so they are "
                  f"{dp} x jax.grad of the global (mean) loss. Set gradients_mean explicitly "
                  "(True: the gradient of the global loss; False: keep the sum) in "
                  "set_auto_parallel_context / auto_parallel_context to silence this",
                  AutoParallelWarning, stacklevel=user_stacklevel())


def check_loss(loss_fn: Any, specs: list[Any], out_tree: Any = None,
               has_aux: bool = False) -> None:
    """The loss a training step differentiates: one real floating-point scalar (``specs``:
    the traced outputs' shape-dtype specs); an integer or boolean loss has no gradient
    (``jax.grad`` refuses it) and a complex one no order. ``has_aux``: the function returns
    ``(loss, aux)`` (``out_tree``: the traced output structure), ``aux`` any pytree of arrays,
    as for ``jax.value_and_grad(..., has_aux=True)``.

    >>> import jax.numpy as jnp
    >>> check_loss(jnp.sum, [jax.ShapeDtypeStruct((), jnp.int32)])
    Traceback (most recent call last):
    autopar.errors.AutoParallelTypeError: loss_fn='sum' is invalid: ...
    """
    name = getattr(loss_fn, "__name__", "fn")
    if has_aux:
        pair = out_tree is not None and len(out_tree.children()) == 2 and \
            out_tree.node_data() is not None and out_tree.node_data()[0] in (tuple, list) \
            and jax.tree_util.treedef_is_leaf(out_tree.children()[0])
        if not pair:
            raise AutoParallelError("loss_fn", name, "with has_aux=True it must return a pair "
                                    "(loss, aux): a scalar loss and a pytree of arrays "
                                    f"(returned: {out_tree})", "Return (loss, aux), or drop "
                                    "has_aux=True")
        specs = specs[:1]
    if len(specs) != 1 or tuple(specs[0].shape) != ():
        raise AutoParallelError("loss_fn", name, "must return one scalar loss",
                                "Return jnp.mean(...) etc., or (loss, aux) with has_aux=True")
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
