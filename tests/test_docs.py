"""Docs are tests: every Python block and every shell command of README.md and docs/*.md runs.

The blocks of one file run in document order, in the test process (8 emulated devices, the
context reset around each file), with the working directory a fresh temporary one so files the
docs write land there:

- Python blocks share one namespace (a later block may use what an earlier one defined). A
  block whose first line is a file-name comment (``# mymodels.py``) is also saved under that
  name, so a later ``autopar --model mymodels:...`` command imports it as the reader's would.
- Shell blocks (``sh``, ``bash``, ``shell``, ``console``): each command (``\\`` continuations
  joined, ``#`` comments dropped) must be an ``autopar`` command; it runs through the CLI's
  ``main`` and must exit 0.

A block right after the line ``<!-- not run: REASON -->`` is skipped (say why: a 60 s
calibration, a second process, the commands CI itself runs).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(<!-- not run: [^>]*-->\s*\n)?```(python|sh|bash|shell|console)\n(.*?)```",
                    re.S)
_FILE_NAME = re.compile(r"#\s*([A-Za-z_]\w*\.py)\s*\n")


class Block(NamedTuple):
    line: int
    language: str  # "python" or "shell"
    source: str


def blocks(path: Path) -> list[Block]:
    """The blocks of ``path`` that run, in document order."""
    text = path.read_text(encoding="utf-8")
    return [Block(text[:m.start(3)].count("\n") + 1,
                  "python" if m.group(2) == "python" else "shell", m.group(3))
            for m in _BLOCK.finditer(text) if not m.group(1)]


def shell_commands(source: str) -> list[list[str]]:
    """The argument lists of a shell block's commands."""
    joined = re.sub(r"\\\n", " ", source)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def _run_python(block: Block, where: str, namespace: dict) -> None:
    named = _FILE_NAME.match(block.source)
    if named:
        Path(named.group(1)).write_text(block.source, encoding="utf-8")
    exec(compile(block.source, where, "exec"), namespace)  # noqa: S102 - the docs' own examples


def _run_shell(block: Block, where: str) -> None:
    from autopar.cli import main

    for argv in shell_commands(block.source):
        if argv[0] != "autopar":
            pytest.fail(f"{where}: {shlex.join(argv)!r} is not an autopar command; run it "
                        "from a test, or put <!-- not run: REASON --> before the block")
        assert main(argv[1:]) == 0, f"{where}: {shlex.join(argv)} failed"


@pytest.mark.parametrize("path", [p for p in DOCS if blocks(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_runs(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = set(sys.modules)
    namespace: dict = {"__name__": "__doc__"}
    try:
        for block in blocks(path):
            where = f"{path.relative_to(ROOT)}:{block.line}"
            if block.language == "python":
                _run_python(block, where, namespace)
            else:
                _run_shell(block, where)
    finally:  # modules the docs wrote (mymodels) must not leak into other tests
        for name in set(sys.modules) - modules:
            if getattr(sys.modules[name], "__file__", "") and \
                    str(sys.modules[name].__file__).startswith(str(tmp_path)):
                del sys.modules[name]
    capsys.readouterr()


def test_shell_commands_are_parsed_as_a_reader_types_them():
    source = ("autopar run --model mlp \\\n    -o layers=2   # two layers\n\n"
              "autopar show plan.json\n")
    assert shell_commands(source) == [["autopar", "run", "--model", "mlp", "-o", "layers=2"],
                                      ["autopar", "show", "plan.json"]]


def test_a_failing_doc_command_fails_the_test(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AssertionError, match="show missing.json failed"):
        _run_shell(Block(1, "shell", "autopar show missing.json\n"), "x.md:1")
    with pytest.raises(pytest.fail.Exception, match="not an autopar command"):
        _run_shell(Block(1, "shell", "rm -rf build\n"), "x.md:1")
