"""autopar benchmarks: each bench_*.py module has main(quick: bool) and writes JSON + a table;
the docs' tables of measured figures are rendered from that JSON (benchmarks/_common.py)."""
