"""Plan-independent array storage: every state leaf on disk as its logical (whole) array.

A plan places a leaf as one sharded `jax.Array` (single-stage plans) or as a `StagedArray` of per-stage
pieces (MPMD pipelines: row blocks of stacked layers, or whole copies such as a tied embedding). Orbax's
array handler writes only arrays that span every process and reads only whole arrays, so neither a stage
placed within one process nor a restore into other stage bounds fits it. This module writes each leaf as
one zarr array (TensorStore, the storage orbax itself uses) at its logical shape: every process writes the
replica-0 shards it holds at their logical offsets (a piece's rows shifted by the stage's first row), and
restoring reads, on each process, exactly the regions its devices hold in the target placement. Nothing
is gathered: no process ever holds more than its own shards. `checkpoint.LogicalStateHandler` plugs this
into orbax's `CheckpointManager`, which keeps the atomic commit, asynchronous saves and retention.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from jax.experimental import multihost_utils

from mistjax.core.types import PyTree
from mistjax.runtime.mpmd_state import StagedArray, is_staged, per_leaf_on_host

SEP = "/"
T = TypeVar("T")
Index = tuple[slice, ...]


class CheckpointLayoutError(ValueError):
    """A saved leaf and the state it should be restored into disagree (name, shape or dtype)."""


class Piece(NamedTuple):
    """One placed array of a leaf and the logical row it starts at (0 for whole arrays and copies)."""

    array: jax.Array
    row: int


class LeafSpec(NamedTuple):
    """A leaf's logical shape and dtype: what a checkpoint records and a restore must match."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class HostShard:
    """A shard copied to host memory, with its region of the logical array."""

    index: Index
    data: np.ndarray


async def _gather(*tasks: Awaitable[T]) -> list[T]:
    """`asyncio.gather` that lets every task finish before raising the first error (no reads left dangling)."""
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)


# ------------------------------------------------------------------------------ leaves and pieces
def logical_leaves(state: PyTree) -> list[tuple[str, jax.Array | StagedArray | np.ndarray]]:
    """``(name, leaf)`` for every array of `state`, a `StagedArray` counting as one leaf (its logical name)."""
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_staged)[0]
    out = []
    for path, leaf in flat:
        name = jax.tree_util.keystr(path, simple=True, separator=SEP) or "_"  # "_": a state that is one array
        if not isinstance(leaf, jax.Array | StagedArray | np.ndarray | np.generic):
            raise TypeError(f"cannot checkpoint state leaf {name!r} of type {type(leaf).__name__}: only arrays "
                            "(jax, numpy) are saved; keep other values out of the state or convert them to arrays")
        out.append((name, leaf))
    return out


def leaf_spec(leaf: jax.Array | StagedArray | np.ndarray) -> LeafSpec:
    return LeafSpec(tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype).name)


def pieces(leaf: jax.Array | StagedArray) -> list[Piece]:
    """Every placed array of `leaf` with its first logical row (copies all start at row 0)."""
    if not is_staged(leaf):
        return [Piece(leaf, 0)]
    if leaf.info.rows:
        return [Piece(p, start) for p, (start, _) in zip(leaf.pieces, leaf.info.bounds)]
    return [Piece(p, 0) for p in leaf.pieces]


def written_pieces(leaf: jax.Array | StagedArray) -> list[Piece]:
    """The pieces whose shards are written: all row blocks, but only the first of identical copies."""
    found = pieces(leaf)
    return found if not is_staged(leaf) or leaf.info.rows else found[:1]


def logical_region(index: Index, piece_shape: Sequence[int], row: int) -> Index:
    """A shard's region of its piece (`index`, open ends allowed) as bounded slices of the logical array."""
    index = tuple(index) + (slice(None),) * (len(piece_shape) - len(index))
    bounded = [slice(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, piece_shape)]
    if bounded and row:
        bounded[0] = slice(bounded[0].start + row, bounded[0].stop + row)
    return tuple(bounded)


# ------------------------------------------------------------------------------ save
def host_shards(leaf: jax.Array | StagedArray | np.ndarray) -> list[HostShard]:
    """Copies of the replica-0 shards this process holds, placed in logical coordinates.

    The copy is taken now (``np.array``), so a train step that donates the device buffers afterwards
    cannot change what is written.
    """
    if isinstance(leaf, np.ndarray | np.generic):
        whole = tuple(slice(0, n) for n in np.shape(leaf))
        return [HostShard(whole, np.array(leaf))] if jax.process_index() == 0 else []
    out = []
    for piece in written_pieces(leaf):
        for shard in piece.array.addressable_shards:
            if shard.replica_id == 0:
                index = logical_region(shard.index, piece.array.shape, piece.row)
                out.append(HostShard(index, np.array(shard.data)))
    return out


