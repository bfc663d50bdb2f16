"""`ShardedStep`: the user's train step, compiled and run the way a plan says."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, cast, runtime_checkable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core.axes import AxisRules, apply_axis_rules, is_stacked, leaf_axes
from mistjax.core.execution import ExecutionPlan
from mistjax.core.layout import (
    OPT,
    OTHER,
    PARAM,
    LeafLayout,
    plan_layouts,
    state_shardings,
)
from mistjax.core.plan import Plan, PlanError, params_fingerprint
from mistjax.core.types import Batch, LossFn, Metrics, PyTree, State, TrainStep
from mistjax.runtime import fit, xla_flags
from mistjax.runtime.checks import (
    TokenRange,
    check_shapes,
    check_tokens,
    token_ranges,
)
from mistjax.runtime.context import use_handler
from mistjax.runtime.grads import regather_updated_params, sharded_value_and_grad
from mistjax.runtime.leaves import LeafRoles, path_tokens, state_layouts, state_roles, tensor_split_axes
from mistjax.runtime.mesh import batch_shardings, build_plan_mesh
from mistjax.runtime.mpmd import MpmdStep
from mistjax.runtime.report import (
    AppliedReport,
    PipelineReport,
    applied_report,
    grad_accumulators_on_host,
    itemsizes,
)
from mistjax.runtime.tracing import trace_train_step
from mistjax.trace.split import checkpoint_names, trace_loss


@dataclass
class _Call:
    fun: LossFn
    has_aux: bool
    args: tuple[PyTree, ...]


class _Probe:
    """Records the `mistjax.value_and_grad` calls of a step while it is traced abstractly."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []

    def value_and_grad(self, fun: LossFn, has_aux: bool, args: tuple[PyTree, ...]) -> PyTree:
        # A snapshot: NNX states hold Variables that the step may update in place afterwards
        # (optimizer.update), which would swap the recorded leaves for the updated ones.
        flat, tree = jax.tree.flatten(args)
        self.calls.append(_Call(fun, has_aux, jax.tree.unflatten(tree, flat)))
        return jax.value_and_grad(fun, has_aux=has_aux)(*args)


@dataclass(frozen=True)
class LossCall:
    """The loss a step differentiates with `mistjax.value_and_grad`, as seen while tracing it."""

    fun: LossFn  # the loss function
    has_aux: bool  # it returns (loss, aux)
    args: tuple[PyTree, ...]  # its arguments as ShapeDtypeStructs (parameters first, metadata kept)


@dataclass(frozen=True)
class StepAnalysis:
    """What tracing the step once abstractly tells the runtime."""

    roles: tuple[str, ...]  # per state leaf: param / opt / other
    stacked: tuple[bool, ...]  # per state leaf: holds the layer stack on its leading dim
    num_layers: int | None  # layers in the model's stack, if it has one
    uses_mistjax_grad: bool  # the step calls mistjax.value_and_grad / grad
    params_fingerprint: str = ""  # `mistjax.plan.params_fingerprint` of the differentiated parameters
    loss: LossCall | None = None  # the differentiated loss (None for a step using plain jax.grad)
    leaves: LeafRoles | None = None  # axes, optimizer mirrors and unrolled-layer membership per state leaf
    unrolled: bool = False  # the layer stack is unrolled (a block repeated in the jaxpr, not a scan)
    checkpoint_tags: tuple[str, ...] = ()  # checkpoint_name tags of one layer (what activation offload moves)
    token_ranges: tuple[TokenRange, ...] = ()  # batch leaves that index an embedding (checked per call)


