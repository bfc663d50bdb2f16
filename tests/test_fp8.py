"""FP8 projections (`mistjax.core.fp8`, `models.ModelConfig.fp8`): the numerics against an explicit quantized
reference, training under plans against one device, and what the analysis and the cost model make of them."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mistjax
import models
from mistjax.core.fp8 import E4M3, E5M2, fp8_einsum, fp8_einsums
from mistjax.cost.kernels import gemm_seconds
from mistjax.hardware.presets import ClusterSpec, DeviceSpec

SPEC = "bte,end->btnd"


def _quantized(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x`` rounded to ``dtype`` under its tensorwise scale, back in fp32 (the reference's own arithmetic)."""
    top = float(jnp.finfo(dtype).max)
    scale = top / jnp.max(jnp.abs(x))
    return jnp.clip(x * scale, -top, top).astype(dtype).astype(jnp.float32) / scale


def _operands():
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 16, 64), jnp.float32)
    w = 0.1 * jax.random.normal(kw, (64, 4, 8), jnp.float32)
    g = jax.random.normal(kg, (2, 16, 4, 8), jnp.float32)
    return x, w, g


def _rel(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_fp8_einsum_is_the_product_of_the_quantized_operands():
    """Forward: e4m3 operands under their amax scales, accumulated in fp32; backward: the output gradient in e5m2
    against the same e4m3 operands. Equal to that arithmetic done by hand, and within fp8 rounding of fp32."""
    x, w, g = _operands()
    y, vjp = jax.vjp(lambda a, b: fp8_einsum(SPEC, a, b), x, w)
    xq, wq, gq = _quantized(x, E4M3), _quantized(w, E4M3), _quantized(g, E5M2)
    assert _rel(y, jnp.einsum(SPEC, xq, wq)) < 1e-6
    dx, dw = vjp(g)
    assert _rel(dx, jnp.einsum("btnd,end->bte", gq, wq)) < 1e-6
    assert _rel(dw, jnp.einsum("bte,btnd->end", xq, gq)) < 1e-6
    assert 1e-3 < _rel(y, jnp.einsum(SPEC, x, w)) < 0.1  # fp8 rounding is there, and small


def test_fp8_einsum_in_fp16_does_not_overflow():
    """The scaled product reaches 448^2 x k, past fp16's 65504: an fp16 model gets the unscaled result."""
    x, w, _ = _operands()
    y = fp8_einsum(SPEC, x.astype(jnp.float16), w.astype(jnp.float16))
    assert y.dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(y)))
    assert _rel(y.astype(jnp.float32), jnp.einsum(SPEC, x, w)) < 0.1


def test_fp8_einsums_cast_the_input_once_and_sum_its_gradients():
    x, w, g = _operands()
    ws, gs = (w, 2.0 * w), (g, -g)
    ys, vjp = jax.vjp(lambda a, bs: fp8_einsums((SPEC, SPEC), a, bs), x, ws)
    dx, dws = vjp(gs)
    for i in range(2):
        y1, vjp1 = jax.vjp(lambda a, b: fp8_einsum(SPEC, a, b), x, ws[i])
        assert _rel(ys[i], y1) < 1e-7
        assert _rel(dws[i], vjp1(gs[i])[1]) < 1e-7
    parts = [jax.vjp(lambda a, b: fp8_einsum(SPEC, a, b), x, ws[i])[1](gs[i])[0] for i in range(2)]
    assert _rel(dx, parts[0] + parts[1]) < 1e-6
    jaxpr = str(jax.make_jaxpr(lambda a, bs: fp8_einsums((SPEC, SPEC), a, bs))(x, ws))
    assert jaxpr.count("reduce_max") == 3  # one amax for x, one per weight


def test_fp8_einsum_refuses_an_index_it_cannot_transpose():
    x, w, _ = _operands()
    with pytest.raises(ValueError, match="index z appears in no other term"):
        fp8_einsum("btz,end->btnd", x, w)
    with pytest.raises(ValueError, match="one spec per weight"):
        fp8_einsums((SPEC,), x, (w, w))


def test_fp8_models_train_under_a_plan_as_on_one_device(train_steps):
    """An fp8 llama under tp 4 with remat gives one device's losses and parameters (the amax of a split tensor is
    all-reduced, so every device casts with the whole tensor's scale); fp8 training tracks the full-precision
    run. (Under data parallelism each replica scales its own micro-batch, as torchao and Transformer Engine do.)"""
    cfg = models.get_config("llama-tiny").replace(fp8=True)
    ref_losses, ref_params = train_steps(cfg, 2)
    plan = mistjax.uniform_plan(cfg.num_layers, 4, micro_batch=16, tp=4, remat_layers=2, shard_opt=True)
    losses, params = train_steps(cfg, 2, jax.devices()[:4], plan)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    full_losses, full_params = train_steps(cfg.replace(fp8=False), 2)
    np.testing.assert_allclose(losses, full_losses, rtol=0.01)
    assert losses != full_losses
    # A split sum rounds differently, and an element near an fp8 rounding boundary then lands in the next
    # bucket: the parameters agree to a small fraction of how far fp8 moves them from full precision.
    for p, r, f in zip(params, ref_params, full_params):
        assert np.linalg.norm(p - r) <= 0.2 * np.linalg.norm(f - r) + 1e-7 * np.linalg.norm(r)


