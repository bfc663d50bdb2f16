"""The lock-step SPMD pipeline's tick program: a schedule compiled to per-(tick, stage) buffer slots.

Slots are sized by interval colouring (optimal for interval graphs), so every buffer holds exactly
the number of micro-batches the table keeps alive.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mistjax.core.schedules import B_AT, F_AT, RECV_AT, SEED_AT, Schedule, check_schedule, op_ticks


def _colour(intervals: list[tuple[float, float]]) -> tuple[list[int], int]:
    """Assign slots to closed intervals so that overlapping ones differ; returns (slots, slot count).

    Greedy by start time, reusing the free slot that was released first; optimal for interval graphs.
    """
    order = sorted(range(len(intervals)), key=lambda k: intervals[k][0])
    slot_end: list[float] = []
    slots = [-1] * len(intervals)
    for k in order:
        lo, hi = intervals[k]
        free = [j for j, end in enumerate(slot_end) if end < lo]
        j = min(free, key=lambda j: slot_end[j]) if free else len(slot_end)
        if j == len(slot_end):
            slot_end.append(hi)
        slot_end[j] = hi
        slots[k] = j
    return slots, len(slot_end)


# Columns of the per-(tick, stage) program the executor scans over.
F_MB, F_XSLOT, F_RSLOT, F_SEED, B_MB, B_RSLOT, B_CSLOT, RX_SLOT, RC_SLOT = range(9)
NUM_COLUMNS = 9


class TickProgram(NamedTuple):
    """A schedule compiled to buffer slots.

    ``table[t, s]`` holds, by column: ``F_MB`` forward micro-batch; ``F_XSLOT`` input-queue slot it
    reads (stage > 0); ``F_RSLOT`` residual slot it writes; ``F_SEED`` cotangent-queue slot the last
    stage's seed goes to; ``B_MB`` backward micro-batch; ``B_RSLOT`` residual slot and ``B_CSLOT``
    cotangent slot it reads; ``RX_SLOT`` / ``RC_SLOT`` input / cotangent-queue slot that the message
    arriving at the end of the tick goes to. ``-1`` everywhere a column does not apply.
    """

    table: np.ndarray  # int32 [T, S, NUM_COLUMNS]
    residual_slots: np.ndarray  # [S] micro-batches of saved activations each stage keeps
    input_slots: int  # activation-queue depth (max over stages)
    cotangent_slots: int  # cotangent-queue depth (max over stages)


def tick_program(sched: Schedule) -> TickProgram:
    """Allocate buffer slots for a (checked) schedule; see `TickProgram`."""
    check_schedule(sched)
    f_tick, b_tick = op_ticks(sched)
    S, G = f_tick.shape
    table = np.full((sched.num_ticks, S, NUM_COLUMNS), -1, np.int32)
    res_slots = np.zeros(S, np.int64)
    x_depth = c_depth = 1
    for s in range(S):
        table[f_tick[s], s, F_MB] = np.arange(G)
        table[b_tick[s], s, B_MB] = np.arange(G)
        slots, res_slots[s] = _colour([(f_tick[s, i] + F_AT, b_tick[s, i] + B_AT) for i in range(G)])
        table[f_tick[s], s, F_RSLOT] = slots
        table[b_tick[s], s, B_RSLOT] = slots
        if s > 0:  # activation of mb i lands at the end of F(s-1, i) and is read by F(s, i)
            slots, n = _colour([(f_tick[s - 1, i] + RECV_AT, f_tick[s, i] + F_AT) for i in range(G)])
            table[f_tick[s - 1], s, RX_SLOT] = slots
            table[f_tick[s], s, F_XSLOT] = slots
            x_depth = max(x_depth, n)
        if s < S - 1:  # cotangent lands at the end of B(s+1, i)
            slots, n = _colour([(b_tick[s + 1, i] + RECV_AT, b_tick[s, i] + B_AT) for i in range(G)])
            table[b_tick[s + 1], s, RC_SLOT] = slots
        else:  # the last stage's forward writes the seed cotangent mid-tick
            slots, n = _colour([(f_tick[s, i] + SEED_AT, b_tick[s, i] + B_AT) for i in range(G)])
            table[f_tick[s], s, F_SEED] = slots
        table[b_tick[s], s, B_CSLOT] = slots
        c_depth = max(c_depth, n)
    return TickProgram(table, res_slots, x_depth, c_depth)


__all__ = ["NUM_COLUMNS", "TickProgram", "tick_program"]
