"""Tests for mistjax.tuning.milp: inter-stage MILP against brute force, cuts, limits and imbalance."""

from __future__ import annotations

import warnings

import cvxpy as cp
import numpy as np
import pytest

from mistjax.tuning import milp
from mistjax.tuning.milp import (
    InterStageSolution,
    brute_force_inter_stage,
    default_layer_options,
    pipeline_objective,
    solve_inter_stage,
)
from mistjax.tuning.pareto import sample_pareto

RTOL = 1e-6


def _random_case(seed: int) -> dict:
    """Small random instance: S <= 4 stages, <= 3 layer options, K <= 4 candidates, some infeasible."""
    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 5))
    J = int(rng.integers(1, 4))
    K = int(rng.integers(1, 5))
    G = int(rng.choice([1, 4, 16]))
    options = sorted(rng.choice(np.arange(1, 6), size=J, replace=False).tolist())
    per_layer = rng.uniform(0.5, 1.5, (S, 1, 1))
    stable = per_layer * np.asarray(options, float)[None, :, None] * rng.uniform(1.0, 2.0, (S, J, K))
    delta = rng.uniform(0.0, 3.0, (S, J, K)) * np.asarray(options, float)[None, :, None]
    stable[rng.random((S, J, K)) < 0.2] = np.inf
    delta[rng.random((S, J, K)) < 0.05] = np.nan  # NaN counts as infeasible too
    # Mostly reachable totals; the occasional +1 makes some cases infeasible.
    num_layers = int(sum(rng.choice(options) for _ in range(S)) + (rng.random() < 0.1))
    return dict(stable=stable, delta=delta, layer_options=options, num_layers=num_layers, G=G)


def _check_consistent(sol: InterStageSolution, case: dict) -> None:
    stable, delta = case["stable"], case["delta"]
    assert sum(sol.layers) == case["num_layers"]
    for i, (j, k, layers) in enumerate(zip(sol.option_indices, sol.candidates, sol.layers, strict=True)):
        assert case["layer_options"][j] == layers
        assert sol.stable[i] == stable[i][j][k] and sol.delta[i] == delta[i][j][k]
    assert sol.objective == pytest.approx(float(pipeline_objective(sol.stable, sol.delta, case["G"])))


def test_milp_matches_brute_force_on_random_cases() -> None:
    feasible = 0
    for seed in range(40):
        case = _random_case(seed)
        ref = brute_force_inter_stage(**case)
        sol = solve_inter_stage(**case)
        assert (ref is None) == (sol is None), f"seed {seed}: feasibility disagrees"
        if ref is None:
            continue
        feasible += 1
        assert sol.optimal and sol.status == cp.OPTIMAL
        assert sol.objective == pytest.approx(ref.objective, rel=RTOL), f"seed {seed}"
        _check_consistent(sol, case)
        _check_consistent(ref, case)
    assert feasible >= 20


@pytest.mark.parametrize("fill", [0.25, 0.5])
def test_milp_with_a_fill_share_matches_brute_force(fill: float) -> None:
    """Interleaved 1F1B / ZB-H1 objectives (`fill_share` c < 1): the MILP's reductions (dominance, the cut) stay
    exact, and the objective is ``(G - c) T_max + c sum T + max(0, max_i (D_i - c sum_{j<i} T_j))``."""
    feasible = 0
    for seed in range(30):
        case = _random_case(seed)
        ref = brute_force_inter_stage(**case, fill=fill)
        sol = solve_inter_stage(**case, fill=fill)
        assert (ref is None) == (sol is None), f"seed {seed}: feasibility disagrees"
        if ref is None:
            continue
        feasible += 1
        assert sol.objective == pytest.approx(ref.objective, rel=RTOL), f"seed {seed}"
        T, D = np.asarray(sol.stable), np.asarray(sol.delta)
        before = fill * (np.cumsum(T) - T)
        expect = (case["G"] - fill) * T.max() + fill * T.sum() + max(0.0, float(np.max(D - before)))
        assert sol.objective == pytest.approx(expect, rel=1e-12)
        limit = (case["G"] - fill) * T.max() * 0.999  # the cut: (G - c) T_max <= best_cost
        cut = solve_inter_stage(**case, fill=fill, best_cost=limit)
        assert cut is None or (case["G"] - fill) * max(cut.stable) <= limit * (1 + 1e-9)
    assert feasible >= 15
    with pytest.raises(ValueError, match="fill"):
        solve_inter_stage(**_random_case(0), fill=1.5)


