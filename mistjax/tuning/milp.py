"""Inter-stage MILP: split the layers over pipeline stages and pick one Pareto candidate per stage.

Given, for every stage slot ``i`` and every allowed layer count ``layer_options[j]``, a short list of
``K`` intra-stage candidates ``(stable, delta)`` (from ``pareto.sample_pareto``), choose one layer count
and one candidate per stage to minimise the 1F1B pipeline time with imbalance (Mist §3.5, §5.4):

    T_iter = (G - 1) * max_i T_i + sum_i T_i + max(0, max_i (D_i - sum_{j<i} T_j))

A stage's delta (the extra cost of its first/last micro-batch) can hide behind the fill/drain time of
the stages before it. That is why the model carries ``D_max`` and not a plain sum. Interleaved 1F1B and
ZB-H1 expose a share c < 1 of each stage's time in the fill and drain (``fill``,
`core.pipeline_time.fill_share`): ``(G - c) max T + c sum T`` with the fill ``c sum_{j<i} T_j``.

The MILP is built with cvxpy and solved with HiGHS. ``brute_force_inter_stage`` enumerates every
assignment and exists for tests and tiny cases. Both score assignments with ``pipeline_objective``, so
the formula lives in one place.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import cvxpy as cp
import numpy as np
import scipy.sparse as sp

from mistjax.core.pipeline_time import exposed_delta
from mistjax.core.pipeline_time import pipeline_1f1b_time as pipeline_objective
from mistjax.tuning.pareto import pareto_mask

__all__ = [
    "InterStageSolution",
    "brute_force_inter_stage",
    "default_layer_options",
    "pipeline_objective",
    "solve_inter_stage",
]

# cvxpy statuses under which HiGHS stopped early (time limit etc.) but may hold an incumbent.
_EARLY_STOP_STATUSES = (cp.USER_LIMIT, cp.OPTIMAL_INACCURATE)
# HighsInfo.primal_solution_status value meaning "feasible point available".
_HIGHS_SOLUTION_FEASIBLE = 2

# Per-stage cost table: CostTable[i][j] is a 1-D array over the K candidates of stage i with
# layer_options[j] layers. Ragged K across (i, j) is allowed.
CostTable = Sequence[Sequence[Sequence[float] | np.ndarray]] | np.ndarray


@dataclass(frozen=True)
class InterStageSolution:
    """One pipeline partition and the per-stage candidates it uses.

    Attributes:
        layers: Layer count of each stage, ``sum(layers) == num_layers``.
        option_indices: Index ``j`` into ``layer_options`` chosen for each stage.
        candidates: Index ``k`` of the chosen candidate in ``stable[i][j]`` for each stage.
        stable: ``T_i``, the chosen stable cost of each stage.
        delta: ``D_i``, the chosen delta cost of each stage.
        objective: ``pipeline_objective(stable, delta, G)`` of this assignment. It is recomputed in
            float64 from the input tables, not read back from the solver.
        status: cvxpy status string (``"optimal"``, ``"user_limit"``, ...), or ``"brute_force"``.
        solve_time: Seconds inside the solver, as HiGHS reports it (enumeration time for brute force).
        wall_time: Seconds for the whole call: model build, solve and decoding.
        optimal: True when the solver proved optimality (within ``mip_rel_gap``), or for brute force.
    """

    layers: tuple[int, ...]
    option_indices: tuple[int, ...]
    candidates: tuple[int, ...]
    stable: tuple[float, ...]
    delta: tuple[float, ...]
    objective: float
    status: str
    solve_time: float
    wall_time: float
    optimal: bool
    hide: tuple[float, ...] = ()  # H_i of the chosen candidates (empty: T_i, Mist's formula)

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages S."""
        return len(self.layers)

    @property
    def t_max(self) -> float:
        """Bottleneck stable time ``max_i T_i``."""
        return max(self.stable)

    @property
    def d_max(self) -> float:
        """Exposed delta ``max(0, max_i D_i - sum_{j<i} H_j)`` (H: `hide`, else T) at c = 1."""
        return float(exposed_delta(np.asarray(self.stable), np.asarray(self.delta),
                                   hide=np.asarray(self.hide) if self.hide else None))


