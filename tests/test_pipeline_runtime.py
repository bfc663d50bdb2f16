"""Pipelined plans through autoshard (the MPMD executor): numerics vs one device, residual memory of 1F1B
vs GPipe, per-stage programs, clear errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_runtime import BATCH, DEVICES, ZERO2, ZERO3, assert_matches_reference, loss_only_step, setup

import mistjax
from mistjax.core import hlo
from mistjax.plan import PlanError, uniform_plan


def pipelined_plan(name, stages, *, grad_accum, tp=1, layers=None, schedule="1f1b", shard_group=0, **stage):
    cfg = setup(name)[0]
    dp = DEVICES // (tp * stages)
    plan = uniform_plan(cfg.num_layers, DEVICES, stages=stages, tp=tp, grad_accum=grad_accum,
                        shard_group=shard_group, micro_batch=BATCH // (dp * grad_accum), schedule=schedule,
                        **{"shard_opt": True, **stage})
    if layers:
        plan = plan.replace(stages=tuple(dataclasses.replace(s, layers=ls) for s, ls in zip(plan.stages, layers)))
    return plan


CASES = [
    ("llama-tiny", 2, dict(grad_accum=2)),
    ("llama-tiny", 2, dict(grad_accum=4, schedule="gpipe", layers=[(0, 3), (3, 4)])),
    ("gpt3-tiny", 4, dict(grad_accum=4, layers=[(0, 1), (1, 2), (2, 3), (3, 4)], remat_layers=1)),
    ("gpt3-tiny", 2, dict(grad_accum=4, **ZERO3, shard_group=2)),
    ("falcon-tiny", 2, dict(grad_accum=2, layers=[(0, 3), (3, 4)], **ZERO3)),
    ("falcon-tiny", 4, dict(grad_accum=8, schedule="gpipe")),
    ("llama-tiny", 2, dict(grad_accum=4, tp=2, **ZERO2)),
    ("gpt3-tiny", 4, dict(grad_accum=8, schedule="1f1b-eager", layers=[(0, 1), (1, 2), (2, 3), (3, 4)])),
]


SLOW_CASES = {1, 2, 4, 5, 6, 7}  # gpipe, ZeRO-3, TP inside pipelines and four stages (1F1B, eager) have their
# own fast tests (test_pipeline_mpmd): -m slow


@pytest.mark.parametrize("name,stages,kw", [
    pytest.param(*c, id=f"{c[0]}-S{c[1]}-{i}", marks=pytest.mark.slow if i in SLOW_CASES else ())
    for i, c in enumerate(CASES)])
def test_pipelined_matches_single_device(name, stages, kw):
    cfg, state, batch, train_step, ref_loss, ref_grads = setup(name)
    step = mistjax.autoshard(train_step, jax.devices(), plan=pipelined_plan(name, stages, **kw))
    _, metrics = step(jax.tree.map(jnp.copy, state), batch)
    assert_matches_reference(metrics, ref_loss, ref_grads)


def mpmd(plan, name="gpt3-tiny"):
    """The MPMD executor of `plan` for the model, set up (traced, not compiled)."""
    _, state, batch, *_ = setup(name)
    step = mistjax.autoshard(loss_only_step(name), jax.devices(), plan=plan)
    step._mpmd._setup(state, batch)
    return step._mpmd


def test_1f1b_holds_fewer_residuals_than_gpipe():
    """Each stage's residuals live in the buffers between its forward and backward programs: 1F1B holds
    at most S - s micro-batches of them, GPipe all G (the last stage fuses F and B and holds none)."""
    _, state, batch, *_ = setup("gpt3-tiny")
    held = {}
    for schedule in ("1f1b", "gpipe"):
        step = mistjax.autoshard(loss_only_step("gpt3-tiny"), jax.devices(),
                                 plan=pipelined_plan("gpt3-tiny", 2, grad_accum=4, schedule=schedule))
        step(jax.tree.map(jnp.copy, state), batch)
        held[schedule] = step._mpmd.stats
    assert held["1f1b"].residuals_in_flight == [2, 0] and held["gpipe"].residuals_in_flight == [4, 0]
    assert 0 < held["1f1b"].residual_bytes[0] < held["gpipe"].residual_bytes[0]


def test_stage_remat_changes_the_program():
    plan = pipelined_plan("gpt3-tiny", 2, grad_accum=4)
    first_only = plan.replace(stages=(dataclasses.replace(plan.stages[0], remat_layers=2), plan.stages[1]))
    plain, remat = mpmd(plan).residual_bytes(), mpmd(first_only).residual_bytes()
    assert remat[0] < plain[0] and remat[1] == plain[1] == 0


def with_stages(plan, **per_stage):
    """``plan`` with per-stage values: ``with_stages(plan, offload_acts=[1.0, 0.0])``."""
    stages = tuple(dataclasses.replace(s, **{k: v[i] for k, v in per_stage.items()}) for i, s in enumerate(plan.stages))
    return plan.replace(stages=stages)


def test_stage_activation_offload_matches_single_device():
    """Stage 0 (the most micro-batches in flight) offloads all its layers' activations, stage 1 half."""
    name = "gpt3-tiny"
    cfg, state, batch, train_step, ref_loss, ref_grads = setup(name)
    plan = with_stages(pipelined_plan(name, 2, grad_accum=4, layers=[(0, 3), (3, 4)]), offload_acts=[1.0, 0.0])
    step = mistjax.autoshard(train_step, jax.devices(), plan=plan)
    _, metrics = step(jax.tree.map(jnp.copy, state), batch)
    assert_matches_reference(metrics, ref_loss, ref_grads)


