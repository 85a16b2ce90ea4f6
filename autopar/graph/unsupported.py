"""Every JAX primitive of a function that autopar's tracer does not support, in one error.

When the tracer meets a primitive it has no operator kind for, :func:`unsupported_error`
walks the whole jaxpr -- the bodies the tracer inlines (jit, custom_jvp / custom_vjp, remat)
and the bodies of the unsupported loops and branches themselves -- and builds one
:class:`~autopar.errors.UnsupportedOperatorError` listing each distinct primitive, first met
first, with how many equations use it, the user's line of the first of them, the library
line that emitted it, and how to proceed.

The user's line is the innermost frame outside JAX, Python's standard library, autopar and
the installed packages (``site-packages`` / ``dist-packages``: flax, equinox, keras, optax,
haiku...): the line of the model that called the library, not the library's line where the
primitive was made (``flax/core/axes_scan.py``), which is named beside it.

>>> library_path("/venv/lib/python3.11/site-packages/flax/core/axes_scan.py")
'flax/core/axes_scan.py'
>>> installed("/venv/lib/python3.11/site-packages/flax/core/axes_scan.py"), installed("m.py")
(True, False)
"""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass
from typing import Any, Iterable

import jax
import jaxlib
from jax.extend.core import jaxprs_in_params

from autopar.errors import UnsupportedOperatorError
from autopar.graph.loops import LOOP_PRIMITIVES, while_length
from autopar.graph.ops import INLINED, KINDS, UNSUPPORTED_HINTS

__all__ = ["DEFAULT_HINT", "Unsupported", "body", "census", "installed", "library_path",
           "locate", "unsupported_error"]

#: how to proceed with a primitive that :data:`~autopar.graph.ops.UNSUPPORTED_HINTS` does
#: not name
DEFAULT_HINT = ("rewrite it with supported operators (see docs/graph.md), or keep it outside "
                "the function that autopar parallelises")
#: the most primitives the error lists one a line (the rest are named on one more line), and
#: the most its one-line summary spells out
SHOWN, SUMMARIZED = 8, 3
_PACKAGE_DIRS = ("site-packages", "dist-packages")


def _prefixes(*folders: str) -> tuple[str, ...]:
    """Each folder as a path prefix, as written and resolved, ending in its separator
    (``.../jax/`` must not match ``.../jax_triton``)."""
    out = [os.path.join(p, "") for f in folders for p in (f, os.path.realpath(f))]
    return tuple(dict.fromkeys(out))


_JAX = _prefixes(os.path.dirname(jax.__file__), os.path.dirname(jaxlib.__file__))
_PYTHON = _prefixes(*{sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib"),
                      os.path.dirname(os.__file__)})
