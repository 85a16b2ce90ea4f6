"""Fused communication kernels as rewrite rules over the redistribution steps.

DESIGN.md: "fused kernels are rewrite rules over its steps". After
:func:`autopar.rewrite.rewrite` has
turned a plan into explicit communication nodes, two patterns of a matmul next to one of its
steps are replaced by one fused node that :func:`autopar.lower.lower` runs as a ring kernel
(``autopar.kernels``):

- **matmul -> ReduceScatter** (``mm_reduce_scatter``): a ``dot_general`` whose partial-sum
  output is immediately reduce-scattered along dim 0 over exactly its partial axes (Megatron's
  row-parallel matmul followed by sequence/batch split) becomes
  ``mm_reduce_scatter(x, w, axes)``;
- **AllGather -> matmul** (``all_gather_matmul``): an AllGather along dim 0 whose result is
  read only as the left operand of a ``dot_general`` becomes ``all_gather_matmul(x, w, axes)``.

Matmul shapes accepted: ``lhs (..., k) . rhs (k, n)`` (contracting lhs's last dim with rhs's
first, no batch dims, output dtype = input dtype); leading lhs dims are flattened into the
kernel's rows, which keeps dim-0 blocks contiguous (for mm_reduce_scatter the local dim 0 must
divide by the group size). The rule never fuses when the intermediate value (partial product
or gathered operand) has another reader or is a program output.

When to fuse (``fused_kernels``): ``False`` never, ``True`` wherever the pattern matches,
``"auto"`` (the default) where the alpha-beta model with overlap predicts the fused ring is
not slower than the matmul plus the collective (:func:`predict`). Where the cluster's
``overlap`` is 0 (``cpu-emulated``, and a calibration of emulated devices: communication is a
copy by the cores that compute) nothing overlaps, so ``"auto"`` never fuses there: the ring
only adds its extra memory pass.

Each fused node also records the ring schedule the same model predicts fastest on the
cluster (:func:`best_schedule`): one way or both ways round the ring (``bidirectional``) and
one matmul per block or one for all (``chunks=None`` / ``1``). Without a cluster (``True``
on a plan priced on none) the kernels' defaults run: one way, pipelined.

>>> predict("mm_reduce_scatter", flops=2 * 4096 * 1024 * 1024, x_bytes=4096 * 1024 * 2,
...         out_bytes=4096 * 1024 * 2, comm_bytes=4096 * 1024 * 2, p=8, intra=True,
...         cluster="accelerator-8x")["fused"] < \\
...     predict("mm_reduce_scatter", flops=2 * 4096 * 1024 * 1024, x_bytes=4096 * 1024 * 2,
...             out_bytes=4096 * 1024 * 2, comm_bytes=4096 * 1024 * 2, p=8, intra=True,
...             cluster="accelerator-8x")["unfused"]
True
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any, Literal, Mapping, Union

import numpy as np

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.graph.custom_rules import RuleBound
from autopar.kernels.mm_reduce_scatter import ring_hops
from autopar.parallel_graph import PNode, ParallelGraph
from autopar.strategies.cost import CLUSTERS, Cluster, CostModel, get_cluster
from autopar.strategies.layout import axis_name

__all__ = ["DEFAULT_SCHEDULE", "FusedKernels", "FUSED_OPS",
           "best_schedule", "check_fused_kernels", "fuse_kernels", "predict", "run_fused"]

FusedKernels = Union[bool, Literal["auto"]]
#: MindSpore-style display names of the fused nodes.
FUSED_OPS: dict[str, str] = {"mm_reduce_scatter": "MatMulReduceScatter",
                             "all_gather_matmul": "AllGatherMatMul"}
#: The ring schedule of a fused node when no cluster prices it (the kernels' defaults).
DEFAULT_SCHEDULE: MappingProxyType[str, Any] = MappingProxyType(
    {"bidirectional": False, "chunks": None})


def check_fused_kernels(value: Any, key: str = "fused_kernels") -> FusedKernels:
    """Validate the option: ``True``, ``False`` or ``"auto"``."""
    if isinstance(value, bool) or value == "auto":
        return value  # type: ignore[no-any-return]
    if isinstance(value, str):
        raise AutoParallelError(key, value, "must be True, False or 'auto'")
    raise AutoParallelTypeError(key, value, "a bool or the string 'auto'")


# ---------------------------------------------------------------------------- cost


def predict(kind: str, *, flops: float, x_bytes: float, out_bytes: float, comm_bytes: float,
            p: int, intra: bool, cluster: str | Cluster,
            itemsize: int = 4, bidirectional: bool = False,
            chunks: int | None = None) -> dict[str, float]:
    """Alpha-beta times (seconds) of the unfused pair and of the fused ring, with overlap.

    ``comm_bytes``: the collective's per-device bytes as the redistribution table counts them
    (reduce_scatter: its input; all_gather: its output). Every device sends ``p - 1`` blocks
    of ``comm_bytes / p`` (mm_reduce_scatter's accumulators travel in fp32: ``4 / itemsize``
    times that) in ``R`` rounds -- ``R = p - 1`` one way, ``ceil((p - 1) / 2)`` both ways
    (each round then uses both directions of the links) -- while the local matmul runs in
    ``c = chunks`` pieces (default ``p``), the first of which cannot overlap anything::

        unfused = T_mm + T_collective                          (as the search prices it)
        fused   = T_mm / c + R * max((c - 1) / c * T_mm / R, alpha + block / bw) + extra
        fused   = T_mm + R * (alpha + block / bw) + extra       (no overlap, or c = 1)

    ``extra`` is the ring's additional local memory traffic: mm_reduce_scatter adds each
    arriving accumulator to a partial product (a pass over three blocks per hop, which a
    reduce-scatter does inside the collective) and, pipelined, copies the rows of ``x``
    block by block (``chunks=1`` reads its one product in place);
    all_gather_matmul writes the products into row order once (``chunks=1``: assembles the
    gathered ``x`` instead). A hop is priced as the cluster's ``collective_permute`` of one
    block. The cluster's ``overlap`` (measured by :func:`autopar.calibrate`) is the fraction
    of the transfers that hides behind compute; at 0 (emulated devices, whose cores both
    compute and move data) nothing overlaps, neither a matmul and a transfer nor the two
    directions of a link (``R = p - 1`` both ways).
    """
    clus = _resolved(cluster)
    cm = CostModel(clus)
    c = p if chunks is None else int(chunks)
    if c < 1 or p % c:
        raise AutoParallelError("chunks", chunks, f"must be a divisor of p = {p}")
    t_mm = cm.compute_time(flops, x_bytes + out_bytes)
    mem = clus.memory_bandwidth
    if kind == "mm_reduce_scatter":
        coll = "reduce_scatter"
        block = comm_bytes / p * (4 / itemsize)
        # + each hop's add (read two blocks, write one) outside the collective
        extra = (x_bytes / mem if c > 1 else 0.0) + 3 * (p - 1) * block / mem
    elif kind == "all_gather_matmul":
        coll = "all_gather"
        block = comm_bytes / p
        extra = (out_bytes / mem if c > 1 else 0.0) + (x_bytes / mem if c < p else 0.0)
    else:
        raise AutoParallelError("kind", kind, f"must be one of {sorted(FUSED_OPS)}")
    unfused = t_mm + cm.collective_time(coll, comm_bytes, p, intra=intra)
    t_step = cm.collective_time("collective_permute", block, p, intra=intra)  # one hop
    ov = clus.overlap
    rounds = ring_hops(p, bidirectional and ov > 0)[0]  # the kernels' own round count
    serial = t_mm + rounds * t_step + extra
    if c == 1 or ov == 0:
        fused = serial
    else:  # the overlappable fraction of the transfers hides behind the matmul chunks
        hidden = t_mm / c + rounds * max((c - 1) / c * t_mm / rounds, t_step) + extra
        fused = ov * hidden + (1 - ov) * serial
    return {"unfused": unfused, "fused": fused, "gain": unfused / fused}


def _resolved(cluster: str | Cluster) -> Cluster:
    """``cluster`` as a Cluster: a preset name, ``"calibrated"`` or a file resolved
    (:func:`autopar.clusters.resolve_cluster`); a Cluster is already one."""
    if isinstance(cluster, Cluster):
        return cluster
    from autopar.clusters import resolve_cluster

    return resolve_cluster(cluster)


def best_schedule(kind: str, p: int, cluster: str | Cluster,
                  **shapes: Any) -> tuple[dict[str, Any], dict[str, float]]:
    """The ring schedule (``bidirectional``, ``chunks``) the model predicts fastest, and its
    :func:`predict` result; ties go to the simpler schedule (one way, pipelined)."""
    best: tuple[dict[str, Any], dict[str, float]] | None = None
    cluster = _resolved(cluster)  # (once for the four schedules)
    for bidirectional in (False, True):
        for chunks in (None, 1):
            r = predict(kind, p=p, cluster=cluster, bidirectional=bidirectional,
                        chunks=chunks, **shapes)
            if best is None or r["fused"] < best[1]["fused"] * (1 - 1e-9):
                best = ({"bidirectional": bidirectional, "chunks": chunks}, r)
    assert best is not None
    return best


# ---------------------------------------------------------------------------- matching


def _matmul_ok(node: PNode, pg: ParallelGraph) -> bool:
    if node.is_comm or node.op != "dot_general" or node.kind != "matmul":
        return False
    if isinstance(node.primitive, RuleBound):  # a custom rule's body: kept as re-bound
        return False
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = (pg.values[v] for v in node.inputs)
    out = pg.values[node.outputs[0]]
    r = len(lhs.local_shape)
    return (r >= 2 and len(rhs.local_shape) == 2 and tuple(lc) == (r - 1,)
            and tuple(rc) == (0,) and not lb and not rb
            and lhs.spec.dtype == rhs.spec.dtype == out.spec.dtype)


def _consumers(pg: ParallelGraph) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, n in enumerate(pg.nodes):
        for v in n.inputs:
            out.setdefault(v, []).append(i)
    return out


def _schedule(kind: str, dot: PNode, comm: PNode, pg: ParallelGraph, cluster: str | Cluster | None
              ) -> tuple[Mapping[str, Any], dict[str, float] | None]:
    """The fastest ring schedule for one matched pair on ``cluster`` (:func:`best_schedule`);
    without a cluster the kernels' defaults, unpriced."""
    if cluster is None:
        return DEFAULT_SCHEDULE, None
    lhs, rhs = (pg.values[v] for v in dot.inputs)
    out = pg.values[dot.outputs[0]]
    m = int(np.prod(lhs.local_shape[:-1]))
    k, n = rhs.local_shape
    item = int(np.dtype(lhs.spec.dtype).itemsize)
    cm = CostModel(get_cluster(cluster))  # resolved by fuse_kernels
    p, intra = cm.group(comm.step.axes, pg.mesh)  # type: ignore[union-attr]
    if kind == "all_gather_matmul":
        m *= p
    return best_schedule(kind, p, cluster, flops=2.0 * m * k * n, x_bytes=m * k * item,
                         out_bytes=int(np.prod(out.local_shape)) * item,
                         comm_bytes=comm.step.nbytes, intra=intra,  # type: ignore[union-attr]
                         itemsize=item)