def default_layer_options(num_layers: int, num_stages: int, G: int) -> tuple[int, ...]:
    """Mist's per-stage layer-count window around an even split (§5.4).

    ``[max(1, round(L/S) - 2), min(round(L/S) + 2, L - S + 1)]``, or only ``round(L/S)`` when ``G == 1``
    (Mist's rule; with one micro-batch there is no steady state to balance).
    """
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"need 1 <= num_stages <= num_layers, got S={num_stages}, L={num_layers}")
    mid = math.floor(num_layers / num_stages + 0.5)
    if G == 1:
        return (mid,)
    return tuple(range(max(1, mid - 2), min(mid + 2, num_layers - num_stages + 1) + 1))


def _normalise_tables(
    stable: CostTable, delta: CostTable, layer_options: Sequence[int], hide: CostTable | None = None
) -> list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Per (stage, option) pair of float64 1-D cost arrays (T, D, H; H = T without ``hide``), with every
    candidate whose T or D is not finite set to inf."""
    num_options = len(layer_options)
    if num_options == 0 or any(int(x) != x or x < 0 for x in layer_options):
        raise ValueError(f"layer_options must be non-empty non-negative integers, got {layer_options}")
    if len(stable) != len(delta) or (hide is not None and len(hide) != len(stable)):
        raise ValueError(f"stable has {len(stable)} stages but delta has {len(delta)}"
                         + ("" if hide is None else f" and hide {len(hide)}"))
    if len(stable) == 0:
        raise ValueError("need at least one stage")
    tables = []
    for i, (s_row, d_row) in enumerate(zip(stable, delta, strict=True)):
        h_row = s_row if hide is None else hide[i]
        if len(s_row) != num_options or len(d_row) != num_options or len(h_row) != num_options:
            raise ValueError(
                f"stage {i}: expected {num_options} layer options, got {len(s_row)} (stable) / "
                f"{len(d_row)} (delta) / {len(h_row)} (hide)"
            )
        row = []
        for j, (s_ij, d_ij, h_ij) in enumerate(zip(s_row, d_row, h_row, strict=True)):
            s = np.asarray(s_ij, dtype=np.float64).reshape(-1)
            d = np.asarray(d_ij, dtype=np.float64).reshape(-1)
            h = np.asarray(h_ij, dtype=np.float64).reshape(-1)
            if s.shape != d.shape or s.shape != h.shape:
                raise ValueError(f"stage {i}, option {j}: stable {s.shape} vs delta {d.shape} vs hide {h.shape}")
            ok = np.isfinite(s) & np.isfinite(d)
            row.append((np.where(ok, s, np.inf), np.where(ok, d, np.inf), np.where(ok, h, np.inf)))
        tables.append(row)
    return tables


def _undominated(s: np.ndarray, d: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Candidates of one (stage, option) that no other beats in every assignment, ties kept at the lower index.

    Swapping candidate k for k' changes the objective by at most ``c (T' - T) + c max(0, H - H')`` plus
    ``D' - D`` where stage i's own delta is the exposed one: with ``T' <= T``, ``D' <= D`` and
    ``T' - H' <= T - H`` nothing grows. With H = T (Mist's formula) this is the (T, D) Pareto frontier.
    """
    if np.array_equal(s, h):
        return pareto_mask(s, d, keep_duplicates=False)
    with np.errstate(invalid="ignore"):  # inf - inf for infeasible candidates: NaN, which dominates nothing
        f = s - h  # what of the micro-batch hides nothing (the forward)
    n = s.size
    at_least = ((s[None, :] <= s[:, None]) & (d[None, :] <= d[:, None]) & (f[None, :] <= f[:, None]))
    better = (s[None, :] < s[:, None]) | (d[None, :] < d[:, None]) | (f[None, :] < f[:, None])
    earlier = np.arange(n)[None, :] < np.arange(n)[:, None]
    np.fill_diagonal(at_least, False)
    return np.isfinite(s) & np.isfinite(d) & ~np.any(at_least & (better | earlier), axis=1)


