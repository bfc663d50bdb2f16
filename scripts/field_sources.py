"""Step-time accuracy per independent source: a published-runs file and its `bench_published` JSON.

Usage::

    python scripts/bench_published.py tests/data/field-runs.json --json docs/results/field.json
    python scripts/field_sources.py tests/data/field-runs.json docs/results/field.json

Groups the priced runs by their ``source.source_id`` (the independent source each run comes from; a run
without one is grouped under its ``id``) and prints, per source, the number of runs, the median and max
``|ln(predicted / measured)|`` and the geometric-mean ratio predicted / measured, then the same over all
runs. See docs/field_runs.md.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import tyro


@dataclass(frozen=True)
class SourceStats:
    """Step-time accuracy of one group of runs."""

    source: str  # source_id
    n: int  # priced runs with a measured time
    median_abs_log: float  # median |ln(pred / meas)|
    max_abs_log: float  # max |ln(pred / meas)|
    geo_mean_ratio: float  # exp(mean ln(pred / meas))


def _stats(source: str, ratios: Sequence[float]) -> SourceStats:
    logs = [math.log(r) for r in ratios]
    return SourceStats(source, len(logs), statistics.median(abs(x) for x in logs), max(abs(x) for x in logs),
                       math.exp(statistics.fmean(logs)))


def by_source(runs: Mapping[str, Any], bench: Mapping[str, Any]) -> list[SourceStats]:
    """Per-source stats (in the order sources first appear in ``runs``) and an ``all`` row last.

    Args:
        runs: a parsed published-runs file (its ``points`` carry ``source.source_id``).
        bench: the parsed ``--json`` output of scripts/bench_published.py on that file.

    Raises:
        ValueError: the bench JSON names a run the runs file does not have.
    """
    source_of = {}
    for p in runs["points"]:
        src = p.get("source")
        source_of[p["id"]] = src.get("source_id", p["id"]) if isinstance(src, dict) else p["id"]
    groups: dict[str, list[float]] = {s: [] for s in dict.fromkeys(source_of.values())}
    for p in bench["points"]:
        if p["id"] not in source_of:
            raise ValueError(f"bench point {p['id']!r} is not in the runs file; run both commands on the same file")
        if p.get("time_ratio") is not None:
            groups[source_of[p["id"]]].append(p["time_ratio"])
    rows = [_stats(s, r) for s, r in groups.items() if r]
    every = [r for rs in groups.values() for r in rs]
    return rows + ([_stats("all", every)] if every else [])


def table(rows: Sequence[SourceStats]) -> str:
    """A GitHub-markdown table of `by_source` rows."""
    lines = ["| source | runs | median \\|ln(pred/meas)\\| | max \\|ln(pred/meas)\\| | geo-mean pred/meas |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r.source} | {r.n} | {r.median_abs_log:.3f} | {r.max_abs_log:.3f} | {r.geo_mean_ratio:.3f} |"
              for r in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Args:
    """Flags of scripts/field_sources.py."""

    runs: Annotated[str, tyro.conf.Positional]  # a published-runs JSON file
    bench: Annotated[str, tyro.conf.Positional]  # scripts/bench_published.py --json output for that file


def main(argv: list[str] | None = None) -> list[SourceStats]:
    """Print the per-source table; return its rows."""
    args = tyro.cli(Args, args=argv, description=__doc__)
    try:
        with open(args.runs) as fr, open(args.bench) as fb:
            runs, bench = json.load(fr), json.load(fb)
        rows = by_source(runs, bench)
    except (OSError, json.JSONDecodeError, ValueError, KeyError) as e:
        raise SystemExit(f"field_sources: {e}") from None
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
