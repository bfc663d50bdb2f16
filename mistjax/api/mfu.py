"""Model FLOPs utilisation (MFU), with its formula named wherever it is shown.

MFU is the share of the devices' peak that the model's own arithmetic needs at a given speed::

    MFU = model FLOPs per token x tokens/s / (devices x peak FLOP/s per device)
    model FLOPs per token = 6 N + 12 L H Q T        (PaLM, Chowdhery et al. 2022, appendix B)

with N the parameter count (every array the model holds, embeddings included), L layers, H attention heads of
size Q, T tokens per sequence: 6 FLOPs per parameter per token (forward 2, backward 4) plus the attention
scores and their weighted sum (not halved for causal masking). Recomputation (remat) is not counted, so MFU
does not reward it. Where the attention shape is not known (a step autoshard sees only as code) the attention
term is left out and the formula shown says so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFlops:
    """The terms of the model-FLOPs formula for one model at one sequence length."""

    num_params: int  # N: every parameter of the model
    num_layers: int = 0  # L (0 with the heads: the attention term is not counted)
    num_heads: int = 0  # H: attention (query) heads per layer
    head_dim: int = 0  # Q: size of each head
    seq_len: int = 0  # T: tokens per sequence

    @property
    def per_token(self) -> float:
        """Model FLOPs per token: ``6 N + 12 L H Q T``."""
        return 6.0 * self.num_params + 12.0 * self.num_layers * self.num_heads * self.head_dim * self.seq_len

    @property
    def counts_attention(self) -> bool:
        return self.num_layers * self.num_heads * self.head_dim * self.seq_len > 0

    def formula(self) -> str:
        """The formula with its terms' values, e.g. ``6·N + 12·L·H·Q·T per token (PaLM; N 6.7B, L 32, ...)``."""
        if not self.counts_attention:
            return f"6·N per token (N {_count(self.num_params)}; attention FLOPs not counted: its shape is unknown)"
        return (f"6·N + 12·L·H·Q·T per token (PaLM's model FLOPs; N {_count(self.num_params)}, L {self.num_layers}, "
                f"H {self.num_heads}, Q {self.head_dim}, T {self.seq_len}; remat not counted)")


def mfu(tokens_per_s: float, flops: ModelFlops, num_devices: int, peak: float) -> float:
    """Model FLOPs utilisation: ``flops.per_token x tokens_per_s / (num_devices x peak)`` (0 without a peak)."""
    return flops.per_token * tokens_per_s / (num_devices * peak) if num_devices * peak > 0 else 0.0


def mfu_line(tokens_per_s: float, flops: ModelFlops, num_devices: int, peak: float, what: str = "predicted") -> str:
    """One line: the MFU, the formula and every number that went into it."""
    return (f"MFU {100 * mfu(tokens_per_s, flops, num_devices, peak):.1f}% {what} = model FLOPs x tokens/s / "
            f"(devices x peak): {flops.formula()}, {tokens_per_s:,.0f} tokens/s, {num_devices} x "
            f"{peak / 1e12:.4g} TFLOP/s")


def _count(n: int) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return str(n)


__all__ = ["ModelFlops", "mfu", "mfu_line"]
