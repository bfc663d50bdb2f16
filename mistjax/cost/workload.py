"""`Workload`: what the cost model needs to know about one training job, without devices.

A workload is a model's symbolic profile (`mistjax.analysis`), the table of its parameter leaves
(shape, logical axes, stacked or not: the runtime lays out and offloads whole leaves, so the
model must see them too), the sequence length, the global batch and the optimizer. Profiles are
cached by (model config, policies) because the analysis traces the loss at seven sizes (seconds).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mistjax.analysis import CompiledProfile, ModelProfile, analyze_model, compile_profile

# Optimizer state per parameter element: (fp32 state copies, elementwise FLOPs, transcendentals).
# AdamW: mu and nu; the FLOP count is what XLA:CPU's cost analysis reports for optax.adamw's
# update of one element (bias corrections, decay, sqrt, divide, apply_updates), measured on the grid.
OPTIMIZERS: dict[str, tuple[int, float, float]] = {
    "adamw": (2, 17.0, 1.0),
    "adam": (2, 15.0, 1.0),
    "sgd": (0, 2.0, 0.0),
    "momentum": (1, 5.0, 0.0),
}
_PROFILE_CACHE: dict[Any, tuple[ModelProfile, CompiledProfile, tuple]] = {}


@dataclass(frozen=True)
class ParamLeaf:
    """One parameter leaf as the runtime sees it."""

    shape: tuple[int, ...]  # global shape (stacked leaves start with the layer dim)
    axes: tuple[str | None, ...] | None  # logical axis names (None: the model gave none)
    stacked: bool  # holds the layer stack on its leading dim
    itemsize: int  # bytes per element (param dtype; fp32 master weights)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Workload:
    """One training job: model profile, parameter leaves, sequence length, batch and optimizer."""

    name: str  # model name (informational; part of the fingerprint)
    profile: ModelProfile  # symbolic per-device profile of pre / block / post
    compiled: CompiledProfile = field(repr=False, compare=False)  # vectorised evaluation of `profile`
    leaves: tuple[ParamLeaf, ...] = field(repr=False)  # every parameter leaf in flat order
    seq_len: int = 1024  # tokens per sequence
    global_batch: int = 1  # sequences per optimizer step
    optimizer: str = "adamw"  # key of OPTIMIZERS
    config: Any = field(default=None, repr=False, compare=False)  # the models.ModelConfig, if built from one

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}")

    # ------------------------------------------------------------------------------ constructors
    @classmethod
    def from_model(cls, config: Any, seq_len: int, global_batch: int, optimizer: str = "adamw",
                   policies: tuple[str, ...] | None = None) -> Workload:
        """Analyse ``config``'s loss abstractly (no parameters are allocated).

        Args:
          config: a `models.ModelConfig`.
          seq_len: sequence length.
          global_batch: sequences per step.
          optimizer: ``adamw`` (default), ``adam``, ``sgd`` or ``momentum``.
          policies: remat policies to analyse (default: the analysis's defaults).
        """
        from flax import nnx

        import models
        from mistjax.runtime.sharding import leaf_axes
        from mistjax.train.loss import make_loss_fn

        abstract = nnx.eval_shape(lambda: models.build(config, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(abstract, nnx.Param)
        key = (config, None if policies is None else tuple(policies))
        if key not in _PROFILE_CACHE:
            prof = analyze_model(make_loss_fn(graphdef), params, policies=policies)
            _PROFILE_CACHE[key] = (prof, compile_profile(prof), ())
        prof, comp, _ = _PROFILE_CACHE[key]
        return cls(name=config.name, profile=prof, compiled=comp, leaves=_leaf_table(params, leaf_axes(params)),
                   seq_len=seq_len, global_batch=global_batch, optimizer=optimizer, config=config)

    @classmethod
    def from_train_step(cls, loss_fn: Any, params: Any, seq_len: int, global_batch: int, optimizer: str = "adamw",
                        name: str = "custom", policies: tuple[str, ...] | None = None) -> Workload:
        """Analyse an arbitrary loss ``loss_fn(params, batch)`` over token batches (see `analyze_model`)."""
        from mistjax.runtime.sharding import leaf_axes

        prof = analyze_model(loss_fn, params, policies=policies)
        return cls(name=name, profile=prof, compiled=compile_profile(prof),
                   leaves=_leaf_table(params, leaf_axes(params)), seq_len=seq_len, global_batch=global_batch,
                   optimizer=optimizer)

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
        return OPTIMIZERS[self.optimizer][0]

    def policy_index(self, name: str) -> int:
        """Index of a remat policy name (``none`` for layers that are not checkpointed)."""
        if name not in self.policies:
            raise ValueError(f"remat policy {name!r} was not analysed for {self.name}; analysed: "
                             f"{', '.join(self.policies)} (pass policies=... to Workload.from_model)")
        return self.policies.index(name)

    def tags(self) -> tuple[str, ...]:
        return self.profile.tags

    def offload_policy(self) -> str | None:
        """The analysed policy equal to what activation offload keeps: every checkpoint_name tag."""
        tags = self.profile.tags
        name = "names:" + ",".join(tags) if tags else None
        return name if name in self.policies else None

    def fingerprint(self) -> str:
        """Short stable hash of the model, its sizes, the batch and the optimizer."""
        doc = {"name": self.name, "seq": self.seq_len, "batch": self.global_batch, "opt": self.optimizer,
               "leaves": [[list(x.shape), x.itemsize, x.stacked] for x in self.leaves],
               "layers": self.num_layers}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _leaf_table(params: Any, axes: list[Any]) -> tuple[ParamLeaf, ...]:
    import jax

    out = []
    for leaf, ax in zip(jax.tree.leaves(params), axes):
        shape = tuple(int(d) for d in np.shape(leaf))
        out.append(ParamLeaf(shape=shape, axes=ax, stacked=bool(ax) and ax[0] == "layers",
                             itemsize=np.dtype(leaf.dtype).itemsize))
    return tuple(out)


__all__ = ["OPTIMIZERS", "ParamLeaf", "Workload"]
