"""How complete, how fast and how stable the tuner's search is, from 2 GPUs to 3,072.

Cells: Mist's evaluation grid (`reproduce_paper.py`: GPT-3 / Llama / Falcon, 1.3B-22B on 2-32 L4 or A100-40GB,
16 sequences per GPU) and four large shapes: GPT-3 175B on dgx-a100:128x8 (global batch 1536), 530B on
dgx-a100:280x8 (2240), 1T on dgx-a100:384x8 (3072), all at sequence 2048, and a Llama-2-70B-like model on
dgx-h100:8x8 (1024 x 4096). Each cell is searched in mistjax's full space with ``--time-limit`` and again
with ten times the limit; the table gives the wall time, the outer keys searched / pruned by bound / cut by
the limit, the plan, its predicted throughput, Megatron-LM's space's throughput, and whether the longer
search returned the same plan. ``--compete`` searches each cell once more beside a competing CPU-bound process
(one busy loop) and checks that the plan is the same (`SearchResult`'s work counts depend on ``--workers`` only,
never on the machine's load). Writes the rows to ``--json``.

Run: python scripts/bench_tuner.py [--cells grid|large|all] [--time-limit 60] [--workers N] [--compete]
    [--json FILE]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the cost model only

import tyro  # noqa: E402
from reproduce_paper import CELLS, FAMILIES, PLATFORMS, cluster_for, plan_text  # noqa: E402
from tqdm import tqdm  # noqa: E402

import models  # noqa: E402
from mistjax.hardware.presets import ClusterSpec  # noqa: E402
from mistjax.tuning import (  # noqa: E402
    SearchResult,
    SearchSpace,
    baseline_spaces,
    baseline_system,
    default_workers,
    search,
)
from mistjax.tuning.baselines import GRID_PRECISION  # noqa: E402
from mistjax.validate.published import system_workload  # noqa: E402


@dataclass(frozen=True)
class Cell:
    """One search problem: a model shape, a cluster and a global batch."""

    name: str
    config: models.ModelConfig
    cluster: str  # `ClusterSpec.parse` spec
    seq: int
    global_batch: int


def _shape(base: str, name: str, **sizes: int) -> models.ModelConfig:
    return dataclasses.replace(models.get_config(base), name=name, dtype="bfloat16", **sizes)


LARGE = (
    Cell("gpt3-175b", _shape("gpt3-22b", "gpt3-175b", hidden_size=12288, num_layers=96, num_heads=96, num_kv_heads=96,
                             ffn_size=4 * 12288, vocab_size=51200), "dgx-a100:128x8", 2048, 1536),
    Cell("gpt3-530b", _shape("gpt3-22b", "gpt3-530b", hidden_size=20480, num_layers=105, num_heads=128,
                             num_kv_heads=128, ffn_size=4 * 20480, vocab_size=51200), "dgx-a100:280x8", 2048, 2240),
    Cell("gpt3-1t", _shape("gpt3-22b", "gpt3-1t", hidden_size=25600, num_layers=128, num_heads=160, num_kv_heads=160,
                           ffn_size=4 * 25600, vocab_size=51200), "dgx-a100:384x8", 2048, 3072),
    Cell("llama2-70b", _shape("llama-13b", "llama2-70b", hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                              ffn_size=28672, vocab_size=32000), "dgx-h100:8x8", 4096, 1024),
)


def grid_cells() -> list[Cell]:
    cells = []
    for platform, seq in PLATFORMS.items():
        for family in FAMILIES:
            for gpus, size in CELLS:
                c = cluster_for(platform, gpus)
                cells.append(Cell(f"{family}-{size}", models.get_config(f"{family}-{size}").replace(dtype="bfloat16"),
                                  f"{platform}:{c.nodes}x{c.devices_per_node}", seq, 16 * gpus))
    return cells


@dataclass(frozen=True)
class Args:
    """Search completeness, time and stability per cell."""

    cells: Literal["grid", "large", "all"] = "all"  # which cells: Mist's grid (30), the four large ones, or both
    time_limit: float = 60.0  # seconds per search
    repeat_factor: float = 10.0  # the second search's limit, as a multiple of --time-limit (0: no second search)
    only: str = ""  # comma-separated cell names (e.g. gpt3-175b,llama-7b) to run a subset
    workers: int = 0  # processes per search (0: the tuner's default, `mistjax.tuning.default_workers`)
    compete: bool = False  # search each cell again beside one competing CPU-bound process (same plan?)
    json: Path = ROOT / "docs" / "results" / "bench_tuner.json"  # where the rows go


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def competing_process() -> Iterator[None]:
    """One CPU-bound process (a busy loop) running while the block runs."""
    proc = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    proc.start()
    try:
        yield
    finally:
        proc.terminate()
        proc.join()


def _timed(cell: Cell, cluster: ClusterSpec, space: SearchSpace, limit: float, label: str,
           megatron: bool = False, workers: int = 0) -> tuple[SearchResult, float]:
    system = baseline_system("megatron" if megatron else "mistjax")  # priced as the grid prices them
    workload = system_workload(system, cell.config, cell.seq, cell.global_batch, GRID_PRECISION)
    bar = tqdm(desc=f"{cell.name} {cell.cluster} {label}", unit="key", leave=False, file=sys.stderr)

    def progress(_: str, visited: int, total: int) -> None:
        bar.total = total
        bar.n = visited
        bar.refresh()

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the row reports the cut keys
        result = search(workload, cluster, space, time_limit=limit, progress=progress, workers=workers or None)
    bar.close()
    return result, time.perf_counter() - t0


def _plan_key(r: SearchResult) -> str:
    if r.plan is None:
        return ""
    return json.dumps({k: v for k, v in r.plan.to_dict().items() if k not in ("prediction", "fingerprints")},
                      sort_keys=True)


def run_cell(cell: Cell, a: Args) -> dict[str, Any]:
    cluster = ClusterSpec.parse(cell.cluster)
    mine, wall = _timed(cell, cluster, SearchSpace(), a.time_limit, f"{a.time_limit:g} s", workers=a.workers)
    meg, _ = _timed(cell, cluster, baseline_spaces(("megatron",))["megatron"], a.time_limit, "megatron", True,
                    a.workers)
    row: dict[str, Any] = {
        "cell": cell.name, "cluster": cell.cluster, "seq": cell.seq, "global_batch": cell.global_batch,
        "gpus": cluster.nodes * cluster.devices_per_node, "time_limit": a.time_limit, "wall_s": wall,
        "keys": mine.keys, "searched": mine.keys - mine.keys_pruned - mine.keys_cut, "pruned": mine.keys_pruned,
        "cut": mine.keys_cut, "gap": mine.gap, "evaluated": mine.evaluated, "milps": mine.milps,
        "plan": plan_text(mine.plan), "tokens_per_s": mine.prediction.tokens_per_s if mine.plan else 0.0,
        "megatron_tokens_per_s": meg.prediction.tokens_per_s if meg.plan else 0.0,
        "megatron_plan": plan_text(meg.plan), "megatron_complete": meg.complete, "workers": a.workers or
        default_workers(),
    }
    if a.compete:
        with competing_process():
            busy, busy_wall = _timed(cell, cluster, SearchSpace(), a.time_limit, "competing", workers=a.workers)
        # The plan with its search record (work counted, keys pruned): the same, however busy the machine.
        row.update(compete_wall_s=busy_wall, compete_cut=busy.keys_cut, compete_same_plan=_full_plan(busy) ==
                   _full_plan(mine))
    if a.repeat_factor > 0:
        long, long_wall = _timed(cell, cluster, SearchSpace(), a.time_limit * a.repeat_factor,
                                 f"{a.time_limit * a.repeat_factor:g} s")
        row.update(long_wall_s=long_wall, long_cut=long.keys_cut, same_plan=_plan_key(long) == _plan_key(mine),
                   long_tokens_per_s=long.prediction.tokens_per_s if long.plan else 0.0)
    return row


def _full_plan(r: SearchResult) -> str:
    return "" if r.plan is None else json.dumps(
        {k: v for k, v in r.plan.to_dict().items() if k != "fingerprints"}, sort_keys=True)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| cell | cluster | GPUs | search s | keys searched / pruned / cut | gap | plan | tokens/s | "
             "Megatron-LM's space tokens/s | same plan at 10x limit (s) |",
             "|---|---|---:|---:|---|---:|---|---:|---:|---|"]
    for r in rows:
        same = "-" if "same_plan" not in r else f"{'yes' if r['same_plan'] else 'NO'} ({r['long_wall_s']:.1f})"
        meg = f"{r['megatron_tokens_per_s']:,.0f}" if r["megatron_tokens_per_s"] else "no plan"
        lines.append(f"| {r['cell']} | {r['cluster']} | {r['gpus']} | {r['wall_s']:.1f} | {r['searched']} / "
                     f"{r['pruned']} / {r['cut']} | {r['gap']:.1%} | {r['plan']} | {r['tokens_per_s']:,.0f} | {meg} | "
                     f"{same} |")
    return "\n".join(lines)


def main(a: Args) -> list[dict[str, Any]]:
    cells = (grid_cells() if a.cells in ("grid", "all") else []) + (list(LARGE) if a.cells in ("large", "all") else [])
    if a.only:
        wanted = set(a.only.split(","))
        cells = [c for c in cells if c.name in wanted]
    rows = []
    for cell in tqdm(cells, desc="cells", unit="cell", file=sys.stderr):
        rows.append(run_cell(cell, a))
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"time_limit": a.time_limit, "rows": rows}, indent=1))
    print(table(rows))
    complete = sum(not r["cut"] for r in rows)
    same = sum(r.get("same_plan", False) for r in rows)
    longest = max(r["wall_s"] for r in rows)
    print(f"\n{complete} of {len(rows)} cells searched completely; longest search {longest:.1f} s; "
          f"same plan at {a.repeat_factor:g}x the limit: {same} of {len(rows)}")
    if a.compete:
        busy = max(r["compete_wall_s"] for r in rows)
        print(f"beside a competing process: longest search {busy:.1f} s; the same plan (and search record) on "
              f"{sum(r['compete_same_plan'] for r in rows)} of {len(rows)} cells")
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
