"""Pipeline schedules by name, and how many micro-batches' residuals each stage holds under them.

``"gpipe"`` runs all forwards then all backwards (``G`` micro-batches in flight); ``"1f1b"``
(PipeDream-flush) warms up with ``min(S - s - 1, G)`` forwards and then alternates (``min(S - s, G)`` in
flight); ``"1f1b-eager"`` puts every backward at its earliest slot (``min(2 (S - s) - 1, G)`` in flight);
``"zb-h1"`` splits each backward into its input-gradient and weight-gradient halves and defers the latter
into the bubbles (Qi et al., ICLR'24), with 1F1B's peak (its first stage's) on every stage; ``"zb-v"`` runs
two chunks per device group placed in a V (group ``d`` holds virtual stages ``d`` and ``2S - 1 - d``, so the
first group also computes the loss) with split backwards, filling the pipeline with the weight passes at about
1F1B's peak memory. The executor's operation order is `mistjax.core.pipeline_order`'s; trade-offs and
measurements: docs/internals.md.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

SCHEDULE_NAMES = ("1f1b", "gpipe", "1f1b-eager", "zb-h1", "zb-v")
ZERO_BUBBLE = frozenset({"zb-h1", "zb-v"})
"""Schedules whose backward runs as B (input gradient) then W (weight gradients), W deferred into bubbles."""
V_SHAPED = frozenset({"zb-v"})
"""Schedules of two chunks per device group placed in a V (`stage_groups`)."""


class ScheduleError(ValueError):
    """A pipeline schedule is unknown, or its sizes cannot be run."""


def stage_groups(num_virtual: int, num_groups: int, schedule: str) -> np.ndarray:
    """The device group of each virtual stage. Round robin (virtual stage ``k`` on group ``k % S``: one chunk per
    group, or Megatron's interleaving) except under a V-shaped schedule, whose ``2S`` virtual stages go down the
    groups and back up: ``k`` on group ``k`` for ``k < S``, on ``2S - 1 - k`` after.

    Raises:
      ScheduleError: a V-shaped schedule with other than two chunks per group.
    """
    k = np.arange(num_virtual)
    if schedule not in V_SHAPED:
        return k % num_groups
    if num_virtual != 2 * num_groups:
        raise ScheduleError(f"{schedule} runs two chunks per device group: {num_virtual} virtual stages on "
                            f"{num_groups} group(s) cannot be placed in a V")
    return np.where(k < num_groups, k, 2 * num_groups - 1 - k)


def inflight_microbatches(
    stage: ArrayLike, num_stages: ArrayLike, num_microbatches: ArrayLike, schedule: str = "1f1b"
) -> np.ndarray:
    """Micro-batches whose residuals stage ``stage`` (0-based) holds at its peak, vectorised, as the MPMD
    executor runs the schedule (`mistjax.core.pipeline_order.residuals_in_flight`, tested equal).

    1F1B: ``min(S - stage, G)`` (warm-up forwards S - stage - 1, Mist's p, plus the current one). ZB-H1:
    ``min(S, G)`` on every stage, 1F1B's peak (its first stage's): stage s keeps a micro-batch's residuals until
    its weight-gradient pass, which it runs s micro-batches after the input gradient (Qi et al.'s lag).
    GPipe: G (every forward finishes before the first backward).
    1F1B-eager: ``min(2 (S - stage) - 1, G)`` (backward i waits ``2 (S - stage) - 2`` ticks after forward i).
    The last stage runs each micro-batch's forward and backward in one program: one, transiently.
    """
    _one_chunk(schedule)
    st = np.asarray(stage, dtype=np.int64)
    s = np.asarray(num_stages, dtype=np.int64)
    g = np.asarray(num_microbatches, dtype=np.int64)
    if np.any(st < 0) or np.any(st >= s):
        raise ValueError("stage must be in [0, num_stages)")
    if schedule == "1f1b":
        n = np.minimum(s - st, g)
    elif schedule == "zb-h1":
        n = np.minimum(s, g)
    elif schedule == "gpipe":
        n = np.broadcast_to(g, np.broadcast_shapes(st.shape, s.shape, g.shape)).copy()
    elif schedule == "1f1b-eager":
        n = np.minimum(2 * (s - st) - 1, g)
    else:
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}: use one of {SCHEDULE_NAMES}")
    return np.where(st == s - 1, 1, n)


def deferred_microbatches(stage: ArrayLike, num_stages: ArrayLike, num_microbatches: ArrayLike,
                          schedule: str = "1f1b") -> np.ndarray:
    """Micro-batches whose weight-gradient pass stage ``stage`` defers at its peak, each holding its stash (the
    values the pass reads of the input-gradient pass), vectorised, as the MPMD executor runs ZB-H1
    (`mistjax.core.pipeline_order.deferred_in_flight`, tested equal); zero for other schedules.

    ZB-H1: ``min(stage + 1, G)``, stage s running each weight-gradient pass s micro-batches after its input
    gradient (the last stage ``min(S, G)``), none on the first stage, whose deferred pass is its whole backward
    (its residuals are counted in flight until then, and it has no stash).
    """
    _one_chunk(schedule)
    st = np.asarray(stage, dtype=np.int64)
    s = np.asarray(num_stages, dtype=np.int64)
    g = np.asarray(num_microbatches, dtype=np.int64)
    if schedule not in SCHEDULE_NAMES:
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}: use one of {SCHEDULE_NAMES}")
    if schedule != "zb-h1":
        return np.zeros(np.broadcast_shapes(st.shape, s.shape, g.shape), np.int64)
    n = np.minimum(st + 1, g)
    return np.where((st == 0) | (s == 1), 0, n)


def _one_chunk(schedule: str) -> None:
    if schedule in V_SHAPED:
        raise ScheduleError(f"{schedule} holds its micro-batches per device group, not per stage: read them from its "
                            "issue order (core.pipeline_order.group_in_flight / deferred_in_flight)")


__all__ = ["SCHEDULE_NAMES", "V_SHAPED", "ZERO_BUBBLE", "ScheduleError", "deferred_microbatches",
           "inflight_microbatches", "stage_groups"]
