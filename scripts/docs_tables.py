"""Regenerate the tables of docs/benchmarks.md from the results files in docs/results/ (no benchmark is run).

Usage::

    python scripts/docs_tables.py            # rewrite every generated block of docs/benchmarks.md
    python scripts/docs_tables.py --check    # exit 1 naming the blocks whose text is not what the JSON gives

Each block sits between ``<!-- docs_tables:NAME:begin -->`` and ``<!-- docs_tables:NAME:end -->``; NAME picks a
function of :data:`TABLES`, which reads one results file. The reproduce_paper block is written by
``scripts/reproduce_paper.py`` itself and is not touched here. Standard library only (the field block reuses
scripts/field_sources.py's grouping), so it runs in a second.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
GiB = 2**30
MiB = 2**20
BLOCK = re.compile(r"(<!-- docs_tables:(?P<name>[\w-]+):begin -->\n)(?P<body>.*?)(<!-- docs_tables:(?P=name):end -->)",
                   re.S)
GRID_PLATFORMS = ("l4", "a100-40gb")


def load(name: str) -> Any:
    """One results file of docs/results/ as parsed JSON."""
    return json.loads((RESULTS / name).read_text())


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """A markdown table; the first ``left`` columns are left-aligned, the rest right-aligned."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def zero_level(stage: dict[str, Any]) -> int:
    """The ZeRO level of one stage of a plan dict."""
    return 3 if stage["shard_weights"] else 2 if stage["shard_grads"] else 1 if stage["shard_opt"] else 0


def plan_text(plan: dict[str, Any]) -> str:
    """A short text of a plan dict: parallel degrees, micro-batching, remat, ZeRO and optimizer offload per stage."""
    st = plan["stages"]
    zero = "/".join(sorted({str(zero_level(s)) for s in st}))
    text = (f"dp{plan['dp']} tp{plan['tp']} pp{len(st)} b{plan['micro_batch']} G{plan['grad_accum']} "
            f"remat {'/'.join(str(s['remat_layers']) for s in st)} Z{zero}")
    if any(s["offload_opt"] for s in st):
        text += " opt-off " + "/".join(f"{s['offload_opt']:g}" for s in st)
    return text


def short_plan(text: str) -> str:
    """A tuner plan text up to its per-stage lists (``S8 1f1b dp1 tp1 b2 G64``)."""
    return text.split(" L[")[0]


def published() -> str:
    """scripts/bench_published.py: the 20 Mist-artifact runs on L4, measured vs predicted."""
    d = load("published.json")
    t, m = d["summary"]["time"], d["summary"]["memory"]
    summary = table(["", "runs", "median \\|ln(pred/meas)\\|", "max", "geo-mean pred/meas", "predicted to fit"], [
        ["step time", t["n"], f"{t['median_abs_log_ratio']:.3f}", f"{t['max_abs_log_ratio']:.3f}",
         f"{t['geo_mean_ratio']:.3f}", "-"],
        ["peak memory (runs with a measured peak)", m["n"], f"{m['median_abs_log_ratio']:.3f}",
         f"{m['max_abs_log_ratio']:.3f}", "-", f"{m['n_fit']} / {m['n_ran']}"]])
    rows, pairs, ratios = [], [], []
    for p in d["points"]:
        meas = " / ".join(f"{x / 1024:.1f}" for x in p["measured_stage_peak_mib"] or []) or "-"
        pred = " / ".join(f"{x / 1024:.1f}" for x in p["predicted_stage_peak_mib"])
        ratio = f"{p['memory_ratio']:.2f}" if p.get("memory_ratio") else "-"
        rows.append([p["id"], p["cluster"], plan_text(p["plan"]), f"{p['measured_time_s']:.2f}",
                     f"{p['predicted_time_s']:.2f}", f"{p['time_ratio']:.2f}", meas, pred, ratio,
                     "yes" if p["fits"] else "**no**"])
        pairs += [[q["mist"], q["megatron"], f"{q['measured_speedup']:.3f}", f"{q['predicted_speedup']:.3f}",
                   f"{q['ratio']:.3f}"] for q in p.get("speedup_pairs") or []]
        ratios += [q["ratio"] for q in p.get("speedup_pairs") or []]
    within = sum(abs(r - 1) <= 0.10 for r in ratios)
    runs = table(["run", "cluster", "plan", "measured s", "predicted s", "time ratio", "measured peak GiB per stage",
                  "predicted peak GiB per stage", "peak ratio", "fits"], rows, left=3)
    pair_table = table(["Mist run", "Megatron-LM run", "measured speedup", "predicted speedup",
                        "predicted / measured"], pairs, left=2)
    return (f"{summary}\n\n{runs}\n\nMist over Megatron-LM in the same cell (speedup = t_Megatron / t_Mist): "
            f"{within} of {len(pairs)} pairs within 10%.\n\n{pair_table}\n")


