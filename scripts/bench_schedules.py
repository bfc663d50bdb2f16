"""Pipeline schedules' bubbles, simulated: the executor's issue order of each schedule replayed with F, B and W.

Run: python scripts/bench_schedules.py [--json FILE] [--shapes 8x32 4x16 ...] [--wgrad-share 0.25]

For 1F1B, interleaved 1F1B (2 chunks per device group), ZB-H1 and ZB-V (2 chunks per group in a V) it takes the
host's issue order (`core.pipeline_order.issue_order`, what `runtime.mpmd` issues) at each shape ``S x G``
(device groups x micro-batches) and replays it with equal stages (`core.pipeline_order.simulated_time`): a
device group's micro-batch takes T = F + B + W = 1, the forward F = T/3, the weight-gradient passes W =
``--wgrad-share`` T (a quarter by default: the measured share on the Mist grid and the large cells is 0.24-0.29)
and the input gradient B the rest; without a split backward (1F1B, interleaved) the backward is B + W in one
pass; with c chunks per group each chunk takes 1/c of each. Printed per schedule and shape:

- ``fill_share``: c in ``makespan = G T + c (S - 1) T`` (`core.pipeline_time.fill_share`'s definition): 1 for
  1F1B, 1/v interleaved; ``ideal_fill_share`` for ZB-H1 is Qi et al.'s ``(F + B - W) / T``; ``model_fill_share``
  is the share the cost model prices the schedule with (`core.pipeline_time.fill_share`).
- ``peak_inflight``: the most whole micro-batches whose residuals a device group holds at once (a chunk's
  micro-batch counts 1/c; under ZB-H1 / ZB-V a micro-batch is held from its F to its W), against ``cap``, the
  zero-bubble schedules' memory cap: S, 1F1B's peak (its first stage's).

No device runs anything; a shape takes milliseconds to a second.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import tyro  # noqa: E402

from mistjax.core.pipeline_order import group_residual_peaks, issue_order, op_costs, simulated_time  # noqa: E402
from mistjax.core.pipeline_time import fill_share  # noqa: E402
from mistjax.core.schedules import ZERO_BUBBLE  # noqa: E402

SCHEDULES: tuple[tuple[str, str, int], ...] = (  # (row name, schedule, chunks per device group)
    ("1f1b", "1f1b", 1), ("interleaved", "1f1b", 2), ("zb-h1", "zb-h1", 1), ("zb-v", "zb-v", 2))


@dataclass(frozen=True)
class Args:
    """Flags of scripts/bench_schedules.py."""

    json_out: Annotated[str | None, tyro.conf.arg(name="json")] = None  # write the rows here
    shapes: tuple[str, ...] = ("8x32", "4x16", "16x64", "8x8", "8x64")  # device groups x micro-batches
    wgrad_share: float = 0.25  # W / T, the weight-gradient passes' share of a micro-batch's time


def parse_shape(text: str) -> tuple[int, int]:
    """``"8x32"`` -> (8, 32): device groups S and micro-batches G."""
    try:
        s, g = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not SxG (device groups x micro-batches), e.g. 8x32") from None
    if s < 2 or g < 1:
        raise SystemExit(f"--shapes: {text!r} needs at least 2 device groups and 1 micro-batch")
    return s, g


def row(name: str, schedule: str, chunks: int, S: int, G: int, w: float) -> dict[str, Any]:
    """One schedule at one shape: its simulated makespan, fill share and peak residuals (module docstring)."""
    F, T = 1.0 / 3.0, 1.0
    K = S * chunks
    if schedule == "1f1b":  # no split backward: B + W in one pass
        costs = op_costs(schedule, np.full(K, F / chunks), np.full(K, (T - F) / chunks))
    else:
        costs = op_costs(schedule, np.full(K, F / chunks), np.full(K, (T - F) / chunks), np.full(K, w / chunks))
    issue = issue_order(schedule, S, G, chunks)
    makespan = simulated_time(issue, S, costs, schedule)
    peaks = group_residual_peaks(issue, S, schedule=schedule) / chunks
    out: dict[str, Any] = {
        "schedule": name, "chunks": chunks, "stages": S, "grad_accum": G, "wgrad_share": w,
        "makespan": makespan, "fill_share": (makespan - G * T) / ((S - 1) * T),
        "model_fill_share": fill_share(schedule, chunks, w, S, G),
        "peak_inflight": float(peaks.max()), "inflight_per_group": peaks.tolist(),
        "cap": S if schedule in ZERO_BUBBLE else None, "ops": len(issue)}
    if schedule == "zb-h1":
        out["ideal_fill_share"] = (T - 2 * w) / T  # Qi et al.: (S - 1)(F + B - W)
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = tyro.cli(Args, args=argv, description=__doc__)
    if not 0.0 <= args.wgrad_share < 2.0 / 3.0:
        raise SystemExit(f"--wgrad-share must be in [0, 2/3) (W is part of the backward, 2/3 of T), "
                         f"got {args.wgrad_share}")
    rows = [row(name, schedule, chunks, S, G, args.wgrad_share)
            for S, G in map(parse_shape, args.shapes) for name, schedule, chunks in SCHEDULES]
    head = f"{'schedule':<12} {'S':>3} {'G':>4} {'fill_share':>10} {'ideal':>6} {'model':>6} {'peak':>5} {'cap':>4}"
    print(f"equal stages, T = F + B + W = 1, F = T/3, W = {args.wgrad_share:g} T")
    print(head)
    print("-" * len(head))
    for r in rows:
        ideal = f"{r['ideal_fill_share']:.3f}" if "ideal_fill_share" in r else "-"
        print(f"{r['schedule']:<12} {r['stages']:>3} {r['grad_accum']:>4} {r['fill_share']:>10.3f} {ideal:>6} "
              f"{r['model_fill_share']:>6.3f} {r['peak_inflight']:>5.2f} {r['cap'] or '-':>4}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"wgrad_share": args.wgrad_share, "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
