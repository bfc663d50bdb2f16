"""Sharded, atomic, asynchronous, plan-independent checkpoints of a train state (orbax + TensorStore).

A checkpoint directory holds one sub-directory per saved step (orbax's layout)::

    DIR/<step>/state/<leaf>/   each leaf as its logical (whole) array, a zarr array written shard by shard
    DIR/<step>/meta/           small JSON: step, model, the plan that wrote it, data position, leaf shapes,
                               checksums, run config

Every process writes the shards it holds at their logical offsets (`mistjax.train.logical`), so any plan
saves — a pipeline stage within one process too — and any plan restores: the new placement reads, per
process, the regions its devices hold. Orbax's manager makes the save asynchronous (host copies before
`save` returns, writes in the background) and atomic (the step directory appears under its final name
only once complete). Each checkpoint records a wrap-around checksum of every logical array, which does not
depend on the placement; a checkpoint that cannot be read or whose checksums differ is skipped with a
warning in favour of the one before it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import future as ocp_future

from mistjax.core.types import PyTree, State
from mistjax.train import logical

META_FORMAT = 2  # version of the layout: 2 = logical arrays (1, per-placement pieces, is refused with a message)


class CheckpointError(RuntimeError):
    """A checkpoint directory cannot be used (unwritable, incompatible, or nothing readable)."""


class CheckpointMeta(TypedDict, total=False):
    """A checkpoint's JSON metadata: the run's description (what `mistjax.train.loop` records), then the keys
    `Checkpointer.save` adds. Read back, it is whatever the file holds past the ``format`` / ``step`` check."""

    model: str  # the model preset
    plan: dict[str, object]  # `Plan.to_dict()`
    data_seed: int
    config: dict[str, object]  # the run's `TrainConfig` fields
    process_count: int
    device_count: int
    data_position: dict[str, object]  # where the data source continues: {"next_batch": step, "seed": ...}
    format: int  # `META_FORMAT`
    step: int
    leaves: dict[str, list[object]]  # leaf name -> [logical shape, dtype name]
    checksums: dict[str, list[int]]  # leaf name -> `checksums`
    saved_at: str  # local time, ISO 8601


def check_writable(directory: str | Path) -> Path:
    """Create `directory` if needed and prove that files can be written there.

    Raises:
      CheckpointError: naming the directory and the reason, before any training work is done.
    """
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        # A real write catches read-only mounts and permission bits that os.access can miss.
        fd, probe = tempfile.mkstemp(prefix=".mistjax-write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        reason = e.strerror or str(e)
        raise CheckpointError(f"cannot write checkpoints to {str(path)!r}: {reason}; "
                              "choose a writable --ckpt-dir") from e
    return path.resolve()


# ------------------------------------------------------------------------------ the state item
class LogicalStateHandler(ocp.AsyncCheckpointHandler):
    """Orbax handler for the ``state`` item: every leaf as its logical array (`mistjax.train.logical`).

    `async_save` copies this process's shards to host memory before it returns (the next, donating
    step may then reuse the device buffers) and writes them in orbax's background thread; orbax's
    manager commits the step directory only once every process has finished.
    """

    def __init__(self) -> None:
        self.last_write_s: float | None = None  # seconds the last background write took

    async def async_save(self, directory: epath.Path, args: LogicalSave) -> list[ocp_future.Future]:
        writes = logical.prepare_writes(Path(directory), args.state)

        async def write() -> None:
            t0 = time.perf_counter()
            await logical.write_all(writes)
            self.last_write_s = time.perf_counter() - t0

        return [ocp_future.CommitFutureAwaitingContractedSignals(write(), name="mistjax_state_save")]

    def save(self, directory: epath.Path, args: LogicalSave) -> None:
        async def run() -> None:
            for f in await self.async_save(directory, args):
                f.result()

        asyncio.run(run())

    def restore(self, directory: epath.Path, args: LogicalRestore) -> PyTree:
        return asyncio.run(logical.read_all(Path(directory), args.template))


@ocp.args.register_with_handler(LogicalStateHandler, for_save=True)
@dataclasses.dataclass
class LogicalSave(ocp.args.CheckpointArgs):
    """Save `state` (any placement) as logical arrays."""

    state: PyTree


@ocp.args.register_with_handler(LogicalStateHandler, for_restore=True)
@dataclasses.dataclass
class LogicalRestore(ocp.args.CheckpointArgs):
    """Restore onto `template`'s placement (its values are not read)."""

    template: PyTree


