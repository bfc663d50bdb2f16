"""Lock-step pipeline schedule tables, as the cost model prices pipelines (`mistjax.cost.predict`).

The executor no longer runs these tables: pipelined plans run on the MPMD executor
(`mistjax.runtime.mpmd`), whose per-group orders and host issue order are `runtime.mpmd_schedule`'s
(no ticks). The tables, `lockstep_time` and `in_flight` stay for the cost model, the tuner's search
space (`SCHEDULE_NAMES`) and the plots until the cost model describes the MPMD executor.

A schedule is a pair of integer tables ``fwd[t, s]`` / ``bwd[t, s]``: the micro-batch that stage ``s``
runs forward / backward in tick ``t`` (``-1`` = idle). Every tick a stage may run one forward and then
one backward; at the end of the tick activations move one stage down and cotangents one stage up
(``ppermute``), so a dependency must be met in an *earlier* tick. The one exception is the last stage,
whose forward also computes the loss gradient (the seed), so its backward may follow in the same tick.

Three tables are provided:

* ``"gpipe"``: all forwards (micro-batch ``i`` on stage ``s`` at tick ``i + s``), then all backwards.
  Every stage keeps the saved activations of all ``G`` micro-batches.
* ``"1f1b"`` (classic non-interleaved 1F1B, PipeDream-flush / Megatron): stage ``s`` runs
  ``min(S - s - 1, G)`` warm-up forwards, then alternates one forward / one backward, then cools down.
  At most ``min(S - s, G)`` micro-batches are in flight on stage ``s``. One op per stage per tick,
  ``2 (G + S - 1)`` ticks.
* ``"1f1b-eager"``: forward ``i`` at tick ``i + s`` and backward ``i`` at tick ``i + 2S - 2 - s`` (the
  earliest possible), so a stage runs one forward *and* one backward per tick in the steady state;
  ``G + 2S - 2`` ticks. In flight on stage ``s``: ``min(2 (S - s) - 1, G)``, still independent of ``G``
  but up to twice classic 1F1B's.

Trade-off (why ``"1f1b"`` was the default). A lock-step executor ends every tick in a ``ppermute``, so
it lasts as long as the slowest stage's work in it (`lockstep_time`). In classic 1F1B's steady state a
stage runs F while its neighbour runs B, so every tick costs ``max(F, B)``: with ``B = 2F`` the modelled
step time is up to +33% over GPipe (+26% at S=4, G=16), more with remat (B = 3F). The eager table packs
F and B of the same stage into one tick, so its lock-step time equals GPipe's ``(G + S - 1)(F + B)``,
but it keeps up to ``2 (S - s) - 1`` micro-batches of activations instead of ``S - s``. The planner
(Mist's cost model) charges 1F1B with ``S - s`` micro-batches in flight, so the memory-faithful classic
table is the default: a mis-predicted step time costs throughput, a mis-predicted peak is an OOM. Plans
with memory headroom can ask for ``"1f1b-eager"`` (the cost model should then charge ``2 (S - s) - 1``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

SCHEDULE_NAMES = ("1f1b", "gpipe", "1f1b-eager")

# Instants inside a tick (fractions of it) ordering a stage's forward before its backward (`in_flight`).
_F_AT, _B_AT = 0.1, 0.3


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


def _op_ticks(sched: Schedule) -> tuple[np.ndarray, np.ndarray]:
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
    f_tick, b_tick = _op_ticks(sched)
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
    f_tick, b_tick = _op_ticks(sched)
    return np.array([max(_overlaps(list(zip(f_tick[s] + _F_AT, b_tick[s] + _B_AT)))) for s in
                     range(f_tick.shape[0])])


def one_f_one_b_bound(num_stages: int, num_microbatches: int) -> np.ndarray:
    """The classic 1F1B in-flight bound ``min(S - s, G)`` per stage."""
    return np.minimum(num_stages - np.arange(num_stages), num_microbatches)


def lockstep_time(sched: Schedule, fwd_cost: float | np.ndarray = 1.0, bwd_cost: float | np.ndarray = 2.0
                  ) -> float:
    """Step time of the lock-step executor: each tick lasts as long as its slowest stage.

    Args:
        sched: the schedule.
        fwd_cost: seconds of one micro-batch forward, scalar or per stage ``[S]``.
        bwd_cost: the same for a backward (include recompute for remat stages).
    """
    fwd, bwd = np.asarray(sched.fwd), np.asarray(sched.bwd)
    S = fwd.shape[1]
    f = np.broadcast_to(np.asarray(fwd_cost, float), (S,))
    b = np.broadcast_to(np.asarray(bwd_cost, float), (S,))
    return float(((fwd >= 0) * f + (bwd >= 0) * b).max(axis=1).sum())


def bubble_fraction(num_stages: int, num_microbatches: int, schedule: str = "1f1b", fwd_cost: float = 1.0,
                    bwd_cost: float = 1.0) -> float:
    """Idle fraction of the lock-step step time: ``1 - G (F + B) / lockstep_time``.

    With equal F and B costs this is the textbook ``(S - 1) / (G + S - 1)`` for all three tables; with
    ``bwd_cost > fwd_cost`` classic 1F1B also pays the lock-step penalty (see the module docstring).
    """
    sched = make_schedule(schedule, num_stages, num_microbatches)
    total = lockstep_time(sched, fwd_cost, bwd_cost)
    return 1.0 - num_microbatches * (fwd_cost + bwd_cost) / total


def _overlaps(intervals: list[tuple[float, float]]) -> list[int]:
    """For each interval (closed), the number of intervals alive at its start (>= 1)."""
    return [sum(a <= lo <= b for a, b in intervals) for lo, _ in intervals] or [0]


__all__ = ["SCHEDULE_NAMES", "Schedule", "ScheduleError", "bubble_fraction", "check_schedule",
           "eager_one_f_one_b_schedule", "gpipe_schedule", "in_flight", "lockstep_time", "make_schedule",
           "one_f_one_b_bound", "one_f_one_b_schedule"]
