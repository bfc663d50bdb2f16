"""Multi-process (multi-host) initialisation with the settings resolved from arguments, ``MISTJAX_*``
then ``JAX_*`` environment variables (docs/pretraining.md).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import jax

DEFAULT_INIT_TIMEOUT_S = 300  # processes of a job may start minutes apart on a busy cluster
DEFAULT_HEARTBEAT_TIMEOUT_S = 60  # a silent peer is declared dead after this long
DEFAULT_SHUTDOWN_TIMEOUT_S = 120  # a finished process waits this long for the others at exit

_ENV_PREFIXES = ("MISTJAX_", "JAX_")
# Substrings of runtime errors raised when a collective's peer process has gone away.
_PEER_LOSS_MARKERS = ("gloo", "connection reset", "connection closed", "socket closed", "broken pipe",
                      "coordination service", "heartbeat", "unavailable", "peer")


class DistributedError(RuntimeError):
    """Multi-process settings are incomplete or wrong, or a peer process failed."""


@dataclass(frozen=True)
class ProcessSetup:
    """Where this process sits in a run."""

    coordinator: str | None  # host:port of process 0; None for a single-process run
    num_processes: int  # processes in the run
    process_id: int  # this process, 0 .. num_processes - 1
    local_devices: int | None  # CPU devices of this process, if set explicitly

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def _env(name: str, env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The value of ``MISTJAX_<name>`` or ``JAX_<name>`` and which variable held it."""
    for prefix in _ENV_PREFIXES:
        value = env.get(prefix + name)
        if value not in (None, ""):
            return value, prefix + name
    return None, None


def _as_int(value: int | str | None, what: str, source: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{what} must be an integer, got {value!r} (from {source})") from None


def resolve(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
            local_devices: int | None = None, *, env: Mapping[str, str] | None = None) -> ProcessSetup:
    """Merge arguments with environment variables and check them.

    Args:
      coordinator: ``host:port`` of process 0 (flag ``--coordinator``).
      num_processes: processes in the run (flag ``--num-processes``).
      process_id: this process's index (flag ``--process-id``).
      local_devices: CPU devices to simulate in this process (flag ``--local-devices``).
      env: environment to read (default ``os.environ``).
    Returns:
      The resolved `ProcessSetup`; ``num_processes == 1`` means an ordinary single-process run.
    Raises:
      DistributedError: a setting is missing, malformed or out of range; the message names the
        flag and environment variable to set.
    """
    env = os.environ if env is None else env
    sources = {}
    if coordinator is None:
        coordinator, sources["coordinator"] = _env("COORDINATOR_ADDRESS", env)
    if num_processes is None:
        raw, src = _env("NUM_PROCESSES", env)
        num_processes = _as_int(raw, "the number of processes", src or "")
        sources["num_processes"] = src
    if process_id is None:
        raw, src = _env("PROCESS_ID", env)
        process_id = _as_int(raw, "the process id", src or "")
        sources["process_id"] = src
    if local_devices is None:
        raw, src = _env("LOCAL_DEVICES", env)
        local_devices = _as_int(raw, "the local device count", src or "")
    if local_devices is not None and local_devices < 1:
        raise DistributedError(f"--local-devices must be positive, got {local_devices}")

    if num_processes is None and process_id is None and coordinator is None:
        return ProcessSetup(None, 1, 0, local_devices)
    if num_processes is not None and num_processes < 1:
        raise DistributedError(f"--num-processes must be positive, got {num_processes}")
    if num_processes == 1 and (process_id or 0) == 0:
        return ProcessSetup(None, 1, 0, local_devices)
    missing = [f"{flag} (or {var})" for flag, var, value in (
        ("--coordinator", "JAX_COORDINATOR_ADDRESS", coordinator),
        ("--num-processes", "JAX_NUM_PROCESSES", num_processes),
        ("--process-id", "JAX_PROCESS_ID", process_id)) if value is None]
    if missing:
        raise DistributedError(f"a multi-process run needs all of --coordinator, --num-processes and --process-id; "
                               f"missing: {', '.join(missing)}")
    assert num_processes is not None and process_id is not None and coordinator is not None
    if not 0 <= process_id < num_processes:
        raise DistributedError(f"--process-id {process_id} is outside 0..{num_processes - 1} "
                               f"for --num-processes {num_processes}")
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DistributedError(f"--coordinator {coordinator!r} must be host:port, e.g. 10.0.0.1:1234 "
                               "(the address of process 0 and a free port)")
    return ProcessSetup(coordinator, num_processes, process_id, local_devices)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               local_devices: int | None = None, timeout_s: int = DEFAULT_INIT_TIMEOUT_S,
               heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
               shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S) -> ProcessSetup:
    """Join a multi-process run (or set up a single-process one); call before any JAX computation.

    Args:
      coordinator: ``host:port`` of process 0; default from the environment (see module doc).
      num_processes: processes in the run; default from the environment.
      process_id: this process's index; default from the environment.
      local_devices: number of CPU devices this process simulates (sets ``jax_num_cpu_devices``);
        leave None on GPU/TPU, where the visible accelerators are used.
      timeout_s: how long to wait for all processes to connect. When it passes, the process prints
        an ``error:`` line saying which side is missing and exits with status 1 (JAX's runtime
        would abort it at that point anyway, blaming "another task").
      heartbeat_timeout_s: after this long without heartbeats a process is declared dead and
        every other process is terminated by the runtime, instead of waiting forever.
      shutdown_timeout_s: how long a finished process waits for the others at exit.
    Returns:
      The `ProcessSetup` in effect.
    Raises:
      DistributedError: bad settings, JAX already started, or the coordinator service cannot
        start (e.g. its port is taken).
    """
    setup = resolve(coordinator, num_processes, process_id, local_devices)
    if setup.local_devices is not None:
        try:
            jax.config.update("jax_num_cpu_devices", setup.local_devices)
        except RuntimeError as e:  # backends already initialised
            raise DistributedError(f"cannot set {setup.local_devices} local devices: {e}; call "
                                   "mistjax.distributed.initialize before any other JAX call") from e
    if not setup.multi_process:
        return setup
    if jax.distributed.is_initialized():
        return setup
    _configure_transfers(setup)
    # If not every process connects in time, JAX's runtime aborts the process with a message
    # about "another task" dying. A watchdog that fires first says what actually went wrong.
    watchdog = threading.Timer(timeout_s, _join_timed_out, args=(setup, timeout_s))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(coordinator_address=setup.coordinator, num_processes=setup.num_processes,
                                   process_id=setup.process_id, initialization_timeout=int(timeout_s) + 30,
                                   heartbeat_timeout_seconds=int(heartbeat_timeout_s),
                                   shutdown_timeout_seconds=int(shutdown_timeout_s))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "must be called before" in str(e):
            raise DistributedError(f"{first}; call mistjax.distributed.initialize first") from e
        if setup.process_id == 0:
            raise DistributedError(f"process 0 could not start the coordinator at {setup.coordinator}: {first}. "
                                   "Is the port in use? Choose another port in --coordinator") from e
        raise DistributedError(f"process {setup.process_id} of {setup.num_processes} could not join the run at "
                               f"{setup.coordinator}: {first}") from e
    finally:
        watchdog.cancel()
    return setup


