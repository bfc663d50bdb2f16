"""Numeric cost-model building blocks: collectives, interference, pipeline time, op roofline."""

import numpy as np
import pytest

from mistjax import cost
from mistjax.cost import InterferenceParams, OpTimeTable, overlap_time
from mistjax.hardware import ClusterSpec
from mistjax.hardware.interference import MASKS, NUM_FACTORS

RNG = np.random.default_rng(1234)
LINK = (1e9, 1e-5)  # 1 GB/s, 10 us per step

# -- collectives ---------------------------------------------------------------------------------


def test_ring_collectives_by_hand():
    n, p = 8e6, 8
    assert cost.all_gather_time(n, p, LINK) == pytest.approx(7e-5 + 7 / 8 * 8e-3)
    assert cost.reduce_scatter_time(n, p, LINK) == pytest.approx(7e-5 + 7e-3)
    assert cost.all_reduce_time(n, p, LINK) == pytest.approx(2 * (7e-5 + 7e-3))
    assert cost.all_to_all_time(n, p, LINK) == pytest.approx(7e-5 + 7e-3)
    # Mist's fitted form: phi * (bytes/k * (n-1)/n + b)
    base = 8e6 / 1e9 * 7 / 8 + 1e-5
    assert cost.all_gather_time(n, p, LINK, model="mist") == pytest.approx(base)
    assert cost.reduce_scatter_time(n, p, LINK, model="mist") == pytest.approx(1.1 * base)
    assert cost.all_reduce_time(n, p, LINK, model="mist") == pytest.approx(2.1 * base)


def test_collectives_issued_per_leaf_pay_the_latency_each():
    n, p, lat = 8e6, 8, LINK[1]
    assert cost.all_gather_time(n, p, LINK, ops=9) - cost.all_gather_time(n, p, LINK) == pytest.approx(8 * 7 * lat)
    assert cost.all_reduce_time(n, p, LINK, ops=3) - cost.all_reduce_time(n, p, LINK) == pytest.approx(2 * 2 * 7 * lat)
    extra = cost.hierarchical_reduce_scatter_time(n, 4, 2, LINK, LINK, ops=5) - cost.hierarchical_reduce_scatter_time(
        n, 4, 2, LINK, LINK)
    assert extra == pytest.approx(4 * (3 + 1) * lat)


def test_uncombined_collectives_price_zero3_not_dp():
    """On XLA:CPU (no all-gather / reduce-scatter combiner) ZeRO-3's per-leaf gathers each pay the latency;
    data parallelism's all-reduces are combined on every platform, so its time does not change."""
    import dataclasses

    import models
    from mistjax.cost import predict
    from mistjax.plan import uniform_plan

    wl = models.workload(models.get_config("llama-tiny"), 16, 16)
    cpu = ClusterSpec.preset("cpu")
    combined = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, combines_collectives=True))
    assert not cpu.device.combines_collectives
    dp = uniform_plan(wl.num_layers, 8, micro_batch=2, shard_opt=False)
    z3 = uniform_plan(wl.num_layers, 8, micro_batch=2, shard_opt=True, shard_grads=True, shard_weights=True)
    assert predict(wl, dp, cpu).step_time == pytest.approx(predict(wl, dp, combined).step_time, rel=1e-12)
    assert predict(wl, z3, cpu).step_time > predict(wl, z3, combined).step_time


def test_collectives_trivial_cases_and_errors():
    assert cost.all_reduce_time(1e9, 1, LINK) == 0.0
    assert cost.all_gather_time(0.0, 8, LINK) == 0.0
    assert cost.all_reduce_time(0.0, 8, LINK, model="mist") == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        cost.collective_time("broadcast", 1.0, 2, LINK)
    with pytest.raises(ValueError, match="cost model"):
        cost.all_gather_time(1.0, 2, LINK, model="tree")
    with pytest.raises(TypeError):
        cost.all_gather_time(1.0, 2, 5.0)


