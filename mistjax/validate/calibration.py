"""Fit a device's time constants to measured training runs (``scripts/fit_presets.py``).

The few per-device constants the kernel pricing uses (`mistjax.cost.kernels`: ``matmul_efficiency``,
``matmul_k_half``, ``memory_efficiency``, ``kernel_overhead``) are fitted by least squares on
``ln(predicted / measured)`` over the runs of a published-runs file (`mistjax.validate.published`): one set
of constants for every run, no per-case factor. Each prediction is the cost model's own
(`mistjax.cost.predict.analyze` of the run's plan), without the optimizer step where the run's timing leaves
it out. The fit reports its residuals and a leave-one-out error (each run predicted by constants fitted
without it), the honest figure with more constants than a handful of runs can pin down.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import date
from typing import Any

import numpy as np

from mistjax.cost.predict import analyze
from mistjax.hardware import ClusterSpec
from mistjax.validate.published import (
    PublishedRun,
    cluster_for,
    excludes_optimizer,
    optimizer_seconds,
    to_plan,
    zoo_workload,
)
from mistjax.validate.published_format import model_config

# Constant -> (lower, upper) bound; every one is fitted in log space.
BOUNDS: dict[str, tuple[float, float]] = {
    "matmul_efficiency": (0.05, 1.0),
    "matmul_k_half": (1.0, 4096.0),
    "memory_efficiency": (0.05, 1.0),
    "kernel_overhead": (1e-7, 1e-3),
}
FIELDS = tuple(BOUNDS)


@dataclass(frozen=True)
class Case:
    """One run prepared for fitting: its workload, plan and cluster are built once."""

    run: PublishedRun  # the record
    workload: Any  # `mistjax.cost.Workload` of the run's model (attention as the run ran it)
    plan: Any  # the equivalent `Plan`
    cluster: ClusterSpec  # the run's cluster with the preset's constants
    untimed_optimizer: bool  # the run's time leaves the optimizer step out
    measured: float  # measured seconds per step

    @property
    def single_stage(self) -> bool:
        return self.plan.num_stages == 1


def prepare(runs: Sequence[PublishedRun]) -> list[Case]:
    """`Case`s of the runs that completed (the ones with a measured time)."""
    out = []
    for r in runs:
        if r.measured.iter_time_s is None:
            continue
        plan = to_plan(r)
        config = model_config(r.model, r.dtype).replace(attention="fused" if r.flash_attention else "xla")
        policies = None if any(s.offload_acts > 0 for s in plan.stages) else ("full",)
        wl = zoo_workload(config, r.model.seq_len, r.global_batch, policies)
        out.append(Case(r, wl, plan, cluster_for(r), excludes_optimizer(r), float(r.measured.iter_time_s)))
    return out


def with_constants(cluster: ClusterSpec, values: dict[str, float]) -> ClusterSpec:
    """``cluster`` whose device has ``values`` for the fitted constants."""
    return replace(cluster, device=replace(cluster.device, **values))


def predicted(case: Case, values: dict[str, float]) -> float:
    """Predicted seconds of what the case's run timed, with the device constants ``values``."""
    cluster = with_constants(case.cluster, values)
    step = analyze(case.workload, case.plan, cluster).step_time
    if case.untimed_optimizer:
        step -= optimizer_seconds(case.workload, case.plan, cluster)
    return step


def log_errors(cases: Sequence[Case], values: dict[str, float]) -> np.ndarray:
    """``ln(predicted / measured)`` per case."""
    return np.array([math.log(predicted(c, values) / c.measured) for c in cases])


@dataclass(frozen=True)
class Fit:
    """Constants fitted to a set of runs, with their residuals and leave-one-out errors."""

    values: dict[str, float]  # the fitted constants
    start: dict[str, float]  # the constants the fit started from (the preset's)
    ids: tuple[str, ...]  # the runs fitted, in order
    log_errors: tuple[float, ...]  # ln(pred / measured) per run with `values`
    loo_log_errors: tuple[float, ...] | None  # per run, with constants fitted without it (None: not computed)
    start_log_errors: tuple[float, ...]  # per run with `start`

    @staticmethod
    def _stats(errs: Sequence[float] | None) -> dict[str, float] | None:
        if not errs:
            return None
        a = [abs(e) for e in errs]
        return {
            "median_abs_log_ratio": statistics.median(a),
            "max_abs_log_ratio": max(a),
            "median_abs_rel_err": statistics.median(abs(math.exp(e) - 1) for e in errs),
        }

    def summary(self) -> dict[str, Any]:
        """Residual statistics: before (preset constants), fitted, leave-one-out."""
        return {
            "n": len(self.ids),
            "before": self._stats(self.start_log_errors),
            "fitted": self._stats(self.log_errors),
            "leave_one_out": self._stats(self.loo_log_errors),
        }


