"""Communication groups: MindSpore's ``mindspore.communication`` queries on autopar's groups.

``hccl_world_group`` holds ranks ``0 .. device_num - 1`` of the current auto-parallel context;
other groups are made with :func:`create_group`. The caller is the rank ``global_rank`` of the
context; it must belong to the group it names. The groups are per thread (a ContextVar), like
the auto-parallel context, and every call validates everything before it changes anything.
The gradient split strategies of a group are :mod:`autopar.split_strategies`'; both are
reached as :mod:`autopar.hccl`, whose ``destroy_group`` / ``reset_comm_groups`` drop a group's
split strategies with it.

>>> import autopar
>>> autopar.set_auto_parallel_context(device_num=8)
>>> create_group("tp0", [0, 1, 2, 3])
>>> get_rank_size("tp0"), member_group("nccl_world_group")
(4, 'hccl_world_group')
>>> reset_groups(); autopar.reset_auto_parallel_context()
"""

from __future__ import annotations

import contextvars
from types import MappingProxyType
from typing import Any, Mapping

from autopar.context import current_config
from autopar.errors import (AutoParallelError, AutoParallelTypeError, CommGroupError, found,
                            safe_repr)

__all__ = [
    "WORLD_GROUP",
    "WORLD_GROUP_ALIASES",
    "MAX_GROUP_NAME_BYTES",
    "create_group",
    "destroy_group",
    "get_rank_size",
    "get_rank_id",
    "get_group_rank_from_world_rank",
    "get_world_rank_from_group_rank",
    "get_rank",
    "get_group_size",
    "member_group",
    "reset_groups",
]

WORLD_GROUP = "hccl_world_group"
#: MindSpore's names of the world group per backend (GlobalComm.WORLD_COMM_GROUP: Ascend,
#: GPU, CPU): get_rank and get_group_size take each of them for hccl_world_group; none of them
#: can be created or destroyed.
WORLD_GROUP_ALIASES: tuple[str, ...] = (WORLD_GROUP, "nccl_world_group", "mccl_world_group")
MAX_GROUP_NAME_BYTES = 128  # including the terminating NUL

#: The created groups (name -> world ranks, group rank i = ranks[i]); replaced, never mutated.
_GROUPS: contextvars.ContextVar[Mapping[str, tuple[int, ...]]] = contextvars.ContextVar(
    "autopar_comm_groups", default=MappingProxyType({}))


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
    groups = _GROUPS.get()
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
    >>> create_group("tp0", [0, 1, 2, 3])
    >>> get_rank_size("tp0")
    4
    >>> reset_groups(); autopar.reset_auto_parallel_context()
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
    groups = _GROUPS.get()
    if name in groups:
        raise CommGroupError("group", name, "a group of this name exists already",
                             "Destroy it first with autopar.hccl.destroy_group")
    _GROUPS.set(MappingProxyType({**groups, name: tuple(rank_ids)}))


def destroy_group(group: str) -> str:
    """Remove a group created by create_group (also after device_num shrank below its
    ranks); its name. (:func:`autopar.hccl.destroy_group` drops its split strategies too.)"""
    name = _not_world(_check_group_name(group), "destroyed")
    _created_ranks(name)
    _GROUPS.set(MappingProxyType({k: v for k, v in _GROUPS.get().items() if k != name}))
    return name


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
    >>> create_group("tp1", [4, 5, 6, 7])
    >>> get_rank(), get_rank("tp1"), get_group_size("tp1"), get_group_size("nccl_world_group")
    (5, 1, 4, 8)
    >>> reset_groups(); autopar.reset_auto_parallel_context()
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


def member_group(group: Any) -> str:
    """``group``'s name (the world group's other names as ``hccl_world_group``), checked: the
    group exists, its ranks fit ``device_num`` and the caller (``global_rank``) is a member.
    What a group's split strategy needs (:mod:`autopar.split_strategies`)."""
    name = _group(group)
    _caller_in(name, _ranks_of(name))
    return name


def reset_groups() -> None:
    """Forget every created group (in this thread / context)."""
    _GROUPS.set(MappingProxyType({}))
