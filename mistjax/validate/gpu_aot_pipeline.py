"""Pipelined plans on the target GPU without the GPU: every (stage, phase) program, compiled deviceless.

A plan with several stages runs on the MPMD executor (`mistjax.runtime.mpmd`): one jitted program per
(stage, phase), each on its stage's sub-mesh. `compile_pipeline` gives the executor the compile-only
XLA:GPU devices of `mistjax.validate.gpu_aot` (the same ``(node, gpu)`` mesh a single-program plan gets;
the executor cuts each stage's sub-mesh out of it), compiles every program with
``MpmdStep.compile_stages`` and reports, per stage, XLA's ``memory_analysis`` of each program and the
stage's peak:

    peak(stage) = max over its programs p of [ argument(p) + output(p) + temp(p) - alias(p) + resident(p) ]

``resident(p)``: device bytes per device that live on the stage's devices between programs and are not
arguments of ``p``: the stage's state pieces that ``p`` does not take (optimizer state during the
forward and backward, everything during ``finish``), the gradient accumulators and loss sums where ``p``
does not take them (forward, split, update rounds), and the residuals of the *other* micro-batches in
flight (`MpmdStep.residual_bytes` x the most other micro-batches' residuals held while ``p`` runs, from
the schedule's issue order: the forward of micro-batch i keeps the residuals of those issued before it,
the backward of i those of the others). With virtual stages (several chunks per device group), the
group's other chunks add their state, accumulators and most residuals held (an upper bound). Not counted:
activations and cotangents received and queued for a later program (one micro-batch's boundary value
each), allocator, cuBLAS/cuDNN and NCCL overheads (as for single programs). Compile-only devices have no
host memory space: state the plan offloads is counted by XLA:GPU on the device where a program takes it
as an argument (the update rounds; `ProgramAot.host_in_arguments`), and as host (not resident) otherwise;
`StageAot.peak_host_kept` is the peak with it left on host. The resident bytes are counted by
`mistjax.runtime.mpmd_memory`, as the runtime's memory check before the first step counts them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mistjax.core.plan import Plan
from mistjax.core.types import Batch, State, TrainStep
from mistjax.runtime.mpmd_memory import (
    group_peers,
    most_in_flight,
    persistent,
    resident_parts,
    residuals_beside,
    shard_bytes,
    takes,
)
from mistjax.validate.gpu_aot_target import (
    DeviceMemory,
    MemoryAnalyzed,
    Verification,
    compile_only_devices,
    device_mesh,
    target_for,
    zoo_step,
)

if TYPE_CHECKING:
    from mistjax.hardware.presets import ClusterSpec
    from mistjax.runtime.mpmd import MpmdStep
    from models.config import ModelConfig


@dataclass(frozen=True)
class ProgramAot:
    """One (stage, phase) program: XLA's memory analysis and what lives beside it."""

    phase: str  # forward / backward / last / finish / split / update1 ...
    memory: DeviceMemory  # XLA:GPU's memory_analysis of the program, per device
    resident: int  # device bytes live between programs that are not its arguments (module docstring)
    resident_parts: dict[str, int]  # resident by kind: state, accumulators, residuals
    # host-placed state it takes and offloaded residuals it takes or makes, which compile-only XLA:GPU counts
    # on the device (in `argument` / `output`)
    host_in_arguments: int = 0

    @property
    def peak(self) -> int:
        return self.memory.peak + self.resident

    @property
    def peak_host_kept(self) -> int:
        """`peak` with the host-placed state it takes left in host memory (as on a GPU with host memory)."""
        return self.peak - self.host_in_arguments


@dataclass(frozen=True)
class StageAot:
    """One stage's programs and its peak (the largest program peak)."""

    stage: int
    layers: tuple[int, int]
    programs: tuple[ProgramAot, ...]
    state: int  # device bytes per device of the stage's state pieces (host-placed pieces left out)
    offloaded: int  # bytes per device of the pieces the plan places on host
    accumulators: int  # gradient accumulators and loss sums (device-placed)
    residual_bytes: int  # one micro-batch's residuals (`MpmdStep.residual_bytes`)
    in_flight: int  # most micro-batches' residuals held at once on the stage
    group: int = -1  # the device group it runs on (`Plan.stage_groups`); -1: read before groups were recorded

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.programs)

    @property
    def peak_phase(self) -> str:
        return max(self.programs, key=lambda p: p.peak).phase

    @property
    def peak_host_kept(self) -> int:
        """The peak with offloaded state counted on host where a program takes it (`ProgramAot`)."""
        return max(p.peak_host_kept for p in self.programs)


