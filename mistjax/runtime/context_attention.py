"""Context-parallel causal attention: the sequence split over a mesh axis (issue #31, docs/context-parallel.md).

Two forms, both global-view functions for arrays whose sequence dim is split contiguously over the mesh
axis ``axis`` (device i holds positions ``[i s/cp, (i+1) s/cp)``), run as a ``jax.shard_map`` manual over
that axis only, so that other axes (``data`` on the batch, ``tensor`` on the heads) stay with GSPMD:

* `ContextForm.RING` (ring attention, Liu et al. 2023, load-balanced as in Brandon et al. 2023 "Striped
  attention" / the zigzag layout of ring-flash-attention): the kernel moves q, k and v into a zigzag layout
  (the sequence cut into ``2 cp`` chunks, device d working on chunks d and ``2cp-1-d``), then passes the
  key/value shards around a ring of ``cp`` steps with an online softmax; under the causal mask every device
  computes the same number of chunk pairs at every step (`ring_schedule`). The output is moved back to the
  natural order, so the caller never sees the zigzag layout. The backward is a second ring that carries the
  key/value shards and their float32 dK/dV accumulators, which arrive home after ``cp`` hops.
* `ContextForm.ULYSSES` (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all from the sequence split to
  a head split, a blockwise attention over the whole sequence for ``heads / cp`` heads (causal: query block i
  reads key blocks 0..i only, `_causal_forward`), and an all-to-all back (`ulysses_supported` says which head
  counts work).

Both run under a ``jax.custom_vjp`` whose residuals are q, k, v, the output and the float32 log-sum-exp
(FlashAttention-2, Dao 2023), with every step blocked over ``block_size`` keys: O(local seq x block)
temporaries. The forward and backward are ``jax.jit``-ed functions named
``context_attention_fwd_<form>_cp<cp>_b<block>`` / ``context_attention_bwd_...`` so that the analysis can
price them as one unit (like ``models.attention``'s ``fused_attention_fwd_b<B>``, whose per-block math
this module re-implements: the runtime does not import the model zoo).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from mistjax.core.attention_blocks import check_attention_args, key_blocks, pad_keys
from mistjax.core.context import ContextForm, ulysses_supported
from mistjax.core.layout import CONTEXT_AXIS
from mistjax.core.types import PyTree

DEFAULT_BLOCK_SIZE = 128
FWD_NAME = "context_attention_fwd"  # name prefix of the forward's jit (module docstring)
BWD_NAME = "context_attention_bwd"
_SEL = -1  # a slot chosen per device and step in `_step_pairs` (see there)
_T = TypeVar("_T")


# ------------------------------------------------------------------------------------------ public API

def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str = CONTEXT_AXIS,
                      form: ContextForm = ContextForm.RING, causal: bool = True,
                      block_size: int = DEFAULT_BLOCK_SIZE, residual_name: str | None = None) -> jax.Array:
    """Attention over a sequence split contiguously over the mesh axis ``axis`` of the current mesh.

    Call it under ``jax.set_mesh(mesh)`` (or inside a ``shard_map`` of that mesh that leaves ``axis``
    automatic), on arrays in their natural sequence order.

    Args:
        q: ``[batch, seq, heads, head_dim]``.
        k: ``[batch, seq, kv_heads, head_dim]``; query head ``n`` reads kv head ``n // (heads // kv_heads)``.
        v: same shape and dtype as ``k``.
        axis: the mesh axis the sequence is split over (``cp`` devices).
        form: `ContextForm.RING` or `ContextForm.ULYSSES` (or their string values).
        causal: mask keys after the query.
        block_size: keys per block inside each step (balanced blocks of at most this many keys).
        residual_name: ``checkpoint_name`` given to the saved output and log-sum-exp (as the blockwise kernel's
            option), so that a remat policy saving that name keeps both instead of rerunning the ring.

    Returns:
        ``[batch, seq, heads, head_dim]`` in ``q.dtype``, split like ``q``; logits, softmax statistics and
        accumulators are float32.

    Raises:
        ValueError: for bad shapes, a ``block_size`` that is not a positive integer, an unknown ``form``,
            an ``axis`` not in the current mesh, a sequence the form cannot split, or head counts Ulysses
            cannot split (`ulysses_supported`).
    """
    form = _form(form)
    check_attention_args(q, k, v, block_size, "context_attention")
    cp = _context_size(axis)
    s, heads, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    parts = 2 * cp if form is ContextForm.RING and causal else cp
    if s % parts:
        why = "2 * cp chunks (the zigzag layout)" if parts != cp else "cp shards"
        raise ValueError(f"context_attention(form={form.value!r}): the sequence length {s} must split into {why} "
                         f"= {parts}, with cp = {cp} devices on mesh axis {axis!r}; pad the sequence to a multiple "
                         f"of {parts} or use a smaller {axis!r} axis")
    if form is ContextForm.ULYSSES and (reason := ulysses_supported(heads, kv_heads, cp)) is not None:
        raise ValueError(f"context_attention(form='ulysses') on mesh axis {axis!r}: {reason}; use "
                         "form='ring', or a context axis size that divides the head counts")
    direct = form is ContextForm.ULYSSES and _direct_all_to_all(axis)
    return _attention(axis, form, cp, block_size, causal, kv_heads, direct, residual_name)(q, k, v)


def ring_schedule(cp: int, causal: bool = True) -> list[list[tuple[tuple[int, int], ...]]]:
    """The chunk pairs the ring form computes: ``[step][device] -> ((q_chunk, kv_chunk), ...)``.

    Causal: chunks of ``seq / (2 cp)`` positions numbered 0 .. 2cp-1; a pair with equal chunks is computed
    under the causal mask (the others in full). Every device computes three pairs at step 0 (two of them
    masked) and two full pairs at every later step. Non-causal: chunks are the ``cp`` shards and every step
    computes one full pair. The kernel reads the same `_step_pairs`, so the cost model can price this.

    Args:
        cp: devices on the context axis.
        causal: the schedule of the causal (zigzag) kernel, or of the non-causal one.
    """
    out = []
    for t in range(cp):
        row = []
        for d in range(cp):
            src = (d - t) % cp  # the device whose K/V shard device d holds at step t
            sel = int(src > d)

            def chunk(slot: int, dev: int) -> int:
                held = (dev, 2 * cp - 1 - dev) if causal else (dev,)
                return held[sel if slot == _SEL else slot]  # noqa: B023 -- used within this iteration

            row.append(tuple((chunk(qs, d), chunk(ks, src)) for qs, ks, _ in _step_pairs(t, causal)))
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------ checks

def _form(form: ContextForm | str) -> ContextForm:
    try:
        return ContextForm(form)
    except ValueError:
        raise ValueError(f"context_attention: form must be one of {[f.value for f in ContextForm]}, "
                         f"got {form!r}") from None


def _context_size(axis: str) -> int:
    """Devices on ``axis`` of the current (abstract) mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        have = "no mesh is set" if mesh.empty else f"the current mesh has axes {tuple(mesh.axis_names)}"
        raise ValueError(f"context_attention: axis={axis!r} is not an axis of the current mesh ({have}); run it "
                         f"under `with jax.set_mesh(mesh):` for a mesh with an {axis!r} axis, or pass axis= the "
                         "name of the axis the sequence is split over")
    return int(mesh.shape[axis])


