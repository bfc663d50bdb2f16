"""Time of one stage: per-layer phases with Mist's overlap model, and the once-per-step extras.

Per layer and phase (forward / backward) the four channels are priced standalone and combined with
`overlap_time` (Mist section 3.2); tensor-parallel collectives are added serially (they sit on the
critical path between matmuls), or, where the layer runs them as collective matmuls
(`Plan.tp_overlap`), what of their rings the chunks' GEMMs do not hide (`cost.tp_rings`).
Layer kinds follow `runtime.remat`: plain, checkpointed (recompute in backward), activation-offloaded (tagged
activations D2H in forward, H2D in backward, the rest recomputed). Every kind fetches its weights (ZeRO-3
all-gather, host->device copy) in the forward and again in the backward (plain layers through the runtime's
re-fetching custom VJP). Collective group layouts follow the plan mesh ``(stage, replica, shard, tensor)``
with ``tensor`` fastest: a TP group is ``t`` consecutive devices, a ZeRO/MiCS group ``p`` devices with stride
``t``, spanning ``ceil(p t / per_node)`` nodes; a group spanning nodes uses the hierarchical (MiCS) gather /
reduce-scatter.
"""

from __future__ import annotations

from typing import NamedTuple, TypeAlias, cast

import numpy as np
from numpy.typing import ArrayLike

from mistjax.analysis.compiled import PartValues, ProfileValues
from mistjax.core.context import ring_traffic, ulysses_traffic
from mistjax.core.execution import Capabilities, collective_matmul_runs, rows_synced_in_loop
from mistjax.core.hlo import CollectiveOp
from mistjax.cost.collectives import (
    LinkLike,
    collective_time,
    hierarchical_all_gather_time,
    hierarchical_all_reduce_time,
    hierarchical_reduce_scatter_time,
    host_copy_time,
    p2p_time,
)
from mistjax.cost.interference import overlap_time
from mistjax.cost.kernels import WEIGHT_GEMM_KERNELS, WEIGHT_GEMMS, kernel_rows
from mistjax.cost.knobs import Knobs, LayerKinds, StateBytes
from mistjax.cost.layout import unique_rows
from mistjax.cost.tp_rings import chunk_overhead, recompute_share, tp_ring_recompute_time, tp_ring_time
from mistjax.cost.workload import OPTIMIZERS, Workload
from mistjax.hardware.interference import InterferenceParams
from mistjax.hardware.presets import ClusterSpec

# The collectives a stage issues (tensor-parallel and ZeRO / DP), as `StageCost.comm` reports them.
KINDS: tuple[CollectiveOp, ...] = (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE)

LinkArrays: TypeAlias = tuple[np.ndarray, np.ndarray]
"""(bandwidth, latency) of one link per strategy: a `LinkLike` of `mistjax.cost.collectives`."""


def _fp32(workload: Workload) -> bool:
    return workload.compute_dtype == "float32"


def compute_time(cluster: ClusterSpec, flops: np.ndarray, matmul: np.ndarray, fp32: bool, itemsize: float
                 ) -> np.ndarray:
    """Roofline time: matmul FLOPs at the (efficiency-scaled) peak, the rest memory-bound.

    The profile gives FLOPs, not bytes per op; elementwise work is charged one element read and one
    written per FLOP (an upper bound for fused chains, a fair one for XLA's unfused CPU kernels).
    """
    dev = cluster.device
    peak = (dev.peak_flops_fp32 if fp32 else dev.peak_flops) * dev.matmul_efficiency
    other = np.maximum(flops - matmul, 0.0)
    return matmul / peak + other * 2.0 * itemsize / (dev.hbm_bandwidth * dev.memory_efficiency)


def _group_link(cluster: ClusterSpec, group: np.ndarray, stride: np.ndarray, per_node: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, LinkArrays, LinkArrays]:
    """(devices per node k, nodes m, intra link, inter link) of a group of ``group`` devices ``stride`` apart: it
    touches the nodes its span covers, at most one per member (members a node or more apart each sit in their
    own node), so ``k * m == group``."""
    span = group * stride
    m = np.clip(np.ceil(span / np.maximum(per_node, 1)), 1.0, np.maximum(group, 1.0))
    k = np.maximum(group / m, 1.0)
    intra = _links(cluster, k, np.ones_like(k))
    inter = _links(cluster, k, np.maximum(m, 2))
    return k, m, intra, inter


def _links(cluster: ClusterSpec, k: np.ndarray, m: np.ndarray) -> LinkArrays:
    """Vectorised ``cluster.collective_link(k, m)`` (a lookup per distinct layout, 1-D sorts only)."""
    k, m = np.asarray(k, dtype=np.int64), np.asarray(m, dtype=np.int64)
    shape = np.broadcast_shapes(k.shape, m.shape)
    if k.size and m.size and k.min() == k.max() and m.min() == m.max():  # one layout (a tuner key's usual case)
        link = cluster.collective_link(int(k.flat[0]), int(m.flat[0]))
        return np.full(shape, float(link.bandwidth)), np.full(shape, float(link.latency))
    rows, inv = unique_rows([k, m])
    links = [cluster.collective_link(int(a), int(b)) for a, b in rows]
    bw = np.array([x.bandwidth for x in links])[inv].reshape(shape)
    lat = np.array([x.latency for x in links])[inv].reshape(shape)
    return bw, lat


