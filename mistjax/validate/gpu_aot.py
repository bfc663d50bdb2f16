"""Verify a plan on the target GPU without the GPU: XLA:GPU deviceless AOT compiles.

`compile_plan` builds compile-only devices for a cluster (``get_topology_desc(platform="cuda",
target_config=SPEC, topology="1xNODESxPER_NODE")``, the spec being one of `gpu_targets/`), applies the
plan through the real runtime (`mistjax.runtime.step.ShardedStep` on abstract state and batch: no array
is ever allocated, so full-scale models compile in seconds to minutes), compiles with XLA:GPU and returns
a `GpuAotReport`: per-device memory (`memory_analysis`), whether it fits the card, the async collectives
of the scheduled GPU HLO, XLA's HloCostAnalysis, and what is live at the memory peak.

Requirements: the CUDA plugin (``pip install 'mistjax[gpu-aot]'``: jax-cuda12-plugin / -pjrt pinned to
jax, nvidia-cuda-nvcc-cu12 for ptxas and libdevice; no CUDA runtime wheels) and, on a machine without a
GPU driver, a process started with ``JAX_PLATFORMS=cpu`` (otherwise the plugin's CUDA version check fails
and no cuda topology can be made). `verify_in_subprocess` runs the compile in a fresh
``JAX_PLATFORMS=cpu`` process, whatever the caller's platform state; the CLI's ``--verify`` uses it.

Limits (docs/cost_model.md): no autotuning deviceless (default GEMM tiles); ``memory_analysis`` leaves out
allocator, cuBLAS/cuDNN and NCCL overheads; and compile-only devices have no host memory space, so jaxlib
drops ``memory_kind="pinned_host"`` from the state's shardings: state the plan offloads is counted on the
device (`GpuAotReport.offloaded_state` says how much). Activation offload (in-program placement) is kept.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mistjax.core.execution import collective_matmul_runs
from mistjax.core.hlo import AsyncCollective, async_collectives, collective_bytes, collectives, computation_trips
from mistjax.core.plan import Plan, format_bytes
from mistjax.core.types import Batch, State, TrainStep
from mistjax.validate.gpu_aot_pipeline import PipelineAotReport, format_pipeline, group_peaks, verify_pipeline
from mistjax.validate.gpu_aot_target import (
    INSTALL_HINT,
    TARGET_SPECS,
    DeviceMemory,
    GpuAotUnavailable,
    GpuTarget,
    MemoryAnalyzed,
    MemoryStats,
    Verification,
    compile_only_devices,
    device_mesh,
    load_target,
    plugin_problem,
    target_for,
    zoo_step,
)
from mistjax.validate.peak import LiveBuffer, peak_from_dump

if TYPE_CHECKING:
    import jax

    from mistjax.cost.predict import Analysis
    from mistjax.hardware.presets import ClusterSpec
    from mistjax.runtime.step import ShardedStep
    from models.config import ModelConfig

# ---------------------------------------------------------------------------------------- the report
@dataclass(frozen=True)
class CollectiveStats:
    """The collectives of one kind in the scheduled GPU HLO."""

    count: int  # instructions (each async pair or sync op once; loop bodies once)
    async_pairs: int  # of them, split into -start / -done
    overlapped: int  # async pairs with compute scheduled between start and done
    bytes_per_step: int  # result bytes per device per step (loop trips counted)
    in_loops: int = 0  # of the instructions, those inside loop bodies / branches (per layer, micro-batch, tick)


@dataclass(frozen=True)
class GpuAotReport:
    """What XLA:GPU compiled for one plan on one cluster (per device: SPMD devices run one program)."""

    cluster: str  # e.g. "l4:1x2"
    device_kind: str  # the compile-only devices' kind, e.g. "NVIDIA L4"
    num_devices: int  # devices the program was compiled for
    memory: DeviceMemory  # XLA's memory analysis of one device
    capacity: float  # bytes of one card (the cluster's device memory, --memory-gib applied)
    budget: float  # bytes a plan may use per device (cluster.memory_budget(): capacity x usable fraction)
    xla_memory_limit: int  # the spec's device_memory_size, XLA's own limit
    collectives: dict[str, CollectiveStats]  # by kind
    flops: float | None  # HloCostAnalysis FLOPs of the optimised module (None if the private call failed)
    bytes_accessed: float | None  # HloCostAnalysis bytes accessed (after GPU fusion)
    offloaded_state: int  # state bytes per device the plan keeps on host that XLA:GPU counts on device
    peak_buffers: tuple[LiveBuffer, ...]  # values live at the memory peak, largest first (if dumped)
    compile_seconds: float  # lower + compile wall time
    notes: tuple[str, ...] = ()  # caveats of this compile
    hlo_text: str = field(default="", repr=False, compare=False)  # the optimised, scheduled GPU HLO

    @property
    def peak(self) -> int:
        return self.memory.peak

    @property
    def peak_host_kept(self) -> int:
        """The peak with the state the plan offloads left in host memory (as on a GPU with host memory)."""
        return self.memory.peak - self.offloaded_state

    @property
    def peak_per_stage(self) -> list[int]:
        """One program, one stage: `peak_host_kept` (the interface of `PipelineAotReport`)."""
        return [self.peak_host_kept]

    @property
    def fits(self) -> bool:
        """XLA:GPU's per-device peak (offloaded state on host) is within the card's memory."""
        return self.peak_host_kept <= self.capacity

    def to_dict(self, with_hlo: bool = False) -> dict[str, object]:
        """JSON-ready fields and the derived ``peak``, ``fits``, ``peak_per_stage`` (``hlo_text`` on request)."""
        out = dataclasses.asdict(self)
        if not with_hlo:
            out.pop("hlo_text")
        out["peak"], out["fits"], out["peak_per_stage"] = self.peak, self.fits, self.peak_per_stage
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> GpuAotReport:
        """The report `to_dict` wrote (its derived keys ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        return cls(**{**d, "memory": DeviceMemory(**d["memory"]),
                      "collectives": {k: CollectiveStats(**v) for k, v in d["collectives"].items()},
                      "peak_buffers": tuple(LiveBuffer(**b) for b in d["peak_buffers"]),
                      "notes": tuple(d.get("notes", ()))})


def xla_cost_analysis(compiled: jax.stages.Compiled) -> dict[str, float] | None:
    """XLA's HloCostAnalysis of a compiled (compile-only) executable's optimised module, or None.

    PRIVATE API: ``compiled.cost_analysis()`` returns None for compile-only executables, so this calls
    ``jax._src.lib._jax.hlo_module_cost_analysis`` on the CPU client with the optimised GPU module (jax
    0.10.2). It counts a loop body once and cuBLAS / cuDNN custom calls as 0 FLOPs. A failure (the
    private call moved) returns None rather than breaking a verification.
    """
    try:
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        module = compiled.runtime_executable().hlo_modules()[0]
        return dict(_jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module))
    except Exception:  # noqa: BLE001 - private API: any failure means "not available"
        return None


