"""Trace any JAX function into autopar's :class:`~autopar.graph.ir.Graph`.

``trace(fn, *example_args)`` runs ``jax.make_jaxpr`` and walks the jaxpr: nested calls (jit,
closed_call, custom_jvp / custom_vjp, remat) are inlined, every equation becomes a node with a
stable readable name (JAX name stack / ``jax.named_scope`` + primitive + index per scope),
input values are named by their argument pytree path (``params/layer0/w1``), and
unsupported primitives raise one :class:`~autopar.errors.UnsupportedOperatorError` naming each
of the function's, with the user's source line (:mod:`autopar.graph.unsupported`).

>>> import jax, jax.numpy as jnp, autopar
>>> def loss(params, x):
...     with jax.named_scope("layer0"):
...         h = jnp.tanh(x @ params["w"])
...     return jnp.mean(h ** 2)
>>> g = autopar.trace(loss, {"w": jnp.ones((8, 4))}, jnp.ones((2, 8)))
>>> [n.name for n in g.nodes][:2]
['layer0/dot_general_0', 'layer0/tanh_0']
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

import jax
import numpy as np
from jax._src import source_info_util

from autopar.errors import AutoParallelError, AutoParallelTypeError, safe_repr
from autopar.graph.annotate import (apply_parameter_plans, parse_plan_scope, parse_scope,
                                    shards_called, untransformed)
from autopar.graph.custom_rules import RULE_PRIMITIVES, RuleBound, rule_of
from autopar.graph.ir import Graph, Node, Strategy, TensorSpec, Value
from autopar.graph.loops import LOOP_KIND, LOOP_PRIMITIVES, UncountedWhile, emit_loop
from autopar.graph.ops import INLINED, KINDS, flops
from autopar.graph.prng import is_key, itemsize, key_data
from autopar.graph.remat import REMAT_PRIMITIVES, Remat, policy_saves
from autopar.graph.unsupported import body, unsupported_error

__all__ = ["check_arrays", "trace"]


#: dtype -> (its name, bytes per element): ``str(np.dtype(...))`` is slow and a graph has
#: few dtypes, so each is named once per process
_DTYPES: dict[Any, tuple[str, int]] = {}


def _dtype(dtype: Any) -> tuple[str, int]:
    hit = _DTYPES.get(dtype)
    if hit is None:  # (a typed PRNG key's dtype is no NumPy dtype: "key<fry>", its key data)
        name = str(dtype) if is_key(dtype) else str(np.dtype(dtype))
        hit = _DTYPES[dtype] = (name, itemsize(name))
    return hit


def _const_data(c: Any) -> np.ndarray:
    """A constant's data on the host; a key array's: its key data (:mod:`autopar.graph.prng`)."""
    dtype = getattr(c, "dtype", None)
    return key_data(c) if dtype is not None and is_key(dtype) else np.asarray(c)


def traced_dtype(x: Any) -> str:
    """The dtype JAX traces ``x`` at: a 64-bit NumPy array's 32-bit one when x64 is off, a
    Python number's default (``2.0``: float32). The one rule for checking an argument's
    dtype against the traced example's. What JAX cannot take (a string, a date) is named by
    its own dtype or type, so the comparison fails with autopar's error, not JAX's."""
    if isinstance(x, (str, bytes)):  # (result_type would read "2.0" as a dtype name)
        return type(x).__name__
    try:
        return str(np.dtype(jax.dtypes.canonicalize_dtype(jax.dtypes.result_type(x))))
    except (TypeError, ValueError):
        return str(getattr(x, "dtype", type(x).__name__))


def _spec(aval: Any) -> TensorSpec:
    return TensorSpec(tuple(map(int, aval.shape)), _dtype(aval.dtype)[0])


def _nbytes(spec: TensorSpec) -> int:
    """``spec.nbytes`` with the itemsize looked up once per dtype."""
    return math.prod(spec.shape) * _dtype(spec.dtype)[1]


def _source(eqn: Any, fallback: str = "<unknown>") -> str:
    """The user's source line of an equation; inside inlined library calls, the call's line."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return fallback
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def _path_str(path: Iterable[Any]) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _arg_names(fn: Callable[..., Any], n: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(n):
        if i < len(params) and params[i].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(params[i].name)
        else:
            names.append(f"arg{i}")
    return names


@dataclass(frozen=True)
class _Passed:
    """A stand-in variable: what a custom function passed through unchanged."""

    aval: Any


@dataclass(frozen=True)
class _CopyEqn:
    """The equation of the guarded ``copy`` node :meth:`_Builder.guard_passed_through`
    emits (the fields :meth:`_Builder.emit` reads)."""

    invars: tuple
    outvars: tuple
    primitive: Any = jax.lax.copy_p
    params: Any = field(default_factory=dict)


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.values: dict[str, Value] = {}
        self.counters: dict[tuple[str, str], int] = {}
        self.literals = 0
        self.pending: dict[int, Strategy] = {}  # annotation id -> strategy, not yet attached
        self.done: set[int] = set()
        self.plans: set[int] = set()  # shard(parameter_plan=...) ids seen while tracing
        self.devices: dict[str, int] = {}  # annotated node -> the devices its Layouts assume
        self.rule: str | None = None  # inside a custom_jvp / custom_vjp body: its rule
        self.remat: str | None = None  # inside a jax.checkpoint call: its region
        self.regions = 0  # the regions met so far
        self.root: Any = None  # the traced jaxpr (where the unsupported primitives are counted)
        # (outer scope, name stack) -> (readable scope, annotation markers, plan ids)
        self.scopes: dict[tuple[tuple[str, ...], Any], tuple[str, list, list[int]]] = {}

    def add_value(self, name: str, value: Value) -> str:
        base, k = name, 1
        while name in self.values:
            name, k = f"{base}~{k}", k + 1
        self.values[name] = Value(name, value.spec, value.kind, value.producer, value.data)
        return name

    def literal(self, lit: Any) -> str:
        data = np.asarray(lit.val)
        name = f"literal_{self.literals}"
        self.literals += 1
        return self.add_value(name, Value(name, _spec(lit.aval), "literal", data=data))

    def read(self, env: dict[Any, str], var: Any) -> str:
        if type(var).__name__ == "Literal":
            return self.literal(var)
        return env[var]

    def run(self, jaxpr: Any, env: dict[Any, str], scope: list[str],
            source: str = "<unknown>") -> None:
        for eqn in jaxpr.eqns:
            prim = eqn.primitive.name
            stack = scope + [s for s in str(eqn.source_info.name_stack).split("/") if s]
            if prim in REMAT_PRIMITIVES and self.remat is None:
                self.remat_call(eqn, env, stack, _source(eqn, source))
                continue
            if prim in INLINED:
                self.inline(eqn, env, stack, _source(eqn, source))
                continue
            if prim in LOOP_PRIMITIVES:  # one loop node, its body traced once
                try:
                    emit_loop(self, eqn, env, stack, _source(eqn, source))
                except UncountedWhile as e:  # (a while of unknown trip count: unsupported)
                    raise unsupported_error(jaxpr if self.root is None else self.root,
                                            frozenset({id(e.eqn)})) from None
                continue
            if prim not in KINDS:  # every one of the function named at once
                raise unsupported_error(jaxpr if self.root is None else self.root)
            self.emit(eqn, env, stack, _source(eqn, source))

    def inline(self, eqn: Any, env: dict[Any, str], stack: list[str], source: str) -> None:
        inner, consts = body(eqn)
        inner_env: dict[Any, str] = {}
        for var, c in zip(inner.constvars, consts):
            inner_env[var] = self.add_value("const", Value("const", _spec(var.aval), "const",
                                                           data=_const_data(c)))
        for var, outer in zip(inner.invars, eqn.invars):
            inner_env[var] = self.read(env, outer)
        name = eqn.params.get("name")
        sub = stack + [str(name)] if isinstance(name, str) and name and name != "<lambda>" \
            else stack
        outer_rule, start = self.rule, len(self.nodes)
        if eqn.primitive.name in RULE_PRIMITIVES:
            self.rule = outer_rule or rule_of(eqn, source)
        try:
            self.run(inner, inner_env, sub, source)
            for outer, var in zip(eqn.outvars, inner.outvars):
                env[outer] = self.read(inner_env, var)
                if self.rule is not None and self.rule != outer_rule:
                    self.guard_passed_through(env, outer, start, stack, source)
        finally:
            self.rule = outer_rule

    def remat_call(self, eqn: Any, env: dict[Any, str], stack: list[str],
                   source: str) -> None:
        """A ``jax.checkpoint`` call: its body inlined, every node it made tagged with its
        region and whether the policy saves it (:mod:`autopar.graph.remat`; a checkpoint
        nested inside is part of this region)."""
        policy = eqn.params.get("policy")
        self.remat = region = f"remat_{self.regions}"
        self.regions += 1
        start = len(self.nodes)
        try:
            self.inline(eqn, env, stack, source)
        finally:
            self.remat = None
        cse = bool(eqn.params.get("prevent_cse", True))
        for i in range(start, len(self.nodes)):
            n = self.nodes[i]
            prim = getattr(n.primitive, "primitive", n.primitive)  # (a RuleBound's own)
            saved = policy_saves(policy, prim, [self.values[v].spec for v in n.inputs],
                                 n.params, n.source) if n.kind != LOOP_KIND else False
            self.nodes[i] = replace(n, remat=Remat(region, policy, saved, cse))

    def guard_passed_through(self, env: dict[Any, str], outer: Any, start: int,
                             stack: list[str], source: str) -> None:
        """An output of a custom function that no node of its body made (the identity of a
        gradient clip) becomes a guarded ``copy`` node (:mod:`autopar.graph.custom_rules`)."""
        made = {n.name for n in self.nodes[start:]}
        if self.values[env[outer]].producer in made or type(outer).__name__ == "DropVar":
            return
        inner = _Passed(outer.aval)
        env[inner] = env[outer]
        self.emit(_CopyEqn((inner,), (outer,)), env, stack, source)
        del env[inner]

    def scope(self, stack: list[str]) -> tuple[str, list]:
        """The readable scope of a name stack and its annotation markers (innermost last);
        parameter plans met on the way are recorded. Parsed once per distinct stack."""
        key = tuple(stack)
        hit = self.scopes.get(key)
        if hit is None:
            readable, markers, plans = [], [], []
            for entry in stack:
                parsed = parse_scope(untransformed(entry))  # (vmap wraps the entries)
                plan = parse_plan_scope(untransformed(entry))
                if plan is not None:
                    plans.append(plan)
                elif parsed is None:
                    readable.append(entry)
                else:
                    markers.append(parsed)
            hit = self.scopes[key] = ("/".join(readable), markers, plans)
        self.plans.update(hit[2])
        return hit[0], hit[1]

    def emit(self, eqn: Any, env: dict[Any, str], stack: list[str], source: str) -> None:
        prim = eqn.primitive.name
        scope, markers = self.scope(stack)
        idx = self.counters.get((scope, prim), 0)
        self.counters[(scope, prim)] = idx + 1
        name = f"{scope}/{prim}_{idx}" if scope else f"{prim}_{idx}"
        inputs = tuple(self.read(env, v) for v in eqn.invars)
        in_values = [self.values[v] for v in inputs]
        in_specs = [v.spec for v in in_values]
        out_specs = [_spec(v.aval) for v in eqn.outvars]
        annotation = None
        for ident, strategy, devices in reversed(markers):  # innermost annotation first
            if ident in self.done:
                continue
            self.pending.setdefault(ident, strategy)
            if [len(e) for e in strategy] == [s.rank for s in in_specs]:
                annotation = strategy
                self.done.add(ident)
                if devices is not None:
                    self.devices[name] = devices
            break
        outputs = []
        for i, (var, spec) in enumerate(zip(eqn.outvars, out_specs)):
            vname = name if len(eqn.outvars) == 1 else f"{name}:{i}"
            vname = self.add_value(vname, Value(vname, spec, "activation", producer=name))
            if type(var).__name__ != "DropVar":
                env[var] = vname
            outputs.append(vname)
        kind = KINDS[prim]
        primitive = eqn.primitive if self.rule is None else RuleBound(eqn.primitive, self.rule)
        self.nodes.append(Node(
            name=name, op=prim, kind=kind, inputs=inputs, outputs=tuple(outputs),
            params=dict(eqn.params), scope=scope, source=source,
            flops=flops(kind, in_specs, out_specs, eqn.params),
            bytes_read=sum(_nbytes(v.spec) for v in in_values if v.kind != "literal"),
            bytes_written=sum(_nbytes(s) for s in out_specs),
            primitive=primitive, annotation=annotation))


#: The deepest pytree :func:`flatten` hands to JAX (a model's parameters nest a few levels)
_MAX_DEPTH = 200


def _deeper_than(tree: Any, limit: int) -> bool:
    """Whether lists, tuples and dicts nest deeper than ``limit`` in ``tree`` (walked
    without recursion)."""
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (list, tuple, dict)):
            if depth >= limit:
                return True
            children = node.values() if isinstance(node, dict) else node
            stack.extend((c, depth + 1) for c in children)
    return False


