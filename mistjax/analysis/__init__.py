"""mistjax.analysis: symbolic per-device costs of a model's pre / block / post parts.

``analyze_model(loss, params)`` traces the loss at a few sizes and returns a `ModelProfile` of
sympy expressions in ``b`` (micro-batch per device), ``s`` (sequence length) and ``t``
(tensor-parallel degree): FLOPs per phase, weight bytes, residual bytes per remat policy,
liveness peaks, and Megatron tensor/sequence-parallel collectives. ``compile_profile`` turns
them into one vectorised NumPy function for the tuner. ``flop_count`` counts a jaxpr's FLOPs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name -> the module defining it. Imported on first use: the runtime imports the sympy-free modules
# (graph, layout, tp, block) and must not pay for sympy, which `analyze`, `compiled` and `profile` need.
_EXPORTS = {
    "DEFAULT_POINTS": "analyze", "analyze_model": "analyze", "block_tags": "analyze", "token_batch": "analyze",
    "analysis_points": "analyze", "first_trace": "analyze", "FixedLengthWarning": "analyze",
    "CompiledProfile": "compiled", "compile_profile": "compiled", "part_values": "compiled",
    "FlopCount": "flops", "flop_count": "flops",
    "Graph": "graph", "StructureError": "graph", "build_graph": "graph",
    "Partial": "layout", "Shard": "layout", "constrain_graph": "layout", "partition_spec": "layout",
    "PartFn": "parts", "VjpTrace": "parts", "split_parts": "parts", "vjp_jaxprs": "parts",
    "SYMBOLS": "poly", "B": "poly", "S": "poly", "T": "poly", "FitError": "poly",
    "Collective": "profile", "ModelProfile": "profile", "PartProfile": "profile", "tp_gate": "profile",
    "propagate": "tp",
}

if TYPE_CHECKING:
    from mistjax.analysis.analyze import (
        DEFAULT_POINTS,
        FixedLengthWarning,
        analysis_points,
        analyze_model,
        block_tags,
        first_trace,
        token_batch,
    )
    from mistjax.analysis.compiled import CompiledProfile, compile_profile, part_values
    from mistjax.analysis.flops import FlopCount, flop_count
    from mistjax.analysis.graph import Graph, StructureError, build_graph
    from mistjax.analysis.layout import Partial, Shard, constrain_graph, partition_spec
    from mistjax.analysis.parts import PartFn, VjpTrace, split_parts, vjp_jaxprs
    from mistjax.analysis.poly import SYMBOLS, B, FitError, S, T
    from mistjax.analysis.profile import Collective, ModelProfile, PartProfile, tp_gate
    from mistjax.analysis.tp import propagate


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "B",
    "DEFAULT_POINTS",
    "S",
    "SYMBOLS",
    "T",
    "Collective",
    "CompiledProfile",
    "FitError",
    "FixedLengthWarning",
    "FlopCount",
    "Graph",
    "ModelProfile",
    "Partial",
    "PartFn",
    "PartProfile",
    "Shard",
    "StructureError",
    "VjpTrace",
    "analysis_points",
    "analyze_model",
    "block_tags",
    "build_graph",
    "compile_profile",
    "constrain_graph",
    "first_trace",
    "flop_count",
    "part_values",
    "partition_spec",
    "propagate",
    "split_parts",
    "token_batch",
    "tp_gate",
    "vjp_jaxprs",
]