def test_collectives_broadcast_and_accept_link_models():
    n = np.array([[1e6], [1e7], [1e8]])
    p = np.array([1, 2, 4, 8])
    t = cost.all_gather_time(n, p, LINK)
    assert t.shape == (3, 4)
    assert np.all(t[:, 0] == 0) and np.all(np.diff(t, axis=1) > 0)
    link = ClusterSpec.preset("a100-40gb").collective_link(8)
    bw = np.full(4, link.bandwidth)
    as_pair = cost.all_reduce_time(1e8, 8, (bw, link.latency))
    np.testing.assert_allclose(as_pair, cost.all_reduce_time(1e8, 8, link))


def test_hierarchical_equals_flat_within_one_node():
    n = RNG.uniform(1e5, 1e9, 100)
    k = RNG.choice([1, 2, 4, 8], 100)
    intra, inter = (RNG.uniform(1e10, 3e11, 100), 3e-6), (RNG.uniform(1e9, 5e10, 100), 3e-5)
    np.testing.assert_allclose(
        cost.hierarchical_all_gather_time(n, k, 1, intra, inter), cost.all_gather_time(n, k, intra)
    )
    np.testing.assert_allclose(
        cost.hierarchical_reduce_scatter_time(n, k, 1, intra, inter), cost.reduce_scatter_time(n, k, intra)
    )
    # one device per node: only the inter-node ring is left
    np.testing.assert_allclose(
        cost.hierarchical_all_gather_time(n, 1, 4, intra, inter), cost.all_gather_time(n, 4, inter)
    )


def test_hierarchical_by_hand_and_cheaper_than_flat():
    n, k, m = 1.6e7, 8, 2
    intra, inter = (100e9, 2e-6), (10e9, 3e-5)
    expect = (1 * 3e-5 + 0.5 * n / 10e9) + (7 * 2e-6 + 7 / 8 * n / 100e9)
    assert cost.hierarchical_all_gather_time(n, k, m, intra, inter) == pytest.approx(expect)
    assert cost.hierarchical_reduce_scatter_time(n, k, m, intra, inter) == pytest.approx(expect)
    flat = cost.all_gather_time(n, k * m, inter)  # the flat ring's bus bandwidth is the inter link
    assert flat == pytest.approx(15 * 3e-5 + 15 / 16 * n / 10e9)
    assert expect < flat


def test_all_reduce_over_nodes_takes_the_faster_of_ring_and_tree_latency():
    """NCCL's latency model: a ring of p = k m devices steps 2 (p - 1) times, 2 (m - 1) of them across nodes; a
    tree chains the k devices of a node and spans the m nodes in ceil(log2 m) levels, up and down. The bytes
    move at the group link's ring rate either way; within one node it is the flat ring."""
    intra, inter = (400e9, 2e-6), (400e9, 8e-6)
    n = 1e6
    rate = lambda p: 2 * (p - 1) / p * n / 400e9  # noqa: E731
    assert cost.hierarchical_all_reduce_time(n, 8, 1, intra, inter) == pytest.approx(
        cost.all_reduce_time(n, 8, intra))
    # 2 nodes of 8: ring 2 (14 x 2 + 1 x 8) us = 72 us, tree 2 (7 x 2 + 1 x 8) us = 44 us
    assert cost.hierarchical_all_reduce_time(n, 8, 2, intra, inter) == pytest.approx(rate(16) + 44e-6)
    # 128 nodes of 8: ring 2 (896 x 2 + 127 x 8) us = 5.6 ms, tree 2 (7 x 2 + 7 x 8) us = 140 us; a flat ring
    # at the inter-node latency on every hop was 16.4 ms
    t = cost.hierarchical_all_reduce_time(n, 8, 128, intra, inter)
    assert t == pytest.approx(rate(1024) + 140e-6)
    assert cost.all_reduce_time(n, 1024, inter) - rate(1024) == pytest.approx(2 * 1023 * 8e-6)
    # one device per node: the ring crosses nodes at every step, the tree still wins
    assert cost.hierarchical_all_reduce_time(n, 1, 4, intra, inter) == pytest.approx(rate(4) + 2 * 2 * 8e-6)
    assert cost.hierarchical_all_reduce_time(0.0, 8, 4, intra, inter) == 0.0
    assert cost.hierarchical_all_reduce_time(n, 1, 1, intra, inter) == 0.0