def _ag(nbytes: np.ndarray, k: np.ndarray, m: np.ndarray, intra: LinkLike, inter: LinkLike, ops: ArrayLike = 1.0
        ) -> np.ndarray:
    return hierarchical_all_gather_time(nbytes, k, m, intra, inter, ops=ops)


def _rs(nbytes: np.ndarray, k: np.ndarray, m: np.ndarray, intra: LinkLike, inter: LinkLike, ops: ArrayLike = 1.0
        ) -> np.ndarray:
    return hierarchical_reduce_scatter_time(nbytes, k, m, intra, inter, ops=ops)


class LeafOps(NamedTuple):
    """How many all-gathers / reduce-scatters the runtime's per-leaf collectives are issued as."""

    stacked: float  # per layer: one per stacked (layer) leaf
    other: float  # the non-stacked leaves (embedding, head, final norm)
    total: float  # once per step over every leaf (the stacked ones as [L, ...] arrays)


def leaf_ops(workload: Workload, cluster: ClusterSpec) -> LeafOps:
    """One collective per parameter leaf where XLA does not combine them (XLA:CPU), else one per program
    point (XLA:GPU's combiner passes): each pays the link latency (`collective_time`'s ``ops``)."""
    if cluster.device.combines_collectives:
        return LeafOps(1.0, 1.0, 1.0)
    stacked = sum(1 for x in workload.leaves if x.stacked)
    other = len(workload.leaves) - stacked
    return LeafOps(float(max(stacked, 1)), float(max(other, 1)), float(max(len(workload.leaves), 1)))


def _compute(cluster: ClusterSpec, fp32: bool, flops: np.ndarray, matmul: np.ndarray) -> np.ndarray:
    return compute_time(cluster, flops, matmul, fp32, 4.0 if fp32 else 2.0)


def _tp_link(cluster: ClusterSpec, k: Knobs) -> LinkArrays:
    """The link of a tensor-parallel group: ``t`` consecutive devices."""
    _, tm, tintra, tinter = _group_link(cluster, k.tp, np.ones_like(k.tp), k.per_node)
    return np.where(tm > 1, tinter[0], tintra[0]), np.where(tm > 1, tinter[1], tintra[1])


def _cp_link(cluster: ClusterSpec, k: Knobs) -> LinkArrays:
    """The link of a context-parallel group: ``cp`` devices ``tp`` apart."""
    _, m, intra, inter = _group_link(cluster, k.cp, k.tp, k.per_node)
    return np.where(m > 1, inter[0], intra[0]), np.where(m > 1, inter[1], intra[1])


def context_kv_bytes(workload: Workload, v: ProfileValues) -> np.ndarray:
    """Per device, the key and value shards of one layer and micro-batch under context parallelism: K and V are
    ``kv_share`` of the layer's hidden-state output each (`Workload.kv_share`), at the local sequence."""
    return 2.0 * workload.kv_share() * v.block.output_bytes


def acc_scale(workload: Workload) -> float:
    """Bytes of a float32 accumulator element over an activation element."""
    return 4.0 / (4.0 if workload.compute_dtype == "float32" else 2.0)


def kv_repeat(workload: Workload, k: Knobs) -> np.ndarray:
    """How many copies of each key / value head Ulysses exchanges: ``cp / kv_heads`` where the kv heads are
    fewer than the ``cp`` devices, else 1 (`core.context.ulysses_supported`)."""
    heads = workload.attention_heads()
    return np.maximum(1.0, k.cp / (heads[1] if heads is not None else k.cp))


def context_ring_bytes(workload: Workload, k: Knobs, v: ProfileValues) -> tuple[np.ndarray, np.ndarray]:
    """Bytes a device sends in one layer's context-parallel attention per micro-batch, forward and backward:
    the ring's (`core.context.ring_traffic`) or Ulysses' (`core.context.ulysses_traffic`) by ``k.ulysses``; the
    queries are as large as the layer's output."""
    q, kv = v.block.output_bytes, context_kv_bytes(workload, v)
    ring = ring_traffic(k.cp, q, kv, acc_scale(workload))
    ulysses = ulysses_traffic(k.cp, q, kv, kv_repeat(workload, k))
    return np.where(k.ulysses, ulysses[0], ring[0]), np.where(k.ulysses, ulysses[1], ring[1])


def _ulysses_held(workload: Workload, k: Knobs, v: ProfileValues) -> np.ndarray:
    """The bytes each direction's four all-to-alls of a Ulysses layer hold per device (q, k, v in and the output
    back; ``do`` in and dq, dk, dv back): ``2 q + kv'``."""
    return 2.0 * v.block.output_bytes + kv_repeat(workload, k) * context_kv_bytes(workload, v)


