"""ZeRO-0 / ZeRO-1 (and MiCS hop 1) gradient sync inside the backward for G == 1
(`core.execution.StageExecution.synced`, Megatron-LM's ``--overlap-grad-reduce``): the numerics equal one
device's, and the compiled program issues the stacked layers' all-reduce / reduce-scatter inside the
backward layer loop's while body (once per layer), not after it. With G > 1 the sync stays at the end
of the step (peeling the last micro-batch cost memory: docs/cost_model.md). On XLA:CPU (synchronous
collectives) each layer's collective is issued in its own iteration; the deferred form XLA:GPU gets
(`core.execution.Capabilities.defers_row_sync`) is checked here too, forced, for its numerics and placement."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_accumulate import LAYER_GRAD_BYTES, L, init_params, loss_fn, make_batch, train_step

import mistjax
from mistjax.core import hlo
from mistjax.core.execution import Capabilities
from mistjax.plan import Plan, StagePlan
from mistjax.runtime import grads

# (ZeRO stage, G, MiCS partition group or 0): the collective that syncs the layers' gradients, its
# group size, and the per-device bytes it produces for the whole stack.
CASES = {
    "zero0-G1": (0, 1, 0, "all-reduce", 8, LAYER_GRAD_BYTES),
    "zero1-G1": (1, 1, 0, "reduce-scatter", 8, LAYER_GRAD_BYTES // 8),
    "mics-G1": (1, 1, 4, "reduce-scatter", 4, LAYER_GRAD_BYTES // 4),
    "zero1-G2": (1, 2, 0, "reduce-scatter", 8, LAYER_GRAD_BYTES // 8),  # G > 1: at the end of the step
}


def _plan(zero: int, G: int, group: int) -> Plan:
    return Plan(stages=(StagePlan((0, L), shard_opt=zero >= 1),), micro_batch=4 // G, grad_accum=G, dp=8,
                shard_group=group)


def _check(case: str, deferred: bool) -> None:
    """The step's loss and gradients equal one device's; where its layer collectives sit."""
    zero, G, group, op, size, layer_bytes = CASES[case]
    state, batch = {"params": init_params()}, make_batch()
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(state["params"], batch)
    step = mistjax.autoshard(train_step, jax.devices(), plan=_plan(zero, G, group))
    _, metrics = step(jax.tree.map(jnp.copy, state), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=2e-6)
    for g, r in zip(jax.tree.leaves(metrics["grads"]), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=2e-5 * float(jnp.max(jnp.abs(r))))

    colls = [c for c in hlo.collectives(step.lower(state, batch).compile().as_text())
             if c.op == op and c.group_size == size]
    in_loop = sum(c.result_bytes * c.trips for c in colls if c.trips > 1)
    after = sum(c.result_bytes for c in colls if c.trips == 1)
    if G > 1:  # once, after the micro-batch scan: the whole stack's and the embedding's / head's
        assert in_loop == 0 and after > layer_bytes, colls
        return
    # The backward layer loop (L trips) syncs one layer's rows per trip; what stays after it is the
    # embedding's and head's sync (and the loss), far less than a layer. Deferred, the first trip syncs
    # the zero seed (`accumulate.sync_deferred`) and the first layer's rows (still pending) come after.
    assert sum(c.result_bytes * c.trips for c in colls if c.trips == L) == layer_bytes, colls
    row = layer_bytes // L
    if deferred:
        assert row <= after < 1.5 * row, colls
    else:
        assert after < row, colls


@pytest.mark.parametrize("case", list(CASES))
def test_layer_grads_sync_inside_the_backward_loop(case):
    """XLA:CPU: not deferred (its collectives are synchronous), each layer synced in its own trip."""
    assert not grads.mesh_capabilities(jax.sharding.Mesh(np.array(jax.devices()), ("x",))).defers_row_sync
    _check(case, deferred=False)


@pytest.mark.parametrize("case", ["zero0-G1", "zero1-G1"])
def test_deferred_layer_sync_numerics_and_placement(case, monkeypatch):
    """The deferred sync (`accumulate.sync_deferred`, what a GPU mesh gets) forced on XLA:CPU: the same
    numerics, the first layer's rows synced after the loop."""
    monkeypatch.setattr(grads, "mesh_capabilities", lambda mesh, tp_overlap=False: Capabilities(True, tp_overlap))
    _check(case, deferred=True)
