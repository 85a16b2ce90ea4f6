"""MindSpore 2.x at home: the keys 2.3 - 2.5 added to set_auto_parallel_context, ParallelMode,
get_rank / get_group_size. Each key changes the program (tested) or warns why it cannot."""

from __future__ import annotations

import threading
import warnings

import jax.numpy as jnp
import pytest

import autopar as ap
from autopar.hccl import get_group_size, get_rank
from autopar.config import (MINDSPORE_PIPELINE_SCHEDULERS, NO_EFFECT_REASONS,
                            PIPELINE_SCHEDULERS)
from autopar.context import ParallelMode, public_dict
from autopar.pipeline.schedules import SCHEDULES
from autopar.strategies.modes import PARALLEL_MODES

NEW_DEFAULTS = {
    "strategy_ckpt_config": {"load_file": "", "save_file": "", "only_trainable_params": True},
    "pipeline_config": {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"},
    "auto_pipeline": False, "force_fp32_communication": False,
    "pipeline_result_broadcast": False, "group_ckpt_save_file": "", "dump_local_norm": False,
    "dump_local_norm_path": "", "dump_device_local_norm": False,
    # in MindSpore 2.5's key map though not in its documentation
    "pipeline_segments": 1, "communi_parallel_mode": "all_group_parallel",
    "optimizer_weight_shard_aggregated_save": False, "optimizer_weight_shard_size": -1,
}

# key, a value autopar cannot honour, the reason's key in NO_EFFECT_REASONS
NO_EFFECT = [
    ("strategy_ckpt_config", {"only_trainable_params": False},
     "strategy_ckpt_config.only_trainable_params"),
    ("pipeline_config", {"pipeline_interleave": True}, "pipeline_config.pipeline_interleave"),
    ("force_fp32_communication", True, "force_fp32_communication"),
    ("pipeline_result_broadcast", True, "pipeline_result_broadcast"),
    ("group_ckpt_save_file", "./group.ckpt", "group_ckpt_save_file"),
    ("dump_local_norm", True, "dump_local_norm"),
    ("dump_local_norm_path", "./dump", "dump_local_norm_path"),
    ("dump_device_local_norm", True, "dump_device_local_norm"),
    ("pipeline_segments", 2, "pipeline_segments"),
    ("communi_parallel_mode", "no_group_parallel", "communi_parallel_mode"),
    ("optimizer_weight_shard_aggregated_save", True, "optimizer_weight_shard_aggregated_save"),
]

T, V = TypeError, ValueError
BAD = [
    ({"strategy_ckpt_config": "x.json"}, T, "strategy_ckpt_config"),
    ({"strategy_ckpt_config": None}, T, "strategy_ckpt_config"),
    ({"strategy_ckpt_config": {"load_file": 1}}, T, "strategy_ckpt_config.load_file"),
    ({"strategy_ckpt_config": {"save_file": None}}, T, "strategy_ckpt_config.save_file"),
    ({"strategy_ckpt_config": {"only_trainable_params": 1}}, T, "only_trainable_params"),
    ({"strategy_ckpt_config": {"load": "x"}}, V, "load"),
    ({"strategy_ckpt_config": {"load_file": "a"}, "strategy_ckpt_load_file": "b"}, V,
     "strategy_ckpt_load_file"),
    ({"strategy_ckpt_config": {"save_file": "a"}, "strategy_ckpt_save_file": "b"}, V,
     "strategy_ckpt_save_file"),
    ({"pipeline_config": [("pipeline_scheduler", "gpipe")]}, T, "pipeline_config"),
    ({"pipeline_config": {"pipeline_scheduler": "seqpipe"}}, V, "seqpipe"),
    ({"pipeline_config": {"pipeline_scheduler": "zero_bubble_v"}}, V, "zero_bubble_v"),
    ({"pipeline_config": {"pipeline_scheduler": "GPipe"}}, V, "pipeline_scheduler"),
    ({"pipeline_config": {"pipeline_scheduler": 1}}, T, "pipeline_scheduler"),
    ({"pipeline_config": {"pipeline_interleave": "yes"}}, T, "pipeline_interleave"),
    ({"pipeline_config": {"scheduler": "gpipe"}}, V, "scheduler"),
    ({"pipeline_scheduler": "gpipe"}, V, "pipeline_config"),
    ({"pipeline_interleave": True}, V, "pipeline_config"),
    ({"auto_pipeline": 1}, T, "auto_pipeline"),
    ({"force_fp32_communication": "True"}, T, "force_fp32_communication"),
    ({"pipeline_result_broadcast": None}, T, "pipeline_result_broadcast"),
    ({"group_ckpt_save_file": 3}, T, "group_ckpt_save_file"),
    ({"dump_local_norm": 0}, T, "dump_local_norm"),
    ({"dump_local_norm_path": b"dump"}, T, "dump_local_norm_path"),
    ({"dump_device_local_norm": 1.0}, T, "dump_device_local_norm"),
    ({"force_fp32_communication": True, "device_num": 0}, V, "device_num"),
    ({"pipeline_segments": 0}, V, "pipeline_segments"),
    ({"pipeline_segments": True}, T, "pipeline_segments"),
    ({"communi_parallel_mode": "ALL_GROUP_PARALLEL"}, V, "communi_parallel_mode"),
    ({"communi_parallel_mode": 0}, T, "communi_parallel_mode"),
    ({"optimizer_weight_shard_aggregated_save": 1}, T, "optimizer_weight_shard_aggregated_save"),
    ({"optimizer_weight_shard_size": 2.0}, T, "optimizer_weight_shard_size"),
    ({"optimizer_weight_shard_size": True}, T, "optimizer_weight_shard_size"),
    ({"parallel_optimizer_config": {"optimizer_weight_shard_size": 0}}, V,
     "optimizer_weight_shard_size"),
    ({"parallel_optimizer_config": {"optimizer_weight_shard_size": -2}}, V,
     "optimizer_weight_shard_size"),
    ({"parallel_optimizer_config": {"optimizer_level": "level4"}}, V, "optimizer_level"),
    ({"parallel_optimizer_config": {"optimizer_level": 2}}, T, "optimizer_level"),
    ({"parallel_optimizer_config": {"optimizer_level": "level1",
                                    "gradient_accumulation_shard": True}}, V,
     "gradient_accumulation_shard"),
    ({"optimizer_weight_shard_size": 4,
      "parallel_optimizer_config": {"optimizer_weight_shard_size": 2}}, V,
     "optimizer_weight_shard_size"),
    ({"sharding_propagation": 1}, T, "sharding_propagation"),
    ({"sharding_propagation": True, "search_mode": "dynamic_programming"}, V,
     "sharding_propagation"),
]


def test_defaults_are_mindspore_25s():
    d = public_dict()
    assert {k: d[k] for k in NEW_DEFAULTS} == NEW_DEFAULTS


@pytest.mark.parametrize("kwargs,exc,text", BAD, ids=[repr(b[0])[:50] for b in BAD])
def test_bad_input_is_typed_names_the_key_and_changes_nothing(kwargs, exc, text):
    ap.set_auto_parallel_context(strategy_ckpt_config={"save_file": "keep.json"})
    before = public_dict()
    with pytest.raises(exc) as info:
        ap.set_auto_parallel_context(**kwargs)
    assert isinstance(info.value, ap.AutoparError) and text in str(info.value), str(info.value)
    assert public_dict() == before
    with pytest.raises(exc):
        with ap.auto_parallel_context(**kwargs):
            pass  # pragma: no cover - never entered
    assert public_dict() == before


@pytest.mark.parametrize("key,value,reason", NO_EFFECT, ids=[k for k, _, _ in NO_EFFECT])
def test_keys_without_effect_warn_once_per_set_naming_key_and_reason(key, value, reason):
    for _ in range(2):  # every call that sets the key warns once
        with pytest.warns(ap.AutoParallelWarning) as caught:
            ap.set_auto_parallel_context(**{key: value})
        texts = [str(w.message) for w in caught if issubclass(w.category, ap.AutoParallelWarning)]
        assert len(texts) == 1 and texts[0].startswith(key)
        assert NO_EFFECT_REASONS[reason] in texts[0]
    got = ap.get_auto_parallel_context(key)
    assert got == ({**NEW_DEFAULTS[key], **value} if isinstance(value, dict) else value)
    with pytest.warns(ap.AutoParallelWarning, match=key):  # a scoped override too
        with ap.auto_parallel_context(**{key: value}):
            pass


@pytest.mark.parametrize("key", sorted(NEW_DEFAULTS))
def test_default_values_set_silently(key):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ap.set_auto_parallel_context(**{key: NEW_DEFAULTS[key]})
    assert ap.get_auto_parallel_context(key) == NEW_DEFAULTS[key]


def test_every_key_has_its_effect_documented():
    from autopar.config import reference_rows

    rows = {r["key"]: r for r in reference_rows()}
    assert set(public_dict()) <= set(rows)
    assert all(r["jax"] for r in rows.values())
    for reason in NO_EFFECT_REASONS.values():
        assert any(reason in r["jax"] for r in rows.values())


def test_sharding_propagation_is_the_deprecated_form_of_the_search_mode():
    with pytest.warns(DeprecationWarning, match="search_mode='sharding_propagation'"):
        ap.set_auto_parallel_context(sharding_propagation=True)
    assert ap.get_auto_parallel_context("search_mode") == "sharding_propagation"
    assert ap.get_auto_parallel_context("sharding_propagation") is True
    with pytest.warns(DeprecationWarning):
        ap.set_auto_parallel_context(sharding_propagation=False)  # MindSpore ORs the two
    assert ap.get_auto_parallel_context("search_mode") == "sharding_propagation"
    ap.set_auto_parallel_context(search_mode="recursive_programming")
    assert ap.get_auto_parallel_context("sharding_propagation") is False


def test_optimizer_weight_shard_size_is_one_setting_under_two_names():
    ap.set_auto_parallel_context(optimizer_weight_shard_size=4)
    assert ap.get_auto_parallel_context("parallel_optimizer_config")[
        "optimizer_weight_shard_size"] == 4
    ap.set_auto_parallel_context(parallel_optimizer_config={"optimizer_weight_shard_size": 2})
    assert ap.get_auto_parallel_context("optimizer_weight_shard_size") == 2
    for value in (1, 0, -3, -1):  # MindSpore warns and keeps the size (-1 included)
        with pytest.warns(ap.AutoParallelWarning, match="not applied"):
            ap.set_auto_parallel_context(optimizer_weight_shard_size=value)
        assert ap.get_auto_parallel_context("optimizer_weight_shard_size") == 2
    for value in (1, -1):  # in the dict: MindSpore keeps the size (autopar also warns)
        with pytest.warns(ap.AutoParallelWarning, match="not applied"):
            ap.set_auto_parallel_context(
                parallel_optimizer_config={"optimizer_weight_shard_size": value})
        assert ap.get_auto_parallel_context("optimizer_weight_shard_size") == 2
    ap.reset_auto_parallel_context()  # restores the whole group
    assert ap.get_auto_parallel_context("optimizer_weight_shard_size") == -1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the dict's -1 changes nothing here: no warning
        ap.set_auto_parallel_context(parallel_optimizer_config={"optimizer_weight_shard_size": -1})
    assert ap.get_auto_parallel_context("optimizer_weight_shard_size") == -1


def test_comm_fusion_openstate_false_closes_every_type(monkeypatch):
    """MindSpore's comm_fusion['openstate']: False closes fusion of every type; the types
    given are kept, warned as having no effect, and used again once it is True."""
    ap.set_auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                 comm_fusion={"openstate": False,
                                              "allreduce": {"mode": "size", "config": 32}})
    assert ap.get_auto_parallel_context("comm_fusion") == {
        "openstate": False, "allreduce": {"mode": "size", "config": 32}}
    with pytest.warns(ap.AutoParallelWarning, match="openstate.*no effect"):
        resolved = ap.resolve_context()
    assert {resolved.allreduce_fusion.mode, resolved.allgather_fusion.mode} == {"off"}
    grads = [(f"g{i}", 1024) for i in range(5)]
    ap.hccl.set_split_strategy_by_idx([2])  # not used either
    try:
        b = ap.simulation.gradient_buckets(grads)
        assert b.ends == (1, 2, 3, 4, 5) and "openstate" in b.source
        ap.set_auto_parallel_context(comm_fusion={"openstate": True})
        assert ap.simulation.gradient_buckets(grads).ends == (5,)  # 32 MB: one bucket
    finally:
        ap.hccl.reset_comm_groups()
    ap.reset_auto_parallel_context()
    assert ap.get_auto_parallel_context("comm_fusion") == {}
    with pytest.raises(ap.AutoParallelTypeError, match="comm_fusion.openstate=1"):
        ap.set_auto_parallel_context(comm_fusion={"openstate": 1})