def costmodel() -> str:
    """scripts/bench_costmodel.py: the cost model against XLA:CPU's compiled programs, 32 cells."""
    d = load("costmodel.json")
    rows = [[c["model"], c["seq"], c["global_batch"], c["plan"], f"{c['mem_pred'] / MiB:.1f}",
             f"{c['mem_xla'] / MiB:.1f}", f"{c['mem_err']:+.3f}", f"{c['flops_err']:+.4f}",
             "-" if c["coll_err"] is None else f"{c['coll_err']:+.4f}"] for c in d["cells"]]
    s = d["summary"]
    return (table(["model", "seq", "global batch", "plan", "memory predicted MiB", "memory XLA MiB", "memory err",
                   "FLOPs err", "collective bytes err"], rows, left=4)
            + f"\n\n{s['n_cells']} cells ({s['n_skipped_pipelined']} pipelined cells skipped: one program per stage "
            f"and phase); memory \\|err\\| median {s['mem_err_median']:.1%}, max {s['mem_err_max']:.1%}; FLOPs max "
            f"{s['flops_err_max']:.1%}; collective bytes max {s['coll_err_max']:.2%}.\n")


def tuner_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures docs and README quote from bench_tuner.json (also read by tests/test_readme_numbers.py)."""
    grid = [r for r in rows if r["cluster"].split(":")[0] in GRID_PLATFORMS]
    large = [r for r in rows if r not in grid]
    avg = {p: statistics.fmean(r["tokens_per_s"] / r["megatron_tokens_per_s"] for r in grid
                               if r["cluster"].split(":")[0] == p) for p in GRID_PLATFORMS}
    return {"cells": len(rows), "complete": sum(r["cut"] == 0 for r in rows),
            "same_plan": sum(bool(r.get("same_plan")) for r in rows),
            "min_wall_s": min(r["wall_s"] for r in rows), "max_wall_s": max(r["wall_s"] for r in rows),
            "max_grid_wall_s": max(r["wall_s"] for r in grid), "max_large_wall_s": max(r["wall_s"] for r in large),
            "min_gpus": min(r["gpus"] for r in rows), "max_gpus": max(r["gpus"] for r in rows), "avg_speedup": avg}


def tuner() -> str:
    """scripts/bench_tuner.py: complete searches of the grid and four large cells."""
    d = load("bench_tuner.json")
    rows = [[r["cell"], r["cluster"], f"{r['gpus']:,}", f"{r['wall_s']:.1f}", r["keys"],
             f"{r['searched']} / {r['pruned']} / {r['cut']}", short_plan(r["plan"]), f"{r['tokens_per_s']:,.0f}",
             f"{r['megatron_tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / r['megatron_tokens_per_s']:.3f}",
             f"{'yes' if r.get('same_plan') else '**no**'} ({r.get('long_wall_s', float('nan')):.1f})"]
            for r in d["rows"]]
    s = tuner_summary(d["rows"])
    avg = ", ".join(f"{p} {v:.3f}x" for p, v in s["avg_speedup"].items())
    return (table(["cell", "cluster", "GPUs", "search s", "keys", "searched / pruned / cut", "plan (outer key)",
                   "tokens/s", "Megatron-LM's space tokens/s", "speedup", "same plan at 10x the limit (s)"],
                  rows, left=2)
            + f"\n\n{s['complete']} / {s['cells']} searches complete (no key cut by the {d['time_limit']:g} s limit), "
            f"{s['same_plan']} / {s['cells']} return the same plan at 10x the limit; search times "
            f"{s['min_wall_s']:.1f}-{s['max_wall_s']:.1f} s (longest grid cell {s['max_grid_wall_s']:.1f} s, longest "
            f"large cell {s['max_large_wall_s']:.1f} s); grid average speedup over Megatron-LM's space: {avg}.\n")


def gpu_aot_tuned() -> str:
    """scripts/bench_gpu_aot_tuned.py: tuned plans compiled by XLA:GPU without GPUs, re-tuned once if over."""
    d = load("gpu_aot_tuned.json")
    rows = []
    for rec in d["cells"]:
        rounds = rec["rounds"] if len(rec["rounds"]) == 1 else [rec["rounds"][0], rec["rounds"][-1]]
        for i, r in zip((1, len(rec["rounds"])), rounds):
            p, x = max(r["predicted"]), max(r["xla"])
            rows.append([rec["id"], i, r["plan_text"], f"{p / GiB:.2f}", f"{x / GiB:.2f}", f"{p / x - 1:+.3f}",
                         "yes" if r["fits"] else "**no**", "yes" if r["within_budget"] else "no"])
    s = d["summary"]
    return (table(["cell", "round", "plan", "predicted GiB", "XLA:GPU GiB", "pred / XLA - 1 (largest group)",
                   "fits card", "in budget"], rows, left=3)
            + f"\n\n{s['cells']} cells, {s['compiled_plans']} plans compiled; per device group \\|pred / XLA - 1\\| "
            f"median {s['group_err_median']:.1%}, max {s['group_err_max']:.1%}; largest group's peak median "
            f"{s['peak_err_median']:.1%}, max {s['peak_err_max']:.1%}; first plan fits its card "
            f"{s['first_plan_fits_card']} / {s['cells']}, within the planning budget "
            f"{s['first_plan_within_budget']}; last plan fits {s['final_fits_card']}, within budget "
            f"{s['final_within_budget']}.\n")


def gpu_aot() -> str:
    """scripts/bench_gpu_aot.py: hand-written and published plans compiled by XLA:GPU without GPUs."""
    d = load("gpu_aot.json")
    rows = []
    for c in d["cells"]:
        pred = c["predicted"]["peak"]
        meas = f"{c['measured_gib']:.2f}" if c.get("measured_gib") else "-"
        rows.append([c["id"], c["cluster"], c["note"], f"{pred / GiB:.2f}", f"{pred / (1 + c['peak_err']) / GiB:.2f}",
                     f"{c['peak_err']:+.1%}", meas])
    s = d["summary"]
    return (table(["cell", "cluster", "plan", "predicted GiB (largest stage)", "XLA:GPU GiB", "pred / XLA - 1",
                   "measured (published) GiB"], rows, left=3)
            + f"\n\n{s['n_cells']} cells; \\|pred / XLA - 1\\| median {s['peak_err_median']:.1%}, max "
            f"{s['peak_err_max']:.1%}.\n")


def gpu_aot_pipelined() -> str:
    """scripts/bench_gpu_aot.py on the published pipelined plans: every stage's programs, per stage."""
    d = load("gpu_aot_pipelined.json")
    rows = []
    for c in d["cells"]:
        pred, host = c["predicted"]["peak_per_stage"], c["predicted"]["host_per_stage"]
        for i, (p, h, e, ek, m) in enumerate(zip(pred, host, c["peak_err_per_stage"],
                                                 c["peak_err_host_kept_per_stage"], c["measured_per_stage"])):
            lo, hi = c["plan"]["stages"][i]["layers"]
            rows.append([c["id"] if i == 0 else "", f"{i} ({lo}-{hi})",
                         f"{p / GiB:.2f}" + (f" (+{h / GiB:.2f})" if h else ""), f"{p / (1 + e) / GiB:.2f}",
                         f"{e:+.1%}", f"{p / (1 + ek) / GiB:.2f}", f"{ek:+.1%}", f"{m / GiB:.2f}"])
    s = d["summary"]
    return (table(["cell", "stage (layers)", "predicted GiB (+host)", "XLA:GPU GiB", "pred / XLA - 1",
                   "XLA:GPU, host kept", "pred / XLA - 1", "measured (published) GiB"], rows, left=2)
            + f"\n\nLargest stage per cell: \\|pred / XLA - 1\\| median {s['peak_err_median']:.1%}, max "
            f"{s['peak_err_max']:.1%}.\n")


