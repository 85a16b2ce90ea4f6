"""Shared helpers for benchmarks: device setup, timing, and JSON + markdown output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

RESULTS = Path(__file__).resolve().parent / "results"
#: Where a ``--quick`` run writes (git ignores it): never over the committed full results.
SCRATCH = RESULTS / "quick"
_quick = False


def set_quick(quick: bool) -> None:
    """Send this run's results (and pictures) to :data:`SCRATCH` when ``quick``."""
    global _quick
    _quick = bool(quick)


def out_dir() -> Path:
    """The directory this run writes its results to."""
    return SCRATCH if _quick else RESULTS


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


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |")
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


def replace_between_markers(path: Path, name: str, text: str) -> None:
    """Replace what lies between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in a doc
    (tables of measured figures are written by the benchmark, never copied by hand)."""
    from autopar.files import write_text_atomic

    doc = path.read_text(encoding="utf-8")
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    i, j = doc.find(begin), doc.find(end)
    if i < 0 or j < i:
        raise SystemExit(f"{path}: markers {begin} ... {end} not found")
    write_text_atomic(path, doc[:i + len(begin)] + "\n" + text.strip() + "\n" + doc[j:])
