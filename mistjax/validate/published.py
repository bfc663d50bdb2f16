"""Published training runs against the cost model: equivalent plans, predictions, breakdowns, summary.

For each run of a ``published-runs.json`` file (`mistjax.validate.published_format`) `predict_run` builds
the equivalent mistjax `Plan` (`to_plan`), the model config, the cluster, and prices the plan with the
project's cost model (`mistjax.cost.predict.analyze`). It also attributes the predicted step time to
resources (matmul, memory-bound kernels, collectives, pipeline sends, host copies: how much the
prediction shrinks when that resource is made free) and to structure (steady micro-batches, pipeline
fill / drain, once-per-step work). `summarize` and `speedup_pairs` give what
``scripts/bench_published.py`` prints; docs/benchmarks.md has the measured tables.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import numpy as np

from mistjax.core.plan import Plan, StagePlan
from mistjax.cost.predict import Analysis, analyze
from mistjax.cost.workload import Workload
from mistjax.hardware import ClusterSpec, LinkModel
from mistjax.tuning.baselines import Storage, SystemRecord, system_named
from mistjax.validate.published_format import (
    PublishedRun,
    PublishedRuns,
    PublishedRunsError,
    load_published,
    model_config,
    parse_published,
)

if TYPE_CHECKING:
    from models.config import ModelConfig

MiB, GiB = 2**20, 2**30
# A run's cell (`cell_key`): (model preset or shape, sequence length, preset, nodes, GPUs per node, flash flag).
Cell: TypeAlias = tuple[str | tuple[str | int | None, ...], int, str, int, int, bool]
# Resources whose time `time_by_resource` attributes, in print order; "shared" is what no single one removes.
RESOURCES = ("matmul", "memory_bound", "launch", "collectives", "p2p", "host_copies")
_FREE = 1e9  # factor that makes a resource free without leaving the validated (finite) range


@dataclass(frozen=True)
class RunPrediction:
    """One run priced by the cost model."""

    run: PublishedRun  # the record
    plan: Plan  # the equivalent mistjax plan
    cluster: ClusterSpec  # the cluster it was priced on (card memory as the run had it)
    analysis: Analysis  # the cost model's prediction with its breakdowns
    by_resource: dict[str, float]  # seconds of the step attributed to each of RESOURCES + "shared"
    by_structure: dict[str, float]  # seconds: steady micro-batches, pipeline fill/drain, once-per-step
    runtime_ok: bool  # the mistjax runtime can run the plan as it is
    notes: tuple[str, ...]  # what the prediction approximates for this run
    untimed: float = 0.0  # predicted seconds of the step the run's timing leaves out (its optimizer step)

    @property
    def step_time(self) -> float:
        """Predicted seconds of what the run timed (the whole step less `untimed`)."""
        return self.analysis.step_time - self.untimed

    @property
    def stage_peaks(self) -> tuple[float, ...]:
        """Predicted device bytes per stage."""
        return tuple(sum(m.values()) for m in self.analysis.stage_memory)

    @property
    def fits(self) -> bool:
        """Every stage's predicted device memory fits the card."""
        return max(self.stage_peaks) <= self.cluster.device.hbm_bytes

    @property
    def fits_budget(self) -> bool:
        """The plan passes the tuner's own memory check: every stage's `guarded_peak` (the preset's memory margin on
        the non-state part) within `ClusterSpec.memory_budget` of the card the run had."""
        dev = self.cluster.device
        return self.analysis.prediction.guarded_peak(dev.memory_margin) <= self.cluster.memory_budget()

    @property
    def time_ratio(self) -> float | None:
        t = self.run.measured.iter_time_s
        return None if t is None else self.step_time / t

    @property
    def memory_ratio(self) -> float | None:
        """Predicted / measured peak (max over stages), where the peak was measured."""
        m = self.run.measured.stage_peak_allocated_mib
        return None if m is None else max(self.stage_peaks) / (max(m) * MiB)


