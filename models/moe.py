"""Mixture-of-Experts decoders (issue #51): Llama blocks whose MLP is a routed set of SwiGLU experts.

``ModelConfig.moe`` (`models.moe_config.MoEConfig`) turns a llama-family config into an MoE model:

* top-k token-choice router in float32 (softmax or sigmoid scores, normalised top-k, a routed scale), the
  Switch load-balancing loss (`make_moe_loss_fn`) and the aux-loss-free expert bias, added to the scores for the
  choice only and updated outside the gradient (`update_biases`);
* capacity-factor dropping with padded per-sequence buffers, or the dropless ``ragged_dot`` path
  (`mistjax.core.moe`, which the expert-parallel runtime runs too);
* shared experts (one SwiGLU of ``shared_ffn_size``, always on), dense-first layers and an MoE layer frequency.

The stack is two scans: the dense-first blocks (if any), then periods of ``layer_freq`` blocks whose last block
is MoE. The planner does not price MoE yet (`models.workload` refuses it, naming MoE; issue #51 items 4-5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mistjax.core.moe import (
    ExpertWeights,
    LoadStats,
    apply_experts,
    balancing_loss,
    load_stats,
    route,
    update_expert_bias,
)
from models.config import ModelConfig
from models.head_loss import linear_cross_entropy
from models.layers import INIT_STD, Attention, Norm, SwiGLU, make_param, out_proj_std
from models.loss import token_weights
from models.mla import MultiHeadLatentAttention
from models.mla_config import MLAConfig
from models.moe_config import MoEConfig
from models.transformer import CausalLM, make_layer_stack


class ExpertBias(nnx.Variable):
    """The aux-loss-free balancing bias ``[E]`` of one MoE layer: not a parameter (no gradient, no optimizer)."""


class MoEMLP(nnx.Module):
    """Router + routed SwiGLU experts + optional shared expert; returns ``(y, LoadStats)``.

    Kernels: router ``[embed, router]``; experts gate / up ``[experts, embed, mlp]``, down
    ``[experts, mlp, embed]``; the shared expert is a `SwiGLU` of width ``shared_ffn_size``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        moe = _moe(config)
        h, e, f = config.hidden_size, moe.num_experts, moe.expert_ffn_size
        std = nnx.initializers.normal(INIT_STD)
        self.router = make_param(rngs, std, (h, e), ("embed", "router"), config)
        self.w_gate = make_param(rngs, std, (e, h, f), ("experts", "embed", "mlp"), config)
        self.w_up = make_param(rngs, std, (e, h, f), ("experts", "embed", "mlp"), config)
        self.w_down = make_param(rngs, nnx.initializers.normal(out_proj_std(config)), (e, f, h),
                                 ("experts", "mlp", "embed"), config)
        self.bias = ExpertBias(jnp.zeros((e,), jnp.float32)) if moe.expert_bias else None
        shared = config.replace(ffn_size=moe.shared_ffn_size) if moe.shared_ffn_size else None
        self.shared = SwiGLU(shared, rngs=rngs) if shared is not None else None
        self.spec = moe.router_spec()

    def __call__(self, x: jax.Array) -> tuple[jax.Array, LoadStats]:
        logits = checkpoint_name(jnp.einsum("bsh,he->bse", x.astype(jnp.float32),
                                            self.router[...].astype(jnp.float32)), "moe_router")
        routing = route(logits, self.spec, None if self.bias is None else self.bias[...])
        weights = ExpertWeights(self.w_gate[...], self.w_up[...], self.w_down[...])
        y = checkpoint_name(apply_experts(x, routing, weights, self.spec), "moe_out")
        if self.shared is not None:
            y = y + self.shared(x)
        return y, load_stats(routing, self.spec)


