"""The `autopar` command."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


def _setup_devices(n: int) -> None:
    """Emulate n CPU devices; must run before the first JAX computation."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job end to end, as far as it exists: configure, resolve, print."""
    _setup_devices(args.devices)
    import autopar as ap

    print("autopar demo: configure the auto-parallel context as MindSpore users do\n")
    print('  ap.set_auto_parallel_context(device_num=%d, parallel_mode="auto_parallel",\n'
          '      search_mode="dynamic_programming",\n'
          '      comm_fusion={"allreduce": {"mode": "size", "config": 32}})\n' % args.devices)
    ap.set_auto_parallel_context(device_num=args.devices, parallel_mode="auto_parallel",
                                 search_mode="dynamic_programming",
                                 comm_fusion={"allreduce": {"mode": "size", "config": 32}})
    resolved = ap.resolve_context()
    print(resolved.table())
    split = ap.get_split_strategy()
    print(f"\nHCCL gradient split ({split.group}): {split.mode} {list(split.values)}"
          f"{' (default)' if split.is_default else ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main job end to end on emulated devices")
    demo.add_argument("--devices", type=int, default=8, help="emulated devices (default 8)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "devices", 1) < 1:
        print(f"autopar: --devices must be >= 1, got {args.devices}", file=sys.stderr)
        return 2
    return int(args.func(args))