def _cp_layer_times(workload: Workload, cluster: ClusterSpec, k: Knobs, v: ProfileValues
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of one layer's context-parallel traffic, forward and backward, charged serially: the ring's
    neighbour transfers (`context_ring_bytes`), or without the ring kernel the keys and values GSPMD gathers
    over the ``cp`` group (again in the backward, which also reduce-scatters their gradients). Serial, as
    XLA:GPU mostly schedules them: in its deviceless compile of the one-stage cp 4 cell, 13 of the 84 permutes
    run beside an attention block scan, the rest beside a few small fusions or nothing (docs/benchmarks.md)."""
    link = _cp_link(cluster, k)
    on = k.cp > 1
    if workload.ring_attention:
        f, b = context_ring_bytes(workload, k, v)
        bw, lat = link
        ring = (f / bw + (k.cp - 1.0) * lat, b / bw + (2.0 * k.cp - 1.0) * lat)
        # Ulysses: four all-to-alls each way (`_ulysses_held`).
        a2a = collective_time(CollectiveOp.ALL_TO_ALL, _ulysses_held(workload, k, v), k.cp, link, ops=4)
        fwd, bwd = (np.where(on, np.where(k.ulysses, a2a, r), 0.0) for r in ring)
        return fwd, bwd
    full = context_kv_bytes(workload, v) * k.cp
    ag = collective_time(CollectiveOp.ALL_GATHER, full, k.cp, link)
    rs = collective_time(CollectiveOp.REDUCE_SCATTER, full, k.cp, link)
    return np.where(on, ag, 0.0), np.where(on, ag + rs, 0.0)


def context_partial(workload: Workload, k: Knobs) -> np.ndarray:
    """Whether the stage's layer weights' gradients are accumulated as per-context-rank partial sums and reduced
    over `context` once per step (`runtime.grads.partial_leaves`): cp > 1 without TP, G > 1, one stage, the
    layer's attention run as the context-parallel kernel, the weights read in place (no ZeRO-3, no weight
    offload) and accumulated on the device."""
    return ((k.cp > 1) & (k.tp == 1) & (k.G > 1) & ~k.pipelined & (k.zero < 3) & (k.wo <= 0) & (k.go <= 0)
            & bool(workload.ring_attention))


def _cp_grad_sync(workload: Workload, cluster: ClusterSpec, k: Knobs, v: ProfileValues) -> np.ndarray:
    """Seconds of the all-reduce over the ``cp`` group of one micro-batch's gradients: the weights are
    replicated over it and each device's gradient is a partial sum over its part of the sequence (GSPMD
    reduces it where the gradient is formed, once per micro-batch), except the layer weights' where
    `context_partial` holds (`_cp_step_sync`)."""
    nbytes = _cp_grad_bytes(workload, k, v)
    return np.where(k.cp > 1, hierarchical_all_reduce_time(nbytes, *_group_link(cluster, k.cp, k.tp, k.per_node)),
                    0.0)


def _cp_layer_bytes(workload: Workload, k: Knobs, v: ProfileValues) -> np.ndarray:
    """The stage's layer weights' gradient, as the context all-reduce moves it."""
    return v.block.weight_bytes * k.layers * workload.grad_scale


def _cp_grad_bytes(workload: Workload, k: Knobs, v: ProfileValues) -> np.ndarray:
    """One micro-batch's gradient reduced over `context` in that micro-batch: the pre / post weights', and the
    layer weights' unless `context_partial`."""
    layers = np.where(context_partial(workload, k), 0.0, _cp_layer_bytes(workload, k, v))
    return layers + (np.where(k.first, v.pre.weight_bytes, 0.0)
                     + np.where(k.last, v.post.weight_bytes, 0.0)) * workload.grad_scale


def _cp_step_bytes(workload: Workload, k: Knobs, v: ProfileValues) -> np.ndarray:
    """The layer weights' partial sums reduced over `context` once per step where `context_partial` holds (under
    ZeRO-1 / 2 after the partition group's reduce-scatter: its 1 / p), else 0."""
    shard = np.where((k.zero >= 1) & (k.shard_group > 1), k.shard_group, 1.0)
    return np.where(context_partial(workload, k), _cp_layer_bytes(workload, k, v) / shard, 0.0)


def _cp_step_sync(workload: Workload, cluster: ClusterSpec, k: Knobs, v: ProfileValues) -> np.ndarray:
    """Seconds of the once-per-step reduction over `context` of the layer weights' partial sums: a reduce-scatter
    where the optimizer state is split over `context` too (`Knobs.context_shards`), else an all-reduce."""
    nbytes, link = _cp_step_bytes(workload, k, v), _group_link(cluster, k.cp, k.tp, k.per_node)
    rs = _rs(nbytes, *link)
    return np.where(k.cp > 1, np.where(k.context_shards > 1, rs, hierarchical_all_reduce_time(nbytes, *link)), 0.0)


def _cp_comm(workload: Workload, k: Knobs, v: ProfileValues, kinds: LayerKinds) -> dict[str, np.ndarray]:
    """Collective result bytes per step of context parallelism, by kind: the ring's transfers (checkpointed
    layers run the forward's again) or GSPMD's gathered keys / values, and the gradient all-reduce over
    ``context`` (per micro-batch, and the layer weights' partials once per step: `context_partial`)."""
    on = k.cp > 1
    step = _cp_step_bytes(workload, k, v)  # reduce-scattered (result bytes: 1 / cp) where the state is split
    scattered = k.context_shards > 1
    ar = np.where(on, k.G * _cp_grad_bytes(workload, k, v) + np.where(scattered, 0.0, step), 0.0)
    rs_step = np.where(on & scattered, step / k.cp, 0.0)
    if workload.ring_attention:
        f, b = context_ring_bytes(workload, k, v)
        ring = k.G * (k.layers * (f + b) + kinds.n_remat * f)
        # Ulysses runs its exchanges as all-to-alls where `tensor` is one device, else as cp - 1 ppermutes each
        # (`runtime.context_attention._all_to_all`): an all-to-all's result is what it holds, the ppermutes'
        # what is sent.
        a2a = k.G * (2.0 * k.layers + kinds.n_remat) * _ulysses_held(workload, k, v)
        direct = on & k.ulysses & (k.tp == 1)
        return {"collective-permute": np.where(on & ~direct, ring, 0.0), "all-to-all": np.where(direct, a2a, 0.0),
                "all-reduce": ar, "reduce-scatter": rs_step}
    kv = context_kv_bytes(workload, v)
    return {"all-gather": np.where(on, k.G * k.layers * 2.0 * kv * k.cp, 0.0),
            "reduce-scatter": np.where(on, k.G * k.layers * kv, 0.0) + rs_step, "all-reduce": ar}