def analyze_step(train_step: TrainStep, state: State, batch: Batch, axis_rules: AxisRules | None = None
                 ) -> StepAnalysis:
    """Trace `train_step` abstractly and classify every state leaf (`mistjax.runtime.leaves`).

    ``axis_rules``: MaxText-style logical-axis rules (`mistjax.core.axes.apply_axis_rules`); without any
    weight naming a tensor-split axis, Megatron's splits are inferred (`mistjax.analysis.tp_roles`).
    """
    s_paths, s_leaves = zip(*jax.tree_util.tree_flatten_with_path(state)[0]) if jax.tree.leaves(state) else ((), ())
    probe = _Probe()
    trace = trace_train_step(train_step, state, batch, probe)
    inputs, batch_in = trace.state_inputs, trace.batch_inputs
    axes = leaf_axes(state)
    shapes = [tuple(np.shape(x)) for x in s_leaves]
    if not probe.calls:
        # A step using plain jax.grad: parameters are the leaves under a `params` field.
        params = {i: path_tokens(p[1:]) for i, p in enumerate(s_paths)
                  if p and getattr(p[0], "name", getattr(p[0], "key", None)) == "params"}
        info = state_roles(s_paths, shapes, axes, params, sorted(params),
                           stacked_params={i for i in params if is_stacked(axes[i])})
        return StepAnalysis(info.roles, info.stacked, None, False, "", None, info)
    call = probe.calls[0]
    where = {id(x): i for i, x in enumerate(inputs)}
    loss = LossCall(call.fun, call.has_aux,
                    tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), call.args)))
    traced = trace_loss(call.fun, *loss.args)
    p_paths = [path_tokens(p) for p, _ in jax.tree_util.tree_flatten_with_path(call.args[0])[0]]
    order = [where.get(id(leaf)) for leaf in jax.tree.leaves(call.args[0])]
    params = {i: toks for i, toks in zip(order, p_paths) if i is not None}
    stack = traced.stack
    stacked: set[int] = set()
    if stack is not None and traced.groups is None:
        stacked = {i for j in stack.stacked_leaves if (i := order[j]) is not None}
    groups = traced.groups if None not in order else None
    from mistjax.analysis.tp_roles import model_tensor_axes  # here, not at import: the package loads sympy

    p_axes = model_tensor_axes(traced, loss.args[0], axis_rules)
    info = state_roles(s_paths, shapes, apply_axis_rules(axes, axis_rules), params,
                       [i if i is not None else -1 for i in order], stacked_params=stacked, groups=groups,
                       param_axes={i: ax for i, ax in zip(order, p_axes) if i is not None})
    where_b = {id(x): i for i, x in enumerate(batch_in)}
    rest_to_batch = [where_b.get(id(x)) for x in jax.tree.leaves(call.args[1:])]
    return StepAnalysis(info.roles, info.stacked, stack.num_layers if stack is not None else None, True,
                        params_fingerprint(call.args[0]), loss, info, traced.groups is not None,
                        checkpoint_names(stack.body) if stack is not None else (),
                        tuple(token_ranges(traced, rest_to_batch, batch)))


CompiledPrograms: TypeAlias = dict[tuple[int, str], jax.stages.Compiled | jax.stages.Lowered]
"""``{(stage, phase): program}``: what `ShardedStep.compile_stages` gives (``(0, "step")`` for one stage)."""


@runtime_checkable
class PlannedStep(Protocol):
    """The step object `mistjax.autoshard` returns, whatever the plan (one stage or a pipeline).

    `ShardedStep` (a given plan) and `mistjax.api.tuned_step.AutoShardedStep` (tuned on first use) both
    have this surface; docs/guide.md shows it.
    """

    @property
    def plan(self) -> Plan: ...

    @property
    def execution(self) -> ExecutionPlan | None: ...

    @property
    def applied(self) -> AppliedReport | PipelineReport | None: ...

    def place(self, state: State, batch: Batch | None = None) -> State: ...

    def gather(self, state: State) -> State: ...

    def compile_stages(self, state: State, batch: Batch, phases: Sequence[str] | None = None, *,
                       compile: bool = True) -> CompiledPrograms: ...

    def lower(self, state: State, batch: Batch) -> jax.stages.Lowered: ...

    def report(self) -> str: ...

    def summary(self) -> str: ...

    def batch_shardings(self, batch: Batch) -> PyTree: ...

    def place_batch(self, batch: Batch) -> Batch: ...

    def __call__(self, state: State, batch: Batch) -> tuple[State, Metrics]: ...


