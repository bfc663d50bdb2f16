"""The placed state of an MPMD plan: each array leaf as a `StagedArray` of per-stage pieces.

Under an MPMD pipeline a leaf of the train state lives on several sub-meshes at once: a stacked layer
parameter (and its gradient accumulator and optimizer state) in one piece of rows per stage, the
embedding on the first stage, the head on the last, a tied embedding on both, the step counter on
every stage. Each piece has its own sharding and memory kind (the stage's ZeRO level and offload).

`ShardedStep.place(state)` and ``step(state, batch)`` therefore return the user's pytree with every
array leaf replaced by a `StagedArray` (a registered pytree node): attribute access such as
``state.params`` keeps working, ``jax.tree.map`` maps over the pieces, ``jax.tree_util`` paths name
them (``params/layers/mlp/wi/value/stage2``, so orbax saves and restores each piece with its own
sharding), and ``np.asarray(leaf)`` or ``step.gather(state)`` rebuilds the whole arrays on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias, TypeGuard, cast

import jax
import numpy as np
import numpy.typing as npt

from mistjax.core.types import PyTree, State

LeafFn: TypeAlias = Callable[[list[jax.Array]], jax.Array]
"""``fn(leaves) -> rows``: one result row per leaf (`per_leaf_on_host`)."""


@dataclass(frozen=True)
class StagedInfo:
    """Where a leaf's pieces live (static: part of the pytree structure)."""

    rows: bool  # True: pieces are row blocks of dim 0 by layer range; False: identical whole copies
    stages: tuple[int, ...]  # the (virtual) stages holding a piece, in piece order
    shape: tuple[int, ...]  # the whole leaf's shape
    dtype: str  # its dtype name
    bounds: tuple[tuple[int, int], ...] = ()  # rows: the row range of each piece


@jax.tree_util.register_pytree_with_keys_class
class StagedArray:
    """One state leaf of an MPMD plan as per-stage pieces (see module docstring)."""

    def __init__(self, pieces: Sequence[PyTree], info: StagedInfo):
        self.pieces = tuple(pieces)
        self.info = info

    # pytree protocol
    def tree_flatten_with_keys(self) -> tuple[list[tuple[jax.tree_util.GetAttrKey, PyTree]], StagedInfo]:
        return [(jax.tree_util.GetAttrKey(f"stage{k}"), p) for k, p in zip(self.info.stages, self.pieces)], self.info

    def tree_flatten(self) -> tuple[tuple[PyTree, ...], StagedInfo]:
        return self.pieces, self.info

    @classmethod
    def tree_unflatten(cls, info: StagedInfo, pieces: Sequence[PyTree]) -> StagedArray:
        return cls(pieces, info)

    # array-like metadata of the whole leaf
    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.info.dtype)

    @property
    def ndim(self) -> int:
        return len(self.info.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.info.shape))

    def piece(self, stage: int) -> PyTree:
        """The piece held by `stage` (raises KeyError if it holds none)."""
        return self.pieces[self.info.stages.index(stage)]

    def __array__(self, dtype: npt.DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        out = gather_leaf(self)
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        where = "rows over stages" if self.info.rows else "copies on stages"
        return f"StagedArray(shape={self.shape}, dtype={self.info.dtype}, {where} {list(self.info.stages)})"


def is_staged(x: object) -> TypeGuard[StagedArray]:
    return isinstance(x, StagedArray)


def _host(piece: jax.Array | np.ndarray) -> np.ndarray:
    if isinstance(piece, jax.Array) and not piece.is_fully_addressable:
        raise ValueError("this process holds only part of a pipelined state leaf; gather it with "
                         "ShardedStep.gather(state), which brings every piece to each process")
    return np.asarray(piece)


def gather_leaf(x: StagedArray) -> np.ndarray:
    """The whole leaf on the host (rows concatenated; the first copy of a replicated leaf)."""
    if x.info.rows:
        return np.concatenate([_host(p) for p in x.pieces], axis=0)
    return _host(x.pieces[0])


def gather_state(state: State) -> PyTree:
    """The user's structure with every `StagedArray` replaced by its whole host array."""
    return jax.tree.map(lambda x: gather_leaf(x) if is_staged(x) else x, state, is_leaf=is_staged)


@functools.cache
def _jit(fn: LeafFn) -> LeafFn:
    return jax.jit(fn)


def per_leaf_on_host(fn: LeafFn, leaves: Sequence[jax.Array]) -> np.ndarray:
    """``fn(leaves)`` (jitted; one result row per leaf) for leaves that may live on different sub-meshes.

    One jitted call cannot mix arrays of different device sets, so the leaves are grouped by device
    set and `fn` runs once per group; the rows come back in leaf order as a host array, on every
    process. In a multi-process run each group's (small) result is sent to every group's devices
    (``jax.device_put`` between meshes of one shape, which JAX's cross-host transfers require), so each
    process reads all rows from devices it holds.
    """
    jitted = _jit(fn)
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    if len(groups) == 1:
        return np.asarray(jitted(list(leaves)))
    me = jax.process_index()
    rows: list[np.ndarray | None] = [None] * len(leaves)
    # Stage state lives on its stage's mesh: every leaf has a NamedSharding.
    meshes = [cast(jax.sharding.NamedSharding, leaves[idx[0]].sharding).mesh for idx in groups.values()]
    for mesh, idx in zip(meshes, groups.values()):
        part = [leaves[i] for i in idx]
        local = any(d.process_index == me for d in mesh.devices.flat)
        if jax.process_count() == 1:
            out = np.asarray(jitted(part))
        else:
            shape = jax.eval_shape(fn, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in part])
            src = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            value = jax.device_put(jitted(part), src) if local else \
                jax.make_array_from_single_device_arrays(shape.shape, src, [], dtype=shape.dtype)
            out = None
            for other in meshes:  # the same transfers in the same order on every process
                dst = jax.sharding.NamedSharding(other, jax.sharding.PartitionSpec())
                mine = any(d.process_index == me for d in other.devices.flat)
                if other is not mesh and not (local or mine):
                    continue
                copy = value if other is mesh else jax.device_put(value, dst)
                if mine and out is None:
                    out = np.asarray(copy.addressable_shards[0].data)
        assert out is not None, "every process holds a device of some stage, so it receives each group's rows"
        for j, i in enumerate(idx):
            rows[i] = out[j]
    return np.stack(cast(list[np.ndarray], rows))  # every row is set: the groups partition the leaves


__all__ = ["StagedArray", "StagedInfo", "gather_leaf", "gather_state", "is_staged", "per_leaf_on_host"]
