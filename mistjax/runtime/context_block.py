"""Context parallelism inside the layer: the model's fused-attention calls run as the ring / Ulysses kernel.

Under a plan with ``cp > 1`` the layer runs in its global view with the sequence split over ``context``
(`runtime.grads`), and GSPMD would gather each layer's keys and values whole for the attention. A layer
whose attention is the blockwise fused kernel's protocol (`mistjax.analysis.fused`: a ``custom_vjp`` whose
forward is a ``jit`` named ``fused_attention_fwd_b<B>``) has that call replaced here by
`runtime.context_attention.context_attention` (ring, balanced causal split), with the same block size,
mask and residual name. Any other attention is left to GSPMD, with a warning.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Sequence
from typing import NamedTuple, cast

import jax
from jax.extend import core as jex

from mistjax.core.context import ContextForm, ulysses_supported
from mistjax.core.jaxpr import Value, bind_equation, iter_eqns, read, shaped
from mistjax.core.layout import CONTEXT_AXIS
from mistjax.core.plan import PlanError
from mistjax.runtime.context_attention import context_attention
from mistjax.runtime.context_partial import eval_partial, is_partial
from mistjax.trace.split import BlockFn, LayerStack, TracedLoss


class AttentionCall(NamedTuple):
    """A fused-attention call of the layer the context-parallel kernel can replace."""

    block: int  # keys per block of the model's kernel
    causal: bool  # the kernel masks later keys
    residual_name: str | None  # the checkpoint name its forward gives the saved output and log-sum-exp
    heads: int  # query heads (the call's q is [b, s, heads, d])
    kv_heads: int  # key / value heads


def check_form(calls: Iterable[AttentionCall], form: ContextForm, cp: int, tp: int = 1) -> None:
    """Raise `PlanError` naming ``cp_form`` when ``form`` cannot split the heads of one of ``calls``.

    Ulysses gives each of the ``cp`` devices whole heads (`core.context.ulysses_supported`); the ring splits any."""
    if form is not ContextForm.ULYSSES:
        return
    for call in calls:
        if (reason := ulysses_supported(call.heads, call.kv_heads, cp, tp)) is not None:
            raise PlanError(f"cp_form='ulysses' with cp={cp}, tp={tp}: {reason}; use cp_form='ring', or a cp "
                            "(x tp) that divides the head counts")


def run_attention(call: AttentionCall, form: ContextForm, vals: Sequence[Value], axis: str = CONTEXT_AXIS
                  ) -> list[Value]:
    """The fused-attention call ``call`` on ``vals`` (q, k, v) as the context-parallel kernel of ``form``."""
    q, k, v = cast(Sequence[jax.Array], vals)  # attention's operands are arrays, never literals
    return [context_attention(q, k, v, axis=axis, form=form, causal=call.causal, block_size=call.block,
                              residual_name=call.residual_name)]


def attention_call(eqn: jex.JaxprEqn) -> AttentionCall | None:
    """The `AttentionCall` of ``eqn``, or None when it is not a blockwise fused-attention call on q, k, v."""
    from mistjax.analysis.fused import unit_of

    if eqn.primitive.name != "custom_vjp_call" or len(eqn.invars) != 3 or "call_jaxpr" not in eqn.params:
        return None
    if any(len(getattr(v.aval, "shape", ())) != 4 for v in eqn.invars):
        return None
    for e in iter_eqns(eqn.params["call_jaxpr"]):
        unit = unit_of(str(e.params.get("name", ""))) if e.primitive.name in ("pjit", "jit") else None
        if unit is not None and unit[0] == "fwd" and unit[1] is not None:
            # The kernel's mask is its only select (the analysis reads causality the same way).
            causal = any(x.primitive.name == "select_n" for x in iter_eqns(e.params["jaxpr"], bodies=True))
            q, k = (shaped(v).shape for v in eqn.invars[:2])
            return AttentionCall(unit[1], causal, _residual_name(eqn), int(q[2]), int(k[2]))
    return None


def _residual_name(eqn: jex.JaxprEqn) -> str | None:
    """The checkpoint name the call's forward rule gives its residuals: traced through ``jax.vjp``."""
    avals = [jax.ShapeDtypeStruct(shaped(v).shape, shaped(v).dtype) for v in eqn.invars]

    def pullback(*args: jax.Array) -> object:
        out, vjp = jax.vjp(lambda *x: bind_equation(eqn, list(x))[0], *args)
        return vjp(out)

    names = {e.params["name"] for e in iter_eqns(jax.make_jaxpr(pullback)(*avals), bodies=True)
             if e.primitive.name == "name"}
    return next(iter(sorted(names))) if len(names) == 1 else None


