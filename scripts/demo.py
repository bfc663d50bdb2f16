"""`make demo`: tune a plan for a small GPT on 8 simulated CPU devices, train it and plot the loss.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/demo.py --out demo_out
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# mistjax before jax: it chooses the platform quietly (no CUDA plugin noise on a machine without a GPU).
from mistjax.train.loop import TrainConfig, run_training, save_loss_plot  # noqa: E402
import jax  # noqa: E402


def describe_shardings(state: object, limit: int = 8) -> str:
    """A few parameter leaves with their shapes and shardings, as lines of text."""
    lines = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0][:limit]:  # type: ignore[attr-defined]
        name = jax.tree_util.keystr(path).replace(".value", "")
        lines.append(f"  {name:<48} {str(leaf.shape):<18} {leaf.sharding.spec}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="demo_out", help="folder for the loss curve and metrics")
    parser.add_argument("--model", default="gpt3-tiny")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}")
    # plan="auto": mistjax.autoshard traces the step, tunes a plan for the 8 devices (cpu preset) and runs it.
    cfg = TrainConfig(model=args.model, steps=args.steps, global_batch=16, seq_len=32, plan="auto",
                      metrics=str(out / "metrics.jsonl"))
    (out / "metrics.jsonl").unlink(missing_ok=True)
    result = run_training(cfg)
    print(result.plan.summary())
    print("parameter shardings (first leaves):")
    print(describe_shardings(result.state))
    png = out / "loss.png"
    save_loss_plot(result.losses, png, title=f"{args.model} on {jax.device_count()} simulated devices")
    print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}; wrote {png}")


if __name__ == "__main__":
    main()
