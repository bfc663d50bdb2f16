"""Where a pipeline's state lives: the stages and their sub-meshes, and each state leaf's pieces and layouts.

Part of the pipeline's build step (`runtime.pipeline_program.build_pipeline`). `StageGrid` gives each (virtual)
stage its device group's sub-mesh and says whether this process runs it (`LocalStage`) or only takes part in its
transfers (`RemoteStage`); `place_leaves` decides, per state leaf, which stages hold a piece (stacked leaves by
layer rows, the others whole where the update's propagation puts them) and each piece's layout under the stage's
own one-stage plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import PyTreeDef

from mistjax.core.axes import Axes, AxisRules, apply_axis_rules, leaf_axes
from mistjax.core.layout import OPT, OTHER, PARAM, LeafLayout, LeafRole, plan_layouts
from mistjax.core.plan import Plan, PlanError
from mistjax.core.types import PyTree, State
from mistjax.runtime.leaves import LeafRoles, path_tokens, state_layouts, state_roles
from mistjax.runtime.mesh import RUNTIME_MESH_AXES, build_plan_mesh
from mistjax.runtime.mpmd_state import StagedInfo
from mistjax.runtime.mpmd_update import Propagation, Rows, Whole
from mistjax.trace.split import PartUsage, TracedLoss


class LocalStage(NamedTuple):
    """A (virtual) stage this process runs: it holds devices of the stage's sub-mesh."""

    stage: int  # the (virtual) stage
    group: int  # its device group
    mesh: Mesh


class RemoteStage(NamedTuple):
    """A stage another process runs: this process only takes part in the transfers it sends or receives."""

    stage: int  # the (virtual) stage
    group: int
    mesh: Mesh


Stage: TypeAlias = LocalStage | RemoteStage


@dataclass(frozen=True)
class StageGrid:
    """The plan mesh split into device groups, and each (virtual) stage on its group's sub-mesh.

    Attributes:
      mesh: the whole plan mesh.
      group_meshes: per device group, its sub-mesh (the runtime mesh with a size-1 stage axis).
      stages: per (virtual) stage, `LocalStage` or `RemoteStage`.
      meshes: per stage, its group's sub-mesh (one object for a group's chunks: ``is`` compares groups).
      group: per stage, its device group.
      replicated: per stage, the replicated sharding on its sub-mesh (what transfers of whole values target).
    """

    mesh: Mesh
    group_meshes: tuple[Mesh, ...]
    stages: tuple[Stage, ...]
    meshes: tuple[Mesh, ...]
    group: tuple[int, ...]
    replicated: tuple[NamedSharding, ...]

    @classmethod
    def of(cls, mesh: Mesh | Sequence[jax.Device] | None, plan: Plan) -> StageGrid:
        """The grid of ``plan`` on ``mesh`` (the devices, or None for all), as seen by this process."""
        full = build_plan_mesh(mesh, plan)
        groups = tuple(Mesh(full.devices[d: d + 1], RUNTIME_MESH_AXES, axis_types=full.axis_types)
                       for d in range(plan.device_stages))
        me = jax.process_index()
        # Compile-only devices (deviceless XLA:GPU compiles of a multi-host topology) belong to no running
        # process: this process lowers and compiles every stage's programs.
        compile_only = not set(full.devices.flat) & set(jax.devices())
        stages: list[Stage] = []
        for k, d in enumerate(plan.stage_groups):
            m = groups[d]
            local = compile_only or any(dev.process_index == me for dev in m.devices.flat)
            stages.append(LocalStage(k, d, m) if local else RemoteStage(k, d, m))
        meshes = tuple(s.mesh for s in stages)
        return cls(full, groups, tuple(stages), meshes, tuple(s.group for s in stages),
                   tuple(NamedSharding(m, P()) for m in meshes))

    def local(self, k: int) -> bool:
        """Whether this process runs stage ``k``."""
        return isinstance(self.stages[k], LocalStage)

    @property
    def K(self) -> int:
        """(Virtual) stages."""
        return len(self.stages)

    @property
    def S(self) -> int:
        """Device groups."""
        return len(self.group_meshes)


