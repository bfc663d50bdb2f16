"""Step time measured on this machine vs the cost model on a profile calibrated on the same machine.

Usage::

    python scripts/bench_time.py [--json OUT] [--rounds 8] [--block 3] [--warmup 2] [--quick] [--profile PROFILE.json]

On the simulated devices JAX sees (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)
the script first measures the devices with `mistjax.hardware.calibrate.calibrate` (what ``mistjax calibrate``
writes; ``--profile`` loads a saved one instead), then runs every plan of `PLANS` (tiny / small zoo models:
DP, ZeRO-1/2/3, MiCS, TP, remat policies, gradient accumulation, MPMD pipelines) through ``mistjax.autoshard``:
each plan's first call compiles and ``--warmup`` steps follow; then ``--rounds`` rounds run ``--block`` steps
of every plan each, all but a block's first timed (round-robin, so a load change on this shared host falls on
every plan alike), each step ended by ``jax.block_until_ready``. Each plan is predicted with the cost model
(`mistjax.cost.predict.analyze`) on the calibrated profile: one set of constants for every plan, nothing
fitted to the step times. Prints one
markdown row per plan (measured median, noise, predicted, predicted / measured) and the summary: Spearman
rank correlation and the median of ``|predicted / measured - 1|``. ``--json`` writes
``{"points": [...], "summary": {"n", "spearman", "median_abs_rel_err"}, ...}``. See docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import tyro  # noqa: E402

Z0, Z1 = dict(shard_opt=False), dict(shard_opt=True)
Z3 = dict(shard_opt=True, shard_grads=True, shard_weights=True)


@dataclass(frozen=True)
class Case:
    """One plan to time: a zoo model, its batch shape and the `uniform_plan` keywords (8 devices)."""

    label: str
    model: str
    seq: int
    global_batch: int
    knobs: dict[str, Any]


PLANS: tuple[Case, ...] = (
    Case("dp", "llama-small", 64, 16, dict(micro_batch=2, **Z0)),
    Case("zero1", "llama-small", 64, 16, dict(micro_batch=2, **Z1)),
    Case("zero3", "llama-small", 64, 16, dict(micro_batch=2, **Z3)),
    Case("mics p2 zero3", "llama-small", 64, 16, dict(micro_batch=2, shard_group=2, **Z3)),
    Case("tp2 zero1", "llama-small", 64, 16, dict(micro_batch=4, tp=2, **Z1)),
    Case("tp4 zero3 G2", "llama-small", 64, 16, dict(micro_batch=4, tp=4, grad_accum=2, **Z3)),
    Case("remat full", "llama-small", 64, 16, dict(micro_batch=2, remat_layers=4, **Z1)),
    Case("remat dots", "llama-small", 64, 16, dict(micro_batch=2, remat_layers=4, remat_policy="dots", **Z1)),
    Case("pp2 1f1b G4", "llama-small", 64, 16, dict(micro_batch=1, stages=2, grad_accum=4, **Z1)),
    Case("pp2 gpipe G2", "llama-small", 64, 16, dict(micro_batch=2, stages=2, grad_accum=2, schedule="gpipe", **Z0)),
    Case("dp b4", "gpt3-small", 64, 32, dict(micro_batch=4, **Z0)),
    Case("dp", "llama-tiny", 32, 16, dict(micro_batch=2, **Z0)),
    Case("pp2 1f1b G4", "gpt3-tiny", 32, 16, dict(micro_batch=1, stages=2, grad_accum=4, **Z1)),
)
QUICK: tuple[Case, ...] = (Case("dp", "llama-tiny", 32, 16, dict(micro_batch=2, **Z0)),
                          Case("zero3", "llama-tiny", 32, 16, dict(micro_batch=2, **Z3)))


@dataclass(frozen=True)
class Args:
    """Flags of scripts/bench_time.py."""

    json_out: Annotated[str | None, tyro.conf.arg(name="json")] = None  # write points and summary here
    rounds: int = 8  # rounds over every plan, each plan running ``block`` steps in a row per round
    block: int = 3  # steps per plan and round; all but the first are timed
    warmup: int = 2  # untimed steps per plan after the compiling one
    quick: bool = False  # two llama-tiny plans, a quick calibration (a smoke test, not a benchmark)
    profile: str | None = None  # a saved `mistjax calibrate` profile to use instead of calibrating now
    save_profile: str | None = None  # write the calibrated profile here


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation of two equally long sequences (ties get their average rank).

    Args:
      x: first sample.
      y: second sample, paired with ``x``.

    Returns:
      The Pearson correlation of the ranks; nan for fewer than two points or a constant sample.
    """
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} vs {len(y)} values")
    if len(x) < 2:
        return float("nan")
    rx, ry = _ranks(np.asarray(x, float)), _ranks(np.asarray(y, float))
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(len(v), dtype=float)
    for value in np.unique(v):  # ties: the mean of their ranks
        tied = v == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def summarize(measured: Sequence[float], predicted: Sequence[float]) -> dict[str, float]:
    """The summary of paired step times: ``n``, ``spearman`` and ``median_abs_rel_err`` (of predicted / measured).

    Args:
      measured: measured seconds per step, one per plan.
      predicted: predicted seconds per step, paired with ``measured``.
    """
    ratios = np.asarray(predicted, float) / np.asarray(measured, float)
    return {"n": len(ratios), "spearman": spearman(measured, predicted),
            "median_abs_rel_err": float(np.median(np.abs(ratios - 1.0))) if len(ratios) else float("nan")}