def fuse_kernels(pg: ParallelGraph, fused_kernels: FusedKernels = "auto",
                 cluster: str | Cluster | None = None) -> ParallelGraph:
    """``pg`` with the matching matmul + step pairs replaced by fused nodes (module docstring).

    ``cluster`` prices ``"auto"`` (default: the cluster the plan was priced on, its
    ``cluster_config``, else the preset of that name).
    """
    mode = check_fused_kernels(fused_kernels)
    if mode is False:
        return pg
    if cluster is not None:
        cluster = _resolved(cluster)
    else:  # the plan's own cluster (custom ones too), else its preset by name
        cluster = getattr(pg.plan, "cluster_config", None)
        if cluster is None:
            name = getattr(pg.plan, "cluster", None)
            cluster = name if name in CLUSTERS else None
        if cluster is None and mode == "auto":
            return pg
    nodes = list(pg.nodes)
    uses = _consumers(pg)
    outputs = set(pg.outputs)
    drop: set[int] = set()
    put: dict[int, PNode] = {}
    for i, node in enumerate(nodes):
        if i in drop or i in put:
            continue
        if _matmul_ok(node, pg):  # matmul -> reduce_scatter
            v = node.outputs[0]
            readers = uses.get(v, [])
            if len(readers) != 1 or v in outputs:
                continue
            c = nodes[readers[0]]
            st = c.step
            if st is None or st.kind != "reduce_scatter" or st.dim != 0 or \
                    set(st.axes) != set(pg.values[v].layout.partial):
                continue
            if pg.values[node.inputs[0]].local_shape[0] % pg.mesh.size_of(st.axes):
                continue
            sched, cost = _schedule("mm_reduce_scatter", node, c, pg, cluster)
            if mode == "auto" and cost is not None and cost["gain"] < 1.0:
                continue
            put[i] = _fused("mm_reduce_scatter", node, c, node.inputs, c.outputs, sched)
            drop.add(readers[0])
        elif node.step is not None and node.step.kind == "all_gather" and node.step.dim == 0:
            v = node.outputs[0]
            readers = uses.get(v, [])
            if len(readers) != 1 or v in outputs:
                continue
            j = readers[0]
            d = nodes[j]
            if not _matmul_ok(d, pg) or d.inputs[0] != v or d.inputs[1] == v:
                continue
            sched, cost = _schedule("all_gather_matmul", d, node, pg, cluster)
            if mode == "auto" and cost is not None and cost["gain"] < 1.0:
                continue
            put[j] = _fused("all_gather_matmul", d, node, (node.inputs[0], d.inputs[1]),
                            d.outputs, sched)
            drop.add(i)
    if not put:
        return pg
    new = [put.get(i, n) for i, n in enumerate(nodes) if i not in drop]
    return replace(pg, nodes=tuple(new), values=MappingProxyType(dict(pg.values)))


