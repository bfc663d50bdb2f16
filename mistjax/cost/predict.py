"""`predict` / `analyze`: the cost model's view of one whole `Plan`, stage by stage, priced as the
runtime's executor runs it: one program for a single stage, the MPMD pipeline otherwise
(docs/pipelines.md, docs/internals.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from mistjax.core.context import ContextForm
from mistjax.core.hlo import CollectiveOp
from mistjax.core.pipeline_order import (
    OpCost,
    charged_deferred,
    charged_in_flight,
    group_finish_times,
    group_residual_peaks,
    issue_order,
)
from mistjax.core.pipeline_order import op_costs as order_op_costs
from mistjax.core.pipeline_time import pipeline_time
from mistjax.core.plan import Plan, Prediction, format_bytes
from mistjax.core.schedules import V_SHAPED, ZERO_BUBBLE
from mistjax.core.strategies import StageStrategies
from mistjax.cost.model import MEMORY_CATEGORIES, StageCost, stage_cost
from mistjax.cost.workload import Workload
from mistjax.hardware.presets import ClusterSpec

# Memory categories a device group holds once per chunk it runs (state, residuals); the rest are
# transients of one program at a time.
_PER_CHUNK = ("params", "optimizer", "grads", "activations")


@dataclass(frozen=True)
class Analysis:
    """A plan's prediction with its breakdowns (per device; per device group where stages differ)."""

    prediction: Prediction  # what `predict` returns
    step_time: float  # seconds per step as the executor runs the plan
    mist_step_time: float  # Mist's 1F1B / GPipe formula on the same stage times, for comparison
    stage_fwd: tuple[float, ...]  # per (virtual) stage: forward seconds of one micro-batch
    stage_bwd: tuple[float, ...]  # per (virtual) stage: backward seconds of one micro-batch
    stage_wgrad: tuple[float, ...]  # per (virtual) stage: the weight-gradient GEMMs' part of `stage_bwd`
    stage_memory: tuple[dict[str, float], ...]  # per device group: device bytes by category
    stage_host: tuple[float, ...]  # per device group: host bytes per device (offloaded state and activations)
    xla_cpu_peak: tuple[float, ...]  # per device group: device + host bytes, what XLA:CPU's memory analysis counts
    collective_bytes: dict[str, float]  # per step, per device, result bytes by collective kind (max over stages)
    flops: tuple[float, ...]  # per (virtual) stage: FLOPs per device per step
    flops_xla: tuple[float, ...]  # per (virtual) stage: FLOPs as XLA's cost_analysis counts them
    dispatch_time: float = 0.0  # host seconds issuing the step's programs and transfers
    notes: tuple[str, ...] = field(default=())  # what is approximated for this plan

    @property
    def peak_memory(self) -> float:
        return self.prediction.peak_memory

    def summary(self) -> str:
        """A short human-readable table."""
        lines = [f"step {self.step_time:.4g} s (Mist formula {self.mist_step_time:.4g} s, host dispatch "
                 f"{self.dispatch_time:.3g} s), peak {self.peak_memory / 2**20:.1f} MiB/device"]
        for i, m in enumerate(self.stage_memory):
            cats = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in m.items())
            lines.append(f"  stage {i}: MiB: {cats}")
        lines.append("  collectives/step: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in
                                                         self.collective_bytes.items()))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _inflight(plan: Plan) -> np.ndarray:
    """Micro-batches of residuals each virtual stage holds at its peak under the MPMD issue order; the last
    stage's forward and backward are one program, which holds one micro-batch's transiently."""
    if plan.num_stages == 1:
        return np.ones(1, np.int64)
    return charged_in_flight(plan.schedule, plan.device_stages, plan.grad_accum, plan.virtual_stages)


def plan_strategies(workload: Workload, plan: Plan, cluster: ClusterSpec) -> StageStrategies:
    """One strategy row per (virtual) stage of ``plan`` (the runtime's view of the plan)."""
    S, G = plan.num_stages, plan.grad_accum
    n_dev = plan.dp * plan.cp * plan.tp
    per_node = min(int(cluster.devices_per_node), n_dev)
    nodes = max(math.ceil(n_dev / per_node), 1)
    st = plan.stages
    return StageStrategies.make(
        b=plan.micro_batch, dp=plan.dp, tp=plan.tp, cp=plan.cp, ulysses=int(plan.cp_form == ContextForm.ULYSSES),
        tp_overlap=int(plan.tp_overlap),
        shard_group=plan.shard_group, stages=S, G=G,
        nodes=nodes, per_node=per_node, zero=np.array([s.zero_stage for s in st]),
        layers=np.array([s.num_layers for s in st]),
        remat=np.array([s.remat_layers for s in st]),
        policy=np.array([workload.policy_index(s.remat_policy) if s.remat_layers else 0 for s in st]),
        wo=np.array([s.offload_weights for s in st]), go=np.array([s.offload_grads for s in st]),
        oo=np.array([s.offload_opt for s in st]), ao=np.array([s.offload_acts for s in st]),
        inflight=_inflight(plan), first=np.arange(S) == 0, last=np.arange(S) == S - 1,
        deferred=(charged_deferred(plan.schedule, plan.device_stages, G, plan.virtual_stages) if S > 1
                  else np.zeros(1, np.int64)))


