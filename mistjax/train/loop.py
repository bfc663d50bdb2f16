"""The training loop shared by `make demo` and `scripts/pretrain.py`.

A run is fully determined by its `TrainConfig`: parameters come from ``seed``, and the data
source returns the batch of step ``s`` from ``seed + s`` alone. Resuming therefore only needs
the train state (parameters, optimizer state, step) from a checkpoint: the steps after it see
exactly the batches an uninterrupted run would have seen, and produce bit-identical losses.

Steps are numbered from 1 everywhere (log lines, the metrics log, errors, checkpoints): step ``k`` is the
``k``-th optimizer step, and the checkpoint of step ``k`` holds the state after it, so a run resumed from it
continues with step ``k + 1``.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, NotRequired, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from flax import nnx

import models
from mistjax.api import autoshard, value_and_grad
from mistjax.api.mfu import ModelFlops, mfu
from mistjax.api.precision import with_master_weights
from mistjax.core.plan import Plan, PlanError, uniform_plan
from mistjax.core.types import Batch, LossFn, PyTree
from mistjax.distributed import DistributedError, is_primary, peer_failure
from mistjax.runtime.mpmd_state import is_staged, per_leaf_on_host
from mistjax.runtime.step import ShardedStep
from mistjax.train.checkpoint import Checkpointer, CheckpointError, CheckpointMeta, SaveCost
from mistjax.train.data import DataError, MemmapTokens, SyntheticTokens, TokenSource
from mistjax.train.metrics import MetricsLog, peak_flops
from mistjax.train.state import TrainState, make_optimizer
from mistjax.train.text_data import TextTokens, is_token_file
from models.loss import make_loss_fn
from models.spec import load_config

if TYPE_CHECKING:
    from jax.sharding import Mesh
    from tqdm import tqdm

# Config fields whose change on resume makes the continuation differ from an uninterrupted run.
_RESUME_SENSITIVE = ("steps", "global_batch", "seq_len", "learning_rate", "warmup_steps", "seed", "data", "token_dtype",
                     "tokenizer", "text_field", "eos_id", "compute_dtype", "param_dtype", "fp8")


class TrainingDivergedError(FloatingPointError):
    """The loss or the parameters became NaN or infinite."""


@dataclass(frozen=True)
class TrainConfig:
    """One training run. `scripts/pretrain.py` generates its flags from these fields (tyro): the comment
    after a field is its ``--help`` text."""

    # model preset (python -m models --list), a JSON file of models.ModelConfig fields, or a Hugging Face
    # config.json (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, Falcon): what `mistjax plan --model` accepts
    model: str = "gpt3-tiny"
    steps: int = 50  # total optimizer steps, counting those before a resume
    global_batch: int = 16  # sequences per optimizer step
    seq_len: int = 32  # tokens per sequence
    learning_rate: Annotated[float, tyro.conf.arg(aliases=("--lr",))] = 3e-3  # peak AdamW learning rate
    warmup_steps: Annotated[int, tyro.conf.arg(aliases=("--warmup",))] = 5  # linear warm-up steps before cosine decay
    seed: int = 0  # parameter init and data order
    data: Annotated[str | None, tyro.conf.arg(help=(
        "training data (default: synthetic tokens): a flat binary token file ending in .bin, or text: a .txt, "
        ".jsonl or .parquet file, a folder or a quoted glob of them, or a Hugging Face datasets save_to_disk "
        "folder; text needs --tokenizer"))] = None
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # dtype of a .bin token file
    tokenizer: str | None = None  # tokenizer.json (Hugging Face tokenizers), or a folder holding one, for text --data
    text_field: str = "text"  # the .jsonl field / .parquet or dataset column that holds each document's text
    eos_id: int | None = None  # id appended after every document; unset: the tokenizer's end-of-text token
    data_cache: str | None = None  # where text --data is tokenized to; unset: ~/.cache/mistjax/tokens
    plan: Annotated[str | None, tyro.conf.arg(help=(
        'plan JSON file, or "auto" to tune a plan on the first batch (mistjax.autoshard); default: data '
        "parallelism over all devices"))] = None
    compute_dtype: Annotated[Literal["float32", "bfloat16"], tyro.conf.arg(aliases=("--dtype",), help=(
        "matmul dtype; bfloat16 for mixed precision"))] = "float32"
    # Storage dtype of the weights: float32 (MaxText's default), or bfloat16 with an fp32 master copy in the
    # optimizer state (mistjax.with_master_weights; Megatron-LM's). `mistjax plan --param-dtype` prices the same.
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # Attention and MLP projections as FP8 GEMMs with tensorwise dynamic scales (models.ModelConfig.fp8): on
    # H100 / H200 / L4 they run on the fp8 tensor cores; elsewhere the operands are rounded to fp8 all the same.
    fp8: bool = False
    # JSON-lines file, one record per step (step from 1, loss, step_time_s, tokens_per_s, mfu, host_bytes_per_device)
    metrics: str | None = None
    log_every: int = 10  # without a progress bar (--no-progress, or output not a terminal): a log line every N steps
    ckpt_dir: str | None = None  # checkpoint directory (orbax: sharded, async, atomic); default: no checkpoints
    ckpt_every: int = 100  # save every N steps (and after the last step)
    keep: int = 3  # newest checkpoints kept; older ones are deleted
    resume: bool = False  # continue from the newest usable checkpoint in --ckpt-dir (start fresh if none)
    async_ckpt: bool = True  # write checkpoints in the background (--no-async-ckpt: in the foreground)
    # hardware preset for MFU, e.g. h100, a100-80gb, l4 (MFU = (6 N + 12 L H Q T) tokens/s / (devices peak): PaLM's
    # model FLOPs, mistjax.api.mfu)
    hardware: str | None = None

    def __post_init__(self) -> None:
        positive = {"steps": "--steps", "global_batch": "--global-batch", "seq_len": "--seq-len",
                    "ckpt_every": "--ckpt-every", "keep": "--keep", "log_every": "--log-every"}
        for name, flag in positive.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} {value!r}: must be a positive integer")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"--warmup {self.warmup_steps!r}: must be a non-negative integer")
        if not (isinstance(self.learning_rate, int | float) and math.isfinite(self.learning_rate)
                and self.learning_rate > 0):
            raise ValueError(f"--lr {self.learning_rate!r}: the learning rate must be a positive number, e.g. 3e-4")
        if self.token_dtype not in ("uint16", "uint32"):
            raise ValueError(f"--token-dtype {self.token_dtype!r}: use uint16 or uint32")
        if not self.text_field:
            raise ValueError("--text-field '': name the field that holds the text, e.g. --text-field text")
        if self.eos_id is not None and (isinstance(self.eos_id, bool) or self.eos_id < 0):
            raise ValueError(f"--eos-id {self.eos_id!r}: must be a token id (a non-negative integer)")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype {self.compute_dtype!r}: use float32 or bfloat16")
        if self.param_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--param-dtype {self.param_dtype!r}: use float32 or bfloat16")


@dataclass
class TrainResult:
    """What a run produced (the steps this process ran, not those before a resume)."""

    losses: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    plan: Plan | None = None
    state: TrainState | None = None  # the state after the last step
    start_step: int = 0  # steps done before this run (> 0 after a resume): this run's first step is start_step + 1
    mfu: list[float] = field(default_factory=list)  # per step, when the hardware is known
    # (step, loss) of the steps before a resume, read back from the metrics log (empty without --metrics)
    earlier_losses: list[tuple[int, float]] = field(default_factory=list)
    host_bytes_per_device: float = 0.0  # placed state kept in host memory by each device (offload)
    checkpoints: list[int] = field(default_factory=list)  # steps saved by this run
    checkpoint_costs: list[SaveCost] = field(default_factory=list)  # what each of those saves cost


StepMetrics = dict[str, jax.Array]  # what the train step returns besides the state: {"loss": scalar}


class StepRecord(TypedDict):
    """One line of the metrics log (`MetricsLog`): a step's loss and speed."""

    step: int  # from 1: the k-th optimizer step
    loss: float
    step_time_s: float
    tokens_per_s: float
    host_bytes_per_device: float  # placed state each device keeps in host memory (the plan's offload)
    mfu: NotRequired[float]  # when the hardware is known (``--hardware``)


