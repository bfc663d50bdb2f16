"""Layers shared by the GPT-3, Llama and Falcon families (Flax NNX).

Conventions:

* No biases in linear layers (Mist's models have none); norms have a scale, LayerNorm also a bias.
* Every ``nnx.Param`` carries logical axis names in its ``out_sharding`` metadata (set through
  ``nnx.with_partitioning``). Names used: ``vocab``, ``embed``, ``heads``, ``kv_heads``, ``head_dim``,
  ``mlp``, ``position`` (rows of GPT-3's learned position table) and ``layers`` (leading axis of the
  scanned stack, added by ``nnx.vmap``'s ``transform_metadata``).
* Mixed precision: params are stored in ``param_dtype`` and cast to the compute ``dtype`` where they are used;
  norms, rotary angles and softmax run in float32; logits come back as float32.
* Activations the runtime may want to save or offload are tagged with ``checkpoint_name``: ``layer_input``,
  ``qkv_proj``, ``attn_out``, ``mlp_in``, ``mlp_out``. Nothing here applies remat.
* ``ModelConfig.elementwise="eager"`` prices the chains PyTorch has no single op for (RMSNorm, rotary, SwiGLU)
  as Megatron-LM's PyTorch code runs them, one kernel per op (`eager_op`); the numbers computed are the same
  math, and XLA still fuses them when the model runs here. LayerNorm and GELU are one PyTorch op (apex's fused
  LayerNorm, ``F.gelu``) and keep their fused form in both modes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as core_spmd
from jax.ad_checkpoint import checkpoint_name

from mistjax.analysis.graph import EAGER_JIT  # the marker the analysis reads (its protocol)
from mistjax.core.fp8 import fp8_einsum, fp8_einsums
from models.attention import blockwise_attention, cudnn_attention, cudnn_unsupported, fused_attention
from models.config import DEFAULT_ROPE_BASE, ModelConfig

INIT_STD = 0.02  # Megatron's init_method_std
ROPE_BASE = DEFAULT_ROPE_BASE  # the default of ModelConfig.rope_base

_ones = nnx.initializers.ones
_zeros = nnx.initializers.zeros


def compute_dtype(config: ModelConfig) -> jnp.dtype:
    """The compute dtype of ``config`` as a numpy dtype."""
    return jnp.dtype(config.dtype)


def project(specs: tuple[str, ...], x: jax.Array, ws: tuple[jax.Array, ...], fp8: bool) -> tuple[jax.Array, ...]:
    """``jnp.einsum(spec, x, w)`` for each (spec, w); with ``fp8`` as FP8 GEMMs sharing one cast of ``x``
    (`mistjax.core.fp8.fp8_einsums`)."""
    return fp8_einsums(specs, x, ws) if fp8 else tuple(jnp.einsum(s, x, w) for s, w in zip(specs, ws))


def linear(x: jax.Array, w: jax.Array, fp8: bool) -> jax.Array:
    """``x [b, t, in] @ w [in, out]``, as an FP8 GEMM when ``fp8``."""
    return fp8_einsum("bti,io->bto", x, w) if fp8 else x @ w


def _eager_sharding() -> bool:
    # Flax shards a Variable at creation by default, which fails outside a mesh (our names are logical, not
    # mesh axes). Shard eagerly only when both a mesh and logical-axis rules are active, so a model can be
    # created anywhere and, under `jax.set_mesh(...)` + `nnx.logical_axis_rules(...)`, born sharded.
    return not jax.sharding.get_abstract_mesh().empty and bool(core_spmd.get_logical_axis_rules())


def partitioned(init: nnx.Initializer, names: Sequence[str]) -> nnx.Initializer:
    """``nnx.with_partitioning`` with the eager-sharding choice above."""
    return nnx.with_partitioning(init, tuple(names), eager_sharding=_eager_sharding())


def make_param(rngs: nnx.Rngs, init: nnx.Initializer, shape: Sequence[int], names: Sequence[str],
               config: ModelConfig) -> nnx.Param:
    """Creates an ``nnx.Param`` in ``config.param_dtype`` annotated with logical axis ``names``."""
    assert len(names) == len(shape), (names, shape)
    return nnx.Param(partitioned(init, names)(rngs.params(), tuple(shape), jnp.dtype(config.param_dtype)))


def out_proj_std(config: ModelConfig) -> float:
    """Init std of projections that write into the residual stream (GPT-2/Megatron: 0.02 / sqrt(2L))."""
    return INIT_STD / math.sqrt(2 * config.num_layers)


# ---------------------------------------------------------------------------------------------- eager ops
def _eager_kernel(x: jax.Array) -> jax.Array:
    return x


_eager_kernel.__name__ = _eager_kernel.__qualname__ = EAGER_JIT
# An identity the analysis reads as "an op-by-op runtime writes this value to memory" (no op of its own).
eager_written = jax.jit(_eager_kernel)


@jax.custom_vjp
def _grad_written(x: jax.Array) -> jax.Array:
    """Identity whose cotangent is marked written: the backward kernel of the op reading ``x``."""
    return x


_grad_written.defvjp(lambda x: (x, None), lambda _, g: (eager_written(g),))


def eager_op(fn: Callable[..., jax.Array], *xs: jax.Array) -> jax.Array:
    """``fn(*xs)`` as one PyTorch eager op: its result is written (one kernel reading ``xs``), and so is the
    gradient it returns for each operand in the backward (autograd runs one backward kernel per op)."""
    return eager_written(fn(*(_grad_written(x) for x in xs)))


@jax.custom_vjp
def _silu_saving_input(x: jax.Array) -> jax.Array:
    """``F.silu``: autograd saves only the input and its backward recomputes the sigmoid (JAX's own rule would
    keep the sigmoid as a residual, a written value PyTorch does not have)."""
    return jax.nn.silu(x)


def _silu_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    sig = jax.nn.sigmoid(x)
    return (g * sig * (1 + x * (1 - sig)),)


_silu_saving_input.defvjp(lambda x: (jax.nn.silu(x), x), _silu_bwd)


# ---------------------------------------------------------------------------------------------- layers
class Norm(nnx.Module):
    """LayerNorm (``kind="layernorm"``: scale + bias) or RMSNorm (``kind="rmsnorm"``: scale only).

    Statistics are computed in float32 whatever the compute dtype; the output is cast back to it. With
    ``elementwise="eager"`` RMSNorm is Megatron-LM's PyTorch module (`_rms_norm_eager`).
    """

    def __init__(self, config: ModelConfig, kind: str, *, rngs: nnx.Rngs):
        if kind not in ("layernorm", "rmsnorm"):
            raise ValueError(f"Norm kind must be 'layernorm' or 'rmsnorm', got {kind!r}")
        self.kind = kind
        self.eps = config.norm_eps
        self.dtype = compute_dtype(config)
        self.eager = config.elementwise == "eager" and kind == "rmsnorm"
        self.scale = make_param(rngs, _ones, (config.hidden_size,), ("embed",), config)
        self.bias = (make_param(rngs, _zeros, (config.hidden_size,), ("embed",), config)
                     if kind == "layernorm" else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.eager:
            return _rms_norm_eager(self.eps, self.dtype, x, self.scale[...])
        bias = self.bias[...] if self.bias is not None else None
        return recomputed(partial(_normalize, self.kind, self.eps, self.dtype))(x, self.scale[...], bias)


def recomputed(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``fn`` that keeps only its inputs for the backward and recomputes the rest (cheap elementwise
    chains: norms, activations), as Megatron-LM's fused kernels do; without it autodiff would keep every
    intermediate, several of them in float32."""
    return jax.checkpoint(fn, prevent_cse=True)


