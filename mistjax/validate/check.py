"""Check the cost model against XLA's compiled programs (tests and scripts/bench_costmodel.py): per cell,
memory, FLOPs and collective bytes predicted next to what XLA:CPU compiled. What is compared with
what: docs/internals.md.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NotRequired, TypeAlias, TypedDict

from mistjax.core import hlo
from mistjax.core.execution import collective_matmul_runs
from mistjax.core.plan import Plan, uniform_plan
from mistjax.core.schedules import V_SHAPED
from mistjax.core.types import Batch, State, TrainStep
from mistjax.cost.predict import analyze
from mistjax.cost.workload import Workload
from mistjax.hardware.presets import ClusterSpec

if TYPE_CHECKING:
    import jax

    from mistjax.train.state import TrainState
    from models.config import ModelConfig

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
TP_FORMS = ("xla-cpu", "gspmd", "megatron")
# One predicted tensor-parallel collective: (kind, full-buffer bytes x count, summands).
TPRecord = tuple[str, float, int]
# `uniform_plan` keyword arguments of a grid entry (stage fields, micro_batch, tp, stages, ...).
PlanKwargs: TypeAlias = dict[str, bool | int | float | str]
# (model preset, sequence length, global batch, `PlanKwargs`): one cell of the grids below.
GridCell: TypeAlias = tuple[str, int, int, PlanKwargs]
# A grid cell's model: a zoo preset name, or a zoo `ModelConfig` (tests/test_awkward_shapes.py's shapes).
ModelName: TypeAlias = "str | ModelConfig"


class CellMeasurement(TypedDict):
    """What XLA:CPU compiled for one cell, per device (`measure_cell`)."""

    mem: float  # peak bytes (the largest device group's for a pipeline)
    flops: float  # FLOPs + transcendentals (NaN for a pipeline)
    coll: dict[str, int] | None  # executed collective result bytes by kind (None for a pipeline)
    mem_per_stage: NotRequired[list[float]]  # a pipeline's peak per device group


class CellComparison(TypedDict):
    """Predicted vs compiled memory, FLOPs and collective bytes of one cell (`compare_cell`)."""

    model: str
    seq: int
    global_batch: int
    plan: str  # a short description of the plan
    mem_pred: float
    mem_xla: float
    mem_err: float  # mem_pred / mem_xla - 1
    flops_pred: float
    flops_xla: float
    flops_err: float
    coll_pred: dict[str, float]  # by kind (`KINDS`), tensor-parallel ones included
    coll_xla: dict[str, float]
    coll_err: float  # sum of |pred - xla| over kinds / total xla bytes (NaN for a pipeline)
    coll_tp_pred: dict[str, float]  # the tensor-parallel part of coll_pred (`tp_collective_bytes`)
    step_time_pred: float


def tp_records(workload: Workload, part: str, policy: str, b: int, s: int, t: int) -> list[TPRecord]:
    """The tensor-parallel collectives of one pass (forward + backward) of ``part`` under ``policy``.

    From the analysed graphs when the profile carries them (they hold each reduction's summands, also
    for the recomputing policies); else from the profile's expressions: ``tp_collectives`` (policy
    ``none``) plus ``tp_recompute[policy]`` per kind, the recomputed collectives counted as single
    summands.
    """
    prof = workload.profile_for(t)  # the kv heads' regime at t (split or replicated)
    passes = prof.passes or {}
    if part in passes and policy in passes[part]:
        return [(c.kind, float(c.nbytes.exact(b, s, t) * c.count.exact(b, s, t)), c.summands)
                for ps in passes[part][policy] for c in ps.res.collectives]
    symbols = prof.symbols
    subs = dict(zip(symbols, (b, s, t)))
    part_prof = prof.parts[part]
    out = [(c.kind, float((c.nbytes * c.count).subs(subs)), c.summands) for c in part_prof.tp_collectives]
    if policy != "none":
        out += [(k, float(sp_expr.subs(subs)), 1) for k, sp_expr in part_prof.tp_recompute.get(policy, {}).items()]
    return out


def _form_bytes(records: list[TPRecord], t: int, form: str) -> dict[str, float]:
    """Per-kind result bytes of ``records`` as ``form`` counts them (see the module docstring)."""
    out: dict[str, float] = {}
    for kind, nbytes, m in records:
        if kind == "reduce-scatter":
            if form == "xla-cpu":
                kind, nbytes = "all-reduce", nbytes * m
            else:
                nbytes = nbytes * (m if form == "gspmd" else 1) / t
        out[kind] = out.get(kind, 0.0) + nbytes
    return out


def ring_records(records: list[TPRecord], t: int) -> list[TPRecord]:
    """``records`` of a layer as collective matmuls run them (`core.execution.Capabilities.collective_matmul`):
    each all-gather and reduce-scatter (one per partial sum) of ``nbytes`` becomes ``t - 1`` ring transfers of
    ``nbytes / t``, a collective-permute result of ``(t - 1) / t`` of it; all-reduces stay. Every one is
    counted as a ring, as the cost model prices them (`cost.tp_rings`); a layer whose partial sum of several
    matmuls keeps its reduce-scatter (a parallel block) would show it as such instead."""
    ringed = ("all-gather", "reduce-scatter")
    return [("collective-permute", n * (t - 1) / t, 1) if k in ringed else (k, n, m) for k, n, m in records]


def tp_collective_bytes(workload: Workload, plan: Plan, form: str = "xla-cpu", rings: bool = False
                        ) -> dict[str, float]:
    """Predicted tensor-parallel collective result bytes per step and device, by kind.

    Per micro-batch, each plain layer runs the block's forward and backward (policy ``none``), each
    checkpointed layer its policy's forward, recompute and backward, the first stage the pre part and
    the last stage the post part; times the ``grad_accum`` micro-batches. The maximum over stages
    (as `Analysis.collective_bytes`). ``form``: ``xla-cpu`` (reduce-scatters as GSPMD's all-reduces,
    one per summand), ``gspmd`` (one reduce-scatter per summand) or ``megatron`` (the cost model's
    count: one reduce-scatter per partial sum). ``rings``: the layers run collective matmuls
    (`ring_records`).
    """
    if form not in TP_FORMS:
        raise ValueError(f"form must be one of {TP_FORMS}, got {form!r}")
    t = plan.tp
    if t <= 1:
        return {}
    b, s = plan.micro_batch, workload.seq_len // plan.cp  # each device's part of a sequence
    best: dict[str, float] = {}
    for i, st in enumerate(plan.stages):
        c = min(st.remat_layers, st.num_layers)
        recs = [(k, n * (st.num_layers - c), m) for k, n, m in tp_records(workload, "block", "none", b, s, t)]
        if c:
            recs += [(k, n * c, m) for k, n, m in tp_records(workload, "block", st.remat_policy, b, s, t)]
        if rings:
            recs = ring_records(recs, t)
        if i == 0:
            recs += tp_records(workload, "pre", "none", b, s, t)
        if i == len(plan.stages) - 1:
            recs += tp_records(workload, "post", "none", b, s, t)
        per_step = {k: v * plan.grad_accum for k, v in _form_bytes(recs, t, form).items()}
        if sum(per_step.values()) > sum(best.values()):
            best = per_step
    return best


@functools.cache
def grid_config(name: ModelName) -> ModelConfig:
    """The zoo config of a grid cell (a preset name or a config): one slice of the fused LM head. XLA's cost
    analysis counts a loop body once, and a one-trip loop is removed, so the compiled program's FLOPs compare
    one to one (the memory of slicing is checked in tests/test_models.py)."""
    import models

    config = models.get_config(name) if isinstance(name, str) else name
    return config.replace(loss_chunks=1)


def _setup(name: ModelName, seq: int, global_batch: int
           ) -> tuple[TrainState, dict[str, jax.ShapeDtypeStruct], TrainStep]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import mistjax
    import models
    from mistjax.train.state import TrainState

    cfg = grid_config(name)
    state = nnx.eval_shape(lambda: TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3)))
    loss_fn = models.make_loss_fn(state.graphdef)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        loss, grads = mistjax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    tok = jax.ShapeDtypeStruct((global_batch, seq), jnp.int32)
    return state, {"inputs": tok, "targets": tok}, train_step


def measure_cell(name: ModelName, seq: int, global_batch: int, plan: Plan) -> CellMeasurement:
    """Compile the runtime's train step for ``plan`` and read memory, FLOPs and collectives."""
    import jax

    import mistjax

    state, batch, step = _setup(name, seq, global_batch)
    if plan.num_stages > 1:
        return _measure_pipelined(step, state, batch, plan)
    compiled = mistjax.autoshard(step, jax.devices(), plan=plan).lower(state, batch).compile()
    ca = compiled.cost_analysis()
    return {"mem": hlo.memory_stats(compiled)["peak"],
            "flops": float(ca["flops"]) + float(ca.get("transcendentals", 0.0)),
            "coll": hlo.collective_bytes(compiled.as_text(), executed=True)}


