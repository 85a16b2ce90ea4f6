"""Refactors change no plan and no program: golden fingerprints of the zoo's plans and programs.

For each case (a zoo model under one context) the test records the strategy file's bytes, the
lowered StableHLO of ``parallelize`` and of the training step (plain, pipelined) and their
collective counts, as SHA-256 fingerprints in ``tests/golden/programs.json``. Plans are
autopar's own output and must match on any machine. The program text is JAX's: it is compared
when the installed jax is the version the goldens were written with, and otherwise only its
collective counts are (a new jax may spell the same program differently).

Regenerate after an intended change (and say why in the commit):
``AUTOPAR_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax
import pytest

import autopar as ap
from autopar.models import mlp, tfm_stack, transformer

GOLDEN = Path(__file__).resolve().parent / "golden" / "programs.json"
KEY = jax.random.key(0)
_MODELS = {
    "mlp": lambda: mlp(widths=(16, 64, 16), batch=8),
    "tfm_stack": lambda: tfm_stack(blocks=2, batch=2, seq=8, hidden=32, heads=2),
    "transformer": lambda: transformer(layers=2, hidden=32, heads=2, seq=8, vocab=64, batch=8),
}
_AUTO = {"parallel_mode": "auto_parallel", "device_num": 8, "gradients_mean": False}
CASES = {  # name: (model, context, what to lower)
    **{f"{m}/{mode}": (m, {**_AUTO, "search_mode": mode}, ("parallelize", "train"))
       for m in ("mlp", "tfm_stack", "transformer")
       for mode in ("dynamic_programming", "recursive_programming", "sharding_propagation")},
    "transformer/data_parallel": ("transformer", {"parallel_mode": "data_parallel",
                                                  "device_num": 8, "gradients_mean": True},
                                  ("parallelize", "train")),
    "transformer/fused_optimizer": ("transformer", {
        **_AUTO, "comm_fusion": {"allreduce": {"mode": "size", "config": 1}},
        "enable_parallel_optimizer": True,
        "parallel_optimizer_config": {"parallel_optimizer_threshold": 0}}, ("train",)),
    "mlp/pipeline": ("mlp", {"parallel_mode": "semi_auto_parallel", "device_num": 8,
                             "gradients_mean": False, "pipeline_stages": 2}, ("pipeline",)),
}


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:20]


def _first_matmul_split(model, args) -> dict:
    """sharding_propagation's seed: the first matmul's rhs split 8 ways on its free dim."""
    graph = ap.trace(model.loss, *args)
    node = next(n for n in graph.nodes if n.op == "dot_general")
    lhs, rhs = (graph.spec(v).rank for v in node.inputs)
    return {node.name: ((1,) * lhs, (1,) * (rhs - 1) + (8,))}


def _program(kind: str, model, args, fixed: dict | None) -> dict:
    """{text, collectives} of one lowering of ``model`` under the current context."""
    params, *batch = args
    if kind == "parallelize":
        f = ap.parallelize(model.loss, *args, fixed=fixed)
        text, counts = f.as_text(*args), f.collective_counts(*args)
    elif kind == "train":
        step = ap.train_step(model.loss, params, tuple(batch), fixed=fixed)
        state = step.init(params)
        text = step.as_text(params, state, *batch)
        counts = step.collective_counts(params, state, *batch)
    else:
        step = ap.pipeline_train_step(model.loss, params, tuple(batch), micro_batches=4)
        state = step.init(params)
        text = step.as_text(params, state, *batch)
        counts = step.collective_counts(params, state, *batch)
    return {"text": _sha(text), "collectives": counts}


def fingerprint(case: str, tmp_path: Path) -> dict:
    name, context, kinds = CASES[case]
    model = _MODELS[name]()
    args = model.example_args(KEY)
    fixed = _first_matmul_split(model, args) if "propagation" in case else None
    out = {}
    plan_file = tmp_path / "plan.json"
    files = context["parallel_mode"] in ("semi_auto_parallel", "auto_parallel") \
        and "pipeline" not in kinds
    with ap.auto_parallel_context(**context, **(
            {"strategy_ckpt_save_file": str(plan_file)} if files else {})):
        for kind in kinds:
            out[kind] = _program(kind, model, args, fixed)
    if plan_file.exists():
        out["plan"] = _sha(plan_file.read_bytes())
    return out


def _load() -> dict:
    return json.loads(GOLDEN.read_text(encoding="utf-8")) if GOLDEN.exists() else {}


@pytest.mark.parametrize("case", list(CASES))
def test_plans_and_programs_match_the_goldens(case, tmp_path):
    got = fingerprint(case, tmp_path)
    golden = _load()
    if os.environ.get("AUTOPAR_UPDATE_GOLDEN"):
        golden.setdefault("cases", {})[case] = got
        golden["jax"] = jax.__version__
        from autopar.files import write_text_atomic

        write_text_atomic(GOLDEN, json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    want = golden.get("cases", {}).get(case)
    assert want is not None, f"no golden for {case}: run with AUTOPAR_UPDATE_GOLDEN=1"
    assert got.get("plan") == want.get("plan"), f"{case}: the plan changed"
    same_jax = golden.get("jax") == jax.__version__
    for kind in want:
        if kind == "plan":
            continue
        assert got[kind]["collectives"] == want[kind]["collectives"], f"{case} {kind}"
        if same_jax:
            assert got[kind]["text"] == want[kind]["text"], f"{case}: the {kind} program changed"
