"""`Workload`: what the cost model needs to know about one training job, without devices.

A workload is a model's symbolic profile (`mistjax.analysis`), the table of its parameter leaves
(shape, logical axes, stacked or not: the runtime lays out and offloads whole leaves, so the
model must see them too), the sequence length, the global batch and the optimizer. It knows no
model zoo: `models.workload` builds one for a zoo config, `mistjax.autoshard` for the user's loss.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from mistjax.analysis import CompiledProfile, ModelProfile, analyze_model, compile_profile, first_trace, token_batch
from mistjax.analysis.tp_roles import (
    TENSOR_AXES_KV_REPLICATED,
    kv_head_sizes,
    kv_replicated_axes,
    model_tensor_axes,
)
from mistjax.core.axes import Axes, AxisRules, is_stacked, leaf_axes
from mistjax.core.context import ContextForm, ulysses_supported
from mistjax.core.layout import TENSOR_AXES
from mistjax.core.types import LossFn, PyTree
from mistjax.cost.kv_regimes import KVRegimes
from mistjax.trace.split import TracedLoss, part_usage

Analyze = Callable[[tuple[str, ...]], ModelProfile]
"""``analyze(tensor_axes) -> profile``: the loss analysed with those logical names split over ``tensor``."""

# Optimizer state per parameter element: (fp32 state copies, elementwise FLOPs, transcendentals).
# AdamW: mu and nu; the FLOP count is what XLA:CPU's cost analysis reports for optax.adamw's
# update of one element (bias corrections, decay, sqrt, divide, apply_updates), measured on the grid.
OPTIMIZERS: dict[str, tuple[int, float, float]] = {
    "adamw": (2, 17.0, 1.0),
    "adam": (2, 15.0, 1.0),
    "sgd": (0, 2.0, 0.0),
    "momentum": (1, 5.0, 0.0),
}


@dataclass(frozen=True)
class ParamLeaf:
    """One parameter leaf as the runtime sees it."""

    shape: tuple[int, ...]  # global shape (stacked leaves start with the layer dim)
    axes: tuple[str | None, ...] | None  # logical axis names (None: the model gave none)
    stacked: bool  # holds the layer stack on its leading dim
    itemsize: int  # bytes per element (the parameter's storage dtype)
    # Non-stacked leaves: which parts around the stack read it ("pre": the first pipeline stage holds it,
    # "post": the last stage; both for tied weights). Empty: unknown (held with the pre part).
    parts: frozenset[str] = frozenset()

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Workload:
    """One training job: model profile, parameter leaves, sequence length, batch and optimizer."""

    name: str  # model name (informational; part of the fingerprint)
    profile: ModelProfile  # symbolic per-device profile of pre / block / post (kv heads split: `profile_for`)
    # Vectorised evaluation of `profile`; a `KVRegimes` when some tensor degrees replicate the kv heads.
    compiled: CompiledProfile | KVRegimes = field(repr=False, compare=False)
    leaves: tuple[ParamLeaf, ...] = field(repr=False)  # every parameter leaf in flat order
    seq_len: int = 1024  # tokens per sequence
    global_batch: int = 1  # sequences per optimizer step
    optimizer: str = "adamw"  # key of OPTIMIZERS (state copies per parameter, update FLOPs)
    compute_dtype: str = "float32"  # dtype the matmuls run in (fp32 runs at the device's fp32 peak)
    master_weights: bool = False  # the optimizer state also holds a master copy of every parameter
    state_itemsize: int = 4  # bytes per element of each optimizer-state copy (fp32 moments and master)
    grad_dtype: str | None = None  # dtype gradients are accumulated and reduced in (None: the parameters')
    # Stacked-weight gradients are added into the accumulator inside the backward layer loop (one buffer,
    # `runtime.accumulate`); False for an unrolled stack, whose micro-batch gradient is whole first.
    layer_grads_in_loop: bool = True
    # Per-device state totals by knob combination (`cost.layout.totals_over`), leaf selections and kernel
    # tables: lives with the workload. Values differ by key: each owner reads back what it stored.
    layout_cache: dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}")

    # ------------------------------------------------------------------------------ constructors
    @classmethod
    def from_loss(cls, loss_fn: LossFn, params: PyTree, *, seq_len: int, global_batch: int, optimizer: str = "adamw",
                  name: str = "custom", policies: tuple[str, ...] | None = None, compute_dtype: str = "float32",
                  master_weights: bool = False, state_itemsize: int = 4, grad_dtype: str | None = None,
                  batch_fn: Callable[[int, int], tuple[PyTree, ...]] | None = None,
                  profile: ModelProfile | None = None, cache: bool | str | Path = True,
                  axis_rules: AxisRules | None = None, analyze: Analyze | None = None) -> Workload:
        """Analyse ``loss_fn(params, batch)`` over token batches (`mistjax.analysis.analyze_model`).

        Args:
          loss_fn: the loss, ``loss_fn(params, *batch_fn(b, s)) -> scalar``.
          params: its parameters (arrays or ``jax.ShapeDtypeStruct``s; NNX state keeps logical axes).
          seq_len: tokens per sequence.
          global_batch: sequences per step.
          optimizer: key of `OPTIMIZERS`.
          name: model name (informational; part of the fingerprint).
          policies: remat policies to analyse (default: the analysis's defaults).
          compute_dtype: dtype the matmuls run in (``float32`` prices them at the fp32 peak).
          master_weights: the optimizer keeps a master copy of the (16-bit) parameters
            (`mistjax.api.precision.with_master_weights`).
          state_itemsize: bytes per element of each optimizer-state copy.
          grad_dtype: dtype gradients are accumulated and reduced in (None: the parameters' own).
          batch_fn: ``(b, s) -> (batch, ...)``, the loss's other arguments at micro-batch ``b`` and sequence
            length ``s`` (default: int32 ``{"inputs", "targets"}`` token batches).
          profile: an already computed profile of this loss (skips the analysis with the default tensor axes).
          cache: the on-disk profile cache (`mistjax.analysis.cache`): True for the default directory, a
            path, or False.
          axis_rules: MaxText-style logical-axis rules (`mistjax.core.axes.apply_axis_rules`). Without any
            weight naming a tensor-split axis, the Megatron splits are inferred from the dataflow
            (`mistjax.analysis.tp_roles`), as the runtime does.
          analyze: ``analyze(tensor_axes) -> profile`` (`Analyze`), e.g. a memoised one; default
            `mistjax.analysis.analyze_model` of this loss. A model naming ``kv_heads`` dims is analysed a second
            time with them replicated, on first use of a degree that does not divide them (`KVRegimes`).
        """
        batch = batch_fn or token_batch
        traced = first_trace(loss_fn, params, batch, seq_len)  # at no sequence longer than seq_len
        axes = model_tensor_axes(traced, params, axis_rules)
        if analyze is None:
            def analyze(tensor_axes: tuple[str, ...]) -> ModelProfile:
                return analyze_model(loss_fn, params, batch, policies=policies, cache=cache, param_axes=axes,
                                     tensor_axes=tensor_axes, seq_len=seq_len)
        prof = profile if profile is not None else analyze(TENSOR_AXES)
        base = compile_profile(prof)
        kv = kv_head_sizes(axes, [np.shape(x) for x in jax.tree.leaves(params)])
        compiled: CompiledProfile | KVRegimes = (
            KVRegimes(base, kv, lambda: analyze(TENSOR_AXES_KV_REPLICATED)) if kv else base)
        return cls(name=name, profile=prof, compiled=compiled,
                   leaves=leaf_table(params, traced, axes=axes),
                   seq_len=seq_len, global_batch=global_batch, optimizer=optimizer, compute_dtype=compute_dtype,
                   master_weights=master_weights, state_itemsize=state_itemsize, grad_dtype=grad_dtype,
                   layer_grads_in_loop=traced.groups is None)

    # ------------------------------------------------------------------------------ derived
    @property
    def policies(self) -> tuple[str, ...]:
        """Remat policies the block was analysed for; `StageStrategies.policy` indexes this tuple."""
        return self.profile.block.policies

    @property
    def num_layers(self) -> int:
        return self.profile.num_layers

    @property
    def opt_copies(self) -> int:
        """Parameter-sized arrays in the optimizer state (moments, plus the master copy)."""
        return OPTIMIZERS[self.optimizer][0] + int(self.master_weights)

    @property
    def param_itemsize(self) -> int:
        """Bytes per element of the layer stack's parameters (their storage dtype)."""
        return next((x.itemsize for x in self.leaves if x.stacked), self.leaves[0].itemsize if self.leaves else 4)

    @property
    def grad_scale(self) -> float:
        """Gradient bytes per parameter byte (the gradient dtype against the storage dtype)."""
        return np.dtype(self.grad_dtype).itemsize / self.param_itemsize if self.grad_dtype else 1.0

    def grad_itemsize(self, leaf: ParamLeaf) -> int:
        """Bytes per element of a leaf's gradient accumulator and reductions."""
        return np.dtype(self.grad_dtype).itemsize if self.grad_dtype else leaf.itemsize

    def policy_index(self, name: str) -> int:
        """Index of a remat policy name (``none`` for layers that are not checkpointed)."""
        if name not in self.policies:
            raise ValueError(f"remat policy {name!r} was not analysed for {self.name}; analysed: "
                             f"{', '.join(self.policies)} (pass policies=... when building the workload)")
        return self.policies.index(name)

    def tags(self) -> tuple[str, ...]:
        return self.profile.tags

    def offload_policy(self) -> str | None:
        """The analysed policy equal to what activation offload keeps: every checkpoint_name tag."""
        tags = self.profile.tags
        name = "names:" + ",".join(tags) if tags else None
        return name if name in self.policies else None

    def supports_tp(self, tp: int) -> bool:
        """Whether tensor parallelism of degree ``tp`` applies: some weight names a tensor-split axis, every
        such dim divides by ``tp`` (key / value heads it does not divide are replicated instead), and so do the
        split sizes the analysis of that regime found (heads, MLP width, ...)."""
        if tp == 1:
            return True
        dims = [d for x in self.leaves if x.axes is not None and len(x.axes) == len(x.shape)
                for d, n in zip(x.shape, kv_replicated_axes(x.axes, x.shape, tp) or ()) if n in TENSOR_AXES]
        if not dims or any(d % tp for d in dims):
            return False
        return bool(np.all(self.compiled.feasible(1, self.seq_len, tp)))

    def supports_cp(self, cp: int, tp: int = 1) -> bool:
        """Whether context parallelism of degree ``cp`` applies with tensor parallelism of degree ``tp``: the
        sequence splits into ``2 cp`` chunks (the ring's balanced causal split, docs/context-parallel.md) and each
        device's part of it ``tp`` ways (sequence parallelism)."""
        return cp == 1 or (self.seq_len % (2 * cp) == 0 and (self.seq_len // cp) % tp == 0)

    def context_forms(self, cp: int, tp: int = 1) -> tuple[str, ...]:
        """The context-parallel forms (`core.context.ContextForm`) that split this model's sequence ``cp`` ways
        with TP ``tp``: the ring wherever `supports_cp`, and Ulysses where the heads split too
        (`core.context.ulysses_supported`; only for a model whose leaves name their ``heads`` / ``kv_heads``)."""
        if not self.supports_cp(cp, tp):
            return ()
        if cp == 1:
            return (ContextForm.RING.value,)
        heads = self.attention_heads()
        ulysses = heads is not None and ulysses_supported(*heads, cp, tp) is None
        return (ContextForm.RING.value, ContextForm.ULYSSES.value) if ulysses else (ContextForm.RING.value,)

    def attention_heads(self) -> tuple[int, int] | None:
        """(query heads, key / value heads) from the leaves' logical names (``heads`` / ``kv_heads`` dims; a model
        naming only ``heads`` has as many kv heads), or None when no leaf names them."""
        heads, kv = self._largest_dim("heads"), self._largest_dim("kv_heads")
        return (heads, kv or heads) if heads else None

    def _largest_dim(self, name: str) -> int:
        return max((d for x in self.leaves if x.axes is not None and len(x.axes) == len(x.shape)
                    for d, n in zip(x.shape, x.axes) if n == name), default=0)

    @property
    def ring_attention(self) -> bool:
        """Whether the layer's attention is the blockwise fused kernel, which the runtime runs as the ring kernel
        under context parallelism (`runtime.context_block`); otherwise GSPMD gathers the keys and values whole."""
        return self.profile.block.fused_flops != 0

    def kv_share(self) -> float:
        """Key / value heads per query head, from the leaves' logical names (``kv_heads`` and ``heads`` dims;
        1.0, multi-head attention, when the model names neither): the size of K and V relative to Q, which
        context parallelism moves between devices."""
        kv, heads = self._largest_dim("kv_heads"), self._largest_dim("heads")
        return kv / heads if kv and heads else 1.0

    def profile_for(self, tp: int) -> ModelProfile:
        """The symbolic profile that prices ``tp``-way tensor parallelism: `profile`, or the analysis with the
        key / value heads replicated where ``tp`` does not divide them."""
        if isinstance(self.compiled, KVRegimes) and bool(self.compiled.replicated_at(tp)):
            return self.compiled.replicated.profile
        return self.profile

    def fingerprint(self) -> str:
        """Short stable hash of the model, its sizes, the batch and the optimizer."""
        doc = {"name": self.name, "seq": self.seq_len, "batch": self.global_batch, "opt": self.optimizer,
               "master": self.master_weights, "state_itemsize": self.state_itemsize, "grad_dtype": self.grad_dtype,
               "leaves": [[list(x.shape), x.itemsize, x.stacked] for x in self.leaves],
               "layers": self.num_layers}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def leaf_table(params: PyTree, traced: TracedLoss | None = None, *, axes: Sequence[Axes | None] | None = None
               ) -> tuple[ParamLeaf, ...]:
    """The `ParamLeaf` of every leaf of a parameter pytree, as the runtime lays them out.

    Args:
      params: the parameters.
      traced: the traced loss. Its layer scan says which leaves are stacked, and which part (pre / post
        the layers) reads each other leaf (`trace.split.part_usage`); an unrolled layer stack's L
        per-layer leaves of each place count as ONE stacked leaf (`mistjax.runtime.leaves.state_layouts`).
      axes: logical axes per leaf (default: from the partition metadata).
    """
    leaves = jax.tree.leaves(params)
    axes = leaf_axes(params) if axes is None else list(axes)
    stacked = [is_stacked(ax) for ax in axes]
    groups = traced.groups if traced is not None else None
    usage = None
    if groups is not None:
        leaves, axes = groups.virtual_avals(leaves), groups.virtual_axes(axes)
        stacked = [isinstance(v, tuple) or is_stacked(ax) for v, ax in zip(groups.virtual, axes)]
    elif traced is not None and traced.stack is not None:
        layer_leaves = set(traced.stack.stacked_leaves)
        stacked = [i in layer_leaves for i in range(len(leaves))]
        usage = part_usage(traced)
    out = []
    for i, (leaf, ax, st) in enumerate(zip(leaves, axes, stacked)):
        shape = tuple(int(d) for d in np.shape(leaf))
        parts = frozenset() if usage is None or st else frozenset(
            name for name, used in (("pre", usage.pre), ("post", usage.post)) if i in used)
        out.append(ParamLeaf(shape=shape, axes=ax, stacked=st, itemsize=np.dtype(leaf.dtype).itemsize, parts=parts))
    return tuple(out)


__all__ = ["OPTIMIZERS", "ParamLeaf", "Workload", "leaf_table"]
