"""The train state: parameters, optimizer state and step counter as one pytree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.typing import DTypeLike

from mistjax.api.precision import with_master_weights


@struct.dataclass
class TrainState:
    """Parameters, optax state and step of one model, as a pytree.

    The graph definition and the optimizer are static fields, so a `TrainState` can cross
    `jax.jit` boundaries and be sharded leaf by leaf. Parameter leaves keep their Flax
    `nnx.Param` wrappers (and with them the logical axis names), and the optax state mirrors
    them, so every leaf of the state can be mapped to a sharding.
    """

    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State  # trainable parameters (fp32 master weights)
    opt_state: optax.OptState  # optimizer state, mirroring `params`
    graphdef: nnx.GraphDef = struct.field(pytree_node=False)  # rebuilds the module with `params`
    tx: optax.GradientTransformation = struct.field(pytree_node=False)  # the optimizer

    @classmethod
    def create(cls, model: nnx.Module, tx: optax.GradientTransformation, *,
               param_dtype: DTypeLike | None = None) -> TrainState:
        """Split `model` into its graph and parameters and initialise the optimizer.

        Args:
          model: the model, with its parameters at full precision.
          tx: the optimizer (wrap it in `mistjax.api.precision.with_master_weights` for 16-bit weights).
          param_dtype: store the parameters in this dtype (e.g. ``"bfloat16"``); the optimizer is
            initialised from the full-precision values first, so a master copy starts exact.
        """
        graphdef, params = nnx.split(model, nnx.Param)
        opt_state = tx.init(params)
        if param_dtype is not None:
            params = jax.tree.map(lambda x: x.astype(jnp.dtype(param_dtype)), params)
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, graphdef=graphdef, tx=tx)

    def apply_gradients(self, grads: nnx.State) -> TrainState:
        """One optimizer step with `grads` (same structure as `params`)."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state)

    def model(self) -> nnx.Module:
        """The module with the current parameters (for evaluation outside the train step)."""
        return nnx.merge(self.graphdef, self.params)


def make_optimizer(learning_rate: float = 3e-4, *, warmup_steps: int = 0, total_steps: int = 0,
                   weight_decay: float = 0.1, clip_norm: float | None = 1.0, b2: float = 0.95,
                   master_weights: bool = False) -> optax.GradientTransformation:
    """AdamW with optional linear warm-up + cosine decay and global-norm clipping.

    With ``master_weights`` the whole chain runs on an fp32 master copy of 16-bit parameters
    (`mistjax.api.precision.with_master_weights`).
    """
    schedule: optax.Schedule | float = learning_rate
    if total_steps > 0:
        schedule = optax.warmup_cosine_decay_schedule(
            0.0 if warmup_steps else learning_rate, learning_rate, max(warmup_steps, 1),
            max(total_steps, warmup_steps + 1), end_value=learning_rate * 0.1)
    chain = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
    chain.append(optax.adamw(schedule, b2=b2, weight_decay=weight_decay))
    tx = optax.chain(*chain)
    return with_master_weights(tx) if master_weights else tx
