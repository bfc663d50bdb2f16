"""How a pipelined step's arrays reach its stages: program dispatch, transfers between stages, state placement.

`StageIO` is the one place the executor touches a stage's devices: `run` dispatches a program where this
process runs the stage (`LocalStage`) and counts it in the step's `DispatchStats`; `transfer` / `send` move
arrays between stages with ``jax.device_put`` (in a multi-process run, by the processes that send or receive
them; a piece another process produces is a handle with no local shards). `Placement` puts the user's state
onto the stages as `StagedArray` leaves, gathers it back, and splits the batch over the device groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core.plan import PlanError
from mistjax.core.types import Batch, PyTree, State
from mistjax.runtime.mesh import batch_shardings
from mistjax.runtime.mpmd_state import StagedArray, gather_state, is_staged
from mistjax.runtime.pipeline_leaves import RemoteStage, StageGrid, StageLeaves


@dataclass
class DispatchStats:
    """What the host did in the last step (for the cost model and `scripts/bench_mpmd.py`)."""

    programs: int = 0  # jitted programs dispatched
    transfers: int = 0  # jax.device_put calls (one may move several arrays)
    host_s: float = 0.0  # host seconds spent issuing the step (the devices may still be running)
    by_kind: dict[str, int] = field(default_factory=dict)  # programs per phase
    residuals_in_flight: list[int] = field(default_factory=list)  # per stage: most micro-batches' residuals held
    residual_bytes: list[int] = field(default_factory=list)  # per stage: those residuals' bytes per device

    @property
    def ops(self) -> int:
        return self.programs + self.transfers


Held: TypeAlias = jax.Array | None
"""An array of a stage, or None on a process that does not run that stage (its programs' outputs exist only on
the processes holding the stage's devices: a `RemoteStage`)."""


def slicer(value: np.ndarray) -> Callable[[Any], np.ndarray]:
    """``jax.make_array_from_callback``'s callback: each device's block of a host array."""
    return lambda idx: value[idx]


def here(x: Held) -> jax.Array:
    """``x`` on a process that runs its stage, where it is never None."""
    assert x is not None, "an array of a stage this process runs"
    return x


class StageIO:
    """Program dispatch and transfers between the stages of one grid, counted in `stats`."""

    def __init__(self, grid: StageGrid) -> None:
        self.grid = grid
        self.stats = DispatchStats()

    def run(self, kind: str, k: int, fn: Callable[..., PyTree], *args: PyTree) -> PyTree | None:
        """``fn(*args)`` where this process runs stage `k` (counted in the step's `DispatchStats`), else None."""
        if isinstance(self.grid.stages[k], RemoteStage):
            return None
        self.stats.programs += 1
        self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0) + 1
        return fn(*args)

    def transfer(self, x: Held, dst: NamedSharding, *, src_stage: int, dst_stage: int,
                 aval: jax.ShapeDtypeStruct | None = None) -> Held:
        """``jax.device_put`` between stages, by the processes that send or receive it (``aval``: the array's,
        where another process may produce it)."""
        grid = self.grid
        src_local, dst_local = grid.local(src_stage), grid.local(dst_stage)
        if grid.meshes[src_stage] is grid.meshes[dst_stage] or not (src_local or dst_local):
            if x is not None and x.sharding != dst and src_local:
                self.stats.transfers += 1
                return jax.device_put(x, dst)
            return x
        if x is None:  # produced by another process: a handle with no local shards
            assert aval is not None, "a transfer from another process needs the array's aval"
            src = NamedSharding(grid.meshes[src_stage], dst.spec, memory_kind=dst.memory_kind)
            x = jax.make_array_from_single_device_arrays(aval.shape, src, [], dtype=aval.dtype)
        self.stats.transfers += 1
        return jax.device_put(x, dst)

    def send(self, arrays: list[Held], avals: list[jax.ShapeDtypeStruct], dst: list[NamedSharding], src_stage: int,
             dst_stage: int) -> list[Held]:
        """Several arrays from one stage to another in one ``device_put`` call."""
        grid = self.grid
        if grid.meshes[src_stage] is grid.meshes[dst_stage]:
            return arrays
        if not (grid.local(src_stage) or grid.local(dst_stage)):
            return [None] * len(arrays)
        xs = []
        for x, a, d in zip(arrays, avals, dst):
            if x is None:
                src = NamedSharding(grid.meshes[src_stage], d.spec, memory_kind=d.memory_kind)
                x = jax.make_array_from_single_device_arrays(a.shape, src, [], dtype=a.dtype)
            xs.append(x)
        self.stats.transfers += 1
        return list(jax.device_put(xs, dst))


