"""tests/data/field-runs.json: measured runs from independent public sources (#50 item 3), and the per-source
accuracy script. Accuracy itself is reported in docs/field_runs.md, not asserted here."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
from conftest import load_script

from mistjax.validate.published_format import load_published

ROOT = Path(__file__).resolve().parents[1]
FIELD = ROOT / "tests" / "data" / "field-runs.json"


@pytest.fixture(scope="module")
def runs():
    return load_published(FIELD)


def test_field_file_has_enough_runs_from_enough_sources(runs):
    sources = Counter(r.source["source_id"] for r in runs.points)
    assert len(runs.points) >= 60
    assert len(sources) >= 6, sources
    assert all(r.ran for r in runs.points)  # every run has a measured step time


def test_every_field_run_names_its_source_and_assumptions(runs):
    for r in runs.points:
        src = r.source
        assert isinstance(src, dict), r.id
        assert src.get("url") or src.get("paper"), f"{r.id}: no URL or paper"
        assert src.get("repo") is None or len(src.get("commit", "")) == 40, f"{r.id}: repo without a full commit"
        assert isinstance(src.get("assumed"), list) and src["assumed"], f"{r.id}: no 'assumed' list"
        if r.kind == "derived":  # the arithmetic from the published throughput is written out
            assert "t = " in r.measured.timing_scope, r.id


def test_field_runs_are_on_datacenter_gpus_and_no_held_out_source(runs):
    assert {r.hardware.preset for r in runs.points} <= {"dgx-a100", "dgx-h100", "aws-p4d", "a100-80gb", "h100",
                                                         "h200", "l4"}
    for r in runs.points:  # the held-out tables (issue #50) are not a source of any run
        text = json.dumps(r.source).lower()
        for held_out in ("performance_summary", "performance-summary", "performance summary", "mlcommons",
                         "mlperf", "model zoo", "2104.04473"):
            assert held_out not in text, (r.id, held_out)


def test_field_sources_groups_and_summarizes_by_hand():
    fs = load_script("field_sources")
    runs = {"points": [{"id": "a", "source": {"source_id": "s1"}}, {"id": "b", "source": {"source_id": "s1"}},
                       {"id": "c", "source": {"source_id": "s2"}}, {"id": "d"}]}
    bench = {"points": [{"id": "a", "time_ratio": 2.0}, {"id": "b", "time_ratio": 0.5},
                        {"id": "c", "time_ratio": 1.0}, {"id": "d", "time_ratio": None}]}
    rows = {r.source: r for r in fs.by_source(runs, bench)}
    assert set(rows) == {"s1", "s2", "all"}  # d has no time: no row
    assert rows["s1"].n == 2 and rows["s1"].median_abs_log == pytest.approx(math.log(2))
    assert rows["s1"].geo_mean_ratio == pytest.approx(1.0)
    assert rows["all"].n == 3 and rows["all"].max_abs_log == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="not in the runs file"):
        fs.by_source(runs, {"points": [{"id": "zz", "time_ratio": 1.0}]})


def test_field_results_file_matches_the_runs_file():
    """docs/results/field.json (quoted in docs/field_runs.md) was produced from the current runs file."""
    bench = json.loads((ROOT / "docs" / "results" / "field.json").read_text())
    ids = [p["id"] for p in json.loads(FIELD.read_text())["points"]]
    assert [p["id"] for p in bench["points"]] == ids
    assert bench["summary"]["time"]["n"] == len(ids)
