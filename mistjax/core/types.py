"""Names for the open-ended values the package passes around, so that signatures say what they hold.

JAX pytrees and user callables have no static type worth checking (a pytree is any nesting of
containers whose leaves are arrays); these aliases name them instead of a bare `Any`, as Levanter's
``PyTree`` and optax's ``Params`` / ``Updates`` do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

PyTree: TypeAlias = Any
"""A JAX pytree: nested lists / tuples / dicts / registered nodes whose leaves are arrays or scalars."""

State: TypeAlias = PyTree
"""A user's train state (parameters, optimizer state, step counters), as their step receives it."""

Batch: TypeAlias = PyTree
"""A user's batch: leaves whose leading dimension is the global batch are split over data parallelism."""

Metrics: TypeAlias = PyTree
"""What a user's step returns besides the new state (loss, aux values)."""

TrainStep: TypeAlias = Callable[[State, Batch], tuple[State, Metrics]]
"""A user's train step: ``(state, batch) -> (new_state, metrics)``."""

LossFn: TypeAlias = Callable[..., Any]
"""A user's loss: ``(params, *rest) -> loss`` or ``-> (loss, aux)``; its result is checked where traced."""

__all__ = ["Batch", "LossFn", "Metrics", "PyTree", "State", "TrainStep"]