def synced_in_loop(workload: Workload, k: Knobs, lt: dict[str, np.ndarray]) -> np.ndarray:
    """Fraction of the stage's layer gradients synchronised per layer inside the backward: the stacked layers
    (not host-accumulated) where `core.execution.rows_synced_in_loop` holds. The rest (embedding, head, host
    accumulators, G > 1, every pipeline stage: the MPMD executor syncs in its `finish` program) syncs at the end
    of the step."""
    return np.where(syncs_rows_in_loop(workload, k), 1.0 - lt["acc_layer_host_frac"], 0.0)


def syncs_rows_in_loop(workload: Workload, k: Knobs) -> np.ndarray:
    """Whether the stage's device-accumulated layer rows sync inside the backward (see `synced_in_loop`)."""
    return rows_synced_in_loop(k.zero, k.dp, k.shard_group, k.G, k.pipelined) & workload.layer_grads_in_loop


def synced_row_bytes(workload: Workload, k: Knobs, v: ProfileValues, lt: dict[str, np.ndarray]) -> np.ndarray:
    """Bytes of one layer's gradient row that the in-loop sync synchronises (`synced_in_loop`; 0 without)."""
    return synced_in_loop(workload, k, lt) * v.block.weight_bytes * workload.grad_scale


def capabilities(cluster: ClusterSpec) -> Capabilities:
    """The platform `Capabilities` of the cluster's devices (`DeviceSpec.async_collectives`), as the runtime
    reads them from its mesh."""
    return Capabilities(bool(cluster.device.async_collectives))


def _grad_sync_time(cluster: ClusterSpec, k: Knobs, nbytes: np.ndarray, rs_ops: ArrayLike = 1.0) -> np.ndarray:
    """Seconds of the ZeRO-0 all-reduce over DP / ZeRO-1 reduce-scatter over the partition group (hop 1) of
    ``nbytes`` of gradient (nothing for ZeRO >= 2: reduced per micro-batch), the reduce-scatter issued as
    ``rs_ops`` collectives (all-reduces are combined on every platform)."""
    gk, gm, intra, inter = _group_link(cluster, k.shard_group, k.tp * k.cp, k.per_node)
    ar = hierarchical_all_reduce_time(nbytes, *_group_link(cluster, k.dp, k.tp * k.cp, k.per_node))
    return np.where(k.zero == 0, ar, np.where(k.zero == 1, _rs(nbytes, gk, gm, intra, inter, rs_ops), 0.0))


def _tp_time(part: PartValues, phase: str, k: Knobs, link: LinkArrays) -> np.ndarray:
    """Seconds of a part's tensor-parallel collectives in one phase (serial: between matmuls)."""
    return cast(np.ndarray, sum(collective_time(kd, part.tp(kd, phase), k.tp, link) for kd in KINDS))


def _ring_overlap(cluster: ClusterSpec) -> InterferenceParams | None:
    """How a collective matmul's transfers share the device with its GEMMs: the cluster's interference factors
    where collectives run asynchronously, None where in line (`cost.tp_rings.exposed_ring_time`)."""
    return cluster.interference if cluster.device.async_collectives else None


def _block_tp_time(cluster: ClusterSpec, v: ProfileValues, phase: str, k: Knobs, link: LinkArrays,
                   ring_gemm: np.ndarray) -> np.ndarray:
    """Seconds of a layer's tensor-parallel collectives in one phase: serial, or as collective matmuls whose
    chunk GEMMs (``ring_gemm`` seconds in all) hide their transfers (`cost.tp_rings`)."""
    serial = _tp_time(v.block, phase, k, link)
    if not np.any(_rings(k)):
        return serial
    return np.where(_rings(k), tp_ring_time(v.block, phase, k.tp, link, ring_gemm, _ring_overlap(cluster)),
                    serial)


def _rings(k: Knobs) -> np.ndarray:
    """Per strategy, whether its layers run collective matmuls (`core.execution.collective_matmul_runs` of the
    plan's ``tp_overlap``)."""
    return collective_matmul_runs(k.tp_overlap, k.cp)


def _tp_recompute_time(workload: Workload, cluster: ClusterSpec, v: ProfileValues, k: Knobs, link: LinkArrays,
                       ring_gemm: np.ndarray) -> np.ndarray:
    """Seconds of the extra tensor-parallel collectives a checkpointed layer issues when it recomputes
    (with collective matmuls: as the forward's rings, ``ring_gemm`` its GEMM seconds)."""
    nbytes = _recompute_bytes(workload, v, k)
    serial = cast(np.ndarray, sum(collective_time(kd, nbytes[kd], k.tp, link) for kd in KINDS))
    if not np.any(_rings(k)):
        return serial
    return np.where(_rings(k),
                    tp_ring_recompute_time(v.block, nbytes, k.tp, link, ring_gemm, _ring_overlap(cluster)), serial)


