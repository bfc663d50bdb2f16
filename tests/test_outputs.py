"""Outputs that never mislead (#55): explain prices the plan's own shape, knobs that apply to nothing say so,
defaults are stated, unverified plans say so, messages state what they counted, MFU and host memory shown."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

import mistjax
from mistjax.cli import main
from mistjax.plan import uniform_plan

TX = optax.adam(1e-2)
TINY_MODEL = ["--model", "gpt3-tiny", "--cluster", "cpu:1x8", "--dtype", "float32"]


def _plan_file(tmp_path, **fingerprints):
    """A 4-layer ZeRO-1 plan over 8 devices, global batch 16, recording ``fingerprints``."""
    path = tmp_path / "plan.json"
    uniform_plan(4, 8, micro_batch=2, shard_opt=True).replace(fingerprints=fingerprints).save(path)
    return path


def test_explain_uses_the_plans_recorded_shape(tmp_path, capsys):
    """Without --seq-len, explain prices the plan at the sequence length it was tuned for, not 2048."""
    plan = _plan_file(tmp_path, batch="16x48")
    assert main(["explain", str(plan), *TINY_MODEL]) == 0
    out = capsys.readouterr().out
    assert "priced at global batch 16 x sequence 48 (the plan's)" in out
    # 2048 would exceed gpt3-tiny's max_seq_len of 64 and fail: the plan's 48 is what was priced
    assert "step" in out


def test_explain_refuses_another_seq_len(tmp_path, capsys):
    plan = _plan_file(tmp_path, batch="16x48")
    assert main(["explain", str(plan), *TINY_MODEL, "--seq-len", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seq-len 32 differs from the 48 tokens the plan was tuned for" in err
    assert "omit --seq-len" in err
    assert main(["explain", str(plan), *TINY_MODEL, "--seq-len", "48"]) == 0  # the same length is fine


def test_explain_says_when_it_falls_back_to_the_default_length(tmp_path, capsys):
    """A hand-written plan records no shape: an explicit --seq-len is used; without it the default is named."""
    plan = _plan_file(tmp_path)
    assert main(["explain", str(plan), *TINY_MODEL, "--seq-len", "32"]) == 0
    assert "priced at global batch 16 x sequence 32 (--seq-len)" in capsys.readouterr().out
    assert main(["explain", str(plan), *TINY_MODEL]) == 2  # 2048 > max_seq_len: the default was really used
    captured = capsys.readouterr()
    assert "the default: the plan records none; pass --seq-len" in captured.out
    assert "--seq-len 2048 exceeds" in captured.err


def test_explain_refuses_another_global_batch(tmp_path, capsys):
    plan = _plan_file(tmp_path, batch="16x48")
    assert main(["explain", str(plan), *TINY_MODEL, "--global-batch", "32"]) == 2
    assert "global batch 32 != micro_batch 2" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- no-op knobs
L, D, F, B = 4, 16, 32, 8


def _scan_model(tag: bool):
    """A 4-layer MLP stack under lax.scan; with ``tag`` its hidden activation is named ``mlp_in``."""
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w_in": jax.random.normal(k[0], (L, D, F)) / 4, "w_out": jax.random.normal(k[1], (L, F, D)) / 6}

    def loss_fn(params, batch):
        def layer(h, w):
            a = h @ w["w_in"]
            a = checkpoint_name(a, "mlp_in") if tag else a
            return h + jnp.tanh(a) @ w["w_out"], None

        h, _ = jax.lax.scan(layer, batch["x"], params)
        return jnp.mean(h**2)

    def step_fn(state, batch):
        loss, g = mistjax.value_and_grad(loss_fn)(state["params"], batch)
        u, opt = TX.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt": opt}, {"loss": loss}

    state = {"params": params, "opt": TX.init(params)}
    batch = {"x": jax.random.normal(k[2], (B, D))}
    return step_fn, state, batch


def _run(step_fn, state, batch, plan, devices):
    """The autosharded step's loss and its report, with the NoOpWarnings raised while placing it."""
    ref = jax.jit(step_fn)(state, batch)[1]["loss"]  # first: the sharded step donates the state
    step = mistjax.autoshard(step_fn, devices, plan=plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, metrics = step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref), rtol=1e-5)
    return step, [str(w.message) for w in caught if issubclass(w.category, mistjax.NoOpWarning)]


