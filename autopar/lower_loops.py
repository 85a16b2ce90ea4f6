"""A loop node lowered as a loop: one ``lax.scan`` inside the ``shard_map`` program.

The rewrite gives a loop node the program of one iteration (its body's ParallelGraph under
the body plan: ``node.params["program"]``); :func:`run_loop` runs it as the body of a
``lax.scan`` with the scan's own trip count, ``reverse`` and ``unroll``, on the local blocks:
the constants are read by every iteration, the carries enter and leave each iteration in one
layout (the rewrite moves them back), the ``xs`` are scanned along their leading dim (never
split) and the ``ys`` stacked along it. The program's size and its compile time therefore do
not grow with the trip count, and its gradient is JAX's transpose of the ``lax.scan``.

A ``cond`` node (one iteration, a program per branch: ``node.params["programs"]``) is lowered
as one ``lax.switch`` on its index (replicated: every device takes the same branch), every
branch reading all the operands and making its results in the node's output layouts.

A program holding a loop runs under ``shard_map(check_vma=False)`` (as the training step's
always does): a carry's variance across the mesh can differ between entering and leaving an
iteration, which ``lax.scan`` refuses under ``check_vma=True``.
"""

from __future__ import annotations

from typing import Any, Callable

from jax import lax

from autopar.parallel_graph import PNode, ParallelGraph

__all__ = ["body_program", "body_programs", "run_loop"]


def body_program(node: PNode) -> ParallelGraph:
    """The per-iteration program of a loop node."""
    return node.params["program"]


def body_programs(node: PNode) -> tuple[ParallelGraph, ...]:
    """Every program of a loop node: its body's, or each branch's of a ``cond``."""
    return node.params.get("programs") or (node.params["program"],)


def run_loop(node: PNode, args: list[Any], run: Callable[..., tuple[Any, ...]],
             vma: bool = False) -> list[Any]:
    """A loop node on its local operands (constants, initial carries, ``xs``): the final
    carries and the stacked ``ys``. ``run(pg, *flat, vma=...)`` runs one program
    (:func:`autopar.lower.run_body`)."""
    p = node.params
    if node.op == "cond":  # one lax.switch of the branches' programs
        branches = [lambda *a, pg=pg: tuple(run(pg, *a, vma=vma)) for pg in p["programs"]]
        return list(lax.switch(args[0], branches, *args))
    program = body_program(node)
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = args[:nc], tuple(args[nc:nc + nk]), tuple(args[nc + nk:])

    def step(carry: tuple[Any, ...], x: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple]:
        outs = run(program, *consts, *carry, *x, vma=vma)
        return tuple(outs[:nk]), tuple(outs[nk:])

    carry, ys = lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"],
                         unroll=p["unroll"])
    return [*carry, *ys]
