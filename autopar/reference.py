"""Markdown reference tables of the context keys, their effect, the mode restrictions and the
algorithm parameters (for docs/context.md).

docs/context.md embeds each table between a pair of markers, ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` (NAME in :data:`BLOCKS`); a test keeps them in sync. Regenerate with
``python -m autopar.reference docs/context.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from autopar.algo import algo_reference_rows
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


def effects_markdown() -> str:
    """Every key of set_auto_parallel_context and what it does in autopar (on JAX)."""
    lines = ["| key | default | effect in autopar (JAX) |", "|---|---|---|"]
    for r in reference_rows():
        lines.append(f"| `{r['key']}` | {_cell(r['default'])} | {_cell(r['jax'])} |")
    return "\n".join(lines)


def algo_markdown() -> str:
    """Every algorithm parameter (set_algo_parameters) and what it does in autopar."""
    lines = ["| key | type | default | range | description | effect in autopar |",
             "|---|---|---|---|---|---|"]
    for r in algo_reference_rows():
        lines.append("| " + " | ".join(_cell(r[c]) for c in
                                        ("key", "type", "default", "range", "description",
                                         "effect")) + " |")
    return "\n".join(lines)


#: marker name -> the function rendering the block
BLOCKS: dict[str, Callable[[], str]] = {"keys": context_reference_markdown,
                                        "effects": effects_markdown, "algo": algo_markdown}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def render(text: str) -> str:
    """``text`` with every marked block present replaced by its current rendering."""
    for name, make in BLOCKS.items():
        begin, end = markers(name)
        if begin not in text:
            continue
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{make()}\n{end}{tail}"
    return text


def update(path: Path) -> None:
    from autopar.files import write_text_atomic

    write_text_atomic(path, render(path.read_text()))


if __name__ == "__main__":
    update(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/context.md"))
