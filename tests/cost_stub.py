"""A small analytic stand-in for `mistjax.cost.COST_MODEL` implementing the same interface (tests only).

The tuner takes its cost model (`mistjax.core.strategies.CostModel`) as an argument, so its tests can
run against this stub (`COST_MODEL`) and check the tuner's own logic (MILP = brute force, feasibility,
determinism, baselines <= mistjax) on a model whose numbers are easy to reason about. The numbers
are rough (Korthikanti-style activation sizes, roofline compute, alpha-beta collectives, a "max +
10% of the rest" overlap); they are not the project's cost model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mistjax.core.pipeline_time import pipeline_1f1b_time
from mistjax.core.plan import Plan, Prediction
from mistjax.core.schedules import inflight_microbatches
from mistjax.core.strategies import CostModel, StageStrategies

_BYTES_W, _BYTES_G, _BYTES_O = 2.0, 2.0, 12.0  # bf16 weights and grads, fp32 master + Adam moments


@dataclass(frozen=True)
class Workload:
    """Model + sequence length + global batch (the stub keeps the model config)."""

    config: Any
    seq_len: int
    global_batch: int
    optimizer: str = "adamw"
    policies: tuple[str, ...] = ("none", "full", "dots")
    grad_dtype: str | None = None

    @classmethod
    def from_model(cls, config: Any, seq_len: int, global_batch: int, optimizer: str = "adamw") -> Workload:
        return cls(config, int(seq_len), int(global_batch), optimizer)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_layers)

    def supports_tp(self, tp: int) -> bool:
        """Heads, kv heads, MLP and hidden widths must split evenly over ``tp`` devices."""
        c = self.config
        return all(d % tp == 0 for d in (c.num_heads, c.num_kv_heads, c.ffn_size, c.hidden_size))

    def fingerprint(self) -> str:
        doc = {"config": asdict(self.config), "seq": self.seq_len, "batch": self.global_batch, "opt": self.optimizer}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StageCost:
    stable: np.ndarray  # seconds of one steady micro-batch
    delta: np.ndarray  # once-per-step seconds
    fwd: np.ndarray  # forward part of `stable`
    bwd: np.ndarray  # backward part of `stable`
    memory: dict[str, np.ndarray]  # bytes by category
    peak: np.ndarray  # sum of `memory`
    feasible: np.ndarray  # fits the budget
    offload_floor: np.ndarray  # a lower bound of the peak at smaller offload ratios (none claimed: 0)
    wgrad: np.ndarray  # weight-gradient part of `bwd`


def _coll(nbytes: Any, n: Any, bw: Any, lat: Any, passes: float = 1.0) -> np.ndarray:
    n = np.asarray(n, np.float64)
    return np.where(n > 1, passes * ((n - 1) * lat + (n - 1) / np.maximum(n, 1) * nbytes / bw), 0.0)


def stage_cost(workload: Workload, cluster: Any, st: StageStrategies) -> StageCost:
    """Per-device stable / delta seconds and peak bytes of one stage, vectorised."""
    c = workload.config
    a = {f: np.asarray(getattr(st, f)) for f in st.__dataclass_fields__}  # natural broadcasting, no copies
    b, dp, tp, p, zero = (a[k].astype(np.float64) for k in ("b", "dp", "tp", "shard_group", "zero"))
    nl, r, pol = a["layers"].astype(np.float64), a["remat"].astype(np.float64), a["policy"].astype(np.int64)
    wo, go, oo, ao = (a[k].astype(np.float64) for k in ("wo", "go", "oo", "ao"))
    infl, G = a["inflight"].astype(np.float64), a["G"].astype(np.float64)
    first, last = a["first"].astype(bool), a["last"].astype(bool)
    nodes, per_node = a["nodes"].astype(np.float64), a["per_node"].astype(np.float64)
    h, s, V = float(c.hidden_size), float(workload.seq_len), float(c.vocab_size)
    dev = cluster.device
    rate = dev.peak_flops * dev.matmul_efficiency
    t = b * s
    P = float(c.params_per_layer())
    f_fwd = (2 * P * t + 4 * b * s * s * h) / tp / rate
    names = np.asarray(workload.policies)
    extra = np.select([names[pol] == "full", names[pol] == "dots"], [1.0, 0.3], 0.0)
    saved_remat = np.select([names[pol] == "full", names[pol] == "dots"], [2.0, 12.0], 34.0) * b * s * h / tp
    saved_full = 34.0 * b * s * h / tp
    W = _BYTES_W * P / tp
    Gb = _BYTES_G * P / tp
    Ob = _BYTES_O * P / tp
    inter = np.minimum(dp, nodes)
    intra = np.where(dp > nodes, dp / np.maximum(nodes, 1), 1.0)
    bw, lat = cluster.collective_link_arrays(np.maximum(intra, 1), np.maximum(inter, 1))
    g_inter = np.where(p <= intra, 1.0, np.ceil(p / np.maximum(intra, 1)))
    g_intra = np.minimum(p, intra)
    gbw, glat = cluster.collective_link_arrays(np.maximum(g_intra, 1), np.maximum(g_inter, 1))
    ag_w = _coll(W, p, gbw, glat)
    rs_g = _coll(Gb, p, gbw, glat) * 1.1
    ar_rep = _coll(Gb / np.maximum(p, 1), dp / np.maximum(p, 1), bw, lat, 2.0)
    ar_all = _coll(Gb, dp, bw, lat, 2.0)
    tbw, tlat = cluster.collective_link_arrays(np.minimum(tp, per_node), 1)
    tp_comm = np.where(tp > 1, 8 * _coll(2 * b * s * h, tp, tbw, tlat), 0.0)
    h2d, d2h = dev.host_to_device, dev.device_to_host

    def copy(n: Any, link: Any) -> np.ndarray:
        return np.where(n > 0, link.latency + n / link.bandwidth, 0.0)

    comm_stable = np.where(zero >= 3, 2 * ag_w + rs_g, np.where(zero == 2, rs_g, 0.0))
    comm_delta = np.where(zero >= 2, ag_w, np.where(zero == 1, ag_w + rs_g, ar_all)) + np.where(
        (p < dp) & (zero >= 1), ar_rep, 0.0)
    sh_w, sh_g, sh_o = (np.where(zero >= k, p, 1.0) for k in (3, 2, 1))
    h2d_st = copy(2 * wo * W / sh_w + go * Gb / sh_g + ao * saved_full, h2d)
    d2h_st = copy(go * Gb / sh_g + ao * saved_full, d2h)
    opt_swap = copy(oo * Ob / sh_o, h2d) + copy(oo * Ob / sh_o, d2h)

    def overlap(*xs: np.ndarray) -> np.ndarray:
        m = xs[0]
        for x in xs[1:]:
            m = np.maximum(m, x)
        return m + 0.1 * (sum(xs) - m)

    layer_nockpt = overlap(3 * f_fwd, comm_stable, h2d_st, d2h_st) + 2 * tp_comm
    layer_ckpt = overlap((3 + extra) * f_fwd, comm_stable, h2d_st, d2h_st) + 2 * tp_comm
    stable = r * layer_ckpt + (nl - r) * layer_nockpt
    delta = nl * overlap(comm_delta, opt_swap)
    head = 6 * V * h * t / tp / rate
    stable = stable + np.where(first, 0.02 * head, 0.0) + np.where(last, head, 0.0)
    single = G <= 1
    stable = np.where(single, stable + delta, stable)
    delta = np.where(single, 0.0, delta)

    states = nl * (W * (1 - wo) / sh_w + Gb * (1 - go) / sh_g + Ob * (1 - oo) / sh_o)
    buffers = np.where((zero >= 3) | (wo > 0), 2 * W, 0.0) + np.where((zero >= 2) | (go > 0), 2 * Gb, 0.0)
    acts_one = r * saved_remat + (nl - r) * saved_full
    acts = infl * acts_one * (1 - ao)
    work = 2 * saved_full
    emb = V * h * (_BYTES_W + _BYTES_G + _BYTES_O) / np.where(zero >= 1, p, 1.0)
    prepost = np.where(first, emb, 0.0) + np.where(last, emb + 4 * b * s * V / tp, 0.0)
    memory = {"states": states, "buffers": buffers, "activations": acts, "working": work + 0 * nl,
              "pre_post": prepost + 0 * nl}
    shape = np.broadcast_shapes(*(x.shape for x in a.values()))
    memory = {k: np.broadcast_to(v, shape) for k, v in memory.items()}
    peak = sum(memory.values())
    stable, delta = np.broadcast_to(stable, shape), np.broadcast_to(delta, shape)
    valid = (r <= nl) & (r >= 0) & (p >= 1) & (dp % np.maximum(p, 1) == 0)
    feasible = valid & (peak <= cluster.memory_budget())
    # The stub splits a micro-batch evenly between forward and backward (so every schedule's steady
    # micro-batch costs `stable`, as the 1F1B formula of `predict` assumes).
    return StageCost(stable, delta, stable / 2, stable / 2, memory, peak, feasible, 0 * peak, stable / 4)


def predict(workload: Workload, plan: Plan, cluster: Any) -> Prediction:
    """Step time and per-stage memory of a plan under the stub model."""
    S = plan.num_stages
    stage_devices = plan.num_devices // S
    per_node = min(cluster.devices_per_node, stage_devices)
    nodes = max(1, stage_devices // per_node)
    T, D, mem = [], [], []
    for i, sp in enumerate(plan.stages):
        zero = sp.zero_stage
        pol = list(workload.policies).index(sp.remat_policy) if sp.remat_policy in workload.policies else 1
        st = StageStrategies(plan.micro_batch, plan.dp, plan.tp, plan.shard_group, zero, sp.num_layers,
                             sp.remat_layers, pol, sp.offload_weights, sp.offload_grads, sp.offload_opt,
                             sp.offload_acts, int(inflight_microbatches(i, S, plan.grad_accum, plan.schedule)),
                             plan.grad_accum, i == 0, i == S - 1,
                             S, nodes, per_node)
        cost = stage_cost(workload, cluster, st)
        T.append(float(cost.stable))
        D.append(float(cost.delta))
        mem.append({k: float(v) for k, v in cost.memory.items()})
    step = float(pipeline_1f1b_time(np.array(T), np.array(D), plan.grad_accum))
    return Prediction(step, tuple(T), tuple(D), tuple(mem), workload.global_batch * workload.seq_len / step)


# The stub as the tuner takes it (`mistjax.core.strategies.CostModel`).
COST_MODEL = CostModel(stage_cost=stage_cost, predict=predict)