def test_a_strided_group_touches_at_most_one_node_per_member():
    from mistjax.cost.stage_time import _group_link

    cluster = ClusterSpec.preset("dgx-h100", 64, 8)
    for group, stride, k, m in ((16, 1, 8, 2), (16, 4, 2, 8), (16, 64, 1, 16), (1, 128, 1, 1), (8, 8, 1, 8)):
        gk, gm, _, _ = _group_link(cluster, np.array([group]), np.array([stride]), np.array([8]))
        assert (gk[0], gm[0]) == (k, m), (group, stride)


def test_mics_example_traffic():
    """mics.md section 4: N = 64, p = k = 8, bf16 (Pb = G): ZeRO-3 ~2.95 G s vs MiCS 1.75 G."""
    g = 1.0
    z3 = cost.zero3_node_egress_bytes(g, g, 64, 8, accum_steps=8)
    mics = cost.mics_node_egress_bytes(g, g, 8, 64, 8, accum_steps=8)
    assert z3 == pytest.approx(8 * 3 * 63 / 64)
    assert mics == pytest.approx(1.75)
    assert mics < z3 and z3 / mics == pytest.approx(13.5, rel=0.01)
    assert cost.zero3_node_egress_bytes(g, g, 64, 8, 1) / cost.mics_node_egress_bytes(g, g, 8, 64, 8, 1) == (
        pytest.approx(1.69, rel=0.01)
    )
    # gradient-only at s = 1 MiCS moves more (1.75 G vs 0.98 G), as the digest notes
    assert cost.mics_node_egress_bytes(0, g, 8, 64, 8, 1) > cost.zero3_node_egress_bytes(0, g, 64, 8, 1)
    # a partition group spanning 2 nodes: hop 1 leaves the node, (m-1)/m per collective
    two = cost.mics_node_egress_bytes(g, g, 16, 64, 8, accum_steps=1)
    assert two == pytest.approx(3 * 0.5 + 8 * 2 * (3 / 4) / 16)
    assert cost.mics_node_egress_bytes(g, g, 8, 8, 8, 4) == 0.0  # a single node sends nothing


def test_mics_times_on_a_cluster():
    c = ClusterSpec.preset("a100-40gb", nodes=8)
    pb = g = 2 * 7e9  # 7B params, bf16
    z3 = cost.zero3_step_comm_time(pb, g, 64, c.collective_link(8, 8), accum_steps=8)
    intra, inter = c.collective_link(8), c.collective_link(8, 1)
    replica = c.collective_link(1, 8)  # one device per node in each replication group
    sync = cost.mics_grad_sync_time(g, 8, 1, 8, 8, intra, inter, replica)
    expect = 8 * cost.reduce_scatter_time(g, 8, intra) + cost.all_reduce_time(g / 8, 8, replica)
    assert sync == pytest.approx(expect)
    step = cost.mics_step_comm_time(pb, g, 8, 1, 8, 8, intra, inter, replica)
    assert step == pytest.approx(expect + 16 * cost.all_gather_time(pb, 8, intra))
    assert step < z3


