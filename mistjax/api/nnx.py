"""Flax NNX idioms under `mistjax.autoshard`: ``nnx.Optimizer``, ``nnx.value_and_grad``, ``nnx.jit``.

An NNX train step is stateful, ``train_step(model, optimizer, batch) -> metrics``, while autoshard runs a
pure ``train_step(state, batch) -> (state, metrics)``. `functional` turns one into the other (the one
line a user adds), and `value_and_grad` is the drop-in for ``nnx.value_and_grad`` that lets autoshard
plan the gradient (micro-batches, per-layer remat and ZeRO-3 gathers, pipelines)::

    @nnx.jit                                            # kept: autoshard compiles the step itself
    def train_step(model, optimizer, batch):
        loss, grads = mistjax.nnx.value_and_grad(loss_fn)(model, batch)   # was nnx.value_and_grad
        optimizer.update(model, grads)
        return {"loss": loss}

    step, state = mistjax.nnx.functional(train_step, model, optimizer)   # the one-line change
    sharded = mistjax.autoshard(step, mesh)
    state = sharded.place(state, batch)
    state, metrics = sharded(state, batch)
    nnx.update((model, optimizer), state)              # back into the objects, when wanted

The optimizer's state (``nnx.Optimizer.opt_state``) mirrors the model's parameters by path, so ZeRO and
optimizer offload shard it like any optax state.
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from mistjax.api import value_and_grad as _value_and_grad
from mistjax.core.types import Batch, LossFn, Metrics, PyTree, State, TrainStep


def value_and_grad(f: LossFn, *, has_aux: bool = False, wrt: nnx.filterlib.Filter = nnx.Param
                   ) -> Callable[..., PyTree]:
    """Drop-in for ``nnx.value_and_grad(f, has_aux=...)(model, *args)`` (gradients of the ``wrt`` variables).

    Outside `mistjax.autoshard` it computes what ``nnx.value_and_grad`` does; inside, autoshard runs the
    gradient the way its plan says. The gradients come back as an ``nnx.State`` of the ``wrt`` variables.
    Changes ``f`` makes to other model state (batch statistics, RNG counts) are not written back: a
    language model's loss has none.
    """

    def wrapped(model: nnx.Module, *args: PyTree) -> PyTree:
        graphdef, params, rest = nnx.split(model, wrt, ...)

        def pure(p: nnx.State, *a: PyTree) -> PyTree:  # the loss value, or (value, aux)
            return f(nnx.merge(graphdef, p, rest), *a)

        return _value_and_grad(pure, has_aux=has_aux)(params, *args)

    return wrapped


def functional(train_step: Callable[..., Metrics], *objects: nnx.Object) -> tuple[TrainStep, State]:
    """A stateful NNX step as the pure step autoshard runs, and its state.

    Args:
      train_step: ``train_step(*objects, batch) -> metrics`` that updates ``objects`` in place (an
        ``nnx.jit``-decorated function is unwrapped: autoshard compiles the step itself).
      objects: the NNX objects it takes, e.g. ``model, optimizer``.
    Returns:
      ``(step, state)``: ``step(state, batch) -> (state, metrics)`` and ``nnx.state(objects)``.
    """
    # nnx.jit keeps the undecorated function as __wrapped__ (functools.wraps); a jit inside would trace the
    # parameters anew, and autoshard compiles the whole step anyway.
    inner = getattr(train_step, "__wrapped__", train_step)
    graphdef, state = nnx.split(objects)

    def step(state: State, batch: Batch) -> tuple[State, Metrics]:
        objs = nnx.merge(graphdef, state)
        metrics = inner(*objs, batch)
        return nnx.state(objs), metrics

    return step, state


__all__ = ["functional", "value_and_grad"]
