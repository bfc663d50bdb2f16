"""The pipeline's build step: `build_pipeline` turns a train step and a plan into a frozen `PipelineProgram`.

It traces the step abstractly (`mpmd_update.trace_step`: the gradient call left opaque), traces the loss at one
device's micro-batch, places every state leaf on the stages (`pipeline_leaves`), builds each stage's programs
(`mpmd_stage`, `mpmd_split` for a zero-bubble schedule's split backwards) and update rounds (`pipeline_rounds`),
and lowers the plan to its `ExecutionPlan` (per stage `StageExecution`, the platform, and the host's issue order of
the stage programs). Nothing here runs a program: `runtime.pipeline_exec.Executor` runs the program's issue order,
one handler per `OpKind`. A new schedule is its order (`core.pipeline_order.issue_order`) plus those handlers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np
from jax.extend.core import Var

from mistjax.core.axes import AxisRules
from mistjax.core.execution import ExecutionPlan, host_accumulators, is_batch_leaf
from mistjax.core.jaxpr import Atom, shaped
from mistjax.core.pipeline_order import Op, OpKind, issue_order
from mistjax.core.plan import Plan, PlanError, params_fingerprint
from mistjax.core.types import Batch, PyTree, State, TrainStep
from mistjax.runtime.grads import layer_block, mesh_capabilities
from mistjax.runtime.leaves import tensor_split_axes
from mistjax.runtime.mpmd_split import SplitPrograms
from mistjax.runtime.mpmd_stage import LossInfo, StagePrograms, StageSpec
from mistjax.runtime.mpmd_update import Layout, Propagation, StageRows, TracedStep, state_names, trace_step
from mistjax.runtime.pipeline_leaves import (
    LeafContext,
    StageGrid,
    StageLeaves,
    layer_stages,
    leaf_roles,
    param_layouts,
    place_leaves,
    tensor_layouts,
)
from mistjax.runtime.pipeline_rounds import (
    Round,
    RoundBuilder,
    TwinRoute,
    contrib_aval,
    metric_combine,
    metric_sources,
)
from mistjax.runtime.report import PipelineReport, StageReport, applied_report, pipeline_report
from mistjax.trace.split import NoLayerStackError, TracedLoss, checkpoint_names, pre_part, real_usage, trace_loss


@dataclass(frozen=True)
class PipelineProgram:
    """Everything a pipelined step runs, built once by `build_pipeline` (see module docstring).

    Attributes:
      plan: the plan.
      leaves: the stages (`StageGrid`) and where every state leaf's pieces live.
      ts: the traced step (state, batch) -> (new state, metrics).
      info: the loss as every stage reads it.
      rest_vars: the loss's arguments besides the parameters (the step jaxpr's atoms).
      fingerprint: the parameters' fingerprint the plan was checked against.
      prop: where every value of the update lives (`mpmd_update.Propagation`).
      rows: each stage's layer rows.
      programs: per stage, its forward / backward / last / finish / split programs.
      split_programs: per stage running a zero-bubble schedule's split backward, its B and W programs.
      rounds: per (stage, round), the update program.
      prologue: per stage reading the batch, the program computing loss arguments from the inputs (or None).
      metric_combine: per metric, whether its parts are combined on the device groups after the last round.
      twin_routes: per round, the contributions sent after it.
      execution: the `ExecutionPlan`, with the issue order the executor walks.
      applied: what each stage's knobs did (`runtime.report`).
    """

    plan: Plan
    leaves: StageLeaves
    ts: TracedStep
    info: LossInfo
    rest_vars: tuple[Atom, ...]
    fingerprint: str
    prop: Propagation
    rows: StageRows
    programs: tuple[StagePrograms, ...]
    split_programs: Mapping[int, SplitPrograms]
    rounds: Mapping[tuple[int, int], Round]
    prologue: Mapping[int, Round | None]
    metric_combine: tuple[bool, ...]
    twin_routes: Mapping[int, list[TwinRoute]]
    execution: ExecutionPlan
    applied: PipelineReport

    @property
    def grid(self) -> StageGrid:
        """The stages and their sub-meshes."""
        return self.leaves.grid

    @property
    def K(self) -> int:
        """(Virtual) stages."""
        return self.leaves.grid.K

    @property
    def issue(self) -> tuple[Op, ...]:
        """The stage programs in host issue order."""
        return self.execution.issue

    def contrib_aval(self, v: Var, lay: Layout, source: int, at: int) -> jax.ShapeDtypeStruct:
        """A contribution of `source` to materialised value `v`, as received on stage `at` (replicated)."""
        return contrib_aval(self.leaves, self.rows, v, lay, source, at)

    def metric_sources(self, v: Atom) -> list[int]:
        """The stages (or device groups) computing metric value `v`."""
        return metric_sources(self.prop, self.grid.S, v)

    def uses_batch(self, k: int) -> bool:
        """Stage `k` reads the loss's other arguments."""
        return self.programs[k].spec.uses_batch


