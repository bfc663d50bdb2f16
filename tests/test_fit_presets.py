"""scripts/fit_presets.py and mistjax.validate.calibration: cross-validation folds and writing a fitted preset."""

import json
import math
from datetime import date
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import load_script

from mistjax.hardware import ClusterSpec
from mistjax.hardware.presets import preset_document
from mistjax.validate import calibration as cal
from mistjax.validate.published import load_published

DATA = Path(__file__).parent / "data" / "published-runs.json"


def _fake_cases(ids):
    return [SimpleNamespace(run=SimpleNamespace(id=i)) for i in ids]


def _fit(values, start, errs_before, errs_after, loo, fold_values=()):
    ids = tuple(f"r{i}" for i in range(len(errs_after)))
    return cal.Fit(values=values, start=start, ids=ids, log_errors=tuple(errs_after), loo_log_errors=loo,
                   start_log_errors=tuple(errs_before), folds="cell", fold_of=tuple(range(len(ids))),
                   fold_values=tuple(fold_values))


def test_cross_validation_leaves_the_held_out_fold_out_of_its_fit(monkeypatch):
    cases = _fake_cases(["a", "b", "c", "d", "e"])
    fold_of = (0, 0, 1, 2, 2)
    fitted_on = []

    def solve(rest, fields, x0, max_nfev):
        fitted_on.append({c.run.id for c in rest})
        return {"memory_efficiency": float(len(fitted_on))}  # the fold's constants name the fold

    def errs(chosen, values):
        return [values["memory_efficiency"] * 0.01 + ord(c.run.id) * 0.0 for c in chosen]

    monkeypatch.setattr(cal, "_solve", solve)
    monkeypatch.setattr(cal, "log_errors", errs)
    out, per_fold = cal.cross_validate(cases, ("memory_efficiency",), fold_of, {"memory_efficiency": 0.5}, 10)
    assert fitted_on == [{"c", "d", "e"}, {"a", "b", "d", "e"}, {"a", "b", "c"}]
    assert out == pytest.approx([0.01, 0.01, 0.02, 0.03, 0.03])  # each run priced by its own fold's fit
    assert [v["memory_efficiency"] for v in per_fold] == [1.0, 2.0, 3.0]


def test_a_fold_too_small_to_refit_is_not_cross_validated(monkeypatch):
    """A fold whose removal leaves no more runs than constants is not refitted, and its runs are not counted as
    out of sample (they were priced in sample before: the H200 fit's 1.3B fold); a fit with such a fold never
    replaces a preset's constants."""
    monkeypatch.setattr(cal, "_solve", lambda *a: pytest.fail("refit with fewer runs than constants"))
    monkeypatch.setattr(cal, "log_errors", lambda chosen, values: [0.0] * len(chosen))
    errs, per_fold = cal.cross_validate(_fake_cases(["a", "b"]), ("memory_efficiency", "kernel_overhead"), (0, 1),
                                        {"memory_efficiency": 0.5, "kernel_overhead": 1e-6}, 10)
    assert per_fold == [] and all(math.isnan(e) for e in errs)
    f = _fit({"memory_efficiency": 0.9}, {"memory_efficiency": 0.8}, [0.3, -0.2, 0.1], [0.05, -0.02, 0.01],
             (0.01, math.nan, 0.02))
    assert f.summary()["leave_one_out"]["n"] == 2 and not f.improves()


def test_refits_start_from_the_presets_constants_not_the_full_fit(monkeypatch):
    starts = []
    monkeypatch.setattr(cal, "_solve",
                        lambda rest, fields, x0, n: starts.append(dict(x0)) or {"memory_efficiency": 0.9})
    monkeypatch.setattr(cal, "log_errors", lambda chosen, values: [0.0] * len(chosen))
    dev = SimpleNamespace(name="d", memory_efficiency=0.5)
    cases = [SimpleNamespace(run=SimpleNamespace(id=i), cluster=SimpleNamespace(device=dev)) for i in "abcd"]
    monkeypatch.setattr(cal, "fold_index", lambda cs, folds: (0, 1, 2, 3))
    cal.fit(cases, ("memory_efficiency",), folds="run")
    assert starts == [{"memory_efficiency": 0.5}] * 5  # the full fit, then four refits, all from the preset


def test_cell_folds_pair_each_megatron_run_with_its_mist_run():
    runs = [r for r in load_published(str(DATA)).points if r.measured.iter_time_s is not None]
    cases = [SimpleNamespace(run=r) for r in runs]
    by_cell = cal.fold_index(cases, "cell")
    assert cal.fold_index(cases, "run") == tuple(range(len(runs)))
    assert len(set(by_cell)) < len(runs)
    for f in set(by_cell):
        members = [r for r, g in zip(runs, by_cell) if g == f]
        assert len({(r.model.preset, r.hardware.per_node, r.flash_attention) for r in members}) == 1
        if any(r.kind == "derived" for r in members):  # a Megatron-LM time derived from its cell's Mist time
            assert any(r.kind == "measured" for r in members)
    assert len(set(cal.fold_index(cases, "model"))) == len({r.model.preset for r in runs})
    with pytest.raises(ValueError, match="unknown folds"):
        cal.fold_index(cases, "bogus")


