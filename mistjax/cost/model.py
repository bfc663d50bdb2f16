"""The vectorised stage cost: step time and per-device memory of arrays of stage strategies.

`stage_cost(workload, cluster, st)` prices every strategy of `StageStrategies` at once with NumPy
(no Python loop per strategy). It describes what the runtime does (`mistjax.runtime`):

* Layer loop (`runtime.remat`): of a stage's ``l`` layers the last ``c`` are checkpointed with the
  stage's policy, the first ``round(ao (l - c))`` offload their tagged activations to host and
  recompute the rest, the others keep everything. With per-layer fetches (ZeRO-3 gathers, host
  weights) every layer fetches its weights in its forward and again in its backward: plain layers
  through the runtime's re-fetching custom VJP (their residuals are only the activation-dependent
  ones, ``saved[none]``, no fetched weights or views of them), checkpointed and offloaded layers by
  recomputation. Two fetched layers are live at once (scan of > 2 layers unrolled by 2, forward and
  backward).
* Gradients (`runtime.grads`): ZeRO-0/1 accumulate full fp32 gradients and all-reduce (0) or
  reduce-scatter (1) at the end; ZeRO-2 reduce-scatters every micro-batch; ZeRO-3 reduce-scatters
  per layer through autodiff; MiCS adds one all-reduce of the shards over the replicas per step.
  ZeRO-1/2 plans all-gather the updated parameters after the GSPMD optimizer update.
* Time per layer phase is Mist's: ``I(compute, d2d, h2d, d2h) + TP collectives`` with the
  four-channel interference model; once-per-step work (gradient sync, optimizer update,
  ZeRO all-gather, optimizer-state offload traffic) goes to ``delta``.

Memory categories per device: ``params``, ``optimizer``, ``grads``, ``activations``, ``buffers``
(transients, fetch double buffers, batch). ``host`` (offloaded state, reported separately) is not
device memory, but XLA:CPU counts it in ``memory_analysis``; `StageCost.xla_cpu_peak` adds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from mistjax.core.strategies import StageStrategies
from mistjax.cost.layout import totals_over
from mistjax.cost.stage_time import layer_times, step_extras
from mistjax.cost.workload import Workload

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
    host: np.ndarray = field(default_factory=lambda: np.zeros(()))  # host bytes per device (offloaded)
    host_acts: np.ndarray = field(default_factory=lambda: np.zeros(()))  # offloaded activations, part of `host`
    flops: np.ndarray = field(default_factory=lambda: np.zeros(()))  # FLOPs per device per step
    flops_xla: np.ndarray = field(default_factory=lambda: np.zeros(()))  # FLOPs as XLA's cost_analysis counts
    flops_xla_step: np.ndarray = field(default_factory=lambda: np.zeros(()))  # once-per-step part of `flops_xla`
    comm: dict[str, np.ndarray] = field(default_factory=dict)  # collective result bytes per step, by kind

    @property
    def xla_cpu_peak(self) -> np.ndarray:
        """What XLA:CPU's memory analysis reports: host-placed buffers count as ordinary ones there."""
        return self.peak + self.host


def _pick(values: dict[str, np.ndarray], key: str, policies: tuple[str, ...], index: np.ndarray) -> np.ndarray:
    """``values[key[policy]]`` with the policy chosen per strategy (vectorised)."""
    stack = np.stack([values[f"{key}[{p}]"] for p in policies])
    idx = np.broadcast_to(index, stack.shape[1:]).astype(np.int64)
    return np.take_along_axis(stack, idx[None], axis=0)[0]


