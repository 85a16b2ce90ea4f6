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
    """The main job end to end, as far as it exists: configure, trace, search, compare."""
    _setup_devices(args.devices)
    import time

    import jax

    import autopar as ap
    from autopar.models import transformer

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
          f"{' (default)' if split.is_default else ''}\n")

    model = transformer(layers=args.layers, hidden=256, heads=8, seq=128, vocab=1024, batch=8)
    t0 = time.perf_counter()
    graph = ap.trace(model.loss, *jax.eval_shape(model.example_args, jax.random.key(0)))
    print(f"traced the zoo transformer ({args.layers} layers): {len(graph.nodes)} nodes, "
          f"{len(graph.parameters())} parameters, fingerprint {graph.fingerprint()[:12]} "
          f"in {time.perf_counter() - t0:.2f} s\n")
    plans = {}
    for mode in ("recursive_programming", "dynamic_programming", "exact"):
        plans[mode] = ap.search(graph, mode=mode, cluster=args.cluster)
    best = plans["exact"].objective
    print(f"search modes on {args.devices} devices, cluster {args.cluster}:")
    print(f"  {'mode':<24}{'step ms':>10}{'vs exact':>10}{'search s':>10}")
    for mode, plan in plans.items():
        print(f"  {mode:<24}{plan.cost.total * 1e3:>10.3f}{plan.objective / best:>10.4f}"
              f"{plan.search_seconds:>10.3f}")
    plan = plans[resolved.config.search_mode]
    print("\n" + plan.summary())
    for p in graph.parameters()[:6]:
        print(f"  {p}: {plan.layout(p)} (splits {plan.split_counts(p)})")
    return _demo_run(args)


def _demo_run(args: argparse.Namespace) -> int:
    """Run the plan for real on the emulated devices and check it against one device."""
    import jax
    import numpy as np

    import autopar as ap
    from autopar.models import transformer

    small = transformer(layers=args.layers, hidden=64, heads=4, seq=16, vocab=128,
                                  batch=8)
    example = small.example_args(jax.random.key(0))
    f = ap.parallelize(small.loss, *example, cluster=args.cluster)
    print(f"\nparallelized a small transformer (hidden 64, seq 16, batch 8) on {args.devices} "
          f"devices; collectives in the lowered program: {f.collective_counts(*example)}")
    loss_p = float(f(*example))
    loss_1 = float(jax.jit(small.loss)(*example))
    grad_p = jax.grad(lambda *a: f(*a))(*example)
    grad_1 = jax.grad(small.loss)(*example)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(grad_p), jax.tree.leaves(grad_1)))
    ok = abs(loss_p - loss_1) <= 1e-5 * max(1.0, abs(loss_1)) and err <= 1e-4
    print(f"loss on {args.devices} devices {loss_p:.6f} vs one device {loss_1:.6f}; max gradient "
          f"difference {err:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main job end to end on emulated devices")
    demo.add_argument("--devices", type=int, default=8, help="emulated devices (default 8)")
    demo.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    demo.add_argument("--cluster", default="accelerator-8x",
                      help="cost-model cluster preset (default accelerator-8x)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "devices", 1) < 1:
        print(f"autopar: --devices must be >= 1, got {args.devices}", file=sys.stderr)
        return 2
    if getattr(args, "layers", 1) < 1:
        print(f"autopar: --layers must be >= 1, got {args.layers}", file=sys.stderr)
        return 2
    return int(args.func(args))