def flatten(key: str, tree: Any, *, paths: bool = False, **kw: Any) -> Any:
    """``jax.tree_util.tree_flatten(tree)`` (``paths``: ``tree_flatten_with_path``); a tree
    JAX cannot flatten -- nested too deep, or a dict whose keys do not sort (``{"a": x, 1:
    y}``) -- a typed error naming ``key``. The depth is measured first: JAX's flatten of a
    list nested 100,000 deep left the interpreter's recursion count exhausted (every later
    call raised RecursionError)."""
    if _deeper_than(tree, _MAX_DEPTH):
        raise AutoParallelTypeError(key, tree, f"a pytree of arrays nested at most "
                                    f"{_MAX_DEPTH} deep")
    try:
        if paths:
            return jax.tree_util.tree_flatten_with_path(tree, **kw)
        return jax.tree_util.tree_flatten(tree, **kw)
    except (RecursionError, SystemError, ValueError, TypeError) as e:
        raise AutoParallelTypeError(key, tree, "a pytree of arrays JAX can flatten (JAX "
                                    f"said: {str(e).splitlines()[0][:120]})") from None


def check_arrays(key: str, tree: Any, *, none: bool = False) -> None:
    """Every leaf of ``tree`` is an array or a number (what JAX can trace, a typed PRNG key
    array included; ``none``: None too, JAX's empty pytree); else a typed error naming the
    leaf's path, e.g. ``batch[0]`` or ``params['w']``."""
    for path, leaf in flatten(key, tree, paths=True, is_leaf=lambda x: x is None)[0]:
        if leaf is None and none:
            continue
        if leaf is None or isinstance(leaf, (str, bytes)) or not (
                hasattr(leaf, "shape") and hasattr(leaf, "dtype") or
                isinstance(leaf, (int, float, complex, np.number))):
            raise AutoParallelTypeError(f"{key}{jax.tree_util.keystr(path)}", leaf,
                                        "an array or a number")
        bits = 64 if jax.config.jax_enable_x64 else 32  # (a Python int is traced as one)
        if isinstance(leaf, int) and not -2 ** (bits - 1) <= leaf < 2 ** (bits - 1):
            raise AutoParallelError(f"{key}{jax.tree_util.keystr(path)}", leaf,
                                    f"a Python int JAX can hold (int{bits})")


