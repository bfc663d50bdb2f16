"""Remat and offload policies by the names plans use (``full``, ``dots``, ``names:a,b``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias

import jax

from mistjax.core.plan import PlanError

CheckpointPolicy: TypeAlias = Callable[..., bool]
"""What ``jax.checkpoint(policy=...)`` takes, as JAX annotates it: ``(primitive, *avals, **params) -> saveable``
(an offload policy answers with JAX's offload marker in place of True)."""

# `checkpoint_name` tag of a weight fetched inside a layer (ZeRO-3 gather, host->device copy).
GATHERED = "mistjax_gathered_weight"
_cp = jax.checkpoint_policies


def remat_policy(name: str) -> CheckpointPolicy:
    """The `jax.checkpoint` policy for a plan's remat policy name."""
    if name == "full":
        return _cp.nothing_saveable
    if name == "dots":
        return _cp.dots_with_no_batch_dims_saveable
    if name.startswith("names:"):
        names = [n.strip() for n in name[len("names:"):].split(",") if n.strip()]
        return _cp.save_only_these_names(*names)
    raise PlanError(f"unknown remat policy {name!r}; use full, dots or names:a,b")


def offload_policy(names: Sequence[str]) -> CheckpointPolicy:
    """Offload the tagged activations of a layer to host memory and recompute the rest in backward."""
    return _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[n for n in names if n != GATHERED],
        offload_src="device", offload_dst="pinned_host")


__all__ = ["GATHERED", "CheckpointPolicy", "offload_policy", "remat_policy"]