@dataclass(frozen=True)
class RunFailure:
    """A run the cost model could not price: kept in the results with the reason, never dropped."""

    run: PublishedRun  # the record
    error: str  # why (the cost model's or the analysis's message)


# ---------------------------------------------------------------------------------------------- building
def zoo_workload(config: ModelConfig, seq_len: int, global_batch: int, policies: tuple[str, ...] | None,
                 storage: Storage | None = None) -> Workload:
    """The cost model's workload of a zoo model (`models.workload`), its state stored as ``storage`` says
    (default: the config's own dtypes, an fp32 master copy under 16-bit weights)."""
    import models

    if storage is None:
        return models.workload(config, seq_len, global_batch, policies=policies)
    return models.workload(config.replace(dtype=storage.compute_dtype, param_dtype=storage.param_dtype), seq_len,
                           global_batch, policies=policies, master_weights=storage.master_weights,
                           grad_dtype=storage.grad_dtype)


def system_workload(system: SystemRecord, config: ModelConfig, seq_len: int, global_batch: int, precision: str,
                    policies: tuple[str, ...] | None = None) -> Workload:
    """``config`` trained at ``precision`` (fp32 / bf16 / fp16 / fp8) as ``system`` runs it: its kernels
    (`as_system_runs_it`) and its state storage (`SystemRecord.storage`). The grid prices every baseline's space
    with it, and `predict_run` every published run."""
    return zoo_workload(as_system_runs_it(config, system), seq_len, global_batch, policies,
                        system.storage(precision))


def to_plan(run: PublishedRun) -> Plan:
    """The mistjax plan equivalent to a run's parallel configuration.

    Per stage: its layer range, ``remat_layers`` checkpointed with its ``remat_policy`` (Megatron's full
    uniform recompute is every layer with ``full``), ZeRO flags from the stage's level (Megatron's distributed
    optimizer is ZeRO-1) and the offload fractions; DP, TP, micro-batch, accumulation and schedule as
    given. Plain ZeRO over the data-parallel group (no MiCS partition).
    """
    par = run.parallel
    stages = tuple(StagePlan(layers=s.layers, shard_opt=s.zero >= 1, shard_grads=s.zero >= 2,
                             shard_weights=s.zero >= 3, remat_layers=s.remat_layers, remat_policy=s.remat_policy,
                             offload_weights=s.offload_weights, offload_grads=s.offload_grads,
                             offload_opt=s.offload_opt, offload_acts=s.offload_acts) for s in par.stages)
    return Plan(stages=stages, micro_batch=par.micro_batch, grad_accum=par.grad_accum, dp=par.dp, tp=par.tp,
                schedule=par.schedule, virtual_stages=par.virtual_stages, shard_group=par.shard_group,
                tp_overlap=run.tp_overlap)


def run_config(run: PublishedRun) -> ModelConfig:
    """The zoo model config a run is priced with: its shape and dtype (FP8 projections for an fp8 run), the
    attention it ran (fused for ``flash_attention``, else unfused as Megatron-LM runs it), and its system's kernels
    (`as_system_runs_it`: the elementwise chains, the rotary fraction where the record gives none). The state's
    storage is the system's too (`predict_run` passes `SystemRecord.storage`)."""
    config = model_config(run.model, run.dtype).replace(attention="fused" if run.flash_attention else "xla",
                                                        fp8=run.fp8)
    return as_system_runs_it(config, run.system_record, keep_rotary=run.model.rotary_pct is not None)


def as_system_runs_it(config: ModelConfig, system: SystemRecord, keep_rotary: bool = False) -> ModelConfig:
    """A zoo config with ``system``'s kernels: its elementwise chains (``eager``: Megatron-LM's model code, the
    artifact's pin, runs RMSNorm, rotary and SwiGLU as PyTorch ops one kernel each; ``fused`` elsewhere) and, for
    a rotary model, the whole head rotated where the system does so by default (Megatron-LM's
    ``--rotary-percent`` 1.0) unless ``keep_rotary`` (the run's record gives its fraction)."""
    rotary = config.rotary_pct
    if system.whole_head_rotary and rotary and not keep_rotary:
        rotary = 1.0
    return config.replace(elementwise=system.elementwise, rotary_pct=rotary)


