"""The baselines (Megatron-LM, ZeRO-3/FSDP, MiCS, Mist's own space) and the ablation steps, as search
spaces on the same tuner and cost model (docs/internals.md).
"""

from __future__ import annotations

from mistjax.tuning.space import SearchSpace

__all__ = ["ABLATION_STEPS", "BASELINES", "ablation_spaces", "baseline_spaces"]

BASELINES: tuple[str, ...] = ("megatron", "zero3-fsdp", "mics", "mist")
ABLATION_STEPS: tuple[str, ...] = ("3d", "+zero23", "+ckpt", "+offload", "+imbalance", "+mics+policies")

_NO_OFFLOAD = {"weight_offload": (0.0,), "grad_offload": (0.0,), "opt_offload": (0.0,), "act_offload": (0.0,)}


def baseline_spaces(names: tuple[str, ...] | None = None) -> dict[str, SearchSpace]:
    """The named baseline spaces (all of `BASELINES` by default)."""
    spaces = {"megatron": SearchSpace.megatron(), "zero3-fsdp": SearchSpace.fsdp(), "mics": SearchSpace.mics_only(),
              "mist": SearchSpace.mist()}
    names = BASELINES if names is None else names
    unknown = [n for n in names if n not in spaces]
    if unknown:
        raise ValueError(f"unknown baselines {unknown}; valid names: {', '.join(BASELINES)}")
    return {n: spaces[n] for n in names}


def ablation_spaces() -> dict[str, SearchSpace]:
    """The cumulative ablation steps, in order (`ABLATION_STEPS`)."""
    base = SearchSpace.mist().replace(zero_levels=(1,), remat="all", pareto_k=1, **_NO_OFFLOAD)
    steps = [base.replace(name="3d")]
    steps.append(steps[-1].replace(name="+zero23", zero_levels=(1, 2, 3)))
    steps.append(steps[-1].replace(name="+ckpt", remat="tune"))
    offload = {k: getattr(SearchSpace(), k) for k in _NO_OFFLOAD}
    steps.append(steps[-1].replace(name="+offload", **offload))
    steps.append(steps[-1].replace(name="+imbalance", pareto_k=SearchSpace().pareto_k))
    steps.append(SearchSpace.full().replace(name="+mics+policies"))
    return {s.name: s for s in steps}