@dataclass(frozen=True)
class PipelineAotReport:
    """What XLA:GPU compiled for one pipelined plan on one cluster."""

    cluster: str
    device_kind: str
    num_devices: int
    stages: tuple[StageAot, ...]
    capacity: float  # bytes of one card
    compile_seconds: float
    budget: float = 0.0  # bytes a plan may use per device (cluster.memory_budget())

    @property
    def peak_per_stage(self) -> list[int]:
        """Each stage's peak with the state the plan offloads kept on host (as on a GPU with host memory)."""
        return [s.peak_host_kept for s in self.stages]

    @property
    def fits(self) -> bool:
        """Every stage's peak is within the card's memory."""
        return max(self.peak_per_stage) <= self.capacity

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> PipelineAotReport:
        """The report `to_dict` wrote (its derived keys ignored)."""
        def program(p: Mapping[str, object]) -> ProgramAot:
            return ProgramAot(p["phase"], DeviceMemory(**p["memory"]), p["resident"], dict(p["resident_parts"]),
                              p.get("host_in_arguments", 0))

        def stage(s: Mapping[str, object]) -> StageAot:
            return StageAot(s["stage"], tuple(s["layers"]), tuple(program(p) for p in s["programs"]), s["state"],
                            s["offloaded"], s["accumulators"], s["residual_bytes"], s["in_flight"], s.get("group", -1))

        return cls(d["cluster"], d["device_kind"], d["num_devices"], tuple(stage(s) for s in d["stages"]),
                   d["capacity"], d["compile_seconds"], d.get("budget", 0.0))

    def to_dict(self) -> dict[str, object]:
        """JSON-ready fields with the derived peaks, ``fits`` and ``pipelined`` (`report_from_dict` reads it)."""
        out = dataclasses.asdict(self)
        for s, d in zip(self.stages, out["stages"]):
            d["peak"], d["peak_phase"], d["peak_host_kept"] = s.peak, s.peak_phase, s.peak_host_kept
            for p, pd in zip(s.programs, d["programs"]):
                pd["peak"], pd["xla_peak"], pd["peak_host_kept"] = p.peak, p.memory.peak, p.peak_host_kept
        out["peak_per_stage"], out["fits"], out["pipelined"] = self.peak_per_stage, self.fits, True
        return out


def stage_group(stage: StageAot, groups: int) -> int:
    """The device group ``stage`` ran on: as recorded, or round robin for a report written before groups were."""
    return stage.group if stage.group >= 0 else stage.stage % groups


def group_peaks(report: Verification, groups: int) -> tuple[float, ...]:
    """XLA's peak per device group: the stages placed on group g share its devices (each stage's peak already
    counts what the group's other stages keep resident)."""
    peaks = report.peak_per_stage
    stages = getattr(report, "stages", None)
    if not stages or not hasattr(stages[0], "group"):
        return tuple(float(max(peaks[g::groups])) for g in range(groups))
    placed = [stage_group(s, groups) for s in stages]
    return tuple(float(max(p for p, h in zip(peaks, placed) if h == g)) for g in range(groups))


