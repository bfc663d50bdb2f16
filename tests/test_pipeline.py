"""Tests for the pipeline executor (mistjax.runtime.pipeline) and its schedule tables (.schedules).

A toy LM (embedding V=64 -> L residual MLP blocks -> RMS norm + head + mean cross-entropy) is run through
`pipeline_value_and_grad` on 8 simulated CPU devices and compared with `jax.value_and_grad` of the
un-pipelined model on one device.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core import pipeline_time as ptime
from mistjax.core import schedules as sch
from mistjax.core.policies import remat_policy as remat_policy_fn
from mistjax.runtime import ticks
from mistjax.runtime.pipeline import (
    from_stage_layout,
    layer_residual_bytes,
    pipeline_value_and_grad,
    to_stage_layout,
)

VOCAB = 64


# ------------------------------------------------------------------------------------------ toy model
def init_params(num_layers: int, width: int = 16, ffn: int = 32, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 5)
    pre = {"emb": 0.5 * jax.random.normal(k[0], (VOCAB, width))}
    blocks = {"w1": jax.random.normal(k[1], (num_layers, width, ffn)) / np.sqrt(width),
              "w2": jax.random.normal(k[2], (num_layers, ffn, width)) / np.sqrt(ffn),
              "g": 1.0 + 0.1 * jax.random.normal(k[3], (num_layers, width))}
    post = {"g": jnp.ones(width), "head": jax.random.normal(k[4], (width, VOCAB)) / np.sqrt(width)}
    return pre, blocks, post


def _rms(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def pre_fn(p, mb):
    return p["emb"][mb["tok"]]


def block_fn(w, h):
    act = checkpoint_name(jax.nn.gelu(_rms(h, w["g"]) @ w["w1"]), "act")  # for the "names:act" policy
    return h + act @ w["w2"]


def post_fn(p, h, mb):
    logp = jax.nn.log_softmax(_rms(h, p["g"]) @ p["head"])
    return -jnp.mean(jnp.take_along_axis(logp, mb["tgt"][..., None], -1))


def reference_loss(params, mbs):
    pre, blocks, post = params

    def one(mb):
        h, _ = jax.lax.scan(lambda h, w: (block_fn(w, h), None), pre_fn(pre, mb), blocks)
        return post_fn(post, h, mb)

    return jnp.mean(jax.vmap(one)(mbs))


def make_batch(num_mb: int, batch: int = 8, seq: int = 4, seed: int = 1):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"tok": jax.random.randint(k1, (num_mb, batch, seq), 0, VOCAB),
            "tgt": jax.random.randint(k2, (num_mb, batch, seq), 0, VOCAB)}


def make_mesh(shape, names=("stage", "replica")):
    return jax.make_mesh(shape, names[: len(shape)], axis_types=(AxisType.Auto,) * len(shape))


def pipelined(mesh, layers, *, batch_axis=None, **kw):
    """(jitted pipeline fn, placement fn) for the toy model."""
    fn = jax.jit(functools.partial(pipeline_value_and_grad, pre_fn, block_fn, post_fn, mesh=mesh,
                                   stage_layers=layers, **kw))

    def place(pre, staged, post, mbs, abstract=False):
        put = ((lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)) if abstract
               else jax.device_put)
        rep, stg = NamedSharding(mesh, P()), NamedSharding(mesh, P("stage"))
        bat = NamedSharding(mesh, P(None, batch_axis))
        return (jax.tree.map(lambda x: put(x, rep), pre), jax.tree.map(lambda x: put(x, stg), staged),
                jax.tree.map(lambda x: put(x, rep), post), jax.tree.map(lambda x: put(x, bat), mbs))

    return fn, place


def assert_matches_reference(loss, grads, params, mbs, layers, mask):
    ref_loss, (r_pre, r_blocks, r_post) = jax.jit(jax.value_and_grad(reference_loss))(params, mbs)
    g_pre, g_stage, g_post = grads
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
    close(loss, ref_loss)
    jax.tree.map(close, g_pre, r_pre)
    jax.tree.map(close, g_post, r_post)
    jax.tree.map(close, from_stage_layout(g_stage, layers), r_blocks)
    for leaf in jax.tree.leaves(g_stage):  # padding rows: exactly zero
        pad = np.asarray(leaf)[~np.asarray(mask)]
        assert not pad.size or np.all(pad == 0)


def run_case(mesh_shape, layers, num_mb, schedule, *, remat=None, policy="full", batch_axis=None, dp_axes=()):
    mesh = make_mesh(mesh_shape)
    params = init_params(layers[-1][1])
    mbs = make_batch(num_mb)
    staged, mask = to_stage_layout(params[1], layers)
    fn, place = pipelined(mesh, layers, batch_axis=batch_axis, schedule=schedule, remat_layers=remat,
                          remat_policy=policy, dp_axes=dp_axes)
    args = place(params[0], staged, params[2], mbs)
    compiled = fn.lower(*args).compile()
    loss, grads = compiled(*args)
    assert_matches_reference(loss, grads, params, mbs, layers, mask)
    assert grads[1]["w1"].sharding.spec[0] == "stage"
    return compiled


# ---------------------------------------------------------------------------------- correctness (SPMD)
@pytest.mark.parametrize("mesh_shape,layers,num_mb,schedule,remat,policy", [
    ((2,), [(0, 2), (2, 4)], 2, "1f1b", None, "full"),  # G = S, even
    ((4,), [(0, 3), (3, 4), (4, 6), (6, 8)], 8, "1f1b", [2, 0, 1, 2], ["full", "full", "names:act", "dots"]),
    ((4,), [(0, 3), (3, 4), (4, 6), (6, 8)], 16, "gpipe", [0, 1, 0, 1], "full"),  # G = 4S, uneven
    ((2,), [(0, 1), (1, 4)], 4, "1f1b-eager", [0, 2], "dots"),  # G = 2S, last stage F and B share a tick
])
def test_matches_reference(mesh_shape, layers, num_mb, schedule, remat, policy):
    run_case(mesh_shape, layers, num_mb, schedule, remat=remat, policy=policy)


def _all_reduce_sites(hlo: str) -> set[str]:
    """'entry' / 'loop' for every all-reduce in compiled HLO (loop = inside a non-entry computation)."""
    sites, comp = set(), ""
    for line in hlo.splitlines():
        if line.startswith("ENTRY"):
            comp = "entry"
        elif re.match(r"^\S.*\{$", line):
            comp = "loop"
        if re.search(r"\ball-reduce(-start)?\(", line):
            sites.add(comp)
    return sites


def test_gspmd_data_parallel_inside_branches():
    """Batch sharded over a GSPMD 'replica' axis: its all-reduces run inside the varying branches."""
    compiled = run_case((2, 4), [(0, 2), (2, 4)], 4, "1f1b", batch_axis="replica")
    assert "loop" in _all_reduce_sites(compiled.as_text())  # ran without deadlock


def test_manual_data_parallel_reduces_once():
    """dp_axes=('replica',): grads are reduced once after the schedule loop, never inside it."""
    compiled = run_case((4, 2), [(0, 3), (3, 4), (4, 5), (5, 7)], 8, "gpipe", remat=[1, 0, 0, 1],
                        batch_axis="replica", dp_axes=("replica",))
    assert _all_reduce_sites(compiled.as_text()) == {"entry"}


def test_manual_collective_inside_block():
    """A block with its own collective over a manual DP axis (as ZeRO-3 gathers would be) runs inside
    the stage branches without deadlock: its groups never span stages."""
    def stat_block(w, h, mean=lambda v: jax.lax.pmean(jnp.mean(v), "replica")):
        return h + jax.nn.gelu((h * jax.lax.rsqrt(mean(h * h) + 1.0)) @ w["w1"]) @ w["w2"]

    layers, mesh = [(0, 2), (2, 4)], make_mesh((2, 4))
    pre, blocks, post = init_params(4)
    mbs = make_batch(2)
    staged, _ = to_stage_layout(blocks, layers)
    fn = jax.jit(functools.partial(pipeline_value_and_grad, pre_fn, stat_block, post_fn, mesh=mesh,
                                   stage_layers=layers, remat_layers=[1, 0], dp_axes=("replica",)))
    batch = jax.device_put(mbs, NamedSharding(mesh, P(None, "replica")))
    loss, (_, g_stage, _) = fn(pre, staged, post, batch)

    def reference(blocks):
        def one(mb):
            h, _ = jax.lax.scan(lambda h, w: (stat_block(w, h, jnp.mean), None), pre_fn(pre, mb), blocks)
            return post_fn(post, h, mb)
        return jnp.mean(jax.vmap(one)(mbs))

    ref_loss, ref_grads = jax.value_and_grad(reference)(blocks)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
                 from_stage_layout(g_stage, layers), ref_grads)


# ---------------------------------------------------------------------------------------- memory / remat
def _compiled_memory(mesh_shape, layers, num_mb, schedule, remat=None, policy="full", width=64, ffn=256):
    """Per-device peak estimate (argument + output + temp - alias) and temp bytes; compile only."""
    mesh = make_mesh(mesh_shape)
    params = init_params(layers[-1][1], width, ffn)
    staged, _ = to_stage_layout(params[1], layers)
    fn, place = pipelined(mesh, layers, schedule=schedule, remat_layers=remat, remat_policy=policy)
    lowered = fn.lower(*place(params[0], staged, params[2], make_batch(num_mb, 8, 32), abstract=True))
    m = lowered.compile().memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return peak, m.temp_size_in_bytes, lowered.as_text().count("dot_general")


def test_one_f_one_b_peak_below_gpipe():
    layers = [(0, 2), (2, 4)]
    peaks = {(s, g): _compiled_memory((2,), layers, g, s)[0] for s in ("1f1b", "gpipe") for g in (4, 8)}
    for g in (4, 8):  # G >= 2S
        assert peaks["1f1b", g] < peaks["gpipe", g]
    assert peaks["1f1b", 8] < 1.05 * peaks["1f1b", 4]  # 1F1B: flat in G
    assert peaks["gpipe", 8] > 1.5 * peaks["gpipe", 4]  # GPipe: grows with G


def test_per_stage_remat():
    """Remat on stage 0 only shrinks the pools stage 0 dominates and adds its recompute dots."""
    layers = [(0, 2), (2, 4)]
    peak0, temp0, dots0 = _compiled_memory((2,), layers, 4, "1f1b")
    peak1, temp1, dots1 = _compiled_memory((2,), layers, 4, "1f1b", remat=[2, 0])
    assert temp1 < 0.8 * temp0  # stage 0 keeps 2 micro-batches; with full remat only its inputs
    assert dots1 > dots0  # stage 0's backward branch recomputes its forward


def test_layer_residual_bytes_by_policy():
    w = jax.tree.map(lambda a: a[0], init_params(1)[1])
    h = jax.ShapeDtypeStruct((8, 4, 16), jnp.float32)
    full, dots, names, none = (layer_residual_bytes(block_fn, w, h, p)
                               for p in ("full", "dots", "names:act", None))
    assert full == h.size * 4  # only the layer input
    assert full < dots <= none and full < names < none


# --------------------------------------------------------------------------------------------- layout
def test_stage_layout_roundtrip():
    layers = [(0, 3), (3, 4), (4, 6), (6, 8)]
    stacked = {"a": jnp.arange(8 * 2.0).reshape(8, 2), "b": jnp.arange(8)}
    staged, mask = to_stage_layout(stacked, layers)
    assert staged["a"].shape == (4, 3, 2) and mask.shape == (4, 3)
    assert mask.sum(1).tolist() == [3, 1, 2, 2]
    assert staged["b"].tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0], [6, 7, 0]]
    back = from_stage_layout(staged, layers)
    jax.tree.map(np.testing.assert_array_equal, back, stacked)


def test_input_errors():
    with pytest.raises(ValueError, match="contiguous"):
        to_stage_layout({"a": jnp.zeros((4, 2))}, [(0, 2), (3, 4)])
    with pytest.raises(ValueError, match="remat policy"):
        remat_policy_fn("sometimes")
    mesh = make_mesh((2,))
    params = init_params(4)
    staged, _ = to_stage_layout(params[1], [(0, 2), (2, 4)])
    call = functools.partial(pipeline_value_and_grad, pre_fn, block_fn, post_fn, params[0], staged, params[2],
                             make_batch(2), mesh=mesh)
    with pytest.raises(ValueError, match="stages"):
        call(stage_layers=[(0, 1), (1, 2), (2, 4)])
    with pytest.raises(ValueError, match="remat_layers"):
        call(stage_layers=[(0, 2), (2, 4)], remat_layers=[3, 0])
    with pytest.raises(sch.ScheduleError, match="unknown"):
        call(stage_layers=[(0, 2), (2, 4)], schedule="zigzag")


# ------------------------------------------------------------------------------------- schedule tables
SIZES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 4), (3, 5), (4, 2), (4, 4), (4, 8), (4, 16), (8, 8)]


@pytest.mark.parametrize("num_stages,num_mb", SIZES)
def test_schedule_tables(num_stages, num_mb):
    S, G = num_stages, num_mb
    for name in sch.SCHEDULE_NAMES:
        sched = sch.make_schedule(name, S, G)
        counts = sch.check_schedule(sched)  # every F and B once, dependencies respected
        if name == "1f1b":
            np.testing.assert_array_equal(counts, np.minimum(S - np.arange(S), G))
            sch.check_schedule(sched, sch.inflight_microbatches(np.arange(S), S, G))
            assert sched.num_ticks == 2 * (G + S - 1)
            assert ((sched.fwd >= 0) & (sched.bwd >= 0)).sum() == 0  # one op per stage per tick
            for s in range(S):  # warm-up S-s-1 forwards, then one more before the first backward
                first_b = int(np.nonzero(sched.bwd[:, s] >= 0)[0][0])
                assert (sched.fwd[:first_b, s] >= 0).sum() == min(S - s, G)
        elif name == "gpipe":
            np.testing.assert_array_equal(counts, np.full(S, G))
        else:
            np.testing.assert_array_equal(counts, np.minimum(2 * (S - np.arange(S)) - 1, G))
            assert sched.num_ticks == G + 2 * S - 2
        # Textbook bubble (S-1)/(G+S-1) with equal F and B costs, for every table.
        assert ptime.bubble_fraction(S, G, name) == pytest.approx((S - 1) / (G + S - 1))
        _simulate(sched)


def test_lockstep_penalty_of_classic_1f1b():
    S, G = 4, 16
    gpipe = ptime.lockstep_time(sch.gpipe_schedule(S, G), 1.0, 2.0)
    assert gpipe == pytest.approx((G + S - 1) * 3.0)
    assert ptime.lockstep_time(sch.eager_one_f_one_b_schedule(S, G), 1.0, 2.0) == pytest.approx(gpipe)
    assert ptime.lockstep_time(sch.one_f_one_b_schedule(S, G), 1.0, 2.0) == pytest.approx(72.0)  # +26%
    assert ptime.bubble_fraction(S, G, "1f1b", 1.0, 2.0) > ptime.bubble_fraction(S, G, "gpipe", 1.0, 2.0)


def test_check_schedule_rejects_bad_tables():
    fwd, bwd = sch.one_f_one_b_schedule(3, 4)
    with pytest.raises(sch.ScheduleError, match="exactly once"):
        sch.check_schedule(sch.Schedule(np.where(fwd == 2, -1, fwd), bwd))
    swapped = fwd.copy()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]  # stage 1 runs before stage 0
    with pytest.raises(sch.ScheduleError, match="does not follow"):
        sch.check_schedule(sch.Schedule(swapped, bwd))
    with pytest.raises(sch.ScheduleError, match="holds"):
        sch.check_schedule(sch.gpipe_schedule(3, 4), sch.inflight_microbatches(np.arange(3), 3, 4))


def _simulate(sched: sch.Schedule) -> None:
    """Replay the tick program symbolically: every read must find the micro-batch it expects."""
    prog = ticks.tick_program(sched)
    t_, S = sched.fwd.shape
    res = [[None] * int(prog.residual_slots[s]) for s in range(S)]
    xq = [[None] * prog.input_slots for _ in range(S)]
    cq = [[None] * prog.cotangent_slots for _ in range(S)]
    for t in range(t_):
        row = prog.table[t]
        for s in range(S):
            f, b = row[s, ticks.F_MB], row[s, ticks.B_MB]
            if f >= 0:
                if s > 0:
                    assert xq[s][row[s, ticks.F_XSLOT]] == f
                res[s][row[s, ticks.F_RSLOT]] = f
                if s == S - 1:
                    cq[s][row[s, ticks.F_SEED]] = f
            if b >= 0:
                assert res[s][row[s, ticks.B_RSLOT]] == b and cq[s][row[s, ticks.B_CSLOT]] == b
        for s in range(S):  # messages land at the end of the tick
            if row[s, ticks.RX_SLOT] >= 0:
                assert row[s - 1, ticks.F_MB] >= 0
                xq[s][row[s, ticks.RX_SLOT]] = row[s - 1, ticks.F_MB]
            if row[s, ticks.RC_SLOT] >= 0:
                cq[s][row[s, ticks.RC_SLOT]] = row[s + 1, ticks.B_MB]
