"""Fit a hardware preset's kernel-pricing constants to published training runs.

Usage::

    python scripts/fit_presets.py tests/data/published-runs.json --preset l4 [--write] [--json OUT]

Least squares on ``ln(predicted / measured)`` over every run of the file on the preset's device that has a
measured step time (`mistjax.validate.calibration`): one set of constants for all runs, no per-case factor.
Prints the residuals per run before and after the fit and a leave-one-out error (each run predicted with the
constants fitted without it). ``--write`` stores the constants in the preset's catalog JSON with a
"fitted to ..." sentence in its ``device.source``. See docs/cost_model.md, "Calibration".
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tyro  # noqa: E402


@dataclass(frozen=True)
class Args:
    """Flags of scripts/fit_presets.py."""

    data: Annotated[str, tyro.conf.Positional]  # a published-runs JSON file (e.g. tests/data/published-runs.json)
    preset: str = "l4"  # the hardware preset (mistjax/hardware/catalog/<preset>.json) whose runs are fitted
    fields: tuple[str, ...] = ("matmul_efficiency", "matmul_k_half", "memory_efficiency", "kernel_overhead")
    # constants to fit (the others keep the preset's values)
    leave_one_out: bool = True  # also refit once per run without it (the honest error of a small fit)
    max_evaluations: int = 60  # residual evaluations per least-squares fit
    write: bool = False  # store the fitted constants in the preset's catalog JSON
    json_out: Annotated[str | None, tyro.conf.arg(name="json")] = None  # write the fit and residuals here


def _row(run_id: str, before: float, after: float, loo: float | None) -> str:
    def pct(e: float | None) -> str:
        return "-" if e is None else f"{math.exp(e):.3f}"

    return f"| {run_id} | {pct(before)} | {pct(after)} | {pct(loo)} |"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = tyro.cli(Args, args=argv, description=__doc__)
    from mistjax.hardware.presets import PRESET_NAMES, preset_document
    from mistjax.validate.calibration import fit, fitted_source, prepare, update_preset_document
    from mistjax.validate.published import PublishedRunsError, load_published

    try:
        runs = load_published(args.data).points
    except PublishedRunsError as e:
        raise SystemExit(f"fit_presets: {e}") from None
    if args.preset not in PRESET_NAMES:
        raise SystemExit(f"fit_presets: --preset {args.preset!r} is not a preset; one of {', '.join(PRESET_NAMES)}")
    chosen = [r for r in runs if r.hardware.preset == args.preset]
    if not chosen:
        presets = sorted({r.hardware.preset for r in runs})
        raise SystemExit(f"fit_presets: no run of {args.data} is on preset {args.preset!r}; --preset one of {presets}")
    cases = prepare(chosen)
    print(f"fitting {', '.join(args.fields)} of {args.preset} to {len(cases)} timed runs of {args.data}")
    try:
        result = fit(cases, args.fields, loo=args.leave_one_out, max_nfev=args.max_evaluations, log=print)
    except ValueError as e:
        raise SystemExit(f"fit_presets: {e}") from None
    print("\nconstants: " + ", ".join(f"{k} {result.start[k]:.4g} -> {v:.4g}" for k, v in result.values.items()))
    print("\n| run | pred/meas before | fitted | leave-one-out |\n|---|---:|---:|---:|")
    loo = result.loo_log_errors or (None,) * len(result.ids)
    for rid, b, a, o in zip(result.ids, result.start_log_errors, result.log_errors, loo):
        print(_row(rid, b, a, o))
    summary = result.summary()
    print("\n" + "\n".join(f"{k}: {v}" for k, v in summary.items()))
    out = {"preset": args.preset, "data": args.data, "values": result.values, "start": result.start,
           "ids": list(result.ids), "log_errors": list(result.log_errors),
           "loo_log_errors": None if result.loo_log_errors is None else list(result.loo_log_errors),
           "start_log_errors": list(result.start_log_errors), "summary": summary}
    if args.write:
        path = Path(__file__).resolve().parents[1] / "mistjax" / "hardware" / "catalog" / f"{args.preset}.json"
        doc = preset_document(args.preset)
        subset = f"{args.preset} runs with a measured step time"
        doc = update_preset_document(doc, result, fitted_source(result, Path(args.data).name, subset))
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote the fitted constants into {path}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json_out}")
    return out


if __name__ == "__main__":
    main()
