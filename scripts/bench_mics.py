"""MiCS against ZeRO-3 and the tuned plan: published runs, the 30B target, and a network x scale sweep.

Usage::

    python scripts/bench_mics.py [--json docs/results/mics.json] [--runs tests/data/mics-runs.json]
                                 [--no-sweep] [--tuned-limit 20]

Prints and (``--json``) writes:

* ``published``: every run of ``tests/data/mics-runs.json`` priced by the cost model (predicted / measured step
  time), each MiCS-over-ZeRO-3 pair's predicted and measured speed-up, and the a-priori choices the file's
  assumptions name: the partition group (the smallest node-aligned group whose plan fits the card) and the
  micro-batch (the largest of 1, 2, 4 that fits) with the prediction at every other choice (sensitivity).
* ``target``: a GPT-3-shaped 30B (h 7168, 48 layers, 56 heads, ffn 28672) on 256 aws-p4d GPUs, global batch 512,
  sequence 2048: the best ZeRO-3 plan (the zero3-fsdp space), the best MiCS plan with 1 < shard_group < dp, the
  tuned plan of mistjax's full space, and the tuned plan of the full space without MiCS groups (shard_group = dp).
* ``sweep``: weak scaling as in the MiCS paper (4 sequences per GPU, GPT-3 13B, sequence 2048) over 16 -> 512
  A100-40GB GPUs (aws-p4d nodes) and 100 -> 3,200 Gb/s of network per node: the best ZeRO-3 plan, the best MiCS
  plan, the tuned plan (a search of ``--tuned-limit`` seconds), and MiCS's weak-scaling efficiency (throughput per
  GPU at N over that at 16).

Every number is the cost model's; no constant is fitted here. docs/mics.md has the tables and what they show.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Annotated, Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tyro  # noqa: E402

GiB = 2**30
PAIRS = (("smp-gpt2-30b-p4d-256-mics64", "deepspeed-zero3-gpt2-30b-p4d-256", 1.397),)  # (MiCS, ZeRO-3, measured)
BANDWIDTHS_GBPS = (100, 200, 400, 800, 1600, 3200)
GPUS = (16, 32, 64, 128, 256, 512)
TARGET_LIMIT = 120.0  # seconds of the 30B target's full-space search


@dataclass(frozen=True)
class Args:
    """Flags of scripts/bench_mics.py."""

    json_out: Annotated[str | None, tyro.conf.arg(name="json")] = None  # write the results here
    runs: str = "tests/data/mics-runs.json"  # MiCS's published runs
    sweep: bool = True  # run the network x scale sweep (minutes)
    tuned_limit: float = 20.0  # seconds for each tuned (full-space) search of the sweep; 0: no tuned column


def _plan_text(plan: Any) -> str:
    return (f"dp{plan.dp} p{plan.shard_group} tp{plan.tp} S{plan.num_stages} b{plan.micro_batch} G{plan.grad_accum} "
            f"z{max(s.zero_stage for s in plan.stages)} remat{sum(s.remat_layers for s in plan.stages)}")


def _fits(analysis: Any, cluster: Any) -> bool:
    return bool(analysis.prediction.guarded_peak(cluster.device.memory_margin) <= cluster.memory_budget())


def _sensitivity(run: Any) -> list[dict[str, Any]]:
    """The run's prediction at every other partition group / micro-batch the file's a-priori rules chose among."""
    from mistjax.cost.predict import analyze
    from mistjax.validate.published import cluster_for, run_config, to_plan, zoo_workload

    base = to_plan(run)
    cluster = cluster_for(run)
    workload = zoo_workload(run_config(run), run.model.seq_len, run.global_batch, ("full",),
                            run.system_record.storage(run.precision_word))
    per_gpu = run.global_batch // base.dp
    rows = []
    groups = sorted({g for g in (8, 16, 32, 64, 128, 256, 512) if base.dp % g == 0} | {base.shard_group})
    for b in sorted({x for x in (1, 2, 4, base.micro_batch) if per_gpu % x == 0}):
        for g in groups:
            plan = dataclasses.replace(base, micro_batch=b, grad_accum=per_gpu // b, shard_group=g)
            a = analyze(workload, plan, cluster)
            rows.append({"micro_batch": b, "shard_group": g, "predicted_s": a.step_time,
                         "peak_gib": a.peak_memory / GiB, "fits_budget": _fits(a, cluster),
                         "as_recorded": (b, g) == (base.micro_batch, base.shard_group)})
    return rows


def published(path: str) -> dict[str, Any]:
    """Every run of the file priced, the pairs' speed-ups, and each run's sensitivity table."""
    from mistjax.validate.published import RunFailure, load_published, predict_all

    runs = load_published(path)
    preds = {p.run.id: p for p in predict_all(runs)}
    points = []
    for rid, p in preds.items():
        if isinstance(p, RunFailure):
            points.append({"id": rid, "error": p.error})
            continue
        meas = p.run.measured.iter_time_s
        points.append({"id": rid, "plan": _plan_text(p.plan), "measured_s": meas, "predicted_s": p.step_time,
                       "ratio": p.step_time / meas, "fits_budget": p.fits_budget,
                       "peak_gib": max(p.stage_peaks) / GiB, "sensitivity": _sensitivity(p.run)})
    pairs = []
    for mics, zero3, measured in PAIRS:
        a, b = preds.get(mics), preds.get(zero3)
        if a is None or b is None or isinstance(a, RunFailure) or isinstance(b, RunFailure):
            continue
        predicted = b.step_time / a.step_time
        pairs.append({"mics": mics, "zero3": zero3, "measured_speedup": measured, "predicted_speedup": predicted,
                      "ratio": predicted / measured})
    return {"runs": path, "points": points, "pairs": pairs}


def gpt3_30b() -> Any:
    """The issue's GPT-3-shaped 30B (h 7168, 48 layers, 56 heads, ffn 28672) at sequence 2048, bf16."""
    import models

    return models.get_config("gpt3-22b").replace(name="gpt3-30b", hidden_size=7168, num_layers=48, num_heads=56,
                                                 num_kv_heads=56, ffn_size=28672, max_seq_len=2048,
                                                 dtype="bfloat16", param_dtype="bfloat16")


