"""Residual bytes and liveness peaks of analysed graphs, with view/broadcast aliasing (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
from jax.extend import core as jex

from mistjax.analysis.fused import per_block
from mistjax.analysis.graph import Graph, Node, constant_nodes, names
from mistjax.analysis.poly import ZERO, Poly, prune_dominated
from mistjax.core.jaxpr import Atom, is_var, scan_counts

ALIAS = names(
    "name reduce_precision reshape squeeze expand_dims copy copy_p optimization_barrier stop_gradient"
)
FUSED = frozenset({"broadcast_in_dim", "iota"})
# Loop fusion: an elementwise result whose only consumer is elementwise or a reduction is computed inside
# that consumer's kernel (XLA's producer-consumer fusion, on CPU and GPU alike): it has no buffer.
ELEMENTWISE = names(
    "add sub mul div neg exp exp2 log log1p expm1 tanh logistic erf erf_inv rsqrt sqrt cbrt abs sign pow "
    "integer_pow max min select_n convert_element_type eq ne lt le gt ge and or not square clamp"
)
FUSING_CONSUMERS = ELEMENTWISE | names("reduce_sum reduce_max reduce_min argmax argmin")

SizeFn = Callable[[jex.Var], Poly]  # bytes of a var (per device)


def alias_roots(graph: Graph) -> dict[jex.Var, jex.Var | None]:
    """var -> the var whose buffer it shares (itself when it owns one; None when it has none)."""
    root: dict[jex.Var, jex.Var | None] = {}
    outs = {v for v in graph.outvars if is_var(v)}
    const = constant_nodes(graph)
    consumers: dict[jex.Var, list[Node]] = {}
    for n in graph.nodes:
        for v in n.ins:
            if is_var(v):
                consumers.setdefault(v, []).append(n)
    for n in graph.nodes:
        if n in const:  # folded or fused by XLA
            root.update((v, None) for v in n.outs)
            continue
        src = n.ins[0] if n.ins and is_var(n.ins[0]) else None
        same_dtype_convert = (
            n.prim == "convert_element_type" and src is not None and src.aval.dtype == n.outs[0].aval.dtype
        )
        for v in n.outs:
            if src is not None and (n.prim in ALIAS or same_dtype_convert) and len(n.outs) == 1:
                root[v] = root.get(src, src)
            elif n.prim in FUSED and v not in outs:
                root[v] = None  # fused into its consumers: no buffer of its own
            elif n.prim in ELEMENTWISE and v not in outs and _fuses_into_consumer(consumers.get(v, [])):
                root[v] = None
            else:
                root[v] = v
    return root


def _fuses_into_consumer(users: list[Node]) -> bool:
    return len(users) == 1 and users[0].prim in FUSING_CONSUMERS and not users[0].subs


def nbytes_fn(graph: Graph, local_dims: Callable[[jex.Var], tuple[Poly, ...]] | None = None) -> SizeFn:
    """Bytes of a var (per device when ``local_dims`` gives per-device dims)."""
    dims = local_dims or graph.shape

    def size(v: jex.Var) -> Poly:
        n = Poly.const(1)
        for d in dims(v):
            n = n * d
        return n * int(np.dtype(v.aval.dtype).itemsize)

    return size


def peak_candidates(
    graph: Graph,
    size: SizeFn,
    *,
    exclude: Iterable[Atom] = (),
    extra: Sequence[tuple[int, jex.Var, Poly]] = (),
    large_blocks: bool = False,
) -> list[Poly]:
    """Live bytes at each program point of ``graph`` (pruned to the non-dominated ones).

    Args:
      graph: the flattened computation.
      size: bytes of a var.
      exclude: vars (or alias roots) never counted (e.g. weight gradients).
      extra: ``(node index, var, bytes)`` buffers created right before a node (collective
        copies: a gathered input, a reduce-scattered partial sum) living until the var's last
        use.
      large_blocks: price the bodies of blockwise fused-attention loops for ``s`` above their
        block size (`fused.per_block`) instead of as traced (one block of ``s`` keys).
    """
    root = alias_roots(graph)
    excluded = {root.get(v, v) for v in exclude if is_var(v)}
    last: dict[jex.Var, int] = {}
    for i, n in enumerate(graph.nodes):
        for v in n.ins:
            if is_var(v):
                r = root.get(v, v)
                if r is not None:
                    last[r] = i
        for v in n.outs:  # an unused result dies where it is born
            r = root.get(v, v)
            if r is not None:
                last.setdefault(r, i)
    end = len(graph.nodes)
    for v in graph.outvars:
        if is_var(v) and root.get(v, v) is not None:
            last[root.get(v, v)] = end
    inputs = set(graph.invars) | set(graph.constvars)
    extra_at: dict[int, list[tuple[jex.Var, Poly]]] = {}
    for i, v, b in extra:
        extra_at.setdefault(i, []).append((v, b))
    frees: dict[int, list[Poly]] = {}
    live = ZERO
    cands: list[Poly] = [ZERO]
    for i, n in enumerate(graph.nodes):
        for v, b in extra_at.get(i, ()):
            live = live + b
            frees.setdefault(max(last.get(root.get(v, v), i), i), []).append(b)
        for v in n.outs:
            if not (is_var(v) or isinstance(v, jex.DropVar)) or v in inputs:
                continue
            r = root.get(v, v)
            if r is not v or r in excluded:
                continue
            b = size(v)
            live = live + b
            frees.setdefault(last.get(r, i), []).append(b)
        inner: list[Poly] = [ZERO]
        for g in n.subs:
            state = loop_state(n, g)
            if large_blocks and n.unit_block:  # a blockwise attention loop: its body above s = block
                inner.extend(per_block(c, n.unit_block) for c in peak_candidates(g, size, exclude=state))
            else:
                inner.extend(peak_candidates(g, size, exclude=state, large_blocks=large_blocks))
        cands.extend(live + c for c in prune_dominated(inner))
        for b in frees.pop(i, ()):
            live = live - b
    for _v, b in extra_at.get(end, ()):
        cands.append(live + b)
    return prune_dominated(cands)


def loop_state(node: Node, body: Graph) -> list[Atom]:
    """The results of ``body`` that are ``node``'s own output buffers: a loop body's new carry (XLA gives
    a while loop one buffer per state element, shared by its init, the body's parameter and root, and the
    loop's result) and a conditional branch's results. The outer graph counts them as ``node``'s outputs,
    so inside they own no second buffer; a scan's per-iteration ``ys`` are written into the stacked result
    and are left counted."""
    if node.prim == "scan":
        return list(body.outvars[: scan_counts(node.params)[1]])
    if node.prim == "while":
        return list(body.outvars) if body is node.subs[0] else []
    if node.prim == "cond":
        return list(body.outvars)
    return []


def residual_roots(graph: Graph, residuals: Sequence[Atom]) -> list[jex.Var]:
    """The distinct buffers behind ``residuals`` (aliases of one buffer count once)."""
    root = alias_roots(graph)
    seen: dict[jex.Var, None] = {}
    for v in residuals:
        if is_var(v):
            r = root.get(v, v)
            seen.setdefault(v if r is None else r, None)
    return list(seen)
