"""Logical axis names of state leaves, as the model attached them: Flax NNX partition metadata
(``nnx.with_partitioning``) and flax.linen boxes (``nn.with_logical_partitioning`` / ``nn.Partitioned``,
kept in the parameter tree as ``flax.core.meta.Partitioned``), optionally renamed by user logical-axis
rules (MaxText style, `apply_axis_rules`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import jax
from flax import nnx
from flax.core import meta

from mistjax.core.types import PyTree

Axes: TypeAlias = tuple[str | None, ...]
"""Logical axis names of one leaf, one per dim (None: a dim without a name)."""

AxisRule: TypeAlias = tuple[str, str | Sequence[str | None] | None]
"""One MaxText-style rule: a logical axis name and the mesh axis (or axes, or None) it maps to."""

AxisRules: TypeAlias = Sequence[AxisRule]
"""MaxText-style logical-axis rules ``[(logical, mesh_axes), ...]`` (`apply_axis_rules`)."""


def _is_variable(x: object) -> bool:
    return isinstance(x, nnx.Variable | meta.Partitioned)


def leaf_axes(tree: PyTree) -> list[Axes | None]:
    """Logical axis names of each array leaf of `tree` (aligned with `jax.tree.leaves(tree)`)."""
    out: list[Axes | None] = []
    for node in jax.tree.leaves(tree, is_leaf=_is_variable):
        names: Sequence[str | None] | None
        if isinstance(node, meta.Partitioned):
            names = node.names
        elif isinstance(node, nnx.Variable):
            names = node.get_metadata().get("out_sharding") or node.get_metadata().get("sharding")
        else:
            out.append(None)
            continue
        n_leaves = len(jax.tree.leaves(node))
        out.extend([tuple(names) if names else None] * n_leaves)
    return out


# What a logical axis becomes under user rules: split over `tensor` (a name the layout rules split) or kept
# whole (a name they never split).
_TENSOR_MARK, _WHOLE_MARK = "mlp", "embed"


def apply_axis_rules(axes: Sequence[Axes | None], rules: AxisRules | None) -> list[Axes | None]:
    """Logical axes renamed by MaxText-style rules ``[(logical, mesh_axes), ...]``.

    A logical name whose rule maps it to a mesh axis named ``tensor`` (or a tuple holding it) is split
    over the tensor-parallel axis; a name with a rule to anything else (None, ``fsdp``, ...) stays whole
    under tensor parallelism; names without a rule keep their meaning (`mistjax.core.layout.TENSOR_AXES`).
    """
    if not rules:
        return list(axes)
    table: dict[str, bool] = {}
    for rule in rules:
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"axis rule {rule!r} is not a (logical name, mesh axes) pair; write rules as "
                             "[('mlp', 'tensor'), ('embed', None), ...]")
        name, target = rule
        targets = target if isinstance(target, tuple | list) else (target,)
        table.setdefault(name, "tensor" in targets)
    out: list[Axes | None] = []
    for ax in axes:
        if ax is None:
            out.append(None)
            continue
        out.append(tuple(n if n not in table or n == "layers" else _TENSOR_MARK if table[n] else _WHOLE_MARK
                         for n in ax))
    return out


def is_stacked(axes: Axes | None) -> bool:
    """Whether a leaf with these logical axes holds the layer stack on its leading dim."""
    return axes is not None and len(axes) > 0 and axes[0] == "layers"


__all__ = ["Axes", "AxisRule", "AxisRules", "apply_axis_rules", "is_stacked", "leaf_axes"]
