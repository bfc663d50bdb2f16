"""Whole-pipeline iteration time from per-stage micro-batch times (Mist section 3.5). Pure NumPy.

Inputs are per-stage arrays with the stage axis LAST, shape ``(..., S)``; leading axes are batch
axes (candidate plans) and ``G`` broadcasts against them.

* ``stable[..., i]`` (T_i): forward + backward time of one ordinary micro-batch on stage i.
* ``delta[..., i]`` (D_i): extra time of the first and last micro-batches of the iteration on stage
  i (repositioned optimizer step, ZeRO-1 all-gather, final gradient reduce-scatter/all-reduce).

What the formula models (checked against brute-force simulation in the tests):

* With D = 0, ``sum T + (G-1) max T`` is exactly the makespan of a flow shop: each micro-batch's
  forward+backward on stage i is one unit of length T_i, units go through stages in order, every
  stage handles micro-batches in order. It equals the real 1F1B schedule (separate F and B, no
  lock-step) when all stages are equal, and was never below it in our random trials when B_i/F_i
  is the same on every stage (real 1F1B can hide part of the fill, so the formula is conservative).
* D_i as a release time (stage i may start its first micro-batch only at D_i, e.g. after its
  repositioned optimizer step): the flow-shop makespan is at most the formula, with equality for
  equal stages. The delta of stage i hides in the ``sum_{j<i} T_j`` that stage i waits anyway.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

Schedule = Literal["1f1b", "gpipe", "1f1b-eager"]
SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "1f1b-eager")


def _stages(stable: ArrayLike, delta: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(stable, dtype=np.float64)
    d = np.asarray(delta, dtype=np.float64)
    if t.ndim == 0 or t.shape[-1] == 0:
        raise ValueError("stable must have a non-empty trailing stage axis")
    t, d = np.broadcast_arrays(t, d)
    return t, d


def _imbalance(t: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``max(0, max_i (D_i - sum_{j<i} T_j))``: the MILP's D_max, whose variable is >= 0."""
    before = np.cumsum(t, axis=-1) - t  # exclusive prefix sum
    return np.maximum(np.max(d - before, axis=-1), 0.0)


def pipeline_1f1b_time(stable: ArrayLike, delta: ArrayLike, num_microbatches: ArrayLike) -> np.ndarray:
    """Mist's 1F1B iteration time: ``sum T + (G-1) max T + max(0, max_i (D_i - sum_{j<i} T_j))``.

    With one stage this is ``G*T + max(D, 0)``; with G = 1 and one stage, T + D (Mist's no-PP
    case; Mist sets D = 0 there and folds the first/last extras into T).

    Args:
        stable: T, shape ``(..., S)``, seconds.
        delta: D, broadcastable to ``stable``.
        num_microbatches: G >= 1, broadcastable to ``stable.shape[:-1]``.

    Returns:
        Seconds, shape ``stable.shape[:-1]`` broadcast with G.
    """
    t, d = _stages(stable, delta)
    g = np.asarray(num_microbatches, dtype=np.float64)
    if np.any(g < 1):
        raise ValueError("num_microbatches must be >= 1")
    return t.sum(axis=-1) + (g - 1) * t.max(axis=-1) + _imbalance(t, d)


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
    return t.sum(axis=-1) + (g - 1) * peak + _imbalance(t, d)


def pipeline_time(
    stable: ArrayLike, delta: ArrayLike, num_microbatches: ArrayLike, schedule: Schedule = "1f1b"
) -> np.ndarray:
    """Dispatch to ``pipeline_1f1b_time`` or ``pipeline_gpipe_time`` by schedule name.

    ``"1f1b-eager"`` (the lock-step executor's packing of 1F1B, `mistjax.runtime.schedules`) runs the
    same per-stage order of work as 1F1B, so Mist's 1F1B formula describes it.
    """
    if schedule in ("1f1b", "1f1b-eager"):
        return pipeline_1f1b_time(stable, delta, num_microbatches)
    if schedule == "gpipe":
        return pipeline_gpipe_time(stable, delta, num_microbatches)
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")


def bubble_fraction(
    num_stages: ArrayLike, num_microbatches: ArrayLike, schedule: Schedule = "1f1b"
) -> np.ndarray:
    """Idle fraction of each stage for equal stages: ``(S-1) / (G+S-1)``, the same for GPipe and 1F1B.

    (Relative to the useful work it is (S-1)/G; this returns the fraction of the iteration.)
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")
    s = np.asarray(num_stages, dtype=np.float64)
    g = np.asarray(num_microbatches, dtype=np.float64)
    if np.any(s < 1) or np.any(g < 1):
        raise ValueError("num_stages and num_microbatches must be >= 1")
    return (s - 1) / (g + s - 1)


def inflight_microbatches(
    stage: ArrayLike, num_stages: ArrayLike, num_microbatches: ArrayLike, schedule: Schedule = "1f1b"
) -> np.ndarray:
    """Micro-batches whose activations stage ``stage`` (0-based) holds at its peak.

    1F1B: ``min(S - stage, G)`` (warm-up forwards S - stage - 1, Mist's p, plus the current one).
    GPipe: G (every forward finishes before the first backward).
    1F1B-eager: ``min(2 (S - stage) - 1, G)`` (backward i waits ``2 (S - stage) - 2`` ticks after forward i).
    """
    st = np.asarray(stage, dtype=np.int64)
    s = np.asarray(num_stages, dtype=np.int64)
    g = np.asarray(num_microbatches, dtype=np.int64)
    if np.any(st < 0) or np.any(st >= s):
        raise ValueError("stage must be in [0, num_stages)")
    if schedule == "1f1b":
        return np.minimum(s - st, g)
    if schedule == "gpipe":
        return np.broadcast_to(g, np.broadcast_shapes(st.shape, s.shape, g.shape)).copy()
    if schedule == "1f1b-eager":
        return np.minimum(2 * (s - st) - 1, g)
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")


def lockstep_microbatch_time(fwd: ArrayLike, bwd: ArrayLike, schedule: Schedule = "1f1b") -> np.ndarray:
    """Steady-state seconds one micro-batch costs a stage in the lock-step executor.

    Each tick lasts as long as its slowest stage (`mistjax.runtime.schedules.lockstep_time`). In classic
    1F1B's steady state a stage runs a forward while its neighbour runs a backward, so a micro-batch
    takes a forward tick and a backward tick, each ``max(fwd, bwd)`` long. GPipe and 1F1B-eager put
    a stage's forward and backward work into ticks of their own kind, so a micro-batch costs
    ``fwd + bwd``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")
    f, b = np.asarray(fwd, dtype=np.float64), np.asarray(bwd, dtype=np.float64)
    return 2.0 * np.maximum(f, b) if schedule == "1f1b" else f + b
