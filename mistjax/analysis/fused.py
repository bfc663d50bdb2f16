"""Fused attention as one unit of a trace: how the analysis recognises it and prices it.

Two kinds of kernel are recognised (docs/cost_model.md, "Fused attention"):

* A blockwise kernel (`models.attention.blockwise_attention`, or any kernel that follows the same
  protocol): its forward and backward run inside ``jit`` equations named ``fused_attention_fwd_b<B>``
  and ``fused_attention_bwd_b<B>``, ``B`` the keys per block. `mistjax.analysis.graph.build_graph`
  inlines them like any call, so FLOPs (the backward's recompute of QK^T included), residuals (the
  output and the log-sum-exp, O(s)) and tensor-parallel layouts come from the traced kernel itself;
  it tags the nodes with the unit and records the call (`UnitCall`).
* cuDNN flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``): the
  ``dot_product_attention_{fwd,bwd}_wrapper`` primitives stay leaf nodes; `cudnn_flops` prices them
  like the blockwise kernel (same matmul FLOPs, the same per-score elementwise and transcendental
  counts), so that a model is priced the same whether it was traced on a GPU host (cuDNN) or on a CPU
  host (where the same model runs the blockwise kernel).

Memory: the analysis traces at small sequence lengths, where a blockwise kernel has one block of
``s`` keys and its per-block temporaries are ``~ s x s``. Above ``s = B`` they are ``s x B``:
`per_block` rewrites a unit loop's live-set sizes for that regime and
`mistjax.analysis.analyze.PassAnalysis.peak` returns ``Piecewise((traced, s <= B), (rewritten, True))``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jax.extend import core as jex

from mistjax.analysis.poly import ZERO, Mono, Number, Poly
from mistjax.core.jaxpr import Atom, Params, is_var, iter_eqns

UNIT_JIT = re.compile(r"^fused_attention_(fwd|bwd)(?:_b(\d+))?$")
CUDNN_FWD = frozenset({"dot_product_attention_fwd_wrapper", "dot_product_attention_fwd"})
CUDNN_BWD = frozenset({"dot_product_attention_bwd_wrapper", "dot_product_attention_bwd"})
CUDNN = CUDNN_FWD | CUDNN_BWD

# Per attention-score element, the blockwise kernel's elementwise FLOPs (scale, mask select, max, subtract,
# sum; backward: mask select, subtract, dP - D, times P, scale; plus a convert per cast to a 16-bit dtype) and
# one exp each way. cuDNN is priced with the same counts; tests/test_fused_attention.py checks them against
# the traced kernel.
SCORE_ELEMENTWISE = {"fwd": 5, "bwd": 6}
SCORE_CASTS = {"fwd": 1, "bwd": 2}  # p (and dS) cast to the input dtype before their matmuls


@dataclass(frozen=True)
class UnitCall:
    """One fused-attention call in a graph.

    Attributes:
      name: the ``jit`` name or the cuDNN primitive.
      phase: ``fwd`` or ``bwd``.
      block: keys per block of a blockwise kernel; None for cuDNN.
      ins: the graph values it reads (q, k, v; the backward also o, lse, dO).
      outs: the values it writes (o, lse; dq, dk, dv).
    """

    name: str
    phase: str
    block: int | None
    ins: tuple[Atom, ...]
    outs: tuple[Atom, ...]


def unit_of(name: str) -> tuple[str, int | None] | None:
    """``(phase, block)`` when ``name`` (a ``jit`` name or a primitive) is a fused-attention kernel."""
    if name in CUDNN:
        return ("fwd" if name in CUDNN_FWD else "bwd"), None
    m = UNIT_JIT.match(name)
    if m is None:
        return None
    return m.group(1), (int(m.group(2)) if m.group(2) else None)


class BlockSizeError(ValueError):
    """A blockwise kernel's block count is not a polynomial of the traced sequence lengths."""