class _MicrobatchLoss(NamedTuple):
    """The step's loss traced at one device's micro-batch (`_microbatch_loss`)."""

    traced: TracedLoss
    args: tuple[PyTree, ...]  # its arguments: parameters, then the rest at the micro-batch
    p_avals: list[jax.ShapeDtypeStruct]  # per parameter leaf (global shapes)
    mb_avals: tuple[jax.ShapeDtypeStruct, ...]  # per rest leaf: one device's micro-batch (non-batch: whole)
    is_batch: tuple[bool, ...]  # per rest leaf: batch data (`core.execution.is_batch_leaf`)
    rest_vars: tuple[Atom, ...]  # the step jaxpr's atoms of the rest leaves


def _check_pipelinable(traced: TracedLoss) -> None:
    """Raise a `PlanError` naming the fix when the loss's layers cannot be split into stages."""
    if traced.stack is None:
        raise PlanError("the plan pipelines the model, but its loss has no scan over stacked layer parameters; "
                        "build the layers with nnx.scan / nn.scan / lax.scan over stacked params, or use a plan "
                        "with one stage")
    stack = traced.stack
    if any(i is None for i in stack.xs_leaf):
        raise NoLayerStackError("the layer scan iterates over values that are not parameters; a pipeline can "
                                "only split scans over stacked parameters")
    if len(traced.closed.jaxpr.eqns[stack.eqn_index].outvars) > stack.num_carry:
        raise NoLayerStackError("the layer scan returns per-layer outputs besides its carry, which a pipeline "
                                "cannot pass between stages; return only the hidden state from the scan")


def _microbatch_loss(plan: Plan, ts: TracedStep) -> _MicrobatchLoss:
    """The step's loss traced at one device's micro-batch, checked to be pipelinable."""
    call = ts.call
    n_params = call.num_params
    p_avals = [jax.ShapeDtypeStruct(shaped(v).shape, shaped(v).dtype) for v in ts.vg.invars[:n_params]]
    rest_vars = tuple(ts.vg.invars[n_params:])
    is_batch = tuple(is_batch_leaf(shaped(v).shape, plan.global_batch) for v in rest_vars)
    if not any(is_batch):
        raise PlanError(f"no argument of the loss has the global batch ({plan.global_batch}) as its leading "
                        "dim; a pipelined plan splits the batch into micro-batches")
    mb_avals = tuple(jax.ShapeDtypeStruct((plan.micro_batch, *shaped(v).shape[1:]) if b else shaped(v).shape,
                                          shaped(v).dtype) for v, b in zip(rest_vars, is_batch))
    args = jax.tree.unflatten(call.args_tree, [*p_avals, *mb_avals])
    traced = trace_loss(call.fun, args[0], *args[1:])
    _check_pipelinable(traced)
    plan.check_layers(traced.require_stack().num_layers)
    return _MicrobatchLoss(traced, args, p_avals, mb_avals, is_batch, rest_vars)


