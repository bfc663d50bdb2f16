"""The LM head and its cross-entropy as one kernel: no full-vocabulary logits are kept.

``linear_cross_entropy(x, w, targets, weights, chunks)`` is ``sum(weights * CE(x @ w, targets))`` with a
custom VJP. The forward runs over ``chunks`` sequence slices; each computes its logits (fp32 accumulate),
its loss, and at once the gradients of that loss with respect to ``x`` and ``w`` (softmax minus one-hot,
scaled by the token weights), then drops the logits. The backward only scales the saved ``dx`` and ``dw``
by the incoming cotangent. Peak memory is one chunk's ``[b, s / chunks, vocab]`` fp32 logits instead of
the whole step's several copies, and nothing is recomputed (Megatron-LM's fused vocab cross-entropy
likewise reuses the logits buffer for the gradient). Under tensor parallelism ``w`` is split over the
vocabulary (``("embed", "vocab")``) and GSPMD reduces the log-sum-exp across the shards. A padded vocabulary
(`models.config.ModelConfig.padded_vocab_size`) has its pad columns masked out of every slice's softmax.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from models.layers import mask_pad_logits


def _chunk_count(seq: int, chunks: int) -> int:
    """The largest divisor of ``seq`` that is at most ``chunks`` (slices of equal length)."""
    return max(d for d in range(1, min(chunks, seq) + 1) if seq % d == 0)


def _dot(a: jax.Array, b: jax.Array, contract: tuple[tuple[int, ...], tuple[int, ...]]) -> jax.Array:
    """fp32-accumulated ``dot_general`` (no einsum: its size-1 squeezes change the traced structure)."""
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _chunk(x: jax.Array, w: jax.Array, t: jax.Array, wt: jax.Array, vocab: int | None
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Weighted loss sum of one slice, its ``dx`` (in x's dtype) and its fp32 ``dw``.

    ``vocab``: real columns of ``w`` (None: all); the others are padding, masked out of the softmax, so
    their probability, and with it their gradient, is zero.
    """
    wc = w.astype(x.dtype)
    logits = _dot(x, wc, ((2,), (0,)))  # [b, c, v]
    if vocab is not None:
        logits = mask_pad_logits(logits, vocab)
    lse = jax.nn.logsumexp(logits, axis=-1)
    onehot = jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32)
    loss = jnp.sum((lse - jnp.sum(logits * onehot, axis=-1)) * wt)
    dlogits = ((jnp.exp(logits - lse[..., None]) - onehot) * wt[..., None]).astype(x.dtype)
    dx = _dot(dlogits, wc, ((2,), (1,))).astype(x.dtype)  # [b, c, e]
    dw = _dot(x, dlogits, ((0, 1), (0, 1)))  # [e, v]
    return loss, dx, dw


def _forward(x: jax.Array, w: jax.Array, targets: jax.Array, weights: jax.Array, chunks: int,
             vocab: int | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    # A loop over the slices (not a Python loop): XLA merges independent dots sharing an operand, which
    # would rebuild the full logits; the loop carries the loss and dw, so GSPMD keeps dw's vocab split.
    b, s, e = x.shape
    n = _chunk_count(s, chunks)

    def slices(a: jax.Array) -> jax.Array:  # [b, s, ...] -> [n, b, s / n, ...]
        return jnp.moveaxis(a.reshape(b, n, s // n, *a.shape[2:]), 1, 0)

    def body(carry: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, ...], jax.Array]:
        total, dw = carry
        loss, dx, dwi = _chunk(*xs[:1], w, *xs[1:], vocab)
        return (total + loss, dw + dwi), dx

    init = (jnp.zeros((), jnp.float32), jnp.zeros(w.shape, jnp.float32))
    (total, dw), dxs = jax.lax.scan(body, init, (slices(x), slices(targets), slices(weights)))
    return total, jnp.moveaxis(dxs, 0, 1).reshape(b, s, e), dw


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def linear_cross_entropy(x: jax.Array, w: jax.Array, targets: jax.Array, weights: jax.Array,
                         chunks: int = 8, vocab: int | None = None) -> jax.Array:
    """``sum(weights * cross_entropy(x @ w, targets))`` in fp32, without keeping the logits.

    Args:
      x: ``[batch, seq, embed]`` final hidden states (the compute dtype).
      w: ``[embed, padded_vocab]`` head kernel (cast to ``x``'s dtype for the matmul).
      targets: int ``[batch, seq]`` token ids (below ``vocab``).
      weights: ``[batch, seq]`` per-token weights (``1 / tokens`` for a mean, zero for padding).
      chunks: sequence slices the vocabulary matmul runs in (the largest divisor of ``seq`` up to it).
      vocab: the real vocabulary when ``w`` has pad columns past it (`models.layers.mask_pad_logits`);
        None or ``w``'s width: no padding.
    """
    return _forward(x, w, targets, weights, chunks, vocab)[0]


def _fwd(x, w, targets, weights, chunks, vocab):  # noqa: ANN001, ANN202 (custom_vjp rule)
    total, dx, dw = _forward(x, w, targets, weights, chunks, vocab)
    return total, (dx, dw.astype(w.dtype))


def _bwd(chunks, vocab, res, g):  # noqa: ANN001, ANN202 (custom_vjp rule)
    dx, dw = res
    return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None, None


linear_cross_entropy.defvjp(_fwd, _bwd)


__all__ = ["linear_cross_entropy"]
