"""`mistjax calibrate`: measure the present devices and write a cluster profile the tuner can load.

Measures, on the devices JAX sees: matmul throughput (and whether the devices share one pool of it), memory
bandwidth (fresh outputs and in place), the overhead of a kernel and of dispatching a program, collective
bandwidth and latency per group size (alpha-beta fit of all-gathers inside one program: a tiny buffer, two
sizes), host<->device copy bandwidth, and the slowdown of each channel when compute, collectives and host
copies run in one program at the same time (Mist's interference factors, one value per channel subset). The
result is a `ClusterSpec` JSON (the same format as the presets), so ``autoshard(..., hardware="profile.json")``
and ``mistjax plan --cluster profile.json`` use measured numbers.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from datetime import date

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from mistjax.core.hlo import ASYNC_COLLECTIVE_PLATFORMS
from mistjax.core.types import PyTree
from mistjax.hardware.interference import MASKS, InterferenceParams
from mistjax.hardware.presets import ClusterSpec, DeviceSpec, LinkModel


def _median_time(fn: Callable[[], PyTree], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one untimed (compiling) call: the median, as the
    benchmarks report a step's, so a lucky call on a shared host does not set the figure."""
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _spread(devices: list[jax.Device] | None) -> tuple[jax.sharding.Mesh, NamedSharding]:
    """A 1-D mesh over ``devices`` (default: the first device) and the sharding of its leading axis."""
    mesh = jax.sharding.Mesh(np.array(devices or jax.devices()[:1]), ("x",))
    return mesh, NamedSharding(mesh, P("x"))