def as_megatron_runs_it(config: ModelConfig) -> ModelConfig:
    """``config`` with Megatron-LM's kernels (`as_system_runs_it` with its record)."""
    return as_system_runs_it(config, system_named("megatron"))


def _storage_text(storage: Storage) -> str:
    weights = "fp32 weights" if storage.param_dtype == "float32" else "16-bit weights with an fp32 master copy"
    grads = "fp32" if (storage.grad_dtype or storage.param_dtype) == "float32" else "16-bit"
    return f"{storage.compute_dtype} compute, {weights}, {grads} gradients, fp32 moments"


def runtime_elementwise(run: PublishedRun) -> str:
    """How the run's system runs elementwise chains (`SystemRecord.elementwise`)."""
    return run.system_record.elementwise


def cluster_for(run: PublishedRun) -> ClusterSpec:
    """The run's hardware preset at its shape, with the card memory the run had (when the file gives it)."""
    hw = run.hardware
    cluster = ClusterSpec.preset(hw.preset, nodes=hw.nodes, per_node=hw.per_node)
    return cluster if hw.card_memory_gib is None else cluster.with_memory(hw.card_memory_gib * GiB)


def run_workload(run: PublishedRun) -> Workload:
    """The workload a run is priced with: its model as its system runs it (`run_config`), its sequence and
    batch, the remat policies its plan uses, and the state stored as the system stores it at the run's
    precision (`SystemRecord.storage`). `predict_run` and the preset fit (`validate.calibration`) read it."""
    return zoo_workload(run_config(run), run.model.seq_len, run.global_batch, _policies(to_plan(run)),
                        run.system_record.storage(run.precision_word))


def _policies(plan: Plan) -> tuple[str, ...] | None:
    """Remat policies to analyse: the plan's (``full`` at least) unless a stage offloads activations (needs every
    tag policy)."""
    if any(s.offload_acts > 0 for s in plan.stages):
        return None
    return tuple(sorted({"full", *(s.remat_policy for s in plan.stages)}))


def _runtime_check(plan: Plan) -> str | None:
    """Why the mistjax runtime cannot run ``plan`` today (None: it can).

    Single-stage plans run on the SPMD step, pipelined ones on the MPMD executor, which takes per-stage
    ZeRO, remat and offload settings (docs/pipelines.md); `Plan` validation already refused the rest.
    """
    del plan
    return None


# ---------------------------------------------------------------------------------------------- breakdowns
def _scaled(link: LinkModel) -> LinkModel:
    return LinkModel(link.bandwidth * _FREE, 0.0)


def _free(cluster: ClusterSpec, resource: str) -> ClusterSpec:
    """``cluster`` with one resource made (practically) free."""
    dev = cluster.device
    if resource == "matmul":
        return replace(cluster, device=replace(dev, peak_flops=dev.peak_flops * _FREE,
                                               peak_flops_fp32=dev.peak_flops_fp32 * _FREE,
                                               peak_flops_fp8=dev.peak_flops_fp8 * _FREE))
    if resource == "memory_bound":
        return replace(cluster, device=replace(dev, hbm_bandwidth=dev.hbm_bandwidth * _FREE))
    if resource == "launch":
        return replace(cluster, device=replace(dev, kernel_overhead=0.0))
    if resource == "collectives":
        return replace(cluster, intra_node={k: _scaled(v) for k, v in cluster.intra_node.items()},
                       inter_node={k: _scaled(v) for k, v in cluster.inter_node.items()})
    if resource == "p2p":
        return replace(cluster, p2p_intra=_scaled(cluster.p2p_intra), p2p_inter=_scaled(cluster.p2p_inter))
    if resource == "host_copies":
        return replace(cluster, device=replace(dev, host_to_device=_scaled(dev.host_to_device),
                                               device_to_host=_scaled(dev.device_to_host)))
    raise ValueError(f"unknown resource {resource!r}; one of {RESOURCES}")