def test_wire_and_buffer_bytes():
    assert cost.wire_bytes("all-gather", 8.0, 8) == pytest.approx(7.0)
    assert cost.wire_bytes("reduce-scatter", 8.0, 8) == pytest.approx(7.0)
    assert cost.wire_bytes("all-reduce", 8.0, 8) == pytest.approx(14.0)
    assert cost.wire_bytes("all-reduce", 8.0, 1) == 0.0
    assert cost.wire_bytes("collective-permute", 8.0, 2) == 8.0
    assert cost.collective_buffer_bytes("all-gather", 8.0, 4) == (2.0, 8.0)
    assert cost.collective_buffer_bytes("reduce-scatter", 8.0, 4) == (8.0, 2.0)
    assert cost.ring_node_egress_bytes("all-gather", 8.0, 8, 1) == 0.0
    assert cost.ring_node_egress_bytes("all-gather", 8.0, 16, 2) == pytest.approx(7.5)
    with pytest.raises(ValueError):
        cost.wire_bytes("gather", 1.0, 2)


def test_p2p_and_host_copies():
    link = ClusterSpec.preset("l4").device.host_to_device
    assert cost.host_copy_time(0.0, link) == 0.0
    assert cost.host_copy_time(5.75e9, link) == pytest.approx(1.0 + link.latency)
    t = cost.p2p_time(np.array([0.0, 1e9]), (5e9, 1e-5))
    np.testing.assert_allclose(t, [0.0, 0.2 + 1e-5])


def test_rank_layout_mist_rule():
    assert cost.dp_group_layout(16, 1, 2, 8) == (2, 8)
    assert cost.dp_group_layout(8, 2, 2, 8) == (2, 4)
    assert cost.dp_group_layout(4, 2, 1, 8) == (1, 4)
    assert cost.dp_group_layout(1, 16, 2, 8) == (1, 1)
    assert cost.dp_group_layout(2, 16, 4, 8) == (2, 1)  # TP spans 2 nodes; DP pairs are on different nodes
    inter, intra = cost.dp_group_layout(np.array([16, 8, 4]), np.array([1, 2, 4]), 2, 8)
    np.testing.assert_array_equal(inter, [2, 2, 2])
    np.testing.assert_array_equal(intra, [8, 4, 2])
    with pytest.raises(ValueError):
        cost.dp_group_layout(3, 2, 1, 8)
    assert cost.tp_group_layout(4, 8) == (1, 4)
    assert cost.tp_group_layout(16, 8) == (2, 8)


# -- interference --------------------------------------------------------------------------------


def _random_channels(n):
    x = RNG.uniform(0, 10, (4, n))
    x[RNG.random((4, n)) < 0.35] = 0.0  # every zero pattern shows up
    return x


def _params_between(lo, hi_fn):
    """Random factors with f_{M,k} in [lo, hi_fn(|M|)]."""
    return InterferenceParams(tuple(RNG.uniform(lo, hi_fn(len(m))) for m in MASKS for _ in m))


def _reference(x, params):
    """Straight per-row port of Mist's loop (slow, for cross-checking the vectorised version)."""
    x = list(map(float, x))
    t = 0.0
    for mask, f in params.mask_factors():
        if {k for k in range(4) if x[k] > 0} != set(mask):
            continue
        o = min(x[k] * fk for k, fk in zip(mask, f))
        t += o
        for k, fk in zip(mask, f):
            x[k] = 0.0 if x[k] * fk <= o else x[k] - o / fk
    return t + sum(x)


def test_overlap_matches_reference_loop():
    x = _random_channels(400)
    for params in (_params_between(1, lambda s: 4.0), ClusterSpec.preset("l4").interference):
        got = overlap_time(*x, params)
        np.testing.assert_allclose(got, [_reference(col, params) for col in x.T], rtol=1e-12)


