"""Seconds of a part's passes, priced kernel by kernel as the device runs them.

The analysis lists each pass's kernels (`mistjax.analysis.kernels`): GEMMs by shape, fusion kernels by the
bytes they move, fused-attention calls. Here each is priced on the device (docs/cost_model.md, "Kernels"):

* GEMM: ``max(flops / (peak * eff), bytes / (hbm * memory_efficiency)) + kernel_overhead`` with
  ``eff = matmul_efficiency * k / (k + matmul_k_half) * tile(m) * tile(n)``, ``tile(x) = x / ceil(x / T) / T``
  for the device's tile edge ``T``: small and skinny GEMMs run below peak.
* Fusion kernels: ``bytes / (hbm * memory_efficiency) + count * kernel_overhead``.
* Fused attention (``fused_attention_kernels``): one kernel per call, its matmul FLOPs at the GEMM efficiency
  of the head dim (half of them when the kernel is causal: cuDNN / FlashAttention skip masked tiles), its
  elementwise work at the fp32 peak, at least its bytes over the memory bandwidth; otherwise (XLA:CPU runs
  the blockwise kernel as ordinary operations) the pass's plain kernel table.

Evaluated once per distinct ``(b, t)`` of the strategies (the sequence length is the workload's) and cached
on the workload, so `stage_cost` stays vectorised.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mistjax.analysis.kernels import KernelArrays
from mistjax.cost.layout import unique_rows

_CACHE = "kernel-times"  # key prefix in Workload.layout_cache


def _device_key(dev: Any, fp32: bool) -> tuple[Any, ...]:
    return (dev.peak_flops, dev.peak_flops_fp32, dev.hbm_bandwidth, dev.matmul_efficiency, dev.memory_efficiency,
            dev.matmul_k_half, dev.matmul_tile, dev.kernel_overhead, dev.fused_attention_kernels, fp32)


def _tile(x: np.ndarray, edge: float) -> np.ndarray:
    """Fraction of a tiled dimension doing useful work (x padded to a multiple of the tile edge)."""
    x = np.maximum(x, 1.0)
    return x / (np.ceil(x / edge) * edge)


def gemm_efficiency(m: Any, n: Any, k: Any, dev: Any) -> np.ndarray:
    """Fraction of peak a GEMM of ``m x k`` by ``k x n`` reaches on ``dev`` (before the memory roofline)."""
    k = np.maximum(np.asarray(k, dtype=np.float64), 1.0)
    shape = k / (k + dev.matmul_k_half)
    return dev.matmul_efficiency * shape * _tile(np.asarray(m, np.float64), dev.matmul_tile) * \
        _tile(np.asarray(n, np.float64), dev.matmul_tile)


def gemm_seconds(ka: KernelArrays, dev: Any, fp32: bool) -> np.ndarray:
    """Seconds of a pass's GEMMs at each point (sum over its GEMMs)."""
    if ka.gemm_m.shape[-1] == 0:
        return np.zeros(ka.fusion_bytes.shape)
    peak = dev.peak_flops_fp32 if fp32 else dev.peak_flops
    flops = 2.0 * ka.gemm_batch * ka.gemm_m * ka.gemm_n * ka.gemm_k
    compute = flops / (peak * gemm_efficiency(ka.gemm_m, ka.gemm_n, ka.gemm_k, dev))
    memory = ka.gemm_bytes / (dev.hbm_bandwidth * dev.memory_efficiency)
    each = np.where(flops > 0, np.maximum(compute, memory) + dev.kernel_overhead, 0.0)
    return np.sum(each * ka.gemm_count, axis=-1)


def unit_seconds(ka: KernelArrays, dev: Any, fp32: bool) -> np.ndarray:
    """Seconds of a pass's fused-attention calls, each one kernel."""
    peak = dev.peak_flops_fp32 if fp32 else dev.peak_flops
    skip = 0.5 if ka.causal else 1.0
    d = float(ka.head_dim or 128)
    eff = dev.matmul_efficiency * d / (d + dev.matmul_k_half) * float(_tile(np.asarray(d), dev.matmul_tile))
    compute = skip * (ka.unit_matmul_flops / (peak * eff) + ka.unit_other_flops / dev.peak_flops_fp32)
    memory = ka.unit_bytes / (dev.hbm_bandwidth * dev.memory_efficiency)
    return np.where(ka.unit_count > 0, np.maximum(compute, memory) + ka.unit_count * dev.kernel_overhead, 0.0)


def pass_seconds(ka: KernelArrays, dev: Any, fp32: bool) -> np.ndarray:
    """Seconds of one pass's kernels at each point."""
    fusions = ka.fusion_bytes / (dev.hbm_bandwidth * dev.memory_efficiency) + ka.fusion_count * dev.kernel_overhead
    return gemm_seconds(ka, dev, fp32) + fusions + unit_seconds(ka, dev, fp32)


def _tables(workload: Any, dev: Any, b: np.ndarray, s: float, t: np.ndarray) -> dict[tuple[str, str], np.ndarray]:
    """Seconds of every (part, pass) at the points ``(b, s, t)`` (1-D arrays)."""
    fp32 = workload.compute_dtype == "float32"
    arrays = workload.compiled.kernels(b, np.full_like(b, s), t)
    plain = not dev.fused_attention_kernels
    out = {}
    for (part, key), ka in arrays.items():
        if key.endswith("|plain"):
            continue
        chosen = arrays.get((part, f"{key}|plain"), ka) if plain else ka
        out[(part, key)] = pass_seconds(chosen, dev, fp32)
    return out


def kernel_times(workload: Any, dev: Any, b: Any, t: Any) -> dict[tuple[str, str], np.ndarray]:
    """``(part, "fwd[policy]" | "bwd[policy]") -> seconds`` of one micro-batch, broadcast like ``b`` and ``t``.

    Raises:
      ValueError: the workload's profile has no kernel tables (a profile built without `analyze_model`).
    """
    if workload.compiled.kernels is None:
        raise ValueError(f"the profile of {workload.name!r} has no kernel tables; rebuild the workload with "
                         "mistjax.analysis.analyze_model (Workload.from_loss / models.workload)")
    b, t = np.broadcast_arrays(np.asarray(b, dtype=np.float64), np.asarray(t, dtype=np.float64))
    s = float(workload.seq_len)
    cache = workload.layout_cache.setdefault((_CACHE, _device_key(dev, workload.compute_dtype == "float32"), s), {})
    rows, inv = unique_rows([b.ravel(), t.ravel()])
    missing = [tuple(r) for r in rows if tuple(r) not in cache]
    if missing:
        mb, mt = (np.array(c, dtype=np.float64) for c in zip(*missing))
        tables = _tables(workload, dev, mb, s, mt)
        for i, key in enumerate(missing):
            cache[key] = {name: float(v[i]) for name, v in tables.items()}
    names = list(cache[tuple(rows[0])])
    stacked = np.array([[cache[tuple(r)][n] for n in names] for r in rows])  # [rows, names]
    return {n: stacked[inv, j].reshape(b.shape) for j, n in enumerate(names)}


__all__ = ["gemm_efficiency", "gemm_seconds", "kernel_times", "pass_seconds", "unit_seconds"]
