"""Measure tuned and baseline plans on one device and compare with the cost model's predictions.

For each model and emulated memory budget: tune (mistjax's space and the baselines' spaces, on a
one-device cluster of the given preset whose memory is the budget), then run every distinct plan
with `mistjax.autoshard(..., plan=...)`: median step time over a few steps, XLA's static peak
(``compiled.memory_analysis()``: argument + output + temp - alias) and the allocator's peak, and
the errors against the predictions. Results go to RESULTS_DIR/bench_gpu.json (rewritten after every
run, so a timeout keeps what finished).

GPU (H200): python scripts/bench_gpu.py --results RESULTS_DIR        (see scripts/bench_gpu.sh)
CPU check : python scripts/bench_gpu.py --results /tmp/r --dry-run   (gpt3-tiny, seconds)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GiB = 2**30


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", required=True, help="directory for bench_gpu.json")
    ap.add_argument("--models", default="gpt3-1.3b,gpt3-2.7b")
    ap.add_argument("--budgets-gib", default="32,64", help="emulated device memory sizes (GiB); 1.3B needs 25, 2.7B 48")
    ap.add_argument("--hardware", default="h200", help="preset whose compute and links the predictions use")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per plan (after one warm-up step)")
    ap.add_argument("--baselines", default="megatron,zero3-fsdp,mist")
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds per search")
    ap.add_argument("--deadline", type=float, default=450.0, help="stop starting new runs after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="gpt3-tiny on the host CPU with tiny budgets")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.models, a.budgets_gib, a.hardware = "gpt3-tiny", "0.004,0.008", "cpu"
        a.seq, a.global_batch, a.steps = 32, 16, 2
    return a


def _run_plan(cfg: Any, plan: Any, seq: int, batch_size: int, steps: int) -> dict[str, Any]:
    import jax
    import numpy as np
    from flax import nnx

    import mistjax
    import models
    from mistjax.train.loop import make_train_step
    from mistjax.train.state import TrainState, make_optimizer

    device = jax.devices()[0]
    state = TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), make_optimizer(1e-4))
    step = mistjax.autoshard(make_train_step(models.make_loss_fn(state.graphdef)), [device], plan=plan)
    tok = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch_size, seq + 1)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    state = step.place(state, batch)
    t0 = time.perf_counter()
    mem = step.lower(state, batch).compile().memory_analysis()
    compile_s = time.perf_counter() - t0
    xla_peak = None
    if mem is not None:
        xla_peak = float(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                         - mem.alias_size_in_bytes)
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        loss = float(metrics["loss"])  # waits for the step
        if i:
            times.append(time.perf_counter() - t)
    stats = device.memory_stats() or {}
    del state, step
    gc.collect()
    return {"step_time": statistics.median(times), "step_times": times, "loss": loss, "compile_s": compile_s,
            "xla_peak": xla_peak, "allocator_peak": float(stats.get("peak_bytes_in_use", 0.0)) or None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = _args(argv)
    if a.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import models
    from mistjax.hardware.presets import ClusterSpec
    from mistjax.tuning import tune

    warnings.simplefilter("ignore", RuntimeWarning)
    out_dir = Path(a.results)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    doc: dict[str, Any] = {"hardware": a.hardware, "seq": a.seq, "global_batch": a.global_batch, "runs": []}
    baselines = tuple(b for b in a.baselines.split(",") if b)
    for name in a.models.split(","):
        cfg = models.get_config(name).replace(dtype="float32" if a.dry_run else "bfloat16")
        workload = models.workload(cfg, a.seq, a.global_batch)
        for gib in (float(x) for x in a.budgets_gib.split(",")):
            cluster = ClusterSpec.preset(a.hardware, nodes=1, per_node=1).with_memory(gib * GiB)
            try:
                res = tune(workload, cluster, baselines=baselines, time_limit=a.time_limit)
            except RuntimeError as e:
                doc["runs"].append({"model": name, "budget_gib": gib, "error": str(e)})
                continue
            plans = {"mistjax": res.plan.as_plan()}
            plans.update({n: r.plan for n, r in res.baselines.items() if r.plan is not None})
            seen: dict[str, str] = {}
            for label, plan in plans.items():
                if time.perf_counter() - started > a.deadline:
                    doc["stopped"] = f"deadline {a.deadline:g} s reached"
                    break
                key = json.dumps({k: v for k, v in plan.to_dict().items() if k not in ("prediction", "fingerprints")},
                                 sort_keys=True)
                rec: dict[str, Any] = {"model": name, "budget_gib": gib, "plan_of": label, "plan": plan.to_dict(),
                                       "budget_bytes": cluster.memory_budget()}
                pred = plan.prediction
                rec["pred_step_time"], rec["pred_peak"] = pred.step_time, pred.peak_memory
                if key in seen:
                    rec["same_as"] = seen[key]
                else:
                    seen[key] = label
                    try:
                        rec.update(_run_plan(cfg, plan, a.seq, a.global_batch, a.steps))
                        rec["time_err"] = rec["pred_step_time"] / rec["step_time"] - 1.0
                        if rec["xla_peak"]:
                            rec["mem_err"] = rec["pred_peak"] / rec["xla_peak"] - 1.0
                    except Exception as e:  # an OOM or a runtime gap is a result too
                        rec["error"] = f"{type(e).__name__}: {e}"[:500]
                doc["runs"].append(rec)
                (out_dir / "bench_gpu.json").write_text(json.dumps(doc, indent=1))
                if "step_time" in rec:
                    what = (f"measured {rec['step_time']:.3f} s, predicted {rec['pred_step_time']:.3f} s "
                            f"({rec['time_err']:+.1%}); peak xla {(rec['xla_peak'] or 0) / GiB:.3f} GiB, predicted "
                            f"{rec['pred_peak'] / GiB:.3f} GiB")
                else:
                    what = rec.get("error", f"same plan as {rec.get('same_as')}")
                msg = f"{name} {gib:g} GiB {label:>10}: {what}"
                print(msg, flush=True)
    errs = [abs(r["time_err"]) for r in doc["runs"] if "time_err" in r]
    merrs = [abs(r["mem_err"]) for r in doc["runs"] if "mem_err" in r]
    doc["summary"] = {"runs": len(errs), "time_err_mean": statistics.mean(errs) if errs else None,
                      "mem_err_mean": statistics.mean(merrs) if merrs else None,
                      "wall_s": time.perf_counter() - started}
    (out_dir / "bench_gpu.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc["summary"]))
    return doc


if __name__ == "__main__":
    main()
