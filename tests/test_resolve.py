"""resolve_context: mode restrictions are reported when compiling, never silently dropped."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import autopar as ap
from autopar.context import public_dict
from autopar.reference import BEGIN, BLOCKS, END, context_reference_markdown, markers

ERRORS = [
    (dict(device_num=4, global_rank=4, parallel_mode="data_parallel"), "global_rank"),
    (dict(device_num=8, parallel_mode="data_parallel", pipeline_stages=2), "pipeline_stages"),
    (dict(device_num=8, parallel_mode="hybrid_parallel", pipeline_stages=2), "pipeline_stages"),
    (dict(device_num=6, parallel_mode="semi_auto_parallel", pipeline_stages=4),
     "divisible by pipeline_stages"),
    (dict(device_num=8, parallel_mode="data_parallel", grad_accumulation_step=2),
     "grad_accumulation_step"),
    (dict(device_num=8, parallel_mode="data_parallel", dataset_strategy=((1, 8),)),
     "dataset_strategy"),
    (dict(device_num=8, parallel_mode="auto_parallel", dataset_strategy=((3, 1),)),
     "must divide device_num"),
]

WARNINGS = [
    (dict(gradients_mean=True), "gradients_mean"),
    (dict(device_num=8, parallel_mode="data_parallel", gradient_fp32_sync=True),
     "gradient_fp32_sync"),
    (dict(device_num=8, parallel_mode="hybrid_parallel", gradient_fp32_sync=False),
     "gradient_fp32_sync"),
    (dict(device_num=8, parallel_mode="data_parallel", loss_repeated_mean=False),
     "loss_repeated_mean"),
    (dict(device_num=8, parallel_mode="semi_auto_parallel", search_mode="recursive_programming"),
     "search_mode"),
    (dict(device_num=8, parallel_mode="data_parallel", full_batch=True), "full_batch"),
    (dict(parameter_broadcast=True), "parameter_broadcast"),
    (dict(enable_parallel_optimizer=True), "enable_parallel_optimizer"),
    (dict(device_num=8, parallel_mode="auto_parallel",
          parallel_optimizer_config={"parallel_optimizer_threshold": 1}),
     "parallel_optimizer_config"),
    (dict(device_num=8, parallel_mode="auto_parallel",
          comm_fusion={"allgather": {"mode": "auto"}}), "comm_fusion"),
    (dict(comm_fusion={"allreduce": {"mode": "auto"}}), "allreduce fusion"),
    (dict(device_num=8, parallel_mode="data_parallel", enable_alltoall=True), "enable_alltoall"),
    (dict(device_num=8, parallel_mode="data_parallel", strategy_ckpt_save_file="s.json"),
     "strategy files"),
    (dict(device_num=8), "stand_alone runs on one device"),
]


@pytest.mark.parametrize("kwargs,text", ERRORS, ids=[t for _, t in ERRORS])
def test_error_restrictions(kwargs, text):
    ap.set_auto_parallel_context(**kwargs)  # each key alone is valid: setting succeeds
    before = public_dict()
    with pytest.raises(ap.ContextConflictError) as info:
        ap.resolve_context()
    assert text in str(info.value)
    assert "Fix:" in str(info.value)
    assert public_dict() == before  # resolving changes nothing


@pytest.mark.parametrize("kwargs,text", WARNINGS, ids=[t for _, t in WARNINGS])
def test_warning_restrictions(kwargs, text):
    ap.set_auto_parallel_context(**kwargs)
    with pytest.warns(ap.AutoParallelWarning, match=text):
        resolved = ap.resolve_context()
    assert any(text in w for w in resolved.warnings)


def test_all_errors_listed_at_once():
    ap.set_auto_parallel_context(device_num=4, global_rank=9, parallel_mode="data_parallel",
                                 pipeline_stages=3, grad_accumulation_step=2)
    with pytest.raises(ap.ContextConflictError) as info:
        ap.resolve_context()
    msg = str(info.value)
    assert msg.startswith("4 conflicting setting(s)")
    for key in ("global_rank", "pipeline_stages", "divisible", "grad_accumulation_step"):
        assert key in msg


@pytest.mark.parametrize("mode", ["stand_alone", "data_parallel", "hybrid_parallel",
                                  "semi_auto_parallel", "auto_parallel"])
def test_clean_configurations_resolve_without_warnings(mode):
    ap.set_auto_parallel_context(device_num=1 if mode == "stand_alone" else 8,
                                 parallel_mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved = ap.resolve_context()
    assert resolved.warnings == ()
    assert resolved.allreduce_fusion.mode == "none"


def test_semi_auto_pipeline_and_defaults_fp32_sync_are_fine():
    ap.set_auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                 pipeline_stages=2, grad_accumulation_step=4,
                                 dataset_strategy=((2, 1), (2, 1)), gradient_fp32_sync=True)
    resolved = ap.resolve_context()
    assert resolved.devices_per_stage == 4


def test_fusion_settings_resolved():
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                 enable_parallel_optimizer=True,
                                 comm_fusion={"allreduce": {"mode": "size", "config": 32},
                                              "allgather": {"mode": "auto"},
                                              "reducescatter": {"mode": "size", "config": 0.5}})
    r = ap.resolve_context()
    assert r.allreduce_fusion.threshold_bytes == 32 * 2**20
    assert r.allgather_fusion.threshold_bytes == 64 * 2**20
    assert r.reducescatter_fusion.threshold_bytes == 2**19
    ap.set_auto_parallel_context(all_reduce_fusion_config=[20, 35])
    r = ap.resolve_context()
    assert (r.allreduce_fusion.mode, r.allreduce_fusion.indices) == ("index", (20, 35))
    assert "index [20, 35]" in r.table()


def test_table_marks_user_keys():
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel")
    table = ap.resolve_context().table()
    line = next(x for x in table.splitlines() if x.startswith("device_num"))
    assert "8" in line and "yes (1)" in line
    line = next(x for x in table.splitlines() if x.startswith("global_rank"))
    assert "yes" not in line


def test_docs_reference_table_is_current():
    text = (Path(__file__).resolve().parents[1] / "docs" / "context.md").read_text()
    embedded = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert embedded == context_reference_markdown().strip(), \
        "docs/context.md is stale: run python -m autopar.reference docs/context.md"
    for name, make in BLOCKS.items():  # the keys' effects and the algorithm parameters too
        begin, end = markers(name)
        assert text.split(begin, 1)[1].split(end, 1)[0].strip() == make().strip(), \
            f"docs/context.md's {name} table is stale: run python -m autopar.reference " \
            "docs/context.md"