@dataclass(frozen=True)
class StageLeaves:
    """Every state leaf's pieces: which stages hold one, and its layout there.

    Attributes:
      grid: the stages.
      state_tree: the state's treedef.
      state_avals: per state leaf, its global aval.
      param_index: per loss parameter, its state leaf.
      axes: per state leaf, its logical axes (tensor splits the degree does not divide dropped).
      infos: per state leaf, the `StagedInfo` of its placed `StagedArray`.
      held: per stage, the state leaves it holds a piece of.
      layouts: per stage, each held leaf's layout.
      one_stage_plans: per stage, its one-stage plan (layers ``(0, n)``).
    """

    grid: StageGrid
    state_tree: PyTreeDef
    state_avals: tuple[jax.ShapeDtypeStruct, ...]
    param_index: tuple[int, ...]
    axes: tuple[Axes | None, ...]
    infos: tuple[StagedInfo, ...]
    held: tuple[list[int], ...]
    layouts: tuple[dict[int, LeafLayout], ...]
    one_stage_plans: tuple[Plan, ...]

    def piece_sharding(self, i: int, k: int) -> NamedSharding:
        """Storage sharding of state leaf `i`'s piece on stage `k`."""
        lay = self.layouts[k][i]
        return NamedSharding(self.grid.meshes[k], lay.spec(), memory_kind="pinned_host" if lay.host else None)

    def piece_aval(self, i: int, k: int) -> jax.ShapeDtypeStruct:
        """State leaf `i`'s piece on stage `k`, with its storage sharding."""
        lay = self.layouts[k][i]
        return jax.ShapeDtypeStruct(lay.shape, self.state_avals[i].dtype, sharding=self.piece_sharding(i, k))


class LeafContext(NamedTuple):
    """What `place_leaves` reads besides the plan and the propagation."""

    grid: StageGrid
    state_tree: PyTreeDef
    state_avals: tuple[jax.ShapeDtypeStruct, ...]
    param_index: tuple[int, ...]
    axes: tuple[Axes | None, ...]
    leaf_roles: LeafRoles | None  # an unrolled stack's roles (None for a scanned stack)


