"""Misuse of autoshard gets a clear, actionable error (the rest of docs/errors.md is tested elsewhere)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from test_runtime import BATCH, DEVICES, setup

import mistjax
from mistjax.plan import PlanError, uniform_plan
from models import make_loss_fn


def test_plain_jax_grad_with_a_plan_that_needs_mistjax_grad():
    cfg, state, batch, *_ = setup("gpt3-tiny")
    loss_fn = make_loss_fn(state.graphdef)

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    plan = uniform_plan(cfg.num_layers, DEVICES, micro_batch=BATCH // DEVICES // 2, grad_accum=2, shard_opt=True)
    with pytest.raises(PlanError, match="needs the step to compute gradients with mistjax.value_and_grad"):
        mistjax.autoshard(train_step, jax.devices(), plan=plan)(state, batch)


def test_value_and_grad_of_a_transformed_copy():
    cfg, state, batch, *_ = setup("gpt3-tiny")
    loss_fn = make_loss_fn(state.graphdef)

    def train_step(state, batch):
        params = jax.tree.map(lambda p: p * 1.0, state.params)
        loss, grads = mistjax.value_and_grad(loss_fn)(params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    plan = uniform_plan(cfg.num_layers, DEVICES, micro_batch=BATCH // DEVICES, shard_opt=True)
    with pytest.raises(PlanError, match="as they come from the train state"):
        mistjax.autoshard(train_step, jax.devices(), plan=plan)(state, batch)


def test_value_and_grad_other_argnums_inside_autoshard():
    cfg, state, batch, *_ = setup("gpt3-tiny")

    def train_step(state, batch):
        loss, g = mistjax.value_and_grad(lambda b, p: jnp.sum(b["inputs"]) * 0.0 + 1.0, argnums=1)(batch, 1.0)
        return state, {"loss": loss}

    plan = uniform_plan(cfg.num_layers, DEVICES, micro_batch=BATCH // DEVICES, shard_opt=True)
    with pytest.raises(ValueError, match="differentiates the first argument"):
        mistjax.autoshard(train_step, jax.devices(), plan=plan)(state, batch)


def test_unsupported_primitive_in_the_block():
    from mistjax.analysis.analyze import UnsupportedPrimitiveError, analyze_model

    def loss(params, x):
        def layer(h, w):
            h = jax.lax.while_loop(lambda c: jnp.sum(c[1]) < 3.0, lambda c: (c[0] @ w, c[1] + 1.0), (h, h))[0]
            return h, None

        return jnp.mean(jax.lax.scan(layer, x, params["layers"])[0])

    params = {"layers": jnp.ones((2, 4, 4)) * 0.1}
    with pytest.raises(UnsupportedPrimitiveError, match="data-dependent while loop"):
        analyze_model(loss, params, lambda b, s: (jax.ShapeDtypeStruct((b, s, 4), jnp.float32),))
