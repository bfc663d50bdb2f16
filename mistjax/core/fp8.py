"""FP8 matmuls with dynamic tensorwise scaling, the recipe torchao's Float8Linear and Transformer Engine's
"current scaling" run on Hopper / Ada GPUs (docs/precision.md).

Forward: both operands are scaled by ``max / amax`` (their whole-tensor absolute maximum) and cast to
``float8_e4m3fn`` (max 448); the GEMM accumulates in fp32 and the result is scaled back. Backward: the output
gradient is cast to ``float8_e5m2`` (max 57344, more range for gradients) the same way, and both gradient GEMMs
(input and weight) run with fp8 operands too. The residuals are the operands in their own dtype, as an
ordinary matmul saves them, so FP8 changes no activation memory; the backward casts them again with the
forward's scales.

XLA:GPU compiles a dot of fp8 operands to an fp8 GEMM (Triton or cuBLASLt) on sm_89 / sm_90 and later, and
the cost model prices it at the device's fp8 peak (`DeviceSpec.peak_flops_fp8`); other backends (XLA:CPU,
A100) compute it in a wider type, with the same rounding of the operands.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # forward operands
E5M2 = jnp.float8_e5m2  # output gradients


def _scale(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """fp32 factor that maps ``x``'s absolute maximum onto ``dtype``'s largest finite value (1 for all zeros)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    top = float(jnp.finfo(dtype).max)
    return jnp.where(amax > 0, top / jnp.maximum(amax, jnp.finfo(jnp.float32).tiny), 1.0)


def _cast(x: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(dtype)


def _operands(spec: str) -> tuple[str, str, str]:
    try:
        ins, out = spec.replace(" ", "").split("->")
        a, b = ins.split(",")
    except ValueError:
        raise ValueError(f"fp8_einsum spec {spec!r}: expected two operands and an output, e.g. 'bte,ef->btf'"
                         ) from None
    for name, labels, others in (("first", a, b + out), ("second", b, a + out)):
        missing = sorted(set(labels) - set(others))
        if missing:
            raise ValueError(f"fp8_einsum spec {spec!r}: {name} operand index {''.join(missing)} appears in no "
                             "other term; sum it out before the matmul")
    return a, b, out


def _gemm(spec: str, x: jax.Array, w: jax.Array, unscale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    # The GEMM accumulates in fp32 and writes ``dtype`` (a tensor-parallel partial product is reduced in it, as
    # a bf16 matmul's is); the unscale follows. The scaled product reaches 448^2 x k: fp16 (max 65504) takes it
    # in fp32 and rounds after the unscale.
    wide = jnp.dtype(dtype) if float(jnp.finfo(dtype).max) > 1e30 else jnp.dtype(jnp.float32)
    y = jnp.einsum(spec, x, w, preferred_element_type=wide)
    return (y * unscale.astype(wide)).astype(dtype)


def fp8_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` as an FP8 GEMM: e4m3 operands with tensorwise dynamic scales, fp32 accumulation,
    the result in ``x``'s dtype; the gradients' GEMMs take the output gradient in e5m2.

    Args:
      spec: a two-operand einsum whose every index appears in at least two terms (a projection such as
        ``"bte,end->btnd"``).
      x: activations (bf16 / fp16 / fp32).
      w: weights (any float dtype; the gradient comes back in it).

    Raises:
      ValueError: ``spec`` is not such an einsum.
    """
    return fp8_einsums((spec,), x, (w,))[0]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsums(specs: tuple[str, ...], x: jax.Array, ws: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """`fp8_einsum` of one input with several weights (attention's q / k / v, an MLP's gate and up): ``x`` is
    scaled and cast once, as a fused projection's input is, and its gradient is the sum of the GEMMs'."""
    return _forward(specs, x, ws)[0]


# What the forward saves for the backward: x, the weights, x's scale and the weights' scales.
_Residuals = tuple[jax.Array, tuple[jax.Array, ...], jax.Array, tuple[jax.Array, ...]]


def _forward(specs: tuple[str, ...], x: jax.Array, ws: tuple[jax.Array, ...]
             ) -> tuple[tuple[jax.Array, ...], _Residuals]:
    if len(specs) != len(ws):
        raise ValueError(f"fp8_einsums: {len(specs)} specs for {len(ws)} weights; give one spec per weight")
    for spec in specs:
        _operands(spec)
    sx = _scale(x, E4M3)
    xq = _cast(x, sx, E4M3)
    sws = tuple(_scale(w, E4M3) for w in ws)
    ys = tuple(_gemm(spec, xq, _cast(w, sw, E4M3), 1.0 / (sx * sw), x.dtype)
               for spec, w, sw in zip(specs, ws, sws))
    return ys, (x, ws, sx, sws)


def _backward(specs: tuple[str, ...], res: _Residuals, gs: tuple[jax.Array, ...]
              ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    x, ws, sx, sws = res
    xq = _cast(x, sx, E4M3)
    dx: jax.Array | None = None
    dws = []
    for spec, w, sw, g in zip(specs, ws, sws, gs):
        a, b, out = _operands(spec)
        sg = _scale(g, E5M2)
        gq = _cast(g, sg, E5M2)
        part = _gemm(f"{out},{b}->{a}", gq, _cast(w, sw, E4M3), 1.0 / (sg * sw), x.dtype)
        dx = part if dx is None else dx + part
        dws.append(_gemm(f"{a},{out}->{b}", xq, gq, 1.0 / (sx * sg), w.dtype))
    if dx is None:  # no weights: x reached no GEMM, so its gradient is zero (not None, which JAX rejects)
        dx = jnp.zeros_like(x)
    return dx, tuple(dws)


fp8_einsums.defvjp(_forward, _backward)

__all__ = ["E4M3", "E5M2", "fp8_einsum", "fp8_einsums"]
