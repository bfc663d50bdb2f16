"""Next-token cross-entropy loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.head_loss import linear_cross_entropy

Batch = dict[str, jax.Array]


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy in fp32; `mask` (same shape as targets) drops padding tokens."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if mask is None:
        return jnp.mean(losses)
    mask = mask.astype(jnp.float32)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def token_weights(targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Per-token weights of the mean cross-entropy: ``1 / tokens``, or ``mask / sum(mask)``."""
    if mask is None:
        return jnp.full(targets.shape, 1.0 / targets.size, jnp.float32)
    mask = mask.astype(jnp.float32)
    return mask / jnp.maximum(jnp.sum(mask), 1.0)


def make_loss_fn(graphdef: nnx.GraphDef, *, fused_head: bool = True) -> Callable[[Any, Batch], jax.Array]:
    """`loss_fn(params, batch)`: rebuild the module from `params` and score next-token prediction.

    `batch` holds ``inputs`` and ``targets`` (int32 ``[batch, seq]``), and optionally ``mask``.
    ``fused_head`` (default) runs the LM head and the cross-entropy as one kernel over sequence slices
    (`models.head_loss.linear_cross_entropy`, ``ModelConfig.loss_chunks`` of them) that never keeps the
    full-vocabulary logits; False materialises the fp32 logits (``model(inputs)``) as plain JAX would.
    """

    def loss_fn(params: Any, batch: Batch) -> jax.Array:
        model = nnx.merge(graphdef, params)
        if not fused_head:
            return cross_entropy(model(batch["inputs"]), batch["targets"], batch.get("mask"))
        hidden = model.final_norm(model.run_layers(model.embed_tokens(batch["inputs"])))
        weights = token_weights(batch["targets"], batch.get("mask"))
        return linear_cross_entropy(hidden, model.head_kernel(), batch["targets"], weights,
                                    model.config.loss_chunks, model.config.vocab_size)

    return loss_fn
