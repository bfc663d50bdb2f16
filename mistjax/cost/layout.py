"""Per-device bytes of parameters, gradients and optimizer state, leaf by leaf as the runtime lays them out.

The runtime (`mistjax.core.layout.plan_layouts`) splits tensor-parallel dims by ``t``, splits
ZeRO-3 parameters / ZeRO-1 optimizer state over the MiCS partition group on one dim chosen by
`choose_shard_dim` (a leaf with no divisible dim stays whole), and offloads WHOLE leaves chosen by
`select_offload`. This module applies exactly those functions to the workload's leaf table, once per
distinct combination of the knobs that matter (a handful per tuner call), and broadcasts the
results back over the strategy arrays, so the model charges exactly what the runtime stores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np

from mistjax.analysis.tp_roles import kv_replicated_axes
from mistjax.core.layout import TENSOR_AXES, choose_shard_dim, select_offload
from mistjax.cost.workload import ParamLeaf, Workload

_T = TypeVar("_T")
_Selected = Literal["w", "opt", "acc"]  # what `_selection` picks: weights, optimizer-state copies, grad accumulators


@dataclass(frozen=True)
class LeafTotals:
    """Per-device bytes for one knob combination; ``layer`` = one layer of the stack, ``other`` = embedding,
    head and norms together."""

    w_layer_dev: float  # stored parameter bytes of one layer in device memory
    w_layer_host: float  # ... of one layer in host memory (offloaded weights)
    w_layer_shard: float  # one layer's parameters as ZeRO-sharded where a dim divides (fetch operand)
    w_other_dev: float  # stored non-stacked parameter bytes in device memory
    w_other_shard: float  # non-stacked parameters sharded where a dim divides
    opt_layer_dev: float  # optimizer state of one layer in device memory
    opt_layer_host: float  # optimizer state of one layer in host memory
    opt_other_dev: float  # optimizer state of the non-stacked leaves in device memory
    opt_other_host: float  # ... in host memory
    g_layer_shard: float  # one layer's gradient (in the gradient dtype) as reduce-scattered over the group
    g_other_shard: float  # the non-stacked gradient as reduce-scattered (unsplittable leaves whole)
    acc_layer_host_frac: float  # fraction of the stacked gradient accumulators kept in host memory
    w_layer_fetch: float  # bytes of one layer that are fetched per use (ZeRO-3 gathered or host-streamed)
    w_other_fetch: float  # non-stacked bytes gathered once per micro-batch (ZeRO-3)
    w_pre_fetch: float  # the part of `w_other_fetch` the pre part reads (embedding)
    w_post_fetch: float  # the part of `w_other_fetch` the post part reads (head, final norm)
    w_layer_dev_acc_host: float  # `w_layer_dev` of the leaves whose gradient accumulator is on host
    g_tied: float  # gradient bytes, as the update reads them, of the leaves both the first and last stage hold


FIELDS = tuple(f.name for f in dataclasses.fields(LeafTotals))


def _local_elements(wl: Workload, tp: int, p: int) -> tuple[np.ndarray, np.ndarray]:
    """Per leaf: elements on one device after the tensor split, and whether ZeRO / MiCS can split it ``p`` ways."""
    elems, shardable = [], []
    for leaf in wl.leaves:
        shape, ax = leaf.shape, kv_replicated_axes(leaf.axes, leaf.shape, tp)  # the runtime's kv replication
        tdims: tuple[int, ...] = ()
        if tp > 1 and ax is not None and len(ax) == len(shape):
            tdims = tuple(d for d, n in enumerate(ax) if n in TENSOR_AXES)
        sdim = choose_shard_dim(shape, ax, tdims, leaf.stacked, p, tp) if leaf.size > 1 else None
        elems.append(leaf.size / (tp if tdims else 1))
        shardable.append(sdim is not None)
    return np.asarray(elems, np.float64), np.asarray(shardable, bool)


def held(leaf: ParamLeaf, first: bool, last: bool) -> bool:
    """Whether a pipeline stage (``first`` / ``last``) holds a non-stacked leaf: the first stage the
    pre part's, the last the post part's, both a tied one's (a single stage is first and last)."""
    parts = leaf.parts or frozenset({"pre"})
    return (first and "pre" in parts) or (last and "post" in parts)