def _none_read(fn: Callable[..., Any], example_args: tuple[Any, ...], err: TypeError) -> None:
    """Raise a typed error naming the None leaves of ``example_args`` (by the function's
    argument names, e.g. ``params['w']``) when the function failed on one (a None is an
    empty pytree to JAX -- equinox's ``eqx.partition`` leaves them -- and must not be read
    as an array); return otherwise."""
    if "NoneType" not in str(err):
        return
    names = _arg_names(fn, len(example_args))
    nones = [names[path[0].idx] + jax.tree_util.keystr(path[1:]) for path, leaf in
             jax.tree_util.tree_flatten_with_path(example_args, is_leaf=lambda x: x is None)[0]
             if leaf is None]
    if nones:
        raise AutoParallelTypeError(
            "None leaves", nones, f"the function read one as an array ({err}); None is an "
            "empty pytree to JAX: pass an array there, or leave it unread (as eqx.combine "
            "does)") from err


def trace(fn: Callable[..., Any], *example_args: Any, param_argnums: Iterable[int] | None = None,
          annotations: Mapping[str, Any] | None = None, name: str | None = None) -> Graph:
    """Trace ``fn(*example_args)`` into a Graph.

    ``param_argnums``: which positional arguments hold parameters (default: the first, when
    there are two or more arguments, as in ``loss(params, *batch)``; none for one argument).
    ``annotations``: strategies by node name (MindSpore tuples), checked and attached.
    """
    if not callable(fn):
        raise AutoParallelTypeError("fn", fn, "trace needs a callable JAX function")
    if name is not None and not isinstance(name, str):
        raise AutoParallelTypeError("name", name, "the graph's name must be a str (or None: "
                                    "the function's name)")
    if annotations is not None and not isinstance(annotations, Mapping):
        raise AutoParallelTypeError("annotations", annotations, "a mapping of node name -> "
                                    "strategy")
    check_arrays("args", example_args, none=True)
    n = len(example_args)
    if param_argnums is None:
        argnums = {0} if n >= 2 else set()
    else:
        try:
            argnums = set(param_argnums)
        except TypeError:
            raise AutoParallelTypeError("param_argnums", param_argnums,
                                        "an iterable of argument positions") from None
        bad = [a for a in argnums if not isinstance(a, int) or isinstance(a, bool)
               or not 0 <= a < n]
        if bad:
            raise AutoParallelError("param_argnums", sorted(argnums, key=safe_repr),
                                    f"positions must be ints in [0, {n}), found "
                                    f"{safe_repr(bad)}")
    with shards_called() as called:
        try:
            closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*example_args)
        except TypeError as err:
            _none_read(fn, example_args, err)
            raise
    leaves, in_tree = jax.tree_util.tree_flatten_with_path(tuple(example_args))
    arg_names = _arg_names(fn, n)
    b = _Builder()
    b.root = closed.jaxpr
    env: dict[Any, str] = {}
    inputs = []
    for var, (path, _) in zip(closed.jaxpr.invars, leaves):
        argnum = path[0].idx
        label = "/".join(p for p in (arg_names[argnum], _path_str(path[1:])) if p)
        kind = "param" if argnum in argnums else "data"
        env[var] = b.add_value(label, Value(label, _spec(var.aval), kind))
        inputs.append(env[var])
    for var, c in zip(closed.jaxpr.constvars, closed.consts):
        env[var] = b.add_value("const", Value("const", _spec(var.aval), "const",
                                              data=_const_data(c)))
    b.run(closed.jaxpr, env, [])
    pending = called | b.pending  # (a shard of a function computing nothing: called only)
    unmatched = sorted(set(pending) - b.done)
    if unmatched:
        strategies = [pending[i] for i in unmatched]
        raise AutoParallelError(
            "strategy", strategies[0], "autopar.shard matched no operator whose input ranks "
            "fit the strategy (one tuple per input, one split count per dimension)",
            "Wrap a single operator, e.g. autopar.shard(jnp.matmul, ((2, 1), (1, 4)))(a, b)")
    outputs = [b.read(env, v) for v in closed.jaxpr.outvars]
    graph = Graph(b.nodes, b.values, inputs, outputs, in_tree=in_tree,
                  out_tree=jax.tree_util.tree_structure(out_shape),
                  name=name or getattr(fn, "__name__", "fn"), layout_devices=b.devices)
    if b.plans:
        graph = apply_parameter_plans(graph, sorted(b.plans))
    return graph.annotate(annotations) if annotations is not None else graph
