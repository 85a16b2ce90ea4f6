"""Uneven batches: a batch that does not divide the data-parallel degree, run exactly.

``parallelize(fn, *args, uneven_batch="all_gather_v")`` runs a batch of ``B`` rows on ``n``
devices with ``B % n != 0`` as MindSpore splits an uneven dataset: the first ``B % n`` ranks
get ``ceil(B / n)`` rows, the others ``floor(B / n)`` (:func:`batch_counts`). SPMD needs one
shape on every device, so each device's block is padded to ``L = ceil(B / n)`` rows (with
copies of one of its real rows, so the padding computes ordinary values); the program is
traced and searched at the padded batch ``P = n * L`` with the batch dim split ``n`` ways,
and every output carrying the batch is gathered with :func:`autopar.kernels.all_gather_v`
to exactly ``B`` rows inside the ``shard_map`` (the padding rows are never sent).

Worked example: ``B = 6`` on 4 devices gives counts ``(2, 2, 1, 1)``, row offsets
``(0, 2, 4, 5)``, ``L = 2`` and ``P = 8``; device 2 holds rows ``[4, 4]`` (row 4 and its
padding copy) and contributes only its first row to the gather.

This is exact only when no operator mixes batch rows. :func:`UnevenRequest.check` proves it
from the parallel program before anything runs, and raises
:class:`~autopar.errors.AutoParallelError` naming the first offending node otherwise:

1. ``fn`` is traced at ``B`` and at ``P``; the two graphs must be the same operators with
   the same literals and parameters, except sizes ``B`` <-> ``P`` (so nothing reads the batch
   size as a number, e.g. ``jnp.mean`` over the batch dividing by it);
2. every value computed from a batch input, or whose shape changed with the batch, keeps the
   batch as dim 0 (size ``P``) split over exactly the batch axes, with no other dim and no
   pending partial sum over those axes (a reduction over the batch leaves a partial sum or
   loses dim 0; a transpose moves it);
3. no communication (or fused communication kernel) over the batch axes acts on such a value
   (an AllReduce / AllGather / AlltoAll over the batch would combine rows);
4. no ``iota`` counts along a dim split over the batch axes (it would number padded rows),
   and no ``random_bits`` draws the padded batch (its rows are the padded batch's);
5. a value of the padded batch's shape that is the same in every row -- a broadcast
   constant (``jnp.zeros_like(x)``, ``jnp.where``'s scalar) and elementwise operators of such
   values, computed from no batch input (not an ``iota``: it numbers rows) -- may have any
   layout: its padded rows meet only padded rows, elementwise; it may not be reduced or
   reshaped on its own (that would count its padded rows) nor be an output.

Training (:func:`autopar.train_step`) still refuses uneven splits: a gradient is a sum over
the batch, which is exactly the row mixing refused here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.graph.ir import Graph
from autopar.graph.tracer import trace
from autopar.lower import block_index
from autopar.parallel_graph import ParallelGraph

__all__ = ["UNEVEN_BATCH_CHOICES", "check_uneven_batch", "batch_counts", "UnevenRequest",
           "UnevenBatch", "plan_uneven"]

#: ``parallelize(uneven_batch=...)``: ``"divisor"`` splits the batch by a divisor of it (the
#: default: a batch of 6 on 4 devices runs 2-way); ``"all_gather_v"`` splits it unevenly.
UNEVEN_BATCH_CHOICES = ("divisor", "all_gather_v")
_HINT = ('Use a batch size divisible by the device count, or uneven_batch="divisor" (and '
         'parallel_mode="data_parallel" if the search moved the batch)')


def check_uneven_batch(value: Any) -> str:
    """Validate ``parallelize``'s ``uneven_batch`` option."""
    if not isinstance(value, str):
        raise AutoParallelTypeError("uneven_batch", value,
                                    f"must be a str, one of {list(UNEVEN_BATCH_CHOICES)}")
    if value not in UNEVEN_BATCH_CHOICES:
        raise AutoParallelError("uneven_batch", value,
                                f"must be one of {list(UNEVEN_BATCH_CHOICES)}")
    return value


def batch_counts(batch: int, ranks: int) -> tuple[int, ...]:
    """MindSpore's uneven split: the first ``batch % ranks`` ranks get one row more.

    >>> batch_counts(6, 4), batch_counts(3, 4)
    ((2, 2, 1, 1), (1, 1, 1, 0))
    """
    q, r = divmod(batch, ranks)
    return tuple(q + 1 if i < r else q for i in range(ranks))


