"""The lock-step schedule tables the cost model prices (`mistjax.core.schedules`).

The MPMD executor's own per-group orders and issue order are tested in tests/test_pipeline_mpmd.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from mistjax.core import pipeline_time as ptime
from mistjax.core import schedules as sch

# ------------------------------------------------------------------------------------- schedule tables
SIZES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 4), (3, 5), (4, 2), (4, 4), (4, 8), (4, 16), (8, 8)]


@pytest.mark.parametrize("num_stages,num_mb", SIZES)
def test_schedule_tables(num_stages, num_mb):
    S, G = num_stages, num_mb
    for name in sch.SCHEDULE_NAMES:
        sched = sch.make_schedule(name, S, G)
        counts = sch.check_schedule(sched)  # every F and B once, dependencies respected
        if name == "1f1b":
            np.testing.assert_array_equal(counts, np.minimum(S - np.arange(S), G))
            sch.check_schedule(sched, sch.inflight_microbatches(np.arange(S), S, G))
            assert sched.num_ticks == 2 * (G + S - 1)
            assert ((sched.fwd >= 0) & (sched.bwd >= 0)).sum() == 0  # one op per stage per tick
            for s in range(S):  # warm-up S-s-1 forwards, then one more before the first backward
                first_b = int(np.nonzero(sched.bwd[:, s] >= 0)[0][0])
                assert (sched.fwd[:first_b, s] >= 0).sum() == min(S - s, G)
        elif name == "gpipe":
            np.testing.assert_array_equal(counts, np.full(S, G))
        else:
            np.testing.assert_array_equal(counts, np.minimum(2 * (S - np.arange(S)) - 1, G))
            assert sched.num_ticks == G + 2 * S - 2
        # Textbook bubble (S-1)/(G+S-1) with equal F and B costs, for every table.
        assert ptime.bubble_fraction(S, G, name) == pytest.approx((S - 1) / (G + S - 1))


def test_check_schedule_rejects_bad_tables():
    fwd, bwd = sch.one_f_one_b_schedule(3, 4)
    with pytest.raises(sch.ScheduleError, match="exactly once"):
        sch.check_schedule(sch.Schedule(np.where(fwd == 2, -1, fwd), bwd))
    swapped = fwd.copy()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]  # stage 1 runs before stage 0
    with pytest.raises(sch.ScheduleError, match="does not follow"):
        sch.check_schedule(sch.Schedule(swapped, bwd))
    with pytest.raises(sch.ScheduleError, match="holds"):
        sch.check_schedule(sch.gpipe_schedule(3, 4), sch.inflight_microbatches(np.arange(3), 3, 4))


def test_op_spans_run_each_group_in_issue_order_after_its_inputs():
    from mistjax.core.pipeline_order import dependencies, group_finish_times, issue_order, op_spans

    issue = issue_order("1f1b", 2, 4, 2)  # interleaved: 4 virtual stages on 2 groups
    cost = {"F": [1.0, 1.5, 1.2, 0.8], "B": [2.0, 3.0, 2.4, 1.6], "FB": [3.0, 4.5, 3.6, 2.4]}
    spans = op_spans(issue, 2, cost)
    assert set(spans) == set(issue)
    for g in range(2):
        mine = [spans[op] for op in issue if op.stage % 2 == g]
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:]))  # one at a time, in issue order
    for op, (start, end) in spans.items():
        assert end - start == pytest.approx(cost[op.kind][op.stage])
        assert all(spans[d][1] <= start + 1e-12 for d in dependencies(op, 4))
    np.testing.assert_allclose(group_finish_times(issue, 2, cost),
                               [max(e for op, (_, e) in spans.items() if op.stage % 2 == g) for g in range(2)])
