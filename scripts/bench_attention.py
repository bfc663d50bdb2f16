"""Fused vs unfused attention: compiled memory on XLA:CPU and what the analysis charges per layer.

Run: python scripts/bench_attention.py [--json FILE] [--model gpt3-7b] [--seq-len 2048] [--time]

1. XLA:CPU ``memory_analysis()`` temp of ``value_and_grad`` through ONE attention layer of llama-tiny
   (fp32, micro-batch 1) at two sequence lengths, per attention kernel: the blockwise kernel grows
   linearly in s, the unfused ones quadratically.
2. The symbolic block profile (`mistjax.analysis`) of ``--model`` in bf16 (traced abstractly; nothing is
   allocated): saved residual bytes per layer (no remat), and the backward's transient peak, at
   micro-batch 1 and ``--seq-len``, unfused (``xla``) vs fused (``blockwise``; a cuDNN model is priced
   the same), plus the block's FLOPs.
3. ``--time``: wall time of value-and-VJP of one attention core on this CPU ([1, s, 8 heads, 4 kv heads,
   64] fp32), the blockwise kernel at a few block sizes against XLA's unfused attention (best of 3).
4. ``--context`` (only this): the context-parallel kernels side by side, ring against Ulysses, on two host
   devices (`XLA_FLAGS=--xla_force_host_platform_device_count=2`; s 4096, block 256).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import models  # noqa: E402
from mistjax.analysis import analyze_model, compile_profile  # noqa: E402
from mistjax.runtime.context_attention import context_attention  # noqa: E402
from models import make_loss_fn  # noqa: E402
from models.attention import blockwise_attention  # noqa: E402
from models.layers import Attention, xla_attention  # noqa: E402

KERNELS = ("blockwise", "xla", "reference")


def layer_temp(attention: str, s: int) -> int:
    """XLA:CPU temp bytes of value_and_grad through one llama-tiny attention layer at [1, s]."""
    cfg = models.get_config("llama-tiny").replace(attention=attention, max_seq_len=s)
    gd, params = nnx.split(Attention(cfg, rngs=nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((1, s, cfg.hidden_size), jnp.float32)

    def loss(p: nnx.State, x: jax.Array) -> jax.Array:
        return jnp.sum(nnx.merge(gd, p)(x) ** 2)

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def block_costs(name: str, attention: str, s: int) -> dict[str, float]:
    """Per-layer saved bytes, backward peak and FLOPs of ``name`` in bf16 at b = 1, sequence ``s``, t = 1."""
    cfg = models.get_config(name).replace(attention=attention, dtype="bfloat16")
    gd, state = nnx.split(nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0))))
    prof = analyze_model(make_loss_fn(gd), state, policies=("none",))
    v = compile_profile(prof)(1, s, 1)
    keys = ("saved_bytes[none]", "bwd_peak_bytes[none]", "fwd_peak_bytes[none]", "fwd_flops", "bwd_flops",
            "fwd_matmul_flops", "bwd_matmul_flops", "fused_flops", "fused_bytes")
    return {k: float(v[f"block.{k}"]) for k in keys}


def core_time(fn: object, s: int, sharding: NamedSharding | None = None) -> float:
    """Best-of-3 seconds of a jitted value-and-VJP of ``fn`` on [1, s, 8, 64] queries, 4 kv heads (fp32), the
    inputs placed with ``sharding`` when given."""
    ks = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(k, (1, s, 8, 64)) for k in ks[:2])
    k, v = (jax.random.normal(key, (1, s, 4, 64)) for key in ks[2:])
    if sharding is not None:
        q, k, v, do = (jax.device_put(x, sharding) for x in (q, k, v, do))

    def step(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array) -> tuple:
        o, vjp = jax.vjp(fn, q, k, v)
        return o, vjp(do)

    f = jax.jit(step)
    jax.block_until_ready(f(q, k, v, do))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(f(q, k, v, do))
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt3-7b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lengths", default="256,1024", help="two sequence lengths for the compiled layer")
    p.add_argument("--time", action="store_true", help="also time the attention core on this CPU")
    p.add_argument("--context", action="store_true",
                   help="only time the context-parallel kernels (ring vs Ulysses, cp 2, s 4096, block 256) on two "
                        "host devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=2")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.context:
        context_times(a.json)
        return
    lengths = [int(x) for x in a.lengths.split(",")]

    print("XLA:CPU temp of value_and_grad through one llama-tiny attention layer (fp32, b=1), MB")
    print(f"{'kernel':<10}" + "".join(f"{'s=' + str(s):>12}" for s in lengths) + f"{'ratio':>8}")
    temps = {}
    for k in KERNELS:
        temps[k] = [layer_temp(k, s) for s in lengths]
        row = "".join(f"{t / 1e6:12.2f}" for t in temps[k])
        print(f"{k:<10}{row}{temps[k][-1] / temps[k][0]:8.2f}")

    print(f"\nanalysis, {a.model} (bf16) per layer at b=1, s={a.seq_len}, t=1")
    blocks = {k: block_costs(a.model, k, a.seq_len) for k in ("xla", "blockwise")}
    print(f"{'quantity':<24}{'unfused (xla)':>16}{'fused':>16}")
    for key in blocks["xla"]:
        scale, unit = (1e6, "MB") if "bytes" in key else (1e12, "TFLOP")
        print(f"{key + ' ' + unit:<24}{blocks['xla'][key] / scale:16.3f}{blocks['blockwise'][key] / scale:16.3f}")
    times: dict[str, list[float]] = {}
    if a.time:
        kernels = {"xla": xla_attention, **{f"blockwise B={bs}": (lambda q, k, v, bs=bs: blockwise_attention(
            q, k, v, block_size=bs)) for bs in (8, 32, 128, 512)}}
        print(f"\nvalue-and-VJP of one attention core on this CPU, ms (best of 3)\n{'kernel':<18}"
              + "".join(f"{'s=' + str(s):>10}" for s in (1024, 2048)))
        for name, fn in kernels.items():
            times[name] = [core_time(fn, s) for s in (1024, 2048)]
            print(f"{name:<18}" + "".join(f"{t * 1e3:10.0f}" for t in times[name]))
    if a.json:
        out = {"layer_temp_bytes": {"lengths": lengths, **temps},
               "block": {"model": a.model, "seq_len": a.seq_len, "b": 1, **blocks}, "core_seconds": times}
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")


def context_times(json_path: str | None) -> None:
    """Value-and-VJP seconds of the context-parallel kernels side by side (`runtime.context_attention`)."""
    if len(jax.devices()) < 2:
        raise SystemExit("--context needs two devices: XLA_FLAGS=--xla_force_host_platform_device_count=2")
    mesh = Mesh(np.array(jax.devices()[:2]), ("context",), axis_types=(AxisType.Auto,))
    times = {}
    with jax.set_mesh(mesh):
        for form in ("ring", "ulysses"):
            fn = functools.partial(context_attention, form=form, block_size=256)
            times[form] = core_time(fn, 4096, NamedSharding(mesh, P(None, "context")))
    print("value-and-VJP of one attention core split over 2 host devices (s 4096, 8 / 4 heads of 64), s "
          f"(best of 3): ring {times['ring']:.3f}, ulysses {times['ulysses']:.3f}, "
          f"ulysses / ring {times['ulysses'] / times['ring']:.3f}")
    if json_path:
        Path(json_path).write_text(json.dumps({"context_seconds": times}, indent=1))
        print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
