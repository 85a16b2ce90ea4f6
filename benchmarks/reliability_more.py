"""The reliability benchmark's later families (benchmarks/bench_reliability.py runs them):

- **fuzz**: every public function given combined and nested values -- a seeded
  ``hypothesis`` draw (ints past 4,300 digits, NaN, NumPy arrays and scalars, IntEnums,
  paths that are no paths, objects whose repr raises, text with line breaks, nested lists,
  tuples and dicts of them) and values nested 1,000 and 100,000 deep;
- **graph**: odd dtypes (bfloat16, float16, complex64, int32), NaN, zero-size and 0-d
  inputs, duplicated leaves, prime device counts and 10^12-element shapes, traced,
  searched and run; a result must equal one device's;
- **disk**: a full disk and a read-only one (a small tmpfs, where this machine lets us
  mount one): one file, a pipelined step's stage files and a comparison's report, all
  written or none;
- **concurrency**: threads and processes saving one path while others read it;
- **jobs**: two-process ``autopar run`` jobs that never form (peer never started, wrong
  port, mismatched arguments, duplicate ids, a foreign server on the port) or lose a
  process (kill -9, SIGTERM, SIGINT, SIGSTOP of either);
- **argv**: random command lines over every subcommand.
"""

from __future__ import annotations

import enum
import errno
import json
import math
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import autopar as ap
from autopar.files import write_text_atomic
from benchmarks import bench_reliability as br
from benchmarks.bench_reliability import Case, Refused

MORE_CATEGORIES = ("fuzz", "graph", "disk", "concurrency", "jobs", "argv")
#: Why the disk family did not run where it did not (set by :func:`disk_cases`).
SKIPPED: dict[str, str] = {}


# ---------------------------------------------------------------------------- fuzz values


class Two(enum.IntEnum):
    TWO = 2


class BadRepr:
    """An object whose repr raises (an error message must still be written)."""

    def __repr__(self) -> str:
        raise RuntimeError("repr fails")


class NoPath:
    """An ``os.PathLike`` whose ``__fspath__`` returns no str."""

    def __fspath__(self) -> Any:
        return 3


def nested(depth: int, kind: str = "list") -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v] if kind == "list" else {"a": v}
    return v


HUGE = 10 ** 5000
FIXED_VALUES: list[tuple[str, Any]] = [
    ("an int of 5001 digits", HUGE), ("a list nested 1,000 deep", nested(1000)),
    ("a list nested 100,000 deep", nested(100_000)), ("a dict nested 2,000 deep",
                                                       nested(2000, "dict")),
    ("a NumPy array", np.array([1, 2])), ("an IntEnum", Two.TWO),
    ("an object whose repr raises", BadRepr()), ("a PathLike giving an int", NoPath()),
    ("text with a line break", "a\nb"), ("[huge int]", [HUGE])]


