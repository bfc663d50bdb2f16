"""The vectorised stage cost: step time and per-device memory of arrays of stage strategies.

`stage_cost` prices every strategy of a `StageStrategies` at once with NumPy and describes what the
runtime does; what it charges for each runtime behaviour: docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mistjax.analysis.compiled import ProfileValues
from mistjax.core.execution import double_buffered, scan_bodies, scan_unroll
from mistjax.core.hlo import CollectiveOp
from mistjax.core.plan import guarded_peak
from mistjax.core.stages import offloaded_layers
from mistjax.core.strategies import StageStrategies
from mistjax.cost.knobs import Knobs, LayerKinds, StateBytes
from mistjax.cost.layout import totals_over
from mistjax.cost.stage_time import (
    KINDS,
    acc_scale,
    capabilities,
    context_kv_bytes,
    kv_repeat,
    layer_times,
    step_extras,
    synced_in_loop,
    syncs_rows_in_loop,
)
from mistjax.cost.workload import Workload
from mistjax.hardware.presets import ClusterSpec

MEMORY_CATEGORIES = ("params", "optimizer", "grads", "activations", "buffers")


@dataclass(frozen=True)
class StageCost:
    """Costs of each strategy (arrays of the strategies' broadcast shape).

    Only memory depends on ``inflight``: extra axes of it (one per pipeline schedule, as the tuner
    passes) appear in ``memory``, ``peak``, ``feasible`` and ``host``; time and FLOP arrays leave them out
    and broadcast against them.
    """

    stable: np.ndarray  # seconds of one steady micro-batch (forward + backward)
    delta: np.ndarray  # extra seconds of the first + last micro-batch incl. once-per-step work
    fwd: np.ndarray  # forward part of `stable` (for the lock-step pipeline time)
    bwd: np.ndarray  # backward part of `stable`
    memory: dict[str, np.ndarray]  # per-device bytes by category (MEMORY_CATEGORIES)
    peak: np.ndarray  # per-device peak bytes (sum of the categories)
    feasible: np.ndarray  # peak within the memory budget and t divides the split sizes
    offload_floor: np.ndarray  # bytes no smaller offload ratios can bring the guarded peak below (`_offload_floor`)
    host: np.ndarray = field(default_factory=lambda: np.zeros(()))  # host bytes per device (offloaded)
    host_acts: np.ndarray = field(default_factory=lambda: np.zeros(()))  # offloaded activations, part of `host`
    flops: np.ndarray = field(default_factory=lambda: np.zeros(()))  # FLOPs per device per step
    flops_xla: np.ndarray = field(default_factory=lambda: np.zeros(()))  # FLOPs as XLA's cost_analysis counts
    flops_xla_step: np.ndarray = field(default_factory=lambda: np.zeros(()))  # once-per-step part of `flops_xla`
    comm: dict[str, np.ndarray] = field(default_factory=dict)  # collective result bytes per step, by kind
    optimizer_step: np.ndarray = field(default_factory=lambda: np.zeros(()))  # seconds of `delta` in the optimizer
    # step: the update and the ZeRO-1/2 re-gather of the updated parameters
    wgrad: np.ndarray = field(default_factory=lambda: np.zeros(()))  # part of `bwd` in the weight-gradient
    # GEMMs (what a zero-bubble schedule defers)
    # One micro-batch's residuals in device memory, and one deferred weight pass's stash (zero-bubble): what a
    # device group's peak along its operations adds up (`cost.predict`, `core.pipeline_order.group_residual_peaks`)
    residual: np.ndarray = field(default_factory=lambda: np.zeros(()))
    stash: np.ndarray = field(default_factory=lambda: np.zeros(()))

    @property
    def xla_cpu_peak(self) -> np.ndarray:
        """What XLA:CPU's memory analysis reports: host-placed buffers count as ordinary ones there."""
        return self.peak + self.host


def layer_kinds(workload: Workload, k: Knobs, v: ProfileValues) -> LayerKinds:
    """The stage's layer kinds: the first ``round(ao (l - c))`` offload, the last ``c`` recompute."""
    c = k.remat
    n_off = np.where(k.ao > 0, offloaded_layers(k.layers, c, k.ao), 0.0)
    off_pol = workload.offload_policy() or "full"
    saved_c = np.where(c > 0, v.block.pick(v.block.saved_bytes, workload.policies, k.policy), 0.0)
    n_plain = k.layers - c - n_off
    # A deferred weight-gradient pass's stash per layer under the layer's policy (`analysis` stash_bytes).
    stash = (n_plain * v.block.stash_bytes("none") + n_off * v.block.stash_bytes(off_pol)
             + np.where(c > 0, c * v.block.pick(v.block.stash_bytes, workload.policies, k.policy), 0.0))
    # Ulysses keeps its head-split keys / values as residuals, each kv head repeated where there are fewer than
    # cp devices (`runtime.context_attention._ulysses_forward`): (repeat - 1) more copies than the profile's.
    repeated = np.where(k.ulysses & (k.cp > 1), (kv_repeat(workload, k) - 1.0) * context_kv_bytes(workload, v), 0.0)
    return LayerKinds(n_off=n_off, n_plain=n_plain, n_remat=c, saved_plain=v.block.saved_bytes("none") + repeated,
                      saved_remat=saved_c,
                      saved_off_host=np.maximum(v.block.saved_bytes(off_pol) - v.block.output_bytes, 0.0),
                      offload_policy=off_pol, stash=stash)


def _residual(k: Knobs, v: ProfileValues, kinds: LayerKinds) -> np.ndarray:
    """Device bytes of one micro-batch's residuals on the stage."""
    # Plain layers keep only activation-dependent residuals; fetched weights are re-fetched in backward.
    per_mb = (kinds.n_plain * kinds.saved_plain + kinds.n_remat * kinds.saved_remat
              + kinds.n_off * v.block.output_bytes)
    per_mb = per_mb + np.where(k.first, v.pre.saved_bytes("none"), 0.0)
    return per_mb + np.where(k.last, v.post.saved_bytes("none"), 0.0)


def _activations(k: Knobs, v: ProfileValues, kinds: LayerKinds) -> tuple[np.ndarray, np.ndarray]:
    """(device, host) activation bytes: residuals of ``inflight`` micro-batches."""
    return (k.inflight * _residual(k, v, kinds) + k.deferred * _stash(k, v, kinds),
            k.inflight * kinds.n_off * kinds.saved_off_host)


def _stash(k: Knobs, v: ProfileValues, kinds: LayerKinds) -> np.ndarray:
    """Bytes one deferred weight-gradient pass holds (`runtime.mpmd_split`): what its layers' weight gradients
    read of the input-gradient pass (`LayerKinds.stash`), and the head's on the last stage."""
    return kinds.stash + np.where(k.last, v.post.stash_bytes("none"), 0.0)


def state_bytes(workload: Workload, k: Knobs, v: ProfileValues, lt: dict[str, np.ndarray], *,
                deferred: bool) -> StateBytes:
    """What the runtime stores for the stage's model states (`mistjax.runtime.grads`, `runtime.mpmd_stage`).

    A stage holds its own layers' rows of the stacked leaves and the other leaves its parts read
    (`cost.layout.held`: the embedding on the first stage, the head on the last; a single stage all).
    `deferred`: the in-loop sync is issued one layer late (`core.execution.Capabilities.defers_row_sync`).
    """
    nl, zero, G = k.layers, k.zero, k.G
    params = nl * lt["w_layer_dev"] + lt["w_other_dev"]
    optimizer = nl * lt["opt_layer_dev"] + lt["opt_other_dev"]
    host_state = nl * (lt["w_layer_host"] + lt["opt_layer_host"]) + lt["opt_other_host"]
    param_layer = v.block.weight_bytes
    param_other = np.where(k.first, v.pre.weight_bytes, 0.0) + np.where(k.last, v.post.weight_bytes, 0.0)
    scale = workload.grad_scale
    full_layer, full_other = param_layer * scale, param_other * scale  # in the gradient dtype
    grad_full = nl * full_layer + full_other
    grad_shard = nl * lt["g_layer_shard"] + lt["g_other_shard"]
    on_dev = 1 - lt["acc_layer_host_frac"]
    # One micro-batch's gradients as autodiff produces them (parameter dtype; ZeRO-3's come reduce-
    # scattered), next to the accumulator of the gradient dtype whenever there is one: several micro-
    # batches, or any pipeline stage (its backward program adds into a donated accumulator). The layers'
    # gradients with a device accumulator are added into it inside the backward layer loop
    # (`runtime.accumulate`): only the other leaves' (and host-accumulated layers') are whole first.
    mb_layer = np.where(zero >= 3, lt["g_layer_shard"], full_layer) / scale
    mb_other = np.where(zero >= 3, lt["g_other_shard"], full_other) / scale
    mb_grads = nl * mb_layer + mb_other

    def accumulated(on_dev: np.ndarray | float) -> np.ndarray:  # with a fraction ``on_dev`` of the layers'
        acc_full = nl * full_layer * on_dev + full_other  # accumulators on the device
        acc_shard = nl * lt["g_layer_shard"] * on_dev + lt["g_other_shard"]
        in_loop = nl * mb_layer * on_dev if workload.layer_grads_in_loop else 0.0
        return np.where(zero >= 2, acc_shard, acc_full) + mb_grads - in_loop

    accumulates = (G > 1) | k.pipelined
    # An in-loop sync (`cost.stage_time.synced_in_loop`, G == 1) writes the synchronised rows into a result
    # buffer instead of the layers' whole micro-batch gradient (ZeRO-0: the whole rows, in the gradient
    # dtype; ZeRO-1: only the shard), plus, deferred, the one row pending its collective
    # (`runtime.accumulate.sync_deferred`).
    def unaccumulated(synced: np.ndarray | float) -> np.ndarray:  # a fraction ``synced`` of the layer rows
        rest = mb_grads - nl * mb_layer * synced
        out = nl * synced * np.where(zero == 1, lt["g_layer_shard"], full_layer)
        if deferred:
            out = out + synced * full_layer
        return np.maximum(rest, rest * scale) + out

    grads = np.where(accumulates, accumulated(on_dev), unaccumulated(synced_in_loop(workload, k, lt)))
    # Both are linear in the accumulators' device fraction (rest >= 0): the least over every fraction is at 0 or 1.
    in_loop = syncs_rows_in_loop(workload, k).astype(np.float64)
    grads_floor = np.where(accumulates, np.minimum(accumulated(0.0), accumulated(1.0)),
                           np.minimum(unaccumulated(0.0), unaccumulated(in_loop)))
    acc_host = nl * np.where(zero >= 2, lt["g_layer_shard"], full_layer) * lt["acc_layer_host_frac"]
    return StateBytes(params=params, optimizer=optimizer, grads=grads, grads_floor=grads_floor,
                      host=host_state + np.where(accumulates, acc_host, 0.0), grad_full=grad_full,
                      grad_shard=grad_shard, param_full=nl * param_layer + param_other, host_state=host_state,
                      grad_tied=lt["g_tied"])


def _buffers(workload: Workload, k: Knobs, v: ProfileValues, lt: dict[str, np.ndarray], kinds: LayerKinds,
             double_buffer: np.ndarray) -> np.ndarray:
    """Transient device bytes: the largest liveness peak, recompute space, fetched weights, the batch.
    `double_buffer`: per strategy, `core.execution.double_buffered`."""
    pols, c = workload.policies, kinds.n_remat
    blk_peak = np.maximum(v.block.bwd_peak_bytes("none"), v.block.fwd_peak_bytes("none"))
    blk_peak = np.maximum(blk_peak, np.where(c > 0, v.block.pick(v.block.bwd_peak_bytes, pols, k.policy), 0.0))
    part_peak, whole_step = _part_peak(k, v, lt)
    # A checkpointed layer's backward peak (bwd_peak[policy]) already holds its recomputed residuals;
    # what XLA adds is at most the residuals its policy did not keep next to the plain backward's
    # transients (measured: charging both on top of each other over-predicted remat cells by 10-26%).
    # An activation-offloaded layer recomputes everything it did not offload.
    remat_bwd = np.where(c > 0, kinds.saved_plain - kinds.saved_remat + v.block.bwd_peak_bytes("none") - blk_peak, 0.0)
    recompute = np.maximum(np.maximum(remat_bwd, 0.0), np.where(kinds.n_off > 0, kinds.saved_plain, 0.0))
    # Fetched layer weights live only inside the layer loops: two layers at once in a scan unrolled by 2
    # (`core.execution.scan_unroll`; forward, and backward where they are fetched again), one otherwise.
    # They are never live next to pre / post's transients.
    unrolled = (scan_unroll(kinds.n_plain, False, double_buffer) == 2) | (scan_unroll(kinds.n_remat, False,
                                                                                       double_buffer) == 2)
    layer_fetch = np.where(unrolled, 2.0, 1.0) * lt["w_layer_fetch"]
    # Context parallelism: the ring's key / value shards in flight (the received one and the next) and the float32
    # dK / dV travelling with them; without the ring kernel, one layer's keys and values gathered whole and their
    # gradients before the scatter.
    # Ulysses: the head-split queries / keys / values it received (then ``do``) and the float32 dq / dK / dV.
    kv = context_kv_bytes(workload, v)
    acc = acc_scale(workload)
    ring = np.where(k.ulysses, v.block.output_bytes + kv_repeat(workload, k) * kv, 2.0 * kv) * (1.0 + acc)
    gathered_kv = np.where(k.cp > 1, ring if workload.ring_attention else 2.0 * kv * k.cp, 0.0)
    return (np.maximum(blk_peak + recompute + layer_fetch + gathered_kv, part_peak) + whole_step
            + _batch_and_messages(workload, k, v) + _segment_slices(workload, k, kinds, lt))


def _batch_and_messages(workload: Workload, k: Knobs, v: ProfileValues) -> np.ndarray:
    """The local batch's int32 inputs and targets, and on a pipeline stage the activation it received and the
    cotangent waiting for its backward. (The optimizer update runs in place on the donated state: no extra
    copy of it is charged.)"""
    tokens = k.b * k.G * float(workload.seq_len) / k.cp * 4.0 * 2.0
    return tokens + np.where(k.pipelined, 2.0 * v.block.output_bytes, 0.0)


def _offload_floor(workload: Workload, k: Knobs, v: ProfileValues, states: StateBytes, activations: np.ndarray,
                   margin: float) -> np.ndarray:
    """A lower bound of the guarded peak (`core.plan.guarded_peak`) of every strategy that differs from this
    one only in offload ratios no larger than its own.

    The guarded peak is ``state + (1 + margin) * max(activations + transients, update extra)``. Lowering a
    ratio never shrinks the stored parameters, optimizer state or activations; the gradient buffers are
    bounded by their least over every accumulator placement (`StateBytes.grads_floor`); parameters +
    optimizer state on the device plus what the update brings in (`_update_extra`) are the same at every
    ratio. The transients counted are the ones no ratio changes: a plain layer's liveness peak, the batch and
    the pipeline messages.
    """
    grad_shard = np.where((k.zero >= 1) & (k.zero <= 2), states.grad_shard, 0.0)
    held = states.params + states.optimizer + states.grads_floor
    via_update = held + states.host_state + (1.0 + margin) * grad_shard
    plain_peak = np.maximum(v.block.bwd_peak_bytes("none"), v.block.fwd_peak_bytes("none"))
    via_layers = held + (1.0 + margin) * (activations + plain_peak + _batch_and_messages(workload, k, v))
    return np.maximum(via_update, via_layers)


def _update_extra(k: Knobs, states: StateBytes) -> np.ndarray:
    """Device bytes the optimizer update holds besides the stored states, once the activations are gone:
    the offloaded weights and optimizer state it brings onto the device (XLA copies a host-placed
    argument in before computing on it), and with ZeRO-1/2 the reduce-scattered gradient shard it reads
    next to the accumulators. Measured on XLA:GPU's compile of the pipeline's update programs (an L4
    falcon-7b stage: 5.0 GiB of temporaries for 4.0 GiB of offloaded optimizer state). A pipeline's first and
    last stage also hold the other's summand of a tied leaf's gradient (`LeafTotals.g_tied`)."""
    tied = np.where(k.pipelined & (k.first | k.last), states.grad_tied, 0.0)
    return states.host_state + np.where((k.zero >= 1) & (k.zero <= 2), states.grad_shard, 0.0) + tied


def _part_peak(k: Knobs, v: ProfileValues, lt: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(pre / post transient peak, ZeRO-3-gathered embedding / head bytes live for the whole step).

    With G > 1 XLA hoists the (loop-invariant) gathers of embedding and head out of the micro-batch loop,
    so both live for the whole step (a pipeline's stage programs are charged the same); with G == 1 each
    is gathered where its part runs and freed after its last use (measured on XLA:CPU: ZeRO-3 gpt3-small
    s32 b2 holds only the gathered head at its peak), so it joins its part's peak.
    """
    hoisted = (k.G > 1) | k.pipelined
    post = v.post.fwd_peak_bytes("none") + v.post.bwd_peak_bytes("none") + np.where(hoisted, 0.0, lt["w_post_fetch"])
    pre = v.pre.fwd_peak_bytes("none") + v.pre.bwd_peak_bytes("none") + np.where(hoisted, 0.0, lt["w_pre_fetch"])
    return (np.maximum(np.where(k.last, post, 0.0), np.where(k.first, pre, 0.0)),
            np.where(hoisted, lt["w_other_fetch"], 0.0))


def _segment_slices(workload: Workload, k: Knobs, kinds: LayerKinds, lt: dict[str, np.ndarray]) -> np.ndarray:
    """A stack run as several segments (offloaded / plain / checkpointed layers) without in-loop gradient
    accumulation scans slices of the stacked weights (`runtime.remat.make_layer_loop`: ``x[start:end]``). A
    slice is a new buffer in XLA (a loop operand cannot alias part of another buffer), read again by the
    segment's backward scan: one more copy of the stage's stored layer weights for the whole step (seen in
    XLA:CPU's buffer assignment). With in-loop accumulation (several micro-batches, or any pipeline stage)
    each layer reads its rows of the whole stacks instead (`runtime.accumulate.scan_rows`); only the leaves
    with a host accumulator (not accumulated in the loop) are still sliced."""
    kinds_present = ((kinds.n_off > 0).astype(float) + (kinds.n_plain > 0) + (kinds.n_remat > 0))
    in_loop = ((k.G > 1) | k.pipelined) & workload.layer_grads_in_loop
    sliced = np.where(in_loop, lt["w_layer_dev_acc_host"], lt["w_layer_dev"])
    return np.where(kinds_present > 1, k.layers * sliced, 0.0)


def _flops(workload: Workload, k: Knobs, v: ProfileValues, lt: dict[str, np.ndarray], kinds: LayerKinds,
           step: dict[str, np.ndarray], double_buffer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FLOPs per device per step, and as XLA's cost analysis counts them (each loop body once)."""
    c = kinds.n_remat
    blk = v.block.fwd_flops + v.block.bwd_flops
    rec_c = np.where(c > 0, v.block.pick(v.block.recompute_flops, workload.policies, k.policy), 0.0)
    rec_off = v.block.recompute_flops(kinds.offload_policy)
    parts = (np.where(k.first, v.pre.fwd_flops + v.pre.bwd_flops, 0.0)
             + np.where(k.last, v.post.fwd_flops + v.post.bwd_flops, 0.0))
    flops = k.G * (k.layers * blk + c * rec_c + kinds.n_off * rec_off + parts) + step["flops"]

    # XLA counts a loop body once: the micro-batch loop (G > 1) and each layer scan's body
    # (`core.execution.scan_bodies`); the pipeline executor's programs are not counted that way.
    # (A pipeline stage's programs are counted by the executor's own programs, not this loop rule.)
    fetching = double_buffer & ~k.pipelined
    cnt_plain, cnt_c = scan_bodies(kinds.n_plain, False, fetching), scan_bodies(c, False, fetching)
    cnt_off = scan_bodies(kinds.n_off, True, fetching)
    mb_xla = (cnt_plain + cnt_c + cnt_off) * blk + cnt_c * rec_c + cnt_off * rec_off + parts
    # The layers' accumulation adds run inside the layer loops (`runtime.accumulate`): XLA counts the
    # counted layers' rows, not the whole stack (`step` charges the whole accumulator once).
    scale = workload.grad_scale
    row = np.where(k.zero >= 2, lt["g_layer_shard"], v.block.weight_bytes * scale) / (workload.param_itemsize * scale)
    in_loop = (k.G > 1) & ~k.pipelined & workload.layer_grads_in_loop
    rows = row * (1 - lt["acc_layer_host_frac"]) * (cnt_plain + cnt_c + cnt_off - k.layers)
    return flops, mb_xla + step["flops_xla"] + np.where(in_loop, rows, 0.0)


@dataclass(frozen=True)
class StageMemory:
    """The memory side of `StageCost` (what fitting needs), and what pricing time reads next."""

    memory: dict[str, np.ndarray]  # per-device bytes by category (MEMORY_CATEGORIES)
    peak: np.ndarray  # per-device peak bytes (sum of the categories)
    feasible: np.ndarray  # the guarded peak within the memory budget and t divides the split sizes
    offload_floor: np.ndarray  # `_offload_floor`
    host: np.ndarray  # host bytes per device (offloaded states and activations)
    host_acts: np.ndarray  # offloaded activations, part of `host`
    knobs: Knobs
    values: ProfileValues
    totals: dict[str, np.ndarray]  # `cost.layout.totals_over` of the strategies
    kinds: LayerKinds
    states: StateBytes


def stage_memory(workload: Workload, cluster: ClusterSpec, st: StageStrategies) -> StageMemory:
    """Per-device memory and feasibility of every strategy of ``st`` (`stage_cost` without the times).

    Feasibility covers memory (the peak with the device's `memory_margin` on its non-state part,
    `mistjax.core.plan.guarded_peak`, within ``cluster.memory_budget()``) and tensor-parallel divisibility;
    ``b * dp * G`` matching the global batch is the tuner's job.
    """
    k = Knobs.of(st)
    s = float(workload.seq_len) / k.cp  # each device's part of a sequence (context parallelism)
    v = workload.compiled.values(k.b, s, k.tp)
    # A single stage holds everything; a pipeline stage its own rows and parts (`cost.layout.held`).
    one = ~k.pipelined
    lt = totals_over(workload, (k.tp, np.where(k.zero >= 1, k.shard_group, 1), k.zero, k.wo, k.oo, k.go, k.first | one,
                                k.last | one, np.where(one, workload.num_layers, k.layers), k.context_shards))
    kinds = layer_kinds(workload, k, v)
    activations, act_host = _activations(k, v, kinds)
    states = state_bytes(workload, k, v, lt, deferred=capabilities(cluster).defers_row_sync)
    double_buffer = double_buffered(capabilities(cluster).double_buffers_fetches, lt["w_layer_fetch"] > 0)
    buffers = np.maximum(_buffers(workload, k, v, lt, kinds, double_buffer), _update_extra(k, states) - activations)
    memory = {"params": states.params, "optimizer": states.optimizer, "grads": states.grads,
              "activations": activations, "buffers": buffers}
    margin = cluster.device.memory_margin
    ok_tp = workload.compiled.feasible(k.b, s, k.tp)
    return StageMemory(memory=memory, peak=sum(memory.values()),
                       feasible=(guarded_peak(memory, margin) <= cluster.memory_budget()) & ok_tp,
                       offload_floor=_offload_floor(workload, k, v, states, activations, margin),
                       host=states.host + act_host, host_acts=act_host, knobs=k, values=v, totals=lt, kinds=kinds,
                       states=states)


def stage_cost(workload: Workload, cluster: ClusterSpec, st: StageStrategies) -> StageCost:
    """Price every strategy of ``st`` on ``cluster`` (vectorised; no Python loop per strategy): `stage_memory`
    and the times."""
    m = stage_memory(workload, cluster, st)
    k, v, lt, kinds = m.knobs, m.values, m.totals, m.kinds
    lay = layer_times(workload, cluster, k, v, lt, kinds)
    ext = step_extras(workload, cluster, k, v, lt, m.states, kinds)
    double_buffer = double_buffered(capabilities(cluster).double_buffers_fetches, lt["w_layer_fetch"] > 0)
    flops, flops_xla = _flops(workload, k, v, lt, kinds, ext, double_buffer)
    return StageCost(stable=lay["fwd"] + lay["bwd"], delta=ext["delta"], fwd=lay["fwd"], bwd=lay["bwd"],
                     memory=m.memory, peak=m.peak, feasible=m.feasible, offload_floor=m.offload_floor, host=m.host,
                     host_acts=m.host_acts, flops=flops, flops_xla=flops_xla, flops_xla_step=ext["flops_xla"],
                     comm={kd: ext[f"comm.{kd}"] for kd in (*KINDS, CollectiveOp.COLLECTIVE_PERMUTE,
                                                              CollectiveOp.ALL_TO_ALL)},
                     optimizer_step=ext["update"] + ext["regather"], wgrad=np.minimum(lay["wgrad"], lay["bwd"]),
                     residual=_residual(k, v, kinds), stash=_stash(k, v, kinds))


__all__ = ["MEMORY_CATEGORIES", "StageCost", "StageMemory", "StageStrategies", "layer_kinds", "stage_cost",
           "stage_memory", "state_bytes"]
