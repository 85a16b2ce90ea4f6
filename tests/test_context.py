"""set/get/reset_auto_parallel_context: every key, every rule, all-or-nothing, threads."""

from __future__ import annotations

import threading
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar as ap
from autopar.config import MAX_FUSION_MB
from autopar.context import public_dict
from autopar.graph.ir import check_strategy_shape

ALL_KEYS = sorted(public_dict()) + ["auto_parallel_search_mode"]

# A non-default value for every key, as a MindSpore user would write it.
ROUND_TRIP = {
    "device_num": 8,
    "global_rank": 3,
    "gradients_mean": True,
    "gradient_fp32_sync": False,
    "loss_repeated_mean": False,
    "parallel_mode": "semi_auto_parallel",
    "search_mode": "sharding_propagation",
    "parameter_broadcast": True,
    "strategy_ckpt_load_file": "./strategy_stage1.ckpt",
    "strategy_ckpt_save_file": "./strategy_stage2.ckpt",
    "full_batch": True,
    "dataset_strategy": ((1, 8), (1, 8)),
    "enable_parallel_optimizer": True,
    "parallel_optimizer_config": {"gradient_accumulation_shard": False,
                                  "parallel_optimizer_threshold": 24,
                                  "optimizer_weight_shard_size": 2, "optimizer_level": None},
    "enable_alltoall": True,
    "all_reduce_fusion_config": [8, 160],
    "optimizer_weight_shard_size": 2,  # the same setting as in parallel_optimizer_config
    "pipeline_stages": 2,
    "grad_accumulation_step": 4,
    "recompute": "selective",
    "comm_fusion": {"allreduce": {"mode": "size", "config": 32},
                    "allgather": {"mode": "auto", "config": None},
                    "reducescatter": {"mode": "size", "config": 16.5}},
}


def snapshot():
    return public_dict()