_AUTOPAR = _prefixes(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def installed(path: str) -> bool:
    """Whether a source file is an installed package's (under ``site-packages`` or
    ``dist-packages``)."""
    return any(part in _PACKAGE_DIRS for part in re.split(r"[\\/]", path))


def _jax_or_python(path: str) -> bool:
    """JAX's own files and Python's (a virtual environment's packages live under its
    standard library folder: they are not Python's)."""
    return (path.startswith(_JAX) or path.startswith("<frozen")
            or (path.startswith(_PYTHON) and not installed(path)))


def _library(path: str) -> bool:
    """Not the user's: JAX's, Python's, autopar's or an installed package's."""
    return _jax_or_python(path) or installed(path) or path.startswith(_AUTOPAR)


def library_path(path: str) -> str:
    """A library file as its import path shows it: after the last ``site-packages``, or from
    ``autopar/``; any other file as given."""
    parts = re.split(r"[\\/]", path)
    cut = max((i for i, p in enumerate(parts) if p in _PACKAGE_DIRS), default=None)
    if cut is not None:
        return "/".join(parts[cut + 1:])
    if path.startswith(_AUTOPAR):
        return "autopar/" + path[len(next(p for p in _AUTOPAR if path.startswith(p))):]
    return path


@dataclass(frozen=True)
class _Frame:
    file: str
    line: int
    function: str

    def shown(self, short: bool = False) -> str:
        return f"{library_path(self.file) if short else self.file}:{self.line} ({self.function})"


def _frames(eqn: Any) -> list[_Frame]:
    """The Python frames where an equation was made, innermost first (the line of each is
    where its expression starts, as JAX's own source summaries read it)."""
    tb = getattr(getattr(eqn, "source_info", None), "traceback", None)
    if tb is None:
        return []
    codes, lastis = tb.raw_frames()
    return [_Frame(c.co_filename, tb.code_addr2location(c, i)[0],
                   getattr(c, "co_qualname", c.co_name)) for c, i in zip(codes, lastis)]


def locate(chain: Iterable[Any]) -> tuple[str, str | None]:
    """(the user's line, the library line that emitted the primitive, or None when the user's
    own line did) of an equation given with the calls around it, innermost first: inside a
    call's body an equation's traceback stops at the body, the call's continues it. Where no
    frame is the user's (a model of autopar's own zoo), the innermost outside JAX."""
    frames = [f for eqn in chain for f in _frames(eqn)]
    user = next((k for k, f in enumerate(frames) if not _library(f.file)), None)
    if user is None:
        inner = next((f for f in frames if not _jax_or_python(f.file)), None)
        return (inner.shown(short=True) if inner else "<unknown>"), None
    emitted = next((f for f in frames[:user] if installed(f.file)
                    and not _jax_or_python(f.file)), None)
    return frames[user].shown(), emitted.shown(short=True) if emitted else None


def body(eqn: Any) -> tuple[Any, list[Any]]:
    """The body (jaxpr, consts) of a call the tracer inlines
    (:data:`~autopar.graph.ops.INLINED`)."""
    inner = eqn.params[INLINED[eqn.primitive.name]]
    if callable(inner) and not hasattr(inner, "eqns") and not hasattr(inner, "jaxpr"):
        inner = inner()  # a thunk (custom_vjp_call_jaxpr in some versions)
    return (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, [])


def census(jaxpr: Any, refused: frozenset[int] = frozenset()
           ) -> dict[str, list[tuple[Any, ...]]]:
    """Each unsupported primitive of ``jaxpr`` (first met first) -> its equations, each with
    the calls around it (innermost first). Inlined bodies are walked as the tracer walks them;
    the bodies of unsupported loops and branches too (what they hold needs rewriting as well
    when the loop is unrolled)."""
    found: dict[str, list[tuple[Any, ...]]] = {}
    _walk(jaxpr, (), found, refused)
    return found


def _counted(eqn: Any, refused: frozenset[int]) -> bool:
    """A loop the tracer supports: a scan or cond; a while not ``refused`` (the tracer
    found its trip count unknown: ids of equations) and counted in shape
    (:func:`~autopar.graph.loops.while_length`, whatever its operands' values)."""
    if eqn.primitive.name != "while":
        return True
    return id(eqn) not in refused and while_length(eqn, lambda i: 0) is not None


def _walk(jaxpr: Any, outer: tuple[Any, ...], found: dict[str, list[tuple[Any, ...]]],
          refused: frozenset[int]) -> None:
    for eqn in jaxpr.eqns:
        prim, chain = eqn.primitive.name, (eqn, *outer)
        if prim in INLINED:
            _walk(body(eqn)[0], chain, found, refused)
        elif prim in LOOP_PRIMITIVES and _counted(eqn, refused):  # supported, body walked
            for sub in jaxprs_in_params(eqn.params):
                _walk(sub, chain, found, refused)
        elif prim not in KINDS:
            found.setdefault(prim, []).append(chain)
            for sub in jaxprs_in_params(eqn.params):
                _walk(sub, chain, found, refused)


@dataclass(frozen=True)
class Unsupported:
    """One unsupported primitive of a traced function: how many equations use it, the user's
    line of the first (``where``), the library line that emitted it (``emitted``, None when the
    user's line did) and how to proceed (``hint``)."""

    primitive: str
    count: int
    where: str
    emitted: str | None
    hint: str

    def line(self) -> str:
        """``'while' x2 at model.py:42 (forward), emitted in flax/...py:200 (fn): hint``."""
        times = f" x{self.count}" if self.count > 1 else ""
        lib = f", emitted in {self.emitted}" if self.emitted else ""
        return f"{self.primitive!r}{times} at {self.where}{lib}: {self.hint}"


def unsupported_error(jaxpr: Any, refused: frozenset[int] = frozenset()
                      ) -> UnsupportedOperatorError:
    """The one error naming every unsupported primitive of ``jaxpr`` (see the module), the
    ``while`` loops the tracer ``refused`` (ids of equations) among them."""
    items = []
    for prim, chains in census(jaxpr, refused).items():
        where, emitted = locate(chains[0])
        hint = UNSUPPORTED_HINTS.get(prim, DEFAULT_HINT).rstrip(".")
        items.append(Unsupported(prim, len(chains), where, emitted, hint))
    if len(items) == 1:
        u = items[0]
        lib = f", emitted in {u.emitted}," if u.emitted else ""
        times = f" ({u.count} equations; the first is named)" if u.count > 1 else ""
        text = (f"JAX primitive {u.primitive!r} at {u.where}{lib} is not supported by "
                f"autopar's tracer{times}. How to proceed: {u.hint}.")
        return UnsupportedOperatorError(text, items, text)
    head = (f"{len(items)} JAX primitives ({sum(u.count for u in items)} equations) are not "
            "supported by autopar's tracer")
    lines = [f"  {u.line()}." for u in items[:SHOWN]]
    rest = items[SHOWN:]
    if rest:
        lines.append(f"  ... and {len(rest)} more: " + ", ".join(
            f"{u.primitive!r}" + (f" x{u.count}" if u.count > 1 else "") for u in rest) + ".")
    summary = "; ".join(u.line() for u in items[:SUMMARIZED])
    if len(items) > SUMMARIZED:
        summary += f"; and {len(items) - SUMMARIZED} more (autopar.trace lists each)"
    return UnsupportedOperatorError(f"{head}. How to proceed with each:\n" + "\n".join(lines),
                                    items, f"{head}: {summary}.")
