"""Where one benchmark cell's search spends its time: cProfile of mistjax's space on one `bench_tuner` cell.

Prints the wall time, the strategies priced and MILPs solved, the plan, and the functions with the most
cumulative time (docs/tuning.md's profile section quotes it). ``--plans FILE`` writes each cell's plan JSON (the
search's fingerprint of its answer) so that two versions of the tuner can be compared plan for plan.

Run: python scripts/profile_tuner.py --cells l4:gpt3-22b,dgx-h100:llama2-70b [--profile] [--top 25] [--workers N]
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tyro  # noqa: E402
from bench_tuner import LARGE, Cell, _plan_key, grid_cells  # noqa: E402

from mistjax.hardware.presets import ClusterSpec  # noqa: E402
from mistjax.tuning import SearchSpace, baseline_system, search  # noqa: E402
from mistjax.tuning.baselines import GRID_PRECISION  # noqa: E402
from mistjax.validate.published import system_workload  # noqa: E402


@dataclass(frozen=True)
class Args:
    """Time (and optionally profile) single cells of `scripts/bench_tuner.py`."""

    cells: str = "l4:gpt3-22b"  # comma-separated PLATFORM:NAME (e.g. l4:gpt3-22b, dgx-a100:gpt3-1t)
    profile: bool = False  # run under cProfile and print the top functions
    top: int = 25  # functions printed
    plans: Path | None = None  # write {cell: plan JSON} here
    time_limit: float = 600.0
    workers: int = 0  # processes per search (0: the tuner's default)


def find(spec: str) -> Cell:
    platform, name = spec.split(":")
    for c in grid_cells() + list(LARGE):
        if c.name == name and c.cluster.split(":")[0] == platform:
            return c
    raise SystemExit(f"no cell {spec!r}: use PLATFORM:NAME, e.g. l4:gpt3-22b or dgx-h100:llama2-70b")


def main(a: Args) -> None:
    plans = {}
    for spec in a.cells.split(","):
        cell = find(spec)
        cluster = ClusterSpec.parse(cell.cluster)
        workload = system_workload(baseline_system("mistjax"), cell.config, cell.seq, cell.global_batch,
                                   GRID_PRECISION)
        prof = cProfile.Profile() if a.profile else None
        kw = {"workers": a.workers} if a.workers else {}
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if prof is not None:
                prof.enable()
            r = search(workload, cluster, SearchSpace(), time_limit=a.time_limit, **kw)
            if prof is not None:
                prof.disable()
        wall = time.perf_counter() - t0
        print(f"{spec}: {wall:.1f} s, {r.evaluated:,} strategies, {r.milps} MILPs, complete {r.complete}, "
              f"step {r.step_time:.6g} s")
        plans[spec] = _plan_key(r)
        if prof is not None:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(a.top)
            print(out.getvalue())
    if a.plans is not None:
        a.plans.write_text(json.dumps(plans, indent=1, sort_keys=True))


if __name__ == "__main__":
    main(tyro.cli(Args))