def _loss_info(plan: Plan, ts: TracedStep, loss: _MicrobatchLoss) -> LossInfo:
    """The loss as every stage reads it (its activation and aux avals), without the layer block."""
    traced, call = loss.traced, ts.call
    usage = real_usage(traced)
    consts, carry = jax.eval_shape(lambda p, r: pre_part(traced, p, r), loss.p_avals, list(loss.mb_avals))
    h_avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in
                    [*(consts[j] for j, dep in enumerate(usage.const_needs_params) if dep), *carry])
    aux_avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in traced.closed.out_avals[1:]) \
        if call.has_aux else ()
    return LossInfo(fun=call.fun, has_aux=call.has_aux, traced=traced, usage=usage, is_batch=loss.is_batch,
                    mb_avals=loss.mb_avals, h_avals=h_avals, aux_avals=aux_avals, grad_accum=plan.grad_accum,
                    dp=plan.dp, tp=plan.tp, cp=plan.cp)


def _stage_programs(plan: Plan, leaves: StageLeaves, info: LossInfo, k: int) -> StagePrograms:
    """Stage `k`'s programs over the parameters it holds."""
    held_params = [j for j, i in enumerate(leaves.param_index) if i in leaves.layouts[k]]
    lays = [leaves.layouts[k][leaves.param_index[j]] for j in held_params]
    sp = plan.stages[k]
    acc_host = host_accumulators(lays, sp.offload_grads)
    K = leaves.grid.K
    # The first stage (pre part), the last (post part), and any stage recomputing batch-only consts.
    uses_batch = k == 0 or k == K - 1 or bool(info.bconst_positions)
    spec = StageSpec(index=k, num_stages=K, layers=sp.layers, plan=leaves.one_stage_plans[k],
                     mesh=leaves.grid.meshes[k], params=tuple(held_params), layouts=tuple(lays),
                     acc_host=tuple(acc_host), uses_batch=uses_batch)
    # An unrolled stack's stage runs its own layers' leaves (`TracedLoss.for_layers`).
    return StagePrograms(spec, dataclasses.replace(info, traced=info.traced.for_layers(*sp.layers)))


def _applied_report(plan: Plan, leaves: StageLeaves, programs: Sequence[StagePrograms],
                    tags: tuple[str, ...]) -> PipelineReport:
    """What each stage's knobs did to the pieces it holds and to its programs (`runtime.report`), warning for a
    knob that applies to nothing on a stage."""
    param_of = {i: j for j, i in enumerate(leaves.param_index)}
    stages = []
    for k, pr in enumerate(programs):
        held, one = leaves.held[k], leaves.one_stage_plans[k]
        acc_host = dict(zip(pr.spec.params, pr.spec.acc_host))
        applied = applied_report([leaves.layouts[k][i] for i in held],
                                 [np.dtype(leaves.state_avals[i].dtype).itemsize for i in held], one,
                                 num_layers=one.stages[0].num_layers, uses_mistjax_grad=True,
                                 checkpoint_tags=tags, warn=False,
                                 grads_on_host=[acc_host.get(param_of.get(i, -1), False) for i in held])
        applied = dataclasses.replace(applied, execution=pr.execution)
        stages.append(StageReport(k, plan.stages[k].layers, leaves.grid.group[k], leaves.grid.meshes[k].size, one,
                                  applied))
    return pipeline_report(stages)


