"""The verified tuner (`mistjax.validate.verified`) and the memory margin the budget keeps.

A fake compiler stands in for XLA:GPU here: it says each plan needs its predicted peak plus a fixed gap,
so the loop's decisions can be checked without compiling (the real compile of a pipelined plan is in
tests/test_gpu_aot.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import models
from mistjax.core.plan import guarded_peak
from mistjax.cost.predict import analyze
from mistjax.hardware import ClusterSpec
from mistjax.tuning import tune
from mistjax.validate.verified import tune_verified

CFG = models.get_config("gpt3-1.3b").replace(dtype="bfloat16")
WORKLOAD = models.workload(CFG, 2048, 32)
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class FakeReport:
    """A `Verification` whose per-stage peaks are given."""

    peak_per_stage: list[int]
    capacity: float
    budget: float
    cluster: str = "l4:1x2"
    device_kind: str = "NVIDIA L4"
    num_devices: int = 2
    compile_seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return max(self.peak_per_stage) <= self.capacity

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def fake_verify(gap: float, calls: list):
    def verify(config, seq, batch, plan, cluster):
        a = analyze(WORKLOAD, plan, cluster)
        calls.append(plan)
        peaks = [int(sum(m.values()) + gap) for m in a.stage_memory]
        return FakeReport(peaks, cluster.device.hbm_bytes, cluster.memory_budget())
    return verify


def search(cluster):
    # A generous limit: the search ends in about 10 s alone, but the suite runs files side by side.
    return tune(WORKLOAD, cluster, time_limit=300, baselines=()).plan


def test_a_plan_over_the_budget_is_retuned_with_the_measured_gap():
    cluster = ClusterSpec.parse("l4:1x2")
    calls = []
    v = tune_verified(CFG, WORKLOAD, cluster, search, verify=fake_verify(1.5 * GiB, calls))
    assert len(v.rounds) >= 2 and v.verified, v.summary()
    first, last = v.rounds[0], v.rounds[-1]
    assert first.overflow > 0 and last.overflow <= 0
    assert last.budget < max(first.predicted)  # the next search could not return the first plan again
    assert max(last.xla) <= cluster.memory_budget()
    assert "re-tuned" in v.summary() and len(calls) == len(v.rounds)


def test_a_plan_within_the_budget_is_kept_after_one_compile():
    cluster = ClusterSpec.parse("l4:1x2")
    calls = []
    v = tune_verified(CFG, WORKLOAD, cluster, search, verify=fake_verify(-2 * GiB, calls))
    assert len(v.rounds) == 1 and v.verified and len(calls) == 1
    assert "verified: XLA:GPU's peak is within the planning budget" in v.summary()


def test_the_memory_margin_holds_back_a_share_of_the_non_state_memory():
    memory = {"params": 4.0, "optimizer": 8.0, "grads": 2.0, "activations": 5.0, "buffers": 1.0}
    assert guarded_peak(memory, 0.0) == 20.0
    assert guarded_peak(memory, 0.1) == pytest.approx(20.0 + 0.1 * 8.0)
    arrays = {k: np.array([v, 2 * v]) for k, v in memory.items()}
    np.testing.assert_allclose(guarded_peak(arrays, 0.1), [20.8, 41.6])


def test_the_tuner_keeps_the_margin_free():
    """With a margin, the tuned plan's peak plus the margin on its non-state part is within the budget,
    and without one the plan uses more of it."""
    cluster = ClusterSpec.parse("l4:1x2")
    margin = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_margin=0.15))
    plain = search(cluster).prediction
    kept = search(margin).prediction
    budget = cluster.memory_budget()
    assert kept.guarded_peak(0.15) <= budget * (1 + 1e-9)
    assert plain.guarded_peak(0.15) > budget  # the unmargined plan would not have passed
    assert kept.peak_memory < plain.peak_memory


def test_with_budget_keeps_the_card_and_refuses_a_budget_above_it():
    cluster = ClusterSpec.parse("h100:1x8")
    lower = cluster.with_budget(60 * GiB)
    assert lower.memory_budget() == pytest.approx(60 * GiB) and lower.device.hbm_bytes == cluster.device.hbm_bytes
    with pytest.raises(ValueError, match="not within the card"):
        cluster.with_budget(100 * GiB)
