"""The plots render to PNG files, their legends cover no label, and their titles and legends say what the plan did."""

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.figure import Figure

from mistjax.viz import (
    memory_figure,
    pareto_figure,
    plot_memory,
    plot_pareto,
    plot_speedups,
    plot_timeline,
    timeline_figure,
)


def _is_png(path):
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def _layout_problems(fig: Figure) -> list[str]:
    """Every legend box that overlaps a text of the figure (axis labels, titles, tick labels, annotations) or
    leaves the figure, after drawing it as it is saved."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    texts = []
    for ax in fig.axes:
        texts += [("x-axis label", ax.xaxis.label), ("y-axis label", ax.yaxis.label), ("title", ax.title)]
        texts += [(f"text {t.get_text()!r}", t) for t in ax.texts]
        texts += [(f"tick {t.get_text()!r}", t) for t in ax.get_xticklabels() + ax.get_yticklabels()]
    problems = []
    for legend in legends:
        box = legend.get_window_extent(renderer)
        if not fig.bbox.contains(box.x0, box.y0) or not fig.bbox.contains(box.x1, box.y1):
            problems.append(f"legend {box} leaves the figure {fig.bbox}")
        for name, t in texts:
            if t.get_visible() and t.get_text() and box.overlaps(t.get_window_extent(renderer)):
                problems.append(f"legend covers the {name}")
    return problems


def _legend_labels(fig: Figure) -> list[str]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    return [t.get_text() for legend in legends for t in legend.get_texts()]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


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


def test_layout_check_finds_a_covered_label():
    """The check itself: the old timeline layout (a legend anchored just below a one-row axes) covers the label."""
    fig, ax = plt.subplots(figsize=(11, 1.85), dpi=120)
    ax.barh(0, 1.0, label="forward")
    ax.set_xlabel("seconds (each device group runs its operations as soon as their inputs arrive)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.4), ncol=3, fontsize=7, frameon=False)
    fig.tight_layout()
    assert "legend covers the x-axis label" in _layout_problems(fig)


@pytest.mark.parametrize("stages,groups,schedule", [(1, 1, "1f1b"), (2, 2, "1f1b"), (4, 4, "zb-h1"),
                                                     (4, 2, "zb-v"), (8, 4, "1f1b")])
def test_timeline_legend_clear_of_labels(stages, groups, schedule):
    fig = timeline_figure([0.04] * stages, [0.06] * stages, 8, schedule=schedule, groups=groups,
                          last_extra=[0.01] * stages, stage_wgrad=[0.02] * stages,
                          channels=[{"d2d": 0.01, "h2d": 0.01, "d2h": 0.01}] * stages)
    assert _layout_problems(fig) == []


def test_single_stage_timeline_names_no_pipeline_schedule():
    """One stage runs its micro-batches forward then backward in turn: the title names no pipeline schedule
    (it said `gpipe` for a plan that says 1f1b)."""
    for schedule in ("1f1b", "gpipe", "zb-h1"):
        title = timeline_figure([0.04], [0.06], 2, schedule=schedule).axes[0].get_title()
        assert "one stage (no pipeline schedule)" in title and "2 micro-batches" in title
        assert not any(name in title for name in ("gpipe", "1f1b", "zb-"))


@pytest.mark.parametrize("schedule,stages,groups", [("1f1b", 2, 2), ("gpipe", 3, 3), ("zb-h1", 2, 2),
                                                     ("zb-v", 4, 2), ("1f1b", 4, 2)])
def test_pipeline_timeline_title_names_the_plan_schedule(schedule, stages, groups):
    title = timeline_figure([0.04] * stages, [0.06] * stages, 4, schedule=schedule, groups=groups,
                            stage_wgrad=[0.02] * stages).axes[0].get_title()
    assert f"schedule {schedule}" in title
    assert ("chunks per group" in title) == (stages > groups)


@pytest.mark.parametrize("stages", [1, 2, 5])
def test_memory_legend_clear_of_the_limit_label(stages):
    fig = memory_figure([{"params": 3e9, "grads": 3e9, "optimizer": 6e9, "activations": 6e9, "buffers": 1e9}] * stages,
                        limit=19.8 * 2**30)
    limit_labels = [t for t in fig.axes[0].texts if t.get_text().startswith("limit ")]
    assert [t.get_text() for t in limit_labels] == ["limit 19.8 GiB"]
    assert _layout_problems(fig) == []
    # the label is inside the axes, beside its line
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box, axes_box = limit_labels[0].get_window_extent(renderer), fig.axes[0].get_window_extent(renderer)
    assert axes_box.x0 <= box.x0 and box.x1 <= axes_box.x1


def test_pareto_star_says_what_chose_it():
    rng = np.random.default_rng(0)
    stable, delta = rng.uniform(1, 2, 50), rng.uniform(0, 1, 50)
    one = pareto_figure(stable, delta, picked=(1.5, 0.5), picked_by="the one-stage search (no MILP)")
    assert "chosen by the one-stage search (no MILP)" in _legend_labels(one)
    assert not any("MILP" in t and "no MILP" not in t for t in _legend_labels(one))
    assert _layout_problems(one) == []
    milp = pareto_figure(stable, delta, chosen=[0, 3], picked=(1.5, 0.5), picked_by="the inter-stage MILP")
    assert "chosen by the inter-stage MILP" in _legend_labels(milp)
    plain = pareto_figure(stable, delta, picked=(1.5, 0.5))
    assert "chosen" in _legend_labels(plain) and not any("MILP" in t for t in _legend_labels(plain))
