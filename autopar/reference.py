"""Markdown reference tables of the context keys and mode restrictions (for docs/context.md).

docs/context.md embeds :func:`context_reference_markdown` between the markers
``<!-- keys:begin -->`` and ``<!-- keys:end -->``; a test keeps the two in sync. Regenerate with
``python -m autopar.reference docs/context.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from autopar.config import reference_rows
from autopar.resolve import RESTRICTIONS

BEGIN, END = "<!-- keys:begin -->", "<!-- keys:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def context_reference_markdown() -> str:
    lines = ["| key | type | default | range / values | modes | description |",
             "|---|---|---|---|---|---|"]
    for r in reference_rows():
        lines.append("| " + " | ".join(_cell(r[c]) for c in
                                        ("key", "type", "default", "range", "modes",
                                         "description")) + " |")
    lines += ["", "Mode restrictions, checked by `autopar.resolve_context()` when a program is "
              "compiled (warnings fire only for keys the user set, except where the value itself "
              "asks for an effect):", "",
              "| key | severity | rule | fix |", "|---|---|---|---|"]
    for x in RESTRICTIONS:
        lines.append(f"| {x.key} | {x.severity} | {_cell(x.rule)} | {_cell(x.fix)} |")
    return "\n".join(lines)


def update(path: Path) -> None:
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{context_reference_markdown()}\n{END}{tail}"
    from autopar.files import write_text_atomic

    write_text_atomic(path, new)


if __name__ == "__main__":
    update(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/context.md"))
