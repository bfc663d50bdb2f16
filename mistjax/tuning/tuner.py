"""`mistjax.tune` (`mistjax.tuning.tuner.tune`): outer loops over TP, stages and micro-batch, then the Plan.

``search`` runs one search space: for every outer key (`space.outer_keys`) it prices all stage
strategies (`intra.evaluate_key`), solves the stage assignment (`inter.solve_key`, pruned by the
best cost so far) and keeps the best; a global time limit stops the loops and returns the best
feasible plan found, with a warning. ``tune`` runs mistjax's space plus the baselines (and,
optionally, the ablation steps) on the same workload and cost model and returns a `TuneResult`.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

import numpy as np

from mistjax.core.context import ContextForm
from mistjax.core.plan import Plan, Prediction, SearchRecord, StagePlan, format_bytes, lowered_budget
from mistjax.core.schedules import V_SHAPED, ZERO_BUBBLE
from mistjax.core.strategies import CostModel, StageStrategies, WorkloadLike
from mistjax.tuning.baselines import ablation_spaces, baseline_spaces
from mistjax.tuning.inter import KeyChoice, key_bound, tune_key
from mistjax.tuning.intra import ScheduleMemo, StageTables, TableArena, sample_stage_tables, small_pages
from mistjax.tuning.space import OuterKey, SearchSpace, outer_keys

if TYPE_CHECKING:
    from mistjax.hardware.presets import ClusterSpec

# ``progress(space_name, keys_visited, keys_total)``: called as a search starts (0 visited), after each outer key it
# visits (pruned or searched) and as it ends (all visited, also when its time limit stopped it early).
Progress = Callable[[str, int, int], None]
# A JSON-ready report row (an outer key of the frontier, a stage's Pareto points): values of mixed types.
Record: TypeAlias = dict[str, Any]
# One improvement of a search: its objective, its plan and the Pareto data of its stages.
_Improvement: TypeAlias = tuple[float, Plan, tuple[Record, ...]]

__all__ = ["DEFAULT_WORK_BUDGET", "WorkBudget", "SearchResult", "TuneResult", "TunedPlan", "build_plan",
           "check_time_limit", "check_workers", "default_cost_model", "default_workers", "fingerprints", "search",
           "tune"]


def default_cost_model() -> CostModel:
    """The project's cost model (`mistjax.cost.COST_MODEL`)."""
    from mistjax.cost import COST_MODEL  # the tuner's only import of the cost package

    return COST_MODEL


@dataclass(frozen=True)
class TunedPlan(Plan):
    """A `Plan` from the tuner that also remembers the best baseline's prediction for `summary`.

    The extra fields are not part of the plan's JSON (a saved tuned plan loads as a plain `Plan`).
    """

    baseline_name: str = ""
    baseline_prediction: Prediction | None = None

    def to_dict(self) -> Record:
        out = super().to_dict()
        out.pop("baseline_name", None)
        out.pop("baseline_prediction", None)
        return out

    def as_plan(self) -> Plan:
        """The plain `Plan` (what the runtime and the JSON file see)."""
        return Plan.from_dict(self.to_dict())

    def summary(self) -> str:
        lines = [super().summary()]
        base, mine = self.baseline_prediction, self.prediction
        if base is not None and mine is not None and base.step_time > 0:
            lines.append(f"  best baseline ({self.baseline_name}): {base.step_time:.4g} s/step, "
                         f"{base.tokens_per_s:,.0f} tokens/s, peak {format_bytes(base.peak_memory)}/device; "
                         f"mistjax speedup {base.step_time / mine.step_time:.2f}x")
        return "\n".join(lines)


class WorkBudget(NamedTuple):
    """A deterministic limit on one search: past it no further outer key is started (a key started is finished),
    so a search stopped by it returns the same plan on any machine, however fast or busy. The default is about
    ten times the most any benchmark cell needs (`scripts/bench_tuner.py`: GPT-3 1T prices 10.9M strategies,
    GPT-3 530B solves 13 MILPs), so every one of them completes."""

    strategies: int = 100_000_000  # stage strategies priced by the cost model
    milps: int = 1_000  # inter-stage MILPs solved

    def spent(self, strategies: int, milps: int) -> bool:
        """Whether ``strategies`` priced and ``milps`` solved use the budget up."""
        return strategies >= self.strategies or milps >= self.milps


DEFAULT_WORK_BUDGET = WorkBudget()


