"""Capture a loss function as a jaxpr and split it at its layer stack.

A model that scans over stacked layer parameters (``nnx.scan``, ``nn.scan`` or ``lax.scan``)
traces to a jaxpr with one top-level ``scan`` whose scanned operands are the stacked
parameters. Everything before that scan is the *pre* part (embedding), the scan body is one
*block*, and everything after is the *post* part (final norm, head, loss). The runtime
re-evaluates the jaxpr with its own layer loop in place of the scan (to checkpoint, gather and
offload per layer), and the pipeline runs pre / blocks / post on different stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import jax
import numpy as np
from jax.extend import core as jex
from jax.tree_util import PyTreeDef

from mistjax.core.jaxpr import (
    PLAIN_CALLS,
    Atom,
    Value,
    bind_equation,
    eval_jaxpr,
    inline_calls,
    iter_eqns,
    read,
    run_equations,
    scan_counts,
)
from mistjax.core.types import LossFn, PyTree
from mistjax.trace.unrolled import LayerSlices, ParamGroups, find_unrolled

Operand: TypeAlias = Value | LayerSlices
"""An input of the loss as the runtime passes it: an array, or the real per-layer leaves of a virtual stacked one."""
Layer: TypeAlias = Callable[[Sequence[Operand], Sequence[Value], Sequence[Operand]], tuple[list[Value], list[Value]]]
"""One layer, ``layer(consts, carry, x_slices) -> (carry, y_slices)``."""
LayerLoop: TypeAlias = Callable[[Layer, list[Operand], list[Value], list[Operand]], tuple[list[Value], list[Value]]]
"""``layer_loop(layer, consts, carry, xs) -> (carry, ys)``: runs every layer (a scan by default)."""
# One layer, ``block(consts, carry, x_slices) -> (carry, y_slices)``: a replacement for the scan body
# (e.g. `mistjax.runtime.tensor.tensor_parallel_block`, which runs it under Megatron's TP layouts).
BlockFn: TypeAlias = Layer


class NoLayerStackError(ValueError):
    """The loss has no scan over stacked layer parameters, so it cannot be pipelined."""


@dataclass(frozen=True)
class LayerStack:
    """The top-level scan that runs the model's layers."""

    eqn_index: int  # position of the scan in the loss jaxpr's equations
    num_layers: int  # scan length = number of stacked layers
    num_consts: int  # scan operands broadcast to every layer (rotary tables, masks, ...)
    num_carry: int  # scan carry operands (the hidden state)
    xs_leaf: tuple[int | None, ...]  # per scanned operand: index of the param leaf it is, or None
    body: jex.ClosedJaxpr  # one layer: (consts, carry, x slices) -> (carry, y slices)

    @property
    def stacked_leaves(self) -> tuple[int, ...]:
        """Indices (into the flat params) of the stacked layer parameters."""
        return tuple(i for i in self.xs_leaf if i is not None)


