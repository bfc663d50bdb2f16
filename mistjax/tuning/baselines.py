"""The systems mistjax is compared with, each priced as it runs, and their search spaces (docs/internals.md).

A `SystemRecord` is the one place that says how a training system stores the train state (16-bit weights with an
fp32 master copy, or fp32 weights; the dtype it accumulates and reduces gradients in) and which kernels its model
code runs (eager or fused elementwise chains, the rotary fraction). The evaluation grid prices each baseline's
search space with its record (`scripts/reproduce_paper.py`), and `mistjax.validate.published` prices each
published run of that system with the same record, so a baseline's plans cost what its measured runs cost.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from mistjax.tuning.space import SearchSpace

__all__ = ["ABLATION_STEPS", "BASELINES", "GRID_PRECISION", "SYSTEMS", "Storage", "SystemRecord", "WeightStorage",
           "ablation_spaces", "baseline_spaces", "baseline_system", "system_named"]

BASELINES: tuple[str, ...] = ("megatron", "zero3-fsdp", "mics", "mist")
ABLATION_STEPS: tuple[str, ...] = ("3d", "+zero23", "+ckpt", "+offload", "+imbalance", "+mics+policies")

# The precision Mist's evaluation grid trains in (the artifact's Megatron-LM --fp16, Mist params_dtype=float16,
# DeepSpeed fp16): every system of the grid is priced at it, each storing the state as its record says.
GRID_PRECISION = "fp16"

_NO_OFFLOAD = {"weight_offload": (0.0,), "grad_offload": (0.0,), "opt_offload": (0.0,), "act_offload": (0.0,)}

# Leading word of a run's precision -> the dtype its matmuls run in (fp16 has bf16's sizes and speed; fp8: bf16
# training whose projections run as FP8 GEMMs).
COMPUTE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "bfloat16", "fp8": "bfloat16"}


class WeightStorage(enum.StrEnum):
    """How a system keeps the weights of a 16-bit run."""

    SIXTEEN_BIT_MASTER = "16-bit+master"  # 16-bit weights; the optimizer state holds an fp32 master copy
    FP32 = "fp32"  # fp32 weights, cast to the compute dtype inside the layers; no master copy


class Storage(NamedTuple):
    """The dtypes a system's train state is priced with (`models.workload`'s arguments)."""

    compute_dtype: str  # the matmuls' dtype
    param_dtype: str  # the stored weights' dtype
    master_weights: bool  # the optimizer state holds an fp32 copy of every weight
    grad_dtype: str | None  # the dtype gradients are accumulated and reduced in (None: the weights')


@dataclass(frozen=True)
class SystemRecord:
    """A training system as it runs: state storage, kernels, and where that is documented.

    Attributes:
      name: key in `SYSTEMS`.
      label: the system and version the record describes.
      weights: how a 16-bit run stores weights (`WeightStorage`); an fp32 run stores fp32 weights everywhere.
      fp32_grads: 16-bit runs whose precision is in this set accumulate and reduce gradients in fp32.
      elementwise: ``eager`` (RMSNorm, rotary, SwiGLU as one framework op each) or ``fused``.
      whole_head_rotary: a rotary model rotates the whole head (Megatron-LM's ``--rotary-percent`` default 1.0).
      source: where these facts come from.
    """

    name: str
    label: str
    weights: WeightStorage
    fp32_grads: frozenset[str]
    elementwise: str
    whole_head_rotary: bool
    source: str

    def storage(self, precision: str) -> Storage:
        """The dtypes of a run at ``precision`` (fp32 / bf16 / fp16 / fp8, the leading word of a run's record)."""
        if precision not in COMPUTE_DTYPES:
            raise ValueError(f"precision {precision!r}: use one of {', '.join(COMPUTE_DTYPES)}")
        compute = COMPUTE_DTYPES[precision]
        if compute == "float32" or self.weights == WeightStorage.FP32:
            return Storage(compute, "float32", False, None)
        return Storage(compute, compute, True, "float32" if precision in self.fp32_grads else None)


_16 = WeightStorage.SIXTEEN_BIT_MASTER
SYSTEMS: dict[str, SystemRecord] = {r.name: r for r in (
    SystemRecord("megatron", "Megatron-LM (core_r0.4.0, the Mist artifact's pin; the SP paper's runs)", _16,
                 frozenset({"bf16", "fp8"}), "eager", True,
                 "--fp16 / --bf16 keep 16-bit params and an fp32 main copy in the distributed optimizer; --bf16 sets "
                 "--accumulate-allreduce-grads-in-fp32 (megatron/arguments.py); the artifact passes no "
                 "--rotary-percent (1.0) and runs RMSNorm / rotary / SwiGLU as PyTorch ops (megatron/model)"),
    SystemRecord("mist", "Mist runtime (the EuroSys'25 artifact)", _16, frozenset(), "fused", False,
                 "training.params_dtype=float16: fp16 params and grads, fp32 master and Adam moments; a CUDA "
                 "RMSNorm, a Triton rotary, a one-kernel SwiGLU (Mist's README and configs)"),
    SystemRecord("deepspeed", "DeepSpeed 0.12.6 ZeRO-1/2/3 and MiCS (Megatron-DeepSpeed model code)", _16,
                 frozenset(), "fused", False,
                 "fp16 / bf16 engine: 16-bit params and grads, fp32 master and moments partitioned "
                 "(ZeRO paper's 2+2+12 bytes per parameter; MiCS paper section 3)"),
    SystemRecord("torchtitan", "torchtitan (PyTorch FSDP2, DTensor TP)", _16, frozenset({"bf16", "fp8"}), "fused",
                 False, "FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 all-gathered "
                 "weights, fp32 gradient reduce-scatter (torchtitan's mixed_precision_reduce default)"),
    # MaxText stores fp32 weights (weight_dtype float32) and casts them to bf16 inside each layer; XLA's SPMD
    # partitioner runs that convert on the shard, so FSDP gathers bf16 weights and reduce-scatters bf16 weight
    # gradients. The cost model prices gathers in the stored dtype, so the record prices MaxText as 16-bit
    # weights with an fp32 master copy: the same 16 bytes of state per parameter, and the bytes it communicates.
    SystemRecord("maxtext", "MaxText (JAX / XLA:GPU)", _16, frozenset(), "fused", False,
                 "weight_dtype float32, dtype bfloat16 (MaxText's base.yml); bf16 gathers and gradient "
                 "reduce-scatters after XLA's SPMD partitioning"),
    SystemRecord("mistjax", "mistjax (this project; `mistjax.with_master_weights` for 16-bit runs)", _16,
                 frozenset(), "fused", False,
                 "the runtime stores the weights in param_dtype; with_master_weights keeps the fp32 copy in the "
                 "optimizer state; gradients in the weights' dtype unless Plan.grad_dtype says otherwise"),
)}

# Which system runs each baseline's space in the evaluation grid (Mist digest section 6.4).
_BASELINE_SYSTEMS = {"megatron": "megatron", "zero3-fsdp": "deepspeed", "mics": "deepspeed", "mist": "mist"}


def system_named(name: str) -> SystemRecord:
    """The record of a system by its `SYSTEMS` key."""
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    return SYSTEMS[name]


def baseline_system(name: str) -> SystemRecord:
    """The system that runs baseline ``name`` (a `BASELINES` name, or ``mistjax`` for this project's space)."""
    return SYSTEMS[_BASELINE_SYSTEMS.get(name, "mistjax")]


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
    steps.append(SearchSpace.full().replace(name="+mics+policies", tp_overlap=False))  # no TP overlap: not Mist's
    return {s.name: s for s in steps}
