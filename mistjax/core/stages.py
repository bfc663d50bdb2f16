"""What a stage's plan implies for its code: which of its layers offload, run plain, or recompute.

The runtime's layer loops, the pipeline executor and the cost model all read these, so the rule
"offload first, remat last" is written once: the first layers of a stage offload their tagged
activations (they wait longest for their backward), the last ``remat_layers`` are checkpointed
(Mist's convention: their activations would be freed soonest anyway), the rest keep everything.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike


class SegmentKind(enum.StrEnum):
    """How a run of a stage's layers keeps its activations for the backward."""

    OFFLOAD = "offload"  # tagged activations to host in the forward, back in the backward; the rest recomputed
    PLAIN = "plain"  # every residual kept on the device
    REMAT = "remat"  # checkpointed with the stage's remat policy: recomputed in the backward


OFFLOAD, PLAIN, REMAT = SegmentKind.OFFLOAD, SegmentKind.PLAIN, SegmentKind.REMAT


def offloaded_layers(num_layers: ArrayLike, remat_layers: ArrayLike, ratio: ArrayLike) -> int | np.ndarray:
    """Layers whose activations go to host for an activation offload ``ratio`` of the non-remat layers.

    Vectorised (the cost model prices arrays of strategies); an int for scalar arguments.
    """
    n = np.round(np.asarray(ratio) * (np.asarray(num_layers) - np.minimum(remat_layers, num_layers)))
    return int(n) if n.ndim == 0 else n


def layer_segments(num_layers: int, remat_layers: int, offload_layers: int) -> list[tuple[int, int, SegmentKind]]:
    """A stage's layers as non-empty ``(start, end, kind)`` runs: offloaded, plain, checkpointed."""
    n_remat = min(remat_layers, num_layers)
    n_off = min(offload_layers, num_layers - n_remat)
    n_plain_end = num_layers - n_remat
    bounds = [(0, n_off, OFFLOAD), (n_off, n_plain_end, PLAIN), (n_plain_end, num_layers, REMAT)]
    return [b for b in bounds if b[1] > b[0]]


@dataclass(frozen=True)
class StageKind:
    """Everything that makes one stage's code differ from another's.

    A pipeline compiles one program (or branch) per distinct kind, and the cost model counts each
    kind's code once, as XLA's cost analysis does.
    """

    first: bool  # runs the pre part (embedding)
    last: bool  # runs the post part (head and loss)
    num_offload: int  # leading layers whose tagged activations go to host (the rest is recomputed)
    num_plain: int  # then layers run without checkpointing
    num_remat: int  # trailing layers run under jax.checkpoint(policy)
    policy: str | None  # remat policy of the trailing layers (None without any)

    @property
    def num_layers(self) -> int:
        return self.num_offload + self.num_plain + self.num_remat

    def segments(self) -> list[tuple[int, int, SegmentKind]]:
        return layer_segments(self.num_layers, self.num_remat, self.num_offload)


def stage_kind(stage: int, num_stages: int, num_layers: int, remat_layers: int, policy: str | None,
               offload_layers: int = 0) -> StageKind:
    """The `StageKind` of stage ``stage`` of ``num_stages`` (layer order as in `layer_segments`)."""
    remat = min(remat_layers, num_layers)
    n_off = min(offload_layers, num_layers - remat)
    return StageKind(stage == 0, stage == num_stages - 1, n_off, num_layers - remat - n_off, remat,
                     policy if remat else None)


__all__ = ["OFFLOAD", "PLAIN", "REMAT", "SegmentKind", "StageKind", "layer_segments", "offloaded_layers",
           "stage_kind"]
