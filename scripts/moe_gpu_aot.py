"""Compile one MoE layer's forward + backward deviceless for XLA:GPU (issue #51, item 2): the dropless ``ragged_dot``
path against the padded capacity path, and expert parallelism over 8 GPUs; prints what XLA:GPU makes of each.

Usage (no GPU needed; the JAX CUDA plugin and nvcc packages must be installed)::

    JAX_PLATFORMS=cpu python scripts/moe_gpu_aot.py [--gpu h100] [--tokens 4096] [--json docs/results/moe_gpu_aot.json]

For each path it reports XLA's cost-analysis FLOPs (against the routed FLOPs ``6 * tokens * k * h * f`` forward),
the temporary bytes, and how the grouped GEMM was lowered (a ``ragged-dot`` left for a library or custom kernel,
or expanded into dense dots). Numbers are the compiler's, not measured run times.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core.moe import ExpertWeights, RouterSpec, apply_experts, experts_dispatch, route
from mistjax.runtime.experts import expert_parallel
from mistjax.validate.gpu_aot import xla_cost_analysis
from mistjax.validate.gpu_aot_target import compile_only_devices, load_target

MIXTRAL = {"hidden": 4096, "ffn": 14336, "experts": 8, "top_k": 2}


def _layer(spec: RouterSpec):
    def loss(x, router, w):
        routing = route(jnp.einsum("bsh,he->bse", x.astype(jnp.float32), router), spec)
        return jnp.sum(apply_experts(x, routing, ExpertWeights(*w), spec).astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2))


def _shapes(batch: int, seq: int, h: int, f: int, e: int):
    bf16 = jnp.bfloat16
    return (jax.ShapeDtypeStruct((batch, seq, h), bf16), jax.ShapeDtypeStruct((h, e), jnp.float32),
            (jax.ShapeDtypeStruct((e, h, f), bf16), jax.ShapeDtypeStruct((e, h, f), bf16),
             jax.ShapeDtypeStruct((e, f, h), bf16)))


def _summary(compiled: jax.stages.Compiled, routed_flops: float) -> dict[str, object]:
    text = compiled.as_text()
    cost = xla_cost_analysis(compiled) or {}  # compile-only executables have no cost_analysis()
    memory = compiled.memory_analysis()
    return {"xla_flops": float(cost.get("flops", 0.0)), "routed_flops_fwd_bwd": routed_flops,
            "flops_ratio": float(cost.get("flops", 0.0)) / routed_flops,
            "temp_gib": memory.temp_size_in_bytes / 2**30 if memory else None,
            "ragged_dot_ops": len(re.findall(r"ragged-dot|ragged_dot", text)),
            "dots": len(re.findall(r"= \S+ dot\(", text)),
            "cublas_calls": len(re.findall(r"custom_call_target=\"__cublas", text)),
            "all_to_all": len(re.findall(r" all-to-all(?:-start)?\(", text))}


def single_gpu(gpu: str, tokens: int) -> dict[str, object]:
    """The dropless and the capacity path on one GPU (batch 1 x ``tokens``)."""
    device = compile_only_devices(load_target(gpu), 1, 1)[0]
    h, f, e, k = MIXTRAL["hidden"], MIXTRAL["ffn"], MIXTRAL["experts"], MIXTRAL["top_k"]
    routed = 3 * 6 * tokens * k * h * f  # forward 3 GEMMs of 2*t*k*h*f FLOPs; backward twice that
    out = {}
    for name, factor in (("dropless ragged_dot", None), ("capacity 1.0 (padded)", 1.0),
                         ("capacity 1.25 (padded)", 1.25)):
        spec = RouterSpec(e, k, capacity_factor=factor)
        sharding = jax.sharding.SingleDeviceSharding(device)
        args = _shapes(1, tokens, h, f, e)
        compiled = jax.jit(_layer(spec), in_shardings=(sharding, sharding, (sharding,) * 3)).lower(*args).compile()
        out[name] = _summary(compiled, routed)
    return out


def expert_parallel_8(gpu: str, tokens: int) -> dict[str, object]:
    """EP 8 on one 8-GPU node, capacity 1.0: ``tokens`` per GPU."""
    devices = compile_only_devices(load_target(gpu), 1, 8)
    mesh = Mesh(np.array(devices, dtype=object).reshape(1, 8), ("data", "expert"),
                axis_types=(AxisType.Auto, AxisType.Auto))
    h, f, e, k = MIXTRAL["hidden"], MIXTRAL["ffn"], MIXTRAL["experts"], MIXTRAL["top_k"]
    spec = RouterSpec(e, k, capacity_factor=1.0)
    tokens_sh = NamedSharding(mesh, P(("data", "expert")))
    expert_sh = NamedSharding(mesh, P("expert"))

    def grad(x, router, w):
        with experts_dispatch(expert_parallel(mesh)):
            return _layer(spec)(x, router, w)

    compiled = jax.jit(grad, in_shardings=(tokens_sh, NamedSharding(mesh, P()), (expert_sh,) * 3)).lower(
        *_shapes(8, tokens, h, f, e)).compile()
    return _summary(compiled, 3 * 6 * tokens * k * h * f)


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = {"gpu": args.gpu, "jax": jax.__version__, "tokens": args.tokens, "layer": MIXTRAL,
              "single_gpu": single_gpu(args.gpu, args.tokens), "ep8": expert_parallel_8(args.gpu, args.tokens)}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
