"""The house rules: the import-linter contracts of pyproject.toml (layers, no back edges, no zoo imports)."""

import os
import subprocess
import sys
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_layer_contracts_hold(monkeypatch):
    monkeypatch.chdir(ROOT)  # the contracts live in pyproject.toml
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0


def test_the_runtime_s_analysis_modules_do_not_import_sympy():
    """`import mistjax` (the runtime reads analysis.graph / layout / block / tp) leaves sympy unloaded; the
    symbolic modules load it on first use."""
    code = ("import sys, mistjax, mistjax.analysis.layout, mistjax.analysis.block, mistjax.analysis.tp; "
            "assert 'sympy' not in sys.modules, 'sympy loaded'; "
            "from mistjax.analysis import B, analyze_model; assert 'sympy' in sys.modules and str(B) == 'b'")
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
