"""TP communication overlapped with the matmuls (issue #28 item 3): XLA:GPU's schedule with and without
the collective matmul, compiled deviceless.

Usage::

    python scripts/bench_tp_overlap.py [--model gpt3-7b] [--layers 4] [--cluster h100:1x8] [--tp 8]
                                       [--seq 2048] [--micro-batch 1] [--json docs/results/tp_overlap.json]

The runtime's real train step (bf16 compute and weights with an fp32 master copy, AdamW: `zoo_step`) of
the model's shape, cut to ``--layers`` layers so that it compiles in minutes on a small CPU host, is compiled
for the cluster's GPUs without GPUs (`mistjax.validate.gpu_aot.compile_plan`) twice: with the collective
matmul forced off (Megatron's all-gather / reduce-scatter beside the GEMMs) and on
(`mistjax.runtime.collective_matmul`). From each scheduled HLO it counts, inside the layer loop, the
async collectives (``-start`` / ``-done`` pairs) by kind, how many of them have a GEMM (Triton / cuBLAS)
scheduled between start and done, the GEMMs between them in all, and the synchronous collectives; plus
``memory_analysis`` temp. Next to each compile, the cost model's price of the same cell, the collective matmul
off and on (`mistjax.cost.stage_time.layer_tp_times`, `mistjax.cost.tp_rings`): one layer's TP seconds
forward / backward, the split GEMMs' extra kernels, and the step time. Runs with JAX_PLATFORMS=cpu (set
here); needs ``pip install 'mistjax[gpu-aot]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MiB = 2**20
RESULTS = os.path.join(os.path.dirname(__file__), "..", "docs", "results", "tp_overlap.json")


def loop_schedule(hlo_text: str, trips: int) -> dict[str, dict[str, int]]:
    """Per collective kind in the loops of ``trips`` iterations (the layer loops, forward and backward): async
    pairs, those with a GEMM between start and done, GEMMs between in all, compute ops between in all,
    synchronous ones, and the result KiB per device per layer."""
    from mistjax.core.hlo import async_collectives, collectives, computation_trips

    loops = computation_trips(hlo_text)
    in_loop = {c for c, n in loops.items() if n == trips}
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for p in async_collectives(hlo_text):
        if p.computation in in_loop and p.done:
            row = out[str(p.op)]
            row["async_pairs"] += 1
            row["with_gemm_between"] += p.matmuls_between > 0
            row["gemms_between"] += p.matmuls_between
            row["compute_between"] += p.compute_between
    for c in collectives(hlo_text):
        if c.computation in in_loop:
            out[str(c.op)]["sync"] += not c.is_async
            out[str(c.op)]["kib_per_layer"] += c.result_bytes // 1024
    return {k: dict(v) for k, v in sorted(out.items())}


def gemms_in_loops(hlo_text: str, trips: int) -> int:
    """GEMM instructions (Triton / cuBLAS fusions and custom calls) in the loops of ``trips`` iterations."""
    import re

    from mistjax.core.hlo import computation_trips

    loops = computation_trips(hlo_text)
    count, comp = 0, ""
    head = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
    for line in hlo_text.splitlines():
        h = head.match(line)
        if h:
            comp = h.group(1)
        elif loops.get(comp) == trips and ('"kind":"__triton' in line and "gemm" in line
                                           or 'custom_call_target="__cublas' in line):
            count += 1
    return count


def predicted(args: argparse.Namespace, on: bool) -> dict[str, float]:
    """The cost model's price of the cell (all ``--layers`` layers), the collective matmul forced ``on``:
    microseconds of one layer's TP collectives and split-GEMM overhead per micro-batch, and the step."""
    import numpy as np

    import models
    from mistjax.cost.model import stage_memory
    from mistjax.cost.predict import plan_strategies, predict
    from mistjax.cost.stage_time import layer_tp_times

    cfg, cluster, plan = _cell(args)
    plan = plan.replace(tp_overlap=on)
    workload = models.workload(cfg, args.seq, args.micro_batch * plan.dp)
    m = stage_memory(workload, cluster, plan_strategies(workload, plan, cluster))
    tp = layer_tp_times(workload, cluster, m.knobs, m.values, m.kinds)
    step = predict(workload, plan, cluster).step_time
    out = {f"layer_{k}_us": round(float(np.ravel(v)[0]) * 1e6, 1) for k, v in tp.items()}
    out["step_ms"] = round(step * 1e3, 2)
    return out


