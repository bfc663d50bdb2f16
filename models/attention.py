"""Fused causal attention: cuDNN's flash attention on GPUs that support it, else a blockwise kernel.

Unfused attention (`models.layers.xla_attention`, `models.layers.reference_attention`) keeps the
``[batch, heads, seq, seq]`` probabilities for the backward: about 6 x heads x seq^2 bytes per layer.
Fused attention keeps only the output and the log-sum-exp of every query row (FlashAttention-2, Dao
2023, section 3.1) and recomputes the probabilities in the backward.

* `cudnn_attention`: ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (bf16 / fp16,
  head dim a multiple of 8 and <= 128 on Ampere/Ada, <= 256 on Hopper and later; `cudnn_unsupported`).
* `blockwise_attention`: the same algorithm in plain JAX for any backend: a ``lax.scan`` over blocks
  of keys with an online softmax in float32, under a ``jax.custom_vjp`` whose residuals are q, k, v,
  the output and the float32 log-sum-exp; the backward rescans the key blocks and recomputes each
  block's probabilities (five block matmuls against the forward's two: 2.5x, not 2x).
* `fused_attention`: cuDNN where `cudnn_unsupported` finds nothing against it, else the blockwise
  kernel (warning once per reason when a GPU cannot take cuDNN).

Recognisable as a unit: the blockwise forward and backward run inside ``jax.jit``-ed functions named
``fused_attention_fwd_b<B>`` / ``fused_attention_bwd_b<B>`` (B: the key block size), which survive
``jax.vjp`` and ``jax.checkpoint`` as named ``jit`` equations; `mistjax.analysis` reads these names
(and cuDNN's ``dot_product_attention_{fwd,bwd}_wrapper`` primitives) to price the kernel as one unit.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

# The key blocking both blockwise kernels share (this one and the context-parallel ring), in the core so that
# the model zoo never imports the runtime.
from mistjax.core.attention_blocks import check_attention_args, key_blocks, pad_keys

DEFAULT_BLOCK_SIZE = 128  # keys per block: the fastest on CPU at s = 1-2k, ahead of XLA unfused (docs/guide.md)
FWD_NAME = "fused_attention_fwd"  # name prefix of the blockwise forward's jit (see the module docstring)
BWD_NAME = "fused_attention_bwd"
_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def cudnn_unsupported(head_dim: int, dtype: jnp.dtype, device: jax.Device | None = None) -> str | None:
    """Why cuDNN flash attention cannot run these shapes on ``device`` (None when it can).

    Args:
        head_dim: width of one attention head.
        dtype: dtype of q, k and v.
        device: the device to run on; default ``jax.devices()[0]`` (the default backend).
    """
    device = device or jax.devices()[0]
    if device.platform != "gpu" or not hasattr(device, "compute_capability"):
        return f"the device is {device.platform}, not a CUDA GPU"
    cc = tuple(int(x) for x in str(device.compute_capability).split("."))
    if cc < (8, 0):
        return f"compute capability {device.compute_capability} < 8.0 (cuDNN flash attention needs Ampere+)"
    if jnp.dtype(dtype) not in _CUDNN_DTYPES:
        return f"compute dtype {jnp.dtype(dtype).name} (cuDNN flash attention takes bfloat16 / float16)"
    limit = 256 if cc >= (9, 0) else 128
    if head_dim > limit or head_dim % 8:
        return f"head dim {head_dim} (cuDNN takes multiples of 8 up to {limit} on compute capability {cc[0]}.{cc[1]})"
    return None


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True) -> jax.Array:
    """cuDNN flash attention via ``jax.nn.dot_product_attention`` (GQA handled by cuDNN).

    Args:
        q: ``[batch, seq, heads, head_dim]``; k, v: ``[batch, seq, kv_heads, head_dim]``, same dtype.
        causal: mask keys after the query.
    """
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"fused attention: cuDNN flash attention is not available ({reason}); using the blockwise "
                  "kernel (models.attention.blockwise_attention), which has the same memory but is slower. "
                  "Set ModelConfig.attention='blockwise' to silence this.", stacklevel=3)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_size: int = DEFAULT_BLOCK_SIZE,
                    causal: bool = True, residual_name: str | None = None) -> jax.Array:
    """cuDNN flash attention where `cudnn_unsupported` allows it, else `blockwise_attention`.

    Not on a GPU (CPU, TPU) the blockwise kernel is the intended path and nothing is said; on a GPU that
    cannot take these shapes a warning names the reason once.
    """
    reason = cudnn_unsupported(q.shape[-1], q.dtype)
    if reason is None:
        return cudnn_attention(q, k, v, causal=causal)
    if jax.devices()[0].platform == "gpu":
        _warn_fallback(reason)
    return blockwise_attention(q, k, v, block_size=block_size, causal=causal, residual_name=residual_name)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_size: int = DEFAULT_BLOCK_SIZE,
                        causal: bool = True, residual_name: str | None = None) -> jax.Array:
    """Memory-efficient (flash-style) attention: O(seq) residuals, O(seq x block) temporaries.

    Args:
        q: ``[batch, seq, heads, head_dim]``.
        k: ``[batch, seq, kv_heads, head_dim]``; query head ``n`` reads kv head ``n // (heads // kv_heads)``
            (the grouping of ``jax.nn.dot_product_attention``).
        v: same shape and dtype as ``k``.
        block_size: keys per block (the kernel uses ``ceil(seq / ceil(seq / block_size))`` so that blocks
            are balanced; the last one is padded and masked when they do not divide ``seq``).
        causal: mask keys after the query.
        residual_name: ``checkpoint_name`` given to the saved output and log-sum-exp, so that a remat policy
            saving that name keeps both (saving the output alone would still rerun the kernel).

    Returns:
        ``[batch, seq, heads, head_dim]`` in ``q.dtype``; logits, softmax statistics and accumulators are
        float32 whatever the input dtype.

    Raises:
        ValueError: for bad shapes or a non-positive ``block_size``.
    """
    check_attention_args(q, k, v, block_size)
    return _blockwise(q, k, v, block_size, causal, residual_name)




def _block_mask(s: int, start: jax.Array, bk: int, causal: bool) -> jax.Array:
    """``[s, bk]``: query ``i`` may read key ``start + j`` (causal, and not a padding key)."""
    qpos = lax.broadcasted_iota(jnp.int32, (s, bk), 0)
    kpos = start + lax.broadcasted_iota(jnp.int32, (s, bk), 1)
    return kpos <= qpos if causal else kpos < s


def _mask_bias(s: int, start: jax.Array, bk: int, causal: bool) -> jax.Array:
    """``[s, bk]`` float32: 0 where `_block_mask` allows the key, -inf elsewhere.

    Added to the logits rather than selected with ``jnp.where``: a select's linearization keeps its
    boolean mask as a residual, and the scan's partial evaluation stacks it over all key blocks
    (``[blocks, b, kv, s, g, bk]`` booleans: 4 GiB per layer loop at b 2, s 8192 on XLA:GPU), while an
    added constant has nothing to keep.
    """
    return jnp.where(_block_mask(s, start, bk, causal), 0.0, -jnp.inf).astype(jnp.float32)


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, block_size: int, causal: bool
             ) -> tuple[jax.Array, jax.Array]:
    """``(o [b, s, n, d] in q.dtype, lse [b, kv, s, g] float32)`` by an online softmax over key blocks."""
    b, s, n, d = q.shape
    kvh = k.shape[2]
    g = n // kvh
    nk, bk = key_blocks(s, block_size)
    scale = 1.0 / math.sqrt(d)
    qg = q.reshape(b, s, kvh, g, d)
    k, v = pad_keys(k, nk * bk), pad_keys(v, nk * bk)

    def body(carry: tuple[jax.Array, ...], start: jax.Array) -> tuple[tuple[jax.Array, ...], None]:
        m, den, acc = carry  # [b, kv, s, g] x2, [b, kv, s, g, d]: running max, sum and output (float32)
        kj = lax.dynamic_slice_in_dim(k, start, bk, axis=1)
        vj = lax.dynamic_slice_in_dim(v, start, bk, axis=1)
        logits = jnp.einsum("bskgd,btkd->bksgt", qg, kj, preferred_element_type=jnp.float32) * scale
        logits = logits + _mask_bias(s, start, bk, causal)[:, None, :]
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))  # finite: every row sees key 0 in block 0
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[..., None])
        pv = jnp.einsum("bksgt,btkd->bksgd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
        return (m_new, den * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv), None

    init = (jnp.full((b, kvh, s, g), -jnp.inf, jnp.float32), jnp.zeros((b, kvh, s, g), jnp.float32),
            jnp.zeros((b, kvh, s, g, d), jnp.float32))
    (m, den, acc), _ = lax.scan(body, init, jnp.arange(nk, dtype=jnp.int32) * bk)
    o = jnp.moveaxis(acc / den[..., None], 1, 2).reshape(b, s, n, d).astype(q.dtype)
    return o, m + jnp.log(den)


def _backward(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array, do: jax.Array,
              block_size: int, causal: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` by a second scan over key blocks that recomputes each block's probabilities."""
    b, s, n, d = q.shape
    kvh = k.shape[2]
    g = n // kvh
    nk, bk = key_blocks(s, block_size)
    scale = 1.0 / math.sqrt(d)
    qg, dog = q.reshape(b, s, kvh, g, d), do.reshape(b, s, kvh, g, d)
    # D_i = sum_j P_ij dP_ij = do_i . o_i (FlashAttention-2, eq. for dS), in float32.
    delta = jnp.einsum("bskgd,bskgd->bksg", dog, o.reshape(b, s, kvh, g, d), preferred_element_type=jnp.float32)
    kp, vp = pad_keys(k, nk * bk), pad_keys(v, nk * bk)

    def body(dq: jax.Array, start: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        kj = lax.dynamic_slice_in_dim(kp, start, bk, axis=1)
        vj = lax.dynamic_slice_in_dim(vp, start, bk, axis=1)
        logits = jnp.einsum("bskgd,btkd->bksgt", qg, kj, preferred_element_type=jnp.float32) * scale
        mask = _block_mask(s, start, bk, causal)[:, None, :]
        p = jnp.where(mask, jnp.exp(logits - lse[..., None]), 0.0)
        dv = jnp.einsum("bksgt,bskgd->bktd", p.astype(do.dtype), dog, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bskgd,btkd->bksgt", dog, vj, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
        dq = dq + jnp.einsum("bksgt,btkd->bksgd", ds, kj, preferred_element_type=jnp.float32)
        dk = jnp.einsum("bksgt,bskgd->bktd", ds, qg, preferred_element_type=jnp.float32)
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq, (dk, dv) = lax.scan(body, jnp.zeros((b, kvh, s, g, d), jnp.float32),
                            jnp.arange(nk, dtype=jnp.int32) * bk)

    def unblock(x: jax.Array) -> jax.Array:  # [nk, b, kv, bk, d] -> [b, s, kv, d]
        return jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(b, nk * bk, kvh, d)[:, :s]

    dq = jnp.moveaxis(dq, 1, 2).reshape(b, s, n, d).astype(q.dtype)
    return dq, unblock(dk), unblock(dv)


@functools.cache
def _kernels(block_size: int, causal: bool) -> tuple[Callable[..., tuple[jax.Array, ...]], ...]:
    """The jitted forward and backward, named so that the analysis can find them (module docstring)."""
    def fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _forward(q, k, v, block_size, causal)

    def bwd(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array, do: jax.Array
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
        return _backward(q, k, v, o, lse, do, block_size, causal)

    fwd.__name__ = fwd.__qualname__ = f"{FWD_NAME}_b{block_size}"
    bwd.__name__ = bwd.__qualname__ = f"{BWD_NAME}_b{block_size}"
    return jax.jit(fwd), jax.jit(bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _blockwise(q: jax.Array, k: jax.Array, v: jax.Array, block_size: int, causal: bool,
               residual_name: str | None) -> jax.Array:
    return _kernels(block_size, causal)[0](q, k, v)[0]


def _blockwise_fwd(q: jax.Array, k: jax.Array, v: jax.Array, block_size: int, causal: bool,
                   residual_name: str | None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    o, lse = _kernels(block_size, causal)[0](q, k, v)
    if residual_name is not None:
        o, lse = checkpoint_name(o, residual_name), checkpoint_name(lse, residual_name)
    return o, (q, k, v, o, lse)


def _blockwise_bwd(block_size: int, causal: bool, residual_name: str | None, res: tuple[jax.Array, ...],
                   do: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return _kernels(block_size, causal)[1](*res, do)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)
