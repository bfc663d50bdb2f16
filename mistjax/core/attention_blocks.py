"""The key blocking both blockwise attention kernels share: the model zoo's fused attention
(`models.attention`) and the runtime's context-parallel ring (`mistjax.runtime.context_attention`).

Here in the core so that the model zoo need not import the runtime (the layer rules of
docs/architecture.md): both kernels check their inputs and cut the keys into blocks the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_attention_args(q: jax.Array, k: jax.Array, v: jax.Array, block_size: int, who: str = "") -> None:
    """Raise ValueError (prefixed ``who: ``) unless q ``[b, s, heads, d]``, k, v ``[b, s, kv_heads, d]`` of one
    dtype, kv heads dividing heads, and a positive integer ``block_size`` (both blockwise kernels' inputs)."""
    pre = f"{who}: " if who else ""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"{pre}block_size must be a positive integer, got {block_size!r}")
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"{pre}expected q [b, s, heads, d] and k, v [b, s, kv_heads, d]; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    b, s, n, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d or n % k.shape[2]:
        raise ValueError(f"{pre}k/v {k.shape} do not match q {q.shape}: need the same batch, seq "
                         "and head_dim, and kv_heads dividing heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{pre}q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def key_blocks(s: int, block_size: int) -> tuple[int, int]:
    """(number of key blocks, keys per block): balanced blocks of at most ``block_size`` keys."""
    nk = -(-s // block_size)
    return nk, -(-s // nk)


def pad_keys(x: jax.Array, total: int) -> jax.Array:
    """``x`` ``[b, s, kv, d]`` zero-padded along the sequence to ``total`` keys (the last block's padding)."""
    pad = total - x.shape[1]
    return x if pad == 0 else jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))


__all__ = ["check_attention_args", "key_blocks", "pad_keys"]