def _configure_transfers(setup: ProcessSetup) -> None:
    """Give this process a cross-process transfer socket (see module doc)."""
    address = os.environ.get("MISTJAX_TRANSFER_ADDRESS")
    if not address and setup.coordinator is not None:
        host, _, port = setup.coordinator.rpartition(":")
        if host in ("127.0.0.1", "localhost", "::1", "[::1]"):
            address = f"{host}:{int(port) + 1 + setup.process_id}"
    if address:
        jax.config.update("jax_cross_host_transfer_socket_address", address)


def _join_timed_out(setup: ProcessSetup, timeout_s: float) -> None:
    """Runs on the watchdog thread while `jax.distributed.initialize` still waits."""
    where = ("the other processes did not connect" if setup.process_id == 0 else
             f"could not reach process 0 at {setup.coordinator}")
    print(f"error: process {setup.process_id} of {setup.num_processes}: {where} within {timeout_s:g} s "
          "(--dist-timeout). Start all processes with the same --coordinator and --num-processes, run process 0 "
          "on the coordinator host, and check that its port is reachable from every host", file=sys.stderr,
          flush=True)
    os._exit(1)  # the main thread is blocked inside the runtime; exit without waiting for it


def is_primary() -> bool:
    """True on the process that writes metrics, logs and checkpoint metadata (process 0)."""
    return jax.process_index() == 0


def peer_failure(error: BaseException, step: int) -> DistributedError | None:
    """A `DistributedError` explaining `error` if it looks like a lost peer, else None.

    Only meaningful in a multi-process run: a collective (gloo on CPU, NCCL on GPU) fails as
    soon as the connection to a dead process resets.
    """
    if jax.process_count() <= 1 or not isinstance(error, jax.errors.JaxRuntimeError):
        return None
    text = str(error)
    if not any(marker in text.lower() for marker in _PEER_LOSS_MARKERS):
        return None
    first = text.strip().splitlines()[0][:300]
    return DistributedError(
        f"process {jax.process_index()} of {jax.process_count()} lost contact with a peer at step {step} "
        f"({first}). Another process probably died or was killed: check its log, then restart all "
        "processes with --resume to continue from the last checkpoint")


__all__ = ["DistributedError", "ProcessSetup", "initialize", "is_primary", "peer_failure", "resolve"]
