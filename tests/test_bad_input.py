"""Bad input to the plan, the CLIs and autoshard gets a clear error naming the field or flag and the fix
(docs/errors.md); knobs that apply to nothing warn."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mistjax
from mistjax.plan import Plan, PlanError, uniform_plan

TX = optax.adamw(1e-2)


@pytest.fixture(scope="module")
def lax_scan(zoo3p):
    fam = zoo3p.lax_scan()
    return fam, zoo3p.optax_state(fam.params, TX), zoo3p.optax_step(fam.loss_fn, TX)


def plan8(**kw) -> Plan:
    return uniform_plan(2, 8, micro_batch=2, **{"shard_opt": True, **kw})


# ---------------------------------------------------------------------------------------------- plans
@pytest.mark.parametrize("field,value,match", [
    ("shard_opt", "false", "stages.0.shard_opt: 'false' must be true or false"),
    ("shard_opt", 1, "stages.0.shard_opt: 1 must be true or false"),  # no coercion: 1 is not true
    ("remat_layers", "2", "stages.0.remat_layers: '2' must be an integer"),
    ("remat_layers", 2.0, "stages.0.remat_layers: 2.0 must be an integer"),
    ("offload_opt", "0.5", "stages.0.offload_opt: '0.5' must be a number"),
    ("layers", [0, 1, 2], r"stages.0.layers: \[0, 1, 2\] must be two integers \[start, end\)"),
])
def test_plan_json_fields_of_the_wrong_type(field, value, match):
    doc = plan8().to_dict()
    doc["stages"][0][field] = value
    with pytest.raises(PlanError, match=match):
        Plan.from_json(json.dumps(doc))


def test_plan_json_lists_every_problem_on_its_own_line():
    """Unknown fields (with the likely spelling), missing ones and wrong types, each with the field's path."""
    doc = plan8(stages=2).to_dict()
    doc["dpp"] = 2
    doc["stages"][1]["shard_weight"] = True
    del doc["stages"][0]["layers"]
    doc["fingerprints"] = {"model": 7}
    with pytest.raises(PlanError) as e:
        Plan.from_json(json.dumps(doc))
    lines = str(e.value).splitlines()
    assert lines[0] == "malformed plan (4 problems):"
    assert sorted(ln.strip().split(":")[0] for ln in lines[1:]) == [
        "dpp", "fingerprints.model", "stages.0.layers", "stages.1.shard_weight"]
    assert "dpp: unknown field (did you mean 'dp'?)" in str(e.value)
    assert "stages.1.shard_weight: unknown field (did you mean 'shard_weights'?); a stage's fields are" in str(e.value)
    assert "stages.0.layers: missing" in str(e.value)


def test_plan_json_keeps_the_plans_own_checks():
    """A well-typed plan that does not hold together gets `Plan.validate`'s message, not a pydantic one."""
    doc = plan8().to_dict()
    doc["shard_group"] = 3
    with pytest.raises(PlanError, match=r"^shard_group=3 must divide dp=8"):
        Plan.from_json(json.dumps(doc))
    doc = plan8().to_dict()
    doc["stages"][0]["offload_acts"] = 1.5
    with pytest.raises(PlanError, match=r"^stage 0: offload_acts=1.5 is outside \[0, 1\]"):
        Plan.from_json(json.dumps(doc))
    with pytest.raises(PlanError, match="a plan must be a JSON object, got list"):
        Plan.from_json("[]")


def test_misspelt_uniform_plan_keyword():
    with pytest.raises(PlanError, match="unknown keyword 'shard_weight' .did you mean 'shard_weights'"):
        uniform_plan(2, 8, shard_weight=True, shard_opt=True)


def test_batch_size_message_says_the_plan_runs_exactly_its_batch(lax_scan):
    fam, state, step_fn = lax_scan
    small = {k: v[:12] for k, v in fam.batch.items()}
    with pytest.raises(PlanError, match="runs exactly 16 sequences per step; pass batches of 16"):
        mistjax.autoshard(step_fn, jax.devices(), plan=plan8()).place(state, small)


