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
from typing import Callable, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autopar.errors import (AutoParallelError, AutoParallelTypeError, from_validation_problem,
                            validation_problems)
from autopar.limits import MAX_DEVICES
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.redistribution import STEP_KINDS, Step, transpose_step

__all__ = ["BACKWARD_FACTOR", "COLLECTIVE_KINDS", "Calibration", "Cluster", "CLUSTERS",
           "CollectiveFit", "CostModel", "get_cluster"]


#: Collective kinds the model prices, each with its ring formula over a group of p devices:
#: p -> (latency steps, bandwidth factor), the time being ``steps * alpha + factor * n / B``.
#: Redistribution steps name the kind that prices them (:data:`STEP_KINDS
#: <autopar.strategies.redistribution.STEP_KINDS>` ``.collective``).
_RING: dict[str, Callable[[int], tuple[float, float]]] = {
    "all_reduce": lambda p: (2.0 * (p - 1), 2.0 * ((p - 1) / p)),
    "reduce_scatter": lambda p: (float(p - 1), (p - 1) / p),
    "all_gather": lambda p: (float(p - 1), (p - 1) / p),
    "all_to_all": lambda p: (float(p - 1), (p - 1) / p),
    "collective_permute": lambda p: (1.0, 1.0),
}
COLLECTIVE_KINDS = tuple(_RING)
#: Backward of an operator costs this many times its forward (two matmuls per matmul: the
#: gradient of each input); the one place the factor lives.
BACKWARD_FACTOR = 2.0


def _formula(kind: str, p: int) -> tuple[float, float]:
    """(latency steps, bytes factor) of the ring formula of ``kind`` over ``p`` devices."""
    ring = _RING.get(kind)
    if ring is None:
        raise AutoParallelError("collective", kind, f"unknown collective kind; one of "
                                f"{list(COLLECTIVE_KINDS)}")
    return ring(p)


#: Bounds that keep every price finite: rates are at least 1 per second (they divide), and
#: seconds and bytes at most these (they add up over a step).
_SECONDS = 1e3
_BYTES = 1e18


class _TypedConstruction(type(BaseModel)):  # type: ignore[misc]
    """``Cluster(...)`` (and its parts) written in a user's code: bad figures raise autopar's
    typed errors naming the field, the value and the rule (``Cluster.peak_flops='1' is
    invalid: ...``). Only a direct call goes through the metaclass: a cluster read from a
    file (nested in a calibration or strategy file) keeps pydantic's error, which its loader
    turns into a file error naming the file and the field."""

    def __call__(cls, *args: object, **kwargs: object) -> object:
        if args:
            raise AutoParallelTypeError(cls.__name__, args, "takes its figures by keyword "
                                        f"only: {cls.__name__}(name=..., peak_flops=...)")
        try:
            return super().__call__(**kwargs)
        except ValidationError as err:
            raise from_validation_problem(validation_problems(err), cls.__name__,
                                          cls.model_fields) from None


