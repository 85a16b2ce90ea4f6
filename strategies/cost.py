"""The cost model shared by every search mode: compute, communication, memory.

Compute: roofline per device, ``max(flops / peak_flops, bytes / memory_bandwidth)``.
Communication: the alpha-beta model per collective over a group of ``p`` devices, with the
link of the group (intra-node when all its axes are inside one node, else inter-node):

- all_reduce:      2(p-1)/p * n / B + 2(p-1) * alpha
- reduce_scatter:  (p-1)/p * n / B + (p-1) * alpha     (n: input bytes per device)
- all_gather:      (p-1)/p * n / B + (p-1) * alpha     (n: output bytes per device)
- all_to_all:      (p-1)/p * n / B + (p-1) * alpha
- slice:           0

Cluster presets (figures documented in docs/search.md):

>>> CLUSTERS["accelerator-8x"].devices_per_node
8
>>> cm = CostModel(CLUSTERS["accelerator-8x"])
>>> round(cm.collective_time("all_reduce", 2**20, 8, intra=True) * 1e6, 1)  # microseconds
88.4
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from pydantic import BaseModel, ConfigDict, Field

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.redistribution import Step, transpose_step

__all__ = ["Cluster", "CLUSTERS", "CostModel", "get_cluster"]


class Cluster(BaseModel):
    """Hardware figures the cost model uses (per device unless stated)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
    devices_per_node: int = Field(ge=1, description="devices sharing the fast intra-node link")
    peak_flops: float = Field(gt=0, description="sustained FLOP/s per device")
    memory_bandwidth: float = Field(gt=0, description="device memory bytes/s")
    memory_bytes: float = Field(gt=0, description="device memory capacity (the budget)")
    intra_bandwidth: float = Field(gt=0, description="bytes/s per device inside a node")
    intra_alpha: float = Field(ge=0, description="seconds of latency per ring step, intra")
    inter_bandwidth: float = Field(gt=0, description="bytes/s per device across nodes")
    inter_alpha: float = Field(ge=0, description="seconds of latency per ring step, inter")
    optimizer_state_factor: float = Field(
        default=2.0, ge=0, description="optimizer state bytes per parameter byte (Adam: 2)")


CLUSTERS: dict[str, Cluster] = {
    # An Ascend-910-class training node: 8 devices, ~256 TFLOP/s fp16 of which ~50 % is
    # sustained on large matmuls, 32 GB HBM at ~1.2 TB/s, ~100 GB/s per device inside the
    # node (HCCS), 100 Gb/s RoCE (12.5 GB/s) per device between nodes.
    "accelerator-8x": Cluster(
        name="accelerator-8x", devices_per_node=8, peak_flops=1.28e14,
        memory_bandwidth=1.2e12, memory_bytes=32e9, intra_bandwidth=100e9, intra_alpha=5e-6,
        inter_bandwidth=12.5e9, inter_alpha=20e-6),
    # This machine: 8 emulated CPU devices sharing 2 cores and their memory. Figures measured
    # by benchmarks/bench_calibrate.py (per device = machine total / 8).
    "cpu-emulated": Cluster(
        name="cpu-emulated", devices_per_node=4096, peak_flops=4e9, memory_bandwidth=2e9,
        memory_bytes=2.5e9, intra_bandwidth=1e9, intra_alpha=30e-6, inter_bandwidth=1e9,
        inter_alpha=30e-6),
}


def get_cluster(cluster: str | Cluster | None) -> Cluster:
    if cluster is None:
        return CLUSTERS["accelerator-8x"]
    if isinstance(cluster, Cluster):
        return cluster
    if not isinstance(cluster, str):
        raise AutoParallelTypeError("cluster", cluster, "a preset name or a Cluster")
    if cluster not in CLUSTERS:
        raise AutoParallelError("cluster", cluster, f"unknown preset; choose one of "
                                f"{sorted(CLUSTERS)} or pass autopar.Cluster(...)")
    return CLUSTERS[cluster]