def make_train_step(loss_fn: LossFn) -> Callable[[TrainState, Batch], tuple[TrainState, StepMetrics]]:
    """The ordinary train step: mistjax.value_and_grad, then the optimizer."""

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, StepMetrics]:
        loss, grads = value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return train_step


def build_data(cfg: TrainConfig, vocab_size: int) -> TokenSource:
    """The run's data: synthetic tokens, a ``.bin`` token file, or a text corpus (tokenized once, cached).

    Raises:
      DataError: unusable data or data flags; the message names the flag and the fix.
    """
    if cfg.data is None:
        return SyntheticTokens(vocab_size, cfg.seq_len, cfg.global_batch, seed=cfg.seed)
    if is_token_file(cfg.data):
        if cfg.tokenizer is not None:
            warnings.warn(f"--tokenizer is ignored: --data {cfg.data!r} is a token file (already tokenized)",
                          RuntimeWarning, stacklevel=2)
        return MemmapTokens(cfg.data, seq_len=cfg.seq_len, batch_size=cfg.global_batch, dtype=cfg.token_dtype,
                            vocab_size=vocab_size, seed=cfg.seed)
    _check_metrics_outside(cfg.data, cfg.metrics)
    return TextTokens(cfg.data, tokenizer=cfg.tokenizer, seq_len=cfg.seq_len, batch_size=cfg.global_batch,
                      vocab_size=vocab_size, seed=cfg.seed, text_field=cfg.text_field, eos_id=cfg.eos_id,
                      cache_dir=cfg.data_cache, log=_log)


