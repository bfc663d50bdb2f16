"""Weight gradients kept as per-context-rank partial sums, reduced over `context` once per step.

Under context parallelism (`Plan.cp`) the layer runs in its global view with the sequence split over `context`,
and a weight replicated over `context` gets its gradient as a contraction over the sequence: GSPMD forms each
device's partial sum and all-reduces it over `context` where the gradient is formed, once per micro-batch.
Megatron-LM instead reduces the summed gradient once per step over the data x context group.

Here a layer weight accumulated inside the layer loop (`runtime.accumulate`) enters the layer in *partial form*:
``[cp, *shape]`` split over `context` on its leading dim, each device holding its own copy (`spread`; no
transfer). The layer is evaluated equation by equation (`eval_partial`, from `runtime.context_block`): an
equation on weights only runs on each device's copy (vmapped over the leading dim); an equation where a weight
meets the sequence-split activations (a projection, a norm scale) runs manual over `context` on each device's
part of the sequence (`jax.shard_map`), so its weight cotangent is that device's partial sum, in partial form,
with no collective. The accumulator holds those partials for the step ([layers, cp, ...], split over `context`:
the bytes per device of a plain accumulator), and `runtime.grads` sums them over `context` after the last
micro-batch (docs/context-parallel.md). Any other equation reads the weight through `from_partials` (the
replicated value; its cotangent reduced by GSPMD, as before, and spread back).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex
from jax.sharding import PartitionSpec as P

from mistjax.core.jaxpr import CHECKPOINTS, PLAIN_CALLS, Atom, Value, bind_equation, inner_jaxpr, read, shaped
from mistjax.core.layout import CONTEXT_AXIS

# Equations a weight may meet the activations in, run manual over `context` on local shapes: none of them has a
# shape among its parameters, so each device binds it on its part of the sequence unchanged.
_LOCAL = frozenset({"dot_general", "mul", "add", "sub", "div", "max", "min", "convert_element_type"})


def _spec(ndim: int, dim: int | None) -> P:
    """A spec splitting ``dim`` of an ``ndim``-dim value over `context` (None: replicated)."""
    entries: list[str | None] = [None] * ndim
    if dim is not None:
        entries[dim] = CONTEXT_AXIS
    return P(*entries)


def spread(x: jax.Array, cp: int) -> jax.Array:
    """``x`` (replicated over `context`) in partial form: ``[cp, *x.shape]`` split over `context` on dim 0, each
    device's block its own copy (a local broadcast, no transfer)."""
    y = jnp.broadcast_to(x[None], (cp, *x.shape))
    return lax.with_sharding_constraint(y, _spec(y.ndim, 0))


@jax.custom_vjp
def from_partials(xc: jax.Array) -> jax.Array:
    """A partial-form value (every block the same copy) as the replicated value: each device's own block."""
    return jax.shard_map(lambda b: b[0], in_specs=_spec(xc.ndim, 0), out_specs=P(),
                         axis_names=frozenset({CONTEXT_AXIS}), check_vma=False)(xc)


def _from_fwd(xc: jax.Array) -> tuple[jax.Array, int]:
    return from_partials(xc), xc.shape[0]


def _from_bwd(cp: int, ct: jax.Array) -> tuple[jax.Array]:
    # ``ct`` is whole (GSPMD reduced it over `context`): its 1 / cp on every block sums back to it.
    return (spread(ct / cp, cp),)


from_partials.defvjp(_from_fwd, _from_bwd)


def is_partial(value: Value, var: Atom, cp: int) -> bool:
    """Whether ``value`` is ``var``'s value in partial form (one more, leading, dim of ``cp``)."""
    return tuple(jnp.shape(value)) == (cp, *shaped(var).shape)


def _seq_dim(shape: Sequence[int], seq: int) -> int | None:
    """The sequence dim of an activation: dim 1 where it holds ``seq`` positions (the layer's ``[b, s, ...]``
    values, as the runtime splits the hidden state), else its one dim of ``seq``; None when it has none (or
    several, none of them dim 1)."""
    if len(shape) > 1 and shape[1] == seq:
        return 1
    dims = [d for d, n in enumerate(shape) if n == seq]
    return dims[0] if len(dims) == 1 else None


