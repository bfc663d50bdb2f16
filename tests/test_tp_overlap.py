"""Collective matmuls (`mistjax.runtime.collective_matmul`, issue #28 item 3): the tensor-parallel all-gather /
reduce-scatter of the layer run as rings of chunked matmuls and ppermutes. Forced on on XLA:CPU (where the
runtime leaves them off): the step against the single-device reference, the layer's collectives in the
compiled HLO, the rings against plain matmuls, and the switch (the plan's ``tp_overlap``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_runtime import ZERO3, assert_matches_reference, make_plan, setup

import mistjax
import models
from mistjax.core.execution import Capabilities
from mistjax.core.hlo import collectives as hlo_collectives
from mistjax.cost.kernels import kernel_times
from mistjax.cost.model import stage_memory
from mistjax.cost.predict import plan_strategies, predict
from mistjax.cost.stage_time import layer_tp_times
from mistjax.cost.tp_rings import exposed_ring_time, ring_bytes
from mistjax.hardware import ClusterSpec
from mistjax.plan import uniform_plan
from mistjax.runtime import xla_flags
from mistjax.runtime.collective_matmul import RingDot, allgather_matmul, free_out_dim, matmul_reduce_scatter

NUMERICS = [
    ("gpt3-tiny", dict(tp=2, shard_opt=False)),
    ("llama-tiny", dict(ZERO3, tp=4, grad_accum=2, remat_layers=2)),  # GQA, SwiGLU; ZeRO-3 fetches, remat
]


@pytest.mark.parametrize("name,knobs", NUMERICS, ids=[f"{n}-tp{k['tp']}" for n, k in NUMERICS])
def test_rings_match_single_device(name, knobs):
    """Loss (rtol 1e-5), gradients and parameters after one step (rtol 1e-4) as the unsharded step."""
    cfg, state, batch, train_step, ref_loss, ref_grads = setup(name)
    step = mistjax.autoshard(train_step, jax.devices(), plan=make_plan(cfg, **knobs).replace(tp_overlap=True))
    new, metrics = step(jax.tree.map(jnp.copy, state), batch)
    np.testing.assert_allclose(float(metrics["loss"]), ref_loss, rtol=1e-5)
    assert_matches_reference(metrics, ref_loss, ref_grads)
    ref_new = jax.jit(lambda s, g: s.apply_gradients(g))(state, ref_grads)
    for p, r in zip(jax.tree.leaves(new.params), jax.tree.leaves(ref_new.params)):
        np.testing.assert_allclose(np.asarray(p), np.asarray(r), rtol=1e-4, atol=1e-6)


def _tp_in_loops(compiled, tp: int) -> dict[str, tuple[int, float]]:
    """Per kind, (executions, executed result bytes) of the tensor-group collectives inside loops."""
    out: dict[str, tuple[int, float]] = {}
    for c in hlo_collectives(compiled.as_text()):
        if c.group_size == tp and not c.computation.startswith("main"):
            n, b = out.get(c.op, (0, 0.0))
            out[c.op] = (n + c.trips, b + c.result_bytes * c.trips)
    return out


def test_rings_replace_the_layer_gathers():
    """gpt3-tiny at tp = 2, 4 layers: on, no all-gather is left in the layer loops and no activation-sized
    all-reduce (XLA:CPU's form of a reduce-scatter); ten ring transfers per layer (forward: two gathers, two
    reduce-scatters; backward: per column-parallel ring one transfer carrying the input chunk and the input
    gradient's accumulator, per row-parallel ring the cotangent chunk), each (t - 1) / t of an activation,
    the share of it an all-gather moves. Off (the default on CPU): today's program, no ppermute."""
    cfg, state, batch, train_step, *_ = setup("gpt3-tiny")
    plan = make_plan(cfg, tp=2, shard_opt=False)
    t, layers = plan.tp, cfg.num_layers

    def loops(on: bool):
        step = mistjax.autoshard(train_step, jax.devices(), plan=plan.replace(tp_overlap=on))
        return _tp_in_loops(step.lower(state, batch).compile(), t)

    on, off = loops(True), loops(False)
    assert "collective-permute" not in off and off["all-gather"][0] == 6 * layers, off
    activation = off["all-gather"][1] / off["all-gather"][0]  # bytes of one gathered layer input
    assert "all-gather" not in on, on
    permutes, moved = on["collective-permute"]
    # Forward 4 transfers, backward 2 x 2 (input + accumulator) + 2: 10 activation chunks per ring step.
    assert permutes == 8 * (t - 1) * layers, on
    assert moved == pytest.approx(10 * layers * activation * (t - 1) / t), (on, activation)
    assert on["all-reduce"][1] < off["all-reduce"][1] and on["all-reduce"][1] / on["all-reduce"][0] < activation, on


def _eqn(f, *args):
    (eqn,) = jax.make_jaxpr(f)(*args).eqns
    return eqn


def test_rings_against_plain_matmuls():
    """The rings at t = 4 on a (data 2, tensor 4) mesh, inside a shard_map manual over `data` as in the
    runtime: a gathered ring of two matmuls (the activation on the left of one, on the right of the other)
    and a reduce-scattered sum of two matmuls; value and gradients as plain matmuls."""
    t = 4
    mesh = Mesh(np.array(jax.devices()).reshape(2, t), ("data", "tensor"))
    k = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(k[0], (2, 16, 8))  # (batch, seq, embed)
    wa = jax.random.normal(k[1], (8, 4, 3))  # embed -> (heads, dim), heads split
    wb = jax.random.normal(k[2], (12, 8))  # (mlp, embed): x on the right, mlp split
    wo = jax.random.normal(k[3], (12, 8))
    wo2 = jax.random.normal(k[4], (4, 3, 8))

    def col_a(x, w):
        return jnp.einsum("bte,end->btnd", x, w)

    def col_b(x, w):
        return jnp.einsum("fe,bte->fbt", w, x)

    def row_a(m, w):  # m: (f, b, t), f split
        return jnp.einsum("fbt,fe->bte", m, w)

    def row_b(q, w):
        return jnp.einsum("btnd,nde->bte", q, w)

    def ref(x, wa, wb, wo, wo2):
        q, m = jnp.tanh(col_a(x, wa)), jnp.tanh(col_b(x, wb))
        return jnp.sum(jnp.sin(row_a(m, wo) + row_b(q, wo2)) * x)

    ea, eb = _eqn(col_a, x, wa), _eqn(col_b, x, wb)
    q0, m0 = col_a(x, wa), col_b(x, wb)
    ra, rb = _eqn(row_a, m0, wo), _eqn(row_b, q0, wo2)
    assert (free_out_dim(eb, 1, 1), free_out_dim(eb, 0, 0), free_out_dim(ra, 0, 0)) == (2, 0, None)
    seq = P(None, "tensor", None)
    gather = [RingDot(ea, 0, 1, 1, P(None, "tensor", None), P(None, None, "tensor", None), seq),
              RingDot(eb, 1, 1, 2, P("tensor", None), P("tensor", None, None), seq)]
    scatter = [RingDot(ra, 0, 2, 1, P("tensor", None), seq, P("tensor", None, None)),
               RingDot(rb, 0, 1, 1, P("tensor", None, None), seq, P(None, None, "tensor", None))]

    def ringed(x, wa, wb, wo, wo2):
        q, m = allgather_matmul(x, [wa, wb], gather, axis="tensor", t=t)
        y = matmul_reduce_scatter([jnp.tanh(m), jnp.tanh(q)], [wo, wo2], scatter, axis="tensor", t=t)
        return jnp.sum(jnp.sin(y) * x)

    def body(x, *ws):
        v, g = jax.value_and_grad(ringed, argnums=range(5))(x, *ws)
        return jax.lax.psum(v, "data"), g[0], [jax.lax.psum(u, "data") for u in g[1:]]

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P(), P(), P()),
                                out_specs=(P(), P("data"), P()), axis_names=frozenset({"data"}), check_vma=False))
    with jax.set_mesh(mesh):
        v, gx, gws = run(x, wa, wb, wo, wo2)
    rv, rg = jax.value_and_grad(ref, argnums=range(5))(x, wa, wb, wo, wo2)
    np.testing.assert_allclose(v, rv, rtol=1e-5)
    for a, b in zip([gx, *gws], rg):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_switch(monkeypatch):
    """The plan's ``tp_overlap`` is the switch, a plain value: the environment changes nothing (the old
    MISTJAX_COLLECTIVE_MATMUL is gone), a plan JSON carries it, a non-bool is refused; XLA:GPU flags only for GPU
    programs, each with its reason."""
    monkeypatch.setenv("MISTJAX_COLLECTIVE_MATMUL", "on")
    assert not Capabilities.of_platform("gpu").collective_matmul and Capabilities.of_platform("cpu", True) == (
        False, True)
    plan = uniform_plan(4, 2, tp=2).replace(tp_overlap=True)
    assert mistjax.Plan.from_json(plan.to_json()).tp_overlap and "collective matmuls" in plan.summary()
    assert "applies to nothing" in uniform_plan(4, 2).replace(tp_overlap=True).summary()
    with pytest.raises(mistjax.plan.PlanError, match="tp_overlap"):
        plan.replace(tp_overlap="yes")
    assert xla_flags.compiler_options("cpu") == {} and xla_flags.compiler_options("tpu") == {}
    opts = xla_flags.compiler_options("gpu")
    assert opts["xla_gpu_threshold_for_windowed_einsum_mib"] == 1 << 40 and len(opts) == len(xla_flags.GPU_FLAGS)
    assert "xla_gpu_enable_latency_hiding_scheduler" not in opts  # left to XLA (it raised an A100 peak 37%)
    assert all(len(f.reason) > 40 for f in xla_flags.GPU_FLAGS)


