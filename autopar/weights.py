"""Trained weights saved under one plan and restored under another: ``save_checkpoint`` /
``load_checkpoint``, and MindSpore's ``transform_checkpoints`` / ``load_distributed_checkpoint``.

A checkpoint is a directory: ``checkpoint.json`` (the manifest: every array's name, shape,
dtype, the graph value it is and the layout it was trained in, MindSpore's ``dev_matrix`` /
``tensor_map``) and one ``state-N`` folder written by **orbax-checkpoint** (a dependency for
this module alone: a well-kept library for sharded, per-process checkpoint I/O on tensorstore;
writing it ourselves would mean our own chunked array format and its multi-host barriers).
Each process writes only the shards it holds (orbax skips replicas); a restore hands orbax
the target ``NamedSharding`` of every array, so each device reads its own block under the
target layout from disk, and no process ever holds a whole sharded array. In a job of several
processes (``jax.distributed``) process 0 alone names the state folder and writes the
manifest; the devices of the saving and the restoring job need not be in as many processes.
A typed PRNG key (``jax.random.key``) is written by orbax as its raw ``key_data`` and
its impl, which the manifest names (``key_impl``): it comes back a key of that impl.

**Names, not layouts, tie the two runs.** A parameter is named by its pytree path
(``['w1']``), an optimizer-state leaf by its path in the state as ``optimizer.init`` makes it
over the parameter tree (``[0].mu['w1']``), whatever the plan, the device count or the step
kind: a pipelined step's state over packed ``[p, D, N]`` buffers (its parallel optimizer's
shards included) is unpacked to that tree on save and packed again on restore, so stages merge
or split and the parallel optimizer switches on or off between the runs. A state leaf of its
parameter's shape *follows* the parameter (the manifest says which): it is restored in its
parameter's target layout.

**Atomic.** orbax writes ``state-N`` under a temporary name and renames it when complete; then
the manifest naming it replaces the old one in one ``os.replace``
(:func:`autopar.files.write_files_atomic`); older ``state-*`` folders are removed last. A save
killed anywhere leaves the previous manifest, naming the previous complete folder.

**Checked.** Before any array is read, every name, shape and dtype of the checkpoint is matched
with the target's: a :class:`CheckpointMismatchError` names the parameter (or state leaf), what
the target expects and what the checkpoint holds. A source strategy file given to
:func:`transform_checkpoints` / :func:`load_distributed_checkpoint` must describe the
checkpoint (its device count, and every parameter's shape and layout) or a
:class:`CheckpointStrategyError` says where it does not.

>>> import jax, autopar as ap, tempfile                        # doctest: +SKIP
>>> ap.save_checkpoint(d := tempfile.mkdtemp(), params, state, step_a)  # doctest: +SKIP
>>> params, state = ap.load_checkpoint(d, step_b)               # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Literal, NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autopar.checkpoint import layout_entry, layout_from_entry, read_strategy_file
from autopar.errors import AutoParallelError, AutoParallelTypeError, FileFieldError
from autopar.files import path_text, read_json_document, validation_failure, write_files_atomic
from autopar.graph.tracer import traced_dtype
from autopar.multihost import agree_made
from autopar.pipeline.buffers import PackedParams
from autopar.pipeline.step import PipelineTrainStep
from autopar.step_inputs import is_prng_key
from autopar.strategies.layout import DeviceMesh, TensorLayout, jax_mesh
from autopar.strategies.plan import Plan
from autopar.train import TrainStep

__all__ = ["CheckpointMismatchError", "CheckpointStrategyError", "CheckpointFileError",
           "Restored", "save_checkpoint", "load_checkpoint", "transform_checkpoints",
           "load_distributed_checkpoint", "reshard", "FORMAT", "VERSION", "MANIFEST"]

FORMAT = "autopar-checkpoint"
VERSION = 1
MANIFEST = "checkpoint.json"
_ITEM = re.compile(r"^(?P<prefix>[A-Za-z0-9_.-]*?)(?P<n>[0-9]+)$")


class CheckpointFileError(FileFieldError):
    """A checkpoint directory that cannot be read (no manifest, a bad field)."""

    what = "checkpoint"


class CheckpointMismatchError(CheckpointFileError):
    """A checkpoint whose names, shapes or dtypes are not the target's: names the array,
    the target's expectation and what the checkpoint holds."""


