"""The auto-parallel configuration schema: every key of MindSpore's set_auto_parallel_context.

One pydantic model, :class:`AutoParallelConfig`, holds the keys with their defaults, ranges and
descriptions (seed 002). It is frozen and strict: ``True`` is not an int, ``8.0`` is not an int,
a list is not a tuple where MindSpore wants a tuple. Validation failures are translated into
autopar's typed errors by :func:`validate_config`, naming the key, the value and the rule.

>>> cfg = validate_config({"device_num": 8, "parallel_mode": "auto_parallel"})
>>> cfg.device_num, cfg.search_mode
(8, 'dynamic_programming')
"""

from __future__ import annotations

import difflib
import os
from typing import Annotated, Any, ClassVar, Iterable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from autopar.errors import (AutoParallelError, AutoParallelTypeError, ContextConflictError,
                            UnknownKeyError, found, safe_repr, type_name, validation_problems)
from autopar.limits import MAX_DEVICES
from autopar.strategies.recompute import RECOMPUTE
from autopar.strategies.modes import (DEFAULT_PARALLEL_MODE, DEFAULT_SEARCH_MODE, PARALLEL_MODES,
                                      SEARCH_MODES, SOLVERS)

__all__ = [
    "PARALLEL_MODES",
    "SEARCH_MODES",
    "AUTO_FUSION_THRESHOLD_MB",
    "AllReduceFusion",
    "GatherFusion",
    "CommFusion",
    "ParallelOptimizerConfig",
    "StrategyCkptConfig",
    "PipelineConfig",
    "PIPELINE_SCHEDULERS",
    "NO_EFFECT_REASONS",
    "AutoParallelConfig",
    "no_effect_messages",
    "validate_config",
    "raise_for_validation_error",
]

DATASET_STRATEGY_NAMES = ("data_parallel", "full_batch")
STRATEGY_FILE_KEYS = (("strategy_ckpt_load_file", "load_file"),
                      ("strategy_ckpt_save_file", "save_file"))
AUTO_FUSION_THRESHOLD_MB = 64
MAX_INDEX = 2**31 - 1
#: The largest size-mode fusion threshold (MB): 1 EiB, past any real gradient set.
MAX_FUSION_MB = 2**40

_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)


def _type_error(rule: str) -> PydanticCustomError:
    return PydanticCustomError("autopar_type", rule)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_choice(name: str, choices: tuple[str, ...]):
    def check(v: str) -> str:
        if v not in choices:
            raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}")
        return v

    return check


def _check_indices(v: Any, what: str) -> tuple[int, ...]:
    """Non-empty, strictly ascending, non-negative ints (a list or tuple)."""
    if not isinstance(v, (list, tuple)):
        raise _type_error(f"{what} must be a list of ints, {found(v)}")
    for i, item in enumerate(v):
        if not _is_int(item):
            raise _type_error(f"{what} must contain only ints, {found(item, f'[{i}]')}")
    if len(v) == 0:
        raise ValueError(f"{what} must not be empty")
    if any(i < 0 or i > MAX_INDEX for i in v):
        raise ValueError(f"{what} indices must be non-negative ints below 2**31")
    if any(b <= a for a, b in zip(v, v[1:])):
        raise ValueError(f"{what} indices must be strictly ascending")
    return tuple(v)


class _Fusion(BaseModel):
    """One fusion type: {"mode": ..., "config": ...}."""

    model_config = _STRICT
    MODES: ClassVar[tuple[str, ...]] = ("auto", "size")
    NAME: ClassVar[str] = "allgather"

    mode: str = Field(description="auto (64 MB threshold), size (threshold in MB, > 0)")
    config: Any = Field(default=None, description="threshold in MB for size; None for auto")

    @model_validator(mode="after")
    def _check(self) -> "_Fusion":
        if self.mode not in self.MODES:
            raise ValueError(f"mode must be one of {', '.join(repr(m) for m in self.MODES)} "
                             f"for {self.NAME} fusion")
        c = self.config
        if self.mode == "auto":
            if c is not None:
                raise ValueError("auto mode takes no config (its threshold is 64 MB); omit "
                                 "config or pass None, or use mode 'size'")
        elif self.mode == "size":
            if isinstance(c, bool) or not isinstance(c, (int, float)):
                raise _type_error("size mode needs config, a threshold in MB (int or float), "
                                  + found(c, "config"))
            if not 0 < c <= MAX_FUSION_MB:  # NaN, inf and ints past a double fail too
                raise ValueError(f"size mode needs a fusion threshold in (0, {MAX_FUSION_MB}] MB")
            if c * 2 ** 20 < 1:
                raise ValueError(f"size mode needs a threshold of at least one byte "
                                 f"(config >= 2**-20 MB = {2 ** -20:.3g} MB)")
        else:  # index
            object.__setattr__(self, "config", _check_indices(c, "index mode config"))
        return self

    def as_dict(self) -> dict[str, Any]:
        cfg = list(self.config) if isinstance(self.config, tuple) else self.config
        return {"mode": self.mode, "config": cfg}