# ------------------------------------------------------------------------------------------- the cost model
def test_exposed_ring_time_by_hand():
    """One ring of t = 8 moving 8 MB in all over 1 GB/s, 10 us per step: in line every transfer is paid
    ((t - 1) steps of latency + B / t / bw); beside the chunk GEMMs at least what the GEMM does not cover and at
    most the transfer (the interference factors slow both)."""
    link, t, nbytes = (1e9, 1e-5), 8, 8e6
    step = 1e-5 + nbytes / t / 1e9  # 1.01 ms
    assert exposed_ring_time(nbytes, 1, t, link, 0.0, None) == pytest.approx(7 * step)
    ovl = ClusterSpec.parse("h100:1x8").interference
    for gemm in (0.0, 0.5 * t * step, t * step, 4.0 * t * step):
        got = exposed_ring_time(nbytes, 1, t, link, gemm, ovl)
        assert 7 * max(0.0, step - gemm / t) - 1e-12 <= got <= 7 * step + 1e-12, gemm
    assert exposed_ring_time(nbytes, 2, t, link, 0.0, None) == pytest.approx(2 * 7 * (1e-5 + nbytes / 2 / t / 1e9))
    assert exposed_ring_time(nbytes, 1, 1, link, 0.0, None) == 0.0  # no tensor parallelism, no ring


