"""The runtime context that `mistjax.value_and_grad` consults while `autoshard` traces a step."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Protocol

from mistjax.core.types import LossFn, PyTree


class GradHandler(Protocol):
    """What answers `mistjax.value_and_grad` while a step is traced (the runtime's gradient, a recorder)."""

    def value_and_grad(self, fun: LossFn, has_aux: bool, args: tuple[PyTree, ...]) -> PyTree:
        """``jax.value_and_grad(fun, has_aux=has_aux)(*args)``, computed (or recorded) the handler's way."""
        ...


_ACTIVE: contextvars.ContextVar[GradHandler | None] = contextvars.ContextVar("mistjax_grad_handler", default=None)


def active_handler() -> GradHandler | None:
    return _ACTIVE.get()


@contextlib.contextmanager
def use_handler(handler: GradHandler) -> Iterator[None]:
    token = _ACTIVE.set(handler)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
