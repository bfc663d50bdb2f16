"""Interleaved 1F1B in the tuner: the plan transform, the residuals each device group is charged for, and
the tuner adopting it only where `predict` prices it faster and it fits."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import numpy as np
import pytest

import models
from mistjax.core import pipeline_order as po
from mistjax.core.schedules import inflight_microbatches
from mistjax.cost import COST_MODEL, analyze
from mistjax.hardware import ClusterSpec
from mistjax.plan import Plan, PlanError, StagePlan, uniform_plan
from mistjax.runtime.mpmd_memory import residuals_beside
from mistjax.tuning.inter import tune_key
from mistjax.tuning.intra import ScheduleMemo, stage_inflight
from mistjax.tuning.space import OuterKey, SearchSpace
from mistjax.tuning.tuner import _reschedule, _SearchJob, build_plan


def test_interleaved_splits_each_group_into_chunks_in_layer_order():
    plan = Plan(stages=(StagePlan((0, 5), remat_layers=3, offload_acts=0.5, shard_weights=True, shard_grads=True),
                        StagePlan((5, 9), offload_opt=0.25)), grad_accum=4, dp=2)
    out = plan.interleaved(2)
    assert out.virtual_stages == 2 and out.device_stages == 2 and out.schedule == "1f1b"
    # virtual stage c * 2 + g is chunk c of group g: group 0's 5 layers as 3 + 2, group 1's 4 as 2 + 2
    assert [s.layers for s in out.stages] == [(0, 3), (3, 5), (5, 7), (7, 9)]
    assert [s.remat_layers for s in out.stages] == [2, 0, 1, 0]  # group 0's 3 checkpointed layers spread
    assert [s.offload_acts for s in out.stages] == [0.5, 0.0, 0.5, 0.0]
    assert [s.zero_stage for s in out.stages] == [3, 1, 3, 1]
    assert sum(s.num_layers for s in out.stages[0::2]) == 5 and out.num_layers == 9
    assert Plan.from_json(out.to_json()) == out
    with pytest.raises(PlanError, match="fewer than 5 layers"):
        plan.interleaved(5)
    with pytest.raises(PlanError, match="one-chunk 1f1b plan"):
        out.interleaved(2)


def held_along_the_ops(groups: int, micro: int, chunks: int) -> np.ndarray:
    """Per group, the most micro-batches' chunks held at once, walking each group's ops (an independent count)."""
    live, peak = {}, np.zeros(groups)
    for op in po.issue_order("1f1b", groups, micro, chunks):
        g = op.stage % groups
        if op.kind == po.OpKind.F:
            live[op.stage] = live.get(op.stage, 0) + 1
        elif op.kind == po.OpKind.B:
            live[op.stage] -= 1
        now = sum(n for k, n in live.items() if k % groups == g) + (op.kind == po.OpKind.FB)
        peak[g] = max(peak[g], now)
    return peak


@pytest.mark.parametrize("groups,micro,chunks", [(4, 8, 2), (8, 48, 2), (8, 48, 4), (3, 6, 3), (4, 8, 1)])
def test_group_in_flight_is_the_peak_of_the_groups_chunks(groups, micro, chunks):
    per_group = po.group_in_flight("1f1b", groups, micro, chunks)
    assert np.allclose(per_group * chunks, held_along_the_ops(groups, micro, chunks))
    # at most the sum of the chunks' own peaks (they need not coincide), equal with one chunk
    charged = po.charged_in_flight("1f1b", groups, micro, chunks)
    sums = charged.reshape(chunks, groups).sum(axis=0)
    assert np.all(per_group * chunks <= sums) and (chunks > 1 or np.array_equal(per_group, sums))
    # one chunk per group: the executor's classic 1F1B count
    one = np.maximum(inflight_microbatches(np.arange(groups), groups, micro), 1)
    assert chunks > 1 or np.array_equal(per_group, one)
    if chunks > 1:  # Megatron-LM's count on the first group: its warm-up forwards and one more, in chunks
        assert per_group[0] == pytest.approx((2 * (groups - 1) + (chunks - 1) * groups + 1) / chunks)
        assert np.all(per_group >= one)


def test_predict_charges_an_interleaved_group_its_chunks_peak():
    wl = models.workload(models.get_config("gpt3-7b"), 2048, 128)
    cluster = ClusterSpec.preset("a100-80gb", 4, 8)
    one = uniform_plan(32, 32, tp=2, micro_batch=2, stages=4, grad_accum=16, shard_opt=True)
    plan = one.interleaved(2)  # 8 layers per group, 4 per chunk: equal chunks but the first / last
    a, b = analyze(wl, plan, cluster), analyze(wl, one, cluster)
    per_mb = np.array([m["activations"] for m in b.stage_memory]) / po.group_in_flight("1f1b", 4, 16)
    acts = np.array([m["activations"] for m in a.stage_memory])
    # the middle groups hold 8 layers of plain residuals either way: peak of chunks held x one group's share
    expect = po.group_in_flight("1f1b", 4, 16, 2) * per_mb
    assert acts[1:3] == pytest.approx(expect[1:3], rel=1e-6)
    assert np.all(acts > np.array([m["activations"] for m in b.stage_memory]))


def test_an_interleaved_key_charges_each_slot_its_groups_peak():
    key = OuterKey(tp=1, stages=4, micro_batch=1, dp=1, grad_accum=8, nodes=1, per_node=1)
    slots = np.arange(4)
    assert np.array_equal(stage_inflight(slots, key, "1f1b"), inflight_microbatches(slots, 4, 8))
    interleaved = OuterKey(tp=1, stages=4, micro_batch=1, dp=1, grad_accum=8, nodes=1, per_node=1, chunks=2)
    assert np.allclose(stage_inflight(slots, interleaved, "1f1b"), held_along_the_ops(4, 8, 2) / 2)


@pytest.mark.parametrize("groups,micro,chunks", [(4, 8, 2), (2, 4, 2), (3, 6, 3), (4, 8, 1)])
def test_the_runtime_check_charges_what_predict_charges(groups, micro, chunks):
    """`runtime.mpmd_memory.residuals_beside` (the pre-step check, `--verify`): beside each F / B program its
    group holds what `group_residual_peaks` charges, less the program's own micro-batch where the program
    holds it itself; the last stage's fused program sees the other chunks' residuals at that moment."""
    sizes = np.arange(1, groups * chunks + 1) * 1000  # one micro-batch's residual bytes per virtual stage
    ex = SimpleNamespace(issue=po.issue_order("1f1b", groups, micro, chunks), S=groups, K=groups * chunks,
                         group=tuple(k % groups for k in range(groups * chunks)),
                         residual_bytes=lambda: [int(x) for x in sizes])
    beside = residuals_beside(ex)
    peaks = po.group_residual_peaks(ex.issue, groups, sizes)
    for g in range(groups):
        mine = range(g, groups * chunks, groups)
        # a forward's residuals are its outputs, a fused forward + backward's its temporaries: add them back
        held = [beside[(k, kind)] + sizes[k] for k in mine for kind in ("F", "FB") if (k, kind) in beside]
        assert max(held) == peaks[g]
    last = groups * chunks - 1
    assert beside[(last, "FB")] <= peaks[last % groups] - sizes[last]
    assert chunks > 1 or beside[(last, "FB")] == 0  # one chunk: nothing else is held beside it


def test_the_tuner_adopts_interleaving_where_faster_and_fitting():
    wl = models.workload(models.get_config("gpt3-7b"), 2048, 128)
    cluster = ClusterSpec.preset("a100-80gb", 4, 8)
    plan = uniform_plan(32, 32, tp=2, micro_batch=2, stages=4, grad_accum=16, shard_opt=True)
    plan = plan.replace(prediction=COST_MODEL.predict(wl, plan, cluster))
    space = SearchSpace(zero_bubble=False)
    out = _reschedule(_SearchJob(wl, cluster, COST_MODEL, space, ScheduleMemo(("1f1b",)), True), plan)
    assert out.virtual_stages in space.interleave and out.device_stages == 4
    assert out.prediction.step_time < plan.prediction.step_time
    assert out.prediction.guarded_peak(cluster.device.memory_margin) <= cluster.memory_budget()
    # the prediction it carries is predict's for the plan it is
    assert out.prediction.step_time == pytest.approx(COST_MODEL.predict(wl, out.replace(prediction=None),
                                                                        cluster).step_time)
    report = analyze(wl, out.replace(prediction=None), cluster)
    note = " ".join(report.notes)
    # Mist's formula prices the groups as one stage each (the one-chunk plan of the note), not the chunks
    one_chunk = float(re.search(r"against ([0-9.]+) s with each group's chunks", note).group(1))
    assert report.mist_step_time == pytest.approx(one_chunk, rel=0.02) and report.mist_step_time > report.step_time
    assert f"interleaved 1F1B ({out.virtual_stages} chunks per device group)" in note and "bubble" in note
    # the interleaved key searched as a key of its own holds the interleaved residuals and fits
    key = OuterKey(2, 4, 2, 4, 16, 1, 8, chunks=4)
    tables, choice = tune_key(wl, cluster, COST_MODEL, key, space, None, time.perf_counter() + 120)
    again = build_plan(tables, choice)
    assert again.virtual_stages == 4 and again.device_stages == 4 and again.grad_accum == plan.grad_accum
    pred = COST_MODEL.predict(wl, again, cluster)
    assert pred.guarded_peak(cluster.device.memory_margin) <= cluster.memory_budget() * 1.01
    assert pred.step_time == pytest.approx(choice.objective, rel=0.05)  # the key's objective prices it as it runs
    # interleaving starts from 1F1B only: a GPipe plan is left as it is (no error)
    gpipe = uniform_plan(32, 32, tp=2, micro_batch=2, stages=4, grad_accum=16, schedule="gpipe", shard_opt=True)
    gpipe = gpipe.replace(prediction=COST_MODEL.predict(wl, gpipe, cluster))
    kept = _reschedule(_SearchJob(wl, cluster, COST_MODEL, SearchSpace(zero_bubble=False, schedules=("1f1b", "gpipe")),
                                  ScheduleMemo(("1f1b", "gpipe")), True), gpipe)
    assert kept.virtual_stages == 1 and kept.schedule == "gpipe"
    # a space without it keeps the plan
    off = SearchSpace(zero_bubble=False, interleave=())
    assert _reschedule(_SearchJob(wl, cluster, COST_MODEL, off, ScheduleMemo(("1f1b",)), True), plan) is plan


def test_chunk_counts_below_two_or_not_integers_are_refused():
    for bad in ((1, 2), (2.0,), (True,)):
        with pytest.raises(ValueError, match="SearchSpace.interleave"):
            SearchSpace(interleave=bad)
    plan = uniform_plan(8, 2, stages=2, grad_accum=4, shard_opt=True)
    for bad in (1, 2.0):
        with pytest.raises(PlanError, match="integer >= 2"):
            plan.interleaved(bad)
    with pytest.raises(PlanError, match="one-chunk 1f1b plan"):
        plan.replace(schedule="gpipe").interleaved(2)
    assert SearchSpace.megatron().interleave == (2, 4) and SearchSpace.mist().interleave == ()


def test_megatron_interleaves_equal_chunks_only():
    """Megatron-LM's virtual stages hold the same layers each: its space interleaves a plan only where every
    stage's layers split evenly (6 layers: 2 chunks, not 4), where mistjax's splits within one layer."""
    wl = models.workload(models.get_config("gpt3-1.3b"), 2048, 64)
    cluster = ClusterSpec.preset("a100-80gb", 1, 8)
    plan = uniform_plan(24, 8, tp=2, micro_batch=2, stages=4, grad_accum=8, remat_layers=6,
                        shard_opt=True)  # 6 layers per stage
    plan = plan.replace(prediction=COST_MODEL.predict(wl, plan, cluster))

    def rescheduled(space: SearchSpace) -> Plan:
        job = _SearchJob(wl, cluster, COST_MODEL, space, ScheduleMemo(("1f1b",)), True)
        return _reschedule(job, plan)

    assert rescheduled(SearchSpace.megatron().replace(interleave=(4,))) is plan
    out = rescheduled(SearchSpace.megatron())
    assert out.virtual_stages == 2 and out.prediction.step_time < plan.prediction.step_time
    assert {st.num_layers for st in out.stages} == {3}
    assert rescheduled(SearchSpace(zero_bubble=False, interleave=(4,))).virtual_stages == 4


def test_a_device_group_of_chunks_sends_once_per_chunk():
    """The tuner's view of an interleaved key (`StageStrategies.chunks`): each chunk sends its activation forward
    and its cotangent back, so a group's micro-batch takes the extra chunks' sends, the time `predict` charges
    the same layers run as chunks of their own; one stage sends nothing."""
    from mistjax.core.strategies import StageStrategies
    from mistjax.cost.collectives import p2p_time

    wl = models.workload(models.get_config("gpt3-7b"), 2048, 128)
    cluster = ClusterSpec.preset("l4", 1, 8)
    common = dict(b=2, dp=2, layers=8, G=16, first=False, last=False, nodes=1, per_node=2)
    one, two, four = (COST_MODEL.stage_cost(wl, cluster, StageStrategies.make(stages=4, chunks=v, **common))
                      for v in (1, 2, 4))
    send = p2p_time(float(wl.compiled(2, 2048, 1)["block.output_bytes"]), cluster.p2p_link(False))
    assert send > 0
    assert float(two.stable - one.stable) == pytest.approx(2 * send, rel=1e-9)
    assert float(four.stable - one.stable) == pytest.approx(6 * send, rel=1e-9)
    alone = [COST_MODEL.stage_cost(wl, cluster, StageStrategies.make(stages=1, chunks=v, **common)).stable
             for v in (1, 4)]
    assert float(alone[0]) == float(alone[1])


@pytest.mark.parametrize("groups,micro,chunks", [(2, 3, 2), (4, 6, 2), (4, 7, 2), (3, 7, 3), (4, 9, 4), (8, 12, 2)])
def test_interleaved_orders_run_any_micro_batch_count_of_at_least_the_groups(groups, micro, chunks):
    """Where the groups do not divide the micro-batches, the order still runs every operation once, after what it
    reads, and its bubble is no larger than with the next multiple of the groups (nominal costs)."""
    issue = po.issue_order("1f1b", groups, micro, chunks)
    done: set = set()
    for op in issue:
        assert all(dep in done for dep in po.dependencies(op, groups * chunks)), op
        done.add(op)
    assert len(done) == len(issue) == micro * (2 * groups * chunks - 1)
    def bubble(g):
        return po.simulated_time(po.issue_order("1f1b", groups, g, chunks), groups) - 3 * chunks * g
    assert bubble(micro) <= bubble(-(-micro // groups) * groups) + 1e-9
    assert np.allclose(po.group_in_flight("1f1b", groups, micro, chunks) * chunks,
                       held_along_the_ops(groups, micro, chunks))


def test_megatrons_orders_are_kept_where_the_groups_divide_the_micro_batches():
    """Group 0 of 4 groups x 2 chunks at G 8 warms up with Megatron's count, (S - 1) * 2 + (v - 1) * S = 10."""
    first = po.device_orders("1f1b", 4, 8, 2)[0]
    assert [op.kind for op in first[:11]] == [po.OpKind.F] * 10 + [po.OpKind.F]
    assert first[11].kind == po.OpKind.B
    with pytest.raises(po.ScheduleError, match="at least 4"):
        po.issue_order("1f1b", 4, 3, 2)
