"""Outputs that never mislead (#55): explain prices the plan's own shape, knobs that apply to nothing say so,
defaults are stated, unverified plans say so, messages state what they counted, MFU and host memory shown."""

from __future__ import annotations

from mistjax.cli import main
from mistjax.plan import uniform_plan

TINY_MODEL = ["--model", "gpt3-tiny", "--cluster", "cpu:1x8", "--dtype", "float32"]


def _plan_file(tmp_path, **fingerprints):
    """A 4-layer ZeRO-1 plan over 8 devices, global batch 16, recording ``fingerprints``."""
    path = tmp_path / "plan.json"
    uniform_plan(4, 8, micro_batch=2, shard_opt=True).replace(fingerprints=fingerprints).save(path)
    return path


def test_explain_uses_the_plans_recorded_shape(tmp_path, capsys):
    """Without --seq-len, explain prices the plan at the sequence length it was tuned for, not 2048."""
    plan = _plan_file(tmp_path, batch="16x48")
    assert main(["explain", str(plan), *TINY_MODEL]) == 0
    out = capsys.readouterr().out
    assert "priced at global batch 16 x sequence 48 (the plan's)" in out
    # 2048 would exceed gpt3-tiny's max_seq_len of 64 and fail: the plan's 48 is what was priced
    assert "step" in out


def test_explain_refuses_another_seq_len(tmp_path, capsys):
    plan = _plan_file(tmp_path, batch="16x48")
    assert main(["explain", str(plan), *TINY_MODEL, "--seq-len", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seq-len 32 differs from the 48 tokens the plan was tuned for" in err
    assert "omit --seq-len" in err
    assert main(["explain", str(plan), *TINY_MODEL, "--seq-len", "48"]) == 0  # the same length is fine


def test_explain_says_when_it_falls_back_to_the_default_length(tmp_path, capsys):
    """A hand-written plan records no shape: an explicit --seq-len is used; without it the default is named."""
    plan = _plan_file(tmp_path)
    assert main(["explain", str(plan), *TINY_MODEL, "--seq-len", "32"]) == 0
    assert "priced at global batch 16 x sequence 32 (--seq-len)" in capsys.readouterr().out
    assert main(["explain", str(plan), *TINY_MODEL]) == 2  # 2048 > max_seq_len: the default was really used
    captured = capsys.readouterr()
    assert "the default: the plan records none; pass --seq-len" in captured.out
    assert "--seq-len 2048 exceeds" in captured.err


def test_explain_refuses_another_global_batch(tmp_path, capsys):
    plan = _plan_file(tmp_path, batch="16x48")
    assert main(["explain", str(plan), *TINY_MODEL, "--global-batch", "32"]) == 2
    assert "global batch 32 != micro_batch 2" in capsys.readouterr().err