def _check_metrics_outside(data: str, metrics: str | None) -> None:
    """Refuse a JSON-lines metrics file inside a --data folder: the folder is read recursively, so the run
    would train on its own log, and the corpus (and its token cache) would change with every step."""
    folder = Path(data).expanduser()
    if metrics is None or not folder.is_dir():
        return
    if Path(metrics).expanduser().resolve().is_relative_to(folder.resolve()):
        raise DataError(f"--metrics {metrics!r} lies inside the --data folder {data!r}, which is read recursively "
                        "as training text: write the metrics file outside the data folder")


def resolve_plan(cfg: TrainConfig, num_layers: int, num_devices: int) -> Plan:
    if cfg.plan is not None:
        return Plan.load(cfg.plan)
    if cfg.global_batch % num_devices:
        raise PlanError(f"global batch {cfg.global_batch} is not divisible by the {num_devices} devices; "
                        "use a multiple of the device count")
    # Data parallelism over every device with ZeRO-1 (the optimizer state sharded): docs/pretraining.md.
    return uniform_plan(num_layers, num_devices, micro_batch=cfg.global_batch // num_devices, shard_opt=True)


def make_global_batch(step: ShardedStep, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """The host batch as global arrays on the shardings the sharded step expects.

    Every process computes the same global batch (the data source is seeded by step), and each
    copies only the rows of its own devices. `jax.device_put` of a host array onto a sharding
    spanning several processes would also work, but it all-gathers the whole batch every step
    to check that all processes passed the same value.
    """
    shardings = step.batch_shardings(batch)
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]),
                        batch, shardings)


def _leaves_finite(leaves: list[jax.Array]) -> jax.Array:
    on_device = [jax.device_put(x, jax.memory.Space.Device) if jax.typeof(x).memory_space == jax.memory.Space.Host
                 else x for x in leaves]  # offloaded leaves are read on device
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in on_device])


