"""Gradient accumulation into one buffer: each layer's weight gradient is added into the step's
accumulator inside the backward layer loop, as Megatron-LM adds into its ``main_grad`` buffer.

Left to autodiff, a micro-batch's gradient of a stacked weight is a whole new stacked buffer (the
backward scan's per-layer outputs) that is added into the accumulator after the backward: two
gradient buffers live at once. Here the accumulator is threaded through the layer loop as a carry
that the forward passes on unchanged, and `accumulate_into` (an identity on the forward) adds the
cotangent of each layer's weight slice into that layer's row of the carry's cotangent. The caller
seeds the cotangent of the loop's accumulator output with the accumulator itself, so the backward
carry starts as the accumulator and each layer updates its row in place (a dynamic-update-slice of a
while-loop carry): one buffer, and one layer's gradient in flight. A stack of several layer kinds
(`runtime.remat`) reads each layer's rows of the whole stacks with `pick_rows` (`scan_rows`) rather
than scanning a copied slice of them per segment. The G == 1 in-loop gradient sync feeds result
buffers the same way (`accumulate_into` with a ``finish`` collective), or on GPU meshes one backward
iteration late (`sync_deferred`), so XLA:GPU overlaps each layer's collective with the next layer's
backward. docs/internals.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TypeAlias, TypeVar

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from mistjax.runtime.context_partial import spread

# The checkpoint name of a weight slice in partial form (`PartialGrad`): never saved for the backward.
PARTIAL_NAME = "mistjax_context_partial_weight"

# One layer's cotangent of a stored weight slice -> the increment of that layer's accumulator row
# (to device, the gradient dtype, a ZeRO-2 reduce-scatter over the partition group).
SliceGrad: TypeAlias = Callable[[jax.Array], jax.Array]


class PartialGrad:
    """A `SliceGrad` of a weight accumulated as per-context-rank partial sums (`runtime.context_partial`): the
    layer reads the weight's slice in partial form (``[cp, *slice]``, `spread`), so its cotangent, and the
    accumulator's row, are ``[cp, *row]`` partials that `runtime.grads` sums over `context` once per step."""

    def __init__(self, prepare: SliceGrad, cp: int) -> None:
        self.prepare, self.cp = prepare, cp

    def __call__(self, ct: jax.Array) -> jax.Array:
        return self.prepare(ct)

    def spread(self, x: jax.Array) -> jax.Array:
        """One layer's stored slice as the layer reads it: in partial form."""
        return spread(x, self.cp)


def _spread(prepare: SliceGrad | None, x: jax.Array) -> jax.Array:
    """``x`` as the layer reads it: in partial form where its `prepare` is a `PartialGrad`."""
    return prepare.spread(x) if isinstance(prepare, PartialGrad) else x


def _slice_zero(g: jax.Array, prepare: SliceGrad, host: bool) -> jax.Array:
    """The zero cotangent of a stored slice whose layer cotangent is ``g`` (in partial form: one dim more)."""
    return _zero_like(g[0] if isinstance(prepare, PartialGrad) else g, host)


Leaves: TypeAlias = list[jax.Array]
"""A layer's flat operands or results (its carry, its scanned slices, its outputs): one array per leaf."""

Slots: TypeAlias = list[jax.Array | None]
"""Per accumulated weight (or per scanned operand), its whole-stack buffer, or None where it has none."""

LayerFn: TypeAlias = Callable[[Leaves, Leaves], tuple[Leaves, Leaves]]
"""``layer_fn(carry, xs) -> (carry, ys)``: one layer, the body of a ``lax.scan`` over the layers."""

RowsIn: TypeAlias = tuple[tuple[Leaves, jax.Array], Leaves]
"""What a `reading_rows` layer scans: ``((x, layer), accs)``, the whole stacks of `x` read at row `layer`."""

