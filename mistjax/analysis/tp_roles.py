"""Tensor-parallel roles of unnamed weights, inferred from the layer's dataflow (Megatron's pairing).

A model whose weights carry no logical axis names (Hugging Face's Flax models, plain NNX / linen
modules, pure functions) still has Megatron's structure: a *column* weight whose matmul output feeds,
through elementwise ops, views and attention, the contraction of a *row* weight (MLP up / gate ->
down, attention q / k / v -> output). `infer_tensor_axes` finds the pairs by propagating trial splits
through one layer with the analysis's own layout rules (`mistjax.analysis.tp`):

* a weight of the layer is tried split on the free dim of its matmul (column). The trial is kept when
  the split reaches the contraction of weights not yet assigned (they become row weights, split on
  their contracted dim) without any all-gather or all-to-all on the way; or, with no new row weight,
  when it adds no communication (the other column weights of a pair already found: k and v next to q);
* finally a 1-D weight the propagation wants split (a column bias) is split too.

A weight whose split would need a gather (GPT-2's fused ``c_attn``, whose output is cut into q, k, v
along the split dim) stays replicated, so only the pairs that Megatron would split are split. The
result is given as logical axes (``"mlp"`` on the split dim), which the runtime, the analysis and the
cost model's leaf table read like names the model attached itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

from jax.extend import core as jex

from mistjax.analysis.graph import Graph, Node, build_graph
from mistjax.analysis.layout import REP, Shard, State, TPResult
from mistjax.analysis.tp import propagate
from mistjax.core.axes import AxisRules, apply_axis_rules, leaf_axes
from mistjax.core.layout import TENSOR_AXES
from mistjax.core.types import PyTree
from mistjax.trace.split import TracedLoss

Axes = tuple[str | None, ...] | None
SPLIT_NAME = "mlp"  # the logical name an inferred split dim gets (any of TENSOR_AXES would do)


def _dots(graph: Graph) -> list[Node]:
    return [n for n in graph.walk() if n.prim == "dot_general"]


def _free_dims(node: Node, side: int) -> list[int]:
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    c, b = (lc, lb) if side == 0 else (rc, rb)
    rank = len(node.ins[side].aval.shape)
    return [d for d in range(rank) if d not in c and d not in b]


def _score(res: TPResult) -> tuple[int, int, float]:
    """(gathers / all-to-alls, collectives, total collective bytes at the traced size). A layer output left
    split counts as a gather: the hidden state between layers must be whole (`REP` targets are "leave it")."""
    bad = sum(1 for c in res.collectives if c.kind in ("all-gather", "all-to-all"))
    bad += sum(1 for st in res.out_states if isinstance(st, Shard))
    nbytes = sum(float(c.nbytes.exact(1, 1)) * float(c.count.exact(1, 1)) for c in res.collectives)
    return bad, len(res.collectives), float(nbytes)


_SAME_SHAPE = frozenset({"convert_element_type", "copy", "copy_p", "name", "reduce_precision", "optimization_barrier"})


Sources: TypeAlias = dict[jex.Var, tuple[jex.Var, tuple[int, ...]]]  # var -> (weight, per own dim its dim)


def _sources(graph: Graph, weights: set[jex.Var]) -> Sources:
    """Var -> (the weight it is a view of, per own dim the weight's dim): the weight itself, a cast / copy
    (same dims) or a transpose of it (GPT-2's ``Conv1D`` multiplies by ``kernel.T``)."""
    src: Sources = {v: (v, tuple(range(len(v.aval.shape)))) for v in weights}
    for n in graph.walk():
        ins = [src.get(i) if isinstance(i, jex.Var) else None for i in n.ins]
        if n.prim in _SAME_SHAPE and len(n.ins) == len(n.outs):
            for hit, o in zip(ins, n.outs):
                if hit is not None:
                    src[o] = hit
        elif n.prim == "transpose" and ins[0] is not None:
            w, dims = ins[0]
            src[n.outs[0]] = (w, tuple(dims[p] for p in n.params["permutation"]))
    return src


def _wanted_splits(res: TPResult, src: Sources, assigned: dict[jex.Var, State]) -> dict[jex.Var, Shard]:
    """Weights not yet assigned that the propagation wants split (a local slice of a replicated input)."""
    out: dict[jex.Var, Shard] = {}
    for node, (ins, _) in res.node_states.items():
        for v, st in zip(node.ins, ins):
            hit = src.get(v) if isinstance(v, jex.Var) else None
            if hit is not None and hit[0] not in assigned and isinstance(st, Shard) and \
                    res.states.get(v, REP) is REP:
                out.setdefault(hit[0], Shard(hit[1][st.dim]))
    return out


def infer_layer_splits(graph: Graph, weights: Sequence[jex.Var], activations: Sequence[jex.Var]
                       ) -> dict[jex.Var, Shard]:
    """Megatron splits of ``weights`` (vars of ``graph``) by trial propagation (see the module doc)."""
    wset = set(weights)
    src = _sources(graph, wset)
    assigned: dict[jex.Var, State] = {}

    def run(states: dict[jex.Var, State]) -> TPResult:
        targets = [REP] * len(graph.outvars)
        return propagate(graph, {**{a: REP for a in activations}, **states}, targets, sequence_parallel=False,
                         param_vars=list(weights))

    base = _score(run(assigned))
    order: list[tuple[jex.Var, int]] = []
    for node in _dots(graph):
        for side in (0, 1):
            v = node.ins[side]
            hit = src.get(v) if isinstance(v, jex.Var) else None
            if hit is not None and len(hit[0].aval.shape) >= 2:
                order.extend((hit[0], hit[1][d]) for d in _free_dims(node, side))
    tried: set[tuple[jex.Var, int]] = set()
    for v, d in order:
        if v in assigned or (v, d) in tried:
            continue
        tried.add((v, d))
        trial = {**assigned, v: Shard(d)}
        res = run(trial)
        score = _score(res)
        rows = {u: s for u, s in _wanted_splits(res, src, trial).items() if len(u.aval.shape) >= 2}
        if score[0] > base[0]:
            continue  # the split needs a gather on the way
        if rows:
            # A Megatron pair: the split reaches the row weights with no collective on the way; only the
            # row matmul's partial sum is reduced (one more collective), as in Megatron.
            trial.update(rows)
            res = run(trial)
            new = _score(res)
            if new[0] > base[0] or new[1] > base[1] + 1:
                continue
        elif score[1] > base[1] or score[2] > base[2]:
            continue  # another column of a pair found already must add no communication
        assigned, base = trial, _score(res)
    if assigned:  # column biases: the 1-D weights the propagation wants split
        res = run(assigned)
        assigned.update({u: s for u, s in _wanted_splits(res, src, assigned).items() if len(u.aval.shape) == 1})
    return {v: s for v, s in assigned.items() if isinstance(s, Shard)}


def has_tensor_names(axes: Sequence[Axes]) -> bool:
    """Whether any leaf names a tensor-split axis (then names rule and nothing is inferred)."""
    return any(ax is not None and any(n in TENSOR_AXES for n in ax) for ax in axes)


def infer_tensor_axes(traced: TracedLoss, axes: Sequence[Axes]) -> list[Axes]:
    """Per real parameter leaf, its logical axes: ``axes`` when any weight names a tensor-split axis, else
    axes with the Megatron splits `infer_layer_splits` finds in the layer (other leaves keep theirs).

    Args:
      traced: the loss (with its layer stack; without one nothing is inferred).
      axes: per real parameter leaf, the names from the model's metadata (None: unnamed).
    """
    axes = list(axes)
    stack = traced.stack
    if stack is None or has_tensor_names(axes):
        return axes
    graph = build_graph(stack.body)
    nc, ncar = stack.num_consts, stack.num_carry
    xs = graph.invars[nc + ncar:]
    weights = [v for v, i in zip(xs, stack.xs_leaf) if i is not None]
    acts = [v for v in graph.invars[nc:nc + ncar]]
    splits = infer_layer_splits(graph, weights, acts)
    if not splits:
        return axes
    leaf_of = {v: i for v, i in zip(xs, stack.xs_leaf) if i is not None}
    groups = traced.groups
    for v, st in splits.items():
        k = leaf_of[v]
        rank = len(v.aval.shape)
        names: list[str | None] = [None] * rank
        names[st.dim] = SPLIT_NAME
        if groups is None:  # a stacked leaf: its slice's dims follow the layer dim
            axes[k] = ("layers", *names)
        else:
            for r in groups.virtual[k]:
                axes[r] = tuple(names)
    return axes


def model_tensor_axes(traced: TracedLoss, params: PyTree, axis_rules: AxisRules | None = None) -> list[Axes]:
    """Per real parameter leaf of ``params``, the logical axes mistjax lays it out by: the model's metadata
    (NNX / linen), renamed by ``axis_rules`` (MaxText style), or, when no weight names a tensor-split
    axis, the Megatron splits inferred from the layer's dataflow."""
    return infer_tensor_axes(traced, apply_axis_rules(leaf_axes(params), axis_rules))


# Key / value heads: split over ``tensor`` when the degree divides them, else kept whole on every device
# (replicated), as inference engines do for multi-query attention. The query heads stay split; each device's
# query heads read the replicated key / value heads, and the projections' gradients are summed over the
# tensor group. A replicated dim is renamed `REPLICATED_KV`, a name no layout rule splits.
KV_AXIS = "kv_heads"
REPLICATED_KV = "kv_heads_replicated"
# The tensor-split names of an analysis with every kv head replicated (`mistjax.cost.kv_regimes`).
TENSOR_AXES_KV_REPLICATED = tuple(n for n in TENSOR_AXES if n != KV_AXIS)


def replicates_kv(size: int, tp: int) -> bool:
    """Whether ``tp``-way tensor parallelism keeps a ``kv_heads`` dim of ``size`` whole (``tp`` does not divide
    it)."""
    return tp > 1 and int(size) % tp != 0


def kv_replicated_axes(axes: Axes, shape: Sequence[int], tp: int) -> Axes:
    """``axes`` of a leaf of ``shape`` with each ``kv_heads`` dim that ``tp`` does not divide renamed
    `REPLICATED_KV` (kept whole); other names, and leaves without names, unchanged."""
    if axes is None or len(axes) != len(shape) or KV_AXIS not in axes:
        return axes
    return tuple(REPLICATED_KV if n == KV_AXIS and replicates_kv(d, tp) else n for n, d in zip(axes, shape))


def kv_head_sizes(axes: Sequence[Axes], shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The distinct sizes of the dims named ``kv_heads`` (sorted; empty when no leaf names one)."""
    return tuple(sorted({int(d) for ax, shape in zip(axes, shapes) if ax is not None and len(ax) == len(shape)
                         for d, n in zip(shape, ax) if n == KV_AXIS}))


def splittable(axes: Sequence[Axes], shapes: Sequence[tuple[int, ...]], tp: int) -> bool:
    """Whether some leaf has a tensor-split dim and ``tp`` divides every such dim (``kv_heads`` dims it does not
    divide are replicated, `kv_replicated_axes`)."""
    dims = [d for ax, shape in zip(axes, shapes) if ax is not None and len(ax) == len(shape)
            for d, n in zip(shape, kv_replicated_axes(ax, shape, tp)) if n in TENSOR_AXES]
    return bool(dims) and all(int(d) % tp == 0 for d in dims)


__all__ = ["KV_AXIS", "REPLICATED_KV", "SPLIT_NAME", "TENSOR_AXES_KV_REPLICATED", "has_tensor_names",
           "infer_layer_splits", "infer_tensor_axes", "kv_head_sizes", "kv_replicated_axes", "model_tensor_axes",
           "replicates_kv", "splittable"]