def _fused(op: str, dot: PNode, comm: PNode, inputs: tuple[str, ...],
           outputs: tuple[str, ...], schedule: Mapping[str, Any]) -> PNode:
    st = comm.step
    assert st is not None
    ring = ("both ways" if schedule["bidirectional"] else "one way") + \
        (", one matmul" if schedule["chunks"] == 1 else ", pipelined")
    note = (f"{FUSED_OPS[op]}[{','.join(st.axes)}] = {dot.name} + {comm.name} ({comm.note}; "
            f"ring {ring})")
    return PNode(dot.name if op == "all_gather_matmul" else comm.name, op, "fused", inputs,
                 outputs, MappingProxyType({"axes": st.axes, "dot": dot.name,
                                            "comm": comm.name, "nbytes": st.nbytes,
                                            **schedule}),
                 strategy=dot.strategy, source=dot.source, note=note, display=FUSED_OPS[op])


# ---------------------------------------------------------------------------- lowering


def run_fused(node: PNode, args: list[Any], pg: ParallelGraph) -> list[Any]:
    """Run a fused node inside ``shard_map`` on local arrays."""
    from autopar.kernels import all_gather_matmul, mm_reduce_scatter

    x, w = args
    name = axis_name(node.params["axes"])
    want = pg.values[node.outputs[0]].local_shape
    x2 = x.reshape(-1, x.shape[-1])
    sched = {key: node.params.get(key, DEFAULT_SCHEDULE[key]) for key in DEFAULT_SCHEDULE}
    if node.op == "mm_reduce_scatter":
        out = mm_reduce_scatter(x2, w, name, **sched)
    elif node.op == "all_gather_matmul":
        out = all_gather_matmul(x2, w, name, **sched)
    else:
        raise AutoParallelError("node", node.name, f"unknown fused kernel {node.op!r}")
    return [out.reshape(want)]
