"""The 28 slowdown factors of Mist's four-channel interference model (hardware data).

One phase of a layer runs up to four things at once: compute, device<->device collectives (d2d),
host->device copies (h2d) and device->host copies (d2h). When a set M of channels is busy together,
channel k progresses 1/f_{M,k} times slower than alone. `InterferenceParams` holds the factors
(measured by `mistjax calibrate` or fitted in Mist's hardware templates); the cost math that applies
them is `mistjax.cost.interference.overlap_time`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

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
        factors: 28 floats >= 1, in ``MASKS`` order; factor j of mask M is
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
        """Inverse of ``to_dict`` with validation (ValueError naming the bad field).

        Besides ``{"factors": [28 numbers]}`` (what ``to_dict`` writes) a document may give only the
        fitted 4-way factors, ``{"four_way": [4 numbers], "triple": 1.3, "pair": 1.15}`` (the last two
        optional), which `from_four_way` expands; preset files use that form where only the 4-way
        factors were measured.
        """
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected an object, got {type(data).__name__}")
        forms = {"factors": {"factors"}, "four_way": {"four_way", "triple", "pair"}}
        form = "four_way" if "four_way" in data else "factors"
        extra = sorted(set(data) - forms[form])
        if extra:
            raise ValueError(f"{path}: unknown field(s) {extra}; expected ['factors'] or "
                             "['four_way'] with optional 'triple' and 'pair'")
        want = NUM_FACTORS if form == "factors" else len(CHANNELS)
        vals = data.get(form)
        if not isinstance(vals, list) or not all(_is_number(v) for v in vals):
            raise ValueError(f"{path}.{form}: expected a list of {want} numbers")
        for name in ("triple", "pair"):
            if name in data and not _is_number(data[name]):
                raise ValueError(f"{path}.{name}: expected a number >= 1, got {data[name]!r}")
        try:
            if form == "factors":
                return cls(tuple(vals))
            return cls.from_four_way(vals, **{k: data[k] for k in ("triple", "pair") if k in data})
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)

__all__ = ["CHANNELS", "MASKS", "NUM_FACTORS", "InterferenceParams", "mask_name"]
