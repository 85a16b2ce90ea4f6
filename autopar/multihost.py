"""What the processes of one ``jax.distributed`` job must agree on, and how they agree.

Every process of a job runs the same program of collectives. A cost model, a plan or a
measurement loop that differs between processes makes them run different programs: the
job hangs in a collective, or computes with mismatched layouts. Each process resolves its
own cluster (its own ``AUTOPAR_CLUSTER``, its own calibration cache, its own clock), so
the decisions are taken by process 0 and shared:

- :func:`agree_flag` and :func:`agree_text`: process 0's value, on every process;
  :func:`agree_made`: what process 0 alone makes (its error, raised on every process);
- :func:`check_same`: every process's text compared with process 0's, by digest; where
  any differs, every process raises the same :class:`~autopar.errors.AutoParallelError`
  (none of them goes on into a step the others would not run);
- :func:`together` / :func:`agreeing`: the scope where every process runs the same code in
  step -- building one program (``parallelize``, ``train_step``, the pipelined step) -- so
  the decisions taken there may be agreed. Outside it (``autopar.search``, a simulation, a
  comparison, perhaps on process 0 alone) each process decides for itself: a collective
  that only some processes reach would wait forever.

In a single process (or before ``jax.distributed.initialize``) each is the identity and
runs no JAX computation.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import numpy as np

from autopar.errors import AutoParallelError

__all__ = ["agree_flag", "agree_made", "agree_text", "agreeing", "check_same", "is_lead",
           "several", "together"]

_TOGETHER: ContextVar[bool] = ContextVar("autopar_processes_together", default=False)


def several() -> bool:
    """True inside a ``jax.distributed`` job of more than one process."""
    import jax

    return bool(jax.distributed.is_initialized()) and jax.process_count() > 1


def is_lead() -> bool:
    """True on process 0 (and in a single process): the one that writes and reports."""
    import jax

    return not several() or jax.process_index() == 0


@contextmanager
def together() -> Iterator[None]:
    """The scope of code every process of a job runs in step (see the module doc)."""
    token = _TOGETHER.set(True)
    try:
        yield
    finally:
        _TOGETHER.reset(token)


def agreeing() -> bool:
    """True inside :func:`together` in a job of several processes: decide as process 0."""
    return _TOGETHER.get() and several()


def _broadcast(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x))


def agree_flag(flag: bool) -> bool:
    """Process 0's ``flag`` (a collective: every process must ask, in the same order)."""
    if not several():
        return bool(flag)
    return bool(_broadcast(np.array([bool(flag)], np.int32))[0])


def agree_text(text: str) -> str:
    """Process 0's ``text`` (a collective: every process must ask, in the same order)."""
    if not several():
        return text
    data = np.frombuffer(text.encode(), np.uint8)
    size = int(_broadcast(np.array([data.size], np.int32))[0])
    buf = np.zeros(size, np.uint8)
    if is_lead():
        buf[:] = data
    return bytes(_broadcast(buf).astype(np.uint8)).decode()


def agree_made(make: Callable[[], str]) -> str:
    """Process 0's ``make()``, made on process 0 alone, on every process (a collective).

    Where ``make`` raises on process 0, every process raises (the others an
    :class:`~autopar.errors.AutoParallelError` with process 0's message): none waits for a
    text that will not come."""
    if not several():
        return make()
    text, error = "", None
    if is_lead():
        try:
            text = "ok " + make()
        except Exception as e:  # every process must leave the collective below
            text, error = f"error {e}", e
    agreed = agree_text(text)
    if error is not None:
        raise error
    if agreed.startswith("error "):
        raise AutoParallelError(f"on process 0: {agreed[len('error '):]}")
    return agreed[len("ok "):]


def check_same(text: str, key: str, what: str) -> None:
    """Raise on every process when any process's ``text`` differs from process 0's.

    ``key`` / ``what`` name it in the error (e.g. ``"plan"``, ``"the strategy file
    text"``)."""
    if not several():
        return
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(digest.astype(np.int32)))
    other = [i for i in range(1, every.shape[0]) if not np.array_equal(every[i], every[0])]
    if other:
        raise AutoParallelError(
            key, f"process(es) {other}", f"{what} differs from process 0's: every process of "
            "a jax.distributed job must build the same one (the same function, shapes, "
            "context and strategy files on each)")
