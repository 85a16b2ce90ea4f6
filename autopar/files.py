"""The one writer and the one reader of autopar's files (strategy files, calibrations,
traces, reports, pictures).

Writing (:func:`write_bytes_atomic`, :func:`write_text_atomic`): the bytes go to a temporary
file of a unique name beside the target (``.<name>.<random>.tmp``), are flushed to disk, and
replace the target in one ``os.replace``: a reader sees the old file or the new one, never a
part. The target must be a regular file or absent: a directory (or a path ending in a
separator), a FIFO, a device or a socket is refused before anything is written, and so is a
path through a link under /dev or into /proc (``/dev/stdout`` resolves to the file the
output is redirected to). A symlink is written through (its target is replaced, the link
stays). An existing file keeps its mode (and, written by root, its owner); a new one gets
``0o666`` less the umask, applied by the kernel as the temporary is created (the umask is
never read: reading it sets it for a moment for every thread). On any failure the temporary
file is removed and the target is untouched; temporaries of the same name pattern left by a
killed writer (older than a minute) are removed by the next save. Errors are
:class:`AutoParallelError` naming the target and the reason, never the hidden temporary.

A set of files (:func:`write_files_atomic`: a pipelined step's stage strategy files, a
comparison's report) is written all or nothing: every temporary first, then each replaces
its target; a failure puts back the files already replaced.

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

import errno
import glob
import json
import math
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from autopar.errors import (AutoParallelError, AutoParallelTypeError, FileFieldError,
                            type_name, validation_problems)

__all__ = ["STALE_SECONDS", "read_bytes_capped", "read_json", "read_json_document",
           "path_text", "validation_failure",
           "writable_target", "require_finite",
           "write_bytes_atomic", "write_files_atomic", "write_text_atomic"]

#: A temporary file of ours this old was left by a writer that died: the next save removes it.
STALE_SECONDS = 60.0


def path_text(path: Any, key: str) -> str:
    """The text of a path given for ``key``: a non-empty str, or an ``os.PathLike`` whose
    ``__fspath__`` returns one; anything else (bytes, a ``__fspath__`` that fails or returns
    no str) an :class:`AutoParallelTypeError` naming ``key``."""
    text: Any = path
    if isinstance(path, os.PathLike):
        try:
            text = os.fspath(path)
        except Exception:  # noqa: BLE001 - a user's __fspath__: returns no str, or raises
            text = None
    if not isinstance(text, str) or not text:
        raise AutoParallelTypeError(key, path, "a non-empty path (a str, or an os.PathLike "
                                    "whose __fspath__ returns one)")
    return text


def _where(path: Any) -> Any:
    """What an error shows of a path: its text where it has one, else the value itself."""
    try:
        return path_text(path, "path")
    except AutoParallelTypeError:
        return path


def _target(path: Any, key: str) -> Path:
    text = path_text(path, key)
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


#: The random part a temporary file's name has between our prefix and ``.tmp`` (as
#: ``tempfile.mkstemp`` made them): only names of exactly this shape are ours to remove (a
#: user's ``.s.json.backup.tmp`` is not)
_TEMP_TAIL = re.compile(r"[a-z0-9_]{8}\.tmp")
_TEMP_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789_"


def _clean_stale(directory: Path, name: str) -> None:
    """Remove our temporary files of ``name`` older than :data:`STALE_SECONDS` (a killed
    writer's): names of :data:`_TEMP_TAIL`'s shape after our prefix, nothing else."""
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


def _data_bytes(path: Any, data: Any, key: str) -> bytes:
    """``data`` as the bytes to write: bytes as given, text as UTF-8; anything else (and
    text UTF-8 cannot encode) a typed error naming ``path``."""
    where = _where(path)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if not isinstance(data, str):
        raise AutoParallelTypeError(key, where, "cannot be written: the data must be bytes "
                                    f"or text, found a {type(data).__name__}")
    try:
        return data.encode("utf-8")
    except UnicodeEncodeError as e:
        raise AutoParallelError(key, where, f"cannot be written: the text holds "
                                f"{e.object[e.start:e.end]!r} at {e.start}, which UTF-8 "
                                "cannot encode (a lone surrogate)") from None


def _new_temp(target: Path, like: os.stat_result | None) -> tuple[int, Path]:
    """A new temporary file beside ``target`` (``.<name>.<8 random>.tmp``), open for
    writing. Made by ``os.open(O_CREAT | O_EXCL)``: a new target's gets ``0o666`` less the
    umask, applied by the kernel (reading the umask would set it process-wide for a moment,
    which other threads see); an existing target's (``like``) gets its mode and, written by
    root, its owner."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for tmp in _temp_names(target):
        try:
            fd = os.open(tmp, flags, 0o666 if like is None else 0o600)
            break
        except FileExistsError:
            continue
    if like is not None:
        try:
            _keep_owner(fd, like)
            os.fchmod(fd, stat.S_IMODE(like.st_mode))  # (after fchown, which clears set-id)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
    return fd, tmp


def _keep_owner(fd: int, like: os.stat_result) -> None:
    """Give the file ``fd`` the owner and group of ``like`` (the file it will replace)
    where they differ and this process may: root keeps another user's file theirs; another
    user keeps the file's group when it is one of theirs."""
    if (like.st_uid, like.st_gid) == (os.geteuid(), os.getegid()):
        return
    if os.geteuid() == 0:
        os.fchown(fd, like.st_uid, like.st_gid)
        return
    if like.st_uid == os.geteuid():
        try:
            os.fchown(fd, -1, like.st_gid)
        except OSError:  # (not one of this user's groups: the file gets the user's own)
            pass


def _write_temp(target: Path, data: bytes) -> Path:
    """A temporary file beside ``target`` holding ``data``, flushed to disk."""
    try:
        like: os.stat_result | None = target.stat()
    except FileNotFoundError:
        like = None
    _clean_stale(target.parent if str(target.parent) else Path("."), target.name)
    fd, tmp = _new_temp(target, like)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _temp_names(target: Path) -> Iterator[Path]:
    """Fresh names for temporary files beside ``target``: ``.<name>.<8 random>.tmp`` (the
    shape :func:`_clean_stale` removes); FileExistsError after 100 taken ones."""
    directory = target.parent if str(target.parent) else Path(".")
    for _ in range(100):
        tail = "".join(secrets.choice(_TEMP_ALPHABET) for _ in range(8))
        yield directory / f"{_temp_prefix(target.name)}{tail}.tmp"
    raise FileExistsError(errno.EEXIST, "no free name for a temporary file", str(target))


def _backup(target: Path) -> Path | None:
    """A second name for ``target``'s file as it is (a hard link; a copy where links are
    not allowed), so that a set that fails after replacing it can put it back; None for a
    target that does not exist."""
    if not target.exists():
        return None
    for name in _temp_names(target):
        try:
            os.link(target, name)
            return name
        except FileExistsError:
            continue
        except OSError:  # (a file system without links, or another user's file)
            break
    return _write_temp(target, target.read_bytes())


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_files_atomic(files: Sequence[tuple[Any, Any, str]]) -> list[Path]:
    """Write a set of files all or nothing: ``files`` holds ``(path, data, key)`` each
    (``data`` bytes, or text written as UTF-8; ``key`` names the setting in errors); returns
    the paths written (a symlink's target where a path is a link).

    Every target is checked first, then every temporary file is written and flushed (a full
    disk fails here, before any target is touched), then each replaces its target in turn.
    Where any step fails, the targets already replaced get their old files back (a new one
    is removed), every temporary file is removed, and the error (an
    :class:`AutoParallelError`) names the file that failed: the files are all new or all as
    they were. Each file is written as :func:`write_bytes_atomic` writes one."""
    items = [(_target(path, key), _data_bytes(path, data, key), key,
              path_text(path, key)) for path, data, key in files]
    seen: set[str] = set()
    for target, _, key, shown in items:
        if os.path.realpath(target) in seen:
            raise AutoParallelError(key, shown, "is named twice in one set of files written "
                                    "together; give each file its own path")
        seen.add(os.path.realpath(target))
    temps: list[Path] = []
    backups: list[Path | None] = []
    done: list[tuple[Path, Path | None]] = []
    failed = items[0] if items else None
    try:
        for item in items:
            failed = item
            temps.append(_write_temp(item[0], item[1]))
        for k, item in enumerate(items):  # (the last is never put back: no backup needed)
            failed = item
            backups.append(_backup(item[0]) if k < len(items) - 1 else None)
        for item, tmp, backup in zip(items, temps, backups):
            failed = item
            os.replace(tmp, item[0])
            done.append((item[0], backup))
    except BaseException as e:
        _undo(done, temps, backups)
        if isinstance(e, OSError) and failed is not None:
            raise AutoParallelError(failed[2], failed[3], f"cannot be written: "
                                    f"{e.strerror or e}" + (
                                        " (no file of the set was changed)"
                                        if len(items) > 1 else "")) from None
        raise
    for backup in backups:
        if backup is not None:
            _unlink(backup)
    return [item[0] for item in items]


def _undo(done: list[tuple[Path, Path | None]], temps: list[Path],
          backups: list[Path | None]) -> None:
    """Put back what a failed :func:`write_files_atomic` replaced (last first), and remove
    its temporary files and backups."""
    for target, backup in reversed(done):
        try:
            if backup is None:
                os.unlink(target)  # (it was new)
            else:
                os.replace(backup, target)
        except OSError:
            pass
    for p in [*temps, *(b for b in backups if b is not None)]:
        _unlink(p)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *,
                       key: str = "path") -> Path:
    """Write ``data`` to ``path`` atomically (see the module doc); returns the path written
    (a symlink's target when ``path`` is a link). ``key`` names the setting in errors."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise AutoParallelTypeError(key, _where(path), "cannot be written: the data must be bytes, "
                                    f"found a {type(data).__name__}")
    return write_files_atomic([(path, data, key)])[0]


def write_text_atomic(path: str | os.PathLike[str], text: str, *, key: str = "path") -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`write_bytes_atomic`)."""
    where = _where(path)
    if not isinstance(text, str):
        raise AutoParallelTypeError(key, where, "cannot be written: the text must be a str, "
                                    f"found a {type(text).__name__}")
    return write_files_atomic([(path, text, key)])[0]


def read_bytes_capped(path: str | os.PathLike[str], limit: int,
                      error: Callable[[str, Any], Exception] | None = None) -> bytes:
    """The bytes of the regular file ``path``, refusing more than ``limit``.

    ``error(expected, found)`` builds the exception to raise (default: an
    :class:`AutoParallelError` on key ``path``)."""
    def fail(expected: str, found: Any) -> Exception:
        if error is not None:
            return error(expected, found)
        return AutoParallelError("path", _where(path), f"expected {expected}; found {found}")

    try:  # non-blocking: opening a FIFO with no writer must not wait
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise fail("a readable file", "missing (no such file)") from None
    except OSError as e:
        raise fail("a readable file", e.strerror or str(e)) from None
    except ValueError:  # os.open refuses a NUL byte in the path
        raise fail("a path without NUL bytes", "a NUL byte in the path") from None
    except TypeError:  # (not a path, or an os.PathLike whose __fspath__ returns no str)
        raise fail("a path (a str, or an os.PathLike whose __fspath__ returns one)",
                   f"a {type_name(path)}") from None
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
