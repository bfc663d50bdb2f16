"""Pipeline schedule tables: which micro-batch each stage runs forward / backward in each tick.

A schedule is a pair of integer tables ``fwd[t, s]`` / ``bwd[t, s]`` (``-1`` = idle). A dependency must
be met in an earlier tick, except the last stage's backward, which may follow its forward (the loss
gradient) in the same tick. ``"gpipe"`` runs all forwards then all backwards (``G`` micro-batches in
flight); ``"1f1b"`` (PipeDream-flush) warms up with ``min(S - s - 1, G)`` forwards and then alternates
(``min(S - s, G)`` in flight); ``"1f1b-eager"`` puts every backward at its earliest tick
(``min(2 (S - s) - 1, G)`` in flight). Trade-offs and measurements: docs/internals.md.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

SCHEDULE_NAMES = ("1f1b", "gpipe", "1f1b-eager")

# Instants inside a tick (fractions of it) ordering a stage's forward before its backward (`in_flight`).
F_AT, B_AT = 0.1, 0.3


class ScheduleError(ValueError):
    """A schedule table is malformed or violates a pipeline dependency."""


class Schedule(NamedTuple):
    """Forward / backward micro-batch per (tick, stage); -1 = idle. Unpacks as ``fwd, bwd``."""

    fwd: np.ndarray  # int [T, S]
    bwd: np.ndarray  # int [T, S]

    @property
    def num_ticks(self) -> int:
        return self.fwd.shape[0]

    @property
    def num_stages(self) -> int:
        return self.fwd.shape[1]

    @property
    def num_microbatches(self) -> int:
        return int(self.fwd.max()) + 1


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(f"need at least one stage and one micro-batch, got S={num_stages}, "
                            f"G={num_microbatches}")


def _from_ticks(f_tick: np.ndarray, b_tick: np.ndarray) -> Schedule:
    """Build the tables from tick numbers ``f_tick[s, i]`` / ``b_tick[s, i]``."""
    num_stages, num_mb = f_tick.shape
    num_ticks = int(max(f_tick.max(), b_tick.max())) + 1
    fwd = np.full((num_ticks, num_stages), -1, np.int32)
    bwd = np.full((num_ticks, num_stages), -1, np.int32)
    for s in range(num_stages):
        fwd[f_tick[s], s] = np.arange(num_mb)
        bwd[b_tick[s], s] = np.arange(num_mb)
    return Schedule(fwd, bwd)


def gpipe_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: forward wave, then backward wave (one op per stage per tick, ``2 (G + S - 1)`` ticks)."""
    _check_sizes(num_stages, num_microbatches)
    s = np.arange(num_stages)[:, None]
    i = np.arange(num_microbatches)[None, :]
    last_forward = num_microbatches + num_stages - 2  # tick of the last stage's last forward
    return _from_ticks(np.broadcast_to(i + s, (num_stages, num_microbatches)),
                       last_forward + 1 + (num_stages - 1 - s) + i)


