"""``autopar.search``: choose a strategy for every operator, under the context's settings.

``search(graph, *, mode=None, device_num=None, cluster=None, fixed=None)`` reads what it is not
given from the resolved auto-parallel context. ``parallel_mode`` decides who chooses:

- ``stand_alone``: one device, nothing split.
- ``data_parallel``: every operator splits its batch dimension (traced from dim 0 of the data
  inputs) over all devices; parameters replicated, gradients all-reduced.
- ``semi_auto_parallel`` / ``hybrid_parallel``: the user's strategies (``fixed=`` and
  annotations) are honoured, every other operator is data parallel, as MindSpore does.
- ``auto_parallel``: the search mode (``recursive_programming``, ``dynamic_programming``,
  ``sharding_propagation``, or ``exact``) chooses, honouring fixed strategies.

All modes build the same :class:`~autopar.strategies.problem.Problem` (one cost model), so
their plans compare like for like. Under ``semi_auto_parallel`` / ``auto_parallel`` the
context's ``strategy_ckpt_load_file`` replaces the search by a checked load of a saved plan,
and ``strategy_ckpt_save_file`` saves the plan (:mod:`autopar.checkpoint`). A plan over the cluster's memory budget is re-searched with
memory priced into the objective; if none fits, the error says how much is missing.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Mapping

from autopar.errors import AutoParallelError, AutoParallelTypeError, AutoParallelWarning
from autopar.graph.ir import Graph
from autopar.strategies import (dynamic_programming, exact, recursive_programming,
                                sharding_propagation)
from autopar.strategies.cost import Cluster, CostModel
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.plan import Plan
from autopar.strategies.problem import Problem

__all__ = ["MODES", "search", "data_parallel_splits"]

MODES: dict[str, Callable[[Problem], list[int]]] = {
    "recursive_programming": recursive_programming.solve,
    "dynamic_programming": dynamic_programming.solve,
    "sharding_propagation": sharding_propagation.solve,
    "exact": exact.solve,
}
_MEMORY_WEIGHTS = (0.0, 1e-12, 1e-11, 1e-10, 1e-9, 1e-8, 1e-7)


def data_parallel_splits(problem_specs: Mapping[str, Any], graph: Graph,
                         device_num: int, mesh: DeviceMesh) -> dict[str, tuple[int, ...]]:
    """Per operator: split the loop dim carrying the batch (dim 0 of the data inputs)."""
    batch: dict[str, int | None] = {v: (0 if graph.spec(v).rank else None)
                                     for v in graph.data_inputs()}
    out: dict[str, tuple[int, ...]] = {}
    for node in graph.nodes:
        spec = problem_specs[node.name]
        it = None
        for v, mp in zip(node.inputs, spec.in_maps):
            b = batch.get(v)
            if b is not None and mp[b] is not None:
                it = mp[b]
                break
        splits = [1] * len(spec.sizes)
        if it is not None and spec.splittable(it):
            limit = dict(spec.divides).get(it)
            for s in sorted((d for d in range(1, device_num + 1) if device_num % d == 0),
                            reverse=True):
                if spec.sizes[it] % s == 0 and (limit is None or limit % s == 0) and \
                        mesh.assign([s]) is not None:
                    splits[it] = s
                    break
        out[node.name] = tuple(splits)
        for v, mp in zip(node.outputs, spec.out_maps):
            batch[v] = mp.index(it) if it is not None and it in mp else None
    return out


def _resolve(mode: Any, device_num: Any, cluster: Any, fixed: Any,
             parallel_mode: Any) -> tuple[str, int, Cluster | None, dict, str, Any]:
    from autopar.clusters import resolve_cluster
    from autopar.resolve import resolve_context

    ctx = resolve_context()
    cfg = ctx.config
    pmode = cfg.parallel_mode if parallel_mode is None else parallel_mode
    if pmode not in ("stand_alone", "data_parallel", "hybrid_parallel", "semi_auto_parallel",
                     "auto_parallel"):
        raise AutoParallelError("parallel_mode", pmode, "unknown parallel mode")
    m = cfg.search_mode if mode is None else mode
    if not isinstance(m, str):
        raise AutoParallelTypeError("mode", m, f"a search mode name, one of {sorted(MODES)}")
    if m not in MODES:
        raise AutoParallelError("mode", m, f"unknown search mode; choose one of {sorted(MODES)}")
    n = cfg.device_num if device_num is None else device_num
    if not isinstance(n, int) or isinstance(n, bool):
        raise AutoParallelTypeError("device_num", n, "must be an int")
    if not 1 <= n <= 4096:
        raise AutoParallelError("device_num", n, "must be in [1, 4096]")
    if pmode == "stand_alone":
        n = 1
    if fixed is not None and not isinstance(fixed, Mapping):
        raise AutoParallelTypeError("fixed", fixed, "a mapping of node name -> strategy")
    loading = bool(cfg.strategy_ckpt_load_file) and pmode in ("semi_auto_parallel",
                                                               "auto_parallel")
    # a load prices on the file's own cluster unless one is named
    clus = None if loading and cluster is None else resolve_cluster(cluster)
    return m, n, clus, dict(fixed or {}), pmode, cfg


def search(graph: Graph, *, mode: str | None = None, device_num: int | None = None,
           cluster: str | Cluster | None = None, fixed: Mapping[str, Any] | None = None,
           parallel_mode: str | None = None, fully_use_devices: bool = True) -> Plan:
    """Search a plan for ``graph`` (see the module docstring).

    ``fully_use_devices`` (MindSpore's algorithm parameter of the same name): when True (the
    default) an operator's splits must use every device, except for small operators (at most
    4 MiB of output), which may repeat their work; False lets every operator repeat work on
    some axes — a larger space (slower search) that can pay off when communication is dear.
    """
    if not isinstance(fully_use_devices, bool):
        raise AutoParallelTypeError("fully_use_devices", fully_use_devices, "must be a bool")
    if not isinstance(graph, Graph):
        raise AutoParallelTypeError("graph", graph, "autopar.search takes the Graph returned "
                                    "by autopar.trace")
    m, n, clus, fixed_map, pmode, cfg = _resolve(mode, device_num, cluster, fixed,
                                                 parallel_mode)
    if fixed_map and pmode in ("stand_alone", "data_parallel"):
        warnings.warn(f"fixed strategies are not used under parallel_mode={pmode!r} (every "
                      "operator is data parallel there); use semi_auto_parallel or "
                      "auto_parallel to honour them", AutoParallelWarning, stacklevel=2)
    if cfg.strategy_ckpt_load_file and pmode in ("semi_auto_parallel", "auto_parallel"):
        plan = _load(graph, cfg, n, clus, fixed_map)
    else:
        assert clus is not None
        plan = _search(graph, m, n, clus, fixed_map, pmode, cfg, fully_use_devices)
    if cfg.strategy_ckpt_save_file and pmode in ("semi_auto_parallel", "auto_parallel"):
        from autopar.checkpoint import save_strategy

        save_strategy(plan, graph, cfg.strategy_ckpt_save_file)
    return plan


def _load(graph: Graph, cfg: Any, n: int, cluster: Any, fixed_map: dict) -> Plan:
    """The plan of ``strategy_ckpt_load_file``; fixed strategies must agree with it."""
    from autopar.checkpoint import load_strategy

    plan = load_strategy(cfg.strategy_ckpt_load_file, graph, device_num=n, cluster=cluster)
    from autopar.graph.ir import check_strategy_shape

    for name, strategy in sorted(fixed_map.items()):
        graph.node(name)
        if check_strategy_shape(strategy, None, name) != plan.nodes[name].strategy:
            raise AutoParallelError(
                f"fixed strategy of node {name!r}", strategy,
                f"conflicts with {plan.nodes[name].strategy} in strategy_ckpt_load_file "
                f"{cfg.strategy_ckpt_load_file!r}", "Drop fixed= or the load file")
    return plan


def parallel_optimizer_kb(cfg: Any) -> int | None:
    """The parallel optimizer threshold (KB) the search prices, None when it is off."""
    if not cfg.enable_parallel_optimizer:
        return None
    return int(cfg.parallel_optimizer_config.parallel_optimizer_threshold)


def _search(graph: Graph, m: str, n: int, clus: Cluster, fixed_map: dict, pmode: str,
            cfg: Any, fully_use_devices: bool) -> Plan:
    mesh = DeviceMesh.for_devices(n)
    cm = CostModel(clus)
    t0 = time.perf_counter()
    label = m if pmode == "auto_parallel" else pmode
    po_kb = parallel_optimizer_kb(cfg)
    for weight in _MEMORY_WEIGHTS:
        derived = pmode != "auto_parallel" and n > 1  # strategies derived, not searched
        # (a derived mode only needs this first problem's loop nests and checked fixed
        # strategies, so it is built lazily: no choice lists)
        problem = Problem(graph, mesh, cm, enable_alltoall=cfg.enable_alltoall,
                          dataset_strategy=cfg.dataset_strategy, memory_weight=weight,
                          fixed=fixed_map, full_use=fully_use_devices, parallel_optimizer_kb=po_kb,
                          lazy=derived or (pmode == "auto_parallel"
                                           and m == "recursive_programming"))
        if derived:
            dp = data_parallel_splits(problem.specs, graph, n, mesh)
            keep = set(problem.fixed) if pmode in ("semi_auto_parallel",
                                                   "hybrid_parallel") else set()
            dp = {k: v for k, v in dp.items() if k not in keep}
            problem = Problem(graph, mesh, cm, enable_alltoall=cfg.enable_alltoall,
                              dataset_strategy=cfg.dataset_strategy, memory_weight=weight,
                              fixed={k: v for k, v in fixed_map.items() if k in keep},
                              fixed_splits=dp, full_use=fully_use_devices,
                              parallel_optimizer_kb=po_kb)
        if m == "exact" and pmode == "auto_parallel":
            picks = exact.solve(problem, memory_limit=clus.memory_bytes)
        else:
            solver = MODES[m] if pmode == "auto_parallel" else dynamic_programming.solve
            picks = solver(problem)
        plan = Plan.from_picks(problem, picks, label, time.perf_counter() - t0)
        if plan.cost.memory_bytes <= clus.memory_bytes or m == "exact":
            if weight:
                plan.notes.append(f"memory priced at {weight:g} s/byte to fit the budget")
            return plan
    raise AutoParallelError(
        "memory", f"{plan.cost.memory_bytes / 2**30:.2f} GiB per device",
        f"no plan found within the {clus.name} budget of {clus.memory_bytes / 2**30:.2f} GiB "
        f"per device", "Use more devices, a smaller model or batch, or a cluster with more "
        "memory")