@dataclass(frozen=True)
class SearchResult:
    """The outcome of searching one space.

    Attributes:
        space: the space searched.
        plan: the best plan (with prediction and fingerprints), or None if nothing fits.
        objective: the tuner's objective of that plan (seconds per step; inf if none).
        keys: outer keys in the space; ``keys_done`` of them were searched (wholly or in part).
        evaluated: stage strategies priced by the cost model.
        milps: inter-stage MILPs solved.
        seconds: wall time.
        timed_out: the time limit or the work budget stopped the search (the plan is the best found until then).
        frontier: per outer key: its parameters, bound, best objective (None: nothing fits, or not
            searched) and status: ``searched``, ``pruned`` (its bound cannot beat the plan found),
            ``partial`` (the limit stopped its search) or ``cut`` (the limit came before it).
        pareto: per stage of the chosen plan: the sampled (stable, delta) Pareto points of its layer
            count and the chosen point.
        keys_pruned: keys whose lower bound proved they cannot beat the plan.
        keys_cut: keys the time limit left unsearched or searched in part.
        gap: proven bound on how much faster the space's best plan can be: ``objective / lower bound - 1``
            over the cut keys' lower bounds (0 when the search is complete; inf when no plan was found
            or a cut key has no bound).
    """

    space: SearchSpace
    plan: Plan | None
    objective: float
    keys: int
    keys_done: int
    evaluated: int
    milps: int
    seconds: float
    timed_out: bool
    frontier: tuple[Record, ...] = ()
    pareto: tuple[Record, ...] = ()
    keys_pruned: int = 0
    keys_cut: int = 0
    gap: float = 0.0
    stopped_by: str = ""  # "" (complete), "work budget" (deterministic) or "time limit" (the clock)

    @property
    def complete(self) -> bool:
        """Every key was searched or pruned by a sound bound: the plan is the space's best."""
        return self.keys_cut == 0

    def completeness(self) -> str:
        """One line: keys searched / pruned / cut, and the proven gap when cut."""
        searched = self.keys - self.keys_pruned - self.keys_cut
        text = (f"{searched} of {self.keys} outer keys searched, {self.keys_pruned} pruned by bound, "
                f"{self.keys_cut} cut by the {self.stopped_by or 'time limit'}")
        if self.keys_cut:
            text += ("; no plan found" if self.plan is None else
                     "; the gap to the space's best is not bounded" if not math.isfinite(self.gap) else
                     f"; the space's best plan is at most {self.gap:.1%} faster than this one")
        return text

    @property
    def prediction(self) -> Prediction | None:
        return self.plan.prediction if self.plan is not None else None

    def record(self) -> SearchRecord:
        """The plan's `SearchRecord`: how this search ended, without its wall time."""
        return SearchRecord(complete=self.complete, stopped_by=self.stopped_by, keys=self.keys,
                            keys_pruned=self.keys_pruned, keys_cut=self.keys_cut, strategies_priced=self.evaluated,
                            milps=self.milps, gap=self.gap if math.isfinite(self.gap) else None)

    @property
    def step_time(self) -> float:
        p = self.prediction
        return p.step_time if p is not None else math.inf


def fingerprints(workload: WorkloadLike, cluster: ClusterSpec, params_fingerprint: str = "") -> dict[str, str]:
    """What a plan was tuned for: workload (model profile), mesh, hardware and batch.

    ``model`` (the runtime's `mistjax.plan.params_fingerprint`, checked when the plan is applied) is
    recorded only when the parameters are known, i.e. when `autoshard` tunes.
    """
    seq = getattr(workload, "seq_len", None)
    batch = getattr(workload, "global_batch", None)
    out = {"workload": str(workload.fingerprint()), "mesh": f"{cluster.nodes}x{cluster.devices_per_node}",
           "hardware": str(cluster.fingerprint()), "batch": f"{batch}x{seq}"}
    if params_fingerprint:
        out["model"] = params_fingerprint
    return out


def build_plan(tables: StageTables, choice: KeyChoice) -> Plan:
    """The `Plan` of an inter-stage choice (no prediction yet)."""
    key = tables.key
    stages, start = [], 0
    group = int(tables.grid.shard_group[choice.strategy[0]])
    for i, (n, r, x) in enumerate(zip(choice.layers, choice.remat, choice.strategy)):
        j = tables.layer_options.index(n)
        c = tables.remat_count(j, r)
        zero = int(tables.grid.zero[x])
        if int(tables.grid.shard_group[x]) != group:
            raise AssertionError(f"stage {i} uses MiCS group {tables.grid.shard_group[x]} != {group}")
        stages.append(StagePlan(
            layers=(start, start + n), shard_weights=zero >= 3, shard_grads=zero >= 2, shard_opt=zero >= 1,
            remat_layers=c, remat_policy=tables.remat.names[int(tables.remat.policy[r])] if c else "full",
            offload_weights=float(tables.grid.wo[x]), offload_grads=float(tables.grid.go[x]),
            offload_opt=float(tables.grid.oo[x]), offload_acts=float(tables.grid.ao[x])))
        start += n
    plan = Plan(stages=tuple(stages), micro_batch=key.micro_batch, grad_accum=key.grad_accum, dp=key.dp, tp=key.tp,
                cp=key.cp, cp_form=key.cp_form, shard_group=group, tp_overlap=key.tp_overlap,
                schedule="1f1b" if key.schedule in V_SHAPED else key.schedule)
    if key.schedule in V_SHAPED:
        return plan.v_shaped()
    return plan.interleaved(key.chunks) if key.chunks > 1 else plan


def _pareto_data(tables: StageTables, choice: KeyChoice, k: int, shared: bool) -> tuple[Record, ...]:
    if tables.key.stages == 1:
        G = tables.key.grad_accum
        s, d = tables.stable[0, 0].ravel(), tables.delta[0, 0].ravel()
        from mistjax.tuning.pareto import sample_pareto  # local: only the S = 1 report needs it here
        pick = sample_pareto(s, d, G, k)
        ok = pick.indices >= 0
        return ({"stage": 0, "layers": choice.layers[0], "stable": pick.stable[ok].tolist(),
                 "delta": pick.delta[ok].tolist(), "chosen": [choice.stable[0], choice.delta[0]]},)
    sampled = sample_stage_tables(tables, k, shared)
    g = choice.strategy[0] if shared else int(np.searchsorted(np.unique(tables.grid.shard_group),
                                                              tables.grid.shard_group[choice.strategy[0]]))
    out = []
    for i, n in enumerate(choice.layers):
        j = tables.layer_options.index(n)
        ok = np.isfinite(sampled.stable[g, i, j])
        out.append({"stage": i, "layers": n, "stable": sampled.stable[g, i, j][ok].tolist(),
                    "delta": sampled.delta[g, i, j][ok].tolist(), "chosen": [choice.stable[i], choice.delta[i]]})
    return tuple(out)


def _key_record(key: OuterKey, objective: float | None, bound: float, status: str) -> Record:
    rec = dataclasses.asdict(key)
    rec["objective"] = objective
    rec["bound"] = bound if math.isfinite(bound) else None
    rec["status"] = status
    return rec


