"""The symbolic profile of a model: per part (pre / block / post) costs as sympy expressions.

All quantities are per device, as exact expressions in ``b`` (micro-batch per device), ``s``
(sequence length) and ``t`` (tensor-parallel degree, Megatron-style with sequence parallelism
when ``t > 1``). See `mistjax.analysis.analyze` for how they are derived and which are exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import sympy as sp

from mistjax.analysis.poly import B, S, T

if TYPE_CHECKING:  # neither imports this module (the analysis builds profiles, the kernels are read by them)
    from mistjax.analysis.graph import Graph
    from mistjax.analysis.kernels import PassKernels
    from mistjax.analysis.tp import TPResult


class AnalysedPass(Protocol):
    """One analysed pass as `ModelProfile.passes` holds it (a `mistjax.analysis.analyze.PassAnalysis`): typed
    structurally so that this module, which the analysis imports, does not import it back."""

    @property
    def g(self) -> Graph: ...

    @property
    def res(self) -> TPResult: ...


COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
PHASES = ("fwd", "bwd")


def tp_gate(x: sp.Expr) -> sp.Expr:
    """``x`` when ``t > 1``, else 0: no tensor-parallel collective runs on one device."""
    x = sp.sympify(x)
    return sp.Integer(0) if x == 0 else sp.Piecewise((0, sp.Eq(T, 1)), (x, True))


@dataclass(frozen=True)
class Collective:
    """One tensor-parallel collective of a part (per micro-batch pass).

    Attributes:
      kind: ``all-gather`` | ``reduce-scatter`` | ``all-reduce`` | ``all-to-all`` (HLO spelling).
      phase: ``fwd`` or ``bwd``.
      nbytes: full (unsharded) buffer bytes -- the all-gather output, the reduce-scatter or
        all-reduce input -- the convention of `mistjax.cost.collectives`; the collective runs
        over the ``t`` devices of the tensor group, only when ``t > 1``.
      count: how many times it runs per pass (a loop trip count; usually 1).
      dtype: element type as computed (XLA:CPU widens bf16 collectives to f32; GPUs do not).
      shape: full shape.
      where: the primitive that needed it (``output``: the part's output layout).
      summands: for a reduction, how many partial matmul results Megatron sums locally before
        it; GSPMD instead reduces each of them separately (``summands`` x the traffic).
    """

    kind: str
    phase: str
    nbytes: sp.Expr
    count: sp.Expr
    dtype: str
    shape: tuple[sp.Expr, ...]
    where: str
    summands: int = 1

    @property
    def result_bytes(self) -> sp.Expr:
        """Bytes of the per-device result (what the HLO shows): RS output is ``nbytes / t``."""
        return self.nbytes / T if self.kind == "reduce-scatter" else self.nbytes


@dataclass(frozen=True)
class PartProfile:
    """Costs of one part for one device (one layer for ``block``). Expressions in b, s, t.

    Policies: ``none`` (no remat) plus the remat policies analysed (``full``, ``dots``,
    ``names:a,b``; see `mistjax.runtime.remat.remat_policy`).

    Attributes:
      name: ``pre``, ``block`` or ``post``.
      fwd_flops / bwd_flops: training forward (``jax.vjp``'s forward) and backward (input and
        weight gradients) without remat; transcendentals count 1 each.
      fwd_matmul_flops / bwd_matmul_flops: the ``dot_general`` share of the above.
      recompute_flops: per policy, extra FLOPs a checkpointed layer runs (fwd + bwd under the
        policy minus fwd + bwd without remat); 0 for ``none``.
      weight_bytes / weight_params: parameters of the part on one device (tensor-split dims
        divided by t), bytes in the stored dtype.
      saved_bytes: per policy, residual bytes the layer keeps for its backward: what ``jax.vjp``
        of ``jax.checkpoint(part, policy)`` really keeps, minus the weights (and batch
        constants), distinct buffers once; includes the layer input if it is kept.
      stash_bytes: per policy, what a deferred weight-gradient pass reads of its input-gradient pass under a
        zero-bubble schedule (the gradients at the weight matmuls' outputs, values the policy recomputed).
      fwd_peak_bytes / bwd_peak_bytes: per policy, transient peak within the part's forward /
        backward by last-use liveness, excluding its inputs (weights, layer input, residuals,
        cotangents) and weight gradients; includes outputs, residuals produced and
        collective buffers.
      output_bytes: the part's output (the hidden state; the loss for ``post``).
      tp_collectives: collectives without remat, forward and backward.
      tp_recompute: per policy, kind -> extra collective bytes (``nbytes`` x count) a
        checkpointed layer issues when it recomputes (e.g. the reduce-scatter after the attention
        output projection; the re-gathered input is shared with the weight-gradient gather).
      tp_divisors: sizes ``t`` must divide (heads, kv heads, MLP width, vocabulary, and the
        sequence length under sequence parallelism).
      notes: anything the analysis approximated.
      fused_flops / fused_matmul_flops: of the forward + backward FLOPs (no remat), those inside
        fused-attention kernels (`mistjax.analysis.fused`: the blockwise kernel's named jits, cuDNN's
        primitives), all of it / the matmul share; a cost model may price them as one kernel.
      fused_bytes: bytes those kernels read and write (q, k, v, o, lse; backward also dO, dq, dk,
        dv): their memory traffic as single kernels.
      kernels: per pass, ``fwd[policy]`` / ``bwd[policy]`` -> `mistjax.analysis.kernels.PassKernels`: the
        GEMMs by shape, the bytes and count of the fusion kernels and the fused-attention calls a GPU
        compiler makes of the pass (the time model prices these; `mistjax.analysis.kernels`).
    """

    name: str
    fwd_flops: sp.Expr
    bwd_flops: sp.Expr
    fwd_matmul_flops: sp.Expr
    bwd_matmul_flops: sp.Expr
    recompute_flops: Mapping[str, sp.Expr]
    weight_bytes: sp.Expr
    weight_params: sp.Expr
    saved_bytes: Mapping[str, sp.Expr]
    stash_bytes: Mapping[str, sp.Expr]
    fwd_peak_bytes: Mapping[str, sp.Expr]
    bwd_peak_bytes: Mapping[str, sp.Expr]
    output_bytes: sp.Expr
    tp_collectives: tuple[Collective, ...]
    tp_recompute: Mapping[str, Mapping[str, sp.Expr]]
    tp_divisors: tuple[sp.Expr, ...]
    notes: tuple[str, ...] = ()
    fused_flops: sp.Expr = sp.Integer(0)
    fused_matmul_flops: sp.Expr = sp.Integer(0)
    fused_bytes: sp.Expr = sp.Integer(0)
    kernels: Mapping[str, PassKernels] = field(default_factory=dict, compare=False)

    @property
    def policies(self) -> tuple[str, ...]:
        return tuple(self.saved_bytes)

    def tp_bytes(self, kind: str | None = None, phase: str | None = None) -> sp.Expr:
        """Total ``nbytes`` x count of the matching collectives, 0 when ``t == 1``."""
        total = sp.Add(
            *[
                c.nbytes * c.count
                for c in self.tp_collectives
                if (kind is None or c.kind == kind) and (phase is None or c.phase == phase)
            ]
        )
        return tp_gate(total)

    def tp_calls(self, kind: str | None = None, phase: str | None = None) -> sp.Expr:
        """Number of matching collective calls (for latency terms), 0 when ``t == 1``."""
        total = sp.Add(
            *[
                c.count
                for c in self.tp_collectives
                if (kind is None or c.kind == kind) and (phase is None or c.phase == phase)
            ]
        )
        return tp_gate(total)

    def expressions(self) -> dict[str, sp.Expr]:
        """Every quantity as a flat ``name -> expression`` dict (the keys `compile_profile` uses)."""
        out: dict[str, sp.Expr] = {
            "fwd_flops": self.fwd_flops,
            "bwd_flops": self.bwd_flops,
            "fwd_matmul_flops": self.fwd_matmul_flops,
            "bwd_matmul_flops": self.bwd_matmul_flops,
            "weight_bytes": self.weight_bytes,
            "weight_params": self.weight_params,
            "output_bytes": self.output_bytes,
            "fused_flops": self.fused_flops,
            "fused_matmul_flops": self.fused_matmul_flops,
            "fused_bytes": self.fused_bytes,
        }
        for pol in self.policies:
            out[f"saved_bytes[{pol}]"] = self.saved_bytes[pol]
            out[f"stash_bytes[{pol}]"] = self.stash_bytes[pol]
            out[f"fwd_peak_bytes[{pol}]"] = self.fwd_peak_bytes[pol]
            out[f"bwd_peak_bytes[{pol}]"] = self.bwd_peak_bytes[pol]
            out[f"recompute_flops[{pol}]"] = self.recompute_flops[pol]
            for kind in COLLECTIVE_KINDS:
                extra = self.tp_recompute.get(pol, {}).get(kind, sp.Integer(0))
                out[f"tp_recompute[{pol}].{kind}"] = tp_gate(extra)
        for kind in COLLECTIVE_KINDS:
            for phase in PHASES:
                out[f"tp.{kind}.{phase}"] = self.tp_bytes(kind, phase)
                out[f"tp_calls.{kind}.{phase}"] = self.tp_calls(kind, phase)
        return out


@dataclass(frozen=True)
class ModelProfile:
    """The three parts of a model with a layer stack, plus what the analysis was run with.

    Attributes:
      pre / block / post: the part profiles (``block`` is ONE layer).
      num_layers: layers in the stack.
      points: the ``(b, s)`` sizes traced (six fit points, then the check point).
      sequence_parallel: whether TP quantities assume Megatron sequence parallelism.
      tags: checkpoint names found in the block (usable in ``names:`` policies).
      passes: part -> policy -> (forward, backward) `mistjax.analysis.analyze.PassAnalysis`: the
        analysed graphs traced at ``points[0]`` with their tensor-parallel layouts (e.g. for
        `mistjax.analysis.tp.constrain_graph`); not part of equality or repr.
    """

    pre: PartProfile
    block: PartProfile
    post: PartProfile
    num_layers: int
    points: tuple[tuple[int, int], ...]
    sequence_parallel: bool = True
    tags: tuple[str, ...] = ()
    symbols: tuple[sp.Symbol, sp.Symbol, sp.Symbol] = field(default=(B, S, T))
    passes: Mapping[str, Mapping[str, tuple[AnalysedPass, AnalysedPass]]] | None = field(
        default=None, compare=False, repr=False
    )

    @property
    def parts(self) -> dict[str, PartProfile]:
        return {"pre": self.pre, "block": self.block, "post": self.post}

    def expressions(self) -> dict[str, sp.Expr]:
        """``"part.quantity" -> expression`` for every part (see `PartProfile.expressions`)."""
        return {f"{name}.{k}": v for name, part in self.parts.items() for k, v in part.expressions().items()}