def mpmd() -> str:
    """scripts/bench_mpmd.py: the MPMD executor's ops per step, host time and step time."""
    d = load("bench_mpmd.json")
    rows = [[r["grad_accum"], r["schedule"] + (f" (v={r['chunks']})" if r["chunks"] > 1 and r["schedule"] == "1f1b"
                                               else ""),
             r["ops"], r["programs"], r["transfers"], f"{r['host_s'] * 1e3:.1f}", f"{r['host_ms_per_op']:.3f}",
             f"{r['step_s'] * 1e3:.1f}", " / ".join(str(x) for x in r["residuals_in_flight"])] for r in d["runs"]]
    f = d["dispatch_floor_ms"]
    return (table(["G", "schedule", "ops/step", "programs", "transfers", "host ms", "ms/op", "step ms",
                   "micro-batches of residuals in flight per stage"], rows, left=0)
            + f"\n\n{d['devices']} devices, jax {d['jax']}; dispatch floor {f['program']:.3f} ms per program, "
            f"{f['transfer']:.3f} ms per transfer.\n")


def bench_time() -> str:
    """scripts/bench_time.py: step time on this machine's 8 simulated devices, measured vs predicted."""
    d = load("bench_time.json")
    rows = [[p["label"], p["plan"], f"{p['measured_s'] * 1e3:.1f}", f"{p['noise_iqr']:.0%}",
             f"{p['noise_spread']:.0%}", f"{p['predicted_s'] * 1e3:.1f}", f"{p['ratio']:.2f}",
             f"{p['predicted_dispatch_s'] * 1e3:.1f}", f"{p['compile_s']:.1f}"] for p in d["points"]]
    s = d["summary"]
    ratios = [p["ratio"] for p in d["points"]]
    return (table(["plan", "shape", "measured ms", "IQR", "max-min", "predicted ms", "pred/meas", "dispatch ms",
                   "compile s"], rows, left=2)
            + f"\n\n{s['n']} plans, {d['rounds']} rounds of {d['block']} steps; Spearman {s['spearman']:.2f}, median "
            f"\\|pred/meas - 1\\| {s['median_abs_rel_err']:.1%}, pred/meas {min(ratios):.2f}-{max(ratios):.2f}; "
            f"{d['wall_s']:.0f} s.\n")