def chunk_shape(leaf: jax.Array | StagedArray | np.ndarray) -> tuple[int, ...]:
    """A zarr chunk that tiles every writer's shard, so no two processes ever write one chunk."""
    if isinstance(leaf, np.ndarray | np.generic) or leaf.ndim == 0:
        return tuple(max(int(n), 1) for n in np.shape(leaf))
    sizes: list[list[int]] = [[] for _ in range(leaf.ndim)]
    for piece in written_pieces(leaf):
        for dim, n in enumerate(piece.array.sharding.shard_shape(piece.array.shape)):
            sizes[dim].append(int(n))
        if piece.row:
            sizes[0].append(piece.row)
    return tuple(max(reduce(math.gcd, s), 1) for s in sizes)


def _spec(path: Path, spec: LeafSpec, chunks: tuple[int, ...] | None = None) -> dict[str, object]:
    out: dict[str, object] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    if chunks is not None:
        out["metadata"] = {"shape": list(spec.shape), "data_type": spec.dtype,
                           "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}}}
    return out


class PendingWrite(NamedTuple):
    """A leaf ready to be written: where, its logical spec and chunking, and this process's shards."""

    path: Path
    spec: LeafSpec
    chunks: tuple[int, ...]
    shards: list[HostShard]


def agreed_chunks(local: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The chunk shapes every process uses: per dim the gcd over all processes' own `chunk_shape`."""
    if jax.process_count() == 1:
        return local
    flat = np.array([n for chunks in local for n in chunks], np.int64)
    every = multihost_utils.process_allgather(flat)
    merged = [reduce(math.gcd, (int(v) for v in column)) for column in np.asarray(every).reshape(-1, flat.size).T]
    out, at = [], 0
    for chunks in local:
        out.append(tuple(merged[at:at + len(chunks)]))
        at += len(chunks)
    return out


def prepare_writes(directory: Path, state: PyTree) -> list[PendingWrite]:
    """Host copies of everything this process writes for `state` under `directory` (one folder per leaf)."""
    named = logical_leaves(state)
    chunks = agreed_chunks([chunk_shape(leaf) for _, leaf in named])
    return [PendingWrite(directory / name, leaf_spec(leaf), c, host_shards(leaf))
            for (name, leaf), c in zip(named, chunks)]


async def write_all(writes: Sequence[PendingWrite]) -> None:
    """Write the prepared shards. Process 0 creates each array; the others only add chunks (disjoint)."""
    primary = jax.process_index() == 0

    async def one(w: PendingWrite) -> None:
        spec = _spec(w.path, w.spec, w.chunks)
        if primary:
            t = await ts.open(spec, create=True, open=True)
        else:
            t = await ts.open(spec, open=True, assume_metadata=True)
        await _gather(*(t[s.index].write(s.data) for s in w.shards))

    await _gather(*(one(w) for w in writes))


# ------------------------------------------------------------------------------ restore
def check_layout(saved: dict[str, LeafSpec], template: PyTree) -> None:
    """Raise `CheckpointLayoutError` naming the leaves where the checkpoint and `template` differ."""
    want = {name: leaf_spec(leaf) for name, leaf in logical_leaves(template)}
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - set(want))
    changed = [f"{k}: {tuple(saved[k].shape)} {saved[k].dtype} saved vs {want[k].shape} {want[k].dtype} now"
               for k in sorted(set(want) & set(saved)) if LeafSpec(tuple(saved[k].shape), saved[k].dtype) != want[k]]
    problems = ([f"not in the checkpoint: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"] * bool(missing)
                + [f"only in the checkpoint: {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"] * bool(extra)
                + changed[:3])
    if problems:
        raise CheckpointLayoutError("; ".join(problems))


async def _read_array(t: ts.TensorStore, piece: Piece) -> jax.Array:
    """`piece`'s placement filled from the logical array `t` (only this process's devices are read; a region
    several of its devices hold, a replicated one, is read once)."""
    arr = piece.array
    index_of = arr.sharding.devices_indices_map(arr.shape)
    devices = [d for d in arr.sharding._addressable_device_assignment]  # noqa: SLF001 - jax's own order
    regions = {d: logical_region(index_of[d], arr.shape, piece.row) for d in devices}
    unique = {_region_key(r): r for r in regions.values()}
    data = dict(zip(unique, await _gather(*(t[r].read() for r in unique.values()))))
    kind = arr.sharding.memory_kind
    buffers = [jax.device_put(np.asarray(data[_region_key(regions[d])]).astype(arr.dtype, copy=False),
                              jax.sharding.SingleDeviceSharding(d, memory_kind=kind)) for d in devices]
    return jax.make_array_from_single_device_arrays(arr.shape, arr.sharding, buffers, dtype=arr.dtype)


def _region_key(region: Index) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in region)