def test_stage_activation_offload_is_placed_on_host():
    """The offloading stage's forward returns its tagged residuals in host memory (XLA:CPU then drops the
    placement, see docs/guide.md) and keeps fewer on device; the other stage's programs are unchanged."""
    base = pipelined_plan("gpt3-tiny", 2, grad_accum=4)
    _, state, batch, *_ = setup("gpt3-tiny")
    lowered, ex = {}, {}
    for key, plan in (("none", base), ("stage0", with_stages(base, offload_acts=[1.0, 0.0]))):
        step = mistjax.autoshard(loss_only_step("gpt3-tiny"), jax.devices(), plan=plan)
        lowered[key] = step.compile_stages(state, batch, ["forward"], compile=False)[(0, "forward")]
        ex[key] = step._mpmd
    assert "annotate_device_placement" not in lowered["none"].as_text()
    assert lowered["stage0"].as_text().count("annotate_device_placement") > 0
    host = [a for a in ex["stage0"].programs[0].classify().avals if a[3]]
    assert host and not any(a[3] for a in ex["none"].programs[0].classify().avals)
    device = lambda e: sum(int(np.prod(a[0])) * a[1].itemsize for a in e.programs[0].classify().avals if not a[3])  # noqa: E731
    assert device(ex["stage0"]) < device(ex["none"])


def test_pipelined_plans_take_per_stage_state_choices():
    """ZeRO level, optimizer / gradient-accumulator offload differ per stage (the MPMD executor gives each
    stage its own layouts); the numerics do not change."""
    name = "llama-tiny"
    _, state, batch, train_step, ref_loss, ref_grads = setup(name)
    plan = with_stages(pipelined_plan(name, 2, grad_accum=4, layers=[(0, 3), (3, 4)]),
                       shard_opt=[True, False], offload_grads=[1.0, 0.0], offload_opt=[0.0, 1.0])
    step = mistjax.autoshard(train_step, jax.devices(), plan=plan)
    new, metrics = step(jax.tree.map(jnp.copy, state), batch)
    assert_matches_reference(metrics, ref_loss, ref_grads)
    kinds = {k: {x.sharding.memory_kind for x in jax.tree.leaves(new.opt_state) if x.sharding.mesh is m}
             for k, m in enumerate(step._mpmd.meshes)}
    assert kinds[0] == {"device"} and "pinned_host" in kinds[1]


def test_pipelining_a_model_without_layer_stack_is_refused():
    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"]) ** 2)

    def train_step(state, batch):
        loss, grads = mistjax.value_and_grad(loss_fn)(state["params"], batch)
        return {"params": jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)}, {"loss": loss}

    state = {"params": {"w": jnp.ones((4, 4))}}
    plan = uniform_plan(2, DEVICES, stages=2, micro_batch=1, grad_accum=1, shard_opt=True)
    step = mistjax.autoshard(train_step, jax.devices(), plan=plan)
    with pytest.raises(PlanError, match="no scan over stacked layer"):
        step(state, {"x": jnp.ones((4, 4))})


def test_optimizer_step_runs_pipelined():
    cfg, state, batch, *_ = setup("llama-tiny")
    # Copies: the step donates its state, and `setup`'s state is shared by the other tests.
    state = jax.tree.map(jnp.copy, state.replace(tx=optax.adam(1e-3), opt_state=optax.adam(1e-3).init(state.params)))
    step = mistjax.autoshard(loss_only_step("llama-tiny"), jax.devices(),
                             plan=pipelined_plan("llama-tiny", 2, grad_accum=2, **ZERO2))
    losses = []
    for _ in range(3):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0]


def test_pipelined_zero3_across_nodes_is_hierarchical():
    """4 nodes of 2, 2 stages x dp 4: each stage's partition group spans 2 nodes, so the per-layer
    gathers run inter-node then intra-node (and the reduce-scatters mirror them), with the same
    numerics as one device."""
    mesh = jax.make_mesh((4, 2), ("node", "gpu"))
    name = "llama-tiny"
    plan = pipelined_plan(name, 2, grad_accum=2, **ZERO3)
    _, state, batch, train_step, ref_loss, ref_grads = setup(name)
    _, metrics = mistjax.autoshard(train_step, mesh, plan=plan)(jax.tree.map(jnp.copy, state), batch)
    assert_matches_reference(metrics, ref_loss, ref_grads)
    programs = mistjax.autoshard(loss_only_step(name), mesh, plan=plan).compile_stages(
        state, batch, ["forward", "backward", "last"])
    colls = [c for p in programs.values() for c in hlo.collectives(p.as_text()) if c.op in ("all-gather",
                                                                                          "reduce-scatter")]
    # Each stage's program runs on its own 4 devices (node, local): ids (0,0) (0,1) (1,0) (1,1).
    inter, intra = "{{0,2},{1,3}}", "{{0,1},{2,3}}"
    assert {c.groups for c in colls} == {inter, intra}
    for op in ("all-gather", "reduce-scatter"):
        assert sum(c.op == op and c.groups == inter for c in colls) == sum(c.op == op and c.groups == intra
                                                                           for c in colls) > 0
