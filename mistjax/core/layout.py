"""Map a plan onto the leaves of a train state: tensor-parallel dims, ZeRO/MiCS shard dims.

Every array leaf of the state gets a `LeafLayout`: which dims are split over ``tensor``
(Megatron column/row parallelism, read from the logical axis names the model attached to its
parameters) and which dim, if any, is split over the ZeRO / MiCS partition group (the plan's
``shard`` axis; on the runtime mesh the pair `SHARD_SPEC` of intra- and inter-node parts). Storage
sharding (how a leaf lives between steps) and compute sharding (how it is used inside a layer)
differ, as in Levanter: a ZeRO-3 parameter is stored sharded and gathered per layer.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import PyTreeDef

from mistjax.core.plan import Plan, PlanError
from mistjax.core.types import PyTree

if TYPE_CHECKING:  # annotations only: mistjax.core.axes loads Flax
    from mistjax.core.axes import Axes

# The plan's `shard` axis as (inter-node, intra-node) mesh axes, node-major like the devices.
SHARD_AXES = ("shard_node", "shard_local")
# How a ZeRO/MiCS-split dim names them: local-major, so device (n, l) of m nodes holds chunk
# l * m + n. Then gathering over `shard_node` and then `shard_local` (both tiled) yields the chunks
# in order with no re-layout (MiCS digest 8.5), and the reduce-scatter is the mirror. A node-major
# spec would need a reshape/transpose between the phases, and GSPMD answers that (with tensor
# parallelism) with an extra `tensor` all-gather per phase. With one node both orders are the same.
SHARD_SPEC = ("shard_local", "shard_node")
# The runtime mesh: the plan mesh axes with `shard` split in two (`mistjax.runtime.mesh`).
# `context` (context parallelism: the sequence split) sits between the data-parallel axes and `tensor`, so a
# CP x TP group is consecutive devices (inside a node when it fits).
CONTEXT_AXIS = "context"
RUNTIME_MESH_AXES = ("stage", "replica", *SHARD_AXES, CONTEXT_AXIS, "tensor")

# Logical axis names split over the `tensor` mesh axis (Megatron: attention heads, MLP hidden,
# vocabulary); everything else (embed, head_dim, layers, ...) stays whole under TP.
TENSOR_AXES = ("heads", "kv_heads", "mlp", "vocab")
# Which non-tensor dim ZeRO prefers to split, in order (largest such dim wins a tie).
SHARD_PREFERENCE = ("embed", "mlp", "vocab", "heads", "kv_heads", "head_dim")
# Data-parallel axes, major first: a batch split over them puts rows on devices in the same order
# as the plan's flat (replica, shard) axes.
DP_AXES = ("replica", *SHARD_AXES)


class LeafRole(enum.StrEnum):
    """What a state leaf is to the plan: the ZeRO stage shards parameters and optimizer state differently.

    A `str` enum, so a role compares equal to its value (``LeafRole.PARAM == "param"``) and formats as it.
    """

    PARAM = "param"  # a parameter (ZeRO-3 shards it; weight offload moves it)
    OPT = "opt"  # optimizer state mirroring a parameter (ZeRO >= 1 shards it; optimizer offload moves it)
    OTHER = "other"  # anything else (step counters, scalars): replicated


PARAM, OPT, OTHER = LeafRole.PARAM, LeafRole.OPT, LeafRole.OTHER


class Shaped(Protocol):
    """A leaf as far as its layout goes: an array, a ``jax.ShapeDtypeStruct`` or an abstract value."""

    @property
    def shape(self) -> tuple[int, ...]: ...


# One entry of a PartitionSpec: a mesh axis, several (split over their product), or None (whole).
_SpecEntry = str | tuple[str, ...] | None


@dataclass(frozen=True)
class LeafLayout:
    """How one state leaf is laid out on the plan mesh."""

    role: LeafRole  # parameter, optimizer state mirroring a parameter, or other
    shape: tuple[int, ...]  # global shape
    axes: Axes | None  # logical axis names, if the model provided them
    tensor_dims: tuple[int, ...]  # dims split over the `tensor` axis
    shard_dim: int | None  # dim split over SHARD_SPEC when the plan shards this leaf (ZeRO / MiCS)
    stacked: bool  # leading dim is the layer stack
    sharded: bool  # stored sharded over SHARD_SPEC (ZeRO-3 param or ZeRO-1 optimizer state)
    host: bool = False  # stored in host memory (offloaded)
    stage_split: bool = False  # the layer dim is split over `stage` (pipelined plans, even layer blocks)
    layer_slice: bool = False  # one layer's leaf of an unrolled stack (laid out as a slice of a stacked leaf)
    # The shard dim is split over `context` too (optimizer state under context parallelism, and ZeRO-3 weights:
    # sharded over the data x context group, as Megatron-LM's distributed optimizer does; ZeRO-1 / 2 weights stay
    # replicated over `context`).
    context_split: bool = False

    def __post_init__(self) -> None:
        # Callers may name the role by its string; the field always holds the member (ValueError if unknown).
        object.__setattr__(self, "role", LeafRole(self.role))

    def spec(self, *, storage: bool = True) -> P:
        """PartitionSpec: storage layout, or the compute layout (no ZeRO split) if not `storage`."""
        entries: list[_SpecEntry] = [None] * len(self.shape)
        for d in self.tensor_dims:
            entries[d] = "tensor"
        if storage and self.stage_split:
            entries[0] = "stage"
        if storage and self.sharded and self.shard_dim is not None:
            inner = entries[self.shard_dim]
            assert not isinstance(inner, tuple)  # only "tensor" / "stage" (single names) are set above
            split = (*SHARD_SPEC, CONTEXT_AXIS) if self.context_split else SHARD_SPEC
            entries[self.shard_dim] = split if inner is None else (*split, inner)
        return P(*entries)

    def manual_spec(self, *, sharded: bool | None = None) -> P:
        """The part of the spec over the manual (data-parallel) axes, for shard_map in/out specs."""
        sharded = self.sharded if sharded is None else sharded
        if not sharded or self.shard_dim is None:
            return P()
        return P(*([None] * self.shard_dim + [SHARD_SPEC]))

    @property
    def nbytes_elems(self) -> int:
        return int(np.prod(self.shape))


def choose_shard_dim(shape: tuple[int, ...], axes: Axes | None, tensor_dims: tuple[int, ...],
                     stacked: bool, group: int, tp: int) -> int | None:
    """The dim ZeRO / MiCS splits `group` ways, or None if no dim divides evenly."""
    if group <= 1:
        return None
    candidates = []
    for d, size in enumerate(shape):
        if stacked and d == 0:
            continue
        local = size // tp if d in tensor_dims else size
        if d in tensor_dims or local % group:
            continue
        name = axes[d] if axes else None
        rank = SHARD_PREFERENCE.index(name) if name in SHARD_PREFERENCE else len(SHARD_PREFERENCE)
        candidates.append((rank, -size, d))
    return min(candidates)[2] if candidates else None


def context_shards(plan: Plan) -> int:
    """Devices of the `context` axis the optimizer state is split over besides the ZeRO / MiCS group: ``cp``
    with ZeRO >= 1 under context parallelism, else 1."""
    return plan.cp if plan.cp > 1 and plan.stages[0].shard_opt else 1


def shard_split(shape: tuple[int, ...], axes: Axes | None, tensor_dims: tuple[int, ...], stacked: bool,
                plan: Plan) -> tuple[int | None, bool]:
    """(the dim ZeRO / MiCS splits, whether the optimizer state splits it over `context` too): a dim the
    ``shard_group x cp`` group divides where `context_shards` says so and one exists, else
    `choose_shard_dim` over the group alone."""
    ctx = context_shards(plan)
    both = choose_shard_dim(shape, axes, tensor_dims, stacked, plan.shard_group * ctx, plan.tp) if ctx > 1 else None
    if both is not None:
        return both, True
    return choose_shard_dim(shape, axes, tensor_dims, stacked, plan.shard_group, plan.tp), False


def select_offload(sizes: list[int], ratio: float) -> list[bool]:
    """Which leaves to keep in host memory so that about `ratio` of the bytes are offloaded.

    Whole leaves move (a stacked leaf holds every layer's copy of one weight), largest first, while
    the offloaded total stays within ``ratio`` of all bytes (plus half the smallest leaf, so that
    ratio 1 takes everything). The cost model uses this same selection, so it charges exactly the
    fraction the runtime achieves.
    """
    chosen = [False] * len(sizes)
    if ratio <= 0 or not sizes:
        return chosen
    budget = ratio * sum(sizes) + 0.5 * min(sizes)
    used = 0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if used + sizes[i] <= budget:
            chosen[i] = True
            used += sizes[i]
    return chosen


def plan_layouts(leaves: Sequence[Shaped], roles: Sequence[LeafRole | str], stacked_flags: Sequence[bool],
                 plan: Plan, axes: Sequence[Axes | None]) -> list[LeafLayout]:
    """Lay out every state leaf under `plan` (stage 0's ZeRO flags for now: DP is uniform).

    Raises:
        ValueError: a role that is not a `LeafRole` value.
        PlanError: the tensor-parallel degree does not divide a tensor-split dim.
    """
    stage = plan.stages[0]
    layouts = []
    for leaf, name, stacked, ax in zip(leaves, roles, stacked_flags, axes):
        role = LeafRole(name)
        shape = tuple(np.shape(leaf))
        tensor_dims: tuple[int, ...] = ()
        if plan.tp > 1 and ax is not None and len(ax) == len(shape):
            tensor_dims = tuple(d for d, name in enumerate(ax) if name in TENSOR_AXES)
            for d in tensor_dims:
                if shape[d] % plan.tp:
                    raise PlanError(
                        f"tensor parallelism {plan.tp} does not divide dim {d} ({ax[d]}={shape[d]}) of a "
                        f"parameter of shape {shape}; choose tp dividing the number of heads, kv heads, "
                        "MLP width and vocabulary")
        sharded = (role == PARAM and stage.shard_weights) or (role == OPT and stage.shard_opt)
        big = len(shape) > 0 and int(np.prod(shape)) > 1
        shard_dim, context_split = shard_split(shape, ax, tensor_dims, stacked, plan) if big else (None, False)
        if role != OPT and plan.shard_group == 1:
            shard_dim = None  # a dim chosen for the optimizer state's context split: no partition group to use it
        layouts.append(LeafLayout(role=role, shape=shape, axes=ax, tensor_dims=tensor_dims, shard_dim=shard_dim,
                                  stacked=stacked, sharded=sharded and shard_dim is not None,
                                  stage_split=stacked and plan.num_stages > 1 and shape[0] % plan.num_stages == 0,
                                  context_split=context_split and sharded and role in (OPT, PARAM)))
    # Offload: optimizer state by `offload_opt`, stacked (per-layer streamed) weights by `offload_weights`.
    for role, ratio, want in ((OPT, stage.offload_opt, lambda lay: True),
                              (PARAM, stage.offload_weights, lambda lay: lay.stacked)):
        idx = [i for i, lay in enumerate(layouts) if lay.role == role and want(lay) and lay.nbytes_elems > 1]
        for i, host in zip(idx, select_offload([layouts[i].nbytes_elems for i in idx], ratio)):
            if host:
                layouts[i] = dataclasses.replace(layouts[i], host=True)
    return layouts


def state_shardings(layouts: list[LeafLayout], treedef: PyTreeDef, mesh: Mesh) -> PyTree:
    """Storage NamedShardings for the whole state (a pytree like the state)."""
    shardings = [NamedSharding(mesh, lay.spec(), memory_kind="pinned_host" if lay.host else None)
                 for lay in layouts]
    return jax.tree.unflatten(treedef, shardings)


def unsharded_fraction(layouts: list[LeafLayout], role: LeafRole = PARAM) -> float:
    """Fraction of `role` elements that could not be split over the partition group (<= 2% check)."""
    total = sum(lay.nbytes_elems for lay in layouts if lay.role == role)
    whole = sum(lay.nbytes_elems for lay in layouts if lay.role == role and lay.shard_dim is None)
    return whole / total if total else 0.0
