"""Does the compiled plan fit the devices' memory? Checked once, before the first step runs.

`ShardedStep.verify_memory` (called by the first ``step(state, batch)``) places the state and the batch,
compiles the step's programs (the compilation the first step does anyway; it reuses them) and compares, on
every local device that reports a memory limit, what the plan needs with what the device has free:

    need      = argument + output + temp - alias of the step's program (XLA's ``memory_analysis``, per
                device); for a pipelined plan, the stage's peak over its programs with what lives on the
                stage between them (`mistjax.runtime.mpmd_memory`, as the deviceless verifier counts it)
    available = bytes_limit - other,   other = bytes_in_use - resident

``resident``: bytes of the placed state (and, for a one-program plan, the placed batch) already on the
device. They are part of ``bytes_in_use`` and also of ``need`` (as the program's arguments or, between a
pipeline's programs, as resident state), so they are counted once. Everything else in use on the device
(an unplaced copy of the state the caller still holds, other arrays, another program's buffers) is taken
from the limit. Host-placed (offloaded) pieces count on neither side.

A device's capacity comes from `device_capacity` (``memory_stats()['bytes_limit']``) and its use from
`device_in_use`; devices without a limit (the CPU) are not checked, and nothing is compiled early for them.
Tests replace the two functions (``monkeypatch.setattr(mistjax.runtime.fit, "device_capacity", ...)``) to
give simulated CPU devices a capacity.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np

from mistjax.core.plan import Plan, PlanDoesNotFit, format_bytes
from mistjax.core.types import PyTree
from mistjax.runtime.mpmd_memory import program_peak, stage_peaks

if TYPE_CHECKING:  # annotations only: the pipeline imports this module
    from mistjax.runtime.mpmd import MpmdStep

HOST_KINDS = ("pinned_host", "unpinned_host")


def _stats(device: jax.Device) -> dict[str, int] | None:
    try:
        return device.memory_stats()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def device_capacity(device: jax.Device) -> int | None:
    """Bytes the device's allocator may hand out (``memory_stats()['bytes_limit']``), or None where the
    device reports no limit (the CPU has no fixed capacity: such devices are not checked)."""
    limit = (_stats(device) or {}).get("bytes_limit")
    return int(limit) if limit else None


def device_in_use(device: jax.Device) -> int | None:
    """Bytes allocated on the device now (``memory_stats()['bytes_in_use']``), or None if it does not say."""
    used = (_stats(device) or {}).get("bytes_in_use")
    return int(used) if used is not None else None


def capacities(devices: Iterable[jax.Device]) -> dict[jax.Device, int]:
    """`device_capacity` of this process's devices among ``devices``, for those that report one."""
    me = jax.process_index()
    caps = {d: device_capacity(d) for d in devices if d.process_index == me}
    return {d: c for d, c in caps.items() if c is not None}


def resident_bytes(tree: PyTree) -> dict[jax.Device, int]:
    """Per device: bytes of the device-memory shards of the arrays in ``tree`` (host-placed ones left out)."""
    out: dict[jax.Device, int] = {}
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array) or x.is_deleted() or x.sharding.memory_kind in HOST_KINDS:
            continue
        for s in x.addressable_shards:
            out[s.device] = out.get(s.device, 0) + int(s.data.nbytes)
    return out


@dataclass(frozen=True)
class StageFit:
    """One stage's need against its tightest device."""

    stage: int
    phase: str  # the program at the stage's peak ("step": the one program of a single-stage plan)
    layers: tuple[int, int]
    devices: int  # devices of the stage (this process's)
    device: jax.Device  # the stage's device with the least room
    need: int  # bytes per device at the stage's peak
    limit: int  # that device's capacity (`device_capacity`)
    other: int  # bytes in use on it by buffers the step does not account for

    @property
    def available(self) -> int:
        return self.limit - self.other

    @property
    def fits(self) -> bool:
        return self.need <= self.available

    def line(self) -> str:
        return (f"stage {self.stage} ({self.phase}) needs {format_bytes(self.need)} of "
                f"{format_bytes(self.available)} free on {self.device}")


@dataclass(frozen=True)
class FitReport:
    """The memory check of a step (no stages: no device reports a limit, nothing was checked)."""

    stages: tuple[StageFit, ...] = ()

    @property
    def checked(self) -> bool:
        return bool(self.stages)

    @property
    def misfits(self) -> tuple[StageFit, ...]:
        return tuple(s for s in self.stages if not s.fits)

    @property
    def worst(self) -> StageFit | None:
        """The stage with the least room (most missing bytes)."""
        return max(self.stages, key=lambda s: s.need - s.available, default=None)

    def summary(self) -> str:
        if not self.stages:
            return "memory check: skipped (the devices report no memory limit)"
        return "memory check before the first step: " + "; ".join(s.line() for s in self.stages)


def stage_fit(stage: int, phase: str, layers: tuple[int, int], need: int, devices: Iterable[jax.Device],
              caps: dict[jax.Device, int], resident: dict[jax.Device, int]) -> StageFit | None:
    """The stage's fit on its device with the least room (None: none of its devices reports a limit)."""
    devices = list(devices)
    best: StageFit | None = None
    for d in devices:
        if d not in caps:
            continue
        used = device_in_use(d)
        other = max(0, used - resident.get(d, 0)) if used is not None else 0
        fit = StageFit(stage, phase, (layers[0], layers[1]), len(devices), d, int(need), caps[d], other)
        if best is None or fit.available < best.available:
            best = fit
    return best