def time_by_resource(workload: Workload, plan: Plan, cluster: ClusterSpec, step: float) -> dict[str, float]:
    """Seconds of the predicted step each resource accounts for: ``step`` minus the step with it free.

    Serial work adds up exactly; time hidden under overlap is removed by no single resource and is
    reported as ``shared`` (``step - sum``; it is 0 when nothing overlaps).
    """
    out = {r: step - analyze(workload, plan, _free(cluster, r)).step_time for r in RESOURCES}
    out["shared"] = step - sum(out.values())
    return {k: _denoise(v, step) for k, v in out.items()}


def _denoise(v: float, scale: float) -> float:
    """0 for float round-off (and the 1e-9 left by a 'free' resource) relative to ``scale``."""
    return 0.0 if abs(v) <= 1e-6 * scale else v


def time_by_structure(a: Analysis, plan: Plan) -> dict[str, float]:
    """Seconds of the step: G x the slowest stage's micro-batch, pipeline fill / drain, once-per-step work."""
    steady = plan.grad_accum * max(f + b for f, b in zip(a.stage_fwd, a.stage_bwd))
    per_step = max(a.prediction.stage_delta) if a.prediction.stage_delta else 0.0
    return {"steady": steady, "pipeline_fill_drain": _denoise(a.step_time - steady - per_step, a.step_time),
            "per_step": per_step}


# ---------------------------------------------------------------------------------------------- predicting
_UNTIMED_OPTIMIZER = re.compile(r"optimizer[^.;]*not timed|exclud\w* the optimizer|without the optimizer", re.I)


def excludes_optimizer(run: PublishedRun) -> bool:
    """The run's time leaves the optimizer step out (its ``timing_scope`` says so, as Mist's benchmark does)."""
    return bool(_UNTIMED_OPTIMIZER.search(run.measured.timing_scope))


def optimizer_seconds(workload: Workload, plan: Plan, cluster: ClusterSpec) -> float:
    """Predicted seconds of the optimizer step in ``plan``'s step: the update and the ZeRO-1/2 re-gather of the
    updated parameters (the slowest stage's)."""
    from mistjax.cost.model import stage_cost
    from mistjax.cost.predict import plan_strategies

    return float(np.max(stage_cost(workload, cluster, plan_strategies(workload, plan, cluster)).optimizer_step))


def predict_run(run: PublishedRun) -> RunPrediction:
    """Price one run with the cost model (see the module docstring).

    The model runs the attention the run ran: fused (``flash_attention``) or unfused (``attention="xla"``),
    and its elementwise chains as the run's runtime does (`run_config`).
    A run whose timing leaves the optimizer step out is compared without it (`excludes_optimizer`). Its
    tensor-parallel collectives are priced as the run ran them: as collective matmuls where it did
    (`PublishedRun.tp_overlap`, the plan's ``tp_overlap``), else serially.
    """
    return _predict_run(run)


def _predict_run(run: PublishedRun) -> RunPrediction:
    plan = to_plan(run)
    cluster = cluster_for(run)
    system = run.system_record
    storage = system.storage(run.precision_word)
    workload = run_workload(run)
    a = analyze(workload, plan, cluster)
    notes = list(a.notes)
    untimed = optimizer_seconds(workload, plan, cluster) if excludes_optimizer(run) else 0.0
    if untimed:
        notes.append("timing leaves the optimizer step out: compared without the predicted update and re-gather")
    if run.dtype != "float32":
        notes.append(f"{run.precision_word} as {system.name} runs it: {_storage_text(storage)}"
                     + (", the attention and MLP projections as FP8 GEMMs with tensorwise scales" if run.fp8 else ""))
    why = _runtime_check(plan)
    if why:
        notes.append(f"runtime cannot run this plan today: {why}")
    return RunPrediction(run=run, plan=plan, cluster=cluster, analysis=a,
                         by_resource=time_by_resource(workload, plan, cluster, a.step_time),
                         by_structure=time_by_structure(a, plan), runtime_ok=why is None, notes=tuple(notes),
                         untimed=untimed)


