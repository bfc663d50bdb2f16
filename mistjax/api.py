"""The public entry points: `autoshard`, `value_and_grad`, `grad`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from mistjax.plan import Plan
from mistjax.runtime.context import active_handler
from mistjax.runtime.step import ShardedStep, TrainStep


def value_and_grad(fun: Callable[..., Any], argnums: int = 0, has_aux: bool = False) -> Callable[..., Any]:
    """Drop-in for `jax.value_and_grad` that lets `autoshard` plan the gradient computation.

    Outside `autoshard` it is exactly `jax.value_and_grad`. Inside, the differentiated loss is
    handed to the runtime, which splits the batch into micro-batches, runs the plan's layer loop
    (remat, ZeRO gathers) or pipeline schedule, and synchronises gradients as the plan says.
    Only ``argnums=0`` (the parameters) is supported inside `autoshard`.
    """

    def wrapped(*args: Any) -> Any:
        handler = active_handler()
        if handler is None:
            return jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(*args)
        if argnums != 0:
            raise ValueError("inside mistjax.autoshard, value_and_grad differentiates the first "
                             "argument (the parameters) only; move the parameters first")
        return handler.value_and_grad(fun, has_aux, args)

    return wrapped


def grad(fun: Callable[..., Any], argnums: int = 0, has_aux: bool = False) -> Callable[..., Any]:
    """Drop-in for `jax.grad`; see `value_and_grad`."""
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    def wrapped(*args: Any) -> Any:
        out, g = vg(*args)
        return (g, out[1]) if has_aux else g

    return wrapped


def autoshard(train_step: TrainStep, mesh: Any = None, *, plan: Plan | str | Path | None = None,
              **tune_options: Any) -> ShardedStep:
    """Run `train_step(state, batch) -> (state, metrics)` with a distributed-training plan.

    Args:
      train_step: an ordinary JAX train step; compute gradients with `mistjax.value_and_grad`
        to allow micro-batching, pipelining and per-layer remat.
      mesh: the devices mistjax may use (a `jax.sharding.Mesh`, whose axis names may describe the
        topology such as ``("node", "gpu")``, or a list of devices). Defaults to all devices.
      plan: a `Plan` or the path of a saved plan to apply as is.
      **tune_options: options for the tuner when no plan is given.
    Returns:
      A `ShardedStep` with ``place(state)``, ``__call__(state, batch)``, ``lower(...)`` and ``plan``.
    """
    if plan is None:
        raise NotImplementedError("autoshard without a plan needs the tuner; pass plan=... for now")
    if isinstance(plan, str | Path):
        plan = Plan.load(plan)
    return ShardedStep(train_step, mesh, plan)
