"""The cost model (mistjax.cost.model / predict): vectorised stage cost, plan predictions, and the
check against XLA's compiled programs (memory, FLOPs, collective bytes)."""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np
import pytest

import mistjax
from mistjax.core.hlo import collectives as hlo_collectives
from mistjax.cost import StageStrategies, Workload, analyze, predict, stage_cost
from mistjax.cost.layout import totals_over
from mistjax.hardware import ClusterSpec
from mistjax.plan import Prediction, uniform_plan
from mistjax.validate.check import FULL_GRID, SMALL_GRID, compare_cell, grid_plan, workload_for

CPU = ClusterSpec.preset("cpu", 1, 8)
A100 = ClusterSpec.preset("a100-40gb", 2, 8)
# The A100 cluster priced as if its collectives ran synchronously (no deferred in-loop sync).
A100_SYNC = dataclasses.replace(A100, device=dataclasses.replace(A100.device, async_collectives=False))


@pytest.fixture(scope="module")
def wl() -> Workload:
    return workload_for("llama-tiny", 16, 16)


def test_workload_from_model(wl):
    assert wl.num_layers == 4 and "full" in wl.policies and wl.policies[0] == "none"
    assert len(wl.fingerprint()) == 16 and wl.fingerprint() == workload_for("llama-tiny", 16, 16).fingerprint()
    assert mistjax.Workload is Workload and mistjax.Cluster is ClusterSpec


def test_stage_cost_is_vectorised_and_row_consistent(wl):
    r = np.random.default_rng(1)
    n = 2000
    kw = dict(b=r.integers(1, 5, n), dp=r.choice([2, 4, 8], n), tp=r.choice([1, 2], n), zero=r.integers(0, 4, n),
              layers=r.integers(1, 5, n), remat=r.integers(0, 3, n), policy=r.integers(0, len(wl.policies), n),
              wo=r.choice([0, 0.5], n), oo=r.choice([0, 1.0], n), ao=r.choice([0, 0.5], n), G=r.choice([1, 2], n),
              first=r.integers(0, 2, n).astype(bool), last=r.integers(0, 2, n).astype(bool))
    c = stage_cost(wl, A100, StageStrategies.make(**kw))
    assert c.stable.shape == c.peak.shape == (n,)
    assert np.all(c.stable > 0) and np.all(c.delta >= 0) and np.all(np.isfinite(c.peak))
    np.testing.assert_allclose(c.peak, sum(c.memory.values()))
    for i in (0, 7, 1999):  # one strategy alone gives the same numbers as inside the batch
        one = stage_cost(wl, A100, StageStrategies.make(**{k: v[i] for k, v in kw.items()}))
        assert float(one.peak) == pytest.approx(c.peak[i]) and float(one.stable) == pytest.approx(c.stable[i])
        assert float(one.delta) == pytest.approx(c.delta[i])


def test_memory_follows_the_runtime_rules(wl):
    base = dict(b=2, dp=8, layers=4, G=1)
    z0, z1, z3 = (stage_cost(wl, CPU, StageStrategies.make(zero=z, **base)) for z in (0, 1, 3))
    params = sum(x.size * x.itemsize for x in wl.leaves)
    assert float(z0.memory["params"]) == params and float(z0.memory["optimizer"]) == 2 * params
    assert float(z1.memory["optimizer"]) == pytest.approx(2 * params / 8)  # every tiny leaf splits 8 ways
    assert float(z3.memory["params"]) == pytest.approx(params / 8)
    off = stage_cost(wl, CPU, StageStrategies.make(zero=1, oo=1.0, **base))
    assert float(off.memory["optimizer"]) == 0 and float(off.host) == pytest.approx(2 * params / 8)
    remat = stage_cost(wl, CPU, StageStrategies.make(zero=0, remat=4, policy=wl.policy_index("full"), **base))
    assert float(remat.memory["activations"]) < float(z0.memory["activations"])
    assert float(remat.flops) > float(z0.flops)  # recompute


