"""Per-device bytes of parameters, gradients and optimizer state, leaf by leaf as the runtime lays them out.

The runtime (`mistjax.core.layout.plan_layouts`) splits tensor-parallel dims by ``t``, splits
ZeRO-3 parameters / ZeRO-1 optimizer state over the MiCS partition group on one dim chosen by
`choose_shard_dim` (a leaf with no divisible dim stays whole), and offloads WHOLE leaves chosen by
`select_offload`. This module applies exactly those functions to the workload's leaf table, once per
distinct combination of the knobs that matter (a handful per tuner call), and broadcasts the
results back over the strategy arrays, so the model charges exactly what the runtime stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mistjax.core.layout import TENSOR_AXES, choose_shard_dim, select_offload
from mistjax.cost.workload import Workload

FIELDS = ("w_layer_dev", "w_layer_host", "w_layer_shard", "w_other_dev", "w_other_shard", "opt_layer_dev",
          "opt_layer_host", "opt_other_dev", "opt_other_host", "g_layer_shard", "g_other_shard",
          "acc_layer_host_frac", "w_layer_fetch", "w_other_fetch")


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


def _local_elements(wl: Workload, tp: int, p: int) -> list[tuple[float, bool]]:
    """Per leaf: elements on one device after the tensor split, and whether ZeRO / MiCS can split it ``p`` ways."""
    out = []
    for leaf in wl.leaves:
        shape, ax = leaf.shape, leaf.axes
        tdims: tuple[int, ...] = ()
        if tp > 1 and ax is not None and len(ax) == len(shape):
            tdims = tuple(d for d, n in enumerate(ax) if n in TENSOR_AXES)
        sdim = choose_shard_dim(shape, ax, tdims, leaf.stacked, p, tp) if leaf.size > 1 else None
        out.append((leaf.size / (tp if tdims else 1), sdim is not None))
    return out


def leaf_totals(wl: Workload, tp: int, p: int, zero: int, wo: float, oo: float, go: float) -> LeafTotals:
    """`LeafTotals` for one knob combination (the scalar rules of `plan_layouts`).

    Bytes per element: parameters in their own dtype, gradients in the workload's gradient dtype, and every
    optimizer-state copy (moments, master weights) in ``state_itemsize``.
    """
    L = wl.num_layers
    local = _local_elements(wl, tp, p)
    # Offload choices, by element counts over whole leaves, exactly as the runtime picks them.
    opt_idx = [i for i, x in enumerate(wl.leaves) if x.size > 1]
    opt_host_sel = select_offload([wl.leaves[i].size for i in opt_idx] * wl.opt_copies, oo)
    st_idx = [i for i, x in enumerate(wl.leaves) if x.stacked and x.size > 1]
    w_host = dict(zip(st_idx, select_offload([wl.leaves[i].size for i in st_idx], wo)))
    acc_sel = select_offload([wl.leaves[i].size for i in st_idx], go)
    acc_frac = sum(wl.leaves[i].size for i, h in zip(st_idx, acc_sel) if h) / max(
        sum(wl.leaves[i].size for i in st_idx), 1)
    t = dict.fromkeys(FIELDS, 0.0)
    n_opt = len(opt_idx)
    for i, (leaf, (elems, shardable)) in enumerate(zip(wl.leaves, local)):
        per = (1.0 / L) if leaf.stacked else 1.0
        key = "layer" if leaf.stacked else "other"
        nbytes = elems * leaf.itemsize
        w_sh = nbytes / p if (shardable and zero >= 3) else nbytes
        host = w_host.get(i, False)
        t[f"w_{key}_dev"] += 0.0 if host else w_sh * per
        if key == "layer":
            t["w_layer_host"] += w_sh * per if host else 0.0
            t["w_layer_fetch"] += nbytes * per if (host or (shardable and zero >= 3)) else 0.0
        else:
            t["w_other_fetch"] += nbytes if (shardable and zero >= 3) else 0.0
        t[f"w_{key}_shard"] += (nbytes / p if shardable else nbytes) * per
        g_bytes = elems * wl.grad_itemsize(leaf)
        t[f"g_{key}_shard"] += (g_bytes / p if shardable else g_bytes) * per
        o_bytes = elems * wl.state_itemsize
        o = o_bytes / p if (shardable and zero >= 1) else o_bytes
        if i in opt_idx:
            j = opt_idx.index(i)
            for c in range(wl.opt_copies):
                where = "host" if opt_host_sel[c * n_opt + j] else "dev"
                t[f"opt_{key}_{where}"] += o * per
        else:
            t[f"opt_{key}_dev"] += o * per * wl.opt_copies
    t["acc_layer_host_frac"] = acc_frac
    return LeafTotals(**t)


def unique_rows(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of broadcast 1-D columns and the inverse index (1-D sorts only: fast)."""
    codes, uniqs, key = [], [], np.zeros(np.shape(columns[0]), dtype=np.int64)
    for col in columns:
        u, inv = np.unique(col, return_inverse=True)
        key = key * len(u) + inv.reshape(key.shape)
        uniqs.append(u)
        codes.append(inv)
    ukey, first, inverse = np.unique(key.ravel(), return_index=True, return_inverse=True)
    rows = np.stack([np.asarray(c).ravel()[first] for c in columns], axis=1)
    return rows, inverse


def totals_over(wl: Workload, columns: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """`leaf_totals` for every row of the broadcast columns ``(tp, p, zero, wo, oo, go)``.

    Distinct rows are few (TP degrees x group sizes x ZeRO stages x offload ratios), so the Python
    loop runs over those, never per strategy.
    """
    cols = np.broadcast_arrays(*[np.asarray(c, dtype=np.float64) for c in columns])
    shape = cols[0].shape
    uniq, inv = unique_rows([c.ravel() for c in cols])
    rows = []
    cache = wl.layout_cache  # lives (and dies) with the workload
    for r in uniq:
        key = (int(r[0]), int(r[1]), int(r[2]), float(r[3]), float(r[4]), float(r[5]))
        if key not in cache:
            cache[key] = leaf_totals(wl, *key)
        rows.append(cache[key])
    out = {}
    for f in FIELDS:
        vals = np.array([getattr(r, f) for r in rows])
        out[f] = vals[inv.ravel()].reshape(shape)
    return out


__all__ = ["FIELDS", "LeafTotals", "leaf_totals", "totals_over"]
