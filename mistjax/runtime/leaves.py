"""Which train-state leaves are parameters, which mirror a parameter (optimizer state), and their layouts.

A train state is any pytree: ``{"params", "opt"}`` with an optax state of any structure (adamw, chains,
masks, ``multi_transform``), a `flax.training.TrainState`, an NNX ``Optimizer``'s state. The
parameters are the leaves the step differentiates with `mistjax.value_and_grad` (found by identity
while tracing). An optimizer leaf *mirrors* a parameter when its key path ends with the parameter's
path inside the differentiated tree and its shape equals the parameter's (optax's per-parameter
states keep the parameter tree below their own fields; masked-out entries are empty nodes). A
mirror is laid out like its parameter: the same tensor-parallel dims, the same ZeRO dim, the same
layer membership; so ZeRO-1/2/3 and optimizer offload shard every optimizer state alike.

Unrolled layer stacks (`mistjax.trace.unrolled`): the L real leaves of one place in the layer
subtree (and the L leaves of each optimizer field mirroring them) are laid out as ONE stacked leaf,
exactly as the cost model's leaf table sees them, and the stacked layout is then given to each real
leaf without its layer dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TypeAlias

import jax
import numpy as np

from mistjax.core.jaxpr import Shaped
from mistjax.core.layout import OPT, OTHER, PARAM, LeafLayout, LeafRole, plan_layouts
from mistjax.core.plan import Plan
from mistjax.trace.unrolled import ParamGroups

Axes: TypeAlias = tuple[str | None, ...] | None

Token: TypeAlias = Hashable
"""One step of a key path as a plain value: a dict key, a sequence index or an attribute name."""

Tokens: TypeAlias = tuple[Token, ...]
"""A key path as plain tokens (`path_tokens`)."""

GroupKey: TypeAlias = tuple[Hashable, ...]
"""An unrolled stack's virtual leaf: ``("param", k)``, or ``("opt", k, prefix)`` for an optimizer field of it."""


def _token(key: jax.tree_util.KeyEntry) -> Token:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def path_tokens(path: jax.tree_util.KeyPath) -> Tokens:
    """A key path as plain tokens, without the trailing ``value`` of NNX variables / linen boxes."""
    toks = tuple(_token(k) for k in path)
    while toks and toks[-1] in ("value", "raw_value"):
        toks = toks[:-1]
    return toks


@dataclass(frozen=True)
class Mirror:
    """An optimizer-state leaf that mirrors a parameter."""

    param: int  # state index of the parameter leaf it mirrors
    prefix: Tokens  # its path before the parameter's path (e.g. ``("opt", 0, "mu")``): the field


def match_mirrors(state_paths: Sequence[jax.tree_util.KeyPath], state_shapes: Sequence[tuple[int, ...]],
                  params: dict[int, Tokens]) -> dict[int, Mirror]:
    """Optimizer leaves matched to parameters by tree path and shape.

    Args:
      state_paths: key path of every state leaf.
      state_shapes: shape of every state leaf.
      params: state index of each parameter leaf -> its path tokens inside the differentiated tree.
    Returns:
      state index -> `Mirror` for every non-parameter leaf whose path ends with a parameter's path and
      whose shape is that parameter's (the longest such path wins; scalars never mirror).
    """
    by_last: dict[Token, list[tuple[int, Tokens]]] = {}
    for i, toks in params.items():
        if toks:
            by_last.setdefault(toks[-1], []).append((i, toks))
    out: dict[int, Mirror] = {}
    for i, (path, shape) in enumerate(zip(state_paths, state_shapes)):
        if i in params or int(np.prod(shape)) <= 1:
            continue
        toks = path_tokens(path)
        if not toks:
            continue
        best: tuple[int, int, Tokens] | None = None
        for p, ptoks in by_last.get(toks[-1], ()):
            n = len(ptoks)
            fits = n <= len(toks) and toks[-n:] == ptoks and tuple(state_shapes[p]) == tuple(shape)
            if fits and (best is None or n > best[0]):
                best = (n, p, toks[:-n])
        if best is not None:
            out[i] = Mirror(param=best[1], prefix=best[2])
    return out


@dataclass(frozen=True)
class LeafRoles:
    """What every state leaf is (aligned with ``jax.tree.leaves(state)``)."""

    roles: tuple[LeafRole, ...]
    stacked: tuple[bool, ...]  # holds the layer stack on its leading dim
    axes: tuple[Axes, ...]  # logical axes (a mirror has its parameter's)
    mirrors: dict[int, Mirror]  # optimizer leaves mirroring a parameter
    # Unrolled stacks: per state leaf, (virtual group key, layer) for the layer leaves and their mirrors.
    layer_of: dict[int, tuple[GroupKey, int]] = dataclasses.field(default_factory=dict)
    num_layers: int = 0  # layers of the unrolled stack (0: none)


