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
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from autopar.errors import AutoParallelError, safe_repr

__all__ = ["agree_flag", "agree_made", "agree_text", "agreeing", "check_same", "is_lead",
           "end_first", "join", "leave", "several", "together"]

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


# ---------------------------------------------------------------------------- forming the job


#: What the processes say first on the coordinator's port (a program that does not is not
#: one of the job's processes), and the seconds each waits for the other end's first words.
_PROTOCOL = "autopar-job/1"
_HELLO_S = 10.0
#: Seconds a process that said it failed may take to end by itself before its peers stop.
_GRACE_S = 3.0


def join(coordinator: str, num_processes: int, process_id: int, *, timeout_s: float = 60.0,
         facts: Mapping[str, Any] | None = None,
         on_lost: Callable[[str, int], Any] | None = None) -> None:
    """Form the ``jax.distributed`` job of ``num_processes`` processes at ``coordinator``
    (``HOST:PORT``) as process ``process_id``, then initialize JAX's runtime, and watch the
    job until :func:`leave`.

    XLA's client aborts the process (``SIGABRT``, a C++ stack) when a job does not form, so
    the processes first meet on the coordinator's port: process 0 listens, the others
    connect and give their ``process_id``, ``num_processes`` and ``facts`` (the settings
    every process must share, by name, e.g. ``{"--devices": 8}``). A peer that never comes,
    a process 0 that never answers, another program on the port, two processes given one
    id, or settings that differ: every process raises one :class:`AutoParallelError` saying
    which process and why, within ``timeout_s``. Only then is
    ``jax.distributed.initialize`` called (its preemption service off: it caught
    ``SIGTERM``, so ``kill`` could not stop the job).

    Once joined, each process keeps a connection to process 0 (process 0 one to each
    other) and a thread watching it: a process that ends without :func:`leave` (killed, or
    failed), is stopped by ``SIGTERM`` / ``SIGINT``, or answers nothing for ``timeout_s``
    (stopped, hung) ends the job: every other process calls ``on_lost(message, status)``
    (default: the message on stderr, then ``os._exit(status)``) instead of waiting in a
    collective for it."""
    host, port = _address(coordinator)
    facts = {"--num-processes": num_processes, **(facts or {})}
    if process_id == 0:
        conns = _lead_handshake(host, port, num_processes, facts, timeout_s)
    else:
        conns = _peer_handshake(host, port, process_id, facts, timeout_s)
    global _WATCH
    _WATCH = _Watch(conns, process_id, timeout_s, on_lost or _lost_default)
    _WATCH.start()
    import jax

    jax.config.update("jax_enable_preemption_service", False)
    heartbeat = max(100, int(3 * timeout_s))  # (the watch's timeout comes first)
    with _service_apart(process_id, coordinator, num_processes, heartbeat, timeout_s):
        jax.distributed.initialize(coordinator, num_processes=num_processes,
                                   process_id=process_id,
                                   initialization_timeout=max(1, int(timeout_s)),
                                   heartbeat_timeout_seconds=heartbeat)


#: The process that serves JAX's coordination service for process 0 (:func:`_service_apart`)
_SERVICE = """
import os, sys, time
from jax._src.lib import _jax
service = _jax.get_distributed_runtime_service(
    sys.argv[1], int(sys.argv[2]), heartbeat_timeout=int(sys.argv[3]), shutdown_timeout=300)
print("ready", flush=True)
sys.stdin.buffer.read()  # until process 0 ends, however it ends
time.sleep(float(sys.argv[4]))  # the others end (their watch, or the shutdown) first
os._exit(0)
"""


