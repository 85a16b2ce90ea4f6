"""The `autopar` command, run as a new user would (subprocess)."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True,
                          text=True, timeout=300)


def test_demo_prints_resolved_configuration():
    p = run("demo")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "device_num" in out and "auto_parallel" in out
    assert "allreduce fusion" in out and "size, threshold 32 MB" in out
    assert "96.54" in out
    assert "dynamic_programming" in out and "vs exact" in out
    assert "-> OK" in out  # the plan ran on 8 devices and matched one device


def test_bad_arguments_fail_cleanly():
    p = run("demo", "--devices", "0")
    assert p.returncode == 2 and "--devices" in p.stderr
    p = run("nosuchcommand")
    assert p.returncode == 2
