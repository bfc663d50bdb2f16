"""Pipeline-parallel value-and-grad: GPipe and 1F1B inside one jitted SPMD program.

The model comes as three pure functions: ``pre(pre_params, mb) -> h`` (embedding), ``block(layer_params,
h) -> h`` (one layer) and ``post(post_params, h, mb) -> loss`` (norm, head, mean loss of the micro-batch).
`pipeline_value_and_grad` runs them as ``S`` stages over the ``stage`` mesh axis with a static schedule
table (`mistjax.core.schedules`) and returns the mean loss over ``G`` micro-batches and its gradients.

How it works
------------
* One ``jax.shard_map``, manual over ``stage`` (plus the axes in ``dp_axes``, if any); every other mesh
  axis stays with GSPMD, so tensor parallelism and ZeRO sharding inside ``block`` keep working. A
  ``lax.scan`` over ticks reads row ``[t, stage]`` of the compiled table (`schedules.tick_program`).
* Per tick: the forward, one ``ppermute`` of activations, the backward, one ``ppermute`` of cotangents.
  F and B are each a chain of two-way ``lax.cond``s, one per distinct *stage kind* (first / last /
  number of plain and checkpointed layers / remat policy), so every stage's HLO is specialised to its
  own plan: it scans exactly its own layers (padding rows of the ``[S, Lmax]`` layout are never touched,
  cost nothing, and get exactly-zero grads), its last ``remat_layers[s]`` layers under
  ``jax.checkpoint`` with its own policy. Why a chain and not ``lax.switch``: XLA:CPU then updates the
  carried buffers in place, whereas a >2-way conditional (or a pass-through *true* branch) made it copy
  every residual pool each tick (measured: 2x the pipeline's temp memory).
* Forward: per layer ``jax.vjp(block, w, h)``. The vjp's residual leaves that depend on ``h`` (found at
  trace time by a dependency walk over the vjp's jaxpr, `runtime.residuals`) are written in place
  into ring-buffer pools; weight-only leaves (the weights, casts, slices of them) are not stored.
  Backward (reverse scan): the vjp is rebuilt from a fresh ``jax.vjp`` at a zero activation, which
  supplies the treedef and the weight-only leaves (its activation part is dead code that XLA
  removes; checked by counting dots), with the stored leaves put back; weight grads accumulate in
  place in fp32.
* Activation offload (``offload_layers[s]``, the stage's first layers): those layers run under
  ``jax.checkpoint`` with `runtime.remat.offload_policy`, so their vjp residuals are the layer input
  (device) and the ``checkpoint_name``-tagged activations (host memory space). Pools are keyed by
  memory space too, so the tagged rows go to pools created in host memory (a device_put per write is
  the policy's own; XLA:CPU drops the annotations, GPUs move the bytes).
* The first stage runs ``pre`` in its forward and recomputes it in its backward (an embedding gather;
  nothing of ``pre`` outlives a tick). The last stage runs ``jax.value_and_grad(post)`` inside its
  forward tick and keeps only the seed cotangent, never the head's residuals (logits).
* Pools are keyed by residual (shape, dtype), sized ``max_s slots_s * rows_s``: SPMD devices all
  allocate the same buffers, so activation memory per device is the *max over stages* of each stage's
  need (slots from the schedule: 1F1B ``min(S - s, G)``, GPipe ``G``; rows from the stage's remat).
  Whole residual shapes (no byte packing) let GSPMD shard them like the activations they come from.
  Measured (S=4, 2 layers/stage, D=64, F=256, 512 tokens/micro-batch, 6.8 MiB of residuals per stage
  and micro-batch), per-device peak = argument + output + temp - alias, G = 4 / 8 / 16: GPipe
  30.8 / 58.3 / 113.4 MiB; 1F1B 30.3 / 30.3 / 30.3 MiB (4 slots = 27.0 MiB of pools);
  1F1B-eager 30.3 / 50.6 / 50.6 MiB (7 slots).

Collectives and ``cond`` (XLA:CPU, 8 simulated devices, jax 0.10.2)
-------------------------------------------------------------------
* A collective over the *manual* ``stage`` axis inside a device-varying branch deadlocks, and so does
  the ``psum`` JAX inserts when transposing the implicit ``pvary`` of a stage-invariant input. So all
  inputs are ``pcast`` to varying at the top and the ``ppermute``s are unconditional (idle stages send
  zeros).
* **GSPMD collectives over the non-manual axes inside the branches work** (no deadlock). With the batch
  sharded over ``replica``, the weight-gradient contractions and the loss mean become ``all-reduce``s
  over ``replica`` groups inside the branches (TP over ``tensor`` likewise). Each such group lies inside
  one stage (GSPMD never spans a manual axis) and the predicates depend only on stage and tick, so all
  members of a group take the same branch; XLA:CPU rendezvous per participant group. Tested on meshes
  (2, 4) and (2, 2, 2); not checked on GPU/NCCL.
* Its cost (``dp_axes=()``, the default): the weight grads of *every* micro-batch are all-reduced inside
  the backward branch, ``G`` times per step instead of once (GSPMD also chose to all-gather the last
  stage's activations and compute the toy head replicated). With ``dp_axes=("replica", ...)`` those
  axes are manual: each device runs its share of every micro-batch (``post``'s mean is then a local
  mean; the executor ``pmean``s loss and grads once after the loop, which equals the global mean for
  equal local batches). Use it for plain DP / the MiCS ``replica`` axis; keep an axis with GSPMD when
  weights are sharded over it (ZeRO-3 / MiCS ``shard``), since ``block`` must see whole weights.
* Collectives over a *manual non-stage* axis issued by ``block`` itself (e.g. a ``pmean`` or per-layer
  ZeRO-3 ``all_gather`` over ``replica`` / ``shard``) also work inside the branches, for the same
  reason (tested). Callers that own the shard_map and the gradient sync use `pipeline_local`.

Overlap
-------
Each ``ppermute`` is issued right after the op that produced its operand, outside every cond. On GPU this
relies on XLA's async ``collective-permute-start/done`` and latency-hiding scheduler to overlap the
activation send with the same tick's backward, and on while-loop collective pipelining for the
cotangent send; XLA:CPU runs collectives synchronously, so nothing here measured overlap.

Memory of pre / post params
---------------------------
They are replicated over ``stage``: every device holds them plus an fp32 gradient accumulator of the same
size (zero except on the owner stage), and their grads are ``psum``'ed over ``stage`` (an all-reduce of
embedding/head size). Queues: an input and a cotangent queue of activation-sized slots (1F1B depth 1;
GPipe's last stage keeps ``G`` seed cotangents, and SPMD gives every stage that depth).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mistjax.core.policies import offload_policy
from mistjax.core.policies import remat_policy as checkpoint_policy
from mistjax.core.schedules import make_schedule
from mistjax.core.stages import OFFLOAD, PLAIN, StageKind, stage_kind
from mistjax.runtime import ticks as sch
from mistjax.runtime.residuals import classify, restore_vjp
from mistjax.runtime.residuals import vary as _vary
from mistjax.trace.split import checkpoint_names

PyTree = Any

# Extra columns appended to the tick program: the stage-kind branch F and B take (0 = idle).
_F_BRANCH, _B_BRANCH = sch.NUM_COLUMNS, sch.NUM_COLUMNS + 1


# ----------------------------------------------------------------------------------------------- layout
def _check_stage_layers(stage_layers: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    bounds = [(int(a), int(b)) for a, b in stage_layers]
    if not bounds:
        raise ValueError("stage_layers is empty: give one [start, end) layer range per stage")
    prev = 0
    for s, (a, b) in enumerate(bounds):
        if a != prev or b < a:
            raise ValueError(f"stage {s} has layers [{a}, {b}); stages must be contiguous from layer 0 "
                             f"(expected to start at {prev}) and not negative")
        prev = b
    return bounds


def to_stage_layout(stacked: PyTree, stage_layers: Sequence[Sequence[int]]) -> tuple[PyTree, jax.Array]:
    """Turn every ``[L, ...]`` leaf into ``[S, Lmax, ...]`` (zero padded) plus ``layer_mask [S, Lmax]``.

    Stage ``s`` gets layers ``[a_s, b_s)`` of ``stage_layers`` in its first ``b_s - a_s`` rows.
    """
    bounds = _check_stage_layers(stage_layers)
    lmax = max(max(b - a for a, b in bounds), 1)
    index = np.zeros((len(bounds), lmax), np.int32)
    mask = np.zeros((len(bounds), lmax), bool)
    for s, (a, b) in enumerate(bounds):
        index[s, : b - a] = np.arange(a, b)
        mask[s, : b - a] = True
    num_layers = bounds[-1][1]
    even = all(b - a == lmax for a, b in bounds)

    def one(x: jax.Array) -> jax.Array:
        if x.shape[0] != num_layers:
            raise ValueError(f"stacked leaf has {x.shape[0]} layers, stage_layers cover {num_layers}")
        if even:  # a reshape keeps a stage-split leaf where it is; a gather would make GSPMD move it
            return x.reshape((len(bounds), lmax) + x.shape[1:])
        keep = mask.reshape(mask.shape + (1,) * (x.ndim - 1))
        return jnp.where(keep, jnp.take(x, index, axis=0), jnp.zeros((), x.dtype))

    return jax.tree.map(one, stacked), jnp.asarray(mask)


def from_stage_layout(staged: PyTree, stage_layers: Sequence[Sequence[int]]) -> PyTree:
    """Invert `to_stage_layout`: ``[S, Lmax, ...]`` leaves back to ``[L, ...]`` (padding dropped)."""
    bounds = _check_stage_layers(stage_layers)
    if all(b - a == bounds[0][1] - bounds[0][0] for a, b in bounds):
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), staged)
    stage_of = np.array([s for s, (a, b) in enumerate(bounds) for _ in range(b - a)], np.int32)
    row_of = np.array([r for a, b in bounds for r in range(b - a)], np.int32)
    return jax.tree.map(lambda x: x[stage_of, row_of], staged)


# ------------------------------------------------------------------------------ residual classification
def layer_residual_bytes(block: Callable[[PyTree, PyTree], PyTree], layer_params: PyTree, h: PyTree,
                         remat_policy: str | None = None) -> int:
    """Bytes the executor saves per layer per micro-batch (``remat_policy=None``: no checkpointing).

    Args may be arrays or ``jax.ShapeDtypeStruct``s of one layer's params and one micro-batch's
    activation; the count is what the pipeline's residual pools hold for that layer.
    """
    fn = block if remat_policy is None else jax.checkpoint(block, policy=checkpoint_policy(remat_policy))
    return classify(fn, layer_params, h).nbytes


# ------------------------------------------------------------------------------------------ stage kinds
def _segment_fn_key(kind: StageKind, segment: str) -> str | None:
    """The `layer_fns` key of a segment of ``kind``: None (plain), OFFLOAD, or its remat policy."""
    return None if segment == PLAIN else OFFLOAD if segment == OFFLOAD else kind.policy


def _segments(kind: StageKind) -> list[tuple[int, int, str | None]]:
    return [(lo, hi, _segment_fn_key(kind, seg)) for lo, hi, seg in kind.segments()]


def _take(tree: PyTree, i: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _put(tree: PyTree, i: jax.Array, value: PyTree) -> PyTree:
    return jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, 0), tree, value)


def _put_if(tree: PyTree, slot: jax.Array, value: PyTree) -> PyTree:
    """Write `value` at `slot` unless slot < 0 (the slot's old content is kept)."""
    k = jnp.maximum(slot, 0)
    return _put(tree, k, jax.tree.map(lambda v, old: jnp.where(slot >= 0, v, old), value, _take(tree, k)))


def _in_host(x: jax.Array, host: bool) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Host) if host else x