def _layer_split_possible(usable: list[list[bool]], layer_options: Sequence[int], num_layers: int) -> bool:
    """Whether some choice of usable option per stage sums to ``num_layers`` (subset-sum DP)."""
    reachable = {0}
    for row in usable:
        # Layer counts are non-negative, so partial sums above num_layers can never come back down.
        reachable = {
            r + layer_options[j]
            for r in reachable
            for j, ok in enumerate(row)
            if ok and r + layer_options[j] <= num_layers
        }
        if not reachable:
            return False
    return num_layers in reachable


def _cut_allows(s: np.ndarray, G: int, best_cost: float | None, fill: float = 1.0) -> np.ndarray:
    """Candidates that can satisfy the pruning cut ``(G-c) * T_max <= best_cost`` (T_max >= own T)."""
    if best_cost is None:
        return np.ones(s.shape, dtype=bool)
    with np.errstate(invalid="ignore"):  # 0 * inf for infeasible entries when G == c
        return (G - fill) * s <= best_cost


# Every solve: one thread (HiGHS fixes its thread count at the first solve in a process, and a later solve
# asking for another fails: cvxpy's SolverError), seed 0 (the same plan whatever the machine).
HIGHS_DEFAULTS = {"threads": 1, "random_seed": 0}

_BANNER_SILENCED: list[bool] = []


def _silence_highs_banner() -> None:
    """HiGHS prints its copyright banner to the C-level stdout when the process's first solver is built,
    whatever the log options say: build that first one with stdout pointed at /dev/null."""
    if _BANNER_SILENCED:
        return
    _BANNER_SILENCED.append(True)
    try:
        import highspy
    except ImportError:
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _run_solver(prob: cp.Problem, options: dict) -> str:
    """Solve with HiGHS and return the cvxpy status (a seam that tests can patch)."""
    if not options.get("verbose"):
        _silence_highs_banner()
    with warnings.catch_warnings():
        # cvxpy warns "Solution may be inaccurate" on a time limit. We issue our own, clearer warning.
        warnings.filterwarnings("ignore", message="Solution may be inaccurate", category=UserWarning)
        try:
            prob.solve(solver=cp.HIGHS, **options)
        except cp.error.SolverError:
            # cvxpy raises when HiGHS stops (its time limit, on a loaded machine a tiny one) with no point
            # at all: that is an early stop without a feasible assignment, which the caller handles.
            return cp.USER_LIMIT
    return prob.status


@dataclass(frozen=True)
class _Triples:
    """The usable (stage i, option j, candidate k) triples of the MILP, one entry per triple."""

    stage: np.ndarray  # i of each triple
    option: np.ndarray  # j: index into layer_options
    candidate: np.ndarray  # k: index into the (i, j) cost arrays
    stable: np.ndarray  # s_ijk, as the tables give it (unscaled)
    delta: np.ndarray  # d_ijk, unscaled
    hide: np.ndarray  # h_ijk, unscaled (s_ijk without a hide table)

    @property
    def size(self) -> int:
        """Number of triples (binary variables of the model)."""
        return int(self.stable.size)


