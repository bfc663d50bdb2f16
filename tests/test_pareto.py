"""Tests for mistjax.tuning.pareto: frontier mask and K-point frontier sampling."""

from __future__ import annotations

import numpy as np
import pytest

from mistjax.tuning.pareto import pareto_mask, sample_pareto


def _reference_mask(stable: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """O(n^2) textbook definition (strict dominance; non-finite points are never on the front)."""
    n = stable.shape[0]
    feasible = np.isfinite(stable) & np.isfinite(delta)
    mask = np.zeros(n, dtype=bool)
    for i in range(n):
        if not feasible[i]:
            continue
        dominated = False
        for j in range(n):
            if not feasible[j]:
                continue
            weakly = stable[j] <= stable[i] and delta[j] <= delta[i]
            if weakly and (stable[j] < stable[i] or delta[j] < delta[i]):
                dominated = True
                break
        mask[i] = not dominated
    return mask


def _random_costs(rng: np.random.Generator, shape: tuple[int, ...], *, integer: bool) -> tuple:
    if integer:  # small integer grid: many ties and exact duplicates
        s = rng.integers(0, 8, shape).astype(float)
        d = rng.integers(0, 8, shape).astype(float)
    else:
        s = rng.gamma(2.0, 1.0, shape)
        d = 1.0 / (s + 0.1) + rng.random(shape)
    s[rng.random(shape) < 0.15] = np.inf
    d[rng.random(shape) < 0.05] = np.nan
    return s, d


@pytest.mark.parametrize("integer", [True, False])
def test_mask_matches_quadratic_reference(integer: bool) -> None:
    rng = np.random.default_rng(0)
    for _ in range(150):
        n = int(rng.integers(1, 60))
        s, d = _random_costs(rng, (n,), integer=integer)
        np.testing.assert_array_equal(pareto_mask(s, d), _reference_mask(s, d), err_msg=f"{s}\n{d}")


def test_mask_batched_equals_rowwise() -> None:
    rng = np.random.default_rng(1)
    s, d = _random_costs(rng, (3, 4, 37), integer=True)
    mask = pareto_mask(s, d)
    assert mask.shape == s.shape
    for idx in np.ndindex(3, 4):
        np.testing.assert_array_equal(mask[idx], _reference_mask(s[idx], d[idx]))


def test_mask_duplicates_and_edge_cases() -> None:
    s = np.array([2.0, 1.0, 2.0, 1.0, np.inf, 3.0])
    d = np.array([1.0, 5.0, 1.0, 5.0, 0.0, 1.0])
    np.testing.assert_array_equal(pareto_mask(s, d), [True, True, True, True, False, False])
    # Only the lowest-index copy survives with keep_duplicates=False.
    np.testing.assert_array_equal(
        pareto_mask(s, d, keep_duplicates=False), [True, True, False, False, False, False]
    )
    assert pareto_mask(np.full(4, np.inf), np.zeros(4)).sum() == 0
    assert pareto_mask(np.zeros((2, 0)), np.zeros((2, 0))).shape == (2, 0)
    # Broadcasting: one delta vector shared by a batch of stable rows.
    assert pareto_mask(np.ones((5, 3)), np.array([3.0, 2.0, 1.0])).sum(axis=-1).tolist() == [1] * 5
    with pytest.raises(ValueError):
        pareto_mask(np.float64(1.0), np.float64(1.0))


@pytest.mark.parametrize("G", [1, 4, 16])
def test_sample_k1_is_imbalance_unaware_argmin(G: int) -> None:
    rng = np.random.default_rng(G)
    for integer in (True, False):
        s, d = _random_costs(rng, (6, 5, 40), integer=integer)
        s[0, 0] = d[0, 0] = np.inf  # a row with no feasible point at all
        out = sample_pareto(s, d, G, 1)
        assert out.indices.shape == (6, 5, 1)
        feasible = np.isfinite(s) & np.isfinite(d)
        expected = np.argmin(np.where(feasible, s + d / G, np.inf), axis=-1)
        expected = np.where(feasible.any(axis=-1), expected, -1)
        np.testing.assert_array_equal(out.indices[..., 0], expected)


@pytest.mark.parametrize("k", [2, 5, 30])
def test_sample_returns_only_unique_frontier_points(k: int) -> None:
    rng = np.random.default_rng(k)
    s, d = _random_costs(rng, (4, 3, 80), integer=False)
    s[1, 2] = np.inf  # fully infeasible row
    out = sample_pareto(s, d, 4, k)
    assert out.indices.shape == out.stable.shape == out.delta.shape == (4, 3, k)
    front = pareto_mask(s, d)
    for idx in np.ndindex(4, 3):
        ids, ss, dd = out.indices[idx], out.stable[idx], out.delta[idx]
        valid = ids >= 0
        assert front[idx][ids[valid]].all(), "sampled a dominated point"
        assert len(set(ids[valid].tolist())) == valid.sum(), "duplicate index"
        np.testing.assert_array_equal(ss[valid], s[idx][ids[valid]])
        np.testing.assert_array_equal(dd[valid], d[idx][ids[valid]])
        assert np.isinf(ss[~valid]).all() and np.isinf(dd[~valid]).all()
        # Valid slots first, sorted by stable.
        assert np.all(valid[:-1] >= valid[1:])
        assert np.all(np.diff(ss[valid]) >= 0)
        assert valid.sum() <= min(k, front[idx].sum())
    assert (out.indices[1, 2] == -1).all()


def test_sample_covers_small_front_completely() -> None:
    s = np.array([1.0, 2.0, 3.0, 2.5, 9.0])
    d = np.array([3.0, 2.0, 1.0, 2.5, 9.0])
    out = sample_pareto(s, d, 1, 10)
    assert sorted(out.indices[out.indices >= 0].tolist()) == [0, 1, 2]
    assert (out.indices >= 0).sum() == 3


def test_epsilon_points_reach_non_supported_frontier_point() -> None:
    # (6, 6) is on the frontier but above the segment (0,10)-(10,0): no weighted sum selects it.
    s = np.array([0.0, 10.0, 6.0])
    d = np.array([10.0, 0.0, 6.0])
    ws_only = sample_pareto(s, d, 1, 8, num_eps=0)
    assert 2 not in ws_only.indices.tolist()
    mixed = sample_pareto(s, d, 1, 8)  # default num_eps = 4 -> eps in {0, 10/3, 20/3, 10}
    assert 2 in mixed.indices.tolist()


def test_sample_shapes_and_validation() -> None:
    s = np.random.default_rng(0).random((2, 3, 7, 50))
    out = sample_pareto(s, 1.0 / s, 16, 4)
    assert out.indices.shape == (2, 3, 7, 4) and out.indices.dtype == np.int64
    empty = sample_pareto(np.zeros((3, 0)), np.zeros((3, 0)), 4, 2)
    assert empty.indices.shape == (3, 2) and (empty.indices == -1).all()
    with pytest.raises(ValueError):
        sample_pareto(s, s, 4, 0)
    with pytest.raises(ValueError):
        sample_pareto(s, s, 4, 3, num_eps=3)
    with pytest.raises(ValueError):
        sample_pareto(s, s, 0, 3)
