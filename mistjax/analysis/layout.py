"""Tensor-parallel layouts of values, the collectives between them, and running a graph under them.

A value is replicated (``None``), split along one dim (`Shard`), or a partial sum / max held by
every device (`Partial`). `mistjax.analysis.tp` propagates these through a graph;
`constrain_graph` evaluates the graph with every value (and every consumer-side conversion)
constrained to its propagated layout, so that GSPMD realises exactly the recorded collectives.
The tests compare its HLO with the prediction; the runtime may use it to get Megatron's
schedule rather than GSPMD's own choices (with only the hidden state constrained, GSPMD
all-gathers weights and uses all-to-alls around grouped-query attention instead).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.extend import core as jex
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.analysis.graph import Graph, Node
from mistjax.analysis.poly import Poly, prod
from mistjax.core.jaxpr import Atom, Value, bind_equation, read


@dataclass(frozen=True)
class Shard:
    """Split along ``dim``; ``seq`` marks a sequence-parallel split (gathered first on conflict)."""

    dim: int
    seq: bool = False


@dataclass(frozen=True)
class Partial:
    """Each device holds a summand (``op='sum'``) or a partial maximum / minimum."""

    op: str = "sum"
    rs_ok: bool = False  # came from contracting a split weight: reduce-scatter over the sequence


State = Shard | Partial | None  # None: replicated
REP: State = None


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective on the ``tensor`` axis (sizes as polynomials; see `tp_summary`)."""

    kind: str  # all-gather | reduce-scatter | all-reduce | all-to-all
    nbytes: Poly  # full (unsharded) buffer bytes: AG output, RS / AR input
    shape: tuple[Poly, ...]  # full shape
    dtype: str
    count: Poly  # how many times it runs per pass (loop trip counts)
    where: str  # the primitive that needed it, or "output"
    summands: int = 1  # partial products summed locally before this reduction (1 for gathers)


def same_layout(a: State, b: State) -> bool:
    if isinstance(a, Shard) and isinstance(b, Shard):
        return a.dim == b.dim
    return a == b


def generic_dims(dims: Sequence[Poly]) -> list[int]:
    """Dims at a generic point (b=7, s=101, t=1): products match exactly when the polynomials do."""
    return [round(x(7, 101)) for x in dims]


def map_reshape(src: Sequence[int], dst: Sequence[int], d: int) -> int | None:
    """The dst dim that carries src dim ``d``'s split through a reshape, or None if it cannot.

    Dims are grouped into runs with equal products; a split survives when it is the major
    (first non-unit) dim of its run and lands on the major non-unit dim of the matching run.
    """
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [i], [j]
        pi = src[i] if i < len(src) else 1
        pj = dst[j] if j < len(dst) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i)
                pi *= src[i]
                i += 1
            elif j < len(dst):
                gj.append(j)
                pj *= dst[j]
                j += 1
            else:
                return None
        if d in gi:
            major_i = next((k for k in gi if k < len(src) and src[k] != 1), None)
            major_j = next((k for k in gj if k < len(dst) and dst[k] != 1), None)
            return major_j if major_i == d else None
    return None


@dataclass
class TPResult:
    """Layouts and collectives of one graph."""

    states: dict[jex.Var, State]
    node_states: dict[Node, tuple[list[State], list[State]]]
    collectives: list[CollectiveRecord] = field(default_factory=list)
    extra: list[tuple[int, jex.Var, Poly]] = field(default_factory=list)  # (node index, var, local bytes) copies
    divisors: set[Poly] = field(default_factory=set)  # split dim sizes: t must divide each
    notes: list[str] = field(default_factory=list)
    out_states: list[State] = field(default_factory=list)  # layouts of the graph outputs after resolution
    params: set[jex.Var] = field(default_factory=set)  # weights and values derived from them by casts / views

    def local_dims(self, graph: Graph, v: Atom, st: State) -> tuple[Poly, ...]:
        """Per-device dims of ``v`` in layout ``st`` (a partial value is held whole on each device)."""
        dims = graph.shape(v)
        if isinstance(st, Shard):
            return tuple(x.div_t() if k == st.dim else x for k, x in enumerate(dims))
        return dims


def nbytes(graph: Graph, v: jex.Var) -> Poly:
    return prod(graph.shape(v)) * int(np.dtype(v.aval.dtype).itemsize)


def partition_spec(state: State, ndim: int, axis: str = "tensor", seq: int | None = None,
                   context: str | None = None) -> P | None:
    """The PartitionSpec of a layout (None for a partial value: leave it to GSPMD).

    Args:
      state: the tensor-parallel layout.
      ndim: the value's rank.
      axis: the tensor-parallel mesh axis.
      seq: the value's sequence dim, split over ``context`` under context parallelism (None: it has none).
      context: the context-parallel mesh axis (None: no context parallelism). A dim split over both is
        split over ``context`` major, then ``axis``, as the hidden state is between layers.
    """
    if isinstance(state, Partial):
        return None
    entries: list[str | tuple[str, str] | None] = [None] * ndim
    if context is not None and seq is not None:
        entries[seq] = context
    if isinstance(state, Shard):
        entries[state.dim] = (context, axis) if entries[state.dim] is not None else axis
    return P(*entries)


def constrain_graph(
    graph: Graph, result: TPResult, mesh: jax.sharding.Mesh, axis: str = "tensor"
) -> Callable[..., list[Value]]:
    """A function evaluating ``graph`` with every value constrained to its propagated layout.

    The returned ``f(*args)`` takes the graph's inputs (constvars are bound from the trace) and
    returns its outputs. Under ``jax.jit`` with the inputs sharded like `result.states`, GSPMD
    then inserts exactly the collectives the propagation recorded.
    """

    def constrain(v: jex.Var, x: Value) -> Value:
        st = result.states.get(v, REP)
        spec = partition_spec(st, np.ndim(x), axis)
        if spec is None or not hasattr(x, "shape"):
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def run(g: Graph, args: Sequence[Value]) -> list[Value]:
        env: dict[jex.Var, Value] = dict(g.consts)
        env.update(zip(g.invars, args))
        for n in g.nodes:
            vals = [read(env, v) for v in n.ins]
            eff = result.node_states.get(n, ([None] * len(n.ins), []))[0]
            for k, (v, st) in enumerate(zip(n.ins, eff)):
                # The consumer needs a layout other than the value's own: a gathered copy, a
                # reduce-scattered partial sum or a local slice. Say so, or GSPMD picks its own.
                if (
                    isinstance(v, jex.Var)
                    and not isinstance(st, Partial)
                    and st != result.states.get(v, REP)
                    and not (
                        isinstance(st, Shard)
                        and isinstance(result.states.get(v), Shard)
                        and st.dim == result.states[v].dim
                    )
                ):
                    spec = partition_spec(st, np.ndim(vals[k]), axis)
                    vals[k] = jax.lax.with_sharding_constraint(vals[k], NamedSharding(mesh, spec))
            for v, o in zip(n.outs, bind_equation(n.eqn, vals)):
                env[v] = constrain(v, o)
        return [read(env, v) for v in g.outvars]

    return lambda *args: run(graph, args)
