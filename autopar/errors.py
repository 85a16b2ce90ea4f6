"""One error hierarchy for autopar.

Every error autopar raises for bad user input derives from :class:`AutoparError`.
Value problems are :class:`AutoParallelError` (a ``ValueError``, which is what a MindSpore
user expects from ``set_auto_parallel_context``); wrong types are
:class:`AutoParallelTypeError` (a ``TypeError``). A message names the rule, the value
received, where (key, node name, source line) and how to fix it.

>>> try:
...     raise AutoParallelError("device_num", 0, "must be an int in [1, 4096]")
... except ValueError as e:
...     print(e)
device_num=0 is invalid: must be an int in [1, 4096].
"""

from __future__ import annotations

import math
import reprlib
import sys
from typing import Any, Iterable

__all__ = [
    "AutoparError",
    "AutoParallelError",
    "AutoParallelTypeError",
    "UnknownKeyError",
    "ContextConflictError",
    "CommGroupError",
    "UnsupportedOperatorError",
    "FileFieldError",
    "MemoryBudgetError",
    "AutoParallelWarning",
    "validation_problems",
    "from_validation_problem",
    "safe_repr",
    "same_value",
    "user_stacklevel",
]


class AutoparError(Exception):
    """Root of every error autopar raises on purpose."""


class _Bounded(reprlib.Repr):
    """``reprlib``'s bounded repr (6 levels deep, 160 characters a string or object), whose
    int says its size where Python refuses to write it (past 4,300 digits)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = self.maxlong = 160

    def repr_int(self, x: int, level: int) -> str:
        try:
            return super().repr_int(x, level)
        except ValueError:
            digits = int(abs(x).bit_length() * math.log10(2)) + 1
            return f"<{'a negative' if x < 0 else 'an'} int of about {digits} digits>"


_BOUNDED = _Bounded()


def safe_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)`` on one line (an array's repr spans several), cut to ``limit``
    characters (a 400-digit int, a huge list); never raises. Where Python's own ``repr``
    fails (an int past 4,300 digits, a value nested 1,000 deep, a ``__repr__`` that raises)
    a bounded one (:mod:`reprlib`), then the type's name. What every error message shows of
    a user's value.

    >>> safe_repr(10 ** 5000)
    '<an int of about 5001 digits>'
    >>> nest = []
    >>> for _ in range(100_000):
    ...     nest = [nest]
    >>> safe_repr(nest)
    '[[[[[[...]]]]]]'
    """
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - ValueError, RecursionError, a user's __repr__
        try:
            text = _BOUNDED.repr(value)
        except Exception:  # noqa: BLE001 - a user's __repr__ below the first level
            text = f"<a {type_name(value)}>"
    text = text.replace("\n", " ").replace("\r", " ")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


_shown = safe_repr


def same_value(a: Any, b: Any) -> bool:
    """Whether two values a user gave for one setting agree (``a == b``), never raising: a
    NumPy array compares element by element, and the truth of its answer is ambiguous (an
    array agrees with no other value).

    >>> import numpy as np
    >>> same_value("a", "a"), same_value(np.array([1, 2]), "a"), same_value([1], [1])
    (True, False, True)
    """
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - ValueError of an array's truth, a user's __eq__
        return a is b


def _format(key: str | None, value: Any, rule: str, hint: str | None) -> str:
    head = f"{key}={_shown(value)} is invalid" if key is not None else \
        f"{_shown(value)} is invalid"
    msg = f"{head}: {rule.rstrip('.')}."
    if hint:
        msg += f" {hint.rstrip('.')}."
    return msg


def found(item: Any, at: str = "") -> str:
    """How a rule names the offending element of a container: its value, its type, where it is.

    >>> found("a", "[1]")
    "found 'a' (str) at [1]"
    """
    return f"found {_shown(item, 80)} ({type_name(item)})" + (f" at {at}" if at else "")


def type_name(value: Any) -> str:
    """The name of ``value``'s type, with its module where that is not Python's own:
    numpy's bool is ``numpy.bool``, not a ``bool``.

    >>> type_name(True), type_name(range(2)), type_name(Ellipsis)
    ('bool', 'range', 'ellipsis')
    """
    t = type(value)
    mod = t.__module__.split(".")[0]
    return t.__name__ if mod == "builtins" else f"{mod}.{t.__name__}"


class _Keyed(AutoparError):
    """Built either from a ready message (one argument) or from ``(key, value, rule[, hint])``."""

    def __init__(self, key_or_message: str, value: Any = ..., rule: str | None = None,
                 hint: str | None = None) -> None:
        if value is ... and rule is None:
            self.key: str | None = None
            self.value: Any = None
            super().__init__(key_or_message)
        else:
            self.key = key_or_message
            self.value = value
            super().__init__(_format(key_or_message, value, self._rule(rule, value), hint))

    @staticmethod
    def _rule(rule: str | None, value: Any) -> str:
        return rule or "not allowed"


class AutoParallelError(_Keyed, ValueError):
    """A value is out of range, not allowed, or conflicts with another setting."""


