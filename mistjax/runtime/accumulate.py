"""Gradient accumulation into one buffer: each layer's weight gradient is added into the step's
accumulator inside the backward layer loop, as Megatron-LM adds into its ``main_grad`` buffer.

Left to autodiff, a micro-batch's gradient of a stacked weight is a whole new stacked buffer (the
backward scan's per-layer outputs) that is added into the accumulator after the backward: two
gradient buffers live at once. Here the accumulator is threaded through the layer loop as a carry
that the forward passes on unchanged, and `accumulate_into` (an identity on the forward) adds the
cotangent of each layer's weight slice into that layer's row of the carry's cotangent. The caller
seeds the cotangent of the loop's accumulator output with the accumulator itself, so the backward
carry starts as the accumulator and each layer updates its row in place (a dynamic-update-slice of a
while-loop carry): one buffer, and one layer's gradient in flight. docs/internals.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

# One layer's cotangent of a stored weight slice -> the increment of that layer's accumulator row
# (to device, the gradient dtype, a ZeRO-2 reduce-scatter over the partition group).
SliceGrad = Callable[[jax.Array], jax.Array]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def accumulate_into(accs: list[jax.Array], xs: list[jax.Array], layer: jax.Array,
                    prepare: tuple[SliceGrad, ...], on_host: tuple[bool, ...]
                    ) -> tuple[list[jax.Array], list[jax.Array]]:
    """Identity on ``(accs, xs)``; the backward adds ``prepare[j](ct of xs[j])`` into row `layer` of
    the cotangent of ``accs[j]`` and gives `xs` a zero cotangent (their gradient lives in `accs`).

    Args:
      accs: the stacked accumulators (leading dim = layers), one per accumulated weight.
      xs: this layer's stored slices of those weights.
      layer: the layer's row in the accumulators (an int32 scalar).
      prepare: per weight, turns the slice cotangent into the accumulator row's increment.
      on_host: per weight, whether its stored slice is in host memory (its zero cotangent must be).
    """
    del layer, prepare, on_host
    return accs, xs


def _fwd(accs: list[jax.Array], xs: list[jax.Array], layer: jax.Array, prepare: tuple[SliceGrad, ...],
         on_host: tuple[bool, ...]) -> tuple[tuple[list[jax.Array], list[jax.Array]], jax.Array]:
    del prepare, on_host
    return (accs, xs), layer


def _zero_like(g: jax.Array, host: bool) -> jax.Array:
    z = jax.numpy.zeros_like(g)
    return jax.device_put(z, jax.memory.Space.Host) if host else z


def _bwd(prepare: tuple[SliceGrad, ...], on_host: tuple[bool, ...], layer: jax.Array,
         ct: tuple[list[jax.Array], list[jax.Array]]) -> tuple[list[jax.Array], list[jax.Array], None]:
    ct_accs, ct_xs = ct
    out = []
    for acc, g, prep in zip(ct_accs, ct_xs, prepare):
        row = lax.dynamic_index_in_dim(acc, layer, keepdims=False) + prep(g).astype(acc.dtype)
        out.append(lax.dynamic_update_index_in_dim(acc, row, layer, 0))
    # Zero, and dead code: the weights themselves are not differentiated (`runtime.grads`).
    return out, [_zero_like(g, h) for g, h in zip(ct_xs, on_host)], None


accumulate_into.defvjp(_fwd, _bwd)


def scan_accumulating(layer_fn: Callable[[list[Any], list[Any]], tuple[list[Any], list[Any]]],
                      carry: list[Any], xs: list[Any], accs: Sequence[jax.Array | None],
                      prepare: Sequence[SliceGrad | None], start: int, unroll: int
                      ) -> tuple[list[Any], list[jax.Array | None], list[Any]]:
    """``lax.scan(layer_fn, carry, xs)`` over layers ``start, start + 1, ...`` with `accs` (per scanned
    operand, its whole-stack accumulator or None) carried along and fed by `accumulate_into`.

    Returns:
      (carry, accs, ys): the accumulators are the inputs on the forward; their cotangents collect the
      layers' gradients.
    """
    idx = [j for j, a in enumerate(accs) if a is not None]
    preps = tuple(prepare[j] for j in idx)
    on_host = tuple(getattr(jax.typeof(xs[j]), "memory_space", None) == jax.memory.Space.Host for j in idx)
    num = int(jax.numpy.shape(xs[0])[0])

    def step(c_a: tuple[list[Any], list[Any]], x_i: tuple[list[Any], jax.Array]) -> Any:
        c, a = c_a
        x, i = x_i
        a, picked = accumulate_into(a, [x[j] for j in idx], i, preps, on_host)
        x = list(x)
        for j, v in zip(idx, picked):
            x[j] = v
        c, y = layer_fn(c, x)
        return (c, a), y

    rows = start + jax.numpy.arange(num, dtype=jax.numpy.int32)
    (carry, acc_out), ys = lax.scan(step, (carry, [accs[j] for j in idx]), (xs, rows), unroll=unroll)
    out: list[jax.Array | None] = list(accs)
    for j, a in zip(idx, acc_out):
        out[j] = a
    return carry, out, ys


__all__ = ["SliceGrad", "accumulate_into", "scan_accumulating"]
