"""What a pipelined plan's knobs did, stage by stage (issue #30), and the step surface `autoshard` returns.

`step.report()` of a pipelined plan lists every stage's knobs with numbers read from what was placed: the
test counts the same things on the placed `StagedArray` pieces (their shardings and memory kinds) and on
the stage's gradient accumulators. A knob that applies to nothing on one stage warns `NoOpWarning` naming
that stage. The step object has the documented methods (docs/guide.md) for one-stage and pipelined plans,
with a given plan (`ShardedStep`) and tuned on first use (`AutoShardedStep`).
"""

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
from mistjax.api.tuned_step import AutoShardedStep
from mistjax.core.plan import format_bytes
from mistjax.plan import Plan, PlanError, StagePlan
from mistjax.runtime.mpmd_state import StagedArray
from mistjax.runtime.report import PipelineReport
from mistjax.runtime.step import PlannedStep, ShardedStep

V, D, F, L, B, T = 32, 8, 16, 4, 16, 8
TX = optax.adamw(1e-2)


def loss_fn(params: dict, batch: dict, tag: bool = True) -> jax.Array:
    h = params["embed"][batch["inputs"]]

    def layer(h, w):
        a = (h * w["scale"]) @ w["w1"]
        a = checkpoint_name(a, "mlp_in") if tag else a  # what activation offload moves
        return h + jnp.tanh(a) @ w["w2"], None

    h, _ = jax.lax.scan(layer, h, params["layers"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["head"], batch["targets"]).mean()


def make_step(tag: bool = True):
    def train_step(state, batch):
        loss, grads = mistjax.value_and_grad(lambda p, b: loss_fn(p, b, tag))(state["params"], batch)
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    return train_step


def make_state() -> dict:
    k = jax.random.split(jax.random.key(0), 4)
    params = {"embed": jax.random.normal(k[0], (V, D)) * 0.5, "head": jax.random.normal(k[3], (D, V)) * 0.3,
              "layers": {"w1": jax.random.normal(k[1], (L, D, F)) * 0.3,
                         "w2": jax.random.normal(k[2], (L, F, D)) * 0.3, "scale": jnp.ones((L, D))}}
    return {"params": params, "opt": TX.init(params)}


def make_batch(seed: int = 1) -> dict:
    tok = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, V)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def two_stages(first: dict, second: dict, **kw) -> Plan:
    """Stage 0 runs layers 0-3, stage 1 layer 3, on 4 devices each (dp 4, 2 micro-batches of 2)."""
    return Plan(stages=(StagePlan(layers=(0, 3), **first), StagePlan(layers=(3, 4), **second)),
                micro_batch=2, grad_accum=2, dp=4, **kw)


# Stage 0: ZeRO-3 over MiCS pairs, one checkpointed layer, gradient accumulators on host, the other two
# layers' tagged activations on host; stage 1: plain DP, half its optimizer state and its weights on host.
KNOBS = two_stages(dict(shard_opt=True, shard_grads=True, shard_weights=True, remat_layers=1, offload_grads=1.0,
                        offload_acts=1.0),
                   dict(shard_opt=False, offload_opt=0.5, offload_weights=1.0), shard_group=2)