def _key_bounds(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel, keys: list[OuterKey], space: SearchSpace,
                memo: ScheduleMemo, deadline: float) -> list[float]:
    """`inter.key_bound` of each key while time is left; a key left unbounded gets ``inf`` (visited last,
    never pruned by it).

    Bounding prices every key's families once, which grows with the space: past the deadline the
    search itself stops after the best-bound key, so the other keys' bounds would not be used.
    """
    bounds = [math.inf] * len(keys)
    for i, k in enumerate(keys):
        if time.perf_counter() >= deadline:
            break
        bounds[i] = key_bound(workload, cluster, cost, k, space, memo)
    return bounds


def _visit_order(keys: list[OuterKey], bounds: list[float]) -> list[int]:
    """One-chunk keys of the space's schedules first, then the ZB-H1 and interleaved keys; in each part best bound
    first, a key's siblings of other schedules (and chunk counts) right after it.

    The other schedules' keys rarely beat the one-chunk plans, which then cut their sweeps; siblings of other
    one-chunk schedules reuse each other's prices (`intra.ScheduleMemo`). Every key still faces the pruning test.
    """
    group = [dataclasses.replace(k, schedule="", chunks=1) for k in keys]
    group_bound: dict[OuterKey, tuple[float, int]] = {}
    for i, (g, b) in enumerate(zip(group, bounds)):
        group_bound[g] = min(group_bound.get(g, (math.inf, i)), (b, i))
    variant = [int(k.chunks > 1 or k.schedule in ZERO_BUBBLE) for k in keys]
    return sorted(range(len(keys)), key=lambda i: (variant[i], group_bound[group[i]], bounds[i], i))


@dataclass(frozen=True)
class _SearchJob:
    """What every outer key of one search is tuned against."""

    workload: WorkloadLike
    cluster: ClusterSpec
    cost: CostModel
    space: SearchSpace
    memo: ScheduleMemo
    prune: bool
    arena: TableArena = field(default_factory=TableArena)  # one key's tables at a time (`intra.TableArena`)


@dataclass
class _Tally:
    """What the loop over outer keys gathered so far (the loop adds to it key by key)."""

    # The best plan's search objective (its choice's; the key's tables are not kept: the next key reuses their
    # memory) and its step time under `predict` (what later keys must beat); inf: no plan yet.
    best_objective: float = math.inf
    best_time: float = math.inf
    found: list[_Improvement] = field(default_factory=list)  # every improvement, best last
    frontier: list[Record] = field(default_factory=list)
    evaluated: int = 0
    milps: int = 0
    done: int = 0  # keys searched (not pruned)
    timed_out: bool = False
    stopped_by: str = ""  # what stopped the search: "work budget", "time limit" or "" (nothing)
    cut_bounds: list[float] = field(default_factory=list)  # lower bounds of the keys cut by the limit
    fastest_key: float = math.inf  # seconds the quickest key searched so far took
    stopped: bool = False  # the work budget or the clock stopped the search: the keys left are cut
    before: tuple[int, int] = (0, 0)  # strategies and MILPs of the tasks merged before this one's seed

    def seed(self) -> _Tally:
        """A fresh tally for the next task (`_run_task`) that knows what this one knows: the best plan's objective
        and time, whether the search stopped, and the work spent (for the work budget)."""
        return _Tally(best_objective=self.best_objective, best_time=self.best_time, stopped_by=self.stopped_by,
                      fastest_key=self.fastest_key, stopped=self.stopped,
                      before=(self.before[0] + self.evaluated, self.before[1] + self.milps))

    def merge(self, task: _Tally) -> None:
        """Add a task's tally (seeded by `seed` from this one or an earlier state of it), in visit order. Its
        improvements are kept where they beat the best merged so far, as `keep` would have kept them."""
        for improvement in task.found:
            t = _predicted(improvement[1]).step_time
            if t < self.best_time:
                self.found.append(improvement)
                self.best_objective, self.best_time = improvement[0], t
        self.frontier += task.frontier
        self.evaluated += task.evaluated
        self.milps += task.milps
        self.done += task.done
        self.timed_out |= task.timed_out
        self.stopped_by = self.stopped_by or task.stopped_by
        self.stopped |= task.stopped
        self.cut_bounds += task.cut_bounds
        self.fastest_key = min(self.fastest_key, task.fastest_key)

    def add(self, job: _SearchJob, tables: StageTables, choice: KeyChoice | None, bound: float,
            plan: Plan | None = None) -> None:
        """Count one searched key and keep its choice when it beats the best so far (``plan``: its plan, with the
        full prediction attached, when `_fitting_choice` checked it)."""
        self.count(tables, choice)
        self.done += 1
        partial = tables.truncated or (choice is not None and not choice.optimal)
        self.timed_out |= partial
        if partial:
            self.stopped_by = self.stopped_by or "time limit"  # a key's pricing or MILP checks only the clock
            self.cut_bounds.append(bound)
        self.frontier.append(_key_record(tables.key, choice.objective if choice is not None else None, bound,
                                         "partial" if partial else "searched"))
        self.keep(job, tables, choice, plan)

    @property
    def cut(self) -> float:
        """What a key must beat: the best plan's objective or its predicted step time, whichever is larger. Its
        predicted time, where the search's objective was optimistic (an interleaved key assumes equal chunks); its
        objective, where that was pessimistic (ZB-H1's fill share from one strategy's weight-gradient share): a key
        whose objective is below it may still be faster under `predict`, which ranks the plans (`keep`)."""
        return max(self.best_objective, self.best_time) if math.isfinite(self.best_objective) else math.inf

    def count(self, tables: StageTables, choice: KeyChoice | None) -> None:
        """Add one search of a key to the strategies priced and MILPs solved."""
        self.evaluated += tables.evaluated
        if choice is not None:
            self.milps += choice.milps

    def keep(self, job: _SearchJob, tables: StageTables, choice: KeyChoice | None, plan: Plan | None) -> None:
        """Keep ``choice`` (a plan of ``tables``' key; ``plan``: it with its full prediction, None where it does not
        fit) when its predicted step time beats the best so far."""
        if choice is not None and plan is not None and _predicted(plan).step_time < self.best_time:
            self.best_objective, self.best_time = choice.objective, _predicted(plan).step_time
            self.found.append((choice.objective, plan, _pareto_data(tables, choice, job.space.pareto_k, False)))

    def result(self, space: SearchSpace, keys: int, seconds: float,
               winner: _Improvement | None = None) -> SearchResult:
        """The `SearchResult` of this tally with ``winner`` as its plan (None: no plan)."""
        objective, plan, pareto = winner if winner is not None else (math.inf, None, ())
        pruned = sum(r["status"] == "pruned" for r in self.frontier)
        lower = min(self.cut_bounds, default=math.inf)
        gap = 0.0 if not self.cut_bounds else max(0.0, objective / lower - 1.0) if lower > 0 else math.inf
        return SearchResult(space, plan, objective, keys, self.done, self.evaluated, self.milps, seconds,
                            self.timed_out, tuple(self.frontier), pareto, keys_pruned=pruned,
                            keys_cut=len(self.cut_bounds), gap=gap, stopped_by=self.stopped_by)


