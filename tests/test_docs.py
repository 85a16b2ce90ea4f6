"""Docs are tests: every Python block of README.md and docs/*.md runs.

The blocks of one file run in order in one namespace (a later block may use what an earlier
one defined), in the test process (8 emulated devices, the context reset around each file),
with the working directory a fresh temporary one so files the docs write land there. A block
right after the line ``<!-- not run: REASON -->`` is skipped (say why: a 60 s calibration, a
second process).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(<!-- not run: [^>]*-->\s*\n)?```python\n(.*?)```", re.S)


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, source) of each block of ``path`` that runs."""
    text = path.read_text(encoding="utf-8")
    return [(text[:m.start(2)].count("\n") + 1, m.group(2)) for m in _BLOCK.finditer(text)
            if not m.group(1)]


@pytest.mark.parametrize("path", [p for p in DOCS if python_blocks(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__doc__"}
    for line, source in python_blocks(path):
        code = compile(source, f"{path.relative_to(ROOT)}:{line}", "exec")
        exec(code, namespace)  # noqa: S102 - the docs' own examples
    capsys.readouterr()
