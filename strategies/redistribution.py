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
transposes), the search's price tables (:mod:`autopar.strategies.edge_pricing`) and the
lowering (whether it communicates) read the record; the ``jax.lax`` rule of each kind lives
in :mod:`autopar.lower` (execution stays above planning), keyed by the same kind. A new kind
is a record here and its lowering rule (tests/test_registry.py checks both tables cover the
same kinds).

The planner is :class:`CodedPlan`, on codes of the layouts (:class:`MeshCodes`): it emits
coded steps, which :func:`plan_steps` decodes into :class:`Step` s and the search prices as
they are (:meth:`EdgePricer.pair <autopar.strategies.edge_pricing.EdgePricer.pair>`). The
search's large edges are planned by its lock-step form, which takes the same actions on every
pair of an edge at once (numpy; a rule the planner changes or a kind it newly emits is
changed there too: tests/test_edge_pricing.py compares the two on random pairs, bit for bit,
and tests/test_redistribution_fast.py the planner with the straightforward one it was first
written as).

With ``enable_alltoall=False`` a move is all_gather + slice, as MindSpore does.
``nbytes`` is the per-device byte count the collective formula uses: the gathered (output)
size for all_gather, the input size for reduce_scatter, all_reduce and all_to_all, and for a
slice its input size -- the output of the all_gather its backward is (a slice is free in
forward).

>>> from autopar.strategies.layout import DeviceMesh, TensorLayout
>>> mesh = DeviceMesh.for_devices(8)
>>> src, dst = TensorLayout(((), ()), ("a0",)), TensorLayout((("a0",), ()))
>>> steps = redistribute((16, 16), 4, src, dst, mesh)
>>> [(s.kind, s.axes, s.dim) for s in steps]
[('reduce_scatter', ('a0',), 0)]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from autopar.errors import AutoParallelError
from autopar.strategies.layout import DeviceMesh, TensorLayout

__all__ = ["Step", "StepKind", "STEP_KINDS", "redistribute", "plan_steps", "transpose_step",
           "apply_step_to_layout", "CodedPlan", "MeshCodes", "mesh_codes"]


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


