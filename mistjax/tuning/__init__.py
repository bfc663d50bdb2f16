"""mistjax.tuning: the tuner (Mist §5): search space, intra-stage Pareto sampling, inter-stage MILP.

``mistjax.tune(workload, cluster)`` is `mistjax.tuning.tuner.tune`.
"""

from mistjax.tuning.baselines import (
    ABLATION_STEPS,
    BASELINES,
    SYSTEMS,
    SystemRecord,
    ablation_spaces,
    baseline_spaces,
    baseline_system,
)
from mistjax.tuning.milp import (
    InterStageSolution,
    brute_force_inter_stage,
    default_layer_options,
    pipeline_objective,
    solve_inter_stage,
)
from mistjax.tuning.pareto import ParetoSample, pareto_mask, sample_pareto
from mistjax.tuning.space import OuterKey, SearchSpace
from mistjax.tuning.tuner import (
    DEFAULT_WORK_BUDGET,
    SearchResult,
    TunedPlan,
    TuneResult,
    WorkBudget,
    default_workers,
    search,
    tune,
)

__all__ = [
    "DEFAULT_WORK_BUDGET",
    "WorkBudget",
    "ABLATION_STEPS",
    "BASELINES",
    "InterStageSolution",
    "OuterKey",
    "ParetoSample",
    "SearchResult",
    "SearchSpace",
    "SYSTEMS",
    "SystemRecord",
    "TuneResult",
    "TunedPlan",
    "ablation_spaces",
    "baseline_spaces",
    "baseline_system",
    "brute_force_inter_stage",
    "default_layer_options",
    "default_workers",
    "pareto_mask",
    "pipeline_objective",
    "sample_pareto",
    "search",
    "solve_inter_stage",
    "tune",
]

