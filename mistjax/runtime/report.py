"""What each plan knob really did to this step: bytes sharded, leaves offloaded, layers checkpointed.

`applied_report` reads the placed layouts (`mistjax.core.layout.LeafLayout`) and the step analysis, so
the report states facts of the placed state, not of the plan: a ZeRO-1 plan on a state whose optimizer
leaves mirror no parameter shards nothing, and says so. A knob the plan asks for that applies to
nothing warns (`NoOpWarning`), and so does a plan whose per-layer knobs need `mistjax.value_and_grad`
when the step differentiates with plain ``jax.value_and_grad`` (GSPMD then places the state as planned
but decides the collectives itself).

A pipelined plan gets one such report per stage (`pipeline_report`): each stage holds its own pieces under
its own one-stage plan (layers, ZeRO level, MiCS group, remat, offload ratios), so a knob can apply on one
stage and to nothing on another.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mistjax.core.execution import StageExecution, host_accumulators
from mistjax.core.layout import OPT, PARAM, LeafLayout, context_shards
from mistjax.core.plan import Plan, StagePlan, format_bytes


class NoOpWarning(UserWarning):
    """A plan knob applies to nothing in this step (or is left to GSPMD)."""


@dataclass(frozen=True)
class KnobReport:
    """One knob of the plan as applied."""

    knob: str  # the plan field(s), e.g. "shard_opt (ZeRO-1)"
    requested: bool  # the plan asks for it
    applied: bool  # it changed something in this step
    detail: str  # what it did, in numbers


@dataclass(frozen=True)
class AppliedReport:
    """What the placed step does, knob by knob."""

    knobs: tuple[KnobReport, ...]
    notes: tuple[str, ...] = ()  # warnings raised while placing (no-ops, GSPMD fallbacks)
    # How the step runs them (`core.execution`): a pipeline stage's from its setup, a one-stage step's once
    # the step is compiled (its loss is traced inside the step's program).
    execution: StageExecution | None = None
    # Bytes of placed state each device keeps in host memory: its share of the offloaded weights and optimizer
    # state, and of the gradient accumulators kept on host (activations offloaded per micro-batch not counted).
    host_bytes: float = 0.0

    def summary(self) -> str:
        return "\n".join(["Applied (placed state and step):", *self.lines("  ")])

    def lines(self, indent: str) -> list[str]:
        """The requested or applied knobs and the notes, one line each, indented by ``indent``."""
        out = []
        for k in self.knobs:
            if k.requested or k.applied:
                mark = "yes" if k.applied else "NO "
                out.append(f"{indent}[{mark}] {k.knob}: {k.detail}")
        if self.host_bytes > 0 or any(k.requested for k in self.knobs if k.knob.startswith("offload_")):
            out.append(f"{indent}host memory per device: {format_bytes(self.host_bytes)} of offloaded state "
                       "(weights, optimizer state, gradient accumulators; offloaded activations not counted)")
        if self.execution is not None:
            out += [f"{indent}execution: {line}" for line in self.execution.describe()]
        return out + [f"{indent}note: {n}" for n in self.notes]

    def __getitem__(self, knob: str) -> KnobReport:
        for k in self.knobs:
            if k.knob.split(" ")[0] == knob:
                return k
        raise KeyError(f"no knob {knob!r}; knobs: {', '.join(k.knob.split(' ')[0] for k in self.knobs)}")


def _bytes(lay: LeafLayout, itemsize: int) -> int:
    return lay.nbytes_elems * itemsize


def _per_device(lay: LeafLayout, itemsize: int, plan: Plan) -> float:
    n = float(_bytes(lay, itemsize))
    if lay.tensor_dims:
        n /= plan.tp
    if lay.sharded and lay.shard_dim is not None:
        n /= plan.shard_group * (plan.cp if lay.context_split else 1)
    if lay.stage_split:
        n /= plan.num_stages
    return n


_Pool = list[tuple[LeafLayout, int]]  # (layout, item size) of the leaves of one role


def _frac(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _total(pool: _Pool) -> int:
    return sum(_bytes(lay, s) for lay, s in pool)


def _partition_devices(plan: Plan) -> int:
    """Devices ZeRO splits the optimizer state over: the MiCS partition group (x cp under context parallelism)."""
    return plan.shard_group * context_shards(plan)


def _unsharded(what: str, plan: Plan) -> str:
    """Why a ZeRO knob shards nothing: its partition group is one device."""
    return (f"nothing sharded: the partition group is 1 device (dp {plan.dp}, MiCS group {plan.shard_group}"
            f"{f', cp {plan.cp}' if plan.cp > 1 else ''}), so every device holds the whole {what}")


def _sharding_knobs(params: _Pool, opts: _Pool, plan: Plan) -> list[KnobReport]:
    """ZeRO-1/2/3 (over the MiCS partition group) and tensor parallelism, as placed. A ZeRO flag the stage
    sets over a partition group of one device is requested and applies to nothing (`zero_noop_note`)."""
    stage = plan.stages[0]
    if _partition_devices(plan) == 1:
        return [KnobReport("shard_opt (ZeRO-1)", stage.shard_opt, False, _unsharded("optimizer state", plan)),
                KnobReport("shard_grads (ZeRO-2)", stage.shard_grads, False, _unsharded("gradients", plan)),
                KnobReport("shard_weights (ZeRO-3)", stage.shard_weights, False, _unsharded("parameters", plan)),
                *_sharding_knobs_split(params, opts, plan)[3:]]
    return _sharding_knobs_split(params, opts, plan)


def _sharding_knobs_split(params: _Pool, opts: _Pool, plan: Plan) -> list[KnobReport]:
    """`_sharding_knobs` over a partition group of several devices."""
    stage = plan.stages[0]
    p_total, o_total = _total(params), _total(opts)
    o_sh = [(lay, s) for lay, s in opts if lay.sharded]
    o_ctx = sum(lay.context_split for lay, _ in o_sh)
    o_dev = sum(_per_device(lay, s, plan) for lay, s in opts)
    ways = f"{plan.shard_group} ways" + (f" ({o_ctx} of them {plan.shard_group * plan.cp} ways: x cp over `context`)"
                                         if o_ctx else "")
    g_sh = [(lay, s) for lay, s in params if lay.shard_dim is not None]
    w_sh = [(lay, s) for lay, s in params if lay.sharded]
    p_dev = sum(_per_device(lay, s, plan) for lay, s in params)
    t_sp = [(lay, s) for lay, s in params if lay.tensor_dims]
    return [
        KnobReport("shard_opt (ZeRO-1)", stage.shard_opt and plan.shard_group * context_shards(plan) > 1, bool(o_sh),
                   f"{len(o_sh)} of {len(opts)} optimizer leaves sharded {ways} "
                   f"({_frac(_total(o_sh), o_total)} of {format_bytes(o_total)}); "
                   f"optimizer state per device {format_bytes(o_dev)}"),
        KnobReport("shard_grads (ZeRO-2)", stage.shard_grads and plan.shard_group > 1,
                   stage.shard_grads and bool(g_sh),
                   f"{len(g_sh)} of {len(params)} gradients reduce-scattered every micro-batch"),
        KnobReport("shard_weights (ZeRO-3)", stage.shard_weights and plan.shard_group > 1, bool(w_sh),
                   f"{len(w_sh)} of {len(params)} parameters stored sharded"
                   + (f" ({w_ctx} of them x cp over `context`)" if (w_ctx := sum(lay.context_split for lay, _ in w_sh))
                      else "")
                   + f" ({_frac(_total(w_sh), p_total)} of {format_bytes(p_total)}); "
                   f"parameters per device {format_bytes(p_dev)}"),
        KnobReport("tp (tensor parallel)", plan.tp > 1, plan.tp > 1 and bool(t_sp),
                   f"{len(t_sp)} of {len(params)} weights split {plan.tp} ways "
                   f"({_frac(_total(t_sp), p_total)} of the parameter bytes)"),
    ]


def _offload_knobs(params: _Pool, opts: _Pool, grads_host: _Pool, stage: StagePlan) -> list[KnobReport]:
    """Weights, gradient accumulators and optimizer state kept in host memory, as placed."""
    knobs = []
    for name, pool, what in (("offload_weights", params, "leaves"), ("offload_grads", params, "accumulators"),
                             ("offload_opt", opts, "leaves")):
        host = grads_host if name == "offload_grads" else [(lay, s) for lay, s in pool if lay.host]
        detail = (f"{len(host)} of {len(pool)} gradient {what}" if name == "offload_grads" else f"{len(host)} {what}")
        knobs.append(KnobReport(name, getattr(stage, name) > 0, bool(host),
                                f"{detail} in host memory ({format_bytes(_total(host))}, "
                                f"{_frac(_total(host), _total(pool))})"))
    return knobs


def _policy_names(policy: str) -> tuple[str, ...]:
    """The ``checkpoint_name`` tags a ``names:a,b`` remat policy saves (none for ``full`` / ``dots``)."""
    if not policy.startswith("names:"):
        return ()
    return tuple(n.strip() for n in policy[len("names:"):].split(",") if n.strip())


def remat_policy_knob(plan: Plan, remat: int, checkpoint_tags: Sequence[str]) -> KnobReport | None:
    """The ``names:a,b`` remat policy as applied (None unless a checkpointed stage names one): it applies when
    at least one of its names tags an activation of the layer; one that matches no tag saves nothing, and the
    checkpointed layers then recompute everything, as ``full`` does."""
    named = [n for s in plan.stages if s.remat_layers for n in _policy_names(s.remat_policy)]
    if not named or remat == 0:  # no layer checkpointed: remat_layers's own report says so
        return None
    unmatched = sorted({n for n in named if n not in checkpoint_tags})
    matched = sorted(set(named) - set(unmatched))
    tags = ", ".join(checkpoint_tags) if checkpoint_tags else "none"
    if matched:
        detail = f"saves the activations tagged {', '.join(matched)} in the {remat} checkpointed layer(s)"
        if unmatched:
            detail += f"; {', '.join(unmatched)} tag nothing (the layer's checkpoint_name tags: {tags})"
    else:
        detail = (f"{', '.join(unmatched)} match no checkpoint_name tag of the layer (its tags: {tags}), so the "
                  f"{remat} checkpointed layer(s) save nothing and recompute everything, as remat_policy 'full'; "
                  "tag the activations with jax.ad_checkpoint.checkpoint_name or use 'full' / 'dots'")
    return KnobReport("remat_policy", True, bool(matched), detail)


def _layer_knobs(plan: Plan, num_layers: int | None, uses_mistjax_grad: bool,
                 checkpoint_tags: Sequence[str]) -> tuple[KnobReport, KnobReport | None, KnobReport, KnobReport]:
    """Remat (and its named policy, if any), activation offload and micro-batching: what the layer loop and the
    accumulation run."""
    stage = plan.stages[0]
    remat = sum(s.remat_layers for s in plan.stages) if num_layers is not None and uses_mistjax_grad else 0
    acts = sum(s.offloaded_layers for s in plan.stages) if checkpoint_tags and uses_mistjax_grad else 0
    policy = remat_policy_knob(plan, remat, checkpoint_tags)
    acts_as = "; no name matches a tag: acts as full" if policy is not None and not policy.applied else ""
    return (
        KnobReport("remat_layers", any(s.remat_layers for s in plan.stages), remat > 0,
                   f"{remat} of {num_layers or 0} layers checkpointed ({stage.remat_policy}{acts_as})"),
        policy,
        KnobReport("offload_acts", any(s.offload_acts for s in plan.stages), acts > 0,
                   f"{acts} layers offload their activations tagged {', '.join(checkpoint_tags)}" if checkpoint_tags
                   else "the layer tags no activation with jax.ad_checkpoint.checkpoint_name, so none is offloaded "
                   "(tag the activations to offload)"),
        KnobReport("grad_accum", plan.grad_accum > 1, plan.grad_accum > 1 and uses_mistjax_grad,
                   f"{plan.grad_accum} micro-batch(es) of {plan.micro_batch} per step"))


def applied_report(layouts: Sequence[LeafLayout], itemsizes: Sequence[int], plan: Plan, *,
                   num_layers: int | None, uses_mistjax_grad: bool, checkpoint_tags: Sequence[str] = (),
                   grads_on_host: Sequence[bool] | None = None, warn: bool = True) -> AppliedReport:
    """The `AppliedReport` of a placed step (warning for each requested knob that applies to nothing).

    Args:
        layouts: the placed state's leaf layouts (a pipeline stage's: the pieces it holds).
        itemsizes: bytes per element of each leaf.
        plan: the one-stage plan the leaves were placed under.
        num_layers: layers the step (or stage) runs in its layer loop; None without a layer stack.
        uses_mistjax_grad: the step differentiates with `mistjax.value_and_grad` (else GSPMD decides).
        checkpoint_tags: the ``checkpoint_name`` tags of one layer (what activation offload moves).
        grads_on_host: per leaf, its gradient accumulator is kept in host memory (None: none is).
        warn: emit a `NoOpWarning` per note.
    """
    lays = list(zip(layouts, itemsizes))
    host_acc = grads_on_host if grads_on_host is not None else [False] * len(lays)
    params = [(lay, s) for lay, s in lays if lay.role == PARAM]
    opts = [(lay, s) for lay, s in lays if lay.role == OPT]
    grads_host = [(lay, s) for (lay, s), h in zip(lays, host_acc) if h and lay.role == PARAM]
    remat, policy, acts, accum = _layer_knobs(plan, num_layers, uses_mistjax_grad, checkpoint_tags)
    weights, grads, opt = _offload_knobs(params, opts, grads_host, plan.stages[0])
    knobs = [*_sharding_knobs(params, opts, plan), remat, *([policy] if policy is not None else []), weights, grads,
             opt, acts, accum]
    notes = _noop_notes(knobs, plan)
    if not uses_mistjax_grad:
        gspmd = [k.knob for k in knobs if k.requested and k.knob.split(" ")[0] in
                 ("shard_grads", "shard_weights", "tp", "offload_weights")]
        if gspmd:
            notes.append(f"the step differentiates with plain jax.value_and_grad, so {', '.join(gspmd)} "
                         "only place the state: GSPMD decides the collectives (no per-layer gathers, Megatron "
                         "block or weight streaming); use mistjax.value_and_grad (a drop-in) for the planned ones")
    if warn:
        for n in notes:
            warnings.warn(n, NoOpWarning, stacklevel=4)
    host = [(lay, s) for lay, s in lays if lay.host] + grads_host
    return AppliedReport(tuple(knobs), tuple(notes), host_bytes=sum(_per_device(lay, s, plan) for lay, s in host))


_ZERO_KNOBS = ("shard_opt", "shard_grads", "shard_weights")


def _noop_notes(knobs: Sequence[KnobReport], plan: Plan) -> list[str]:
    """One note per requested knob that applies to nothing; the ZeRO flags over a partition group of one
    device as one note for the stage's ZeRO level (ZeRO-1 alone there is no note: it is `StagePlan`'s default
    and what the tuner records for dp 1, and the report's ``[NO ]`` line says it shards nothing)."""
    stage = plan.stages[0]
    zero_noop = _partition_devices(plan) == 1 and stage.zero_stage > 0
    notes = [f"{k.knob} applies to nothing in this step: {k.detail}" for k in knobs
             if k.requested and not k.applied and not (zero_noop and k.knob.split(" ")[0] in _ZERO_KNOBS)]
    if zero_noop and stage.zero_stage > 1:
        flags = ", ".join(k for k in _ZERO_KNOBS[:stage.zero_stage][::-1])
        notes.insert(0, f"ZeRO-{stage.zero_stage} ({flags}) applies to nothing in this step: "
                        f"{_unsharded('state', plan)}; set them False, or use dp > 1 to shard")
    if plan.tp_overlap and (plan.tp == 1 or plan.cp > 1):  # `core.execution.collective_matmul_runs`
        why = "tp is 1" if plan.tp == 1 else "the rings need the sequence split over tensor alone, not context too"
        notes.append(f"tp_overlap applies to nothing in this step: {why}; set it False")
    remat = next((k for k in knobs if k.knob == "remat_policy" and k.applied), None)
    if remat is not None and "tag nothing" in remat.detail:
        notes.append(f"remat_policy: {remat.detail}")
    return notes


