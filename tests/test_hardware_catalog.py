"""Hardware presets as data: the catalog documents, their link rules, sources and the DGX presets."""

import json
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from mistjax.hardware import PRESET_NAMES, ClusterSpec, InterferenceParams
from mistjax.hardware.presets import preset_document

GiB = 2**30
CATALOG = resources.files("mistjax.hardware").joinpath("catalog")


def test_catalog_holds_exactly_the_named_presets():
    files = sorted(p.name for p in CATALOG.iterdir() if p.name.endswith(".json"))
    assert files == sorted(f"{n}.json" for n in PRESET_NAMES)
    for name in PRESET_NAMES:
        doc = preset_document(name)
        assert doc["name"] == name
        assert "nodes" not in doc and "devices_per_node" not in doc  # the shape comes from the caller


def test_catalog_ships_in_the_wheel():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "catalog/*.json" in pyproject["tool"]["setuptools"]["package-data"]["mistjax.hardware"]


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_states_its_sources_inside_the_repository(name):
    doc = preset_document(name)
    for text in (doc["source"], doc["device"]["source"]):
        assert len(text) > 40
        assert "shared/" not in text and "/work" not in text and ".md" not in text


def test_preset_document_is_a_fresh_copy():
    doc = preset_document("h100")
    doc["device"]["peak_flops"] = 1.0
    assert ClusterSpec.preset("h100").device.peak_flops == 989e12
    with pytest.raises(ValueError, match="unknown hardware preset 'v100'"):
        preset_document("v100")


def test_dgx_a100_from_its_datasheet():
    c = ClusterSpec.parse("dgx-a100:4x8")
    assert c.device.name == "NVIDIA A100-SXM4-80GB" and c.device.hbm_bytes == 80 * GiB
    assert c.device.peak_flops == 312e12 and c.device.hbm_bandwidth == 2039e9
    assert c.collective_link(8).bandwidth == 300e9  # NVLink3 600 GB/s bidirectional, per direction
    assert c.collective_link(8, 4).bandwidth == 8 * 25e9  # 8x 200 Gb/s HDR per node, per direction
    assert c.collective_link(1, 2).bandwidth == 25e9 and c.p2p_link(cross_node=True).bandwidth == 25e9
    assert c.collective_link(8, 2).latency == 8e-6  # InfiniBand, not the GCP VM network
    assert "DGX A100" in c.source and "200 Gb/s HDR" in c.source


def test_dgx_h100_from_its_datasheet():
    c = ClusterSpec.parse("dgx-h100:2x8")
    assert c.device.name == "NVIDIA H100-SXM5-80GB" and c.device.peak_flops == 989e12
    assert c.collective_link(8).bandwidth == 450e9  # NVLink4 900 GB/s bidirectional, per direction
    assert c.collective_link(8, 2).bandwidth == 8 * 50e9  # 8x 400 Gb/s NDR per node
    assert "DGX H100" in c.source and "400 Gb/s NDR" in c.source
    # the h100 preset models a DGX-style node: same numbers, other name and sources
    h = ClusterSpec.parse("h100:2x8")
    assert h.intra_node == c.intra_node and h.inter_node == c.inter_node and h.device.hbm_bytes == c.device.hbm_bytes


def test_rule_links_follow_the_shape():
    small, wide = ClusterSpec.preset("h100", 2, 4), ClusterSpec.preset("h100", 2, 64)
    assert list(small.intra_node) == [2, 4, 8] and list(wide.intra_node) == [2, 4, 8, 16, 32, 64]
    assert wide.collective_link(64, 2).bandwidth == 64 * 50e9
    assert sorted({m for m, _ in wide.inter_node}) == [2, 4]
    # the cpu preset shares one host: per-device numbers are the document's totals split over the devices
    doc = preset_document("cpu")
    for shape in ((1, 8), (2, 4), (1, 1)):
        c = ClusterSpec.preset("cpu", *shape)
        n = shape[0] * shape[1]
        assert c.device.hbm_bytes == doc["device"]["hbm_bytes"] / n
        assert c.device.peak_flops == doc["device"]["peak_flops"] / n


def test_a_profile_may_use_rules_and_round_trips():
    doc = preset_document("a100-80gb") | {"nodes": 2, "devices_per_node": 8, "name": "my-a2"}
    c = ClusterSpec.from_dict(doc)
    assert c.name == "my-a2" and c.num_devices == 16
    assert ClusterSpec.from_json(c.to_json()) == c  # realised as plain link records
    assert ClusterSpec.from_dict(doc, nodes=4, per_node=2).num_devices == 8  # the arguments override