@dataclass(frozen=True)
class CostModel:
    """Prices compute and collectives for a cluster; shared by all search modes."""

    cluster: Cluster
    _groups: dict = field(default_factory=dict, repr=False, compare=False)
    _steps: dict = field(default_factory=dict, repr=False, compare=False)
    _coef: dict = field(default_factory=dict, repr=False, compare=False)

    def compute_time(self, flops: float, nbytes: float) -> float:
        c = self.cluster
        return max(flops / c.peak_flops, nbytes / c.memory_bandwidth)

    def collective_time(self, kind: str, nbytes: float, p: int, *, intra: bool) -> float:
        if p <= 1 or kind == "slice":
            return 0.0
        c = self.cluster
        bw, alpha = (c.intra_bandwidth, c.intra_alpha) if intra else \
            (c.inter_bandwidth, c.inter_alpha)
        frac = (p - 1) / p
        if kind == "all_reduce":
            return 2 * frac * nbytes / bw + 2 * (p - 1) * alpha
        if kind in ("reduce_scatter", "all_gather", "all_to_all"):
            return frac * nbytes / bw + (p - 1) * alpha
        raise AutoParallelError("collective", kind, "unknown collective kind")

    def group(self, axes: Iterable[str], mesh: DeviceMesh) -> tuple[int, bool]:
        """(group size, whether the group is inside one node) of collectives over axes."""
        key = (tuple(axes), mesh)
        hit = self._groups.get(key)
        if hit is None:
            inner = mesh.inner_axes(self.cluster.devices_per_node)
            hit = (mesh.size_of(key[0]), all(a in inner for a in key[0]))
            self._groups[key] = hit
        return hit

    def step_time(self, step: Step, mesh: DeviceMesh) -> float:
        p, intra = self.group(step.axes, mesh)
        return self.collective_time(step.kind, step.nbytes, p, intra=intra)

    def steps_time(self, steps: tuple[Step, ...], mesh: DeviceMesh, *,
                   backward: bool = False) -> float:
        """Forward time of the steps, plus their transposes when ``backward`` (memoised)."""
        key = (steps, mesh, backward)
        hit = self._steps.get(key)
        if hit is not None:
            return hit
        total = 0.0
        for s in steps:
            total += self.step_time(s, mesh)
            if backward:
                t = transpose_step(s)
                if t is not None:
                    total += self.step_time(t, mesh)
        self._steps[key] = total
        return total

    def coefficients(self, steps: tuple[Step, ...], mesh: DeviceMesh, *,
                     backward: bool = False) -> tuple[float, float]:
        """(latency seconds, seconds per global byte) of shape-free steps (``fraction`` set):
        the steps' time for a tensor of B global bytes is ``a + b * B`` (memoised)."""
        key = (steps, mesh, backward)
        hit = self._coef.get(key)
        if hit is not None:
            return hit
        a = b = 0.0
        c = self.cluster
        for s in steps:
            # forward kind, and in backward its transpose: all_gather <-> reduce_scatter and
            # all_to_all cost the same, slice -> all_gather, all_reduce -> nothing
            kinds = [s.kind]
            if backward and s.kind != "all_reduce":
                kinds.append("all_gather" if s.kind == "slice" else s.kind)
            p, intra = self.group(s.axes, mesh)
            if p <= 1:
                continue
            bw, alpha = (c.intra_bandwidth, c.intra_alpha) if intra else \
                (c.inter_bandwidth, c.inter_alpha)
            for kind in kinds:
                if kind == "slice":
                    continue
                k = 2.0 if kind == "all_reduce" else 1.0
                b += k * (p - 1) / p * s.fraction / bw
                a += k * (p - 1) * alpha
        self._coef[key] = (a, b)
        return a, b

    def all_reduce_time(self, nbytes: float, axes: Iterable[str], mesh: DeviceMesh) -> float:
        p, intra = self.group(axes, mesh)
        return self.collective_time("all_reduce", nbytes, p, intra=intra)

    def parameter_memory(self, local_bytes: float, group: int, *,
                         sharded: bool = False) -> float:
        """Bytes per device a parameter costs in training: its stored copy, its gradient and
        its optimizer state (``optimizer_state_factor`` x the parameter).

        ``local_bytes``: the parameter's block under its layout; ``group``: the size of its
        data-parallel group (the devices it is replicated on). ``sharded`` (the parallel
        optimizer, :mod:`autopar.optimizer_shard`): the stored copy and the state are split
        ``group`` ways; the gradient is still whole until it is reduce-scattered. The
        communication does not change: a reduce-scatter plus an all-gather move the bytes
        of one all-reduce (the ring all-reduce is exactly those two phases).

        >>> cm = CostModel(CLUSTERS["accelerator-8x"])
        >>> cm.parameter_memory(800, 8), cm.parameter_memory(800, 8, sharded=True)
        (3200.0, 1100.0)
        """
        state = self.cluster.optimizer_state_factor
        if not sharded or group <= 1:
            return float(local_bytes * (2.0 + state))
        return float(local_bytes * (1.0 + (1.0 + state) / group))