@pytest.mark.parametrize("config", [5, 1.5, "12", [1, True], None])
def test_all_reduce_fusion_config_beside_a_bad_index_comm_fusion_is_typed(config):
    """The two names of one setting in one call: a malformed comm_fusion config is a typed
    error (was 'int' object is not iterable), and nothing changes."""
    before = public_dict()
    with pytest.raises(ap.AutoparError) as info:
        ap.set_auto_parallel_context(all_reduce_fusion_config=[1, 2], comm_fusion={
            "allreduce": {"mode": "index", "config": config}})
    assert info.value.key == "all_reduce_fusion_config" and public_dict() == before
    with pytest.raises(ap.AutoParallelTypeError) as info:
        ap.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "index", "config": 5}})
    assert "found 5 (int)" in str(info.value)


@pytest.mark.parametrize("kwargs, key, error", [
    ({"parallel_optimizer_config": {"optimizer_weight_shard_size": True}},
     "parallel_optimizer_config.optimizer_weight_shard_size", ap.AutoParallelTypeError),
    ({"parallel_optimizer_config": {"optimizer_weight_shard_size": 1.0}},
     "parallel_optimizer_config.optimizer_weight_shard_size", ap.AutoParallelTypeError),
    ({"optimizer_weight_shard_size": 1,  # (True == 1: not a contradiction to pass over)
      "parallel_optimizer_config": {"optimizer_weight_shard_size": True}},
     "parallel_optimizer_config.optimizer_weight_shard_size", ap.AutoParallelTypeError),
    ({"optimizer_weight_shard_size": 5000}, "optimizer_weight_shard_size", ap.AutoParallelError),
    ({"parallel_optimizer_config": {"optimizer_level": "level2",
                                    "gradient_accumulation_shard": 1}},
     "parallel_optimizer_config.gradient_accumulation_shard", ap.AutoParallelTypeError),
])
def test_parallel_optimizer_bad_values_name_the_key_given_and_change_nothing(kwargs, key, error):
    before = public_dict()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(error) as e:
            ap.set_auto_parallel_context(**kwargs)
    assert e.value.key == key
    assert public_dict() == before
    assert not seen  # a refused call warns of nothing ("not applied", deprecations)