def test_predict_and_analyze(wl):
    plan = uniform_plan(4, 8, micro_batch=2, shard_opt=True)
    p = predict(wl, plan, A100)
    assert isinstance(p, Prediction) and p.step_time > 0 and p.peak_memory > 0 and len(p.stage_memory) == 1
    a = mistjax.analyze(wl, plan, A100)
    assert a.step_time == p.step_time and set(a.stage_memory[0]) == {"params", "optimizer", "grads", "activations",
                                                                      "buffers"}
    assert a.collective_bytes["reduce-scatter"] > 0 and "step" in a.summary()
    pipe = analyze(wl, uniform_plan(4, 8, micro_batch=1, stages=2, grad_accum=4, shard_opt=True), A100)
    assert len(pipe.stage_fwd) == 2 and pipe.mist_step_time > 0
    acts = [m["activations"] for m in pipe.stage_memory]
    # MPMD: stage 0 holds min(S, G) = 2 micro-batches' residuals, the last stage (fused F+B program) one
    assert acts[0] > acts[1] > 0


def test_shared_compute_pipeline_spreads_its_work_over_the_pool(wl):
    """On devices that share one pool of compute (XLA:CPU), an idle stage lends its share to the busy one:
    the pipeline costs its total work over the groups, between the lock-step makespan's 1 / groups and 1x."""
    plan = uniform_plan(4, 8, micro_batch=1, stages=2, grad_accum=4, shard_opt=True)
    own = dataclasses.replace(CPU, device=dataclasses.replace(CPU.device, shared_compute=False))
    pooled = dataclasses.replace(CPU, device=dataclasses.replace(CPU.device, shared_compute=True))
    lock, pool = analyze(wl, plan, own), analyze(wl, plan, pooled)
    work = sum(plan.grad_accum * (f + b) + d for f, b, d in zip(pool.stage_fwd, pool.stage_bwd,
                                                                pool.prediction.stage_delta))
    assert lock.step_time / 2 <= pool.step_time < lock.step_time
    assert pool.step_time == pytest.approx(max(work / 2, lock.step_time / 2))
    assert "one pool of compute" in pool.summary() and not lock.notes  # the user is told why
    single = uniform_plan(4, 8, micro_batch=2, shard_opt=True)  # one program: every device busy, nothing to lend
    assert analyze(wl, single, pooled).step_time == analyze(wl, single, own).step_time


def test_hlo_counter_reads_tuple_collectives():
    text = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ag = f32[8]{0} all-gather(%x), channel_id=1, replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ar = (f32[2]{0}, f32[3]{0}, f32[1]{0}, f32[1]{0}, f32[1]{0}, /*index=5*/f32[2]{0}) all-reduce(%a, %b), \