class CheckpointStrategyError(FileFieldError):
    """A source strategy file that does not describe the checkpoint."""

    what = "strategy file"


class Restored(NamedTuple):
    """``load_checkpoint``'s result: ``params, opt_state = load_checkpoint(...)``."""

    params: Any
    opt_state: Any


# ---------------------------------------------------------------------------- the manifest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ArrayEntry(_Strict):
    """One saved array: its name, orbax key, shape, dtype; a parameter's graph value name,
    stage and layout (MindSpore's ``dev_matrix`` / ``tensor_map``); a state leaf's
    parameter (``follows``)."""

    name: str = Field(min_length=1)
    key: str = Field(pattern=r"^[ps][0-9]+$")
    shape: list[int]
    dtype: str
    value: str | None = None
    stage: int | None = None
    dev_matrix: list[int] | None = None
    tensor_map: list[int | list[int]] | None = None
    follows: str | None = None
    key_impl: str | None = Field(default=None, min_length=1)  # a typed PRNG key's impl


class Manifest(_Strict):
    """``checkpoint.json``."""

    format: Literal["autopar-checkpoint"]
    version: int
    item: str = Field(pattern=r"^[A-Za-z0-9_.-]*[0-9]+$")
    device_num: int = Field(ge=1)
    source: str
    params: list[ArrayEntry]
    opt_state: list[ArrayEntry]


def read_manifest(path: Any) -> Manifest:
    """The manifest of the checkpoint at ``path``, validated (the state folder it names must
    exist)."""
    root = Path(path_text(path, "path"))
    if not (root / MANIFEST).is_file():
        raise CheckpointFileError(root, MANIFEST, "a checkpoint directory written by "
                                  "autopar.save_checkpoint", "no manifest")
    data = read_json_document(root / MANIFEST, fmt=FORMAT, version=VERSION, limit=1 << 28,
                              error=CheckpointFileError)
    try:
        m = Manifest.model_validate(data)
    except ValidationError as e:
        raise CheckpointFileError(root / MANIFEST, *validation_failure(e)) from None
    if not (root / m.item).is_dir():
        raise CheckpointFileError(root, "item", "the state folder the manifest names", m.item)
    return m


# ---------------------------------------------------------------------------- sources


@dataclasses.dataclass
class _Saved:
    """What a save writes: entries (without keys) and their arrays, in order."""

    device_num: int
    source: str
    params: list[tuple[dict[str, Any], Any]]
    state: list[tuple[dict[str, Any], Any]]


def _names(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(p), x) for p, x in
            jax.tree_util.tree_flatten_with_path(tree)[0]]


def _entry(name: str, x: Any, **extra: Any) -> dict[str, Any]:
    if is_prng_key(x):  # (orbax writes its key_data; the impl rebuilds its dtype)
        extra["key_impl"] = str(jax.random.key_impl(x))
    return {"name": name, "shape": [int(n) for n in np.shape(x)], "dtype": traced_dtype(x),
            **extra}


def _dtype(path: Any, e: ArrayEntry) -> Any:
    """The dtype of a saved array: a NumPy dtype, or a typed PRNG key's of its impl."""
    try:
        if e.key_impl is not None:
            return jax.eval_shape(lambda: jax.random.key(0, impl=e.key_impl)).dtype
        return np.dtype(e.dtype)
    except (TypeError, ValueError) as err:
        raise CheckpointFileError(path, f"{e.name} dtype", "a NumPy dtype, or a typed PRNG "
                                  "key's with its key_impl", f"{e.dtype} ({err})") from None


def _layout_fields(layout: TensorLayout, shape: tuple[int, ...],
                   mesh: DeviceMesh) -> dict[str, Any]:
    e = layout_entry(layout, shape, mesh)
    return {"dev_matrix": e["dev_matrix"], "tensor_map": e["tensor_map"]}


def _param_entries(names: Sequence[str], leaves: Sequence[Any], values: Sequence[str | None],
                   layouts: Sequence[tuple[TensorLayout, DeviceMesh] | None],
                   stages: Sequence[int | None]) -> list[tuple[dict[str, Any], Any]]:
    out = []
    for n, x, v, lm, s in zip(names, leaves, values, layouts, stages):
        extra = {} if lm is None else _layout_fields(lm[0], tuple(np.shape(x)), lm[1])
        out.append((_entry(n, x, value=v, stage=s, **extra), x))
    return out


