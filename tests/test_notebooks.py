"""The notebooks run top to bottom (at small sizes) in a fresh kernel."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize("name", ["quickstart", "cost_model_accuracy",
                                  pytest.param("paper_reproduction", marks=pytest.mark.slow)])
def test_notebook_runs(name, tmp_path, monkeypatch):
    monkeypatch.setenv("MISTJAX_NOTEBOOK_SMALL", "1")
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert nb.cells[-1].get("outputs"), "the last cell printed or plotted nothing"