channel_id=2, replica_groups={{0,1,2,3}}
}
"""
    colls = {c.op: c for c in hlo_collectives(text)}
    assert colls["all-reduce"].result_bytes == 4 * 10 and colls["all-reduce"].group_size == 4
    assert colls["all-gather"].trips == 3 and colls["all-gather"].result_bytes == 32


def _check(records, mem_median, mem_max, flops_max, coll_max):
    mem = [abs(r["mem_err"]) for r in records]
    assert statistics.median(mem) <= mem_median, records
    assert max(mem) <= mem_max, records
    assert max(abs(r["flops_err"]) for r in records) <= flops_max, records
    coll = [abs(r["coll_err"]) for r in records if r["coll_err"] is not None]
    assert max(coll, default=0.0) <= coll_max, records


def test_against_xla_small_grid():
    """Predicted vs compiled per-device peak memory, FLOPs and collective bytes on the small grid."""
    cells = [SMALL_GRID[i] for i in (0, 1, 4)]  # llama-tiny: DP, ZeRO-1, MiCS ZeRO-3 (one model analysis)
    records = [compare_cell(name, seq, gb, grid_plan(name, kw), CPU) for name, seq, gb, kw in cells]
    _check(records, mem_median=0.05, mem_max=0.15, flops_max=0.02, coll_max=0.01)


def test_against_xla_pipelined():
    """A pipelined plan runs on the MPMD executor, one program per (stage, phase): its stages' compiled peaks
    (each program with the residuals and state its stage holds beside it) against the predicted ones, within
    the grid's 15%. The per-stage programs' FLOPs and collectives are not compared (`compare_cell` leaves them
    NaN; `bench_costmodel` counts such cells as skipped)."""
    name, seq, gb, kw = next(c for c in FULL_GRID if c[3].get("stages") == 2)
    rec = compare_cell(name, seq, gb, grid_plan(name, kw), CPU)
    assert abs(rec["mem_err"]) <= 0.15, rec
    assert rec["mem_xla"] > 0 and np.isnan(rec["flops_err"]), rec


@pytest.mark.slow
def test_against_xla_full_grid():
    records = [compare_cell(name, seq, gb, grid_plan(name, kw), CPU) for name, seq, gb, kw in FULL_GRID]
    # Collectives: 1% except tensor-parallel cells, whose embedding / head GSPMD partitions on its own
    # (llama-tiny tp2: 1.26%, see docs/cost_model.md).
    _check(records, mem_median=0.05, mem_max=0.15, flops_max=0.02, coll_max=0.015)
    _check([r for r in records if "tp" not in r["plan"]], mem_median=0.05, mem_max=0.15, flops_max=0.02,
           coll_max=0.01)


def test_in_loop_sync_is_serial_without_async_collectives(wl, monkeypatch):
    """``async_collectives`` False (XLA:CPU; the runtime does not defer there): the layers' sync is
    charged per layer (one collective each), serially, in delta; the bytes stay; ZeRO-1 never holds the
    layers' whole gradient. G > 1 keeps the end-of-step sync."""
    from mistjax.cost import model, stage_time

    def costs(**kw):
        return {z: stage_cost(wl, A100_SYNC, StageStrategies.make(zero=z, b=2, dp=8, layers=4, **kw)) for z in (0, 1)}

    on = {G: costs(G=G) for G in (1, 2)}
    off_fn = lambda workload, k, lt: np.zeros(np.shape(k.zero))  # noqa: E731
    monkeypatch.setattr(stage_time, "synced_in_loop", off_fn)
    monkeypatch.setattr(model, "synced_in_loop", off_fn)
    off = {G: costs(G=G) for G in (1, 2)}
    for z in (0, 1):
        a, b = on[1][z], off[1][z]
        assert float(a.stable) == float(b.stable) and float(a.flops_xla) == float(b.flops_xla)
        assert float(b.delta) < float(a.delta)  # the same bytes in L collectives: L latencies (a tiny model)
        assert {k: float(v) for k, v in a.comm.items()} == {k: float(v) for k, v in b.comm.items()}
        assert float(on[2][z].delta) == float(off[2][z].delta)
    assert float(on[1][1].memory["grads"]) < float(off[1][1].memory["grads"])  # shards only


def test_async_collectives_price_the_deferred_sync_below_the_serial_one(wl):
    """The same cluster with and without ``async_collectives``: deferred, the step costs less than the
    serial per-layer sync, its backward no less than the compute (the serial backward), and one pending
    row more of gradient memory (ZeRO-0 and ZeRO-1: the whole unsynchronised row)."""
    assert not CPU.device.async_collectives and A100.device.async_collectives
    extra = []
    for z in (0, 1):
        st = StageStrategies.make(zero=z, b=2, dp=8, layers=4, G=1)
        a, s = stage_cost(wl, A100, st), stage_cost(wl, A100_SYNC, st)
        assert float(a.stable + a.delta) < float(s.stable + s.delta)
        assert float(a.bwd) > float(s.bwd) and float(a.fwd) == float(s.fwd)
        extra.append(float(a.memory["grads"]) - float(s.memory["grads"]))
    assert extra[0] > 0 and extra[0] == pytest.approx(extra[1])