def collective_stats(hlo_text: str) -> dict[str, CollectiveStats]:
    """Per-kind collective counts of a scheduled GPU HLO (`mistjax.core.hlo`)."""

    totals = collective_bytes(hlo_text, executed=True)
    pairs = async_collectives(hlo_text)
    found = collectives(hlo_text)
    entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", hlo_text, re.M)
    out = {}
    for kind in sorted({c.op for c in found}):
        mine = [p for p in pairs if p.op == kind and p.done]
        out[kind] = CollectiveStats(count=sum(1 for c in found if c.op == kind), async_pairs=len(mine),
                                    overlapped=sum(1 for p in mine if p.compute_between),
                                    bytes_per_step=int(totals.get(kind, 0)),
                                    in_loops=sum(1 for c in found if c.op == kind and entry
                                                 and c.computation != entry.group(1)))
    return out


def loop_collectives(hlo_text: str, trips: int) -> list[AsyncCollective]:
    """The async collectives of a scheduled GPU HLO's loops of `trips` iterations (a layer loop: one
    trip per layer), with what XLA scheduled between each ``-start`` and its ``-done``: a gradient
    collective that overlaps the backward has the next layer's matmuls there (``matmuls_between``)."""
    loops = computation_trips(hlo_text)
    return [p for p in async_collectives(hlo_text) if p.done and loops.get(p.computation, 1) == trips]


