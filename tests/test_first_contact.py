"""A clean first contact on a CPU machine (issue #32): the README's commands run without JAX_PLATFORMS set and
print no traceback, no CUDA plugin error and no missing-driver log lines (`mistjax._platform`).

Every command runs in a subprocess whose environment lacks JAX_PLATFORMS (conftest sets it for this process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mistjax import _platform

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NOISE = ("Traceback", "cudart", "absl::InitializeLog", "Jax plugin configuration error")
CUDA_PLUGIN_WITHOUT_DRIVER = _platform._cuda_plugin() is not None and not _platform.nvidia_driver_present()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(extra)
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(**extra), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def _assert_quiet(proc: subprocess.CompletedProcess[str]) -> None:
    found = [word for word in NOISE if word in proc.stderr]
    assert not found, f"{proc.args}: {found} in stderr:\n{proc.stderr[-3000:]}"


def test_plan_and_explain(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    workload = ["--model", "gpt3-tiny", "--cluster", "l4:1x2", "--seq-len", "64"]
    proc = _run([str(BIN / "mistjax"), "plan", *workload, "--global-batch", "8", "--json", str(plan)], tmp_path)
    _assert_quiet(proc)
    assert "predicted:" in proc.stdout and plan.is_file()
    assert "searching" not in proc.stderr  # the progress bar: only on a terminal
    proc = _run([str(BIN / "mistjax"), "explain", str(plan), *workload], tmp_path)
    _assert_quiet(proc)
    assert "peak" in proc.stdout


def test_demo(tmp_path: Path) -> None:
    """`make demo` (the README's main job), shortened to a few steps: quiet, and it writes the loss plot."""
    out = tmp_path / "demo_out"
    proc = _run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--out", str(out), "--steps", "4"], tmp_path)
    _assert_quiet(proc)
    assert (out / "loss.png").is_file()


def test_help_texts(tmp_path: Path) -> None:
    _assert_quiet(_run([str(BIN / "mistjax"), "calibrate", "--help"], tmp_path))
    proc = _run([sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--help"], tmp_path)
    _assert_quiet(proc)
    assert "usage" in proc.stdout


def test_models_list(tmp_path: Path) -> None:
    proc = _run([sys.executable, "-m", "models", "--list"], tmp_path)
    assert "gpt3-tiny" in proc.stdout
    _assert_quiet(proc)

def test_import_is_light(tmp_path: Path) -> None:
    """`import mistjax` (and building a step with a plan) loads neither the symbolic analysis (sympy) nor the
    tuner's solver (cvxpy): they come with the first tuning or tensor-parallel block (issue #30)."""
    code = ("import sys, mistjax, jax; from mistjax.plan import uniform_plan; "
            "step = mistjax.autoshard(lambda s, b: (s, {}), jax.devices()[:1], plan=uniform_plan(1, 1)); "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'sympy', 'cvxpy'}); print(heavy); "
            "print(sorted(m for m in sys.modules if m.startswith(('mistjax.analysis', 'mistjax.tuning', "
            "'mistjax.cost'))))")
    proc = _run([sys.executable, "-c", code], tmp_path)
    assert proc.stdout.split("\n")[:2] == ["[]", "[]"], proc.stdout


@pytest.mark.skipif(not CUDA_PLUGIN_WITHOUT_DRIVER, reason="needs the JAX CUDA plugin on a machine without a driver")
@pytest.mark.parametrize("platforms", [None, "cpu", ""])
def test_platform_choice(tmp_path: Path, platforms: str | None) -> None:
    """Unset: mistjax chooses cpu; set (even to ""): it stays. The plugin's driver lines are gone either way
    (with "" the backends are not started: JAX would then try CUDA and say why it cannot)."""
    start = "print(jax.devices()[0].platform)" if platforms != "" else "print('-')"
    code = f"import os, mistjax, jax; print(repr(os.environ.get('JAX_PLATFORMS'))); {start}"
    proc = _run([sys.executable, "-c", code], tmp_path, **({} if platforms is None else {"JAX_PLATFORMS": platforms}))
    _assert_quiet(proc)
    chosen, platform = proc.stdout.split()
    assert chosen == repr("cpu" if platforms is None else platforms)
    assert platform == ("-" if platforms == "" else "cpu")


@pytest.mark.skipif(not CUDA_PLUGIN_WITHOUT_DRIVER, reason="needs the JAX CUDA plugin on a machine without a driver")
def test_platform_choice_after_jax(tmp_path: Path) -> None:
    """jax imported before mistjax: the platform is still chosen (no CUDA plugin traceback at backend start)."""
    code = "import jax, mistjax; print(jax.devices()[0].platform)"
    proc = _run([sys.executable, "-c", code], tmp_path)
    assert proc.stdout.split() == ["cpu"]
    assert "Traceback" not in proc.stderr and "plugin configuration error" not in proc.stderr


def test_filter_keeps_other_output(capfd: pytest.CaptureFixture[str]) -> None:
    noise = (b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
             b"I0000 00:00:1796285439.255323    5830 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
             b"GPU will not be used.\n")
    with _platform.drop_driver_noise():
        os.write(2, noise + b"E0000 a real error\n" + noise)
        print("a Python warning", file=sys.stderr)
    err = capfd.readouterr().err
    assert sorted(err.splitlines()) == ["E0000 a real error", "a Python warning"]  # sys.stderr may be captured apart


def test_search_progress_reports_every_key_and_changes_nothing() -> None:
    import cost_stub as stub

    import models
    from mistjax.hardware.presets import ClusterSpec
    from mistjax.tuning import SearchSpace, search

    w = stub.Workload.from_model(models.get_config("llama-tiny"), 32, 16)
    cl = ClusterSpec.preset("cpu", nodes=1, per_node=8)
    cl = cl.with_memory(1.2e6 / cl.device.usable_memory_fraction)
    calls: list[tuple[str, int, int]] = []
    quiet = search(w, cl, SearchSpace(), cost=stub.COST_MODEL)
    shown = search(w, cl, SearchSpace(), cost=stub.COST_MODEL, progress=lambda *a: calls.append(a))
    assert quiet.plan is not None and quiet.plan.to_json() == shown.plan.to_json()
    assert [c[1] for c in calls] == list(range(shown.keys + 1))  # 0, each key visited, all
    assert {(c[0], c[2]) for c in calls} == {(shown.space.name, shown.keys)}


@pytest.mark.slow  # about 35-60 s on two cores (tunes, traces and compiles a small Llama on 8 simulated devices)
def test_readme_snippet(tmp_path: Path) -> None:
    if _platform.nvidia_driver_present():
        pytest.skip("the README snippet is for CPUs (on a GPU machine it is run with JAX_PLATFORMS=cpu)")
    snippet = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert snippet is not None
    script = tmp_path / "snippet.py"
    script.write_text(snippet.group(1))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the snippet asks for its 8 devices itself
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in env.items() if k != "JAX_PLATFORMS"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_quiet(proc)
    assert "Plan:" in proc.stdout


def test_public_names_stay_functions_after_their_packages_load():
    """`mistjax.tune` and `mistjax.api.autoshard` are functions; no submodule of the same name may replace them
    when it is imported later (a package attribute is rebound to a submodule on its first import)."""
    import importlib

    import mistjax
    import mistjax.api

    importlib.import_module("mistjax.api.tuned_step")  # what autoshard without a plan imports on first use
    importlib.import_module("mistjax.tuning.space")
    from mistjax.api import autoshard

    assert callable(autoshard) and callable(mistjax.api.autoshard) and callable(mistjax.autoshard)
    assert callable(mistjax.tune) and mistjax.tune.__name__ == "tune"
