"""Checkpoints: exact resume after SIGKILL, resume under another plan, corrupt-checkpoint fallback, clear errors."""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import models
from mistjax.plan import Plan, StagePlan
from mistjax.runtime.mpmd_state import gather_state
from mistjax.train.checkpoint import Checkpointer, CheckpointError, check_writable, checksums
from mistjax.train.loop import TrainConfig, _prepare, run_training

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = REPO / "scripts" / "pretrain.py"
BASE = TrainConfig(model="gpt3-tiny", steps=6, global_batch=8, seq_len=16, warmup_steps=2, ckpt_every=2, keep=3)


# ------------------------------------------------------------------------------ helpers
def garble(path: Path) -> None:
    """Flip bytes in the middle of `path` and cut its tail off (a torn, corrupted write)."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 4, len(data) // 2, 3):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data[: max(1, len(data) * 3 // 4)]))


def largest_array_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory):
    """Six steps with checkpoints at 2, 4 and 6; tests work on copies of its directory."""
    directory = tmp_path_factory.mktemp("base") / "ckpt"
    cfg = TrainConfig(**{**BASE.__dict__, "ckpt_dir": str(directory)})
    return cfg, run_training(cfg, progress=False)


def copy_of(base_run, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(base_run[0].ckpt_dir, dst)
    return dst


# ------------------------------------------------------------------------------ exact resume
def test_resume_after_sigkill_matches_uninterrupted(killed_and_resumed) -> None:
    steps = 12
    run = killed_and_resumed([sys.executable, str(PRETRAIN), "--model", "gpt3-tiny", "--steps", str(steps),
                              "--global-batch", "8", "--seq-len", "16", "--warmup", "3", "--ckpt-every", "2",
                              "--keep", "2", "--no-progress"])
    assert 5 <= run.killed_at < steps
    assert "resumed from step" in run.resumed.stdout
    assert [r["step"] for r in run.got] == list(range(1, steps + 1))  # every step exactly once, in order
    np.testing.assert_allclose([r["loss"] for r in run.got], [r["loss"] for r in run.want], rtol=0, atol=1e-6)
    assert [r["loss"] for r in run.got] == [r["loss"] for r in run.want], "resume is close but not bit-identical"


# ------------------------------------------------------------------------------ corruption
def test_corrupt_latest_falls_back_to_previous(base_run, tmp_path: Path) -> None:
    cfg = base_run[0]
    directory = copy_of(base_run, tmp_path)
    garble(largest_array_file(directory / "6"))
    manager = Checkpointer(directory)
    try:
        template = base_run[1].state
        with pytest.warns(RuntimeWarning, match=r"checkpoint step 6 .* is corrupt: unreadable arrays"):
            state, meta = manager.restore_latest(template)
        assert meta["step"] == 4 and int(state.step) == 4
        assert manager.steps() == [2, 4], "the bad step is moved aside so that step 6 can be saved again"
        assert list(directory.glob("6.corrupt-*"))
        for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(template)):
            assert got.sharding == want.sharding  # restored onto the plan's shardings
        manager.save(6, template, {"model": cfg.model})  # the resumed run can write step 6 again
        manager.wait()
        assert manager.steps() == [2, 4, 6]
    finally:
        manager.close()


def test_no_usable_checkpoint_is_a_clear_error(base_run, tmp_path: Path) -> None:
    cfg, _ = base_run
    directory = copy_of(base_run, tmp_path)
    garble(largest_array_file(directory / "6"))
    (directory / "4" / "meta" / "metadata").write_text("{not json")
    shutil.rmtree(directory / "2" / "state")
    with pytest.warns(RuntimeWarning, match="corrupt"), \
            pytest.raises(CheckpointError, match=r"no usable checkpoint.*step 6.*step 4.*step 2"):
        run_training(TrainConfig(**{**cfg.__dict__, "ckpt_dir": str(directory), "resume": True}), progress=False)


def test_checksums_detect_silent_changes(base_run) -> None:
    state = base_run[1].state
    sums = checksums(state)
    leaf = jax.tree.leaves(state.params)[0]
    changed = jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1e-3) if x is leaf else x, state)
    name = next(k for k in sums if k.startswith("params/"))
    assert checksums(changed)[name] != sums[name]


def test_metadata_records_the_run(base_run) -> None:
    cfg, _ = base_run
    manager = Checkpointer(cfg.ckpt_dir)
    try:
        assert manager.steps() == [2, 4, 6]
        meta = manager.read_meta(6)
    finally:
        manager.close()
    assert meta["step"] == 6 and meta["model"] == "gpt3-tiny" and meta["data_seed"] == cfg.seed
    assert meta["plan"]["dp"] == 8 and meta["config"]["global_batch"] == 8
    assert meta["data_position"] == {"next_batch": 6, "seed": cfg.seed, "source": "synthetic"}
    assert meta["leaves"]["params/layers/mlp/wi/value"][0][0] == models.get_config(cfg.model).num_layers
    assert set(meta["leaves"]) == set(meta["checksums"])


# ------------------------------------------------------------------------------ another plan
def pipelined_tp_zero3(num_layers: int) -> Plan:
    """pp 2 x dp 2 x tp 2, ZeRO-3 on both stages, half of stage 1's optimizer state on host."""
    half = num_layers // 2
    return Plan(stages=(StagePlan((0, half), shard_grads=True, shard_weights=True),
                        StagePlan((half, num_layers), shard_grads=True, shard_weights=True, offload_opt=0.5)),
                micro_batch=2, grad_accum=2, dp=2, tp=2)


