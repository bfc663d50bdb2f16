"""mistjax.tune: the tuner (Mist §5): search space, intra-stage Pareto sampling, inter-stage MILP.

The package is callable: ``mistjax.tune(workload, cluster)`` is `mistjax.tune.tuner.tune`, and the
submodules stay reachable as ``mistjax.tune.space`` etc.
"""

import sys
import types
from typing import Any

from mistjax.tune.baselines import ABLATION_STEPS, BASELINES, ablation_spaces, baseline_spaces
from mistjax.tune.milp import (
    InterStageSolution,
    brute_force_inter_stage,
    default_layer_options,
    pipeline_objective,
    solve_inter_stage,
)
from mistjax.tune.pareto import ParetoSample, pareto_mask, sample_pareto
from mistjax.tune.space import OuterKey, SearchSpace
from mistjax.tune.tuner import SearchResult, TunedPlan, TuneResult, search, tune

__all__ = [
    "ABLATION_STEPS",
    "BASELINES",
    "InterStageSolution",
    "OuterKey",
    "ParetoSample",
    "SearchResult",
    "SearchSpace",
    "TuneResult",
    "TunedPlan",
    "ablation_spaces",
    "baseline_spaces",
    "brute_force_inter_stage",
    "default_layer_options",
    "pareto_mask",
    "pipeline_objective",
    "sample_pareto",
    "search",
    "solve_inter_stage",
    "tune",
]


class _CallableModule(types.ModuleType):
    """Lets ``mistjax.tune(...)`` call the tuner while ``mistjax.tune`` stays the package."""

    def __call__(self, *args: Any, **kwargs: Any) -> TuneResult:
        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
