"""What each plan knob really did to this step: bytes sharded, leaves offloaded, layers checkpointed.

`applied_report` reads the placed layouts (`mistjax.core.layout.LeafLayout`) and the step analysis, so
the report states facts of the placed state, not of the plan: a ZeRO-1 plan on a state whose optimizer
leaves mirror no parameter shards nothing, and says so. A knob the plan asks for that applies to
nothing warns (`NoOpWarning`), and so does a plan whose per-layer knobs need `mistjax.value_and_grad`
when the step differentiates with plain ``jax.value_and_grad`` (GSPMD then places the state as planned
but decides the collectives itself).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mistjax.core.layout import OPT, PARAM, LeafLayout
from mistjax.core.plan import Plan, format_bytes


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

    def summary(self) -> str:
        lines = ["Applied (placed state and step):"]
        for k in self.knobs:
            if k.requested or k.applied:
                mark = "yes" if k.applied else "NO "
                lines.append(f"  [{mark}] {k.knob}: {k.detail}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

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
        n /= plan.shard_group
    if lay.stage_split:
        n /= plan.num_stages
    return n


def applied_report(layouts: Sequence[LeafLayout], itemsizes: Sequence[int], plan: Plan, *,
                   num_layers: int | None, uses_mistjax_grad: bool, checkpoint_tags: Sequence[str] = (),
                   warn: bool = True) -> AppliedReport:
    """The `AppliedReport` of a placed step (warning for each requested knob that applies to nothing)."""
    stage = plan.stages[0]
    lays = list(zip(layouts, itemsizes))
    params = [(lay, s) for lay, s in lays if lay.role == PARAM]
    opts = [(lay, s) for lay, s in lays if lay.role == OPT]
    p_total = sum(_bytes(lay, s) for lay, s in params)
    o_total = sum(_bytes(lay, s) for lay, s in opts)
    knobs: list[KnobReport] = []
    notes: list[str] = []

    def frac(part: float, whole: float) -> str:
        return f"{100 * part / whole:.0f}%" if whole else "-"

    o_sh = [(lay, s) for lay, s in opts if lay.sharded]
    o_dev = sum(_per_device(lay, s, plan) for lay, s in opts)
    knobs.append(KnobReport(
        "shard_opt (ZeRO-1)", stage.shard_opt and plan.shard_group > 1, bool(o_sh),
        f"{len(o_sh)} of {len(opts)} optimizer leaves sharded {plan.shard_group} ways "
        f"({frac(sum(_bytes(lay, s) for lay, s in o_sh), o_total)} of {format_bytes(o_total)}); "
        f"optimizer state per device {format_bytes(o_dev)}"))
    g_sh = [(lay, s) for lay, s in params if lay.shard_dim is not None]
    knobs.append(KnobReport(
        "shard_grads (ZeRO-2)", stage.shard_grads and plan.shard_group > 1, stage.shard_grads and bool(g_sh),
        f"{len(g_sh)} of {len(params)} gradients reduce-scattered every micro-batch"))
    w_sh = [(lay, s) for lay, s in params if lay.sharded]
    p_dev = sum(_per_device(lay, s, plan) for lay, s in params)
    knobs.append(KnobReport(
        "shard_weights (ZeRO-3)", stage.shard_weights and plan.shard_group > 1, bool(w_sh),
        f"{len(w_sh)} of {len(params)} parameters stored sharded "
        f"({frac(sum(_bytes(lay, s) for lay, s in w_sh), p_total)} of {format_bytes(p_total)}); "
        f"parameters per device {format_bytes(p_dev)}"))
    t_sp = [(lay, s) for lay, s in params if lay.tensor_dims]
    knobs.append(KnobReport(
        "tp (tensor parallel)", plan.tp > 1, plan.tp > 1 and bool(t_sp),
        f"{len(t_sp)} of {len(params)} weights split {plan.tp} ways "
        f"({frac(sum(_bytes(lay, s) for lay, s in t_sp), p_total)} of the parameter bytes)"))
    remat = sum(s.remat_layers for s in plan.stages) if num_layers is not None and uses_mistjax_grad else 0
    knobs.append(KnobReport(
        "remat_layers", any(s.remat_layers for s in plan.stages), remat > 0,
        f"{remat} of {num_layers or 0} layers checkpointed ({stage.remat_policy})"))
    for name, role, pool in (("offload_weights", PARAM, params), ("offload_opt", OPT, opts)):
        host = [(lay, s) for lay, s in pool if lay.host]
        total = p_total if role == PARAM else o_total
        knobs.append(KnobReport(
            name, getattr(stage, name) > 0, bool(host),
            f"{len(host)} leaves in host memory ({format_bytes(sum(_bytes(lay, s) for lay, s in host))}, "
            f"{frac(sum(_bytes(lay, s) for lay, s in host), total)})"))
    acts = sum(s.offloaded_layers for s in plan.stages) if checkpoint_tags and uses_mistjax_grad else 0
    knobs.append(KnobReport(
        "offload_acts", any(s.offload_acts for s in plan.stages), acts > 0,
        f"{acts} layers offload their activations tagged {', '.join(checkpoint_tags)}" if checkpoint_tags else
        "the layer tags no activation with jax.ad_checkpoint.checkpoint_name, so none is offloaded (tag the "
        "activations to offload)"))
    knobs.append(KnobReport("grad_accum", plan.grad_accum > 1, plan.grad_accum > 1 and uses_mistjax_grad,
                            f"{plan.grad_accum} micro-batch(es) of {plan.micro_batch} per step"))
    for k in knobs:
        if k.requested and not k.applied:
            notes.append(f"{k.knob} applies to nothing in this step: {k.detail}")
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
    return AppliedReport(tuple(knobs), tuple(notes))


def itemsizes(leaves: Sequence[object]) -> list[int]:
    return [int(np.dtype(getattr(x, "dtype", np.float32)).itemsize) for x in leaves]


__all__ = ["AppliedReport", "KnobReport", "NoOpWarning", "applied_report", "itemsizes"]
