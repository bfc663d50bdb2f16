"""What the deviceless XLA:GPU compiles share: the target specs, their compile-only devices, XLA's memory
analysis of a compiled program, the report protocol and the zoo's abstract train step.

Read by both `mistjax.validate.gpu_aot` (single-program plans) and `mistjax.validate.gpu_aot_pipeline`
(pipelined plans), which import it rather than each other (`gpu_aot` dispatches to the pipelined compile).
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from mistjax.core.types import Batch, TrainStep

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh

    from mistjax.hardware.presets import ClusterSpec
    from mistjax.train.state import TrainState
    from models.config import ModelConfig

INSTALL_HINT = "pip install 'mistjax[gpu-aot]'"
# mistjax hardware preset -> XLA GpuTargetConfigProto text spec in mistjax/validate/gpu_targets/.
TARGET_SPECS: dict[str, str] = {
    "l4": "l4.txtpb",
    "a100-40gb": "a100_sxm_40.txtpb",
    "a100-80gb": "a100_sxm_80.txtpb",
    "h100": "h100_sxm.txtpb",
    "h200": "h200.txtpb",
    "aws-p4d": "a100_sxm_40.txtpb",  # the same GPU as a100-40gb
    "aws-p5": "h100_sxm.txtpb",  # the same GPU as h100
}
_SPEC_NAME = re.compile(r'^device_description_str:\s*"([^"]*)"', re.M)
_SPEC_MEMORY = re.compile(r"device_memory_size:\s*(\d+)")


class GpuAotUnavailable(RuntimeError):
    """The deviceless XLA:GPU compile cannot run here (plugin missing, or the platform was set up wrong)."""


# ------------------------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class GpuTarget:
    """One XLA:GPU target spec."""

    preset: str  # the mistjax hardware preset it stands for (`TARGET_SPECS`)
    spec_file: str  # file name in mistjax/validate/gpu_targets/
    device_kind: str  # the spec's device description, e.g. "NVIDIA H100 80GB HBM3"
    memory_bytes: int  # the spec's device_memory_size (XLA's memory limit for its remat pass)

    def config_text(self) -> str:
        """The GpuTargetConfigProto text (comments included; the text-format parser skips them)."""
        return importlib.resources.files("mistjax.validate").joinpath("gpu_targets", self.spec_file).read_text()


def load_target(preset: str) -> GpuTarget:
    """The target spec of a hardware preset (``l4``, ``a100-40gb``, ``a100-80gb``, ``h100``, ``h200``)."""
    key = preset.strip().lower()
    if key not in TARGET_SPECS:
        raise ValueError(f"no XLA:GPU target spec for {preset!r}; deviceless GPU compiles know "
                         f"{', '.join(TARGET_SPECS)}")
    text = importlib.resources.files("mistjax.validate").joinpath("gpu_targets", TARGET_SPECS[key]).read_text()
    name, mem = _SPEC_NAME.search(text), _SPEC_MEMORY.search(text)
    return GpuTarget(key, TARGET_SPECS[key], name.group(1) if name else key, int(mem.group(1)) if mem else 0)


def target_for(cluster: ClusterSpec) -> GpuTarget:
    """The spec for a `ClusterSpec`: by preset name, else by its device name (calibrated profiles)."""
    if cluster.name.lower() in TARGET_SPECS:
        return load_target(cluster.name)
    for preset in TARGET_SPECS:
        target = load_target(preset)
        if target.device_kind.lower() == cluster.device.name.lower():
            return target
    raise ValueError(f"no XLA:GPU target spec for cluster {cluster.name!r} (device {cluster.device.name!r}); "
                     f"deviceless GPU compiles know the presets {', '.join(TARGET_SPECS)}")


# ------------------------------------------------------------------------------------- availability
def plugin_problem() -> str | None:
    """Why the deviceless GPU compile cannot run in this environment, or None if its packages are there."""
    import jax

    if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return f"the JAX CUDA plugin (jax-cuda12-plugin) is not installed; {INSTALL_HINT}"
    try:
        version = importlib.metadata.version("jax-cuda12-plugin")
    except importlib.metadata.PackageNotFoundError:
        version = jax.__version__
    if version != jax.__version__:
        return f"jax-cuda12-plugin {version} does not match jax {jax.__version__}; {INSTALL_HINT}"
    nvcc = importlib.util.find_spec("nvidia.cuda_nvcc")
    roots = list(nvcc.submodule_search_locations or ()) if nvcc else []
    if not any((Path(r) / "nvvm" / "libdevice" / "libdevice.10.bc").is_file() for r in roots):
        return f"nvidia-cuda-nvcc-cu12 (ptxas and libdevice for XLA:GPU) is not installed; {INSTALL_HINT}"
    return None


def _platform_problem() -> str:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return ("the CUDA plugin could not register a cuda topology in this process (JAX_PLATFORMS="
            f"{platforms!r}); without a GPU driver the process must start with JAX_PLATFORMS=cpu, e.g. "
            "`JAX_PLATFORMS=cpu python ...`, or use mistjax.validate.gpu_aot.verify_in_subprocess")


def compile_only_devices(target: GpuTarget, nodes: int, per_node: int) -> list[jax.Device]:
    """``nodes * per_node`` compile-only XLA:GPU devices of ``target``, node-major."""
    from jax.experimental import topologies

    problem = plugin_problem()
    if problem:
        raise GpuAotUnavailable(problem)
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target.config_text(),
                                            topology=f"1x{nodes}x{per_node}")
    except (NotImplementedError, RuntimeError) as e:
        raise GpuAotUnavailable(f"{_platform_problem()} ({e})") from e
    return sorted(topo.devices, key=lambda d: d.id)


def device_mesh(devices: Sequence[jax.Device], nodes: int) -> Mesh:
    """The devices as a ``(node, gpu)`` mesh, so the runtime knows the node boundaries (MiCS, TP checks)."""
    from jax.sharding import Mesh

    return Mesh(np.array(devices, dtype=object).reshape(nodes, len(devices) // nodes), ("node", "gpu"))


# ---------------------------------------------------------------------------------------- the report
class MemoryStats(Protocol):
    """The fields of XLA's ``memory_analysis()`` result (jaxlib's ``CompiledMemoryStats``) read here, in bytes."""

    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int
    host_argument_size_in_bytes: int
    host_output_size_in_bytes: int
    host_temp_size_in_bytes: int


class MemoryAnalyzed(Protocol):
    """A compiled program that reports its memory: a `jax.stages.Compiled`, compile-only ones included."""

    def memory_analysis(self) -> MemoryStats: ...


@dataclass(frozen=True)
class DeviceMemory:
    """XLA's ``memory_analysis()`` of one device's program, in bytes."""

    argument: int  # inputs: the state shards (params, optimizer state, step) and the batch shard
    output: int  # outputs: the new state and the metrics
    alias: int  # output bytes that reuse donated input buffers
    temp: int  # XLA's temp allocation: every other value live during the step (grads, activations, ...)
    host_argument: int = 0  # inputs placed in host memory
    host_output: int = 0  # outputs placed in host memory
    host_temp: int = 0  # host-memory temporaries (offloaded activations)

    @property
    def peak(self) -> int:
        """Device bytes the step needs: argument + output + temp - alias."""
        return self.argument + self.output + self.temp - self.alias

    @classmethod
    def of(cls, compiled: MemoryAnalyzed) -> DeviceMemory:
        """The memory analysis of ``compiled``."""
        m = compiled.memory_analysis()
        return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes,
                   m.host_argument_size_in_bytes, m.host_output_size_in_bytes, m.host_temp_size_in_bytes)


class Verification(Protocol):
    """What a deviceless compile of a plan reports, single-program (`GpuAotReport`) or pipelined
    (`mistjax.validate.gpu_aot_pipeline.PipelineAotReport`)."""

    cluster: str
    device_kind: str
    num_devices: int
    capacity: float
    budget: float
    compile_seconds: float

    @property
    def peak_per_stage(self) -> list[int]: ...  # XLA's per-device peak of each stage, offloaded state on host

    @property
    def fits(self) -> bool: ...

    def to_dict(self) -> dict[str, object]: ...


# ---------------------------------------------------------------------------------- the zoo's step
def zoo_step(config: ModelConfig, seq_len: int, global_batch: int, learning_rate: float = 1e-3
             ) -> tuple[TrainState, dict[str, jax.ShapeDtypeStruct], TrainStep]:
    """Abstract (state, batch) and the train step of a `models.ModelConfig` with AdamW, as the cost
    model's `models.workload` assumes (``mistjax.value_and_grad`` of the zoo's cross-entropy). 16-bit
    weights (``config.param_dtype``) keep an fp32 master copy (`mistjax.with_master_weights`)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import mistjax
    import models
    from mistjax.train.state import TrainState
    from models import make_loss_fn

    tx = optax.adamw(learning_rate)
    low = config.param_dtype != "float32"
    if low:
        tx = mistjax.with_master_weights(tx)
    full = config.replace(param_dtype="float32")
    state = nnx.eval_shape(lambda: TrainState.create(models.build(full, rngs=nnx.Rngs(0)), tx,
                                                     param_dtype=config.param_dtype if low else None))
    loss_fn = make_loss_fn(state.graphdef)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        loss, grads = mistjax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    tokens = jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32)
    return state, {"inputs": tokens, "targets": tokens}, train_step


__all__ = ["INSTALL_HINT", "TARGET_SPECS", "DeviceMemory", "GpuAotUnavailable", "GpuTarget", "MemoryAnalyzed",
           "MemoryStats", "Verification", "compile_only_devices", "device_mesh", "load_target", "plugin_problem",
           "target_for", "zoo_step"]
