"""The training loop shared by `make demo` and `scripts/pretrain.py`."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

import models
from mistjax.api import autoshard, value_and_grad
from mistjax.plan import Plan, PlanError, uniform_plan
from mistjax.train.data import MemmapTokens, SyntheticTokens
from mistjax.train.loss import make_loss_fn
from mistjax.train.state import TrainState, make_optimizer


@dataclass(frozen=True)
class TrainConfig:
    """One training run (all flags of scripts/pretrain.py)."""

    model: str = "gpt3-tiny"  # preset name (python -m models --list)
    steps: int = 50  # optimizer steps to run
    global_batch: int = 16  # sequences per optimizer step
    seq_len: int = 32  # tokens per sequence
    learning_rate: float = 3e-3  # peak AdamW learning rate
    warmup_steps: int = 5  # linear warm-up before cosine decay
    seed: int = 0  # parameter init and data order
    data: str | None = None  # flat uint16/uint32 token file; None = synthetic repeating data
    token_dtype: str = "uint16"  # dtype of the token file
    plan: str | None = None  # plan JSON file; None = data parallelism over all devices
    compute_dtype: str = "float32"  # bfloat16 for mixed precision (fp32 master weights)
    metrics: str | None = None  # JSON-lines file, one record per step
    log_every: int = 1  # progress-bar refresh interval in steps


@dataclass
class TrainResult:
    """What a run produced."""

    losses: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    plan: Plan | None = None
    state: Any = None


def make_train_step(loss_fn: Callable[..., Any]) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    """The ordinary train step: mistjax.value_and_grad, then the optimizer."""

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        loss, grads = value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return train_step


def build_data(cfg: TrainConfig, vocab_size: int) -> SyntheticTokens | MemmapTokens:
    if cfg.data is None:
        return SyntheticTokens(vocab_size, cfg.seq_len, cfg.global_batch, seed=cfg.seed)
    return MemmapTokens(cfg.data, seq_len=cfg.seq_len, batch_size=cfg.global_batch, dtype=cfg.token_dtype,
                        vocab_size=vocab_size, seed=cfg.seed)


def resolve_plan(cfg: TrainConfig, num_layers: int, num_devices: int) -> Plan:
    if cfg.plan is not None:
        return Plan.load(cfg.plan)
    if cfg.global_batch % num_devices:
        raise PlanError(f"global batch {cfg.global_batch} is not divisible by the {num_devices} devices; "
                        "use a multiple of the device count")
    return uniform_plan(num_layers, num_devices, micro_batch=cfg.global_batch // num_devices)


def run_training(cfg: TrainConfig, *, mesh: Any = None, progress: bool = True) -> TrainResult:
    """Train `cfg.model` for `cfg.steps` steps and return the loss curve."""
    model_cfg = models.get_config(cfg.model).replace(dtype=cfg.compute_dtype)
    if cfg.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
    model = models.build(model_cfg, rngs=nnx.Rngs(cfg.seed))
    tx = make_optimizer(cfg.learning_rate, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
    state = TrainState.create(model, tx)
    data = build_data(cfg, model_cfg.vocab_size)
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()
    plan = resolve_plan(cfg, model_cfg.num_layers, len(devices))
    step = autoshard(make_train_step(make_loss_fn(state.graphdef)), mesh if mesh is not None else devices,
                     plan=plan)
    state = step.place(state, data.batch(0))
    result = TrainResult(plan=plan)
    metrics_file = open(cfg.metrics, "a") if cfg.metrics else None  # noqa: SIM115
    tokens = cfg.global_batch * cfg.seq_len
    bar = _progress(cfg.steps, progress)
    try:
        for i in range(cfg.steps):
            t0 = time.perf_counter()
            state, metrics = step(state, data.batch(i))
            loss = float(metrics["loss"])
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {i}; lower --lr or check the data")
            result.losses.append(loss)
            result.tokens_per_s.append(tokens / dt)
            if metrics_file is not None:
                metrics_file.write(json.dumps({"step": i, "loss": loss, "tokens_per_s": tokens / dt}) + "\n")
                metrics_file.flush()
            if bar is not None and (i % cfg.log_every == 0 or i == cfg.steps - 1):
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens / dt:,.0f}")
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        if metrics_file is not None:
            metrics_file.close()
    result.state = state
    return result


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)


def save_loss_plot(losses: list[float], path: str | Path, title: str = "training loss") -> None:
    """Write the loss curve as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(np.arange(len(losses)), losses, lw=1.8, color="#1f77b4")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