def _pass_times(workload: Workload, cluster: ClusterSpec, k: Knobs, v: ProfileValues, kinds: LayerKinds
                ) -> dict[str, np.ndarray]:
    """Compute seconds of one layer per kind and phase, and of pre / post (`mistjax.cost.kernels`).

    Plain layers run the forward and backward without remat; checkpointed layers their policy's forward and
    backward (which recomputes); activation-offloaded layers those of the offload policy. ``ring_fwd`` /
    ``ring_bwd``: a plain layer's GEMMs that collective-matmul rings run, forward (its weight GEMMs) and
    backward (half of them: the input gradients'; `cost.tp_rings`); ``ring_kernels_*``: how many GEMM kernels
    those are.
    """
    if workload.compiled.kernels is None:  # a profile without kernel tables: the FLOP roofline
        return _flop_times(workload, cluster, k, v, kinds)
    point = np.broadcast_shapes(np.shape(k.b), np.shape(k.tp), np.shape(k.cp))
    shape = np.broadcast_shapes(point, np.shape(k.policy))
    rows, inv = kernel_rows(workload, cluster.device, k.b, k.tp, k.cp)
    pols, off = workload.policies, kinds.offload_policy

    def get(part: str, key: str) -> np.ndarray:
        return rows[(part, key)][inv].reshape(point)

    def pick(phase: str) -> np.ndarray:  # the checkpointed layers' policy, per strategy
        table = np.stack([rows[("block", f"{phase}[{p}]")] for p in pols], axis=1)  # [rows, policies]
        row = np.broadcast_to(inv.reshape(point), shape)
        return table[row, np.broadcast_to(np.asarray(k.policy, dtype=np.int64), shape)]

    out = {"f_plain": get("block", "fwd[none]"), "b_plain": get("block", "bwd[none]"),
           "f_remat": pick("fwd"), "b_remat": pick("bwd")}
    has_off = ("block", f"fwd[{off}]") in rows
    out["f_off"] = get("block", f"fwd[{off}]") if has_off else out["f_plain"]
    out["b_off"] = get("block", f"bwd[{off}]") if has_off else out["b_plain"]
    for part in ("pre", "post"):
        out[f"{part}_fwd"], out[f"{part}_bwd"] = get(part, "fwd[none]"), get(part, "bwd[none]")
    out["ring_fwd"] = get("block", "fwd[none]" + WEIGHT_GEMMS)
    out["ring_bwd"] = 0.5 * get("block", "bwd[none]" + WEIGHT_GEMMS)
    out["ring_kernels_fwd"] = get("block", "fwd[none]" + WEIGHT_GEMM_KERNELS)
    out["ring_kernels_bwd"] = 0.5 * get("block", "bwd[none]" + WEIGHT_GEMM_KERNELS)
    return out


def _flop_times(workload: Workload, cluster: ClusterSpec, k: Knobs, v: ProfileValues, kinds: LayerKinds
                ) -> dict[str, np.ndarray]:
    """`_pass_times` from FLOPs alone (matmul at peak x efficiency, the rest at 2 x itemsize bytes per FLOP)."""
    fp32 = _fp32(workload)
    blk = v.block
    f_c = _compute(cluster, fp32, blk.fwd_flops, blk.fwd_matmul_flops)
    b_c = _compute(cluster, fp32, blk.bwd_flops, blk.bwd_matmul_flops)
    mm_ratio = blk.fwd_matmul_flops / np.maximum(blk.fwd_flops, 1.0)
    rec = blk.pick(blk.recompute_flops, workload.policies, k.policy)
    rec_off = blk.recompute_flops(kinds.offload_policy)
    out = {"f_plain": f_c, "b_plain": b_c, "f_remat": f_c, "f_off": f_c,
           "b_remat": b_c + _compute(cluster, fp32, rec, rec * mm_ratio),
           "b_off": b_c + _compute(cluster, fp32, rec_off, rec_off * mm_ratio)}
    for name, part in (("pre", v.pre), ("post", v.post)):
        out[f"{name}_fwd"] = _compute(cluster, fp32, part.fwd_flops, part.fwd_matmul_flops)
        out[f"{name}_bwd"] = _compute(cluster, fp32, part.bwd_flops, part.bwd_matmul_flops)
    # The rings' GEMMs: every matmul FLOP at the roofline (attention's products included: no kernel table).
    out["ring_fwd"] = _compute(cluster, fp32, blk.fwd_matmul_flops, blk.fwd_matmul_flops)
    out["ring_bwd"] = 0.5 * _compute(cluster, fp32, blk.bwd_matmul_flops, blk.bwd_matmul_flops)
    out["ring_kernels_fwd"] = out["ring_kernels_bwd"] = np.zeros_like(f_c)  # the roofline prices no kernels
    return out


def _recompute_bytes(workload: Workload, v: ProfileValues, k: Knobs) -> dict[str, np.ndarray]:
    """Bytes by kind of the extra tensor-parallel collectives of a checkpointed layer's recompute."""
    def of(kd: str) -> np.ndarray:
        return np.maximum(v.block.pick(lambda q: v.block.tp_recompute(q, kd), workload.policies, k.policy), 0.0)

    return {kd: of(kd) for kd in KINDS}