def _all_finite(tree: PyTree) -> bool:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    # Per leaf, on the leaf's own devices (a pipelined plan's state lives on several sub-meshes).
    return bool(np.all(per_leaf_on_host(_leaves_finite, leaves)))


def _run_meta(cfg: TrainConfig, plan: Plan) -> CheckpointMeta:
    """What a checkpoint records about the run, besides the arrays."""
    return {"model": cfg.model, "plan": plan.to_dict(), "data_seed": cfg.seed, "config": dataclasses.asdict(cfg),
            "process_count": jax.process_count(), "device_count": jax.device_count()}


def _plan_layout(plan: Mapping[str, object]) -> dict[str, object]:
    """The plan fields that shape the run, flattened (``stages[0].shard_grads``) for readable diffs.

    The cost model's prediction and the fingerprints describe a plan but change nothing in the run.
    """
    out: dict[str, object] = {}
    for key, value in plan.items():
        if key in ("prediction", "fingerprints"):
            continue
        if key == "stages":
            out["num_stages"] = len(value)
            for i, stage in enumerate(value):
                out.update({f"stages[{i}].{k}": list(v) if isinstance(v, tuple) else v for k, v in stage.items()})
        else:
            out[key] = value
    return out


def _plan_brief(plan: Mapping[str, object]) -> str:
    """A plan in one phrase: ``pp 2 x dp 2 x tp 2, ZeRO 3/3, micro-batch 2 x 2``."""
    stages = plan.get("stages") or [{}]
    zero = "/".join(str(3 if s.get("shard_weights") else 2 if s.get("shard_grads") else int(bool(s.get("shard_opt"))))
                    for s in stages)
    offload = any(float(s.get(f"offload_{k}", 0) or 0) for s in stages for k in ("weights", "grads", "opt", "acts"))
    return (f"pp {len(stages)} x dp {plan.get('dp')} x tp {plan.get('tp')}, ZeRO {zero}"
            f"{', offload' if offload else ''}, micro-batch {plan.get('micro_batch')} x {plan.get('grad_accum')}")


def _check_compatible(meta: CheckpointMeta, cfg: TrainConfig, plan: Plan, directory: Path, data: TokenSource
                      ) -> None:
    """Refuse a checkpoint of another model; say what a new plan or cluster changes; warn about settings
    that make the continuation differ from an uninterrupted run."""
    where = f"{str(directory)!r} (step {meta['step']})"
    if meta.get("model") != cfg.model:
        raise CheckpointError(f"cannot resume: the checkpoint in {where} was written by model {meta.get('model')!r}, "
                              f"but this run uses model {cfg.model!r}; pass --model {meta.get('model')} or use "
                              "another --ckpt-dir")
    old, new = meta.get("plan") or {}, plan.to_dict()
    if _plan_layout(old) != _plan_layout(new):
        _log(f"note: resuming {where} under another plan ({_plan_brief(old)} -> {_plan_brief(new)}); the saved "
             "arrays are placed as this plan wants, and the loss continues as before up to float reassociation")
    was = (meta.get("process_count"), meta.get("device_count"))
    if was != (jax.process_count(), jax.device_count()):
        _log(f"note: the checkpoint was written by {was[0]} process(es) with {was[1]} devices; this run has "
             f"{jax.process_count()} with {jax.device_count()}")
    config = meta.get("config", {})
    changed = [f"{k} {config[k]!r} -> {getattr(cfg, k)!r}" for k in _RESUME_SENSITIVE
               if k in config and config[k] != getattr(cfg, k)]
    saved = (meta.get("data_position") or {}).get("tokens_sha256")
    now = _data_fingerprint(data).get("tokens_sha256")
    if saved is not None and now is not None and saved != now:
        changed.append(f"the tokenized --data {cfg.data!r} differs from the checkpoint's (tokens sha256 "
                       f"{saved[:12]} -> {now[:12]}: files, tokenizer or --eos-id changed)")
    if changed:
        warnings.warn(f"resuming with changed settings ({'; '.join(changed)}): the continuation will differ "
                      "from an uninterrupted run", RuntimeWarning, stacklevel=3)