def grad_accumulators_on_host(layouts: Sequence[LeafLayout], plan: Plan, uses_mistjax_grad: bool) -> list[bool]:
    """Per leaf of a one-program step: its gradient accumulator lives in host memory between micro-batches.

    `core.execution.host_accumulators` (the rule `runtime.grads.sharded_value_and_grad` runs) with several
    micro-batches; with one micro-batch there is no accumulator to keep anywhere.
    """
    out = [False] * len(layouts)
    if plan.grad_accum <= 1 or not uses_mistjax_grad:
        return out
    idx = [i for i, lay in enumerate(layouts) if lay.role == PARAM]
    for i, h in zip(idx, host_accumulators([layouts[i] for i in idx], plan.stages[0].offload_grads)):
        out[i] = h
    return out


@dataclass(frozen=True)
class StageReport:
    """What one pipeline stage's knobs did to the pieces it holds and to its programs."""

    stage: int  # the (virtual) stage index
    layers: tuple[int, int]  # [start, end) of the model's layer stack this stage runs
    group: int  # the device group it runs on (stage % device stages)
    devices: int  # devices in that group
    plan: Plan  # its one-stage plan (layers counted from 0; dp, MiCS group, tp of the whole plan)
    applied: AppliedReport  # its knobs, as `applied_report` gives them for the stage's pieces

    def header(self) -> str:
        """The stage's knobs as planned: layers, ZeRO level and partition group, remat, offload ratios."""
        sp, plan = self.plan.stages[0], self.plan
        group = f"MiCS group {plan.shard_group} of dp {plan.dp}" if plan.shard_group != plan.dp else f"dp {plan.dp}"
        zero = f"ZeRO-{sp.zero_stage} over {group}" if sp.zero_stage else f"ZeRO-0 (replicated over dp {plan.dp})"
        if sp.zero_stage and _partition_devices(plan) == 1:
            zero = f"ZeRO-{sp.zero_stage} asked, nothing sharded (partition group of 1 device)"
        return (f"stage {self.stage}: layers {self.layers[0]}-{self.layers[1]} on device group {self.group} "
                f"({self.devices} devices); {zero}; remat {sp.remat_layers} of "
                f"{sp.num_layers} layers ({sp.remat_policy}); offload weights {sp.offload_weights:g}, grads "
                f"{sp.offload_grads:g}, optimizer {sp.offload_opt:g}, activations {sp.offload_acts:g}")