def make_attention(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """Multi-head latent attention when ``config.mla`` is set, else the zoo's GQA `Attention`."""
    return MultiHeadLatentAttention(config, rngs=rngs) if config.mla is not None else Attention(config, rngs=rngs)


class DenseBlock(nnx.Module):
    """The dense block of an MoE model: ``x + attn(rms1(x))`` then ``x + swiglu(rms2(x))`` (Llama's, with MLA
    where the config has it)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = Norm(config, "rmsnorm", rngs=rngs)
        self.attn = make_attention(config, rngs)
        self.mlp_norm = Norm(config, "rmsnorm", rngs=rngs)
        self.mlp = SwiGLU(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = checkpoint_name(x, "layer_input")
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MoEBlock(nnx.Module):
    """``x + attn(rms1(x))`` then ``x + moe(rms2(x))``; returns ``(x, LoadStats)``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = Norm(config, "rmsnorm", rngs=rngs)
        self.attn = make_attention(config, rngs)
        self.mlp_norm = Norm(config, "rmsnorm", rngs=rngs)
        self.mlp = MoEMLP(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, LoadStats]:
        x = checkpoint_name(x, "layer_input")
        x = x + self.attn(self.attn_norm(x))
        y, stats = self.mlp(self.mlp_norm(x))
        return x + y, stats


class MoEPeriod(nnx.Module):
    """``layer_freq - 1`` dense Llama blocks, then one `MoEBlock` (the scanned unit of the MoE stack)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.dense = nnx.List([DenseBlock(config, rngs=rngs) for _ in range(_moe(config).layer_freq - 1)])
        self.moe = MoEBlock(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, LoadStats]:
        for block in self.dense:
            x = block(x)
        return self.moe(x)


class MoEForCausalLM(CausalLM):
    """Llama decoder with MoE blocks (``config.moe``).

    Attributes:
        dense_layers: the scanned dense-first blocks (``moe.first_dense_layers`` of them), or None.
        layers: the scanned `MoEPeriod` stack (``moe_layers`` periods).
    """

    norm_kind = "rmsnorm"

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        moe = _moe(config)
        if config.family != "llama":
            raise ValueError(f"MoE models need family='llama', got {config.family!r}")
        super().__init__(config.replace(num_layers=moe.moe_layers(config.num_layers),
                                        moe=None, mla=None), rngs=rngs)  # builds the embedding, norm and head
        self.config = config
        self.layers = make_layer_stack(lambda r: MoEPeriod(config, rngs=r), moe.moe_layers(config.num_layers), rngs)
        self.dense_layers = (make_layer_stack(lambda r: DenseBlock(config, rngs=r), moe.first_dense_layers, rngs)
                             if moe.first_dense_layers else None)

    @staticmethod
    def make_block(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        # Called by CausalLM.__init__ for a placeholder stack that __init__ replaces at once.
        return Norm(config, "rmsnorm", rngs=rngs)

    def run_layers_with_stats(self, hidden: jax.Array, *, body_transform: Callable | None = None
                              ) -> tuple[jax.Array, LoadStats]:
        """Dense-first scan, then the MoE scan; returns the hidden state and ``LoadStats`` stacked per MoE layer
        (leading axis ``moe_layers``).

        Args:
            hidden: ``[B, T, h]`` in the compute dtype.
            body_transform: optional wrapper of both scan bodies ``(hidden, block) -> out``, e.g.
                ``lambda f: nnx.remat(f, policy=...)``; policies may name the MoE tags ``moe_router`` (router
                logits) and ``moe_out`` (routed experts' output) besides the dense ones.
        """
        wrap = body_transform or (lambda f: f)

        def dense(h: jax.Array, block: nnx.Module) -> jax.Array:
            return block(h)

        def period(h: jax.Array, unit: nnx.Module) -> tuple[jax.Array, LoadStats]:
            return unit(h)

        if self.dense_layers is not None:
            hidden = nnx.scan(wrap(dense), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(hidden, self.dense_layers)
        return nnx.scan(wrap(period), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(hidden, self.layers)

    def run_layers(self, hidden: jax.Array, *, body_transform: Callable | None = None) -> jax.Array:
        """The layer stack without its statistics (the dense models' interface)."""
        return self.run_layers_with_stats(hidden, body_transform=body_transform)[0]

    def forward_unrolled(self, tokens: jax.Array) -> jax.Array:
        """Not provided for MoE models (their stack is two scans)."""
        raise NotImplementedError("forward_unrolled is written for one stacked scan; MoE models have two")


class MoEMetrics(NamedTuple):
    """What an MoE loss reports besides the loss."""

    cross_entropy: jax.Array  # []
    balancing: jax.Array  # []: mean over MoE layers of the Switch loss (1.0 is balanced)
    counts: jax.Array  # [moe_layers, E]: routed choices per expert (the bias update reads them)
    dropped: jax.Array  # [moe_layers]: (token, choice) pairs past capacity


def make_moe_loss_fn(graphdef: nnx.GraphDef) -> Callable[[Any, Any, dict], tuple[jax.Array, MoEMetrics]]:
    """``loss_fn(params, rest, batch) -> (loss, MoEMetrics)`` for ``graphdef, params, rest =
    nnx.split(model, nnx.Param, ...)``: fused head + cross-entropy plus ``aux_loss_coef`` times the balancing loss.

    ``rest`` holds the non-parameter state (the expert biases); differentiate with respect to ``params`` only.
    """

    def loss_fn(params: Any, rest: Any, batch: dict) -> tuple[jax.Array, MoEMetrics]:
        # Fresh Variables for ``rest``: a closed-over state made outside the current trace cannot enter nnx.scan.
        model = nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))
        hidden, stats = model.run_layers_with_stats(model.embed_tokens(batch["inputs"]))
        hidden = model.final_norm(hidden)
        weights = token_weights(batch["targets"], batch.get("mask"))
        ce = linear_cross_entropy(hidden, model.head_kernel(), batch["targets"], weights,
                                  model.config.loss_chunks, model.config.vocab_size)
        moe = _moe(model.config)
        balance = jnp.mean(jax.vmap(balancing_loss, in_axes=(0, None))(stats, moe.top_k))
        loss = ce + moe.aux_loss_coef * balance if moe.aux_loss_coef else ce
        return loss, MoEMetrics(ce, balance, stats.counts, stats.dropped)

    return loss_fn


def update_biases(rest: Any, counts: jax.Array, config: ModelConfig) -> Any:
    """The non-parameter state ``rest`` with every MoE layer's `ExpertBias` moved by the aux-loss-free rule.

    Args:
        rest: ``nnx.State`` of the model's non-parameters (holds ``layers.moe.mlp.bias`` as ``[moe_layers, E]``).
        counts: ``MoEMetrics.counts`` of the step, ``[moe_layers, E]``.
        config: the model's config (its ``moe.bias_update_rate``).

    Raises:
        ValueError: the config has no expert bias (the update would do nothing).
    """
    moe = _moe(config)
    if not moe.expert_bias:
        raise ValueError(f"ModelConfig({config.name!r}).moe.expert_bias is False: there is no bias to update; "
                         "set expert_bias=True for aux-loss-free balancing")
    return jax.tree.map(lambda b: update_expert_bias(b, counts, moe.bias_update_rate), rest)


def _moe(config: ModelConfig) -> MoEConfig:
    if config.moe is None:
        raise ValueError(f"ModelConfig({config.name!r}).moe is None; MoE blocks need a models.MoEConfig")
    return config.moe


# ------------------------------------------------------------------------------------------ presets
def _llama_moe(name: str, vocab: int, h: int, layers: int, heads: int, kv: int, ffn: int, seq: int,
               moe: MoEConfig, *, rope: float, head_dim: int | None = None, mla: MLAConfig | None = None
               ) -> ModelConfig:
    # With MLA the head width is the query / key width, of which the last rope_dim are rotated.
    rotary = 1.0 if mla is None else mla.rope_dim / mla.qk_dim
    return ModelConfig(name=name, family="llama", vocab_size=vocab, hidden_size=h, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv, ffn_size=ffn, max_seq_len=seq, rotary_pct=rotary,
                       norm_eps=1e-6 if name.startswith(("qwen", "deepseek")) else 1e-5, rope_base=rope,
                       attention_head_dim=head_dim if mla is None else mla.qk_dim, moe=moe, mla=mla)


def _presets() -> dict[str, ModelConfig]:
    mixtral = MoEConfig(num_experts=8, top_k=2, expert_ffn_size=14336, aux_loss_coef=0.02)
    qwen3 = MoEConfig(num_experts=128, top_k=8, expert_ffn_size=768, aux_loss_coef=0.001)
    # DeepSeek-V3: MLA, group-limited routing; no multi-token prediction (docs/moe.md).
    deepseek = MoEConfig(num_experts=256, top_k=8, expert_ffn_size=2048, scoring="sigmoid", routed_scale=2.5,
                         expert_bias=True, aux_loss_coef=0.001, shared_ffn_size=2048, first_dense_layers=3,
                         num_groups=8, top_groups=4)
    # gpt-oss: clamped SwiGLU experts; no expert / router / attention biases, full causal attention on every layer
    # (no sliding window, no sinks): docs/moe.md lists the gaps.
    oss = MoEConfig(num_experts=128, top_k=4, expert_ffn_size=2880, aux_loss_coef=0.9, swiglu_limit=7.0)
    tiny = MoEConfig(num_experts=8, top_k=2, expert_ffn_size=32, shared_ffn_size=32, first_dense_layers=1,
                     aux_loss_coef=0.01)
    configs = [
        _llama_moe("mixtral-8x7b", 32000, 4096, 32, 32, 8, 14336, 32768, mixtral, rope=1e6),
        _llama_moe("mixtral-8x22b", 32768, 6144, 56, 48, 8, 16384, 65536,
                   dataclasses.replace(mixtral, expert_ffn_size=16384), rope=1e6),
        _llama_moe("qwen3-30b-a3b", 151936, 2048, 48, 32, 4, 6144, 40960, qwen3, rope=1e6, head_dim=128),
        _llama_moe("qwen3-235b-a22b", 151936, 4096, 94, 64, 4, 12288, 40960,
                   dataclasses.replace(qwen3, expert_ffn_size=1536), rope=1e6, head_dim=128),
        _llama_moe("deepseek-v3", 129280, 7168, 61, 128, 128, 18432, 163840, deepseek, rope=1e4,
                   mla=MLAConfig(kv_rank=512, q_rank=1536, nope_dim=128, rope_dim=64, v_dim=128)),
        _llama_moe("gpt-oss-120b", 201088, 2880, 36, 64, 8, 2880, 131072, oss, rope=1.5e5, head_dim=64),
        _llama_moe("gpt-oss-20b", 201088, 2880, 24, 64, 8, 2880, 131072,
                   dataclasses.replace(oss, num_experts=32), rope=1.5e5, head_dim=64),
        _llama_moe("moe-tiny", 256, 32, 3, 4, 2, 64, 64, tiny, rope=1e4),
    ]
    return {c.name: c for c in configs}


PRESETS: dict[str, ModelConfig] = _presets()

__all__ = ["PRESETS", "ExpertBias", "MoEBlock", "MoEForCausalLM", "MoEMLP", "MoEMetrics", "MoEPeriod",
           "make_moe_loss_fn", "update_biases"]
