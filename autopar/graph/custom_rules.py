"""Custom derivative rules (``jax.custom_jvp`` / ``jax.custom_vjp``) met while tracing.

The tracer inlines such a function's body, and a sharded program re-binds the body's
primitives on local arrays. Differentiating that program (``train_step``, the pipelined step,
``jax.grad`` of a ``parallelize``'d function) would differentiate the body, not the user's
rule: another gradient, silently (a straight-through estimator's ``round`` gives 0, a
gradient clip written with ``custom_vjp`` is ignored). So the tracer re-binds the body's
operators through :class:`RuleBound`:

- ``jax.nn.relu`` (a ``custom_jvp``): its rule -- derivative 0 at 0, where the body's ``max``
  would split the tie 0.5 / 0.5 -- is applied exactly;
- any other rule: the forward runs as traced; a gradient through it (a cotangent reaching
  its body in reverse mode) raises :class:`~autopar.errors.AutoParallelError` naming the
  function and its source line. A gradient that does not pass through it (an integer output,
  ``stop_gradient``) is not refused.

A custom function whose body computes nothing (``custom_vjp`` of the identity, a gradient
clip) gets one guarded ``copy_p`` node, so its output is guarded too.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from autopar.errors import AutoParallelError

__all__ = ["RULE_PRIMITIVES", "RELU", "RuleBound", "rule_of"]

#: the primitives that carry a custom derivative rule around an inlined body
RULE_PRIMITIVES = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
#: :func:`rule_of` for ``jax.nn.relu``, whose rule autopar applies
RELU = "relu"


def rule_of(eqn: Any, source: str) -> str:
    """:data:`RELU` for ``jax.nn.relu``'s ``custom_jvp``, else what to name in the error: the
    function, its kind and the user's source line."""
    body = eqn.params.get("call_jaxpr")
    info = getattr(getattr(body, "jaxpr", None), "debug_info", None)
    name = getattr(info, "func_name", None) or "a function"
    where = str(getattr(info, "func_src_info", "") or "")
    if eqn.primitive.name == "custom_jvp_call" and name == "relu" and "/jax/_src/nn/" in where:
        return RELU
    kind = "custom_jvp" if eqn.primitive.name == "custom_jvp_call" else "custom_vjp"
    return f"{name!r} (a jax.{kind} function, called at {source})"


@jax.custom_jvp
def _relu_max(x: Any, zero: Any) -> Any:
    return lax.max(x, zero)


@_relu_max.defjvp
def _relu_max_jvp(primals: tuple, tangents: tuple) -> tuple:
    (x, zero), (tx, tz) = primals, tangents
    return lax.max(x, zero), jnp.where(x > zero, tx, tz)  # jax.nn.relu: 0 at the tie


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
        if rule == RELU and prim.name == "max" and len(args) == 2:
            return _relu_max(*args)

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