def test_fp8_gemms_are_analysed_and_priced_at_the_fp8_peak():
    """The analysis flags the projections' GEMMs (forward and both gradients) as fp8 and gathers the sequence-
    parallel activations in fp8; the kernels of an fp8 layer price below bf16's on H100 (fp8 tensor cores) and
    their GEMMs the same on A100 (none)."""
    base = models.get_config("llama-tiny").replace(dtype="bfloat16", param_dtype="bfloat16")
    loads = {fp8: models.workload(base.replace(fp8=fp8), 64, 8, policies=("none",)) for fp8 in (False, True)}
    block = {fp8: w.profile.parts["block"] for fp8, w in loads.items()}
    fwd, bwd = block[True].kernels["fwd[none]"], block[True].kernels["bwd[none]"]
    assert sum(g.fp8 for g in fwd.gemms) >= 3 and sum(g.fp8 for g in bwd.gemms) >= 4  # qkv/o/mlp, dgrad + wgrad
    assert not any(g.fp8 for g in block[False].kernels["fwd[none]"].gemms)
    gathers = {fp8: [c for c in b.tp_collectives if c.kind == "all-gather" and c.phase == "fwd"]
               for fp8, b in block.items()}
    assert [c.dtype for c in gathers[True]] == ["float8_e4m3fn"] * len(gathers[False])
    assert [c.kind for c in block[True].tp_collectives if c.kind != "all-reduce"] == \
        [c.kind for c in block[False].tp_collectives if c.kind != "all-reduce"]

    arrays = {fp8: w.compiled.kernels(np.array([4.0]), np.array([64.0]), np.array([1.0]))[("block", "fwd[none]")]
              for fp8, w in loads.items()}
    h100 = ClusterSpec.preset("h100").device
    a100 = ClusterSpec.preset("a100-80gb").device
    assert h100.peak_flops_fp8 == pytest.approx(2 * h100.peak_flops, rel=1e-3) and a100.peak_flops_fp8 == 0
    flops = {fp8: float(np.sum(2 * a.gemm_batch * a.gemm_m * a.gemm_n * a.gemm_k * a.gemm_count)) for fp8, a in
             arrays.items()}
    assert flops[True] == pytest.approx(flops[False])
    huge = replace(h100, kernel_overhead=0.0, hbm_bandwidth=1e20)  # compute-bound: the peaks alone decide
    assert gemm_seconds(arrays[True], huge, False)[0] < 0.6 * gemm_seconds(arrays[False], huge, False)[0]
    huge_a100 = replace(a100, kernel_overhead=0.0, hbm_bandwidth=1e20)
    assert gemm_seconds(arrays[True], huge_a100, False)[0] == pytest.approx(
        gemm_seconds(arrays[False], huge_a100, False)[0])


def test_a_negative_fp8_peak_is_refused():
    dev = ClusterSpec.preset("h100").device
    with pytest.raises(ValueError, match="peak_flops_fp8"):
        DeviceSpec(**{**dev.__dict__, "peak_flops_fp8": -1.0})


def test_xla_gpu_compiles_the_projections_to_fp8_gemms_on_h100():
    """Deviceless XLA:GPU for H100 (tp 2): the projections' forward and gradient GEMMs take fp8 operands, and the
    sequence-parallel activations are gathered in fp8."""
    from mistjax.validate import gpu_aot

    problem = gpu_aot.plugin_problem()
    if problem is not None:
        pytest.skip(f"deviceless XLA:GPU compile unavailable: {problem}")
    cfg = models.get_config("llama-tiny").replace(dtype="bfloat16", param_dtype="bfloat16", fp8=True)
    state, batch, step = gpu_aot.zoo_step(cfg, 64, 4)
    plan = mistjax.uniform_plan(cfg.num_layers, 2, micro_batch=4, tp=2, shard_opt=True)
    text = gpu_aot.compile_plan(step, state, batch, plan, ClusterSpec.parse("h100:1x2"), breakdown=False).hlo_text
    gemms = [line for line in text.splitlines() if "gemm_fusion" in line and "_computation (" in line]
    fp8 = [line for line in gemms if line.count("f8e") >= 2]
    assert len(fp8) >= 6, gemms  # forward, input-gradient and weight-gradient GEMMs of the projections
    gathers = [line.split("all-gather-start(")[0] for line in text.splitlines() if "all-gather-start(" in line]
    assert any("f8e4m3fn[" in g for g in gathers), gathers