class AutoParallelTypeError(_Keyed, TypeError):
    """A value has the wrong type (``True`` where an int is needed included)."""

    @staticmethod
    def _rule(rule: str | None, value: Any) -> str:
        if rule and "found " in rule:  # the rule names the offending element (see found())
            return rule
        return f"{rule or 'wrong type'} (got {type_name(value)})"


class UnknownKeyError(AutoParallelError):
    """A key that is not an attribute of the auto-parallel context (or of a nested dict)."""


class FileFieldError(AutoParallelError):
    """A file that cannot be used: names the file, the field, expected vs found (subclasses
    say which kind of file)."""

    what = "file"

    def __init__(self, path: Any, field: str, expected: str, found: Any) -> None:
        self.path, self.field, self.expected, self.found = str(path), field, expected, found
        text = found[:200] + ("..." if len(found) > 200 else "") if isinstance(found, str) \
            else safe_repr(found)
        super().__init__(f"{self.what} {safe_repr(str(path))}: field {safe_repr(field)}: "
                         f"expected {expected}; found {text}")


class ContextConflictError(AutoParallelError):
    """Settings that are each valid but cannot be used together (found by resolve_context)."""


class CommGroupError(AutoParallelError):
    """A communication-group rule is broken (unknown group, caller rank not a member, ...)."""


class UnsupportedOperatorError(AutoParallelError):
    """JAX primitives autopar cannot partition: every one of the traced function, each with
    its count, the user's source line, the library line that emitted it and how to proceed.
    ``unsupported``: those records (``primitive``, ``count``, ``where``, ``emitted``,
    ``hint``), first met first; ``summary``: the message on one line (the command line's)."""

    def __init__(self, message: str, unsupported: Iterable[Any] = (),
                 summary: str | None = None) -> None:
        super().__init__(message)
        self.unsupported = tuple(unsupported)
        self.summary = summary or " ".join(message.split())


class AutoParallelWarning(UserWarning):
    """A setting that is valid but has no effect, or less effect than asked, in this mode."""


def validation_problems(err: Any, *, steps: bool = True) -> list[tuple[str, str, Any, str]]:
    """(kind, dotted field, value found, message) of each problem of a pydantic
    ``ValidationError`` (read through its ``errors()``: this module imports no pydantic): the
    field without pydantic's own steps (``function-after[...]``, a union member such as
    ``int`` or ``tuple[int, ...]``; ``steps=False`` keeps every part, for models whose dict
    keys are the user's, a node named ``block[0]/dot_general_0``), the message without its
    ``Value error, `` prefix, the value of a missing field ``'<missing>'``. The one reading
    of pydantic's errors."""
    out = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"] if not (steps and _pydantic_step(str(p))))
        msg = str(e["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        value = "<missing>" if e["type"] == "missing" else e.get("input", "<missing>")
        out.append((str(e["type"]), loc, value, msg))
    return out


def _pydantic_step(part: str) -> bool:
    return part.startswith("function-") or "[" in part or part in (
        "int", "float", "str", "bool", "list", "tuple", "dict", "none")


def from_validation_problem(problems: list[tuple[str, str, Any, str]], where: str,
                            fields: Iterable[str] = ()) -> AutoparError:
    """autopar's typed error for the first of :func:`validation_problems` met building
    ``where`` (``where.field=value is invalid: rule``; the others counted in the message):
    an unknown field is an :class:`UnknownKeyError` naming ``fields``, a wrong type an
    :class:`AutoParallelTypeError`, anything else an :class:`AutoParallelError`."""
    kind, loc, value, msg = problems[0]
    key = f"{where}.{loc}" if loc else where
    more = f" ({len(problems) - 1} more problem(s): " + "; ".join(
        f"{k}: {m}" for _, k, _, m in problems[1:]) + ")" if len(problems) > 1 else ""
    if kind == "extra_forbidden":
        return UnknownKeyError(f"{loc.split('.')[-1]!r} is not a field of {where}. Fields: "
                               f"{', '.join(sorted(fields))}.")
    if kind.endswith("_type") or kind == "autopar_type":
        return AutoParallelTypeError(key, value, f"{msg}{more}")
    return AutoParallelError(key, value, f"{msg}{more}")


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller point at the
    first frame outside autopar: the user's line, however deep inside autopar it was issued
    (``search``, ``parallelize``, ``train_step`` and a pipelined step's stages all plan)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and _ours(str(frame.f_globals.get("__name__", ""))):
        level, frame = level + 1, frame.f_back
    return level


def _ours(module: str) -> bool:
    return module == "autopar" or module.startswith("autopar.")


class MemoryBudgetError(AutoParallelError):
    """No plan fits the cluster's memory per device. ``needed`` / ``budget``: the bytes per
    device of the plan that came closest and the budget; ``lower_bound``: what the state
    alone needs at the most sharded layout (or None); ``fits``: the knobs tried that make it
    fit, as ``{setting: bytes per device}`` (:mod:`autopar.strategies.fit`)."""

    def __init__(self, message: str, *, needed: float, budget: float,
                 lower_bound: float | None = None, fits: dict | None = None) -> None:
        super().__init__(message)
        self.key, self.value = "memory", needed
        self.needed, self.budget, self.lower_bound = needed, budget, lower_bound
        self.fits = dict(fits or {})
