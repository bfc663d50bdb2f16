"""Build the runtime mesh ``(stage, replica, shard_node, shard_local, tensor)`` from the user's devices.

The plan speaks of one ``shard`` axis (`Plan.mesh_shape`); the runtime splits it in two so a MiCS
partition group that spans nodes can be gathered hierarchically (MiCS section 3): ``shard_node``
is the inter-node part (one member per node, same local rank) and ``shard_local`` the intra-node
part; devices stay node-major, as with one flat axis. When the group fits in a node, or the
user's devices name no node level, ``shard_node`` has size 1 and every spec and collective is
exactly the flat one.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core.execution import is_batch_leaf
from mistjax.core.layout import CONTEXT_AXIS, DP_AXES, RUNTIME_MESH_AXES, SHARD_AXES, SHARD_SPEC
from mistjax.core.plan import PLAN_MESH_AXES, Plan, PlanError
from mistjax.core.types import PyTree

NODE_AXIS_NAMES = ("node", "nodes", "host", "hosts", "dcn", "slice")
__all__ = ["NODE_AXIS_NAMES", "RUNTIME_MESH_AXES", "SHARD_AXES", "SHARD_SPEC", "batch_spec", "build_plan_mesh",
           "devices_of", "shard_split", "split_batch_spec"]


def devices_of(mesh_or_devices: Mesh | Sequence[jax.Device] | None) -> tuple[list[jax.Device], int | None]:
    """The user's devices in order, and the devices per node if the mesh names a node level."""
    if mesh_or_devices is None:
        return list(jax.devices()), None
    if isinstance(mesh_or_devices, Mesh):
        devs = list(mesh_or_devices.devices.flat)
        names = tuple(mesh_or_devices.axis_names)
        per_node = None
        if names and names[0] in NODE_AXIS_NAMES:
            per_node = len(devs) // mesh_or_devices.devices.shape[0]
        return devs, per_node
    return list(mesh_or_devices), None


def shard_split(plan: Plan, per_node: int | None) -> tuple[int, int]:
    """(nodes, members per node) of a MiCS partition group: the extents of `SHARD_AXES`.

    A group of ``shard_group`` devices with stride ``cp * tp`` covers ``shard_group * cp * tp`` consecutive
    devices; when that is k > 1 whole nodes, each node holds ``shard_group / k`` of its members.
    Otherwise (inside one node, or no node level known) the group is all intra-node: ``(1, p)``.
    """
    ring = plan.tp * plan.cp
    span = ring * plan.shard_group
    if per_node is None or span <= per_node:
        return 1, plan.shard_group
    if ring >= per_node:  # each member on its own node(s): a CP x TP group fills whole nodes
        return plan.shard_group, 1
    nodes = span // per_node
    return nodes, plan.shard_group // nodes


def build_plan_mesh(mesh_or_devices: Mesh | Sequence[jax.Device] | None, plan: Plan) -> Mesh:
    """Arrange the user's devices as `RUNTIME_MESH_AXES` for `plan`.

    ``tensor`` varies fastest, then the shard axes: with the user's devices grouped by node, TP
    groups and MiCS partition groups stay inside a node whenever they fit in one, and a group
    spanning k nodes splits into ``shard_node`` (k) x ``shard_local`` (members per node). When the
    user's mesh names a node level (first axis ``node``), a TP group that would straddle nodes is
    refused.
    """
    devs, per_node = devices_of(mesh_or_devices)
    plan.check_devices(len(devs))
    if per_node is not None:
        if plan.tp > per_node or per_node % plan.tp:
            raise PlanError(f"tp={plan.tp} does not fit the {per_node} devices of a node; tensor "
                            "parallelism needs the fast intra-node links — choose tp dividing the node size")
        ring = plan.cp * plan.tp
        if ring > per_node and ring % per_node or ring < per_node and per_node % ring:
            raise PlanError(f"a context-parallel group (cp {plan.cp} x tp {plan.tp} devices) must be part of a "
                            f"node or whole nodes of {per_node}; choose cp x tp dividing or a multiple of it")
        group = ring * plan.shard_group
        if group > per_node and group % per_node:
            raise PlanError(f"a MiCS partition group ({plan.shard_group} x cp {plan.cp} x tp {plan.tp} devices) "
                            f"must be part of a node or whole nodes of {per_node}")
    nodes, local = shard_split(plan, per_node)
    # The plan's (stage, replica, shard, context, tensor) extents with `shard` replaced by its two parts.
    shape = tuple(e for a in PLAN_MESH_AXES
                  for e in ((nodes, local) if a == "shard" else (plan.mesh_shape[a],)))
    grid = np.array(devs, dtype=object).reshape(shape)
    return Mesh(grid, RUNTIME_MESH_AXES, axis_types=(AxisType.Auto,) * len(RUNTIME_MESH_AXES))


def batch_shardings(mesh: Mesh, batch: PyTree, global_batch: int) -> PyTree:
    """Where each batch leaf goes on `mesh`: batch data (`core.execution.is_batch_leaf`) split over the
    data-parallel axes, and along its sequence (dim 1) over `context` under context parallelism
    (`batch_spec`); the rest replicated."""
    cp = mesh.shape.get(CONTEXT_AXIS, 1)
    return jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(np.shape(x), global_batch, cp)), batch)


def batch_spec(shape: tuple[int, ...], global_batch: int, cp: int) -> P:
    """The `PartitionSpec` of one batch leaf (see `batch_shardings`).

    Raises:
      PlanError: under context parallelism, a batch leaf of two or more dims whose dim 1 (the sequence)
        does not split ``cp`` ways.
    """
    return split_batch_spec(shape, cp) if is_batch_leaf(shape, global_batch) else P()


def split_batch_spec(shape: tuple[int, ...], cp: int) -> P:
    """The `PartitionSpec` of batch data of ``shape``: rows over the data-parallel axes, and under context
    parallelism the sequence (dim 1) over ``context``.

    Raises:
      PlanError: under context parallelism, a leaf of two or more dims whose dim 1 does not split ``cp`` ways.
    """
    if cp == 1 or len(shape) < 2:
        return P(DP_AXES)
    if shape[1] % cp:
        raise PlanError(f"context parallelism splits every batch leaf along dim 1 (the sequence): a leaf of shape "
                        f"{tuple(shape)} does not split into cp={cp} parts; use a sequence length divisible by "
                        f"{cp} (ring attention: by {2 * cp}) or a plan with another cp")
    return P(DP_AXES, CONTEXT_AXIS)
