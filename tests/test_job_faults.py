"""Two-process ``autopar run`` jobs (loopback, gloo) that never form or lose a process: every
process ends within the job's timeout with one error line naming the process and the
reason -- never XLA's abort with a C++ stack (a job that never formed, or a survivor of kill
-9), never a job that SIGTERM cannot stop (JAX's preemption notifier caught it).

Each job runs the CLI with a 5 s timeout (benchmarks/reliability_more.py: the reliability
benchmark's ``jobs`` family, whose harness judges the processes: a non-zero exit, one error
line, no traceback)."""

from __future__ import annotations

import signal
import time

import pytest

from benchmarks import reliability_more as more
from benchmarks.bench_reliability import Refused


def _job_lines(tmp_path, spawn, judged, fault=None) -> str:
    """The judged processes' error lines (the harness raises Refused with them); a process
    that hangs, aborts or says more than one line fails the test."""
    with pytest.raises(Refused) as info:
        more._job(spawn, judged, fault=fault)(tmp_path)
    return str(info.value)


def test_a_job_whose_peer_never_comes_says_so_in_one_line(tmp_path):
    """Process 0 alone aborted after 66 s with 13-20 lines of C++ stack (rc -6)."""
    t0 = time.monotonic()
    line = _job_lines(tmp_path, lambda tmp, port: [more.job_process(tmp, "p0", 0, 2, port)],
                      (0,))
    assert "exit 2" in line and "process(es) [1] did not join process 0" in line, line
    assert time.monotonic() - t0 < more.JOB_TIMEOUT_S + 15


def test_processes_given_different_num_processes_fail_at_once(tmp_path):
    """--num-processes 2 beside 4 aborted within 2 s: now both say which was given what."""
    line = _job_lines(tmp_path, more._pair(n1=4), (0, 1))
    assert line.count("--num-processes: process 1 was given 4, process 0 2") == 2, line


def test_the_survivor_of_a_kill_9_ends_at_once_naming_the_lost_process(tmp_path):
    """It ended in 0.3 s, or after gloo's 30 s timeout, or said nothing for over 60 s (one
    aborted at 94 s with a C++ stack)."""
    line = _job_lines(tmp_path, more._pair(), (1,), fault=(0, signal.SIGKILL))
    assert line.startswith("[1] exit 1: autopar run: error: process 0 ended without "
                           "finishing"), line


def test_sigterm_stops_a_job(tmp_path):
    """JAX's preemption notifier caught SIGTERM: the job trained to the end and exited 0."""
    line = _job_lines(tmp_path, more._pair(), (0, 1), fault=(1, signal.SIGTERM))
    assert "[1] exit 143: autopar run: error: process 1 stopped by SIGTERM" in line, line
    assert "[0] exit 1: autopar run: error: process 1 stopped by SIGTERM; the job cannot go " \
           "on without it" in line, line
