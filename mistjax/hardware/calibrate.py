"""`mistjax calibrate`: measure the present devices and write a cluster profile the tuner can load.

Measures, on the devices JAX sees: matmul throughput, memory bandwidth, collective bandwidth and
latency per group size (alpha-beta fit of an all-gather over two sizes), host<->device copy
bandwidth, and the slowdown of each channel when compute, collectives and host copies run in one
program at the same time (Mist's interference factors, one value per channel subset). The result is
a `ClusterSpec` JSON (the same format as the presets), so ``autoshard(..., hardware="profile.json")``
and ``mistjax plan --cluster profile.json`` use measured numbers.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from datetime import date
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.hardware.interference import MASKS, InterferenceParams
from mistjax.hardware.presets import ClusterSpec, DeviceSpec, LinkModel


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())  # compile + warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(n: int, dtype: Any, repeats: int = 3) -> float:
    """Dense matmul FLOP/s on one device."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / _best_time(lambda: f(a), repeats)


def memory_bandwidth(nbytes: int, repeats: int = 3) -> float:
    """Streaming read+write bytes/s on one device."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 2.0 + 1.0)
    return 2 * nbytes / _best_time(lambda: f(x), repeats)


def collective_link(devices: list[Any], sizes: tuple[int, int], repeats: int = 3) -> LinkModel:
    """Alpha-beta fit of a ring all-gather over `devices` (two buffer sizes, bytes of the result)."""
    g = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    times = []
    for nbytes in sizes:
        x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), NamedSharding(mesh, P("x")))
        f = jax.jit(jax.shard_map(partial(jax.lax.all_gather, axis_name="x", tiled=True), mesh=mesh,
                                  in_specs=P("x"), out_specs=P(), check_vma=False))
        times.append(_best_time(lambda f=f, x=x: f(x), repeats))
    # t = (g-1) * alpha + (g-1)/g * bytes / bw, solved from the two sizes.
    (s0, s1), (t0, t1) = sizes, times
    per_byte = max((t1 - t0) / ((g - 1) / g * (s1 - s0)), 1e-15)
    alpha = max((t0 - (g - 1) / g * s0 * per_byte) / (g - 1), 0.0)
    return LinkModel(bandwidth=1.0 / per_byte, latency=alpha)


def host_links(nbytes: int, repeats: int = 3) -> tuple[LinkModel, LinkModel]:
    """Host->device and device->host copy bandwidth on the first device (pinned host memory)."""
    dev = jax.devices()[0]
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), dev)
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device = jax.sharding.SingleDeviceSharding(dev)
    xh = jax.device_put(x, host)
    d2h = nbytes / _best_time(lambda: jax.device_put(x, host), repeats)
    h2d = nbytes / _best_time(lambda: jax.device_put(xh, device), repeats)
    return LinkModel(h2d, 10e-6), LinkModel(d2h, 10e-6)


def interference_factors(devices: list[Any], nbytes: int, repeats: int = 3) -> InterferenceParams:
    """Slowdown of each channel when the channels of a subset run in one program concurrently.

    Each channel (compute, device<->device, host->device, device->host) gets a workload; a subset's
    joint time over the slowest standalone time of its members gives one factor for all of them (a
    coarse fit: Mist fits one factor per channel and subset).
    """
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    n = 512
    a = jax.device_put(jnp.ones((len(devices) * n, n), jnp.float32), NamedSharding(mesh, P("x")))
    v = jax.device_put(jnp.ones((len(devices) * nbytes // 4,), jnp.float32), NamedSharding(mesh, P("x")))
    vh = jax.device_put(v, NamedSharding(mesh, P("x"), memory_kind="pinned_host"))
    ops = {
        0: lambda a, v, vh: jnp.sum(a @ a.T[:, :n]),
        1: lambda a, v, vh: jnp.sum(jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P()))),
        2: lambda a, v, vh: jnp.sum(jax.device_put(vh, jax.memory.Space.Device)),
        3: lambda a, v, vh: jax.device_put(v * 1.0, jax.memory.Space.Host),  # returned, so the copy runs
    }
    jitted = {k: jax.jit(op) for k, op in ops.items()}
    alone = {k: _best_time(lambda f=f: f(a, v, vh), repeats) for k, f in jitted.items()}
    factors = []
    for mask in MASKS:
        joint = jax.jit(lambda a, v, vh, mask=mask: tuple(ops[k](a, v, vh) for k in mask))
        t = _best_time(lambda j=joint: j(a, v, vh), repeats)
        slow = max(1.0, min(float(len(mask)), t / max(alone[k] for k in mask)))
        factors.extend([slow] * len(mask))
    return InterferenceParams(tuple(factors))


def calibrate(*, name: str = "calibrated", quick: bool = False, log: Callable[[str], None] = print) -> ClusterSpec:
    """Measure this process's devices and return them as a one-node `ClusterSpec`."""
    devices = jax.devices()
    n_dev, platform = len(devices), devices[0].platform
    big = 1 << (20 if quick else 24)
    reps = 2 if quick else 5
    dtype = jnp.bfloat16 if platform in ("gpu", "tpu") else jnp.float32
    mm = 1024 if quick else 4096
    flops = matmul_flops(mm, dtype, reps)
    flops32 = flops if dtype == jnp.float32 else matmul_flops(mm, jnp.float32, reps)
    hbm = memory_bandwidth(big, reps)
    log(f"matmul {flops / 1e12:.3f} TFLOP/s ({jnp.dtype(dtype).name}), memory {hbm / 1e9:.1f} GB/s")
    h2d, d2h = host_links(big, reps)
    log(f"host->device {h2d.bandwidth / 1e9:.2f} GB/s, device->host {d2h.bandwidth / 1e9:.2f} GB/s")
    intra = {}
    for g in (2, 4, 8):
        if g <= n_dev:
            intra[g] = collective_link(devices[:g], (big // 64, big), reps)
            log(f"all-gather over {g}: {intra[g].bandwidth / 1e9:.2f} GB/s, latency {intra[g].latency * 1e6:.1f} us")
    if not intra:
        intra = {1: LinkModel(hbm, 1e-6)}
    inter = interference_factors(devices[: min(n_dev, 8)], big // 4, reps) if n_dev > 1 else InterferenceParams.serial()
    stats = devices[0].memory_stats() or {}
    hbm_bytes = float(stats.get("bytes_limit", 16 * 2**30))
    device = DeviceSpec(name=f"{platform}: {devices[0].device_kind}", peak_flops=flops, peak_flops_fp32=flops32,
                        hbm_bytes=hbm_bytes, hbm_bandwidth=hbm, host_to_device=h2d, device_to_host=d2h,
                        matmul_efficiency=1.0, memory_efficiency=1.0,
                        source=f"measured by mistjax calibrate on {date.today().isoformat()}")
    p2p = intra[min(intra)]
    return ClusterSpec(name=name, device=device, nodes=1, devices_per_node=n_dev, intra_node=intra,
                       inter_node={(2, k): link for k, link in itertools.islice(intra.items(), 4)},
                       p2p_intra=p2p, p2p_inter=p2p, interference=inter,
                       source=f"mistjax calibrate, {n_dev} x {platform}, {date.today().isoformat()}")
