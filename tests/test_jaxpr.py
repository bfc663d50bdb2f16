"""The one table of call-like primitives, its walker and its interpreter (`mistjax.core.jaxpr`)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mistjax.core.jaxpr import (
    CALLS,
    CHECKPOINTS,
    CLOSED_CALL,
    CUSTOM_VJP,
    INLINABLE,
    JIT,
    PER_DEVICE,
    PLAIN_CALLS,
    Visit,
    eval_jaxpr,
    inline_calls,
    inner_jaxpr,
    iter_eqns,
    walk,
)

X = jnp.linspace(0.1, 1.0, 8).reshape(2, 4)


@jax.custom_jvp
def _jvp_sin(x: jax.Array) -> jax.Array:
    return jnp.sin(x)


_jvp_sin.defjvp(lambda p, t: (_jvp_sin(p[0]), jnp.cos(p[0]) * t[0]))


@jax.custom_vjp
def _vjp_sin(x: jax.Array) -> jax.Array:
    return jax.jit(jnp.sin)(x)


_vjp_sin.defvjp(lambda x: (_vjp_sin(x), x), lambda x, ct: (jnp.cos(x) * ct,))


def _scan_sum(x: jax.Array) -> jax.Array:
    c, _ = jax.lax.scan(lambda c, row: (jnp.sin(c * row), None), x[0], x)
    return c.sum()


def _shard_mapped(x: jax.Array) -> jax.Array:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    return jax.shard_map(lambda a: a * 2.0, mesh=mesh, in_specs=P(), out_specs=P())(x)


# Per table entry, a function JAX traces to that primitive (closed_call: JAX's partial evaluation emits it
# for the known part of a checkpointed scan's VJP).
PRODUCERS: dict[str, Callable[[jax.Array], object]] = {
    "jit": jax.jit(jnp.sin),
    CLOSED_CALL: lambda x: jax.vjp(jax.checkpoint(_scan_sum), x),
    "remat2": jax.checkpoint(jnp.sin),
    "custom_jvp_call": _jvp_sin,
    "custom_vjp_call": _vjp_sin,
    "shard_map": _shard_mapped,
}


def test_every_entry_has_a_producer():
    assert set(PRODUCERS) == set(CALLS)
    assert set(CALLS) >= CHECKPOINTS | CUSTOM_VJP | PER_DEVICE | PLAIN_CALLS
    assert JIT in PLAIN_CALLS and not PER_DEVICE & INLINABLE


@pytest.mark.parametrize("name", sorted(CALLS))
def test_table_entry_on_a_traced_function(name):
    closed = jax.make_jaxpr(PRODUCERS[name])(X)
    eqns = [e for e in iter_eqns(closed, bodies=True) if e.primitive.name == name]
    assert eqns, f"no {name} equation in {closed}"
    for eqn in eqns:
        assert CALLS[name] in eqn.params  # the table names the parameter JAX uses
        inner = inner_jaxpr(eqn)
        assert inner is not None
        # A call applies its body once to its operands.
        assert len(inner.jaxpr.invars) == len(eqn.invars)
        assert len(inner.jaxpr.outvars) == len(eqn.outvars)


def test_pjit_in_custom_vjp_in_checkpoint_is_walked_to_its_leaves():
    closed = jax.make_jaxpr(jax.checkpoint(lambda x: _vjp_sin(x) * 2.0))(X)
    steps = [(s.visit, s.eqn.primitive.name) for s in walk(closed)]
    assert steps == [
        (Visit.ENTER, "remat2"),
        (Visit.ENTER, "custom_vjp_call"),
        (Visit.ENTER, "jit"),
        (Visit.LEAF, "sin"),
        (Visit.EXIT, "jit"),
        (Visit.EXIT, "custom_vjp_call"),
        (Visit.LEAF, "mul"),
        (Visit.EXIT, "remat2"),
    ]
    assert [e.primitive.name for e in iter_eqns(closed)] == ["remat2", "custom_vjp_call", "jit", "sin", "mul"]
    # Only the named calls are entered.
    assert [(s.visit, s.eqn.primitive.name) for s in walk(closed, enter={"remat2"})] == [
        (Visit.ENTER, "remat2"), (Visit.LEAF, "custom_vjp_call"), (Visit.LEAF, "mul"), (Visit.EXIT, "remat2")]


def test_a_scan_is_not_entered_unless_asked():
    closed = jax.make_jaxpr(lambda x, c: jax.lax.scan(lambda c, r: (jax.jit(jnp.sin)(c * r), None), c, x)[0])(
        X, X[0])
    assert [(s.visit, s.eqn.primitive.name) for s in walk(closed)] == [(Visit.LEAF, "scan")]
    assert inner_jaxpr(closed.jaxpr.eqns[0]) is None
    assert [e.primitive.name for e in iter_eqns(closed)] == ["scan"]
    assert [e.primitive.name for e in iter_eqns(closed, bodies=True)] == ["scan", "mul", "jit", "sin"]


def _prims(closed: jax.extend.core.ClosedJaxpr) -> set[str]:
    return {e.primitive.name for e in iter_eqns(closed, bodies=True)}


def test_inline_calls_removes_calls_and_keeps_values():
    fun = jax.checkpoint(lambda x: _jvp_sin(_vjp_sin(x)) + jax.jit(jnp.cos)(x))
    closed = jax.make_jaxpr(fun)(X)
    flat = inline_calls(closed)
    assert not _prims(flat) & set(CALLS)
    want = np.asarray(fun(X))
    np.testing.assert_allclose(np.asarray(eval_jaxpr(flat.jaxpr, flat.consts, [X])[0]), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(eval_jaxpr(closed.jaxpr, closed.consts, [X], INLINABLE)[0]), want,
                               rtol=1e-6)


def test_inline_calls_by_name_and_depth():
    closed = jax.make_jaxpr(jax.jit(lambda x: jax.jit(jax.checkpoint(jnp.sin))(x)))(X)
    top = inline_calls(closed, PLAIN_CALLS, depth=1)
    assert [e.primitive.name for e in top.jaxpr.eqns] == ["jit"]  # only the outer jit is gone
    assert [e.primitive.name for e in inline_calls(closed, PLAIN_CALLS).jaxpr.eqns] == ["remat2"]
    no_call = jax.make_jaxpr(jnp.sin)(X)
    assert inline_calls(no_call) is no_call
    sharded = jax.make_jaxpr(_shard_mapped)(X)
    assert [e.primitive.name for e in inline_calls(sharded).jaxpr.eqns] == ["shard_map"]  # per-device body
