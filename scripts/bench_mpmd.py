"""MPMD pipeline executor: host dispatch per op, step time, per-stage compiled memory.

Run: python scripts/bench_mpmd.py [--json FILE] [--steps N] [--model gpt3-tiny]

8 simulated CPU devices, 4 pipeline stages x dp 2, an 8-layer tiny GPT, AdamW with global-norm clipping
(the update splits into two rounds per stage). For GPipe, classic 1F1B and interleaved 1F1B (2 chunks
per device group), ZB-H1 (zero-bubble: each backward split into input- and weight-gradient programs) and ZB-V
(two chunks per group in a V, backwards split) at G = 8 and 16 it reports the operations the host issues per step
(programs and ``jax.device_put`` transfers), the host seconds spent issuing one step (the devices run asynchronously),
host time per op, and the step's wall time. Then, for 1F1B, ZB-H1 and ZB-V at G = 8, every stage's programs' compiled
``memory_analysis()`` (argument / output / temp bytes per device): each stage's own buffers.

On this CPU machine the simulated devices' compute threads share the cores with the host thread, so the
host time per op is an upper bound of the pure dispatch cost; `--idle` also times a model too small to
compute anything, to isolate dispatch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import mistjax  # noqa: E402
import models  # noqa: E402
from mistjax.core import hlo  # noqa: E402
from mistjax.plan import Plan, StagePlan  # noqa: E402
from mistjax.train.data import SyntheticTokens  # noqa: E402
from mistjax.train.loop import make_train_step  # noqa: E402
from mistjax.train.state import TrainState, make_optimizer  # noqa: E402
from models import make_loss_fn  # noqa: E402

CONFIGS = [("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zb-v", 2)]  # (schedule, chunks per device group)


def plan_for(num_layers: int, groups: int, chunks: int, dp: int, G: int, schedule: str) -> Plan:
    if schedule == "zb-v":  # each group's layers as two chunks placed in a V
        return plan_for(num_layers, groups, 1, dp, G, "1f1b").v_shaped()
    k = groups * chunks
    bounds = [round(i * num_layers / k) for i in range(k + 1)]
    stages = tuple(StagePlan((a, b), shard_opt=True) for a, b in zip(bounds[:-1], bounds[1:]))
    return Plan(stages=stages, micro_batch=1, grad_accum=G, dp=dp, schedule=schedule, virtual_stages=chunks)


def time_steps(step, state, batch, steps: int) -> tuple[list[dict], object]:
    """Run `steps` steps after two warm-up steps; per step: host issue time, ops, wall time."""
    for _ in range(2):
        state, m = step(state, batch)
        jax.block_until_ready(m)
    rows = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        host = step._mpmd.stats.host_s
        jax.block_until_ready((state, m))
        wall = time.perf_counter() - t0
        st = step._mpmd.stats
        rows.append({"host_s": host, "wall_s": wall, "ops": st.ops, "programs": st.programs,
                     "transfers": st.transfers})
    return rows, state


def dispatch_floor(calls: int = 300) -> dict[str, float]:
    """Host ms per call of a 1-element jitted add on a 2-device sub-mesh (`calibrate.dispatch_seconds`, what
    ``mistjax calibrate`` stores as ``dispatch_seconds``), and of a device_put of it to another sub-mesh: what
    any op costs the host here, whatever it computes."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from mistjax.hardware.calibrate import dispatch_seconds

    devs = jax.devices()
    a, b = Mesh(devs[0:2], ("x",)), Mesh(devs[2:4], ("x",))
    x = jax.device_put(jnp.zeros((2,)), NamedSharding(a, P("x")))
    dst = NamedSharding(b, P("x"))
    jax.block_until_ready(jax.device_put(x, dst))
    t0 = time.perf_counter()
    ys = [jax.device_put(x, dst) for _ in range(calls)]
    transfer = 1e3 * (time.perf_counter() - t0) / calls
    jax.block_until_ready(ys)
    return {"program": 1e3 * dispatch_seconds(calls, devs), "transfer": transfer}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt3-tiny")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--idle", action="store_true", help="also time a 1-wide model (dispatch only)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    n, groups = jax.device_count(), 4
    dp = n // groups
    cfgs = [(a.model, a.layers, a.seq_len, "model")]
    if a.idle:
        cfgs.append((a.model, a.layers, 2, "idle"))
    records, memory = [], []
    floor = dispatch_floor()
    print(f"dispatch floor: {floor['program']:.3f} ms per jitted program, {floor['transfer']:.3f} ms per device_put",
          flush=True)
    for name, layers, seq, kind in cfgs:
        cfg = models.get_config(name).replace(num_layers=layers)
        state0 = TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), make_optimizer(1e-3))
        train_step = make_train_step(make_loss_fn(state0.graphdef))
        for G in (8, 16):
            batch = SyntheticTokens(cfg.vocab_size, seq, dp * G).batch(0)
            for schedule, chunks in CONFIGS:
                plan = plan_for(layers, groups, chunks, dp, G, schedule)
                step = mistjax.autoshard(train_step, jax.devices(), plan=plan)
                t0 = time.perf_counter()
                state = step.place(jax.tree.map(jnp.copy, state0), batch)
                rows, state = time_steps(step, state, batch, a.steps)
                setup_s = time.perf_counter() - t0
                host = statistics.median(r["host_s"] for r in rows)
                wall = statistics.median(r["wall_s"] for r in rows)
                ops = rows[-1]["ops"]
                rec = {"kind": kind, "seq_len": seq, "schedule": schedule, "chunks": chunks, "grad_accum": G,
                       "stages": groups, "dp": dp, "ops": ops, "programs": rows[-1]["programs"],
                       "transfers": rows[-1]["transfers"], "host_s": host, "host_ms_per_op": 1e3 * host / ops,
                       "step_s": wall, "compile_and_warmup_s": setup_s,
                       "by_kind": dict(step._mpmd.stats.by_kind),
                       "residuals_in_flight": step._mpmd.stats.residuals_in_flight}
                records.append(rec)
                print(f"{kind:<5} G={G:<3} {schedule:<6} v={chunks}  ops/step {ops:4d}  host {1e3 * host:7.1f} ms  "
                      f"{rec['host_ms_per_op']:.3f} ms/op  step {1e3 * wall:7.1f} ms", flush=True)
                if kind == "model" and G == 8 and (schedule, chunks) in (("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)):
                    for (k, phase), c in sorted(step.compile_stages(state, batch).items()):
                        memory.append({"schedule": schedule, "stage": k, "group": step._mpmd.group[k], "phase": phase,
                                       **hlo.memory_stats(c)})
    print()
    head = f"{'run':<5} {'G':>3} {'schedule':<16} {'ops/step':>8} {'programs':>8} {'host ms':>8} {'ms/op':>6} " \
           f"{'step ms':>8}"
    print(head)
    print("-" * len(head))
    for r in records:
        sched = r["schedule"] + (f" (v={r['chunks']})" if r["chunks"] > 1 else "")
        print(f"{r['kind']:<5} {r['grad_accum']:>3} {sched:<16} {r['ops']:>8} {r['programs']:>8} "
              f"{1e3 * r['host_s']:>8.1f} {r['host_ms_per_op']:>6.3f} {1e3 * r['step_s']:>8.1f}")
    print()
    print(f"{'schedule':<8} {'stage':>5} {'group':>5} {'phase':<12} {'argument KiB':>12} {'output KiB':>10} "
          f"{'temp KiB':>9}")
    for m in memory:
        print(f"{m['schedule']:<8} {m['stage']:>5} {m['group']:>5} {m['phase']:<12} {m['argument'] / 1024:>12.1f} "
              f"{m['output'] / 1024:>10.1f} {m['temp'] / 1024:>9.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": records, "stage_memory": memory, "devices": n,
                                            "dispatch_floor_ms": floor,
                                            "jax": jax.__version__}, indent=2))


if __name__ == "__main__":
    main()