def zero_bubble() -> str:
    """scripts/bench_zero_bubble.py: the grid's tuned pipelined plans priced under 1F1B and ZB-H1."""
    d = load("zero_bubble.json")
    rows = [[c["platform"], c["model"], c["gpus"], c["stages"], c["grad_accum"], f"{c['step_1f1b']:.3f}",
             f"{c['step_zb']:.3f}", f"{c['gain']:.3f}", f"{c['bubble_1f1b']:.1%} -> {c['bubble_zb']:.1%}",
             f"{c['peak_1f1b'] / GiB:.2f} / {c['peak_zb'] / GiB:.2f}", f"{c['budget'] / GiB:.2f}",
             "yes" if c["fits"] else "no"] for c in d["cells"]]
    return table(["platform", "model", "GPUs", "S", "G", "1F1B s", "ZB-H1 s", "gain", "bubble 1F1B -> ZB",
                  "peak 1F1B / ZB GiB", "budget GiB", "ZB fits"], rows, left=2) + "\n"


def tp_overlap() -> str:
    """scripts/bench_tp_overlap.py: GPT-3 7B TP 8 on 8 H100, deviceless schedule and the cost model's price."""
    d = load("tp_overlap.json")
    rows = []
    for r in d["runs"]:
        coll = r["loop"]
        tp = {k: v for k, v in coll.items() if k != "all-reduce"}
        p = r["predicted"]
        pairs = sum(v["async_pairs"] for v in tp.values())
        rows.append(["on" if r["collective_matmul"] else "off",
                     " + ".join(f"{v['async_pairs']} {k}" for k, v in tp.items()),
                     f"{sum(v['with_gemm_between'] for v in tp.values())} / {pairs}", r["gemms_in_loop"],
                     f"{r['temp_mib']:.1f}", f"{r['peak_mib']:.1f}",
                     f"{p['layer_fwd_us']:.1f} / {p['layer_bwd_us']:.1f}",
                     f"{p['layer_chunks_fwd_us']:.0f} / {p['layer_chunks_bwd_us']:.0f}", f"{p['step_ms']:.2f}"])
    return table(["collective matmul", "TP collectives per layer (async pairs, both loops)",
                  "with a GEMM between start and done", "GEMMs in the layer loops",
                  "temp MiB", "peak MiB", "predicted TP us fwd / bwd", "predicted split-GEMM us fwd / bwd",
                  "predicted step ms"], rows) + "\n"