def test_a_names_policy_that_matches_no_tag_warns_and_says_it_acts_as_full():
    step_fn, state, batch = _scan_model(tag=False)
    plan = uniform_plan(L, 8, micro_batch=1, remat_layers=L, remat_policy="names:mlp_in")
    step, noops = _run(step_fn, state, batch, plan, jax.devices())
    assert any(n.startswith("remat_policy applies to nothing in this step: mlp_in match no checkpoint_name tag")
               for n in noops), noops
    report = step.summary()
    assert "[NO ] remat_policy: mlp_in match no checkpoint_name tag of the layer (its tags: none)" in report
    assert "4 of 4 layers checkpointed (names:mlp_in; no name matches a tag: acts as full)" in report


def test_a_names_policy_that_matches_a_tag_applies():
    step_fn, state, batch = _scan_model(tag=True)
    plan = uniform_plan(L, 8, micro_batch=1, remat_layers=L, remat_policy="names:mlp_in,mlp_out")
    step, noops = _run(step_fn, state, batch, plan, jax.devices())
    assert noops == ["remat_policy: saves the activations tagged mlp_in in the 4 checkpointed layer(s); mlp_out tag "
                     "nothing (the layer's checkpoint_name tags: mlp_in)"]
    assert step.applied["remat_policy"].applied and "acts as full" not in step.summary()


def test_zero_at_dp_1_warns_and_claims_no_sharding():
    step_fn, state, batch = _scan_model(tag=False)
    plan = uniform_plan(L, 1, micro_batch=B, shard_opt=True, shard_grads=True, shard_weights=True)
    step, noops = _run(step_fn, state, batch, plan, jax.devices()[:1])
    assert noops == ["ZeRO-3 (shard_weights, shard_grads, shard_opt) applies to nothing in this step: nothing "
                     "sharded: the partition group is 1 device (dp 1, MiCS group 1), so every device holds the "
                     "whole state; set them False, or use dp > 1 to shard"]
    summary = step.summary()
    assert "[yes] shard" not in summary and "[NO ] shard_weights (ZeRO-3): nothing sharded" in summary
    assert "the stages' ZeRO-3 flags shard nothing: the partition group is 1 device (dp 1)" in summary


def test_zero_1_at_dp_1_is_reported_without_a_warning():
    """ZeRO-1 is StagePlan's default and what the tuner records at dp 1: the report says it shards nothing."""
    step_fn, state, batch = _scan_model(tag=False)
    step, noops = _run(step_fn, state, batch, uniform_plan(L, 1, micro_batch=B, shard_opt=True), jax.devices()[:1])
    assert noops == [] and "[NO ] shard_opt (ZeRO-1): nothing sharded" in step.summary()


# ---------------------------------------------------------------------------------------------- defaults
def test_uniform_plan_turns_nothing_on_unasked():
    plan = uniform_plan(4, 8)
    assert [s.zero_stage for s in plan.stages] == [0]
    assert (plan.dp, plan.tp, plan.cp, plan.micro_batch, plan.grad_accum, plan.num_stages) == (8, 1, 1, 1, 1, 1)
    stage = plan.stages[0]
    assert stage.remat_layers == 0 and all(getattr(stage, f) == 0 for f in mistjax.plan.OFFLOAD_FIELDS)
    assert uniform_plan(4, 8, shard_opt=True).stages[0].zero_stage == 1
    assert uniform_plan(4, 8, shard_opt=True, shard_grads=True, shard_weights=True).stages[0].zero_stage == 3
    assert "no ZeRO" in uniform_plan.__doc__ and "shard_opt=True" in uniform_plan.__doc__


# ---------------------------------------------------------------------------------------------- unverified plans
def test_plan_on_a_preset_without_a_gpu_target_says_it_is_not_verified(tmp_path, capsys):
    """dgx-h100 has no XLA:GPU target spec: the output and the plan's JSON say the plan was not verified."""
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt3-tiny", "--cluster", "dgx-h100:1x8", "--global-batch", "16", "--seq-len",
                 "32", "--time-limit", "10", "--no-baselines", "--json", str(path)]) == 0
    want = ("not verified by XLA:GPU (no target spec for cluster 'dgx-h100'); memory margin 0.0% of the non-state "
            "memory applied")
    assert capsys.readouterr().out.count(want) == 2  # before the search and with the plan
    assert mistjax.plan.Plan.load(path).fingerprints["verification"] == want


