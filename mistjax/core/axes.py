"""Logical axis names of state leaves, as the model attached them (Flax NNX partition metadata)."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

Axes = tuple[str | None, ...]


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def leaf_axes(tree: Any) -> list[Axes | None]:
    """Logical axis names of each array leaf of `tree` (aligned with `jax.tree.leaves(tree)`)."""
    out: list[Axes | None] = []
    for node in jax.tree.leaves(tree, is_leaf=_is_variable):
        if _is_variable(node):
            names = node.get_metadata().get("out_sharding") or node.get_metadata().get("sharding")
            n_leaves = len(jax.tree.leaves(node))
            out.extend([tuple(names) if names else None] * n_leaves)
        else:
            out.append(None)
    return out


def is_stacked(axes: Axes | None) -> bool:
    """Whether a leaf with these logical axes holds the layer stack on its leading dim."""
    return bool(axes) and axes[0] == "layers"


__all__ = ["Axes", "is_stacked", "leaf_axes"]
