"""Communication groups and the HCCL gradient split API (seeds 000 and 001).

``hccl_world_group`` holds ranks ``0 .. device_num - 1`` of the current auto-parallel context;
other groups are made with :func:`create_group`. A split strategy tells how backward gradients
are grouped into AllReduce segments: by percentage of gradient bytes
(:func:`set_split_strategy_by_size`) or by gradient index (:func:`set_split_strategy_by_idx`).
When both are set the size strategy wins; with neither, the default is two segments of
96.54 % and 3.46 % of the data (the ResNet-50 optimum).

The caller is the rank ``global_rank`` of the context; it must belong to the group it names.
State is per thread (a ContextVar), like the auto-parallel context, and every call validates
everything before it changes anything.

>>> import autopar
>>> autopar.set_auto_parallel_context(device_num=8)
>>> autopar.hccl.set_split_strategy_by_size([60, 20, 20])
>>> autopar.hccl.get_split_strategy()
SplitStrategy(group='hccl_world_group', mode='size', values=(60, 20, 20), is_default=False, \
ignored_index=None)
>>> autopar.hccl.reset_comm_groups(); autopar.reset_auto_parallel_context()
"""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from autopar.config import MAX_INDEX
from autopar.context import current_config
from autopar.errors import (AutoParallelError, AutoParallelTypeError, CommGroupError, found,
                            safe_repr)
from autopar.limits import finite

__all__ = [
    "WORLD_GROUP",
    "MAX_SEGMENTS",
    "DEFAULT_SPLIT_SIZES",
    "SplitStrategy",
    "create_group",
    "destroy_group",
    "get_rank_size",
    "get_rank_id",
    "get_group_rank_from_world_rank",
    "get_world_rank_from_group_rank",
    "get_rank",
    "get_group_size",
    "WORLD_GROUP_ALIASES",
    "set_split_strategy_by_size",
    "set_split_strategy_by_idx",
    "get_split_strategy",
    "reset_comm_groups",
]

WORLD_GROUP = "hccl_world_group"
#: MindSpore's names of the world group per backend (GlobalComm.WORLD_COMM_GROUP: Ascend,
#: GPU, CPU): get_rank and get_group_size take each of them for hccl_world_group; none of them
#: can be created or destroyed.
WORLD_GROUP_ALIASES: tuple[str, ...] = (WORLD_GROUP, "nccl_world_group", "mccl_world_group")
MAX_SEGMENTS = 8
MAX_GROUP_NAME_BYTES = 128  # including the terminating NUL
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
class _CommState:
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    by_size: dict[str, tuple[float, ...]] = field(default_factory=dict)
    by_idx: dict[str, tuple[int, ...]] = field(default_factory=dict)


_STATE: contextvars.ContextVar[_CommState] = contextvars.ContextVar("autopar_comm",
                                                                    default=_CommState())


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_group_name(group: Any) -> str:
    if not isinstance(group, str):
        raise AutoParallelTypeError("group", group, "group name must be a str")
    if group == "":
        raise AutoParallelError("group", group, "group name must not be empty")
    if "\0" in group:
        raise AutoParallelError("group", group, "group name must not contain a NUL character")
    try:
        size = len(group.encode("utf-8")) + 1
    except UnicodeEncodeError:
        raise AutoParallelError("group", group, "group name must be valid UTF-8 text (a lone "
                                "surrogate cannot be encoded)") from None
    if size > MAX_GROUP_NAME_BYTES:
        raise AutoParallelError(
            "group", group, f"group name takes {size} bytes with its terminating NUL; at most "
            f"{MAX_GROUP_NAME_BYTES} are allowed (127 bytes of UTF-8 text)")
    return group


def _world_ranks() -> tuple[int, ...]:
    return tuple(range(current_config().device_num))


def _created_ranks(name: str) -> tuple[int, ...]:
    """The ranks of a group made by create_group, as created (whether or not they still fit
    device_num)."""
    groups = _STATE.get().groups
    if name not in groups:
        known = ", ".join([WORLD_GROUP, *sorted(groups)])
        raise CommGroupError("group", name, f"no such group (known groups: {known})",
                             "Create it first with autopar.hccl.create_group(group, rank_ids)")
    return groups[name]


def _not_world(name: str, action: str) -> str:
    """The one rule of the world group's names: reserved, never created nor destroyed."""
    if name in WORLD_GROUP_ALIASES:
        raise CommGroupError("group", name, f"the world group's names "
                             f"{list(WORLD_GROUP_ALIASES)} are reserved: the world group always "
                             f"exists and cannot be {action}")
    return name


def _group(group: Any) -> str:
    """A checked group name, the world group's other names (MindSpore's GPU / CPU ones) as
    ``hccl_world_group``: the same group for every function that takes a group."""
    name = _check_group_name(group)
    return WORLD_GROUP if name in WORLD_GROUP_ALIASES else name


def _ranks_of(group: Any) -> tuple[int, ...]:
    name = _group(group)
    if name == WORLD_GROUP:
        return _world_ranks()
    ranks = _created_ranks(name)
    device_num = current_config().device_num
    if max(ranks) >= device_num:
        raise CommGroupError("group", name, f"its ranks {list(ranks)} no longer fit device_num="
                             f"{device_num}", "Destroy and re-create the group")
    return ranks


def _caller_in(group: str, ranks: tuple[int, ...]) -> int:
    rank = current_config().global_rank
    if rank not in ranks:
        raise CommGroupError(
            "group", group, f"the caller's rank (global_rank={rank}) is not a member; the group "
            f"holds ranks {list(ranks)}", "Call this from a member rank or set global_rank")
    return ranks.index(rank)


