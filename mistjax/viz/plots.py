"""Plots of plans and predictions (matplotlib, PNG files)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from mistjax.core.pipeline_order import Op, issue_order, op_costs, op_spans  # noqa: E402
from mistjax.core.schedules import stage_groups  # noqa: E402

MEMORY_COLOURS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
                  "buffers": "#8172b3"}
CHANNEL_COLOURS = {"compute": "#4c72b0", "d2d": "#8172b3", "h2d": "#55a868", "d2h": "#c44e52"}
GiB = 2.0**30


def plot_timeline(stage_fwd: Sequence[float], stage_bwd: Sequence[float], num_microbatches: int, path: str | Path, *,
                  schedule: str = "1f1b", first_extra: Sequence[float] | None = None,
                  last_extra: Sequence[float] | None = None,
                  channels: Sequence[Mapping[str, float]] | None = None, title: str | None = None,
                  groups: int | None = None, stage_wgrad: Sequence[float] | None = None) -> Path:
    """`timeline_figure` written to ``path`` (PNG)."""
    return _save(timeline_figure(stage_fwd, stage_bwd, num_microbatches, schedule=schedule, first_extra=first_extra,
                                 last_extra=last_extra, channels=channels, title=title, groups=groups,
                                 stage_wgrad=stage_wgrad), path)


def timeline_figure(stage_fwd: Sequence[float], stage_bwd: Sequence[float], num_microbatches: int, *,
                    schedule: str = "1f1b", first_extra: Sequence[float] | None = None,
                    last_extra: Sequence[float] | None = None,
                    channels: Sequence[Mapping[str, float]] | None = None, title: str | None = None,
                    groups: int | None = None, stage_wgrad: Sequence[float] | None = None) -> Figure:
    """The schedule as the MPMD executor runs it and the cost model prices it: the host's issue order
    (`core.pipeline_order.issue_order`), each device group starting an operation as soon as its inputs
    arrive, then its once-per-step work. One stage has no pipeline schedule: its micro-batches run forward then
    backward in turn (gradient accumulation), whatever ``schedule`` says, and the title says so.

    Args:
      schedule: the plan's pipeline schedule (`mistjax.core.schedules.SCHEDULE_NAMES`), named in the title.
      stage_fwd / stage_bwd: per (virtual) stage, seconds of one micro-batch's forward / backward.
      first_extra / last_extra: per stage, once-per-step seconds (gathers after the optimizer step, final
        gradient sync, update); drawn hatched after the group's last operation, where the executor runs them.
      channels: per stage, seconds per micro-batch on the device<->device (``d2d``), host->device
        (``h2d``) and device->host (``d2h``) channels, drawn as thin bars under each forward.
      title: the title's first part (default: "pipeline timeline", or "step timeline" for one stage).
      groups: device groups (default: one per stage; fewer with interleaved virtual stages).
      stage_wgrad: per stage, the weight-gradient part of the backward (a zero-bubble schedule's W).
    """
    S = len(stage_fwd)
    G = groups or S
    if S == 1:
        schedule = "1f1b"  # one stage, one program per micro-batch: forward and backward in turn
    f, b = np.asarray(stage_fwd, float), np.asarray(stage_bwd, float)
    extra = np.zeros(S)  # once-per-step seconds per stage
    for e in (first_extra, last_extra):
        if e is not None:
            extra += np.asarray(e, float)
    costs = op_costs(schedule, f, b, 0.0 if stage_wgrad is None else np.asarray(stage_wgrad, float))
    spans = op_spans(issue_order(schedule, G, num_microbatches, S // G), G, costs, schedule)
    placed = stage_groups(S, G, schedule)
    # Constrained layout keeps the legend, placed outside below the axes, clear of the x-axis label.
    fig, ax = plt.subplots(figsize=(11, 1.9 + 0.75 * G), dpi=120, layout="constrained")
    _draw_ops(ax, spans, f, costs["B"], placed, num_microbatches <= 16, channels)
    step = _draw_step_work(ax, spans, extra, placed, G)
    ax.set_yticks(range(G), [f"stage {g}" for g in range(G)] if G == S else [f"group {g}" for g in range(G)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (each device group runs its operations as soon as their inputs arrive)")
    ax.set_title(_timeline_title(title, schedule, S, G, num_microbatches, step))
    legend = [Patch(color="#4c72b0", label="forward"), Patch(color="#dd8452", label="backward"),
              *([Patch(color="#55a868", label="weight gradients (deferred)")] if "W" in costs else []),
              Patch(facecolor="white", edgecolor="black", hatch="//", label="once-per-step work")]
    if channels is not None:
        legend += [Patch(color=CHANNEL_COLOURS[c], label=n) for c, n in
                   (("d2d", "device<->device"), ("h2d", "host->device"), ("d2h", "device->host"))]
    fig.legend(handles=legend, loc="outside lower center", ncol=len(legend), fontsize=7, frameon=False)
    return fig


def _timeline_title(title: str | None, schedule: str, S: int, G: int, num_microbatches: int, step: float) -> str:
    if S == 1:
        return (f"{title or 'step timeline'} — one stage (no pipeline schedule): {num_microbatches} micro-batches "
                f"accumulated, step {step:.3g} s")
    chunks = f" ({S // G} chunks per group)" if S > G else ""
    return (f"{title or 'pipeline timeline'} — schedule {schedule}{chunks}, {num_microbatches} micro-batches, "
            f"step {step:.3g} s")


def _draw_ops(ax: Axes, spans: dict[Op, tuple[float, float]], f: np.ndarray, b: np.ndarray, placed: np.ndarray,
              labels: bool, channels: Sequence[Mapping[str, float]] | None) -> None:
    """One bar per operation on its device group's row (a fused FB as its forward then its backward), the
    micro-batch written on forwards when ``labels``, and each forward's channel times as thin bars under it."""
    colour = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
    for op, (start, end) in spans.items():
        row = placed[op.stage]
        parts = [("F", f[op.stage]), ("B", b[op.stage])] if op.kind == "FB" else [(op.kind, end - start)]
        for kind, dur in parts:
            ax.barh(row, dur, left=start, height=0.6, color=colour[kind], edgecolor="white", linewidth=0.4)
            if labels and kind == "F":
                ax.text(start + dur / 2, row, str(op.mb), ha="center", va="center", fontsize=6, color="white")
            if channels is not None and kind == "F":
                for j, ch in enumerate(("d2d", "h2d", "d2h")):
                    if channels[op.stage].get(ch, 0.0) > 0:
                        ax.barh(row + 0.36 + 0.09 * j, channels[op.stage][ch], left=start, height=0.08,
                                color=CHANNEL_COLOURS[ch])
            start += dur


def _draw_step_work(ax: Axes, spans: dict[Op, tuple[float, float]], extra: np.ndarray, placed: np.ndarray,
                    G: int) -> float:
    """Each group's once-per-step seconds (``extra`` per stage), hatched after its last operation; the step time."""
    finish = np.zeros(G)
    for op, (_, end) in spans.items():
        finish[placed[op.stage]] = max(finish[placed[op.stage]], end)
    delta = np.bincount(placed, weights=extra, minlength=G)
    for g in range(G):
        if delta[g] > 0:
            ax.barh(g, delta[g], left=finish[g], height=0.6, color="white", edgecolor="black", hatch="//",
                    linewidth=0.4)
    return float(np.max(finish + delta))


def plot_memory(stage_memory: Sequence[Mapping[str, float]], path: str | Path, *, limit: float | None = None,
                title: str = "memory per device, by stage") -> Path:
    """`memory_figure` written to ``path`` (PNG)."""
    return _save(memory_figure(stage_memory, limit=limit, title=title), path)


def memory_figure(stage_memory: Sequence[Mapping[str, float]], *, limit: float | None = None,
                  title: str = "memory per device, by stage") -> Figure:
    """Stacked bars of per-device bytes by category for each stage, with the memory limit as a line labelled
    inside the axes (the legend sits outside, to the right)."""
    cats = [c for c in MEMORY_COLOURS if any(m.get(c, 0) for m in stage_memory)]
    cats += sorted({c for m in stage_memory for c in m} - set(cats) - set(MEMORY_COLOURS))
    fig, ax = plt.subplots(figsize=(3.2 + 1.1 * len(stage_memory), 4), dpi=120, layout="constrained")
    x = np.arange(len(stage_memory))
    bottom = np.zeros(len(stage_memory))
    for c in cats:
        vals = np.array([m.get(c, 0.0) for m in stage_memory]) / GiB
        ax.bar(x, vals, bottom=bottom, color=MEMORY_COLOURS.get(c, "0.6"), label=c, width=0.6)
        bottom += vals
    top = bottom.max(initial=0.0)
    if limit:
        ax.axhline(limit / GiB, color="black", ls="--", lw=1)
        # x in axes fractions, y in GiB: the label stays inside the axes whatever the number of stages.
        ax.text(0.98, limit / GiB, f"limit {limit / GiB:.1f} GiB", va="bottom", ha="right", fontsize=8,
                transform=blended_transform_factory(ax.transAxes, ax.transData),
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})
        top = max(top, limit / GiB)
    ax.set_ylim(0, top * 1.12 or 1.0)
    ax.set_xticks(x, [f"stage {i}" for i in x])
    ax.set_ylabel("GiB per device")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return fig


