"""The jaxpr vocabulary every package reads: which primitives call a sub-jaxpr, one walker, one interpreter.

A *call-like* equation applies its inner jaxpr once to its operands: ``jax.jit``, ``jax.checkpoint``,
``custom_jvp`` / ``custom_vjp`` functions, ``shard_map``, and ``closed_call``, which JAX's partial
evaluation emits (e.g. in the VJP of a checkpointed scan). `CALLS` names each with the parameter holding
its inner jaxpr; every package that looks through calls reads this one table. Loops and conditionals
(``scan``, ``while``, ``cond``) are not calls: their bodies run many times, or one body of several.

`walk` and `iter_eqns` visit a jaxpr's structure with calls entered (no values); `eval_jaxpr` /
`bind_equation` are the one interpreter (concrete arrays or tracers), and `inline_calls` re-traces a
jaxpr with calls replaced by their bodies.

The table is for the pinned JAX (0.10): older names (``pjit``, ``checkpoint``, ``custom_vjp_call_jaxpr``)
no longer occur, and `tests/test_jaxpr.py` traces a function producing each entry.
"""

from __future__ import annotations

import enum
from collections.abc import Container, Iterator, Mapping, MutableMapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeGuard, cast

import jax
import numpy as np
from jax._src import source_info_util  # private, as jax.core.eval_jaxpr uses it (no public API)
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var, jaxprs_in_params
from jax.extend.core.primitives import closed_call_p

Atom: TypeAlias = Var | Literal
"""An equation operand: a variable, or a literal constant written into the jaxpr."""

Value: TypeAlias = jax.typing.ArrayLike
"""What an operand holds when a jaxpr is evaluated: an array (concrete or a tracer) or a Python / NumPy scalar."""


Params: TypeAlias = dict[str, Any]
"""An equation's parameters: whatever its primitive takes (sub-jaxprs, shapes, dtypes, callables)."""


class Shaped(Protocol):
    """Anything with a static shape and a dtype: an array, a ``jax.ShapeDtypeStruct``, a variable's aval."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...


CLOSED_CALL = closed_call_p.name
"""Partial evaluation's call: ``closed_call`` (JAX 0.10), ``eval_jaxpr`` (0.11)."""

CALLS: Mapping[str, str] = MappingProxyType({
    "jit": "jaxpr",  # jax.jit; its ``name`` param names the function (fused kernels, eager markers)
    CLOSED_CALL: "call_jaxpr",  # partial evaluation's call (known part of a checkpointed scan, ...)
    "remat2": "jaxpr",  # jax.checkpoint (an open Jaxpr: its constants are operands)
    "custom_jvp_call": "call_jaxpr",  # the primal of a jax.custom_jvp function
    "custom_vjp_call": "call_jaxpr",  # the primal of a jax.custom_vjp function
    "shard_map": "jaxpr",  # an open Jaxpr on per-device shapes
})
"""Call-like primitive -> the parameter holding its inner (closed or open) jaxpr."""

JIT = "jit"
"""The primitive of a ``jax.jit`` call (the only call with a user-given name)."""

CHECKPOINTS = frozenset({"remat2"})
"""``jax.checkpoint``: its body is recomputed in the backward pass."""

CUSTOM_VJP = frozenset({"custom_vjp_call"})
"""``jax.custom_vjp``: its body's backward is the user's rule, not JAX's."""

PER_DEVICE = frozenset({"shard_map"})
"""Calls whose body sees per-device shapes: walked for structure, never evaluated in place of the call."""

INLINABLE = frozenset(CALLS) - PER_DEVICE
"""Calls whose body may be evaluated on the call's operands in place of the call."""

PLAIN_CALLS = frozenset({JIT, CLOSED_CALL})
"""Calls without a differentiation rule of their own: inlining them changes nothing a transformation sees."""