def _measure_pipelined(step: TrainStep, state: State, batch: Batch, plan: Plan) -> CellMeasurement:
    """A pipelined plan's programs, compiled per (stage, phase) on this machine's devices: each device
    group's peak as the executor holds its buffers (`mistjax.validate.gpu_aot_pipeline.stage_reports`).
    FLOPs and collectives are not compared for pipelines (NaN): they are spread over many programs."""
    import jax

    from mistjax.runtime.step import ShardedStep
    from mistjax.validate.gpu_aot import group_peaks
    from mistjax.validate.gpu_aot_pipeline import PipelineAotReport, stage_reports

    sharded = ShardedStep(step, jax.devices(), plan)
    stages = stage_reports(sharded._mpmd, sharded.compile_stages(state, batch))
    report = PipelineAotReport("local", jax.devices()[0].device_kind, jax.device_count(), stages, 0.0, 0.0)
    peaks = group_peaks(report, plan.device_stages)
    return {"mem": max(peaks), "mem_per_stage": list(peaks), "flops": float("nan"), "coll": None}


@functools.cache
def workload_for(name: ModelName, seq: int, global_batch: int) -> Workload:
    """The (cached) AdamW workload of a model preset (or config)."""
    import models

    # Uncached: the collective checks read the analysed graphs (summands of recomputed reductions).
    return models.workload(grid_config(name), seq, global_batch, cache=False)


