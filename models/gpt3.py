"""GPT-3 family: learned positions, pre-LayerNorm, GELU MLP (ffn 4h), untied head, no biases."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import MIST_MAX_SEQ_LEN, MIST_SIZES, MIST_VOCAB, ModelConfig, tiny_and_small
from models.layers import INIT_STD, Attention, GeluMLP, Norm, make_param
from models.transformer import CausalLM


class GPT3Block(nnx.Module):
    """``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.ln1 = Norm(config, "layernorm", rngs=rngs)
        self.attn = Attention(config, rngs=rngs)
        self.ln2 = Norm(config, "layernorm", rngs=rngs)
        self.mlp = GeluMLP(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = checkpoint_name(x, "layer_input")
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT3(CausalLM):
    """GPT-3 decoder. Adds a learned position table ``[max_seq_len, embed]`` (logical axes
    ``("position", "embed")``) to the token embedding."""

    norm_kind = "layernorm"

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.family != "gpt3":
            raise ValueError(f"GPT3 needs a config with family='gpt3', got {config.family!r}")
        super().__init__(config, rngs=rngs)
        self.pos_embed = make_param(rngs, nnx.initializers.normal(INIT_STD),
                                    (config.max_seq_len, config.hidden_size), ("position", "embed"), config)

    @staticmethod
    def make_block(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return GPT3Block(config, rngs=rngs)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        hidden = super().embed_tokens(tokens)
        return hidden + self.pos_embed[: tokens.shape[1]].astype(hidden.dtype)[None]


def _paper(size: str) -> ModelConfig:
    h, layers, heads = MIST_SIZES[size]
    return ModelConfig(name=f"gpt3-{size}", family="gpt3", vocab_size=MIST_VOCAB, hidden_size=h,
                       num_layers=layers, num_heads=heads, num_kv_heads=heads, ffn_size=4 * h,
                       max_seq_len=MIST_MAX_SEQ_LEN)


PRESETS: dict[str, ModelConfig] = {
    **tiny_and_small("gpt3", tiny_ffn=256, small_ffn=1024, kv_heads=8, rotary_pct=0.0),
    **{f"gpt3-{size}": _paper(size) for size in MIST_SIZES},
}