def _state_entries(state: Any, params: Sequence[tuple[dict[str, Any], Any]]
                   ) -> list[tuple[dict[str, Any], Any]]:
    """The state's leaves by path; each follows the parameter whose path ends its own (the
    longest such), when of that parameter's shape."""
    out = []
    for name, x in _names(state):
        best = None
        for e, _ in params:
            if name.endswith(e["name"]) and list(np.shape(x)) == e["shape"] and (
                    best is None or len(e["name"]) > len(best)):
                best = e["name"]
        out.append((_entry(name, x, follows=best), x))
    return out


def _from_train_step(step: TrainStep, params: Any, opt_state: Any) -> _Saved:
    leaves = step._param_leaves(params)
    pg = step.parallel_graph
    values = list(pg.inputs[:step._n_params])
    layouts = [(pg.values[v].layout, pg.mesh) for v in values]
    ps = _param_entries(step.split.paths, leaves, values, layouts, [None] * len(leaves))
    return _Saved(step.device_num, "train_step", ps, _state_entries(opt_state, ps))


def _pipeline_layouts(step: PipelineTrainStep) -> dict[int, tuple[TensorLayout, int]]:
    return {sl.leaf: (sl.layout, s) for s in range(step.stages)
            for sl in step.packing.slots[s]}


def _unpack_state(step: PipelineTrainStep, packed: PackedParams, opt_state: Any) -> Any:
    """A pipelined step's state over packed buffers as the state over the parameter tree."""
    def one(node: Any) -> Any:
        if not isinstance(node, PackedParams):
            return node
        full = tuple(b if b is not None else p for b, p in zip(node.buffers, packed.buffers))
        return step.split.masked(step.unpack(PackedParams(full)))
    return jax.tree_util.tree_map(one, opt_state, is_leaf=lambda x: isinstance(x, PackedParams))


def _from_pipeline(step: PipelineTrainStep, params: Any, opt_state: Any) -> _Saved:
    packed = step.pack(params)
    tree = step.unpack(packed)
    leaves = jax.tree_util.tree_leaves(tree)
    at = _pipeline_layouts(step)
    ps = _param_entries(step.split.paths, leaves, step._param_names,
                        [(at[i][0], step.intra_mesh) for i in range(len(leaves))],
                        [at[i][1] for i in range(len(leaves))])
    state = _unpack_state(step, packed, opt_state)
    return _Saved(step.device_num, f"pipeline_train_step ({step.stages} stages)", ps,
                  _state_entries(state, ps))


def _from_plan(plan: Plan, params: Any, opt_state: Any) -> _Saved:
    ptree = _plan_param_tree(plan)
    leaves, tree = jax.tree_util.tree_flatten(params)
    if tree != ptree:
        raise AutoParallelError("params", f"{len(leaves)} leaves", "must have the structure "
                                f"of the plan's parameters ({ptree})")
    names = [n for n, _ in _names(params)]
    values = list(plan.inputs[:len(leaves)])
    ps = _param_entries(names, leaves, values, [(plan.layouts[v], plan.mesh) for v in values],
                        [None] * len(leaves))
    return _Saved(plan.mesh.device_num, f"plan ({plan.mode})", ps, _state_entries(opt_state, ps))


def _plan_param_tree(plan: Plan) -> Any:
    if plan.in_tree is None or not plan.in_tree.children():
        raise AutoParallelError("plan", plan.mode, "has no argument structure (it was not "
                                "built from a traced graph)", "Pass the training step")
    return plan.in_tree.children()[0]


def _source(step_or_plan: Any, params: Any, opt_state: Any) -> _Saved:
    if isinstance(step_or_plan, PipelineTrainStep):
        return _from_pipeline(step_or_plan, params, opt_state)
    if isinstance(step_or_plan, TrainStep):
        if step_or_plan.backend == "pmap":
            raise AutoParallelError("step_or_plan", step_or_plan, "a checkpoint is saved from "
                                    "a shard_map step", "Use backend='shard_map'")
        return _from_train_step(step_or_plan, params, opt_state)
    if isinstance(step_or_plan, Plan):
        return _from_plan(step_or_plan, params, opt_state)
    raise AutoParallelTypeError("step_or_plan", step_or_plan, "the train_step / "
                                "pipeline_train_step the state was trained with, or its Plan")


