"""Next-token cross-entropy loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Batch = dict[str, jax.Array]


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy in fp32; `mask` (same shape as targets) drops padding tokens."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if mask is None:
        return jnp.mean(losses)
    mask = mask.astype(jnp.float32)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_loss_fn(graphdef: nnx.GraphDef) -> Callable[[Any, Batch], jax.Array]:
    """`loss_fn(params, batch)`: rebuild the module from `params` and score next-token prediction.

    `batch` holds ``inputs`` and ``targets`` (int32 ``[batch, seq]``), and optionally ``mask``.
    """

    def loss_fn(params: Any, batch: Batch) -> jax.Array:
        logits = nnx.merge(graphdef, params)(batch["inputs"])
        return cross_entropy(logits, batch["targets"], batch.get("mask"))

    return loss_fn
