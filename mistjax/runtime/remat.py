"""The layer loop of a stage: remat segments, per-layer weight fetches (ZeRO-3 gathers, host copies)
and the re-fetching custom VJP that keeps no fetched weights between forward and backward
(docs/internals.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mistjax.core.execution import LayerScan
from mistjax.core.policies import GATHERED, offload_policy, remat_policy
from mistjax.core.stages import OFFLOAD, PLAIN, REMAT
from mistjax.core.types import PyTree
from mistjax.runtime.accumulate import PartialGrad, SliceGrad, reading_rows, scan_accumulating, scan_rows
from mistjax.runtime.residuals import Residuals, classify, restore_vjp
from mistjax.trace.split import LayerLoop as SplitLayerLoop
from mistjax.trace.split import unrolled_loop
from mistjax.trace.unrolled import LayerSlices

Layer = Callable[[list[jax.Array], list[jax.Array], list[jax.Array]], tuple[list[jax.Array], list[jax.Array]]]


def _schedules_weight_grads_late() -> bool:
    """Whether the platform being traced for (the abstract mesh's; a deviceless XLA:GPU compile traces in a CPU
    process) defers a flat program's weight-gradient matmuls to the end of the backward when nothing orders
    them: XLA:GPU does (the recomputed activations then stay live: remat on 16 unrolled layers, deviceless H100
    compile, took the peak from 76 to 109 MiB; with the order, to 58 MiB), XLA:CPU does not (with the order its
    remat'd peak is 64 MiB, without 48 MiB). Without a mesh: assumed."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device is None or device.platform != "cpu"


def _after(x: PyTree, ct: PyTree, every: bool = False) -> PyTree:
    """`x`, its values unchanged, made to depend on `ct` (a cotangent): every device-resident float leaf plus a
    zero computed from one element of `ct`'s first float leaf, or of each (`every`) (``min(|e|, 0)``, which
    XLA does not fold).

    An optimization barrier is not enough in one flat program (an unrolled layer loop): XLA:CPU expands it
    before its last CSE, which then merged each layer's backward re-fetch with the forward's, and it ran the
    recomputation in the forward (their results live from forward to backward: remat and ZeRO-3 lowered no
    peak, docs/benchmarks.md, "Remat and ZeRO-3 on unrolled stacks"); on XLA:GPU, which keeps the barrier
    until after scheduling, ZeRO-3 with the barrier alone saved nothing either (deviceless H100 compile: 48 ->
    49 MiB; tied, 47 -> 30 MiB). The dependency holds on every platform, for one elementwise pass over `x`;
    the price is that a fetch cannot start before its layer's cotangent (no overlap with the layer after it in
    the backward). The carry's cotangent comes first in `ct` (a per-layer output's may be an instantiated
    zero, which XLA folds).
    """
    probes = [c for c in jax.tree.leaves(ct) if jnp.issubdtype(c.dtype, jnp.inexact) and c.size]
    if not probes:
        return jax.lax.optimization_barrier(x)
    zero = cast(jax.Array, sum(jnp.minimum(jnp.abs(jnp.ravel(p)[0]), 0) for p in probes[:None if every else 1]))

    def tie(v: jax.Array) -> jax.Array:
        on_host = getattr(jax.typeof(v), "memory_space", None) == jax.memory.Space.Host
        if on_host or not jnp.issubdtype(v.dtype, jnp.inexact):
            return v
        return v + zero.astype(v.dtype)

    return jax.tree.map(tie, x)


def _refetching_layer(layer: Layer, riding: bool = False, tied: bool = False, recomputes: bool = False
                      ) -> Layer:
    """``layer(consts, carry, x)`` (x: stored weight slices, fetched inside) with a VJP that re-fetches.

    The forward keeps the residuals of ``jax.vjp(layer)`` that depend on `consts` or `carry`, plus
    `consts` and the stored slices `x` themselves (the scan's linearization forwards those from its
    inputs: no copy); the fetched weights and everything computed from them alone are dropped. The
    backward runs a fresh ``jax.vjp`` at a zero carry: it fetches again (all-gather, host->device),
    rebuilds the weight-only residuals, and its activation part is dead code (the stored leaves
    replace it). Its cotangent for `x` goes through the fetch's own transpose: a reduce-scatter over
    the partition group for an all-gather (the ZeRO-3 per-layer reduce-scatter), host memory for a
    host->device copy (`runtime.grads` moves it back).

    With `riding`, `x` is ``(x, a)`` and the layer passes `a` (the gradient accumulators of
    `accumulate.reading_rows`) on to its output ``(y, a)``: `a` is not kept (a per-layer residual of
    it would be a stacked copy of the accumulators); the backward's fresh forward passes zeros.

    With `tied` (an unrolled stack's layers, all in one flat program), the backward's inputs (the stored
    residuals, `consts`, `x`) are made to depend on the cotangent (`_after`), so that XLA neither merges the
    re-fetch and the recomputation with the forward's nor issues them before the backward reaches the layer.
    With `recomputes` too (a checkpointed `layer`), on platforms that defer weight-gradient matmuls
    (`_schedules_weight_grads_late`) the carry cotangent it passes on is made to depend on its weight
    gradients, so that each layer's recomputed activations die in its own backward step.
    """

    def as_wh(w: PyTree, h: tuple[list[jax.Array], list[jax.Array]]) -> tuple[list[jax.Array], PyTree]:
        return layer(h[0], h[1], w)  # `residuals.classify`'s (weights, activation) signature

    # The classification of the traced fwd, read by the bwd traced after it (same avals each time).
    classified: list[Residuals] = []

    @jax.custom_vjp
    def run(consts: list[jax.Array], c: list[jax.Array], x: PyTree) -> tuple[list[jax.Array], PyTree]:
        return layer(consts, c, x)

    def fwd(consts: list[jax.Array], c: list[jax.Array], x: PyTree) -> tuple[PyTree, tuple[PyTree, ...]]:
        res = classify(as_wh, x, (consts, c))
        classified[:] = [res]
        out, vjp = jax.vjp(as_wh, x, (consts, c))
        return out, (res.take(vjp), consts, x[0] if riding else x)

    def bwd(saved: tuple[PyTree, ...], ct: tuple[list[jax.Array], PyTree]
            ) -> tuple[list[jax.Array], list[jax.Array], PyTree]:
        stored, consts, x = saved
        if tied:
            stored, consts, x = _after((stored, consts, x), ct)
        else:
            # Like jax.checkpoint's prevent_cse: keep XLA from merging the re-fetch with the forward fetch
            # when both land in one computation (a scan of one trip is no loop), which would keep the
            # fetched weights alive from forward to backward. XLA:CPU expands the barrier before CSE, so
            # there such short segments still fetch once (docs/cost_model.md); in loops it is a no-op.
            x = jax.lax.optimization_barrier(x)
        if riding:  # zeros passed straight to the output: dead code
            x = (x, jax.tree.map(jnp.zeros_like, ct[1][1]))
        # zeros_like of the carry cotangent: the carry's shape, dtype and (with check_vma) varying axes.
        zero_c = [jnp.zeros_like(ci) for ci in ct[0]]
        fresh = jax.vjp(as_wh, x, (consts, zero_c))[1]
        g_x, (g_consts, g_c) = restore_vjp(fresh, classified[0], stored)(ct)
        if tied and recomputes and _schedules_weight_grads_late():
            g_c = _after(g_c, g_x, every=True)  # this layer's weight gradients before the next layer's backward
        return g_consts, g_c, g_x

    run.defvjp(fwd, bwd)
    return run


# One layer as a scan body: ``(carry, stored slices) -> (carry, per-layer outputs)``.
ScanBody = Callable[[list[jax.Array], PyTree], tuple[list[jax.Array], PyTree]]


def _unrolled(fn: ScanBody, carry: list[jax.Array], xs: list[Any]) -> tuple[list[jax.Array], PyTree]:
    """`trace.split.unrolled_loop` on a layer loop's traced arrays (it types them as any jaxpr value)."""
    out, ys = unrolled_loop(cast(Any, fn), cast(Any, carry), xs)
    return cast(list[jax.Array], out), ys


def as_layer_loop(loop: Callable[..., tuple[list[jax.Array], list[jax.Array]]]) -> SplitLayerLoop:
    """A runtime layer loop as `trace.split.evaluate` takes it: inside the traced step its values are arrays
    (tracers), which the trace layer types as any jaxpr value (`core.jaxpr.Value`)."""
    return cast(SplitLayerLoop, loop)


def _prepared(p: SliceGrad | None) -> SliceGrad:
    """An accumulated operand's `LayerLoop.prepare` entry (set for every operand with an accumulator)."""
    assert p is not None, "an accumulated operand without its prepare function"
    return p


class LoopSinks(NamedTuple):
    """What one micro-batch's backward layer loop feeds, per scanned operand (None: nothing for it).

    Attributes:
      accs: whole-stack gradient accumulators; each layer's cotangent row is added in its iteration
        (`runtime.accumulate`; `prepare` turns a cotangent into its row).
      outs: result buffers of another shape than the accumulator (the G == 1 in-loop sync's ZeRO-1 shards).
      finish: the collective that synchronises each layer's summed row (`runtime.accumulate.accumulate_into`).
      defer: issue each row's collective one backward iteration later (`runtime.accumulate.sync_deferred`;
        with `finish` only).
    """

    accs: Sequence[jax.Array | None]
    outs: Sequence[jax.Array | None] | None = None
    finish: Sequence[SliceGrad | None] | None = None
    defer: bool = False


class LoopResult(NamedTuple):
    """A layer loop's results: the carry, the per-layer outputs, and the fed `LoopSinks` buffers."""

    carry: list[jax.Array]
    ys: list[jax.Array]
    accs: list[jax.Array | None] | None = None
    outs: list[jax.Array | None] | None = None


Body = Callable[[list[jax.Array], list[jax.Array], list[jax.Array]], tuple[list[jax.Array], list[jax.Array]]]


@dataclass(frozen=True)
class LayerLoop:
    """A stage's layer loop, run in place of the model's layer scan (`mistjax.trace.split.evaluate`).

    Attributes:
      scans: the loop's scans, their kinds and unroll (`core.execution.layer_scans`).
      policy: remat policy name of the checkpointed layers (full | dots | names:a,b).
      gather: per scanned operand, a function that turns one layer's stored slice into the slice used for
        compute (e.g. an all-gather over the ZeRO axis), or None.
      carry_constraint: applied to the hidden state between layers (sequence parallelism).
      offload_names: the checkpoint_name tags of a layer (what activation offload moves).
      refetch_plain: run plain layers under the re-fetching custom VJP even without fetches, so their
        residuals hold only activation-dependent values (the MPMD pipeline keeps a stage's residuals
        between its forward and backward programs, where a weight-only one would be one more copy of
        the stage's weights per micro-batch in flight).
      prepare: per scanned operand, how one layer's weight cotangent enters its accumulator (see
        `runtime.accumulate`); used with `LoopSinks.accs`. A stack of several scans then reads each layer's
        rows of the accumulated stacks (`accumulate.scan_rows`) instead of scanning per-scan slices of them
        (each a copy of those weights for the whole step).
      enter: applied to the carry entering the loop (`runtime.grads`: the sequence-parallel split).
    """

    scans: tuple[LayerScan, ...]
    policy: str
    gather: tuple[Callable[[jax.Array], jax.Array] | None, ...]
    carry_constraint: Callable[[jax.Array], jax.Array] | None = None
    offload_names: tuple[str, ...] = ()
    refetch_plain: bool = False
    prepare: tuple[SliceGrad | None, ...] = ()
    enter: Callable[[jax.Array], jax.Array] | None = None  # applied to the initial carry (sequence split)

    @property
    def num_layers(self) -> int:
        return self.scans[-1].end if self.scans else 0

    def __call__(self, body: Body, consts: list[jax.Array], carry: list[jax.Array], xs: list[jax.Array]
                 ) -> tuple[list[jax.Array], list[jax.Array]]:
        """``(carry, ys)``: the interface of `mistjax.trace.split.evaluate`'s ``layer_loop``."""
        out = self.run(body, consts, carry, xs)
        return out.carry, out.ys

    def _apply(self, body: Body) -> Layer:
        def apply(consts: list[jax.Array], c: list[jax.Array], x: list[jax.Array]
                  ) -> tuple[list[jax.Array], list[jax.Array]]:
            x = [xi if g is None else checkpoint_name(g(xi), GATHERED) for g, xi in zip(self.gather, x)]
            c, y = body(consts, c, x)
            if self.carry_constraint is not None:
                c = [self.carry_constraint(ci) for ci in c]
            return c, y

        return apply

    def _kinds(self, apply: Callable[[list[jax.Array], list[jax.Array], PyTree], tuple[list[jax.Array], PyTree]],
               consts: list[jax.Array], riding: bool, unrolled: bool = False
               ) -> dict[str, ScanBody]:
        """The per-layer function of each segment kind (see `_refetching_layer` for `riding`; `unrolled`: the
        layers run as a Python loop, in one flat program)."""
        checkpointed = {REMAT: remat_policy(self.policy), OFFLOAD: offload_policy(self.offload_names)}
        if unrolled:
            # Every kind under the re-fetching VJP with its backward tied to its cotangent (`_after`): in one
            # flat program XLA otherwise merges a jax.checkpoint's recomputation and a plain layer's re-fetch
            # with the forward's, or issues them in the forward, and remat / ZeRO-3 lower no peak.
            fns = {PLAIN: apply, **{k: jax.checkpoint(apply, policy=p) for k, p in checkpointed.items()}}
            return {k: functools.partial(_refetching_layer(f, tied=True, recomputes=k != PLAIN), consts)
                    for k, f in fns.items()}
        if riding:
            # Every kind under the re-fetching VJP: a jax.checkpoint alone keeps the whole stacks it
            # reads its rows from as a per-layer residual, which the scan stacks (a copy per layer).
            fns = {PLAIN: apply, **{k: jax.checkpoint(apply, policy=p) for k, p in checkpointed.items()}}
            return {k: functools.partial(_refetching_layer(f, riding=True), consts) for k, f in fns.items()}

        def layer(c: list[jax.Array], x: list[jax.Array]) -> tuple[list[jax.Array], list[jax.Array]]:
            return apply(consts, c, x)

        # Plain layers: with fetches, the re-fetching custom VJP (consts go in as an argument: a
        # custom_vjp must not close over values being differentiated); without, a plain function.
        any_gather = any(g is not None for g in self.gather)
        plain = functools.partial(_refetching_layer(apply), consts) if any_gather or self.refetch_plain else layer
        return {PLAIN: plain, **{k: jax.checkpoint(layer, policy=p) for k, p in checkpointed.items()}}

    def run(self, body: Body, consts: list[jax.Array], carry: list[jax.Array], xs: list[jax.Array],
            sinks: LoopSinks | None = None) -> LoopResult:
        """Run the layers over the scanned operands `xs`, feeding `sinks` in the backward if given."""
        if sinks is not None and sinks.defer and sinks.finish is None:
            raise ValueError("defer: only an in-loop sync (`finish`) can be deferred")
        apply = self._apply(body)
        if self.enter is not None:
            carry = [self.enter(c) for c in carry]
        accs = None if sinks is None else list(sinks.accs)
        outs = None if sinks is None or sinks.outs is None else list(sinks.outs)
        finish = None if sinks is None else sinks.finish
        # Several scans with in-loop accumulation: each layer reads its rows of the whole stacks
        # (`accumulate.scan_rows`), so no scan reads a copied slice of them.
        # (Not with `finish`: the G == 1 in-loop sync scans slices; the cost model charges them there.)
        # Also for weights read in partial form (`accumulate.PartialGrad`): read inside the checkpointed layer, their
        # broadcast is recomputed in the backward, not kept per layer.
        partial = any(isinstance(p, PartialGrad) for p in self.prepare)
        by_rows = (accs is not None and finish is None and (len(self.scans) > 1 or partial)
                   and any(a is not None for a in accs))
        unrolled = any(isinstance(x, LayerSlices) for x in xs)  # an unrolled stack: its own leaves per layer
        fns = self._kinds(apply, consts, riding=False, unrolled=unrolled)
        if by_rows:
            assert accs is not None  # (by_rows: accumulated)
            rows_of = [j for j, a in enumerate(accs) if a is not None]
            prepared = [_prepared(p) for p, a in zip(self.prepare, accs) if a is not None]
            fns_rows = self._kinds(reading_rows(apply, rows_of, prepared),
                                   consts, riding=True)
        ys_parts = []
        for scan in self.scans:
            start, end, fn = scan.start, scan.end, fns[scan.kind]
            # (Not used on the row-reading path: there only `scan_rows` slices, the other operands.)
            seg = xs if by_rows or (start, end) == (0, self.num_layers) else [x[start:end] for x in xs]
            if unrolled:
                if accs is not None:
                    raise ValueError("in-loop gradient accumulation needs a stacked layer scan")
                carry, ys = _unrolled(fn, carry, seg)
            elif by_rows:
                assert accs is not None  # (by_rows: accumulated)
                carry, accs, ys = scan_rows(fns_rows[scan.kind], carry, xs, accs, start, end, scan.unroll)
            elif accs is not None:
                assert sinks is not None  # (accumulators come from the sinks)
                # The whole-stack accumulators ride through every scan (rows start..end-1 here).
                carry, accs, outs, ys = scan_accumulating(fn, carry, seg, accs, list(self.prepare), start,
                                                          scan.unroll, outs, finish, defer=sinks.defer)
            else:
                carry, ys = jax.lax.scan(fn, carry, seg, unroll=scan.unroll)
            ys_parts.append(ys)
        ys = ys_parts[0] if len(ys_parts) == 1 else [jax.numpy.concatenate(parts) for parts in zip(*ys_parts)]
        return LoopResult(carry, ys, None if accs is None else list(accs), None if outs is None else list(outs))