def noise(times: Sequence[float]) -> dict[str, float]:
    """Median, interquartile range over the median and (max - min) over the median of repeated timings."""
    med = statistics.median(times)
    q1, q3 = np.percentile(times, [25, 75])
    return {"median": med, "iqr_rel": float((q3 - q1) / med), "spread_rel": float((max(times) - min(times)) / med)}


def describe(case: Case, plan: Any) -> str:
    """Short plan text: model, batch shape and the plan's knobs."""
    s = plan.stages[0]
    parts = [f"pp{plan.num_stages} {plan.schedule}" if plan.num_stages > 1 else "", f"dp{plan.dp}",
             f"tp{plan.tp}" if plan.tp > 1 else "", f"p{plan.shard_group}" if plan.shard_group != plan.dp else "",
             f"z{s.zero_stage}", f"b{plan.micro_batch}", f"G{plan.grad_accum}" if plan.grad_accum > 1 else "",
             f"remat{s.remat_layers}:{s.remat_policy}" if s.remat_layers else ""]
    return f"{case.model} s{case.seq} gb{case.global_batch} " + " ".join(p for p in parts if p)


class Runner:
    """Builds each model's state and train step once, then times plans on all devices."""

    def __init__(self) -> None:
        self._models: dict[str, tuple[Any, Any, Any]] = {}

    def _model(self, name: str) -> tuple[Any, Any, Any]:
        if name not in self._models:
            import optax
            from flax import nnx

            import models
            from mistjax.train.loop import make_train_step
            from mistjax.train.state import TrainState

            cfg = models.get_config(name)
            state = TrainState.create(models.build(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3))
            self._models[name] = (cfg, state, make_train_step(models.make_loss_fn(state.graphdef)))
        return self._models[name]

    def plan(self, case: Case) -> Any:
        """The case's `Plan` on all devices."""
        import jax

        import mistjax

        return mistjax.uniform_plan(self._model(case.model)[0].num_layers, jax.device_count(), **case.knobs)

    def prepare(self, case: Case, plan: Any, warmup: int) -> Timed:
        """Compile the case's step, place its state and batch, and run ``warmup`` untimed steps."""
        import jax
        import jax.numpy as jnp

        import mistjax
        from mistjax.train.data import SyntheticTokens

        cfg, state0, train_step = self._model(case.model)
        batch = SyntheticTokens(cfg.vocab_size, case.seq, case.global_batch).batch(0)
        step = mistjax.autoshard(train_step, jax.devices(), plan=plan)
        t0 = time.perf_counter()
        state = step.place(jax.tree.map(jnp.copy, state0), batch)
        if plan.num_stages == 1:
            batch = step.place_batch(batch)
        timed = Timed(step, state, batch)
        timed.run()
        timed.compile_s = time.perf_counter() - t0
        for _ in range(warmup):
            timed.run()
        return timed


class Timed:
    """A compiled step with its own state and batch: each `run` is one step, ended by ``block_until_ready``."""

    def __init__(self, step: Any, state: Any, batch: Any) -> None:
        self.step, self.state, self.batch = step, state, batch
        self.compile_s = 0.0  # seconds of the first (compiling) call
        self.times_s: list[float] = []  # the timed steps
        self.loss = float("nan")

    def run(self) -> float:
        import jax

        t = time.perf_counter()
        self.state, m = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, m))
        self.loss = float(m["loss"])
        return time.perf_counter() - t


def time_round_robin(timed: Sequence[Timed], rounds: int, block: int) -> None:
    """``rounds`` rounds over every plan: a load change on a shared host falls on every plan alike instead
    of on the few timed while it lasts. Each plan runs ``block`` steps in a row per round and the first of
    them is not timed (the switch from another program leaves its caches cold)."""
    for _ in range(rounds):
        for t in timed:
            t.run()
            t.times_s.extend(t.run() for _ in range(block - 1))


