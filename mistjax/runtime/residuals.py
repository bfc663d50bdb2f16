"""Split a layer's ``jax.vjp`` residuals into activation-dependent and weight-only leaves.

Keep between forward and backward only the residuals that depend on the activation, and rebuild
the rest in the backward from the (re-fetched) weights. A name-based ``jax.checkpoint`` policy cannot
express this (it still saves the untagged casts / views computed from a tagged weight).
`runtime.remat` keeps them as the residuals of a per-layer ``jax.custom_vjp``; the MPMD pipeline
(`runtime.mpmd_stage`) returns a stage's activation-dependent leaves from its forward program and
puts them back in its backward program.

How: `classify` traces ``jax.vjp(fn, w, h)`` once and walks its jaxpr to find which residual leaves
depend on `h`. In the backward a fresh ``jax.vjp(fn, w, zero_h)`` supplies the treedef and the
weight-only leaves (re-running the weight fetch), `restore_vjp` puts the stored leaves back, and
the activation part of that fresh forward is dead code that XLA removes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeAlias

import jax
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

from mistjax.core.jaxpr import Atom, Visit, is_var, walk
from mistjax.core.types import PyTree

VjpFn: TypeAlias = Callable[[PyTree], tuple[PyTree, ...]]
"""What ``jax.vjp`` returns besides the primal: a pytree (its leaves are the residuals) called on a cotangent."""


def depends(jaxpr: Jaxpr | ClosedJaxpr, seeds: Sequence[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` depend on the inputs flagged in ``seeds``.

    Exact through calls (`core.jaxpr.CALLS`: their bodies are walked), conservative through anything else
    (a loop's or a conditional's every output depends on every input).
    """
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    # Every variable's flag is written, not only the dependent ones': one jaxpr object may be the body of
    # several calls (a cached jit), so a later call must overwrite what an earlier one left.
    dep: dict[Var, bool] = dict(zip(jaxpr.invars, seeds))
    dep.update((v, False) for v in jaxpr.constvars)

    def flag(v: Atom) -> bool:
        return is_var(v) and dep.get(v, False)

    for step in walk(jaxpr):
        eqn, inner = step.eqn, step.inner
        if inner is None:  # a leaf
            d = any(flag(v) for v in eqn.invars)
            dep.update((v, d) for v in eqn.outvars)
        elif step.visit is Visit.ENTER:
            dep.update(zip(inner.jaxpr.invars, [flag(v) for v in eqn.invars], strict=True))
            dep.update((v, False) for v in inner.jaxpr.constvars)
        else:
            dep.update(zip(eqn.outvars, [flag(v) for v in inner.jaxpr.outvars], strict=True))
    return [flag(v) for v in jaxpr.outvars]


@dataclasses.dataclass(frozen=True)
class Residuals:
    """Which leaves of one layer's ``jax.vjp`` residuals are kept between forward and backward."""

    num_leaves: int
    stored: tuple[int, ...]  # leaf indices kept (first occurrence of each activation-dependent value)
    # (shape, dtype, varying axes, in host memory) per stored leaf; host leaves come from an offload policy
    avals: tuple[tuple[tuple[int, ...], np.dtype, frozenset[str], bool], ...]
    aliases: tuple[tuple[int, int], ...]  # (leaf, stored leaf) pairs that are the same value

    @property
    def nbytes(self) -> int:
        """Bytes of the stored leaves, device and host."""
        return self.device_nbytes + self.host_nbytes

    @property
    def device_nbytes(self) -> int:
        """Bytes of the stored leaves kept in device memory."""
        return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt, _, host in self.avals if not host)

    @property
    def host_nbytes(self) -> int:
        """Bytes of the stored leaves an offload policy puts in host memory."""
        return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt, _, host in self.avals if host)

    def take(self, vjp: VjpFn) -> list[jax.Array]:
        """The stored leaves of a ``jax.vjp`` function traced like the classified one."""
        leaves = jax.tree.leaves(vjp)
        if len(leaves) != self.num_leaves:
            raise RuntimeError("the layer's vjp changed structure since it was classified; is the layer a "
                               "pure function of its (weights, activation)?")
        return [leaves[j] for j in self.stored]


def classify(fn: Callable[[PyTree, PyTree], PyTree], w: PyTree, h: PyTree) -> Residuals:
    """Trace ``jax.vjp(fn, w, h)`` and find the residual leaves that depend on the activation `h`."""
    closed = jax.make_jaxpr(lambda w, h: jax.tree.leaves(jax.vjp(fn, w, h)[1]))(w, h)
    num_w = len(jax.tree.leaves(w))
    dep = depends(closed.jaxpr, [k >= num_w for k in range(len(closed.jaxpr.invars))])
    stored: list[int] = []  # output index of each distinct activation-dependent residual
    aliases: list[tuple[int, int]] = []  # (output index, the stored output it repeats)
    first: dict[Var, int] = {}
    for j, (var, d) in enumerate(zip(closed.jaxpr.outvars, dep)):
        if d and var in first:
            aliases.append((j, first[var]))
        elif d:
            first[var] = j
            stored.append(j)
    out = [closed.out_avals[j] for j in stored]
    avals = tuple((tuple(a.shape), np.dtype(a.dtype), a.manual_axis_type.varying,
                   getattr(a, "memory_space", None) == jax.memory.Space.Host) for a in out)
    return Residuals(len(closed.jaxpr.outvars), tuple(stored), avals, tuple(aliases))


def restore_vjp(fresh: VjpFn, res: Residuals, stored: Sequence[jax.Array]) -> VjpFn:
    """`fresh` (a ``jax.vjp`` function traced at a zero activation) with the `stored` leaves put back.

    `fresh` supplies the treedef and the weight-only leaves; its activation-dependent leaves are
    replaced (dead code for XLA), aliases re-pointed to their stored value.
    """
    leaves, treedef = jax.tree.flatten(fresh)
    if len(leaves) != res.num_leaves:
        raise RuntimeError("the layer's vjp changed structure since it was classified; is the layer a "
                           "pure function of its (weights, activation)?")
    for j, value in zip(res.stored, stored):
        leaves[j] = value
    for j, first in res.aliases:
        leaves[j] = leaves[first]
    return jax.tree.unflatten(treedef, leaves)


def vary(tree: PyTree, axes: tuple[str, ...]) -> PyTree:
    """pcast every leaf to varying over the manual `axes` it does not vary over yet."""

    def one(x: jax.Array) -> jax.Array:
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


__all__ = ["Residuals", "VjpFn", "classify", "depends", "restore_vjp", "vary"]