def _usable_triples(tables: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]], layer_options: Sequence[int],
                    num_layers: int, G: int, best_cost: float | None, fill: float = 1.0) -> _Triples | None:
    """The triples the MILP keeps (see `_InterStageModel`), or None when they allow no layer split."""
    parts: list[tuple[np.ndarray, ...]] = []
    usable = [[False] * len(layer_options) for _ in tables]
    for i, row in enumerate(tables):
        for j, (s, d, h) in enumerate(row):
            keep = _undominated(s, d, h) & _cut_allows(s, G, best_cost, fill)
            ks = np.flatnonzero(keep)
            if ks.size == 0:
                continue
            usable[i][j] = True
            parts.append((np.full(ks.size, i), np.full(ks.size, j), ks, s[ks], d[ks], h[ks]))
    # No usable triple at all leaves no reachable layer sum, so `parts` is non-empty past this check.
    if not _layer_split_possible(usable, layer_options, num_layers):
        return None
    return _Triples(*(np.concatenate(column) for column in zip(*parts, strict=True)))


class _Coefficients(NamedTuple):
    """The MILP's constant matrices over the triples, costs divided by ``scale``."""

    onehot: sp.csr_matrix  # [S, n]: row i selects stage i's triples
    stable: sp.csr_matrix  # [S, n]: T = stable @ z
    exposed: sp.csr_matrix  # [S, n]: D_i - c sum_{j<i} H_j = exposed @ z
    layers: np.ndarray  # [n]: layer count of each triple
    stable_sum: np.ndarray  # [n]: c sum_i T_i = stable_sum @ z (c: the fill share)
    scale: float  # the costs' divisor


def _coefficients(triples: _Triples, num_stages: int, layer_options: Sequence[int], fill: float) -> _Coefficients:
    """The constant matrices of the model, with the costs rescaled to O(1).

    The rescaling makes HiGHS's absolute tolerances mean the same thing whether the tables are in
    seconds or microseconds. The reported objective is recomputed unscaled.
    """
    S, n = num_stages, triples.size
    scale = float(max(np.abs(triples.stable).max(), np.abs(triples.delta).max()))
    scale = scale if scale > 0 else 1.0
    s_sc, d_sc = triples.stable / scale, triples.delta / scale
    cols = np.arange(n)
    onehot = sp.csr_matrix((np.ones(n), (triples.stage, cols)), shape=(S, n))
    Ms = sp.csr_matrix((s_sc, (triples.stage, cols)), shape=(S, n))
    Md = sp.csr_matrix((d_sc, (triples.stage, cols)), shape=(S, n))
    Mh = sp.csr_matrix((triples.hide / scale, (triples.stage, cols)), shape=(S, n))
    prefix = sp.csr_matrix(np.tril(np.ones((S, S)), k=-1))  # row i sums stages j < i
    exposed = (Md - fill * (prefix @ Mh)).tocsr()
    layers = np.asarray(layer_options, dtype=np.float64)[triples.option]
    return _Coefficients(onehot, Ms, exposed, layers, fill * s_sc, scale)


