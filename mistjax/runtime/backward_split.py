"""A backward pass split into its input-gradient part (B) and its weight-gradient part (W).

Zero-bubble pipeline schedules (docs/pipelines.md) run a stage's backward as two programs: B computes the
cotangent the previous stage waits for, W the weight gradients, later, in what would be a bubble. The split
is exact and nothing is computed twice: the backward's jaxpr (calls inlined) is partitioned by liveness into
the equations B's outputs need and the rest, and W reads what it needs of B's values as a *stash* (the
gradients at the weight matmuls' outputs, values a checkpointed layer recomputed). A layer loop (``scan``) is
split the same way into two loops: B's carries the activation cotangent and stacks the stash per layer, W's
carries the gradient accumulators and reads the stacked stash.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from mistjax.core.jaxpr import (
    INLINABLE,
    Atom,
    Value,
    bind_equation,
    inner_jaxpr,
    is_var,
    read,
    scan_counts,
    shaped,
)


class SplitError(ValueError):
    """A backward pass cannot be split (its input gradient reads a weight gradient's inputs it should not)."""


def _shape_struct(v: Var) -> jax.ShapeDtypeStruct:
    a = shaped(v)
    return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))


def flatten(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` re-traced with every call inlined, in loop bodies too (only loops and primitives remain)."""

    def run(jaxpr: Jaxpr, consts: Sequence[Value], args: Sequence[Value]) -> list[Value]:
        env: dict[Var, Value] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            vals = [read(env, v) for v in eqn.invars]
            inner = inner_jaxpr(eqn) if eqn.primitive.name in INLINABLE else None
            if inner is not None:
                outs = run(inner.jaxpr, inner.consts, vals)
            elif eqn.primitive.name == "scan":
                params = dict(eqn.params, jaxpr=flatten(eqn.params["jaxpr"]))
                eqn = eqn.replace(params=params)
                outs = bind_equation(eqn, vals)
            else:
                outs = bind_equation(eqn, vals)
            env.update(zip(eqn.outvars, outs))
        return [read(env, v) for v in jaxpr.outvars]

    def flat(*args: Value) -> list[Value]:
        return run(closed.jaxpr, closed.consts, args)

    return jax.make_jaxpr(flat)(*[_shape_struct(v) for v in closed.jaxpr.invars])


@dataclasses.dataclass(frozen=True)
class ScanPart:
    """One half (B or W) of a split ``scan`` equation.

    Attributes:
      eqn: the original scan equation.
      body: the half's body equations (primitives and nested `ScanPart`s).
      consts / carry / xs: the original operand indices this half reads, by role.
      carry_out: the indices (into the carry) of the carries this half produces.
      ys_out: the indices (into the stacked outputs) this half produces.
      body_in: the body variables bound to this half's operands, in order consts, carry, xs, extra.
      body_out: the body variables it returns, in order carry_out, ys_out, extra.
      extra_in: outer variables read as extra stacked operands (the W half's stash), after xs.
      extra_out: outer variables bound to its extra stacked outputs (the B half's stash).
    """

    eqn: JaxprEqn
    body: tuple[Node, ...]
    consts: tuple[int, ...]
    carry: tuple[int, ...]
    xs: tuple[int, ...]
    carry_out: tuple[int, ...]
    ys_out: tuple[int, ...]
    body_in: tuple[Var, ...]
    body_out: tuple[Atom, ...]
    extra_in: tuple[Var, ...] = ()
    extra_out: tuple[Var, ...] = ()

    def outvars(self) -> list[Var]:
        nc, ncar = scan_counts(self.eqn.params)
        outs = self.eqn.outvars
        return [*(outs[i] for i in self.carry_out), *(outs[ncar + i] for i in self.ys_out), *self.extra_out]

    def invars(self) -> list[Atom]:
        nc, ncar = scan_counts(self.eqn.params)
        ins = self.eqn.invars
        return [*(ins[i] for i in self.consts), *(ins[nc + i] for i in self.carry),
                *(ins[nc + ncar + i] for i in self.xs), *self.extra_in]


Node = JaxprEqn | ScanPart


class Split(NamedTuple):
    """A jaxpr's equations split into B and W (see module docstring)."""

    b: tuple[Node, ...]
    w: tuple[Node, ...]
    stash: tuple[Var, ...]  # variables B defines that W reads
    b_in: frozenset[Var]  # input variables B reads
    w_in: frozenset[Var]  # input variables W reads


def _vars(atoms: Sequence[Atom]) -> list[Var]:
    return [v for v in atoms if is_var(v)]


def _node_in(node: Node) -> list[Var]:
    return _vars(node.invars() if isinstance(node, ScanPart) else node.invars)


def _node_out(node: Node) -> list[Var]:
    return _vars(node.outvars() if isinstance(node, ScanPart) else node.outvars)


def split_jaxpr(jaxpr: Jaxpr, used_b: Sequence[bool], used_w: Sequence[bool]) -> Split:
    """Partition ``jaxpr``'s equations: B computes the outputs flagged in `used_b`, W those in `used_w` that B
    does not, reading B's values through the stash. Loops with outputs on both sides are split in two.

    Two liveness passes: B's (which equations, and which outputs of each loop, B needs), then W's (the rest
    of what W's outputs need; a loop's W half reads per-layer values of its B half as a stacked stash).
    """
    in_b = _b_liveness(jaxpr, used_b)
    w_nodes, halves, w_reads = _w_liveness(jaxpr, used_w, in_b)
    # B's nodes in program order, each mixed scan as its B half (whose body stashes what W's half reads).
    b_nodes = [halves[idx][0] if idx in halves else jaxpr.eqns[idx] for idx in sorted(in_b)]
    b_reads = {v for node in b_nodes for v in _node_in(node)}
    passed = {v for v, u in zip(jaxpr.outvars, used_b) if u and is_var(v)}  # inputs returned as they are
    b_in = frozenset(v for v in jaxpr.invars if v in b_reads or v in passed)
    stash = tuple(dict.fromkeys(v for node in b_nodes for v in _node_out(node) if v in w_reads))
    w_in = frozenset(v for v in jaxpr.invars if v in w_reads)
    return Split(tuple(b_nodes), tuple(w_nodes), stash, b_in, w_in)


def _b_liveness(jaxpr: Jaxpr, used_b: Sequence[bool]) -> dict[int, list[bool]]:
    """Equation index -> which of its outputs B needs, for the equations B runs (a scan: its B half's)."""
    need = {v for v, u in zip(jaxpr.outvars, used_b) if u and is_var(v)}
    in_b: dict[int, list[bool]] = {}
    for idx in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[idx]
        ub = [is_var(o) and o in need for o in eqn.outvars]
        if not any(ub):
            continue
        in_b[idx] = ub
        if eqn.primitive.name == "scan":
            need.update(v for v, u in zip(eqn.invars, _scan_b_inputs(eqn, ub)) if u and is_var(v))
        else:
            need.update(_vars(eqn.invars))
    return in_b


def _w_liveness(jaxpr: Jaxpr, used_w: Sequence[bool], in_b: dict[int, list[bool]]
                ) -> tuple[list[Node], dict[int, tuple[ScanPart, ScanPart | None]], set[Var]]:
    """W's nodes in program order, the halves of the scans B runs part of, and every variable W reads."""
    need = {v for v, u in zip(jaxpr.outvars, used_w) if u and is_var(v)}
    nodes_rev: list[Node] = []
    halves: dict[int, tuple[ScanPart, ScanPart | None]] = {}
    for idx in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[idx]
        uw = [is_var(o) and o in need for o in eqn.outvars]
        if eqn.primitive.name == "scan" and idx in in_b:
            # Outputs B's half produces are stash when W reads them; W's half produces the rest.
            b_half, w_half = _split_scan(eqn, in_b[idx], [w and not b for w, b in zip(uw, in_b[idx])])
            halves[idx] = (b_half, w_half)
            if w_half is not None:
                nodes_rev.append(w_half)
                need.update(_vars(w_half.invars()))
        elif any(uw) and idx not in in_b:
            nodes_rev.append(eqn)
            need.update(_vars(eqn.invars))
    return nodes_rev[::-1], halves, need


def _scan_b_inputs(eqn: JaxprEqn, ub: list[bool]) -> list[bool]:
    """Which operands of a scan the outputs `ub` read (the carries' fixpoint)."""
    nc, ncar = scan_counts(eqn.params)
    body = eqn.params["jaxpr"].jaxpr
    carry_b = _carry_fixpoint(body, nc, ncar, ub[:ncar], ub[ncar:])
    used = _live_inputs(body, [*carry_b, *ub[ncar:]])
    return used


def _live_inputs(body: Jaxpr, used_out: Sequence[bool]) -> list[bool]:
    need = {v for v, u in zip(body.outvars, used_out) if u and is_var(v)}
    for eqn in reversed(body.eqns):
        if any(is_var(o) and o in need for o in eqn.outvars):
            need.update(_vars(eqn.invars))
    return [v in need for v in body.invars]


def _carry_fixpoint(body: Jaxpr, nc: int, ncar: int, carry: Sequence[bool], ys: Sequence[bool]) -> list[bool]:
    """The carries a scan's outputs need: a carry read in the body must be carried."""
    carry = list(carry)
    while True:
        used = _live_inputs(body, [*carry, *ys])
        new = [c or u for c, u in zip(carry, used[nc:nc + ncar])]
        if new == carry:
            return carry
        carry = new


def _split_scan(eqn: JaxprEqn, ub: list[bool], uw: list[bool]) -> tuple[ScanPart, ScanPart | None]:
    """The B and W halves of a scan whose outputs `ub` B needs and `uw` W needs (and B does not produce)."""
    nc, ncar = scan_counts(eqn.params)
    closed = eqn.params["jaxpr"]
    body = closed.jaxpr
    if closed.consts:
        raise SplitError("a flattened scan body closes over constants; re-trace it with `flatten`")
    n_in = len(body.invars)
    carry_b = _carry_fixpoint(body, nc, ncar, ub[:ncar], ub[ncar:])
    ys_b = list(ub[ncar:])
    # W's carries: those it needs that B does not carry (B's carried values it reads are stashed per layer).
    carry_w = [w and not b for w, b in zip(uw[:ncar], carry_b)]
    ys_w = [w and not b for w, b in zip(uw[ncar:], ys_b)]
    while True:
        inner = split_jaxpr(body, [*carry_b, *ys_b], [*carry_w, *ys_w])
        read = inner.w_in
        new = [c or (body.invars[nc + j] in read and not carry_b[j]) for j, c in enumerate(carry_w)]
        if new == carry_w:
            break
        carry_w = new
    carry_in_b = {body.invars[nc + j] for j in range(ncar) if carry_b[j]}
    # A B-carried value W reads is stashed per layer (B returns it as a stacked output).
    stash_body = list(inner.stash) + [v for v in body.invars if v in inner.w_in and v in carry_in_b]
    idx = range(n_in)
    b_consts = tuple(i for i in range(nc) if body.invars[i] in inner.b_in)
    b_xs = tuple(i - nc - ncar for i in idx[nc + ncar:] if body.invars[i] in inner.b_in)
    b_carry = tuple(j for j in range(ncar) if carry_b[j])
    stash_outer = tuple(Var(jax.core.ShapedArray((eqn.params["length"], *v.aval.shape), v.aval.dtype))
                        for v in stash_body)
    b_half = ScanPart(
        eqn=eqn, body=inner.b, consts=b_consts, carry=b_carry, xs=b_xs,
        carry_out=b_carry, ys_out=tuple(i for i, u in enumerate(ys_b) if u),
        body_in=tuple([*(body.invars[i] for i in b_consts), *(body.invars[nc + j] for j in b_carry),
                       *(body.invars[nc + ncar + i] for i in b_xs)]),
        body_out=tuple([*(body.outvars[j] for j in b_carry), *(body.outvars[ncar + i] for i, u in enumerate(ys_b)
                                                               if u), *stash_body]),
        extra_out=stash_outer)
    if not any(carry_w) and not any(ys_w):
        if stash_body:
            raise SplitError("internal: a scan's W half has no outputs but reads a stash")
        return b_half, None
    w_reads = inner.w_in - carry_in_b
    w_consts = tuple(i for i in range(nc) if body.invars[i] in w_reads)
    w_carry = tuple(j for j in range(ncar) if carry_w[j])
    w_xs = tuple(i - nc - ncar for i in idx[nc + ncar:] if body.invars[i] in w_reads)
    w_half = ScanPart(
        eqn=eqn, body=inner.w, consts=w_consts, carry=w_carry, xs=w_xs,
        carry_out=w_carry, ys_out=tuple(i for i, u in enumerate(ys_w) if u),
        body_in=tuple([*(body.invars[i] for i in w_consts), *(body.invars[nc + j] for j in w_carry),
                       *(body.invars[nc + ncar + i] for i in w_xs), *stash_body]),
        body_out=tuple([*(body.outvars[j] for j in w_carry), *(body.outvars[ncar + i] for i, u in enumerate(ys_w)
                                                               if u)]),
        extra_in=stash_outer)
    return b_half, w_half


def run_nodes(nodes: Sequence[Node], env: dict[Var, Value]) -> None:
    """Evaluate split nodes in order, reading and writing ``env``."""
    for node in nodes:
        if isinstance(node, ScanPart):
            outs = _run_scan(node, [read(env, v) for v in node.invars()])
            env.update(zip(node.outvars(), outs))
        else:
            env.update(zip(node.outvars, bind_equation(node, [read(env, v) for v in node.invars])))


def _run_scan(part: ScanPart, args: list[Value]) -> list[Value]:
    n_c, n_car = len(part.consts), len(part.carry)
    consts, carry, xs = args[:n_c], args[n_c:n_c + n_car], args[n_c + n_car:]
    n_carry_out = len(part.carry_out)

    def body(c: list[Value], x: list[Value]) -> tuple[list[Value], list[Value]]:
        env = dict(zip(part.body_in, [*consts, *c, *x]))
        run_nodes(part.body, env)
        outs = [read(env, v) for v in part.body_out]
        return outs[:n_carry_out], outs[n_carry_out:]

    p = part.eqn.params
    carry_out, ys = jax.lax.scan(body, carry, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    return [*carry_out, *ys]


class SplitBackward(NamedTuple):
    """A backward function split in two (`split_backward`).

    Attributes:
      b: ``b(*args) -> (outputs flagged B, stash)``.
      w: ``w(*args, *stash) -> outputs flagged W`` (`args`: the same arguments; those W does not read are
        unused, so a program may pass placeholders).
      stash: the stash's shapes and dtypes.
      b_reads / w_reads: per argument, whether B / W reads it.
    """

    b: Callable[..., tuple[list[Value], list[Value]]]
    w: Callable[..., list[Value]]
    stash: tuple[jax.ShapeDtypeStruct, ...]
    b_reads: tuple[bool, ...]
    w_reads: tuple[bool, ...]


def split_backward(fn: Callable[..., Sequence[Value]], args: Sequence[jax.ShapeDtypeStruct | Value],
                   is_b: Sequence[bool]) -> SplitBackward:
    """Split ``fn`` (flat arguments -> flat outputs) into B (the outputs flagged in `is_b`) and W (the rest).

    Raises:
      SplitError: if an output B needs is one W would have to compute first (never for a backward pass: an
        input gradient does not read a weight gradient).
    """
    closed = flatten(jax.make_jaxpr(lambda *a: list(fn(*a)))(*args))
    jaxpr = closed.jaxpr
    is_w = [not b for b in is_b]
    parts = split_jaxpr(jaxpr, is_b, is_w)
    consts = dict(zip(jaxpr.constvars, closed.consts))

    def b(*a: Value) -> tuple[list[Value], list[Value]]:
        env: dict[Var, Value] = {**consts, **dict(zip(jaxpr.invars, a))}
        run_nodes(parts.b, env)
        return ([_out(env, v) for v, u in zip(jaxpr.outvars, is_b) if u], [env[v] for v in parts.stash])

    def w(*a: Value) -> list[Value]:
        n = len(jaxpr.invars)
        env: dict[Var, Value] = {**consts, **dict(zip(jaxpr.invars, a[:n]))}
        env.update(zip(parts.stash, a[n:]))
        run_nodes(parts.w, env)
        return [_out(env, v) for v, u in zip(jaxpr.outvars, is_w) if u]

    return SplitBackward(b, w, tuple(_shape_struct(v) for v in parts.stash),
                         tuple(v in parts.b_in for v in jaxpr.invars), tuple(v in parts.w_in for v in jaxpr.invars))


def _out(env: dict[Var, Value], v: Atom) -> Value:
    return v.val if isinstance(v, Literal) else env[v]


__all__ = ["Split", "SplitBackward", "SplitError", "flatten", "run_nodes", "split_backward", "split_jaxpr"]
