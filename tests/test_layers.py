"""The house rules: the import-linter contracts of pyproject.toml (layers, no back edges, no zoo imports)."""

from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_layer_contracts_hold(monkeypatch):
    monkeypatch.chdir(ROOT)  # the contracts live in pyproject.toml
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0
