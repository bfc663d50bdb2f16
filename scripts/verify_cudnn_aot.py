"""Compile fused attention for a GPU you do not have (deviceless XLA:GPU AOT) and report its memory.

Run: JAX_PLATFORMS=cpu python scripts/verify_cudnn_aot.py --target-config h100_sxm.txtpb [--seq-len 2048]

Needs the CUDA plugin (``jax-cuda12-plugin`` / ``jax-cuda12-pjrt`` pinned to the jax version, plus
``nvidia-cuda-nvcc-cu12``) and a ``GpuTargetConfigProto`` in text format (XLA ships them under
``xla/backends/gpu/target_config/specs/``). Compiles value-and-VJP of one attention core (bf16, GPT-3 7B
heads by default) with cuDNN, the blockwise kernel and XLA's unfused attention, and prints XLA:GPU's
``memory_analysis()`` and the cuDNN custom calls found in the optimised HLO.

TEST-ONLY: cuDNN's version probe cannot run without a GPU, so this script replaces it
(``check_cudnn_version``, a private jax function) in its own process. The product never does that.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin cannot initialise without a GPU otherwise
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from models.attention import blockwise_attention, cudnn_attention  # noqa: E402
from models.layers import xla_attention  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-config", required=True, help="GpuTargetConfigProto text file of the target GPU")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    a = p.parse_args()
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_impl

    cudnn_impl.check_cudnn_version = lambda: 91000  # test-only (module docstring)
    topo = topologies.get_topology_desc(platform="cuda", target_config=Path(a.target_config).read_text(),
                                        topology="1x1x1")
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    print(f"target: {mesh.devices.flat[0].device_kind}; q [1, {a.seq_len}, {a.heads}, {a.head_dim}] bf16")
    rep = NamedSharding(mesh, P())
    q = jax.ShapeDtypeStruct((1, a.seq_len, a.heads, a.head_dim), jnp.bfloat16, sharding=rep)
    k = jax.ShapeDtypeStruct((1, a.seq_len, a.kv_heads, a.head_dim), jnp.bfloat16, sharding=rep)
    kernels = {"cudnn": cudnn_attention, "blockwise": blockwise_attention, "xla": xla_attention}
    print(f"{'kernel':<10}{'temp MB':>10}{'args MB':>10}  custom calls")
    for name, fn in kernels.items():
        def step(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, fn=fn) -> tuple:
            o, vjp = jax.vjp(fn, q, k, v)
            return o, vjp(do)

        compiled = jax.jit(step).lower(q, k, k, q).compile()
        ma = compiled.memory_analysis()
        calls = sorted(set(re.findall(r'custom_call_target="(__cudnn[^"]+)"', compiled.as_text())))
        print(f"{name:<10}{ma.temp_size_in_bytes / 1e6:10.1f}{ma.argument_size_in_bytes / 1e6:10.1f}  {calls}")


if __name__ == "__main__":
    main()