def stage_cost(workload: Workload, cluster: object, st: StageStrategies) -> StageCost:
    """Price every strategy of ``st`` on ``cluster`` (a `mistjax.hardware.ClusterSpec`).

    Feasibility covers memory (``peak <= cluster.memory_budget()``) and tensor-parallel divisibility;
    ``b * dp * G`` matching the global batch is the tuner's job.
    """
    # Everything but the in-flight count is broadcast up front; in-flight only scales activation memory,
    # so extra axes of it (one per pipeline schedule, `tune.intra.price_pairs`) cost no extra time work.
    shape = np.broadcast_shapes(*(np.shape(getattr(st, f.name)) for f in fields(st) if f.name != "inflight"))
    A = {f.name: np.broadcast_to(np.asarray(getattr(st, f.name)), shape) for f in fields(st) if f.name != "inflight"}
    A["inflight"] = np.asarray(st.inflight)
    b, t = A["b"].astype(np.float64), A["tp"].astype(np.float64)
    s = float(workload.seq_len)
    zero = A["zero"].astype(np.int64)
    p = np.where(A["shard_group"] <= 0, A["dp"], A["shard_group"]).astype(np.float64)
    dp = A["dp"].astype(np.float64)
    nl = A["layers"].astype(np.float64)
    c = np.minimum(A["remat"], A["layers"]).astype(np.float64)
    G = A["G"].astype(np.float64)
    S = A["stages"].astype(np.float64)
    first, last = A["first"].astype(bool), A["last"].astype(bool)
    pol = A["policy"].astype(np.int64)
    L = float(workload.num_layers)
    v = workload.compiled(b, s, t)
    pols = workload.policies
    lt = totals_over(workload, (t, np.where(zero >= 1, p, 1), zero, A["wo"], A["oo"], A["go"]))

    # ---------------------------------------------------------------- layer kinds
    n_off = np.where(A["ao"] > 0, np.round(A["ao"] * (nl - c)), 0.0)
    n_plain = nl - c - n_off
    saved_none = v["block.saved_bytes[none]"]
    saved_c = np.where(c > 0, _pick(v, "block.saved_bytes", pols, pol), 0.0)
    off_pol = workload.offload_policy() or "full"
    saved_off_host = np.maximum(v[f"block.saved_bytes[{off_pol}]"] - v["block.output_bytes"], 0.0)
    fetch = lt["w_layer_fetch"]  # full bytes of one layer's fetched leaves (0 without ZeRO-3 / host weights)
    # Plain layers keep only activation-dependent residuals; fetched weights are re-fetched in backward.
    res_mb = n_plain * saved_none + c * saved_c + n_off * v["block.output_bytes"]
    res_mb = res_mb + np.where(first, v["pre.saved_bytes[none]"], 0.0)
    res_mb = res_mb + np.where(last, v["post.saved_bytes[none]"], 0.0)
    act_host = A["inflight"] * n_off * saved_off_host
    activations = A["inflight"] * res_mb

    # ---------------------------------------------------------------- states
    pipelined = S > 1
    stored_layers = np.where(pipelined, np.where(L % np.maximum(S, 1) == 0, L / np.maximum(S, 1), L), nl)
    params = stored_layers * lt["w_layer_dev"] + lt["w_other_dev"]
    optimizer = stored_layers * lt["opt_layer_dev"] + lt["opt_other_dev"]
    host = (stored_layers * (lt["w_layer_host"] + lt["opt_layer_host"]) + lt["opt_other_host"] + act_host)
    full_layer = v["block.weight_bytes"]
    full_other = v["pre.weight_bytes"] + v["post.weight_bytes"]
    grad_full = nl * full_layer + full_other
    grad_shard = nl * lt["g_layer_shard"] + lt["g_other_shard"]
    acc_dev_full = nl * full_layer * (1 - lt["acc_layer_host_frac"]) + full_other
    acc_dev_shard = nl * lt["g_layer_shard"] * (1 - lt["acc_layer_host_frac"]) + lt["g_other_shard"]
    # Single stage: G == 1 -> one set of gradients (full unless ZeRO-3); G > 1 -> accumulator + one
    # micro-batch's gradients. Pipelines: fp32 accumulators of Lmax rows plus replicated pre/post.
    mb_grads = np.where(zero >= 3, grad_shard, grad_full)
    acc = np.where(zero >= 2, acc_dev_shard, acc_dev_full)
    grads_single = np.where(G > 1, acc + mb_grads, mb_grads)
    grads_pipe = nl * full_layer + full_other + np.where(zero >= 1, grad_shard, 0.0)
    grads = np.where(pipelined, grads_pipe, grads_single)
    host = host + np.where(G > 1, nl * np.where(zero >= 2, lt["g_layer_shard"], full_layer) * lt["acc_layer_host_frac"],
                           0.0)

    # ---------------------------------------------------------------- transient buffers
    blk_peak = np.maximum(v["block.bwd_peak_bytes[none]"], v["block.fwd_peak_bytes[none]"])
    blk_peak = np.maximum(blk_peak, np.where(c > 0, _pick(v, "block.bwd_peak_bytes", pols, pol), 0.0))
    part_peak = np.maximum(np.where(last, v["post.fwd_peak_bytes[none]"] + v["post.bwd_peak_bytes[none]"], 0.0),
                           np.where(first, v["pre.fwd_peak_bytes[none]"] + v["pre.bwd_peak_bytes[none]"], 0.0))
    # A checkpointed layer's backward peak (bwd_peak[policy]) already holds its recomputed residuals;
    # what XLA adds is at most the residuals its policy did not keep next to the plain backward's
    # transients (measured: charging both on top of each other over-predicted remat cells by 10-26%).
    # An activation-offloaded layer recomputes everything it did not offload.
    remat_bwd = np.where(c > 0, saved_none - saved_c + v["block.bwd_peak_bytes[none]"] - blk_peak, 0.0)
    recompute_buf = np.maximum(np.maximum(remat_bwd, 0.0), np.where(n_off > 0, saved_none, 0.0))
    # Fetched layer weights live only inside the layer loops: two layers at once in the unrolled-by-2
    # scan of plain layers (forward, and backward where they are fetched again), one otherwise. They are
    # never live next to pre / post's transients; the ZeRO-3-gathered embedding / head is (whole step).
    layer_fetch = np.where(n_plain > 2, 2.0, 1.0) * fetch
    tokens = b * G * s * 4.0 * 2.0  # int32 inputs + targets of the local batch
    # The optimizer update runs in place on the donated state (no extra copy of it is charged).
    # The pipeline executor's backward holds one layer's fp32 gradient next to the slice of the
    # accumulator it adds into, and the layer's weight slice taken from the stage's stacked params.
    pipe_buf = np.where(pipelined, 2.0 * full_layer, 0.0)
    buffers = (np.maximum(blk_peak + recompute_buf + layer_fetch, part_peak) + lt["w_other_fetch"] + tokens
               + pipe_buf)
    memory = {"params": params, "optimizer": optimizer, "grads": grads, "activations": activations,
              "buffers": buffers}
    peak = sum(memory.values())

    # ---------------------------------------------------------------- time
    lay = layer_times(workload, cluster, A, v, lt, n_plain=n_plain, n_off=n_off, c=c, saved_off_host=saved_off_host)
    ext = step_extras(workload, cluster, A, v, lt, grad_full=grad_full, grad_shard=grad_shard, p=p, dp=dp)
    stable = lay["fwd"] + lay["bwd"]
    delta = ext["delta"]

    # ---------------------------------------------------------------- FLOPs
    blk = v["block.fwd_flops"] + v["block.bwd_flops"]
    rec_c = np.where(c > 0, _pick(v, "block.recompute_flops", pols, pol), 0.0)
    rec_off = v[f"block.recompute_flops[{off_pol}]"]
    mb_flops = nl * blk + c * rec_c + n_off * rec_off
    mb_flops = mb_flops + np.where(first, v["pre.fwd_flops"] + v["pre.bwd_flops"], 0.0)
    mb_flops = mb_flops + np.where(last, v["post.fwd_flops"] + v["post.bwd_flops"], 0.0)
    flops = G * mb_flops + ext["flops"]
    # XLA counts a loop body once: the micro-batch loop (G > 1) and each layer segment's scan.
    # Segments of more than two layers with fetches are unrolled by 2; the pipeline executor's are not.
    def counted(n: np.ndarray) -> np.ndarray:
        u = np.where((fetch > 0) & ~pipelined & (n > 2), 2.0, 1.0)
        return np.where(n <= 0, 0.0, np.where(n > 1, u + np.mod(n, u), 1.0))

    cnt_plain, cnt_c, cnt_off = counted(n_plain), counted(c), counted(n_off)
    mb_xla = (cnt_plain + cnt_c + cnt_off) * blk + cnt_c * rec_c + cnt_off * rec_off
    mb_xla = mb_xla + np.where(first, v["pre.fwd_flops"] + v["pre.bwd_flops"], 0.0)
    mb_xla = mb_xla + np.where(last, v["post.fwd_flops"] + v["post.bwd_flops"], 0.0)
    flops_xla = mb_xla + ext["flops_xla"]

    budget = cluster.memory_budget()  # type: ignore[attr-defined]
    ok_tp = workload.compiled.feasible(b, s, t)
    return StageCost(stable=stable, delta=delta, fwd=lay["fwd"], bwd=lay["bwd"], memory=memory, peak=peak,
                     feasible=(peak <= budget) & ok_tp, host=host, host_acts=act_host, flops=flops, flops_xla=flops_xla,
                     flops_xla_step=ext["flops_xla"],
                     comm={k: ext[f"comm.{k}"] for k in ("all-gather", "reduce-scatter", "all-reduce")})


__all__ = ["MEMORY_CATEGORIES", "StageCost", "StageStrategies", "stage_cost"]