def _normalize(kind: str, eps: float, dtype: Any, x: jax.Array, scale: jax.Array, bias: jax.Array | None
               ) -> jax.Array:
    x = x.astype(jnp.float32)
    if kind == "layernorm":
        x = x - jnp.mean(x, axis=-1, keepdims=True)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)


def _rms_norm_eager(eps: float, dtype: Any, x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm op by op as Megatron-LM's ``megatron/model/rms_norm.py`` runs it (core_r0.4.0): ``x.float()``,
    ``pow(2)``, ``mean(-1)``, ``+ eps`` and ``rsqrt`` (on one value per token), ``x * rsqrt``,
    ``type_as(x)``, ``* weight`` in the compute dtype. Autograd keeps every intermediate (no recompute)."""
    x32 = eager_op(lambda a: a.astype(jnp.float32), x)
    sq = eager_op(lambda a: a * a, x32)  # its backward reads x32 (no 2x residual)
    ms = eager_op(lambda a: jnp.mean(a, axis=-1, keepdims=True), sq)
    inv = eager_op(lambda a: jax.lax.rsqrt(a + eps), ms)
    y = eager_op(jnp.multiply, x32, inv)
    y = eager_op(lambda a: a.astype(dtype), y)
    return eager_op(jnp.multiply, y, scale.astype(dtype))


def rotary_frequencies(rotary_dims: int, base: float = ROPE_BASE, scaling: tuple = ()) -> jax.Array:
    """Angular frequency of each rotated pair, ``[rotary_dims // 2]`` float32.

    Args:
        rotary_dims: even number of rotated head dims.
        base: RoPE's base wavelength theta (``ModelConfig.rope_base``).
        scaling: ``ModelConfig.rope_scaling``: ``()``, ``("linear", factor)`` or
            ``("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)``.
    """
    half = rotary_dims // 2
    inv_freq = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / rotary_dims))
    if not scaling:
        return inv_freq
    kind, factor = scaling[0], scaling[1]
    if kind == "linear":
        return inv_freq / factor
    # llama3: wavelengths above original_len / low_freq_factor are stretched by `factor`, those below
    # original_len / high_freq_factor kept, the band between blended linearly in original_len / wavelength.
    # The clip is that piecewise rule in one traced expression (no host constant enters the layer scan).
    low, high, original_len = scaling[2], scaling[3], scaling[4]
    periods_in_context = original_len * inv_freq / (2 * math.pi)  # original_len / wavelength
    keep = jnp.clip((periods_in_context - low) / (high - low), 0.0, 1.0)
    return (1.0 - keep) * inv_freq / factor + keep * inv_freq


def _rotary_tables(seq: int, rotary_dims: int, base: float = ROPE_BASE, scaling: tuple = ()
                   ) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotation angles, ``[1, seq, 1, rotary_dims // 2]`` in float32 (constants)."""
    inv_freq = rotary_frequencies(rotary_dims, base, scaling)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [seq, half]
    return jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]


def _rotary_eager(x: jax.Array, rotary_dims: int, base: float = ROPE_BASE, scaling: tuple = ()) -> jax.Array:
    """Rotary op by op as Megatron-LM's ``apply_rotary_pos_emb`` runs it (core_r0.4.0), in the compute dtype:
    ``t * cos``, ``rotate_half`` (``-x2`` and a concatenation; the chunk is a view whose backward is one
    concatenation kernel), ``* sin``, the sum, and the concatenation with the unrotated dims (a copy)."""
    tables = _rotary_tables(x.shape[1], rotary_dims, base, scaling)
    cos, sin = (jnp.concatenate([c, c], axis=-1).astype(x.dtype) for c in tables)
    t, t_pass = x[..., :rotary_dims], x[..., rotary_dims:]
    x1, x2 = jnp.split(_grad_written(t), 2, axis=-1)
    rotated = eager_written(jnp.concatenate([eager_op(jnp.negative, x2), x1], axis=-1))
    out = eager_op(jnp.add, eager_op(lambda a: a * cos, t), eager_op(lambda a: a * sin, rotated))
    return eager_written(jnp.concatenate([out, t_pass], axis=-1))


def apply_rotary(x: jax.Array, rotary_dims: int, eager: bool = False, *, base: float = ROPE_BASE,
                 scaling: tuple = ()) -> jax.Array:
    """Rotates the first ``rotary_dims`` dims of each head (GPT-NeoX / Megatron ``rotary_percent`` style).

    Args:
        x: ``[batch, seq, heads, head_dim]``; positions are ``0..seq-1``.
        rotary_dims: even number of leading head dims to rotate; 0 returns ``x`` unchanged.
        eager: Megatron-LM's op-by-op form in the compute dtype (`_rotary_eager`).
        base: RoPE's base wavelength (``ModelConfig.rope_base``).
        scaling: frequency scaling (``ModelConfig.rope_scaling``; `rotary_frequencies`).

    Returns:
        Array of the same shape and dtype; angles and the rotation are computed in float32.
    """
    if rotary_dims == 0:
        return x
    if eager:
        return _rotary_eager(x, rotary_dims, base, scaling)
    half = rotary_dims // 2
    cos, sin = _rotary_tables(x.shape[1], rotary_dims, base, scaling)
    rot = x[..., :rotary_dims].astype(jnp.float32)
    x1, x2 = rot[..., :half], rot[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return jnp.concatenate([rotated, x[..., rotary_dims:]], axis=-1)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention as plain einsums with a masked float32 softmax.

    Args:
        q: ``[batch, seq, heads, head_dim]``.
        k: ``[batch, seq, kv_heads, head_dim]``; kv heads are repeated to ``heads`` (query head ``n`` reads kv
            head ``n // (heads // kv_heads)``, the grouping ``jax.nn.dot_product_attention`` uses).
        v: same shape as ``k``.

    Returns:
        ``[batch, seq, heads, head_dim]`` in ``q.dtype``.
    """
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("btnd,bsnd->bnts", q, k, preferred_element_type=jnp.float32)
    logits = logits / math.sqrt(q.shape[-1])
    seq = q.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bnts,bsnd->btnd", probs, v)


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Unfused causal attention as Megatron-LM runs it without FlashAttention, every s x s matrix in the
    compute dtype: the score matmul writes its result in ``q.dtype`` (Megatron's 16-bit ``baddbmm``, fp32
    accumulation), a fused scale-mask-softmax computed in float32 keeps only its probabilities
    (`scaled_causal_softmax`), the probability x value matmul reads them (its result accumulated and cast
    back, so its transpose writes the probabilities' gradient in float32: one s x s matrix more bytes than
    Megatron's 16-bit ``bmm``, kept because the 16-bit product changes the liveness peak of the backward)."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("btnd,bsnd->bnts", q, k)
    probs = scaled_causal_softmax(scores, 1.0 / math.sqrt(q.shape[-1]))
    out = jnp.einsum("bnts,bsnd->btnd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def scaled_causal_softmax(scores: jax.Array, scale: float) -> jax.Array:
    """``softmax(causal_mask(scores * scale))`` over the last axis, float32 math, returned in ``scores.dtype``.

    Megatron-LM's ``FusedScaleMaskSoftmax`` (``scaled_upper_triang_masked_softmax``): one kernel each way; the
    backward reads only the probabilities and the incoming gradient (masked positions have probability 0, so
    the mask is not kept) and writes the scores' gradient in their dtype.
    """
    q_len, k_len = scores.shape[-2:]
    causal = jnp.tril(jnp.ones((q_len, k_len), dtype=bool))
    logits = jnp.where(causal, scores.astype(jnp.float32) * scale, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits, axis=-1).astype(scores.dtype)


def _softmax_fwd(scores: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    probs = scaled_causal_softmax(scores, scale)
    return probs, probs


def _softmax_bwd(scale: float, probs: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    p, g32 = probs.astype(jnp.float32), g.astype(jnp.float32)
    return ((scale * p * (g32 - jnp.sum(g32 * p, axis=-1, keepdims=True))).astype(probs.dtype),)


scaled_causal_softmax.defvjp(_softmax_fwd, _softmax_bwd)


class Attention(nnx.Module):
    """Causal self-attention with grouped-query heads and optional partial rotary embedding.

    The attention core is ``config.attention``: fused (`models.attention`: cuDNN or the blockwise kernel,
    O(seq) residuals) by default, or unfused (``xla`` / ``reference``: the probabilities are saved).

    Kernels: q ``[embed, heads, head_dim]``, k/v ``[embed, kv_heads, head_dim]``, out
    ``[heads, head_dim, embed]``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        h, n, kv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        std = nnx.initializers.normal(INIT_STD)
        self.wq = make_param(rngs, std, (h, n, d), ("embed", "heads", "head_dim"), config)
        self.wk = make_param(rngs, std, (h, kv, d), ("embed", "kv_heads", "head_dim"), config)
        self.wv = make_param(rngs, std, (h, kv, d), ("embed", "kv_heads", "head_dim"), config)
        self.wo = make_param(rngs, nnx.initializers.normal(out_proj_std(config)), (n, d, h),
                             ("heads", "head_dim", "embed"), config)
        self.rotary_dims = config.rotary_dims
        self.rope_base, self.rope_scaling = config.rope_base, config.rope_scaling
        self.eager_rotary = config.elementwise == "eager"
        self.attention = config.attention
        self.attention_block = config.attention_block
        self.fp8 = config.fp8

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        q, k, v = (checkpoint_name(u, "qkv_proj") for u in project(
            ("bte,end->btnd", "bte,ekd->btkd", "bte,ekd->btkd"), x,
            (self.wq[...].astype(dt), self.wk[...].astype(dt), self.wv[...].astype(dt)), self.fp8))
        q, k = (apply_rotary(u, self.rotary_dims, self.eager_rotary, base=self.rope_base, scaling=self.rope_scaling)
                for u in (q, k))
        out = checkpoint_name(self.attend(q, k, v), "attn_out")
        return project(("btnd,nde->bte",), out, (self.wo[...].astype(dt),), self.fp8)[0]

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """Causal attention core with the configured kernel (``ModelConfig.attention``)."""
        if self.attention == "fused":  # the fused kernels' saved output and lse share the output's tag
            return fused_attention(q, k, v, block_size=self.attention_block, residual_name="attn_out")
        if self.attention == "blockwise":
            return blockwise_attention(q, k, v, block_size=self.attention_block, residual_name="attn_out")
        if self.attention == "cudnn":
            reason = cudnn_unsupported(q.shape[-1], q.dtype)
            if reason is not None:
                raise ValueError(f"ModelConfig.attention='cudnn' cannot run here: {reason}; use 'fused' (cuDNN "
                                 "where supported, else the blockwise kernel) or 'blockwise'")
            return cudnn_attention(q, k, v)
        return xla_attention(q, k, v) if self.attention == "xla" else reference_attention(q, k, v)


class GeluMLP(nnx.Module):
    """``gelu(x @ wi) @ wo`` with kernels ``[embed, mlp]`` and ``[mlp, embed]`` (GPT-3, Falcon)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        h, f = config.hidden_size, config.ffn_size
        self.wi = make_param(rngs, nnx.initializers.normal(INIT_STD), (h, f), ("embed", "mlp"), config)
        self.wo = make_param(rngs, nnx.initializers.normal(out_proj_std(config)), (f, h), ("mlp", "embed"),
                             config)
        self.fp8 = config.fp8

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        hidden = checkpoint_name(linear(x, self.wi[...].astype(dt), self.fp8), "mlp_in")
        return checkpoint_name(linear(recomputed(jax.nn.gelu)(hidden), self.wo[...].astype(dt), self.fp8), "mlp_out")


class SwiGLU(nnx.Module):
    """``(silu(x @ w_gate) * (x @ w_up)) @ wo`` (Llama); with ``elementwise="eager"`` the silu and the product
    are two PyTorch ops (Megatron-LM's ``swiglu``: ``F.silu(x[0]) * x[1]``)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        h, f = config.hidden_size, config.ffn_size
        std = nnx.initializers.normal(INIT_STD)
        self.w_gate = make_param(rngs, std, (h, f), ("embed", "mlp"), config)
        self.w_up = make_param(rngs, std, (h, f), ("embed", "mlp"), config)
        self.wo = make_param(rngs, nnx.initializers.normal(out_proj_std(config)), (f, h), ("mlp", "embed"),
                             config)
        self.eager = config.elementwise == "eager"
        self.fp8 = config.fp8

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        gate, up = (checkpoint_name(u, "mlp_in") for u in project(
            ("bti,io->bto", "bti,io->bto"), x, (self.w_gate[...].astype(dt), self.w_up[...].astype(dt)), self.fp8))
        act = _swiglu_eager(gate, up) if self.eager else recomputed(_swiglu)(gate, up)
        return checkpoint_name(linear(act, self.wo[...].astype(dt), self.fp8), "mlp_out")


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def _swiglu_eager(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``F.silu(gate) * up``: two kernels forward, one per operand gradient backward (autograd keeps silu's
    output for the product's backward and the input for silu's)."""
    return eager_op(jnp.multiply, eager_op(_silu_saving_input, gate), up)


def _real_vocab(init: nnx.Initializer, vocab: int, axis: int) -> nnx.Initializer:
    """``init`` with the vocabulary's pad entries (index ``vocab`` and up along ``axis``) set to zero.

    The pad rows never score (`mask_pad_logits`) and are never looked up, so their values do not matter;
    zeros keep them inert in checkpoints and under weight decay.
    """

    def run(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
        x = init(key, shape, dtype)
        if shape[axis] == vocab:
            return x
        real = jax.lax.broadcasted_iota(jnp.int32, tuple(shape), axis) < vocab
        return jnp.where(real, x, jnp.zeros((), x.dtype))

    return run


class Embed(nnx.Module):
    """Token embedding table ``[padded_vocab, embed]``; the lookup is cast to the compute dtype.

    The table has ``config.padded_vocab_size`` rows (zeros past ``vocab_size``) so that tensor parallelism
    splits it evenly; token ids are below ``vocab_size``, so the pad rows are never read.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        init = _real_vocab(nnx.initializers.normal(INIT_STD), config.vocab_size, 0)
        self.embedding = make_param(rngs, init, (config.padded_vocab_size, config.hidden_size), ("vocab", "embed"),
                                    config)
        self.dtype = compute_dtype(config)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)


class LMHead(nnx.Module):
    """Untied output projection ``[embed, padded_vocab]``; matmul in the compute dtype, logits in float32.

    Calling it gives the raw logits of every column, the pad columns included (`CausalLM.compute_logits`
    masks them).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        init = _real_vocab(nnx.initializers.normal(INIT_STD), config.vocab_size, 1)
        self.kernel = make_param(rngs, init, (config.hidden_size, config.padded_vocab_size), ("embed", "vocab"),
                                 config)

    def __call__(self, x: jax.Array) -> jax.Array:
        return project_logits(x, self.kernel[...])


def project_logits(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x [b, t, embed] @ kernel [embed, vocab]`` in ``x``'s dtype, accumulated and returned in float32."""
    return jnp.einsum("bte,ev->btv", x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)


def mask_pad_logits(logits: jax.Array, vocab: int) -> jax.Array:
    """``logits [..., padded_vocab]`` with the columns from ``vocab`` on (the padding) at the dtype's minimum.

    Those columns then get zero probability: the softmax, its log-sum-exp and the loss's gradient are those
    of the real vocabulary, and sampling never picks a pad token. The mask is an added ``[padded_vocab]``
    bias, not a select: a select's linearization keeps its boolean mask as a residual of the logits' size.
    Logits without padding come back unchanged (the traced program is the unpadded model's).
    """
    width = logits.shape[-1]
    if width == vocab:
        return logits
    real = jax.lax.iota(jnp.int32, width) < vocab
    return logits + jnp.where(real, 0.0, jnp.finfo(logits.dtype).min).astype(logits.dtype)