@dataclass(frozen=True)
class TracedLoss:
    """A loss ``fun(params, *rest)`` captured as a jaxpr over flat leaves."""

    closed: jex.ClosedJaxpr  # (param leaves..., other leaves...) -> (loss, aux leaves...)
    num_param_leaves: int  # the first `num_param_leaves` invars are parameter leaves
    param_tree: PyTreeDef  # treedef of the differentiated params
    out_tree: PyTreeDef  # treedef of fun's output
    stack: LayerStack | None  # the layer scan, or None for a model without one
    rest_tree: PyTreeDef | None = None  # treedef of the other arguments (to retrace at other sizes)
    # An unrolled layer stack (`mistjax.trace.unrolled`): the jaxpr's parameter invars are then the
    # *virtual* leaves (layer leaves stacked), `num_param_leaves` counts those, and `param_tree` /
    # `real_params` describe the real ones the callers pass.
    groups: ParamGroups | None = None
    real_params: tuple[jax.ShapeDtypeStruct, ...] = ()  # the real parameter leaves

    def param_structs(self) -> PyTree:
        """The real parameters as a pytree of ShapeDtypeStructs (to trace the loss again)."""
        return jax.tree.unflatten(self.param_tree, list(self.real_params))

    def virtual(self, param_leaves: Sequence[Value], *, slices: bool = True) -> list[Operand]:
        """The jaxpr's parameter inputs from the real leaves (identity without an unrolled stack)."""
        return list(param_leaves) if self.groups is None else self.groups.to_virtual(param_leaves, slices=slices)

    def real_index(self, i: int) -> int:
        """The real leaf of the jaxpr's parameter input ``i`` (not stacked)."""
        return i if self.groups is None else self.groups.real_index(i)

    @property
    def num_real_params(self) -> int:
        """How many parameter leaves the callers pass (the real ones of an unrolled stack)."""
        return self.num_param_leaves if self.groups is None else self.groups.num_real

    def param_aval(self, i: int) -> jax.ShapeDtypeStruct:
        """Shape and dtype of real parameter leaf ``i``."""
        if self.groups is not None:
            return self.real_params[i]
        aval = self.closed.jaxpr.invars[i].aval
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype)

    def layer_leaves(self) -> frozenset[int]:
        """The real parameter leaves of the layer stack: stacked ones, or every layer's of an unrolled stack."""
        if self.groups is not None:
            return frozenset(self.groups.members())
        return frozenset(self.stack.stacked_leaves) if self.stack is not None else frozenset()

    def for_layers(self, start: int, stop: int) -> TracedLoss:
        """This loss with an unrolled stack's groups cut to layers ``[start, stop)`` (a pipeline stage's):
        `virtual` then gives LayerSlices of those layers only. A scanned stack is returned unchanged."""
        if self.groups is None:
            return self
        virtual = tuple(v if isinstance(v, int) else v[start:stop] for v in self.groups.virtual)
        return dataclasses.replace(self, groups=dataclasses.replace(self.groups, virtual=virtual))

    def require_stack(self) -> LayerStack:
        if self.stack is None:
            raise NoLayerStackError(
                "the loss has no scan over stacked layer parameters, so it cannot be split into "
                "pipeline stages or checkpointed per layer; build the layers with nnx.scan / nn.scan / "
                "lax.scan over stacked params, or use a plan with one stage and no remat")
        return self.stack


def trace_loss(fun: LossFn, params: PyTree, *rest: PyTree) -> TracedLoss:
    """Trace ``fun(params, *rest)`` (arrays or ShapeDtypeStructs) and find its layer stack."""
    param_leaves, param_tree = jax.tree.flatten(params)
    rest_leaves, rest_tree = jax.tree.flatten(rest)
    n = len(param_leaves)
    out_tree_box: list[PyTreeDef] = []

    def flat_fun(*leaves: Value) -> list[Value]:
        p = jax.tree.unflatten(param_tree, leaves[:n])
        r = jax.tree.unflatten(rest_tree, leaves[n:])
        out = fun(p, *r)
        out_leaves, out_tree = jax.tree.flatten(out)
        out_tree_box.append(out_tree)
        return out_leaves

    closed = jax.make_jaxpr(flat_fun)(*param_leaves, *rest_leaves)
    # Top-level jit calls only, so a scan nested in them is visible; calls with rules of their own
    # (checkpoint, custom_vjp) stay, as they change what differentiating the loss gives.
    closed = inline_calls(closed, PLAIN_CALLS, depth=1)
    real = tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in param_leaves)
    stack, groups = find_layer_stack(closed, n), None
    if stack is None and n:
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        found = find_unrolled(closed, n, paths)
        if found is not None:
            closed, groups = found
            n = len(groups.virtual)
            stack = find_layer_stack(closed, n)
    return TracedLoss(closed=closed, num_param_leaves=n, param_tree=param_tree, out_tree=out_tree_box[0],
                      stack=stack, rest_tree=rest_tree, groups=groups, real_params=real)


def find_layer_stack(closed: jex.ClosedJaxpr, num_param_leaves: int) -> LayerStack | None:
    """The top-level scan whose scanned operands hold the most parameter bytes, if any."""
    invar_index = {v: i for i, v in enumerate(closed.jaxpr.invars[:num_param_leaves])}
    best, best_bytes = None, 0
    for k, eqn in enumerate(closed.jaxpr.eqns):
        if eqn.primitive.name != "scan" or eqn.params["reverse"]:
            continue
        nc, ncar = scan_counts(eqn.params)
        xs = eqn.invars[nc + ncar:]
        xs_leaf = tuple(invar_index.get(v) if isinstance(v, jex.Var) else None for v in xs)
        nbytes = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
                     for v, i in zip(xs, xs_leaf) if i is not None)
        if nbytes > best_bytes:
            best_bytes = nbytes
            best = LayerStack(eqn_index=k, num_layers=int(eqn.params["length"]), num_consts=nc,
                              num_carry=ncar, xs_leaf=xs_leaf, body=eqn.params["jaxpr"])
    return best


