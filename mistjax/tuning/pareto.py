"""Pareto frontier of (stable, delta) stage costs and K-point sampling of it.

The intra-stage tuner evaluates every strategy of a stage exhaustively and gets two costs per strategy:
``stable`` (the steady-state time of one micro-batch) and ``delta`` (the extra time of the first/last
micro-batch). Neither dominates the other in the whole-pipeline time, so the tuner keeps a small set of
frontier points per stage key and leaves the final trade-off to the inter-stage MILP (Mist §5.2-5.3).

Everything here works on the last axis of arrays shaped ``[..., X]``. Leading axes are batch axes (e.g.
``(G, mesh, p, l, c)``), and nothing loops over strategies in Python. Infeasible strategies carry ``+inf``
(or NaN) in either cost. They are never on the frontier and never sampled.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["ParetoSample", "pareto_mask", "sample_pareto"]


class ParetoSample(NamedTuple):
    """K sampled frontier points per batch row.

    Attributes:
        indices: ``int64 [..., K]`` positions along the strategy axis, ``-1`` for empty slots.
        stable: ``float64 [..., K]`` stable cost of each sampled point, ``+inf`` for empty slots.
        delta: ``float64 [..., K]`` delta cost of each sampled point, ``+inf`` for empty slots.
    """

    indices: np.ndarray
    stable: np.ndarray
    delta: np.ndarray


def _as_cost_pair(stable: np.ndarray, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Broadcast the two costs and map every non-finite entry to ``(+inf, +inf)``.

    A strategy that is infeasible in either objective is infeasible as a whole. Sending both coordinates
    to +inf keeps such points at the end of any sort and stops them from dominating anything.
    """
    s, d = np.broadcast_arrays(np.asarray(stable, dtype=np.float64), np.asarray(delta, dtype=np.float64))
    if s.ndim == 0:
        raise ValueError("stable/delta need at least one axis (the strategy axis)")
    feasible = np.isfinite(s) & np.isfinite(d)
    return np.where(feasible, s, np.inf), np.where(feasible, d, np.inf), feasible


def pareto_mask(stable: np.ndarray, delta: np.ndarray, *, keep_duplicates: bool = True) -> np.ndarray:
    """Non-dominated points (minimising both costs) along the last axis.

    Point ``i`` is dominated when some ``j`` has ``stable_j <= stable_i`` and ``delta_j <= delta_i``
    with at least one strict inequality. The method sorts lexicographically by (stable, delta), so it
    costs O(X log X) per row instead of the O(X^2) pairwise test.

    Args:
        stable: ``[..., X]`` first objective. ``inf``/NaN means infeasible.
        delta: ``[..., X]`` second objective (broadcast against ``stable``).
        keep_duplicates: Identical frontier points do not dominate each other, so by default all copies
            are marked. With ``False`` only the copy with the lowest index is kept.

    Returns:
        Boolean array of the broadcast shape, True on the frontier. Infeasible points are always False.
    """
    s, d, feasible = _as_cost_pair(stable, delta)
    n = s.shape[-1]
    if n == 0:
        return np.zeros(s.shape, dtype=bool)

    # Primary key stable, secondary delta. lexsort is stable, so within a run of identical pairs the
    # lowest original index comes first (this is the copy keep_duplicates=False retains).
    order = np.lexsort((d, s), axis=-1)
    ss = np.take_along_axis(s, order, axis=-1)
    ds = np.take_along_axis(d, order, axis=-1)

    new_group = np.ones(s.shape, dtype=bool)
    new_group[..., 1:] = (ss[..., 1:] != ss[..., :-1]) | (ds[..., 1:] != ds[..., :-1])
    # In sorted order, every point lexicographically smaller than point i sits before i's run of
    # identical copies. Such a point dominates i iff its delta <= delta_i, hence i is on the frontier
    # iff delta_i is strictly below the minimum delta over the positions before its run starts.
    pos = np.broadcast_to(np.arange(n), s.shape)
    run_start = np.maximum.accumulate(np.where(new_group, pos, 0), axis=-1)
    prefix_min = np.minimum.accumulate(ds, axis=-1)
    min_before = np.concatenate([np.full(s.shape[:-1] + (1,), np.inf), prefix_min[..., :-1]], axis=-1)
    on_front = ds < np.take_along_axis(min_before, run_start, axis=-1)
    if not keep_duplicates:
        on_front &= new_group

    mask = np.empty(s.shape, dtype=bool)
    np.put_along_axis(mask, order, on_front, axis=-1)
    return mask & feasible


def _default_num_eps(k: int) -> int:
    return k // 2


