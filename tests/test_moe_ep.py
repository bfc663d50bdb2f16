"""Expert parallelism (issue #51, item 2): all-to-all dispatch in shard_map against a single-device reference.

One SGD-with-momentum step of the tiny MoE model (dense-first layer, shared expert, 8 experts, top-2) on 8
simulated devices, the expert axis folded with the data axis (``data x expert = 8``), against ``jax.jit`` on one
device: the losses to rtol 1e-5, the updated parameters to rtol 1e-4, the per-expert routed counts exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import models
from mistjax.core.moe import experts_dispatch
from mistjax.runtime.experts import ExpertParallelError, expert_parallel, expert_shardings
from models.moe import make_moe_loss_fn


def _setup(capacity_factor: float | None):
    cfg = models.get_config("moe-tiny")
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, capacity_factor=capacity_factor))
    graphdef, params, rest = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, cfg.vocab_size)
    return cfg, graphdef, params, rest, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _step(graphdef, opt, dispatcher):
    loss_fn = make_moe_loss_fn(graphdef)

    def step(params, rest, opt_state, batch):
        def grads():
            return jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch)

        if dispatcher is None:
            (loss, metrics), g = grads()
        else:
            with experts_dispatch(dispatcher):
                (loss, metrics), g = grads()
        updates, _ = opt.update(g, opt_state, params)
        return loss, metrics, optax.apply_updates(params, updates)

    return jax.jit(step)


def _mesh(ep: int, etp: int = 1):
    return jax.make_mesh((8 // (ep * etp), ep, etp), ("data", "expert", "tensor"), axis_types=(AxisType.Auto,) * 3)


@pytest.mark.parametrize("ep, etp, capacity_factor, zero3", [
    (2, 1, 1.0, False),
    # expert tensor parallelism on top: data 2 x expert 2 x tensor 2
    pytest.param(2, 2, 1.0, False, marks=pytest.mark.slow),
    pytest.param(4, 1, 1.0, True, marks=pytest.mark.slow),  # ZeRO-3: every parameter split over its data group
    pytest.param(4, 1, None, False, marks=pytest.mark.slow),  # dropless (worst-case buffers)
    pytest.param(8, 1, 0.5, False, marks=pytest.mark.slow),  # heavy dropping
])
def test_expert_parallel_matches_single_device(ep, etp, capacity_factor, zero3):
    cfg, graphdef, params, rest, batch = _setup(capacity_factor)
    opt = optax.sgd(0.1, momentum=0.9)
    ref_loss, ref_metrics, ref_params = _step(graphdef, opt, None)(params, rest, opt.init(params), batch)

    mesh = _mesh(ep, etp)
    tensor = "tensor" if etp > 1 else None
    zero = ("data",) if zero3 else ()
    params_ep = jax.device_put(params, expert_shardings(models.logical_axes(params), mesh, tensor_axis=tensor,
                                                        zero_axes=zero))
    gate, wq = params_ep["layers"]["moe"]["mlp"]["w_gate"][...], params_ep["layers"]["moe"]["attn"]["wq"][...]
    assert gate.sharding.spec == P(None, "expert", ("data",) if zero3 else None, tensor)
    assert wq.sharding.spec == P(None, ("data", "expert") if zero3 else None, None, None)
    args = (params_ep, jax.device_put(rest, NamedSharding(mesh, P())), opt.init(params_ep),
            jax.device_put(batch, NamedSharding(mesh, P(("data", "expert")))))
    compiled = _step(graphdef, opt, expert_parallel(mesh, tensor_axis=tensor)).lower(*args).compile()
    assert "all-to-all" in compiled.as_text()
    if zero3:  # the split parameters are gathered where used
        assert "all-gather" in compiled.as_text()
    loss, metrics, new_params = compiled(*args)

    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(metrics.counts), np.asarray(ref_metrics.counts))
    for (path, got), (_, want) in zip(jax.tree_util.tree_leaves_with_path(new_params),
                                      jax.tree_util.tree_leaves_with_path(ref_params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
    np.testing.assert_array_equal(np.asarray(metrics.dropped), np.asarray(ref_metrics.dropped))
    if capacity_factor is not None:  # the case drops tokens, so equal results mean the same ones were dropped
        assert float(ref_metrics.dropped.sum()) > 0


def test_expert_parallel_refuses_indivisible_experts():
    cfg, _, _, _, batch = _setup(1.0)
    mesh = _mesh(8)
    cfg3 = cfg.replace(moe=dataclasses.replace(cfg.moe, num_experts=6))
    graphdef, params, rest = nnx.split(models.build(cfg3, rngs=nnx.Rngs(0)), nnx.Param, ...)
    with pytest.raises(ExpertParallelError, match="does not divide num_experts=6"), \
            experts_dispatch(expert_parallel(mesh)):
        make_moe_loss_fn(graphdef)(params, rest, batch)
    with pytest.raises(ExpertParallelError, match="mesh axis 'ep' is not in the mesh"):
        expert_parallel(mesh, expert_axis="ep")


def test_expert_parallelism_folded_over_tensor_ranks_exceeds_data_parallelism():
    """EP 8 on a data 2 x tensor 4 mesh: the batch is split two ways only, the experts eight ways (each tensor rank
    dispatches its share of its group's sequences); one step equals the single-device step."""
    cfg, graphdef, params, rest, batch = _setup(1.0)
    opt = optax.sgd(0.1, momentum=0.9)
    ref_loss, ref_metrics, ref_params = _step(graphdef, opt, None)(params, rest, opt.init(params), batch)
    mesh = jax.make_mesh((2, 1, 4), ("data", "expert", "tensor"), axis_types=(AxisType.Auto,) * 3)
    shardings = expert_shardings(models.logical_axes(params), mesh, expert_axis=("expert", "tensor"))
    params_ep = jax.device_put(params, shardings)
    assert params_ep["layers"]["moe"]["mlp"]["w_up"][...].sharding.spec == P(None, ("expert", "tensor"), None, None)
    args = (params_ep, jax.device_put(rest, NamedSharding(mesh, P())), opt.init(params_ep),
            jax.device_put(batch, NamedSharding(mesh, P(("data", "expert")))))
    compiled = _step(graphdef, opt, expert_parallel(mesh, fold_axes=("tensor",))).lower(*args).compile()
    assert "all-to-all" in compiled.as_text()
    loss, metrics, new_params = compiled(*args)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(metrics.dropped), np.asarray(ref_metrics.dropped))
    for got, want in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