def matmul_flops(n: int, dtype: DTypeLike, repeats: int = 3, devices: list[jax.Device] | None = None) -> float:
    """Dense matmul FLOP/s of one device while every device of ``devices`` runs its own ``n x n`` matmul.

    All devices compute at once, as in a training step: simulated CPU devices share the host's cores,
    so one device alone would get them all (GPUs are independent, and the answer is the same).
    """
    mesh, spec = _spread(devices)
    a = jax.device_put(jnp.ones((mesh.size * n, n), dtype), spec)
    f = jax.jit(jax.shard_map(lambda a: a @ a, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return 2 * n**3 / _median_time(lambda: f(a), repeats)


def memory_bandwidth(nbytes: int, repeats: int = 3, devices: list[jax.Device] | None = None, in_place: bool = False
                     ) -> float:
    """Streaming read+write bytes/s of one device while every device of ``devices`` streams its buffer.

    The least-squares slope of the median times at four sizes up to ``nbytes`` per device, so a program's fixed
    launch cost (large for several simulated CPU devices) does not count as bandwidth, and one noisy size
    (a shared host) moves the fit less than it moved a two-point slope. Each call writes a fresh output, as
    a program writes its temporaries (on XLA:CPU that pays the host's first-touch page faults); with
    ``in_place`` the input is donated and overwritten, as the optimizer update overwrites the donated state.
    """
    mesh, spec = _spread(devices)
    f = jax.jit(jax.shard_map(lambda x: x * 2.0 + 1.0, mesh=mesh, in_specs=P("x"), out_specs=P("x")),
                donate_argnums=0 if in_place else ())
    sizes = np.array([nbytes // 4, nbytes // 2, 3 * nbytes // 4, nbytes], dtype=np.float64)
    times = []
    for size in sizes.astype(int):
        x = jax.device_put(jnp.ones((mesh.size * size // 4,), jnp.float32), spec)
        timed = _median_donated_time(f, x, repeats) if in_place else _median_time(functools.partial(f, x), repeats)
        times.append(timed)
    slope = float(np.polyfit(2 * sizes, np.array(times), 1)[0])  # seconds per byte read + written
    if slope <= 0:  # the sizes are too small to rise above the launch noise: the largest one's rate, launch included
        return float(2 * sizes[-1] / times[-1])
    return 1.0 / slope


def _median_donated_time(f: Callable[[jax.Array], jax.Array], x: jax.Array, repeats: int) -> float:
    """Median seconds of ``x = f(x)`` (``f`` donates its argument), after one untimed call."""
    x = jax.block_until_ready(f(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def shares_compute(flops_all: float, n: int, dtype: DTypeLike, repeats: int = 3,
                   devices: list[jax.Device] | None = None) -> bool:
    """Whether the devices draw on one pool of compute: one device's matmul FLOP/s with half of ``devices``
    busy (``n x n`` each) is well above its FLOP/s with all of them busy (simulated XLA:CPU devices share the
    host's cores: about 2x; independent GPUs: about 1x).

    ``flops_all`` (all busy, measured before) is one of three ratios' denominators; the other two pairs are
    measured back to back, and the median ratio decides, so a burst of load from another process on a shared
    host (a parallel test worker) does not tip one side of a single comparison.
    """
    devices = devices or jax.devices()
    if len(devices) < 2:
        return False
    half = devices[: len(devices) // 2]
    ratios = [matmul_flops(n, dtype, repeats, half) / flops_all]
    for _ in range(2):
        ratios.append(matmul_flops(n, dtype, repeats, half) / matmul_flops(n, dtype, repeats, devices))
    return float(np.median(ratios)) > 1.5


def kernel_overhead(repeats: int = 3, devices: list[jax.Device] | None = None) -> float:
    """Seconds each kernel of a program costs beyond its work, every device of ``devices`` running at once:
    the slope between chains of 16 and 512 dependent 16 x 16 matmuls (about no work; XLA fuses no two)."""
    mesh, spec = _spread(devices)
    x = jax.device_put(jnp.ones((mesh.size * 16, 16), jnp.float32), spec)
    w = jnp.eye(16, dtype=jnp.float32) * 0.5

    def chain(k: int) -> Callable[[jax.Array, jax.Array], jax.Array]:
        def run(x: jax.Array, w: jax.Array) -> jax.Array:
            for _ in range(k):
                x = x @ w
            return x

        return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))

    # 496 kernels apart: a slope of ~1 us per kernel stands well above the timing noise of one call.
    short, long = (_median_time(functools.partial(f, x, w), repeats) for f in (chain(16), chain(512)))
    return max((long - short) / 496, 0.0)


def dispatch_seconds(calls: int = 200, devices: list[jax.Device] | None = None) -> float:
    """Host seconds per call of a one-element jitted program on two devices (``devices[:2]``): what issuing
    any program costs the host, whatever it computes (the MPMD pipeline issues many per step). The calls
    are issued back to back without waiting, so the figure is the host's, not the devices'."""
    mesh, spec = _spread((devices or jax.devices())[:2])
    x = jax.device_put(jnp.zeros((mesh.size,), jnp.float32), spec)
    add = jax.jit(lambda v: v + 1)
    jax.block_until_ready(add(x))
    t0 = time.perf_counter()
    ys = [add(x) for _ in range(calls)]
    seconds = (time.perf_counter() - t0) / calls
    jax.block_until_ready(ys)
    return seconds


# Small GEMMs (m, n, k) whose throughput fixes the kernel pricing's shape constants (`gemm_shape_constants`).
GEMM_SHAPES: tuple[tuple[int, int, int], ...] = ((64, 64, 64), (64, 64, 512), (512, 512, 64), (16, 256, 256),
                                                 (256, 16, 256), (256, 256, 16), (128, 128, 128))


def gemm_throughput(m: int, n: int, k: int, dtype: DTypeLike, repeats: int = 3, devices: list[jax.Device] | None = None,
                    flops: float = 2.0**27) -> float:
    """FLOP/s of one device running batched ``m x k`` by ``k x n`` GEMMs while every device of ``devices`` does.

    The slope between a batch of about ``flops / 4`` and ``flops`` FLOPs, so a program's launch cost drops out.
    """
    mesh, _ = _spread(devices)
    spec = NamedSharding(mesh, P("x"))
    f = jax.jit(jax.shard_map(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), mesh=mesh, in_specs=(P("x"), P("x")),
                              out_specs=P("x")))
    big = max(4, int(flops / (2 * m * n * k)))
    batches, times = (big // 4, big), []
    for batch in batches:
        a = jax.device_put(jnp.ones((mesh.size * batch, m, k), dtype), spec)
        b = jax.device_put(jnp.ones((mesh.size * batch, k, n), dtype), spec)
        times.append(_median_time(functools.partial(f, a, b), repeats))
    return 2 * m * n * k * (batches[1] - batches[0]) / max(times[1] - times[0], 1e-9)


def fit_gemm_shape(efficiency: dict[tuple[int, int, int], float]) -> tuple[float, float]:
    """``(matmul_tile, matmul_k_half)`` of `DeviceSpec.gemm_efficiency` closest (log least squares, grid over
    powers of two) to measured efficiencies of GEMM shapes (fractions of the large-matmul peak)."""
    shapes = np.array(list(efficiency), dtype=np.float64)
    target = np.log(np.clip(np.array(list(efficiency.values())), 1e-6, 1.0))
    m, n, k = shapes.T
    best, pick = float("inf"), (128.0, 32.0)
    for tile in 2.0 ** np.arange(0, 9):
        pad = m / (np.ceil(m / tile) * tile) * n / (np.ceil(n / tile) * tile)
        for k_half in np.concatenate([[0.0], 2.0 ** np.arange(0, 10)]):
            err = float(np.sum((np.log(k / (k + k_half) * pad) - target) ** 2))
            if err < best - 1e-12:
                best, pick = err, (float(tile), float(k_half))
    return pick


def gemm_shape_constants(peak: float, dtype: DTypeLike, repeats: int = 3, devices: list[jax.Device] | None = None,
                         log: Callable[[str], None] = print) -> tuple[float, float]:
    """Measure `GEMM_SHAPES` on all devices and fit ``(matmul_tile, matmul_k_half)`` to their efficiency."""
    eff = {shape: min(gemm_throughput(*shape, dtype, repeats, devices) / peak, 1.0) for shape in GEMM_SHAPES}
    tile, k_half = fit_gemm_shape(eff)
    shown = ", ".join(f"{a}x{b}x{c}: {e:.2f}" for (a, b, c), e in eff.items())
    log(f"small GEMMs (m x n x k: fraction of peak): {shown}; fit: tile {tile:g}, k_half {k_half:g}")
    return tile, k_half


def _all_gather_seconds(mesh: jax.sharding.Mesh, nbytes: int, trips: int, repeats: int) -> float:
    """Seconds per all-gather of an ``nbytes`` result over the mesh's ``"x"`` axis, from ``trips`` dependent
    all-gathers in one program, every group of the ``("r", "x")`` mesh gathering at once.

    Inside one program, as a train step issues them: no dispatch in the figure (the model charges
    `DeviceSpec.dispatch_seconds` per program separately).
    """
    g = mesh.shape["x"]
    local = max(nbytes // 4 // g, 1)

    def body(_: jax.Array, y: jax.Array) -> jax.Array:  # the next gather reads this one's result
        return jax.lax.all_gather(y, "x", tiled=True)[:local] * 1.0

    spec = P(("r", "x"))
    x = jax.device_put(jnp.ones((local * mesh.size,), jnp.float32), NamedSharding(mesh, spec))
    f = jax.jit(jax.shard_map(lambda y: jax.lax.fori_loop(0, trips, body, y), mesh=mesh, in_specs=spec,
                              out_specs=spec, check_vma=False))
    return _median_time(lambda: f(x), repeats) / trips


def collective_link(devices: list[jax.Device], group: int, sizes: tuple[int, int], repeats: int = 3) -> LinkModel:
    """Alpha-beta fit of a ring all-gather over groups of ``group`` consecutive ``devices``, every group
    gathering at once as in a train step (on simulated CPU devices a group's rendezvous waits for threads
    that share the cores with the other groups': 2.4x the latency of one group alone for pairs, measured):
    the latency from a tiny buffer, the bandwidth from two buffer sizes (bytes of the result), every time
    per collective inside one program."""
    g = group
    mesh = jax.sharding.Mesh(np.array(devices[: len(devices) // g * g]).reshape(-1, g), ("r", "x"))
    tiny = _all_gather_seconds(mesh, 4 * g, 32, repeats)
    (s0, s1) = sizes
    t0, t1 = (_all_gather_seconds(mesh, n, 4, repeats) for n in sizes)
    # t = (g-1) * alpha + (g-1)/g * bytes / bw: alpha where the bytes are nothing, bw from the two sizes.
    # (t1 <= t0: the sizes too close for the noise; the larger one's rate, latency included, bounds it)
    per_byte = (t1 - t0) / ((g - 1) / g * (s1 - s0)) if t1 > t0 else t1 / ((g - 1) / g * s1)
    alpha = max(tiny / (g - 1), 0.0)
    return LinkModel(bandwidth=1.0 / per_byte, latency=alpha)


def host_links(nbytes: int, repeats: int = 3) -> tuple[LinkModel, LinkModel]:
    """Host->device and device->host copy bandwidth on the first device (pinned host memory)."""
    dev = jax.devices()[0]
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), dev)
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device = jax.sharding.SingleDeviceSharding(dev)
    xh = jax.device_put(x, host)
    d2h = nbytes / _median_time(lambda: jax.device_put(x, host), repeats)
    h2d = nbytes / _median_time(lambda: jax.device_put(xh, device), repeats)
    return LinkModel(h2d, 10e-6), LinkModel(d2h, 10e-6)


def interference_factors(devices: list[jax.Device], nbytes: int, repeats: int = 3) -> InterferenceParams:
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
    alone = {k: _median_time(functools.partial(f, a, v, vh), repeats) for k, f in jitted.items()}
    factors = []
    for mask in MASKS:
        def joint_fn(a: jax.Array, v: jax.Array, vh: jax.Array, mask: tuple[int, ...] = mask) -> tuple[jax.Array, ...]:
            return tuple(ops[k](a, v, vh) for k in mask)

        joint = jax.jit(joint_fn)
        t = _median_time(functools.partial(joint, a, v, vh), repeats)
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
    mm = 1024 if quick else (4096 if n_dev == 1 else 2048)  # per device; all devices compute at once
    flops = matmul_flops(mm, dtype, reps, devices)
    flops32 = flops if dtype == jnp.float32 else matmul_flops(mm, jnp.float32, reps, devices)
    hbm = memory_bandwidth(big, reps, devices)
    hbm_in_place = memory_bandwidth(big, reps, devices, in_place=True)
    shared = shares_compute(flops, mm, dtype, reps, devices)
    log(f"per device, all {n_dev} at once: matmul {flops / 1e12:.3f} TFLOP/s ({jnp.dtype(dtype).name}), "
        f"memory {hbm / 1e9:.1f} GB/s ({hbm_in_place / 1e9:.1f} GB/s in place); "
        f"{'one pool of compute' if shared else 'independent compute'}")
    tile, k_half = gemm_shape_constants(flops, dtype, reps, devices, log)
    per_kernel, dispatch = kernel_overhead(reps, devices), dispatch_seconds(50 if quick else 200, devices)
    log(f"per kernel {per_kernel * 1e6:.1f} us (all devices at once), dispatch {dispatch * 1e6:.0f} us per program")
    h2d, d2h = host_links(big, reps)
    log(f"host->device {h2d.bandwidth / 1e9:.2f} GB/s, device->host {d2h.bandwidth / 1e9:.2f} GB/s")
    intra = {}
    for g in (2, 4, 8):
        if g <= n_dev:
            intra[g] = collective_link(devices, g, (big // 64, big), reps)
            log(f"all-gather over {g} (all {n_dev // g} groups at once): {intra[g].bandwidth / 1e9:.2f} GB/s, "
                f"latency {intra[g].latency * 1e6:.1f} us")
    if not intra:
        intra = {1: LinkModel(hbm, 1e-6)}
    inter = interference_factors(devices[: min(n_dev, 8)], big // 4, reps) if n_dev > 1 else InterferenceParams.serial()
    stats = devices[0].memory_stats() or {}
    hbm_bytes = float(stats.get("bytes_limit", 16 * 2**30))
    device = DeviceSpec(name=f"{platform}: {devices[0].device_kind}", peak_flops=flops, peak_flops_fp32=flops32,
                        hbm_bytes=hbm_bytes, hbm_bandwidth=hbm, in_place_bandwidth=hbm_in_place,
                        host_to_device=h2d, device_to_host=d2h,
                        matmul_efficiency=1.0, memory_efficiency=1.0, kernel_overhead=per_kernel,
                        dispatch_seconds=dispatch,
                        # the zoo's fused attention is cuDNN on GPUs only, the blockwise kernel elsewhere
                        fused_attention_kernels=platform == "gpu", matmul_tile=tile, matmul_k_half=k_half,
                        # XLA:CPU has no all-gather / reduce-scatter combiner: one collective per leaf
                        combines_collectives=platform != "cpu",
                        # XLA:CPU runs collectives inline; GPUs / TPUs overlap them (and the runtime defers the sync)
                        async_collectives=platform in ASYNC_COLLECTIVE_PLATFORMS, shared_compute=shared,
                        source=f"measured by mistjax calibrate on {date.today().isoformat()}")
    p2p = intra[min(intra)]
    return ClusterSpec(name=name, device=device, nodes=1, devices_per_node=n_dev, intra_node=intra,
                       inter_node={(2, k): link for k, link in itertools.islice(intra.items(), 4)},
                       p2p_intra=p2p, p2p_inter=p2p, interference=inter,
                       source=f"mistjax calibrate, {n_dev} x {platform}, {date.today().isoformat()}")