def _acc_dtype(dtype: Any) -> np.dtype:
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


# ------------------------------------------------------------------------------------------- executor
@dataclasses.dataclass(frozen=True)
class _Program:
    """Everything static about one pipeline call: sizes, stage kinds and the compiled tick table."""

    num_stages: int
    num_microbatches: int
    kinds: tuple[StageKind, ...]  # per stage
    unique: tuple[StageKind, ...]  # distinct kinds; branch k + 1 runs unique[k]
    ticks: sch.TickProgram
    table: np.ndarray  # ticks.table plus the _F_BRANCH / _B_BRANCH columns


def _make_program(stage_layers: Sequence[Sequence[int]], num_mb: int, schedule: str,
                  remat_layers: Sequence[int] | None, remat_policy: str | Sequence[str],
                  offload_layers: Sequence[int] | None = None) -> _Program:
    bounds = _check_stage_layers(stage_layers)
    S = len(bounds)
    sizes = [b - a for a, b in bounds]
    remat = [0] * S if remat_layers is None else [int(r) for r in remat_layers]
    policies = [remat_policy] * S if isinstance(remat_policy, str) else list(remat_policy)
    offload = [0] * S if offload_layers is None else [int(n) for n in offload_layers]
    if len(remat) != S or len(policies) != S or len(offload) != S:
        raise ValueError(f"remat_layers, remat_policy and offload_layers need one entry per stage ({S})")
    for s in range(S):
        if not 0 <= remat[s] <= sizes[s]:
            raise ValueError(f"stage {s}: remat_layers={remat[s]} is outside [0, {sizes[s]}]")
        if remat[s]:
            checkpoint_policy(policies[s])  # validate early, with a clear message
        if not 0 <= offload[s] <= sizes[s] - remat[s]:
            raise ValueError(f"stage {s}: offload_layers={offload[s]} is outside [0, {sizes[s] - remat[s]}] "
                             "(activation offload applies to the layers that are not checkpointed)")
    ticks = sch.tick_program(make_schedule(schedule, S, num_mb))
    kinds = tuple(stage_kind(s, S, sizes[s], remat[s], policies[s], offload[s]) for s in range(S))
    unique = tuple(dict.fromkeys(kinds))
    branch = np.array([unique.index(k) + 1 for k in kinds], np.int32)
    t = ticks.table
    extra = np.stack([np.where(t[..., sch.F_MB] >= 0, branch, 0),
                      np.where(t[..., sch.B_MB] >= 0, branch, 0)], -1)
    return _Program(S, num_mb, kinds, unique, ticks, np.concatenate([t, extra.astype(np.int32)], -1))