def _cached(wl: Workload, key: tuple, make: Callable[[], _T]) -> _T:
    cache = wl.layout_cache  # lives (and dies) with the workload
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _selection(wl: Workload, kind: _Selected, ratio: float, first: bool, last: bool, n: int) -> np.ndarray:
    """Which leaves (or, for ``opt``, which optimizer-state copies of which leaves: ``[copies, leaves]``) a
    stage keeps in host memory at offload ``ratio``: `select_offload` over the stage's whole leaves."""
    L = wl.num_layers
    size = np.array([x.size * n / L if x.stacked else x.size for x in wl.leaves], np.float64)
    mine = np.array([x.stacked or held(x, first, last) for x in wl.leaves]) & (size > 1)
    if kind == "opt":
        idx = np.flatnonzero(mine)
        sel: np.ndarray = np.zeros((wl.opt_copies, len(wl.leaves)), bool)
        picked = np.asarray(select_offload(list(size[idx]) * wl.opt_copies, ratio), bool).reshape(wl.opt_copies, -1)
        sel[:, idx] = picked
        return sel
    idx = np.flatnonzero(np.array([x.stacked for x in wl.leaves]) & (size > 1))
    sel = np.zeros(len(wl.leaves), bool)
    sel[idx] = select_offload(list(size[idx]), ratio)
    return sel


def leaf_totals(wl: Workload, tp: int, p: int, zero: int, wo: float, oo: float, go: float, first: bool = True,
                last: bool = True, layers: int | None = None, ctx: int = 1) -> LeafTotals:
    """`LeafTotals` of one stage for one knob combination (the scalar rules of `plan_layouts`).

    The stage holds ``layers`` rows of every stacked leaf (default: all) and the non-stacked leaves its
    parts read (`held`); offload picks whole leaves among those, largest first, as the runtime does for
    a stage's own leaves. Bytes per element: parameters in their own dtype, gradients in the workload's
    gradient dtype, every optimizer-state copy (moments, master weights) in ``state_itemsize``. ``ctx``: the
    `context` devices the optimizer state (and ZeRO-3's weights) are split over too (`core.layout.context_shards`),
    on leaves the ``p x ctx`` group divides (`core.layout.shard_split`).
    """
    L = wl.num_layers
    n = L if layers is None else layers
    elems, shardable = _cached(wl, ("local", tp, p), lambda: _local_elements(wl, tp, p))
    stacked = np.array([x.stacked for x in wl.leaves])
    held_other = np.array([not x.stacked and held(x, first, last) for x in wl.leaves])
    opt_host = _cached(wl, ("opt", oo, first, last, n), lambda: _selection(wl, "opt", oo, first, last, n))
    w_host = _cached(wl, ("w", wo, n), lambda: _selection(wl, "w", wo, first, last, n))
    acc_host = _cached(wl, ("acc", go, n), lambda: _selection(wl, "acc", go, first, last, n))
    size = np.array([x.size for x in wl.leaves], np.float64)
    acc_frac = float(np.sum(size[acc_host]) / max(np.sum(size[stacked & (size > 1)]), 1))
    per = np.where(stacked, 1.0 / L, 1.0)
    nbytes = elems * np.array([x.itemsize for x in wl.leaves])
    w_sh = np.where(shardable & (zero >= 3), nbytes / p, nbytes)
    w_any = np.where(shardable, nbytes / p, nbytes)
    g_bytes = elems * np.array([wl.grad_itemsize(x) for x in wl.leaves])
    g_sh = np.where(shardable, g_bytes / p, g_bytes)
    o_bytes = elems * wl.state_itemsize
    o = np.where(shardable & (zero >= 1), o_bytes / p, o_bytes)
    if ctx > 1 and zero >= 1:
        both = _cached(wl, ("local", tp, p * ctx), lambda: _local_elements(wl, tp, p * ctx))[1]
        o = np.where(both, o_bytes / (p * ctx), o)
        if zero >= 3:  # ZeRO-3 weights are split over the data x context group too (`core.layout.plan_layouts`)
            w_sh = np.where(both, nbytes / (p * ctx), w_sh)
    o_host = opt_host.sum(axis=0)  # copies of each leaf on host
    layer, other = stacked, held_other
    fetched = w_host | (shardable & (zero >= 3))
    other_fetched = other & shardable & (zero >= 3)
    by_pre = np.array([held(x, True, False) for x in wl.leaves])  # read by the pre part (as `held` says)
    by_post = np.array([held(x, False, True) for x in wl.leaves])

    def total(values: np.ndarray, mask: np.ndarray) -> float:
        return float(np.sum((values * per)[mask]))

    return LeafTotals(
        w_layer_dev=total(w_sh, layer & ~w_host), w_layer_host=total(w_sh, layer & w_host),
        w_layer_shard=total(w_any, layer), w_other_dev=total(w_sh, other), w_other_shard=total(w_any, other),
        opt_layer_dev=total(o * (wl.opt_copies - o_host), layer), opt_layer_host=total(o * o_host, layer),
        opt_other_dev=total(o * (wl.opt_copies - o_host), other), opt_other_host=total(o * o_host, other),
        g_layer_shard=total(g_sh, layer), g_other_shard=total(g_sh, other), acc_layer_host_frac=acc_frac,
        w_layer_fetch=total(nbytes, layer & fetched),
        w_other_fetch=total(nbytes, other_fetched), w_pre_fetch=total(nbytes, other_fetched & by_pre),
        w_post_fetch=total(nbytes, other_fetched & by_post),
        w_layer_dev_acc_host=total(w_sh, layer & ~w_host & acc_host),
        g_tied=total(g_sh if zero >= 2 else g_bytes, other & by_pre & by_post))