def test_overlap_bounds():
    x = _random_channels(20000)
    lo, hi = x.max(axis=0), x.sum(axis=0)
    t = overlap_time(*x, _params_between(1, lambda s: 50.0))  # any factors >= 1
    assert np.all(t >= lo * (1 - 1e-12))
    t = overlap_time(*x, _params_between(1, lambda s: float(s)))  # f <= |M| => sum 1/f >= 1
    assert np.all(t <= hi * (1 + 1e-12)) and np.all(t >= lo * (1 - 1e-12))
    np.testing.assert_allclose(overlap_time(*x, InterferenceParams.ideal()), lo, rtol=1e-12)
    np.testing.assert_allclose(overlap_time(*x, InterferenceParams.serial()), hi, rtol=1e-12)
    # huge factors are worse than running serially: the upper bound genuinely needs sum 1/f >= 1
    assert overlap_time(1.0, 1.0, 0.0, 0.0, InterferenceParams.uniform(100.0)) > 2.0


def test_overlap_single_channel_and_zero():
    params = ClusterSpec.preset("l4").interference
    for k in range(4):
        x = np.zeros((4, 3))
        x[k] = [0.5, 2.0, 7.0]
        np.testing.assert_array_equal(overlap_time(*x, params), x[k])
    assert overlap_time(0, 0, 0, 0, params) == 0.0


def test_overlap_two_channel_by_hand():
    f = list(InterferenceParams.uniform(3.0).factors)
    i = sum(len(m) for m in MASKS[: MASKS.index((0, 2))])
    f[i : i + 2] = [1.2, 1.5]  # compute slowed 1.2x, h2d 1.5x while both run
    params = InterferenceParams(tuple(f))
    assert params.factor(("compute", "h2d"), "h2d") == 1.5
    # both run for min(10*1.2, 4*1.5) = 6 s; compute has 10 - 6/1.2 = 5 s left, alone
    assert overlap_time(10.0, 0.0, 4.0, 0.0, params) == pytest.approx(11.0)
    assert overlap_time(1.0, 0.0, 4.0, 0.0, params) == pytest.approx(1.2 + (4 - 1.2 / 1.5))


def test_overlap_nan_inf_negative():
    p = InterferenceParams.ideal()
    t = overlap_time(np.array([1.0, np.nan, np.inf]), 2.0, 0.0, 0.0, p)
    assert t[0] == 2.0 and np.isnan(t[1]) and np.isinf(t[2])
    with pytest.raises(ValueError):
        overlap_time(-1.0, 0, 0, 0, p)


def test_interference_params_validation_and_helpers():
    with pytest.raises(ValueError, match="28"):
        InterferenceParams((1.0,) * 27)
    with pytest.raises(ValueError, match=r"factors\[5\]"):
        InterferenceParams((1.0,) * 5 + (0.9,) + (1.0,) * 22)
    p = InterferenceParams.from_four_way((18.94, 1.26, 50.0, 1.6))
    assert NUM_FACTORS == 28 and len(p.as_table()) == 11
    assert p.factor(("d2d", "compute"), "compute") == 1.15
    assert p.factor((0, 1, 2), 1) == 1.26
    assert InterferenceParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="interference"):
        InterferenceParams.from_dict({"factors": [1.0] * 28, "extra": 1})
    for mask in MASKS:  # the generic fill never makes overlap worse than serial execution
        assert sum(1 / p.factor(mask, k) for k in mask) >= 1


# -- pipeline time -------------------------------------------------------------------------------


def _flow_shop(t, g, release=None):
    """Each micro-batch's F+B on stage i is one unit of length t[i]; stages and micro-batches in order."""
    s = len(t)
    fin = np.zeros((g, s))
    for j in range(g):
        for i in range(s):
            start = max(fin[j - 1, i] if j else 0.0, fin[j, i - 1] if i else 0.0)
            if release is not None and j == 0:
                start = max(start, release[i])
            fin[j, i] = start + t[i]
    return fin[-1, -1]


