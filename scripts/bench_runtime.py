"""Per-device compiled memory and collective bytes of the runtime, plan by plan (tiny Llama, 8 CPU devices).

Run: python scripts/bench_runtime.py [--json FILE] [--model llama-tiny]
Each plan is compiled (never run); memory comes from `compiled.memory_analysis()` (peak = argument +
output + temp - alias), collectives from the compiled HLO (result bytes per device, by kind).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import mistjax  # noqa: E402
import models  # noqa: E402
from mistjax.core import hlo  # noqa: E402
from mistjax.train.data import SyntheticTokens  # noqa: E402
from mistjax.train.loop import make_train_step  # noqa: E402
from mistjax.train.state import TrainState  # noqa: E402

ZERO = {0: dict(shard_opt=False), 1: dict(shard_opt=True), 2: dict(shard_opt=True, shard_grads=True),
        3: dict(shard_opt=True, shard_grads=True, shard_weights=True)}
PLANS = {
    "dp": dict(ZERO[0]),
    "zero1": dict(ZERO[1]),
    "zero2 G4": dict(ZERO[2], grad_accum=4),
    "zero3": dict(ZERO[3]),
    "mics p2 zero3 G4": dict(ZERO[3], shard_group=2, grad_accum=4),
    "tp2+sp zero1": dict(ZERO[1], tp=2),
    "tp4 zero3 G2": dict(ZERO[3], tp=4, grad_accum=2),
    "remat full": dict(ZERO[1], remat_layers=4),
    "remat dots": dict(ZERO[1], remat_layers=4, remat_policy="dots"),
    "offload opt": dict(ZERO[1], offload_opt=1.0),
    "offload w+g G4": dict(ZERO[3], offload_weights=1.0, offload_grads=1.0, grad_accum=4),
}  # pipelined plans run one program per stage and phase: scripts/bench_mpmd.py


def measure(name: str, batch_size: int, seq_len: int) -> list[dict]:
    cfg = models.get_config(name)
    state = TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3))
    batch = SyntheticTokens(cfg.vocab_size, seq_len, batch_size).batch(0)
    train_step = make_train_step(models.make_loss_fn(state.graphdef))
    n = jax.device_count()
    records = []
    for label, knobs in PLANS.items():
        knobs = dict(knobs)
        stages, tp, g = knobs.pop("stages", 1), knobs.get("tp", 1), knobs.get("grad_accum", 1)
        knobs.pop("tp", None), knobs.pop("grad_accum", None)
        dp = n // (stages * tp)
        plan = mistjax.uniform_plan(cfg.num_layers, n, stages=stages, tp=tp, grad_accum=g,
                                    micro_batch=batch_size // (dp * g), **knobs)
        step = mistjax.autoshard(train_step, jax.devices(), plan=plan)
        compiled = step.lower(state, batch).compile()
        records.append({"label": label, "plan": json.loads(plan.to_json()), "memory": hlo.memory_stats(compiled),
                        "collectives": hlo.collective_bytes(compiled.as_text()),
                        "host_params": hlo.host_placed_params(compiled.as_text())})
    return records


def table(records: list[dict]) -> str:
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")
    head = f"{'plan':<20} {'arg KiB':>9} {'temp KiB':>9} {'peak KiB':>9} {'host':>5} " + " ".join(
        f"{k[:14]:>14}" for k in kinds)
    lines = [head, "-" * len(head)]
    for r in records:
        m, c = r["memory"], r["collectives"]
        lines.append(f"{r['label']:<20} {m['argument'] / 1024:>9.1f} {m['temp'] / 1024:>9.1f} {m['peak'] / 1024:>9.1f} "
                     f"{r['host_params']:>5} " + " ".join(f"{c.get(k, 0) / 1024:>12.1f}Ki" for k in kinds))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--json", default=None, help="write one record per plan here")
    a = p.parse_args()
    records = measure(a.model, a.batch, a.seq_len)
    print(f"{a.model}, global batch {a.batch}, seq {a.seq_len}, {jax.device_count()} devices "
          "(per-device bytes; collectives = result bytes by kind)")
    print(table(records))
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