def test_defaults_are_the_seeds():
    """The seed's keys with its defaults, and MindSpore 2.3 - 2.5's keys with theirs."""
    d = snapshot()
    assert d == {
        "device_num": 1, "global_rank": 0, "gradients_mean": False, "gradient_fp32_sync": True,
        "loss_repeated_mean": True, "parallel_mode": "stand_alone",
        "search_mode": "dynamic_programming", "parameter_broadcast": False,
        "strategy_ckpt_load_file": "", "strategy_ckpt_save_file": "", "full_batch": False,
        "dataset_strategy": "data_parallel", "enable_parallel_optimizer": False,
        "parallel_optimizer_config": {"gradient_accumulation_shard": True,
                                      "parallel_optimizer_threshold": 64,
                                      "optimizer_weight_shard_size": -1,
                                      "optimizer_level": None},
        "enable_alltoall": False, "all_reduce_fusion_config": [], "pipeline_stages": 1,
        "grad_accumulation_step": 1, "comm_fusion": {},
        "strategy_ckpt_config": {"load_file": "", "save_file": "", "only_trainable_params": True},
        "pipeline_config": {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"},
        "auto_pipeline": False, "recompute": "none", "force_fp32_communication": False,
        "pipeline_result_broadcast": False, "group_ckpt_save_file": "", "dump_local_norm": False,
        "dump_local_norm_path": "", "dump_device_local_norm": False,
        # MindSpore 2.5's keys missing from its documentation, and two views
        "pipeline_segments": 1, "communi_parallel_mode": "all_group_parallel",
        "optimizer_weight_shard_aggregated_save": False, "sharding_propagation": False,
        "optimizer_weight_shard_size": -1,
    }


@pytest.mark.parametrize("key", sorted(ROUND_TRIP))
def test_round_trip_every_key(key):
    value = ROUND_TRIP[key]
    ap.set_auto_parallel_context(**{key: value})
    got = ap.get_auto_parallel_context(key)
    if key == "full_batch":
        assert got is True and ap.get_auto_parallel_context("dataset_strategy") == "full_batch"
    else:
        assert got == value
    # every other key keeps its default (except the documented linked views)
    linked = {"full_batch": {"dataset_strategy"}, "dataset_strategy": {"full_batch"},
              "all_reduce_fusion_config": {"comm_fusion"},
              "strategy_ckpt_load_file": {"strategy_ckpt_config"},
              "strategy_ckpt_save_file": {"strategy_ckpt_config"},
              "parallel_optimizer_config": {"optimizer_weight_shard_size"},
              "optimizer_weight_shard_size": {"parallel_optimizer_config"},
              "sharding_propagation": {"search_mode"},
              "search_mode": {"sharding_propagation"}}.get(key, set())
    if key == "comm_fusion":
        linked = {"all_reduce_fusion_config"}
    after = snapshot()
    ap.reset_auto_parallel_context()
    base = snapshot()
    for other in base:
        if other != key and other not in linked:
            assert after[other] == base[other], other


def test_round_trip_all_keys_in_one_call():
    kwargs = dict(ROUND_TRIP)
    kwargs.pop("full_batch")  # dataset_strategy is a tuple: full_batch is False by definition
    kwargs.pop("comm_fusion")  # all_reduce_fusion_config sets comm_fusion's allreduce
    ap.set_auto_parallel_context(**kwargs)
    for key, value in kwargs.items():
        assert ap.get_auto_parallel_context(key) == value, key
    assert ap.get_auto_parallel_context("full_batch") is False
    assert ap.get_auto_parallel_context("comm_fusion") == {
        "allreduce": {"mode": "index", "config": [8, 160]}}


def test_seed_examples_run_unchanged():
    ap.set_auto_parallel_context(device_num=8)
    ap.set_auto_parallel_context(global_rank=0)
    ap.set_auto_parallel_context(gradients_mean=True)
    ap.set_auto_parallel_context(gradient_fp32_sync=False)
    ap.set_auto_parallel_context(parallel_mode="auto_parallel")
    ap.set_auto_parallel_context(search_mode="dynamic_programming")
    with pytest.warns(DeprecationWarning, match="auto_parallel_search_mode"):
        ap.set_auto_parallel_context(auto_parallel_search_mode="dynamic_programming")
    ap.set_auto_parallel_context(parameter_broadcast=False)
    ap.set_auto_parallel_context(strategy_ckpt_load_file="./strategy_stage1.ckpt")
    ap.set_auto_parallel_context(strategy_ckpt_save_file="./strategy_stage1.ckpt")
    ap.set_auto_parallel_context(dataset_strategy=((1, 8), (1, 8)))
    ap.set_auto_parallel_context(enable_parallel_optimizer=False)
    ap.set_auto_parallel_context(enable_alltoall=False)
    ap.set_auto_parallel_context(all_reduce_fusion_config=[8, 160])
    ap.set_auto_parallel_context(pipeline_stages=2)
    parallel_config = {"gradient_accumulation_shard": True, "parallel_optimizer_threshold": 24}
    ap.set_auto_parallel_context(parallel_optimizer_config=parallel_config,
                                 enable_parallel_optimizer=True)
    config = {"allreduce": {"mode": "size", "config": 32},
              "allgather": {"mode": "size", "config": 32}}
    ap.set_auto_parallel_context(comm_fusion=config)
    assert ap.get_auto_parallel_context("comm_fusion") == config
    assert ap.get_auto_parallel_context("all_reduce_fusion_config") == []
    assert ap.get_auto_parallel_context("parallel_optimizer_config") == {
        **parallel_config, "optimizer_weight_shard_size": -1, "optimizer_level": None}
    assert ap.get_auto_parallel_context("pipeline_stages") == 2


def test_deprecated_alias_sets_and_gets_search_mode():
    with pytest.warns(DeprecationWarning):
        ap.set_auto_parallel_context(auto_parallel_search_mode="recursive_programming")
    assert ap.get_auto_parallel_context("search_mode") == "recursive_programming"
    with pytest.warns(DeprecationWarning):
        assert ap.get_auto_parallel_context("auto_parallel_search_mode") == \
            "recursive_programming"


def test_file_settings_take_a_pathlib_path_as_its_text():
    from pathlib import Path, PurePosixPath

    ap.set_auto_parallel_context(strategy_ckpt_load_file=Path("a") / "s.json")
    ap.set_auto_parallel_context(strategy_ckpt_config={"save_file": PurePosixPath("b.json")})
    assert ap.get_auto_parallel_context("strategy_ckpt_config") == {
        "load_file": "a/s.json", "save_file": "b.json", "only_trainable_params": True}
    assert ap.get_auto_parallel_context("strategy_ckpt_save_file") == "b.json"
    ap.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=2)
    assert ap.resolve_context().config.strategy_ckpt_load_file == "a/s.json"
    with pytest.warns(ap.AutoParallelWarning):
        ap.set_auto_parallel_context(group_ckpt_save_file=Path("g.ckpt"))
    assert ap.get_auto_parallel_context("group_ckpt_save_file") == "g.ckpt"
    with pytest.raises(ap.AutoParallelError, match="strategy_ckpt_save_file"):
        ap.set_auto_parallel_context(strategy_ckpt_save_file=Path("c.json"),
                                     strategy_ckpt_config={"save_file": "d.json"})
    with pytest.raises(ap.AutoParallelTypeError, match="valid string"):
        ap.set_auto_parallel_context(strategy_ckpt_load_file=b"bytes.json")
    assert ap.get_auto_parallel_context("strategy_ckpt_save_file") == "b.json"