def _sim_1f1b(f, b, g):
    """Event simulation of non-interleaved 1F1B with separate F and B ops and no lock-step."""
    s = len(f)
    order = []
    for st in range(s):
        w = min(s - st - 1, g)
        ops = [("F", i) for i in range(w)]
        for k in range(g - w):
            ops += [("F", w + k), ("B", k)]
        order.append(ops + [("B", i) for i in range(g - w, g)])
    done, ptr, free = {}, [0] * s, [0.0] * s
    while any(ptr[st] < len(order[st]) for st in range(s)):
        moved = False
        for st in range(s):
            while ptr[st] < len(order[st]):
                op, i = order[st][ptr[st]]
                dep = (("F", st - 1, i) if st else None) if op == "F" else (
                    ("F", st, i) if st == s - 1 else ("B", st + 1, i))
                if dep is not None and dep not in done:
                    break
                start = max(free[st], done[dep] if dep else 0.0)
                free[st] = start + (f[st] if op == "F" else b[st])
                done[(op, st, i)] = free[st]
                ptr[st] += 1
                moved = True
        assert moved, "schedule deadlocked"
    return max(free)


def _sim_gpipe(f, b, g):
    fwd = _flow_shop(f, g)  # last stage finishes its forwards
    return fwd + _flow_shop(b[::-1], g)  # then the backward wave runs in reverse stage order


def test_1f1b_formula_by_hand():
    t, d = [1.0, 2.0, 3.0], [4.0, 1.0, 0.0]
    # sum 6 + 3*max 3 + max(4-0, 1-1, 0-3) = 19
    assert cost.pipeline_1f1b_time(t, d, 4) == pytest.approx(19.0)
    assert cost.pipeline_1f1b_time(t, [0.5, 2.5, 3.0], 4) == pytest.approx(16.5)  # 2.5 - 1 = 1.5 exposed
    assert cost.pipeline_1f1b_time([[5.0]], [[2.0]], 1) == pytest.approx([7.0])  # no PP: T + D
    # the MILP's D_max variable is >= 0, so negative deltas never shorten the iteration
    assert cost.pipeline_1f1b_time(t, [-1.0, -1.0, -1.0], 2) == pytest.approx(9.0)


def test_1f1b_formula_equals_flow_shop_simulation():
    for _ in range(300):
        s, g = RNG.integers(1, 7), RNG.integers(1, 13)
        t = RNG.uniform(0.1, 5, s)
        assert cost.pipeline_1f1b_time(t, np.zeros(s), g) == pytest.approx(_flow_shop(t, g))
        d = RNG.uniform(0, 8, s)
        assert _flow_shop(t, g, release=d) <= cost.pipeline_1f1b_time(t, d, g) + 1e-9
        tu = np.full(s, t[0])  # equal stages: the delta term is exact too
        assert cost.pipeline_1f1b_time(tu, d, g) == pytest.approx(_flow_shop(tu, g, release=d))


def test_1f1b_formula_vs_real_1f1b_schedule():
    for _ in range(300):
        s, g = int(RNG.integers(1, 7)), int(RNG.integers(1, 13))
        f = RNG.uniform(0.1, 2, s)
        c = RNG.uniform(0.5, 3)
        formula = cost.pipeline_1f1b_time((1 + c) * f, np.zeros(s), g)
        assert _sim_1f1b(f, c * f, g) <= formula * (1 + 1e-9)  # same B/F ratio on all stages
        fu, bu = np.full(s, f[0]), np.full(s, c * f[0])  # equal stages: exact, (G+S-1)(F+B)
        assert _sim_1f1b(fu, bu, g) == pytest.approx(cost.pipeline_1f1b_time(fu + bu, np.zeros(s), g))
        assert _sim_1f1b(fu, bu, g) == pytest.approx((g + s - 1) * (fu[0] + bu[0]))