@dataclass(frozen=True)
class _InterStageModel:
    """The inter-stage MILP (Mist §3.5, §5.4) over the usable (stage i, option j, candidate k) triples.

    * ``z_ijk`` binary: stage i runs ``layer_options[j]`` layers with candidate k.
    * ``sum_{j,k} z_ijk = 1`` for each i, and ``sum_{i,j,k} layer_options[j] z_ijk = num_layers``.
      Mist's separate layer binaries ``l_ij`` (with ``z_ijk <= l_ij``) are implied by these and left
      out.
    * ``T_i = sum s_ijk z_ijk``, ``D_i = sum d_ijk z_ijk`` as affine expressions (not variables).
    * ``T_max >= T_i``, ``D_max >= D_i - c sum_{j<i} H_j``, ``D_max >= 0`` (H: what of a stage's micro-batch
      its successors' deltas hide behind, its backward; T without a hide table). Optionally
      ``(G-c) T_max <= best_cost``.
    * minimise ``(G-c) T_max + c sum_i T_i + D_max`` (c: the fill share, 1 for 1F1B).

    Two reductions (`_usable_triples`) shrink the model without losing the optimum:

    * Infeasible (inf/NaN) candidates get no variable, and neither do candidates that alone break the
      pruning cut.
    * Within one (i, j) only the distinct non-dominated candidates are kept (`_undominated`): a candidate
      no worse in T, D and the unhidden part T - H can always be swapped in. With H = T: raising ``T_i`` by
      e adds c e to the sum and lowers ``D_max`` by at most c e, so the (T, D) frontier.

    No stage-symmetry breaking is applied. Stage slots have their own tables, and the exposed-delta
    term depends on stage order, so swapping stages is not a symmetry in general.
    """

    problem: cp.Problem
    z: cp.Variable  # [n] boolean, one per triple
    t_max: cp.Variable  # scalar, scaled seconds
    d_max: cp.Variable  # scalar, non-negative, scaled seconds

    @classmethod
    def build(cls, triples: _Triples, num_stages: int, layer_options: Sequence[int], num_layers: int, G: int,
              best_cost: float | None, fill: float = 1.0) -> _InterStageModel:
        """Variables, constraints and objective of the model over ``triples``."""
        c = _coefficients(triples, num_stages, layer_options, fill)
        z = cp.Variable(triples.size, boolean=True)
        t_max = cp.Variable()
        d_max = cp.Variable(nonneg=True)
        constraints = [
            c.onehot @ z == 1,
            c.layers @ z == num_layers,
            c.stable @ z <= t_max,
            c.exposed @ z <= d_max,
        ]
        if best_cost is not None and fill < G:
            # Already implied by the candidate filter (T_max can equal max_i T_i). It stays in the
            # model so that the model states the cut.
            constraints.append((G - fill) * t_max <= best_cost / c.scale)
        problem = cp.Problem(cp.Minimize((G - fill) * t_max + c.stable_sum @ z + d_max), constraints)
        return cls(problem, z, t_max, d_max)

    def solve(self, time_limit: float, mip_rel_gap: float, verbose: bool,
              highs_options: dict | None) -> tuple[str, float]:
        """Run HiGHS; the cvxpy status and the seconds HiGHS reports it spent."""
        options = {"time_limit": float(time_limit), "mip_rel_gap": float(mip_rel_gap), "verbose": verbose,
                   **HIGHS_DEFAULTS, **(highs_options or {})}
        if options["threads"] != HIGHS_DEFAULTS["threads"]:
            raise ValueError(f"highs_options threads={options['threads']}: HiGHS fixes its thread count at the "
                             "process's first solve, and mistjax solves with one thread; leave threads out")
        status = _run_solver(self.problem, options)
        stats = self.problem.solver_stats
        return status, (float(stats.solve_time or 0.0) if stats else 0.0)


def _solution(triples: _Triples, chosen: np.ndarray, layer_options: Sequence[int], num_layers: int, G: int,
              fill: float, status: str, solve_time: float, t_start: float) -> InterStageSolution:
    """The `InterStageSolution` of the chosen triples (one per stage), its objective recomputed unscaled."""
    sel = chosen[np.argsort(triples.stage[chosen])]
    layers = tuple(int(layer_options[j]) for j in triples.option[sel])
    if sum(layers) != num_layers:
        raise RuntimeError(f"decoded layer split {layers} does not sum to {num_layers}")
    T, D, H = triples.stable[sel], triples.delta[sel], triples.hide[sel]
    return InterStageSolution(
        layers=layers,
        option_indices=tuple(int(j) for j in triples.option[sel]),
        candidates=tuple(int(k) for k in triples.candidate[sel]),
        stable=tuple(float(t) for t in T),
        delta=tuple(float(x) for x in D),
        objective=float(pipeline_objective(T, D, G, fill, H)),
        status=str(status),
        solve_time=solve_time,
        wall_time=time.perf_counter() - t_start,
        optimal=status == cp.OPTIMAL,
        hide=tuple(float(x) for x in H),
    )


