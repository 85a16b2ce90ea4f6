"""Pipeline schedules: which micro-batch each stage runs forward or backward at each tick.

A schedule is built from each stage's **op order** and one rule: at every tick each stage
runs the next op of its order as soon as its inputs exist (forward ``F(s, k)`` needs
``F(s-1, k)`` from an earlier tick, backward ``B(s, k)`` needs ``F(s, k)`` and ``B(s+1, k)``
from earlier ticks). The orders:

- ``gpipe`` (GPipe, Huang et al. 2019): every forward, then every backward, ``F0 .. F(m-1),
  B0 .. B(m-1)``. Every stage holds the activations of all ``m`` micro-batches at the turn.
- ``1f1b`` (PipeDream-Flush / Megatron's non-interleaved 1F1B, MindSpore's default): stage
  ``s`` runs ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards; at most ``p - s`` micro-batches are in
  flight on stage ``s``, so activation memory is bounded by ``p``, not ``m``.

Both take ``2 (m + p - 1)`` ticks; the same gradients come out (every micro-batch's
gradient is accumulated), only order and memory differ. The tables also assign **buffer
slots**: a stage keeps each received activation (its input of ``F(s, k)``, re-read by
``B(s, k)``, which recomputes the forward) and each received gradient until used; slots are
reused as soon as they are free, so the slot count is the measured peak.

>>> s = schedule("gpipe", stages=2, micro_batches=4)
>>> s.ticks
10
>>> s.peak_in_flight, schedule("1f1b", stages=2, micro_batches=4).peak_in_flight
((4, 4), (2, 1))
>>> print(schedule("1f1b", 2, 4).table())
stage 0: F0 F1 .  B0 F2 B1 F3 B2 .  B3
stage 1: .  F0 B0 F1 B1 F2 B2 F3 B3 .
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.limits import MAX_MICRO_BATCHES

__all__ = ["SCHEDULES", "Schedule", "schedule", "op_order", "bubble_fraction"]

SCHEDULES = ("1f1b", "gpipe")
IDLE, FWD, BWD = 0, 1, 2

Op = tuple[int, int]  # (FWD or BWD, micro-batch)


def op_order(name: str, stages: int, micro_batches: int, stage: int) -> tuple[Op, ...]:
    """The order in which ``stage`` runs its forwards and backwards."""
    m = micro_batches
    if name == "gpipe":
        return tuple((FWD, k) for k in range(m)) + tuple((BWD, k) for k in range(m))
    warm = min(stages - stage - 1, m)
    order: list[Op] = [(FWD, k) for k in range(warm)]
    for i in range(m - warm):
        order += [(FWD, warm + i), (BWD, i)]
    order += [(BWD, k) for k in range(m - warm, m)]
    return tuple(order)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """GPipe's idle fraction with equal stages and free communication: (p-1)/(m+p-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


@dataclass(frozen=True)
class Schedule:
    """The tick tables of a schedule (arrays ``[ticks, stages]``, int32).

    ``op`` (0 idle, 1 forward, 2 backward) and ``micro`` (micro-batch) say what each stage
    runs; ``x_slot`` / ``g_slot`` which slot holds the activation / gradient it reads;
    ``x_write`` / ``g_write`` where the activation / gradient received at the end of the tick
    goes (``act_slots`` / ``grad_slots``: nothing received).
    """

    name: str
    stages: int
    micro_batches: int
    op: np.ndarray
    micro: np.ndarray
    x_slot: np.ndarray
    g_slot: np.ndarray
    x_write: np.ndarray
    g_write: np.ndarray
    act_slots: int
    grad_slots: int
    peak_in_flight: tuple[int, ...]   # per stage: forwards done whose backward is not

    @property
    def ticks(self) -> int:
        return int(self.op.shape[0])

    def busy_ticks(self) -> int:
        return int((self.op != IDLE).sum())

    def tick_bubble(self) -> float:
        """Idle fraction of the tick table (every op one tick)."""
        return 1.0 - self.busy_ticks() / (self.ticks * self.stages)

    def table(self) -> str:
        """One row per stage: ``F3`` / ``B3`` / ``.`` per tick."""
        rows = []
        for s in range(self.stages):
            cells = []
            for t in range(self.ticks):
                o = int(self.op[t, s])
                cells.append(".  " if o == IDLE else
                             f"{'F' if o == FWD else 'B'}{int(self.micro[t, s]):<2d}")
            rows.append(f"stage {s}: " + "".join(cells).rstrip())
        return "\n".join(rows)


