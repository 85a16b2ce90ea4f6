"""Search modes side by side with measured step times (the `autopar compare --measure` job).

    .venv/bin/python -m benchmarks compare [--quick]

Same as ``autopar compare --model transformer -o layers=2 -o hidden=256 -o heads=8 -o seq=128
-o vocab=1024 -o batch=8 --devices 8 --cluster cpu-emulated --measure --steps 7``: every mode
plans the zoo transformer for 8 emulated devices, each plan is run as a training step, timed
round-robin. Writes benchmarks/results/compare.json (+ the markdown table on stdout).
"""

from __future__ import annotations

import argparse

from benchmarks._common import write_results

_COLUMNS = ["mode", "predicted_ms", "vs_exact", "comm_MB", "collectives", "memory_MiB",
            "search_s", "measured_ms"]


def main(quick: bool = False) -> None:
    from autopar.cli import _measure_all
    from autopar.compare import compare_modes
    from autopar.cli_util import load_model

    import autopar as ap

    opts = dict(layers=1 if quick else 2, hidden=64 if quick else 256, heads=4 if quick else 8,
                seq=16 if quick else 128, vocab=128 if quick else 1024, batch=8)
    fn, ex, desc = load_model("transformer", opts)
    graph = ap.trace(fn, *ex)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        rows = compare_modes(graph, device_num=8, cluster="cpu-emulated")
    _measure_all(fn, ex, rows, graph, 8, 3 if quick else 7)
    out = [{"mode": r.mode, "predicted_ms": r.step_seconds * 1e3,
            "vs_exact": r.ratio_to_exact, "comm_MB": r.comm_bytes / 2**20,
            "collectives": r.collectives, "memory_MiB": r.memory_bytes / 2**20,
            "search_s": r.search_seconds,
            "measured_ms": (r.measured_step_seconds or 0.0) * 1e3} for r in rows]
    write_results("compare" + ("_quick" if quick else ""), out, _COLUMNS,
                  meta={"model": desc, "devices": 8, "cluster": "cpu-emulated",
                        "timing": "median of round-robin steps (one step of each plan per "
                                  "round)"})


if __name__ == "__main__":
    from benchmarks._common import setup_devices

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    a = parser.parse_args()
    setup_devices(8)
    main(quick=a.quick)
