"""Reliability: hostile inputs against autopar's public surface (the `reliability` job).

    .venv/bin/python -m benchmarks reliability [--quick]

Every case feeds one hostile input to a public entry point and records whether

1. it failed with one of autopar's typed errors (an ``AutoparError``: ``StrategyFileError``,
   ``ClusterFileError``, ``UnknownKeyError``, ...) or, where succeeding is right, succeeded with
   a checked result (a mutated strategy file that still loads must give the saved plan; a
   write through a symlink must keep the link and the target's mode). For the CLI: a
   non-zero exit with exactly one ``error:`` line on stderr (progress lines and argparse's
   usage aside) and no traceback;
2. nothing changed: every key of the auto-parallel context (and the set of keys set
   explicitly), the HCCL groups and split strategies, the ``AUTOPAR_*`` environment,
   ``/dev/null``, and every file of the case's own directory (kind, bytes, mode, link target;
   a file left behind, such as a temporary, is litter);
3. its message names the offending key, option or file (and can be printed: UTF-8).

Categories: context, hccl, strategy files, calibration files, writer, kill -9 during save,
cli, train_step, and (benchmarks/reliability_more.py) fuzz, graph, disk, concurrency, jobs,
argv. Cases are generated systematically and deterministically (seed ``SEED``).
A full run writes benchmarks/results/reliability.json (one row per category; every failing
case, with what went wrong, in ``meta.failing``) and the table between the ``reliability``
markers of docs/reliability.md; ``--quick`` runs a subset (one CLI subprocess) and writes
to results/quick only.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import optax

import autopar as ap
from autopar.checkpoint import dumps_strategy, strategy_document
from benchmarks._common import DocTables
from autopar.clusters import dumps_cluster
from autopar.context import explicit_keys
from autopar.errors import AutoparError, safe_repr
from autopar.files import write_bytes_atomic, write_text_atomic
from autopar.models import mlp

ROOT = Path(__file__).resolve().parent.parent
SEED = 20240611
CLUSTER = "accelerator-8x"
CASE_TIMEOUT_S = 60.0
COLUMNS = ["category", "cases", "typed_errors", "clean_ok", "untyped", "accepted_or_wrong",
           "state_changed", "files_harmed", "names_key_or_file", "failing"]
CATEGORIES = ("context", "hccl", "strategy files", "calibration files", "writer",
              "kill -9 during save", "cli", "train_step", "fuzz", "graph", "disk",
              "concurrency", "jobs", "argv")
#: Categories whose cases run other processes, two at a time
POOLED = ("cli", "argv")


# ---------------------------------------------------------------------------- the runner


class Refused(Exception):
    """A clean refusal reported by another process (the CLI's error line, a child's typed
    error): the typed outcome of cases that run a subprocess."""


class CaseTimeout(Exception):
    """A case that did not return within :data:`CASE_TIMEOUT_S` (a hang, e.g. on a FIFO)."""


@dataclass
class Case:
    """One hostile input. ``call(tmp)`` runs it with ``tmp`` the case's own directory (made by
    ``setup(tmp)``). ``expect``: ``"error"`` (only a typed error is right), ``"clean"`` (it
    must succeed and ``check(tmp, result)`` return None) or ``"either"``. ``names``: what the
    error message must contain. ``writes``: files a clean success may change. ``groups``:
    communication groups to watch besides the baseline ones."""

    category: str
    label: str
    call: Callable[[Path], Any]
    names: tuple[str, ...] = ()
    expect: str = "error"
    check: Callable[[Path, Any], str | None] | None = None
    setup: Callable[[Path], None] | None = None
    writes: tuple[str, ...] = ()
    typed: tuple[type[BaseException], ...] = (AutoparError,)
    groups: tuple[str, ...] = ()


#: Outcome kinds that are failures in themselves.
BAD_KINDS = ("untyped", "accepted", "refused", "wrong", "harness")


@dataclass
class Outcome:
    """What a case did. ``kind``: typed (a typed error), clean (a checked success), untyped
    (another exception, a traceback), accepted (no error where one was due), refused (an
    error where success was due), wrong (a success whose check failed), harness (the case
    could not be set up)."""

    case: Case
    kind: str
    message: str
    state: list[str]
    files: list[str]
    named: bool | None
    seconds: float

    @property
    def problems(self) -> list[str]:
        out = [f"{self.kind}: {self.message[:400]}"] if self.kind in BAD_KINDS else []
        out += [f"state changed: {s}" for s in self.state]
        out += [f"file {f}" for f in self.files]
        if self.named is False:
            out.append(f"message does not name {list(self.case.names)} (or is not UTF-8): "
                       f"{self.message[:300]}")
        return [printable(p) for p in out]

    @property
    def failed(self) -> bool:
        return bool(self.problems)


def printable(text: str) -> str:
    """``text`` with lone surrogates escaped, so it can be printed and saved as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def run_case(case: Case, tmp: Path) -> Outcome:
    """Run one case in the fresh directory ``tmp`` (removed afterwards) and judge it."""
    tmp.mkdir(parents=True)
    try:
        set_baseline()
        if case.setup is not None:
            case.setup(tmp)
    except Exception as e:  # noqa: BLE001 - the harness's own failure, reported as such
        _remove(tmp)
        return Outcome(case, "harness", f"setup failed: {type(e).__name__}: {e}", [], [],
                       None, 0.0)
    state0, files0 = process_state(case.groups), files_state(tmp)
    t0 = time.perf_counter()
    result, error = _call(case, tmp)
    seconds = time.perf_counter() - t0
    kind, message = judge(case, tmp, result, error)
    state = _diff(state0, process_state(case.groups))
    files = file_changes(files0, files_state(tmp), case.writes if kind == "clean" else ())
    named = names_ok(case, message) if kind == "typed" else None
    _remove(tmp)
    return Outcome(case, kind, printable(message), state, files, named, seconds)


def _on_alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout(f"no answer within {CASE_TIMEOUT_S:.0f} s")


def _call(case: Case, tmp: Path) -> tuple[Any, BaseException | None]:
    """``case.call(tmp)``: (result, None) or (None, the exception); a hang is cut off by an
    alarm (main thread; subprocesses have their own timeouts)."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        old = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S)
    try:
        return case.call(tmp), None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit included: judged, never fatal
        return None, e
    finally:
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def judge(case: Case, tmp: Path, result: Any, error: BaseException | None) -> tuple[str, str]:
    """(kind, message) of one call (see :class:`Outcome`)."""
    if error is None:
        if case.expect == "error":
            return "accepted", f"no error; returned {_short(result)}"
        problem = case.check(tmp, result) if case.check is not None else None
        return ("wrong", problem) if problem else ("clean", _short(result))
    message = f"{type(error).__name__}: {error}"
    if not isinstance(error, case.typed):
        frame = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
        where = "".join(f" (raised at {Path(f.filename).name}:{f.lineno} in {f.name})"
                        for f in frame)
        return "untyped", message + where
    return ("refused", message) if case.expect == "clean" else ("typed", message)


def names_ok(case: Case, message: str) -> bool:
    """The message names every one of ``case.names`` (``"a|b"``: either) and encodes as
    UTF-8."""
    try:
        message.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return all(any(a in message for a in n.split("|")) for n in case.names)


def _short(value: Any) -> str:
    return printable(safe_repr(value, 120))[:120]


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)``, printable, with the middle of a long one elided (a value Python
    cannot repr -- an int past 4,300 digits, a deep nest -- as autopar's errors show it)."""
    text = printable(safe_repr(value, 10_000))
    return text if len(text) <= limit else f"{text[:limit - 20]}...({len(text)} chars)"


# ---------------------------------------------------------------------------- state


#: Every key of set_auto_parallel_context (``auto_parallel_search_mode`` is a view of
#: ``search_mode``, read through it: reading the alias itself warns).
CONTEXT_KEYS = tuple(k for k in ap.config.KEYS if k != "auto_parallel_search_mode")
ALL_KEYS = (*CONTEXT_KEYS, "auto_parallel_search_mode")
BASE_CONTEXT: dict[str, Any] = {
    "device_num": 8, "global_rank": 1, "parallel_mode": "semi_auto_parallel",
    "search_mode": "recursive_programming", "gradients_mean": True,
    "dataset_strategy": ((1, 8),), "enable_alltoall": True, "grad_accumulation_step": 2,
    "comm_fusion": {"allreduce": {"mode": "index", "config": [3, 7]}},
    "parallel_optimizer_config": {"parallel_optimizer_threshold": 16}}
BASE_GROUPS = {"tp0": [0, 1, 2, 3], "evens": [0, 2, 4, 6]}


def set_baseline() -> None:
    """A non-default context and HCCL state (so that a partial change shows): every case
    starts from it."""
    ap.reset_auto_parallel_context()
    ap.hccl.reset_comm_groups()
    ap.set_auto_parallel_context(**BASE_CONTEXT)
    for name, ranks in BASE_GROUPS.items():
        ap.hccl.create_group(name, ranks)
    ap.hccl.set_split_strategy_by_size([60, 40])
    ap.hccl.set_split_strategy_by_idx([1, 5], "tp0")


def _try(fn: Callable[..., Any], *args: Any) -> str:
    try:
        return repr(fn(*args))
    except Exception as e:  # noqa: BLE001 - the state is "this raises"
        return f"raises {type(e).__name__}"