def _sample_counts(k: int, G: int, num_eps: int | None) -> tuple[int, int]:
    """Slots of the weighted-sum and the epsilon-constraint samplers, after checking the arguments."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if G < 1:
        raise ValueError(f"G must be >= 1, got {G}")
    n_eps = _default_num_eps(k) if num_eps is None else int(num_eps)
    if not 0 <= n_eps <= k - 1:
        raise ValueError(f"num_eps must be in [0, k-1] = [0, {k - 1}], got {n_eps}")
    return k - n_eps, n_eps


def _weighted_sum_picks(sf: np.ndarray, df: np.ndarray, G: int, n_ws: int) -> list[np.ndarray]:
    """``argmin alpha/(1-alpha) * stable + delta/G`` over the frontier, for ``n_ws`` interior alphas."""
    # One vectorised argmin per sample (k <= ~30), not per strategy. This keeps peak memory at the
    # input size rather than k times it.
    picks = []
    for alpha in np.linspace(0.0, 1.0, n_ws + 2)[1:-1]:
        w = alpha / (1.0 - alpha)
        picks.append(np.argmin(w * sf + df / G, axis=-1))
    return picks


def _epsilon_picks(s: np.ndarray, sf: np.ndarray, df: np.ndarray, front: np.ndarray, n_eps: int) -> list[np.ndarray]:
    """``argmin delta`` subject to ``stable <= eps`` over the frontier, ``eps`` spread over its stable range."""
    if not n_eps:
        return []
    s_lo = sf.min(axis=-1)
    # The frontier point with the largest stable is the one with the smallest delta.
    s_hi = np.where(front, s, -np.inf).max(axis=-1)
    ts = np.linspace(0.0, 1.0, n_eps) if n_eps >= 2 else np.array([0.5])
    picks = []
    with np.errstate(invalid="ignore"):  # rows without a frontier give nan bounds, masked by the caller
        for t in ts:
            # Convex combination, so t=0 and t=1 reproduce the end points exactly.
            eps = (1.0 - t) * s_lo + t * s_hi
            # Frontier points are unique, and on the frontier delta falls strictly as stable
            # rises, so the constrained minimiser is unique.
            picks.append(np.argmin(np.where(sf <= eps[..., None], df, np.inf), axis=-1))
    return picks


def _distinct_sorted(idx: np.ndarray, s: np.ndarray, d: np.ndarray, any_front: np.ndarray) -> ParetoSample:
    """The picks ``idx [..., k]`` with repeats and frontier-less rows emptied, sorted by ascending stable."""
    k = idx.shape[-1]
    # An earlier slot already holds the same index: drop this copy.
    same = idx[..., :, None] == idx[..., None, :]
    dup = (same & np.tril(np.ones((k, k), dtype=bool), k=-1)).any(axis=-1)
    valid = ~dup & any_front[..., None]

    sel_s = np.where(valid, np.take_along_axis(s, idx, axis=-1), np.inf)
    sel_d = np.where(valid, np.take_along_axis(d, idx, axis=-1), np.inf)
    idx = np.where(valid, idx, -1)

    order = np.argsort(sel_s, axis=-1, kind="stable")
    return ParetoSample(
        np.take_along_axis(idx, order, axis=-1),
        np.take_along_axis(sel_s, order, axis=-1),
        np.take_along_axis(sel_d, order, axis=-1),
    )


def sample_pareto(
    stable: np.ndarray,
    delta: np.ndarray,
    G: int,
    k: int,
    *,
    num_eps: int | None = None,
) -> ParetoSample:
    """Pick up to ``k`` frontier points per row for the inter-stage MILP.

    Two samplers share the ``k`` slots:

    * **Weighted sum** (``k - num_eps`` points, Mist's sampler): for alpha in
      ``linspace(0, 1, k_ws + 2)[1:-1]`` take ``argmin alpha/(1-alpha) * stable + delta/G``. With
      ``k == 1`` this is alpha = 1/2, i.e. ``argmin stable + delta/G`` (the mean per-micro-batch time,
      which is the imbalance-unaware ablation). A weighted sum only reaches *supported* points, the
      vertices of the frontier's lower convex hull.
    * **Epsilon constraint** (``num_eps`` points, default ``k // 2``): ``argmin delta`` subject to
      ``stable <= eps_j``, with ``eps_j`` spread evenly from the smallest frontier ``stable`` to the
      frontier's ``stable`` at its smallest ``delta`` (both ends included when ``num_eps >= 2``, the
      midpoint when ``num_eps == 1``). Each frontier point solves such a problem, so concave stretches
      of the frontier are reachable too. The MILP objective is not a weighted sum of one stage's
      costs, so a non-supported point can be the best choice for a stage. Mist's optional extra mode
      instead constrains ``stable >= x``. That can return dominated points; the upper-bound form here
      cannot.

    Both samplers run on the frontier only (``pareto_mask``), so every returned point is
    non-dominated, even when rounding makes weighted scores tie. Points chosen twice are
    de-duplicated (index ``-1``, costs ``+inf``). Each row is sorted by ascending ``stable``, and the
    empty slots come last.

    Args:
        stable: ``[..., X]`` stable (steady-state per-micro-batch) cost, ``inf`` = infeasible.
        delta: ``[..., X]`` delta (first/last-micro-batch overhead) cost, ``inf`` = infeasible.
        G: Number of micro-batches (gradient accumulation steps). Delta is amortised over them.
        k: Number of sample slots ``K`` (>= 1).
        num_eps: Slots given to the epsilon-constraint sampler. ``None`` means ``k // 2``. It must be
            ``<= k - 1``, so that at least one weighted-sum point exists.

    Returns:
        ``ParetoSample(indices [..., k], stable [..., k], delta [..., k])``.
    """
    n_ws, n_eps = _sample_counts(k, G, num_eps)
    s, d, _ = _as_cost_pair(stable, delta)
    batch_shape = s.shape[:-1]
    if s.shape[-1] == 0:
        return ParetoSample(
            np.full(batch_shape + (k,), -1, dtype=np.int64),
            np.full(batch_shape + (k,), np.inf),
            np.full(batch_shape + (k,), np.inf),
        )

    front = pareto_mask(s, d, keep_duplicates=False)
    sf = np.where(front, s, np.inf)
    df = np.where(front, d, np.inf)
    picks = _weighted_sum_picks(sf, df, G, n_ws) + _epsilon_picks(s, sf, df, front, n_eps)
    return _distinct_sorted(np.stack(picks, axis=-1).astype(np.int64), s, d, np.asarray(front.any(axis=-1)))