def checkpoint_names(closed: jex.ClosedJaxpr) -> tuple[str, ...]:
    """The `checkpoint_name` tags used in a jaxpr (recursing into sub-jaxprs), in order of appearance."""
    return tuple(dict.fromkeys(e.params["name"] for e in iter_eqns(closed, bodies=True) if e.primitive.name == "name"))


def run_block(stack: LayerStack, consts: Sequence[Operand], carry: Sequence[Value], xs: Sequence[Operand],
              block: BlockFn | None = None) -> tuple[list[Value], list[Value]]:
    """Run one layer: the scan body on one slice of the scanned operands (through `block` if given)."""
    if block is not None:
        carry_out, ys = block(consts, carry, xs)
        return list(carry_out), list(ys)
    out = eval_jaxpr(stack.body.jaxpr, stack.body.consts, [*consts, *carry, *xs])
    return out[: stack.num_carry], out[stack.num_carry:]


def default_layer_loop(body: Layer, consts: list[Operand], carry: list[Value], xs: list[Operand]
                       ) -> tuple[list[Value], list[Value]]:
    """Plain `lax.scan` over the layers (what the model itself would do); a Python loop over the real
    per-layer leaves of an unrolled stack (`LayerSlices`), as the model itself ran."""
    if any(isinstance(x, LayerSlices) for x in xs):
        return unrolled_loop(lambda c, x: body(consts, c, x), carry, xs)

    def step(c: list[Value], x: list[Value]) -> tuple[list[Value], list[Value]]:
        return body(consts, c, x)

    return jax.lax.scan(step, carry, xs)


def unrolled_loop(layer: Callable[[list[Value], list[Operand]], tuple[list[Value], list[Value]]],
                  carry: list[Value], xs: list[Operand]) -> tuple[list[Value], list[Value]]:
    """``lax.scan(layer, carry, xs)`` as a Python loop when ``xs`` are `LayerSlices` (an unrolled stack:
    each layer reads its own real leaves); the per-layer outputs are stacked as a scan's would be."""
    num = len(xs[0].parts) if isinstance(xs[0], LayerSlices) else int(np.shape(xs[0])[0])
    ys_all = []
    for i in range(num):
        carry, ys = layer(list(carry), [x[i] for x in xs])
        ys_all.append(ys)
    ys = [jax.numpy.stack(parts) for parts in zip(*ys_all)] if ys_all and ys_all[0] else []
    return list(carry), ys


