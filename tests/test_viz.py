"""The plots render to PNG files."""

import numpy as np

from mistjax.viz import plot_memory, plot_pareto, plot_speedups, plot_timeline


def _is_png(path):
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plots_write_pngs(tmp_path):
    assert _is_png(plot_timeline([1.0, 1.5], [2.0, 3.0], 4, tmp_path / "t.png", first_extra=[0.5, 0.2],
                                 last_extra=[0.3, 0.9], channels=[{"d2d": 0.4, "h2d": 0.1}, {"d2h": 0.2}]))
    # ZB-H1: the weight-gradient passes drawn where the schedule defers them
    assert _is_png(plot_timeline([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], 6, tmp_path / "zb.png", schedule="zb-h1",
                                 stage_wgrad=[1.0, 1.0, 1.0]))
    assert _is_png(plot_memory([{"params": 1e9, "activations": 2e9}, {"params": 1e9, "grads": 5e8}],
                               tmp_path / "m.png", limit=4e9))
    rng = np.random.default_rng(0)
    assert _is_png(plot_pareto(rng.uniform(1, 2, 50), rng.uniform(0, 1, 50), tmp_path / "p.png", chosen=[0, 3]))
    assert _is_png(plot_speedups(["a", "b"], {"mistjax": [1.2, 1.4], "zero-3": [0.9, 1.0]}, tmp_path / "s.png"))
