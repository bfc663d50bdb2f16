"""mistjax.hardware.calibrate: the GEMM shape fit recovers the constants that generated its input."""

from __future__ import annotations

import dataclasses

import pytest

from mistjax.hardware.calibrate import GEMM_SHAPES, fit_gemm_shape
from mistjax.hardware.presets import ClusterSpec


@pytest.mark.parametrize(("tile", "k_half"), [(128.0, 32.0), (32.0, 8.0), (1.0, 0.0)])
def test_fit_gemm_shape_recovers_the_generating_constants(tile, k_half):
    dev = dataclasses.replace(ClusterSpec.preset("cpu").device, matmul_tile=tile, matmul_k_half=k_half,
                              matmul_efficiency=1.0)
    eff = {s: float(dev.gemm_efficiency(*s)) for s in GEMM_SHAPES}
    assert fit_gemm_shape(eff) == (tile, k_half)


def test_calibrate_measures_the_simulated_devices():
    """A quick calibration of the 8 simulated CPU devices: one pool of compute (a device runs faster while
    others idle), in-place streaming measured next to fresh outputs, kernel and dispatch overheads, a link
    per group size (finite figures even where quick sizes drown in noise), and a profile that round-trips
    through JSON."""
    from mistjax.hardware.calibrate import calibrate

    lines: list[str] = []
    profile = calibrate(name="test", quick=True, log=lines.append)
    dev = profile.device
    assert dev.shared_compute and not dev.async_collectives and not dev.combines_collectives
    assert dev.update_bandwidth == dev.in_place_bandwidth
    assert all(0 < bw < 1e13 for bw in (dev.in_place_bandwidth, dev.hbm_bandwidth, dev.peak_flops))  # no 1 / 0
    assert 0 < dev.kernel_overhead < 1e-3 and 0 < dev.dispatch_seconds < 1e-1
    assert sorted(profile.intra_node) == [2, 4, 8]
    assert all(link.latency > 0 and link.bandwidth < 1e13 for link in profile.intra_node.values())
    assert ClusterSpec.from_json(profile.to_json()) == profile
    assert any("one pool of compute" in line for line in lines)