def test_full_batch_and_dataset_strategy_stay_consistent():
    ap.set_auto_parallel_context(full_batch=True)
    assert ap.get_auto_parallel_context("dataset_strategy") == "full_batch"
    ap.set_auto_parallel_context(full_batch=False)
    assert ap.get_auto_parallel_context("dataset_strategy") == "data_parallel"
    ap.set_auto_parallel_context(dataset_strategy="full_batch")
    assert ap.get_auto_parallel_context("full_batch") is True
    ap.set_auto_parallel_context(dataset_strategy=((2, 1),))
    assert ap.get_auto_parallel_context("full_batch") is False
    ap.set_auto_parallel_context(full_batch=False)  # a tuple strategy stays as it is
    assert ap.get_auto_parallel_context("dataset_strategy") == ((2, 1),)
    ap.set_auto_parallel_context(full_batch=True, dataset_strategy="full_batch")
    assert ap.get_auto_parallel_context("full_batch") is True


def test_comm_fusion_merges_per_type_and_index_alias():
    ap.set_auto_parallel_context(comm_fusion={"allgather": {"mode": "auto"}})
    ap.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "index", "config": [20, 35]}})
    assert ap.get_auto_parallel_context("comm_fusion") == {
        "allreduce": {"mode": "index", "config": [20, 35]},
        "allgather": {"mode": "auto", "config": None}}
    assert ap.get_auto_parallel_context("all_reduce_fusion_config") == [20, 35]
    ap.set_auto_parallel_context(all_reduce_fusion_config=(1, 2, 3))
    assert ap.get_auto_parallel_context("comm_fusion")["allreduce"] == {
        "mode": "index", "config": [1, 2, 3]}
    ap.set_auto_parallel_context(comm_fusion={"allreduce": None})
    assert ap.get_auto_parallel_context("all_reduce_fusion_config") == []
    ap.set_auto_parallel_context(all_reduce_fusion_config=[4],
                                 comm_fusion={"allreduce": {"mode": "index", "config": [4]},
                                              "reducescatter": {"mode": "size", "config": 2}})
    assert ap.get_auto_parallel_context("comm_fusion") == {
        "allreduce": {"mode": "index", "config": [4]},
        "allgather": {"mode": "auto", "config": None},
        "reducescatter": {"mode": "size", "config": 2}}


def test_parallel_optimizer_config_merges():
    ap.set_auto_parallel_context(parallel_optimizer_config={"parallel_optimizer_threshold": 0})
    ap.set_auto_parallel_context(parallel_optimizer_config={"gradient_accumulation_shard": False})
    assert ap.get_auto_parallel_context("parallel_optimizer_config") == {
        "gradient_accumulation_shard": False, "parallel_optimizer_threshold": 0,
        "optimizer_weight_shard_size": -1, "optimizer_level": None}


def test_reset_restores_defaults():
    before = snapshot()
    ap.set_auto_parallel_context(**{k: v for k, v in ROUND_TRIP.items()
                                    if k not in ("full_batch", "comm_fusion")})
    assert snapshot() != before
    ap.reset_auto_parallel_context()
    assert snapshot() == before


# --------------------------------------------------------------------------- bad inputs
T, V = TypeError, ValueError