class _Runtime:
    """The grad handler active while the compiled step is traced."""

    def __init__(self, step: ShardedStep, layouts: list[LeafLayout]) -> None:
        self.step, self.layouts = step, layouts
        self.by_id: dict[int, tuple[LeafLayout, jax.Array | None]] = {}

    def bind(self, leaves: list[jax.Array], host_originals: list[jax.Array | None]) -> None:
        """Map the leaves the step sees to their layouts (and host-resident originals, if offloaded)."""
        self.by_id = {id(x): (lay, orig) for x, lay, orig in zip(leaves, self.layouts, host_originals)}

    def _record(self, execution: ExecutionPlan) -> None:
        """Keep how the traced step runs (`core.execution`) on the step and in its applied report."""
        self.step.traced_execution = execution
        applied = self.step.applied
        if applied is not None:
            assert isinstance(applied, AppliedReport)  # (the grad handler runs one-stage steps only)
            self.step.applied = dataclasses.replace(applied, execution=execution.stages[0])

    def value_and_grad(self, fun: LossFn, has_aux: bool, args: tuple[PyTree, ...]) -> PyTree:
        params, rest = args[0], args[1:]
        layouts, leaves = [], []
        for leaf in jax.tree.leaves(params):
            lay, orig = self.by_id.get(id(leaf), (None, None))
            if lay is None or lay.role != PARAM:
                raise PlanError("mistjax.value_and_grad must differentiate the parameters as they come "
                                "from the train state (state.params), not a transformed copy")
            layouts.append(lay)
            leaves.append(leaf if orig is None else orig)  # offloaded weights stream in per layer
        params = jax.tree.unflatten(jax.tree.structure(params), leaves)
        return sharded_value_and_grad(fun, has_aux, params, rest, plan=self.step.plan, mesh=self.step.mesh,
                                      layouts=layouts, global_batch=self.step.plan.global_batch,
                                      on_execution=self._record)