def _layer_tp(workload: Workload, cluster: ClusterSpec, k: Knobs, v: ProfileValues, c: dict[str, np.ndarray]
              ) -> dict[str, np.ndarray]:
    """`layer_tp_times` from the pass times ``c`` (`_pass_times`)."""
    tlink = _tp_link(cluster, k)
    out = {"fwd": _block_tp_time(cluster, v, "fwd", k, tlink, c["ring_fwd"]),
           "bwd": _block_tp_time(cluster, v, "bwd", k, tlink, c["ring_bwd"]),
           "recompute": _tp_recompute_time(workload, cluster, v, k, tlink, c["ring_fwd"])}
    zero = np.zeros(np.shape(out["fwd"]))
    out["chunks_fwd"] = out["chunks_bwd"] = out["chunks_recompute"] = zero
    if np.any(_rings(k)):
        overhead = np.where(_rings(k), cluster.device.kernel_overhead, 0.0)
        out["chunks_fwd"] = chunk_overhead(c["ring_kernels_fwd"], k.tp, overhead)
        out["chunks_bwd"] = chunk_overhead(c["ring_kernels_bwd"], k.tp, overhead)
        out["chunks_recompute"] = recompute_share(v.block, _recompute_bytes(workload, v, k)) * out["chunks_fwd"]
    return out


def layer_tp_times(workload: Workload, cluster: ClusterSpec, k: Knobs, v: ProfileValues, kinds: LayerKinds
                   ) -> dict[str, np.ndarray]:
    """Seconds one layer's tensor-parallel collectives add to a micro-batch: ``fwd``, ``bwd`` and a checkpointed
    layer's ``recompute`` extra; serial, or as collective matmuls' exposed ring time (`cost.tp_rings`). With
    collective matmuls also ``chunks_fwd`` / ``chunks_bwd`` / ``chunks_recompute``: the compute the split GEMMs
    add (`cost.tp_rings.chunk_overhead`; zeros without)."""
    return _layer_tp(workload, cluster, k, v, _pass_times(workload, cluster, k, v, kinds))