def _check(name: object, stages: object, micro_batches: object) -> tuple[str, int, int]:
    if not isinstance(name, str):
        raise AutoParallelTypeError("schedule", name, f"a schedule name, one of {SCHEDULES}")
    key = name.lower()
    if key not in SCHEDULES:
        raise AutoParallelError("schedule", name, f"unknown pipeline schedule; choose one of "
                                f"{SCHEDULES}")
    for k, v in (("pipeline_stages", stages), ("micro_batches", micro_batches)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise AutoParallelTypeError(k, v, "must be an int")
        if v < 1:
            raise AutoParallelError(k, v, "must be >= 1")
    if micro_batches > MAX_MICRO_BATCHES:  # (the tables would not fit in memory)
        raise AutoParallelError("micro_batches", micro_batches,
                                f"must be at most {MAX_MICRO_BATCHES}")
    if micro_batches < stages:
        raise AutoParallelError("micro_batches", micro_batches, f"must be >= pipeline_stages "
                                f"({stages}): fewer micro-batches than stages leave a stage "
                                "idle for the whole step", f"Use micro_batches >= {stages}")
    return key, int(stages), int(micro_batches)  # type: ignore[call-overload]


def schedule(name: str, stages: int, micro_batches: int) -> Schedule:
    """Build the tick tables of ``name`` (``"gpipe"`` or ``"1f1b"``) for ``stages`` x
    ``micro_batches`` (see the module docstring)."""
    name, p, m = _check(name, stages, micro_batches)
    orders = [list(op_order(name, p, m, s)) for s in range(p)]
    pos = [0] * p
    done_f = np.full((p, m), -1)     # tick at which F(s, k) ran
    done_b = np.full((p, m), -1)
    rows: list[list[Op | None]] = []
    while any(pos[s] < len(orders[s]) for s in range(p)):
        t = len(rows)
        row: list[Op | None] = [None] * p
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            kind, k = orders[s][pos[s]]
            if kind == FWD:
                ready = s == 0 or 0 <= done_f[s - 1, k] < t
            else:
                ready = 0 <= done_f[s, k] < t and (s == p - 1 or 0 <= done_b[s + 1, k] < t)
            if ready:
                row[s] = (kind, k)
        for s, o in enumerate(row):
            if o is not None:
                (done_f if o[0] == FWD else done_b)[s, o[1]] = t
                pos[s] += 1
        rows.append(row)
        if t > 4 * (m + p) + 8:  # pragma: no cover - the orders above never deadlock
            raise AutoParallelError("schedule", name, "deadlocked")
    return _tables(name, p, m, rows, done_f, done_b)


def _alloc(arrive: list[list[tuple[int, int]]], used: list[dict[int, int]]
           ) -> tuple[dict[tuple[int, int], int], int]:
    """Slots per stage: ``arrive[s]`` = [(tick, k)], ``used[s][k]`` = last tick reading it.
    A slot freed by a read at tick t can take an arrival at the end of the same tick."""
    slot_of: dict[tuple[int, int], int] = {}
    count = 0
    for s, events in enumerate(arrive):
        free: list[int] = []
        live: list[tuple[int, int]] = []  # (last read tick, slot)
        n = 0
        for t, k in sorted(events):
            for item in sorted(live):
                if item[0] <= t:
                    live.remove(item)
                    free.append(item[1])
            free.sort()
            if free:
                slot = free.pop(0)
            else:
                slot, n = n, n + 1
            slot_of[(s, k)] = slot
            live.append((used[s][k], slot))
        count = max(count, n)
    return slot_of, max(count, 1)


def _tables(name: str, p: int, m: int, rows: list[list[Op | None]], done_f: np.ndarray,
            done_b: np.ndarray) -> Schedule:
    n_ticks = len(rows)
    op = np.zeros((n_ticks, p), np.int32)
    micro = np.zeros((n_ticks, p), np.int32)
    for t, row in enumerate(rows):
        for s, o in enumerate(row):
            if o is not None:
                op[t, s], micro[t, s] = o
    # activations arrive at s >= 1 when F(s-1, k) ends; last read by B(s, k)
    x_arrive = [[(int(done_f[s - 1, k]), k) for k in range(m)] if s else [] for s in range(p)]
    x_used = [{k: int(done_b[s, k]) for k in range(m)} for s in range(p)]
    g_arrive = [[(int(done_b[s + 1, k]), k) for k in range(m)] if s < p - 1 else []
                for s in range(p)]
    g_used = x_used
    x_of, n_x = _alloc(x_arrive, x_used)
    g_of, n_g = _alloc(g_arrive, g_used)
    x_slot = np.zeros((n_ticks, p), np.int32)
    g_slot = np.zeros((n_ticks, p), np.int32)
    x_write = np.full((n_ticks, p), n_x, np.int32)
    g_write = np.full((n_ticks, p), n_g, np.int32)
    for t in range(n_ticks):
        for s in range(p):
            k = int(micro[t, s])
            if op[t, s] != IDLE and s > 0:
                x_slot[t, s] = x_of[(s, k)]
            if op[t, s] == BWD and s < p - 1:
                g_slot[t, s] = g_of[(s, k)]
    for s in range(1, p):
        for t, k in x_arrive[s]:
            x_write[t, s] = x_of[(s, k)]
    for s in range(p - 1):
        for t, k in g_arrive[s]:
            g_write[t, s] = g_of[(s, k)]
    peak = []
    for s in range(p):
        live = best = 0
        for t in range(n_ticks):
            if op[t, s] == FWD:
                live += 1
            elif op[t, s] == BWD:
                live -= 1
            best = max(best, live)
        peak.append(best)
    return Schedule(name, p, m, op, micro, x_slot, g_slot, x_write, g_write, n_x, n_g,
                    tuple(peak))