def solve_inter_stage(stable: CostTable, delta: CostTable, layer_options: Sequence[int], num_layers: int, G: int, *,
                      time_limit: float = 10.0, best_cost: float | None = None, mip_rel_gap: float = 1e-6,
                      verbose: bool = False, highs_options: dict | None = None,
                      fill: float = 1.0, hide: CostTable | None = None) -> InterStageSolution | None:
    """Optimal layer split and per-stage candidate choice by MILP (cvxpy + HiGHS).

    The model (binaries per usable (stage, option, candidate) triple, the 1F1B objective with
    ``T_max`` / ``D_max``, and the two reductions that shrink it without losing the optimum) is
    described on `_InterStageModel`.

    Args:
        stable: ``stable[i][j]`` = 1-D array over candidates of stage slot i with ``layer_options[j]``
            layers. ``inf``/NaN = infeasible. An ``[S, J, K]`` array also works.
        delta: Same layout as ``stable``.
        layer_options: Allowed per-stage layer counts, shared by all stages.
        num_layers: Total number of layers L to distribute.
        G: Number of micro-batches.
        time_limit: HiGHS wall-clock limit in seconds.
        best_cost: Pruning cut from the outer search: require ``(G-c) * T_max <= best_cost``.
        mip_rel_gap: HiGHS relative optimality gap. The small default makes "optimal" mean optimal
            for any practical purpose.
        verbose: Print the HiGHS log.
        highs_options: Extra HiGHS options passed through cvxpy (e.g. ``{"threads": 1}``).
        fill: c, the schedule's `core.pipeline_time.fill_share`: the objective is
            ``(G-c) T_max + c sum_i T_i + max(0, max_i (D_i - c sum_{j<i} H_j))`` (1: Mist's 1F1B formula).
        hide: H, same layout as ``stable``: what of each candidate's micro-batch a later stage's delta hides
            behind in the drain (its backward time, `core.pipeline_time.exposed_delta`); None: T (Mist's).

    Returns:
        The best assignment found, or ``None`` when none exists: the problem is infeasible, the cut
        excludes everything, or the time limit passed before any feasible point was found (this last
        case also warns). When the time limit stops the solver after it found a feasible point, the
        result has ``optimal=False`` and a ``RuntimeWarning`` is issued.
    """
    t_start = time.perf_counter()
    if G < 1:
        raise ValueError(f"G must be >= 1, got {G}")
    tables = _normalise_tables(stable, delta, layer_options, hide)
    if best_cost is not None and G == 1 and best_cost < 0:
        return None  # the cut reads 0 <= best_cost
    if not 0.0 <= fill <= 1.0:
        raise ValueError(f"fill must be in [0, 1], got {fill}")
    triples = _usable_triples(tables, layer_options, num_layers, G, best_cost, fill)
    if triples is None:
        return None
    model = _InterStageModel.build(triples, len(tables), layer_options, num_layers, G, best_cost, fill)
    status, solve_time = model.solve(time_limit, mip_rel_gap, verbose, highs_options)
    if status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
        return None
    if status != cp.OPTIMAL and status not in _EARLY_STOP_STATUSES:
        raise RuntimeError(f"HiGHS failed on the inter-stage MILP: cvxpy status {status!r}")
    chosen = _decode(model.z.value, model.problem, triples.stage, len(tables))
    if chosen is None:
        if status == cp.OPTIMAL:
            raise RuntimeError("HiGHS reported optimal but returned no valid assignment")
        warnings.warn(f"inter-stage MILP stopped ({status}, time_limit={time_limit}s) before finding a feasible "
                      "assignment; returning None", RuntimeWarning, stacklevel=2)
        return None
    sol = _solution(triples, chosen, layer_options, num_layers, G, fill, status, solve_time, t_start)
    if not sol.optimal:
        warnings.warn(f"inter-stage MILP hit its time limit ({time_limit:.2g} s, HiGHS status {status}); returning "
                      "the best feasible assignment found, which may not be optimal", RuntimeWarning, stacklevel=2)
    return sol


