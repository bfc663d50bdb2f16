"""Offloaded strategies priced only where one can be chosen: a rank-ordered sweep of each family's offload lattice.

Within a family (ZeRO level x MiCS group) the strategies differ only in their four offload ratios, a lattice
``wo x go x oo x ao``. The cost model's times never fall as a ratio grows (`tests/test_tune.py` checks it on
whole grids), so at one (slot, layers, remat) entry a *feasible* strategy y <= x (no ratio larger) is at
least as fast as x in stable and delta alike: x cannot be the unique best of any plan there. The exception
is the gradient-accumulator ratio where layer rows are synchronised inside the backward loop
(`core.execution.rows_synced_in_loop`): host-accumulated rows sync at the end of the step instead, and with
none left in the loop its per-layer collectives go, so the sweep orders nothing along that ratio there.
Memory is not monotone in the ratios (the optimizer update brings offloaded state back onto the device), so
the sweep never infers feasibility from a neighbour: an entry whose most-offloaded point's `offload_floor` exceeds
the budget has no point that fits and is dropped; the others are visited rank by rank (the sum of the ratio
indices), pricing a point only when no point below it was found feasible. What is priced is each entry's
infeasible points with nothing feasible below, and its minimal feasible ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from mistjax.core.execution import rows_synced_in_loop
from mistjax.core.strategies import CostModel, WorkloadLike
from mistjax.tuning.intra import StageTables, entries_fit, entries_floor, price_entries
from mistjax.tuning.space import StrategyGrid

if TYPE_CHECKING:
    from mistjax.hardware.presets import ClusterSpec

__all__ = ["Entries", "OffloadLattice", "Tightening", "entries_that_may_fit", "sweep_offloads"]

_RATIOS = ("wo", "go", "oo", "ao")
_CHUNK = 1 << 16  # (entry, point) pairs priced per call: the deadline is checked that often
# Time first goes on while at least this share of the points it priced closed on their bound alone: a full
# price costs about three memory checks, and below ~1% the closed points do not save the difference (measured:
# 3% on A100-40GB Llama-22B's keys, 0.2% on L4 GPT-3 22B's, docs/internals.md), judged once this many are priced.
_MIN_DEAD_SHARE = 0.01
_PROBE_POINTS = 1 << 16


@dataclass(frozen=True)
class OffloadLattice:
    """The offload lattice of a strategy grid's families.

    Attributes:
        strategy: ``[F, P]`` the strategy index x at each family's flat lattice point (-1: not in the grid,
            e.g. a weight offload without gradient offload).
        preds: ``[P, 4]`` the flat point one step lower in each ratio (-1 at the lattice's floor).
        levels: the flat points of each rank 1, 2, ... (rank 0 is the zero-offload base).
        coords: ``[P, 4]`` each flat point's index along each ratio.
    """

    strategy: np.ndarray
    preds: np.ndarray
    levels: tuple[np.ndarray, ...]
    coords: np.ndarray

    @property
    def top(self) -> np.ndarray:
        """``[F]`` each family's strategy with every ratio at its largest (-1 where the grid lacks it)."""
        return self.strategy[:, -1]

    @classmethod
    def of(cls, grid: StrategyGrid) -> OffloadLattice:
        values = [np.unique(getattr(grid, name)) for name in _RATIOS]
        shape = tuple(v.size for v in values)
        coords = np.stack([np.searchsorted(v, getattr(grid, name)) for v, name in zip(values, _RATIOS)])
        flat = np.ravel_multi_index(tuple(coords), shape)
        strategy = np.full((int(grid.family.max()) + 1, int(np.prod(shape))), -1, np.int64)
        strategy[grid.family, flat] = np.arange(len(grid))
        every = np.indices(shape).reshape(4, -1)
        preds = np.full((every.shape[1], 4), -1, np.int64)
        for axis in range(4):
            lower = every.copy()
            lower[axis] -= 1
            ok = lower[axis] >= 0
            preds[ok, axis] = np.ravel_multi_index(tuple(lower[:, ok]), shape)
        rank = every.sum(axis=0)
        levels = tuple(np.flatnonzero(rank == k) for k in range(1, int(rank.max()) + 1))
        return cls(strategy, preds, levels, every.T.copy())

    def faces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The points with every ratio at its largest but one, at each smaller value: (flat point, ratio, index
        along it), one entry per such point (`sweep._floors_over`)."""
        top = self.coords.max(axis=0)
        on_face = (self.coords == top).sum(axis=1) == 3
        flat = np.flatnonzero(on_face)
        axis = np.argmin(self.coords[flat] == top, axis=1)
        return flat, axis, self.coords[flat, axis]


PointBound = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]  # (entry index, stable, delta) -> bound


class Tightening(NamedTuple):
    """How the sweep raises its bounds as it climbs (time first, pipelines).

    Attributes:
        floor: ``[E]`` a lower bound of the stable time of any point of each entry that a plan beating the cut can
            use (at the start, its zero-offload point's).
        rebound: ``rebound(floor)`` -> (each entry's bound at its floor, the `PointBound`) with the other stages'
            least times taken from the floors.
    """

    floor: np.ndarray
    rebound: Callable[[np.ndarray], tuple[np.ndarray, PointBound]]


class Entries(NamedTuple):
    """(slot, layer option, remat option, family) entries of a key's tables whose offloaded points are swept;
    ``bound`` is a lower bound of the objective of any plan using the entry (compared with the cut)."""

    slot: np.ndarray
    option: np.ndarray
    remat: np.ndarray
    family: np.ndarray
    bound: np.ndarray


def sweep_offloads(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables,
                   entries: Entries, cut: float, deadline: float, point_bound: PointBound | None = None,
                   tightening: Tightening | None = None) -> None:
    """Price the undominated offloaded points of ``entries`` into ``tables`` (dominated ones stay ``inf``).

    An entry leaves the sweep once its ``bound`` reaches ``cut``; with one stage the cut falls to the best
    objective priced so far (``G * stable + delta`` of a feasible point), since the entry is the whole plan.
    With a ``point_bound`` (a lower bound of any plan through a point, from the point's own times) the sweep
    starts *time first*: every point looked at is priced in full, and one whose bound reaches the cut closes
    the lattice above it like a feasible one (times never fall as a ratio grows, so neither does the bound).
    Where that closes too little (`_MIN_DEAD_SHARE` of the points priced, once `_PROBE_POINTS` are), it goes
    on *memory first*: a point is first asked whether it fits (`cost.stage_memory`, about a third of its
    price) and only the fitting ones are priced. Sets ``tables.truncated`` when the deadline stops it.

    With a ``tightening`` the bounds rise level by level while it goes time first: every point of an entry that
    is still open lies above one of the level's open points along ratios whose times never fall, so the least
    stable time of the entry's feasible points found and of its open points bounds what is left of it below;
    an entry out of the sweep (its bound reached the cut) holds nothing a plan beating the cut can use. The
    floors give the other stages' least times (`Tightening.rebound`).
    """
    lattice = OffloadLattice.of(tables.grid)
    bound_now = entries.bound
    live = bound_now < cut
    ordered = _ordered_ratios(tables, entries)  # [E, 4]
    reached = np.zeros((entries.slot.size, lattice.strategy.shape[1]), bool)  # a closing point <= here
    single = tables.key.stages == 1
    priced = dead = 0  # points priced time first, and how many of them closed on their bound alone
    floor = tightening.floor.copy() if tightening is not None else np.empty(0)
    found = np.full(entries.slot.size, np.inf)  # least stable time of each entry's feasible points priced
    tight = ordered.all(axis=1)  # entries whose times never fall along any ratio
    over: np.ndarray | None = None  # `_floors_over`, once the sweep goes memory first
    for points in lattice.levels:
        if not live.any():
            return
        if time.perf_counter() >= deadline:
            tables.truncated = True
            return
        pred = lattice.preds[points]  # [n, 4]
        below = (reached[:, np.maximum(pred, 0)] & (pred >= 0) & ordered[:, None, :]).any(axis=-1)  # [E, n]
        xs = lattice.strategy[entries.family[:, None], points[None, :]]
        time_first = point_bound is not None and (priced < _PROBE_POINTS or dead >= _MIN_DEAD_SHARE * priced)
        ask = live[:, None] & (xs >= 0) & ~below
        if not time_first:  # points a face's floor proves too big are not asked (they would not fit)
            over = _floors_over(workload, cluster, cost, tables, entries, lattice, live) if over is None else over
            ask &= ~(lattice.coords[points][None, :, :] <= over[:, None, :]).any(axis=-1)
        e, p = np.nonzero(ask)
        closes = np.zeros(e.size, bool)
        stable = np.full(e.size, np.inf)
        for lo in range(0, e.size, _CHUNK):
            if lo and time.perf_counter() >= deadline:
                tables.truncated = True
                return
            ee = e[lo:lo + _CHUNK]
            at = (entries.slot[ee], entries.option[ee], entries.remat[ee], xs[ee, p[lo:lo + _CHUNK]])
            if time_first and point_bound is not None:  # (time first implies a bound; the test narrows it)
                got = _price_time_first(workload, cluster, cost, tables, at, ee, point_bound, cut)
                priced, dead = priced + ee.size, dead + int((got.over & ~got.feasible).sum())
            else:
                got = _price_memory_first(workload, cluster, cost, tables, at)
            closes[lo:lo + ee.size] = got.feasible | got.over
            stable[lo:lo + ee.size] = got.stable
            np.minimum.at(found, ee, np.where(got.feasible, got.stable, np.inf))
            if single and got.feasible.any():
                cut = min(cut, float(got.objective.min()))
        below[e, p] |= closes
        reached[:, points] = below
        if tightening is not None and time_first:
            floor, bound_now, point_bound = _tighten(tightening, floor, found, live & tight, live, e[~closes],
                                                     stable[~closes])
        live &= bound_now < cut


def _floors_over(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables, entries: Entries,
                 lattice: OffloadLattice, live: np.ndarray) -> np.ndarray:
    """``[E, 4]`` per entry and ratio the largest index v (-1: none) such that no point whose ratio is at index v or
    below fits: the `offload_floor` of the lattice point with that ratio at v and every other ratio at its largest
    exceeds the budget (the floor bounds the guarded peak of every point with no ratio above the point's). Only
    the live entries are asked (the others never come back into the sweep); a face point the grid lacks proves
    nothing.

    Memory first, these points would be asked whether they fit one by one (they do not): a face's floor answers
    for all of them with one memory call.
    """
    over = np.full((entries.slot.size, 4), -1, np.int64)
    flat, axis, index = lattice.faces()
    x = lattice.strategy[entries.family[:, None], flat[None, :]]  # [E, faces]
    e, f = np.nonzero(live[:, None] & (x >= 0))
    budget = cluster.memory_budget()
    for lo in range(0, e.size, _CHUNK):
        ee, ff = e[lo:lo + _CHUNK], f[lo:lo + _CHUNK]
        floor = entries_floor(workload, cluster, cost, tables, entries.slot[ee], entries.option[ee],
                              entries.remat[ee], x[ee, ff])
        big = floor > budget
        np.maximum.at(over, (ee[big], axis[ff[big]]), index[ff[big]])
    return over


def _tighten(tightening: Tightening, floor: np.ndarray, found: np.ndarray, rising: np.ndarray, live: np.ndarray,
             open_entry: np.ndarray, open_stable: np.ndarray) -> tuple[np.ndarray, np.ndarray, PointBound]:
    """The floors after a level priced time first (``open_*``: its points left open), and the bounds they give.
    ``rising``: the entries whose floor follows the level (see `sweep_offloads`); the others keep theirs, and
    those out of the sweep hold none."""
    level = found.copy()
    np.minimum.at(level, open_entry, open_stable)
    floor = np.where(rising, np.maximum(floor, level), np.where(live, floor, np.inf))
    bound, point_bound = tightening.rebound(floor)
    return floor, bound, point_bound


class _Priced(NamedTuple):
    """What pricing a chunk of points found, per point."""

    feasible: np.ndarray  # fits (and was priced in full)
    over: np.ndarray  # its `PointBound` reaches the cut (time first only)
    objective: np.ndarray  # ``G * stable + delta`` where feasible, ``inf`` elsewhere (the single-stage cut)
    stable: np.ndarray  # its stable time where priced in full, ``inf`` elsewhere


_Point = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # (slot, layer option, remat option, strategy)


def _price_time_first(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables,
                      at: _Point, entry: np.ndarray, point_bound: PointBound, cut: float) -> _Priced:
    """Price every point in full; store the feasible ones."""
    got = price_entries(workload, cluster, cost, tables, *at)
    keep = np.flatnonzero(got.feasible)
    slot, option, remat, x = (a[keep] for a in at)
    tables.store_entries(slot, option, remat, x, got.stable[keep], got.delta[keep], got.feasible[keep], got.bwd[keep])
    over = point_bound(entry, got.stable, got.delta) >= cut
    G = tables.key.grad_accum
    return _Priced(got.feasible, over, np.where(got.feasible, G * got.stable + got.delta, np.inf), got.stable)


def _price_memory_first(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables,
                        at: _Point) -> _Priced:
    """Ask every point whether it fits; price and store the fitting ones."""
    n = at[0].size
    feasible, objective = np.zeros(n, bool), np.full(n, np.inf)
    fits = np.flatnonzero(entries_fit(workload, cluster, cost, tables, *at))
    if fits.size:
        slot, option, remat, x = (a[fits] for a in at)
        got = price_entries(workload, cluster, cost, tables, slot, option, remat, x)
        tables.store_entries(slot, option, remat, x, got.stable, got.delta, got.feasible, got.bwd)
        feasible[fits] = got.feasible
        objective[fits] = np.where(got.feasible, tables.key.grad_accum * got.stable + got.delta, np.inf)
    return _Priced(feasible, np.zeros(n, bool), objective, np.full(n, np.inf))


def _ordered_ratios(tables: StageTables, entries: Entries) -> np.ndarray:
    """``[E, 4]`` the ratios along which an entry's times never fall (every one but ``go`` where layer rows sync
    inside the backward loop)."""
    grid, key = tables.grid, tables.key
    first = np.array([np.flatnonzero(grid.family == f)[0] for f in range(int(grid.family.max()) + 1)])
    x = first[entries.family]
    in_loop = rows_synced_in_loop(grid.zero[x], key.dp, grid.shard_group[x], key.grad_accum, key.stages > 1)
    ordered = np.ones((entries.family.size, len(_RATIOS)), bool)
    ordered[:, _RATIOS.index("go")] = ~in_loop
    return ordered


def entries_that_may_fit(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables,
                         entries: Entries) -> Entries:
    """Price each entry's most-offloaded point into ``tables``; keep the entries whose `offload_floor` there
    does not prove that no point of the family fits."""
    x = OffloadLattice.of(tables.grid).top[entries.family]
    floor = np.zeros(x.size)
    for lo in range(0, x.size, _CHUNK):
        at = np.flatnonzero(x[lo:lo + _CHUNK] >= 0) + lo
        if not at.size:
            continue
        got = price_entries(workload, cluster, cost, tables, entries.slot[at], entries.option[at], entries.remat[at],
                            x[at])
        tables.store_entries(entries.slot[at], entries.option[at], entries.remat[at], x[at], got.stable, got.delta,
                             got.feasible, got.bwd)
        floor[at] = got.offload_floor
    keep = floor <= cluster.memory_budget()
    return Entries(*(a[keep] for a in entries))
