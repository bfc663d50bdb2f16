"""The XLA settings the runtime sets, in one place, each with its reason; and the collective-matmul switch.

XLA:GPU flags go to the compiler per program (``jax.jit(..., compiler_options=...)``, see
`compiler_options`), never through the process-wide ``XLA_FLAGS``: a CPU program in the same process
(tests, deviceless compiles) is unaffected, and the user's own ``XLA_FLAGS`` still apply underneath.

The collective matmul (`mistjax.runtime.collective_matmul`) is a rewrite of the traced program, not a
flag. `use_collective_matmul` decides it per platform: on where collectives run asynchronously beside
compute (XLA:GPU: NCCL on its own streams, ``-start`` / ``-done`` pairs the latency-hiding scheduler
places GEMMs between), off on XLA:CPU, which runs each collective synchronously, so the ring only adds
steps. Force it either way with the environment variable ``MISTJAX_COLLECTIVE_MATMUL=on|off`` (``auto``,
the default: by platform) or, in-process, ``with collective_matmul(True): ...`` around the first call
(trace) of a step; the context wins over the environment.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

COLLECTIVE_MATMUL_ENV = "MISTJAX_COLLECTIVE_MATMUL"
"""Environment switch of the collective matmul: ``on``, ``off`` or ``auto`` (default: on for GPU platforms)."""

# Platforms (``jax.Device.platform``) whose collectives run asynchronously beside compute.
ASYNC_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})


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
      collective_matmul: the collective-matmul rewrite: True / False forces it; None decides by platform
        (and ``MISTJAX_COLLECTIVE_MATMUL``).
    """

    flags: tuple[XlaFlag, ...]
    collective_matmul: bool | None = None


GPU_FLAGS: tuple[XlaFlag, ...] = (
    XlaFlag("xla_gpu_enable_latency_hiding_scheduler", True,
            "schedules each async collective's -start early and its -done late with independent compute "
            "between: what puts a collective matmul's GEMM of chunk s between the start and done of the "
            "transfer of chunk s+1 (and the data-parallel reduce-scatters beside the backward). XLA's "
            "default; in jaxlib 0.10.2 the scheduler runs whatever its value (the deviceless H100 schedule "
            "of the TP=8 GPT-3 7B step is identical with it false). Pinned: the overlap depends on it."),
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
"""The XLA:GPU flags of every program the runtime compiles for a GPU."""

DEFAULT = XlaGpuOptions(GPU_FLAGS)
_forced: list[bool | None] = [None]  # `collective_matmul`'s in-process override (None: none)


def compiler_options(platform: str | None, options: XlaGpuOptions = DEFAULT) -> dict[str, bool | int | str]:
    """The ``compiler_options`` of a program compiled for ``platform`` (empty off GPUs)."""
    if platform not in ASYNC_PLATFORMS:
        return {}
    return {f.name: f.value for f in options.flags}


def use_collective_matmul(platform: str | None, options: XlaGpuOptions = DEFAULT) -> bool:
    """Whether the tensor-parallel runtime runs collective matmuls for ``platform`` (None: unknown).

    Order: the in-process `collective_matmul` context, ``options.collective_matmul``, the
    ``MISTJAX_COLLECTIVE_MATMUL`` environment variable, then the platform (on for GPUs).
    """
    for forced in (_forced[-1], options.collective_matmul):
        if forced is not None:
            return forced
    env = os.environ.get(COLLECTIVE_MATMUL_ENV, "auto").strip().lower()
    if env in ("on", "1", "true"):
        return True
    if env in ("off", "0", "false"):
        return False
    if env not in ("", "auto"):
        raise ValueError(f"{COLLECTIVE_MATMUL_ENV}={env!r}: use on, off or auto")
    return platform in ASYNC_PLATFORMS


@contextlib.contextmanager
def collective_matmul(on: bool | None) -> Iterator[None]:
    """Force the collective matmul on / off (None: by platform) for steps traced inside the block."""
    _forced.append(on)
    try:
        yield
    finally:
        _forced.pop()


def describe(options: XlaGpuOptions = DEFAULT) -> str:
    """The settings as text, one per line with the reason (for docs and ``--verbose`` reports)."""
    lines = [f"--{f.name}={str(f.value).lower()}: {f.reason}" for f in options.flags]
    lines.append(f"collective matmul: {options.collective_matmul!s} (None: by platform; "
                 f"${COLLECTIVE_MATMUL_ENV}={os.environ.get(COLLECTIVE_MATMUL_ENV, 'auto')})")
    return "\n".join(lines)


__all__ = ["ASYNC_PLATFORMS", "COLLECTIVE_MATMUL_ENV", "DEFAULT", "GPU_FLAGS", "XlaFlag", "XlaGpuOptions",
           "collective_matmul", "compiler_options", "describe", "use_collective_matmul"]
