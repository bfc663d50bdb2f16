"""Fit the GPU presets' memory margin to XLA:GPU compiles of tuned plans.

Usage::

    python scripts/fit_memory_margin.py docs/results/gpu_aot_tuned.json [--write] [--quantile 1.0] [--reprice]

Input: the JSON of ``scripts/bench_gpu_aot_tuned.py`` (every tuned plan's predicted and XLA:GPU peak per
device group, with the predicted state / rest split). For each group, the margin on the predicted non-state
memory (gradients, activations, buffers: state, i.e. parameters and optimizer state, is what XLA counts
as arguments and is priced exactly) that keeps the worst plan the tuner may admit within the card
(`needed_margins`).
The fitted margin is the ``quantile`` of those over every group of every plan compiled (default 1.0:
the largest, so that every plan of the grid would have fitted), never below 0. One figure for all GPU
presets: the misses come from XLA's buffer assignment, the same compiler on each of them. ``--write``
stores it in the GPU presets' catalog JSONs (``device.memory_margin`` and ``memory_margin_source``).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parents[1]
CATALOG = ROOT / "mistjax" / "hardware" / "catalog"
GPU_PRESETS = ("l4", "a100-40gb", "a100-80gb", "h100", "h200", "dgx-a100", "dgx-h100")


@dataclass
class Args:
    """Fit the memory margin; optionally write it into the GPU presets."""

    results: tyro.conf.Positional[str]  # bench_gpu_aot_tuned.py's JSON
    quantile: float = 1.0  # of the per-group margins needed (1.0: the largest)
    write: bool = False  # store the margin in the GPU presets' catalog JSONs
    reprice: bool = False  # price the compiled plans again with this checkout's cost model (XLA's peaks stay)
    catalog: Annotated[str, tyro.conf.arg(help="folder of the preset JSONs")] = str(CATALOG)


def needed_margins(results: dict) -> list[tuple[str, int, float]]:
    """(cell, group, margin that group needed) for every device group of every compiled plan.

    A plan is admitted when ``state + (1 + m) rest <= budget``; the worst admitted plan has ``state + rest
    = budget - m rest``, and XLA needs the model's error ``e = xla - predicted`` on top. It fits the card
    when ``budget - m rest + e <= capacity``: ``m >= (e - (capacity - budget)) / rest``. The budget's own
    headroom (`DeviceSpec.usable_memory_fraction`, for the allocator and libraries XLA's analysis leaves
    out) absorbs part of the error; the margin takes the rest.
    """
    out = []
    for cell in results["cells"]:
        headroom = cell["capacity"] - cell["planning_budget"]
        for r in cell["rounds"]:
            for g, (p, x, comp) in enumerate(zip(r["predicted"], r["xla"], r["components"])):
                out.append((cell["id"], g, (x - p - headroom) / max(comp["rest"], 1.0)))
    return out


def reprice(results: dict) -> dict:
    """The results with every compiled plan's prediction redone by the current cost model (the plans and
    XLA's peaks are what they were): refit after a change of the memory model without compiling again."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_gpu_aot_tuned as bench

    import models
    from mistjax.core.plan import Plan
    from mistjax.cost.predict import analyze
    from mistjax.hardware.presets import ClusterSpec

    cells = {c.id: c for c in bench.CELLS}
    for cell in results["cells"]:
        spec = cells[cell["id"]]
        workload = models.workload(bench.config_of(spec), spec.seq, spec.global_batch)
        for r in cell["rounds"]:
            cluster = ClusterSpec.parse(spec.cluster).with_budget(r["budget"])
            a = analyze(workload, Plan.from_dict(r["plan"]), cluster)
            r["predicted"] = [float(sum(m.values())) for m in a.stage_memory]
            r["components"] = bench.split(a)
    return results


def write_margin(folder: Path, margin: float, source: str) -> list[str]:
    """Set ``device.memory_margin`` / ``memory_margin_source`` in each GPU preset, editing the text in
    place (after ``usable_memory_fraction``) so that the rest of the hand-written document is unchanged."""
    written = []
    fields = f'"memory_margin": {round(margin, 4)},\n  "memory_margin_source": {json.dumps(source)},\n  '
    for name in GPU_PRESETS:
        path = folder / f"{name}.json"
        text = re.sub(r'"memory_margin": [^\n]*\n\s*"memory_margin_source": [^\n]*\n\s*', "", path.read_text())
        text, n = re.subn(r'("usable_memory_fraction": [^,\n]+,\n\s*)', lambda m: m.group(1) + fields, text, count=1)
        if n != 1:
            raise SystemExit(f"fit_memory_margin: {path} has no device.usable_memory_fraction to write after")
        json.loads(text)  # still a valid document
        path.write_text(text)
        written.append(str(path))
    return written


def main(argv: list[str] | None = None) -> float:
    args = tyro.cli(Args, args=argv, description=__doc__)
    results = json.loads(Path(args.results).read_text())
    if args.reprice:
        results = reprice(results)
    rows = needed_margins(results)
    if not rows:
        sys.exit(f"fit_memory_margin: {args.results} holds no compiled plan")
    values = np.array([m for *_, m in rows])
    margin = max(0.0, float(np.quantile(values, args.quantile)))
    print(f"{len(rows)} device groups of {sum(len(c['rounds']) for c in results['cells'])} compiled plans "
          f"({len(results['cells'])} cells); margin each group needed: median {statistics.median(values):+.3f}, "
          f"max {values.max():+.3f}")
    for cell, g, m in sorted(rows, key=lambda r: -r[2])[:8]:
        print(f"  {cell:26s} group {g}: {m:+.3f}")
    print(f"fitted memory margin (quantile {args.quantile:g}): {margin:.4f} of non-state memory")
    if args.write:
        date = datetime.date.today().isoformat()
        source = (f"fitted by scripts/fit_memory_margin.py (quantile {args.quantile:g}) to {len(rows)} device groups "
                  f"of XLA:GPU deviceless compiles of tuned plans ({os.path.basename(args.results)}, "
                  "scripts/bench_gpu_aot_tuned.py" + (", re-priced by the cost model that reads this"
                                                      if args.reprice else "") + f"), {date}")
        for path in write_margin(Path(args.catalog), margin, source):
            print(f"wrote {path}")
    return margin


if __name__ == "__main__":
    main()
