"""Tensor-parallel layout propagation through a jaxpr graph (Megatron's column/row split with sequence
parallelism): each value's layout and the collectives between layouts. Rules: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from jax.extend import core as jex

from mistjax.analysis.graph import Graph, Node, names
from mistjax.analysis.layout import (
    REP,
    CollectiveRecord,
    Partial,
    Shard,
    State,
    TPResult,
    generic_dims,
    map_reshape,
    nbytes,
    same_layout,
)
from mistjax.analysis.poly import ONE, PS, Poly, prod
from mistjax.core.jaxpr import Atom, scan_counts

__all__ = ["REP", "CollectiveRecord", "Partial", "Propagator", "Shard", "State", "TPResult", "propagate"]


# Ops a partial sum passes through unresolved: views and copies of it. Arithmetic on a partial
# (even linear, like a scale) resolves it first, as Megatron does right after the matmul: a
# partial fanned out to several consumers would otherwise be reduced once per consumer.
LINEAR_UNARY = names(
    "convert_element_type name reduce_precision copy copy_p reshape transpose broadcast_in_dim "
    "squeeze expand_dims slice pad rev reduce_sum dynamic_slice split cumsum optimization_barrier"
)
PARAM_PRESERVING = names(
    "convert_element_type reshape transpose broadcast_in_dim name reduce_precision copy copy_p "
    "squeeze expand_dims"
)
ELEMENTWISE_LINEAR_ADD = frozenset({"add", "sub", "add_any"})
PARAM_SCALING = names("mul div clamp max min")  # with scalar operands: a weight stays a weight
# A partial scaled by a replicated scalar stays partial: the FP8 GEMMs' unscale (`mistjax.core.fp8`) runs on each
# device's partial product, as the GEMM's epilogue does, and the sum is reduced after it.
SCALAR_SCALE = frozenset({"mul", "div"})


class Propagator:
    """Forward layout propagation over a `Graph` (see the module docstring)."""

    def __init__(
        self,
        graph: Graph,
        in_states: dict[jex.Var, State],
        *,
        sequence_parallel: bool = True,
        param_vars: Sequence[jex.Var] = (),
        model_sizes: Sequence[Poly] = (),
    ):
        self.g = graph
        self.sp = sequence_parallel
        self.res = TPResult(states=dict(in_states), node_states={})
        self.param = set(param_vars)
        self.model_sizes = set(model_sizes)
        self.done: set[tuple[jex.Var, int | State]] = set()  # (value, split dim or layout) converted
        self.summands: dict[jex.Var, int] = {}  # partial value -> how many partial products it sums
        self.index = 0
        for v, st in in_states.items():
            self._divisor(v, st)

    # -- helpers ----------------------------------------------------------------------------------
    def st(self, v: Atom) -> State:
        return REP if isinstance(v, jex.Literal) else self.res.states.get(v, REP)

    def _divisor(self, v: Atom, st: State) -> None:
        if isinstance(st, Shard) and not isinstance(v, jex.Literal):
            self.res.divisors.add(self.g.shape(v)[st.dim])

    def seq_dim(self, v: Atom) -> int | None:
        if isinstance(v, jex.Literal):
            return None
        return next((k for k, x in enumerate(self.g.shape(v)) if x == PS), None)

    def default_target(self, v: Atom) -> State:
        st = self.st(v)
        if isinstance(st, Partial) and st.op == "sum" and st.rs_ok and self.sp:
            d = self.seq_dim(v)
            if d is not None:
                return Shard(d, seq=True)
        return REP

    def record(self, kind: str, v: Atom, where: str, mult: Poly) -> None:
        self.res.collectives.append(
            CollectiveRecord(
                kind=kind,
                nbytes=nbytes(self.g, v),
                shape=self.g.shape(v),
                dtype=str(np.dtype(v.aval.dtype)),
                count=mult,
                where=where,
                summands=self.summands.get(v, 1) if kind != "all-gather" else 1,
            )
        )

    def convert(self, v: Atom, want: State, where: str, mult: Poly) -> State:
        """Make ``v`` available in layout ``want``; record the collective that takes."""
        cur = self.st(v)
        if isinstance(v, jex.Literal) or same_layout(cur, want) or (cur is REP and isinstance(want, Shard)):
            return want
        key = (v, want.dim if isinstance(want, Shard) else want)
        if key in self.done:
            return want
        self.done.add(key)
        if isinstance(cur, Partial):
            kind = "reduce-scatter" if cur.op == "sum" and isinstance(want, Shard) else "all-reduce"
        elif isinstance(cur, Shard):
            kind = "all-gather" if want is REP else "all-to-all"
        else:
            raise AssertionError(f"cannot turn a replicated value into {want}")
        self.record(kind, v, where, mult)
        if mult == ONE:  # a new buffer for liveness (top-level graph only)
            local = prod(self.res.local_dims(self.g, v, want)) * int(np.dtype(v.aval.dtype).itemsize)
            self.res.extra.append((self.index, v, local))
        self._divisor(v, want)
        return want

    # -- driver -----------------------------------------------------------------------------------
    def run(
        self, graph: Graph, mult: Poly = ONE, out_targets: Sequence[State | None] | None = None
    ) -> list[State]:
        """Propagate through ``graph`` (the top level or a loop body); the outputs' final layouts."""
        for i, node in enumerate(graph.nodes):
            if graph is self.g:
                self.index = i
            ins_eff, outs = self.node(node, mult)
            self.res.node_states[node] = (ins_eff, outs)
            from_partials = sum(
                self.summands.get(u, 1)
                for u, st in zip(node.ins, ins_eff)
                if isinstance(st, Partial) and isinstance(u, jex.Var)
            )
            for v, s in zip(node.outs, outs):
                self.res.states[v] = s
                self._divisor(v, s)
                if isinstance(s, Partial):
                    self.summands[v] = from_partials or 1
            if self._keeps_param(node):
                self.param.update(node.outs)
        if graph is self.g:
            self.index = len(graph.nodes)
        finals = []
        for v, want in zip(graph.outvars, out_targets or [None] * len(graph.outvars)):
            if want is not None or isinstance(self.st(v), Partial):
                want = want if want is not None else self.default_target(v)
                finals.append(self.convert(v, want, "output", mult))
            else:
                finals.append(self.st(v))
        if graph is self.g:
            self.res.out_states = finals
        self.res.params = self.param
        return finals

    def _keeps_param(self, n: Node) -> bool:
        """The node's result is still a weight: a view or cast of one, or one scaled and clipped by scalars (the
        FP8 cast of `mistjax.core.fp8`)."""
        weights = [u for u in n.ins if isinstance(u, jex.Var) and u in self.param]
        if not weights:
            return False
        if n.prim in PARAM_PRESERVING:
            return True
        return n.prim in PARAM_SCALING and len(weights) == 1 and all(
            u in weights or isinstance(u, jex.Literal) or self.g.shape(u) == () for u in n.ins)

    def node(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        p = n.prim
        rule = getattr(self, "_" + p.replace("-", "_"), None)
        if rule is not None:
            return rule(n, mult)
        if p in ("scan", "while", "cond"):
            return self._loop(n, mult)
        if len(n.outs) == 1 and all(
            isinstance(v, jex.Literal) or len(self.g.shape(v)) in (0, len(n.outs[0].aval.shape))
            for v in n.ins
        ):
            return self._elementwise(n, mult)
        self.res.notes.append(f"no tensor-parallel rule for {p}: operands gathered, result replicated")
        return [self.convert(v, REP, p, mult) for v in n.ins], [REP] * len(n.outs)

    # -- rules ------------------------------------------------------------------------------------
    def _want_all(self, n: Node, wants: Sequence[State], mult: Poly) -> list[State]:
        return [self.convert(v, w, n.prim, mult) for v, w in zip(n.ins, wants)]

    def _elementwise(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        out_shape = self.g.shape(n.outs[0])
        full = [not isinstance(v, jex.Literal) and len(self.g.shape(v)) == len(out_shape) for v in n.ins]
        sts = [self.st(v) for v in n.ins]
        partials = [s for s, f in zip(sts, full) if f and isinstance(s, Partial)]
        others = [s for s, f in zip(sts, full) if f and not isinstance(s, Partial)]
        if partials and all(s.op == "sum" for s in partials):
            linear = (
                n.prim in LINEAR_UNARY
                and len(partials) == 1
                or n.prim in ELEMENTWISE_LINEAR_ADD
                and not others
                and all(full)
            )
            if linear or self._scaled_by_scalar(n, full):
                return list(sts), [Partial("sum", rs_ok=any(s.rs_ok for s in partials))]
        shards = [s for s in others if isinstance(s, Shard)]
        target: State = next((s for s in shards if not s.seq), shards[0] if shards else REP)
        if target is REP:
            for v, s, f in zip(n.ins, sts, full):
                if f and isinstance(s, Partial) and isinstance(self.default_target(v), Shard):
                    target = self.default_target(v)
                    break
        wants = []
        for v, f in zip(n.ins, full):
            if not f:
                wants.append(REP)
            elif isinstance(target, Shard) and self.g.shape(v)[target.dim] != out_shape[target.dim]:
                wants.append(REP)  # size-1 dim broadcast against the split one
            else:
                wants.append(target)
        return self._want_all(n, wants, mult), [target]

    _select_n = _elementwise

    def _scaled_by_scalar(self, n: Node, full: Sequence[bool]) -> bool:
        """``partial * scalar``, ``scalar * partial`` or ``partial / scalar`` with a replicated scalar."""
        if n.prim not in SCALAR_SCALE or len(n.ins) != 2 or full[0] == full[1] or (n.prim == "div" and full[1]):
            return False
        scalar = n.ins[1] if full[0] else n.ins[0]
        if isinstance(scalar, jex.Literal):
            return np.ndim(scalar.val) == 0
        return self.st(scalar) is REP and self.g.shape(scalar) == ()

    def _unary_map(
        self, n: Node, mult: Poly, f: Callable[[int], int | None]
    ) -> tuple[list[State], list[State]]:
        s = self.st(n.ins[0])
        rest = [REP] * (len(n.ins) - 1)
        if isinstance(s, Partial):
            if n.prim in LINEAR_UNARY:
                return [s, *rest], [s] * len(n.outs)
            s = self.convert(n.ins[0], REP, n.prim, mult)
        if isinstance(s, Shard):
            d = f(s.dim)
            if d is None:
                return [self.convert(n.ins[0], REP, n.prim, mult), *rest], [REP] * len(n.outs)
            return [s, *rest], [Shard(d, s.seq)] * len(n.outs)
        return [REP, *rest], [REP] * len(n.outs)

    def _broadcast_in_dim(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        bd = n.params["broadcast_dimensions"]
        src, dst = self.g.shape(n.ins[0]), self.g.shape(n.outs[0])
        return self._unary_map(n, mult, lambda d: bd[d] if src[d] == dst[bd[d]] else None)

    def _reshape(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        src, dst = generic_dims(self.g.shape(n.ins[0])), generic_dims(self.g.shape(n.outs[0]))
        return self._unary_map(n, mult, lambda d: map_reshape(src, dst, d))

    def _transpose(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        perm = list(n.params["permutation"])
        return self._unary_map(n, mult, lambda d: perm.index(d))

    def _squeeze(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        dims = set(n.params["dimensions"])
        return self._unary_map(n, mult, lambda d: None if d in dims else d - sum(1 for k in dims if k < d))

    def _expand_dims(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        src, dst = generic_dims(self.g.shape(n.ins[0])), generic_dims(self.g.shape(n.outs[0]))
        return self._unary_map(n, mult, lambda d: map_reshape(src, dst, d))

    def _keeps_dim(self, n: Node, d: int) -> bool:
        return self.g.shape(n.ins[0])[d] == self.g.shape(n.outs[0])[d]

    def _slice(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        return self._unary_map(n, mult, lambda d: d if self._keeps_dim(n, d) else None)

    _dynamic_slice = _slice
    _pad = _slice
    _reduce_precision = _slice
    _convert_element_type = _slice
    _name = _slice
    _copy = _slice
    _copy_p = _slice
    _stop_gradient = _slice
    _optimization_barrier = _slice

    def _rev(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        dims = set(n.params["dimensions"])
        return self._unary_map(n, mult, lambda d: None if d in dims else d)

    def _split(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        return self._unary_map(n, mult, lambda d: None if d == n.params["axis"] else d)

    def _cumsum(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        return self._unary_map(n, mult, lambda d: None if d == n.params["axis"] else d)

    _cumprod = _cummax = _cummin = _cumlogsumexp = _cumsum

    def _concatenate(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        k = n.params["dimension"]
        sts = [self.st(v) for v in n.ins]
        if all(isinstance(s, Partial) and s.op == "sum" for s in sts):
            return sts, [Partial("sum", rs_ok=all(s.rs_ok for s in sts))]
        target = next((s for s in sts if isinstance(s, Shard) and s.dim != k), REP)
        return self._want_all(n, [target] * len(n.ins), mult), [target]

    def _reduce(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        axes = set(n.params["axes"])
        s = self.st(n.ins[0])
        op = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}.get(n.prim)
        if isinstance(s, Partial):
            if op == "sum" and s.op == "sum":
                return [s], [s]
            s = self.convert(n.ins[0], REP, n.prim, mult)
        if isinstance(s, Shard):
            if s.dim in axes:
                if op is None:
                    return [self.convert(n.ins[0], REP, n.prim, mult)], [REP]
                return [s], [Partial(op)]
            return [s], [Shard(s.dim - sum(1 for a in axes if a < s.dim), s.seq)]
        return [REP], [REP]

    _reduce_sum = _reduce_max = _reduce_min = _reduce_prod = _reduce_and = _reduce_or = _argmax = _argmin = (
        _reduce
    )

    def _dot_general(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        (lc, rc), (lb, rb) = n.params["dimension_numbers"]
        lhs, rhs = n.ins
        sl, sr = self.st(lhs), self.st(rhs)
        # A partial operand passes through when the other is replicated (the product is linear).
        if isinstance(sl, Partial) and sl.op == "sum" and sr is REP:
            return [sl, REP], [sl]
        if isinstance(sr, Partial) and sr.op == "sum" and sl is REP:
            return [REP, sr], [sr]
        if isinstance(sl, Partial):
            sl = self.convert(lhs, self.default_target(lhs), "dot_general", mult)
        if isinstance(sr, Partial):
            sr = self.convert(rhs, self.default_target(rhs), "dot_general", mult)
        sl, sr = self._replicated_weight(lhs, sl, rhs, sr), self._replicated_weight(rhs, sr, lhs, sl)
        nl, nr = len(self.g.shape(lhs)), len(self.g.shape(rhs))
        lfree = [d for d in range(nl) if d not in lc and d not in lb]
        rfree = [d for d in range(nr) if d not in rc and d not in rb]

        def role(side: int, d: int) -> tuple[str, int]:
            c, b = (lc, lb) if side == 0 else (rc, rb)
            if d in b:
                return "batch", list(b).index(d)
            if d in c:
                return "contract", list(c).index(d)
            return "free", (lfree if side == 0 else rfree).index(d)

        if isinstance(sl, Shard) and isinstance(sr, Shard):
            rl, rr = role(0, sl.dim), role(1, sr.dim)
            if not (rl == rr and rl[0] != "free"):
                # Conflict: gather the sequence-split operand (Megatron), else the smaller one.
                smaller = generic_dims([nbytes(self.g, lhs)])[0] <= generic_dims([nbytes(self.g, rhs)])[0]
                gather_left = (sl.seq and not sr.seq) or (sl.seq == sr.seq and smaller)
                if gather_left:
                    sl = self.convert(lhs, REP, "dot_general", mult)
                else:
                    sr = self.convert(rhs, REP, "dot_general", mult)
        params = (lhs in self.param) or (rhs in self.param)
        for side, s in ((0, sl), (1, sr)):
            if not isinstance(s, Shard):
                continue
            kind, k = role(side, s.dim)
            if kind == "free":  # the split passes to the output's matching free dim
                out_dim = len(lb) + (k if side == 0 else len(lfree) + k)
                return ([s, REP] if side == 0 else [REP, s]), [Shard(out_dim, s.seq)]
            other = (rb[k] if kind == "batch" else rc[k]) if side == 0 else (lb[k] if kind == "batch" else lc[k])
            if kind == "batch":
                ins = [s, Shard(other)] if side == 0 else [Shard(other), s]
                return ins, [Shard(k, s.seq)]
            if kind == "contract":
                ins = [s, Shard(other)] if side == 0 else [Shard(other), s]
                return ins, [Partial("sum", rs_ok=params)]
        return [REP, REP], [REP]

    def _replicated_weight(self, v: Atom, st: State, other: Atom, other_st: State) -> State:
        """The layout a matmul reads the activation ``v`` in when ``other`` is a replicated weight (a key /
        value projection kept whole because t does not divide its heads, `tp_roles.kv_replicated_axes`).

        A sequence-split activation whose gathered copy already exists (the column-parallel query
        projection gathered it) is read whole: the projection then runs whole on every device, as a
        replicated Megatron layer does, and its output enters attention replicated. Left sequence-split,
        the output would have to be gathered inside the attention kernel's key-block loop.
        """
        if (isinstance(st, Shard) and st.seq and other_st is REP and isinstance(other, jex.Var)
                and other in self.param and isinstance(v, jex.Var) and (v, REP) in self.done):
            return REP
        return st

    def _gather(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        dn = n.params["dimension_numbers"]
        op, idx = n.ins[0], n.ins[1]
        self.convert(idx, REP, "gather", mult)
        s = self.st(op)
        if isinstance(s, Partial) and s.op == "sum":
            return [s, REP], [s]
        if isinstance(s, Partial):
            s = self.convert(op, REP, "gather", mult)
        if isinstance(s, Shard):
            if s.dim in dn.start_index_map and s.dim in dn.collapsed_slice_dims:
                # Megatron's vocab-parallel lookup: each device serves its rows, zeros elsewhere.
                return [s, REP], [Partial("sum", rs_ok=op in self.param)]
            kept = [
                d
                for d in range(len(self.g.shape(op)))
                if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims
            ]
            if s.dim in kept and n.params["slice_sizes"][s.dim] == op.aval.shape[s.dim]:
                return [s, REP], [Shard(dn.offset_dims[kept.index(s.dim)], s.seq)]
            return [self.convert(op, REP, "gather", mult), REP], [REP]
        return [REP, REP], [REP]

    def _scatter_add(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        dn = n.params["dimension_numbers"]
        op = n.ins[0]
        s = self.st(op)
        if s is REP:
            # A zero-filled operand may be created split: pick an indexed dim of a split size
            # (the transpose of a vocab-parallel lookup scatters into the device's own rows).
            for d in dn.scatter_dims_to_operand_dims:
                if self.g.shape(op)[d] in self.model_sizes:
                    s = Shard(d)
                    break
        if isinstance(s, Partial):
            s = self.convert(op, REP, n.prim, mult)
        if isinstance(s, Shard) and s.dim not in dn.scatter_dims_to_operand_dims:
            s = self.convert(op, REP, n.prim, mult)
        eff = [s] + [self.convert(v, REP, n.prim, mult) for v in n.ins[1:]]
        return eff, [s]

    _scatter = _scatter_add

    def _dot_product_attention_fwd_wrapper(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        """cuDNN attention: heads split over ``tensor`` stay local (q, k, v, o, dO on their heads dim, the
        log-sum-exp ``[b, heads, s]`` on dim 1); without a head split everything is gathered."""
        heads = 1 if int(n.params.get("layout", 0)) == 1 else 2

        def want(v: Atom, split: bool) -> State:
            rank = 0 if isinstance(v, jex.Literal) else len(self.g.shape(v))
            if not split or rank not in (3, 4):
                return REP
            return Shard(heads if rank == 4 else 1)

        q = self.st(n.ins[0])
        split = isinstance(q, Shard) and q.dim == heads and not q.seq
        ins = self._want_all(n, [want(v, split) for v in n.ins], mult)
        return ins, [want(v, split) for v in n.outs]

    _dot_product_attention_bwd_wrapper = _dot_product_attention_fwd_wrapper
    _dot_product_attention_fwd = _dot_product_attention_bwd = _dot_product_attention_fwd_wrapper

    def _iota(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        return [REP] * len(n.ins), [REP] * len(n.outs)

    def _loop(self, n: Node, mult: Poly) -> tuple[list[State], list[State]]:
        if n.prim == "cond":
            ins = [self.convert(v, REP, "cond", mult) if k == 0 else self.st(v) for k, v in enumerate(n.ins)]
            outs = None
            for g in n.subs:  # every branch ends in the first branch's layouts
                for v, s in zip(g.invars, ins[1:]):
                    self.res.states[v] = s
                finals = self.run(g, mult, out_targets=outs)
                outs = outs if outs is not None else finals
            return ins, list(outs or [])
        body = n.subs[0]
        if n.prim == "while":
            nc = n.params["body_nconsts"]
            ins = [
                self.convert(v, REP, "while", mult) if k < n.params["cond_nconsts"] else self.st(v)
                for k, v in enumerate(n.ins)
            ]
            body_in = ins[n.params["cond_nconsts"] :]
            ncar = len(body.outvars)
            for v, s in zip(body.invars, body_in):
                self.res.states[v] = s
            self.run(body, mult * n.length, out_targets=body_in[nc : nc + ncar])
            return ins, body_in[nc:]
        nc, ncar = scan_counts(n.params)
        ins: list[State] = []
        for k, v in enumerate(n.ins):
            s = self.st(v)
            if isinstance(s, Partial) or (k >= nc + ncar and isinstance(s, Shard) and s.dim == 0):
                s = self.convert(v, REP, "scan", mult)
            ins.append(s)
        body_in = ins[: nc + ncar] + [
            Shard(s.dim - 1, s.seq) if isinstance(s, Shard) else s for s in ins[nc + ncar :]
        ]
        ins[nc : nc + ncar] = body_in[nc : nc + ncar] = self._carry_layouts(n, body_in, mult)
        for v, s in zip(body.invars, body_in):
            self.res.states[v] = s
        targets: list[State | None] = list(ins[nc : nc + ncar]) + [None] * (len(body.outvars) - ncar)
        ys = self.run(body, mult * n.length, out_targets=targets)[ncar:]
        ys_out = [Shard(s.dim + 1, s.seq) if isinstance(s, Shard) else REP for s in ys]
        return ins, ins[nc : nc + ncar] + ys_out

    def _carry_layouts(self, n: Node, body_in: list[State], mult: Poly) -> list[State]:
        """Layouts of a scan's carries: a replicated initial carry that the body turns into a split one
        (an accumulator started from zeros and updated with per-head values) starts split, which is a
        local slice of the replicated value; otherwise every trip would end in an all-gather.

        Found by trial propagations of the body (nothing recorded) until the carry layouts are stable.
        """
        nc, ncar = scan_counts(n.params)
        body = n.subs[0]
        carry = list(body_in[nc : nc + ncar])
        for _ in range(ncar + 1):
            trial = Propagator(self.g, dict(self.res.states), sequence_parallel=self.sp,
                               param_vars=list(self.param), model_sizes=list(self.model_sizes))
            trial.summands = dict(self.summands)
            trial.res.states.update(zip(body.invars, body_in[:nc] + carry + body_in[nc + ncar :]))
            finals = trial.run(body, mult * n.length)[:ncar]
            new = [f if c is REP and isinstance(f, Shard) else c for c, f in zip(carry, finals)]
            if new == carry:
                break
            carry = new
        return carry


def propagate(
    graph: Graph,
    in_states: dict[jex.Var, State],
    out_targets: Sequence[State | None],
    *,
    sequence_parallel: bool = True,
    param_vars: Sequence[jex.Var] = (),
    model_sizes: Sequence[Poly] = (),
    gathered: Sequence[jex.Var] = (),
) -> TPResult:
    """Propagate layouts through ``graph`` and resolve its outputs to ``out_targets``.

    Args:
      graph: the flattened computation.
      in_states: layout of each input var (missing: replicated).
      out_targets: per output, the layout it must end in (None: leave it, resolving partials).
      sequence_parallel: resolve row-parallel partial sums by reduce-scatter over the sequence.
      param_vars: inputs that are (casts of) weights; contracting their split dims gives
        reduce-scatterable partial sums.
      model_sizes: sizes of the split weight dims (heads, mlp, vocab); zero-filled scatter
        targets with such a dim are created split.
      gathered: split inputs all-gathered once on entry, whole for every consumer (the cotangent of
        the hidden state entering the layers: Megatron's transpose of the scatter to the sequence split).
    """
    prop = Propagator(
        graph, in_states, sequence_parallel=sequence_parallel, param_vars=param_vars, model_sizes=model_sizes
    )
    for v in gathered:
        prop.res.states[v] = prop.convert(v, REP, "enter", ONE)
    prop.run(graph, ONE, out_targets=out_targets)
    return prop.res
