"""A quiet JAX platform choice on a machine without a GPU driver, made before JAX starts its backends.

The dev and ``gpu-aot`` extras install the JAX CUDA plugin (jax-cuda12-plugin) for deviceless XLA:GPU
compiles (`mistjax.validate.gpu_aot`). On a machine without an NVIDIA driver that plugin, left alone,

* fails its CUDA version check when JAX picks a platform by itself (``JAX_PLATFORMS`` unset): a 20-line
  "Jax plugin configuration error ... Unable to load CUDA. Is it installed?" traceback, and
* logs ``cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.``, each
  after absl's ``WARNING: All log messages before absl::InitializeLog() is called are written to STDERR``,
  once for every shared library of the plugin that loads: three while ``import jax`` loads jaxlib's GPU
  kernels, one when JAX registers the plugin's PJRT library, whatever ``JAX_PLATFORMS`` says. They are
  C++ absl logs that static initialisers write straight to file descriptor 2; no environment variable
  reaches them (``TF_CPP_MIN_LOG_LEVEL``, ``GLOG_minloglevel``, ``ABSL_MIN_LOG_LEVEL`` change nothing).

`choose()`, run by ``mistjax/__init__.py`` before anything of mistjax imports jax, acts only when a JAX
CUDA plugin is installed and no NVIDIA driver is present (``libcuda.so.1`` cannot be loaded, so CUDA cannot
run in this process anyway):

* with ``JAX_PLATFORMS`` unset and no other accelerator runtime (TPU, ROCm), it chooses the CPU platform
  (``JAX_PLATFORMS=cpu``, which child processes inherit; ``jax.config`` when jax is already imported).
  With it the plugin skips its version check but still registers, so deviceless compiles keep working;
* unless ``JAX_PLATFORMS`` asks for cuda, it imports jax and loads the plugin's PJRT library with file
  descriptor 2 filtered: exactly those two kinds of line are dropped, everything else written there
  (warnings, errors, tracebacks) is passed on once the imports return.

A ``JAX_PLATFORMS`` the user set, even to ``""``, is never changed. Nothing here imports jax unless it acts.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

_CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
_NOISE = re.compile(rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
                    rb"|I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine.*")


def _cuda_plugin() -> Path | None:
    """The installed JAX CUDA plugin's PJRT library (found without importing jax), or None."""
    for name in _CUDA_PLUGINS:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin:
            return Path(spec.origin).parent / "xla_cuda_plugin.so"
    return None


def nvidia_driver_present() -> bool:
    """Whether an NVIDIA driver is there: its device nodes, its /proc entry, or a loadable libcuda (WSL)."""
    if any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def other_accelerator_present() -> bool:
    """Whether a TPU (libtpu or its device nodes) or an AMD GPU (ROCm's /dev/kfd) may be there."""
    if any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0", "/dev/kfd")):
        return True
    try:
        return importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):
        return False


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


@contextlib.contextmanager
def drop_driver_noise() -> Iterator[None]:
    """Run the body with file descriptor 2 captured; afterwards write it back without the missing-driver lines."""
    captured = None
    try:
        sys.stderr.flush()
        captured = tempfile.TemporaryFile()  # noqa: SIM115 (closed below, by `with captured`)
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no usable stderr or temporary file: nothing filtered
        if captured is not None:
            captured.close()
        yield
        return
    with captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [ln for ln in captured.read().splitlines(keepends=True) if not _NOISE.fullmatch(ln.rstrip())]
            _write_all(2, b"".join(kept))


def _backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return xla_bridge.backends_are_initialized()
    except Exception:  # a JAX without it: assume the worst and change nothing
        return True


def choose() -> None:
    """Choose the CPU platform quietly when a JAX CUDA plugin is installed but no GPU driver is (module doc)."""
    plugin = _cuda_plugin()
    if plugin is None or nvidia_driver_present():
        return
    user_platforms = os.environ.get("JAX_PLATFORMS")
    if user_platforms is not None and any(p.strip() in ("cuda", "gpu") for p in user_platforms.split(",")):
        return  # asked for CUDA without a driver: let JAX say everything it has to say
    choose_cpu = user_platforms is None and not other_accelerator_present()
    if choose_cpu and "jax" not in sys.modules:
        os.environ["JAX_PLATFORMS"] = "cpu"  # read by `import jax`; child processes inherit it
        choose_cpu = False
    with drop_driver_noise():
        import jax

        if _backends_initialized():
            return
        # jax was imported before mistjax, no platform set. (jax's Config declares no option attributes.)
        if choose_cpu and not jax.config.jax_platforms:  # type: ignore[attr-defined]
            jax.config.update("jax_platforms", "cpu")
            os.environ["JAX_PLATFORMS"] = "cpu"
        if plugin.is_file():
            # The plugin's PJRT library, which JAX loads when it registers the plugin (its static
            # initialisers log once); a library loaded twice runs them once.
            with contextlib.suppress(OSError):
                ctypes.CDLL(str(plugin))
