"""The runtime applies every plan knob correctly: numerics, collectives, memory, errors."""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mistjax
import models
from mistjax.core import hlo
from mistjax.plan import Plan, PlanError, StagePlan, uniform_plan
from mistjax.train.data import SyntheticTokens
from mistjax.train.state import TrainState
from models import make_loss_fn

BATCH, SEQ, DEVICES = 16, 16, 8


@functools.cache
def setup(name: str, **changes):
    cfg = models.get_config(name).replace(**changes)
    state = TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1, momentum=0.9))
    loss_fn = make_loss_fn(state.graphdef)
    batch = SyntheticTokens(cfg.vocab_size, SEQ, BATCH, kind="random").batch(0)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(state.params, batch)

    def train_step(state, batch):
        loss, grads = mistjax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss, "grads": grads}

    return cfg, state, batch, train_step, float(ref_loss), ref_grads


@functools.cache
def loss_only_step(name: str):
    """A step whose metrics hold only the loss (returning grads would all-gather them)."""
    loss_fn = make_loss_fn(setup(name)[1].graphdef)

    def train_step(state, batch):
        loss, grads = mistjax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return train_step


def make_plan(cfg, *, tp=1, grad_accum=1, shard_group=0, **stage) -> Plan:
    dp = DEVICES // tp
    return uniform_plan(cfg.num_layers, DEVICES, tp=tp, grad_accum=grad_accum, shard_group=shard_group,
                        micro_batch=BATCH // (dp * grad_accum), **{"shard_opt": True, **stage})


def run(name: str, **knobs):
    cfg, state, batch, train_step, ref_loss, ref_grads = setup(name)
    step = mistjax.autoshard(train_step, jax.devices(), plan=make_plan(cfg, **knobs))
    _, metrics = step(jax.tree.map(jnp.copy, state), batch)
    return step, metrics, ref_loss, ref_grads


def assert_matches_reference(metrics, ref_loss, ref_grads):
    np.testing.assert_allclose(float(metrics["loss"]), ref_loss, rtol=2e-6)
    for g, r in zip(jax.tree.leaves(metrics["grads"]), jax.tree.leaves(ref_grads)):
        scale = float(jnp.max(jnp.abs(r)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=2e-5 * scale)


ZERO1 = dict(shard_opt=True)
ZERO2 = dict(shard_opt=True, shard_grads=True)
ZERO3 = dict(shard_opt=True, shard_grads=True, shard_weights=True)

SINGLE_KNOBS = {
    "dp": dict(shard_opt=False),
    "zero1": ZERO1,
    "zero2": ZERO2,
    "zero3": ZERO3,
    "mics": dict(ZERO3, shard_group=2),
    "tp_sp": dict(tp=2, shard_opt=False),
    "remat_full": dict(shard_opt=False, remat_layers=4),
    "remat_dots": dict(shard_opt=False, remat_layers=2, remat_policy="dots"),
    "remat_names": dict(shard_opt=False, remat_layers=3, remat_policy="names:mlp_in,attn_out"),
    "accum": dict(shard_opt=False, grad_accum=2),
}

COMBOS = [
    ("gpt3-tiny", dict(ZERO3, tp=2, grad_accum=2, remat_layers=2)),
    ("gpt3-tiny", dict(ZERO2, shard_group=2, grad_accum=2)),
    ("gpt3-tiny", dict(ZERO1, tp=4, remat_layers=1, remat_policy="dots")),
    ("falcon-tiny", dict(ZERO3, tp=2, shard_group=2, grad_accum=2, remat_layers=2,
                         remat_policy="names:qkv_proj")),
    ("falcon-tiny", dict(ZERO2, grad_accum=2, remat_layers=4)),
    ("falcon-tiny", dict(ZERO1, tp=8)),
    ("llama-tiny", dict(ZERO3, tp=2, shard_group=2, grad_accum=2, remat_layers=2)),
    ("llama-tiny", dict(ZERO2, tp=4, grad_accum=2)),
    ("llama-tiny", dict(ZERO3, grad_accum=2, remat_layers=3, remat_policy="dots")),
    ("llama-tiny", dict(ZERO1, shard_group=4, remat_layers=1)),
]


@pytest.mark.parametrize("knob", list(SINGLE_KNOBS))
def test_single_knob_matches_single_device(knob):
    _, metrics, ref_loss, ref_grads = run("llama-tiny", **SINGLE_KNOBS[knob])
    assert_matches_reference(metrics, ref_loss, ref_grads)


SLOW_COMBOS = {1, 2, 4, 5, 6, 7, 8}  # one combination per family (and ZeRO-1 + MiCS) stays by default; -m slow


@pytest.mark.parametrize("name,knobs", [
    pytest.param(*c, id=f"{c[0]}-{i}", marks=pytest.mark.slow if i in SLOW_COMBOS else ())
    for i, c in enumerate(COMBOS)])
def test_combination_matches_single_device(name, knobs):
    _, metrics, ref_loss, ref_grads = run(name, **knobs)
    assert_matches_reference(metrics, ref_loss, ref_grads)


def compiled(name: str, mesh=None, **knobs):
    cfg, state, batch, *_ = setup(name)
    train_step = loss_only_step(name)
    step = mistjax.autoshard(train_step, mesh or jax.devices(), plan=make_plan(cfg, **knobs))
    return step, step.lower(state, batch).compile()


def test_zero2_reduce_scatters_gradients():
    _, c0 = compiled("llama-tiny", **ZERO1)
    _, c2 = compiled("llama-tiny", **ZERO2)
    ops0 = {c.op for c in hlo.collectives(c0.as_text())}
    ops2 = [c for c in hlo.collectives(c2.as_text()) if c.op == "reduce-scatter"]
    assert ops2 and all(c.group_size == DEVICES for c in ops2)
    # ZeRO-1 reduce-scatters once at the end of the step; ZeRO-2 once per micro-batch inside the loop.
    assert "reduce-scatter" in ops0


def test_zero3_gathers_one_layer_at_a_time():
    _, c = compiled("llama-tiny", **ZERO3)
    gathers = [x for x in hlo.collectives(c.as_text()) if x.op == "all-gather"]
    params = setup("llama-tiny")[1].params
    layer_bytes = {int(np.prod(x.shape[1:])) * 4 for x in jax.tree.leaves(params["layers"])}
    other_bytes = {x.size * 4 for k, v in params.items() if k != "layers" for x in jax.tree.leaves(v)}
    in_loop = [g for g in gathers if not g.computation.startswith("main")]
    at_top = [g for g in gathers if g.computation.startswith("main")]
    assert {g.result_bytes for g in in_loop} == layer_bytes, "each stacked parameter is gathered per layer"
    assert {g.result_bytes for g in at_top} <= other_bytes, "a whole layer stack was gathered at once"
    # XLA:CPU issues one all-gather per leaf (no combiner), as `cost.stage_time.leaf_ops` charges the latency:
    # each loop body gathers every stacked leaf a whole number of times (XLA may unroll it), the top every
    # other leaf once.
    from mistjax.cost.stage_time import leaf_ops
    from mistjax.hardware import ClusterSpec
    from mistjax.validate.check import workload_for

    ops = leaf_ops(workload_for("llama-tiny", SEQ, BATCH), ClusterSpec.preset("cpu"))
    n_stacked = len(jax.tree.leaves(params["layers"]))
    assert (ops.stacked, ops.other) == (n_stacked, len(jax.tree.leaves(params)) - n_stacked)
    bodies = collections.Counter(g.computation for g in in_loop)
    assert bodies and all(n % n_stacked == 0 for n in bodies.values()), bodies
    assert len(at_top) == ops.other


def test_mics_two_hop_sync():
    p = 2
    _, c = compiled("llama-tiny", **dict(ZERO2, shard_group=p, grad_accum=2))
    colls = hlo.collectives(c.as_text())
    rs = [x for x in colls if x.op == "reduce-scatter"]
    assert rs and all(x.group_size == p for x in rs), "hop 1 must stay inside groups of p"
    cross = [x for x in colls if x.op == "all-reduce" and x.group_size == DEVICES // p and x.result_bytes > 64]
    assert len(cross) == 1, f"expected exactly one cross-group all-reduce, got {len(cross)}"
    n_params = sum(x.size for x in jax.tree.leaves(setup("llama-tiny")[1].params))
    assert cross[0].result_bytes == pytest.approx(4 * n_params / p, rel=0.02)
    assert cross[0].computation.startswith("main") or "while" not in cross[0].computation


def test_zero3_parameters_take_one_nth_of_memory():
    _, c0 = compiled("gpt3-tiny", shard_opt=False)
    _, c3 = compiled("gpt3-tiny", **ZERO3)
    a0, a3 = hlo.memory_stats(c0)["argument"], hlo.memory_stats(c3)["argument"]
    assert a3 < 0.16 * a0, (a0, a3)


def test_remat_lowers_temporary_memory():
    _, c0 = compiled("gpt3-tiny", shard_opt=False)
    _, c4 = compiled("gpt3-tiny", shard_opt=False, remat_layers=4)
    # The lean layer (norms and activations recomputed by the model itself) keeps so little that the tiny
    # model's temp peak sits elsewhere: remat must not add to it, and must recompute the layer's matmuls.
    assert hlo.memory_stats(c4)["temp"] <= hlo.memory_stats(c0)["temp"]
    dots = [len(re.findall(r"= \S+ dot\(", c.as_text())) for c in (c0, c4)]
    assert dots[1] > dots[0], dots


def test_zero3_plain_layers_regather_in_backward():
    """Without remat, each layer's weights are gathered in the forward loop and again in the backward
    loop (the re-fetching custom VJP), and the backward keeps no gathered weights: ZeRO-3 holds
    less temporary memory than ZeRO-2 (which has the same residuals but full-size gradients)."""
    from mistjax.core.hlo import collective_bytes
    from mistjax.core.hlo import collectives as hlo_collectives

    _, c3 = compiled("llama-tiny", **ZERO3)
    params = setup("llama-tiny")[1].params
    stacked = jax.tree.leaves(params["layers"])
    num_layers = stacked[0].shape[0]
    layer = sum(int(np.prod(x.shape[1:])) * 4 for x in stacked)  # one layer's gathered fp32 weights
    other = sum(x.size * 4 for k, v in params.items() if k != "layers" for x in jax.tree.leaves(v))
    text = c3.as_text()
    assert collective_bytes(text, executed=True)["all-gather"] == 2 * num_layers * layer + other
    loops = {g.computation for g in hlo_collectives(text)
             if g.op == "all-gather" and not g.computation.startswith("main")}
    assert len(loops) == 2, f"layer gathers in the forward and the backward loop, got {loops}"

    _, c2 = compiled("llama-tiny", **ZERO2)
    t2, t3 = hlo.memory_stats(c2)["temp"], hlo.memory_stats(c3)["temp"]
    full_grads = sum(x.size * 4 for x in jax.tree.leaves(params))
    # ZeRO-3 over ZeRO-2: + one fetched layer (XLA:CPU runs no double buffer: `Capabilities.double_buffers_fetches`) +
    # the gathered embedding / head, - the full-size gradients it never holds (reduce-scattered per layer).
    expected = t2 + layer + other - (full_grads - full_grads // DEVICES)
    # Plain layers keeping their gathered weights as residuals (the old runtime) added ~num_layers * layer.
    assert t3 < expected + 0.25 * num_layers * layer, (t3, expected, layer)


def test_layer_loop_double_buffers_fetches_only_where_they_overlap(monkeypatch):
    """Two layers per loop iteration (layer i+1's gather under layer i's compute) only on platforms with
    asynchronous collectives; on XLA:CPU each iteration gathers one layer, and the step holds less. Both
    loops compute the reference gradients."""
    from types import SimpleNamespace

    from mistjax.core.execution import Capabilities
    from mistjax.runtime import grads as runtime_grads

    def gpu_like(platform):
        return SimpleNamespace(devices=np.array([SimpleNamespace(platform=platform)]))

    assert runtime_grads.mesh_capabilities(gpu_like("gpu")).double_buffers_fetches
    assert not runtime_grads.mesh_capabilities(gpu_like("cpu")).double_buffers_fetches
    n_stacked = len(jax.tree.leaves(setup("llama-tiny")[1].params["layers"]))

    def per_body_gathers(c):
        bodies = collections.Counter(g.computation for g in hlo.collectives(c.as_text())
                                     if g.op == "all-gather" and not g.computation.startswith("main"))
        return set(bodies.values())

    _, single = compiled("llama-tiny", **ZERO3)  # its numerics: test_single_knob_matches_single_device
    monkeypatch.setattr(runtime_grads, "mesh_capabilities", lambda mesh, tp_overlap=False:
                        Capabilities(True, tp_overlap))
    _, double = compiled("llama-tiny", **ZERO3)
    _, metrics, ref_loss, ref_grads = run("llama-tiny", **ZERO3)
    assert_matches_reference(metrics, ref_loss, ref_grads)
    assert per_body_gathers(single) == {n_stacked}, per_body_gathers(single)
    assert per_body_gathers(double) == {2 * n_stacked}, per_body_gathers(double)
    assert hlo.memory_stats(single)["temp"] < hlo.memory_stats(double)["temp"]


def test_double_buffered_odd_segment_keeps_one_copy_of_its_residuals():
    """An odd segment under the double buffer runs its last layer as its own scan: ``lax.scan`` with an
    unroll that does not divide the length would concatenate the remainder's residuals onto the loop's
    (a second copy of every stacked residual at the end of the forward). The gradients stay autodiff's."""
    from mistjax.core.execution import layer_scans
    from mistjax.runtime.remat import LayerLoop

    L, B, D = 5, 4, 32
    k = jax.random.split(jax.random.key(1), 3)
    h0, ws = jax.random.normal(k[0], (B, D)), jax.random.normal(k[1], (L, D, D)) / 4

    def body(consts, c, x):
        return [jnp.tanh(c[0] @ x[0])], []

    def loss(h0, ws, double_buffer):
        loop = LayerLoop(scans=layer_scans(L, 0, 0, double_buffer), policy="full", gather=(lambda w: w * 1.0,))
        c, _ = loop(body, [], [h0], [ws])
        return jnp.sum(c[0] ** 2)

    grads = {db: jax.jit(jax.grad(functools.partial(loss, double_buffer=db), argnums=(0, 1)))(h0, ws)
             for db in (False, True)}
    for a, b in zip(grads[False], grads[True]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    text = jax.jit(jax.grad(functools.partial(loss, double_buffer=True), argnums=(0, 1))).lower(h0, ws).as_text()
    stacked = [ln for ln in text.splitlines() if "concatenate" in ln and f"tensor<{L}x{B}x{D}x" in ln]
    assert not stacked, stacked


def test_refetching_layer_loop_matches_autodiff():
    """A `LayerLoop` with a gather: consts / carry / stored-shard gradients equal plain autodiff's
    (the gather's transpose reduce-scatters), no residual is a gathered weight, and without a
    gather the loop stays a plain function (no custom VJP)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from mistjax.core.execution import layer_scans
    from mistjax.runtime.remat import LayerLoop

    L, B, D = 4, 3, 16
    k = jax.random.split(jax.random.key(0), 4)
    scale, h0 = jnp.float32(0.7), jax.random.normal(k[0], (B, D))
    ws, bs = jax.random.normal(k[1], (L, D, D)) / 4, jax.random.normal(k[2], (L, D))

    def body(consts, c, x):
        h = jnp.tanh(c[0] @ x[0] * consts[0]) + x[1]
        return [h], [jnp.sum(h * h)]

    def loss(scale, h0, ws, bs, gather, remat):
        fetches = any(g is not None for g in gather)  # double-buffered where it fetches, as on a GPU
        loop = LayerLoop(scans=layer_scans(L, remat, 0, fetches), policy="full", gather=tuple(gather))
        c, ys = loop(body, [scale], [h0], [ws, bs])
        return jnp.sum(c[0] ** 3) + jnp.sum(ys[0])

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    ref = grad(scale, h0, ws, bs, [None, None], 0)
    assert "custom_vjp" not in str(jax.make_jaxpr(functools.partial(loss, gather=[None, None], remat=0))(
        scale, h0, ws, bs))
    gather = [lambda x: jax.lax.all_gather(x, "shard", axis=0, tiled=True), None]
    residual_shapes = []

    def sharded(scale, h0, ws_local, bs):
        fn = functools.partial(loss, gather=gather, remat=1)
        residual_shapes.extend(x.shape for x in jax.tree.leaves(jax.vjp(fn, scale, h0, ws_local, bs)[1]))
        g = grad(scale, h0, ws_local, bs, gather, 1)
        return g[0], g[1], g[2] / DEVICES, g[3]  # each device computed the same loss: the scatter summed 8

    mesh = Mesh(np.array(jax.devices()), ("shard",))
    fn = jax.jit(jax.shard_map(sharded, mesh=mesh, in_specs=(P(), P(), P(None, "shard"), P()),
                               out_specs=(P(), P(), P(None, "shard"), P()), check_vma=False))
    for g, r in zip(fn(scale, h0, ws, bs), ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    # The plain layers keep their stored shards [L - 1, D / 8, D], never gathered weights (or views).
    assert not [s for s in residual_shapes if s[-2:] == (D, D)], residual_shapes
    assert (L - 1, D // DEVICES, D) in residual_shapes


def test_nearly_all_parameters_sharded():
    step, _ = compiled("falcon-tiny", **ZERO3)
    from mistjax.core.layout import unsharded_fraction

    assert unsharded_fraction(step.layouts) <= 0.02


# ---------------------------------------------------------------- MiCS groups spanning nodes
INTER = "{{0,4},{1,5},{2,6},{3,7}}"  # equal local rank on the 2 nodes of 4
INTRA = "{{0,1,2,3},{4,5,6,7}}"  # one node


def node_mesh():
    """2 nodes x 4 devices; the leading ``node`` axis tells the runtime where node boundaries are
    (make_mesh gives Explicit axis types here; the runtime only reads the devices and names)."""
    return jax.make_mesh((2, 4), ("node", "gpu"))


def run_on_nodes(name: str, **knobs) -> None:
    """Loss, gradients and the optimizer's updated parameters equal the single-device reference."""
    cfg, state, batch, train_step, ref_loss, ref_grads = setup(name)
    step = mistjax.autoshard(train_step, node_mesh(), plan=make_plan(cfg, **knobs))
    new_state, metrics = step(jax.tree.map(jnp.copy, state), batch)
    assert_matches_reference(metrics, ref_loss, ref_grads)
    ref_state = jax.jit(lambda s: s.apply_gradients(ref_grads))(state)
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def layer_weight_bytes(name: str) -> set[int]:
    return {int(np.prod(x.shape[1:])) * 4 for x in jax.tree.leaves(setup(name)[1].params["layers"])}


def test_shard_axes_split_at_node_boundaries():
    from mistjax.runtime.mesh import build_plan_mesh

    cfg = models.get_config("llama-tiny")
    shape = lambda mesh, **k: tuple(build_plan_mesh(mesh, make_plan(cfg, **k)).shape.values())  # noqa: E731
    # (stage, replica, shard_node, shard_local, context, tensor)
    assert shape(node_mesh(), **ZERO3) == (1, 1, 2, 4, 1, 1)  # 8 = 2 nodes x 4
    assert shape(node_mesh(), **ZERO3, tp=2) == (1, 1, 2, 2, 1, 2)  # 4 x tp 2 = 2 nodes x (2 x tp 2)
    assert shape(node_mesh(), **ZERO3, shard_group=4) == (1, 2, 1, 4, 1, 1)  # one node: flat
    assert shape(jax.devices(), **ZERO3) == (1, 1, 1, 8, 1, 1)  # no node level known: flat
    assert make_plan(cfg, **ZERO3).mesh_shape == {"stage": 1, "replica": 1, "shard": 8, "context": 1, "tensor": 1}


@pytest.mark.parametrize("dim", [0, 1])
def test_hierarchical_collectives_equal_flat_ones(dim):
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from mistjax.runtime.grads import shard_all_gather, shard_psum_scatter
    from mistjax.runtime.mesh import SHARD_AXES, SHARD_SPEC

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), SHARD_AXES)
    x = jax.random.normal(jax.random.key(0), (8, 16, 24))  # [device, ...]: one full buffer per device
    spec = P(*([None] * dim + [SHARD_SPEC]))

    def both(local_x, full):
        return (shard_all_gather(local_x, dim), jax.lax.all_gather(local_x, SHARD_SPEC, axis=dim, tiled=True),
                shard_psum_scatter(full[0], dim),
                jax.lax.psum_scatter(full[0], SHARD_SPEC, scatter_dimension=dim, tiled=True))

    fn = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(spec, P(SHARD_AXES)), out_specs=(P(), P(), spec, spec),
                               check_vma=False))
    hier_ag, flat_ag, hier_rs, flat_rs = fn(x[0], x)
    np.testing.assert_array_equal(hier_ag, flat_ag)
    np.testing.assert_allclose(hier_rs, flat_rs, rtol=1e-6, atol=1e-6)
    colls = hlo.collectives(fn.lower(x[0], x).compile().as_text())
    ag = [(c.groups, c.result_bytes) for c in colls if c.op == "all-gather" and c.group_size != 8]
    full = 16 * 24 * 4
    assert ag == [(INTER, full // 4), (INTRA, full)]  # inter-node on 1/p chunks first, then intra-node
    rs = [(c.groups, c.result_bytes) for c in colls if c.op == "reduce-scatter" and c.group_size != 8]
    assert rs == [(INTRA, full // 4), (INTER, full // 8)]  # intra-node on the whole buffer first


def test_zero3_across_nodes_gathers_hierarchically():
    run_on_nodes("llama-tiny", **ZERO3)
    _, c = compiled("llama-tiny", node_mesh(), **ZERO3)
    colls = hlo.collectives(c.as_text())
    assert not [x for x in colls if x.op in ("all-gather", "reduce-scatter") and x.group_size == DEVICES]
    full = layer_weight_bytes("llama-tiny")
    in_loop = [x for x in colls if not x.computation.startswith("main")]
    by = lambda op, groups: [x.result_bytes for x in in_loop if x.op == op and x.groups == groups]  # noqa: E731
    # Per layer weight: inter-node gather of the 1/8 chunks (result 1/4), then intra-node (result whole) ...
    assert {4 * b for b in by("all-gather", INTER)} == full and set(by("all-gather", INTRA)) == full
    assert len(by("all-gather", INTER)) == len(by("all-gather", INTRA))
    # ... and autodiff's reduce-scatter mirrors it: intra-node on the whole gradient, inter-node on 1/4.
    assert {4 * b for b in by("reduce-scatter", INTRA)} == full and {8 * b for b in by("reduce-scatter", INTER)} == full
    assert len(by("reduce-scatter", INTER)) == len(by("reduce-scatter", INTRA))


def test_zero2_across_nodes_reduce_scatters_hierarchically():
    knobs = dict(ZERO2, grad_accum=2)
    run_on_nodes("llama-tiny", **knobs)
    _, c = compiled("llama-tiny", node_mesh(), **knobs)
    colls = hlo.collectives(c.as_text())
    rs = [x for x in colls if x.op == "reduce-scatter"]
    assert rs and {x.groups for x in rs} == {INTRA, INTER}
    assert sum(x.groups == INTRA for x in rs) == sum(x.groups == INTER for x in rs)
    assert all(not x.computation.startswith("main") for x in rs), "ZeRO-2 scatters every micro-batch"
    # The updated parameters are re-gathered hierarchically too (not by one flat GSPMD all-gather).
    ag = [x for x in colls if x.op == "all-gather"]
    assert ag and {x.groups for x in ag} == {INTER, INTRA}


def test_mics_group_inside_a_node_is_unchanged():
    knobs = dict(ZERO3, shard_group=4)
    run_on_nodes("llama-tiny", **knobs)
    key = lambda c: sorted((x.op, x.groups, x.result_bytes) for x in hlo.collectives(c.as_text()))  # noqa: E731
    on_nodes, flat = key(compiled("llama-tiny", node_mesh(), **knobs)[1]), key(compiled("llama-tiny", **knobs)[1])
    assert on_nodes == flat
    assert {g for op, g, _ in on_nodes if op in ("all-gather", "reduce-scatter")} == {INTRA}


def test_hlo_reads_mesh_replica_groups():
    line = "x = f32[8]{0} all-gather(f32[1]{0} y), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, d={0}"
    assert hlo.collectives(line)[0].group_size == 4
    assert hlo.replica_group_size("replica_groups=mesh['a'=2,'b'=4] {'a','b'}") == 8
    assert hlo.replica_group_size("replica_groups=mesh['a'=8], device_ids=([0,2,4,6,1,3,5,7]) {'a':(2)4}") == 4


# ---------------------------------------------------------------- validation errors
def test_device_count_mismatch():
    cfg, state, batch, train_step, *_ = setup("llama-tiny")
    plan = uniform_plan(cfg.num_layers, 4, micro_batch=4, shard_opt=True)
    with pytest.raises(PlanError, match="needs 4 devices .* mesh has 8"):
        mistjax.autoshard(train_step, jax.devices(), plan=plan)


def test_shard_group_must_divide_dp():
    with pytest.raises(PlanError, match="shard_group=3 must divide dp=8"):
        uniform_plan(4, 8, shard_group=3, shard_opt=True)


def test_tp_must_divide_heads():
    """Key / value heads the degree does not divide are replicated (tests/test_awkward_shapes.py); the query
    heads must split."""
    cfg, state, batch, train_step, *_ = setup("llama-tiny", num_heads=4, num_kv_heads=4)
    step = mistjax.autoshard(train_step, jax.devices(), plan=make_plan(cfg, tp=8))
    with pytest.raises(PlanError, match=r"tensor parallelism 8 does not divide dim \d \(heads=4\)"):
        step(state, batch)


def test_batch_not_divisible():
    cfg, state, batch, train_step, *_ = setup("llama-tiny")
    step = mistjax.autoshard(train_step, jax.devices(), plan=make_plan(cfg, grad_accum=1))
    small = {k: v[:12] for k, v in batch.items()}
    with pytest.raises(PlanError, match="global batch 12 != micro_batch 2 x dp 8"):
        step(state, small)


def test_offload_ratio_out_of_range():
    with pytest.raises(PlanError, match=r"offload_opt=1.5 is outside \[0, 1\]"):
        StagePlan(layers=(0, 4), offload_opt=1.5).validate()


def test_unknown_remat_policy():
    with pytest.raises(PlanError, match="unknown remat policy 'most'"):
        StagePlan(layers=(0, 4), remat_layers=1, remat_policy="most").validate()


def test_plan_for_other_model_refused():
    cfg, state, batch, train_step, *_ = setup("llama-tiny")
    step = mistjax.autoshard(train_step, jax.devices(), plan=uniform_plan(6, 8, micro_batch=2, shard_opt=True))
    with pytest.raises(PlanError, match="cover 6 layers but the model has 4"):
        step(state, batch)


def test_plan_json_round_trip_and_bad_files(tmp_path):
    plan = make_plan(models.get_config("llama-tiny"), **dict(ZERO3, tp=2, grad_accum=2, remat_layers=1))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    path.write_text(plan.to_json()[:40])
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(path)
    path.write_text(plan.to_json().replace('"schema_version": 1', '"schema_version": 99'))
    with pytest.raises(PlanError, match="schema version 99 is not supported"):
        Plan.load(path)


OFFLOAD_KNOBS = {
    "offload_opt": dict(ZERO1, offload_opt=0.5),
    "offload_weights": dict(ZERO3, offload_weights=1.0, grad_accum=2),
    "offload_grads": dict(ZERO1, offload_grads=1.0, grad_accum=2),
    "offload_acts": dict(ZERO1, offload_acts=0.5),
    "offload_all": dict(ZERO3, tp=2, offload_opt=1.0, offload_weights=0.5, offload_grads=0.5, offload_acts=1.0,
                        grad_accum=2, remat_layers=1),
}


@pytest.mark.parametrize("knob", list(OFFLOAD_KNOBS))
def test_offload_matches_single_device(knob):
    _, metrics, ref_loss, ref_grads = run("gpt3-tiny", **OFFLOAD_KNOBS[knob])
    assert_matches_reference(metrics, ref_loss, ref_grads)


def test_offloaded_state_lives_in_host_memory():
    step, c = compiled("gpt3-tiny", **dict(ZERO1, offload_opt=1.0, offload_weights=1.0))
    host = [lay for lay in step.layouts if lay.host]
    assert any(lay.role == "opt" for lay in host) and any(lay.role == "param" for lay in host)
    # Every host-resident state leaf is an S(5) (host memory space) entry parameter of the program.
    assert hlo.host_placed_params(c.as_text()) >= len(host)
    placed = step.place(setup("gpt3-tiny")[1], setup("gpt3-tiny")[2])
    kinds = {x.sharding.memory_kind for x, lay in zip(jax.tree.leaves(placed), step.layouts) if lay.host}
    assert kinds == {"pinned_host"}


def test_offload_selection_fraction():
    from mistjax.core.layout import select_offload

    sizes = [100, 50, 30, 20]
    assert select_offload(sizes, 0.0) == [False] * 4
    assert select_offload(sizes, 1.0) == [True] * 4
    chosen = select_offload(sizes, 0.5)
    assert sum(s for s, c in zip(sizes, chosen) if c) == 100


def test_plan_for_other_model_fingerprint_refused():
    from mistjax.plan import params_fingerprint

    cfg, state, batch, train_step, *_ = setup("llama-tiny")
    other = setup("gpt3-tiny")[1]
    plan = make_plan(cfg).replace(fingerprints={"model": params_fingerprint(other.params)})
    with pytest.raises(PlanError, match="made for another model"):
        mistjax.autoshard(train_step, jax.devices(), plan=plan)(state, batch)
    ok = make_plan(cfg).replace(fingerprints={"model": params_fingerprint(state.params)})
    mistjax.autoshard(train_step, jax.devices(), plan=ok).lower(state, batch)