@pytest.fixture(scope="module")
def ran():
    """One step of `KNOBS`, with the warnings its first call raised."""
    step = mistjax.autoshard(make_step(), jax.devices(), plan=KNOBS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new, metrics = step(make_state(), make_batch())
    return step, new, metrics, caught


def _numbers(detail: str, pattern: str) -> tuple[int, ...]:
    found = re.search(pattern, detail)
    assert found, f"{pattern!r} not in {detail!r}"
    return tuple(int(g) for g in found.groups())


def _pieces(tree, stage: int) -> list[jax.Array]:
    """The pieces of ``tree``'s leaves held by ``stage``."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, StagedArray))
    return [x.pieces[x.info.stages.index(stage)] for x in leaves if stage in x.info.stages]


def _on_host(pieces: list[jax.Array]) -> list[jax.Array]:
    return [p for p in pieces if p.sharding.memory_kind == "pinned_host"]


def test_report_names_every_stage_and_its_knobs(ran):
    step, new, metrics, caught = ran
    assert np.isfinite(float(metrics["loss"]))
    assert not [w for w in caught if issubclass(w.category, mistjax.NoOpWarning)], [str(w.message) for w in caught]
    applied = step.applied
    assert isinstance(applied, PipelineReport) and [r.stage for r in applied.stages] == [0, 1]
    text = step.report()
    assert "stage 0: layers 0-3 on device group 0 (4 devices); ZeRO-3 over MiCS group 2 of dp 4" in text
    assert "stage 1: layers 3-4 on device group 1 (4 devices); ZeRO-0 (replicated over dp 4)" in text
    assert "remat 1 of 3 layers (full); offload weights 0, grads 1, optimizer 0, activations 1" in text
    assert "offload weights 1, grads 0, optimizer 0.5, activations 0" in text
    assert text in step.summary() and step.plan.summary() in step.summary()


def test_sharding_numbers_match_the_placed_pieces(ran):
    step, new, *_ = ran
    for k in (0, 1):
        pieces = _pieces(new["params"], k)
        split = [p for p in pieces if p.sharding.shard_shape(p.shape) != p.shape]
        knob = step.applied[k].applied["shard_weights"]
        assert _numbers(knob.detail, r"(\d+) of (\d+) parameters stored sharded") == (len(split), len(pieces))
        assert knob.applied == (k == 0) and knob.requested == (k == 0)
    # ZeRO-3 on stage 0 splits its three stacked weights and the embedding; stage 1 keeps its weights whole.
    assert step.applied[0].applied["shard_weights"].detail.startswith("4 of 4")
    opt0 = [p for p in _pieces(new["opt"], 0) if p.ndim]
    split0 = [p for p in opt0 if p.sharding.shard_shape(p.shape) != p.shape]
    assert _numbers(step.applied[0].applied["shard_opt"].detail, r"(\d+) of (\d+) optimizer leaves sharded 2 ways"
                    ) == (len(split0), len(opt0)) and split0


def test_offload_numbers_match_the_host_pieces(ran):
    step, new, *_ = ran
    for k in (0, 1):
        for knob, tree in (("offload_opt", new["opt"]), ("offload_weights", new["params"])):
            host = _on_host(_pieces(tree, k))
            detail = step.applied[k].applied[knob].detail
            assert _numbers(detail, r"(\d+) leaves in host memory") == (len(host),), (k, knob)
            assert format_bytes(sum(p.nbytes for p in host)) in detail
    assert _on_host(_pieces(new["opt"], 1)) and _on_host(_pieces(new["params"], 1))  # stage 1 offloads both
    # Gradient accumulators: stage 0 keeps its stacked weights' in host memory between micro-batches.
    for k in (0, 1):
        accs = step._mpmd._accs[k][0]
        on_host = [a for a in accs if a.sharding.memory_kind == "pinned_host"]
        held = len(step._mpmd.programs[k].spec.params)
        assert _numbers(step.applied[k].applied["offload_grads"].detail,
                        r"(\d+) of (\d+) gradient accumulators in host memory") == (len(on_host), held)
    assert step.applied[0].applied["offload_grads"].applied and not step.applied[1].applied["offload_grads"].applied


def test_layer_knobs_match_the_stage_programs(ran):
    step, *_ = ran
    stage0 = step.applied[0].applied
    assert stage0["remat_layers"].detail == "1 of 3 layers checkpointed (full)"
    # offload_acts 1.0 of the two layers not checkpointed; their residuals are the ones kept on host.
    assert stage0["offload_acts"].detail == "2 layers offload their activations tagged mlp_in"
    assert step._mpmd.residual_host_bytes()[0] > 0
    assert not step.applied[1].applied["offload_acts"].requested
    assert step.applied[1].applied["remat_layers"].detail == "0 of 1 layers checkpointed (full)"


def test_a_knob_that_applies_to_nothing_on_one_stage_warns():
    """No activation is tagged: offload_acts on stage 0 moves nothing (stage 1 asks for nothing of the kind);
    ZeRO-3 over pairs of the 4 devices on stage 1 still applies."""
    plan = two_stages(dict(offload_acts=0.5), dict(shard_opt=True, shard_grads=True, shard_weights=True),
                      shard_group=2)
    step = mistjax.autoshard(make_step(tag=False), jax.devices(), plan=plan)
    with pytest.warns(mistjax.NoOpWarning, match="stage 0: offload_acts applies to nothing") as record:
        step.place(make_state(), make_batch())
    assert [str(w.message) for w in record if issubclass(w.category, mistjax.NoOpWarning)] == \
        list(step.applied.notes)
    assert not step.applied[1].applied.notes and step.applied[1].applied["shard_weights"].applied
    assert "[NO ] offload_acts" in step.report()


def _fixed_tuning(plan: Plan):
    """`AutoShardedStep._tune` that takes ``plan`` (the surface is under test here, not the tuner)."""

    def tune(self, state, batch):
        self._inner = ShardedStep(self.train_step, self.user_mesh, plan)

    return tune


@pytest.mark.parametrize("kind", ["one stage", "pipelined"])
def test_the_step_object_has_the_documented_surface(kind, monkeypatch):
    plan = two_stages({}, {}) if kind == "pipelined" else Plan(
        stages=(StagePlan(layers=(0, L), shard_weights=True, shard_grads=True),), micro_batch=2, grad_accum=1, dp=8)
    monkeypatch.setattr(AutoShardedStep, "_tune", _fixed_tuning(plan))
    step = mistjax.autoshard(make_step(), jax.devices(), verbose=False)
    assert isinstance(step, AutoShardedStep)
    with pytest.raises(PlanError, match="no plan yet"):
        step.report()
    state, batch = make_state(), make_batch()
    placed = step.place(jax.tree.map(jnp.copy, state), batch)
    assert step.plan is plan and isinstance(step, PlannedStep) and isinstance(step._inner, PlannedStep)
    leaves = jax.tree.leaves(placed, is_leaf=lambda x: isinstance(x, StagedArray))
    assert all(isinstance(x, StagedArray) for x in leaves) == (kind == "pipelined")
    # gather gives back exactly what was placed, as whole host arrays.
    for got, want in zip(jax.tree.leaves(step.gather(placed)), jax.tree.leaves(state), strict=True):
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, np.asarray(want))
    if kind == "pipelined":
        programs = step.compile_stages(placed, batch, ["forward"])
        assert set(programs) == {(0, "forward")}
        with pytest.raises(PlanError, match="compile_stages"):
            step.lower(placed, batch)
    else:
        programs = step.compile_stages(placed, batch)
        assert set(programs) == {(0, "step")}
        assert step.compile_stages(placed, batch, ["forward"]) == {}
        lowered = step.lower(placed, batch)
        assert isinstance(lowered, jax.stages.Lowered) and "all-gather" in lowered.compile().as_text()
    assert all(isinstance(c, jax.stages.Compiled) and c.memory_analysis() is not None for c in programs.values())
    new, metrics = step(placed, batch)
    assert np.isfinite(float(metrics["loss"]))
    assert "Applied" in step.report() and step.report() in step.summary()
    assert np.all(np.isfinite(jax.tree.leaves(step.gather(new))[0]))


def test_both_step_classes_spell_out_the_surface():
    """Every `PlannedStep` member is defined on both classes themselves (typed delegation, no __getattr__)."""
    members = [m for m in dir(PlannedStep) if not m.startswith("_") or m == "__call__"]
    assert {"place", "gather", "compile_stages", "lower", "report", "summary", "plan"} <= set(members)
    for cls in (ShardedStep, AutoShardedStep):
        missing = [m for m in members if m not in vars(cls) and m != "plan"]
        assert not missing, (cls.__name__, missing)
        assert "__getattr__" not in vars(cls)
    assert isinstance(vars(AutoShardedStep)["plan"], property)
