"""The loss-and-gradient computation a plan prescribes, as one shard_map over the data-parallel axes:
micro-batches, the plan's layer loop, and gradient synchronisation with exactly the plan's ZeRO /
MiCS collectives (which ones, and when: docs/internals.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from mistjax.core.context import ContextForm
from mistjax.core.execution import (
    Capabilities,
    ExecutionPlan,
    StageExecution,
    StageLeaf,
    host_accumulators,
    is_batch_leaf,
    lower_stage,
)
from mistjax.core.layout import CONTEXT_AXIS, DP_AXES, PARAM, SHARD_AXES, LeafLayout, shard_split
from mistjax.core.plan import Plan, PlanError, StagePlan
from mistjax.core.types import LossFn, PyTree
from mistjax.runtime.accumulate import PartialGrad, SliceGrad
from mistjax.runtime.context_block import context_parallel_block
from mistjax.runtime.remat import Body, LayerLoop, LoopSinks, as_layer_loop
from mistjax.runtime.tensor import per_tensor_shard, tensor_parallel_block
from mistjax.trace.split import BlockFn, Operand, TracedLoss, checkpoint_names, evaluate, part_usage, trace_loss

MANUAL_AXES = frozenset({"stage", "replica", *SHARD_AXES})


def _widen_for_reduction(x: jax.Array) -> DTypeLike | None:
    """The dtype a reduction collective of ``x`` runs in: fp32 for a 16-bit float on XLA:CPU (inside a partly
    manual shard_map it fails to compile 16-bit psum / psum_scatter, and it computes them in fp32
    anyway); None elsewhere (GPUs and TPUs reduce 16-bit values natively)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    cpu = device is not None and device.platform == "cpu"
    return jnp.float32 if cpu and x.dtype in (jnp.bfloat16, jnp.float16) else None


def psum(x: jax.Array, axis: str | tuple[str, ...]) -> jax.Array:
    """``lax.psum`` (16-bit floats through fp32 on XLA:CPU, see `_widen_for_reduction`)."""
    wide = _widen_for_reduction(x)
    return lax.psum(x, axis) if wide is None else lax.psum(x.astype(wide), axis).astype(x.dtype)


def psum_scatter(x: jax.Array, axis: str, dim: int) -> jax.Array:
    """Tiled ``lax.psum_scatter`` (16-bit floats through fp32 on XLA:CPU, see `_widen_for_reduction`)."""
    wide = _widen_for_reduction(x)
    y = x if wide is None else x.astype(wide)
    y = lax.psum_scatter(y, axis, scatter_dimension=dim, tiled=True)
    return y if wide is None else y.astype(x.dtype)


def _all_gather(x: jax.Array, axis: str, dim: int) -> jax.Array:
    """Tiled ``lax.all_gather``; on XLA:CPU a 16-bit float is gathered in fp32, so that the reduce-scatter
    autodiff transposes it into compiles there (see `_widen_for_reduction`)."""
    wide = _widen_for_reduction(x)
    y = x if wide is None else x.astype(wide)
    y = lax.all_gather(y, axis, axis=dim, tiled=True)
    return y if wide is None else y.astype(x.dtype)