def _solve(cases: Sequence[Case], fields: Sequence[str], x0: dict[str, float], max_nfev: int) -> dict[str, float]:
    from scipy.optimize import least_squares

    lo = np.log([BOUNDS[f][0] for f in fields])
    hi = np.log([BOUNDS[f][1] for f in fields])
    start = np.clip(np.log([x0[f] for f in fields]), lo + 1e-9, hi - 1e-9)

    def resid(z: np.ndarray) -> np.ndarray:
        return log_errors(cases, dict(zip(fields, np.exp(z).tolist())))

    sol = least_squares(resid, start, bounds=(lo, hi), x_scale=1.0, diff_step=1e-3, max_nfev=max_nfev)
    return dict(zip(fields, np.exp(sol.x).tolist()))


def fit(
    cases: Sequence[Case],
    fields: Sequence[str] = FIELDS,
    *,
    loo: bool = True,
    max_nfev: int = 60,
    log: Callable[[str], None] | None = None,
) -> Fit:
    """Least-squares fit of ``fields`` of the cases' device to their measured times (see module docstring).

    Args:
      cases: from `prepare`; all on devices with the same constants (one preset).
      fields: constants to fit (keys of `BOUNDS`); the others keep the preset's values.
      loo: also refit once per case without it and predict it (leave-one-out).
      max_nfev: residual evaluations per fit.
      log: progress callback.
    Raises:
      ValueError: no cases, an unknown field, or cases on different devices.
    """
    if not cases:
        raise ValueError("no runs with a measured step time to fit")
    unknown = [f for f in fields if f not in BOUNDS]
    if unknown:
        raise ValueError(f"cannot fit {unknown}; fittable constants: {', '.join(BOUNDS)}")
    devices = {c.cluster.device.name for c in cases}
    if len(devices) > 1:
        raise ValueError(f"the runs are on different devices ({', '.join(sorted(devices))}); fit one preset at a time")
    dev = cases[0].cluster.device
    start = {f: float(getattr(dev, f)) for f in fields}
    values = _solve(cases, fields, start, max_nfev)
    loo_errs = None
    if loo and len(cases) > len(fields):
        loo_errs = []
        for i, c in enumerate(cases):
            rest = [x for j, x in enumerate(cases) if j != i]
            v = _solve(rest, fields, values, max(max_nfev // 2, 10))
            loo_errs.append(float(log_errors([c], v)[0]))
            if log:
                log(f"  leave-one-out {i + 1}/{len(cases)} {c.run.id}: {loo_errs[-1]:+.3f}")
    return Fit(
        values=values,
        start=start,
        ids=tuple(c.run.id for c in cases),
        log_errors=tuple(map(float, log_errors(cases, values))),
        loo_log_errors=None if loo_errs is None else tuple(loo_errs),
        start_log_errors=tuple(map(float, log_errors(cases, start))),
    )


def fitted_source(result: Fit, data: str, subset: str) -> str:
    """The provenance sentence appended to a preset's ``device.source``."""
    s = result.summary()
    loo = s["leave_one_out"]
    tail = f", leave-one-out {loo['median_abs_log_ratio']:.3f} / {loo['max_abs_log_ratio']:.3f}" if loo else ""
    names = ", ".join(f"{k} {v:.4g}" for k, v in result.values.items())
    return (
        f"fitted to {data} ({s['n']} runs, {subset}) by scripts/fit_presets.py on {date.today().isoformat()}: "
        f"{names}; median / max |ln(pred/meas)| {s['fitted']['median_abs_log_ratio']:.3f} / "
        f"{s['fitted']['max_abs_log_ratio']:.3f}{tail}"
    )


def update_preset_document(doc: dict[str, Any], result: Fit, source: str) -> dict[str, Any]:
    """A preset document with the fitted constants and the provenance sentence in ``device.source``."""
    out = dict(doc)
    dev = dict(out["device"])
    for k, v in result.values.items():
        dev[k] = float(f"{v:.4g}")
    old = dev.get("source", "")
    kept = old.split(" | fitted to ")[0]  # a previous fit's sentence is replaced, not appended to
    dev["source"] = f"{kept} | {source}" if kept else source
    out["device"] = dev
    return out


__all__ = [
    "BOUNDS",
    "FIELDS",
    "Case",
    "Fit",
    "fit",
    "fitted_source",
    "log_errors",
    "predicted",
    "prepare",
    "update_preset_document",
    "with_constants",
]