def param_layouts(num_params: int, stacked: set[int], usage: PartUsage, num_stages: int,
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


def layer_stages(plan: Plan, traced: TracedLoss) -> dict[int, int]:
    """Real parameter index -> the (virtual) stage holding its layer, for an unrolled stack's leaves."""
    if traced.groups is None:
        return {}
    stage_of = [k for k, sp in enumerate(plan.stages) for _ in range(*sp.layers)]
    return {r: stage_of[layer] for r, (_, layer) in traced.groups.members().items()}


def leaf_roles(traced: TracedLoss, abstract: State, params: PyTree, axis_rules: AxisRules | None,
               state_avals: Sequence[jax.ShapeDtypeStruct], param_index: Sequence[int],
               stacked: set[int]) -> LeafRoles:
    """Every state leaf's logical axes, as the one-stage runtime reads them (`runtime.leaves.state_roles`):
    the model's names (renamed by ``axis_rules``) or, without any, the tensor splits inferred from the layer
    (`analysis.tp_roles`), optimizer mirrors taking their parameter's; and, for an unrolled stack, which
    layer each leaf belongs to."""
    from mistjax.analysis.tp_roles import model_tensor_axes  # here, not at import: the package loads sympy

    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    tokens = [path_tokens(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    p_axes = model_tensor_axes(traced, params, axis_rules)
    index = list(param_index)
    return state_roles(paths, [tuple(x.shape) for x in state_avals],
                       apply_axis_rules(leaf_axes(abstract), axis_rules), dict(zip(index, tokens)),
                       index, stacked_params={index[j] for j in stacked},
                       param_axes=dict(zip(index, p_axes)), groups=traced.groups)


def tensor_layouts(plan: Plan, p_avals: Sequence[jax.ShapeDtypeStruct], stacked: set[int],
                   axes: Sequence[Axes | None]) -> list[LeafLayout]:
    """Global layouts of the parameters (their tensor-parallel dims, for the Megatron block)."""
    whole = Plan(stages=(dataclasses.replace(plan.stages[0], layers=(0, plan.num_layers)),),
                 micro_batch=plan.micro_batch, grad_accum=plan.grad_accum, dp=plan.dp, tp=plan.tp, cp=plan.cp,
                 cp_form=plan.cp_form, shard_group=plan.shard_group)
    return plan_layouts(list(p_avals), [PARAM] * len(p_avals), [j in stacked for j in range(len(p_avals))], whole,
                        list(axes))


def _staged_infos(ctx: LeafContext, plan: Plan, prop: Propagation, names: Sequence[str]) -> tuple[StagedInfo, ...]:
    """Per state leaf: which stages hold a piece (all, by rows, for a stacked leaf)."""
    infos = []
    K = ctx.grid.K
    for i, aval in enumerate(ctx.state_avals):
        lay = prop.state_layout_of(i)
        if isinstance(lay, Rows):
            if lay.dim != 0 or not aval.shape or aval.shape[0] != plan.num_layers:
                raise PlanError(f"state leaf {names[i]} is split by layers along dim {lay.dim}; a pipelined "
                                "plan keeps stacked leaves split along their leading layer dim")
            infos.append(StagedInfo(True, tuple(range(K)), tuple(aval.shape), np.dtype(aval.dtype).name,
                                    tuple(s.layers for s in plan.stages)))
        else:
            infos.append(StagedInfo(False, tuple(sorted(lay.stages)), tuple(aval.shape), np.dtype(aval.dtype).name))
    return tuple(infos)


def _stage_roles(ctx: LeafContext, held: list[int], roles: list[LeafRole], layers: tuple[int, int]) -> LeafRoles:
    """`LeafRoles` of the leaves a stage holds, its layers of an unrolled stack renumbered from 0."""
    full = ctx.leaf_roles
    assert full is not None  # (an unrolled stack's roles: `place_leaves` calls this only with them)
    layer_of = {pos: (key, layer - layers[0]) for pos, i in enumerate(held)
                for key, layer in [full.layer_of.get(i, (None, -1))] if key is not None}
    return LeafRoles(tuple(roles), (False,) * len(held), tuple(ctx.axes[i] for i in held), {}, layer_of,
                     layers[1] - layers[0])


def place_leaves(ctx: LeafContext, plan: Plan, prop: Propagation, names: Sequence[str]) -> StageLeaves:
    """Per state leaf: which stages hold a piece, and each piece's layout on its stage."""
    infos = _staged_infos(ctx, plan, prop, names)
    avals = ctx.state_avals
    param_of = {i: j for j, i in enumerate(ctx.param_index)}
    held_all, layouts, plans = [], [], []
    for k, sp in enumerate(plan.stages):
        held = [i for i, inf in enumerate(infos) if k in inf.stages]
        n = sp.layers[1] - sp.layers[0]
        local = [jax.ShapeDtypeStruct((n, *avals[i].shape[1:]) if infos[i].rows else avals[i].shape, avals[i].dtype)
                 for i in held]
        # Optimizer state: leaves with logical axes (Flax / optax mirrors) or placed like a parameter
        # by the update's propagation (plain pytrees); counters and other replicated leaves are "other".
        roles = [PARAM if i in param_of else OPT if ctx.axes[i] is not None or prop.state_layout[i] !=
                 Whole(prop.ALL) else OTHER for i in held]
        one = Plan(stages=(dataclasses.replace(sp, layers=(0, n)),), micro_batch=plan.micro_batch,
                   grad_accum=plan.grad_accum, dp=plan.dp, tp=plan.tp, cp=plan.cp, cp_form=plan.cp_form,
                   shard_group=plan.shard_group)
        # An offload ratio that moves nothing on this stage warns with the stage's report (`applied_report`).
        if ctx.leaf_roles is None:
            lays = plan_layouts(local, roles, [infos[i].rows for i in held], one, [ctx.axes[i] for i in held])
        else:  # an unrolled stack: the stage's layer leaves laid out as one stacked leaf per place
            lays = state_layouts(local, _stage_roles(ctx, held, roles, sp.layers), one)
        held_all.append(held)
        layouts.append(dict(zip(held, lays)))
        plans.append(one)
    return StageLeaves(ctx.grid, ctx.state_tree, ctx.state_avals, ctx.param_index, ctx.axes, infos, tuple(held_all),
                       tuple(layouts), tuple(plans))


__all__ = ["LeafContext", "LocalStage", "RemoteStage", "Stage", "StageGrid", "StageLeaves", "layer_stages",
           "leaf_roles", "param_layouts", "place_leaves", "tensor_layouts"]