def _best(workload: Any, cluster: Any, space: Any, limit: float) -> dict[str, Any]:
    from mistjax.cost import COST_MODEL
    from mistjax.tuning.tuner import search

    t0 = time.perf_counter()
    r = search(workload, cluster, space, time_limit=limit, cost=COST_MODEL)
    if r.plan is None:
        return {"plan": None, "step_s": None, "search_s": time.perf_counter() - t0, "complete": r.completeness()}
    return {"plan": _plan_text(r.plan), "shard_group": r.plan.shard_group, "dp": r.plan.dp, "step_s": r.step_time,
            "search_s": time.perf_counter() - t0, "complete": r.completeness()}


def _spaces(limit: float) -> dict[str, Any]:
    from mistjax.tuning.space import SearchSpace

    spaces = {"zero3": (SearchSpace.fsdp(), 120.0), "mics": (SearchSpace.mics_only(), 120.0)}
    return {**spaces, "tuned": (SearchSpace.full(), limit)} if limit > 0 else spaces


def _proper_mics(workload: Any, cluster: Any) -> dict[str, Any]:
    """The best MiCS plan with 1 < shard_group < dp: each node-aligned group of the MiCS space priced by search
    with the group forced (`shard_groups` patched to that one group)."""
    import mistjax.tuning.space as sp
    from mistjax.tuning.space import SearchSpace

    original = sp.shard_groups
    best: dict[str, Any] = {"plan": None, "step_s": None}
    dp = cluster.num_devices
    try:
        for g in [g for g in original(dp, 1, cluster.devices_per_node, True) if 1 < g < dp]:
            sp.shard_groups = lambda d, t, n, m, g=g, **_: (g,) if d % g == 0 else (d,)  # type: ignore[misc]
            r = _best(workload, cluster, SearchSpace.mics_only(), 120.0)
            if r["step_s"] is not None and r.get("shard_group") == g and (
                    best["step_s"] is None or r["step_s"] < best["step_s"]):
                best = r
    finally:
        sp.shard_groups = original
    return best


