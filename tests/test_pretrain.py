"""scripts/pretrain.py as a user runs it: metrics, MFU, divergence and data errors (`cli`: tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import models
from mistjax.api.mfu import ModelFlops, mfu
from mistjax.hardware import ClusterSpec
from mistjax.train.data import DataError, MemmapTokens, write_token_file
from mistjax.train.metrics import MetricsLog, peak_flops

SMALL = ["--model", "gpt3-tiny", "--global-batch", "8", "--seq-len", "16", "--no-progress"]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_one_record_per_step_with_mfu(cli, tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 0, "loss": 9.9}\n')  # a stale file from an earlier run is replaced
    code, out, err = cli(*SMALL, "--steps", 3, "--metrics", metrics, "--hardware", "h100")
    assert code == 0, err
    got = records(metrics)
    assert [r["step"] for r in got] == [1, 2, 3]  # numbered from 1, as the log lines and the checkpoints
    cfg = models.get_config("gpt3-tiny")
    peak = ClusterSpec.preset("h100").device.peak_flops_fp32  # --dtype float32 is measured against fp32 peak
    per_token = 6 * cfg.num_params() + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 16  # PaLM, T = 16
    for r in got:
        assert np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert r["mfu"] == pytest.approx(per_token * r["tokens_per_s"] / (8 * peak), rel=1e-9)
        assert r["host_bytes_per_device"] == 0.0  # the default plan offloads nothing
    assert "final loss" in out and "at step 3, MFU" in out
    assert "MFU = model FLOPs x tokens/s / (devices x peak): 6·N + 12·L·H·Q·T per token" in out
    # The plan before the first step; without a bar, plain log lines (the last step always), no carriage returns.
    assert out.index("Plan:") < out.index("step 1/3:") < out.index("step 3/3:") and "\r" not in out + err


def test_mfu_formula_and_peaks() -> None:
    device = ClusterSpec.preset("a100-80gb").device
    assert peak_flops("a100-80gb", "bfloat16") == device.peak_flops
    assert peak_flops("a100-80gb", "float32") == device.peak_flops_fp32
    assert mfu(1000.0, ModelFlops(10**9), 8, 1e15) == pytest.approx(6e12 / 8e15)
    attention = 12 * 2 * 4 * 8 * 100 * 1000.0  # 12 L H Q T per token, 1000 tokens/s
    assert mfu(1000.0, ModelFlops(10**9, 2, 4, 8, 100), 8, 1e15) == pytest.approx((6e12 + attention) / 8e15)
    with pytest.raises(ValueError, match="unknown hardware preset 'tpu-v9'.*valid names"):
        peak_flops("tpu-v9", "bfloat16")


def test_metrics_log_continues_after_resume(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": i, "loss": float(i)}) + "\n" for i in range(1, 11)) + '{"step": 11, "l')
    log = MetricsLog(path, start_step=6)  # the checkpoint holds the state after step 6
    assert [r["step"] for r in log.kept] == [1, 2, 3, 4, 5, 6]  # what a resumed run's plot starts from
    log.write({"step": 7, "loss": -1.0})
    log.close()
    assert [r["step"] for r in records(path)] == [1, 2, 3, 4, 5, 6, 7]
    assert records(path)[-1]["loss"] == -1.0
    MetricsLog(path, start_step=3, enabled=False).close()  # a non-primary process leaves the file alone
    assert len(records(path)) == 7


def test_nan_loss_stops_with_clear_error_and_keeps_checkpoint(cli, tmp_path: Path) -> None:
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    # lr 1e30 without warm-up: step 1 is fine, its update blows the weights up, step 2's loss is NaN.
    code, _, err = cli(*SMALL, "--steps", 5, "--lr", "1e30", "--warmup", 0, "--ckpt-dir", ckpt, "--ckpt-every", 1,
                       "--metrics", metrics)
    assert code == 1
    assert "error: training diverged: the loss is nan at step 2" in err
    assert "the last checkpoint (step 1)" in err and "lower --lr (now 1e+30)" in err
    assert "Traceback" not in err
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [1]
    assert [r["step"] for r in records(metrics)] == [1]  # the NaN step is not logged


def test_missing_and_truncated_token_files(cli, tmp_path: Path) -> None:
    missing = tmp_path / "nope.bin"
    with pytest.raises(DataError, match="does not exist"):
        MemmapTokens(missing, seq_len=16, batch_size=8)
    code, _, err = cli(*SMALL, "--steps", 1, "--data", missing)
    assert code == 1 and "error: token file" in err and "does not exist" in err

    truncated = tmp_path / "cut.bin"
    write_token_file(truncated, np.arange(1000) % 256)
    truncated.write_bytes(truncated.read_bytes()[:-1])  # half a uint16 token at the end
    with pytest.raises(DataError, match="not a multiple of 2"):
        MemmapTokens(truncated, seq_len=16, batch_size=8)
    code, _, err = cli(*SMALL, "--steps", 1, "--data", truncated)
    assert code == 1 and "truncated or has another dtype" in err and "Traceback" not in err

    short = tmp_path / "short.bin"
    write_token_file(short, np.arange(5))
    code, _, err = cli(*SMALL, "--steps", 1, "--data", short)
    assert code == 1 and "fewer than one sequence" in err


def test_token_file_read_with_the_wrong_dtype_is_refused(cli, tmp_path: Path) -> None:
    """uint32 ids read as uint16 (a 0 after every token), uint16 ids read as uint32, odd sizes: one-line errors
    naming --token-dtype and the fix, before any model is built."""
    ids = np.random.default_rng(0).integers(1, 256, 4000)
    u32 = tmp_path / "tokens_u32.bin"
    write_token_file(u32, ids, "uint32")
    for vocab in (256, None):
        with pytest.raises(DataError, match="little-endian uint32 ids read as --token-dtype uint16.*is 0.*"
                                            "pass --token-dtype uint32"):
            MemmapTokens(u32, seq_len=16, batch_size=8, vocab_size=vocab)
    code, _, err = cli(*SMALL, "--steps", 1, "--data", u32, "--token-dtype", "uint16")
    assert code == 1 and "pass --token-dtype uint32" in err and "Traceback" not in err
    assert MemmapTokens(u32, seq_len=16, batch_size=8, dtype="uint32", vocab_size=256).batch(0)["inputs"].max() < 256

    # A vocabulary above 65,536 (Llama-3's 128,256): the high halves are 0 or 1, still not real text.
    big = tmp_path / "big_u32.bin"
    write_token_file(big, np.random.default_rng(1).integers(0, 128256, 4000), "uint32")
    with pytest.raises(DataError, match="is at most 1.*pass --token-dtype uint32"):
        MemmapTokens(big, seq_len=16, batch_size=8, vocab_size=128256)

    u16 = tmp_path / "tokens_u16.bin"
    write_token_file(u16, ids, "uint16")  # 8000 bytes: whole uint32 words, each two ids pairing up
    with pytest.raises(DataError, match=r"contains id \d+ >= vocab size 256 \(read as --token-dtype uint32\).*"
                                        "try --token-dtype uint16"):
        MemmapTokens(u16, seq_len=16, batch_size=8, dtype="uint32", vocab_size=256)
    code, _, err = cli(*SMALL, "--steps", 1, "--data", u16, "--token-dtype", "uint32")
    assert code == 1 and "try --token-dtype uint16" in err
    odd = tmp_path / "odd_u16.bin"
    write_token_file(odd, ids[:-1], "uint16")  # 7998 bytes
    with pytest.raises(DataError, match="not a multiple of 4 \\(--token-dtype uint32\\).*pass the --token-dtype"):
        MemmapTokens(odd, seq_len=16, batch_size=8, dtype="uint32")
    MemmapTokens(u16, seq_len=16, batch_size=8, vocab_size=256)  # the right dtype is accepted


def test_token_file_checks_read_a_bounded_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks read the head and a slice of the tail: an out-of-vocabulary id there is caught, one in the
    unsampled middle is not read at all (large files stay cheap to open)."""
    from mistjax.train import data

    monkeypatch.setattr(data, "SAMPLE_BYTES", 1024)
    monkeypatch.setattr(data, "TAIL_BYTES", 1024)
    ids = np.random.default_rng(0).integers(0, 256, 10_000)
    for where, caught in ((0, True), (5_000, False), (9_999, True)):
        bad = ids.copy()
        bad[where] = 300
        path = tmp_path / f"bad{where}.bin"
        write_token_file(path, bad)
        if caught:
            with pytest.raises(DataError, match="contains id 300 >= vocab size 256"):
                MemmapTokens(path, seq_len=16, batch_size=8, vocab_size=256)
        else:
            MemmapTokens(path, seq_len=16, batch_size=8, vocab_size=256)


