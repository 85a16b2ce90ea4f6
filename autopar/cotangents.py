"""Where a training step's cotangents are the same on every device: sums it can skip.

A training step (:mod:`autopar.train`) differentiates each device's program with the loss
seeded ``1 / N`` on every device, so the cotangent of a replicated value is in general
*partial*: its copies add up to the true cotangent, and a parameter's gradient must be summed
over every axis the parameter is replicated on (:func:`autopar.grad_sync.replicated_axes`).
But where every operator between a value and the loss does the same work on the devices along
an axis (the plan *repeats* that work over the axis), each of those devices holds the same
cotangent, and summing it over the axis only multiplies it by the axis's size. This module
finds those axes, for the step to multiply locally instead of all-reducing -- the loss's own
final AllReduce (whose cotangent is the seed everywhere) and the gradients of parameters used
only in repeated computation (a replicated head, a final layer norm), which the cost model
prices as needing no synchronisation.

:func:`alike_axes` walks the parallel program backward from its outputs (a zero or seeded
cotangent: the same everywhere). A value's cotangent is alike over an axis when every use of
it gives an alike contribution:

- an operator gives its inputs alike contributions over the axes where its outputs'
  cotangents are alike and none of its layouts is split or partial (it runs the same on those
  devices);
- a communication step's transpose: an AllReduce's (a psum) and a ReduceScatter's (an
  all-gather) leave the cotangent alike over the step's axes as well
  (:attr:`StepKind.alike_transpose <autopar.strategies.redistribution.StepKind>`); the
  others (all-gather, all-to-all, slice) make it differ along them;
- a fused ring kernel: as the collective and the matmul it fuses;
- a loop: nowhere (what its body splits inside is not seen from outside; summing alike
  cotangents is exact, only not free).

A value laid out split over an axis holds different blocks along it, so it is never alike
there.
"""

from __future__ import annotations

from typing import Mapping

from autopar.errors import AutoParallelTypeError
from autopar.parallel_graph import PNode, ParallelGraph
from autopar.strategies.redistribution import STEP_KINDS

__all__ = ["alike_axes"]


def alike_axes(pg: ParallelGraph) -> dict[str, frozenset[str]]:
    """Per value of ``pg``, the mesh axes (of size > 1) over which its cotangent in the
    training step's backward is the same on every device (see the module docstring).

    >>> import jax.numpy as jnp, autopar
    >>> g = autopar.trace(lambda w, x: jnp.tanh(x @ w).sum(), jnp.ones((4, 4)), jnp.ones((2, 4)))
    >>> plan = autopar.search(g, mode="dynamic_programming", device_num=2,
    ...                       parallel_mode="auto_parallel",
    ...                       fixed={"dot_general_0": ((1, 1), (1, 1))})
    >>> sorted(alike_axes(autopar.rewrite.rewrite(g, plan))["w"])   # w's matmul is repeated
    ['a0']
    """
    if not isinstance(pg, ParallelGraph):
        raise AutoParallelTypeError("pg", pg, "an autopar ParallelGraph (autopar.rewrite)")
    every = frozenset(a for a in pg.mesh.names if pg.mesh.sizes[a] > 1)
    seen: dict[str, frozenset[str]] = {}
    for node in reversed(pg.nodes):
        outs = [_value_alike(pg, seen, o, every) for o in node.outputs]
        give = _contribution(pg, node, frozenset.intersection(every, *outs))
        for v in node.inputs:
            seen[v] = seen.get(v, every) & give
    return {v: _value_alike(pg, seen, v, every) for v in pg.values}


def _value_alike(pg: ParallelGraph, seen: Mapping[str, frozenset[str]], v: str,
                 every: frozenset[str]) -> frozenset[str]:
    """``v``'s alike axes from its uses so far (none: an output or unused value, whose
    cotangent is the seed or zero on every device), less the axes it is split over."""
    return seen.get(v, every) - pg.values[v].layout.used_axes()


def _contribution(pg: ParallelGraph, node: PNode, alike: frozenset[str]) -> frozenset[str]:
    """The axes over which ``node``'s backward gives each input an alike cotangent, given
    ``alike``: those of all its outputs."""
    if node.step is not None:
        axes = frozenset(node.step.axes)
        return alike | axes if STEP_KINDS[node.step.kind].alike_transpose else alike - axes
    if node.kind == "loop":
        # a loop's body may split what its operands and results do not (a batch sliced and
        # gathered back inside): its inputs' cotangents are taken to differ everywhere
        return frozenset()
    if node.op == "all_gather_matmul":
        # a ring kernel: an AllGather of operand 0 over its axes (its cotangent is
        # reduce-scattered: operand 0 is split there anyway), then the matmul of the gathered
        # operand with the others
        gathered = pg.values[node.inputs[0]].layout.used_axes() - frozenset(node.params["axes"])
        return alike - gathered - _used(pg, node.inputs[1:] + node.outputs)
    # an operator; or mm_reduce_scatter, whose matmul's partial output (over the axes its
    # output is then split on) leaves no more axes alike than that output does
    return alike - _used(pg, node.inputs + node.outputs)


def _used(pg: ParallelGraph, values: tuple[str, ...]) -> frozenset[str]:
    return frozenset().union(*(pg.values[v].layout.used_axes() for v in values))
