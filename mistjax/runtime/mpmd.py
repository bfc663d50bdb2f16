"""The MPMD pipeline executor: one program per (stage, phase) on each stage's own devices.

A plan with several stages runs here (`ShardedStep` delegates to `MpmdStep`). Each (virtual) stage
``k`` has its own sub-mesh (device group ``k % S`` of the plan mesh), its own one-stage plan (layer
count, ZeRO level, MiCS group, remat, offload ratios) and its own programs (`mpmd_stage`): forward
and backward per micro-batch (fused on the last stage), ``finish`` (the stage's gradient sync), and
the update rounds the step splits into (`mpmd_update`). Nothing is compiled for the largest stage:
every stage allocates only what its own programs need.

The host drives one step as a single sequence of operations (`core.pipeline_order.issue_order`): each
device group runs its queue in that order, and JAX's asynchronous dispatch lets the groups overlap.
Activations and cotangents move between stages with ``jax.device_put`` to the receiver's sharding
(the sender's program already produced that layout); accumulators and optimizer state are donated,
received buffers never are. In a multi-process run every process walks the same sequence, runs the
programs of the stages it holds devices of, and takes part in the transfers it sends or receives
(JAX's cross-host transfers; `configure_cross_host_transfers`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex
from jax.extend.core import Var
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core.axes import Axes, AxisRules, apply_axis_rules, leaf_axes
from mistjax.core.execution import ExecutionPlan, host_accumulators, is_batch_leaf
from mistjax.core.jaxpr import Atom, Value, shaped
from mistjax.core.layout import DP_AXES, OPT, OTHER, PARAM, LeafLayout, LeafRole, plan_layouts
from mistjax.core.pipeline_order import Op, OpKind, issue_order
from mistjax.core.plan import Plan, PlanError, params_fingerprint
from mistjax.core.types import Batch, Metrics, PyTree, State, TrainStep
from mistjax.runtime import xla_flags
from mistjax.runtime.grads import layer_block, mesh_capabilities, regather_updated_params
from mistjax.runtime.leaves import LeafRoles, path_tokens, state_layouts, state_roles, tensor_split_axes
from mistjax.runtime.mesh import RUNTIME_MESH_AXES, SHARD_AXES, batch_shardings, batch_spec, build_plan_mesh
from mistjax.runtime.mpmd_split import SplitPrograms
from mistjax.runtime.mpmd_stage import LossInfo, Program, StagePrograms, StageSpec
from mistjax.runtime.mpmd_state import StagedArray, StagedInfo, gather_state, is_staged
from mistjax.runtime.mpmd_update import (
    EnvKey,
    InputGroup,
    Layout,
    Output,
    Propagation,
    Rows,
    Sink,
    Source,
    StageRows,
    Target,
    TracedStep,
    Whole,
    combine,
    contributors,
    stage_eval,
    state_names,
    trace_step,
    twin_key,
)
from mistjax.runtime.report import PipelineReport, StageReport, applied_report, pipeline_report
from mistjax.trace.split import (
    NoLayerStackError,
    PartUsage,
    TracedLoss,
    checkpoint_names,
    pre_part,
    real_usage,
    trace_loss,
)


@dataclass
class DispatchStats:
    """What the host did in the last step (for the cost model and `scripts/bench_mpmd.py`)."""

    programs: int = 0  # jitted programs dispatched
    transfers: int = 0  # jax.device_put calls (one may move several arrays)
    host_s: float = 0.0  # host seconds spent issuing the step (the devices may still be running)
    by_kind: dict[str, int] = field(default_factory=dict)  # programs per phase
    residuals_in_flight: list[int] = field(default_factory=list)  # per stage: most micro-batches' residuals held
    residual_bytes: list[int] = field(default_factory=list)  # per stage: those residuals' bytes per device

    @property
    def ops(self) -> int:
        return self.programs + self.transfers


Held: TypeAlias = jax.Array | None
"""An array of a stage, or None on a process that does not run that stage (its programs' outputs exist only on
the processes holding the stage's devices)."""


@dataclass
class _Queues:
    """What one step's operations hand each other (keyed by (stage, micro-batch))."""

    live: list[int]  # per stage: micro-batches whose residuals it holds
    # Arrays are None on a process that does not run the stage holding them (`Held`).
    h_recv: dict[tuple[int, int], list[Held]] = field(default_factory=dict)  # activations received
    ct_recv: dict[tuple[int, int], list[Held]] = field(default_factory=dict)  # cotangents received
    res: dict[tuple[int, int], PyTree] = field(default_factory=dict)  # residuals of forwards
    wres: dict[tuple[int, int], tuple[PyTree, ...]] = field(default_factory=dict)  # what a W reads


@dataclass
class _Round:
    """One update program of one stage (see `mpmd_update`)."""

    groups: list[InputGroup]  # the input groups it reads, in argument order
    outputs: list[Output]  # what each output is
    program: Program
    sizes: list[int]  # arrays per input group
    avals: list[jax.ShapeDtypeStruct]  # one aval per input array (abstract lowering)


def _slicer(value: np.ndarray) -> Callable[[Any], np.ndarray]:
    """``jax.make_array_from_callback``'s callback: each device's block of a host array."""
    return lambda idx: value[idx]


def _here(x: Held) -> jax.Array:
    """``x`` on a process that runs its stage, where it is never None."""
    assert x is not None, "an array of a stage this process runs"
    return x


def _lowered(program: Callable[[], Program], *avals: PyTree) -> jax.stages.Lowered:
    """``program().lower(*avals)``: the program is built when its lowering is asked for."""
    return program().lower(*avals)


def configure_cross_host_transfers(address: str) -> None:
    """Enable JAX's cross-process ``device_put`` (needed on CPU for pipelines spanning processes).

    Args:
      address: ``host:port`` this process listens on for transfers; one per process.
    """
    jax.config.update("jax_cross_host_transfer_socket_address", address)


Pieces = list[dict[int, Held]]  # per state leaf: its piece on each (virtual) stage holding it
GroupBatches = list[list[jax.Array]]  # per device group: the batch leaves placed on it
Twins = dict[tuple[int, Var], list[Held]]  # (stage, materialised var) -> the contributions it received


class TwinRoute(NamedTuple):
    """The contributions to a value materialised in one update round, sent to a stage that reads it later."""

    stage: int  # the receiving (virtual) stage
    var: Var  # the materialised value (the step jaxpr's variable)
    sources: tuple[int, ...]  # the contributing stages, in `combine` order
    avals: tuple[jax.ShapeDtypeStruct, ...]  # per source: the contribution as received


class _MicrobatchLoss(NamedTuple):
    """The step's loss traced at one device's micro-batch (`MpmdStep._microbatch_loss`)."""

    traced: TracedLoss
    args: tuple[PyTree, ...]  # its arguments: parameters, then the rest at the micro-batch
    p_avals: list[jax.ShapeDtypeStruct]  # per parameter leaf (global shapes)
    mb_avals: tuple[jax.ShapeDtypeStruct, ...]  # per rest leaf: one device's micro-batch (non-batch: whole)
    is_batch: tuple[bool, ...]  # per rest leaf: batch data (`core.execution.is_batch_leaf`)


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


def _param_layouts(num_params: int, stacked: set[int], usage: PartUsage, num_stages: int,
                   layer_stage: dict[int, int]) -> list[Rows | Whole]:
    """Which stages hold each parameter: stacked ones by rows, an unrolled stack's layer leaves on the stage of
    their layer (`layer_stage`); the pre part's on the first stage, the post part's on the last (both for a
    tied embedding); unused ones on the first."""
    out: list[Rows | Whole] = []
    for j in range(num_params):
        if j in stacked:
            out.append(Rows(0))
            continue
        if j in layer_stage:
            out.append(Whole(frozenset({layer_stage[j]})))
            continue
        holders = set()
        if j in usage.pre or j not in usage.post:
            holders.add(0)
        if j in usage.post:
            holders.add(num_stages - 1)
        out.append(Whole(frozenset(holders)))
    return out


class MpmdStep:
    """A train step run as an MPMD pipeline (see module docstring); used through `ShardedStep`."""

    def __init__(self, train_step: TrainStep, mesh: Mesh | Sequence[jax.Device] | None, plan: Plan,
                 axis_rules: AxisRules | None = None) -> None:
        if plan.num_stages < 2:
            raise PlanError("the MPMD executor runs plans with several stages")
        self.train_step, self.plan, self.axis_rules = train_step, plan, axis_rules
        self.mesh = build_plan_mesh(mesh, plan)
        self.S, self.K = plan.device_stages, plan.num_stages
        self.group_meshes = [Mesh(self.mesh.devices[d: d + 1], RUNTIME_MESH_AXES, axis_types=self.mesh.axis_types)
                             for d in range(self.S)]
        self.group: tuple[int, ...] = plan.stage_groups  # the device group of each (virtual) stage
        self.meshes = [self.group_meshes[self.group[k]] for k in range(self.K)]
        me = jax.process_index()
        # Compile-only devices (deviceless XLA:GPU compiles of a multi-host topology) belong to no running
        # process: this process lowers and compiles every stage's programs.
        compile_only = not set(self.mesh.devices.flat) & set(jax.devices())
        self.local = [compile_only or any(d.process_index == me for d in m.devices.flat) for m in self.meshes]
        self.issue: list[Op] = issue_order(plan.schedule, self.S, plan.grad_accum, plan.virtual_stages)
        self.rows = StageRows(tuple(s.layers[0] for s in plan.stages), tuple(s.layers[1] for s in plan.stages))
        self.stats = DispatchStats()
        self._avals: dict[tuple[Var, int, int], jax.ShapeDtypeStruct] = {}
        self._replicated = [NamedSharding(m, P()) for m in self.meshes]
        self.applied: PipelineReport | None = None  # what each stage's knobs did, once set up
        self.execution: ExecutionPlan | None = None  # how the plan runs (`core.execution`), once set up
        # Per stage: device bytes of one micro-batch's residuals under the shardings XLA gave the forward's
        # outputs (`_note_residuals`), once a forward program was compiled for it or ran.
        self._residual_device_bytes: dict[int, int] = {}
        self._ready = False

    # ================================================================== setup
    def _abstract_state(self, state: State) -> State:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x)), np.dtype(x.dtype)), state,
                            is_leaf=is_staged)

    def _setup(self, state: State, batch: Batch) -> None:
        plan = self.plan
        abstract = self._abstract_state(state)
        abatch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.dtype(x.dtype)), batch)
        ts = trace_step(self.train_step, abstract, abatch)
        self.ts, call = ts, ts.call
        s_leaves, self.state_tree = jax.tree.flatten(abstract)
        self.state_avals = s_leaves
        self.param_index = ts.param_state_index()
        loss = self._microbatch_loss(ts)
        traced, stack = loss.traced, loss.traced.require_stack()
        self.fingerprint = params_fingerprint(loss.args[0])
        plan.check_model(self.fingerprint)
        usage = real_usage(traced)
        consts, carry = jax.eval_shape(lambda p, r: pre_part(traced, p, r), loss.p_avals, list(loss.mb_avals))
        h_avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in
                        [*(consts[j] for j, dep in enumerate(usage.const_needs_params) if dep), *carry])
        aux_avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in traced.closed.out_avals[1:]) \
            if call.has_aux else ()
        # A scanned stack's leaves are split by rows; an unrolled stack's per-layer leaves go whole to their stage.
        self.stacked = set() if traced.groups is not None else set(stack.stacked_leaves)
        roles = self._leaf_roles(traced, abstract, loss.args[0])
        # Key / value heads the tensor degree does not divide are replicated, on every stage alike.
        self.axes = tensor_split_axes(list(roles.axes), [np.shape(x) for x in s_leaves], plan.tp)
        self.leaf_roles = roles if traced.groups is not None else None
        param_layouts = _param_layouts(call.num_params, self.stacked, usage, self.K, self._layer_stages(traced))
        names = state_names(abstract)
        batch_names = ["batch" + (n and "/" + n) for n in state_names(abatch)]
        self.prop = Propagation(ts, num_stages=self.K, param_layouts=param_layouts, names=names,
                                batch_names=batch_names, num_layers=stack.num_layers)
        self._place_leaves(names)
        tp_layouts = self._tensor_layouts(loss.p_avals, self.stacked, [self.axes[i] for i in self.param_index])
        info = LossInfo(fun=call.fun, has_aux=call.has_aux, traced=traced, usage=usage, is_batch=loss.is_batch,
                        mb_avals=loss.mb_avals, h_avals=h_avals, aux_avals=aux_avals, grad_accum=plan.grad_accum,
                        dp=plan.dp, tp=plan.tp, cp=plan.cp)
        info.tp_block = layer_block(call.fun, traced, tp_layouts, plan, loss.is_batch)
        self.info = info
        self._build_programs(checkpoint_names(stack.body))

    def _layer_stages(self, traced: TracedLoss) -> dict[int, int]:
        """Real parameter index -> the (virtual) stage holding its layer, for an unrolled stack's leaves."""
        if traced.groups is None:
            return {}
        stage_of = [k for k, sp in enumerate(self.plan.stages) for _ in range(*sp.layers)]
        return {r: stage_of[layer] for r, (_, layer) in traced.groups.members().items()}

    def _microbatch_loss(self, ts: TracedStep) -> _MicrobatchLoss:
        """The step's loss traced at one device's micro-batch, checked to be pipelinable."""
        plan, call = self.plan, ts.call
        n_params = call.num_params
        p_avals = [jax.ShapeDtypeStruct(shaped(v).shape, shaped(v).dtype) for v in ts.vg.invars[:n_params]]
        self.rest_vars = rest_vars = ts.vg.invars[n_params:]
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
        return _MicrobatchLoss(traced, args, p_avals, mb_avals, is_batch)

    def _build_programs(self, checkpoint_tags: tuple[str, ...]) -> None:
        """Every stage's programs, update rounds, prologue and metric plan; the applied report."""
        self.programs = [self._stage_programs(k) for k in range(self.K)]
        self.split_programs = {op.stage: SplitPrograms(self.programs[op.stage]) for op in self.issue
                               if op.kind is OpKind.W}
        self.rounds = {(k, r): self._build_round(k, r) for k in range(self.K)
                       for r in range(1, self.prop.num_rounds + 1)}
        self.prologue = {k: self._build_prologue(k) for k in range(self.K) if self._uses_batch(k)}
        self._metric_plan()
        self.twin_routes = self._twin_routes()
        self.execution = ExecutionPlan(tuple(pr.execution for pr in self.programs),
                                       mesh_capabilities(self.meshes[0], self.plan.tp_overlap), self.info.is_batch,
                                       tuple(self.issue))
        self._accs: dict[int, tuple[PyTree, PyTree]] = {}  # per stage: (accumulators, loss accumulators)
        self.applied = self._applied_report(checkpoint_tags)
        self._ready = True

    def _applied_report(self, tags: tuple[str, ...]) -> PipelineReport:
        """What each stage's knobs did to the pieces it holds and to its programs (`runtime.report`),
        warning for a knob that applies to nothing on a stage."""
        param_of = {i: j for j, i in enumerate(self.param_index)}
        stages = []
        for k, pr in enumerate(self.programs):
            held, one = self.held[k], self.one_stage_plans[k]
            acc_host = dict(zip(pr.spec.params, pr.spec.acc_host))
            applied = applied_report([self.layouts[k][i] for i in held],
                                     [np.dtype(self.state_avals[i].dtype).itemsize for i in held], one,
                                     num_layers=one.stages[0].num_layers, uses_mistjax_grad=True,
                                     checkpoint_tags=tags, warn=False,
                                     grads_on_host=[acc_host.get(param_of.get(i, -1), False) for i in held])
            applied = dataclasses.replace(applied, execution=pr.execution)
            stages.append(StageReport(k, self.plan.stages[k].layers, self.group[k], self.meshes[k].size, one, applied))
        return pipeline_report(stages)

    def _tensor_layouts(self, p_avals: Sequence[jax.ShapeDtypeStruct], stacked: set[int],
                        axes: Sequence[Axes | None]) -> list[LeafLayout]:
        """Global layouts of the parameters (their tensor-parallel dims, for the Megatron block)."""
        plan = self.plan
        whole = Plan(stages=(dataclasses.replace(plan.stages[0], layers=(0, plan.num_layers)),),
                     micro_batch=plan.micro_batch, grad_accum=plan.grad_accum, dp=plan.dp, tp=plan.tp, cp=plan.cp,
                     cp_form=plan.cp_form, shard_group=plan.shard_group)
        return plan_layouts(list(p_avals), [PARAM] * len(p_avals), [j in stacked for j in range(len(p_avals))], whole,
                            list(axes))

    def _place_leaves(self, names: list[str]) -> None:
        """Per state leaf: which stages hold a piece, and each piece's layout on its stage."""
        prop, plan = self.prop, self.plan
        infos = []
        for i, aval in enumerate(self.state_avals):
            lay = prop.state_layout_of(i)
            if isinstance(lay, Rows):
                if lay.dim != 0 or not aval.shape or aval.shape[0] != plan.num_layers:
                    raise PlanError(f"state leaf {names[i]} is split by layers along dim {lay.dim}; a pipelined "
                                    "plan keeps stacked leaves split along their leading layer dim")
                infos.append(StagedInfo(True, tuple(range(self.K)), tuple(aval.shape), np.dtype(aval.dtype).name,
                                        tuple(s.layers for s in plan.stages)))
            else:
                infos.append(StagedInfo(False, tuple(sorted(lay.stages)), tuple(aval.shape),
                                        np.dtype(aval.dtype).name))
        self.infos = infos
        param_of = {i: j for j, i in enumerate(self.param_index)}
        self.held: list[list[int]] = []
        self.layouts: list[dict[int, LeafLayout]] = []
        self.one_stage_plans: list[Plan] = []
        for k, sp in enumerate(plan.stages):
            held = [i for i, inf in enumerate(infos) if k in inf.stages]
            n = sp.layers[1] - sp.layers[0]
            local = [jax.ShapeDtypeStruct((n, *self.state_avals[i].shape[1:]) if infos[i].rows
                                          else self.state_avals[i].shape, self.state_avals[i].dtype) for i in held]
            # Optimizer state: leaves with logical axes (Flax / optax mirrors) or placed like a parameter
            # by the update's propagation (plain pytrees); counters and other replicated leaves are "other".
            roles = [PARAM if i in param_of else OPT if self.axes[i] is not None or prop.state_layout[i] !=
                     Whole(prop.ALL) else OTHER for i in held]
            one = Plan(stages=(dataclasses.replace(sp, layers=(0, n)),), micro_batch=plan.micro_batch,
                       grad_accum=plan.grad_accum, dp=plan.dp, tp=plan.tp, cp=plan.cp, cp_form=plan.cp_form,
                       shard_group=plan.shard_group)
            # An offload ratio that moves nothing on this stage warns with the stage's report (`_applied_report`).
            if self.leaf_roles is None:
                lays = plan_layouts(local, roles, [infos[i].rows for i in held], one, [self.axes[i] for i in held])
            else:  # an unrolled stack: the stage's layer leaves laid out as one stacked leaf per place
                lays = state_layouts(local, self._stage_roles(held, roles, sp.layers), one)
            self.held.append(held)
            self.layouts.append(dict(zip(held, lays)))
            self.one_stage_plans.append(one)

    def _stage_roles(self, held: list[int], roles: list[LeafRole], layers: tuple[int, int]) -> LeafRoles:
        """`LeafRoles` of the leaves a stage holds, its layers of an unrolled stack renumbered from 0."""
        full = self.leaf_roles
        assert full is not None  # (an unrolled stack's roles: `_place_leaves` calls this only with them)
        layer_of = {pos: (key, layer - layers[0]) for pos, i in enumerate(held)
                    for key, layer in [full.layer_of.get(i, (None, -1))] if key is not None}
        return LeafRoles(tuple(roles), (False,) * len(held), tuple(self.axes[i] for i in held), {}, layer_of,
                         layers[1] - layers[0])

    def _leaf_roles(self, traced: TracedLoss, abstract: State, params: PyTree) -> LeafRoles:
        """Every state leaf's logical axes, as the one-stage runtime reads them (`runtime.leaves.state_roles`):
        the model's names (renamed by ``axis_rules``) or, without any, the tensor splits inferred from the layer
        (`analysis.tp_roles`), optimizer mirrors taking their parameter's; and, for an unrolled stack, which
        layer each leaf belongs to."""
        from mistjax.analysis.tp_roles import model_tensor_axes  # here, not at import: the package loads sympy

        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
        tokens = [path_tokens(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        p_axes = model_tensor_axes(traced, params, self.axis_rules)
        return state_roles(paths, [tuple(x.shape) for x in self.state_avals],
                           apply_axis_rules(leaf_axes(abstract), self.axis_rules), dict(zip(self.param_index, tokens)),
                           self.param_index, stacked_params={self.param_index[j] for j in self.stacked},
                           param_axes=dict(zip(self.param_index, p_axes)), groups=traced.groups)

    def piece_sharding(self, i: int, k: int) -> NamedSharding:
        """Storage sharding of state leaf `i`'s piece on stage `k`."""
        lay = self.layouts[k][i]
        return NamedSharding(self.meshes[k], lay.spec(), memory_kind="pinned_host" if lay.host else None)

    def _stage_programs(self, k: int) -> StagePrograms:
        held_params = [j for j, i in enumerate(self.param_index) if i in self.layouts[k]]
        lays = [self.layouts[k][self.param_index[j]] for j in held_params]
        sp = self.plan.stages[k]
        acc_host = host_accumulators(lays, sp.offload_grads)
        spec = StageSpec(index=k, num_stages=self.K, layers=sp.layers, plan=self.one_stage_plans[k],
                         mesh=self.meshes[k], params=tuple(held_params), layouts=tuple(lays),
                         acc_host=tuple(acc_host), uses_batch=self._uses_batch(k))
        # An unrolled stack's stage runs its own layers' leaves (`TracedLoss.for_layers`).
        return StagePrograms(spec, dataclasses.replace(self.info, traced=self.info.traced.for_layers(*sp.layers)))

    def _uses_batch(self, k: int) -> bool:
        """The first stage (pre part), the last (post part), and any stage recomputing batch-only consts."""
        return k == 0 or k == self.K - 1 or bool(self.info.bconst_positions)

    # ------------------------------------------------------------------ update rounds
    def _inputs_of(self, k: int, r: int) -> list[InputGroup]:
        """Every input group stage `k` could read in round `r` (pruned to the used ones later)."""
        prop, ts = self.prop, self.ts
        groups = [InputGroup(Source.STATE, i) for i in self.held[k]]
        n_aux = ts.call.num_aux
        if k == self.K - 1:
            groups += [InputGroup(Source.LOSS)] + [InputGroup(Source.AUX, a) for a in range(n_aux)]
        groups += [InputGroup(Source.GRAD, j) for j, i in enumerate(self.param_index) if i in self.layouts[k]]
        groups += [InputGroup(Source.BATCH, b) for b in range(len(ts.batch_vars))]
        groups += [InputGroup(Source.TWIN, v) for v in prop.mat if prop.level[v] <= r - 2]
        return groups

    def _group_vars(self, g: InputGroup) -> jex.Var | tuple[Source, jex.Var]:
        """The step jaxpr's variable an input group binds in the update's environment (a twin: its own key)."""
        ts, n_aux = self.ts, self.ts.call.num_aux
        match g.source:
            case Source.STATE:
                return ts.state_vars[g.ref_index]
            case Source.LOSS:
                return ts.vg.outvars[0]
            case Source.AUX:
                return ts.vg.outvars[1 + g.ref_index]
            case Source.GRAD:
                return ts.vg.outvars[1 + n_aux + g.ref_index]
            case Source.BATCH:
                return ts.batch_vars[g.ref_index]
        return twin_key(g.ref_var)

    def _group_avals(self, k: int, g: InputGroup) -> list[jax.ShapeDtypeStruct]:
        """Avals (with shardings) of the arrays of input group `g` on stage `k`."""
        mesh = self.meshes[k]
        if g.source is Source.STATE:
            return [self._piece_aval(g.ref_index, k)]
        if g.source in (Source.LOSS, Source.AUX):
            v = self._group_vars(g)
            assert isinstance(v, Var)  # the loss or an aux output: a variable of the step
            return [jax.ShapeDtypeStruct(shaped(v).shape, shaped(v).dtype, sharding=NamedSharding(mesh, P()))]
        if g.source is Source.GRAD:
            prog, info = self.programs[k], self.infos[self.param_index[g.ref_index]]
            jj = prog.spec.params.index(g.ref_index)
            piece = self._piece_aval(self.param_index[g.ref_index], k)
            sources = info.stages if not info.rows else (k,)
            return [jax.ShapeDtypeStruct(piece.shape, piece.dtype, sharding=prog.grad_shardings()[jj])] * len(sources)
        if g.source is Source.BATCH:
            v = self.ts.batch_vars[g.ref_index]
            spec = batch_spec(shaped(v).shape, self.plan.global_batch, self.plan.cp)
            return [jax.ShapeDtypeStruct(shaped(v).shape, shaped(v).dtype, sharding=NamedSharding(mesh, spec))]
        v = g.ref_var
        lay = self.prop.layout_of(v)
        return [self._contrib_aval(v, lay, s, k) for s in contributors(lay, self.K)]

    def _piece_aval(self, i: int, k: int) -> jax.ShapeDtypeStruct:
        lay = self.layouts[k][i]
        return jax.ShapeDtypeStruct(lay.shape, self.state_avals[i].dtype, sharding=self.piece_sharding(i, k))

    def _contrib_aval(self, v: Var, lay: Layout, source: int, at: int) -> jax.ShapeDtypeStruct:
        """A contribution of `source` to materialised value `v`, as received on stage `at` (replicated)."""
        key = (v, source, at)
        if key not in self._avals:
            shape = list(shaped(v).shape)
            if isinstance(lay, Rows):
                shape[lay.dim] = self.rows.count(source)
            self._avals[key] = jax.ShapeDtypeStruct(tuple(shape), shaped(v).dtype,
                                                    sharding=NamedSharding(self.meshes[at], P()))
        return self._avals[key]

    def _targets(self, k: int, r: int) -> list[tuple[Output, Target]]:
        """What stage `k` computes in round `r`: each `Output` with the step jaxpr's value it is."""
        prop, ts = self.prop, self.ts
        out: list[tuple[Output, Target]] = []
        for v in prop.mat:
            if prop.level[v] == r - 1 and k in contributors(prop.layout_of(v), self.K):
                out.append((Output(Sink.CONTRIB, v), v))
        if r == prop.num_rounds:
            for i in self.held[k]:
                nv = ts.new_state_vars[i]
                if nv is ts.state_vars[i]:
                    continue  # unchanged: the old piece is kept
                # (a leaf read from its materialised value is a variable: only variables are materialised)
                out.append((Output(Sink.STATE, i), twin_key(cast(Var, nv)) if i in prop.out_twin else nv))
            for m, mv in enumerate(ts.metric_vars):
                if k in self._metric_sources(mv):
                    out.append((Output(Sink.METRIC, m), mv))
        return out

    def _metric_sources(self, v: Atom) -> list[int]:
        lay = Whole(self.prop.ALL) if isinstance(v, jex.Literal) else self.prop.layout_of(v)
        if lay == Whole(self.prop.ALL):
            return list(range(self.S))  # each device group computes its own copy
        return contributors(lay, self.K)

    def _make_env_fn(self, k: int, groups: list[InputGroup], sizes: list[int],
                     targets: list[tuple[Output, Target]]) -> Callable[..., list[Value]]:
        prop = self.prop

        def fn(*flat: jax.Array) -> list[Value]:
            env: dict[EnvKey, Value] = {}
            pos = 0
            for g, n in zip(groups, sizes):
                arrays = list(flat[pos: pos + n])
                pos += n
                if g.source is Source.STATE and self.layouts[k][g.ref_index].host:
                    arrays = [jax.device_put(a, jax.memory.Space.Device) for a in arrays]
                if g.source is Source.GRAD:
                    value = arrays[0] if n == 1 else sum(arrays[1:], arrays[0])  # a tied parameter's summands
                elif g.source is Source.TWIN:
                    value = combine(prop.layout_of(g.ref_var), arrays)
                else:
                    value = arrays[0]
                env[self._group_vars(g)] = value
            outs = stage_eval(prop, k, self.rows, env, [t for _, t in targets])
            return self._regather(k, targets, outs, env)

        return fn

    def _regather(self, k: int, targets: list[tuple[Output, Target]], outs: list[Value],
                  env: dict[EnvKey, Value]) -> list[Value]:
        """Updated ZeRO-1/2 parameters re-gathered hierarchically when the partition group spans nodes."""
        if self.meshes[k].shape[SHARD_AXES[0]] == 1:
            return outs
        idx = [j for j, (key, _) in enumerate(targets) if key.sink is Sink.STATE and
               self.layouts[k][key.ref_index].role == PARAM]
        if not idx:
            return outs
        lays = [self.layouts[k][targets[j][0].ref_index] for j in idx]
        updated = [cast(jax.Array, outs[j]) for j in idx]  # traced arrays (the update program's values)
        new = regather_updated_params(updated, [None] * len(idx), lays, self.one_stage_plans[k], self.meshes[k])
        outs = list(outs)
        for j, x in zip(idx, new):
            outs[j] = x
        return outs

    def _build_program(self, k: int, groups: list[InputGroup], targets: list[tuple[Output, Target]],
                       donate: frozenset[Source]) -> _Round:
        """Jit stage `k`'s evaluation of `targets`, keeping only the input groups it reads."""
        sizes = [len(self._group_avals(k, g)) for g in groups]
        avals = [a for g in groups for a in self._group_avals(k, g)]
        probe = jax.make_jaxpr(self._make_env_fn(k, groups, sizes, targets))(
            *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
        used_vars = {v for e in probe.jaxpr.eqns for v in e.invars if isinstance(v, jex.Var)}
        used_vars |= {v for v in probe.jaxpr.outvars if isinstance(v, jex.Var)}
        keep, pos = [], 0
        for g, n in zip(groups, sizes):
            if any(v in used_vars for v in probe.jaxpr.invars[pos: pos + n]):
                keep.append(g)
            pos += n
        sizes = [len(self._group_avals(k, g)) for g in keep]
        avals = [a for g in keep for a in self._group_avals(k, g)]
        fn = self._make_env_fn(k, keep, sizes, targets)
        whole = NamedSharding(self.meshes[k], P())
        out_sh = [self.piece_sharding(key.ref_index, k) if key.sink is Sink.STATE else whole for key, _ in targets]
        donated: list[int] = []
        pos = 0
        new_state = {key.ref_index for key, _ in targets if key.sink is Sink.STATE}
        for g, n in zip(keep, sizes):
            if g.source in donate and (g.source is not Source.STATE or g.ref_index in new_state):
                donated += range(pos, pos + n)
            pos += n
        prog = jax.jit(fn, out_shardings=out_sh, donate_argnums=tuple(donated),
                       compiler_options=xla_flags.compiler_options(self.meshes[k].devices.flat[0].platform))
        return _Round(keep, [key for key, _ in targets], prog, sizes, avals)

    def _twin_routes(self) -> dict[int, list[TwinRoute]]:
        """Per update round r, the contributions sent after it: each value materialised in round r that a
        later round of a stage reads, from every contributing stage to that stage (computed once)."""
        prop, R = self.prop, self.prop.num_rounds
        routes: dict[int, list[TwinRoute]] = {r: [] for r in range(1, R + 1)}
        for r in range(1, R + 1):
            seen: set[tuple[int, Var]] = set()
            for t in range(self.K):
                for r2 in range(r + 1, R + 1):
                    for g in self.rounds[(t, r2)].groups:
                        if g.source is not Source.TWIN or prop.level[g.ref_var] != r - 1 or (t, g.ref_var) in seen:
                            continue
                        seen.add((t, g.ref_var))
                        lay = prop.layout_of(g.ref_var)
                        srcs = tuple(contributors(lay, self.K))
                        routes[r].append(TwinRoute(t, g.ref_var, srcs, tuple(self._contrib_aval(g.ref_var, lay, s, t)
                                                                          for s in srcs)))
        return routes

    def _build_round(self, k: int, r: int) -> _Round:
        final = r == self.prop.num_rounds
        return self._build_program(k, self._inputs_of(k, r), self._targets(k, r),
                                   frozenset({Source.STATE}) if final else frozenset())

    def _build_prologue(self, k: int) -> _Round | None:
        """Stage `k`'s loss arguments computed from the step's inputs (None if they are all inputs)."""
        targets: list[tuple[Output, Target]] = []
        for r, v in enumerate(self.rest_vars):
            if isinstance(v, jex.Var) and v not in self.ts.batch_vars:
                targets.append((Output(Sink.REST, r), v))
        if not targets:
            return None
        groups = ([InputGroup(Source.STATE, i) for i in self.held[k]]
                  + [InputGroup(Source.BATCH, b) for b in range(len(self.ts.batch_vars))])
        return self._build_program(k, groups, targets, frozenset())

    def _metric_plan(self) -> None:
        """Which metrics need combining on the device groups after the last round."""
        self.metric_combine: list[bool] = []
        for v in self.ts.metric_vars:
            lay = None if isinstance(v, jex.Literal) else self.prop.layout_of(v)
            self.metric_combine.append(isinstance(lay, Rows) or (lay is not None and not isinstance(lay, Whole)))
        self._combine_programs: dict[int, Program] = {}

    # ================================================================== placement
    def place(self, state: State, batch: Batch) -> State:
        """The state as `StagedArray` leaves with each piece on its stage (see `mpmd_state`)."""
        if not self._ready:
            self._setup(state, batch)
        leaves = jax.tree.leaves(state, is_leaf=is_staged)
        if any(is_staged(x) for x in leaves):
            self._check_staged(leaves)
            return state
        return jax.tree.unflatten(self.state_tree, [self._place_leaf(i, x) for i, x in enumerate(leaves)])

    def _check_staged(self, leaves: Sequence[jax.Array]) -> None:
        if len(leaves) != len(self.infos) or any(not is_staged(x) or x.info != inf for x, inf in zip(leaves,
                                                                                                      self.infos)):
            raise PlanError("the state was placed for another plan or model; pass the state returned by this "
                            "step's place() or __call__, or an unplaced state")

    def _place_leaf(self, i: int, x: jax.Array) -> StagedArray:
        info = self.infos[i]
        host = np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) and x.is_fully_addressable else x
        pieces = []
        for n, k in enumerate(info.stages):
            value = host[info.bounds[n][0]: info.bounds[n][1]] if info.rows else host
            sh = self.piece_sharding(i, k)
            value = np.asarray(value)
            pieces.append(jax.make_array_from_callback(value.shape, sh, _slicer(value),
                                                       dtype=value.dtype))
        return StagedArray(pieces, info)

    def _piece_or_handle(self, i: int, k: int, x: jax.Array | None) -> jax.Array:
        """`x`, or for a piece another process holds, a handle with no local shards (as `place` makes):
        every process then sees the same pieces, with their shardings, for checksums and checkpoints."""
        if x is not None:
            return x
        info = self.infos[i]
        n = info.stages.index(k)
        shape = (info.bounds[n][1] - info.bounds[n][0], *info.shape[1:]) if info.rows else info.shape
        return jax.make_array_from_single_device_arrays(shape, self.piece_sharding(i, k), [], dtype=info.dtype)

    def gather(self, state: State) -> State:
        """The user's structure with whole host arrays (every piece brought to this process)."""
        if jax.process_count() > 1:
            state = jax.tree.map(self._replicate_piece_everywhere, state, is_leaf=is_staged)
        return gather_state(state)

    def _replicate_piece_everywhere(self, x: PyTree) -> PyTree:
        if not is_staged(x):
            return x
        pieces = []
        for k, p in zip(x.info.stages, x.pieces):
            full = NamedSharding(self.mesh, P())
            parts: list[jax.Array] = []
            for d in range(self.S):
                local = self._transfer(p, NamedSharding(self.group_meshes[d], P()), src_stage=k, dst_stage=d)
                if self.local[d]:
                    assert local is not None  # a placed piece is an array (a handle where another process holds it)
                    parts.extend(s.data for s in local.addressable_shards)
            pieces.append(jax.make_array_from_single_device_arrays(p.shape, full, parts, dtype=p.dtype))
        return StagedArray(pieces, x.info)

    # ================================================================== batch
    def batch_shardings(self, batch: Batch) -> PyTree:
        """The batch over the whole plan mesh: split over DP, replicated over the stages."""
        return batch_shardings(self.mesh, batch, self.plan.global_batch)

    def _stage_batch(self, batch: Batch) -> list[list[jax.Array]]:
        """Per device group, the batch leaves on its sub-mesh (no copies for a batch placed by
        `batch_shardings`)."""
        leaves = jax.tree.leaves(batch)
        shardings = jax.tree.leaves(self.batch_shardings(batch))
        out: list[list[jax.Array]] = [[] for _ in range(self.S)]
        for x, sh in zip(leaves, shardings):
            if not (isinstance(x, jax.Array) and x.sharding == sh):
                value = np.asarray(x)
                x = jax.make_array_from_callback(value.shape, sh, _slicer(value), dtype=value.dtype)
            for d in range(self.S):
                devices = set(self.group_meshes[d].devices.flat)
                shards = [s.data for s in x.addressable_shards if s.device in devices]
                out[d].append(jax.make_array_from_single_device_arrays(
                    x.shape, NamedSharding(self.group_meshes[d], sh.spec), shards, dtype=x.dtype))
        return out

    # ================================================================== transfers
    def _transfer(self, x: Held, dst: NamedSharding, *, src_stage: int, dst_stage: int,
                  aval: jax.ShapeDtypeStruct | None = None) -> Held:
        """``jax.device_put`` between stages, by the processes that send or receive it (``aval``: the array's,
        where another process may produce it)."""
        src_local, dst_local = self.local[src_stage], self.local[dst_stage]
        if self.meshes[src_stage] is self.meshes[dst_stage] or not (src_local or dst_local):
            if x is not None and x.sharding != dst and src_local:
                self.stats.transfers += 1
                return jax.device_put(x, dst)
            return x
        if x is None:  # produced by another process: a handle with no local shards
            assert aval is not None, "a transfer from another process needs the array's aval"
            src = NamedSharding(self.meshes[src_stage], dst.spec, memory_kind=dst.memory_kind)
            x = jax.make_array_from_single_device_arrays(aval.shape, src, [], dtype=aval.dtype)
        self.stats.transfers += 1
        return jax.device_put(x, dst)

    def _send(self, arrays: list[Held], avals: list[jax.ShapeDtypeStruct], dst: list[NamedSharding], src_stage: int,
              dst_stage: int) -> list[Held]:
        """Several arrays from one stage to another in one ``device_put`` call."""
        if self.meshes[src_stage] is self.meshes[dst_stage]:
            return arrays
        if not (self.local[src_stage] or self.local[dst_stage]):
            return [None] * len(arrays)
        xs = []
        for x, a, d in zip(arrays, avals, dst):
            if x is None:
                src = NamedSharding(self.meshes[src_stage], d.spec, memory_kind=d.memory_kind)
                x = jax.make_array_from_single_device_arrays(a.shape, src, [], dtype=a.dtype)
            xs.append(x)
        self.stats.transfers += 1
        return list(jax.device_put(xs, dst))

    def _run(self, kind: str, k: int, fn: Callable[..., PyTree], *args: PyTree) -> PyTree | None:
        """``fn(*args)`` where this process runs stage `k` (counted in the step's `DispatchStats`), else None."""
        if not self.local[k]:
            return None
        self.stats.programs += 1
        self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0) + 1
        return fn(*args)

    # ================================================================== one step
    def __call__(self, state: State, batch: Batch) -> tuple[State, Metrics]:
        self.plan.check_batch(_leading_dim(batch))  # the programs are compiled for this batch size
        if not self._ready:
            self._setup(state, batch)
        t0 = time.perf_counter()
        self.stats = DispatchStats()
        state = self.place(state, batch)
        leaves = jax.tree.leaves(state, is_leaf=is_staged)
        self._check_staged(leaves)
        pieces = [dict(zip(x.info.stages, x.pieces)) for x in leaves]
        groups_batch = self._stage_batch(batch)
        mbs = self._microbatches(pieces, groups_batch)
        grads, loss, aux = self._pipeline(pieces, mbs)
        tied = self._share_tied_grads(grads)
        new_pieces, metrics = self._update(pieces, tied, loss, aux, groups_batch)
        new_leaves = []
        for i, inf in enumerate(self.infos):
            new_leaves.append(StagedArray([self._piece_or_handle(i, k, new_pieces[i].get(k, pieces[i][k]))
                                           for k in inf.stages], inf))
        self.stats.host_s = time.perf_counter() - t0
        return jax.tree.unflatten(self.state_tree, new_leaves), metrics

    def _rest_leaves(self, k: int, pieces: Pieces, groups_batch: GroupBatches) -> list[Held]:
        """The loss's non-parameter arguments on stage `k` (whole batch leaves, before splitting)."""
        batch_pos = {v: b for b, v in enumerate(self.ts.batch_vars)}
        state_pos = {v: i for i, v in enumerate(self.ts.state_vars)}
        prologue = self.prologue.get(k)
        computed: dict[int, Held] = {}
        if prologue is not None:
            args = self._gather_inputs(k, prologue, pieces, {}, None, None, None, groups_batch)
            outs = self._run("prologue", k, prologue.program, *args)
            computed = {key.ref_index: o for key, o in zip(prologue.outputs, outs or [None] * len(prologue.outputs))}
        out = []
        for r, v in enumerate(self.rest_vars):
            if isinstance(v, jex.Literal):
                out.append(jax.device_put(jnp.asarray(v.val, shaped(v).dtype), NamedSharding(self.meshes[k], P()))
                           if self.local[k] else None)
            elif v in batch_pos:
                out.append(groups_batch[self.group[k]][batch_pos[v]])
            elif r in computed:
                out.append(computed[r])
            else:
                out.append(pieces[state_pos[v]][k])
        return out

    def _microbatches(self, pieces: Pieces, groups_batch: GroupBatches) -> list[list[list[Held]]]:
        """Per stage and micro-batch, the loss's rest leaves (batch leaves split; the others whole)."""
        G = self.plan.grad_accum
        is_batch = self.info.is_batch
        out: list[list[list[Held]]] = []
        per_group: dict[int, list[list[Held]]] = {}
        for k in range(self.K):
            if not self.programs[k].spec.uses_batch:
                out.append([[] for _ in range(G)])
                continue
            d = self.group[k]
            if d not in per_group:
                rest = self._rest_leaves(k, pieces, groups_batch)
                split = self._run("split", k, self.programs[k].split(), [x for x, b in zip(rest, is_batch) if b])
                per_mb = []
                for i in range(G):
                    it = iter(split[i]) if split is not None else iter([None] * sum(is_batch))
                    per_mb.append([next(it) if b else x for x, b in zip(rest, is_batch)])
                per_group[d] = per_mb
            out.append(per_group[d])
        return out

    def _pipeline(self, pieces: Pieces, mbs: list[list[list[Held]]]
                  ) -> tuple[list[list[Held]], Held, list[Held] | None]:
        """Run the schedule; returns per stage its finished gradients, and the loss and aux sums."""
        K = self.K
        params = [[pieces[self.param_index[j]][k] for j in self.programs[k].spec.params] for k in range(K)]
        for k in range(K):
            if k not in self._accs and self.local[k]:
                self._accs[k] = self.programs[k].init_accumulators()
        q = _Queues(live=[0] * K)
        self.stats.residuals_in_flight = [0] * K
        split = {op.stage for op in self.issue if op.kind is OpKind.W}
        for op in self.issue:
            k, i = op.stage, op.mb
            if op.kind is OpKind.F:
                self._op_forward(q, params[k], mbs[k][i], k, i)
                continue
            if op.kind is OpKind.W:
                self._op_weight_grad(q, params[k], k, i)
            elif k in split:
                self._op_input_grad(q, params[k], mbs[k][i], k, i)
            elif op.kind is OpKind.B:
                self._op_backward(q, params[k], k, i)
            else:
                self._op_last(q, params[k], mbs[k][i], k, i)
            if op.kind is OpKind.W or k not in split:
                q.live[k] -= op.kind is not OpKind.FB
        self.stats.residual_bytes = [n * b for n, b in zip(self.stats.residuals_in_flight, self.residual_bytes())]
        grads: list[list[Held]] = []
        loss = aux = None
        for k in range(K):
            acc, lacc = self._accs.get(k, (None, None))
            out = self._run("finish", k, self.programs[k].finish(), acc, lacc if k == K - 1 else [])
            if out is None:
                grads.append([None] * len(self.programs[k].spec.params))
                continue
            g, sums, acc, lacc_new = out
            self._accs[k] = (acc, lacc_new if k == K - 1 else lacc)
            grads.append(list(g))
            if k == K - 1:
                loss, aux = sums[0], list(sums[1:])
        return grads, loss, aux

    def _send_ct(self, ct_in: list[Held] | None, k: int, i: int, q: _Queues) -> None:
        h_float = [a for a, f in zip(self.programs[0].h_global_avals(), self.programs[0].h_float) if f]
        q.ct_recv[(k - 1, i)] = self._send(list(ct_in) if ct_in is not None else [None] * len(h_float), h_float,
                                           self.programs[k - 1].ct_shardings(), k, k - 1)

    def _set_acc(self, k: int, acc: list[Held] | None, lacc: list[Held] | None) -> None:
        if self.local[k]:
            self._accs[k] = (acc, lacc)

    def _op_forward(self, q: _Queues, params: list[Held], mb: list[Held], k: int, i: int) -> None:
        pr = self.programs[k]
        h_avals = self.programs[0].h_global_avals()
        args = (params, mb) if k == 0 else (params, q.h_recv.pop((k, i)), mb)
        out = self._run("forward", k, pr.forward(), *args)
        h, r = out if out is not None else (None, None)
        if r is not None and k not in self._residual_device_bytes:  # the residuals as placed: per-device bytes
            self._note_residuals(k, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in r], [x.sharding for x in r])
        q.res[(k, i)] = r
        q.live[k] += 1
        self.stats.residuals_in_flight[k] = max(self.stats.residuals_in_flight[k], q.live[k])
        q.h_recv[(k + 1, i)] = self._send(list(h) if h is not None else [None] * len(h_avals), h_avals,
                                          self.programs[k + 1].h_shardings(), k, k + 1)

    def _op_backward(self, q: _Queues, params: list[Held], k: int, i: int) -> None:
        acc, lacc = self._accs.get(k, (None, None))
        out = self._run("backward", k, self.programs[k].backward(), params, q.res.pop((k, i)), q.ct_recv.pop((k, i)),
                        acc)
        if k == 0:
            acc = out[0] if out is not None else None
        else:
            ct_in, acc = out if out is not None else (None, None)
            self._send_ct(ct_in, k, i, q)
        self._set_acc(k, acc, lacc)

    def _op_last(self, q: _Queues, params: list[Held], mb: list[Held], k: int, i: int) -> None:
        acc, lacc = self._accs.get(k, (None, None))
        out = self._run("last", k, self.programs[k].last(), params, q.h_recv.pop((k, i)), mb, acc, lacc)
        ct_in, acc, lacc = out if out is not None else (None, None, None)
        self._set_acc(k, acc, lacc)
        self._send_ct(ct_in, k, i, q)

    def _op_input_grad(self, q: _Queues, params: list[Held], mb: list[Held], k: int, i: int) -> None:
        """A zero-bubble schedule's B (or the last stage's FB): the input gradient now, the rest kept for W."""
        sp = self.split_programs[k]
        if k == 0:  # no input gradient: W runs the whole backward
            q.wres[(k, i)] = (q.res.pop((k, i)), q.ct_recv.pop((k, i)))
            return
        if k == self.K - 1:
            q.live[k] += 1
            self.stats.residuals_in_flight[k] = max(self.stats.residuals_in_flight[k], q.live[k])
            acc, lacc = self._accs.get(k, (None, None))
            h = q.h_recv.pop((k, i))
            out = self._run("last_input", k, sp.last_input(), params, h, mb, lacc)
            ct_in, lacc, stash = out if out is not None else (None, None, None)
            self._set_acc(k, acc, lacc)
            split = sp.last()
            q.wres[(k, i)] = ([h[j] for j in split.reads("w", "h")] if h is not None else None,
                              [mb[j] for j in split.reads("w", "mb")], stash)
        else:
            stored, ct = q.res.pop((k, i)), q.ct_recv.pop((k, i))
            out = self._run("input_grad", k, sp.input_grad(), params, stored, ct)
            ct_in, stash = out if out is not None else (None, None)
            split = sp.middle()
            q.wres[(k, i)] = ([stored[j] for j in split.reads("w", "stored")] if stored is not None else None,
                              [ct[j] for j in split.reads("w", "ct")] if ct is not None else None, stash)
        self._send_ct(ct_in, k, i, q)

    def _op_weight_grad(self, q: _Queues, params: list[Held], k: int, i: int) -> None:
        """A zero-bubble schedule's W: the weight gradients of micro-batch `i` into the accumulators."""
        acc, lacc = self._accs.get(k, (None, None))
        if k == 0:
            stored, ct = q.wres.pop((k, i))
            out = self._run("backward", k, self.programs[k].backward(), params, stored, ct, acc)
            acc = out[0] if out is not None else None
        else:
            sp = self.split_programs[k]
            a, b, stash = q.wres.pop((k, i))
            prog = sp.last_weight() if k == self.K - 1 else sp.weight_grad()
            acc = self._run("weight_grad", k, prog, params, a, b, acc, stash)
        self._set_acc(k, acc, lacc)

    def _share_tied_grads(self, grads: list[list[Held]]) -> dict[tuple[int, int], list[Held]]:
        """Per (stage, parameter): the gradient summands it adds (a tied parameter gets every holder's)."""
        out: dict[tuple[int, int], list[Held]] = {}
        for k in range(self.K):
            for jj, j in enumerate(self.programs[k].spec.params):
                out[(k, j)] = [grads[k][jj]]
        for j, i in enumerate(self.param_index):
            info = self.infos[i]
            if info.rows or len(info.stages) < 2:
                continue
            for t in info.stages:
                tj = self.programs[t].spec.params.index(j)
                dst = self.programs[t].grad_shardings()[tj]
                parts = []
                for s in info.stages:
                    sj = self.programs[s].spec.params.index(j)
                    x = grads[s][sj]
                    if s != t:
                        aval = jax.ShapeDtypeStruct(self.layouts[s][i].shape, self.state_avals[i].dtype)
                        if self.local[s] and x is not None and cast(NamedSharding, x.sharding).spec != dst.spec:
                            x = jax.device_put(x, NamedSharding(self.meshes[s], dst.spec))  # sender reshards first
                            self.stats.transfers += 1
                        x = self._transfer(x, dst, src_stage=s, dst_stage=t, aval=aval)
                    parts.append(x)
                out[(t, j)] = parts
        return out

    def _gather_inputs(self, k: int, rnd: _Round, pieces: Pieces, twins: Twins,
                       grads: dict[tuple[int, int], list[Held]] | None, loss: Held, aux: list[Held] | None,
                       groups_batch: GroupBatches) -> list[Held]:
        args: list[Held] = []
        for g in rnd.groups:
            match g.source:
                case Source.STATE:
                    args.append(pieces[g.ref_index][k])
                case Source.LOSS:
                    args.append(loss)
                case Source.AUX:
                    # (None on a process without the last stage, as `loss` is: its programs do not run here)
                    args.append(aux[g.ref_index] if aux is not None else None)
                case Source.GRAD:
                    assert grads is not None  # (only the prologue has no gradients, and it reads none)
                    args.extend(grads[(k, g.ref_index)])
                case Source.BATCH:
                    args.append(groups_batch[self.group[k]][g.ref_index])
                case _:
                    args.extend(twins[(k, g.ref_var)])
        return args

    def _update(self, pieces: Pieces, grads: dict[tuple[int, int], list[Held]], loss: Held,
                aux: list[Held] | None, groups_batch: GroupBatches) -> tuple[Pieces, Metrics]:
        R = self.prop.num_rounds
        twins: Twins = {}
        new_pieces: Pieces = [{} for _ in self.infos]
        metric_parts: dict[tuple[int, int], Held] = {}  # (metric, source stage) -> contribution
        for r in range(1, R + 1):
            contribs: dict[tuple[Var, int], Held] = {}
            for k in range(self.K):
                rnd = self.rounds[(k, r)]
                args = self._gather_inputs(k, rnd, pieces, twins, grads, loss, aux, groups_batch)
                outs = self._run(f"update{r}", k, rnd.program, *args)
                outs = outs if outs is not None else [None] * len(rnd.outputs)
                for key, o in zip(rnd.outputs, outs):
                    if key.sink is Sink.CONTRIB:
                        contribs[(key.ref_var, k)] = o
                    elif key.sink is Sink.STATE:
                        new_pieces[key.ref_index][k] = o
                    else:
                        metric_parts[(key.ref_index, k)] = o
            for route in self.twin_routes[r]:
                twins[(route.stage, route.var)] = [
                    self._transfer(contribs[(route.var, s)], self._replicated[route.stage], src_stage=s,
                                   dst_stage=route.stage, aval=aval) for s, aval in zip(route.sources, route.avals)]
        return new_pieces, self._metrics(metric_parts)

    def _metrics(self, parts: dict[tuple[int, int], Held]) -> Metrics:
        """Every metric as an ordinary array replicated over the whole plan mesh."""
        ts, prop = self.ts, self.prop
        per_group: list[list[Held]] = [[] for _ in range(self.S)]
        combine_inputs: list[list[list[Held]]] = [[] for _ in range(self.S)]
        for m, v in enumerate(ts.metric_vars):
            srcs = self._metric_sources(v)
            lay = Whole(prop.ALL) if isinstance(v, jex.Literal) else prop.layout_of(v)
            for d in range(self.S):
                if lay == Whole(prop.ALL):
                    per_group[d].append(parts[(m, d)])
                    continue
                assert isinstance(v, Var)  # (a literal is whole on every group)
                recv = [self._transfer(parts[(m, s)], self._replicated[d], src_stage=s,
                                       dst_stage=d, aval=self._contrib_aval(v, lay, s, d)) for s in srcs]
                if self.metric_combine[m]:
                    combine_inputs[d].append(recv)
                    per_group[d].append(None)
                else:
                    per_group[d].append(recv[0])
        if any(self.metric_combine):
            for d in range(self.S):
                prog = self._combine_program(d)
                outs = self._run("metrics", d, prog, combine_inputs[d])
                it = iter(outs if outs is not None else [None] * sum(self.metric_combine))
                per_group[d] = [next(it) if c else x for x, c in zip(per_group[d], self.metric_combine)]
        full = NamedSharding(self.mesh, P())
        out = []
        for m, v in enumerate(ts.metric_vars):
            bufs = [s.data for d in range(self.S) if self.local[d] for s in _here(per_group[d][m]).addressable_shards]
            aval = shaped(v)
            out.append(jax.make_array_from_single_device_arrays(aval.shape, full, bufs, dtype=aval.dtype))
        return jax.tree.unflatten(ts.metrics_tree, out)

    def _combine_program(self, d: int) -> Program:
        if d not in self._combine_programs:
            lays = [self.prop.layout_of(v) for v, c in zip(self.ts.metric_vars, self.metric_combine) if c]
            sh = NamedSharding(self.group_meshes[d], P())
            self._combine_programs[d] = jax.jit(lambda groups: [combine(lay, g) for lay, g in zip(lays, groups)],
                                                out_shardings=[sh] * len(lays))
        return self._combine_programs[d]

    # ================================================================== inspection
    def residual_bytes(self) -> list[int]:
        """Per stage: bytes per device its forward keeps in device memory for one micro-batch (0 on the last
        stage); the part an offload policy moves to host is `residual_host_bytes`.

        Once the stage's forward program was compiled (`compile_stages`) or ran, each residual's bytes are those of its
        piece under the sharding XLA gave it: a tensor-parallel residual is split over the tensor axis. Before,
        each residual is counted whole over that axis (its data-parallel piece), an upper bound."""
        return [0 if k == self.K - 1 else self._residual_device_bytes.get(k, self.programs[k].classify().device_nbytes)
                for k in range(self.K)]

    def _note_residuals(self, k: int, out_info: Sequence[jax.ShapeDtypeStruct],
                        shardings: Sequence[jax.sharding.Sharding]) -> None:
        """Record stage ``k``'s per-device residual bytes from its compiled forward's outputs (`residual_bytes`)."""
        stored = self.programs[k].classify().avals
        if len(stored) != len(out_info) or len(out_info) != len(shardings):
            return  # not the layout this accounting knows: keep the upper bound
        self._residual_device_bytes[k] = sum(
            int(np.prod(sh.shard_shape(tuple(info.shape)))) * np.dtype(info.dtype).itemsize
            for (_, _, _, host), info, sh in zip(stored, out_info, shardings) if not host)

    def residual_host_bytes(self) -> list[int]:
        """Per stage: bytes per device of one micro-batch's residuals kept in host memory (offloaded)."""
        return [0 if k == self.K - 1 else self.programs[k].classify().host_nbytes for k in range(self.K)]

    def compile_stages(self, state: State, batch: Batch, phases: Sequence[str] | None = None, *,
                       compile: bool = True) -> dict[tuple[int, str], jax.stages.Compiled | jax.stages.Lowered]:
        """Every program of every local stage: ``{(stage, phase): jax.stages.Compiled}`` (or ``Lowered``
        with ``compile=False``).

        Phases: ``forward`` / ``backward`` (stages before the last), ``last``, ``finish``, ``split``
        (stages reading the batch), ``update1`` ... (the update rounds); `phases` picks some. Each has its
        own ``memory_analysis()``: the stage's memory, not the largest stage's.
        """
        if not self._ready:
            self._setup(state, batch)
        want = set(phases) if phases is not None else None
        out: dict[tuple[int, str], jax.stages.Compiled | jax.stages.Lowered] = {}

        def add(k: int, phase: str, lower: Callable[[], jax.stages.Lowered]) -> None:
            if want is None or phase in want:
                low = lower()
                out[(k, phase)] = low.compile() if compile else low

        for k, pr in enumerate(self.programs):
            if not self.local[k]:
                continue
            params = pr.param_avals()
            acc, lacc = pr.acc_avals(), pr.loss_acc_avals()
            mb = pr.mb_global_avals()
            h = pr.h_global_avals()
            hf = [a for a, f in zip(h, pr.h_float) if f]
            if k < self.K - 1:
                if want is None or {"forward", "backward", "input_grad", "weight_grad"} & want:
                    fwd = pr.forward().lower(params, mb) if k == 0 else pr.forward().lower(params, h, mb)
                    needs_res = want is None or bool({"backward", "input_grad", "weight_grad"} & want)
                    fwd_c = fwd.compile() if compile or needs_res else None
                    if want is None or "forward" in want:
                        out[(k, "forward")] = fwd_c if compile and fwd_c is not None else fwd  # (compile: built)
                    res = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                           for a, s in zip(fwd.out_info[1], fwd_c.output_shardings[1])] if fwd_c is not None else []
                    if fwd_c is not None:
                        self._note_residuals(k, fwd.out_info[1], fwd_c.output_shardings[1])
                    if k in self.split_programs and k > 0:  # a zero-bubble stage runs its split backward instead
                        self._add_split_programs(k, add, [params, res, hf, acc], want)
                    elif want is None or "backward" in want:
                        add(k, "backward", functools.partial(_lowered, pr.backward, params, res, hf, acc))
            else:
                if k in self.split_programs:
                    self._add_split_programs(k, add, [params, h, mb, acc, lacc], want)
                else:
                    add(k, "last", functools.partial(_lowered, pr.last, params, h, mb, acc, lacc))
            add(k, "finish", functools.partial(_lowered, pr.finish, acc, lacc if k == self.K - 1 else []))
            if pr.spec.uses_batch:
                add(k, "split", functools.partial(_lowered, pr.split, self._batch_avals(k)))
            for r in range(1, self.prop.num_rounds + 1):
                rnd = self.rounds[(k, r)]
                add(k, f"update{r}", functools.partial(rnd.program.lower, *rnd.avals))
        return out

    def _add_split_programs(self, k: int, add: Callable[[int, str, Callable[[], jax.stages.Lowered]], None],
                            avals: list[list[jax.ShapeDtypeStruct]], want: set[str] | None) -> None:
        """A zero-bubble stage's B and W programs (`mpmd_split`): ``avals`` are the unsplit backward's (middle
        stage: params, stored, ct, acc) or the fused last program's (params, h, mb, acc, loss_acc)."""
        sp = self.split_programs[k]
        last = k == self.K - 1
        b_name, w_name = ("last_input", "last_weight") if last else ("input_grad", "weight_grad")
        if want is not None and not {b_name, w_name} & want:
            return
        b_prog = sp.last_input() if last else sp.input_grad()
        b_args = [avals[0], avals[1], avals[2], avals[4]] if last else avals[:3]
        low = b_prog.lower(*b_args)
        comp = low.compile()  # its output shardings are the stash's, which W reads
        add(k, b_name, lambda: low)
        stash = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                 for a, s in zip(low.out_info[-1], comp.output_shardings[-1])]
        split = sp.last() if last else sp.middle()
        g1, g2 = ("h", "mb") if last else ("stored", "ct")
        w_args = [avals[0], [avals[1][j] for j in split.reads("w", g1)], [avals[2][j] for j in split.reads("w", g2)],
                  avals[3], stash]
        w_prog = sp.last_weight() if last else sp.weight_grad()
        add(k, w_name, lambda: w_prog.lower(*w_args))

    def _batch_avals(self, k: int) -> list[jax.ShapeDtypeStruct]:
        sh = NamedSharding(self.meshes[k], P(DP_AXES))
        return [jax.ShapeDtypeStruct(shaped(v).shape, shaped(v).dtype, sharding=sh)
                for v, b in zip(self.rest_vars, self.info.is_batch) if b]

    def stage_summary(self) -> list[dict[str, object]]:
        """Per stage: layers, what it holds (embedding / head), its pieces' memory kinds."""
        out = []
        for k in range(self.K):
            kinds: dict[str, int] = {}
            for i in self.held[k]:
                lay = self.layouts[k][i]
                kinds[lay.role + ("@host" if lay.host else "")] = kinds.get(lay.role + ("@host" if lay.host else ""),
                                                                            0) + lay.nbytes_elems
            out.append({"stage": k, "group": self.group[k], "layers": self.plan.stages[k].layers,
                        "leaves": [self.infos[i] for i in self.held[k]], "elements": kinds})
        return out


def _leading_dim(batch: Batch) -> int:
    dims = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)}
    if not dims:
        raise PlanError("the batch has no array with a leading batch dimension")
    return max(dims)


__all__ = ["DispatchStats", "MpmdStep", "configure_cross_host_transfers"]
