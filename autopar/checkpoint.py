"""Strategy files: save a searched plan, load it instead of searching (MindSpore's
``strategy_ckpt_save_file`` / ``strategy_ckpt_load_file``).

A strategy file is versioned JSON validated by a strict pydantic schema (unknown fields are
errors). It keeps what MindSpore's strategy checkpoint keeps — per operator the strategy
tuples and its pipeline stage (``parallel_strategy_item``), per parameter the tensor layout
(``parallel_layout_item``: device matrix, tensor map, tensor shape, slice shape) — plus what
autopar needs to rebuild the plan exactly: the graph fingerprint, device_num and mesh, each
operator's split per loop dimension, the data inputs' layouts, the cluster the plan was priced
on, ``enable_alltoall``, the memory weight of the objective and the parallel optimizer's
threshold (``parallel_optimizer_kb``) and, only when it is not -1 (so files of the default stay
as they were), its shard group size (``optimizer_weight_shard_size``); likewise, only when
they are not the default, the mixed precision it was priced with (``gradient_fp32_sync:
false``; ``optimizer_state``: per parameter the bytes of optimizer state per parameter byte
``optimizer.init`` keeps, :mod:`autopar.strategies.precision`; ``micro_batches``: the
micro-batches of a step its objective was priced for, :class:`~autopar.strategies.problem.
Breakdown`). A plan chosen by measured
tuning (:mod:`autopar.tune`) also keeps its measurements (``tuning``: the candidates' predicted
and measured step times, the chosen one, the machine they were measured on); files without it
are the files of before, byte for byte.

Writes are atomic (a temporary file in the same directory, then ``os.replace``), and the same
plan always gives the same bytes (sorted keys, ``repr`` floats, no timings but a tuning's
measurements, written only when given). Loading checks
everything before anything is used and raises :class:`StrategyFileError` (an
``AutoParallelError``) naming the file, the field, what was expected and what was found.

>>> import jax.numpy as jnp, autopar as ap
>>> def loss(p, x):
...     return jnp.sum(jnp.tanh(x @ p["w"]))
>>> g = ap.trace(loss, {"w": jnp.ones((16, 32))}, jnp.ones((8, 16)))
>>> with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
...     plan = ap.search(g)
...     path = save_strategy(plan, g, "/tmp/autopar-doctest-strategy.json")
...     again = load_strategy(path, g)
>>> (again.nodes, again.layouts, again.cost) == (plan.nodes, plan.layouts, plan.cost)
True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from autopar.errors import (AutoParallelError, AutoParallelTypeError, FileFieldError,
                            from_validation_problem, validation_problems)
from autopar.files import (read_json_document, validation_failure, write_bytes_atomic,
                           write_text_atomic)
from autopar.graph.ir import Graph, check_strategy_shape
from autopar.graph.loops import LOOP_KIND, loop_body, loop_nodes
from autopar.limits import MAX_DEVICES
from autopar.strategies.cost import Cluster, CostModel, get_cluster
from autopar.strategies.layout import DeviceMesh, TensorLayout
from autopar.strategies.modes import PARALLEL_MODES, SEARCH_MODES
from autopar.strategies.loops import PlannedLoops
from autopar.strategies.plan import Fingerprint, NodeStrategy, Plan, Pricing
from autopar.strategies.problem import Breakdown, Problem, splits_from_strategy
from autopar.strategies.search import SearchSettings

__all__ = ["FORMAT", "VERSION", "StrategyFile", "StrategyFileError", "TuningEntry",
           "save_strategy", "load_strategy", "read_strategy_file", "strategy_document",
           "dumps_strategy",
           "layout_entry", "layout_from_entry", "write_bytes_atomic", "write_text_atomic"]

FORMAT = "autopar-strategy"
VERSION = 1


class StrategyFileError(FileFieldError):
    """A strategy file that cannot be used: names the file, the field, expected vs found."""

    what = "strategy file"


# ---------------------------------------------------------------------------- schema

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class OperatorEntry(BaseModel):
    """One operator: MindSpore's ``{"stage", "parallel_strategy"}`` plus autopar's loop splits;
    a loop node's also its body plan (``body``, written only for loop nodes)."""

    model_config = _STRICT
    op: str
    stage: int = Field(ge=0)
    parallel_strategy: list[list[int]]
    splits: list[int]
    body: "LoopBodyEntry | None" = None


