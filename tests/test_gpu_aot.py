"""Deviceless XLA:GPU compiles of small plans (`mistjax.validate.gpu_aot`), and the HLO readers they use.

The compile cells need the CUDA plugin (``pip install 'mistjax[gpu-aot]'``, part of the dev extras) and
skip with the reason when it is absent; the reader tests run everywhere.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest

import models
from mistjax.cli import main
from mistjax.core.hlo import async_collectives, collective_bytes, instructions
from mistjax.hardware import ClusterSpec
from mistjax.plan import format_bytes, uniform_plan
from mistjax.validate import gpu_aot
from mistjax.validate.peak import peak_buffers

PROBLEM = gpu_aot.plugin_problem()
needs_plugin = pytest.mark.skipif(PROBLEM is not None, reason=f"deviceless XLA:GPU compile unavailable: {PROBLEM}")
TINY = models.get_config("gpt3-tiny").replace(dtype="bfloat16")

GPU_HLO = """HloModule jit_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (carry: (s32[], bf16[16,16])) -> (s32[], bf16[16,16]) {
  %carry = (s32[], bf16[16,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %acc = bf16[16,16]{1,0} get-tuple-element(%carry), index=1
  ROOT %out = (s32[], bf16[16,16]{1,0}) tuple(%i, %acc)
}

ENTRY %main (p0: bf16[8,16], p1: f32[4,4]) -> f32[2,4] {
  %p0 = bf16[8,16]{1,0} parameter(0), metadata={op_name="state.params[\\'w\\'].value"}
  %p1 = f32[4,4]{1,0} parameter(1), metadata={op_name="batch"}
  %all-gather-start = (bf16[8,16]{1,0}, bf16[16,16]{1,0}) all-gather-start(%p0), channel_id=1, dimensions={0}
  %fusion.1 = f32[4,4]{1,0} fusion(%p1), kind=kLoop, calls=%add, metadata={op_name="jit(step)/mul"}
  %ag = bf16[16,16]{1,0} all-gather-done(%all-gather-start)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[16,16]{1,0}) tuple(%zero, %ag)
  %while.1 = (s32[], bf16[16,16]{1,0}) while(%init), condition=%add, body=%body
  %reduce-scatter-start = ((f32[4,4], bf16[16,16]), (f32[2,4], bf16[8,16])) reduce-scatter-start(%fusion.1, %ag)
  %reduce-scatter-done = (f32[2,4]{1,0}, bf16[8,16]{1,0}) reduce-scatter-done(%reduce-scatter-start)
  ROOT %r = f32[2,4]{1,0} get-tuple-element(%reduce-scatter-done), index=0
}
"""
LIVE = """HloLiveRange (max 9):
  Live ranges at 6 (peak):
    p0{}: 256 bytes (cumulative: 256 bytes)
    carry{1}: 512 bytes (cumulative: 768 bytes)
    fusion.1{}: 64 bytes (cumulative: 832 bytes)
  Stack trace breakdown for peak usage: 832 bytes
"""


def test_gpu_hlo_reader_counts_async_and_combined_collectives():
    # bf16 results count (the dtype regex once skipped "bf16"); a combined reduce-scatter-start's result is
    # its second tuple (f32[2,4] + bf16[8,16] = 32 + 256 bytes), not its second operand.
    assert collective_bytes(GPU_HLO, executed=True) == {"all-gather": 16 * 16 * 2,
                                                        "reduce-scatter": 2 * 4 * 4 + 8 * 16 * 2}
    pairs = {p.op: p for p in async_collectives(GPU_HLO)}
    assert pairs["all-gather"].done and pairs["all-gather"].compute_between == 1  # the fusion overlaps it
    assert pairs["reduce-scatter"].done and pairs["reduce-scatter"].compute_between == 0
    assert pairs["all-gather"].matmuls_between == 0  # a kLoop fusion is no GEMM
    assert instructions(GPU_HLO)["p0"].op_name == "state.params[\\'w\\'].value"


def test_peak_buffers_name_arguments_and_loop_carries():
    bufs = {b.value: b for b in peak_buffers(LIVE, GPU_HLO)}
    assert bufs["p0{}"].kind == "argument" and bufs["p0{}"].op_name == "state.params['w'].value"
    assert bufs["carry{1}"].kind == "loop-carry" and bufs["carry{1}"].shape == "bf16[16,16]"
    assert bufs["fusion.1{}"].kind == "temp" and bufs["fusion.1{}"].op_name == "jit(step)/mul"
    assert [b.nbytes for b in peak_buffers(LIVE, GPU_HLO)] == [512, 256, 64]


def test_targets_cover_the_gpu_presets():
    for preset in gpu_aot.TARGET_SPECS:
        target = gpu_aot.load_target(preset)
        card = ClusterSpec.preset(preset, 1, 2).device.hbm_bytes
        assert 0.9 < target.memory_bytes / card < 1.1, preset  # the spec's memory is the preset's card
        assert gpu_aot.target_for(ClusterSpec.preset(preset, 1, 2)) == target
    with pytest.raises(ValueError, match="l4, a100-40gb"):
        gpu_aot.target_for(ClusterSpec.preset("tpu-v5e", 1, 4))


def test_missing_plugin_is_a_clear_error(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("jax_plugins") else real(name, *a))
    assert "pip install 'mistjax[gpu-aot]'" in gpu_aot.plugin_problem()
    with pytest.raises(gpu_aot.GpuAotUnavailable, match="jax-cuda12-plugin"):
        gpu_aot.compile_only_devices(gpu_aot.load_target("l4"), 1, 2)
    plan = tmp_path / "plan.json"
    uniform_plan(TINY.num_layers, 2, micro_batch=2, shard_opt=True).save(plan)
    args = ["explain", str(plan), "--model", "gpt3-tiny", "--cluster", "l4:1x2", "--global-batch", "4",
            "--seq-len", "32", "--verify"]
    assert main(args) == 2
    assert "mistjax[gpu-aot]" in capsys.readouterr().err


@functools.cache
def _report(cluster: str, **plan_kwargs):
    cl = ClusterSpec.parse(cluster)
    plan = uniform_plan(TINY.num_layers, cl.num_devices, **{"shard_opt": True, **plan_kwargs})
    return gpu_aot.verify_model(TINY, 32, 16, plan, cl)


def test_a_triton_gemm_without_tile_sizes_is_compiled_with_cublas():
    """Deviceless, XLA's Triton GEMM emitter can find no tile sizes for a dot: `compile_plan` compiles again
    with Triton GEMMs off (and says so); any other compile error is raised as it is."""
    calls = []

    class Lowered:
        def __init__(self, error: str):
            self.error = error

        def compile(self, compiler_options=None):
            calls.append(compiler_options)
            if len(calls) == 1:
                raise RuntimeError(self.error)
            return "compiled"

    assert gpu_aot._compile_gemms(Lowered("INTERNAL: Couldn't find output tile sizes for dot"), {}) == \
        ("compiled", True)
    assert calls == [None, {"xla_gpu_enable_triton_gemm": False}]
    calls.clear()
    with pytest.raises(RuntimeError, match="out of memory"):
        gpu_aot._compile_gemms(Lowered("RESOURCE_EXHAUSTED: out of memory"), {"xla_dump_to": "/tmp/x"})
    assert calls == [{"xla_dump_to": "/tmp/x"}]


@needs_plugin
def test_cublas_gemms_are_an_option_xla_gpu_takes():
    """The retry's option is one XLA:GPU's deviceless compile accepts: the GEMMs become cuBLAS calls."""
    from mistjax.runtime.step import ShardedStep

    cl = ClusterSpec.parse("l4:1x2")
    state, batch, step = gpu_aot.zoo_step(TINY, 32, 4)
    devices = gpu_aot.compile_only_devices(gpu_aot.target_for(cl), 1, 2)
    lowered = ShardedStep(step, gpu_aot.device_mesh(devices, 1), uniform_plan(TINY.num_layers, 2, micro_batch=2,
                                                                              shard_opt=True)).lower(
        state, batch)
    text = lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False}).as_text()
    assert "__cublas$" in text and "__triton_gemm" not in text


@needs_plugin
def test_zero3_shards_the_state_over_eight_h100s():
    z0 = _report("h100:1x8", micro_batch=2, shard_opt=False)
    z3 = _report("h100:1x8", micro_batch=2, shard_opt=True, shard_grads=True, shard_weights=True)
    assert z0.device_kind == "NVIDIA H100 80GB HBM3" and z0.num_devices == 8 and z0.fits
    assert 7.0 < z0.memory.argument / z3.memory.argument <= 8.0  # fp32 params + Adam moments split 8 ways
    assert z3.collectives["all-gather"].async_pairs > 0 and z3.collectives["reduce-scatter"].async_pairs > 0
    assert z3.collectives["all-gather"].overlapped > 0  # the per-layer gathers run under compute
    for r in (z0, z3):
        live = sum(b.nbytes for b in r.peak_buffers)
        assert 0.7 * r.peak <= live <= 1.02 * r.peak  # the values XLA lists at its peak add up to memory_analysis
        assert any(b.kind == "argument" and b.op_name.startswith("state.params") for b in r.peak_buffers)
        assert r.flops is None or r.flops > 0


@needs_plugin
def test_a_compile_only_gpu_mesh_defers_the_layer_sync():
    """`runtime.grads.mesh_capabilities` reads the mesh's devices, not ``jax.devices()`` (CPU here): a
    deviceless H100 mesh defers the row sync, as the GPUs' own run would."""
    from mistjax.runtime.grads import mesh_capabilities

    mesh = gpu_aot.device_mesh(gpu_aot.compile_only_devices(gpu_aot.load_target("h100"), 1, 8), 1)
    assert mesh_capabilities(mesh).defers_row_sync


@needs_plugin
@pytest.mark.parametrize("zero", [0, 1])
def test_layer_gradient_sync_overlaps_the_next_layers_backward(zero):
    """G == 1: the backward layer loop issues each layer's all-reduce (ZeRO-0) / reduce-scatter (ZeRO-1)
    one iteration late (`runtime.accumulate.sync_deferred`), so XLA:GPU schedules another layer's
    backward GEMMs between its -start and -done (issued in its own iteration it had none: the loop
    counter's update only)."""
    r = _report("h100:1x8", micro_batch=2, shard_opt=zero >= 1)
    op = "all-reduce" if zero == 0 else "reduce-scatter"
    pairs = [p for p in gpu_aot.loop_collectives(r.hlo_text, TINY.num_layers) if p.op == op]
    assert pairs and all(p.matmuls_between > 0 for p in pairs), pairs


@needs_plugin
def test_tensor_parallel_splits_the_layer_weights_on_two_l4s():
    r = _report("l4:1x2", micro_batch=16, tp=2)
    entry = [i for i in instructions(r.hlo_text).values() if i.opcode == "parameter"
             and i.op_name.replace("\\'", "'").startswith("state.params['layers']['mlp']['wi']")]
    assert entry and f",{TINY.ffn_size // 2}]" in entry[0].type  # [layers, hidden, ffn / 2] per device
    assert any(c.async_pairs for c in r.collectives.values())


@needs_plugin
def test_tensor_parallel_collective_matmuls_on_two_l4s_when_switched_on():
    """With the collective matmul switched on (`Capabilities.collective_matmul`, opt-in) the layers' TP
    collectives run as rings: transfers, each async beside a chunk's GEMM, and the report says so."""
    cl = ClusterSpec.parse("l4:1x2")
    plan = uniform_plan(TINY.num_layers, 2, micro_batch=16, tp=2, shard_opt=True).replace(tp_overlap=True)
    r = gpu_aot.verify_model(TINY, 32, 16, plan, cl)
    rings = r.collectives["collective-permute"]
    assert rings.async_pairs > 0 and rings.overlapped > 0 and rings.in_loops > 0, rings
    assert any("collective matmuls" in n for n in r.notes), r.notes


@needs_plugin
def test_cli_verify_flags_a_plan_that_does_not_fit(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    uniform_plan(TINY.num_layers, 2, micro_batch=2, shard_opt=True).save(plan)
    args = ["explain", str(plan), "--model", "gpt3-tiny", "--cluster", "l4:1x2", "--global-batch", "4",
            "--seq-len", "32", "--memory-gib", "0.001", "--verify"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "XLA:GPU deviceless compile for 2 x NVIDIA L4" in out
    assert "does not fit: XLA:GPU needs" in out and f"of {format_bytes(0.001 * 2**30)}" in out


@needs_plugin
def test_pipelined_plan_compiles_per_stage_for_two_l4s():
    """Each stage's programs compile for its own L4 (the MPMD executor cuts its sub-mesh out of the
    compile-only devices); a stage's peak adds what lives between programs to each program's own memory."""
    from mistjax.plan import Plan, StagePlan
    from mistjax.validate.gpu_aot_pipeline import verify_pipeline

    half = TINY.num_layers // 2
    plan = Plan(stages=(StagePlan(layers=(0, half), shard_opt=True), StagePlan(layers=(half, TINY.num_layers))),
                micro_batch=2, grad_accum=4, dp=1)
    r = verify_pipeline(TINY.replace(param_dtype="bfloat16"), 32, 8, plan, ClusterSpec.parse("l4:1x2"))
    assert r.device_kind == "NVIDIA L4" and r.num_devices == 2
    first, last = r.stages
    assert {p.phase for p in first.programs} >= {"forward", "backward", "finish", "update1"}
    assert "last" in {p.phase for p in last.programs} and last.residual_bytes == 0
    assert first.in_flight == 2 and first.residual_bytes > 0  # 1F1B on 2 stages: two micro-batches' residuals
    fwd = {p.phase: p for p in first.programs}
    assert fwd["forward"].resident_parts["residuals"] == first.residual_bytes  # the other micro-batch's
    assert fwd["forward"].resident_parts["accumulators"] == first.accumulators > 0
    assert fwd["finish"].resident_parts["state"] == first.state  # finish takes no state
    assert fwd["update1"].resident_parts["state"] < first.state
    for st in r.stages:
        assert st.peak == max(p.memory.peak + p.resident for p in st.programs) > st.state
    assert r.to_dict()["peak_per_stage"] == r.peak_per_stage


@needs_plugin
def test_cli_verifies_a_pipelined_plan_per_stage(tmp_path, capsys):
    """`explain --verify` compiles every (stage, phase) program of a pipelined plan (it failed with "a
    pipelined plan runs one program per (stage, phase)"): a row per stage, predicted next to XLA:GPU, and
    the report survives the subprocess's JSON (`report_from_dict`)."""
    from mistjax.plan import Plan, StagePlan

    half = TINY.num_layers // 2
    plan = Plan(stages=(StagePlan(layers=(0, half), shard_opt=True), StagePlan(layers=(half, TINY.num_layers))),
                micro_batch=2, grad_accum=2, dp=1)
    path = tmp_path / "plan.json"
    plan.save(path)
    args = ["explain", str(path), "--model", "gpt3-tiny", "--cluster", "l4:1x2", "--global-batch", "4",
            "--seq-len", "32", "--verify"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "XLA:GPU deviceless compile of 2 pipeline stages' programs for 2 x NVIDIA L4" in out
    rows = [ln for ln in out.splitlines() if ln.strip().startswith(("0 (layers 0-", "1 (layers "))]
    assert len(rows) == 2 and all("backward:" in r or "last:" in r or "update" in r or "finish" in r for r in rows)
    assert "fits: XLA:GPU needs" in out