def test_flag_mistakes_are_one_line_errors(cli, tmp_path: Path) -> None:
    code, _, err = cli(*SMALL, "--resume")
    assert code == 1 and "--resume needs --ckpt-dir" in err
    code, _, err = cli(*SMALL, "--hardware", "nonesuch")
    assert code == 1 and "unknown hardware preset 'nonesuch'" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = cli(*SMALL, "--ckpt-dir", blocker / "ckpt")
    assert code == 1 and "cannot write checkpoints to" in err and "choose a writable --ckpt-dir" in err


def test_bf16_weights_train_on_an_fp32_master_copy() -> None:
    """--param-dtype bfloat16: the state stores 16-bit weights and the optimizer an fp32 master copy, and the
    run trains (the loss falls), as `mistjax plan --param-dtype bfloat16` prices it."""
    import jax
    import jax.numpy as jnp

    from mistjax.train.loop import TrainConfig, run_training

    cfg = TrainConfig(model="gpt3-tiny", steps=4, global_batch=8, seq_len=16, param_dtype="bfloat16",
                      compute_dtype="bfloat16", learning_rate=1e-2)
    result = run_training(cfg, progress=False)
    params = jax.tree.leaves(result.state.params)
    master = jax.tree.leaves(result.state.opt_state.master)
    assert {x.dtype for x in params} == {jnp.dtype("bfloat16")}
    assert {x.dtype for x in master} == {jnp.dtype("float32")} and len(master) == len(params)
    assert np.isfinite(result.losses).all() and result.losses[-1] < result.losses[0]


