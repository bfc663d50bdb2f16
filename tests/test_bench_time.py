"""scripts/bench_time.py: the summary statistics, and the JSON of a quick run (slow)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import load_script


def _script():
    return load_script("bench_time")


def test_spearman_known_values():
    bt = _script()
    assert bt.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bt.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # monotone but not linear: rank correlation is still 1
    assert bt.spearman([1, 2, 3, 4, 5], [1, 8, 27, 64, 1000]) == pytest.approx(1.0)
    # 1 - 6 sum d^2 / (n (n^2 - 1)) with d = (0, 0, 1, -1, 0): 1 - 12 / 120
    assert bt.spearman([1, 2, 3, 4, 5], [1, 2, 4, 3, 5]) == pytest.approx(0.9)
    # ties take their mean rank (scipy.stats.spearmanr gives 0.9486832980505138 here)
    assert bt.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)
    assert math.isnan(bt.spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError):
        bt.spearman([1, 2], [1])


def test_summary_and_noise():
    bt = _script()
    s = bt.summarize([1.0, 2.0, 4.0], [1.1, 1.6, 4.0])
    assert s["n"] == 3 and s["spearman"] == pytest.approx(1.0)
    assert s["median_abs_rel_err"] == pytest.approx(0.1)  # |ratios - 1| = 0.1, 0.2, 0
    n = bt.noise([1.0, 1.0, 2.0, 1.0, 3.0])
    assert n["median"] == 1.0 and n["spread_rel"] == pytest.approx(2.0) and n["iqr_rel"] == pytest.approx(1.0)


def test_plans_cover_the_brief():
    bt = _script()
    kn = [c.knobs for c in bt.PLANS]
    assert len(bt.PLANS) >= 12
    assert any(k.get("stages", 1) == 2 for k in kn) and any(k.get("tp", 1) > 1 for k in kn)
    assert any(k.get("shard_group") for k in kn) and any(k.get("grad_accum", 1) > 1 for k in kn)
    assert {k.get("remat_policy", "full") for k in kn if k.get("remat_layers")} >= {"full", "dots"}
    assert any(k.get("shard_weights") for k in kn) and any(k.get("shard_opt") and not k.get("shard_grads")
                                                          for k in kn)


@pytest.mark.slow
def test_quick_run_json_schema(tmp_path):
    out = tmp_path / "bench_time.json"
    _script().main(["--quick", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == {"n", "spearman", "median_abs_rel_err"} and doc["summary"]["n"] == 2
    for p in doc["points"]:
        assert {"plan", "measured_s", "noise_iqr", "noise_spread", "predicted_s", "ratio"} <= set(p)
        assert p["measured_s"] > 0 and p["predicted_s"] > 0
        assert p["ratio"] == pytest.approx(p["predicted_s"] / p["measured_s"])
