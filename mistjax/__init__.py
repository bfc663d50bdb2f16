"""mistjax: automatic memory/parallelism co-optimisation for LLM training on JAX.

Reimplements Mist (EuroSys'25) and MiCS (VLDB'22) on JAX/Flax. See README.md and docs/.
"""

from typing import Any

from mistjax import _platform

_platform.choose()  # before anything imports jax: the CPU platform, quietly, on a machine without a GPU driver

from mistjax.api import autoshard, grad, value_and_grad  # noqa: E402
from mistjax.api import nnx as nnx  # noqa: E402  NNX idioms: mistjax.nnx.value_and_grad, mistjax.nnx.functional
from mistjax.api.precision import with_master_weights  # noqa: E402
from mistjax.plan import Plan, PlanError, Prediction, StagePlan, uniform_plan  # noqa: E402
from mistjax.runtime.checks import StepError  # noqa: E402
from mistjax.runtime.report import NoOpWarning  # noqa: E402

__version__ = "0.1.0"

__all__ = ["autoshard", "grad", "nnx", "value_and_grad", "with_master_weights", "Plan", "PlanError", "Prediction",
           "StagePlan", "uniform_plan", "StepError", "NoOpWarning", "tune", "SearchSpace", "TuneResult", "analyze",
           "Workload", "Cluster", "Checkpointer", "CheckpointError"]


def __getattr__(name: str) -> Any:
    # The tuner pulls in cvxpy: import it on first use. `mistjax.tune` is the function; the package is
    # `mistjax.tuning` (a different name, so that importing a submodule never shadows the function).
    if name in ("tune", "SearchSpace", "TuneResult"):
        import mistjax.tuning as tuning

        return getattr(tuning, name)
    # The cost model pulls in sympy (symbolic analysis): also imported on first use.
    if name in ("analyze", "Workload"):
        import mistjax.cost as cost_pkg

        return getattr(cost_pkg, name)
    # Checkpoints pull in orbax and TensorStore.
    if name in ("Checkpointer", "CheckpointError"):
        import mistjax.train.checkpoint as checkpoint

        return getattr(checkpoint, name)
    if name == "Cluster":
        from mistjax.hardware import Cluster

        return Cluster
    raise AttributeError(f"module 'mistjax' has no attribute {name!r}")
