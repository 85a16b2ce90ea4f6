"""Time to trace the zoo transformer (and the ANCHORS tfmN stack) into autopar's graph.

Goal (issue 3): 96 transformer layers traced in under 5 s on this machine. ``make_jaxpr`` is
JAX's own cost; ``build`` is autopar's walk over the jaxpr; both are reported.
"""

from __future__ import annotations

import time

from benchmarks._common import (
    Col,
    DocTables,
    DocTexts,
    markdown_table,
    run_main,
    write_results,
)

_DOC_COLUMNS = ("model", "layers", Col("nodes", fmt=","),
                Col("cold s (first trace in the process)", "cold_s", ".2f"),
                Col("warm s", "warm_s", ".2f"))


def doc_tables(results: dict[str, dict]) -> DocTexts:
    """docs/graph.md's ``trace`` table, from trace.json."""
    return {("docs/graph.md", "trace"): markdown_table(results["trace"]["rows"], _DOC_COLUMNS)}


DOC_TABLES = DocTables(("trace",), doc_tables)


def _measure(model, repeat: int) -> dict:
    """cold: first trace in this process; warm: best of `repeat` more (JAX caches warm)."""
    import jax

    import autopar

    args = model.example_args(jax.random.key(0))
    t0 = time.perf_counter()
    g = autopar.trace(model.loss, *args)
    cold = time.perf_counter() - t0
    warm, jaxpr = float("inf"), float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.make_jaxpr(model.loss)(*args)
        t1 = time.perf_counter()
        autopar.trace(model.loss, *args)
        t2 = time.perf_counter()
        jaxpr, warm = min(jaxpr, t1 - t0), min(warm, t2 - t1)
    return {"nodes": len(g.nodes), "params": len(g.parameters()), "cold_s": cold,
            "warm_s": warm, "make_jaxpr_s": jaxpr, "build_s": max(warm - jaxpr, 0.0)}


def main(quick: bool = False) -> None:
    from autopar.models import tfm_stack, transformer

    rows = []
    layers = (2, 4) if quick else (12, 48, 96)
    for n in layers:
        m = transformer(layers=n, hidden=256, heads=8, seq=128, vocab=1024, batch=8)
        r = _measure(m, 1 if quick else 3)
        rows.append({"model": "transformer", "layers": n, **r,
                     "goal_s": 5.0 if n == 96 else "", "meets_goal": (r["cold_s"] < 5.0)
                     if n == 96 else ""})
    for n in ((2,) if quick else (4, 16, 48)):
        m = tfm_stack(blocks=n)
        r = _measure(m, 1 if quick else 3)
        rows.append({"model": "tfm_stack", "layers": n, **r, "goal_s": "", "meets_goal": ""})
    write_results("trace", rows, ["model", "layers", "nodes", "params", "cold_s", "warm_s",
                                  "make_jaxpr_s", "build_s", "goal_s", "meets_goal"],
                  meta={"note": "cold_s: first autopar.trace in the process (goal applies); "
                        "warm_s: best of 3 more; make_jaxpr_s: JAX alone (warm); build_s: "
                        "autopar's walk = warm_s - make_jaxpr_s"})
    DOC_TABLES.write()


if __name__ == "__main__":
    run_main(main)