def test_gpipe_formula():
    for _ in range(200):
        s, g = RNG.integers(1, 7), RNG.integers(1, 13)
        f, b = RNG.uniform(0.1, 2, s), RNG.uniform(0.1, 4, s)
        got = cost.pipeline_gpipe_time(f + b, np.zeros(s), g, forward=f)
        assert got == pytest.approx(_sim_gpipe(f, b, g))
        assert got >= cost.pipeline_1f1b_time(f + b, np.zeros(s), g) - 1e-9
    t, d = RNG.uniform(1, 2, (5, 4)), RNG.uniform(0, 3, (5, 4))
    np.testing.assert_allclose(cost.pipeline_gpipe_time(t, d, 8), cost.pipeline_1f1b_time(t, d, 8))
    assert cost.pipeline_time(t, d, 8, "gpipe").shape == (5,)
    with pytest.raises(ValueError):
        cost.pipeline_gpipe_time(t, d, 8, forward=t * 2)
    with pytest.raises(ValueError):
        cost.pipeline_time(t, d, 8, "interleaved")


def test_pipeline_batched_and_errors():
    t, d = RNG.uniform(0.1, 3, (7, 3, 4)), RNG.uniform(0, 3, (7, 3, 4))
    g = RNG.integers(1, 20, (7, 3))
    got = cost.pipeline_1f1b_time(t, d, g)
    assert got.shape == (7, 3)
    assert got[2, 1] == pytest.approx(cost.pipeline_1f1b_time(t[2, 1], d[2, 1], g[2, 1]))
    with pytest.raises(ValueError):
        cost.pipeline_1f1b_time(t, d, 0)
    with pytest.raises(ValueError):
        cost.pipeline_1f1b_time(1.0, 0.0, 1)


def test_bubble_and_inflight():
    assert cost.bubble_fraction(4, 16) == pytest.approx(3 / 19)
    assert cost.bubble_fraction(1, 5, "gpipe") == 0.0
    np.testing.assert_allclose(cost.bubble_fraction(np.array([1, 2, 4]), 4), [0, 1 / 5, 3 / 7])
    # 1F1B stage time vs bubble: (G+S-1) units, G of them useful
    s, g = 4, 16
    total = cost.pipeline_1f1b_time(np.ones(s), np.zeros(s), g)
    assert 1 - g / total == pytest.approx(cost.bubble_fraction(s, g))
    np.testing.assert_array_equal(cost.inflight_microbatches(np.arange(4), 4, 2), [2, 2, 2, 1])
    np.testing.assert_array_equal(cost.inflight_microbatches(np.arange(4), 4, 16), [4, 3, 2, 1])
    # the last stage runs each micro-batch's forward and backward in one program: one at a time
    np.testing.assert_array_equal(cost.inflight_microbatches(np.arange(4), 4, 16, "gpipe"), [16, 16, 16, 1])
    np.testing.assert_array_equal(cost.inflight_microbatches(np.arange(4), 4, 16, "1f1b-eager"), [7, 5, 3, 1])
    np.testing.assert_array_equal(cost.inflight_microbatches(np.arange(4), 4, 4, "1f1b-eager"), [4, 4, 3, 1])
    with pytest.raises(ValueError):
        cost.inflight_microbatches(4, 4, 8)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "1f1b-eager"])
def test_inflight_is_what_the_executor_schedule_keeps(schedule):
    from mistjax.core import pipeline_order

    for S in (2, 3, 4, 6):
        for G in (1, 2, S, 2 * S + 1, 4 * S):
            kept = pipeline_order.residuals_in_flight(pipeline_order.issue_order(schedule, S, G))
            kept[-1] = 1  # the last stage's fused forward-backward program holds one, transiently
            np.testing.assert_array_equal(cost.inflight_microbatches(np.arange(S), S, G, schedule), kept)


# -- op times ------------------------------------------------------------------------------------