@contextmanager
def _service_apart(process_id: int, coordinator: str, n: int, heartbeat: int,
                   timeout_s: float) -> Iterator[None]:
    """On process 0, JAX's coordination service runs in a process of its own while the
    block (``jax.distributed.initialize``) makes process 0's client. Served by process 0
    itself, the service died with it, and every other process's JAX client then logged a
    C++ error and terminated its process at once, racing the watch's one line; apart, it
    lives until process 0 has ended and the others have had the time to end (the watch
    ends them). Where this jaxlib has no such service to start apart, process 0 serves it
    as JAX does."""
    try:
        from jax._src import distributed as jax_distributed

        make = jax_distributed._jax.get_distributed_runtime_service
    except (ImportError, AttributeError):
        make = None
    if process_id != 0 or make is None:
        yield
        return
    bind = "[::]:" + coordinator.rpartition(":")[2]
    helper = subprocess.Popen([sys.executable, "-c", _SERVICE, bind, str(n), str(heartbeat),
                               str(2 * _GRACE_S)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    ready = selectors.DefaultSelector()
    ready.register(helper.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
    wait = max(timeout_s, 60.0)  # (a new Python importing jaxlib: seconds on a busy host)
    if not ready.select(timeout=wait) or helper.stdout.readline() != b"ready\n":
        helper.kill()
        raise AutoParallelError(f"process 0 could not start JAX's coordination service at "
                                f"{bind} within {wait:g} s")
    _HELPERS.append(helper)  # (its stdin, open until process 0 ends, keeps it serving)
    jax_distributed._jax.get_distributed_runtime_service = lambda *a, **k: _Apart()
    try:
        yield
    finally:
        jax_distributed._jax.get_distributed_runtime_service = make


class _Apart:
    """Process 0's handle on the service run apart: JAX shuts it down at exit; it ends by
    itself once process 0 has."""

    def shutdown(self) -> None:
        pass


_HELPERS: list[subprocess.Popen] = []


def leave(ok: bool = True) -> bool:
    """End this process's part in the job :func:`join` formed: ``ok``, its peers let it go;
    else they are told it failed (and stop, unless they end by themselves within a few
    seconds, as processes that all failed one check do). False (and nothing done) outside
    a job."""
    watch = _WATCH
    if watch is None:
        return False
    if not watch.claim("main"):  # (the watch found a process lost first: it ends this one)
        threading.Event().wait()
    watch.leave(b"bye\n" if ok else b"fail\n")
    return True


def end_first(wait_s: float = 0.0) -> bool:
    """Whether this process's main thread may say how the job ended (its error line): True
    outside a job, and where the job's watch found no lost process first -- within
    ``wait_s`` seconds (an unforeseen error is most often a collective that failed as a
    process ended: the watch names it). False: the watch is ending the process."""
    watch = _WATCH
    if watch is None:
        return True
    deadline = time.monotonic() + wait_s
    while watch.owner is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return watch.claim("main")


def _address(coordinator: str) -> tuple[str, int]:
    host, _, port = coordinator.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise AutoParallelError("coordinator", coordinator, "HOST:PORT, a port in [1, 65535]")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as e:
        raise AutoParallelError("coordinator", coordinator, f"cannot resolve {host!r} "
                                f"({e.strerror or e})") from None
    return host, int(port)


def _family(host: str, port: int) -> socket.AddressFamily:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]


class _Lines:
    """JSON messages, one a line, over a socket: what the handshake says."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def send(self, message: Mapping[str, Any]) -> None:
        try:
            self.sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            pass  # (the other end is gone: what it would have been told, it finds out)

    def read(self, seconds: float) -> dict[str, Any] | str:
        """The next message, or why there is none: ``"timeout"``, ``"closed"``, ``"garbage"``
        (not a message of ours: another program's bytes)."""
        deadline = time.monotonic() + seconds
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                return "timeout"
            except OSError:
                return "closed"
            if not data:
                return "closed"
            self.buf += data
            if len(self.buf) > 65536:
                return "garbage"
        line, _, self.buf = self.buf.partition(b"\n")
        try:
            message = json.loads(line)
        except ValueError:
            return "garbage"
        return message if isinstance(message, dict) else "garbage"


def _lead_handshake(host: str, port: int, n: int, facts: dict[str, Any],
                    timeout_s: float) -> dict[int, socket.socket]:
    """Process 0's side: every other process joins, or every one that did is told why not."""
    where = f"{host}:{port}"
    try:
        server = socket.create_server((host, port), family=_family(host, port))
    except OSError as e:
        raise AutoParallelError(f"process 0 cannot serve the job at {where} ("
                                f"{os.strerror(e.errno) if e.errno else e}): another "
                                "program, or another process "
                                "given --process-id 0, holds the port") from None
    peers: dict[int, _Lines] = {}
    deadline = time.monotonic() + timeout_s
    with server:
        while len(peers) < n - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k for k in range(1, n) if k not in peers]
                raise _refuse(peers, f"process(es) {missing} did not join process 0 at "
                              f"{where} within {timeout_s:g} s (not started, or given another "
                              "--coordinator?)")
            server.settimeout(min(left, 1.0))
            try:
                conn = _Lines(server.accept()[0])
            except socket.timeout:
                continue
            hello = conn.read(_HELLO_S)
            if not isinstance(hello, dict) or hello.get("protocol") != _PROTOCOL:
                conn.sock.close()  # (not one of the job's processes: a stray client)
                continue
            problem = _join_problem(hello, facts, peers, n)
            if problem:
                conn.send({"error": problem})
                conn.sock.close()
                raise _refuse(peers, problem)
            conn.send({"ok": True})
            peers[hello["process_id"]] = conn
    return _lead_watch(host, peers, timeout_s)


def _join_problem(hello: dict[str, Any], facts: dict[str, Any], peers: dict[int, Any],
                  n: int) -> str:
    """Why a process that says ``hello`` cannot join process 0's job ('' when it can)."""
    k, theirs = hello.get("process_id"), hello.get("facts")
    if type(k) is not int or not isinstance(theirs, dict):
        return f"a process gave no process id ({safe_repr(k)})"
    for name, ours in facts.items():
        if theirs.get(name) != ours:
            return (f"{name}: process {k} was given {safe_repr(theirs.get(name))}, process 0 "
                    f"{safe_repr(ours)}; give every process of the job the same")
    if not 0 < k < n:
        return f"--process-id: process 0 found a process given {k}, not in [1, {n})"
    if k in peers:
        return f"--process-id: two processes were given {k}; give each its own"
    return ""


def _refuse(peers: dict[int, _Lines], problem: str) -> AutoParallelError:
    """Tell every process that joined why the job does not form; the error to raise."""
    for conn in peers.values():
        conn.send({"error": problem})
        conn.sock.close()
    return AutoParallelError(f"the job did not form: {problem}")


def _lead_watch(host: str, peers: dict[int, _Lines], timeout_s: float
                ) -> dict[int, socket.socket]:
    """Every process joined: each connects to a port of process 0's own to be watched (the
    coordinator's port is JAX's from now on), then lets go of the coordinator's."""
    with socket.create_server((host, 0), family=_family(host, 0)) as server:
        for conn in peers.values():
            conn.send({"go": True, "watch": server.getsockname()[1]})
        watched: dict[int, socket.socket] = {}
        deadline = time.monotonic() + _HELLO_S
        while len(watched) < len(peers) and time.monotonic() < deadline:
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn = _Lines(server.accept()[0])
            except socket.timeout:
                break
            hello = conn.read(_HELLO_S)
            k = hello.get("process_id") if isinstance(hello, dict) else None
            if k in peers and k not in watched:
                watched[k] = conn.sock
            else:
                conn.sock.close()
    missing = sorted(set(peers) - set(watched))
    if missing:
        for sock in watched.values():
            sock.close()
        raise _refuse(peers, f"process(es) {missing} joined but did not stay (ended?)")
    for conn in peers.values():  # they close first: the port is left free for JAX
        conn.read(_HELLO_S)
        conn.sock.close()
    return watched


def _peer_handshake(host: str, port: int, me: int, facts: dict[str, Any],
                    timeout_s: float) -> dict[int, socket.socket]:
    """Another process's side: join process 0, or say why it cannot."""
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = _Lines(socket.create_connection((host, port), timeout=2))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise AutoParallelError(f"process {me}: no process 0 answered at {where} "
                                        f"within {timeout_s:g} s (not started, or given "
                                        "another --coordinator?)") from None
            time.sleep(0.25)
    with conn.sock:
        conn.send({"protocol": _PROTOCOL, "process_id": me, "facts": facts})
        answer = conn.read(_HELLO_S)
        if not isinstance(answer, dict) or not answer.get("ok") and "error" not in answer:
            raise AutoParallelError(f"process {me}: the program at {where} is not the job's "
                                    f"process 0 (its answer: {answer}); another program "
                                    "holds the port")
        if answer.get("ok"):
            answer = conn.read(max(0.0, deadline - time.monotonic()) + _HELLO_S)
        if isinstance(answer, dict) and "error" in answer:
            raise AutoParallelError(f"the job did not form: {answer['error']}")
        if not isinstance(answer, dict) or not isinstance(answer.get("watch"), int):
            raise AutoParallelError(f"process {me}: process 0 at {where} ended before the "
                                    f"job formed ({answer})")
        watch = socket.create_connection((host, answer["watch"]), timeout=_HELLO_S)
        _Lines(watch).send({"process_id": me})
    return {0: watch}


def _lost_default(message: str, status: int) -> None:
    print(f"autopar: error: {message}", file=sys.stderr, flush=True)
    os._exit(status)


class _Watch(threading.Thread):
    """The connections of a joined process to its peers (process 0's to every other, the
    others' to process 0), watched: pings every second, the peers' pings, goodbyes and
    failures read, and ``SIGTERM`` / ``SIGINT`` caught (through Python's wakeup fd: they
    arrive while the main thread waits in a collective)."""

    def __init__(self, conns: dict[int, socket.socket], me: int, stall_s: float,
                 on_lost: Callable[[str, int], Any]) -> None:
        super().__init__(name="autopar-job-watch", daemon=True)
        self.conns, self.me, self.stall_s, self.on_lost = conns, me, stall_s, on_lost
        self.heard = {k: time.monotonic() for k in conns}
        self.bufs = {k: b"" for k in conns}
        self.ended: set[int] = set()
        self.failing: dict[int, float] = {}
        self.done = threading.Event()
        self.lock = threading.RLock()  # (Python's signal handler may run while held)
        self.owner: str | None = None  # who ends the job: "main" (its line), "watch"
        self.wake_r, wake_w = socket.socketpair()
        wake_w.setblocking(False)
        self.wake_w = wake_w
        for k in conns:
            conns[k].setblocking(False)
        try:  # (the main thread only: it is, in the command)
            signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        except ValueError:
            pass

    def claim(self, who: str) -> bool:
        """Whether ``who`` ends the job (the first to ask does; the watch then stays quiet)."""
        with self.lock:
            if self.owner is None:
                self.owner = who
                self.done.set()
            return self.owner == who

    def _first(self) -> bool:
        """Whether the watch ends the job, and this is its only report (a signal arrives
        twice: through the wakeup fd and to Python's handler)."""
        with self.lock:
            if self.owner is not None:
                return False
            self.owner = "watch"
            self.done.set()
            return True

    def leave(self, word: bytes) -> None:
        self._send_all(word)

    def _send_all(self, data: bytes, but: int | None = None) -> None:
        with self.lock:
            for k, sock in self.conns.items():
                if k != but and k not in self.ended:
                    try:
                        sock.send(data)
                    except OSError:
                        pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stopped(signal.Signals(signum).name)

    def _stopped(self, name: str) -> None:
        """This process got ``SIGTERM`` / ``SIGINT``: its peers are told, it ends."""
        if self._first():
            self._send_all(f"stop stopped by {name}\n".encode())
            self.on_lost(f"process {self.me} stopped by {name}", 128 + getattr(
                signal, name, signal.SIGTERM).value)

    def _lost(self, k: int, why: str) -> None:
        if not self._first():
            return
        if self.me == 0:  # (the others know only process 0: tell them who)
            self._send_all(f"lost {k} {why}\n".encode(), but=k)
        self.on_lost(f"process {k} {why}; the job cannot go on without it", 1)

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        for k, sock in self.conns.items():
            sel.register(sock, selectors.EVENT_READ, k)
        sel.register(self.wake_r, selectors.EVENT_READ, None)
        beat = min(1.0, self.stall_s / 5)
        next_ping, last = 0.0, time.monotonic()
        while not self.done.is_set():
            for key, _ in sel.select(timeout=beat):
                self._read(sel, key)
            now = time.monotonic()
            if now - last > 3 * beat:  # this process was stopped itself: not the others
                self.heard = dict.fromkeys(self.heard, now)
            last = now
            if now >= next_ping:
                self._send_all(b"ping\n")
                next_ping = now + beat
            for k, t in list(self.failing.items()):
                if now - t > _GRACE_S:
                    self._lost(k, "ended with an error (its own output says which)")
            for k, t in self.heard.items():
                if k not in self.ended and k not in self.failing and now - t > self.stall_s:
                    self._lost(k, f"has not answered for {self.stall_s:g} s (stopped, or "
                               "hung)")

    def _read(self, sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        k = key.data
        try:
            data = key.fileobj.recv(4096)  # type: ignore[union-attr]
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if k is None:  # a signal, through the wakeup fd
            for signum in data:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    self._stopped(signal.Signals(signum).name)
            return
        if not data:
            sel.unregister(key.fileobj)
            if k not in self.ended and k not in self.failing:
                self._lost(k, "ended without finishing (killed, or failed)")
            return
        self.heard[k] = time.monotonic()
        *lines, self.bufs[k] = (self.bufs[k] + data).split(b"\n")
        for line in lines:
            word, _, rest = line.decode(errors="replace").partition(" ")
            if word == "bye":
                self.ended.add(k)
            elif word == "fail":
                self.failing.setdefault(k, time.monotonic())
            elif word == "stop":
                self._lost(k, rest or "stopped")
            elif word == "lost":
                who, _, why = rest.partition(" ")
                self._lost(int(who) if who.isdigit() else k, why)


_WATCH: _Watch | None = None