def test_four_way_interference_form():
    fw = [1.31, 2.63, 2.41, 2.59]
    assert InterferenceParams.from_dict({"four_way": fw}) == InterferenceParams.from_four_way(fw)
    custom = InterferenceParams.from_dict({"four_way": fw, "triple": 1.2, "pair": 1.1})
    assert custom == InterferenceParams.from_four_way(fw, triple=1.2, pair=1.1)
    with pytest.raises(ValueError, match=r"cluster.interference: four_way: expected 4 factors"):
        InterferenceParams.from_dict({"four_way": fw[:3]}, "cluster.interference")
    with pytest.raises(ValueError, match=r"interference.pair"):
        InterferenceParams.from_dict({"four_way": fw, "pair": "mild"})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['factors'\]"):
        InterferenceParams.from_dict({"four_way": fw, "factors": [1.0] * 28})


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: None, "missing field(s) ['devices_per_node', 'nodes']"),
        (lambda d: d["intra_node"].__setitem__("group_sizes", "all"), "cluster.intra_node.group_sizes"),
        (lambda d: d["intra_node"].__setitem__("bandwidth", -1), "cluster.intra_node.bandwidth"),
        (lambda d: d["inter_node"].__setitem__("bandwidth", 1e9), "exactly one of 'bandwidth'"),
        (lambda d: d["inter_node"].pop("bandwidth_per_device"), "exactly one of 'bandwidth'"),
        (lambda d: d["inter_node"].__setitem__("nodes", [1, 2]), "cluster.inter_node.nodes"),
        (lambda d: d["inter_node"].__setitem__("nodes", []), "cluster.inter_node.nodes"),
        (lambda d: d["inter_node"].__setitem__("per_node", "all"), "cluster.inter_node.per_node"),
        (lambda d: d["inter_node"].__setitem__("latency", "slow"), "cluster.inter_node.latency"),
        (lambda d: d["device"].__setitem__("split_across_devices", ["name"]), "split_across_devices"),
        (lambda d: d["device"].__setitem__("split_across_devices", "hbm_bytes"), "split_across_devices"),
        (lambda d: d["interference"].__setitem__("four_way", [1.0, 0.5, 1.0, 1.0]), "cluster.interference"),
    ],
)
def test_malformed_rules_name_the_field(mutate, needle):
    doc = preset_document("h100")
    mutate(doc)
    shaped = not needle.startswith("missing")  # a preset document has no shape of its own
    with pytest.raises(ValueError) as err:
        ClusterSpec.from_dict(json.loads(json.dumps(doc)), **(dict(nodes=2, per_node=8) if shaped else {}))
    assert needle in str(err.value)
    if not shaped:
        assert ClusterSpec.from_dict(doc, nodes=1, per_node=8) == ClusterSpec.preset("h100")


def test_split_field_must_be_a_number():
    doc = preset_document("cpu")
    doc["device"]["hbm_bytes"] = "lots"
    with pytest.raises(ValueError, match="cluster.device.hbm_bytes"):
        ClusterSpec.from_dict(doc, nodes=1, per_node=8)


@pytest.mark.parametrize("name,gbit_per_node,gpu", [("aws-p3dn", 100, "V100-SXM2-32GB"),
                                                     ("aws-p4d", 400, "A100-SXM4-40GB"),
                                                     ("aws-p5", 3200, "H100-SXM5-80GB")])
def test_cloud_presets_carry_their_instances_network(name, gbit_per_node, gpu):
    """The public-cloud presets MiCS targets (#52): eight GPUs per instance, the instance's network line rate split
    over its GPUs, the same XLA:GPU target as the GPU's own preset where one exists."""
    from mistjax.validate.gpu_aot_target import TARGET_SPECS

    cl = ClusterSpec.preset(name, nodes=4, per_node=8)
    assert gpu in cl.device.name
    assert cl.collective_link(8, 4).bandwidth * 8 / 1e9 == pytest.approx(gbit_per_node)
    assert "aws.amazon.com" in cl.source
    assert TARGET_SPECS.get(name) == {"aws-p4d": "a100_sxm_40.txtpb", "aws-p5": "h100_sxm.txtpb"}.get(name)