def check_blocks(closed: jex.ClosedJaxpr, seq_lens: Sequence[int]) -> None:
    """Refuse a blockwise kernel whose block count is not a polynomial of the traced sequence lengths.

    The kernel uses ``ceil(s / B)`` key blocks: a fit over ``seq_lens`` is exact when ``B`` divides every
    traced length or is at least the longest one.

    Raises:
      BlockSizeError: naming the block size and the fixes.
    """
    for eqn in iter_eqns(closed, bodies=True):
        m = UNIT_JIT.match(str(eqn.params.get("name", ""))) if "name" in eqn.params else None
        block = int(m.group(2)) if m and m.group(2) else None
        if block and block < max(seq_lens) and any(s % block for s in seq_lens):
            raise BlockSizeError(
                f"the layer block runs a blockwise fused-attention kernel with {block} keys per block; the "
                f"analysis traces sequence lengths {sorted(set(seq_lens))}, where its number of blocks "
                f"(ceil(s / {block})) is not a polynomial in s. Use a block size (ModelConfig.attention_block "
                f"for models/) >= {max(seq_lens)} (default 128) or one dividing every traced length, or pass "
                f"analysis points whose sequence lengths are multiples of {block}")


def cudnn_flops(prim: str, params: Params, ins: Sequence[tuple[Poly, ...]], itemsize: int
                ) -> tuple[Poly, Poly, Poly]:
    """``(matmul, elementwise, transcendental)`` FLOPs of a cuDNN attention primitive (per device).

    Args:
      prim: the primitive name.
      params: its parameters (``layout``: 0 for ``[b, s, heads, d]``, 1 for ``[b, heads, s, d]``).
      ins: per-device shapes of its operands (q, k, v first).
      itemsize: bytes per element of q (16-bit inputs add the blockwise kernel's casts).

    The score matrix is counted whole (``b x heads x s_q x s_k``) although a causal cuDNN kernel skips
    the masked tiles: the FLOP convention of the unfused attention and of Megatron's formula.
    """
    q, k = ins[0], ins[1]
    if int(params.get("layout", 0)) == 1:  # BNTH
        (b, n, sq, d), sk = q, k[2]
    else:  # BTNH
        (b, sq, n, d), sk = q, k[1]
    scores = b * n * sq * sk
    phase = "fwd" if prim in CUDNN_FWD else "bwd"
    elementwise = (SCORE_ELEMENTWISE[phase] + (SCORE_CASTS[phase] if itemsize < 4 else 0)) * scores
    if phase == "fwd":  # QK^T and PV
        return 4 * scores * d, elementwise, scores
    # Recomputed QK^T, dV, dP, dQ, dK, and D = rowsum(dO * O).
    return 10 * scores * d + 2 * b * n * sq * d, elementwise, scores


def per_block(size: Poly, block: int) -> Poly:
    """A unit loop body's live bytes above ``s = block``: every ``s^2`` term is ``s x block``.

    At the traced sizes a blockwise kernel has one block of ``s`` keys, so a ``[.., s_q, keys]`` block
    temporary fits as ``c * s^2``; with more than one block it is ``c * s * block``. Terms linear in ``s``
    are kept: the query-side values are exact, the key-block ones (a k/v block, a dK/dV block) are then
    counted at ``s`` keys instead of ``block`` (an upper bound; docs/cost_model.md).
    """
    out: dict[Mono, Number] = {}
    for (i, j, k), c in size.terms.items():
        m, c2 = ((i, 1, k), c * block) if j == 2 else ((i, j, k), c)
        out[m] = out.get(m, 0) + c2
    return Poly(out)


def unit_bytes(calls: Sequence[UnitCall], nbytes: Callable[[jex.Var], Poly]) -> Poly:
    """Bytes the fused calls read and write (q, k, v, o, lse; backward also dO, dq, dk, dv): the memory
    traffic of one fused kernel per call, each value once per call."""
    total = ZERO
    for c in calls:
        seen: dict[jex.Var, None] = {}
        for v in (*c.ins, *c.outs):
            if is_var(v):
                seen.setdefault(v, None)
        for v in seen:
            total = total + nbytes(v)
    return total


__all__ = ["CUDNN", "UNIT_JIT", "UnitCall", "check_blocks", "cudnn_flops", "per_block", "unit_bytes", "unit_of"]
