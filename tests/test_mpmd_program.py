"""The pipeline's shape (issue #53): one build step to a frozen `PipelineProgram`, an executor that runs its
`ExecutionPlan`'s issue order one handler per `OpKind`, local and remote stages as distinct types.

Numerics of every schedule against one device are tested in tests/test_pipeline_mpmd.py and
tests/test_zero_bubble.py; here, what the executor runs is what the program says.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from test_pipeline_mpmd import OPTIMIZERS, make_batch, make_state, make_step, plan_of

import mistjax
from mistjax.core.pipeline_order import OpKind, issue_order
from mistjax.plan import PlanError
from mistjax.runtime.pipeline_exec import HANDLERS, SPLIT_HANDLERS, Executor
from mistjax.runtime.pipeline_io import StageIO
from mistjax.runtime.pipeline_leaves import LocalStage, RemoteStage, StageGrid
from mistjax.runtime.pipeline_program import PipelineProgram


def test_every_op_kind_has_a_handler_on_whole_and_split_stages():
    assert set(HANDLERS) == set(SPLIT_HANDLERS) == set(OpKind)
    # A zero-bubble stage's B and fused FB are input-gradient passes; its W the deferred weight pass.
    assert SPLIT_HANDLERS[OpKind.B] is SPLIT_HANDLERS[OpKind.FB] is Executor.input_grad
    assert HANDLERS[OpKind.B] is Executor.backward and HANDLERS[OpKind.FB] is Executor.last


def test_a_remote_stage_dispatches_nothing_and_counts_nothing():
    plan = plan_of([{}, {}])
    grid = StageGrid.of(jax.devices(), plan)
    assert all(isinstance(s, LocalStage) for s in grid.stages)  # one process holds every device here
    remote = dataclasses.replace(grid, stages=(grid.stages[0], RemoteStage(*grid.stages[1])))
    io = StageIO(remote)

    def program(x):
        raise AssertionError("a remote stage's program ran")

    assert io.run("forward", 1, program, 1.0) is None
    assert io.run("forward", 0, lambda x: x + 1, 1.0) == 2.0
    assert io.stats.programs == 1 and io.stats.by_kind == {"forward": 1}
    # Neither side of a transfer between two remote stages moves anything.
    both = StageIO(dataclasses.replace(grid, stages=tuple(RemoteStage(*s) for s in grid.stages)))
    assert both.send([None], [jax.ShapeDtypeStruct((2,), jnp.float32)], [grid.replicated[1]], 0, 1) == [None]
    assert both.stats.transfers == 0


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_step_runs_the_programs_the_issue_order_names(schedule):
    tx = OPTIMIZERS["sgd"]()
    plan = plan_of([{}, {}], schedule=schedule)
    step = mistjax.autoshard(make_step(tx), jax.devices(), plan=plan)
    state, batch = make_state(tx), make_batch()
    ex = step._mpmd
    with pytest.raises(PlanError, match="built by the first"):
        _ = ex.program  # nothing is built before the first place / compile / call
    step(jax.tree.map(jnp.copy, state), batch)
    program = ex.program
    assert isinstance(program, PipelineProgram)
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.rounds = {}  # type: ignore[misc]
    assert list(program.execution.issue) == issue_order(schedule, 2, plan.grad_accum)
    kinds = collections.Counter(op.kind for op in program.execution.issue)
    G = plan.grad_accum
    if schedule == "zb-h1":
        assert set(program.split_programs) == {0, 1}
        # Stage 0's W runs its whole backward (it has no input gradient to send); stage 1's splits B and W.
        want = {"forward": kinds[OpKind.F], "last_input": kinds[OpKind.FB], "backward": G, "weight_grad": G}
    else:
        assert not program.split_programs
        want = {"forward": kinds[OpKind.F], "backward": kinds[OpKind.B], "last": kinds[OpKind.FB]}
    assert {k: v for k, v in ex.stats.by_kind.items() if k in want} == want
    assert ex.stats.by_kind["finish"] == 2