# ---------------------------------------------------------------------------- writing


def _next_item(root: Path, prefix: str) -> str:
    """The next state folder's name: one past every ``<prefix>N`` there."""
    used = [int(m.group("n")) for p in root.iterdir() if (m := _ITEM.match(p.name))
            and m.group("prefix") == prefix] if root.is_dir() else []
    return f"{prefix}{max(used, default=0) + 1}"


def _host(x: Any) -> Any:
    return x if isinstance(x, jax.Array) else np.asarray(x)


def _write(path: Any, saved: _Saved, prefix: str = "state-") -> Path:
    """Write the arrays under a new state folder, then the manifest naming it, then remove
    the older folders (see the module doc). In a job of several processes process 0 alone
    creates the directory, names the folder and writes the manifest (each process its own
    shards, through orbax); where it fails, every process raises (none waits for it)."""
    import orbax.checkpoint as ocp

    root = Path(path_text(path, "path"))
    if root.exists() and not root.is_dir():
        raise AutoParallelError("path", str(root), "is a file; a checkpoint is a directory")

    def start() -> str:
        root.mkdir(parents=True, exist_ok=True)
        return _next_item(root, prefix)
    item = agree_made(start)
    items: dict[str, Any] = {}
    params, state = [], []
    for kind, pairs, out in (("p", saved.params, params), ("s", saved.state, state)):
        for k, (entry, x) in enumerate(pairs):
            items[f"{kind}{k}"] = _host(x)
            out.append({**entry, "key": f"{kind}{k}"})
    manifest = Manifest.model_validate({
        "format": FORMAT, "version": VERSION, "item": item, "device_num": saved.device_num,
        "source": saved.source, "params": params, "opt_state": state})
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(root / item, items, force=True)
        ckpt.wait_until_finished()

    def finish() -> str:
        text = json.dumps(manifest.model_dump(exclude_none=True), indent=1, sort_keys=True)
        write_files_atomic([(root / MANIFEST, text + "\n", "path")])
        for old in root.iterdir():
            if old.name != item and old.is_dir() and _ITEM.match(old.name):
                shutil.rmtree(old, ignore_errors=True)
        return ""
    agree_made(finish)
    return root


def save_checkpoint(path: str | os.PathLike[str], params: Any, opt_state: Any,
                    step_or_plan: Any) -> Path:
    """Save a training state with the plan it was trained under.

    ``params`` / ``opt_state``: what the step returns (a pipelined step's packed parameters
    too); ``step_or_plan``: the ``train_step`` / ``pipeline_train_step`` they come from, or a
    :class:`~autopar.Plan` (then ``params`` has the plan's parameter structure and
    ``opt_state`` any pytree). ``path``: the checkpoint directory (created; a checkpoint
    already there is replaced atomically). Every process calls it; each writes its own
    shards. Returns the directory."""
    return _write(path, _source(step_or_plan, params, opt_state))


# ---------------------------------------------------------------------------- targets


@dataclasses.dataclass
class _Target:
    """Where every array goes: the parameters' names, shapes, dtypes and shardings; the
    state's when the target knows its optimizer (else None: restored by the manifest,
    following the parameters); ``finish`` builds the result from the restored arrays."""

    mesh: Mesh
    params: dict[str, tuple[tuple[int, ...] | None, str, NamedSharding]]
    state: dict[str, tuple[tuple[int, ...], str]] | None
    finish: Callable[[dict[str, Any], dict[str, Any]], Restored]
    by_value: bool = False   # params matched by graph value name (a strategy file)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(np.shape(x)), traced_dtype(x))


def _state_specs(optimizer: Any, masked: Any) -> tuple[Any, dict[str, tuple]]:
    st = jax.eval_shape(optimizer.init, masked)
    return jax.tree_util.tree_structure(st), {
        n: (tuple(x.shape), str(x.dtype)) for n, x in _names(st)}


