"""The README's benchmark figures and docs/benchmarks.md's generated tables against docs/results/*.json (#53).

Each README sentence that quotes a benchmark is matched by a pattern; every number it prints must equal the
results file's value at the printed rounding (a figure printed "4%" is within 0.5 points, "1.14x" within
0.005). A benchmark re-run that moves a figure fails here until the README quotes the new value; a reworded
sentence fails with the pattern to update.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def _results(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def _docs_tables() -> ModuleType:
    return load_script("docs_tables")


@pytest.fixture(scope="module")
def readme() -> str:
    """README.md with its line breaks and runs of spaces collapsed, so that patterns span wrapped lines."""
    return " ".join((ROOT / "README.md").read_text().split())


def _match(readme: str, pattern: str) -> re.Match[str]:
    """The one match of ``pattern`` in the README; ``{N}`` in it stands for a decimal number."""
    found = list(re.finditer(pattern.replace("{N}", r"\d+(?:\.\d+)?"), readme))
    assert len(found) == 1, (f"README.md: expected one sentence matching {pattern!r}, found {len(found)}; if the "
                             "sentence was reworded, update the pattern in tests/test_readme_numbers.py")
    return found[0]


def _printed(text: str, value: float, what: str) -> None:
    """``text`` (a number as the README prints it) equals ``value`` at the printed number of decimals."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    assert abs(float(text.replace(",", "")) - value) <= 0.5 * 10**-decimals + 1e-9, (
        f"README.md prints {what} as {text}, the results file gives {value:.4g}: quote the current value")


def test_search_times_quoted_are_bench_tuners(readme: str) -> None:
    rows = _results("bench_tuner.json")["rows"]
    s = _docs_tables().tuner_summary(rows)
    m = _match(readme, r"a complete search of the benchmark cells, (\d+) to ([\d,]+) GPUs, takes ({N})-({N}) s "
                       r"on 2 cores; (\d+) of the (\d+) cells need more than the default 60 s")
    # A complete search's time: the search at the limit where it completed, else the one at ten times the limit.
    assert all(r["long_cut"] == 0 for r in rows if r["cut"]), "a cell was cut even at ten times the limit"
    complete = [r["wall_s"] if r["cut"] == 0 else r["long_wall_s"] for r in rows]
    _printed(m[1], s["min_gpus"], "the fewest GPUs")
    _printed(m[2], s["max_gpus"], "the most GPUs")
    _printed(m[3], min(complete), "the shortest complete search")
    _printed(m[4], max(complete), "the longest complete search")
    _printed(m[5], s["cells"] - s["complete"], "the cells cut by the default limit")
    _printed(m[6], s["cells"], "the cells")


def test_published_run_figures_are_published_jsons(readme: str) -> None:
    d = _results("published.json")
    t, mem = d["summary"]["time"], d["summary"]["memory"]
    m = _match(readme, r"on the (\d+) published L4 runs of Mist's artifact .*? the predicted step time is within a "
                       r"median ({N})% of the measured one \(max ({N})x;")
    _printed(m[1], t["n"], "the number of published runs")
    _printed(m[2], 100 * math.expm1(t["median_abs_log_ratio"]), "the median step-time error (%)")
    _printed(m[3], math.exp(t["max_abs_log_ratio"]), "the largest step-time ratio")
    ratios = [q["ratio"] for p in d["points"] for q in p.get("speedup_pairs") or []]
    m = _match(readme, r"every Mist-over-Megatron-LM speedup of the (\d+) measured pairs within 10%")
    _printed(m[1], len(ratios), "the number of measured speedup pairs")
    assert all(abs(r - 1) <= 0.10 for r in ratios), [r for r in ratios if abs(r - 1) > 0.10]
    m = _match(readme, r"the predicted peak memory within a median ({N})% \(max ({N})x\)")
    _printed(m[1], 100 * math.expm1(mem["median_abs_log_ratio"]), "the median peak-memory error (%)")
    _printed(m[2], math.exp(mem["max_abs_log_ratio"]), "the largest peak-memory ratio")


