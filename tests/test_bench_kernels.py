"""scripts/bench_kernels.py: the kernel curves bench_gpu.sh measures on a lent GPU, checked on the CPU with tiny
shapes (the script's health and its rows' fields, not a measurement)."""

from pathlib import Path

import numpy as np
from conftest import load_script

from mistjax.cost.kernels import gemm_kernel_seconds, streaming_seconds
from mistjax.hardware import ClusterSpec

ROOT = Path(__file__).resolve().parents[1]


def _script():
    return load_script("bench_kernels")


def test_smoke_rows_carry_measurement_and_the_models_price(tmp_path):
    doc = _script().main(["--smoke", "--repeats", "2", "--json", str(tmp_path / "k.json")])
    kinds = {r["kind"] for r in doc["rows"]}
    assert kinds == {"gemm", "stream", "attention"} and (tmp_path / "k.json").exists()
    dev = ClusterSpec.preset("h200", nodes=1, per_node=1).device
    for r in doc["rows"]:
        if r["kind"] == "gemm":
            flops = 2.0 * r["m"] * r["n"] * r["k"]
            assert r["seconds"] > 0 and r["tflops"] == flops / r["seconds"] / 1e12
            assert r["pred_s"] >= dev.kernel_overhead
        elif r["kind"] == "stream":
            assert r["pred_s"] == float(streaming_seconds(r["bytes"], dev)) + dev.kernel_overhead
        else:
            assert r["fwd_s"] > 0 and r["fwd_bwd_s"] > 0


def test_gemm_kernel_price_is_its_rooflines_plus_overhead():
    """A large GEMM is compute-bound at the preset's efficiency; a thin one memory-bound; both pay the overhead."""
    dev = ClusterSpec.preset("h200", nodes=1, per_node=1).device
    big = float(gemm_kernel_seconds(2.0 * 8192**3, 8192, 8192, 8192, 3 * 8192**2 * 2, dev, dev.peak_flops))
    assert np.isclose(big, 2.0 * 8192**3 / (dev.peak_flops * float(dev.gemm_efficiency(8192, 8192, 8192)))
                      + dev.kernel_overhead)
    thin_bytes = (8192 * 8 + 8 * 8192 + 8192 * 8192) * 2.0
    thin = float(gemm_kernel_seconds(2.0 * 8192 * 8192 * 8, 8192, 8192, 8, thin_bytes, dev, dev.peak_flops))
    assert thin >= float(streaming_seconds(thin_bytes, dev)) + dev.kernel_overhead