class AllReduceFusion(_Fusion):
    MODES = ("auto", "size", "index")
    NAME = "allreduce"


class GatherFusion(_Fusion):
    MODES = ("auto", "size")
    NAME = "allgather/reducescatter"


class CommFusion(BaseModel):
    """comm_fusion: which collective types are fused and how. A missing type is not fused;
    ``openstate=False`` (MindSpore's switch) fuses none, whatever the types say."""

    model_config = _STRICT

    openstate: bool = True
    allreduce: AllReduceFusion | None = None
    allgather: GatherFusion | None = None
    reducescatter: GatherFusion | None = None

    def as_dict(self) -> dict[str, Any]:
        """The types that are set (and ``openstate`` when it is False), as given."""
        off = {} if self.openstate else {"openstate": False}
        return off | {k: getattr(self, k).as_dict() for k in _FUSION_TYPES
                      if getattr(self, k) is not None}

    def fused(self) -> dict[str, Any]:
        """The types that take effect: :meth:`as_dict` without ``openstate``, or nothing when
        it is False."""
        return {k: v for k, v in self.as_dict().items() if k != "openstate"} \
            if self.openstate else {}


_FUSION_TYPES = ("allreduce", "allgather", "reducescatter")


#: parallel_optimizer_config's optimizer_level (MindSpore 2.6) -> gradient_accumulation_shard
OPTIMIZER_LEVELS: dict[str, bool] = {"level1": False, "level2": True, "level3": False}


def shard_size_rule(v: int) -> str | None:
    """Why the int ``v`` is not a parallel-optimizer shard size (None when it is one), for
    the dict entry and the top-level key alike."""
    if v != -1 and not 1 < v <= MAX_DEVICES:
        return (f"optimizer_weight_shard_size must be -1 (the whole data-parallel group) or "
                f"an int in [2, {MAX_DEVICES}]")
    return None


class ParallelOptimizerConfig(BaseModel):
    model_config = _STRICT

    gradient_accumulation_shard: bool = Field(
        default=True, description="shard the accumulated gradients across data-parallel devices")
    parallel_optimizer_threshold: Annotated[int, Field(ge=0)] = Field(
        default=64, description="parameters smaller than this (KB) are not sharded")
    # MindSpore 2.5 (undocumented there; the same setting as the top-level key)
    optimizer_weight_shard_size: int = Field(
        default=-1, description="devices a sharded parameter is split over: -1 its whole "
        "data-parallel group, else a divisor of that group (> 1)")
    # MindSpore 2.6
    optimizer_level: str | None = Field(
        default=None, description="level1: shard the optimizer state and update; level2: "
        "also the accumulated gradients (sets gradient_accumulation_shard=True; level1 and "
        "level3 set it False); level3: also the parameters between uses")

    @field_validator("optimizer_weight_shard_size")
    @classmethod
    def _shard_size(cls, v: int) -> int:
        why = shard_size_rule(v)
        if why:
            raise ValueError(why)
        return v

    @field_validator("optimizer_level")
    @classmethod
    def _level(cls, v: str | None) -> str | None:
        return None if v is None else _check_choice("optimizer_level", OPTIMIZER_LEVELS)(v)


def _path(v: str) -> str:
    """A file path setting: refused with a NUL byte when set, not at the first save."""
    if "\0" in v:
        raise ValueError("a path cannot hold a NUL byte")
    return v


def fspath_setting(v: Any) -> Any:
    """A ``pathlib.Path`` (any ``os.PathLike`` of text) is taken as its string, as JAX
    users pass paths; MindSpore's str is kept as is and other types fail as not a str."""
    if isinstance(v, os.PathLike):
        try:
            path = os.fspath(v)
        except TypeError:  # (its __fspath__ returns no str or bytes: refused as not a str)
            return v
        return path if isinstance(path, str) else v
    return v


class StrategyCkptConfig(BaseModel):
    """strategy_ckpt_config: MindSpore 2.x's one dict for the strategy files. ``load_file`` /
    ``save_file`` are the same settings as strategy_ckpt_load_file / strategy_ckpt_save_file
    (one value, two names: the one set last wins)."""

    model_config = _STRICT

    load_file: str = Field(default="", description="load the strategy from this file")
    save_file: str = Field(default="", description="save the strategy to this file")
    only_trainable_params: bool = Field(
        default=True, description="only the trainable parameters' layouts are saved / loaded")

    @field_validator("load_file", "save_file", mode="before")
    @classmethod
    def _pathlike(cls, v: Any) -> Any:
        return fspath_setting(v)

    @field_validator("load_file", "save_file")
    @classmethod
    def _paths(cls, v: str) -> str:
        return _path(v)


