"""Cost model vs XLA's compiled programs on 8 simulated CPU devices (issue #5).

Usage::

    python scripts/bench_costmodel.py [--json FILE] [--speed] [--small]

Prints one row per (model, plan) cell: predicted vs compiled per-device memory, FLOPs and
collective bytes with relative errors, then the summary. ``--speed`` also times `stage_cost` on
100,000 random strategies of one block (``speed.strategies_per_s``). See docs/cost_model.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Annotated

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import tyro  # noqa: E402


def speed(n: int = 100_000) -> float:
    """Strategies priced per second by `stage_cost` (llama-tiny block, a100-40gb 2x8, random strategies)."""
    from mistjax.cost import StageStrategies, stage_cost
    from mistjax.hardware import ClusterSpec
    from mistjax.validate.check import workload_for

    wl = workload_for("llama-tiny", 1024, 512)
    r = np.random.default_rng(0)
    st = StageStrategies.make(
        b=r.integers(1, 9, n), dp=r.choice([1, 2, 4, 8], n), tp=r.choice([1, 2, 4], n), zero=r.integers(0, 4, n),
        layers=r.integers(1, 5, n), remat=r.integers(0, 3, n), policy=r.integers(0, len(wl.policies), n),
        wo=r.choice([0, 0.5, 1], n), oo=r.choice([0, 0.5, 1], n), ao=r.choice([0, 0.5], n), go=r.choice([0, 1.0], n),
        G=r.choice([1, 2, 4], n), inflight=r.integers(1, 4, n), first=r.integers(0, 2, n).astype(bool),
        last=r.integers(0, 2, n).astype(bool), nodes=1, per_node=8)
    cl = ClusterSpec.preset("a100-40gb", 2, 8)
    stage_cost(wl, cl, st)  # warm the per-layout caches
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        stage_cost(wl, cl, st)
        best = min(best, time.perf_counter() - t)
    return n / best


@dataclass(frozen=True)
class Args:
    """Flags of scripts/bench_costmodel.py."""

    json_out: Annotated[str | None, tyro.conf.arg(name="json")] = None  # write cells and summary to this file
    speed: bool = False  # also time 100,000 strategies
    small: bool = False  # the test grid only (6 cells)


def main(argv: list[str] | None = None) -> None:
    """Compare every grid cell; print the rows and summary; optionally write them."""
    args = tyro.cli(Args, args=argv, description=__doc__)

    from mistjax.hardware import ClusterSpec
    from mistjax.validate.check import FULL_GRID, SMALL_GRID, compare_cell, grid_plan

    cluster = ClusterSpec.preset("cpu", 1, 8)
    cells = []
    print(f"{'model':13s} {'seq':>3s} {'plan':38s} {'mem pred':>11s} {'mem xla':>11s} {'err':>7s} "
          f"{'flops err':>9s} {'coll err':>8s}")
    skipped = []
    for name, seq, gb, kw in (SMALL_GRID if args.small else FULL_GRID):
        plan = grid_plan(name, kw)
        if plan.num_stages > 1:  # the MPMD executor runs one program per (stage, phase): no one program to compare
            skipped.append(f"{name} s{seq} {kw}")
            continue
        rec = compare_cell(name, seq, gb, plan, cluster)
        cells.append(rec)
        ce = "-" if rec["coll_err"] is None else f"{rec['coll_err']:+.4f}"
        print(f"{name:13s} {seq:3d} {rec['plan']:38s} {rec['mem_pred']:11.0f} {rec['mem_xla']:11.0f} "
              f"{rec['mem_err']:+7.3f} {rec['flops_err']:+9.4f} {ce:>8s}", flush=True)
    mem = [abs(c["mem_err"]) for c in cells]
    coll = [abs(c["coll_err"]) for c in cells if c["coll_err"] is not None]
    summary = {"mem_err_median": statistics.median(mem), "mem_err_max": max(mem),
               "flops_err_max": max(abs(c["flops_err"]) for c in cells), "coll_err_max": max(coll, default=0.0),
               "n_cells": len(cells), "n_skipped_pipelined": len(skipped)}
    for cell in skipped:
        print(f"skipped (pipelined, one program per stage and phase): {cell}")
    out: dict = {"cells": cells, "summary": summary}
    if args.speed:
        out["speed"] = {"strategies_per_s": speed()}
    print(json.dumps({k: v for k, v in out.items() if k != "cells"}, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
