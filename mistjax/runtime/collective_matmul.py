"""Collective matmuls: the tensor-parallel all-gather / reduce-scatter of a sequence-split activation run as
a ring of per-chunk matmuls and neighbour transfers, so that each transfer overlaps a matmul.

Under Megatron TP + sequence parallelism a column-parallel matmul consumes the layer input all-gathered
over the sequence, and a row-parallel matmul's partial sum is reduce-scattered back onto the sequence.
Issued as one collective beside one GEMM, the transfer cannot overlap the GEMM that needs its result.
Split both along the sequence into the ``t`` chunks the devices hold (the "collective matmul" of
Wang et al., ASPLOS 2023; Transformer Engine's userbuffers overlap on GPUs):

* all-gather -> matmul: device ``i`` multiplies the chunk it holds by its weight shard and passes the
  chunk to device ``i + 1`` (``ppermute``); after ``t`` steps it has seen every chunk and written each
  product's rows into place. Step ``s``'s transfer does not depend on step ``s``'s GEMM, so XLA:GPU's
  latency-hiding scheduler runs them together. Several matmuls of the same input (q, k, v; gate and up)
  share one ring: the input travels once, as the single all-gather it replaces.
* matmul -> reduce-scatter: device ``i`` computes the rows of chunk ``(i - 1 - s) mod t`` of its partial
  product, adds the accumulator received from device ``i - 1`` and passes it on; after ``t`` steps it
  holds the full sum of its own chunk. The transfer of step ``s``'s accumulator overlaps step ``s + 1``'s
  GEMM.

Backward passes use the mirrored rings: the input gradient of a gathered matmul is a matmul-reduce-scatter,
its weight gradient gathers the (saved, sequence-split) input again chunk by chunk; the reduce-scattered
matmul's gradients gather the output cotangent chunk by chunk. Residuals are the split input and the
weights, as in the plain Megatron path (`mistjax.runtime.tensor`): never the gathered copy.

Each ring runs inside a ``jax.shard_map`` manual over the ``tensor`` axis only (the data-parallel axes are
already manual in the runtime's program). The loops are unrolled (``t`` is at most a node's GPU count):
the scheduler sees every step. On XLA:CPU collectives run synchronously and the ring only adds steps; the
runtime turns the rewrite on per platform (`mistjax.runtime.xla_flags`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex
from jax.sharding import PartitionSpec as P

from mistjax.core.jaxpr import Atom, shaped

# The analysis is imported where a plan is made, not at import (its package loads sympy; see runtime.tensor).
if TYPE_CHECKING:
    from mistjax.analysis.graph import Graph, Node
    from mistjax.analysis.layout import State, TPResult


@dataclass(frozen=True)
class RingDot:
    """One ``dot_general`` of a collective matmul, with where the sequence runs through it.

    Attributes:
      eqn: the equation (its parameters are bound again on per-device operands).
      pos: which operand (0: lhs, 1: rhs) is the sequence-carrying activation.
      dim: the sequence dim in that operand (a free dim: neither contracted nor batched).
      out_dim: where that dim lands in the output.
      other_spec: PartitionSpec of the other operand (the weight) on the ``tensor`` axis.
      out_spec: PartitionSpec of the output: the weight's split for a gathered matmul; the sequence
        split for a reduce-scattered one.
      act_spec: PartitionSpec of the activation operand (the sequence split for a gathered matmul).
    """

    eqn: jex.JaxprEqn
    pos: int
    dim: int
    out_dim: int
    other_spec: P
    out_spec: P
    act_spec: P

    def apply(self, act: jax.Array, other: jax.Array) -> jax.Array:
        """The product of per-device operands (any number of sequence rows)."""
        args = [act, other] if self.pos == 0 else [other, act]
        # Bound without the equation's context (`bind_equation` enters it): that holds the trace's mesh,
        # whose `tensor` axis is not manual as it is here.
        prim = self.eqn.primitive
        return prim.bind(*args, **prim.get_bind_params(self.eqn.params))

    def grad_act(self, act: jax.Array, other: jax.Array, ct: jax.Array) -> jax.Array:
        """The activation's cotangent for output cotangent ``ct`` (``act`` gives only the shape)."""
        shape = jax.ShapeDtypeStruct(act.shape, act.dtype)
        return jax.linear_transpose(lambda a: self.apply(a, other), shape)(ct)[0]

    def grad_other(self, act: jax.Array, other: jax.Array, ct: jax.Array) -> jax.Array:
        """The weight's cotangent for output cotangent ``ct`` (``other`` gives only the shape)."""
        shape = jax.ShapeDtypeStruct(other.shape, other.dtype)
        return jax.linear_transpose(lambda w: self.apply(act, w), shape)(ct)[0]


