"""Fit a device's time constants to measured training runs (``scripts/fit_presets.py``).

The few per-device constants the kernel pricing uses (`mistjax.cost.kernels`: ``matmul_efficiency``,
``matmul_k_half``, ``memory_efficiency``, ``kernel_overhead``) are fitted by least squares on
``ln(predicted / measured)`` over the runs of a published-runs file (`mistjax.validate.published`): one set
of constants for every run, no per-case factor. Each prediction is the cost model's own
(`mistjax.cost.predict.analyze` of the run's plan), without the optimizer step where the run's timing leaves
it out. The fit reports its residuals and a cross-validated error, the honest figure with more constants
than a handful of runs can pin down: each fold (`FOLDS`) is predicted by constants fitted without it, and
the spread of every constant over the folds says how well the runs pin it down. The default fold is a
*cell* (model, cluster, attention): a published Megatron-LM time is derived from the Mist time of its cell
(times the artifact's speedup), and the two runs of a cell share every workload property, so holding out a
single run while its partner stays in leaks the held-out answer into the fit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import date
from typing import Any, TypedDict, cast

import numpy as np

from mistjax.core.plan import Plan
from mistjax.cost.predict import analyze
from mistjax.cost.workload import Workload
from mistjax.hardware import ClusterSpec
from mistjax.validate.published import (
    PublishedRun,
    cell_key,
    cluster_for,
    excludes_optimizer,
    optimizer_seconds,
    run_workload,
    to_plan,
)

# Constant -> (lower, upper) bound; every one is fitted in log space.
BOUNDS: dict[str, tuple[float, float]] = {
    "matmul_efficiency": (0.05, 1.0),
    "matmul_k_half": (1.0, 4096.0),
    "memory_efficiency": (0.05, 1.0),
    "kernel_overhead": (1e-7, 1e-3),
}
FIELDS = tuple(BOUNDS)
# Cross-validation folds: what one fold holds out.
FOLDS: dict[str, Callable[[PublishedRun], Hashable]] = {
    "run": lambda r: r.id,
    "cell": cell_key,
    "model": lambda r: r.model.preset or (r.model.family, r.model.hidden, r.model.layers),
    "source": lambda r: source_key(r),
}


def source_key(run: PublishedRun) -> str:
    """The independent source a run comes from: its ``source.source_id`` where the file names one, else the
    repository or paper its ``source`` cites, else its id (a source of its own)."""
    src = run.source if isinstance(run.source, dict) else {}
    for field in ("source_id", "repo", "paper", "url"):
        if isinstance(src.get(field), str) and src[field]:
            return str(src[field])
    return run.id


@dataclass(frozen=True)
class Case:
    """One run prepared for fitting: its workload, plan and cluster are built once."""

    run: PublishedRun  # the record
    workload: Workload  # of the run's model (attention as the run ran it)
    plan: Plan  # the equivalent plan
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
        out.append(Case(r, run_workload(r), to_plan(r), cluster_for(r), excludes_optimizer(r),
                        float(r.measured.iter_time_s)))
    return out


def with_constants(cluster: ClusterSpec, values: dict[str, float]) -> ClusterSpec:
    """``cluster`` whose device has ``values`` for the fitted constants."""
    return replace(cluster, device=replace(cluster.device, **cast(dict[str, Any], values)))


def predicted(case: Case, values: dict[str, float]) -> float:
    """Predicted seconds of what the case's run timed, with the device constants ``values``."""
    cluster = with_constants(case.cluster, values)
    step = analyze(case.workload, case.plan, cluster).step_time  # the plan's tp_overlap is the run's (`to_plan`)
    if case.untimed_optimizer:
        step -= optimizer_seconds(case.workload, case.plan, cluster)
    return step


def log_errors(cases: Sequence[Case], values: dict[str, float]) -> np.ndarray:
    """``ln(predicted / measured)`` per case."""
    return np.array([math.log(predicted(c, values) / c.measured) for c in cases])


class FitSummary(TypedDict):
    """`Fit.summary`: residual statistics (`Fit._stats`; None where not computed)."""

    n: int  # runs fitted
    folds: str  # what one cross-validation fold holds out
    n_folds: int
    before: dict[str, float] | None  # with the preset's constants
    fitted: dict[str, float] | None  # with the fitted constants, in sample
    leave_one_out: dict[str, float] | None  # each fold with constants fitted without it
    constants_over_folds: dict[str, dict[str, float]] | None  # `Fit.spread`


