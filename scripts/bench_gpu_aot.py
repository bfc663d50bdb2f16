"""Cost model vs XLA:GPU at full scale: deviceless AOT compiles for the target clusters (issue #13).

Usage::

    python scripts/bench_gpu_aot.py [--json FILE] [--cells ID,ID] [--top N]

For each cell (a published or representative plan on an L4 / A100 / H100 cluster) the runtime's real
train step (bf16 compute and weights, an fp32 master copy, AdamW) is compiled for the cluster's GPUs without GPUs
(`mistjax.validate.gpu_aot`), and XLA:GPU's per-device memory is printed next to the cost model's
prediction (`mistjax.cost.predict.analyze`) and, for published runs, the measured peak. Then, per cell,
the largest values live at XLA's memory peak and the async collectives. Pipelined cells (published
Mist plans, `published=True`) run on the MPMD executor: every (stage, phase) program is compiled for its
stage's GPUs and each stage's peak (`mistjax.validate.gpu_aot_pipeline`: the largest program's
arguments + outputs + temp - aliases, plus what lives between programs and is not its argument) is
printed next to the model's `peak_per_stage` and the run's measured per-stage peaks. Needs ``pip install
'mistjax[gpu-aot]'``; runs with JAX_PLATFORMS=cpu (set here). See docs/cost_model.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

GiB = 2**30
PUBLISHED = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "published-runs.json")


@dataclass(frozen=True)
class Cell:
    """One plan on one cluster."""

    id: str  # short name (the published run's id where there is one)
    model: str  # models preset
    seq: int  # sequence length
    global_batch: int  # sequences per step
    cluster: str  # preset spec NAME:NODESxPER_NODE
    plan: dict[str, Any]  # uniform_plan kwargs, or {"stages": [...], ...} for a per-stage plan
    measured_gib: float | None = None  # published measured peak (max over stages), if any
    note: str = ""  # how the plan relates to the published one
    published: bool = False  # the plan, model shape and measured peaks come from PUBLISHED (`to_plan`)


CELLS: tuple[Cell, ...] = (
    Cell("mist-readme-megatron-best-gpt1.3b-l4x2", "gpt3-1.3b", 2048, 32, "l4:1x2",
         dict(micro_batch=8, grad_accum=2, remat_layers=24, remat_policy="full", shard_opt=True),
         measured_gib=19273.83 / 1024, note="Megatron-LM best: dp 2, b 8, G 2, full recompute, distributed optimizer"),
    Cell("mist-tuned-gpt1.3b-l4x2-flash1", "gpt3-1.3b", 2048, 32, "l4:1x2", {}, published=True,
         note="Mist-tuned (published plan): 2 stages (13 + 11 layers), b 2, G 16, ZeRO-1, no remat, flash"),
    Cell("mist-tuned-gpt7b-l4x8-flash1", "gpt3-7b", 2048, 128, "l4:1x8", {}, published=True,
         note="Mist-tuned (published plan): 4 stages x dp 2, b 1, G 64, ZeRO-1, remat 3/2/0/0, optimizer "
              "offload 0/0.125/0.375/0, flash"),
    Cell("tp4-gpt7b-a100-40gb-1x8", "gpt3-7b", 2048, 16, "a100-40gb:1x8",
         dict(tp=4, micro_batch=1, grad_accum=8, remat_layers=32, remat_policy="full", shard_opt=True),
         note="Megatron-style: tp 4 (+SP) x dp 2, b 1, G 8, full recompute, distributed optimizer"),
    Cell("zero3-llama7b-h100-1x8", "llama-7b", 2048, 16, "h100:1x8",
         dict(micro_batch=1, grad_accum=2, shard_opt=True, shard_grads=True, shard_weights=True),
         note="FSDP-style: ZeRO-3 over dp 8, b 1, G 2, no remat"),
)


def build_plan(cell: Cell, num_layers: int, devices: int) -> Any:
    from mistjax.plan import Plan, StagePlan, uniform_plan

    kw = dict(cell.plan)
    if "stages" not in kw or isinstance(kw["stages"], int):
        return uniform_plan(num_layers, devices, **kw)
    bounds = kw.pop("stages")
    plan_keys = ("micro_batch", "grad_accum", "tp", "shard_group", "schedule")
    glob = {k: kw.pop(k) for k in plan_keys if k in kw}
    stages = tuple(StagePlan(layers=(a, b), remat_layers=r, **kw) for a, b, r in bounds)
    dp = devices // (len(stages) * glob.get("tp", 1))
    return Plan(stages=stages, dp=dp, **glob)


def _dims(shape: str) -> tuple[str, tuple[int, ...]]:
    """(dtype, dims) of an array type like ``bf16[8,2048]``; ("", ()) for tuples and tokens."""
    m = re.fullmatch(r"(\w+)\[([\d,]*)\]", shape.strip())
    return (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)) if m else ("", ())


def param_shapes(state: Any, arg_shapes: list[str]) -> set[tuple[int, ...]]:
    """Per-layer shapes of the parameters: global (a gathered ZeRO-3 weight) and as stored (TP / ZeRO shards)."""
    import jax

    out = set()
    for x in jax.tree.leaves(state.params):
        shape = tuple(x.shape)
        out |= {shape, shape[1:]} if len(shape) > 2 else {shape}
    for s in arg_shapes:
        shape = _dims(s)[1]
        out |= {shape, shape[1:]} if len(shape) > 2 else {shape}
    return {s for s in out if len(s) >= 2}


def categorise(buf: dict[str, Any], cfg: Any, seq: int, shapes: set[tuple[int, ...]], stacks: set[int],
               tp: int) -> str:
    """A coarse label for a value live at XLA's peak: what the memory model should charge it as.

    Heuristic on shapes (GPT-1.3B has hidden == seq == 2048, so the order of the tests matters): attention
    scores are [..., heads (or batch x heads), s, s]; a parameter-shaped value is a parameter's per-layer
    shape, alone or under one layer-stack dim; logits carry the vocabulary; activations a token dim.
    """
    dtype, dims = _dims(buf["shape"])
    op = buf["op_name"]
    if buf["kind"] == "argument":
        return ("state: params" if ".params" in op else "state: optimizer" if "opt_state" in op else
                "state: other") + f" ({dtype})"
    where = " [cond output copy]" if op.endswith("/cond") else ""
    heads = max(cfg.num_heads // tp, 1)
    if len(dims) >= 3 and dims[-1] == dims[-2] == seq and dims[-3] % heads == 0:
        return f"attention scores/probs ({dtype}){where}"
    core = dims
    while len(core) > 2 and core[0] == 1:
        core = core[1:]
    if core in shapes or (len(core) > 2 and core[0] in stacks and core[1:] in shapes):
        return f"param-shaped ({dtype}, {buf['kind']}): grads / accumulators / weight copies"
    if cfg.vocab_size in dims:
        return f"logits-sized ({dtype})"
    if any(d % seq == 0 for d in dims if d >= seq):
        return f"activations ({dtype}){where}"
    return f"other ({buf['kind']})"


def breakdown(rec: dict[str, Any], cfg: Any, seq: int, state: Any, plan: Any) -> dict[str, int]:
    """Bytes live at XLA's peak by `categorise` label, largest first."""
    bufs = rec["xla_gpu"]["peak_buffers"]
    shapes = param_shapes(state, [b["shape"] for b in bufs if b["kind"] == "argument"])
    stacks = {cfg.num_layers, *(st.num_layers for st in plan.stages), max(st.num_layers for st in plan.stages)}
    out: dict[str, int] = {}
    for b in bufs:
        key = categorise(b, cfg, seq, shapes, stacks, plan.tp)
        out[key] = out.get(key, 0) + b["nbytes"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# `categorise` labels -> the cost model's memory categories (first matching prefix). Parameter-shaped fp32
# temporaries are mostly per-micro-batch gradients, but in pipelines also stage-layout weight copies.
MODEL_OF = (("state: params", "params"), ("state: optimizer", "optimizer"), ("state: other", "params"),
            ("param-shaped (f32", "grads"), ("attention", "activations"), ("activations", "activations"),
            ("logits", "buffers"), ("param-shaped (", "buffers"), ("other", "buffers"))
MODEL_CATEGORIES = ("params", "optimizer", "grads", "activations", "buffers")


def as_model_categories(breakdown: dict[str, int]) -> dict[str, int]:
    """XLA's live bytes at the peak summed into the cost model's categories (`MODEL_OF`)."""
    out = dict.fromkeys(MODEL_CATEGORIES, 0)
    for label, nbytes in breakdown.items():
        out[next(cat for prefix, cat in MODEL_OF if label.startswith(prefix))] += nbytes
    return out


def run_cell(cell: Cell, top: int, dump: str | None = None) -> dict[str, Any]:
    import models
    from mistjax.cost.predict import analyze
    from mistjax.hardware import ClusterSpec
    from mistjax.validate.gpu_aot import predicted_split, verify_model, zoo_step

    cfg = models.get_config(cell.model).replace(dtype="bfloat16", param_dtype="bfloat16")
    cluster = ClusterSpec.parse(cell.cluster)
    plan = build_plan(cell, cfg.num_layers, cluster.num_devices)
    t = time.perf_counter()
    analysis = analyze(models.workload(cfg, cell.seq, cell.global_batch), plan, cluster)
    t_model = time.perf_counter() - t
    keep = os.path.join(dump, cell.id) if dump else None
    report = verify_model(cfg, cell.seq, cell.global_batch, plan, cluster, keep_dump=keep)
    pred = predicted_split(analysis)
    stage = int(pred["stage"])
    rec = {"id": cell.id, "model": cell.model, "seq": cell.seq, "global_batch": cell.global_batch,
           "cluster": cell.cluster, "note": cell.note, "plan": json.loads(plan.to_json()),
           "predicted": {"state": pred["state"], "rest": pred["rest"], "peak": pred["peak"], "host": pred["host"],
                         "stage": stage, "categories": analysis.stage_memory[stage],
                         "peak_per_stage": [sum(m.values()) for m in analysis.stage_memory]},
           "xla_gpu": report.to_dict(), "measured_gib": cell.measured_gib,
           "peak_err": pred["peak"] / report.peak - 1.0, "model_seconds": t_model}
    rec["breakdown"] = breakdown(rec, cfg, cell.seq, zoo_step(cfg, cell.seq, cell.global_batch)[0], plan)
    rec["xla_categories"] = as_model_categories(rec["breakdown"])
    return rec


def published_run(cell: Cell) -> Any:
    from mistjax.validate.published_format import load_published

    return next(r for r in load_published(PUBLISHED).points if r.id == cell.id)


def run_pipelined_cell(cell: Cell) -> dict[str, Any]:
    """A published pipelined plan: every (stage, phase) program compiled for the GPUs, per-stage peaks
    (`mistjax.validate.gpu_aot_pipeline`) next to the cost model's and the run's measured ones."""
    import models
    from mistjax.cost.predict import analyze
    from mistjax.validate.gpu_aot_pipeline import verify_pipeline
    from mistjax.validate.published import cluster_for, to_plan
    from mistjax.validate.published_format import model_config

    run = published_run(cell)
    cfg = model_config(run.model, "bfloat16").replace(attention="fused" if run.flash_attention else "xla")
    plan, cluster = to_plan(run), cluster_for(run)
    t = time.perf_counter()
    analysis = analyze(models.workload(cfg, cell.seq, cell.global_batch), plan, cluster)
    t_model = time.perf_counter() - t
    report = verify_pipeline(cfg, cell.seq, cell.global_batch, plan, cluster)
    pred = [float(sum(m.values())) for m in analysis.stage_memory]
    xla = report.peak_per_stage
    meas = [m * 2**20 for m in run.measured.stage_peak_allocated_mib or ()]
    return {"id": cell.id, "model": cell.model, "seq": cell.seq, "global_batch": cell.global_batch,
            "cluster": cell.cluster, "note": cell.note, "plan": json.loads(plan.to_json()), "pipelined": True,
            "predicted": {"peak_per_stage": pred, "host_per_stage": [float(h) for h in analysis.stage_host],
                          "categories": list(analysis.stage_memory), "peak": max(pred)},
            "xla_gpu": report.to_dict(), "measured_per_stage": meas or None,
            "measured_gib": max(meas) / GiB if meas else None,
            "peak_err_per_stage": [p / x - 1.0 for p, x in zip(pred, xla)],
            "peak_err_host_kept_per_stage": [p / st.peak_host_kept - 1.0 for p, st in zip(pred, report.stages)],
            "peak_err": max(pred) / max(xla) - 1.0, "model_seconds": t_model}


def print_pipelined(rec: dict[str, Any]) -> None:
    x, p = rec["xla_gpu"], rec["predicted"]
    print(f"\n{rec['id']} ({rec['model']}, seq {rec['seq']}, batch {rec['global_batch']}, {rec['cluster']}): "
          f"{rec['note']}  [{len(x['stages'])} stages, compile {x['compile_seconds']:.0f} s]")
    print(f"  {'GiB per device':17s} {'predicted':>9s} {'(host)':>7s} {'XLA:GPU':>9s} {'err':>7s} {'host kept':>9s} "
          f"{'err':>7s} {'measured':>9s}  XLA peak program: args + out + temp - alias + resident "
          "(state / accs / residuals)")
    meas = rec["measured_per_stage"] or [None] * len(x["stages"])
    for k, st in enumerate(x["stages"]):
        prog = next(q for q in st["programs"] if q["phase"] == st["peak_phase"])
        m, r = prog["memory"], prog["resident_parts"]
        mm = f"{meas[k] / GiB:9.2f}" if meas[k] else f"{'-':>9s}"
        print(f"  stage {k} {str(tuple(st['layers'])):9s} {p['peak_per_stage'][k] / GiB:9.2f} "
              f"{p['host_per_stage'][k] / GiB:7.2f} {st['peak'] / GiB:9.2f} {rec['peak_err_per_stage'][k]:+7.3f} "
              f"{st['peak_host_kept'] / GiB:9.2f} {rec['peak_err_host_kept_per_stage'][k]:+7.3f} {mm}"
              f"  {st['peak_phase']}: {m['argument'] / GiB:.2f} + {m['output'] / GiB:.2f} + {m['temp'] / GiB:.2f} - "
              f"{m['alias'] / GiB:.2f} + {r['state'] / GiB:.2f} / {r['accumulators'] / GiB:.2f} / "
              f"{r['residuals'] / GiB:.2f} ({st['in_flight']} x {st['residual_bytes'] / GiB:.2f} GiB residuals max, "
              f"{st['offloaded'] / GiB:.2f} GiB state on host)")
        for q in st["programs"]:
            print(f"      {q['phase']:9s} XLA {q['xla_peak'] / GiB:7.2f} (temp {q['memory']['temp'] / GiB:6.2f}) "
                  f"+ resident {q['resident'] / GiB:6.2f} = {q['peak'] / GiB:7.2f}"
                  + (f" ({q['host_in_arguments'] / GiB:.2f} of its arguments are host-placed state)"
                     if q["host_in_arguments"] else ""))


def print_cell(rec: dict[str, Any], top: int) -> None:
    x, p = rec["xla_gpu"], rec["predicted"]
    mem = x["memory"]
    rest = x["peak"] - mem["argument"]
    meas = f"{rec['measured_gib']:.2f}" if rec["measured_gib"] else "-"
    print(f"\n{rec['id']} ({rec['model']}, seq {rec['seq']}, batch {rec['global_batch']}, {rec['cluster']}): "
          f"{rec['note']}")
    print(f"  {'GiB per device':28s} {'predicted':>10s} {'XLA:GPU':>10s}")
    print(f"  {'state (args)':28s} {p['state'] / GiB:10.2f} {mem['argument'] / GiB:10.2f}")
    print(f"  {'rest (temp + new outputs)':28s} {p['rest'] / GiB:10.2f} {rest / GiB:10.2f}")
    print(f"  {'peak':28s} {p['peak'] / GiB:10.2f} {x['peak'] / GiB:10.2f}   (pred/xla - 1 = {rec['peak_err']:+.3f}; "
          f"published measured {meas})")
    print(f"  {'by category, GiB':28s} " + " ".join(f"{c:>11s}" for c in MODEL_CATEGORIES) + "   host")
    label = f"predicted (stage {p['stage']})"
    print(f"  {label:28s} "
          + " ".join(f"{p['categories'].get(c, 0) / GiB:11.2f}" for c in MODEL_CATEGORIES) + f" {p['host'] / GiB:6.2f}")
    print(f"  {'XLA:GPU, live at the peak':28s} "
          + " ".join(f"{rec['xla_categories'][c] / GiB:11.2f}" for c in MODEL_CATEGORIES))
    print(f"  XLA: temp {mem['temp'] / GiB:.2f}, output {mem['output'] / GiB:.2f}, alias {mem['alias'] / GiB:.2f}, "
          f"host temp {mem['host_temp'] / GiB:.2f}; fits {x['capacity'] / GiB:.1f} GiB card: {x['fits']}; "
          f"compile {x['compile_seconds']:.0f} s")
    for note in x["notes"]:
        print(f"  note: {note}")
    colls = ", ".join(f"{k} {c['count']} ({c['async_pairs']} async, {c['overlapped']} overlapped, {c['in_loops']} "
                      f"in loops, {c['bytes_per_step'] / GiB:.2f} GiB/step)" for k, c in x["collectives"].items())
    print(f"  collectives: {colls}")
    if x["flops"]:
        print(f"  HloCostAnalysis: {x['flops']:.3e} flops, {x['bytes_accessed']:.3e} bytes accessed (loop bodies once)")
    live = sum(rec["breakdown"].values())
    print(f"  what is live at XLA's peak ({live / GiB:.2f} GiB in distinct buffers; the rest of the peak is "
          "XLA's packing slack):")
    for k, v in rec["breakdown"].items():
        print(f"    {v / GiB:8.2f} GiB  {k}")
    if top:
        print(f"  largest values live at XLA's peak ({top}):")
    for b in x["peak_buffers"][:top]:
        print(f"    {b['nbytes'] / 2**20:9.1f} MiB {b['kind']:10s} {b['shape']:30s} {b['op_name'][-80:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the cells and the summary to this file")
    ap.add_argument("--cells", help="comma-separated cell ids (default: all)")
    ap.add_argument("--top", type=int, default=16, help="live buffers to print per cell")
    ap.add_argument("--dump", help="keep XLA's dumps (HLO, buffer assignment, memory-usage report) in DIR/<cell>")
    ap.add_argument("--reprint", help="print the tables of a JSON written by --json (no compiles)")
    args = ap.parse_args()
    if args.reprint:
        with open(args.reprint) as f:
            for rec in json.load(f)["cells"]:
                if rec.get("pipelined"):
                    print_pipelined(rec)
                    continue
                rec["xla_categories"] = as_model_categories(rec["breakdown"])
                print_cell(rec, args.top)
        return
    from mistjax.validate.gpu_aot import plugin_problem

    problem = plugin_problem()
    if problem:
        sys.exit(f"bench_gpu_aot: {problem}")
    wanted = set(args.cells.split(",")) if args.cells else None
    cells = [c for c in CELLS if wanted is None or c.id in wanted]
    if wanted and len(cells) != len(wanted):
        sys.exit(f"unknown cell ids {sorted(wanted - {c.id for c in cells})}; known: {[c.id for c in CELLS]}")
    recs = []
    for cell in cells:
        rec = run_pipelined_cell(cell) if cell.published else run_cell(cell, args.top, args.dump)
        recs.append(rec)
        if cell.published:
            print_pipelined(rec)
        else:
            print_cell(rec, args.top)
        sys.stdout.flush()
    print(f"\n{'cell':42s} {'pred GiB':>9s} {'XLA GiB':>9s} {'err':>7s} {'measured':>9s}")
    for r in recs:
        meas = f"{r['measured_gib']:.2f}" if r["measured_gib"] else "-"
        xla_peak = max(r["xla_gpu"]["peak_per_stage"]) if r.get("pipelined") else r["xla_gpu"]["peak"]
        print(f"{r['id']:42s} {r['predicted']['peak'] / GiB:9.2f} {xla_peak / GiB:9.2f} "
              f"{r['peak_err']:+7.3f} {meas:>9s}")
    errs = [abs(r["peak_err"]) for r in recs]
    summary = {"n_cells": len(recs), "peak_err_median": statistics.median(errs) if errs else None,
               "peak_err_max": max(errs, default=None)}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cells": recs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
