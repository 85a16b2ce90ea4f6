"""Text for people: plain-text and markdown tables, and the progress bar of long work.

The base layer's one home of aligned text, so planning (:mod:`autopar.strategies.explain`),
calibration, tuning, the mode comparison and the ``autopar`` command print the same way.

>>> print(table([("mode", "ms"), ("exact", "1.50")]))
mode   ms
-----  ----
exact  1.50
>>> print(markdown_table([("mode", "ms"), ("exact", "1.50")]))
| mode | ms |
|---|---|
| exact | 1.50 |
"""

from __future__ import annotations

import sys
import time
from typing import Any, Sequence

__all__ = ["Progress", "markdown_table", "table"]


class Progress:
    """A progress bar on stderr for work that takes more than a second.

    On a terminal it redraws one line (``[#####.....] 3/6 label``); otherwise (CI logs,
    pipes) it prints a line when the work starts and one per finished item, so logs stay
    readable and a long first item does not look like a hang.

    >>> with Progress("search", 2, stream=sys.stdout, tty=False) as bar:
    ...     bar.advance("exact")
    ...     bar.advance("dynamic_programming")
      [0/2] search ...
      [1/2] search: exact
      [2/2] search: dynamic_programming
    """

    def __init__(self, label: str, total: int, *, stream: Any = None,
                 tty: bool | None = None, quiet: bool = False) -> None:
        self.label, self.total, self.done = label, max(1, total), 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.quiet = quiet
        self.t0 = time.perf_counter()

    def __enter__(self) -> "Progress":
        self._draw("")
        return self

    def advance(self, note: str = "") -> None:
        self.done += 1
        self._draw(note)

    def _draw(self, note: str) -> None:
        if self.quiet:
            return
        if self.tty:
            width = 24
            filled = width * self.done // self.total
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r  [{bar}] {self.done}/{self.total} {self.label} "
                              f"{note[:40]:<40} {time.perf_counter() - self.t0:6.1f} s")
            self.stream.flush()
        else:
            line = f"{self.label}: {note}" if self.done else f"{self.label} ..."
            self.stream.write(f"  [{self.done}/{self.total}] {line}\n")
            self.stream.flush()

    def __exit__(self, *exc: Any) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()


def table(rows: Sequence[Sequence[Any]], *, align: str | None = None) -> str:
    """A plain-text table: the first row is the header; ``align`` per column, ``l`` or ``r``
    (default: left for the first column, right for the others)."""
    cells = [[str(c) for c in r] for r in rows]
    n = max(len(r) for r in cells)
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(n)]
    align = align or ("l" + "r" * (n - 1))
    out = []
    for k, r in enumerate(cells):
        parts = [c.rjust(w) if a == "r" and k else c.ljust(w)
                 for c, w, a in zip(r, widths, align)]
        out.append("  ".join(parts).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def markdown_table(rows: Sequence[Sequence[Any]]) -> str:
    """The same rows as a GitHub markdown table."""
    head, *body = [[str(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)