def target(limit: float) -> dict[str, Any]:
    """The issue's 30B target on aws-p4d: best ZeRO-3, best MiCS (1 < p < dp) and tuned plans."""
    import models
    from mistjax.hardware import ClusterSpec

    workload = models.workload(gpt3_30b(), 2048, 512)
    cluster = ClusterSpec.preset("aws-p4d", nodes=32, per_node=8)
    spaces = _spaces(TARGET_LIMIT)
    spaces["tuned_no_mics"] = (spaces["tuned"][0].replace(mics=False), TARGET_LIMIT)  # the same space, p = dp
    out = {name: _best(workload, cluster, space, lim) for name, (space, lim) in spaces.items()}
    out["mics_proper"] = _proper_mics(workload, cluster)
    z, m = out["zero3"]["step_s"], out["mics_proper"]["step_s"]
    out["mics_over_zero3"] = None if not (z and m) else z / m
    t, n = out["tuned"]["step_s"], out["tuned_no_mics"]["step_s"]
    out["tuned_over_no_mics"] = None if not (t and n) else n / t
    return out


def with_network(cluster: Any, gbps_per_node: float) -> Any:
    """``cluster`` with its inter-node links scaled to ``gbps_per_node`` Gb/s per node (latencies unchanged)."""
    from mistjax.hardware import LinkModel

    scale = gbps_per_node * 1e9 / 8 / cluster.collective_link(cluster.devices_per_node, 2).bandwidth
    return dataclasses.replace(cluster, inter_node={key: LinkModel(v.bandwidth * scale, v.latency)
                                                    for key, v in cluster.inter_node.items()},
                               p2p_inter=LinkModel(cluster.p2p_inter.bandwidth * scale, cluster.p2p_inter.latency))


def sweep(limit: float) -> list[dict[str, Any]]:
    """Weak scaling: GPT-3 13B, 4 sequences per GPU, over GPU counts and per-node network bandwidths."""
    import models
    from mistjax.hardware import ClusterSpec

    config = models.get_config("gpt3-13b").replace(dtype="bfloat16", param_dtype="bfloat16", max_seq_len=2048)
    rows = []
    for n in GPUS:
        workload = models.workload(config, 2048, 4 * n)
        for gbps in BANDWIDTHS_GBPS:
            cluster = with_network(ClusterSpec.preset("aws-p4d", nodes=n // 8, per_node=8), gbps)
            row: dict[str, Any] = {"gpus": n, "gbps_per_node": gbps}
            for name, (space, lim) in _spaces(limit).items():
                row[name] = _best(workload, cluster, space, lim)
            row["mics_proper"] = _proper_mics(workload, cluster)
            print(json.dumps({k: (v if not isinstance(v, dict) else v.get("step_s")) for k, v in row.items()}),
                  flush=True)
            rows.append(row)
    return rows


def _table(rows: list[list[Any]], header: list[str]) -> str:
    align = "|".join("---" if i == 0 else "---:" for i in range(len(header)))
    lines = ["| " + " | ".join(header) + " |", "|" + align + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = tyro.cli(Args, args=argv, description=__doc__)
    out: dict[str, Any] = {"published": published(args.runs)}
    pub = out["published"]
    print(_table([[p["id"], p.get("plan"), p.get("measured_s"), f"{p.get('predicted_s', 0):.2f}",
                   f"{p.get('ratio', 0):.3f}"] for p in pub["points"]],
                 ["run", "plan", "measured s", "predicted s", "pred / meas"]))
    for q in pub["pairs"]:
        print(f"MiCS over ZeRO-3 {q['mics']} / {q['zero3']}: measured {q['measured_speedup']:.3f}x, predicted "
              f"{q['predicted_speedup']:.3f}x (ratio {q['ratio']:.3f})")
    out["target"] = target(args.tuned_limit)
    print(json.dumps(out["target"], indent=1))
    if args.sweep:
        out["sweep"] = sweep(args.tuned_limit)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {args.json_out}")
    return out


if __name__ == "__main__":
    main()
