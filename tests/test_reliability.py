"""The reliability benchmark (benchmarks/bench_reliability.py): its quick case set finds no
failing case beyond the known defects listed here, and its runner really reports every kind
of failure (an untyped error, accepted bad input, a changed context or split strategy, a
harmed file, litter, a message that names nothing, a CLI traceback, a hang)."""

from __future__ import annotations

import re
import time

import pytest

import autopar as ap
from benchmarks import bench_reliability as br

#: Defects the benchmark found in autopar, not fixed yet: (category, pattern of the case's
#: input). A failing case not listed fails the test; so does a listed defect that no longer
#: fails (it was fixed: delete its line). What went wrong, per case: benchmarks/results/
#: reliability.json, meta.failing.
KNOWN_DEFECTS = [
]


def _known(outcome: br.Outcome) -> bool:
    return any(outcome.case.category == c and re.search(p, outcome.case.label)
               for c, p in KNOWN_DEFECTS)


def test_quick_case_set_fails_only_on_known_defects():
    outcomes = br.run_all(quick=True)
    assert {o.case.category for o in outcomes} == set(br.CATEGORIES) - set(br.skipped())
    assert len(outcomes) > 500
    new = [f"[{o.case.category}] {o.case.label}: {o.problems}" for o in outcomes
           if o.failed and not _known(o)]
    assert not new, "\n".join(new)
    failing = [o for o in outcomes if o.failed]
    fixed = [(c, p) for c, p in KNOWN_DEFECTS if not any(
        o.case.category == c and re.search(p, o.case.label) for o in failing)]
    assert not fixed, f"fixed, delete from KNOWN_DEFECTS: {fixed}"


def _run(case: br.Case) -> br.Outcome:
    (outcome,) = br.run_all(quick=True, cases=[case])
    return outcome


def _typed(tmp):
    raise ap.AutoParallelError("device_num", 0, "probe")


def test_an_untyped_error_fails():
    o = _run(br.Case("probe", "KeyError", lambda tmp: {}["x"], names=("x",)))
    assert o.failed and o.kind == "untyped" and "KeyError" in o.problems[0]
    assert "raised at test_reliability.py:" in o.message  # where, for a reproducer


def test_accepted_bad_input_and_a_wrong_result_fail():
    assert _run(br.Case("probe", "accepts", lambda tmp: 1)).kind == "accepted"
    wrong = _run(br.Case("probe", "wrong", lambda tmp: 1, expect="clean",
                         check=lambda tmp, r: "not what was saved"))
    assert wrong.failed and wrong.kind == "wrong"
    refused = _run(br.Case("probe", "refused", _typed, expect="clean"))
    assert refused.failed and refused.kind == "refused"
    ok = _run(br.Case("probe", "typed", _typed, names=("device_num",)))
    assert not ok.failed and ok.kind == "typed" and ok.named


def test_a_changed_context_or_split_strategy_fails():
    def partial_apply(tmp):
        ap.set_auto_parallel_context(device_num=2)
        _typed(tmp)

    def split(tmp):
        ap.hccl.set_split_strategy_by_size([100])
        _typed(tmp)

    a, b = _run(br.Case("probe", "ctx", partial_apply)), _run(br.Case("probe", "split", split))
    assert a.failed and any("context device_num: 8 -> 2" in s for s in a.state)
    assert b.failed and any("get_split_strategy('hccl_world_group')" in s for s in b.state)


def test_harmed_files_and_litter_fail():
    def harm(tmp):
        (tmp / "s.json").write_text("changed")
        (tmp / ".s.json.x1.tmp").write_text("half")
        (tmp / "gone.json").unlink()
        _typed(tmp)

    o = _run(br.Case("probe", "harm", harm, names=("device_num",),
                     setup=lambda tmp: [(tmp / n).write_text("old")
                                        for n in ("s.json", "gone.json")]))
    assert o.failed and len(o.files) == 3
    assert any("'.s.json.x1.tmp' left behind" in f for f in o.files)
    assert any("'gone.json' removed" in f for f in o.files)


def test_a_message_that_names_nothing_fails():
    o = _run(br.Case("probe", "unnamed", _typed, names=("strategy_ckpt_load_file",)))
    assert o.failed and o.named is False
    assert not br.names_ok(br.Case("p", "l", _typed), "surrogate \udcff")


def test_a_hang_is_cut_off(monkeypatch):
    monkeypatch.setattr(br, "CASE_TIMEOUT_S", 0.2)
    t0 = time.perf_counter()
    o = _run(br.Case("probe", "hang", lambda tmp: time.sleep(10)))
    assert o.kind == "untyped" and "CaseTimeout" in o.message
    assert time.perf_counter() - t0 < 5


def test_cli_verdicts():
    with pytest.raises(br.Refused, match="bad value"):
        br.cli_verdict(2, "", "  [0/1] trace ...\nusage: autopar run [-h]\n          [--x X]\n"
                       "autopar run: error: bad value\n")
    with pytest.raises(RuntimeError, match="traceback"):
        br.cli_verdict(1, "", "Traceback (most recent call last):\n  File x\nValueError: v\n")
    with pytest.raises(RuntimeError, match="not one error line"):
        br.cli_verdict(2, "", "autopar run: error: a\nautopar run: error: b\n")
    with pytest.raises(RuntimeError, match="not one error line"):
        br.cli_verdict(137, "", "")
    assert br.cli_verdict(0, "done", "").startswith("exit 0")


def test_the_callers_context_is_left_alone():
    ap.set_auto_parallel_context(device_num=4)
    _run(br.Case("probe", "typed", _typed))
    assert ap.get_auto_parallel_context("device_num") == 4


def test_summary_rows():
    outcomes = [_run(br.Case("probe", "typed", _typed, names=("device_num",))),
                _run(br.Case("probe", "KeyError", lambda tmp: {}["x"]))]
    row = br.summarize(outcomes)[0]
    assert row == {"category": "probe", "cases": 2, "typed_errors": 1, "clean_ok": 0,
                   "untyped": 1, "accepted_or_wrong": 0, "state_changed": 0,
                   "files_harmed": 0, "names_key_or_file": "1/1", "failing": 1}
