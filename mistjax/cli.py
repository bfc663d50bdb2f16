"""The `mistjax` command: plan, explain, presets, calibrate.

Examples:
  mistjax plan --model gpt3-22b --cluster a100-40gb:4x8 --global-batch 512 --seq-len 4096
  mistjax plan --model llama-7b --cluster l4:1x8 --global-batch 128 --seq-len 2048 --json plan.json --plot plots/
  mistjax plan --model Meta-Llama-3-8B/config.json --cluster dgx-h100:1x8 --seq-len 8192   # a Hugging Face config
  mistjax explain plan.json --model llama-7b --cluster l4:1x8 --seq-len 2048 --verify   # XLA:GPU's memory too
  mistjax presets                               # the cluster presets: devices, memory, links, sources
  mistjax calibrate --out profile.json          # then: mistjax plan --cluster profile.json ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import tyro

from mistjax.core.plan import Plan, PlanError, format_bytes

if TYPE_CHECKING:
    from tqdm import tqdm

    from mistjax.api.mfu import ModelFlops
    from mistjax.cost.predict import Analysis
    from mistjax.cost.workload import Workload
    from mistjax.hardware.presets import ClusterSpec
    from mistjax.tuning.tuner import Progress, TuneResult
    from mistjax.validate.verified import TuneFn, VerifiedPlan, VerifyRound
    from models.config import ModelConfig


class CliError(Exception):
    """A user-facing error: printed without a traceback."""


class FlagError(CliError):
    """A flag's value is out of range: reported like a parse error (exit status 2). Raised by the flags'
    ``__post_init__``; not a ValueError, so that tyro leaves it to `main`, which prints it on one line."""

    def __init__(self, command: str, message: str) -> None:
        super().__init__(message)
        self.command = command


def _positive_int(command: str, flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise FlagError(command, f"argument {flag}: {value} must be a positive integer (at least 1)")


def _positive(command: str, flag: str, value: float | None, example: str) -> None:
    if value is not None and not value > 0:
        raise FlagError(command, f"argument {flag}: {value:g} must be positive ({example})")


def _hint(text: str) -> object:
    """What ``--help`` says in place of ``(default: None)``."""
    return tyro.conf.arg(help_behavior_hint=text)


@dataclass(frozen=True, kw_only=True)
class WorkloadArgs:
    """The flags `plan` and `explain` share: the model, the cluster, the batch and what to check.

    Each subcommand's dataclass is its flags (tyro: the comment on or above a field is its ``--help``);
    ``__post_init__`` checks the values (`FlagError`). `PlanArgs` redeclares ``model`` with ``field()``, not
    a bare annotation, which would inherit this class's ``None`` default and leave ``--model`` optional.
    """

    command: ClassVar[str] = ""

    # model preset (python -m models --list), a JSON file of models.ModelConfig fields, or a Hugging Face
    # config.json (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, Falcon; models.from_hf_config)
    model: str | None = None
    cluster: str = "a100-40gb:1x8"  # hardware preset NAME:NODESxPER_NODE, or a `mistjax calibrate` profile JSON
    global_batch: int | None = None  # sequences per step
    seq_len: int = 2048  # tokens per sequence
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype
    # storage dtype of the weights: float32 (MaxText's default) or bfloat16 with an fp32 master copy in the
    # optimizer state (Megatron-LM's; `pretrain --param-dtype`)
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # attention and MLP projections as FP8 GEMMs (models.ModelConfig.fp8; fp8 tensor cores: H100 / H200 / L4)
    fp8: bool = False
    # override device memory in GiB (emulate smaller cards)
    memory_gib: Annotated[float | None, _hint("(default: the cluster's)")] = None
    plot: Annotated[str | None, _hint("(default: no plots)")] = None  # write PNG plots into this folder
    # compile the plan for the cluster's GPUs with XLA:GPU (deviceless AOT, no GPU needed) and print its
    # per-device memory next to the prediction; `plan` re-tunes with the measured gap (up to 3 rounds) while
    # XLA's peak is above the planning budget; exit status 1 if the plan does not fit the card (needs pip
    # install 'mistjax[gpu-aot]'). Default: `plan` verifies where that compiler and the GPU's target spec are
    # installed (--no-verify skips it), `explain` does not
    verify: Annotated[bool | None, _hint("(default: `plan` where it can, `explain` no)")] = None

    def __post_init__(self) -> None:
        _positive_int(self.command, "--global-batch", self.global_batch)
        _positive_int(self.command, "--seq-len", self.seq_len)
        _positive(self.command, "--memory-gib", self.memory_gib, "GiB of device memory, e.g. 40")


@dataclass(frozen=True, kw_only=True)
class PlanArgs(WorkloadArgs):
    """Tune a plan for a model on a cluster and compare it with the baselines.
    Example: mistjax plan --model gpt3-22b --cluster a100-40gb:4x8 --global-batch 512 --seq-len 4096"""

    command: ClassVar[str] = "plan"

    # model preset (python -m models --list), a JSON file of models.ModelConfig fields, or a Hugging Face
    # config.json (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, Falcon; models.from_hf_config)
    model: str = field()
    global_batch: int = 64  # sequences per step
    time_limit: float = 60.0  # seconds for the search
    no_baselines: tyro.conf.FlagCreatePairsOff[bool] = False  # skip the baselines
    # progress bar over the search's outer keys on stderr (auto: on a terminal, searches over 1 s)
    progress: Literal["auto", "on", "off"] = "auto"
    json: Annotated[str | None, _hint("(default: not saved)")] = None  # save the plan as JSON

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self.command, "--time-limit", self.time_limit, "seconds for the search, e.g. 60")


@dataclass(frozen=True, kw_only=True)
class ExplainArgs(WorkloadArgs):
    """Show a saved plan and its predicted time and memory.
    Example: mistjax explain plan.json --model llama-7b --cluster l4:1x8 --seq-len 2048"""

    command: ClassVar[str] = "explain"

    plan: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="PLAN")]  # plan JSON file
    global_batch: Annotated[int | None, _hint("(default: the plan's)")] = None  # sequences per step
    # tokens per sequence; a value other than the one the plan was tuned for is refused (re-plan for it)
    seq_len: Annotated[int | None, _hint("(default: the plan's, else 2048)")] = None


@dataclass(frozen=True, kw_only=True)
class CalibrateArgs:
    """Measure this machine's devices into a cluster profile: matmul throughput, memory and collective
    bandwidth, host links and interference. Example: mistjax calibrate --out prof.json"""

    command: ClassVar[str] = "calibrate"

    out: str = "cluster_profile.json"  # where to write the profile JSON
    name: str = "calibrated"  # label stored in the profile
    quick: tyro.conf.FlagCreatePairsOff[bool] = False  # smaller, faster measurements


@dataclass(frozen=True, kw_only=True)
class PresetsArgs:
    """List the hardware presets --cluster names: device, memory, compute, links, XLA:GPU check and source.
    Example: mistjax presets"""

    command: ClassVar[str] = "presets"

    full: tyro.conf.FlagCreatePairsOff[bool] = False  # print each preset's whole source text


Args = PlanArgs | ExplainArgs | PresetsArgs | CalibrateArgs


def load_model_config(spec: str) -> ModelConfig:
    """A preset name (`python -m models --list`), a JSON file of `models.ModelConfig` fields, or a Hugging Face
    ``config.json`` (`models.spec.load_config`; a Hugging Face config's warnings print as one line each)."""
    from models.spec import ModelSpecError, load_config

    try:
        return load_config(spec)
    except ModelSpecError as e:
        raise CliError(str(e)) from e


def load_cluster(spec: str, memory_gib: float | None = None) -> ClusterSpec:
    """A preset like ``a100-40gb:4x8`` or a calibration profile JSON file."""
    from mistjax.hardware.presets import ClusterSpec

    path = Path(spec)
    try:
        if path.suffix == ".json" or path.is_file():
            if not path.is_file():
                raise CliError(f"cluster profile {spec!r} does not exist; run `mistjax calibrate --out {spec}`")
            cluster = ClusterSpec.from_json(path.read_text())
        else:
            cluster = ClusterSpec.parse(spec)
    except ValueError as e:
        raise CliError(f"bad cluster {spec!r}: {e}") from e
    return cluster.with_memory(memory_gib * 2**30) if memory_gib is not None else cluster


def _model_config(args: WorkloadArgs) -> ModelConfig:
    cfg = load_model_config(args.model).replace(dtype=args.dtype, param_dtype=args.param_dtype, fp8=args.fp8)
    if args.seq_len > cfg.max_seq_len:
        raise CliError(f"--seq-len {args.seq_len} exceeds {cfg.name}'s max_seq_len {cfg.max_seq_len}")
    return cfg


def _workload(args: WorkloadArgs, config: ModelConfig) -> Workload:
    import models
    from mistjax.core.moe import MoENotTunedError

    try:
        return models.workload(config, args.seq_len, args.global_batch)
    except MoENotTunedError as e:
        raise CliError(str(e)) from e


def cmd_plan(args: PlanArgs) -> int:
    import mistjax

    cluster = load_cluster(args.cluster, args.memory_gib)
    required = bool(args.verify)  # asked for: a failed compile is an error; by default only a warning
    if args.verify:
        _verify_ready(cluster)
    # default: verify where the GPU's compiler and a target spec are here
    unverifiable = _verify_problem(cluster) if args.verify is None else None if args.verify else "--no-verify"
    verify = unverifiable is None
    config = _model_config(args)  # once: a Hugging Face config's warnings print once
    workload = _workload(args, config)
    print(f"planning {args.model} (seq {args.seq_len}, global batch {args.global_batch}) on {cluster.name} "
          f"{cluster.nodes}x{cluster.devices_per_node}, {cluster.memory_budget() / 2**30:.1f} GiB usable per device")
    print(margin_line(cluster))
    if unverifiable is not None:
        print(f"  {unverified_line(cluster, unverifiable)}")
    results: list[TuneResult] = []

    def tune_fn(c: ClusterSpec) -> Plan:
        try:
            with _search_progress(args.progress) as progress:
                results.append(mistjax.tune(workload, c, time_limit=args.time_limit,
                                            baselines=() if args.no_baselines else None, progress=progress))
        except RuntimeError as e:
            raise CliError(str(e)) from e
        plan = results[-1].plan
        return plan.as_plan() if hasattr(plan, "as_plan") else plan

    verified = _tune_verified(config, workload, cluster, tune_fn, required) if verify else None
    if verified is not None:
        plan = verified.plan
    elif results:  # the verification failed after the search
        plan = results[-1].plan.as_plan() if hasattr(results[-1].plan, "as_plan") else results[-1].plan
    else:
        plan = tune_fn(cluster)
    print(results[-1].summary())
    from mistjax.cost.predict import analyze

    analysis = analyze(workload, plan, cluster)
    for note in analysis.notes:  # e.g. why the schedule (interleaved, zero-bubble)
        print(f"  note: {note}")
    _print_usage(config, workload, plan, cluster, analysis, args.time_limit)
    status = (verification_line(verified) if verified is not None else
              unverified_line(cluster, unverifiable or "the compile failed: see the warning above"))
    print(f"  {status}")
    plan = plan.replace(fingerprints={**plan.fingerprints, "verification": status})  # kept in the JSON
    if args.json:
        plan.save(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        _plots(workload, plan, cluster, Path(args.plot), results[-1])
    if verified is None:
        return 0
    from mistjax.validate.gpu_aot import format_verification

    print(format_verification(verified.rounds[-1].report, verified.analysis))
    print("verified tuning (the plan compiled for the GPU; re-tuned with the measured gap if above the budget):")
    print(verified.summary())
    return 0 if verified.rounds[-1].report.fits else 1


def model_flops(config: ModelConfig, seq_len: int) -> ModelFlops:
    """The terms of PaLM's model-FLOPs formula for a zoo / Hugging Face config (`mistjax.api.mfu`)."""
    from mistjax.api.mfu import ModelFlops

    return ModelFlops(config.num_params(), config.num_layers, config.num_heads, config.head_dim, seq_len)


def usage_lines(config: ModelConfig, workload: Workload, plan: Plan, cluster: ClusterSpec,
                analysis: Analysis) -> list[str]:
    """The predicted MFU (its formula and numbers) and the host memory each device's offload needs."""
    from mistjax.api.mfu import mfu_line

    dev = cluster.device
    fp32 = config.dtype == "float32"
    peak = float(dev.peak_flops_fp32 if fp32 else dev.peak_flops)
    host = max(analysis.stage_host, default=0.0)
    return [mfu_line(analysis.prediction.tokens_per_s, model_flops(config, workload.seq_len), plan.num_devices, peak)
            + f" ({'fp32' if fp32 else '16-bit'} peak of {dev.name})",
            f"host memory per device: {format_bytes(host)} (offloaded weights, gradients, optimizer state and "
            f"activations, largest device group), device peak {format_bytes(analysis.peak_memory)}"]


def _print_usage(config: ModelConfig, workload: Workload, plan: Plan, cluster: ClusterSpec, analysis: Analysis,
                 time_limit: float) -> None:
    """`usage_lines`, then at long context the `context_choice_note` (its search gets ``time_limit`` s)."""
    note = context_choice_note(workload, cluster, plan, analysis, time_limit)
    for line in [*usage_lines(config, workload, plan, cluster, analysis), *([note] if note else [])]:
        print(f"  {line}")


LONG_CONTEXT = 32768  # tokens per sequence from which `plan` / `explain` compare the plan with the other CP choice
EXPLAIN_SEARCH_SECONDS = 60.0  # `explain`'s search for that other plan


def context_choice_note(workload: Workload, cluster: ClusterSpec, plan: Plan, analysis: Analysis,
                        time_limit: float) -> str | None:
    """At long context (`LONG_CONTEXT` tokens or more), the best plan of the other context-parallel choice
    (without CP if the plan splits sequences, else with some cp > 1), searched here, next to this one: both
    plans' predicted step time, host memory per device and device peak, and the numbers that decide between
    them (a micro-batch's forward + backward seconds, the attention exchange). None below that length."""
    import mistjax
    from mistjax.cost.predict import analyze
    from mistjax.tuning.space import SearchSpace

    if workload.seq_len < LONG_CONTEXT:
        return None
    with_cp = plan.cp > 1
    cps = (1,) if with_cp else tuple(c for c in SearchSpace().cp_degrees if c > 1)
    other_label = "without context parallelism" if with_cp else "with context parallelism"
    try:
        found = mistjax.tune(workload, cluster, space=SearchSpace(cp_degrees=cps), time_limit=time_limit,
                             baselines=()).plan
    except RuntimeError:  # nothing fits
        return (f"context note: no plan {other_label} fits the budget of {format_bytes(cluster.memory_budget())} "
                f"per device; {'context parallelism is needed' if with_cp else 'only plans without it fit'}")
    other = found.as_plan() if hasattr(found, "as_plan") else found
    theirs = analyze(workload, other, cluster)
    ours, t0, t1 = _plan_facts(plan, analysis), analysis.step_time, theirs.step_time
    choices = ("context parallelism", "no context parallelism")
    winner, margin = (choices[not with_cp], t1 / t0 - 1) if t0 <= t1 else (choices[with_cp], t0 / t1 - 1)
    return (f"context note: this plan ({ours}) against the best plan {other_label} ({_plan_facts(other, theirs)}): "
            f"{winner} wins by {margin:.1%} of step time (forward + backward of a micro-batch "
            f"{_pass_seconds(analysis)} against {_pass_seconds(theirs)} s); per device and step "
            f"{format_bytes(_exchange(analysis))} against {format_bytes(_exchange(theirs))} of attention exchange")


def _plan_facts(plan: Plan, analysis: Analysis) -> str:
    """A plan in one phrase, with its predicted step time, host memory per device and device peak."""
    stage = plan.stages[0]
    remat = sum(s.remat_layers for s in plan.stages)
    acts = max(s.offload_acts for s in plan.stages)
    return (f"{plan.device_stages} stage(s) x dp {plan.dp} x cp {plan.cp}"
            f"{f' {plan.cp_form}' if plan.cp > 1 else ''} x tp {plan.tp}, ZeRO-{stage.zero_stage}, remat {remat} of "
            f"{plan.num_layers} layers, activations offloaded {acts:.0%}: {analysis.step_time:.4g} s/step, host "
            f"memory per device {format_bytes(max(analysis.stage_host, default=0.0))}, device peak "
            f"{format_bytes(analysis.peak_memory)}")


def _pass_seconds(analysis: Analysis) -> str:
    return f"{max(f + b for f, b in zip(analysis.stage_fwd, analysis.stage_bwd)):.4g}"


def _exchange(analysis: Analysis) -> float:
    """Bytes of context-parallel attention exchange per device and step (all-to-all and ring sends)."""
    return sum(analysis.collective_bytes.get(k, 0.0) for k in ("all-to-all", "collective-permute"))


def unverified_line(cluster: ClusterSpec, reason: str) -> str:
    """What stands in for the XLA:GPU check of a plan that was not compiled for the GPU (``reason``: why)."""
    dev = cluster.device
    margin = (f"memory margin {dev.memory_margin:.1%} of the non-state memory applied"
              if dev.memory_margin_source else "no memory margin applied (the preset has none)")
    return f"not verified by XLA:GPU ({reason}); {margin}"


def verification_line(verified: VerifiedPlan) -> str:
    """The XLA:GPU check's verdict on the plan, in one line."""
    r = verified.rounds[-1]
    peak = f"XLA:GPU's peak {format_bytes(max(r.xla))} per device"
    if verified.verified:
        return f"verified by XLA:GPU: {peak}, within the planning budget of {format_bytes(r.report.budget)}"
    return (f"NOT verified by XLA:GPU: {peak}, above the planning budget of {format_bytes(r.report.budget)}"
            + (" (but within the card)" if r.report.fits else " and the card"))


def margin_line(cluster: ClusterSpec) -> str:
    """What the planning budget holds back for the memory model's misses, and where that figure comes from."""
    dev = cluster.device
    if not dev.memory_margin_source:
        return "  memory margin: none (plans use the whole budget; --verify checks them on the GPU's compiler)"
    return (f"  memory margin: {dev.memory_margin:.1%} of each plan's non-state memory (gradients, activations, "
            f"buffers) held back beyond the budget; {dev.memory_margin_source}")


def _tune_verified(config: ModelConfig, workload: Workload, cluster: ClusterSpec, tune_fn: TuneFn,
                   required: bool) -> VerifiedPlan | None:
    """`mistjax.validate.verified.tune_verified`, printing each round as it ends. A compile that fails is an
    error when ``--verify`` was asked for, else a warning (and None: the plan stays unverified)."""
    from mistjax.validate.gpu_aot import GpuAotUnavailable
    from mistjax.validate.verified import tune_verified

    def say(r: VerifyRound) -> None:
        print(f"  compiled for XLA:GPU: predicted {max(r.predicted) / 2**30:.2f} GiB, XLA:GPU {max(r.xla) / 2**30:.2f} "
              f"GiB per device" + (f"; {r.overflow / 2**30:.2f} GiB over the budget: re-tuning with the measured gap"
                                   if r.overflow > 0 else ""), flush=True)

    print(f"verifying on XLA:GPU for {cluster.nodes}x{cluster.devices_per_node} {cluster.device.name} "
          "(deviceless compile; minutes at full scale)...", flush=True)
    try:
        return tune_verified(config, workload, cluster, tune_fn, on_round=say)
    except (GpuAotUnavailable, ValueError) as e:
        if required:
            raise CliError(f"--verify: {e}") from e
        print(f"mistjax plan: warning: the plan could not be verified on XLA:GPU ({e}); it is unverified "
              "(--no-verify skips the compile)", file=sys.stderr)
        return None


@contextlib.contextmanager
def _search_progress(mode: str) -> Iterator[Progress | None]:
    """A tqdm bar on stderr over each searched space's outer keys: with ``auto`` only when stderr is a terminal
    and a search runs longer than a second; ``on`` always, ``off`` never. Yields the tuner's ``progress`` callback."""
    if mode == "off":
        yield None
        return
    from tqdm import tqdm

    bars: list[tqdm] = []

    def progress(space: str, visited: int, total: int) -> None:
        if visited == 0:  # a search starts: one bar per space, cleared when it ends
            bars.append(tqdm(total=total, desc=f"searching {space}", unit="key", file=sys.stderr, leave=False,
                             disable=None if mode == "auto" else False, delay=1.0, mininterval=0.5))
        bars[-1].update(visited - bars[-1].n)
        if visited >= total:
            bars[-1].close()

    try:
        yield progress
    finally:
        for bar in bars:
            bar.close()


def cmd_explain(args: ExplainArgs) -> int:
    from mistjax.cost.predict import analyze

    try:
        plan = Plan.load(args.plan)
    except PlanError as e:
        raise CliError(str(e)) from e
    print(plan.summary())
    if args.model is None:
        if args.verify:
            raise CliError("--verify compiles the plan for a model: pass --model (and --cluster)")
        print("(pass --model and --cluster for the predicted time and memory)")
        return 0
    cluster = load_cluster(args.cluster, args.memory_gib)
    if args.verify:
        _verify_ready(cluster)
    args = _explain_shape(args, plan)
    config = _model_config(args)
    workload = _workload(args, config)
    try:
        plan.check_devices(cluster.num_devices)
        plan.check_batch(args.global_batch)
        plan.check_layers(workload.num_layers)
    except PlanError as e:
        raise CliError(str(e)) from e
    report = analyze(workload, plan, cluster)
    print(report.summary())  # with its notes
    from mistjax.cost.mics import mics_lines

    for line in mics_lines(workload, plan, cluster):  # what the partition group buys (none without sharding)
        print(line)
    _print_usage(config, workload, plan, cluster, report, EXPLAIN_SEARCH_SECONDS)
    if args.plot:
        _plots(workload, plan, cluster, Path(args.plot))
    return _verify(config, workload, plan, cluster, report) if args.verify else 0


DEFAULT_SEQ_LEN = 2048  # `explain`'s sequence length for a plan that records none (a hand-written one)


def recorded_shape(plan: Plan) -> tuple[int, int] | None:
    """The (global batch, sequence length) the plan was tuned for (its ``batch`` fingerprint, ``"128x4096"``),
    or None when it records none (a plan written by hand or by `uniform_plan`)."""
    match = re.fullmatch(r"(\d+)x(\d+)", plan.fingerprints.get("batch", ""))
    return (int(match[1]), int(match[2])) if match else None


def _explain_shape(args: ExplainArgs, plan: Plan) -> ExplainArgs:
    """``args`` with the batch and sequence length to price the plan at: the plan's own unless given. A
    ``--seq-len`` other than the one the plan was tuned for is an error: the plan's recorded prediction (its
    summary) is for its own shape, and a plan tuned for one length is no plan for another (re-plan for it).
    A ``--global-batch`` other than the plan's is refused by `Plan.check_batch`."""
    batch = plan.global_batch if args.global_batch is None else args.global_batch
    recorded = recorded_shape(plan)
    if recorded is None:
        seq = DEFAULT_SEQ_LEN if args.seq_len is None else args.seq_len
        how = "the default: the plan records none; pass --seq-len" if args.seq_len is None else "--seq-len"
    else:
        seq = recorded[1] if args.seq_len is None else args.seq_len
        if seq != recorded[1]:
            raise CliError(f"--seq-len {seq} differs from the {recorded[1]} tokens the plan was tuned for (global "
                           f"batch x sequence {recorded[0]}x{recorded[1]}); omit --seq-len to explain it at its "
                           f"own shape, or re-plan: mistjax plan --seq-len {seq} ...")
        how = "the plan's" if args.seq_len is None else "--seq-len, as the plan records"
    print(f"priced at global batch {batch} x sequence {seq} ({how})")
    return dataclasses.replace(args, global_batch=batch, seq_len=seq)


def _verify_problem(cluster: ClusterSpec) -> str | None:
    """Why ``--verify`` cannot run here, in a few words (None: it can): the deviceless XLA:GPU compiler is not
    installed, or the cluster's GPU has no target spec (`mistjax.validate.gpu_aot`)."""
    try:
        _verify_ready(cluster)
    except CliError as e:
        reason = str(e).removeprefix("--verify: ").split(";")[0]
        return re.sub(r" \(device '[^']*'\)", "", reason.replace("no XLA:GPU target spec", "no target spec"))
    return None


def _verify_ready(cluster: ClusterSpec) -> None:
    """Fail before any tuning or analysis if ``--verify`` cannot run (plugin missing, no GPU spec)."""
    from mistjax.validate.gpu_aot import plugin_problem, target_for

    try:  # first: a cluster without a target spec cannot be verified whatever is installed
        target_for(cluster)
    except ValueError as e:
        raise CliError(f"--verify: {e}") from e
    problem = plugin_problem()
    if problem:
        raise CliError(f"--verify: {problem}")


def _verify(config: ModelConfig, workload: Workload, plan: Plan, cluster: ClusterSpec,
            analysis: Analysis | None = None) -> int:
    """Compile ``plan`` for ``cluster``'s GPUs (XLA:GPU, deviceless, in a JAX_PLATFORMS=cpu subprocess) and
    print XLA's per-device memory next to the prediction; exit status 1 if XLA says it does not fit."""
    from mistjax.cost.predict import analyze
    from mistjax.validate.gpu_aot import GpuAotUnavailable, format_verification, verify_in_subprocess

    print(f"verifying on XLA:GPU for {cluster.nodes}x{cluster.devices_per_node} {cluster.device.name} "
          "(deviceless compile; minutes at full scale)...", flush=True)
    try:
        report = verify_in_subprocess(config, workload.seq_len, workload.global_batch, plan, cluster)
    except (GpuAotUnavailable, ValueError) as e:
        raise CliError(f"--verify: {e}") from e
    print(format_verification(report, analysis or analyze(workload, plan, cluster)))
    return 0 if report.fits else 1


def _plots(workload: Workload, plan: Plan, cluster: ClusterSpec, out: Path, result: TuneResult | None = None) -> None:
    from mistjax.cost.predict import analyze
    from mistjax.viz import plot_memory, plot_pareto, plot_timeline

    report = analyze(workload, plan, cluster)
    files = [plot_memory(report.stage_memory, out / "memory.png", limit=cluster.memory_budget()),
             plot_timeline(report.stage_fwd, report.stage_bwd, plan.grad_accum, out / "timeline.png",
                           schedule=plan.schedule,
                           last_extra=report.prediction.stage_delta, groups=plan.device_stages,
                           stage_wgrad=report.stage_wgrad)]
    # One stage: the search picks the stage's best strategy itself; only a pipeline's stages come from the MILP.
    picked_by = "the inter-stage MILP" if plan.num_stages > 1 else "the one-stage search (no MILP)"
    for rec in result.pareto if result is not None else ():
        picked = rec.get("chosen")
        files.append(plot_pareto(rec["stable"], rec["delta"], out / f"pareto_stage{rec['stage']}.png",
                                 num_microbatches=plan.grad_accum, picked=tuple(picked) if picked else None,
                                 picked_by=picked_by,
                                 title=f"stage {rec['stage']} ({rec['layers']} layers): sampled Pareto points"))
    print("wrote " + ", ".join(str(f) for f in files))


def cmd_presets(args: PresetsArgs) -> int:
    """One row per preset (`mistjax.hardware.presets.PRESET_NAMES`, read from mistjax/hardware/catalog/)."""
    for line in preset_table(full=args.full):
        print(line)
    return 0


def preset_table(full: bool = False) -> list[str]:
    """The presets as text lines: a header, one row per preset, then each preset's source (shortened to its
    first clause unless ``full``)."""
    from mistjax.hardware.presets import PRESET_NAMES, ClusterSpec
    from mistjax.validate.gpu_aot_target import TARGET_SPECS

    gb = 1e9
    rows = [("name", "device", "memory", "usable", "bf16 peak", "intra-node", "inter-node", "host link", "XLA:GPU")]
    sources = []
    for name in PRESET_NAMES:
        c = ClusterSpec.preset(name)
        dev = c.device
        rows.append((name, dev.name, format_bytes(dev.hbm_bytes), format_bytes(c.memory_budget()),
                     f"{dev.peak_flops / 1e12:.4g} TFLOP/s", f"{c.p2p_intra.bandwidth / gb:.4g} GB/s",
                     f"{c.p2p_inter.bandwidth / gb:.4g} GB/s", f"{dev.host_to_device.bandwidth / gb:.4g} GB/s",
                     "yes" if name in TARGET_SPECS else "no"))
        text = c.source if full else c.source.split(";")[0]
        sources.append(f"  {name}: {text if full or len(text) <= 110 else text[:107] + '...'}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    return ["cluster presets (--cluster NAME[:NODESxPER_NODE], default 1x8; memory per device, usable = the planning "
            "budget; links per direction: intra- and inter-node point-to-point, host <-> device; XLA:GPU: a target "
            "spec for --verify):", *table, "sources" + ("" if full else " (first clause; --full for all)") + ":",
            *sources]


def cmd_calibrate(args: CalibrateArgs) -> int:
    import jax

    from mistjax.hardware.calibrate import calibrate

    n = len(jax.devices())
    if n == 1:
        print(f"mistjax calibrate: warning: only one {jax.devices()[0].platform} device is visible, so no collective "
              "bandwidth or interference can be measured (the profile assumes serial links); run on the node's "
              "devices (on a CPU host: XLA_FLAGS=--xla_force_host_platform_device_count=8)", file=sys.stderr)

    cluster = calibrate(name=args.name, quick=args.quick)
    Path(args.out).write_text(cluster.to_json())
    print(f"wrote {args.out}: {cluster.devices_per_node} x {cluster.device.name}")
    return 0


COMMANDS: dict[str, type[Args]] = {c.command: c for c in (PlanArgs, ExplainArgs, PresetsArgs, CalibrateArgs)}


def parse_args(argv: list[str] | None = None) -> Args:
    """The subcommand and its flags (tyro, from the dataclasses above); a bad flag exits with status 2."""
    return tyro.extras.subcommand_cli_from_dict(COMMANDS, prog="mistjax", description=__doc__, args=argv,
                                                # an optional flag takes a value, not the word None
                                                config=(tyro.conf.DisallowNone,))


def _run(args: Args) -> int:
    match args:
        case PlanArgs():
            return cmd_plan(args)
        case ExplainArgs():
            return cmd_explain(args)
        case PresetsArgs():
            return cmd_presets(args)
        case CalibrateArgs():
            return cmd_calibrate(args)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except FlagError as e:
        print(f"mistjax {e.command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        with warnings.catch_warnings():  # the library's warnings as one line each, without Python's source line
            warnings.showwarning = lambda message, *_, **__: print(f"mistjax {args.command}: warning: {message}",
                                                                   file=sys.stderr)
            return _run(args)
    except (CliError, PlanError) as e:
        print(f"mistjax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
