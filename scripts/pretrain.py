"""Scripted pretraining with mistjax.

Examples:
  python scripts/pretrain.py --model gpt3-tiny --steps 100 --global-batch 16 --seq-len 32
  python scripts/pretrain.py --model llama-small --data tokens.bin --token-dtype uint16 --plan plan.json \\
      --metrics metrics.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mistjax.train.loop import TrainConfig, run_training, save_loss_plot  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=d.model, help="model preset (see `python -m models --list`)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--global-batch", type=int, default=d.global_batch, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=d.learning_rate, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=d.warmup_steps, help="warm-up steps")
    p.add_argument("--seed", type=int, default=d.seed, help="init and data seed")
    p.add_argument("--data", default=None, help="flat binary token file (default: synthetic tokens)")
    p.add_argument("--token-dtype", default=d.token_dtype, choices=["uint16", "uint32"])
    p.add_argument("--plan", default=None, help="plan JSON (default: data parallelism)")
    p.add_argument("--dtype", default=d.compute_dtype, choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--metrics", default=None, help="write one JSON record per step to this file")
    p.add_argument("--plot", default=None, help="write the loss curve PNG here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    cfg = TrainConfig(model=a.model, steps=a.steps, global_batch=a.global_batch, seq_len=a.seq_len,
                      learning_rate=a.lr, warmup_steps=a.warmup, seed=a.seed, data=a.data,
                      token_dtype=a.token_dtype, plan=a.plan, compute_dtype=a.dtype, metrics=a.metrics)
    result = run_training(cfg, progress=not a.no_progress)
    print(result.plan.summary())
    print(f"final loss {result.losses[-1]:.4f}")
    if a.plot:
        save_loss_plot(result.losses, a.plot, title=a.model)


if __name__ == "__main__":
    main()