def layer_times(workload: Workload, cluster: ClusterSpec, k: Knobs, v: ProfileValues, lt: dict[str, np.ndarray],
                kinds: LayerKinds) -> dict[str, np.ndarray]:
    """Forward and backward seconds of one micro-batch on the stage (layers + pre/post + p2p)."""
    blk = v.block
    c = _pass_times(workload, cluster, k, v, kinds)
    tlink = _tp_link(cluster, k)
    tp = _layer_tp(workload, cluster, k, v, c)
    tp_f, tp_b, tp_rec = tp["fwd"], tp["bwd"], tp["recompute"]
    cp_f, cp_b = _cp_layer_times(workload, cluster, k, v)
    tp_f, tp_b = tp_f + cp_f, tp_b + cp_b

    # ZeRO / MiCS group: p devices, stride cp x t.
    zero, p, G = k.zero, k.shard_group, k.G
    ops = leaf_ops(workload, cluster)
    gk, gm, intra, inter = _group_link(cluster, p, k.tp * k.cp, k.per_node)
    fetch_ag = np.where((zero >= 3) & (p > 1), _ag(lt["w_layer_fetch"], gk, gm, intra, inter, ops.stacked), 0.0)
    # ZeRO-3 under CP: the weights are split over `context` too, gathered over it first (to the group's 1 / p).
    fetch_ag = fetch_ag + np.where((zero >= 3) & (k.context_shards > 1),
                                   _ag(lt["w_layer_fetch"] / p, *_group_link(cluster, k.cp, k.tp, k.per_node),
                                       ops.stacked), 0.0)
    h2d_link, d2h_link = cluster.device.host_to_device, cluster.device.device_to_host
    fetch_h2d = np.where(lt["w_layer_host"] > 0, host_copy_time(lt["w_layer_host"], h2d_link), 0.0)
    # ZeRO-3's reduce-scatter is the fetch's transpose (parameter dtype); ZeRO-2 scatters in the gradient dtype.
    full_layer = blk.weight_bytes * np.where(zero >= 3, 1.0, workload.grad_scale)
    rs_each = (zero >= 2) & (p > 1)
    grad_rs = np.where(rs_each, _rs(full_layer, gk, gm, intra, inter, ops.stacked), 0.0)
    # The G == 1 in-loop sync (`synced_in_loop`), deferred (`defers_row_sync`): each backward iteration
    # issues the collective of the row the previous one computed (`runtime.accumulate.sync_deferred`),
    # which XLA:GPU overlaps with this layer's backward: one more D2D channel of every layer's backward
    # (the first iteration's collective syncs the zero seed); the row still pending after each loop is
    # charged serially (`step_extras`). Not deferred, the whole per-layer sync is serial (`step_extras`).
    if capabilities(cluster).defers_row_sync:
        grad_rs = grad_rs + _grad_sync_time(cluster, k, synced_row_bytes(workload, k, v, lt), ops.stacked)
    acc_frac = np.where(G > 1, lt["acc_layer_host_frac"], 0.0)
    acc_bytes = np.where(zero >= 2, lt["g_layer_shard"], full_layer) * acc_frac
    acc_in, acc_out = host_copy_time(acc_bytes, h2d_link), host_copy_time(acc_bytes, d2h_link)
    act_out = host_copy_time(kinds.saved_off_host, d2h_link)
    act_in = host_copy_time(kinds.saved_off_host, h2d_link)
    ovl = cluster.interference
    # Each backward re-fetches the layer's weights (gather / H2D) next to its gradient reduce-scatter. Where
    # collectives run inline (XLA:CPU) they join the layer's serial part with the TP collectives.
    d2d_f: np.ndarray | float = fetch_ag
    d2d_b: np.ndarray | float = fetch_ag + grad_rs
    if not cluster.device.async_collectives:
        tp_f, tp_b, d2d_f, d2d_b = tp_f + d2d_f, tp_b + d2d_b, 0.0, 0.0

    # With collective matmuls the split GEMMs' extra kernels join the compute (zeros without).
    cf, cb = tp["chunks_fwd"], tp["chunks_bwd"]
    cr = cb + tp["chunks_recompute"]
    f_plain = overlap_time(c["f_plain"] + cf, d2d_f, fetch_h2d, 0.0, ovl) + tp_f
    f_remat = overlap_time(c["f_remat"] + cf, d2d_f, fetch_h2d, 0.0, ovl) + tp_f
    b_plain = overlap_time(c["b_plain"] + cb, d2d_b, fetch_h2d + acc_in, acc_out, ovl) + tp_b
    f_off = overlap_time(c["f_off"] + cf, d2d_f, fetch_h2d, act_out, ovl) + tp_f
    b_off = overlap_time(c["b_off"] + cr, d2d_b, fetch_h2d + acc_in + act_in, acc_out, ovl) + tp_b + tp_rec
    b_rem = overlap_time(c["b_remat"] + cr, d2d_b, fetch_h2d + acc_in, acc_out, ovl) + tp_b + tp_rec
    fwd = kinds.n_plain * f_plain + kinds.n_remat * f_remat + kinds.n_off * f_off
    bwd = kinds.n_plain * b_plain + kinds.n_off * b_off + kinds.n_remat * b_rem

    # pre / post, and the ZeRO-3 gather of non-stacked weights once per micro-batch (serial).
    for name, part, on in (("pre", v.pre, k.first), ("post", v.post, k.last)):
        pf = c[f"{name}_fwd"] + _tp_time(part, "fwd", k, tlink)
        pb = c[f"{name}_bwd"] + _tp_time(part, "bwd", k, tlink)
        fwd, bwd = fwd + np.where(on, pf, 0.0), bwd + np.where(on, pb, 0.0)
    z3 = (zero >= 3) & (p > 1)
    other_ag = np.where(z3, _ag(lt["w_other_fetch"], gk, gm, intra, inter, ops.other), 0.0)
    fwd = fwd + np.where(G > 1, 0.0, other_ag)  # with G > 1 XLA hoists it out of the loop: once per step
    bwd = bwd + np.where(z3, _rs(lt["w_other_fetch"], gk, gm, intra, inter, ops.other), 0.0)
    # Pipeline sends: the activation forward, its cotangent backward (ppermute each tick), once per chunk the
    # device group runs.
    send = np.where(k.pipelined, k.chunks * p2p_time(blk.output_bytes, cluster.p2p_link(False)), 0.0)
    # The weight-gradient GEMMs (half of the layer's backward weight GEMMs; the head's about half its backward;
    # the embedding's whole backward): what a zero-bubble schedule's W pass runs.
    wgrad = k.layers * c["ring_bwd"] + np.where(k.last, 0.5 * c["post_bwd"], 0.0) + np.where(k.first, c["pre_bwd"], 0.0)
    return {"fwd": fwd + send, "bwd": bwd + send + _cp_grad_sync(workload, cluster, k, v), "wgrad": wgrad}


