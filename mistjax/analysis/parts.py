"""Split a traced loss into pre / block / post functions and trace their forward and backward.

`split_parts` turns one `TracedLoss` into three `PartFn`s: the *pre* part (equations before the
layer scan: embedding), one *block* (the scan body: one layer) and the *post* part (equations
after the scan: final norm, head, loss). Each is a function of differentiable inputs (weights
and the hidden state) and non-differentiable ones (batch, constants).

`vjp_jaxprs` traces what training runs for a part under a remat policy: the forward of
``jax.vjp`` (outputs + the residuals JAX keeps, i.e. the leaves of the returned VJP object) and
the backward (the VJP applied to output cotangents, as a function of those residuals).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.extend import core as jex
from jax.tree_util import PyTreeDef

from mistjax.core.jaxpr import Atom, Value, read
from mistjax.core.policies import remat_policy
from mistjax.trace.split import TracedLoss, free_vars, needed_equations, run_equations

WEIGHT, ACT, OTHER = "weight", "act", "other"


@dataclass(frozen=True)
class PartFn:
    """One part of the loss as ``fn(diff, nondiff) -> outputs``.

    Attributes:
      fn: evaluates the part on lists of differentiable / other inputs.
      diff: avals of the differentiable inputs.
      diff_kind: per diff input, ``"weight"`` (a parameter leaf or layer slice of one) or ``"act"``.
      diff_leaf: per diff input, the parameter leaf index (None for activations).
      nondiff: avals of the other inputs (batch, constants).
      num_outputs: outputs of ``fn`` (all differentiated).
    """

    fn: Callable[[list[Value], list[Value]], list[Value]]
    diff: tuple[jax.ShapeDtypeStruct, ...]
    diff_kind: tuple[str, ...]
    diff_leaf: tuple[int | None, ...]
    nondiff: tuple[jax.ShapeDtypeStruct, ...]
    num_outputs: int


def _sds(v: jex.Var) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)


def _float(v: jex.Var) -> bool:
    return jax.dtypes.issubdtype(v.aval.dtype, np.inexact)


def _free_inputs(eqns: Sequence[jex.JaxprEqn], outs: Sequence[Atom]) -> list[jex.Var]:
    """Vars read by ``eqns`` (or returned) that they do not define, in first-use order."""
    return free_vars(eqns, outs, defined=set())


def _sub_fn(
    eqns: Sequence[jex.JaxprEqn], ins: Sequence[jex.Var], outs: Sequence[Atom], consts: dict[jex.Var, Value]
) -> Callable[[list[Value]], list[Value]]:
    def f(args: list[Value]) -> list[Value]:
        env = dict(consts)
        env.update(zip(ins, args))
        run_equations(eqns, env)
        return [read(env, v) for v in outs]

    return f


def _make_part(
    eqns: Sequence[jex.JaxprEqn],
    outs: Sequence[Atom],
    consts: dict[jex.Var, Value],
    leaf_of: dict[jex.Var, int],
    act_inputs: set[jex.Var],
    order: Sequence[jex.Var] = (),
) -> PartFn:
    """A part from its equations. Its inputs come in the order of ``order`` (the jaxpr's inputs), then in
    first-use order: first use alone would differ between the traces at different sizes when a size makes
    JAX drop an equation (``pos[:s]`` at the table's full length reads the table later)."""
    eqns = needed_equations(eqns, outs)
    rank = {v: k for k, v in enumerate(order)}
    free = sorted((v for v in _free_inputs(eqns, outs) if v not in consts), key=lambda v: rank.get(v, len(rank)))
    diff = [v for v in free if _float(v) and (v in leaf_of or v in act_inputs)]
    nondiff = [v for v in free if v not in diff]
    inner = _sub_fn(eqns, diff + nondiff, outs, consts)
    return PartFn(
        fn=lambda d, nd: inner(list(d) + list(nd)),
        diff=tuple(_sds(v) for v in diff),
        diff_kind=tuple(WEIGHT if v in leaf_of else ACT for v in diff),
        diff_leaf=tuple(leaf_of.get(v) for v in diff),
        nondiff=tuple(_sds(v) for v in nondiff),
        num_outputs=len(outs),
    )


def split_parts(traced: TracedLoss) -> dict[str, PartFn]:
    """The pre, block and post parts of a traced loss with a layer stack."""
    stack = traced.require_stack()
    jaxpr = traced.closed.jaxpr
    consts = dict(zip(jaxpr.constvars, traced.closed.consts))
    leaf_of = {v: i for i, v in enumerate(jaxpr.invars[: traced.num_param_leaves])}
    scan = jaxpr.eqns[stack.eqn_index]
    pre_eqns, post_eqns = jaxpr.eqns[: stack.eqn_index], jaxpr.eqns[stack.eqn_index + 1 :]
    nc, ncar = stack.num_consts, stack.num_carry
    pre_defined = {v for e in pre_eqns for v in e.outvars}
    pre_outs = [v for v in scan.invars if isinstance(v, jex.Var) and v in pre_defined and _float(v)]
    pre = _make_part(pre_eqns, pre_outs, consts, leaf_of, set(), jaxpr.invars)
    post = _make_part(post_eqns, [jaxpr.outvars[0]], consts, leaf_of, set(scan.outvars),
                      [*scan.outvars, *jaxpr.invars])

    body = stack.body
    bj = body.jaxpr
    body_consts = dict(zip(bj.constvars, body.consts))
    slice_leaf = {bj.invars[nc + ncar + k]: i for k, i in enumerate(stack.xs_leaf) if i is not None}
    carry_vars = {v for v in bj.invars[nc : nc + ncar] if _float(v)}
    block = _make_part(bj.eqns, list(bj.outvars), body_consts, slice_leaf, carry_vars, bj.invars)
    return {"pre": pre, "block": block, "post": post}


@dataclass(frozen=True)
class VjpTrace:
    """Forward and backward jaxprs of one part under one remat policy."""

    fwd: jex.ClosedJaxpr  # (diff..., nondiff...) -> (outputs..., residuals...)
    bwd: jex.ClosedJaxpr  # (residuals..., output cotangents...) -> diff cotangents
    num_outputs: int
    num_diff: int


def vjp_jaxprs(part: PartFn, policy: str = "none") -> VjpTrace:
    """Trace training's forward (with residuals) and backward for ``part``.

    Args:
      part: the part to differentiate w.r.t. its ``diff`` inputs.
      policy: ``"none"`` (no remat) or a remat policy name of `mistjax.runtime.remat`
        (``full``, ``dots``, ``names:a,b``); the part is wrapped in ``jax.checkpoint`` with it.
    """
    box: list[PyTreeDef] = []
    nd_count = len(part.diff)

    def fwd(*flat: Value) -> tuple[list[Value], list[Value]]:
        d, nd = list(flat[:nd_count]), list(flat[nd_count:])
        f = lambda dd: part.fn(dd, nd)  # noqa: E731
        if policy != "none":
            f = jax.checkpoint(f, policy=remat_policy(policy), prevent_cse=True)
        outs, vjp = jax.vjp(f, d)
        leaves, tree = jax.tree.flatten(vjp)
        box.append(tree)
        return list(outs), leaves

    fj = jax.make_jaxpr(fwd)(*part.diff, *part.nondiff)
    tree = box[0]
    res = [_sds(v) for v in fj.jaxpr.outvars[part.num_outputs :]]
    cts = [_sds(v) for v in fj.jaxpr.outvars[: part.num_outputs]]

    def bwd(*flat: Value) -> list[Value]:
        r, c = list(flat[: len(res)]), list(flat[len(res) :])
        (grads,) = jax.tree.unflatten(tree, r)(c)
        return list(grads)

    bj = jax.make_jaxpr(bwd)(*res, *cts)
    return VjpTrace(fwd=fj, bwd=bj, num_outputs=part.num_outputs, num_diff=nd_count)
