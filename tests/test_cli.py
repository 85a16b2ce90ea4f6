"""The `autopar` command: every subcommand on small models, in-process (fast) and as a new user
runs it (subprocess, the console script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from autopar.cli import main

SMALL_MLP = ["--model", "mlp", "-o", "widths=(16,32,16)", "-o", "batch=8"]
SMALL_TFM = ["--model", "transformer", "-o", "layers=1", "-o", "hidden=32", "-o", "heads=2",
             "-o", "seq=8", "-o", "vocab=64", "-o", "batch=8"]


def run(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def test_demo_end_to_end(tmp_path):
    p = run("demo", "--out", str(tmp_path / "demo"))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "device_num" in out and "auto_parallel" in out
    assert "allreduce fusion" in out and "size, threshold 32 MB" in out
    assert "96.54" in out
    for mode in ("exact", "dynamic_programming", "recursive_programming",
                 "sharding_propagation"):
        assert mode in out
    assert "vs exact" in out and "same plan True, same bytes True" in out
    assert "-> OK" in out  # trained on 8 devices, matched one device
    assert "fp_start" not in out and "iteration" in out
    trace = json.loads((tmp_path / "demo" / "trace.json").read_text())
    assert any(e.get("name") == "bp_end" for e in trace["traceEvents"])
    assert (tmp_path / "demo" / "strategy.json").exists()


def test_console_script_search_and_show(tmp_path):
    exe = Path(sys.executable).parent / "autopar"
    if not exe.exists():
        pytest.skip("console script not installed (pip install -e .)")
    f = tmp_path / "s.json"
    p = subprocess.run([str(exe), "search", *SMALL_MLP, "--devices", "8", "--save", str(f)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "plan[dynamic_programming] on 8 devices" in p.stdout and f.exists()
    p = subprocess.run([str(exe), "show", str(f)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "autopar-strategy" in p.stdout and "tensor_map" in p.stdout


def test_bad_arguments_fail_cleanly(tmp_path):
    p = run("demo", "--devices", "0")
    assert p.returncode == 2 and "--devices" in p.stderr
    p = run("show", str(tmp_path / "missing.json"))
    assert p.returncode == 2 and "missing.json" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------------------- in-process


def test_search_prints_plan_and_saves(tmp_path, capsys):
    f = tmp_path / "plan.json"
    assert main(["search", *SMALL_TFM, "--devices", "4", "--mode", "recursive_programming",
                 "--save", str(f)]) == 0
    out = capsys.readouterr().out
    assert "plan[recursive_programming] on 4 devices" in out and "parameter" in out
    doc = json.loads(f.read_text())
    assert doc["device_num"] == 4 and doc["mode"] == "recursive_programming"
    assert main(["search", *SMALL_TFM, "--devices", "4", "--load", str(f), "--full"]) == 0
    out = capsys.readouterr().out
    assert "loaded from" in out and "dot_general" in out


def test_search_with_a_user_model(tmp_path, capsys, monkeypatch):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import jax.numpy as jnp

        def wide(width=64):
            def loss(p, x):
                return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])
            return loss, ({"w1": jnp.ones((width, 4 * width)),
                           "w2": jnp.ones((4 * width, width))}, jnp.ones((8, width)))
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["search", "--model", "mymodels:wide", "-o", "width=32", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "mymodels:wide(width=32)" in out and "p/w1" in out


def test_compare_writes_json_markdown_png(tmp_path, capsys):
    out_dir = tmp_path / "cmp"
    assert main(["compare", *SMALL_MLP, "--devices", "8", "--out", str(out_dir)]) == 0
    text = capsys.readouterr().out
    assert "vs exact" in text and "sharding_propagation" in text
    doc = json.loads((out_dir / "compare.json").read_text())
    modes = {m["mode"]: m for m in doc["modes"]}
    assert set(modes) == {"exact", "dynamic_programming", "recursive_programming",
                          "sharding_propagation"}
    assert modes["exact"]["ratio_to_exact"] == 1.0
    assert modes["dynamic_programming"]["ratio_to_exact"] == pytest.approx(1.0, abs=1e-9)
    for m in modes.values():
        assert m["ratio_to_exact"] >= 1.0 - 1e-9 and m["collectives"] >= 0
        assert m["memory_bytes"] > 0 and m["search_seconds"] >= 0
    assert "| mode |" in (out_dir / "compare.md").read_text()
    pytest.importorskip("matplotlib")
    assert (out_dir / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_measure(tmp_path, capsys):
    assert main(["compare", *SMALL_MLP, "--devices", "8", "--out", str(tmp_path),
                 "--modes", "dynamic_programming", "exact", "--measure", "--steps", "1"]) == 0
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert all(m["measured_step_seconds"] > 0 for m in doc["modes"])
    assert "measured ms" in capsys.readouterr().out


def test_run_checks_against_one_device(tmp_path, capsys):
    out = tmp_path / "run.json"
    f = tmp_path / "s.json"
    assert main(["run", *SMALL_MLP, "--devices", "8", "--steps", "2", "--check", "--json",
                 str(out), "--save", str(f)]) == 0
    res = json.loads(out.read_text())
    assert res["match"] is True and len(res["losses"]) == 2 and res["processes"] == 1
    assert res["max_param_diff"] <= 1e-4
    assert "-> OK" in capsys.readouterr().out and f.exists()
    assert main(["run", *SMALL_MLP, "--devices", "8", "--steps", "2", "--load", str(f),
                 "--json", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["losses"] == res["losses"] and again["param_sums"] == res["param_sums"]


def test_trace_writes_chrome_trace(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["simulate", *SMALL_TFM, "--devices", "8", "--out", str(out), "--buckets",
                 "hccl"]) == 0
    text = capsys.readouterr().out
    assert "bp_end" in text and "Iteration_end" in text and "iteration" in text
    assert json.loads(out.read_text())["traceEvents"]


def test_show_pretty_prints(tmp_path, capsys):
    f = tmp_path / "s.json"
    assert main(["search", *SMALL_MLP, "--devices", "8", "--save", str(f)]) == 0
    capsys.readouterr()
    assert main(["show", str(f), "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert "fingerprint" in out and "dev_matrix" in out and "more operators" in out


@pytest.mark.parametrize("argv,needle", [
    (["search", "--model", "vgg"], "not a zoo model"),
    (["search", "--model", "mlp", "-o", "layers"], "KEY=VALUE"),
    (["search", "--model", "mlp", "-o", "batch=8", "-o", "batch=16"], "given twice"),
    (["search", "--model", "mlp", "--fix", "layer0/dot_general_0"], "OPERATOR=STRATEGY"),
    (["search", "--model", "mlp", "--fix", "layer0/dot_genral_0=((1, 1), (1, 8))"],
     "did you mean 'layer0/dot_general_0'"),
    (["search", "--model", "mlp", "--fix", "layer0/dot_general_0=((1, 1), (1, 3))"],
     "does not divide"),
    (["search", "--model", "mlp", "-o", "depth=3"], "depth"),
    (["search", "--model", "nosuchmodule_xyz:f"], "cannot import"),
    (["search", "--model", "os:nothing_here"], "no function"),
    (["search", "--model", "os:getcwd"], "must return (fn, example_args)"),
    (["search", "--model", ":f"], "MODULE:FUNCTION"),
    (["run", *SMALL_MLP, "--num-processes", "2"], "--coordinator"),
    (["run", *SMALL_MLP, "--num-processes", "2", "--coordinator", "127.0.0.1:1",
      "--process-id", "5"], "--process-id"),
    (["run", *SMALL_MLP, "--devices", "7", "--num-processes", "2", "--coordinator",
      "127.0.0.1:1", "--process-id", "0"], "divide evenly"),
    (["run", *SMALL_MLP, "--devices", "64"], "devices"),
    (["run", *SMALL_MLP, "--process-id", "0"], "--num-processes > 1"),
    (["run", *SMALL_MLP, "--coordinator", "127.0.0.1:1"], "--num-processes > 1"),
    (["run", *SMALL_MLP, "--parallel-mode", "data_parallel", "--save", "x.json"],
     "--save needs"),
    (["run", *SMALL_MLP, "--atol", "0.1"], "--atol applies with --check only"),
    (["compare", *SMALL_MLP, "--steps", "3"], "--steps applies with --measure only"),
    (["calibrate", "--budget", "1e9"], "in (0, 1e6)"),
    (["search", *SMALL_MLP, "--save", "/dev/stdout"], "leads to a stream"),
])
def test_bad_input_in_process(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_bad_strategy_file_is_a_clean_error(tmp_path, capsys):
    f = tmp_path / "bad.json"
    f.write_text('{"format": "autopar-strategy", "version": 99}')
    assert main(["show", str(f)]) == 2
    err = capsys.readouterr().err
    assert "version" in err and "99" in err
    assert main(["search", *SMALL_MLP, "--load", str(f)]) == 2


def test_show_refuses_a_file_that_contradicts_itself(tmp_path, capsys):
    """A mesh of 12 devices beside device_num 8, a negative predicted step: shown as read."""
    plan = tmp_path / "p.json"
    assert main(["search", *SMALL_MLP, "--save", str(plan)]) == 0
    capsys.readouterr()
    for edit, field in ((lambda d: d["mesh"][0].update(size=3), "'mesh'"),
                        (lambda d: d["predicted"].update(step_seconds=-1.0),
                         "'predicted.step_seconds'")):
        doc = json.loads(plan.read_text())
        edit(doc)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        assert main(["show", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and field in err, err


def test_argparse_rejects_bad_values():
    for argv in (["search", "--model", "mlp", "--devices", "x"],
                 ["search", "--model", "mlp", "--mode", "greedy"],
                 ["compare"], ["nosuchcommand"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def test_python_dash_m_matches_console_script():
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-m", "autopar", "--help"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == 0
    for cmd in ("demo", "search", "compare", "run", "simulate", "show"):
        assert cmd in p.stdout


def test_compare_modes_ignores_strategy_files(tmp_path):
    import jax

    import autopar as ap
    from autopar.models import mlp

    m = mlp(widths=(64, 256, 64), batch=64)
    g = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    f = tmp_path / "s.json"
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  strategy_ckpt_save_file=str(f)):
        ap.search(g, mode="recursive_programming")
        before = f.read_bytes()
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  strategy_ckpt_load_file=str(f), strategy_ckpt_save_file=str(f)):
        rows = ap.compare_modes(g, modes=["exact", "recursive_programming"])
    assert [r.mode for r in rows] == ["exact", "recursive_programming"]
    assert all("loaded from" not in " ".join(r.plan.notes) for r in rows)
    assert f.read_bytes() == before
    with pytest.raises(ap.AutoParallelError, match="unknown search modes"):
        ap.compare_modes(g, modes=["greedy"])
    with pytest.raises(ap.AutoParallelTypeError):
        ap.compare_modes(g, modes="exact")
    with pytest.raises(ap.AutoParallelTypeError):
        ap.compare_modes("graph")


# ---------------------------------------------------------------------------- review fixes


def _plan_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("plan["))


def test_mode_exact_and_every_search_mode_reach_the_search(capsys):
    from autopar.cli import MODES
    from autopar.strategies.modes import SEARCH_MODES

    assert MODES == tuple(SEARCH_MODES)
    assert main(["search", *SMALL_MLP, "--devices", "8", "--mode", "exact"]) == 0
    assert _plan_line(capsys.readouterr().out).startswith("plan[exact] on 8 devices")
    # no --mode: the context's search_mode (dynamic_programming)
    assert main(["search", *SMALL_MLP, "--devices", "8"]) == 0
    assert _plan_line(capsys.readouterr().out).startswith("plan[dynamic_programming]")
    # data_parallel without --mode: no search_mode warning (warnings are errors here)
    assert main(["search", *SMALL_MLP, "--devices", "8", "--parallel-mode",
                 "data_parallel"]) == 0
    assert _plan_line(capsys.readouterr().out).startswith("plan[data_parallel]")


def test_load_prices_on_the_files_cluster(tmp_path, capsys):
    f = tmp_path / "s.json"
    assert main(["search", *SMALL_MLP, "--devices", "8", "--cluster", "cpu-emulated",
                 "--save", str(f)]) == 0
    saved = _plan_line(capsys.readouterr().out)
    assert main(["search", *SMALL_MLP, "--devices", "8", "--load", str(f)]) == 0
    loaded = _plan_line(capsys.readouterr().out)
    assert "cluster cpu-emulated" in loaded
    assert loaded.split(": step ")[1].split(";")[0] == saved.split(": step ")[1].split(";")[0]
    assert main(["search", *SMALL_MLP, "--devices", "8", "--load", str(f), "--mode",
                 "exact"]) == 2
    assert "--mode" in capsys.readouterr().err


def test_save_and_load_outside_auto_modes_are_refused(tmp_path, capsys):
    f = tmp_path / "dp.json"
    for flag in ("--save", "--load"):
        assert main(["search", *SMALL_MLP, "--parallel-mode", "data_parallel", flag,
                     str(f)]) == 2
        err = capsys.readouterr().err
        assert flag in err and "auto_parallel" in err
    assert not f.exists()


@pytest.mark.parametrize("pmode", ["semi_auto_parallel", "data_parallel", "stand_alone"])
def test_mode_outside_auto_parallel_is_refused(pmode, capsys):
    # (the search mode is used under auto_parallel only: it was silently ignored)
    assert main(["search", *SMALL_MLP, "--parallel-mode", pmode, "--mode", "exact"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mode" in err and pmode in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["show", ""], ["search", "--model", "mlp", "--save", ""],
                                  ["search", "--model", "mlp", "--load", ""]])
def test_an_empty_path_is_refused_before_any_work(argv, capsys):
    # (Path("") is ".": refused as a directory only after the whole trace and search)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "expected a file path, got ''" in err and "Traceback" not in err


def test_unwritable_outputs_are_clean_errors(tmp_path, capsys):
    existing = tmp_path / "afile"
    existing.write_text("x")
    assert main(["compare", *SMALL_MLP, "--modes", "dynamic_programming", "--out",
                 str(existing)]) == 2
    err = capsys.readouterr().err
    assert "autopar compare: error:" in err and "afile" in err and "Traceback" not in err
    assert main(["simulate", *SMALL_MLP, "--out", str(tmp_path / "nodir" / "t.json")]) == 2
    err = capsys.readouterr().err
    assert "autopar simulate: error:" in err and "Traceback" not in err


def test_compare_records_the_command_it_was_given(tmp_path):
    argv = ["compare", *SMALL_MLP, "--modes", "dynamic_programming", "--out", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert doc["command"] == "autopar " + " ".join(argv)
    assert doc["cluster"] == "accelerator-8x"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["compare.json", "compare.md"] + (["compare.png"] if (tmp_path / "compare.png").exists()
                                          else []))  # no temporary files left


def test_compare_with_reference_rule():
    from autopar.cli_util import compare_with_reference

    p = {"w": np.ones(3)}
    assert compare_with_reference([2.0, 1.0], p, [2.0, 1.0], p) == (0.0, 0.0, True)
    # a later step's loss off (the old rule scaled every step by the first loss)
    diff, loss_diff, ok = compare_with_reference([100.0, 1.001], p, [100.0, 1.0], p)
    assert not ok and loss_diff == pytest.approx(1e-3)
    assert not compare_with_reference([1.0], {"w": np.ones(3) + 1e-3}, [1.0], p)[2]
    assert not compare_with_reference([1.0], p, [1.0, 1.0], p)[2]  # lengths differ
    # a 16-bit parameter one unit of its last place off (bf16 near 0.125) passes by default,
    # not in float32 nor with --atol 1e-4; so does its loss two units off
    import jax.numpy as jnp

    b16, b16_off = {"w": jnp.full(3, 0.125, jnp.bfloat16)}, {"w": jnp.full(3, 0.126, jnp.bfloat16)}
    assert compare_with_reference([0.4258], b16_off, [0.4277], b16)[2]
    assert not compare_with_reference([0.4258], b16_off, [0.4277], b16, atol=1e-4)[2]
    f32_off = {"w": np.full(3, 0.125 + 9.77e-4, np.float32)}
    assert not compare_with_reference([1.0], f32_off, [1.0], {"w": np.full(3, 0.125)})[2]


def test_demo_restores_the_callers_context(monkeypatch, tmp_path):
    import argparse

    import autopar as ap
    from autopar import demo

    seen = {}

    def fake(args, out, t0):
        seen["device_num"] = ap.get_auto_parallel_context("device_num")
        return 0

    monkeypatch.setattr(demo, "_demo", fake)
    with ap.auto_parallel_context(device_num=2, parallel_mode="data_parallel"):
        assert demo.cmd_demo(argparse.Namespace(devices=8, out=tmp_path, pipeline_stages=2,
                                                cluster="accelerator-8x")) == 0
        assert seen["device_num"] == 8
        assert ap.get_auto_parallel_context("device_num") == 2
        assert ap.get_auto_parallel_context("parallel_mode") == "data_parallel"


def test_calibrate_command_writes_a_loadable_file(tmp_path, capsys, monkeypatch):
    import autopar as ap

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--devices", "2", "--quick", "--budget", "3", "--out",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "calibrated-cpu-2 (calibrated)" in text and "all_reduce" in text
    assert ap.clusters.load_cluster(out).name == "calibrated-cpu-2"
    assert main(["search", *SMALL_MLP, "--cluster", str(out)]) == 0
    assert "cluster calibrated-cpu-2" in capsys.readouterr().out
    assert main(["calibrate", "--budget", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--budget" in err
    # a bad --out is refused before the cache is touched or anything measured
    cached = sorted((tmp_path / "cache").rglob("*"))
    stamps = [p.stat().st_mtime_ns for p in cached]
    assert main(["calibrate", "--devices", "2", "--quick", "--fresh", "--out",
                 str(tmp_path / "nodir" / "c.json")]) == 2
    assert "--out" in capsys.readouterr().err
    assert sorted((tmp_path / "cache").rglob("*")) == cached
    assert [p.stat().st_mtime_ns for p in cached] == stamps


def test_simulate_checks_every_output_before_writing_any(tmp_path, capsys):
    trace = tmp_path / "t.json"
    assert main(["simulate", *SMALL_MLP, "--out", str(trace), "--png",
                 str(tmp_path / "nodir" / "t.png")]) == 2
    assert "--png" in capsys.readouterr().err and not trace.exists()


def test_bad_run_and_demo_options_fail_in_one_line(tmp_path, capsys, monkeypatch):
    for argv in (["run", *SMALL_MLP, "--atol", "-1"], ["run", *SMALL_MLP, "--atol", "nan"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert "--atol" in capsys.readouterr().err
    assert main(["run", *SMALL_MLP, "--num-processes", "2", "--process-id", "0",
                 "--coordinator", "localhost"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HOST:PORT" in err
    assert main(["run", *SMALL_MLP, "--num-processes", "2", "--process-id", "0",
                 "--coordinator", "localhost:\u00b2"]) == 2  # (isdigit, yet not for int())
    assert "HOST:PORT" in capsys.readouterr().err
    assert main(["demo", "--pipeline-stages", "3", "--out", str(tmp_path / "d")]) == 2
    assert "must divide --devices 8" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    (tmp_path / "badmodels.py").write_text(
        "def boom():\n    raise RuntimeError('no data')\n"
        "def untraceable():\n    return (lambda x: x.item() + 1), (1.0,)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, what in (("badmodels:boom", "RuntimeError: no data"),
                       ("badmodels:untraceable", "tracing the function failed"),
                       ("nosuchmodule:f", "cannot import module")):
        assert main(["search", "--model", spec]) == 2
        err = capsys.readouterr().err  # progress lines, then the error on one line
        assert len([x for x in err.splitlines() if "error:" in x]) == 1
        assert what in err and "Traceback" not in err


def test_cli_output_says_what_happened(tmp_path, capsys):
    from autopar.cli import build_parser

    plan = tmp_path / "p.json"
    assert main(["search", *SMALL_MLP, "--full", "--save", str(plan)]) == 0
    out = capsys.readouterr().out
    assert out.count("step ") == 1 and "searched in" in out  # the summary once
    assert main(["search", *SMALL_MLP, "--load", str(plan)]) == 0
    assert f"loaded from {plan} in" in capsys.readouterr().out
    assert main(["show", str(plan)]) == 0
    assert "data input" in capsys.readouterr().out
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, p in sub.choices.items():
        for action in p._actions:
            assert action.help, f"autopar {name} {action.option_strings or action.dest}"
            if "--load" in (action.help or "") and name in ("compare", "simulate"):
                raise AssertionError(f"autopar {name} help mentions --load")


def _one_error_line(capsys, needle: str) -> None:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_user_models_that_fail_give_one_line(tmp_path, capsys, monkeypatch):
    """run printed a traceback when the function failed to trace; a builder's multi-line
    error, its SystemExit(0) (exit 0, nothing done), an option nested too deep to parse
    and a model of no argument escaped as raw errors."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "failing.py").write_text(textwrap.dedent("""
        import jax.numpy as jnp
        def trace_raises():
            def loss(p, x):
                raise KeyError("inside")
            return loss, (jnp.ones((8, 8)), jnp.ones((8, 8)))
        def multiline():
            raise RuntimeError("boom\\nsecond line")
        def exits():
            raise SystemExit(0)
        def no_args():
            return (lambda: jnp.float32(0.0)), ()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [(["run", "--model", "failing:trace_raises", "--steps", "1"],
              "tracing the function failed: KeyError: 'inside'"),
             (["search", "--model", "failing:multiline"], "RuntimeError: boom"),
             (["search", "--model", "failing:exits"], "SystemExit: 0"),
             (["search", "--model", "mlp", "-o", "batch=" + "-" * 3000 + "1"],
              "too deeply nested"),
             (["run", "--model", "failing:no_args", "--steps", "1"], "arguments are empty")]
    for argv, needle in cases:
        assert main([*argv, "--devices", "8", "--cluster", "accelerator-8x"]) == 2
        _one_error_line(capsys, needle)
    assert main(["search", "--model", "failing:no_args", "--mode", "exact"]) == 0