def test_no_verify_says_so(tmp_path, capsys):
    assert main(["plan", "--model", "gpt3-tiny", "--cluster", "cpu:1x8", "--global-batch", "16", "--seq-len", "32",
                 "--time-limit", "10", "--no-baselines", "--no-verify"]) == 0
    assert "not verified by XLA:GPU (--no-verify); no memory margin applied (the preset has none)" in \
        capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- what is counted
def test_the_smallest_plan_message_states_what_it_counted(capsys):
    """GPT-3 22B on one L4 (#55): the figure is device bytes after offload, its parts add up to it, and the
    offloaded host bytes (the whole model state, hundreds of GiB) are given apart."""
    assert main(["plan", "--model", "gpt3-22b", "--cluster", "l4:1x1", "--global-batch", "32", "--seq-len", "2048",
                 "--no-verify", "--time-limit", "10", "--no-baselines"]) == 2
    err = capsys.readouterr().err
    need = float(re.search(r"the smallest plan needs ([\d.]+) GiB of device memory per device", err)[1])
    parts = re.search(r"counted on the device after offload: ([\d.]+) GiB parameters, ([\d.]+) GiB gradients, "
                      r"([\d.]+) GiB optimizer state, ([\d.]+) GiB activations, ([\d.]+) GiB buffers", err)
    assert parts and abs(sum(float(x) for x in parts.groups()) - need) <= 0.011
    host = float(re.search(r"; ([\d.]+) GiB more offloaded to host memory\)", err)[1])
    assert float(parts[3]) < 1.0 < 200 < host  # the optimizer state is on the host, not counted in the figure


# ---------------------------------------------------------------------------------------------- MFU and host memory
def test_explain_shows_mfu_with_its_formula_and_host_memory(tmp_path, capsys):
    """GPT-3 7B, ZeRO-3 over 8 A100s with the optimizer state on the host: the MFU printed is PaLM's formula on
    the config's numbers at the predicted tokens/s, and the host memory is the offloaded Adam state's share."""
    import models

    path = tmp_path / "plan.json"
    uniform_plan(32, 8, micro_batch=2, grad_accum=4, shard_opt=True, shard_grads=True, shard_weights=True,
                 remat_layers=32, offload_opt=1.0).replace(fingerprints={"batch": "64x2048"}).save(path)
    assert main(["explain", str(path), "--model", "gpt3-7b", "--cluster", "a100-40gb:1x8"]) == 0
    out = capsys.readouterr().out
    line = re.search(r"MFU ([\d.]+)% predicted = model FLOPs x tokens/s / \(devices x peak\): 6·N \+ 12·L·H·Q·T per "
                     r"token \(PaLM's model FLOPs; N 6.87B, L 32, H 32, Q 128, T 2048; remat not counted\), "
                     r"([\d,]+) tokens/s, 8 x 312 TFLOP/s", out)
    cfg = models.get_config("gpt3-7b")
    per_token = 6 * cfg.num_params() + 12 * 32 * 32 * 128 * 2048
    want = per_token * float(line[2].replace(",", "")) / (8 * 312e12)
    assert float(line[1]) == pytest.approx(100 * want, abs=0.06)
    host = re.search(r"host memory per device: ([\d.]+) GiB", out)
    adam = 2 * 4 * cfg.num_params() / 8 / 2**30  # two fp32 moments, sharded 8 ways
    assert adam <= float(host[1]) < 1.3 * adam


def test_summary_shows_host_memory_per_device():
    """Adam's two moments offloaded under ZeRO-1 over 8 devices: each device keeps 1/8 of them on the host."""
    step_fn, state, batch = _scan_model(tag=False)
    plan = uniform_plan(L, 8, micro_batch=1, shard_opt=True, offload_opt=1.0)
    step, noops = _run(step_fn, state, batch, plan, jax.devices())
    moments = 2 * 4 * (L * D * F * 2) / 8  # fp32 mu and nu of both weights, sharded 8 ways
    assert noops == [] and moments <= step.applied.host_bytes <= moments + 64  # + Adam's step counts
    assert f"host memory per device: {mistjax.plan.format_bytes(step.applied.host_bytes)} of offloaded state" in \
        step.summary()


