"""Hardware descriptions for the cost model: devices, links, clusters and the named presets (SI units).

Presets are data: one JSON document per name in ``mistjax/hardware/catalog/`` (package data), read
by `ClusterSpec.from_dict` for the requested shape, each with the source of its numbers.
``docs/hardware.md`` gives the document schema, the link semantics and the sources.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from importlib import resources
from types import MappingProxyType
from typing import Any, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt

from mistjax.hardware.interference import InterferenceParams

GiB = 2**30
_FORMAT, _VERSION = "mistjax.cluster", 1

Json: TypeAlias = Any
"""A parsed JSON value (``json.loads`` output, a cluster document or part of one), validated field by field
where it is read: until then its shape is unknown."""

_T = TypeVar("_T")


def _check_num(owner: str, name: str, v: object, *, positive: bool = True, at_most_one: bool = False) -> None:
    ok = (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
          and (v > 0 if positive else v >= 0) and (not at_most_one or v <= 1))
    if not ok:
        want = "a finite number" + (" > 0" if positive else " >= 0") + (" and <= 1" if at_most_one else "")
        raise ValueError(f"{owner}.{name}: expected {want}, got {v!r}")


def _check_count(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")


@dataclass(frozen=True)
class LinkModel:
    """Alpha-beta link: ``time = latency + bytes / bandwidth`` per transfer step."""

    bandwidth: float  # bytes/s
    latency: float  # seconds per step (ring alpha); Mist's per-call constant b in model="mist"

    def __post_init__(self) -> None:
        _check_num("link", "bandwidth", self.bandwidth)
        _check_num("link", "latency", self.latency, positive=False)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or simulated device)."""

    name: str  # e.g. "NVIDIA A100-SXM4-40GB"
    peak_flops: float  # dense bf16/fp16 FLOP/s
    peak_flops_fp32: float  # dense fp32 FLOP/s
    hbm_bytes: float  # device memory, bytes
    hbm_bandwidth: float  # device memory bandwidth, bytes/s
    host_to_device: LinkModel  # pinned host -> device copies
    device_to_host: LinkModel  # device -> pinned host copies
    matmul_efficiency: float  # fraction of peak_flops large matmuls reach
    memory_efficiency: float  # fraction of hbm_bandwidth streaming kernels reach
    # Dense fp8 FLOP/s of the tensor cores (H100 / H200 / L4: twice bf16); 0: none (A100, TPU v5), where a GEMM of
    # fp8 operands (`mistjax.core.fp8`) runs at ``peak_flops`` after the compiler widens them.
    peak_flops_fp8: float = 0.0
    usable_memory_fraction: float = 0.88  # Mist's capacity factor (room for runtime, fragmentation)
    source: str = ""  # where the numbers come from
    # Host seconds to dispatch one jitted program or device_put (the MPMD pipeline issues many per step);
    # default: the floor scripts/bench_mpmd.py measured for JAX 0.10.2 on the 2-core dev VM (0.15 ms).
    dispatch_seconds: float = 1.5e-4
    # Kernel pricing (mistjax.cost.kernels, docs/cost_model.md "Kernels"):
    matmul_k_half: float = 32.0  # contraction length at which a GEMM reaches half its large-k efficiency
    matmul_tile: float = 128.0  # GEMM tile edge: m and n are padded to multiples of it
    kernel_overhead: float = 3e-6  # seconds every kernel costs on top of its roofline (launch, ramp, tail)
    fused_attention_kernels: bool = True  # fused attention runs as one kernel skipping masked tiles (cuDNN,
    # FlashAttention); False: as the blockwise kernel's plain operations (XLA:CPU)
    # XLA merges the all-gathers / reduce-scatters of one program point into one collective (its combiner
    # passes, XLA:GPU and TPU); False: one per parameter leaf, each paying the link latency (XLA:CPU, which
    # combines all-reduces only).
    combines_collectives: bool = True
    # XLA runs collectives asynchronously (``-start`` / ``-done`` pairs its scheduler overlaps with compute:
    # GPUs, TPUs): a layer loop's ZeRO-3 gathers and reduce-scatters overlap the layers' compute, and the
    # runtime defers each layer's ZeRO-0/1 in-loop gradient sync by one backward iteration so it overlaps
    # the next layer's backward (`core.execution.Capabilities.defers_row_sync`). False: collectives run inline,
    # in program order (XLA:CPU), so each is charged on top of the compute around it.
    async_collectives: bool = True
    # Bytes/s of streaming kernels that overwrite a buffer donated to them (the optimizer update of the
    # donated train state); 0: ``hbm_bandwidth``. XLA:CPU writes every fresh output and temporary into newly
    # allocated host memory, paying first-touch page faults (about 5x slower, `mistjax calibrate` measures
    # both); GPU and TPU allocators reuse device memory, so there the two are one.
    in_place_bandwidth: float = 0.0
    # The node's devices draw on one pool of compute (simulated XLA:CPU devices share the host's cores, and
    # one device alone runs as fast as all of them together): the busy stages of an MPMD pipeline get the idle
    # stages' share, so a pipeline costs about its total work spread over the node, not its lock-step
    # makespan (`mistjax.cost.predict`). False: each device computes on its own (GPUs, TPUs).
    shared_compute: bool = False
    # Fraction of a plan's non-state memory (gradients, activations, buffers) held back for what the memory
    # model misses on this compiler: a plan fits when ``state + (1 + memory_margin) * rest`` is within the
    # budget. Fitted by scripts/fit_memory_margin.py from XLA:GPU compiles of tuned plans
    # (scripts/bench_gpu_aot_tuned.py); ``memory_margin_source`` says which. 0: none (XLA:CPU, whose grid
    # the model is checked on directly).
    memory_margin: float = 0.0
    memory_margin_source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("device.name: expected a non-empty string")
        if not isinstance(self.source, str):
            raise ValueError("device.source: expected a string")
        for f in ("peak_flops", "peak_flops_fp32", "hbm_bytes", "hbm_bandwidth"):
            _check_num("device", f, getattr(self, f))
        for f in ("matmul_efficiency", "memory_efficiency", "usable_memory_fraction"):
            _check_num("device", f, getattr(self, f), at_most_one=True)
        _check_num("device", "dispatch_seconds", self.dispatch_seconds, positive=False)
        _check_num("device", "in_place_bandwidth", self.in_place_bandwidth, positive=False)
        _check_num("device", "peak_flops_fp8", self.peak_flops_fp8, positive=False)
        _check_num("device", "memory_margin", self.memory_margin, positive=False)
        _check_num("device", "matmul_tile", self.matmul_tile)
        for f in ("matmul_k_half", "kernel_overhead"):
            _check_num("device", f, getattr(self, f), positive=False)
        for f in ("fused_attention_kernels", "combines_collectives", "async_collectives", "shared_compute"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"device.{f}: expected true or false, got {getattr(self, f)!r}")
        for f in ("host_to_device", "device_to_host"):
            if not isinstance(getattr(self, f), LinkModel):
                raise ValueError(f"device.{f}: expected a LinkModel")

    @property
    def update_bandwidth(self) -> float:
        """Bytes/s of the optimizer update, which overwrites the donated state: ``in_place_bandwidth`` where
        measured, else ``hbm_bandwidth`` (before ``memory_efficiency``)."""
        return self.in_place_bandwidth or self.hbm_bandwidth

    def gemm_efficiency(self, m: npt.ArrayLike, n: npt.ArrayLike, k: npt.ArrayLike) -> np.ndarray:
        """Fraction of the peak a GEMM of ``m x k`` by ``k x n`` reaches (vectorised; before the memory roofline).

        ``matmul_efficiency * k / (k + matmul_k_half) * tile(m) * tile(n)`` with ``tile(x) = x / (T ceil(x / T))``
        for the tile edge ``T = matmul_tile``: a short contraction pays the tile's fixed load / store work, and
        m, n are padded to whole tiles (docs/cost_model.md, "Kernels").
        """
        k = np.maximum(np.asarray(k, dtype=np.float64), 1.0)
        edge = self.matmul_tile

        def tile(x: npt.ArrayLike) -> np.ndarray:
            x = np.maximum(np.asarray(x, dtype=np.float64), 1.0)
            return x / (np.ceil(x / edge) * edge)

        return self.matmul_efficiency * k / (k + self.matmul_k_half) * tile(m) * tile(n)


