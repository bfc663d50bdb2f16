"""Compute-op time: a roofline with a saturating efficiency curve, and an optional measured table.

Roofline: ``time = max(flops / (peak * eff(flops)), bytes / (hbm_bw * mem_eff))``.

Efficiency curve (small ops do not fill the chip; kernels pay launch and tail costs):
``eff(f) = eff_max * f / (f + f_half)`` with ``f_half = peak * eff_max * overhead``. It rises from 0,
reaches eff_max/2 at f_half and approaches eff_max for large ops; algebraically the compute term is
``f / (peak * eff_max) + overhead``, i.e. a fixed per-op overhead (default 3 us, a typical GPU kernel
launch + ramp) on top of the large-op throughput. An op with no flops and no bytes costs 0.

``OpTimeTable`` holds measured times keyed by an op signature; ``lookup`` uses them where present
and falls back to the roofline (Mist measures every op on the target GPU instead, section 4.3).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
from numpy.typing import ArrayLike

from mistjax.hardware.presets import DeviceSpec

DEFAULT_OP_OVERHEAD = 3e-6  # seconds; per-op fixed cost implied by the efficiency curve
_TABLE_FORMAT = "mistjax.op_time_table"
_TABLE_VERSION = 1


def _f(x: ArrayLike) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def compute_efficiency(
    flops: ArrayLike,
    peak_flops: ArrayLike,
    max_efficiency: ArrayLike,
    overhead: ArrayLike = DEFAULT_OP_OVERHEAD,
) -> np.ndarray:
    """Fraction of ``peak_flops`` an op of ``flops`` reaches: ``eff_max * f / (f + f_half)``."""
    f = _f(flops)
    f_half = _f(peak_flops) * _f(max_efficiency) * _f(overhead)
    with np.errstate(invalid="ignore", divide="ignore"):
        e = _f(max_efficiency) * f / (f + f_half)
    return np.where(f > 0, e, 0.0)[()]


def roofline_time(
    flops: ArrayLike,
    nbytes: ArrayLike,
    peak_flops: ArrayLike,
    hbm_bandwidth: ArrayLike,
    *,
    matmul_efficiency: ArrayLike = 1.0,
    memory_efficiency: ArrayLike = 1.0,
    overhead: ArrayLike = DEFAULT_OP_OVERHEAD,
) -> np.ndarray:
    """Roofline time of an op (seconds), vectorised over every argument.

    Args:
        flops: floating-point operations of the op.
        nbytes: bytes read + written from device memory.
        peak_flops: device peak, FLOP/s.
        hbm_bandwidth: device memory bandwidth, bytes/s.
        matmul_efficiency: large-op fraction of peak (eff_max).
        memory_efficiency: achievable fraction of ``hbm_bandwidth``.
        overhead: per-op fixed cost defining the efficiency curve's knee (0 = pure roofline).
    """
    f, b = _f(flops), _f(nbytes)
    if np.any(f < 0) or np.any(b < 0):
        raise ValueError("flops and nbytes must be >= 0")
    compute = np.where(f > 0, f / (_f(peak_flops) * _f(matmul_efficiency)) + _f(overhead), 0.0)
    memory = b / (_f(hbm_bandwidth) * _f(memory_efficiency))
    return np.maximum(compute, memory)


def op_time(
    flops: ArrayLike, nbytes: ArrayLike, device: DeviceSpec, *, fp32: bool = False,
    overhead: ArrayLike = DEFAULT_OP_OVERHEAD,
) -> np.ndarray:
    """``roofline_time`` with the peaks and efficiencies of ``device`` (bf16 peak unless ``fp32``)."""
    return roofline_time(
        flops,
        nbytes,
        device.peak_flops_fp32 if fp32 else device.peak_flops,
        device.hbm_bandwidth,
        matmul_efficiency=device.matmul_efficiency,
        memory_efficiency=device.memory_efficiency,
        overhead=overhead,
    )


def op_signature(op: str, shapes: Sequence[Sequence[int]], dtype: str, **attrs: object) -> str:
    """Canonical table key, e.g. ``dot_general|bf16|8x1024x4096,4096x4096|pass=fwd``.

    Attributes are sorted by name so that keyword order does not matter.
    """
    dims = ",".join("x".join(str(int(d)) for d in s) for s in shapes)
    parts = [op, dtype, dims] + [f"{k}={attrs[k]}" for k in sorted(attrs)]
    return "|".join(parts)


@dataclass(frozen=True)
class OpTimeTable:
    """Measured op times (seconds) keyed by ``op_signature`` strings. Immutable.

    Attributes:
        entries: signature -> measured seconds (finite, >= 0).
        device: name of the device the times were measured on.
        source: free text: how and when they were measured.
    """

    entries: Mapping[str, float] = field(default_factory=dict)  # signature -> seconds
    device: str = ""  # DeviceSpec.name the measurements belong to
    source: str = ""  # provenance, e.g. "mistjax calibrate, 2025-06-01"

    def __post_init__(self) -> None:
        clean: dict[str, float] = {}
        for k, v in dict(self.entries).items():
            if not isinstance(k, str) or not k:
                raise ValueError(f"entries: keys must be non-empty strings, got {k!r}")
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"entries[{k!r}]: expected a finite time >= 0, got {v!r}")
            clean[k] = float(v)
        object.__setattr__(self, "entries", MappingProxyType(clean))

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, signature: object) -> bool:
        return signature in self.entries

    def get(self, signature: str, default: float | None = None) -> float | None:
        """Measured time of ``signature`` or ``default``."""
        return self.entries.get(signature, default)

    def with_entries(self, new: Mapping[str, float]) -> OpTimeTable:
        """Copy with ``new`` added (overriding existing keys)."""
        return OpTimeTable({**self.entries, **new}, self.device, self.source)

    def lookup(
        self, signatures: Iterable[str], flops: ArrayLike, nbytes: ArrayLike, device: DeviceSpec
    ) -> np.ndarray:
        """Times for a 1-D list of ops: measured where the table has the signature, else roofline."""
        sigs = list(signatures)
        est = np.broadcast_to(op_time(flops, nbytes, device), (len(sigs),))
        meas = np.array([self.entries.get(s, np.nan) for s in sigs], dtype=np.float64)
        return np.where(np.isnan(meas), est, meas)

    def to_json(self) -> str:
        """Serialise (keys sorted, so equal tables give equal text)."""
        doc = {"format": _TABLE_FORMAT, "version": _TABLE_VERSION, "device": self.device,
               "source": self.source, "entries": dict(sorted(self.entries.items()))}
        return json.dumps(doc, indent=1)

    @classmethod
    def from_json(cls, text: str) -> OpTimeTable:
        """Parse and validate; raises ValueError naming the bad field."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"op time table: not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise ValueError("op time table: expected a JSON object at the top level")
        allowed = {"format", "version", "device", "source", "entries"}
        extra = sorted(set(doc) - allowed)
        if extra:
            raise ValueError(f"op time table: unknown field(s) {extra}; expected {sorted(allowed)}")
        if doc.get("format") != _TABLE_FORMAT:
            raise ValueError(f"op time table.format: expected {_TABLE_FORMAT!r}, got {doc.get('format')!r}")
        if doc.get("version") != _TABLE_VERSION:
            raise ValueError(f"op time table.version: expected {_TABLE_VERSION}, got {doc.get('version')!r}")
        for key in ("device", "source"):
            if not isinstance(doc.get(key, ""), str):
                raise ValueError(f"op time table.{key}: expected a string")
        entries = doc.get("entries")
        if not isinstance(entries, dict):
            raise ValueError("op time table.entries: expected an object mapping signature -> seconds")
        try:
            return cls(entries, doc.get("device", ""), doc.get("source", ""))
        except ValueError as e:
            raise ValueError(f"op time table.{e}") from None

    def save(self, path: str | Path) -> None:
        """Write ``to_json()`` to ``path``."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> OpTimeTable:
        """Read a table written by ``save``."""
        return cls.from_json(Path(path).read_text())
