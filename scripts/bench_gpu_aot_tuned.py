"""Tuned plans on the target GPU's compiler: does every plan the tuner picks fit? (issue #32)

Usage::

    python scripts/bench_gpu_aot_tuned.py [--json FILE] [--cells ID,ID] [--time-limit S] [--rounds N]

For each cell (the Mist grid's L4 and A100 cells, and Llama-3-8B / Llama-2-70B shapes on H100) the tuner
picks a plan (`mistjax.tune`, no baselines), the runtime's real train step under that plan is compiled for
the cluster's GPUs without GPUs (`mistjax.validate.gpu_aot`; pipelined plans: every (stage, phase) program
of the MPMD executor, `mistjax.validate.gpu_aot_pipeline`), and XLA:GPU's per-device-group peak is printed
next to the prediction. With ``--rounds`` > 1 a plan above the planning budget is re-tuned with the
measured gap (`mistjax.validate.verified.tune_verified`, what ``mistjax plan --verify`` does). The JSON
feeds ``scripts/fit_memory_margin.py``. Needs ``pip install 'mistjax[gpu-aot]'``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tyro  # noqa: E402

GiB = 2**30
LLAMA3_8B = dict(name="llama3-8b", family="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                 ffn_size=14336, vocab_size=128256, max_seq_len=8192, rotary_pct=1.0)
LLAMA2_70B = dict(name="llama2-70b", family="llama", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
                  ffn_size=28672, vocab_size=32000, max_seq_len=4096, rotary_pct=1.0)


@dataclass(frozen=True)
class TunedCell:
    """One workload on one cluster; the plan is the tuner's."""

    id: str
    model: str | dict[str, Any]  # a models preset, or ModelConfig fields
    seq: int
    global_batch: int
    cluster: str  # preset spec NAME:NODESxPER_NODE


def grid_cells() -> list[TunedCell]:
    """The Mist grid (scripts/reproduce_paper.py): 16 sequences per GPU, L4 at seq 2048, A100 at 4096."""
    out = []
    for platform, seq, families in (("l4", 2048, ("gpt3", "llama", "falcon")), ("a100-40gb", 4096, ("gpt3", "llama"))):
        for family in families:
            for gpus, size in ((2, "1.3b"), (4, "2.7b"), (8, "7b"), (16, "13b"), (32, "22b")):
                cluster = f"{platform}:{max(1, gpus // 8)}x{min(gpus, 8)}"
                out.append(TunedCell(f"{platform}-{family}-{size}-{gpus}", f"{family}-{size}", seq, 16 * gpus, cluster))
    return out


CELLS: tuple[TunedCell, ...] = (
    *grid_cells(),
    TunedCell("h100-llama3-8b-8", LLAMA3_8B, 8192, 64, "h100:1x8"),
    TunedCell("h100-llama2-70b-32", LLAMA2_70B, 4096, 256, "h100:4x8"),
)


def config_of(cell: TunedCell) -> Any:
    import models
    from models.config import ModelConfig

    cfg = models.get_config(cell.model) if isinstance(cell.model, str) else ModelConfig(**cell.model)
    return cfg.replace(dtype="bfloat16")  # bf16 compute, fp32 weights (the grid's setting)


def plan_text(plan: Any) -> str:
    zero = "/".join(str(s.zero_stage) for s in plan.stages)
    remat = "/".join(str(s.remat_layers) for s in plan.stages)
    off = "/".join(f"{s.offload_opt:g}" for s in plan.stages)
    sched = f" {plan.schedule}" + (f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else "") \
        if plan.num_stages > 1 else ""
    return (f"S{plan.num_stages}{sched} dp{plan.dp} tp{plan.tp} b{plan.micro_batch} G{plan.grad_accum} "
            f"L{[s.num_layers for s in plan.stages]} ZeRO{zero} ckpt{remat} oo{off}")


def split(analysis: Any) -> list[dict[str, float]]:
    """Per device group: the predicted state (params + optimizer) and the rest."""
    out = []
    for m in analysis.stage_memory:
        state = m.get("params", 0.0) + m.get("optimizer", 0.0)
        out.append({"state": state, "rest": sum(m.values()) - state})
    return out


def run_cell(cell: TunedCell, time_limit: float, rounds: int) -> dict[str, Any]:
    import mistjax
    import models
    from mistjax.cost.predict import analyze
    from mistjax.hardware.presets import ClusterSpec
    from mistjax.validate.verified import tune_verified

    cfg, cluster = config_of(cell), ClusterSpec.parse(cell.cluster)
    workload = models.workload(cfg, cell.seq, cell.global_batch)
    tune_s: list[float] = []

    def tune_fn(c: Any) -> Any:
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            plan = mistjax.tune(workload, c, time_limit=time_limit, baselines=()).plan
        tune_s.append(time.perf_counter() - t)
        return plan.as_plan() if hasattr(plan, "as_plan") else plan

    t0 = time.perf_counter()
    v = tune_verified(cfg, workload, cluster, tune_fn, max_rounds=rounds)
    recs = []
    for r, ts in zip(v.rounds, tune_s):
        comps = split(analyze(workload, r.plan, cluster.with_budget(r.budget)))
        recs.append({"budget": r.budget, "plan": r.plan.to_dict(), "plan_text": plan_text(r.plan),
                     "predicted": list(r.predicted), "xla": list(r.xla), "components": comps,
                     "err": [p / x - 1.0 for p, x in zip(r.predicted, r.xla)], "fits": r.report.fits,
                     "within_budget": r.overflow <= 0, "tune_s": ts, "compile_s": r.report.compile_seconds,
                     "pipelined": r.plan.num_stages > 1})
    return {"id": cell.id, "cluster": cell.cluster, "seq": cell.seq, "global_batch": cell.global_batch,
            "capacity": cluster.device.hbm_bytes, "planning_budget": cluster.memory_budget(),
            "memory_margin": cluster.device.memory_margin, "rounds": recs, "verified": v.verified,
            "seconds": time.perf_counter() - t0}


