"""A flattened view of a jaxpr with symbolic shapes, built from traces at several sizes.

The analysis never traces with symbolic shapes: Flax models compare, slice and build masks from
the sequence length, which `jax.export.symbolic_shape` handles only in part. Instead the same
computation is traced at six concrete ``(b, s)`` points (plus one check point). The traces have
the same equations in the same order, so every variable's dims can be matched position by
position and fitted exactly with `fit_dim` (degree <= 1 in b, <= 2 in s); the check point
verifies the fit. One difference is tolerated: an `ELIDABLE` equation (a slice and its transpose)
that JAX drops at a size where it changes nothing, as ``pos[:s]`` of a table of exactly ``s`` rows.
Any other structural difference (the model branches on a size) is a `StructureError` naming the
primitive and the line of the user's code that made it.

Call-like equations (every primitive of `mistjax.core.jaxpr.CALLS`: ``jit``, ``jax.checkpoint``, custom
JVP / VJP functions, ``closed_call``, ``shard_map``) are inlined by that module's walker, so a `Graph` is a
flat list of leaf `Node`s; loops and conditionals (``scan``, ``while``, ``cond``) keep their bodies as
nested graphs with a trip count (a fitted polynomial for ``scan``; 1 for ``while``, whose count is unknown).

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

import numpy as np
from jax.extend import core as jex

from mistjax.analysis.fused import UnitCall, unit_of
from mistjax.analysis.poly import Poly, fit_dim
from mistjax.core.jaxpr import CHECKPOINTS, CUSTOM_VJP, JIT, Atom, Params, Step, Value, Visit, is_var, walk
from mistjax.trace.source import equation_line

# Name of the identity ``jit`` that marks a value an eager runtime writes (models.layers.eager_written).
EAGER_JIT = "eager_kernel"
# Calls a node remembers it was inlined from (`Node.call`): the tensor-parallel runtime runs them again as calls.
REGIONS = CHECKPOINTS | CUSTOM_VJP


def names(text: str) -> frozenset[str]:
    """A set of primitive names from a whitespace-separated list (keeps long tables compact)."""
    return frozenset(text.split())


class StructureError(ValueError):
    """Traces at different sizes differ in structure, so their shapes cannot be matched."""


@dataclass(eq=False)
class CallSite:
    """An inlined ``jax.checkpoint`` / ``custom_vjp`` equation: its inputs and outputs as graph values."""

    eqn: jex.JaxprEqn
    ins: tuple[Atom, ...]
    outs: tuple[Atom, ...] = ()

    @property
    def checkpoint(self) -> bool:
        return self.eqn.primitive.name in CHECKPOINTS


@dataclass(eq=False)
class Node:
    """One leaf equation (identity-hashed), or a loop / conditional with nested graphs."""

    prim: str
    params: Params
    ins: list[Atom]  # after inlining substitutions
    outs: list[jex.Var]  # DropVar for an unused result
    eqn: jex.JaxprEqn  # the reference equation (source info for messages)
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

    invars: list[jex.Var]
    constvars: list[jex.Var]
    nodes: list[Node]
    outvars: list[Atom]
    dims: dict[jex.Var, tuple[Poly, ...]]  # shared by nested graphs: var -> fitted dims
    consts: dict[jex.Var, Value] = field(default_factory=dict)  # shared: constvar -> value (inlined ones too)
    units: list[UnitCall] = field(default_factory=list)  # fused-attention calls (top-level graph only)
    eager: set[jex.Var] = field(default_factory=set)  # shared: values an eager runtime writes (EAGER_JIT inputs)

    def shape(self, v: Atom) -> tuple[Poly, ...]:
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


Env = dict[jex.Var, Atom]  # inlined call's variable -> the graph value it stands for


@dataclass
class _Frame:
    """What entering one call changed in the builder, to restore at its exit."""

    unit: tuple[str, int | None] | None  # the fused unit the call starts (`unit_of` of its name), or None
    outer_unit: tuple[str, int | None] | None
    outer_call: CallSite | None


# Equations a trace at one size may have and one at another size lacks, because JAX drops them when they would
# change nothing: a position table sliced to the sequence (``pos[:s]``) traces a ``slice`` below the table's
# length and none at it, and the slice's transpose (``pad``) likewise. They keep the rank, so the traces still
# align position by position once the extra equation is stepped over.
ELIDABLE = frozenset({"slice", "pad", "dynamic_slice"})


BRANCH_FIX = ("; the computation branches on the batch or sequence size there (e.g. a Python `if` on a shape). "
              "Make it take one path at every size up to the batch's (jnp.where on values, or the size-dependent "
              "part moved out of the loss), or pass plan=... (or workload=...) to autoshard to skip the analysis "
              "(docs/errors.md, StructureError)")


def _where(eqn: jex.JaxprEqn) -> str:
    line = equation_line(eqn)
    return f" (made at {line})" if line else ""


def _name(step: Step) -> str:
    name = step.eqn.primitive.name
    return f"`{name}`{_where(step.eqn)}" if step.visit is not Visit.EXIT else f"the end of `{name}`"


def _mismatch(ref: Step, other: Step, k: int, point: tuple[int, int] | None, ref_point: tuple[int, int] | None
              ) -> StructureError:
    at = f"(b, s) = {point}" if point else "another size"
    return StructureError(f"the traces at different sizes differ at equation {k}: {_name(ref)} at (b, s) = "
                          f"{ref_point} but {_name(other)} at {at}{BRANCH_FIX}")


def _elidable(step: Step) -> bool:
    return step.visit is Visit.LEAF and step.eqn.primitive.name in ELIDABLE


class _Aligned:
    """One other trace walked in step with the reference. An `ELIDABLE` equation only one of them has (a slice
    of a table that is a no-op at one size) is stepped over in the other trace, or stands in the reference for
    its own operand (`phantom`): the sliced value has the whole table's shape at that size."""

    def __init__(self, jaxpr: jex.Jaxpr, ref: jex.Jaxpr, point: tuple[int, int] | None):
        self._steps = list(walk(jaxpr))
        self._pos = 0
        self.point = point
        self._corr: dict[jex.Var, Atom] = dict(zip(ref.invars, jaxpr.invars))  # reference var -> this trace's
        self._corr.update(zip(ref.constvars, jaxpr.constvars))
        self._alias: dict[jex.Var, Atom] = {}  # result of a stepped-over equation -> its operand

    def match(self, ref: Step, k: int, ref_point: tuple[int, int] | None) -> Step:
        while True:
            step = self._steps[self._pos] if self._pos < len(self._steps) else None
            if (step is not None and step.visit is ref.visit and step.eqn.primitive.name == ref.eqn.primitive.name
                    and not (_elidable(step) and not self._same_operands(ref, step))):
                self._pos += 1
                self._pair(ref, step)
                return step
            if ref.visit is Visit.LEAF and ref.eqn.primitive.name in ELIDABLE:
                phantom = self._phantom(ref)
                if phantom is not None:
                    return phantom
            if step is None:
                raise StructureError(f"the trace at (b, s) = {self.point} lacks {_name(ref)}, equation {k} of "
                                     f"the trace at (b, s) = {ref_point}{BRANCH_FIX}")
            if not _elidable(step):
                raise _mismatch(ref, step, k, self.point, ref_point)
            self._pos += 1
            # Stepped over: its result stands for its operand (what the reference reads in its place).
            self._alias.update((v, step.eqn.invars[0]) for v in step.eqn.outvars)

    def _same_operands(self, ref: Step, step: Step) -> bool:
        """Whether ``step`` reads what ``ref`` reads, as far as the walk paired their values (an elidable
        equation of the same name but other operands is an extra one of this trace, not ``ref``'s pair)."""
        for r, o in zip(ref.eqn.invars, step.eqn.invars):
            here = self._corr.get(r) if is_var(r) else None
            if is_var(here) and is_var(o) and self._resolve(here) is not self._resolve(o):
                return False
        return True

    def _resolve(self, v: Atom) -> Atom:
        while v in self._alias:
            v = self._alias[v]
        return v

    def _pair(self, ref: Step, step: Step) -> None:
        self._corr.update(zip(ref.eqn.outvars, step.eqn.outvars))
        if ref.visit is Visit.ENTER and ref.inner is not None and step.inner is not None:
            self._corr.update(zip(ref.inner.jaxpr.invars, step.inner.jaxpr.invars))
            self._corr.update(zip(ref.inner.jaxpr.constvars, step.inner.jaxpr.constvars))
        if ref.visit is Visit.EXIT and ref.inner is not None and step.inner is not None:
            self._corr.update(zip(ref.inner.jaxpr.outvars, step.inner.jaxpr.outvars))

    def _phantom(self, ref: Step) -> Step | None:
        """The reference's elidable equation as this trace lacks it: its result is its operand here."""
        operand = ref.eqn.invars[0]
        here = self._corr.get(operand) if is_var(operand) else None
        if not is_var(here):  # a literal or an unknown value: no stand-in
            return None
        self._corr.update((v, here) for v in ref.eqn.outvars)
        return Step(Visit.LEAF, ref.eqn.replace(invars=[here], outvars=[here]))

    def finish(self, ref_point: tuple[int, int] | None) -> None:
        """Raise unless only elidable equations are left."""
        for step in self._steps[self._pos:]:
            if not _elidable(step):
                raise StructureError(f"the trace at (b, s) = {self.point} has {_name(step)}, which the trace at "
                                     f"(b, s) = {ref_point} lacks{BRANCH_FIX}")


