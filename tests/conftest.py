"""Test configuration: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

# LLVM at -O0: the suite is compile-bound (tiny models, hundreds of programs), and the backend level
# changes only the machine code XLA emits, not the HLO passes, the buffer assignment or the collectives the
# tests check (docs/internals.md, "Test suite"). Subprocesses inherit them.
_TEST_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0")
_OURS = {flag.split("=")[0] for flag in _TEST_FLAGS}
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in _OURS] + list(_TEST_FLAGS))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One profile cache for the whole run (shared by xdist workers, which inherit the controller's environment):
# the same tiny models are analysed by many test files, and a hit skips the symbolic analysis.
if "MISTJAX_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["MISTJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="mistjax-test-cache-")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def zoo3p():
    """Third-party-style model families and their plain optax train steps (tests/thirdparty.py)."""
    import thirdparty

    return thirdparty


@pytest.fixture(scope="session")
def family(zoo3p):
    """``family(name)``: a built third-party model family (cached; skips when transformers is absent)."""
    built = {}

    def get(name: str):
        if name in zoo3p.HF_FAMILIES and not zoo3p.hf_available():
            pytest.skip("transformers is not installed (pip install -e '.[dev]' brings transformers<5)")
        if name not in built:
            built[name] = zoo3p.FAMILIES[name]()
        return built[name]

    return get



@pytest.fixture
def hf_config_file(tmp_path):
    """``hf_config_file(doc, folder="model")``: writes a Hugging Face config dict to ``<tmp>/<folder>/config.json``
    (the layout of a downloaded checkpoint) and returns the path."""
    import json

    def write(doc: dict, folder: str = "model"):
        path = tmp_path / folder / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc))
        return path

    return write


@pytest.fixture(scope="session")
def train_steps():
    """``train_steps(cfg, steps, devices=None, plan=None) -> (losses, params)``: a zoo model (``models.build(cfg,
    rngs=nnx.Rngs(0))``) trained ``steps`` SGD-momentum steps on random-token batches (16 x 16, below
    ``cfg.vocab_size``), on one device with plain ``jax.value_and_grad`` (no plan, cached per config and steps),
    or with ``mistjax.autoshard`` on ``devices`` under ``plan``; the parameters come back gathered (numpy).
    The same initial state and batches either way, so a plan's run compares leaf by leaf with the reference."""
    import numpy as np
    import optax
    from flax import nnx

    import mistjax
    import models
    from mistjax.train.data import SyntheticTokens
    from mistjax.train.state import TrainState

    references = {}

    def run(cfg, steps: int, devices=None, plan=None):
        if plan is None and (cfg, steps) in references:
            return references[(cfg, steps)]
        state = TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1, momentum=0.9))
        loss_fn = models.make_loss_fn(state.graphdef)
        grad = jax.value_and_grad if plan is None else mistjax.value_and_grad

        def train_step(state, batch):
            loss, grads = grad(loss_fn)(state.params, batch)
            return state.apply_gradients(grads), {"loss": loss}

        step = jax.jit(train_step) if plan is None else mistjax.autoshard(train_step, devices, plan=plan)
        data = SyntheticTokens(cfg.vocab_size, 16, 16, kind="random")
        losses = []
        for i in range(steps):
            state, metrics = step(state, data.batch(i))
            losses.append(float(metrics["loss"]))
        params = jax.device_get(step.gather(state).params if plan is not None else state.params)
        out = (losses, [np.asarray(x) for x in jax.tree.leaves(params)])
        if plan is None:
            references[(cfg, steps)] = out
        return out

    return run


def load_script(name: str):
    """scripts/<name>.py imported as a module (once per process), its ``main(argv)`` callable in this process.

    The module is registered in ``sys.modules`` under its name, as the importlib recipe says: dataclasses and
    tyro resolve the scripts' annotations and config classes through it.
    """
    import importlib.util
    import sys
    from pathlib import Path

    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def pretrain():
    """scripts/pretrain.py imported as a module (its `main(argv)` runs the script in this process)."""
    return load_script("pretrain")


@pytest.fixture
def cli(pretrain, capsys):
    """``cli(*args) -> (exit code, stdout, stderr)``: scripts/pretrain.py's main() run in this process."""
    import warnings

    saved = warnings.formatwarning

    def run(*args):
        try:
            pretrain.main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = int(e.code) if isinstance(e.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    warnings.formatwarning = saved


@pytest.fixture(scope="session")
def killed_and_resumed(tmp_path_factory):
    """``killed_and_resumed(args, after=5) -> KilledRun``: scripts/pretrain.py run three times on 8 CPU devices
    with a shared XLA cache: once through as the reference, once killed with SIGKILL when a checkpoint exists
    and ``after`` steps are logged (so the resume redoes logged steps), and once with ``--resume``. ``args``
    are the script and its flags without ``--ckpt-dir`` / ``--metrics``, which this adds."""
    import json
    import os
    import signal
    import subprocess
    import time
    from dataclasses import dataclass
    from pathlib import Path

    cache = tmp_path_factory.mktemp("xla-cache")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

    def complete_lines(path: Path) -> list[str]:
        try:
            return [line for line in path.read_text().split("\n")[:-1] if line]
        except FileNotFoundError:
            return []

    @dataclass
    class KilledRun:
        want: list[dict]  # the reference's metrics records
        got: list[dict]  # the killed-then-resumed run's
        killed_at: int  # steps logged when it was killed
        killed_output: str  # the killed run's stdout
        resumed: subprocess.CompletedProcess
        ckpt: Path

    def run(args: list[str], after: int = 5) -> KilledRun:
        root = tmp_path_factory.mktemp("killed")
        ref = subprocess.run([*args, "--ckpt-dir", str(root / "ref"), "--metrics", str(root / "ref.jsonl")],
                             env=env, capture_output=True, text=True, timeout=240)
        assert ref.returncode == 0, ref.stderr[-3000:]
        ckpt, metrics = root / "ckpt", root / "run.jsonl"
        run_args = [*args, "--ckpt-dir", str(ckpt), "--metrics", str(metrics)]
        proc = subprocess.Popen(run_args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                if len(complete_lines(metrics)) >= after and any(p.name.isdigit() for p in ckpt.glob("*")):
                    break
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"the run ended on its own before the kill: {err[-2000:]}"
        killed_at = len(complete_lines(metrics))
        resumed = subprocess.run([*run_args, "--resume"], env=env, capture_output=True, text=True, timeout=240)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        records = lambda p: [json.loads(line) for line in p.read_text().splitlines()]  # noqa: E731
        return KilledRun(records(root / "ref.jsonl"), records(metrics), killed_at, out, resumed, ckpt)

    return run
