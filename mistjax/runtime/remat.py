"""The layer loop of a stage: remat segments, per-layer weight fetches (ZeRO-3 gathers, host copies)
and the re-fetching custom VJP that keeps no fetched weights between forward and backward
(docs/internals.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mistjax.core.policies import GATHERED, offload_policy, remat_policy
from mistjax.core.stages import layer_segments
from mistjax.runtime.accumulate import SliceGrad, reading_rows, scan_accumulating, scan_rows
from mistjax.runtime.residuals import Residuals, classify, restore_vjp
from mistjax.trace.split import unrolled_loop
from mistjax.trace.unrolled import LayerSlices

Layer = Callable[[list[Any], list[Any], list[Any]], tuple[list[Any], list[Any]]]
# ``loop(body, consts, carry, xs, accs=None, outs=None, finish=None, defer=False)`` (see `make_layer_loop`).
LayerLoopFn = Callable[..., Any]


def _refetching_layer(layer: Layer, riding: bool = False) -> Layer:
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
    """

    def as_wh(w: Any, h: tuple[list[Any], list[Any]]) -> tuple[list[Any], Any]:
        return layer(h[0], h[1], w)  # `residuals.classify`'s (weights, activation) signature

    # The classification of the traced fwd, read by the bwd traced after it (same avals each time).
    classified: list[Residuals] = []

    @jax.custom_vjp
    def run(consts: list[Any], c: list[Any], x: Any) -> tuple[list[Any], Any]:
        return layer(consts, c, x)

    def fwd(consts: list[Any], c: list[Any], x: Any) -> tuple[Any, tuple[Any, ...]]:
        res = classify(as_wh, x, (consts, c))
        classified[:] = [res]
        out, vjp = jax.vjp(as_wh, x, (consts, c))
        return out, (res.take(vjp), consts, x[0] if riding else x)

    def bwd(saved: tuple[Any, ...], ct: tuple[list[Any], Any]) -> tuple[list[Any], list[Any], Any]:
        stored, consts, x = saved
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
        return g_consts, g_c, g_x

    run.defvjp(fwd, bwd)
    return run


def _unrolled_segments(segments: Sequence[tuple[int, int, str]], double_buffer: bool
                       ) -> list[tuple[int, int, str, int]]:
    """``(start, end, kind, unroll)`` per scan of the layer loop.

    With per-layer fetches (ZeRO-3 gathers, host->device weight copies) and `double_buffer`, two layers
    per loop iteration let the scheduler fetch layer i+1 while layer i computes (a double buffer; the
    cost model charges two layers of fetched weights). The backward scan is the transpose of this one and
    keeps its unroll, so its re-fetches are double-buffered too. A segment of two layers stays a loop of
    two trips: unrolled, it would be one trip, which XLA inlines and then merges the backward's re-fetch
    with the forward's (the gathered weights would stay live). An odd segment runs its last layer as a
    scan of its own: ``lax.scan`` with an unroll that does not divide the length concatenates the
    remainder's outputs, residual stacks included, onto the loop's (a copy of every stacked residual:
    15 GiB per device for a 31-layer Llama-3-8B segment at 16k tokens per micro-batch on XLA:GPU); a
    segment of three layers runs one layer per iteration (its split would leave a one-trip loop). A
    segment that offloads its activations keeps one layer per iteration: XLA:GPU (jaxlib 0.10.2) fails
    to compile host-placed residual stacks of an unrolled scan (an INTERNAL layout-assignment error).
    """
    out = []
    for start, end, kind in segments:
        if not (double_buffer and end - start > 2) or kind == "offload" or end - start == 3:
            out.append((start, end, kind, 1))  # (3 = a two-trip loop of two layers + one: inlined as above)
        elif (end - start) % 2:
            out += [(start, end - 1, kind, 2), (end - 1, end, kind, 1)]
        else:
            out.append((start, end, kind, 2))
    return out