def _offloaded_state_bytes(step: ShardedStep, state: State) -> int:
    """Per-device bytes of the state leaves the plan puts in host memory (their device shard shapes)."""
    import jax
    from jax.sharding import NamedSharding

    total = 0
    for x, lay in zip(jax.tree.leaves(state), step.layouts or ()):
        if lay.host:
            shard = NamedSharding(step.mesh, lay.spec()).shard_shape(tuple(np.shape(x)))
            total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total


def compile_plan(train_step: TrainStep, state: State, batch: Batch, plan: Plan, cluster: ClusterSpec, *,
                 breakdown: bool = True, keep_dump: str | Path | None = None) -> GpuAotReport:
    """Compile ``train_step`` under ``plan`` for ``cluster``'s GPUs, deviceless, and report it.

    Args:
      train_step: ``train_step(state, batch) -> (state, metrics)``, gradients by `mistjax.value_and_grad`.
      state: the train state, abstract (``nnx.eval_shape`` / ``jax.ShapeDtypeStruct`` leaves) or concrete.
      batch: the global batch (``jax.ShapeDtypeStruct`` leaves are enough).
      plan: the plan to apply (its device count must equal the cluster's).
      cluster: a `mistjax.hardware.ClusterSpec` with an XLA:GPU spec (`target_for`).
      breakdown: also dump XLA's buffer assignment and list what is live at the peak (a little slower).
      keep_dump: keep XLA's dump (HLO, buffer assignment, memory-usage report) in this folder.
    Raises:
      GpuAotUnavailable: the plugin is missing or the process was not started with JAX_PLATFORMS=cpu.
    """
    from mistjax.runtime.step import ShardedStep

    target = target_for(cluster)
    devices = compile_only_devices(target, cluster.nodes, cluster.devices_per_node)
    t0 = time.perf_counter()
    step = ShardedStep(train_step, device_mesh(devices, cluster.nodes), plan)
    lowered = step.lower(state, batch)
    with tempfile.TemporaryDirectory(prefix="mistjax-gpu-aot-") as tmp:
        dump = str(keep_dump or tmp)
        options = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True} if breakdown or keep_dump else {}
        compiled, cublas = _compile_gemms(lowered, options)
        seconds = time.perf_counter() - t0
        peak = tuple(peak_from_dump(dump)) if options else ()
    text = compiled.as_text()
    cost = xla_cost_analysis(compiled)
    offloaded = _offloaded_state_bytes(step, state)
    notes = []
    if cublas:
        notes.append("compiled with cuBLAS GEMMs: without autotuning XLA's Triton GEMM emitter found no tile sizes "
                     "for a dot (what autotuning may pick on the GPU too)")
    if offloaded:
        notes.append(f"the plan keeps {format_bytes(offloaded)} of state per device in host memory; compile-only "
                     "devices have no host memory space, so XLA:GPU counts it in the device arguments")
    if cost is None:
        notes.append("XLA's HloCostAnalysis (private API) was not available")
    if plan.tp > 1 and collective_matmul_runs(plan.tp_overlap, plan.cp):
        notes.append("tensor parallelism runs collective matmuls: the layers' all-gathers / reduce-scatters are "
                     "rings of collective-permutes (t - 1 per ring, each beside a chunk's GEMM)")
    return GpuAotReport(
        cluster=f"{cluster.name}:{cluster.nodes}x{cluster.devices_per_node}", device_kind=devices[0].device_kind,
        num_devices=len(devices), memory=DeviceMemory.of(compiled), capacity=float(cluster.device.hbm_bytes),
        budget=float(cluster.memory_budget()), xla_memory_limit=target.memory_bytes,
        collectives=collective_stats(text), flops=None if cost is None else float(cost.get("flops", 0.0)),
        bytes_accessed=None if cost is None else float(cost.get("bytes accessed", 0.0)), offloaded_state=offloaded,
        peak_buffers=peak, compile_seconds=seconds, notes=tuple(notes), hlo_text=text)


