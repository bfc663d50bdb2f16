"""The MPMD pipeline executor: per-stage plans, schedules without ticks, the split update, multi-process.

Numerics are compared with the same train step jitted on one device (`jax.value_and_grad`): loss,
gradients (returned in the metrics), and the state after the optimizer step. Fast tests use a tiny
pure-JAX model (a scan over stacked layers, optionally a tied embedding) so each plan compiles in
seconds; the model-zoo and 4-stage cases are marked slow.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mistjax
from mistjax.plan import Plan, PlanError, StagePlan, uniform_plan
from mistjax.runtime import mpmd_schedule as ms
from mistjax.runtime.mpmd_state import StagedArray
from mistjax.runtime.mpmd_update import Rows, UpdateError, Whole

V, D, F, L, B, T = 32, 8, 16, 4, 16, 8


def init_params(seed: int = 0, tied: bool = False, layers: int = L) -> dict:
    k = jax.random.split(jax.random.key(seed), 4)
    p = {"embed": jax.random.normal(k[0], (V, D)) * 0.5,
         "layers": {"w1": jax.random.normal(k[1], (layers, D, F)) * 0.3,
                    "w2": jax.random.normal(k[2], (layers, F, D)) * 0.3,
                    "scale": jnp.ones((layers, D))}}
    if not tied:
        p["head"] = jax.random.normal(k[3], (D, V)) * 0.3
    return p


def loss_fn(params: dict, batch: dict) -> jax.Array:
    h = params["embed"][batch["inputs"]]

    def layer(h, w):
        return h + jnp.tanh((h * w["scale"]) @ w["w1"]) @ w["w2"], None

    h, _ = jax.lax.scan(layer, h, params["layers"])
    head = params["head"] if "head" in params else params["embed"].T  # tied: the embedding is the head
    logits = h @ head
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def make_batch(seed: int = 1) -> dict:
    tok = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, V)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def make_step(tx: optax.GradientTransformation):
    def train_step(state, batch):
        loss, grads = mistjax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt, "step": state["step"] + 1}
        return new, {"loss": loss, "grads": grads}

    return train_step


def make_state(tx: optax.GradientTransformation, **kw) -> dict:
    params = init_params(**kw)
    return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}


def plan_of(stages: list[dict], *, dp: int = 4, grad_accum: int = 2, layers=None, **kw) -> Plan:
    """A plan with per-stage fields; ``layers`` defaults to an even split of the tiny model."""
    n = len(stages)
    if layers is None:
        bounds = [round(i * L / n) for i in range(n + 1)]
        layers = list(zip(bounds[:-1], bounds[1:]))
    return Plan(stages=tuple(StagePlan(layers=tuple(ls), **s) for ls, s in zip(layers, stages)),
                micro_batch=B // (dp * grad_accum), grad_accum=grad_accum, dp=dp, **kw)


def assert_close(got, want, rtol=2e-6, atol_scale=2e-6, what=""):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        scale = float(np.max(np.abs(w))) or 1.0
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol_scale * scale, err_msg=what)


@functools.cache
def reference(tx_name: str, tied: bool = False):
    tx = OPTIMIZERS[tx_name]()
    state, batch = make_state(tx, tied=tied), make_batch()
    new, metrics = jax.jit(make_step(tx))(state, batch)
    return state, batch, new, metrics


def run_plan(plan: Plan, tx_name: str, tied: bool = False, steps: int = 1):
    tx = OPTIMIZERS[tx_name]()
    state, batch, ref_new, ref_metrics = reference(tx_name, tied)
    step = mistjax.autoshard(make_step(tx), jax.devices(), plan=plan)
    new, metrics = step(jax.tree.map(jnp.copy, state), batch)
    return step, new, metrics, ref_new, ref_metrics


def check_against_reference(step, new, metrics, ref_new, ref_metrics, update_atol=2e-6):
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=2e-6)
    assert_close(metrics["grads"], ref_metrics["grads"], rtol=1e-4, atol_scale=2e-5, what="gradients")
    got = step.gather(new)
    assert_close(got["opt"], ref_new["opt"], rtol=1e-4, atol_scale=2e-5, what="optimizer state")
    assert_close(got["params"], ref_new["params"], rtol=1e-5, atol_scale=update_atol, what="parameters")
    assert int(got["step"]) == int(ref_new["step"]) == 1


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    # eps keeps Adam's first step away from sign(g) for gradients at the noise level, where any two
    # summation orders disagree; the schedule depends on the step count held by every stage.
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                      optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), eps=1e-3)),
}


# ------------------------------------------------------------------------------------- schedules
def test_1f1b_has_no_tick_barrier():
    """Classic 1F1B at S=4, G=16: G + S - 1 operations on the longest chain per direction, the ideal
    (G + S - 1)(F + B) makespan (the lock-step table costs +26%), and min(S - s, G) in flight."""
    S, G = 4, 16
    issue = ms.issue_order("1f1b", S, G)
    assert ms.dependency_depth(issue, S) == {"forward": G + S - 1, "backward": G + S - 1}
    assert ms.simulated_time(issue, S) == pytest.approx((G + S - 1) * 3.0)
    from mistjax.runtime import schedules

    lockstep = schedules.lockstep_time(schedules.make_schedule("1f1b", S, G), 1.0, 2.0)
    assert lockstep == pytest.approx(1.26 * (G + S - 1) * 3.0, rel=0.01)
    # The last stage fuses forward and backward, so it keeps no residuals at all.
    np.testing.assert_array_equal(ms.residuals_in_flight(issue), [4, 3, 2, 0])
    for g in (4, 8, 32):  # flat in G
        np.testing.assert_array_equal(ms.residuals_in_flight(ms.issue_order("1f1b", S, g)), [4, 3, 2, 0])
    np.testing.assert_array_equal(ms.residuals_in_flight(ms.issue_order("gpipe", S, G)), [G, G, G, 0])


@pytest.mark.parametrize("schedule,S,G,v", [("1f1b", 4, 16, 1), ("gpipe", 3, 5, 1), ("1f1b-eager", 4, 8, 1),
                                            ("1f1b", 4, 8, 2), ("1f1b", 2, 4, 3), ("gpipe", 2, 4, 2)])
def test_issue_order_is_a_valid_merge(schedule, S, G, v):
    """Every operation once; each group's queue is its schedule order; dependencies come first."""
    orders = ms.device_orders(schedule, S, G, v)
    issue = ms.issue_order(schedule, S, G, v)
    K = S * v
    assert sorted(issue) == sorted(op for o in orders for op in o)
    assert len(issue) == (2 * K - 1) * G
    assert ms.group_queues(issue, S) == orders
    pos = {op: n for n, op in enumerate(issue)}
    for op in issue:
        assert all(pos[d] < pos[op] for d in ms.dependencies(op, K))


