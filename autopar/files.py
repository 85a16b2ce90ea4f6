"""The one writer and the one reader of autopar's files (strategy files, calibrations,
traces, reports, pictures).

Writing (:func:`write_bytes_atomic`, :func:`write_text_atomic`): the bytes go to a temporary
file of a unique name beside the target (``.<name>.<random>.tmp``), are flushed to disk, and
replace the target in one ``os.replace``: a reader sees the old file or the new one, never a
part. The target must be a regular file or absent: a directory (or a path ending in a
separator), a FIFO, a device or a socket is refused before anything is written, and so is a
path through a link under /dev or into /proc (``/dev/stdout`` resolves to the file the
output is redirected to). A symlink is written through (its target is replaced, the link
stays). An existing file keeps its mode; a new one gets ``0o666`` less the umask. On any
failure the temporary file is removed and the target is untouched; temporaries of the same
name pattern left by a killed writer (older than a minute) are removed by the next save.
Errors are :class:`AutoParallelError` naming the target and the reason, never the hidden
temporary.

Reading (:func:`read_bytes_capped`): regular files only (a FIFO would block, a device never
end), at most ``limit`` bytes (checked before reading, and while reading).

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> write_text_atomic(d / "a.json", "{}").read_text()
'{}'
>>> read_bytes_capped(d / "a.json", 10)
b'{}'
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from autopar.errors import (AutoParallelError, AutoParallelTypeError, FileFieldError,
                            validation_problems)

__all__ = ["STALE_SECONDS", "read_bytes_capped", "read_json", "read_json_document",
           "validation_failure",
           "writable_target", "require_finite",
           "write_bytes_atomic", "write_text_atomic"]

#: A temporary file of ours this old was left by a writer that died: the next save removes it.
STALE_SECONDS = 60.0


def _target(path: Any, key: str) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise AutoParallelTypeError(key, path, "a non-empty path")
    text = os.fspath(path)
    if "\0" in str(text):
        raise AutoParallelError(key, str(text).replace("\0", "\\0"), "a path cannot hold a NUL "
                                "byte")
    if str(text).endswith((os.sep, os.altsep or os.sep)):
        raise AutoParallelError(key, str(text), "names a directory; give a file name")
    if _through_system(str(text)):
        raise AutoParallelError(key, str(text), "leads to a stream or a process's open file "
                                "(a link under /dev, or /proc); files are written only over "
                                "regular files")
    try:
        target = Path(text)
        if target.is_symlink():  # write through the link: its target is what gets replaced
            target = Path(os.path.realpath(target))
        directory = target.parent if str(target.parent) else Path(".")
        if not directory.is_dir():
            what = "is not a directory" if directory.exists() else "does not exist"
            raise AutoParallelError(key, str(text), f"directory {str(directory)!r} {what}")
        st = target.stat()
    except FileNotFoundError:
        return target
    except OSError as e:  # a name too long, a path through a file, no permission
        raise AutoParallelError(key, str(text), f"cannot be written: {e.strerror or e}") \
            from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise AutoParallelError(key, str(text), f"is {kind}; files are written only over "
                                "regular files")
    return target


def _through_system(text: str) -> bool:
    """Whether writing to ``text`` would go through a link under /dev (``/dev/stdout``,
    ``/dev/fd/1``) or into /proc (``/proc/self/fd/1``): such a link resolves to the file the
    output is redirected to, and a write there would replace that file instead of writing to
    the stream. Each step resolves its directory first (``d/../x`` with ``d`` a link is
    where the system finds it); a regular file under /dev (``/dev/shm/plan.json``) is fine."""
    try:
        p = os.path.join(os.getcwd(), text)
        for _ in range(40):  # (a loop of links ends the walk)
            where = os.path.realpath(os.path.dirname(p))
            p = os.path.join(where, os.path.basename(p))
            if p.startswith("/proc/"):
                return True
            if not os.path.islink(p):
                return False
            if p.startswith("/dev/"):
                return True
            p = os.path.join(where, os.readlink(p))
    except OSError:  # (no working directory, a link gone meanwhile: the checks after say)
        pass
    return False


def writable_target(path: Any, key: str) -> Path:
    """The file a write to ``path`` would replace, checked as :func:`write_bytes_atomic`
    checks it (a non-empty path, no NUL, its directory there, not a directory or special
    file), without writing: for callers that write several files and must refuse before the
    first."""
    return _target(path, key)


def _temp_prefix(name: str) -> str:
    """``.<name>.``, the name cut so a temporary file's name fits where ``name`` does."""
    return f".{name[:200]}."


#: The random part ``tempfile.mkstemp`` puts between our prefix and ``.tmp``: only names of
#: exactly this shape are ours to remove (a user's ``.s.json.backup.tmp`` is not)
_TEMP_TAIL = re.compile(r"[a-z0-9_]{8}\.tmp")


