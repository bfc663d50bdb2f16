"""Fused attention (models/attention.py) and how mistjax.analysis prices it.

The blockwise kernel against the einsum reference (forward and gradients, fp32 and bf16, causal, GQA, odd
lengths and blocks that do not divide them), its compiled memory (linear in s, where unfused attention is
quadratic), the analysis of a fused block (matmul FLOPs 2.5x the forward's in the backward, O(s)
residuals, per-block peaks), cuDNN priced like the kernel, and tensor parallelism equal to one device.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import sympy as sp
from flax import nnx
from test_runtime import BATCH, DEVICES, SEQ, assert_matches_reference

import mistjax
import models
from mistjax.analysis import B, S, T, analyze_model
from mistjax.analysis.analyze import check_block_primitives
from mistjax.analysis.fused import SCORE_CASTS, SCORE_ELEMENTWISE, per_block, unit_of
from mistjax.analysis.poly import Poly
from mistjax.train.data import SyntheticTokens
from mistjax.train.state import TrainState
from models import attention as fa
from models import make_loss_fn
from models.layers import Attention, reference_attention, xla_attention

SHAPES = [  # (batch, seq, heads, kv_heads, head_dim, block)
    (2, 16, 4, 4, 8, 128),  # one block (s <= block)
    (2, 37, 4, 2, 8, 8),  # GQA, odd length, 5 blocks of 8 (last one padded)
    (1, 33, 4, 1, 16, 5),  # MQA, 7 balanced blocks of 5 (two padding keys)
    (1, 64, 8, 2, 8, 16),  # blocks divide the sequence
]


def _qkv(b, s, n, kv, d, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(b, s, n, d), (b, s, kv, d), (b, s, kv, d), (b, s, n, d)]
    return [jax.random.normal(k, sh).astype(dtype) for k, sh in zip(ks, shapes)]


def _value_and_vjp(fn, q, k, v, do):
    def run(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(do.astype(out.dtype)))

    return jax.jit(run)(q, k, v, do)


def _rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


# ------------------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("b,s,n,kv,d,block", SHAPES)
def test_blockwise_matches_reference_fp32(b, s, n, kv, d, block):
    q, k, v, do = _qkv(b, s, n, kv, d)
    got = _value_and_vjp(lambda *a: fa.blockwise_attention(*a, block_size=block), q, k, v, do)
    ref = _value_and_vjp(reference_attention, q, k, v, do)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert x.shape == r.shape and x.dtype == r.dtype
        assert _rel(x, r) < 1e-5, name


def test_blockwise_non_causal_matches_xla():
    q, k, v, do = _qkv(2, 21, 4, 2, 8)
    got = _value_and_vjp(lambda *a: fa.blockwise_attention(*a, block_size=8, causal=False), q, k, v, do)
    ref = _value_and_vjp(lambda *a: jax.nn.dot_product_attention(*a, is_causal=False), q, k, v, do)
    for x, r in zip(got, ref):
        assert _rel(x, r) < 1e-5


@pytest.mark.parametrize("s,kv,block", [(64, 2, 16), (129, 4, 128)])
def test_blockwise_bf16_as_accurate_as_unfused_bf16(s, kv, block):
    """bf16 in, fp32 statistics: the error against an fp32 computation on the same (bf16-rounded) inputs is
    the bf16 rounding of P before PV and of the results (~2^-9 relative per element, ~2e-3 in norm), as
    for XLA's unfused attention in bf16. Bound: 1e-2, and at most 1.5x XLA's own error + 1e-3."""
    q, k, v, do = _qkv(2, s, 8, kv, 32, jnp.bfloat16, seed=s)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    truth = _value_and_vjp(reference_attention, *f32)
    got = _value_and_vjp(lambda *a: fa.blockwise_attention(*a, block_size=block), q, k, v, do)
    xla = _value_and_vjp(xla_attention, q, k, v, do)
    for name, x, y, t in zip(("out", "dq", "dk", "dv"), got, xla, truth):
        assert x.dtype == jnp.bfloat16
        err, xla_err = _rel(x, t), _rel(y, t)
        assert err < 1e-2 and err <= 1.5 * xla_err + 1e-3, (name, err, xla_err)


def test_blockwise_rejects_bad_input():
    q, k, v, _ = _qkv(1, 8, 4, 2, 8)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        fa.blockwise_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError, match="kv_heads dividing heads"):
        fa.blockwise_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    with pytest.raises(ValueError, match="dtypes differ"):
        fa.blockwise_attention(q, k.astype(jnp.bfloat16), v)


def test_blockwise_jits_are_named_units():
    q, k, v, do = _qkv(1, 16, 4, 2, 8)
    fwd = jax.make_jaxpr(lambda *a: jax.vjp(lambda *x: fa.blockwise_attention(*x, block_size=64), *a)[0])(q, k, v)
    names = [e.params["name"] for e in fwd.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    assert names == ["fused_attention_fwd_b64"] and unit_of(names[0]) == ("fwd", 64)
    assert unit_of("fused_attention_bwd_b64") == ("bwd", 64)
    assert unit_of("dot_product_attention_bwd_wrapper") == ("bwd", None) and unit_of("my_fn") is None
    # Static loops only: the analysis accepts the kernel.
    check_block_primitives(jax.make_jaxpr(lambda *a: jax.grad(lambda *x: fa.blockwise_attention(*x).sum(),
                                                              argnums=(0, 1, 2))(*a))(q, k, v))


# ------------------------------------------------------------------------------------------- dispatch


class _FakeGPU:
    platform = "gpu"

    def __init__(self, cc: str):
        self.compute_capability = cc


def test_cudnn_support_rules():
    a100, h100 = _FakeGPU("8.0"), _FakeGPU("9.0")
    assert fa.cudnn_unsupported(128, jnp.bfloat16, a100) is None
    assert fa.cudnn_unsupported(256, jnp.float16, h100) is None
    assert "head dim 192" in fa.cudnn_unsupported(192, jnp.bfloat16, a100)
    assert "head dim 260" in fa.cudnn_unsupported(260, jnp.bfloat16, h100)
    assert "float32" in fa.cudnn_unsupported(128, jnp.float32, h100)
    assert "7.5" in fa.cudnn_unsupported(64, jnp.bfloat16, _FakeGPU("7.5"))
    assert "cpu" in fa.cudnn_unsupported(64, jnp.bfloat16)  # the tests run on CPU


def test_fused_falls_back_with_one_warning(monkeypatch):
    q, k, v, _ = _qkv(1, 16, 2, 2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on CPU the blockwise kernel is the intended path: silent
        np.testing.assert_allclose(fa.fused_attention(q, k, v), fa.blockwise_attention(q, k, v))
    monkeypatch.setattr(fa.jax, "devices", lambda *a: [_FakeGPU("8.0")])
    fa._warn_fallback.cache_clear()
    with pytest.warns(UserWarning, match=r"float32 .*blockwise"):
        fa.fused_attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        fa.fused_attention(q, k, v)


def test_cudnn_option_refuses_a_cpu():
    cfg = models.get_config("llama-tiny").replace(attention="cudnn", dtype="bfloat16")
    gd, state = nnx.split(nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match="attention='cudnn' cannot run here: the device is cpu"):
        jax.eval_shape(lambda st, t: nnx.merge(gd, st)(t), state, jax.ShapeDtypeStruct((1, 8), jnp.int32))


# ------------------------------------------------------------------------------------- compiled memory


def _attention_layer_temp(attention: str, s: int) -> int:
    cfg = models.get_config("llama-tiny").replace(attention=attention, max_seq_len=s)
    gd, params = nnx.split(Attention(cfg, rngs=nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((1, s, cfg.hidden_size), jnp.float32)
    loss = lambda p, x: jnp.sum(nnx.merge(gd, p)(x) ** 2)  # noqa: E731
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_compiled_temp_linear_for_blockwise_quadratic_for_xla():
    """XLA:CPU temp of value_and_grad through one attention layer at s = 256 and 1024 (4x): the blockwise
    kernel's grows ~4x (measured 5.7 -> 22.7 MB), the unfused one's excess over it ~16x (8.5 -> 68 MB in all:
    its 16-bit s^2 scores, probabilities and their gradients dominate at 1024)."""
    blk = [_attention_layer_temp("blockwise", s) for s in (256, 1024)]
    xla = [_attention_layer_temp("xla", s) for s in (256, 1024)]
    assert blk[1] / blk[0] < 5
    assert (xla[1] - blk[1]) / (xla[0] - blk[0]) > 10
    assert blk[1] < xla[1] / 2


# ---------------------------------------------------------------------------------------------- analysis


def _profile(name: str, policies=("none",), **changes):
    cfg = models.get_config(name).replace(**changes)
    gd, state = nnx.split(nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0))))
    return cfg, analyze_model(make_loss_fn(gd), state, policies=policies)


def _coef(expr, monomial) -> sp.Expr:
    return sp.Poly(sp.expand(expr), B, S, 1 / T).coeff_monomial(monomial)


@pytest.fixture(scope="module")
def profiles():
    pols = ("none", "full", "names:attn_out")
    return {att: _profile("llama-tiny", pols, attention=att) for att in ("xla", "blockwise")}


def test_fused_block_flops_include_the_recompute(profiles):
    (cfg, xla), (_, fused) = profiles["xla"], profiles["blockwise"]
    n, d = cfg.num_heads, cfg.head_dim
    s2 = B * S**2 / T  # attention matmuls scale as b s^2 (heads split over t)
    fwd_attn = _coef(xla.block.fwd_matmul_flops, s2)
    assert fwd_attn == 4 * n * d  # QK^T and PV
    assert _coef(fused.block.fwd_matmul_flops, s2) == fwd_attn
    assert _coef(xla.block.bwd_matmul_flops, s2) == 2 * fwd_attn  # unfused backward: 4 matmuls
    assert _coef(fused.block.bwd_matmul_flops, s2) == sp.Rational(5, 2) * fwd_attn  # + recomputed QK^T
    # The unit: all of it at matmul rate would be fwd 4 + bwd 10 (+ D = rowsum(dO * O)).
    assert _coef(fused.block.fused_matmul_flops, s2) == 14 * n * d
    assert xla.block.fused_flops == 0 and xla.block.fused_bytes == 0


def test_fused_block_saves_only_o_and_lse(profiles):
    (cfg, xla), (_, fused) = profiles["xla"], profiles["blockwise"]
    none = sp.expand(fused.block.saved_bytes["none"])
    assert sp.degree(none, S) == 1 and sp.degree(sp.expand(xla.block.saved_bytes["none"]), S) == 2
    # the probabilities only, in the compute dtype (models.layers.scaled_causal_softmax; fp32 here)
    assert _coef(xla.block.saved_bytes["none"], B * S**2 / T) == cfg.num_heads * 4
    # names:attn_out keeps the layer input plus the output; fused also its log-sum-exp (fp32 per row).
    out = cfg.hidden_size * 4
    lse = cfg.num_heads * 4
    extra = lambda p: sp.expand(p.block.saved_bytes["names:attn_out"] - p.block.saved_bytes["full"])  # noqa: E731
    assert extra(xla) == out * B * S / T
    assert extra(fused) == (out + lse) * B * S / T
    # q, k, v, o, lse read and written, dO / dq / dk / dv in the backward (fp32 here).
    kvw = cfg.num_kv_heads * cfg.head_dim * 4
    fwd = 2 * out + 2 * kvw + lse
    bwd = 3 * out + 2 * kvw + lse + (out + 2 * kvw)
    assert sp.expand(fused.block.fused_bytes) == (fwd + bwd) * B * S / T


def test_fused_block_peak_is_per_block_above_the_block_size(profiles):
    (_, xla), (cfg, fused) = profiles["xla"], profiles["blockwise"]
    peak = fused.block.bwd_peak_bytes["none"]
    assert isinstance(peak, sp.Piecewise)
    small, large = peak.args[0].expr, peak.args[1].expr
    block = cfg.attention_block
    at = lambda e, s, b=1: float(sp.lambdify((B, S, T), e, "numpy")(b, s, 1))  # noqa: E731
    assert at(small, block) == at(large, block)  # continuous where the kernel starts a second block
    assert at(peak, 4096) / at(peak, 2048) == pytest.approx(2.0, rel=0.02)  # linear in s above the block
    unfused = xla.block.bwd_peak_bytes["none"]
    assert at(unfused, 4096) / at(unfused, 2048) == pytest.approx(4.0, rel=0.02)
    assert per_block(Poly({(1, 2, 1): 3, (1, 1, 0): 5}), 128) == Poly({(1, 1, 1): 384, (1, 1, 0): 5})


def test_fused_block_tp_collectives_are_the_unfused_ones(profiles):
    """Heads split over `tensor` stay local through the kernel's loops: no collective inside attention."""
    (_, xla), (_, fused) = profiles["xla"], profiles["blockwise"]

    def kinds(p):
        return sorted((c.kind, c.phase, c.where, str(c.nbytes)) for c in p.block.tp_collectives)

    assert kinds(fused) == kinds(xla)
    assert not fused.block.notes  # every primitive of the kernel had a layout rule
    # Every residual is split over t (the kernel's accumulators are per head, never gathered).
    none = sp.expand(fused.block.saved_bytes["none"])
    assert all(term.is_number or term.has(T) for term in sp.Add.make_args(none))


