"""autopar benchmarks: each bench_*.py module has main(quick: bool) and writes JSON + a table."""