class LayoutEntry(BaseModel):
    """MindSpore's tensor layout fields. ``dev_matrix`` is the mesh (outermost axis first);
    ``tensor_map`` per tensor dim: the device-matrix dim it is split over, counted from the
    right as MindSpore does (-1: not split), or a list of them (outer first) when a dim is split
    over several axes; ``slice_shape`` is the local shape on one device."""

    model_config = _STRICT
    dev_matrix: list[int]
    tensor_map: list[int | list[int]]
    tensor_shape: list[int]
    slice_shape: list[int]
    field: int = 0
    opt_weight_shard_step: int = 0
    opt_weight_shard_size: int = 0


class LoopBodyEntry(BaseModel):
    """A loop node's body plan: its operators (named within the body) and its parameters'
    layouts (each iteration's slice); its data inputs' layouts are the loop's ``splits``."""

    model_config = _STRICT
    parallel_strategy_item: dict[str, OperatorEntry]
    parallel_layout_item: dict[str, LayoutEntry]


OperatorEntry.model_rebuild()


class MeshAxis(BaseModel):
    model_config = _STRICT
    name: str
    size: int = Field(ge=2)


class Predicted(BaseModel):
    """The plan's predicted cost when it was saved (seconds, bytes per device)."""

    model_config = _STRICT
    step_seconds: float = Field(ge=0)
    compute: float = Field(ge=0)
    communication: float = Field(ge=0)
    redistribution: float = Field(ge=0)
    gradient_sync: float = Field(ge=0)
    memory_bytes: float = Field(ge=0)
    objective: float = Field(ge=0)


class TuningRowEntry(BaseModel):
    """One candidate plan a tuning measured: its name (``dynamic_programming``,
    ``data_parallel``, ``megatron tp4``, ...), predicted and measured step (ms; measured is
    null when only one distinct plan was there to run) and whether it was kept."""

    model_config = _STRICT
    name: str = Field(min_length=1, max_length=200)
    predicted_ms: float = Field(ge=0)
    measured_ms: float | None = Field(ge=0)
    chosen: bool


class TuningEntry(BaseModel):
    """The measurements of a tuning (:mod:`autopar.tune`): the machine and cost model they
    were taken on, the timed rounds and one row per candidate, in priced order, one chosen
    (the plan of the file)."""

    model_config = _STRICT
    machine: str = Field(min_length=1, max_length=1000)
    cluster: str = Field(min_length=1, max_length=1000)
    steps: int = Field(ge=1)
    rows: list[TuningRowEntry] = Field(min_length=1, max_length=1000)

    @field_validator("rows")
    @classmethod
    def _one_chosen(cls, rows: list[TuningRowEntry]) -> list[TuningRowEntry]:
        chosen = [r.name for r in rows if r.chosen]
        if len(chosen) != 1:
            raise ValueError(f"exactly one row is chosen (found {len(chosen)})")
        if len({r.name for r in rows}) != len(rows):
            raise ValueError("the rows' names are distinct")
        return rows

    @property
    def chosen(self) -> TuningRowEntry:
        return next(r for r in self.rows if r.chosen)


class StrategyFile(BaseModel):
    """The whole file (format ``autopar-strategy``, version 1)."""

    model_config = _STRICT
    format: Literal["autopar-strategy"]
    version: int
    fingerprint: str = Field(min_length=1)
    device_num: int = Field(ge=1, le=MAX_DEVICES)
    mesh: list[MeshAxis]
    mode: str
    cluster: dict[str, Any]
    enable_alltoall: bool
    memory_weight: float = Field(ge=0)
    parallel_optimizer_kb: int | None = Field(default=None, ge=0)
    # written only when not -1 (the whole data-parallel group): default files keep their bytes
    optimizer_weight_shard_size: int = Field(default=-1, ge=-1, le=MAX_DEVICES)
    # mixed precision as priced (strategies.precision), each written only when it is not the
    # default (gradient_fp32_sync acting; the cluster's optimizer_state_factor)
    gradient_fp32_sync: bool = True
    optimizer_state: dict[str, Annotated[float, Field(ge=0, le=1e6)]] | None = None
    # the micro-batches of a step the objective was priced per (written only when not 1)
    micro_batches: int = Field(default=1, ge=1, le=2**31 - 1)
    current_stage: int = Field(ge=0)
    parallel_strategy_item: dict[str, OperatorEntry]
    parallel_layout_item: dict[str, LayoutEntry]
    data_layout_item: dict[str, LayoutEntry]
    predicted: Predicted
    # written only by a tuning (autopar.tune): files without it keep their bytes
    tuning: TuningEntry | None = None

    @field_validator("optimizer_weight_shard_size")
    @classmethod
    def _shard_size(cls, v: int) -> int:
        if v in (0, 1):
            raise ValueError("optimizer_weight_shard_size is -1 (the whole data-parallel "
                             f"group) or in [2, {MAX_DEVICES}]")
        return v


# ---------------------------------------------------------------------------- layouts


