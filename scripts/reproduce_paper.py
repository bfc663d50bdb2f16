"""Mist's evaluation grid on the cost model: mistjax vs Megatron-LM, ZeRO-3/FSDP, MiCS and Mist's space.

Grid (Mist digest §6): GPT-3, Llama, Falcon at 1.3B / 2.7B / 7B / 13B / 22B on 2 / 4 / 8 / 16 / 32
GPUs (global batch 16 x GPUs), on L4 nodes (sequence 2048) and A100-40GB nodes (sequence 4096), 8 GPUs
per node. Every number is a *prediction* of the same cost model for the best plan of each space, each space
priced as the system that runs it runs it (`mistjax.tuning.SYSTEMS`: fp16 training as the Mist artifact's runs,
each system's state storage and kernels; the same records price `scripts/bench_published.py`'s runs).
Prints one row per cell, writes a markdown table into docs/benchmarks.md (between markers) and, with
``--json FILE``, the records. ``--quick`` runs a subset small enough for a test.

Run: python scripts/reproduce_paper.py [--quick] [--json FILE] [--no-docs] [--ablations N]
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the cost model only: no accelerator (nor its plugin's start-up)

import tyro  # noqa: E402

import models  # noqa: E402
from mistjax.hardware.presets import ClusterSpec  # noqa: E402
from mistjax.tuning import (  # noqa: E402
    ABLATION_STEPS,
    SearchSpace,
    ablation_spaces,
    baseline_spaces,
    baseline_system,
    search,
)
from mistjax.tuning.baselines import GRID_PRECISION  # noqa: E402
from mistjax.validate.published import load_published, measured_speedups, system_workload  # noqa: E402

PLATFORMS = {"l4": 2048, "a100-40gb": 4096}  # platform -> sequence length
CELLS = ((2, "1.3b"), (4, "2.7b"), (8, "7b"), (16, "13b"), (32, "22b"))  # (GPUs, model size)
FAMILIES = ("gpt3", "llama", "falcon")
BEGIN, END = "<!-- reproduce_paper:begin -->", "<!-- reproduce_paper:end -->"
PUBLISHED = ROOT / "tests" / "data" / "published-runs.json"  # the Mist artifact's measured L4 runs


def cluster_for(platform: str, gpus: int) -> ClusterSpec:
    return ClusterSpec.preset(platform, nodes=max(1, gpus // 8), per_node=min(gpus, 8))


def plan_text(plan: Any) -> str:
    if plan is None:
        return "-"
    zero = "/".join(str(s.zero_stage) for s in plan.stages)
    remat = "/".join(str(s.remat_layers) for s in plan.stages)
    off = "/".join(f"{s.offload_opt:g}" for s in plan.stages)
    mics = f" p{plan.shard_group}" if plan.shard_group != plan.dp else ""
    sched = f" {plan.schedule}" if plan.num_stages > 1 else ""
    sched += f" x{plan.virtual_stages} chunks" if plan.virtual_stages > 1 else ""
    cp = f" cp{plan.cp}" if plan.cp > 1 else ""
    return (f"S{plan.device_stages}{sched} dp{plan.dp}{cp} tp{plan.tp} b{plan.micro_batch} G{plan.grad_accum}{mics} "
            f"L{[s.num_layers for s in plan.stages]} ZeRO{zero} ckpt{remat} oo{off}")


def measured_by_cell(path: str | None) -> dict[tuple[str, str, int], float]:
    """(platform, model, GPUs) -> the measured Mist-over-Megatron-LM speedup of that cell, for runs with fused
    attention (the grid's models run fused attention) and the grid's batch (16 sequences per GPU)."""
    if not path:
        return {}
    runs = load_published(path)
    batch = {r.id: r.global_batch for r in runs.points}
    return {(m.hardware, m.model, m.gpus): m.speedup for m in measured_speedups(runs)
            if m.flash_attention and batch[m.mist] == batch[m.megatron] == 16 * m.gpus}


def run_cell(platform: str, family: str, size: str, gpus: int, time_limit: float, ablations: bool) -> dict[str, Any]:
    seq = PLATFORMS[platform]
    cfg = models.get_config(f"{family}-{size}")
    cluster = cluster_for(platform, gpus)
    # Every space is priced as the system that runs it runs it (`mistjax.tuning.SYSTEMS`: state storage at the
    # grid's precision, kernels); systems priced alike share one workload.
    workloads: dict[Any, Any] = {}

    def workload_of(name: str) -> Any:
        system = baseline_system(name)
        key = (system.storage(GRID_PRECISION), system.elementwise, system.whole_head_rotary)
        if key not in workloads:
            workloads[key] = system_workload(system, cfg, seq, 16 * gpus, GRID_PRECISION)
        return workloads[key]

    workload = workload_of("mistjax")
    t0 = time.perf_counter()
    mine = search(workload, cluster, SearchSpace(), time_limit=time_limit)
    tune_s = time.perf_counter() - t0
    base = {name: search(workload_of(name), cluster, sp, time_limit=time_limit)
            for name, sp in baseline_spaces().items()}
    # mistjax's space contains every baseline's: when the full prediction ranks a baseline's plan higher than the
    # search objective did, mistjax uses that plan (as `mistjax.tune` does) where the baseline is priced as
    # mistjax runs it. A system priced otherwise (Megatron-LM's eager kernels) is not adopted: mistjax would run
    # that plan its own way, which its own search already priced.
    best = min([mine, *(r for n, r in base.items() if workload_of(n) is workload)], key=lambda r: r.step_time)
    tok = best.prediction.tokens_per_s if best.plan is not None else 0.0
    btok = {n: (r.prediction.tokens_per_s if r.plan is not None else 0.0) for n, r in base.items()}
    meg = btok.get("megatron", 0.0)
    rec: dict[str, Any] = {
        "platform": platform, "family": family, "size": size, "gpus": gpus, "tokens_per_s": tok,
        "baselines": btok, "speedup_vs_megatron": tok / meg if meg > 0 else None, "tune_s": tune_s,
        "plan": best.plan.to_dict() if best.plan is not None else None, "plan_text": plan_text(best.plan),
        "adopted": None if best is mine else best.space.name, "timed_out": mine.timed_out,
    }
    if ablations:
        steps = {n: search(workload, cluster, sp, time_limit=time_limit)
                 for n, sp in ablation_spaces().items()}
        rec["ablation_tokens_per_s"] = {n: (r.prediction.tokens_per_s if r.plan is not None else 0.0)
                                        for n, r in steps.items()}
    return rec


def summarise(cells: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for platform in PLATFORMS:
        sp = [c["speedup_vs_megatron"] for c in cells if c["platform"] == platform and c["speedup_vs_megatron"]]
        if sp:
            out[platform] = {"avg_speedup_vs_megatron": sum(sp) / len(sp), "min_speedup_vs_megatron": min(sp),
                             "cells": len(sp)}
        both = [(c["speedup_vs_megatron"], c["measured_speedup"]) for c in cells if c["platform"] == platform
                and c["speedup_vs_megatron"] and c.get("measured_speedup")]
        if both:  # the cells that have a measured Mist-over-Megatron speedup
            pred, meas = (sum(x) / len(both) for x in zip(*both))
            out[platform]["measured"] = {"cells": len(both), "avg_predicted_speedup": pred,
                                         "avg_measured_speedup": meas, "ratio": pred / meas}
    out["tune_s_max"] = max((c["tune_s"] for c in cells), default=0.0)
    gains = {}
    abl = [c["ablation_tokens_per_s"] for c in cells if "ablation_tokens_per_s" in c]
    for prev, step in zip(ABLATION_STEPS, ABLATION_STEPS[1:]):
        ratios = [a[step] / a[prev] for a in abl if a.get(prev) and a.get(step)]
        if ratios:
            gains[step] = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    if gains:
        out["ablation_gain"] = gains  # geometric mean over the ablation cells, each step vs the previous
    return out


def markdown(cells: list[dict[str, Any]], summary: dict[str, Any], command: str) -> str:
    names = list(cells[0]["baselines"]) if cells else []
    lines = [BEGIN, "## Mist evaluation grid (predicted)", "",
             f"`{command}` (cost model predictions for the best plan of each space; throughput in tokens/s; "
             "speedup = mistjax / Megatron-LM; tune = mistjax's search time on this 2-core machine).", "",
             "| platform | model | GPUs | mistjax | " + " | ".join(names)
             + " | speedup | measured Mist / Megatron | tune s | mistjax plan |",
             "|---|---|---:|---:|" + "---:|" * len(names) + "---:|---:|---:|---|"]
    for c in cells:
        base = " | ".join(f"{c['baselines'][n]:,.0f}" if c["baselines"][n] else "OOM" for n in names)
        sp = f"{c['speedup_vs_megatron']:.2f}x" if c["speedup_vs_megatron"] else "-"
        meas = f"{c['measured_speedup']:.2f}x" if c.get("measured_speedup") else "-"
        lines.append(f"| {c['platform']} | {c['family']}-{c['size']} | {c['gpus']} | {c['tokens_per_s']:,.0f} | "
                     f"{base} | {sp} | {meas} | {c['tune_s']:.1f} | {c['plan_text']} |")
    lines.append("")
    for platform in PLATFORMS:
        if platform in summary:
            s = summary[platform]
            lines.append(f"- {platform}: average speedup over Megatron-LM {s['avg_speedup_vs_megatron']:.2f}x, "
                         f"minimum {s['min_speedup_vs_megatron']:.2f}x over {s['cells']} cells")
            if "measured" in s:
                m = s["measured"]
                lines.append(f"- {platform}, the {m['cells']} cells with a measured Mist-over-Megatron speedup (Mist "
                             f"artifact, `{PUBLISHED.relative_to(ROOT)}`): predicted average "
                             f"{m['avg_predicted_speedup']:.2f}x, measured {m['avg_measured_speedup']:.2f}x "
                             f"(predicted / measured {m['ratio']:.3f})")
    lines.append(f"- longest mistjax search: {summary['tune_s_max']:.1f} s")
    if "ablation_gain" in summary:
        steps = ", ".join(f"{k} {v:.3f}x" for k, v in summary["ablation_gain"].items())
        lines.append(f"- ablation (each step vs the previous, geometric mean): {steps}")
    lines += ["", END]
    return "\n".join(lines)


def write_docs(text: str, path: Path) -> None:
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + text + old[old.index(END) + len(END):]
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(new)


@dataclass(frozen=True)
class Args:
    """Flags of scripts/reproduce_paper.py."""

    quick: bool = False  # a small subset (GPT-3 at 2 and 4 GPUs) for tests
    json_out: Annotated[str | None, tyro.conf.arg(name="json")] = None  # write the records and summary here
    docs: str = str(ROOT / "docs" / "benchmarks.md")  # markdown file to update
    no_docs: Annotated[bool, tyro.conf.arg(name="no-docs")] = False  # do not touch the markdown file
    platforms: str = ",".join(PLATFORMS)  # comma-separated subset of l4,a100-40gb
    families: str = ",".join(FAMILIES)  # comma-separated model families
    max_gpus: int = 32  # cells up to this many GPUs
    time_limit: float = 60.0  # seconds per search
    # published-runs file whose measured Mist-over-Megatron speedups are shown next to the predicted ones
    # ('' for none)
    published: str = str(PUBLISHED) if PUBLISHED.exists() else ""
    ablations: int = 2  # GPT-3 cells per platform (smallest first) that also run the ablation steps


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the grid; print each cell and the summary; update the docs table; return (and optionally write) it."""
    args = tyro.cli(Args, args=argv, description=__doc__)
    platforms = [p for p in args.platforms.split(",") if p]
    families = [f for f in args.families.split(",") if f]
    cells_todo = [(g, s) for g, s in CELLS if g <= args.max_gpus]
    if args.quick:
        platforms, families, cells_todo = platforms[:1], ["gpt3"], [c for c in CELLS if c[0] <= 4]
    warnings.simplefilter("ignore", RuntimeWarning)
    measured = measured_by_cell(args.published)
    cells = []
    for platform in platforms:
        for family in families:
            for k, (gpus, size) in enumerate(cells_todo):
                rec = run_cell(platform, family, size, gpus, args.time_limit, family == "gpt3" and k < args.ablations)
                rec["measured_speedup"] = measured.get((platform, f"{family}-{size}", gpus))
                cells.append(rec)
                b = ", ".join(f"{n} {v:,.0f}" for n, v in rec["baselines"].items())
                sp = f"{rec['speedup_vs_megatron']:.2f}x" if rec["speedup_vs_megatron"] else "-"
                meas = f" (measured Mist {rec['measured_speedup']:.2f}x)" if rec["measured_speedup"] else ""
                print(f"{platform:>9} {family}-{size:<5} {gpus:>2} GPUs: mistjax {rec['tokens_per_s']:,.0f} tok/s "
                      f"({b}) speedup {sp}{meas}, tuned in {rec['tune_s']:.1f} s; {rec['plan_text']}", flush=True)
    summary = summarise(cells)
    print(json.dumps(summary, indent=1))
    flags = [a for a in (sys.argv[1:] if argv is None else argv) if a]
    command = " ".join(["python scripts/reproduce_paper.py", *flags])
    if not args.no_docs:
        write_docs(markdown(cells, summary, command), Path(args.docs))
    out = {"cells": [{k: v for k, v in c.items() if k != "plan_text"} for c in cells], "summary": summary}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