def test_roofline_and_efficiency_curve():
    dev = ClusterSpec.preset("a100-40gb").device
    big = cost.op_time(1e13, 1e8, dev)
    assert big == pytest.approx(1e13 / (312e12 * 0.8) + cost.DEFAULT_OP_OVERHEAD)
    assert cost.op_time(0.0, 1e9, dev) == pytest.approx(1e9 / (1555e9 * 0.85))
    assert cost.op_time(0.0, 0.0, dev) == 0.0
    assert cost.op_time(1e9, 0.0, dev, fp32=True) > cost.op_time(1e9, 0.0, dev)
    f_half = 312e12 * 0.8 * cost.DEFAULT_OP_OVERHEAD
    assert cost.compute_efficiency(f_half, 312e12, 0.8) == pytest.approx(0.4)
    eff = cost.compute_efficiency(np.logspace(3, 15, 50), 312e12, 0.8)
    assert np.all(np.diff(eff) > 0) and eff[-1] == pytest.approx(0.8, rel=1e-3)
    # the curve equals the roofline compute term with an explicit efficiency
    f = np.logspace(6, 12, 20)
    via_curve = f / (312e12 * cost.compute_efficiency(f, 312e12, 0.8))
    np.testing.assert_allclose(cost.roofline_time(f, 0.0, 312e12, 1.0, matmul_efficiency=0.8), via_curve)
    with pytest.raises(ValueError):
        cost.roofline_time(-1.0, 0.0, 1.0, 1.0)


def test_op_time_table(tmp_path):
    dev = ClusterSpec.preset("h100").device
    sig = cost.op_signature("dot_general", [(8, 1024, 4096), (4096, 4096)], "bf16", pass_="fwd", tp=2)
    assert sig == cost.op_signature("dot_general", [(8, 1024, 4096), (4096, 4096)], "bf16", tp=2, pass_="fwd")
    table = OpTimeTable({sig: 1.5e-4}, device=dev.name, source="unit test")
    path = tmp_path / "ops.json"
    table.save(path)
    back = OpTimeTable.load(path)
    assert back == table and sig in back and len(back) == 1
    got = back.lookup([sig, "other"], np.array([1e12, 1e12]), 0.0, dev)
    np.testing.assert_allclose(got, [1.5e-4, cost.op_time(1e12, 0.0, dev)])
    assert back.with_entries({"other": 1.0}).get("other") == 1.0 and back.get("other") is None


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{not json", "not valid JSON"),
        ('{"format": "x", "version": 1, "entries": {}}', "format"),
        ('{"format": "mistjax.op_time_table", "version": 2, "entries": {}}', "version"),
        ('{"format": "mistjax.op_time_table", "version": 1, "entries": {"a": -1}}', "entries['a']"),
        ('{"format": "mistjax.op_time_table", "version": 1, "entries": {"a": "1"}}', "entries['a']"),
        ('{"format": "mistjax.op_time_table", "version": 1, "entries": []}', "entries"),
        ('{"format": "mistjax.op_time_table", "version": 1, "entries": {}, "x": 1}', "unknown field"),
    ],
)
def test_op_time_table_rejects_bad_json(text, needle):
    with pytest.raises(ValueError) as err:
        OpTimeTable.from_json(text)
    assert needle in str(err.value)


# -- vectorised over many elements ---------------------------------------------------------------


def test_vectorised_calls_on_1e5_elements():
    n = 100_000
    nbytes = RNG.uniform(0, 1e9, n)
    p = RNG.choice([1, 2, 4, 8], n)
    assert cost.all_reduce_time(nbytes, p, LINK, model="mist").shape == (n,)
    assert cost.hierarchical_all_gather_time(nbytes, p, 2, LINK, LINK).shape == (n,)
    assert cost.host_copy_time(nbytes, LINK).shape == (n,)
    x = RNG.uniform(0, 1, (4, n)) * (RNG.random((4, n)) < 0.7)
    assert overlap_time(*x, ClusterSpec.preset("a100-40gb").interference).shape == (n,)
    assert overlap_time(*x.reshape(4, 100, 1000), InterferenceParams.serial()).shape == (100, 1000)
    stages = RNG.uniform(0, 1, (n, 4))
    assert cost.pipeline_1f1b_time(stages, stages * 0.1, RNG.integers(1, 64, n)).shape == (n,)
    assert cost.op_time(nbytes, nbytes, ClusterSpec.preset("l4").device).shape == (n,)
