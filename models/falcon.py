"""Falcon family: parallel attention + MLP sharing one LayerNorm input, partial rotary, GELU MLP (4h)."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import MIST_MAX_SEQ_LEN, MIST_SIZES, MIST_VOCAB, ModelConfig, tiny_and_small
from models.layers import Attention, GeluMLP, Norm
from models.transformer import CausalLM


class FalconBlock(nnx.Module):
    """``x + attn(ln(x)) + mlp(ln(x))`` (one norm, both branches read the same normalized input)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.ln = Norm(config, "layernorm", rngs=rngs)
        self.attn = Attention(config, rngs=rngs)
        self.mlp = GeluMLP(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = checkpoint_name(x, "layer_input")
        normed = self.ln(x)
        return x + self.attn(normed) + self.mlp(normed)


class Falcon(CausalLM):
    """Falcon decoder (positions through RoPE on ``rotary_pct`` of each head)."""

    norm_kind = "layernorm"

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.family != "falcon":
            raise ValueError(f"Falcon needs a config with family='falcon', got {config.family!r}")
        super().__init__(config, rngs=rngs)

    @staticmethod
    def make_block(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return FalconBlock(config, rngs=rngs)


def _paper(size: str) -> ModelConfig:
    h, layers, heads = MIST_SIZES[size]
    return ModelConfig(name=f"falcon-{size}", family="falcon", vocab_size=MIST_VOCAB, hidden_size=h,
                       num_layers=layers, num_heads=heads, num_kv_heads=heads, ffn_size=4 * h,
                       max_seq_len=MIST_MAX_SEQ_LEN, rotary_pct=0.25)


PRESETS: dict[str, ModelConfig] = {
    **tiny_and_small("falcon", tiny_ffn=256, small_ffn=1024, kv_heads=8, rotary_pct=0.25),
    **{f"falcon-{size}": _paper(size) for size in MIST_SIZES},
}