@dataclass(frozen=True)
class Fit:
    """Constants fitted to a set of runs, with their residuals and leave-one-out errors."""

    values: dict[str, float]  # the fitted constants
    start: dict[str, float]  # the constants the fit started from (the preset's)
    ids: tuple[str, ...]  # the runs fitted, in order
    log_errors: tuple[float, ...]  # ln(pred / measured) per run with `values`
    loo_log_errors: tuple[float, ...] | None  # per run, with constants fitted without its fold (None: not computed)
    start_log_errors: tuple[float, ...]  # per run with `start`
    folds: str = "cell"  # what one cross-validation fold holds out (a key of `FOLDS`)
    fold_of: tuple[int, ...] = ()  # per run, the index of its fold
    fold_values: tuple[dict[str, float], ...] = ()  # per fold, the constants fitted without it

    @staticmethod
    def _stats(errs: Sequence[float] | None) -> dict[str, float] | None:
        """Median / max |ln| over the finite errors (a NaN: a run its fold could not cross-validate)."""
        errs = [e for e in errs or () if not math.isnan(e)]
        if not errs:
            return None
        a = [abs(e) for e in errs]
        return {
            "n": len(a),
            "median_abs_log_ratio": statistics.median(a),
            "max_abs_log_ratio": max(a),
            "median_abs_rel_err": statistics.median(abs(math.exp(e) - 1) for e in errs),
        }

    def spread(self) -> dict[str, dict[str, float]] | None:
        """Per constant, its min / median / max over the cross-validation folds (None: not computed)."""
        if not self.fold_values:
            return None
        out = {}
        for k in self.values:
            xs = [v[k] for v in self.fold_values]
            out[k] = {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}
        return out

    def summary(self) -> FitSummary:
        """Residual statistics: before (preset constants), fitted (in sample), leave-one-out (out of sample)."""
        return FitSummary(
            n=len(self.ids),
            folds=self.folds,
            n_folds=len(self.fold_values),
            before=self._stats(self.start_log_errors),
            fitted=self._stats(self.log_errors),
            leave_one_out=self._stats(self.loo_log_errors),
            constants_over_folds=self.spread(),
        )

    def improves(self) -> bool:
        """Every run is cross-validated and the out-of-sample error beats the starting constants' (median and max
        |ln(pred/meas)|): the test a fit passes before it replaces a preset's constants (``--write``)."""
        s = self.summary()
        loo, before = s["leave_one_out"], s["before"]
        if loo is None or before is None or loo["n"] < s["n"]:  # every run must be predicted out of sample
            return False
        return (loo["median_abs_log_ratio"] < before["median_abs_log_ratio"]
                and loo["max_abs_log_ratio"] <= before["max_abs_log_ratio"])


def _solve(cases: Sequence[Case], fields: Sequence[str], x0: dict[str, float], max_nfev: int) -> dict[str, float]:
    from scipy.optimize import least_squares

    lo = np.log([BOUNDS[f][0] for f in fields])
    hi = np.log([BOUNDS[f][1] for f in fields])
    start = np.clip(np.log([x0[f] for f in fields]), lo + 1e-9, hi - 1e-9)

    def resid(z: np.ndarray) -> np.ndarray:
        return log_errors(cases, dict(zip(fields, np.exp(z).tolist())))

    sol = least_squares(resid, start, bounds=(lo, hi), x_scale=1.0, diff_step=1e-3, max_nfev=max_nfev)
    return dict(zip(fields, np.exp(sol.x).tolist()))


def fold_index(cases: Sequence[Case], folds: str) -> tuple[int, ...]:
    """Per case, the index of its cross-validation fold (`FOLDS`; folds numbered in order of appearance).

    Raises:
      ValueError: ``folds`` is not a key of `FOLDS`.
    """
    if folds not in FOLDS:
        raise ValueError(f"unknown folds {folds!r}; one of {', '.join(FOLDS)}")
    keys: dict[Hashable, int] = {}
    return tuple(keys.setdefault(FOLDS[folds](c.run), len(keys)) for c in cases)


def cross_validate(
    cases: Sequence[Case],
    fields: Sequence[str],
    fold_of: Sequence[int],
    x0: dict[str, float],
    max_nfev: int,
    log: Callable[[str], None] | None = None,
) -> tuple[list[float], list[dict[str, float]]]:
    """Refit once per fold without it, starting from ``x0`` (the preset's constants, never the fit that saw the
    fold), and predict its runs: ``(ln(pred / measured) per case, constants per fold)``.

    A fold whose removal leaves no more runs than constants cannot be refitted: its runs' errors are NaN (not
    cross-validated; `Fit.summary` counts them) and no constants are recorded for it.
    """
    errs = [math.nan] * len(cases)
    per_fold = []
    for f in range(max(fold_of) + 1):
        held = [i for i, g in enumerate(fold_of) if g == f]
        rest = [c for i, c in enumerate(cases) if fold_of[i] != f]
        if len(rest) <= len(fields):
            if log:
                log(f"  fold {f + 1}/{max(fold_of) + 1}: {len(rest)} runs left for {len(fields)} constants, "
                    "not refitted")
            continue
        v = _solve(rest, fields, x0, max_nfev)
        per_fold.append(v)
        for i, e in zip(held, log_errors([cases[i] for i in held], v)):
            errs[i] = float(e)
        if log:
            log(f"  fold {f + 1}/{max(fold_of) + 1} ({', '.join(cases[i].run.id for i in held)}): "
                + ", ".join(f"{errs[i]:+.3f}" for i in held))
    return errs, per_fold


