"""The redistribution table: (source layout, target layout) -> ordered collective steps.

One table for the whole project: the cost model prices its steps, the rewrite turns them into
explicit communication nodes, the lowering into ``jax.lax`` collectives. Steps:

- ``all_reduce`` over axes: resolve a pending partial sum, result replicated on those axes.
- ``reduce_scatter`` over axes along ``dim``: resolve a partial sum into a split (cheaper
  than all_reduce when the consumer accepts a split tensor).
- ``all_gather`` over axes along ``dim``: undo a split.
- ``all_to_all`` over one axis: move a split from ``src_dim`` to ``dim``.
- ``slice`` over axes along ``dim``: split a replicated dim locally (no communication).

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
from typing import Literal

from autopar.errors import AutoParallelError
from autopar.strategies.layout import DeviceMesh, Layout

__all__ = ["Step", "redistribute", "transpose_step"]

StepKind = Literal["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "slice"]


@dataclass(frozen=True, slots=True)
class Step:
    kind: StepKind
    axes: tuple[str, ...]
    dim: int | None = None        # the dim gathered / scattered / sliced / split into
    src_dim: int | None = None    # all_to_all: the dim whose split moves to `dim`
    nbytes: int = 0               # per-device bytes the cost formula uses
    fraction: float = 0.0         # nbytes / the tensor's global bytes

    def __str__(self) -> str:
        where = f" dim {self.dim}" if self.dim is not None else ""
        if self.kind == "all_to_all":
            where = f" dim {self.src_dim}->{self.dim}"
        return f"{self.kind}[{','.join(self.axes)}]{where}"


def transpose_step(step: Step) -> Step | None:
    """The backward counterpart of a forward step (None: no communication in backward)."""
    n, f = step.nbytes, step.fraction
    if step.kind == "all_gather":
        return Step("reduce_scatter", step.axes, step.dim, nbytes=n, fraction=f)
    if step.kind == "reduce_scatter":
        return Step("all_gather", step.axes, step.dim, nbytes=n, fraction=f)
    if step.kind == "slice":  # replicated input's cotangent: gather the sliced pieces
        return Step("all_gather", step.axes, step.dim, nbytes=n, fraction=f)
    if step.kind == "all_to_all":
        return Step("all_to_all", step.axes, step.src_dim, src_dim=step.dim, nbytes=n,
                    fraction=f)
    return None  # all_reduce (partial -> replicated) transposes to the identity


def _fraction(dims: list[list[str]], mesh: DeviceMesh) -> float:
    """Per-device share of the global tensor for the current dims."""
    sizes, n = mesh.sizes, 1
    for axes in dims:
        for a in axes:
            n *= sizes[a]
    return 1.0 / n


def _slice(steps: list[Step], axes: tuple[str, ...], dim: int, fraction: float) -> None:
    """Append a local slice of a tensor holding ``fraction`` of the whole (its input: the
    size its backward all_gather produces), merged with a slice of the same dim just before
    it (which keeps its own, larger, input fraction)."""
    last = steps[-1] if steps else None
    if last is not None and last.kind == "slice" and last.dim == dim:
        steps[-1] = Step("slice", last.axes + axes, dim, fraction=last.fraction)
    else:
        steps.append(Step("slice", axes, dim, fraction=fraction))


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
    shape = tuple(0 for _ in src.dims)
    if set(dst.partial) - set(src.partial):
        raise AutoParallelError("layout", str(dst), "a redistribution cannot create a partial "
                                "sum; only resolve one")
    cur = [list(d) for d in src.dims]
    want = [list(d) for d in dst.dims]
    steps: list[Step] = []

    # 1. resolve partial sums: reduce_scatter where the target splits on that axis next,
    #    all_reduce otherwise.
    pending = [a for a in src.partial if a not in dst.partial]
    scatter: dict[int, list[str]] = {}
    for d in range(len(shape)):
        if cur[d] != want[d][:len(cur[d])]:
            continue
        nxt = want[d][len(cur[d]):]
        take = []
        for a in nxt:
            if a in pending and not any(a in c for c in cur):
                take.append(a)
            else:
                break
        if take:
            scatter[d] = take
    reduce_axes = [a for a in pending if not any(a in t for t in scatter.values())]
    if reduce_axes:
        steps.append(Step("all_reduce", tuple(reduce_axes),
                          fraction=_fraction(cur, mesh)))
    for d in sorted(scatter):
        before = _fraction(cur, mesh)
        cur[d].extend(scatter[d])
        steps.append(Step("reduce_scatter", tuple(scatter[d]), d, fraction=before))

    # 2. move splits until every dim matches the target.
    def is_prefix(d: int) -> bool:
        return cur[d] == want[d][:len(cur[d])]

    early_done = False
    for _ in range(4 * len(mesh.axes) + 4):
        if cur == want:
            break
        moved = False
        if enable_alltoall:
            for d1 in range(len(shape)):
                if not cur[d1] or is_prefix(d1):
                    continue
                a = cur[d1][-1]
                for d2 in range(len(shape)):
                    w2 = want[d2]
                    if d2 != d1 and is_prefix(d2) and len(w2) > len(cur[d2]) \
                            and w2[len(cur[d2])] == a:
                        nb = _fraction(cur, mesh)
                        cur[d1].pop()
                        cur[d2].append(a)
                        steps.append(Step("all_to_all", (a,), d2, src_dim=d1, fraction=nb))
                        moved = True
                        break
                if moved:
                    break
        if moved:
            continue
        bad = [d for d in range(len(shape)) if not is_prefix(d)]
        if bad and not early_done:
            # Slice first what no gather will touch: axes free now that a good dim wants
            # next. The gathers that follow then move smaller pieces.
            early_done = True
            used = {a for c in cur for a in c}
            for d2 in range(len(shape)):
                if d2 in bad:
                    continue
                add = []
                for a in want[d2][len(cur[d2]):]:
                    if a in used:
                        break
                    add.append(a)
                if add:
                    _slice(steps, tuple(add), d2, _fraction(cur, mesh))
                    cur[d2].extend(add)
                    used.update(add)
                    moved = True
            if moved:
                continue
        if bad:
            d = bad[0]
            k = 0
            while k < len(cur[d]) and k < len(want[d]) and cur[d][k] == want[d][k]:
                k += 1
            gone = cur[d][k:]
            wanted = {a for w in want for a in w}
            if not wanted.intersection(gone):  # a plain un-split: one collective
                del cur[d][k:]
                steps.append(Step("all_gather", tuple(gone), d, fraction=_fraction(cur, mesh)))
                continue
            # Some gathered axes split another dim next: gather one axis at a time (innermost
            # first) and slice it where it is wanted at once, never holding more of the tensor
            # than needed. In the alpha-beta ring model this is never dearer than one gather
            # of all the axes followed by slices: the bytes are the same or fewer (later steps
            # move smaller pieces) and the latency sum(p_i - 1) <= prod(p_i) - 1.
            a = cur[d].pop()
            steps.append(Step("all_gather", (a,), d, fraction=_fraction(cur, mesh)))
            if all(is_prefix(d2) for d2 in range(len(shape))):
                continue  # no gather follows: the final slices go together
            for d2 in range(len(shape)):
                if d2 != d and is_prefix(d2) and len(want[d2]) > len(cur[d2]) \
                        and want[d2][len(cur[d2])] == a:
                    _slice(steps, (a,), d2, _fraction(cur, mesh))
                    cur[d2].append(a)
                    break
            continue
        for d in range(len(shape)):
            add = want[d][len(cur[d]):]
            if add:
                _slice(steps, tuple(add), d, _fraction(cur, mesh))
                cur[d].extend(add)
    else:  # pragma: no cover - the loop always converges; guard against regressions
        raise AutoParallelError("layout", f"{src} -> {dst}", "redistribution did not converge")
    return tuple(steps)
