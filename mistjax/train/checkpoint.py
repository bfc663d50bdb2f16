"""Sharded, atomic, asynchronous checkpoints of a `TrainState` with orbax.

A checkpoint directory holds one sub-directory per saved step (orbax's layout)::

    DIR/<step>/state/   the train state's arrays, each saved as sharded on the plan mesh
    DIR/<step>/meta/    small JSON: step, model, plan, data seed, run config, checksums

Saving is orbax's: the arrays are copied to host memory before `save` returns (so the next,
donating train step may reuse the device buffers), written in the background, and the step
directory appears under its final name only once complete, so a crash mid-save never replaces
a good checkpoint. Restoring reads every array straight onto the shardings of a template state
placed by the plan. Each checkpoint also records a wrap-around checksum of every array; a
checkpoint that cannot be read or whose checksums differ is skipped with a warning in favour of
the one before it.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import type_handlers as ocp_types

from mistjax.core.types import PyTree, State
from mistjax.runtime.mpmd_state import per_leaf_on_host

META_FORMAT = 1  # version of the metadata layout below
_SEP = "/"


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
    format: int  # `META_FORMAT`
    step: int
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


# ------------------------------------------------------------------------------ state <-> tree
def _leaf_names(state: PyTree) -> list[str]:
    return [jax.tree_util.keystr(p, simple=True, separator=_SEP) for p, _ in
            jax.tree_util.tree_flatten_with_path(state)[0]]


def state_to_tree(state: PyTree) -> dict[str, PyTree]:
    """The state's arrays as nested dicts keyed by field names (``params/layers/mlp/wi/value``).

    Plain nested dicts keep the on-disk layout readable and independent of Flax/optax classes.
    """
    out: dict[str, PyTree] = {}
    for name, leaf in zip(_leaf_names(state), jax.tree.leaves(state)):
        node = out
        *parents, last = name.split(_SEP)
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return out


def tree_to_state(tree: Mapping[str, PyTree], template: State) -> State:
    """Inverse of `state_to_tree`: put the arrays of `tree` back into `template`'s structure."""
    leaves = []
    for name in _leaf_names(template):
        node: PyTree = tree
        for key in name.split(_SEP):
            node = node[key]
        leaves.append(node)
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


def _checksums(leaves: list[jax.Array]) -> jax.Array:
    """Per leaf: the uint32 wrap-around sum of its bits, plain and position-weighted.

    Integer addition is associative, so the result does not depend on the sharding or the
    reduction order: the same array saved under one plan and read back gives the same sums.
    """
    sums = []
    for x in leaves:
        if jax.typeof(x).memory_space == jax.memory.Space.Host:  # offloaded leaves: read on device
            x = jax.device_put(x, jax.memory.Space.Device)
        if x.dtype == jnp.bool_:
            bits = x.astype(jnp.uint32)
        else:
            width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
            bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
        bits = bits.reshape(-1)
        weight = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
        sums.append(jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32)]))
    return jnp.stack(sums)


def checksums(state: PyTree) -> dict[str, list[int]]:
    """`_checksums` of every leaf of `state`, keyed by leaf name (JSON-ready)."""
    # A pipelined plan's state lives on several sub-meshes: checksum each mesh's leaves on it.
    values = per_leaf_on_host(_checksums, jax.tree.leaves(state))
    return {name: [int(a), int(b)] for name, (a, b) in zip(_leaf_names(state), values)}


