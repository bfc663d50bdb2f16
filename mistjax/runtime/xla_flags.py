"""The XLA settings the runtime sets, in one place, each with its reason.

XLA:GPU flags go to the compiler per program (``jax.jit(..., compiler_options=...)``, see
`compiler_options`), never through the process-wide ``XLA_FLAGS``: a CPU program in the same process
(tests, deviceless compiles) is unaffected, and the user's own ``XLA_FLAGS`` still apply underneath.

The collective matmul (`mistjax.runtime.collective_matmul`) is a rewrite of the traced program, not a
flag: the plan's ``tp_overlap`` knob decides it (`core.execution.Capabilities.collective_matmul`), for the
runtime and the cost model alike. It pays only where collectives run asynchronously beside compute (XLA:GPU:
NCCL on its own streams, ``-start`` / ``-done`` pairs the latency-hiding scheduler places GEMMs between), not
on XLA:CPU, which runs each collective synchronously; the tuner turns it on where the cost model predicts a gain.
"""

from __future__ import annotations

from dataclasses import dataclass

# Platforms (``jax.Device.platform``) whose programs get the XLA:GPU flags.
GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})


@dataclass(frozen=True)
class XlaFlag:
    """One XLA debug option the runtime sets, and why."""

    name: str
    value: bool | int | str
    reason: str


@dataclass(frozen=True)
class XlaGpuOptions:
    """What the runtime asks of XLA:GPU.

    Attributes:
      flags: the debug options set on every XLA:GPU program the runtime compiles.
    """

    flags: tuple[XlaFlag, ...]


GPU_FLAGS: tuple[XlaFlag, ...] = (
    XlaFlag("xla_gpu_enable_highest_priority_async_stream", True,
            "runs the collectives' stream at the highest priority, so the NCCL kernels of a ring's "
            "transfers are not starved by the GEMMs they overlap (Megatron-LM and Transformer Engine give "
            "their communication streams high priority too). XLA's default; a run-time property, not "
            "visible in the compiled HLO."),
    XlaFlag("xla_gpu_threshold_for_windowed_einsum_mib", 1 << 40,
            "keeps XLA's own windowed einsum (the SPMD partitioner's loop for an einsum whose operand it "
            "must all-gather or whose result it must reduce-scatter) off, as by default: the runtime "
            "decomposes Megatron's collectives itself (`collective_matmul`) and never leaves the partitioner "
            "a gather beside a dot (with the threshold at 0 the schedule is identical, with the rewrite on "
            "or off)."),
)
"""The XLA:GPU flags of every program the runtime compiles for a GPU.

Not among them: ``xla_gpu_enable_latency_hiding_scheduler``. XLA enables it by default where it pays (the
deviceless H100 schedule of the TP 8 GPT-3 7B step, rings and all, is the same with it set either way), but
forcing it on for an A100 target raised the compiled peak of the Megatron-style TP 4 GPT-3 7B cell from 17.44
to 23.84 GiB (`scripts/bench_gpu_aot.py`, 2026-12-05): the scheduler buys overlap with memory, which the
cost model, fitted on XLA's default programs, does not charge."""

DEFAULT = XlaGpuOptions(GPU_FLAGS)


def compiler_options(platform: str | None, options: XlaGpuOptions = DEFAULT) -> dict[str, bool | int | str]:
    """The ``compiler_options`` of a program compiled for ``platform`` (empty off GPUs)."""
    if platform not in GPU_PLATFORMS:
        return {}
    return {f.name: f.value for f in options.flags}


def describe(options: XlaGpuOptions = DEFAULT) -> str:
    """The settings as text, one per line with the reason (for docs and ``--verbose`` reports)."""
    lines = [f"--{f.name}={str(f.value).lower()}: {f.reason}" for f in options.flags]
    lines.append("collective matmul: the plan's tp_overlap (Plan.tp_overlap), not a flag")
    return "\n".join(lines)


__all__ = ["DEFAULT", "GPU_FLAGS", "GPU_PLATFORMS", "XlaFlag", "XlaGpuOptions", "compiler_options", "describe"]