def process_state(groups: Iterable[str] = ()) -> dict[str, str]:
    """The context, the HCCL state, the AUTOPAR_* environment and /dev/null, as text."""
    out = {f"context {k}": _try(ap.get_auto_parallel_context, k) for k in CONTEXT_KEYS}
    out["explicit keys"] = repr(sorted(explicit_keys()))
    for g in dict.fromkeys((ap.hccl.WORLD_GROUP, *BASE_GROUPS, *groups)):
        for fn in (ap.hccl.get_rank_size, ap.hccl.get_rank_id, ap.hccl.get_split_strategy):
            out[f"{fn.__name__}({g!r})"] = _try(fn, g)
    out.update({f"env {k}": v for k, v in os.environ.items() if k.startswith("AUTOPAR")})
    st = os.stat("/dev/null")
    out["/dev/null"] = repr((stat.S_IFMT(st.st_mode), st.st_rdev, st.st_ino))
    return out


def _diff(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return [f"{k}: {before.get(k, '<unset>')} -> {after.get(k, '<unset>')}"
            for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]


def _file_id(path: str) -> tuple[str, ...]:
    st = os.lstat(path)
    mode = oct(stat.S_IMODE(st.st_mode))
    if stat.S_ISLNK(st.st_mode):
        return ("symlink", os.readlink(path))
    if not stat.S_ISREG(st.st_mode):
        kinds = {stat.S_IFDIR: "directory", stat.S_IFIFO: "fifo", stat.S_IFCHR: "device",
                 stat.S_IFSOCK: "socket"}
        return (kinds.get(stat.S_IFMT(st.st_mode), "other"), mode)
    try:
        with open(path, "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()[:16]
    except OSError:
        digest = "unreadable"
    return ("file", mode, f"{st.st_size} bytes", digest)


def files_state(root: Path) -> dict[str, tuple[str, ...]]:
    """Every entry under ``root`` (symlinks not followed): kind, mode, size and digest."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = _file_id(path)
    return out


def file_changes(before: dict[str, tuple[str, ...]], after: dict[str, tuple[str, ...]],
                 allowed: Sequence[str] = ()) -> list[str]:
    """What changed under a case's directory, except ``allowed`` (a clean success's writes)."""
    out = []
    for rel in sorted(set(before) | set(after)):
        if rel in allowed or before.get(rel) == after.get(rel):
            continue
        what = ("left behind" if rel not in before else "removed" if rel not in after
                else f"changed {before[rel]} -> {after[rel]}")
        out.append(f"{rel!r} {what}")
    return out


def _remove(path: Path) -> None:
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, 0o700)
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- fixtures


def plain_context(**keys: Any) -> Any:
    """``auto_parallel_context`` over the baseline with every key a plan depends on given."""
    base = {"device_num": 8, "global_rank": 0, "parallel_mode": "auto_parallel",
            "search_mode": "dynamic_programming", "dataset_strategy": "data_parallel",
            "enable_alltoall": False, "grad_accumulation_step": 1, "pipeline_stages": 1,
            "enable_parallel_optimizer": False, "comm_fusion": {"allreduce": None},
            "strategy_ckpt_load_file": "", "strategy_ckpt_save_file": ""}
    return ap.auto_parallel_context(**{**base, **keys})


@cache
def fixture() -> SimpleNamespace:
    """A small MLP, its graph, plan, strategy file, training step and calibration file."""
    m = mlp(widths=(16, 32, 16), batch=8)
    params, x = m.example_args(jax.random.key(0))
    graph = ap.trace(m.loss, params, x)
    with plain_context():
        plan = ap.search(graph, cluster=CLUSTER)
    doc = strategy_document(plan, graph)
    other_mode = "recursive_programming" if doc["mode"] != "recursive_programming" else \
        "dynamic_programming"
    with plain_context(parallel_mode="data_parallel", gradients_mean=False):
        step = ap.train_step(m.loss, params, (x,), cluster=CLUSTER)
    cluster = ap.clusters.resolve_cluster(CLUSTER)
    return SimpleNamespace(
        model=m, params=params, x=x, graph=graph, plan=plan, doc=doc,
        valid=dumps_strategy(doc).encode(),
        other=dumps_strategy({**doc, "mode": other_mode}).encode(),
        step=step, opt_state=step.init(params), cluster=cluster,
        cluster_doc=json.loads(dumps_cluster(cluster)),
        cluster_bytes=dumps_cluster(cluster).encode())


def load_plan(path: Any) -> Any:
    with plain_context():
        return ap.load_strategy(path, fixture().graph)


def same_plan(tmp: Path | None, plan: Any) -> str | None:
    """None when ``plan`` is the saved plan (strategies, layouts, cost, objective): a
    strategy file that still loads must mean what was saved."""
    ref = fixture().plan
    if (plan.nodes, plan.layouts, plan.cost, plan.objective) != \
            (ref.nodes, ref.layouts, ref.cost, ref.objective):
        return "loaded a plan other than the saved one (its meaning changed)"
    return None


def _put(name: str, data: bytes, mode: int | None = None) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
        if mode is not None:
            os.chmod(tmp / name, mode)
    return setup


def _both(*setups: Callable[[Path], None] | None) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        for s in setups:
            if s is not None:
                s(tmp)
    return setup


@cache
def can_mknod() -> bool:
    """Whether a character device node can be made here (root in most containers)."""
    with tempfile.TemporaryDirectory() as d:
        try:
            os.mknod(os.path.join(d, "null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
            return True
        except OSError:
            return False


def _special(kind: str, name: str) -> Callable[[Path], None]:
    """Make a FIFO, a character device (/dev/null's numbers; a FIFO where mknod is not
    allowed), a directory, a socket, a symlink loop or a dangling symlink at ``tmp/name``."""
    def setup(tmp: Path) -> None:
        p = tmp / name
        if kind == "fifo" or (kind == "device" and not can_mknod()):
            os.mkfifo(p)
        elif kind == "device":
            os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        elif kind == "directory":
            p.mkdir()
        elif kind == "socket":
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(str(p))
        elif kind == "loop":
            os.symlink(name, p)
        elif kind == "dangling":
            os.symlink("nodir/x.json", p)
    return setup


# ---------------------------------------------------------------------------- context


INT_RANGES = {"device_num": (1, 4096), "global_rank": (0, 4095), "pipeline_stages": (1, 4096),
              "grad_accumulation_step": (1, 2**31 - 1), "pipeline_segments": (1, 4096)}
BOOL_KEYS = ("gradients_mean", "gradient_fp32_sync", "loss_repeated_mean", "parameter_broadcast",
             "full_batch", "enable_parallel_optimizer", "enable_alltoall", "auto_pipeline",
             "force_fp32_communication", "pipeline_result_broadcast", "dump_local_norm",
             "dump_device_local_norm", "optimizer_weight_shard_aggregated_save",
             "sharding_propagation")
CHOICES = {"parallel_mode": "auto_parallel", "search_mode": "dynamic_programming",
           "auto_parallel_search_mode": "dynamic_programming",
           "communi_parallel_mode": "all_group_parallel"}
RECOMPUTE_BAD = ["", "SELECTIVE", " full", "full\0", "\udcff", None, 1, True, ["full"],
                 ("full",), b"full", "all", "selective_full"]
PATH_KEYS = ("strategy_ckpt_load_file", "strategy_ckpt_save_file", "group_ckpt_save_file",
             "dump_local_norm_path")
STRATEGY_CKPT_BAD = [None, [], "x.json", {"load_file": 1}, {"save_file": None},
                     {"only_trainable_params": 1}, {"load": "x"}, {1: 2}]
PIPELINE_BAD = [None, [], "gpipe", {"pipeline_scheduler": "seqpipe"},
                {"pipeline_scheduler": "GPIPE"}, {"pipeline_scheduler": 1},
                {"pipeline_interleave": "yes"}, {"scheduler": "gpipe"}, {1: 2}]
DATASET_BAD = ["", "model_parallel", "FULL_BATCH", ((0, 8),), ((1, 8.0),), ((1, True),),
               [[1, 8]], ((1, 8), [1, 8]), (), ((4097,),), ((1, -1),), None, 8, (1, 8),
               {"x": (1, 8)}, (("1", "8"),)]
OPTIMIZER_BAD = [None, [], "x", {"gradient_accumulation_shard": 1},
                 {"gradient_accumulation_shard": "yes"}, {"parallel_optimizer_threshold": -1},
                 {"parallel_optimizer_threshold": 1.5}, {"parallel_optimizer_threshold": True},
                 {"parallel_optimizer_threshold": "64"}, {"bogus": 1},
                 {"Parallel_optimizer_threshold": 4}, {1: 2},
                 {"optimizer_weight_shard_size": 0}, {"optimizer_weight_shard_size": -2},
                 {"optimizer_weight_shard_size": 4097}, {"optimizer_weight_shard_size": "2"},
                 {"optimizer_level": "level4"}, {"optimizer_level": 2},
                 {"optimizer_level": "level1", "gradient_accumulation_shard": True}]
#: (sizes <= 1 are warned about and not applied, as MindSpore does: not errors)
SHARD_SIZE_BAD = [4097, 2**64, "2", 2.0, True, None, [2], np.float64(2)]


def _fusion(kind: str, mode: Any, *config: Any) -> dict[str, Any]:
    return {kind: {"mode": mode, **({"config": config[0]} if config else {})}}


FUSION_BAD = [None, [], "auto", {"allreduce": "auto"}, {"allreduce": {}},
              _fusion("allreduce", "auto", 32), _fusion("allreduce", "size"),
              *(_fusion("allreduce", "size", c) for c in (0, -1, float("nan"), float("inf"),
                                                          1e-9, True, "32", [32], 10**400)),
              *(_fusion("allreduce", "index", c) for c in ([], [3, 1], [1, 1], [-1], [1.0],
                                                           [2**31], "1,2", None)),
              _fusion("allgather", "index", [1]), _fusion("reducescatter", "bogus"),
              _fusion("allreduce", "AUTO"), {"broadcast": {"mode": "auto"}},
              {"allreduce": {"mode": "size", "config": 32, "extra": 1}}]
FUSION_INDEX_BAD = [None, [], [3, 1], [1, 1], [-1], [1.0], [True], "1,2", 5, [2**31], [[1]],
                    {1: 2}]


def bad_values() -> dict[str, list[Any]]:
    """Wrong types and out-of-range values for every key of set_auto_parallel_context."""
    out: dict[str, list[Any]] = {}
    for key, (lo, hi) in INT_RANGES.items():
        out[key] = [lo - 1, hi + 1, -2**63, 2**64, True, False, float(lo), float("nan"),
                    float("inf"), str(lo), None, [lo], (lo,), complex(lo), np.int64(lo)]
    for key in BOOL_KEYS:
        out[key] = [1, 0, "True", "false", "", None, 1.0, [True], np.bool_(True)]
    for key, good in CHOICES.items():
        out[key] = ["", good.upper(), good.replace("_", "-"), f" {good}", f"{good}\0",
                    "\udcff", None, 1, [good], (good,), good.encode()]
    for key in PATH_KEYS:
        out[key] = [None, 1, b"f.json", Path("f\0.json"), ["f.json"], True]
    out.update(dataset_strategy=DATASET_BAD, parallel_optimizer_config=OPTIMIZER_BAD,
               recompute=RECOMPUTE_BAD,
               comm_fusion=FUSION_BAD, all_reduce_fusion_config=FUSION_INDEX_BAD,
               strategy_ckpt_config=STRATEGY_CKPT_BAD, pipeline_config=PIPELINE_BAD,
               optimizer_weight_shard_size=SHARD_SIZE_BAD)
    missing = set(ALL_KEYS) - set(out)
    if missing:  # a new key: give it bad values here
        raise SystemExit(f"bench_reliability: no hostile values for keys {sorted(missing)}")
    return out


def misspellings(key: str) -> list[str]:
    """Near misses of a key: a letter dropped or added, swapped, case, dashes."""
    half = len(key) // 2
    candidates = [key[:-1], key + "s", key.upper(), key[1] + key[0] + key[2:],
                  key.replace("_", "-") if "_" in key else key + "_", key[:half] + key[half + 1:]]
    return [c for c in dict.fromkeys(candidates) if c not in ALL_KEYS]


def _set_case(label: str, kwargs: dict[str, Any], names: tuple[str, ...],
              via: str = "set") -> Case:
    def call(tmp: Path) -> Any:
        if via == "set":
            return ap.set_auto_parallel_context(**kwargs)
        with ap.auto_parallel_context(**kwargs):
            return "entered"
    return Case("context", f"{via}: {label}", call, names=names)


def context_cases() -> list[Case]:
    """Every key x wrong types and ranges (set, and the first also through a with-block and
    beside a valid key: nothing may be applied), misspelt and unknown keys, conflicts."""
    cases = []
    for key, values in bad_values().items():
        for k, v in enumerate(values):
            shown = short_repr(v, 80)
            cases.append(_set_case(f"{key}={shown}", {key: v}, (key,)))
            if k == 0:
                cases.append(_set_case(f"{key}={shown}", {key: v}, (key,), via="with"))
                cases.append(_set_case(f"device_num=2, {key}={shown}", {"device_num": 2, key: v},
                                       (key,)))
    for key in ALL_KEYS:
        for wrong in misspellings(key):
            cases.append(_set_case(f"misspelt {wrong!r}", {wrong: 1}, (wrong,)))
        cases.append(Case("context", f"get_auto_parallel_context({key[:-1]!r})",
                          partial(lambda k, tmp: ap.get_auto_parallel_context(k), key[:-1]),
                          names=(key[:-1],)))
    for wrong, shown in (("", "''"), ("bogus", "bogus"), ("model_config", "model_config"),
                         ("model_fields", "model_fields"), ("__class__", "__class__"),
                         ("device num", "device num"), ("d" * 1000, "d" * 1000),
                         ("dévice_num", "dévice_num"), ("\udcffkey", "udcffkey")):
        cases.append(_set_case(f"unknown key {wrong[:20]!r}", {wrong: 1}, (shown,)))
    for arg in (None, 1, b"device_num"):
        cases.append(Case("context", f"get_auto_parallel_context({arg!r})",
                          partial(lambda a, tmp: ap.get_auto_parallel_context(a), arg),
                          names=(repr(arg),)))
    return cases + conflict_cases()


def conflict_cases() -> list[Case]:
    """Pairs that contradict each other in one call, and combinations resolve_context
    refuses (inside a with-block, which must restore the context on the error)."""
    pairs = [
        {"full_batch": True, "dataset_strategy": "data_parallel"},
        {"full_batch": False, "dataset_strategy": "full_batch"},
        {"full_batch": True, "dataset_strategy": ((1, 8),)},
        {"auto_parallel_search_mode": "recursive_programming",
         "search_mode": "dynamic_programming"},
        {"all_reduce_fusion_config": [1, 2], "comm_fusion": _fusion("allreduce", "size", 32)},
        {"all_reduce_fusion_config": [1, 2],
         "comm_fusion": _fusion("allreduce", "index", [1, 3])},
        {"all_reduce_fusion_config": [1, 2], "comm_fusion": {"allreduce": "index"}}]
    cases = [_set_case(", ".join(f"{k}={v!r}" for k, v in kw.items()), kw, tuple(kw))
             for kw in pairs]
    resolve = [({"device_num": 4, "global_rank": 5}, "global_rank"),
               ({"parallel_mode": "data_parallel", "pipeline_stages": 2}, "pipeline_stages"),
               ({"pipeline_stages": 3}, "pipeline_stages"),
               ({"parallel_mode": "data_parallel", "grad_accumulation_step": 4},
                "grad_accumulation_step"),
               ({"parallel_mode": "data_parallel", "dataset_strategy": ((1, 8),),
                 "grad_accumulation_step": 1}, "dataset_strategy"),
               ({"dataset_strategy": ((3, 1),)}, "dataset_strategy")]
    for kw, key in resolve:
        def call(tmp: Path, kw: dict[str, Any] = kw) -> Any:
            with ap.auto_parallel_context(**kw):
                return ap.resolve_context()
        cases.append(Case("context", "resolve_context() under " + ", ".join(
            f"{k}={v!r}" for k, v in kw.items()), call, names=(key,),
            typed=(ap.ContextConflictError,)))
    return cases


# ---------------------------------------------------------------------------- hccl


BAD_SIZES = [None, "60,40", 100, [], {"a": 100}, np.array([50.0, 50.0]), [50, 50.0001],
             [50, 49], [101, -1], [float("nan"), 100], [float("inf")], [True, 99], ["50", "50"],
             [None, 100], [10] * 10, [100 / 9] * 9, [1e308, 1e308], [2**1100], [10**400, 0]]
BAD_IDX = [None, "1,2", 5, [], np.array([1, 2]), [3, 1], [1, 1], [-1, 2], [1.0, 2], [True, 2],
           ["1"], list(range(9)), [None]]
BAD_GROUP_NAMES = [None, 1, b"tp0", ["tp0"], "", "a\0b", "\udcff", "x" * 128, "é" * 64]
BAD_RANKS = [None, "0,1", 3, [], [0, 0], [-1], [8], [0, 1.0], [True], [0, 2**63],
             np.array([0, 1]), [[0]]]


def _hccl(label: str, fn: Callable[[], Any], names: tuple[str, ...],
          groups: Sequence[Any] = ()) -> Case:
    watch = tuple(g for g in groups if isinstance(g, str))
    return Case("hccl", label, lambda tmp: fn(), names=names, groups=watch)


def hccl_cases() -> list[Case]:
    """The HCCL split API and communication groups: bad lists, order, segments, names."""
    cases = [_hccl(f"set_split_strategy_by_size({short_repr(v)})",
                   partial(ap.hccl.set_split_strategy_by_size, v), ("dataSizeList",))
             for v in BAD_SIZES]
    cases += [_hccl(f"set_split_strategy_by_idx({short_repr(v)})",
                    partial(ap.hccl.set_split_strategy_by_idx, v), ("idxList",)) for v in BAD_IDX]
    for g in [*BAD_GROUP_NAMES, "nosuch"]:
        shown = short_repr(g, 30)
        cases += [_hccl(f"set_split_strategy_by_size([50, 50], {shown})",
                        partial(ap.hccl.set_split_strategy_by_size, [50, 50], g), ("group",), [g]),
                  _hccl(f"set_split_strategy_by_idx([1, 2], {shown})",
                        partial(ap.hccl.set_split_strategy_by_idx, [1, 2], g), ("group",), [g]),
                  _hccl(f"destroy_group({shown})", partial(ap.hccl.destroy_group, g),
                        ("group",), [g]),
                  _hccl(f"get_rank_size({shown})", partial(ap.hccl.get_rank_size, g), ("group",),
                        [g])]
        if g != "nosuch":
            cases.append(_hccl(f"create_group({shown}, [0, 1])",
                               partial(ap.hccl.create_group, g, [0, 1]), ("group",), [g]))
    cases += [_hccl(f"create_group('newgrp', {r!r})", partial(ap.hccl.create_group, "newgrp", r),
                    ("rank_ids",), ["newgrp"]) for r in BAD_RANKS]
    return cases + hccl_rule_cases()


def hccl_rule_cases() -> list[Case]:
    """Rules between groups and the context: reserved names, membership, stale groups."""
    def shrunk(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with ap.auto_parallel_context(device_num=2, global_rank=1):
                return fn()
        return call

    return [
        _hccl("create_group('tp0', ...) again", partial(ap.hccl.create_group, "tp0", [0, 1]),
              ("tp0",)),
        _hccl("create_group(hccl_world_group)",
              partial(ap.hccl.create_group, ap.hccl.WORLD_GROUP, [0]), (ap.hccl.WORLD_GROUP,)),
        _hccl("destroy_group(hccl_world_group)",
              partial(ap.hccl.destroy_group, ap.hccl.WORLD_GROUP), (ap.hccl.WORLD_GROUP,)),
        _hccl("get_rank_id('evens') from rank 1", partial(ap.hccl.get_rank_id, "evens"),
              ("evens",)),
        _hccl("set_split_strategy_by_size on a group the caller is not in",
              partial(ap.hccl.set_split_strategy_by_size, [50, 50], "evens"), ("evens",)),
        _hccl("set_split_strategy_by_idx on a group the caller is not in",
              partial(ap.hccl.set_split_strategy_by_idx, [1, 2], "evens"), ("evens",)),
        *(_hccl(f"get_group_rank_from_world_rank({r!r}, 'tp0')",
                partial(ap.hccl.get_group_rank_from_world_rank, r, "tp0"), ("world_rank_id",))
          for r in (9, -1, 1.0, True, "1", None)),
        *(_hccl(f"get_world_rank_from_group_rank('tp0', {r!r})",
                partial(ap.hccl.get_world_rank_from_group_rank, "tp0", r), ("group_rank_id",))
          for r in (4, -1, 1.0, True, "0", None)),
        _hccl("get_rank_size('tp0') after device_num=2",
              shrunk(partial(ap.hccl.get_rank_size, "tp0")), ("tp0",)),
        _hccl("set_split_strategy_by_idx on 'tp0' after device_num=2",
              shrunk(partial(ap.hccl.set_split_strategy_by_idx, [1, 2], "tp0")), ("tp0",)),
    ]


# ---------------------------------------------------------------------------- strategy files


#: Values a field is replaced with (types and ranges a file must not carry).
FIELD_VALUES = [None, True, False, -1, 0, 2**64, 1.5, -0.0, 1e308, "x", "", [], {}, [[]], [-1],
                {"a": 1}]


def truncations(data: bytes, count: int) -> list[tuple[str, bytes]]:
    n = len(data)
    cuts = sorted({0, 1, n // 2, n - 2, n - 1, *(round(i * n / count) for i in range(count))})
    return [(f"truncated to {c} of {n} bytes", data[:c]) for c in cuts if c < n]


def flips(data: bytes, count: int, rng: random.Random) -> list[tuple[str, bytes]]:
    out = []
    while len(out) < count:
        pos = rng.randrange(len(data))
        new = rng.choice([rng.randrange(256), data[pos] ^ 0x20, data[pos] ^ 0x01, 0, 0xFF,
                          ord('"'), ord("}"), ord("9"), ord(" ")])
        if new != data[pos]:
            out.append((f"byte {pos} {data[pos]:#04x} -> {new:#04x}",
                        data[:pos] + bytes([new]) + data[pos + 1:]))
    return out


def json_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    items = node.items() if isinstance(node, dict) else \
        enumerate(node) if isinstance(node, list) else ()
    out = []
    for k, v in items:
        out.append(prefix + (k,))
        out += json_paths(v, prefix + (k,))
    return out


def _edited(doc: dict[str, Any], path: tuple[Any, ...], value: Any = ...) -> bytes:
    """``doc`` with the field at ``path`` set to ``value`` (deleted for ``...``), as JSON."""
    copy = json.loads(json.dumps(doc))
    node = copy
    for k in path[:-1]:
        node = node[k]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return (json.dumps(copy, sort_keys=True, indent=1) + "\n").encode()


def field_edits(doc: dict[str, Any], count: int, rng: random.Random) -> list[tuple[str, bytes]]:
    """Every top-level field and a seeded sample of nested ones: two wrong values each and a
    deletion; an unknown field at the top and in a nested object."""
    paths = json_paths(doc)
    top = [p for p in paths if len(p) == 1]
    deep = [p for p in paths if len(p) > 1]
    chosen = top[:count // 2] + rng.sample(deep, min(len(deep), max(0, count - len(top))))
    out = []
    for i, path in enumerate(chosen):
        where = "/".join(str(k) for k in path)
        for value in (FIELD_VALUES[i % len(FIELD_VALUES)],
                      FIELD_VALUES[(5 * i + 3) % len(FIELD_VALUES)]):
            out.append((f"{where} = {value!r}", _edited(doc, path, value)))
        out.append((f"{where} deleted", _edited(doc, path)))
    out.append(("an unknown top-level field", _edited(doc, ("bogus",), 1)))
    nested = [p for p in paths if isinstance(_at(doc, p), dict)]
    if nested:
        out.append((f"an unknown field in {'/'.join(map(str, nested[-1]))}",
                    _edited(doc, nested[-1] + ("bogus",), 1)))
    return out


def number_edits(doc: dict[str, Any], count: int, rng: random.Random) -> list[tuple[str, bytes]]:
    """Numbers JSON can write but a double cannot hold: 1e400 (parsed as infinity), -1e400,
    10**400, and once a 5000-digit number (past Python's int-from-text limit)."""
    nums = [p for p in json_paths(doc) if type(_at(doc, p)) in (int, float)]
    out = []
    for k, path in enumerate(rng.sample(nums, min(len(nums), count))):
        where = "/".join(str(x) for x in path)
        for text in (b"1e400", b"-1e400", b"1" + b"0" * 400) + ((b"9" * 5000,) if k == 0 else ()):
            shown = text.decode() if len(text) < 10 else f"a {len(text)}-digit number"
            out.append((f"{where} = {shown}",
                        _edited(doc, path, "NUMBER").replace(b'"NUMBER"', text)))
    return out


def _at(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def nestings(doc: dict[str, Any], quick: bool) -> list[tuple[str, bytes]]:
    """A value replaced by a deep nest of lists or objects (a parser must not overflow)."""
    depths = [(1000, b"[", b"]")] if quick else \
        [(1000, b"[", b"]"), (100_000, b"[", b"]"), (100_000, b'{"a":', b"}")]
    out = []
    for depth, open_, close in depths:
        mid = b"1" if open_ == b'{"a":' else b""
        data = _edited(doc, ("predicted", "compute"), "NEST").replace(
            b'"NEST"', open_ * depth + mid + close * depth)
        out.append((f"predicted/compute nested {depth} deep ({open_.decode()[:1]})", data))
    return out


def _file_load(category: str, label: str, data: bytes | None, load: Callable[[Any], Any],
               check: Callable[[Path, Any], str | None], typed: type[BaseException],
               name: str = "s.json", setup: Callable[[Path], None] | None = None,
               names: tuple[str, ...] | None = None, path: Any = None) -> Case:
    """Load ``tmp/name`` (holding ``data``) or ``path``: a typed error naming it, or a load
    whose result passes ``check``."""
    target = (lambda tmp: path) if path is not None else (lambda tmp: str(tmp / name))
    return Case(category, label, lambda tmp: load(target(tmp)),
                names=names if names is not None else (name,), expect="either",
                check=check, typed=(typed,),
                setup=_both(_put(name, data) if data is not None else None, setup))


def special_paths(name_ok: str) -> list[tuple[str, Callable[[Path], None] | None, Any,
                                              tuple[str, ...], str]]:
    """(label, setup, path (a name in tmp, or absolute, or a wrong type), names, expect)
    of the paths every reader must refuse; ``name_ok`` holds a valid file."""
    return [
        ("a FIFO", _special("fifo", "t-fifo.json"), "t-fifo.json", ("t-fifo.json",), "error"),
        ("a character device", _special("device", "t-dev.json"), "t-dev.json", ("t-dev.json",),
         "error"),
        ("a socket", _special("socket", "t-sock.json"), "t-sock.json", ("t-sock.json",), "error"),
        ("a directory", _special("directory", "t-dir.json"), "t-dir.json", ("t-dir.json",),
         "error"),
        ("a directory with a trailing slash", _special("directory", "t-dir.json"), "t-dir.json/",
         ("t-dir.json",), "error"),
        ("the valid file with a trailing slash", None, name_ok + "/", (name_ok,), "error"),
        ("/dev/zero", None, Path("/dev/zero"), ("/dev/zero",), "error"),
        ("/dev/null", None, Path("/dev/null"), ("/dev/null",), "error"),
        ("a missing file", None, "t-missing.json", ("t-missing.json",), "error"),
        ("an empty file", _put("t-empty.json", b""), "t-empty.json", ("t-empty.json",), "error"),
        ("a symlink loop", _special("loop", "t-loop.json"), "t-loop.json", ("t-loop.json",),
         "error"),
        ("a dangling symlink", _special("dangling", "t-dangling.json"), "t-dangling.json",
         ("t-dangling.json",), "error"),
        ("a NUL byte in the path", None, "t\0nul.json", ("nul.json",), "error"),
        ("a 300-character name", None, "x" * 300, ("x" * 40,), "error"),
        ("a non-UTF-8 name", None, "\udcff.json", ("udcff",), "error"),
        ("a symlink to the valid file", lambda tmp: os.symlink(name_ok, tmp / "t-link.json"),
         "t-link.json", ("t-link.json",), "either"),
        ("the valid file, mode 000", lambda tmp: os.chmod(tmp / name_ok, 0), name_ok,
         (name_ok,), "either"),
    ]


def _reader_paths(category: str, data: bytes, load: Callable[[Any], Any],
                  check: Callable[[Path, Any], str | None], typed: type[BaseException],
                  key: str) -> list[Case]:
    """Special files and bad paths for a reader (``key``: what a wrong type must name)."""
    cases = []
    for label, setup, path, names, expect in special_paths("s.json"):
        def call(tmp: Path, path: Any = path) -> Any:
            return load(path if isinstance(path, Path) else os.path.join(tmp, path))
        cases.append(Case(category, label, call, names=names, expect=expect,
                          check=check, typed=(AutoparError,),
                          setup=_both(_put("s.json", data), setup)))
    for bad in (None, 123, b"s.json", "", ["s.json"]):
        cases.append(Case(category, f"path {bad!r}", partial(lambda b, tmp: load(b), bad),
                          names=(key,), setup=_put("s.json", data)))
    return cases


def strategy_cases(quick: bool) -> list[Case]:
    """A saved strategy file mutated (truncated, bytes flipped, fields changed, nested deep),
    over the size cap, special files, loaded directly and through the context."""
    fx, rng = fixture(), random.Random(SEED)
    mutations = [*truncations(fx.valid, 6 if quick else 60),
                 *flips(fx.valid, 8 if quick else 80, rng),
                 *field_edits(fx.doc, 6 if quick else 60, rng),
                 *number_edits(fx.doc, 2 if quick else 12, rng), *nestings(fx.doc, quick)]
    cases = [_file_load("strategy files", label, data, load_plan, same_plan,
                        ap.StrategyFileError) for label, data in mutations]
    cases += _reader_paths("strategy files", fx.valid, load_plan, same_plan,
                           ap.StrategyFileError, "strategy_ckpt_load_file")
    return cases + cap_cases() + strategy_context_cases(mutations[:: max(1, len(mutations) // 8)])


def _with_cap(value: str, fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
    def call(tmp: Path) -> Any:
        old = os.environ.get("AUTOPAR_MAX_FILE_BYTES")
        os.environ["AUTOPAR_MAX_FILE_BYTES"] = value
        try:
            return fn(tmp)
        finally:
            if old is None:
                del os.environ["AUTOPAR_MAX_FILE_BYTES"]
            else:
                os.environ["AUTOPAR_MAX_FILE_BYTES"] = old
    return call


def cap_cases() -> list[Case]:
    """The size cap (AUTOPAR_MAX_FILE_BYTES): files over it, at it, bad cap values."""
    fx = fixture()
    n = len(fx.valid)
    padded = fx.valid + b" " * (2 * 2**20)

    def load(tmp: Path) -> Any:
        return load_plan(str(tmp / "s.json"))

    cases = []
    for label, data, cap, expect, names in (
            ("a file one byte over the cap", fx.valid, str(n - 1), "error", ("s.json",)),
            ("a file at the cap", fx.valid, str(n), "clean", ()),
            ("a file 5x the cap", fx.valid, "1000", "error", ("s.json",)),
            ("2 MiB of trailing blanks, cap 1 MiB", padded, str(2**20), "error", ("s.json",)),
            ("cap 'abc'", fx.valid, "abc", "error", ("AUTOPAR_MAX_FILE_BYTES",)),
            ("cap '0'", fx.valid, "0", "error", ("AUTOPAR_MAX_FILE_BYTES",)),
            ("cap '-5'", fx.valid, "-5", "error", ("AUTOPAR_MAX_FILE_BYTES",))):
        cases.append(Case("strategy files", f"{label} (AUTOPAR_MAX_FILE_BYTES={cap})",
                          _with_cap(cap, load), names=names, expect=expect,
                          check=same_plan, setup=_put("s.json", data)))
    return cases


def strategy_context_cases(sample: list[tuple[str, bytes]]) -> list[Case]:
    """Loads through ``strategy_ckpt_load_file`` (search), and a valid file under another
    context or graph."""
    fx = fixture()

    def via_search(tmp: Path, path: str = "s.json") -> Any:
        with plain_context(strategy_ckpt_load_file=str(tmp / path)):
            return ap.search(fx.graph, cluster=CLUSTER)

    cases = [Case("strategy files", f"search(strategy_ckpt_load_file): {label}", via_search,
                  names=("s.json",), expect="either", check=same_plan,
                  typed=(ap.StrategyFileError,), setup=_put("s.json", data))
             for label, data in sample]
    for label, path, setup in (("a FIFO", "t-fifo.json", _special("fifo", "t-fifo.json")),
                               ("a directory", "t-dir.json", _special("directory", "t-dir.json")),
                               ("a NUL byte in the path", "t\0nul.json", None)):
        cases.append(Case("strategy files", f"search(strategy_ckpt_load_file): {label}",
                          partial(via_search, path=path), names=(path.split("\0")[-1],),
                          setup=setup))
    other = mlp(widths=(16, 32, 32), batch=8)
    other_graph = ap.trace(other.loss, *jax.eval_shape(other.example_args, jax.random.key(0)))
    for label, keys, graph in (("device_num=4", {"device_num": 4}, fx.graph),
                               ("enable_alltoall=True", {"enable_alltoall": True}, fx.graph),
                               ("parallel optimizer on", {"enable_parallel_optimizer": True},
                                fx.graph),
                               ("another graph", {}, other_graph)):
        def call(tmp: Path, keys: dict[str, Any] = keys, graph: Any = graph) -> Any:
            with plain_context(**keys):
                return ap.load_strategy(str(tmp / "s.json"), graph)
        cases.append(Case("strategy files", f"a valid file under {label}", call,
                          names=("s.json",), typed=(ap.StrategyFileError,),
                          setup=_put("s.json", fx.valid)))
    return cases


# ---------------------------------------------------------------------------- calibration files


def as_in_file(tmp: Path, cluster: Any) -> str | None:
    """None when every figure of the loaded cluster is finite and the one its file holds (a
    calibration file carries no checksum: an edited figure is a new calibration)."""
    infinite = [k for k, v in cluster.model_dump().items()
                if isinstance(v, float) and not math.isfinite(v)]
    if infinite:
        return f"loaded infinite or NaN figures {infinite}"
    got = cluster.model_dump(mode="json")
    want = json.loads((tmp / "s.json").read_bytes())["cluster"]
    wrong = [k for k, v in want.items() if got.get(k) != v]
    return f"loaded {wrong} other than the file says" if wrong else None


def calibration_cases(quick: bool) -> list[Case]:
    """A saved calibration file mutated and special paths, read by load_cluster."""
    fx, rng = fixture(), random.Random(SEED + 1)
    data = fx.cluster_bytes
    mutations = [*truncations(data, 4 if quick else 20), *flips(data, 4 if quick else 20, rng),
                 *field_edits(fx.cluster_doc, 4 if quick else 16, rng),
                 *number_edits(fx.cluster_doc, 2 if quick else 8, rng)]
    cases = [_file_load("calibration files", label, d, ap.clusters.load_cluster, as_in_file,
                        ap.ClusterFileError) for label, d in mutations]
    return cases + _reader_paths("calibration files", data, ap.clusters.load_cluster, as_in_file,
                                 ap.ClusterFileError, "path")


# ---------------------------------------------------------------------------- writer


def savers() -> dict[str, tuple[str, Callable[[Any], Any], bytes]]:
    """The public writers: name -> (the key their errors name, save(path), the bytes)."""
    fx = fixture()

    def via_search(path: Any) -> Any:
        with plain_context(strategy_ckpt_save_file=path):
            return ap.search(fx.graph, cluster=CLUSTER)

    return {
        "write_text_atomic": ("path", lambda p: write_text_atomic(p, "{}\n"), b"{}\n"),
        "save_strategy": ("strategy_ckpt_save_file",
                          lambda p: ap.save_strategy(fx.plan, fx.graph, p), fx.valid),
        "save_cluster": ("path", lambda p: ap.clusters.save_cluster(fx.cluster, p),
                         fx.cluster_bytes),
        "search(strategy_ckpt_save_file)": ("strategy_ckpt_save_file", via_search, fx.valid),
    }


def _wrote(name: str, expected: bytes, mode: int | None = None,
           link: str | None = None) -> Callable[[Path, Any], str | None]:
    """The check of a write that must succeed: bytes, mode, the link kept."""
    def check(tmp: Path, result: Any) -> str | None:
        p = tmp / name
        if link is not None and os.readlink(tmp / link) != name:
            return f"the symlink {link} no longer points to {name}"
        if p.read_bytes() != expected:
            return f"{name} does not hold the saved bytes"
        if mode is not None and stat.S_IMODE(p.stat().st_mode) != mode:
            return f"{name} has mode {oct(stat.S_IMODE(p.stat().st_mode))}, not {oct(mode)}"
        return None
    return check


def _aged(name: str, seconds: float) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / name).write_bytes(b"partial")
        t = time.time() - seconds
        os.utime(tmp / name, (t, t))
    return setup


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fields(**kw: Any) -> dict[str, Any]:
    """The Case fields of a target (setup, check, names, writes)."""
    return kw


def clean_targets(expected: bytes) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path in tmp, Case fields) of writes that must succeed."""
    stale = ".t-stale.json.abcd1234.tmp"
    return [
        ("a symlink (written through, target mode kept)", "t-link.json", _fields(
            setup=_both(_put("real.json", b"old", 0o640),
                        lambda tmp: os.symlink("real.json", tmp / "t-link.json")),
            check=_wrote("real.json", expected, 0o640, link="t-link.json"),
            writes=("real.json",))),
        ("a 0600 file keeps its mode", "t-0600.json", _fields(
            setup=_put("t-0600.json", b"old", 0o600), check=_wrote("t-0600.json", expected, 0o600),
            writes=("t-0600.json",))),
        ("a new file gets 0666 less the umask", "t-new.json", _fields(
            check=_wrote("t-new.json", expected, 0o666 & ~_umask()), writes=("t-new.json",))),
        ("a stale temporary (2 min old) is removed", "t-stale.json", _fields(
            setup=_both(_put("t-stale.json", b"old"), _aged(stale, 120)),
            check=_wrote("t-stale.json", expected), writes=("t-stale.json", stale))),
        ("a fresh temporary (another writer's) is kept", "t-young.json", _fields(
            setup=_both(_put("t-young.json", b"old"), _aged(".t-young.json.abcd1234.tmp", 0)),
            check=_wrote("t-young.json", expected), writes=("t-young.json",))),
    ] + ([("another user's file, written by root, keeps its owner", "t-theirs.json", _fields(
        setup=_both(_put("t-theirs.json", b"old", 0o640),
                    lambda tmp: os.chown(tmp / "t-theirs.json", 65534, 65534)),
        check=_owned("t-theirs.json", expected, 65534), writes=("t-theirs.json",)))]
         if os.geteuid() == 0 else [])


def _owned(name: str, expected: bytes, uid: int) -> Callable[[Path, Any], str | None]:
    """The check of a write over another user's file: its bytes, mode and owner."""
    def check(tmp: Path, result: Any) -> str | None:
        st = (tmp / name).stat()
        if (st.st_uid, st.st_gid) != (uid, uid):
            return f"{name} is now owned by {st.st_uid}:{st.st_gid}, not {uid}:{uid}"
        return _wrote(name, expected, 0o640)(tmp, result)
    return check


def error_targets() -> list[tuple[str, Any, dict[str, Any]]]:
    """(label, path in tmp (str) or as given (other types), Case fields) of refused writes."""
    t = [("a FIFO", "t-fifo.json", "fifo"), ("a character device", "t-dev.json", "device"),
         ("a socket", "t-sock.json", "socket"), ("a directory", "t-dir.json", "directory"),
         ("a symlink loop", "t-loop.json", "loop"),
         ("a symlink into a missing directory", "t-dangling.json", "dangling")]
    out: list[tuple[str, Any, dict[str, Any]]] = [
        (label, name, _fields(setup=_special(kind, name), names=(name,)))
        for label, name, kind in t]
    out += [
        ("an existing directory with a trailing slash", "t-dir.json/",
         _fields(setup=_special("directory", "t-dir.json"), names=("t-dir.json",))),
        ("a new name with a trailing slash", "t-new.json/", _fields(names=("t-new.json",))),
        ("an existing file with a trailing slash", "t-file.json/",
         _fields(setup=_put("t-file.json", b"old"), names=("t-file.json",))),
        ("a NUL byte in the name", "t\0nul.json", _fields(names=("nul.json",))),
        ("a 300-character name", "x" * 300, _fields(names=("x" * 40,))),
        ("a missing parent directory", "nodir/t.json", _fields(names=("nodir",))),
        ("a parent that is a file", "t-file.json/child.json",
         _fields(setup=_put("t-file.json", b"old"), names=("t-file.json",))),
    ]
    if os.geteuid() != 0:  # root writes anyway: see readonly_child_case
        out.append(("a read-only directory", "ro/t.json", _fields(
            setup=lambda tmp: (tmp.joinpath("ro").mkdir(), os.chmod(tmp / "ro", 0o555)),
            names=("ro/t.json",))))
    return out


def _dev_null(save: Callable[[Any], Any]) -> Callable[[Path], Any]:
    """Try /dev/null only after the same saver refused a device node of our own (the guard:
    a saver that would write over /dev/null never gets the chance)."""
    def call(tmp: Path) -> Any:
        try:
            save(str(tmp / "t-dev.json"))
        except AutoparError:
            return save("/dev/null")
        raise RuntimeError("not tried: the saver wrote over a device node of its own")
    return call


def writer_cases() -> list[Case]:
    """Every public saver x hostile targets; the writes that must succeed, checked."""
    cases = []
    for saver, (key, save, expected) in savers().items():
        for label, rel, kw in error_targets():
            cases.append(Case("writer", f"{saver}: {label}",
                              partial(lambda r, s, tmp: s(os.path.join(tmp, r)), rel, save),
                              **kw))
        for label, rel, kw in clean_targets(expected):
            cases.append(Case("writer", f"{saver}: {label}",
                              partial(lambda r, s, tmp: s(os.path.join(tmp, r)), rel, save),
                              expect="clean", **kw))
        cases.append(Case("writer", f"{saver}: /dev/null (after a device node was refused)",
                          _dev_null(save), names=("/dev/null",),
                          setup=_special("device", "t-dev.json")))
        bad = [None, 123, b"t.json", ["t.json"]] + ([""] if saver != "search("
                                                      "strategy_ckpt_save_file)" else [])
        for value in bad:
            cases.append(Case("writer", f"{saver}: path {value!r}",
                              partial(lambda v, s, tmp: s(v), value, save), names=(key,)))
        cases.append(Case("writer", f"{saver}: a 255-character name (the longest allowed)",
                          partial(lambda s, tmp: s(str(tmp / ("y" * 250 + ".json"))), save),
                          expect="either", check=lambda tmp, r: None,
                          writes=("y" * 250 + ".json",), names=("y" * 40,)))
    return cases + writer_data_cases() + readonly_child_case()


def writer_data_cases() -> list[Case]:
    """What the generic writers are given to write: text that is not UTF-8, not bytes."""
    return [
        Case("writer", "write_text_atomic: text with a lone surrogate",
             lambda tmp: write_text_atomic(str(tmp / "t-text.json"), "\udcff"),
             names=("t-text.json",)),
        Case("writer", "write_bytes_atomic: str data",
             lambda tmp: write_bytes_atomic(str(tmp / "t-bytes.json"), "text"),  # type: ignore
             names=("t-bytes.json",)),
        Case("writer", "write_bytes_atomic: None data",
             lambda tmp: write_bytes_atomic(str(tmp / "t-bytes.json"), None),  # type: ignore
             names=("t-bytes.json",), setup=_put("t-bytes.json", b"old")),
    ]


# ---------------------------------------------------------------------------- child processes


#: A child imports autopar.files alone: the package's __init__ would import JAX (2 s).
CHILD_PRELUDE = f"""
import sys, types
pkg = types.ModuleType("autopar")
pkg.__path__ = [{str(ROOT / 'autopar')!r}]
sys.modules["autopar"] = pkg
from autopar.files import write_text_atomic
from autopar.errors import AutoparError
"""

READONLY_CHILD = CHILD_PRELUDE + """
import json, os
os.setgid(65534)
os.setuid(65534)
try:
    write_text_atomic(sys.argv[1], "{}")
    print(json.dumps(["ok", ""]))
except AutoparError as e:
    print(json.dumps(["typed", str(e)]))
except BaseException as e:
    print(json.dumps(["untyped", f"{type(e).__name__}: {e}"]))
"""


def readonly_child_case() -> list[Case]:
    """As root a read-only directory stops nothing: the write runs in a child that has
    dropped to uid 65534 (nobody)."""
    if os.geteuid() != 0:
        return []

    def setup(tmp: Path) -> None:
        os.chmod(tmp.parent, 0o755)
        (tmp / "ro").mkdir()
        os.chmod(tmp / "ro", 0o555)

    def call(tmp: Path) -> Any:
        p = subprocess.run([sys.executable, "-c", READONLY_CHILD, str(tmp / "ro" / "t.json")],
                           capture_output=True, text=True, timeout=60, check=False)
        kind, message = json.loads(p.stdout.strip().splitlines()[-1])
        if kind == "typed":
            raise Refused(message)
        if kind == "untyped":
            raise RuntimeError(message)
        return message

    return [Case("writer", "write_text_atomic: a read-only directory (as uid 65534)", call,
                 names=("ro/t.json",), typed=(Refused,), setup=setup)]


KILL_CHILD = CHILD_PRELUDE + """
import json
docs = json.load(sys.stdin)
print("ready", flush=True)
i = 0
while True:
    write_text_atomic(sys.argv[1], docs[i % 2], key="strategy_ckpt_save_file")
    i += 1
"""


def _kill_call(delay: float) -> Callable[[Path], Any]:
    """Save two strategy documents in turn in a child, SIGKILL it after ``delay``; then the
    file must be one of them and load, and the next save must leave no temporary."""
    def call(tmp: Path) -> Any:
        fx, path = fixture(), tmp / "s.json"
        child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(path)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        child.stdin.write(json.dumps([fx.other.decode(), fx.valid.decode()]))
        child.stdin.close()
        if child.stdout.readline().strip() != "ready":
            child.kill()
            raise RuntimeError("the saving child did not start")
        time.sleep(delay)
        child.kill()
        child.wait()
        child.stdout.close()
        data = path.read_bytes()
        if data not in (fx.valid, fx.other):
            raise RuntimeError(f"after kill -9 the file is neither document ({len(data)} bytes)")
        problem = same_plan(None, load_plan(str(path)))
        temps = sorted(tmp.glob(".s.json.*.tmp"))
        for t in temps:  # a minute later, the next save cleans up after the killed writer
            os.utime(t, (time.time() - 120, time.time() - 120))
        ap.save_strategy(fx.plan, fx.graph, str(path))
        return {"file": "A" if data == fx.valid else "B", "temporaries": len(temps),
                "problem": problem}
    return call


def _kill_check(tmp: Path, result: Any) -> str | None:
    if result["problem"]:
        return result["problem"]
    return None if (tmp / "s.json").read_bytes() == fixture().valid else \
        "the save after the kill did not write the document"


def kill_cases(quick: bool) -> list[Case]:
    rng = random.Random(SEED + 2)
    delays = [0.0 if k % 5 == 0 else rng.uniform(0.0, 0.03) for k in range(4 if quick else 40)]
    return [Case("kill -9 during save", f"SIGKILL after {d * 1e3:.1f} ms of saving", _kill_call(d),
                 expect="clean", check=_kill_check, setup=_put("s.json", fixture().valid),
                 writes=("s.json",)) for d in delays]


# ---------------------------------------------------------------------------- cli


BADMODELS = '''
def boom(**kw):
    raise RuntimeError("no data")


notcallable = 3


def returns_none(**kw):
    return None


def untraceable(**kw):
    return (lambda x: x.item() + 1), (1.0,)
'''
PROGRESS_LINE = re.compile(r"^\s+\[\d+/\d+\] ")

CLI = [
    (["run", "--model", "mlp", "--atol", "-1"], "--atol"),
    (["run", "--model", "mlp", "--atol", "nan"], "--atol"),
    (["run", "--model", "mlp", "--num-processes", "2", "--process-id", "0",
      "--coordinator", "localhost"], "--coordinator"),
    (["run", "--model", "mlp", "--num-processes", "2", "--process-id", "0",
      "--coordinator", "localhost:99999"], "--coordinator"),
    (["run", "--model", "mlp", "--num-processes", "2", "--process-id", "5",
      "--coordinator", "localhost:1234"], "--process-id"),
    (["run", "--model", "mlp", "--process-id", "0"], "--process-id"),
    (["run", "--model", "mlp", "-o", "widths=(8,16,8)", "--steps", "1", "--json", "subdir"],
     "subdir"),
    (["demo", "--pipeline-stages", "3", "--out", "demo-out"], "--pipeline-stages"),
    (["search", "--model", "nosuchmodule:f"], "nosuchmodule"),
    (["search", "--model", "badmodels:boom"], "badmodels:boom"),
    (["search", "--model", "badmodels:notcallable"], "notcallable"),
    (["search", "--model", "badmodels:nosuchfn"], "nosuchfn"),
    (["search", "--model", "badmodels:returns_none"], "returns_none"),
    (["search", "--model", "badmodels:untraceable"], "badmodels:untraceable"),
    (["search", "--model", "brokenmod:f"], "brokenmod"),
    (["search", "--model", "nosuchzoo"], "nosuchzoo"),
    (["search", "--model", ":f"], "--model"),
    (["search", "--model", "mlp", "-o", "layers"], "layers"),
    (["search", "--model", "mlp", "-o", "bogus=1"], "bogus"),
    (["search", "--model", "mlp", "--devices", "0"], "--devices"),
    (["search", "--model", "mlp", "--devices", "abc"], "--devices"),
    (["search", "--model", "mlp", "--bogus"], "--bogus"),
    (["search", "--model", "mlp", "--load", "garbage.json"], "garbage.json"),
    (["search", "--model", "mlp", "--save", "subdir/"], "subdir"),
    (["search", "--model", "mlp", "--save", "t-fifo.json"], "t-fifo.json"),
    (["search", "--model", "mlp", "--load", "s.json", "--parallel-mode", "data_parallel"],
     "--load"),
    (["search", "--model", "mlp", "--load", "s.json", "--mode", "exact"], "--mode"),
    (["search", "--model", "mlp", "--cluster", "nosuchcluster"], "nosuchcluster"),
    (["search", "--model", "mlp", "--cluster", "garbage.json"], "garbage.json"),
    (["simulate", "--model", "mlp", "--buckets", "bogus"], "--buckets"),
    (["calibrate", "--budget", "-1"], "--budget"),
    (["calibrate", "--budget", "nan"], "--budget"),
    (["show", "t-fifo.json"], "t-fifo.json"),
    (["show", "missing.json"], "missing.json"),
    (["show", "garbage.json"], "garbage.json"),
    (["show", "subdir"], "subdir"),
    (["show", "\udcff.json"], "udcff.json"),
    (["search", "--model", "mlp", "-o", "widths=(8,"], "widths"),
    (["search", "--model", "mlp", "-o", "widths=()"], "widths"),
    (["run", "--model", "mlp", "--steps", "0"], "--steps"),
    (["frobnicate"], "frobnicate"),
    ([], "COMMAND"),
]


def error_lines(stderr: str) -> list[str]:
    """The lines of stderr that are neither progress lines nor argparse's usage block."""
    lines = [x for x in stderr.splitlines() if x.strip() and not PROGRESS_LINE.match(x)]
    if lines and lines[0].startswith("usage:"):
        lines.pop(0)
        while lines and lines[0].startswith(" "):
            lines.pop(0)
    return lines


def cli_verdict(returncode: int, stdout: str, stderr: str) -> str:
    """Judge a command's exit: raises :class:`Refused` (its error line) for a clean refusal,
    RuntimeError for a traceback or other stderr; returns stdout's tail for a success."""
    if returncode == 0:
        return f"exit 0: {stdout[-200:]}"
    lines = error_lines(stderr)
    if "Traceback" in stderr:
        raise RuntimeError(f"exit {returncode} with a traceback: {stderr.strip()[-400:]}")
    if len(lines) != 1 or "error:" not in lines[0]:
        raise RuntimeError(f"exit {returncode}; stderr is not one error line: {lines[:4]}")
    raise Refused(lines[0])


def cli_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "JAX_PLATFORMS": "cpu", "AUTOPAR_CLUSTER": CLUSTER,
            "AUTOPAR_CACHE_DIR": "off", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": path}


def _cli_setup(tmp: Path) -> None:
    (tmp / "badmodels.py").write_text(BADMODELS)
    (tmp / "brokenmod.py").write_text("raise ImportError('broken on purpose')\n")
    (tmp / "garbage.json").write_bytes(bytes(range(256)) * 4)
    (tmp / "s.json").write_bytes(fixture().valid)
    (tmp / "subdir").mkdir()
    os.mkfifo(tmp / "t-fifo.json")


def _cli_call(argv: list[str]) -> Callable[[Path], Any]:
    def call(tmp: Path) -> Any:
        p = subprocess.run([sys.executable, "-m", "autopar", *argv], cwd=tmp, env=cli_env(),
                           capture_output=True, encoding="utf-8", errors="backslashreplace",
                           timeout=300, stdin=subprocess.DEVNULL, check=False)
        return cli_verdict(p.returncode, p.stdout, p.stderr)
    return call


def cli_cases(quick: bool) -> list[Case]:
    chosen = [c for c in CLI if c[0][:1] == ["show"]][:1] if quick else CLI
    return [Case("cli", "autopar " + " ".join(argv), _cli_call(argv), names=(name,),
                 typed=(Refused,), setup=_cli_setup) for argv, name in chosen]


# ---------------------------------------------------------------------------- train_step


def _build(keys: dict[str, Any], *args: Any, **kw: Any) -> Callable[[Path], Any]:
    def call(tmp: Path) -> Any:
        with plain_context(**{"parallel_mode": "data_parallel", **keys}):
            return ap.train_step(*args, cluster=CLUSTER, **kw)
    return call


def _step(*args: Any, method: str = "__call__") -> Callable[[Path], Any]:
    return lambda tmp: getattr(fixture().step, method)(*args)


def _replace_w(params: Any, value: Any) -> Any:
    return {**params, "layer0": {**params["layer0"], "w": value}}


def train_cases() -> list[Case]:
    """train_step built with bad inputs, and a built step called with bad ones."""
    fx = fixture()
    p, x, loss, st = fx.params, fx.x, fx.model.loss, fx.opt_state
    table = [
        ("batch a list", _build({}, loss, p, [x]), "batch"),
        ("a None batch leaf", _build({}, loss, p, (None,)), "batch[0]"),
        ("a str batch leaf", _build({}, loss, p, ("abc",)), "batch[0]"),
        ("a bytes batch leaf", _build({}, loss, p, (b"abc",)), "batch[0]"),
        ("a None parameter", _build({}, loss, _replace_w(p, None), (x,)), "params"),
        ("a str parameter", _build({}, loss, _replace_w(p, "abc"), (x,)), "params"),
        ("loss_fn not callable", _build({}, 3, p, (x,)), "loss_fn"),
        ("optimizer a str", _build({}, loss, p, (x,), "sgd"), "optimizer"),
        ("optimizer the sgd factory", _build({}, loss, p, (x,), optax.sgd), "optimizer"),
        ("backend 'bogus'", _build({}, loss, p, (x,), backend="bogus"), "backend"),
        ("sync_method 'bogus'", _build({}, loss, p, (x,), sync_method="bogus"), "sync_method"),
        ("fused_kernels 'bogus'", _build({}, loss, p, (x,), fused_kernels="bogus"),
         "fused_kernels"),
        ("mesh a str", _build({}, loss, p, (x,), mesh="abc"), "mesh"),
        ("a loss that is not a scalar", _build({}, lambda q, b: b, p, (x,)), "loss_fn"),
        ("backend='pmap', 6 batch rows over 8 devices",
         _build({}, loss, p, (x[:6],), backend="pmap"), "batch"),
        ("grad_accumulation_step=3, 8 rows",
         _build({"parallel_mode": "auto_parallel", "grad_accumulation_step": 3}, loss, p, (x,)),
         "grad_accumulation_step"),
        ("backend='pmap' under auto_parallel",
         _build({"parallel_mode": "auto_parallel"}, loss, p, (x,), backend="pmap"), "backend"),
        ("backend='pmap' with pipeline_stages=2",
         _build({"parallel_mode": "semi_auto_parallel", "pipeline_stages": 2}, loss, p, (x,),
                backend="pmap"), "backend"),
        ("step: adam state for an sgd step", _step(p, optax.adam(0.1).init(p), x), "opt_state"),
        ("step: momentum state", _step(p, optax.sgd(0.1, momentum=0.9).init(p), x), "opt_state"),
        ("step: None state", _step(p, None, x), "opt_state"),
        ("step: {} state", _step(p, {}, x), "opt_state"),
        ("step: params of another structure", _step({"w": x}, st, x), "params"),
        ("step: a str parameter", _step(_replace_w(p, "abc"), st, x), "params"),
        ("step: a None parameter", _step(_replace_w(p, None), st, x), "params"),
        ("step: 4 batch rows, not 8", _step(p, st, x[:4]), "batch"),
        ("step: an int32 batch", _step(p, st, np.asarray(x).astype(np.int32)), "dtype"),
        ("step: an extra batch input", _step(p, st, x, x), "batch"),
        ("step: no batch input", _step(p, st), "batch"),
        ("step: a str batch", _step(p, st, "abc"), "batch"),
        ("grads: 4 batch rows", _step(p, x[:4], method="grads"), "batch"),
    ]
    return [Case("train_step", label, call, names=(name,)) for label, call, name in table]


# ---------------------------------------------------------------------------- the run


def build_cases(quick: bool) -> list[Case]:
    """Every case of a run (``quick``: fewer file mutations and kills, one CLI command, a
    subset of each later family: benchmarks/reliability_more.py)."""
    from benchmarks import reliability_more as more

    fixture()
    return [*context_cases(), *hccl_cases(), *strategy_cases(quick), *calibration_cases(quick),
            *writer_cases(), *kill_cases(quick), *cli_cases(quick), *train_cases(),
            *more.fuzz_cases(quick), *more.graph_cases(quick), *more.disk_cases(quick),
            *more.concurrency_cases(quick), *more.job_cases(quick), *more.argv_cases(quick)]


def skipped() -> dict[str, str]:
    """Categories this machine could not run, and why (a tmpfs needs root)."""
    from benchmarks import reliability_more as more

    return dict(more.SKIPPED)


def _run_all(quick: bool, cases: list[Case] | None) -> list[Outcome]:
    base = Path(tempfile.mkdtemp(prefix="autopar-reliability-"))
    os.chmod(base, 0o755)  # a case may drop to another uid (readonly_child_case)
    try:
        with warnings.catch_warnings():  # AutoParallelWarning, DeprecationWarning: not judged
            warnings.simplefilter("ignore")
            cases = build_cases(quick) if cases is None else cases
            out = [run_case(c, base / f"{k:04d}") for k, c in enumerate(cases)
                   if c.category not in POOLED]
            with ThreadPoolExecutor(max_workers=2) as pool:  # subprocesses, 2 at a time
                out += pool.map(lambda kc: run_case(kc[1], base / f"cli{kc[0]:04d}"),
                                [(k, c) for k, c in enumerate(cases) if c.category in POOLED])
    finally:
        _remove(base)
    order = {c: k for k, c in enumerate(CATEGORIES)}
    return sorted(out, key=lambda o: order.get(o.case.category, len(order)))


def run_all(quick: bool, cases: list[Case] | None = None) -> list[Outcome]:
    """Run the cases (default: :func:`build_cases`) in a copy of the caller's context, so
    the caller's auto-parallel context and HCCL state are left as they were."""
    return contextvars.copy_context().run(_run_all, quick, cases)


def summarize(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per category (and a total): the table's counts."""
    cats = list(dict.fromkeys(o.case.category for o in outcomes))
    rows = [_row(c, [o for o in outcomes if o.case.category == c]) for c in cats]
    return rows + [_row("total", list(outcomes))]


def _row(category: str, outs: list[Outcome]) -> dict[str, Any]:
    judged = [o for o in outs if o.named is not None]
    return {"category": category, "cases": len(outs),
            "typed_errors": sum(o.kind == "typed" for o in outs),
            "clean_ok": sum(o.kind == "clean" for o in outs),
            "untyped": sum(o.kind == "untyped" for o in outs),
            "accepted_or_wrong": sum(o.kind in ("accepted", "refused", "wrong", "harness")
                                     for o in outs),
            "state_changed": sum(bool(o.state) for o in outs),
            "files_harmed": sum(bool(o.files) for o in outs),
            "names_key_or_file": f"{sum(bool(o.named) for o in judged)}/{len(judged)}",
            "failing": sum(o.failed for o in outs)}


def failing(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    return [{"category": o.case.category, "input": printable(o.case.label)[:300],
             "problems": o.problems} for o in outcomes if o.failed]


def kill_summary(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """How the kills landed: which complete document the file held (A: the one it started
    with, B: the other), and how many kills left the writer's temporary behind."""
    results = [o.message for o in outcomes if o.case.category == "kill -9 during save"]
    return {"kills": len(results), "file_a": sum("'file': 'A'" in r for r in results),
            "file_b": sum("'file': 'B'" in r for r in results),
            "left_a_temporary": sum("'temporaries': 0" not in r for r in results)}


def render(payloads: dict[str, dict[str, Any]]) -> dict[tuple[str, str], str]:
    """The docs table from the saved JSON (``{"reliability": payload}``), keyed by (doc,
    marker): the shape of a ``DocTables`` render in benchmarks/_common.py."""
    from benchmarks._common import markdown_table

    payload = payloads["reliability"]
    meta, kills = payload["meta"], payload["meta"]["kill -9"]
    text = markdown_table(payload["rows"], payload["columns"]) + (
        f"\n\n{meta['cases']} cases in {meta['seconds']:.0f} s (seed {meta['seed']}). kill -9: "
        f"after {kills['file_a'] + kills['file_b']} of {kills['kills']} kills the file held one "
        f"of the two complete documents being saved in turn (A {kills['file_a']}, B "
        f"{kills['file_b']}); {kills['left_a_temporary']} kills left a temporary, which the "
        "next save removed." + "".join(f" Not run on this machine: {cat} ({why})."
                                       for cat, why in meta.get("skipped", {}).items())
        + " `python -m benchmarks reliability` wrote this table.")
    return {("docs/reliability.md", "reliability"): text}


DOC_TABLES = DocTables(("reliability",), render)


def publish(rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write the JSON and, after a full run, the docs table rendered from it."""
    from benchmarks._common import write_results

    write_results("reliability", rows, COLUMNS, meta=meta)
    DOC_TABLES.write()


def main(quick: bool = False) -> None:
    t0 = time.perf_counter()
    outcomes = run_all(quick)
    seconds = time.perf_counter() - t0
    bad = failing(outcomes)
    for f in bad:
        print(f"FAILING [{f['category']}] {f['input']}\n    " + "\n    ".join(f["problems"]))
    meta = {"seed": SEED, "quick": quick, "seconds": round(seconds, 1), "cases": len(outcomes),
            "root": os.geteuid() == 0, "mknod": can_mknod(), "kill -9": kill_summary(outcomes),
            "skipped": skipped(), "failing": bad}
    publish(summarize(outcomes), meta)
    print(f"\n{len(outcomes)} cases, {len(bad)} failing, {seconds:.1f} s")


if __name__ == "__main__":
    from benchmarks._common import run_main

    run_main(main)