def _train_target(step: TrainStep) -> _Target:
    shapes = [step.parallel_graph.values[v].spec.shape for v in step.parallel_graph.inputs]
    # (a typed PRNG key, never trained, is a uint32 stand-in to the optimizer's eval_shape)
    abstract = jax.tree_util.tree_unflatten(step.split.tree, [
        jax.ShapeDtypeStruct(s, np.uint32 if d.startswith("key<") else d)
        for s, d in zip(shapes, step._p_dtypes)])
    params = {n: (tuple(x.shape), d, sh) for (n, x), d, sh in
              zip(_names(abstract), step._p_dtypes, step.storage_shardings)}
    tree, state = _state_specs(step.optimizer, step.split.masked(abstract))

    def finish(p: dict[str, Any], s: dict[str, Any]) -> Restored:
        return Restored(jax.tree_util.tree_unflatten(step.split.tree, list(p.values())),
                        jax.tree_util.tree_unflatten(tree, [s[n] for n in state]))
    return _Target(step.mesh, params, state, finish)


def _pipeline_target(step: PipelineTrainStep) -> _Target:
    leaves = [jax.ShapeDtypeStruct(tuple(s), d) for s, d in
              zip((step.graph.spec(v).shape for v in step._param_names), step._p_dtypes)]
    abstract = jax.tree_util.tree_unflatten(step._p_tree, leaves)
    at = _pipeline_layouts(step)
    params = {n: (tuple(x.shape), str(x.dtype),
                  NamedSharding(step.mesh, at[i][0].partition_spec()))
              for i, (n, x) in enumerate(_names(abstract))}
    tree, state = _state_specs(step.optimizer, step.split.masked(abstract))
    packed_abs = jax.eval_shape(step._pack, leaves)
    is_packed = lambda x: isinstance(x, PackedParams)  # noqa: E731
    pstate = jax.eval_shape(lambda b: step.optimizer.init(step._masked(b)), packed_abs.buffers)
    ptree = jax.tree_util.tree_structure(pstate, is_leaf=is_packed)
    packed_at = [is_packed(x) for x in jax.tree_util.tree_leaves(pstate, is_leaf=is_packed)]

    def finish(p: dict[str, Any], s: dict[str, Any]) -> Restored:
        pl = list(p.values())
        canonical = jax.tree_util.tree_unflatten(tree, [s[n] for n in state])
        out = []
        for part, packed in zip(ptree.flatten_up_to(canonical), packed_at):
            if packed:  # a parameter-tree part: packed like the parameters, carried ones None
                flat = jax.tree_util.tree_leaves(part, is_leaf=lambda x: x is None)
                full = [x if x is not None else q for x, q in zip(flat, pl)]
                out.append(step._masked(step._pack(full).buffers))
            else:
                out.append(part)
        return Restored(jax.tree_util.tree_unflatten(step._p_tree, pl), ptree.unflatten(out))
    return _Target(step.mesh, params, state, finish)


def _plan_target(plan: Plan) -> _Target:
    """A plan knows its parameters' names and layouts, not their shapes: the checkpoint's
    shapes are taken (the layout must divide them)."""
    ptree = _plan_param_tree(plan)
    values = list(plan.inputs[:ptree.num_leaves])
    mesh = jax_mesh(plan.mesh)
    names = [n for n, _ in _names(jax.tree_util.tree_unflatten(ptree, [0] * len(values)))]
    params = {n: (None, "", NamedSharding(mesh, plan.layouts[v].partition_spec()))
              for n, v in zip(names, values)}

    def finish(p: dict[str, Any], s: dict[str, Any]) -> Restored:
        return Restored(jax.tree_util.tree_unflatten(ptree, list(p.values())), s)
    return _Target(mesh, params, None, finish)


def _strategy_target(path: Any) -> _Target:
    f = read_strategy_file(path)
    mesh = DeviceMesh(tuple((a.name, a.size) for a in f.mesh))
    jmesh = _mesh_of(mesh, "target")
    params = {}
    for v, e in f.parallel_layout_item.items():
        lay = layout_from_entry(e, mesh, f"parallel_layout_item[{v!r}]", str(path))
        params[v] = (tuple(e.tensor_shape), "", NamedSharding(jmesh, lay.partition_spec()))

    def finish(p: dict[str, Any], s: dict[str, Any]) -> Restored:
        return Restored(p, s)
    return _Target(jmesh, params, None, finish, by_value=True)


