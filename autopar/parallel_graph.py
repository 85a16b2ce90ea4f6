"""ParallelGraph: the per-device program, with local shapes and explicit communication.

:func:`autopar.rewrite.rewrite` turns a traced :class:`~autopar.graph.ir.Graph` and a
:class:`~autopar.strategies.plan.Plan` into a ParallelGraph: every value carries its global
spec, its :class:`~autopar.strategies.layout.TensorLayout` and its local (per-device) shape; every
place where a producer's layout differs from what a consumer needs holds explicit
communication nodes, one per redistribution :class:`~autopar.strategies.redistribution.Step`
(AllReduce, ReduceScatter, AllGather, AlltoAll, or a local StridedSlice). Printing it gives a
MindSpore-style IR dump of the parallel program::

    ParallelGraph 'loss' on 8 devices (a0:2xa1:2xa2:2): 17 operators, 1 communication (AllReduce 1)
    ...
    %layer1/dot_general_0  dot_general  (%layer0/tanh_0, %params/layer1/w)  [8,64]  R P[a0,a1,a2]
    %all_reduce_0          AllReduce[a0,a1,a2]  (%layer1/dot_general_0)     [8,64]  R  ...

``values[name].layout`` of a graph input is the layout it is placed with (its
``PartitionSpec`` is the ``shard_map`` in-spec); graph outputs never hold pending partial sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from autopar.graph.ir import Graph, Strategy, TensorSpec
from autopar.strategies.layout import DeviceMesh, TensorLayout
from autopar.strategies.redistribution import STEP_KINDS, Step
from autopar.text import table as text_table

__all__ = ["PValue", "PNode", "ParallelGraph"]


@dataclass(frozen=True, slots=True, eq=False)
class PValue:
    """A tensor of the parallel program: global spec, layout and per-device shape.

    ``origin`` is the graph value it holds (itself for graph values; for the output of a
    communication node, the value being redistributed).
    """

    name: str
    spec: TensorSpec
    layout: TensorLayout
    local_shape: tuple[int, ...]
    kind: str  # param | data | const | literal | activation | comm
    origin: str
    data: np.ndarray | None = None

    @property
    def local_spec(self) -> TensorSpec:
        return TensorSpec(self.local_shape, self.spec.dtype)


@dataclass(frozen=True, slots=True, eq=False)
class PNode:
    """An operator (re-bound per device with local shapes) or a communication step."""

    name: str
    op: str                        # JAX primitive name, or the step kind for communication
    kind: str                      # the graph node kind, or "comm"
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: Mapping[str, Any]
    primitive: Any = None
    step: Step | None = None
    strategy: Strategy | None = None
    source: str = ""
    note: str = ""                 # for communication: which value, for which consumer
    display: str = ""              # a fused kernel's MindSpore name (autopar/kernel_rules.py)
    remat: Any = None              # its jax.checkpoint region (autopar/graph/remat.py)

    @property
    def is_comm(self) -> bool:
        return self.step is not None

    @property
    def op_name(self) -> str:
        """The MindSpore operator of a communication node (its step kind's ``display``) or a
        fused kernel; the primitive of an operator."""
        if self.step is not None:
            return STEP_KINDS[self.step.kind].display
        return self.display if self.is_fused else self.op

    @property
    def is_fused(self) -> bool:
        """A matmul fused with its collective (a ring kernel, see autopar/kernel_rules.py)."""
        return self.kind == "fused"

    @property
    def display_op(self) -> str:
        if self.is_fused:
            return f"{self.op_name}[{','.join(self.params['axes'])}]"
        if self.step is None:
            return self.op
        name = f"{self.op_name}[{','.join(self.step.axes)}]"
        return f"{name}({self.step.where})" if self.step.where else name


@dataclass(frozen=True, eq=False)
class ParallelGraph:
    """The rewritten program (see the module docstring). Nodes are in execution order."""

    name: str
    mesh: DeviceMesh
    nodes: tuple[PNode, ...]
    values: Mapping[str, PValue]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    graph: Graph
    plan: Any                      # the Plan it was rewritten from
    in_tree: Any = None
    out_tree: Any = None

    @property
    def device_num(self) -> int:
        return self.mesh.device_num

    def comm_nodes(self) -> tuple[PNode, ...]:
        return tuple(n for n in self.nodes if n.is_comm)

    def fused_nodes(self) -> tuple[PNode, ...]:
        """Matmuls fused with their collective (``mm_reduce_scatter``, ``all_gather_matmul``)."""
        return tuple(n for n in self.nodes if n.is_fused)

    def comm_counts(self) -> dict[str, int]:
        """Communication nodes per step kind, e.g. ``{'all_reduce': 1}`` (slices included);
        fused kernels count under their name (``mm_reduce_scatter``, ``all_gather_matmul``)."""
        out: dict[str, int] = {}
        for n in self.comm_nodes() + self.fused_nodes():
            out[n.op] = out.get(n.op, 0) + 1
        return dict(sorted(out.items()))

    def comm_bytes(self) -> int:
        """Per-device bytes the inserted collectives move in forward (the cost formula's n),
        including those of collectives fused into a matmul (``fused_nodes``)."""
        return sum(n.step.nbytes for n in self.comm_nodes()
                   if n.step is not None and STEP_KINDS[n.step.kind].collective) + \
            sum(int(n.params["nbytes"]) for n in self.fused_nodes())

    def in_layouts(self) -> tuple[TensorLayout, ...]:
        return tuple(self.values[v].layout for v in self.inputs)

    def out_layouts(self) -> tuple[TensorLayout, ...]:
        return tuple(self.values[v].layout for v in self.outputs)

    # ------------------------------------------------------------------ printing
    def _ref(self, v: str) -> str:
        val = self.values[v]
        if val.kind == "literal" and val.data is not None and val.data.size == 1:
            return repr(val.data.item())
        return f"%{v}"

    def summary(self) -> str:
        ops = sum(1 for n in self.nodes if not n.is_comm and not n.is_fused)
        counts = self.comm_counts()
        names = {n.op: n.op_name for n in self.comm_nodes() + self.fused_nodes()}
        comm = ", ".join(f"{names[k]} {c}" for k, c in counts.items())
        return (f"ParallelGraph {self.name!r} on {self.device_num} devices ({self.mesh}): "
                f"{ops} operators, {sum(counts.values())} communication"
                + (f" ({comm})" if comm else ""))

    def __str__(self) -> str:
        def shape(v: str) -> str:
            return "[" + ",".join(map(str, self.values[v].local_shape)) + "]"

        lines = [self.summary(), "", "inputs:"]
        rows = [("value", "global", "local", "layout")]
        for v in self.inputs:
            val = self.values[v]
            rows.append((f"%{v}", str(val.spec), shape(v), str(val.layout)))
        lines += _table(rows)
        lines += ["", "nodes:"]
        rows = [("value", "op", "inputs", "local", "layout", "strategy / note")]
        for n in self.nodes:
            outs = n.outputs
            extra = n.note if n.is_comm or n.is_fused else (str(n.strategy) if n.strategy else "")
            rows.append((", ".join(f"%{o}" for o in outs), n.display_op,
                         "(" + ", ".join(self._ref(i) for i in n.inputs) + ")",
                         " ".join(shape(o) for o in outs),
                         " ".join(str(self.values[o].layout) for o in outs), extra))
        lines += _table(rows)
        lines += ["", "outputs:"]
        rows = [("value", "global", "local", "layout")]
        for v in self.outputs:
            val = self.values[v]
            rows.append((self._ref(v), str(val.spec), shape(v), str(val.layout)))
        lines += _table(rows)
        for n in self.nodes:  # a loop's per-iteration program
            if n.kind == "loop":
                lines += ["", f"body of loop {n.name} (x{n.params['length']}), every iteration:"]
                lines += [f"  {x}" if x else x for x in str(n.params["program"]).split("\n")]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"ParallelGraph({self.name!r}, {self.device_num} devices, {len(self.nodes)} "
                f"nodes, comm {self.comm_counts()})")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    return ["  " + line for line in text_table(rows, align="l" * len(rows[0])).split("\n")]
