"""Whole-pipeline step time from per-stage micro-batch times (Mist section 3.5), vectorised.

Per-stage inputs carry the stage axis LAST, shape ``(..., S)``; leading axes are candidate plans and
``G`` broadcasts against them. ``stable[..., i]`` (T_i) is the forward + backward time of one steady
micro-batch on stage i, ``delta[..., i]`` (D_i) the extra time of its first and last micro-batches
(once-per-step work). What the formulas model, and how they were checked: docs/internals.md.
"""

from __future__ import annotations

import functools
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from mistjax.core.pipeline_order import issue_order, op_costs, simulated_time
from mistjax.core.schedules import SCHEDULE_NAMES, V_SHAPED, ZERO_BUBBLE, ScheduleError

ScheduleName = Literal["1f1b", "gpipe", "1f1b-eager"]


def _stages(stable: ArrayLike, delta: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(stable, dtype=np.float64)
    d = np.asarray(delta, dtype=np.float64)
    if t.ndim == 0 or t.shape[-1] == 0:
        raise ValueError("stable must have a non-empty trailing stage axis")
    t, d = np.broadcast_arrays(t, d)
    return t, d


def exposed_delta(stable: ArrayLike, delta: ArrayLike, fill: float = 1.0, hide: ArrayLike | None = None
                  ) -> np.ndarray:
    """``max(0, max_i (D_i - c sum_{j<i} H_j))``: the delta no earlier stage's drain hides (the MILP's D_max), with
    ``fill`` = c the share of each stage's time in the fill and drain (`fill_share`).

    ``hide`` = H: what of an earlier stage's micro-batch runs after stage i's last operation. The executor's
    drain is a chain of backward passes from the last stage to the first, so a stage's once-per-step work
    hides behind the earlier stages' backward times (`StageCost.bwd`); None: their whole micro-batch times T
    (Mist's formula)."""
    t, d = np.asarray(stable, dtype=np.float64), np.asarray(delta, dtype=np.float64)
    h = t if hide is None else np.broadcast_to(np.asarray(hide, dtype=np.float64), t.shape)
    before = fill * (np.cumsum(h, axis=-1) - h)  # exclusive prefix sum
    return np.maximum(np.max(d - before, axis=-1), 0.0)


def fill_share(schedule: str, chunks: int = 1, wgrad_share: float = 0.0, stages: int = 2,
               microbatches: int | None = None) -> float:
    """The share ``c`` of a stage's micro-batch time that the pipeline's fill and drain expose, in
    ``T_iter = (G - c) max T + c sum T + D_max`` (`pipeline_1f1b_time` with ``fill``), as the MPMD executor's
    issue order runs the schedule (`core.pipeline_order`; equal to its simulated makespan for equal stages).

    1F1B, 1F1B-eager and GPipe expose it all (c = 1, Mist's formula). Interleaved 1F1B with ``chunks`` = v
    chunks per device group fills with chunks v times shorter (c = 1/v: ``(G + (S-1)/v) T`` for equal stages,
    Narayanan et al. 2021). ZB-H1 leaves the weight passes W to fill the drain: the executor's order
    (`core.pipeline_order.zero_bubble_orders`, stage s lagging its W's s micro-batches) has Qi et al.'s bubble
    ``(S-1)(F + B - W)`` for ``G >= S``: c = 1 - 2 w with ``wgrad_share`` = w = W / T, at least 0. Where
    ``W > B`` (w > 1/3 with F = T/3) the forward's own fill ``(S-1) F`` is the bubble instead, which
    this share, not given F, does not see; the weight passes' share on the grid and the large cells is 0.24-0.29.
    ZB-V has no closed form here: its share is the executor's order simulated for equal chunks
    (`v_fill_share`), for time on at most 8 groups, 4 micro-batches per group and the weight share rounded to
    0.02 (0.26-0.52 from S 4 to 8 at G = 2 S to 4 S and W 0.24-0.28 of T; docs/schedules.md).
    """
    if schedule in V_SHAPED:
        s = min(stages, 8)
        return v_fill_share(s, min(microbatches or 4 * s, 4 * s), round(float(wgrad_share) / 0.02) * 0.02)
    if schedule in ZERO_BUBBLE:
        return float(min(1.0, max(0.0, 1.0 - 2.0 * wgrad_share)))
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    return 1.0 / chunks


@functools.lru_cache(maxsize=1024)
def v_fill_share(stages: int, microbatches: int, wgrad_share: float) -> float:
    """ZB-V's `fill_share` for ``stages`` device groups of equal chunks, each chunk's forward a third of its
    micro-batch time and its weight passes ``wgrad_share`` of it: ``(makespan - G T) / ((S - 1) T)`` of the
    executor's order (`core.pipeline_order.zero_bubble_v_issue`), T a group's micro-batch time."""
    S, G, V = stages, microbatches, 2 * stages
    if S < 2:
        return 1.0
    w = min(max(wgrad_share, 0.0), 2.0 / 3.0)
    cost = op_costs("zb-v", np.full(V, 1.0 / 3.0), np.full(V, 2.0 / 3.0), np.full(V, w))
    makespan = simulated_time(issue_order("zb-v", S, G, 2), S, cost, "zb-v")
    return float(min(1.0, max(0.0, (makespan - 2.0 * G) / (2.0 * (S - 1)))))


def pipeline_1f1b_time(stable: ArrayLike, delta: ArrayLike, num_microbatches: ArrayLike,
                       fill: float = 1.0, hide: ArrayLike | None = None) -> np.ndarray:
    """Mist's 1F1B iteration time: ``sum T + (G-1) max T + max(0, max_i (D_i - sum_{j<i} T_j))``; with
    ``fill`` = c (`fill_share`) another schedule's: ``c sum T + (G-c) max T + max(0, max_i (D_i - c sum_{j<i} T_j))``.

    With one stage this is ``G*T + max(D, 0)``; with G = 1 and one stage, T + D (Mist's no-PP
    case; Mist sets D = 0 there and folds the first/last extras into T).

    Args:
        stable: T, shape ``(..., S)``, seconds.
        delta: D, broadcastable to ``stable``.
        num_microbatches: G >= 1, broadcastable to ``stable.shape[:-1]``.
        fill: c in [0, 1], the schedule's `fill_share` (1: 1F1B).
        hide: H, the part of each stage's micro-batch its successors' deltas hide behind (`exposed_delta`;
            None: T).

    Returns:
        Seconds, shape ``stable.shape[:-1]`` broadcast with G.
    """
    t, d = _stages(stable, delta)
    g = np.asarray(num_microbatches, dtype=np.float64)
    if np.any(g < 1):
        raise ValueError("num_microbatches must be >= 1")
    return fill * t.sum(axis=-1) + (g - fill) * t.max(axis=-1) + exposed_delta(t, d, fill, hide)


def pipeline_gpipe_time(
    stable: ArrayLike,
    delta: ArrayLike,
    num_microbatches: ArrayLike,
    forward: ArrayLike | None = None,
) -> np.ndarray:
    """GPipe (all forwards, then all backwards) iteration time.

    The forward wave is a flow shop over the stages and the backward wave one in reverse order, so
    with F_i = ``forward`` and B_i = T_i - F_i the time is
    ``sum T + (G-1) (max F + max B) + imbalance`` (the imbalance term as in 1F1B: stage i's extra
    work hides behind the forward fill and backward drain of the stages before it). Without
    ``forward`` the B/F ratio is assumed equal on all stages, so max F + max B = max T and the time
    equals ``pipeline_1f1b_time``: GPipe and 1F1B have the same bubble; 1F1B only bounds memory.

    Args:
        stable: T, shape ``(..., S)``.
        delta: D, broadcastable to ``stable``.
        num_microbatches: G >= 1.
        forward: optional forward part F of T, same shape as ``stable`` (0 <= F <= T).
    """
    if forward is None:
        return pipeline_1f1b_time(stable, delta, num_microbatches)
    t, d = _stages(stable, delta)
    f = np.broadcast_to(np.asarray(forward, dtype=np.float64), t.shape)
    if np.any(f < 0) or np.any(f > t * (1 + 1e-12)):
        raise ValueError("forward must satisfy 0 <= forward <= stable")
    g = np.asarray(num_microbatches, dtype=np.float64)
    if np.any(g < 1):
        raise ValueError("num_microbatches must be >= 1")
    peak = f.max(axis=-1) + (t - f).max(axis=-1)
    return t.sum(axis=-1) + (g - 1) * peak + exposed_delta(t, d)


def pipeline_time(
    stable: ArrayLike, delta: ArrayLike, num_microbatches: ArrayLike, schedule: ScheduleName = "1f1b"
) -> np.ndarray:
    """Dispatch to ``pipeline_1f1b_time`` or ``pipeline_gpipe_time`` by schedule name.

    ``"1f1b-eager"`` runs the same per-stage order of work as 1F1B, so Mist's 1F1B formula describes it.
    """
    if schedule in ("1f1b", "1f1b-eager"):
        return pipeline_1f1b_time(stable, delta, num_microbatches)
    if schedule == "gpipe":
        return pipeline_gpipe_time(stable, delta, num_microbatches)
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {list(SCHEDULE_NAMES)}")


def bubble_fraction(num_stages: ArrayLike, num_microbatches: ArrayLike, schedule: ScheduleName = "1f1b") -> np.ndarray:
    """Idle fraction of each stage of a pipeline of equal stages: ``(S - 1) / (G + S - 1)``, for GPipe and
    1F1B alike (1F1B only bounds the activations in flight). Vectorised."""
    if schedule not in SCHEDULE_NAMES:
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}: use one of {SCHEDULE_NAMES}")
    s = np.asarray(num_stages, dtype=np.float64)
    g = np.asarray(num_microbatches, dtype=np.float64)
    if np.any(s < 1) or np.any(g < 1):
        raise ValueError("num_stages and num_microbatches must be >= 1")
    return (s - 1) / (g + s - 1)


__all__ = ["bubble_fraction", "exposed_delta", "fill_share", "pipeline_1f1b_time", "pipeline_gpipe_time",
           "pipeline_time", "v_fill_share"]