def test_interleaving_shrinks_the_bubble():
    """Megatron's interleaved 1F1B: with v chunks per group the fill/drain costs 1/v of classic 1F1B."""
    S, G = 4, 8
    classic = ms.simulated_time(ms.issue_order("1f1b", S, G), S)
    inter = ms.simulated_time(ms.issue_order("1f1b", S, G, 2), S, cost={"F": 0.5, "B": 1.0, "FB": 1.5})
    assert inter < classic
    assert inter == pytest.approx(G * 3.0 + (S - 1) * 1.5)
    with pytest.raises(ms.ScheduleError, match="multiple of 4"):
        ms.device_orders("1f1b", 4, 6, 2)


def test_a_bad_order_is_reported_as_deadlock():
    orders = ms.device_orders("1f1b", 2, 2)
    orders[0] = orders[0][::-1]  # backward before its forward
    with pytest.raises(ms.ScheduleError, match="deadlocks"):
        ms.list_schedule(orders)


def test_virtual_stages_plan_field():
    plan = plan_of([{}] * 4, dp=2, grad_accum=2, virtual_stages=2)
    assert plan.device_stages == 2 and plan.num_devices == 4 and plan.mesh_shape["stage"] == 2
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(plan_of([{}] * 2).to_json()).virtual_stages == 1
    with pytest.raises(PlanError, match="must divide"):
        plan_of([{}] * 3, virtual_stages=2)
    with pytest.raises(PlanError, match="multiple of 2"):
        plan_of([{}] * 4, grad_accum=3, dp=1, virtual_stages=2)
    with pytest.raises(PlanError, match="no interleaved form"):
        plan_of([{}] * 4, schedule="1f1b-eager", virtual_stages=2)


# ------------------------------------------------------------------------------------- the update split
def propagation(plan: Plan, tx_name: str, tied: bool = False):
    tx = OPTIMIZERS[tx_name]()
    step = mistjax.autoshard(make_step(tx), jax.devices(), plan=plan)
    state, batch = make_state(tx, tied=tied), make_batch()
    step._mpmd._setup(state, batch)
    return step._mpmd


def test_update_split_places_state_and_reduces_the_norm_across_stages():
    ex = propagation(plan_of([{}, {}]), "clip_adamw")
    names = dict(zip(ex.prop.names.values(), ex.prop.state_layout))
    assert names["params/layers/w1"] == Rows(0) and names["opt/1/0/mu/layers/w1"] == Rows(0)
    assert names["params/embed"] == names["opt/1/0/nu/embed"] == Whole(frozenset({0}))
    assert names["params/head"] == names["opt/1/0/mu/head"] == Whole(frozenset({1}))
    assert names["step"] == names["opt/1/0/count"] == Whole(frozenset({0, 1}))
    # Per-stage sums of squares, one materialised global norm, then the update: two rounds.
    assert ex.prop.num_rounds == 2 and len(ex.prop.mat) == 1
    tied = propagation(plan_of([{}, {}]), "sgd", tied=True)
    assert dict(zip(tied.prop.names.values(), tied.prop.state_layout))["params/embed"] == Whole(frozenset({0, 1}))