class _Builder:
    def __init__(self, points: Sequence[tuple[int, int]]):
        self.points = list(points)
        self.dims: dict[jex.Var, tuple[Poly, ...]] = {}
        self.consts: dict[jex.Var, Value] = {}
        self.units: list[UnitCall] = []
        self.unit: tuple[str, int | None] | None = None  # (name, block) of the fused kernel being inlined
        self._defined: set[jex.Var] = set()  # vars some leaf node already defines (see `_define`)
        self.call: CallSite | None = None  # the outermost checkpoint / custom_vjp call being inlined
        self.eager: set[jex.Var] = set()  # values passed to an EAGER_JIT marker (shared by nested graphs)

    def fit(self, ref: Atom, others: Sequence[Atom]) -> None:
        if not is_var(ref) or ref in self.dims:
            return
        shapes = [tuple(ref.aval.shape)] + [tuple(o.aval.shape) for o in others]
        if any(len(sh) != len(shapes[0]) for sh in shapes):
            raise StructureError(f"the rank of a value differs between the traces at different sizes: "
                                 f"{shapes}{BRANCH_FIX}")
        if not self.points or len(shapes) == 1:
            self.dims[ref] = tuple(Poly.const(int(d)) for d in shapes[0])
            return
        self.dims[ref] = tuple(fit_dim([int(sh[d]) for sh in shapes], self.points) for d in range(len(shapes[0])))

    def _fit_all(self, refs: Sequence[Atom], others: Sequence[Sequence[Atom]]) -> None:
        for k, v in enumerate(refs):
            self.fit(v, [o[k] for o in others])

    def graph(self, ref: jex.ClosedJaxpr, others: Sequence[jex.ClosedJaxpr]) -> Graph:
        rj = ref.jaxpr
        self.consts.update(zip(rj.constvars, ref.consts))
        ojs = [o.jaxpr for o in others]
        self._fit_all(rj.invars, [o.invars for o in ojs])
        self._fit_all(rj.constvars, [o.constvars for o in ojs])
        env: Env = {}
        nodes: list[Node] = []
        self._eqns(rj, ojs, env, nodes)
        outvars = [_sub(env, v) for v in rj.outvars]
        return Graph(invars=list(rj.invars), constvars=list(rj.constvars), nodes=_dce(nodes, outvars),
                     outvars=outvars, dims=self.dims, consts=self.consts, eager=self.eager)

    def _define(self, v: jex.Var, env: Env) -> jex.Var:
        """The var a leaf equation defines: a fresh one when ``v`` was defined before (the same inner jaxpr
        inlined twice, e.g. one jitted helper called per chunk), so each call's buffers live their own span."""
        if not is_var(v):
            return v
        if v not in self._defined:
            self._defined.add(v)
            return v
        fresh = type(v)(v.aval)
        if v in self.dims:
            self.dims[fresh] = self.dims[v]
        env[v] = fresh
        return fresh

    def _eqns(self, rj: jex.Jaxpr, ojs: Sequence[jex.Jaxpr], env: Env, nodes: list[Node]) -> None:
        """Walk ``rj`` with its calls inlined, in step with the aligned traces ``ojs``, into ``nodes``."""
        ref_point = self.points[0] if self.points else None
        aligned = [_Aligned(o, rj, self.points[i + 1] if len(self.points) > i + 1 else None)
                   for i, o in enumerate(ojs)]
        frames: list[_Frame] = []
        for k, step in enumerate(walk(rj)):
            others = [a.match(step, k, ref_point) for a in aligned]
            eqn, name = step.eqn, step.eqn.primitive.name
            if step.visit is Visit.EXIT:
                self._exit(step, env, frames.pop())
                continue
            self._fit_all(eqn.outvars, [o.eqn.outvars for o in others])
            if name == JIT and eqn.params.get("name") == EAGER_JIT:
                # The marker is an identity: its inputs are the marked values (JAX's partial evaluation may
                # have dropped its outputs, which are the same values).
                self.eager.update(_sub(env, v) for v in eqn.invars if is_var(v))
            if step.visit is Visit.ENTER:
                frames.append(self._enter(step, others, env))
            else:
                nodes.append(self._leaf(eqn, [o.eqn for o in others], env))
        for a in aligned:
            a.finish(ref_point)

    def _enter(self, step: Step, others: Sequence[Step], env: Env) -> _Frame:
        """Start inlining a call: its body's inputs stand for the call's operands."""
        eqn, inner = step.eqn, step.inner
        unit = unit_of(str(eqn.params.get("name", ""))) if self.unit is None else None
        frame = _Frame(unit, self.unit, self.call)
        if unit is not None:
            self.unit = (str(eqn.params["name"]), unit[1])
        if self.call is None and eqn.primitive.name in REGIONS:
            self.call = CallSite(eqn, tuple(_sub(env, v) for v in eqn.invars))
        ij, oijs = inner.jaxpr, [o.inner.jaxpr for o in others]
        self.consts.update(zip(ij.constvars, inner.consts))
        self._fit_all(ij.constvars, [o.constvars for o in oijs])
        self._fit_all(ij.invars, [o.invars for o in oijs])
        for j, v in enumerate(ij.invars):
            env[v] = _sub(env, eqn.invars[j]) if j < len(eqn.invars) else v
        return frame

    def _exit(self, step: Step, env: Env, frame: _Frame) -> None:
        """End inlining a call: its results are its body's outputs."""
        eqn, ij = step.eqn, step.inner.jaxpr
        for j, v in enumerate(eqn.outvars):
            if is_var(v):
                env[v] = _sub(env, ij.outvars[j])
        outs = tuple(_sub(env, v) for v in eqn.outvars)
        if self.call is not frame.outer_call:
            self.call.outs = outs
        self.call = frame.outer_call
        if frame.unit is not None:
            self.unit = frame.outer_unit
            ins = tuple(_sub(env, v) for v in eqn.invars)
            self.units.append(UnitCall(str(eqn.params["name"]), frame.unit[0], frame.unit[1], ins, outs))

    def _leaf(self, eqn: jex.JaxprEqn, others: Sequence[jex.JaxprEqn], env: Env) -> Node:
        name = eqn.primitive.name
        node = Node(prim=name, params=dict(eqn.params), ins=[_sub(env, v) for v in eqn.invars],
                    outs=[self._define(v, env) for v in eqn.outvars], eqn=eqn,
                    unit=self.unit[0] if self.unit else None, unit_block=self.unit[1] if self.unit else None,
                    call=self.call)
        leaf_unit = unit_of(name) if self.unit is None else None
        if leaf_unit is not None:  # cuDNN attention: one primitive per call
            node.unit = name
            self.units.append(UnitCall(name, leaf_unit[0], None, tuple(node.ins), tuple(node.outs)))
        if name == "scan":
            node.subs = [self.graph(eqn.params["jaxpr"], [o.params["jaxpr"] for o in others])]
            lengths = [int(eqn.params["length"])] + [int(o.params["length"]) for o in others]
            node.length = fit_dim(lengths, self.points) if others else Poly.const(lengths[0])
        elif name == "while":
            node.subs = [self.graph(eqn.params[key], [o.params[key] for o in others])
                         for key in ("body_jaxpr", "cond_jaxpr")]
            node.length = Poly.const(1)
        elif name == "cond":
            node.subs = [self.graph(br, [o.params["branches"][i] for o in others])
                         for i, br in enumerate(eqn.params["branches"])]
        return node