def checksums(state: PyTree) -> dict[str, list[int]]:
    """Per logical leaf of `state`: two wrap-around sums of its bits, the same under any placement."""
    return logical.logical_checksums(state)


def _agree(ok: bool) -> bool:
    """True only if `ok` holds on every process (all processes must take the same branch)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


# ------------------------------------------------------------------------------ manager
def _handler_registry(state: LogicalStateHandler) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Orbax handlers for the two items of a checkpoint: the state's logical arrays and the JSON metadata."""
    meta = ocp.handlers.JsonCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", LogicalSave, state)
    registry.add("state", LogicalRestore, state)
    registry.add("meta", ocp.args.JsonSave, meta)
    registry.add("meta", ocp.args.JsonRestore, meta)
    return registry


@dataclasses.dataclass(frozen=True)
class SaveCost:
    """What one save cost: the seconds `save` blocked the caller (host copies), then the background write."""

    step: int
    blocking_s: float
    write_s: float | None  # None until the write has finished


class Checkpointer:
    """Saves and restores `TrainState` checkpoints under one directory (orbax CheckpointManager).

    Args:
      directory: checkpoint directory; created if missing (see `check_writable`).
      keep: how many of the newest checkpoints to keep; older ones are deleted.
      async_save: write in a background thread (the arrays are copied to host first).
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True) -> None:
        if keep < 1:
            raise CheckpointError(f"--keep must be at least 1, got {keep}")
        self.directory = check_writable(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True,
                                               enable_async_checkpointing=async_save)
        self._state_handler = LogicalStateHandler()
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              handler_registry=_handler_registry(self._state_handler))
        self._blocking: dict[int, float] = {}
        self._written: dict[int, float] = {}

    # -------------------------------------------------------------- queries
    def steps(self) -> list[int]:
        """Steps of the finished checkpoints, oldest first (half-written ones are never listed)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def read_meta(self, step: int) -> CheckpointMeta:
        """The JSON metadata of checkpoint `step` (raises if it is unreadable)."""
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if isinstance(meta, dict) and meta.get("step") == step and meta.get("format") == 1:
            raise CheckpointError(
                f"checkpoint step {step} in {str(self.directory)!r} has the per-plan layout of mistjax before "
                "format 2, which this version does not read; finish that run with the mistjax that wrote it, or "
                "start over in another --ckpt-dir")
        if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or meta.get("step") != step:
            raise ValueError(f"metadata of step {step} is malformed")
        return meta

    # -------------------------------------------------------------- save / restore
    def save(self, step: int, state: State, meta: Mapping[str, object] | None = None) -> None:
        """Start saving `state` (under any plan) as checkpoint `step`; returns once the arrays are on the host.

        Args:
          step: the checkpoint's number (the optimizer steps taken, by convention).
          state: the placed state: `jax.Array` or `StagedArray` leaves (a pipelined plan's), or numpy arrays.
          meta: JSON-ready facts to keep beside the arrays (`CheckpointMeta` lists what the loop records).

        A save still in flight from an earlier call is finished first (orbax does this), so at
        most one checkpoint is being written at a time.
        """
        t0 = time.perf_counter()
        leaves = {name: [list(spec.shape), spec.dtype] for name, leaf in logical.logical_leaves(state)
                  for spec in [logical.leaf_spec(leaf)]}
        meta = dict(meta or {}, format=META_FORMAT, step=int(step), leaves=leaves, checksums=checksums(state),
                    saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self._note_finished_write()
        self._manager.save(step, args=ocp.args.Composite(state=LogicalSave(state), meta=ocp.args.JsonSave(meta)),
                           force=True)
        self._blocking[int(step)] = time.perf_counter() - t0

    def _note_finished_write(self) -> None:
        """Attribute the background write that has just finished to the step it belongs to."""
        if self._state_handler.last_write_s is not None and self._blocking:
            pending = [s for s in self._blocking if s not in self._written]
            if pending:
                self._written[max(pending)] = self._state_handler.last_write_s
            self._state_handler.last_write_s = None

    def costs(self) -> list[SaveCost]:
        """The cost of each save this `Checkpointer` made, oldest first (waits for a write in flight)."""
        self.wait()
        self._note_finished_write()
        return [SaveCost(s, b, self._written.get(s)) for s, b in sorted(self._blocking.items())]

    def newest_meta(self) -> CheckpointMeta | None:
        """Metadata of the newest checkpoint whose metadata is readable (None if there is none).

        Cheap (small JSON reads): lets a caller refuse an incompatible checkpoint before it
        builds the model. Unreadable metadata is reported later, by `restore_latest`.
        """
        for step in reversed(self.steps()):
            try:
                return self.read_meta(step)
            except CheckpointError:
                raise
            except Exception:  # noqa: BLE001 - corrupt: restore_latest warns and falls back
                continue
        return None

    def restore_latest(self, template: State) -> tuple[State, CheckpointMeta] | None:
        """Restore the newest usable checkpoint onto the shardings of `template`.

        Args:
          template: a train state already placed by the plan (its leaves' shardings and dtypes
            are the restore targets; its values are not used).
        Returns:
          ``(state, meta)``, or None if the directory holds no checkpoint at all.
        Raises:
          CheckpointError: checkpoints exist but none of them can be read.
        """
        steps = self.steps()
        if not steps:
            return None
        failures: list[str] = []
        for step in reversed(steps):
            error: BaseException | None = None
            try:
                meta = self.read_meta(step)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for bad files
                meta, error = None, e
            if not _agree(meta is not None):
                failures.append(self._bad(step, f"unreadable metadata ({_short(error)})"))
                continue
            assert meta is not None
            self._check_layout(step, meta, template)
            state = None
            try:
                state = self._manager.restore(step, args=ocp.args.Composite(state=LogicalRestore(template)))["state"]
            except Exception as e:  # noqa: BLE001
                error = e
            if not _agree(state is not None):
                failures.append(self._bad(step, f"unreadable arrays ({_short(error)})"))
                continue
            bad = [k for k, v in checksums(state).items() if meta["checksums"].get(k) != v]
            if bad:
                failures.append(self._bad(step, f"checksum mismatch in {', '.join(bad[:3])}"
                                                f"{' and others' if len(bad) > 3 else ''}"))
                continue
            return state, meta
        raise CheckpointError(f"no usable checkpoint in {str(self.directory)!r}: " + "; ".join(failures)
                              + ". Delete the directory (or pick another --ckpt-dir) to start over")

    def _check_layout(self, step: int, meta: CheckpointMeta, template: State) -> None:
        """Refuse (without touching the checkpoint) a state whose leaves differ from the saved ones."""
        saved = {name: logical.LeafSpec(tuple(shape), dtype) for name, (shape, dtype) in meta["leaves"].items()}
        try:
            logical.check_layout(saved, template)
        except logical.CheckpointLayoutError as e:
            raise CheckpointError(
                f"cannot restore checkpoint step {step} of {str(self.directory)!r} into this state: {e}. The model "
                "(and the optimizer and weight dtype) must match the run that wrote it; the plan may differ") from None

    def _bad(self, step: int, reason: str) -> str:
        """Warn about corrupt checkpoint `step` and move it aside so later saves can reuse the number."""
        older = [s for s in self.steps() if s < step]
        then = f"falling back to step {older[-1]}" if older else "no older checkpoint to fall back to"
        warnings.warn(f"checkpoint step {step} in {str(self.directory)!r} is corrupt: {reason}; moved it to "
                      f"{step}.corrupt-*; {then}", RuntimeWarning, stacklevel=3)
        if jax.process_index() == 0:
            src = self.directory / str(step)
            dst = self.directory / f"{step}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
            if src.is_dir():
                src.rename(dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"mistjax-ckpt-quarantine-{step}")
        self._manager.reload()
        return f"step {step}: {reason}"

    def wait(self) -> None:
        """Block until a save in flight has been written and committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


def _short(error: BaseException | None) -> str:
    """The gist of an orbax/tensorstore error: its first sentence, without the tensorstore spec dump."""
    if error is None:
        return "failed on another process"
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(" See full TensorStore details")[0][:160]


__all__ = ["CheckpointError", "CheckpointMeta", "Checkpointer", "LogicalRestore", "LogicalSave", "LogicalStateHandler",
           "SaveCost", "check_writable", "checksums"]
