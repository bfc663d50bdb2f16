"""The mistjax command line: plan, explain, calibrate, and its errors."""

from __future__ import annotations

import json
import re

import pytest

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


def test_flags_keep_their_spellings(capsys):
    """tyro builds the flags from the subcommands' dataclasses, with the argparse CLI's names."""
    from mistjax.cli import ExplainArgs, PlanArgs, parse_args

    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--cluster", "--global-batch", "--seq-len", "--dtype", "--param-dtype", "--memory-gib",
                 "--plot", "--verify", "--no-verify", "--time-limit", "--no-baselines", "--progress", "--json"):
        assert flag in out, flag
    plan = parse_args(["plan", *TINY, "--time-limit", "5", "--no-baselines", "--progress", "off", "--json", "p.json"])
    assert plan == PlanArgs(model="gpt3-tiny", cluster="cpu:1x8", global_batch=16, seq_len=32, dtype="float32",
                            time_limit=5.0, no_baselines=True, progress="off", json="p.json")
    assert plan.verify is None  # plan's default: verify where the compiler is installed
    assert parse_args(["explain", "p.json", "--verify"]) == ExplainArgs(plan="p.json", verify=True)
    assert parse_args(["explain", "--no-verify", "p.json"]) == ExplainArgs(plan="p.json", verify=False)
    assert parse_args(["explain", "p.json"]).global_batch is None  # the plan's


def test_bad_flags_exit_2_without_a_traceback(capsys):
    for argv, needle in ((["plan", "--model", "gpt3-tiny", "--time-limit", "0"], "argument --time-limit: 0 must be "
                          "positive (seconds for the search"),
                         (["plan", "--model", "gpt3-tiny", "--progress", "sometimes"], "--progress"),
                         (["plan", "--model", "gpt3-tiny", "--seq-len", "many"], "--seq-len"),
                         (["plan", "--modle", "gpt3-tiny"], "--model"),
                         (["explain", "p.json", "--memory-gib", "None"], "--memory-gib")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (argv, err)


def test_bad_plan_file_names_the_field(tmp_path, capsys):
    from mistjax.plan import uniform_plan

    doc = uniform_plan(2, 8, micro_batch=2, shard_opt=True).to_dict()
    doc["stages"][0]["shard_opt"] = "false"
    doc["stages"][0]["zero"] = 3
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(doc))
    assert main(["explain", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mistjax explain: error: malformed plan (2 problems):")
    assert "  stages.0.shard_opt: 'false' must be true or false" in err
    assert "  stages.0.zero: unknown field" in err and "Traceback" not in err