def test_a_hugging_face_config_trains(cli, tmp_path: Path) -> None:
    """--model takes what `mistjax plan --model` takes: here a Hugging Face config.json, not only a preset."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
                                  "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}))
    code, out, err = cli("--model", config, "--global-batch", "8", "--seq-len", "16", "--no-progress", "--steps", 2)
    assert code == 0, err
    assert "final loss" in out and "at step 2" in out
    code, _, err = cli("--model", tmp_path / "nope.json", "--steps", 1, "--no-progress")
    assert code == 1 and "model config file" in err and "does not exist" in err and "Traceback" not in err


def test_the_plot_after_a_resume_covers_every_step(cli, pretrain, tmp_path: Path, monkeypatch) -> None:
    """Steps 1-2, then a resume to step 4 with --plot: the curve has steps 1-4 (the first two read back from the
    metrics log), numbered as the log lines and the metrics are."""
    plotted = {}
    monkeypatch.setattr(pretrain, "save_loss_plot", lambda losses, path, title, steps: plotted.update(
        losses=losses, steps=steps))
    import shutil

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    common = (*SMALL, "--ckpt-dir", ckpt, "--ckpt-every", 2, "--metrics", metrics, "--steps", 4)
    code, out, err = cli(*common)
    assert code == 0, err
    first = records(metrics)
    shutil.rmtree(ckpt / "4")  # as if killed after step 3: the newest checkpoint is step 2's
    code, out, err = cli(*common, "--resume", "--plot", tmp_path / "loss.png")
    assert code == 0, err
    assert "resumed from step 2" in out and "continuing with step 3" in out and "step 4/4:" in out
    got = records(metrics)
    assert plotted["steps"] == [r["step"] for r in got] == [1, 2, 3, 4]
    assert plotted["losses"] == [r["loss"] for r in got] == [r["loss"] for r in first]  # bit-exact resume


def test_boolean_flags_read_naturally(pretrain) -> None:
    assert pretrain.parse_args([]).launch.progress
    assert not pretrain.parse_args(["--no-progress"]).launch.progress
    assert pretrain.parse_args(["--progress"]).launch.progress
