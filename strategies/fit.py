"""When no plan fits the memory budget: the least a step needs, and the knobs that fit.

:func:`advise` turns the search's :class:`~autopar.errors.MemoryBudgetError` into one a user
can act on:

- **a lower bound** (:func:`state_lower_bound`): the parameters, their gradients and their
  optimizer state (as the optimizer keeps it, :mod:`autopar.strategies.precision`, else the
  cluster's ``optimizer_state_factor``) split evenly over every device -- no layout stores
  less. Above the budget, no search on these devices can fit, whatever it splits.
- **the knobs tried**: the same search with ``enable_parallel_optimizer=True`` (where it is
  off), with ``recompute='selective'`` and ``'full'`` (where the graph has repeated layers,
  :mod:`autopar.strategies.recompute`) and on 2, 4 and 8 times the devices (where the lower
  bound there is within the budget): each that fits is named with the memory per device of
  its plan. Tried, not guessed: each is a search of its own.

Pipeline stages and gradient accumulation change the traced step itself (stages and
micro-batches are built by the pipelined step; accumulation traces the loss at the
micro-batch), so they are named as what is left to try, not tried here; the message says that
``auto_pipeline=True`` (:func:`autopar.search_configuration`, ``train_step``) searches both
within the budget.

>>> import jax.numpy as jnp, autopar as ap
>>> g = ap.trace(lambda w, x: jnp.sum(x @ w), jnp.ones((256, 256)), jnp.ones((8, 256)))
>>> from autopar.strategies.search import SearchSettings
>>> state_lower_bound(g, 8, ap.CLUSTERS["accelerator-8x"], SearchSettings())  # 4 x 256 KiB / 8
131072.0
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from typing import Any, Mapping

from autopar.errors import AutoParallelError, MemoryBudgetError
from autopar.graph.ir import Graph
from autopar.limits import MAX_DEVICES
from autopar.strategies.cost import Cluster
from autopar.strategies.memory import size
from autopar.strategies.problem import requires_grad
from autopar.strategies.recompute import RECOMPUTE, with_recompute
from autopar.strategies.search import SearchSettings, search_plan

__all__ = ["advise", "state_lower_bound"]

#: the multiples of the device count tried
MORE_DEVICES = (2, 4, 8)



def state_lower_bound(graph: Graph, device_num: int, cluster: Cluster,
                      settings: SearchSettings) -> float:
    """Bytes per device of the parameters, the trained ones' gradients and optimizer state,
    split evenly over ``device_num`` devices."""
    grads = requires_grad(graph)
    state = dict(settings.optimizer_state) if settings.optimizer_state is not None else None
    total = 0.0
    for v in graph.parameters():
        spec = graph.spec(v)
        nbytes = math.prod(spec.shape) * spec.itemsize
        trained = grads.get(v, False) and spec.dtype.startswith(("float", "bfloat", "complex"))
        per = cluster.optimizer_state_factor if state is None else state.get(v, 0.0)
        total += nbytes * (2.0 + per) if trained else nbytes
    return total / device_num


def _tries(graph: Graph, device_num: int, settings: SearchSettings
           ) -> list[tuple[str, int, SearchSettings, Graph]]:
    """(the knob as the user sets it, devices, settings, graph) of each try, in order."""
    out = []
    if settings.parallel_optimizer_kb is None and \
            settings.parallel_mode in ("semi_auto_parallel", "auto_parallel"):
        out.append(("enable_parallel_optimizer=True", device_num,
                    replace(settings, parallel_optimizer_kb=0), graph))
    with warnings.catch_warnings():  # (a graph with no layers: nothing to try)
        warnings.simplefilter("ignore")
        for kind in RECOMPUTE[1:]:
            again = with_recompute(graph, kind)
            if again is not graph:
                out.append((f"recompute={kind!r}", device_num, settings, again))
    out += [(f"device_num={k * device_num}", k * device_num, settings, graph)
            for k in MORE_DEVICES if k * device_num <= MAX_DEVICES]
    return out


def advise(graph: Graph, error: MemoryBudgetError, *, mode: str, device_num: int,
           cluster: Cluster, fixed: Mapping[str, Any] | None,
           settings: SearchSettings) -> MemoryBudgetError:
    """``error`` with the lower bound and the knobs that fit (see the module docstring)."""
    budget = cluster.memory_bytes
    bound = state_lower_bound(graph, device_num, cluster, settings)
    fits: dict[str, float] = {}
    for knob, n, tried, g in _tries(graph, device_num, settings):
        if state_lower_bound(graph, n, cluster, tried) > budget:
            continue  # no layout on n devices stores the state within the budget
        try:
            with warnings.catch_warnings():  # (a try's own notes are not the user's)
                warnings.simplefilter("ignore")
                plan = search_plan(g, mode=mode, device_num=n, cluster=cluster,
                                   fixed=fixed, settings=tried)
        except AutoParallelError:  # it does not fit either (or the fixed splits do not)
            continue
        fits[knob] = plan.cost.memory_bytes
        if knob.startswith("device_num"):
            break  # the fewest devices that fit
    lines = [str(error), f"the parameters, gradients and optimizer state alone need "
             f"{size(bound)} per device split over all {device_num} devices"
             + (" (more than the budget: no layout on these devices fits)"
                if bound > budget else "")]
    lines.append("fits with " + ", ".join(f"{k} ({size(v)} per device)"
                                          for k, v in fits.items()) if fits else
                 "neither enable_parallel_optimizer=True, recompute nor up to "
                 f"{MORE_DEVICES[-1]}x the devices fits")
    lines.append("not tried here: pipeline_stages (pipeline_train_step), "
                 "grad_accumulation_step (auto_pipeline=True makes "
                 "autopar.search_configuration and train_step search both within the "
                 "budget), a smaller batch, a cluster with more memory")
    return MemoryBudgetError("; ".join(lines), needed=error.needed, budget=error.budget,
                             lower_bound=bound, fits=fits)