def test_spread_and_improves():
    f = _fit({"memory_efficiency": 0.9}, {"memory_efficiency": 0.8}, [0.3, -0.2, 0.1], [0.05, -0.02, 0.01],
             (0.1, -0.1, 0.05), [{"memory_efficiency": x} for x in (0.85, 0.9, 0.95)])
    assert f.spread() == {"memory_efficiency": {"min": 0.85, "median": 0.9, "max": 0.95}}
    assert f.summary()["leave_one_out"]["max_abs_log_ratio"] == pytest.approx(0.1)
    assert f.improves()
    worse = _fit({"memory_efficiency": 0.9}, {"memory_efficiency": 0.8}, [0.3, -0.2, 0.1], [0.0, 0.0, 0.0],
                 (0.35, 0.01, 0.01))  # median better, max worse: not adopted
    assert not worse.improves()
    assert not _fit({"x": 1.0}, {"x": 1.0}, [0.1], [0.0], None).improves()


def test_written_preset_round_trips_with_its_provenance():
    before = preset_document("l4")
    f = _fit({"matmul_efficiency": 0.5123456, "memory_efficiency": 0.9}, {"matmul_efficiency": 0.45,
             "memory_efficiency": 0.8}, [0.2, -0.1, 0.3], [0.05, -0.01, 0.02], (0.08, -0.04, 0.06))
    source = cal.fitted_source(f, "tests/data/published-runs.json", "l4 runs with a measured step time")
    doc = cal.update_preset_document(before, f, source)
    text = doc["device"]["source"]
    datasheet = before["device"]["source"].split(" | fitted to ")[0]  # the preset's own earlier fit is replaced
    assert text.startswith(datasheet + " | fitted to tests/data/published-runs.json, 3 runs")
    assert text.count(" | fitted to ") == 1
    assert date.today().isoformat() in text and "by scripts/fit_presets.py" in text
    assert "matmul_efficiency 0.5123 (was 0.45)" in text  # the values replaced stay on record
    cluster = ClusterSpec.from_dict(json.loads(json.dumps(doc)), nodes=1, per_node=4)
    assert cluster.device.matmul_efficiency == pytest.approx(0.5123)
    assert cluster.device.memory_efficiency == pytest.approx(0.9)
    assert cluster.device.peak_flops == before["device"]["peak_flops"]  # datasheet values untouched
    again = cal.update_preset_document(doc, f, source)
    assert again["device"]["source"].count("fitted to") == 1  # a refit replaces the sentence


@pytest.fixture(scope="module")
def script():
    return load_script("fit_presets")


def test_fit_presets_write_on_two_cells(script, tmp_path):
    doc = json.loads(DATA.read_text())
    keep = {"mist-tuned-gpt1.3b-l4x2-flash1", "megatron-best-gpt1.3b-l4x2-flash1",
            "mist-tuned-llama1.3b-l4x2-flash1", "megatron-best-llama1.3b-l4x2-flash1"}
    doc["points"] = [p for p in doc["points"] if p["id"] in keep]
    data = tmp_path / "runs.json"
    data.write_text(json.dumps(doc))
    out = script.main([str(data), "--fields", "memory_efficiency", "--max-evaluations", "3", "--write", "--force",
                       "--catalog", str(tmp_path), "--json", str(tmp_path / "fit.json")])
    assert out["adopted"] and out["summary"]["folds"] == "cell" and out["summary"]["n_folds"] == 2
    assert len(out["fold_values"]) == 2 and out["loo_log_errors"] is not None
    written = json.loads((tmp_path / "l4.json").read_text())
    assert written["device"]["memory_efficiency"] == pytest.approx(out["values"]["memory_efficiency"], rel=1e-3)
    assert f"fitted to {data}, 4 runs" in written["device"]["source"]
    ClusterSpec.from_dict(written, nodes=1, per_node=2)
    assert json.loads((tmp_path / "fit.json").read_text())["ids"] == out["ids"]


def test_source_folds_hold_out_each_independent_source():
    """Leave-one-source-out: a run's fold is the ``source_id`` its file names, else the repository or paper its
    source cites, else the run itself."""
    def run(i, source):
        return SimpleNamespace(run=SimpleNamespace(id=i, source=source))

    cases = [run("a", {"source_id": "foundry", "repo": "x/y"}), run("b", {"repo": "x/y"}), run("c", {"paper": "P"}),
             run("d", {"source_id": "foundry"}), run("e", None), run("f", {"repo": "x/y"})]
    assert cal.fold_index(cases, "source") == (0, 1, 2, 0, 3, 1)
    field = load_published(str(DATA.parent / "field-runs.json")).points
    assert len({cal.source_key(r) for r in field}) >= 6
