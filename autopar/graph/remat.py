"""Recomputation regions: ``jax.checkpoint`` / ``remat`` kept through trace, rewrite and lower.

The tracer inlines a ``checkpoint`` call (``jax.checkpoint``, ``nn.remat``,
``eqx.filter_checkpoint``) like any call, and tags every node of its body with a
:class:`Remat`: the region (``remat_0``, one per call, in trace order), the user's policy
(the callable itself: ``None`` saves nothing, as ``jax.checkpoint``'s default) and whether
the policy saves this node's outputs -- the policy asked as JAX's partial evaluation asks
it, ``policy(primitive, *input avals, **params)``. A call nested in another is part of the
outer region (the outer policy decides what is kept from forward to backward).

What the tag means downstream:

- **lowering** (:func:`autopar.lower.run_body`): each region's contiguous span of the
  per-device program (its operators and the communication between them) runs inside
  ``jax.checkpoint`` with the user's policy, so the compiled program recomputes what the
  policy says (a ``checkpoint_name`` is re-bound as the ``name`` primitive, so a names
  policy matches the same values);
- **memory** (:mod:`autopar.strategies.memory`): backward keeps, of a region, its inputs
  and what the policy saves; the residuals its operators read that the policy does not save
  are recomputed, live from the start of the region's backward (a transient);
- **time** (:mod:`autopar.strategies.op_pricing`, :mod:`autopar.timeline`): a recomputed
  operator's forward runs again in backward.

>>> import jax, jax.numpy as jnp, autopar
>>> policy = jax.checkpoint_policies.dots_saveable
>>> f = jax.checkpoint(lambda w, x: jnp.tanh(x @ w).sum(), policy=policy)
>>> g = autopar.trace(f, jnp.ones((4, 4)), jnp.ones((2, 4)))
>>> [(n.op, n.remat.region, n.remat.saved) for n in g.nodes]
[('dot_general', 'remat_0', True), ('tanh', 'remat_0', False), ('reduce_sum', 'remat_0', False)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import numpy as np

from autopar.errors import AutoParallelError

__all__ = ["REMAT_PRIMITIVES", "Remat", "policy_saves", "spans"]

#: the call primitives of ``jax.checkpoint`` (``remat2`` in JAX's jaxprs; ``checkpoint``:
#: its older name)
REMAT_PRIMITIVES: frozenset[str] = frozenset({"checkpoint", "remat2"})


@dataclass(frozen=True, slots=True)
class Remat:
    """A node's recomputation region: ``region`` (its id), ``policy`` (the user's
    ``jax.checkpoint`` policy; None: save nothing), ``saved`` (whether the policy saves this
    node's outputs: backward reads them stored, not recomputed) and ``prevent_cse``
    (``jax.checkpoint``'s own flag, passed on)."""

    region: str
    policy: Any = field(default=None, compare=False)
    saved: bool = False
    prevent_cse: bool = True

    def __str__(self) -> str:
        return f"{self.region}[{'saved' if self.saved else 'recomputed'}]"


def policy_saves(policy: Any, primitive: Any, in_specs: Sequence[Any], params: Any,
                 where: str) -> bool:
    """Whether ``policy`` saves the outputs of an equation of ``primitive`` (``in_specs``:
    its inputs' shapes and dtypes), as JAX's partial evaluation asks it. A policy that
    offloads (``save_and_offload_only_these_names``) raises a typed error naming it."""
    if policy is None:
        return False
    avals = [jax.core.ShapedArray(s.shape, np.dtype(s.dtype)) if _numeric(s.dtype) else None
             for s in in_specs]
    answer = policy(primitive, *avals, **dict(params))
    if isinstance(answer, (bool, np.bool_)):
        return bool(answer)
    name = type(answer).__name__
    if name in ("Saveable", "SaveableType"):
        return True
    if name in ("Recompute", "RecomputeType"):
        return False
    raise AutoParallelError("jax.checkpoint policy", policy, f"a policy that saves or "
                            f"recomputes (it answered {name} at {where}); autopar keeps "
                            "saved values on the device, it does not offload them",
                            "Use save_only_these_names / save_any_names_but_these")


def _numeric(dtype: str) -> bool:
    try:
        np.dtype(dtype)
    except TypeError:
        return False  # (a typed PRNG key)
    return True


def spans(nodes: Sequence[Any]) -> dict[int, int]:
    """The span of each region in a program (nodes with an optional ``remat`` and an
    ``is_comm``-like ``step``): first index -> one past the last node of the region; the
    communication steps between two nodes of one region are inside it.

    >>> from types import SimpleNamespace as N
    >>> r = Remat("remat_0")
    >>> spans([N(remat=None, step=None), N(remat=r, step=None), N(remat=None, step=1),
    ...        N(remat=r, step=None), N(remat=None, step=1)])
    {1: 4}
    """
    out: dict[int, int] = {}
    i, n = 0, len(nodes)
    while i < n:
        r = getattr(nodes[i], "remat", None)
        if r is None:
            i += 1
            continue
        last, k = i, i + 1
        while k < n:
            rk = getattr(nodes[k], "remat", None)
            if rk is not None and rk.region == r.region:
                last = k
            elif rk is not None or getattr(nodes[k], "step", None) is None:
                break
            k += 1
        out[i] = last + 1
        i = last + 1
    return out
