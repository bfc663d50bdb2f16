"""Stage kinds for `mistjax.cost.predict` (the SPMD lock-step pipeline executor that lived here is gone).

Pipelined plans run on the MPMD executor (`mistjax.runtime.mpmd`). This module only re-exports
`remat.stage_kind` for the cost model's import until that moves to the shared stage facts.
"""

from mistjax.runtime.remat import StageKind, stage_kind

__all__ = ["StageKind", "stage_kind"]
