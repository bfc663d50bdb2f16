"""The memory check before the first step (`mistjax.runtime.fit`) and autoshard's re-tuning on a misfit.

CPU devices report no memory limit, so the check is skipped there; the tests give the 8 simulated devices a
capacity by replacing `fit.device_capacity` (and `fit.device_in_use` where other buffers matter).
"""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mistjax
import models
from mistjax.core.plan import PlanDoesNotFit
from mistjax.plan import Plan, StagePlan, uniform_plan
from mistjax.runtime import fit
from mistjax.runtime.mpmd_memory import program_peak
from mistjax.train.state import TrainState
from models import make_loss_fn

MiB = 2**20


@functools.cache
def setup(name: str = "llama-tiny"):
    cfg = models.get_config(name)
    state = TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), optax.adamw(3e-4))
    loss_fn = make_loss_fn(state.graphdef)

    def train_step(state, batch):
        loss, grads = mistjax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (16, 33), dtype=np.int32)
    return cfg, state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, train_step


def fresh(state):
    return jax.tree.map(jnp.copy, state)  # steps donate the state they run on


def capacity(monkeypatch, limit) -> None:
    """Give every device (or, with a function, each device) a memory limit."""
    monkeypatch.setattr(fit, "device_capacity", limit if callable(limit) else lambda d: limit)


def two_stages(cfg) -> Plan:
    half = cfg.num_layers // 2
    return Plan(stages=(StagePlan(layers=(0, half), remat_layers=1), StagePlan(layers=(half, cfg.num_layers))),
                micro_batch=2, grad_accum=2, dp=4)


def test_without_a_memory_limit_nothing_is_checked():
    cfg, state, batch, train_step = setup()
    assert fit.capacities(jax.devices()) == {}  # CPU: memory_stats() has no bytes_limit
    step = mistjax.autoshard(train_step, jax.devices(), plan=uniform_plan(cfg.num_layers, 8, micro_batch=2,
                                                                          shard_opt=True))
    _, metrics = step(fresh(state), batch)
    assert math.isfinite(float(metrics["loss"]))
    assert step.fit is not None and not step.fit.checked and "memory check" not in step.summary()


def test_single_stage_misfit_names_the_stage_and_knobs(monkeypatch):
    cfg, state, batch, train_step = setup()
    plan = uniform_plan(cfg.num_layers, 8, micro_batch=2, shard_opt=True)
    step = mistjax.autoshard(train_step, jax.devices(), plan=plan)
    capacity(monkeypatch, MiB)
    with pytest.raises(PlanDoesNotFit, match=r"stage 0 \(the whole step, layers 0-4\) needs .* MiB per device") as e:
        step(fresh(state), batch)
    msg = str(e.value)
    assert "1 MiB limit" in msg and f"raise remat_layers (now 0 of {cfg.num_layers})" in msg
    assert "shard_grads=True (ZeRO-2)" in msg and "smaller micro_batch (now 2" in msg
    assert isinstance(e.value, mistjax.PlanError) and e.value.stage == 0 and e.value.gap > 0
    # Nothing ran: with room, the same step runs, and its peak is the one the check measured.
    capacity(monkeypatch, 2**40)
    new_state, metrics = step(fresh(state), batch)
    assert math.isfinite(float(metrics["loss"])) and step.fit.checked and step.fit.worst.fits
    assert step.fit.worst.need == e.value.need
    assert "memory check before the first step: stage 0 (step) needs" in step.summary()


def test_bytes_in_use_count_once(monkeypatch):
    """What the placed state and batch hold is in bytes_in_use and in the program's arguments: counted once."""
    cfg, state, batch, train_step = setup()
    step = mistjax.autoshard(train_step, jax.devices(), plan=uniform_plan(cfg.num_layers, 8, micro_batch=2,
                                                                          shard_opt=True))
    limit, in_use = 2**40, 2**40 - MiB
    capacity(monkeypatch, limit)
    monkeypatch.setattr(fit, "device_in_use", lambda d: in_use)
    with pytest.raises(PlanDoesNotFit, match="held by other buffers") as e:
        step(fresh(state), batch)
    worst = e.value.report.worst
    args = step.lower(state, batch).compile().memory_analysis().argument_size_in_bytes
    assert in_use - worst.other == args  # resident: the placed state and batch shards on the device
    assert e.value.available == limit - worst.other and "free the" in str(e.value)


