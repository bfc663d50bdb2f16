"""Published training runs vs the cost model: measured and predicted step time and per-stage peak memory.

Usage::

    python scripts/bench_published.py tests/data/published-runs.json [--json OUT]

For every run of a file in the ``published-runs.json`` format (any zoo model or shape, any cluster
preset) builds the equivalent mistjax plan, prices it with the cost model and prints: one row per
run (measured vs predicted time and per-stage peak memory), the Mist-over-Megatron speedups of the
runs of one cell, the predicted memory by category per stage (runs with a measured peak), the
predicted time by resource and by structure, and the summary. ``--json`` writes
``{"points": [...], "summary": {"time": {...}, "memory": {...}}}``. See docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tyro  # noqa: E402

GiB, MiB = 2**30, 2**20


def _table(header: Sequence[str], rows: list[Sequence[Any]], right_from: int = 1) -> str:
    """A GitHub-markdown table (numbers right-aligned from column ``right_from``)."""
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _gib(values: Sequence[float] | None, scale: float = MiB) -> str:
    return "-" if values is None else " / ".join(f"{v * scale / GiB:.1f}" for v in values)


def _plan_text(plan: Any) -> str:
    s0 = plan.stages
    remat = "/".join(str(s.remat_layers) for s in s0)
    zero = sorted({s.zero_stage for s in s0})
    off = [s.offload_opt for s in s0]
    text = f"dp{plan.dp} tp{plan.tp} pp{plan.num_stages} b{plan.micro_batch} G{plan.grad_accum} remat {remat}"
    text += f" Z{'/'.join(map(str, zero))}"
    return text + (f" opt-off {'/'.join(f'{x:g}' for x in off)}" if any(off) else "")


def runs_table(preds: list[Any]) -> str:
    rows = []
    for p in preds:
        r = p.run
        ratio = p.time_ratio
        mem = p.memory_ratio
        rows.append([r.id, r.framework, f"{r.hardware.preset}:{r.hardware.nodes}x{r.hardware.per_node}",
                     _plan_text(p.plan), "-" if r.measured.iter_time_s is None else f"{r.measured.iter_time_s:.2f}",
                     f"{p.step_time:.2f}", "-" if ratio is None else f"{ratio:.2f}",
                     _gib(r.measured.stage_peak_allocated_mib), _gib(p.stage_peaks, 1.0),
                     "-" if mem is None else f"{mem:.2f}", "yes" if p.fits else "no",
                     "yes" if p.fits_budget else "no", "yes" if p.runtime_ok else "no"])
    return _table(["run", "system", "cluster", "plan", "measured s", "predicted s", "time ratio",
                   "measured peak GiB per stage", "predicted peak GiB per stage", "peak ratio", "fits card",
                   "fits budget", "runtime"], rows, right_from=4)


def pairs_table(pairs: list[dict[str, Any]]) -> str:
    rows = [[q["mist"], q["megatron"], f"{q['measured_speedup']:.3f}", f"{q['predicted_speedup']:.3f}",
             f"{q['ratio']:.3f}"] for q in pairs]
    return _table(["Mist run", "Megatron-LM run", "measured speedup", "predicted speedup", "predicted / measured"],
                  rows, right_from=2)


def memory_table(preds: list[Any]) -> str:
    from mistjax.cost.model import MEMORY_CATEGORIES

    rows = []
    for p in preds:
        meas = p.run.measured.stage_peak_allocated_mib
        if meas is None:
            continue
        for i, m in enumerate(p.analysis.stage_memory):
            rows.append([p.run.id, i, f"{meas[i] / 1024:.1f}", f"{sum(m.values()) / GiB:.1f}",
                         *(f"{m[k] / GiB:.1f}" for k in MEMORY_CATEGORIES), f"{p.analysis.stage_host[i] / GiB:.1f}"])
    return _table(["run", "stage", "measured GiB", "predicted GiB", *MEMORY_CATEGORIES, "host"], rows, right_from=1)


def time_table(preds: list[Any]) -> str:
    from mistjax.validate.published import RESOURCES

    rows = []
    for p in preds:
        res, st = p.by_resource, p.by_structure
        meas = p.run.measured.iter_time_s
        rows.append([p.run.id, "-" if meas is None else f"{meas:.2f}", f"{p.step_time:.2f}",
                     *(f"{res[k]:.2f}" for k in (*RESOURCES, "shared")),
                     *(f"{st[k]:.2f}" for k in ("steady", "pipeline_fill_drain", "per_step"))])
    return _table(["run", "measured s", "predicted s", *RESOURCES, "shared", "steady", "fill/drain", "per step"],
                  rows, right_from=1)


def summary_text(summary: dict[str, dict[str, Any]]) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    return "\n".join(f"{part}: " + ", ".join(f"{k} {f(v)}" for k, v in vals.items()) for part, vals in summary.items())


@dataclass(frozen=True)
class Args:
    """Flags of scripts/bench_published.py."""

    data: Annotated[str, tyro.conf.Positional]  # a published-runs JSON file (e.g. tests/data/published-runs.json)
    json_out: Annotated[str | None, tyro.conf.arg(name="json")] = None  # write points and summary here


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Predict every run of the file; print the table and summary; return (and optionally write) them."""
    args = tyro.cli(Args, args=argv, description=__doc__)

    from mistjax.validate.published import (
        PublishedRunsError,
        RunFailure,
        load_published,
        point_dict,
        predict_all,
        speedup_pairs,
        summarize,
    )

    try:
        runs = load_published(args.data)
    except PublishedRunsError as e:
        raise SystemExit(f"bench_published: {e}") from None
    results = predict_all(runs)
    pairs = speedup_pairs(results)
    summary = summarize(results)
    preds = [p for p in results if not isinstance(p, RunFailure)]
    print(f"{len(results)} runs from {args.data}\n")
    for p in results:
        if isinstance(p, RunFailure):
            print(f"NOT PRICED {p.run.id}: {p.error}")
    print(runs_table(preds), "\n")
    if pairs:
        print("Mist over Megatron-LM, same cell (model, cluster, flash flag):\n")
        print(pairs_table(pairs), "\n")
    print("Predicted memory per stage by category (GiB; runs with a measured peak):\n")
    print(memory_table(preds), "\n")
    print("Predicted step time by resource and by structure (seconds):\n")
    print(time_table(preds), "\n")
    notes: dict[str, list[str]] = {}
    for p in preds:
        for note in p.notes:
            notes.setdefault(note, []).append(p.run.id)
    for note, ids in notes.items():
        print(f"note ({len(ids)} run{'s' * (len(ids) > 1)}): {note}" + (f" [{', '.join(ids)}]" if len(ids) < 4 else ""))
    print("\n" + summary_text(summary))
    points = []
    for p in results:
        d = point_dict(p)
        d["speedup_pairs"] = [q for q in pairs if q["mist"] == p.run.id]
        points.append(d)
    out = {"points": points, "summary": summary}
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {args.json_out}")
    return out


if __name__ == "__main__":
    main()