def test_fetched_weights_follow_the_runtimes_loops(wl):
    """ZeRO-3's gathered weights as the runtime holds them: two layers inside the layer loops where it
    double-buffers the fetches (asynchronous collectives), one where it does not; the gathered embedding /
    head for the whole step when G > 1 (XLA hoists their gathers out of the micro-batch loop), only next
    to their own part when G == 1 (cheaper by at least the smaller of the two)."""
    def buffers(cluster, **kw):
        return float(stage_cost(wl, cluster, StageStrategies.make(zero=3, b=2, dp=8, layers=4, **kw)).memory["buffers"])

    lt = totals_over(wl, (1, 8, 3, 0.0, 0.0, 0.0, True, True, 4))
    one_layer = float(lt["w_layer_fetch"])
    assert one_layer > 0 and float(lt["w_pre_fetch"]) > 0 and float(lt["w_post_fetch"]) > 0
    assert buffers(A100, G=2) - buffers(A100_SYNC, G=2) == pytest.approx(one_layer)
    assert buffers(A100_SYNC, G=2) - buffers(A100_SYNC, G=1) >= min(float(lt["w_pre_fetch"]), float(lt["w_post_fetch"]))


def test_layer_collectives_add_to_compute_without_async_collectives(wl):
    """ZeRO-3's per-layer gathers and reduce-scatters: overlapped with the layers' compute where XLA runs
    collectives asynchronously (A100), added to it where it runs them inline (XLA:CPU's order): the
    synchronous price is the overlapped one's compute plus the whole collective time, never less."""
    st = StageStrategies.make(zero=3, b=2, dp=8, layers=4, G=1)
    no_comm = StageStrategies.make(zero=1, b=2, dp=8, layers=4, G=1)  # same compute, no in-loop gathers
    a, s = stage_cost(wl, A100, st), stage_cost(wl, A100_SYNC, st)
    base = stage_cost(wl, A100_SYNC, no_comm)
    assert float(s.fwd) > float(a.fwd) and float(s.bwd) > float(a.bwd)
    # inline: the forward is the compute plus every layer's gather (and the other leaves' one gather)
    assert float(s.fwd) - float(base.fwd) > float(a.fwd) - float(base.fwd) > 0


def test_in_loop_sync_overlaps_the_next_layers_backward(wl, monkeypatch):
    """ZeRO-0/1 single stage, G == 1: each layer's sync runs under the next layer's backward (the runtime
    defers it by one iteration, `runtime.accumulate.sync_deferred`): the backward costs more than its
    compute and less than compute plus the serial per-layer collectives; the loop's first row is synced
    after it (serial, in delta), and the first iteration's zero-seed collective adds one row of bytes;
    ZeRO-1 never holds the layers' whole gradient. G > 1 keeps the end-of-step sync."""
    from mistjax.cost import model, stage_time
    from mistjax.cost.knobs import Knobs

    rows = {}
    real_rows = stage_time.synced_row_bytes

    def spy(workload, k, v, lt):
        rows[int(k.zero)] = out = real_rows(workload, k, v, lt)
        return out

    def strategies(z, G):
        return StageStrategies.make(zero=z, b=2, dp=8, layers=4, G=G)

    monkeypatch.setattr(stage_time, "synced_row_bytes", spy)
    on = {G: {z: stage_cost(wl, A100, strategies(z, G)) for z in (0, 1)} for G in (2, 1)}
    monkeypatch.setattr(stage_time, "synced_row_bytes", real_rows)  # keep the G == 1 rows
    off_fn = lambda workload, k, lt: np.zeros(np.shape(k.zero))  # noqa: E731
    monkeypatch.setattr(stage_time, "synced_in_loop", off_fn)
    monkeypatch.setattr(model, "synced_in_loop", off_fn)
    off = {G: {z: stage_cost(wl, A100, strategies(z, G)) for z in (0, 1)} for G in (1, 2)}
    for z in (0, 1):
        a, b = on[1][z], off[1][z]
        t_row = float(stage_time._grad_sync_time(A100, Knobs.of(strategies(z, 1)), rows[z]))
        exposed = float(a.bwd) - float(b.bwd)
        assert t_row > 0 and float(a.fwd) == float(b.fwd)
        assert 0.0 < exposed < 4 * t_row  # never below the compute, below the serial per-layer sync
        assert exposed >= 4 * t_row - float(b.bwd)  # at most the compute hides
        seed = float(rows[z]) / (1 if z == 0 else 8)
        kind = "all-reduce" if z == 0 else "reduce-scatter"
        assert float(a.comm[kind]) == pytest.approx(float(b.comm[kind]) + seed)
        assert float(on[2][z].delta) == float(off[2][z].delta) and float(on[2][z].bwd) == float(off[2][z].bwd)
    assert float(on[1][1].memory["grads"]) < float(off[1][1].memory["grads"])  # shards only