def eager_one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B with every backward at its earliest tick (one F and one B per tick; see module docstring)."""
    _check_sizes(num_stages, num_microbatches)
    s = np.arange(num_stages)[:, None]
    i = np.arange(num_microbatches)[None, :]
    return _from_ticks(np.broadcast_to(i + s, (num_stages, num_microbatches)),
                       i + 2 * num_stages - 2 - s)


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Classic non-interleaved 1F1B: warm-up ``min(S-s-1, G)`` forwards, alternate, cool down.

    Each stage walks its op list in order and runs the next op as soon as its dependency finished in an
    earlier tick (an as-soon-as-possible list schedule); one op per stage per tick.
    """
    _check_sizes(num_stages, num_microbatches)
    S, G = num_stages, num_microbatches
    orders = []
    for s in range(S):
        warm = min(S - s - 1, G)
        ops = [("F", i) for i in range(warm)]
        for k in range(G - warm):
            ops += [("F", warm + k), ("B", k)]
        ops += [("B", i) for i in range(G - warm, G)]
        orders.append(ops)
    done: dict[tuple[str, int, int], int] = {}
    pos = [0] * S
    f_tick = np.zeros((S, G), np.int64)
    b_tick = np.zeros((S, G), np.int64)
    t = 0
    while any(pos[s] < len(orders[s]) for s in range(S)):
        ran = []
        for s in range(S):
            if pos[s] == len(orders[s]):
                continue
            op, i = orders[s][pos[s]]
            if op == "F":
                dep = ("F", s - 1, i) if s > 0 else None
            else:
                dep = ("F", s, i) if s == S - 1 else ("B", s + 1, i)
            if dep is None or done.get(dep, t) < t:
                ran.append((op, s, i))
                pos[s] += 1
                (f_tick if op == "F" else b_tick)[s, i] = t
        done.update({key: t for key in ran})
        t += 1
        if t > 4 * (S + G) + 4:  # cannot happen for a valid op order; guards against an endless loop
            raise ScheduleError("1F1B list scheduling did not terminate")
    return _from_ticks(f_tick, b_tick)


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The table called `name` (one of `SCHEDULE_NAMES`)."""
    makers = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule, "1f1b-eager": eager_one_f_one_b_schedule}
    if name not in makers:
        raise ScheduleError(f"unknown pipeline schedule {name!r}: use one of {SCHEDULE_NAMES}")
    return makers[name](num_stages, num_microbatches)


def op_ticks(sched: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """``f_tick[s, i]``, ``b_tick[s, i]``; raises unless every (stage, micro-batch) F and B occur once."""
    fwd, bwd = np.asarray(sched.fwd), np.asarray(sched.bwd)
    if fwd.ndim != 2 or fwd.shape != bwd.shape:
        raise ScheduleError(f"fwd and bwd must be [ticks, stages] tables of one shape, got {fwd.shape} "
                            f"and {bwd.shape}")
    S, G = fwd.shape[1], int(max(fwd.max(), bwd.max())) + 1
    ticks = []
    for name, table in (("forward", fwd), ("backward", bwd)):
        out = np.full((S, G), -1, np.int64)
        for s in range(S):
            col = table[:, s]
            ids, counts = np.unique(col[col >= 0], return_counts=True)
            if len(ids) != G or (counts != 1).any() or (col < -1).any():
                raise ScheduleError(f"stage {s} must run each of the {G} micro-batches' {name} exactly "
                                    f"once; it runs {dict(zip(ids.tolist(), counts.tolist()))}")
            live = np.nonzero(col >= 0)[0]
            out[s, col[live]] = live
        ticks.append(out)
    return ticks[0], ticks[1]


def check_schedule(sched: Schedule, max_in_flight: np.ndarray | None = None) -> np.ndarray:
    """Validate a schedule and return the per-stage maximum number of micro-batches in flight.

    Checks that every stage runs each micro-batch's forward and backward exactly once, that forwards
    follow the previous stage's forward and backwards the next stage's backward in an earlier tick
    (the last stage's backward may share its forward's tick), and, if given, that stage ``s`` never
    holds more than ``max_in_flight[s]`` micro-batches of saved activations.

    Raises:
        ScheduleError: on the first violated rule.
    """
    f_tick, b_tick = op_ticks(sched)
    S, G = f_tick.shape
    for s in range(S):
        for i in range(G):
            if s > 0 and f_tick[s, i] <= f_tick[s - 1, i]:
                raise ScheduleError(f"F(stage {s}, mb {i}) at tick {f_tick[s, i]} does not follow "
                                    f"F(stage {s - 1}) at tick {f_tick[s - 1, i]}")
            if s < S - 1 and b_tick[s, i] <= b_tick[s + 1, i]:
                raise ScheduleError(f"B(stage {s}, mb {i}) at tick {b_tick[s, i]} does not follow "
                                    f"B(stage {s + 1}) at tick {b_tick[s + 1, i]}")
            if b_tick[s, i] < f_tick[s, i]:
                raise ScheduleError(f"B(stage {s}, mb {i}) runs before its forward")
    counts = in_flight(sched)
    if max_in_flight is not None:
        bad = np.nonzero(counts > np.asarray(max_in_flight))[0]
        if len(bad):
            s = int(bad[0])
            raise ScheduleError(f"stage {s} holds {counts[s]} micro-batches of activations, more than "
                                f"the allowed {np.asarray(max_in_flight)[s]}")
    return counts


def in_flight(sched: Schedule) -> np.ndarray:
    """Per stage, the most micro-batches whose forward ran and whose backward has not finished."""
    f_tick, b_tick = op_ticks(sched)
    return np.array([max(_overlaps(list(zip(f_tick[s] + F_AT, b_tick[s] + B_AT)))) for s in
                     range(f_tick.shape[0])])


def _overlaps(intervals: list[tuple[float, float]]) -> list[int]:
    """For each interval (closed), the number of intervals alive at its start (>= 1)."""
    return [sum(a <= lo <= b for a, b in intervals) for lo, _ in intervals] or [0]


def inflight_microbatches(
    stage: ArrayLike, num_stages: ArrayLike, num_microbatches: ArrayLike, schedule: str = "1f1b"
) -> np.ndarray:
    """Micro-batches whose residuals stage ``stage`` (0-based) holds at its peak, vectorised, as the MPMD
    executor runs the schedule (`mistjax.core.pipeline_order.residuals_in_flight`, tested equal).

    1F1B: ``min(S - stage, G)`` (warm-up forwards S - stage - 1, Mist's p, plus the current one).
    GPipe: G (every forward finishes before the first backward).
    1F1B-eager: ``min(2 (S - stage) - 1, G)`` (backward i waits ``2 (S - stage) - 2`` ticks after forward i).
    The last stage runs each micro-batch's forward and backward in one program: one, transiently.
    """
    st = np.asarray(stage, dtype=np.int64)
    s = np.asarray(num_stages, dtype=np.int64)
    g = np.asarray(num_microbatches, dtype=np.int64)
    if np.any(st < 0) or np.any(st >= s):
        raise ValueError("stage must be in [0, num_stages)")
    if schedule == "1f1b":
        n = np.minimum(s - st, g)
    elif schedule == "gpipe":
        n = np.broadcast_to(g, np.broadcast_shapes(st.shape, s.shape, g.shape)).copy()
    elif schedule == "1f1b-eager":
        n = np.minimum(2 * (s - st) - 1, g)
    else:
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}: use one of {SCHEDULE_NAMES}")
    return np.where(st == s - 1, 1, n)


__all__ = ["B_AT", "F_AT", "SCHEDULE_NAMES", "Schedule", "ScheduleError", "check_schedule",
           "eager_one_f_one_b_schedule", "gpipe_schedule", "in_flight", "inflight_microbatches", "make_schedule",
           "one_f_one_b_schedule", "op_ticks"]
