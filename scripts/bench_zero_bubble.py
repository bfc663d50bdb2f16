"""Zero-bubble (ZB-H1) on the Mist grid's pipelined cells: predicted gain and bubble, per cell.

Run: python scripts/bench_zero_bubble.py [--grid docs/results/reproduce.json] [--json FILE]

For every cell of the grid file (`scripts/reproduce_paper.py`'s output) whose tuned plan is pipelined, the
same plan is priced under 1F1B and under ZB-H1 (`mistjax.cost.analyze`: the executor's issue order with
each stage's input-gradient and weight-gradient halves, and the stash of the deferred weight passes as
activation memory). The table shows both step times, the gain, the bubble fraction before / after, ZB's peak
against the card's budget, and the speedup over Megatron-LM's space before / after where ZB fits and is
faster (what `SearchSpace.zero_bubble` adopts). The Megatron-LM throughputs are the grid file's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from reproduce_paper import PLATFORMS, cluster_for  # noqa: E402

import models  # noqa: E402
from mistjax.cost import analyze  # noqa: E402
from mistjax.cost.model import stage_cost  # noqa: E402
from mistjax.cost.predict import bubble_fraction, plan_strategies  # noqa: E402
from mistjax.plan import Plan  # noqa: E402
from mistjax.tuning import baseline_system  # noqa: E402
from mistjax.tuning.baselines import GRID_PRECISION  # noqa: E402
from mistjax.validate.published import system_workload  # noqa: E402


def cell_record(cell: dict) -> dict | None:
    plan = Plan.from_dict(cell["plan"]) if cell.get("plan") else None
    if plan is None or plan.num_stages < 2 or plan.virtual_stages > 1:
        return None
    platform, gpus = cell["platform"], cell["gpus"]
    # Priced as the grid priced the plan: mistjax's storage at the grid's precision (`reproduce_paper.run_cell`).
    cfg = models.get_config(f"{cell['family']}-{cell['size']}")
    workload = system_workload(baseline_system("mistjax"), cfg, PLATFORMS[platform], 16 * gpus, GRID_PRECISION)
    cluster = cluster_for(platform, gpus)
    one, zb_plan = plan.replace(schedule="1f1b", prediction=None), plan.replace(schedule="zb-h1", prediction=None)
    a1, az = analyze(workload, one, cluster), analyze(workload, zb_plan, cluster)
    c1 = stage_cost(workload, cluster, plan_strategies(workload, one, cluster))
    fits = az.prediction.guarded_peak(cluster.device.memory_margin) <= cluster.memory_budget() * (1 + 1e-9)
    gain = a1.step_time / az.step_time
    meg = cell["baselines"].get("megatron") or 0.0
    tok1, tokz = a1.prediction.tokens_per_s, az.prediction.tokens_per_s
    adopted = fits and gain > 1.0
    return {"platform": platform, "model": f"{cell['family']}-{cell['size']}", "gpus": gpus,
            "stages": plan.num_stages, "grad_accum": plan.grad_accum, "step_1f1b": a1.step_time,
            "step_zb": az.step_time, "gain": gain, "bubble_1f1b": bubble_fraction(one, c1),
            "bubble_zb": bubble_fraction(zb_plan, c1), "peak_zb": az.peak_memory,
            "peak_1f1b": a1.peak_memory, "budget": cluster.memory_budget(), "fits": fits, "adopted": adopted,
            "speedup_before": tok1 / meg if meg else None,
            "speedup_after": (tokz if adopted else tok1) / meg if meg else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", default=str(ROOT / "docs" / "results" / "reproduce.json"))
    p.add_argument("--json", default=None)
    a = p.parse_args()
    cells = json.loads(Path(a.grid).read_text())["cells"]
    rows = [r for r in map(cell_record, cells) if r is not None]
    head = (f"{'platform':<10} {'model':<12} {'GPUs':>4} {'S':>2} {'G':>4} {'1F1B s':>8} {'ZB s':>8} {'gain':>6} "
            f"{'bubble':>13} {'ZB peak GiB':>11} {'fits':>4} {'vs Megatron':>15}")
    print(head)
    print("-" * len(head))
    for r in rows:
        sp = (f"{r['speedup_before']:.3f}->{r['speedup_after']:.3f}" if r["speedup_before"] is not None else "-")
        print(f"{r['platform']:<10} {r['model']:<12} {r['gpus']:>4} {r['stages']:>2} {r['grad_accum']:>4} "
              f"{r['step_1f1b']:>8.3f} {r['step_zb']:>8.3f} {r['gain']:>6.3f} "
              f"{r['bubble_1f1b']:>6.1%}->{r['bubble_zb']:<6.1%} {r['peak_zb'] / 2**30:>11.2f} "
              f"{'yes' if r['fits'] else 'no':>4} {sp:>15}")
    summary = {}
    for platform in sorted({r["platform"] for r in rows}):
        mine = [r for r in rows if r["platform"] == platform and r["speedup_before"] is not None]
        summary[platform] = {
            "pipelined_cells": len(mine), "adopted": sum(r["adopted"] for r in mine),
            "avg_speedup_before": statistics.fmean(r["speedup_before"] for r in mine) if mine else None,
            "avg_speedup_after": statistics.fmean(r["speedup_after"] for r in mine) if mine else None,
            "max_gain": max((r["gain"] for r in mine if r["adopted"]), default=1.0)}
    print()
    for platform, s in summary.items():
        print(f"{platform}: {s['adopted']} of {s['pipelined_cells']} pipelined cells take ZB-H1; average speedup "
              f"over Megatron-LM's space (these cells) {s['avg_speedup_before']:.3f} -> {s['avg_speedup_after']:.3f}; "
              f"largest gain {s['max_gain']:.3f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"cells": rows, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