BAD_CASES: list[tuple[dict, type, str]] = [
    # unknown keys
    ({"device_nums": 8}, V, "device_nums"),
    ({"foo": 1}, V, "foo"),
    ({"Device_num": 8}, V, "Device_num"),
    ({"hcom_parallel": True}, V, "hcom_parallel"),
    ({"device_num": 8, "bogus": 1}, V, "bogus"),
    ({"comm_fusion": {"alltoall": {"mode": "auto"}}}, V, "alltoall"),
    ({"comm_fusion": {"allreduce": {"mode": "size", "config": 1, "x": 2}}}, V, "x"),
    ({"comm_fusion": {"allreduce": {"config": 32}}}, V, "mode"),
    ({"parallel_optimizer_config": {"threshold": 1}}, V, "threshold"),
    ({"parallel_optimizer_config": {"gradient_accumulation": True}}, V, "gradient_accumulation"),
    # device_num
    ({"device_num": 0}, V, "device_num"),
    ({"device_num": -1}, V, "device_num"),
    ({"device_num": 4097}, V, "device_num"),
    ({"device_num": 2**40}, V, "device_num"),
    ({"device_num": True}, T, "device_num"),
    ({"device_num": 8.0}, T, "device_num"),
    ({"device_num": "8"}, T, "device_num"),
    ({"device_num": None}, T, "device_num"),
    ({"device_num": [8]}, T, "device_num"),
    # global_rank
    ({"global_rank": -1}, V, "global_rank"),
    ({"global_rank": 4096}, V, "global_rank"),
    ({"global_rank": False}, T, "global_rank"),
    ({"global_rank": 1.5}, T, "global_rank"),
    ({"global_rank": "0"}, T, "global_rank"),
    # bools
    ({"gradients_mean": 1}, T, "gradients_mean"),
    ({"gradients_mean": "True"}, T, "gradients_mean"),
    ({"gradients_mean": None}, T, "gradients_mean"),
    ({"gradient_fp32_sync": 0}, T, "gradient_fp32_sync"),
    ({"gradient_fp32_sync": "yes"}, T, "gradient_fp32_sync"),
    ({"loss_repeated_mean": 1.0}, T, "loss_repeated_mean"),
    ({"parameter_broadcast": 1}, T, "parameter_broadcast"),
    ({"parameter_broadcast": []}, T, "parameter_broadcast"),
    ({"full_batch": 1}, T, "full_batch"),
    ({"full_batch": "full_batch"}, T, "full_batch"),
    ({"enable_parallel_optimizer": 1}, T, "enable_parallel_optimizer"),
    ({"enable_parallel_optimizer": None}, T, "enable_parallel_optimizer"),
    ({"enable_alltoall": 0}, T, "enable_alltoall"),
    ({"enable_alltoall": "False"}, T, "enable_alltoall"),
    # parallel_mode
    ({"parallel_mode": "auto"}, V, "parallel_mode"),
    ({"parallel_mode": "AUTO_PARALLEL"}, V, "parallel_mode"),
    ({"parallel_mode": ""}, V, "parallel_mode"),
    ({"parallel_mode": "model_parallel"}, V, "parallel_mode"),
    ({"parallel_mode": 1}, T, "parallel_mode"),
    ({"parallel_mode": None}, T, "parallel_mode"),
    ({"parallel_mode": ["auto_parallel"]}, T, "parallel_mode"),
    # search_mode and the alias
    ({"search_mode": "dp"}, V, "search_mode"),
    ({"search_mode": "exhaustive"}, V, "search_mode"),
    ({"search_mode": "Dynamic_programming"}, V, "search_mode"),
    ({"search_mode": 2}, T, "search_mode"),
    ({"search_mode": None}, T, "search_mode"),
    ({"search_mode": "recursive_programming",
      "auto_parallel_search_mode": "dynamic_programming"}, V, "auto_parallel_search_mode"),
    # strategy files
    ({"strategy_ckpt_load_file": 1}, T, "strategy_ckpt_load_file"),
    ({"strategy_ckpt_load_file": None}, T, "strategy_ckpt_load_file"),
    ({"strategy_ckpt_save_file": b"x.ckpt"}, T, "strategy_ckpt_save_file"),
    ({"strategy_ckpt_save_file": ["a"]}, T, "strategy_ckpt_save_file"),
    # dataset_strategy
    ({"dataset_strategy": "model_parallel"}, V, "dataset_strategy"),
    ({"dataset_strategy": ""}, V, "dataset_strategy"),
    ({"dataset_strategy": ()}, V, "dataset_strategy"),
    ({"dataset_strategy": ((0, 8),)}, V, "dataset_strategy"),
    ({"dataset_strategy": ((1, -2),)}, V, "dataset_strategy"),
    ({"dataset_strategy": ((1, 5000),)}, V, "dataset_strategy"),
    ({"dataset_strategy": [[1, 8]]}, T, "dataset_strategy"),
    ({"dataset_strategy": ([1, 8],)}, T, "dataset_strategy"),
    ({"dataset_strategy": ((1.0, 8),)}, T, "dataset_strategy"),
    ({"dataset_strategy": ((True, 8),)}, T, "dataset_strategy"),
    ({"dataset_strategy": (1, 8)}, T, "dataset_strategy"),
    ({"dataset_strategy": 8}, T, "dataset_strategy"),
    ({"dataset_strategy": None}, T, "dataset_strategy"),
    ({"full_batch": True, "dataset_strategy": "data_parallel"}, V, "full_batch"),
    ({"full_batch": False, "dataset_strategy": "full_batch"}, V, "full_batch"),
    ({"full_batch": True, "dataset_strategy": ((1, 8),)}, V, "full_batch"),
    # parallel_optimizer_config
    ({"parallel_optimizer_config": {"parallel_optimizer_threshold": -1}}, V,
     "parallel_optimizer_threshold"),
    ({"parallel_optimizer_config": {"parallel_optimizer_threshold": 1.5}}, T,
     "parallel_optimizer_threshold"),
    ({"parallel_optimizer_config": {"parallel_optimizer_threshold": True}}, T,
     "parallel_optimizer_threshold"),
    ({"parallel_optimizer_config": {"gradient_accumulation_shard": 1}}, T,
     "gradient_accumulation_shard"),
    ({"parallel_optimizer_config": [("gradient_accumulation_shard", True)]}, T,
     "parallel_optimizer_config"),
    ({"parallel_optimizer_config": None}, T, "parallel_optimizer_config"),
    # all_reduce_fusion_config
    ({"all_reduce_fusion_config": []}, V, "all_reduce_fusion_config"),
    ({"all_reduce_fusion_config": [8, 8]}, V, "all_reduce_fusion_config"),
    ({"all_reduce_fusion_config": [160, 8]}, V, "all_reduce_fusion_config"),
    ({"all_reduce_fusion_config": [-1, 8]}, V, "all_reduce_fusion_config"),
    ({"all_reduce_fusion_config": [8.0, 160]}, T, "all_reduce_fusion_config"),
    ({"all_reduce_fusion_config": [True, 5]}, T, "all_reduce_fusion_config"),
    ({"all_reduce_fusion_config": "8,160"}, T, "all_reduce_fusion_config"),
    ({"all_reduce_fusion_config": 8}, T, "all_reduce_fusion_config"),
    ({"all_reduce_fusion_config": None}, T, "all_reduce_fusion_config"),
    ({"all_reduce_fusion_config": [1, 2],
      "comm_fusion": {"allreduce": {"mode": "size", "config": 4}}}, V,
     "all_reduce_fusion_config"),
    ({"all_reduce_fusion_config": [1, 2],
      "comm_fusion": {"allreduce": {"mode": "index", "config": [1, 3]}}}, V,
     "all_reduce_fusion_config"),
    # pipeline_stages, grad_accumulation_step
    ({"pipeline_stages": 0}, V, "pipeline_stages"),
    ({"pipeline_stages": -2}, V, "pipeline_stages"),
    ({"pipeline_stages": 5000}, V, "pipeline_stages"),
    ({"pipeline_stages": True}, T, "pipeline_stages"),
    ({"pipeline_stages": 2.0}, T, "pipeline_stages"),
    ({"grad_accumulation_step": 0}, V, "grad_accumulation_step"),
    ({"grad_accumulation_step": -1}, V, "grad_accumulation_step"),
    ({"grad_accumulation_step": True}, T, "grad_accumulation_step"),
    ({"grad_accumulation_step": "4"}, T, "grad_accumulation_step"),
    # comm_fusion
    ({"comm_fusion": {"allreduce": {"mode": "size", "config": 0}}}, V, "comm_fusion"),
    ({"comm_fusion": {"allreduce": {"mode": "size", "config": -32}}}, V, "comm_fusion"),
    ({"comm_fusion": {"allreduce": {"mode": "size", "config": float("nan")}}}, V, "comm_fusion"),
    ({"comm_fusion": {"allreduce": {"mode": "size", "config": float("inf")}}}, V, "comm_fusion"),
    ({"comm_fusion": {"allreduce": {"mode": "size", "config": "32"}}}, T, "comm_fusion"),
    ({"comm_fusion": {"allreduce": {"mode": "size", "config": True}}}, T, "comm_fusion"),
    ({"comm_fusion": {"allreduce": {"mode": "size"}}}, T, "comm_fusion"),
    ({"comm_fusion": {"allreduce": {"mode": "sizes", "config": 32}}}, V, "comm_fusion"),
    ({"comm_fusion": {"allreduce": {"mode": 1, "config": 32}}}, T, "comm_fusion"),
    ({"comm_fusion": {"allreduce": {"mode": "auto", "config": 64}}}, V, "comm_fusion"),
    ({"comm_fusion": {"allreduce": {"mode": "index", "config": []}}}, V, "comm_fusion"),
    ({"comm_fusion": {"allreduce": {"mode": "index", "config": [3, 1]}}}, V, "comm_fusion"),
    ({"comm_fusion": {"allreduce": {"mode": "index", "config": 3}}}, T, "comm_fusion"),
    ({"comm_fusion": {"allgather": {"mode": "index", "config": [1, 2]}}}, V, "comm_fusion"),
    ({"comm_fusion": {"reducescatter": {"mode": "index", "config": [1]}}}, V, "comm_fusion"),
    ({"comm_fusion": {"allgather": {"mode": "size", "config": 0}}}, V, "comm_fusion"),
    ({"comm_fusion": {"allgather": "auto"}}, T, "comm_fusion"),
    ({"comm_fusion": {"allreduce": 32}}, T, "comm_fusion"),
    ({"comm_fusion": [("allreduce", {"mode": "auto"})]}, T, "comm_fusion"),
    ({"comm_fusion": "auto"}, T, "comm_fusion"),
    ({"comm_fusion": None}, T, "comm_fusion"),
    # one bad key among good ones: nothing applied
    ({"device_num": 8, "global_rank": 5000}, V, "global_rank"),
    ({"parallel_mode": "auto_parallel", "search_mode": "greedy"}, V, "search_mode"),
    ({"device_num": 16, "pipeline_stages": 2, "gradients_mean": 1}, T, "gradients_mean"),
    ({"comm_fusion": {"allreduce": {"mode": "size", "config": 32}},
      "enable_alltoall": "yes"}, T, "enable_alltoall"),
]