def _pick(keys: list[int], want: int) -> int:
    """Largest key <= want, or the smallest key when want is below all of them."""
    below = [k for k in keys if k <= want]
    return max(below) if below else min(keys)


@dataclass(frozen=True)
class ClusterSpec:
    """Nodes x devices with the links the cost model needs. Immutable, hashable, JSON round-trips."""

    name: str  # preset name or user label
    device: DeviceSpec  # every device is identical
    nodes: int  # number of nodes (hosts / ICI slices)
    devices_per_node: int  # devices on each node
    intra_node: Mapping[int, LinkModel]  # group size k (2, 4, 8) -> link of a k-device collective
    inter_node: Mapping[tuple[int, int], LinkModel]  # (nodes m, devices per node k) -> link
    p2p_intra: LinkModel  # pipeline send inside a node (Mist: the 2-GPU intra fit)
    p2p_inter: LinkModel  # pipeline send across nodes (Mist: the 2-node x 1-GPU fit)
    interference: InterferenceParams  # overlap slowdown factors
    source: str = ""  # provenance of the numbers

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("cluster.name: expected a non-empty string")
        if not isinstance(self.source, str):
            raise ValueError("cluster.source: expected a string")
        _check_count("cluster.nodes", self.nodes)
        _check_count("cluster.devices_per_node", self.devices_per_node)
        if not isinstance(self.device, DeviceSpec):
            raise ValueError("cluster.device: expected a DeviceSpec")
        intra, inter = dict(self.intra_node), dict(self.inter_node)
        if not intra:
            raise ValueError("cluster.intra_node: needs at least one entry")
        if self.nodes > 1 and not inter:
            raise ValueError("cluster.inter_node: needs entries when nodes > 1")
        for k, v in intra.items():
            if isinstance(k, bool) or not isinstance(k, int) or k < 1 or not isinstance(v, LinkModel):
                raise ValueError(f"cluster.intra_node[{k!r}]: expected int group size -> LinkModel")
        for pair, v in inter.items():
            good = isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(i, int) and i >= 1 for i in pair)
            if not good or not isinstance(v, LinkModel):
                raise ValueError(f"cluster.inter_node[{pair!r}]: expected (nodes, per_node) ints -> LinkModel")
        typed = (("p2p_intra", LinkModel), ("p2p_inter", LinkModel), ("interference", InterferenceParams))
        for f, kind in typed:
            if not isinstance(getattr(self, f), kind):
                raise ValueError(f"cluster.{f}: expected a {kind.__name__}")
        object.__setattr__(self, "intra_node", MappingProxyType(dict(sorted(intra.items()))))
        object.__setattr__(self, "inter_node", MappingProxyType(dict(sorted(inter.items()))))

    def __hash__(self) -> int:
        return hash(self.to_json())

    @property
    def num_devices(self) -> int:
        """Total devices: nodes * devices_per_node."""
        return self.nodes * self.devices_per_node

    def collective_link(self, group_size_intra: int, group_nodes: int = 1) -> LinkModel:
        """Link for a collective with ``group_size_intra`` devices on each of ``group_nodes`` nodes.

        Single-node groups use ``intra_node``; groups over several nodes use ``inter_node``. Sizes
        without an entry use the largest entry below them (a group of 16 uses the 8 entry).
        """
        k, m = max(int(group_size_intra), 1), max(int(group_nodes), 1)
        if m == 1:
            return self.intra_node[_pick(list(self.intra_node), k)]
        if not self.inter_node:
            raise ValueError(f"cluster {self.name!r} has no inter-node links")
        nk = _pick(sorted({a for a, _ in self.inter_node}), m)
        kk = _pick(sorted(b for a, b in self.inter_node if a == nk), k)
        return self.inter_node[(nk, kk)]

    def collective_link_arrays(self, group_size_intra: npt.ArrayLike, group_nodes: npt.ArrayLike = 1
                               ) -> tuple[np.ndarray | np.float64, np.ndarray | np.float64]:
        """Vectorised ``collective_link``: (bandwidth, latency) arrays, usable as a link in mistjax.cost.

        Arrays of the inputs' broadcast shape; numpy scalars when both inputs are scalars.
        """
        k, m = np.broadcast_arrays(np.asarray(group_size_intra, np.int64), np.asarray(group_nodes, np.int64))
        # One int64 code per (k, m) and a 1-D unique: row-wise np.unique(axis=0) sorts structured
        # rows and dominated the tuner's time on million-element strategy arrays.
        code = k.ravel() * (int(m.max(initial=0)) + 1) + m.ravel()
        uniq, inv = np.unique(code, return_inverse=True)
        span = int(m.max(initial=0)) + 1
        links = [self.collective_link(int(c // span), int(c % span)) for c in uniq]  # few distinct layouts
        bw = np.array([lk.bandwidth for lk in links], np.float64)[inv].reshape(k.shape)
        lat = np.array([lk.latency for lk in links], np.float64)[inv].reshape(k.shape)
        return bw[()], lat[()]

    def p2p_link(self, cross_node: bool) -> LinkModel:
        """Link of a pipeline point-to-point send."""
        return self.p2p_inter if cross_node else self.p2p_intra

    def memory_budget(self) -> float:
        """Bytes a plan may use per device: HBM * usable_memory_fraction (before Mist's gamma)."""
        return self.device.hbm_bytes * self.device.usable_memory_fraction

    def with_memory(self, hbm_bytes: float) -> ClusterSpec:
        """Copy whose devices have ``hbm_bytes`` of memory (to emulate smaller cards)."""
        return replace(self, device=replace(self.device, hbm_bytes=hbm_bytes))

    def with_budget(self, budget_bytes: float) -> ClusterSpec:
        """Copy whose plans may use ``budget_bytes`` per device (the card's memory unchanged)."""
        if not 0 < budget_bytes <= self.device.hbm_bytes:
            raise ValueError(f"a memory budget of {budget_bytes / 2**30:.2f} GiB per device is not within the "
                             f"card's {self.device.hbm_bytes / 2**30:.2f} GiB")
        return replace(self, device=replace(self.device, usable_memory_fraction=budget_bytes / self.device.hbm_bytes))

    def with_shape(self, nodes: int, devices_per_node: int) -> ClusterSpec:
        """Copy with a different node count / node size (links unchanged)."""
        return replace(self, nodes=nodes, devices_per_node=devices_per_node)

    def fingerprint(self) -> str:
        """Short stable hash of every number, for plans to record what they were tuned for."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Json]:
        """Plain-JSON form (dict keys become lists of records)."""
        return {
            "format": _FORMAT, "version": _VERSION, "name": self.name, "source": self.source,
            "nodes": self.nodes, "devices_per_node": self.devices_per_node, "device": asdict(self.device),
            "intra_node": [{"group_size": k, **asdict(v)} for k, v in self.intra_node.items()],
            "inter_node": [{"nodes": a, "per_node": b, **asdict(v)} for (a, b), v in self.inter_node.items()],
            "p2p_intra": asdict(self.p2p_intra), "p2p_inter": asdict(self.p2p_inter),
            "interference": self.interference.to_dict(),
        }

    def to_json(self) -> str:
        """Serialise to JSON text (deterministic)."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, doc: Json, nodes: int | None = None, per_node: int | None = None) -> ClusterSpec:
        """Build from a cluster document, validating every field (ValueError naming the field).

        The document is either ``to_dict`` output or a preset file of ``mistjax/hardware/catalog/``,
        whose links are rules that hold for any shape (``docs/hardware.md`` describes the schema):
        ``intra_node`` / ``inter_node`` may be objects instead of record lists, and ``device`` may
        name host-wide totals in ``split_across_devices``.

        Args:
          doc: the parsed JSON document.
          nodes: number of nodes; overrides (or stands in for) the document's ``nodes``.
          per_node: devices per node; overrides (or stands in for) ``devices_per_node``.
        """
        given = frozenset(k for k, v in (("nodes", nodes), ("devices_per_node", per_node)) if v is not None)
        _fields(doc, "cluster", {f.name for f in fields(cls)} | {"format", "version"}, frozenset({"source"}) | given)
        if doc["format"] != _FORMAT or doc["version"] != _VERSION:
            raise ValueError(f"cluster.format/version: expected {_FORMAT!r} v{_VERSION}, "
                             f"got {doc['format']!r} v{doc['version']!r}")
        n = doc["nodes"] if nodes is None else nodes
        k = doc["devices_per_node"] if per_node is None else per_node
        _check_count("cluster.nodes", n)
        _check_count("cluster.devices_per_node", k)
        try:
            return cls(
                name=doc["name"], device=_device(doc["device"], n * k, "cluster.device"), nodes=n,
                devices_per_node=k, source=doc.get("source", ""),
                intra_node=_intra_links(doc["intra_node"], k, "cluster.intra_node"),
                inter_node=_inter_links(doc["inter_node"], k, "cluster.inter_node"),
                p2p_intra=_link(doc["p2p_intra"], "cluster.p2p_intra"),
                p2p_inter=_link(doc["p2p_inter"], "cluster.p2p_inter"),
                interference=InterferenceParams.from_dict(doc["interference"], "cluster.interference"),
            )
        except TypeError as e:  # a wrongly typed value that slipped past the checks
            raise ValueError(f"cluster: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> ClusterSpec:
        """Parse a cluster document (``to_json`` output or a profile in the preset schema); no pickle, no eval."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"cluster: not valid JSON ({e})") from None
        return cls.from_dict(doc)

    # -- presets --------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, nodes: int = 1, per_node: int = 8) -> ClusterSpec:
        """A named preset with ``nodes`` x ``per_node`` devices (``PRESET_NAMES`` lists them).

        Each preset is a JSON document shipped with the package (``mistjax/hardware/catalog/``), read by
        `from_dict` with the requested shape; its ``source`` fields say where every number comes from.
        """
        key = name.strip().lower()
        if key not in PRESET_NAMES:
            raise ValueError(f"unknown hardware preset {name!r}; valid names: {', '.join(PRESET_NAMES)}")
        _check_count("nodes", nodes)
        _check_count("per_node", per_node)
        return cls.from_dict(preset_document(key), nodes=nodes, per_node=per_node)

    @classmethod
    def parse(cls, spec: str) -> ClusterSpec:
        """``"a100-40gb:4x8"`` = 4 nodes x 8 devices; ``"h100"`` = 1 x 8; ``"l4:4"`` = 1 x 4."""
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*(?::\s*(?:(\d+)\s*[xX]\s*)?(\d+)\s*)?", spec)
        if not m:
            raise ValueError(f"cannot parse cluster spec {spec!r}; expected NAME[:NODESxPER_NODE], "
                             f"e.g. 'a100-40gb:4x8'; valid names: {', '.join(PRESET_NAMES)}")
        name, n, k = m.groups()
        return cls.preset(name, nodes=int(n) if n else 1, per_node=int(k) if k else 8)


Cluster = ClusterSpec  # the name used in design.md

# One document per name in mistjax/hardware/catalog/ (package data; the suite checks the two agree).
PRESET_NAMES: tuple[str, ...] = ("l4", "a100-40gb", "a100-80gb", "h100", "h200", "dgx-a100", "dgx-h100", "aws-p3dn",
                                 "aws-p4d", "aws-p5", "tpu-v5e", "tpu-v5p", "cpu")


@functools.cache
def _preset_text(name: str) -> str:
    return resources.files("mistjax.hardware").joinpath("catalog", f"{name}.json").read_text(encoding="utf-8")


def preset_document(name: str) -> dict[str, Json]:
    """The JSON document of preset ``name`` (a fresh copy: link rules, not yet sized to a shape).

    Raises:
        ValueError: for a name not in ``PRESET_NAMES``.
    """
    if name not in PRESET_NAMES:
        raise ValueError(f"unknown hardware preset {name!r}; valid names: {', '.join(PRESET_NAMES)}")
    return json.loads(_preset_text(name))


# -- JSON validation helpers ---------------------------------------------------------------------
def _fields(doc: object, path: str, allowed: set[str], optional: frozenset[str] = frozenset()) -> None:
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected an object, got {type(doc).__name__}")
    extra, missing = sorted(set(doc) - allowed), sorted(allowed - optional - set(doc))
    if extra:
        raise ValueError(f"{path}: unknown field(s) {extra}")
    if missing:
        raise ValueError(f"{path}: missing field(s) {missing}")


def _build(kind: type[_T], kwargs: dict[str, Json], path: str) -> _T:
    try:
        return kind(**kwargs)
    except ValueError as e:  # "device.peak_flops: ..." -> "cluster.device.peak_flops: ..."
        head, _, rest = str(e).partition(".")
        raise ValueError(f"{path}.{rest}" if rest and ":" not in head else f"{path}: {e}") from None


def _link(doc: Json, path: str) -> LinkModel:
    _fields(doc, path, {"bandwidth", "latency"})
    return _build(LinkModel, doc, path)


def _records(doc: Json, path: str, keys: tuple[str, ...]) -> dict[tuple[int, ...], LinkModel]:
    if not isinstance(doc, list):
        raise ValueError(f"{path}: expected a list of records")
    out: dict[tuple[int, ...], LinkModel] = {}
    for i, rec in enumerate(doc):
        _fields(rec, f"{path}[{i}]", set(keys) | {"bandwidth", "latency"})
        key = tuple(rec[k] for k in keys)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in key):
            raise ValueError(f"{path}[{i}]: {'/'.join(keys)} must be integers >= 1, got {key}")
        if key in out:
            raise ValueError(f"{path}[{i}]: duplicate entry {key}")
        out[key] = _link({"bandwidth": rec["bandwidth"], "latency": rec["latency"]}, f"{path}[{i}]")
    return out


# -- link rules of preset documents ---------------------------------------------------------------
_SPLITTABLE = ("peak_flops", "peak_flops_fp32", "peak_flops_fp8", "hbm_bytes", "hbm_bandwidth", "in_place_bandwidth")


def _pow2_upto(n: int) -> list[int]:
    """Group sizes 2, 4, 8, ... up to max(8, n): the entries a rule-built link table holds."""
    top = max(8, n)
    return [2**i for i in range(1, top.bit_length()) if 2**i <= top]


def _device(doc: Json, num_devices: int, path: str) -> DeviceSpec:
    """A `DeviceSpec` from its document; fields named in ``split_across_devices`` are divided among the devices."""
    _fields(doc, path, {f.name for f in fields(DeviceSpec)} | {"split_across_devices"},
            frozenset({"source", "usable_memory_fraction", "split_across_devices", "dispatch_seconds", "matmul_k_half",
                       "matmul_tile", "kernel_overhead", "fused_attention_kernels",
                       "combines_collectives", "async_collectives", "shared_compute", "in_place_bandwidth",
                       "memory_margin", "memory_margin_source", "peak_flops_fp8"}))
    split = doc.get("split_across_devices", [])
    if not isinstance(split, list) or not all(isinstance(f, str) and f in _SPLITTABLE for f in split):
        raise ValueError(f"{path}.split_across_devices: expected a list of field names among {list(_SPLITTABLE)} "
                         f"(host-wide totals shared by every device), got {split!r}")
    dev = {k: v for k, v in doc.items() if k != "split_across_devices"}
    for f in split:
        _check_num(path, f, dev[f])
        dev[f] = dev[f] / num_devices
    dev["host_to_device"] = _link(dev["host_to_device"], f"{path}.host_to_device")
    dev["device_to_host"] = _link(dev["device_to_host"], f"{path}.device_to_host")
    return _build(DeviceSpec, dev, path)


def _intra_links(doc: Json, per_node: int, path: str) -> dict[int, LinkModel]:
    """Records ``[{group_size, bandwidth, latency}, ...]`` or the rule ``{"group_sizes": "powers_of_two", ...}``."""
    if not isinstance(doc, dict):
        return {k[0]: v for k, v in _records(doc, path, ("group_size",)).items()}
    _fields(doc, path, {"group_sizes", "bandwidth", "latency"})
    if doc["group_sizes"] != "powers_of_two":
        raise ValueError(f"{path}.group_sizes: expected 'powers_of_two' (one link for groups of 2, 4, ... up to "
                         f"max(8, devices_per_node)), got {doc['group_sizes']!r}")
    return dict.fromkeys(_pow2_upto(per_node), _link({"bandwidth": doc["bandwidth"], "latency": doc["latency"]}, path))


def _inter_links(doc: Json, per_node: int, path: str) -> dict[tuple[int, int], LinkModel]:
    """Records ``[{nodes, per_node, bandwidth, latency}, ...]`` or a rule (see ``docs/hardware.md``).

    The rule ``{"nodes": [2, 4], "per_node": "one_and_powers_of_two", "bandwidth_per_device": B, "latency": L}``
    gives a collective over m nodes with k devices on each ``k * B`` (each device drives its own NIC share);
    ``"bandwidth": B`` instead gives every entry the same bandwidth.
    """
    if not isinstance(doc, dict):
        return _records(doc, path, ("nodes", "per_node"))  # type: ignore[return-value]
    _fields(doc, path, {"nodes", "per_node", "bandwidth", "bandwidth_per_device", "latency"},
            frozenset({"bandwidth", "bandwidth_per_device"}))
    if ("bandwidth" in doc) == ("bandwidth_per_device" in doc):
        raise ValueError(f"{path}: give exactly one of 'bandwidth' (every entry) or 'bandwidth_per_device' "
                         "(k devices per node share k times it)")
    m_list = doc["nodes"]
    if (not isinstance(m_list, list) or not m_list or len(set(m_list)) != len(m_list)
            or not all(isinstance(m, int) and not isinstance(m, bool) and m >= 2 for m in m_list)):
        raise ValueError(f"{path}.nodes: expected a non-empty list of distinct node counts >= 2, got {m_list!r}")
    if doc["per_node"] != "one_and_powers_of_two":
        raise ValueError(f"{path}.per_node: expected 'one_and_powers_of_two' (1, 2, 4, ... up to "
                         f"max(8, devices_per_node) devices per node), got {doc['per_node']!r}")
    scale = "bandwidth_per_device" in doc
    bw = doc["bandwidth_per_device"] if scale else doc["bandwidth"]
    _link({"bandwidth": bw, "latency": doc["latency"]}, path)  # validates the numbers once
    return {(m, k): LinkModel(k * bw if scale else bw, doc["latency"])
            for m in m_list for k in [1, *_pow2_upto(per_node)]}