RowLayerFn: TypeAlias = Callable[[Leaves, RowsIn], tuple[Leaves, tuple[Leaves, Leaves]]]
"""``f(carry, ((x, layer), accs)) -> (carry, (ys, accs))``: a `reading_rows` layer with its consts bound."""


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def accumulate_into(accs: list[jax.Array | None], outs: list[jax.Array | None], xs: list[jax.Array],
                    layer: jax.Array, prepare: tuple[SliceGrad, ...], finish: tuple[SliceGrad | None, ...],
                    on_host: tuple[bool, ...]) -> tuple[Slots, Slots, Leaves]:
    """Identity on ``(accs, outs, xs)``; the backward turns the cotangent of ``xs[j]`` into row `layer`
    of the cotangent of ``accs[j]`` (or of ``outs[j]``) and gives `xs` a zero cotangent (their gradient
    lives in the accumulators).

    Per weight ``j``, with ``row = ct(accs[j])[layer] + prepare[j](ct(xs[j]))`` (no first term when
    ``accs[j]`` is None) and ``fin = finish[j]`` (identity when None):

    * ``outs[j]`` None: ``fin(row)`` goes into row `layer` of ``ct(accs[j])`` (at its low corner when
      `fin` returns less, e.g. a reduce-scatter's shard): accumulate, or accumulate and synchronise;
    * else (no accumulator: the runtime's G == 1 sync, `core.execution.StageExecution.synced`):
      ``ct(outs[j])[layer] = fin(row)``.

    Args:
      accs: the stacked accumulators (leading dim = layers), one per accumulated weight, or None.
      outs: the stacked result buffers of the synchronised rows when there is no accumulator, or None.
      xs: this layer's stored slices of those weights.
      layer: the layer's row in the accumulators (an int32 scalar).
      prepare: per weight, turns the slice cotangent into the accumulator row's increment.
      finish: per weight, applied to the summed row before it is stored (a collective), or None.
      on_host: per weight, whether its stored slice is in host memory (its zero cotangent must be).
    """
    del layer, finish, on_host
    return accs, outs, [_spread(p, x) for p, x in zip(prepare, xs)]


def _fwd(accs: Slots, outs: Slots, xs: Leaves, layer: jax.Array, prepare: tuple[SliceGrad, ...],
         finish: tuple[SliceGrad | None, ...], on_host: tuple[bool, ...]
         ) -> tuple[tuple[Slots, Slots, Leaves], jax.Array]:
    del finish, on_host
    return (accs, outs, [_spread(p, x) for p, x in zip(prepare, xs)]), layer


def _zero_like(g: jax.Array, host: bool) -> jax.Array:
    z = jax.numpy.zeros_like(g)
    return jax.device_put(z, jax.memory.Space.Host) if host else z


def _row(acc: jax.Array | None, out: jax.Array | None, g: jax.Array, layer: jax.Array, prep: SliceGrad,
         fin: SliceGrad | None) -> jax.Array:
    """One layer's new accumulator (or result) row, in the buffer's dtype (the plan's gradient dtype)."""
    buf = acc if acc is not None else out
    assert buf is not None  # every accumulated operand has an accumulator or a result buffer
    dtype = buf.dtype
    row = prep(g).astype(dtype)
    if acc is not None:
        row = lax.dynamic_index_in_dim(acc, layer, keepdims=False) + row
    return row if fin is None else fin(row).astype(dtype)


def _bwd(prepare: tuple[SliceGrad, ...], finish: tuple[SliceGrad | None, ...], on_host: tuple[bool, ...],
         layer: jax.Array, ct: tuple[Slots, Slots, Leaves]) -> tuple[Slots, Slots, Leaves, None]:
    ct_accs, ct_outs, ct_xs = ct
    accs, outs = list(ct_accs), list(ct_outs)
    for j, (g, prep, fin) in enumerate(zip(ct_xs, prepare, finish)):
        row = _row(accs[j], outs[j], g, layer, prep, fin)
        start = (layer,) + (0,) * row.ndim  # the row, or its low corner for a smaller (scattered) result
        out_j, acc_j = outs[j], accs[j]
        if out_j is None:
            assert acc_j is not None  # (as in `_row`)
            accs[j] = lax.dynamic_update_slice(acc_j, row[None], start)
        else:
            outs[j] = lax.dynamic_update_slice(out_j, row[None], start)
    # Zero, and dead code: the weights themselves are not differentiated (`runtime.grads`).
    return accs, outs, [_slice_zero(g, p, h) for g, p, h in zip(ct_xs, prepare, on_host)], None


