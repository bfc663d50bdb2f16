"""`MLAConfig`: DeepSeek's multi-head latent attention, the ``ModelConfig.mla`` field (`models.mla` builds it)."""

from __future__ import annotations

import dataclasses
import numbers


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Low-rank query and key / value projections with a decoupled rotary part (DeepSeek-V2 / V3).

    Raises:
        ValueError: from ``__post_init__`` when a field is invalid; the message names the field and the fix.
    """

    kv_rank: int  # width of the compressed key / value latent (HF kv_lora_rank, 512)
    q_rank: int | None = None  # width of the compressed query (HF q_lora_rank, 1536); None: a full query projection
    nope_dim: int = 128  # per-head query / key width without rotary (HF qk_nope_head_dim)
    rope_dim: int = 64  # per-head rotary width of the query, shared key rotary part (HF qk_rope_head_dim)
    v_dim: int = 128  # per-head value width (HF v_head_dim)

    def __post_init__(self) -> None:
        for field in ("kv_rank", "nope_dim", "rope_dim", "v_dim", "q_rank"):
            value = getattr(self, field)
            if field == "q_rank" and value is None:
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MLAConfig.{field}: must be a positive integer, got {value!r}")
        if self.rope_dim % 2:
            raise ValueError(f"MLAConfig.rope_dim: {self.rope_dim} must be even (RoPE rotates pairs of dims)")
        if self.v_dim > self.qk_dim:
            raise ValueError(f"MLAConfig.v_dim: {self.v_dim} exceeds nope_dim + rope_dim = {self.qk_dim}; the zoo's "
                             "attention kernels pad the values to the query / key width, not the other way round")

    @property
    def qk_dim(self) -> int:
        """Per-head query / key width (no-rotary part + rotary part)."""
        return self.nope_dim + self.rope_dim

    def params(self, hidden: int, heads: int) -> int:
        """Parameters of one MLA sub-layer: query (low-rank with its norm, or full), the key / value latent and
        shared rotary key, its norm, the up-projection to per-head keys and values, and the output."""
        q = (hidden * heads * self.qk_dim if self.q_rank is None
             else hidden * self.q_rank + self.q_rank + self.q_rank * heads * self.qk_dim)
        kv = (hidden * (self.kv_rank + self.rope_dim) + self.kv_rank
              + self.kv_rank * heads * (self.nope_dim + self.v_dim))
        return q + kv + heads * self.v_dim * hidden


__all__ = ["MLAConfig"]