def format_pipeline(report: PipelineAotReport, predicted: list[float], unit: float, uname: str) -> list[str]:
    """Per device group: the predicted peak next to XLA:GPU's, the program at XLA's peak and what lives
    beside it (`resident_parts`)."""
    lines = [f"  {'stage':<16s} {'predicted':>10s} {'XLA:GPU':>10s}  XLA's peak program: args + out + temp - alias, "
             f"+ resident state / accumulators / residuals ({uname})"]
    xla = group_peaks(report, len(predicted))
    for g, (p, x) in enumerate(zip(predicted, xla)):
        st = max((s for s in report.stages if stage_group(s, len(predicted)) == g), key=lambda s: s.peak_host_kept)
        prog = max(st.programs, key=lambda q: q.peak_host_kept)
        m, r = prog.memory, prog.resident_parts
        label = f"{g} (layers {st.layers[0]}-{st.layers[1]})"
        lines.append(f"  {label:<16s} {p / unit:10.2f} {x / unit:10.2f}  {prog.phase}: {m.argument / unit:.2f} + "
                     f"{m.output / unit:.2f} + {m.temp / unit:.2f} - {m.alias / unit:.2f}, + {r['state'] / unit:.2f} "
                     f"/ {r['accumulators'] / unit:.2f} / {r['residuals'] / unit:.2f}")
    return lines


def stage_reports(ex: MpmdStep, compiled: Mapping[tuple[int, str], MemoryAnalyzed]) -> tuple[StageAot, ...]:
    """Per stage: each program's memory analysis with its resident bytes, and the stage's peak."""
    flight, most = residuals_beside(ex), most_in_flight(ex)
    pers = [persistent(ex, k, most[k]) for k in range(ex.K)]
    out = []
    for k in range(ex.K):
        others = group_peers(ex, k, pers)
        progs = []
        for (kk, phase), c in sorted(compiled.items()):
            if kk != k:
                continue
            parts = resident_parts(ex, k, phase, pers[k], others, flight)
            host_in = sum(b for i, b in pers[k].host.items() if i in takes(ex, k, phase)[0])
            # Offloaded residuals: the forward's outputs and the backward's arguments, in host memory on a GPU.
            host_in += ex.residual_host_bytes()[k] if phase in ("forward", "backward") else 0
            progs.append(ProgramAot(phase, DeviceMemory.of(c), sum(parts.values()), parts, host_in))
        out.append(StageAot(k, tuple(ex.plan.stages[k].layers), tuple(progs), sum(pers[k].state.values()),
                            sum(pers[k].host.values()), pers[k].acc, pers[k].residual, most[k], ex.group[k]))
    return tuple(out)


def compile_pipeline(train_step: TrainStep, state: State, batch: Batch, plan: Plan, cluster: ClusterSpec
                     ) -> PipelineAotReport:
    """Compile every (stage, phase) program of a pipelined ``plan`` for ``cluster``'s GPUs, deviceless.

    Same arguments as `mistjax.validate.gpu_aot.compile_plan`; the plan must have several stages.
    Raises `GpuAotUnavailable` when the plugin is missing or the process was not started with
    ``JAX_PLATFORMS=cpu``.
    """
    from mistjax.runtime.step import ShardedStep

    target = target_for(cluster)
    devices = compile_only_devices(target, cluster.nodes, cluster.devices_per_node)
    t0 = time.perf_counter()
    step = ShardedStep(train_step, device_mesh(devices, cluster.nodes), plan)
    compiled = step.compile_stages(state, batch)
    seconds = time.perf_counter() - t0
    return PipelineAotReport(cluster=f"{cluster.name}:{cluster.nodes}x{cluster.devices_per_node}",
                             device_kind=devices[0].device_kind, num_devices=len(devices),
                             stages=stage_reports(step._mpmd, compiled), capacity=float(cluster.device.hbm_bytes),
                             compile_seconds=seconds, budget=float(cluster.memory_budget()))


def verify_pipeline(config: ModelConfig, seq_len: int, global_batch: int, plan: Plan, cluster: ClusterSpec
                    ) -> PipelineAotReport:
    """`compile_pipeline` of the zoo model ``config`` (`mistjax.validate.gpu_aot_target.zoo_step`)."""
    state, batch, step = zoo_step(config, seq_len, global_batch)
    return compile_pipeline(step, state, batch, plan, cluster)


__all__ = ["PipelineAotReport", "ProgramAot", "StageAot", "compile_pipeline", "format_pipeline", "group_peaks",
           "most_in_flight", "resident_parts", "residuals_beside", "shard_bytes", "stage_reports", "verify_pipeline"]