def test_autoshard_summary_shows_the_predicted_mfu_and_its_formula(zoo3p):
    fam = zoo3p.lax_scan()
    state, batch = zoo3p.optax_state(fam.params, TX), fam.batch
    step = mistjax.autoshard(zoo3p.optax_step(fam.loss_fn, TX), jax.devices(), time_limit=10, baselines=())
    step(state, batch)
    line = re.search(r"MFU ([\d.]+)% predicted = model FLOPs x tokens/s / \(devices x peak\): 6·N per token "
                     r"\(N ([\d.]+K); attention FLOPs not counted: its shape is unknown\), ([\d,]+) tokens/s, 8 x",
                     step.summary())
    n = sum(x.size for x in jax.tree.leaves(fam.params))
    assert line and line[2] == f"{n / 1e3:.3g}K"
    assert float(line[3].replace(",", "")) == pytest.approx(step.plan.prediction.tokens_per_s, rel=1e-3)


# ---------------------------------------------------------------------------------------------- presets
def test_presets_lists_every_preset_with_its_numbers_and_source(capsys):
    from mistjax.hardware.presets import PRESET_NAMES, ClusterSpec

    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line and line.split()[0] in PRESET_NAMES}
    assert set(rows) == set(PRESET_NAMES)
    h100 = ClusterSpec.preset("h100")
    assert rows["h100"].split()[-1] == "yes" and rows["dgx-h100"].split()[-1] == "no"  # the XLA:GPU target spec
    assert f"{h100.device.peak_flops / 1e12:.4g} TFLOP/s" in rows["h100"] and "80 GiB" in rows["h100"]
    assert f"{h100.p2p_inter.bandwidth / 1e9:.4g} GB/s" in rows["h100"]
    for name in PRESET_NAMES:
        assert f"\n  {name}: " in out  # its source
    assert main(["presets", "--full"]) == 0
    assert ClusterSpec.preset("dgx-h100").source in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- long context
def _context_note(out: str) -> tuple[list[float], list[str], float]:
    note = next(line for line in out.splitlines() if "context note:" in line)
    times = [float(t) for t in re.findall(r": ([\d.]+) s/step, host memory per device", note)]
    hosts = re.findall(r"host memory per device ([\d.]+ \w+)", note)
    wins = float(re.search(r"wins by ([\d.]+)% of step time", note)[1])
    return times, hosts, wins


def test_long_context_plans_are_compared_with_the_other_cp_choice(monkeypatch, capsys):
    """From LONG_CONTEXT tokens, plan shows the best plan of the other context-parallel choice beside its own:
    both step times and host memory per device, and by how much the chosen one wins (lowered here to 2048
    tokens so that a 1.3B model at 4096 tokens is a fast stand-in for a 131k-token cell)."""
    import mistjax.cli as cli

    monkeypatch.setattr(cli, "LONG_CONTEXT", 2048)
    assert main(["plan", "--model", "llama-1.3b", "--cluster", "a100-40gb:1x8", "--seq-len", "4096",
                 "--global-batch", "8", "--no-baselines", "--no-verify", "--time-limit", "20"]) == 0
    out = capsys.readouterr().out
    times, hosts, wins = _context_note(out)
    assert len(times) == 2 and len(hosts) == 2 and times[0] <= times[1]  # the tuned plan is the faster one
    assert wins == pytest.approx(100 * (times[1] / times[0] - 1), abs=0.1)
    assert ("against the best plan with context parallelism (1 stage(s) x dp 4 x cp 2" in out) != \
        ("against the best plan without context parallelism" in out)


@pytest.mark.slow
def test_the_131k_cell_on_32_h100s_explains_its_context_choice(tmp_path, capsys):
    """#55 item 5's cell: Llama-3.1-8B at 131,072 tokens on dgx-h100:4x8; both plans' time and host memory."""
    import json

    from test_hf_config import LLAMA31_8B

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA31_8B))
    assert main(["plan", "--model", str(config), "--cluster", "dgx-h100:4x8", "--seq-len", "131072",
                 "--global-batch", "32", "--no-baselines", "--time-limit", "60"]) == 0
    times, hosts, wins = _context_note(capsys.readouterr().out)
    assert len(times) == 2 and times[0] <= times[1] and all(h.endswith("GiB") for h in hosts)
