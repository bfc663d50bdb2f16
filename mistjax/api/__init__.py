"""The public entry points: `autoshard`, `tune`, `value_and_grad`, `grad`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh

from mistjax.core.plan import Plan
from mistjax.core.strategies import CostModel
from mistjax.core.types import LossFn, PyTree, TrainStep
from mistjax.runtime.context import active_handler
from mistjax.runtime.step import AxisRules, PlannedStep, ShardedStep

if TYPE_CHECKING:  # the tuner imports cvxpy, the cost model sympy; keep `import mistjax` light until a plan is tuned
    from mistjax.cost.workload import Workload
    from mistjax.hardware.presets import ClusterSpec
    from mistjax.tuning.space import SearchSpace
    from mistjax.tuning.tuner import TuneResult


def tune(workload: Workload, cluster: ClusterSpec, **options: Any) -> TuneResult:  # options: see tuner.tune
    """Tune a plan offline (no devices needed); see `mistjax.tuning.tuner.tune` for the options."""
    from mistjax.tuning.tuner import tune as run

    return run(workload, cluster, **options)


def value_and_grad(fun: LossFn, argnums: int = 0, has_aux: bool = False) -> Callable[..., PyTree]:
    """Drop-in for `jax.value_and_grad` that lets `autoshard` plan the gradient computation.

    Outside `autoshard` it is exactly `jax.value_and_grad`. Inside, the differentiated loss is
    handed to the runtime, which splits the batch into micro-batches, runs the plan's layer loop
    (remat, ZeRO gathers) or pipeline schedule, and synchronises gradients as the plan says.
    Only ``argnums=0`` (the parameters) is supported inside `autoshard`.
    """

    def wrapped(*args: PyTree) -> PyTree:
        handler = active_handler()
        if handler is None:
            return jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(*args)
        if argnums != 0:
            raise ValueError("inside mistjax.autoshard, value_and_grad differentiates the first "
                             "argument (the parameters) only; move the parameters first")
        return handler.value_and_grad(fun, has_aux, args)

    return wrapped


def grad(fun: LossFn, argnums: int = 0, has_aux: bool = False) -> Callable[..., PyTree]:
    """Drop-in for `jax.grad`; see `value_and_grad`."""
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    def wrapped(*args: PyTree) -> PyTree:
        out, g = vg(*args)
        return (g, out[1]) if has_aux else g

    return wrapped


def autoshard(train_step: TrainStep, mesh: Mesh | Sequence[jax.Device] | None = None, *,
              plan: Plan | str | Path | None = None, hardware: ClusterSpec | str | None = None,
              global_batch: int | None = None, memory_budget: float | None = None,
              cache_dir: str | Path | None = None, space: SearchSpace | None = None, time_limit: float = 60.0,
              workload: Workload | None = None, baselines: tuple[str, ...] | None = None,
              cost: CostModel | None = None, axis_rules: AxisRules | None = None, verbose: bool = True
              ) -> PlannedStep:
    """Run `train_step(state, batch) -> (state, metrics)` with a distributed-training plan.

    With ``plan`` the plan is applied as is. Without one, the first ``step.place(state, batch)`` or
    ``step(state, batch)`` traces the step, builds the workload, tunes a plan for the mesh (or
    loads it from ``cache_dir``), then compiles and runs it; ``step.plan.summary()`` shows the plan
    and its prediction next to the best baseline's, ``step.result`` the whole `TuneResult`.

    Args:
      train_step: an ordinary JAX train step; compute gradients with `mistjax.value_and_grad`
        to allow micro-batching, pipelining and per-layer remat.
      mesh: the devices mistjax may use (a `jax.sharding.Mesh`, whose axis names may describe the
        topology such as ``("node", "gpu")``, or a list of devices). Defaults to all devices.
      plan: a `Plan` or the path of a saved plan to apply as is.
      hardware: what to tune for: a preset name (``"a100-40gb"``), a spec (``"a100-40gb:4x8"``),
        a `ClusterSpec`, or None to detect it from the devices (``cpu`` on the host platform).
      global_batch: sequences per step (default: the leading dimension of the first batch).
      memory_budget: bytes a device may use (default: the preset's / device's budget).
      cache_dir: directory of tuned plans (JSON, keyed by model, mesh, hardware, batch and space
        fingerprints); a hit skips the search.
      space: the search space (default: mistjax's full space).
      time_limit: seconds for the search.
      workload: the cost model's `Workload`, if the step's model cannot be recognised.
      baselines: baselines to compare with (default: all).
      cost: the cost model (default `mistjax.cost.COST_MODEL`, the interface `mistjax.core.strategies.CostModel`).
      axis_rules: MaxText-style logical-axis rules, ``[("mlp", "tensor"), ("heads", "tensor"), ("embed", None)]``:
        names mapped to ``tensor`` are split by tensor parallelism, others stay whole. Without rules the
        model's own names count (heads, kv_heads, mlp, vocab); without any names, Megatron's column / row
        pairs are inferred from the layer's dataflow.
      verbose: without a plan, print what the first call does (analysis, tuning and how long) to stderr.
    Returns:
      A `PlannedStep`: a `ShardedStep` (with ``plan``) or, without a plan, an `AutoShardedStep` (tuned on
      the first ``place`` / call) with the same methods, for one stage or a pipeline alike:
      ``place(state, batch)``, ``__call__(state, batch)``, ``gather(state)``, ``compile_stages(state,
      batch)``, ``lower(state, batch)`` (one-stage plans), ``report()``, ``summary()`` and ``plan``.
    """
    if plan is None:
        from mistjax.api.tuned_step import AutoShardedStep  # deferred: pulls in the tuner and cost model

        return AutoShardedStep(train_step, mesh, hardware=hardware, global_batch=global_batch,
                               memory_budget=memory_budget, cache_dir=cache_dir, space=space, time_limit=time_limit,
                               workload=workload, baselines=baselines, cost=cost, axis_rules=axis_rules,
                               verbose=verbose)
    if isinstance(plan, str | Path):
        plan = Plan.load(plan)
    return ShardedStep(train_step, mesh, plan, axis_rules=axis_rules)


__all__ = ["autoshard", "grad", "tune", "value_and_grad"]