def _data_fingerprint(data: TokenSource) -> dict[str, str]:
    """What a checkpoint records of a tokenized text corpus: the token stream's hash (nothing for other sources,
    whose batches the config alone determines)."""
    return {"tokens_sha256": data.fingerprint} if isinstance(data, TextTokens) else {}


def _log(message: str) -> None:
    if is_primary():
        print(message, flush=True)


@dataclass
class _Setup:
    """Everything a run needs before its first step."""

    plan: Plan
    step: ShardedStep
    state: TrainState
    data: TokenSource
    num_devices: int
    start: int
    model: models.ModelConfig


def _prepare(cfg: TrainConfig, mesh: Mesh | None, ckpt: Checkpointer | None) -> _Setup:
    """Model, plan, sharded step and placed (or restored) state; cheap checks first."""
    model_cfg = load_config(cfg.model).replace(dtype=cfg.compute_dtype, fp8=cfg.fp8)  # a ValueError names --model
    if cfg.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
    data = build_data(cfg, model_cfg.vocab_size)
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()
    auto = cfg.plan == "auto"  # mistjax.autoshard tunes the plan on the first batch
    plan = None if auto else resolve_plan(cfg, model_cfg.num_layers, len(devices))
    if plan is not None:
        try:  # before the model build; the config names the field that refuses the tensor degree, and the fix
            model_cfg.check_tensor_parallel(plan.tp)
        except ValueError as e:
            raise PlanError(f"the plan's tp={plan.tp} cannot split model {cfg.model!r}: {e}") from None
    if plan is not None and ckpt is not None and cfg.resume and (newest := ckpt.newest_meta()) is not None:
        _check_compatible(newest, cfg, plan, ckpt.directory, data)  # before the (slow) model build
    model = models.build(model_cfg, rngs=nnx.Rngs(cfg.seed))
    tx = make_optimizer(cfg.learning_rate, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
    low = cfg.param_dtype != "float32"  # 16-bit weights: the optimizer updates an fp32 master copy
    state = TrainState.create(model, with_master_weights(tx) if low else tx,
                              param_dtype=cfg.param_dtype if low else None)
    step = autoshard(make_train_step(make_loss_fn(state.graphdef)), mesh if mesh is not None else devices,
                     plan=plan, **({"global_batch": cfg.global_batch} if auto else {}))
    state = step.place(state, data.batch(0))
    if auto:
        plan = step.plan
        if ckpt is not None and cfg.resume and (newest := ckpt.newest_meta()) is not None:
            _check_compatible(newest, cfg, plan, ckpt.directory, data)
    start = 0
    if ckpt is not None and cfg.resume:
        restored = ckpt.restore_latest(state)
        if restored is None:
            _log(f"no checkpoint in {str(ckpt.directory)!r} yet; starting from step 0")
        else:
            state, meta = restored
            start = int(meta["step"])
            _log(f"resumed from step {start} ({ckpt.directory / str(start)}: the state after step {start}); "
                 f"continuing with step {start + 1}")
    return _Setup(plan, step, state, data, len(devices), start, model_cfg)


def run_training(cfg: TrainConfig, *, mesh: Mesh | None = None, progress: bool = True) -> TrainResult:
    """Train `cfg.model` up to step `cfg.steps` and return what this run produced.

    Raises:
      CheckpointError: unwritable ``ckpt_dir`` (before any work), or an incompatible or
        unreadable checkpoint on resume.
      DataError, PlanError: unusable data or plan.
      TrainingDivergedError: NaN/inf loss or parameters; the last good checkpoint is kept.
      DistributedError: a peer process died during a multi-process run.
    """
    if cfg.steps < 1 or cfg.ckpt_every < 1:
        raise ValueError(f"steps ({cfg.steps}) and ckpt_every ({cfg.ckpt_every}) must be positive")
    if cfg.resume and not cfg.ckpt_dir:
        raise CheckpointError("--resume needs --ckpt-dir (the directory to resume from)")
    peak = peak_flops(cfg.hardware, cfg.compute_dtype) if cfg.hardware else None
    # Settings that can be checked without the model go first, so mistakes fail in seconds.
    ckpt = Checkpointer(cfg.ckpt_dir, keep=cfg.keep, async_save=cfg.async_ckpt) if cfg.ckpt_dir else None
    try:
        if ckpt is not None and not cfg.resume and ckpt.latest_step() is not None:
            raise CheckpointError(f"{str(ckpt.directory)!r} already holds checkpoints (newest: step "
                                  f"{ckpt.latest_step()}); pass --resume to continue that run, or choose an "
                                  "empty --ckpt-dir")
        setup = _prepare(cfg, mesh, ckpt)
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise
    _log(setup.step.summary())  # the plan (a tuned one too) and what each knob did, before the first step
    applied = setup.step.applied
    result = TrainResult(plan=setup.plan, start_step=setup.start,
                         host_bytes_per_device=float(applied.host_bytes) if applied is not None else 0.0)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(setup.state.params, is_leaf=is_staged))
    m = setup.model
    flops = ModelFlops(num_params, m.num_layers, m.num_heads, m.head_dim, cfg.seq_len)
    if peak is not None:
        _log(f"MFU = model FLOPs x tokens/s / (devices x peak): {flops.formula()}, {setup.num_devices} x "
             f"{peak / 1e12:.4g} TFLOP/s ({cfg.hardware}, {cfg.compute_dtype})")
    mfu_of = None if peak is None else partial(mfu, flops=flops, num_devices=setup.num_devices, peak=peak)
    log = MetricsLog(cfg.metrics, setup.start, enabled=is_primary())
    result.earlier_losses = [(r["step"], float(r["loss"])) for r in log.kept if isinstance(r.get("loss"), int | float)]
    reporter = _Reporter(cfg, result, log, _progress(cfg.steps, setup.start, progress and is_primary()), mfu_of)
    result.state = _train_steps(cfg, setup, ckpt, reporter)
    return result