@pytest.mark.parametrize("fill", [1.0, 0.5])
def test_milp_with_a_hide_table_matches_brute_force(fill: float) -> None:
    """Deltas hidden behind the earlier stages' backward times H <= T (the executor's drain): the MILP's
    three-way dominance (T, D and the unhidden T - H) stays exact, and H = T is Mist's objective."""
    feasible = 0
    for seed in range(40):
        case = _random_case(seed)
        rng = np.random.default_rng(1000 + seed)
        hide = np.asarray(case["stable"]) * rng.uniform(0.5, 0.8, np.shape(case["stable"]))
        ref = brute_force_inter_stage(**case, fill=fill, hide=hide)
        sol = solve_inter_stage(**case, fill=fill, hide=hide)
        assert (ref is None) == (sol is None), f"seed {seed}: feasibility disagrees"
        if ref is None:
            continue
        feasible += 1
        assert sol.objective == pytest.approx(ref.objective, rel=RTOL), f"seed {seed}"
        T, D, H = (np.asarray(x) for x in (sol.stable, sol.delta, sol.hide))
        expect = (case["G"] - fill) * T.max() + fill * T.sum() + max(0.0, float(np.max(D - fill * (np.cumsum(H) - H))))
        assert sol.objective == pytest.approx(expect, rel=1e-12)
        same = solve_inter_stage(**case, fill=fill, hide=case["stable"])
        assert same.objective == pytest.approx(solve_inter_stage(**case, fill=fill).objective, rel=RTOL)
    assert feasible >= 20


def test_a_delta_hides_behind_the_earlier_stages_backward_in_the_drain() -> None:
    """The executor's 1F1B: each stage finishes its last backward about the earlier stages' backward times
    before the last stage to finish, so a late stage's once-per-step work hides behind those, not behind
    whole micro-batches (equal stages: exact)."""
    from mistjax.core.pipeline_order import group_finish_times, issue_order, op_costs

    S, G = 4, 8
    f, b, d = np.full(S, 1.0), np.full(S, 2.0), np.array([0.0, 0.0, 0.0, 30.0])
    finish = group_finish_times(issue_order("1f1b", S, G), S, op_costs("1f1b", f, b))
    assert list(finish.max() - finish) == [0.0, 2.0, 4.0, 6.0]
    executor = float(np.max(finish + d))
    assert float(pipeline_objective(f + b, d, G, hide=b)) == pytest.approx(executor)  # 57
    assert float(pipeline_objective(f + b, d, G)) < executor  # 54: hidden behind 9 s instead of 6


def test_fill_shares_of_the_schedules() -> None:
    from mistjax.core.pipeline_time import fill_share

    assert fill_share("1f1b") == fill_share("gpipe") == 1.0
    assert fill_share("1f1b", 4) == 0.25  # interleaved: (G + (S-1)/v) T for equal stages
    assert fill_share("zb-h1", 1, 0.25, 2) == pytest.approx(0.5)  # (S-1)(F + B - W): 1 - 2 W/T with W = T/4
    assert fill_share("zb-h1", 1, 0.7) == 0.0 and fill_share("zb-h1", 1, -1.0) == 1.0
    # equal stages: the interleaved bubble is (S-1)/v stage times
    assert float(pipeline_objective([1.0] * 4, [0.0] * 4, 8, fill_share("1f1b", 2))) == pytest.approx(8 + 3 / 2)


@pytest.mark.parametrize("S,G", [(4, 16), (8, 64), (16, 32)])
@pytest.mark.parametrize("schedule,chunks,F,B,W", [("1f1b", 1, 1.0, 2.0, 0.0), ("1f1b", 2, 1.0, 2.0, 0.0),
                                                   ("1f1b", 4, 1.0, 2.0, 0.0), ("zb-h1", 1, 1.0, 1.0, 1.0),
                                                   ("zb-h1", 1, 1.0, 1.4, 0.6)])
def test_fill_shares_are_the_executors_bubbles(S, G, schedule, chunks, F, B, W) -> None:
    """Equal stages of F + B + W per micro-batch: the objective with the schedule's fill share is the makespan of
    the executor's issue order (ZB-H1's B the input gradient, W the deferred weight passes)."""
    from mistjax.core.pipeline_order import group_finish_times, issue_order, op_costs
    from mistjax.core.pipeline_time import fill_share

    T, K = F + B + W, S * chunks
    costs = op_costs(schedule, np.full(K, F / chunks), np.full(K, (B + W) / chunks), np.full(K, W / chunks))
    executor = float(group_finish_times(issue_order(schedule, S, G, chunks), S, costs).max())
    c = fill_share(schedule, chunks, W / T, S)
    assert float(pipeline_objective([T] * S, [0.0] * S, G, c)) == pytest.approx(executor, rel=1e-9)


