"""The execution plan (`mistjax.core.execution`): one set of rules read by the runtime, the cost model and
the report.

The layer-scan rule is checked three ways against itself: the scans the runtime builds (`layer_scans`) cover
the stage's layers in order, with the unroll the cost model charges (`scan_unroll`) and as many compiled
bodies as it counts (`scan_bodies`); the in-loop sync rule is checked against its vectorised form; and the
report of a real step (one stage and pipelined) prints what the lowered plan decided.
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mistjax
from mistjax.core.execution import (
    Capabilities,
    StageLeaf,
    double_buffered,
    is_batch_leaf,
    layer_scans,
    lower_stage,
    rows_synced_in_loop,
    scan_bodies,
    scan_unroll,
)
from mistjax.core.layout import PARAM, LeafLayout
from mistjax.core.stages import OFFLOAD, layer_segments
from mistjax.plan import Plan, StagePlan


@pytest.mark.parametrize("double_buffer", [False, True])
def test_layer_scans_cover_the_layers_with_the_charged_unroll_and_bodies(double_buffer):
    for n, remat, off in itertools.product(range(1, 12), range(0, 6), range(0, 6)):
        scans = layer_scans(n, remat, off, double_buffer)
        assert [(s.start, s.end) for s in scans][0][0] == 0 and scans[-1].end == n
        assert all(a.end == b.start for a, b in zip(scans, scans[1:])), scans
        for start, end, kind in layer_segments(n, remat, off):
            mine = [s for s in scans if start <= s.start and s.end <= end]
            assert sum(s.num_layers for s in mine) == end - start
            assert all(s.kind == kind for s in mine)
            # the cost model's count of compiled layer bodies and its fetched-layers-live factor
            assert sum(s.unroll for s in mine) == int(scan_bodies(end - start, kind == OFFLOAD, double_buffer))
            assert max(s.unroll for s in mine) == int(scan_unroll(end - start, kind == OFFLOAD, double_buffer))
            # an unroll always divides its scan (else lax.scan concatenates a copy of the residual stacks)
            assert all(s.num_layers % s.unroll == 0 for s in mine)
    assert not any(s.unroll == 2 for s in layer_scans(9, 0, 9, True))  # offloading scans: one layer each
    assert [s.unroll for s in layer_scans(3, 0, 0, True)] == [1]  # a 3-layer split would leave a one-trip loop
    assert [(s.num_layers, s.unroll) for s in layer_scans(7, 0, 0, True)] == [(6, 2), (1, 1)]


def _facts(zero: int, n: int = 3, **kw) -> list[StageLeaf]:
    lay = LeafLayout(PARAM, (4, 8), None, (), 1, True, zero == 3)
    return [StageLeaf(lay, zero, loop_eligible=True, in_stack=True, **kw) for _ in range(n)]


def test_lower_stage_matches_the_vectorised_sync_rule():
    zeros, dps, groups, gs = [0, 1, 2, 3], [1, 2, 8], [1, 2, 8], [1, 4]
    for zero, dp, group, G, pipelined in itertools.product(zeros, dps, groups, gs, [False, True]):
        if group > dp:
            continue
        ex = lower_stage(_facts(zero), num_layers=4, remat_layers=0, offload_layers=0, grad_accum=G, dp=dp,
                         group=group, pipelined=pipelined, caps=Capabilities(True))
        expect = bool(rows_synced_in_loop(zero, dp, group, G, pipelined))
        assert (ex.synced == frozenset(range(3))) is expect, (zero, dp, group, G, pipelined)
        # accumulated in the loop with several micro-batches or on a pipeline stage, else only when synced
        assert ex.in_loop == (frozenset(range(3)) if G > 1 or pipelined or expect else frozenset())
        assert ex.defer_sync is expect  # asynchronous collectives: the synced rows go one layer late
    vec = rows_synced_in_loop(np.array([0, 1, 1, 2]), np.array([8, 8, 8, 8]), np.array([1, 2, 1, 2]), 1, False)
    np.testing.assert_array_equal(vec, [True, True, False, False])


def test_double_buffering_is_one_rule_for_the_runtime_and_the_cost_model():
    """`lower_stage` double-buffers exactly where `double_buffered` (the rule the cost model prices per strategy
    from the bytes it fetches per layer) says: asynchronous collectives and fetched stacked layer weights."""
    for async_, fetched, in_stack in itertools.product([False, True], repeat=3):
        lay = LeafLayout(PARAM, (4, 8), None, (), 1, True, fetched)
        leaves = [StageLeaf(lay, 3 if fetched else 1, loop_eligible=True, in_stack=in_stack)]
        ex = lower_stage(leaves, num_layers=6, remat_layers=0, offload_layers=0, grad_accum=1, dp=8, group=8,
                         pipelined=False, caps=Capabilities(async_))
        assert ex.double_buffer is bool(double_buffered(async_, fetched and in_stack)), (async_, fetched, in_stack)
        assert [s.unroll for s in ex.scans] == ([2] if ex.double_buffer else [1])
    np.testing.assert_array_equal(double_buffered(True, np.array([0.0, 3.0]) > 0), [False, True])
    np.testing.assert_array_equal(double_buffered(np.array([False, True]), True), [False, True])


def test_host_accumulators_and_fetches_follow_the_leaves():
    ex = lower_stage(_facts(3, host_accumulator=True), num_layers=5, remat_layers=0, offload_layers=0,
                     grad_accum=2, dp=8, group=8, pipelined=False, caps=Capabilities.of_platform("gpu"))
    assert ex.in_loop == frozenset() and ex.host_accumulators == frozenset(range(3))
    assert ex.fetched == frozenset(range(3)) and ex.double_buffer
    assert [s.unroll for s in ex.scans] == [2, 1]
    cpu = lower_stage(_facts(3), num_layers=5, remat_layers=0, offload_layers=0, grad_accum=2, dp=8, group=8,
                      pipelined=False, caps=Capabilities.of_platform("cpu"))
    assert not cpu.double_buffer and [s.unroll for s in cpu.scans] == [1]
    assert is_batch_leaf((16, 9), 16) and not is_batch_leaf((), 16) and not is_batch_leaf((9, 16), 16)


# ------------------------------------------------------------------------------------- the report reads it
V, D, L, B, T = 32, 8, 4, 16, 8
TX = optax.adamw(1e-2)


def _loss(params: dict, batch: dict) -> jax.Array:
    h = params["embed"][batch["inputs"]]
    h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w["w"]), None), h, params["layers"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["head"], batch["targets"]).mean()


def _train_step(state: dict, batch: dict):
    loss, grads = mistjax.value_and_grad(_loss)(state["params"], batch)
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}


def _state_and_batch() -> tuple[dict, dict]:
    k = jax.random.split(jax.random.key(0), 3)
    params = {"embed": jax.random.normal(k[0], (V, D)), "head": jax.random.normal(k[1], (D, V)),
              "layers": {"w": jax.random.normal(k[2], (L, D, D)) * 0.3}}
    tok = jax.random.randint(jax.random.key(1), (B, T + 1), 0, V)
    return {"params": params, "opt": TX.init(params)}, {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def _count(report: str, what: str) -> list[int]:
    return [int(m) for m in re.findall(rf"{what}: (\d+) lea(?:f|ves)", report)]


def test_report_prints_the_lowered_execution_of_each_stage():
    state, batch = _state_and_batch()
    one = mistjax.autoshard(_train_step, jax.devices(), plan=Plan(stages=(StagePlan((0, L), shard_weights=True,
                                                                                     shard_grads=True),),
                                                                  micro_batch=1, grad_accum=2, dp=8))
    one(state, batch)
    text = one.report()
    # ZeRO-3 fetches the stacked weight per layer (and embed / head where they are used); with two
    # micro-batches the stacked weight's gradient is added inside the backward loop; nothing is synced there.
    assert _count(text, "fetched per layer use") == [3], text
    assert _count(text, "gradients added inside the backward layer loop") == [1], text
    assert _count(text, "gradients synchronised per layer in the backward") == [0], text
    assert "double-buffered" not in text  # XLA:CPU runs its collectives in line

    piped = mistjax.autoshard(_train_step, jax.devices(), plan=Plan(
        stages=(StagePlan((0, 2)), StagePlan((2, L), remat_layers=1)), micro_batch=2, grad_accum=2, dp=4))
    piped(*_state_and_batch())
    text = piped.report()
    assert _count(text, "gradients added inside the backward layer loop") == [1, 1], text
    assert "layer scans (stage-local layers): plain 0-1" in text, text
    assert "layer scans (stage-local layers): plain 0-0, remat 1-1" in text, text


def test_the_step_exposes_its_execution_plan():
    """`step.execution`: one stage once its program is traced; a pipeline's per stage with the issue order the
    executor walks (every stage program of every micro-batch once)."""
    from mistjax.runtime.step import ShardedStep

    state, batch = _state_and_batch()
    one = ShardedStep(_train_step, jax.devices(), Plan(stages=(StagePlan((0, L)),), micro_batch=2, dp=8))
    assert one.execution is None
    one(state, batch)
    ex = one.execution
    assert len(ex.stages) == 1 and ex.batch_mask == (True, True) and not ex.issue
    assert not ex.capabilities.async_collectives
    assert ex.stages[0].synced  # ZeRO-1 over 8 devices, one micro-batch: the stacked rows sync in the loop

    piped = ShardedStep(_train_step, jax.devices(), Plan(stages=(StagePlan((0, 2)), StagePlan((2, L))),
                                                         micro_batch=2, grad_accum=2, dp=4))
    piped.place(*_state_and_batch())
    ex = piped.execution
    assert len(ex.stages) == 2 and all(not st.synced for st in ex.stages)  # pipeline stages sync in `finish`
    assert sorted((op.kind, op.stage, op.mb) for op in ex.issue) == sorted(
        [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1), ("FB", 1, 0), ("FB", 1, 1)])
    assert any(line.startswith("issue order: 6 stage programs") for line in ex.describe())
