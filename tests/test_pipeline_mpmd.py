"""The MPMD pipeline executor: per-stage plans, schedules without ticks, the split update, multi-process.

Numerics are compared with the same train step jitted on one device (`jax.value_and_grad`): loss,
gradients (returned in the metrics), and the state after the optimizer step. Fast tests use a tiny
pure-JAX model (a scan over stacked layers, optionally a tied embedding) so each plan compiles in
seconds; the model-zoo and 4-stage cases are marked slow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mistjax
from mistjax.core import pipeline_order as ms
from mistjax.plan import Plan, PlanError, StagePlan
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
    (G + S - 1)(F + B) makespan (a lock-step run of the table would cost +26%), and min(S - s, G) in flight."""
    S, G = 4, 16
    issue = ms.issue_order("1f1b", S, G)
    assert ms.dependency_depth(issue, S) == {"forward": G + S - 1, "backward": G + S - 1}
    assert ms.simulated_time(issue, S) == pytest.approx((G + S - 1) * 3.0)
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
    with pytest.raises(ms.ScheduleError, match="at least 4"):
        ms.device_orders("1f1b", 4, 3, 2)


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
    with pytest.raises(PlanError, match="at least 2"):
        plan_of([{}] * 4, grad_accum=1, dp=1, virtual_stages=2)
    assert plan_of([{}] * 4, grad_accum=1, dp=16, virtual_stages=2, schedule="gpipe").grad_accum == 1
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
    (lambda p: p["embed"] + p["head"].T,
     "mixes params/embed .held by stage 0. with a value computed from params/head .held by stage 1."),
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
UNEVEN = plan_of([dict(shard_opt=True, shard_grads=True, shard_weights=True, remat_layers=1, offload_grads=1.0),
                  dict(shard_opt=False, offload_opt=0.5)], layers=[(0, 3), (3, 4)], grad_accum=2)


@pytest.fixture(scope="module")
def uneven():
    """Stage 0: 3 layers, ZeRO-3, one checkpointed layer, gradient accumulators on host; stage 1: one
    layer, plain DP, half its optimizer state on host. clip_by_global_norm + adamw with a schedule."""
    return run_plan(UNEVEN, "clip_adamw")


def test_uneven_stages_with_their_own_zero_and_offload_match_one_device(uneven):
    step, new, metrics, ref_new, ref_metrics = uneven
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
    assert any(ex.programs[0].spec.acc_host) and not any(ex.programs[1].spec.acc_host)
    assert ex.stats.residuals_in_flight == [2, 0]  # 1F1B with G = 2: both micro-batches in flight on stage 0
    # A second step continues from the placed state (on a copy: the step donates its state).
    new2, m2 = step(jax.tree.map(jnp.copy, new), make_batch(2))
    assert np.isfinite(float(m2["loss"])) and float(m2["loss"]) != float(metrics["loss"])


def test_each_stage_compiles_only_what_its_plan_holds(uneven):
    """Every stage's programs have their own memory: stage 0 (ZeRO-3) receives a quarter of its weights,
    its backward keeps the gradient accumulators in host memory; only stage 1's update reads optimizer
    state from host memory."""
    from mistjax.core import hlo

    step, new, *_ = uneven
    progs = step.compile_stages(new, make_batch(), ["forward", "backward", "last", "update2"])
    ex = step._mpmd
    held = [sum(int(np.prod(ex.layouts[k][i].shape)) * 4 for i in ex.held[k] if i in ex.param_index)
            for k in range(2)]
    fwd0 = progs[(0, "forward")].memory_analysis().argument_size_in_bytes
    last1 = progs[(1, "last")].memory_analysis().argument_size_in_bytes
    assert fwd0 < held[0] / 3  # weights split 4 ways (plus one micro-batch of tokens)
    assert last1 > held[1]  # whole weights
    kinds = lambda c: {s.memory_kind for s in jax.tree.leaves(c.input_shardings)}  # noqa: E731
    assert "pinned_host" in kinds(progs[(0, "backward")]) and "pinned_host" not in kinds(progs[(1, "last")])
    assert hlo.host_placed_params(progs[(1, "update2")].as_text()) > 0
    assert hlo.host_placed_params(progs[(0, "update2")].as_text()) == 0


