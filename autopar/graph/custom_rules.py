"""Custom derivative rules (``jax.custom_jvp`` / ``jax.custom_vjp``) met while tracing.

The tracer inlines such a function's body, and a sharded program re-binds the body's
primitives on local arrays. Differentiating that program (``train_step``, the pipelined step,
``jax.grad`` of a ``parallelize``'d function) would differentiate the body, not the user's
rule: another gradient, silently (a straight-through estimator's ``round`` gives 0, a
gradient clip written with ``custom_vjp`` is ignored). So the tracer re-binds the body's
operators through :class:`RuleBound`:

- ``jax.nn.relu`` and ``relu6`` (``custom_jvp``): their rule -- derivative 0 at the kinks,
  where the body's ``max`` / ``min`` would split the tie 0.5 / 0.5 -- is applied exactly;
- JAX's other own ``custom_jvp`` functions (``logaddexp`` inside ``softplus``,
  ``log_sigmoid`` and optax's sigmoid cross-entropy; ``xlogy``, ``logit``, ``sinc``) are
  inlined plainly: their rules exist for infinities and single points (x = 0), and their
  body's derivative is theirs everywhere else;
- any other rule (the user's): the forward runs as traced; a gradient through it (a cotangent
  reaching its body in reverse mode) raises :class:`~autopar.errors.AutoParallelError` naming
  the function and its source line. A gradient that does not pass through it (an integer
  output, ``stop_gradient``) is not refused.

A custom function whose body computes nothing (``custom_vjp`` of the identity, a gradient
clip) gets one guarded ``copy_p`` node, so its output is guarded too.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from autopar.errors import AutoParallelError

__all__ = ["RULE_PRIMITIVES", "TIES_TO_CONSTANT", "RuleBound", "rule_of"]

#: the primitives that carry a custom derivative rule around an inlined body
RULE_PRIMITIVES = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
#: :func:`rule_of` for ``jax.nn.relu`` / ``relu6``: a tie of their ``max`` / ``min`` with
#: the constant goes to the constant (derivative 0 at the kink)
TIES_TO_CONSTANT = "ties to the constant"


def rule_of(eqn: Any, source: str) -> str | None:
    """:data:`TIES_TO_CONSTANT` for ``jax.nn.relu`` / ``relu6``; None for JAX's other own
    ``custom_jvp`` functions (inlined plainly); else what to name in the error: the
    function, its kind and the user's source line."""
    body = eqn.params.get("call_jaxpr")
    info = getattr(getattr(body, "jaxpr", None), "debug_info", None)
    name = getattr(info, "func_name", None) or "a function"
    jvp = eqn.primitive.name == "custom_jvp_call"
    # JAX's own: its function and its rule both in JAX's sources (a user's custom_jvp around
    # jnp.rint or jax.nn.relu has its rule in the user's file)
    ours = jvp and all("/jax/_src/" in _source_of(x) for x in (
        info, getattr(eqn.params.get("jvp_jaxpr_fun"), "debug_info", None)))
    if ours and name in ("relu", "relu6") and "/jax/_src/nn/" in _source_of(info):
        return TIES_TO_CONSTANT
    if ours:
        return None
    kind = "custom_jvp" if jvp else "custom_vjp"
    return f"{name!r} (a jax.{kind} function, called at {source})"


def _source_of(info: Any) -> str:
    return str(getattr(info, "func_src_info", "") or "").replace("\\", "/")


def _ties_to_second(op: Any, wins: Any) -> Any:
    """``op(x, c)`` (max / min) whose derivative at a tie goes to ``c``: ``x``'s tangent
    where ``wins(x, c)``, else ``c``'s (a constant's: 0)."""
    @jax.custom_jvp
    def f(x: Any, c: Any) -> Any:
        return op(x, c)

    @f.defjvp
    def _jvp(primals: tuple, tangents: tuple) -> tuple:
        (x, c), (tx, tc) = primals, tangents
        return op(x, c), jnp.where(wins(x, c), tx, tc)

    return f


_TIES = {"max": _ties_to_second(lax.max, lax.gt), "min": _ties_to_second(lax.min, lax.lt)}


class RuleBound:
    """A primitive of a custom function's body, re-bound with the rule's effect (module
    docstring); it stands for the primitive in a node (``name``, ``multiple_results``,
    ``bind``)."""

    def __init__(self, primitive: Any, rule: str) -> None:
        self.primitive, self.rule = primitive, rule

    @property
    def name(self) -> str:
        return self.primitive.name

    @property
    def multiple_results(self) -> bool:
        return self.primitive.multiple_results

    def bind(self, *args: Any, **params: Any) -> Any:
        prim, rule = self.primitive, self.rule
        if rule == TIES_TO_CONSTANT:  # (anything else in relu's body: as traced)
            if prim.name in _TIES and len(args) == 2:
                return _TIES[prim.name](*args)
            return prim.bind(*args, **params)

        @jax.custom_vjp
        def run(*xs: Any) -> Any:
            out = prim.bind(*xs, **params)
            return tuple(out) if prim.multiple_results else out

        def forward(*xs: Any) -> tuple:
            return run(*xs), None

        def refuse(_: Any, cotangent: Any) -> tuple:  # traced only for a gradient through it
            raise AutoParallelError(
                "gradient", rule, "autopar re-binds a custom_jvp / custom_vjp function's body "
                "on split tensors and cannot apply its derivative rule; differentiating the "
                "body instead would give another gradient", "Compute the function outside "
                "what autopar parallelises, or write it without a custom derivative rule")

        run.defvjp(forward, refuse)
        out = run(*args)
        return list(out) if prim.multiple_results else out

    def __repr__(self) -> str:
        return f"RuleBound({self.primitive.name}, {self.rule})"
