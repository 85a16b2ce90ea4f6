"""Run every benchmark: `python -m benchmarks [--quick] [name ...]`."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("names", nargs="*",
                        help="benchmark names (bench_<name>.py); all when empty")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent
    found = sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules([str(here)])
                   if m.name.startswith("bench_"))
    names = args.names or found
    unknown = [n for n in names if n not in found]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {found}")
    from benchmarks._common import set_quick, setup_devices

    set_quick(args.quick)  # a smoke run never writes over the committed results
    setup_devices(8)
    for name in names:
        importlib.import_module(f"benchmarks.bench_{name}").main(quick=args.quick)


if __name__ == "__main__":
    main()