def test_ragged_candidate_lists() -> None:
    # K differs per (stage, option); nested lists instead of an array.
    stable = [[[1.0, 2.0], [3.0]], [[1.5], [2.5, 2.0, np.inf]]]
    delta = [[[4.0, 0.5], [0.0]], [[2.0], [0.0, 3.0, 0.0]]]
    case = dict(stable=stable, delta=delta, layer_options=[1, 2], num_layers=3, G=4)
    sol = solve_inter_stage(**case)
    ref = brute_force_inter_stage(**case)
    assert sol.objective == pytest.approx(ref.objective, rel=RTOL)
    _check_consistent(sol, case)


def test_infeasible_problems_return_none() -> None:
    s = np.ones((2, 2, 3))
    d = np.zeros((2, 2, 3))
    # No split of 7 layers into two stages from {1, 2}.
    assert solve_inter_stage(s, d, [1, 2], 7, 4) is None
    assert brute_force_inter_stage(s, d, [1, 2], 7, 4) is None
    # Stage 1 has no feasible candidate at all.
    s_bad = s.copy()
    s_bad[1] = np.inf
    assert solve_inter_stage(s_bad, d, [1, 2], 3, 4) is None
    assert brute_force_inter_stage(s_bad, d, [1, 2], 3, 4) is None
    # Only option 2 is feasible for stage 0 and only option 2 for stage 1 -> 4 layers, not 3.
    s_mix = s.copy()
    s_mix[:, 0] = np.inf
    assert solve_inter_stage(s_mix, d, [1, 2], 3, 4) is None
    assert brute_force_inter_stage(s_mix, d, [1, 2], 3, 4) is None


def test_pruning_cut_is_respected() -> None:
    checked = 0
    for seed in range(40):
        case = _random_case(seed)
        if case["G"] == 1:
            continue
        free = brute_force_inter_stage(**case)
        if free is None or free.num_stages < 2:
            continue
        # Just below the unconstrained optimum's bottleneck term: the optimum itself is cut off.
        cut = (case["G"] - 1) * free.t_max * (1 - 1e-9)
        sol = solve_inter_stage(**case, best_cost=cut)
        ref = brute_force_inter_stage(**case, best_cost=cut)
        assert (sol is None) == (ref is None), f"seed {seed}"
        if ref is not None:
            assert (case["G"] - 1) * sol.t_max <= cut
            assert sol.objective == pytest.approx(ref.objective, rel=RTOL)
            assert sol.objective >= free.objective * (1 - RTOL)
        checked += 1
        # A cut below every candidate prunes everything.
        assert solve_inter_stage(**case, best_cost=0.0) is None
    assert checked >= 5
    # G == 1: the cut is 0 <= best_cost.
    s, d = np.ones((1, 1, 1)), np.zeros((1, 1, 1))
    assert solve_inter_stage(s, d, [2], 2, 1, best_cost=-1.0) is None
    assert solve_inter_stage(s, d, [2], 2, 1, best_cost=0.0) is not None


def test_imbalance_awareness_changes_the_layer_split() -> None:
    # Stage 1's delta appears with 2+ layers. It is only partly hidden behind stage 0's fill time.
    opts = [1, 2, 3]
    stable = np.array([[[1.0], [2.0], [3.0]], [[1.0], [2.0], [3.0]]])
    delta = np.array([[[0.0], [0.0], [0.0]], [[0.0], [8.0], [8.0]]])
    aware = solve_inter_stage(stable, delta, opts, 4, 4)
    unaware = solve_inter_stage(stable, np.zeros_like(delta), opts, 4, 4)
    assert unaware.layers == (2, 2)
    assert aware.layers == (3, 1)
    assert aware.objective == pytest.approx(13.0)
    assert float(pipeline_objective(unaware.stable, delta[[0, 1], [1, 1], 0], 4)) == pytest.approx(16.0)


def test_delta_hidden_by_fill_picks_different_candidates_per_stage() -> None:
    # Identical tables for both stages. Candidate 0 is fast with a large delta, candidate 1 is slow
    # with no delta. The last stage's delta hides behind stage 0's fill, so the optimum mixes them,
    # and beats the imbalance-unaware choice (K=1: argmin stable + delta/G) for both stages.
    G = 4
    s_cands, d_cands = np.array([1.0, 1.2]), np.array([1.0, 0.0])
    stable = np.broadcast_to(s_cands, (2, 1, 2))
    delta = np.broadcast_to(d_cands, (2, 1, 2))
    sol = solve_inter_stage(stable, delta, [1], 2, G)
    assert sol.candidates == (1, 0)
    assert sol.objective == pytest.approx(3 * 1.2 + 2.2)

    k1 = int(sample_pareto(s_cands, d_cands, G, 1).indices[0])
    assert k1 == 1
    unaware = float(pipeline_objective([s_cands[k1]] * 2, [d_cands[k1]] * 2, G))
    assert sol.objective < unaware


