"""Seconds of a layer's tensor-parallel collectives where they run as collective matmuls
(`core.execution.Capabilities.collective_matmul`; the runtime's rings: `mistjax.runtime.collective_matmul`).

A ring replaces one all-gather of the sequence-split layer input (with the column-parallel matmuls that read it)
or one reduce-scatter of a row-parallel matmul's partial sum: ``t - 1`` neighbour transfers of a ``1 / t`` chunk,
each beside the GEMM of one chunk. Where collectives run asynchronously a step costs only what its transfer
takes beyond that GEMM; in line (a forced ring on XLA:CPU) the whole transfer::

    step  = latency + (B / t) / bw                    one transfer: B = the ring's full-buffer bytes in the phase
    gemm  = G / t                                     one chunk's GEMM: G = the ring's matmul seconds in the phase
    ring  = (t - 1) * (overlap(gemm, step) - gemm)    async collectives; in line: (t - 1) * step

``overlap`` is the stage model's own `overlap_time` of a compute and a D2D channel (the cluster's interference
factors: both slow down while they share the device), so a step costs at least ``max(0, step - gemm)`` and at
most ``step``.

What the profile gives per phase is totals, so every ring of a phase is priced as their mean
(docs/cost_model.md, "TP communication overlapped"):

* rings: one per forward all-gather and reduce-scatter of the layer (`PartValues.tp_calls`); the backward
  runs one mirrored ring per forward ring (a gather ring's carries the input chunk and the input gradient's
  accumulator together, a reduce-scatter ring's the output cotangent's chunk);
* B: the phase's all-gather + reduce-scatter bytes over its rings;
* G: the layer's weight GEMMs over its rings: all of them in the forward, half of them in the backward (the
  input gradients' GEMMs run in the ring; the weight gradients' GEMMs after it, on the gathered operand).

All-reduces (no sequence parallelism, the layer norms' weight gradients) stay serial, as do pre / post.
Averaging the rings of a phase (a max of means, not a mean of maxes) can only under-state the exposed time
of unequal rings. The rings cost compute too: each GEMM they split runs as ``t`` kernels (`chunk_overhead`).
"""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
from numpy.typing import ArrayLike

from mistjax.analysis.compiled import PartValues
from mistjax.core.hlo import CollectiveOp
from mistjax.cost.collectives import collective_time
from mistjax.cost.interference import overlap_time
from mistjax.hardware.interference import InterferenceParams

_AG, _RS, _AR = CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE
Link: TypeAlias = tuple[ArrayLike, ArrayLike]
"""(bandwidth, latency) of the tensor-parallel group's link, per strategy."""


def ring_count(part: PartValues) -> np.ndarray:
    """Rings of one pass of ``part``: one per forward all-gather and reduce-scatter (the backward has as many)."""
    return part.tp_calls(_AG, "fwd") + part.tp_calls(_RS, "fwd")


def ring_bytes(part: PartValues, phase: str) -> np.ndarray:
    """Full-buffer bytes the rings of ``phase`` move in all: the all-gathers and reduce-scatters they replace."""
    return part.tp(_AG, phase) + part.tp(_RS, phase)


def exposed_ring_time(nbytes: ArrayLike, rings: ArrayLike, t: ArrayLike, link: Link, gemm: ArrayLike,
                      overlap: InterferenceParams | None) -> np.ndarray:
    """Seconds ``rings`` rings over ``t`` devices add to a phase (module docstring).

    Args:
      nbytes: full-buffer bytes of the collectives the rings replace, in all.
      rings: how many rings.
      t: devices of the tensor-parallel group.
      link: (bandwidth, latency) of its link.
      gemm: seconds of the matmuls the rings run, in all.
      overlap: the interference factors where collectives run asynchronously (each transfer beside its
        chunk's GEMM); None where they run in line.
    """
    bw, lat = link
    n, r, t = (np.asarray(x, dtype=np.float64) for x in (nbytes, rings, t))
    per, tt = np.maximum(r, 1.0), np.maximum(t, 1.0)
    step = np.asarray(lat) + n / per / tt / np.asarray(bw)
    if overlap is not None:
        g = np.asarray(gemm, dtype=np.float64) / per / tt
        step = np.maximum(overlap_time(g, step, 0.0, 0.0, overlap) - g, 0.0)
    return np.where((t > 1) & (r > 0) & (n > 0), r * (t - 1.0) * step, 0.0)


def tp_ring_time(part: PartValues, phase: str, t: ArrayLike, link: Link, gemm: ArrayLike,
                 overlap: InterferenceParams | None) -> np.ndarray:
    """Seconds of ``part``'s tensor-parallel collectives in ``phase`` with collective matmuls: its rings'
    exposed time (`exposed_ring_time`) plus its all-reduces, serial."""
    rings = exposed_ring_time(ring_bytes(part, phase), ring_count(part), t, link, gemm, overlap)
    return rings + collective_time(_AR, part.tp(_AR, phase), t, link)


def recompute_share(part: PartValues, recompute: dict[str, np.ndarray]) -> np.ndarray:
    """The share of the forward's rings a checkpointed layer runs again when it recomputes: its extra
    all-gather + reduce-scatter bytes (``recompute``: bytes by kind, `PartValues.tp_recompute`) over the
    forward's."""
    fwd = ring_bytes(part, "fwd")
    return np.where(fwd > 0, (recompute[_AG] + recompute[_RS]) / np.maximum(fwd, 1.0), 0.0)


def tp_ring_recompute_time(part: PartValues, recompute: dict[str, np.ndarray], t: ArrayLike, link: Link,
                           gemm_fwd: ArrayLike, overlap: InterferenceParams | None) -> np.ndarray:
    """Seconds of the extra tensor-parallel collectives a checkpointed layer issues when it recomputes, with
    collective matmuls: its all-gathers and reduce-scatters as `recompute_share` of the forward's rings, its
    all-reduces serial."""
    rings = exposed_ring_time(ring_bytes(part, "fwd"), ring_count(part), t, link, gemm_fwd, overlap)
    return recompute_share(part, recompute) * rings + collective_time(_AR, recompute[_AR], t, link)


def chunk_overhead(kernels: ArrayLike, t: ArrayLike, overhead: ArrayLike) -> np.ndarray:
    """Seconds the rings' GEMMs cost beyond the whole GEMMs they split: each of the ``kernels`` runs as ``t``
    chunk kernels, ``t - 1`` more kernel overheads (`DeviceSpec.kernel_overhead`). A chunk's roofline is
    taken as ``1 / t`` of the GEMM's (``m / t`` rows: whole tiles at the sizes TP is used with)."""
    t = np.asarray(t, dtype=np.float64)
    return np.where(t > 1, (t - 1.0) * np.asarray(kernels) * overhead, 0.0)


__all__ = ["chunk_overhead", "exposed_ring_time", "recompute_share", "ring_bytes", "ring_count",
           "tp_ring_recompute_time", "tp_ring_time"]
