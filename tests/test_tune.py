"""Measured tuning (autopar/tune.py): the selection rule on given timings, the interleaved
rounds on a fake clock, a real tune of a tiny MLP on 8 devices (the kept step trains like one
device), the measurements saved and reloaded without measuring, the typed errors, the CLI."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
import numerics
from autopar.checkpoint import StrategyFileError, read_strategy_file
from autopar.cli import main
from autopar.models import mlp
from autopar.tune import (Tuning, TuningRow, choose, distinct_plans, measure_rounds,
                          tuned_train_step)

KEY = jax.random.key(0)
AUTO = dict(device_num=8, parallel_mode="auto_parallel", gradients_mean=True)


class CountingClock:
    """A clock that counts its calls (time itself from the real one)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        import time

        self.calls += 1
        return time.perf_counter()


def tiny():
    m = mlp(widths=(16, 64, 16), batch=8)
    params, x = m.example_args(KEY)
    return m, params, x


# ------------------------------------------------------------------ the rule


def test_choose_keeps_the_fastest_measured_not_the_cheapest_priced():
    rows = [TuningRow("dynamic_programming", 0.03, 1.9), TuningRow("megatron tp4", 0.08, 1.7)]
    assert choose(rows) == 1  # priced cheaper, measured slower: the other is kept
    assert choose(rows[::-1]) == 0
    assert choose([TuningRow("a", 0.03, 1.7), TuningRow("b", 0.08, 1.9)]) == 0


def test_choose_on_equal_times_takes_the_cheaper_priced():
    assert choose([TuningRow("a", 0.09, 2.0), TuningRow("b", 0.05, 2.0)]) == 1
    assert choose([TuningRow("a", 0.05, 2.0), TuningRow("b", 0.05, 2.0)]) == 0  # then first
    # nothing measured (one distinct plan): the cheapest priced
    assert choose([TuningRow("a", 0.09, None), TuningRow("b", 0.05, None)]) == 1
    assert choose([TuningRow("a", 0.01, None), TuningRow("b", 0.05, 3.0)]) == 1
    with pytest.raises(ap.AutoParallelError):
        choose([])


def test_rounds_interleave_in_a_seeded_order_and_take_medians():
    now = [0.0]
    order: list[int] = []
    costs = [[3.0, 1.0, 2.0], [5.0, 5.0, 0.5]]  # per runner, per round

    def runner(i):
        def run():
            order.append(i)
            now[0] += costs[i][sum(1 for j in order if j == i) - 1]
        return run

    clock = CountingClock()

    def fake():
        clock()
        return now[0]

    medians = measure_rounds([runner(0), runner(1)], steps=3, clock=fake)
    assert medians == [2.0, 5.0] and clock.calls == 12  # two clock reads per timed run
    assert sorted(order[:2]) == sorted(order[2:4]) == sorted(order[4:]) == [0, 1]
    again: list[int] = []
    order, now[0] = again, 0.0
    measure_rounds([runner(0), runner(1)], steps=3, clock=fake)
    assert again == order  # the same seed, the same order


def test_distinct_plans_drops_a_plan_ranked_twice():
    m, params, x = tiny()
    g = ap.trace(m.loss, params, x)
    ap.set_auto_parallel_context(**AUTO)
    with ap.auto_parallel_context(parallel_mode="data_parallel"):
        dp = ap.search(g)
    auto = ap.search(g)
    picked = distinct_plans([("search", auto), ("data_parallel", dp), ("again", auto)], 3)
    assert [name for name, _ in picked] == ["search", "data_parallel"]
    assert [name for name, _ in distinct_plans(picked, 1)] == ["search"]


# ------------------------------------------------------------------ a real tune