def free_out_dim(eqn: jex.JaxprEqn, pos: int, dim: int) -> int | None:
    """Where operand ``pos``'s dim ``dim`` lands in a ``dot_general``'s output; None if it is contracted
    or batched. Output dims are the batch dims, then lhs's free dims, then rhs's, each in order."""
    (contract, batch) = eqn.params["dimension_numbers"]
    ndims = [len(shaped(eqn.invars[0]).shape), len(shaped(eqn.invars[1]).shape)]
    if dim in contract[pos] or dim in batch[pos]:
        return None
    free = [[d for d in range(ndims[k]) if d not in contract[k] and d not in batch[k]] for k in (0, 1)]
    return len(batch[0]) + (0 if pos == 0 else len(free[0])) + free[pos].index(dim)


def spec_on(ndim: int, dim: int | None, axis: str) -> P:
    """A PartitionSpec splitting ``dim`` (None: none) over ``axis``."""
    return P(*[axis if d == dim else None for d in range(ndim)])


# ------------------------------------------------------------------------------------------- the rings

def _ring(t: int) -> list[tuple[int, int]]:
    return [(k, (k + 1) % t) for k in range(t)]


def _rows(x: jax.Array, chunk: jax.Array, dim: int, t: int) -> jax.Array:
    """Chunk ``chunk`` (a traced index) of ``t`` along ``dim``."""
    n = x.shape[dim] // t
    return lax.dynamic_slice_in_dim(x, chunk * n, n, dim)


def _put_rows(buf: jax.Array, rows: jax.Array, chunk: jax.Array, dim: int) -> jax.Array:
    return lax.dynamic_update_slice_in_dim(buf, rows, chunk * rows.shape[dim], dim)


def _gemm(fn: Callable[..., jax.Array], *args: jax.Array) -> jax.Array:
    """``fn(*args)``, one chunk's matmul, kept a matmul of its own: behind optimization barriers XLA's
    simplifier cannot see that the chunks' matmuls are slices of one (on XLA:GPU it turned a ring's
    ``dot(dynamic_slice(x, r), w)`` into ``dynamic_slice(dot(x, w), r)`` and CSE'd the chunks into one GEMM
    issued before the ring, and a gathered ring's row updates into one GEMM after the last transfer: no
    overlap left). XLA:GPU keeps barriers until after scheduling; they cost nothing at run time."""
    return lax.optimization_barrier(fn(*lax.optimization_barrier(args)))


def _gathered_shape(x: jax.Array, dim: int, t: int) -> jax.ShapeDtypeStruct:
    shape = list(x.shape)
    shape[dim] *= t
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def _gather_matmul(x: jax.Array, others: Sequence[jax.Array], dots: Sequence[RingDot], axis: str, t: int
                   ) -> list[jax.Array]:
    """Per device: every ``dots[j](gathered x, others[j])``, gathering ``x`` chunk by chunk around the ring."""
    me = lax.axis_index(axis)
    full = _gathered_shape(x, dots[0].dim, t)
    outs = [jnp.zeros(jax.eval_shape(d.apply, full, w).shape, shaped(d.eqn.outvars[0]).dtype)
            for d, w in zip(dots, others)]
    chunk = x
    for s in range(t):
        # Issued before this step's GEMMs and independent of them: the transfer runs beside them.
        nxt = lax.ppermute(chunk, axis, _ring(t)) if s < t - 1 else chunk
        src = (me - s) % t  # whose chunk this device holds at step s
        outs = [_put_rows(o, _gemm(d.apply, chunk, w), src, d.out_dim) for o, d, w in zip(outs, dots, others)]
        chunk = nxt
    return outs


def _scatter_sum(part: Callable[[jax.Array], jax.Array], axis: str, t: int) -> jax.Array:
    """Per device: its chunk of ``sum over devices of part(chunk)``: ``part(r)`` is this device's partial
    product for rows chunk ``r``; the accumulator travels the ring and arrives at its owner last."""
    me = lax.axis_index(axis)
    acc: jax.Array | None = None
    for s in range(t):
        # Step s adds chunk (me - 1 - s): at s = t - 1 that is `me`, the chunk this device keeps.
        mine = part((me - 1 - s) % t)
        # The previous step's accumulator moves while `mine` is computed (no dependency between them).
        acc = mine if acc is None else lax.ppermute(acc, axis, _ring(t)) + mine
    assert acc is not None  # (a ring has t >= 1 steps)
    return acc