def _mesh_of(mesh: DeviceMesh, key: str) -> Mesh:
    if mesh.device_num > jax.device_count():
        raise AutoParallelError(key, f"{mesh.device_num} devices", f"needs that many devices; "
                                f"{jax.device_count()} are present",
                                "Run with as many devices as the target plan")
    return jax_mesh(mesh)


def _spread_target(m: Manifest, n: int) -> _Target:
    """Every parameter split along its first dim that ``n`` divides (else replicated) over
    the first ``n`` devices: ``autopar reshard --devices N``."""
    if jax.device_count() < n:
        raise AutoParallelError("--devices", n, f"needs that many devices; "
                                f"{jax.device_count()} are present")
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    params = {}
    for e in m.params:
        dim = next((k for k, s in enumerate(e.shape) if s % n == 0 and s >= n), None)
        spec = PartitionSpec(*[("d" if k == dim else None) for k in range(len(e.shape))])
        params[e.name] = (tuple(e.shape), e.dtype, NamedSharding(mesh, spec))

    def finish(p: dict[str, Any], s: dict[str, Any]) -> Restored:
        return Restored(p, s)
    return _Target(mesh, params, None, finish)


def _target(target: Any) -> _Target:
    if isinstance(target, PipelineTrainStep):
        return _pipeline_target(target)
    if isinstance(target, TrainStep):
        if target.backend == "pmap":
            raise AutoParallelError("target", target, "restores into a shard_map step",
                                    "Use backend='shard_map'")
        return _train_target(target)
    if isinstance(target, Plan):
        return _plan_target(target)
    if isinstance(target, (str, os.PathLike)):
        return _strategy_target(target)
    raise AutoParallelTypeError("target", target, "a train_step / pipeline_train_step, a "
                                "Plan, or a strategy file's path")


# ---------------------------------------------------------------------------- checks


def _shown(shape: Sequence[int], dtype: str) -> str:
    return f"shape {tuple(shape)} {dtype}".rstrip()


def _match(path: Any, m: Manifest, t: _Target) -> dict[str, tuple[ArrayEntry, NamedSharding]]:
    """Every checkpoint array with its target sharding, checked: the same names (by graph
    value for a strategy file), shapes and dtypes."""
    key = (lambda e: e.value) if t.by_value else (lambda e: e.name)
    have = {key(e): e for e in m.params}
    for name in t.params:
        if name not in have:
            raise CheckpointMismatchError(path, f"params {name}", "every parameter of the "
                                          "target", f"no such parameter (it holds "
                                          f"{sorted(map(str, have))[:8]})")
    for name, e in have.items():
        if name not in t.params:
            raise CheckpointMismatchError(path, f"params {e.name}", "only the target's "
                                          f"parameters ({sorted(t.params)[:8]})",
                                          "a parameter the target does not have")
        shape, dtype, _ = t.params[name]
        if (shape is not None and tuple(e.shape) != shape) or dtype not in ("", e.dtype):
            want = _shown(e.shape if shape is None else shape, dtype)
            raise CheckpointMismatchError(path, f"params {e.name}", want,
                                          _shown(e.shape, e.dtype))
    out = {e.key: (e, t.params[key(e)][2]) for e in m.params}
    psh = {e.name: t.params[key(e)][2] for e in m.params}
    states = {e.name: e for e in m.opt_state}
    if t.state is not None:
        for name in sorted(set(t.state) ^ set(states)):
            raise CheckpointMismatchError(path, f"opt_state {name}", "the target optimizer's "
                                          "state" if name in t.state else "no such leaf",
                                          "missing" if name in t.state else "a leaf the "
                                          "target's optimizer does not have")
        for name, (shape, dtype) in t.state.items():
            e = states[name]
            if tuple(e.shape) != shape or e.dtype != dtype:
                raise CheckpointMismatchError(path, f"opt_state {name}", _shown(shape, dtype),
                                              _shown(e.shape, e.dtype))
    rep = NamedSharding(t.mesh, PartitionSpec())
    for e in m.opt_state:
        out[e.key] = (e, psh[e.follows] if e.follows in psh else rep)
    return out