def check_single(plan: Plan, compiled: jax.stages.Compiled, devices: Iterable[jax.Device], placed: PyTree
                 ) -> FitReport:
    """A one-program plan: its compiled step against every device (``placed``: its placed arguments)."""
    devices = list(devices)
    fit = stage_fit(0, "step", plan.stages[0].layers, program_peak(compiled), devices, capacities(devices),
                    resident_bytes(placed))
    return FitReport((fit,) if fit is not None else ())


def check_pipeline(ex: MpmdStep, compiled: dict[tuple[int, str], jax.stages.Compiled], placed_state: PyTree
                   ) -> FitReport:
    """A pipelined plan (``ex``: its `MpmdStep`): every stage's peak against its own devices."""
    caps = capacities(ex.mesh.devices.flat)
    resident = resident_bytes(placed_state)
    fits = []
    for k, (need, phase) in sorted(stage_peaks(ex, compiled).items()):
        fit = stage_fit(k, phase, ex.plan.stages[k].layers, need, ex.meshes[k].devices.flat, caps, resident)
        if fit is not None:
            fits.append(fit)
    return FitReport(tuple(fits))


def knob_hints(plan: Plan, k: int) -> list[str]:
    """The knobs of stage ``k`` (and of the plan) that would lower its memory, as the plan sets them now."""
    sp = plan.stages[k]
    on = f" on stage {k}" if plan.num_stages > 1 else ""
    hints = []
    if sp.remat_layers < sp.num_layers:
        hints.append(f"raise remat_layers{on} (now {sp.remat_layers} of {sp.num_layers})")
    elif sp.remat_policy != "full":
        hints.append(f"remat_policy='full'{on} (now {sp.remat_policy!r})")
    if (plan.shard_group or plan.dp) > 1:
        for flag, zero in (("shard_opt", "ZeRO-1"), ("shard_grads", "ZeRO-2"), ("shard_weights", "ZeRO-3")):
            if not getattr(sp, flag):
                hints.append(f"{flag}=True{on} ({zero})")
                break
    if sp.offload_opt < 1:
        hints.append(f"offload the optimizer state{on} (offload_opt, now {sp.offload_opt:g})")
    if plan.micro_batch > 1:
        hints.append(f"a smaller micro_batch (now {plan.micro_batch}; raise grad_accum, now {plan.grad_accum}, "
                     "to keep the batch)")
    if plan.num_stages > 1 and sp.num_layers > 1:
        hints.append(f"fewer layers on stage {k} (now {sp.num_layers})")
    return hints


def misfit_error(report: FitReport, plan: Plan) -> PlanDoesNotFit:
    """The error for a report with a stage that does not fit, naming it and the knobs to change."""
    f = report.worst
    assert f is not None and not f.fits
    where = (f"stage {f.stage} (layers {f.layers[0]}-{f.layers[1]}, its {f.phase} program)" if plan.num_stages > 1
             else f"stage 0 (the whole step, layers {f.layers[0]}-{f.layers[1]})")
    hints = knob_hints(plan, f.stage)
    if f.other > 0.05 * f.limit:
        hints.append(f"free the {format_bytes(f.other)} other buffers hold on {f.device} (e.g. an unplaced copy of "
                     "the state: pass the state step.place(state, batch) returns and drop the original)")
    others = [s for s in report.misfits if s is not f]
    also = f" (also {', '.join(s.line() for s in others)})" if others else ""
    msg = (f"the plan does not fit in device memory: {where} needs {format_bytes(f.need)} per device at its peak, "
           f"but {f.device} has {format_bytes(f.available)} free ({format_bytes(f.limit)} limit, "
           f"{format_bytes(f.other)} held by other buffers){also}; lower it by {format_bytes(f.need - f.available)}: "
           f"{'; '.join(hints + ['more devices'])}. Checked before the first step, from XLA's memory analysis of "
           "the compiled program" + ("s" if plan.num_stages > 1 else ""))
    return PlanDoesNotFit(msg, stage=f.stage, need=f.need, available=f.available, report=report)


def raise_if_misfit(report: FitReport, plan: Plan) -> None:
    """Raise `misfit_error` if a stage of ``report`` does not fit; in a multi-process run every process
    raises when any does (each checks its own devices, and one process stopping alone would leave the
    others waiting in the step's first collective)."""
    local = max((f.need - f.available for f in report.misfits), default=0.0)
    gaps = np.array([local])
    if jax.process_count() > 1:  # every process takes part, misfit or not
        from jax.experimental import multihost_utils

        gaps = np.asarray(multihost_utils.process_allgather(np.float64(local))).reshape(-1)
    if report.misfits:
        raise misfit_error(report, plan)
    worst = int(np.argmax(gaps))
    if gaps[worst] > 0:
        raise PlanDoesNotFit(f"the plan does not fit in device memory on process {worst} (short by "
                             f"{format_bytes(gaps[worst])} per device; that process's error names the stage "
                             "and the knobs)", need=float(gaps[worst]), available=0.0, report=report)


__all__ = ["FitReport", "StageFit", "capacities", "check_pipeline", "check_single", "device_capacity",
           "device_in_use", "knob_hints", "misfit_error", "raise_if_misfit", "resident_bytes", "stage_fit"]