def test_at_least_100_distinct_bad_cases():
    assert len({repr(c) for c in BAD_CASES}) >= 100 and len(BAD_CASES) == len(
        {repr(c) for c in BAD_CASES})


@pytest.mark.parametrize("kwargs,exc,key", BAD_CASES, ids=[repr(c[0])[:60] for c in BAD_CASES])
def test_bad_input_raises_typed_error_and_changes_nothing(kwargs, exc, key):
    ap.set_auto_parallel_context(device_num=4, parallel_mode="semi_auto_parallel",
                                 comm_fusion={"allgather": {"mode": "auto"}})
    before = snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(exc) as info:
            ap.set_auto_parallel_context(**kwargs)
    assert isinstance(info.value, ap.AutoparError)
    assert key in str(info.value), str(info.value)
    assert snapshot() == before
    with pytest.raises(exc):
        with ap.auto_parallel_context(**kwargs):
            pass  # pragma: no cover - never entered
    assert snapshot() == before


def test_unknown_key_lists_valid_keys_and_suggests():
    with pytest.raises(ap.UnknownKeyError) as info:
        ap.set_auto_parallel_context(device_nums=8)
    msg = str(info.value)
    assert "Did you mean 'device_num'" in msg
    for key in ALL_KEYS:
        assert key in msg


