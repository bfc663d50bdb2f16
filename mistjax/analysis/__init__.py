"""mistjax.analysis: symbolic per-device costs of a model's pre / block / post parts.

``analyze_model(loss, params)`` traces the loss at a few sizes and returns a `ModelProfile` of
sympy expressions in ``b`` (micro-batch per device), ``s`` (sequence length) and ``t``
(tensor-parallel degree): FLOPs per phase, weight bytes, residual bytes per remat policy,
liveness peaks, and Megatron tensor/sequence-parallel collectives. ``compile_profile`` turns
them into one vectorised NumPy function for the tuner. ``flop_count`` counts a jaxpr's FLOPs.
"""

from mistjax.analysis.analyze import DEFAULT_POINTS, analyze_model, block_tags, token_batch
from mistjax.analysis.compiled import CompiledProfile, compile_profile, part_values
from mistjax.analysis.flops import FlopCount, flop_count
from mistjax.analysis.graph import Graph, StructureError, build_graph
from mistjax.analysis.layout import Partial, Shard, constrain_graph, partition_spec
from mistjax.analysis.parts import PartFn, VjpTrace, split_parts, vjp_jaxprs
from mistjax.analysis.poly import SYMBOLS, FitError
from mistjax.analysis.profile import Collective, ModelProfile, PartProfile, tp_gate
from mistjax.analysis.tp import propagate

B, S, T = SYMBOLS

__all__ = [
    "B",
    "DEFAULT_POINTS",
    "S",
    "SYMBOLS",
    "T",
    "Collective",
    "CompiledProfile",
    "FitError",
    "FlopCount",
    "Graph",
    "ModelProfile",
    "Partial",
    "PartFn",
    "PartProfile",
    "Shard",
    "StructureError",
    "VjpTrace",
    "analyze_model",
    "block_tags",
    "build_graph",
    "compile_profile",
    "constrain_graph",
    "flop_count",
    "part_values",
    "partition_spec",
    "propagate",
    "split_parts",
    "token_batch",
    "tp_gate",
    "vjp_jaxprs",
]
