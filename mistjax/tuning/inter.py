"""Inter-stage tuning of one outer key: the layer split and one candidate per stage, with pruning.

One stage needs no MILP: the best strategy minimises ``G * stable + delta`` directly (the MILP
objective with S = 1). Several stages go through `solve_inter_stage` (cvxpy + HiGHS) on the sampled
Pareto tables (Mist §5.4). When the runtime needs the stages to share their ZeRO / offload setting,
each shared strategy is its own MILP; strategies are tried in the order of a lower bound and skipped
once the bound reaches the best cost so far, or when an already visited strategy dominates them;
every MILP carries the cut ``(G-c) T_max <= best`` (Mist's outer-loop pruning; c the schedule's fill share).

`tune_key` interleaves pricing (`intra`) and solving: a family's (ZeRO level x MiCS group) offloaded
strategies are swept (`sweep`) only where its zero-offload strategy does not fit, cut by an incumbent plan.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from mistjax.core.schedules import V_SHAPED
from mistjax.core.strategies import CostModel, WorkloadLike
from mistjax.tuning.intra import (
    ScheduleMemo,
    StageTables,
    TableArena,
    key_fill,
    prepare_key,
    price,
    price_pairs,
    sample_stage_tables,
)
from mistjax.tuning.milp import solve_inter_stage
from mistjax.tuning.space import OuterKey, RematOptions, SearchSpace, StrategyGrid, key_layer_options, strategy_grid
from mistjax.tuning.sweep import Entries, PointBound, Tightening, entries_that_may_fit, sweep_offloads

if TYPE_CHECKING:
    from mistjax.hardware.presets import ClusterSpec

__all__ = ["KeyChoice", "entry_bounds", "key_bound", "lower_bounds", "solve_key", "tune_key"]

# A single MILP may use at most this share of the time left, so one slow solve cannot starve the
# remaining outer keys. HiGHS returns its incumbent when stopped.
_MILP_SHARE = 0.5
# Priced elements (slots x layer options x remat options) per call of the exhaustive pricing: a big
# pipelined key's chunk stays a fraction of a second, so the deadline is checked that often.
_CHUNK_ELEMENTS = 1 << 19
# When the time is up before any plan is known, one MILP still runs over what is priced, with this many
# seconds (inside the search's 1 s of grace): a search that priced a feasible key returns a plan.
_FIRST_MILP_S = 0.5


@dataclass(frozen=True)
class KeyChoice:
    """The best plan of one outer key.

    Attributes:
        objective: predicted step time (the pipeline objective).
        layers: layers per stage.
        remat: per stage, index r into ``tables.remat``.
        strategy: per stage, index x into ``tables.grid``.
        stable / delta: per-stage costs of the choice.
        optimal: False when a MILP stopped at its time limit.
        milps: MILPs solved for this key.
    """

    objective: float
    layers: tuple[int, ...]
    remat: tuple[int, ...]
    strategy: tuple[int, ...]
    stable: tuple[float, ...]
    delta: tuple[float, ...]
    optimal: bool = True
    milps: int = 0


def lower_bounds(s: np.ndarray, d: np.ndarray, G: int, layer_opts: tuple[int, ...], num_layers: int,
                 fill: float = 1.0) -> np.ndarray:
    """A lower bound of the pipeline objective (with the key's ``fill`` share, `StageTables.fill`) per group of
    ``[groups, S, J, K]`` candidates.

    With ``m_ij`` the smallest stable time of stage i with ``layer_opts[j]`` layers, two small
    dynamic programmes over the layer splits that add up to L give ``min sum_i m_i`` and
    ``min max_i m_i``; each bounds its term of the objective from below. The exposed delta is at
    least ``D_i - sum_{j<i} T_j`` with every ``T_j`` at its largest finite value. ``inf`` when no
    layer split has candidates in every stage.
    """
    total, worst = _split_tables(s.min(axis=3), layer_opts, num_layers, prefixes=False)  # [groups, L + 1]
    d_min = d.min(axis=(2, 3))
    t_hi = np.where(np.isfinite(s), s, 0.0).max(axis=(2, 3))
    before = fill * (np.cumsum(t_hi, axis=1) - t_hi)
    exposed = np.maximum(0.0, np.where(np.isfinite(d_min), d_min - before, 0.0).max(axis=1))
    with np.errstate(invalid="ignore"):
        lb = (G - fill) * worst[:, num_layers] + fill * total[:, num_layers] + exposed
    return np.where(np.isfinite(total[:, num_layers]), lb, np.inf)


def _dominated(tables: StageTables, g: int, seen: list[int]) -> bool:
    """Whether an already visited shared strategy is at least as good as strategy ``g`` everywhere.

    If strategy h has ``stable <=``, ``delta <=`` and ``stable - bwd <=`` (the part no later stage's delta
    hides behind) those of g for every (stage, layers, remat) where g is feasible, any plan with g can switch
    to h without getting worse (`milp._undominated`). h was either solved (its optimum is kept) or pruned by a
    bound that then also holds for g.
    """
    if not seen:
        return False
    h = np.asarray(seen)
    sg, dg = tables.stable[..., g], tables.delta[..., g]
    ok = np.isfinite(sg)
    sh, dh = tables.stable[..., h][ok], tables.delta[..., h][ok]  # [n_feasible, H]
    better = (sh <= sg[ok][:, None]) & (dh <= dg[ok][:, None])
    if tables.bwd.size:
        with np.errstate(invalid="ignore"):  # inf - inf where h is infeasible: NaN, which is never better
            fg, fh = sg[ok] - tables.bwd[..., g][ok], sh - tables.bwd[..., h][ok]
            better &= fh <= fg[:, None]
    return bool(better.all(axis=0).any())


def _single_stage(tables: StageTables) -> KeyChoice | None:
    G = tables.key.grad_accum
    obj = G * tables.stable[0, 0] + tables.delta[0, 0]  # [R, X]
    if not np.isfinite(obj).any():
        return None
    r, x = np.unravel_index(int(np.argmin(obj)), obj.shape)
    return KeyChoice(float(obj[r, x]), (tables.layer_options[0],), (int(r),), (int(x),),
                     (float(tables.stable[0, 0, r, x]),), (float(tables.delta[0, 0, r, x]),))


def _solve_groups(tables: StageTables, k: int, shared: bool, best: KeyChoice | None, best_cost: float | None,
                  deadline: float, num_layers: int, xs: np.ndarray | None = None) -> tuple[KeyChoice | None, int, bool]:
    """MILPs over the strategy groups (all, or the strategies ``xs``), best-bound first."""
    G, S = tables.key.grad_accum, tables.key.stages
    sampled = sample_stage_tables(tables, k, shared, xs)
    lbs = lower_bounds(sampled.stable, sampled.delta, G, tables.layer_options, num_layers, tables.fill)
    milps, optimal = 0, True
    seen: list[int] = []  # the strategies of the groups solved (shared tables), against which `_dominated` tests
    for g in np.argsort(lbs, kind="stable"):
        cut = best.objective if best is not None else best_cost
        if not np.isfinite(lbs[g]) or (cut is not None and lbs[g] >= cut):
            break
        x_of_group = int(sampled.strategy[g][sampled.strategy[g] >= 0].flat[0]) if shared else -1
        if shared and _dominated(tables, x_of_group, seen):
            continue
        if shared:
            seen.append(x_of_group)
        left = deadline - time.perf_counter()
        first = best is None and cut is None  # nothing to return yet, from this key or any other
        if left <= 0 and not first:
            optimal = False
            break
        optimal &= left > 0
        sol = solve_inter_stage(sampled.stable[g], sampled.delta[g], tables.layer_options, num_layers, G,
                                time_limit=_FIRST_MILP_S if left <= 0 else max(0.05, _MILP_SHARE * left),
                                best_cost=cut, fill=tables.fill, hide=sampled.bwd[g])
        milps += 1
        if sol is None:
            continue
        optimal &= sol.optimal
        if cut is not None and sol.objective >= cut:
            continue
        r = tuple(int(sampled.remat[g, i, sol.option_indices[i], sol.candidates[i]]) for i in range(S))
        x = tuple(int(sampled.strategy[g, i, sol.option_indices[i], sol.candidates[i]]) for i in range(S))
        best = KeyChoice(sol.objective, sol.layers, r, x, sol.stable, sol.delta, True, 0)
    return best, milps, optimal


def solve_key(tables: StageTables, k: int, shared: bool, best_cost: float | None, deadline: float,
              num_layers: int) -> KeyChoice | None:
    """The best choice of fully priced ``tables`` that beats ``best_cost`` (None if none does)."""
    if tables.key.stages == 1:
        best = _single_stage(tables)
        return best if best is not None and (best_cost is None or best.objective < best_cost) else None
    best, milps, optimal = _solve_groups(tables, k, shared, None, best_cost, deadline, num_layers)
    return None if best is None else _with_stats(best, optimal, milps)


def _with_stats(c: KeyChoice, optimal: bool, milps: int) -> KeyChoice:
    return KeyChoice(c.objective, c.layers, c.remat, c.strategy, c.stable, c.delta, optimal, milps)


def _base_strategies(grid: StrategyGrid) -> np.ndarray:
    """Per family: the strategy with the smallest offload ratios."""
    F = int(grid.family.max()) + 1
    lo = np.logical_and.reduce([r == r.min() for r in (grid.wo, grid.go, grid.oo, grid.ao)])
    return np.array([np.flatnonzero(lo & (grid.family == f))[0] for f in range(F)])


def key_bound(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, key: OuterKey, space: SearchSpace,
              memo: ScheduleMemo | None = None) -> float:
    """A lower bound of a key's best objective, from its families' least-offloaded strategies
    without remat and without the memory limit (an offload or a checkpointed layer never saves time).

    An interleaved key is bounded with its one-chunk 1F1B sibling's prices (shared with it through ``memo``)
    under its own fill share: each chunk's sends only add time, and its layer counts are among the sibling's. A
    ZB-V key is bounded with its one-chunk ZB-H1 sibling's prices under ZB-V's share; that is not a proven bound,
    since the sibling charges the head to the last group and ZB-V to the first (docs/pipelines.md).
    """
    L = int(workload.num_layers)
    whole = key
    if key.chunks > 1:  # a V-shaped key's sibling is its one-chunk ZB-H1 key (each group's chunks as one stage)
        key = dataclasses.replace(key, chunks=1, schedule="zb-h1" if key.schedule in V_SHAPED else key.schedule)
    opts = key_layer_options(space, L, key)
    grid = strategy_grid(space, key.dp, key.tp * key.cp, cluster.devices_per_node, pipelined=key.stages > 1)
    base = _base_strategies(grid)
    none = tuple(workload.policies).index("none") if "none" in tuple(workload.policies) else 0
    probe = StageTables(key, opts, RematOptions(np.zeros(1, np.int64), np.full(1, none), tuple(workload.policies)),
                        grid, np.empty(0), np.empty(0), memo=memo)
    probe.fill = key_fill(workload, cluster, cost, dataclasses.replace(probe, key=whole))  # the key's own share
    s, d, _, _ = price_pairs(workload, cluster, cost, probe, np.zeros(len(base), np.int64), base)  # [S, J, F]
    if key.stages == 1:
        return float(np.min(key.grad_accum * s[0, 0] + d[0, 0]))
    lb = lower_bounds(np.moveaxis(s, 2, 0)[..., None], np.moveaxis(d, 2, 0)[..., None], key.grad_accum, opts, L,
                      probe.fill)
    return float(lb.min())


def _split_tables(m: np.ndarray, layer_opts: tuple[int, ...], num_layers: int,
                  prefixes: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The min sum and min max of ``m`` (``[..., S, J]``, the least time of slot i with ``layer_opts[j]``
    layers) over the first i slots using l layers in all: ``[..., S+1, L+1]``, or with ``prefixes`` False
    only i = S, ``[..., L+1]`` (without the memory of every prefix)."""
    S = m.shape[-2]
    total = np.full((*m.shape[:-2], num_layers + 1), np.inf)
    worst = np.full_like(total, np.inf)
    total[..., 0] = worst[..., 0] = 0.0
    rows = [(total, worst)]
    for i in range(S):  # S x J vectorised shifts over (leading axes, layers used so far)
        new_total, new_worst = np.full_like(total, np.inf), np.full_like(worst, np.inf)
        for j, n in enumerate(layer_opts):
            if n > num_layers:
                continue
            mij = m[..., i, j, None]
            new_total[..., n:] = np.minimum(new_total[..., n:], total[..., :num_layers + 1 - n] + mij)
            new_worst[..., n:] = np.minimum(new_worst[..., n:], np.maximum(worst[..., :num_layers + 1 - n], mij))
        total, worst = new_total, new_worst
        if prefixes:
            rows.append((total, worst))
    if not prefixes:
        return total, worst
    return np.stack([t for t, _ in rows], axis=-2), np.stack([w for _, w in rows], axis=-2)


def _others(head: np.ndarray, tail: np.ndarray, combine: np.ufunc) -> np.ndarray:
    """``[L+1]`` the min over ``a + b = l`` of ``combine(head[a], tail[b])``."""
    L1 = head.size
    pair = combine(head[:, None], tail[None, :])  # [a, b]
    out = np.full(L1, np.inf)
    a, b = np.indices(pair.shape)
    ok = a + b < L1
    np.minimum.at(out, (a + b)[ok], pair[ok])
    return out


def entry_bounds(least: np.ndarray, G: int, layer_opts: tuple[int, ...], num_layers: int, fill: float,
                 slot: np.ndarray, option: np.ndarray, stable: np.ndarray) -> np.ndarray:
    """A lower bound of the pipeline objective of any plan whose stage ``slot`` runs ``layer_opts[option]``
    layers at stable time ``stable`` (one value per entry).

    The other stages' layers add up to the rest, and each stage takes at least ``least[i, j]`` (``[S, J]``) with
    ``layer_opts[j]`` layers: so the bound is ``(G - c) max(stable, W) + c (stable + T)`` with ``W`` / ``T`` the
    least max / sum of the others (two dynamic programmes over the slots before and after, joined at every
    layer count), c the ``fill`` share, and ``D_max >= 0``.
    """
    S, L = least.shape[0], num_layers
    head_sum, head_max = _split_tables(least, layer_opts, L)
    tail_sum, tail_max = _split_tables(least[::-1], layer_opts, L)
    rest_sum = np.full((S, L + 1), np.inf)
    rest_max = np.full((S, L + 1), np.inf)
    for i in np.unique(slot):
        rest_sum[i] = _others(head_sum[i], tail_sum[S - 1 - i], np.add)
        rest_max[i] = _others(head_max[i], tail_max[S - 1 - i], np.maximum)
    left = L - np.asarray(layer_opts)[option]
    ok = left >= 0
    left = np.maximum(left, 0)
    with np.errstate(invalid="ignore"):
        lb = (G - fill) * np.maximum(stable, rest_max[slot, left]) + fill * (stable + rest_sum[slot, left])
    return np.where(ok & np.isfinite(lb), lb, np.inf)


def fitting_entries(s0: np.ndarray, ok0: np.ndarray, entries: Entries) -> np.ndarray:
    """``[S, J, R, F]`` the entries where some strategy of the family may fit: the zero-offload point itself
    (``ok0``), or an offloaded one (``entries``, those `entries_that_may_fit` kept)."""
    allowed = ok0.copy()
    allowed[entries.slot, entries.option, entries.remat, entries.family] = True
    return allowed


def _open_entries(tables: StageTables, s0: np.ndarray, d0: np.ndarray, ok0: np.ndarray) -> Entries:
    """The (slot, layers, remat, family) entries whose offloaded strategies can matter.

    Where a family's zero-offload strategy fits, it dominates every offloaded one (an offload never makes a
    strategy faster), so only the entries where it does not fit are swept. The most-offloaded strategy's
    failing to fit proves nothing (the optimizer update brings offloaded state back onto the device, so a
    middle point can fit where both ends do not: `tests/test_tune.py` prices whole grids to show it). The
    bound of an entry is its zero-offload objective with one stage, and ``G * stable`` (one stage's share of
    the pipeline's) otherwise.
    """
    S, J, R, F = ok0.shape
    has_children = np.bincount(tables.grid.family, minlength=F) > 1
    slot, option, r, f = np.nonzero(~ok0 & has_children)
    G = tables.key.grad_accum
    bound = G * s0[slot, option, r, f] + (d0[slot, option, r, f] if S == 1 else 0.0)
    return Entries(slot, option, r, f, bound)


def _price_all(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables,
               deadline: float) -> None:
    """Price every strategy (Mist's exhaustive evaluation) in chunks, until the deadline."""
    S, J, R, X = tables.stable.shape
    step = max(1, _CHUNK_ELEMENTS // (S * J * R))
    for lo in range(0, X, step):
        if lo and time.perf_counter() >= deadline:  # the first chunk always: a key searched prices something
            tables.truncated = True
            return
        price(workload, cluster, cost, tables, np.arange(lo, min(lo + step, X)))


def _point_bound(tables: StageTables, entries: Entries, bound: Callable[..., np.ndarray] | None) -> PointBound:
    """The sweep's bound of a plan through an offloaded point of entry ``e``: `entry_bounds` at the point's own
    stable time in a pipeline (``bound``), the objective itself (``G stable + delta``) with one stage."""
    if bound is None:
        G = tables.key.grad_accum
        return lambda e, stable, delta: G * stable + delta
    return lambda e, stable, delta: bound(entries.slot[e], entries.option[e], stable)


def _rebound(tables: StageTables, entries: Entries, fixed: np.ndarray, num_layers: int, floor: np.ndarray
             ) -> tuple[np.ndarray, PointBound]:
    """`sweep.Tightening.rebound`: the entries' bounds at their ``floor`` and the point bound, with each stage's
    least time the smaller of ``fixed`` (``[S, J]``, the entries not swept: their zero-offload point fits) and the
    floors of the swept entries there."""
    least = fixed.copy()
    np.minimum.at(least, (entries.slot, entries.option), floor)
    bound = partial(entry_bounds, least, tables.key.grad_accum, tables.layer_options, num_layers, tables.fill)
    return bound(entries.slot, entries.option, floor), _point_bound(tables, entries, bound)


def tune_key(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, key: OuterKey, space: SearchSpace,
             best_cost: float | None, deadline: float, prune: bool = True, memo: ScheduleMemo | None = None,
             arena: TableArena | None = None) -> tuple[StageTables, KeyChoice | None]:
    """Price and solve one outer key; the choice is None unless it beats ``best_cost``.

    Every stage of a pipeline chooses its own strategy (ZeRO level, offload ratios, remat): the MPMD
    executor runs per-stage plans, and the inter-stage MILP picks one Pareto point per stage (Mist's
    imbalance-aware tuning). Only the MiCS group is shared (the plan holds one).

    Args:
        prune: price offloaded strategies only where the zero-offload ones do not fit (exact when time
            never falls and feasibility never shrinks as offload ratios grow); False prices everything,
            as Mist does.
        memo: prices shared with the key's siblings of other pipeline schedules (`intra.ScheduleMemo`).
        arena: memory for the tables (`intra.TableArena`): they are valid until it hands out the next key's.
    """
    L = int(workload.num_layers)
    tables = prepare_key(workload, cluster, cost, key, space, memo, arena)
    G, S = key.grad_accum, key.stages
    if not prune:
        _price_all(workload, cluster, cost, tables, deadline)
        return tables, solve_key(tables, space.pareto_k, False, best_cost, deadline, L)
    s0, d0, ok0 = price(workload, cluster, cost, tables, _base_strategies(tables.grid))  # [S, J, R, F]
    cut = np.inf if best_cost is None else best_cost
    if S == 1:
        cut = min(cut, float(np.min(np.where(ok0[0, 0], G * s0[0, 0] + d0[0, 0], np.inf))))
    entries = entries_that_may_fit(workload, cluster, cost, tables, _open_entries(tables, s0, d0, ok0))
    bound, tightening = None, None
    if S > 1:  # sound bounds that count memory: the zero-offload prices where some point of the family may fit
        least = np.where(fitting_entries(s0, ok0, entries), s0, np.inf).min(axis=(2, 3))  # [S, J]
        at = np.nonzero(np.isfinite(least))
        bound = partial(entry_bounds, least, G, tables.layer_options, L, tables.fill)
        if bound(at[0], at[1], least[at]).min(initial=np.inf) >= cut:
            return tables, None
        floor = s0[entries.slot, entries.option, entries.remat, entries.family]
        entries = entries._replace(bound=bound(entries.slot, entries.option, floor))
        tightening = Tightening(floor, partial(_rebound, tables, entries, np.where(ok0, s0, np.inf).min(axis=(2, 3)),
                                               L))
    incumbent = None
    if S > 1:  # a plan from the zero- and most-offloaded points: its objective cuts the sweep
        incumbent = solve_key(tables, space.pareto_k, False, best_cost, deadline, L)
        cut = min(cut, np.inf if incumbent is None else incumbent.objective)
    sweep_offloads(workload, cluster, cost, tables, entries, cut, deadline, _point_bound(tables, entries, bound),
                   tightening)
    choice = solve_key(tables, space.pareto_k, False, best_cost, deadline, L)
    if incumbent is not None and (choice is None or incumbent.objective < choice.objective):
        choice = incumbent  # Pareto sampling of the larger tables can miss it
    return tables, choice
