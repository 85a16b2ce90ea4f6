"""``autopar.search``: the planning entry point — resolve the context, load or search, save.

``search(graph, *, mode=None, device_num=None, cluster=None, fixed=None, parallel_mode=None,
fully_use_devices=None, optimizer=None)`` reads what it is not given from the auto-parallel
context and the algorithm parameters (:mod:`autopar.algo`), once, into a
:class:`~autopar.setup.Setup` (:func:`plan_graph` is the core the other entry points call
with theirs): the parallel mode (who chooses), the search mode
(:mod:`autopar.strategies.modes`), the devices, the cluster that prices the plan
(:func:`autopar.clusters.resolve_cluster`), ``fully_use_devices`` and
``elementwise_op_strategy_follow``.
Under ``semi_auto_parallel`` / ``auto_parallel`` the context's ``strategy_ckpt_load_file``
replaces the search by a checked load of a saved plan, and ``strategy_ckpt_save_file`` saves
the plan (:mod:`autopar.checkpoint`). :func:`plan_graph` writes no file: each entry point
loads or searches, builds, then saves (:func:`strategy_saves`, :func:`save_strategies`), so
one that fails (a later check, a pipeline's next stage) writes nothing. The search itself is
:func:`autopar.strategies.search.search_plan`, which reads no context and writes no file.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import jax

from autopar.checkpoint import dumps_strategy, load_plan, strategy_document
from autopar.clusters import note_devices
from autopar.errors import (AutoParallelError, AutoParallelTypeError, AutoParallelWarning,
                            MemoryBudgetError, user_stacklevel)
from autopar.files import writable_target, write_files_atomic
from autopar.graph.ir import Graph, check_strategy_shape
from autopar.graph.ms_layout import to_strategy
from autopar.graph.prng import is_key
from autopar.limits import MAX_DEVICES
from autopar.multihost import check_same, several
from autopar.setup import Setup, resolve_setup
from autopar.strategies.cost import Cluster, CostModel
from autopar.strategies.explain import Explanation, alternatives
from autopar.strategies.fit import advise
from autopar.strategies.modes import (PARALLEL_MODES, SOLVERS, USES_PARAMETER_PLANS,
                                      USES_STRATEGY_FILES, USES_USER_STRATEGIES)
from autopar.strategies.plan import Plan
from autopar.strategies.precision import optimizer_state
from autopar.strategies.search import SearchSettings, ranked_plans, search_plan
from autopar.strategies.stages import StagePartition
from autopar.strategies.stages import partition_stages as _partition_stages

__all__ = ["StrategySave", "check_same_plans", "explain", "explain_node", "partition_stages",
           "plan_graph", "ranked_candidates", "save_strategies", "search", "search_graph",
           "strategy_saves"]


def search(graph: Graph, *, mode: str | None = None, device_num: int | None = None,
           cluster: str | Cluster | None = None, fixed: Mapping[str, Any] | None = None,
           parallel_mode: str | None = None, fully_use_devices: bool | None = None,
           optimizer: Any = None) -> Plan:
    """Search a plan for ``graph`` (see the module docstring).

    ``optimizer``: the optax ``GradientTransformation`` the step will run (``train_step``
    passes its own); the memory and update time price each parameter's optimizer state as
    ``optimizer.init`` makes it (:func:`autopar.strategies.precision.optimizer_state`).
    None: the cluster's ``optimizer_state_factor`` (Adam's 2 x the parameter).

    ``fully_use_devices`` (MindSpore's algorithm parameter of the same name; None: the value
    of ``set_algo_parameters(fully_use_devices=...)``, True by default): when True an
    operator's splits must use every device, except for small operators (at most
    4 MiB of output), which may repeat their work; False lets every operator repeat work on
    some axes — a larger space (slower search) that can pay off when communication is dear.
    """
    return search_graph(graph, resolve_setup(cluster), mode=mode, device_num=device_num,
                        fixed=fixed, parallel_mode=parallel_mode,
                        fully_use_devices=fully_use_devices, optimizer=optimizer)


def search_graph(graph: Graph, setup: Setup, *, mode: str | None = None,
                 device_num: int | None = None, fixed: Mapping[str, Any] | None = None,
                 parallel_mode: str | None = None, fully_use_devices: bool | None = None,
                 optimizer: Any = None) -> Plan:
    """:func:`search` on the setup its caller resolved (the CLI's, once per command),
    reading no store: load or search (:func:`plan_graph`), then save."""
    _one_program(setup, device_num, parallel_mode)
    plan = plan_graph(graph, setup, mode=mode, device_num=device_num,
                      fixed=fixed, parallel_mode=parallel_mode,
                      fully_use_devices=fully_use_devices, optimizer=optimizer)
    save_strategies(strategy_saves(plan, graph, setup, parallel_mode=parallel_mode))
    return plan


def _one_program(setup: Setup, device_num: Any, parallel_mode: Any) -> None:
    """A search plans one program over its devices: under ``pipeline_stages > 1`` (or
    ``auto_pipeline``) a search over all ``device_num`` devices would ignore the stages, so it
    is refused (a stage's own search, on ``device_num / pipeline_stages`` devices, is not)."""
    cfg = setup.config
    stages = cfg.pipeline_stages
    whole = device_num is None or device_num == cfg.device_num
    if cfg.auto_pipeline and whole:
        raise AutoParallelError(
            "auto_pipeline", True, "autopar.search plans one program for the graph's batch "
            "and would ignore it: the stages and the micro-batches are chosen from the "
            "training step's loss, parameters and batch",
            "Use autopar.search_configuration(loss_fn, params, batch) or train_step, or set "
            "auto_pipeline=False")
    if stages > 1 and whole and (parallel_mode or cfg.parallel_mode) != "stand_alone":
        raise AutoParallelError(
            "pipeline_stages", stages, f"autopar.search plans one program over all "
            f"device_num={cfg.device_num} devices and would ignore the stages",
            "Use autopar.pipeline_train_step (or train_step) to plan and run the stages, or "
            "autopar.partition_stages and search each stage graph with "
            f"device_num={cfg.device_num // stages}")


def plan_graph(graph: Graph, setup: Setup, *, mode: str | None = None,
               device_num: int | None = None, fixed: Mapping[str, Any] | None = None,
               parallel_mode: str | None = None, fully_use_devices: bool | None = None,
               load_file: str | None = None, save_file: str | None = None,
               optimizer: Any = None, micro_batches: int = 1,
               stage: int | None = None, advise: bool = True) -> Plan:
    """:func:`search` on the setup its caller's entry point resolved (the pipelined step's,
    once for all its stages). ``load_file`` / ``save_file`` replace the configuration's
    strategy-file paths (a stage's own files); no file is written here (the entry point saves
    once it has built the step: :func:`strategy_saves`), but a save path that cannot be
    written fails at once. ``micro_batches``: the times one optimizer
    step runs ``graph`` (a training step's ``grad_accumulation_step``, times its micro-batches
    for a pipeline stage): the objective charges each the gradient sync and the optimizer
    update once a step (``SearchSettings.micro_batches``). ``stage``: a pipeline stage's
    plan has every operator in that stage (``Plan.stages``; its strategy file says so).
    ``advise`` False: a plan that does not fit raises the search's own
    :class:`MemoryBudgetError`, without trying what would fit (a candidate of a larger
    search)."""
    cfg = setup.config
    load = cfg.strategy_ckpt_load_file if load_file is None else load_file
    save = cfg.strategy_ckpt_save_file if save_file is None else save_file
    s = _search_inputs(graph, setup, mode=mode, device_num=device_num, fixed=fixed,
                       parallel_mode=parallel_mode, fully_use_devices=fully_use_devices,
                       optimizer=optimizer, micro_batches=micro_batches)
    files = s.pmode in USES_STRATEGY_FILES
    if (load or save) and not files and cfg.parallel_mode in USES_STRATEGY_FILES:
        warnings.warn(f"strategy files are used only in semi_auto_parallel and auto_parallel: "
                      f"parallel_mode={s.pmode!r} (the argument) ignores "
                      + " and ".join(f"{k}={v!r}" for k, v in (
                          ("strategy_ckpt_load_file", load), ("strategy_ckpt_save_file", save))
                          if v), AutoParallelWarning, stacklevel=user_stacklevel())
    if files and load:  # priced on the file's own cluster unless named
        plan = _load(graph, load, cfg.pipeline_stages, s.n,
                     setup.cluster if setup.cluster_named else None, s.fixed_map,
                     s.settings, s.annotated)
    else:
        plan = _advised(search_plan, graph, s, setup, advise)
    if stage is not None:
        plan = replace(plan, stages={**plan.stages, **dict.fromkeys(plan.nodes, stage)})
    if files and save:  # (written by the entry point: a bad path fails before the build)
        writable_target(save, "strategy_ckpt_save_file")
    return plan


def ranked_candidates(graph: Graph, setup: Setup, *, mode: str | None = None,
                      fixed: Mapping[str, Any] | None = None,
                      optimizer: Any = None, micro_batches: int = 1) -> list[tuple[str, Plan]]:
    """The plans a search weighs, cheapest first, as (name, plan): the search's own and the
    hand plans (:func:`autopar.strategies.search.ranked_plans`), on the setup its caller's
    entry point resolved; no strategy file is read or written (``micro_batches``: as
    :func:`plan_graph`'s)."""
    s = _search_inputs(graph, setup, mode=mode, device_num=None, fixed=fixed,
                       parallel_mode=None, fully_use_devices=None, optimizer=optimizer,
                       micro_batches=micro_batches)
    return _advised(ranked_plans, graph, s, setup)


def _advised(searcher: Any, graph: Graph, s: "_SearchInputs", setup: Setup,
             advised: bool = True) -> Any:
    """``searcher`` (:func:`search_plan` or :func:`ranked_plans`) on the checked inputs; when
    no plan fits the memory budget, the error says what would
    (:func:`autopar.strategies.fit.advise`; ``advised`` False: the search's own error)."""
    clus = note_devices(setup.cluster, s.n)
    try:
        return searcher(graph, mode=s.mode, device_num=s.n, cluster=clus, fixed=s.fixed_map,
                        settings=s.settings)
    except MemoryBudgetError as e:
        if not advised:
            raise
        raise advise(graph, e, mode=s.mode, device_num=s.n, cluster=clus, fixed=s.fixed_map,
                     settings=s.settings) from None


@dataclass(frozen=True)
class _SearchInputs:
    pmode: str
    mode: str
    n: int
    fixed_map: dict
    annotated: dict
    settings: SearchSettings


def _search_inputs(graph: Graph, setup: Setup, *, mode: str | None, device_num: int | None,
                   fixed: Mapping[str, Any] | None, parallel_mode: str | None,
                   fully_use_devices: bool | None, optimizer: Any = None,
                   micro_batches: int = 1) -> _SearchInputs:
    """The checked values a search takes from its arguments, else the setup's configuration
    and algorithm parameters."""
    cfg, algo = setup.config, setup.algo
    if fully_use_devices is None:
        fully_use_devices = algo.fully_use_devices
    if not isinstance(fully_use_devices, bool):
        raise AutoParallelTypeError("fully_use_devices", fully_use_devices, "must be a bool")
    if not isinstance(graph, Graph):
        raise AutoParallelTypeError("graph", graph, "autopar.search takes the Graph returned "
                                    "by autopar.trace")
    pmode = _check_parallel_mode(cfg.parallel_mode if parallel_mode is None else parallel_mode)
    m = _check_search_mode(cfg.search_mode if mode is None else mode)
    n = 1 if pmode == "stand_alone" else _check_device_num(
        cfg.device_num if device_num is None else device_num)
    fixed_map, annotated = _user_strategies(graph, fixed, pmode, n)
    if mode is not None and pmode != "auto_parallel":
        warnings.warn(f"mode={mode!r} is only used by auto_parallel: parallel_mode={pmode!r} "
                      "(as the context's search_mode)", AutoParallelWarning,
                      stacklevel=user_stacklevel())
    settings = SearchSettings.from_config(
        cfg, parallel_mode=pmode, fully_use_devices=fully_use_devices,
        elementwise_op_strategy_follow=algo.elementwise_op_strategy_follow,
        hand_plan_margin=algo.hand_plan_margin,
        optimizer_state=_optimizer_state(graph, optimizer),
        micro_batches=_check_micro_batches(micro_batches))
    return _SearchInputs(pmode, m, n, fixed_map, annotated, settings)


def _check_micro_batches(m: Any) -> int:
    if not isinstance(m, int) or isinstance(m, bool):
        raise AutoParallelTypeError("micro_batches", m, "must be an int")
    if m < 1:
        raise AutoParallelError("micro_batches", m, "the micro-batches one optimizer step "
                                "runs the graph for must be at least 1")
    return m


def _optimizer_state(graph: Graph, optimizer: Any) -> tuple[tuple[str, float], ...] | None:
    """Per parameter of ``graph``, the bytes of state ``optimizer`` keeps per parameter byte
    (:func:`~autopar.strategies.precision.optimizer_state`, on the parameters as the
    function was traced on them: their tree where the trace kept it); None without one."""
    if optimizer is None:
        return None
    if not callable(getattr(optimizer, "init", None)):
        raise AutoParallelTypeError("optimizer", optimizer, "an optax GradientTransformation "
                                    "(with init and update)")
    names = graph.parameters()
    # (typed PRNG keys are carried, never trained: the optimizer does not see them)
    specs = [None if is_key(graph.spec(v).dtype) else
             jax.ShapeDtypeStruct(graph.spec(v).shape, graph.spec(v).dtype) for v in names]
    tree = graph.in_tree.children()[0] if graph.in_tree is not None and \
        graph.in_tree.num_leaves >= len(names) else None
    params = jax.tree_util.tree_unflatten(tree, specs) \
        if tree is not None and tree.num_leaves == len(specs) else specs
    try:
        ratios = optimizer_state(optimizer, params)
    except Exception as e:  # noqa: BLE001 - the user's optimizer: priced by the factor
        warnings.warn(f"optimizer: {type(optimizer).__name__}'s init failed on the traced "
                      f"parameters ({type(e).__name__}: {e}); its state is priced as the "
                      "cluster's optimizer_state_factor", AutoParallelWarning,
                      stacklevel=user_stacklevel())
        return None
    return tuple(zip([v for v, s in zip(names, specs) if s is not None], ratios))


def _user_strategies(graph: Graph, fixed: Any, pmode: str, n: int) -> tuple[dict, dict]:
    """The user's strategies a search on ``n`` devices under ``pmode`` honours: ``fixed=``
    (checked, Layouts made split counts) and the graph's annotations ``fixed=`` does not
    replace. Under a mode that uses none (stand_alone, data_parallel) they are not checked,
    and a warning says they are not used; so for parameter_plan's layouts on one device
    (stand_alone: data_parallel stores parameters as they say)."""
    if fixed is not None and not isinstance(fixed, Mapping):
        raise AutoParallelTypeError("fixed", fixed, "a mapping of node name -> strategy")
    for name in fixed or {}:
        if not isinstance(name, str):
            raise AutoParallelTypeError("fixed", name, "its keys are node names (str); see "
                                        "graph.summary()")
    used = pmode in USES_USER_STRATEGIES  # Layouts: the product is device_num
    if not used:
        given = [f"fixed strategies for {len(fixed)} operator(s)"] if fixed else []
        given += [f"{len(d)} {what}" for d, what in (
            (graph.annotations(), "annotated operator(s) (autopar.shard, Graph.annotate)"),
            (graph.parameter_layouts() if pmode not in USES_PARAMETER_PLANS else {},
             "parameter layout(s) (parameter_plan)")) if d]
        if given:
            warnings.warn(
                f"{' and '.join(given)} are not used under parallel_mode={pmode!r} ("
                + ("one device: nothing is split" if pmode == "stand_alone" else
                   "every operator is data parallel there") + "); use "
                + ", ".join(USES_USER_STRATEGIES) + " to honour them", AutoParallelWarning,
                stacklevel=user_stacklevel())
        return {}, {}
    fixed_map = {name: to_strategy(strategy, f"fixed node {name!r}", n)
                 for name, strategy in (fixed or {}).items()}
    for name, count in graph.layout_devices.items():
        if count != n:  # (shard / parameter_plan / annotate Layouts: as fixed= above)
            raise AutoParallelError(f"Layout of {name!r}", count, f"its device matrix has "
                                    f"{count} devices; it must have device_num={n}")
    return fixed_map, {name: to_strategy(a, f"annotated node {name!r}", n)
                       for name, a in graph.annotations().items() if name not in fixed_map}


@dataclass(frozen=True)
class StrategySave:
    """A strategy file an entry point writes once it has built what the plan runs: ``plan``
    searched on ``graph``, its ``path``, and ``tuning``: the measurements that chose it
    (:mod:`autopar.tune`, kept in the file) or None."""

    plan: Plan
    graph: Graph
    path: Any
    tuning: Mapping[str, Any] | None = None


def strategy_saves(plan: Plan, graph: Graph, setup: Setup, *, path: Any = None,
                   parallel_mode: str | None = None,
                   tuning: Mapping[str, Any] | None = None) -> tuple[StrategySave, ...]:
    """The save of ``plan``'s strategy file (one, or none): to ``path`` (default the
    configuration's ``strategy_ckpt_save_file``; empty: none) where the parallel mode
    (default the configuration's) uses strategy files, as :func:`plan_graph` planned it."""
    cfg = setup.config
    path = cfg.strategy_ckpt_save_file if path is None else path
    pmode = cfg.parallel_mode if parallel_mode is None else parallel_mode
    if not path or pmode not in USES_STRATEGY_FILES:
        return ()
    return (StrategySave(plan, graph, path, tuning),)


def save_strategies(saves: Sequence[StrategySave]) -> None:
    """Write ``saves``, the last step of an entry point (load or search; build; then save):
    all or nothing (:func:`autopar.files.write_files_atomic`), so one whose second file
    cannot be written (a full disk) leaves the first as it was. Every process of a
    ``jax.distributed`` job writes the same bytes (:func:`check_same_plans` checked them)."""
    if saves:
        write_files_atomic([(s.path, dumps_strategy(strategy_document(s.plan, s.graph,
                                                                      s.tuning)),
                             "strategy_ckpt_save_file") for s in saves])


def _check_parallel_mode(pmode: Any) -> str:
    if pmode not in PARALLEL_MODES:
        raise AutoParallelError("parallel_mode", pmode, "unknown parallel mode; choose one of "
                                f"{list(PARALLEL_MODES)}")
    return pmode


def _check_search_mode(m: Any) -> str:
    if not isinstance(m, str):
        raise AutoParallelTypeError("mode", m, f"a search mode name, one of {sorted(SOLVERS)}")
    if m not in SOLVERS:
        raise AutoParallelError("mode", m, f"unknown search mode; choose one of {sorted(SOLVERS)}")
    return m


def _check_device_num(n: Any) -> int:
    if not isinstance(n, int) or isinstance(n, bool):
        raise AutoParallelTypeError("device_num", n, "must be an int")
    if not 1 <= n <= MAX_DEVICES:
        raise AutoParallelError("device_num", n, f"must be in [1, {MAX_DEVICES}]")
    return n


def _load(graph: Graph, path: str, stages: int, n: int, cluster: Cluster | None,
          fixed_map: dict, settings: SearchSettings, annotated: dict) -> Plan:
    """The plan of the strategy file ``path``; the user's strategies (``fixed=``, then the
    annotations ``fixed=`` does not replace) must agree with it."""
    plan = load_plan(path, graph, device_num=n, cluster=cluster, settings=settings,
                     pipeline_stages=stages)
    for what, given, drop in (("fixed strategy", fixed_map, "fixed="),
                              ("annotated strategy", annotated, "the annotation")):
        for name, strategy in sorted(given.items()):
            graph.node(name)
            if check_strategy_shape(strategy, None, name) != plan.nodes[name].strategy:
                raise AutoParallelError(
                    f"{what} of node {name!r}", strategy,
                    f"conflicts with {plan.nodes[name].strategy} in strategy_ckpt_load_file "
                    f"{path!r}", f"Drop {drop} or the load file")
    return plan


def partition_stages(graph: Graph, stages: int, *, boundaries: Sequence[str | int] | None = None,
                     device_num: int | None = None, micro_batches: int | None = None,
                     cluster: str | Cluster | None = None) -> StagePartition:
    """Cut ``graph`` into ``stages`` pipeline stages
    (:func:`autopar.strategies.stages.partition_stages`). ``device_num``: all devices
    (default: the context's); each stage gets ``device_num / stages``. ``cluster``: as for
    :func:`search`. ``boundaries``: fix the cuts instead of searching them.
    ``micro_batches``: ``m`` of the objective (default ``stages``).
    """
    setup = resolve_setup(cluster)
    n = setup.config.device_num if device_num is None else device_num
    return _partition_stages(graph, stages, device_num=n, cluster=setup.cluster,
                             boundaries=boundaries, micro_batches=micro_batches)


def explain(graph: Graph, plan: Plan, node: str, *,
            cluster: str | Cluster | None = None) -> Explanation:
    """Why ``plan`` gives operator ``node`` its strategy: every strategy the operator could
    take (the search's space: ``fully_use_devices`` as set), the rest of the plan held, each
    priced whole (:mod:`autopar.strategies.explain`), cheapest first. ``cluster``: price on
    another cost model (default: the plan's own; a preset, ``"calibrated"``, a file or a
    :class:`Cluster`) -- where the plan's choice is then not the cheapest, that is what the
    other model would change. Data inputs are laid out by the context's dataset_strategy.
    ``print(ap.explain(graph, plan, name))`` shows the table."""
    _check_explain(graph, plan, node)
    return _explained(graph, plan, node, resolve_setup(cluster), own=cluster is None)


def explain_node(graph: Graph, plan: Plan, node: str, setup: Setup, *,
                 own_cluster: bool = True) -> Explanation:
    """:func:`explain` on the setup its caller resolved (the CLI's, once per command),
    reading no store: priced on the plan's own cluster where ``own_cluster`` (as
    ``explain(cluster=None)``), else on the setup's."""
    _check_explain(graph, plan, node)
    return _explained(graph, plan, node, setup, own=own_cluster)


def _check_explain(graph: Any, plan: Any, node: Any) -> None:
    """:func:`explain`'s checks of its arguments."""
    if not isinstance(graph, Graph):
        raise AutoParallelTypeError("graph", graph, "the Graph returned by autopar.trace")
    if not isinstance(plan, Plan):
        raise AutoParallelTypeError("plan", plan, "a Plan from autopar.search or "
                                    "autopar.load_strategy")
    if not isinstance(node, str):
        raise AutoParallelTypeError("node", node, "an operator's name (str; plan.nodes lists "
                                    "them)")
    if not plan.searched_on(graph):
        raise AutoParallelError("plan", f"fingerprint {plan.fingerprint[:12]}", "it was not "
                                f"searched on this graph (fingerprint "
                                f"{graph.fingerprint()[:12]})", "Trace the function the plan "
                                "was searched for")
    graph.node(node)  # (an unknown name: the graph's error, with the closest names)
    if plan.stages:
        raise AutoParallelError("plan", f"{len(set(plan.stages.values()))} pipeline stages",
                                "explain takes one stage's plan and graph (a pipelined "
                                "step's plans[s] and stage_graphs[s])")


def _explained(graph: Graph, plan: Plan, node: str, setup: Setup, *,
               own: bool) -> Explanation:
    """:func:`explain`'s table on a checked plan and node (``own``: the plan's cluster)."""
    priced = plan.cluster_config if own and plan.cluster_config is not None \
        else setup.cluster
    rows = alternatives(graph, plan, node, CostModel(priced),
                        full_use=setup.algo.fully_use_devices,
                        dataset_strategy=setup.config.dataset_strategy)
    out = Explanation(node, plan.nodes[node].op, plan.mode, priced.name, tuple(rows))
    mine = out.chosen.objective
    if own and abs(mine - plan.objective) > 1e-9 * abs(plan.objective):
        out = replace(out, notes=(f"note: the plan re-priced here costs {mine * 1e3:.4g} ms, "
                                  f"{plan.objective * 1e3:.4g} ms when it was searched "
                                  "(another dataset_strategy or search setting)",))
    return out


def check_same_plans(parts: Sequence[tuple[Plan, Graph, Any]]) -> None:
    """Under ``jax.distributed``: raise the same error on every process unless each built
    process 0's plans -- (plan, graph, parallel graph) triples, compared by their strategy
    file text and collectives (:func:`autopar.multihost.check_same`). Nothing to do in one
    process."""
    if several():  # every process must lower the same program
        check_same("".join(dumps_strategy(strategy_document(plan, graph)) +
                           repr(pg.comm_counts()) for plan, graph, pg in parts),
                   "plan", "the plan (its strategy file text and collectives)")
