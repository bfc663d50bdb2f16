"""Pipeline schedules side by side: compiled memory per device and the schedule's bubble, per (S, G).

Run: python scripts/bench_pipeline.py [--json FILE] [--model gpt3-tiny]
Memory comes from compiling the real pipelined train step (8 simulated CPU devices; one SPMD program,
so every stage's device allocates the same buffers: the largest stage's need). The bubble fraction and
the in-flight micro-batches per stage come from the schedule tables the executor runs; the lock-step
time is in units of one stage forward (backward = 2x forward).
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
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import mistjax  # noqa: E402
import models  # noqa: E402
from mistjax.core import hlo, pipeline_time, schedules  # noqa: E402
from mistjax.train.data import SyntheticTokens  # noqa: E402
from mistjax.train.loop import make_train_step  # noqa: E402
from mistjax.train.state import TrainState  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt3-tiny")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    cfg = models.get_config(a.model)
    state = TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3))
    train_step = make_train_step(models.make_loss_fn(state.graphdef))
    n = jax.device_count()
    records = []
    for S in (2, 4):
        dp = n // S
        for G in (S, 2 * S, 4 * S):
            batch = SyntheticTokens(cfg.vocab_size, a.seq_len, dp * G).batch(0)
            for schedule in ("1f1b", "1f1b-eager", "gpipe"):
                plan = mistjax.uniform_plan(cfg.num_layers, n, stages=S, grad_accum=G, micro_batch=1, schedule=schedule)
                compiled = mistjax.autoshard(train_step, jax.devices(), plan=plan).lower(state, batch).compile()
                sched = schedules.make_schedule(schedule, S, G)
                records.append({
                    "stages": S, "grad_accum": G, "schedule": schedule, "memory": hlo.memory_stats(compiled),
                    "inflight_per_stage": [int(x) for x in schedules.in_flight(sched)],
                    "bubble_fraction": float(pipeline_time.bubble_fraction(S, G, schedule)),
                    "lockstep_time": float(pipeline_time.lockstep_time(sched, np.ones(S), 2 * np.ones(S))),
                })
    head = (f"{'S':>2} {'G':>3} {'schedule':<10} {'peak KiB':>9} {'temp KiB':>9} {'in-flight/stage':<16} "
            f"{'bubble':>7} {'ticks t':>8}")
    print(f"{a.model}, seq {a.seq_len}, micro-batch 1 per data-parallel rank, {n} devices")
    print(head)
    print("-" * len(head))
    for r in records:
        m = r["memory"]
        print(f"{r['stages']:>2} {r['grad_accum']:>3} {r['schedule']:<10} {m['peak'] / 1024:>9.1f} "
              f"{m['temp'] / 1024:>9.1f} "
              f"{str(r['inflight_per_stage']):<16} {r['bubble_fraction']:>7.3f} {r['lockstep_time']:>8.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