@pytest.mark.parametrize("kwargs", [{"strategy_ckpt_save_file": "a\0b"},
                                    {"strategy_ckpt_config": {"load_file": "x\0"}}])
def test_a_path_with_a_nul_byte_is_refused_when_set(kwargs):
    before = public_dict()
    with pytest.raises(ap.AutoParallelError, match="NUL"):
        ap.set_auto_parallel_context(**kwargs)
    assert public_dict() == before


def test_a_refused_call_warns_of_nothing():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ap.AutoParallelError):
            ap.set_auto_parallel_context(optimizer_weight_shard_size=0, sharding_propagation=True,
                                         device_num=0)
    assert not seen


def test_optimizer_level_sets_gradient_accumulation_shard():
    for level, shard in (("level2", True), ("level1", False), ("level2", True)):
        ap.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": level})
        cfg = ap.get_auto_parallel_context("parallel_optimizer_config")
        assert cfg["optimizer_level"] == level and cfg["gradient_accumulation_shard"] is shard
    with pytest.warns(ap.AutoParallelWarning, match="level3"):
        ap.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": "level3"})
    assert ap.get_auto_parallel_context("parallel_optimizer_config")[
        "gradient_accumulation_shard"] is False


def test_gradient_accumulation_shard_alone_cannot_contradict_the_level_set_before():
    ap.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": "level2"})
    before = ap.get_auto_parallel_context("parallel_optimizer_config")
    with pytest.raises(ap.AutoParallelError, match="gradient_accumulation_shard=False.*level2"):
        ap.set_auto_parallel_context(
            parallel_optimizer_config={"gradient_accumulation_shard": False})
    assert ap.get_auto_parallel_context("parallel_optimizer_config") == before
    ap.set_auto_parallel_context(parallel_optimizer_config={"gradient_accumulation_shard": True})
    ap.set_auto_parallel_context(parallel_optimizer_config={
        "optimizer_level": "level1", "gradient_accumulation_shard": False})
    assert ap.get_auto_parallel_context("parallel_optimizer_config")[
        "gradient_accumulation_shard"] is False


