"""Fit a hardware preset's kernel-pricing constants to published training runs.

Usage::

    python scripts/fit_presets.py tests/data/published-runs.json --preset l4 [--folds cell] [--write] [--json OUT]
    python scripts/fit_presets.py tests/data/field-runs.json tests/data/multinode-runs.json --preset dgx-h100 \
        --folds source                     (leave-one-source-out over several files)

Least squares on ``ln(predicted / measured)`` over every run of the files on the preset that has a
measured step time (`mistjax.validate.calibration`): one set of constants for all runs, no per-case factor.
Prints the residuals per run before and after the fit, the cross-validated (out-of-sample) error (each fold
of runs, by default one cell: model, cluster, attention, predicted with the constants fitted without it)
and every constant's spread over the folds. ``--write`` stores the constants in the preset's catalog JSON
with a "fitted to <file>, <n> runs, <date>, by scripts/fit_presets.py" sentence (with the values replaced)
in its ``device.source``, but only when the out-of-sample error beats the preset's current one (median and
max |ln|; ``--force`` writes anyway). See docs/cost_model.md, "Calibration".
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

    data: Annotated[tuple[str, ...], tyro.conf.Positional]  # published-runs JSON files (tests/data/*-runs.json)
    preset: str = "l4"  # the hardware preset (mistjax/hardware/catalog/<preset>.json) whose runs are fitted
    fields: tuple[str, ...] = ("matmul_efficiency", "matmul_k_half", "memory_efficiency", "kernel_overhead")
    # constants to fit (the others keep the preset's values)
    leave_one_out: bool = True  # also refit once per fold without it (the honest error of a small fit)
    folds: str = "cell"  # what a fold holds out: cell (model, cluster, attention) | run | model | source
    max_evaluations: int = 60  # residual evaluations per least-squares fit
    exclude: tuple[str, ...] = ()  # leave out runs whose id contains one of these (e.g. fp8: priced as bf16)
    write: bool = False  # store the fitted constants in the preset's catalog JSON (if out of sample improves)
    force: bool = False  # with --write: write even if the out-of-sample error does not improve
    catalog: str | None = None  # directory of the preset JSON to write (default: mistjax/hardware/catalog)
    json_out: Annotated[str | None, tyro.conf.arg(name="json")] = None  # write the fit and residuals here


def _row(run_id: str, before: float, after: float, loo: float | None) -> str:
    def pct(e: float | None) -> str:
        return "-" if e is None or math.isnan(e) else f"{math.exp(e):.3f}"

    return f"| {run_id} | {pct(before)} | {pct(after)} | {pct(loo)} |"


def _spread_table(result: Any) -> str:
    """Markdown table: every constant before, fitted, and its min / median / max over the folds."""
    spread = result.spread()
    lines = ["\n| constant | preset | fitted | folds min | median | max |", "|---|---:|---:|---:|---:|---:|"]
    for k, v in result.values.items():
        s = spread[k] if spread else None
        cells = ["-"] * 3 if s is None else [f"{s[q]:.4g}" for q in ("min", "median", "max")]
        lines.append(f"| {k} | {result.start[k]:.4g} | {v:.4g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _write(args: Args, result: Any) -> bool:
    """Store the fit in the preset's catalog JSON if it improves out of sample (or ``--force``); True if written."""
    from mistjax.hardware.presets import preset_document
    from mistjax.validate.calibration import fitted_source, update_preset_document

    if not (result.improves() or args.force):
        s = result.summary()
        loo = s["leave_one_out"]
        got = "not computed" if loo is None else f"{loo['median_abs_log_ratio']:.3f} / {loo['max_abs_log_ratio']:.3f}"
        print(f"not written: out-of-sample median / max |ln| {got} does not beat the preset's "
              f"{s['before']['median_abs_log_ratio']:.3f} / {s['before']['max_abs_log_ratio']:.3f} (--force writes)")
        return False
    folder = Path(args.catalog) if args.catalog else Path(__file__).resolve().parents[1] / "mistjax/hardware/catalog"
    path = folder / f"{args.preset}.json"
    subset = f"{args.preset} runs with a measured step time" + (
        f", leaving out the ids containing {' / '.join(args.exclude)}" if args.exclude else "")
    source = fitted_source(result, " + ".join(args.data), subset)
    doc = update_preset_document(preset_document(args.preset), result, source)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote the fitted constants into {path}\n{doc['device']['source'].split(' | ')[-1]}")
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = tyro.cli(Args, args=argv, description=__doc__)
    from mistjax.hardware.presets import PRESET_NAMES
    from mistjax.validate.calibration import fit, prepare
    from mistjax.validate.published import PublishedRunsError, load_published

    try:
        runs = tuple(r for path in args.data for r in load_published(path).points)
    except PublishedRunsError as e:
        raise SystemExit(f"fit_presets: {e}") from None
    if args.preset not in PRESET_NAMES:
        raise SystemExit(f"fit_presets: --preset {args.preset!r} is not a preset; one of {', '.join(PRESET_NAMES)}")
    chosen = [r for r in runs if r.hardware.preset == args.preset and not any(x in r.id for x in args.exclude)]
    if not chosen:
        presets = sorted({r.hardware.preset for r in runs})
        raise SystemExit(f"fit_presets: no run of {' + '.join(args.data)} is on preset {args.preset!r}; "
                         f"--preset one of {presets}")
    cases = prepare(chosen)
    print(f"fitting {', '.join(args.fields)} of {args.preset} to {len(cases)} timed runs of {' + '.join(args.data)}")
    try:
        result = fit(cases, args.fields, loo=args.leave_one_out, folds=args.folds, max_nfev=args.max_evaluations,
                     log=print)
    except ValueError as e:
        raise SystemExit(f"fit_presets: {e}") from None
    print("\nconstants: " + ", ".join(f"{k} {result.start[k]:.4g} -> {v:.4g}" for k, v in result.values.items()))
    print("\n| run | pred/meas before | fitted | leave-one-out |\n|---|---:|---:|---:|")
    loo = result.loo_log_errors or (None,) * len(result.ids)
    for rid, b, a, o in zip(result.ids, result.start_log_errors, result.log_errors, loo):
        print(_row(rid, b, a, o))
    summary = result.summary()
    print("\n" + "\n".join(f"{k}: {v}" for k, v in summary.items() if k != "constants_over_folds"))
    print(_spread_table(result))
    out = {"preset": args.preset, "data": list(args.data), "fields": list(args.fields), "folds": args.folds,
           "values": result.values, "start": result.start, "ids": list(result.ids),
           "log_errors": list(result.log_errors), "fold_of": list(result.fold_of),
           "fold_values": list(result.fold_values),
           "loo_log_errors": None if result.loo_log_errors is None else [  # null: a run not cross-validated
               None if math.isnan(e) else e for e in result.loo_log_errors],
           "start_log_errors": list(result.start_log_errors), "summary": summary, "adopted": False}
    if args.write:
        out["adopted"] = _write(args, result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json_out}")
    return out


if __name__ == "__main__":
    main()