def test_placed_state_checkpoints_as_logical_arrays(uneven, tmp_path):
    """Each `StagedArray` is saved as one logical array (the uneven stages' row blocks at their offsets, on-disk
    shape = the whole leaf's); restoring onto a placed template gives the same pieces, shardings and memory
    kinds, and the checksums, computed per piece and combined, equal those of the gathered whole arrays."""
    import tensorstore as ts

    from mistjax.train.checkpoint import Checkpointer, checksums

    step, new, *_ = uneven
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(1, new, {"note": "mpmd"})
    template = step.place(make_state(OPTIMIZERS["clip_adamw"]()), make_batch())
    restored, meta = ckpt.restore_latest(template)
    ckpt.close()
    assert meta["checksums"] == checksums(new) == checksums(restored) == checksums(step.gather(new))
    stacked = "params/layers/w1"  # row blocks of 3 and 1 layers on two stages
    path = tmp_path / "ckpt" / "1" / "state" / stacked
    on_disk = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result()
    assert tuple(on_disk.shape) == tuple(meta["leaves"][stacked][0])
    assert_close(step.gather(restored), step.gather(new), rtol=0, atol_scale=0)
    assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(new)))


def test_interleaved_1f1b_matches_one_device():
    """Two device groups of two chunks each (Megatron's interleaved 1F1B), a different ZeRO level per
    chunk; chunk 0 of group 0 has the embedding, chunk 1 of group 1 the head."""
    plan = plan_of([dict(shard_opt=False), dict(shard_opt=True, shard_grads=True),
                    dict(shard_opt=True, shard_grads=True, shard_weights=True), dict(shard_opt=True)],
                   dp=4, grad_accum=2, virtual_stages=2)
    step, new, metrics, ref_new, ref_metrics = run_plan(plan, "sgd")
    check_against_reference(step, new, metrics, ref_new, ref_metrics)
    ex = step._mpmd
    assert ex.meshes[0] is ex.meshes[2] and ex.meshes[1] is ex.meshes[3] and ex.meshes[0] is not ex.meshes[1]
    assert ex.stats.by_kind["forward"] == 3 * 2 and ex.stats.by_kind["last"] == 2


def test_interleaved_1f1b_with_micro_batches_not_a_multiple_of_the_groups_matches_one_device():
    """Megatron-Core runs interleaved 1F1B with any micro-batch count of at least the pipeline depth: G 3 on 2
    device groups of 2 chunks (the last micro-batch group takes the remainder) runs and matches `jax.jit`."""
    tx = OPTIMIZERS["sgd"]()
    state = make_state(tx)
    batch = jax.tree.map(lambda x: x[:12], make_batch())
    ref_new, ref_metrics = jax.jit(make_step(tx))(state, batch)
    plan = Plan(stages=tuple(StagePlan(layers=(i, i + 1)) for i in range(L)), micro_batch=1, grad_accum=3, dp=4,
                virtual_stages=2)
    step = mistjax.autoshard(make_step(tx), jax.devices(), plan=plan)
    new, metrics = step(jax.tree.map(jnp.copy, state), batch)
    check_against_reference(step, new, metrics, ref_new, ref_metrics)
    assert step._mpmd.stats.by_kind["last"] == 3


def test_a_tuned_plan_interleaved_matches_one_device():
    """`Plan.interleaved` of a one-chunk plan with per-group knobs (ZeRO-3 + remat + gradient offload on group 0,
    optimizer offload on group 1): each chunk keeps its group's knobs, the checkpointed layers spread."""
    plan = plan_of([dict(shard_opt=True, shard_grads=True, shard_weights=True, remat_layers=2, offload_grads=1.0),
                    dict(shard_opt=False, offload_opt=0.5)], grad_accum=2).interleaved(2)
    assert [s.remat_layers for s in plan.stages] == [1, 0, 1, 0]
    step, new, metrics, ref_new, ref_metrics = run_plan(plan, "clip_adamw")
    check_against_reference(step, new, metrics, ref_new, ref_metrics)
    assert step._mpmd.meshes[0] is step._mpmd.meshes[2]