class Placement:
    """The state on the stages as `StagedArray` leaves, gathered back; the batch over the device groups."""

    def __init__(self, leaves: StageLeaves, global_batch: int) -> None:
        self.leaves, self.global_batch = leaves, global_batch

    def place(self, state: State) -> State:
        """The state as `StagedArray` leaves with each piece on its stage (see `mpmd_state`)."""
        leaves = jax.tree.leaves(state, is_leaf=is_staged)
        if any(is_staged(x) for x in leaves):
            self.check_staged(leaves)
            return state
        return jax.tree.unflatten(self.leaves.state_tree, [self._place_leaf(i, x) for i, x in enumerate(leaves)])

    def check_staged(self, leaves: Sequence[jax.Array]) -> None:
        """Raise a `PlanError` unless ``leaves`` were placed for this step."""
        infos = self.leaves.infos
        if len(leaves) != len(infos) or any(not is_staged(x) or x.info != inf for x, inf in zip(leaves, infos)):
            raise PlanError("the state was placed for another plan or model; pass the state returned by this "
                            "step's place() or __call__, or an unplaced state")

    def _place_leaf(self, i: int, x: jax.Array) -> StagedArray:
        info = self.leaves.infos[i]
        host = np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) and x.is_fully_addressable else x
        pieces = []
        for n, k in enumerate(info.stages):
            value = host[info.bounds[n][0]: info.bounds[n][1]] if info.rows else host
            sh = self.leaves.piece_sharding(i, k)
            value = np.asarray(value)
            pieces.append(jax.make_array_from_callback(value.shape, sh, slicer(value), dtype=value.dtype))
        return StagedArray(pieces, info)

    def piece_or_handle(self, i: int, k: int, x: Held) -> jax.Array:
        """`x`, or for a piece another process holds, a handle with no local shards (as `place` makes):
        every process then sees the same pieces, with their shardings, for checksums and checkpoints."""
        if x is not None:
            return x
        info = self.leaves.infos[i]
        n = info.stages.index(k)
        shape = (info.bounds[n][1] - info.bounds[n][0], *info.shape[1:]) if info.rows else info.shape
        return jax.make_array_from_single_device_arrays(shape, self.leaves.piece_sharding(i, k), [], dtype=info.dtype)

    def batch_shardings(self, batch: Batch) -> PyTree:
        """The batch over the whole plan mesh: split over DP, replicated over the stages."""
        return batch_shardings(self.leaves.grid.mesh, batch, self.global_batch)

    def stage_batch(self, batch: Batch) -> list[list[jax.Array]]:
        """Per device group, the batch leaves on its sub-mesh (no copies for a batch placed by
        `batch_shardings`)."""
        grid = self.leaves.grid
        leaves = jax.tree.leaves(batch)
        shardings = jax.tree.leaves(self.batch_shardings(batch))
        out: list[list[jax.Array]] = [[] for _ in range(grid.S)]
        for x, sh in zip(leaves, shardings):
            if not (isinstance(x, jax.Array) and x.sharding == sh):
                value = np.asarray(x)
                x = jax.make_array_from_callback(value.shape, sh, slicer(value), dtype=value.dtype)
            for d in range(grid.S):
                devices = set(grid.group_meshes[d].devices.flat)
                shards = [s.data for s in x.addressable_shards if s.device in devices]
                out[d].append(jax.make_array_from_single_device_arrays(
                    x.shape, NamedSharding(grid.group_meshes[d], sh.spec), shards, dtype=x.dtype))
        return out


def _replicate_piece_everywhere(x: PyTree, grid: StageGrid, io: StageIO) -> PyTree:
    """A placed leaf's pieces each replicated over the whole plan mesh (every process gets a copy)."""
    if not is_staged(x):
        return x
    pieces = []
    for k, p in zip(x.info.stages, x.pieces):
        full = NamedSharding(grid.mesh, P())
        parts: list[jax.Array] = []
        for d in range(grid.S):
            local = io.transfer(p, NamedSharding(grid.group_meshes[d], P()), src_stage=k, dst_stage=d)
            if grid.local(d):
                assert local is not None  # a placed piece is an array (a handle where another process holds it)
                parts.extend(s.data for s in local.addressable_shards)
        pieces.append(jax.make_array_from_single_device_arrays(p.shape, full, parts, dtype=p.dtype))
    return StagedArray(pieces, x.info)


def gather(state: State, grid: StageGrid, io: StageIO) -> State:
    """The user's structure with whole host arrays (every piece brought to this process)."""
    if jax.process_count() > 1:
        state = jax.tree.map(lambda x: _replicate_piece_everywhere(x, grid, io), state, is_leaf=is_staged)
    return gather_state(state)


__all__ = ["DispatchStats", "Held", "Placement", "StageIO", "gather", "here", "slicer"]
