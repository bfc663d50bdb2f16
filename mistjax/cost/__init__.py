"""mistjax.cost: numeric building blocks of the cost model (pure NumPy, vectorised).

Collectives (alpha-beta, Mist's fitted form, MiCS hierarchical and 2-hop), the four-channel
interference model, pipeline iteration time, and the roofline op-time model; on top of them the
cost model of plans: `Workload`, the vectorised `stage_cost` over `StageStrategies`, and
`predict` / `analyze` of a whole `Plan` (see docs/cost_model.md).
"""

from mistjax.core.pipeline_time import (
    bubble_fraction,
    pipeline_1f1b_time,
    pipeline_gpipe_time,
    pipeline_time,
)
from mistjax.core.schedules import SCHEDULE_NAMES as SCHEDULES
from mistjax.core.schedules import inflight_microbatches
from mistjax.core.strategies import CostModel, StageStrategies
from mistjax.cost.collectives import (
    COLLECTIVES,
    MIST_PHI,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    collective_buffer_bytes,
    collective_time,
    dp_group_layout,
    hierarchical_all_gather_time,
    hierarchical_all_reduce_time,
    hierarchical_node_egress_bytes,
    hierarchical_reduce_scatter_time,
    host_copy_time,
    mics_grad_sync_time,
    mics_node_egress_bytes,
    mics_step_comm_time,
    p2p_time,
    reduce_scatter_time,
    ring_node_egress_bytes,
    tp_group_layout,
    wire_bytes,
    zero3_node_egress_bytes,
    zero3_step_comm_time,
)
from mistjax.cost.interference import overlap_time
from mistjax.cost.model import MEMORY_CATEGORIES, StageCost, StageMemory, stage_cost, stage_memory
from mistjax.cost.ops import (
    DEFAULT_OP_OVERHEAD,
    OpTimeTable,
    compute_efficiency,
    op_signature,
    op_time,
    roofline_time,
)
from mistjax.cost.predict import Analysis, analyze, plan_strategies, predict
from mistjax.cost.workload import OPTIMIZERS, ParamLeaf, Workload
from mistjax.hardware.interference import CHANNELS, MASKS, InterferenceParams, mask_name  # hardware data, re-exported
from mistjax.hardware.presets import ClusterSpec

# The project's cost model as the tuner sees it (`mistjax.core.strategies.CostModel`).
COST_MODEL: CostModel[Workload, ClusterSpec] = CostModel(stage_cost=stage_cost, predict=predict,
                                                         stage_memory=stage_memory)

__all__ = [
    "COST_MODEL",
    "Analysis",
    "CostModel",
    "MEMORY_CATEGORIES",
    "OPTIMIZERS",
    "ParamLeaf",
    "StageCost",
    "StageMemory",
    "StageStrategies",
    "Workload",
    "analyze",
    "plan_strategies",
    "predict",
    "stage_cost",
    "stage_memory",
    "CHANNELS",
    "COLLECTIVES",
    "DEFAULT_OP_OVERHEAD",
    "MASKS",
    "MIST_PHI",
    "SCHEDULES",
    "InterferenceParams",
    "OpTimeTable",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "bubble_fraction",
    "collective_buffer_bytes",
    "collective_time",
    "compute_efficiency",
    "dp_group_layout",
    "hierarchical_all_gather_time",
    "hierarchical_all_reduce_time",
    "hierarchical_node_egress_bytes",
    "hierarchical_reduce_scatter_time",
    "host_copy_time",
    "inflight_microbatches",
    "mask_name",
    "mics_grad_sync_time",
    "mics_node_egress_bytes",
    "mics_step_comm_time",
    "op_signature",
    "op_time",
    "overlap_time",
    "p2p_time",
    "pipeline_1f1b_time",
    "pipeline_gpipe_time",
    "pipeline_time",
    "reduce_scatter_time",
    "ring_node_egress_bytes",
    "roofline_time",
    "tp_group_layout",
    "wire_bytes",
    "zero3_node_egress_bytes",
    "zero3_step_comm_time",
]
