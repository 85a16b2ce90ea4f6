"""HCCL's gradient split strategies (seeds 000 and 001): how backward gradients are grouped
into AllReduce segments, per communication group.

By percentage of gradient bytes (:func:`set_split_strategy_by_size`) or by gradient index
(:func:`set_split_strategy_by_idx`). When both are set the size strategy wins; with neither,
the default is two segments of 96.54 % and 3.46 % of the data (the ResNet-50 optimum). A
group's strategies are set and read by a member of it (the context's ``global_rank``; the
groups are :mod:`autopar.comm_groups`'). The strategies are per thread (a ContextVar), like
the auto-parallel context, and every call validates everything before it changes anything.
Users reach them as :mod:`autopar.hccl`.

>>> import autopar
>>> autopar.set_auto_parallel_context(device_num=8)
>>> set_split_strategy_by_size([60, 20, 20])
>>> get_split_strategy()
SplitStrategy(group='hccl_world_group', mode='size', values=(60, 20, 20), is_default=False, \
ignored_index=None)
>>> reset_split_strategies(); autopar.reset_auto_parallel_context()
"""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Mapping

from autopar.comm_groups import WORLD_GROUP, member_group
from autopar.config import MAX_INDEX
from autopar.errors import AutoParallelError, AutoParallelTypeError, found
from autopar.limits import finite

__all__ = [
    "MAX_SEGMENTS",
    "DEFAULT_SPLIT_SIZES",
    "SplitStrategy",
    "check_percentages",
    "set_split_strategy_by_size",
    "set_split_strategy_by_idx",
    "get_split_strategy",
    "forget_split_strategies",
    "reset_split_strategies",
]

MAX_SEGMENTS = 8
DEFAULT_SPLIT_SIZES: tuple[float, ...] = (96.54, 3.46)
_SUM_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class SplitStrategy:
    """The effective gradient split of one group.

    mode "size": values are percentages of gradient bytes, in backward (production) order.
    mode "index": values are inclusive end indices of segments (HCCL convention: [20, 100, 159]
    means gradients 0..20, 21..100, 101..159, and the rest).
    ``ignored_index`` is an index strategy that was set but is overridden by a size strategy.
    """

    group: str
    mode: Literal["size", "index"]
    values: tuple[float, ...] | tuple[int, ...]
    is_default: bool
    ignored_index: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class _Splits:
    """The split strategies set, per group name: by size, by index; replaced, never mutated."""

    by_size: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: MappingProxyType({}))
    by_idx: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))


_SPLITS: contextvars.ContextVar[_Splits] = contextvars.ContextVar("autopar_split_strategies",
                                                                  default=_Splits())


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_list(key: str, values: Any, kind: str) -> list[Any]:
    if not isinstance(values, (list, tuple)):
        raise AutoParallelTypeError(key, values, f"{key} must be a list of {kind}")
    if len(values) == 0:
        raise AutoParallelError(key, values, f"{key} must not be empty")
    if len(values) > MAX_SEGMENTS:
        raise AutoParallelError(key, values, f"at most {MAX_SEGMENTS} gradient segments are "
                                f"supported, got {len(values)}")
    return list(values)


def check_percentages(values: Any, key: str = "dataSizeList") -> list[float]:
    """The one rule of a percentage split: at most 8 finite, non-negative numbers summing
    to 100 (the values, checked)."""
    values = _check_list(key, values, "percentages")
    for i, v in enumerate(values):
        if not (_is_int(v) or isinstance(v, float)):
            raise AutoParallelTypeError(key, values,
                                        f"percentages must be ints or floats, {found(v, f'[{i}]')}")
        if not finite(v) or v < 0:
            raise AutoParallelError(key, values, "percentages must be finite and non-negative, "
                                    + found(v, f"[{i}]"))
    try:
        total = math.fsum(values)
    except OverflowError:
        total = math.inf
    if abs(total - 100.0) > _SUM_TOLERANCE:
        raise AutoParallelError(key, values, f"percentages must sum to 100, they sum to "
                                f"{total!r}")
    return values


def set_split_strategy_by_size(dataSizeList: list[float],  # noqa: N803
                               group: str = WORLD_GROUP) -> None:
    """Split backward gradients into AllReduce segments by percentage of data size.

    Percentages are non-negative, at most 8, and sum to 100. Example: 150 MB of gradients
    split 90 / 30 / 30 MB is ``[60, 20, 20]``.
    """
    values = check_percentages(dataSizeList)
    group = member_group(group)
    s = _SPLITS.get()
    _SPLITS.set(_Splits(MappingProxyType({**s.by_size, group: tuple(values)}), s.by_idx))


def set_split_strategy_by_idx(idxList: list[int], group: str = WORLD_GROUP) -> None:  # noqa: N803
    """Split backward gradients into AllReduce segments by gradient index.

    Indices are inclusive segment ends, non-negative, strictly ascending, at most 8:
    ``[20, 100, 159]`` on ResNet-50's 161 gradients gives 0..20, 21..100, 101..159, 160.
    """
    values = _check_list("idxList", idxList, "ints")
    for i, v in enumerate(values):
        if not _is_int(v):
            raise AutoParallelTypeError("idxList", idxList,
                                        f"indices must be ints, {found(v, f'[{i}]')}")
        if not 0 <= v <= MAX_INDEX:
            raise AutoParallelError("idxList", idxList, "indices must be non-negative ints "
                                    "below 2**31 (as all_reduce_fusion_config's), "
                                    f"{found(v, f'[{i}]')}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise AutoParallelError("idxList", idxList, "indices must be strictly ascending")
    group = member_group(group)
    s = _SPLITS.get()
    _SPLITS.set(_Splits(s.by_size, MappingProxyType({**s.by_idx, group: tuple(values)})))


def get_split_strategy(group: str = WORLD_GROUP) -> SplitStrategy:
    """The effective split strategy: size if set, else index if set, else the default."""
    group = member_group(group)
    s = _SPLITS.get()
    idx = s.by_idx.get(group)
    if group in s.by_size:
        return SplitStrategy(group, "size", s.by_size[group], False, ignored_index=idx)
    if idx is not None:
        return SplitStrategy(group, "index", idx, False)
    return SplitStrategy(group, "size", DEFAULT_SPLIT_SIZES, True)


def forget_split_strategies(group: str) -> None:
    """Drop the split strategies of the group named ``group`` (a destroyed group's)."""
    s = _SPLITS.get()
    _SPLITS.set(_Splits(MappingProxyType({k: v for k, v in s.by_size.items() if k != group}),
                        MappingProxyType({k: v for k, v in s.by_idx.items() if k != group})))


def reset_split_strategies() -> None:
    """Forget every split strategy (in this thread / context)."""
    _SPLITS.set(_Splits())