def test_cost_scale_does_not_change_the_choice() -> None:
    for seed in range(8):
        case = _random_case(seed)
        base = solve_inter_stage(**case)
        if base is None:
            continue
        tiny = solve_inter_stage(**{**case, "stable": case["stable"] * 1e-6, "delta": case["delta"] * 1e-6})
        assert tiny.objective == pytest.approx(base.objective * 1e-6, rel=1e-5)


def test_time_limit_returns_incumbent_with_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    real = milp._run_solver

    def stopped_early(prob: cp.Problem, options: dict) -> str:
        real(prob, options)
        return cp.USER_LIMIT

    monkeypatch.setattr(milp, "_run_solver", stopped_early)
    case = _random_case(4)  # a feasible 3-stage case
    with pytest.warns(RuntimeWarning, match="time limit"):
        sol = solve_inter_stage(**case)
    assert sol is not None and not sol.optimal and sol.status == cp.USER_LIMIT
    _check_consistent(sol, case)


def test_time_limit_without_incumbent_returns_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(milp, "_run_solver", lambda prob, options: cp.USER_LIMIT)  # never solves
    with pytest.warns(RuntimeWarning, match="before finding a feasible"):
        assert solve_inter_stage(**_random_case(4)) is None


def test_solver_error_is_an_early_stop_without_incumbent(monkeypatch: pytest.MonkeyPatch) -> None:
    """cvxpy raises SolverError when HiGHS stops with no point at all (a tiny time limit on a loaded
    machine): that is an early stop without a feasible assignment (None and a warning), not a traceback."""
    def fail(self: cp.Problem, *args: object, **kwargs: object) -> None:
        raise cp.error.SolverError("Solver 'HIGHS' failed.")

    monkeypatch.setattr(cp.Problem, "solve", fail)
    with pytest.warns(RuntimeWarning, match="before finding a feasible"):
        assert solve_inter_stage(**_random_case(4)) is None


def test_real_zero_time_limit_is_handled() -> None:
    rng = np.random.default_rng(0)
    S, opts, K = 8, [4, 5, 6, 7, 8], 30
    stable = rng.uniform(1, 2, (S, len(opts), K)) * np.asarray(opts, float)[None, :, None]
    delta = rng.uniform(0, 10, (S, len(opts), K))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sol = solve_inter_stage(stable, delta, opts, 48, 16, time_limit=0.0)
    if sol is None or not sol.optimal:
        assert any(issubclass(w.category, RuntimeWarning) for w in caught)
    if sol is not None:
        assert sum(sol.layers) == 48


def test_pipeline_objective_formula() -> None:
    # One stage: G * T + D.
    assert float(pipeline_objective([2.0], [3.0], 5)) == pytest.approx(13.0)
    # T = (1, 2, 3), D = (0.5, 4, 1): exposed = max(0.5, 4 - 1, 1 - 3) = 3.
    assert float(pipeline_objective([1.0, 2.0, 3.0], [0.5, 4.0, 1.0], 4)) == pytest.approx(3 * 3 + 6 + 3)
    # Negative deltas never make the exposed term negative.
    assert float(pipeline_objective([1.0, 1.0], [-5.0, -5.0], 2)) == pytest.approx(3.0)
    batched = pipeline_objective(np.ones((4, 3, 2)), np.zeros((4, 3, 2)), 3)
    assert batched.shape == (4, 3) and np.allclose(batched, 4.0)


def test_default_layer_options() -> None:
    assert default_layer_options(32, 4, 8) == (6, 7, 8, 9, 10)
    assert default_layer_options(32, 4, 1) == (8,)
    assert default_layer_options(4, 4, 8) == (1,)
    assert default_layer_options(5, 2, 8) == (1, 2, 3, 4)
    with pytest.raises(ValueError):
        default_layer_options(2, 3, 4)


def test_solves_agree_on_highs_threads_in_one_process() -> None:
    """HiGHS fixes its thread count at a process's first solve; a later solve asking for another fails (cvxpy's
    SolverError, which reads as a stop without a feasible point). Every solve runs with `HIGHS_DEFAULTS`, so a
    direct call, the tuner's calls and a call with other HiGHS options all solve in one process."""
    case = _random_case(4)
    first = solve_inter_stage(**case)
    again = solve_inter_stage(**case, highs_options={"random_seed": 0, "mip_rel_gap": 1e-6})
    assert first is not None and again is not None and again.objective == pytest.approx(first.objective)
    with pytest.raises(ValueError, match="threads"):
        solve_inter_stage(**case, highs_options={"threads": 4})
