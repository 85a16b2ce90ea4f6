"""Fused communication kernels as rewrite rules over the redistribution steps.

DESIGN.md: "fused kernels are rewrite rules over its steps". After :func:`autopar.rewrite` has
turned a plan into explicit communication nodes, two patterns of a matmul next to one of its
steps are replaced by one fused node that :func:`autopar.lower` runs as a ring kernel
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
not slower than the matmul plus the collective (:func:`predict`). On ``cpu-emulated``
(devices sharing two cores, communication is a copy by the same cores) nothing overlaps, so
``"auto"`` never fuses there: the ring only adds its extra memory pass.

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
from typing import Any, Literal, Union

import numpy as np

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.parallel_graph import PNode, ParallelGraph
from autopar.strategies.cost import CLUSTERS, Cluster, CostModel, get_cluster

__all__ = ["FusedKernels", "FUSED_OPS", "NO_OVERLAP_CLUSTERS", "check_fused_kernels",
           "fuse_kernels", "predict", "run_fused"]

FusedKernels = Union[bool, Literal["auto"]]
#: MindSpore-style display names of the fused nodes.
FUSED_OPS: dict[str, str] = {"mm_reduce_scatter": "MatMulReduceScatter",
                             "all_gather_matmul": "AllGatherMatMul"}
#: Cluster presets whose devices cannot overlap compute and communication.
NO_OVERLAP_CLUSTERS = frozenset({"cpu-emulated"})


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
            overlap: bool | None = None) -> dict[str, float]:
    """Alpha-beta times (seconds) of the unfused pair and of the fused ring, with overlap.

    ``comm_bytes``: the collective's per-device bytes as the redistribution table counts them
    (reduce_scatter: its input; all_gather: its output). A ring of ``p`` devices runs ``p - 1``
    steps each moving ``comm_bytes / p`` (mm_reduce_scatter's accumulators travel in fp32:
    ``4 / itemsize`` times that) while one of ``p`` matmul blocks runs::

        unfused = T_mm + T_collective
        fused   = T_mm / p + (p - 1) * max(T_mm / p, alpha + block / bw) + extra   (overlap)
        fused   = T_mm + (p - 1) * (alpha + block / bw) + extra                    (no overlap)

    ``extra`` is the ring's additional local memory pass: mm_reduce_scatter slices x block by
    block, all_gather_matmul writes the products into row order once. ``bidirectional``: each
    step sends half a block each way at once (``block / 2`` per link direction). ``overlap``:
    whether the matmul blocks run while the transfers are in flight (default: unless the
    cluster is in :data:`NO_OVERLAP_CLUSTERS`; a ring in one matmul, ``chunks=1``, never does).
    """
    clus = get_cluster(cluster)
    cm = CostModel(clus)
    t_mm = cm.compute_time(flops, x_bytes + out_bytes)
    if kind == "mm_reduce_scatter":
        coll = "reduce_scatter"
        block = comm_bytes / p * (4 / itemsize)
        extra = x_bytes / clus.memory_bandwidth
    elif kind == "all_gather_matmul":
        coll = "all_gather"
        block = comm_bytes / p
        extra = out_bytes / clus.memory_bandwidth
    else:
        raise AutoParallelError("kind", kind, f"must be one of {sorted(FUSED_OPS)}")
    unfused = t_mm + cm.collective_time(coll, comm_bytes, p, intra=intra)
    bw, alpha = (clus.intra_bandwidth, clus.intra_alpha) if intra else \
        (clus.inter_bandwidth, clus.inter_alpha)
    t_step = alpha + (block / 2 if bidirectional else block) / bw
    if overlap is None:
        overlap = clus.name not in NO_OVERLAP_CLUSTERS
    if not overlap:
        fused = t_mm + (p - 1) * t_step + extra
    else:
        fused = t_mm / p + (p - 1) * max(t_mm / p, t_step) + extra
    return {"unfused": unfused, "fused": fused, "gain": unfused / fused}


# ---------------------------------------------------------------------------- matching


def _matmul_ok(node: PNode, pg: ParallelGraph) -> bool:
    if node.is_comm or node.op != "dot_general" or node.kind != "matmul":
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


def _group(axes: tuple[str, ...], pg: ParallelGraph) -> int:
    return pg.mesh.size_of(axes)


def _costs(kind: str, dot: PNode, comm: PNode, pg: ParallelGraph,
           cluster: str | Cluster) -> dict[str, float]:
    lhs, rhs = (pg.values[v] for v in dot.inputs)
    out = pg.values[dot.outputs[0]]
    m = int(np.prod(lhs.local_shape[:-1]))
    k, n = rhs.local_shape
    item = int(np.dtype(lhs.spec.dtype).itemsize)
    p = _group(comm.step.axes, pg)  # type: ignore[union-attr]
    cm = CostModel(get_cluster(cluster))
    _, intra = cm.group(comm.step.axes, pg.mesh)  # type: ignore[union-attr]
    if kind == "all_gather_matmul":
        m *= p
    return predict(kind, flops=2.0 * m * k * n, x_bytes=m * k * item,
                   out_bytes=int(np.prod(out.local_shape)) * item,
                   comm_bytes=comm.step.nbytes, p=p, intra=intra,  # type: ignore[union-attr]
                   cluster=cluster, itemsize=item)


def fuse_kernels(pg: ParallelGraph, fused_kernels: FusedKernels = "auto",
                 cluster: str | Cluster | None = None) -> ParallelGraph:
    """``pg`` with the matching matmul + step pairs replaced by fused nodes (module docstring).

    ``cluster`` prices ``"auto"`` (default: the cluster the plan was priced on, its
    ``cluster_config``, else the preset of that name).
    """
    mode = check_fused_kernels(fused_kernels)
    if mode is False:
        return pg
    if cluster is None:  # the plan's own cluster (custom ones too), else its preset by name
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
            p = _group(st.axes, pg)
            if pg.values[node.inputs[0]].local_shape[0] % p:
                continue
            if mode == "auto" and _costs("mm_reduce_scatter", node, c, pg,
                                         cluster)["gain"] < 1.0:  # type: ignore[arg-type]
                continue
            put[i] = _fused("mm_reduce_scatter", node, c, node.inputs, c.outputs)
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
            if mode == "auto" and _costs("all_gather_matmul", d, node, pg,
                                         cluster)["gain"] < 1.0:  # type: ignore[arg-type]
                continue
            put[j] = _fused("all_gather_matmul", d, node, (node.inputs[0], d.inputs[1]),
                            d.outputs)
            drop.add(i)
    if not put:
        return pg
    new = [put.get(i, n) for i, n in enumerate(nodes) if i not in drop]
    return replace(pg, nodes=tuple(new), values=MappingProxyType(dict(pg.values)))


def _fused(op: str, dot: PNode, comm: PNode, inputs: tuple[str, ...],
           outputs: tuple[str, ...]) -> PNode:
    st = comm.step
    assert st is not None
    note = f"{FUSED_OPS[op]}[{','.join(st.axes)}] = {dot.name} + {comm.name} ({comm.note})"
    return PNode(dot.name if op == "all_gather_matmul" else comm.name, op, "fused", inputs,
                 outputs, MappingProxyType({"axes": st.axes, "dot": dot.name,
                                            "comm": comm.name, "nbytes": st.nbytes}),
                 strategy=dot.strategy, source=dot.source, note=note)


# ---------------------------------------------------------------------------- lowering


def run_fused(node: PNode, args: list[Any], pg: ParallelGraph) -> list[Any]:
    """Run a fused node inside ``shard_map`` on local arrays."""
    from autopar.kernels import all_gather_matmul, mm_reduce_scatter

    x, w = args
    axes = tuple(node.params["axes"])
    name: Any = axes[0] if len(axes) == 1 else axes
    want = pg.values[node.outputs[0]].local_shape
    x2 = x.reshape(-1, x.shape[-1])
    if node.op == "mm_reduce_scatter":
        out = mm_reduce_scatter(x2, w, name)
    elif node.op == "all_gather_matmul":
        out = all_gather_matmul(x2, w, name)
    else:
        raise AutoParallelError("node", node.name, f"unknown fused kernel {node.op!r}")
    return [out.reshape(want)]