# ------------------------------------------------------------------------------------------ per-block math

class _State(NamedTuple):
    """Online-softmax state of a run of queries (float32): running max, sum and un-normalised output."""

    m: jax.Array  # [b, kv, s, g]
    den: jax.Array  # [b, kv, s, g]
    acc: jax.Array  # [b, kv, s, g, d]


def _group(x: jax.Array, kv_heads: int) -> jax.Array:
    """``[b, s, n, d] -> [b, s, kv, g, d]``: the query heads grouped by the kv head they read."""
    b, s, n, d = x.shape
    return x.reshape(b, s, kv_heads, n // kv_heads, d)


def _ungroup(x: jax.Array) -> jax.Array:
    """``[b, kv, s, g, d] -> [b, s, kv * g, d]``."""
    b, kvh, s, g, d = x.shape
    return jnp.moveaxis(x, 1, 2).reshape(b, s, kvh * g, d)


def _init(q: jax.Array) -> _State:
    b, s, kvh, g, d = q.shape
    return _State(jnp.full((b, kvh, s, g), -jnp.inf, jnp.float32), jnp.zeros((b, kvh, s, g), jnp.float32),
                  jnp.zeros((b, kvh, s, g, d), jnp.float32))


def _finish(state: _State, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """``(o [b, s, n, d] in dtype, lse [b, kv, s, g] float32)``."""
    return _ungroup(state.acc / state.den[..., None]).astype(dtype), state.m + jnp.log(state.den)


def _block_mask(sq: int, sk: int, start: jax.Array, bk: int, diagonal: bool) -> jax.Array:
    """``[sq, bk]``: query ``i`` may read key ``start + j`` (causal on a diagonal pair, and not padding)."""
    qpos = lax.broadcasted_iota(jnp.int32, (sq, bk), 0)
    kpos = start + lax.broadcasted_iota(jnp.int32, (sq, bk), 1)
    return kpos <= qpos if diagonal else kpos < sk


def _block_update(st: _State, q: jax.Array, kj: jax.Array, vj: jax.Array, bias: jax.Array, scale: float) -> _State:
    """The online softmax ``st`` of the queries ``q`` (``[b, sq, kv, g, d]``) after one key block ``kj`` / ``vj``
    (``[b, bk, kv, d]``); ``bias`` ``[sq, bk]`` is 0 where a key is visible and -inf where masked."""
    logits = jnp.einsum("bskgd,btkd->bksgt", q, kj, preferred_element_type=jnp.float32) * scale
    logits = logits + bias[:, None, :]  # an added -inf, not a select: nothing for a linearization to keep
    # Finite: every row sees a key in the first block (key 0 on a diagonal pair, padding only at the end).
    m_new = jnp.maximum(st.m, jnp.max(logits, axis=-1))
    alpha = jnp.exp(st.m - m_new)
    p = jnp.exp(logits - m_new[..., None])
    pv = jnp.einsum("bksgt,btkd->bksgd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
    return _State(m_new, st.den * alpha + jnp.sum(p, axis=-1), st.acc * alpha[..., None] + pv)


def _block_grads(q: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, kj: jax.Array, vj: jax.Array,
                 mask: jax.Array, scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq [b, kv, sq, g, d], dk [b, bk, kv, d], dv)`` in float32 of the queries ``q`` against one key block,
    its probabilities recomputed from the log-sum-exp (FlashAttention-2's backward); ``mask`` ``[sq, bk]``."""
    logits = jnp.einsum("bskgd,btkd->bksgt", q, kj, preferred_element_type=jnp.float32) * scale
    p = jnp.where(mask[:, None, :], jnp.exp(logits - lse[..., None]), 0.0)
    dv = jnp.einsum("bksgt,bskgd->btkd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bskgd,btkd->bksgt", do, vj, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
    dq = jnp.einsum("bksgt,btkd->bksgd", ds, kj, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bksgt,bskgd->btkd", ds, q, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _pair_forward(state: _State, q: jax.Array, k: jax.Array, v: jax.Array, *, diagonal: bool,
                  block_size: int) -> _State:
    """``state`` updated with the keys ``k`` (``[b, sk, kv, d]``) for the queries ``q`` (``[b, sq, kv, g, d]``).

    ``diagonal``: q and k are the same positions (causal mask inside); else every key is visible.
    A scan over key blocks: the logits temporary is ``[b, kv, sq, g, block]``.
    """
    sq, sk = q.shape[1], k.shape[1]
    nk, bk = key_blocks(sk, block_size)
    scale = 1.0 / math.sqrt(q.shape[-1])
    k, v = pad_keys(k, nk * bk), pad_keys(v, nk * bk)

    def body(st: _State, start: jax.Array) -> tuple[_State, None]:
        kj = lax.dynamic_slice_in_dim(k, start, bk, axis=1)
        vj = lax.dynamic_slice_in_dim(v, start, bk, axis=1)
        bias = jnp.where(_block_mask(sq, sk, start, bk, diagonal), 0.0, -jnp.inf).astype(jnp.float32)
        return _block_update(st, q, kj, vj, bias, scale), None

    return lax.scan(body, state, jnp.arange(nk, dtype=jnp.int32) * bk)[0]


def _pair_backward(q: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, k: jax.Array, v: jax.Array,
                   *, diagonal: bool, block_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq [b, kv, sq, g, d], dk [b, sk, kv, d], dv)`` in float32 of one (queries, keys) pair.

    ``q``, ``do``: ``[b, sq, kv, g, d]``; ``lse``, ``delta``: ``[b, kv, sq, g]``. A scan over key blocks.
    """
    b, sq, kvh, g, d = q.shape
    sk = k.shape[1]
    nk, bk = key_blocks(sk, block_size)
    scale = 1.0 / math.sqrt(d)
    kp, vp = pad_keys(k, nk * bk), pad_keys(v, nk * bk)

    def body(dq: jax.Array, start: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        kj = lax.dynamic_slice_in_dim(kp, start, bk, axis=1)
        vj = lax.dynamic_slice_in_dim(vp, start, bk, axis=1)
        gq, dk, dv = _block_grads(q, do, lse, delta, kj, vj, _block_mask(sq, sk, start, bk, diagonal), scale)
        return dq + gq, (dk, dv)

    dq, (dk, dv) = lax.scan(body, jnp.zeros((b, kvh, sq, g, d), jnp.float32), jnp.arange(nk, dtype=jnp.int32) * bk)

    def unblock(x: jax.Array) -> jax.Array:  # [nk, b, bk, kv, d] -> [b, sk, kv, d]
        return jnp.moveaxis(x, 0, 1).reshape(b, nk * bk, kvh, d)[:, :sk]

    return dq, unblock(dk), unblock(dv)


def _pad_seq(x: jax.Array, total: int, axis: int) -> jax.Array:
    """``x`` zero-padded along ``axis`` to ``total`` positions."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, total - x.shape[axis])
    return jnp.pad(x, pad)


def _causal_mask(i: jax.Array, j: jax.Array, bs: int) -> jax.Array:
    """``[bs, bs]``: in query block ``i`` and key block ``j`` (``bs`` positions each), query may read key."""
    rows = lax.broadcasted_iota(jnp.int32, (bs, bs), 0)
    cols = lax.broadcasted_iota(jnp.int32, (bs, bs), 1)
    return j * bs + cols <= i * bs + rows


def _causal_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, block_size: int) -> _State:
    """The online-softmax state of causal attention of the queries ``q`` (``[b, s, kv, g, d]``) over the keys of
    the same positions (``[b, s, kv, d]``), skipping the masked blocks: query block i reads key blocks 0..i
    only (a loop of ``i + 1`` trips), so the work is the causal half of the square, not all of it."""
    b, s, kvh, g, d = q.shape
    n, bs = key_blocks(s, block_size)
    scale = 1.0 / math.sqrt(d)
    qp, kp, vp = (_pad_seq(x, n * bs, 1) for x in (q, k, v))

    def query_block(_: None, i: jax.Array) -> tuple[None, _State]:
        qi = lax.dynamic_slice_in_dim(qp, i * bs, bs, axis=1)

        def key_block(j: jax.Array, st: _State) -> _State:
            kj, vj = (lax.dynamic_slice_in_dim(x, j * bs, bs, axis=1) for x in (kp, vp))
            bias = jnp.where(_causal_mask(i, j, bs), 0.0, -jnp.inf).astype(jnp.float32)
            return _block_update(st, qi, kj, vj, bias, scale)

        return None, lax.fori_loop(0, i + 1, key_block, _init(qi))

    _, st = lax.scan(query_block, None, jnp.arange(n, dtype=jnp.int32))

    def unblock(x: jax.Array) -> jax.Array:  # [n, b, kv, bs, ...] -> [b, kv, s, ...]
        x = jnp.moveaxis(x, 0, 2)
        return x.reshape(x.shape[:2] + (n * bs,) + x.shape[4:])[:, :, :s]

    return _State(*(unblock(x) for x in st))


def _causal_backward(q: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, k: jax.Array, v: jax.Array,
                     *, block_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`_pair_backward` of a causal pair of the same positions, skipping the masked blocks as
    `_causal_forward` does: ``(dq [b, kv, s, g, d], dk [b, s, kv, d], dv)`` in float32."""
    b, s, kvh, g, d = q.shape
    n, bs = key_blocks(s, block_size)
    scale = 1.0 / math.sqrt(d)
    qp, dop, kp, vp = (_pad_seq(x, n * bs, 1) for x in (q, do, k, v))
    lsep, deltap = (_pad_seq(x, n * bs, 2) for x in (lse, delta))

    def query_block(acc: tuple[jax.Array, jax.Array], i: jax.Array
                    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        qi, doi = (lax.dynamic_slice_in_dim(x, i * bs, bs, axis=1) for x in (qp, dop))
        lsei, deltai = (lax.dynamic_slice_in_dim(x, i * bs, bs, axis=2) for x in (lsep, deltap))

        def key_block(j: jax.Array, c: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            dq, dk, dv = c
            kj, vj = (lax.dynamic_slice_in_dim(x, j * bs, bs, axis=1) for x in (kp, vp))
            gq, gk, gv = _block_grads(qi, doi, lsei, deltai, kj, vj, _causal_mask(i, j, bs), scale)
            add = lambda whole, part: lax.dynamic_update_slice_in_dim(
                whole, lax.dynamic_slice_in_dim(whole, j * bs, bs, axis=1) + part, j * bs, axis=1)
            return dq + gq, add(dk, gk), add(dv, gv)

        dq, dk, dv = lax.fori_loop(0, i + 1, key_block, (jnp.zeros((b, kvh, bs, g, d), jnp.float32), *acc))
        return (dk, dv), dq

    zeros = jnp.zeros((b, n * bs, kvh, d), jnp.float32)
    (dk, dv), dq = lax.scan(query_block, (zeros, zeros), jnp.arange(n, dtype=jnp.int32))
    dq = jnp.moveaxis(dq, 0, 2).reshape(b, kvh, n * bs, g, d)[:, :, :s]
    return dq, dk[:, :s], dv[:, :s]


def _delta(do: jax.Array, o: jax.Array) -> jax.Array:
    """``rowsum(do * o)`` per query row and head, ``[b, kv, s, g]`` float32 (grouped inputs)."""
    return jnp.einsum("bskgd,bskgd->bksg", do, o, preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------------------------ zigzag layout

def _zigzag_perms(cp: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The ``ppermute`` pairs moving each device's first / second half (chunks 2i, 2i+1) to its zigzag owner.

    Chunk j (< cp) belongs to device j, chunk j (>= cp) to device 2cp-1-j. Each is a permutation: the even
    chunks land on every device once, and so do the odd ones.
    """
    owner = lambda j: j if j < cp else 2 * cp - 1 - j
    return [(i, owner(2 * i)) for i in range(cp)], [(i, owner(2 * i + 1)) for i in range(cp)]


def _ppermute(x: _T, axis: str, perm: list[tuple[int, int]]) -> _T:
    """``lax.ppermute`` of a pytree, skipped when ``perm`` moves nothing (cp = 1)."""
    return x if all(a == b for a, b in perm) else lax.ppermute(x, axis, perm)


def _to_zigzag(x: jax.Array, axis: str, cp: int) -> tuple[jax.Array, jax.Array]:
    """A device's natural shard (seq dim 1) -> its zigzag slots ``(chunk d, chunk 2cp-1-d)``."""
    first, second = jnp.split(x, 2, axis=1)
    p0, p1 = _zigzag_perms(cp)
    a, b = _ppermute(first, axis, p0), _ppermute(second, axis, p1)
    # An even device receives its low chunk from the even chunks' permutation, an odd one its high chunk.
    even = lax.axis_index(axis) % 2 == 0
    return jnp.where(even, a, b), jnp.where(even, b, a)


def _from_zigzag(slots: tuple[jax.Array, jax.Array], axis: str, cp: int) -> jax.Array:
    """The inverse of `_to_zigzag`: zigzag slots -> the natural shard."""
    even = lax.axis_index(axis) % 2 == 0
    a, b = jnp.where(even, slots[0], slots[1]), jnp.where(even, slots[1], slots[0])
    p0, p1 = _zigzag_perms(cp)
    inverse = lambda perm: [(dst, src) for src, dst in perm]
    return jnp.concatenate([_ppermute(a, axis, inverse(p0)), _ppermute(b, axis, inverse(p1))], axis=1)


# ------------------------------------------------------------------------------------------ the ring

def _step_pairs(t: int, causal: bool) -> tuple[tuple[int, int, bool], ...]:
    """``(q slot, kv slot, diagonal)`` computed at ring step ``t``.

    Causal, zigzag slots (0: chunk d < cp, 1: chunk 2cp-1-d >= cp). Step 0 holds the device's own K/V: the
    two diagonal pairs under the mask and the high queries against the low keys. At a later step the K/V of
    device ``src`` visit: the high queries always read the low keys; if ``src < d`` the low queries read
    them too (the high keys are later than both query chunks), if ``src > d`` the high queries also read
    the high keys (the low queries precede both key chunks). So the second pair is ``(sel, sel)`` with
    ``sel = src > d`` (`_SEL`), and every device computes two full pairs per step. Non-causal: one slot.
    """
    if not causal:
        return ((0, 0, False),)
    if t == 0:
        return ((0, 0, True), (1, 1, True), (1, 0, False))
    return ((1, 0, False), (_SEL, _SEL, False))


def _pick(slot: int, slots: Sequence[_T], sel: jax.Array) -> _T:
    """``slots[slot]``; for `_SEL` slot 1 where ``sel`` else slot 0 (a select, no branch)."""
    if slot != _SEL:
        return slots[slot]
    return jax.tree.map(lambda a, b: jnp.where(sel, b, a), slots[0], slots[1])


def _put(slot: int, slots: Sequence[_T], new: _T, sel: jax.Array) -> tuple[_T, ...]:
    """``slots`` with ``slots[slot]`` replaced by ``new`` (for `_SEL`, slot 1 where ``sel`` else slot 0)."""
    if slot != _SEL:
        return tuple(new if i == slot else x for i, x in enumerate(slots))
    keep0 = jax.tree.map(lambda old, n: jnp.where(sel, old, n), slots[0], new)
    keep1 = jax.tree.map(lambda old, n: jnp.where(sel, n, old), slots[1], new)
    return keep0, keep1


def _ring_next(x: _T, axis: str, cp: int) -> _T:
    """``x`` sent to the next device of the ring (device d receives device d-1's)."""
    return _ppermute(x, axis, [(i, (i + 1) % cp) for i in range(cp)])


def _slots(x: jax.Array, n: int) -> tuple[jax.Array, ...]:
    return tuple(jnp.split(x, n, axis=1)) if n > 1 else (x,)


def _ring_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str, cp: int, block_size: int,
                  causal: bool) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """One device's ring forward: natural shards in, ``(o natural, (q, k, v, o, lse) zigzag)`` out."""
    kvh = k.shape[2]
    qs: tuple[jax.Array, ...]
    ks: tuple[jax.Array, ...]
    vs: tuple[jax.Array, ...]
    if causal:
        qs, ks, vs = (_to_zigzag(x, axis, cp) for x in (q, k, v))
    else:
        qs, ks, vs = (q,), (k,), (v,)
    qg = tuple(_group(x, kvh) for x in qs)
    me = lax.axis_index(axis)
    state = tuple(_init(x) for x in qg)
    kv = (ks, vs)
    for t in range(cp):
        # The next step's K/V is sent before this step's compute so that XLA can overlap the two.
        nxt = _ring_next(kv, axis, cp) if t < cp - 1 else kv
        sel = (me - t) % cp > me
        for qi, ki, diagonal in _step_pairs(t, causal):
            new = _pair_forward(_pick(qi, state, sel), _pick(qi, qg, sel), _pick(ki, kv[0], sel),
                                _pick(ki, kv[1], sel), diagonal=diagonal, block_size=block_size)
            state = _put(qi, state, new, sel)
        kv = nxt
    outs, lses = zip(*(_finish(st, q.dtype) for st in state))
    o = _from_zigzag(outs, axis, cp) if causal else outs[0]
    cat = lambda xs, dim=1: jnp.concatenate(xs, axis=dim)
    return o, (cat(qs), cat(ks), cat(vs), cat(outs), cat(lses, 2))


def _ring_backward(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array, do: jax.Array, *,
                   axis: str, cp: int, block_size: int, causal: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One device's ring backward: zigzag residuals and the natural ``do`` in, natural dq, dk, dv out."""
    kvh, n = k.shape[2], 2 if causal else 1
    dos = _to_zigzag(do, axis, cp) if causal else (do,)
    qg, og = (tuple(_group(x, kvh) for x in _slots(a, n)) for a in (q, o))
    dog = tuple(_group(x, kvh) for x in dos)
    lses = tuple(jnp.split(lse, n, axis=2)) if n > 1 else (lse,)
    deltas = tuple(_delta(a, b) for a, b in zip(dog, og))
    me = lax.axis_index(axis)
    dq = tuple(jnp.zeros(x.shape[:1] + (kvh, x.shape[1]) + x.shape[3:], jnp.float32) for x in qg)
    kv = (_slots(k, n), _slots(v, n))
    # dK/dV accumulators travel with their K/V shard (float32, so that cp partial sums do not round).
    dkv = tuple(tuple(jnp.zeros(x.shape, jnp.float32) for x in xs) for xs in kv)
    for t in range(cp):
        nxt = _ring_next(kv, axis, cp) if t < cp - 1 else kv
        sel = (me - t) % cp > me
        for qi, ki, diagonal in _step_pairs(t, causal):
            qa, doa, lsea, deltaa = (_pick(qi, x, sel) for x in (qg, dog, lses, deltas))
            gq, gk, gv = _pair_backward(qa, doa, lsea, deltaa, _pick(ki, kv[0], sel), _pick(ki, kv[1], sel),
                                        diagonal=diagonal, block_size=block_size)
            dq = _put(qi, dq, _pick(qi, dq, sel) + gq, sel)
            dkv = (_put(ki, dkv[0], _pick(ki, dkv[0], sel) + gk, sel),
                   _put(ki, dkv[1], _pick(ki, dkv[1], sel) + gv, sel))
        dkv = _ring_next(dkv, axis, cp)  # after cp hops each accumulator is back on its shard's device
        kv = nxt
    dqs = tuple(_ungroup(x).astype(q.dtype) for x in dq)
    dks, dvs = (tuple(x.astype(k.dtype) for x in xs) for xs in dkv)
    back = (lambda xs: _from_zigzag(xs, axis, cp)) if causal else (lambda xs: xs[0])
    return back(dqs), back(dks), back(dvs)


# ------------------------------------------------------------------------------------------ Ulysses

def _all_to_all(x: jax.Array, axis: str, cp: int, split: int, concat: int, direct: bool) -> jax.Array:
    """A tiled all-to-all over ``axis``: ``x``'s dim ``split`` cut in ``cp`` pieces, piece j to device j,
    the pieces received concatenated along ``concat`` in device order.

    ``direct``: one ``lax.all_to_all``. Else ``cp - 1`` ppermutes (the same bytes): with another mesh axis
    left to GSPMD, XLA's partitioner replicates an all-to-all's operand over that axis (an all-gather of
    the batch over ``data``), which ppermutes do not need.
    """
    if direct:
        return lax.all_to_all(x, axis, split_axis=split, concat_axis=concat, tiled=True)
    me, size = lax.axis_index(axis), x.shape[split] // cp
    piece = lambda j: lax.dynamic_slice_in_dim(x, j * size, size, axis=split)
    # got[r] comes from device me - r; reversed, the sources run me+1, ..., me+cp: a roll puts them in order.
    got = [piece(me)] + [lax.ppermute(piece((me + r) % cp), axis, [(i, (i + r) % cp) for i in range(cp)])
                         for r in range(1, cp)]
    out = jnp.concatenate(got[::-1], axis=concat)
    return jnp.roll(out, (me + 1) * got[0].shape[concat], axis=concat)


def _to_heads(x: jax.Array, units: int, axis: str, cp: int, direct: bool) -> jax.Array:
    """Sequence split -> head split: ``[b, s/cp, h, d] -> [b, s, units/cp, h/units, d]``.

    The heads are cut in ``units`` groups (one kv head, or the query heads reading it) and group u goes to
    device ``u % cp``: strided, so that a head dim also split over ``tensor`` (contiguous blocks) is cut
    inside each block and never gathered when ``tensor`` divides ``units / cp``.
    """
    b, sl, h, d = x.shape
    x = x.reshape(b, sl, units // cp, cp, h // units, d)
    return _all_to_all(x, axis, cp, 3, 1, direct)[:, :, :, 0]


def _to_seq(x: jax.Array, axis: str, cp: int, direct: bool) -> jax.Array:
    """The inverse of `_to_heads`: ``[b, s, units/cp, h/units, d] -> [b, s/cp, h, d]``."""
    b, s, ul, hu, d = x.shape
    return _all_to_all(x[:, :, :, None], axis, cp, 1, 3, direct).reshape(b, s // cp, ul * cp * hu, d)


def _direct_all_to_all(axis: str) -> bool:
    """Whether no other mesh axis of more than one device is left to GSPMD (see `_all_to_all`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not any(size > 1 and name != axis and name not in mesh.manual_axes for name, size in mesh.shape.items())


def _ulysses_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str, cp: int, block_size: int,
                     causal: bool, direct: bool) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """One device's Ulysses forward: ``(o natural, (q, k, v, o, lse) head-split)``."""
    kvh = k.shape[2]
    if kvh < cp:  # fewer kv heads than devices: repeat each so every device receives the one it reads
        k, v = jnp.repeat(k, cp // kvh, axis=2), jnp.repeat(v, cp // kvh, axis=2)
    units = k.shape[2]
    qh = _to_heads(q, units, axis, cp, direct)  # [b, s, kv_local, g_local, d]
    kh, vh = (_to_heads(x, units, axis, cp, direct)[:, :, :, 0] for x in (k, v))
    # Causal: query block i reads key blocks 0..i only; the ring's zigzag does the same by its chunk pairs.
    state = (_causal_forward(qh, kh, vh, block_size=block_size) if causal
             else _pair_forward(_init(qh), qh, kh, vh, diagonal=False, block_size=block_size))
    oh, lse = _finish(state, q.dtype)
    oh = _group(oh, kh.shape[2])
    return _to_seq(oh, axis, cp, direct), (qh, kh, vh, oh, lse)


def _ulysses_backward(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array, do: jax.Array, *,
                      axis: str, cp: int, block_size: int, causal: bool, kv_heads: int, direct: bool
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One device's Ulysses backward: head-split residuals and the natural ``do`` in, natural grads out."""
    units = k.shape[2] * cp
    dog = _to_heads(do, units, axis, cp, direct)
    delta = _delta(dog, o)
    gq, gk, gv = (_causal_backward(q, dog, lse, delta, k, v, block_size=block_size) if causal
                  else _pair_backward(q, dog, lse, delta, k, v, diagonal=False, block_size=block_size))
    dq = _to_seq(jnp.moveaxis(gq, 1, 2).astype(q.dtype), axis, cp, direct)
    # Sent in the input dtype (each device's dK/dV is complete for its heads: nothing left to accumulate).
    dk, dv = (_to_seq(x[:, :, :, None].astype(k.dtype), axis, cp, direct) for x in (gk, gv))
    if kv_heads < cp:  # the transpose of the repeat: sum each kv head's copies (in float32)
        b, s, _, d = dk.shape
        dk, dv = (x.reshape(b, s, kv_heads, cp // kv_heads, d).sum(axis=3, dtype=jnp.float32).astype(k.dtype)
                  for x in (dk, dv))
    return dq, dk, dv


# ------------------------------------------------------------------------------------------ assembly

@functools.cache
def _kernels(axis: str, form: ContextForm, cp: int, block_size: int, causal: bool, kv_heads: int,
             direct: bool) -> tuple[Callable[..., PyTree], Callable[..., tuple[jax.Array, jax.Array, jax.Array]]]:
    """The named, jitted global forward and backward: a ``shard_map`` manual over ``axis`` only."""
    seq, on = P(None, axis), P(None, None, axis)  # split dim 1 / dim 2
    fwd_local: Callable[..., PyTree]
    bwd_local: Callable[..., PyTree]
    if form is ContextForm.RING:
        fwd_local = functools.partial(_ring_forward, axis=axis, cp=cp, block_size=block_size, causal=causal)
        bwd_local = functools.partial(_ring_backward, axis=axis, cp=cp, block_size=block_size, causal=causal)
        res_specs = (seq, seq, seq, seq, on)  # q, k, v, o zigzag on the seq dim; lse [b, kv, s, g]
    else:
        fwd_local = functools.partial(_ulysses_forward, direct=direct, axis=axis, cp=cp, block_size=block_size,
                                      causal=causal)
        bwd_local = functools.partial(_ulysses_backward, kv_heads=kv_heads, direct=direct, axis=axis, cp=cp,
                                      block_size=block_size, causal=causal)
        res_specs = (on, on, on, on, seq)  # q, k, v, o split over heads; lse [b, kv, s, g] over kv heads

    def manual(f: Callable[..., PyTree], in_specs: tuple, out_specs: PyTree) -> Callable[..., PyTree]:
        return jax.shard_map(f, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset({axis}),
                             check_vma=False)

    def fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> PyTree:
        return manual(fwd_local, (seq, seq, seq), (seq, res_specs))(q, k, v)

    def bwd(*res_and_do: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return manual(bwd_local, (*res_specs, seq), (seq, seq, seq))(*res_and_do)

    fwd.__name__ = fwd.__qualname__ = f"{FWD_NAME}_{form.value}_cp{cp}_b{block_size}"
    bwd.__name__ = bwd.__qualname__ = f"{BWD_NAME}_{form.value}_cp{cp}_b{block_size}"
    return jax.jit(fwd), jax.jit(bwd)


@functools.cache
def _attention(axis: str, form: ContextForm, cp: int, block_size: int, causal: bool, kv_heads: int,
               direct: bool, residual_name: str | None) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """The custom-VJP global attention of one configuration (``direct``: Ulysses' `_all_to_all`)."""
    fwd, bwd = _kernels(axis, form, cp, block_size, causal, kv_heads, direct)

    @jax.custom_vjp
    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return fwd(q, k, v)[0]

    def attend_fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        o, res = fwd(q, k, v)
        if residual_name is not None:  # res = (q, k, v, o, lse)
            res = (*res[:3], *(checkpoint_name(x, residual_name) for x in res[3:]))
        return o, res

    def attend_bwd(res: tuple[jax.Array, ...], do: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return bwd(*res, do)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


__all__ = ["CONTEXT_AXIS", "ContextForm", "check_attention_args", "context_attention", "key_blocks", "pad_keys",
           "ring_schedule", "ulysses_supported"]
