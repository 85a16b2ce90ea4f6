"""``parallelize(fn, *example_args)``: the whole pipeline behind one call, as MindSpore runs it.

trace -> search (under the current auto-parallel context) -> rewrite -> lower. The result is
called like ``fn`` (same pytrees in and out) and runs as one jitted ``shard_map`` program on
``device_num`` devices; it keeps the plan and the parallel program for inspection.

>>> import jax.numpy as jnp, autopar as ap
>>> def loss(params, x):
...     return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)
>>> params, x = {"w": jnp.ones((16, 32)) / 16}, jnp.ones((8, 16))
>>> with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel"):
...     f = ap.parallelize(loss, params, x)
>>> bool(jnp.allclose(f(params, x), loss(params, x)))
True
>>> f.parallel_graph.comm_counts()     # data parallel: only the loss is all-reduced
{'all_reduce': 1}

Under ``semi_auto_parallel`` / ``auto_parallel`` the context's ``strategy_ckpt_save_file``
saves the plan and ``strategy_ckpt_load_file`` loads it instead of searching (see
:mod:`autopar.checkpoint`); ``f.plan.in_shardings()`` hands the plan's input layouts to a plain
``jax.jit``.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable, Mapping

from jax.sharding import Mesh

from autopar.errors import (AutoParallelError, AutoParallelTypeError, AutoParallelWarning,
                            user_stacklevel)
from autopar.graph.ir import Graph
from autopar.graph.tracer import trace
from autopar.inspection import ProgramInspection
from autopar.kernel_rules import FusedKernels, check_fused_kernels
from autopar.lower import LoweredFunction, lower
from autopar.multihost import together
from autopar.parallel_graph import ParallelGraph
from autopar.rewrite import rewrite
from autopar.strategies.modes import SOLVERS
from autopar.strategies.recompute import with_recompute
from autopar.strategies.plan import Plan
from autopar.planner import check_same_plans, plan_graph, save_strategies, strategy_saves
from autopar.setup import Setup, resolve_setup
from autopar.uneven import UnevenBatch, UnevenRequest, check_uneven_batch, plan_uneven

__all__ = ["parallelize", "parallel_function", "ParallelFunction"]

class ParallelFunction(ProgramInspection):
    """``fn`` parallelised: call it like ``fn``; ``.plan``, ``.parallel_graph``, ``.as_text``,
    ``.collective_counts`` (:class:`~autopar.inspection.ProgramInspection`).

    ``.uneven``: the :class:`~autopar.uneven.UnevenBatch` (counts, padded rows) when the batch
    runs split unevenly (``uneven_batch="all_gather_v"``), else None.
    """

    uneven: UnevenBatch | None = None

    def __init__(self, fn: Callable[..., Any], graph: Graph, plan: Plan,
                 parallel_graph: ParallelGraph, lowered: LoweredFunction) -> None:
        self.fn = fn
        self.graph = graph
        self.plan = plan
        self.parallel_graph = parallel_graph
        self.lowered = lowered
        self.mesh: Mesh = lowered.mesh
        self.__name__ = getattr(fn, "__name__", "fn")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any) -> Any:
        return self.lowered(*args)

    def lower(self, *args: Any) -> Any:
        """The ``jax.stages.Lowered`` program for these arguments (checked and placed as a
        call places them)."""
        return self.lowered.flat.lower(*self.lowered.place(*args))

    def __repr__(self) -> str:
        return (f"ParallelFunction({self.__name__!r}, {self.plan.mode}, "
                f"{self.parallel_graph.device_num} devices, comm "
                f"{self.parallel_graph.comm_counts()})")


def parallelize(fn: Callable[..., Any], *example_args: Any, mode: str | None = None,
                fixed: Mapping[str, Any] | None = None, cluster: Any = None,
                mesh: Mesh | None = None,
                fused_kernels: FusedKernels = "auto",
                uneven_batch: str = "divisor") -> ParallelFunction:
    """Trace, search, rewrite and lower ``fn`` for arguments shaped like ``example_args``.

    ``mode``: a search mode (default: the context's ``search_mode``, used under
    ``parallel_mode="auto_parallel"``). ``fixed``: MindSpore strategies by node name, e.g.
    ``{"layer0/dot_general_0": ((1, 1), (1, 8))}``. ``cluster``: the cost model's cluster (a
    preset name or :class:`~autopar.strategies.cost.Cluster`). ``mesh``: a
    ``jax.sharding.Mesh`` with the plan's axes (default: the first ``device_num`` devices).
    The first positional argument holds the parameters when there are two or more.
    ``strategy_ckpt_load_file`` / ``strategy_ckpt_save_file`` in the context load / save the
    plan (through :func:`autopar.search`). ``fused_kernels``: ``"auto"`` (default) replaces a
    matmul + ReduceScatter / AllGather + matmul by the pipelined ring kernels where the cost
    model predicts they are not slower on the cluster, ``True`` wherever they match, ``False``
    never (:mod:`autopar.kernel_rules`, docs/kernels.md). ``uneven_batch``: ``"divisor"``
    (default) splits the batch by a divisor of it (6 rows on 4 devices run 2-way);
    ``"all_gather_v"`` splits a batch that does not divide the device count unevenly, pads
    each device's block, and gathers the outputs with ``all_gather_v`` -- forward only, and
    refused (naming the node) when an operator mixes batch rows (:mod:`autopar.uneven`;
    a searched plan that does gives way to the data-parallel one, with a warning).
    """
    if not callable(fn):
        raise AutoParallelTypeError("fn", fn, "parallelize needs a callable JAX function")
    check_fused_kernels(fused_kernels)
    setup = resolve_setup(cluster)  # the stores, read once
    uneven = plan_uneven(fn, example_args, check_uneven_batch(uneven_batch), setup.device_num)
    f = parallel_function(fn, example_args, uneven, setup, mode=mode, fixed=fixed,
                          mesh=mesh, fused_kernels=fused_kernels)
    save_strategies(strategy_saves(f.plan, f.graph, setup))  # once the function is built
    return f


def parallel_function(fn: Callable[..., Any], example_args: tuple[Any, ...],
                      uneven: UnevenRequest | None, setup: Setup, *, mode: str | None,
                      fixed: Mapping[str, Any] | None, mesh: Mesh | None,
                      fused_kernels: FusedKernels, plan: Plan | None = None,
                      optimizer: Any = None, micro_batches: int = 1,
                      searched: Plan | None = None, recompute: str = "none"
                      ) -> ParallelFunction:
    """:func:`parallelize` after its checks: trace, search (:func:`autopar.planner.plan_graph`
    on the entry point's ``setup``), rewrite and lower, reading no store and writing no
    file (the entry point saves the plan: :func:`autopar.planner.strategy_saves`). ``uneven``: the
    uneven split :func:`autopar.uneven.plan_uneven` asked for, or None. ``plan``: a plan
    searched on this function at these shapes, run as it is instead of searching (no
    strategy file read or written, ``mode`` and ``fixed`` unused): a tuning's candidates.
    ``micro_batches``: the times a training step runs ``fn`` (its grad_accumulation_step),
    priced by the search (:func:`autopar.planner.plan_graph`). ``searched``: the plan a
    search with these settings already found (the configuration search's one stage): taken
    as the search's answer where it was searched on this very graph and no strategy file is
    loaded, else the search runs. ``recompute``: the regions a training step adds
    (:func:`autopar.strategies.recompute.with_recompute`)."""
    args = example_args if uneven is None else uneven.padded_args
    # every process builds it (under jax.distributed): the cluster is process 0's
    with together():
        graph = with_recompute(trace(fn, *args), recompute)
        given = plan is not None
        if given:
            _check_given_plan(plan, graph)
        elif searched is not None and not setup.config.strategy_ckpt_load_file and \
                searched.searched_on(graph):
            plan = replace(searched, stages={})  # (one stage: no stage numbers)
        else:
            plan = plan_graph(graph, setup, mode=mode, fixed=fixed, optimizer=optimizer,
                              micro_batches=micro_batches)
        cluster = setup.cluster if setup.cluster_named else None  # (else the plan's own)
        pg = rewrite(graph, plan, fused_kernels=fused_kernels, cluster=cluster)
        adapter = None
        if uneven is not None and given:  # (the given plan runs as it is, or is refused)
            adapter = uneven.check(graph, pg)
        elif uneven is not None:
            plan, pg, adapter = _rows_kept(uneven, graph, plan, pg, setup, mode=mode,
                                           fixed=fixed, fused_kernels=fused_kernels)
        check_same_plans([(plan, graph, pg)])  # (under jax.distributed)
        f = ParallelFunction(fn, graph, plan, pg, lower(pg, mesh, adapter=adapter))
    f.uneven = adapter
    return f


def _check_given_plan(plan: Any, graph: Graph) -> None:
    """A plan given to run (``plan=``) must be a one-stage :class:`Plan` searched on
    ``graph``."""
    if not isinstance(plan, Plan):
        raise AutoParallelTypeError("plan", plan, "a Plan from autopar.search (or None)")
    if not plan.searched_on(graph):
        raise AutoParallelError("plan", f"fingerprint {plan.fingerprint[:12]}", "it was not "
                                f"searched on this function at these shapes (fingerprint "
                                f"{graph.fingerprint()[:12]})", "Search the function it runs")
    if plan.stages:
        raise AutoParallelError("plan", f"{len(set(plan.stages.values()))} pipeline stages",
                                "a pipelined plan runs in the pipelined step")


def _rows_kept(uneven: UnevenRequest, graph: Graph, plan: Plan, pg: ParallelGraph,
               setup: Setup, *, mode: str | None, fixed: Mapping[str, Any] | None,
               fused_kernels: FusedKernels) -> tuple[Plan, ParallelGraph, UnevenBatch]:
    """The plan, its program and the uneven adapter, the batch rows proven apart
    (:meth:`UnevenRequest.check`). A plan a search mode chose that mixes rows gives way,
    with a warning, to the data-parallel one -- every operator split along the batch, saved
    as the search's plan; a plan of the user's strategies (``fixed=``, annotations, a
    strategy file loaded, a parallel mode that derives them) is refused as it is."""
    try:
        return plan, pg, uneven.check(graph, pg)
    except AutoParallelError as refused:
        if fixed or graph.annotations() or plan.source or plan.mode not in SOLVERS:
            raise
        first, mixing, searched = refused, getattr(refused, "mixing", ""), plan.mode
    with warnings.catch_warnings():  # (a strategy file is the auto search's: saved below)
        warnings.filterwarnings("ignore", "strategy files are used only",
                                AutoParallelWarning)
        rows = plan_graph(graph, setup, parallel_mode="data_parallel")
    plan = plan_graph(graph, setup, mode=mode,
                      fixed={name: ns.strategy for name, ns in rows.nodes.items()})
    pg = rewrite(graph, plan, fused_kernels=fused_kernels,
                 cluster=setup.cluster if setup.cluster_named else None)
    try:
        adapter = uneven.check(graph, pg)
    except AutoParallelError:
        raise first from None  # (the function itself mixes rows: said of the searched plan)
    warnings.warn(f"uneven_batch='all_gather_v': in the {searched} plan {mixing}; the "
                  "data-parallel plan runs instead, every operator split along the batch",
                  AutoParallelWarning, stacklevel=user_stacklevel())
    plan = plan.with_notes("uneven_batch: every operator split along the batch (the "
                           "searched plan mixed batch rows)")
    return plan, pg, adapter
