"""`autoshard` without a plan: trace the step, tune for the mesh (or load a cached plan), then run.

The workload comes from the loss the step differentiates with `mistjax.value_and_grad` (captured
while tracing the step), with the sequence length and global batch of the example batch. Plans are
cached as JSON (never pickle) under ``cache_dir``, named by a hash of the fingerprints of model,
mesh, hardware, batch and search space.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import jax
import numpy as np
from jax.extend import core as jex
from jax.sharding import Mesh

from mistjax.api.precision import MasterWeightsState
from mistjax.core.execution import ExecutionPlan, is_batch_leaf
from mistjax.core.layout import OPT, PARAM
from mistjax.core.plan import Plan, PlanDoesNotFit, PlanError, Prediction, format_bytes, lowered_budget
from mistjax.core.strategies import CostModel
from mistjax.core.types import Batch, Metrics, PyTree, State, TrainStep
from mistjax.cost.workload import OPTIMIZERS, Workload
from mistjax.hardware.presets import ClusterSpec
from mistjax.runtime import fit
from mistjax.runtime.mpmd_state import is_staged
from mistjax.runtime.report import AppliedReport, PipelineReport
from mistjax.runtime.step import AxisRules, CompiledPrograms, LossCall, ShardedStep, StepAnalysis, analyze_step
from mistjax.tuning.space import SearchSpace
from mistjax.tuning.tuner import TunedPlan, TuneResult, default_cost_model, fingerprints, tune

__all__ = ["AutoShardedStep", "Hardware", "MeshLike", "detect_cluster", "step_workload"]

MeshLike: TypeAlias = Mesh | Sequence[jax.Device] | None
"""The devices a step may use: a `jax.sharding.Mesh`, a list of devices, or None (all devices)."""

Hardware: TypeAlias = ClusterSpec | str | None
"""What to tune for: a `ClusterSpec`, a preset name, a ``NAME:NODESxPER_NODE`` spec, or None (detect)."""

_CACHE_FORMAT = "mistjax.tuned-plan"
_MAX_RETUNES = 3  # re-tunes after a tuned plan did not fit the devices' free memory
# device_kind substrings -> preset, most specific first.
_GPU_PRESETS = (("A100-SXM4-40GB", "a100-40gb"), ("A100", "a100-80gb"), ("H200", "h200"), ("H100", "h100"),
                ("L4", "l4"))


def _devices(mesh: MeshLike) -> list[jax.Device]:
    if mesh is None:
        return list(jax.devices())
    if hasattr(mesh, "devices"):
        return list(np.asarray(mesh.devices).flat)
    return list(mesh)


def detect_cluster(devices: Sequence[jax.Device], hardware: Hardware = None,
                   memory_budget: float | None = None) -> ClusterSpec:
    """The `ClusterSpec` to tune for on ``devices``.

    Args:
        devices: the devices of the mesh.
        hardware: None (detect from the platform: ``cpu`` on the host, the GPU's preset by its
            device kind), a preset name, a ``NAME:NODESxPER_NODE`` spec or a `ClusterSpec`.
        memory_budget: bytes a plan may use per device (overrides the preset's budget).
    """
    n = len(devices)
    per_node = min(n, max(1, sum(1 for d in devices if d.process_index == devices[0].process_index)))
    if isinstance(hardware, ClusterSpec):
        cluster = hardware
    elif isinstance(hardware, str) and ":" in hardware:
        cluster = ClusterSpec.parse(hardware)
    else:
        name = hardware
        if name is None:
            d = devices[0]
            name = "cpu" if d.platform == "cpu" else None
            kind = str(getattr(d, "device_kind", ""))
            for pattern, preset in _GPU_PRESETS:
                if name is None and pattern.lower() in kind.lower():
                    name = preset
            if name is None and d.platform == "tpu":
                name = "tpu-v5p" if "v5p" in kind.lower() else "tpu-v5e"
            if name is None:
                raise PlanError(f"cannot tell which hardware preset fits device kind {kind!r}; pass hardware=<preset> "
                                "(mistjax.hardware.PRESET_NAMES) or a ClusterSpec")
        cluster = ClusterSpec.preset(name, nodes=max(1, n // per_node), per_node=per_node)
    if cluster.num_devices != n:
        per_node = min(cluster.devices_per_node, n)
        if n % per_node:
            raise PlanError(f"hardware {cluster.name!r} has {cluster.devices_per_node} devices per node, which does "
                            f"not tile the mesh's {n} devices")
        cluster = cluster.with_shape(n // per_node, per_node)
    if memory_budget is None and hardware is None and devices[0].platform != "cpu":
        stats = devices[0].memory_stats() or {}
        if stats.get("bytes_limit"):
            cluster = cluster.with_memory(float(stats["bytes_limit"]))
    if memory_budget is not None:
        cluster = cluster.with_memory(float(memory_budget) / cluster.device.usable_memory_fraction)
    return cluster


def _seq_len(batch: Batch, global_batch: int) -> int:
    for x in jax.tree.leaves(batch):
        if np.ndim(x) >= 2 and np.shape(x)[0] == global_batch:
            return int(np.shape(x)[1])
    raise PlanError("cannot find the sequence length: no batch array is shaped [global_batch, seq_len, ...]; "
                    "pass workload=...")


def _resized_batch(args: tuple[PyTree, ...], global_batch: int, seq_len: int
                   ) -> Callable[[int, int], tuple[PyTree, ...]]:
    """``(b, s) -> args`` with every batch array resized: leading dim ``b``, sequence dim ``s``."""
    def resize(b: int, s: int) -> tuple[PyTree, ...]:
        def one(x: jax.Array) -> jax.ShapeDtypeStruct:
            shape = list(np.shape(x))
            if is_batch_leaf(shape, global_batch):
                shape[0] = b
                if len(shape) > 1 and shape[1] == seq_len:
                    shape[1] = s
            return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

        return tuple(jax.tree.map(one, args))

    return resize


def _optimizer_state(state: State, analysis: StepAnalysis) -> dict[str, str | bool | int]:
    """How the step's optimizer state is stored: the `OPTIMIZERS` entry whose moments per parameter match,
    a master copy (`with_master_weights`), and the bytes per state element."""
    leaves = jax.tree.leaves(state)
    opt = [x for x, role in zip(leaves, analysis.roles) if role == OPT]
    param_elems = sum(int(np.prod(np.shape(x))) for x, role in zip(leaves, analysis.roles) if role == PARAM)
    opt_elems = sum(int(np.prod(np.shape(x))) for x in opt)
    master = any(isinstance(node, MasterWeightsState) for node in
                 jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, MasterWeightsState)))
    moments = (round(opt_elems / param_elems) if param_elems else 0) - int(master)
    by_moments = {c: name for name, (c, _, _) in reversed(OPTIMIZERS.items())}
    itemsize = max((np.dtype(x.dtype).itemsize for x in opt), default=4,
                   key=lambda i: sum(int(np.prod(np.shape(x))) for x in opt if np.dtype(x.dtype).itemsize == i))
    return {"optimizer": by_moments.get(moments, "adamw"), "master_weights": master, "state_itemsize": int(itemsize)}


def step_workload(loss: LossCall, state: State, analysis: StepAnalysis, batch: Batch, global_batch: int,
                  grad_dtype: str | None = None, profile_cache: bool | str | Path = True,
                  axis_rules: AxisRules | None = None) -> Workload:
    """The cost model's `Workload` of a traced step: its loss, parameters, batch sizes and optimizer state.

    ``profile_cache``: where analysed profiles are cached (`mistjax.analysis.cache`; True: the default).
    """
    seq = _seq_len(batch, global_batch)
    return Workload.from_loss(loss.fun, loss.args[0], seq_len=seq, global_batch=global_batch,
                              name=f"step-{analysis.params_fingerprint[:8]}",
                              batch_fn=_resized_batch(loss.args[1:], global_batch, seq),
                              compute_dtype=_matmul_dtype(loss), grad_dtype=grad_dtype,
                              cache=profile_cache, axis_rules=axis_rules,
                              **_optimizer_state(state, analysis))


def _matmul_dtype(loss: LossCall) -> str:
    """The dtype the loss's largest matmul runs in (what the cost model prices matmuls at)."""
    best: tuple[float, str] = (-1.0, "float32")

    def walk(jaxpr: jex.Jaxpr) -> None:
        nonlocal best
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                a, b = eqn.invars[0].aval, eqn.invars[1].aval
                best = max(best, (float(np.prod(a.shape)) * float(np.prod(b.shape)), np.dtype(a.dtype).name))
            for sub in jex.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(loss.fun)(*loss.args).jaxpr)
    return best[1]


