"""mistjax.tune: intra-stage Pareto sampling and the inter-stage MILP (Mist §5)."""

from mistjax.tune.milp import (
    InterStageSolution,
    brute_force_inter_stage,
    default_layer_options,
    pipeline_objective,
    solve_inter_stage,
)
from mistjax.tune.pareto import ParetoSample, pareto_mask, sample_pareto

__all__ = [
    "InterStageSolution",
    "ParetoSample",
    "brute_force_inter_stage",
    "default_layer_options",
    "pareto_mask",
    "pipeline_objective",
    "sample_pareto",
    "solve_inter_stage",
]
