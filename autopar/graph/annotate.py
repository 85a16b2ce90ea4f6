"""Semi-auto annotations inside user code: attach a MindSpore strategy to an operator.

``autopar.shard(fn, strategy)`` wraps a function (typically one operator, e.g. ``jnp.matmul``)
so that the first operator traced inside it whose input ranks fit the strategy gets that
strategy, like MindSpore's ``ops.MatMul().shard(((2, 1), (1, 4)))``. ``autopar.matmul(a, b,
strategy=...)`` is the common case. The annotation travels through ``jax.make_jaxpr`` as a
``jax.named_scope`` entry (``ap.shard#<k>[<strategy>]``), which the tracer reads and strips
from node names, so it survives jit, custom_jvp and remat. Outside tracing it costs nothing.

>>> import jax.numpy as jnp, autopar
>>> def f(x, w):
...     return autopar.matmul(x, w, strategy=((2, 1), (1, 4)))
>>> g = autopar.trace(f, jnp.ones((8, 16)), jnp.ones((16, 4)))
>>> g.node("dot_general_0").annotation
((2, 1), (1, 4))
"""

from __future__ import annotations

import ast
import functools
import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from autopar.errors import AutoParallelTypeError
from autopar.graph.ir import Strategy, check_strategy_shape

__all__ = ["shard", "matmul", "parse_scope", "PREFIX"]

PREFIX = "ap.shard#"
_ids = itertools.count()


def shard(fn: Callable[..., Any], strategy: Any) -> Callable[..., Any]:
    """Wrap ``fn`` so the first operator inside it with matching input ranks gets ``strategy``.

    The strategy has one tuple per operator input (scalars: ``()``), one split count per
    dimension, as in MindSpore. Its validity for the operator's shapes is checked by the search.
    """
    if not callable(fn):
        raise AutoParallelTypeError("fn", fn, "shard wraps a callable, e.g. jnp.matmul")
    checked = check_strategy_shape(strategy, None, "autopar.shard")
    text = repr(checked)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(f"{PREFIX}{next(_ids)}[{text}]"):
            return fn(*args, **kwargs)

    return wrapped


def matmul(a: Any, b: Any, strategy: Any = None) -> Any:
    """``a @ b``, optionally annotated with a MindSpore strategy ``((a splits), (b splits))``."""
    if strategy is None:
        return jnp.matmul(a, b)
    return shard(jnp.matmul, strategy)(a, b)


def parse_scope(entry: str) -> tuple[int, Strategy] | None:
    """``'ap.shard#3[((2, 1), (1, 4))]'`` -> ``(3, ((2, 1), (1, 4)))``; other scopes -> None."""
    if not entry.startswith(PREFIX) or not entry.endswith("]"):
        return None
    ident, _, rest = entry[len(PREFIX):].partition("[")
    return int(ident), tuple(tuple(e) for e in ast.literal_eval(rest[:-1]))
