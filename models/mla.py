"""Multi-head latent attention (DeepSeek-V2 / V3) in its training form (no weight absorption).

``q = q_b(norm(q_a(x)))`` (or one projection without ``q_rank``) per head ``[nope | rope]``; the key / value
latent ``c, k_rope = kv_a(x)``: per-head keys and values ``[k_nope | v] = kv_b(norm(c))``, one rotary key part
shared by all heads. RoPE rotates the ``rope`` parts; the scores are scaled by ``1/sqrt(nope + rope)``. The
values are zero-padded to the query / key width so that every attention kernel of the zoo runs it (the padded
output columns are zeros and are dropped), as DeepSeek's FlashAttention path does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import ModelConfig
from models.layers import INIT_STD, Attention, Norm, apply_rotary, make_param, out_proj_std
from models.mla_config import MLAConfig


class MultiHeadLatentAttention(nnx.Module):
    """MLA with kernels q_a ``[embed, q_rank]``, q_b ``[q_rank, heads, head_dim]`` (or wq
    ``[embed, heads, head_dim]``), kv_a ``[embed, kv_rank]``, k_rope ``[embed, head_dim]``, kv_b
    ``[kv_rank, heads, head_dim]`` (keys and values side by side), wo ``[heads, head_dim, embed]``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        mla = config.mla
        if mla is None:
            raise ValueError(f"ModelConfig({config.name!r}).mla is None; MultiHeadLatentAttention needs an MLAConfig")
        h, n = config.hidden_size, config.num_heads
        std = nnx.initializers.normal(INIT_STD)
        if mla.q_rank is None:
            self.wq = make_param(rngs, std, (h, n, mla.qk_dim), ("embed", "heads", "head_dim"), config)
            self.q_a = self.q_norm = self.q_b = None
        else:
            self.wq = None
            self.q_a = make_param(rngs, std, (h, mla.q_rank), ("embed", "q_rank"), config)
            self.q_norm = Norm(_norm_config(config, mla.q_rank), "rmsnorm", rngs=rngs)
            self.q_b = make_param(rngs, std, (mla.q_rank, n, mla.qk_dim), ("q_rank", "heads", "head_dim"), config)
        self.kv_a = make_param(rngs, std, (h, mla.kv_rank), ("embed", "kv_rank"), config)
        self.k_rope = make_param(rngs, std, (h, mla.rope_dim), ("embed", "head_dim"), config)
        self.kv_norm = Norm(_norm_config(config, mla.kv_rank), "rmsnorm", rngs=rngs)
        self.kv_b = make_param(rngs, std, (mla.kv_rank, n, mla.nope_dim + mla.v_dim), ("kv_rank", "heads", "head_dim"),
                               config)
        self.wo = make_param(rngs, nnx.initializers.normal(out_proj_std(config)), (n, mla.v_dim, h),
                             ("heads", "head_dim", "embed"), config)
        self.mla: MLAConfig = mla
        self.rope_base, self.rope_scaling = config.rope_base, config.rope_scaling
        self.attention, self.attention_block = config.attention, config.attention_block

    def __call__(self, x: jax.Array) -> jax.Array:
        dt, mla = x.dtype, self.mla
        if self.q_a is None:
            q = jnp.einsum("bte,end->btnd", x, self.wq[...].astype(dt))
        else:
            q = jnp.einsum("btr,rnd->btnd", self.q_norm(x @ self.q_a[...].astype(dt)), self.q_b[...].astype(dt))
        kv = jnp.einsum("btr,rnd->btnd", self.kv_norm(x @ self.kv_a[...].astype(dt)), self.kv_b[...].astype(dt))
        k_nope, v = kv[..., :mla.nope_dim], kv[..., mla.nope_dim:]
        k_rope = (x @ self.k_rope[...].astype(dt))[:, :, None, :]
        # the rotary parts sit last, as in DeepSeek; apply_rotary rotates leading dims, so rotate them alone
        q_rope = apply_rotary(q[..., mla.nope_dim:], mla.rope_dim, base=self.rope_base, scaling=self.rope_scaling)
        k_rope = apply_rotary(k_rope, mla.rope_dim, base=self.rope_base, scaling=self.rope_scaling)
        q = checkpoint_name(jnp.concatenate([q[..., :mla.nope_dim], q_rope], axis=-1), "qkv_proj")
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], mla.rope_dim))], axis=-1)
        v_padded = jnp.pad(v, ((0, 0),) * 3 + ((0, mla.qk_dim - mla.v_dim),)) if mla.qk_dim > mla.v_dim else v
        out = Attention.attend(self, q, checkpoint_name(k, "qkv_proj"), checkpoint_name(v_padded, "qkv_proj"))  # type: ignore[arg-type]
        out = checkpoint_name(out[..., :mla.v_dim], "attn_out")
        return jnp.einsum("btnd,nde->bte", out, self.wo[...].astype(dt))


def _norm_config(config: ModelConfig, width: int) -> ModelConfig:
    """A config whose RMSNorm is ``width`` wide (the latents' norms), with the same eps and dtypes."""
    return config.replace(hidden_size=width, num_heads=1, num_kv_heads=1, attention_head_dim=None, rotary_pct=0.0,
                          rope_scaling=(), moe=None, mla=None)


__all__ = ["MultiHeadLatentAttention"]