# --------------------------------------------------------------------------- strategy files
def test_strategy_ckpt_config_and_the_two_keys_are_one_setting():
    ap.set_auto_parallel_context(strategy_ckpt_load_file="a.json")
    assert ap.get_auto_parallel_context("strategy_ckpt_config")["load_file"] == "a.json"
    ap.set_auto_parallel_context(strategy_ckpt_config={"load_file": "b.json",
                                                       "save_file": "c.json"})
    assert ap.get_auto_parallel_context("strategy_ckpt_load_file") == "b.json"  # last wins
    assert ap.get_auto_parallel_context("strategy_ckpt_save_file") == "c.json"
    ap.set_auto_parallel_context(strategy_ckpt_save_file="d.json")
    assert ap.get_auto_parallel_context("strategy_ckpt_config") == {
        "load_file": "b.json", "save_file": "d.json", "only_trainable_params": True}
    ap.set_auto_parallel_context(strategy_ckpt_config={"load_file": ""})  # merges per key
    assert ap.get_auto_parallel_context("strategy_ckpt_load_file") == ""
    assert ap.get_auto_parallel_context("strategy_ckpt_save_file") == "d.json"
    # both names in one call: they must agree
    ap.set_auto_parallel_context(strategy_ckpt_config={"save_file": "e.json"},
                                 strategy_ckpt_save_file="e.json")
    assert ap.context.current_config().strategy_ckpt_save_file == "e.json"
    with ap.auto_parallel_context(strategy_ckpt_save_file=""):  # the pipeline's per-stage use
        assert ap.get_auto_parallel_context("strategy_ckpt_config")["save_file"] == ""
    assert ap.get_auto_parallel_context("strategy_ckpt_config")["save_file"] == "e.json"
    ap.reset_auto_parallel_context()
    assert ap.get_auto_parallel_context("strategy_ckpt_config") == \
        NEW_DEFAULTS["strategy_ckpt_config"]


