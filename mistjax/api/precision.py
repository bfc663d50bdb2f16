"""Mixed precision as Megatron-LM and Mist run it: 16-bit working weights, fp32 master weights in the optimizer.

The train state stores the parameters in their working dtype (bf16 / fp16); `with_master_weights` wraps
an optax transformation so that it keeps an fp32 copy of every parameter in its own state (where
ZeRO-1/2/3 shard it with the moments), applies the inner update to the fp32 copy, and returns the
updates that turn the working weights into the rounded new master weights.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from mistjax.core.types import PyTree


class MasterWeightsState(NamedTuple):
    """Optimizer state of `with_master_weights`."""

    master: PyTree  # fp32 copy of the parameters (same tree and shapes)
    inner: optax.OptState  # state of the wrapped transformation, over the master copy


def _astype(tree: PyTree, dtype: DTypeLike) -> PyTree:
    return jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), tree)


def with_master_weights(inner: optax.GradientTransformation, master_dtype: DTypeLike = jnp.float32
                        ) -> optax.GradientTransformation:
    """``inner`` applied to an fp32 master copy of 16-bit parameters.

    ``init(params)`` copies the parameters to ``master_dtype`` (give it the full-precision initial values
    when you have them: `mistjax.train.state.TrainState.create` does). ``update(grads, state, params)``
    casts the gradients to ``master_dtype``, runs ``inner`` on the master copy (clipping, moments, weight
    decay all in fp32), and returns updates in ``master_dtype`` such that
    ``optax.apply_updates(params, updates)`` equals the new master weights rounded to the parameters' dtype.

    Args:
      inner: the optimizer, e.g. ``optax.adamw(3e-4)``.
      master_dtype: dtype of the master copy and of the inner optimizer's arithmetic.
    """

    def init(params: optax.Params) -> MasterWeightsState:
        master = _astype(params, master_dtype)
        return MasterWeightsState(master=master, inner=inner.init(master))

    def update(grads: optax.Updates, state: MasterWeightsState, params: optax.Params | None = None
               ) -> tuple[optax.Updates, MasterWeightsState]:
        if params is None:
            raise ValueError("with_master_weights needs the parameters: call update(grads, state, params)")
        updates, inner_state = inner.update(_astype(grads, master_dtype), state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        # apply_updates adds in fp32 (the updates' dtype) and rounds once to the parameters' dtype.
        delta = jax.tree.map(lambda m, p: m - jnp.asarray(p).astype(master_dtype), master, params)
        return delta, MasterWeightsState(master=master, inner=inner_state)

    return optax.GradientTransformation(init, update)


__all__ = ["MasterWeightsState", "with_master_weights"]