def dispatched_ops(plan: Plan, update_rounds: int = 1) -> int:
    """Programs and transfers the host issues per step (docs/pipelines.md): one program for a single
    stage; for K virtual stages, ``(2K - 1) G`` pipeline programs, K finish programs, K update rounds,
    two batch splits and ``2 (K - 1) G`` activation / cotangent transfers. A zero-bubble schedule runs
    ``(3K - 2) G`` pipeline programs (every stage's W, every stage but the first's B)."""
    K, G = plan.num_stages, plan.grad_accum
    if K == 1:
        return 1
    pipeline = (3 * K - 2) * G if plan.schedule in ZERO_BUBBLE else (2 * K - 1) * G
    groups = np.asarray(plan.stage_groups)
    hops = int(np.sum(groups[1:] != groups[:-1]))  # a V's turn stays on its group: nothing is sent there
    return pipeline + K + K * update_rounds + 2 + 2 * hops * G


def op_costs(plan: Plan, c: StageCost) -> Mapping[str, OpCost]:
    """Seconds of each kind of pipeline operation per virtual stage (`core.pipeline_order.op_costs`; the
    weight-gradient part of a zero-bubble backward is `StageCost.wgrad`, the weight-gradient GEMMs)."""
    S = plan.num_stages
    return order_op_costs(plan.schedule, np.broadcast_to(np.asarray(c.fwd, np.float64), (S,)), c.bwd, c.wgrad)


def _pipeline_step(plan: Plan, c: StageCost, shared_compute: bool = False) -> float:
    """Makespan of the MPMD issue order with each stage's forward / backward seconds, every device group
    then running its once-per-step work (gradient sync, update) after its last operation.

    With ``shared_compute`` (`DeviceSpec.shared_compute`: the devices draw on one pool, and the stage times
    are those of every group busy at once) a group runs faster while others idle, so the step is the
    groups' total work spread over the pool, or the makespan at the speed of a group running alone
    (``groups`` times faster), whichever is longer."""
    groups = plan.device_stages
    issue = issue_order(plan.schedule, groups, plan.grad_accum, plan.virtual_stages)
    fwd, bwd = np.asarray(c.fwd, np.float64), np.asarray(c.bwd, np.float64)
    finish = group_finish_times(issue, groups, op_costs(plan, c), plan.schedule)
    group = np.asarray(plan.stage_groups)
    delta = np.bincount(group, weights=np.asarray(c.delta, np.float64), minlength=groups)
    makespan = float(np.max(finish + delta))
    if not shared_compute:
        return makespan
    work = np.bincount(group, weights=plan.grad_accum * (fwd + bwd), minlength=groups) + delta
    return max(float(np.sum(work)) / groups, makespan / groups)


def _devices_time(plan: Plan, c: StageCost, shared_compute: bool = False) -> float:
    """The devices' step time (host dispatch aside): one stage's micro-batches plus its once-per-step work, or
    the pipeline's `_pipeline_step`."""
    if plan.num_stages == 1:
        return float(plan.grad_accum * c.stable[0] + c.delta[0])
    return _pipeline_step(plan, c, shared_compute)


def bubble_fraction(plan: Plan, c: StageCost) -> float:
    """Idle share of the device groups over the pipeline's operations (once-per-step work left out):
    ``1 - mean busy / makespan`` of the executor's issue order."""
    groups = plan.device_stages
    issue = issue_order(plan.schedule, groups, plan.grad_accum, plan.virtual_stages)
    makespan = float(np.max(group_finish_times(issue, groups, op_costs(plan, c), plan.schedule)))
    S = plan.num_stages
    busy = np.bincount(np.asarray(plan.stage_groups), weights=plan.grad_accum * (np.broadcast_to(c.fwd, (S,))
                                                                         + np.broadcast_to(c.bwd, (S,))),
                       minlength=groups)
    return float(1.0 - np.mean(busy) / makespan) if makespan > 0 else 0.0