def plot_pareto(stable: np.ndarray, delta: np.ndarray, path: str | Path, *, chosen: Sequence[int] = (),
                num_microbatches: int = 1, picked: tuple[float, float] | None = None, picked_by: str | None = None,
                title: str = "intra-stage strategies") -> Path:
    """`pareto_figure` written to ``path`` (PNG)."""
    return _save(pareto_figure(stable, delta, chosen=chosen, num_microbatches=num_microbatches, picked=picked,
                               picked_by=picked_by, title=title), path)


def pareto_figure(stable: np.ndarray, delta: np.ndarray, *, chosen: Sequence[int] = (), num_microbatches: int = 1,
                  picked: tuple[float, float] | None = None, picked_by: str | None = None,
                  title: str = "intra-stage strategies") -> Figure:
    """Strategies of one stage (stable vs delta / G), their frontier, sampled points and the plan's pick.

    Args:
      stable / delta: per strategy, seconds (delta is divided by `num_microbatches` for display).
      chosen: indices of the points sampled for the inter-stage MILP.
      picked: the (stable, delta) of the strategy the plan runs on this stage.
      picked_by: what chose it, for the legend ("chosen by ..."): e.g. "the inter-stage MILP" for a pipeline,
        "the one-stage search (no MILP)" for one stage. Default: just "chosen".
    """
    stable, delta = np.asarray(stable, float), np.asarray(delta, float) / num_microbatches
    ok = np.isfinite(stable) & np.isfinite(delta)
    fig, ax = plt.subplots(figsize=(5.5, 4), dpi=120, layout="constrained")
    ax.scatter(stable[ok], delta[ok], s=4, color="0.75", label="feasible strategies")
    order = np.argsort(stable[ok])
    front_s, front_d, best = [], [], np.inf
    for i in order:
        if delta[ok][i] < best:
            best = delta[ok][i]
            front_s.append(stable[ok][i])
            front_d.append(best)
    ax.step(front_s, front_d, where="post", color="#c44e52", lw=1.2, label="Pareto frontier")
    if len(chosen):
        idx = np.asarray([i for i in chosen if i >= 0])
        ax.scatter(stable[idx], delta[idx], s=28, color="#4c72b0", zorder=3, label="sampled for the MILP")
    if picked is not None:
        ax.scatter([picked[0]], [picked[1] / num_microbatches], marker="*", s=160, color="#dd8452", zorder=4,
                   label=f"chosen by {picked_by}" if picked_by else "chosen")
    ax.set_xlabel("stable time per micro-batch (s)")
    ax.set_ylabel(f"delta / G (s), G = {num_microbatches}")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return fig


def plot_speedups(labels: Sequence[str], speedups: Mapping[str, Sequence[float]], path: str | Path, *,
                  title: str = "predicted speedup over Megatron-LM") -> Path:
    """Grouped bars: for each grid cell (label), the speedup of each system over the reference."""
    names = list(speedups)
    x = np.arange(len(labels))
    w = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(labels) * max(len(names), 1) / 2 + 2), 4), dpi=120)
    for j, n in enumerate(names):
        ax.bar(x + (j - (len(names) - 1) / 2) * w, speedups[n], width=w, label=n)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speedup (x)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=min(len(names), 4))
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
