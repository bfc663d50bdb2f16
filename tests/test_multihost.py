"""Multi-process training on JAX's own runtime: 2 processes x 4 CPU devices on 127.0.0.1."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import models
from mistjax.distributed import DistributedError, resolve
from mistjax.plan import uniform_plan
from mistjax.train.loop import TrainConfig, run_training

PRETRAIN = Path(__file__).resolve().parents[1] / "scripts" / "pretrain.py"
BATCH, SEQ = 16, 16
MODEL = "llama-tiny"


# ------------------------------------------------------------------------------ settings
def test_resolve_reads_flags_then_mistjax_then_jax_env() -> None:
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3",
           "MISTJAX_PROCESS_ID": "2"}
    setup = resolve(env=env)
    assert (setup.coordinator, setup.num_processes, setup.process_id) == ("10.0.0.1:1234", 4, 2)
    assert resolve(process_id=1, env=env).process_id == 1
    assert not resolve(env={}).multi_process
    assert not resolve(num_processes=1, env={}).multi_process
    assert resolve(env={"MISTJAX_LOCAL_DEVICES": "4"}).local_devices == 4


@pytest.mark.parametrize("kwargs, env, message", [
    ({"num_processes": 2}, {}, r"missing: --coordinator \(or JAX_COORDINATOR_ADDRESS\), --process-id"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, {}, r"--process-id 2 is outside 0..1"),
    ({"coordinator": "nohost", "num_processes": 2, "process_id": 0}, {}, r"must be host:port"),
    ({}, {"JAX_NUM_PROCESSES": "two"}, r"must be an integer, got 'two' \(from JAX_NUM_PROCESSES\)"),
])
def test_resolve_rejects_incomplete_or_bad_settings(kwargs, env, message) -> None:
    with pytest.raises(DistributedError, match=message):
        resolve(**kwargs, env=env)


# ------------------------------------------------------------------------------ real processes
@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-2 + TP 2 + 2 accumulated micro-batches on 8 devices."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    layers = models.get_config(MODEL).num_layers
    uniform_plan(layers, 8, tp=2, grad_accum=2, micro_batch=BATCH // (4 * 2), shard_opt=True,
                 shard_grads=True).save(path)
    return path


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xla-cache")


@functools.cache
def reference(plan_file: Path, steps: int) -> tuple[float, ...]:
    """The same plan in this process on its 8 simulated devices (computed while the subprocesses start)."""
    cfg = TrainConfig(model=MODEL, plan=str(plan_file), steps=steps, global_batch=BATCH, seq_len=SEQ)
    return tuple(run_training(cfg, progress=False).losses)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, plan_file: Path, cache: Path, steps: int, *extra: str, heartbeat: int = 10,
           ckpt_every: int = 2) -> list[subprocess.Popen]:
    env = dict(os.environ)
    flags = os.environ["XLA_FLAGS"].replace("device_count=8", "device_count=4")  # conftest's, resized
    env.update(JAX_NUM_CPU_DEVICES="4", XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", PYTHONUNBUFFERED="1",
               JAX_DEFAULT_MATMUL_PRECISION="highest")  # as tests/conftest.py sets for the reference
    port = free_port()
    procs = []
    for pid in range(2):
        args = [sys.executable, str(PRETRAIN), "--model", MODEL, "--plan", str(plan_file), "--steps", str(steps),
                "--global-batch", str(BATCH), "--seq-len", str(SEQ), "--no-progress",
                "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid),
                "--local-devices", "4", "--dist-timeout", "120", "--heartbeat-timeout", str(heartbeat),
                "--metrics", str(tmp_path / "metrics.jsonl"), "--ckpt-dir", str(tmp_path / "ckpt"),
                "--ckpt-every", str(ckpt_every), *extra]
        log = open(tmp_path / f"p{pid}.log", "a")  # noqa: SIM115 - the child owns it
        procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for all processes; kill every one still running when the time is up."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def losses(path: Path) -> list[float]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + p.read_text()[-3000:] for p in sorted(tmp_path.glob("p*.log")))


def test_two_processes_match_one_process(tmp_path: Path, plan_file: Path, compile_cache: Path) -> None:
    steps = 4
    procs = launch(tmp_path, plan_file, compile_cache, steps, ckpt_every=steps)  # one multi-process save
    try:
        want = reference(plan_file, steps)
    finally:
        codes = finish(procs, timeout=400)
    assert codes == [0, 0], logs(tmp_path)
    got = losses(tmp_path / "metrics.jsonl")
    assert len(got) == steps
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [4]


@pytest.mark.slow
def test_dead_peer_stops_the_others_and_the_run_resumes(tmp_path: Path, plan_file: Path, compile_cache: Path) -> None:
    steps = 10
    procs = launch(tmp_path, plan_file, compile_cache, steps, heartbeat=5)
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            if metrics.exists() and metrics.read_text().count("\n") >= 3 and (tmp_path / "ckpt" / "2").is_dir():
                break
            time.sleep(0.05)
        assert all(p.poll() is None for p in procs), logs(tmp_path)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = procs[0].wait(timeout=60)
        waited = time.monotonic() - killed
    finally:
        finish(procs, timeout=1)
    text = (tmp_path / "p0.log").read_text()
    assert code != 0 and waited < 60
    # Either our message (a collective saw the connection reset) or the runtime's (heartbeat timeout).
    assert "lost contact with a peer" in text or "another task died" in text, text[-3000:]
    assert metrics.read_text().count("\n") < steps, "the run must have been cut short"

    procs = launch(tmp_path, plan_file, compile_cache, steps, "--resume")
    try:
        want = reference(plan_file, steps)
    finally:
        codes = finish(procs, timeout=400)
    assert codes == [0, 0], logs(tmp_path)
    np.testing.assert_allclose(losses(metrics), want, rtol=2e-6, atol=2e-6)


@pytest.mark.slow
def test_resume_on_fewer_processes_retunes_and_keeps_the_global_batch(tmp_path: Path, plan_file: Path,
                                                                      compile_cache: Path) -> None:
    """A run on 2 processes x 4 devices (ZeRO-2 + TP 2) resumes on 1 process x 4 devices with ``--plan auto``:
    the plan is re-tuned for the devices now present, the global batch stays 16 (more accumulation), and
    the losses continue those of the run that wrote the checkpoint (up to float reassociation)."""
    steps = 6
    procs = launch(tmp_path, plan_file, compile_cache, steps, ckpt_every=4)
    codes = finish(procs, timeout=600)
    assert codes == [0, 0], logs(tmp_path)
    first = losses(tmp_path / "metrics.jsonl")
    shutil.rmtree(tmp_path / "ckpt" / str(steps))  # as if the run had stopped after step 4

    env = dict(os.environ)
    env.update(JAX_NUM_CPU_DEVICES="4", XLA_FLAGS=os.environ["XLA_FLAGS"].replace("device_count=8", "device_count=4"),
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_DEFAULT_MATMUL_PRECISION="highest")
    args = [sys.executable, str(PRETRAIN), "--model", MODEL, "--plan", "auto", "--steps", str(steps),
            "--global-batch", str(BATCH), "--seq-len", str(SEQ), "--no-progress", "--resume",
            "--ckpt-dir", str(tmp_path / "ckpt"), "--metrics", str(tmp_path / "metrics.jsonl")]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed from step 4" in done.stdout
    assert "written by 2 process(es) with 8 devices; this run has 1 with 4" in done.stdout
    assert "global batch 16" in done.stdout and "under another plan" in done.stdout
    got = losses(tmp_path / "metrics.jsonl")
    assert got[:4] == first[:4]
    np.testing.assert_allclose(got[4:], first[4:], rtol=1e-5, atol=1e-5)


def test_missing_peer_is_a_clear_error_after_the_join_timeout(tmp_path: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = [sys.executable, str(PRETRAIN), "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2",
            "--process-id", "1", "--dist-timeout", "2", "--no-progress"]
    t0 = time.monotonic()
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and time.monotonic() - t0 < 30
    assert "error: process 1 of 2: could not reach process 0 at 127.0.0.1:" in done.stderr
    assert "within 2 s (--dist-timeout)" in done.stderr
