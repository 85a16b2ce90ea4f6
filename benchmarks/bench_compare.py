"""Search modes side by side with measured step times (the `autopar compare --measure` job).

    .venv/bin/python -m benchmarks compare [--quick]

Same as ``autopar compare --model transformer -o layers=2 -o hidden=256 -o heads=8 -o seq=128
-o vocab=1024 -o batch=8 --devices 8 --cluster calibrated --measure --steps 7``: every mode
plans the zoo transformer for 8 emulated devices on this machine's calibration, each plan is
run as a training step, timed round-robin. Writes benchmarks/results/compare.json, the table
between the ``compare`` markers of docs/cli.md and docs/compare_modes.png (full runs only).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks._common import (
    DocTables,
    DocTexts,
    markdown_table,
    run_main,
    write_results,
)

_COLUMNS = ["mode", "predicted_ms", "vs_exact", "comm_MB", "collectives", "memory_MiB",
            "search_s", "measured_ms"]


def doc_tables(results: dict[str, dict]) -> DocTexts:
    """docs/cli.md's ``compare`` table, from compare.json."""
    payload = results["compare"]
    return {("docs/cli.md", "compare"): markdown_table(payload["rows"], _COLUMNS) + (
        f"\n\n(`predicted_ms`: the cost model on `{payload['meta']['cluster']}`; "
        "`measured_ms`: median of 7 round-robin training steps; `python -m benchmarks compare` "
        "wrote this table.)")}


DOC_TABLES = DocTables(("compare",), doc_tables)


def main(quick: bool = False) -> None:
    import autopar as ap
    from autopar.cli import _measure_all
    from autopar.cli_util import load_model
    from autopar.compare import compare_modes

    opts = {"layers": 1 if quick else 2, "hidden": 64 if quick else 256,
            "heads": 4 if quick else 8, "seq": 16 if quick else 128,
            "vocab": 128 if quick else 1024, "batch": 8}
    fn, ex, desc = load_model("transformer", opts)
    graph = ap.trace(fn, *ex)
    cluster = ap.calibrate(8)  # this machine (cached after the first run)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        rows = compare_modes(graph, device_num=8, cluster=cluster)
    _measure_all(fn, ex, rows, graph, 8, 3 if quick else 7)
    out = [{"mode": r.mode, "predicted_ms": r.step_seconds * 1e3,
            "vs_exact": r.ratio_to_exact, "comm_MB": r.comm_bytes / 2**20,
            "collectives": r.collectives, "memory_MiB": r.memory_bytes / 2**20,
            "search_s": r.search_seconds,
            "measured_ms": (r.measured_step_seconds or 0.0) * 1e3} for r in rows]
    meta = {"model": desc, "devices": 8, "cluster": cluster.name,
            "timing": "median of round-robin steps (one step of each plan per round)"}
    write_results("compare", out, _COLUMNS, meta=meta)
    if quick:
        return
    from autopar.compare import write_comparison
    from autopar.files import write_bytes_atomic
    from benchmarks._common import ROOT, out_dir

    paths = write_comparison(rows, out_dir() / "compare", meta=meta, title=(
        f"search modes: {desc} on 8 devices, cluster {cluster.name}"))
    if "png" in paths:
        write_bytes_atomic(ROOT / "docs" / "compare_modes.png", Path(paths["png"]).read_bytes())
    DOC_TABLES.write()


if __name__ == "__main__":
    run_main(main)
