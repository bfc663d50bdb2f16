"""The mistjax command line: plan, explain, calibrate, and its errors."""

from __future__ import annotations

import json
import re

from mistjax.cli import main

TINY = ["--model", "gpt3-tiny", "--cluster", "cpu:1x8", "--global-batch", "16", "--seq-len", "32",
        "--dtype", "float32"]


def test_plan_explain_round_trip(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", *TINY, "--time-limit", "20", "--json", str(plan), "--plot", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "predicted:" in out and "megatron" in out
    assert json.loads(plan.read_text())["schema_version"] == 1
    assert (tmp_path / "plots" / "memory.png").stat().st_size > 5000
    assert main(["explain", str(plan), *TINY]) == 0
    assert "step" in capsys.readouterr().out


def test_unknown_preset_is_a_clear_error(capsys):
    assert main(["plan", "--model", "gpt3-tiny", "--cluster", "a200:1x8"]) == 2
    err = capsys.readouterr().err
    assert "a200" in err and "a100-40gb" in err


def test_malformed_calibration_file(tmp_path, capsys):
    bad = tmp_path / "profile.json"
    bad.write_text('{"name": "x", "device": {}}')
    assert main(["plan", "--model", "gpt3-tiny", "--cluster", str(bad)]) == 2
    assert "bad cluster" in capsys.readouterr().err


def test_corrupt_plan_file(tmp_path, capsys):
    bad = tmp_path / "plan.json"
    bad.write_text('{"stages": [')
    assert main(["explain", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_no_feasible_plan_says_what_would_fit(capsys):
    assert main(["plan", *TINY, "--memory-gib", "0.0001", "--time-limit", "10", "--no-baselines"]) == 2
    err = capsys.readouterr().err
    assert "no plan fits" in err and "the smallest plan needs" in err and "devices with at least" in err


def test_param_dtype_prices_16bit_weights_with_a_master_copy(tmp_path, capsys):
    """--param-dtype bfloat16 halves the stored weights and adds an fp32 master copy to the optimizer state."""
    plan = tmp_path / "plan.json"
    assert main(["plan", *TINY, "--time-limit", "10", "--no-baselines", "--json", str(plan)]) == 0
    capsys.readouterr()
    mib = {}
    for dtype in ("float32", "bfloat16"):
        assert main(["explain", str(plan), *TINY, "--param-dtype", dtype]) == 0
        line = re.search(r"params ([\d.]+), optimizer ([\d.]+)", capsys.readouterr().out)
        mib[dtype] = (float(line[1]), float(line[2]))
    assert mib["bfloat16"][0] < 0.6 * mib["float32"][0]  # 2 bytes per weight, not 4
    assert mib["bfloat16"][1] > mib["float32"][1]  # + the fp32 master copy