def _cache_key(fps: dict[str, str], space: SearchSpace, cost: CostModel) -> str:
    model = f"{cost.stage_cost.__module__}.{getattr(cost.stage_cost, '__qualname__', '')}"
    doc = {"fingerprints": fps, "space": space.to_dict(), "cost": model}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _load_cached(path: Path, fps: dict[str, str]) -> TunedPlan | None:
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != _CACHE_FORMAT or doc.get("fingerprints") != fps:
            return None
        plan = Plan.from_dict(doc["plan"])
        base = doc.get("baseline") or {}
        pred = Prediction(**{**base["prediction"], "stage_stable": tuple(base["prediction"]["stage_stable"]),
                             "stage_delta": tuple(base["prediction"]["stage_delta"]),
                             "stage_memory": tuple(base["prediction"]["stage_memory"])}) if base else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"ignoring unreadable plan cache {str(path)!r} ({e}); tuning again", RuntimeWarning,
                      stacklevel=3)
        return None
    return TunedPlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(Plan)},
                     baseline_name=base.get("name", ""), baseline_prediction=pred)


def _save_cached(path: Path, plan: TunedPlan, fps: dict[str, str]) -> None:
    base = None
    if plan.baseline_prediction is not None:
        base = {"name": plan.baseline_name, "prediction": dataclasses.asdict(plan.baseline_prediction)}
    doc = {"format": _CACHE_FORMAT, "fingerprints": fps, "plan": plan.to_dict(), "baseline": base}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    tmp.replace(path)


