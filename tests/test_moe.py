"""Mixture-of-Experts in the zoo (issue #51, item 1): routing, capacity and dropping, the dropless path, the
balancing loss and bias, the MoE model and presets, and the planner's clear refusal."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from mistjax.core.moe import (
    ExpertWeights,
    MoENotTunedError,
    RouterSpec,
    Scoring,
    balancing_loss,
    capacity,
    capacity_experts,
    glu,
    load_stats,
    ragged_experts,
    route,
    slot_positions,
    update_expert_bias,
)
from models.moe import make_moe_loss_fn, update_biases
from models.moe_config import MoEConfig


def _count(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(tree, nnx.Param)))


def test_softmax_top_k_normalised_is_softmax_over_the_chosen_logits():
    logits = jax.random.normal(jax.random.key(0), (5, 8))
    routing = route(logits, RouterSpec(8, 3))
    chosen = jnp.take_along_axis(logits, routing.experts, axis=-1)
    np.testing.assert_allclose(routing.weights, jax.nn.softmax(chosen, axis=-1), rtol=1e-6)
    assert (jnp.diff(chosen, axis=-1) <= 0).all()  # best first


def test_sigmoid_scores_and_routed_scale():
    logits = jax.random.normal(jax.random.key(1), (4, 6))
    routing = route(logits, RouterSpec(6, 2, Scoring.SIGMOID, normalize=True, scale=2.5))
    np.testing.assert_allclose(routing.weights.sum(-1), 2.5, rtol=1e-6)
    raw = route(logits, RouterSpec(6, 2, Scoring.SIGMOID, normalize=False))
    np.testing.assert_allclose(raw.weights, jnp.take_along_axis(jax.nn.sigmoid(logits), raw.experts, -1))


def test_expert_bias_selects_but_does_not_weight_and_takes_no_gradient():
    logits = jnp.zeros((3, 4)).at[:, 0].set(1.0)
    spec = RouterSpec(4, 1, Scoring.SIGMOID, normalize=False)
    bias = jnp.array([0.0, 0.0, 0.0, 5.0])
    biased = route(logits, spec, bias)
    assert (biased.experts[:, 0] == 3).all()  # the bias moved the choice ...
    np.testing.assert_allclose(biased.weights[:, 0], jax.nn.sigmoid(0.0))  # ... not the weight
    grad = jax.grad(lambda b: route(logits, spec, b).weights.sum())(bias)
    assert not grad.any()


def test_group_limited_routing_picks_only_from_the_best_groups():
    logits = jax.random.normal(jax.random.key(8), (64, 16))
    spec = RouterSpec(16, 4, Scoring.SIGMOID, num_groups=4, top_groups=2)
    routing = route(logits, spec)
    scores = np.asarray(jax.nn.sigmoid(logits))
    for t in range(64):  # brute force: groups by the sum of their two best scores, then top-4 inside the best 2
        groups = scores[t].reshape(4, 4)
        best = np.argsort(-np.sort(groups, axis=1)[:, -2:].sum(1), kind="stable")[:2]
        allowed = np.concatenate([np.arange(4 * g, 4 * g + 4) for g in best])
        want = allowed[np.argsort(-scores[t][allowed], kind="stable")[:4]]
        assert sorted(np.asarray(routing.experts[t]).tolist()) == sorted(want.tolist())
    plain = route(logits, RouterSpec(16, 4, Scoring.SIGMOID))
    assert not np.array_equal(plain.experts, routing.experts)  # the limit changed some choices
    with pytest.raises(ValueError, match="top_groups"):
        MoEConfig(num_experts=16, top_k=8, expert_ffn_size=4, num_groups=8, top_groups=2)


def test_slot_positions_take_first_choices_before_second_choices():
    experts = jnp.array([[[0, 1], [1, 0], [0, 1]]])  # one sequence, 3 tokens, top-2
    pos = slot_positions(experts, 2)
    # expert 0: first choices of tokens 0 and 2 (positions 0, 1), then token 1's second choice (2)
    np.testing.assert_array_equal(pos, [[[0, 1], [0, 2], [1, 2]]])
    assert capacity(16, RouterSpec(8, 2, capacity_factor=1.0)) == 4
    assert capacity(16, RouterSpec(8, 2, capacity_factor=100.0)) == 16  # never more than the sequence
    assert capacity(16, RouterSpec(8, 2)) == 16  # dropless


def _experts(e=4, h=8, f=16):
    keys = jax.random.split(jax.random.key(2), 4)
    w = ExpertWeights(*(0.3 * jax.random.normal(k, s) for k, s in zip(keys, ((e, h, f), (e, h, f), (e, f, h)))))
    x = jax.random.normal(keys[3], (2, 6, h))
    return x, w


@pytest.mark.parametrize("limit", [None, 0.5])  # plain SwiGLU; gpt-oss's clamped one (clamping at this scale)
def test_dropless_ragged_equals_unbounded_capacity_path_and_its_gradients(limit):
    x, w = _experts()
    spec = RouterSpec(4, 2)
    logits = jax.random.normal(jax.random.key(3), (2, 6, 4))

    def loss(fn, x, w):
        return jnp.sum(fn(x, route(logits, spec), w) ** 2)

    ragged = jax.value_and_grad(lambda x, w: loss(lambda a, r, b: ragged_experts(a, r, b, limit), x, w),
                                (0, 1))(x, w)
    padded = jax.value_and_grad(lambda x, w: loss(lambda a, r, b: capacity_experts(a, r, b, 6, limit), x, w),
                                (0, 1))(x, w)
    for got, want in zip(jax.tree.leaves(ragged), jax.tree.leaves(padded)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert "ragged_dot" in str(jax.make_jaxpr(lambda x: ragged_experts(x, route(logits, spec), w))(x))


def test_clamped_swiglu_is_gpt_oss_activation():
    gate, up = jnp.array([-9.0, -1.0, 0.5, 3.0, 9.0]), jnp.array([-9.0, -0.5, 0.0, 2.0, 9.0])
    g, u = np.minimum(np.asarray(gate), 7.0), np.clip(np.asarray(up), -7.0, 7.0)
    want = g / (1 + np.exp(-1.702 * g)) * (u + 1)
    np.testing.assert_allclose(glu(gate, up, 7.0), want, rtol=1e-6)
    np.testing.assert_allclose(glu(gate, up), jax.nn.silu(gate) * up)


def test_capacity_drops_exactly_the_choices_past_capacity():
    x, w = _experts()
    spec = RouterSpec(4, 2, capacity_factor=0.5)  # 2 slots per expert per sequence of 6 tokens, top-2
    routing = route(jax.random.normal(jax.random.key(4), (2, 6, 4)), spec)
    kept = slot_positions(routing.experts, 4) < capacity(6, spec)
    assert not kept.all()
    # reference: run every token through its kept experts one by one
    want = np.zeros(x.shape, np.float32)
    for b in range(2):
        for s in range(6):
            for j in range(2):
                if kept[b, s, j]:
                    e = int(routing.experts[b, s, j])
                    hid = jax.nn.silu(x[b, s] @ w.gate[e]) * (x[b, s] @ w.up[e])
                    want[b, s] += float(routing.weights[b, s, j]) * np.asarray(hid @ w.down[e])
    np.testing.assert_allclose(capacity_experts(x, routing, w, capacity(6, spec)), want, rtol=1e-5, atol=1e-6)
    assert float(load_stats(routing, spec).dropped) == float((~kept).sum())


def test_balancing_loss_is_one_when_balanced_and_grows_with_imbalance():
    uniform = route(jnp.zeros((8, 4)).at[jnp.arange(8), jnp.arange(8) % 4].set(1e-3), RouterSpec(4, 1))
    assert abs(float(balancing_loss(load_stats(uniform, RouterSpec(4, 1)), 1)) - 1.0) < 1e-3
    skewed = route(jnp.zeros((8, 4)).at[:, 0].set(3.0), RouterSpec(4, 1))
    assert float(balancing_loss(load_stats(skewed, RouterSpec(4, 1)), 1)) > 2.0


def test_bias_update_raises_underloaded_and_lowers_overloaded_experts():
    new = update_expert_bias(jnp.zeros(4), jnp.array([10.0, 2.0, 2.0, 2.0]), 1e-3)
    np.testing.assert_allclose(new, [-1e-3, 1e-3, 1e-3, 1e-3])


def test_moe_model_counts_and_layer_pattern():
    cfg = models.get_config("moe-tiny")
    model = models.build(cfg, rngs=nnx.Rngs(0))
    assert isinstance(model, models.MoEForCausalLM)
    assert _count(model) == cfg.num_params()
    assert model.layers.moe.mlp.w_gate.shape == (2, 8, 32, 32)  # 2 MoE layers after 1 dense-first
    periodic = cfg.replace(num_layers=5, moe=dataclasses.replace(cfg.moe, layer_freq=2))
    abstract = nnx.eval_shape(lambda: models.build(periodic, rngs=nnx.Rngs(0)))
    assert _count(abstract) == periodic.num_params()
    assert len(abstract.layers.dense) == 1 and abstract.layers.moe.mlp.router.shape == (2, 32, 8)
    with pytest.raises(ValueError, match="layer_freq=3 does not divide"):
        cfg.replace(num_layers=5, moe=dataclasses.replace(cfg.moe, layer_freq=3))


@pytest.mark.parametrize("name, total, active", [
    ("mixtral-8x7b", 46.70e9, 12.88e9), ("mixtral-8x22b", 140.63e9, 39.16e9), ("qwen3-30b-a3b", 30.53e9, 3.35e9),
    ("qwen3-235b-a22b", 235.09e9, 22.19e9), ("gpt-oss-120b", 116.79e9, 5.71e9), ("gpt-oss-20b", 20.91e9, 4.19e9),
    ("deepseek-v3", 671.03e9, 37.55e9),
])
def test_presets_match_published_sizes(name, total, active):
    """Total counts of the published checkpoints (Mixtral-8x7B: 46.70B; Qwen3-30B-A3B: 30.53B; gpt-oss-120b:
    116.8B); active counts include the embedding and head."""
    cfg = models.get_config(name)
    moe = cfg.moe
    layers = moe.moe_layers(cfg.num_layers)
    inactive = layers * (moe.mlp_params(cfg.hidden_size) - moe.active_mlp_params(cfg.hidden_size))
    assert cfg.num_params() == pytest.approx(total, rel=2e-3)
    assert cfg.num_params() - inactive == pytest.approx(active, rel=2e-3)
    assert name not in models.PRESETS and name in models.MOE_PRESETS


def test_moe_config_validation_and_json_round_trip():
    cfg = models.get_config("deepseek-v3")
    back = models.ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert back == cfg and hash(back) == hash(cfg)
    with pytest.raises(ValueError, match="MoEConfig.top_k: 9 exceeds num_experts=8"):
        MoEConfig(num_experts=8, top_k=9, expert_ffn_size=4)
    with pytest.raises(ValueError, match="MoEConfig.scoring"):
        MoEConfig(num_experts=8, top_k=2, expert_ffn_size=4, scoring="sinkhorn")
    with pytest.raises(ValueError, match="leaves no MoE layer"):
        cfg.replace(num_layers=3)


def test_loss_adds_the_balancing_loss_and_the_bias_update_moves_selection():
    cfg = models.get_config("moe-tiny")
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, expert_bias=True, bias_update_rate=0.5))
    graphdef, params, rest = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(5), (2, 17), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    loss_fn = make_moe_loss_fn(graphdef)
    loss, metrics = loss_fn(params, rest, batch)
    np.testing.assert_allclose(loss, metrics.cross_entropy + 0.01 * metrics.balancing, rtol=1e-6)
    assert metrics.counts.shape == (2, 8) and float(metrics.counts.sum()) == 2 * 2 * 16 * 2
    grads = jax.grad(lambda p: loss_fn(p, rest, batch)[0])(params)
    assert float(jnp.abs(grads["layers"]["moe"]["mlp"]["router"][...]).sum()) > 0  # the aux loss reaches it
    moved = update_biases(rest, metrics.counts, cfg)
    _, after = loss_fn(params, moved, batch)
    assert not np.array_equal(after.counts, metrics.counts)  # the bias changed which experts are chosen
    np.testing.assert_allclose(after.counts.sum(), metrics.counts.sum())


def test_planner_refuses_moe_naming_it():
    with pytest.raises(MoENotTunedError, match="Mixture-of-Experts"):
        models.workload(models.get_config("moe-tiny"), 16, 8)


def test_cli_plan_refuses_moe_in_one_line(capsys):
    from mistjax.cli import main

    code = main(["plan", "--model", "mixtral-8x7b", "--cluster", "dgx-h100:4x8", "--seq-len", "4096",
                 "--global-batch", "256", "--no-verify"])
    err = capsys.readouterr().err
    assert code != 0 and "Mixture-of-Experts" in err and "not tune" in err and "Traceback" not in err


@pytest.mark.parametrize("policy", [pytest.param("nothing", marks=pytest.mark.slow), "names"])
def test_remat_of_moe_layers_keeps_the_gradients(policy):
    """The scan bodies take a remat transform; a policy can name the MoE tags (router logits, experts' output)."""
    cfg = models.get_config("moe-tiny")
    graphdef, params = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, 256)
    saveable = (jax.checkpoint_policies.nothing_saveable if policy == "nothing"
                else jax.checkpoint_policies.save_only_these_names("moe_router", "moe_out"))

    def loss(p, transform):
        model = nnx.merge(graphdef, p)
        return jnp.mean(model.run_layers(model.embed_tokens(tokens), body_transform=transform) ** 2)

    want = jax.grad(loss)(params, None)
    remat = jax.grad(loss)(params, lambda f: nnx.remat(f, policy=saveable))
    for got, ref in zip(jax.tree.leaves(remat), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
    jaxpr = str(jax.make_jaxpr(lambda p: jax.grad(loss)(p, lambda f: nnx.remat(f, policy=saveable)))(params))
    assert "remat" in jaxpr or "checkpoint" in jaxpr


def test_analysis_refuses_an_moe_loss_by_its_tags_or_a_ragged_dot():
    """What autoshard and mistjax.tune reach: the zoo's MoE (tagged) and a from-scratch grouped GEMM."""
    from mistjax.analysis import analyze_model

    cfg = models.get_config("moe-tiny")
    graphdef, params = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    with pytest.raises(MoENotTunedError, match="'moe_router'"):
        analyze_model(models.make_loss_fn(graphdef), params)

    def scratch(p, batch):
        x = p["embed"][batch["inputs"]]
        y = jax.lax.ragged_dot(x.reshape(-1, 8), p["experts"], jnp.array([10, 22], jnp.int32))
        return jnp.mean(y)

    weights = {"embed": jnp.ones((256, 8)), "experts": jnp.ones((2, 8, 8))}
    with pytest.raises(MoENotTunedError, match="ragged_dot"):
        analyze_model(scratch, weights, points=[(2, 16)] * 7)


def _mla_tiny(attention: str = "fused") -> models.ModelConfig:
    from models.mla_config import MLAConfig

    cfg = models.get_config("moe-tiny")
    mla = MLAConfig(kv_rank=16, q_rank=24, nope_dim=8, rope_dim=4, v_dim=8)
    return cfg.replace(mla=mla, attention_head_dim=mla.qk_dim, rotary_pct=mla.rope_dim / mla.qk_dim,
                       attention=attention, num_kv_heads=cfg.num_heads)


def test_mla_counts_kernels_and_causality():
    from models.mla import MultiHeadLatentAttention

    cfg = _mla_tiny()
    model = models.build(cfg, rngs=nnx.Rngs(0))
    assert _count(model) == cfg.num_params()
    assert isinstance(model.layers.moe.attn, MultiHeadLatentAttention)
    assert isinstance(model.dense_layers.attn, MultiHeadLatentAttention)  # the dense-first layers too
    attn = nnx.merge(*nnx.split(jax.tree.map(lambda a: a[0], model.layers.moe.attn)))
    x = jax.random.normal(jax.random.key(7), (2, 16, 32))
    # the fused kernel (values zero-padded to the query / key width) equals the unpadded einsum reference
    reference = MultiHeadLatentAttention(_mla_tiny("reference"), rngs=nnx.Rngs(0))
    nnx.update(reference, nnx.state(attn))
    np.testing.assert_allclose(attn(x), reference(x), rtol=1e-5, atol=1e-6)
    # causal: changing the last token changes no earlier output
    changed = attn(x.at[:, -1].set(0.0))
    np.testing.assert_allclose(changed[:, :-1], attn(x)[:, :-1], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="mla"):
        _mla_tiny().replace(moe=None)


@pytest.mark.slow
def test_autoshard_with_a_given_plan_runs_an_moe_step_data_parallel(zoo3p):
    """Without tuning (a plan given), autoshard runs the MoE step as plain data parallelism, equal to jax.jit."""
    import optax

    import mistjax

    cfg = models.get_config("moe-tiny")
    graphdef, params = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param)

    def loss_fn(p, batch):
        logits = nnx.merge(graphdef, p)(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    tx = optax.sgd(0.1)
    tokens = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    _, want = jax.jit(zoo3p.optax_step(loss_fn, tx))(zoo3p.optax_state(params, tx), batch)
    step = mistjax.autoshard(zoo3p.optax_step(loss_fn, tx), jax.devices(), plan=mistjax.uniform_plan(2, 8),
                             verbose=False)
    state = step.place(zoo3p.optax_state(jax.tree.map(jnp.copy, params), tx), batch)  # the step donates it
    _, metrics = step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(want["loss"]), rtol=1e-5)
