"""Gradient buckets: which gradients one fused collective carries (allreduce, allgather,
reducescatter), designed once for every fusion setting MindSpore and HCCL offer.

The input is the gradients in the order backward produces them (``Graph.gradient_order()``),
each with its bytes per device (the full parameter without a plan; the local shard with one).
A bucket is a contiguous run of that order. The modes:

============================  ===================================================================
mode                          boundaries
============================  ===================================================================
``index`` (MindSpore)         ``all_reduce_fusion_config`` / ``comm_fusion`` allreduce index:
                              split *points*, exclusive. ``[20, 35]`` -> gradients 0..19,
                              20..34, 35..end. A point must be in ``[1, n]``; ``n`` means
                              "no rest" (MindSpore's ``[8, 160]`` on ResNet-50's 161).
``size`` / ``auto``           greedy in gradient order: a bucket closes when adding the next
                              gradient would pass the threshold (auto: 64 MB = 64 MiB). A
                              gradient larger than the threshold is never split: it gets a
                              bucket of its own (which exceeds the threshold).
``hccl_size``                 HCCL ``set_split_strategy_by_size``: percentages of the total
                              bytes, at most 8. Rounding rule: segment k ends at the *first*
                              gradient at which the cumulative bytes reach the cumulative
                              percentage (``cum_bytes >= cum_pct / 100 * total``, relative
                              tolerance 1e-9); the last segment ends at the last gradient. A
                              gradient is never split; a segment left empty (0 %, or a
                              percentage smaller than the gradient that closed the previous
                              segment) is dropped.
``hccl_index``                HCCL ``set_split_strategy_by_idx``: inclusive end indices into the
                              backward order. ``[20, 100, 159]`` on 161 gradients -> 0..20,
                              21..100, 101..159, 160 (the rest). An index must be ``< n``;
                              at most 8 segments including the rest.
``none``                      one bucket per gradient (MindSpore's "fusion closed").
============================  ===================================================================

Every index (MindSpore's and HCCL's) refers to the **backward order** above: index 0 is the
first gradient produced (for ResNet-50 ``fc/b``), index n-1 the last (``stem/conv/w``). For
``allgather`` (the parallel optimizer's weight gathers) a graph's parameters are taken in
forward (first-use) order instead, the order the gathers are needed.

Precedence of :func:`gradient_buckets` for allreduce (``policy="context"``, the default):

1. ``comm_fusion["allreduce"]`` set in the context (``all_reduce_fusion_config`` included);
2. else an HCCL split strategy set for the group with ``set_split_strategy_by_size`` /
   ``set_split_strategy_by_idx`` (size wins over index, as HCCL says);
3. else fusion closed: one bucket per gradient (MindSpore: "if it is not set, the fusion is
   closed").

``policy="hccl"`` opts into HCCL's effective strategy instead, *including* its default
``[96.54, 3.46]`` when nothing was set (the context's comm_fusion is not consulted);
``policy="none"`` closes fusion. allgather / reducescatter use only their comm_fusion entry.

>>> grads = [("c", 40), ("b", 30), ("a", 30)]
>>> [b.gradients for b in buckets_by_index(grads, [1])]
[('c',), ('b', 'a')]
>>> [b.gradients for b in buckets_by_percent(grads, [50, 50])]
[('c', 'b'), ('a',)]
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Sequence

from autopar.comm_groups import WORLD_GROUP
from autopar.errors import AutoParallelError, AutoParallelTypeError, found
from autopar.limits import finite
from autopar.split_strategies import MAX_SEGMENTS, check_percentages, get_split_strategy
from autopar.text import table as text_table

__all__ = [
    "MB",
    "fusion_config",
    "MAX_GRADIENT_BYTES",
    "BUCKET_POLICIES",
    "Gradient",
    "Bucket",
    "GradientBuckets",
    "gradients",
    "buckets_from_ends",
    "buckets_by_index",
    "buckets_by_size",
    "buckets_by_percent",
    "buckets_per_gradient",
    "buckets_pytorch_ddp",
    "percent_ends",
    "gradient_buckets",
]

MB = 1024 * 1024
_KINDS = ("allreduce", "allgather", "reducescatter")
#: The bucket policies by name (a policy string of simulate(buckets=...) and friends)
BUCKET_POLICIES = ("context", "hccl", "none")
_PCT_TOL = 1e-9
#: The largest gradient accepted, in bytes (4 EiB): sums and percentages of real gradients stay
#: far inside a double's range.
MAX_GRADIENT_BYTES = 2**62


@dataclass(frozen=True, slots=True)
class Gradient:
    """One gradient: its parameter name, bytes per device, and the mesh axes of its all-reduce
    (``None``: every device, the data-parallel case without a plan)."""

    name: str
    nbytes: int
    axes: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Bucket:
    """One fused collective: gradients ``first..last`` (inclusive, backward-order indices)."""

    index: int
    gradients: tuple[str, ...]
    nbytes: int
    first: int
    last: int

    def __len__(self) -> int:
        return len(self.gradients)


def fusion_config(ends: Sequence[int]) -> tuple[int, ...]:
    """The ``all_reduce_fusion_config`` split points of buckets ending (exclusive) at
    ``ends``: every end but the last (the number of gradients, which closes the last bucket
    anyway), or that one alone for a single bucket (an empty list is not a setting).

    >>> fusion_config((5, 12, 21)), fusion_config((21,))
    ((5, 12), (21,))
    """
    return tuple(ends[:-1]) or tuple(ends[-1:])


@dataclass(frozen=True, slots=True)
class GradientBuckets:
    """The buckets of one collective kind, with where the setting came from.

    ``source`` says which rule applied (e.g. ``"HCCL default split [96.54, 3.46]"``).
    """

    kind: str
    mode: str
    source: str
    buckets: tuple[Bucket, ...]
    gradients: tuple[Gradient, ...]

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self) -> Iterator[Bucket]:
        return iter(self.buckets)

    def __getitem__(self, i: int) -> Bucket:
        return self.buckets[i]

    @property
    def total_bytes(self) -> int:
        return sum(g.nbytes for g in self.gradients)

    @property
    def ends(self) -> tuple[int, ...]:
        """Exclusive end of every bucket (the last is the number of gradients)."""
        return tuple(b.last + 1 for b in self.buckets)

    @property
    def hccl_indices(self) -> tuple[int, ...]:
        """Inclusive end indices, HCCL ``set_split_strategy_by_idx`` style (last = n - 1)."""
        return tuple(b.last for b in self.buckets)

    @property
    def fusion_config(self) -> tuple[int, ...]:
        """MindSpore ``all_reduce_fusion_config`` split points giving these buckets."""
        return fusion_config(self.ends)

    @property
    def percentages(self) -> tuple[float, ...]:
        """Each bucket's share of the bytes, in percent (exact, not rounded)."""
        total = self.total_bytes
        return tuple(100.0 * b.nbytes / total if total else 0.0 for b in self.buckets)

    def table(self) -> str:
        """A readable table: bucket, index range, count, MB, %, cumulative %, names."""
        rows = [("bucket", "gradients", "count", "MB", "%", "cum %", "first -> last")]
        total, cum = self.total_bytes, 0
        for b in self.buckets:
            cum += b.nbytes
            pct = 100.0 * b.nbytes / total if total else 0.0
            rows.append((str(b.index), f"{b.first}..{b.last}", str(len(b)),
                         f"{b.nbytes / MB:.3f}", f"{pct:.2f}",
                         f"{100.0 * cum / total if total else 0.0:.2f}",
                         b.gradients[0] if len(b) == 1 else
                         f"{b.gradients[0]} -> {b.gradients[-1]}"))
        lines = text_table(rows, align="l" * len(rows[0])).split("\n")
        lines.append(f"{self.kind}: {len(self.buckets)} bucket(s) over {len(self.gradients)} "
                     f"gradients, {total / MB:.3f} MB; {self.source}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# ---------------------------------------------------------------------------- gradients


def _gradient(i: int, g: Any) -> Gradient:
    """Entry ``i`` of a gradient list, checked."""
    if isinstance(g, Gradient):
        item = g
    elif isinstance(g, (list, tuple)) and len(g) == 2:
        item = Gradient(g[0], g[1])  # type: ignore[arg-type]
    else:
        raise AutoParallelTypeError("gradients", g, "each gradient is a (name, nbytes) pair")
    if not isinstance(item.name, str):
        raise AutoParallelTypeError("gradients", item.name, "gradient names are str")
    if isinstance(item.nbytes, bool) or not isinstance(item.nbytes, int):
        raise AutoParallelTypeError("gradients", item.nbytes,
                                    f"bytes of gradient {item.name!r} must be an int")
    if not 0 <= item.nbytes <= MAX_GRADIENT_BYTES:
        raise AutoParallelError("gradients", item.nbytes, f"bytes of gradient {item.name!r} "
                                f"at [{i}] must be >= 0 and at most 2**62")
    return item


def _check_gradients(grads: Any) -> tuple[Gradient, ...]:
    if isinstance(grads, (str, bytes)) or not isinstance(grads, (list, tuple)):
        raise AutoParallelTypeError("gradients", grads, "a list of (name, nbytes) pairs or "
                                    "autopar.fusion.Gradient, in backward order")
    out: list[Gradient] = []
    seen: set[str] = set()
    for i, g in enumerate(grads):
        item = _gradient(i, g)
        if item.name in seen:
            raise AutoParallelError("gradients", item.name, "gradient names must be unique")
        seen.add(item.name)
        out.append(item)
    if not out:
        raise AutoParallelError("gradients", list(grads), "there are no gradients to bucket",
                                "The graph has no parameters")
    return tuple(out)


def _readers(graph: Any, name: str, derived: frozenset[str]) -> list[tuple[str, int, str]]:
    """(operator, input position, value) of every read of parameter ``name`` and of the values
    computed from parameters alone that it flows into (a broadcast of it, a cast):
    :func:`~autopar.strategies.problem.parameter_values`, whose gradients the training step
    reduces with the parameter's and the cost model prices as its synchronisation."""
    out, todo, seen = [], [name], {name}
    while todo:
        v = todo.pop(0)
        for c in graph.consumers(v):
            node = graph.node(c)
            out += [(c, j, v) for j, inp in enumerate(node.inputs) if inp == v]
            for o in node.outputs:
                if o in derived and o not in seen:
                    seen.add(o)
                    todo.append(o)
    return out


def _plan_gradient(graph: Any, plan: Any, name: str, derived: frozenset[str]) -> Gradient:
    """(local bytes, all-reduce axes) of one parameter's gradient under a plan.

    As strategies/problem.py prices it: per operator reading it (or a value computed from it
    alone, :func:`_readers`), the gradient is all-reduced over the axes the operator uses
    where that input (its layout) is replicated. Over several readers: the union of axes and
    the largest local block.
    """
    mesh = plan.mesh
    spec = graph.spec(name)
    axes: set[str] = set()
    nbytes = 0
    readers = [r for r in _readers(graph, name, derived) if r[0] in plan.nodes]
    for c, j, v in readers:
        ns, vspec = plan.nodes[c], graph.spec(v)
        used = frozenset().union(*(lay.used_axes() for lay in ns.in_layouts + ns.out_layouts))
        lay = ns.in_layouts[j]
        axes |= used - lay.used_axes()
        nbytes = max(nbytes, math.prod(lay.local_shape(vspec.shape, mesh)) * vspec.itemsize)
    if not readers:  # unused: a zero gradient, synchronised where it is replicated
        lay = plan.layout(name)
        axes = set(mesh.names) - lay.used_axes()
        nbytes = math.prod(lay.local_shape(spec.shape, mesh)) * spec.itemsize
    return Gradient(name, int(nbytes), tuple(a for a in mesh.names if a in axes))


def gradients(graph: Any, plan: Any = None, *, order: str = "backward") -> tuple[Gradient, ...]:
    """The gradients of a graph's parameters in backward order, with bytes per device.

    Without a plan: full parameter bytes, all-reduced over every device. With a plan: the
    local shard's bytes and the axes where it is replicated (see :func:`_plan_gradient`).
    ``order="forward"`` gives first-use order (for allgather).

    >>> import jax.numpy as jnp, autopar
    >>> g = autopar.trace(lambda params, x: (x @ params["a"] @ params["b"]).sum(),
    ...                   {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 2))}, jnp.ones((2, 4)))
    >>> [(x.name, x.nbytes) for x in gradients(g)]
    [('params/b', 32), ('params/a', 64)]
    """
    from autopar.graph.ir import Graph

    if not isinstance(graph, Graph):
        raise AutoParallelTypeError("graph", graph, "an autopar.Graph from autopar.trace")
    if order not in ("backward", "forward"):
        raise AutoParallelError("order", order, "must be 'backward' or 'forward'")
    names = graph.gradient_order()
    if order == "forward":
        names = names[::-1]
    if plan is None:
        return tuple(Gradient(p, graph.spec(p).nbytes) for p in names)
    _check_plan(graph, plan)
    from autopar.strategies.problem import parameter_values

    derived = parameter_values(graph)
    return tuple(_plan_gradient(graph, plan, p, derived) for p in names)


def _check_plan(graph: Any, plan: Any) -> None:
    from autopar.strategies.plan import Plan

    if not isinstance(plan, Plan):
        raise AutoParallelTypeError("plan", plan, "an autopar.Plan from autopar.search")
    if not plan.searched_on(graph):  # the very graph searched: no hashing
        raise AutoParallelError("plan", f"plan for graph {plan.fingerprint[:12]}",
                                f"it was searched for another graph (this graph's fingerprint "
                                f"is {graph.fingerprint()[:12]})",
                                "Search the plan for this graph")


# ---------------------------------------------------------------------------- bucketing rules


def buckets_from_ends(grads: Any, ends: Sequence[int], *, kind: str = "allreduce",
                      mode: str = "custom", source: str = "explicit boundaries") \
        -> GradientBuckets:
    """Buckets ending (exclusive) at ``ends``; the last end must be the number of gradients.

    >>> buckets_from_ends([("x", 1), ("y", 2), ("z", 3)], [2, 3]).hccl_indices
    (1, 2)
    """
    gs = _check_gradients(grads)
    n = len(gs)
    ends = _int_list("ends", ends, "bucket ends")
    if ends[-1] != n or ends[0] <= 0:
        raise AutoParallelError("ends", ends, f"bucket ends must be strictly ascending, "
                                f"positive, and end at the number of gradients ({n})")
    out, start = [], 0
    for k, e in enumerate(ends):
        part = gs[start:e]
        out.append(Bucket(k, tuple(g.name for g in part), sum(g.nbytes for g in part),
                          start, e - 1))
        start = e
    return GradientBuckets(kind, mode, source, tuple(out), gs)


def _int_list(key: str, values: Any, what: str) -> list[int]:
    if not isinstance(values, (list, tuple, range)):
        raise AutoParallelTypeError(key, values, f"{what} must be a list of ints")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise AutoParallelTypeError(key, values, f"{what} must contain only ints, "
                                        + found(v, f"[{i}]"))
    if not values:
        raise AutoParallelError(key, list(values), f"{what} must not be empty")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise AutoParallelError(key, list(values), f"{what} must be strictly ascending")
    return list(values)


def buckets_by_index(grads: Any, indices: Sequence[int], *,
                     convention: Literal["mindspore", "hccl"] = "mindspore",
                     kind: str = "allreduce", source: str | None = None) -> GradientBuckets:
    """Buckets at gradient indices (backward order).

    ``convention="mindspore"``: exclusive split points (``all_reduce_fusion_config``):
    ``[20, 35]`` -> 0..19, 20..34, 35..end; each point in ``[1, n]``.
    ``convention="hccl"``: inclusive ends (``set_split_strategy_by_idx``): ``[20, 100, 159]``
    -> 0..20, 21..100, 101..159, then the rest; each index ``< n``; at most 8 segments.

    >>> g = [(f"g{i}", 4) for i in range(5)]
    >>> buckets_by_index(g, [2], convention="mindspore").ends
    (2, 5)
    >>> buckets_by_index(g, [2], convention="hccl").ends
    (3, 5)
    """
    gs = _check_gradients(grads)
    n = len(gs)
    if convention == "mindspore":
        key = "all_reduce_fusion_config"
        idx = _int_list(key, indices, "fusion split indices")
        bad = [i for i in idx if not 1 <= i <= n]
        if bad:
            raise AutoParallelError(
                key, idx, f"split indices must be in [1, {n}] for {n} gradients (index i "
                f"closes a bucket before gradient i, in backward order); {bad} out of range",
                f"Use indices from 1 to {n}; see autopar.simulation.gradient_buckets(...)"
                ".table()")
        ends = [i for i in idx if i < n] + [n]
        src = source or f"MindSpore index split points {idx}"
    elif convention == "hccl":
        key = "idxList"
        idx = _int_list(key, indices, "gradient end indices")
        bad = [i for i in idx if not 0 <= i < n]
        if bad:
            raise AutoParallelError(
                key, idx, f"end indices must be in [0, {n - 1}] for {n} gradients (backward "
                f"order, inclusive ends); {bad} out of range", f"The last gradient is {n - 1}")
        ends = [i + 1 for i in idx] + ([n] if idx[-1] < n - 1 else [])
        if len(ends) > MAX_SEGMENTS:
            raise AutoParallelError(
                key, idx, f"at most {MAX_SEGMENTS} gradient segments are supported; these "
                f"indices make {len(ends)} (the gradients after the last index form one more)",
                f"End the list at the last gradient, {n - 1}")
        src = source or f"HCCL index end indices {idx}"
    else:
        raise AutoParallelError("convention", convention, "must be 'mindspore' or 'hccl'")
    return buckets_from_ends(gs, ends, kind=kind, mode="index" if convention == "mindspore"
                             else "hccl_index", source=src)


def buckets_by_size(grads: Any, threshold_bytes: int | float, *, kind: str = "allreduce",
                    mode: str = "size", source: str | None = None) -> GradientBuckets:
    """Greedy buckets (MindSpore size / auto): a bucket closes when adding the next gradient
    would pass ``threshold_bytes``. A gradient larger than the threshold gets its own bucket.

    >>> buckets_by_size([("a", 3), ("b", 3), ("c", 9), ("d", 1)], 6).ends
    (2, 3, 4)
    """
    gs = _check_gradients(grads)
    _positive("threshold_bytes", threshold_bytes, "the fusion threshold")
    ends, cur = [], 0
    for i, g in enumerate(gs):
        if i > (ends[-1] if ends else 0) and cur + g.nbytes > threshold_bytes:
            ends.append(i)  # the open bucket is not empty and g would pass the threshold
            cur = 0
        cur += g.nbytes
    ends.append(len(gs))
    src = source or f"size threshold {threshold_bytes / MB:g} MB"
    return buckets_from_ends(gs, ends, kind=kind, mode=mode, source=src)


def _positive(key: str, value: Any, what: str) -> int | float:
    """The one rule of a size or cap: a finite number (int or float, not bool) above 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AutoParallelTypeError(key, value, f"{what} must be a number")
    if not finite(value) or value <= 0:  # (an int past a double's range is not)
        raise AutoParallelError(key, value, f"{what} must be a finite number larger than 0")
    return value


def percent_ends(sizes: Sequence[int], percentages: Sequence[float]) -> list[int]:
    """Exclusive bucket ends of a percentage split (the rounding rule of the module doc).

    >>> percent_ends([10, 80, 10], [50, 50]), percent_ends([10, 80, 10], [0, 95, 5])
    ([2, 3], [3])
    """
    n, total = len(sizes), sum(sizes)
    cum = list(itertools.accumulate(sizes))
    ends: list[int] = []
    prev = 0  # gradients placed so far
    for k in range(len(percentages) - 1):
        target = total * math.fsum(percentages[:k + 1]) / 100.0 - _PCT_TOL * total
        if (cum[prev - 1] if prev else 0) >= target:
            continue  # already reached: an empty segment, dropped
        end = bisect.bisect_left(cum, target, lo=prev) + 1  # first j with cum[j] >= target
        end = min(end, n)
        ends.append(end)
        prev = end
    if not ends or ends[-1] != n:
        ends.append(n)
    return ends


def buckets_by_percent(grads: Any, percentages: Sequence[float], *, kind: str = "allreduce",
                       source: str | None = None) -> GradientBuckets:
    """HCCL split by size: percentages of the total bytes, in backward order (at most 8).

    Segment k ends at the first gradient whose cumulative bytes reach the cumulative
    percentage; empty segments are dropped.

    >>> buckets_by_percent([("a", 10), ("b", 80), ("c", 10)], [50, 50]).ends
    (2, 3)
    """
    gs = _check_gradients(grads)
    vals = check_percentages(percentages)
    ends = percent_ends([g.nbytes for g in gs], vals)
    src = source or f"HCCL size split {vals}"
    return buckets_from_ends(gs, ends, kind=kind, mode="hccl_size", source=src)


def buckets_per_gradient(grads: Any, *, kind: str = "allreduce",
                         source: str = "fusion closed: one collective per gradient") \
        -> GradientBuckets:
    """One bucket per gradient (MindSpore's fusion closed)."""
    gs = _check_gradients(grads)
    return buckets_from_ends(gs, list(range(1, len(gs) + 1)), kind=kind, mode="none",
                             source=source)


def buckets_pytorch_ddp(grads: Any, *, bucket_cap_mb: float = 25.0,
                        first_bucket_mb: float = 1.0) -> GradientBuckets:
    """PyTorch DDP's buckets: in reverse parameter order (= backward order), a bucket closes
    once it holds at least its cap (the first bucket 1 MiB, the others 25 MiB), so a bucket
    may pass its cap by the gradient that filled it.

    >>> buckets_pytorch_ddp([("a", MB), ("b", MB), ("c", MB)]).ends
    (1, 3)
    """
    gs = _check_gradients(grads)
    _positive("bucket_cap_mb", bucket_cap_mb, "the bucket cap")
    _positive("first_bucket_mb", first_bucket_mb, "the first bucket's cap")
    ends, cur, cap = [], 0, first_bucket_mb * MB
    for i, g in enumerate(gs):
        cur += g.nbytes
        if cur >= cap and i < len(gs) - 1:
            ends.append(i + 1)
            cur, cap = 0, bucket_cap_mb * MB
    ends.append(len(gs))
    return buckets_from_ends(gs, ends, mode="pytorch_ddp", source=f"PyTorch DDP buckets "
                             f"(first {first_bucket_mb:g} MiB, then {bucket_cap_mb:g} MiB)")


# ---------------------------------------------------------------------------- precedence


def _setting(kind: str, resolved: Any) -> Any:
    """The FusionSetting of a kind in ``resolved`` (a ResolvedContext)."""
    from autopar.resolve import ResolvedContext

    if not isinstance(resolved, ResolvedContext):
        raise AutoParallelTypeError("resolved", resolved, "an autopar.resolve.ResolvedContext "
                                    "(from autopar.resolve_context())")
    return getattr(resolved, f"{kind}_fusion")


def _from_setting(gs: tuple[Gradient, ...], setting: Any, kind: str) -> GradientBuckets:
    if setting.mode == "index":
        return buckets_by_index(gs, list(setting.indices or ()), convention="mindspore",
                                kind=kind, source=f"comm_fusion {kind} index "
                                f"{list(setting.indices or ())} (all_reduce_fusion_config)")
    return buckets_by_size(gs, setting.threshold_bytes, kind=kind, mode=setting.mode,
                           source=f"comm_fusion {kind} {setting.mode}, threshold "
                           f"{setting.threshold_bytes / MB:g} MB")


def _from_hccl(gs: tuple[Gradient, ...], strat: Any, kind: str) -> GradientBuckets:
    where = f"group {strat.group!r}"
    if strat.mode == "size":
        label = "HCCL default split" if strat.is_default else "HCCL set_split_strategy_by_size"
        note = f"; index strategy {list(strat.ignored_index)} ignored (size wins)" \
            if strat.ignored_index else ""
        return buckets_by_percent(gs, list(strat.values), kind=kind,
                                  source=f"{label} {list(strat.values)} ({where}){note}")
    return buckets_by_index(gs, list(strat.values), convention="hccl", kind=kind,
                            source=f"HCCL set_split_strategy_by_idx {list(strat.values)} "
                            f"({where})")


def gradient_buckets(source: Any, plan: Any = None, *, kind: str = "allreduce",
                     policy: str = "context", resolved: Any = None,
                     group: str = WORLD_GROUP, split: Any = None) -> GradientBuckets:
    """The buckets of one collective kind under the settings in force.

    ``source`` is a Graph (with an optional Plan: per-device bytes) or a list of
    ``(name, nbytes)`` in backward order. ``resolved`` (a ResolvedContext) replaces the current
    context's comm_fusion, ``split`` (a :class:`~autopar.split_strategies.SplitStrategy` an
    entry point read, :class:`autopar.setup.Setup`) the HCCL split strategy set for ``group``.
    Precedence (module doc): comm_fusion > HCCL split strategy set for ``group`` (size over
    index) > fusion closed; ``policy="hccl"``: HCCL's effective strategy, its default
    [96.54, 3.46] included; ``policy="none"``: fusion closed.

    >>> import autopar
    >>> autopar.set_auto_parallel_context(device_num=8, all_reduce_fusion_config=[1])
    >>> gradient_buckets([("a", 4), ("b", 4), ("c", 4)]).ends
    (1, 3)
    >>> autopar.reset_auto_parallel_context()
    """
    if not isinstance(kind, str) or kind not in _KINDS:
        raise AutoParallelError("kind", kind, f"must be one of {list(_KINDS)}")
    if not isinstance(policy, str) or policy not in BUCKET_POLICIES:
        raise AutoParallelError("policy", policy, f"must be one of {list(BUCKET_POLICIES)}")
    from autopar.graph.ir import Graph

    if isinstance(source, Graph):
        gs = gradients(source, plan, order="forward" if kind == "allgather" else "backward")
    else:
        if plan is not None:
            raise AutoParallelError("plan", "given", "a plan needs a Graph as the source",
                                    "Pass the graph the plan was searched for")
        gs = _check_gradients(source)
    if policy == "none":
        return buckets_per_gradient(gs, kind=kind)
    if policy == "hccl":
        if kind != "allreduce":
            raise AutoParallelError("policy", policy, f"HCCL split strategies apply to "
                                    f"allreduce only, not {kind}")
        return _from_hccl(gs, split or get_split_strategy(group), kind)
    if resolved is None:  # the entry point reads the context's comm_fusion
        from autopar.context import current_config
        from autopar.resolve import fusion_setting

        setting = fusion_setting(current_config(), kind)  # type: ignore[arg-type]
    else:
        setting = _setting(kind, resolved)
    if setting.mode == "off":  # (an HCCL split strategy is not used either)
        return buckets_per_gradient(gs, kind=kind, source="fusion switched off: "
                                    "comm_fusion['openstate'] is False")
    if setting.mode != "none":
        return _from_setting(gs, setting, kind)
    if kind == "allreduce":
        strat = split or get_split_strategy(group)
        if not strat.is_default:
            return _from_hccl(gs, strat, kind)
    return buckets_per_gradient(gs, kind=kind, source=f"fusion closed: no comm_fusion "
                                f"{kind} set" + (" and no HCCL split strategy set"
                                                 if kind == "allreduce" else ""))