def check_source_strategy(path: Any, m: Manifest, strategy: Any) -> None:
    """Refuse (:class:`CheckpointStrategyError`) a strategy file that does not describe the
    checkpoint: another device count, a parameter missing, another shape or layout."""
    f = read_strategy_file(strategy)
    ours = [e for e in m.params if e.value is not None and e.stage in (None, f.current_stage)]
    if f.device_num != m.device_num and not any(e.stage is not None for e in ours):
        raise CheckpointStrategyError(strategy, "device_num", f"{m.device_num}, the device "
                                      f"count checkpoint {str(path)!r} was saved on",
                                      f.device_num)
    for e in ours:
        item = f.parallel_layout_item.get(e.value)
        where = f"parallel_layout_item[{e.value!r}]"
        if item is None:
            raise CheckpointStrategyError(strategy, where, f"the layout of checkpoint "
                                          f"parameter {e.name}", "no such parameter")
        if list(item.tensor_shape) != e.shape:
            raise CheckpointStrategyError(strategy, f"{where}.tensor_shape", f"{e.shape}, as "
                                          f"checkpoint parameter {e.name}", item.tensor_shape)
        if e.tensor_map is not None and (list(item.dev_matrix), list(item.tensor_map)) != (
                e.dev_matrix, e.tensor_map):
            raise CheckpointStrategyError(strategy, f"{where}.tensor_map", f"dev_matrix "
                                          f"{e.dev_matrix} tensor_map {e.tensor_map}, the "
                                          f"layout checkpoint parameter {e.name} was saved in",
                                          f"dev_matrix {item.dev_matrix} tensor_map "
                                          f"{item.tensor_map}")


# ---------------------------------------------------------------------------- restoring