def _decode(z_value: np.ndarray | None, prob: cp.Problem, stage_of: np.ndarray, S: int) -> np.ndarray | None:
    """Flat indices of the chosen triples, one per stage, or None if the solver holds no valid point.

    On an early stop HiGHS can hand back a point that is not feasible, even all zeros, so the
    one-candidate-per-stage structure is checked here, not assumed.
    """
    info = getattr(prob.solver_stats, "extra_stats", None)
    primal_status = getattr(info, "primal_solution_status", _HIGHS_SOLUTION_FEASIBLE)
    if z_value is None or primal_status != _HIGHS_SOLUTION_FEASIBLE:
        return None
    z_value = np.asarray(z_value).reshape(-1)
    if z_value.shape != stage_of.shape:
        return None
    chosen = np.flatnonzero(z_value > 0.5)
    if chosen.size != S or np.bincount(stage_of[chosen], minlength=S).max() != 1:
        return None
    return chosen


def brute_force_inter_stage(
    stable: CostTable,
    delta: CostTable,
    layer_options: Sequence[int],
    num_layers: int,
    G: int,
    *,
    best_cost: float | None = None,
    fill: float = 1.0,
    hide: CostTable | None = None,
) -> InterStageSolution | None:
    """Exact reference for ``solve_inter_stage`` by full enumeration (tests and tiny cases only).

    Cost grows as ``J^S * K^S``. Every layer split is enumerated, and for each split every candidate
    combination is scored at once with ``pipeline_objective``. Dominated candidates are *not* pruned,
    so this also checks the MILP's reductions.
    """
    t_start = time.perf_counter()
    if G < 1:
        raise ValueError(f"G must be >= 1, got {G}")
    tables = _normalise_tables(stable, delta, layer_options, hide)
    S = len(tables)
    best: tuple[float, tuple[int, ...], tuple[int, ...], np.ndarray, np.ndarray, np.ndarray] | None = None
    for split in itertools.product(range(len(layer_options)), repeat=S):
        if sum(layer_options[j] for j in split) != num_layers:
            continue
        feas = [np.flatnonzero(np.isfinite(tables[i][j][0])) for i, j in enumerate(split)]
        if any(f.size == 0 for f in feas):
            continue
        grids = np.meshgrid(*feas, indexing="ij")
        combo = np.stack([g.reshape(-1) for g in grids], axis=-1)  # [N, S] candidate indices
        T = np.stack([tables[i][j][0][combo[:, i]] for i, j in enumerate(split)], axis=-1)
        D = np.stack([tables[i][j][1][combo[:, i]] for i, j in enumerate(split)], axis=-1)
        H = np.stack([tables[i][j][2][combo[:, i]] for i, j in enumerate(split)], axis=-1)
        obj = pipeline_objective(T, D, G, fill, H)
        if best_cost is not None:
            obj = np.where((G - fill) * T.max(axis=-1) <= best_cost, obj, np.inf)
        a = int(np.argmin(obj))
        if np.isfinite(obj[a]) and (best is None or obj[a] < best[0]):
            best = (float(obj[a]), split, tuple(int(k) for k in combo[a]), T[a], D[a], H[a])
    if best is None:
        return None
    objective, split, cands, T, D, H = best
    elapsed = time.perf_counter() - t_start
    return InterStageSolution(
        layers=tuple(int(layer_options[j]) for j in split),
        option_indices=tuple(split),
        candidates=cands,
        stable=tuple(float(t) for t in T),
        delta=tuple(float(x) for x in D),
        objective=objective,
        status="brute_force",
        solve_time=elapsed,
        wall_time=elapsed,
        optimal=True,
        hide=tuple(float(x) for x in H),
    )
