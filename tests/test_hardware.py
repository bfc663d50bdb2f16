"""Hardware presets: loading, parsing, JSON round trip and validation, link lookup."""

import dataclasses
import json

import numpy as np
import pytest

from mistjax.hardware import PRESET_NAMES, Cluster, ClusterSpec, DeviceSpec, LinkModel
from mistjax.hardware.interference import InterferenceParams

GiB = 2**30


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("shape", [(1, 8), (4, 8), (2, 4), (1, 16)])
def test_every_preset_builds_and_round_trips(name, shape):
    c = ClusterSpec.preset(name, nodes=shape[0], per_node=shape[1])
    assert c.num_devices == shape[0] * shape[1]
    assert c.source and c.device.source
    back = ClusterSpec.from_json(c.to_json())
    assert back == c
    assert hash(back) == hash(c)
    assert back.fingerprint() == c.fingerprint()
    # every lookup the tuner can make resolves
    for k in (1, 2, 3, 4, 8, 16):
        for m in range(1, shape[0] + 1):
            assert isinstance(c.collective_link(k, m), LinkModel)


def test_parse_shapes_and_names():
    c = ClusterSpec.parse("a100-40gb:4x8")
    assert (c.nodes, c.devices_per_node, c.num_devices) == (4, 8, 32)
    assert ClusterSpec.parse("h100").num_devices == 8
    assert ClusterSpec.parse("l4:4").num_devices == 4
    assert ClusterSpec.parse(" A100-40GB:2X8 ").num_devices == 16
    assert Cluster is ClusterSpec
    for bad in ("a100-40gb:4x", "a100-40gb:x8", ":4x8", "a100 40gb"):
        with pytest.raises(ValueError):
            ClusterSpec.parse(bad)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError) as err:
        ClusterSpec.parse("v100:2x8")
    msg = str(err.value)
    assert "'v100'" in msg
    for name in PRESET_NAMES:
        assert name in msg
    with pytest.raises(ValueError, match="nodes"):
        ClusterSpec.preset("l4", nodes=0)


def test_mist_fitted_numbers():
    l4 = ClusterSpec.preset("l4", nodes=4)
    assert l4.collective_link(8).bandwidth == pytest.approx(4.68e9)
    assert l4.collective_link(2).bandwidth == pytest.approx(2.96e9)
    assert l4.collective_link(4, 2).bandwidth == pytest.approx(1.72e9)
    assert l4.collective_link(1, 4).bandwidth == pytest.approx(0.46e9)
    assert l4.device.host_to_device.bandwidth == pytest.approx(5.75e9)
    assert l4.device.device_to_host.bandwidth == pytest.approx(6.13e9)
    assert l4.interference.four_way() == (18.94, 1.26, 50.0, 1.60)
    a = ClusterSpec.preset("a100-40gb", nodes=4)
    assert a.collective_link(8, 4).bandwidth == pytest.approx(10.6e9)
    assert a.collective_link(8, 2).bandwidth == pytest.approx(10.7e9)
    assert a.interference.four_way() == (1.31, 2.63, 2.41, 2.59)
    # Mist's rules: sizes above 8 use the 8 entry; we also fall back to the largest smaller key
    assert a.collective_link(16).bandwidth == pytest.approx(210e9)
    assert a.collective_link(3).bandwidth == pytest.approx(139e9)
    assert a.collective_link(8, 8) == a.collective_link(8, 4)
    # p2p: the 2-GPU intra fit and the 2-node x 1-GPU fit
    assert a.p2p_link(cross_node=False).bandwidth == pytest.approx(139e9)
    assert a.p2p_link(cross_node=True).bandwidth == pytest.approx(1.30e9)
    assert a.memory_budget() == pytest.approx(0.88 * 40 * GiB)


def test_datasheet_numbers():
    h = ClusterSpec.preset("h100", nodes=2)
    assert h.collective_link(8).bandwidth == pytest.approx(450e9)  # half of 900 GB/s bidirectional
    assert h.collective_link(8, 2).bandwidth == pytest.approx(400e9)  # 8 x 400 Gbps NICs
    assert h.collective_link(1, 2).bandwidth == pytest.approx(50e9)
    assert ClusterSpec.preset("tpu-v5p").collective_link(4).bandwidth == pytest.approx(1.8e11)
    assert ClusterSpec.preset("tpu-v5e", per_node=64).collective_link(64, 2).bandwidth == pytest.approx(
        64 * 25e9 / 8
    )
    for name in PRESET_NAMES:
        src = ClusterSpec.preset(name).source
        assert ("Mist" in src) or ("datasheet" in src) or ("rough" in src)


def test_cpu_preset_splits_the_host():
    one = ClusterSpec.preset("cpu", per_node=1)
    eight = ClusterSpec.preset("cpu", per_node=8)
    assert eight.device.peak_flops == pytest.approx(one.device.peak_flops / 8)
    assert eight.interference == InterferenceParams.serial()