@pytest.fixture(scope="module")
def gpt3_7b():
    cfg = models.get_config("gpt3-7b").replace(dtype="bfloat16", param_dtype="bfloat16")
    return models.workload(cfg, 2048, 8)


def _layer(workload, cluster: str, on: bool) -> tuple[dict[str, float], dict[str, float], float]:
    """TP = 8 GPT-3 7B, micro-batch 1: one layer's TP seconds (`layer_tp_times`), its compute and ring bytes, and
    the predicted step time, the plan's ``tp_overlap`` = ``on``."""
    cl = ClusterSpec.parse(cluster)
    plan = uniform_plan(workload.num_layers, 8, tp=8, micro_batch=1, shard_opt=False).replace(tp_overlap=on)
    m = stage_memory(workload, cl, plan_strategies(workload, plan, cl))
    tp = {k: float(np.ravel(v)[0]) for k, v in layer_tp_times(workload, cl, m.knobs, m.values, m.kinds).items()}
    step = predict(workload, plan, cl).step_time
    kt = kernel_times(workload, cl.device, 1.0, 8.0)
    bw = cl.collective_link(8, 1).bandwidth
    comm = {ph: float(np.ravel(ring_bytes(m.values.block, ph))[0]) * 7 / 8 / bw for ph in ("fwd", "bwd")}
    compute = {"fwd": float(kt[("block", "fwd[none]")]), "bwd": float(kt[("block", "bwd[none]")])}
    return tp, {ph: comm[ph] - compute[ph] for ph in comm}, step


