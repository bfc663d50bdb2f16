"""Build the plan mesh ``(stage, replica, shard, tensor)`` from the user's devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from mistjax.plan import PLAN_MESH_AXES, Plan, PlanError

NODE_AXIS_NAMES = ("node", "nodes", "host", "hosts", "dcn", "slice")


def devices_of(mesh_or_devices: Mesh | Sequence[Any] | None) -> tuple[list[Any], int | None]:
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


def build_plan_mesh(mesh_or_devices: Mesh | Sequence[Any] | None, plan: Plan) -> Mesh:
    """Arrange the user's devices as ``(stage, replica, shard, tensor)`` for `plan`.

    ``tensor`` varies fastest, then ``shard``: with the user's devices grouped by node, TP groups
    and MiCS partition groups stay inside a node whenever they fit in one. When the user's mesh
    names a node level (first axis ``node``), a TP group that would straddle nodes is refused.
    """
    devs, per_node = devices_of(mesh_or_devices)
    plan.check_devices(len(devs))
    if per_node is not None:
        if plan.tp > per_node or per_node % plan.tp:
            raise PlanError(f"tp={plan.tp} does not fit the {per_node} devices of a node; tensor "
                            "parallelism needs the fast intra-node links — choose tp dividing the node size")
        group = plan.tp * plan.shard_group
        if group > per_node and group % per_node:
            raise PlanError(f"a MiCS partition group ({plan.shard_group} x tp {plan.tp} devices) must be "
                            f"part of a node or whole nodes of {per_node}")
    shape = tuple(plan.mesh_shape[a] for a in PLAN_MESH_AXES)
    grid = np.array(devs, dtype=object).reshape(shape)
    return Mesh(grid, PLAN_MESH_AXES, axis_types=(AxisType.Auto,) * len(PLAN_MESH_AXES))
