"""Which machine a plan is priced for: presets, calibration files, the cache, the default.

:func:`resolve_cluster` is what every entry point calls with the user's ``cluster=``:

- a :class:`~autopar.strategies.cost.Cluster`: itself;
- a preset name (``"accelerator-8x"``, ``"cpu-emulated"``): the preset;
- ``"calibrated"``: the cached calibration of the devices present, measured now if there is
  none (:func:`autopar.calibrate`);
- a path to a calibration file (``.json``, written by ``autopar calibrate --out``);
- ``None``: the ``AUTOPAR_CLUSTER`` environment variable when set (any of the above forms),
  else the cached calibration of the devices present, else the preset of their platform
  (CPU devices: ``cpu-emulated``; anything else: ``accelerator-8x``). Either way one line on
  stderr says which model prices the plans and how to calibrate (once per process).

Calibrations are cached in ``$AUTOPAR_CACHE_DIR`` (default ``~/.cache/autopar``), one file
per platform, device kind, device count, process count and host
(:func:`~autopar.calibration.host_identity`: processor, CPUs, memory); a cached calibration
another host, another JAX version or an older calibration wrote is measured again, and a
calibration file or cluster measured on another host prices plans for that host, with a
one-line notice saying so. ``AUTOPAR_CACHE_DIR=off`` switches the cache off. A calibration
file is versioned JSON written canonically (sorted keys, ``repr`` floats) through the one
atomic writer, so loading and saving it again gives the same bytes; a file that cannot be
used raises :class:`ClusterFileError` naming the file and field.

Under ``jax.distributed``, while the processes build a program together
(:func:`autopar.multihost.together`: ``parallelize``, ``train_step``, the pipelined step),
the resolution is process 0's on every process (its request, its cache): processes that
priced plans on different clusters would run different programs. A process that asked for
another cluster says so in one line. Elsewhere (``autopar.search`` on one process, say)
each resolves its own. :func:`calibrate` is always measured by every process together.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from pydantic import ValidationError

from autopar.calibration import (CALIBRATION_VERSION, MESSAGE_SIZES, check_settings,
                                 host_identity, measure, select_devices)
from autopar.errors import AutoParallelError, AutoParallelTypeError, FileFieldError
from autopar.files import (path_text, read_json_document, validation_failure,
                           write_text_atomic)
from autopar.multihost import agree_text, agreeing, is_lead, several
from autopar.strategies.cost import CLUSTERS, Cluster, get_cluster

__all__ = ["CACHE_ENV", "CLUSTER_ENV", "ClusterFileError", "FORMAT", "MAX_FILE_BYTES",
           "KIND_PRESETS", "PLATFORM_PRESETS", "cached_calibration", "calibrate",
           "cluster_for", "default_preset",
           "describe_cluster", "dumps_cluster", "forget_calibration", "load_cluster",
           "note_devices", "plan_cluster", "resolve_cluster", "save_cluster", "store_calibration"]

FORMAT = "autopar-cluster"
VERSION = 1
CLUSTER_ENV = "AUTOPAR_CLUSTER"
CACHE_ENV = "AUTOPAR_CACHE_DIR"
#: A calibration file is a few KiB; anything past this is not one.
MAX_FILE_BYTES = 4 * 2 ** 20
#: The preset for a platform when nothing was measured (never the accelerator's for a CPU).
PLATFORM_PRESETS = {"cpu": "cpu-emulated"}
#: The preset for a device whose ``device_kind`` holds the word, when nothing was measured
#: (an H200 has the H100's compute; its preset's memory, 80 GB, is the smaller budget).
KIND_PRESETS = (("H100", "dgx-h100-80gb"), ("H200", "dgx-h100-80gb"),
                ("A100", "dgx-a100-80gb"))
_DEFAULT_PRESET = "accelerator-8x"
_noticed: set[str] = set()
_loaded: dict[tuple[str, int, int], Cluster | None] = {}  # cache files read, by mtime


class ClusterFileError(FileFieldError):
    """A calibration file that cannot be used: names the file, the field, expected vs found."""

    what = "calibration file"


# ---------------------------------------------------------------------------- files


def _check_cluster(cluster: Any) -> None:
    if not isinstance(cluster, Cluster):
        raise AutoParallelTypeError("cluster", cluster, "an autopar.Cluster")


def dumps_cluster(cluster: Cluster) -> str:
    """Canonical text of a calibration file: the same cluster always gives the same bytes."""
    _check_cluster(cluster)
    doc = {"format": FORMAT, "version": VERSION, "cluster": cluster.model_dump(mode="json")}
    return json.dumps(doc, sort_keys=True, indent=1, allow_nan=False) + "\n"


def save_cluster(cluster: Cluster, path: str | os.PathLike[str]) -> Path:
    """Write ``cluster`` to ``path`` (atomic; refuses a path that is not a regular file)."""
    return write_text_atomic(path, dumps_cluster(cluster))  # checks the cluster and path


def load_cluster(path: str | os.PathLike[str]) -> Cluster:
    """Read and validate a calibration file (see the module doc)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise AutoParallelTypeError("path", path, "a non-empty path")
    data = read_json_document(path, fmt=FORMAT, version=VERSION, limit=MAX_FILE_BYTES,
                              error=ClusterFileError)
    extra = sorted(set(data) - {"format", "version", "cluster"})
    if extra:
        raise ClusterFileError(path, extra[0], "no such field", data[extra[0]])
    if "cluster" not in data:
        raise ClusterFileError(path, "cluster", "the cluster's figures", "<missing>")
    try:
        return Cluster.model_validate_json(json.dumps(data.get("cluster")))
    except ValidationError as e:
        raise ClusterFileError(path, *validation_failure(e, "cluster")) from None