def apply_step_to_layout(layout: TensorLayout, step: Step) -> TensorLayout:
    """The layout after one redistribution step.

    >>> lay = TensorLayout(((), ("a1",)), ("a0",))
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
    return TensorLayout(tuple(tuple(d) for d in dims), tuple(partial))


# ---------------------------------------------------------------------------- the planner


def redistribute(shape: tuple[int, ...], itemsize: int, src: TensorLayout, dst: TensorLayout,
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
def plan_steps(src: TensorLayout, dst: TensorLayout, mesh: DeviceMesh,
               enable_alltoall: bool = False) -> tuple[Step, ...]:
    """The shape-free steps (``fraction`` set, ``nbytes`` 0); pure and cached: the
    :class:`CodedPlan` of the pair, its coded steps decoded."""
    if dst.partial and set(dst.partial) - set(src.partial):
        raise AutoParallelError("layout", str(dst), "a redistribution cannot create a partial "
                                "sum; only resolve one")
    if src.rank != dst.rank:
        raise AutoParallelError("layout", f"{src} -> {dst}", "the layouts' ranks differ")
    codes = mesh_codes(mesh)
    for lay in (src, dst):
        if codes.encode(lay) is None:
            raise AutoParallelError("layout", str(lay), f"each axis of the mesh {mesh} on at "
                                    "most one dim and at most once in the partial sum (a "
                                    f"mesh of at most {MAX_AXES} axes)")
    plan = CodedPlan(codes, codes.encode(src), codes.encode(dst))
    if not plan.plan(enable_alltoall):  # pragma: no cover - the plan always converges
        raise AutoParallelError("layout", f"{src} -> {dst}",
                                "redistribution did not converge")
    axes = codes.axes
    return tuple(Step(kind, axes(code), None if d < 0 else d, None if s < 0 else s,
                      fraction=frac) for kind, code, frac, d, s in plan.steps)


BITS = 4       # bits per axis digit in a code (digit = the axis's index on the mesh + 1)
DIGIT = (1 << BITS) - 1
MAX_AXES = DIGIT  # the mesh axes a code can name (DeviceMesh.for_devices makes at most 12)
_KEPT_LAYOUTS = 200_000  # layouts whose codes a mesh keeps


class MeshCodes:
    """A mesh's axes as the planner's codes. A dim's axes are a code (their digits, outer
    axis in the low digits), a length and a bit mask (bit ``i``: axis ``i``); a layout is
    its dims' codes, lengths and masks, its partial sum's mask, the mask of the axes its
    dims use and its partial sum's code (:meth:`encode`). ``frac[mask]`` is the per-device
    share of a tensor split over the axes of ``mask`` (``1.0 / n``, n the product of their
    sizes), ``low[j]`` the mask of a code's first ``j`` digits. One per mesh
    (:func:`mesh_codes`); the layouts' codes are kept."""

    __slots__ = ("names", "index", "sizes", "frac", "low", "ok", "rounds", "_layouts")

    def __init__(self, mesh: DeviceMesh) -> None:
        self.names = mesh.names
        k = len(self.names)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.ok = k <= MAX_AXES
        self.sizes = [mesh.sizes[n] for n in self.names]
        prods = [1] * (1 << k if self.ok else 1)
        for m in range(1, len(prods)):
            low = (m & -m).bit_length() - 1
            prods[m] = prods[m & (m - 1)] * self.sizes[low]
        self.frac = [1.0 / n for n in prods]
        self.low = [(1 << (BITS * j)) - 1 for j in range(k + 2)]
        self.rounds = 4 * k + 4  # the planner's bound on its rounds (it converges sooner)
        self._layouts: dict[TensorLayout, tuple | None] = {}

    def axes(self, code: int) -> tuple[str, ...]:
        """The axes a code names, in order."""
        out = []
        while code:
            out.append(self.names[(code & DIGIT) - 1])
            code >>= BITS
        return tuple(out)

    def encode(self, lay: TensorLayout) -> tuple | None:
        """(per dim codes, lengths, masks: lists; partial mask; used mask: the dims' axes;
        partial code) of a layout, or None: one the planner does not take (an axis on two
        dims or twice in the partial sum, an axis not on the mesh, a mesh of more than
        :data:`MAX_AXES` axes). Never modified: a plan copies a source's lists (a target's
        are compared with its state)."""
        hit = self._layouts.get(lay, False)
        if hit is False:
            if len(self._layouts) >= _KEPT_LAYOUTS:  # (pure: forgetting costs a re-encode)
                self._layouts.clear()
            hit = self._layouts[lay] = self._encode(lay) if self.ok else None
        return hit

    def _encode(self, lay: TensorLayout) -> tuple | None:
        index, seen = self.index, 0
        codes, lens, masks = [], [], []
        for axes in lay.dims:
            code = mask = 0
            for j, a in enumerate(axes):
                i = index.get(a)
                if i is None or seen >> i & 1:
                    return None
                seen |= 1 << i
                code |= (i + 1) << (BITS * j)
                mask |= 1 << i
            codes.append(code)
            lens.append(len(axes))
            masks.append(mask)
        partial = pcode = 0
        for j, a in enumerate(lay.partial):
            i = index.get(a)
            if i is None or partial >> i & 1:
                return None
            partial |= 1 << i
            pcode |= (i + 1) << (BITS * j)
        return codes, lens, masks, partial, seen, pcode


@lru_cache(maxsize=256)
def mesh_codes(mesh: DeviceMesh) -> MeshCodes:
    """The :class:`MeshCodes` of a mesh (one per mesh: they keep the layouts' codes)."""
    return MeshCodes(mesh)


def _digits(code: int) -> int:
    """How many axes a code names (its digits are never 0)."""
    return (code.bit_length() + BITS - 1) // BITS