def _train_steps(cfg: TrainConfig, setup: _Setup, ckpt: Checkpointer | None, reporter: _Reporter) -> TrainState:
    """Steps ``setup.start`` .. ``cfg.steps - 1``: each reported, the state checkpointed every ``ckpt_every``;
    the reporter and the checkpointer are closed on the way out. Returns the last state."""
    state, run_meta = setup.state, _run_meta(cfg, setup.plan)
    failed_peer = False
    try:
        for i in range(setup.start, cfg.steps):
            state, loss, seconds = _one_step(setup, state, i)
            if not math.isfinite(loss):
                raise TrainingDivergedError(_diverged(f"the loss is {loss} at step {i + 1}", cfg, ckpt))
            reporter.step(i, loss, seconds)
            done = i + 1
            if ckpt is not None and (done % cfg.ckpt_every == 0 or done == cfg.steps):
                if not bool(_all_finite(state)):  # never let a checkpoint hold NaN/inf
                    raise TrainingDivergedError(_diverged(f"the parameters became NaN/inf in step {done}", cfg,
                                                          ckpt))
                position = {"next_batch": done, "seed": cfg.seed, "source": cfg.data or "synthetic",
                            **_data_fingerprint(setup.data)}
                ckpt.save(done, state, {**run_meta, "data_position": position})
                reporter.result.checkpoints.append(done)
    except DistributedError:  # a lost peer (`_one_step`) or one found by the distributed runtime
        failed_peer = True
        raise
    finally:
        reporter.close()
        # After a lost peer, finishing a save would wait on the dead process: leave it unfinished
        # (orbax never publishes a half-written checkpoint).
        if ckpt is not None and not failed_peer:
            reporter.result.checkpoint_costs = ckpt.costs()
            ckpt.close()
    return state


