"""Check the cost model against XLA's compiled programs (used by tests and scripts/bench_costmodel.py).

A cell is (model preset, sequence length, global batch, plan). `measure_cell` compiles the runtime's
real train step (``mistjax.autoshard(step, jax.devices(), plan=plan).lower(state, batch).compile()``
on abstract AdamW state) and reads what XLA:CPU reports; `compare_cell` puts the model's matching
figures next to it. What is compared, like with like:

* memory: ``argument + output + temp - alias`` (`runtime.hlo.memory_stats`) vs the model's
  `Analysis.xla_cpu_peak` (device peak + host-placed bytes: XLA:CPU counts host buffers as ordinary);
* FLOPs: ``flops + transcendentals`` of ``cost_analysis()`` vs `Analysis.flops_xla`, the model's
  count with every loop body counted once (the micro-batch scan, each layer segment's scan with
  its unroll), as XLA:CPU counts them;
* collectives: result bytes per kind, each instruction times the trip counts of the loops around
  it (`hlo_count.collective_totals`), vs `Analysis.collective_bytes`. Tensor-parallel collectives
  are not in that figure (XLA:CPU rewrites reduce-scatters as all-reduces + slices, see
  tests/test_analysis.py), so cells with ``tp > 1`` report no collective error.
"""

from __future__ import annotations

import functools
from typing import Any

from mistjax.cost.hlo_count import collective_totals
from mistjax.cost.predict import analyze
from mistjax.cost.workload import Workload
from mistjax.plan import Plan

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")


@functools.cache
def _setup(name: str, seq: int, global_batch: int) -> tuple[Any, Any, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import mistjax
    import models
    from mistjax.train.loss import make_loss_fn
    from mistjax.train.state import TrainState

    cfg = models.get_config(name)
    state = nnx.eval_shape(lambda: TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3)))
    loss_fn = make_loss_fn(state.graphdef)

    def train_step(state: Any, batch: Any) -> Any:
        loss, grads = mistjax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    tok = jax.ShapeDtypeStruct((global_batch, seq), jnp.int32)
    return state, {"inputs": tok, "targets": tok}, train_step


def measure_cell(name: str, seq: int, global_batch: int, plan: Plan) -> dict[str, Any]:
    """Compile the runtime's train step for ``plan`` and read memory, FLOPs and collectives."""
    import jax

    import mistjax
    from mistjax.runtime import hlo

    state, batch, step = _setup(name, seq, global_batch)
    compiled = mistjax.autoshard(step, jax.devices(), plan=plan).lower(state, batch).compile()
    ca = compiled.cost_analysis()
    return {"mem": hlo.memory_stats(compiled)["peak"],
            "flops": float(ca["flops"]) + float(ca.get("transcendentals", 0.0)),
            "coll": collective_totals(compiled.as_text())}


@functools.cache
def workload_for(name: str, seq: int, global_batch: int) -> Workload:
    """The (cached) AdamW workload of a model preset."""
    import models

    return Workload.from_model(models.get_config(name), seq, global_batch)


