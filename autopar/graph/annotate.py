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
import warnings
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from autopar.errors import AutoParallelError, AutoParallelTypeError, AutoParallelWarning
from autopar.graph.ir import Graph, Strategy, check_strategy_shape
from autopar.graph.ms_layout import Layout
from autopar.graph.ops import op_spec

__all__ = ["shard", "matmul", "parse_scope", "parse_plan_scope", "apply_parameter_plans",
           "PREFIX", "PLAN_PREFIX"]

PREFIX = "ap.shard#"
PLAN_PREFIX = "ap.plan#"
_ids = itertools.count()
_PLANS: dict[int, dict[str, tuple[int, ...]]] = {}  # shard(parameter_plan=...) by scope id


def shard(fn: Callable[..., Any], in_strategy: Any, out_strategy: Any = None,
          parameter_plan: Mapping[str, Any] | None = None, device: str = "Ascend",
          level: int = 0) -> Callable[..., Any]:
    """Wrap ``fn`` so the first operator inside it with matching input ranks gets
    ``in_strategy`` -- MindSpore's ``shard(fn, in_strategy, out_strategy=None,
    parameter_plan=None, device="Ascend", level=0)``.

    ``in_strategy`` has one entry per operator input: a tuple of split counts (scalars: ``()``)
    or a :class:`~autopar.graph.ms_layout.Layout` called with its aliases. ``out_strategy``
    is checked and, as in MindSpore's ``ms.shard`` ("not in use right now"), not enforced:
    autopar warns (an operator's output follows its inputs' splits; the search redistributes
    it for the consumers). ``parameter_plan``: ``{parameter name: strategy}``; every operator
    reading that parameter is fixed at its layout (see :func:`apply_parameter_plans`).
    ``device`` and ``level`` are checked and unused, as in MindSpore.
    """
    if not callable(fn):
        raise AutoParallelTypeError("fn", fn, "shard wraps a callable, e.g. jnp.matmul")
    _check_entries(in_strategy, "in_strategy")
    checked = check_strategy_shape(in_strategy, None, "autopar.shard")
    _check_out_strategy(out_strategy)
    if not isinstance(device, str):
        raise AutoParallelTypeError("device", device, "must be a str (unused: 'Ascend', 'GPU' "
                                    "or 'CPU')")
    if not isinstance(level, int) or isinstance(level, bool):
        raise AutoParallelTypeError("level", level, "must be an int (unused)")
    plan_id = _register_plan(parameter_plan)
    text = repr(checked)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(f"{PREFIX}{next(_ids)}[{text}]"):
            if plan_id is None:
                return fn(*args, **kwargs)
            with jax.named_scope(f"{PLAN_PREFIX}{plan_id}"):
                return fn(*args, **kwargs)

    return wrapped


def _check_entries(strategy: Any, key: str) -> None:
    """MindSpore's ``None`` entry (data parallel) needs device_num, unknown when wrapping."""
    if isinstance(strategy, (tuple, list)):
        for i, e in enumerate(strategy):
            if e is None:
                raise AutoParallelError(key, strategy, f"entry [{i}] is None (MindSpore: data "
                                        "parallel); autopar needs the split counts here",
                                        "Give the tuple, e.g. (8, 1) for 8 devices")


def _check_out_strategy(out_strategy: Any) -> None:
    if out_strategy is None:
        return
    if not isinstance(out_strategy, tuple):
        raise AutoParallelTypeError("out_strategy", out_strategy, "must be None or a tuple")
    _check_entries(out_strategy, "out_strategy")
    check_strategy_shape(out_strategy, None, "out_strategy")
    warnings.warn("out_strategy is checked but not enforced (as in MindSpore's ms.shard, where "
                  "it is not in use): an operator's output follows its input splits, and the "
                  "search redistributes it where its consumers need another layout",
                  AutoParallelWarning, stacklevel=3)