def compare_cell(name: ModelName, seq: int, global_batch: int, plan: Plan, cluster: ClusterSpec,
                 measured: CellMeasurement | None = None) -> CellComparison:
    """One record: predicted vs compiled memory, FLOPs and collective bytes, with relative errors."""
    wl = workload_for(name, seq, global_batch)
    a = analyze(wl, plan, cluster)
    m = measured or measure_cell(name, seq, global_batch, plan)
    mem_pred = max(a.xla_cpu_peak)
    flops_pred = max(a.flops_xla)
    rings = bool(collective_matmul_runs(plan.tp_overlap, plan.cp))  # the rings are there where the plan runs them
    tp_coll = tp_collective_bytes(wl, plan, "xla-cpu", rings=rings)
    pred_coll = {k: float(a.collective_bytes.get(k, 0.0)) + tp_coll.get(k, 0.0) for k in KINDS}
    if m["coll"] is None:  # a pipeline: its collectives are spread over its programs (not compared)
        xla_coll, coll_err = {k: float("nan") for k in KINDS}, float("nan")
    else:
        xla_coll = {k: float(m["coll"].get(k, 0)) for k in KINDS}
        coll_err = sum(abs(pred_coll[k] - xla_coll[k]) for k in KINDS) / max(sum(xla_coll.values()), 1.0)
    return {"model": grid_config(name).name, "seq": seq, "global_batch": global_batch, "plan": _describe(plan),
            "mem_pred": mem_pred, "mem_xla": float(m["mem"]), "mem_err": mem_pred / m["mem"] - 1.0,
            "flops_pred": flops_pred, "flops_xla": m["flops"], "flops_err": flops_pred / m["flops"] - 1.0,
            "coll_pred": pred_coll, "coll_xla": xla_coll, "coll_err": coll_err, "coll_tp_pred": tp_coll,
            "step_time_pred": a.step_time}


def _describe(plan: Plan) -> str:
    s = plan.stages[0]
    parts = [f"S{plan.num_stages}" if plan.num_stages > 1 else "", f"dp{plan.dp}",
             f"tp{plan.tp}" if plan.tp > 1 else "",
             f"p{plan.shard_group}" if plan.shard_group != plan.dp else "", f"z{s.zero_stage}", f"b{plan.micro_batch}",
             f"G{plan.grad_accum}" if plan.grad_accum > 1 else "",
             f"remat{s.remat_layers}:{s.remat_policy}" if s.remat_layers else ""]
    parts += [f"{n[8]}o{getattr(s, n):g}" for n in ("offload_weights", "offload_grads", "offload_opt", "offload_acts")
              if getattr(s, n)]
    return " ".join(p for p in parts if p)


Z0, Z1 = dict(shard_opt=False), dict(shard_opt=True)
Z2, Z3 = dict(shard_opt=True, shard_grads=True), dict(shard_opt=True, shard_grads=True, shard_weights=True)

