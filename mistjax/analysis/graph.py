"""A flattened view of a jaxpr with symbolic shapes, built from traces at several sizes.

The analysis never traces with symbolic shapes: Flax models compare, slice and build masks from
the sequence length, which `jax.export.symbolic_shape` handles only in part. Instead the same
computation is traced at six concrete ``(b, s)`` points (plus one check point). The traces have
the same equations in the same order, so every variable's dims can be matched position by
position and fitted exactly with `fit_dim` (degree <= 1 in b, <= 2 in s); the check point
verifies the fit. A structural difference between the traces (the model branches on a size) is
reported as an error naming the primitive.

Call-like equations (``pjit``, ``remat``, ``custom_jvp_call``, ``custom_vjp_call``,
``closed_call``, ``shard_map``) are inlined, so a `Graph` is a flat list of leaf `Node`s; loops
and conditionals (``scan``, ``while``, ``cond``) keep their bodies as nested graphs with a trip
count (a fitted polynomial for ``scan``; 1 for ``while``, whose count is unknown).

Fused attention (`mistjax.analysis.fused`): the nodes inlined from a blockwise kernel's named ``jit``
and cuDNN's attention primitives carry the unit's name (``Node.unit``), and every such call is listed in
``Graph.units``.

Eager kernels: a value passed to an identity ``jit`` named `EAGER_JIT` is one a runtime that executes the
model op by op (PyTorch eager) writes to memory; the builder records it in ``Graph.eager``, which the
kernel model (`mistjax.analysis.kernels`) materialises. The marker adds no node, FLOP or buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.extend import core as jex

from mistjax.analysis.fused import UnitCall, unit_of
from mistjax.analysis.poly import Poly, fit_dim

CALL_PARAMS = {  # primitive -> param holding the inlined jaxpr
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "shard_map": "jaxpr",
}

CHECKPOINTS = frozenset({"remat", "remat2", "checkpoint"})
# Name of the identity ``jit`` that marks a value an eager runtime writes (models.layers.eager_written).
EAGER_JIT = "eager_kernel"
REGIONS = CHECKPOINTS | {"custom_vjp_call", "custom_vjp_call_jaxpr"}


def names(text: str) -> frozenset[str]:
    """A set of primitive names from a whitespace-separated list (keeps long tables compact)."""
    return frozenset(text.split())


class StructureError(ValueError):
    """Traces at different sizes differ in structure, so their shapes cannot be matched."""


@dataclass(eq=False)
class CallSite:
    """An inlined ``jax.checkpoint`` / ``custom_vjp`` equation: its inputs and outputs as graph values."""

    eqn: Any
    ins: tuple[Any, ...]
    outs: tuple[Any, ...] = ()

    @property
    def checkpoint(self) -> bool:
        return self.eqn.primitive.name in CHECKPOINTS


@dataclass(eq=False)
class Node:
    """One leaf equation (identity-hashed), or a loop / conditional with nested graphs."""

    prim: str
    params: dict[str, Any]
    ins: list[Any]  # jex.Var or jex.Literal (after inlining substitutions)
    outs: list[Any]  # jex.Var (or DropVar)
    eqn: Any  # the reference equation (source info for messages)
    subs: list[Graph] = field(default_factory=list)  # scan/while body, cond branches
    length: Poly | None = None  # trip count of a scan / while
    unit: str | None = None  # the fused-attention kernel this node belongs to (mistjax.analysis.fused)
    unit_block: int | None = None  # keys per block of that kernel when it is blockwise
    # The outermost ``jax.checkpoint`` or ``custom_vjp`` call this node was inlined from (None: none). The
    # tensor-parallel runtime evaluates such runs of nodes as that call again: flat, autodiff would keep
    # every intermediate of the recomputed norms and activations and of the attention kernel.
    call: CallSite | None = None


@dataclass(eq=False)
class Graph:
    """A flattened jaxpr: inputs, leaf nodes in program order, outputs, symbolic dims."""

    invars: list[Any]
    constvars: list[Any]
    nodes: list[Node]
    outvars: list[Any]
    dims: dict[Any, tuple[Poly, ...]]  # shared by nested graphs: var -> fitted dims
    consts: dict[Any, Any] = field(default_factory=dict)  # shared: constvar -> value (inlined ones too)
    units: list[UnitCall] = field(default_factory=list)  # fused-attention calls (top-level graph only)
    eager: set[Any] = field(default_factory=set)  # shared: values an eager runtime writes (EAGER_JIT inputs)

    def shape(self, v: Any) -> tuple[Poly, ...]:
        if isinstance(v, jex.Literal):
            return tuple(Poly.const(int(d)) for d in np.shape(v.val))
        return self.dims[v]

    def walk(self) -> list[Node]:
        """Every node, nested bodies included (pre-order)."""
        out = []
        for n in self.nodes:
            out.append(n)
            for g in n.subs:
                out.extend(g.walk())
        return out


def _is_var(v: Any) -> bool:
    return isinstance(v, jex.Var) and not isinstance(v, jex.DropVar)


def _call_jaxpr(eqn: Any) -> Any | None:
    name = eqn.primitive.name
    if name not in CALL_PARAMS:
        return None
    key = CALL_PARAMS[name]
    if key not in eqn.params:
        key = next((k for k, v in eqn.params.items() if isinstance(v, jex.ClosedJaxpr | jex.Jaxpr)), None)
    return None if key is None else eqn.params[key]


def _open(j: Any) -> tuple[Any, list[Any]]:
    return (j.jaxpr, list(j.consts)) if isinstance(j, jex.ClosedJaxpr) else (j, [])


class _Builder:
    def __init__(self, points: Sequence[tuple[int, int]]):
        self.points = list(points)
        self.dims: dict[Any, tuple[Poly, ...]] = {}
        self.consts: dict[Any, Any] = {}
        self.units: list[UnitCall] = []
        self.unit: tuple[str, int | None] | None = None  # (name, block) of the fused kernel being inlined
        self._defined: set[Any] = set()  # vars some leaf node already defines (see `_define`)
        self.call: CallSite | None = None  # the outermost checkpoint / custom_vjp call being inlined
        self.eager: set[Any] = set()  # values passed to an EAGER_JIT marker (shared by nested graphs)

    def fit(self, ref: Any, others: Sequence[Any]) -> None:
        if not _is_var(ref) or ref in self.dims:
            return
        shapes = [tuple(ref.aval.shape)] + [tuple(o.aval.shape) for o in others]
        if any(len(sh) != len(shapes[0]) for sh in shapes):
            raise StructureError(f"rank of {ref} differs between traces: {shapes}")
        if not self.points or len(shapes) == 1:
            self.dims[ref] = tuple(Poly.const(int(d)) for d in shapes[0])
            return
        fitted = []
        for d in range(len(shapes[0])):
            vals = [int(sh[d]) for sh in shapes]
            poly = fit_dim(vals, self.points)
            fitted.append(poly)
        self.dims[ref] = tuple(fitted)

    def graph(self, ref: Any, others: Sequence[Any]) -> Graph:
        rj, consts = _open(ref)
        self.consts.update(zip(rj.constvars, consts))
        ojs = [_open(o)[0] for o in others]
        for k, v in enumerate(rj.invars):
            self.fit(v, [o.invars[k] for o in ojs])
        for k, v in enumerate(rj.constvars):
            self.fit(v, [o.constvars[k] for o in ojs])
        env: dict[Any, Any] = {}
        nodes: list[Node] = []
        self._eqns(rj, ojs, env, nodes)
        sub = lambda v: env.get(v, v) if _is_var(v) else v  # noqa: E731
        outvars = [sub(v) for v in rj.outvars]
        return Graph(
            invars=list(rj.invars),
            constvars=list(rj.constvars),
            nodes=_dce(nodes, outvars),
            outvars=outvars,
            dims=self.dims,
            consts=self.consts,
            eager=self.eager,
        )

    def _define(self, v: Any, env: dict[Any, Any]) -> Any:
        """The var a leaf equation defines: a fresh one when ``v`` was defined before (the same inner jaxpr
        inlined twice, e.g. one jitted helper called per chunk), so each call's buffers live their own span."""
        if not _is_var(v):
            return v
        if v not in self._defined:
            self._defined.add(v)
            return v
        fresh = type(v)(v.aval)
        if v in self.dims:
            self.dims[fresh] = self.dims[v]
        env[v] = fresh
        return fresh

    def _eqns(self, rj: Any, ojs: Sequence[Any], env: dict[Any, Any], nodes: list[Node]) -> None:
        if any(len(o.eqns) != len(rj.eqns) for o in ojs):
            at = f" at (b, s) = {self.points}" if len(self.points) == len(ojs) + 1 else ""  # which size branches
            raise StructureError(
                f"traces at different sizes{at} have {[len(rj.eqns)] + [len(o.eqns) for o in ojs]} "
                "equations; the computation branches on the batch or sequence size"
            )
        sub = lambda v: env.get(v, v) if _is_var(v) else v  # noqa: E731
        for k, eqn in enumerate(rj.eqns):
            others = [o.eqns[k] for o in ojs]
            name = eqn.primitive.name
            if any(o.primitive.name != name for o in others):
                raise StructureError(
                    f"equation {k} is {name} in one trace and {[o.primitive.name for o in others]} in others"
                )
            for j, v in enumerate(eqn.outvars):
                self.fit(v, [o.outvars[j] for o in others])
            inner = _call_jaxpr(eqn)
            if name in ("pjit", "jit") and eqn.params.get("name") == EAGER_JIT:
                # The marker is an identity: its inputs are the marked values (JAX's partial evaluation may
                # have dropped its outputs, which are the same values).
                self.eager.update(sub(v) for v in eqn.invars if _is_var(v))
            if inner is not None:
                unit = unit_of(str(eqn.params.get("name", ""))) if self.unit is None else None
                outer_unit, outer_call = self.unit, self.call
                if unit is not None:
                    self.unit = (str(eqn.params["name"]), unit[1])
                if self.call is None and name in REGIONS:
                    self.call = CallSite(eqn, tuple(sub(v) for v in eqn.invars))
                ij, consts = _open(inner)
                self.consts.update(zip(ij.constvars, consts))
                oijs = [_open(_call_jaxpr(o))[0] for o in others]
                for j, v in enumerate(ij.constvars):
                    self.fit(v, [o.constvars[j] for o in oijs])
                for j, v in enumerate(ij.invars):
                    self.fit(v, [o.invars[j] for o in oijs])
                    env[v] = sub(eqn.invars[j]) if j < len(eqn.invars) else v
                self._eqns(ij, oijs, env, nodes)
                for j, v in enumerate(eqn.outvars):
                    if _is_var(v):
                        ov = ij.outvars[j]
                        env[v] = env.get(ov, ov) if _is_var(ov) else ov
                if self.call is not outer_call:
                    self.call.outs = tuple(sub(v) for v in eqn.outvars)
                self.call = outer_call
                if unit is not None:
                    self.unit = outer_unit
                    self.units.append(UnitCall(str(eqn.params["name"]), unit[0], unit[1],
                                               tuple(sub(v) for v in eqn.invars), tuple(sub(v) for v in eqn.outvars)))
                continue
            node = Node(
                prim=name,
                params=dict(eqn.params),
                ins=[sub(v) for v in eqn.invars],
                outs=[self._define(v, env) for v in eqn.outvars],
                eqn=eqn,
                unit=self.unit[0] if self.unit else None,
                unit_block=self.unit[1] if self.unit else None,
                call=self.call,
            )
            leaf_unit = unit_of(name) if self.unit is None else None
            if leaf_unit is not None:  # cuDNN attention: one primitive per call
                node.unit = name
                self.units.append(UnitCall(name, leaf_unit[0], None, tuple(node.ins), tuple(node.outs)))
            if name == "scan":
                node.subs = [self.graph(eqn.params["jaxpr"], [o.params["jaxpr"] for o in others])]
                node.length = (
                    fit_dim(
                        [int(eqn.params["length"])] + [int(o.params["length"]) for o in others], self.points
                    )
                    if others
                    else Poly.const(int(eqn.params["length"]))
                )
            elif name == "while":
                node.subs = [
                    self.graph(eqn.params["body_jaxpr"], [o.params["body_jaxpr"] for o in others]),
                    self.graph(eqn.params["cond_jaxpr"], [o.params["cond_jaxpr"] for o in others]),
                ]
                node.length = Poly.const(1)
            elif name == "cond":
                node.subs = [
                    self.graph(br, [o.params["branches"][i] for o in others])
                    for i, br in enumerate(eqn.params["branches"])
                ]
            nodes.append(node)