@dataclass(frozen=True)
class PipelineReport:
    """What a pipelined plan does, stage by stage (`report[k]` is stage ``k``'s `StageReport`)."""

    stages: tuple[StageReport, ...]

    @property
    def host_bytes(self) -> float:
        """The most host memory a device of any stage keeps (`AppliedReport.host_bytes`)."""
        return max((r.applied.host_bytes for r in self.stages), default=0.0)

    @property
    def notes(self) -> tuple[str, ...]:
        """Every stage's notes (no-op knobs), each naming its stage."""
        return tuple(f"stage {r.stage}: {n}" for r in self.stages for n in r.applied.notes)

    def summary(self) -> str:
        lines = [f"Applied per stage ({len(self.stages)} stages; placed pieces and stage programs):"]
        for r in self.stages:
            lines += [f"  {r.header()}", *r.applied.lines("    ")]
        return "\n".join(lines)

    def __getitem__(self, stage: int) -> StageReport:
        return self.stages[stage]


def pipeline_report(stages: Sequence[StageReport], warn: bool = True) -> PipelineReport:
    """The `PipelineReport` of a placed pipeline (a `NoOpWarning` for each knob that applies to nothing on a
    stage; give the stages' `AppliedReport` built with ``warn=False``)."""
    report = PipelineReport(tuple(stages))
    if warn:
        for n in report.notes:
            warnings.warn(n, NoOpWarning, stacklevel=6)  # the user's place() or first call
    return report


def itemsizes(leaves: Sequence[object]) -> list[int]:
    return [int(np.dtype(getattr(x, "dtype", np.float32)).itemsize) for x in leaves]


__all__ = ["AppliedReport", "KnobReport", "NoOpWarning", "PipelineReport", "StageReport", "applied_report",
           "grad_accumulators_on_host", "itemsizes", "pipeline_report"]