def test_mics_inside_a_stage_matches_one_device():
    """dp 4 with MiCS partition groups of 2: ZeRO-3 on stage 0 (gathers inside the pair, hop-2
    all-reduce across pairs), ZeRO-2 on stage 1."""
    plan = plan_of([dict(shard_opt=True, shard_grads=True, shard_weights=True),
                    dict(shard_opt=True, shard_grads=True)], dp=4, grad_accum=2, shard_group=2)
    step, new, metrics, ref_new, ref_metrics = run_plan(plan, "sgd")
    check_against_reference(step, new, metrics, ref_new, ref_metrics)
    w1 = new["params"]["layers"]["w1"].pieces[0]
    assert w1.sharding.shard_shape(w1.shape)[1:] != w1.shape[1:]  # split inside the partition group only
    assert len({d for d in w1.sharding.device_set}) == 4


def test_tied_embedding_is_held_by_both_ends_and_updated_identically():
    plan = plan_of([dict(shard_opt=False), dict(shard_opt=True, shard_grads=True)], schedule="gpipe")
    step, new, metrics, ref_new, ref_metrics = run_plan(plan, "sgd", tied=True)
    check_against_reference(step, new, metrics, ref_new, ref_metrics)
    emb = new["params"]["embed"]
    assert emb.info.stages == (0, 1)
    np.testing.assert_array_equal(np.asarray(emb.pieces[0]), np.asarray(emb.pieces[1]))


# ------------------------------------------------------------------------------------- model zoo, slow
def zoo_run(name: str, plan: Plan):
    from test_runtime import setup

    _, state, batch, train_step, ref_loss, ref_grads = setup(name)
    step = mistjax.autoshard(train_step, jax.devices(), plan=plan)
    new, metrics = step(jax.tree.map(jnp.copy, state), batch)
    return step, new, metrics, ref_loss, ref_grads


@pytest.mark.slow
def test_tensor_parallel_inside_stages_matches_one_device():
    """llama-tiny, 2 stages x dp 2 x tp 2: Megatron TP + SP inside each stage, ZeRO-3 on stage 0 only."""
    from test_runtime import BATCH, assert_matches_reference

    plan = Plan(stages=(StagePlan((0, 2), shard_grads=True, shard_weights=True), StagePlan((2, 4), shard_opt=False)),
                micro_batch=BATCH // (2 * 2), grad_accum=2, dp=2, tp=2)
    step, new, metrics, ref_loss, ref_grads = zoo_run("llama-tiny", plan)
    assert_matches_reference(metrics, ref_loss, ref_grads)
    wq = jax.tree.leaves(new.params["layers"]["attn"]["wq"], is_leaf=lambda x: isinstance(x, StagedArray))[0]
    assert all("tensor" in str(p.sharding.spec) for p in wq.pieces)


def mist_7b_plan(num_devices: int = 8, grad_accum: int = 4) -> Plan:
    """Mist's tuned GPT-7B plan on 8 L4 (paper section 6.8): 4 stages x dp 2, ZeRO-1, layers [7, 8, 9, 8],
    checkpointed layers [3, 2, 0, 0], optimizer offload [0, .125, .375, 0] (G scaled from 64)."""
    bounds = np.cumsum([0, 7, 8, 9, 8])
    stages = tuple(StagePlan((int(a), int(b)), shard_opt=True, remat_layers=c, offload_opt=o)
                   for a, b, c, o in zip(bounds[:-1], bounds[1:], [3, 2, 0, 0], [0.0, 0.125, 0.375, 0.0]))
    dp = num_devices // 4
    return Plan(stages=stages, micro_batch=16 // (dp * grad_accum), grad_accum=grad_accum, dp=dp)


@pytest.mark.slow
def test_mist_published_7b_plan_pattern_runs_and_matches():
    """The published plan's per-stage pattern on a 32-layer tiny GPT: numerics equal to one device,
    stages 1 and 2 offload part of their optimizer state (adam), stage 0 checkpoints 3 layers."""
    from flax import nnx

    import models
    from mistjax.train.data import SyntheticTokens
    from mistjax.train.state import TrainState
    from models import make_loss_fn

    cfg = models.get_config("gpt3-tiny").replace(num_layers=32)
    tx = optax.adam(1e-3, eps=1e-3)
    state = TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), tx)
    loss = make_loss_fn(state.graphdef)
    batch = SyntheticTokens(cfg.vocab_size, 16, 16, kind="random").batch(0)

    def train_step(state, batch):
        value, grads = mistjax.value_and_grad(loss)(state.params, batch)
        return state.apply_gradients(grads), {"loss": value, "grads": grads}

    ref_new, ref = jax.jit(train_step)(state, batch)
    step = mistjax.autoshard(train_step, jax.devices(), plan=mist_7b_plan())
    new, metrics = step(jax.tree.map(jnp.copy, state), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref["loss"]), rtol=2e-6)
    assert_close(metrics["grads"], ref["grads"], rtol=1e-4, atol_scale=2e-5)
    got = step.gather(new)
    assert_close(got.params, ref_new.params, rtol=1e-5, atol_scale=2e-5)
    ex = step._mpmd
    host = [{x.sharding.memory_kind for x in jax.tree.leaves(new.opt_state) if x.sharding.mesh is m}
            for m in ex.meshes]
    assert ["pinned_host" in h for h in host] == [False, True, True, False]
    assert ex.residual_bytes()[0] < ex.residual_bytes()[2]  # stage 0 checkpoints 3 of its 7 layers


