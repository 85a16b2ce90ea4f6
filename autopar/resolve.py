"""Resolve the auto-parallel context for one compilation: mode restrictions, derived settings.

Each key is valid on its own when it is set; some combinations are not (seed 002's mode
restrictions, e.g. pipeline_stages > 1 under data_parallel). They are checked here,
when a program is compiled under the context, never silently dropped: an *error* restriction
raises :class:`~autopar.errors.ContextConflictError` listing every violation, a *warning*
restriction (a setting that is valid but has no effect in this mode) warns
:class:`~autopar.errors.AutoParallelWarning`. Warnings fire only for keys the user set.

>>> import autopar
>>> with autopar.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
...                                    pipeline_stages=2):
...     autopar.resolve_context()
Traceback (most recent call last):
...
autopar.errors.ContextConflictError: 1 conflicting setting(s): [pipeline_stages] ...
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Literal

from autopar.config import (AUTO_FUSION_THRESHOLD_MB, PIPELINE_SCHEDULERS, AutoParallelConfig,
                            reference_rows)
from autopar.context import current_config, explicit_keys, public_dict
from autopar.errors import AutoParallelWarning, ContextConflictError
from autopar.strategies.modes import PIPELINE_MODES
from autopar.text import table as text_table

__all__ = ["Restriction", "RESTRICTIONS", "FusionSetting", "ResolvedContext", "fusion_setting",
           "pipeline_schedule", "read_context", "resolve_context"]

SEMI_AUTO = ("semi_auto_parallel", "auto_parallel")
MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Restriction:
    """A rule between keys: ``violated(config, explicit)`` says whether it is broken."""

    key: str
    severity: Literal["error", "warning"]
    rule: str
    violated: Callable[[AutoParallelConfig, frozenset[str]], bool]
    fix: str


def _mode(c: AutoParallelConfig) -> str:
    return c.parallel_mode


def _ds_split_bad(c: AutoParallelConfig) -> bool:
    if not isinstance(c.dataset_strategy, tuple):
        return False
    return any(c.device_num % math.prod(s) != 0 for s in c.dataset_strategy)


RESTRICTIONS: tuple[Restriction, ...] = (
    Restriction("global_rank", "error", "global_rank must be < device_num",
                lambda c, e: c.global_rank >= c.device_num,
                "set global_rank in [0, device_num) or raise device_num"),
    Restriction("pipeline_stages", "error",
                "pipeline_stages > 1 needs parallel_mode 'semi_auto_parallel' (as the seed) or "
                "'auto_parallel' (autopar searches the stage boundaries, then each stage)",
                lambda c, e: c.pipeline_stages > 1 and _mode(c) not in PIPELINE_MODES,
                "set parallel_mode='semi_auto_parallel' or 'auto_parallel', or pipeline_stages=1"),
    Restriction("pipeline_stages", "error", "device_num must be divisible by pipeline_stages",
                lambda c, e: c.device_num % c.pipeline_stages != 0,
                "choose pipeline_stages dividing device_num"),
    Restriction("auto_pipeline", "error",
                "auto_pipeline needs parallel_mode 'auto_parallel' (as MindSpore): the stages' "
                "layouts are searched with them",
                lambda c, e: c.auto_pipeline and _mode(c) != "auto_parallel",
                "set parallel_mode='auto_parallel', or auto_pipeline=False"),
    Restriction("grad_accumulation_step", "error",
                "grad_accumulation_step > 1 needs parallel_mode semi_auto_parallel or "
                "auto_parallel", lambda c, e: c.grad_accumulation_step > 1 and _mode(c) not in
                SEMI_AUTO, "set parallel_mode to semi_auto_parallel/auto_parallel or "
                "grad_accumulation_step=1"),
    Restriction("dataset_strategy", "error",
                "a tuple dataset_strategy needs parallel_mode semi_auto_parallel or "
                "auto_parallel", lambda c, e: isinstance(c.dataset_strategy, tuple)
                and _mode(c) not in SEMI_AUTO,
                "use dataset_strategy='data_parallel'/'full_batch' or change parallel_mode"),
    Restriction("dataset_strategy", "error",
                "the product of each input's split counts must divide device_num",
                lambda c, e: _ds_split_bad(c), "choose split counts whose product divides "
                "device_num"),
    Restriction("gradients_mean", "warning",
                "gradients_mean has no effect in stand_alone (no gradient all-reduce)",
                lambda c, e: c.gradients_mean and _mode(c) == "stand_alone",
                "remove gradients_mean or choose a parallel mode"),
    Restriction("gradient_fp32_sync", "warning",
                "gradient_fp32_sync is not supported in stand_alone, data_parallel and "
                "hybrid_parallel: gradients are all-reduced in their own dtype there",
                lambda c, e: "gradient_fp32_sync" in e and _mode(c) in
                ("stand_alone", "data_parallel", "hybrid_parallel"),
                "use semi_auto_parallel/auto_parallel or do not set gradient_fp32_sync"),
    Restriction("loss_repeated_mean", "warning",
                "loss_repeated_mean only matters in semi_auto_parallel and auto_parallel",
                lambda c, e: "loss_repeated_mean" in e and _mode(c) not in SEMI_AUTO,
                "do not set loss_repeated_mean in this mode"),
    Restriction("search_mode", "warning", "search_mode is only used by auto_parallel",
                lambda c, e: "search_mode" in e and _mode(c) != "auto_parallel",
                "set parallel_mode='auto_parallel' or do not set search_mode"),
    Restriction("full_batch", "warning",
                "full_batch only takes effect in semi_auto_parallel and auto_parallel",
                lambda c, e: c.full_batch and _mode(c) not in SEMI_AUTO,
                "use semi_auto_parallel/auto_parallel or dataset_strategy='data_parallel'"),
    Restriction("parameter_broadcast", "warning",
                "parameter_broadcast has no effect in stand_alone (one device)",
                lambda c, e: c.parameter_broadcast and _mode(c) == "stand_alone",
                "choose a parallel mode or do not set parameter_broadcast"),
    Restriction("enable_parallel_optimizer", "warning",
                "enable_parallel_optimizer has no effect in stand_alone (nothing to shard over)",
                lambda c, e: c.enable_parallel_optimizer and _mode(c) == "stand_alone",
                "choose a parallel mode"),
    Restriction("parallel_optimizer_config", "warning",
                "parallel_optimizer_config only takes effect with enable_parallel_optimizer=True "
                "(or under auto_pipeline=True with it unset: the search may turn it on)",
                lambda c, e: "parallel_optimizer_config" in e and not c.enable_parallel_optimizer
                and not (c.auto_pipeline and "enable_parallel_optimizer" not in e),
                "set enable_parallel_optimizer=True"),
    Restriction("comm_fusion", "warning",
                "allgather / reducescatter fusion applies to the parallel optimizer's "
                "collectives, which exist only with enable_parallel_optimizer=True",
                lambda c, e: (c.comm_fusion.allgather is not None or c.comm_fusion.reducescatter
                              is not None) and not c.enable_parallel_optimizer,
                "set enable_parallel_optimizer=True or drop those comm_fusion entries"),
    Restriction("comm_fusion", "warning",
                "comm_fusion['openstate'] is False: no collective is fused, the fusion types "
                "set (or all_reduce_fusion_config) have no effect",
                lambda c, e: not c.comm_fusion.openstate and bool(c.comm_fusion.as_dict().keys()
                                                                  - {"openstate"}),
                "set comm_fusion={'openstate': True} to use them, or drop them"),
    Restriction("comm_fusion", "warning",
                "allreduce fusion has no effect in stand_alone (no gradient all-reduce)",
                lambda c, e: c.comm_fusion.allreduce is not None and _mode(c) == "stand_alone",
                "choose a parallel mode or drop comm_fusion['allreduce']"),
    Restriction("enable_alltoall", "warning",
                "enable_alltoall only matters where autopar inserts redistributions "
                "(hybrid_parallel, semi_auto_parallel, auto_parallel)",
                lambda c, e: "enable_alltoall" in e and _mode(c) in ("stand_alone",
                                                                     "data_parallel"),
                "do not set enable_alltoall in this mode"),
    Restriction("pipeline_config", "warning",
                "pipeline_config only matters with pipeline_stages > 1 (a pipelined step)",
                lambda c, e: "pipeline_config" in e and c.pipeline_stages == 1
                and not c.auto_pipeline,
                "set pipeline_stages > 1 or do not set pipeline_config"),
    *(Restriction(key, "warning",
                  "strategy files (this key or strategy_ckpt_config) are used only in "
                  "semi_auto_parallel and auto_parallel",
                  lambda c, e, key=key: bool(getattr(c, key)) and _mode(c) not in SEMI_AUTO,
                  "use semi_auto_parallel/auto_parallel")
      for key in ("strategy_ckpt_load_file", "strategy_ckpt_save_file")),
    Restriction("device_num", "warning",
                "stand_alone runs on one device; device_num > 1 is not used",
                lambda c, e: c.device_num > 1 and _mode(c) == "stand_alone",
                "choose a parallel mode or set device_num=1"),
)


@dataclass(frozen=True, slots=True)
class FusionSetting:
    """How one collective type is fused: none, by byte threshold, or by gradient index."""

    kind: Literal["allreduce", "allgather", "reducescatter"]
    mode: Literal["none", "off", "auto", "size", "index"]  # off: comm_fusion openstate=False
    threshold_bytes: int | None = None
    indices: tuple[int, ...] | None = None

    def __str__(self) -> str:
        if self.mode == "none":
            return "off (one collective per tensor)"
        if self.mode == "off":
            return "off by comm_fusion['openstate']=False (one collective per tensor)"
        if self.mode == "index":
            return f"index {list(self.indices or ())}"
        return f"{self.mode}, threshold {(self.threshold_bytes or 0) / MB:g} MB"


def pipeline_schedule(c: AutoParallelConfig) -> str:
    """autopar's pipeline schedule (autopar.pipeline.schedules) for pipeline_config's
    pipeline_scheduler: ``'1f1b'`` (the default, as MindSpore) or ``'gpipe'``."""
    return PIPELINE_SCHEDULERS[c.pipeline_config.pipeline_scheduler]


def fusion_setting(c: AutoParallelConfig,
                   kind: Literal["allreduce", "allgather", "reducescatter"]) -> FusionSetting:
    """How comm_fusion fuses one collective type under a configuration (no checks)."""
    spec = getattr(c.comm_fusion, kind)
    if not c.comm_fusion.openstate:
        return FusionSetting(kind, "off")
    if spec is None:
        return FusionSetting(kind, "none")
    if spec.mode == "index":
        return FusionSetting(kind, "index", indices=tuple(spec.config))
    mb = AUTO_FUSION_THRESHOLD_MB if spec.mode == "auto" else spec.config
    return FusionSetting(kind, spec.mode, threshold_bytes=int(mb * MB))


@dataclass(frozen=True, slots=True)
class ResolvedContext:
    """A checked configuration plus what is derived from it, for one compilation."""

    config: AutoParallelConfig
    explicit: frozenset[str]
    warnings: tuple[str, ...]
    allreduce_fusion: FusionSetting
    allgather_fusion: FusionSetting
    reducescatter_fusion: FusionSetting

    @property
    def devices_per_stage(self) -> int:
        return self.config.device_num // self.config.pipeline_stages

    @property
    def pipeline_schedule(self) -> str:
        """The schedule of a pipelined step: ``'1f1b'`` or ``'gpipe'`` (pipeline_config's
        pipeline_scheduler; autopar.pipeline.schedules.schedule takes this name)."""
        return pipeline_schedule(self.config)

    def table(self) -> str:
        """A readable table of every key; keys the user set are marked, defaults shown."""
        values = public_dict(self.config)
        defaults = {r["key"]: r["default"] for r in reference_rows()}
        rows = [("key", "value", "set by user (default)")]
        for key in sorted(values):
            shown = repr(values[key])
            mark = f"yes ({defaults.get(key, '')})" if key in self.explicit else ""
            rows.append((key, shown, mark))
        for f in (self.allreduce_fusion, self.allgather_fusion, self.reducescatter_fusion):
            rows.append((f"-> {f.kind} fusion", str(f), "resolved"))
        rows.append(("-> pipeline schedule", self.pipeline_schedule, "resolved"))
        return text_table(rows, align="lll")


def check_restrictions(config: AutoParallelConfig, explicit: frozenset[str]) \
        -> tuple[list[str], list[str]]:
    """(errors, warnings) messages for every violated restriction, in table order."""
    errors, warns = [], []
    values = public_dict(config)
    for r in RESTRICTIONS:
        if r.violated(config, explicit):
            shown = {r.key: values.get(r.key), "parallel_mode": config.parallel_mode,
                     "device_num": config.device_num}  # (the key first, each once)
            msg = f"[{r.key}] {r.rule} (" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) \
                + f"). Fix: {r.fix}."
            (errors if r.severity == "error" else warns).append(msg)
    return errors, warns


def resolve_context(config: AutoParallelConfig | None = None,
                    explicit: frozenset[str] | None = None) -> ResolvedContext:
    """Check the current context (or the given config) and return it resolved.

    Raises ContextConflictError listing every error-level conflict; warns
    AutoParallelWarning once per warning-level one.
    """
    if config is None:
        config, explicit = current_config(), explicit_keys() if explicit is None else explicit
    explicit = explicit if explicit is not None else frozenset()
    errors, warns = check_restrictions(config, explicit)
    if errors:
        raise ContextConflictError(f"{len(errors)} conflicting setting(s): " + " ".join(errors))
    for w in warns:
        warnings.warn(w, AutoParallelWarning, stacklevel=2)
    return _resolved(config, explicit, tuple(warns))


def read_context() -> ResolvedContext:
    """The current context as set, unchecked: no conflict raised or warned. What the
    analysis entry points read (a simulation, the split advisor): they ask what a setting
    would do, on any context (a stand_alone one with ``device_num=8`` included)."""
    return _resolved(current_config(), explicit_keys(), ())


def _resolved(config: AutoParallelConfig, explicit: frozenset[str],
              warns: tuple[str, ...]) -> ResolvedContext:
    return ResolvedContext(config, explicit, warns, fusion_setting(config, "allreduce"),
                           fusion_setting(config, "allgather"),
                           fusion_setting(config, "reducescatter"))