def test_get_unknown_or_wrong_type_key():
    with pytest.raises(ValueError, match="nope"):
        ap.get_auto_parallel_context("nope")
    with pytest.raises(TypeError):
        ap.get_auto_parallel_context(3)


def test_message_names_value_and_rule():
    with pytest.raises(ValueError) as info:
        ap.set_auto_parallel_context(device_num=5000)
    msg = str(info.value)
    assert "device_num=5000" in msg and "4096" in msg
    with pytest.raises(TypeError) as info:
        ap.set_auto_parallel_context(device_num=True)
    assert "device_num=True" in str(info.value) and "bool" in str(info.value)
    # numpy's scalars are named with their module (numpy's bool is named "bool")
    import numpy as np
    for key, value, name in (("gradients_mean", np.True_, "numpy.bool"),
                             ("device_num", np.int64(8), "numpy.int64")):
        with pytest.raises(ap.AutoParallelTypeError, match=rf"\(got {name}\)"):
            ap.set_auto_parallel_context(**{key: value})
    # a nested key left out is missing, not None
    with pytest.raises(ap.AutoParallelError, match=r"^comm_fusion.allreduce.mode is missing"):
        ap.set_auto_parallel_context(comm_fusion={"allreduce": {"config": 1}})


# --------------------------------------------------------------------------- hypothesis ranges
@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=-10**6, max_value=10**6))
def test_device_num_range(n):
    before = snapshot()
    if 1 <= n <= 4096:
        ap.set_auto_parallel_context(device_num=n)
        assert ap.get_auto_parallel_context("device_num") == n
    else:
        with pytest.raises(ValueError, match="device_num"):
            ap.set_auto_parallel_context(device_num=n)
        assert snapshot() == before
    ap.reset_auto_parallel_context()


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=-10**5, max_value=10**5))
def test_global_rank_range(n):
    if 0 <= n <= 4095:
        ap.set_auto_parallel_context(global_rank=n)
        assert ap.get_auto_parallel_context("global_rank") == n
    else:
        with pytest.raises(ValueError, match="global_rank"):
            ap.set_auto_parallel_context(global_rank=n)
        assert ap.get_auto_parallel_context("global_rank") == 0
    ap.reset_auto_parallel_context()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["pipeline_stages", "grad_accumulation_step"]),
       st.integers(min_value=-100, max_value=5000))