def predict_all(runs: PublishedRuns) -> list[RunPrediction | RunFailure]:
    """`predict_run` for every point, in file order; a run that cannot be priced becomes a `RunFailure`."""
    out: list[RunPrediction | RunFailure] = []
    for r in runs.points:
        try:
            out.append(predict_run(r))
        # PlanError, ScheduleError, analysis errors (unsupported model code), unanalysed policies, and anything
        # else: a run that cannot be priced is reported with the reason, never a crash of the whole file.
        except Exception as e:  # noqa: BLE001
            out.append(RunFailure(run=r, error=f"{type(e).__name__}: {e}"))
    return out


def _priced(preds: Sequence[RunPrediction | RunFailure]) -> list[RunPrediction]:
    return [p for p in preds if isinstance(p, RunPrediction)]


# ---------------------------------------------------------------------------------------------- summary
def _log_stats(ratios: list[float]) -> dict[str, float | None]:
    logs = [abs(math.log(r)) for r in ratios]
    return {"median_abs_log_ratio": statistics.median(logs) if logs else None,
            "max_abs_log_ratio": max(logs) if logs else None}


def summarize(preds: list[RunPrediction | RunFailure]) -> dict[str, dict[str, float | None]]:
    """Time and memory accuracy over the priced runs that have the measurement.

    ``memory`` compares each run's peak (max over stages); ``n_fit`` counts runs that ran and are
    predicted to fit their card's memory, ``n_fit_budget`` those that also pass the tuner's own check
    (`RunPrediction.fits_budget`), ``n_ran`` the runs that ran (have a measured step time; a run the model
    could not price counts as ran and not fitting); ``n_unpriced`` the runs that could not be priced.
    """
    priced = _priced(preds)
    t = [p.time_ratio for p in priced if p.time_ratio is not None]
    m = [p.memory_ratio for p in priced if p.memory_ratio is not None]
    geo = math.exp(statistics.fmean(math.log(r) for r in t)) if t else None
    n_fit = sum(p.fits for p in priced if p.run.ran)
    n_budget = sum(p.fits_budget for p in priced if p.run.ran)
    return {"time": {"n": len(t), **_log_stats(t), "geo_mean_ratio": geo},
            "memory": {"n": len(m), **_log_stats(m), "n_fit": n_fit, "n_fit_budget": n_budget,
                       "n_ran": sum(p.run.ran for p in preds), "n_unpriced": len(preds) - len(priced)}}


def cell_key(run: PublishedRun) -> Cell:
    """The run's cell: (model, sequence length, preset, nodes, GPUs per node, flash flag); the Mist and
    Megatron-LM runs of one cell are compared (`speedup_pairs`)."""
    mdl, hw = run.model, run.hardware
    model = mdl.preset or (mdl.family, mdl.hidden, mdl.layers, mdl.heads, mdl.kv_heads, mdl.ffn, mdl.vocab)
    return (model, mdl.seq_len, hw.preset, hw.nodes, hw.per_node, run.flash_attention)


def speedup_pairs(preds: list[RunPrediction | RunFailure]) -> list[dict[str, str | float]]:
    """Every (Mist run, Megatron-LM run) of one cell (model, cluster, flash flag): speedup = t_megatron / t_mist."""
    out = []
    priced = [p for p in _priced(preds) if p.run.ran]
    for mist in (p for p in priced if p.run.framework == "mist"):
        for meg in (p for p in priced if p.run.framework == "megatron"):
            if cell_key(meg.run) != cell_key(mist.run):
                continue
            measured = meg.run.measured.iter_time_s / mist.run.measured.iter_time_s
            predicted = meg.step_time / mist.step_time
            out.append({"mist": mist.run.id, "megatron": meg.run.id, "measured_speedup": measured,
                        "predicted_speedup": predicted, "ratio": predicted / measured})
    return out