def predict(case: Case, plan: Any, cluster: Any) -> Any:
    """The cost model's `Analysis` of the case's plan on ``cluster``."""
    import models
    from mistjax.cost.predict import analyze

    wl = models.workload(models.get_config(case.model), case.seq, case.global_batch)
    return analyze(wl, plan, cluster)


def calibrated(args: Args) -> Any:
    """The cluster profile: loaded from ``--profile`` or measured now by `mistjax.hardware.calibrate`."""
    from mistjax.hardware import ClusterSpec
    from mistjax.hardware.calibrate import calibrate

    if args.profile:
        return ClusterSpec.from_json(Path(args.profile).read_text())
    cluster = calibrate(name="bench_time", quick=args.quick, log=lambda s: print(f"calibrate: {s}", flush=True))
    if args.save_profile:
        Path(args.save_profile).write_text(cluster.to_json())
    return cluster


def _table(header: Sequence[str], rows: list[Sequence[Any]], right_from: int = 1) -> str:
    """A GitHub-markdown table (numbers right-aligned from column ``right_from``)."""
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def points_table(points: list[dict[str, Any]]) -> str:
    """One markdown row per plan: measured median and noise, predicted, ratio, predicted dispatch."""
    rows = [[p["label"], p["plan"], f"{1e3 * p['measured_s']:.1f}", f"{100 * p['noise_iqr']:.0f}%",
             f"{100 * p['noise_spread']:.0f}%", f"{1e3 * p['predicted_s']:.1f}", f"{p['ratio']:.2f}",
             f"{1e3 * p['predicted_dispatch_s']:.1f}", f"{p['compile_s']:.1f}"] for p in points]
    return _table(["plan", "shape", "measured ms", "IQR", "max-min", "predicted ms", "pred/meas", "dispatch ms",
                   "compile s"], rows, right_from=2)


def _point(case: Case, plan: Any, timing: Timed, a: Any) -> dict[str, Any]:
    n = noise(timing.times_s)
    return {"label": case.label, "model": case.model, "seq": case.seq, "global_batch": case.global_batch,
            "plan": describe(case, plan), "plan_json": json.loads(plan.to_json()), "measured_s": n["median"],
            "noise_iqr": n["iqr_rel"], "noise_spread": n["spread_rel"], "times_s": timing.times_s,
            "compile_s": timing.compile_s, "predicted_s": a.step_time, "predicted_dispatch_s": a.dispatch_time,
            "ratio": a.step_time / n["median"], "loss": timing.loss}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Calibrate, time and predict every plan; print the tables; return (and optionally write) the results."""
    args = tyro.cli(Args, args=argv, description=__doc__)
    import jax

    t_start = time.perf_counter()
    cluster = calibrated(args)
    cases = QUICK if args.quick else PLANS
    rounds, block, warmup = (1, 3, 1) if args.quick else (args.rounds, args.block, args.warmup)
    runner = Runner()
    plans = [runner.plan(case) for case in cases]
    timed = []
    for case, plan in zip(cases, plans):
        timed.append(runner.prepare(case, plan, warmup))
        print(f"compiled {case.label:<18} {describe(case, plan):<48} {timed[-1].compile_s:5.1f} s", flush=True)
    time_round_robin(timed, rounds, block)
    points = [_point(case, plan, t, predict(case, plan, cluster)) for case, plan, t in zip(cases, plans, timed)]
    for p in points:
        print(f"{p['label']:<18} {p['plan']:<48} measured {1e3 * p['measured_s']:8.1f} ms "
              f"(IQR {100 * p['noise_iqr']:3.0f}%)  predicted {1e3 * p['predicted_s']:8.1f} ms  "
              f"ratio {p['ratio']:.2f}", flush=True)
    summary = summarize([p["measured_s"] for p in points], [p["predicted_s"] for p in points])
    print()
    print(points_table(points))
    print()
    print(f"n {summary['n']}, Spearman {summary['spearman']:.3f}, median |pred/meas - 1| "
          f"{100 * summary['median_abs_rel_err']:.1f}% ({jax.device_count()} x {jax.devices()[0].platform}, "
          f"{rounds} rounds of {block} steps ({block - 1} timed) after {warmup} warm-up, "
          f"{time.perf_counter() - t_start:.0f} s in all)")
    print(f"host load average (1 / 5 / 15 min) at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    out = {"points": points, "summary": summary, "rounds": rounds, "block": block, "warmup": warmup,
           "devices": jax.device_count(), "cpu_cores": os.cpu_count(), "load_average": os.getloadavg(),
           "wall_s": time.perf_counter() - t_start,
           "jax": jax.__version__, "profile": json.loads(cluster.to_json())}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json_out}")
    return out


if __name__ == "__main__":
    main()
