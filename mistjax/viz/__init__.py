"""mistjax.viz: plots of plans and predictions (PNG via matplotlib). Each ``plot_*`` writes a PNG; the
``*_figure`` functions return the matplotlib figure (for notebooks, and for tests that read its layout)."""

from mistjax.viz.plots import (
    memory_figure,
    pareto_figure,
    plot_memory,
    plot_pareto,
    plot_speedups,
    plot_timeline,
    timeline_figure,
)

__all__ = ["memory_figure", "pareto_figure", "plot_memory", "plot_pareto", "plot_speedups", "plot_timeline",
           "timeline_figure"]
