"""Per-step training metrics: a JSON-lines log that survives restarts, throughput and MFU.

MFU (model FLOPs utilisation) is the fraction of the hardware's peak that the model's own
arithmetic would need at the measured speed::

    MFU = 6 * N * tokens_per_s / (num_devices * peak_flops_per_device)

with N the parameter count: a forward and backward pass cost about 6 FLOPs per parameter per
token (2 forward, 4 backward). Attention score FLOPs and remat recomputation are not counted,
as in the PaLM/Megatron convention, so MFU does not reward recomputation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

FLOPS_PER_PARAM_PER_TOKEN = 6  # forward 2 + backward 4


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


def mfu(tokens_per_s: float, num_params: int, num_devices: int, peak: float) -> float:
    """Model FLOPs utilisation (see the module docstring for the formula)."""
    return FLOPS_PER_PARAM_PER_TOKEN * num_params * tokens_per_s / (num_devices * peak)


def _step_of(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None  # e.g. a half-written last line from a killed run
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


class MetricsLog:
    """JSON lines, one record per step, that a resumed run continues without duplicates.

    Opening the log keeps only the records of steps before `start_step` (all earlier steps of
    the interrupted run), drops the rest and any half-written line, and appends from there.
    Only `enabled` processes write (process 0 in a multi-process run).

    Args:
      path: the JSON-lines file; None disables the log.
      start_step: the first step this run will record.
      enabled: whether this process writes.
    """

    def __init__(self, path: str | Path | None, start_step: int, *, enabled: bool = True) -> None:
        self.path = Path(path) if path is not None else None
        self._file: TextIO | None = None
        if self.path is None or not enabled:
            return
        kept: list[str] = []
        if self.path.exists() and start_step > 0:
            for line in self.path.read_text().splitlines():
                step = _step_of(line)
                if step is not None and step < start_step:
                    kept.append(line + "\n")
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


__all__ = ["FLOPS_PER_PARAM_PER_TOKEN", "MetricsLog", "mfu", "peak_flops"]
