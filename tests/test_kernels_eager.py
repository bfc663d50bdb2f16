"""Eager kernels (``ModelConfig.elementwise="eager"``): one kernel per PyTorch op, priced by the bytes it moves.

Megatron-LM (core_r0.4.0, the Mist artifact's pin) runs RMSNorm, rotary and SwiGLU as separate PyTorch ops;
the analysis must price each op as a kernel reading its operands and writing its result, and each backward
op as a kernel writing the gradient it returns, where the fused pricing gives one kernel per chain.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from mistjax.analysis.graph import EAGER_JIT, build_graph
from mistjax.analysis.kernels import PassKernels, graph_kernels, kernel_values
from mistjax.analysis.poly import Poly
from mistjax.cost.kernels import kernel_rows
from mistjax.hardware import ClusterSpec
from models import layers

N, H = 64, 32  # tokens, hidden
BF16 = jnp.bfloat16


def _kernels(fn, *args) -> PassKernels:
    """The kernel table of ``fn``'s jaxpr at the concrete shapes of ``args``."""
    g = build_graph(jax.make_jaxpr(fn)(*args))
    size = lambda v: Poly.const(int(np.prod(v.aval.shape)) * jnp.dtype(v.aval.dtype).itemsize)  # noqa: E731
    dims = lambda n: ([g.shape(v) for v in n.ins], [g.shape(v) for v in n.outs])  # noqa: E731
    return graph_kernels(g, size, dims)


def _bytes(k: PassKernels) -> float:
    return float(k.fusion_bytes(1, 1))


def _count(k: PassKernels) -> float:
    return float(k.fusion_count(1, 1))