class CollectiveFit(BaseModel, metaclass=_TypedConstruction):
    """A measured collective: ``seconds = alpha + beta * n`` for one kind and group size.

    ``n`` is counted as the model counts it: per-device input bytes (all_reduce,
    reduce_scatter, all_to_all, collective_permute), per-device output bytes (all_gather).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    kind: Literal[COLLECTIVE_KINDS]
    group: int = Field(ge=2, le=MAX_DEVICES, description="devices in the group")
    intra: bool = Field(description="every device of the group in one node (process)")
    alpha: float = Field(ge=0, le=_SECONDS, description="seconds: the fixed cost of one "
                         "collective")
    beta: float = Field(ge=0, le=_SECONDS, description="seconds per byte (n as the model "
                        "counts it)")
    residual: float = Field(ge=0, description="largest |fit / measured - 1| over the samples")
    samples: int = Field(ge=2, description="message sizes measured")
    knee: float = Field(default=0.0, ge=0, le=_BYTES, description="bytes past which the "
                        "slope is beta_large (messages that no longer fit the caches); 0: one "
                        "slope")
    beta_large: float = Field(default=0.0, ge=0, le=_SECONDS, description="seconds per byte "
                              "past the knee")


class Calibration(BaseModel, metaclass=_TypedConstruction):
    """Where and how a calibrated cluster was measured (``autopar.calibrate``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    version: int = Field(description="calibration format version")
    platform: str = Field(description="jax backend platform: cpu, gpu, tpu")
    device_kind: str = Field(description="jax Device.device_kind")
    device_count: int = Field(ge=1, description="devices measured")
    process_count: int = Field(ge=1, description="processes (nodes) measured")
    jax_version: str
    host: str = Field(default="", max_length=256, description="the machine measured: "
                      "processor, CPUs, memory (autopar.calibration.host_identity; empty: "
                      "not recorded)")
    matmul_residual: float = Field(ge=0, description="largest |fit / measured - 1|, matmuls")
    memory_residual: float = Field(ge=0, description="largest |fit / measured - 1|, "
                                   "elementwise")
    shared_compute: float = Field(ge=1e-3, le=1e6, description="one device alone / every "
                                  "device at "
                                  "once, matmul throughput per device (1: independent "
                                  "devices; device count / cores: emulated devices)")
    seconds: float = Field(ge=0, description="wall seconds the calibration took")


class Cluster(BaseModel, metaclass=_TypedConstruction):
    """Hardware figures the cost model uses (per device unless stated)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    name: str = Field(pattern=r"^[^\x00-\x1f\x7f]{1,200}$", description="printable, "
                      "1-200 characters (it is shown in plans and messages)")
    devices_per_node: int = Field(ge=1, le=MAX_DEVICES, description="devices sharing the fast "
                                  "intra-node link")
    peak_flops: float = Field(ge=1, description="sustained FLOP/s per device")
    peak_flops_by_dtype: dict[str, float] = Field(
        default_factory=dict, description="sustained FLOP/s per device of an operator "
        "computing in a dtype (e.g. {'bfloat16': 1.56e14, 'float32': 1.9e13}); dtypes not "
        "listed run at peak_flops")
    memory_bandwidth: float = Field(ge=1, description="device memory bytes/s")
    memory_bytes: float = Field(ge=1, le=_BYTES, description="device memory capacity (the "
                                "budget)")
    intra_bandwidth: float = Field(ge=1, description="bytes/s per device inside a node")
    intra_alpha: float = Field(ge=0, le=_SECONDS, description="seconds of latency per ring "
                               "step, intra")
    inter_bandwidth: float = Field(ge=1, description="bytes/s per device across nodes")
    inter_alpha: float = Field(ge=0, le=_SECONDS, description="seconds of latency per ring "
                               "step, inter")
    optimizer_state_factor: float = Field(
        default=2.0, ge=0, le=1e6, description="optimizer state bytes per parameter byte "
        "(Adam: 2)")
    op_overhead: float = Field(default=0.0, ge=0, le=_SECONDS, description="seconds per "
                               "operator per device (dispatch, kernel launch)")
    step_overhead: float = Field(default=0.0, ge=0, le=_SECONDS, description="seconds per "
                                 "program call (dispatch to every device), once per step")
    update_passes: float = Field(default=0.0, ge=0, le=1e6, description="memory passes of the "
                                 "optimizer update over a parameter block (0: 3 + 2 x "
                                 "optimizer_state_factor, reads of the parameter, gradient "
                                 "and state plus writes of the parameter and state)")
    barrier: float = Field(default=0.0, ge=0, le=_SECONDS, description="seconds a "
                           "collective costs on top of its fit when it waits for computation "
                           "(devices that share cores catch up with each other at it; 0: "
                           "devices that run on their own)")
    barrier_per_byte: float = Field(default=0.0, ge=0, le=_SECONDS, description="seconds "
                                    "per byte (n as its fit counts it) a collective costs "
                                    "in a training step on top of its fit and the barrier: "
                                    "its glue (slices, a zero-filled gradient) and the "
                                    "devices drifting apart grow with the message (0: none)")
    overlap: float = Field(default=1.0, ge=0, le=1, description="fraction of a transfer "
                           "that can hide behind compute (0: the cores that compute move "
                           "the data, as emulated devices do)")
    collectives: tuple[CollectiveFit, ...] = Field(
        default=(), description="measured collectives; kinds and group sizes not listed "
        "use the ring formulas with the link figures above")
    calibration: Calibration | None = Field(default=None, description="how it was measured "
                                            "(None: a hand-written preset)")


CLUSTERS: dict[str, Cluster] = {
    # An Ascend-910-class training node: 8 devices, ~256 TFLOP/s fp16 of which ~50 % is
    # sustained on large matmuls, 32 GB HBM at ~1.2 TB/s, ~100 GB/s per device inside the
    # node (HCCS), 100 Gb/s RoCE (12.5 GB/s) per device between nodes.
    "accelerator-8x": Cluster(
        name="accelerator-8x", devices_per_node=8, peak_flops=1.28e14,
        memory_bandwidth=1.2e12, memory_bytes=32e9, intra_bandwidth=100e9, intra_alpha=5e-6,
        inter_bandwidth=12.5e9, inter_alpha=20e-6),
    # Emulated CPU devices sharing a few cores and their memory (jax_num_cpu_devices): the
    # preset for CPU devices when no calibration is cached. Figures per device (machine
    # total / 8) rounded from `autopar calibrate` on a 2-core machine; nothing overlaps. (No
    # barrier yet: calibrations measure 0.1-0.15 ms; the preset's plans are left as they were.)
    "cpu-emulated": Cluster(
        name="cpu-emulated", devices_per_node=MAX_DEVICES, peak_flops=4e9, memory_bandwidth=2e9,
        memory_bytes=2.5e9, intra_bandwidth=1e9, intra_alpha=30e-6, inter_bandwidth=1e9,
        inter_alpha=30e-6, overlap=0.0),
    # NVIDIA DGX nodes (8 GPUs, NVLink / NVSwitch inside, one InfiniBand NIC per GPU). Each
    # figure is the datasheet's times the fraction large kernels sustain (docs/design/0020):
    # matmuls 0.85 of A100's dense tensor peak and 0.70 of H100's (cuBLAS on large bf16
    # GEMMs), HBM 0.85, NVLink and InfiniBand at NCCL's measured bus bandwidth. fp32 matmuls
    # run as TF32 (XLA's default on these GPUs); memory: 80 GB of 85.9 left to XLA (set
    # XLA_PYTHON_CLIENT_MEM_FRACTION near 0.93; JAX's default 0.75 leaves 64 GB). Checked on
    # an H200 (`python -m benchmarks accelerator`, docs/scale.md): a one-device bfloat16
    # decoder step priced by dgx-h100-80gb within 3 % of its measured time; sustained bf16
    # matmuls measured at 0.72 of the datasheet's dense peak.
    "dgx-a100-80gb": Cluster(
        name="dgx-a100-80gb", devices_per_node=8, peak_flops=0.85 * 156e12,
        peak_flops_by_dtype={"bfloat16": 0.85 * 312e12, "float16": 0.85 * 312e12},
        memory_bandwidth=0.85 * 2.039e12, memory_bytes=80e9, intra_bandwidth=235e9,
        intra_alpha=2e-6, inter_bandwidth=22e9, inter_alpha=5e-6),
    "dgx-h100-80gb": Cluster(
        name="dgx-h100-80gb", devices_per_node=8, peak_flops=0.70 * 494.7e12,
        peak_flops_by_dtype={"bfloat16": 0.70 * 989.4e12, "float16": 0.70 * 989.4e12},
        memory_bandwidth=0.85 * 3.35e12, memory_bytes=80e9, intra_bandwidth=360e9,
        intra_alpha=2e-6, inter_bandwidth=45e9, inter_alpha=5e-6),
}


def get_cluster(cluster: str | Cluster) -> Cluster:
    """A preset by name, or the Cluster itself. Which cluster to use when none is named is
    the entry points' decision (:func:`autopar.clusters.resolve_cluster`), not the model's."""
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
    _lin: dict = field(default_factory=dict, repr=False, compare=False)
    _step_terms: dict = field(default_factory=dict, repr=False, compare=False)

    def compute_time(self, flops: float, nbytes: float, *, launch: bool = True,
                     dtype: str | None = None) -> float:
        """Seconds of one operator's forward on one device: its launch (unless fused into
        another's) + roofline, its FLOPs at the peak of the dtype it computes in
        (``peak_flops_by_dtype``, else ``peak_flops``).

        >>> a100 = CLUSTERS["accelerator-8x"].model_copy(
        ...     update={"peak_flops_by_dtype": {"bfloat16": 2.56e14}})
        >>> cm = CostModel(a100)
        >>> cm.compute_time(2.56e14, 0, dtype="bfloat16"), cm.compute_time(2.56e14, 0)
        (1.0, 2.0)
        """
        c = self.cluster
        peak = c.peak_flops_by_dtype.get(dtype, c.peak_flops) if dtype else c.peak_flops
        return (c.op_overhead if launch else 0.0) + max(flops / peak,
                                                         nbytes / c.memory_bandwidth)

    @property
    def overlaps_communication(self) -> bool:
        """Whether the simulators run gradient communication beside the computation on this
        cluster (a stream of its own, as HCCL's ``hcom_parallel``) or after it: the nearer of
        the two to the cluster's ``overlap``, the measured fraction of a transfer that hides
        behind compute (at least half: beside). Emulated devices measure 0 (the cores that
        compute move the data): their communication waits for the computation.

        >>> CostModel(CLUSTERS["accelerator-8x"]).overlaps_communication
        True
        >>> CostModel(CLUSTERS["cpu-emulated"]).overlaps_communication
        False
        """
        return self.cluster.overlap >= 0.5

    def alpha_beta(self, kind: str, p: int, intra: bool) -> tuple[float, float, float, float]:
        """(seconds, seconds per byte, knee bytes, extra seconds per byte past the knee) of
        one ``kind`` collective over ``p`` devices: its time for ``n`` bytes (counted as
        :class:`CollectiveFit` says) is ``a + b * n + extra * max(0, n - knee)``.

        The measured fit of (kind, p, intra) when the cluster has one; else the ring formula
        with the link figures (a kind measured at other group sizes takes its per-step
        latency and bandwidth from the nearest measured size). Plus the cluster's
        ``barrier`` and ``barrier_per_byte``: the fits are measured on chains of collectives,
        where every device arrives at once; in a training step a collective also waits for
        the computation before it, and carries its glue."""
        key = (kind, p, intra)
        hit = self._coef.get(key)
        if hit is not None:
            return hit
        steps, factor = _formula(kind, p)
        c = self.cluster
        fits = [f for f in c.collectives if f.kind == kind and f.intra == intra]
        exact = [f for f in fits if f.group == p]
        if exact or fits:
            f = exact[0] if exact else min(fits, key=lambda f: (abs(f.group - p), f.group))
            s0, f0 = _formula(kind, f.group)
            ks, kf = steps / s0, factor / f0
            extra = (f.beta_large - f.beta) * kf if f.knee > 0 else 0.0
            hit = (f.alpha * ks + c.barrier, f.beta * kf + c.barrier_per_byte, f.knee, extra)
        else:
            bw, alpha = (c.intra_bandwidth, c.intra_alpha) if intra else \
                (c.inter_bandwidth, c.inter_alpha)
            hit = (steps * alpha + c.barrier, factor / bw + c.barrier_per_byte, 0.0, 0.0)
        self._coef[key] = hit
        return hit

    def collective_time(self, kind: str, nbytes: float, p: int, *, intra: bool) -> float:
        """Seconds of one ``kind`` collective (:data:`COLLECTIVE_KINDS`) of ``nbytes`` over
        ``p`` devices."""
        if p <= 1:
            return 0.0
        a, b, knee, extra = self.alpha_beta(kind, p, intra)
        return a + b * nbytes + (extra * max(0.0, nbytes - knee) if extra else 0.0)

    def intra_node(self, span: int) -> bool:
        """Whether a group of devices spread over ``span`` consecutive device numbers talks
        over the intra-node link (else the inter-node one): the one rule of which link a
        group uses, a node holding ``devices_per_node`` consecutive devices. A group over
        mesh axes spans :meth:`DeviceMesh.span <autopar.strategies.layout.DeviceMesh.span>`
        devices (:meth:`group`); a stage's data-parallel group of d devices spans d.

        >>> cm = CostModel(CLUSTERS["accelerator-8x"])
        >>> cm.intra_node(8), cm.intra_node(16)
        (True, False)
        """
        return span <= self.cluster.devices_per_node

    def group(self, axes: Iterable[str], mesh: DeviceMesh) -> tuple[int, bool]:
        """(group size, whether the group is inside one node) of collectives over axes."""
        key = (tuple(axes), mesh)
        hit = self._groups.get(key)
        if hit is None:
            hit = (mesh.size_of(key[0]), self.intra_node(mesh.span(key[0])))
            self._groups[key] = hit
        return hit

    def step_time(self, step: Step, mesh: DeviceMesh) -> float:
        """Forward seconds of one redistribution step (0 for a local one)."""
        kind = STEP_KINDS[step.kind].collective
        if kind is None:
            return 0.0
        p, intra = self.group(step.axes, mesh)
        return self.collective_time(kind, step.nbytes, p, intra=intra)

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
                     backward: bool = False
                     ) -> tuple[float, float, tuple[tuple[float, float, float], ...]]:
        """(latency seconds, seconds per global byte, knee terms) of shape-free steps
        (``fraction`` set): the steps' time for a tensor of B global bytes is
        ``a + b * B + sum(extra * max(0, fraction * B - knee))`` over the terms (none when
        no collective is measured past a knee; see :meth:`steps_seconds`) (memoised)."""
        key = (steps, mesh, backward)
        hit = self._lin.get(key)
        if hit is not None:
            return hit
        a = b = 0.0
        terms = []
        per_step = self._step_terms.get((mesh, backward))
        if per_step is None:
            per_step = self._step_terms[(mesh, backward)] = {}
        for s in steps:
            parts = per_step.get((s.kind, s.axes))
            if parts is None:
                parts = per_step[(s.kind, s.axes)] = self._step_parts(s, mesh, backward)
            for ka, kb, knee, extra in parts:
                a += ka
                b += kb * s.fraction
                if extra:
                    terms.append((s.fraction, knee, extra))
        hit = (a, b, tuple(terms))
        self._lin[key] = hit
        return hit

    def _step_parts(self, s: Step, mesh: DeviceMesh, backward: bool
                    ) -> tuple[tuple[float, float, float, float], ...]:
        """The collectives one step costs, as :meth:`alpha_beta` terms: the forward one, and
        in backward its transpose (which moves the same n: all_gather's output is
        reduce_scatter's input); none over a group of one device or for a local step. They
        depend on the step's kind and axes only, so :meth:`coefficients` keeps them."""
        p, intra = self.group(s.axes, mesh)
        if p <= 1:
            return ()
        parts = []
        for t in (s, transpose_step(s) if backward else None):
            kind = STEP_KINDS[t.kind].collective if t is not None else None
            if kind is not None:
                parts.append(self.alpha_beta(kind, p, intra))
        return tuple(parts)

    @staticmethod
    def steps_seconds(coef: tuple[float, float, tuple], nbytes: float) -> float:
        """The time of :meth:`coefficients` for a tensor of ``nbytes`` global bytes."""
        a, b, terms = coef
        t = a + b * nbytes
        for frac, knee, extra in terms:
            t += extra * max(0.0, frac * nbytes - knee)
        return t

    def all_reduce_time(self, nbytes: float, axes: Iterable[str], mesh: DeviceMesh) -> float:
        p, intra = self.group(axes, mesh)
        return self.collective_time("all_reduce", nbytes, p, intra=intra)

    def gradient_sync_time(self, nbytes: float, axes: Iterable[str], mesh: DeviceMesh) -> float:
        """Seconds of one parameter's gradient all-reduce in a training step: its fit, without
        the ``barrier`` and ``barrier_per_byte``. A step's gradient all-reduces do not depend
        on each other and XLA merges them into one collective (each array in it still costs
        its latency, measured on CPU), so the devices catch up once per step, not once per
        parameter, and no glue surrounds it."""
        p, intra = self.group(axes, mesh)
        if p <= 1:
            return 0.0
        c = self.cluster
        return self.collective_time("all_reduce", nbytes, p, intra=intra) - c.barrier - \
            c.barrier_per_byte * nbytes

    def _state(self, state: float | None) -> float:
        """Optimizer state bytes per parameter byte: ``state`` (derived from the optimizer,
        :func:`~autopar.strategies.precision.optimizer_state`), else the cluster's
        ``optimizer_state_factor``."""
        return self.cluster.optimizer_state_factor if state is None else state

    def update_time(self, local_bytes: float, state: float | None = None) -> float:
        """Seconds of the optimizer update of one parameter block on one device: it reads
        the parameter, its gradient and its state and writes the parameter and the state
        (``3 + 2 x state`` passes over the block, ``state``: :meth:`_state`; Adam: 7)."""
        c = self.cluster
        passes = c.update_passes or 3.0 + 2.0 * self._state(state)
        return c.op_overhead + passes * local_bytes / c.memory_bandwidth

    def parameter_memory(self, local_bytes: float, group: int, *, sharded: bool = False,
                         state: float | None = None) -> float:
        """Bytes per device a parameter costs in training: its stored copy, its gradient and
        its optimizer state (``state`` x the parameter, :meth:`_state`).

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
        state = self._state(state)
        if not sharded or group <= 1:
            return float(local_bytes * (2.0 + state))
        return float(local_bytes * (1.0 + (1.0 + state) / group))

    def parameter_parts(self, local_bytes: float, group: int, *, sharded: bool = False,
                        state: float | None = None) -> tuple[float, float, float]:
        """:meth:`parameter_memory` in its three parts, (stored copy, optimizer state,
        gradient): what a step holds throughout, and the gradient it makes in backward
        (:mod:`autopar.strategies.memory` orders them).

        >>> cm = CostModel(CLUSTERS["accelerator-8x"])
        >>> cm.parameter_parts(800, 8), cm.parameter_parts(800, 8, sharded=True)
        ((800.0, 1600.0, 800.0), (100.0, 200.0, 800.0))
        """
        state = self._state(state)
        ways = group if sharded and group > 1 else 1
        return (float(local_bytes / ways), float(local_bytes * state / ways),
                float(local_bytes))
