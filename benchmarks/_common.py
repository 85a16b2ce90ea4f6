"""Shared helpers for benchmarks: device setup, timing, JSON results and the doc tables.

Every ``bench_<name>.py`` has ``main(quick=False)``, which measures and writes its rows with
:func:`write_results`. A benchmark whose figures appear in the docs also declares
``DOC_TABLES = DocTables(results, render)``: ``render`` is a pure function from the saved JSON
payloads (``{name: payload}`` of ``benchmarks/results/<name>.json``) to the markdown of each
doc table, keyed by ``(doc path relative to the repository, marker)``. A full run ends with
``DOC_TABLES.write()``, which replaces the text between ``<!-- marker:begin -->`` and
``<!-- marker:end -->``; a ``--quick`` run never touches the docs. tests/test_bench_docs.py
checks that every doc holds what rendering the committed JSON gives.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: Where a ``--quick`` run writes (git ignores it): never over the committed full results.
SCRATCH = RESULTS / "quick"
_quick = False

#: (doc path relative to the repository, marker name) -> the markdown between the markers.
DocTexts = dict[tuple[str, str], str]


def set_quick(quick: bool) -> None:
    """Send this run's results (and pictures) to :data:`SCRATCH` when ``quick``."""
    global _quick
    _quick = bool(quick)


def out_dir() -> Path:
    """The directory this run writes its results to."""
    return SCRATCH if _quick else RESULTS


def run_main(main: Callable[..., None]) -> None:
    """``python -m benchmarks.bench_<name> [--quick]``: the same as
    ``python -m benchmarks <name> [--quick]``."""
    quick = "--quick" in sys.argv[1:]
    set_quick(quick)
    setup_devices(8)
    main(quick=quick)


def setup_devices(n: int = 8) -> None:
    """Give JAX n emulated CPU devices; call before the first JAX computation."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def timeit(fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of fn() over `repeat` runs after `warmup` runs.

    fn must block until its result is ready (e.g. call .block_until_ready()).
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


@dataclass(frozen=True)
class Col:
    """A column of a markdown table: its header, what a row shows in it (``row[key]``, the key
    defaulting to the header, or ``key(row)``) and the format spec of a number there."""

    header: str
    key: str | Callable[[Mapping[str, Any]], Any] | None = None
    fmt: str | None = None

    def cell(self, row: Mapping[str, Any], fmt: str) -> str:
        v = self.key(row) if callable(self.key) else row.get(self.key or self.header, "")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return str(v)
        if self.fmt is None and isinstance(v, int):
            return str(v)
        return format(v, self.fmt or fmt)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str | Col],
                   fmt: str = ".4g") -> str:
    """One line per row; a column is a row key or a :class:`Col`; floats in ``fmt`` unless
    the column has its own format."""
    cols = [c if isinstance(c, Col) else Col(c) for c in columns]
    lines = ["| " + " | ".join(c.header for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(c.cell(r, fmt) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def write_results(name: str, rows: Sequence[dict[str, Any]], columns: Sequence[str],
                  meta: dict[str, Any] | None = None) -> Path:
    """Print a markdown table and write <out_dir()>/<name>.json (atomically)."""
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform()},
        "meta": meta or {},
        "columns": list(columns),
        "rows": list(rows),
    }
    from autopar.files import write_text_atomic

    path = write_text_atomic(out / f"{name}.json",
                             json.dumps(payload, indent=2, sort_keys=True) + "\n")
    print(f"\n## {name}\n")
    print(markdown_table(rows, columns))
    print(f"\n(written to {path})")
    return path


def marked_span(doc: str, name: str) -> tuple[int, int]:
    """Where the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` lies in doc."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    i, j = doc.find(begin), doc.find(end)
    if i < 0 or j < i:
        raise ValueError(f"markers {begin} ... {end} not found")
    return i + len(begin), j


def marked(text: str) -> str:
    """What a doc holds between its markers for the rendered ``text``."""
    return "\n" + text.strip() + "\n"


def replace_between_markers(path: Path, name: str, text: str) -> None:
    """Replace what lies between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in a doc
    (tables of measured figures are written by the benchmark, never copied by hand)."""
    from autopar.files import write_text_atomic

    doc = path.read_text(encoding="utf-8")
    try:
        i, j = marked_span(doc, name)
    except ValueError as e:
        raise SystemExit(f"{path}: {e}") from None
    write_text_atomic(path, doc[:i] + marked(text) + doc[j:])


def read_results(name: str, directory: Path | None = None) -> dict[str, Any]:
    """The payload :func:`write_results` saved as ``<directory>/<name>.json``."""
    path = (directory or RESULTS) / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class DocTables:
    """The doc tables of one benchmark: ``render`` maps the payloads of the ``results`` it
    reads (``{name: payload}``) to the markdown between each doc's markers."""

    results: tuple[str, ...]
    render: Callable[[dict[str, dict[str, Any]]], DocTexts]

    def texts(self, directory: Path | None = None) -> DocTexts:
        """The tables rendered from the saved JSON in ``directory`` (the committed results)."""
        return self.render({n: read_results(n, directory) for n in self.results})

    def write(self) -> None:
        """After a full run: the docs' tables rendered from the JSON it just wrote. A
        ``--quick`` run leaves the docs alone."""
        if _quick:
            return
        for (doc, marker), text in self.texts(out_dir()).items():
            replace_between_markers(ROOT / doc, marker, text)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (NaN under three points)."""
    import math

    from scipy.stats import spearmanr

    if len(a) < 3:
        return math.nan
    return float(spearmanr(a, b).statistic)
