"""Seconds of a part's passes, priced kernel by kernel as the device runs them.

The analysis lists each pass's kernels (`mistjax.analysis.kernels`): GEMMs by shape, fusion kernels by the
bytes they move, fused-attention calls. Here each is priced on the device (docs/cost_model.md, "Kernels"):

* GEMM: ``max(flops / (peak * eff), bytes / (hbm * memory_efficiency)) + kernel_overhead`` (``peak``: the fp8 peak
  for a GEMM of fp8 operands on a device that has one) with the device's
  shape efficiency ``eff = DeviceSpec.gemm_efficiency(m, n, k)`` (a short contraction and m, n padded to whole
  tiles cost throughput): small and skinny GEMMs run below peak.
* Fusion kernels: ``bytes / (hbm * memory_efficiency) + count * kernel_overhead``.
* Fused attention (``fused_attention_kernels``): one kernel per call, its matmul FLOPs at the GEMM efficiency
  of the head dim (half of them when the kernel is causal: cuDNN / FlashAttention skip masked tiles), its
  elementwise work at the fp32 peak, at least its bytes over the memory bandwidth; otherwise (XLA:CPU runs
  the blockwise kernel as ordinary operations) the pass's plain kernel table.

Evaluated once per distinct ``(b, t)`` of the strategies (the sequence length is the workload's) and cached
on the workload, so `stage_cost` stays vectorised.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeAlias

import numpy as np
from numpy.typing import ArrayLike

from mistjax.analysis.kernels import KernelArrays
from mistjax.cost.layout import unique_rows
from mistjax.cost.workload import Workload
from mistjax.hardware.presets import DeviceSpec

_CACHE = "kernel-times"  # key prefix in Workload.layout_cache
WEIGHT_GEMMS = "|weight-gemms"
"""Suffix of a pass key whose entry is the seconds of its weight GEMMs only (`weight_gemm_seconds`): kept for the
layer's plain passes, ``("block", "fwd[none]" + WEIGHT_GEMMS)`` and the backward's, which the collective-matmul
rings overlap (`mistjax.cost.tp_rings`)."""
WEIGHT_GEMM_KERNELS = "|weight-gemm-kernels"
"""Suffix of a pass key whose entry is how many weight GEMM kernels the pass runs (beside `WEIGHT_GEMMS`)."""

PassTimes: TypeAlias = dict[tuple[str, str], np.ndarray]
"""Seconds by ``(part, "fwd[policy]" | "bwd[policy]")``."""


def _device_key(dev: DeviceSpec, fp32: bool) -> tuple[float | bool, ...]:
    return (dev.peak_flops, dev.peak_flops_fp32, dev.peak_flops_fp8, dev.hbm_bandwidth, dev.matmul_efficiency,
            dev.memory_efficiency, dev.matmul_k_half, dev.matmul_tile, dev.kernel_overhead,
            dev.fused_attention_kernels, fp32)


def gemm_seconds(ka: KernelArrays, dev: DeviceSpec, fp32: bool) -> np.ndarray:
    """Seconds of a pass's GEMMs at each point (sum over its GEMMs)."""
    if ka.gemm_m.shape[-1] == 0:
        return np.zeros(ka.fusion_bytes.shape)
    peak: float | np.ndarray = dev.peak_flops_fp32 if fp32 else dev.peak_flops
    if dev.peak_flops_fp8 > 0:  # fp8 operands run on the fp8 tensor cores
        peak = np.where(ka.gemm_fp8 > 0, dev.peak_flops_fp8, peak)
    flops = 2.0 * ka.gemm_batch * ka.gemm_m * ka.gemm_n * ka.gemm_k
    each = np.where(flops > 0, gemm_kernel_seconds(flops, ka.gemm_m, ka.gemm_n, ka.gemm_k, ka.gemm_bytes, dev, peak),
                    0.0)
    return np.sum(each * ka.gemm_count, axis=-1)


def gemm_kernel_seconds(flops: ArrayLike, m: ArrayLike, n: ArrayLike, k: ArrayLike,
                        nbytes: ArrayLike, dev: DeviceSpec, peak: float | np.ndarray) -> np.ndarray:
    """Seconds of one GEMM kernel (``flops`` over a batch of ``m x k`` by ``k x n`` products moving ``nbytes``):
    the slower of the compute roofline at `DeviceSpec.gemm_efficiency` and the memory roofline, plus the
    kernel's fixed overhead. ``scripts/bench_kernels.py`` compares it with measured GEMMs."""
    compute = np.asarray(flops, dtype=np.float64) / (peak * dev.gemm_efficiency(m, n, k))
    return np.maximum(compute, streaming_seconds(nbytes, dev)) + dev.kernel_overhead


def streaming_seconds(nbytes: ArrayLike, dev: DeviceSpec) -> np.ndarray:
    """Seconds to stream ``nbytes`` through device memory at ``hbm_bandwidth * memory_efficiency`` (the memory
    roofline of every kernel; a memory-bound kernel adds ``kernel_overhead``)."""
    return np.asarray(nbytes, dtype=np.float64) / (dev.hbm_bandwidth * dev.memory_efficiency)


def weight_gemm_seconds(ka: KernelArrays, dev: DeviceSpec, fp32: bool) -> np.ndarray:
    """Seconds of a pass's GEMMs without batch dims: the weight matmuls (projections, MLP; attention's score and
    value products are batched over heads). A layer with one local head at batch 1 would count those too."""
    return gemm_seconds(_weight_gemms(ka), dev, fp32)


