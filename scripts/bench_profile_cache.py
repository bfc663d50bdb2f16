"""First-call cost of the symbolic analysis with and without the on-disk profile cache.

For each model, builds its cost-model workload three times in fresh in-memory state: with the cache
off (the analysis runs), into an empty cache (the analysis runs and the profile is written), and from
the warm cache (a hit: tracing once and reading the file). Prints a table and writes JSON.

  .venv/bin/python scripts/bench_profile_cache.py --json profile_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models  # noqa: E402
import models.cost  # noqa: E402


def _timed(name: str, cache: str) -> float:
    os.environ["MISTJAX_CACHE_DIR"] = cache
    models.cost._PROFILES.clear()  # the zoo's in-memory cache: measure the disk cache alone
    t = time.perf_counter()
    models.workload(models.get_config(name), 32, 16)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt3-tiny,llama-tiny,falcon-tiny", help="comma-separated zoo presets")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in args.models.split(","):
            off = _timed(name, "off")
            cold = _timed(name, d)
            warm = _timed(name, d)
            rows.append({"model": name, "no_cache_s": off, "cold_s": cold, "hit_s": warm, "speedup": off / warm})
    print(f"{'model':<14} {'no cache':>9} {'cold':>7} {'hit':>7} {'speedup':>8}")
    for r in rows:
        print(f"{r['model']:<14} {r['no_cache_s']:>8.2f}s {r['cold_s']:>6.2f}s {r['hit_s']:>6.2f}s "
              f"{r['speedup']:>7.1f}x")
    doc = {"rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