def test_cost_model_prices_the_rings_where_the_runtime_runs_them(gpt3_7b):
    """The plan's ``tp_overlap``, read by both: on for an H100 cluster (async collectives) the layer's TP time is
    the rings' exposed time, below the serial collectives and above what the bandwidth alone leaves uncovered by
    the layer's compute, and the split GEMMs' extra kernels are charged; off, the serial price stands; on XLA:CPU
    (collectives in line) the rings gain nothing."""
    serial, _, step_off = _layer(gpt3_7b, "h100:1x8", False)
    auto, floor, step_auto = _layer(gpt3_7b, "h100:1x8", True)
    assert auto["chunks_fwd"] > 0 and serial["chunks_fwd"] == 0
    for ph in ("fwd", "bwd"):
        assert max(0.0, floor[ph]) <= auto[ph] < serial[ph], (ph, auto, serial, floor)
    assert step_auto < step_off  # the rings pay at this size (docs/benchmarks.md: the deviceless schedule)
    cpu_on, _, cpu_step = _layer(gpt3_7b, "cpu:1x8", True)
    cpu_off, _, cpu_step_off = _layer(gpt3_7b, "cpu:1x8", False)
    assert cpu_step >= cpu_step_off and cpu_on["fwd"] >= cpu_off["fwd"]


def test_compiled_collectives_against_the_ring_accounting():
    """`validate.check` with the rings forced on: the layer's all-gathers and reduce-scatters are predicted as the
    collective-permutes of their rings (`ring_records`), and the compiled XLA:CPU step agrees per kind within 1%
    of its collective bytes (gpt3-tiny, TP 2, ZeRO-1, G 2; the FULL_GRID cell)."""
    from mistjax.validate.check import compare_cell, grid_plan

    kw = dict(micro_batch=4, tp=2, grad_accum=2, shard_opt=True)
    rec = compare_cell("gpt3-tiny", 16, 32, grid_plan("gpt3-tiny", kw).replace(tp_overlap=True),
                       ClusterSpec.preset("cpu", 1, 8))
    assert rec["coll_tp_pred"]["collective-permute"] > 0 and rec["coll_err"] < 0.01, rec


def test_tp_overlap_auto_on_where_it_pays(gpt3_7b):
    """GPT-3 7B at tp 8 on eight H100s: the tuner chooses the knob by itself: the winner runs its TP collectives as
    collective matmuls, predicted more than 2% faster than the same plan without (the tuner's threshold); on
    XLA:CPU (collectives in line) and in Megatron-LM's space it stays off."""
    from mistjax.tuning import SearchSpace, search

    space = SearchSpace(tp_degrees=(8,), pipeline=False, cp_degrees=(1,))
    gpu = search(gpt3_7b, ClusterSpec.parse("h100:1x8"), space)
    assert gpu.plan.tp == 8 and gpu.plan.tp_overlap
    off = predict(gpt3_7b, gpu.plan.replace(tp_overlap=False, prediction=None), ClusterSpec.parse("h100:1x8"))
    assert gpu.plan.prediction.step_time < off.step_time / 1.02
    assert not search(gpt3_7b, ClusterSpec.parse("h100:1x8"), space.replace(tp_overlap=False)).plan.tp_overlap
    cpu = search(gpt3_7b, ClusterSpec.parse("cpu:1x8").with_memory(2**40), space).plan
    assert cpu.tp == 8 and not cpu.tp_overlap


def test_tp_overlap_at_tp_1_warns_that_it_applies_to_nothing():
    cfg, state, batch, train_step, *_ = setup("gpt3-tiny")
    step = mistjax.autoshard(train_step, jax.devices(), plan=make_plan(cfg, tp=1).replace(tp_overlap=True))
    with pytest.warns(mistjax.NoOpWarning, match="tp_overlap applies to nothing"):
        step(jax.tree.map(jnp.copy, state), batch)