def _weight_gemms(ka: KernelArrays) -> KernelArrays:
    return replace(ka, gemm_count=np.where(ka.gemm_batch == 1, ka.gemm_count, 0.0))


def unit_seconds(ka: KernelArrays, dev: DeviceSpec, fp32: bool) -> np.ndarray:
    """Seconds of a pass's fused-attention calls, each one kernel."""
    peak = dev.peak_flops_fp32 if fp32 else dev.peak_flops
    skip = 0.5 if ka.causal else 1.0
    d = float(ka.head_dim or 128)
    # Half the matmul FLOPs are score products (k = d), half probability x value products (n = d).
    tile = dev.matmul_tile
    eff = 1.0 / (0.5 / float(dev.gemm_efficiency(tile, tile, d)) + 0.5 / float(dev.gemm_efficiency(tile, d, tile)))
    compute = skip * (ka.unit_matmul_flops / (peak * eff) + ka.unit_other_flops / dev.peak_flops_fp32)
    memory = streaming_seconds(ka.unit_bytes, dev)
    return np.where(ka.unit_count > 0, np.maximum(compute, memory) + ka.unit_count * dev.kernel_overhead, 0.0)


def pass_seconds(ka: KernelArrays, dev: DeviceSpec, fp32: bool) -> np.ndarray:
    """Seconds of one pass's kernels at each point."""
    fusions = streaming_seconds(ka.fusion_bytes, dev) + ka.fusion_count * dev.kernel_overhead
    return gemm_seconds(ka, dev, fp32) + fusions + unit_seconds(ka, dev, fp32)


def _tables(workload: Workload, dev: DeviceSpec, b: np.ndarray, s: float, t: np.ndarray, cp: np.ndarray
            ) -> PassTimes:
    """Seconds of every (part, pass) at the points ``(b, s / cp, t)`` (1-D arrays).

    Under context parallelism (``cp`` > 1) a device runs the model on ``s / cp`` tokens of each sequence, but
    its queries attend to the whole sequence: the ring's balanced causal split gives every device ``1 / cp`` of
    the attention work, ``cp`` times the attention of an ``s / cp`` sequence. So the fused-attention calls are
    charged ``cp`` times (docs/context-parallel.md)."""
    fp32 = workload.compute_dtype == "float32"
    kernels = workload.compiled.kernels
    assert kernels is not None  # `kernel_rows` prices from kernel tables only where the analysis has them
    arrays = kernels(b, s / cp, t)
    plain = not dev.fused_attention_kernels
    out = {}
    for (part, key), ka in arrays.items():
        if key.endswith("|plain"):
            continue
        chosen = arrays.get((part, f"{key}|plain"), ka) if plain else ka
        out[(part, key)] = pass_seconds(chosen, dev, fp32) + (cp - 1.0) * unit_seconds(ka, dev, fp32)
        if part == "block" and key in ("fwd[none]", "bwd[none]"):
            out[(part, key + WEIGHT_GEMMS)] = weight_gemm_seconds(chosen, dev, fp32)
            out[(part, key + WEIGHT_GEMM_KERNELS)] = np.sum(_weight_gemms(chosen).gemm_count, axis=-1)
    return out


def kernel_rows(workload: Workload, dev: DeviceSpec, b: ArrayLike, t: ArrayLike, cp: ArrayLike = 1.0
                ) -> tuple[PassTimes, np.ndarray]:
    """Seconds of every ``(part, "fwd[policy]" | "bwd[policy]")`` of one micro-batch at the distinct
    ``(b, t, cp)`` of the strategies: ``(name -> [rows] seconds, row index of every strategy (flat))``.

    Raises:
      ValueError: the workload's profile has no kernel tables (a profile built without `analyze_model`).
    """
    if workload.compiled.kernels is None:
        raise ValueError(f"the profile of {workload.name!r} has no kernel tables; rebuild the workload with "
                         "mistjax.analysis.analyze_model (Workload.from_loss / models.workload)")
    b, t, cp = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (b, t, cp)))
    s = float(workload.seq_len)
    cache = workload.layout_cache.setdefault((_CACHE, _device_key(dev, workload.compute_dtype == "float32"), s), {})
    rows, inv = unique_rows([b.ravel(), t.ravel(), cp.ravel()])
    keys = [tuple(float(x) for x in r) for r in rows]
    missing = [r for r in keys if r not in cache]
    if missing:
        mb, mt, mc = (np.array(c, dtype=np.float64) for c in zip(*missing))
        tables = _tables(workload, dev, mb, s, mt, mc)
        for i, key in enumerate(missing):
            cache[key] = {name: float(v[i]) for name, v in tables.items()}
    names = list(cache[keys[0]])
    return {n: np.array([cache[r][n] for r in keys]) for n in names}, inv


def kernel_times(workload: Workload, dev: DeviceSpec, b: ArrayLike, t: ArrayLike, cp: ArrayLike = 1.0
                 ) -> PassTimes:
    """`kernel_rows` broadcast to the strategies: ``(part, pass) -> seconds`` shaped like ``b``, ``t``, ``cp``."""
    shape = np.broadcast_shapes(np.shape(b), np.shape(t), np.shape(cp))
    table, inv = kernel_rows(workload, dev, b, t, cp)
    return {n: v[inv].reshape(shape) for n, v in table.items()}


__all__ = ["WEIGHT_GEMMS", "WEIGHT_GEMM_KERNELS", "PassTimes", "gemm_seconds", "kernel_rows", "kernel_times",
           "pass_seconds", "unit_seconds", "weight_gemm_seconds"]