def layout_entry(layout: TensorLayout, shape: tuple[int, ...], mesh: DeviceMesh) -> dict[str, Any]:
    """MindSpore's layout fields for a layout (see :class:`LayoutEntry`).

    >>> mesh = DeviceMesh.for_devices(8)
    >>> layout_entry(TensorLayout(((), ("a1", "a2"))), (16, 32), mesh)["tensor_map"]
    [-1, [1, 0]]
    """
    names = mesh.names
    tmap: list[int | list[int]] = []
    for d in layout.dims:
        idx = [len(names) - 1 - names.index(a) for a in d]
        tmap.append(-1 if not idx else idx[0] if len(idx) == 1 else idx)
    return {"dev_matrix": [s for _, s in mesh.axes], "tensor_map": tmap,
            "tensor_shape": list(shape), "slice_shape": list(layout.local_shape(shape, mesh)),
            "field": 0, "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}


def layout_from_entry(entry: LayoutEntry, mesh: DeviceMesh, where: str,
                      path: str) -> TensorLayout:
    """The :class:`TensorLayout` of a layout entry, checked against ``mesh``."""
    n = len(mesh.axes)
    dims: list[tuple[str, ...]] = []
    seen: set[int] = set()
    for k, m in enumerate(entry.tensor_map):
        idx = [m] if isinstance(m, int) else list(m)
        if idx == [-1]:
            dims.append(())
            continue
        if not idx or any(not 0 <= i < n for i in idx) or seen & set(idx) or \
                len(set(idx)) != len(idx):
            raise StrategyFileError(path, f"{where}.tensor_map[{k}]",
                                    f"-1 or distinct device-matrix dims in [0, {n}) not used "
                                    "by another tensor dim", m)
        seen.update(idx)
        dims.append(tuple(mesh.names[n - 1 - i] for i in idx))
    return TensorLayout(tuple(dims))


# ---------------------------------------------------------------------------- save


def strategy_document(plan: Plan, graph: Graph,
                      tuning: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document of a plan (a plain dict, validated by :class:`StrategyFile`);
    ``tuning``: the measurements that chose it (:class:`TuningEntry`'s fields), or None."""
    if not isinstance(plan, Plan):
        raise AutoParallelTypeError("plan", plan, "a Plan from autopar.search")
    if not isinstance(graph, Graph):
        raise AutoParallelTypeError("graph", graph, "the Graph the plan was searched for")
    if plan.fingerprint != graph.fingerprint():
        raise AutoParallelError("graph", graph.name, f"fingerprint {graph.fingerprint()} is "
                                f"not the plan's {plan.fingerprint}",
                                "Save a plan with the graph it was searched for")
    mesh = plan.mesh
    stages: Mapping[str, int] = plan.stages
    cluster_doc = plan.cluster_config
    if cluster_doc is None and plan.cluster in _preset_names():
        cluster_doc = get_cluster(plan.cluster)
    c, priced = plan.cost, plan.pricing
    doc = {
        "format": FORMAT, "version": VERSION, "fingerprint": plan.fingerprint,
        "device_num": plan.device_num,
        "mesh": [{"name": a, "size": s} for a, s in mesh.axes],
        "mode": plan.mode,
        "cluster": cluster_doc.model_dump(mode="json") if cluster_doc is not None else
        {"name": plan.cluster},
        "enable_alltoall": priced.enable_alltoall, "memory_weight": float(priced.memory_weight),
        "parallel_optimizer_kb": priced.parallel_optimizer_kb,
        "current_stage": max(stages.values(), default=0),  # (a stage's file: its stage)
        "parallel_strategy_item": {name: _operator_entry(n, int(stages.get(name, 0)), graph,
                                                         mesh)
                                   for name, n in plan.nodes.items()},
        "parallel_layout_item": {v: layout_entry(plan.layouts[v], graph.spec(v).shape, mesh)
                                 for v in graph.parameters()},
        "data_layout_item": {v: layout_entry(plan.layouts[v], graph.spec(v).shape, mesh)
                             for v in graph.data_inputs()},
        "predicted": {"step_seconds": float(c.total), "compute": float(c.compute),
                      "communication": float(c.communication),
                      "redistribution": float(c.redistribution),
                      "gradient_sync": float(c.gradient_sync),
                      "memory_bytes": float(c.memory_bytes), "objective": float(plan.objective)},
    }
    if priced.optimizer_weight_shard_size != -1:  # absent from files of the default
        doc["optimizer_weight_shard_size"] = int(priced.optimizer_weight_shard_size)
    if not priced.fp32_sync:
        doc["gradient_fp32_sync"] = False
    if priced.optimizer_state is not None:
        doc["optimizer_state"] = {k: float(v) for k, v in priced.optimizer_state}
    if priced.micro_batches != 1:
        doc["micro_batches"] = int(priced.micro_batches)
    if tuning is not None:  # absent from files of a plan that was not tuned
        doc["tuning"] = _tuning_document(tuning, float(c.total))
    return doc


def _operator_entry(n: NodeStrategy, stage: int, graph: Graph, mesh: DeviceMesh
                    ) -> dict[str, Any]:
    """One operator's entry; a loop node's with its body plan (:class:`LoopBodyEntry`)."""
    entry: dict[str, Any] = {"op": n.op, "stage": stage,
                             "parallel_strategy": [list(e) for e in n.strategy],
                             "splits": list(n.splits)}
    if n.body is not None:
        body = loop_body(graph.node(n.name)).graph
        entry["body"] = {
            "parallel_strategy_item": {k: _operator_entry(b, 0, body, mesh)
                                       for k, b in n.body.nodes.items()},
            "parallel_layout_item": {v: layout_entry(n.body.layouts[v], body.spec(v).shape,
                                                     mesh) for v in body.parameters()}}
    return entry


def _tuning_document(tuning: Mapping[str, Any], step_seconds: float) -> dict[str, Any]:
    """``tuning`` checked (:class:`TuningEntry`, its chosen row the plan's prediction) as
    the file's ``tuning`` field."""
    if not isinstance(tuning, Mapping):
        raise AutoParallelTypeError("tuning", tuning, "a mapping of TuningEntry's fields")
    try:
        entry = TuningEntry.model_validate(dict(tuning))
    except ValidationError as e:
        raise from_validation_problem(validation_problems(e), "tuning",
                                      TuningEntry.model_fields) from None
    if not _same_prediction(entry, step_seconds):
        raise AutoParallelError("tuning", entry.chosen.name, "its chosen row must be the "
                                f"plan saved (predicted {step_seconds * 1e3!r} ms, the row "
                                f"{entry.chosen.predicted_ms!r} ms)")
    return entry.model_dump(mode="json")


def _same_prediction(entry: TuningEntry, step_seconds: float) -> bool:
    """Whether a tuning's chosen row is the plan predicted at ``step_seconds``."""
    return math.isclose(entry.chosen.predicted_ms, step_seconds * 1e3, rel_tol=1e-9,
                        abs_tol=1e-12)


def _preset_names() -> set[str]:
    from autopar.strategies.cost import CLUSTERS

    return set(CLUSTERS)


def dumps_strategy(doc: Mapping[str, Any]) -> str:
    """Canonical text: sorted keys, one-space indent, ``repr`` floats, trailing newline."""
    return json.dumps(doc, sort_keys=True, indent=1, allow_nan=False) + "\n"


def save_strategy(plan: Plan, graph: Graph, path: str | os.PathLike[str], *,
                  tuning: Mapping[str, Any] | None = None) -> Path:
    """Write ``plan`` to ``path`` atomically; the same plan always gives the same bytes.
    ``tuning``: the measurements that chose the plan, kept in the file (see
    :func:`strategy_document`)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise AutoParallelTypeError("strategy_ckpt_save_file", path, "a non-empty path")
    text = dumps_strategy(strategy_document(plan, graph, tuning))
    return write_text_atomic(path, text, key="strategy_ckpt_save_file")


# ---------------------------------------------------------------------------- load


#: The largest strategy file read (bytes); ``AUTOPAR_MAX_FILE_BYTES`` overrides it.
MAX_FILE_BYTES = 64 * 2 ** 20


def max_file_bytes() -> int:
    """:data:`MAX_FILE_BYTES`, or the ``AUTOPAR_MAX_FILE_BYTES`` environment variable."""
    value = os.environ.get("AUTOPAR_MAX_FILE_BYTES", "")
    if not value:
        return MAX_FILE_BYTES
    if not (value.isascii() and value.isdigit() and len(value) <= 18) or int(value) < 1:
        raise AutoParallelError("AUTOPAR_MAX_FILE_BYTES", value, "a positive integer of bytes")
    return int(value)


def read_strategy_file(path: str | os.PathLike[str]) -> StrategyFile:
    """Read and validate a strategy file (no graph needed: what ``autopar show`` prints)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise AutoParallelTypeError("strategy_ckpt_load_file", path, "a non-empty path")
    data = read_json_document(path, fmt=FORMAT, version=VERSION, limit=max_file_bytes(),
                              error=StrategyFileError)
    try:
        f = StrategyFile.model_validate(data)
    except ValidationError as e:
        raise StrategyFileError(path, *validation_failure(e)) from None
    if f.mode not in _known_modes():  # (a mode registered since the file was saved counts)
        raise StrategyFileError(path, "mode", f"one of {sorted(_known_modes())}", f.mode)
    if math.prod(a.size for a in f.mesh) != f.device_num:
        raise StrategyFileError(path, "mesh", f"axes whose sizes multiply to device_num="
                                f"{f.device_num}", [a.model_dump() for a in f.mesh])
    if f.tuning is not None and not _same_prediction(f.tuning, f.predicted.step_seconds):
        raise StrategyFileError(path, "tuning.rows", "a chosen row predicted as the file's "
                                f"plan ({f.predicted.step_seconds * 1e3!r} ms)",
                                f"{f.tuning.chosen.name} {f.tuning.chosen.predicted_ms!r} ms")
    return f


def load_strategy(path: str | os.PathLike[str], graph: Graph, *,
                  device_num: int | None = None, cluster: str | Cluster | None = None,
                  enable_alltoall: bool | None = None, dataset_strategy: Any = None,
                  pipeline_stages: int | None = None) -> Plan:
    """Rebuild the plan saved in ``path`` for ``graph`` (nothing is searched).

    Settings not given come from the current auto-parallel context; ``cluster=None`` uses the
    cluster saved in the file, so the loaded plan has the saved cost exactly. Every check runs
    before the plan is built: a :class:`StrategyFileError` names the field that failed.
    """
    from autopar.clusters import resolve_cluster
    from autopar.context import current_config

    if not isinstance(graph, Graph):
        raise AutoParallelTypeError("graph", graph, "the Graph returned by autopar.trace")
    cfg = current_config()
    settings = SearchSettings.from_config(cfg)
    settings = dataclasses.replace(settings, **{k: v for k, v in (
        ("enable_alltoall", enable_alltoall), ("dataset_strategy", dataset_strategy))
        if v is not None})
    return load_plan(path, graph, device_num=cfg.device_num if device_num is None else device_num,
                     cluster=None if cluster is None else resolve_cluster(cluster),
                     settings=settings, pipeline_stages=cfg.pipeline_stages
                     if pipeline_stages is None else pipeline_stages)


def load_plan(path: str | os.PathLike[str], graph: Graph, *, device_num: int,
              cluster: Cluster | None, settings: SearchSettings, pipeline_stages: int) -> Plan:
    """:func:`load_strategy` with every setting given (``cluster=None``: the file's own)."""
    if not isinstance(graph, Graph):
        raise AutoParallelTypeError("graph", graph, "the Graph returned by autopar.trace")
    n, stages = device_num, pipeline_stages
    alltoall, dataset = settings.enable_alltoall, settings.dataset_strategy
    t0 = time.perf_counter()
    f = read_strategy_file(path)
    p = str(path)
    if f.fingerprint != graph.fingerprint():
        raise StrategyFileError(p, "fingerprint", f"{graph.fingerprint()} (the fingerprint of "
                                f"graph {graph.name!r}: the file was saved for another "
                                "function or other shapes)", f.fingerprint)
    if f.device_num != n:
        raise StrategyFileError(p, "device_num", f"{n} (the devices the plan is loaded for: "
                                "device_num, or a pipeline stage's share of it)", f.device_num)
    mesh = DeviceMesh.for_devices(n)
    if [(a.name, a.size) for a in f.mesh] != list(mesh.axes):
        raise StrategyFileError(p, "mesh", str([{"name": a, "size": s} for a, s in mesh.axes]),
                                [a.model_dump() for a in f.mesh])
    if f.enable_alltoall != alltoall:
        raise StrategyFileError(p, "enable_alltoall", f"{alltoall} (the context's "
                                "enable_alltoall; plans are priced with it)", f.enable_alltoall)
    po_kb = settings.parallel_optimizer_kb
    if f.parallel_optimizer_kb != po_kb:
        raise StrategyFileError(p, "parallel_optimizer_kb", f"{po_kb} (the context's parallel "
                                "optimizer threshold; plans are priced with it)",
                                f.parallel_optimizer_kb)
    shard = settings.optimizer_weight_shard_size
    if f.optimizer_weight_shard_size != shard:
        raise StrategyFileError(p, "optimizer_weight_shard_size", f"{shard} (the context's "
                                "optimizer_weight_shard_size under enable_parallel_optimizer, "
                                "-1 when absent; plans are priced with it)",
                                f.optimizer_weight_shard_size)
    if f.current_stage >= stages:
        raise StrategyFileError(p, "current_stage", f"a stage below pipeline_stages={stages}",
                                f.current_stage)
    clus = _file_cluster(f, p) if cluster is None else cluster
    items, field = f.parallel_strategy_item, "parallel_strategy_item"
    splits = _check_operators(items, graph, mesh, p, stages, field)
    problem = Problem(graph, mesh, CostModel(clus), enable_alltoall=alltoall,
                      dataset_strategy=dataset, memory_weight=f.memory_weight,
                      fixed_splits=splits, parallel_optimizer_kb=f.parallel_optimizer_kb,
                      optimizer_weight_shard_size=f.optimizer_weight_shard_size,
                      fp32_sync=f.gradient_fp32_sync, optimizer_state=f.optimizer_state,
                      micro_batches=f.micro_batches,
                      loops=_file_loops(items, graph, mesh, p, stages, field, f))
    picks = _pick_inputs(f, graph, problem, p)
    plan = Plan.from_picks(problem, picks, f.mode, time.perf_counter() - t0)
    _check_loop_strategies(items, plan, p, field)
    if cluster is None:  # priced on the file's own cluster: the file's prediction must hold
        _check_predicted(f, plan, p)
    return dataclasses.replace(plan.with_notes(f"loaded from {p}"), source=str(p), stages={
        k: e.stage for k, e in sorted(f.parallel_strategy_item.items()) if e.stage})


def _known_modes() -> set[str]:
    """The labels a saved plan's ``mode`` can have: a search mode, or the parallel mode whose
    strategies were derived rather than searched."""
    return set(SEARCH_MODES) | set(PARALLEL_MODES) - {"auto_parallel"}


def _check_predicted(f: StrategyFile, plan: Plan, path: str) -> None:
    """The re-priced plan must have the cost the file says it was saved with: a file whose
    strategies, memory_weight or prediction were edited apart does not load."""
    c = plan.cost
    for name, value in (("step_seconds", c.total), ("compute", c.compute),
                        ("communication", c.communication),
                        ("redistribution", c.redistribution),
                        ("gradient_sync", c.gradient_sync), ("memory_bytes", c.memory_bytes),
                        ("objective", plan.objective)):
        saved = getattr(f.predicted, name)
        if not math.isclose(float(value), saved, rel_tol=1e-9, abs_tol=1e-15):
            raise StrategyFileError(path, f"predicted.{name}", f"{float(value)!r} (the plan "
                                    "re-priced on the file's cluster; the file contradicts "
                                    "itself)", saved)


def _file_cluster(f: StrategyFile, path: str) -> Cluster:
    data = dict(f.cluster)
    if set(data) == {"name"}:
        name = data["name"]
        if not isinstance(name, str) or name not in _preset_names():
            raise StrategyFileError(path, "cluster.name", f"one of {sorted(_preset_names())}",
                                    name)
        return get_cluster(name)
    try:
        return Cluster.model_validate_json(json.dumps(data))
    except ValidationError as e:
        raise StrategyFileError(path, *validation_failure(e, "cluster")) from None


def _check_operators(items: Mapping[str, OperatorEntry], graph: Graph, mesh: DeviceMesh,
                     path: str, stages: int, field: str) -> dict[str, tuple[int, ...]]:
    """Each operator's splits, checked (``items``: the entries of ``field``)."""
    from autopar.strategies.opspec import op_spec

    names = [n.name for n in graph.nodes]
    missing = [k for k in names if k not in items]
    extra = sorted(set(items) - set(names))
    if missing or extra:
        raise StrategyFileError(path, field, f"one entry per operator of "
                                f"the graph ({len(names)})", f"missing {missing[:5]}, unknown "
                                f"{extra[:5]}")
    out: dict[str, tuple[int, ...]] = {}
    for node in graph.nodes:
        e = items[node.name]
        where = f"{field}.{node.name}"
        if node.kind == LOOP_KIND or e.body is not None:
            out[node.name] = _check_loop_entry(e, node, graph, path, where)
            continue
        if e.op != node.op:
            raise StrategyFileError(path, f"{where}.op", repr(node.op), e.op)
        if e.stage >= stages:
            raise StrategyFileError(path, f"{where}.stage", f"a stage in [0, {stages}) "
                                    "(pipeline_stages)", e.stage)
        spec = op_spec(node, graph)
        splits = tuple(e.splits)
        ok = len(splits) == len(spec.sizes) and all(s >= 1 for s in splits)
        ok = ok and all(sz % s == 0 and (s == 1 or spec.splittable(d))
                        for d, (sz, s) in enumerate(zip(spec.sizes, splits)))
        ok = ok and all(lim % splits[d] == 0 for d, lim in spec.divides)
        ok = ok and mesh.device_num % math.prod(splits) == 0 and \
            mesh.assign(splits) is not None
        if not ok:
            raise StrategyFileError(path, f"{where}.splits", f"one split per loop dimension of "
                                    f"sizes {list(spec.sizes)}, each dividing its size, "
                                    f"product dividing device_num={mesh.device_num}",
                                    list(e.splits))
        strategy = tuple(tuple(x) for x in e.parallel_strategy)
        ranks = [graph.spec(v).rank for v in node.inputs]
        try:
            if ranks or strategy:  # an operator without inputs (iota) has the empty strategy
                check_strategy_shape(strategy, ranks, node.name)
                splits_from_strategy(spec, strategy, node.name, mesh)
        except (AutoParallelError, AutoParallelTypeError) as err:
            raise StrategyFileError(path, f"{where}.parallel_strategy", "a strategy valid for "
                                    f"the operator's input shapes "
                                    f"{[list(graph.spec(v).shape) for v in node.inputs]}",
                                    f"{[list(s) for s in strategy]} ({err})") from None
        axes = mesh.assign(splits)
        if axes is None:  # pragma: no cover - checked above
            raise StrategyFileError(path, f"{where}.splits", "splits fitting the mesh", splits)
        implied = tuple(tuple(mesh.size_of(axes[m]) if m is not None else 1 for m in mp)
                        for mp in spec.in_maps)
        if implied != strategy:
            raise StrategyFileError(path, f"{where}.parallel_strategy",
                                    f"{[list(s) for s in implied]} "
                                    f"(the strategy of splits {list(splits)})",
                                    [list(s) for s in strategy])
        out[node.name] = splits
    return out


def _check_loop_entry(e: OperatorEntry, node: Any, graph: Graph, path: str,
                      where: str) -> tuple[int, ...]:
    """A loop node's entry: its op, a body plan, split counts fitting its body's data
    inputs (each input's checked when its body plan is built) and strategy tuples of its
    inputs' ranks (checked against the plan rebuilt: :func:`_check_loop_strategies`)."""
    if node.kind != LOOP_KIND:
        raise StrategyFileError(path, f"{where}.body", "no body (the node is not a loop)",
                                "a body plan")
    if e.op != node.op:
        raise StrategyFileError(path, f"{where}.op", repr(node.op), e.op)
    if e.body is None:
        raise StrategyFileError(path, f"{where}.body", "the loop's body plan", None)
    from autopar.strategies.opspec import op_spec

    spec = op_spec(node, graph)
    splits = tuple(e.splits)
    if len(splits) != len(spec.sizes) or any(
            s < 1 or n % s for n, s in zip(spec.sizes, splits)):
        raise StrategyFileError(path, f"{where}.splits", "one split per dim of the body's data "
                                f"inputs, sizes {list(spec.sizes)}, each dividing its size",
                                list(e.splits))
    try:
        check_strategy_shape(tuple(tuple(x) for x in e.parallel_strategy),
                             [graph.spec(v).rank for v in node.inputs], node.name)
    except (AutoParallelError, AutoParallelTypeError) as err:
        raise StrategyFileError(path, f"{where}.parallel_strategy", "one tuple per input of "
                                "the loop node, one split count per dim",
                                f"{e.parallel_strategy} ({err})") from None
    return splits


def _file_loops(items: Mapping[str, OperatorEntry], graph: Graph, mesh: DeviceMesh,
                path: str, stages: int, field: str, f: StrategyFile) -> PlannedLoops:
    """The body plans of a file's loop nodes (each checked, as the file's own operators
    and parameters are), for the problem that re-prices them."""
    out = {}
    for node in loop_nodes(graph):
        e = items[node.name]
        where = f"{field}.{node.name}.body"
        body = loop_body(node).graph
        items_in = e.body.parallel_strategy_item  # type: ignore[union-attr]
        ops = _check_operators(items_in, body, mesh, path, stages,
                               f"{where}.parallel_strategy_item")
        inner = _file_loops(items_in, body, mesh, path, stages,
                            f"{where}.parallel_strategy_item", f)
        layouts = _entry_layouts(e.body.parallel_layout_item,  # type: ignore[union-attr]
                                 body.parameters(), body, mesh, path,
                                 f"{where}.parallel_layout_item", "parameter")
        nodes = {k: NodeStrategy(k, body.node(k).op, (), s, (), (),
                                 inner.bodies[k][1] if k in inner.bodies else None)
                 for k, s in ops.items()}
        plan = Plan("loop body", mesh, "", Fingerprint(body), nodes, layouts, Breakdown(), 0.0,
                    pricing=Pricing(f.enable_alltoall, f.memory_weight,
                                    f.parallel_optimizer_kb, f.optimizer_weight_shard_size,
                                    f.gradient_fp32_sync, None if f.optimizer_state is None
                                    else tuple(sorted(f.optimizer_state.items())),
                                    f.micro_batches))
        out[node.name] = (tuple(e.splits), plan)
    return PlannedLoops(out)


def _check_loop_strategies(items: Mapping[str, OperatorEntry], plan: Plan, path: str,
                           field: str) -> None:
    """Each loop node's saved strategy is the one its body plan rebuilt gives (nested loops
    too)."""
    for name, ns in plan.nodes.items():
        if ns.body is None:
            continue
        e = items[name]
        saved = [list(x) for x in e.parallel_strategy]
        if saved != [list(x) for x in ns.strategy]:
            raise StrategyFileError(path, f"{field}.{name}.parallel_strategy",
                                    f"{[list(x) for x in ns.strategy]} (the strategy of its "
                                    "body plan)", saved)
        inner = e.body.parallel_strategy_item  # type: ignore[union-attr]
        _check_loop_strategies(inner, ns.body, path,
                               f"{field}.{name}.body.parallel_strategy_item")


def _entry_layouts(items: Mapping[str, LayoutEntry], values: Sequence[str], graph: Graph,
                   mesh: DeviceMesh, path: str, field: str, what: str) -> dict[str, TensorLayout]:
    """The layouts of ``values`` in a layout field (one entry each, every one checked)."""
    missing = [v for v in values if v not in items]
    extra = sorted(set(items) - set(values))
    if missing or extra:
        raise StrategyFileError(path, field, f"one entry per {what} ({len(values)})",
                                f"missing {missing[:5]}, unknown {extra[:5]}")
    return {v: _entry_layout(items[v], graph.spec(v).shape, mesh, path, f"{field}.{v}")
            for v in values}


def _pick_inputs(f: StrategyFile, graph: Graph, problem: Problem, path: str) -> list[int]:
    picks = [0] * len(problem.vertices)
    for field_name, items, values in (("parallel_layout_item", f.parallel_layout_item,
                                       graph.parameters()),
                                      ("data_layout_item", f.data_layout_item,
                                       graph.data_inputs())):
        kind = "<param>" if field_name == "parallel_layout_item" else "<data>"
        what = "parameter" if kind == "<param>" else "data input"
        layouts_of = _entry_layouts(items, values, graph, problem.mesh, path, field_name, what)
        for v in values:
            where, lay = f"{field_name}.{v}", layouts_of[v]
            i = problem.index[kind + v]
            layouts = [c.out_layouts[0] for c in problem.vertices[i].choices]
            if lay not in layouts and kind == "<param>":  # a layout a wider search chose
                problem.widen_param(v, [lay])
                layouts = [c.out_layouts[0] for c in problem.vertices[i].choices]
            if lay not in layouts:
                rule = ("a layout one of its consumers uses, or replicated" if kind == "<param>"
                        else "the layout the context's dataset_strategy gives")
                raise StrategyFileError(path, f"{where}.tensor_map",
                                        f"{rule}: {[str(x) for x in layouts]}", str(lay))
            picks[i] = layouts.index(lay)
    return picks


def _entry_layout(e: LayoutEntry, shape: tuple[int, ...], mesh: DeviceMesh, path: str,
                  where: str) -> TensorLayout:
    """The layout of one layout entry of a tensor of ``shape``, every field checked."""
    if e.dev_matrix != [s for _, s in mesh.axes]:
        raise StrategyFileError(path, f"{where}.dev_matrix", str([s for _, s in mesh.axes]),
                                e.dev_matrix)
    if tuple(e.tensor_shape) != shape:
        raise StrategyFileError(path, f"{where}.tensor_shape", str(list(shape)),
                                e.tensor_shape)
    if len(e.tensor_map) != len(shape):
        raise StrategyFileError(path, f"{where}.tensor_map", f"{len(shape)} entries "
                                "(one per tensor dim)", e.tensor_map)
    lay = layout_from_entry(e, mesh, where, path)
    if any(n % mesh.size_of(d) for n, d in zip(shape, lay.dims)):
        raise StrategyFileError(path, f"{where}.tensor_map", f"splits dividing the "
                                f"shape {list(shape)}", e.tensor_map)
    if tuple(e.slice_shape) != lay.local_shape(shape, mesh):
        raise StrategyFileError(path, f"{where}.slice_shape",
                                str(list(lay.local_shape(shape, mesh))), e.slice_shape)
    for extra_field in ("field", "opt_weight_shard_step", "opt_weight_shard_size"):
        if getattr(e, extra_field) != 0:  # what layout_entry writes: the optimizer
            raise StrategyFileError(  # shard is described by parallel_optimizer_kb
                path, f"{where}.{extra_field}", "0 (autopar's layouts carry no "
                "optimizer shard; see parallel_optimizer_kb)", getattr(e, extra_field))
    return lay
