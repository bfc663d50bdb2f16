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
