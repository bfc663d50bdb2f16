"""mistjax: automatic memory/parallelism co-optimisation for LLM training on JAX.

Reimplements Mist (EuroSys'25) and MiCS (VLDB'22) on JAX/Flax. See README.md and docs/.
"""

from mistjax.api import autoshard, grad, value_and_grad
from mistjax.plan import Plan, PlanError, Prediction, StagePlan, uniform_plan

__version__ = "0.1.0"

__all__ = ["autoshard", "grad", "value_and_grad", "Plan", "PlanError", "Prediction", "StagePlan",
           "uniform_plan"]