def step_extras(workload: Workload, cluster: ClusterSpec, k: Knobs, v: ProfileValues, lt: dict[str, np.ndarray],
                states: StateBytes, kinds: LayerKinds) -> dict[str, np.ndarray]:
    """Once-per-step work (delta), FLOPs outside the layers, and collective bytes per step."""
    loops = sum((np.asarray(n) > 0).astype(np.float64) for n in (kinds.n_off, kinds.n_plain, kinds.n_remat))
    zero, G, t, p, dp, nl = k.zero, k.G, k.tp * k.cp, k.shard_group, k.dp, k.layers  # t: the DP groups' stride
    grad_full, grad_shard = states.grad_full, states.grad_shard
    gk, gm, intra, inter = _group_link(cluster, p, t, k.per_node)
    R = dp / p
    replicas = _group_link(cluster, R, p * t, k.per_node)
    z_eff = zero
    # The stacked layers' sync runs per layer inside the backward (`synced_in_loop`, G == 1), one collective
    # per layer (``sync_bwd``; docs/cost_model.md, "Gradient sync in the backward"). Deferred
    # (`defers_row_sync`), each layer's collective runs under the next layer's backward (a D2D channel of
    # `layer_times`) and only the first row of each layer loop (one per layer kind), synchronised after
    # its loop, stays exposed; otherwise (XLA:CPU's synchronous collectives) every layer's is serial.
    deferred = capabilities(cluster).defers_row_sync
    row = synced_row_bytes(workload, k, v, lt)
    ops = leaf_ops(workload, cluster)
    sync_bwd = (loops if deferred else nl) * _grad_sync_time(cluster, k, row, ops.stacked)
    sync = _grad_sync_time(cluster, k, np.maximum(grad_full - nl * row, 0.0),
                           np.where(row > 0, ops.other, ops.total))
    sync = sync + np.where(z_eff >= 1, hierarchical_all_reduce_time(grad_shard, *replicas), 0.0)
    # After the update the weights are gathered from the optimizer state's shards: under context parallelism
    # first over `context` (the state is split over the data x context group: `core.layout.shard_split`) to
    # the partition group's shard, then (ZeRO-1 / 2) over the partition group, as XLA does it.
    ctx = k.context_shards
    regather = np.where((zero >= 1) & (zero <= 2), _ag(states.param_full, gk, gm, intra, inter, ops.total), 0.0)
    # (ZeRO-3's weights stay split over `context`: `core.layout.plan_layouts`.)
    regather = regather + np.where((ctx > 1) & (zero <= 2),
                                   _ag(states.param_full / p, *_group_link(cluster, ctx, k.tp, k.per_node), ops.total),
                                   0.0)
    copies, opt_flops, opt_trans = OPTIMIZERS[workload.optimizer]
    upd_bytes = np.where(zero >= 1, grad_shard / ctx, grad_full)  # the update runs on shards under ZeRO >= 1
    dev = cluster.device
    # The update overwrites the donated state in place (`DeviceSpec.update_bandwidth`).
    update = upd_bytes * (3 + 2 * copies) / (dev.update_bandwidth * dev.memory_efficiency)
    swap = host_copy_time(states.host_state, dev.host_to_device) + host_copy_time(states.host_state, dev.device_to_host)
    z3 = (zero >= 3) & (p > 1)
    hoisted = np.where(z3 & (G > 1), _ag(lt["w_other_fetch"], gk, gm, intra, inter, ops.other), 0.0)
    # A tied leaf (a tied embedding) is held by the first and the last stage: once per step, before the
    # update, each sends the other its gradient summand (`runtime.mpmd`, tied gradients).
    tied = np.where(k.pipelined & (k.first | k.last), p2p_time(lt["g_tied"], cluster.p2p_link(False)), 0.0)
    sync = sync + _cp_step_sync(workload, cluster, k, v)  # the layer weights' partials over `context`
    delta = sync + sync_bwd + regather + update + swap + hoisted + tied
    # FLOPs outside the layers: the optimizer (elementwise) and the gradient scaling; accumulation adds.
    g_item = workload.param_itemsize * workload.grad_scale  # bytes per gradient element
    elems_upd = upd_bytes / g_item
    elems_full = grad_full / g_item
    acc_elems = np.where(zero >= 2, grad_shard, grad_full) / g_item
    flops = elems_upd * (opt_flops + opt_trans) + elems_full + np.where(G > 1, G * acc_elems, 0.0)
    flops_xla = elems_upd * (opt_flops + opt_trans) + elems_full + np.where(G > 1, acc_elems, 0.0)
    # Collective result bytes per step (per device, fp32 as computed), excluding tensor parallelism.
    fetch, other = lt["w_layer_fetch"], lt["w_other_fetch"]
    # Every layer gathers its weights twice per micro-batch (forward, backward re-fetch); XLA hoists the
    # loop-invariant gather of the non-stacked weights out of the micro-batch scan.
    ag = np.where(z3, G * 2.0 * nl * fetch + other, 0.0)
    ag = ag + np.where((zero >= 1) & (zero <= 2) & (p > 1), states.param_full, 0.0)
    ag = ag + np.where((k.context_shards > 1) & (zero <= 2), states.param_full / p, 0.0)
    ag = ag + np.where(z3 & (k.context_shards > 1), G * 2.0 * nl * fetch / p, 0.0)  # ZeRO-3's gather over context
    rs = np.where(z3, G * (grad_shard), 0.0)
    rs = rs + np.where((z_eff == 2) & (p > 1), G * grad_shard, 0.0) + np.where((z_eff == 1) & (p > 1), grad_shard, 0.0)
    ar = np.where(z_eff == 0, grad_full, 0.0) + np.where((z_eff >= 1) & (R > 1), grad_shard, 0.0) + 4.0
    if deferred:  # the first backward iteration of each loop synchronises the zero seed: one more row
        seed = loops * row
        ar, rs = ar + np.where(zero == 0, seed, 0.0), rs + np.where(zero == 1, seed / np.maximum(p, 1), 0.0)
    cp = _cp_comm(workload, k, v, kinds)
    return {"delta": delta, "flops": flops, "flops_xla": flops_xla,
            "comm.all-gather": ag + cp.get("all-gather", 0.0),
            "comm.reduce-scatter": rs + cp.get("reduce-scatter", 0.0), "comm.all-reduce": ar + cp["all-reduce"],
            "comm.collective-permute": cp.get("collective-permute", np.zeros_like(ar)),
            "comm.all-to-all": cp.get("all-to-all", np.zeros_like(ar)),
            "sync": sync, "sync_bwd": sync_bwd, "regather": regather,
            "update": update, "swap": swap, "tied": tied}


__all__ = ["acc_scale", "capabilities", "compute_time", "context_kv_bytes", "context_partial", "kv_repeat",
           "layer_times", "layer_tp_times", "step_extras", "synced_in_loop", "synced_row_bytes"]