def _search_keys(job: _SearchJob, keys: list[OuterKey], bounds: list[float], deadline: float,
                 best_cost: float | None, progress: Progress | None, budget: WorkBudget | None,
                 workers: int = 1) -> _Tally:
    """Tune the outer keys in `_visit_order`, skipping those whose bound cannot beat the best so far.

    The keys go in tasks (`_tasks`: runs of keys that share prices), merged in visit order. The first task runs
    alone (its best-bound key usually gives the plan the others must beat); then task i starts from what tasks
    0 .. i - lag found (`_Tally.seed`): lag 1 with one worker (the sequential search), `_LAG` with more, the
    tasks in flight running side by side in worker processes (`_TaskPool`). Either way what each task knows,
    and so the answer and the work counted, depends on whether there are several workers only, never on the
    clock or on which task finishes first.

    Each key may use all the time left; once ``budget`` is spent (checked before each key, on the work of the
    tasks merged before its task's seed and its own task's: deterministic) or past the deadline, the keys not
    yet visited are cut (or pruned, where their bound already cannot beat the plan found).
    """
    tasks = _tasks(keys, _visit_order(keys, bounds))
    tally, visited = _Tally(), 0
    args = (job, keys, bounds, deadline, best_cost, budget)
    lag = _LAG if workers > 1 else 1
    with _TaskPool(args, workers if len(tasks) > 1 else 1) as pool:
        pending = [pool.submit(tasks[0], tally.seed())] if tasks else []
        for i, task in enumerate(tasks):
            tally.merge(pending[i].result())
            while len(pending) < min(len(tasks), i + 1 + lag):  # tasks i + 1 .. i + lag in flight
                pending.append(pool.submit(tasks[len(pending)], tally.seed()))
            for _ in task:  # each key of the task, reported as its task's results merge
                visited += 1
                if progress is not None and visited < len(keys):
                    progress(job.space.name, visited, len(keys))
    return tally


def _tasks(keys: list[OuterKey], order: list[int]) -> list[list[int]]:
    """``order`` cut into runs of consecutive keys that differ only in their schedule and chunk count (siblings,
    `_visit_order`): each run shares one `intra.ScheduleMemo` (one task of `_search_keys`)."""
    tasks: list[list[int]] = []
    last = None
    for i in order:
        group = dataclasses.replace(keys[i], schedule="", chunks=1)
        if tasks and group == last:
            tasks[-1].append(i)
        else:
            tasks.append([i])
        last = group
    return tasks


_TaskArgs: TypeAlias = tuple[_SearchJob, list[OuterKey], list[float], float, "float | None", "WorkBudget | None"]


def _run_task(args: _TaskArgs, task: list[int], tally: _Tally) -> _Tally:
    """Visit the keys ``task`` (indices into the keys, in visit order) on a `_Tally.seed`; returns it."""
    job, keys, bounds, deadline, best_cost, budget = args
    # In worker processes a memo per task: what a task prices then does not depend on which tasks ran before it
    # in the same worker. In this process the search's own (the sequential search's counts, as before).
    memo = job.memo if _POOL_ARGS is None else ScheduleMemo(job.memo.schedules)
    for i in task:
        key = keys[i]
        cut = tally.cut if math.isfinite(tally.best_objective) else best_cost
        if cut is not None and math.isfinite(bounds[i]) and bounds[i] >= cut:
            tally.frontier.append(_key_record(key, None, bounds[i], "pruned"))
            continue
        now = time.perf_counter()
        spent = (tally.before[0] + tally.evaluated, tally.before[1] + tally.milps)
        if not tally.stopped and budget is not None and budget.spent(*spent):
            tally.stopped, tally.stopped_by = True, tally.stopped_by or "work budget"
        # A key is not started with less time left than the quickest key so far took: its probes, base
        # prices and MILP set-up run before its first deadline check, so it would overrun the limit.
        if not tally.stopped and (now >= deadline or (math.isfinite(tally.fastest_key)
                                                      and deadline - now < tally.fastest_key)):
            tally.stopped, tally.stopped_by = True, tally.stopped_by or "time limit"
        if tally.stopped:
            tally.timed_out = True
            tally.cut_bounds.append(bounds[i])
            tally.frontier.append(_key_record(key, None, bounds[i], "cut"))
            continue
        tables, choice = tune_key(job.workload, job.cluster, job.cost, key, job.space, cut, deadline, job.prune,
                                  memo, job.arena)
        tally.fastest_key = min(tally.fastest_key, time.perf_counter() - now)
        tables, choice, plan = _fitting_choice(job, tables, choice, cut, deadline, tally)
        tally.add(job, tables, choice, bounds[i], plan)
    return tally


