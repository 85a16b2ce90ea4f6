"""Semi-auto annotations inside user code: attach a MindSpore strategy to an operator.

``autopar.shard(fn, strategy)`` wraps a function (typically one operator, e.g. ``jnp.matmul``)
so that the first operator traced inside it whose input ranks fit the strategy gets that
strategy, like MindSpore's ``ops.MatMul().shard(((2, 1), (1, 4)))``. ``autopar.matmul(a, b,
strategy=...)`` is the common case. The annotation travels through ``jax.make_jaxpr`` as a
``jax.named_scope`` entry (``ap.shard#<token>.<k>[<strategy>]``, the token drawn once per
process: a user's scope that merely starts alike is the user's), which the tracer reads and
strips from node names, so it survives jit, custom_jvp and remat. Outside tracing it costs
nothing.

>>> import jax.numpy as jnp, autopar
>>> def f(x, w):
...     return autopar.matmul(x, w, strategy=((2, 1), (1, 4)))
>>> g = autopar.trace(f, jnp.ones((8, 16)), jnp.ones((16, 4)))
>>> g.node("dot_general_0").annotation
((2, 1), (1, 4))
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import itertools
import re
import secrets
import warnings
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp

from autopar.errors import AutoParallelError, AutoParallelTypeError, AutoParallelWarning
from autopar.graph.ir import Graph, Strategy, check_strategy_shape
from autopar.graph.ms_layout import Layout, layout_devices

__all__ = ["shard", "matmul", "parse_scope", "parse_plan_scope", "apply_parameter_plans",
           "shards_called", "PREFIX", "PLAN_PREFIX"]

PREFIX = "ap.shard#"
PLAN_PREFIX = "ap.plan#"
#: Drawn once per process and part of every scope autopar makes (after the prefix): a user's
#: ``jax.named_scope`` that starts like one (``ap.shard#1[...]``) stays a plain scope, never
#: read as a strategy nor refused
_TOKEN = secrets.token_hex(4)
_ids = itertools.count()
#: shard(parameter_plan=...) by scope id: (plan, the device count its Layouts assume); one id
#: per distinct plan (a shard called at every trace registers nothing new)
_PLANS: dict[int, tuple[dict[str, tuple[int, ...]], int | None]] = {}
_PLAN_IDS: dict[tuple, int] = {}
#: inside :func:`shards_called`: the shards called while tracing (id -> strategy)
_CALLED: contextvars.ContextVar[dict[int, Strategy] | None] = contextvars.ContextVar(
    "autopar_shards_called", default=None)
#: a JAX transformation's wrapping of a name-stack entry: ``vmap(ap.shard#0[...])``
_TRANSFORMED = re.compile(r"^[A-Za-z_]\w*\((.*)\)$")


@contextlib.contextmanager
def shards_called() -> Iterator[dict[int, Strategy]]:
    """Collect the shards called inside the block (the tracer's ``make_jaxpr``): a shard
    whose function computes nothing leaves no scope on any operator, yet must match one."""
    called: dict[int, Strategy] = {}
    token = _CALLED.set(called)
    try:
        yield called
    finally:
        _CALLED.reset(token)


def untransformed(entry: str) -> str:
    """A name-stack entry without the transformations JAX wrapped it in
    (``vmap(ap.shard#0[...])`` -> ``ap.shard#0[...]``)."""
    while (m := _TRANSFORMED.match(entry)) is not None:
        entry = m.group(1)
    return entry


def shard(fn: Callable[..., Any], in_strategy: Any, out_strategy: Any = None,
          parameter_plan: Mapping[str, Any] | None = None, device: str = "Ascend",
          level: int = 0) -> Callable[..., Any]:
    """Wrap ``fn`` so the first operator inside it with matching input ranks gets
    ``in_strategy`` -- MindSpore's ``shard(fn, in_strategy, out_strategy=None,
    parameter_plan=None, device="Ascend", level=0)``.

    ``in_strategy`` has one entry per operator input: a tuple of split counts (scalars: ``()``)
    or a :class:`~autopar.graph.ms_layout.Layout` called with its aliases (its device matrix
    must have device_num devices: the search checks it, as for ``fixed=``). ``out_strategy``
    is checked and, as in MindSpore's ``ms.shard`` ("not in use right now"), not enforced:
    autopar warns (an operator's output follows its inputs' splits; the search redistributes
    it for the consumers). ``parameter_plan``: ``{parameter name: strategy}``: the parameter is
    stored at that layout, its readers stay free (see :func:`apply_parameter_plans`).
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
    plan_values = list(parameter_plan.values()) if isinstance(parameter_plan, Mapping) else []
    devices = layout_devices([*in_strategy, *plan_values] if isinstance(
        in_strategy, (tuple, list)) else plan_values, "in_strategy and parameter_plan")
    plan_id = _register_plan(parameter_plan, devices)
    text = repr(checked) if devices is None else f"{checked!r}@{devices}"

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        ident = next(_ids)
        called = _CALLED.get()
        if called is not None:
            called[ident] = checked
        with jax.named_scope(f"{PREFIX}{_TOKEN}.{ident}[{text}]"):
            if plan_id is None:
                return fn(*args, **kwargs)
            with jax.named_scope(f"{PLAN_PREFIX}{_TOKEN}.{plan_id}"):
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


def _register_plan(parameter_plan: Any, devices: int | None) -> int | None:
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
    key = (tuple(plan.items()), devices)
    ident = _PLAN_IDS.get(key)
    if ident is None:
        ident = _PLAN_IDS[key] = next(_ids)
        _PLANS[ident] = (plan, devices)
    return ident


def parse_plan_scope(entry: str) -> int | None:
    """``'ap.plan#<token>.5'`` -> 5 (a registered parameter plan); other scopes -> None."""
    head = f"{PLAN_PREFIX}{_TOKEN}."
    ident = entry[len(head):]
    if entry.startswith(head) and ident.isascii() and ident.isdigit() and int(ident) in _PLANS:
        return int(ident)
    return None


def _param_matches(value_name: str, key: str) -> bool:
    """MindSpore names (``self.dense.w``, ``blocks.0.w1``) against pytree paths
    (``params/dense/w``): ``.`` and ``/`` alike, the argument name optional."""
    key = key.removeprefix("self.").replace(".", "/")
    value_name = value_name.replace(".", "/")
    return value_name == key or value_name.endswith("/" + key)


def apply_parameter_plans(graph: Graph, plan_ids: list[int]) -> Graph:
    """Store every planned parameter at the plan's split counts, as MindSpore does: only the
    parameter is fixed; the operators reading it are searched like any other, and where one
    reads it in another layout the search prices (and the rewrite inserts) the
    redistribution. Two plans giving one parameter different layouts are refused. Unknown
    names are warned about and ignored, as MindSpore does."""
    fixed: dict[str, tuple[int, ...]] = {}
    devices: dict[str, int] = {}
    for ident in plan_ids:
        plan, count = _PLANS[ident]
        for key, entry in plan.items():
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
                _check_plan(graph, p, entry, fixed.get(p))
                fixed[p] = entry
                if count is not None:
                    devices[p] = count
    return graph.fix_parameters(fixed, devices) if fixed else graph


def _check_plan(graph: Graph, p: str, entry: tuple[int, ...],
                before: tuple[int, ...] | None) -> None:
    shape = graph.spec(p).shape
    if len(entry) != len(shape) or any(d % s for d, s in zip(shape, entry)):
        raise AutoParallelError(f"parameter_plan for {p!r}", entry, f"needs one split count "
                                f"per dimension of shape {shape}, each dividing its size")
    if before is not None and before != tuple(entry):
        raise AutoParallelError(f"parameter_plan for {p!r}", entry, f"another parameter_plan "
                                f"already gives this parameter {before}")


def matmul(a: Any, b: Any, strategy: Any = None) -> Any:
    """``a @ b``, optionally annotated with a MindSpore strategy ``((a splits), (b splits))``."""
    if strategy is None:
        return jnp.matmul(a, b)
    return shard(jnp.matmul, strategy)(a, b)


def parse_scope(entry: str) -> tuple[int, Strategy, int | None] | None:
    """``'ap.shard#<token>.3[((2, 1), (1, 4))]'`` -> ``(3, ((2, 1), (1, 4)), None)``, and
    with the device count its Layouts assume, ``'...[((2, 1), (1, 4))@8]'`` -> ``(..., 8)``;
    other scopes (a user's, whatever it starts with) -> None."""
    head = f"{PREFIX}{_TOKEN}."
    if not entry.startswith(head) or not entry.endswith("]"):
        return None
    ident, _, rest = entry[len(head):].partition("[")
    text, _, devices = rest[:-1].partition("@")
    return (int(ident), tuple(tuple(e) for e in ast.literal_eval(text)),
            int(devices) if devices else None)
