"""autoshard on third-party models: Hugging Face Flax Llama / GPT-2, linen nn.scan, NNX loop and nnx.scan, and a
pure lax.scan function, each with a plain optax state; without a plan and with explicit plans whose effect is read
from the placed state and the compiled program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mistjax
from mistjax.core import hlo
from mistjax.plan import uniform_plan

DEVICES, STEPS = 8, 3
FAST = ("lax-scan", "nnx-loop")  # one scanned and one unrolled family in the default suite
SLOW = ("hf-llama", "hf-gpt2", "linen-scan", "nnx-scan")
NAMES = [*FAST, *[pytest.param(n, marks=pytest.mark.slow) for n in SLOW]]
TX = optax.adamw(1e-2)

_REFS: dict[str, list[float]] = {}


def reference(fam, zoo3p) -> list[float]:
    """Losses of 3 steps of the unsharded jax.jit step."""
    if fam.name not in _REFS:
        step, state, out = jax.jit(zoo3p.optax_step(fam.loss_fn, TX)), zoo3p.optax_state(fam.params, TX), []
        for _ in range(STEPS):
            state, m = step(state, fam.batch)
            out.append(float(m["loss"]))
        _REFS[fam.name] = out
    return _REFS[fam.name]


def run(step, fam, zoo3p) -> tuple[list[float], dict]:
    """Losses of 3 steps and, of the placed state (before the steps donate it): per part, (bytes per device,
    total bytes), and the specs of the parameters."""
    state = step.place(zoo3p.optax_state(jax.tree.map(jnp.copy, fam.params), TX), fam.batch)
    placed = {k: (per_device_bytes(state[k]), total_bytes(state[k])) for k in ("params", "opt")}
    placed["specs"] = [str(x.sharding.spec) for x in jax.tree.leaves(state["params"])]
    losses = []
    for _ in range(STEPS):
        state, m = step(state, fam.batch)
        losses.append(float(m["loss"]))
    return losses, placed


def assert_close(losses, ref):
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_autoshard_without_plan_matches_reference(name, family, zoo3p, capsys):
    fam = family(name)
    step = mistjax.autoshard(zoo3p.optax_step(fam.loss_fn, TX), jax.devices(), time_limit=20)
    losses, _ = run(step, fam, zoo3p)
    assert "mistjax.autoshard: tuning a plan for 8 x" in capsys.readouterr().err
    assert_close(losses, reference(fam, zoo3p))
    assert step.plan.prediction is not None
    # a Python loop of layers pipelines too (issue #29): a pipelined plan runs on the MPMD executor
    assert step.plan.num_stages == 1 or step._inner._mpmd is not None
    assert "Applied" in step.summary()


PLANS = {
    "zero1": dict(shard_opt=True),
    "zero3": dict(shard_opt=True, shard_grads=True, shard_weights=True),
    "tp2": dict(shard_opt=False, tp=2),
    "remat": dict(shard_opt=False, remat_layers=2),
}


def plan_for(knob: str):
    kw = dict(PLANS[knob])
    tp = kw.pop("tp", 1)
    return uniform_plan(2, DEVICES, tp=tp, micro_batch=16 // (DEVICES // tp), **kw)


def per_device_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def total_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


# Explicit plans on scanned models are covered for the zoo by test_runtime.py: the default suite runs them on the
# unrolled NNX loop (the new layer loop), every family under -m slow.
EXPLICIT = ["nnx-loop", *[pytest.param(n, marks=pytest.mark.slow) for n in ("lax-scan", *SLOW)]]


@pytest.mark.parametrize("knob", list(PLANS))
@pytest.mark.parametrize("name", EXPLICIT)
def test_explicit_plan_applies(name, knob, family, zoo3p):
    fam = family(name)
    train_step = zoo3p.optax_step(fam.loss_fn, TX)
    step = mistjax.autoshard(train_step, jax.devices(), plan=plan_for(knob))
    losses, placed = run(step, fam, zoo3p)
    assert_close(losses, reference(fam, zoo3p))
    assert step.applied[knob_field(knob)].applied, step.report()
    state = zoo3p.optax_state(fam.params, TX)
    text = step.lower(state, fam.batch).compile().as_text()
    colls = hlo.collectives(text)
    if knob == "zero1":
        # Every optimizer state mirrors its parameter: ZeRO-1 keeps 1/8 of it per device (the step count whole).
        assert placed["opt"][0] <= placed["opt"][1] / DEVICES + 64
        assert placed["params"][0] == placed["params"][1]
        assert any(c.op == "reduce-scatter" for c in colls)
    elif knob == "zero3":
        assert placed["params"][0] <= placed["params"][1] / DEVICES * 1.05
        assert placed["opt"][0] <= placed["opt"][1] / DEVICES + 64
        gathers = [c for c in colls if c.op == "all-gather" and c.group_size == DEVICES]
        layer_leaves = sum(1 for lay in step.layouts if lay.role == "param" and (lay.stacked or lay.layer_slice))
        # Per-layer weight gathers: inside the layer loop, or one per layer leaf of an unrolled stack.
        assert any(not c.computation.startswith("main") for c in gathers) or len(gathers) >= layer_leaves
    elif knob == "tp2":
        assert any("tensor" in spec for spec in placed["specs"]), "no weight is split over the tensor axis"
        assert any(c.group_size == 2 for c in colls), "no collective over the tensor group"
    else:  # remat: the backward recomputes the checkpointed layers' matmuls
        plain = mistjax.autoshard(train_step, jax.devices(), plan=uniform_plan(2, DEVICES, micro_batch=2,
                                                                               shard_opt=False))
        n_remat = step.lower(state, fam.batch).as_text().count("dot_general")
        n_plain = plain.lower(state, fam.batch).as_text().count("dot_general")
        assert n_remat > n_plain


def knob_field(knob: str) -> str:
    return {"zero1": "shard_opt", "zero3": "shard_weights", "tp2": "tp", "remat": "remat_layers"}[knob]


def test_unrolled_stack_is_found_in_every_loop_model(family):
    from mistjax.trace.split import trace_loss

    for name, layers in (("nnx-loop", 2), ("linen-loop", 3)):  # nnx.List [0], [1]; linen Block_0 .. Block_2
        fam = family(name)
        traced = trace_loss(fam.loss_fn, fam.params, fam.batch)
        assert traced.groups is not None and traced.stack.num_layers == layers
        # The virtual jaxpr computes the same loss as the model's own unrolled loop.
        from mistjax.trace.split import evaluate

        loss = evaluate(traced, jax.tree.leaves(fam.params), jax.tree.leaves(fam.batch))[0]
        np.testing.assert_allclose(float(loss), float(fam.loss_fn(fam.params, fam.batch)), rtol=1e-6)


def test_nnx_optimizer_step_through_mistjax_nnx(zoo3p):
    """A step written with nnx.Optimizer and nnx.jit, made pure by mistjax.nnx.functional, matches the
    stateful NNX loop and runs ZeRO-3 with remat."""
    from flax import nnx

    batch = zoo3p.token_batch()
    ts, model, opt = zoo3p.nnx_optimizer_step(zoo3p.NnxLoopLM(nnx.Rngs(0)))
    ref = [float(ts(model, opt, batch)["loss"]) for _ in range(STEPS)]
    ts, model, opt = zoo3p.nnx_optimizer_step(zoo3p.NnxLoopLM(nnx.Rngs(0)))
    step, state = mistjax.nnx.functional(ts, model, opt)
    plan = uniform_plan(2, DEVICES, micro_batch=2, shard_opt=True, shard_grads=True, shard_weights=True,
                        remat_layers=1)
    sharded = mistjax.autoshard(step, jax.devices(), plan=plan)
    state = sharded.place(state, batch)
    losses = []
    for _ in range(STEPS):
        state, m = sharded(state, batch)
        losses.append(float(m["loss"]))
    assert_close(losses, ref)
    assert sharded.applied["shard_opt"].applied and sharded.applied["shard_weights"].applied
    nnx.update((model, opt), state)  # the state goes back into the NNX objects
    assert int(opt.step[...]) == STEPS


@pytest.mark.parametrize("tx", [
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    optax.multi_transform({"adam": optax.adam(1e-3), "sgd": optax.sgd(1e-2, momentum=0.9)},
                          {"embed": "sgd", "layers": "adam", "head": "adam"}),
    optax.masked(optax.adamw(1e-3), {"embed": False, "layers": True, "head": True}),
], ids=["chain", "multi_transform", "masked"])
def test_optimizer_state_of_any_structure_mirrors_its_parameters(tx, zoo3p):
    from mistjax.runtime.step import analyze_step

    fam = zoo3p.lax_scan()
    state = zoo3p.optax_state(fam.params, tx)
    a = analyze_step(zoo3p.optax_step(fam.loss_fn, tx), state, fam.batch)
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    per_param = [i for i, (p, x) in enumerate(flat) if p[0].key == "opt" and np.size(x) > 1]
    mirrors = a.leaves.mirrors
    assert sorted(mirrors) == per_param  # every per-parameter optimizer leaf, nothing else
    for i, m in mirrors.items():
        assert flat[m.param][0][0].key == "params" and flat[i][1].shape == flat[m.param][1].shape
        assert a.roles[i] == "opt"


def test_tp_is_offered_only_where_something_splits(zoo3p):
    from mistjax.cost.workload import Workload

    pairs, none = zoo3p.lax_scan(), zoo3p.no_pairs()
    w = Workload.from_loss(pairs.loss_fn, pairs.params, seq_len=16, global_batch=16)
    assert w.supports_tp(2) and not w.supports_tp(3)
    assert not Workload.from_loss(none.loss_fn, none.params, seq_len=16, global_batch=16).supports_tp(2)


def test_a_users_state_checkpoints_under_one_plan_and_restores_under_another(family, zoo3p, tmp_path):
    """`mistjax.Checkpointer` on a user's own ``{"params", "opt"}`` state: saved under ZeRO-3, restored under
    TP 2 + ZeRO-1 with every gathered leaf bit-identical, and the next step's loss equal to continuing
    under ZeRO-3."""
    fam = family("nnx-loop")
    train_step = zoo3p.optax_step(fam.loss_fn, TX)
    zero3, tp2 = (mistjax.autoshard(train_step, jax.devices(), plan=plan_for(k)) for k in ("zero3", "tp2"))
    fresh = lambda: zoo3p.optax_state(jax.tree.map(jnp.copy, fam.params), TX)  # noqa: E731
    state, _ = zero3(zero3.place(fresh(), fam.batch), fam.batch)
    ckpt = mistjax.Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(1, state, {"data_position": 1})
    saved = jax.device_get(state)
    cont = float(zero3(state, fam.batch)[1]["loss"])
    ckpt.close()

    restored, meta = mistjax.Checkpointer(tmp_path / "ckpt").restore_latest(tp2.place(fresh(), fam.batch))
    assert meta["data_position"] == 1 and meta["leaves"]
    assert any("tensor" in str(x.sharding.spec) for x in jax.tree.leaves(restored["params"]))
    for want, got in zip(jax.tree.leaves(saved), jax.tree.leaves(tp2.gather(restored))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(float(tp2(restored, fam.batch)[1]["loss"]), cont, rtol=1e-6)