def test_tune_keeps_one_of_two_trains_like_one_device_and_reloads_without_measuring(tmp_path):
    m, params, x = tiny()
    before = jax.tree.map(np.array, params)
    path = tmp_path / "tuned.json"
    clock = CountingClock()
    with ap.auto_parallel_context(strategy_ckpt_save_file=str(path), **AUTO):
        step = tuned_train_step(m.loss, params, (x,), k=2, steps=3, progress=False,
                                clock=clock)
    t = step.tuning
    assert clock.calls == 2 * 2 * 3 and not t.loaded and t.seconds > 0
    assert len(t.rows) == 2 and sum(r.chosen for r in t.rows) == 1
    assert all(r.measured_ms is not None and r.measured_ms > 0 for r in t.rows)
    assert t.rows[0].predicted_ms <= t.rows[1].predicted_ms  # priced order
    assert t.chosen is t.rows[choose(t.rows)]
    assert np.isclose(step.plan.cost.total * 1e3, t.chosen.predicted_ms)
    assert "measured ms" in str(t) and t.chosen.name in str(t)
    jax.tree.map(np.testing.assert_array_equal, params, before)  # the caller's, untouched
    # the kept step trains as one device does (float64 reference)
    ref = numerics.reference(numerics.optimizer_steps(m.loss, steps=1), params, x, jit=False)
    state = step.init(params)
    p1, _, loss = step(params, state, x)
    numerics.check((p1, [loss]), ref)
    # saved with its measurements; loaded back, nothing is measured
    saved = read_strategy_file(path).tuning
    assert saved is not None and [r.name for r in saved.rows] == [r.name for r in t.rows]
    again = CountingClock()
    with ap.auto_parallel_context(strategy_ckpt_load_file=str(path), **AUTO):
        loaded = tuned_train_step(m.loss, params, (x,), k=2, progress=False, clock=again)
        via_api = ap.train_step(m.loss, params, (x,), tune=4)  # any k: the file's stand
    assert again.calls == 0
    for s in (loaded, via_api):
        assert s.tuning.loaded and s.tuning.seconds == 0 and s.tuning.source == str(path)
        assert s.tuning.rows == t.rows
        assert s.plan.nodes == step.plan.nodes and s.plan.layouts == step.plan.layouts


def test_a_reload_saved_again_keeps_the_measurements(tmp_path):
    m, params, x = tiny()
    src, dst = tmp_path / "a.json", tmp_path / "b.json"
    with ap.auto_parallel_context(strategy_ckpt_save_file=str(src), **AUTO):
        tuned_train_step(m.loss, params, (x,), k=2, steps=1, progress=False)
    with ap.auto_parallel_context(strategy_ckpt_load_file=str(src),
                                  strategy_ckpt_save_file=str(dst), **AUTO):
        ap.train_step(m.loss, params, (x,), tune=2)
    assert dst.read_bytes() == src.read_bytes()


def test_untuned_files_keep_their_bytes_and_an_edited_tuning_is_refused(tmp_path):
    m, params, x = tiny()
    g = ap.trace(m.loss, params, x)
    ap.set_auto_parallel_context(**AUTO)
    plan = ap.search(g)
    plain = ap.save_strategy(plan, g, tmp_path / "plain.json")
    assert "tuning" not in json.loads(plain.read_text())
    rows = (TuningRow("dynamic_programming", plan.cost.total * 1e3, 1.0, True),
            TuningRow("data_parallel", 9.0, 2.0))
    record = Tuning(rows, "here", plan.cluster, 3)
    tuned = ap.save_strategy(plan, g, tmp_path / "tuned.json", tuning=record.document())
    doc = json.loads(tuned.read_text())
    assert doc.pop("tuning") == record.document() and doc == json.loads(plain.read_text())
    assert read_strategy_file(tuned).tuning.chosen.name == "dynamic_programming"
    for edit, field in ((lambda d: d["rows"][1].update(chosen=True), "tuning.rows"),
                        (lambda d: d["rows"][0].update(predicted_ms=5.0), "tuning.rows"),
                        (lambda d: d["rows"][0].update(measured_ms=-1.0), "tuning.rows.0")):
        bad = json.loads(tuned.read_text())
        edit(bad["tuning"])
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(StrategyFileError) as e:
            read_strategy_file(tmp_path / "bad.json")
        assert e.value.field.startswith(field), e.value.field
    with pytest.raises(ap.AutoParallelError, match="chosen row must be the plan"):
        ap.save_strategy(plan, g, tmp_path / "x.json", tuning=Tuning(
            rows[::-1], "here", plan.cluster, 3).document() | {"rows": [
                dict(r, chosen=not r["chosen"]) for r in record.document()["rows"]]})


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("tune,error,needle", [
    (True, ap.AutoParallelTypeError, "tune=True"),
    ("2", ap.AutoParallelTypeError, "tune='2'"),
    (2.0, ap.AutoParallelTypeError, "an int in [0, 16]"),
    (-1, ap.AutoParallelError, "must be in [0, 16]"),
    (17, ap.AutoParallelError, "must be in [0, 16]"),
])
def test_bad_tune_values_are_typed_errors(tune, error, needle):
    m, params, x = tiny()
    ap.set_auto_parallel_context(**AUTO)
    with pytest.raises(error) as e:
        ap.train_step(m.loss, params, (x,), tune=tune)
    assert needle in str(e.value)


