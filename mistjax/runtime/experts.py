"""Expert parallelism: MoE dispatch and combine as all-to-all inside ``jax.shard_map`` (issue #51).

The experts of every MoE layer are split over one mesh axis (``expert_axis``, EP ranks); the tokens are split
over that axis *and* the data axes (Megatron-Core's parallel folding: the expert axis is carved out of the
data-parallel ranks, so attention keeps its full data parallelism and each expert's weights are replicated on
the ``data`` ranks, its expert-data-parallel group). Each rank routes its own sequences, fills padded
per-sequence capacity buffers (`mistjax.core.moe.dispatch`: the same tokens are dropped as on one device),
exchanges them with one all-to-all over ``expert_axis``, runs its local experts, sends the outputs back with a
second all-to-all and combines. The dropless configuration (``capacity_factor=None``) uses buffers of the
worst case (``seq`` slots per expert and sequence): nothing is dropped, at E/k times the dropping buffer's
size; ``jax.lax.ragged_all_to_all`` would send only the routed rows but has no CPU lowering (docs/moe.md).

Used as a dispatcher of `mistjax.core.moe.experts_dispatch` while a step is traced::

    with experts_dispatch(expert_parallel(mesh, expert_axis="expert", data_axes=("data",))):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core.moe import (
    ExpertDispatch,
    ExpertWeights,
    RouterSpec,
    Routing,
    capacity,
    combine,
    dispatch,
    swiglu_experts,
)
from mistjax.core.types import PyTree


class ExpertParallelError(ValueError):
    """A mesh, batch or model that expert parallelism cannot split; the message names the field and the fix."""


def expert_parallel(mesh: Mesh, *, expert_axis: str = "expert", data_axes: Sequence[str] = ("data",),
                    tensor_axis: str | None = None, fold_axes: Sequence[str] = ()) -> ExpertDispatch:
    """The expert-parallel dispatcher for `mistjax.core.moe.experts_dispatch`.

    Args:
        mesh: the device mesh; it must have ``expert_axis`` and every one of ``data_axes``.
        expert_axis: mesh axis the experts are split over (EP = its size).
        data_axes: the other mesh axes the batch is split over (the expert-data-parallel ranks).
        tensor_axis: expert tensor parallelism (ETP): each expert's inner width split over this mesh axis
            (gate / up by columns, down by rows, the partial outputs summed over it); the tokens are the same on
            its ranks. None: experts whole.
        fold_axes: mesh axes the batch is *not* split over (e.g. the attention's tensor-parallel axis) that the
            experts are split over too, after ``expert_axis`` (EP = the product of the sizes): EP larger than the
            data parallelism, Megatron-Core's folding. The ranks of a fold group hold the same sequences; each
            dispatches its share of them and the outputs are all-gathered over the group.

    Returns:
        ``fn(x [B, S, h], routing, weights, spec) -> [B, S, h]``: tokens split over
        ``(*data_axes, expert_axis)`` on the batch, expert weights over ``(expert_axis, *fold_axes)`` on their
        expert dim (and over ``tensor_axis`` on their inner width).

    Raises:
        ExpertParallelError: an axis is not in the mesh.
    """
    for axis in (expert_axis, *data_axes, *([tensor_axis] if tensor_axis else []), *fold_axes):
        if axis not in mesh.axis_names:
            raise ExpertParallelError(f"expert_parallel: mesh axis {axis!r} is not in the mesh {mesh.axis_names}; "
                                      "name one of its axes as expert_axis / data_axes / tensor_axis / fold_axes")
    token_axes = (*data_axes, expert_axis)
    expert_axes = (expert_axis, *fold_axes)
    ep = math.prod(mesh.shape[a] for a in expert_axes)
    fold = math.prod(mesh.shape[a] for a in fold_axes)

    def run(x: jax.Array, routing: Routing, w: ExpertWeights, spec: RouterSpec) -> jax.Array:
        _check_split(x.shape[0], spec.num_experts, ep, mesh, token_axes, fold)
        slots = capacity(x.shape[1], spec)

        def local(x: jax.Array, experts: jax.Array, weights: jax.Array, w: ExpertWeights) -> jax.Array:
            if not fold_axes:
                return _exchange(x, experts, weights, w, spec, slots, ep, expert_axes, tensor_axis)
            # This rank's share of the fold group's sequences (capacity is per sequence, so any row split
            # drops the same choices), then the group's outputs gathered back.
            share = x.shape[0] // fold
            start = jax.lax.axis_index(tuple(fold_axes)) * share
            x, experts, weights = (jax.lax.dynamic_slice_in_dim(a, start, share) for a in (x, experts, weights))
            out = _exchange(x, experts, weights, w, spec, slots, ep, expert_axes, tensor_axis)
            # Gathered as a psum of the shares placed in zeros: the result is typed invariant over the fold
            # group (shard_map's out_specs replicate it there), which all_gather's is not in this JAX.
            placed = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((fold * share, *out.shape[1:]), out.dtype),
                                                         out, start, 0)
            return jax.lax.psum(placed, tuple(fold_axes))

        tokens = P(token_axes)
        columns, rows = P(expert_axes, None, tensor_axis), P(expert_axes, tensor_axis, None)
        in_specs = (tokens, tokens, tokens, (columns, columns, rows))  # the last: ExpertWeights' three fields
        return jax.shard_map(lambda x, e, g, ws: local(x, e, g, ExpertWeights(*ws)), mesh=mesh, in_specs=in_specs,
                             out_specs=tokens)(x, routing.experts, routing.weights, tuple(w))

    return run


def _exchange(x: jax.Array, experts: jax.Array, weights: jax.Array, w: ExpertWeights, spec: RouterSpec,
              slots: int, ep: int, axis: tuple[str, ...], tensor_axis: str | None) -> jax.Array:
    """One rank's dispatch, all-to-all, local experts, all-to-all back and combine (inside ``shard_map``)."""
    b, _, h = x.shape
    num_experts = spec.num_experts
    local_experts = num_experts // ep
    buffers, index, kept = dispatch(x, experts, num_experts, slots)  # [b, E*C, h]
    # [b, E, C, h] -> [ep, E_local, b*C, h]: row r of the leading axis goes to expert rank r.
    send = jnp.swapaxes(buffers.reshape(b, num_experts, slots, h), 0, 1).reshape(ep, local_experts, b * slots, h)
    received = jax.lax.all_to_all(send, axis, split_axis=0, concat_axis=0)  # leading axis: source rank
    rows = jnp.swapaxes(received, 0, 1).reshape(local_experts, ep * b * slots, h)
    out = swiglu_experts(rows, w, spec.swiglu_limit)
    if tensor_axis is not None:  # each tensor rank holds a slice of the inner width: sum the partial products
        out = jax.lax.psum(out, tensor_axis)
    back = jnp.swapaxes(out.reshape(local_experts, ep, b * slots, h), 0, 1)
    returned = jax.lax.all_to_all(back, axis, split_axis=0, concat_axis=0)  # leading axis: expert rank
    outputs = jnp.swapaxes(returned.reshape(num_experts, b, slots, h), 0, 1).reshape(b, num_experts * slots, h)
    return combine(outputs, index, kept, weights)


def _check_split(batch: int, num_experts: int, ep: int, mesh: Mesh, token_axes: tuple[str, ...], fold: int
                 ) -> None:
    if num_experts % ep:
        raise ExpertParallelError(f"expert parallelism {ep} does not divide num_experts={num_experts}; choose an "
                                  "expert axis whose size divides the experts")
    ranks = 1
    for axis in token_axes:
        ranks *= mesh.shape[axis]
    if batch % (ranks * fold):
        raise ExpertParallelError(f"batch {batch} is not divisible by the {ranks} token ranks of mesh axes "
                                  f"{token_axes} times the fold group of {fold}; use a batch that is a multiple of "
                                  f"{ranks * fold}")


def expert_shardings(axes: PyTree, mesh: Mesh, *, expert_axis: str | tuple[str, ...] = "expert", name: str = "experts",
                     tensor_axis: str | None = None, inner: str = "mlp", zero_axes: Sequence[str] = (),
                     zero_dim: str = "embed") -> PyTree:
    """``NamedSharding`` per parameter: the dim named ``name`` split over ``expert_axis`` and, in the leaves that
    have it, the dim named ``inner`` over ``tensor_axis`` (expert TP); with ``zero_axes`` (ZeRO-3) the dim named
    ``zero_dim`` is also split, over each leaf's own data-parallel group: ``zero_axes`` for the experts (their
    expert-data-parallel ranks), ``(*zero_axes, expert_axis)`` for the dense parameters (every token rank).

    The train step's compiler gathers a ZeRO-3 leaf where it is used (an expert's before the ``shard_map`` of the
    dispatch) and reduce-scatters its gradient; the optimizer state placed like the parameters stays split.

    Args:
        axes: logical axis names per parameter (tuples of names, e.g. `models.logical_axes`).
        mesh: the device mesh.
        expert_axis: the mesh axis of expert parallelism, or the axes (``(expert_axis, *fold_axes)`` of
            `expert_parallel`) when it is folded over axes the batch is not split over.
        name: the logical name of the expert dimension.
        tensor_axis: the mesh axis of expert tensor parallelism, or None.
        inner: the logical name of an expert's inner width.
        zero_axes: the data axes to shard parameters over (ZeRO-3); empty: parameters replicated over data.
        zero_dim: the logical dim ZeRO-3 splits (it must divide by the group's size).
    """
    dense_group = (*zero_axes, expert_axis) if zero_axes and isinstance(expert_axis, str) else tuple(zero_axes)

    def sharding(names: tuple[str, ...]) -> NamedSharding:
        group = tuple(zero_axes) if name in names else dense_group
        spec: list[str | tuple[str, ...] | None] = [
            expert_axis if n == name else tensor_axis if n == inner and name in names else None for n in names]
        if group and zero_dim in names:
            spec[names.index(zero_dim)] = group
        return NamedSharding(mesh, P(*spec))

    return jax.tree.map(sharding, axes, is_leaf=lambda a: isinstance(a, tuple))


__all__ = ["ExpertParallelError", "expert_parallel", "expert_shardings"]