# ---------------------------------------------------------------------------------------------- CLIs
@pytest.mark.parametrize("flag,value,match", [
    ("--seq-len", "0", "argument --seq-len: 0 must be a positive integer"),
    ("--global-batch", "0", "argument --global-batch: 0 must be a positive integer"),
    ("--memory-gib", "0", "argument --memory-gib: 0 must be positive"),
    ("--memory-gib", "-1", "argument --memory-gib: -1 must be positive"),
])
def test_mistjax_plan_rejects_non_positive_sizes(flag, value, match, capsys):
    from mistjax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "gpt3-tiny", flag, value])
    assert e.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("kw,match", [
    (dict(global_batch=0), "--global-batch 0: must be a positive integer"),
    (dict(learning_rate=-1.0), "--lr -1.0: the learning rate must be a positive number"),
    (dict(steps=0), "--steps 0: must be a positive integer"),
    (dict(warmup_steps=-2), "--warmup -2: must be a non-negative integer"),
])
def test_train_config_names_the_flag(kw, match):
    from mistjax.train.loop import TrainConfig

    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


def test_pretrain_flags_come_from_the_config_and_offer_plan_auto(tmp_path):
    script = __import__("pathlib").Path(__file__).resolve().parents[1] / "scripts" / "pretrain.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "COLUMNS": "200"})
    assert out.returncode == 0
    for flag in ("--global-batch", "--lr", "--plan", "--ckpt-dir", "--no-progress", "--coordinator"):
        assert flag in out.stdout, flag
    assert '"auto"' in out.stdout
    bad = subprocess.run([sys.executable, str(script), "--global-batch", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0
    assert "--global-batch 0: must be a positive integer" in bad.stdout + bad.stderr


def test_highs_banner_is_silenced():
    code = ("import cvxpy as cp; from mistjax.tuning.milp import _run_solver; x = cp.Variable(2, integer=True); "
            "print(_run_solver(cp.Problem(cp.Minimize(cp.sum(x)), [x >= 1.5]), {'verbose': False}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "optimal", out.stdout
    assert "HiGHS" not in out.stdout


# ---------------------------------------------------------------------------------------------- autoshard
def test_train_step_returning_the_wrong_structure(lax_scan):
    fam, state, step_fn = lax_scan
    with pytest.raises(mistjax.StepError, match=r"must return \(new_state, metrics\), but it returned dict"):
        mistjax.autoshard(lambda s, b: step_fn(s, b)[0], jax.devices(), plan=plan8()).place(state, fam.batch)
    with pytest.raises(mistjax.StepError, match="a state of another structure"):
        mistjax.autoshard(lambda s, b: ({"params": step_fn(s, b)[0]["params"]}, {}), jax.devices(),
                          plan=plan8()).place(state, fam.batch)


def test_float_batch(lax_scan):
    fam, state, step_fn = lax_scan
    floats = {k: v.astype(np.float32) for k, v in fam.batch.items()}
    with pytest.raises(mistjax.StepError, match=r"float32\[16,16\].*token ids must be integers"):
        mistjax.autoshard(step_fn, jax.devices(), plan=plan8()).place(state, floats)


def test_token_ids_outside_the_vocabulary(lax_scan):
    fam, state, step_fn = lax_scan
    bad = {k: v.copy() for k, v in fam.batch.items()}
    bad["inputs"][3, 5] = 64
    with pytest.raises(mistjax.StepError, match=r"batch\['inputs'\] holds token id 64.*64 rows"):
        mistjax.autoshard(step_fn, jax.devices(), plan=plan8()).place(state, bad)


def test_batch_of_another_shape_after_the_plan(lax_scan):
    fam, state, step_fn = lax_scan
    step = mistjax.autoshard(step_fn, jax.devices(), plan=plan8())
    placed = step.place(jax.tree.map(jnp.copy, state), fam.batch)
    with pytest.warns(RuntimeWarning, match="the plan was made .and the step compiled. for"):
        step._ensure(placed, {k: v[:, :8] for k, v in fam.batch.items()})
    with pytest.raises(PlanError, match="pass batches of 16"):
        step._ensure(placed, {k: v[:8] for k, v in fam.batch.items()})


def test_tensor_parallel_plan_on_a_model_with_nothing_to_split():
    params = {"w": jnp.ones((8, 8)) * 0.1}
    state = {"params": params, "opt": TX.init(params)}
    batch = {"x": np.ones((16, 8), np.float32)}

    def step_fn(state, batch):
        loss, g = mistjax.value_and_grad(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2))(state["params"], batch)
        u, opt = TX.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt": opt}, {"loss": loss}

    plan = uniform_plan(1, 8, tp=2, micro_batch=4, shard_opt=True)
    with pytest.raises(PlanError, match="tensor parallelism tp=2, but no weight of this model can be split"):
        mistjax.autoshard(step_fn, jax.devices(), plan=plan).place(state, batch)


def test_knob_that_applies_to_nothing_warns(lax_scan):
    fam, _, _ = lax_scan
    sgd = optax.sgd(0.1)  # no optimizer state: ZeRO-1 has nothing to shard
    state = {"params": fam.params, "opt": sgd.init(fam.params)}

    def step_fn(state, batch):
        loss, g = mistjax.value_and_grad(fam.loss_fn)(state["params"], batch)
        return {"params": jax.tree.map(lambda p, d: p - 0.1 * d, state["params"], g), "opt": state["opt"]}, \
            {"loss": loss}

    step = mistjax.autoshard(step_fn, jax.devices(), plan=plan8(shard_opt=True))
    with pytest.warns(mistjax.NoOpWarning, match="shard_opt .ZeRO-1. applies to nothing"):
        step.place(state, fam.batch)
    assert not step.applied["shard_opt"].applied
    assert "[NO ] shard_opt" in step.summary()


def test_plain_jax_grad_with_per_layer_knobs_warns(lax_scan):
    fam, state, _ = lax_scan

    def step_fn(state, batch):
        loss, g = jax.value_and_grad(fam.loss_fn)(state["params"], batch)
        u, opt = TX.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt": opt}, {"loss": loss}

    plan = plan8(shard_opt=True, shard_grads=True, shard_weights=True)
    with pytest.warns(mistjax.NoOpWarning, match="plain jax.value_and_grad.*GSPMD decides the collectives"):
        mistjax.autoshard(step_fn, jax.devices(), plan=plan).place(state, fam.batch)


# ---------------------------------------------------------------------------------------------- profile cache
def _tiny_loss():
    def loss(params, batch):
        h = params["emb"][batch["inputs"]]
        h, _ = jax.lax.scan(lambda c, w: (c + jnp.tanh(c @ w), None), h, params["layers"])
        return jnp.mean(h ** 2)

    params = {"emb": jax.ShapeDtypeStruct((32, 8), jnp.float32), "layers": jax.ShapeDtypeStruct((2, 8, 8), jnp.float32)}
    return loss, params


def test_profile_cache_round_trip_and_bad_files(tmp_path):
    from mistjax.analysis import analyze_model, compile_profile

    loss, params = _tiny_loss()
    first = analyze_model(loss, params, policies=("none", "full"), cache=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    again = analyze_model(loss, params, policies=("none", "full"), cache=tmp_path)
    assert again == first and again.passes is None  # served from the file
    a, b = compile_profile(first)(2, 16, 2), compile_profile(again)(2, 16, 2)
    assert all(np.allclose(a[k], b[k]) for k in a)
    # the time model's kernel tables come back too (without them it falls back to the FLOP roofline)
    for part in ("pre", "block", "post"):
        mine, read = first.parts[part].kernels, again.parts[part].kernels
        assert mine and set(read) == set(mine)
        for key, k in mine.items():
            r = read[key]
            assert [g.flops.terms for g in r.gemms] == [g.flops.terms for g in k.gemms]
            assert r.fusion_bytes.terms == k.fusion_bytes.terms and r.unit.count.terms == k.unit.count.terms
    for bad in ("{not json", json.dumps({"format": "other", "version": 1}),
                json.dumps({"format": "mistjax.profile", "version": 1, "key": files[0].stem,
                            "profile": {"pre": {"fn": "__import__", "args": []}}})):
        files[0].write_text(bad)
        with pytest.warns(RuntimeWarning, match="ignoring unreadable profile cache file"):
            redone = analyze_model(loss, params, policies=("none", "full"), cache=tmp_path)
        assert redone == first


def test_profile_cache_reads_only_whitelisted_nodes():
    import sympy as sp

    from mistjax.analysis.cache import CacheFormatError, expr_from_json, expr_to_json
    from mistjax.analysis.poly import B, S, T

    e = sp.Piecewise((0, sp.Eq(T, 1)), (sp.Max(B * S / T, 3 * S, evaluate=False) + sp.Rational(1, 3), True))
    assert expr_from_json(json.loads(json.dumps(expr_to_json(e)))) == e
    with pytest.raises(CacheFormatError):
        expr_to_json(sp.sin(B))
    with pytest.raises(CacheFormatError):
        expr_to_json(sp.Symbol("x"))
    with pytest.raises(CacheFormatError):
        expr_from_json({"fn": "eval", "args": [{"int": "1"}]})
    with pytest.raises(CacheFormatError):
        expr_from_json({"sym": "os"})


def test_calibrate_warns_on_a_single_device(monkeypatch, tmp_path, capsys):
    import mistjax.hardware.calibrate as cal
    from mistjax.cli import main
    from mistjax.hardware.presets import ClusterSpec

    monkeypatch.setattr(jax, "devices", lambda *a: [jax.local_devices()[0]])
    monkeypatch.setattr(cal, "calibrate", lambda **kw: ClusterSpec.preset("cpu", nodes=1, per_node=1))
    assert main(["calibrate", "--out", str(tmp_path / "p.json")]) == 0
    assert "only one cpu device is visible" in capsys.readouterr().err


def test_linen_metadata_and_axis_rules(zoo3p):
    """linen's nn.with_logical_partitioning names are read; MaxText-style rules decide what TP splits."""
    from mistjax.core.axes import leaf_axes
    from mistjax.runtime.step import analyze_step

    fam = zoo3p.linen_scan()
    assert ("layers", "embed", "mlp") in leaf_axes(fam.params)
    state, step_fn = zoo3p.optax_state(fam.params, TX), zoo3p.optax_step(fam.loss_fn, TX)
    plan = uniform_plan(2, 8, tp=2, micro_batch=4, shard_opt=False)

    def split(rules):
        a = analyze_step(step_fn, state, fam.batch, rules)
        from mistjax.runtime.leaves import state_layouts

        lays = state_layouts(jax.tree.leaves(state), a.leaves, plan)
        return sorted(lay.shape for lay in lays if lay.role == "param" and lay.tensor_dims)

    assert split(None) == [(2, 32, 64), (2, 64, 32), (64, 32)]  # mlp and vocab, by the model's names
    assert split([("mlp", None), ("vocab", "tensor")]) == [(64, 32)]  # the rules keep mlp whole
    assert split([("mlp", ("tensor",)), ("vocab", None)]) == [(2, 32, 64), (2, 64, 32)]


def test_pipelining_an_unrolled_model_with_the_wrong_layer_count_names_it(zoo3p):
    """An unrolled model pipelines like a scanned one (tests/test_pipeline_unrolled.py); a plan whose stages
    cover another number of layers than the Python loop runs is refused with both counts."""
    fam = zoo3p.nnx_loop()
    state, step_fn = zoo3p.optax_state(fam.params, TX), zoo3p.optax_step(fam.loss_fn, TX)
    plan = uniform_plan(4, 8, stages=2, micro_batch=2, grad_accum=2, shard_opt=True)
    with pytest.raises(PlanError, match=r"4 layers.*2|2.*4 layers"):
        mistjax.autoshard(step_fn, jax.devices(), plan=plan).place(state, fam.batch)


@pytest.mark.parametrize("field,value", [("micro_batches", ()), ("micro_batches", (0,)), ("tp_degrees", ()),
                                         ("zero_levels", ()), ("policies", ()), ("act_offload", ()),
                                         ("schedules", ()), ("min_context_tokens", 0),
                                         ("min_context_tokens", 1.5)])
def test_a_search_space_with_an_empty_dimension_names_it(field, value):
    from mistjax.tuning import SearchSpace

    with pytest.raises(ValueError, match=f"SearchSpace.{field}"):
        SearchSpace(**{field: value})


def test_a_cluster_too_small_for_the_model_says_what_would_fit(capsys):
    from mistjax.cli import main

    code = main(["plan", "--model", "gpt3-22b", "--cluster", "l4:2", "--global-batch", "32", "--seq-len", "2048",
                 "--no-verify", "--time-limit", "30"])
    err = capsys.readouterr().err
    assert code == 2 and "no plan fits" in err and "Use devices with at least" in err and "Traceback" not in err