class CodedPlan:
    """The redistribution planner: the steps from a source to a target layout, on their
    codes (:class:`MeshCodes`). The state is per dim the code, length and axis mask of the
    axes reached so far (``c``, ``ln``, ``m``) and of the target's (``w``, ``wl``, ``wm``),
    whether each dim is on its way to the target (its axes a prefix of the target's:
    ``ok``), the axes the dims use and the target wants anywhere (``used``, ``wanted``).
    A step is coded ``(kind, axes code, fraction, dim, src_dim)`` (-1: no dim): the
    fraction is the per-device share of the tensor it moves, ``frac[used]``.

    :func:`plan_steps` decodes the steps into :class:`Step` s (the rewrite, the lowering and
    the cost model read those); :class:`~autopar.strategies.edge_pricing.EdgePricer` prices
    them as they are, for a pair of a small edge; its vectorised planner (``_Run``) takes
    the same actions on every pair of a large edge at once, in lock step (kept equal bit for
    bit by tests/test_edge_pricing.py). The planner:

    1. resolve the partial sums the target does not keep: a reduce_scatter into each dim on
       its way whose next target axes are pending partial axes no dim uses, an all_reduce
       of the rest;
    2. then, until every dim is at its target: an all_to_all where allowed (the innermost
       axis of a dim off its way moves to a dim that takes it next); once, the early slices
       (each dim on its way slices its next axes no dim uses: the gathers that follow move
       smaller pieces); a gather of the first dim off its way (:meth:`gather`); when every
       dim is on its way, the final slices.

    Consecutive slices of one dim merge into one step, which keeps the first's fraction
    (the size its backward all_gather produces)."""

    __slots__ = ("c", "ln", "m", "w", "wl", "wm", "ok", "used", "wanted", "steps", "frac",
                 "low", "pcode", "partials", "rounds")

    def __init__(self, codes: MeshCodes, es: tuple, ed: tuple) -> None:
        self.frac, low, self.rounds = codes.frac, codes.low, codes.rounds
        self.low = low
        self.c, self.ln, self.m = list(es[0]), list(es[1]), list(es[2])
        w, wl = ed[0], ed[1]
        self.w, self.wl, self.wm = w, wl, ed[2]
        self.ok = [n <= wl[d] and w[d] & low[n] == c for d, (c, n) in
                   enumerate(zip(es[0], es[1]))]
        self.used, self.wanted = es[4], ed[4]
        self.pcode, self.partials = es[5], (es[3], ed[3])
        self.steps: list[tuple[str, int, float, int, int]] = []

    def plan(self, alltoall: bool) -> bool:
        """Plan the steps (:attr:`steps`); False where the planner refuses the pair (a
        target that creates a partial sum) or does not converge."""
        src_partial, dst_partial = self.partials
        if dst_partial & ~src_partial:
            return False
        if src_partial:
            self.resolve_partials(src_partial & ~dst_partial)
        c, w, ok = self.c, self.w, self.ok
        early_done = False
        for _ in range(self.rounds):
            if c == w:
                return True
            if alltoall and self.all_to_all():
                continue
            if False in ok:  # some dim is off its way to the target
                if not early_done:
                    early_done = True
                    if self.early_slices():
                        continue
                self.gather(ok.index(False))
                continue
            for d in range(len(c)):  # the final slices
                if self.ln[d] < self.wl[d]:
                    self.slice(d, self.wm[d] & ~self.m[d], w[d] >> (BITS * self.ln[d]))
        return False

    def next_run(self, d: int, allowed: int) -> tuple[int, int]:
        """(mask, code) of the longest run of the target's next axes on dim ``d`` all in
        ``allowed``."""
        w, n, take = self.w[d], self.ln[d], 0
        for j in range(n, self.wl[d]):
            bit = 1 << (((w >> (BITS * j)) & DIGIT) - 1)
            if not allowed & bit:
                break
            take |= bit
        else:
            j = self.wl[d]
        return take, (w >> (BITS * n)) & self.low[j - n]

    def add(self, d: int, mask: int) -> None:
        """Split dim ``d`` further over the target's next axes ``mask`` (it stays on its
        way)."""
        n = self.ln[d] = self.ln[d] + mask.bit_count()
        self.c[d] = self.w[d] & self.low[n]
        self.m[d] |= mask
        self.used |= mask

    def pop(self, d: int) -> int:
        """Take dim ``d``'s innermost axis off; its digit."""
        n = self.ln[d] - 1
        digit = (self.c[d] >> (BITS * n)) & DIGIT
        bit = 1 << (digit - 1)
        c = self.c[d] = self.c[d] & self.low[n]
        self.ln[d] = n
        self.m[d] &= ~bit
        self.used &= ~bit
        self.ok[d] = n <= self.wl[d] and self.w[d] & self.low[n] == c
        return digit

    def wants_next(self, d: int, digit: int) -> bool:
        """Whether dim ``d`` is on its way to the target and takes axis ``digit`` next."""
        n = self.ln[d]
        return self.ok[d] and n < self.wl[d] and (self.w[d] >> (BITS * n)) & DIGIT == digit

    def slice(self, d: int, mask: int, code: int) -> None:
        """Split ``d`` locally over the target's next axes (``mask``, ``code``); merged into
        a slice of the same dim just before it (which keeps its own fraction)."""
        steps = self.steps
        last = steps[-1] if steps else None
        if last is not None and last[0] == "slice" and last[3] == d:
            steps[-1] = ("slice", last[1] | code << (BITS * _digits(last[1])), last[2], d, -1)
        else:
            steps.append(("slice", code, self.frac[self.used], d, -1))
        self.add(d, mask)

    def resolve_partials(self, pending: int) -> None:
        """Step 1: a reduce_scatter into each dim on its way whose next axes are pending
        partial axes no dim uses, an all_reduce of the rest (in the source's order)."""
        allowed, takes = pending & ~self.used, []
        for d in range(len(self.c)):
            take, code = self.next_run(d, allowed) if self.ok[d] else (0, 0)
            if take:
                takes.append((d, take, code))
                pending &= ~take
        if pending:
            code, j, p = 0, 0, self.pcode
            while p:  # the source's partial axes still pending, in its order
                digit = p & DIGIT
                if pending >> (digit - 1) & 1:
                    code |= digit << (BITS * j)
                    j += 1
                p >>= BITS
            self.steps.append(("all_reduce", code, self.frac[self.used], -1, -1))
        for d, take, code in takes:
            before = self.frac[self.used]
            self.add(d, take)
            self.steps.append(("reduce_scatter", code, before, d, -1))

    def all_to_all(self) -> bool:
        """The first dim off its way moves its innermost axis to a dim that takes it next;
        whether one moved."""
        for d1 in range(len(self.c)):
            if not self.ln[d1] or self.ok[d1]:
                continue
            digit = (self.c[d1] >> (BITS * (self.ln[d1] - 1))) & DIGIT
            for d2 in range(len(self.c)):
                if d2 != d1 and self.wants_next(d2, digit):
                    before = self.frac[self.used]
                    self.pop(d1)
                    self.add(d2, 1 << (digit - 1))
                    self.steps.append(("all_to_all", digit, before, d2, d1))
                    return True
        return False

    def early_slices(self) -> bool:
        """Each dim on its way slices its next axes no dim uses; whether one did."""
        moved = False
        for d in range(len(self.c)):
            if self.ok[d]:
                add, code = self.next_run(d, ~self.used)
                if add:
                    self.slice(d, add, code)
                    moved = True
        return moved

    def gather(self, d: int) -> None:
        """Undo the splits of dim ``d`` past its agreement with the target. A plain un-split
        (the target wants none of its axes) is one all_gather. Otherwise gather one axis at
        a time, innermost first, each sliced at once into the dim that takes it next (unless
        every dim is then on its way: the final slices go together), never holding more of
        the tensor than needed. In the alpha-beta ring model this is never dearer than one
        gather of all the axes followed by slices: the bytes are the same or fewer (later
        steps move smaller pieces) and the latency sum(p_i - 1) <= prod(p_i) - 1."""
        c, w = self.c[d], self.w[d]
        diff = c ^ w
        k = ((diff & -diff).bit_length() - 1) // BITS
        gone = self.m[d]
        for j in range(k):
            gone &= ~(1 << (((c >> (BITS * j)) & DIGIT) - 1))
        if not gone & self.wanted:
            self.c[d], self.ln[d], self.ok[d] = c & self.low[k], k, True
            self.m[d] &= ~gone
            self.used &= ~gone
            self.steps.append(("all_gather", c >> (BITS * k), self.frac[self.used], d, -1))
            return
        digit = self.pop(d)
        self.steps.append(("all_gather", digit, self.frac[self.used], d, -1))
        if False not in self.ok:
            return
        for d2 in range(len(self.c)):
            if d2 != d and self.wants_next(d2, digit):
                self.slice(d2, 1 << (digit - 1), digit)
                return