def test_xla_gpu_figures_are_gpu_aot_tuneds(readme: str) -> None:
    d = _results("gpu_aot_tuned.json")
    s = d["summary"]
    errs = [e for c in d["cells"] for r in c["rounds"] for e in r["err"]]  # every group of every compiled plan
    m = _match(readme, r"for (\d+) tuned plans of the Mist grid")
    _printed(m[1], s["cells"], "the number of tuned cells compiled")
    assert s["final_fits_card"] == s["final_within_budget"] == s["cells"], s  # "fits its card ... its budget"
    m = _match(readme, r"the predicted peak per device group is within a median ({N})% \(largest group "
                       r"({N})%\), with misses of up to (-{N})% and \+({N})%")
    _printed(m[1], 100 * s["group_err_median"], "the per-group median error (%)")
    _printed(m[2], 100 * s["peak_err_median"], "the largest group's median error (%)")
    _printed(m[3], 100 * min(errs), "the largest under-prediction (%)")
    _printed(m[4], 100 * max(errs), "the largest over-prediction (%)")


def test_grid_speedups_are_reproduce_jsons(readme: str) -> None:
    s = _results("reproduce.json")["summary"]
    measured = s["l4"]["measured"]
    m = _match(readme, r"on those (\d+) L4 cells the predicted average speedup over Megatron-LM is ({N})x against "
                       r"Mist's measured ({N})x; over the whole grid it is ({N})x on L4 and ({N})x on "
                       r"A100-40GB")
    _printed(m[1], measured["cells"], "the number of measured grid cells")
    _printed(m[2], measured["avg_predicted_speedup"], "the predicted average speedup on the measured cells")
    _printed(m[3], measured["avg_measured_speedup"], "Mist's measured average speedup")
    _printed(m[4], s["l4"]["avg_speedup_vs_megatron"], "the L4 grid's average speedup")
    _printed(m[5], s["a100-40gb"]["avg_speedup_vs_megatron"], "the A100-40GB grid's average speedup")


def test_step_time_figures_are_bench_times(readme: str) -> None:
    d = _results("bench_time.json")
    s = d["summary"]
    ratios = [p["ratio"] for p in d["points"]]
    m = _match(readme, r"\(`scripts/bench_time.py`, (\d+) plans on a profile `mistjax calibrate` measures\) are "
                       r"predicted within a median ({N})% \(({N})-({N})x\) and rank with Spearman ({N})")
    _printed(m[1], s["n"], "the number of timed plans")
    _printed(m[2], 100 * s["median_abs_rel_err"], "the median step-time error (%)")
    _printed(m[3], min(ratios), "the smallest predicted / measured ratio")
    _printed(m[4], max(ratios), "the largest predicted / measured ratio")
    _printed(m[5], s["spearman"], "the rank correlation")
    assert statistics.median(abs(r - 1) for r in ratios) == pytest.approx(s["median_abs_rel_err"])


def test_out_of_sample_figures_are_field_and_fit_jsons(readme: str) -> None:
    t = _results("field.json")["summary"]["time"]
    m = _match(readme, r"on (\d+) runs from six public sources never used for fitting .*? step time is within a "
                       r"median \|ln\(pred/meas\)\| of ({N}) \(max ({N}):")
    _printed(m[1], t["n"], "the number of field runs")
    _printed(m[2], t["median_abs_log_ratio"], "the field runs' median |ln|")
    _printed(m[3], t["max_abs_log_ratio"], "the field runs' max |ln|")
    fit = _results("fit-h200.json")["summary"]
    m = _match(readme, r"preset by script \(leave-one-model-out ({N}) from ({N})\)")
    _printed(m[1], fit["leave_one_out"]["median_abs_log_ratio"], "the H200 fit's out-of-sample median")
    _printed(m[2], fit["before"]["median_abs_log_ratio"], "the H200 preset's median before the fit")
    pts = _results("mics.json")["published"]["points"]
    m = _match(readme, r"MiCS's published runs are predicted ({N})-({N})x fast")
    _printed(m[1], 1 / max(p["ratio"] for p in pts), "the smallest MiCS under-prediction factor")
    _printed(m[2], 1 / min(p["ratio"] for p in pts), "the largest MiCS under-prediction factor")


def test_benchmarks_md_tables_are_generated_from_the_results() -> None:
    module = _docs_tables()
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    blocks = re.findall(r"<!-- docs_tables:([\w-]+):begin -->\n", text)
    assert sorted(blocks) == sorted(module.TABLES), "every docs_tables block once, and every table has a block"
    _, stale = module.render(text)
    assert not stale, f"docs/benchmarks.md: stale tables {stale}; run python scripts/docs_tables.py"