def _agree(ok: bool) -> bool:
    """True only if `ok` holds on every process (all processes must take the same branch)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


# ------------------------------------------------------------------------------ manager
def _handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Orbax handlers for the two items of a checkpoint: the state's arrays and the JSON metadata.

    Replica-parallel writing is turned off (orbax already does so on GPU): it splits every
    replicated array into per-replica slices with one eager XLA op per shape, which on CPU
    costs seconds of compilation at the first save and buys nothing when one host writes.
    """
    arrays = ocp_types.ArrayHandler(use_replica_parallel=False)
    state = ocp.PyTreeCheckpointHandler(type_handler_registry=ocp_types.create_type_handler_registry(
        (jax.Array, arrays)))
    meta = ocp.handlers.JsonCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ocp.args.PyTreeSave, state)
    registry.add("state", ocp.args.PyTreeRestore, state)
    registry.add("meta", ocp.args.JsonSave, meta)
    registry.add("meta", ocp.args.JsonRestore, meta)
    return registry


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
        self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=_handler_registry())

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
        if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or meta.get("step") != step:
            raise ValueError(f"metadata of step {step} is malformed")
        return meta

    # -------------------------------------------------------------- save / restore
    @staticmethod
    def check_savable(state: State) -> None:
        """Raise `CheckpointError` if orbax cannot save `state` in this run.

        In a multi-process run orbax saves only global arrays: an array held entirely by one process
        (a pipeline stage placed on one process's devices by an MPMD plan) is refused as host-local.
        """
        if jax.process_count() == 1:
            return
        local = [name for name, x in zip(_leaf_names(state), jax.tree.leaves(state))
                 if isinstance(x, jax.Array) and x.is_fully_addressable]
        if local:
            raise CheckpointError(
                f"cannot checkpoint this state across {jax.process_count()} processes: {len(local)} arrays (e.g. "
                f"{local[0]}) live on one process's devices only (a pipeline stage placed within one process), "
                "which orbax refuses to save as global arrays. Run without --ckpt-dir, or use a plan whose "
                "stages span processes")

    def save(self, step: int, state: State, meta: Mapping[str, object]) -> None:
        """Start saving `state` as checkpoint `step`; returns once the arrays are on the host.

        A save still in flight from an earlier call is finished first (orbax does this), so at
        most one checkpoint is being written at a time.
        """
        meta = dict(meta, format=META_FORMAT, step=int(step), checksums=checksums(state),
                    saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state_to_tree(state)),
                                                         meta=ocp.args.JsonSave(meta)), force=True)

    def newest_meta(self) -> CheckpointMeta | None:
        """Metadata of the newest checkpoint whose metadata is readable (None if there is none).

        Cheap (small JSON reads): lets a caller refuse an incompatible checkpoint before it
        builds the model. Unreadable metadata is reported later, by `restore_latest`.
        """
        for step in reversed(self.steps()):
            try:
                return self.read_meta(step)
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
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                state_to_tree(template))
        failures: list[str] = []
        for step in reversed(steps):
            error: BaseException | None = None
            try:
                meta = self.read_meta(step)
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for bad files
                meta, error = None, e
            if not _agree(meta is not None):
                failures.append(self._bad(step, f"unreadable metadata ({_short(error)})"))
                continue
            assert meta is not None
            state = None
            try:
                restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                    item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))))["state"]
                state = tree_to_state(restored, template)
            except Exception as e:  # noqa: BLE001
                error = e
                _finalize_abandoned_reads()
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


def _finalize_abandoned_reads(settle_s: float = 0.5) -> None:
    """Quietly wind down the reads orbax abandons when one array of a restore fails.

    Orbax stops at the first failed read, closes its event loop and leaves the other reads
    pending: their tensorstore callbacks later hit the closed loop, and the garbage collector
    finalises their coroutines, each printing a copy of the error through `sys.unraisablehook`
    in whatever code runs at that moment. Give the reads `settle_s` to finish and collect them
    now, hiding only those two kinds of report.
    """
    previous = sys.unraisablehook

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        leftover = "_read_array_index_and_device_put" in repr(unraisable.object) or (
            isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value))
        if not leftover:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        time.sleep(settle_s)
        gc.collect()
    finally:
        sys.unraisablehook = previous


def _short(error: BaseException | None) -> str:
    """The gist of an orbax/tensorstore error: its first sentence, without the tensorstore spec dump."""
    if error is None:
        return "failed on another process"
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(" See full TensorStore details")[0][:160]


__all__ = ["CheckpointError", "CheckpointMeta", "Checkpointer", "check_writable", "checksums", "state_to_tree",
           "tree_to_state"]
