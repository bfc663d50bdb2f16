"""Remat (activation checkpointing) policies by name, and the layer loop that applies them.

A stage with ``l`` layers and ``remat_layers = c`` runs its first ``l - c`` layers normally and
checkpoints the last ``c`` (Mist's convention: the last blocks of a stage are recomputed, since
their activations would be freed soonest anyway). ZeRO-3 weight gathers happen inside each
layer and are tagged `GATHERED`. A checkpointed layer gathers again in its backward pass; a plain
layer's backward still finds views of the gathered weights among its residuals (a name-based policy
saves the untagged value that feeds a tag), so ZeRO-3 saves weight memory on checkpointed layers
only. The cost model charges one fetched layer per plain layer; a per-layer custom VJP that drops
weight-only residuals (as `runtime.pipeline` does) would remove it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from mistjax.plan import PlanError

GATHERED = "mistjax_gathered_weight"
cp = jax.checkpoint_policies


def remat_policy(name: str) -> Callable[..., Any]:
    """The `jax.checkpoint` policy for a plan's remat policy name."""
    if name == "full":
        return cp.nothing_saveable
    if name == "dots":
        return cp.dots_with_no_batch_dims_saveable
    if name.startswith("names:"):
        names = [n.strip() for n in name[len("names:"):].split(",") if n.strip()]
        return cp.save_only_these_names(*names)
    raise PlanError(f"unknown remat policy {name!r}; use full, dots or names:a,b")


# Saves every residual except gathered weights: a non-checkpointed layer that gathers its
# weights keeps its activations but re-gathers in the backward pass (ZeRO-3 semantics).
SAVE_ALL_BUT_GATHERED = cp.save_anything_except_these_names(GATHERED)


def offload_policy(names: Sequence[str]) -> Callable[..., Any]:
    """Offload the tagged activations of a layer to host memory and recompute the rest in backward."""
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[n for n in names if n != GATHERED],
        offload_src="device", offload_dst="pinned_host")


def layer_segments(num_layers: int, remat_layers: int, offload_layers: int) -> list[tuple[int, int, str]]:
    """Split a stage's layers into (start, end, kind) runs: offloaded, plain, checkpointed.

    The first layers offload their activations (their activations wait longest for the backward
    pass), the last `remat_layers` are recomputed, the rest keep their activations on device.
    """
    n_remat = min(remat_layers, num_layers)
    n_off = min(offload_layers, num_layers - n_remat)
    n_plain_end = num_layers - n_remat
    bounds = [(0, n_off, "offload"), (n_off, n_plain_end, "plain"), (n_plain_end, num_layers, "remat")]
    return [b for b in bounds if b[1] > b[0]]


def offloaded_layers(num_layers: int, remat_layers: int, ratio: float) -> int:
    """Layers whose activations go to host for an activation offload `ratio` (of the non-remat layers)."""
    return int(round(ratio * (num_layers - min(remat_layers, num_layers))))


def make_layer_loop(*, num_layers: int, remat_layers: int, policy: str,
                    gather: Sequence[Callable[[Any], Any] | None],
                    carry_constraint: Callable[[Any], Any] | None = None,
                    offload_layers: int = 0, offload_names: Sequence[str] = (),
                    ) -> Callable[..., tuple[list[Any], list[Any]]]:
    """A layer loop for `mistjax.trace.split.evaluate`.

    Args:
      num_layers: layers in the stack this loop runs.
      remat_layers: the last `remat_layers` layers are checkpointed with `policy`.
      policy: remat policy name (full | dots | names:a,b).
      gather: per scanned operand, a function that turns one layer's stored slice into the
        slice used for compute (e.g. an all-gather over the ZeRO axis), or None.
      carry_constraint: applied to the hidden state between layers (sequence parallelism).
      offload_layers: the first `offload_layers` layers offload their tagged activations to host.
      offload_names: the checkpoint_name tags of a layer (what offloading moves).
    """
    any_gather = any(g is not None for g in gather)

    def loop(body: Callable[..., Any], consts: list[Any], carry: list[Any], xs: list[Any]
             ) -> tuple[list[Any], list[Any]]:
        def layer(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            x = [xi if g is None else checkpoint_name(g(xi), GATHERED) for g, xi in zip(gather, x)]
            c, y = body(consts, c, x)
            if carry_constraint is not None:
                c = [carry_constraint(ci) for ci in c]
            return c, y

        fns = {"plain": jax.checkpoint(layer, policy=SAVE_ALL_BUT_GATHERED) if any_gather else layer,
               "remat": jax.checkpoint(layer, policy=remat_policy(policy)),
               "offload": jax.checkpoint(layer, policy=offload_policy(offload_names))}
        ys_parts = []
        for start, end, kind in layer_segments(num_layers, remat_layers, offload_layers):
            fn = fns[kind]
            seg = xs if (start, end) == (0, num_layers) else [x[start:end] for x in xs]
            # With per-layer fetches (ZeRO-3 gathers, host->device weight copies), two layers per loop
            # iteration let the scheduler fetch layer i+1 while layer i computes (a double buffer; the
            # cost model charges two layers of fetched weights).
            carry, ys = jax.lax.scan(fn, carry, seg, unroll=2 if any_gather and end - start > 1 else 1)
            ys_parts.append(ys)
        if len(ys_parts) == 1:
            return carry, ys_parts[0]
        return carry, [jax.numpy.concatenate(parts) for parts in zip(*ys_parts)]

    return loop
