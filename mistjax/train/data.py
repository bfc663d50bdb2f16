"""Token data sources: a memory-mapped token file and a synthetic source (text corpora:
`mistjax.train.text_data`).

All are indexed by step: ``source.batch(step)`` always returns the same batch for the same
step, so a resumed run sees exactly the data an uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """A token file or data setting cannot be used."""


class TokenSource(Protocol):
    """What the training loop reads: the global batch of a step, a pure function of the source, seed and step."""

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """``inputs`` and ``targets``: int32 ``[batch, seq_len]``, targets shifted by one token."""
        ...


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
                            f"(--token-dtype {dtype}): the file is truncated or has another dtype; pass the "
                            "--token-dtype it was written with")
        if size // itemsize < seq_len + 1:
            raise DataError(f"token file {str(path)!r} holds {size // itemsize} tokens, fewer than one "
                            f"sequence of {seq_len + 1}; use a longer file or a shorter --seq-len")
        self.path, self.seq_len, self.batch_size, self.seed = path, seq_len, batch_size, seed
        self.tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
        check_token_sample(self.tokens, dtype, vocab_size, str(path))

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The global batch for `step`: ``inputs`` and ``targets`` int32 ``[batch, seq_len]``."""
        rng = np.random.default_rng(self.seed + step)
        starts = rng.integers(0, len(self.tokens) - self.seq_len, self.batch_size)
        seqs = np.stack([np.asarray(self.tokens[s: s + self.seq_len + 1]) for s in starts]).astype(np.int32)
        return {"inputs": seqs[:, :-1], "targets": seqs[:, 1:]}


# Bytes of a token file the dtype checks read (`check_token_sample`): its head and a slice of its tail.
SAMPLE_BYTES = 4 << 20
TAIL_BYTES = 256 << 10
# A uint16 file is taken for uint32 ids only when at least this many high words were seen (all zero).
MIN_WORDS_FOR_UINT32_GUESS = 64


def check_token_sample(tokens: np.ndarray, dtype: str, vocab_size: int | None, name: str) -> None:
    """Refuses a token file read with the wrong ``--token-dtype``, from a bounded sample (cheap on large files).

    Args:
      tokens: the file's ids as ``dtype`` (a memmap: only the sample is read).
      dtype: the declared ``--token-dtype``.
      vocab_size: the model's vocabulary (None: no range check).
      name: the file, for the message.

    Raises:
      DataError: a sampled id is outside the vocabulary, or a uint16 file reads as little-endian uint32 ids
        (every second uint16 word of its head is zero while the others are not).
    """
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    head = np.asarray(tokens[: SAMPLE_BYTES // itemsize])
    if dtype == "uint16":
        _refuse_uint32_as_uint16(head, vocab_size, name)
    if vocab_size is None:
        return
    tail_start = max(len(head), len(tokens) - TAIL_BYTES // itemsize)
    top = max(int(head.max(initial=0)), int(np.asarray(tokens[tail_start:]).max(initial=0)))
    if top >= vocab_size:
        hint = ("; uint16 ids read as uint32 pair up into ids of 65,536 and more: try --token-dtype uint16"
                if dtype == "uint32" and top >= 1 << 16 else "")
        raise DataError(f"token file {name!r} contains id {top} >= vocab size {vocab_size} (read as --token-dtype "
                        f"{dtype}); check --token-dtype and that the file was tokenized for this model{hint}")


def _refuse_uint32_as_uint16(head: np.ndarray, vocab_size: int | None, name: str) -> None:
    """Little-endian uint32 ids read as uint16 alternate low halves with high halves no larger than those of
    the largest id, ``(vocab - 1) >> 16`` (0 below 65,537 ids): tokens of real text never do."""
    high = head[1 : len(head) - len(head) % 2 : 2]  # the high halves, were these uint32 ids
    bound = (vocab_size - 1) >> 16 if vocab_size else 0
    if len(high) < MIN_WORDS_FOR_UINT32_GUESS or high.max() > bound or head[::2].max() <= bound:
        return
    raise DataError(f"token file {name!r} looks like little-endian uint32 ids read as --token-dtype uint16: every "
                    f"second 16-bit word of its first {len(head):,} is {'0' if bound == 0 else f'at most {bound}'} "
                    "(training would see it after every token); pass --token-dtype uint32")


def write_token_file(path: str | Path, tokens: np.ndarray, dtype: str = "uint16") -> None:
    """Write `tokens` as a flat binary token file readable by `MemmapTokens`."""
    np.asarray(tokens, dtype=TOKEN_DTYPES[dtype]).tofile(path)
