"""Megatron tensor parallelism for the layer block: run it under the analysis's propagated layouts, with
custom VJPs for the conversions, so the compiled program does Megatron's collectives (docs/internals.md).
Where the platform overlaps collectives with compute, the sequence all-gathers feeding matmuls and the
reduce-scatters of matmul outputs run as collective matmuls (`mistjax.runtime.collective_matmul`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import jax
import numpy as np
from jax.extend import core as jex
from jax.sharding import PartitionSpec as P

from mistjax.core.context import ContextForm
from mistjax.core.execution import collective_matmul_runs
from mistjax.core.jaxpr import Atom, Params, Value, read
from mistjax.core.layout import CONTEXT_AXIS, LeafLayout
from mistjax.core.types import LossFn
from mistjax.runtime.collective_matmul import (
    GatherRing,
    RingPlan,
    ScatterRing,
    allgather_matmul,
    matmul_reduce_scatter,
    plan_rings,
)
from mistjax.runtime.context_block import AttentionCall, attention_call, check_form, run_attention, warn_gathered
from mistjax.trace.split import BlockFn, LayerStack, TracedLoss, bind_equation

# `mistjax.analysis` is imported where a tensor-parallel block is built or run, not at import: its package
# loads the symbolic analysis (sympy), which `import mistjax` must not pay for (issue #30).
if TYPE_CHECKING:
    from mistjax.analysis.graph import CallSite, Graph, Node
    from mistjax.analysis.layout import State, TPResult

TENSOR_AXIS = "tensor"


class TensorParallelBlock:
    """One layer evaluated under propagated tensor-parallel layouts (a `BlockFn`).

    Under context parallelism (``context`` set) every value's sequence dim stays split over that mesh axis
    too (a sequence-parallel split over ``(context, tensor)``, a gather over ``tensor`` only), and the
    model's blockwise fused-attention calls run as the ring kernel (`runtime.context_block`).

    Attributes:
      graph: the layer's flattened body with symbolic dims (traced at the runtime's size).
      result: its propagated layouts and the collectives they imply.
      stack: the layer stack it replaces the body of.
      context: the context-parallel mesh axis, or None.
      overlap: the plan's ``tp_overlap``: the layer's collectives run as collective matmuls where they can.
    """

    def __init__(self, graph: Graph, result: TPResult, stack: LayerStack, axis: str = TENSOR_AXIS,
                 context: str | None = None, form: ContextForm = ContextForm.RING, overlap: bool = False):
        self.graph, self.result, self.stack, self.axis, self.context = graph, result, stack, axis, context
        self.overlap = overlap
        self.form = form
        self._rings: RingPlan | None = None
        # The fused-attention calls the ring kernel replaces (their sites: each node of a call points to it).
        sites = dict.fromkeys(n.call for n in graph.nodes if n.call is not None and not n.call.checkpoint)
        self._attention = {} if context is None else {
            site: call for site in sites if (call := attention_call(site.eqn)) is not None}

    def rings(self) -> RingPlan:
        """Where this layer runs collective matmuls when they are on (`mistjax.runtime.collective_matmul`)."""
        if self._rings is None:
            self._rings = plan_rings(self.graph, self.result, self.axis)
        return self._rings

    def _active_rings(self) -> RingPlan:
        """`rings` where the plan asks for them (``overlap``) and they apply (`collective_matmul_runs`), else
        none."""
        mesh = jax.sharding.get_abstract_mesh()
        cp = mesh.shape.get(self.context, 1) if self.context is not None else 1
        if self.axis not in mesh.axis_names or not collective_matmul_runs(self.overlap, cp):
            return RingPlan()
        return self.rings()

    def __call__(self, consts: Sequence[Value], carry: Sequence[Value], xs: Sequence[Value]
                 ) -> tuple[list[Value], list[Value]]:
        outs = self.evaluate([*consts, *carry, *xs])
        n = self.stack.num_carry
        return outs[:n], outs[n:]

    @property
    def attention_calls(self) -> list[AttentionCall]:
        """The fused-attention calls that run as the context-parallel kernel (none without context parallelism)."""
        return list(self._attention.values())

    def seq_dim(self, v: Atom) -> int | None:
        """The sequence dim of the graph value ``v`` under context parallelism (the dim of size ``s``), else None."""
        from mistjax.analysis.poly import PS

        if self.context is None or not isinstance(v, jex.Var):
            return None
        return next((d for d, n in enumerate(self.graph.shape(v)) if n == PS), None)

    def constrain(self, x: Value, state: State, coll: _Collectives | None = None, v: Atom | None = None) -> Value:
        """``x`` (the graph value ``v``) constrained to ``state`` (a partial sum is left to GSPMD); through
        ``coll`` for a sequence-split float value, so that its cotangent's gathers can be shared."""
        from mistjax.analysis.layout import Shard, partition_spec

        spec = partition_spec(state, np.ndim(x), self.axis, None if v is None else self.seq_dim(v), self.context)
        if spec is None or not hasattr(x, "shape"):
            return x
        if coll is not None and isinstance(state, Shard) and state.seq and _is_float(x):
            return coll.pin(_traced(x), spec)
        return jax.lax.with_sharding_constraint(x, spec)

    def evaluate(self, args: Sequence[Value]) -> list[Value]:
        """The layer's outputs from its inputs ``[*consts, *carry, *x_slices]``."""
        from mistjax.analysis.layout import Partial, Shard

        g, res = self.graph, self.result
        env: dict[jex.Var, Value] = dict(g.consts)
        env.update(zip(g.invars, args))
        coll = _Collectives(self.axis, self.context)
        rings = self._active_rings()
        nodes, i = g.nodes, 0
        while i < len(nodes):
            site = nodes[i].call
            j = i + 1
            while site is not None and j < len(nodes) and nodes[j].call is site:
                j += 1
            if site is None:
                if nodes[i] in rings.at:
                    self._run_ring(rings.at[nodes[i]], env, coll)
                elif nodes[i] not in rings.skip:  # else a ring evaluated it
                    self._run_node(nodes[i], env, coll)
            elif site.checkpoint:
                self._run_checkpointed(nodes[i:j], site.eqn.params, env, coll, nodes[j:], g.outvars)
            else:
                self._run_custom_vjp(site, env, coll)
            i = j
        # The outputs in their final layouts (a partial sum resolved, the carry sequence-split).
        outs = []
        for v, st in zip(g.outvars, res.out_states):
            o = read(env, v)
            if isinstance(v, jex.Var) and isinstance(coll.state(v, res), Partial) and isinstance(st, Shard) \
                    and _is_float(o):
                o = coll.reduce_scatter(_traced(o), st.dim, self.seq_dim(v))
            outs.append(self.constrain(o, st, coll, v) if isinstance(v, jex.Var) else o)
        return outs

    def _run_node(self, n: Node, env: dict[jex.Var, Value], coll: _Collectives) -> None:
        """Evaluate one node under its propagated layouts, writing its results into ``env``."""
        from mistjax.analysis.layout import REP, Partial, Shard, same_layout

        res = self.result
        vals = [read(env, v) for v in n.ins]
        eff = res.node_states.get(n, ([REP] * len(n.ins), []))[0]
        gather: dict[int, tuple[int, int | None]] = {}  # input index -> (split dim gathered from, sequence dim)
        for k, (v, want) in enumerate(zip(n.ins, eff)):
            if not isinstance(v, jex.Var) or isinstance(want, Partial) or not hasattr(vals[k], "shape"):
                continue
            cur = coll.state(v, res)
            if same_layout(cur, want):
                continue
            if isinstance(cur, Shard) and want is REP and _is_float(vals[k]):
                gather[k] = (cur.dim, self.seq_dim(v))
            elif isinstance(cur, Partial) and isinstance(want, Shard) and _is_float(vals[k]):
                vals[k] = coll.reduce_scatter(_traced(vals[k]), want.dim, self.seq_dim(v))
            else:
                # A partial sum all-reduced, a local slice of a replicated value, or a re-split
                # (all-to-all): the constraint says so, and its transpose is the mirror.
                vals[k] = self.constrain(vals[k], want, v=v)
        out = coll.gatheredbind_equation(n.eqn, vals, gather) if gather else bind_equation(n.eqn, vals)
        for v, o in zip(n.outs, out):
            env[v] = self.constrain(o, coll.state(v, res), coll, v)

    def _run_ring(self, ring: GatherRing | ScatterRing, env: dict[jex.Var, Value], coll: _Collectives) -> None:
        """Evaluate a collective matmul (`mistjax.runtime.collective_matmul`) in place of its nodes and the
        all-gather / reduce-scatter the plain path would put beside them."""
        from mistjax.analysis.layout import Shard

        t = jax.sharding.get_abstract_mesh().shape[self.axis]
        if isinstance(ring, ScatterRing):
            n, dot = ring.node, ring.dot
            vals = [read(env, v) for v in n.ins]
            y = matmul_reduce_scatter([_traced(vals[dot.pos])], [_traced(vals[1 - dot.pos])], [dot], axis=self.axis,
                                      t=t)
            for v in ring.held:  # the partial sum (and its remat names) exist only reduce-scattered
                coll.held[v] = Shard(ring.dim, seq=True)
            env[n.outs[0]] = self.constrain(y, coll.held[n.outs[0]], coll)
            return
        for p in ring.pulled:
            self._run_node(p, env, coll)
        others = []
        for n, dot in zip(ring.nodes, ring.dots):
            w, want = n.ins[1 - dot.pos], self.result.node_states[n][0][1 - dot.pos]
            others.append(_traced(self.constrain(read(env, w), want)))  # the weight's layout (usually already so)
        outs = allgather_matmul(_traced(read(env, ring.act)), others, ring.dots, axis=self.axis, t=t)
        for n, o in zip(ring.nodes, outs):
            env[n.outs[0]] = self.constrain(o, coll.state(n.outs[0], self.result), coll)

    def _run_checkpointed(self, run: Sequence[Node], params: Params, env: dict[jex.Var, Value],
                          coll: _Collectives, later: Sequence[Node], outvars: Sequence[Atom]) -> None:
        """Evaluate the nodes inlined from one ``jax.checkpoint`` equation (its ``params``) under a
        checkpoint of its policy again: the graph is flat, and evaluated node by node autodiff would keep
        every intermediate of the model's recomputed norms and activations (`models.layers.recomputed`)."""
        defined = {v for n in run for v in n.outs}
        ins = list(dict.fromkeys(v for n in run for v in n.ins
                                 if isinstance(v, jex.Var) and v not in defined and v in env))
        used = {v for v in [*outvars, *(v for n in later for v in n.ins)] if isinstance(v, jex.Var)}
        outs = [v for n in run for v in n.outs if v in used]

        def region(*vals: Value) -> list[Value]:
            local = dict(env)
            local.update(zip(ins, vals))
            for n in run:
                self._run_node(n, local, coll)
            return [local[v] for v in outs]

        fn = jax.checkpoint(region, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy"))
        env.update(zip(outs, fn(*[env[v] for v in ins])))

    def _run_custom_vjp(self, site: CallSite, env: dict[jex.Var, Value], coll: _Collectives) -> None:
        """Bind an inlined ``custom_vjp`` call (the attention kernel, 16-bit probabilities) again on its
        inputs, so its own residuals and backward run. Its inside is per head (no tensor-parallel
        collective): GSPMD carries the inputs' head split through it. Under context parallelism a
        blockwise fused-attention call runs as the ring kernel instead."""
        from mistjax.analysis.layout import REP

        vals = [read(env, v) for v in site.ins]
        call = self._attention.get(site)
        if call is None:
            out = bind_equation(site.eqn, vals)
        else:
            assert self.context is not None  # (attention calls are collected under context parallelism only)
            out = run_attention(call, self.form, vals, self.context)
        for v, o in zip(site.outs, out):
            if isinstance(v, jex.Var) and v not in site.ins:
                env[v] = self.constrain(o, self.result.states.get(v, REP), coll, v)


def _is_float(x: Value) -> bool:
    return jax.dtypes.issubdtype(_traced(x).dtype, np.inexact)


def _traced(x: Value) -> jax.Array:
    """A value of the traced layer as the array (tracer) it is where a collective or a ring reads it."""
    return cast(jax.Array, x)


def _split(x: jax.Array, dim: int, axis: str, seq: int | None = None, context: str | None = None) -> jax.Array:
    """``x`` split along ``dim`` over ``axis`` (and its sequence dim ``seq`` over ``context``)."""
    from mistjax.analysis.layout import Shard, partition_spec

    return jax.lax.with_sharding_constraint(x, partition_spec(Shard(dim), x.ndim, axis, seq, context))


def _all_gather(x: jax.Array, seq: int | None = None, context: str | None = None) -> jax.Array:
    """``x`` whole over ``tensor`` (its sequence dim ``seq`` still split over ``context``)."""
    from mistjax.analysis.layout import REP, partition_spec

    return jax.lax.with_sharding_constraint(x, partition_spec(REP, x.ndim, seq=seq, context=context))


class _Collectives:
    """The conversions of one layer evaluation, with Megatron's transposes (custom VJPs).

    Backward passes gather the same value for several consumers: the split layer input again for
    each column-parallel matmul's weight gradient, the sequence-split output cotangent for each
    transposed row-parallel matmul (in a parallel block both branches share it). XLA does not
    always merge the identical all-gathers GSPMD emits for each, so the gathers are shared here:
    one copy per traced value, where the transposes of the sequence-split constraints (`pin`)
    record which cotangents are the same value (a constraint is the identity). Keyed by object
    identity; an entry keeps its value alive, so an identity is never reused while cached. Lives
    as long as the traced layer.
    """

    def __init__(self, axis: str, context: str | None = None):
        self.axis, self.context = axis, context
        # Values held in another layout than the analysis records: partial sums a collective matmul
        # reduce-scattered where they were made.
        self.held: dict[jex.Var, State] = {}
        self._gathered: dict[int, tuple[jax.Array, jax.Array]] = {}
        self._roots: dict[int, tuple[jax.Array, jax.Array]] = {}  # id(constrained cotangent) -> (it, its source)

    def state(self, v: jex.Var, result: TPResult) -> State:
        """The layout ``v`` is held in (the analysis's unless `held` says otherwise)."""
        return self.held[v] if v in self.held else result.states.get(v)

    def _root(self, x: jax.Array) -> jax.Array:
        while (hit := self._roots.get(id(x))) is not None and hit[0] is x:
            x = hit[1]
        return x

    def all_gather(self, x: jax.Array, seq: int | None = None) -> jax.Array:
        """``x`` gathered over ``tensor`` (its sequence dim ``seq`` kept split over ``context``), once per value."""
        root = self._root(x)
        hit = self._gathered.get(id(root))
        if hit is None or hit[0] is not root:
            hit = (root, _all_gather(x, seq, self.context))
            self._gathered[id(root)] = hit
        return hit[1]

    def pin(self, x: jax.Array, spec: P) -> jax.Array:
        """``x`` constrained to ``spec``; the transpose constrains the cotangent alike and records it
        as the same value as the incoming one."""

        @jax.custom_vjp
        def run(v: jax.Array) -> jax.Array:
            return jax.lax.with_sharding_constraint(v, spec)

        def fwd(v: jax.Array) -> tuple[jax.Array, None]:
            return run(v), None

        def bwd(_: None, ct: jax.Array) -> tuple[jax.Array]:
            out = jax.lax.with_sharding_constraint(ct, spec)
            self._roots[id(out)] = (out, ct)
            return (out,)

        run.defvjp(fwd, bwd)
        return run(x)

    def reduce_scatter(self, x: jax.Array, dim: int, seq: int | None = None) -> jax.Array:
        """A partial sum reduce-scattered onto ``dim`` (a row-parallel output; ``seq`` its sequence dim);
        its transpose is the explicit (shared) all-gather of the cotangent."""

        @jax.custom_vjp
        def run(v: jax.Array) -> jax.Array:
            return _split(v, dim, self.axis, seq, self.context)

        def fwd(v: jax.Array) -> tuple[jax.Array, None]:
            return run(v), None

        def bwd(_: None, ct: jax.Array) -> tuple[jax.Array]:
            return (self.all_gather(ct, seq),)

        run.defvjp(fwd, bwd)
        return run(x)

    def gatheredbind_equation(self, eqn: jex.JaxprEqn, vals: Sequence[Value],
                              gather: dict[int, tuple[int, int | None]]) -> list[Value]:
        """``eqn`` applied to ``vals`` after all-gathering the inputs in ``gather`` (index -> the split dim
        and the sequence dim), Megatron-style.

        The custom VJP keeps the split inputs (not the gathered copies: 1/t of the bytes) for the
        backward, which all-gathers them again for the weight gradient and reduce-scatters the
        gathered inputs' gradients back onto their split dims. With plain constraints autodiff would
        keep the gathered copy and all-reduce the gradient (the transpose of a replicated constraint).
        """
        diff = [k for k, x in enumerate(vals) if hasattr(x, "shape") and _is_float(x)]

        def apply(gathered: Callable[[jax.Array, int | None], jax.Array], *d: jax.Array) -> list[Value]:
            full = list(vals)
            for k, x in zip(diff, d):
                full[k] = gathered(x, gather[k][1]) if k in gather else x
            return bind_equation(eqn, full)

        def gather_once(x: jax.Array, seq: int | None) -> jax.Array:
            return _all_gather(x, seq, self.context)

        @jax.custom_vjp
        def run(*d: jax.Array) -> list[Value]:
            return apply(gather_once, *d)

        def fwd(*d: jax.Array) -> tuple[list[Value], tuple[jax.Array, ...]]:
            return apply(gather_once, *d), d

        def bwd(d: tuple[jax.Array, ...], ct: list[jax.Array]) -> tuple[jax.Array, ...]:
            full = [self.all_gather(x, gather[k][1]) if k in gather else x for k, x in zip(diff, d)]
            _, vjp = jax.vjp(lambda *f: apply(lambda y, _: y, *f), *full)
            cts = vjp(ct)
            return tuple(_split(c, gather[k][0], self.axis, gather[k][1], self.context) if k in gather else c
                         for k, c in zip(diff, cts))

        run.defvjp(fwd, bwd)
        return run(*[vals[k] for k in diff])


# ------------------------------------------------------------------------------------ construction

def tensor_parallel_block(fun: LossFn, traced: TracedLoss, *, layouts: Sequence[LeafLayout], tp: int,
                          batch: Sequence[bool] | None = None, cp: int = 1,
                          form: ContextForm = ContextForm.RING, overlap: bool = False) -> BlockFn | None:
    """A `BlockFn` running ``traced``'s layer under Megatron TP + SP layouts, or None for ``tp == 1``.

    Args:
      fun: the loss ``traced`` was traced from (it is traced again at other sizes).
      traced: the loss traced at the runtime's micro-batch (``mistjax.trace.split.trace_loss``).
      layouts: the runtime's `LeafLayout` of each parameter leaf (their ``tensor_dims``).
      tp: tensor-parallel degree; 1 returns None (today's plain evaluation).
      batch: per rest leaf of ``traced``, whether it is batch data (see `block_graph`).
      cp: context-parallel degree: above 1 the sequence stays split over ``context`` inside the layer and
        the fused attention runs as the context-parallel kernel of ``form`` (`TensorParallelBlock`).
      overlap: run the collectives as collective matmuls (the plan's ``tp_overlap``).
    Returns:
      None also when the model has no layer stack, its sequence does not split ``tp * cp`` ways, or its
      layer cannot be analysed (with a warning): the runtime then leaves the layer to GSPMD, as
      without this block.
    """
    if tp <= 1 or traced.stack is None:
        return None
    from mistjax.analysis.block import block_graph, block_layouts, hidden_sizes

    stack = traced.stack
    sizes = hidden_sizes(stack)
    if sizes is None or sizes[1] % (tp * cp):
        return None
    try:
        graph = block_graph(fun, traced, batch)
        # Per scanned operand, the split dims of its stacked leaf (an unrolled stack's real leaves have no
        # layer dim: shift theirs by one).
        shift = 0 if traced.groups is None else 1
        dims = [None if i is None else tuple(d + shift for d in layouts[traced.real_index(i)].tensor_dims)
                for i in stack.xs_leaf]
        result = block_layouts(graph, stack, dims)
    except Exception as e:  # noqa: BLE001 -- retracing user code at other sizes: any failure falls back
        # Megatron's schedule is an optimisation: a model that only traces at its own sizes (say a
        # batch-size-dependent constant the runtime cannot resize) still trains under GSPMD.
        warnings.warn(f"tensor parallelism falls back to GSPMD's collectives: the layer could not be "
                      f"analysed ({type(e).__name__}: {e})", stacklevel=2)
        return None
    b, s = sizes
    for d in result.divisors:
        if d.exact(b, s) % tp:
            return None
    block = TensorParallelBlock(graph, result, stack, context=CONTEXT_AXIS if cp > 1 else None, form=form,
                                overlap=overlap)
    check_form(block.attention_calls, form, cp, tp)
    if cp > 1 and not block.attention_calls:
        warn_gathered("the layer's attention is not the blockwise fused-attention kernel (models.attention), "
                      "so it is not run as the ring kernel")
    # The layer loops hand a block arrays, never `LayerSlices` (an unrolled stack's are indexed per layer first).
    return cast(BlockFn, block)


def per_tensor_shard(fn: Callable[[jax.Array], jax.Array], tensor_dims: Sequence[int],
                     axis: str = TENSOR_AXIS) -> Callable[[jax.Array], jax.Array]:
    """``fn`` applied to each device's ``tensor`` shard of its argument (dims ``tensor_dims`` split).

    For the ZeRO / MiCS collectives over the partition group (`runtime.grads.shard_all_gather`,
    `shard_psum_scatter`): inside the shard_map that is manual over the data-parallel axes only, a
    manual collective on an operand GSPMD holds split over ``tensor`` is preceded by an all-gather
    over ``tensor`` (the operand is made whole; for a reduce-scatter the result is then sliced
    again), which doubles the ZeRO traffic at t = 2 and gathers ZeRO-3 weights whole. A nested
    shard_map, manual over ``tensor`` too, runs the collective on the local shard. ``fn`` must keep
    the split dims where they are (ZeRO never splits a tensor-split dim).
    """
    if not tensor_dims:
        return fn
    dims = set(tensor_dims)

    def run(x: jax.Array) -> jax.Array:
        spec = P(*[axis if d in dims else None for d in range(x.ndim)])
        return jax.shard_map(fn, in_specs=spec, out_specs=spec, axis_names=frozenset({axis}), check_vma=False)(x)

    return run


__all__ = ["per_tensor_shard", "TensorParallelBlock", "tensor_parallel_block"]