def _cell(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The cell's model config (bf16, ``--layers`` layers), cluster and plan."""
    import models
    from mistjax.hardware import ClusterSpec
    from mistjax.plan import uniform_plan

    cfg = models.get_config(args.model).replace(num_layers=args.layers, dtype="bfloat16", param_dtype="bfloat16")
    cluster = ClusterSpec.parse(args.cluster)
    devices = cluster.nodes * cluster.devices_per_node
    dp = devices // args.tp
    plan = uniform_plan(cfg.num_layers, devices, tp=args.tp, micro_batch=args.micro_batch, shard_opt=dp > 1)
    return cfg, cluster, plan


def compile_once(args: argparse.Namespace, on: bool) -> dict[str, Any]:
    from mistjax.validate.gpu_aot import compile_plan, zoo_step

    cfg, cluster, plan = _cell(args)
    state, batch, step = zoo_step(cfg, args.seq, args.micro_batch * plan.dp)
    t0 = time.perf_counter()
    report = compile_plan(step, state, batch, plan.replace(tp_overlap=on), cluster, breakdown=False)
    text = report.hlo_text
    return {"collective_matmul": on, "compile_s": round(time.perf_counter() - t0, 1),
            "temp_mib": round(report.memory.temp / MiB, 1), "peak_mib": round(report.peak / MiB, 1),
            "loop": loop_schedule(text, args.layers), "gemms_in_loop": gemms_in_loops(text, args.layers),
            "device_kind": report.device_kind, "predicted": predicted(args, on)}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'collective matmul':<18}{'collective':<20}{'async':>6}{'w/ GEMM':>8}{'GEMMs btw':>10}"
          f"{'compute btw':>12}{'sync':>6}{'MiB/layer':>10}")
    for r in rows:
        for kind, v in r["loop"].items():
            print(f"{'on' if r['collective_matmul'] else 'off':<18}{kind:<20}{v.get('async_pairs', 0):>6}"
                  f"{v.get('with_gemm_between', 0):>8}{v.get('gemms_between', 0):>10}{v.get('compute_between', 0):>12}"
                  f"{v.get('sync', 0):>6}{v.get('kib_per_layer', 0) / 1024:>10.1f}")
    for r in rows:
        print(f"collective matmul {'on ' if r['collective_matmul'] else 'off'}: temp {r['temp_mib']} MiB, peak "
              f"{r['peak_mib']} MiB, GEMMs in the layer loop {r['gemms_in_loop']}, compile {r['compile_s']} s")
    for r in rows:
        p = r["predicted"]
        print(f"cost model, collective matmul {'on ' if r['collective_matmul'] else 'off'}: one layer's TP "
              f"{p['layer_fwd_us']} us forward, {p['layer_bwd_us']} us backward; split-GEMM kernels "
              f"{p['layer_chunks_fwd_us']} / {p['layer_chunks_bwd_us']} us; step {p['step_ms']} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-7b")
    ap.add_argument("--layers", type=int, default=4, help="layers of the model's shape (compile time)")
    ap.add_argument("--cluster", default="h100:1x8", help="h100 = H100 SXM, the XLA spec a DGX H100 has")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--json", default=RESULTS)
    args = ap.parse_args(argv)
    rows = [compile_once(args, on) for on in (False, True)]
    print_table(rows)
    from mistjax.runtime import xla_flags

    doc = {"model": args.model, "layers": args.layers, "cluster": args.cluster, "tp": args.tp, "seq": args.seq,
           "micro_batch": args.micro_batch, "xla_gpu_flags": xla_flags.compiler_options("gpu"), "runs": rows}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