@pytest.mark.slow
def test_four_stage_1f1b_memory_is_flat_in_g():
    """Classic 1F1B at S = 4: each stage holds min(S - s, G) micro-batches' residuals whatever G, and
    its programs are the same programs (per micro-batch), so their memory does not grow with G."""
    tx = OPTIMIZERS["sgd"]()
    held, temp = {}, {}
    for G in (4, 8, 16):
        plan = Plan(stages=tuple(StagePlan((s, s + 1)) for s in range(4)), micro_batch=1, grad_accum=G, dp=2)
        batch = {k: jnp.tile(v, (G * 2 // B + 1, 1))[: G * 2] for k, v in make_batch().items()}
        step = mistjax.autoshard(make_step(tx), jax.devices(), plan=plan)
        _, m = step(make_state(tx), batch)
        assert np.isfinite(float(m["loss"]))
        ex = step._mpmd
        held[G] = ex.stats.residual_bytes
        assert ex.stats.residuals_in_flight == [min(4 - s, G) for s in range(3)] + [0]
        progs = step.compile_stages(make_state(tx), batch, ["forward"])
        temp[G] = [progs[(k, "forward")].memory_analysis().temp_size_in_bytes for k in range(3)]
    assert held[4] == held[8] == held[16] and temp[4] == temp[8] == temp[16]


@pytest.mark.slow
def test_two_processes_split_a_pipelined_plan_and_resume_after_kill(tmp_path):
    """2 processes x 4 CPU devices: stage 0 (ZeRO-3, remat) on process 0's devices, stage 1 (ZeRO-1, half
    its optimizer state on host) on process 1's. Activations, cotangents, the global gradient norm of
    the clipped AdamW update and the loss cross processes; the losses equal a single-process run of the
    same plan. Each process writes its own stage's shards into the checkpoint's logical arrays: after
    kill -9 of both processes the run resumes with losses bit-identical to those the killed run logged."""
    import re
    import signal
    import time

    from test_multihost import MODEL, finish, launch, logs, losses, reference

    import models

    plan_file = tmp_path / "plan.json"
    uniform_plan_for(models.get_config(MODEL).num_layers).save(plan_file)
    steps, cache = 6, tmp_path / "xla-cache"
    metrics = tmp_path / "metrics.jsonl"
    procs = launch(tmp_path, plan_file, cache, steps, ckpt_every=2)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            if metrics.exists() and metrics.read_text().count("\n") >= 3 and (tmp_path / "ckpt" / "2").is_dir():
                break
            time.sleep(0.05)
        assert all(p.poll() is None for p in procs), logs(tmp_path)
        for p in procs:
            p.send_signal(signal.SIGKILL)
    finally:
        finish(procs, timeout=10)
    before = losses(metrics)
    assert 3 <= len(before) < steps

    procs = launch(tmp_path, plan_file, cache, steps, "--resume", ckpt_every=2)
    try:
        want = reference(plan_file, steps)
    finally:
        codes = finish(procs, timeout=900)
    assert codes == [0, 0], logs(tmp_path)
    after = losses(metrics)
    resumed_from = int(re.search(r"resumed from step (\d+)", (tmp_path / "p0.log").read_text()).group(1))
    assert resumed_from < len(before), "the resumed run must recompute steps the killed run had logged"
    assert after[:len(before)] == before, "the resumed steps must repeat the killed run's losses bit for bit"
    np.testing.assert_allclose(after, want, rtol=2e-6, atol=2e-6)


def uniform_plan_for(num_layers: int) -> Plan:
    half = num_layers // 2
    return Plan(stages=(StagePlan((0, half), shard_grads=True, shard_weights=True, remat_layers=1),
                        StagePlan((half, num_layers), shard_opt=True, offload_opt=0.5)),
                micro_batch=16 // (4 * 2), grad_accum=2, dp=4)


def test_zero_bubble_on_a_plain_jax_model_with_a_tied_embedding_matches_one_device():
    """ZB-H1 on a model outside the zoo (a plain-JAX scanned MLP, the embedding tied as the head, held by both
    ends): the split backward runs and matches one device."""
    plan = plan_of([dict(shard_opt=True), dict(shard_opt=True)], dp=4, grad_accum=4, schedule="zb-h1")
    step, new, metrics, ref_new, ref_metrics = run_plan(plan, "sgd", tied=True)
    check_against_reference(step, new, metrics, ref_new, ref_metrics)
    assert step._mpmd.stats.by_kind["weight_grad"] == 4 and step._mpmd.stats.by_kind["last_input"] == 4


def test_residuals_are_counted_per_device_under_their_tensor_split():
    """Under TP the forward's residuals are split over the tensor axis (XLA's output shardings); once the forward
    is compiled, the executor's per-micro-batch residual bytes (read by its fit check and the XLA:GPU stage
    report) are those pieces', not the residuals whole over the tensor axis (2x at TP 2)."""
    from flax import nnx

    import models
    from mistjax.train.data import SyntheticTokens
    from mistjax.train.state import TrainState

    cfg = models.get_config("gpt3-tiny")
    state = TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1, momentum=0.9))
    loss_fn = models.make_loss_fn(state.graphdef)

    def train_step(state, batch):
        loss, grads = mistjax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    half = cfg.num_layers // 2
    plan = Plan(stages=(StagePlan(layers=(0, half)), StagePlan(layers=(half, cfg.num_layers))), dp=2, tp=2,
                micro_batch=4, grad_accum=2)
    step = mistjax.autoshard(train_step, jax.devices(), plan=plan)
    batch = SyntheticTokens(cfg.vocab_size, 16, 16, kind="random").batch(0)
    step.compile_stages(state, batch, ["forward"], compile=False)  # lowered only: nothing compiled yet
    ex = step._mpmd
    whole = ex.programs[0].classify().device_nbytes
    assert ex.residual_bytes()[0] == whole  # before a compile: the upper bound
    fwd = step.compile_stages(state, batch, ["forward"])[(0, "forward")]
    infos, shardings = jax.tree.leaves(fwd.out_info[1]), fwd.output_shardings[1]
    pieces = sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize for a, s in zip(infos, shardings))
    assert any("tensor" in str(s.spec) for s in shardings)
    assert ex.residual_bytes()[0] == pieces
    assert pieces < 0.75 * whole
    ran = mistjax.autoshard(train_step, jax.devices(), plan=plan)  # a fresh executor, run instead of compiled
    ran(ran.place(state, batch), batch)
    assert ran._mpmd.residual_bytes()[0] == pieces
    assert ran._mpmd.stats.residual_bytes[0] == ran._mpmd.stats.residuals_in_flight[0] * pieces
