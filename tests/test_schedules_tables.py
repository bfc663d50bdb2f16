"""Pipeline schedules as the cost model prices them (`mistjax.core.schedules`, `mistjax.core.pipeline_time`).

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
def test_bubble_fraction_is_the_textbook_one(num_stages, num_mb):
    """Textbook bubble (S-1)/(G+S-1) with equal F and B costs, for every schedule."""
    S, G = num_stages, num_mb
    for name in sch.SCHEDULE_NAMES:
        assert ptime.bubble_fraction(S, G, name) == pytest.approx((S - 1) / (G + S - 1))


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