def pipeline_local(
    pre: Callable[[PyTree, PyTree], PyTree],
    block: Callable[[PyTree, PyTree], PyTree],
    post: Callable[[PyTree, PyTree, PyTree], jax.Array],
    pre_params: PyTree,
    stage_params: PyTree,
    post_params: PyTree,
    microbatches: PyTree,
    *,
    stage_layers: Sequence[Sequence[int]],
    schedule: str = "1f1b",
    remat_layers: Sequence[int] | None = None,
    remat_policy: str | Sequence[str] = "full",
    offload_layers: Sequence[int] | None = None,
    loss_scale: float | None = None,
    stage_axis: str = "stage",
) -> tuple[jax.Array, tuple[PyTree, PyTree, PyTree]]:
    """The schedule loop, for use inside a ``jax.shard_map`` that is manual over `stage_axis`.

    For callers that own the shard_map and the gradient synchronisation (ZeRO / MiCS): `block` may use
    collectives over the caller's other manual axes (e.g. per-layer all-gathers over ``shard``; their
    groups never span stages, so they are safe inside the varying branches). Arguments are as in
    `pipeline_value_and_grad`, except that `stage_params` leaves are this stage's ``[Lmax, ...]``.

    Returns:
        Unreduced per-device ``(loss, (acc_pre, acc_stage, acc_post))``: the scaled loss sum (nonzero on
        the last stage only), fp32 gradient sums of this device's micro-batch shares (``acc_pre``
        nonzero on the first stage only, ``acc_post`` on the last). Sum over `stage_axis`, then reduce
        over the data-parallel axes as the caller's ZeRO scheme requires.
    """
    counts = {leaf.shape[0] for leaf in jax.tree.leaves(microbatches)}
    if len(counts) != 1:
        raise ValueError(f"microbatches leaves must share the leading [G] axis, got sizes {sorted(counts)}")
    prog = _make_program(stage_layers, counts.pop(), schedule, remat_layers, remat_policy, offload_layers)
    S = prog.num_stages
    if lax.axis_size(stage_axis) != S:
        raise ValueError(f"axis {stage_axis!r} has {lax.axis_size(stage_axis)} devices, stage_layers gives "
                         f"{S} stages")
    lmax = max(k.num_layers for k in prog.kinds)
    for leaf in jax.tree.leaves(stage_params):
        if leaf.ndim < 1 or leaf.shape[0] < lmax:
            raise ValueError(f"local stage_params leaves must be [Lmax>={lmax}, ...], got {leaf.shape}")
    scale = 1.0 / prog.num_microbatches if loss_scale is None else float(loss_scale)
    vary = functools.partial(_vary, axes=tuple(jax.sharding.get_abstract_mesh().manual_axes))
    pre_p, stage_p, post_p, mbs = vary((pre_params, stage_params, post_params, microbatches))
    s_idx = lax.axis_index(stage_axis)
    h_aval = jax.eval_shape(pre, pre_p, _take(mbs, 0))
    zero_h = vary(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), h_aval))

    # Residual layout: classify each (un)checkpointed layer's vjp leaves once, then give every stage
    # kind its rows in pools keyed by (shape, dtype, varying axes).
    layer_fns: dict[str | None, Callable] = {None: block}
    w0 = jax.tree.map(lambda a: a[0], stage_p)
    for k in prog.unique:
        if k.policy is not None:
            layer_fns[k.policy] = jax.checkpoint(block, policy=checkpoint_policy(k.policy))
        if k.num_offload and OFFLOAD not in layer_fns:
            names = checkpoint_names(jax.make_jaxpr(block)(w0, zero_h))
            layer_fns[OFFLOAD] = jax.checkpoint(block, policy=offload_policy(names))
    residuals = {pol: classify(fn, w0, zero_h) for pol, fn in layer_fns.items()}
    pool_keys: list[tuple] = []
    layouts = {}  # kind -> (rows per micro-batch per pool, per segment [(leaf, pool, first row)])
    for k in prog.unique:
        rows: dict[int, int] = {}
        segs = []
        for lo, hi, pol in _segments(k):
            entries = []
            for j, key in zip(residuals[pol].stored, residuals[pol].avals):
                if key not in pool_keys:
                    pool_keys.append(key)
                p = pool_keys.index(key)
                entries.append((j, p, rows.get(p, 0)))
                rows[p] = rows.get(p, 0) + (hi - lo)
            segs.append(entries)
        layouts[k] = (rows, segs)
    slots = prog.ticks.residual_slots
    # Offloaded residuals keep the host memory space their policy gave them: their pools live on host.
    pools = tuple(_vary(_in_host(jnp.zeros((max(int(slots[s]) * layouts[prog.kinds[s]][0].get(p, 0)
                                                for s in range(S)), *shape), dt), host), vma)
                  for p, (shape, dt, vma, host) in enumerate(pool_keys))

    def run_forward(kind: StageKind, h: PyTree, pools: tuple, slot: jax.Array) -> tuple[PyTree, tuple]:
        rows, segs = layouts[kind]
        for (lo, hi, pol), entries in zip(_segments(kind), segs):
            fn, res = layer_fns[pol], residuals[pol]

            def layer(carry, xs, fn=fn, res=res, entries=entries):
                h, pools = carry
                w, li = xs
                h, vjp = jax.vjp(fn, w, h)
                pools = list(pools)
                for (_, p, base), leaf in zip(entries, res.take(vjp)):  # in place: pools only pass two-way conds
                    row = slot * rows[p] + base + li
                    pools[p] = lax.dynamic_update_index_in_dim(pools[p], leaf, row, 0)
                return (h, tuple(pools)), None

            ws = jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], stage_p)
            (h, pools), _ = lax.scan(layer, (h, pools), (ws, jnp.arange(hi - lo)))
        return h, pools

    def run_backward(kind: StageKind, ct: PyTree, acc: PyTree, pools: tuple, slot: jax.Array
                     ) -> tuple[PyTree, PyTree]:
        rows, segs = layouts[kind]
        for (lo, hi, pol), entries in reversed(list(zip(_segments(kind), segs))):
            fn, res = layer_fns[pol], residuals[pol]

            def layer(carry, xs, fn=fn, res=res, entries=entries, lo=lo):
                ct, acc = carry
                w, li = xs
                # A fresh vjp at a zero activation supplies the treedef and the weight-only leaves; its
                # activation-dependent part is dead code, replaced by the stored leaves.
                stored = [lax.dynamic_index_in_dim(pools[p], slot * rows[p] + base + li, 0, keepdims=False)
                          for _, p, base in entries]
                g_w, ct = restore_vjp(jax.vjp(fn, w, zero_h)[1], res, stored)(ct)
                row = lo + li
                acc = _put(acc, row, jax.tree.map(lambda a, g: a + g.astype(a.dtype), _take(acc, row), g_w))
                return (ct, acc), None

            ws = jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], stage_p)
            (ct, acc), _ = lax.scan(layer, (ct, acc), (ws, jnp.arange(hi - lo)), reverse=True)
        return ct, acc

    def f_branch(kind: StageKind, r: jax.Array, y: PyTree, st: dict) -> tuple[PyTree, dict]:
        mb = _take(mbs, r[sch.F_MB])
        h = pre(pre_p, mb) if kind.first else _take(st["xq"], r[sch.F_XSLOT])
        h, pools = run_forward(kind, h, st["pools"], r[sch.F_RSLOT])
        st = dict(st, pools=pools)
        if not kind.last:
            return h, st
        # Last stage: loss and d(loss)/dh now, so the head's residuals never outlive the tick.
        loss, (g_post, dh) = jax.value_and_grad(post, argnums=(0, 1))(post_p, h, mb)
        st["loss"] = st["loss"] + scale * loss.astype(jnp.float32)
        st["acc_post"] = jax.tree.map(lambda a, g: a + scale * g.astype(a.dtype), st["acc_post"], g_post)
        st["cq"] = _put(st["cq"], r[sch.F_SEED], jax.tree.map(lambda d: scale * d, dh))
        return y, st

    def b_branch(kind: StageKind, r: jax.Array, dx: PyTree, st: dict) -> tuple[PyTree, dict]:
        ct = _take(st["cq"], r[sch.B_CSLOT])
        ct, acc = run_backward(kind, ct, st["acc_stage"], st["pools"], r[sch.B_RSLOT])
        st = dict(st, acc_stage=acc)
        if not kind.first:
            return ct, st
        mb = _take(mbs, r[sch.B_MB])
        (g_pre,) = jax.vjp(lambda p: pre(p, mb), pre_p)[1](ct)  # recompute pre: nothing of it is kept
        st["acc_pre"] = jax.tree.map(lambda a, g: a + g.astype(a.dtype), st["acc_pre"], g_pre)
        return dx, st

    def dispatch(branch_fn: Callable, index: jax.Array, r: jax.Array, out: PyTree, st: dict
                 ) -> tuple[PyTree, dict]:
        # One two-way cond per stage kind with the pass-through as the false branch, not one lax.switch:
        # XLA:CPU then updates the carried buffers in place (a >2-way switch copies every pool per tick).
        for k, kind in enumerate(prog.unique, start=1):
            run = functools.partial(branch_fn, kind, r)
            out, st = lax.cond(index == k, run, lambda o, s: (o, s), out, st)
        return out, st

    fwd_pairs = [(i, i + 1) for i in range(S - 1)]
    bwd_pairs = [(i + 1, i) for i in range(S - 1)]

    def tick(st: dict, rows: jax.Array) -> tuple[dict, None]:
        r = lax.dynamic_index_in_dim(rows, s_idx, 0, keepdims=False)
        y, st = dispatch(f_branch, r[_F_BRANCH], r, zero_h, st)
        if S > 1:  # unconditional: a collective inside a device-varying branch deadlocks
            st["xq"] = _put_if(st["xq"], r[sch.RX_SLOT], lax.ppermute(y, stage_axis, fwd_pairs))
        dx, st = dispatch(b_branch, r[_B_BRANCH], r, zero_h, st)
        if S > 1:
            st["cq"] = _put_if(st["cq"], r[sch.RC_SLOT], lax.ppermute(dx, stage_axis, bwd_pairs))
        return st, None

    def queue(depth: int) -> PyTree:
        return vary(jax.tree.map(lambda a: jnp.zeros((depth, *a.shape), a.dtype), h_aval))

    def accumulator(tree: PyTree) -> PyTree:
        return vary(jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), tree))

    state = dict(xq=queue(prog.ticks.input_slots), cq=queue(prog.ticks.cotangent_slots), pools=pools,
                 acc_pre=accumulator(pre_p), acc_stage=accumulator(stage_p), acc_post=accumulator(post_p),
                 loss=vary(jnp.zeros((), jnp.float32)))
    state, _ = lax.scan(tick, state, jnp.asarray(prog.table))
    return state["loss"], (state["acc_pre"], state["acc_stage"], state["acc_post"])


