"""Hardware descriptions for the cost model: devices, links, clusters, presets. SI units throughout.

Two kinds of presets (see ``PRESET_NAMES``):

* ``l4`` and ``a100-40gb`` use the bandwidths Mist FITTED on its clusters (GCP, 8 GPUs per node; Mist
  digest section 3.4). They are effective numbers, far below link specs, and Mist's planner used
  them. Collective latencies and 24 of the 28 interference factors were not available and are
  assumptions (stated in each ``source``).
* ``a100-80gb``, ``h100``, ``h200``, ``tpu-v5e``, ``tpu-v5p`` come from datasheets
  (shared/notes/hardware.md): per-direction link bandwidth = half the quoted bidirectional total;
  no efficiency derating on links (achieved NCCL bus bandwidth is usually 70-90% of it).
* ``cpu``: rough numbers for the simulated XLA CPU devices of a small dev VM.

Link semantics. ``intra_node[k]`` is the link of a collective among k devices of one node (for
TPUs a "node" is an ICI slice). ``inter_node[(m, k)]`` is the effective bandwidth of a collective
over m nodes with k devices taking part on each: for a flat ring it is the bus bandwidth, and for
MiCS's hierarchical collectives it is the node-level inter-node bandwidth the k devices share. It
grows with k because each GPU brings its own NIC share (Mist's fits grow almost linearly in k).
Lookups use the largest key <= the request (Mist: sizes above 8 use the 8 entry).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from mistjax.cost.interference import InterferenceParams

GiB = 2**30
_FORMAT, _VERSION = "mistjax.cluster", 1


def _check_num(owner: str, name: str, v: Any, *, positive: bool = True, at_most_one: bool = False) -> None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > 0 if positive else v >= 0) and (not at_most_one or v <= 1)
    if not ok:
        want = "a finite number" + (" > 0" if positive else " >= 0") + (" and <= 1" if at_most_one else "")
        raise ValueError(f"{owner}.{name}: expected {want}, got {v!r}")


def _check_count(name: str, v: Any) -> None:
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
    usable_memory_fraction: float = 0.88  # Mist's capacity factor (room for runtime, fragmentation)
    source: str = ""  # where the numbers come from

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("device.name: expected a non-empty string")
        if not isinstance(self.source, str):
            raise ValueError("device.source: expected a string")
        for f in ("peak_flops", "peak_flops_fp32", "hbm_bytes", "hbm_bandwidth"):
            _check_num("device", f, getattr(self, f))
        for f in ("matmul_efficiency", "memory_efficiency", "usable_memory_fraction"):
            _check_num("device", f, getattr(self, f), at_most_one=True)
        for f in ("host_to_device", "device_to_host"):
            if not isinstance(getattr(self, f), LinkModel):
                raise ValueError(f"device.{f}: expected a LinkModel")


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
        for k, v in inter.items():
            good = isinstance(k, tuple) and len(k) == 2 and all(isinstance(i, int) and i >= 1 for i in k)
            if not good or not isinstance(v, LinkModel):
                raise ValueError(f"cluster.inter_node[{k!r}]: expected (nodes, per_node) ints -> LinkModel")
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

    def collective_link_arrays(self, group_size_intra: Any, group_nodes: Any = 1) -> tuple[Any, Any]:
        """Vectorised ``collective_link``: (bandwidth, latency) arrays, usable as a link in mistjax.cost."""
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

    def with_shape(self, nodes: int, devices_per_node: int) -> ClusterSpec:
        """Copy with a different node count / node size (links unchanged)."""
        return replace(self, nodes=nodes, devices_per_node=devices_per_node)

    def fingerprint(self) -> str:
        """Short stable hash of every number, for plans to record what they were tuned for."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
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
    def from_dict(cls, doc: Any) -> ClusterSpec:
        """Build from ``to_dict`` output, validating every field (ValueError naming the field)."""
        _fields(doc, "cluster", {f.name for f in fields(cls)} | {"format", "version"}, frozenset({"source"}))
        if doc["format"] != _FORMAT or doc["version"] != _VERSION:
            raise ValueError(f"cluster.format/version: expected {_FORMAT!r} v{_VERSION}, "
                             f"got {doc['format']!r} v{doc['version']!r}")
        dev = doc["device"]
        _fields(dev, "cluster.device", {f.name for f in fields(DeviceSpec)},
                frozenset({"source", "usable_memory_fraction"}))
        dev = {**dev, "host_to_device": _link(dev["host_to_device"], "cluster.device.host_to_device"),
               "device_to_host": _link(dev["device_to_host"], "cluster.device.device_to_host")}
        intra = _records(doc["intra_node"], "cluster.intra_node", ("group_size",))
        inter = _records(doc["inter_node"], "cluster.inter_node", ("nodes", "per_node"))
        try:
            return cls(
                name=doc["name"], device=_build(DeviceSpec, dev, "cluster.device"), nodes=doc["nodes"],
                devices_per_node=doc["devices_per_node"], source=doc.get("source", ""),
                intra_node={k[0]: v for k, v in intra.items()}, inter_node=inter,
                p2p_intra=_link(doc["p2p_intra"], "cluster.p2p_intra"),
                p2p_inter=_link(doc["p2p_inter"], "cluster.p2p_inter"),
                interference=InterferenceParams.from_dict(doc["interference"], "cluster.interference"),
            )
        except TypeError as e:  # a wrongly typed value that slipped past the checks
            raise ValueError(f"cluster: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> ClusterSpec:
        """Parse JSON text written by ``to_json`` (no pickle, no eval)."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"cluster: not valid JSON ({e})") from None
        return cls.from_dict(doc)

    # -- presets --------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, nodes: int = 1, per_node: int = 8) -> ClusterSpec:
        """A named preset with ``nodes`` x ``per_node`` devices (``PRESET_NAMES`` lists them)."""
        key = name.strip().lower()
        if key not in _BUILDERS:
            raise ValueError(f"unknown hardware preset {name!r}; valid names: {', '.join(PRESET_NAMES)}")
        _check_count("nodes", nodes)
        _check_count("per_node", per_node)
        return _BUILDERS[key](nodes, per_node)

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

PRESET_NAMES: tuple[str, ...] = ("l4", "a100-40gb", "a100-80gb", "h100", "h200", "tpu-v5e", "tpu-v5p", "cpu")


# -- JSON validation helpers ---------------------------------------------------------------------
def _fields(doc: Any, path: str, allowed: set[str], optional: frozenset[str] = frozenset()) -> None:
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected an object, got {type(doc).__name__}")
    extra, missing = sorted(set(doc) - allowed), sorted(allowed - optional - set(doc))
    if extra:
        raise ValueError(f"{path}: unknown field(s) {extra}")
    if missing:
        raise ValueError(f"{path}: missing field(s) {missing}")


def _build(kind: type, kwargs: dict[str, Any], path: str) -> Any:
    try:
        return kind(**kwargs)
    except ValueError as e:  # "device.peak_flops: ..." -> "cluster.device.peak_flops: ..."
        head, _, rest = str(e).partition(".")
        raise ValueError(f"{path}.{rest}" if rest and ":" not in head else f"{path}: {e}") from None


def _link(doc: Any, path: str) -> LinkModel:
    _fields(doc, path, {"bandwidth", "latency"})
    return _build(LinkModel, doc, path)


def _records(doc: Any, path: str, keys: tuple[str, ...]) -> dict[tuple[int, ...], LinkModel]:
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


# -- preset catalogue ----------------------------------------------------------------------------
# Latencies are assumptions (Mist's fitted per-call constants were not in our digest): per ring
# step ~2 us on NVLink, 4 us on PCIe, 1 us per ICI hop, 8 us on InfiniBand/RoCE, 30 us on GCP's
# TCP VM network and TPU DCN; 10 us per host<->device copy.
_NVLINK_LAT, _PCIE_LAT, _ICI_LAT, _IB_LAT, _TCP_LAT, _COPY_LAT = 2e-6, 4e-6, 1e-6, 8e-6, 30e-6, 10e-6
_MIST_A100_4WAY = (1.31, 2.63, 2.41, 2.59)  # Mist template-a100 4-way fit (compute, d2d, h2d, d2h)
_MIST_L4_4WAY = (18.94, 1.26, 50.0, 1.60)  # Mist template-l4 4-way fit
_FILL = "the other 24 interference factors are generic defaults (InterferenceParams.from_four_way)"


def _copy(bandwidth: float) -> LinkModel:
    return LinkModel(bandwidth, _COPY_LAT)


def _pow2_upto(n: int) -> list[int]:
    return [2**i for i in range(1, max(8, n).bit_length()) if 2**i <= max(8, n)]


def _mist_cluster(name: str, dev: DeviceSpec, nodes: int, per_node: int, intra_lat: float,
                  intra_gbs: dict[int, float], inter_gbs: dict[int, tuple[float, ...]],
                  four_way: tuple[float, ...], source: str) -> ClusterSpec:
    intra = {k: LinkModel(v * 1e9, intra_lat) for k, v in intra_gbs.items()}
    inter = {(m, k): LinkModel(v * 1e9, _TCP_LAT)
             for m, row in inter_gbs.items() for k, v in zip((1, 2, 4, 8), row)}
    return ClusterSpec(name, dev, nodes, per_node, intra, inter, p2p_intra=intra[2], p2p_inter=inter[(2, 1)],
                       interference=InterferenceParams.from_four_way(four_way), source=source)


def _datasheet_cluster(name: str, dev: DeviceSpec, nodes: int, per_node: int, intra: LinkModel,
                       nic_per_device: float, inter_lat: float, interference: InterferenceParams,
                       source: str) -> ClusterSpec:
    sizes = _pow2_upto(per_node)
    # k devices per node drive k NIC shares (not capped by the intra link: in MiCS's hierarchical
    # collectives the intra phase is priced separately; a flat ring is rarely that wide).
    inter = {(m, k): LinkModel(k * nic_per_device, inter_lat)
             for m in (2, 4) for k in [1, *sizes]}
    return ClusterSpec(name, dev, nodes, per_node, dict.fromkeys(sizes, intra), inter, p2p_intra=intra,
                       p2p_inter=inter[(2, 1)], interference=interference, source=source)


def _l4(nodes: int, per_node: int) -> ClusterSpec:
    dev = DeviceSpec(
        "NVIDIA L4", 121e12, 30.3e12, 22.488 * GiB, 300e9, _copy(5.75e9), _copy(6.13e9),
        # Mist pins clocks at 1050 MHz (about half the boost clock the 121 TFLOPS figure assumes).
        matmul_efficiency=0.45, memory_efficiency=0.8,
        source="datasheet peaks (121 TFLOPS bf16, 30.3 fp32, 300 GB/s); memory 22.488 GB as in Mist's L4 "
               "template; H2D 5.75 / D2H 6.13 GB/s fitted by Mist; efficiencies assumed")
    return _mist_cluster(
        "l4", dev, nodes, per_node, _PCIE_LAT, {2: 2.96, 4: 4.16, 8: 4.68},
        {2: (0.49, 0.98, 1.72, 3.32), 4: (0.46, 0.92, 1.68, 2.97)}, _MIST_L4_4WAY,
        "Mist artifact template-l4 fits (GCP, 8x L4 per node, PCIe, no NVLink): GPU-GPU bandwidths, 4-way "
        f"interference factors; {_FILL}; latencies assumed")


def _a100_40gb(nodes: int, per_node: int) -> ClusterSpec:
    dev = DeviceSpec(
        "NVIDIA A100-SXM4-40GB", 312e12, 19.5e12, 40 * GiB, 1555e9, _copy(5.36e9), _copy(5.85e9),
        matmul_efficiency=0.8, memory_efficiency=0.85,
        source="datasheet peaks (312 TFLOPS bf16, 19.5 fp32, 1555 GB/s); 40 GB as in Mist's template; "
               "H2D 5.36 / D2H 5.85 GB/s fitted by Mist; efficiencies assumed")
    return _mist_cluster(
        "a100-40gb", dev, nodes, per_node, _NVLINK_LAT, {2: 139.0, 4: 193.0, 8: 210.0},
        {2: (1.30, 2.60, 5.42, 10.70), 4: (1.25, 2.49, 5.30, 10.60)}, _MIST_A100_4WAY,
        "Mist artifact template-a100 fits (GCP, 8x A100-SXM4-40GB per node, NVLink): GPU-GPU bandwidths, "
        f"4-way interference factors; {_FILL}; latencies assumed")


def _nvidia(name: str, label: str, flops: float, fp32: float, mem: float, hbm_bw: float, nvlink_dir: float,
            pcie_dir: float, nic: float, net_lat: float, note: str) -> Any:
    def build(nodes: int, per_node: int) -> ClusterSpec:
        dev = DeviceSpec(label, flops, fp32, mem, hbm_bw, _copy(pcie_dir), _copy(pcie_dir),
                         matmul_efficiency=0.75, memory_efficiency=0.85,
                         source=f"datasheet: {note}; FP32 {fp32 / 1e12:g} TFLOPS (NVIDIA datasheet); "
                                "efficiencies assumed")
        return _datasheet_cluster(
            name, dev, nodes, per_node, LinkModel(nvlink_dir, _NVLINK_LAT), nic, net_lat,
            InterferenceParams.from_four_way(_MIST_A100_4WAY),
            f"datasheet (shared/notes/hardware.md): {note}; NVLink per direction = half the bidirectional "
            f"total; 4-way interference borrowed from Mist's A100 fit, {_FILL}; latencies assumed")
    return build


def _tpu(name: str, label: str, flops: float, mem: float, hbm_bw: float, ici_link: float, dcn: float,
         note: str) -> Any:
    def build(nodes: int, per_node: int) -> ClusterSpec:
        dev = DeviceSpec(label, flops, flops / 6, mem, hbm_bw, _copy(1.5e10), _copy(1.5e10),
                         matmul_efficiency=0.85, memory_efficiency=0.85,
                         source=f"datasheet: {note}; fp32 = 1/6 of bf16 (HIGHEST precision = 6 bf16 passes); "
                                "host PCIe ~1.5e10 B/s per chip; efficiencies assumed")
        return _datasheet_cluster(
            name, dev, nodes, per_node, LinkModel(2 * ici_link, _ICI_LAT), dcn, _TCP_LAT,
            InterferenceParams.from_four_way((1.2, 1.2, 1.2, 1.2)),
            f"datasheet (shared/notes/hardware.md): {note}; a 'node' is one ICI slice; a ring along a torus "
            "axis uses both directions (2x the one-way link); inter-node = DCN; interference factors are "
            "placeholders (1.2 four-way), not measured; latencies assumed")
    return build


def _cpu(nodes: int, per_node: int) -> ClusterSpec:
    n = nodes * per_node  # simulated devices share the host, so each gets 1/n of it
    link = LinkModel(2e9, 20e-6)
    dev = DeviceSpec("cpu (simulated XLA device)", 1e11 / n, 1e11 / n, 16 * GiB / n, 2e10 / n, link, link,
                     matmul_efficiency=0.9, memory_efficiency=0.9,
                     source="rough: 2-core dev VM, ~1e11 FLOP/s jitted matmul and ~2e10 B/s memory in total, "
                            "split over the simulated devices; 16 GiB of host RAM shared")
    return ClusterSpec("cpu", dev, nodes, per_node, dict.fromkeys(_pow2_upto(per_node), link),
                       {(m, k): link for m in (2, 4) for k in [1, *_pow2_upto(per_node)]},
                       p2p_intra=link, p2p_inter=link, interference=InterferenceParams.serial(),
                       source="rough numbers for XLA:CPU simulated devices (collectives are memcpys with "
                              "rendezvous overhead); every channel competes for the same cores, so the "
                              "interference model is fully serial")


_BUILDERS = {
    "l4": _l4,
    "a100-40gb": _a100_40gb,
    "a100-80gb": _nvidia("a100-80gb", "NVIDIA A100-SXM4-80GB", 312e12, 19.5e12, 80 * GiB, 2039e9, 300e9, 32e9,
                         12.5e9 / 8, _TCP_LAT, "312 TFLOPS bf16, 80 GB HBM2e at 2039 GB/s, NVLink3 600 GB/s, "
                         "PCIe Gen4 32 GB/s per direction, GCP A2 100 Gbps per 8-GPU VM"),
    "h100": _nvidia("h100", "NVIDIA H100-SXM5-80GB", 989e12, 67e12, 80 * GiB, 3.35e12, 450e9, 64e9, 50e9,
                    _IB_LAT,
                    "989 TFLOPS bf16, 80 GB HBM3 at 3.35 TB/s, NVLink4 900 GB/s, PCIe Gen5 64 GB/s per "
                    "direction, 400 Gbps NIC per GPU (DGX-style)"),
    "h200": _nvidia("h200", "NVIDIA H200-SXM-141GB", 989e12, 67e12, 140 * GiB, 4.8e12, 450e9, 64e9, 50e9,
                    _IB_LAT, "989 TFLOPS bf16, 141 GB HBM3e (~140 GiB visible) at 4.8 TB/s, NVLink4 900 "
                    "GB/s, PCIe Gen5 64 GB/s per direction, GCP A3 Ultra 8x400 Gbps"),
    "tpu-v5e": _tpu("tpu-v5e", "TPU v5e", 197e12, 16 * GiB, 819e9, 4.5e10, 25e9 / 8,
                    "197 TFLOPS bf16, 16 GB HBM2 at 819 GB/s, ICI 4.5e10 B/s one-way per link, DCN 2x100 "
                    "Gbps per 8-chip host"),
    "tpu-v5p": _tpu("tpu-v5p", "TPU v5p", 459e12, 95 * GiB, 2765e9, 9e10, 6.25e9,
                    "459 TFLOPS bf16, 95 GB HBM2e at 2765 GB/s, ICI 9e10 B/s one-way per link, DCN 50 Gbps "
                    "per chip"),
    "cpu": _cpu,
}
assert tuple(_BUILDERS) == PRESET_NAMES