def test_segment_slices_are_charged_only_where_the_runtime_slices():
    """Mixed layer kinds copy the sliced stacks (`cost.model._segment_slices`): every device layer weight
    without in-loop accumulation, only the host-accumulated leaves' with it (G > 1 or a pipeline stage)."""
    from types import SimpleNamespace

    from mistjax.cost.model import _segment_slices

    lt = {"w_layer_dev": np.array(10.0), "w_layer_dev_acc_host": np.array(3.0)}
    kinds = SimpleNamespace(n_off=np.array([0.0, 0.0, 0.0, 0.0]), n_plain=np.array([2.0, 2.0, 2.0, 4.0]),
                            n_remat=np.array([2.0, 2.0, 2.0, 0.0]))
    k = SimpleNamespace(layers=np.array(4.0), G=np.array([1, 2, 1, 2]), pipelined=np.array([False, False, True, False]))
    got = _segment_slices(SimpleNamespace(layer_grads_in_loop=True), k, kinds, lt)
    np.testing.assert_allclose(got, [40.0, 12.0, 12.0, 0.0])  # one kind only: one scan of the whole stack
    unrolled = _segment_slices(SimpleNamespace(layer_grads_in_loop=False), k, kinds, lt)
    np.testing.assert_allclose(unrolled, [40.0, 40.0, 40.0, 0.0])


def test_tied_embedding_gradient_swap_is_priced_on_the_end_stages():
    """A tied embedding is held by the first and the last stage, which swap its gradient summands once per step
    (`runtime.mpmd`): the cost model charges that send to those stages' once-per-step time and memory only."""
    import models

    cfg = models.get_config("llama-tiny")
    tied, untied = (models.workload(cfg.replace(tie_embeddings=t), 16, 16) for t in (True, False))
    plan = uniform_plan(4, 8, stages=4, grad_accum=8, micro_batch=1, shard_opt=True)
    pt, pu = analyze(tied, plan, A100), analyze(untied, plan, A100)
    swap = np.subtract(pt.prediction.stage_delta, pu.prediction.stage_delta)
    link = A100.p2p_link(False)
    embedding = next(x for x in tied.leaves if x.parts >= {"pre", "post"})
    grad = embedding.size * tied.grad_itemsize(embedding)
    expected = link.latency + grad / link.bandwidth
    assert swap[0] == pytest.approx(expected, rel=0.05) and swap[-1] == pytest.approx(expected, rel=0.05)
    # the middle stages hold no tied leaf; the untied model has an LM head of its own instead (no swap)
    assert np.allclose(swap[1:-1], 0.0, atol=1e-12)
