"""Measure the kernel curves the time model needs on the current device: GEMMs over (m, n, k), fused attention
by shape, memory-bound kernels by size; each row with the cost model's prediction for the same kernel.

Usage::

    python scripts/bench_kernels.py --preset h200 --json OUT/kernels.json [--deadline 150]
    python scripts/bench_kernels.py --smoke --json /tmp/kernels.json       (tiny shapes on the CPU, seconds)

Each kernel is jitted, run once to compile and warm up, then timed ``--repeats`` times (wall clock around
``block_until_ready``); the row keeps the median. GEMM rows give the achieved TFLOP/s, the fraction of the
preset's peak, and ``pred_s`` from `mistjax.cost.kernels.gemm_kernel_seconds` with the preset's constants;
memory-bound rows the achieved bandwidth and ``pred_s`` from `streaming_seconds` plus the kernel overhead;
attention rows the forward and forward + backward TFLOP/s (causal: half the score FLOPs). The shapes sweep
what the preset's constants describe: the large-GEMM efficiency, the short-contraction penalty
(``matmul_k_half``), tile padding, the streaming efficiency and the per-kernel overhead. `scripts/bench_gpu.sh`
runs it first on a lent GPU. Absolute times mean something only on a GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tyro  # noqa: E402

GEMM_NK = ((4096, 4096), (4096, 16384), (16384, 4096), (8192, 8192), (4096, 128), (128, 4096))
GEMM_M = (256, 1024, 4096, 16384)
GEMM_SHORT_K = (64, 128, 256, 512, 1024)  # at m = n = 8192: the short-contraction curve
ATTENTION = ((1, 2048, 32, 128), (1, 4096, 32, 128), (2, 8192, 32, 128), (1, 16384, 16, 128))  # b, s, heads, d
STREAM_ELEMENTS = tuple(2**e for e in range(16, 30, 2))


@dataclass(frozen=True)
class Args:
    """Flags of scripts/bench_kernels.py."""

    json_out: Annotated[str | None, tyro.conf.arg(name="json")] = None  # write the rows here
    preset: str = "h200"  # the hardware preset whose constants price each row (pred_s)
    smoke: bool = False  # tiny shapes in float32 (a CPU check of the script, not a measurement)
    repeats: int = 5  # timed runs per kernel after the warm-up
    deadline: float = 150.0  # seconds: no new kernel is started after this


def _timed(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
    """Median wall seconds of ``fn(*args)`` after one compile-and-warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gemm_shapes(smoke: bool) -> list[tuple[int, int, int]]:
    if smoke:
        return [(64, 64, 64), (128, 64, 32), (64, 128, 16)]
    shapes = [(m, n, k) for n, k in GEMM_NK for m in GEMM_M]
    return shapes + [(8192, 8192, k) for k in GEMM_SHORT_K]


def gemm_rows(args: Args, dev: Any, dtype: Any, stop: float) -> list[dict[str, Any]]:
    """One row per GEMM shape: measured seconds, TFLOP/s, fraction of peak, and the cost model's seconds."""
    import jax
    import jax.numpy as jnp

    from mistjax.cost.kernels import gemm_kernel_seconds

    rows = []
    for m, n, k in _gemm_shapes(args.smoke):
        if time.perf_counter() > stop:
            break
        a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
        s = _timed(jax.jit(jnp.matmul), a, b, repeats=args.repeats)
        flops, nbytes = 2.0 * m * n * k, float((m * k + k * n + m * n) * jnp.dtype(dtype).itemsize)
        pred = float(gemm_kernel_seconds(flops, m, n, k, nbytes, dev, dev.peak_flops))
        rows.append({"kind": "gemm", "m": m, "n": n, "k": k, "dtype": jnp.dtype(dtype).name, "seconds": s,
                     "tflops": flops / s / 1e12, "fraction_of_peak": flops / s / dev.peak_flops, "pred_s": pred})
    return rows


