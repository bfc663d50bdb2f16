"""Scripted pretraining with mistjax.

Examples:
  python scripts/pretrain.py --model gpt3-tiny --steps 100 --global-batch 16 --seq-len 32
  python scripts/pretrain.py --model llama-small --data tokens.bin --token-dtype uint16 --plan plan.json \\
      --metrics metrics.jsonl --ckpt-dir ckpt --ckpt-every 50 --resume --hardware h100
  # two processes (run one per host; process 0's address is the coordinator):
  python scripts/pretrain.py --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0 --plan plan.json
  python scripts/pretrain.py --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 1 --plan plan.json

See docs/pretraining.md for token files, plans, checkpoints and MFU.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Importing mistjax does not start a JAX backend, so jax.distributed can still be initialised in main().
from mistjax.distributed import (  # noqa: E402
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_INIT_TIMEOUT_S,
    DistributedError,
    initialize,
)
from mistjax.train.checkpoint import CheckpointError  # noqa: E402
from mistjax.train.loop import TrainConfig, TrainingDivergedError, run_training, save_loss_plot  # noqa: E402

# Errors that are the user's to fix: reported as one line, without a traceback.
USER_ERRORS = (CheckpointError, DistributedError, TrainingDivergedError, ValueError)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", default=d.model, metavar="NAME", help="model preset, see `python -m models --list` (%(default)s)")
    add("--steps", type=int, default=d.steps, metavar="N", help="total optimizer steps, counting those before a "
                                                                "resume (%(default)s)")
    add("--global-batch", type=int, default=d.global_batch, metavar="N", help="sequences per step (%(default)s)")
    add("--seq-len", type=int, default=d.seq_len, metavar="N", help="tokens per sequence (%(default)s)")
    add("--lr", type=float, default=d.learning_rate, metavar="LR", help="peak AdamW learning rate (%(default)s)")
    add("--warmup", type=int, default=d.warmup_steps, metavar="N", help="linear warm-up steps (%(default)s)")
    add("--seed", type=int, default=d.seed, metavar="N", help="init and data seed (%(default)s)")
    add("--data", default=None, metavar="FILE", help="flat binary token file (default: synthetic tokens)")
    add("--token-dtype", default=d.token_dtype, choices=["uint16", "uint32"], help="token file dtype (%(default)s)")
    add("--plan", default=None, metavar="FILE", help="plan JSON (default: data parallelism over all devices)")
    add("--dtype", default=d.compute_dtype, choices=["float32", "bfloat16"], help="compute dtype (%(default)s)")
    add("--plot", default=None, metavar="PNG", help="write the loss curve here")
    add("--no-progress", action="store_true", help="no progress bar")

    add = p.add_argument_group("metrics").add_argument
    add("--metrics", default=None, metavar="FILE", help="JSON lines, one record per step (step, loss, step_time_s, "
                                                        "tokens_per_s, mfu); a resumed run continues the file")
    add("--hardware", default=None, metavar="PRESET", help="hardware preset for MFU, e.g. h100, a100-80gb, l4; "
                                                           "MFU = 6*params*tokens/s / (devices*peak)")

    add = p.add_argument_group("checkpoints").add_argument
    add("--ckpt-dir", default=None, metavar="DIR", help="checkpoint directory (orbax: sharded, async, atomic)")
    add("--ckpt-every", type=int, default=d.ckpt_every, metavar="N", help="save every N steps and after the "
                                                                          "last (%(default)s)")
    add("--keep", type=int, default=d.keep, metavar="N", help="keep the newest N checkpoints (%(default)s)")
    add("--resume", action="store_true", help="continue from the newest usable checkpoint in --ckpt-dir "
                                              "(start fresh if there is none)")
    add("--sync-ckpt", action="store_true", help="write checkpoints in the foreground")

    add = p.add_argument_group("multi-process (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                               "JAX_PROCESS_ID)").add_argument
    add("--coordinator", default=None, metavar="HOST:PORT", help="address of process 0 and a free port")
    add("--num-processes", type=int, default=None, metavar="N", help="number of processes")
    add("--process-id", type=int, default=None, metavar="I", help="this process, 0 .. N-1")
    add("--local-devices", type=int, default=None, metavar="N", help="CPU devices to simulate in this process")
    add("--dist-timeout", type=int, default=DEFAULT_INIT_TIMEOUT_S, metavar="S",
        help="seconds to wait for all processes to join (%(default)s)")
    add("--heartbeat-timeout", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT_S, metavar="S",
        help="seconds after which a silent process is declared dead and the run stops (%(default)s)")
    return p.parse_args(argv)


def _fail(message: str, multi_process: bool) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    if multi_process:
        # A clean interpreter exit would wait at JAX's shutdown barrier for peers that may be dead
        # or still training; leaving at once lets them notice (connection reset / heartbeat) quickly.
        sys.stdout.flush()
        os._exit(1)
    sys.exit(1)


def _format_warning(message: warnings.WarningMessage | str, category: type[Warning], *args: object,
                    **kwargs: object) -> str:
    return f"warning: {message}\n"


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    warnings.formatwarning = _format_warning  # one readable line instead of file:line and source
    try:
        setup = initialize(a.coordinator, a.num_processes, a.process_id, a.local_devices,
                           timeout_s=a.dist_timeout, heartbeat_timeout_s=a.heartbeat_timeout)
    except DistributedError as e:
        _fail(str(e), multi_process=False)
        return
    cfg = TrainConfig(model=a.model, steps=a.steps, global_batch=a.global_batch, seq_len=a.seq_len,
                      learning_rate=a.lr, warmup_steps=a.warmup, seed=a.seed, data=a.data,
                      token_dtype=a.token_dtype, plan=a.plan, compute_dtype=a.dtype, metrics=a.metrics,
                      ckpt_dir=a.ckpt_dir, ckpt_every=a.ckpt_every, keep=a.keep, resume=a.resume,
                      async_ckpt=not a.sync_ckpt, hardware=a.hardware)
    try:
        result = run_training(cfg, progress=not a.no_progress)
    except USER_ERRORS as e:
        _fail(str(e), setup.multi_process)
        return
    except KeyboardInterrupt:
        _fail("interrupted; checkpoints written so far are kept (continue with --resume)", setup.multi_process)
        return
    except BaseException:
        if setup.multi_process:  # see _fail: do not wait for peers at exit
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        raise
    if setup.process_id != 0:
        return
    print(result.plan.summary())
    if not result.losses:
        print(f"nothing to do: the checkpoint is already at step {result.start_step} (--steps {cfg.steps})")
        return
    line = f"final loss {result.losses[-1]:.4f} at step {result.start_step + len(result.losses) - 1}"
    if result.mfu:
        line += f", MFU {100 * result.mfu[-1]:.3g}% on {a.hardware}"
    print(line)
    if result.checkpoints:
        print(f"checkpoints saved at step(s) {', '.join(map(str, result.checkpoints))} in {cfg.ckpt_dir}")
    if a.plot:
        save_loss_plot(result.losses, a.plot, title=a.model, first_step=result.start_step)


if __name__ == "__main__":
    main()