def _register_plan(parameter_plan: Any) -> int | None:
    if parameter_plan is None:
        return None
    if not isinstance(parameter_plan, Mapping):
        raise AutoParallelTypeError("parameter_plan", parameter_plan,
                                    "must be a dict {parameter name: strategy} or None")
    plan = {}
    for name, entry in parameter_plan.items():
        if not isinstance(name, str):
            raise AutoParallelTypeError("parameter_plan", name, "keys are parameter names (str)")
        if isinstance(entry, Layout):
            entry = entry.split_counts()
        plan[name] = check_strategy_shape((entry,), None, f"parameter_plan[{name!r}]")[0]
    ident = next(_ids)
    _PLANS[ident] = plan
    return ident


def parse_plan_scope(entry: str) -> int | None:
    """``'ap.plan#5'`` -> 5 (a registered parameter plan); other scopes -> None."""
    if entry.startswith(PLAN_PREFIX) and entry[len(PLAN_PREFIX):].isdigit():
        return int(entry[len(PLAN_PREFIX):])
    return None


def _param_matches(value_name: str, key: str) -> bool:
    """MindSpore names (``self.dense.w``, ``blocks.0.w1``) against pytree paths
    (``params/dense/w``): ``.`` and ``/`` alike, the argument name optional."""
    key = key.removeprefix("self.").replace(".", "/")
    value_name = value_name.replace(".", "/")
    return value_name == key or value_name.endswith("/" + key)


def apply_parameter_plans(graph: Graph, plan_ids: list[int]) -> Graph:
    """Fix every operator reading a planned parameter at the parameter's layout: the
    operator's loop dims of that input take the plan's splits, its other dims stay whole
    (autopar fixes whole operators; a parameter layout with a free consumer would need the
    search to choose among partial strategies). An operator already annotated must agree.
    Unknown names are warned about and ignored, as MindSpore does."""
    new: dict[str, Strategy] = {}
    for ident in plan_ids:
        for key, entry in _PLANS[ident].items():
            found_params = [p for p in graph.parameters() if _param_matches(p, key)]
            if not found_params:
                warnings.warn(f"parameter_plan: no parameter {key!r} in the graph (its "
                              f"parameters: {list(graph.parameters())}); ignored, as in "
                              "MindSpore", AutoParallelWarning, stacklevel=4)
            elif len(found_params) > 1:
                raise AutoParallelError("parameter_plan", key, f"names several parameters "
                                        f"{found_params}", "Use the full name, e.g. "
                                        f"{found_params[0].partition('/')[2].replace('/', '.')!r}")
            for p in found_params:
                _plan_consumers(graph, p, entry, new)
    return graph.annotate(new) if new else graph


def _plan_consumers(graph: Graph, p: str, entry: tuple[int, ...],
                    new: dict[str, Strategy]) -> None:
    shape = graph.spec(p).shape
    if len(entry) != len(shape) or any(d % s for d, s in zip(shape, entry)):
        raise AutoParallelError(f"parameter_plan for {p!r}", entry, f"needs one split count "
                                f"per dimension of shape {shape}, each dividing its size")
    for name in graph.consumers(p):
        node = graph.node(name)
        spec = op_spec(node, graph)
        current = new.get(name) or node.annotation
        for j, v in enumerate(node.inputs):
            if v != p:
                continue
            splits = {m: s for m, s in zip(spec.in_maps[j], entry) if m is not None}
            wanted = tuple(tuple(entry) if i == j or node.inputs[i] == p else
                           tuple(splits.get(m, 1) if m is not None else 1 for m in mp)
                           for i, mp in enumerate(spec.in_maps))
            if current is not None and current[j] != tuple(entry):
                raise AutoParallelError(f"parameter_plan for {p!r}", entry, f"node {name!r} "
                                        f"already has strategy {current}, which gives this "
                                        f"parameter {current[j]}")
            new[name] = current if current is not None else wanted


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