def _gather_matmul_grads(x: jax.Array, others: Sequence[jax.Array], cts: Sequence[jax.Array],
                         dots: Sequence[RingDot], axis: str, t: int) -> tuple[jax.Array, list[jax.Array]]:
    """Per device: the input's gradient and each weight's, for the outputs' cotangents ``cts``.

    One ring does both halves of Transformer Engine's backward overlap: the input gradient's chunk
    GEMMs (``sum_j ct_j[rows r] @ w_j^T``, reduce-scattered by the accumulator) run while the saved
    split input travels the ring into a gathered buffer; each weight gradient is then one
    GEMM on the gathered input (float32 accumulation inside the GEMM, as in the plain path; no
    weight-sized float32 accumulators).
    """
    me = lax.axis_index(axis)
    dim = dots[0].dim

    def dx_part(r: jax.Array) -> jax.Array:
        parts = [_gemm(lambda c, w, d=d: d.grad_act(x, w, c), _rows(ct, r, d.out_dim, t), w).astype(jnp.float32)
                 for d, w, ct in zip(dots, others, cts)]
        return cast(jax.Array, sum(parts)).astype(x.dtype)  # (a ring has one dot at least)

    gathered = jnp.zeros(_gathered_shape(x, dim, t).shape, x.dtype)
    chunk = x
    acc: jax.Array | None = None
    for s in range(t):
        gathered = _put_rows(gathered, chunk, (me - s) % t, dim)
        mine = dx_part((me - 1 - s) % t)  # as in `_scatter_sum`
        acc = mine if acc is None else acc + mine
        if s < t - 1:
            # The input chunk and the accumulator travel as one transfer, beside the next step's GEMMs:
            # XLA:GPU runs one collective at a time, and a second ring's transfers queued behind the
            # first's with no GEMM left to hide them (deviceless H100 schedule).
            chunk, acc = lax.ppermute(jnp.stack([chunk, acc]), axis, _ring(t))
    assert acc is not None  # (a ring has t >= 1 steps)
    return acc, [d.grad_other(gathered, w, ct) for d, w, ct in zip(dots, others, cts)]


def _matmul_scatter(acts: Sequence[jax.Array], others: Sequence[jax.Array], dots: Sequence[RingDot], axis: str,
                    t: int) -> jax.Array:
    """Per device: its sequence chunk of ``sum_j dots[j](acts[j], others[j])`` (partial sums over ``tensor``)."""

    def part(r: jax.Array) -> jax.Array:
        outs = [_gemm(d.apply, _rows(a, r, d.dim, t), w) for d, a, w in zip(dots, acts, others)]
        return outs[0] if len(outs) == 1 else sum(outs[1:], outs[0])

    return _scatter_sum(part, axis, t)