# The search a forked worker serves: set before its `_TaskPool` forks the workers, which inherit it (a workload's
# compiled profile is generated code that does not pickle).
_POOL_ARGS: _TaskArgs | None = None
# Tasks in flight with worker processes: task i starts from what tasks 0 .. i - _LAG found. More than the workers, so
# that a long task does not hold the others up (the merge is in visit order); few, so that the tasks in flight
# miss few of the plans found before them (measured: docs/tuning.md).
_LAG = 4
# Workers by default (`default_workers`): the searches measured gain little past two processes on the machines
# benchmarked (2 cores), and each worker holds its own key tables (hundreds of MB).
_MAX_WORKERS = 2


def default_workers() -> int:
    """The processes a search uses by default: the CPUs this process may run on, at most `_MAX_WORKERS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_WORKERS, cpus))


def _pool_task(task: list[int], seed: _Tally) -> _Tally:
    """`_run_task` in a worker process (`_TaskPool`)."""
    assert _POOL_ARGS is not None, "a worker is forked after its search set _POOL_ARGS"
    return _run_task(_POOL_ARGS, task, seed)


def _needs_work(args: _TaskArgs, task: list[int], seed: _Tally) -> bool:
    """Whether ``task`` would tune a key from ``seed`` (else it only records pruned or cut keys: done in-process)."""
    job, keys, bounds, deadline, best_cost, budget = args
    if seed.stopped or time.perf_counter() >= deadline or (budget is not None and budget.spent(*seed.before)):
        return False
    cut = seed.cut if math.isfinite(seed.best_objective) else best_cost
    return cut is None or any(not math.isfinite(bounds[i]) or bounds[i] < cut for i in task)


class _TaskPool:
    """Runs `_run_task` in this process (one worker) or in ``workers`` forked processes.

    Fork, not spawn: a worker starts with the search's workload, cost model and prices as they are (nothing to
    pickle or rebuild). The workers run NumPy only (the cost model's formulas, HiGHS), never JAX, so JAX's
    warning that a fork of its process may deadlock does not apply: it is silenced around the fork. Whatever
    the workers build lazily on the workload (a replicated-kv analysis traces the model) was built by the
    search's key bounds before the fork, when the search computes them.
    """

    def __init__(self, args: _TaskArgs, workers: int) -> None:
        self.args, self.workers = args, max(1, workers)
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> _TaskPool:
        global _POOL_ARGS
        if self.workers > 1:
            _POOL_ARGS = self.args
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"))
        return self

    def submit(self, task: list[int], seed: _Tally) -> Future[_Tally]:
        """``task`` run on ``seed``: in a worker where it tunes a key, else here."""
        if self._pool is None or not _needs_work(self.args, task, seed):
            done: Future[_Tally] = Future()
            done.set_result(_run_task(self.args, task, seed))
            return done
        with warnings.catch_warnings():  # the first submit forks the workers
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            return self._pool.submit(_pool_task, task, seed)

    def __exit__(self, *exc: object) -> None:
        global _POOL_ARGS
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        _POOL_ARGS = None


_REFITS = 3  # searches of one key again under a lower budget when its best plan did not fit under `predict`


def _fitting_choice(job: _SearchJob, tables: StageTables, choice: KeyChoice | None, cut: float | None,
                    deadline: float, tally: _Tally) -> tuple[StageTables, KeyChoice | None, Plan | None]:
    """A key's choice that may become the best plan, checked against the full prediction first: (its tables,
    the choice, its plan with the prediction), or without a plan where the choice beats nothing.

    The search's view of a key is approximate where its chunks differ (`intra.stage_inflight`; an interleaved
    key's fill share assumes equal chunks), and a plan the full prediction does not fit, or prices slower than
    its objective, would prune other keys by a time no plan reaches. So the incumbent is ranked by its predicted
    step time (`_Tally.keep`), and a key whose plan does not fit is searched again for a budget lowered by the
    overshoot (`core.plan.lowered_budget`), up to `_REFITS` times; if none fits, the key offers no plan. The
    other searches are counted in ``tally``.
    """
    budget = job.cluster.memory_budget()
    margin = job.cluster.device.memory_margin
    cluster = job.cluster
    for attempt in range(_REFITS + 1):
        if choice is None or (cut is not None and choice.objective >= cut):
            return tables, choice, None
        plan = build_plan(tables, choice).replace(grad_dtype=job.workload.grad_dtype)
        pred = job.cost.predict(job.workload, plan, job.cluster)
        need = pred.guarded_peak(margin)
        if need <= budget * (1 + 1e-9):
            return tables, choice, plan.replace(prediction=pred)
        # A lower budget only slows the key's plans: search again only if this one would beat the cut as it is.
        if attempt == _REFITS or time.perf_counter() >= deadline or (cut is not None and pred.step_time >= cut):
            break
        tally.count(tables, choice)
        lowered = lowered_budget(cluster.memory_budget(), need, need, budget)
        cluster = cluster.with_budget(lowered)
        # A fresh memo: the shared one's prices say what fits the cluster's own budget.
        tables, choice = tune_key(job.workload, cluster, job.cost, tables.key, job.space, cut, deadline, job.prune,
                                  ScheduleMemo(job.memo.schedules), job.arena)
    return tables, None, None


def _reschedule(job: _SearchJob, plan: Plan) -> Plan:
    """``plan`` or ``plan`` itself under another pipeline schedule of the space (ZB-H1, ZB-V, interleaved 1F1B)
    where the full prediction is faster and fits.

    Every key of every schedule was searched (`space.schedule_variants`); this only re-prices the winner as it is
    under the others, because `predict` prices the executor's issue order where the search's objective uses the
    schedule's fill share (`core.pipeline_time.fill_share`), and the two may rank near plans differently.
    """
    if plan.num_stages < 2 or plan.virtual_stages > 1 or plan.schedule in ZERO_BUBBLE:
        return plan
    candidates = [plan.replace(schedule=s, prediction=None) for s in sorted(ZERO_BUBBLE - V_SHAPED)
                  if job.space.zero_bubble]
    if job.space.zero_bubble and min(st.num_layers for st in plan.stages) >= 2 and _equal_chunks(job, plan, 2):
        candidates.append(plan.v_shaped())
    if plan.schedule == "1f1b" and plan.grad_accum % plan.num_stages == 0:
        splittable = min(st.num_layers for st in plan.stages)
        candidates += [plan.interleaved(v) for v in job.space.interleave
                       if v <= splittable and _equal_chunks(job, plan, v)]
    budget = job.cluster.memory_budget() * (1 + 1e-9)
    best = plan
    margin = job.cluster.device.memory_margin
    for cand in candidates:
        pred = job.cost.predict(job.workload, cand, job.cluster)
        if pred.guarded_peak(margin) <= budget and pred.step_time < _predicted(best).step_time:
            best = cand.replace(prediction=pred)
    return best


# The predicted step time collective matmuls must save before the tuner turns them on: the cost model's gain on the
# one published measurement (torchtitan's async TP, Llama 3 8B on H100) is twice the measured one (-18% / -9%), so
# a predicted 2% is about 1% real, and a smaller one may be none.
_TP_OVERLAP_MIN_GAIN = 0.02


def _overlap_or_not(job: _SearchJob, plan: Plan) -> Plan:
    """``plan``, searched with its TP collectives as collective matmuls (`OuterKey.tp_overlap`), or the same plan
    without them where the overlapped one is not `_TP_OVERLAP_MIN_GAIN` faster under the full prediction and the
    plain one fits (a plan searched without them is returned as it is)."""
    if not plan.tp_overlap:
        return plan
    plain = plan.replace(tp_overlap=False, prediction=None)
    pred = job.cost.predict(job.workload, plain, job.cluster)
    fits = pred.guarded_peak(job.cluster.device.memory_margin) <= job.cluster.memory_budget() * (1 + 1e-9)
    pays = _predicted(plan).step_time < (1 - _TP_OVERLAP_MIN_GAIN) * pred.step_time
    return plan if pays or not fits else plain.replace(prediction=pred)


def _predicted(plan: Plan) -> Prediction:
    """The full prediction a searched plan carries (`_fitting_choice` attaches it to every plan it returns)."""
    assert plan.prediction is not None, "a searched plan carries its prediction"
    return plan.prediction


def _equal_chunks(job: _SearchJob, plan: Plan, chunks: int) -> bool:
    """Whether ``plan``'s stages split into ``chunks`` equal chunks where the space's stages are uniform
    (Megatron-LM's virtual stages hold the same layers each); any split elsewhere."""
    return not job.space.uniform_layers or all(st.num_layers % chunks == 0 for st in plan.stages)


def _memo_schedules(space: SearchSpace) -> tuple[str, ...]:
    """The one-chunk schedules of the space's keys, priced at once (`intra.ScheduleMemo`)."""
    return tuple(space.schedules) + (tuple(sorted(ZERO_BUBBLE - V_SHAPED)) if space.zero_bubble else ())


def _supports_cp(workload: WorkloadLike) -> Callable[[int, int], bool]:
    """`WorkloadLike.supports_cp`, or one-way only for a workload that predates context parallelism."""
    return getattr(workload, "supports_cp", lambda cp, tp=1: cp == 1)


def _context_forms(workload: WorkloadLike, space: SearchSpace) -> Callable[[int, int], tuple[str, ...]]:
    """`WorkloadLike.context_forms` (or the ring wherever `_supports_cp` says, for a workload without it) where
    each device holds ``space.min_context_tokens`` of a sequence at least, else none."""
    supports = _supports_cp(workload)
    forms = getattr(workload, "context_forms", lambda cp, tp=1: (ContextForm.RING.value,) if supports(cp, tp) else ())

    def spaced(cp: int, tp: int) -> tuple[str, ...]:
        return () if cp > 1 and int(workload.seq_len) < cp * space.min_context_tokens else forms(cp, tp)

    return spaced


def search(workload: WorkloadLike, cluster: ClusterSpec, space: SearchSpace | None = None, *,
           time_limit: float = 60.0, cost: CostModel | None = None, best_cost: float | None = None,
           prune: bool = True, progress: Progress | None = None,
           work_budget: WorkBudget | None = DEFAULT_WORK_BUDGET, workers: int | None = None) -> SearchResult:
    """Search one space for the plan with the lowest predicted step time.

    Outer keys are visited best-bound first (`inter.key_bound`: each key's fastest strategies
    without remat, offload or memory limit), and a key whose bound cannot beat the best plan so far
    is skipped unpriced.

    Args:
        workload: the cost model's `Workload` (model, sequence length, global batch).
        cluster: a `ClusterSpec`; its nodes x devices_per_node are the devices to plan for, and
            ``memory_budget()`` the per-device memory limit.
        space: the space (default: mistjax's full space).
        time_limit: seconds, a hard deadline; when they run out the best plan so far is returned with a
            warning saying how complete the search was (`SearchResult.completeness`). A search that completes
            within it returns the same plan whatever the limit.
        cost: the cost model (default `mistjax.cost.COST_MODEL`).
        best_cost: an objective to beat from elsewhere (keys that cannot beat it report None).
        prune: skip strategies that bounds prove useless (see `inter.tune_key`); False prices
            every strategy of every key (Mist's exhaustive evaluation; slow).
        progress: ``progress(space.name, keys_visited, keys_total)`` as the search starts, after each
            outer key and as it ends (e.g. a progress bar; it does not change the search).
        work_budget: the deterministic limit (`WorkBudget`; None: none). The plan records how the search ended
            (`Plan.search`: complete, or stopped by the work budget or the time limit).
        workers: processes that tune outer keys side by side (default `default_workers`: the CPUs, at most 2;
            1: this process alone). The plan and the work counted depend on this number only, never on the
            machine's speed or load (`_search_keys`).
    """
    space = space or SearchSpace()
    check_time_limit(time_limit)
    workers = check_workers(default_workers() if workers is None else workers)
    job = _SearchJob(workload, cluster, cost or default_cost_model(), space, ScheduleMemo(_memo_schedules(space)),
                     prune)
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    keys = outer_keys(space, int(workload.num_layers), int(workload.global_batch), cluster.nodes,
                      cluster.devices_per_node, workload.supports_tp, _context_forms(workload, space),
                      async_collectives=bool(cluster.device.async_collectives))
    if progress is not None:
        progress(space.name, 0, len(keys))
    with small_pages():  # the key tables (`intra.small_pages`)
        bounds = (_key_bounds(workload, cluster, job.cost, keys, space, job.memo, deadline) if prune
                  else [0.0] * len(keys))
        tally = _search_keys(job, keys, bounds, deadline, best_cost, progress, work_budget, workers)
        if progress is not None:
            progress(space.name, len(keys), len(keys))
        # Every improvement kept fits under `predict` and carries its prediction (`_fitting_choice`); the last is best.
        winner = tally.found[-1] if tally.found else None
        if winner is not None:
            objective, plan, pareto = winner
            plan = _overlap_or_not(job, _reschedule(job, plan))
            plan = plan.replace(fingerprints=fingerprints(workload, cluster))
            winner = objective, plan, pareto
    result = tally.result(space, len(keys), time.perf_counter() - t0, winner)
    if result.plan is not None:
        result = dataclasses.replace(result, plan=result.plan.replace(search=result.record()))
    if tally.timed_out:
        limit = f"its time limit ({time_limit:g} s)" if tally.stopped_by == "time limit" else f"its {work_budget}"
        warnings.warn(f"space {space.name!r} stopped at {limit}: {result.completeness()}", RuntimeWarning,
                      stacklevel=2)
    return result


def check_workers(workers: int) -> int:
    """``workers``, or a `ValueError` naming the fix unless it is a positive whole number of processes."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers {workers!r}: need a positive whole number of processes (1: search in this "
                         "process alone; default: the CPUs, at most 2)")
    return workers


def check_time_limit(seconds: float) -> None:
    """Raise a `ValueError` naming the fix unless ``seconds`` is a positive, finite time limit."""
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"time limit {seconds!r}: need a positive number of seconds (--time-limit SECONDS; "
                         "120 searches every Mist-grid cell completely)")


@dataclass(frozen=True)
class TuneResult:
    """What `tune` found.

    Attributes:
        plan: the best plan (a `TunedPlan`: its summary shows the best baseline next to it).
        prediction: its prediction.
        baselines: per baseline name, the best plan of that space (`SearchResult`).
        ablations: per ablation step, the best plan of that space (empty unless asked for).
        search: the mistjax search itself (frontier, Pareto data, counts).
        timing: seconds: ``tune`` (mistjax's search), ``baselines``, ``ablations``, ``total``.
        note: how the plan was chosen when it is not the search's own (see `tune`).
    """

    plan: TunedPlan
    prediction: Prediction
    baselines: dict[str, SearchResult] = field(default_factory=dict)
    ablations: dict[str, SearchResult] = field(default_factory=dict)
    search: SearchResult | None = None
    timing: dict[str, float] = field(default_factory=dict)
    note: str = ""

    @property
    def pareto(self) -> tuple[Record, ...]:
        return self.search.pareto if self.search is not None else ()

    def best_baseline(self) -> tuple[str, SearchResult] | None:
        found = [(n, r) for n, r in self.baselines.items() if r.plan is not None]
        return min(found, key=lambda nr: nr[1].step_time) if found else None

    def speedup(self, baseline: str = "megatron") -> float:
        """Predicted step-time ratio baseline / mistjax (inf if the baseline has no feasible plan)."""
        r = self.baselines.get(baseline)
        return (r.step_time / self.prediction.step_time) if r is not None else math.nan

    def summary(self) -> str:
        lines = [self.plan.summary()]
        if self.search is not None:
            lines.append(f"  tuned in {self.timing.get('tune', 0):.2f} s: {self.search.completeness()} "
                         f"({self.search.evaluated:,} stage strategies priced, {self.search.milps} MILPs)")
        for name, r in {**self.baselines, **self.ablations}.items():
            ratio = r.step_time / self.prediction.step_time if self.prediction.step_time else math.nan
            t = f"{r.step_time:.4g} s/step ({ratio:.2f}x)" if r.plan is not None else "no feasible plan"
            lines.append(f"  {name:>16}: {t}")
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)


def no_plan_message(workload: WorkloadLike, cluster: ClusterSpec, cost: CostModel) -> str:
    """Why nothing fits: the smallest per-device memory mistjax can reach, and what would fit it."""
    n = cluster.nodes * cluster.devices_per_node
    budget = cluster.memory_budget()
    text = (f"no plan fits: every strategy of the space exceeds the memory budget of {budget / 2**30:.2f} GiB per "
            f"device on {cluster.nodes}x{cluster.devices_per_node} devices")
    try:
        policy = tuple(workload.policies).index("full") if "full" in workload.policies else 0
        # Every context-parallel degree the sequence allows (a power of two dividing the devices) without tensor
        # parallelism (tp = 1), the rest DP.
        supports = _supports_cp(workload)
        cps = np.array([c for c in (2**i for i in range(n.bit_length())) if n % c == 0 and supports(c, 1)])
        smallest = cost.stage_cost(workload, cluster, StageStrategies.make(
            b=1, dp=n // cps, cp=cps, zero=3, layers=workload.num_layers, remat=workload.num_layers, policy=policy,
            wo=1.0, go=1.0, oo=1.0, ao=1.0, G=np.maximum(1, getattr(workload, "global_batch", n) // (n // cps)),
            per_node=cluster.devices_per_node, nodes=cluster.nodes))
        best = int(np.argmin(smallest.peak))
        need = float(smallest.peak[best])

        def gib(x: Any) -> str:
            return f"{float(np.broadcast_to(x, smallest.peak.shape)[best]) / 2**30:.2f} GiB"

        mem = smallest.memory
        # What the figure counts (#55: it read as if offload were not subtracted): device bytes after offload.
        names = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
                 "buffers": "buffers (transients, e.g. the optimizer update's device copies of offloaded state)"}
        order = [k for k in ("params", "grads", "optimizer", "activations", "buffers") if k in mem]
        parts = ", ".join(f"{gib(mem[k])} {names.get(k, k)}" for k in order + [k for k in mem if k not in order])
        host = getattr(smallest, "host", None)  # a cost model may not price host memory
        counted = f"counted on the device after offload: {parts}" + (
            f"; {gib(host)} more offloaded to host memory" if host is not None else "")
        cp = int(cps[best])
        layout = (f"each sequence split over {cp} devices (context parallelism), ZeRO-3 over {n // cp}" if cp > 1
                  else f"ZeRO-3 over all {n} devices")
        more = math.ceil(n * need / budget) if need > 0 else n
        card = need / cluster.device.usable_memory_fraction / 2**30
        text += (f"; the smallest plan needs {need / 2**30:.2f} GiB of device memory per device ({layout}, every "
                 f"layer recomputed, everything offloadable offloaded, micro-batch 1; {counted}). Use devices "
                 f"with at least {card:.1f} GiB, about {more} or more "
                 "devices of this kind, a shorter sequence, or a smaller model")
    except Exception as e:  # the diagnosis must never hide the real error
        text += f"; use more devices, a smaller model or batch (could not estimate the minimum: {e})"
    return text


def tune(workload: WorkloadLike, cluster: ClusterSpec, *, space: SearchSpace | None = None, time_limit: float = 60.0,
         baselines: tuple[str, ...] | None = None, ablations: bool = False, cost: CostModel | None = None,
         baseline_time_limit: float = 60.0, progress: Progress | None = None,
         work_budget: WorkBudget | None = DEFAULT_WORK_BUDGET, workers: int | None = None) -> TuneResult:
    """Tune a plan for ``workload`` on ``cluster`` and compare it with the baselines.

    Every space searched here is contained in mistjax's full space, so when a baseline's plan is
    predicted faster than the search's own (possible only where `predict` prices something the
    search objective leaves out), that plan is adopted and ``note`` says so.

    Args:
        workload: the cost model's `Workload`.
        cluster: the `ClusterSpec` to plan for (its memory budget is the limit).
        space: mistjax's space (default: the full space).
        time_limit: seconds for mistjax's search.
        baselines: baseline names (default: all of `mistjax.tuning.baselines.BASELINES`; ``()``: none).
        ablations: also search the ablation steps.
        cost: the cost model (default `mistjax.cost.COST_MODEL`).
        baseline_time_limit: seconds for each baseline / ablation search.
        progress: passed to each `search` (mistjax's space, then the baselines and ablations).
        work_budget: each search's deterministic limit (`WorkBudget`; None: none).
        workers: each search's processes (`search`).

    Raises:
        RuntimeError: no plan of the space fits in memory, or the time limit ran out before one was found.
        ValueError: a time limit that is not a positive number of seconds.
    """
    cost = cost or default_cost_model()
    check_time_limit(time_limit)
    check_time_limit(baseline_time_limit)
    t0 = time.perf_counter()
    main = search(workload, cluster, space, time_limit=time_limit, cost=cost, progress=progress,
                  work_budget=work_budget, workers=workers)
    t1 = time.perf_counter()
    base = {name: search(workload, cluster, sp, time_limit=baseline_time_limit, cost=cost, progress=progress,
                         work_budget=work_budget, workers=workers)
            for name, sp in baseline_spaces(baselines).items()}
    t2 = time.perf_counter()
    abl = {name: search(workload, cluster, sp, time_limit=baseline_time_limit, cost=cost, progress=progress,
                        work_budget=work_budget, workers=workers)
           for name, sp in ablation_spaces().items()} if ablations else {}
    t3 = time.perf_counter()
    plan, note = main.plan, ""
    contained = {n: r for n, r in base.items() if r.plan is not None}
    if contained:
        name, r = min(contained.items(), key=lambda nr: nr[1].step_time)
        if plan is None or r.step_time < main.step_time:
            plan, note = r.plan, f"adopted the {name} baseline's plan (predicted faster than the search's own)"
    if plan is None and main.keys_cut:
        fix = "--time-limit SECONDS" if main.stopped_by == "time limit" else "work_budget=WorkBudget(...)"
        raise RuntimeError(f"no plan found within the time limit ({time_limit:g} s) and work budget: "
                           f"{main.completeness()}. Raise the limit that stopped it ({fix})")
    if plan is None:
        raise RuntimeError(no_plan_message(workload, cluster, cost))
    found = [(n, r) for n, r in base.items() if r.plan is not None]
    bname, bres = min(found, key=lambda nr: nr[1].step_time) if found else ("", None)
    tuned = TunedPlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(Plan)},
                      baseline_name=bname, baseline_prediction=bres.prediction if bres is not None else None)
    timing = {"tune": t1 - t0, "baselines": t2 - t1, "ablations": t3 - t2, "total": t3 - t0}
    return TuneResult(tuned, _predicted(tuned), base, abl, main, timing, note)
