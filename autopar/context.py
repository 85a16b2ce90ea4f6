"""The auto-parallel context: set / get / reset, scoped overrides, per-thread isolation.

The context is one immutable :class:`~autopar.config.AutoParallelConfig` held in a
``contextvars.ContextVar``: every thread (and every asyncio task's copy) has its own, a new
thread starts from the defaults, and a ``with auto_parallel_context(...)`` block restores the
previous configuration when it ends, also on exceptions. A call validates every key first and
applies them all at once, or none (a failing call changes nothing).

>>> import autopar
>>> autopar.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel")
>>> autopar.get_auto_parallel_context("device_num")
8
>>> with autopar.auto_parallel_context(device_num=4):
...     autopar.get_auto_parallel_context("device_num")
4
>>> autopar.get_auto_parallel_context("device_num")
8
>>> autopar.reset_auto_parallel_context()
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic_core import PydanticCustomError

from autopar.config import (
    GET_ONLY,
    KEYS,
    STRATEGY_FILE_KEYS,
    OPTIMIZER_LEVELS,
    VIEWS,
    AllReduceFusion,
    AutoParallelConfig,
    _check_indices,
    fspath_setting,
    no_effect_messages,
    shard_size_rule,
    unknown_key_error,
    validate_config,
)
from autopar.errors import (AutoParallelError, AutoParallelTypeError, AutoParallelWarning,
                            UnknownKeyError, safe_repr, same_value)
from autopar.strategies.modes import PARALLEL_MODES

__all__ = [
    "ParallelMode",
    "set_auto_parallel_context",
    "get_auto_parallel_context",
    "reset_auto_parallel_context",
    "auto_parallel_context",
    "current_config",
    "explicit_keys",
]

_WHERE = "set_auto_parallel_context"


class ParallelMode:
    """MindSpore's ``ParallelMode``: one str constant per parallel mode, named by its upper-case
    value, and ``MODE_LIST`` (all of them), from :data:`autopar.strategies.modes.PARALLEL_MODES`.

    >>> ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.MODE_LIST[0]
    ('semi_auto_parallel', 'stand_alone')
    """

    STAND_ALONE: str
    DATA_PARALLEL: str
    HYBRID_PARALLEL: str
    SEMI_AUTO_PARALLEL: str
    AUTO_PARALLEL: str
    MODE_LIST: tuple[str, ...] = PARALLEL_MODES


for _mode in PARALLEL_MODES:
    setattr(ParallelMode, _mode.upper(), _mode)


@dataclass(frozen=True, slots=True)
class _State:
    config: AutoParallelConfig
    explicit: frozenset[str]  # keys the user set (restrictions only fire for these)


_DEFAULT = _State(AutoParallelConfig(), frozenset())
_STATE: contextvars.ContextVar[_State] = contextvars.ContextVar("autopar_context",
                                                                default=_DEFAULT)


def _check_key_names(keys: list[Any], where: str, *, get: bool = False) -> None:
    for key in keys:
        if not isinstance(key, str):
            raise AutoParallelTypeError(f"{where}: key {safe_repr(key)} must be a str.")
        if key in GET_ONLY and not get:
            raise UnknownKeyError(f"{key!r} is read-only in {where} (as in MindSpore): set it "
                                  f"through {GET_ONLY[key]}={{{key!r}: ...}}.")
        if key not in KEYS and not (get and key in GET_ONLY):
            raise unknown_key_error(key, KEYS, where)


def _fusion_index_from_alias(value: Any) -> tuple[int, ...]:
    """Validate all_reduce_fusion_config, naming that key in errors."""
    try:
        return _check_indices(value, "all_reduce_fusion_config")
    except PydanticCustomError as err:  # a type problem (subclass of ValueError: test first)
        raise AutoParallelTypeError("all_reduce_fusion_config", value, str(err)) from None
    except ValueError as err:  # a rule violation
        raise AutoParallelError("all_reduce_fusion_config", value, str(err)) from None


def _merge_dict(key: str, value: Any, current: BaseModel) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise AutoParallelTypeError(key, value, f"{key} must be a dict")
    merged = {name: getattr(current, name) for name in type(current).model_fields}
    merged.update(value)
    return merged


#: warnings a call gives (message, category), issued only once it is valid: a refused call
#: warns of nothing
_Warnings = list[tuple[str, type[Warning]]]


def _apply(state: _State, kwargs: dict[str, Any], where: str = _WHERE) -> _State:
    """Pure: the state after setting kwargs, or an error (nothing is changed either way)."""
    _check_key_names(list(kwargs), where)
    kw = dict(kwargs)
    explicit = set(kw)
    deprecated = "auto_parallel_search_mode" in kw
    if deprecated:
        old = kw.pop("auto_parallel_search_mode")
        if "search_mode" in kw and not same_value(kw["search_mode"], old):
            raise AutoParallelError(
                "auto_parallel_search_mode", old,
                f"it is the deprecated alias of search_mode and contradicts search_mode="
                f"{safe_repr(kw['search_mode'])} in the same call", "Set only search_mode")
        kw["search_mode"] = old
        explicit.discard("auto_parallel_search_mode")
        explicit.add("search_mode")

    later: _Warnings = []  # warned once the call is valid
    _sharding_propagation(kw, explicit, later)
    cur = state.config
    data: dict[str, Any] = {name: getattr(cur, name) for name in AutoParallelConfig.model_fields}

    if "comm_fusion" in kw:
        data["comm_fusion"] = _merge_dict("comm_fusion", kw.pop("comm_fusion"), cur.comm_fusion)
    if "all_reduce_fusion_config" in kw:
        indices = _fusion_index_from_alias(kw.pop("all_reduce_fusion_config"))
        explicit.discard("all_reduce_fusion_config")
        explicit.add("comm_fusion")
        if "comm_fusion" in kwargs and "allreduce" in kwargs["comm_fusion"]:
            ar = kwargs["comm_fusion"]["allreduce"]
            given = ar.get("config") if isinstance(ar, dict) else None
            if not (isinstance(ar, dict) and same_value(ar.get("mode"), "index")
                    and type(given) in (list, tuple)
                    and [type(i) for i in given] == [int] * len(given)  # (no bool, no array)
                    and list(given) == list(indices)):
                raise AutoParallelError(
                    "all_reduce_fusion_config", list(indices),
                    f"it is the same setting as comm_fusion['allreduce'] in index mode and "
                    f"contradicts comm_fusion['allreduce']={safe_repr(ar)} in the same call",
                    "Set only one of them")
        fusion = _merge_dict("comm_fusion", {}, cur.comm_fusion)
        if isinstance(data["comm_fusion"], dict):
            fusion = data["comm_fusion"]
        data["comm_fusion"] = fusion | {"allreduce": AllReduceFusion(mode="index",
                                                                     config=indices)}
    _strategy_files(kw, kwargs, data, cur, explicit)
    if "pipeline_config" in kw:
        data["pipeline_config"] = _merge_dict("pipeline_config", kw.pop("pipeline_config"),
                                              cur.pipeline_config)
    _parallel_optimizer(kw, data, cur, explicit, later)

    # full_batch and dataset_strategy describe one thing; keep them consistent.
    if "full_batch" in kw and "dataset_strategy" not in kw:
        fb = kw["full_batch"]
        if fb is True:
            kw["dataset_strategy"] = "full_batch"
        elif fb is False and cur.dataset_strategy == "full_batch":
            kw["dataset_strategy"] = "data_parallel"
    elif "dataset_strategy" in kw and "full_batch" not in kw:
        kw["full_batch"] = kw["dataset_strategy"] == "full_batch" if isinstance(
            kw["dataset_strategy"], str) else False
    data.update(kw)
    try:
        config = validate_config(data, where)
    except (AutoParallelError, AutoParallelTypeError) as e:
        if deprecated and getattr(e, "key", None) == "search_mode":  # name what was set
            rule = re.sub(r" \(got \w+\)$", "", str(e).split(": ", 1)[-1].rstrip("."))
            raise type(e)("auto_parallel_search_mode", e.value,
                          rule.replace("search_mode", "auto_parallel_search_mode"),
                          "It is the deprecated alias of search_mode") from None
        raise
    if deprecated:
        later.insert(0, ("auto_parallel_search_mode is deprecated and will be removed; use "
                         "search_mode (same values)", DeprecationWarning))
    later += [(message, AutoParallelWarning) for message in no_effect_messages(config, kwargs)]
    for message, category in later:
        warnings.warn(message, category, stacklevel=3)
    return _State(config, state.explicit | frozenset(explicit))


def _sharding_propagation(kw: dict[str, Any], explicit: set[str], later: _Warnings) -> None:
    """MindSpore's deprecated ``sharding_propagation`` bool: True is
    search_mode='sharding_propagation' (False changes nothing: MindSpore ORs the two)."""
    if "sharding_propagation" not in kw:
        return
    value = kw.pop("sharding_propagation")
    explicit.discard("sharding_propagation")
    if not isinstance(value, bool):
        raise AutoParallelTypeError("sharding_propagation", value, "must be a bool")
    if value:
        if not same_value(kw.get("search_mode", "sharding_propagation"), "sharding_propagation"):
            raise AutoParallelError(
                "sharding_propagation", value, f"it means search_mode='sharding_propagation' "
                f"and contradicts search_mode={safe_repr(kw['search_mode'])} in the same call",
                "Set only search_mode")
        kw["search_mode"] = "sharding_propagation"
        explicit.add("search_mode")
    later.append(("sharding_propagation is deprecated (as in MindSpore); use "
                  "search_mode='sharding_propagation'", DeprecationWarning))


def _parallel_optimizer(kw: dict[str, Any], data: dict[str, Any], cur: AutoParallelConfig,
                        explicit: set[str], later: _Warnings) -> None:
    """parallel_optimizer_config merged into the current one, with MindSpore's rules: the
    top-level optimizer_weight_shard_size is the same setting; a top-level size <= 1 (-1
    included) and a size of 1 or -1 in the dict are not applied (MindSpore applies only an
    int > 1), warned about unless the size is that already (-1, the default, set again);
    optimizer_level sets gradient_accumulation_shard (a contradicting value, in the same dict
    or later alone against the level set before, is refused)."""
    if "parallel_optimizer_config" not in kw and "optimizer_weight_shard_size" not in kw:
        return
    given = kw.pop("parallel_optimizer_config", {})
    merged = _merge_dict("parallel_optimizer_config", given, cur.parallel_optimizer_config)
    for key, kind in (("optimizer_weight_shard_size", int), ("gradient_accumulation_shard",
                                                               bool)):  # before the rules
        if key in given and type(given[key]) is not kind:  # (True == 1 == 1.0 in Python)
            raise AutoParallelTypeError(f"parallel_optimizer_config.{key}", given[key],
                                        f"must be {'an int' if kind is int else 'a bool'}")
    keep = cur.parallel_optimizer_config.optimizer_weight_shard_size
    if "optimizer_weight_shard_size" in kw:
        size = kw.pop("optimizer_weight_shard_size")
        explicit.discard("optimizer_weight_shard_size")
        if type(size) is not int:
            raise AutoParallelTypeError("optimizer_weight_shard_size", size, "must be an int")
        why = shard_size_rule(size) if size > 1 else None
        if why:
            raise AutoParallelError("optimizer_weight_shard_size", size, why)
        if given.get("optimizer_weight_shard_size", size) != size:
            raise AutoParallelError(
                "optimizer_weight_shard_size", size, "it is the same setting as "
                "parallel_optimizer_config['optimizer_weight_shard_size'] and contradicts "
                f"{safe_repr(given['optimizer_weight_shard_size'])} in the same call",
                "Set only one of them")
        if size > 1:
            merged["optimizer_weight_shard_size"] = size
        elif size != keep:  # (-1 when it is -1 already changes nothing: set silently)
            later.append((_not_applied("optimizer_weight_shard_size", size),
                          AutoParallelWarning))
    dict_size = given.get("optimizer_weight_shard_size")
    if dict_size in (1, -1):
        if dict_size != keep:
            later.append((_not_applied("parallel_optimizer_config['optimizer_weight_shard_"
                                       "size']", dict_size), AutoParallelWarning))
        merged["optimizer_weight_shard_size"] = keep
    level = given.get("optimizer_level")
    if isinstance(level, str) and level in OPTIMIZER_LEVELS:
        shard = OPTIMIZER_LEVELS[level]
        if "gradient_accumulation_shard" in given and given["gradient_accumulation_shard"] \
                is not shard:
            raise AutoParallelError(
                "parallel_optimizer_config.gradient_accumulation_shard",
                given["gradient_accumulation_shard"], f"optimizer_level={level!r} sets it to "
                f"{shard} in the same call (only level2 shards the accumulated gradients)")
        merged["gradient_accumulation_shard"] = shard
    elif "gradient_accumulation_shard" in given:
        level = merged.get("optimizer_level")
        if isinstance(level, str) and level in OPTIMIZER_LEVELS and \
                given["gradient_accumulation_shard"] is not \
                OPTIMIZER_LEVELS[level]:
            raise AutoParallelError(
                "parallel_optimizer_config.gradient_accumulation_shard",
                given["gradient_accumulation_shard"], f"optimizer_level={level!r}, set "
                f"before, sets it to {OPTIMIZER_LEVELS[level]} (only level2 shards the "
                "accumulated gradients)", "Set optimizer_level in the same call (None "
                "clears it), or reset_auto_parallel_context()")
    data["parallel_optimizer_config"] = merged
    explicit.add("parallel_optimizer_config")


def _not_applied(key: str, value: int) -> str:
    return (f"{key}={safe_repr(value)} is not applied (as in MindSpore, which applies only an "
            "int > 1): the parallel optimizer keeps its shard size; reset_auto_parallel_context() "
            "restores -1, the whole data-parallel group")


def _strategy_files(kw: dict[str, Any], kwargs: dict[str, Any], data: dict[str, Any],
                    cur: AutoParallelConfig, explicit: set[str]) -> None:
    """strategy_ckpt_config and strategy_ckpt_load_file / strategy_ckpt_save_file are one
    setting under two names (as in MindSpore, where both write the same field): whichever is
    set last wins; both in one call must agree. Fills ``data`` with both sides."""
    if "strategy_ckpt_config" not in kw and not any(f in kw for f, _ in STRATEGY_FILE_KEYS):
        return
    merged = _merge_dict("strategy_ckpt_config", kw.pop("strategy_ckpt_config", {}),
                         cur.strategy_ckpt_config)
    merged = {k: fspath_setting(v) for k, v in merged.items()}  # (a pathlib.Path: its text)
    given = kwargs.get("strategy_ckpt_config") or {}
    given = {k: fspath_setting(v) for k, v in given.items()} if isinstance(given, dict) else {}
    for flat, key in STRATEGY_FILE_KEYS:
        if flat in kw:
            value = fspath_setting(kw.pop(flat))
            if key in given and not same_value(given[key], value):
                raise AutoParallelError(
                    flat, value, f"it is the same setting as strategy_ckpt_config[{key!r}] and "
                    f"contradicts strategy_ckpt_config[{key!r}]={safe_repr(given[key])} in the "
                    "same call", "Set only one of them")
            data[flat] = value
            if isinstance(value, str):
                merged[key] = value
        elif isinstance(merged[key], str):
            data[flat] = merged[key]
        if key in given or flat in kwargs:
            explicit.update((flat, "strategy_ckpt_config"))
    data["strategy_ckpt_config"] = merged


def set_auto_parallel_context(**kwargs: Any) -> None:
    """Set auto-parallel keys (seed 002). All keys are validated before any is applied.

    Raises UnknownKeyError (a ValueError) for an unknown key, AutoParallelTypeError (a
    TypeError) for a wrong type, AutoParallelError (a ValueError) for a value out of range.

    >>> set_auto_parallel_context(device_num=8, comm_fusion={"allreduce": {"mode": "size",
    ...                                                                     "config": 32}})
    >>> get_auto_parallel_context("comm_fusion")
    {'allreduce': {'mode': 'size', 'config': 32}}
    >>> reset_auto_parallel_context()
    """
    _STATE.set(_apply(_STATE.get(), kwargs))


def _public_value(config: AutoParallelConfig, name: str) -> Any:
    if name == "all_reduce_fusion_config":
        return config.all_reduce_fusion_config
    if name == "sharding_propagation":
        return config.search_mode == "sharding_propagation"
    if name == "optimizer_weight_shard_size":
        return config.parallel_optimizer_config.optimizer_weight_shard_size
    if name == "comm_fusion":
        return config.comm_fusion.as_dict()
    if name in ("parallel_optimizer_config", "strategy_ckpt_config", "pipeline_config"):
        return getattr(config, name).model_dump()
    if name in GET_ONLY:
        return getattr(getattr(config, GET_ONLY[name]), name)
    return getattr(config, name)


def get_auto_parallel_context(attr_key: str) -> Any:
    """The value of one key, as set (normalised: lists for index lists, dicts for dicts).
    ``pipeline_interleave`` and ``pipeline_scheduler`` read pipeline_config's entries.

    >>> get_auto_parallel_context("search_mode")
    'dynamic_programming'
    """
    _check_key_names([attr_key], "get_auto_parallel_context", get=True)
    config = _STATE.get().config
    if attr_key == "auto_parallel_search_mode":
        warnings.warn("auto_parallel_search_mode is deprecated and will be removed; use "
                      "search_mode", DeprecationWarning, stacklevel=2)
        return config.search_mode
    return _public_value(config, attr_key)


def reset_auto_parallel_context() -> None:
    """Every key back to its default (in this thread / context)."""
    _STATE.set(_DEFAULT)


@contextlib.contextmanager
def auto_parallel_context(**kwargs: Any) -> Iterator[AutoParallelConfig]:
    """Override keys for a block; the previous context comes back afterwards, also on errors.

    >>> with auto_parallel_context(device_num=8, parallel_mode="data_parallel") as cfg:
    ...     cfg.parallel_mode
    'data_parallel'
    """
    new = _apply(_STATE.get(), kwargs, "auto_parallel_context")
    token = _STATE.set(new)
    try:
        yield new.config
    finally:
        _STATE.reset(token)


def current_config() -> AutoParallelConfig:
    """The current (frozen) configuration object."""
    return _STATE.get().config


def explicit_keys() -> frozenset[str]:
    """Keys the user has set since the last reset (for mode-restriction checks)."""
    return _STATE.get().explicit


def public_dict(config: AutoParallelConfig | None = None) -> dict[str, Any]:
    """Every key with its public value (what get_auto_parallel_context returns)."""
    config = config or current_config()
    out = {name: _public_value(config, name) for name in AutoParallelConfig.model_fields}
    for view in VIEWS:
        if view != "auto_parallel_search_mode":  # (reading it warns: deprecated)
            out[view] = _public_value(config, view)
    return out

