"""Per-step training metrics: a JSON-lines log that survives restarts, and the hardware peak for MFU.

MFU (model FLOPs utilisation) is the fraction of the hardware's peak that the model's own
arithmetic would need at the measured speed (`mistjax.api.mfu`, PaLM's model FLOPs)::

    MFU = (6 N + 12 L H Q T) * tokens_per_s / (num_devices * peak_flops_per_device)

with N the parameter count, L layers, H heads of size Q and T tokens per sequence. Remat
recomputation is not counted, so MFU does not reward it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO


def peak_flops(hardware: str, compute_dtype: str) -> float:
    """Peak dense FLOP/s of one device of the `hardware` preset for `compute_dtype`.

    Uses ``DeviceSpec.peak_flops`` (bf16/fp16 tensor-core peak) for half precision and
    ``peak_flops_fp32`` for float32, so an fp32 run is measured against what fp32 can reach.

    Raises:
      ValueError: unknown preset (the message lists the valid names) or no hardware package.
    """
    try:
        from mistjax.hardware import ClusterSpec
    except ImportError as e:  # the hardware presets are an optional part of mistjax
        raise ValueError("--hardware needs the mistjax.hardware package, which is not installed") from e
    device = ClusterSpec.preset(hardware).device
    return float(device.peak_flops_fp32 if compute_dtype == "float32" else device.peak_flops)


def _step_of(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None  # e.g. a half-written last line from a killed run
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


class MetricsLog:
    """JSON lines, one record per step (steps numbered from 1), that a resumed run continues without
    duplicates.

    Opening the log keeps only the records of steps up to `start_step` (the steps the checkpoint
    holds), drops the rest and any half-written line, and appends from there; `kept` holds the
    kept records (a resumed run's plot covers them). Only `enabled` processes write (process 0 in
    a multi-process run).

    Args:
      path: the JSON-lines file; None disables the log.
      start_step: steps done before this run (its first record is step ``start_step + 1``).
      enabled: whether this process writes.
    """

    def __init__(self, path: str | Path | None, start_step: int, *, enabled: bool = True) -> None:
        self.path = Path(path) if path is not None else None
        self._file: TextIO | None = None
        self.kept: list[dict] = []
        if self.path is None or not enabled:
            return
        kept: list[str] = []
        if self.path.exists() and start_step > 0:
            for line in self.path.read_text().splitlines():
                step = _step_of(line)
                if step is not None and step <= start_step:
                    kept.append(line + "\n")
                    self.kept.append(json.loads(line))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Rewrite through a temporary file so a crash here never loses the earlier records.
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def write(self, record: Mapping[str, object]) -> None:
        """Append one record and flush it, so a killed run loses at most the line being written."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


__all__ = ["MetricsLog", "peak_flops"]
