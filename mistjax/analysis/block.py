"""One layer of a traced loss with symbolic dims and propagated tensor-parallel layouts.

The runtime's Megatron block (`mistjax.runtime.tensor`) evaluates a layer under these layouts, so the
compiled program does exactly what the analysis prices. Layouts need symbolic sizes (a partial sum
is reduce-scattered onto the *sequence* dim, which only a fit over several sizes can tell from, say,
the hidden size), so the loss is traced again at six more ``(b, s)`` points around the runtime's
micro-batch, as `analyze_model` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.extend import core as jex

from mistjax.analysis.graph import Graph, build_graph
from mistjax.analysis.layout import REP, Shard, State, TPResult
from mistjax.analysis.poly import PS
from mistjax.analysis.tp import propagate
from mistjax.core.execution import is_batch_leaf
from mistjax.core.jaxpr import Atom, Shaped
from mistjax.core.types import LossFn
from mistjax.trace.split import LayerStack, TracedLoss, trace_loss

Axes = tuple[str | None, ...] | None


def activation_state(graph: Graph, v: Atom, sequence_parallel: bool = True) -> State:
    """Sequence parallelism's layout of an activation: split along its sequence dim (if it has one)."""
    if not sequence_parallel or isinstance(v, jex.Literal) or not jax.dtypes.issubdtype(v.aval.dtype, np.inexact):
        return REP
    d = next((k for k, x in enumerate(graph.shape(v)) if x == PS), None)
    return REP if d is None else Shard(d, seq=True)


def weight_state(axes: Axes, rank: int, tensor_axes: Sequence[str]) -> State:
    """The tensor-parallel layout of a weight (or a layer slice of a stacked one) from its logical axes:
    split along its first dim named in ``tensor_axes``, else replicated."""
    if axes is None:
        return REP
    if len(axes) == rank + 1:  # a layer slice of a stacked leaf: drop the "layers" axis
        axes = axes[1:]
    return next((Shard(d) for d, name in enumerate(axes) if name in tensor_axes), REP)


def hidden_sizes(stack: LayerStack) -> tuple[int, int] | None:
    """(micro-batch, sequence) of the hidden state: the first float carry of rank >= 2."""
    for v in stack.body.jaxpr.invars[stack.num_consts: stack.num_consts + stack.num_carry]:
        shape = v.aval.shape
        if len(shape) >= 2 and jax.dtypes.issubdtype(v.aval.dtype, np.inexact):
            return int(shape[0]), int(shape[1])
    return None


def fit_points(b: int, s: int) -> list[tuple[int, int]]:
    """Seven ``(b, s)`` trace points, the runtime's own first: two batch sizes x three sequence
    lengths to fit (degree <= 1 in b, <= 2 in s), and a check point. Shorter sequences first, so a
    model with a maximal sequence length (a position table) still traces.

    For ``s`` a multiple of 4 the lengths are ``s, s/2, s/4`` and the check ``3s/4``: all multiples
    of ``s/4``, so code that takes its path from the length's divisibility takes the real size's
    path at every point. The blockwise attention kernel (`models.attention`) does: it scans
    ``s / block`` key blocks when the block divides ``s`` and pads the keys otherwise, so a check
    at ``s - 1`` (2047 for s = 2048) traced two more equations and a trip count off the fit, and the
    Megatron block fell back to GSPMD. Other lengths keep ``s // 2, s // 4, s - 1``.
    """
    if s >= 4 and s % 4 == 0:
        ss = [s // 2, s // 4, 3 * s // 4]
    elif s >= 4:
        ss = [s // 2, s // 4, s - 1]
    else:
        ss = [s + 1, s + 2, s + 3]
    return [(b, s), (b + 1, s), (b, ss[0]), (b + 1, ss[0]), (b, ss[1]), (b + 1, ss[1]), (b + 2, ss[2])]


def resized(leaves: Sequence[Shaped], batch: Sequence[bool], b: int, s: int, b2: int, s2: int
            ) -> list[jax.ShapeDtypeStruct]:
    """``leaves`` as ShapeDtypeStructs with every batch leaf's ``[b, s, ...]`` resized to ``[b2, s2, ...]``."""
    out = []
    for x, is_batch in zip(leaves, batch):
        shape = list(np.shape(x))
        if is_batch:
            shape[0] = b2
            if len(shape) >= 2 and shape[1] == s:
                shape[1] = s2
        out.append(jax.ShapeDtypeStruct(tuple(shape), x.dtype))
    return out


def block_graph(fun: LossFn, traced: TracedLoss, batch: Sequence[bool] | None = None) -> Graph:
    """The layer body of ``traced`` as a `Graph` with dims fitted over `fit_points`.

    Args:
      fun: the loss ``traced`` was traced from (``fun(params, *rest)``).
      traced: its trace at the runtime's micro-batch (with ``rest_tree``).
      batch: per rest leaf, whether it is batch data (leading dim = micro-batch, second dim the
        sequence when it equals it); default: leaves whose leading dim equals the hidden state's.
    """
    stack = traced.require_stack()
    sizes = hidden_sizes(stack)
    if sizes is None or traced.rest_tree is None:
        raise ValueError("the layer stack carries no [batch, sequence, ...] hidden state")
    b, s = sizes
    invars = traced.closed.jaxpr.invars
    n = traced.num_param_leaves
    params = traced.param_structs()
    rest = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars[n:]]
    if batch is None:
        batch = [is_batch_leaf(x.shape, b) for x in rest]
    points = fit_points(b, s)
    others = []
    for b2, s2 in points[1:]:
        r = jax.tree.unflatten(traced.rest_tree, resized(rest, batch, b, s, b2, s2))
        others.append(trace_loss(fun, params, *r).require_stack().body)
    return build_graph(stack.body, others, points)


def block_layouts(graph: Graph, stack: LayerStack, tensor_dims: Sequence[tuple[int, ...] | None]) -> TPResult:
    """Propagate Megatron layouts through one layer (as `analyze_model` does for its forward).

    Args:
      graph: the layer body (`block_graph`).
      stack: its layer stack.
      tensor_dims: per scanned operand, the dims of its *stacked* leaf split over ``tensor``
        (None or empty: replicated).
    """
    nc, ncar = stack.num_consts, stack.num_carry
    in_states: dict[jex.Var, State] = {v: activation_state(graph, v) for v in graph.invars[nc:nc + ncar]}
    weights = []
    for v, dims in zip(graph.invars[nc + ncar:], tensor_dims):
        if dims:
            in_states[v] = Shard(dims[0] - 1)  # a layer slice: the stacked leaf minus its layer dim
        if dims is not None:
            weights.append(v)
    model_sizes = [graph.shape(v)[st.dim] for v, st in in_states.items() if isinstance(st, Shard) and not st.seq]
    targets: list[State | None] = [activation_state(graph, v) for v in graph.outvars[:ncar]]
    targets += [None] * (len(graph.outvars) - ncar)
    return propagate(graph, in_states, targets, sequence_parallel=True, param_vars=weights,
                     model_sizes=model_sizes)


__all__ = ["activation_state", "block_graph", "block_layouts", "fit_points", "hidden_sizes", "resized",
           "weight_state"]
