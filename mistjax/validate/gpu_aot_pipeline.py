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
`StageAot.peak_host_kept` is the peak with it left on host.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from mistjax.core.plan import Plan
from mistjax.validate.gpu_aot import DeviceMemory, compile_only_devices, device_mesh, target_for


@dataclass(frozen=True)
class ProgramAot:
    """One (stage, phase) program: XLA's memory analysis and what lives beside it."""

    phase: str  # forward / backward / last / finish / split / update1 ...
    memory: DeviceMemory  # XLA:GPU's memory_analysis of the program, per device
    resident: int  # device bytes live between programs that are not its arguments (module docstring)
    resident_parts: dict[str, int]  # resident by kind: state, accumulators, residuals
    host_in_arguments: int = 0  # host-placed state it takes, which compile-only XLA:GPU counts in `argument`

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

    @property
    def peak_per_stage(self) -> list[int]:
        return [s.peak for s in self.stages]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for s, d in zip(self.stages, out["stages"]):
            d["peak"], d["peak_phase"], d["peak_host_kept"] = s.peak, s.peak_phase, s.peak_host_kept
            for p, pd in zip(s.programs, d["programs"]):
                pd["peak"], pd["xla_peak"], pd["peak_host_kept"] = p.peak, p.memory.peak, p.peak_host_kept
        out["peak_per_stage"] = self.peak_per_stage
        return out


# ------------------------------------------------------------------------------------------ bytes
def shard_bytes(aval: Any) -> int:
    """Bytes per device of an abstract array with a sharding."""
    return int(np.prod(aval.sharding.shard_shape(tuple(aval.shape)))) * np.dtype(aval.dtype).itemsize


def others_in_flight(ex: Any) -> dict[tuple[int, str], int]:
    """Per (stage, F | B): the most other micro-batches' residuals held while that program runs."""
    live = [0] * ex.K
    out: dict[tuple[int, str], int] = {}
    for op in ex.issue:
        if op.kind == "FB":
            continue
        k = op.stage
        others = live[k] if op.kind == "F" else live[k] - 1
        out[(k, op.kind)] = max(out.get((k, op.kind), 0), others)
        live[k] += 1 if op.kind == "F" else -1
    return out


# ---------------------------------------------------------------------------------------- resident
@dataclass(frozen=True)
class _Persistent:
    """What lives on one stage between programs, per device."""

    state: dict[int, int]  # state leaf -> device bytes of its piece (device-placed pieces)
    host: dict[int, int]  # state leaf -> bytes of its host-placed piece
    acc: int  # gradient accumulators + loss sums
    residual: int  # one micro-batch's residuals
    most_in_flight: int


def _persistent(ex: Any, k: int, in_flight: int) -> _Persistent:
    """Host placement from the plan's layouts: compile-only devices drop ``pinned_host`` from shardings."""
    pr = ex.programs[k]
    pieces = {i: shard_bytes(ex._piece_aval(i, k)) for i in ex.held[k]}
    host = {i for i in pieces if ex.layouts[k][i].host}
    acc = sum(shard_bytes(a) for a, h in zip(pr.acc_avals(), pr.spec.acc_host) if not h)
    acc += sum(shard_bytes(a) for a in (pr.loss_acc_avals() if k == ex.K - 1 else []))
    return _Persistent({i: b for i, b in pieces.items() if i not in host}, {i: pieces[i] for i in host}, acc,
                       ex.residual_bytes()[k], in_flight)


def _takes(ex: Any, k: int, phase: str) -> tuple[set[int], bool]:
    """(state leaves the program takes as arguments, whether it takes the accumulators)."""
    params = {ex.param_index[j] for j in ex.programs[k].spec.params}
    if phase in ("forward",):
        return params, False
    if phase in ("backward", "last"):
        return params, True
    if phase == "finish":
        return set(), True
    if phase.startswith("update"):
        rnd = ex.rounds[(k, int(phase[len("update"):]))]
        return {g[1] for g in rnd.groups if g[0] == "state"}, False
    return set(), False  # split, metrics


def resident_parts(ex: Any, k: int, phase: str, mine: _Persistent, others: list[_Persistent],
                   flight: dict[tuple[int, str], int]) -> dict[str, int]:
    """Device bytes live on stage ``k``'s devices while ``phase`` runs that are not its arguments."""
    state_in, acc_in = _takes(ex, k, phase)
    n_res = flight.get((k, "F" if phase == "forward" else "B"), 0) if phase in ("forward", "backward") else 0
    parts = {"state": sum(b for i, b in mine.state.items() if i not in state_in),
             "accumulators": 0 if acc_in else mine.acc, "residuals": n_res * mine.residual}
    for o in others:  # the device group's other chunks (virtual stages)
        parts["state"] += sum(o.state.values())
        parts["accumulators"] += o.acc
        parts["residuals"] += o.most_in_flight * o.residual
    return parts


# ----------------------------------------------------------------------------------------- compile
def most_in_flight(ex: Any) -> list[int]:
    live, most = [0] * ex.K, [0] * ex.K
    for op in ex.issue:
        if op.kind in ("F", "B"):
            live[op.stage] += 1 if op.kind == "F" else -1
            most[op.stage] = max(most[op.stage], live[op.stage])
    return most


def stage_reports(ex: Any, compiled: dict[tuple[int, str], Any]) -> tuple[StageAot, ...]:
    """Per stage: each program's memory analysis with its resident bytes, and the stage's peak."""
    flight, most = others_in_flight(ex), most_in_flight(ex)
    pers = [_persistent(ex, k, most[k]) for k in range(ex.K)]
    out = []
    for k in range(ex.K):
        others = [pers[j] for j in range(ex.K) if j != k and j % ex.S == k % ex.S]
        progs = []
        for (kk, phase), c in sorted(compiled.items()):
            if kk != k:
                continue
            parts = resident_parts(ex, k, phase, pers[k], others, flight)
            host_in = sum(b for i, b in pers[k].host.items() if i in _takes(ex, k, phase)[0])
            progs.append(ProgramAot(phase, DeviceMemory.of(c), sum(parts.values()), parts, host_in))
        out.append(StageAot(k, tuple(ex.plan.stages[k].layers), tuple(progs), sum(pers[k].state.values()),
                            sum(pers[k].host.values()), pers[k].acc, pers[k].residual, most[k]))
    return tuple(out)


def compile_pipeline(train_step: Any, state: Any, batch: Any, plan: Plan, cluster: Any) -> PipelineAotReport:
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
                             compile_seconds=seconds)


def verify_pipeline(config: Any, seq_len: int, global_batch: int, plan: Plan, cluster: Any) -> PipelineAotReport:
    """`compile_pipeline` of the zoo model ``config`` (`mistjax.validate.gpu_aot.zoo_step`)."""
    from mistjax.validate.gpu_aot import zoo_step

    state, batch, step = zoo_step(config, seq_len, global_batch)
    return compile_pipeline(step, state, batch, plan, cluster)


__all__ = ["PipelineAotReport", "ProgramAot", "StageAot", "compile_pipeline", "others_in_flight", "shard_bytes",
           "stage_reports", "verify_pipeline"]