def _lowered_budget(plan: Plan, err: PlanDoesNotFit, budget: float) -> float:
    """The per-device budget to re-tune for after ``plan`` did not fit (`mistjax.core.plan.lowered_budget`)."""
    pred = plan.prediction
    # stage_memory is per device group; a pipeline's stage k runs on group plan.stage_groups[k].
    group = plan.stage_groups[err.stage] if 0 <= err.stage < plan.num_stages else 0
    predicted = sum(pred.stage_memory[group].values()) if pred and pred.stage_memory else 0.0
    return lowered_budget(budget, predicted, err.need, err.available)


@dataclass
class _Tuning:
    """What tuning needs again when autoshard re-tunes (`AutoShardedStep._retune`)."""

    workload: Workload
    cluster: ClusterSpec  # lowered by each re-tune
    space: SearchSpace
    cost: CostModel
    fingerprints: dict[str, str]  # of the first cluster: a re-tuned plan is cached for the same inputs
    path: Path | None  # the plan cache file
    devices: list[jax.Device]
    global_batch: int


class AutoShardedStep:
    """A train step whose plan is tuned on first use (see `mistjax.autoshard`).

    Before the first step the tuned plan's compiled programs are checked against each device's free memory
    (`mistjax.runtime.fit`, on devices that report a limit); a plan that does not fit is re-tuned for a
    budget lowered by the measured gap, at most `_MAX_RETUNES` times (said on stderr, as a `RuntimeWarning`
    and in `summary`), and only a plan that fits is cached.
    """

    def __init__(self, train_step: TrainStep, mesh: MeshLike = None, *, hardware: Hardware = None,
                 global_batch: int | None = None, memory_budget: float | None = None,
                 cache_dir: str | Path | None = None, space: SearchSpace | None = None, time_limit: float = 60.0,
                 workload: Workload | None = None, baselines: tuple[str, ...] | None = None,
                 cost: CostModel | None = None, axis_rules: AxisRules | None = None, verbose: bool = True) -> None:
        self.train_step, self.user_mesh = train_step, mesh
        self.hardware, self.global_batch, self.memory_budget = hardware, global_batch, memory_budget
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.space, self.time_limit, self.workload, self.baselines = space, time_limit, workload, baselines
        self.cost, self.axis_rules, self.verbose = cost, axis_rules, verbose
        self.result: TuneResult | None = None  # the tuner's full result (None when the plan came from the cache)
        self.cache_hit = False
        self.retunes: list[str] = []  # one line per re-tune after the memory check (see `summary`)
        self._inner: ShardedStep | None = None
        self._tuning: _Tuning | None = None
        self._unsaved: TunedPlan | None = None  # tuned, to be cached once it is known to fit

    # ---------------------------------------------------------------- tuning
    def _workload(self, state: State, batch: Batch, analysis: StepAnalysis, global_batch: int) -> Workload:
        if self.workload is not None:
            return self.workload
        if analysis.loss is None:
            raise PlanError("autoshard without a plan tunes for the loss the step differentiates, and this step uses "
                            "no mistjax.value_and_grad / mistjax.grad: use them in place of jax's (drop-in), or pass "
                            "workload=... or plan=...")
        # Profiles live next to the plans when a cache_dir is given, else in the default profile cache.
        profiles = self.cache_dir / "profiles" if self.cache_dir is not None else True
        return step_workload(analysis.loss, state, analysis, batch, global_batch, profile_cache=profiles,
                             axis_rules=self.axis_rules)

    def _space(self, analysis: StepAnalysis, global_batch: int, num_devices: int) -> SearchSpace:
        space = self.space or SearchSpace()
        if analysis.num_layers is None:
            # No scan over stacked layers: no pipeline and no per-layer remat.
            space = space.replace(pipeline=False, remat="none")
        if not analysis.uses_mistjax_grad:
            # jax.grad cannot be split into micro-batches or checkpointed per layer: one micro-batch per
            # step, every per-device batch size that makes it.
            sizes = {global_batch // d for d in range(1, num_devices + 1)
                     if num_devices % d == 0 and global_batch % d == 0}
            space = space.replace(pipeline=False, remat="none", max_grad_accum=1, micro_batches=tuple(sorted(sizes)))
        return space

    def _say(self, message: str) -> None:
        """A progress line on stderr (first call only; process 0 of a multi-process run)."""
        if self.verbose and jax.process_index() == 0:
            print(f"mistjax.autoshard: {message}", file=sys.stderr, flush=True)

    def _tune(self, state: State, batch: Batch) -> None:
        t0 = time.perf_counter()
        devices = _devices(self.user_mesh)
        B = self.global_batch or max(int(np.shape(x)[0]) for x in jax.tree.leaves(batch) if np.ndim(x))
        cost = self.cost or default_cost_model()
        self._say("no plan given: tracing the step and analysing its loss (cached on disk after the first run)")
        analysis = analyze_step(self.train_step, state, batch, self.axis_rules)
        workload = self._workload(state, batch, analysis, B)
        self._say(f"model analysed in {time.perf_counter() - t0:.1f} s ({workload.num_layers} layers"
                  f"{', unrolled' if analysis.unrolled else ''})")
        cluster = detect_cluster(devices, self.hardware, self.memory_budget)
        space = self._space(analysis, B, len(devices))
        fps = fingerprints(workload, cluster, getattr(analysis, "params_fingerprint", ""))
        path = self.cache_dir / f"plan-{_cache_key(fps, space, cost)}.json" if self.cache_dir else None
        self._tuning = _Tuning(workload, cluster, space, cost, fps, path, devices, B)
        plan = _load_cached(path, fps) if path is not None and path.is_file() else None
        self.cache_hit = plan is not None
        if plan is None:
            plan = self._search(cluster)
        else:
            self._say(f"plan read from the cache {str(path)!r}")
        self._build(plan)
        if not fit.capacities(devices):  # no device reports a memory limit (CPU): nothing to check
            self._save()

    def _search(self, cluster: ClusterSpec) -> TunedPlan:
        """Tune for ``cluster`` (the plan is cached only once it fits: `_save`)."""
        t = self._tuning
        assert t is not None
        self._say(f"tuning a plan for {len(t.devices)} x {cluster.device.name} (global batch {t.global_batch}, "
                  f"{format_bytes(cluster.memory_budget())} per device, search limited to {self.time_limit:g} s)")
        t1 = time.perf_counter()
        self.result = tune(t.workload, cluster, space=t.space, time_limit=self.time_limit, baselines=self.baselines,
                           cost=t.cost)
        self._say(f"tuned in {time.perf_counter() - t1:.1f} s: " + self.result.plan.summary().splitlines()[0])
        self._unsaved = self.result.plan.replace(fingerprints=t.fingerprints)
        return self._unsaved

    def _build(self, plan: Plan) -> None:
        assert self._tuning is not None
        mesh = self.user_mesh if self.user_mesh is not None else self._tuning.devices
        self._inner = ShardedStep(self.train_step, mesh, plan, axis_rules=self.axis_rules)

    def _save(self) -> None:
        """Cache the tuned plan (once: after it passed the memory check, or where nothing is checked)."""
        if self._unsaved is not None and self._tuning is not None and self._tuning.path is not None:
            _save_cached(self._tuning.path, self._unsaved, self._tuning.fingerprints)
        self._unsaved = None

    def _fitted(self, state: State, batch: Batch) -> State:
        """``state`` after the plan's memory check before the first step (placed where it ran); a tuned plan
        that does not fit is re-tuned (`_retune`) until one fits."""
        assert self._inner is not None
        while self._inner.fit is None and batch is not None:
            try:
                state = self._inner.verify_memory(state, batch)
            except PlanDoesNotFit as e:
                state = self._retune(e, state)
        if self._inner.fit is not None:
            self._save()
        return state

    def _retune(self, err: PlanDoesNotFit, state: State) -> State:
        """Tune again for a budget lowered by the measured gap; returns ``state`` for the new plan."""
        t, old = self._tuning, self._inner
        assert t is not None and old is not None
        budget = t.cluster.memory_budget()
        target = _lowered_budget(old.plan, err, budget)
        if len(self.retunes) >= _MAX_RETUNES or target <= 0:
            raise PlanDoesNotFit(f"{err}; autoshard tuned this plan and re-tuned {len(self.retunes)} time(s) for the "
                                 "measured gap; pass memory_budget=... lower, or a plan", stage=err.stage,
                                 need=err.need, available=err.available, report=err.report) from err
        note = (f"the tuned plan does not fit: stage {err.stage} needs {format_bytes(err.need)} per device, "
                f"{format_bytes(err.available)} are free; re-tuning for {format_bytes(target)} per device "
                f"(was {format_bytes(budget)})")
        self.retunes.append(note)
        self._say(note)
        warnings.warn(f"mistjax.autoshard: {note}", RuntimeWarning, stacklevel=4)
        t.cluster = t.cluster.with_budget(target)
        try:
            plan = self._search(t.cluster)
        except RuntimeError as e:
            raise PlanDoesNotFit(f"{err}; autoshard re-tuned for {format_bytes(target)} per device, but {e}",
                                 stage=err.stage, need=err.need, available=err.available, report=err.report) from e
        self._build(plan)
        if any(is_staged(x) for x in jax.tree.leaves(state, is_leaf=is_staged)):
            state = old.gather(state)  # pieces placed for the old pipeline: whole arrays for the new plan
        return state

    def _ready(self, state: State, batch: Batch | None, what: str) -> ShardedStep:
        if self._inner is None:
            if batch is None:
                raise PlanError(f"autoshard without a plan tunes on the first batch: call {what} with an example "
                                "batch (e.g. step.place(state, batch)) or pass plan=...")
            self._tune(state, batch)
        assert self._inner is not None
        return self._inner

    # ---------------------------------------------------------------- ShardedStep API (`PlannedStep`)
    def _tuned(self) -> ShardedStep:
        if self._inner is None:
            raise PlanError("no plan yet: autoshard tunes on the first step.place(state, batch) or step(state, batch)")
        return self._inner

    @property
    def plan(self) -> Plan:
        """The tuned plan (after the first place / call)."""
        return self._tuned().plan

    @property
    def applied(self) -> AppliedReport | PipelineReport | None:
        """What each knob did (`mistjax.runtime.report.AppliedReport`, per stage a `PipelineReport`), once
        placed."""
        return self._inner.applied if self._inner is not None else None

    @property
    def execution(self) -> ExecutionPlan | None:
        """How the tuned plan runs (`mistjax.core.execution.ExecutionPlan`), once set up / traced."""
        return self._inner.execution if self._inner is not None else None

    @property
    def fit(self) -> fit.FitReport | None:
        """The memory check before the first step (`mistjax.runtime.fit.FitReport`), once it ran."""
        return self._inner.fit if self._inner is not None else None

    def report(self) -> str:
        """What each knob of the tuned plan did to this step, per stage for a pipeline (after the first
        place / call)."""
        return self._tuned().report()

    def summary(self) -> str:
        """The tuned plan's summary, what was applied, the memory check and the re-tunes it caused."""
        lines = [self._tuned().summary()]
        if self.retunes:
            lines += [f"re-tuned {len(self.retunes)} time(s) after the memory check before the first step:"]
            lines += [f"  {note}" for note in self.retunes]
        mfu = self._predicted_mfu()
        return "\n".join(lines + ([f"  {mfu}"] if mfu else []))

    def _predicted_mfu(self) -> str | None:
        """The predicted MFU of the tuned plan (`mistjax.api.mfu`; the step's attention shape is unknown here,
        so its FLOPs are not counted and the line says so), or None before tuning."""
        from mistjax.api.mfu import ModelFlops, mfu_line

        plan, t = self._tuned().plan, self._tuning
        if t is None or plan.prediction is None:
            return None
        dev = t.cluster.device
        peak = float(dev.peak_flops_fp32 if t.workload.compute_dtype == "float32" else dev.peak_flops)
        flops = ModelFlops(sum(leaf.size for leaf in t.workload.leaves))
        return mfu_line(plan.prediction.tokens_per_s, flops, plan.num_devices, peak) + f" ({dev.name})"

    @property
    def mesh(self) -> Mesh | None:
        """The plan's device mesh (None before tuning)."""
        return self._inner.mesh if self._inner is not None else None

    def place(self, state: State, batch: Batch | None = None) -> State:
        """Tune on the first call (needs ``batch``), check the plan fits the devices, then place ``state``
        as `ShardedStep.place` does."""
        self._ready(state, batch, "step.place(state, batch)")
        state = self._fitted(state, batch)
        return self._tuned().place(state, batch)

    def gather(self, state: State) -> State:
        """A placed state as whole host arrays (`ShardedStep.gather`: a pipeline's `StagedArray` leaves
        reassembled)."""
        return self._tuned().gather(state)

    def compile_stages(self, state: State, batch: Batch, phases: Sequence[str] | None = None, *,
                       compile: bool = True) -> CompiledPrograms:
        """Every program of the tuned plan, ``{(stage, phase): jax.stages.Compiled}`` (tunes first if needed;
        see `ShardedStep.compile_stages`)."""
        return self._ready(state, batch, "step.compile_stages(state, batch)").compile_stages(
            state, batch, phases, compile=compile)

    def batch_shardings(self, batch: Batch) -> PyTree:
        """The shardings `__call__` expects for ``batch`` (after tuning)."""
        return self._ready(None, None, "step.place(state, batch)").batch_shardings(batch)

    def place_batch(self, batch: Batch) -> Batch:
        """Shard a global batch over the tuned plan's data-parallel axes (after tuning)."""
        return self._ready(None, None, "step.place(state, batch)").place_batch(batch)

    def lower(self, state: State, batch: Batch) -> jax.stages.Lowered:
        """The tuned one-stage plan's program, lowered (tunes first if needed; a pipeline raises
        `PlanError`: use `compile_stages`)."""
        return self._ready(state, batch, "step.lower(state, batch)").lower(state, batch)

    def __call__(self, state: State, batch: Batch) -> tuple[State, Metrics]:
        """One train step; the first call tunes, checks the plan fits, and places the state."""
        self._ready(state, batch, "step(state, batch)")
        state = self._fitted(state, batch)
        return self._tuned()(state, batch)