def test_outputs_may_not_name_an_input_or_each_other(tmp_path, capsys):
    """run --load plan.json --json plan.json replaced the strategy file with the report;
    simulate --out t.json --png t.json left a PNG named t.json, both said 'written'."""
    plan = tmp_path / "plan.json"
    assert main(["search", *SMALL_MLP, "--save", str(plan)]) == 0
    before = plan.read_bytes()
    capsys.readouterr()
    assert main(["run", *SMALL_MLP, "--steps", "1", "--load", str(plan), "--json",
                 str(plan)]) == 2
    _one_error_line(capsys, "--json and --load name the same file")
    assert plan.read_bytes() == before
    assert main(["run", *SMALL_MLP, "--steps", "1", "--load", str(plan), "--save",
                 str(plan)]) == 0  # one plan loaded and saved: allowed, as the context's keys
    capsys.readouterr()
    assert main(["search", *SMALL_MLP, "--save", str(tmp_path / "nodir" / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "--save" in err and "nodes" not in err  # refused before the model is traced
    trace = tmp_path / "t.json"
    assert main(["simulate", *SMALL_MLP, "--out", str(trace), "--png", str(trace)]) == 2
    _one_error_line(capsys, "--out and --png name the same file")
    assert not trace.exists()


def test_compare_checks_its_directory_before_any_work(tmp_path, capsys):
    """A directory named compare.md (or a FIFO compare.png) in --out failed only after the
    searches, leaving compare.json (and compare.md) behind."""
    for name, make in (("compare.md", os.mkdir), ("compare.png", os.mkfifo)):
        out = tmp_path / name.replace(".", "_")
        out.mkdir()
        make(out / name)
        assert main(["compare", *SMALL_MLP, "--modes", "dynamic_programming", "--out",
                     str(out)]) == 2
        _one_error_line(capsys, f"--out ({name})")
        assert sorted(p.name for p in out.iterdir()) == [name]
    (tmp_path / "afile").write_text("x")
    assert main(["compare", *SMALL_MLP, "--out", str(tmp_path / "afile")]) == 2
    _one_error_line(capsys, "is not a directory")
    assert main(["compare", *SMALL_MLP, "--out", str(tmp_path / "afile" / "sub")]) == 2
    _one_error_line(capsys, "is not a directory")
    nested = tmp_path / "new" / "results" / "run1"  # made with its parents, as before
    assert main(["compare", *SMALL_MLP, "--modes", "dynamic_programming", "--out",
                 str(nested)]) == 0
    assert (nested / "compare.json").exists()


def test_run_json_is_strict_json_when_the_loss_diverges(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nanmodel.py").write_text(
        "import jax.numpy as jnp\ndef nan_loss():\n"
        "    return (lambda p, x: jnp.sum(x @ p) * jnp.nan), "
        "(jnp.ones((8, 8)), jnp.ones((8, 8)))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    report = tmp_path / "r.json"
    assert main(["run", "--model", "nanmodel:nan_loss", "--devices", "8", "--steps", "1",
                 "--json", str(report)]) == 0
    data = json.loads(report.read_text(), parse_constant=lambda c: pytest.fail(c))
    assert data["losses"] == [None]


def test_calibrate_says_when_nothing_was_cached_and_fresh_replaces_only_on_success(
        tmp_path, capsys, monkeypatch):
    import autopar as ap

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "off")
    assert main(["calibrate", "--devices", "2", "--quick", "--budget", "2"]) == 0
    assert "not cached" in capsys.readouterr().out
    cache = tmp_path / "cache"
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(cache))
    monkeypatch.setattr(ap, "calibrate", lambda *a, **k: (_ for _ in ()).throw(
        KeyboardInterrupt))  # --fresh interrupted while measuring
    ap.clusters.store_calibration(ap.CLUSTERS["cpu-emulated"].model_copy(
        update={"name": "old"}), __import__("jax").devices()[:2])
    files = sorted(cache.rglob("*.json"))
    assert main(["calibrate", "--devices", "2", "--quick", "--fresh"]) == 130
    assert sorted(cache.rglob("*.json")) == files  # the old calibration is kept


def test_gloo_reports_and_their_fragments_leave_stdout_and_python_output_stays():
    """Under jax.distributed on CPU, gloo's C++ threads write connection reports to fd 1 in
    interleaved fragments (a line may be a lone "1"); the CLI's own lines must all remain."""
    code = textwrap.dedent("""
        import os
        from autopar.cli_util import drop_gloo_lines
        print("before")
        drop_gloo_lines()
        os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of ")
        os.write(1, b"connected peer ranks is : 1\\n1\\n\\n")
        print("1")
        os.write(1, b"native line\\n")
        print("row  2.5")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert sorted(out.splitlines()) == ["1", "before", "native line", "row  2.5"]
    # Python's lines in their order (the native line comes when the filter thread passes
    # it: before or after Python's buffered ones)
    assert [x for x in out.splitlines() if x != "native line"] == ["before", "1", "row  2.5"]


def test_argument_errors_are_one_line(capsys):
    for argv in (["search", "--model", "mlp", "--devices", "0"], ["serch"],
                 ["search", "--model", "mlp", "--bogus", "1"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "error:" in err and "--help" in err


def test_an_unforeseen_failure_is_one_line_and_the_debug_switch_shows_it(monkeypatch, capsys):
    import autopar.cli as cli

    def broken(args):
        raise ValueError("a bug\nwith two lines")

    monkeypatch.setitem(cli._JOINS, broken, lambda args: None)  # (no devices needed)
    monkeypatch.setattr(cli, "_distributed", lambda args: None)
    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser(), broken))
    assert main(["show", "x.json"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error: ValueError: a bug" in err
    monkeypatch.setenv("AUTOPAR_DEBUG", "1")
    with pytest.raises(ValueError):
        main(["show", "x.json"])


def _with_func(parser, func):
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    sub.choices["show"].set_defaults(func=func)
    return parser


def test_an_inherited_jax_platforms_does_not_stop_emulated_devices(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cuda"}
    p = subprocess.run([sys.executable, "-m", "autopar", "run", *SMALL_MLP, "--devices", "2",
                        "--steps", "1"], capture_output=True, text=True, timeout=300,
                       env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr


def test_warnings_are_the_commands_lines_and_not_about_its_own_defaults(tmp_path):
    """Under stand_alone the command's parallel defaults (its device count, gradients_mean)
    are not the user's settings: no warning; a real one is one 'autopar run: warning:' line
    (Python's format showed autopar's source line)."""
    base = [sys.executable, "-W", "default", "-m", "autopar", "run", *SMALL_MLP, "--steps", "1"]
    p = subprocess.run([*base, "--parallel-mode", "stand_alone"], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0 and "warning" not in p.stderr.lower(), p.stderr
    assert " on 1 device(s) " in p.stdout
    (tmp_path / "warns.py").write_text(textwrap.dedent("""
        import warnings, jax.numpy as jnp
        def build():
            warnings.warn("this model is an example")
            return (lambda p, x: jnp.mean((x @ p) ** 2)), (jnp.ones((4, 4)), jnp.ones((8, 4)))
    """))
    p = subprocess.run([*base[:6], "--model", "warns:build", "--devices", "2", "--steps", "1"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    warned = [line for line in p.stderr.splitlines() if "warning" in line.lower()]
    assert warned == ["autopar run: warning: this model is an example"], p.stderr


def test_fix_seeds_propagation_and_holds_in_the_plan(capsys, tmp_path):
    f = tmp_path / "p.json"
    assert main(["search", *SMALL_MLP, "--mode", "sharding_propagation", "--save", str(f),
                 "--fix", "layer0/dot_general_0=((1, 1), (1, 8))"]) == 0
    assert "plan[sharding_propagation]" in capsys.readouterr().out
    doc = json.loads(f.read_text())
    entry = doc["parallel_strategy_item"]["layer0/dot_general_0"]
    assert entry["parallel_strategy"] == [[1, 1], [1, 8]]


def test_demo_refuses_a_file_as_its_output_directory_before_any_work(tmp_path, capsys):
    f = tmp_path / "p1.json"
    f.write_text("{}")
    assert main(["demo", "--out", str(f), "--cluster", "accelerator-8x"]) == 2
    err = capsys.readouterr().err
    assert "is not a directory; give a directory" in err and f.read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p1.json"]


def test_demo_checks_its_files_and_cluster_before_any_work(tmp_path, capsys):
    """They were checked after the searches and the training (20 s), leaving a strategy
    file behind; a bad --cluster printed the context and left its directory."""
    out = tmp_path / "d"
    out.mkdir()
    os.mkfifo(out / "trace.json")
    (out / "strategy.json").mkdir()
    for argv, needle in ((["--out", str(out)], "strategy.json"),
                         (["--out", str(tmp_path / "new"), "--cluster", "nosuch"],
                          "unknown cluster")):
        assert main(["demo", *argv]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and needle in captured.err
    (out / "strategy.json").rmdir()
    assert main(["demo", "--out", str(out), "--cluster", "accelerator-8x"]) == 2
    assert "trace.json" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert sorted(p.name for p in out.iterdir()) == ["trace.json"]
    with pytest.raises(SystemExit):
        main(["demo", "--out", ""])
    assert "expected a directory path" in capsys.readouterr().err


def test_inputs_are_checked_before_the_trace(tmp_path, capsys):
    """A bad --cluster or --load file fails before the progress lines of the trace."""
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for argv in (["--cluster", "nosuch"], ["--load", str(bad)]):
        assert main(["search", *SMALL_MLP, *argv]) == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_an_interrupt_while_the_command_loads_is_one_line(monkeypatch, capsys):
    import importlib.abc

    import autopar.__main__ as entry

    class Interrupt(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "autopar.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "autopar.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupt(), *sys.meta_path])
    assert entry.run() == 130
    assert capsys.readouterr().err == "interrupted\n"
