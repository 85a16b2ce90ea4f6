"""The one writer and reader of files: atomic, regular files only, no litter, typed errors."""

from __future__ import annotations

import os
import stat
import time

import pytest

import autopar as ap
from autopar.errors import AutoparError
from autopar.files import STALE_SECONDS, read_bytes_capped, write_text_atomic


def _litter(d) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_special_targets_are_refused_and_untouched(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    stdout = tmp_path / "out.txt"  # /dev/stdout when the output goes to a file: the file
    stdout.symlink_to("/dev/stdout")  # replaced, the output lost (it was written)
    (tmp_path / "dev").symlink_to("/dev/shm")  # dev/../stdout is /dev/stdout
    stream = "leads to a stream"
    for target, why in ((fifo, "not a regular file"), ("/dev/null", "not a regular file"),
                        ("/dev/stdout", stream), ("/proc/self/fd/1", stream), (stdout, stream),
                        (tmp_path / "dev" / ".." / "stdout", stream),
                        (tmp_path, "directory"), (str(tmp_path / "new") + os.sep, "directory"),
                        (str(tmp_path / "a\0b"), "NUL"),
                        (tmp_path / "missing" / "x.json", "does not exist"),
                        (fifo / "x.json", "'.*fifo.json' is not a directory")):
        with pytest.raises(ap.AutoParallelError, match=why) as info:
            write_text_atomic(target, "{}")
        assert ".tmp" not in str(info.value)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and not (tmp_path / "new").exists()
    assert _litter(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_a_regular_file_under_dev_is_written():
    path = f"/dev/shm/autopar-test-{os.getpid()}.json"
    try:
        assert write_text_atomic(path, "{}").read_text() == "{}"
    finally:
        os.unlink(path)


def test_symlinks_are_written_through_and_modes_kept(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    real.chmod(0o600)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_text_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    assert stat.S_IMODE(real.stat().st_mode) == 0o600


def test_a_failed_write_leaves_the_old_file_and_no_litter(tmp_path, monkeypatch):
    path = write_text_atomic(tmp_path / "s.json", "old")

    def boom(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(ap.AutoParallelError, match="No space left") as info:
        write_text_atomic(path, "new")
    assert str(path) in str(info.value)
    assert path.read_text() == "old" and _litter(tmp_path) == []


def test_a_killed_writers_temporaries_are_cleaned_by_the_next_save(tmp_path):
    stale = tmp_path / ".s.json.abc_1234.tmp"  # mkstemp's shape: 8 of [a-z0-9_]
    fresh = tmp_path / ".s.json.def45678.tmp"  # perhaps a writer still at work: kept
    other = tmp_path / ".t.json.abc_1234.tmp"  # another file's: not ours to remove
    users = tmp_path / ".s.json.my backup copy.tmp"  # a user's own file: never ours
    for p in (stale, fresh, other, users):
        p.write_text("partial")
    old = time.time() - STALE_SECONDS - 5
    for p in (stale, other, users):
        os.utime(p, (old, old))
    write_text_atomic(tmp_path / "s.json", "{}")
    assert _litter(tmp_path) == sorted([fresh.name, other.name, users.name])


def test_reading_refuses_special_files_and_oversize(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t0 = time.perf_counter()
    with pytest.raises(ap.AutoParallelError, match="regular file"):
        read_bytes_capped(fifo, 100)  # must not block waiting for a writer
    assert time.perf_counter() - t0 < 30
    with pytest.raises(ap.AutoParallelError, match="regular file"):
        read_bytes_capped("/dev/zero", 100)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(ap.AutoParallelError, match="at most 100 bytes"):
        read_bytes_capped(big, 100)
    assert read_bytes_capped(big, 101) == b"x" * 101


def test_strategy_files_are_read_with_a_cap_and_depth_safe(tmp_path, monkeypatch):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000)
    with pytest.raises(ap.StrategyFileError) as info:
        ap.checkpoint.read_strategy_file(deep)
    assert info.value.field == "<json>"
    monkeypatch.setenv("AUTOPAR_MAX_FILE_BYTES", "1000")
    with pytest.raises(ap.StrategyFileError, match="at most 1000 bytes"):
        ap.checkpoint.read_strategy_file(deep)
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    with pytest.raises(ap.StrategyFileError, match="regular file"):
        ap.checkpoint.read_strategy_file(fifo)
    for value in ("lots", "\u00b2", "9" * 5000):  # (int() refuses both of the last two)
        monkeypatch.setenv("AUTOPAR_MAX_FILE_BYTES", value)
        with pytest.raises(ap.AutoParallelError, match="AUTOPAR_MAX_FILE_BYTES"):
            ap.checkpoint.read_strategy_file(deep)


def test_quick_benchmark_runs_write_to_scratch(monkeypatch, tmp_path, capsys):
    from benchmarks import _common

    monkeypatch.setattr(_common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(_common, "SCRATCH", tmp_path / "results" / "quick")
    _common.set_quick(True)
    try:
        quick = _common.write_results("x", [{"a": 1}], ["a"])
    finally:
        _common.set_quick(False)
    full = _common.write_results("x", [{"a": 2}], ["a"])
    assert quick == tmp_path / "results" / "quick" / "x.json"
    assert full == tmp_path / "results" / "x.json" and quick.read_text() != full.read_text()
    capsys.readouterr()


def test_names_and_contents_the_writer_cannot_take_are_typed_errors(tmp_path):
    from autopar.files import read_bytes_capped, write_bytes_atomic, write_text_atomic

    longest = tmp_path / ("x" * 255)  # the longest legal name: its temporary file still fits
    write_text_atomic(longest, "{}")
    assert longest.read_text() == "{}" and sorted(tmp_path.iterdir()) == [longest]
    for call in (lambda: write_text_atomic(tmp_path / ("x" * 300), "{}"),  # over NAME_MAX
                 lambda: write_text_atomic(tmp_path / "t.json", "\udcff"),
                 lambda: write_bytes_atomic(tmp_path / "b.json", "text"),  # type: ignore
                 lambda: read_bytes_capped(str(tmp_path / "a\0b.json"), 100)):
        with pytest.raises(AutoparError) as info:
            call()
        assert str(tmp_path) in str(info.value)
    assert sorted(tmp_path.iterdir()) == [longest]  # nothing written, nothing left behind