def fit(
    cases: Sequence[Case],
    fields: Sequence[str] = FIELDS,
    *,
    loo: bool = True,
    folds: str = "cell",
    max_nfev: int = 60,
    log: Callable[[str], None] | None = None,
) -> Fit:
    """Least-squares fit of ``fields`` of the cases' device to their measured times (see module docstring).

    Args:
      cases: from `prepare`; all on devices with the same constants (one preset).
      fields: constants to fit (keys of `BOUNDS`); the others keep the preset's values.
      loo: also cross-validate: refit once per fold without it and predict its runs (`cross_validate`).
      folds: what a fold holds out (`FOLDS`): ``"cell"`` (default; see the module docstring), ``"run"`` or
        ``"model"``.
      max_nfev: residual evaluations per fit (half of them, at least 10, per fold's refit).
      log: progress callback.
    Raises:
      ValueError: no cases, an unknown field or fold, or cases on different devices.
    """
    if not cases:
        raise ValueError("no runs with a measured step time to fit")
    unknown = [f for f in fields if f not in BOUNDS]
    if unknown:
        raise ValueError(f"cannot fit {unknown}; fittable constants: {', '.join(BOUNDS)}")
    fold_of = fold_index(cases, folds)
    devices = {c.cluster.device.name for c in cases}
    if len(devices) > 1:
        raise ValueError(f"the runs are on different devices ({', '.join(sorted(devices))}); fit one preset at a time")
    dev = cases[0].cluster.device
    start = {f: float(getattr(dev, f)) for f in fields}
    values = _solve(cases, fields, start, max_nfev)
    loo_errs: list[float] | None = None
    per_fold: list[dict[str, float]] = []
    if loo and len(cases) > len(fields) and max(fold_of) > 0:
        loo_errs, per_fold = cross_validate(cases, fields, fold_of, start, max(max_nfev // 2, 10), log)
    return Fit(
        values=values,
        start=start,
        ids=tuple(c.run.id for c in cases),
        log_errors=tuple(map(float, log_errors(cases, values))),
        loo_log_errors=None if loo_errs is None else tuple(loo_errs),
        start_log_errors=tuple(map(float, log_errors(cases, start))),
        folds=folds,
        fold_of=fold_of,
        fold_values=tuple(per_fold),
    )


def fitted_source(result: Fit, data: str, subset: str) -> str:
    """The provenance sentence appended to a preset's ``device.source``: the file, the number of runs, the
    date and the script, the fitted constants with the values they replace, and the residuals."""
    s = result.summary()
    loo, before, fitted = s["leave_one_out"], s["before"], s["fitted"]
    assert before is not None and fitted is not None  # a fit has runs (`fit` refuses none)
    tail = (f", leave-one-{result.folds}-out {loo['median_abs_log_ratio']:.3f} / {loo['max_abs_log_ratio']:.3f}"
            if loo else "")
    names = ", ".join(f"{k} {v:.4g} (was {result.start[k]:.4g})" for k, v in result.values.items())
    return (
        f"fitted to {data}, {s['n']} runs ({subset}), {date.today().isoformat()}, by scripts/fit_presets.py: "
        f"{names}; median / max |ln(pred/meas)| before {before['median_abs_log_ratio']:.3f} / "
        f"{before['max_abs_log_ratio']:.3f}, fitted {fitted['median_abs_log_ratio']:.3f} / "
        f"{fitted['max_abs_log_ratio']:.3f}{tail}"
    )


def update_preset_document(doc: Mapping[str, object], result: Fit, source: str) -> dict[str, object]:
    """A preset document with the fitted constants and the provenance sentence in ``device.source``."""
    out = dict(doc)
    dev = dict(cast(Mapping[str, object], out["device"]))
    for k, v in result.values.items():
        dev[k] = float(f"{v:.4g}")
    old = str(dev.get("source", ""))
    kept = old.split(" | fitted to ")[0]  # a previous fit's sentence is replaced, not appended to
    dev["source"] = f"{kept} | {source}" if kept else source
    out["device"] = dev
    return out


__all__ = [
    "BOUNDS",
    "FIELDS",
    "FOLDS",
    "Case",
    "Fit",
    "FitSummary",
    "cross_validate",
    "fit",
    "fold_index",
    "fitted_source",
    "log_errors",
    "predicted",
    "prepare",
    "update_preset_document",
    "with_constants",
]