def _graph():
    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"]))

    return ap.trace(loss, {"w": jnp.ones((16, 32))}, jnp.ones((8, 16)))


def test_strategy_ckpt_config_saves_and_loads_the_plan(tmp_path):
    g = _graph()
    saved = tmp_path / "stra1.json"
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  strategy_ckpt_config={"save_file": str(saved)}):
        plan = ap.search(g, fixed={"dot_general_0": ((1, 8), (8, 1))})
    assert saved.is_file()
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  strategy_ckpt_config={"load_file": str(saved)}):
        loaded = ap.search(g)  # loaded, not searched: the fixed strategy comes back
    assert loaded.nodes["dot_general_0"].strategy == ((1, 8), (8, 1))
    assert (loaded.nodes, loaded.cost) == (plan.nodes, plan.cost)
    # the later name wins: the flat key points the load elsewhere
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  strategy_ckpt_config={"load_file": str(saved)}):
        ap.set_auto_parallel_context(strategy_ckpt_load_file=str(tmp_path / "missing.json"))
        with pytest.raises(ap.AutoParallelError, match="missing.json"):
            ap.search(g)


# --------------------------------------------------------------------------- pipeline_config
def test_pipeline_config_selects_autopars_schedule():
    ap.set_auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                 pipeline_stages=2)
    assert ap.resolve_context().pipeline_schedule == "1f1b"  # MindSpore's default
    ap.set_auto_parallel_context(pipeline_config={"pipeline_scheduler": "gpipe"})
    r = ap.resolve_context()
    assert r.pipeline_schedule == "gpipe" and "pipeline schedule" in r.table()
    assert ap.get_auto_parallel_context("pipeline_scheduler") == "gpipe"
    assert ap.get_auto_parallel_context("pipeline_interleave") is False
    ap.set_auto_parallel_context(pipeline_config={"pipeline_scheduler": "1f1b"})
    assert ap.resolve_context().pipeline_schedule == "1f1b"