def restored_under(cfg: TrainConfig) -> tuple[object, object]:
    """The state `cfg` resumes from (placed by its plan) and the run's sharded step."""
    ckpt = Checkpointer(cfg.ckpt_dir)
    try:
        setup = _prepare(cfg, None, ckpt)
    finally:
        ckpt.close()
    return setup.state, setup.step


@pytest.fixture(scope="module")
def pipelined_run(tmp_path_factory: pytest.TempPathFactory):
    """Six steps under `pipelined_tp_zero3`, checkpoints at 4 and 6."""
    root = tmp_path_factory.mktemp("pipelined")
    plan_file = root / "plan.json"
    pipelined_tp_zero3(models.get_config(BASE.model).num_layers).save(plan_file)
    cfg = TrainConfig(**{**BASE.__dict__, "plan": str(plan_file), "ckpt_every": 4, "ckpt_dir": str(root / "ckpt")})
    return cfg, run_training(cfg, progress=False)


@pytest.mark.parametrize("direction", ["dp8-zero1 to pp2-tp2-zero3", "pp2-tp2-zero3 to dp8-zero1"])
def test_resume_under_another_plan_continues_the_run(direction, base_run, pipelined_run, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint holds logical arrays: a run resumes under any plan. The restored parameters and optimizer
    state, gathered, are bit-identical to the saved ones, and the next steps' losses equal continuing under
    the plan that wrote it (within 1e-6: the plans reassociate sums differently)."""
    forward = direction.startswith("dp8")
    written_by, other = (base_run, pipelined_run) if forward else (pipelined_run, base_run)
    directory = tmp_path / "ckpt"
    shutil.copytree(written_by[0].ckpt_dir, directory)
    resume = TrainConfig(**{**written_by[0].__dict__, "plan": other[0].plan, "ckpt_dir": str(directory),
                            "resume": True})
    state, step = restored_under(resume)
    assert int(np.asarray(state.step)) == 6
    saved = jax.tree.leaves(jax.device_get(gather_state(written_by[1].state)))
    got = jax.tree.leaves(step.gather(state))
    assert len(saved) == len(got)
    for want, have in zip(saved, got):
        np.testing.assert_array_equal(np.asarray(have), np.asarray(want))
    old, new = ("pp 1 x dp 8", "pp 2 x dp 2 x tp 2, ZeRO 3/3") if forward else ("pp 2", "pp 1 x dp 8")
    assert re.search(f"under another plan \\({re.escape(old)}.* -> {re.escape(new)}", capsys.readouterr().out)

    shutil.rmtree(directory / "6")
    continued = run_training(resume, progress=False)
    assert continued.start_step == 4
    np.testing.assert_allclose(continued.losses, written_by[1].losses[4:], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ refusals
def test_resume_with_other_model_is_refused(base_run, tmp_path: Path) -> None:
    cfg, _ = base_run
    directory = copy_of(base_run, tmp_path)
    other_model = TrainConfig(**{**cfg.__dict__, "model": "llama-tiny", "ckpt_dir": str(directory), "resume": True})
    with pytest.raises(CheckpointError, match=r"model 'gpt3-tiny'.*this run uses model 'llama-tiny'"):
        run_training(other_model, progress=False)


def test_restore_into_another_state_names_the_leaves(base_run, tmp_path: Path) -> None:
    """A state whose leaves differ from the saved ones (here: 16-bit weights with an fp32 master copy) is
    refused with the differing leaves named, and the checkpoint is left in place (not taken for corrupt)."""
    directory = copy_of(base_run, tmp_path)
    cfg = TrainConfig(**{**base_run[0].__dict__, "param_dtype": "bfloat16", "ckpt_dir": str(directory),
                         "resume": True})
    with pytest.warns(RuntimeWarning, match="changed settings"), \
            pytest.raises(CheckpointError, match=r"cannot restore checkpoint step 6 .*(only in|not in) the checkpoint"
                                                 r".*the plan may differ"):
        run_training(cfg, progress=False)
    assert sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) == [2, 4, 6]


def test_unwritable_directory_fails_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    target = blocker / "ckpt"
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"cannot write checkpoints to .*a-file/ckpt.*choose a writable"):
        run_training(TrainConfig(**{**BASE.__dict__, "ckpt_dir": str(target)}), progress=False)
    assert time.perf_counter() - t0 < 5, "the check must come before the model is built"
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(CheckpointError, match="cannot write checkpoints"):
            check_writable(locked)


def test_fresh_run_into_used_directory_is_refused(base_run) -> None:
    cfg, _ = base_run
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(newest: step 6\); pass --resume"):
        run_training(cfg, progress=False)