def hypothesis_values(count: int, seed: int) -> list[tuple[str, Any]]:
    """``count`` combined and nested values drawn by ``hypothesis`` (seeded: the same on
    every run)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    odd = [lambda: np.int64(2), lambda: np.float32(1.5), lambda: np.bool_(True),
           lambda: np.array([1, 2]), lambda: np.array("x"), lambda: Two.TWO, BadRepr, NoPath,
           lambda: Path("a.json"), lambda: HUGE]  # (built: hypothesis reprs what it holds)
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
        st.binary(max_size=4), st.one_of([st.builds(f) for f in odd]), st.sampled_from([
            "a\nb", "\udcff", "", "x" * 300, -0.0, 8, 1, 0, -1, "auto_parallel", "level2",
            "index"]))
    values = st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 3)), inner,
                        max_size=3)), max_leaves=6)
    out: list[Any] = []

    @hseed(seed)
    @settings(max_examples=count, derandomize=False, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(values)
    def draw(v: Any) -> None:
        out.append(v)

    draw()
    return [(f"drawn #{k}: {br.short_repr(v, 50)}", v) for k, v in enumerate(out[:count])]


def _ctx(key: str) -> Callable[[Any], Any]:
    def call(v: Any) -> Any:
        with ap.auto_parallel_context(**{key: v}):
            return "entered"
    return call


def _algo(key: str) -> Callable[[Any], Any]:
    def call(v: Any) -> Any:
        with ap.algo_parameters_context(**{key: v}):
            return "entered"
    return call


def public_calls() -> list[tuple[str, str, Callable[[Any], Any]]]:
    """(label, what the error must name, call(value)) of every public function, the value
    in one argument."""
    fx = br.fixture()
    g, plan, node = fx.graph, fx.plan, fx.graph.nodes[0].name
    cl = br.CLUSTER
    calls: list[tuple[str, str, Callable[[Any], Any]]] = [
        (f"auto_parallel_context({k}=...)", k, _ctx(k)) for k in br.ALL_KEYS]
    calls += [(f"algo_parameters_context({k}=...)", k, _algo(k))
              for k in ap.algo.ALGO_KEYS]
    calls += [
        ("parallel_optimizer_config={optimizer_level: ..., gradient_accumulation_shard}",
         "parallel_optimizer_config", lambda v: _ctx("parallel_optimizer_config")(
             {"optimizer_level": v, "gradient_accumulation_shard": True})),
        ("get_auto_parallel_context(...)", "get_auto_parallel_context",
         ap.get_auto_parallel_context),
        ("get_algo_parameters(...)", "attr_key|get_algo_parameters", ap.get_algo_parameters),
        ("hccl.create_group('fz', ...)", "rank_ids", lambda v: ap.hccl.create_group("fz", v)),
        ("hccl.create_group(..., [0, 1])", "group", lambda v: ap.hccl.create_group(v, [0, 1])),
        ("hccl.set_split_strategy_by_size(...)", "dataSizeList",
         ap.hccl.set_split_strategy_by_size),
        ("hccl.set_split_strategy_by_idx(...)", "idxList", ap.hccl.set_split_strategy_by_idx),
        ("hccl.get_rank_size(...)", "group", ap.hccl.get_rank_size),
        ("Layout(..., names)", "device_matrix", lambda v: ap.Layout(v, ("dp", "mp"))),
        ("Layout((2, 4), ...)", "alias_name", lambda v: ap.Layout((2, 4), v)),
        ("Layout((2, 4), names)(..., 'mp')", "alias",
         lambda v: ap.Layout((2, 4), ("dp", "mp"))(v, "mp")),
        ("search(mode=...)", "mode", lambda v: _searched(lambda: ap.search(g, mode=v,
                                                                           cluster=cl))),
        ("search(device_num=...)", "device_num",
         lambda v: _searched(lambda: ap.search(g, device_num=v, cluster=cl))),
        ("search(cluster=...)", "cluster", lambda v: _searched(lambda: ap.search(g, cluster=v))),
        ("search(fixed={node: ...})", "node",
         lambda v: _searched(lambda: ap.search(g, fixed={node: v}, cluster=cl))),
        ("search(fixed={node: ((..., 1), (1, 8))})", "node", lambda v: _searched(
            lambda: ap.search(g, fixed={node: ((v, 1), (1, 8))}, cluster=cl))),
        ("search(fixed=...)", "fixed|node", lambda v: _searched(lambda: ap.search(g, fixed=v,
                                                                            cluster=cl))),
        ("explain(node=...)", "node", lambda v: _searched(lambda: ap.explain(g, plan, v))),
        ("explain(cluster=...)", "cluster",
         lambda v: _searched(lambda: ap.explain(g, plan, node, cluster=v))),
        ("compare_modes(modes=...)", "mode", lambda v: _searched(
            lambda: ap.compare_modes(g, device_num=8, cluster=cl, modes=v))),
        ("simulate(buckets=...)", "buckets",
         lambda v: _searched(lambda: ap.simulation.simulate(g, plan, buckets=v))),
        ("simulate(device_num=...)", "device_num",
         lambda v: _searched(lambda: ap.simulation.simulate(g, plan, device_num=v))),
        ("simulate_schedule(micro_batches=...)", "micro_batches",
         lambda v: ap.simulation.simulate_schedule([1.0, 1.0], [1.0, 1.0], micro_batches=v)),
        ("simulate_pipeline(micro_batches=...)", "micro_batches", lambda v: _searched(
            lambda: ap.simulation.simulate_pipeline(g, 2, micro_batches=v, cluster=cl))),
        ("gradient_buckets(policy=...)", "policy",
         lambda v: ap.simulation.gradient_buckets(g, plan, policy=v)),
        ("advise_split(max_segments=...)", "max_segments", lambda v: _searched(
            lambda: ap.simulation.advise_split(g, plan, max_segments=v, cluster=cl))),
        ("load_strategy(path=...)", "path|strategy file", lambda v: ap.load_strategy(v, g)),
        ("save_strategy(path=...)", "strategy_ckpt_save_file",
         lambda v: ap.save_strategy(plan, g, v)),
        ("import_mindspore_strategy(path=...)", "path|strategy file",
         lambda v: ap.import_mindspore_strategy(v, g)),
        ("clusters.resolve_cluster(...)", "cluster", ap.clusters.resolve_cluster),
        ("trace(param_argnums=...)", "param_argnums",
         lambda v: ap.trace(fx.model.loss, fx.params, fx.x, param_argnums=v)),
        ("trace(annotations=...)", "annotations|node",
         lambda v: ap.trace(fx.model.loss, fx.params, fx.x, annotations=v)),
        ("trace(fn, params, ...)", "args", lambda v: ap.trace(  # (fn reads no x: its own
            lambda p, x: jnp.sum(p["layer0"]["w"]), fx.params, v)),  # errors are not ours)
        ("trace(name=...)", "name", lambda v: ap.trace(fx.model.loss, fx.params, fx.x, name=v)),
        ("shard(jnp.tanh, (...,))", "in_strategy|autopar.shard", lambda v: ap.trace(
            ap.shard(jnp.tanh, (v,)), np.ones((8, 8), np.float32))),
        ("shard(jnp.tanh, ((..., 1),))", "in_strategy|autopar.shard", lambda v: ap.trace(
            ap.shard(jnp.tanh, ((v, 1),)), np.ones((8, 8), np.float32))),
        ("train_step(optimizer=...)", "optimizer", lambda v: _searched(
            lambda: ap.train_step(fx.model.loss, fx.params, (fx.x,), v, cluster=cl))),
        ("a built step called with ... as its batch", "batch",
         lambda v: fx.step(fx.params, fx.opt_state, v)),
        ("to_jax_shardings(...)", "plan", ap.to_jax_shardings),
    ]
    return calls


def _searched(fn: Callable[[], Any]) -> Any:
    """``fn()`` under the context a search of the fixture needs."""
    with br.plain_context(gradients_mean=True):
        return fn()


def fuzz_cases(quick: bool) -> list[Case]:
    """Every public call x the fixed hostile values and a seeded hypothesis draw: a typed
    error naming the argument, or a result (nothing changed either way)."""
    drawn = hypothesis_values(2 if quick else 10, br.SEED)
    fixed = FIXED_VALUES[:4] + FIXED_VALUES[6:8] if quick else FIXED_VALUES
    cases = []
    for label, key, call in public_calls():
        for vlabel, value in [*fixed, *drawn]:
            cases.append(Case("fuzz", f"{label} <- {vlabel}",
                              lambda tmp, call=call, value=value: _in(tmp, call, value),
                              names=(key,), expect="either", check=_accepted))
    return cases


def _in(tmp: Path, call: Callable[[Any], Any], value: Any) -> Any:
    """``call(value)`` in the case's directory (a value taken as a relative path names a
    file there)."""
    here = os.getcwd()
    os.chdir(tmp)
    try:
        return call(value)
    finally:
        os.chdir(here)


def _accepted(tmp: Path, result: Any) -> None:
    """A value accepted (a valid one drawn: a file name a save may write): what it wrote is
    removed (the files a refusal must leave alone are judged on refusals)."""
    for p in tmp.iterdir():
        if p.is_file() or p.is_symlink():
            p.unlink()
    return None


# ---------------------------------------------------------------------------- graph


def _mlp_fn(p: Any, x: Any) -> Any:
    return jnp.tanh(x @ p["w1"]) @ p["w2"]


def _mlp_args(dtype: Any, rows: int = 8) -> tuple[Any, Any]:
    rng = np.random.default_rng(br.SEED)
    p = {"w1": rng.standard_normal((16, 32)).astype(dtype),
         "w2": rng.standard_normal((32, 16)).astype(dtype)}
    return p, rng.standard_normal((rows, 16)).astype(dtype)


def graph_specs() -> list[tuple[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]]]:
    """(label, fn, args, context keys) of the hostile graphs: each is searched,
    parallelized and run, and must give one device's result (or a typed error)."""
    import ml_dtypes

    p32, x32 = _mlp_args(np.float32)
    nan_x = x32.copy()
    nan_x[1, 3] = np.nan
    w = p32["w1"]
    ints = {"w1": np.arange(16 * 32, dtype=np.int32).reshape(16, 32) % 7,
            "w2": np.arange(32 * 16, dtype=np.int32).reshape(32, 16) % 5}
    cplx = {k: (v + 1j * v).astype(np.complex64) for k, v in p32.items()}
    return [
        ("bfloat16", _mlp_fn, _mlp_args(ml_dtypes.bfloat16), {}),
        ("float16", _mlp_fn, _mlp_args(np.float16), {}),
        ("complex64", lambda p, x: (x @ p["w1"]) @ p["w2"], (cplx, x32.astype(np.complex64)),
         {}),
        ("int32", lambda p, x: (x @ p["w1"]) @ p["w2"], (ints, (x32 * 3).astype(np.int32)),
         {}),
        ("a NaN in the batch", _mlp_fn, (p32, nan_x), {}),
        ("a batch of no rows", _mlp_fn, _mlp_args(np.float32, rows=0), {}),
        ("0-d inputs", lambda a, b: a * b + jnp.sin(a), (np.float32(2.0), np.float32(3.0)),
         {}),
        ("a 0-d parameter", lambda p, x: x * p["s"] + x @ p["w"],
         ({"s": np.float32(2.0), "w": np.ones((16, 16), np.float32)}, x32), {}),
        ("one array as two parameters", lambda p, x: jnp.tanh(x @ p["a"]) @ p["b"].T,
         ({"a": w, "b": w}, x32), {}),
        ("device_num=7 (prime)", _mlp_fn, (p32, x32), {"device_num": 7}),
        ("device_num=5 (prime), 5 rows", _mlp_fn, _mlp_args(np.float32, rows=5),
         {"device_num": 5}),
        ("device_num=3 (prime), shapes of 3", lambda p, x: x @ p["w"],
         ({"w": np.ones((9, 3), np.float32)}, np.ones((6, 9), np.float32)),
         {"device_num": 3}),
    ]