def _add_rows(ct_accs: list[jax.Array], ct_rows: list[jax.Array], layer: jax.Array,
              prepare: tuple[SliceGrad, ...]) -> list[jax.Array]:
    """Row `layer` of each accumulator cotangent plus its layer's prepared weight cotangent (in place)."""
    return [lax.dynamic_update_index_in_dim(acc, _row(acc, None, g, layer, prep, None), layer, 0)
            for acc, g, prep in zip(ct_accs, ct_rows, prepare)]


accumulate_into.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def pick_rows(accs: list[jax.Array], stacks: list[jax.Array], layer: jax.Array, prepare: tuple[SliceGrad, ...]
              ) -> tuple[list[jax.Array], list[jax.Array]]:
    """``(accs, [s[layer] for s in stacks])``; the backward adds ``prepare[j](ct of row j)`` into row
    `layer` of the cotangent of ``accs[j]``, as `accumulate_into` does, and gives `stacks` none.

    `accumulate_into` on a row read out of the whole stack: called inside a layer's checkpointed or
    re-fetching function, the layer keeps the loop-invariant stack and the row index, and its backward
    reads the row again (a row computed outside would be a per-layer residual: a stacked copy).
    """
    return accs, [_spread(p, lax.dynamic_index_in_dim(s, layer, keepdims=False)) for p, s in zip(prepare, stacks)]


def _pick_fwd(accs: list[jax.Array], stacks: list[jax.Array], layer: jax.Array, prepare: tuple[SliceGrad, ...]
              ) -> tuple[tuple[list[jax.Array], list[jax.Array]], jax.Array]:
    return pick_rows(accs, stacks, layer, prepare), layer


def _pick_bwd(prepare: tuple[SliceGrad, ...], layer: jax.Array, ct: tuple[list[jax.Array], list[jax.Array]]
              ) -> tuple[list[jax.Array], None, None]:
    ct_accs, ct_rows = ct
    # None: a symbolic zero (a zero stack would be a whole-stack buffer; the stacks are not differentiated).
    return _add_rows(ct_accs, ct_rows, layer, prepare), None, None


pick_rows.defvjp(_pick_fwd, _pick_bwd)


def _store_synced(outs: list[jax.Array], rows: list[jax.Array], layer: jax.Array,
                  finish: tuple[SliceGrad | None, ...]) -> list[jax.Array]:
    """`outs` with ``finish[j](rows[j])`` (a collective; identity when None) in row `layer` of ``outs[j]``
    (at its low corner when the collective returns less, e.g. a reduce-scatter's shard)."""
    res = []
    for out, row, fin in zip(outs, rows, finish):
        synced = (row if fin is None else fin(row)).astype(out.dtype)
        res.append(lax.dynamic_update_slice(out, synced[None], (layer,) + (0,) * synced.ndim))
    return res


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def sync_deferred(outs: list[jax.Array], pend: list[jax.Array], xs: list[jax.Array], layer: jax.Array,
                  prepare: tuple[SliceGrad, ...], finish: tuple[SliceGrad | None, ...], on_host: tuple[bool, ...],
                  last: int) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
    """Identity on ``(outs, pend, xs)``; the backward synchronises the previous backward layer's row
    while this layer's backward computes (the runtime's G == 1 sync where collectives are asynchronous:
    `core.execution.Capabilities.defers_row_sync`; elsewhere `accumulate_into` synchronises each row in its own layer).

    The cotangent of `pend` is a carry of the backward loop: the unsynchronised row of layer
    ``layer + 1``, computed in the previous backward iteration. The backward runs ``finish[j]`` on it,
    stores the result in row ``layer + 1`` of the cotangent of ``outs[j]``, and passes this layer's own
    row, ``prepare[j](ct(xs[j]))``, on as the new cotangent of ``pend[j]``. So one layer's collective and
    the next layer's backward compute are independent inside one while body, and XLA's latency-hiding
    scheduler overlaps them (Megatron-LM's ``--overlap-grad-reduce``); a collective issued in the
    iteration that computes its row has to wait for that row. The first backward iteration (layer
    `last`, the loop's last row) has nothing pending: it synchronises the zero seed into its own row
    (zero, overwritten one iteration later), one collective of zeros hidden under that layer's backward,
    which keeps every iteration one loop body (peeling the layer would scan a copy of the weights).
    `flush_synced` stores the loop's first row after the loop. One extra row is held (the pending one).

    Args:
      outs: per weight, the stacked buffer of synchronised rows (leading dim = layers), zeros.
      pend: per weight, a zero row of the unsynchronised shape (its cotangent carries the pending row).
      xs: this layer's stored slices of those weights.
      layer: the layer's row in `outs` (an int32 scalar).
      prepare: per weight, turns the slice cotangent into the unsynchronised row (gradient dtype).
      finish: per weight, the collective that synchronises a row, or None.
      on_host: per weight, whether its stored slice is in host memory (its zero cotangent must be).
      last: the loop's last row (the first backward layer: rows after it belong to other loops).
    """
    del layer, prepare, finish, on_host, last
    return outs, pend, xs