RANDOM = frozenset({"random_bits", "rng_uniform", "rng_bit_generator", "random_seed"})


def constant_nodes(graph: Graph) -> set[Node]:
    """Nodes computed from literals and constants only (masks, rotary tables from ``iota``).

    XLA folds them at compile time or fuses them into their consumers, so they cost neither
    FLOPs nor memory.
    """
    varying = set(graph.invars)
    const: set[Node] = set()
    for n in graph.nodes:
        depends = any(_is_var(v) and v in varying for v in n.ins)
        if not depends and not n.subs and n.prim not in RANDOM:
            const.add(n)
        else:
            varying.update(n.outs)
    return const


def _dce(nodes: list[Node], outvars: Sequence[Any]) -> list[Node]:
    """Drop nodes none of whose results are used (XLA removes them too; JAX's AD leaves some)."""
    used = {v for v in outvars if _is_var(v)}
    keep = []
    for n in reversed(nodes):
        effects = bool(getattr(n.eqn, "effects", None))
        if effects or any(_is_var(v) and v in used for v in n.outs):
            keep.append(n)
            used.update(v for v in n.ins if _is_var(v))
    return keep[::-1]


def build_graph(
    ref: jex.ClosedJaxpr, others: Sequence[jex.ClosedJaxpr] = (), points: Sequence[tuple[int, int]] = ()
) -> Graph:
    """Flatten ``ref`` and fit each variable's dims over the aligned traces ``others``.

    Args:
      ref: the jaxpr traced at ``points[0]``.
      others: the same computation traced at ``points[1:]`` (same structure).
      points: the ``(b, s)`` of each trace; empty for a single concrete trace (constant dims).
    """
    if others and len(points) != len(others) + 1:
        raise ValueError("need one (b, s) point per trace")
    builder = _Builder(points if others else ())
    g = builder.graph(ref, list(others))
    g.units = builder.units
    return g