def test_block_sizes_the_fit_cannot_follow_are_refused():
    cfg = models.get_config("llama-tiny").replace(attention_block=16)  # 1, 1, 2, 2 blocks at s = 8..32
    gd, state = nnx.split(nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match=r"16 keys per block.*>= 32 \(default 128\)"):
        analyze_model(make_loss_fn(gd), state, policies=("none",))
    # Blocks dividing every traced length fit exactly (4 blocks of 8 at s = 32): no Piecewise needed.
    _, prof = _profile("llama-tiny", attention="blockwise", attention_block=8)
    peak = sp.lambdify((B, S, T), prof.block.bwd_peak_bytes["none"], "numpy")
    assert peak(1, 4096, 1) / peak(1, 2048, 1) == pytest.approx(2.0, rel=0.02)  # traced per block of 8: linear
    assert sp.degree(sp.expand(prof.block.bwd_flops), S) == 2


@pytest.fixture
def cudnn_traceable(monkeypatch):
    """Test-only: lets cuDNN attention TRACE on this CPU machine (its version probe replaced; never lowered)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr("models.layers.cudnn_unsupported", lambda *a, **k: None)


def test_cudnn_model_priced_like_the_blockwise_kernel(cudnn_traceable):
    """A model traced on a GPU host (cuDNN primitives) and on a CPU host (the blockwise kernel): same
    FLOPs per score element, same matmul FLOPs, same residuals, same collectives, same unit traffic."""
    _, cud = _profile("llama-tiny", attention="cudnn", dtype="bfloat16")
    _, blk = _profile("llama-tiny", attention="blockwise", dtype="bfloat16")
    c, k = cud.block, blk.block
    s2 = B * S**2 / T
    for q in ("fwd_flops", "bwd_flops", "fwd_matmul_flops", "bwd_matmul_flops", "fused_matmul_flops"):
        assert _coef(getattr(c, q), s2) == _coef(getattr(k, q), s2), q
    assert sp.expand(c.fwd_matmul_flops - k.fwd_matmul_flops) == 0
    assert sp.expand(c.bwd_matmul_flops - k.bwd_matmul_flops) == 0
    assert sp.expand(c.saved_bytes["none"] - k.saved_bytes["none"]) == 0
    assert sp.expand(c.fused_bytes - k.fused_bytes) == 0
    assert sorted(map(str, c.tp_collectives)) == sorted(map(str, k.tp_collectives)) and not c.notes
    n = models.get_config("llama-tiny").num_heads
    assert _coef(c.fwd_flops, s2) - _coef(c.fwd_matmul_flops, s2) == n * (SCORE_ELEMENTWISE["fwd"]
                                                                         + SCORE_CASTS["fwd"] + 1)


# ------------------------------------------------------------------------------------ tensor parallelism


def test_fused_attention_tp2_trains_like_one_device():
    cfg = models.get_config("llama-tiny").replace(attention="blockwise")
    state = TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    loss_fn = make_loss_fn(state.graphdef)
    batch = SyntheticTokens(cfg.vocab_size, SEQ, BATCH, kind="random").batch(0)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(state.params, batch)

    def train_step(state, batch):
        loss, grads = mistjax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss, "grads": grads}

    plan = mistjax.uniform_plan(cfg.num_layers, DEVICES, tp=2, micro_batch=BATCH // (DEVICES // 2), shard_opt=True)
    step = mistjax.autoshard(train_step, jax.devices(), plan=plan)
    _, metrics = step(jax.tree.map(jnp.copy, state), batch)
    assert_matches_reference(metrics, float(ref_loss), ref_grads)