# --------------------------------------------------------------------------- the request


@dataclass(frozen=True, eq=False)
class UnevenRequest:
    """An uneven batch found in the example arguments: trace at ``padded_args`` next."""

    batch: int
    ranks: int
    original: Graph                # ``fn`` traced at the real batch
    padded_args: tuple[Any, ...]   # the example arguments with the batch padded to n * L

    @property
    def rows(self) -> int:
        """``L``: rows per device (the largest count)."""
        return -(-self.batch // self.ranks)

    @property
    def padded(self) -> int:
        return self.rows * self.ranks

    def _mixes(self, node: str, why: str) -> AutoParallelError:
        err = AutoParallelError(
            "uneven_batch", "all_gather_v",
            f"the batch size {self.batch} does not divide the data-parallel degree "
            f"{self.ranks}, and node {node!r} mixes batch rows ({why}), so padded rows would "
            f"change the result", _HINT)
        err.mixing = f"node {node!r} mixes batch rows ({why})"  # (said again by a fallback)
        return err

    def check(self, graph: Graph, pg: ParallelGraph) -> "UnevenBatch":
        """Prove the parallel program row-wise (module docstring) and build its adapter."""
        inputs = [v for v in graph.data_inputs() if graph.spec(v).rank]
        axes: tuple[str, ...] = ()
        for v in inputs:
            dims = pg.values[v].layout.dims
            if pg.mesh.size_of(dims[0]) != self.ranks:
                raise AutoParallelError(
                    "uneven_batch", "all_gather_v",
                    f"the plan splits batch input {v!r} (dim 0 = {self.padded} padded rows) "
                    f"{pg.mesh.size_of(dims[0])} ways, all_gather_v needs {self.ranks}",
                    'Use parallel_mode="data_parallel" (or strategies that split the batch '
                    'over every device), or uneven_batch="divisor"')
            if axes and dims[0] != axes:
                raise self._mixes(v, f"it is split over {list(dims[0])}, the other batch "
                                  f"inputs over {list(axes)}: their rows would not align")
            axes = dims[0]
        rows = self._row_values(graph, pg, frozenset(inputs), axes)
        self._same_program(graph)
        outputs = tuple(v in rows for v in pg.outputs)
        return UnevenBatch(self.batch, self.ranks, self.rows, batch_counts(self.batch,
                           self.ranks), axes, frozenset(inputs), outputs)

    def _same_program(self, graph: Graph) -> None:
        """Rule 1: the traces at B and P differ only in sizes B <-> P."""
        b, p = self.batch, self.padded
        for nb, np_ in zip(self.original.nodes, graph.nodes):
            why = ""
            if (nb.op, len(nb.inputs)) != (np_.op, len(np_.inputs)):
                why = f"the trace at batch {b} has {nb.op!r} here, at {p} {np_.op!r}"
            for vb, vp in zip(nb.inputs, np_.inputs):
                xb, xp = self.original.values[vb], graph.values[vp]
                if (xb.data is None) != (xp.data is None) or xb.data is not None and (
                        xb.data.shape != xp.data.shape or not _same_literal(xb.data, xp.data)):
                    why = why or f"its operand {vb!r} depends on the batch size"
            for key in sorted(set(nb.params) | set(np_.params)):
                if not _same(nb.params.get(key), np_.params.get(key), b, p):
                    why = why or f"its parameter {key!r} depends on the batch size"
            if why:
                raise self._mixes(np_.name, why)
        if len(self.original.nodes) != len(graph.nodes):
            raise self._mixes(graph.name, "its operators depend on the batch size")

    def _row_values(self, graph: Graph, pg: ParallelGraph, inputs: frozenset[str],
                    axes: tuple[str, ...]) -> frozenset[str]:
        """Rules 2-5: the values carrying batch rows, checked along the program."""
        rows, consts = set(inputs), set()  # consts: batch-shaped, the same in every row
        for node in pg.nodes:
            if node.kind == "loop":  # (its body's program is not walked: refused, typed)
                raise self._mixes(node.name, "a loop's body is not checked for batch rows "
                                  "(uneven batches do not run loops)")
            touched = any(v in rows for v in node.inputs)
            const_in = any(v in consts for v in node.inputs)
            if node.step is not None or node.is_fused:
                over = set(node.step.axes if node.step is not None else node.params["axes"])
                if touched and over & set(axes):
                    raise self._mixes(node.name, f"{node.display_op} over the batch axes "
                                      f"combines rows: {node.note}")
                (rows if touched else consts if const_in else set()).update(node.outputs)
                continue
            if node.op == "iota":
                dim = node.params["dimension"]
                if set(pg.values[node.outputs[0]].layout.dims[dim]) & set(axes):
                    raise self._mixes(node.name, "an iota along the split batch dim numbers "
                                      "padded rows")
            if node.op == "random_bits" and self._row_shape(pg, node.outputs[0]) == "":
                raise self._mixes(node.name, "a random draw of the padded batch's shape "
                                  "numbers padded rows: a device would draw rows of the "
                                  "padded batch, not the one-device draw's rows it holds")
            uniform = _uniform_rows(node, pg, consts)
            for v in node.outputs:
                self._classify(node.name, pg, v, axes, touched, const_in, uniform, rows,
                               consts)
        const_out = [v for v in pg.outputs if v in consts]
        if const_out:
            raise self._mixes(const_out[0], "an output computed from no batch input has the "
                              "padded batch as dim 0")
        return frozenset(rows)

    def _classify(self, name: str, pg: ParallelGraph, v: str, axes: tuple[str, ...],
                  touched: bool, const_in: bool, uniform: bool, rows: set[str],
                  consts: set[str]) -> None:
        """Output ``v`` of node ``name``: a row value (rule 2), a value the same in every
        row (rule 5: made by a ``uniform`` node from no batch input; any layout), or
        neither; else the node mixes rows."""
        before = self.original.values.get(v)
        if touched or (before is not None and before.spec.shape != pg.values[v].spec.shape):
            why = self._row_shape(pg, v) or self._row_layout(pg, v, axes)
            if not why:
                rows.add(v)
            elif touched or not uniform or self._row_shape(pg, v):
                raise self._mixes(name, f"its output {v!r} {why}")
            else:
                consts.add(v)
        elif const_in:
            raise self._mixes(name, f"it reduces or reshapes a value that is the same in "
                              f"every row over its padded rows (its output {v!r} has no "
                              f"batch dim)")

    def _row_shape(self, pg: ParallelGraph, v: str) -> str:
        val, b, p = pg.values[v], self.batch, self.padded
        before = self.original.values.get(v)
        if not val.spec.shape or val.spec.shape[0] != p:
            return f"(shape {val.spec.shape}) no longer has the batch as dim 0"
        if before is None or before.spec.shape != (b,) + val.spec.shape[1:]:
            return "changes shape other than in its batch dim"
        return ""

    def _row_layout(self, pg: ParallelGraph, v: str, axes: tuple[str, ...]) -> str:
        val = pg.values[v]
        if tuple(val.layout.dims[0]) != axes or set(val.layout.partial) & set(axes) or \
                any(set(d) & set(axes) for d in val.layout.dims[1:]):
            return f"has layout {val.layout}, not its batch dim split over {list(axes)}"
        return ""


def _uniform_rows(node: Any, pg: ParallelGraph, consts: set[str]) -> bool:
    """Whether ``node``, reading no batch row, makes a value that is the same in every row:
    a broadcast that makes dim 0 (or keeps dim 0 of such a value), or an elementwise
    operator (of such values); not an iota (it numbers rows) nor any other operator."""
    if node.op == "broadcast_in_dim":
        src = pg.values[node.inputs[0]].spec.shape
        dims = tuple(node.params["broadcast_dimensions"])
        return 0 not in dims or src[dims.index(0)] == 1 or (
            dims.index(0) == 0 and node.inputs[0] in consts)
    return node.kind == "elementwise"


def _same_literal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal literals, NaN equal to NaN (``jnp.var``'s NaN constant is one literal in both
    traces)."""
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def _same(a: Any, b: Any, batch: int, padded: int) -> bool:
    """Primitive parameters equal, up to sizes ``batch`` (in ``a``) <-> ``padded`` (in ``b``)."""
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)) and \
            not isinstance(a, bool) and not isinstance(b, bool):
        return a == b or (a == batch and b == padded)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and \
            all(_same(x, y, batch, padded) for x, y in zip(a, b))
    try:
        eq = a == b
    except Exception:  # an object without a usable ==: treat as differing
        return False
    return eq if isinstance(eq, bool) else False


def plan_uneven(fn: Callable[..., Any], example_args: Sequence[Any], uneven_batch: str,
                device_num: int) -> UnevenRequest | None:
    """An :class:`UnevenRequest` when ``uneven_batch="all_gather_v"`` and the batch inputs'
    dim 0 does not divide ``device_num``; None otherwise (the default path then runs).

    The batch inputs are the rank >= 1 leaves of every argument after the first when there
    are two or more (the first holds the parameters), else of the one argument.
    """
    if uneven_batch != "all_gather_v" or device_num <= 1:
        return None
    first = 1 if len(example_args) >= 2 else 0
    sizes = {}
    for i, arg in enumerate(example_args[first:], start=first):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            if np.ndim(leaf):
                sizes[f"args[{i}]{jax.tree_util.keystr(path)}"] = int(np.shape(leaf)[0])
    if not sizes or len(set(sizes.values())) != 1:
        if sizes:
            raise AutoParallelError("batch inputs", sizes, "uneven_batch='all_gather_v' needs "
                                    "every batch input to have the same dim 0 (the batch)")
        return None
    batch = next(iter(sizes.values()))
    if batch % device_num == 0:
        return None
    rows = -(-batch // device_num)

    def pad(leaf: Any) -> Any:
        if not np.ndim(leaf):
            return leaf
        return jnp.zeros((rows * device_num,) + tuple(np.shape(leaf)[1:]), leaf.dtype)

    padded = tuple(example_args[:first]) + tuple(
        jax.tree_util.tree_map(pad, a) for a in example_args[first:])
    return UnevenRequest(batch, device_num, trace(fn, *example_args), padded)


# --------------------------------------------------------------------------- execution


@dataclass(frozen=True, eq=False)
class UnevenBatch:
    """How the lowered program takes ``batch`` rows and returns them (the lowering adapter).

    Batch inputs come in whole (replicated) and each device takes its block, padded to
    ``rows``; batch outputs leave through ``all_gather_v`` with ``counts`` rows per rank.
    """

    batch: int
    ranks: int
    rows: int
    counts: tuple[int, ...]
    axes: tuple[str, ...]          # the batch's mesh axes, outer first
    inputs: frozenset[str]         # batch input values
    outputs: tuple[bool, ...]      # per program output: carries the batch (gathered)

    @property
    def displs(self) -> tuple[int, ...]:
        """Row offset of each rank's rows in the batch."""
        return tuple(int(s) for s in np.cumsum((0,) + self.counts[:-1]))

    def row_table(self) -> np.ndarray:
        """``(ranks, rows)`` batch row held at each local position; padding repeats a row."""
        table = np.zeros((self.ranks, self.rows), np.int32)
        for r, (c, d) in enumerate(zip(self.counts, self.displs)):
            for j in range(self.rows):
                table[r, j] = min(d + min(j, max(c - 1, 0)), self.batch - 1)
        return table

    def specs(self, pg: ParallelGraph, in_specs: tuple[Any, ...],
              out_specs: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Batch inputs and outputs are whole on every device (the batch is uneven)."""
        ins = tuple(PartitionSpec() if v in self.inputs else s
                    for v, s in zip(pg.inputs, in_specs))
        outs = tuple(PartitionSpec() if g else s for g, s in zip(self.outputs, out_specs))
        return ins, outs

    def arg_shape(self, v: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the caller passes for program input ``v``."""
        return (self.batch,) + shape[1:] if v in self.inputs else shape

    def enter(self, pg: ParallelGraph, flat: Sequence[Any]) -> tuple[Any, ...]:
        """Inside ``shard_map``: each device takes its rows of every batch input."""
        rank = block_index(self.axes, pg.mesh.sizes)
        mine = jnp.asarray(self.row_table())[rank]
        return tuple(jnp.take(x, mine, axis=0) if v in self.inputs else x
                     for v, x in zip(pg.inputs, flat))

    def leave(self, pg: ParallelGraph, outs: Sequence[Any]) -> tuple[Any, ...]:
        """Inside ``shard_map``: gather each batch output's real rows with all_gather_v."""
        from autopar.kernels.all_gather_v import all_gather_v

        name = self.axes[0] if len(self.axes) == 1 else self.axes
        res = []
        for gather, y in zip(self.outputs, outs):
            if gather:
                row = math.prod(y.shape[1:])
                y = all_gather_v(y, None, [c * row for c in self.counts],
                                 [d * row for d in self.displs],
                                 (self.batch,) + tuple(y.shape[1:]), name)
            res.append(y)
        return tuple(res)
