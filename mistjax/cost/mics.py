"""What a plan's MiCS partition group buys: inter-node traffic per step at the partition size vs over all of dp,
and the same plan sharded over all of dp priced beside it (`mistjax explain`'s MiCS lines; docs/mics.md).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from mistjax.core.plan import Plan, PlanError
from mistjax.cost.collectives import ShardingTraffic, sharding_node_egress
from mistjax.cost.predict import analyze
from mistjax.cost.workload import Workload
from mistjax.hardware.presets import ClusterSpec

GiB = 2**30


class StageTraffic(NamedTuple):
    """One stage's sharding traffic per node per step, at the plan's partition group and over all of dp."""

    stage: int
    group: ShardingTraffic  # at ``plan.shard_group``
    all_dp: ShardingTraffic  # the same stage sharded over all of dp (plain ZeRO)


def stage_weight_bytes(workload: Workload, plan: Plan, index: int) -> tuple[float, float]:
    """(weight bytes, gradient bytes) one device's TP shard of stage ``index`` holds unsharded: its share of the
    layer stack plus the embedding (first stage) / head (last stage) leaves, divided by ``plan.tp``."""
    st = plan.stages[index]
    share = (st.layers[1] - st.layers[0]) / max(workload.num_layers, 1)
    first, last = index == 0, index == len(plan.stages) - 1
    total = 0.0
    for leaf in workload.leaves:
        nbytes = leaf.size * leaf.itemsize
        if leaf.stacked:
            total += nbytes * share
        elif (first and ("pre" in leaf.parts or not leaf.parts)) or (last and "post" in leaf.parts):
            total += nbytes
    weights = total / max(plan.tp, 1)
    return weights, weights * workload.grad_scale


def members_per_node(plan: Plan, per_node: int) -> int:
    """Devices of one data-parallel group on each node (the group strides over cp x tp devices)."""
    ring = plan.tp * plan.cp
    return max(per_node // ring, 1) if ring <= per_node else 1


def stage_traffic(workload: Workload, plan: Plan, cluster: ClusterSpec) -> list[StageTraffic]:
    """`sharding_node_egress` of every stage at the plan's partition group and over all of dp."""
    k = members_per_node(plan, cluster.devices_per_node)
    out = []
    for i, st in enumerate(plan.stages):
        w, g = stage_weight_bytes(workload, plan, i)
        z = st.zero_stage if plan.dp > 1 else 0
        at = sharding_node_egress(w, g, z, plan.shard_group, plan.dp, k, plan.grad_accum)
        over = sharding_node_egress(w, g, z, plan.dp, plan.dp, k, plan.grad_accum)
        out.append(StageTraffic(i, at, over))
    return out


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _gib(t: ShardingTraffic) -> str:
    return (f"gathers {_size(t.gather)}, reduce-scatters {_size(t.reduce_scatter)}, cross-replica all-reduce "
            f"{_size(t.replica_all_reduce)} = {_size(t.total)}")


def mics_lines(workload: Workload, plan: Plan, cluster: ClusterSpec) -> list[str]:
    """`mistjax explain`'s MiCS lines: each stage's inter-node bytes per node per step at the partition group and over
    all of dp, and the same plan with ZeRO over all of dp priced (time, and whether it fits the budget). Empty for a
    plan with no sharding across more than one device."""
    if plan.dp <= 1 or not any(s.zero_stage for s in plan.stages):
        return []
    k = members_per_node(plan, cluster.devices_per_node)
    p, dp = plan.shard_group, plan.dp
    span = lambda g: f"{max(g // k, 1)} node{'s' * (g // k > 1)}"  # noqa: E731
    lines = [f"MiCS: partition group {p} of dp {dp} ({span(p)}; {k} group member(s) per node), inter-node bytes "
             f"leaving each node per step:"]
    worst = max(stage_traffic(workload, plan, cluster), key=lambda s: s.group.total)
    lines.append(f"  stage {worst.stage} at p={p}: {_gib(worst.group)}")
    lines.append(f"  stage {worst.stage} over all of dp={dp} ({span(dp)}): {_gib(worst.all_dp)}")
    if p == dp:
        return lines
    try:
        flat = analyze(workload, dataclasses.replace(plan, shard_group=dp), cluster)
    except PlanError as e:
        lines.append(f"  the same plan sharded over all of dp cannot be priced: {e}")
        return lines
    mine = analyze(workload, plan, cluster)
    fits = flat.prediction.guarded_peak(cluster.device.memory_margin) <= cluster.memory_budget()
    lines.append(f"  the same plan sharded over all of dp: step {flat.step_time:.4g} s vs {mine.step_time:.4g} s "
                 f"at p={p} ({flat.step_time / mine.step_time:.3f}x), peak {_size(flat.peak_memory)} vs "
                 f"{_size(mine.peak_memory)} per device ({'fits' if fits else 'does not fit'} the budget)")
    return lines


__all__ = ["StageTraffic", "members_per_node", "mics_lines", "stage_traffic", "stage_weight_bytes"]