def _clean_stale(directory: Path, name: str) -> None:
    """Remove our temporary files of ``name`` older than :data:`STALE_SECONDS` (a killed
    writer's): ``mkstemp``'s names after our prefix, nothing else."""
    now = time.time()
    prefix = _temp_prefix(name)
    try:
        for p in directory.glob(f"{glob.escape(prefix)}*.tmp"):
            if not _TEMP_TAIL.fullmatch(p.name[len(prefix):]):
                continue
            try:
                if p.is_file() and now - p.stat().st_mtime > STALE_SECONDS:
                    p.unlink()
            except OSError:
                pass
    except OSError:
        pass


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *,
                       key: str = "path") -> Path:
    """Write ``data`` to ``path`` atomically (see the module doc); returns the path written
    (a symlink's target when ``path`` is a link). ``key`` names the setting in errors."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise AutoParallelTypeError(key, os.fspath(path) if isinstance(path, (str, os.PathLike))
                                    else path, "cannot be written: the data must be bytes, "
                                    f"found a {type(data).__name__}")
    target = _target(path, key)
    directory = target.parent if str(target.parent) else Path(".")
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    _clean_stale(directory, target.name)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(target.name), suffix=".tmp",
                                   dir=directory)
    except OSError as e:
        raise AutoParallelError(key, os.fspath(path), f"cannot be written: "
                                f"{e.strerror or e}") from None
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise AutoParallelError(key, os.fspath(path), f"cannot be written: "
                                    f"{e.strerror or e}") from None
        raise
    return target


def write_text_atomic(path: str | os.PathLike[str], text: str, *, key: str = "path") -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`write_bytes_atomic`)."""
    where = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
    if not isinstance(text, str):
        raise AutoParallelTypeError(key, where, "cannot be written: the text must be a str, "
                                    f"found a {type(text).__name__}")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise AutoParallelError(key, where, f"cannot be written: the text holds "
                                f"{e.object[e.start:e.end]!r} at {e.start}, which UTF-8 "
                                "cannot encode (a lone surrogate)") from None
    return write_bytes_atomic(path, data, key=key)


def read_bytes_capped(path: str | os.PathLike[str], limit: int,
                      error: Callable[[str, Any], Exception] | None = None) -> bytes:
    """The bytes of the regular file ``path``, refusing more than ``limit``.

    ``error(expected, found)`` builds the exception to raise (default: an
    :class:`AutoParallelError` on key ``path``)."""
    def fail(expected: str, found: Any) -> Exception:
        if error is not None:
            return error(expected, found)
        return AutoParallelError("path", os.fspath(path), f"expected {expected}; found {found}")

    try:  # non-blocking: opening a FIFO with no writer must not wait
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise fail("a readable file", "missing (no such file)") from None
    except OSError as e:
        raise fail("a readable file", e.strerror or str(e)) from None
    except ValueError:  # os.open refuses a NUL byte in the path
        raise fail("a path without NUL bytes", "a NUL byte in the path") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise fail("a regular file", "a directory" if stat.S_ISDIR(st.st_mode) else
                   "not a regular file (a FIFO, device or socket)")
    with os.fdopen(fd, "rb") as fh:
        if st.st_size > limit:
            raise fail(f"at most {limit} bytes", f"{st.st_size} bytes")
        try:
            data = fh.read(limit + 1)
        except OSError as e:
            raise fail("a readable file", e.strerror or str(e)) from None
    if len(data) > limit:
        raise fail(f"at most {limit} bytes", "a file still growing past it")
    return data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def require_finite(named: Any, hint: str) -> None:
    """Every ``(name, number)`` of ``named`` is finite, else an :class:`AutoParallelError`
    naming the first that is not: what a JSON file (a Chrome trace) is about to hold, since
    JSON has no NaN or Infinity; ``hint`` says where such a number comes from."""
    for name, x in named:
        if not math.isfinite(x):
            raise AutoParallelError("trace", f"{name} = {x}", "every simulated time must be "
                                    "finite to write a Chrome trace (JSON has no NaN or "
                                    "Infinity)", hint)


def _finite_float(text: str) -> float:
    """A JSON number as a float; one too large for a float (``1e999``) is refused, not read
    as infinity (which no autopar file holds and no JSON writer accepts back)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of a float's range")
    return value


def read_json(path: str | os.PathLike[str], *, limit: int, error: type[FileFieldError]
              ) -> Any:
    """The JSON a file holds, read with :func:`read_bytes_capped` (a regular file, at most
    ``limit`` bytes) and parsed strictly (UTF-8, no NaN or Infinity, no duplicate keys,
    depth-safe); every failure an ``error(path, field, expected, found)``."""
    raw = read_bytes_capped(path, limit, lambda expected, found: error(path, "<file>",
                                                                       expected, found))
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates,
                          parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(path, "<json>", "a complete JSON document (truncated or corrupted "
                    "file?)", str(e)[:200]) from None


def read_json_document(path: str | os.PathLike[str], *, fmt: str, version: int, limit: int,
                       error: type[FileFieldError]) -> dict[str, Any]:
    """The JSON object of a versioned autopar file (strategy file, calibration), read by
    :func:`read_json`, its ``format`` and integer ``version`` checked."""
    data = read_json(path, limit=limit, error=error)
    if not isinstance(data, dict):
        raise error(path, "<root>", "a JSON object", type(data).__name__)
    if data.get("format") != fmt:
        raise error(path, "format", repr(fmt), data.get("format", "<missing>"))
    found = data.get("version", "<missing>")
    if type(found) is not int or found != version:
        raise error(path, "version", f"the integer {version} (the version this autopar "
                    "reads)", repr(found))
    return data


def validation_failure(err: Any, prefix: str = "") -> tuple[str, str, Any]:
    """(dotted field, rule, value found) of a pydantic ValidationError's first error."""
    _, field, found, msg = validation_problems(err, steps=False)[0]  # (keys are node names)
    loc = ".".join([*([prefix] if prefix else []), *([field] if field else [])])
    return loc or "<root>", msg.lower(), found