def stream_rows(args: Args, dev: Any, dtype: Any, stop: float) -> list[dict[str, Any]]:
    """One row per size of an elementwise add (two reads, one write): bandwidth and the cost model's seconds."""
    import jax
    import jax.numpy as jnp

    from mistjax.cost.kernels import streaming_seconds

    rows = []
    for size in STREAM_ELEMENTS[:3] if args.smoke else STREAM_ELEMENTS:
        if time.perf_counter() > stop:
            break
        x, y = jnp.ones((size,), dtype), jnp.ones((size,), dtype)
        s = _timed(jax.jit(jnp.add), x, y, repeats=args.repeats)
        nbytes = 3.0 * size * jnp.dtype(dtype).itemsize
        pred = float(streaming_seconds(nbytes, dev)) + dev.kernel_overhead
        rows.append({"kind": "stream", "elements": size, "dtype": jnp.dtype(dtype).name, "bytes": nbytes,
                     "seconds": s, "gb_per_s": nbytes / s / 1e9,
                     "fraction_of_bandwidth": nbytes / s / dev.hbm_bandwidth, "pred_s": pred})
    return rows


def attention_rows(args: Args, dev: Any, dtype: Any, stop: float) -> list[dict[str, Any]]:
    """One row per (batch, sequence, heads, head_dim): causal fused attention forward and forward + backward."""
    import jax
    import jax.numpy as jnp

    shapes = [(1, 64, 2, 16)] if args.smoke else ATTENTION
    rows = []
    for b, s, h, d in shapes:
        if time.perf_counter() > stop:
            break
        q = jnp.ones((b, s, h, d), dtype)
        fwd = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
        both = jax.jit(jax.grad(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
                                .astype(jnp.float32).sum(), argnums=(0, 1, 2)))
        flops = 0.5 * 4.0 * b * s * s * h * d  # causal: half of QK^T and PV
        t_fwd, t_both = _timed(fwd, q, q, q, repeats=args.repeats), _timed(both, q, q, q, repeats=args.repeats)
        rows.append({"kind": "attention", "batch": b, "seq": s, "heads": h, "head_dim": d,
                     "dtype": jnp.dtype(dtype).name, "fwd_s": t_fwd, "fwd_bwd_s": t_both,
                     "fwd_tflops": flops / t_fwd / 1e12, "fwd_bwd_tflops": 3.5 * flops / t_both / 1e12,
                     "fraction_of_peak_fwd": flops / t_fwd / dev.peak_flops})
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| kind | shape | measured s | pred s | pred/meas | rate |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["kind"] == "attention":
            lines.append(f"| attention | b{r['batch']} s{r['seq']} h{r['heads']} d{r['head_dim']} | "
                         f"{r['fwd_s']:.3g} / {r['fwd_bwd_s']:.3g} | - | - | {r['fwd_tflops']:.1f} TFLOP/s fwd |")
            continue
        shape = f"{r['m']}x{r['n']}x{r['k']}" if r["kind"] == "gemm" else f"{r['elements']} el"
        rate = f"{r['tflops']:.1f} TFLOP/s" if r["kind"] == "gemm" else f"{r['gb_per_s']:.0f} GB/s"
        lines.append(f"| {r['kind']} | {shape} | {r['seconds']:.3g} | {r['pred_s']:.3g} | "
                     f"{r['pred_s'] / r['seconds']:.2f} | {rate} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = tyro.cli(Args, args=argv, description=__doc__)
    import jax
    import jax.numpy as jnp

    from mistjax.hardware import ClusterSpec

    dev = ClusterSpec.preset(args.preset, nodes=1, per_node=1).device
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    stop = time.perf_counter() + args.deadline
    rows = gemm_rows(args, dev, dtype, stop) + stream_rows(args, dev, dtype, stop)
    rows += attention_rows(args, dev, dtype, stop)
    doc = {"device": str(jax.devices()[0].device_kind), "preset": args.preset, "smoke": args.smoke,
           "repeats": args.repeats, "rows": rows}
    print(_table(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json_out}")
    return doc


if __name__ == "__main__":
    main()