def state_roles(state_paths: Sequence[jax.tree_util.KeyPath], state_shapes: Sequence[tuple[int, ...]],
                state_axes: Sequence[Axes],
                params: dict[int, Tokens], param_order: Sequence[int], *,
                stacked_params: AbstractSet[int] = frozenset(), param_axes: dict[int, Axes] | None = None,
                groups: ParamGroups | None = None) -> LeafRoles:
    """Classify every state leaf.

    Args:
      state_paths / state_shapes / state_axes: per state leaf.
      params: state index -> path tokens inside the differentiated tree, for the parameter leaves.
      param_order: the state index of each leaf of the differentiated tree, in its flat order.
      stacked_params: state indices of stacked (scanned) layer parameters.
      param_axes: state index -> logical axes to use for a parameter (named or inferred); default its own.
      groups: the unrolled stack of the loss, if it has one (indices into the differentiated tree).
    """
    n = len(state_paths)
    mirrors = match_mirrors(state_paths, state_shapes, params)
    axes = list(state_axes)
    for i, ax in (param_axes or {}).items():
        axes[i] = ax
    roles, stacked = [OTHER] * n, [False] * n
    for i in range(n):
        if i in params:
            roles[i], stacked[i] = PARAM, i in stacked_params
        elif i in mirrors:
            p = mirrors[i].param
            roles[i], stacked[i], axes[i] = OPT, p in stacked_params, axes[p]
        elif state_axes[i] is not None:
            roles[i] = OPT  # optimizer state carrying its own logical names
    layer_of: dict[int, tuple[GroupKey, int]] = {}
    if groups is not None:
        real_to_state = list(param_order)
        for r, (k, layer) in groups.members().items():
            layer_of[real_to_state[r]] = (("param", k), layer)
        for i, m in mirrors.items():
            if m.param in layer_of:
                (_, param_key), layer = layer_of[m.param]
                layer_of[i] = (("opt", param_key, m.prefix), layer)
        # A mirror field that does not cover every layer is laid out leaf by leaf.
        counts: dict[GroupKey, int] = {}
        for key, _ in layer_of.values():
            counts[key] = counts.get(key, 0) + 1
        L = groups.num_layers
        layer_of = {i: v for i, v in layer_of.items() if counts[v[0]] == L}
    return LeafRoles(tuple(roles), tuple(stacked), tuple(axes), mirrors, layer_of,
                     groups.num_layers if groups is not None else 0)


def tensor_split_axes(axes: Sequence[Axes], shapes: Sequence[Sequence[int]], tp: int) -> list[Axes]:
    """``axes`` as ``tp``-way tensor parallelism lays the leaves out: a ``kv_heads`` dim that ``tp`` does not
    divide is kept whole, replicated on every device (`mistjax.analysis.tp_roles.kv_replicated_axes`), instead
    of being refused; every other name unchanged."""
    if tp <= 1:
        return list(axes)
    from mistjax.analysis.tp_roles import kv_replicated_axes  # here, not at import: the package loads sympy

    return [kv_replicated_axes(ax, tuple(shape), tp) for ax, shape in zip(axes, shapes)]


def state_layouts(leaves: Sequence[Shaped], info: LeafRoles, plan: Plan) -> list[LeafLayout]:
    """`plan_layouts` of every state leaf, the L leaves of an unrolled group laid out as one stacked leaf
    (key / value heads the tensor degree does not divide replicated: `tensor_split_axes`)."""
    firsts: dict[GroupKey, int] = {}
    members: dict[GroupKey, list[int]] = {}
    for i, (key, _layer) in sorted(info.layer_of.items(), key=lambda kv: kv[1][1]):
        members.setdefault(key, []).append(i)
        firsts.setdefault(key, i)
    v_leaves: list[Shaped] = []
    v_roles: list[LeafRole] = []
    v_stacked: list[bool] = []
    v_axes: list[Axes] = []
    v_of: list[int | GroupKey] = []  # per laid-out leaf: the state leaf it is, or the unrolled group
    for i, x in enumerate(leaves):
        group = info.layer_of.get(i)  # (its group, its layer) for a leaf of an unrolled group
        if group is not None and firsts[group[0]] != i:
            continue
        if group is not None:
            v_leaves.append(jax.ShapeDtypeStruct((info.num_layers, *np.shape(x)), x.dtype))
            ax = info.axes[i]
            v_axes.append(None if ax is None else ("layers", *ax))
            v_stacked.append(True)
            v_of.append(group[0])
        else:
            v_leaves.append(x)
            v_axes.append(info.axes[i])
            v_stacked.append(info.stacked[i])
            v_of.append(i)
        v_roles.append(info.roles[i])
    v_axes = tensor_split_axes(v_axes, [tuple(np.shape(x)) for x in v_leaves], plan.tp)
    v_layouts = plan_layouts(v_leaves, v_roles, v_stacked, plan, v_axes)
    out: list[LeafLayout | None] = [None] * len(leaves)
    for lay, of in zip(v_layouts, v_of):
        if isinstance(of, int):
            out[of] = lay
            continue
        for i in members[of]:
            out[i] = unstacked(lay, tuple(np.shape(leaves[i])), info.axes[i])
    return out  # type: ignore[return-value]


def unstacked(lay: LeafLayout, shape: tuple[int, ...], axes: Axes) -> LeafLayout:
    """The layout of one layer's leaf of a stacked layout (its layer dim dropped)."""
    return dataclasses.replace(lay, shape=shape, axes=axes, tensor_dims=tuple(d - 1 for d in lay.tensor_dims),
                               shard_dim=None if lay.shard_dim is None else lay.shard_dim - 1, stacked=False,
                               stage_split=False, layer_slice=True)


__all__ = ["GroupKey", "LeafRoles", "Mirror", "Token", "Tokens", "match_mirrors", "path_tokens", "state_layouts",
           "state_roles", "tensor_split_axes", "unstacked"]
