"""Communication groups and the HCCL split API (seeds 000, 001)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar as ap
from autopar.comm_groups import _GROUPS
from autopar.split_strategies import _SPLITS


def snapshot():
    s = _SPLITS.get()
    return (dict(_GROUPS.get()), dict(s.by_size), dict(s.by_idx))


@pytest.fixture(autouse=True)
def _eight_devices():
    ap.set_auto_parallel_context(device_num=8)


def test_default_split_is_resnet50_optimum():
    s = ap.hccl.get_split_strategy()
    assert (s.mode, s.values, s.is_default) == ("size", (96.54, 3.46), True)
    assert s.group == "hccl_world_group"


def test_seed_examples():
    ap.hccl.create_group("group", [0, 1, 2, 3])
    ap.hccl.set_split_strategy_by_size([60, 20, 20], "group")
    assert ap.hccl.get_split_strategy("group").values == (60, 20, 20)
    ap.hccl.set_split_strategy_by_idx([20, 100, 159])
    ap.hccl.set_split_strategy_by_size([80, 20])
    assert ap.hccl.get_split_strategy().values == (80, 20)


def test_size_wins_over_index_in_either_order():
    ap.hccl.set_split_strategy_by_idx([20, 100, 159])
    assert ap.hccl.get_split_strategy() == ap.hccl.SplitStrategy("hccl_world_group", "index",
                                                       (20, 100, 159), False)
    ap.hccl.set_split_strategy_by_size([50.5, 49.5])
    s = ap.hccl.get_split_strategy()
    assert (s.mode, s.values, s.ignored_index) == ("size", (50.5, 49.5), (20, 100, 159))
    ap.hccl.set_split_strategy_by_idx([5])  # setting index later does not override size
    assert ap.hccl.get_split_strategy().mode == "size"
    assert ap.hccl.get_split_strategy().ignored_index == (5,)


def test_groups_and_ranks():
    ap.set_auto_parallel_context(global_rank=5)
    ap.hccl.create_group("odd", [1, 3, 5, 7])
    assert ap.hccl.get_rank_size("odd") == 4 and ap.hccl.get_rank_size() == 8
    assert ap.hccl.get_rank_id("odd") == 2 and ap.hccl.get_rank_id() == 5
    assert ap.hccl.get_group_rank_from_world_rank(7, "odd") == 3
    assert ap.hccl.get_world_rank_from_group_rank("odd", 1) == 3
    ap.hccl.set_split_strategy_by_size([100], "odd")
    ap.hccl.destroy_group("odd")
    with pytest.raises(ap.CommGroupError, match="odd"):
        ap.hccl.get_split_strategy("odd")
    ap.hccl.create_group("odd", [5])  # re-created: old split strategy is gone
    assert ap.hccl.get_split_strategy("odd").is_default


def test_group_name_byte_limit_127_accepted_128_rejected():
    ap.hccl.create_group("g" * 127, [0])
    with pytest.raises(ValueError, match="128"):
        ap.hccl.create_group("g" * 128, [0])
    # multi-byte UTF-8: 42 x 3 bytes = 126 (+NUL = 127) ok; 43 x 3 = 129 rejected
    ap.hccl.create_group("\u4e2d" * 42, [0])
    with pytest.raises(ValueError, match="group"):
        ap.hccl.create_group("\u4e2d" * 43, [0])
    with pytest.raises(ValueError, match="group"):
        ap.hccl.set_split_strategy_by_size([100], "g" * 128)


def test_caller_must_be_member():
    ap.hccl.create_group("upper", [4, 5, 6, 7])
    before = snapshot()
    with pytest.raises(ap.CommGroupError, match="global_rank=0"):
        ap.hccl.set_split_strategy_by_size([100], "upper")
    with pytest.raises(ap.CommGroupError, match="global_rank=0"):
        ap.hccl.set_split_strategy_by_idx([1], "upper")
    with pytest.raises(ap.CommGroupError):
        ap.hccl.get_split_strategy("upper")
    assert snapshot() == before
    ap.set_auto_parallel_context(global_rank=6)
    ap.hccl.set_split_strategy_by_size([100], "upper")
    assert ap.hccl.get_split_strategy("upper").values == (100,)


def test_world_group_follows_device_num():
    ap.set_auto_parallel_context(device_num=2, global_rank=1)
    assert ap.hccl.get_rank_size() == 2
    ap.set_auto_parallel_context(global_rank=3)
    with pytest.raises(ap.CommGroupError, match="global_rank=3"):
        ap.hccl.set_split_strategy_by_size([100])


def test_group_that_no_longer_fits_device_num():
    ap.hccl.create_group("hi", [0, 7])
    ap.set_auto_parallel_context(device_num=4)
    with pytest.raises(ap.CommGroupError, match="device_num=4"):
        ap.hccl.get_rank_size("hi")


def test_group_destroyable_after_device_num_shrinks():
    ap.hccl.create_group("g", [4, 5])
    ap.set_auto_parallel_context(global_rank=4)
    ap.hccl.set_split_strategy_by_size([100], "g")
    ap.set_auto_parallel_context(device_num=4, global_rank=0)
    ap.hccl.destroy_group("g")
    assert snapshot() == ({}, {}, {})
    ap.hccl.create_group("g", [0, 1])  # the name is free again
    assert ap.hccl.get_rank_size("g") == 2 and ap.hccl.get_split_strategy("g").is_default


@pytest.mark.parametrize("alias", ap.hccl.WORLD_GROUP_ALIASES)
def test_world_group_aliases_are_reserved(alias):
    ap.set_auto_parallel_context(global_rank=1)
    with pytest.raises(ap.CommGroupError, match="reserved"):
        ap.hccl.create_group(alias, [0, 1])
    with pytest.raises(ap.CommGroupError, match="cannot be destroyed"):
        ap.hccl.destroy_group(alias)
    assert snapshot() == ({}, {}, {})
    assert ap.hccl.get_group_size(alias) == 8 and ap.hccl.get_rank(alias) == 1


def test_threads_have_their_own_groups():
    ap.hccl.create_group("main_only", [0])
    seen = {}

    def worker():
        ap.set_auto_parallel_context(device_num=8)
        try:
            ap.hccl.get_rank_size("main_only")
        except ap.CommGroupError:
            seen["isolated"] = True
        ap.hccl.set_split_strategy_by_size([10, 90])

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"isolated": True}
    assert ap.hccl.get_split_strategy().is_default  # the worker's split did not leak


T, V = TypeError, ValueError
BAD = [
    # (function name, args, kwargs, exception, text in message)
    ("set_split_strategy_by_size", ([50, 40],), {}, V, "sum to 100"),
    ("set_split_strategy_by_size", ([50, 50.1],), {}, V, "sum to 100"),
    ("set_split_strategy_by_size", ([50, 50.00001],), {}, V, "they sum to 100.00001"),
    ("set_split_strategy_by_size", ([],), {}, V, "dataSizeList"),
    ("set_split_strategy_by_size", ([10] * 9 + [10],), {}, V, "at most 8"),
    ("set_split_strategy_by_size", ([12.5] * 7 + [12.4, 0.1],), {}, V, "at most 8"),
    ("set_split_strategy_by_size", ([110, -10],), {}, V, "non-negative"),
    ("set_split_strategy_by_size", ([float("nan"), 100],), {}, V, "finite"),
    ("set_split_strategy_by_size", ([float("inf")],), {}, V, "finite"),
    ("set_split_strategy_by_size", (["60", "40"],), {}, T, "dataSizeList"),
    ("set_split_strategy_by_size", ([True, 99],), {}, T, "dataSizeList"),
    ("set_split_strategy_by_size", ([None],), {}, T, "dataSizeList"),
    ("set_split_strategy_by_size", (100,), {}, T, "dataSizeList"),
    ("set_split_strategy_by_size", ("100",), {}, T, "dataSizeList"),
    ("set_split_strategy_by_size", ({60: 1, 40: 1},), {}, T, "dataSizeList"),
    ("set_split_strategy_by_size", ([100],), {"group": "nosuch"}, V, "nosuch"),
    ("set_split_strategy_by_size", ([100],), {"group": 1}, T, "group"),
    ("set_split_strategy_by_size", ([100],), {"group": None}, T, "group"),
    ("set_split_strategy_by_size", ([100],), {"group": ""}, V, "group"),
    ("set_split_strategy_by_size", ([100],), {"group": "a\0b"}, V, "NUL"),
    ("set_split_strategy_by_idx", ([],), {}, V, "idxList"),
    ("set_split_strategy_by_idx", ([5, 5],), {}, V, "ascending"),
    ("set_split_strategy_by_idx", ([159, 100, 20],), {}, V, "ascending"),
    ("set_split_strategy_by_idx", ([-1, 20],), {}, V, "non-negative"),
    ("set_split_strategy_by_idx", ([20, 10 ** 400],), {}, V, "below 2**31"),
    ("set_split_strategy_by_idx", (list(range(9)),), {}, V, "at most 8"),
    ("set_split_strategy_by_idx", ([20.0],), {}, T, "idxList"),
    ("set_split_strategy_by_idx", ([False, 3],), {}, T, "idxList"),
    ("set_split_strategy_by_idx", ("20",), {}, T, "idxList"),
    ("set_split_strategy_by_idx", (20,), {}, T, "idxList"),
    ("set_split_strategy_by_idx", ([20],), {"group": "nosuch"}, V, "nosuch"),
    ("set_split_strategy_by_idx", ([20],), {"group": b"bytes"}, T, "group"),
    ("create_group", ("hccl_world_group", [0]), {}, V, "reserved"),
    ("create_group", ("nccl_world_group", [0]), {}, V, "reserved"),
    ("create_group", ("mccl_world_group", [0]), {}, V, "reserved"),
    ("create_group", ("g", []), {}, V, "rank_ids"),
    ("create_group", ("g", [0, 0]), {}, V, "repeat"),
    ("create_group", ("g", [8]), {}, V, "device_num=8"),
    ("create_group", ("g", [-1]), {}, V, "rank_ids"),
    ("create_group", ("g", [1.0]), {}, T, "rank_ids"),
    ("create_group", ("g", [True]), {}, T, "rank_ids"),
    ("create_group", ("g", 3), {}, T, "rank_ids"),
    ("create_group", ("g", "0,1"), {}, T, "rank_ids"),
    ("create_group", (5, [0]), {}, T, "group"),
    ("create_group", ("x" * 200, [0]), {}, V, "group"),
    ("create_group", ("exists", [0]), {}, V, "exists"),
    ("destroy_group", ("hccl_world_group",), {}, V, "cannot be destroyed"),
    ("destroy_group", ("nccl_world_group",), {}, V, "cannot be destroyed"),
    ("destroy_group", ("nosuch",), {}, V, "nosuch"),
    ("get_split_strategy", ("nosuch",), {}, V, "nosuch"),
    ("get_rank_size", (7,), {}, T, "group"),
    ("get_group_rank_from_world_rank", (3, "exists"), {}, V, "world_rank_id"),
    ("get_group_rank_from_world_rank", ("0", "exists"), {}, T, "world_rank_id"),
    ("get_world_rank_from_group_rank", ("exists", 1), {}, V, "group_rank_id"),
    ("get_world_rank_from_group_rank", ("exists", 0.0), {}, T, "group_rank_id"),
]


@pytest.mark.parametrize("fn,args,kwargs,exc,text", BAD,
                         ids=[f"{b[0]}-{repr(b[1])[:30]}-{b[2]}" for b in BAD])
def test_bad_input(fn, args, kwargs, exc, text):
    ap.hccl.create_group("exists", [0])
    ap.hccl.set_split_strategy_by_idx([3])
    before = snapshot()
    with pytest.raises(exc) as info:
        getattr(ap.hccl, fn)(*args, **kwargs)
    assert isinstance(info.value, ap.AutoparError)
    assert text in str(info.value), str(info.value)
    assert snapshot() == before


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(min_value=-5, max_value=105, allow_nan=False), min_size=1,
                max_size=10))
def test_size_rule_property(sizes):
    total = sum(sizes)
    ok = len(sizes) <= 8 and all(s >= 0 for s in sizes) and abs(total - 100) <= 1e-6
    ap.hccl.reset_comm_groups()
    if ok:
        ap.hccl.set_split_strategy_by_size(sizes)
        assert ap.hccl.get_split_strategy().values == tuple(sizes)
    else:
        with pytest.raises(ValueError, match="dataSizeList"):
            ap.hccl.set_split_strategy_by_size(sizes)
        assert ap.hccl.get_split_strategy().is_default


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=100), min_size=1, max_size=8, unique=True))
def test_sizes_that_sum_to_100_are_accepted(weights):
    total = sum(weights)
    if total == 0:
        return
    sizes = [100 * w / total for w in weights]
    sizes[-1] = 100 - sum(sizes[:-1])
    if sizes[-1] < 0:
        return
    ap.hccl.reset_comm_groups()
    ap.hccl.set_split_strategy_by_size(sizes)
    assert ap.hccl.get_split_strategy().mode == "size"


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(min_value=-3, max_value=200), min_size=1, max_size=10))
def test_index_rule_property(idx):
    ok = (len(idx) <= 8 and all(i >= 0 for i in idx)
          and all(b > a for a, b in zip(idx, idx[1:])))
    ap.hccl.reset_comm_groups()
    if ok:
        ap.hccl.set_split_strategy_by_idx(idx)
        assert ap.hccl.get_split_strategy().values == tuple(idx)
    else:
        with pytest.raises(ValueError, match="idxList"):
            ap.hccl.set_split_strategy_by_idx(idx)
        assert ap.hccl.get_split_strategy().is_default


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=140).filter(lambda s: "\0" not in s))
def test_group_name_byte_rule_property(name):
    ap.hccl.reset_comm_groups()
    if name in ap.hccl.WORLD_GROUP_ALIASES:
        return
    nbytes = len(name.encode("utf-8")) + 1
    if nbytes <= 128:
        ap.hccl.create_group(name, [0])
        assert ap.hccl.get_rank_size(name) == 1
    else:
        with pytest.raises(ValueError, match="128"):
            ap.hccl.create_group(name, [0])


@pytest.mark.parametrize("alias", ["nccl_world_group", "mccl_world_group"])
def test_the_world_groups_other_names_are_the_same_group_everywhere(alias):
    """Only get_rank / get_group_size took MindSpore's GPU / CPU names of the world group;
    the split strategies and rank translations said 'no such group'."""
    ap.set_auto_parallel_context(device_num=8)
    ap.hccl.set_split_strategy_by_idx([3, 7], alias)
    assert ap.hccl.get_split_strategy().values == (3, 7)  # set on hccl_world_group itself
    ap.hccl.set_split_strategy_by_size([60, 40], group=alias)
    assert ap.hccl.get_split_strategy(alias) == ap.hccl.get_split_strategy()
    assert ap.hccl.get_rank_size(alias) == 8
    assert ap.hccl.get_world_rank_from_group_rank(alias, 3) == 3
    assert ap.hccl.get_group_rank_from_world_rank(5, alias) == 5