def test_pipelined_misfit_names_the_stage(monkeypatch):
    cfg, state, batch, train_step = setup()
    step = mistjax.autoshard(train_step, jax.devices(), plan=two_stages(cfg))
    capacity(monkeypatch, lambda d: MiB if d.id >= 4 else 2**40)  # stage 1 runs on devices 4-7
    with pytest.raises(PlanDoesNotFit, match=r"stage 1 \(layers 2-4, its last program\) needs") as e:
        step(fresh(state), batch)
    assert "raise remat_layers on stage 1 (now 0 of 2)" in str(e.value) and e.value.stage == 1
    fits = {s.stage: s for s in e.value.report.stages}
    assert fits[0].fits and not fits[1].fits and fits[1].device.id >= 4
    # A stage's need is at least each of its programs' own peak (plus what lives beside them).
    compiled = step.compile_stages(state, batch)
    assert fits[0].need >= max(program_peak(c) for (k, _), c in compiled.items() if k == 0)
    capacity(monkeypatch, 2**40)
    _, metrics = step(fresh(state), batch)
    assert math.isfinite(float(metrics["loss"])) and all(s.fits for s in step.fit.stages)


def test_knob_hints_follow_the_plan():
    plan = Plan(stages=(StagePlan(layers=(0, 3), remat_layers=3, remat_policy="dots", shard_grads=True),
                        StagePlan(layers=(3, 4), shard_weights=True, shard_grads=True, offload_opt=1.0)),
                micro_batch=1, grad_accum=4, dp=4)
    first, last = fit.knob_hints(plan, 0), fit.knob_hints(plan, 1)
    assert first == ["remat_policy='full' on stage 0 (now 'dots')", "shard_weights=True on stage 0 (ZeRO-3)",
                     "offload the optimizer state on stage 0 (offload_opt, now 0)", "fewer layers on stage 0 (now 3)"]
    assert last == ["raise remat_layers on stage 1 (now 0 of 1)"]


def test_autoshard_retunes_until_the_plan_fits(monkeypatch, tmp_path):
    cfg, state, batch, train_step = setup()
    options = dict(hardware="cpu", cache_dir=tmp_path, baselines=(), time_limit=10, verbose=False)
    capacity(monkeypatch, 2**40)
    first = mistjax.autoshard(train_step, jax.devices(), **options)
    first.place(fresh(state), batch)
    default_peak = first.fit.worst.need
    assert not first.retunes and len(list(tmp_path.glob("plan-*.json"))) == 1  # a plan that fits is cached
    # Between the smallest plan's peak and the tuned one's: the cached plan does not fit, autoshard re-tunes.
    limit = int(0.65 * default_peak)
    capacity(monkeypatch, limit)
    step = mistjax.autoshard(train_step, jax.devices(), **options)
    with pytest.warns(RuntimeWarning, match="does not fit: stage 0 needs"):
        _, metrics = step(fresh(state), batch)
    assert step.cache_hit and 1 <= len(step.retunes) <= 3
    assert math.isfinite(float(metrics["loss"])) and step.fit.worst.need <= limit < default_peak
    assert "re-tuned" in step.summary() and "memory check before the first step" in step.summary()
    # Only the plan that fits is cached: the next run reads it and needs no re-tune.
    (path,) = tmp_path.glob("plan-*.json")
    assert Plan.from_dict(json.loads(path.read_text())["plan"]).to_json() == step.plan.to_json()
    again = mistjax.autoshard(train_step, jax.devices(), **options)
    again.place(fresh(state), batch)
    assert again.cache_hit and not again.retunes and again.fit.worst.fits


def test_autoshard_says_when_no_plan_fits(monkeypatch):
    cfg, state, batch, train_step = setup()
    capacity(monkeypatch, 64 * 1024)  # less than the state alone
    step = mistjax.autoshard(train_step, jax.devices(), hardware="cpu", baselines=(), time_limit=10, verbose=False)
    with pytest.raises(PlanDoesNotFit, match="autoshard tuned this plan and re-tuned 0 time") as e:
        step(fresh(state), batch)
    assert "64 KiB limit" in str(e.value) and not step.retunes
