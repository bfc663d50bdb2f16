"""`predict` / `analyze`: the cost model's view of one whole `Plan`, stage by stage, priced as the
runtime's executor runs it (docs/internals.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mistjax.core.pipeline_time import lockstep_time, pipeline_time
from mistjax.core.plan import Plan, Prediction
from mistjax.core.schedules import inflight_microbatches, make_schedule
from mistjax.core.strategies import StageStrategies
from mistjax.cost.model import MEMORY_CATEGORIES, StageCost, stage_cost
from mistjax.cost.workload import Workload


@dataclass(frozen=True)
class Analysis:
    """A plan's prediction with its breakdowns (per device; per stage where stages differ)."""

    prediction: Prediction  # what `predict` returns
    step_time: float  # seconds per step (lock-step runtime)
    mist_step_time: float  # Mist's 1F1B / GPipe formula on the same stage times, for comparison
    stage_fwd: tuple[float, ...]  # per stage: forward seconds of one micro-batch
    stage_bwd: tuple[float, ...]  # per stage: backward seconds of one micro-batch
    stage_memory: tuple[dict[str, float], ...]  # per stage: device bytes by category
    stage_host: tuple[float, ...]  # per stage: host bytes per device (offloaded state and activations)
    xla_cpu_peak: tuple[float, ...]  # per stage: device + host bytes, what XLA:CPU's memory analysis counts
    collective_bytes: dict[str, float]  # per step, per device, result bytes by collective kind (max over stages)
    flops: tuple[float, ...]  # per stage: FLOPs per device per step
    flops_xla: tuple[float, ...]  # per stage: FLOPs as XLA's cost_analysis counts them (loop bodies once)
    notes: tuple[str, ...] = field(default=())  # what is approximated for this plan

    @property
    def peak_memory(self) -> float:
        return self.prediction.peak_memory

    def summary(self) -> str:
        """A short human-readable table."""
        lines = [f"step {self.step_time:.4g} s (Mist formula {self.mist_step_time:.4g} s), "
                 f"peak {self.peak_memory / 2**20:.1f} MiB/device"]
        for i, m in enumerate(self.stage_memory):
            cats = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in m.items())
            lines.append(f"  stage {i}: fwd {self.stage_fwd[i]:.3g} s bwd {self.stage_bwd[i]:.3g} s; MiB: {cats}")
        lines.append("  collectives/step: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in
                                                         self.collective_bytes.items()))
        return "\n".join(lines)


def plan_strategies(workload: Workload, plan: Plan, cluster: Any) -> StageStrategies:
    """One strategy row per stage of ``plan`` (the runtime's view of the plan)."""
    S, G = plan.num_stages, plan.grad_accum
    n_dev = plan.dp * plan.tp
    per_node = min(int(cluster.devices_per_node), n_dev)
    nodes = max(math.ceil(n_dev / per_node), 1)
    rows: dict[str, list[Any]] = {k: [] for k in ("zero", "layers", "remat", "policy", "wo", "go", "oo", "ao",
                                                  "inflight", "first", "last")}
    for i, s in enumerate(plan.stages):
        rows["zero"].append(s.zero_stage)
        rows["layers"].append(s.num_layers)
        rows["remat"].append(s.remat_layers)
        rows["policy"].append(workload.policy_index(s.remat_policy) if s.remat_layers else 0)
        rows["wo"].append(s.offload_weights)
        rows["go"].append(s.offload_grads)
        rows["oo"].append(s.offload_opt)
        rows["ao"].append(s.offload_acts)
        rows["inflight"].append(1 if S == 1 else int(inflight_microbatches(i, S, G, plan.schedule)))
        rows["first"].append(i == 0)
        rows["last"].append(i == S - 1)
    return StageStrategies.make(b=plan.micro_batch, dp=plan.dp, tp=plan.tp, shard_group=plan.shard_group,
                                stages=S, G=G, nodes=nodes, per_node=per_node,
                                **{k: np.asarray(v) for k, v in rows.items()})


def _lockstep(plan: Plan, fwd: np.ndarray, bwd: np.ndarray) -> float:
    return lockstep_time(make_schedule(plan.schedule, plan.num_stages, plan.grad_accum), fwd, bwd)


def analyze(workload: Workload, plan: Plan, cluster: Any) -> Analysis:
    """Predict ``plan`` on ``cluster`` with per-stage time / memory breakdowns (see `Analysis`)."""
    st = plan_strategies(workload, plan, cluster)
    c: StageCost = stage_cost(workload, cluster, st)
    S, G = plan.num_stages, plan.grad_accum
    mem = {k: np.asarray(v, dtype=np.float64).copy() for k, v in c.memory.items()}
    notes = []
    if S > 1:  # SPMD pools: every device holds the largest stage's residual pools
        mem["activations"][:] = mem["activations"].max()
        notes.append("pipeline: activation pools sized to the largest stage on every device")
    peak = sum(mem[k] for k in MEMORY_CATEGORIES)
    if S == 1:
        step = float(G * c.stable[0] + c.delta[0])
    else:
        step = _lockstep(plan, c.fwd, c.bwd) + float(np.max(c.delta))
    mist = float(pipeline_time(c.stable, c.delta, G, plan.schedule))
    stage_memory = tuple({k: float(mem[k][i]) for k in MEMORY_CATEGORIES} for i in range(S))
    tokens = plan.global_batch * workload.seq_len
    pred = Prediction(step_time=step, stage_stable=tuple(float(x) for x in c.stable),
                      stage_delta=tuple(float(x) for x in c.delta), stage_memory=stage_memory,
                      tokens_per_s=tokens / step if step > 0 else 0.0)
    coll = {k: float(np.max(v)) for k, v in c.comm.items()}
    flops_xla = np.broadcast_to(c.flops_xla, (S,)).astype(np.float64)
    if S > 1:
        ticks = make_schedule(plan.schedule, S, G).num_ticks
        coll["collective-permute"] = 2.0 * ticks * float(workload.compiled(
            plan.micro_batch, workload.seq_len, plan.tp)["block.output_bytes"])
        body = flops_xla - np.broadcast_to(c.flops_xla_step, (S,))
        kinds = {plan.stage_kind(i): float(body[i]) for i in range(S)}
        flops_xla = np.full(S, sum(kinds.values()) + float(np.max(c.flops_xla_step)))
    host = np.broadcast_to(c.host, (S,)).astype(np.float64)
    if S > 1:  # offloaded activations sit in host pools, also sized to the largest stage
        acts = np.broadcast_to(c.host_acts, (S,))
        host = host - acts + acts.max()
    return Analysis(prediction=pred, step_time=step, mist_step_time=mist, stage_fwd=tuple(map(float, c.fwd)),
                    stage_bwd=tuple(map(float, c.bwd)), stage_memory=stage_memory,
                    stage_host=tuple(map(float, host)), xla_cpu_peak=tuple(float(x) for x in peak + host),
                    collective_bytes=coll, flops=tuple(map(float, np.broadcast_to(c.flops, (S,)))),
                    flops_xla=tuple(map(float, flops_xla)), notes=tuple(notes))


def predict(workload: Workload, plan: Plan, cluster: Any) -> Prediction:
    """The `mistjax.plan.Prediction` of ``plan`` (step time, per-stage stable / delta / memory)."""
    return analyze(workload, plan, cluster).prediction


__all__ = ["Analysis", "analyze", "plan_strategies", "predict"]
