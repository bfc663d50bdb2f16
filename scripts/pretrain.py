"""Scripted pretraining with mistjax.

Examples (with the project's venv: make .venv/.installed-core, then .venv/bin/python):
  python scripts/pretrain.py --model gpt3-tiny --steps 100 --global-batch 16 --seq-len 32
  python scripts/pretrain.py --model llama-tiny --plan auto     # tune a plan on the first batch
  python scripts/pretrain.py --model llama-small --data tokens.bin --token-dtype uint16 --plan plan.json \\
      --metrics metrics.jsonl --ckpt-dir ckpt --ckpt-every 50 --resume --hardware h100
  # text (.txt/.jsonl/.parquet files, a folder or a glob), tokenized once with a local tokenizer.json and cached:
  python scripts/pretrain.py --model gpt3-1.3b --data corpus/ --tokenizer gpt2/tokenizer.json --seq-len 1024 \\
      --plan auto --ckpt-dir ckpt --resume
  # two processes (run one per host; process 0's address is the coordinator):
  python scripts/pretrain.py --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0 --plan plan.json
  python scripts/pretrain.py --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 1 --plan plan.json

See docs/pretraining.md for token files, text corpora, plans, checkpoints and MFU.
"""


import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Importing mistjax does not start a JAX backend, so jax.distributed can still be initialised in main().
import tyro  # noqa: E402

from mistjax.distributed import (  # noqa: E402
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_INIT_TIMEOUT_S,
    DistributedError,
    initialize,
)
from mistjax.train.checkpoint import CheckpointError, SaveCost  # noqa: E402
from mistjax.train.loop import (  # noqa: E402
    TrainConfig,
    TrainingDivergedError,
    TrainResult,
    run_training,
    save_loss_plot,
)

# Errors that are the user's to fix: reported as one line, without a traceback.
USER_ERRORS = (CheckpointError, DistributedError, TrainingDivergedError, ValueError)


@dataclass(frozen=True)
class Launch:
    """How the script runs (the run itself is `TrainConfig`)."""

    plot: str | None = None  # write the loss curve to this PNG
    # a progress bar on a terminal (--no-progress: a log line every --log-every steps instead)
    progress: bool = True
    coordinator: str | None = None  # HOST:PORT of process 0 (or JAX_COORDINATOR_ADDRESS)
    num_processes: int | None = None  # number of processes (or JAX_NUM_PROCESSES)
    process_id: int | None = None  # this process, 0 .. N-1 (or JAX_PROCESS_ID)
    local_devices: int | None = None  # CPU devices to simulate in this process
    dist_timeout: int = DEFAULT_INIT_TIMEOUT_S  # seconds to wait for all processes to join
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT_S  # seconds after which a silent process is declared dead


@dataclass(frozen=True)
class Args:
    """Flags of scripts/pretrain.py: every field of TrainConfig and of Launch (tyro, one definition each)."""

    train: Annotated[TrainConfig, tyro.conf.OmitArgPrefixes]
    launch: Annotated[Launch, tyro.conf.OmitArgPrefixes]


def parse_args(argv: list[str] | None = None) -> Args:
    """The flags, generated from `TrainConfig` and `Launch`; a bad value exits with a one-line error."""
    try:
        return tyro.cli(Args, args=argv, description=__doc__)
    except ValueError as e:  # a TrainConfig check (e.g. --global-batch 0)
        _fail(str(e), multi_process=False)
        raise  # unreachable: _fail exits


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


def _save_costs(costs: list[SaveCost]) -> str:
    """How long saves held up training (host copies) and how long their background writes took."""
    if not costs:
        return ""
    blocked = sum(c.blocking_s for c in costs) / len(costs)
    written = [c.write_s for c in costs if c.write_s is not None]
    text = f" (each save held training up {blocked:.2f} s on average"
    return text + (f"; written in {sum(written) / len(written):.2f} s in the background)" if written else ")")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg, a = args.train, args.launch
    warnings.formatwarning = _format_warning  # one readable line instead of file:line and source
    try:
        setup = initialize(a.coordinator, a.num_processes, a.process_id, a.local_devices,
                           timeout_s=a.dist_timeout, heartbeat_timeout_s=a.heartbeat_timeout)
    except DistributedError as e:
        _fail(str(e), multi_process=False)
        return
    try:
        result = run_training(cfg, progress=a.progress)
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
    if not result.losses:
        print(f"nothing to do: the checkpoint is already at step {result.start_step} (--steps {cfg.steps})")
        return
    line = f"final loss {result.losses[-1]:.4f} at step {result.start_step + len(result.losses)}"
    if result.mfu:
        line += f", MFU {100 * result.mfu[-1]:.3g}% on {cfg.hardware}"
    print(line)
    if result.checkpoints:
        print(f"checkpoints saved at step(s) {', '.join(map(str, result.checkpoints))} in {cfg.ckpt_dir}"
              + _save_costs(result.checkpoint_costs))
    if a.plot:
        _plot(result, a.plot, cfg)


def _plot(result: TrainResult, path: str, cfg: TrainConfig) -> None:
    """The loss curve of every step: those before a resume read back from the --metrics log, then this run's."""
    points = [*result.earlier_losses, *((result.start_step + 1 + k, x) for k, x in enumerate(result.losses))]
    if len(result.earlier_losses) < result.start_step:
        print(f"note: the plot starts at step {points[0][0]}: the losses of the steps before the resume are read "
              "from the --metrics log" + ("" if cfg.metrics else ", and this run has none (pass the same --metrics "
                                          "file to every run)"))
    save_loss_plot([x for _, x in points], path, title=cfg.model, steps=[k for k, _ in points])


if __name__ == "__main__":
    main()