def test_pipeline_schedules_match_autopars():
    assert set(PIPELINE_SCHEDULERS.values()) == set(SCHEDULES)
    assert set(PIPELINE_SCHEDULERS) <= set(MINDSPORE_PIPELINE_SCHEDULERS)
    from autopar.pipeline.schedules import schedule

    for name in PIPELINE_SCHEDULERS.values():
        assert schedule(name, 2, 4).name == name


@pytest.mark.parametrize("name", [n for n in MINDSPORE_PIPELINE_SCHEDULERS
                                  if n not in PIPELINE_SCHEDULERS])
def test_unsupported_mindspore_schedules_are_refused_naming_the_supported(name):
    with pytest.raises(ap.AutoParallelError) as info:
        ap.set_auto_parallel_context(pipeline_config={"pipeline_scheduler": name})
    msg = str(info.value)
    assert "pipeline_config.pipeline_scheduler" in msg and repr(name) in msg
    assert "'1f1b'" in msg and "'gpipe'" in msg


def test_pipeline_config_without_stages_warns_when_compiling():
    ap.set_auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                 pipeline_config={"pipeline_scheduler": "gpipe"})
    with pytest.warns(ap.AutoParallelWarning, match=r"\[pipeline_config\]"):
        ap.resolve_context()


# --------------------------------------------------------------------------- ParallelMode
def test_parallel_mode_constants_are_the_mode_strings():
    assert ParallelMode.MODE_LIST == PARALLEL_MODES
    for mode in PARALLEL_MODES:
        assert getattr(ParallelMode, mode.upper()) == mode
    assert (ParallelMode.STAND_ALONE, ParallelMode.DATA_PARALLEL, ParallelMode.HYBRID_PARALLEL,
            ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL) == PARALLEL_MODES
    ap.set_auto_parallel_context(parallel_mode=ParallelMode.AUTO_PARALLEL)
    assert ap.get_auto_parallel_context("parallel_mode") == ParallelMode.AUTO_PARALLEL


# --------------------------------------------------------------------------- get_rank
def test_get_rank_and_group_size_as_mindspore_communication():
    ap.set_auto_parallel_context(device_num=8, global_rank=5)
    assert (get_rank(), get_group_size()) == (5, 8)
    for world in ("hccl_world_group", "nccl_world_group", "mccl_world_group"):
        assert (get_rank(world), get_group_size(world)) == (5, 8)
    ap.hccl.create_group("tp1", [7, 5, 6])
    assert (get_rank(group="tp1"), get_group_size(group="tp1")) == (1, 3)
    ap.hccl.create_group("other", [0, 1])
    assert get_group_size("other") == 2
    with pytest.raises(ap.CommGroupError, match="not a member"):
        get_rank("other")
    with pytest.raises(ap.CommGroupError, match="no such group"):
        get_group_size("nope")
    with pytest.raises(ap.AutoParallelTypeError, match="group"):
        get_rank(3)  # type: ignore[arg-type]


def test_get_rank_follows_each_threads_context():
    seen = {}

    def worker(rank: int) -> None:
        ap.set_auto_parallel_context(device_num=4, global_rank=rank)
        seen[rank] = (get_rank(), get_group_size())

    threads = [threading.Thread(target=worker, args=(r,)) for r in (1, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {1: (1, 4), 3: (3, 4)} and get_rank() == 0