_DENSE_KEYS = 1 << 22  # mixed-radix key spaces up to this size are deduplicated by a table lookup, not a sort


def unique_rows(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of the broadcast of ``columns`` and the inverse index (flat over the broadcast shape).

    Rows come sorted by their mixed-radix key (each column's distinct values, column by column). Every
    column is made distinct in its own shape before broadcasting (the tuner's strategy columns are far
    smaller than their broadcast), and a small key space is deduplicated by a presence table (linear)
    instead of sorting every broadcast element.
    """
    shape = np.broadcast_shapes(*(np.shape(c) for c in columns))
    key: np.ndarray = np.zeros((), dtype=np.int64)
    uniqs: list[np.ndarray] = []
    for col in columns:
        u, inv = np.unique(col, return_inverse=True)
        key = key * len(u) + inv.reshape(np.shape(col))
        uniqs.append(u)
    key = np.broadcast_to(key, shape).ravel()
    space = int(np.prod([len(u) for u in uniqs], dtype=np.float64))
    if space <= _DENSE_KEYS:
        present = np.zeros(space, dtype=bool)
        present[key] = True
        ukey = np.flatnonzero(present)
        slot = np.cumsum(present) - 1
        inverse = slot[key]
    else:
        ukey, inverse = np.unique(key, return_inverse=True)
    digits, rest = [], ukey
    for u in reversed(uniqs):
        rest, d = np.divmod(rest, len(u))
        digits.append(u[d])
    return np.stack(digits[::-1], axis=1), inverse.reshape(-1)


def totals_over(wl: Workload, columns: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """`leaf_totals` for every row of the broadcast columns ``(tp, p, zero, wo, oo, go, first, last, layers[, ctx])``.

    Distinct rows are few (TP degrees x group sizes x ZeRO stages x offload ratios x stage positions), so
    the Python loop runs over those, never per strategy.
    """
    cols = [np.asarray(c, dtype=np.float64) for c in columns]
    shape = np.broadcast_shapes(*(c.shape for c in cols))
    uniq, inv = unique_rows(cols)
    rows = []
    cache = wl.layout_cache  # lives (and dies) with the workload
    for r in uniq.tolist():
        key = ("totals", int(r[0]), int(r[1]), int(r[2]), r[3], r[4], r[5], bool(r[6]), bool(r[7]), int(r[8]),
               int(r[9]) if len(r) > 9 else 1)
        row = cache.get(key)
        if row is None:
            lt = leaf_totals(wl, *key[1:])
            row = cache[key] = np.array([getattr(lt, f) for f in FIELDS])
        rows.append(row)
    table = np.stack(rows, axis=1)[:, inv.ravel()]  # [FIELDS, elements]
    return {f: table[k].reshape(shape) for k, f in enumerate(FIELDS)}


__all__ = ["FIELDS", "LeafTotals", "held", "leaf_totals", "totals_over"]
