"""scripts/gpu_runs.py: tuned plans measured on one GPU (bench_gpu.py) as a published-runs file that the
loader reads, priced with the plans' own remat policies and mistjax's fp32 weight storage."""

import json
from pathlib import Path

import pytest
from conftest import load_script

from mistjax.tuning.baselines import WeightStorage
from mistjax.validate.published import parse_published, to_plan

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "bench_gpu_h200.json"
CONVERTED = ROOT / "tests" / "data" / "h200-runs.json"


@pytest.fixture(scope="module")
def gpu_runs():
    return load_script("gpu_runs")


def test_each_distinct_plan_is_one_run_with_its_policy_and_storage(gpu_runs, tmp_path):
    out = gpu_runs.main([str(RESULTS.relative_to(ROOT)), "--out", str(tmp_path / "h200.json")])
    raw = json.loads(RESULTS.read_text())
    measured = [r for r in raw["runs"] if "error" not in r and r.get("step_time") is not None]
    distinct = {gpu_runs._plan_key(r) for r in measured}
    runs = parse_published(out).points
    assert len(runs) == len(distinct) < len(measured)  # repeats of one plan merge into one run
    plans = [to_plan(r) for r in runs]
    policies = {s.remat_policy for p in plans for s in p.stages if s.remat_layers}
    assert policies == {"dots", "full"}  # the tuned plans' selective remat survives the conversion
    assert all(r.system_record.weights == WeightStorage.FP32 and r.dtype == "bfloat16" for r in runs)
    merged: dict[str, list[float]] = {}
    for r in measured:
        merged.setdefault(gpu_runs._plan_key(r), []).extend(r.get("step_times") or [r["step_time"]])
    for run, times in zip(runs, merged.values()):  # the median over every measurement of the plan
        assert min(times) <= run.measured.iter_time_s <= max(times)


def test_the_stored_file_is_the_converted_results(gpu_runs, tmp_path):
    out = gpu_runs.main([str(RESULTS.relative_to(ROOT)), "--out", str(tmp_path / "h200.json")])
    assert json.loads(CONVERTED.read_text()) == out, "re-run: python scripts/gpu_runs.py " \
        "docs/results/bench_gpu_h200.json --out tests/data/h200-runs.json"