def test_with_memory_and_immutability():
    c = ClusterSpec.preset("a100-80gb", nodes=2)
    small = c.with_memory(16 * GiB)
    assert small.memory_budget() == pytest.approx(0.88 * 16 * GiB)
    assert c.device.hbm_bytes == 80 * GiB
    assert small.intra_node == c.intra_node and small.fingerprint() != c.fingerprint()
    assert c.with_shape(4, 8).num_devices == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.nodes = 3
    with pytest.raises(TypeError):
        c.intra_node[2] = LinkModel(1.0, 0.0)


def _doc():
    return json.loads(ClusterSpec.preset("a100-40gb", nodes=2).to_json())


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d["device"].__setitem__("peak_flops", -1), "cluster.device.peak_flops"),
        (lambda d: d["device"].__setitem__("peak_flops", "fast"), "cluster.device.peak_flops"),
        (lambda d: d["device"].__setitem__("usable_memory_fraction", 1.5), "usable_memory_fraction"),
        (lambda d: d["device"].pop("hbm_bytes"), "missing field(s) ['hbm_bytes']"),
        (lambda d: d["device"]["host_to_device"].__setitem__("latency", -1.0), "host_to_device.latency"),
        (lambda d: d["intra_node"][0].__setitem__("bandwidth", 0), "cluster.intra_node[0].bandwidth"),
        (lambda d: d["intra_node"][1].__setitem__("group_size", 2), "duplicate"),
        (lambda d: d["inter_node"][0].__setitem__("nodes", "two"), "cluster.inter_node[0]"),
        (lambda d: d.__setitem__("nodes", 0), "cluster.nodes"),
        (lambda d: d.__setitem__("nodes", 2.0), "cluster.nodes"),
        (lambda d: d.__setitem__("colour", "red"), "unknown field(s) ['colour']"),
        (lambda d: d.__setitem__("version", 99), "cluster.format/version"),
        (lambda d: d["interference"]["factors"].pop(), "cluster.interference"),
        (lambda d: d["interference"]["factors"].__setitem__(3, 0.5), "cluster.interference"),
        (lambda d: d.__setitem__("inter_node", []), "cluster.inter_node"),
        (lambda d: d.__setitem__("p2p_intra", [1, 2]), "cluster.p2p_intra"),
        (lambda d: d["device"].__setitem__("async_collectives", 1), "device.async_collectives"),
    ],
)
def test_malformed_json_names_the_field(mutate, needle):
    d = _doc()
    mutate(d)
    with pytest.raises(ValueError) as err:
        ClusterSpec.from_json(json.dumps(d))
    assert needle in str(err.value)


def test_invalid_json_text():
    with pytest.raises(ValueError, match="not valid JSON"):
        ClusterSpec.from_json("{nodes: 4")
    with pytest.raises(ValueError, match="expected an object"):
        ClusterSpec.from_json("[1, 2]")


def test_dataclass_validation():
    with pytest.raises(ValueError, match="link.bandwidth"):
        LinkModel(-1.0, 0.0)
    link = LinkModel(1e9, 1e-6)
    with pytest.raises(ValueError, match="matmul_efficiency"):
        DeviceSpec("x", 1e12, 1e11, 1e9, 1e11, link, link, matmul_efficiency=0.0, memory_efficiency=0.5)


def test_vectorised_link_lookup_matches_scalar():
    c = ClusterSpec.preset("l4", nodes=4)
    k = np.array([1, 2, 4, 8, 16, 8, 2])
    m = np.array([1, 1, 1, 1, 1, 2, 4])
    bw, lat = c.collective_link_arrays(k, m)
    for i in range(len(k)):
        link = c.collective_link(int(k[i]), int(m[i]))
        assert (bw[i], lat[i]) == (link.bandwidth, link.latency)


def test_optional_json_fields_take_defaults():
    d = _doc()
    del d["source"], d["device"]["source"], d["device"]["usable_memory_fraction"]
    c = ClusterSpec.from_json(json.dumps(d))
    assert c.source == "" and c.device.usable_memory_fraction == 0.88


def test_async_collectives_where_the_runtime_defers_the_layer_sync():
    """`DeviceSpec.async_collectives`: true on the GPU and TPU presets (the runtime defers the in-loop
    gradient sync there, `core.execution.Capabilities.defers_row_sync`), false on the cpu preset (XLA:CPU's collectives
    are synchronous); a profile without it gets true."""
    for name in PRESET_NAMES:
        want = name != "cpu"
        assert ClusterSpec.preset(name).device.async_collectives is want, name
    d = json.loads(ClusterSpec.preset("cpu").to_json())
    assert d["device"]["async_collectives"] is False
    del d["device"]["async_collectives"]
    assert ClusterSpec.from_json(json.dumps(d)).device.async_collectives is True
