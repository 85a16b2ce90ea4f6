"""Communication groups and the HCCL gradient split API (seeds 000 and 001), as MindSpore
users call them: one namespace over :mod:`autopar.comm_groups` (the groups, MindSpore's
``get_rank`` / ``get_group_size``) and :mod:`autopar.split_strategies` (the split strategies
of a group).

``hccl_world_group`` holds ranks ``0 .. device_num - 1`` of the current auto-parallel context;
other groups are made with :func:`create_group`. A split strategy tells how backward gradients
are grouped into AllReduce segments: by percentage of gradient bytes
(:func:`set_split_strategy_by_size`) or by gradient index (:func:`set_split_strategy_by_idx`).
When both are set the size strategy wins; with neither, the default is two segments of
96.54 % and 3.46 % of the data (the ResNet-50 optimum).

The caller is the rank ``global_rank`` of the context; it must belong to the group it names.
State is per thread (ContextVars), like the auto-parallel context, and every call validates
everything before it changes anything. A group's split strategies go with it
(:func:`destroy_group`); :func:`reset_comm_groups` forgets both.

>>> import autopar
>>> autopar.set_auto_parallel_context(device_num=8)
>>> autopar.hccl.set_split_strategy_by_size([60, 20, 20])
>>> autopar.hccl.get_split_strategy()
SplitStrategy(group='hccl_world_group', mode='size', values=(60, 20, 20), is_default=False, \
ignored_index=None)
>>> autopar.hccl.reset_comm_groups(); autopar.reset_auto_parallel_context()
"""

from __future__ import annotations

from autopar import comm_groups, split_strategies
from autopar.comm_groups import (WORLD_GROUP, WORLD_GROUP_ALIASES, create_group,
                                 get_group_rank_from_world_rank, get_group_size, get_rank,
                                 get_rank_id, get_rank_size, get_world_rank_from_group_rank)
from autopar.split_strategies import (DEFAULT_SPLIT_SIZES, MAX_SEGMENTS, SplitStrategy,
                                      get_split_strategy, set_split_strategy_by_idx,
                                      set_split_strategy_by_size)

__all__ = [
    # the groups (autopar.comm_groups)
    "WORLD_GROUP", "WORLD_GROUP_ALIASES", "create_group", "get_group_rank_from_world_rank",
    "get_group_size", "get_rank", "get_rank_id", "get_rank_size", "get_world_rank_from_group_rank",
    # the split strategies (autopar.split_strategies)
    "DEFAULT_SPLIT_SIZES", "MAX_SEGMENTS", "SplitStrategy", "get_split_strategy",
    "set_split_strategy_by_idx", "set_split_strategy_by_size",
    # both
    "destroy_group", "reset_comm_groups",
]


def destroy_group(group: str) -> None:
    """Remove a group created by create_group, with its split strategies (also after
    device_num shrank below its ranks)."""
    split_strategies.forget_split_strategies(comm_groups.destroy_group(group))


def reset_comm_groups() -> None:
    """Forget every created group and split strategy (in this thread / context)."""
    comm_groups.reset_groups()
    split_strategies.reset_split_strategies()
