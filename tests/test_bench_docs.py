"""Tables of measured figures in the docs are written by the benchmarks, never by hand.

For every benchmark that declares ``DOC_TABLES`` (benchmarks/_common.py): each of its marker
pairs is in its doc exactly once, and rendering the committed benchmarks/results JSON gives
the doc's text between the markers byte for byte. A failure means the doc was edited by hand
or the JSON changed without the doc: rerun the benchmark (``python -m benchmarks <name>``).
No JAX here: only the render functions run.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from benchmarks import _common

BENCHMARKS = sorted(m.name for m in pkgutil.iter_modules([str(_common.ROOT / "benchmarks")])
                    if m.name.startswith("bench_"))


def _doc_tables() -> list[tuple[str, str, str, str]]:
    """(benchmark, doc, marker, rendered text) of every declared doc table."""
    out = []
    for name in BENCHMARKS:
        tables = getattr(importlib.import_module(f"benchmarks.{name}"), "DOC_TABLES", None)
        if tables is not None:
            out += [(name, doc, marker, text) for (doc, marker), text in tables.texts().items()]
    return out


TABLES = _doc_tables()


def test_every_doc_writing_benchmark_declares_doc_tables():
    declared = {name for name, *_ in TABLES}
    assert declared == {"bench_checkpoint", "bench_compare", "bench_execute",
                        "bench_fidelity", "bench_fusion", "bench_kernels", "bench_memory",
                        "bench_models", "bench_pipeline", "bench_accelerator",
                        "bench_reliability", "bench_scale", "bench_search", "bench_trace"}


@pytest.mark.parametrize(("bench", "doc", "marker", "text"), TABLES,
                         ids=[f"{doc}:{marker}" for _, doc, marker, _ in TABLES])
def test_doc_table_is_the_rendered_results(bench, doc, marker, text):
    content = (_common.ROOT / doc).read_text(encoding="utf-8")
    for end in ("begin", "end"):
        assert content.count(f"<!-- {marker}:{end} -->") == 1, f"{doc}: <!-- {marker}:{end} -->"
    i, j = _common.marked_span(content, marker)
    assert content[i:j] == _common.marked(text), (
        f"{doc} between the {marker} markers differs from what {bench} renders from "
        f"benchmarks/results: run `python -m benchmarks {bench.removeprefix('bench_')}`")