def unrolled(name: str) -> str:
    """scripts/bench_unrolled_memory.py: remat and ZeRO-3 savings on unrolled vs scanned stacks."""
    d = load(name)
    recs = d["records"]
    rows = []
    for u, s in zip(recs[::2], recs[1::2]):  # each unrolled record is followed by its scanned twin
        assert u["unrolled"] and not s["unrolled"] and u["knob"] == s["knob"], (u["family"], s["family"])

        def cell(r: dict[str, Any]) -> str:
            gathers = (f" [{r['base_all_gathers']['executed']} -> {r['with_all_gathers']['executed']}]"
                       if r["knob"] != "remat" and d["target"] == "cpu" else "")
            return f"{r['base']['peak'] / MiB:.1f} -> {r['with']['peak'] / MiB:.1f} ({r['saving']:.1%}){gathers}"

        rows.append([u["knob"], f"{u['family']} / {s['family']}", cell(u), cell(s), f"{u['saving'] / s['saving']:.2f}",
                     f"{u['vs_scan']:.2f}"])
    return table(["knob", "pair (unrolled / scanned)", "unrolled peak MiB", "scanned peak MiB", "ratio", "vs scan"],
                 rows, left=4) + "\n"


def gpu_h200() -> str:
    """scripts/bench_gpu.sh / bench_gpu.py on one H200: tuned and baseline plans measured."""
    d = load("bench_gpu_h200.json")
    rows = []
    for r in d["runs"]:
        if "error" in r:
            rows.append([r["model"], f"{r['budget_gib']:g}", "-", "no plan fits the budget", *["-"] * 6])
            continue
        if "same_as" in r:
            rows.append([r["model"], f"{r['budget_gib']:g}", r["plan_of"], f"the same plan as {r['same_as']}",
                         "-", f"{r['pred_step_time']:.3f}", "-", "-", f"{r['pred_peak'] / GiB:.2f}", "-"])
            continue
        p = r["plan"]
        st = p["stages"][0]
        remat = f"remat {st['remat_layers']} x {st['remat_policy']}" if st["remat_layers"] else "no remat"
        rows.append([r["model"], f"{r['budget_gib']:g}", r["plan_of"],
                     f"b{p['micro_batch']} G{p['grad_accum']} Z{zero_level(st)}, {remat}", f"{r['step_time']:.3f}",
                     f"{r['pred_step_time']:.3f}", f"{r['time_err']:+.1%}", f"{r['xla_peak'] / GiB:.2f}",
                     f"{r['pred_peak'] / GiB:.2f}", f"{r['mem_err']:+.1%}"])
    return (table(["model", "budget GiB", "space", "plan", "measured s", "predicted s", "time err", "XLA GiB",
                   "predicted GiB", "mem err"], rows, left=4)
            + f"\n\n{d['device']}; {d['date']}.\n")


FIT_FILES = ("fit-l4.json", "fit-l4-eager.json", "fit-h200.json", "fit-dgx-h100-loso.json", "fit-dgx-a100-loso.json")


def fits() -> str:
    """scripts/fit_presets.py: the L4 fits (shipped, and the rejected refit with eager kernels), the H200 fold and
    the leave-one-source-out refits of dgx-h100 / dgx-a100 on the field runs."""
    rows = []
    for name in FIT_FILES:
        d = load(name)
        s = d["summary"]
        vals = ", ".join(f"{k} {v:.4g}" for k, v in d["values"].items())
        rows.append([f"`docs/results/{name}`", d["preset"], vals, s["n"]] + [
            f"{s[k]['median_abs_log_ratio']:.3f} / {s[k]['max_abs_log_ratio']:.3f}"
            for k in ("before", "fitted", "leave_one_out")] + [d["folds"], "yes" if d.get("adopted") else "no"])
    return table(["file", "preset", "fitted constants", "runs", "start constants: median / max \\|ln\\|",
                  "fitted, in sample", "out of sample", "one fold holds out a", "written by --write"], rows,
                 left=3) + "\n"