async def read_leaf(path: Path, leaf: jax.Array | StagedArray | np.ndarray) -> jax.Array | StagedArray | np.ndarray:
    """The logical array at `path`, placed like `leaf` (a template: its values are not used)."""
    t = await ts.open(_spec(path, leaf_spec(leaf)), open=True)
    if isinstance(leaf, np.ndarray | np.generic):
        return np.asarray(await t.read()).astype(leaf.dtype)
    placed = await _gather(*(_read_array(t, p) for p in pieces(leaf)))
    if not is_staged(leaf):
        return placed[0]
    return StagedArray(placed, leaf.info)


async def read_all(directory: Path, template: PyTree) -> PyTree:
    """`template`'s structure with every leaf read from `directory` onto the template's placement."""
    named = logical_leaves(template)
    values = await _gather(*(read_leaf(directory / name, leaf) for name, leaf in named))
    treedef = jax.tree.structure(template, is_leaf=is_staged)
    return jax.tree.unflatten(treedef, list(values))


# ------------------------------------------------------------------------------ checksums
_WEIGHT = 2654435761  # Knuth's multiplicative hash constant: position weights for the second sum


def _piece_sums(arrays: list[jax.Array]) -> jax.Array:
    """Per array: the uint32 wrap-around sum of its bits, and the sum weighted by ``position * W + 1``."""
    sums = []
    for x in arrays:
        if jax.typeof(x).memory_space == jax.memory.Space.Host:  # offloaded leaves: read on device
            x = jax.device_put(x, jax.memory.Space.Device)
        if x.dtype == jnp.bool_:
            bits = x.astype(jnp.uint32)
        else:
            width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
            bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
        bits = bits.reshape(-1)
        weight = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(_WEIGHT) + jnp.uint32(1)
        sums.append(jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32)]))
    return jnp.stack(sums)


def _pieces_with_offsets(state: PyTree) -> Iterator[tuple[str, jax.Array | np.ndarray, int]]:
    for name, leaf in logical_leaves(state):
        if isinstance(leaf, np.ndarray | np.generic):
            yield name, jnp.asarray(leaf), 0
            continue
        row_size = math.prod(leaf.shape[1:]) if leaf.ndim else 1
        for piece in written_pieces(leaf):
            yield name, piece.array, piece.row * row_size


def logical_checksums(state: PyTree) -> dict[str, list[int]]:
    """Per logical leaf: the two wrap-around sums of `_piece_sums` over the whole array.

    Integer addition is associative and the position weight is linear, so the pieces' sums combine
    (``W += offset * W_const * S``) into the sums of the logical array: the same state under any plan
    (any sharding, stage bounds or process layout) gives the same numbers.
    """
    items = list(_pieces_with_offsets(state))
    rows = per_leaf_on_host(_piece_sums, [x for _, x, _ in items]) if items else np.zeros((0, 2), np.uint32)
    out: dict[str, list[int]] = {}
    mask = (1 << 32) - 1
    for (name, _, offset), (plain, weighted) in zip(items, rows.astype(np.uint64)):
        total = out.setdefault(name, [0, 0])
        total[0] = (total[0] + int(plain)) & mask
        total[1] = (total[1] + int(weighted) + offset * _WEIGHT * int(plain)) & mask
    return out


__all__ = ["CheckpointLayoutError", "HostShard", "LeafSpec", "PendingWrite", "Piece", "check_layout", "chunk_shape",
           "host_shards", "leaf_spec", "logical_checksums", "logical_leaves", "pieces", "prepare_writes", "read_all",
           "read_leaf", "write_all"]