def _zero_bubble_note(plan: Plan, c: StageCost, shared: bool) -> str:
    """Why a zero-bubble schedule: its pipeline time and bubble against 1F1B's on the same stages (ZB-V: on
    each device group's chunks as one stage)."""
    one_plan, one_c = (_as_one_chunk(plan, c) if plan.schedule in V_SHAPED else (plan, c))
    one_plan = one_plan.replace(schedule="1f1b")
    zb, one = _pipeline_step(plan, c, shared), _pipeline_step(one_plan, one_c, shared)
    against = "with each group's chunks as one stage under 1F1B" if plan.schedule in V_SHAPED else "under 1F1B"
    return (f"{plan.schedule}: the weight-gradient passes fill the pipeline's bubbles: {zb:.4g} s against "
            f"{one:.4g} s {against} ({one / zb:.3f}x), bubble {bubble_fraction(one_plan, one_c):.1%} -> "
            f"{bubble_fraction(plan, c):.1%}; each deferred pass holds its stash (activation memory)")


def _as_one_chunk(plan: Plan, c: StageCost) -> tuple[Plan, StageCost]:
    """An interleaved plan's device groups as one stage each: each group's chunks' times summed (the plan
    keeps only the counts that scheduling reads)."""
    groups, S = plan.device_stages, plan.num_stages

    def merged(x: np.ndarray | float) -> np.ndarray:
        return np.bincount(np.asarray(plan.stage_groups), weights=np.broadcast_to(np.asarray(x, np.float64), (S,)),
                           minlength=groups)

    one = dataclasses.replace(c, fwd=merged(c.fwd), bwd=merged(c.bwd), wgrad=merged(c.wgrad), delta=merged(c.delta),
                              stable=merged(c.stable))
    return plan.replace(stages=plan.stages[:groups], virtual_stages=1,
                        schedule="1f1b" if plan.schedule in V_SHAPED else plan.schedule), one


def _interleave_note(plan: Plan, c: StageCost, shared: bool) -> str:
    """Why interleaved 1F1B: its pipeline time and bubble against each device group's chunks run as one stage
    (the same work, the groups' summed chunk times, under one-chunk 1F1B)."""
    one_plan, one = _as_one_chunk(plan, c)
    t, t1 = _pipeline_step(plan, c, shared), _pipeline_step(one_plan, one, shared)
    return (f"interleaved 1F1B ({plan.virtual_stages} chunks per device group): {t:.4g} s against {t1:.4g} s with "
            f"each group's chunks as one stage ({t1 / t:.3f}x), bubble {bubble_fraction(one_plan, one):.1%} -> "
            f"{bubble_fraction(plan, c):.1%}; each group holds more micro-batches' residuals and sends "
            f"{plan.virtual_stages}x the activations")


def _context_note(workload: Workload, plan: Plan, cluster: ClusterSpec, c: StageCost) -> str:
    """What context parallelism costs and why its form: the step under the other form where it applies
    (`_devices_time`), and the exchange's bytes per step."""
    shared = bool(cluster.device.shared_compute)
    step = _devices_time(plan, c, shared)
    moved = float(np.max(c.comm[CollectiveOp.ALL_TO_ALL]) + np.max(c.comm[CollectiveOp.COLLECTIVE_PERMUTE]))
    text = (f"context parallelism ({plan.cp_form}, cp {plan.cp}): {format_bytes(moved)} of attention exchange per "
            "step and device")
    for form in workload.context_forms(plan.cp, plan.tp):
        if form != plan.cp_form:
            other = plan.replace(cp_form=form, prediction=None)
            oc = stage_cost(workload, cluster, plan_strategies(workload, other, cluster))
            t = _devices_time(other, oc, shared)
            text += (f"; with cp_form {form} {t:.4g} s against {step:.4g} s ({t / step:.3f}x), peak "
                     f"{format_bytes(_device_peak(other, oc))} against {format_bytes(_device_peak(plan, c))}")
    return text


def _device_peak(plan: Plan, c: StageCost) -> float:
    """The largest device group's bytes (`_group_memory`: an interleaved group holds all its chunks)."""
    return max(sum(group.values()) for group in _group_memory(plan, c))