def _matmul_scatter_grads(acts: Sequence[jax.Array], others: Sequence[jax.Array], ct: jax.Array,
                          dots: Sequence[RingDot], axis: str, t: int) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per device: the gradients of `_matmul_scatter`'s operands. The (sequence-split) output cotangent
    ``ct`` travels the ring into a gathered buffer; each chunk gives its rows of the activations'
    gradients (one GEMM per chunk, beside the next chunk's transfer); each weight gradient is then one
    GEMM on the gathered cotangent."""
    me = lax.axis_index(axis)
    out_dim = dots[0].out_dim
    das = [jnp.zeros(a.shape, a.dtype) for a in acts]
    gathered = jnp.zeros(_gathered_shape(ct, out_dim, t).shape, ct.dtype)
    chunk = ct
    for s in range(t):
        nxt = lax.ppermute(chunk, axis, _ring(t)) if s < t - 1 else chunk
        src = (me - s) % t
        gathered = _put_rows(gathered, chunk, src, out_dim)
        das = [_put_rows(g, _gemm(d.grad_act, _rows(a, src, d.dim, t), w, chunk).astype(g.dtype), src, d.dim)
               for g, d, a, w in zip(das, dots, acts, others)]
        chunk = nxt
    return das, [d.grad_other(a, w, gathered) for d, a, w in zip(dots, acts, others)]


# ------------------------------------------------------------------------------------- global functions

def _manual(fn: Callable, in_specs: object, out_specs: object, axis: str) -> Callable:
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset({axis}), check_vma=False)


def allgather_matmul(x: jax.Array, others: Sequence[jax.Array], dots: Sequence[RingDot], *, axis: str, t: int
                     ) -> list[jax.Array]:
    """``dots[j](all_gather(x), others[j])`` for every j, as one ring of chunked matmuls.

    Args:
      x: the sequence-split activation (split over ``axis`` on ``dots[0].dim``; every dot reads it there).
      others: each dot's other operand: a weight split over ``axis`` on one of its free dims (so each
        device's product is a column block, and the input's gradient a partial sum).
      dots: the matmuls (`RingDot`); they share ``x``'s ring.
      axis: the tensor-parallel mesh axis.
      t: its size.
    Returns:
      Each dot's output (global values, laid out as ``dots[j].out_spec``).
    """
    x_spec = dots[0].act_spec
    w_specs = [d.other_spec for d in dots]
    out_specs = [d.out_spec for d in dots]
    forward = _manual(lambda v, *ws: _gather_matmul(v, ws, dots, axis, t), (x_spec, *w_specs), out_specs, axis)
    backward = _manual(lambda v, ws, cts: _gather_matmul_grads(v, ws, cts, dots, axis, t),
                       (x_spec, w_specs, out_specs), (x_spec, w_specs), axis)

    @jax.custom_vjp
    def run(v: jax.Array, *ws: jax.Array) -> list[jax.Array]:
        return forward(v, *ws)

    def fwd(v: jax.Array, *ws: jax.Array) -> tuple[list[jax.Array], tuple[jax.Array, tuple[jax.Array, ...]]]:
        return forward(v, *ws), (v, ws)  # the split input, not the gathered copy (1/t of the bytes)

    def bwd(res: tuple[jax.Array, tuple[jax.Array, ...]], cts: list[jax.Array]) -> tuple[jax.Array, ...]:
        v, ws = res
        dx, dws = backward(v, list(ws), list(cts))
        return (dx, *dws)

    run.defvjp(fwd, bwd)
    return run(x, *others)


def matmul_reduce_scatter(acts: Sequence[jax.Array], others: Sequence[jax.Array], dots: Sequence[RingDot], *,
                          axis: str, t: int) -> jax.Array:
    """``reduce_scatter(sum_j dots[j](acts[j], others[j]))`` onto the sequence, as one ring of chunked matmuls.

    Args:
      acts: each dot's activation operand (whole along its sequence dim ``dots[j].dim``).
      others: each dot's other operand (split on a contracted dim: the products are partial sums).
      dots: the matmuls; their outputs have one shape and are summed.
      axis: the tensor-parallel mesh axis.
      t: its size.
    Returns:
      The sum, split over ``axis`` on ``dots[0].out_dim`` (``dots[0].out_spec``).
    """
    a_specs = [d.act_spec for d in dots]
    w_specs = [d.other_spec for d in dots]
    out_spec = dots[0].out_spec
    forward = _manual(lambda a, w: _matmul_scatter(a, w, dots, axis, t), (a_specs, w_specs), out_spec, axis)
    backward = _manual(lambda a, w, ct: _matmul_scatter_grads(a, w, ct, dots, axis, t),
                       (a_specs, w_specs, out_spec), (a_specs, w_specs), axis)
    n = len(dots)

    @jax.custom_vjp
    def run(*ops: jax.Array) -> jax.Array:
        return forward(list(ops[:n]), list(ops[n:]))

    def fwd(*ops: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return run(*ops), ops

    def bwd(ops: tuple[jax.Array, ...], ct: jax.Array) -> tuple[jax.Array, ...]:
        das, dws = backward(list(ops[:n]), list(ops[n:]), ct)
        return (*das, *dws)

    run.defvjp(fwd, bwd)
    return run(*acts, *others)


# ------------------------------------------------------------------- where a layer's graph gets rings

# Unary primitives that keep a value as it is (shape, dtype): a partial sum named for a remat policy is
# still reduce-scattered by the ring of the matmul before the name.
_PASS_THROUGH = frozenset({"name", "copy", "copy_p"})


@dataclass
class GatherRing:
    """Column-parallel matmuls of one sequence-split input, run as one `allgather_matmul` ring.

    Attributes:
      act: the sequence-split input the plain path would all-gather.
      nodes: the ``dot_general`` nodes, in graph order (the ring runs where the first one stood).
      dots: their `RingDot` s.
      pulled: later nodes that make the weights (16-bit casts), evaluated before the ring.
    """

    act: jex.Var
    nodes: list[Node]
    dots: list[RingDot]
    pulled: list[Node] = field(default_factory=list)


@dataclass
class ScatterRing:
    """A row-parallel matmul whose partial sum every consumer wants sequence-split: one
    `matmul_reduce_scatter` ring.

    Attributes:
      node: the ``dot_general`` node.
      dot: its `RingDot`.
      held: the output and the pass-through values after it (a remat name): held sequence-split,
        though the analysis records them as partial sums.
      dim: the sequence dim they are split on.
    """

    node: Node
    dot: RingDot
    held: list[jex.Var]
    dim: int


@dataclass
class RingPlan:
    """Where a layer's graph runs collective matmuls.

    Attributes:
      at: the node each ring runs in place of.
      skip: nodes a ring evaluates (the later matmuls of a `GatherRing`, its pulled weight casts).
    """

    at: dict[Node, GatherRing | ScatterRing] = field(default_factory=dict)
    skip: set[Node] = field(default_factory=set)


def _is_float_var(v: Atom) -> bool:
    return isinstance(v, jex.Var) and jnp.issubdtype(shaped(v).dtype, np.inexact)


class _Planner:
    """Finds the rings of one layer graph under its propagated layouts (`plan_rings`)."""

    def __init__(self, graph: Graph, result: TPResult, axis: str):
        self.graph, self.res, self.axis = graph, result, axis
        self.index = {n: i for i, n in enumerate(graph.nodes)}
        self.producer = {v: n for n in graph.nodes for v in n.outs}
        self.uses: dict[jex.Var, list[tuple[Node, int]]] = {}
        for n in graph.nodes:
            for k, v in enumerate(n.ins):
                if isinstance(v, jex.Var):
                    self.uses.setdefault(v, []).append((n, k))
        self.plan = RingPlan()

    def state(self, v: Atom) -> State:
        return self.res.states.get(v) if isinstance(v, jex.Var) else None

    def wants(self, n: Node) -> list[State] | None:
        eff = self.res.node_states.get(n)
        return None if eff is None else eff[0]

    def free(self, n: Node) -> bool:
        """A plain top-level node no ring has claimed."""
        return n.call is None and not n.subs and n not in self.plan.skip and n not in self.plan.at

    # -- all-gather -> matmul
    def gather_dot(self, n: Node) -> tuple[jex.Var, RingDot] | None:
        """``n``'s gathered input and its `RingDot`, if ``n`` is a column-parallel matmul of a gathered
        sequence-split input by a weight split on a free dim."""
        from mistjax.analysis.layout import Partial, Shard

        wants = self.wants(n)
        if n.prim != "dot_general" or wants is None:
            return None
        gathered = [k for k in (0, 1) if _is_float_var(n.ins[k]) and isinstance(self.state(n.ins[k]), Shard)
                    and wants[k] is None]
        if len(gathered) != 1:
            return None
        k = gathered[0]
        act, other, want = n.ins[k], n.ins[1 - k], wants[1 - k]
        act_state = self.state(act)
        assert isinstance(act_state, Shard) and isinstance(act, jex.Var)  # (as `gathered` selected it)
        dim = act_state.dim
        out_dim = free_out_dim(n.eqn, k, dim)
        w_dim = free_out_dim(n.eqn, 1 - k, want.dim) if isinstance(want, Shard) else None
        if out_dim is None or w_dim is None or not _is_float_var(other) or isinstance(self.state(other), Partial):
            return None
        assert isinstance(want, Shard)  # (w_dim is set for a Shard only)
        rd = RingDot(n.eqn, k, dim, out_dim, other_spec=spec_on(shaped(other).ndim, want.dim, self.axis),
                     out_spec=spec_on(shaped(n.outs[0]).ndim, w_dim, self.axis),
                     act_spec=spec_on(shaped(act).ndim, dim, self.axis))
        return act, rd

    def pullable(self, v: Atom, at: int, depth: int = 3) -> list[Node] | None:
        """The nodes after position ``at`` that make ``v`` from values ready there (in graph order), or
        None if ``v`` needs more than ``depth`` of them in a row or anything not plain."""
        n = self.producer.get(v) if isinstance(v, jex.Var) else None
        if n is None or self.index[n] < at:
            return []
        if depth == 0 or not self.free(n) or n.prim == "dot_general":
            return None
        chain: list[Node] = []
        for u in n.ins:
            sub = self.pullable(u, at, depth - 1)
            if sub is None:
                return None
            chain += [m for m in sub if m not in chain]
        return [*chain, n]

    def gather_ring(self, i: int, n: Node) -> GatherRing | None:
        found = self.gather_dot(n)
        if found is None:
            return None
        act, first = found
        ring = GatherRing(act, [n], [first])
        for m in self.graph.nodes[i + 1:]:
            other = self.gather_dot(m) if self.free(m) and m.prim == "dot_general" else None
            if other is None or other[0] is not act or other[1].dim != first.dim:
                continue
            chain = self.pullable(m.ins[1 - other[1].pos], i)
            if chain is not None:
                ring.nodes.append(m)
                ring.dots.append(other[1])
                ring.pulled += [p for p in chain if p not in ring.pulled]
        return ring

    # -- matmul -> reduce-scatter
    def seq_split_uses(self, v: jex.Var) -> int | None:
        """The dim every use of ``v`` wants it split on (a graph output included), or None."""
        from mistjax.analysis.layout import Shard

        dims: set[int | None] = set()
        for n, k in self.uses.get(v, []):
            wants = self.wants(n)
            want = None if wants is None else wants[k]
            dims.add(want.dim if isinstance(want, Shard) else None)
        for o, st in zip(self.graph.outvars, self.res.out_states):
            if o is v:
                dims.add(st.dim if isinstance(st, Shard) else None)
        return dims.pop() if len(dims) == 1 and None not in dims else None

    def scatter_ring(self, n: Node) -> ScatterRing | None:
        from mistjax.analysis.layout import Partial, Shard, same_layout

        wants = self.wants(n)
        out = n.outs[0]
        st = self.res.states.get(out)
        if n.prim != "dot_general" or wants is None or not isinstance(st, Partial) or st.op != "sum":
            return None
        if not all(_is_float_var(v) and not isinstance(w, Partial) and same_layout(self.state(v), w)
                   for v, w in zip(n.ins, wants)):
            return None
        held, v = [out], out
        while len(self.uses.get(v, [])) == 1 and v not in self.graph.outvars:
            (m, _), = self.uses[v]
            if m.prim not in _PASS_THROUGH or not self.free(m):
                break
            v = m.outs[0]
            held.append(v)
        dim = self.seq_split_uses(v)
        if dim is None:
            return None
        for p, want in enumerate(wants):
            a = n.ins[p]
            for d in range(shaped(a).ndim):
                if free_out_dim(n.eqn, p, d) == dim and not (isinstance(want, Shard) and want.dim == d):
                    o = n.ins[1 - p]
                    rd = RingDot(n.eqn, p, d, dim, other_spec=_spec(wants[1 - p], shaped(o).ndim, self.axis),
                                 out_spec=spec_on(shaped(out).ndim, dim, self.axis),
                                 act_spec=_spec(want, shaped(a).ndim, self.axis))
                    return ScatterRing(n, rd, held, dim)
        return None

    def run(self) -> RingPlan:
        for i, n in enumerate(self.graph.nodes):
            if not self.free(n) or n.prim != "dot_general":
                continue
            ring = self.gather_ring(i, n) or self.scatter_ring(n)
            if ring is None:
                continue
            self.plan.at[n] = ring
            if isinstance(ring, GatherRing):
                self.plan.skip.update(ring.nodes[1:])
                self.plan.skip.update(ring.pulled)
        return self.plan


def _spec(state: State, ndim: int, axis: str) -> P:
    from mistjax.analysis.layout import Shard

    return spec_on(ndim, state.dim if isinstance(state, Shard) else None, axis)


def plan_rings(graph: Graph, result: TPResult, axis: str) -> RingPlan:
    """Where the layer ``graph`` (under ``result``'s layouts) runs collective matmuls.

    A `GatherRing` replaces the all-gather of a sequence-split input and the column-parallel matmuls
    that read it (every ``dot_general`` whose other operand is split on a free dim and is ready, or made
    by a few plain nodes from ready values, where the first stands); a `ScatterRing` replaces a
    row-parallel matmul and the reduce-scatter of its partial sum when every use (through remat names)
    wants it sequence-split. A partial sum of several matmuls (a parallel block's attention + MLP) keeps
    the plain reduce-scatter.
    """
    return _Planner(graph, result, axis).run()


__all__ = ["GatherRing", "RingDot", "RingPlan", "ScatterRing", "allgather_matmul", "free_out_dim",
           "matmul_reduce_scatter", "plan_rings", "spec_on"]
