"""A verified tuner: tune, compile the plan for the target GPU (deviceless XLA:GPU), re-tune on a misfit.

The cost model predicts each device group's peak; XLA:GPU's compile of the runtime's real program says
what the card will need. When XLA's largest peak is above the planning budget, the search runs again
with a budget below that plan's predicted peak by the measured gap (`mistjax.core.plan.lowered_budget`,
the rule autoshard's memory check re-tunes by), until a plan's compiled peak is within the budget or the
rounds run out. Every round is kept, so the report says what
was tried and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mistjax.core.plan import Plan, format_bytes, lowered_budget
from mistjax.cost.predict import Analysis, analyze
from mistjax.cost.workload import Workload
from mistjax.hardware.presets import ClusterSpec
from mistjax.validate.gpu_aot import Verification, group_peaks, verify_in_subprocess

if TYPE_CHECKING:
    from models.config import ModelConfig

TuneFn = Callable[[ClusterSpec], Plan]
# ``verify(config, seq_len, global_batch, plan, cluster)``: a deviceless compile (`verify_in_subprocess`).
VerifyFn = Callable[["ModelConfig", int, int, Plan, ClusterSpec], Verification]


@dataclass(frozen=True)
class VerifyRound:
    """One plan tuned under one budget and compiled for the GPU."""

    budget: float  # bytes per device the search was given
    plan: Plan
    predicted: tuple[float, ...]  # the cost model's peak per device group
    xla: tuple[float, ...]  # XLA:GPU's peak per device group (offloaded state on host)
    report: Verification

    @property
    def overflow(self) -> float:
        """Bytes XLA's largest peak is above the planning budget of the card (<= 0: within it)."""
        return max(self.xla) - self.report.budget


@dataclass(frozen=True)
class VerifiedPlan:
    """The outcome of `tune_verified`: the last plan tuned, and every round."""

    rounds: tuple[VerifyRound, ...]
    analysis: Analysis  # the last plan's prediction, on the cluster it was tuned for

    @property
    def plan(self) -> Plan:
        return self.rounds[-1].plan

    @property
    def verified(self) -> bool:
        """XLA:GPU's peak of the last plan is within the planning budget."""
        return self.rounds[-1].overflow <= 0

    def summary(self) -> str:
        """One line per round, then the verdict."""
        lines = []
        for i, r in enumerate(self.rounds):
            pred = max(r.predicted)
            lines.append(f"  round {i + 1}: budget {format_bytes(r.budget)}, predicted {format_bytes(pred)}, XLA:GPU "
                         f"{format_bytes(max(r.xla))} ({max(r.xla) / max(pred, 1.0) - 1:+.1%})"
                         + (f": {format_bytes(r.overflow)} over the planning budget" if r.overflow > 0 else ""))
        budget = format_bytes(self.rounds[0].report.budget)
        if self.verified and len(self.rounds) > 1:
            lines.append(f"  re-tuned {len(self.rounds) - 1} time(s) with the measured gap: the plan now fits the "
                         f"planning budget of {budget} by XLA:GPU")
        elif self.verified:
            lines.append(f"  verified: XLA:GPU's peak is within the planning budget of {budget}")
        else:
            lines.append(f"  NOT verified after {len(self.rounds)} round(s): XLA:GPU's peak stays above the planning "
                         f"budget of {budget}" + (" (but within the card)" if self.rounds[-1].report.fits else ""))
        return "\n".join(lines)


def tune_verified(config: ModelConfig, workload: Workload, cluster: ClusterSpec, tune_fn: TuneFn, *,
                  max_rounds: int = 3, verify: VerifyFn = verify_in_subprocess,
                  on_round: Callable[[VerifyRound], None] | None = None) -> VerifiedPlan:
    """Tune with ``tune_fn``, verify on XLA:GPU, and re-tune with the measured gap until the plan fits.

    Args:
      config: the `models.ModelConfig` compiled for the GPU (`mistjax.validate.gpu_aot.zoo_step`).
      workload: its cost-model `Workload` (sequence length, global batch).
      cluster: the cluster to plan for; its memory budget is the target XLA's peak must meet.
      tune_fn: ``tune_fn(cluster) -> Plan``: the search, run on copies of ``cluster`` with lower budgets.
      max_rounds: most plans tuned and compiled.
      verify: the compile (default: a fresh ``JAX_PLATFORMS=cpu`` process).
      on_round: called after each round (progress for a caller that prints).

    Raises:
      GpuAotUnavailable: the GPU compiler is not installed or the compile failed.
      Exception: whatever ``tune_fn`` raises in the first round (no plan at all); a lowered budget that
        leaves no plan ends the rounds instead (`VerifiedPlan.verified` is False).
    """
    target = cluster.memory_budget()
    current, rounds = cluster, []
    for _ in range(max_rounds):
        try:
            plan = tune_fn(current)
        except Exception:  # noqa: BLE001 - a lowered budget that leaves no plan: keep the rounds so far
            if not rounds:
                raise
            break
        analysis = analyze(workload, plan, current)
        predicted = tuple(float(sum(m.values())) for m in analysis.stage_memory)
        report = verify(config, workload.seq_len, workload.global_batch, plan, cluster)
        rounds.append(VerifyRound(current.memory_budget(), plan, predicted, group_peaks(report, len(predicted)),
                                  report))
        if on_round is not None:
            on_round(rounds[-1])
        if rounds[-1].overflow <= 0:
            break
        worst = int(np.argmax(rounds[-1].xla))  # the group furthest over the budget
        budget = lowered_budget(current.memory_budget(), predicted[worst], rounds[-1].xla[worst], target)
        if budget <= 0:
            break
        current = current.with_budget(budget)
    return VerifiedPlan(tuple(rounds), analysis)


__all__ = ["VerifiedPlan", "VerifyRound", "tune_verified"]