#: MindSpore's pipeline_scheduler names -> autopar's schedule (autopar.pipeline.schedules);
#: MindSpore names missing here are refused with the supported ones listed.
PIPELINE_SCHEDULERS: dict[str, str] = {"1f1b": "1f1b", "gpipe": "gpipe"}
MINDSPORE_PIPELINE_SCHEDULERS: tuple[str, ...] = ("1f1b", "gpipe", "seqpipe", "seqvpp",
                                                  "seqsmartvpp", "zero_bubble_v")


class PipelineConfig(BaseModel):
    """pipeline_config: the pipeline schedule (MindSpore 2.3+)."""

    model_config = _STRICT

    pipeline_interleave: bool = Field(
        default=False, description="interleaved (virtual-stage) schedules")
    pipeline_scheduler: str = Field(default="1f1b", description="the schedule: "
                                    + " / ".join(PIPELINE_SCHEDULERS))

    @field_validator("pipeline_scheduler")
    @classmethod
    def _scheduler(cls, v: str) -> str:
        supported = ", ".join(repr(k) for k in PIPELINE_SCHEDULERS)
        if v in PIPELINE_SCHEDULERS:
            return v
        if v in MINDSPORE_PIPELINE_SCHEDULERS:
            raise ValueError(f"MindSpore's {v!r} schedule is not available in autopar; the "
                             f"supported schedules are {supported}")
        others = ", ".join(repr(k) for k in MINDSPORE_PIPELINE_SCHEDULERS
                           if k not in PIPELINE_SCHEDULERS)
        raise ValueError(f"pipeline_scheduler must be one of {supported} (MindSpore's "
                         f"{others} are not available in autopar)")


#: Why the keys autopar accepts for MindSpore compatibility change nothing on JAX. Setting one
#: to a non-default value warns AutoParallelWarning with this reason, once per call.
NO_EFFECT_REASONS: dict[str, str] = {
    "strategy_ckpt_config.only_trainable_params": "every parameter of an autopar graph is "
    "trainable (it is part of the params argument the gradient is taken of), so the strategy "
    "file holds the same parameter layouts either way",
    "pipeline_config.pipeline_interleave": "autopar has no interleaved (virtual-stage) "
    "schedules: each stage holds one contiguous part of the network and runs the chosen "
    "pipeline_scheduler without interleaving (same gradients, a larger bubble)",
    "force_fp32_communication": "autopar's collectives communicate in the tensor's own dtype; "
    "only gradient synchronisation is upcast, by gradient_fp32_sync (semi_auto_parallel / "
    "auto_parallel)",
    "pipeline_result_broadcast": "the pipelined training step already returns its loss on "
    "every stage (a psum over the stage axis), and autopar has no pipelined inference",
    "group_ckpt_save_file": "autopar's communication groups are the mesh axes, which the "
    "strategy file (strategy_ckpt_save_file) records with the plan; no separate group file "
    "is written",
    "dump_local_norm": "autopar writes no tensor dumps; take norms of the gradients "
    "step.grads(params, *batch) returns (e.g. optax.global_norm)",
    "dump_local_norm_path": "autopar writes no tensor dumps (see dump_local_norm)",
    "dump_device_local_norm": "autopar writes no tensor dumps; take norms of the gradients "
    "step.grads(params, *batch) returns",
    "pipeline_segments": "autopar has no interleaved (virtual-stage) schedules: each "
    "pipeline stage is one segment (see pipeline_config's pipeline_interleave)",
    "communi_parallel_mode": "XLA orders the collectives of all groups itself; there are no "
    "per-group communication streams to configure",
    "optimizer_weight_shard_aggregated_save": "autopar writes no weight checkpoints, and a "
    "parameter the parallel optimizer splits is one jax.Array whose value is the whole "
    "tensor (np.asarray or a checkpoint library saves it aggregated)",
    "parallel_optimizer_config.optimizer_level": "level3's gathering at each use is XLA's to "
    "schedule: autopar gathers the split parameters at the start of the step (level3 acts "
    "as level1 otherwise)",
}

#: communi_parallel_mode's values (MindSpore 2.5)
COMMUNI_PARALLEL_MODES: tuple[str, ...] = ("all_group_parallel", "same_server_group_parallel",
                                           "no_group_parallel")


def _warned(key: str, when: str = "True") -> str:
    return f"{when}: no effect (warns): {NO_EFFECT_REASONS[key]}"


def _meta(type_: str, rule: str, modes: str = "all", jax: str = "") -> dict[str, Any]:
    return {"type": type_, "rule": rule, "modes": modes, "jax": jax}