def make_layer_loop(*, num_layers: int, remat_layers: int, policy: str,
                    gather: Sequence[Callable[[Any], Any] | None],
                    carry_constraint: Callable[[Any], Any] | None = None,
                    offload_layers: int = 0, offload_names: Sequence[str] = (),
                    refetch_plain: bool = False, prepare: Sequence[SliceGrad | None] = (),
                    double_buffer: bool = True) -> LayerLoopFn:
    """A layer loop for `mistjax.trace.split.evaluate`.

    Args:
      num_layers: layers in the stack this loop runs.
      remat_layers: the last `remat_layers` layers are checkpointed with `policy`.
      policy: remat policy name (full | dots | names:a,b).
      gather: per scanned operand, a function that turns one layer's stored slice into the
        slice used for compute (e.g. an all-gather over the ZeRO axis), or None.
      carry_constraint: applied to the hidden state between layers (sequence parallelism).
      offload_layers: the first `offload_layers` layers offload their tagged activations to host.
      offload_names: the checkpoint_name tags of a layer (what offloading moves).
      refetch_plain: run plain layers under the re-fetching custom VJP even without fetches, so their
        residuals hold only activation-dependent values (the MPMD pipeline keeps a stage's residuals
        between its forward and backward programs, where a weight-only one would be one more copy of
        the stage's weights per micro-batch in flight).
      prepare: per scanned operand, how one layer's weight cotangent enters its accumulator (see
        `runtime.accumulate`); used when the loop is called with ``accs``. Then a stack of several
        segments reads each layer's rows of the accumulated stacks (`accumulate.scan_rows`) instead of
        scanning per-segment slices of them (each a copy of those weights for the whole step).
      double_buffer: run segments of more than two layers with fetches two layers per iteration, so
        that layer i+1's fetch overlaps layer i's compute. Only worth it where the platform runs
        collectives and copies asynchronously (`runtime.grads.double_buffers_fetches`).

    Returns:
      ``loop(body, consts, carry, xs, accs=None, outs=None, finish=None, defer=False)``: ``(carry, ys)``,
      or ``(carry, ys, accs)`` when `accs` (per scanned operand, its whole-stack gradient accumulator or
      None) is given, or ``(carry, ys, accs, outs)`` when `finish` (per operand, the collective that
      synchronises each layer's summed row, or None) is given too (`outs`: per operand, the result
      buffer of another shape than the accumulator, or None; see `runtime.accumulate.accumulate_into`).
      With `defer` each row's collective is issued one backward iteration later
      (`runtime.accumulate.sync_deferred`; `outs` only).
    """
    any_gather = any(g is not None for g in gather)

    def loop(body: Callable[..., Any], consts: list[Any], carry: list[Any], xs: list[Any],
             accs: Sequence[Any] | None = None, outs: Sequence[Any] | None = None,
             finish: Sequence[SliceGrad | None] | None = None, defer: bool = False) -> Any:
        if defer and finish is None:
            raise ValueError("defer: only an in-loop sync (`finish`) can be deferred")

        def apply(consts: list[Any], c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            x = [xi if g is None else checkpoint_name(g(xi), GATHERED) for g, xi in zip(gather, x)]
            c, y = body(consts, c, x)
            if carry_constraint is not None:
                c = [carry_constraint(ci) for ci in c]
            return c, y

        def kinds(apply: Layer, riding: bool) -> dict[str, Callable[..., Any]]:
            checkpointed = {"remat": remat_policy(policy), "offload": offload_policy(offload_names)}
            if riding:
                # Every kind under the re-fetching VJP: a jax.checkpoint alone keeps the whole stacks it
                # reads its rows from as a per-layer residual, which the scan stacks (a copy per layer).
                fns = {"plain": apply, **{k: jax.checkpoint(apply, policy=p) for k, p in checkpointed.items()}}
                return {k: functools.partial(_refetching_layer(f, riding=True), consts) for k, f in fns.items()}

            def layer(c: list[Any], x: Any) -> tuple[list[Any], Any]:
                return apply(consts, c, x)

            # Plain layers: with fetches, the re-fetching custom VJP (consts go in as an argument: a
            # custom_vjp must not close over values being differentiated); without, a plain function.
            plain = functools.partial(_refetching_layer(apply), consts) if any_gather or refetch_plain else layer
            return {"plain": plain, **{k: jax.checkpoint(layer, policy=p) for k, p in checkpointed.items()}}

        segments = layer_segments(num_layers, remat_layers, offload_layers)
        # Several segments with in-loop accumulation: each layer reads its rows of the whole stacks
        # (`accumulate.scan_rows`), so no segment scans a copied slice of them.
        # (Not with `finish`: the G == 1 in-loop sync scans slices; the cost model charges them there.)
        by_rows = (accs is not None and finish is None and len(segments) > 1
                   and any(a is not None for a in accs))
        fns = kinds(apply, riding=False)
        if by_rows:
            fns_rows = kinds(reading_rows(apply, [j for j, a in enumerate(accs) if a is not None],
                                          [p for p, a in zip(prepare, accs) if a is not None]), riding=True)
        ys_parts = []
        for start, end, kind, unroll in _unrolled_segments(segments, double_buffer and any_gather):
            fn = fns[kind]
            # (Not used on the row-reading path: there only `scan_rows` slices, the other operands.)
            seg = xs if by_rows or (start, end) == (0, num_layers) else [x[start:end] for x in xs]
            if any(isinstance(x, LayerSlices) for x in xs):  # an unrolled stack: its own leaves per layer
                if accs is not None:
                    raise ValueError("in-loop gradient accumulation needs a stacked layer scan")
                carry, ys = unrolled_loop(fn, carry, seg)
            elif by_rows:
                carry, accs, ys = scan_rows(fns_rows[kind], carry, xs, accs, start, end, unroll)
            elif accs is not None:
                # The whole-stack accumulators ride through every segment (rows start..end-1 here).
                carry, accs, outs, ys = scan_accumulating(fn, carry, seg, accs, prepare, start, unroll, outs,
                                                          finish, defer=defer)
            else:
                carry, ys = jax.lax.scan(fn, carry, seg, unroll=unroll)
            ys_parts.append(ys)
        ys = ys_parts[0] if len(ys_parts) == 1 else [jax.numpy.concatenate(parts) for parts in zip(*ys_parts)]
        if accs is None:
            return carry, ys
        return (carry, ys, list(accs)) if finish is None else (carry, ys, list(accs), list(outs))

    return loop