def _restore(path: Any, m: Manifest, matched: dict[str, tuple[ArrayEntry, NamedSharding]]
             ) -> dict[str, Any]:
    """Each array read by orbax straight into its target sharding (every device its block)."""
    import orbax.checkpoint as ocp

    abstract = {k: jax.ShapeDtypeStruct(tuple(e.shape), _dtype(path, e), sharding=sh)
                for k, (e, sh) in matched.items()}
    sizes = [int(np.prod(e.shape, dtype=np.int64)) * x.dtype.itemsize
             for (e, _), x in zip(matched.values(), abstract.values())] or [0]
    # Reads in flight at once: a quarter of the state, at least its largest array (the host
    # buffers orbax reads into sit beside the restored shards until placed)
    in_flight = max(max(sizes) + 1, sum(sizes) // 4, 1 << 20)
    with ocp.StandardCheckpointer(restore_concurrent_gb=in_flight / 1e9) as ckpt:
        return ckpt.restore(Path(path_text(path, "path")) / m.item, abstract)


def _load(path: Any, target: _Target, m: Manifest) -> Restored:
    matched = _match(path, m, target)
    arrays = _restore(path, m, matched)
    key = (lambda e: e.value) if target.by_value else (lambda e: e.name)
    order = {key(e): e.key for e in m.params}
    params = {n: arrays[order[n]] for n in target.params}
    state = {e.name: arrays[e.key] for e in m.opt_state}
    if target.by_value:  # (a strategy file knows values: name the result as the checkpoint)
        names = {e.value: e.name for e in m.params}
        params = {names[v]: x for v, x in params.items()}
    return target.finish(params, state)


def load_checkpoint(path: str | os.PathLike[str], target: Any) -> Restored:
    """Restore a checkpoint under ``target``'s layout: ``(params, opt_state)``.

    ``target``: a ``train_step`` / ``pipeline_train_step`` (the state comes back as that step
    takes it: its storage layouts, a pipelined step's packed state), a :class:`~autopar.Plan`
    (parameters in the plan's layouts; the state a dict by name, each leaf in its
    parameter's layout or replicated), or a strategy file's path (parameters and state dicts
    by name). Names, shapes and dtypes are checked first
    (:class:`CheckpointMismatchError`)."""
    t = _target(target)
    return _load(path, t, read_manifest(path))


# ---------------------------------------------------------------------------- MindSpore


def _saved_from(m: Manifest, r: Restored, records: dict[str, dict[str, Any]], n: int,
                source: str) -> _Saved:
    params = [({**_entry(e.name, r.params[e.name], value=e.value),
                **records.get(e.name, {})}, r.params[e.name]) for e in m.params]
    state = [(_entry(e.name, r.opt_state[e.name], follows=e.follows), r.opt_state[e.name])
             for e in m.opt_state]
    return _Saved(n, source, params, state)


def _records(t: _Target) -> dict[str, dict[str, Any]]:
    """MindSpore's layout fields of each target sharding (row-major mesh axes)."""
    out = {}
    for name, (_, _, sh) in t.params.items():
        axes = list(sh.mesh.axis_names)
        tmap: list[int | list[int]] = []
        for d in sh.spec:
            names = [] if d is None else [d] if isinstance(d, str) else list(d)
            idx = [len(axes) - 1 - axes.index(a) for a in names]
            tmap.append(-1 if not idx else idx[0] if len(idx) == 1 else idx)
        out[name] = {"dev_matrix": [int(s) for s in sh.mesh.devices.shape], "tensor_map": tmap}
    return out


def reshard(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
            to_strategy: Any = None, devices: int | None = None,
            from_strategy: Any = None, prefix: str = "state-") -> Path:
    """Rewrite checkpoint ``src`` as ``dst`` under a strategy file's layouts or spread over
    ``devices`` devices (``autopar reshard``); ``from_strategy``: checked to describe
    ``src``."""
    if (to_strategy is None) == (devices is None):
        raise AutoParallelError("to_strategy / devices", (to_strategy, devices),
                                "give exactly one")
    m = read_manifest(src)
    if from_strategy is not None:
        check_source_strategy(src, m, from_strategy)
    t = _strategy_target(to_strategy) if to_strategy is not None else _spread_target(m, devices)
    r = _load(src, t, m)
    if t.by_value:
        rec = {next(e.name for e in m.params if e.value == v): x
               for v, x in _records(t).items()}
    else:
        rec = _records(t)
    n = int(t.mesh.devices.size)
    return _write(dst, _saved_from(m, r, rec, n, f"resharded from {m.source}"), prefix)


def transform_checkpoints(src_checkpoints_dir: str | os.PathLike[str],
                          dst_checkpoints_dir: str | os.PathLike[str], ckpt_prefix: str,
                          src_strategy_file: Any = None, dst_strategy_file: Any = None) -> Path:
    """MindSpore's ``transform_checkpoints``: the checkpoint in ``src_checkpoints_dir``
    (described by ``src_strategy_file``, checked when given) rewritten in
    ``dst_checkpoints_dir`` under ``dst_strategy_file``'s layouts (None: merged, every
    array whole on one device, as MindSpore merges); ``ckpt_prefix`` names the state folder
    (``<prefix>N``)."""
    if not isinstance(ckpt_prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]*", ckpt_prefix):
        raise AutoParallelError("ckpt_prefix", ckpt_prefix, "letters, digits, '_', '.', '-'")
    if dst_strategy_file is None:
        return reshard(src_checkpoints_dir, dst_checkpoints_dir, devices=1,
                       from_strategy=src_strategy_file, prefix=ckpt_prefix)
    return reshard(src_checkpoints_dir, dst_checkpoints_dir, to_strategy=dst_strategy_file,
                   from_strategy=src_strategy_file, prefix=ckpt_prefix)


def load_distributed_checkpoint(network: Any, checkpoint_filenames: Any,
                                predict_strategy: Any = None,
                                train_strategy_filename: Any = None) -> Restored:
    """MindSpore's ``load_distributed_checkpoint``: the checkpoint (``checkpoint_filenames``:
    its directory, or a list holding it) restored under ``network`` (a step or a plan; None:
    ``predict_strategy``'s layouts), checked against ``train_strategy_filename`` (the
    strategy file it was trained with) when given."""
    path = checkpoint_filenames
    if isinstance(path, (list, tuple)):
        if len(path) != 1:
            raise AutoParallelError("checkpoint_filenames", path, "one checkpoint directory "
                                    "(autopar keeps every rank's shards in one)")
        path = path[0]
    m = read_manifest(path)
    if train_strategy_filename is not None:
        check_source_strategy(path, m, train_strategy_filename)
    if network is None and predict_strategy is None:
        raise AutoParallelError("network", None, "a step or plan, or a predict_strategy file")
    return _load(path, _target(network if network is not None else predict_strategy), m)