def _sub(env: Env, v: Atom) -> Atom:
    """The graph value ``v`` stands for (itself unless it is an inlined call's variable)."""
    return env.get(v, v) if is_var(v) else v


RANDOM = frozenset({"random_bits", "rng_uniform", "rng_bit_generator", "random_seed"})


def constant_nodes(graph: Graph) -> set[Node]:
    """Nodes computed from literals and constants only (masks, rotary tables from ``iota``).

    XLA folds them at compile time or fuses them into their consumers, so they cost neither
    FLOPs nor memory.
    """
    varying = set(graph.invars)
    const: set[Node] = set()
    for n in graph.nodes:
        depends = any(is_var(v) and v in varying for v in n.ins)
        if not depends and not n.subs and n.prim not in RANDOM:
            const.add(n)
        else:
            varying.update(n.outs)
    return const


def _dce(nodes: list[Node], outvars: Sequence[Atom]) -> list[Node]:
    """Drop nodes none of whose results are used (XLA removes them too; JAX's AD leaves some)."""
    used = {v for v in outvars if is_var(v)}
    keep = []
    for n in reversed(nodes):
        effects = bool(getattr(n.eqn, "effects", None))
        if effects or any(is_var(v) and v in used for v in n.outs):
            keep.append(n)
            used.update(v for v in n.ins if is_var(v))
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
