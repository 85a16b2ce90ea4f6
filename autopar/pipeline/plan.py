"""The stages of a pipelined step and each stage's plan.

The loss, traced at micro-batch size, is cut into ``p`` stages
(:func:`autopar.strategies.stages.partition_stages`: searched, or at the user's boundaries);
each stage's subgraph is searched for its ``device_num / p`` devices with the ordinary
:func:`autopar.search` and rewritten without the fused ring kernels. The strategy files are
one per stage, ``strategy_stage{s}``, as MindSpore keeps them (:func:`stage_saves`), written
together by the entry point once the whole step is built.
:class:`PipelinePlan` is the result a step shows as ``.plan``.

>>> stage_file("/tmp/strategy.json", 1)
'/tmp/strategy_stage1.json'
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from autopar.errors import AutoParallelTypeError
from autopar.files import writable_target
from autopar.graph.ir import Graph
from autopar.multihost import together
from autopar.parallel_graph import ParallelGraph
from autopar.pipeline.schedules import Schedule
from autopar.planner import StrategySave, check_same_plans, plan_graph, strategy_saves
from autopar.rewrite import rewrite
from autopar.setup import Setup
from autopar.strategies.plan import Plan
from autopar.strategies.stages import StagePartition, partition_stages, stage_graph

__all__ = ["PipelinePlan", "StagePlans", "plan_stages", "renamed_plan", "search_stages",
           "stage_file", "stage_saves"]


@dataclass(frozen=True)
class PipelinePlan:
    """Stages, schedule and each stage's plan (over ``device_num / p`` devices)."""

    partition: StagePartition
    schedule: Schedule
    plans: tuple[Plan, ...]
    micro_batches: int
    grad_accumulation_step: int
    notes: tuple[str, ...] = ()  # e.g. the other schedule priced faster than the default

    @property
    def stages(self) -> int:
        return self.partition.stages

    def summary(self) -> str:
        lines = [f"pipeline: {self.stages} stages x {self.micro_batches} micro-batches, "
                 f"schedule {self.schedule.name}, grad_accumulation_step "
                 f"{self.grad_accumulation_step}; {self.schedule.ticks} ticks per round, "
                 f"peak in-flight micro-batches per stage {self.schedule.peak_in_flight}",
                 self.partition.summary(), *self.notes]
        for s, plan in enumerate(self.plans):
            lines.append(f"  stage {s} {plan.summary()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


@dataclass(frozen=True)
class StagePlans:
    """What :func:`plan_stages` found: the partition, and per stage its subgraph, its plan
    and its parallel program."""

    partition: StagePartition
    graphs: tuple[Graph, ...]
    plans: tuple[Plan, ...]
    parallel_graphs: tuple[ParallelGraph, ...]


def stage_file(path: str, stage: int) -> str:
    """The strategy file of pipeline stage ``stage`` for a context path ("" stays "")."""
    if not path:
        return ""
    root, ext = os.path.splitext(path)
    return f"{root}_stage{stage}{ext}"


def stage_saves(plans: Sequence[Plan], graphs: Sequence[Graph],
                setup: Setup) -> tuple[StrategySave, ...]:
    """The stages' strategy files (:func:`stage_file` of the configuration's
    ``strategy_ckpt_save_file``, in stage order), for the entry point to write together
    (:func:`autopar.planner.save_strategies`: all or none) once the step is built."""
    path = setup.config.strategy_ckpt_save_file
    return tuple(save for s, (plan, sg) in enumerate(zip(plans, graphs))
                 for save in strategy_saves(plan, sg, setup, path=stage_file(path, s)))


def _rewrite_unfused(graph: Any, plan: Plan) -> ParallelGraph:
    """``rewrite`` without the fused ring kernels: their ``collective_permute`` inside a
    stage's branch would deadlock (XLA's CPU runtime meets a collective-permute with every
    device of the program, and the other stages are in other branches)."""
    return rewrite(graph, plan, fused_kernels=False)


def plan_stages(graph: Graph, p: int, *, setup: Setup, micro_batches: int,
                boundaries: Sequence[str | int] | None, mode: str | None,
                fixed: Mapping[str, Any] | None, optimizer: Any = None,
                searched: Sequence[Plan] | None = None) -> StagePlans:
    """Cut ``graph`` into ``p`` stages and search, then rewrite, each one for its
    ``device_num / p`` devices (:func:`search_stages`; no file written: the entry point
    saves the stages' files, :func:`stage_saves`)."""
    part, sgs, plans = search_stages(graph, p, setup=setup, micro_batches=micro_batches,
                                     boundaries=boundaries, mode=mode, fixed=fixed,
                                     optimizer=optimizer, searched=searched)
    pgs = [_rewrite_unfused(sg, plan) for sg, plan in zip(sgs, plans)]
    check_same_plans(list(zip(plans, sgs, pgs)))  # (jax.distributed), before any save
    return StagePlans(part, sgs, plans, tuple(pgs))


def search_stages(graph: Graph, p: int, *, setup: Setup, micro_batches: int,
                  boundaries: Sequence[str | int] | None, mode: str | None,
                  fixed: Mapping[str, Any] | None, advise: bool = True,
                  optimizer: Any = None, searched: Sequence[Plan] | None = None
                  ) -> tuple[StagePartition, tuple[Graph, ...], tuple[Plan, ...]]:
    """Cut ``graph`` into ``p`` stages and search each one for its ``device_num / p``
    devices: ``(partition, stage graphs, stage plans)``. ``fixed``: strategies by node name
    of the whole graph (each stage takes its own); ``setup``: the step's (its strategy-file
    paths become one file per stage; its cluster prices the partition and every stage).
    Each stage is searched as one of the ``grad_accumulation_step x micro_batches``
    micro-batches of a step: its gradient sync and optimizer update charged once a step
    (``SearchSettings.micro_batches``). ``advise`` and ``optimizer`` (its state priced per
    parameter): as :func:`autopar.planner.plan_graph`'s. ``searched``: the stage plans a
    search with these settings already found (the configuration search's): a stage whose
    plan was searched on its very graph, with no strategy file to load, takes it as it is."""
    config = setup.config
    n = config.device_num
    with together():  # every process builds the step: process 0's cluster (jax.distributed)
        cluster = setup.cluster  # (first used here: the partition and every stage price on it)
    part = partition_stages(graph, p, boundaries=boundaries, device_num=n,
                            micro_batches=micro_batches, cluster=cluster)
    fixed = dict(fixed or {}) if fixed is None or isinstance(fixed, Mapping) else fixed
    if not isinstance(fixed, dict):
        raise AutoParallelTypeError("fixed", fixed, "a mapping of node name -> strategy")
    for name in fixed:
        graph.node(name)  # unknown names raise, with suggestions
    sgs = tuple(stage_graph(graph, part, s) for s in range(p))
    plans: list[Plan] = []
    seen: dict[str, int] = {}  # a stage's structure without names -> the stage searched
    for s, sg in enumerate(sgs):
        mine = {k: v for k, v in fixed.items() if k in {nd.name for nd in sg.nodes}}
        load = stage_file(config.strategy_ckpt_load_file, s)
        save = stage_file(config.strategy_ckpt_save_file, s)
        key = None if mine or load else _structure_key(sg)
        given = searched[s] if searched is not None and len(searched) == p else None
        if given is not None and not load and given.searched_on(sg):
            plan = given  # (found by the same search before: the configuration search's)
            if save:  # (saved by the entry point: a bad path fails at once)
                writable_target(save, "strategy_ckpt_save_file")
        elif key in seen:  # the same structure as a stage already searched: its plan
            plan = renamed_plan(plans[seen[key]], sgs[seen[key]], sg, s)
            if save:  # (saved by the entry point: a bad path fails at once)
                writable_target(save, "strategy_ckpt_save_file")
        else:
            plan = plan_graph(sg, setup, mode=mode, device_num=n // p, fixed=mine,
                              load_file=load, save_file=save,
                              micro_batches=micro_batches * config.grad_accumulation_step,
                              stage=s, advise=advise, optimizer=optimizer)
            if key is not None:
                seen[key] = s
        plans.append(plan)
    return part, sgs, tuple(plans)


def _order(graph: Graph) -> tuple[list[str], list[str]]:
    """The graph's node names and value names in order: its inputs, then each node's inputs
    (not met before) and outputs."""
    values = dict.fromkeys(graph.inputs)
    for nd in graph.nodes:
        values.update(dict.fromkeys(nd.inputs))
        values.update(dict.fromkeys(nd.outputs))
    return [nd.name for nd in graph.nodes], list(values)


def _structure_key(graph: Graph) -> str:
    """``Graph.structure()`` with every node and value named by its position
    (:func:`_order`), hashed: stage graphs that differ only in their names (the middle
    stages of a stack of identical layers) share it."""
    nodes, values = _order(graph)
    index = {v: f"v{i}" for i, v in enumerate(values)}

    def named(x: Any) -> Any:
        if isinstance(x, str):
            return index.get(x, x)
        return {**x, "name": index.get(x["name"], x["name"])}

    st = graph.structure()
    blob = json.dumps({"inputs": [named(e) for e in st["inputs"]],
                       "outputs": [named(o) for o in st["outputs"]],
                       "nodes": [{**e, "name": str(i), "inputs": [named(x) for x in e["inputs"]],
                                  "outputs": [named(x) for x in e["outputs"]]}
                                 for i, e in enumerate(st["nodes"])]},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def renamed_plan(plan: Plan, source: Graph, graph: Graph, stage: int) -> Plan:
    """``plan`` of ``source`` as the plan of ``graph``, a graph of the same structure
    (:func:`_structure_key`) under other names: every operator's strategy and every value's
    layout taken by position; its prices are the same."""
    (src_n, src_v), (dst_n, dst_v) = _order(source), _order(graph)
    nmap, vmap = dict(zip(src_n, dst_n)), dict(zip(src_v, dst_v))
    return replace(plan, graph_fingerprint=graph,
                   nodes={nmap[k]: replace(ns, name=nmap[k]) for k, ns in plan.nodes.items()},
                   layouts={vmap.get(k, k): lay for k, lay in plan.layouts.items()},
                   parameters=tuple(vmap[v] for v in plan.parameters),
                   inputs=tuple(vmap[v] for v in plan.inputs),
                   stages={nmap[k]: stage for k in plan.stages}, search_seconds=0.0)