class AutoParallelConfig(BaseModel):
    """Every key of set_auto_parallel_context (MindSpore 2.5), with the seed's defaults.

    ``auto_parallel_search_mode`` (deprecated) and ``all_reduce_fusion_config`` are views:
    the first of ``search_mode``, the second of ``comm_fusion["allreduce"]`` in index mode.
    ``strategy_ckpt_config``'s files are kept equal to ``strategy_ckpt_load_file`` /
    ``strategy_ckpt_save_file`` (one setting, two names).
    """

    model_config = _STRICT

    device_num: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = Field(
        default=1, description="Number of devices.",
        json_schema_extra=_meta("int", f"[1, {MAX_DEVICES}]", jax="the mesh: device_num "
                                "devices split into prime-size axes (8 -> 2x2x2)"))
    global_rank: Annotated[int, Field(ge=0, le=MAX_DEVICES - 1)] = Field(
        default=0, description="Global rank id of this process.",
        json_schema_extra=_meta("int", f"[0, {MAX_DEVICES - 1}]; < device_num when compiled",
                                jax="the caller's rank for communication groups "
                                "(get_rank, get_rank_id, split strategies)"))
    gradients_mean: bool = Field(
        default=False, description="Divide all-reduced gradients by the number of devices.",
        json_schema_extra=_meta("bool", "-", "not stand_alone", jax="True: the gradient of "
                                "the global loss; False: times the data-parallel degree, as "
                                "MindSpore's sum of per-device gradients"))
    gradient_fp32_sync: bool = Field(
        default=True, description="All-reduce gradients in fp32.",
        json_schema_extra=_meta("bool", "-", "semi_auto_parallel, auto_parallel",
                                jax="bf16/fp16 gradients cast to f32 for their all-reduce / "
                                "reduce-scatter, then back"))
    loss_repeated_mean: bool = Field(
        default=True, description="Mean (not sum) over repeated calculation of the loss.",
        json_schema_extra=_meta("bool", "-", "semi_auto_parallel, auto_parallel",
                                jax="False: a loss computed on r devices counts r times "
                                "(gradient times r)"))
    parallel_mode: Annotated[str, Field()] = Field(
        default=DEFAULT_PARALLEL_MODE, description="How the network is parallelised.",
        json_schema_extra=_meta("str", " / ".join(PARALLEL_MODES), jax="who chooses the "
                                "strategies: nobody (one device), data parallel, the user, "
                                "or the search"))
    search_mode: str = Field(
        default=DEFAULT_SEARCH_MODE, description="Strategy search algorithm (alias: "
        "auto_parallel_search_mode, deprecated); 'exact' (autopar's integer-program referee) "
        "is autopar's addition.",
        json_schema_extra=_meta("str", " / ".join(SEARCH_MODES), "auto_parallel",
                                jax="the solver of autopar.search (same cost model for all)"))
    parameter_broadcast: bool = Field(
        default=False, description="Broadcast rank 0's parameters before training.",
        json_schema_extra=_meta("bool", "-", "not stand_alone", jax="step.prepare(params) "
                                "places every leaf with rank 0's values"))
    strategy_ckpt_load_file: str = Field(
        default="", description="Load the parallel strategy from this file instead of searching "
        "(same setting as strategy_ckpt_config['load_file']).",
        json_schema_extra=_meta("str", "path or ''", "semi_auto_parallel, auto_parallel",
                                jax="autopar.search loads this plan (checked) instead of "
                                "searching"))
    strategy_ckpt_save_file: str = Field(
        default="", description="Save the parallel strategy to this file (same setting as "
        "strategy_ckpt_config['save_file']).",
        json_schema_extra=_meta("str", "path or ''", "semi_auto_parallel, auto_parallel",
                                jax="autopar.search writes its plan here (atomic JSON)"))
    full_batch: bool = Field(
        default=False, description="Every device loads the whole batch (same as "
        "dataset_strategy='full_batch').",
        json_schema_extra=_meta("bool", "kept consistent with dataset_strategy",
                                "semi_auto_parallel, auto_parallel",
                                jax="batch inputs replicated"))
    dataset_strategy: Any = Field(
        default="data_parallel", description="How batch inputs are split: 'data_parallel', "
        "'full_batch', or one tuple of split counts per input, e.g. ((1, 8), (1, 8)).",
        json_schema_extra=_meta("str | tuple[tuple[int, ...], ...]",
                                "'data_parallel', 'full_batch', or tuple of tuples of ints >= 1",
                                "tuple form: semi_auto_parallel, auto_parallel",
                                jax="the batch inputs' layouts the search starts from"))
    enable_parallel_optimizer: bool = Field(
        default=False, description="Shard the optimizer update across data-parallel devices.",
        json_schema_extra=_meta("bool", "-", "not stand_alone", jax="large parameters and "
                                "optimizer state stored split: gradients reduce-scattered, "
                                "parameters all-gathered"))
    parallel_optimizer_config: ParallelOptimizerConfig = Field(
        default_factory=ParallelOptimizerConfig,
        description="Parallel optimizer details: gradient_accumulation_shard (bool, default True),"
        " parallel_optimizer_threshold (int >= 0 KB, default 64), optimizer_weight_shard_size "
        "(-1 or an int > 1, default -1), optimizer_level ('level1' | 'level2' | 'level3', "
        "MindSpore 2.6).",
        json_schema_extra=_meta("dict", "keys gradient_accumulation_shard, "
                                "parallel_optimizer_threshold, optimizer_weight_shard_size, "
                                "optimizer_level", "with enable_parallel_optimizer",
                                jax="the threshold chooses the parameters the parallel "
                                "optimizer splits; optimizer_weight_shard_size the devices "
                                "each is split over (its innermost data-parallel axes: "
                                "gradient reduce-scattered there and the shards all-reduced "
                                "across the groups; a size that does not divide the group "
                                "falls back to it, warned; the pipelined step refuses it); "
                                "optimizer_level sets "
                                "gradient_accumulation_shard (" + _warned(
                                    "parallel_optimizer_config.optimizer_level",
                                    "level3") + ")"))
    enable_alltoall: bool = Field(
        default=False, description="Allow AllToAll in redistribution (else AllGather + slice).",
        json_schema_extra=_meta("bool", "-", "semi_auto_parallel, auto_parallel",
                                jax="lax.all_to_all in redistributions, else all_gather + "
                                "slice"))
    pipeline_stages: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = Field(
        default=1, description="Number of pipeline stages.",
        json_schema_extra=_meta("int", ">= 1; divides device_num",
                                "> 1: semi_auto_parallel", jax="train_step returns the "
                                "pipelined step over a ('stage', ...) mesh"))
    grad_accumulation_step: Annotated[int, Field(ge=1, le=MAX_INDEX)] = Field(
        default=1, description="Micro-steps whose gradients are accumulated before one update.",
        json_schema_extra=_meta("int", ">= 1", "> 1: semi_auto_parallel, auto_parallel",
                                jax="a lax.scan accumulates g micro-batches' gradients, "
                                "synchronised once"))
    comm_fusion: CommFusion = Field(
        default_factory=CommFusion,
        description="Fusion of allreduce / allgather / reducescatter: {type: {'mode': auto | size"
        " | index, 'config': ...}}, and 'openstate' (bool, default True; False: no fusion of "
        "any type). Not set: no fusion (one collective per gradient).",
        json_schema_extra=_meta("dict", "auto: 64 MB; size: threshold > 0 MB; index: "
                                "allreduce only, ascending indices",
                                jax="gradient collectives grouped into buckets, one collective "
                                "per bucket"))
    # ---- MindSpore 2.3 - 2.5
    strategy_ckpt_config: StrategyCkptConfig = Field(
        default_factory=StrategyCkptConfig,
        description="The strategy files in one dict: load_file, save_file (the same settings as "
        "strategy_ckpt_load_file / strategy_ckpt_save_file), only_trainable_params.",
        json_schema_extra=_meta("dict", "keys load_file (str), save_file (str), "
                                "only_trainable_params (bool)",
                                "semi_auto_parallel, auto_parallel",
                                jax="load_file / save_file as the two keys above; " + _warned(
                                    "strategy_ckpt_config.only_trainable_params",
                                    "only_trainable_params=False")))
    pipeline_config: PipelineConfig = Field(
        default_factory=PipelineConfig,
        description="The pipeline schedule: pipeline_scheduler ('1f1b' | 'gpipe'), "
        "pipeline_interleave (bool).",
        json_schema_extra=_meta("dict", "pipeline_scheduler: " + " / ".join(PIPELINE_SCHEDULERS)
                                + " (MindSpore's others refused); pipeline_interleave: bool",
                                "with pipeline_stages > 1",
                                jax="the pipelined step's schedule (ResolvedContext."
                                "pipeline_schedule); " + _warned(
                                    "pipeline_config.pipeline_interleave",
                                    "pipeline_interleave=True")))
    auto_pipeline: bool = Field(
        default=False, description="Choose the number of stages automatically (1 .. "
        "pipeline_stages).",
        json_schema_extra=_meta("bool", "-", "auto_parallel",
                                jax="train_step searches the pipeline stages (up to "
                                "pipeline_stages where set, else any divisor of device_num), "
                                "the micro-batches (on one stage: grad_accumulation_step) and "
                                "the schedule with the layouts: autopar.search_configuration"))
    recompute: str = Field(
        default="none", description="Recomputation autopar adds where the loss has no "
        "jax.checkpoint of its own: 'none', 'selective' (each layer's attention core) or "
        "'full' (each layer); autopar's addition, MindFormers' recompute_config words.",
        json_schema_extra=_meta("str", " / ".join(RECOMPUTE), jax="the training step's "
                                "repeated layers run under jax.checkpoint "
                                "(autopar.strategies.recompute); left unset under "
                                "auto_pipeline, searched where a configuration does not fit "
                                "without it; a pipelined step recomputes every stage anyway"))
    force_fp32_communication: bool = Field(
        default=False, description="AllReduce / ReduceScatter communicate in fp32.",
        json_schema_extra=_meta("bool", "-", jax=_warned("force_fp32_communication")))
    pipeline_result_broadcast: bool = Field(
        default=False, description="Broadcast the last stage's result to every stage "
        "(pipelined inference).",
        json_schema_extra=_meta("bool", "-", "semi_auto_parallel, auto_parallel",
                                jax=_warned("pipeline_result_broadcast")))
    group_ckpt_save_file: str = Field(
        default="", description="Save the communication groups to this file.",
        json_schema_extra=_meta("str", "path or ''", "semi_auto_parallel, auto_parallel",
                                jax=_warned("group_ckpt_save_file", "a path")))
    dump_local_norm: bool = Field(
        default=False, description="Dump each parameter's local gradient norm.",
        json_schema_extra=_meta("bool", "-", "semi_auto_parallel, auto_parallel",
                                jax=_warned("dump_local_norm")))
    dump_local_norm_path: str = Field(
        default="", description="Directory of the local-norm dumps.",
        json_schema_extra=_meta("str", "path or ''", "semi_auto_parallel, auto_parallel",
                                jax=_warned("dump_local_norm_path", "a path")))
    dump_device_local_norm: bool = Field(
        default=False, description="Dump each device's local gradient norm.",
        json_schema_extra=_meta("bool", "-", "semi_auto_parallel, auto_parallel",
                                jax=_warned("dump_device_local_norm")))

    # ---- MindSpore 2.5, accepted by set_auto_parallel_context though not in its docs
    pipeline_segments: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = Field(
        default=1, description="Segments each pipeline stage is cut into (virtual stages of "
        "an interleaved schedule).",
        json_schema_extra=_meta("int", ">= 1", "with pipeline_stages > 1",
                                jax=_warned("pipeline_segments", "> 1")))
    communi_parallel_mode: str = Field(
        default="all_group_parallel", description="Which communication groups may run "
        "concurrently.",
        json_schema_extra=_meta("str", " / ".join(COMMUNI_PARALLEL_MODES),
                                jax=_warned("communi_parallel_mode", "not the default")))
    optimizer_weight_shard_aggregated_save: bool = Field(
        default=False, description="Save parameters split by the parallel optimizer whole in "
        "checkpoints.",
        json_schema_extra=_meta("bool", "-", "with enable_parallel_optimizer",
                                jax=_warned("optimizer_weight_shard_aggregated_save")))

    @field_validator("group_ckpt_save_file", mode="before")
    @classmethod
    def _pathlike(cls, v: Any) -> Any:
        return fspath_setting(v)  # (the strategy files': _strategy_files_one_setting)

    @field_validator("strategy_ckpt_load_file", "strategy_ckpt_save_file",
                     "group_ckpt_save_file")
    @classmethod
    def _paths(cls, v: str) -> str:
        return _path(v)

    @field_validator("parallel_mode")
    @classmethod
    def _parallel_mode(cls, v: str) -> str:
        return _check_choice("parallel_mode", PARALLEL_MODES)(v)

    @field_validator("communi_parallel_mode")
    @classmethod
    def _communi_parallel_mode(cls, v: str) -> str:
        return _check_choice("communi_parallel_mode", COMMUNI_PARALLEL_MODES)(v)

    @field_validator("recompute")
    @classmethod
    def _recompute(cls, v: str) -> str:
        return _check_choice("recompute", RECOMPUTE)(v)

    @field_validator("search_mode")
    @classmethod
    def _search_mode(cls, v: str) -> str:
        return _check_choice("search_mode", tuple(SOLVERS))(v)  # a solver registered later too

    @field_validator("dataset_strategy", mode="plain")
    @classmethod
    def _dataset_strategy(cls, v: Any) -> Any:
        if isinstance(v, str):
            return _check_choice("dataset_strategy", DATASET_STRATEGY_NAMES)(v)
        if not isinstance(v, tuple):
            raise _type_error("dataset_strategy must be a str or a tuple of tuples of ints")
        if len(v) == 0:
            raise ValueError("dataset_strategy tuple must not be empty")
        for i, entry in enumerate(v):
            if not isinstance(entry, tuple):
                raise _type_error("each dataset_strategy entry must be a tuple, "
                                  + found(entry, f"[{i}]"))
            for j, s in enumerate(entry):
                if not _is_int(s):
                    raise _type_error(f"split counts must be ints, {found(s, f'[{i}][{j}]')}")
                if s < 1 or s > MAX_DEVICES:
                    raise ValueError(f"split counts must be ints in [1, {MAX_DEVICES}], "
                                     f"found {s}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _strategy_files_one_setting(cls, data: Any) -> Any:
        """strategy_ckpt_config's files and the two flat keys are one setting: given one side
        only, the other follows (a contradiction is refused after validation). A
        ``pathlib.Path`` on either side is its text first (:func:`fspath_setting`)."""
        if not isinstance(data, dict):
            return data
        data = {**data, **{flat: fspath_setting(data[flat]) for flat, _ in STRATEGY_FILE_KEYS
                           if flat in data}}
        nested = data.get("strategy_ckpt_config")
        if isinstance(nested, dict):
            nested = data["strategy_ckpt_config"] = {
                k: fspath_setting(v) for k, v in nested.items()}
        if nested is None:  # (a value of the wrong type stays where it was given)
            data = {**data, "strategy_ckpt_config": {
                key: data[flat] for flat, key in STRATEGY_FILE_KEYS
                if isinstance(data.get(flat), str)}}
        elif isinstance(nested, dict):
            for flat, key in STRATEGY_FILE_KEYS:
                if flat not in data and isinstance(nested.get(key), str):
                    data = {**data, flat: nested[key]}
        return data

    @model_validator(mode="after")
    def _strategy_files_agree(self) -> "AutoParallelConfig":
        for flat, key in STRATEGY_FILE_KEYS:
            if getattr(self, flat) != getattr(self.strategy_ckpt_config, key):
                raise ValueError(f"{flat}={getattr(self, flat)!r} contradicts "
                                 f"strategy_ckpt_config[{key!r}]="
                                 f"{getattr(self.strategy_ckpt_config, key)!r}; they are one "
                                 "setting (set only one of them)")
        return self

    @model_validator(mode="after")
    def _full_batch_consistent(self) -> "AutoParallelConfig":
        if self.full_batch != (self.dataset_strategy == "full_batch"):
            raise ValueError(f"full_batch={self.full_batch} contradicts dataset_strategy="
                             f"{self.dataset_strategy!r}; full_batch=True is the same as "
                             "dataset_strategy='full_batch'")
        return self

    @property
    def all_reduce_fusion_config(self) -> list[int]:
        ar = self.comm_fusion.allreduce
        return list(ar.config) if ar is not None and ar.mode == "index" else []


#: Keys that are views of others (set and read through them): key -> what it views
VIEWS: dict[str, str] = {
    "auto_parallel_search_mode": "search_mode (deprecated alias)",
    "all_reduce_fusion_config": "comm_fusion['allreduce'] in index mode",
    "sharding_propagation": "search_mode == 'sharding_propagation' (deprecated)",
    "optimizer_weight_shard_size": "parallel_optimizer_config['optimizer_weight_shard_size']",
}
KEYS: tuple[str, ...] = tuple(AutoParallelConfig.model_fields) + tuple(VIEWS)
#: Keys get_auto_parallel_context reads but set_auto_parallel_context refuses (MindSpore's
#: get-only views of pipeline_config): key -> where it is set.
GET_ONLY: dict[str, str] = {"pipeline_interleave": "pipeline_config",
                            "pipeline_scheduler": "pipeline_config"}

_NESTED: dict[str, type[BaseModel]] = {
    "parallel_optimizer_config": ParallelOptimizerConfig,
    "comm_fusion": CommFusion,
    "comm_fusion.allreduce": AllReduceFusion,
    "comm_fusion.allgather": GatherFusion,
    "comm_fusion.reducescatter": GatherFusion,
    "strategy_ckpt_config": StrategyCkptConfig,
    "pipeline_config": PipelineConfig,
}


def unknown_key_error(key: str, valid: tuple[str, ...] | list[str], where: str) -> UnknownKeyError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"Did you mean {close[0]!r}? " if close else ""
    return UnknownKeyError(
        f"{key!r} is not a valid key of {where}. {hint}Valid keys: {', '.join(sorted(valid))}.")


def raise_for_validation_error(err: ValidationError, where: str) -> None:
    """Translate a pydantic ValidationError into autopar's typed error (first error first)."""
    problems = [(kind, loc or where, None if kind == "missing" else value, msg)
                for kind, loc, value, msg in validation_problems(err)]
    kind, key, value, msg = problems[0]
    more = f" ({len(problems) - 1} more problem(s): " + "; ".join(
        f"{k}: {m}" for _, k, _, m in problems[1:]) + ")" if len(problems) > 1 else ""
    if key == where:  # a rule between keys (a model validator): its message names them
        raise ContextConflictError(f"{msg.rstrip('.')}.{more}")
    if kind == "extra_forbidden":
        parent = ".".join(key.split(".")[:-1])
        valid = list(_NESTED[parent].model_fields) if parent in _NESTED else list(KEYS)
        raise unknown_key_error(key.split(".")[-1], valid, f"{where}.{parent}" if parent else where)
    if kind == "invalid_key":  # a dict key that is not a string: name it, not the whole dict
        parent = ".".join(key.split(".")[:-1])
        err = AutoParallelTypeError(f"{parent}: the key {safe_repr(value)} ({type_name(value)}) is "
                                    "invalid: keys must be strings.")
        err.key, err.value = parent, value
        raise err
    if kind.endswith("_type") or kind == "autopar_type":
        raise AutoParallelTypeError(key, value, f"{msg}{more}")
    if kind == "missing":  # (no value to show: the key is not there)
        err = AutoParallelError(f"{key} is missing: it is required{more}.")
        err.key = key
        raise err
    raise AutoParallelError(key, value, f"{msg}{more}")


def validate_config(data: dict[str, Any], where: str = "set_auto_parallel_context") \
        -> AutoParallelConfig:
    """Build a config from plain values; raise AutoParallelError / AutoParallelTypeError."""
    try:
        return AutoParallelConfig.model_validate(data)
    except ValidationError as err:
        raise_for_validation_error(err, where)
        raise  # unreachable: raise_for_validation_error always raises


def no_effect_messages(config: AutoParallelConfig, keys: Iterable[str]) -> list[str]:
    """For the keys set in one call, one message per key whose value autopar cannot honour on
    JAX (:data:`NO_EFFECT_REASONS`); a key set to its default value says nothing.

    >>> no_effect_messages(validate_config({"force_fp32_communication": True}),
    ...                    ["force_fp32_communication"])[0][:52]
    'force_fp32_communication=True has no effect in autop'
    """
    defaults = AutoParallelConfig()
    out = []
    for key in sorted(set(keys)):
        if key == "strategy_ckpt_config":
            reason = "strategy_ckpt_config.only_trainable_params"
            shown = f"strategy_ckpt_config['only_trainable_params']=" \
                    f"{config.strategy_ckpt_config.only_trainable_params!r}"
            active = not config.strategy_ckpt_config.only_trainable_params
        elif key == "pipeline_config":
            reason = "pipeline_config.pipeline_interleave"
            shown = f"pipeline_config['pipeline_interleave']=" \
                    f"{config.pipeline_config.pipeline_interleave!r}"
            active = config.pipeline_config.pipeline_interleave
        elif key == "parallel_optimizer_config":
            reason = "parallel_optimizer_config.optimizer_level"
            shown = "parallel_optimizer_config['optimizer_level']='level3'"
            active = config.parallel_optimizer_config.optimizer_level == "level3"
        elif key in NO_EFFECT_REASONS:
            reason, shown = key, f"{key}={getattr(config, key)!r}"
            active = getattr(config, key) != getattr(defaults, key)
        else:
            continue
        if active:
            out.append(f"{shown} has no effect in autopar: {NO_EFFECT_REASONS[reason]}.")
    return out


def reference_rows() -> list[dict[str, str]]:
    """One row per key for docs/context.md and the demo: key, type, default, range, modes,
    description and its effect in autopar (``jax``)."""
    rows = []
    defaults = AutoParallelConfig()
    for name, field in AutoParallelConfig.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        default = getattr(defaults, name)
        if isinstance(default, BaseModel):
            default = default.model_dump() if name != "comm_fusion" else default.as_dict()
        rows.append({"key": name, "type": str(extra["type"]), "default": repr(default),
                     "range": str(extra["rule"]), "modes": str(extra["modes"]),
                     "description": field.description or "", "jax": str(extra["jax"])})
    rows.append({"key": "auto_parallel_search_mode", "type": "str", "default": "(search_mode)",
                 "range": "as search_mode", "modes": "auto_parallel",
                 "description": "Deprecated alias of search_mode; warns DeprecationWarning.",
                 "jax": "as search_mode"})
    rows.append({"key": "all_reduce_fusion_config", "type": "list[int]", "default": "[]",
                 "range": "non-empty, strictly ascending, ints >= 0",
                 "modes": "data_parallel, hybrid_parallel, semi_auto_parallel, auto_parallel",
                 "description": "Allreduce fusion by gradient index; same as comm_fusion "
                 "{'allreduce': {'mode': 'index', 'config': [...]}}. Not set: fusion closed.",
                 "jax": "as comm_fusion['allreduce'] in index mode"})
    rows.append({"key": "sharding_propagation", "type": "bool", "default": "False",
                 "range": "-", "modes": "auto_parallel", "description": "Deprecated: True "
                 "is search_mode='sharding_propagation'; warns DeprecationWarning.",
                 "jax": "True sets search_mode='sharding_propagation' (False changes "
                 "nothing, as MindSpore ORs the two); reads back whether that is the mode"})
    rows.append({"key": "optimizer_weight_shard_size", "type": "int", "default": "-1",
                 "range": "> 1 applied; <= 1 warned and not applied (as MindSpore)",
                 "modes": "with enable_parallel_optimizer", "description": "The same "
                 "setting as parallel_optimizer_config['optimizer_weight_shard_size'].",
                 "jax": "as parallel_optimizer_config['optimizer_weight_shard_size']"})
    for key, where in GET_ONLY.items():
        field = PipelineConfig.model_fields[key]
        rows.append({"key": key, "type": f"{getattr(field.annotation, '__name__', '')} (get "
                     "only)", "default": repr(field.default), "range": f"set through {where}",
                     "modes": "-", "description": f"{where}[{key!r}], read alone (as "
                     "MindSpore's get_auto_parallel_context).", "jax": f"as {where}"})
    return rows