def print_cell(rec: dict[str, Any]) -> None:
    for i, r in enumerate(rec["rounds"]):
        errs = " ".join(f"{e:+.3f}" for e in r["err"])
        print(f"{rec['id']:24s} r{i + 1} budget {r['budget'] / GiB:6.2f} pred {max(r['predicted']) / GiB:6.2f} "
              f"XLA {max(r['xla']) / GiB:6.2f} GiB (card {rec['capacity'] / GiB:.0f}, budget "
              f"{rec['planning_budget'] / GiB:.1f}) fits {'yes' if r['fits'] else 'NO '} "
              f"in-budget {'yes' if r['within_budget'] else 'no '} err/group [{errs}] tune {r['tune_s']:.0f} s "
              f"compile {r['compile_s']:.0f} s  {r['plan_text']}", flush=True)


def summarise(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Errors over every compiled plan's device groups; fits of the first and the last round."""
    errs = [abs(e) for rec in recs for r in rec["rounds"] for e in r["err"]]
    peak_errs = [abs(max(r["predicted"]) / max(r["xla"]) - 1.0) for rec in recs for r in rec["rounds"]]
    return {"cells": len(recs), "compiled_plans": sum(len(rec["rounds"]) for rec in recs),
            "group_err_median": statistics.median(errs) if errs else None, "group_err_max": max(errs, default=None),
            "peak_err_median": statistics.median(peak_errs) if peak_errs else None,
            "peak_err_max": max(peak_errs, default=None),
            "first_plan_fits_card": sum(rec["rounds"][0]["fits"] for rec in recs),
            "first_plan_within_budget": sum(rec["rounds"][0]["within_budget"] for rec in recs),
            "final_fits_card": sum(rec["rounds"][-1]["fits"] for rec in recs),
            "final_within_budget": sum(rec["rounds"][-1]["within_budget"] for rec in recs),
            "pipelined_cells": sum(rec["rounds"][-1]["pipelined"] for rec in recs)}


def markdown(recs: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The table for docs/benchmarks.md: each cell's first plan and, when it was re-tuned, its last."""
    lines = ["| cell | round | plan | predicted GiB | XLA:GPU GiB | pred / XLA - 1 (largest group) | fits card | "
             "in budget |", "|---|---|---|---|---|---|---|---|"]
    for rec in recs:
        rounds = rec["rounds"] if len(rec["rounds"]) == 1 else [rec["rounds"][0], rec["rounds"][-1]]
        for i, r in zip((1, len(rec["rounds"])), rounds):
            p, x = max(r["predicted"]), max(r["xla"])
            lines.append(f"| {rec['id']} | {i} | {r['plan_text']} | {p / GiB:.2f} | {x / GiB:.2f} | {p / x - 1:+.3f} | "
                         f"{'yes' if r['fits'] else '**no**'} | {'yes' if r['within_budget'] else 'no'} |")
    lines.append("")
    lines.append(f"{summary['cells']} cells, {summary['compiled_plans']} plans compiled; per device group |pred / "
                 f"XLA - 1| median {summary['group_err_median']:.3f}, max {summary['group_err_max']:.3f}; largest "
                 f"group's peak median {summary['peak_err_median']:.3f}, max {summary['peak_err_max']:.3f}; first "
                 f"plan fits its card {summary['first_plan_fits_card']} / {summary['cells']}, within the planning "
                 f"budget {summary['first_plan_within_budget']}; last plan fits {summary['final_fits_card']}, within "
                 f"budget {summary['final_within_budget']}.")
    return "\n".join(lines)


@dataclass
class Args:
    """Tune every cell, compile its plan for the GPU, compare."""

    json_out: Annotated[str | None, tyro.conf.arg(name="json")] = None  # write the records and summary here
    cells: str = ""  # comma-separated cell ids (default: all)
    time_limit: float = 20.0  # seconds per search
    rounds: int = 1  # plans tuned and compiled per cell (> 1: re-tune with the measured gap)
    reprint: str = ""  # print the table of a JSON written by --json (no tuning, no compiles)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = tyro.cli(Args, args=argv, description=__doc__)
    if args.reprint:
        done = json.loads(Path(args.reprint).read_text())
        print(markdown(done["cells"], summarise(done["cells"])))
        return done
    from mistjax.validate.gpu_aot import plugin_problem

    problem = plugin_problem()
    if problem:
        sys.exit(f"bench_gpu_aot_tuned: {problem}")
    wanted = {c for c in args.cells.split(",") if c}
    cells = [c for c in CELLS if not wanted or c.id in wanted]
    if wanted - {c.id for c in cells}:
        sys.exit(f"unknown cell ids {sorted(wanted - {c.id for c in cells})}; known: {[c.id for c in CELLS]}")
    recs = []
    for cell in cells:
        try:
            recs.append(run_cell(cell, args.time_limit, args.rounds))
        except Exception as e:  # noqa: BLE001 - one failed cell is reported, the others still run
            print(f"{cell.id}: FAILED: {type(e).__name__}: {str(e)[-600:]}", flush=True)
            continue
        print_cell(recs[-1])
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"cells": recs, "summary": summarise(recs)}, indent=1))
    summary = summarise(recs)
    print(json.dumps(summary, indent=1))
    print(markdown(recs, summary))
    return {"cells": recs, "summary": summary}


if __name__ == "__main__":
    main()
