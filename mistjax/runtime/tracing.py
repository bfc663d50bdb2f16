"""The one step tracer: a user's train step traced abstractly with a gradient handler active.

Both readers of the step trace it here: the step analysis (`runtime.step.analyze_step`, a handler that
records the loss and runs its gradient) and the pipeline executor (`runtime.mpmd_update.trace_step`, a
handler that leaves the gradient opaque). The handler decides what `mistjax.value_and_grad` does; this module
decides everything else: abstract inputs, the output check, and the errors a failing step raises.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import jax
import numpy as np
from jax.extend import core as jex
from jax.tree_util import PyTreeDef

from mistjax.core.plan import PlanError
from mistjax.core.types import Batch, State, TrainStep
from mistjax.runtime.checks import StepError, check_output, trace_failure
from mistjax.runtime.context import GradHandler, use_handler


class StepTrace(NamedTuple):
    """A train step as one flat jaxpr: (state leaves, batch leaves) -> (new state leaves, metric leaves).

    Attributes:
      closed: the step's jaxpr (calls not inlined).
      state_inputs: the tracers the step received as its state leaves (for identity lookups in the handler's
        records: a recorded argument that *is* one of them is that state leaf).
      batch_inputs: the same for the batch leaves.
      state_tree: treedef of the state (and of the new state: `check_output` holds it to that).
      metrics_tree: treedef of the metrics.
    """

    closed: jex.ClosedJaxpr
    state_inputs: tuple[jax.core.Tracer, ...]
    batch_inputs: tuple[jax.core.Tracer, ...]
    state_tree: PyTreeDef
    metrics_tree: PyTreeDef


def trace_train_step(train_step: TrainStep, state: State, batch: Batch, handler: GradHandler) -> StepTrace:
    """Trace `train_step` on abstract copies of `state` and `batch` with `handler` answering its gradient calls.

    Raises:
      StepError: the step returns something else than ``(new_state, metrics)`` of the state's structure, or
        fails while tracing (the error names the batch and the likely cause, `runtime.checks.trace_failure`).
      PlanError: the handler refuses the step.
    """
    s_leaves, s_tree = jax.tree.flatten(state)
    b_leaves, b_tree = jax.tree.flatten(batch)
    n = len(s_leaves)
    seen: list[jax.core.Tracer] = []
    metric_trees: list[PyTreeDef] = []

    def flat(*leaves: jax.Array) -> list[jax.Array]:
        seen.extend(cast(tuple[jax.core.Tracer, ...], leaves))  # (traced by make_jaxpr: tracers)
        with use_handler(handler):
            out = train_step(jax.tree.unflatten(s_tree, leaves[:n]), jax.tree.unflatten(b_tree, leaves[n:]))
        check_output(out, s_tree)
        m_leaves, m_tree = jax.tree.flatten(out[1])
        metric_trees.append(m_tree)
        return [*jax.tree.leaves(out[0]), *m_leaves]

    abstract = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in [*s_leaves, *b_leaves]]
    try:
        closed = jax.make_jaxpr(flat)(*abstract)
    except (StepError, PlanError):
        raise
    except (TypeError, ValueError, IndexError) as e:
        raise trace_failure(e, batch) from e
    return StepTrace(closed, tuple(seen[:n]), tuple(seen[n:]), s_tree, metric_trees[0])


__all__ = ["StepTrace", "trace_train_step"]