def _trace(train_step: TrainStep, plan: Plan, grid: StageGrid, abstract_state: State, abstract_batch: Batch,
           axis_rules: AxisRules | None) -> tuple[TracedStep, _MicrobatchLoss, LossInfo, StageLeaves, Propagation,
                                                   str]:
    """The traced step and loss, the update's propagation and every state leaf's placement."""
    ts = trace_step(train_step, abstract_state, abstract_batch)
    call = ts.call
    s_leaves, state_tree = jax.tree.flatten(abstract_state)
    param_index = tuple(ts.param_state_index())
    loss = _microbatch_loss(plan, ts)
    traced, stack = loss.traced, loss.traced.require_stack()
    fingerprint = params_fingerprint(loss.args[0])
    plan.check_model(fingerprint)
    info = _loss_info(plan, ts, loss)
    # A scanned stack's leaves are split by rows; an unrolled stack's per-layer leaves go whole to their stage.
    stacked = set() if traced.groups is not None else set(stack.stacked_leaves)
    roles = leaf_roles(traced, abstract_state, loss.args[0], axis_rules, s_leaves, param_index, stacked)
    # Key / value heads the tensor degree does not divide are replicated, on every stage alike.
    axes = tuple(tensor_split_axes(list(roles.axes), [np.shape(x) for x in s_leaves], plan.tp))
    p_layouts = param_layouts(call.num_params, stacked, info.usage, grid.K, layer_stages(plan, traced))
    names = state_names(abstract_state)
    batch_names = ["batch" + (n and "/" + n) for n in state_names(abstract_batch)]
    prop = Propagation(ts, num_stages=grid.K, param_layouts=p_layouts, names=names, batch_names=batch_names,
                       num_layers=stack.num_layers)
    ctx = LeafContext(grid, state_tree, tuple(s_leaves), param_index, axes,
                      roles if traced.groups is not None else None)
    leaves = place_leaves(ctx, plan, prop, names)
    tp_layouts = tensor_layouts(plan, loss.p_avals, stacked, [axes[i] for i in param_index])
    info.tp_block = layer_block(call.fun, traced, tp_layouts, plan, loss.is_batch)
    return ts, loss, info, leaves, prop, fingerprint


def build_pipeline(train_step: TrainStep, plan: Plan, abstract_state: State, abstract_batch: Batch, *,
                   grid: StageGrid, axis_rules: AxisRules | None = None) -> PipelineProgram:
    """Trace ``train_step`` and build every program of ``plan``'s pipeline (see module docstring).

    Args:
      train_step: the user's ``(state, batch) -> (state, metrics)``.
      plan: a plan with several stages.
      abstract_state: the state's leaves as ``jax.ShapeDtypeStruct`` (global shapes).
      abstract_batch: the batch's leaves likewise.
      grid: the plan's stages on their sub-meshes (`StageGrid.of`).
      axis_rules: renames of the model's logical axis names.
    """
    ts, loss, info, leaves, prop, fingerprint = _trace(train_step, plan, grid, abstract_state, abstract_batch,
                                                       axis_rules)
    K = grid.K
    issue = issue_order(plan.schedule, grid.S, plan.grad_accum, plan.virtual_stages)
    rows = StageRows(tuple(s.layers[0] for s in plan.stages), tuple(s.layers[1] for s in plan.stages))
    programs = tuple(_stage_programs(plan, leaves, info, k) for k in range(K))
    split_programs = {op.stage: SplitPrograms(programs[op.stage]) for op in issue if op.kind is OpKind.W}
    builder = RoundBuilder(ts, prop, leaves, programs, plan, rows, loss.rest_vars)
    rounds = {(k, r): builder.round(k, r) for k in range(K) for r in range(1, prop.num_rounds + 1)}
    prologue = {k: builder.prologue(k) for k in range(K) if programs[k].spec.uses_batch}
    execution = ExecutionPlan(tuple(pr.execution for pr in programs),
                              mesh_capabilities(grid.meshes[0], plan.tp_overlap), info.is_batch, tuple(issue))
    applied = _applied_report(plan, leaves, programs, checkpoint_names(loss.traced.require_stack().body))
    return PipelineProgram(plan, leaves, ts, info, loss.rest_vars, fingerprint, prop, rows, programs,
                           split_programs, rounds, prologue, metric_combine(ts, prop), builder.twin_routes(rounds),
                           execution, applied)


__all__ = ["PipelineProgram", "build_pipeline"]
