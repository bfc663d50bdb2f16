"""mistjax.viz: plots of plans and predictions (PNG via matplotlib)."""

from mistjax.viz.plots import plot_memory, plot_pareto, plot_speedups, plot_timeline

__all__ = ["plot_memory", "plot_pareto", "plot_speedups", "plot_timeline"]