@pytest.mark.parametrize("update,match", [
    (lambda p: jnp.sum(p["layers"]["w1"]) * p["embed"], None),  # a scalar reduced across stages: fine
    (lambda p: p["embed"] + p["head"].T, "mixes params/embed .held by stage 0. with a value computed from params/head .held by stage 1."),
    (lambda p: p["embed"] * jnp.sum(p["layers"]["w1"][0]), "needs params/layers/w1"),
    (lambda p: p["embed"] * jnp.sum(p["layers"]["w1"] * p["embed"][:L, :, None]),
     "needs a value computed from params/embed .shape .4, 8, 1., held by stage 0. on every stage"),
])
def test_update_mixing_large_arrays_of_different_stages_is_refused(update, match, monkeypatch):
    """What the update may combine across stages; arrays above the (here lowered) size limit may not move."""
    import mistjax.runtime.mpmd_update as mu

    monkeypatch.setattr(mu, "SMALL_ELEMENTS", 16)
    tx = optax.sgd(0.1)

    def train_step(state, batch):
        loss, grads = mistjax.value_and_grad(loss_fn)(state["params"], batch)
        p = dict(state["params"], embed=update(state["params"]))
        return {"params": p, "opt": state["opt"], "step": state["step"]}, {"loss": loss}

    step = mistjax.autoshard(train_step, jax.devices(), plan=plan_of([{}, {}]))
    if match is None:
        step._mpmd._setup(make_state(tx), make_batch())
        assert step._mpmd.prop.num_rounds == 2
        return
    with pytest.raises(UpdateError, match=match):
        step._mpmd._setup(make_state(tx), make_batch())


# ------------------------------------------------------------------------------------- numerics
def test_uneven_stages_with_their_own_zero_and_offload_match_one_device():
    """Stage 0: 3 layers, ZeRO-3, one checkpointed layer, gradient accumulators on host; stage 1: one
    layer, plain DP, half its optimizer state on host. clip_by_global_norm + adamw with a schedule."""
    plan = plan_of([dict(shard_opt=True, shard_grads=True, shard_weights=True, remat_layers=1, offload_grads=1.0),
                    dict(shard_opt=False, offload_opt=0.5)], layers=[(0, 3), (3, 4)], grad_accum=2)
    step, new, metrics, ref_new, ref_metrics = run_plan(plan, "clip_adamw")
    check_against_reference(step, new, metrics, ref_new, ref_metrics, update_atol=2e-5)
    ex = step._mpmd
    # The embedding lives on stage 0 only, the head on stage 1 only; stacked leaves in row pieces.
    assert new["params"]["embed"].info.stages == (0,) and new["params"]["head"].info.stages == (1,)
    w1 = new["params"]["layers"]["w1"]
    assert isinstance(w1, StagedArray) and [p.shape[0] for p in w1.pieces] == [3, 1]
    # Stage 0 stores its weights split over its 4 devices (ZeRO-3); stage 1 whole.
    assert w1.pieces[0].sharding.shard_shape(w1.pieces[0].shape) != w1.pieces[0].shape
    assert w1.pieces[1].sharding.shard_shape(w1.pieces[1].shape) == w1.pieces[1].shape
    host = [x for x in jax.tree.leaves(new["opt"]) if x.sharding.memory_kind == "pinned_host"]
    assert host and all(x.sharding.mesh == ex.meshes[1] for x in host)  # only stage 1 offloads
    assert any(h for h in ex.programs[0].spec.acc_host) and not any(ex.programs[1].spec.acc_host)
    # A second step continues from the placed state.
    new2, m2 = step(new, make_batch(2))
    assert np.isfinite(float(m2["loss"]))


def test_tied_embedding_is_held_by_both_ends_and_updated_identically():
    plan = plan_of([dict(shard_opt=False), dict(shard_opt=True, shard_grads=True)], schedule="gpipe")
    step, new, metrics, ref_new, ref_metrics = run_plan(plan, "sgd", tied=True)
    check_against_reference(step, new, metrics, ref_new, ref_metrics)
    emb = new["params"]["embed"]
    assert emb.info.stages == (0, 1)
    np.testing.assert_array_equal(np.asarray(emb.pieces[0]), np.asarray(emb.pieces[1]))
