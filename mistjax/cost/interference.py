"""Mist's interference model for four concurrent channels (Mist artifact, ``tools/optimize.py``).

One phase of a layer runs up to four things at once: compute, device<->device collectives (d2d),
host->device copies (h2d) and device->host copies (d2h). Each has a standalone duration. When a set
M of channels is busy together, channel k progresses 1/f_{M,k} times slower than alone. The model
walks the 11 masks with >= 2 channels, largest first: while every channel of M is still busy, the
phase lasts ``min_k x_k f_{M,k}``; that much (slowed) work is removed from each channel, the
channel(s) hitting the minimum finish, and the row moves on to a smaller mask. Whatever single
channel is left runs alone.

Facts worth knowing when choosing factors (all are tested):

* all factors == 1 (perfect overlap): result == max of the inputs;
* f_{M,k} == |M| for every mask (fair time-slicing, no overlap gain): result == sum of the inputs;
* any factors >= 1: result >= max of the inputs;
* if ``sum_{k in M} 1/f_{M,k} >= 1`` for every mask (overlap never worse than running serially):
  result <= sum of the inputs. Large factors break this bound (f = 100 on a pair is 50x slower than
  running the two one after the other), which is why factors are validated to be >= 1 but not capped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

CHANNELS: tuple[str, ...] = ("compute", "d2d", "h2d", "d2h")

# Masks in the order the model visits them: the 4-way set, then the four 3-subsets, then the six
# pairs, each level in itertools.combinations order. The flat 28-vector follows this order, with
# each mask's factors in channel order (4 + 4*3 + 6*2 = 28).
MASKS: tuple[tuple[int, ...], ...] = tuple(
    m for size in (4, 3, 2) for m in itertools.combinations(range(len(CHANNELS)), size)
)
NUM_FACTORS = sum(len(m) for m in MASKS)  # 28


def mask_name(mask: Sequence[int]) -> str:
    """Human-readable name of a mask, e.g. ``"compute+h2d"``."""
    return "+".join(CHANNELS[k] for k in mask)


@dataclass(frozen=True)
class InterferenceParams:
    """The 28 slowdown factors of the interference model.

    Attributes:
        factors: 28 floats >= 1, in ``MASKS`` order (see module docstring); factor j of mask M is
            how many times slower channel ``M[j]`` runs while all channels of M are busy.
    """

    factors: tuple[float, ...]  # flattened per MASKS, channel order inside a mask

    def __post_init__(self) -> None:
        vals = tuple(float(v) for v in self.factors)
        if len(vals) != NUM_FACTORS:
            raise ValueError(f"interference.factors: expected {NUM_FACTORS} values, got {len(vals)}")
        for i, v in enumerate(vals):
            if not (math.isfinite(v) and v >= 1.0):
                raise ValueError(f"interference.factors[{i}]: expected a finite slowdown >= 1, got {v!r}")
        object.__setattr__(self, "factors", vals)

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def uniform(cls, value: float) -> InterferenceParams:
        """Every channel in every mask slowed by ``value``."""
        return cls((value,) * NUM_FACTORS)

    @classmethod
    def ideal(cls) -> InterferenceParams:
        """Perfect overlap (all factors 1): a phase lasts as long as its longest channel."""
        return cls.uniform(1.0)

    @classmethod
    def serial(cls) -> InterferenceParams:
        """No overlap gain: f_{M,k} = |M|, so a phase lasts the sum of its channels."""
        return cls(tuple(float(len(m)) for m in MASKS for _ in m))

    @classmethod
    def from_four_way(
        cls, four_way: Sequence[float], *, triple: float = 1.3, pair: float = 1.15
    ) -> InterferenceParams:
        """Build from the fitted 4-way factors plus generic defaults for the smaller masks.

        Mist's templates quote the 4-way factors; the 24 others were not available to us. A
        subset factor is ``min(four_way[k], default)`` (``triple`` for 3-subsets, ``pair`` for
        pairs): fewer concurrent channels never slow a channel more than all four do, and the
        defaults are mild (every pair and triple then satisfies sum 1/f >= 1). Refit with
        measurements before trusting absolute overlap numbers.
        """
        fw = [float(v) for v in four_way]
        if len(fw) != len(CHANNELS):
            raise ValueError(f"four_way: expected {len(CHANNELS)} factors, got {len(fw)}")
        out: list[float] = []
        for mask in MASKS:
            cap = {4: math.inf, 3: triple, 2: pair}[len(mask)]
            out.extend(min(fw[k], cap) for k in mask)
        return cls(tuple(out))

    # -- accessors ----------------------------------------------------------------------------
    def mask_factors(self) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
        """Yield ``(mask, factors)`` pairs in visiting order."""
        i = 0
        for mask in MASKS:
            yield mask, np.asarray(self.factors[i : i + len(mask)], dtype=np.float64)
            i += len(mask)

    def factor(self, mask: Sequence[str | int], channel: str | int) -> float:
        """Factor of ``channel`` while the channels of ``mask`` run together (names or indices)."""
        idx = tuple(sorted(CHANNELS.index(c) if isinstance(c, str) else int(c) for c in mask))
        ch = CHANNELS.index(channel) if isinstance(channel, str) else int(channel)
        for m, f in self.mask_factors():
            if m == idx and ch in m:
                return float(f[m.index(ch)])
        raise KeyError(f"no factor for channel {channel!r} in mask {mask!r}")

    def four_way(self) -> tuple[float, ...]:
        """The 4-way factors (compute, d2d, h2d, d2h)."""
        return self.factors[:4]

    def as_table(self) -> dict[str, dict[str, float]]:
        """``{"compute+d2d": {"compute": f, "d2d": f}, ...}`` for printing."""
        return {
            mask_name(m): {CHANNELS[k]: float(v) for k, v in zip(m, f)} for m, f in self.mask_factors()
        }

    def to_dict(self) -> dict[str, list[float]]:
        """JSON-ready form: ``{"factors": [28 floats]}``."""
        return {"factors": list(self.factors)}

    @classmethod
    def from_dict(cls, data: object, path: str = "interference") -> InterferenceParams:
        """Inverse of ``to_dict`` with validation (ValueError naming the bad field)."""
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected an object, got {type(data).__name__}")
        extra = sorted(set(data) - {"factors"})
        if extra:
            raise ValueError(f"{path}: unknown field(s) {extra}; expected ['factors']")
        fac = data.get("factors")
        if not isinstance(fac, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in fac
        ):
            raise ValueError(f"{path}.factors: expected a list of {NUM_FACTORS} numbers")
        try:
            return cls(tuple(fac))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def overlap_time(
    compute: ArrayLike, d2d: ArrayLike, h2d: ArrayLike, d2h: ArrayLike, params: InterferenceParams
) -> np.ndarray:
    """Duration of a phase whose four channels run concurrently (Mist's interference model).

    Args:
        compute: standalone compute time(s), seconds; any shape, broadcast with the others.
        d2d: standalone device<->device collective time(s).
        h2d: standalone host->device copy time(s).
        d2h: standalone device->host copy time(s).
        params: slowdown factors.

    Returns:
        Array of the broadcast shape (0-d for scalar inputs). NaN in any channel gives NaN; inf
        gives inf.

    Raises:
        ValueError: if any input is negative.
    """
    x = np.stack(np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (compute, d2d, h2d, d2h))))
    if np.any(x < 0):
        raise ValueError("overlap_time: channel times must be >= 0")
    nan = np.isnan(x).any(axis=0)
    x = np.where(np.isnan(x), 0.0, x)  # keep NaN out of the mask logic; restored at the end
    t = np.zeros(x.shape[1:])
    with np.errstate(invalid="ignore"):  # inf - inf in rows not selected by a mask is discarded
        t = _passes(x, t, params)
    t = t + x.sum(axis=0)  # at most one channel is left; it runs alone
    return np.where(nan, np.nan, t)[()]


def _passes(x: np.ndarray, t: np.ndarray, params: InterferenceParams) -> np.ndarray:
    """The 11 masked min/subtract passes; updates ``x`` in place, returns the accumulated time."""
    for mask, f in params.mask_factors():
        busy = x > 0
        others = [k for k in range(len(CHANNELS)) if k not in mask]
        rows = busy[list(mask)].all(axis=0) & ~busy[others].any(axis=0)
        if not rows.any():
            continue
        xm = x[list(mask)]
        fb = f.reshape((-1,) + (1,) * (x.ndim - 1))
        scaled = xm * fb  # time each channel would need under this mask's slowdown
        o = scaled.min(axis=0)
        t = t + np.where(rows, o, 0.0)
        # The argmin channel(s) are set to exactly 0 so float residue cannot resurrect them.
        rem = np.where(scaled <= o, 0.0, xm - o / fb)
        x[list(mask)] = np.where(rows, rem, xm)
    return t