def evaluate(traced: TracedLoss, param_leaves: Sequence[Value], rest_leaves: Sequence[Value], *,
             layer_loop: LayerLoop | None = None,
             read_param: Callable[[int, Operand], Operand] | None = None,
             block: BlockFn | None = None) -> list[Value]:
    """Evaluate the traced loss, optionally replacing its layer scan with `layer_loop`.

    Args:
      traced: the captured loss.
      param_leaves / rest_leaves: flat inputs.
      layer_loop: ``layer_loop(body, consts, carry, xs) -> (carry, ys)``, where
        ``body(consts, carry, x_slices) -> (carry, y_slices)`` runs one layer (default with a
        `block`: `default_layer_loop`).
      read_param: called as ``read_param(leaf_index, value)`` the first time a non-stacked
        parameter is used (e.g. to all-gather a ZeRO-3 shard right before its use).
      block: runs one layer in place of the scan body inside `layer_loop` (same signature as
        ``body``); None evaluates the traced body as is.
    Returns:
      The flat outputs of the loss function.
    """
    stack = traced.stack
    jaxpr = traced.closed.jaxpr
    n = traced.num_param_leaves
    stacked = set(stack.stacked_leaves) if stack is not None else set()
    env: dict[jex.Var, Operand] = dict(zip(jaxpr.constvars, traced.closed.consts))
    lazy: dict[jex.Var, int] = {}
    for i, (v, x) in enumerate(zip(jaxpr.invars, [*traced.virtual(param_leaves), *rest_leaves])):
        env[v] = x
        if read_param is not None and i < n and i not in stacked:
            lazy[v] = traced.real_index(i)

    def get(v: Atom) -> Operand:
        if isinstance(v, jex.Var) and v in lazy:
            env[v] = read_param(lazy.pop(v), env[v])
        return read(env, v)

    replace = stack is not None and (layer_loop is not None or block is not None or traced.groups is not None)
    for k, eqn in enumerate(jaxpr.eqns):
        if replace and k == stack.eqn_index:
            vals = [get(v) for v in eqn.invars]
            nc, ncar = stack.num_consts, stack.num_carry
            body = lambda consts, carry, x: run_block(stack, consts, carry, x, block)  # noqa: E731
            carry, ys = (layer_loop or default_layer_loop)(body, vals[:nc], vals[nc:nc + ncar], vals[nc + ncar:])
            outs = [*carry, *ys]
        else:
            outs = bind_equation(eqn, [get(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs))
    return [get(v) for v in jaxpr.outvars]


def pre_part(traced: TracedLoss, param_leaves: Sequence[Value], rest_leaves: Sequence[Value]
             ) -> tuple[list[Value], list[Value]]:
    """Run everything the layer scan needs: returns the scan's (consts, initial carry)."""
    stack = traced.require_stack()
    jaxpr = traced.closed.jaxpr
    scan = jaxpr.eqns[stack.eqn_index]
    env = _inputs_env(traced, param_leaves, rest_leaves)
    _run_needed(jaxpr, range(stack.eqn_index), scan.invars[:stack.num_consts + stack.num_carry], env)
    vals = [read(env, v) for v in scan.invars[:stack.num_consts + stack.num_carry]]
    return vals[:stack.num_consts], vals[stack.num_consts:]


def post_part(traced: TracedLoss, param_leaves: Sequence[Value], rest_leaves: Sequence[Value],
              carry: Sequence[Value]) -> list[Value]:
    """Run everything after the layer scan from its final carry (recomputing any pre values it needs)."""
    stack = traced.require_stack()
    jaxpr = traced.closed.jaxpr
    scan = jaxpr.eqns[stack.eqn_index]
    if len(scan.outvars) > stack.num_carry:
        raise NoLayerStackError("the layer scan returns per-layer outputs besides its carry, which a pipeline "
                                "cannot pass between stages; return only the hidden state from the scan")
    env = _inputs_env(traced, param_leaves, rest_leaves)
    env.update(zip(scan.outvars, carry))
    after = range(stack.eqn_index + 1, len(jaxpr.eqns))
    needed_before = free_vars([jaxpr.eqns[k] for k in after], jaxpr.outvars, defined=set(scan.outvars))
    _run_needed(jaxpr, range(stack.eqn_index), needed_before, env)
    run_equations([jaxpr.eqns[k] for k in after], env)
    return [read(env, v) for v in jaxpr.outvars]


def scan_operands(traced: TracedLoss, param_leaves: Sequence[Value], rest_leaves: Sequence[Value],
                  which: Sequence[int]) -> list[Value]:
    """Evaluate only the layer scan's operands at positions `which` (into its consts + carry).

    Only the equations those operands need run, so `param_leaves` may hold placeholders for the
    parameters they do not read (e.g. a pipeline stage recomputing batch-only scan constants).
    """
    stack = traced.require_stack()
    jaxpr = traced.closed.jaxpr
    targets = [jaxpr.eqns[stack.eqn_index].invars[j] for j in which]
    env = _inputs_env(traced, param_leaves, rest_leaves)
    _run_needed(jaxpr, range(stack.eqn_index), targets, env)
    return [read(env, v) for v in targets]


@dataclass(frozen=True)
class PartUsage:
    """Which parameters the parts around the layer stack read (indices into the flat params)."""

    pre: frozenset[int]  # read by the equations the scan's operands need (embedding, ...)
    post: frozenset[int]  # read after the scan, or by the pre equations the post part recomputes
    const_needs_params: tuple[bool, ...]  # per scan const operand: computed from parameters


def real_usage(traced: TracedLoss) -> PartUsage:
    """`part_usage` with real parameter indices (an unrolled stack's jaxpr reads virtual ones)."""
    usage = part_usage(traced)
    if traced.groups is None:
        return usage
    real = traced.real_index
    return PartUsage(frozenset(real(i) for i in usage.pre), frozenset(real(i) for i in usage.post),
                     usage.const_needs_params)


def part_usage(traced: TracedLoss) -> PartUsage:
    """Classify the parameters by the part of the loss that reads them (`pre_part` / `post_part`)."""
    stack = traced.require_stack()
    jaxpr = traced.closed.jaxpr
    scan = jaxpr.eqns[stack.eqn_index]
    params = {v: i for i, v in enumerate(jaxpr.invars[: traced.num_param_leaves])}

    def slice_params(indices: Sequence[int], targets: Sequence[Atom]) -> set[int]:
        needed = {v for v in targets if isinstance(v, jex.Var)}
        for k in reversed(list(indices)):
            eqn = jaxpr.eqns[k]
            if any(v in needed for v in eqn.outvars):
                needed.update(v for v in eqn.invars if isinstance(v, jex.Var))
        return {params[v] for v in needed if v in params}

    pre = slice_params(range(stack.eqn_index), scan.invars[: stack.num_consts + stack.num_carry])
    after = [jaxpr.eqns[k] for k in range(stack.eqn_index + 1, len(jaxpr.eqns))]
    post_free = free_vars(after, jaxpr.outvars, defined=set(scan.outvars))
    post = slice_params(range(stack.eqn_index), post_free)
    dependent = set(params)
    for eqn in jaxpr.eqns[: stack.eqn_index]:
        if any(isinstance(v, jex.Var) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    consts = scan.invars[: stack.num_consts]
    return PartUsage(frozenset(pre), frozenset(post),
                     tuple(isinstance(v, jex.Var) and v in dependent for v in consts))


def _inputs_env(traced: TracedLoss, param_leaves: Sequence[Value], rest_leaves: Sequence[Value]
                ) -> dict[jex.Var, Value]:
    jaxpr = traced.closed.jaxpr
    env = dict(zip(jaxpr.constvars, traced.closed.consts))
    env.update(zip(jaxpr.invars, [*traced.virtual(param_leaves, slices=False), *rest_leaves]))
    return env


def free_vars(eqns: Sequence[jex.JaxprEqn], outvars: Sequence[Atom], defined: set[jex.Var]) -> list[jex.Var]:
    """Variables that `eqns` (and `outvars`) read but do not define themselves."""
    defined = set(defined)
    free: dict[jex.Var, None] = {}
    for eqn in eqns:
        for v in eqn.invars:
            if isinstance(v, jex.Var) and v not in defined:
                free.setdefault(v, None)
        defined.update(eqn.outvars)
    for v in outvars:
        if isinstance(v, jex.Var) and v not in defined:
            free.setdefault(v, None)
    return list(free)


def needed_equations(eqns: Sequence[jex.JaxprEqn], targets: Sequence[Atom]) -> list[jex.JaxprEqn]:
    """The equations among `eqns` that `targets` depend on, in order."""
    needed = {v for v in targets if isinstance(v, jex.Var)}
    keep = []
    for eqn in reversed(eqns):
        if any(v in needed for v in eqn.outvars):
            keep.append(eqn)
            needed.update(v for v in eqn.invars if isinstance(v, jex.Var))
    return keep[::-1]


def _run_needed(jaxpr: jex.Jaxpr, indices: Sequence[int], targets: Sequence[Atom], env: dict[jex.Var, Value]
                ) -> None:
    """Evaluate only the equations among `indices` that `targets` depend on (in order)."""
    run_equations(needed_equations([jaxpr.eqns[k] for k in indices], targets), env)


__all__ = [  # bind_equation, eval_jaxpr and run_equations: the interpreter of `mistjax.core.jaxpr`, re-exported
    "BlockFn", "Layer", "LayerLoop", "LayerStack", "NoLayerStackError", "Operand", "PartUsage", "TracedLoss",
    "bind_equation", "checkpoint_names", "default_layer_loop", "eval_jaxpr", "evaluate", "find_layer_stack",
    "free_vars", "needed_equations", "part_usage", "post_part", "pre_part", "real_usage", "run_block", "run_equations",
    "scan_operands", "trace_loss", "unrolled_loop",
]