def pipeline_value_and_grad(
    pre: Callable[[PyTree, PyTree], PyTree],
    block: Callable[[PyTree, PyTree], PyTree],
    post: Callable[[PyTree, PyTree, PyTree], jax.Array],
    pre_params: PyTree,
    stage_params: PyTree,
    post_params: PyTree,
    microbatches: PyTree,
    *,
    mesh: Mesh,
    stage_layers: Sequence[Sequence[int]],
    schedule: str = "1f1b",
    remat_layers: Sequence[int] | None = None,
    remat_policy: str | Sequence[str] = "full",
    offload_layers: Sequence[int] | None = None,
    loss_scale: float | None = None,
    dp_axes: Sequence[str] = (),
    stage_axis: str = "stage",
) -> tuple[jax.Array, tuple[PyTree, PyTree, PyTree]]:
    """Mean micro-batch loss and its gradients, run as a pipeline over the `stage_axis` of `mesh`.

    Traceable (call it inside ``jax.jit``). Equivalent to ``jax.value_and_grad`` of
    ``loss_scale * sum_i post(post_p, blocks(pre(pre_p, mb_i)), mb_i)`` with the layers of
    ``from_stage_layout(stage_params)``.

    Args:
        pre: ``pre(pre_params, mb) -> h``, run by the first stage.
        block: ``block(layer_params, h) -> h``, one layer; `layer_params` is one ``[Lmax]`` slice.
        post: ``post(post_params, h, mb) -> scalar`` loss of one micro-batch, run by the last stage.
        pre_params: embedding etc., replicated over `stage_axis`.
        stage_params: stacked layers, leaves ``[S, Lmax, ...]`` sharded ``P(stage_axis)``
            (`to_stage_layout`).
        post_params: final norm / head, replicated over `stage_axis`.
        microbatches: leaves ``[G, ...]``; leaf dim 1 is the batch (split over `dp_axes` if given).
        mesh: the device mesh; `stage_axis` must have ``S`` devices.
        stage_layers: ``[a_s, b_s)`` per stage (contiguous from 0; uneven allowed).
        schedule: "1f1b" (default), "gpipe" or "1f1b-eager" (see `mistjax.core.schedules`).
        remat_layers: per stage, how many of its *last* layers are checkpointed (default none).
        remat_policy: per stage (or one for all): "full" | "dots" | "names:a,b".
        offload_layers: per stage, how many of its *first* layers offload their ``checkpoint_name``-tagged
            activations to host memory (and recompute the rest in the backward), as
            `runtime.remat.offload_policy` does without a pipeline (default none).
        loss_scale: weight of each micro-batch loss (default ``1 / G``).
        dp_axes: mesh axes made manual as data parallelism (batch split, loss and grads ``pmean``'ed
            once after the loop) instead of being left to GSPMD; see the module docstring.
        stage_axis: name of the pipeline axis.

    Returns:
        ``(loss, (g_pre, g_stage, g_post))``; `g_stage` is ``[S, Lmax, ...]`` sharded like
        `stage_params`, with exact zeros in padding rows.
    """
    S = len(_check_stage_layers(stage_layers))
    if mesh.shape.get(stage_axis) != S:
        raise ValueError(f"mesh axis {stage_axis!r} has {mesh.shape.get(stage_axis)} devices but "
                         f"stage_layers gives {S} stages")
    dp_axes = tuple(dp_axes)
    for ax in dp_axes:
        if ax not in mesh.shape or ax == stage_axis:
            raise ValueError(f"dp_axes entry {ax!r} is not a non-stage axis of the mesh {dict(mesh.shape)}")
    for leaf in jax.tree.leaves(stage_params):
        if leaf.ndim < 2 or leaf.shape[0] != S:
            raise ValueError(f"stage_params leaves must be [S={S}, Lmax, ...], got {leaf.shape}; build them "
                             "with to_stage_layout")
    _make_program(stage_layers, 1, schedule, remat_layers, remat_policy, offload_layers)  # validate early

    def body(pre_p: PyTree, stage_p: PyTree, post_p: PyTree, mbs: PyTree):
        loss, (g_pre, g_stage, g_post) = pipeline_local(
            pre, block, post, pre_p, jax.tree.map(lambda a: a[0], stage_p), post_p, mbs,
            stage_layers=stage_layers, schedule=schedule, remat_layers=remat_layers,
            remat_policy=remat_policy, offload_layers=offload_layers, loss_scale=loss_scale,
            stage_axis=stage_axis)
        # Embedding / head grads live on one stage each; the loss on the last.
        loss, g_pre, g_post = lax.psum((loss, g_pre, g_post), stage_axis)
        if dp_axes:  # one reduction per step, after the loop
            loss, g_pre, g_stage, g_post = lax.pmean((loss, g_pre, g_stage, g_post), dp_axes)
        cast = lambda g, p: jax.tree.map(lambda a, b: a.astype(b.dtype), g, p)
        g_stage = jax.tree.map(lambda g, p: g.astype(p.dtype)[None], g_stage, stage_p)
        return loss, (cast(g_pre, pre_p), g_stage, cast(g_post, post_p))

    mb_spec = P(None, dp_axes if len(dp_axes) > 1 else dp_axes[0]) if dp_axes else P()
    run = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(stage_axis), P(), mb_spec),
                        out_specs=(P(), (P(), P(stage_axis), P())),
                        axis_names=frozenset((stage_axis, *dp_axes)), check_vma=True)
    return run(pre_params, stage_params, post_params, microbatches)


__all__ = ["from_stage_layout", "layer_residual_bytes", "pipeline_local", "pipeline_value_and_grad",
           "stage_kind", "to_stage_layout"]
