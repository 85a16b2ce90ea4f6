"""Mixed precision in the price: the bytes a training step stores and sends per parameter.

Three rules, each used by the search, the memory model and the training steps alike:

- **low precision** (:data:`LOW_PRECISION`): bfloat16 and float16;
- **gradient_fp32_sync** (:func:`fp32_sync_active`, :func:`sync_factor`): under
  semi_auto_parallel and auto_parallel (seed 002) a low-precision gradient is cast to float32
  before its all-reduce and back after it, so the collective sends (and the step holds) twice
  its bytes; elsewhere gradients travel in their own dtype;
- **optimizer state as the optimizer keeps it** (:func:`optimizer_state`): the shapes and
  dtypes ``optimizer.init`` returns on the abstract parameters (``jax.eval_shape``: nothing is
  allocated), attributed to each parameter by optax's own map of the state's parameter-
  mirroring subtrees (``optax.tree_map_params``): Adam keeps ``mu`` and ``nu`` in the
  parameter's dtype (2x its bytes), SGD nothing, an fp32 master copy the user keeps for a
  bf16 parameter 2x. The search prices each parameter's state as its ratio to the
  parameter's bytes, so the state follows the parameter's layout; what mirrors no parameter
  (step counts) is a few scalars and is left out. Without an optimizer (``ap.search`` on a
  bare graph) the cluster's ``optimizer_state_factor`` stands in.

>>> import jax.numpy as jnp, optax
>>> params = {"w": jnp.ones((4, 4), jnp.bfloat16), "b": jnp.ones(4, jnp.float32)}
>>> optimizer_state(optax.adam(1e-3), params)
(2.0, 2.0)
>>> optimizer_state(optax.adam(1e-3, mu_dtype=jnp.float32), params)[1]   # w: fp32 mu
3.0
>>> optimizer_state(optax.sgd(1e-3), params)
(0.0, 0.0)
>>> sync_factor("bfloat16", True), sync_factor("float32", True), sync_factor("bfloat16", False)
(2.0, 1.0, 1.0)
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import numpy as np

__all__ = ["LOW_PRECISION", "compute_dtype", "fp32_sync_active", "sync_factor",
           "optimizer_state", "state_ratio"]

#: the floating-point dtypes gradient_fp32_sync upcasts
LOW_PRECISION = ("bfloat16", "float16")


def compute_dtype(graph: Any, node: Any) -> str:
    """The dtype operator ``node`` computes in (the peak its FLOPs run at,
    ``Cluster.peak_flops_by_dtype``): its first input's but literals', else its first
    output's (a bf16 matmul accumulating into fp32 computes in bf16)."""
    for v in node.inputs:
        val = graph.values[v]
        if val.kind != "literal":
            return str(val.spec.dtype)
    return str(graph.values[node.outputs[0]].spec.dtype) if node.outputs else "float32"


def state_ratio(states: Mapping[str, float] | None, value: str) -> float | None:
    """Optimizer state bytes per byte of parameter ``value`` in ``states`` (a parameter it
    does not name keeps none); None without ``states``: the cluster's
    ``optimizer_state_factor`` stands in."""
    return None if states is None else states.get(value, 0.0)


def fp32_sync_active(gradient_fp32_sync: bool, parallel_mode: str) -> bool:
    """Whether ``gradient_fp32_sync`` acts: in semi_auto_parallel and auto_parallel only
    (seed 002); elsewhere gradients are synchronised in their own dtype."""
    return bool(gradient_fp32_sync) and parallel_mode in ("semi_auto_parallel", "auto_parallel")


def sync_factor(dtype: str, fp32: bool) -> float:
    """Bytes a gradient's synchronisation sends per byte of the gradient: 2 for a bf16 /
    fp16 gradient synchronised in fp32 (``fp32``: :func:`fp32_sync_active`), else 1."""
    return 2.0 if fp32 and str(dtype) in LOW_PRECISION else 1.0


def _nbytes(leaf: Any) -> float:
    return float(math.prod(np.shape(leaf)) * np.dtype(leaf.dtype).itemsize)


def optimizer_state(optimizer: Any, params: Any) -> tuple[float, ...]:
    """Per leaf of ``params`` (flattening order; ``None`` subtrees are no leaves): the bytes
    of optimizer state ``optimizer.init`` keeps for it over the leaf's own bytes (0.0 for a
    leaf of no bytes). ``params``: arrays or ``jax.ShapeDtypeStruct`` s. An optimizer whose
    state optax cannot map to its parameters (its ``init`` needs their values, e.g. shapes
    to factor) has its state's bytes spread over the parameters by their bytes."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    leaves, tree = jax.tree_util.tree_flatten(abstract)
    state = jax.eval_shape(optimizer.init, abstract)
    own = [0.0] * len(leaves)

    def take(leaf: Any, k: int) -> Any:
        own[k] += _nbytes(leaf)
        return leaf

    import optax  # (the optimizers' library: imported where an optimizer is given)
    try:
        optax.tree_map_params(optimizer, take, state,
                              jax.tree_util.tree_unflatten(tree, list(range(len(leaves)))))
    except Exception:  # noqa: BLE001 - an init that needs values: spread by bytes
        total = sum(_nbytes(s) for s in jax.tree_util.tree_leaves(state)
                    if np.shape(s))
        size = sum(_nbytes(x) for x in leaves)
        return tuple(total / size if size else 0.0 for _ in leaves)
    return tuple(o / _nbytes(x) if _nbytes(x) else 0.0 for o, x in zip(own, leaves))
