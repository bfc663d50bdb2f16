"""The runtime context that `mistjax.value_and_grad` consults while `autoshard` traces a step."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class GradHandler(Protocol):
    def value_and_grad(self, fun: Callable[..., Any], has_aux: bool, args: tuple[Any, ...]) -> Any: ...


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