class ShardedStep:
    """A train step bound to a plan and a mesh (see `mistjax.autoshard`).

    Plans with several stages run on the MPMD pipeline executor (`mistjax.runtime.mpmd`): the placed
    state is then the user's structure with `StagedArray` leaves (per-stage pieces), `gather` turns it
    back into whole arrays, and `compile_stages` gives each stage's programs for inspection. The same
    methods work on a one-stage plan (`gather` fetches the arrays, `compile_stages` gives its one program),
    and `report` / `summary` list what each knob did, per stage for a pipeline.
    """

    def __init__(self, train_step: TrainStep, mesh: Mesh | Sequence[jax.Device] | None, plan: Plan,
                 axis_rules: AxisRules | None = None) -> None:
        self.train_step = train_step
        self.plan = plan
        self.axis_rules = axis_rules
        self.mesh = build_plan_mesh(mesh, plan)
        self._mpmd: MpmdStep | None = MpmdStep(train_step, mesh, plan, axis_rules) if plan.num_stages > 1 else None
        self.layouts: list[LeafLayout] | None = None
        self.analysis: StepAnalysis | None = None
        self._applied: AppliedReport | None = None  # what each knob did, once a one-stage step is set up
        self.fit: fit.FitReport | None = None  # the memory check before the first step (`verify_memory`)
        self.traced_execution: ExecutionPlan | None = None  # a one-stage step's, once its program is traced
        self._jitted: jax.stages.Wrapped | None = None
        self._state_tree: jax.tree_util.PyTreeDef | None = None

    # ---------------------------------------------------------------- setup
    def _setup(self, state: State, batch: Batch) -> None:
        self.analysis = analyze_step(self.train_step, state, batch, self.axis_rules)
        if self.analysis.params_fingerprint:
            self.plan.check_model(self.analysis.params_fingerprint)
        if self.analysis.num_layers is not None:
            self.plan.check_layers(self.analysis.num_layers)
        elif self.plan.num_stages > 1:
            raise PlanError("the plan pipelines the model, but its loss has no scan over stacked layer "
                            "parameters; use a plan with one stage")
        needs_grad_hook = (self.plan.grad_accum > 1 or self.plan.num_stages > 1 or
                           any(s.remat_layers for s in self.plan.stages))
        if needs_grad_hook and not self.analysis.uses_mistjax_grad:
            raise PlanError("this plan accumulates micro-batches, pipelines or checkpoints layers, which "
                            "needs the step to compute gradients with mistjax.value_and_grad / mistjax.grad")
        leaves, self._state_tree = jax.tree.flatten(state)
        assert self.analysis.leaves is not None  # `analyze_step` classifies every state leaf
        self.layouts = state_layouts(leaves, self.analysis.leaves, self.plan)
        if self.plan.tp > 1 and not any(lay.tensor_dims for lay in self.layouts if lay.role == PARAM):
            raise PlanError(
                f"the plan has tensor parallelism tp={self.plan.tp}, but no weight of this model can be split: none "
                "names a tensor-split logical axis (heads, kv_heads, mlp, vocab) and no Megatron column/row pair "
                "was found in its layer; use a plan with tp=1, or name the axes (nnx.with_partitioning / "
                "nn.with_logical_partitioning, or autoshard(..., axis_rules=[('mlp', 'tensor'), ...]))")
        uses_grad = self.analysis.uses_mistjax_grad
        self._applied = applied_report(self.layouts, itemsizes(leaves), self.plan,
                                       num_layers=self.analysis.num_layers, uses_mistjax_grad=uses_grad,
                                       checkpoint_tags=self.analysis.checkpoint_tags,
                                       grads_on_host=grad_accumulators_on_host(self.layouts, self.plan, uses_grad))
        self._build()

    def _batch_shardings(self, batch: Batch) -> PyTree:
        return batch_shardings(self.mesh, batch, self.plan.global_batch)

    def _build(self) -> None:
        assert self.layouts is not None
        layouts = self.layouts
        runtime = _Runtime(self, layouts)
        st_sh = state_shardings(self.layouts, self._state_tree, self.mesh)
        self._state_shardings = st_sh

        def step_fn(state: State, batch: Batch) -> tuple[State, Metrics]:
            # Host-resident (offloaded) leaves get a device copy for the optimizer update; XLA moves it
            # in where the update needs it. The layer loop streams offloaded weights from the host copy.
            leaves, tree = jax.tree.flatten(state)
            device_leaves = [jax.device_put(x, jax.memory.Space.Device) if lay.host else x
                             for x, lay in zip(leaves, layouts)]
            runtime.bind(device_leaves, [x if lay.host else None for x, lay in zip(leaves, layouts)])
            with use_handler(runtime):
                new_state, metrics = self.train_step(jax.tree.unflatten(tree, device_leaves), batch)
            new_leaves, new_tree = jax.tree.flatten(new_state)
            # The state keeps its structure (out_shardings require it anyway). (jaxlib ships no stub for
            # PyTreeDef: mypy sees an unresolved type without __eq__.)
            if new_tree == tree:  # type: ignore[operator]
                new_state = jax.tree.unflatten(new_tree, regather_updated_params(
                    new_leaves, device_leaves, layouts, self.plan, self.mesh))
            return new_state, metrics

        self._step_fn = step_fn
        self._jitted = jax.jit(step_fn, out_shardings=(st_sh, NamedSharding(self.mesh, P())), donate_argnums=(0,),
                               compiler_options=xla_flags.compiler_options(self.mesh.devices.flat[0].platform))

    def _ensure(self, state: State, batch: Batch) -> None:
        first = self._jitted is None
        if first or _leading_dim(batch) != self.plan.global_batch:
            self.plan.check_batch(_leading_dim(batch))
        if first:
            self._setup(state, batch)
        self._batch_shapes = check_shapes(getattr(self, "_batch_shapes", None), batch)
        if self.analysis is not None:
            check_tokens(self.analysis.token_ranges, batch, device_arrays=first)

    # ---------------------------------------------------------------- public API
    def place(self, state: State, batch: Batch | None = None) -> State:
        """Put `state` on the plan mesh with the plan's storage shardings (ZeRO, TP, offload).

        The layout comes from tracing the step, which needs a batch (or its shapes); without one,
        the layout is derived once the first batch arrives and `place` uses the state's `params`
        field to find the parameters. A pipelined plan needs the batch (its stages' placement comes
        from splitting the step) and returns `StagedArray` leaves.
        """
        if self._mpmd is not None:
            if batch is None:
                raise PlanError("placing the state of a pipelined plan needs a batch (or its shapes): "
                                "step.place(state, batch)")
            self.plan.check_batch(_leading_dim(batch))
            return self._mpmd.place(state, batch)
        if self.layouts is None:
            if batch is None:
                leaves, tree = jax.tree.flatten(state)
                analysis = StepAnalysis(*_path_roles(state), None, True)
                axes = tensor_split_axes(leaf_axes(state), [np.shape(x) for x in leaves], self.plan.tp)
                layouts = plan_layouts(leaves, list(analysis.roles), list(analysis.stacked), self.plan, axes)
                return jax.device_put(state, state_shardings(layouts, tree, self.mesh))
            self._ensure(state, batch)
        return jax.device_put(state, self._state_shardings)

    @property
    def execution(self) -> ExecutionPlan | None:
        """How the plan runs (`core.execution.ExecutionPlan`): a pipeline's once it is set up (placed, called or
        compiled), a one-stage step's once its program is traced (first call or `lower`); None before."""
        return self._mpmd.execution if self._mpmd is not None else self.traced_execution

    @property
    def applied(self) -> AppliedReport | PipelineReport | None:
        """What each knob did, once placed (or first called): an `AppliedReport`, or for a pipelined plan a
        `PipelineReport` with one per stage (`mistjax.runtime.report`)."""
        return self._mpmd.applied if self._mpmd is not None else self._applied

    @applied.setter
    def applied(self, report: AppliedReport | None) -> None:
        # A one-stage step's report is completed once its program is traced (the grad handler records how
        # it runs); a pipeline's is its executor's (`MpmdStep.applied`, per stage).
        if self._mpmd is not None:
            raise AttributeError("a pipelined plan's report is its executor's (MpmdStep.applied, per stage)")
        self._applied = report

    def report(self) -> str:
        """What each knob of the plan did to this step (after `place(state, batch)` or the first call); per
        stage for a pipelined plan."""
        if self.applied is None:
            raise PlanError("nothing placed yet: call step.place(state, batch) or step(state, batch) first")
        return self.applied.summary()

    def summary(self) -> str:
        """The plan's summary, followed by what was applied once the step is placed and the memory check."""
        return (self.plan.summary() + ("\n" + self.applied.summary() if self.applied is not None else "")
                + ("\n" + self.fit.summary() if self.fit is not None and self.fit.checked else ""))

    def verify_memory(self, state: State, batch: Batch) -> State:
        """Check that the compiled plan fits every local device's free memory (`mistjax.runtime.fit`).

        The first ``step(state, batch)`` calls it before running. Where no device reports a memory limit
        (the CPU) nothing is checked or compiled early.

        Returns:
            The state, placed (returned as is where nothing was checked).
        Raises:
            PlanDoesNotFit: a stage needs more than its device has free; the error names the stage, the
                bytes and the plan knobs that would lower them.
        """
        if not fit.capacities(self.mesh.devices.flat):
            self.fit = fit.FitReport()
            return state
        if self._mpmd is not None:
            self.plan.check_batch(_leading_dim(batch))
            state = self._mpmd.place(state, batch)
            compiled_stages = cast(dict[tuple[int, str], jax.stages.Compiled],
                                   self._mpmd.compile_stages(state, batch))  # (compile=True: all compiled)
            report = fit.check_pipeline(self._mpmd, compiled_stages, state)
        else:
            self._ensure(state, batch)
            state = jax.device_put(state, self._state_shardings)
            placed = self.place_batch(batch)
            compiled = self._program().lower(state, placed).compile()
            report = fit.check_single(self.plan, compiled, self.mesh.devices.flat, (state, placed))
        fit.raise_if_misfit(report, self.plan)  # unchanged `self.fit`: the next call checks again
        self.fit = report
        return state

    def batch_shardings(self, batch: Batch) -> PyTree:
        """The shardings `__call__` expects for `batch` (for building global arrays per process)."""
        if self._mpmd is not None:
            return self._mpmd.batch_shardings(batch)
        return self._batch_shardings(batch)

    def place_batch(self, batch: Batch) -> Batch:
        """Shard a global batch over the plan's data-parallel axes."""
        return jax.device_put(batch, self.batch_shardings(batch))

    def gather(self, state: State) -> State:
        """A placed state as the user's structure with whole host arrays (pipelined plans' `StagedArray`
        leaves reassembled); other leaves are fetched with ``jax.device_get``."""
        if self._mpmd is not None:
            return self._mpmd.gather(state)
        return jax.device_get(state)

    def compile_stages(self, state: State, batch: Batch, phases: Sequence[str] | None = None, *,
                       compile: bool = True) -> CompiledPrograms:
        """Every program of the plan, compiled: ``{(stage, phase): jax.stages.Compiled}``.

        A pipelined plan runs one program per (stage, phase) (see `MpmdStep.compile_stages` for the
        phases); a one-stage plan runs one program, ``{(0, "step"): compiled}`` (``lower(state,
        batch).compile()``). Each has its own ``memory_analysis()`` and ``as_text()``.

        Args:
            state: the state (or its ``jax.ShapeDtypeStruct``s; a placed state for a pipeline is fine).
            batch: a batch (or its shapes).
            phases: only these phases (e.g. ``["forward", "backward"]``, or ``["step"]``); None: all.
            compile: False gives the ``jax.stages.Lowered`` programs instead.
        """
        self.plan.check_batch(_leading_dim(batch))
        if self._mpmd is not None:
            return self._mpmd.compile_stages(state, batch, phases, compile=compile)
        if phases is not None and "step" not in phases:
            return {}
        lowered = self.lower(state, batch)
        return {(0, "step"): lowered.compile() if compile else lowered}

    def lower(self, state: State, batch: Batch) -> jax.stages.Lowered:
        """Lower the compiled step for inspection (``.compile().as_text()``, ``memory_analysis()``)."""
        if self._mpmd is not None:
            raise PlanError("a pipelined plan runs one program per (stage, phase), not one program; inspect "
                            "them with step.compile_stages(state, batch) (compile=False for the lowered ones)")
        self._ensure(state, batch)
        state_in = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), state,
                                self._state_shardings)
        batch_in = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), batch,
                                self._batch_shardings(batch))
        return self._program().lower(state_in, batch_in)

    def __call__(self, state: State, batch: Batch) -> tuple[State, Metrics]:
        if self.fit is None:
            state = self.verify_memory(state, batch)
        if self._mpmd is not None:
            return self._mpmd(state, batch)
        self._ensure(state, batch)
        state = jax.device_put(state, self._state_shardings)
        return self._program()(state, self.place_batch(batch))

    def _program(self) -> jax.stages.Wrapped:
        """The one-stage step's jitted program (built by `_ensure`)."""
        assert self._jitted is not None, "_ensure builds the program first"
        return self._jitted


def _leading_dim(batch: Batch) -> int:
    dims = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)}
    if not dims:
        raise PlanError("the batch has no array with a leading batch dimension")
    return max(dims)


def _path_roles(state: State) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    axes = leaf_axes(state)
    roles, stacked = [], []
    for (path, _), ax in zip(jax.tree_util.tree_flatten_with_path(state)[0], axes):
        head = getattr(path[0], "name", getattr(path[0], "key", None)) if path else None
        roles.append(PARAM if head == "params" else OPT if ax is not None else OTHER)
        stacked.append(is_stacked(ax))
    return tuple(roles), tuple(stacked)