def field() -> str:
    """scripts/bench_published.py on tests/data/field-runs.json: per source, never fitted (scripts/field_sources.py)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from field_sources import by_source
    from field_sources import table as source_table

    runs = json.loads((ROOT / "tests" / "data" / "field-runs.json").read_text())
    bench = load("field.json")
    s = bench["summary"]["memory"]
    return (source_table(by_source(runs, bench))
            + f"\n\nMemory: {s['n_ran']} runs ran; predicted to fit their card {s['n_fit']}, to pass the planning "
              f"budget {s['n_fit_budget']}.\n")


def mics() -> str:
    """scripts/bench_mics.py: MiCS's published runs, the 30B aws-p4d target and the bandwidth x scale sweep."""
    d = load("mics.json")
    rows = [[p["id"], p["plan"], f"{p['measured_s']:.2f}", f"{p['predicted_s']:.2f}", f"{p['ratio']:.3f}"]
            for p in d["published"]["points"]]
    t = d["target"]
    target = table(["space", "plan", "step s"], [[k, t[k]["plan"], f"{t[k]['step_s']:.3f}"]
                                                 for k in ("zero3", "mics_proper", "tuned_no_mics", "tuned")], left=2)
    sweep = [[c["gpus"], c["gbps_per_node"], f"{c['zero3']['step_s']:.2f}", f"{c['mics_proper']['step_s']:.2f}",
              f"{c['zero3']['step_s'] / c['mics_proper']['step_s']:.2f}", c["tuned"]["plan"],
              f"{c['tuned']['step_s']:.2f}"] for c in d["sweep"]]
    return (table(["run", "plan priced", "measured s", "predicted s", "pred/meas"], rows, left=2)
            + f"\n\n30B on aws-p4d:32x8 (MiCS over ZeRO-3 {t['mics_over_zero3']:.3f}x, tuned over the space without "
              f"MiCS groups {t['tuned_over_no_mics']:.3f}x):\n\n" + target + "\n\nSweep (GPT-3 13B, weak scaling):\n\n"
            + table(["GPUs", "Gb/s per node", "ZeRO-3 s", "MiCS s", "MiCS gain", "tuned plan", "tuned s"], sweep,
                    left=0) + "\n")


def schedules() -> str:
    """scripts/bench_schedules.py: each schedule's simulated fill share (bubble) and in-flight micro-batches."""
    d = load("schedules.json")
    rows = [[r["schedule"], r["chunks"], r["stages"], r["grad_accum"], f"{r['fill_share']:.3f}",
             f"{r['model_fill_share']:.3f}", f"{r['ideal_fill_share']:.3f}" if "ideal_fill_share" in r else "-",
             f"{r['peak_inflight']:g}", f"{r['makespan']:.2f}"] for r in d["rows"]]
    return table(["schedule", "chunks", "stages S", "micro-batches G", "fill share (simulated)",
                  "cost model's", "ideal (ZB-H1)", "peak in flight", "makespan (T)"], rows) + "\n"


TABLES: dict[str, Callable[[], str]] = {
    "published": published, "costmodel": costmodel, "tuner": tuner, "gpu_aot_tuned": gpu_aot_tuned,
    "gpu_aot": gpu_aot, "gpu_aot_pipelined": gpu_aot_pipelined,
    "mpmd": mpmd, "bench_time": bench_time, "zero_bubble": zero_bubble, "tp_overlap": tp_overlap,
    "unrolled_cpu": lambda: unrolled("unrolled_memory.json"),
    "unrolled_h100": lambda: unrolled("unrolled_memory_h100.json"), "gpu_h200": gpu_h200, "fits": fits,
    "field": field, "mics": mics, "schedules": schedules,
}


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every generated block rewritten, and the names of the blocks whose text changed."""
    changed: list[str] = []

    def sub(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in TABLES:
            raise SystemExit(f"docs/benchmarks.md: unknown block {name!r}; known: {', '.join(TABLES)}")
        body = TABLES[name]()
        if body != m["body"]:
            changed.append(name)
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(sub, text), changed


def main(argv: list[str] | None = None) -> int:
    """Rewrite (default) or check the generated blocks of docs/benchmarks.md."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only report stale blocks (exit status 1 if any)")
    ap.add_argument("--doc", default=str(DOC), help="the markdown file (default docs/benchmarks.md)")
    a = ap.parse_args(argv)
    path = Path(a.doc)
    new, changed = render(path.read_text())
    if a.check:
        if changed:
            print(f"{path}: stale blocks {', '.join(changed)}; run python scripts/docs_tables.py", file=sys.stderr)
        return 1 if changed else 0
    if changed:
        path.write_text(new)
    print(f"{path}: {len(changed)} block(s) rewritten{': ' + ', '.join(changed) if changed else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

