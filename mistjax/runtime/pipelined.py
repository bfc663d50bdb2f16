"""Pipelined plans: the traced loss split into pre / block / post and run by the pipeline executor.

One shard_map is manual over ``stage``, ``replica`` and the shard axes (`SHARD_AXES`); ``tensor``
stays with GSPMD. The stacked layer parameters enter in the stage layout ``[S, Lmax, ...]``
(`to_stage_layout`, a reshard of the boundary layers when stages are uneven); embedding and head
parameters are replicated over ``stage``. Inside, `pipeline_local` runs the schedule; a layer
fetches its weights as the plan says (ZeRO-3 all-gather over the partition group, hierarchical
across nodes; host->device copy), each stage checkpoints and offloads activations as its own plan
says, and autodiff turns the gather into the per-micro-batch
reduce-scatter. After the schedule, gradients are summed over ``stage`` (embedding and head) and
synchronised over the data-parallel axes like the unpipelined path, except that ZeRO-2
reduce-scatters once per step (the schedule accumulates full-size gradients per stage).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core.layout import DP_AXES, SHARD_AXES, SHARD_SPEC, LeafLayout
from mistjax.core.plan import Plan, PlanError
from mistjax.runtime.pipeline import from_stage_layout, pipeline_local, to_stage_layout
from mistjax.runtime.tensor import tensor_parallel_block
from mistjax.trace.split import NoLayerStackError, post_part, pre_part, run_block, trace_loss

MANUAL_AXES = frozenset({"stage", "replica", *SHARD_AXES})


# Choices held by arrays that live on every device: one SPMD program gives a leaf one sharding and one
# memory kind on all devices, so a stage cannot store its slice of a stacked leaf differently.
SHARED_STAGE_FIELDS = ("shard_weights", "shard_grads", "shard_opt", "offload_weights", "offload_grads",
                       "offload_opt")


def check_pipelined_plan(plan: Plan) -> None:
    """Pipelined plans share ZeRO and state-offload choices across stages; remat and activation offload
    are per stage (they decide what each stage's own code keeps in the residual pools)."""
    first = plan.stages[0]
    for i, s in enumerate(plan.stages[1:], 1):
        for name in SHARED_STAGE_FIELDS:
            if getattr(s, name) != getattr(first, name):
                raise PlanError(f"stage {i} sets {name}={getattr(s, name)} but stage 0 sets "
                                f"{getattr(first, name)}: pipelined plans use one ZeRO / state-offload setting "
                                "for all stages (remat and activation offload are per stage); make them equal")
    if first.offload_grads:
        raise PlanError("gradient-accumulator offload is not supported in pipelined plans: the schedule adds "
                        "into every stage's accumulator on every backward tick; set offload_grads=0 or use "
                        "one stage")


def pipelined_value_and_grad(fun: Callable[..., Any], has_aux: bool, params: Any, rest: tuple[Any, ...], *,
                             plan: Plan, mesh: Mesh, layouts: Sequence[LeafLayout], global_batch: int,
                             specs: Sequence[Any], finish: Callable[..., list[jax.Array]],
                             fetch: Callable[[Any, bool], Callable[[jax.Array], jax.Array] | None]) -> Any:
    """``jax.value_and_grad(fun)(params, *rest)`` run as the plan's pipeline (see module doc)."""
    if has_aux:
        raise PlanError("a pipelined plan cannot return auxiliary outputs from the loss (has_aux=True); "
                        "compute metrics outside the loss or use one stage")
    check_pipelined_plan(plan)
    p_leaves, p_tree = jax.tree.flatten(params)
    r_leaves, r_tree = jax.tree.flatten(rest)
    is_batch = [jnp.ndim(x) > 0 and x.shape[0] == global_batch for x in r_leaves]
    full_params = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in p_leaves]
    G, dp = plan.grad_accum, plan.dp
    stage_layers = [s.layers for s in plan.stages]

    # Find the stack once, on global shapes, to know which leaves are stacked.
    probe = trace_loss(fun, jax.tree.unflatten(p_tree, full_params),
                       *jax.tree.unflatten(r_tree, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in r_leaves]))
    stack = probe.require_stack()
    if any(i is None for i in stack.xs_leaf):
        raise NoLayerStackError("the layer scan iterates over values that are not parameters; a pipeline can "
                                "only split scans over stacked parameters")
    stacked_idx = list(stack.xs_leaf)
    other_idx = [i for i in range(len(p_leaves)) if i not in set(stacked_idx)]
    staged, _ = to_stage_layout([p_leaves[i] for i in stacked_idx], stage_layers)

    def staged_spec(i: int, manual: bool) -> P:
        lay = layouts[i]
        entries: list[Any] = [None] * (len(lay.shape) + 1)
        entries[0] = "stage"
        if not manual:
            for d in lay.tensor_dims:
                entries[d + 1] = "tensor"
        if specs[i].weights_sharded:
            entries[lay.shard_dim + 1] = SHARD_SPEC
        return P(*entries)

    staged = [lax.with_sharding_constraint(x, NamedSharding(mesh, staged_spec(i, False)))
              for x, i in zip(staged, stacked_idx)]

    def body(other_local: list[jax.Array], staged_local: list[jax.Array], r_local: list[jax.Array]) -> Any:
        mbs = [_split(x, G) for x, b in zip(r_local, is_batch) if b]
        consts = [x for x, b in zip(r_local, is_batch) if not b]
        mb0 = _merge_rest(is_batch, [m[0] for m in mbs], consts)
        traced = trace_loss(fun, jax.tree.unflatten(p_tree, full_params), *jax.tree.unflatten(r_tree, mb0))
        tp_block = tensor_parallel_block(fun, traced, layouts=layouts, tp=plan.tp, batch=is_batch)
        st = traced.require_stack()
        fetches = [fetch(specs[i], True) for i in stacked_idx]

        def assemble(other: list[jax.Array]) -> list[Any]:
            leaves: list[Any] = [None] * len(p_leaves)
            for i, v in zip(other_idx, other):
                f = fetch(specs[i], False)
                leaves[i] = v if f is None else f(v)
            return leaves

        def pre(pre_p: list[jax.Array], mb: list[jax.Array]) -> Any:
            c, carry = pre_part(traced, assemble(pre_p), _merge_rest(is_batch, mb, consts))
            return (c, carry)

        def block(layer_p: list[jax.Array], h: Any) -> Any:
            c, carry = h
            xs = [x if f is None else f(x) for x, f in zip(layer_p, fetches)]
            carry, _ = run_block(st, c, carry, xs, tp_block)
            return (c, carry)

        def post(post_p: list[jax.Array], h: Any, mb: list[jax.Array]) -> jax.Array:
            outs = post_part(traced, assemble(post_p), _merge_rest(is_batch, mb, consts), h[1])
            return jax.tree.unflatten(traced.out_tree, outs)

        loss, (acc_pre, acc_stage, acc_post) = pipeline_local(
            pre, block, post, other_local, [x[0] for x in staged_local], other_local, mbs,
            stage_layers=stage_layers, schedule=plan.schedule,
            remat_layers=[s.remat_layers for s in plan.stages],
            remat_policy=[s.remat_policy for s in plan.stages],
            offload_layers=[s.offloaded_layers for s in plan.stages],
            loss_scale=1.0 / G)
        loss = lax.psum(loss, ("stage", *_live(DP_AXES, mesh))) / dp
        acc_other = lax.psum([a + b for a, b in zip(acc_pre, acc_post)], "stage")
        acc = [None] * len(p_leaves)
        for i, a in zip(other_idx, acc_other):
            acc[i] = a
        for i, a in zip(stacked_idx, acc_stage):
            acc[i] = a
        grads = finish(acc)
        grads = [(g / dp).astype(p.dtype) for g, p in zip(grads, full_params)]
        return loss, [grads[i] for i in other_idx], [grads[i][None] for i in stacked_idx]

    in_specs = ([specs[i].layout.manual_spec(sharded=specs[i].weights_sharded) for i in other_idx],
                [staged_spec(i, True) for i in stacked_idx],
                [P(DP_AXES) if b else P() for b in is_batch])
    out_specs = (P(), [specs[i].layout.manual_spec(sharded=specs[i].out_sharded) for i in other_idx],
                 [_grad_staged_spec(specs[i]) for i in stacked_idx])
    run = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=MANUAL_AXES,
                        check_vma=False)
    loss, g_other, g_staged = run([p_leaves[i] for i in other_idx], staged, r_leaves)
    g_stacked = from_stage_layout(g_staged, stage_layers)
    grads: list[Any] = [None] * len(p_leaves)
    for i, g in zip(other_idx, g_other):
        grads[i] = g
    for i, g in zip(stacked_idx, g_stacked):
        grads[i] = g
    return loss, jax.tree.unflatten(p_tree, grads)


def _grad_staged_spec(spec: Any) -> P:
    lay = spec.layout
    entries: list[Any] = [None] * (len(lay.shape) + 1)
    entries[0] = "stage"
    if spec.out_sharded:
        entries[lay.shard_dim + 1] = SHARD_SPEC
    return P(*entries)


def _live(axes: Sequence[str], mesh: Mesh) -> tuple[str, ...]:
    return tuple(a for a in axes if mesh.shape[a] > 1)


def _split(x: jax.Array, g: int) -> jax.Array:
    if x.shape[0] % g:
        raise PlanError(f"a local batch of {x.shape[0]} rows does not split into {g} micro-batches")
    return x.reshape((x.shape[0] // g, g) + x.shape[1:]).swapaxes(0, 1)


def _merge_rest(is_batch: Sequence[bool], batch: Sequence[Any], consts: Sequence[Any]) -> list[Any]:
    bi, ci = iter(batch), iter(consts)
    return [next(bi) if b else next(ci) for b in is_batch]