def test_positive_int_keys(key, n):
    ok = n >= 1 and (key != "pipeline_stages" or n <= 4096)
    if ok:
        ap.set_auto_parallel_context(**{key: n})
        assert ap.get_auto_parallel_context(key) == n
    else:
        with pytest.raises(ValueError, match=key):
            ap.set_auto_parallel_context(**{key: n})
    ap.reset_auto_parallel_context()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=-5, max_value=300), max_size=10))
def test_all_reduce_fusion_config_rule(indices):
    valid = (len(indices) > 0 and all(i >= 0 for i in indices)
             and all(b > a for a, b in zip(indices, indices[1:])))
    if valid:
        ap.set_auto_parallel_context(all_reduce_fusion_config=indices)
        assert ap.get_auto_parallel_context("all_reduce_fusion_config") == indices
    else:
        with pytest.raises(ValueError, match="all_reduce_fusion_config"):
            ap.set_auto_parallel_context(all_reduce_fusion_config=indices)
        assert ap.get_auto_parallel_context("all_reduce_fusion_config") == []
    ap.reset_auto_parallel_context()


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.integers(-100, 1000), st.floats(allow_nan=True, allow_infinity=True),
                 st.just(10**400)),
       st.sampled_from(["allreduce", "allgather", "reducescatter"]))
def test_fusion_size_threshold_rule(threshold, kind):
    spec = {kind: {"mode": "size", "config": threshold}}
    if threshold == threshold and threshold * 2 ** 20 >= 1 and threshold <= MAX_FUSION_MB:
        ap.set_auto_parallel_context(comm_fusion=spec)
        assert ap.get_auto_parallel_context("comm_fusion") == spec
    else:
        with pytest.raises(ValueError, match="comm_fusion"):
            ap.set_auto_parallel_context(comm_fusion=spec)
        assert ap.get_auto_parallel_context("comm_fusion") == {}
    ap.reset_auto_parallel_context()


@settings(max_examples=40, deadline=None)
@given(st.one_of(st.booleans(), st.floats(), st.text(max_size=3), st.none(),
                 st.lists(st.integers(), max_size=2)),
       st.sampled_from(["device_num", "global_rank", "pipeline_stages",
                        "grad_accumulation_step"]))
def test_int_keys_reject_non_ints(value, key):
    with pytest.raises(TypeError, match=key):
        ap.set_auto_parallel_context(**{key: value})
    ap.reset_auto_parallel_context()


@settings(max_examples=40, deadline=None)
@given(st.one_of(st.integers(), st.floats(), st.text(max_size=3), st.none()),
       st.sampled_from(["gradients_mean", "gradient_fp32_sync", "loss_repeated_mean",
                        "parameter_broadcast", "full_batch", "enable_parallel_optimizer",
                        "enable_alltoall"]))
def test_bool_keys_reject_non_bools(value, key):
    with pytest.raises(TypeError, match=key):
        ap.set_auto_parallel_context(**{key: value})
    ap.reset_auto_parallel_context()


