"""The public home of the plan contract; it lives in `mistjax.core.plan` (the shared vocabulary)."""

from mistjax.core.plan import (
    OFFLOAD_FIELDS,
    PLAN_MESH_AXES,
    REMAT_POLICIES,
    SCHEDULES,
    SCHEMA_VERSION,
    Plan,
    PlanError,
    Prediction,
    SearchRecord,
    StagePlan,
    format_bytes,
    params_fingerprint,
    uniform_plan,
)

__all__ = ["OFFLOAD_FIELDS", "PLAN_MESH_AXES", "REMAT_POLICIES", "SCHEDULES", "SCHEMA_VERSION", "Plan", "PlanError",
           "Prediction", "SearchRecord", "StagePlan", "format_bytes", "params_fingerprint", "uniform_plan"]