def _group_memory(plan: Plan, c: StageCost) -> list[dict[str, float]]:
    """Per device group: the state of every chunk it runs, the residuals (and zero-bubble stashes) its chunks
    hold at once along its operations (`core.pipeline_order.group_residual_peaks`), the largest chunk's
    transients."""
    S, groups = plan.num_stages, plan.device_stages
    mem = {k: np.broadcast_to(np.asarray(v, dtype=np.float64), (S,)) for k, v in c.memory.items()}
    placed = np.asarray(plan.stage_groups)
    out = []
    for g in range(groups):
        chunks = np.flatnonzero(placed == g)
        out.append({k: float(np.sum(mem[k][chunks]) if k in _PER_CHUNK else np.max(mem[k][chunks]))
                    for k in MEMORY_CATEGORIES})
    if plan.virtual_stages > 1:
        issue = issue_order(plan.schedule, groups, plan.grad_accum, plan.virtual_stages)
        stash = np.where(charged_deferred(plan.schedule, groups, plan.grad_accum, plan.virtual_stages) > 0,
                         np.broadcast_to(np.asarray(c.stash, np.float64), (S,)), 0.0)
        held = group_residual_peaks(issue, groups, np.broadcast_to(np.asarray(c.residual, np.float64), (S,)), stash,
                                    plan.schedule)
        for g in range(groups):
            out[g]["activations"] = float(held[g])
    return out


def analyze(workload: Workload, plan: Plan, cluster: ClusterSpec) -> Analysis:
    """Predict ``plan`` on ``cluster`` with per-stage time / memory breakdowns (see `Analysis`)."""
    st = plan_strategies(workload, plan, cluster)
    c: StageCost = stage_cost(workload, cluster, st)
    S, G = plan.num_stages, plan.grad_accum
    stage_memory = tuple(_group_memory(plan, c))
    dispatch = dispatched_ops(plan) * float(cluster.device.dispatch_seconds)
    # The host issues a pipeline's step while the devices run it: it costs time only where it is slower.
    step = _devices_time(plan, c, bool(cluster.device.shared_compute))
    step = step if S == 1 else max(step, dispatch)
    pooled = S > 1 and cluster.device.shared_compute
    notes: tuple[str, ...] = (
        ("the devices share one pool of compute (DeviceSpec.shared_compute): the pipeline is priced as its "
         "total work over the pool, not its lock-step makespan"),) if pooled else ()
    if S > 1 and plan.schedule in ZERO_BUBBLE:
        notes += (_zero_bubble_note(plan, c, bool(cluster.device.shared_compute)),)
    if plan.virtual_stages > 1 and plan.schedule not in V_SHAPED:
        notes += (_interleave_note(plan, c, bool(cluster.device.shared_compute)),)
    if plan.cp > 1:
        notes += (_context_note(workload, plan, cluster, c),)
    # Mist's formula prices one chunk per stage: an interleaved plan's groups as one stage each.
    groups_c = _as_one_chunk(plan, c)[1] if plan.virtual_stages > 1 else c
    mist = float(pipeline_time(groups_c.stable, groups_c.delta, G, "gpipe" if plan.schedule == "gpipe" else "1f1b"))
    tokens = plan.global_batch * workload.seq_len
    pred = Prediction(step_time=step, stage_stable=tuple(float(x) for x in c.stable),
                      stage_delta=tuple(float(x) for x in c.delta), stage_memory=stage_memory,
                      tokens_per_s=tokens / step if step > 0 else 0.0)
    coll = {k: float(np.max(v)) for k, v in c.comm.items()
            if k not in ("collective-permute", "all-to-all") or np.max(v) > 0}
    if S > 1:
        coll["send"] = 2.0 * G * float(workload.compiled(plan.micro_batch, workload.seq_len, plan.tp)[
            "block.output_bytes"])
    host_chunks = np.broadcast_to(np.asarray(c.host, np.float64), (S,))
    host = np.bincount(np.asarray(plan.stage_groups), weights=host_chunks, minlength=plan.device_stages)
    peak = np.array([sum(m.values()) for m in stage_memory])
    return Analysis(prediction=pred, step_time=step, mist_step_time=mist, stage_fwd=tuple(map(float, c.fwd)),
                    stage_bwd=tuple(map(float, c.bwd)),
                    stage_wgrad=tuple(map(float, np.broadcast_to(c.wgrad, (S,)))), stage_memory=stage_memory,
                    stage_host=tuple(map(float, host)), xla_cpu_peak=tuple(float(x) for x in peak + host),
                    collective_bytes=coll, flops=tuple(map(float, np.broadcast_to(c.flops, (S,)))),
                    flops_xla=tuple(map(float, np.broadcast_to(c.flops_xla, (S,)))), dispatch_time=dispatch,
                    notes=notes)


def predict(workload: Workload, plan: Plan, cluster: ClusterSpec) -> Prediction:
    """The `mistjax.plan.Prediction` of ``plan`` (step time, per-stage stable / delta, per-group memory)."""
    return analyze(workload, plan, cluster).prediction


__all__ = ["Analysis", "analyze", "bubble_fraction", "dispatched_ops", "op_costs", "plan_strategies", "predict"]