def _one_step(setup: _Setup, state: TrainState, i: int) -> tuple[TrainState, float, float]:
    """Step ``i + 1`` (the batch of index ``i``): the new state, its loss and its seconds.

    Raises:
      DistributedError: the step failed because a peer process was lost.
    """
    t0 = time.perf_counter()
    try:
        state, metrics = setup.step(state, make_global_batch(setup.step, setup.data.batch(i)))
        loss = float(metrics["loss"])  # waits for the step: the timing below is the real one
    except jax.errors.JaxRuntimeError as e:
        lost = peer_failure(e, i + 1)
        if lost is None:
            raise
        raise lost from e
    return state, loss, time.perf_counter() - t0


@dataclass
class _Reporter:
    """Where each step's numbers go: the run's result, the metrics log, and a progress bar or log lines."""

    cfg: TrainConfig
    result: TrainResult
    log: MetricsLog
    bar: tqdm | None  # None: a log line every ``log_every`` steps instead
    mfu_of: Callable[[float], float] | None  # tokens/s -> MFU, when the hardware is known

    def step(self, i: int, loss: float, seconds: float) -> None:
        """Record the step of batch ``i`` (step ``i + 1``)."""
        tokens_per_s = self.cfg.global_batch * self.cfg.seq_len / seconds
        record = StepRecord(step=i + 1, loss=loss, step_time_s=seconds, tokens_per_s=tokens_per_s,
                            host_bytes_per_device=self.result.host_bytes_per_device)
        if self.mfu_of is not None:
            record["mfu"] = self.mfu_of(tokens_per_s)
            self.result.mfu.append(record["mfu"])
        self.log.write(record)
        self.result.losses.append(loss)
        self.result.tokens_per_s.append(tokens_per_s)
        cfg, start = self.cfg, self.result.start_step
        if self.bar is not None:
            self.bar.set_postfix(_postfix(record), refresh=False)
            self.bar.update(1)
        elif is_primary() and ((i + 1) % cfg.log_every == 0 or i == cfg.steps - 1 or i == start):
            _log(_log_line(cfg.steps, record))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.log.close()


def _diverged(what: str, cfg: TrainConfig, ckpt: Checkpointer | None) -> str:
    if ckpt is not None:
        ckpt.wait()  # a save in flight holds a finite state: let it land before reporting
        last = ckpt.latest_step()
        kept = (f"the last checkpoint (step {last}) in {str(ckpt.directory)!r} is kept"
                if last is not None else "no checkpoint was written yet")
    else:
        kept = "there is no checkpoint (no --ckpt-dir)"
    fixes = [f"lower --lr (now {cfg.learning_rate:g})", f"lengthen --warmup (now {cfg.warmup_steps})"]
    if cfg.compute_dtype != "float32":
        fixes.append("use --dtype float32")
    if cfg.data is not None:
        fixes.append("check the data")
    return (f"training diverged: {what}; {kept}. To fix: {', '.join(fixes)}, then restart"
            + (" (with --resume to continue from the checkpoint)" if ckpt is not None else ""))


def _postfix(record: StepRecord) -> dict[str, str]:
    out = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
    if "mfu" in record:
        out["MFU"] = f"{100 * record['mfu']:.3g}%"
    return out


def _log_line(total: int, record: StepRecord) -> str:
    """One log line per `log_every` steps when there is no progress bar (no carriage returns in logs)."""
    return f"step {record['step']}/{total}: " + ", ".join(f"{k} {v}" for k, v in _postfix(record).items())


def _progress(total: int, start: int, enabled: bool) -> tqdm | None:
    """A tqdm bar on a terminal; None (plain log lines instead) when disabled or stderr is not a TTY."""
    import sys

    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)


def save_loss_plot(losses: list[float], path: str | Path, title: str = "training loss", first_step: int = 1,
                   steps: list[int] | None = None) -> None:
    """Write the loss curve as a PNG: ``losses[k]`` at step ``steps[k]``, or ``first_step + k`` (from 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    x = np.asarray(steps) if steps is not None else first_step + np.arange(len(losses))
    ax.plot(x, losses, lw=1.8, color="#1f77b4")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