def bucketed_psum(values: Sequence[jax.Array], axis: str | tuple[str, ...]) -> list[jax.Array]:
    """All-reduce several arrays as one flat bucket per dtype (one collective, not one per leaf)."""
    out: list[jax.Array | None] = [None] * len(values)
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, v in enumerate(values):
        by_dtype.setdefault(v.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = psum(jnp.concatenate([values[i].reshape(-1) for i in idx]), axis)
        offset = 0
        for i in idx:
            n = values[i].size
            out[i] = flat[offset: offset + n].reshape(values[i].shape)
            offset += n
    return out  # type: ignore[return-value]


def _live_shard_axes() -> tuple[str, ...]:
    """The parts of the partition group with more than one device, inter-node first; call inside
    the shard_map. Skipping a size-1 part keeps a group inside one node on the flat collective."""
    return tuple(a for a in SHARD_AXES if lax.axis_size(a) > 1) or (SHARD_AXES[-1],)


def shard_all_gather(x: jax.Array, axis: int) -> jax.Array:
    """Tiled all-gather of `x` along `axis` over the partition group, hierarchical across nodes.

    Equals ``lax.all_gather(x, SHARD_SPEC, axis=axis, tiled=True)``. Across m > 1 nodes it runs in
    MiCS's order: first m-way among the devices of equal local rank, so each moves only its own
    1/p over the slow links, then L-way inside the node on the result. The local-major layout
    (`SHARD_SPEC`) makes the inter-node result a contiguous block, so the phases chain with no
    re-layout; autodiff transposes this into `shard_psum_scatter`'s order.
    """
    for name in _live_shard_axes():
        x = _all_gather(x, name, axis)
    return x


def shard_psum_scatter(x: jax.Array, dim: int) -> jax.Array:
    """Tiled reduce-scatter of `x` along `dim` over the partition group, hierarchical across nodes.

    Equals ``lax.psum_scatter(x, SHARD_SPEC, scatter_dimension=dim, tiled=True)``. Across nodes:
    first L-way inside the node on the whole buffer (fast links), then m-way among equal local
    ranks on the 1/L block, so only that block crosses the network — the mirror of the gather.
    """
    for name in reversed(_live_shard_axes()):
        x = psum_scatter(x, name, dim)
    return x


def regather_updated_params(leaves: Sequence[jax.Array], inputs: Sequence[jax.Array | None],
                            layouts: Sequence[LeafLayout],
                            plan: Plan, mesh: Mesh) -> list[jax.Array]:
    """All-gather the updated ZeRO-1/2 parameters from their shards, in their storage dtype.

    Under ZeRO-1/2 the optimizer updates each parameter on its 1/p shard (its gradient and state are
    sharded) and the stored parameter is whole, so the step ends with an all-gather of every updated
    parameter. The updated value is pinned to the sharded layout first, so the update (and, with master
    weights, the cast to the 16-bit storage dtype) runs on the shard and the gather moves storage-dtype
    bytes, as Megatron-LM's distributed optimizer does (left alone, GSPMD gathered the fp32 value before
    the cast). When the group spans nodes, the gather is `shard_all_gather`'s hierarchical one.
    Leaves the step did not change (same object as its input) and host-resident ones are left to XLA.
    """
    if plan.stages[0].zero_stage not in (1, 2):
        return list(leaves)
    hierarchical = mesh.shape[SHARD_AXES[0]] > 1
    out = list(leaves)
    for i, (x, before, lay) in enumerate(zip(leaves, inputs, layouts)):
        if lay.role != PARAM or lay.sharded or lay.shard_dim is None or lay.host or x is before:
            continue
        sharded = dataclasses.replace(lay, sharded=True).spec()
        x = lax.with_sharding_constraint(x, NamedSharding(mesh, sharded))
        if hierarchical:
            # Manual over every mesh axis with the full storage spec in and the same spec minus the
            # shard split out: only the partition-group gather moves data. (Left auto, GSPMD gathered
            # tensor-split and stage-split leaves across `tensor` / `stage` around the map.)
            x = jax.shard_map(lambda v, d=lay.shard_dim: shard_all_gather(v, d), mesh=mesh, in_specs=sharded,
                              out_specs=lay.spec(), check_vma=False)(x)
        out[i] = x
    return out


_V = TypeVar("_V")


def _get(d: dict[int, _V], i: int | None) -> _V | None:
    """``d[i]`` if present; None for an operand that is no parameter leaf (``i`` None) or has no entry."""
    return None if i is None else d.get(i)


def _shard_dim(spec: StageLeaf) -> int:
    """The dim a ZeRO-sharded leaf is split on (`LeafLayout.shard_dim`, set for every sharded leaf)."""
    dim = spec.layout.shard_dim
    assert dim is not None, "a sharded leaf without a shard dim"
    return dim


def make_fetch(spec: StageLeaf, stacked_slice: bool) -> Callable[[jax.Array], jax.Array] | None:
    """Turn a stored (maybe host-resident, maybe ZeRO-3-sharded) weight into its compute copy."""
    host, sharded = spec.layout.host, spec.weights_sharded
    if not (host or sharded):
        return None
    axis = _shard_dim(spec) - (1 if stacked_slice else 0) if sharded else 0
    # Gather each device's tensor shard only (else GSPMD makes the operand whole over `tensor` first).
    gather = per_tensor_shard(lambda v: shard_all_gather(v, axis),
                              [d - (1 if stacked_slice else 0) for d in spec.layout.tensor_dims])

    def fetch(x: jax.Array) -> jax.Array:
        if host:
            x = jax.device_put(x, jax.memory.Space.Device)
        return gather(x) if sharded else x

    return fetch


def to_host(x: jax.Array, host: bool) -> jax.Array:
    """`x` moved to host memory where `host` (an offloaded accumulator or weight), else as it is."""
    return jax.device_put(x, jax.memory.Space.Host) if host else x


def to_device(x: jax.Array, host: bool) -> jax.Array:
    """`x` moved to device memory where `host` says it lives on the host, else as it is."""
    return jax.device_put(x, jax.memory.Space.Device) if host else x


def psum_live(x: PyTree, axes: tuple[str, ...], mesh: Mesh) -> PyTree:
    """`lax.psum` over the axes of `axes` that have more than one device (XLA rejects the others
    when every manual axis is trivial)."""
    live = tuple(a for a in axes if mesh.shape[a] > 1)
    return jax.tree.map(lambda v: psum(v, live), x) if live else x


def grad_dtype_of(plan: Plan, g: jax.Array) -> jax.Array:
    """``g`` in the dtype the plan accumulates and reduces gradients in (its own without `Plan.grad_dtype`)."""
    return g if plan.grad_dtype is None else g.astype(jnp.dtype(plan.grad_dtype))


def split_microbatches(x: jax.Array, g: int) -> jax.Array:
    """[B_local, ...] -> [G, B_local / G, ...] without moving rows across devices."""
    if x.shape[0] % g:
        raise PlanError(f"a local batch of {x.shape[0]} rows does not split into {g} micro-batches")
    return x.reshape((x.shape[0] // g, g) + x.shape[1:]).swapaxes(0, 1)


def _seq_axes(tp: int, cp: int) -> tuple[str, ...]:
    """The mesh axes the hidden state's sequence dim is split over between layers: ``context`` (context
    parallelism) major, then ``tensor`` (Megatron's sequence parallelism)."""
    return tuple(a for a, n in ((CONTEXT_AXIS, cp), ("tensor", tp)) if n > 1)


def sequence_axes(shape: tuple[int, ...], tp: int, cp: int) -> tuple[str, ...] | None:
    """The mesh axes a hidden state ``[b, s, d]`` of ``shape`` is split over along its sequence between layers
    (`_seq_axes`), or None for a value that is not one or does not split ``tp * cp`` ways (left whole)."""
    axes = _seq_axes(tp, cp)
    return axes if axes and len(shape) == 3 and shape[1] % (tp * cp) == 0 else None


def _sp_constraint(tp: int, cp: int = 1) -> Callable[[jax.Array], jax.Array]:
    """Sequence parallelism between layers: the hidden state split along the sequence over ``context`` and
    ``tensor``."""

    def constrain(c: jax.Array) -> jax.Array:
        if (axes := sequence_axes(c.shape, tp, cp)) is not None:
            return lax.with_sharding_constraint(c, P(None, axes, None))
        return c

    return constrain


def _sequence_split(tp: int, cp: int = 1) -> Callable[[jax.Array], jax.Array]:
    """The hidden state entering the layer loop split along the sequence, with Megatron's transpose
    (``scatter_to_sequence_parallel_region``): the backward all-gathers the cotangent once over ``tensor``,
    whole for every consumer before the layers (still split over ``context``, where the whole model runs
    on its part of the sequence).

    A plain constraint's transpose leaves the cotangent split, and GSPMD reshards it per consumer: a
    learned position table's gradient is padded from the split rows, so its accumulator and Adam update
    end up split over ``tensor`` along the table's rows (collective-permutes every micro-batch, all-gathers
    of the gradient and the moments after the loop), besides the gather the embedding's scatter-add needs.
    """
    split = _sp_constraint(tp, cp)
    outside = _sp_constraint(1, cp)

    @jax.custom_vjp
    def enter(c: jax.Array) -> jax.Array:
        return split(c)

    def fwd(c: jax.Array) -> tuple[jax.Array, None]:
        return split(c), None

    def bwd(_: None, ct: jax.Array) -> tuple[jax.Array]:
        if cp > 1:
            return (outside(ct),)
        return (lax.with_sharding_constraint(ct, P(*([None] * ct.ndim))),)

    enter.defvjp(fwd, bwd)

    def constrain(c: jax.Array) -> jax.Array:
        if jnp.ndim(c) == 3 and c.shape[1] % (tp * cp) == 0 and jnp.issubdtype(c.dtype, jnp.inexact):
            return enter(c)
        return c

    return constrain


def _slice_grad(spec: StageLeaf, plan: Plan, partial: bool = False) -> SliceGrad:
    """How one layer's cotangent of a stored weight slice enters the accumulator (see `_microbatch_grad`):
    `_finish_one` on a slice (the layer dim dropped); with `partial`, on the slice's per-context-rank partials
    (`accumulate.PartialGrad`: one leading dim of cp in place of the layer dim)."""
    if partial:
        return PartialGrad(lambda ct: _finish_one(ct, spec, plan), plan.cp)
    return lambda ct: _finish_one(ct, spec, plan, layer_slice=True)


def partial_leaves(traced: TracedLoss, execution: StageExecution, specs: Sequence[StageLeaf], plan: Plan
                   ) -> frozenset[int]:
    """The leaves whose gradients are accumulated as per-context-rank partial sums and reduced over `context`
    once per step (`runtime.context_partial`): the in-loop accumulated layer weights (G > 1) of a plan with
    cp > 1 and no TP whose layer runs the context-parallel attention block, read in place (not fetched: a
    ZeRO-3 gather or a host copy). Empty otherwise: GSPMD reduces those over `context` per micro-batch."""
    if plan.cp <= 1 or plan.tp > 1 or plan.grad_accum <= 1 or traced.stack is None or traced.groups is not None:
        return frozenset()
    if context_parallel_block(traced, ContextForm(plan.cp_form), plan.cp) is None:
        return frozenset()
    return frozenset(i for i in execution.in_loop if not specs[i].fetched)


def stage_layer_loop(traced: TracedLoss, execution: StageExecution, stage: StagePlan, specs: Sequence[StageLeaf],
                     index: Callable[[int], int], plan: Plan, *, refetch_plain: bool = True,
                     partial: frozenset[int] = frozenset()) -> LayerLoop:
    """The layer loop of one stage, as its `StageExecution` says: per-layer fetches, remat and activation
    offload per scan, and how each layer's weight cotangent enters its accumulator; the single-stage step and
    the pipeline's stage programs (`runtime.mpmd_stage`) both run it.

    Args:
      traced: the loss, traced (its layer stack gives the scanned operands).
      specs: the stage's gradient specs; `index` maps a traced parameter index to its position in `specs`.
      partial: the positions in `specs` accumulated as per-context-rank partials (`partial_leaves`).
    """
    st = traced.require_stack()
    stacked = traced.groups is None  # an unrolled stack's operands are its real per-layer leaves (no layer dim)
    return LayerLoop(
        scans=execution.scans, policy=stage.remat_policy,
        gather=tuple(None if i is None else make_fetch(specs[index(i)], stacked) for i in st.xs_leaf),
        carry_constraint=_sp_constraint(plan.tp, plan.cp), offload_names=tuple(checkpoint_names(st.body)),
        refetch_plain=refetch_plain,
        prepare=tuple(None if i is None or not stacked else _slice_grad(specs[index(i)], plan, index(i) in partial)
                      for i in st.xs_leaf))


def mesh_capabilities(mesh: Mesh | None, tp_overlap: bool = False) -> Capabilities:
    """The `Capabilities` of the platform a step for `mesh` compiles for, read from the mesh's devices, not
    ``jax.devices()``: a deviceless XLA:GPU compile (`validate.gpu_aot`) runs in a CPU process and must build
    the program the GPUs would run. No mesh (an abstract trace): as on a GPU. ``tp_overlap``: the plan's."""
    if mesh is None:
        return Capabilities(True, tp_overlap)
    return Capabilities.of_platform(mesh.devices.flat[0].platform, tp_overlap)


def stage_execution(traced: TracedLoss, specs: Sequence[StageLeaf], acc_host: Sequence[bool],
                    index: Callable[[int], int | None], *, stage: StagePlan, grad_accum: int, mesh: Mesh,
                    pipelined: bool) -> StageExecution:
    """Lower one stage to its `StageExecution` (`core.execution.lower_stage`) from the traced loss.

    Args:
      specs: the stage's gradient specs; `acc_host`: per spec, its accumulator is on host.
      index: maps a traced parameter index to its position in `specs` (None: not held by this stage).
    """
    eligible = loop_eligible_leaves(traced)
    st = traced.stack
    scanned = set() if st is None else {index(traced.real_index(i)) for i in st.xs_leaf if i is not None}
    held = {index(i): i for i in range(traced.num_real_params) if index(i) is not None}
    facts = [s._replace(loop_eligible=held.get(j) in eligible, in_stack=j in scanned,
                        host_accumulator=bool(acc_host[j])) for j, s in enumerate(specs)]
    dp = math.prod(mesh.shape[a] for a in DP_AXES)
    return lower_stage(facts, num_layers=stage.num_layers, remat_layers=stage.remat_layers,
                       offload_layers=stage.offloaded_layers, grad_accum=grad_accum, dp=dp,
                       group=_shard_group_size(mesh), pipelined=pipelined, caps=mesh_capabilities(mesh))


def loop_eligible_leaves(traced: TracedLoss) -> frozenset[int]:
    """The stacked weights of a scanned stack read by the layer loop only, of a float dtype: those whose
    gradient can be handled per layer inside the backward layer loop (`core.execution.StageLeaf`)."""
    st = traced.stack
    if st is None or traced.groups is not None:
        return frozenset()
    usage = part_usage(traced)
    leaves = [i for i in st.xs_leaf if i is not None]
    avals = traced.closed.jaxpr.invars
    return frozenset(i for i in leaves if leaves.count(i) == 1 and i not in usage.pre
                     and i not in usage.post and jnp.issubdtype(avals[i].aval.dtype, jnp.inexact))


def _shard_group_size(mesh: Mesh) -> int:
    """Devices in one ZeRO / MiCS partition group (the extents of `SHARD_AXES`)."""
    return math.prod(mesh.shape[a] for a in SHARD_AXES)


def row_sync(spec: StageLeaf, mesh: Mesh) -> SliceGrad:
    """The collective that synchronises one layer's summed gradient row (the layer dim dropped) of a leaf the
    `StageExecution` syncs in the loop: what `finish_grads` does to the whole leaf at the end of the step
    (ZeRO-1 reduce-scatter over the partition group, MiCS hop 1; else the all-reduce over the DP axes)."""
    if spec.layout.shard_dim is not None and spec.zero == 1:
        return lambda row: scatter_grad(row, spec, layer_slice=True)
    return lambda row: psum_live(row, DP_AXES, mesh)


# ``(params, micro_batch, accumulators or None, sync) -> (loss, aux, grads)``: with accumulators, the
# entries of the execution's `in_loop` leaves are the updated accumulators, the others this micro-batch's
# gradients; with ``sync`` (G == 1, no accumulators) the entries of its `synced` leaves are synchronised per layer.
# The layer loop's fed buffers by flat leaf index: (accumulators, synchronised result buffers).
Box = tuple[dict[int, jax.Array], dict[int, jax.Array]]
MicrobatchGrad = Callable[..., tuple[jax.Array, PyTree, list[jax.Array]]]


@dataclass(frozen=True)
class _Sinks:
    """What the layer loop of one micro-batch feeds, by flat leaf index: accumulators (`acc`), result
    buffers of the synchronised rows of leaves without an accumulator (`out`, G == 1), the per-row
    collectives (`finish`, only on the synchronising pass), and whether they are issued one backward
    iteration late (`defer`: `StageExecution.defer_sync`)."""

    acc: dict[int, jax.Array]
    out: dict[int, jax.Array]
    finish: dict[int, SliceGrad] | None
    defer: bool = False


def _synced_shape(shape: Sequence[int], spec: StageLeaf, mesh: Mesh) -> tuple[int, ...]:
    """The shape of a leaf's synchronised gradient: the partition group's shard under ZeRO-1."""
    out = list(shape)
    if spec.zero == 1 and spec.layout.shard_dim is not None:
        out[spec.layout.shard_dim] //= _shard_group_size(mesh)
    return tuple(out)


def _sinks(p_local: list[jax.Array], acc: list[jax.Array] | None, execution: StageExecution,
           specs: Sequence[StageLeaf], plan: Plan, mesh: Mesh, sync: bool) -> _Sinks:
    """The buffers one micro-batch's layer loop feeds (see `_Sinks`): the accumulators, or on the
    synchronising pass (G == 1, no accumulator) zeros of the synchronised shape, so that ZeRO-1 never
    holds the layers' whole gradient."""
    if not sync:
        return _Sinks({i: acc[i] for i in execution.in_loop} if acc is not None else {}, {}, None)
    outs = {i: jnp.zeros(_synced_shape(p_local[i].shape, specs[i], mesh), grad_dtype_of(plan, p_local[i]).dtype)
            for i in execution.synced}
    return _Sinks({}, outs, {i: row_sync(specs[i], mesh) for i in execution.synced}, defer=execution.defer_sync)


def _single_stage_loop(traced: TracedLoss, execution: StageExecution, specs: Sequence[StageLeaf], plan: Plan,
                       partial: frozenset[int] = frozenset()) -> LayerLoop | None:
    """The step's layer loop, entered through the sequence split under tensor parallelism; None for a loss
    without a layer stack (an error if the plan needs one)."""
    stage = plan.stages[0]
    if traced.stack is None:
        if stage.remat_layers > 0 or stage.offload_acts > 0 or any(i in execution.fetched and s.layout.stacked
                                                                     for i, s in enumerate(specs)):
            traced.require_stack()
        return None
    plan.check_layers(traced.stack.num_layers)
    loop = stage_layer_loop(traced, execution, stage, specs, traced.real_index, plan, partial=partial)
    return dataclasses.replace(loop, enter=_sequence_split(plan.tp, plan.cp)) if plan.tp * plan.cp > 1 else loop


def layer_block(fun: LossFn, traced: TracedLoss, layouts: Sequence[LeafLayout], plan: Plan,
                is_batch: Sequence[bool]) -> BlockFn | None:
    """The block that runs one layer under ``plan`` (the single-stage step and every pipeline stage alike):
    Megatron's TP layouts (under cp > 1 with the sequence split over `context` and the context-parallel
    attention inside), with tp = 1 and cp > 1 the context-parallel attention alone, else None (plain)."""
    form = ContextForm(plan.cp_form)
    block = tensor_parallel_block(fun, traced, layouts=layouts, tp=plan.tp, batch=is_batch, cp=plan.cp, form=form,
                                  overlap=plan.tp_overlap)
    if plan.cp > 1 and block is None:
        block = context_parallel_block(traced, form, plan.cp)
    return block


def _microbatch_grad(fun: LossFn, has_aux: bool, traced: TracedLoss, specs: Sequence[StageLeaf],
                     layouts: Sequence[LeafLayout], plan: Plan, is_batch: Sequence[bool],
                     execution: StageExecution, mesh: Mesh, partial: frozenset[int] = frozenset()) -> MicrobatchGrad:
    """One micro-batch's loss, aux and gradients, run as the plan says.

    Gradients of the execution's `in_loop` leaves are added into their accumulators inside the backward layer
    loop (`runtime.accumulate`): those leaves are not differentiated; the accumulators are, with their own
    value as the cotangent seed of the loop's accumulator output, so their cotangent is the sum. On the
    synchronising pass (``sync``) the `synced` leaves' summed rows are all-reduced / reduce-scattered
    there too, each in the iteration that produced it, or one iteration later (`StageExecution.defer_sync`).
    """
    tp_block = layer_block(fun, traced, layouts, plan, is_batch)
    layer_loop = _single_stage_loop(traced, execution, specs, plan, partial)
    xs_leaf = traced.stack.xs_leaf if traced.stack is not None else ()

    def read_param(i: int, v: Operand) -> Operand:
        # `evaluate` asks only for leaves outside the layer stack (``i`` indexes the real leaves): arrays.
        fetch = make_fetch(specs[i], False)
        return v if fetch is None else fetch(cast(jax.Array, v))

    def loss(pl: list[jax.Array], rl: list[jax.Array], sinks: _Sinks | None = None) -> tuple[jax.Array, PyTree, Box]:
        loop: LayerLoop | Callable[..., tuple[list[jax.Array], list[jax.Array]]] | None = layer_loop
        box: Box = ({}, {})
        if sinks is not None:
            assert layer_loop is not None  # (in-loop sinks exist only for a stage with a layer loop)
            run = layer_loop.run

            def sinking(body: Body, consts: list[jax.Array], carry: list[jax.Array], xs: list[jax.Array]
                        ) -> tuple[list[jax.Array], list[jax.Array]]:
                fin = None if sinks.finish is None else [_get(sinks.finish, i) for i in xs_leaf]
                out = run(body, consts, carry, xs, LoopSinks(
                    [_get(sinks.acc, i) for i in xs_leaf], [_get(sinks.out, i) for i in xs_leaf], fin, sinks.defer))
                assert out.accs is not None  # (the loop returns the accumulators it was given)
                for b, bufs in zip(box, (out.accs, out.outs or ())):
                    b.update((i, a) for i, a in zip(xs_leaf, bufs) if i is not None and a is not None)
                return out.carry, out.ys

            loop = sinking
        outs = evaluate(traced, pl, rl, layer_loop=None if loop is None else as_layer_loop(loop),
                        read_param=read_param, block=tp_block)
        out = jax.tree.unflatten(traced.out_tree, outs)
        value, aux = (out[0], out[1]) if has_aux else (out, None)
        return value, aux, box

    def grad(p_local: list[jax.Array], mb: list[jax.Array], acc: list[jax.Array] | None = None,
             sync: bool = False) -> tuple[jax.Array, PyTree, list[jax.Array]]:
        sinks = _sinks(p_local, acc, execution, specs, plan, mesh, sync) if execution.in_loop else None
        if sinks is None or not (sinks.acc or sinks.out):
            (value, aux), g = jax.value_and_grad(lambda p, r: loss(p, r)[:2], has_aux=True)(p_local, mb)
            return value, aux, [_finish_one(gi, s, plan) for gi, s in zip(g, specs)]
        return _sunk_grad(loss, p_local, mb, sinks, specs, plan)

    return grad


def _sunk_grad(loss: Callable[..., tuple[jax.Array, PyTree, Box]], p_local: list[jax.Array], mb: list[jax.Array],
               sinks: _Sinks, specs: Sequence[StageLeaf], plan: Plan) -> tuple[jax.Array, PyTree, list[jax.Array]]:
    """`_microbatch_grad`'s gradient with the layer loop feeding `sinks`: the sinks' leaves are not
    differentiated; the sinks are, seeded with their own value, so their cotangents are the results."""
    fed = set(sinks.acc) | set(sinks.out)
    diff = [i for i in range(len(p_local)) if i not in fed]

    def f(p_diff: list[jax.Array], acc: dict[int, jax.Array], out: dict[int, jax.Array]) -> tuple[tuple, PyTree]:
        pl = list(p_local)
        for i, v in zip(diff, p_diff):
            pl[i] = v
        value, aux, (accs, outs) = loss(pl, mb, _Sinks(acc, out, sinks.finish, sinks.defer))
        return (value, accs, outs), aux

    (value, _, _), vjp, aux = jax.vjp(f, [p_local[i] for i in diff], sinks.acc, sinks.out, has_aux=True)
    g_diff, acc, out = vjp((jnp.ones_like(value), sinks.acc, sinks.out))
    g: list[jax.Array] = list(p_local)
    for i, gi in zip(diff, g_diff):
        g[i] = _finish_one(gi, specs[i], plan)
    for i, a in [*acc.items(), *out.items()]:
        g[i] = a
    return value, aux, g


def _finish_one(g: jax.Array, spec: StageLeaf, plan: Plan, layer_slice: bool = False) -> jax.Array:
    """One micro-batch gradient (of one layer's slice with `layer_slice`) in the plan's dtype, on device (a
    host-streamed weight's arrives in host memory: the transpose of its fetch), reduce-scattered under ZeRO-2."""
    g = grad_dtype_of(plan, to_device(g, spec.layout.host))
    return scatter_grad(g, spec, layer_slice) if spec.scatter_each_microbatch else g


def _accumulate(grad: MicrobatchGrad, p_local: list[jax.Array], mbs: list[jax.Array], is_batch: Sequence[bool],
                G: int, acc_host: Sequence[bool], in_loop: frozenset[int], sync: bool,
                partial: frozenset[int] = frozenset(), cp: int = 1) -> tuple[list[jax.Array], jax.Array, PyTree]:
    """Sum loss, aux and gradients over the ``G`` micro-batches (a scan; offloaded accumulators on host;
    the `in_loop` leaves' accumulators updated inside the backward; the `partial` ones as per-context-rank
    partials, ``[layers, cp, ...]``, see `collapse_partials`). With `sync` (G == 1 only, see
    `StageExecution.synced`) the only backward also synchronises the synced leaves."""
    mb0 = [x[0] if b else x for x, b in zip(mbs, is_batch)]
    if G == 1:
        loss, aux, acc = grad(p_local, mb0, None, sync)
        return acc, loss, aux
    shapes = jax.eval_shape(grad, p_local, mb0)[2]
    acc0 = [_partial_zeros(s.shape, s.dtype, cp) if i in partial else to_host(jnp.zeros(s.shape, s.dtype), h)
            for i, (s, h) in enumerate(zip(shapes, acc_host))]

    def step(acc: list[jax.Array], i: jax.Array) -> tuple[list[jax.Array], tuple[jax.Array, PyTree]]:
        loss, aux, g = grad(p_local, [x[i] if b else x for x, b in zip(mbs, is_batch)], acc)
        # Offloaded accumulators come in, take this micro-batch's gradient and go back out.
        acc = [gi if k in in_loop else to_host(to_device(a, h) + gi, h)
               for k, (a, gi, h) in enumerate(zip(acc, g, acc_host))]
        return acc, (loss, aux)

    acc, (losses, auxs) = lax.scan(step, acc0, jnp.arange(G))
    acc = [to_device(a, h) for a, h in zip(acc, acc_host)]
    return acc, jnp.sum(losses), jax.tree.map(lambda a: jnp.sum(a, axis=0), auxs)


def _partial_zeros(shape: Sequence[int], dtype: DTypeLike, cp: int) -> jax.Array:
    """A zero accumulator of per-context-rank partials of a stacked leaf: ``[layers, cp, ...]``, split over
    `context` on dim 1 (each device holds one leaf's bytes)."""
    z = jnp.zeros((shape[0], cp, *shape[1:]), dtype)
    return lax.with_sharding_constraint(z, P(None, CONTEXT_AXIS, *([None] * (len(shape) - 1))))


def collapse_partials(acc: list[jax.Array], partial: frozenset[int], specs: Sequence[StageLeaf], plan: Plan
                      ) -> tuple[list[jax.Array], frozenset[int]]:
    """Reduce the per-context-rank partial accumulators (`_accumulate`) over `context`, once per step.

    ZeRO-1 leaves are reduce-scattered over the partition group first (on the partials: each device moves its
    own), then summed over `context` split along the ZeRO dim where the optimizer state is split over `context`
    too (`core.layout.shard_split`: GSPMD reduce-scatters; else it all-reduces). ZeRO-2 leaves arrive scattered
    (per micro-batch). Returns the gradients and the leaves whose partition-group part is done (for
    `finish_grads`' ``synced``)."""
    out, done = list(acc), set()
    for i in partial:
        lay = specs[i].layout
        zero1 = specs[i].zero == 1 and lay.shard_dim is not None
        split = lay.shard_dim is not None and shard_split(lay.shape, lay.axes, lay.tensor_dims, lay.stacked, plan)[1]
        out[i] = _sum_partials(acc[i], lay.shard_dim if zero1 else None, lay.shard_dim if split else None)
        if zero1:
            done.add(i)
    return out, frozenset(done)


def _sum_partials(g: jax.Array, scatter: int | None, dim: int | None) -> jax.Array:
    """``[layers, cp, ...]`` partials (split over `context` on dim 1) reduce-scattered over the partition group onto
    ``scatter`` of the result (ZeRO-1; None: not) and summed over `context`: reduce-scattered onto ``dim`` (then split
    over `context` there, as the optimizer state) or all-reduced (None). Explicit, manual over `context`: left to
    GSPMD, the partials are gathered over `context` around a collective of the partition group."""
    def local(b: jax.Array) -> jax.Array:
        x = b[:, 0]
        if scatter is not None:
            x = shard_psum_scatter(x, scatter)
        return psum(x, CONTEXT_AXIS) if dim is None else psum_scatter(x, CONTEXT_AXIS, dim)

    out: list[str | None] = [None] * (g.ndim - 1)
    if dim is not None:
        out[dim] = CONTEXT_AXIS
    return jax.shard_map(local, in_specs=P(None, CONTEXT_AXIS), out_specs=P(*out), axis_names=frozenset({CONTEXT_AXIS}),
                         check_vma=False)(g)


def sharded_value_and_grad(fun: LossFn, has_aux: bool, params: PyTree, rest: tuple[PyTree, ...], *,
                           plan: Plan, mesh: Mesh, layouts: Sequence[LeafLayout], global_batch: int,
                           on_execution: Callable[[ExecutionPlan], None] | None = None) -> PyTree:
    """``jax.value_and_grad(fun, has_aux)(params, *rest)`` run the way `plan` says.

    Args:
      fun: the user's loss function.
      params: differentiated argument (pytree); `layouts` gives each leaf's layout.
      rest: other arguments; leaves whose leading dim equals `global_batch` are the batch.
      on_execution: called with the step's `ExecutionPlan` once the loss is traced (the step's report).
    """
    stage = plan.stages[0]
    if plan.num_stages > 1:
        raise PlanError("pipelined plans run on the MPMD executor (mistjax.runtime.mpmd, through ShardedStep), "
                        "not as one program")
    p_leaves, p_tree = jax.tree.flatten(params)
    r_leaves, r_tree = jax.tree.flatten(rest)
    specs = [StageLeaf(lay, stage.zero_stage if lay.role == PARAM else 0) for lay in layouts]
    is_batch = [is_batch_leaf(np.shape(x), global_batch) for x in r_leaves]
    G, scale = plan.grad_accum, 1.0 / (plan.dp * plan.grad_accum)
    full_params = jax.tree.unflatten(p_tree, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in p_leaves])
    # Gradient accumulators kept in host memory between micro-batches (only worth it when G > 1).
    acc_host = host_accumulators([s.layout for s in specs], stage.offload_grads)

    def body(p_local: list[jax.Array], r_local: list[jax.Array]) -> tuple[jax.Array, list[jax.Array], PyTree]:
        mbs = [split_microbatches(x, G) if b else x for x, b in zip(r_local, is_batch)]
        mb0 = jax.tree.unflatten(r_tree, [x[0] if b else x for x, b in zip(mbs, is_batch)])
        traced = trace_loss(lambda p, *r: fun(p, *r), full_params, *mb0)
        execution = stage_execution(traced, specs, acc_host, lambda i: i, stage=stage, grad_accum=G, mesh=mesh,
                                    pipelined=False)
        if on_execution is not None:
            on_execution(ExecutionPlan((execution,), mesh_capabilities(mesh, plan.tp_overlap), tuple(is_batch)))
        partial = partial_leaves(traced, execution, specs, plan)
        grad = _microbatch_grad(fun, has_aux, traced, specs, layouts, plan, is_batch, execution, mesh, partial)
        acc, loss_sum, aux_sum = _accumulate(grad, p_local, mbs, is_batch, G, acc_host, execution.in_loop,
                                             bool(execution.synced), partial, plan.cp)
        acc, done = collapse_partials(acc, partial, specs, plan)
        grads = [g * jnp.asarray(scale, g.dtype)
                 for g in finish_grads(acc, specs, plan, mesh, execution.synced | done)]
        loss = psum_live(loss_sum, DP_AXES, mesh) * scale
        aux = jax.tree.map(lambda a: psum_live(a, DP_AXES, mesh) * (scale if jnp.issubdtype(a.dtype, jnp.inexact)
                                                                   else 1), aux_sum)
        return loss, grads, aux

    in_specs = ([s.layout.manual_spec(sharded=s.weights_sharded) for s in specs],
                [P(DP_AXES) if b else P() for b in is_batch])
    out_specs = (P(), [s.layout.manual_spec(sharded=s.out_sharded) for s in specs], P())
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=MANUAL_AXES,
                       check_vma=False)
    loss, grads, aux = fn(p_leaves, r_leaves)
    grads = jax.tree.unflatten(p_tree, grads)
    return ((loss, aux), grads) if has_aux else (loss, grads)


def scatter_grad(g: jax.Array, spec: StageLeaf, layer_slice: bool = False) -> jax.Array:
    """Reduce-scatter a gradient (or one layer's slice of it) over the partition group, per tensor shard
    (see `make_fetch`)."""
    off = 1 if layer_slice else 0
    return per_tensor_shard(lambda v: shard_psum_scatter(v, _shard_dim(spec) - off),
                            [d - off for d in spec.layout.tensor_dims])(g)


def finish_grads(acc: list[jax.Array], specs: Sequence[StageLeaf], plan: Plan, mesh: Mesh,
                  synced: frozenset[int] = frozenset()) -> list[jax.Array]:
    """End-of-step synchronisation: ZeRO-0 all-reduce, ZeRO-1 reduce-scatter, MiCS hop 2; the `synced`
    leaves did their ZeRO-0 / ZeRO-1 part inside the last backward (`row_sync`) and take hop 2 only."""
    out = list(acc)
    hop2: list[int] = []
    for i, (g, s) in enumerate(zip(acc, specs)):
        if s.zero >= 2 and s.layout.shard_dim is not None:
            hop2.append(i)  # already reduced inside the partition group
        elif s.zero == 1 and s.layout.shard_dim is not None:
            out[i] = g if i in synced else scatter_grad(g, s)
            hop2.append(i)
        elif i not in synced:
            out[i] = psum_live(g, DP_AXES, mesh)
    if plan.replicas > 1 and hop2:
        for i, v in zip(hop2, bucketed_psum([out[i] for i in hop2], "replica")):
            out[i] = v
    return out