def create_group(group: str, rank_ids: list[int]) -> None:
    """Create a communication group of world ranks (group rank i is rank_ids[i]).

    >>> import autopar
    >>> autopar.set_auto_parallel_context(device_num=8)
    >>> autopar.hccl.create_group("tp0", [0, 1, 2, 3])
    >>> autopar.hccl.get_rank_size("tp0")
    4
    >>> autopar.hccl.reset_comm_groups(); autopar.reset_auto_parallel_context()
    """
    name = _not_world(_check_group_name(group), "created")
    if not isinstance(rank_ids, (list, tuple)):
        raise AutoParallelTypeError("rank_ids", rank_ids, "rank_ids must be a list of ints")
    for i, r in enumerate(rank_ids):
        if not _is_int(r):
            raise AutoParallelTypeError("rank_ids", rank_ids,
                                        f"rank ids must be ints, {found(r, f'[{i}]')}")
    device_num = current_config().device_num
    if len(rank_ids) == 0:
        raise AutoParallelError("rank_ids", rank_ids, "a group needs at least one rank")
    bad = [r for r in rank_ids if r < 0 or r >= device_num]
    if bad:
        raise AutoParallelError("rank_ids", rank_ids, f"rank ids must be in [0, device_num="
                                f"{device_num}), found {safe_repr(bad)}")
    if len(set(rank_ids)) != len(rank_ids):
        raise AutoParallelError("rank_ids", rank_ids, "rank ids must not repeat")
    state = _STATE.get()
    if name in state.groups:
        raise CommGroupError("group", name, "a group of this name exists already",
                             "Destroy it first with autopar.hccl.destroy_group")
    _STATE.set(_CommState({**state.groups, name: tuple(rank_ids)}, state.by_size, state.by_idx))


def destroy_group(group: str) -> None:
    """Remove a group created by create_group, with its split strategies (also after
    device_num shrank below its ranks)."""
    name = _not_world(_check_group_name(group), "destroyed")
    _created_ranks(name)
    s = _STATE.get()
    _STATE.set(_CommState({k: v for k, v in s.groups.items() if k != name},
                          {k: v for k, v in s.by_size.items() if k != name},
                          {k: v for k, v in s.by_idx.items() if k != name}))


def get_rank_size(group: str = WORLD_GROUP) -> int:
    """Number of ranks in the group."""
    return len(_ranks_of(group))


def get_rank_id(group: str = WORLD_GROUP) -> int:
    """The caller's (global_rank's) rank inside the group."""
    return _caller_in(group, _ranks_of(group))


def get_rank(group: str = WORLD_GROUP) -> int:
    """MindSpore's ``mindspore.communication.get_rank``: the caller's (``global_rank``'s) rank
    in ``group`` (the world group by default; its GPU / CPU names ``nccl_world_group`` /
    ``mccl_world_group`` are the same group).

    >>> import autopar
    >>> autopar.set_auto_parallel_context(device_num=8, global_rank=5)
    >>> autopar.hccl.create_group("tp1", [4, 5, 6, 7])
    >>> get_rank(), get_rank("tp1"), get_group_size("tp1"), get_group_size("nccl_world_group")
    (5, 1, 4, 8)
    >>> autopar.hccl.reset_comm_groups(); autopar.reset_auto_parallel_context()
    """
    return get_rank_id(group)


def get_group_size(group: str = WORLD_GROUP) -> int:
    """MindSpore's ``mindspore.communication.get_group_size``: the number of ranks in
    ``group`` (the world group, of ``device_num`` ranks, by default)."""
    return get_rank_size(group)


def get_group_rank_from_world_rank(world_rank_id: int, group: str) -> int:
    group = _group(group)
    ranks = _ranks_of(group)
    if not _is_int(world_rank_id):
        raise AutoParallelTypeError("world_rank_id", world_rank_id, "must be an int")
    if world_rank_id not in ranks:
        raise CommGroupError("world_rank_id", world_rank_id,
                             f"not a member of group {group!r} (ranks {list(ranks)})")
    return ranks.index(world_rank_id)


def get_world_rank_from_group_rank(group: str, group_rank_id: int) -> int:
    group = _group(group)
    ranks = _ranks_of(group)
    if not _is_int(group_rank_id):
        raise AutoParallelTypeError("group_rank_id", group_rank_id, "must be an int")
    if not 0 <= group_rank_id < len(ranks):
        raise AutoParallelError("group_rank_id", group_rank_id,
                                f"must be in [0, {len(ranks)}) for group {group!r}")
    return ranks[group_rank_id]


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
    group = _group(group)
    ranks = _ranks_of(group)
    _caller_in(group, ranks)
    s = _STATE.get()
    _STATE.set(_CommState(s.groups, {**s.by_size, group: tuple(values)}, s.by_idx))


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
    group = _group(group)
    ranks = _ranks_of(group)
    _caller_in(group, ranks)
    s = _STATE.get()
    _STATE.set(_CommState(s.groups, s.by_size, {**s.by_idx, group: tuple(values)}))


def get_split_strategy(group: str = WORLD_GROUP) -> SplitStrategy:
    """The effective split strategy: size if set, else index if set, else the default."""
    group = _group(group)
    ranks = _ranks_of(group)
    _caller_in(group, ranks)
    s = _STATE.get()
    idx = s.by_idx.get(group)
    if group in s.by_size:
        return SplitStrategy(group, "size", s.by_size[group], False, ignored_index=idx)
    if idx is not None:
        return SplitStrategy(group, "index", idx, False)
    return SplitStrategy(group, "size", DEFAULT_SPLIT_SIZES, True)


def reset_comm_groups() -> None:
    """Forget every created group and split strategy (in this thread / context)."""
    _STATE.set(_CommState())