def _manual(eqn: jex.JaxprEqn, vals: Sequence[Value], partial: Sequence[bool], seq: int) -> list[Value] | None:
    """``eqn`` manual over `context` on each device's part of the sequence, its partial-form operands as each
    device's copy; None when it is not one the local shapes allow (`_LOCAL`, one sequence dim per value)."""
    if eqn.primitive.name not in _LOCAL:
        return None
    in_dims = [None if p or jnp.ndim(v) == 0 else _seq_dim(jnp.shape(v), seq) for v, p in zip(vals, partial)]
    out_dims = [_seq_dim(shaped(v).shape, seq) for v in eqn.outvars]
    if None in out_dims or all(d is None for d in in_dims):
        return None
    arrays = [i for i, v in enumerate(vals) if jnp.ndim(v) > 0 or partial[i]]
    specs = tuple(_spec(jnp.ndim(vals[i]), 0 if partial[i] else in_dims[i]) for i in arrays)

    def local(*xs: Value) -> list[Value]:
        args = list(vals)
        for i, x in zip(arrays, xs):
            args[i] = jnp.asarray(x)[0] if partial[i] else x
        # Bound directly: the equation's own context would set the mesh it was traced under (`context` automatic).
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
        return list(out) if eqn.primitive.multiple_results else [out]

    out_specs = [_spec(len(shaped(v).shape), d) for v, d in zip(eqn.outvars, out_dims)]
    return jax.shard_map(local, in_specs=specs, out_specs=out_specs, axis_names=frozenset({CONTEXT_AXIS}))(
        *[vals[i] for i in arrays])


def _vmapped(eqn: jex.JaxprEqn, vals: Sequence[Value], partial: Sequence[bool]) -> list[Value]:
    """``eqn`` on weights only, on each device's copy: vmapped over the partial form's leading dim."""
    outs = jax.vmap(lambda *xs: bind_equation(eqn, xs), in_axes=[0 if p else None for p in partial])(*vals)
    return [lax.with_sharding_constraint(o, _spec(jnp.ndim(o), 0)) for o in outs]


Attention = Callable[[int, Sequence[Value]], list[Value] | None]
"""``(equation index, operands) -> results``: a top-level equation run as the context-parallel attention, or None."""


def eval_partial(jaxpr: jex.Jaxpr, env: dict[jex.Var, Value], cp: int, seq: int, attention: Attention | None = None
                 ) -> list[Value]:
    """Evaluate ``jaxpr`` with ``env`` holding its inputs, some in partial form (`is_partial`); its outputs
    plain. Equations keep the partial form where they can (see the module docstring)."""
    partial = {v for v, x in env.items() if is_partial(x, v, cp)}
    for i, eqn in enumerate(jaxpr.eqns):
        vals = [read(env, v) for v in eqn.invars]
        flags = [isinstance(v, jex.Var) and v in partial for v in eqn.invars]
        outs = attention(i, [_plain(x, f) for x, f in zip(vals, flags)]) if attention is not None else None
        if outs is None:
            outs, held = _partial_equation(eqn, vals, flags, cp, seq)
            partial.update(v for v, h in zip(eqn.outvars, held) if h)
        env.update(zip(eqn.outvars, outs))
    return [_plain(read(env, v), isinstance(v, jex.Var) and v in partial) for v in jaxpr.outvars]


def _plain(x: Value, held: bool) -> Value:
    return from_partials(jnp.asarray(x)) if held else x


def _partial_equation(eqn: jex.JaxprEqn, vals: Sequence[Value], flags: Sequence[bool], cp: int, seq: int
                      ) -> tuple[list[Value], list[bool]]:
    """One equation of `eval_partial`: its results and which of them are in partial form."""
    none = [False] * len(eqn.outvars)
    if not any(flags):
        return bind_equation(eqn, vals), none
    name = eqn.primitive.name
    if name in CHECKPOINTS or name in PLAIN_CALLS:
        inner = inner_jaxpr(eqn)
        if inner is not None:
            return _inner_call(eqn, inner, vals, cp, seq), none
    if all(f or jnp.ndim(v) == 0 for v, f in zip(vals, flags)) and inner_jaxpr(eqn) is None:
        return _vmapped(eqn, vals, flags), [True] * len(eqn.outvars)  # on weights (and scalars) only
    local = _manual(eqn, vals, flags, seq)
    if local is not None:
        return local, none
    return bind_equation(eqn, [_plain(x, f) for x, f in zip(vals, flags)]), none


def _inner_call(eqn: jex.JaxprEqn, inner: jex.ClosedJaxpr, vals: Sequence[Value], cp: int, seq: int
                ) -> list[Value]:
    """A checkpoint or plain call with partial-form operands: its body through `eval_partial` (a checkpoint's
    under ``jax.checkpoint`` with its policy)."""

    def body(*args: Value) -> list[Value]:
        env: dict[jex.Var, Value] = dict(zip(inner.jaxpr.constvars, inner.consts))
        env.update(zip(inner.jaxpr.invars, args))
        return eval_partial(inner.jaxpr, env, cp, seq)

    if eqn.primitive.name in CHECKPOINTS:
        params: Mapping[str, Any] = eqn.params
        fn = jax.checkpoint(body, prevent_cse=bool(params.get("prevent_cse", True)), policy=params.get("policy"))
        return list(fn(*vals))
    return body(*vals)


__all__ = ["eval_partial", "from_partials", "is_partial", "spread"]
