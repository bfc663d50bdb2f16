"""Tests of the model zoo (models/): shapes, parameter counts, logical axes, scan structure, numerics."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import models
from mistjax.core.jaxpr import scan_counts
from models import ModelConfig, falcon, gpt3, llama

TINY = ["gpt3-tiny", "llama-tiny", "falcon-tiny"]
ALLOWED_AXES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "position"}
CHECKPOINT_NAMES = {"layer_input", "qkv_proj", "attn_out", "mlp_in", "mlp_out"}
REPO = Path(__file__).resolve().parents[1]


def _tokens(cfg: ModelConfig, batch: int = 2, seq: int = 16, seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, cfg.vocab_size, dtype=jnp.int32)


@pytest.fixture(scope="module")
def tiny_models() -> dict[str, models.CausalLM]:
    return {name: models.build(models.get_config(name), rngs=nnx.Rngs(0)) for name in TINY}


def _forward(model: models.CausalLM, tokens: jax.Array, method: str = "__call__") -> jax.Array:
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, t: getattr(nnx.merge(graphdef, s), method)(t))(state, tokens)


def _count(model_or_abstract) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model_or_abstract, nnx.Param)))


@pytest.mark.parametrize("name", TINY)
def test_output_shape_and_dtype(tiny_models, name):
    cfg = models.get_config(name)
    logits = _forward(tiny_models[name], _tokens(cfg))
    assert logits.shape == (2, 16, cfg.vocab_size)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize("name", TINY)
def test_num_params_matches_built_tiny(tiny_models, name):
    cfg = models.get_config(name)
    model = tiny_models[name]
    assert _count(model) == cfg.num_params()
    assert _count(model.layers) == cfg.num_layers * cfg.params_per_layer()
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("name", sorted(models.PRESETS))
def test_num_params_matches_abstract_build(name):
    # eval_shape builds without allocating, so every preset (up to 22B) can be checked exactly.
    cfg = models.get_config(name)
    abstract = nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))
    assert _count(abstract) == cfg.num_params()
    assert _count(abstract.layers) == cfg.num_layers * cfg.params_per_layer()


@pytest.mark.parametrize("family", ["gpt3", "llama", "falcon"])
@pytest.mark.parametrize("size,lo,hi", [("1.3b", 1.2, 1.45), ("2.7b", 2.5, 2.9), ("7b", 6.4, 7.1),
                                        ("13b", 12.4, 13.5), ("22b", 21.0, 23.0)])
def test_paper_preset_counts_near_names(family, size, lo, hi):
    assert lo * 1e9 <= models.get_config(f"{family}-{size}").num_params() <= hi * 1e9


def test_family_presets_and_registry():
    assert set(models.PRESETS) == set(gpt3.PRESETS) | set(llama.PRESETS) | set(falcon.PRESETS)
    assert llama.PRESETS["llama-tiny"].num_kv_heads == 4
    for cfg in models.PRESETS.values():
        if cfg.name.endswith(("-tiny", "-small")):
            assert cfg.num_heads % 8 == 0 and cfg.num_kv_heads % 4 == 0 and cfg.ffn_size % 8 == 0
    with pytest.raises(ValueError, match="llama-7b"):
        models.get_config("llama-8b")
    with pytest.raises(ValueError, match="family='gpt3'"):
        models.GPT3(models.get_config("llama-tiny"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", TINY + ["llama-small"])
def test_logical_axes_on_every_param(tiny_models, name):
    model = tiny_models.get(name) or nnx.eval_shape(lambda: models.build(models.get_config(name),
                                                                         rngs=nnx.Rngs(0)))
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    axes = dict(nnx.to_flat_state(models.logical_axes(model)))
    assert params.keys() == axes.keys()
    assert axes == dict(nnx.to_flat_state(models.logical_axes(nnx.state(model, nnx.Param))))
    for path, var in params.items():
        names = axes[path]
        assert isinstance(names, tuple) and len(names) == var.ndim, (path, names, var.shape)
        assert set(names) <= ALLOWED_AXES, (path, names)
        stacked = path[0] == "layers"
        assert (names[0] == "layers") == stacked and names.count("layers") == int(stacked), (path, names)
        if stacked:
            assert var.shape[0] == models.get_config(name).num_layers
    if name.startswith("gpt3"):
        assert axes[("pos_embed",)] == ("position", "embed")


@pytest.mark.parametrize("name", TINY)
def test_scanned_equals_unrolled(tiny_models, name):
    model, tokens = tiny_models[name], _tokens(models.get_config(name))
    scanned = _forward(model, tokens)
    unrolled = _forward(model, tokens, "forward_unrolled")
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", TINY)
def test_jaxpr_has_one_top_level_scan_over_stacked_params(tiny_models, name):
    graphdef, params = nnx.split(tiny_models[name], nnx.Param)
    cfg = models.get_config(name)
    closed = jax.make_jaxpr(lambda p, t: nnx.merge(graphdef, p)(t))(params, _tokens(cfg))
    jaxpr = closed.jaxpr
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1
    scan = scans[0]
    n_consts, n_carry = scan_counts(scan.params)
    assert (n_consts, n_carry, scan.params["length"]) == (0, 1, cfg.num_layers)
    # Params are flattened first (sorted State keys), then tokens; pick the stacked ones in that order.
    leaves = jax.tree_util.tree_leaves_with_path(params)
    assert len(jaxpr.invars) == len(leaves) + 1
    layer_vars = [v for (path, _), v in zip(leaves, jaxpr.invars) if path[0].key == "layers"]
    xs = scan.invars[n_consts + n_carry:]
    assert len(xs) == len(layer_vars) == len(jax.tree.leaves(nnx.state(tiny_models[name].layers, nnx.Param)))
    assert all(a is b for a, b in zip(xs, layer_vars)), "scan xs must be the stacked params, untouched"
    carry = scan.invars[n_consts].aval
    assert carry.shape == (2, 16, cfg.hidden_size) and carry.dtype == jnp.float32
    body_names = {e.params["name"] for e in scan.params["jaxpr"].jaxpr.eqns if e.primitive.name == "name"}
    assert body_names == CHECKPOINT_NAMES
    # The model recomputes only elementwise chains by itself (norms, activations: `models.layers.recomputed`);
    # checkpointing matmuls is the plan's choice.
    remats = [e for e in jaxpr.eqns if "checkpoint" in e.primitive.name or "remat" in e.primitive.name]
    assert remats and not any(i.primitive.name == "dot_general" for e in remats for i in e.params["jaxpr"].eqns)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("attention,block", [("xla", 128), ("blockwise", 128), ("blockwise", 5)])
def test_attention_kernels_agree_with_reference(tiny_models, name, attention, block):
    model, cfg = tiny_models[name], models.get_config(name)
    assert cfg.attention == "fused"  # the default: on CPU the blockwise kernel
    other = models.build(cfg.replace(attention=attention, attention_block=block), rngs=nnx.Rngs(0))
    ref_model = models.build(cfg.replace(attention="reference"), rngs=nnx.Rngs(0))
    nnx.update(other, nnx.state(model, nnx.Param))
    nnx.update(ref_model, nnx.state(model, nnx.Param))
    tokens = _tokens(cfg)
    ref = _forward(ref_model, tokens)
    np.testing.assert_allclose(_forward(other, tokens), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_forward(model, tokens), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", TINY)
def test_bf16_compute_close_to_fp32(tiny_models, name):
    cfg = models.get_config(name)
    bf16 = models.build(cfg.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))
    nnx.update(bf16, nnx.state(tiny_models[name], nnx.Param))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(bf16, nnx.Param)))  # fp32 master
    tokens = _tokens(cfg)
    ref, out = _forward(tiny_models[name], tokens), _forward(bf16, tokens)
    assert out.dtype == jnp.float32
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert 0 < rel < 3e-2, rel
    # The scanned hidden state is carried in bf16.
    graphdef, params = nnx.split(bf16, nnx.Param)
    jaxpr = jax.make_jaxpr(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens).jaxpr
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert scan.invars[0].aval.dtype == jnp.bfloat16


def test_body_transform_remat_matches(tiny_models):
    # The runtime, not the model, applies remat; run_layers exposes the scan body for that.
    model, tokens = tiny_models["llama-tiny"], _tokens(models.get_config("llama-tiny"))
    policy = jax.checkpoint_policies.save_only_these_names("qkv_proj", "attn_out")
    remat = lambda body: nnx.remat(body, policy=policy)
    graphdef, state = nnx.split(model)

    def loss(s, t):
        m = nnx.merge(graphdef, s)
        return m.compute_logits(m.run_layers(m.embed_tokens(t), body_transform=remat)).sum()

    np.testing.assert_allclose(jax.jit(loss)(state, tokens), _forward(model, tokens).sum(), rtol=1e-5)
    jaxpr = jax.make_jaxpr(jax.grad(loss))(state, tokens).jaxpr
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 2  # forward and backward stacks
    # Under grad, the rematerialized forward shows up inside the backward scan (primitive "remat2").
    assert any(e.primitive.name in ("checkpoint", "remat2") for e in scans[1].params["jaxpr"].jaxpr.eqns)


def test_born_sharded_under_mesh_and_rules():
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    rules = (("layers", None), ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"),
             ("kv_heads", "tensor"), ("head_dim", None), ("vocab", "tensor"), ("position", None))
    cfg = models.get_config("llama-tiny")
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        model = nnx.jit(lambda: models.build(cfg, rngs=nnx.Rngs(0)))()
    assert model.layers.attn.wq[...].sharding.spec == jax.P(None, "fsdp", "tensor")
    assert model.lm_head.kernel[...].sharding.spec == jax.P("fsdp", "tensor")


BASE = models.get_config("llama-tiny")


@pytest.mark.parametrize("changes,field", [
    ({"vocab_size": 0}, "vocab_size"), ({"hidden_size": -64}, "hidden_size"),
    ({"num_layers": 0}, "num_layers"), ({"num_heads": 0}, "num_heads"), ({"num_kv_heads": 0}, "num_kv_heads"),
    ({"ffn_size": 0}, "ffn_size"), ({"max_seq_len": 0}, "max_seq_len"),
    ({"num_heads": 7}, "num_heads"),  # does not divide hidden 64
    ({"num_kv_heads": 3}, "num_kv_heads"),  # does not divide 8 heads
    ({"rotary_pct": 0.125}, "rotary_pct"),  # 8 * 0.125 = 1 rotary dim: odd
    ({"rotary_pct": 0.3}, "rotary_pct"),  # 2.4 dims: not an integer
    ({"rotary_pct": 1.5}, "rotary_pct"), ({"rotary_pct": -0.25}, "rotary_pct"),
    ({"family": "bert"}, "family"), ({"dtype": "float64"}, "dtype"), ({"param_dtype": "int8"}, "param_dtype"),
    ({"attention": "flash"}, "attention"), ({"attention_block": 0}, "attention_block"),
    ({"attention_block": True}, "attention_block"), ({"norm_eps": 0.0}, "norm_eps"),
    ({"loss_chunks": 0}, "loss_chunks"),
    ({"family": "gpt3"}, "rotary_pct"),  # gpt3 has learned positions, llama-tiny has rotary 0.25
])
def test_config_validation(changes, field):
    with pytest.raises(ValueError, match=rf"\.{field}: "):
        BASE.replace(**changes)


def test_config_helpers():
    assert BASE.head_dim == 8 and BASE.rotary_dims == 2
    cfg = models.get_config("gpt3-1.3b")
    assert cfg.num_params() == cfg.embedding_params() + 24 * cfg.params_per_layer() + cfg.head_params()
    assert models.human_count(1_316_110_336) == "1.32B"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1  # type: ignore[misc]


def test_cli_lists_every_preset():
    out = subprocess.run([sys.executable, "-m", "models", "--list"], cwd=REPO, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    for name in models.PRESETS:
        assert name in out
    assert "1.42B" in out  # gpt3-1.3b with learned positions for 4096 tokens
    help_out = subprocess.run([sys.executable, "-m", "models", "--help"], cwd=REPO, capture_output=True,
                              text=True, check=True, timeout=120).stdout
    assert "--list" in help_out


# ----------------------------------------------------------------------------------- fused LM head
@pytest.mark.parametrize("name", ["gpt3-tiny", "llama-tiny"])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_head_matches_plain_cross_entropy(name, masked):
    """Loss and every gradient of the fused head + cross-entropy equal the materialised-logits loss."""
    cfg = models.get_config(name)
    gd, params = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(0)
    batch = {k: jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 32)), jnp.int32) for k in ("inputs", "targets")}
    if masked:
        batch["mask"] = jnp.asarray(rng.integers(0, 2, (2, 32)))
    fused, grads = jax.value_and_grad(models.make_loss_fn(gd))(params, batch)
    plain, ref = jax.value_and_grad(models.make_loss_fn(gd, fused_head=False))(params, batch)
    np.testing.assert_allclose(float(fused), float(plain), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_fused_head_keeps_one_slice_of_logits():
    """With 8 slices the head's forward peak holds about one slice's logits, in the analysis (of the
    whole loss) and in the head's program XLA:CPU compiles; without slicing, the whole batch's."""
    from mistjax.analysis import analyze_model

    peaks, temps = {}, {}
    for chunks in (1, 8):
        cfg = models.get_config("gpt3-tiny").replace(vocab_size=4096, max_seq_len=256, loss_chunks=chunks)
        gd, params = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        loss = models.make_loss_fn(gd)
        prof = analyze_model(loss, params, policies=("none",), cache=False)
        from mistjax.analysis.poly import B, S, T

        peaks[chunks] = float(prof.post.fwd_peak_bytes["none"].subs({B: 4, S: 256, T: 1}))
        from models.head_loss import linear_cross_entropy

        head = jax.grad(lambda x, w, t, wt, c=chunks: linear_cross_entropy(x, w, t, wt, c), argnums=(0, 1))
        args = (jax.ShapeDtypeStruct((4, 256, 64), jnp.float32), jax.ShapeDtypeStruct((64, 4096), jnp.float32),
                jax.ShapeDtypeStruct((4, 256), jnp.int32), jax.ShapeDtypeStruct((4, 256), jnp.float32))
        temps[chunks] = jax.jit(head).lower(*args).compile().memory_analysis().temp_size_in_bytes
    logits = 4 * 256 * 4096 * 4  # one fp32 copy of the whole batch's logits
    assert peaks[1] - peaks[8] > 0.8 * logits
    assert temps[1] - temps[8] > 0.8 * logits