def scan_counts(params: Params) -> tuple[int, int]:
    """A ``scan`` equation's (number of consts, number of carry operands): JAX 0.10's ``num_consts`` /
    ``num_carry``, or JAX 0.11's flat trees (``ft_in`` = (consts, carry, xs))."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def is_var(v: object) -> TypeGuard[Var]:
    """Whether ``v`` is a variable that holds a value: not a literal, not a dropped output (``_``)."""
    return isinstance(v, Var) and not isinstance(v, DropVar)


def shaped(v: Atom) -> jax.core.ShapedArray:
    """``v.aval`` as the shaped array it is in a traced array program (JAX types it as the base `AbstractValue`,
    which has no shape or dtype; tokens and references never reach the programs mistjax rewrites)."""
    return cast(jax.core.ShapedArray, v.aval)


def inner_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr | None:
    """The jaxpr a call-like equation applies (an open one closed over no constants); None for others."""
    key = CALLS.get(eqn.primitive.name)
    inner = None if key is None else eqn.params.get(key)
    if isinstance(inner, Jaxpr):
        return ClosedJaxpr(inner, [])
    return inner if isinstance(inner, ClosedJaxpr) else None


class Visit(enum.Enum):
    """What a `Step` of `walk` is at."""

    LEAF = "leaf"  # an equation not entered (any primitive, loops included)
    ENTER = "enter"  # a call about to be walked: its body's steps follow, then its EXIT
    EXIT = "exit"  # the end of an entered call's body


class Step(NamedTuple):
    """One step of `walk`: an equation, and for an entered call its inner jaxpr."""

    visit: Visit
    eqn: JaxprEqn
    inner: ClosedJaxpr | None = None


def _open(jaxpr: Jaxpr | ClosedJaxpr) -> Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr


def walk(jaxpr: Jaxpr | ClosedJaxpr, enter: Container[str] = CALLS) -> Iterator[Step]:
    """The equations of ``jaxpr`` in program order with the calls named in ``enter`` inlined.

    An entered call is an ``ENTER`` step, its body's steps and an ``EXIT`` step (so a caller can map
    the call's operands to the body's inputs and the body's outputs back); every other equation is a
    ``LEAF``. Loop and conditional bodies are never entered (they are not calls).

    Args:
      jaxpr: the jaxpr to walk.
      enter: names of the call-like primitives to inline (default: all of `CALLS`).
    """
    for eqn in _open(jaxpr).eqns:
        inner = inner_jaxpr(eqn) if eqn.primitive.name in enter else None
        if inner is None:
            yield Step(Visit.LEAF, eqn)
            continue
        yield Step(Visit.ENTER, eqn, inner)
        yield from walk(inner.jaxpr, enter)
        yield Step(Visit.EXIT, eqn, inner)


def iter_eqns(jaxpr: Jaxpr | ClosedJaxpr, *, bodies: bool = False) -> Iterator[JaxprEqn]:
    """Every equation of ``jaxpr`` with all calls entered, in pre-order (a call before its body's equations).

    Args:
      jaxpr: the jaxpr to walk.
      bodies: also descend into every other sub-jaxpr (``scan`` / ``while`` bodies, ``cond`` branches);
        by default loops and conditionals are leaves.
    """
    for eqn in _open(jaxpr).eqns:
        yield eqn
        if bodies:
            subs = list(jaxprs_in_params(eqn.params))
        else:
            inner = inner_jaxpr(eqn)
            subs = [] if inner is None else [inner.jaxpr]
        for sub in subs:
            yield from iter_eqns(sub, bodies=bodies)


def read(env: Mapping[Any, Value], v: Atom) -> Value:
    """The value of an operand: a literal's own, a variable's from ``env``."""
    return v.val if isinstance(v, Literal) else env[v]


def bind_equation(eqn: JaxprEqn, args: Sequence[Value], inline: Container[str] = (), *,
                  depth: int | None = None) -> list[Value]:
    """Apply one equation to ``args`` (concrete arrays or tracers).

    Args:
      eqn: the equation.
      args: its operands' values.
      inline: call-like primitives whose body is evaluated equation by equation instead of binding the call.
      depth: how many levels of calls to inline (None: any; 1: only a call of ``eqn`` itself).
    """
    inner = inner_jaxpr(eqn) if eqn.primitive.name in inline and depth != 0 else None
    if inner is not None:
        return eval_jaxpr(inner.jaxpr, inner.consts, args, inline, depth=None if depth is None else depth - 1)
    params = eqn.primitive.get_bind_params(eqn.params)
    # The equation it makes remembers the user's line that made ``eqn`` (as jax.core.eval_jaxpr does), so an
    # error about a re-traced equation names the model's code, not this interpreter.
    with source_info_util.user_context(eqn.source_info.traceback), eqn.ctx.manager:
        out = eqn.primitive.bind(*args, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def run_equations(eqns: Sequence[JaxprEqn], env: MutableMapping[Var, Value], inline: Container[str] = (), *,
                  depth: int | None = None) -> None:
    """Evaluate ``eqns`` in order, reading and writing their values in ``env`` (`bind_equation`'s options)."""
    for eqn in eqns:
        outs = bind_equation(eqn, [read(env, v) for v in eqn.invars], inline, depth=depth)
        env.update(zip(eqn.outvars, outs))


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Value], args: Sequence[Value], inline: Container[str] = (), *,
               depth: int | None = None) -> list[Value]:
    """Evaluate an open jaxpr on ``args`` (the project's one interpreter; `bind_equation`'s options)."""
    env: dict[Var, Value] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    run_equations(jaxpr.eqns, env, inline, depth=depth)
    return [read(env, v) for v in jaxpr.outvars]


def inline_calls(closed: ClosedJaxpr, inline: Container[str] = INLINABLE, *, depth: int | None = None
                 ) -> ClosedJaxpr:
    """``closed`` re-traced with the calls named in ``inline`` replaced by their bodies.

    Args:
      closed: the jaxpr.
      inline: the call-like primitives to inline (default: every call evaluable in place, `INLINABLE`).
      depth: how many levels of nested calls to inline (None: any; 1: only top-level calls).
    Returns:
      ``closed`` itself when it has no such call at its top level, else the re-traced jaxpr.
    """
    if not any(e.primitive.name in inline and inner_jaxpr(e) is not None for e in closed.jaxpr.eqns):
        return closed

    def flat(*args: Value) -> list[Value]:
        return eval_jaxpr(closed.jaxpr, closed.consts, args, inline, depth=depth)

    avals = [v.aval for v in closed.jaxpr.invars]
    return jax.make_jaxpr(flat)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])


__all__ = ["CALLS", "CHECKPOINTS", "CLOSED_CALL", "CUSTOM_VJP", "INLINABLE", "JIT", "PER_DEVICE", "PLAIN_CALLS",
           "Atom", "Params", "Shaped", "Step", "Value", "Visit", "bind_equation", "eval_jaxpr", "inline_calls",
           "inner_jaxpr", "is_var", "iter_eqns", "read", "run_equations", "scan_counts", "walk"]