def verify_model(config: ModelConfig, seq_len: int, global_batch: int, plan: Plan, cluster: ClusterSpec, *,
                 breakdown: bool = True, keep_dump: str | Path | None = None) -> GpuAotReport:
    """`compile_plan` of the zoo model ``config`` (see `zoo_step`) in this process."""
    state, batch, step = zoo_step(config, seq_len, global_batch)
    return compile_plan(step, state, batch, plan, cluster, breakdown=breakdown, keep_dump=keep_dump)


def verify_any(config: ModelConfig, seq_len: int, global_batch: int, plan: Plan, cluster: ClusterSpec
               ) -> Verification:
    """`verify_model`, or for a pipelined plan every (stage, phase) program of the MPMD executor
    (`mistjax.validate.gpu_aot_pipeline.verify_pipeline`), in this process."""
    if plan.num_stages > 1:
        return verify_pipeline(config, seq_len, global_batch, plan, cluster)
    return verify_model(config, seq_len, global_batch, plan, cluster)


def report_from_dict(d: Mapping[str, object]) -> Verification:
    """A `GpuAotReport` or `PipelineAotReport` from its ``to_dict()``."""
    if d.get("pipelined"):
        return PipelineAotReport.from_dict(d)
    return GpuAotReport.from_dict(d)


def _compile_gemms(lowered: jax.stages.Lowered, options: dict[str, object]) -> tuple[jax.stages.Compiled, bool]:
    """``lowered`` compiled with ``options``, and whether it took cuBLAS GEMMs: without autotuning (deviceless),
    XLA's Triton GEMM emitter can find no tile sizes for some dots, and the compile is retried with Triton
    GEMMs off."""
    try:
        return lowered.compile(compiler_options=options or None), False
    except Exception as e:  # noqa: BLE001 -- XLA raises its runtime error type; only this message is retried
        if _NO_TILES not in str(e):
            raise
    return lowered.compile(compiler_options={**options, "xla_gpu_enable_triton_gemm": False}), True


def verify_in_subprocess(config: ModelConfig, seq_len: int, global_batch: int, plan: Plan, cluster: ClusterSpec, *,
                         timeout: float = 1800.0) -> Verification:
    """`verify_any` in a fresh ``JAX_PLATFORMS=cpu`` Python process (safe whatever this process's JAX
    platform state is): a `GpuAotReport`, or a `PipelineAotReport` for a pipelined plan. Raises
    `GpuAotUnavailable` with the reason when the compile cannot run."""
    problem = plugin_problem()  # imports jax but initialises no backend
    if problem:
        raise GpuAotUnavailable(problem)
    target_for(cluster)  # a cluster without an XLA:GPU spec fails here, before a process is started
    with tempfile.TemporaryDirectory(prefix="mistjax-verify-") as tmp:
        paths = {k: Path(tmp) / f"{k}.json" for k in ("model", "plan", "cluster", "out")}
        paths["model"].write_text(json.dumps(dataclasses.asdict(config)))
        paths["plan"].write_text(plan.to_json())
        paths["cluster"].write_text(cluster.to_json())
        cmd = [sys.executable, "-m", "mistjax.validate.gpu_aot", "--model", str(paths["model"]), "--plan",
               str(paths["plan"]), "--cluster", str(paths["cluster"]), "--seq-len", str(seq_len),
               "--global-batch", str(global_batch), "--out", str(paths["out"])]
        proc = _compile_process(cmd, {}, timeout)
        if proc.returncode != 0 and _NO_TILES in proc.stderr:
            # `compile_plan` retries this in-process (`_compile_gemms`); a pipeline's stage programs are compiled
            # by the executor (`MpmdStep.compile_stages`), so the whole process runs again with Triton GEMMs off.
            proc = _compile_process(cmd, {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}, timeout)
        if proc.returncode != 0 or not paths["out"].is_file():
            raise GpuAotUnavailable("the XLA:GPU compile failed: " + _failure(proc.stderr))
        return report_from_dict(json.loads(paths["out"].read_text()))