def test_tune_is_refused_with_pipeline_stages_and_with_a_file_holding_no_measurements(
        tmp_path):
    m, params, x = tiny()
    with ap.auto_parallel_context(pipeline_stages=2, **AUTO):
        with pytest.raises(ap.AutoParallelError, match="pipeline_stages=2"):
            ap.train_step(m.loss, params, (x,), tune=2)
    path = tmp_path / "plain.json"
    with ap.auto_parallel_context(strategy_ckpt_save_file=str(path), **AUTO):
        ap.train_step(m.loss, params, (x,))
    with ap.auto_parallel_context(strategy_ckpt_load_file=str(path), **AUTO):
        with pytest.raises(ap.AutoParallelError, match="no tuning measurements"):
            ap.train_step(m.loss, params, (x,), tune=2)
        assert ap.train_step(m.loss, params, (x,), tune=1).tuning is None  # (1: off)
    with ap.auto_parallel_context(**AUTO):
        with pytest.raises(ap.AutoParallelTypeError, match="clock"):
            tuned_train_step(m.loss, params, (x,), k=2, clock=3)
        with pytest.raises(ap.AutoParallelError, match="steps=0"):
            tuned_train_step(m.loss, params, (x,), k=2, steps=0)


def test_tune_outside_auto_parallel_warns_and_measures_nothing():
    m, params, x = tiny()
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True):
        with pytest.warns(ap.AutoParallelWarning, match="tune=2 is only used by auto_parallel"):
            step = ap.train_step(m.loss, params, (x,), tune=2)
    assert step.tuning is None and step.data_parallel_degree == 8


# ------------------------------------------------------------------ the command


def test_cli_tune_prints_the_table_saves_and_loads(tmp_path, capsys):
    small = ["--model", "mlp", "-o", "widths=(16,32,16)", "-o", "batch=8"]
    path = tmp_path / "plan.json"
    assert main(["tune", *small, "-k", "2", "--steps", "1", "--save", str(path)]) == 0
    out = capsys.readouterr().out
    assert "measured ms" in out and "strategy file written" in out
    assert main(["tune", *small, "-k", "2", "--load", str(path)]) == 0
    assert "loaded from" in capsys.readouterr().out
    assert main(["show", str(path)]) == 0
    assert "measured ms" in capsys.readouterr().out


def test_cli_tune_bad_values_are_one_line(capsys):
    assert main(["tune", "--model", "mlp", "-k", "1"]) == 2  # the API's rule, before any work
    err = capsys.readouterr().err
    assert "k=1 is invalid: must be in [2, 16]" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    for argv, needle in ((["-k", "two"], "invalid int value"), (["--steps", "0"], "--steps")):
        with pytest.raises(SystemExit) as e:  # argparse's own: one line, status 2
            main(["tune", "--model", "mlp", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_only_the_public_face_and_the_command_import_tune():
    """autopar.tune sits on autopar.train: nothing below the entry points may import it."""
    from test_architecture import import_graph

    users = {m for m, deps in import_graph().items() if "autopar.tune" in deps}
    assert users == {"autopar", "autopar.cli"}


def test_train_steps_warnings_point_at_the_callers_line_through_the_tune_facade():
    """autopar.train_step is autopar.tune's: one frame more than autopar.train's."""
    m, params, x = tiny()
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True,
                                  enable_parallel_optimizer=True, parallel_optimizer_config={
                                      "optimizer_weight_shard_size": 3,
                                      "parallel_optimizer_threshold": 0}):
        with pytest.warns(ap.AutoParallelWarning, match="does not divide") as seen:
            ap.train_step(m.loss, params, (x,))
    assert {w.filename for w in seen} == {__file__}


def test_a_tuned_step_returns_the_aux_and_warns_of_an_unset_gradients_mean():
    """has_aux reaches every candidate a tuning builds (each returns ``(loss, aux)``), and the
    tuned path warns of gradients_mean left unset as the untuned one does, at the caller."""
    m, params, x = tiny()

    def with_aux(p, x):
        return m.loss(p, x), {"row_sums": jnp.sum(x, axis=1)}

    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            step = tuned_train_step(with_aux, params, (x,), k=2, steps=1, progress=False,
                                    has_aux=True)
    unset = [w for w in seen if "gradients_mean is not set" in str(w.message)]
    assert len(unset) == (step.data_parallel_degree > 1)
    assert {w.filename for w in unset} <= {__file__}
    assert step.tuning is not None and len(step.tuning.rows) == 2
    value, _ = step.grads(params, x)
    numerics.check(value, numerics.reference(with_aux, params, x))
    _, _, (loss, aux) = step(params, step.init(params), x)
    numerics.check((loss, aux), numerics.reference(with_aux, params, x))
