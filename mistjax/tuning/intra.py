"""Intra-stage tuning: price the stage strategies of one outer key with vectorised cost-model calls into
``[slot, layers, remat, strategy]`` tables, pricing offloaded strategies only where bounds allow
(docs/internals.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from mistjax.core.context import ContextForm
from mistjax.core.pipeline_order import group_deferred, group_in_flight
from mistjax.core.pipeline_time import fill_share
from mistjax.core.schedules import V_SHAPED, ZERO_BUBBLE, deferred_microbatches, inflight_microbatches
from mistjax.core.strategies import CostModel, StageStrategies, WorkloadLike
from mistjax.tuning.pareto import sample_pareto
from mistjax.tuning.space import (
    OuterKey,
    RematOptions,
    SearchSpace,
    StrategyGrid,
    key_layer_options,
    remat_options,
    strategy_grid,
)

if TYPE_CHECKING:
    from mistjax.hardware.presets import ClusterSpec

__all__ = ["EntryPrices", "SampledTables", "ScheduleMemo", "StageTables", "TableArena", "entries_fit", "entries_floor",
           "key_fill", "prepare_key", "price", "price_entries", "price_pairs", "sample_stage_tables", "small_pages"]

# Elements per cost-model call: big enough to amortise NumPy's per-op overhead, small enough that the
# model's few dozen float64 temporaries stay in the low hundreds of MB.
_CHUNK_ELEMENTS = 1 << 19


@dataclass
class StageTables:
    """Costs of the (slot, layers, remat, strategy) candidates of one outer key; ``inf`` where
    infeasible or not priced (pruned).

    Attributes:
        key: the outer key.
        layer_options: J per-stage layer counts.
        remat: the R remat options (``count == -1`` means every layer of the stage).
        grid: the X strategies (family-major).
        stable / delta: ``[S, J, R, X]`` seconds per micro-batch and per step.
        bwd: ``[S, J, R, X]`` the backward part of ``stable``: what a later stage's delta hides behind in the
            pipeline's drain (`core.pipeline_time.exposed_delta`; empty: ``stable``).
        evaluated: strategies priced so far (for the timing report).
        truncated: the deadline stopped the pricing, so the key's best may be among unpriced strategies.
        sampled: cached Pareto samples (`sample_stage_tables`).
        fill: the share of a stage's time in the pipeline's fill and drain (`key_fill`): the key's objective is
            ``core.pipeline_time.pipeline_1f1b_time(..., fill)``.
    """

    key: OuterKey
    layer_options: tuple[int, ...]
    remat: RematOptions
    grid: StrategyGrid
    stable: np.ndarray
    delta: np.ndarray
    evaluated: int = 0
    memo: ScheduleMemo | None = None  # prices shared with sibling keys of other schedules
    truncated: bool = False
    fill: float = 1.0
    bwd: np.ndarray = field(default_factory=lambda: np.empty(0))
    # `sample_stage_tables` results of these tables by (k, shared): the MILP and the tuner's Pareto report
    # sample the same tables; `store` clears it.
    sampled: dict[tuple[int, bool], SampledTables] = field(default_factory=dict, repr=False)
    arena: TableArena | None = field(default=None, repr=False)  # where the tables live (it resets what they write)

    def remat_count(self, j: int, r: int) -> int:
        """Checkpointed layers of option r for a stage of ``layer_options[j]`` layers."""
        c = int(self.remat.count[r])
        return self.layer_options[j] if c < 0 else c

    def store(self, r: np.ndarray, x: np.ndarray, stable: np.ndarray, delta: np.ndarray, ok: np.ndarray,
              bwd: np.ndarray) -> None:
        """Write priced ``[S, J, n]`` entries at remat options ``r[n]`` and strategies ``x[n]``."""
        self.stable[:, :, r, x] = np.where(ok, stable, np.inf)
        self.delta[:, :, r, x] = np.where(ok, np.maximum(delta, 0.0), np.inf)
        if self.bwd.size:
            self.bwd[:, :, r, x] = np.where(ok, bwd, np.inf)
        self.sampled.clear()
        if self.arena is not None:
            self.arena.written((slice(None), slice(None), r, x))

    def store_entries(self, slot: np.ndarray, option: np.ndarray, r: np.ndarray, x: np.ndarray, stable: np.ndarray,
                      delta: np.ndarray, ok: np.ndarray, bwd: np.ndarray) -> None:
        """Write single priced entries (1-D arrays; infeasible ones stay ``inf``)."""
        at = (slot[ok], option[ok], r[ok], x[ok])
        self.stable[at] = stable[ok]
        self.delta[at] = np.maximum(delta[ok], 0.0)
        if self.bwd.size:
            self.bwd[at] = bwd[ok]
        self.sampled.clear()
        if self.arena is not None:
            self.arena.written(at)


class ScheduleMemo:
    """Prices of the last outer key, kept for its siblings that differ only in the pipeline schedule.

    A schedule changes only the micro-batches in flight (activation memory) and the lock-step time
    formula, both cheap on top of one cost-model call; `price_pairs` prices every schedule of
    ``schedules`` at once (the in-flight count is one more broadcast axis) and the search visits sibling
    keys one after another (`tuner.search`), so the memo holds one key's worth of results at most.
    """

    def __init__(self, schedules: tuple[str, ...]) -> None:
        self.schedules = tuple(schedules)
        self._group: OuterKey | None = None
        self._entries: dict[tuple[bytes, ...], PairPrices] = {}

    def lookup(self, key: OuterKey, what: tuple[bytes, ...]) -> PairPrices | None:
        group = dataclasses.replace(key, schedule="")
        if group != self._group:
            self._group, self._entries = group, {}
        got = self._entries.get(what)
        if got is None:
            return None
        i = self.schedules.index(key.schedule)
        return PairPrices(*(a[i] for a in got))

    def store(self, what: tuple[bytes, ...], results: PairPrices) -> None:
        self._entries[what] = results


class PairPrices(NamedTuple):
    """Raw prices of (remat option, strategy) pairs (`price_pairs`), ``[S', J, n]`` each."""

    stable: np.ndarray
    delta: np.ndarray
    bwd: np.ndarray  # the backward part of ``stable``
    feasible: np.ndarray


def price_pairs(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables, r: np.ndarray,
                x: np.ndarray, slots: np.ndarray | None = None) -> PairPrices:
    """Raw (stable, delta, bwd, feasible) ``[S', J, n]`` of (remat option ``r[n]``, strategy ``x[n]``) pairs.

    Raw means the costs are returned even where the memory limit is exceeded (lower bounds need
    them); ``feasible`` says where they fit. Pairs whose checkpointed count exceeds a layer option
    are infeasible.
    """
    key = tables.key
    S = key.stages
    r, x = np.asarray(r, np.int64), np.asarray(x, np.int64)
    memo = (tables.memo if S > 1 and key.chunks == 1 and tables.memo is not None
            and key.schedule in tables.memo.schedules else None)
    what = (b"" if slots is None else np.asarray(slots, np.int64).tobytes(), r.tobytes(), x.tobytes(),
            tables.remat.count.tobytes(), tables.remat.policy.tobytes(), repr(tables.layer_options).encode())
    if memo is not None:
        got = memo.lookup(key, what)
        if got is not None:
            return got
    schedules = memo.schedules if memo is not None else (key.schedule,)
    slot = (np.arange(S) if slots is None else np.asarray(slots)).reshape(-1, 1, 1)
    layers = np.asarray(tables.layer_options, np.int64).reshape(1, -1, 1)
    # Each stage holds its own micro-batches in flight under each schedule (the MPMD executor). One
    # leading axis per schedule.
    inflight = np.stack([stage_inflight(slot, key, n) for n in schedules]).reshape(-1, slot.shape[0], 1, 1)
    deferred = np.stack([stage_deferred(slot, key, n) for n in schedules]).reshape(inflight.shape)
    shape = (len(schedules), slot.shape[0], layers.shape[1], len(r))
    stable, delta, bwd = np.empty(shape), np.empty(shape), np.empty(shape)
    feasible = np.empty(shape, dtype=bool)
    step = max(1, _CHUNK_ELEMENTS // max(1, shape[1] * shape[2]))
    for lo in range(0, len(r), step):
        sl = slice(lo, lo + step)
        st, valid = _strategies(tables, slot, layers, r[sl].reshape(1, 1, -1), x[sl].reshape(1, 1, -1), inflight,
                                deferred)
        out = cost.stage_cost(workload, cluster, st)
        sub = (shape[0], shape[1], shape[2], r[sl].size)
        stable[..., sl] = np.broadcast_to(out.stable, sub)
        delta[..., sl] = np.broadcast_to(out.delta, sub)
        bwd[..., sl] = np.broadcast_to(out.bwd, sub)
        ok = np.broadcast_to(np.asarray(out.feasible, bool) & valid, sub)
        feasible[..., sl] = ok & np.isfinite(stable[..., sl]) & np.isfinite(delta[..., sl])
    tables.evaluated += int(np.prod(shape))
    if memo is not None:
        memo.store(what, PairPrices(stable, delta, bwd, feasible))
    i = schedules.index(key.schedule)
    return PairPrices(stable[i], delta[i], bwd[i], feasible[i])


def _strategies(tables: StageTables, slot: np.ndarray, layers: np.ndarray, r: np.ndarray, x: np.ndarray,
                inflight: np.ndarray, deferred: np.ndarray | int = 0) -> tuple[StageStrategies, np.ndarray]:
    """The `StageStrategies` of (slot, layer count, remat option r, strategy x), broadcast against each other,
    and where the option's checkpointed count fits the layer count."""
    key, grid = tables.key, tables.grid
    count = tables.remat.count[r]
    c = np.where(count < 0, layers, count)
    st = StageStrategies(
        b=np.asarray(key.micro_batch), dp=np.asarray(key.dp), tp=np.asarray(key.tp), cp=np.asarray(key.cp),
        ulysses=np.asarray(key.cp_form == ContextForm.ULYSSES), shard_group=grid.shard_group[x], zero=grid.zero[x],
        layers=layers, remat=np.minimum(c, layers),
        policy=tables.remat.policy[r], wo=grid.wo[x], go=grid.go[x], oo=grid.oo[x], ao=grid.ao[x],
        inflight=inflight, deferred=deferred, chunks=np.asarray(key.chunks), G=np.asarray(key.grad_accum),
        tp_overlap=np.asarray(key.tp_overlap), first=slot == 0,
        last=slot == last_slot(key), stages=np.asarray(key.stages), nodes=np.asarray(key.nodes),
        per_node=np.asarray(key.per_node))
    return st, c <= layers


def last_slot(key: OuterKey) -> int:
    """The device group that runs the head: the last, or under a V-shaped schedule the first (its last chunk)."""
    return 0 if key.schedule in V_SHAPED else key.stages - 1


class EntryPrices(NamedTuple):
    """Raw prices of 1-D entries (see `price_pairs`), with the cost model's `offload_floor`."""

    stable: np.ndarray
    delta: np.ndarray
    feasible: np.ndarray
    offload_floor: np.ndarray
    bwd: np.ndarray  # the backward part of ``stable``


def price_entries(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables,
                  slot: np.ndarray, option: np.ndarray, r: np.ndarray, x: np.ndarray) -> EntryPrices:
    """Raw prices of single (slot, layer option index, remat option, strategy) entries, 1-D, under the key's
    own schedule."""
    st, valid = _entry_strategies(tables, slot, option, r, x)
    out = cost.stage_cost(workload, cluster, st)
    stable, delta = np.broadcast_to(out.stable, slot.shape), np.broadcast_to(out.delta, slot.shape)
    ok = np.broadcast_to(np.asarray(out.feasible, bool), slot.shape) & valid & np.isfinite(stable) & np.isfinite(delta)
    tables.evaluated += int(slot.size)
    return EntryPrices(stable, delta, ok, np.broadcast_to(out.offload_floor, slot.shape),
                       np.broadcast_to(out.bwd, slot.shape))


def entries_fit(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables,
                slot: np.ndarray, option: np.ndarray, r: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Whether single entries (as `price_entries`) fit, from the cost model's ``stage_memory`` where it has one."""
    if cost.stage_memory is None:
        return price_entries(workload, cluster, cost, tables, slot, option, r, x).feasible
    st, valid = _entry_strategies(tables, slot, option, r, x)
    return np.broadcast_to(np.asarray(cost.stage_memory(workload, cluster, st).feasible, bool), slot.shape) & valid


def entries_floor(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables,
                  slot: np.ndarray, option: np.ndarray, r: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The cost model's `offload_floor` of single entries (as `entries_fit`): a lower bound of the guarded peak of
    every strategy with no offload ratio larger than the entry's; 0 (it bounds nothing) where the cost model has no
    ``stage_memory``."""
    if cost.stage_memory is None:
        return np.zeros(slot.shape)
    st, _ = _entry_strategies(tables, slot, option, r, x)
    return np.broadcast_to(np.asarray(cost.stage_memory(workload, cluster, st).offload_floor, np.float64), slot.shape)


def _entry_strategies(tables: StageTables, slot: np.ndarray, option: np.ndarray, r: np.ndarray, x: np.ndarray
                      ) -> tuple[StageStrategies, np.ndarray]:
    key = tables.key
    layers = np.asarray(tables.layer_options, np.int64)[option]
    inflight = stage_inflight(slot, key, key.schedule)
    deferred = stage_deferred(slot, key, key.schedule)
    return _strategies(tables, slot, layers, r, x, np.asarray(inflight), deferred)


def price(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables, xs: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Price every remat option of strategies ``xs`` into the tables.

    Returns:
        Raw stable, delta and feasible, each ``[S, J, R, len(xs)]``.
    """
    R, xs = tables.remat.count.size, np.asarray(xs)
    r = np.repeat(np.arange(R), len(xs))
    x = np.tile(xs, R)
    s, d, b, ok = price_pairs(workload, cluster, cost, tables, r, x)
    tables.store(r, x, s, d, ok, b)
    shape = (ok.shape[0], ok.shape[1], R, len(xs))
    return s.reshape(shape), d.reshape(shape), ok.reshape(shape)


def _prune_policies(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables) -> RematOptions:
    """Drop remat policies that a probe shows to be dominated (no faster, no smaller, no cheaper).

    A policy only changes what a checkpointed layer saves and recomputes, the same per layer for
    every other choice, so it is compared once per key: the first stage slot checkpointing all its
    layers, on the first zero-offload strategy.
    """
    rem = tables.remat
    pols = np.unique(rem.policy[rem.count != 0])
    if pols.size <= 1:
        return rem
    r = np.array([int(np.flatnonzero((rem.policy == p) & (rem.count != 0))[-1]) for p in pols])
    x0 = np.zeros(len(r), dtype=np.int64)
    probe = StageTables(tables.key, tables.layer_options[-1:], rem, tables.grid, tables.stable, tables.delta)
    s, d, _, _ = price_pairs(workload, cluster, cost, probe, r, x0, slots=np.array([0]))
    tables.evaluated += probe.evaluated
    peak = _probe_peak(workload, cluster, cost, probe, r)
    s, d = s[0, 0], d[0, 0]
    keep = []
    for a in range(len(pols)):
        worse = (s <= s[a]) & (d <= d[a]) & (peak <= peak[a])
        strict = (s < s[a]) | (d < d[a]) | (peak < peak[a])
        earlier_equal = worse & ~strict & (np.arange(len(pols)) < a)
        if not (worse & strict).any() and not earlier_equal.any():
            keep.append(pols[a])
    sel = (rem.count == 0) | np.isin(rem.policy, keep)
    return RematOptions(rem.count[sel], rem.policy[sel], rem.names)


def stage_inflight(slot: np.ndarray, key: OuterKey, schedule: str) -> np.ndarray:
    """Micro-batches of residuals each stage slot of ``key`` holds under ``schedule``: the MPMD executor's count
    for one chunk per group (`core.schedules.inflight_microbatches`), the group's peak over its chunks for an
    interleaved key (`core.pipeline_order.group_in_flight`: each chunk an equal share of the group's layers).
    An interleaved key's view is approximate where chunks differ: the embedding's and the head's residuals are
    charged at the group's count, not their chunk's, and activation offload rounds per group, not per chunk;
    `predict` prices the plan that comes of it per chunk, and decides."""
    if key.chunks == 1:
        return inflight_microbatches(slot, key.stages, key.grad_accum, schedule)
    return group_in_flight(schedule, key.stages, key.grad_accum, key.chunks)[np.asarray(slot)]


def stage_deferred(slot: np.ndarray, key: OuterKey, schedule: str) -> np.ndarray:
    """Deferred weight passes whose stash each stage slot of ``key`` holds under ``schedule``
    (`core.schedules.deferred_microbatches`; a group's peak over its chunks for a V-shaped key,
    `core.pipeline_order.group_deferred`, each chunk's stash an equal share of the group's)."""
    if key.chunks == 1:
        return deferred_microbatches(slot, key.stages, key.grad_accum, schedule)
    return group_deferred(schedule, key.stages, key.grad_accum, key.chunks)[np.asarray(slot)]


def key_inflight(key: OuterKey) -> float:
    """Micro-batches in flight on the first stage (the largest pool) under the key's schedule."""
    return float(stage_inflight(np.zeros((), np.int64), key, key.schedule))


def _probe_peak(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, probe: StageTables,
                r: np.ndarray) -> np.ndarray:
    key = probe.key
    layers = probe.layer_options[0]
    st = StageStrategies(
        b=np.asarray(key.micro_batch), dp=np.asarray(key.dp), tp=np.asarray(key.tp), cp=np.asarray(key.cp),
        ulysses=np.asarray(key.cp_form == ContextForm.ULYSSES), shard_group=np.asarray(probe.grid.shard_group[0]),
        zero=np.asarray(probe.grid.zero[0]),
        layers=np.asarray(layers), remat=np.full(len(r), layers), policy=probe.remat.policy[r],
        wo=np.asarray(0.0), go=np.asarray(0.0), oo=np.asarray(0.0), ao=np.asarray(0.0),
        inflight=np.asarray(key_inflight(key)), chunks=np.asarray(key.chunks), G=np.asarray(key.grad_accum),
        tp_overlap=np.asarray(key.tp_overlap), first=np.asarray(True),
        last=np.asarray(key.stages == 1), stages=np.asarray(key.stages), nodes=np.asarray(key.nodes),
        per_node=np.asarray(key.per_node))
    return np.broadcast_to(np.asarray(cost.stage_cost(workload, cluster, st).peak, np.float64), (len(r),))


def key_fill(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables) -> float:
    """The `core.pipeline_time.fill_share` of ``tables``' key (1 with one stage).

    ZB-H1's depends on the weight passes' share of a micro-batch, taken from the key's first strategy without
    remat on a middle stage of a middle layer count: the share is the GEMMs' (weight vs input gradients), about
    the same in every strategy, and the objective only ranks plans that `predict` then prices as they run.
    """
    key = tables.key
    if key.stages == 1:
        return 1.0
    if key.schedule not in ZERO_BUBBLE:
        return fill_share(key.schedule, key.chunks)
    if key.schedule in V_SHAPED:  # a V-shaped key prices each group's chunks as one stage
        key = dataclasses.replace(key, schedule="zb-h1", chunks=1)
        tables = StageTables(key, tables.layer_options, tables.remat, tables.grid, tables.stable, tables.delta)
        share = _wgrad_share(workload, cluster, cost, tables)
        return fill_share("zb-v", 2, share, key.stages, key.grad_accum)
    return fill_share(key.schedule, 1, _wgrad_share(workload, cluster, cost, tables), key.stages)


def _wgrad_share(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, tables: StageTables) -> float:
    """The weight passes' share of a micro-batch (`key_fill`)."""
    key = tables.key
    at = (np.array([key.stages // 2]), np.array([len(tables.layer_options) // 2]),
          np.array([int(np.argmin(tables.remat.count))]), np.array([0]))
    out = cost.stage_cost(workload, cluster, _entry_strategies(tables, *at)[0])
    stable, wgrad = float(np.ravel(out.stable)[0]), float(np.ravel(out.wgrad)[0])
    return wgrad / stable if np.isfinite(stable) and stable > 0 else 0.0


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """NumPy's arrays without transparent huge pages while the block runs (NumPy asks the kernel for them on
    arrays of 4 MiB and more).

    The search's tables run to GiBs of which each key writes a fraction; on a VM the first touch of a huge
    page costs far more than that of the 4 KiB pages written (3 GiB filled: 27 s the first time, then 4.2 s,
    against 1.3 s with small pages: docs/internals.md). A no-op where NumPy has no such switch.
    """
    switch = getattr(getattr(getattr(np, "_core", None), "multiarray", None), "_set_madvise_hugepage", None)
    if switch is None:
        yield
        return
    before = switch(False)
    try:
        yield
    finally:
        switch(before)


class TableArena:
    """Memory for the (stable, delta) tables of one search's outer keys, reused key after key.

    A search tunes one key at a time and keeps nothing of a key's tables once the key is tuned, so each key
    can use the memory of the one before. Tables run to hundreds of MB and most of their entries are never
    priced, so instead of filling the whole buffer with ``inf`` for each key (memory bandwidth: ~0.35 s per
    table here) the arena resets only the entries the previous key's tables wrote (`StageTables.store`,
    `StageTables.store_entries` report them); everything else is still ``inf``.
    """

    def __init__(self) -> None:
        self._memory = np.empty(0)
        self._views: tuple[np.ndarray, ...] | None = None
        self._written: list[tuple[np.ndarray | slice, ...]] = []

    def tables(self, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Three ``inf``-filled arrays of ``shape`` (stable, delta, bwd); valid until the next call."""
        n = int(np.prod(shape))
        if self._memory.size < 3 * n:
            self._memory, self._views = np.full(3 * n, np.inf), None
        elif self._views is not None:
            for at in self._written:
                for view in self._views:
                    view[at] = np.inf
        self._written = []
        self._views = tuple(self._memory[i * n:(i + 1) * n].reshape(shape) for i in range(3))
        return self._views  # type: ignore[return-value]

    def written(self, at: tuple[np.ndarray | slice, ...]) -> None:
        """Note that the current tables were written at the index ``at``."""
        self._written.append(at)

    def written_flat(self) -> np.ndarray:
        """The flat positions (ascending, each once) the current tables were written at."""
        if self._views is None or not self._written:
            return np.empty(0, np.int64)
        shape = self._views[0].shape
        flat = []
        for at in self._written:
            grids = [np.arange(n) if isinstance(a, slice) else np.asarray(a) for a, n in zip(at, shape)]
            if any(isinstance(a, slice) for a in at):  # (every slot, every option, pairs r[n], x[n])
                s, j, n = np.meshgrid(grids[0], grids[1], np.arange(grids[2].size), indexing="ij")
                grids = [s.ravel(), j.ravel(), grids[2][n.ravel()], grids[3][n.ravel()]]
            flat.append(np.ravel_multi_index(tuple(grids), shape))
        return np.unique(np.concatenate(flat))


def prepare_key(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, key: OuterKey, space: SearchSpace,
                memo: ScheduleMemo | None = None, arena: TableArena | None = None) -> StageTables:
    """Empty (all ``inf``) tables of one outer key, with dominated remat policies removed.

    With an ``arena`` the tables live in its memory, valid until it hands out the next key's.
    """
    L = int(workload.num_layers)
    opts = key_layer_options(space, L, key)
    remat = remat_options(space, max(opts), tuple(workload.policies))
    grid = strategy_grid(space, key.dp, key.tp * key.cp, cluster.devices_per_node, pipelined=key.stages > 1)
    tables = StageTables(key, opts, remat, grid, np.empty(0), np.empty(0))
    if space.policies is None:
        tables.remat = _prune_policies(workload, cluster, cost, tables)
    tables.fill = key_fill(workload, cluster, cost, tables)
    shape = (key.stages, len(opts), tables.remat.count.size, len(grid))
    tables.arena = arena or TableArena()
    tables.stable, tables.delta, tables.bwd = tables.arena.tables(shape)
    tables.memo = memo
    return tables


@dataclass(frozen=True)
class SampledTables:
    """K Pareto points per (group, slot, layer option) for the inter-stage MILP.

    A group is a set of strategies the stages must share (one strategy each when the runtime needs
    equal ZeRO / offload settings over stages; all strategies of one MiCS group size otherwise).

    Attributes:
        stable / delta: ``[groups, S, J, K]`` (``inf`` in empty slots).
        remat: ``[groups, S, J, K]`` index r of the remat option.
        strategy: ``[groups, S, J, K]`` index x of the strategy.
        bwd: ``[groups, S, J, K]`` the backward part of ``stable`` (the MILP's hide table).
    """

    stable: np.ndarray
    delta: np.ndarray
    remat: np.ndarray
    strategy: np.ndarray
    bwd: np.ndarray


def sample_stage_tables(tables: StageTables, k: int, shared: bool, xs: np.ndarray | None = None) -> SampledTables:
    """Sample K Pareto points of (stable, delta / G) per stage key and strategy group (Mist §5.3).

    Args:
        tables: the evaluated key.
        k: points per key (1 = the imbalance-unaware ablation: argmin stable + delta / G).
        shared: one group per strategy (the stages share it: the runtime's pipeline restriction).
            Otherwise stages choose strategies freely (Mist), except for the MiCS group, which a
            plan holds once: one group per group size.
        xs: with ``shared``, only these strategies (default: all).
    """
    cache = xs is None
    if cache and (k, shared) in tables.sampled:
        return tables.sampled[(k, shared)]
    S, J, R, X = tables.stable.shape
    G = tables.key.grad_accum
    if shared:
        xs = np.arange(X) if xs is None else np.asarray(xs)
        # [S, J, R, X] -> [X, S, J, R]: the candidates of a stage key are its remat options.
        s = np.moveaxis(tables.stable[..., xs], 3, 0)
        d = np.moveaxis(tables.delta[..., xs], 3, 0)
        pick = sample_pareto(s, d, G, min(k, R))
        r_idx = pick.indices
        x_idx = np.broadcast_to(xs.reshape(-1, 1, 1, 1), r_idx.shape)
        empty = pick.indices < 0
    else:
        groups = np.unique(tables.grid.shard_group)
        s, d, column = _finite_by_group(tables, np.searchsorted(groups, tables.grid.shard_group), len(groups))
        pick = sample_pareto(s, d, G, min(k, R * X))
        empty = pick.indices < 0
        r_idx, x_idx = np.divmod(np.take_along_axis(column, np.maximum(pick.indices, 0), axis=-1), X)
    out = SampledTables(pick.stable, pick.delta, np.where(empty, -1, r_idx), np.where(empty, -1, x_idx),
                        _sampled_bwd(tables, r_idx, x_idx, empty, pick.stable))
    if cache:
        tables.sampled[(k, shared)] = out
    return out


def _sampled_bwd(tables: StageTables, r_idx: np.ndarray, x_idx: np.ndarray, empty: np.ndarray, stable: np.ndarray
                 ) -> np.ndarray:
    """The bwd entries of the sampled points ``[groups, S, J, K]`` (their stable time without a bwd table)."""
    if not tables.bwd.size:
        return stable
    S, J = tables.stable.shape[:2]
    s_idx = np.arange(S).reshape(1, S, 1, 1)
    j_idx = np.arange(J).reshape(1, 1, J, 1)
    got = tables.bwd[s_idx, j_idx, np.maximum(r_idx, 0), np.maximum(x_idx, 0)]
    return np.where(empty, np.inf, got)


def _finite_by_group(tables: StageTables, group_of: np.ndarray, n_groups: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The finite (remat, strategy) candidates of each (MiCS group, slot, layer option), packed to the left.

    Returns ``stable``, ``delta`` ``[groups, S, J, W]`` (``inf`` padding) and ``column`` (the flat
    ``r * X + x`` index of each entry, -1 in padding), W the most finite candidates of any row. Most of a
    key's ``R x X`` entries are ``inf`` (pruned or over the memory limit), and an ``inf`` candidate never
    reaches the Pareto sampler's result; the packing keeps the candidates' order, so every tie is broken
    as over the whole row and the sample is the same, at the cost of the finite entries only.
    """
    S, J, R, X = tables.stable.shape
    flat_s = tables.stable.reshape(S * J, R * X)
    flat_d = tables.delta.reshape(S * J, R * X)
    if tables.arena is not None:  # only the entries written can be finite: no scan of the whole tables
        at = tables.arena.written_flat()
        at = at[np.isfinite(tables.stable.ravel()[at]) & np.isfinite(tables.delta.ravel()[at])]
        row, col = np.divmod(at, R * X)
    else:
        row, col = np.nonzero(np.isfinite(flat_s) & np.isfinite(flat_d))  # row-major: columns ascend in a row
    dest = group_of[col % X] * (S * J) + row
    order = np.argsort(dest, kind="stable")  # group-major, the column order kept within a row
    row, col, dest = row[order], col[order], dest[order]
    counts = np.bincount(dest, minlength=n_groups * S * J)
    width = max(1, int(counts.max(initial=0)))
    pos = np.arange(dest.size) - np.repeat(np.cumsum(counts) - counts, counts)
    s = np.full((n_groups * S * J, width), np.inf)
    d = np.full((n_groups * S * J, width), np.inf)
    column = np.full((n_groups * S * J, width), -1, np.int64)
    s[dest, pos], d[dest, pos], column[dest, pos] = flat_s[row, col], flat_d[row, col], col
    shape = (n_groups, S, J, width)
    return s.reshape(shape), d.reshape(shape), column.reshape(shape)