# ---------------------------------------------------------------------------- the cache


def _cache_dir() -> Path | None:
    value = os.environ.get(CACHE_ENV, "")
    if value.lower() == "off":
        return None
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autopar"


def _cache_path(devices: Sequence[Any]) -> Path | None:
    d = _cache_dir()
    if d is None:
        return None
    procs = len({dev.process_index for dev in devices})
    kind = re.sub(r"[^A-Za-z0-9._-]+", "_", devices[0].device_kind)
    host = hashlib.sha256(host_identity().encode()).hexdigest()[:10]
    return d / f"{devices[0].platform}-{kind}-{len(devices)}-{procs}-{host}.json"


def _current(cluster: Cluster | None) -> Cluster | None:
    """``cluster`` if a calibration of this version measured it on this host with this JAX,
    else None (measured again)."""
    import jax

    cal = cluster.calibration if cluster is not None else None
    if cal is None or (cal.version, cal.host, cal.jax_version) != (
            CALIBRATION_VERSION, host_identity(), jax.__version__):
        return None
    return cluster


def cached_calibration(devices: Sequence[Any]) -> Cluster | None:
    """The cached calibration of exactly these devices' kind and count on this host, or None
    (a cache file that cannot be read, or that an older calibration or another JAX version
    wrote, counts as none: it is measured again and replaced)."""
    path = _cache_path(devices)
    try:
        st = path.stat() if path is not None else None
    except OSError:
        st = None
    if path is None or st is None:
        return None
    key = (str(path), st.st_mtime_ns, st.st_size)  # every search asks: read the file once
    if key not in _loaded:
        try:
            hit = load_cluster(path)
        except ClusterFileError:
            hit = None
        _loaded[key] = _current(hit)
    return _loaded[key]


def store_calibration(cluster: Cluster, devices: Sequence[Any]) -> Path | None:
    path = _cache_path(devices)
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return save_cluster(cluster, path)
    except (OSError, AutoParallelError):
        return None  # a read-only home: the calibration is still returned, just not kept


def forget_calibration(devices: Sequence[Any]) -> None:
    """Drop the cached calibration of these devices (the next one measures again)."""
    path = _cache_path(devices)
    if path is not None and path.is_file():
        path.unlink()


def calibrate(devices: Any = None, *, budget_s: float = 60.0, cache: bool = True,
              fresh: bool = False, progress: bool = True,
              max_message_bytes: int = MESSAGE_SIZES[-1]) -> Cluster:
    """Measure ``devices`` (default: every device present; an int: the first that many) and
    return the fitted Cluster (:func:`autopar.calibration.measure`).

    ``cache``: return the cached calibration of these devices when there is one, and cache a
    new one. ``fresh``: measure even when one is cached (the new one replaces it, once
    measured). Under ``jax.distributed`` every process calls it and measures together;
    process 0's cache, decisions and fit are every process's, and process 0 caches the
    result. ``budget_s``: the wall time to aim for (the measurement plan shrinks to fit:
    fewer message sizes, never fewer than two per fit). ``progress``: a progress bar on
    stderr. ``max_message_bytes``: the largest collective message measured (default 32 MiB;
    smaller for a quick, coarser calibration).
    """
    check_settings(budget_s, progress, max_message_bytes)
    for key, value in (("cache", cache), ("fresh", fresh)):
        if not isinstance(value, bool):
            raise AutoParallelTypeError(key, value, "must be a bool")
    devs = select_devices(devices)
    hit = _process0s(cached_calibration(devs) if cache and not fresh else None, True)
    if hit is not None:
        return hit
    cluster = measure(devs, budget_s=budget_s, progress=progress,
                      max_message_bytes=max_message_bytes)
    if cache and is_lead():
        store_calibration(cluster, devs)
    return cluster


