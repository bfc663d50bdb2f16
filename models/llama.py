"""Llama family: RMSNorm, SwiGLU MLP, partial rotary (0.25 in Mist's configs), grouped-query attention."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import MIST_MAX_SEQ_LEN, MIST_SIZES, MIST_VOCAB, ModelConfig, tiny_and_small
from models.layers import Attention, Norm, SwiGLU
from models.transformer import CausalLM

# Mist's Llama FFN widths per size (paper section 6.2).
LLAMA_FFN = {"1.3b": 5632, "2.7b": 6912, "7b": 11008, "13b": 13824, "22b": 16384}


class LlamaBlock(nnx.Module):
    """``x + attn(rms1(x))`` then ``x + swiglu(rms2(x))``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = Norm(config, "rmsnorm", rngs=rngs)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = Norm(config, "rmsnorm", rngs=rngs)
        self.mlp = SwiGLU(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = checkpoint_name(x, "layer_input")
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(CausalLM):
    """Llama decoder (no position table: positions enter through RoPE)."""

    norm_kind = "rmsnorm"

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.family != "llama":
            raise ValueError(f"Llama needs a config with family='llama', got {config.family!r}")
        super().__init__(config, rngs=rngs)

    @staticmethod
    def make_block(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return LlamaBlock(config, rngs=rngs)


def _paper(size: str) -> ModelConfig:
    h, layers, heads = MIST_SIZES[size]
    return ModelConfig(name=f"llama-{size}", family="llama", vocab_size=MIST_VOCAB, hidden_size=h,
                       num_layers=layers, num_heads=heads, num_kv_heads=heads, ffn_size=LLAMA_FFN[size],
                       max_seq_len=MIST_MAX_SEQ_LEN, rotary_pct=0.25)


PRESETS: dict[str, ModelConfig] = {
    **tiny_and_small("llama", tiny_ffn=128, small_ffn=704, kv_heads=4, rotary_pct=0.25),
    **{f"llama-{size}": _paper(size) for size in MIST_SIZES},
}
