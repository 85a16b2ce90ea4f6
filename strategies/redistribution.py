"""The redistribution table: (source layout, target layout) -> ordered collective steps.

One table for the whole project: the cost model prices its steps, the rewrite turns them into
explicit communication nodes, the lowering into ``jax.lax`` collectives. Steps:

- ``all_reduce`` over axes: resolve a pending partial sum, result replicated on those axes.
- ``reduce_scatter`` over axes along ``dim``: resolve a partial sum into a split (cheaper
  than all_reduce when the consumer accepts a split tensor).
- ``all_gather`` over axes along ``dim``: undo a split.
- ``all_to_all`` over one axis: move a split from ``src_dim`` to ``dim``.
- ``slice`` over axes along ``dim``: split a replicated dim locally (no communication).

Each kind is one :class:`StepKind` record in :data:`STEP_KINDS`: its layout effect, its
backward counterpart, the collective the cost model prices it as, its ``comm_fusion`` key and
its display name. The rewrite (layouts), the IR dump (names), the cost model (pricing,
transposes) and the lowering (whether it communicates) read the record; the ``jax.lax`` rule
of each kind lives in :mod:`autopar.lower` (execution stays above planning), keyed by the same
kind. A new kind is a record here, the code of :func:`plan_steps` that emits it, and its
lowering rule (tests/test_registry.py checks both tables cover the same kinds). The search
prices layout pairs with twins of the planner in :mod:`autopar.strategies.edge_pricing`
(a vectorised one for large edges, one on Python ints for small ones): a change to the planner
is made in both too (tests/test_edge_pricing.py compares them with it on random pairs, bit
for bit).

With ``enable_alltoall=False`` a move is all_gather + slice, as MindSpore does.
``nbytes`` is the per-device byte count the collective formula uses: the gathered (output)
size for all_gather, the input size for reduce_scatter, all_reduce and all_to_all, and for a
slice its input size -- the output of the all_gather its backward is (a slice is free in
forward).

>>> from autopar.strategies.layout import DeviceMesh, Layout
>>> mesh = DeviceMesh.for_devices(8)
>>> steps = redistribute((16, 16), 4, Layout(((), ()), ("a0",)), Layout((("a0",), ())), mesh)
>>> [(s.kind, s.axes, s.dim) for s in steps]
[('reduce_scatter', ('a0',), 0)]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from autopar.errors import AutoParallelError
from autopar.strategies.layout import DeviceMesh, Layout

__all__ = ["Step", "StepKind", "STEP_KINDS", "redistribute", "plan_steps", "transpose_step",
           "apply_step_to_layout"]


@dataclass(frozen=True, slots=True)
class Step:
    kind: str                     # a key of STEP_KINDS
    axes: tuple[str, ...]
    dim: int | None = None        # the dim gathered / scattered / sliced / split into
    src_dim: int | None = None    # all_to_all: the dim whose split moves to `dim`
    nbytes: int = 0               # per-device bytes the cost formula uses
    fraction: float = 0.0         # nbytes / the tensor's global bytes

    @property
    def where(self) -> str:
        """The dims the step acts on, as printed: ``dim 0``, ``dim 1->0`` or ""."""
        return STEP_KINDS[self.kind].where(self)

    def __str__(self) -> str:
        where = f" {self.where}" if self.where else ""
        return f"{self.kind}[{','.join(self.axes)}]{where}"


# ---------------------------------------------------------------------------- the step kinds

#: A layout effect: changes a layout's per-dim axes and partial axes in place.
Effect = Callable[[list[list[str]], list[str], Step], None]


def _resolve(dims: list[list[str]], partial: list[str], s: Step) -> None:
    partial[:] = [a for a in partial if a not in s.axes]


def _split(dims: list[list[str]], partial: list[str], s: Step) -> None:
    dims[s.dim] += list(s.axes)  # type: ignore[index]


def _unsplit(dims: list[list[str]], partial: list[str], s: Step) -> None:
    dims[s.dim] = [a for a in dims[s.dim] if a not in s.axes]  # type: ignore[index]


def _move(dims: list[list[str]], partial: list[str], s: Step) -> None:
    dims[s.src_dim] = [a for a in dims[s.src_dim] if a not in s.axes]  # type: ignore[index]
    dims[s.dim] += list(s.axes)  # type: ignore[index]


def _as(kind: str) -> Callable[[Step], Step]:
    """Backward: the same axes, dim and bytes as a step of ``kind`` (a gather's transpose is
    a reduce-scatter moving the same n, and back; a slice's is the gather of its pieces)."""
    return lambda s: Step(kind, s.axes, s.dim, nbytes=s.nbytes, fraction=s.fraction)


def _swap(s: Step) -> Step:
    return Step(s.kind, s.axes, s.src_dim, src_dim=s.dim, nbytes=s.nbytes, fraction=s.fraction)


def _dim(s: Step) -> str:
    return f"dim {s.dim}" if s.dim is not None else ""


@dataclass(frozen=True)
class StepKind:
    """Everything autopar knows about one kind of redistribution step."""

    name: str
    display: str                          # the MindSpore operator (IR dumps)
    collective: str | None                # the cost model's collective kind; None: local
    comm_fusion: str | None               # the comm_fusion key bucketing this collective
    effect: tuple[Effect, ...]            # the layout change, in order
    transpose: Callable[[Step], Step | None]  # backward counterpart (None: no communication)
    where: Callable[[Step], str] = _dim   # the dims it acts on, as printed
    # in the training step's backward (autopar/cotangents.py), JAX's transpose of its lax rule
    # leaves the input's cotangent the same on every device of its axes (a psum, an all-gather)
    alike_transpose: bool = False


STEP_KINDS: dict[str, StepKind] = {k.name: k for k in (
    # partial -> replicated transposes to the identity
    StepKind("all_reduce", "AllReduce", "all_reduce", "allreduce", (_resolve,),
             lambda s: None, alike_transpose=True),
    StepKind("reduce_scatter", "ReduceScatter", "reduce_scatter", "reducescatter",
             (_resolve, _split), _as("all_gather"), alike_transpose=True),
    StepKind("all_gather", "AllGather", "all_gather", "allgather", (_unsplit,),
             _as("reduce_scatter")),
    StepKind("all_to_all", "AlltoAll", "all_to_all", None, (_move,), _swap,
             lambda s: f"dim {s.src_dim}->{s.dim}"),
    # a replicated input's cotangent: gather the sliced pieces
    StepKind("slice", "StridedSlice", None, None, (_split,), _as("all_gather")),
)}


def transpose_step(step: Step) -> Step | None:
    """The backward counterpart of a forward step (None: no communication in backward)."""
    return STEP_KINDS[step.kind].transpose(step)


def apply_step_to_layout(layout: Layout, step: Step) -> Layout:
    """The layout after one redistribution step.

    >>> lay = Layout(((), ("a1",)), ("a0",))
    >>> str(apply_step_to_layout(lay, Step("reduce_scatter", ("a0",), 0)))
    'S(0)[a0]S(1)[a1]'
    """
    kind = STEP_KINDS.get(step.kind)
    if kind is None:
        raise AutoParallelError("step", str(step), "unknown redistribution step kind")
    dims = [list(d) for d in layout.dims]
    partial = list(layout.partial)
    for effect in kind.effect:
        effect(dims, partial, step)
    return Layout(tuple(tuple(d) for d in dims), tuple(partial))


# ---------------------------------------------------------------------------- the planner


def redistribute(shape: tuple[int, ...], itemsize: int, src: Layout, dst: Layout,
                 mesh: DeviceMesh, enable_alltoall: bool = False) -> tuple[Step, ...]:
    """Ordered steps turning a tensor laid out as ``src`` into ``dst``, with byte counts."""
    if src.rank != len(shape) or dst.rank != len(shape):
        raise AutoParallelError("layout", f"{src} -> {dst}",
                                f"layout ranks must equal the tensor rank {len(shape)}")
    total = itemsize
    for n in shape:
        total *= n
    return tuple(Step(s.kind, s.axes, s.dim, s.src_dim, int(round(s.fraction * total)),
                      s.fraction) for s in plan_steps(src, dst, mesh, enable_alltoall))


@lru_cache(maxsize=500_000)
def plan_steps(src: Layout, dst: Layout, mesh: DeviceMesh,
               enable_alltoall: bool = False) -> tuple[Step, ...]:
    """The shape-free steps (``fraction`` set, ``nbytes`` 0); pure and cached."""
    if dst.partial and set(dst.partial) - set(src.partial):
        raise AutoParallelError("layout", str(dst), "a redistribution cannot create a partial "
                                "sum; only resolve one")
    plan = _Planner(src, dst, mesh)
    if src.partial:
        plan.resolve_partials(src, dst)
    plan.move_splits(enable_alltoall)
    return tuple(plan.steps)


@lru_cache(maxsize=65_536)
def _target(dst: Layout) -> tuple[list[list[str]], frozenset[str]]:
    """A target's per-dim axes as the planner compares them (lists, never modified) and
    every axis it uses."""
    return [list(d) for d in dst.dims], frozenset(a for d in dst.dims for a in d)


class _Planner:
    """The steps from ``src`` to ``dst`` so far, and the per-dim axes they reach (``cur``).

    Hot: the dynamic_programming search plans every distinct layout pair of its edges
    (tens of thousands at 64 devices), so the state is kept cheap to test: ``n`` is the
    product of the sizes of the axes in ``cur`` (the fraction is ``1 / n``), ``wanted`` the
    axes the target uses anywhere (it never changes)."""

    __slots__ = ("mesh", "rank", "src", "dst", "cur", "want", "steps", "sizes", "n", "wanted",
                 "ok")

    def __init__(self, src: Layout, dst: Layout, mesh: DeviceMesh) -> None:
        self.mesh, self.rank, self.src, self.dst = mesh, len(src.dims), src, dst
        self.cur = [list(d) for d in src.dims]
        self.want, self.wanted = _target(dst)  # shared between plans: only read
        self.steps: list[Step] = []
        self.sizes = mesh.sizes
        self.n = mesh.size_of(a for d in src.dims for a in d)
        self.ok = [c == w[:len(c)] for c, w in zip(self.cur, self.want)]  # is_prefix per dim

    def fraction(self) -> float:
        """Per-device share of the global tensor for the current dims."""
        return 1.0 / self.n

    def is_prefix(self, d: int) -> bool:
        return self.ok[d]

    def wants_next(self, d: int, a: str) -> bool:
        """Whether dim ``d`` is on its way to the target and takes axis ``a`` next."""
        k, w = len(self.cur[d]), self.want[d]
        return len(w) > k and w[k] == a and self.ok[d]

    def touched(self, d: int) -> None:
        """Dim ``d``'s axes changed: whether it is still on its way to the target."""
        c = self.cur[d]
        self.ok[d] = c == self.want[d][:len(c)]

    def add(self, d: int, axes: Sequence[str]) -> None:
        """Split dim ``d`` further over ``axes``."""
        self.cur[d].extend(axes)
        for a in axes:
            self.n *= self.sizes[a]
        self.touched(d)

    def slice(self, axes: tuple[str, ...], dim: int) -> None:
        """Split ``dim`` locally over ``axes``; merged with a slice of the same dim just
        before it (which keeps its own, larger, input fraction: the size its backward
        all_gather produces)."""
        last = self.steps[-1] if self.steps else None
        if last is not None and last.kind == "slice" and last.dim == dim:
            self.steps[-1] = Step("slice", last.axes + axes, dim, fraction=last.fraction)
        else:
            self.steps.append(Step("slice", axes, dim, fraction=1.0 / self.n))
        self.add(dim, axes)

    def resolve_partials(self, src: Layout, dst: Layout) -> None:
        """Resolve partial sums: reduce_scatter where the target splits on that axis next,
        all_reduce otherwise."""
        cur, want = self.cur, self.want
        pending = [a for a in src.partial if a not in dst.partial]
        scatter: dict[int, list[str]] = {}
        for d in range(self.rank):
            if not self.is_prefix(d):
                continue
            take = []
            for a in want[d][len(cur[d]):]:
                if a not in pending or any(a in c for c in cur):
                    break
                take.append(a)
            if take:
                scatter[d] = take
        reduce_axes = [a for a in pending if not any(a in t for t in scatter.values())]
        if reduce_axes:
            self.steps.append(Step("all_reduce", tuple(reduce_axes), fraction=self.fraction()))
        for d in sorted(scatter):
            before = self.fraction()
            self.add(d, scatter[d])
            self.steps.append(Step("reduce_scatter", tuple(scatter[d]), d, fraction=before))

    def move_splits(self, enable_alltoall: bool) -> None:
        """Move splits until every dim matches the target: all_to_all where allowed, early
        slices, then gathers, then the final slices."""
        early_done = False
        cur, want = self.cur, self.want
        for _ in range(4 * len(self.mesh.axes) + 4):
            if cur == want:
                break
            if enable_alltoall and self.all_to_all():
                continue
            if False in self.ok:  # some dim is off its way to the target
                if not early_done:
                    early_done = True
                    if self.early_slices():
                        continue
                self.gather(self.ok.index(False))
                continue
            for d in range(self.rank):
                add = want[d][len(cur[d]):]
                if add:
                    self.slice(tuple(add), d)
        else:  # pragma: no cover - the loop always converges; guard against regressions
            raise AutoParallelError("layout", f"{self.src} -> {self.dst}",
                                    "redistribution did not converge")

    def all_to_all(self) -> bool:
        """Move the innermost axis of a dim off its target to a dim that takes it next."""
        for d1 in range(self.rank):
            if not self.cur[d1] or self.is_prefix(d1):
                continue
            a = self.cur[d1][-1]
            for d2 in range(self.rank):
                if d2 != d1 and self.wants_next(d2, a):
                    nb = self.fraction()
                    self.cur[d1].pop()
                    self.n //= self.sizes[a]
                    self.touched(d1)
                    self.add(d2, (a,))
                    self.steps.append(Step("all_to_all", (a,), d2, src_dim=d1, fraction=nb))
                    return True
        return False

    def early_slices(self) -> bool:
        """Slice first what no gather will touch: axes free now that a good dim wants next.
        The gathers that follow then move smaller pieces."""
        used = {a for c in self.cur for a in c}
        moved = False
        for d2 in range(self.rank):
            if not self.ok[d2]:  # a bad dim (slicing a good one keeps it good)
                continue
            add = []
            for a in self.want[d2][len(self.cur[d2]):]:
                if a in used:
                    break
                add.append(a)
            if add:
                self.slice(tuple(add), d2)
                used.update(add)
                moved = True
        return moved

    def gather(self, d: int) -> None:
        """Undo the splits of dim ``d`` past its agreement with the target. A plain un-split
        is one collective. When some gathered axes split another dim next, gather one axis at
        a time (innermost first) and slice it where it is wanted at once, never holding more
        of the tensor than needed. In the alpha-beta ring model this is never dearer than one
        gather of all the axes followed by slices: the bytes are the same or fewer (later
        steps move smaller pieces) and the latency sum(p_i - 1) <= prod(p_i) - 1."""
        c, w, sizes = self.cur[d], self.want[d], self.sizes
        k = 0
        while k < len(c) and k < len(w) and c[k] == w[k]:
            k += 1
        gone = c[k:]
        if self.wanted.isdisjoint(gone):
            del c[k:]
            for a in gone:
                self.n //= sizes[a]
            self.touched(d)
            self.steps.append(Step("all_gather", tuple(gone), d, fraction=1.0 / self.n))
            return
        a = c.pop()
        self.n //= sizes[a]
        self.touched(d)
        self.steps.append(Step("all_gather", (a,), d, fraction=1.0 / self.n))
        if False not in self.ok:
            return  # no gather follows: the final slices go together
        for d2 in range(self.rank):
            if d2 != d and self.wants_next(d2, a):
                self.slice((a,), d2)
                return