# (model, seq, global batch, uniform_plan kwargs). 8 devices.
SMALL_GRID: tuple[GridCell, ...] = (
    ("llama-tiny", 16, 16, dict(micro_batch=2, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, **Z1)),
    ("gpt3-tiny", 16, 16, dict(micro_batch=2, **Z3)),
    ("falcon-tiny", 16, 32, dict(micro_batch=2, grad_accum=2, **Z2)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, shard_group=2, **Z3)),
    ("gpt3-tiny", 32, 16, dict(micro_batch=2, remat_layers=2, remat_policy="dots", **Z0)),
)
FULL_GRID: tuple[GridCell, ...] = SMALL_GRID + (
    ("llama-tiny", 32, 16, dict(micro_batch=2, **Z0)),
    ("llama-tiny", 16, 32, dict(micro_batch=4, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, **Z2)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, **Z3)),
    ("llama-tiny", 16, 32, dict(micro_batch=2, grad_accum=2, **Z0)),
    ("llama-tiny", 16, 32, dict(micro_batch=2, grad_accum=2, **Z1)),
    ("llama-tiny", 16, 32, dict(micro_batch=2, grad_accum=2, **Z3)),
    ("llama-tiny", 16, 16, dict(micro_batch=4, tp=2, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, remat_layers=4, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, remat_layers=4, **Z3)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, offload_opt=1.0, **Z1)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, offload_weights=0.5, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, offload_acts=0.5, **Z0)),
    ("llama-tiny", 16, 32, dict(micro_batch=2, grad_accum=2, offload_grads=1.0, **Z0)),
    ("gpt3-tiny", 16, 16, dict(micro_batch=2, **Z0)),
    ("gpt3-tiny", 16, 32, dict(micro_batch=4, tp=2, grad_accum=2, **Z1)),
    ("gpt3-tiny", 64, 16, dict(micro_batch=2, remat_layers=2, **Z2)),
    ("falcon-tiny", 16, 16, dict(micro_batch=2, **Z0)),
    ("falcon-tiny", 32, 16, dict(micro_batch=2, shard_group=4, **Z2)),
    ("falcon-tiny", 16, 16, dict(micro_batch=4, tp=2, remat_layers=2, remat_policy="names:qkv_proj", **Z3)),
    ("gpt3-small", 32, 16, dict(micro_batch=2, **Z0)),
    ("gpt3-small", 32, 16, dict(micro_batch=2, **Z3)),
    ("llama-small", 32, 16, dict(micro_batch=4, tp=2, **Z1)),
    ("llama-small", 32, 32, dict(micro_batch=2, grad_accum=2, shard_group=4, **Z3)),
    ("falcon-small", 64, 16, dict(micro_batch=2, remat_layers=4, **Z1)),
    ("falcon-small", 32, 16, dict(micro_batch=2, **Z2)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, stages=2, grad_accum=2, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=1, stages=2, grad_accum=4, **Z1)),
    ("llama-tiny", 16, 8, dict(micro_batch=1, stages=4, grad_accum=4, **Z0)),
    ("falcon-tiny", 16, 16, dict(micro_batch=2, stages=2, grad_accum=2, remat_layers=1, schedule="gpipe", **Z1)),
    ("llama-tiny", 16, 16, dict(micro_batch=1, stages=4, grad_accum=8, schedule="1f1b-eager", **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=1, stages=2, grad_accum=4, schedule="zb-h1", **Z1)),
    ("llama-tiny", 16, 16, dict(micro_batch=1, stages=4, grad_accum=8, remat_layers=1, schedule="zb-h1", **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=1, stages=2, grad_accum=4, chunks=2, **Z1)),
    ("gpt3-tiny", 16, 16, dict(micro_batch=1, stages=2, grad_accum=4, chunks=2, remat_layers=2, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=1, stages=2, grad_accum=4, schedule="zb-v", **Z1)),
    ("gpt3-tiny", 16, 32, dict(micro_batch=1, stages=2, grad_accum=8, remat_layers=2, schedule="zb-v", **Z0)),
)


def grid_plan(name: ModelName, kwargs: PlanKwargs, devices: int = 8) -> Plan:
    """The uniform plan of a grid entry (``chunks``: `Plan.interleaved` into that many chunks per group; schedule
    ``zb-v``: `Plan.v_shaped`). An entry that does not say ``shard_opt`` shards the optimizer state (ZeRO-1), as
    every grid cell was measured (`uniform_plan` itself no longer does unasked)."""
    kw = {"shard_opt": True, **dict(kwargs)}
    chunks = int(kw.pop("chunks", 1))
    if kw.get("schedule") in V_SHAPED:
        return uniform_plan(grid_config(name).num_layers, devices, **{**kw, "schedule": "1f1b"}).v_shaped()
    plan = uniform_plan(grid_config(name).num_layers, devices, **kw)
    return plan.interleaved(chunks) if chunks > 1 else plan


__all__ = ["FULL_GRID", "KINDS", "SMALL_GRID", "TP_FORMS", "CellComparison", "CellMeasurement", "GridCell",
           "PlanKwargs", "compare_cell", "grid_plan", "measure_cell", "ring_records", "tp_collective_bytes",
           "tp_records", "workload_for"]
