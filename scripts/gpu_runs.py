"""Turn a `scripts/bench_gpu.py` results file (tuned plans measured on one GPU) into a published-runs file.

Usage::

    python scripts/gpu_runs.py docs/results/bench_gpu_h200.json --out tests/data/h200-runs.json

Each distinct plan measured (the same plan tuned at several budgets or chosen by several spaces is one
run) becomes a point in the ``mistjax-published-runs`` format (`mistjax.validate.published_format`): the
model preset, the one-GPU cluster, mistjax's default storage (bf16 compute, fp32 weights), the plan's
stages with their remat policy, the median of the measured step times over every measurement of that plan,
and the allocator's peak as the stage's peak memory. The file then prices with `scripts/bench_published.py`
and fits the preset with `scripts/fit_presets.py FILE --preset h200` (docs/cost_model.md, "Calibration").
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tyro  # noqa: E402

MiB = 2**20
SYSTEM = "mistjax (JAX / XLA:GPU, scripts/bench_gpu.py)"
PRECISION = "bf16 compute, fp32 weights and optimizer state (mistjax's default param_dtype float32)"
TIMING = "median wall time of a whole training step after a warm-up, optimizer update included"


@dataclass(frozen=True)
class Args:
    """Flags of scripts/gpu_runs.py."""

    results: Annotated[str, tyro.conf.Positional]  # a bench_gpu.py results JSON (e.g. docs/results/bench_gpu_h200.json)
    out: str  # the published-runs JSON to write
    preset: str = "h200"  # the hardware preset the GPU is (mistjax/hardware/catalog)
    seq_len: int = 2048  # the sequence length bench_gpu.py ran (its results file does not record it)
    global_batch: int = 16  # the global batch bench_gpu.py ran


def _stage(s: dict[str, Any]) -> dict[str, Any]:
    zero = 3 if s["shard_weights"] else 2 if s["shard_grads"] else 1 if s["shard_opt"] else 0
    out = {"layers": s["layers"], "remat_layers": s["remat_layers"], "zero": zero}
    if s["remat_layers"]:
        out["remat_policy"] = s["remat_policy"]
    out.update({k: s[k] for k in ("offload_weights", "offload_grads", "offload_opt", "offload_acts") if s[k]})
    return out


def _plan_key(run: dict[str, Any]) -> str:
    plan = {k: v for k, v in run["plan"].items() if k not in ("prediction", "search", "fingerprints")}
    return run["model"] + json.dumps(plan, sort_keys=True)


def _point(runs: list[dict[str, Any]], args: Args, index: int, doc: dict[str, Any]) -> dict[str, Any]:
    first, plan = runs[0], runs[0]["plan"]
    stages = [_stage(s) for s in plan["stages"]]
    times = [t for r in runs for t in r.get("step_times", [r["step_time"]])]
    return {
        "id": f"{first['model']}-{args.preset}x1-plan{index}",
        "kind": "measured",
        "source": {"file": args.results, "device": doc.get("device", ""), "date": doc.get("date", ""),
                   "measured_as": sorted({f"{r['plan_of']} @ {r['budget_gib']:g} GiB" for r in runs})},
        "system": SYSTEM,
        "hardware": {"preset": args.preset, "nodes": 1, "per_node": 1, "gpu": doc.get("device", "")},
        "model": {"preset": first["model"], "seq_len": args.seq_len},
        "global_batch": args.global_batch,
        "precision": PRECISION,
        "flash_attention": True,
        "parallel": {"dp": plan["dp"], "tp": plan["tp"], "pp": len(stages), "micro_batch": plan["micro_batch"],
                     "grad_accum": plan["grad_accum"], "schedule": plan["schedule"], "stages": stages},
        "measured": {"iter_time_s": statistics.median(times),
                     "stage_peak_allocated_mib": [max(r["allocator_peak"] for r in runs) / MiB],
                     "timing_scope": TIMING},
        "expressible": True,
    }


def convert(doc: dict[str, Any], args: Args) -> dict[str, Any]:
    """The published-runs document of a bench_gpu.py results document (runs that failed are left out)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in doc["runs"]:
        if "error" not in run and run.get("step_time") is not None:
            groups.setdefault(_plan_key(run), []).append(run)
    points = [_point(runs, args, i, doc) for i, runs in enumerate(groups.values())]
    about = (f"Distinct tuned plans measured on one GPU by scripts/bench_gpu.py ({doc.get('device', '')}, "
             f"{doc.get('date', '')}), converted by scripts/gpu_runs.py from {args.results}. Time: {TIMING}. Memory: "
             f"the XLA allocator's peak bytes in use. Sequence {args.seq_len}, global batch {args.global_batch}.")
    return {"format": "mistjax-published-runs", "version": 1, "about": about, "points": points}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = tyro.cli(Args, args=argv)
    doc = json.loads(Path(args.results).read_text(encoding="utf-8"))
    out = convert(doc, args)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"{len(out['points'])} distinct plans from {len(doc['runs'])} runs -> {args.out}")
    return out


if __name__ == "__main__":
    main()