class MeasuredSpeedup(NamedTuple):
    """A measured Mist-over-Megatron-LM speedup of one cell, read from the measured times alone."""

    model: str  # the model preset (or the record's name when it has none)
    hardware: str  # the cluster preset
    gpus: int  # nodes x GPUs per node
    flash_attention: bool  # both runs used fused attention
    mist: str  # the Mist run's id (the cell's fastest Mist run)
    megatron: str  # the Megatron-LM run's id
    speedup: float  # t_megatron / t_mist, measured


def measured_speedups(runs: PublishedRuns) -> list[MeasuredSpeedup]:
    """Per cell (`cell_key`), the fastest Mist run over the fastest Megatron-LM run that ran."""
    best: dict[Cell, dict[str, PublishedRun]] = {}
    for r in runs.points:
        if not r.ran or r.framework == "other":
            continue
        cell = best.setdefault(cell_key(r), {})
        old = cell.get(r.framework)
        if old is None or r.measured.iter_time_s < old.measured.iter_time_s:
            cell[r.framework] = r
    out = []
    for cell in best.values():
        if "mist" in cell and "megatron" in cell:
            mist, meg = cell["mist"], cell["megatron"]
            hw = mist.hardware
            out.append(MeasuredSpeedup(mist.model.preset or model_config(mist.model).name, hw.preset,
                                       hw.nodes * hw.per_node, mist.flash_attention, mist.id, meg.id,
                                       meg.measured.iter_time_s / mist.measured.iter_time_s))
    return out


def _shape_name(r: PublishedRun) -> str:
    try:
        return model_config(r.model).name
    except ValueError:
        return "?"


def point_dict(p: RunPrediction | RunFailure) -> dict[str, object]:
    """JSON form of one run and its prediction (``error`` instead of predictions for a `RunFailure`)."""
    r = p.run
    meas = r.measured
    head = {
        "id": r.id, "kind": r.kind, "system": r.system, "framework": r.framework, "priced_as": r.system_record.name,
        "model": r.model.preset or _shape_name(r), "seq_len": r.model.seq_len,
        "cluster": f"{r.hardware.preset}:{r.hardware.nodes}x{r.hardware.per_node}",
        "flash_attention": r.flash_attention, "flash_attention_priced": True,
        "elementwise_priced": runtime_elementwise(r), "precision": r.precision,
        "ran": r.ran, "measured_time_s": meas.iter_time_s,
        "measured_stage_peak_mib": list(meas.stage_peak_allocated_mib) if meas.stage_peak_allocated_mib else None,
    }
    if isinstance(p, RunFailure):  # the plan or the model may be what could not be built
        return {**head, "expressible": False, "error": p.error}
    head.update({"rotary_pct_priced": run_config(r).rotary_pct, "plan": p.plan.to_dict(), "expressible": True})
    a = p.analysis
    return {
        **head, "predicted_time_s": p.step_time, "untimed_s": p.untimed, "time_ratio": p.time_ratio,
        "predicted_stage_peak_mib": [x / MiB for x in p.stage_peaks], "memory_ratio": p.memory_ratio,
        "predicted_stage_memory_mib": [{k: v / MiB for k, v in m.items()} for m in a.stage_memory],
        "predicted_stage_host_mib": [x / MiB for x in a.stage_host],
        "card_memory_mib": p.cluster.device.hbm_bytes / MiB, "fits": p.fits,
        "budget_mib": p.cluster.memory_budget() / MiB, "fits_budget": p.fits_budget,
        "time_by_resource_s": p.by_resource, "time_by_structure_s": p.by_structure,
        "runtime_ok": p.runtime_ok, "notes": list(p.notes),
    }


__all__ = ["RESOURCES", "Cell", "MeasuredSpeedup", "PublishedRunsError", "RunFailure", "RunPrediction",
           "as_megatron_runs_it", "cell_key", "cluster_for", "load_published", "measured_speedups", "parse_published",
           "point_dict", "predict_all", "predict_run", "run_config", "run_workload", "runtime_elementwise",
           "system_workload", "as_system_runs_it",
           "speedup_pairs", "summarize", "time_by_resource", "time_by_structure", "to_plan", "zoo_workload"]