def test_the_models_marker_is_read_by_the_analysis_as_an_eager_write():
    # The protocol is the name of the jit the model wraps a written value in: the traced equation must carry
    # EAGER_JIT (a renamed or re-wrapped marker would not), and the graph must record the marked value.
    x = jnp.ones((N, H))
    jaxpr = jax.make_jaxpr(lambda x: layers.eager_written(jnp.sin(x)))(x)
    names = [e.params.get("name") for e in jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    assert names == [EAGER_JIT]
    g = build_graph(jaxpr)
    (sin,) = [n for n in g.nodes if n.prim == "sin"]
    assert g.eager == set(sin.outs)


def test_eager_rms_norm_is_one_kernel_per_op_of_megatrons_module():
    x, w = jnp.ones((N, H), BF16), jnp.ones((H,), BF16)
    eager = _kernels(partial(layers._rms_norm_eager, 1e-5, BF16), x, w)
    # Bytes per kernel (x: 2NH bytes in bf16, 4NH once cast; one fp32 value per token). jnp.mean is a sum and
    # a division of the N sums, a kernel of its own on one value per token (torch's mean is one kernel).
    cast, square, mean = 2 * N * H + 4 * N * H, 8 * N * H, 4 * N * H + 4 * N + 8 * N
    rsqrt, scale, cast_back, weight = 8 * N, 8 * N * H + 4 * N, 4 * N * H + 2 * N * H, 4 * N * H + 2 * H
    assert _bytes(eager) == cast + square + mean + rsqrt + scale + cast_back + weight
    assert _count(eager) == 8
    fused = _kernels(layers.recomputed(partial(layers._normalize, "rmsnorm", 1e-5, BF16)), x, w, None)
    assert (_bytes(fused), _count(fused)) == (4 * N * H + 4 * N + 2 * H, 1)  # reads x once, writes bf16


def test_eager_backward_writes_each_operand_gradient_in_its_own_kernel():
    a, b = jnp.ones((N, H)), jnp.ones((N, H))
    nbytes = 4 * N * H

    def bwd(op):
        return lambda a, b, g: jax.vjp(op, a, b)[1](g)

    eager = _kernels(bwd(lambda a, b: layers.eager_op(jnp.multiply, a, b)), a, b, a)
    # Autograd's mul backward: g * b and g * a, two kernels each reading g and one operand.
    assert (_bytes(eager), _count(eager)) == (6 * nbytes, 2)


def test_eager_kernels_reading_one_input_are_not_merged():
    x = jnp.ones((N, H))
    nbytes = 4 * N * H
    eager = _kernels(lambda x: (layers.eager_op(jnp.sin, x), layers.eager_op(jnp.cos, x)), x)
    fused = _kernels(lambda x: (jnp.sin(x), jnp.cos(x)), x)
    assert (_bytes(eager), _count(eager)) == (4 * nbytes, 2)  # two launches, each reading x
    assert (_bytes(fused), _count(fused)) == (3 * nbytes, 1)  # XLA's multi-output fusion reads x once


def test_eager_matches_the_fused_math():
    x, w = jax.random.normal(jax.random.key(0), (2, 8, 4, 16)), jax.random.normal(jax.random.key(1), (16,))
    np.testing.assert_allclose(layers.apply_rotary(x, 8, eager=True), layers.apply_rotary(x, 8), rtol=1e-5,
                               atol=1e-6)
    fused_norm = partial(layers._normalize, "rmsnorm", 1e-5, jnp.float32)
    np.testing.assert_allclose(layers._rms_norm_eager(1e-5, jnp.float32, x, w), fused_norm(x, w, None),
                               rtol=1e-5, atol=1e-6)
    def grads(swiglu):
        return jax.grad(lambda g, u: jnp.sum(swiglu(g, u) ** 2), argnums=(0, 1))(x, x + 1)

    for e, f in zip(grads(layers._swiglu_eager), grads(layers._swiglu)):
        np.testing.assert_allclose(e, f, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_workloads():
    """llama-tiny and gpt3-tiny in bf16, fused and eager (keyed by (name, elementwise))."""
    out = {}
    for name in ("llama-tiny", "gpt3-tiny"):
        cfg = models.get_config(name).replace(dtype="bfloat16", param_dtype="bfloat16")
        for mode in ("fused", "eager"):
            out[(name, mode)] = models.workload(cfg.replace(elementwise=mode), 128, 8, policies=("full",))
    return out


def test_megatron_llama_non_matmul_time_exceeds_the_fused_by_the_eager_bytes(tiny_workloads):
    dev = ClusterSpec.preset("l4", nodes=1, per_node=1).device
    fused, eager = tiny_workloads[("llama-tiny", "fused")], tiny_workloads[("llama-tiny", "eager")]
    t_fused, _ = kernel_rows(fused, dev, np.array([8.0]), np.array([1.0]))
    t_eager, _ = kernel_rows(eager, dev, np.array([8.0]), np.array([1.0]))
    for key in ("fwd[none]", "bwd[none]", "bwd[full]"):
        kf = kernel_values(fused.profile.block, key, 8, 128)
        ke = kernel_values(eager.profile.block, key, 8, 128)
        assert ke["gemm_flops"] == kf["gemm_flops"] and ke["gemm_bytes"] == kf["gemm_bytes"]  # same matmuls
        extra_bytes, extra_kernels = ke["fusion_bytes"] - kf["fusion_bytes"], ke["fusion_count"] - kf["fusion_count"]
        assert extra_bytes > kf["fusion_bytes"] and extra_kernels > 0  # the chains' ops, each a kernel
        extra = extra_bytes / (dev.hbm_bandwidth * dev.memory_efficiency) + extra_kernels * dev.kernel_overhead
        np.testing.assert_allclose(t_eager[("block", key)] - t_fused[("block", key)], extra, rtol=1e-9)


def test_gpt_layers_are_single_torch_ops_in_both_modes(tiny_workloads):
    # LayerNorm (apex's fused kernel in Megatron-LM) and GELU (F.gelu) are one op each: nothing changes.
    fused, eager = tiny_workloads[("gpt3-tiny", "fused")], tiny_workloads[("gpt3-tiny", "eager")]
    for key in ("fwd[none]", "bwd[none]", "bwd[full]"):
        assert kernel_values(fused.profile.block, key, 8, 128) == kernel_values(eager.profile.block, key, 8, 128)