def compare_cell(name: str, seq: int, global_batch: int, plan: Plan, cluster: Any,
                 measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """One record: predicted vs compiled memory, FLOPs and collective bytes, with relative errors."""
    wl = workload_for(name, seq, global_batch)
    a = analyze(wl, plan, cluster)
    m = measured or measure_cell(name, seq, global_batch, plan)
    mem_pred = max(a.xla_cpu_peak)
    flops_pred = max(a.flops_xla)
    xla_coll = {k: float(m["coll"].get(k, 0)) for k in KINDS}
    pred_coll = {k: float(a.collective_bytes.get(k, 0.0)) for k in KINDS}
    total = sum(xla_coll.values())
    coll_err = None if plan.tp > 1 else (
        sum(abs(pred_coll[k] - xla_coll[k]) for k in KINDS) / max(total, 1.0))
    return {"model": name, "seq": seq, "global_batch": global_batch, "plan": _describe(plan),
            "mem_pred": mem_pred, "mem_xla": float(m["mem"]), "mem_err": mem_pred / m["mem"] - 1.0,
            "flops_pred": flops_pred, "flops_xla": m["flops"], "flops_err": flops_pred / m["flops"] - 1.0,
            "coll_pred": pred_coll, "coll_xla": xla_coll, "coll_err": coll_err,
            "step_time_pred": a.step_time}


def _describe(plan: Plan) -> str:
    s = plan.stages[0]
    parts = [f"S{plan.num_stages}" if plan.num_stages > 1 else "", f"dp{plan.dp}",
             f"tp{plan.tp}" if plan.tp > 1 else "",
             f"p{plan.shard_group}" if plan.shard_group != plan.dp else "", f"z{s.zero_stage}", f"b{plan.micro_batch}",
             f"G{plan.grad_accum}" if plan.grad_accum > 1 else "",
             f"remat{s.remat_layers}:{s.remat_policy}" if s.remat_layers else ""]
    parts += [f"{n[8]}o{getattr(s, n):g}" for n in ("offload_weights", "offload_grads", "offload_opt", "offload_acts")
              if getattr(s, n)]
    return " ".join(p for p in parts if p)


Z0, Z1 = dict(shard_opt=False), dict(shard_opt=True)
Z2, Z3 = dict(shard_opt=True, shard_grads=True), dict(shard_opt=True, shard_grads=True, shard_weights=True)

# (model, seq, global batch, uniform_plan kwargs). 8 devices.
SMALL_GRID: tuple[tuple[str, int, int, dict[str, Any]], ...] = (
    ("llama-tiny", 16, 16, dict(micro_batch=2, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, **Z1)),
    ("gpt3-tiny", 16, 16, dict(micro_batch=2, **Z3)),
    ("falcon-tiny", 16, 32, dict(micro_batch=2, grad_accum=2, **Z2)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, shard_group=2, **Z3)),
    ("gpt3-tiny", 32, 16, dict(micro_batch=2, remat_layers=2, remat_policy="dots", **Z0)),
)
FULL_GRID: tuple[tuple[str, int, int, dict[str, Any]], ...] = SMALL_GRID + (
    ("llama-tiny", 32, 16, dict(micro_batch=2, **Z0)),
    ("llama-tiny", 16, 32, dict(micro_batch=4, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, **Z2)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, **Z3)),
    ("llama-tiny", 16, 32, dict(micro_batch=2, grad_accum=2, **Z0)),
    ("llama-tiny", 16, 32, dict(micro_batch=2, grad_accum=2, **Z1)),
    ("llama-tiny", 16, 32, dict(micro_batch=2, grad_accum=2, **Z3)),
    ("llama-tiny", 16, 16, dict(micro_batch=4, tp=2, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, remat_layers=4, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, remat_layers=4, **Z3)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, offload_opt=1.0, **Z1)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, offload_weights=0.5, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, offload_acts=0.5, **Z0)),
    ("llama-tiny", 16, 32, dict(micro_batch=2, grad_accum=2, offload_grads=1.0, **Z0)),
    ("gpt3-tiny", 16, 16, dict(micro_batch=2, **Z0)),
    ("gpt3-tiny", 16, 32, dict(micro_batch=4, tp=2, grad_accum=2, **Z1)),
    ("gpt3-tiny", 64, 16, dict(micro_batch=2, remat_layers=2, **Z2)),
    ("falcon-tiny", 16, 16, dict(micro_batch=2, **Z0)),
    ("falcon-tiny", 32, 16, dict(micro_batch=2, shard_group=4, **Z2)),
    ("falcon-tiny", 16, 16, dict(micro_batch=4, tp=2, remat_layers=2, remat_policy="names:qkv_proj", **Z3)),
    ("gpt3-small", 32, 16, dict(micro_batch=2, **Z0)),
    ("gpt3-small", 32, 16, dict(micro_batch=2, **Z3)),
    ("llama-small", 32, 16, dict(micro_batch=4, tp=2, **Z1)),
    ("llama-small", 32, 32, dict(micro_batch=2, grad_accum=2, shard_group=4, **Z3)),
    ("falcon-small", 64, 16, dict(micro_batch=2, remat_layers=4, **Z1)),
    ("falcon-small", 32, 16, dict(micro_batch=2, **Z2)),
    ("llama-tiny", 16, 16, dict(micro_batch=2, stages=2, grad_accum=2, **Z0)),
    ("llama-tiny", 16, 16, dict(micro_batch=1, stages=2, grad_accum=4, **Z1)),
    ("llama-tiny", 16, 8, dict(micro_batch=1, stages=4, grad_accum=4, **Z0)),
    ("falcon-tiny", 16, 16, dict(micro_batch=2, stages=2, grad_accum=2, remat_layers=1, schedule="gpipe", **Z1)),
)


def grid_plan(name: str, kwargs: dict[str, Any], devices: int = 8) -> Plan:
    """The uniform plan of a grid entry."""
    import models
    from mistjax.plan import uniform_plan

    return uniform_plan(models.get_config(name).num_layers, devices, **kwargs)


__all__ = ["FULL_GRID", "KINDS", "SMALL_GRID", "compare_cell", "grid_plan", "measure_cell", "workload_for"]