# --------------------------------------------------------------------------- scoping and threads
def test_scoped_context_restores_also_on_exception():
    ap.set_auto_parallel_context(device_num=8)
    with ap.auto_parallel_context(device_num=2, parallel_mode="data_parallel") as cfg:
        assert cfg.device_num == 2
        assert ap.get_auto_parallel_context("parallel_mode") == "data_parallel"
        ap.set_auto_parallel_context(global_rank=1)  # inside the block: discarded after
    assert ap.get_auto_parallel_context("device_num") == 8
    assert ap.get_auto_parallel_context("global_rank") == 0
    with pytest.raises(RuntimeError):
        with ap.auto_parallel_context(device_num=4):
            raise RuntimeError("boom")
    assert ap.get_auto_parallel_context("device_num") == 8
    with ap.auto_parallel_context(device_num=4):
        with ap.auto_parallel_context(device_num=2):
            assert ap.get_auto_parallel_context("device_num") == 2
        assert ap.get_auto_parallel_context("device_num") == 4


def test_threads_hold_different_configurations():
    barrier = threading.Barrier(2)
    seen: dict[str, tuple] = {}
    errors: list[BaseException] = []

    def worker(name: str, n: int, mode: str) -> None:
        try:
            ap.set_auto_parallel_context(device_num=n, parallel_mode=mode)
            barrier.wait(timeout=10)  # both have set before either reads
            seen[name] = (ap.get_auto_parallel_context("device_num"),
                          ap.get_auto_parallel_context("parallel_mode"))
        except BaseException as e:  # pragma: no cover - surfaced below
            errors.append(e)

    ap.set_auto_parallel_context(device_num=16)
    threads = [threading.Thread(target=worker, args=("a", 2, "data_parallel")),
               threading.Thread(target=worker, args=("b", 8, "auto_parallel"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert seen == {"a": (2, "data_parallel"), "b": (8, "auto_parallel")}
    assert ap.get_auto_parallel_context("device_num") == 16  # main thread untouched


def test_config_object_is_frozen():
    cfg = ap.context.current_config()
    with pytest.raises(Exception):
        cfg.device_num = 3  # type: ignore[misc]


def test_messages_name_what_was_set():
    """A conflict between keys names them, not the whole configuration; the deprecated alias
    is named as given; a size threshold below one byte is refused when set."""
    with pytest.raises(ap.ContextConflictError) as info:
        ap.set_auto_parallel_context(full_batch=True, dataset_strategy=((2, 1),))
    msg = str(info.value)
    assert msg.startswith("full_batch=True contradicts dataset_strategy") and len(msg) < 200
    with pytest.raises(ap.AutoParallelError) as info:
        ap.set_auto_parallel_context(auto_parallel_search_mode="nope")
    assert str(info.value).startswith("auto_parallel_search_mode='nope' is invalid")
    with pytest.raises(ap.AutoParallelError, match="at least one byte"):
        ap.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "size",
                                                                "config": 1e-9}})
    assert ap.get_auto_parallel_context("comm_fusion") == {}


@pytest.mark.parametrize("call, where", [
    (lambda: ap.set_auto_parallel_context(all_reduce_fusion_config=[1, "a"]), "'a' (str) at [1]"),
    (lambda: ap.set_auto_parallel_context(dataset_strategy=((1, 8), (1, "8"))),
     "'8' (str) at [1][1]"),
    (lambda: ap.set_auto_parallel_context(dataset_strategy=((1, 8), [1, 8])),
     "[1, 8] (list) at [1]"),
    (lambda: ap.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "size",
                                                                     "config": "x"}}),
     "'x' (str) at config"),
    (lambda: ap.set_auto_parallel_context(comm_fusion={3: {}}), "the key 3 (int)"),
    (lambda: ap.hccl.set_split_strategy_by_idx([50, "x"]), "'x' (str) at [1]"),
    (lambda: ap.hccl.set_split_strategy_by_size([50, None]), "None (NoneType) at [1]"),
    (lambda: ap.hccl.create_group("g", [0, 1.0]), "1.0 (float) at [1]"),
    (lambda: check_strategy_shape(((2, 1), (1, "4")), None, "matmul"), "'4' (str) at [1][1]"),
    (lambda: check_strategy_shape(((2, 1), 4), None, "matmul"), "4 (int) at [1]"),
])
def test_type_errors_name_the_offending_element(call, where):
    """Not the container's type: the element's value, its type and its position."""
    before = ap.get_auto_parallel_context("comm_fusion")
    with pytest.raises(ap.AutoParallelTypeError) as info:
        call()
    assert where in str(info.value) and "(got " not in str(info.value)
    assert ap.get_auto_parallel_context("comm_fusion") == before