def _reference(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.tree.map(np.asarray, jax.jit(fn)(*args))


def _same(got: Any, want: Any) -> str | None:
    """None when ``got`` is ``want`` (NaN where it is NaN; the tolerance of the dtype)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"returned {got.dtype}{got.shape}, one device {want.dtype}{want.shape}"
    tol = {2: 5e-2, 4: 1e-4, 8: 1e-4}.get(got.dtype.itemsize, 1e-4)
    a, b = got.astype(np.complex128), want.astype(np.complex128)
    if not np.allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.nanmax(np.abs(b)))
                                                       if b.size else 1.0), equal_nan=True):
        return f"differs from one device by {float(np.nanmax(np.abs(a - b))):.3g}"
    return None


def _graph_call(fn: Callable[..., Any], args: tuple[Any, ...], keys: dict[str, Any],
                mode: str) -> Callable[[Path], Any]:
    def call(tmp: Path) -> Any:
        with br.plain_context(**{"search_mode": mode, **keys}):
            f = ap.parallelize(fn, *args, cluster=br.CLUSTER)
        return np.asarray(f(*args)), _reference(fn, args)
    return call


def _big_call(tmp: Path) -> Any:
    """A 10^12-element matmul: traced from shapes and searched (never run)."""
    a = jax.ShapeDtypeStruct((10 ** 6, 10 ** 6), jnp.float32)
    g = ap.trace(lambda x, y: x @ y, a, a)
    with br.plain_context():
        return ap.search(g, cluster=br.CLUSTER).summary()


def graph_cases(quick: bool) -> list[Case]:
    """Each hostile graph under two search modes (quick: five graphs, one mode)."""
    specs = graph_specs()
    if quick:
        specs = [specs[i] for i in (0, 4, 5, 6, 9)]
    modes = ("dynamic_programming",) if quick else ("dynamic_programming",
                                                    "recursive_programming")
    cases = [Case("graph", f"{label} ({mode})", _graph_call(fn, args, keys, mode),
                  names=tuple(keys) or (), expect="either",
                  check=lambda tmp, r: _same(*r))
             for label, fn, args, keys in specs for mode in modes]
    cases.append(Case("graph", "a 10^12-element matmul, traced from shapes and searched",
                      _big_call, expect="either", check=lambda tmp, r: None))
    return cases


# ---------------------------------------------------------------------------- disk


@cache
def tmpfs_reason() -> str:
    """'' where a small tmpfs can be mounted here (root, and a kernel that lets this
    container mount one), else why the disk family is skipped."""
    if os.geteuid() != 0:
        return "not root: no tmpfs can be mounted to fill or make read-only"
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"autopar-tmpfs-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        if _mount(probe, 16):
            return "mounting a tmpfs failed here (no CAP_SYS_ADMIN?)"
        _umount(probe)
        return ""
    finally:
        probe.rmdir()


def _mount(where: Path, kib: int) -> str:
    """Mount a tmpfs of ``kib`` KiB at ``where``: '' or why not."""
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0755", "tmpfs",
                            str(where)], capture_output=True, text=True, check=False)
    except OSError as e:  # (no mount command)
        return str(e)
    return p.stderr.strip() or f"mount exited {p.returncode}" if p.returncode else ""


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def _fill(disk: Path, leave: int = 0) -> None:
    """Fill ``disk`` to the last byte, then free ``leave`` bytes (whole pages)."""
    with open(disk / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        fh.truncate(max(0, (os.path.getsize(disk / "filler") // 4096) * 4096 - leave))


def _on_disk(kib: int, prepare: Callable[[Path], None], act: Callable[[Path], Any],
             *, readonly: bool = False) -> Callable[[Path], Any]:
    """A case on a tmpfs of ``kib`` KiB at ``tmp/disk``: ``prepare(disk)`` writes the old
    files (and fills it), ``act(disk)`` must fail with a typed error leaving every file of
    the disk as it was (kind, bytes, mode) and nothing behind; judged here (the disk is
    unmounted before the runner looks)."""
    def call(tmp: Path) -> Any:
        disk = tmp / "disk"
        disk.mkdir()
        problem = _mount(disk, kib)
        if problem:
            raise RuntimeError(f"could not mount a tmpfs: {problem}")
        try:
            prepare(disk)
            if readonly:
                subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
            before = br.files_state(disk)
            try:
                result = act(disk)
            except ap.AutoparError as e:
                error = e
            else:
                raise RuntimeError(f"no error on a full or read-only disk: {result!r:.100}")
            harmed = br.file_changes(before, br.files_state(disk))
            if harmed:
                raise RuntimeError(f"{type(error).__name__}: {error}; files harmed: {harmed}")
            raise Refused(f"{type(error).__name__}: {error}")
        finally:
            _umount(disk)
            disk.rmdir()  # (the case's own mount point: not the runner's to judge)
    return call


def _stage_loss(p: Any, x: Any, y: Any) -> Any:
    with jax.named_scope("l1"):
        h = jnp.tanh(x @ p["w1"])
    with jax.named_scope("l2"):
        out = h @ p["w2"]
    with jax.named_scope("loss"):
        return jnp.mean((out - y) ** 2)


def _pipelined(disk: Path, name: str = "s.json") -> Any:
    rng = np.random.default_rng(br.SEED)
    p = {"w1": rng.standard_normal((8, 16)).astype(np.float32),
         "w2": rng.standard_normal((16, 8)).astype(np.float32)}
    x, y = (rng.standard_normal((16, 8)).astype(np.float32) for _ in range(2))
    with br.plain_context(parallel_mode="semi_auto_parallel", gradients_mean=True,
                          pipeline_stages=2, strategy_ckpt_save_file=str(disk / name)):
        return ap.pipeline.pipeline_train_step(_stage_loss, p, (x, y))


def _old_stage_files(disk: Path) -> None:
    """Old stage files, and room for the first stage's new file only (its size learnt from
    the same step saving its files beside the disk first)."""
    _pipelined(disk.parent, "dry.json")
    pages = math.ceil((disk.parent / "dry_stage0.json").stat().st_size / 4096)
    for s in range(2):
        (disk.parent / f"dry_stage{s}.json").unlink()
        (disk / f"s_stage{s}.json").write_text(f"OLD {s}\n")
    _fill(disk, leave=pages * 4096)


def _comparison(disk: Path) -> Any:
    from autopar.compare import write_comparison

    fx = br.fixture()
    rows = ap.compare_modes(fx.graph, device_num=8, cluster=br.CLUSTER,
                            modes=["dynamic_programming"])
    return write_comparison(rows, disk / "new" / "report", title="t", meta={})


def disk_cases(quick: bool) -> list[Case]:
    """Saves onto a full and a read-only tmpfs (skipped, with the reason in the results,
    where none can be mounted)."""
    reason = tmpfs_reason()
    if reason:
        SKIPPED["disk"] = reason
        return []
    fx = br.fixture()
    old = lambda disk: ((disk / "s.json").write_bytes(fx.other), _fill(disk))  # noqa: E731
    table = [
        ("save_strategy over a file, disk full", 64, old,
         lambda d: ap.save_strategy(fx.plan, fx.graph, d / "s.json"), False, "s.json"),
        ("a pipelined step's two stage files, room for one", 64, _old_stage_files,
         _pipelined, False, "s_stage"),
        ("compare's report into a new directory, disk full", 64, _fill, _comparison, False,
         "compare"),
        ("save_cluster over a file, disk full", 64,
         lambda d: ((d / "c.json").write_bytes(fx.cluster_bytes), _fill(d)),
         lambda d: ap.clusters.save_cluster(fx.cluster, d / "c.json"), False, "c.json"),
        ("save_strategy over a file, read-only disk", 64,
         lambda d: (d / "s.json").write_bytes(fx.other),
         lambda d: ap.save_strategy(fx.plan, fx.graph, d / "s.json"), True, "s.json"),
        ("a pipelined step's stage files, read-only disk", 64,
         lambda d: [(d / f"s_stage{s}.json").write_text("OLD") for s in range(2)],
         _pipelined, True, "s_stage")]
    if quick:
        table = table[:2]
    return [Case("disk", label, _on_disk(kib, prep, act, readonly=ro), names=(name,),
                 typed=(Refused,)) for label, kib, prep, act, ro, name in table]


# ---------------------------------------------------------------------------- concurrency


def _umask() -> int:
    """The process's umask, read without setting it (/proc; 0o022 where there is none)."""
    try:
        with open("/proc/self/status") as fh:
            return int(next(x for x in fh if x.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration):
        return 0o022


def _reader(path: Path, docs: Sequence[bytes], stop: threading.Event,
            seen: dict[str, int]) -> None:
    while not stop.is_set():
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            seen["missing"] += 1
            continue
        seen["reads"] += 1
        if data not in docs:
            seen["bad"] += 1


def _threads_call(threads: int, saves: int) -> Callable[[Path], Any]:
    """``threads`` threads each saving the two documents in turn over one ``0640`` file,
    and each also saving new files, while a thread reads the file: every read is one of
    the two documents, the file keeps its mode, new files get ``0666`` less the umask, and
    the umask is never changed."""
    def call(tmp: Path) -> Any:
        fx, path = br.fixture(), tmp / "s.json"
        docs = (fx.valid, fx.other)
        mask, stop = _umask(), threading.Event()
        seen = {"reads": 0, "bad": 0, "missing": 0, "umask changed": 0}
        reader = threading.Thread(target=_reader, args=(path, docs, stop, seen))
        reader.start()

        def save(k: int) -> None:
            for i in range(saves):
                write_text_atomic(path, docs[(k + i) % 2].decode())
                write_text_atomic(tmp / f"new-{k}-{i}.json", "{}")
                seen["umask changed"] += _umask() != mask
        try:
            workers = [threading.Thread(target=save, args=(k,)) for k in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        finally:
            stop.set()
            reader.join()
        modes = {oct(stat.S_IMODE(p.stat().st_mode)) for p in tmp.glob("new-*.json")}
        return {**seen, "mode": oct(stat.S_IMODE(path.stat().st_mode)), "new modes": modes,
                "want": oct(0o666 & ~mask)}
    return call


def _threads_check(tmp: Path, r: Any) -> str | None:
    bad = [k for k in ("bad", "missing", "umask changed") if r[k]]
    if bad or r["mode"] != "0o640" or r["new modes"] != {r["want"]}:
        return f"{r}"
    for p in tmp.glob("new-*.json"):  # (the new files are this case's own writes)
        p.unlink()
    return None


PROCESS_SAVER = br.CHILD_PRELUDE + """
import json
docs = json.load(sys.stdin)
for i in range(int(sys.argv[2])):
    write_text_atomic(sys.argv[1], docs[i % 2], key="strategy_ckpt_save_file")
"""


def _processes_call(processes: int, saves: int) -> Callable[[Path], Any]:
    """``processes`` processes saving the two documents over one path while this one
    reads it: no read is anything but one of them."""
    def call(tmp: Path) -> Any:
        fx, path = br.fixture(), tmp / "s.json"
        docs = (fx.valid, fx.other)
        stop, seen = threading.Event(), {"reads": 0, "bad": 0, "missing": 0}
        reader = threading.Thread(target=_reader, args=(path, docs, stop, seen))
        reader.start()
        try:
            children = [subprocess.Popen([sys.executable, "-c", PROCESS_SAVER, str(path),
                                          str(saves)], stdin=subprocess.PIPE, text=True)
                        for _ in range(processes)]
            for c in children:
                c.communicate(json.dumps([d.decode() for d in docs]), timeout=120)
        finally:
            stop.set()
            reader.join()
        return {**seen, "exits": [c.returncode for c in children]}
    return call


def concurrency_cases(quick: bool) -> list[Case]:
    fx = br.fixture()
    setup = br._put("s.json", fx.valid, 0o640)
    threads, saves = (4, 20) if quick else (8, 60)
    return [
        Case("concurrency", f"{threads} threads x {saves} saves of one 0640 file and of new "
             "files, a thread reading", _threads_call(threads, saves), expect="clean",
             check=_threads_check, setup=setup, writes=("s.json",)),
        Case("concurrency", f"3 processes x {10 if quick else 150} saves of one file, a "
             "reader", _processes_call(3, 10 if quick else 150), expect="clean",
             check=lambda tmp, r: None if not r["bad"] and not r["missing"] and not any(
                 r["exits"]) else f"{r}", setup=setup, writes=("s.json",)),
    ]


# ---------------------------------------------------------------------------- jobs


#: The CLI with a shorter wait for the job to form (and for a silent process): a case must
#: not take the minute a user's job gets
JOB_CLI = ("import sys, autopar.cli as c; c.COORDINATOR_TIMEOUT_S = int(sys.argv[1]); "
           "sys.exit(c.main(sys.argv[2:]))")
JOB_TIMEOUT_S = 5
#: Seconds a process may take past the job's timeout to end with its line
JOB_MARGIN_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_process(tmp: Path, name: str, process_id: int, n: int, port: int,
                *extra: str) -> tuple[subprocess.Popen, Path]:
    """One process of an ``autopar run`` job (a small MLP, many steps), its stderr in a
    file of ``tmp``."""
    err = tmp / f"{name}.err"
    cmd = [sys.executable, "-c", JOB_CLI, str(JOB_TIMEOUT_S), "run", "--model", "mlp",
           "--devices", "4", "--steps", "4096", "--num-processes", str(n), "--process-id",
           str(process_id), "--coordinator", f"127.0.0.1:{port}", *extra]
    with err.open("w") as fh:
        return subprocess.Popen(cmd, cwd=tmp, env=br.cli_env(), stdout=subprocess.DEVNULL,
                                stderr=fh, stdin=subprocess.DEVNULL), err


class _Foreign:
    """Another program on the port: it accepts and answers every connection with junk."""

    def __init__(self, port: int) -> None:
        self.server = socket.create_server(("127.0.0.1", port))
        self.server.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            with conn:
                try:
                    conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.server.close()


def _wait_training(err: Path, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        if "train steps: loss" in err.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the job did not start training within {seconds:.0f} s: "
                       f"{err.read_text(errors='replace')[-300:]}")


def _verdicts(procs: list[tuple[subprocess.Popen, Path]], judged: Sequence[int],
              since: float) -> str:
    """Wait for every process (each must end within the job's timeout and margin), judge
    the ``judged`` ones as the CLI's (non-zero, one error line, no traceback or C++ stack):
    their lines, or RuntimeError."""
    lines = []
    for k, (p, err) in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, since + JOB_TIMEOUT_S + JOB_MARGIN_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"process {k} did not end within {JOB_TIMEOUT_S + JOB_MARGIN_S:.0f}"
                               f" s: {err.read_text(errors='replace')[-300:]}") from None
        if k in judged:
            try:
                br.cli_verdict(p.returncode, "", err.read_text(errors="replace"))
            except Refused as e:
                lines.append(f"[{k}] exit {p.returncode}: {e}")
                continue
            raise RuntimeError(f"process {k} ended 0 where the job failed")
    return " | ".join(lines)


def _job(spawn: Callable[[Path, int], list[tuple[subprocess.Popen, Path]]],
         judged: Sequence[int], fault: tuple[int, int] | None = None,
         foreign: bool = False) -> Callable[[Path], Any]:
    """A job case: ``spawn(tmp, port)`` starts its processes; ``fault``: (process, signal)
    sent once the job trains. Every process judged must end with its one line."""
    def call(tmp: Path) -> Any:
        port = free_port()
        other = _Foreign(port) if foreign else None
        procs: list[tuple[subprocess.Popen, Path]] = []
        try:
            procs = spawn(tmp, port)
            since = time.monotonic()
            if fault is not None:
                _wait_training(procs[0][1], procs[0][0], 60.0)
                procs[fault[0]][0].send_signal(fault[1])
                since = time.monotonic()
                if fault[1] == signal.SIGSTOP:
                    survivor = procs[1 - fault[0]][0]
                    try:
                        survivor.wait(timeout=JOB_TIMEOUT_S + JOB_MARGIN_S)
                    except subprocess.TimeoutExpired:
                        pass
                    procs[fault[0]][0].send_signal(signal.SIGCONT)
            raise Refused(_verdicts(procs, judged, since))
        finally:
            for p, err in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                    p.wait()
                err.unlink()  # (the harness's own record of the process's stderr)
            if other is not None:
                other.close()
    return call


def _pair(*extra0: str, n1: int = 2, extra1: Sequence[str] = (), port1: int | None = None
          ) -> Callable[[Path, int], list[tuple[subprocess.Popen, Path]]]:
    def spawn(tmp: Path, port: int) -> list[tuple[subprocess.Popen, Path]]:
        first = job_process(tmp, "p0", 0, 2, port, *extra0)
        time.sleep(0.5)
        return [first, job_process(tmp, "p1", 1, n1, port if port1 is None else port1,
                                   *extra1)]
    return spawn


def job_cases(quick: bool) -> list[Case]:
    """Jobs that never form, and jobs that lose a process once they train."""
    alone0 = lambda tmp, port: [job_process(tmp, "p0", 0, 2, port)]  # noqa: E731
    alone1 = lambda tmp, port: [job_process(tmp, "p1", 1, 2, port)]  # noqa: E731

    def both_zero(tmp: Path, port: int) -> list[tuple[subprocess.Popen, Path]]:
        first = job_process(tmp, "p0", 0, 2, port)
        time.sleep(1.0)
        return [first, job_process(tmp, "p0b", 0, 2, port)]

    def two_ones(tmp: Path, port: int) -> list[tuple[subprocess.Popen, Path]]:
        return [job_process(tmp, "p0", 0, 3, port, "--devices", "3"),
                job_process(tmp, "p1", 1, 3, port, "--devices", "3"),
                job_process(tmp, "p1b", 1, 3, port, "--devices", "3")]

    forming = [
        ("process 1 never started", alone0, (0,), ("process(es) [1]",), False),
        ("process 0 never started", alone1, (0,), ("process 1", "no process 0"), False),
        ("the processes given different ports", _pair(port1=free_port()), (0, 1),
         ("process(es) [1]", "no process 0"), False),
        ("--num-processes 2 beside 4", _pair(n1=4), (0, 1), ("--num-processes",), False),
        ("--devices 4 beside 8", _pair(extra1=("--devices", "8")), (0, 1), ("--devices",),
         False),
        ("two processes given --process-id 0", both_zero, (0, 1), ("--process-id 0",),
         False),
        ("two processes given --process-id 1 (of 3)", two_ones, (0, 1, 2), ("--process-id",),
         False),
        ("another program on the port", _pair(), (0, 1), ("another program",), True)]
    faults = [(f"{name} of process {k} while it trains", (k, sig), (1 - k,) if name ==
               "kill -9" else (0, 1), (f"process {k}",))
              for name, sig in (("kill -9", signal.SIGKILL), ("SIGTERM", signal.SIGTERM),
                                ("SIGINT", signal.SIGINT), ("SIGSTOP", signal.SIGSTOP))
              for k in (1, 0)]
    if quick:
        forming, faults = forming[:1], faults[:1]
    cases = [Case("jobs", label, _job(spawn, judged, foreign=foreign), names=names,
                  typed=(Refused,)) for label, spawn, judged, names, foreign in forming]
    cases += [Case("jobs", label, _job(_pair(), judged, fault=fault), names=names,
                   typed=(Refused,)) for label, fault, judged, names in faults]
    return cases


# ---------------------------------------------------------------------------- argv


#: A small valid command line of each subcommand (``demo``, minutes long, is left to the
#: cli family's refusals)
BASE_ARGV = {
    "search": ["search", "--model", "mlp", "--devices", "8"],
    "compare": ["compare", "--model", "mlp", "--devices", "8", "--modes",
                "dynamic_programming", "--out", "out"],
    "run": ["run", "--model", "mlp", "--devices", "8", "--steps", "1"],
    "tune": ["tune", "--model", "mlp", "--devices", "8", "-k", "2", "--steps", "1"],
    "simulate": ["simulate", "--model", "mlp", "--devices", "8"],
    "calibrate": ["calibrate", "--devices", "2", "--quick", "--budget", "1", "--fresh"],
    "show": ["show", "s.json"]}
NASTY = ["a\nb", "x=\ny", "-1", "0", "nan", "1e999", "\udcff", "", " ", "=", "10" * 40,
         "99999999999999999999", "/dev/null", "/proc/self/fd/1", "s.json", "garbage.json",
         "t-fifo.json", "subdir", "((2, 1),)", "widths=(8,\n16)", "--", "-o", "mlp",
         "badmodels:boom", "layer0/dot_general_0=((1, 1), (1, 8))", "\u2028"]


def _options(command: str) -> list[str]:
    from autopar.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sorted(o for a in sub.choices[command]._actions for o in a.option_strings
                  if o not in ("-h", "--help"))


def random_argv(rng: random.Random) -> list[str]:
    """A small valid command line with one to three random changes: a value replaced, an
    option of the subcommand added with a hostile value, a word dropped or appended."""
    command = rng.choice(sorted(BASE_ARGV))
    argv = list(BASE_ARGV[command])
    for _ in range(rng.randint(1, 3)):
        how = rng.randrange(4)
        values = [i for i, a in enumerate(argv) if i and not a.startswith("-")]
        if how == 0 and values:
            argv[rng.choice(values)] = rng.choice(NASTY)
        elif how == 1:
            at = rng.randrange(1, len(argv) + 1)
            argv[at:at] = [rng.choice(_options(command)), rng.choice(NASTY)]
        elif how == 2 and len(argv) > 1:
            del argv[rng.randrange(1, len(argv))]
        else:
            argv.append(rng.choice(NASTY))
    return argv


def _argv_check(tmp: Path, result: Any) -> None:
    """A command that succeeded: what it wrote (a report, a strategy file) is removed."""
    import shutil

    for p in tmp.iterdir():
        if p.name in ("out", "demo-out") or p.name.endswith((".png", ".md")) or \
                p.name not in _SETUP_NAMES:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    return None


_SETUP_NAMES = {"badmodels.py", "brokenmod.py", "garbage.json", "s.json", "subdir",
                "t-fifo.json"}


def argv_cases(quick: bool) -> list[Case]:
    """Random command lines (seeded): exit 0, or a non-zero exit with one error line and
    no traceback; a refusal writes nothing."""
    rng = random.Random(br.SEED + 3)
    argvs = [random_argv(rng) for _ in range(4 if quick else 40)]
    return [Case("argv", "autopar " + " ".join(map(repr, argv))[:200], br._cli_call(argv),
                 names=(), expect="either", typed=(Refused,), check=_argv_check,
                 setup=br._cli_setup) for argv in argvs]
