"""Collective times (alpha-beta, Mist's fitted form, MiCS hierarchical and 2-hop) and wire/egress bytes,
vectorised over group layouts (formulas: docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal, NamedTuple, TypeAlias, cast

import numpy as np
from numpy.typing import ArrayLike

from mistjax.core.hlo import CollectiveOp
from mistjax.hardware.presets import LinkModel

CostForm = Literal["ring", "mist"]
LinkLike: TypeAlias = LinkModel | tuple[ArrayLike, ArrayLike]
"""A link: one `LinkModel`, or (bandwidth, latency) arrays of one link per strategy
(`ClusterSpec.collective_link_arrays`)."""

_AG, _RS, _AR, _A2A = (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE,
                      CollectiveOp.ALL_TO_ALL)
# The collectives priced here, by their HLO spelling (a `CollectiveOp` equals its spelling).
COLLECTIVES: tuple[str, ...] = tuple(op.value for op in (_AG, _RS, _AR, _A2A))
# Ring passes over the data: all-reduce = reduce-scatter + all-gather. Keyed by `CollectiveOp`, which a
# caller's HLO spelling finds too.
_PASSES: Mapping[str, int] = MappingProxyType({_AG: 1, _RS: 1, _AR: 2, _A2A: 1})
# Mist's fitted per-op multipliers (artifact templates). all-to-all is not in Mist; 1.0 assumed.
MIST_PHI: Mapping[str, float] = MappingProxyType({_AG: 1.0, _RS: 1.1, _AR: 2.1, _A2A: 1.0})


def _f(x: ArrayLike) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _link(link: LinkLike) -> tuple[np.ndarray, np.ndarray]:
    if hasattr(link, "bandwidth") and hasattr(link, "latency"):  # a LinkModel, or any object with its two fields
        model = cast(LinkModel, link)
        return _f(model.bandwidth), _f(model.latency)
    try:
        bw, lat = link
    except (TypeError, ValueError):
        raise TypeError("link must be a LinkModel or a (bandwidth, latency) pair") from None
    return _f(bw), _f(lat)


def collective_time(
    op: str, nbytes: ArrayLike, group_size: ArrayLike, link: LinkLike, *, model: CostForm = "ring",
    ops: ArrayLike = 1,
) -> np.ndarray:
    """Time of one flat collective (or of ``ops`` collectives moving ``nbytes`` between them).

    Args:
        op: one of ``COLLECTIVES``: a `CollectiveOp` or its HLO spelling (e.g. ``"all-gather"``).
        nbytes: full buffer size in bytes.
        group_size: participants P.
        link: the link of this group (bandwidth in bytes/s, latency in s).
        model: ``"ring"`` alpha-beta or Mist's ``"mist"`` fitted form (module docstring).
        ops: how many collectives the bytes are issued as (one per parameter leaf where XLA does not
            combine them): each pays the latency.

    Returns:
        Seconds, broadcast over the inputs.
    """
    if op not in _PASSES:
        raise ValueError(f"unknown collective {op!r}; expected one of {list(COLLECTIVES)}")
    n, p = _f(nbytes), _f(group_size)
    bw, lat = _link(link)
    frac = np.where(p > 1, (p - 1) / np.maximum(p, 1), 0.0)
    if model == "ring":
        t = _PASSES[op] * ((p - 1) * lat * _f(ops) + frac * n / bw)
    elif model == "mist":
        t = MIST_PHI[op] * (n / bw * frac + lat * _f(ops))
    else:
        raise ValueError(f"unknown cost model {model!r}; expected 'ring' or 'mist'")
    return np.where((p > 1) & (n > 0), t, 0.0)[()]


def all_gather_time(
    nbytes: ArrayLike, group_size: ArrayLike, link: LinkLike, *, model: CostForm = "ring", ops: ArrayLike = 1
) -> np.ndarray:
    """Ring all-gather producing ``nbytes`` on each of ``group_size`` devices (seconds)."""
    return collective_time(_AG, nbytes, group_size, link, model=model, ops=ops)


def reduce_scatter_time(
    nbytes: ArrayLike, group_size: ArrayLike, link: LinkLike, *, model: CostForm = "ring", ops: ArrayLike = 1
) -> np.ndarray:
    """Ring reduce-scatter of an ``nbytes`` input (seconds)."""
    return collective_time(_RS, nbytes, group_size, link, model=model, ops=ops)


def all_reduce_time(
    nbytes: ArrayLike, group_size: ArrayLike, link: LinkLike, *, model: CostForm = "ring", ops: ArrayLike = 1
) -> np.ndarray:
    """Ring all-reduce of ``nbytes`` = reduce-scatter + all-gather (seconds)."""
    return collective_time(_AR, nbytes, group_size, link, model=model, ops=ops)


def all_to_all_time(
    nbytes: ArrayLike, group_size: ArrayLike, link: LinkLike, *, model: CostForm = "ring", ops: ArrayLike = 1
) -> np.ndarray:
    """All-to-all of an ``nbytes`` buffer per device (nccl-tests bus factor (P-1)/P)."""
    return collective_time(_A2A, nbytes, group_size, link, model=model, ops=ops)


def hierarchical_all_gather_time(
    nbytes: ArrayLike,
    per_node: ArrayLike,
    nodes: ArrayLike,
    intra: LinkLike,
    inter: LinkLike,
    *,
    model: CostForm = "ring",
    ops: ArrayLike = 1,
) -> np.ndarray:
    """MiCS hierarchical all-gather over p = per_node * nodes devices: inter-node first, then intra.

    Phase 1: ``per_node`` concurrent all-gathers of ``nodes`` participants move (m-1)/m of the
    buffer out of every node, sharing the node's inter-node bandwidth. Phase 2: an intra-node
    all-gather of the full buffer over ``per_node`` devices. In alpha-beta terms:
    ``(m-1) a_e + (m-1)/m n/B_e + (k-1) a_i + (k-1)/k n/B_i`` (MiCS digest section 9 with the
    per-device inter-node beta = k/B_e). With ``nodes == 1`` this is the flat intra-node all-gather.
    """
    return all_gather_time(nbytes, nodes, inter, model=model, ops=ops) + all_gather_time(
        nbytes, per_node, intra, model=model, ops=ops
    )


def hierarchical_reduce_scatter_time(
    nbytes: ArrayLike,
    per_node: ArrayLike,
    nodes: ArrayLike,
    intra: LinkLike,
    inter: LinkLike,
    *,
    model: CostForm = "ring",
    ops: ArrayLike = 1,
) -> np.ndarray:
    """Mirror of ``hierarchical_all_gather_time``: intra-node reduce-scatter first, then inter-node.

    After the intra phase each device holds a 1/k partial; the k concurrent inter-node
    reduce-scatters over m nodes then move (m-1)/m of the buffer out of each node in total.
    """
    return reduce_scatter_time(nbytes, per_node, intra, model=model, ops=ops) + reduce_scatter_time(
        nbytes, nodes, inter, model=model, ops=ops
    )


def hierarchical_all_reduce_time(
    nbytes: ArrayLike,
    per_node: ArrayLike,
    nodes: ArrayLike,
    intra: LinkLike,
    inter: LinkLike,
    *,
    model: CostForm = "ring",
    ops: ArrayLike = 1,
) -> np.ndarray:
    """All-reduce over ``per_node`` (k) devices on each of ``nodes`` (m) nodes, as NCCL runs it.

    The bytes move as a ring's over the group's link (``inter`` across nodes, ``intra`` in one node):
    ``2 (p-1)/p n / B``. The latency is the lesser of NCCL's two algorithms (its latency model: a step per hop,
    each at the latency of the link it crosses):

    * ring: ``2 (p-1)`` steps, ``2 (m-1)`` of them across nodes: ``2 ((p-m) a_i + (m-1) a_e)``;
    * tree (m > 1): a chain through the k devices of each node and a double binary tree over the nodes,
      reduced up and broadcast down: ``2 ((k-1) a_i + ceil(log2 m) a_e)``.

    At thousands of GPUs the ring's latency reaches milliseconds per all-reduce, the tree's stays in tens of
    microseconds. With ``m == 1`` both are the intra-node ring. ``model="mist"``: Mist's fitted form over the
    group's link, as `collective_time` prices it.
    """
    k, m = _f(per_node), _f(nodes)
    p = k * m
    multi = m > 1
    bw_e, lat_e = _link(inter)
    bw_i, lat_i = _link(intra)
    if model == "mist":
        link = (np.where(multi, bw_e, bw_i), np.where(multi, lat_e, lat_i))
        return collective_time(_AR, nbytes, p, link, model="mist", ops=ops)
    n = _f(nbytes)
    bw = np.where(multi, bw_e, bw_i)
    ring = 2.0 * ((p - m) * lat_i + (m - 1.0) * lat_e)
    tree = 2.0 * ((k - 1.0) * lat_i + np.ceil(np.log2(np.maximum(m, 1.0))) * lat_e)
    latency = np.where(multi, np.minimum(ring, tree), 2.0 * (p - 1.0) * lat_i)
    t = 2.0 * (p - 1.0) / np.maximum(p, 1.0) * n / bw + latency * _f(ops)
    return np.where((p > 1) & (n > 0), t, 0.0)[()]


def mics_grad_sync_time(
    grad_bytes: ArrayLike,
    per_node: ArrayLike,
    nodes: ArrayLike,
    replicas: ArrayLike,
    accum_steps: ArrayLike,
    intra: LinkLike,
    inter: LinkLike,
    replica: LinkLike,
    *,
    model: CostForm = "ring",
) -> np.ndarray:
    """MiCS 2-hop gradient synchronisation per optimizer step.

    Hop 1, every micro-step: hierarchical reduce-scatter of the full gradient inside the partition
    group (k = ``per_node`` devices on m = ``nodes`` nodes). Hop 2, once per step: all-reduce of the
    accumulated 1/p shard over the ``replicas`` (R) devices holding the same shard.

    Args:
        grad_bytes: full gradient size in bytes (one model replica).
        per_node: partition-group devices per node (k).
        nodes: partition-group nodes (m).
        replicas: replication-group size R = world / p.
        accum_steps: micro-steps per optimizer step (s).
        intra: intra-node link for k devices.
        inter: node-level inter-node link for (m, k).
        replica: link of the replication group (``cluster.collective_link(...)`` of its layout).
        model: cost form.

    Returns:
        ``s * RS_hier(G) + AR_R(G / p)`` in seconds.
    """
    p = _f(per_node) * _f(nodes)
    hop1 = hierarchical_reduce_scatter_time(grad_bytes, per_node, nodes, intra, inter, model=model)
    return _f(accum_steps) * hop1 + all_reduce_time(_f(grad_bytes) / p, replicas, replica, model=model)


def zero3_step_comm_time(
    param_bytes: ArrayLike,
    grad_bytes: ArrayLike,
    group_size: ArrayLike,
    link: LinkLike,
    accum_steps: ArrayLike,
    gathers_per_step: ArrayLike = 2,
    *,
    model: CostForm = "ring",
) -> np.ndarray:
    """ZeRO-3/FSDP over one flat group: ``s * (g * AG(params) + RS(grads))`` seconds.

    ``gathers_per_step`` = 2 when parameters are re-gathered for the backward pass (the usual
    reshard-after-forward), 1 when the forward's gathered copy is kept.
    """
    ag = all_gather_time(param_bytes, group_size, link, model=model)
    rs = reduce_scatter_time(grad_bytes, group_size, link, model=model)
    return _f(accum_steps) * (_f(gathers_per_step) * ag + rs)


def mics_step_comm_time(
    param_bytes: ArrayLike,
    grad_bytes: ArrayLike,
    per_node: ArrayLike,
    nodes: ArrayLike,
    replicas: ArrayLike,
    accum_steps: ArrayLike,
    intra: LinkLike,
    inter: LinkLike,
    replica: LinkLike,
    gathers_per_step: ArrayLike = 2,
    *,
    model: CostForm = "ring",
) -> np.ndarray:
    """MiCS per-step communication: ``s * g * AG_hier(params)`` plus ``mics_grad_sync_time``."""
    ag = hierarchical_all_gather_time(param_bytes, per_node, nodes, intra, inter, model=model)
    sync = mics_grad_sync_time(
        grad_bytes, per_node, nodes, replicas, accum_steps, intra, inter, replica, model=model
    )
    return _f(accum_steps) * _f(gathers_per_step) * ag + sync


def p2p_time(nbytes: ArrayLike, link: LinkLike) -> np.ndarray:
    """Point-to-point send (pipeline activations): ``latency + nbytes / bandwidth``; 0 for 0 bytes."""
    n = _f(nbytes)
    bw, lat = _link(link)
    return np.where(n > 0, lat + n / bw, 0.0)[()]


def host_copy_time(nbytes: ArrayLike, link: LinkLike) -> np.ndarray:
    """Host<->device copy (Mist: ``bytes/k + b``); exactly 0 for 0 bytes (nothing is offloaded)."""
    return p2p_time(nbytes, link)


# -- wire bytes (compare with the collectives found in compiled HLO) ---------------------------


def wire_bytes(op: str, nbytes: ArrayLike, group_size: ArrayLike) -> np.ndarray:
    """Bytes each device sends in a ring implementation of ``op`` on a full buffer of ``nbytes``.

    all-gather, reduce-scatter, all-to-all: (P-1)/P * n; all-reduce: 2 (P-1)/P * n;
    ``"collective-permute"`` (a p2p send): n. A group of one sends nothing.
    """
    n, p = _f(nbytes), _f(group_size)
    if op == CollectiveOp.COLLECTIVE_PERMUTE:
        return n + 0.0 * p  # one send of the whole buffer; broadcast to the inputs' shape
    if op not in _PASSES:
        valid = [*COLLECTIVES, CollectiveOp.COLLECTIVE_PERMUTE.value]
        raise ValueError(f"unknown collective {op!r}; expected one of {valid}")
    return np.where(p > 1, _PASSES[op] * (p - 1) / np.maximum(p, 1) * n, 0.0)[()]


def collective_buffer_bytes(
    op: str, nbytes: ArrayLike, group_size: ArrayLike
) -> tuple[np.ndarray, np.ndarray]:
    """(operand, result) bytes per device of the HLO instruction for ``op`` on a full buffer.

    all-gather: (n/P, n); reduce-scatter: (n, n/P); all-reduce and all-to-all: (n, n).
    """
    n, p = _f(nbytes), np.maximum(_f(group_size), 1)
    if op == _AG:
        return n / p, n
    if op == _RS:
        return n, n / p
    if op in (_AR, _A2A):
        return n, n
    raise ValueError(f"unknown collective {op!r}; expected one of {list(COLLECTIVES)}")


def ring_node_egress_bytes(
    op: str, nbytes: ArrayLike, group_size: ArrayLike, group_nodes: ArrayLike
) -> np.ndarray:
    """Bytes leaving each node for a flat ring over node-contiguous ranks.

    A ring crosses each node boundary once per direction, so a node's egress equals one device's
    ring traffic (``wire_bytes``) when the group spans > 1 node, else 0.
    """
    return np.where(_f(group_nodes) > 1, wire_bytes(op, nbytes, group_size), 0.0)[()]


def hierarchical_node_egress_bytes(nbytes: ArrayLike, nodes: ArrayLike) -> np.ndarray:
    """Bytes leaving each node in a hierarchical all-gather or reduce-scatter: (m-1)/m * n."""
    m = _f(nodes)
    return np.where(m > 1, (m - 1) / np.maximum(m, 1) * _f(nbytes), 0.0)[()]


def zero3_node_egress_bytes(
    param_bytes: ArrayLike,
    grad_bytes: ArrayLike,
    world_size: ArrayLike,
    devices_per_node: ArrayLike,
    accum_steps: ArrayLike,
    gathers_per_step: ArrayLike = 2,
) -> np.ndarray:
    """Per-node network egress per optimizer step of ZeRO-3 sharded over all ``world_size`` devices.

    ``s * [g * (N-1)/N * Pb + (N-1)/N * G]`` when the group spans nodes (MiCS digest section 4).
    """
    nodes = np.ceil(_f(world_size) / _f(devices_per_node))
    ag = ring_node_egress_bytes(_AG, param_bytes, world_size, nodes)
    rs = ring_node_egress_bytes(_RS, grad_bytes, world_size, nodes)
    return _f(accum_steps) * (_f(gathers_per_step) * ag + rs)


def mics_node_egress_bytes(
    param_bytes: ArrayLike,
    grad_bytes: ArrayLike,
    partition_size: ArrayLike,
    world_size: ArrayLike,
    devices_per_node: ArrayLike,
    accum_steps: ArrayLike,
    gathers_per_step: ArrayLike = 2,
) -> np.ndarray:
    """Per-node network egress per optimizer step of MiCS with partition groups of p devices.

    Partition groups are node-aligned (p divides a node or is a multiple of it). Hop 1 (hierarchical
    gathers and reduce-scatters) leaves the node only when p spans m = p/k > 1 nodes. Hop 2: each
    node hosts min(k, p) replication rings, each all-reducing G/p over R = N/p devices, which
    leaves the node when the ring spans more than one node (N > k).
    """
    p, n, k = _f(partition_size), _f(world_size), _f(devices_per_node)
    m = np.maximum(p / k, 1.0)
    hop1 = _f(gathers_per_step) * hierarchical_node_egress_bytes(param_bytes, m)
    hop1 = hop1 + hierarchical_node_egress_bytes(grad_bytes, m)
    r = n / p
    hop2 = np.where(
        (r > 1) & (n > k), np.minimum(k, p) * 2 * (r - 1) / np.maximum(r, 1) * _f(grad_bytes) / p, 0.0
    )
    return _f(accum_steps) * hop1 + hop2


class LevelBytes(NamedTuple):
    """Result bytes per device of each phase of one hierarchical collective (the HLO instructions' result sizes)."""

    inter: float  # the inter-node phase (k concurrent collectives of m participants, one per local rank)
    intra: float  # the intra-node phase (over the k devices of a node)


def hierarchical_level_bytes(op: str, nbytes: float, per_node: int, nodes: int) -> LevelBytes:
    """Per-device result bytes of each level of `hierarchical_all_gather_time` / `..._reduce_scatter_time` on a
    full buffer of ``nbytes`` over p = k x m devices, as the runtime issues them (`runtime.grads`):

    * all-gather, inter-node first: m chunks of n/p -> n/k, then intra-node -> n;
    * reduce-scatter, intra-node first: n -> n/k, then inter-node -> n/p.

    The inter phase's bytes leaving each node are k x (m-1)/m x its result = `hierarchical_node_egress_bytes`."""
    k, m = max(int(per_node), 1), max(int(nodes), 1)
    if op == _AG:
        return LevelBytes(inter=nbytes / k, intra=float(nbytes))
    if op == _RS:
        return LevelBytes(inter=nbytes / (k * m), intra=nbytes / k)
    raise ValueError(f"hierarchical levels exist for {_AG.value} and {_RS.value}, not {op!r}")


class ShardingTraffic(NamedTuple):
    """Bytes leaving each node per optimizer step for a stage's ZeRO / MiCS collectives (`sharding_node_egress`)."""

    gather: float  # parameter all-gathers (hop 0: ZeRO-3's per micro-batch, ZeRO-1/2's after the update)
    reduce_scatter: float  # gradient reduce-scatters inside the partition group (hop 1)
    replica_all_reduce: float  # the once-per-step all-reduce of the 1/p shard over the replicas (hop 2)

    @property
    def total(self) -> float:
        return self.gather + self.reduce_scatter + self.replica_all_reduce


def sharding_node_egress(param_bytes: float, grad_bytes: float, zero: int, group: int, dp: int, members_per_node: int,
                         accum_steps: int) -> ShardingTraffic:
    """Per-node network egress per step of a stage's sharding collectives with partition group ``group`` of ``dp``.

    As the runtime issues them (`runtime.grads`): a group spanning m > 1 nodes gathers and reduce-scatters
    hierarchically, (m-1)/m of the buffer leaving each node (`hierarchical_node_egress_bytes`); ZeRO-3 gathers every
    weight twice per micro-batch (forward, backward re-fetch) and reduce-scatters every micro-batch, ZeRO-2
    reduce-scatters every micro-batch, ZeRO-1 once per step, and ZeRO-1/2 re-gather the updated weights once;
    with R = dp / group > 1 replicas, each node's ``min(k, group)`` replica rings all-reduce the 1/group gradient
    shard once per step (2 (R-1)/R of it leaves the node when the ring spans nodes). ZeRO-3 reduce-scatters in
    the parameters' dtype (the fetch's transpose), the others in the gradients'.

    Args:
        param_bytes: bytes of the stage's (TP-shard of the) weights in their stored dtype.
        grad_bytes: bytes of their gradients in the gradient dtype.
        zero: ZeRO level 0-3 (0: a plain all-reduce over dp, counted as the replica all-reduce with group 1).
        group: partition group p (dp for plain ZeRO).
        dp: data-parallel degree.
        members_per_node: devices of one data-parallel group on each node (k).
        accum_steps: micro-batches per step (G).
    """
    k = max(int(members_per_node), 1)
    p = 1 if zero == 0 else group
    m = max(p // k, 1)  # nodes the partition group spans
    z3_rs = param_bytes if zero >= 3 else grad_bytes
    gathers = 2.0 * accum_steps if zero >= 3 else (1.0 if zero >= 1 else 0.0)
    scatters = float(accum_steps) if zero >= 2 else (1.0 if zero == 1 else 0.0)
    gather = gathers * float(hierarchical_node_egress_bytes(param_bytes, m))
    rs = scatters * float(hierarchical_node_egress_bytes(z3_rs, m))
    replicas = dp // p
    ar = 0.0
    if replicas > 1 and dp > k:  # the replica ring leaves the node
        ar = min(k, p) * 2.0 * (replicas - 1) / replicas * grad_bytes / p
    return ShardingTraffic(gather, rs, ar)


# -- rank layout (Mist): DP spreads across nodes first, TP is the inner (fastest) dimension ------


GroupCount: TypeAlias = int | np.ndarray
"""Participants of a group layout: an int for scalar arguments, else an int64 array."""


def _intish(x: np.ndarray) -> GroupCount:
    return int(x) if x.ndim == 0 else x


def dp_group_layout(
    dp: ArrayLike, tp: ArrayLike, nodes_in_stage: ArrayLike, devices_per_node: ArrayLike
) -> tuple[GroupCount, GroupCount]:
    """(inter, intra) participants of one DP group in a stage mesh of n nodes x m devices.

    Ranks are node-major with TP innermost, so a DP group takes every tp-th device: it spans
    ``min(dp, n)`` nodes with ``dp / n`` members per node (or 1 when TP spans nodes). Mist's rule.

    Args:
        dp: data-parallel degree.
        tp: tensor-parallel degree.
        nodes_in_stage: nodes of the stage mesh (n).
        devices_per_node: devices the stage uses on each of its nodes (m).

    Raises:
        ValueError: if dp * tp != n * m anywhere.
    """
    dp_, tp_, n, m = (np.asarray(v, dtype=np.int64) for v in (dp, tp, nodes_in_stage, devices_per_node))
    if np.any(dp_ * tp_ != n * m) or np.any(dp_ < 1) or np.any(tp_ < 1):
        raise ValueError(
            "dp_group_layout: need dp >= 1, tp >= 1 and dp * tp == nodes_in_stage * devices_per_node"
        )
    inter = np.minimum(dp_, n)
    intra = np.where(dp_ > n, dp_ // np.maximum(n, 1), 1)
    return _intish(inter), _intish(intra)


def tp_group_layout(tp: ArrayLike, devices_per_node: ArrayLike) -> tuple[GroupCount, GroupCount]:
    """(inter, intra) participants of one TP group: ``intra = min(tp, m)``, ``inter = tp / m`` if tp > m."""
    tp_, m = np.asarray(tp, dtype=np.int64), np.asarray(devices_per_node, dtype=np.int64)
    intra = np.minimum(tp_, m)
    inter = np.where(tp_ > m, tp_ // np.maximum(m, 1), 1)
    return _intish(inter), _intish(intra)