def describe_cluster(cluster: Cluster) -> str:
    """A plain-text summary: the compute figures and each measured collective's fit.

    >>> print(describe_cluster(CLUSTERS["cpu-emulated"]).splitlines()[0].replace(", ", "\\n"))
    cpu-emulated (preset): 4.00 GFLOP/s
    2.00 GB/s memory
    0.0 us per operator
    overlap 0.00
    barrier 0.0 us + 0.00 us per KiB in a step
    """
    _check_cluster(cluster)
    from autopar.text import table

    c = cluster
    head = (f"{c.name} ({'preset' if c.calibration is None else 'calibrated'}): "
            f"{c.peak_flops / 1e9:.2f} GFLOP/s, {c.memory_bandwidth / 1e9:.2f} GB/s memory, "
            f"{c.op_overhead * 1e6:.1f} us per operator, overlap {c.overlap:.2f}, "
            f"barrier {c.barrier * 1e6:.1f} us + {c.barrier_per_byte * 1024e6:.2f} us per KiB "
            "in a step")
    lines = [head]
    if c.calibration is not None:
        k = c.calibration
        host = f"; host {k.host}" if k.host else ""
        lines.append(f"measured on {k.device_count} {k.platform} device(s) ({k.device_kind}, "
                     f"{k.process_count} process(es){host}) in {k.seconds:.1f} s; fit residuals: "
                     f"matmul {k.matmul_residual:.0%}, memory {k.memory_residual:.0%}; "
                     f"shared compute x{k.shared_compute:.2f}")
    if c.collectives:
        def gbps(beta: float) -> str:
            return f"{1 / beta / 1e9:.3f}" if beta > 0 else "inf"

        rows = [("collective", "group", "link", "alpha us", "GB/s (1/beta)", "knee MiB",
                 "GB/s past knee", "max residual", "sizes")]
        rows += [(f.kind, f.group, "intra" if f.intra else "inter", f"{f.alpha * 1e6:.1f}",
                  gbps(f.beta), f"{f.knee / 2 ** 20:g}" if f.knee else "-",
                  gbps(f.beta_large) if f.knee else "-", f"{f.residual:.0%}", f.samples)
                 for f in c.collectives]
        lines += ["", table(rows)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- resolution


def _notice(text: str) -> None:
    if text not in _noticed:
        _noticed.add(text)
        print(f"autopar: {text}", file=sys.stderr)


def _looks_like_path(value: str) -> bool:
    return value.endswith(".json") or os.sep in value or (os.altsep or os.sep) in value


def _measured_elsewhere(cluster: Cluster) -> Cluster:
    """``cluster``, with a notice (once) when its calibration was measured on another host."""
    cal = cluster.calibration
    if cal is not None and cal.host and cal.host != host_identity():
        _notice(f"pricing plans on {cluster.name}, measured on another host ({cal.host}; "
                f"this one: {host_identity()}): the plans are fitted to that host; `autopar "
                "calibrate` measures this one")
    return cluster


def note_devices(cluster: Cluster, device_num: int) -> Cluster:
    """``cluster``, with a notice (once) when it is a calibration of fewer devices than the
    plan it prices: collectives over more devices than it measured are extrapolated."""
    cal = cluster.calibration
    if cal is not None and cal.device_count < device_num:
        _notice(f"pricing {device_num}-device plans on {cluster.name}, measured on "
                f"{cal.device_count} device(s): collectives over more devices are "
                f"extrapolated from its fits; `autopar calibrate --devices {device_num}` "
                "measures them")
    return cluster


def resolve_cluster(cluster: Any = None) -> Cluster:
    """The Cluster that prices a plan for ``cluster`` (see the module doc). While a job of
    several processes builds a program (:func:`autopar.multihost.together`) it is process
    0's on every process."""
    request = _request(cluster)
    if agreeing():
        request = _agreed_request(request)
    if request == "calibrated":
        return calibrate()
    if request == "default":
        return _default_cluster()
    return request


_Request = Cluster | str  # a cluster, or "calibrated" / "default": measured or looked up


def _request(cluster: Any) -> _Request:
    """What this process asks for, read and checked here; what is measured or looked up in
    the cache is named, not done (every process of a job must do it together)."""
    if isinstance(cluster, Cluster):
        return _measured_elsewhere(cluster)
    if isinstance(cluster, os.PathLike):
        path_text(cluster, "cluster")  # (a __fspath__ giving no str: refused, named)
        return _measured_elsewhere(load_cluster(cluster))
    if cluster is not None and not isinstance(cluster, str):
        raise AutoParallelTypeError("cluster", cluster, "a preset name, 'calibrated', a "
                                    "calibration file path or an autopar.Cluster")
    if cluster is None:
        env = os.environ.get(CLUSTER_ENV, "")
        if not env:
            return "default"
        try:
            return _request(env)
        except AutoParallelError as e:  # name where the value came from
            why = str(e).split(" is invalid: ", 1)[-1].rstrip(".")
            raise AutoParallelError(CLUSTER_ENV, env, why) from None
    if cluster in CLUSTERS:
        return get_cluster(cluster)
    if cluster == "calibrated":
        return "calibrated"
    if _looks_like_path(cluster):
        return _measured_elsewhere(load_cluster(cluster))
    raise AutoParallelError("cluster", cluster, f"unknown cluster; choose a preset "
                            f"{sorted(CLUSTERS)}, 'calibrated', a calibration file path "
                            "(.json) or pass autopar.Cluster(...)")


def _agreed_request(request: _Request) -> _Request:
    """Process 0's request, with a notice where this process asked for another."""
    mine = request if isinstance(request, str) else request.model_dump_json()
    agreed = agree_text(mine)
    if agreed == mine:
        return request
    theirs = agreed if agreed in ("calibrated", "default") else \
        Cluster.model_validate_json(agreed)
    _notice(f"this process asked for {_said(request)}; process 0's {_said(theirs)} prices "
            "the plans of this job (every process of a jax.distributed job plans alike)")
    return theirs


def _said(request: _Request) -> str:
    if request == "default":
        return "default cluster"
    return "calibration ('calibrated')" if request == "calibrated" else \
        f"cluster {request.name!r}"  # type: ignore[union-attr]


def _process0s(cluster: Cluster | None, agree: bool) -> Cluster | None:
    """Process 0's cached calibration (or none) on every process of a job, if ``agree``."""
    if not (agree and several()):
        return cluster
    agreed = agree_text("" if cluster is None else cluster.model_dump_json())
    return Cluster.model_validate_json(agreed) if agreed else None


def _default_cluster() -> Cluster:
    devices = select_devices(None)
    hit = _process0s(cached_calibration(devices), agreeing())
    where = f"{len(devices)} {devices[0].platform} device(s)"
    if hit is not None:
        _notice(f"pricing plans on the calibration of these {where} ({hit.name}, cached; "
                f"`autopar calibrate` measures again)")
        return hit
    preset = default_preset(devices[0].platform, devices[0].device_kind)
    _notice(f"pricing plans on the {preset!r} preset (no calibration cached for these "
            f"{where}; run `autopar calibrate` or autopar.calibrate() to measure them)")
    return CLUSTERS[preset]


def default_preset(platform: str, device_kind: str) -> str:
    """The preset that prices devices nothing was measured on: their kind's
    (:data:`KIND_PRESETS`), else their platform's, else the accelerator preset.

    >>> default_preset("gpu", "NVIDIA H200"), default_preset("cpu", "cpu")
    ('dgx-h100-80gb', 'cpu-emulated')
    """
    for word, preset in KIND_PRESETS:
        if word in device_kind:
            return preset
    return PLATFORM_PRESETS.get(platform, _DEFAULT_PRESET)


def cluster_for(plan: Any, cluster: Any = None) -> Cluster:
    """The cluster that prices work on ``plan``: the one named, else the plan's own (so a
    simulation, a fused-kernel choice or a re-pricing agrees with the search), else the
    default (:func:`resolve_cluster`)."""
    own = plan_cluster(plan) if cluster is None else None
    return resolve_cluster(cluster) if own is None else own


def plan_cluster(plan: Any) -> Cluster | None:
    """The cluster ``plan`` was priced on (its own, or its preset's by name); None without
    a plan or when it names none known."""
    if plan is None:
        return None
    own = getattr(plan, "cluster_config", None)
    if isinstance(own, Cluster):
        return own
    name = getattr(plan, "cluster", None)
    return CLUSTERS[name] if isinstance(name, str) and name in CLUSTERS else None