def _defer_fwd(outs: list[jax.Array], pend: list[jax.Array], xs: list[jax.Array], layer: jax.Array,
               prepare: tuple[SliceGrad, ...], finish: tuple[SliceGrad | None, ...], on_host: tuple[bool, ...],
               last: int) -> tuple[tuple[Leaves, Leaves, Leaves], jax.Array]:
    del prepare, finish, on_host, last
    return (outs, pend, xs), layer


def _defer_bwd(prepare: tuple[SliceGrad, ...], finish: tuple[SliceGrad | None, ...], on_host: tuple[bool, ...],
               last: int, layer: jax.Array, ct: tuple[list[jax.Array], list[jax.Array], list[jax.Array]]
               ) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array], None]:
    ct_outs, ct_pend, ct_xs = ct
    outs = _store_synced(list(ct_outs), list(ct_pend), jax.numpy.minimum(layer + 1, last), finish)
    rows = [_row(None, p, g, layer, prep, None) for g, prep, p in zip(ct_xs, prepare, ct_pend)]
    return outs, rows, [_zero_like(g, h) for g, h in zip(ct_xs, on_host)], None


sync_deferred.defvjp(_defer_fwd, _defer_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def flush_synced(outs: list[jax.Array], pend: list[jax.Array], layer: jax.Array,
                 finish: tuple[SliceGrad | None, ...]) -> tuple[list[jax.Array], list[jax.Array]]:
    """Identity on ``(outs, pend)``; the backward synchronises the row still pending after the backward
    loop (layer `layer`'s, the loop's first: see `sync_deferred`) into row `layer` of ``ct(outs)``."""
    del layer, finish
    return outs, pend


def _flush_fwd(outs: list[jax.Array], pend: list[jax.Array], layer: jax.Array, finish: tuple[SliceGrad | None, ...]
               ) -> tuple[tuple[Leaves, Leaves], jax.Array]:
    del finish
    return (outs, pend), layer


def _flush_bwd(finish: tuple[SliceGrad | None, ...], layer: jax.Array, ct: tuple[list[jax.Array], list[jax.Array]]
               ) -> tuple[list[jax.Array], None, None]:
    ct_outs, ct_pend = ct
    # None: `pend` is a constant zero row, not differentiated.
    return _store_synced(list(ct_outs), list(ct_pend), layer, finish), None, None


flush_synced.defvjp(_flush_fwd, _flush_bwd)


def scan_accumulating(layer_fn: LayerFn, carry: Leaves, xs: Leaves, accs: Sequence[jax.Array | None],
                      prepare: Sequence[SliceGrad | None], start: int, unroll: int,
                      outs: Sequence[jax.Array | None] | None = None,
                      finish: Sequence[SliceGrad | None] | None = None, defer: bool = False
                      ) -> tuple[Leaves, Slots, Slots, Leaves]:
    """``lax.scan(layer_fn, carry, xs)`` over layers ``start, start + 1, ...`` with `accs` and `outs`
    (per scanned operand, its whole-stack accumulator / result buffer or None) carried along and fed
    by `accumulate_into` (`finish`: per operand, the collective applied to each summed row), or with
    `defer` (result buffers only) by `sync_deferred`: each row synchronised one backward iteration later.

    Returns:
      (carry, accs, outs, ys): the buffers are the inputs on the forward; their cotangents collect the
      layers' gradients.
    """
    n = len(accs)
    outs = list(outs) if outs is not None else [None] * n
    finish = list(finish) if finish is not None else [None] * n
    if defer:
        if any(a is not None for a in accs) or all(o is None for o in outs):
            raise ValueError("a deferred sync needs result buffers (`outs`) and no accumulators")
        carry, synced, ys = _scan_deferred(layer_fn, carry, xs, outs, prepare, finish, start, unroll)
        return carry, list(accs), synced, ys
    idx = [j for j in range(n) if accs[j] is not None or outs[j] is not None]
    preps, fins = tuple(prepare[j] for j in idx), tuple(finish[j] for j in idx)
    on_host = tuple(getattr(jax.typeof(xs[j]), "memory_space", None) == jax.memory.Space.Host for j in idx)
    num = int(jax.numpy.shape(xs[0])[0])

    def step(c_a: tuple[Leaves, Slots, Slots], x_i: tuple[Leaves, jax.Array]
             ) -> tuple[tuple[Leaves, Slots, Slots], Leaves]:
        c, a, o = c_a
        x, i = x_i
        a, o, picked = accumulate_into(a, o, [x[j] for j in idx], i, preps, fins, on_host)
        x = list(x)
        for j, v in zip(idx, picked, strict=True):
            x[j] = checkpoint_name(v, PARTIAL_NAME) if isinstance(preps[idx.index(j)], PartialGrad) else v
        c, y = layer_fn(c, x)
        return (c, a, o), y

    rows = start + jax.numpy.arange(num, dtype=jax.numpy.int32)
    init = (carry, [accs[j] for j in idx], [outs[j] for j in idx])
    (carry, acc_out, out_out), ys = lax.scan(step, init, (xs, rows), unroll=unroll)
    acc_res: Slots = list(accs)
    out_res: Slots = list(outs)
    for j, a, o in zip(idx, acc_out, out_out):
        acc_res[j], out_res[j] = a, o
    return carry, acc_res, out_res, ys


_T = TypeVar("_T")


def _given(x: _T | None) -> _T:
    """An entry its caller's index list selected as present (an operand's accumulator, buffer, prepare)."""
    assert x is not None
    return x


def _put(xs: Sequence[_T], idx: Sequence[int], values: Sequence[_T]) -> list[_T]:
    out = list(xs)
    for j, v in zip(idx, values):
        out[j] = v
    return out


def _scan_deferred(layer_fn: LayerFn, carry: Leaves, xs: Leaves, outs: Slots, prepare: Sequence[SliceGrad | None],
                   finish: Sequence[SliceGrad | None], start: int, unroll: int
                   ) -> tuple[Leaves, Slots, Leaves]:
    """`scan_accumulating` with result buffers, each layer's row synchronised one backward iteration later
    (`sync_deferred`), the loop's first row after the loop (`flush_synced`)."""
    idx = [j for j, o in enumerate(outs) if o is not None]
    preps, fins = tuple(_given(prepare[j]) for j in idx), tuple(finish[j] for j in idx)
    held = [_given(outs[j]) for j in idx]  # (idx: the operands with a result buffer)
    on_host = tuple(getattr(jax.typeof(xs[j]), "memory_space", None) == jax.memory.Space.Host for j in idx)
    num = int(jax.numpy.shape(xs[0])[0])
    # The pending rows' seeds: one layer's unsynchronised row (the prepared slice cotangent's shape).
    pend = [jax.numpy.zeros(jax.eval_shape(p, jax.ShapeDtypeStruct(xs[j].shape[1:], xs[j].dtype)).shape,
                            o.dtype) for j, p, o in zip(idx, preps, held)]
    bufs, pend = flush_synced(held, pend, jax.numpy.int32(start), fins)

    def step(c_o: tuple[Leaves, Leaves, Leaves], x_i: tuple[Leaves, jax.Array]
             ) -> tuple[tuple[Leaves, Leaves, Leaves], Leaves]:
        c, o, p = c_o
        x, i = x_i
        o, p, picked = sync_deferred(o, p, [x[j] for j in idx], i, preps, fins, on_host, start + num - 1)
        c, y = layer_fn(c, _put(x, idx, picked))
        return (c, o, p), y

    rows = start + jax.numpy.arange(num, dtype=jax.numpy.int32)
    (carry, bufs, _), ys = lax.scan(step, (carry, bufs, pend), (xs, rows), unroll=unroll)
    return carry, _put(outs, idx, bufs), ys


# ``apply(consts, carry, x) -> (carry, y)``: one layer on its operands' rows.
RowLayer: TypeAlias = Callable[[Leaves, Leaves, Leaves], tuple[Leaves, Leaves]]


def reading_rows(apply: RowLayer, idx: Sequence[int], prepare: Sequence[SliceGrad]
                 ) -> Callable[[Leaves, Leaves, RowsIn], tuple[Leaves, tuple[Leaves, Leaves]]]:
    """`apply` as ``f(consts, c, ((x, i), a)) -> (c, (y, a))`` for `scan_rows`: the `idx` entries of `x`
    are whole stacks whose row `i` it picks itself (`pick_rows`, feeding the accumulators `a`).

    Run it under `jax.checkpoint` or the re-fetching VJP (`runtime.remat`): their residuals are then the
    stacks (loop-invariant: no copy) and `i`, and their backward picks the row again.
    """
    idx, prepare = tuple(idx), tuple(prepare)

    def f(consts: Leaves, c: Leaves, xin: RowsIn) -> tuple[Leaves, tuple[Leaves, Leaves]]:
        (x, i), a = xin
        a, rows = pick_rows(a, [x[j] for j in idx], i, prepare)
        x = list(x)
        for j, r in zip(idx, rows):
            x[j] = r
        c, y = apply(consts, c, x)
        return c, (y, a)

    return f


def scan_rows(layer_fn: RowLayerFn, carry: Leaves, xs: Leaves, accs: Sequence[jax.Array | None],
              start: int, end: int, unroll: int) -> tuple[Leaves, Slots, Leaves]:
    """`scan_accumulating` over layers ``start .. end - 1`` of the stacks `xs` without slicing the
    accumulated ones: those go into every iteration whole (a loop-invariant operand) and `layer_fn`
    (built with `reading_rows`) picks its row; the others are scanned as their ``[start:end]`` slice.

    A slice ``x[start:end]`` scanned by a layer segment is a new buffer in XLA, read again by the
    segment's backward scan: a copy of those layer weights for the whole step.

    Returns:
      (carry, accs, ys), as `scan_accumulating`.
    """
    idx = [j for j, a in enumerate(accs) if a is not None]
    whole = (start, end) == (0, int(jax.numpy.shape(xs[0])[0]))
    scanned = [None if j in idx else (x if whole else x[start:end]) for j, x in enumerate(xs)]

    def step(c_a: tuple[Leaves, Leaves], x_i: tuple[Slots, jax.Array]) -> tuple[tuple[Leaves, Leaves], Leaves]:
        c, a = c_a
        part, i = x_i
        x = [xs[j] if j in idx else _given(v) for j, v in enumerate(part)]  # (None only at idx)
        c, (y, a) = layer_fn(c, ((x, i), a))
        return (c, a), y

    rows = jax.numpy.arange(start, end, dtype=jax.numpy.int32)
    (carry, acc_out), ys = lax.scan(step, (carry, [_given(accs[j]) for j in idx]), (scanned, rows), unroll=unroll)
    out: Slots = list(accs)
    for j, a in zip(idx, acc_out):
        out[j] = a
    return carry, out, ys


__all__ = ["LayerFn", "Leaves", "PartialGrad", "RowLayer", "RowLayerFn", "RowsIn", "SliceGrad", "Slots",
           "accumulate_into", "flush_synced", "pick_rows", "reading_rows", "scan_accumulating", "scan_rows",
           "sync_deferred"]