_NO_TILES = "Couldn't find output tile sizes"


def _compile_process(cmd: list[str], flags: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run the compile subprocess with JAX_PLATFORMS=cpu and ``flags`` appended to the environment's."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for name, value in flags.items():
        env[name] = f"{env.get(name, '')} {value}".strip()
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise GpuAotUnavailable(f"the XLA:GPU compile did not finish within {timeout:.0f} s") from e


_EXCEPTION = re.compile(r"^(\w+\.)*\w*(Error|Exception|Unavailable): ")


def _failure(stderr: str) -> str:
    """The compile subprocess's exception line (XLA's error text can run to thousands of characters of HLO:
    its head is kept), then the last lines of its traceback."""
    lines = [ln for ln in stderr.splitlines() if ln.strip() and "cudart_stub" not in ln
             and "absl::InitializeLog" not in ln]
    raised = [ln for ln in lines if _EXCEPTION.match(ln)]
    head = (raised[-1][:1500] + "\n  ") if raised else ""
    return head + "\n  ".join(ln[:300] for ln in lines[-8:])


# ------------------------------------------------------------------------------------- comparison
def predicted_split(analysis: Analysis) -> dict[str, float]:
    """The model's prediction in XLA's terms, for the stage with the largest peak: ``state`` (params +
    optimizer, what XLA counts as arguments), ``rest`` (grads + activations + buffers), ``peak``, and
    ``host`` (bytes the model places on host, which deviceless XLA:GPU counts on the device for state)."""
    mems = analysis.stage_memory
    i = int(np.argmax([sum(m.values()) for m in mems]))
    m = mems[i]
    state = m.get("params", 0.0) + m.get("optimizer", 0.0)
    return {"state": state, "rest": sum(m.values()) - state, "peak": sum(m.values()),
            "host": float(analysis.stage_host[i]), "stage": float(i)}


def verdict(report: Verification) -> str:
    """Whether XLA:GPU's largest per-device peak fits the card and the planning budget, in one line."""
    need, card = format_bytes(max(report.peak_per_stage)), format_bytes(report.capacity)
    if not report.fits:
        return f"does not fit: XLA:GPU needs {need} of {card} per device"
    if report.budget and max(report.peak_per_stage) > report.budget:
        return (f"fits the card, barely: XLA:GPU needs {need} of {card}, above the planning budget of "
                f"{format_bytes(report.budget)}")
    return f"fits: XLA:GPU needs {need} of {card} per device"


def format_verification(report: Verification, analysis: Analysis | None = None) -> str:
    """A short table: XLA:GPU's per-device memory next to the prediction, the fit verdict, collectives."""
    if not isinstance(report, GpuAotReport):
        return _format_pipelined(report, analysis)
    pred = predicted_split(analysis) if analysis is not None else None
    mem = report.memory
    unit, uname = (2**30, "GiB") if max(mem.peak, pred["peak"] if pred else 0) >= 2**30 else (2**20, "MiB")
    lines = [f"XLA:GPU deviceless compile for {report.num_devices} x {report.device_kind} "
             f"({report.compile_seconds:.0f} s), per device in {uname}:",
             f"  {'':36s} {'predicted':>10s} {'XLA:GPU':>10s}"]

    def row(label: str, p: float | None, x: float) -> None:
        lines.append(f"  {label:36s} {'-' if p is None else f'{p / unit:.2f}':>10s} {x / unit:10.2f}")

    row("state (params, optimizer: arguments)", pred and pred["state"], mem.argument)
    row("rest (grads, activations: temp)", pred and pred["rest"], mem.peak - mem.argument)
    row("peak", pred and pred["peak"], mem.peak)
    if mem.host_temp or mem.host_argument:
        lines.append(f"  host memory: arguments {mem.host_argument / unit:.2f}, temp {mem.host_temp / unit:.2f}")
    for note in report.notes:
        lines.append(f"  note: {note}")
    colls = ", ".join(f"{k} {c.count} ({c.async_pairs} async, {c.overlapped} overlapped, {c.in_loops} in loops)"
                      for k, c in report.collectives.items())
    lines.append(f"  collectives: {colls or 'none'}")
    if report.peak_buffers:
        lines.append("  largest values live at XLA's peak:")
        for b in report.peak_buffers[:6]:
            lines.append(f"    {format_bytes(b.nbytes):>10s} {b.kind:10s} {b.shape:26s} {b.op_name[-64:]}")
    lines.append("  " + verdict(report))
    return "\n".join(lines)


def _format_pipelined(report: PipelineAotReport, analysis: Analysis | None) -> str:
    groups = len(analysis.stage_memory) if analysis is not None else len(report.stages)
    pred = ([float(sum(m.values())) for m in analysis.stage_memory] if analysis is not None
            else [float("nan")] * groups)
    unit, uname = (2**30, "GiB") if max(report.peak_per_stage) >= 2**30 else (2**20, "MiB")
    lines = [f"XLA:GPU deviceless compile of {len(report.stages)} pipeline stages' programs for "
             f"{report.num_devices} x {report.device_kind} ({report.compile_seconds:.0f} s), per device in {uname}:"]
    lines += format_pipeline(report, pred, unit, uname)
    lines.append("  " + verdict(report))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- subprocess entry point
def _main(argv: list[str] | None = None) -> int:
    import argparse

    from mistjax.hardware.presets import ClusterSpec
    from models.config import ModelConfig

    p = argparse.ArgumentParser(description="Compile a plan deviceless for XLA:GPU and write the report JSON "
                                            "(run with JAX_PLATFORMS=cpu).")
    p.add_argument("--model", required=True, help="models.ModelConfig fields as JSON")
    p.add_argument("--plan", required=True, help="plan JSON")
    p.add_argument("--cluster", required=True, help="ClusterSpec JSON or a preset spec like l4:1x2")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--out", required=True, help="where to write the report JSON")
    args = p.parse_args(argv)
    config = ModelConfig(**json.loads(Path(args.model).read_text()))
    cluster = (ClusterSpec.from_json(Path(args.cluster).read_text()) if Path(args.cluster).is_file()
               else ClusterSpec.parse(args.cluster))
    report = verify_any(config, args.seq_len, args.global_batch, Plan.load(args.plan), cluster)
    Path(args.out).write_text(json.dumps(report.to_dict()))
    return 0


__all__ = ["CollectiveStats", "DeviceMemory", "GpuAotReport", "GpuAotUnavailable", "GpuTarget", "INSTALL_HINT",
           "MemoryAnalyzed", "MemoryStats", "TARGET_SPECS", "Verification", "collective_stats",
           "compile_only_devices", "compile_plan", "device_mesh", "format_verification", "group_peaks",
           "load_target", "plugin_problem", "predicted_split", "report_from_dict", "target_for", "verify_any",
           "verify_in_subprocess", "verify_model", "xla_cost_analysis", "zoo_step"]

if __name__ == "__main__":
    sys.exit(_main())
