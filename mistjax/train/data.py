"""Token data sources: a memory-mapped token file and a synthetic source.

Both are indexed by step: ``source.batch(step)`` always returns the same batch for the same
step, so a resumed run sees exactly the data an uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """A token file or data setting cannot be used."""


@dataclass(frozen=True)
class SyntheticTokens:
    """Deterministic synthetic token batches.

    ``kind="repeating"`` draws every sequence from a small set of fixed random sequences, so a
    model can memorise them and the loss visibly falls; ``kind="random"`` is uniform noise
    (useful for throughput runs).
    """

    vocab_size: int  # tokens are drawn from [0, vocab_size)
    seq_len: int  # tokens per training sequence (inputs; targets are shifted by one)
    batch_size: int  # sequences per global batch
    seed: int = 0  # base seed; batch `step` uses seed + step
    kind: str = "repeating"  # "repeating" (learnable) or "random"
    num_patterns: int = 8  # distinct sequences for kind="repeating"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "batch_size", "num_patterns"):
            if getattr(self, name) < 1:
                raise DataError(f"SyntheticTokens.{name} must be positive, got {getattr(self, name)}")
        if self.kind not in ("repeating", "random"):
            raise DataError(f"SyntheticTokens.kind must be 'repeating' or 'random', got {self.kind!r}")

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The global batch for `step`: ``inputs`` and ``targets`` int32 ``[batch, seq_len]``."""
        rng = np.random.default_rng(self.seed + step)
        if self.kind == "random":
            seqs = rng.integers(0, self.vocab_size, (self.batch_size, self.seq_len + 1))
        else:
            patterns = np.random.default_rng(self.seed).integers(
                0, self.vocab_size, (self.num_patterns, self.seq_len + 1))
            seqs = patterns[rng.integers(0, self.num_patterns, self.batch_size)]
        seqs = seqs.astype(np.int32)
        return {"inputs": seqs[:, :-1], "targets": seqs[:, 1:]}


class MemmapTokens:
    """Batches of windows from a flat binary file of uint16/uint32 token ids.

    The file is memory-mapped, never loaded whole. Window starts for step `s` come from a
    generator seeded with ``seed + s``.
    """

    def __init__(self, path: str | Path, *, seq_len: int, batch_size: int, dtype: str = "uint16",
                 vocab_size: int | None = None, seed: int = 0) -> None:
        path = Path(path)
        if dtype not in TOKEN_DTYPES:
            raise DataError(f"token dtype {dtype!r} is not supported; use one of {sorted(TOKEN_DTYPES)}")
        if not path.is_file():
            raise DataError(f"token file {str(path)!r} does not exist; pass a flat binary file of "
                            f"{dtype} token ids, or use synthetic data")
        itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
        size = path.stat().st_size
        if size % itemsize:
            raise DataError(f"token file {str(path)!r} has {size} bytes, not a multiple of {itemsize} "
                            f"({dtype}): the file is truncated or has another dtype")
        if size // itemsize < seq_len + 1:
            raise DataError(f"token file {str(path)!r} holds {size // itemsize} tokens, fewer than one "
                            f"sequence of {seq_len + 1}; use a longer file or a shorter --seq-len")
        self.path, self.seq_len, self.batch_size, self.seed = path, seq_len, batch_size, seed
        self.tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
        if vocab_size is not None:
            # A spot check of the head of the file catches a wrong dtype or tokenizer cheaply.
            head = np.asarray(self.tokens[: min(len(self.tokens), 1 << 20)])
            if head.max(initial=0) >= vocab_size:
                raise DataError(f"token file {str(path)!r} contains id {int(head.max())} >= vocab size "
                                f"{vocab_size}; check --token-dtype and the model's vocabulary")

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The global batch for `step`: ``inputs`` and ``targets`` int32 ``[batch, seq_len]``."""
        rng = np.random.default_rng(self.seed + step)
        starts = rng.integers(0, len(self.tokens) - self.seq_len, self.batch_size)
        seqs = np.stack([np.asarray(self.tokens[s: s + self.seq_len + 1]) for s in starts]).astype(np.int32)
        return {"inputs": seqs[:, :-1], "targets": seqs[:, 1:]}


def write_token_file(path: str | Path, tokens: np.ndarray, dtype: str = "uint16") -> None:
    """Write `tokens` as a flat binary token file readable by `MemmapTokens`."""
    np.asarray(tokens, dtype=TOKEN_DTYPES[dtype]).tofile(path)