@functools.cache
def warn_gathered(reason: str) -> None:
    """Warn (once per reason) that context parallelism leaves the layer's attention to GSPMD."""
    warnings.warn(f"context parallelism: {reason}; GSPMD gathers each layer's keys and values whole over "
                  "`context` for the attention (correct, but the keys / values of the whole sequence are held "
                  "per layer and the causal work is not balanced)", stacklevel=4)



def context_parallel_block(traced: TracedLoss, form: ContextForm, cp: int) -> BlockFn | None:
    """A `BlockFn` running ``traced``'s layer with its fused-attention calls as the context-parallel kernel of
    ``form`` over ``cp`` devices, or None (with a warning) when the layer has none the runtime recognises.

    Raises:
      PlanError: Ulysses cannot split the layer's heads ``cp`` ways."""
    stack = traced.stack
    if stack is None:
        return None
    calls = {i: c for i, e in enumerate(stack.body.jaxpr.eqns) if (c := attention_call(e)) is not None}
    if not calls:
        warn_gathered("the layer's attention is not the blockwise fused-attention kernel (models.attention), "
                      "so it is not run as the ring kernel")
        return None
    check_form(calls.values(), form, cp)
    return functools.partial(_run_layer, stack, calls, form)


def _run_layer(stack: LayerStack, calls: dict[int, AttentionCall], form: ContextForm, consts: Sequence[Value],
               carry: Sequence[Value], xs: Sequence[Value]) -> tuple[list[Value], list[Value]]:
    """One layer: the scan body evaluated equation by equation, the attention calls through the kernel."""
    jaxpr = stack.body.jaxpr
    env: dict[jex.Var, Value] = dict(zip(jaxpr.constvars, stack.body.consts))
    env.update(zip(jaxpr.invars, [*consts, *carry, *xs]))
    cp = _partial_cp(jaxpr.invars[len(jaxpr.invars) - len(xs):], xs)
    if cp is not None:
        # Weights in partial form (`runtime.context_partial`): their gradients stay per-context-rank partials.
        seq = int(jax.numpy.shape(carry[0])[1])
        out = eval_partial(jaxpr, env, cp, seq,
                           lambda i, vals: run_attention(calls[i], form, vals) if i in calls else None)
        return out[: stack.num_carry], out[stack.num_carry:]
    for i, eqn in enumerate(jaxpr.eqns):
        vals = [read(env, v) for v in eqn.invars]
        call = calls.get(i)
        outs = bind_equation(eqn, vals) if call is None else run_attention(call, form, vals)
        env.update(zip(eqn.outvars, outs))
    out = [read(env, v) for v in jaxpr.outvars]
    return out[: stack.num_carry], out[stack.num_carry:]


def _partial_cp(invars: Sequence[jex.Var], xs: Sequence[Value]) -> int | None:
    """The context degree of the layer's weights in partial form (`context_partial.is_partial`), or None."""
    for v, x in zip(invars, xs):
        shape = tuple(jax.numpy.shape(x))
        if len(shape) == len(shaped(v).shape) + 1 and is_partial(x, v, shape[0]):
            return shape[0]
    return None


__all__ = ["AttentionCall", "attention_call", "check_form", "context_parallel_block", "run_attention",
           "warn_gathered"]
