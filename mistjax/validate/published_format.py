"""The ``published-runs.json`` format: typed records of measured training runs and a validating loader.

A file (``"format": "mistjax-published-runs"``, version 1) holds an ``about`` text and ``points``, one
per training run: the system that ran it, the cluster (a mistjax hardware preset and a shape), the
model (a zoo preset and / or its shape), the precision, the full parallel configuration with per-stage
layers, remat, ZeRO and offload, and what was measured (step time, per-stage peak allocated memory).
`load_published` checks every field and raises `PublishedRunsError` naming the point and the field.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeAlias, overload

from mistjax.core.plan import REMAT_POLICIES
from mistjax.tuning.baselines import COMPUTE_DTYPES, SystemRecord, WeightStorage, system_named

if TYPE_CHECKING:
    from models.config import ModelConfig

FORMAT, VERSION = "mistjax-published-runs", 1
KINDS = ("measured", "derived")  # measured by the source / derived from its numbers (see the file's about)
# Leading word of ``precision`` -> the compute dtype mistjax prices it with (fp16 has bf16's sizes; fp8: bf16
# training whose projections run as FP8 GEMMs, `PublishedRun.fp8`); each system stores the state as its
# `mistjax.tuning.SystemRecord` says.
PRECISIONS = COMPUTE_DTYPES
# Words of ``system`` -> the `mistjax.tuning.SYSTEMS` record a run is priced with (first match; else mistjax's).
_SYSTEM_WORDS = (("megatron", "megatron"), ("mistjax", "mistjax"), ("mist", "mist"), ("deepspeed", "deepspeed"),
                 ("torchtitan", "torchtitan"), ("maxtext", "maxtext"))
SCHEDULES = ("1f1b", "gpipe", "1f1b-eager")  # `mistjax.plan.SCHEDULES`
SHAPE_FIELDS = ("family", "hidden", "layers", "heads", "kv_heads", "ffn", "vocab")


class PublishedRunsError(ValueError):
    """A published-runs file is malformed; the message names the point and the field."""


@dataclass(frozen=True)
class ModelRecord:
    """The model a run trained: a zoo preset, its shape, or both (then they must agree)."""

    seq_len: int  # tokens per sequence
    preset: str | None = None  # `models.PRESETS` name
    family: str | None = None  # gpt3 | llama | falcon
    hidden: int | None = None  # hidden size
    layers: int | None = None  # transformer blocks
    heads: int | None = None  # query heads
    kv_heads: int | None = None  # key / value heads
    ffn: int | None = None  # MLP inner width
    vocab: int | None = None  # vocabulary size
    rotary_pct: float | None = None  # RoPE fraction of head_dim (default: the family's zoo value)


@dataclass(frozen=True)
class HardwareRecord:
    """Where a run ran."""

    preset: str  # `mistjax.hardware.PRESET_NAMES` name
    nodes: int  # nodes
    per_node: int  # devices per node
    card_memory_gib: float | None = None  # memory per device the run had, GiB (None: the preset's)
    gpu: str = ""  # free-text description


@dataclass(frozen=True)
class StageRecord:
    """One pipeline stage of a run."""

    layers: tuple[int, int]  # [start, end) of the layer stack
    remat_layers: int  # layers checkpointed (recomputed in the backward)
    zero: int  # ZeRO stage 0-3 (Megatron's distributed optimizer = 1)
    remat_policy: str = "full"  # what a checkpointed layer keeps (`mistjax.plan.REMAT_POLICIES`): full recompute
    # (Megatron-LM's, Mist's) or ``dots`` (the matmul outputs kept: mistjax's selective policy)
    offload_weights: float = 0.0  # fractions kept in host memory
    offload_grads: float = 0.0
    offload_opt: float = 0.0
    offload_acts: float = 0.0


@dataclass(frozen=True)
class ParallelRecord:
    """The parallel configuration, uniform across stages except what `StageRecord` holds."""

    dp: int  # data-parallel degree
    tp: int  # tensor-parallel degree
    pp: int  # pipeline stages
    micro_batch: int  # sequences per data-parallel rank per micro-batch
    grad_accum: int  # micro-batches per step
    schedule: str  # pipeline schedule (`SCHEDULES`)
    stages: tuple[StageRecord, ...]  # one per (virtual) pipeline stage, in layer order
    virtual_stages: int = 1  # chunks per device group (Megatron's interleaved 1F1B when > 1): pp x v stages
    shard_group: int = 0  # ZeRO / FSDP partition group (MiCS; e.g. FSDP within a node); 0: all of dp


@dataclass(frozen=True)
class Measurement:
    """What was measured (None where the source gives nothing)."""

    iter_time_s: float | None  # seconds per training step; None: the run did not complete
    stage_peak_allocated_mib: tuple[float, ...] | None  # per stage, MiB (torch max_memory_allocated)
    stage_peak_reserved_mib: tuple[float, ...] | None  # per stage or per rank, MiB (informational)
    timing_scope: str = ""  # what the time covers


@dataclass(frozen=True)
class PublishedRun:
    """One published training run."""

    id: str  # unique name
    kind: str  # `KINDS`
    system: str  # the software that ran it (e.g. "Mist runtime ...", "Megatron-LM ...")
    hardware: HardwareRecord
    model: ModelRecord
    global_batch: int  # sequences per step
    precision: str  # free text whose first word is fp32 / bf16 / fp16 / fp8
    flash_attention: bool  # fused attention in the run
    parallel: ParallelRecord
    measured: Measurement
    source: object = None  # where the numbers come from (free-form JSON, kept as read)
    expressible: bool | None = None  # the file's own claim that a mistjax plan expresses the run
    mist_predicted_s: float | None = None  # Mist's own predicted step time, if published

    @property
    def dtype(self) -> str:
        """Compute dtype mistjax prices the run with (`PRECISIONS`)."""
        return PRECISIONS[self.precision_word]

    @property
    def precision_word(self) -> str:
        """The leading word of ``precision`` (fp32 / bf16 / fp16 / fp8)."""
        return self.precision.split()[0].lower()

    @property
    def system_record(self) -> SystemRecord:
        """The system the run is priced as (`mistjax.tuning.SYSTEMS`, read from ``system``; mistjax's record for a
        system it has none of). A ``precision`` that says ``fp32 weights`` (a 16-bit-compute run that stored
        fp32 weights and no master copy, mistjax's default) overrides the record's weight storage."""
        s = self.system.lower()
        record = system_named(next((name for word, name in _SYSTEM_WORDS if word in s), "mistjax"))
        if "fp32 weights" in self.precision.lower():
            return replace(record, weights=WeightStorage.FP32)
        return record

    @property
    def fp8(self) -> bool:
        """The run's linear layers ran as FP8 GEMMs (``precision`` starts with fp8: torchao Float8, Transformer
        Engine), priced as `models.ModelConfig.fp8` runs them."""
        return self.precision.split()[0].lower() == "fp8"

    @property
    def framework(self) -> str:
        """``megatron``, ``mist`` or ``other``, read from ``system`` (pairs runs for speedups)."""
        s = self.system.lower()
        return "megatron" if "megatron" in s else "mist" if "mist" in s else "other"

    @property
    def tp_overlap(self) -> bool:
        """The run overlapped its tensor-parallel collectives with the matmuls as collective matmuls (torchtitan's
        async TP, read from ``system``); the others ran them beside the GEMMs (Megatron-LM as the artifact ran
        it, DTensor's vanilla TP, Mist's runtime)."""
        return "async tp" in self.system.lower()

    @property
    def ran(self) -> bool:
        """The run completed (it has a measured step time)."""
        return self.measured.iter_time_s is not None


@dataclass(frozen=True)
class PublishedRuns:
    """A loaded file."""

    about: str  # the file's description of its fields
    points: tuple[PublishedRun, ...]  # the runs, in file order


# ---------------------------------------------------------------------------------------------- loading
def load_published(path: str | Path) -> PublishedRuns:
    """Read and validate a published-runs file (JSON only: no pickle, no eval).

    Raises:
        PublishedRunsError: naming the point id and the field that is wrong, and what it should be.
    """
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise PublishedRunsError(f"{p}: cannot read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise PublishedRunsError(f"{p}: not valid JSON ({e})") from None
    return parse_published(doc)


def parse_published(doc: object) -> PublishedRuns:
    """Validate a parsed document (see `load_published`)."""
    top = _Obj(doc, "published-runs", required={"format", "version", "points"}, optional={"about"})
    if top.doc["format"] != FORMAT or top.doc["version"] != VERSION:
        raise PublishedRunsError(f"published-runs.format/version: expected {FORMAT!r} version {VERSION}, "
                                 f"got {top.doc['format']!r} version {top.doc['version']!r}")
    pts = top.doc["points"]
    if not isinstance(pts, list) or not pts:
        raise PublishedRunsError("published-runs.points: expected a non-empty list of runs")
    runs = tuple(_run(p, i) for i, p in enumerate(pts))
    seen: set[str] = set()
    for i, r in enumerate(runs):
        if r.id in seen:
            raise PublishedRunsError(f"points[{i}] ({r.id!r}).id: duplicate id; ids must be unique")
        seen.add(r.id)
    return PublishedRuns(about=top.text("about", ""), points=runs)


class _Required(enum.Enum):
    """The default of a `_Obj` read whose field must be present."""

    FIELD = enum.auto()


_REQUIRED = _Required.FIELD
_Need: TypeAlias = Literal[_Required.FIELD]


class _Obj:
    """Typed reads from one JSON object; every error names ``where`` and the field.

    A read without a default requires its field; with a default, a missing field reads as the default, and
    with ``None`` as the default the field may also be null.
    """

    def __init__(self, doc: object, where: str, required: set[str], optional: set[str] = frozenset()) -> None:
        if not isinstance(doc, dict):
            raise PublishedRunsError(f"{where}: expected an object, got {type(doc).__name__}")
        missing, unknown = sorted(required - set(doc)), sorted(set(doc) - required - optional)
        if missing:
            raise PublishedRunsError(f"{where}: missing field(s) {missing}")
        if unknown:
            raise PublishedRunsError(f"{where}: unknown field(s) {unknown}; known: {sorted(required | optional)}")
        self.doc: dict[str, object] = doc
        self.where = where

    def fail(self, key: str, want: str) -> PublishedRunsError:
        return PublishedRunsError(f"{self.where}.{key}: expected {want}, got {self.doc.get(key)!r}")

    @overload
    def integer(self, key: str, default: _Need = _REQUIRED, lo: int = 1) -> int: ...
    @overload
    def integer(self, key: str, default: None, lo: int = 1) -> int | None: ...

    def integer(self, key: str, default: _Need | None = _REQUIRED, lo: int = 1) -> int | None:
        v = self.doc.get(key, default)
        if v is None and default is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise self.fail(key, f"an integer >= {lo}")
        return v

    @overload
    def number(self, key: str, default: float, lo: float = 0.0, hi: float = math.inf, strict: bool = False
               ) -> float: ...
    @overload
    def number(self, key: str, default: None, lo: float = 0.0, hi: float = math.inf, strict: bool = False
               ) -> float | None: ...

    def number(self, key: str, default: float | None, lo: float = 0.0, hi: float = math.inf, strict: bool = False
               ) -> float | None:
        v = self.doc.get(key, default)
        if v is None and default is None:
            return None
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or v < lo or v > hi or (strict and v == lo):
            cap = f" and <= {hi:g}" if hi < math.inf else ""
            raise self.fail(key, f"a number {'>' if strict else '>='} {lo:g}{cap}")
        return float(v)

    @overload
    def text(self, key: str, default: _Need | str = _REQUIRED) -> str: ...
    @overload
    def text(self, key: str, default: None) -> str | None: ...

    def text(self, key: str, default: _Need | str | None = _REQUIRED) -> str | None:
        """A string; a required one must not be empty."""
        v = self.doc.get(key, default)
        if v is None and default is None:
            return None
        if not isinstance(v, str) or (default is _REQUIRED and not v):
            raise self.fail(key, "a non-empty string" if default is _REQUIRED else "a string")
        return v

    @overload
    def flag(self, key: str, default: _Need = _REQUIRED) -> bool: ...
    @overload
    def flag(self, key: str, default: None) -> bool | None: ...

    def flag(self, key: str, default: _Need | None = _REQUIRED) -> bool | None:
        v = self.doc.get(key, default)
        if v is None and default is None:
            return None
        if not isinstance(v, bool):
            raise self.fail(key, "true or false")
        return v

    def numbers(self, key: str, n: int | None = None) -> tuple[float, ...] | None:
        v = self.doc.get(key)
        if v is None:
            return None
        good = isinstance(v, list) and all(isinstance(x, int | float) and not isinstance(x, bool) and x > 0 for x in v)
        if not good or (n is not None and len(v) != n):
            raise self.fail(key, "null or a list of positive numbers" + (f", one per stage ({n})" if n else ""))
        return tuple(float(x) for x in v)


def _run(doc: object, i: int) -> PublishedRun:
    head = f"points[{i}]"
    if isinstance(doc, dict) and isinstance(doc.get("id"), str) and doc["id"]:
        head = f"points[{i}] ({doc['id']!r})"
    o = _Obj(doc, head, required={"id", "kind", "system", "hardware", "model", "global_batch", "precision",
                                  "flash_attention", "parallel", "measured"},
             optional={"source", "expressible", "mist_predicted_s"})
    kind = o.text("kind")
    if kind not in KINDS:
        raise o.fail("kind", f"one of {list(KINDS)}")
    precision = o.text("precision")
    if (precision.split() or [""])[0].lower() not in PRECISIONS:
        raise o.fail("precision", f"a text starting with one of {list(PRECISIONS)} (e.g. 'fp16 params/grads')")
    model = _model(o.doc["model"], f"{head}.model")
    hardware = _hardware(o.doc["hardware"], f"{head}.hardware")
    parallel = _parallel(o.doc["parallel"], f"{head}.parallel")
    run = PublishedRun(
        id=o.text("id"), kind=kind, system=o.text("system"), hardware=hardware, model=model,
        global_batch=o.integer("global_batch"), precision=precision, flash_attention=o.flag("flash_attention"),
        parallel=parallel, measured=_measured(o.doc["measured"], f"{head}.measured", parallel.pp),
        source=o.doc.get("source"), expressible=o.flag("expressible", None),
        mist_predicted_s=o.number("mist_predicted_s", None, strict=True))
    _check_consistent(run, head)
    return run


def _model(doc: object, where: str) -> ModelRecord:
    o = _Obj(doc, where, required={"seq_len"}, optional={"preset", *SHAPE_FIELDS, "rotary_pct"})
    rec = ModelRecord(seq_len=o.integer("seq_len"), preset=o.text("preset", None), family=o.text("family", None),
                      hidden=o.integer("hidden", None), layers=o.integer("layers", None),
                      heads=o.integer("heads", None), kv_heads=o.integer("kv_heads", None),
                      ffn=o.integer("ffn", None), vocab=o.integer("vocab", None),
                      rotary_pct=o.number("rotary_pct", None, hi=1.0))
    if rec.preset is None:
        missing = [f for f in SHAPE_FIELDS if getattr(rec, f) is None]
        if missing:
            raise PublishedRunsError(f"{where}: without a 'preset' the shape needs {missing}")
    return rec


def _hardware(doc: object, where: str) -> HardwareRecord:
    o = _Obj(doc, where, required={"preset", "nodes", "per_node"}, optional={"card_memory_gib", "gpu"})
    return HardwareRecord(preset=o.text("preset"), nodes=o.integer("nodes"), per_node=o.integer("per_node"),
                          card_memory_gib=o.number("card_memory_gib", None, strict=True), gpu=o.text("gpu", ""))


def _parallel(doc: object, where: str) -> ParallelRecord:
    o = _Obj(doc, where, required={"dp", "tp", "pp", "micro_batch", "grad_accum", "stages"},
             optional={"schedule", "remat_granularity", "zero", "virtual_stages", "shard_group"})
    schedule = o.text("schedule", "1f1b")
    if schedule not in SCHEDULES:
        raise o.fail("schedule", f"one of {list(SCHEDULES)}")
    for key in ("remat_granularity", "zero"):  # descriptions of what the stage numbers mean
        o.text(key, "")
    stages = o.doc["stages"]
    if not isinstance(stages, list) or not stages:
        raise o.fail("stages", "a non-empty list of stages")
    return ParallelRecord(dp=o.integer("dp"), tp=o.integer("tp"), pp=o.integer("pp"),
                          micro_batch=o.integer("micro_batch"), grad_accum=o.integer("grad_accum"), schedule=schedule,
                          stages=tuple(_stage(s, f"{where}.stages[{j}]") for j, s in enumerate(stages)),
                          virtual_stages=o.integer("virtual_stages", 1), shard_group=o.integer("shard_group", 0, lo=0))


def _stage(doc: object, where: str) -> StageRecord:
    offloads = ("offload_weights", "offload_grads", "offload_opt", "offload_acts")
    o = _Obj(doc, where, required={"layers", "remat_layers", "zero"}, optional={*offloads, "remat_policy"})
    lay = o.doc["layers"]
    ints = isinstance(lay, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in lay)
    if not ints or len(lay) != 2 or not 0 <= lay[0] < lay[1]:
        raise o.fail("layers", "[start, end) integers with 0 <= start < end")
    zero = o.integer("zero", lo=0)
    if zero > 3:
        raise o.fail("zero", "a ZeRO stage 0, 1, 2 or 3")
    remat = o.integer("remat_layers", lo=0)
    if remat > lay[1] - lay[0]:
        raise o.fail("remat_layers", f"at most the stage's {lay[1] - lay[0]} layers")
    policy = o.text("remat_policy", "full")
    if policy not in REMAT_POLICIES:
        raise o.fail("remat_policy", f"one of {', '.join(REMAT_POLICIES)}")
    return StageRecord(layers=(lay[0], lay[1]), remat_layers=remat, zero=zero, remat_policy=policy,
                       **{k: o.number(k, 0.0, hi=1.0) for k in offloads})


def _measured(doc: object, where: str, pp: int) -> Measurement:
    o = _Obj(doc, where, required={"iter_time_s"},
             optional={"stage_peak_allocated_mib", "stage_peak_reserved_mib", "timing_scope"})
    return Measurement(iter_time_s=o.number("iter_time_s", None, strict=True),
                       stage_peak_allocated_mib=o.numbers("stage_peak_allocated_mib", pp),
                       stage_peak_reserved_mib=o.numbers("stage_peak_reserved_mib"),
                       timing_scope=o.text("timing_scope", ""))


def _check_consistent(run: PublishedRun, head: str) -> None:
    """Cross-field checks: stage count, devices, batch, and the stages tiling the model's layers."""
    par, hw = run.parallel, run.hardware
    if len(par.stages) != par.pp * par.virtual_stages:
        per = f"pp {par.pp} x virtual_stages {par.virtual_stages}" if par.virtual_stages > 1 else f"pp = {par.pp}"
        raise PublishedRunsError(f"{head}.parallel.stages: {len(par.stages)} stages but {per}")
    if par.dp * par.tp * par.pp != hw.nodes * hw.per_node:
        raise PublishedRunsError(f"{head}.parallel: dp {par.dp} x tp {par.tp} x pp {par.pp} = "
                                 f"{par.dp * par.tp * par.pp} devices but hardware has {hw.nodes} x {hw.per_node}")
    if par.micro_batch * par.dp * par.grad_accum != run.global_batch:
        raise PublishedRunsError(f"{head}.global_batch: {run.global_batch} != micro_batch {par.micro_batch} x dp "
                                 f"{par.dp} x grad_accum {par.grad_accum}")
    from mistjax.hardware import PRESET_NAMES

    if hw.preset not in PRESET_NAMES:
        raise PublishedRunsError(f"{head}.hardware.preset: unknown hardware preset {hw.preset!r}; valid names: "
                                 f"{', '.join(PRESET_NAMES)}")
    end = 0
    for j, s in enumerate(par.stages):
        if s.layers[0] != end:
            raise PublishedRunsError(f"{head}.parallel.stages[{j}].layers: starts at {s.layers[0]}, expected {end} "
                                     "(stages must be contiguous from layer 0)")
        end = s.layers[1]
    layers = model_config(run.model, run.dtype, f"{head}.model").num_layers
    if end != layers:
        raise PublishedRunsError(f"{head}.parallel.stages: the stages cover layers [0, {end}) but the model has "
                                 f"{layers} layers")


def model_config(rec: ModelRecord, dtype: str = "float32", where: str = "model") -> ModelConfig:
    """The `models.ModelConfig` of a model record, computing in and storing its weights in ``dtype``.

    16-bit runs keep an fp32 master copy in the optimizer state (`models.workload`'s default), as
    Megatron-LM's ``--fp16`` / ``--bf16`` and Mist's ``params_dtype=float16`` do.

    A preset gives the architecture (a shape given with it must agree); a shape alone builds a config
    of its family (RoPE fraction as in the zoo: 0 for GPT-3, 0.25 otherwise, unless given). GPT-3's
    position table is sized to the run's sequence length.

    Raises:
        PublishedRunsError: unknown preset, a shape that disagrees with it, or an invalid shape.
    """
    import models
    from mistjax.analysis.analyze import DEFAULT_POINTS
    from models.config import ModelConfig

    # Position table = the run's sequence length, but longer than every sequence the analysis traces:
    # at a trace size equal to the table GPT-3's slice of it vanishes and the traces' structures differ.
    table = max(rec.seq_len, 1 + max(s for _, s in DEFAULT_POINTS))

    fields = {"family": "family", "hidden": "hidden_size", "layers": "num_layers", "heads": "num_heads",
              "kv_heads": "num_kv_heads", "ffn": "ffn_size", "vocab": "vocab_size", "rotary_pct": "rotary_pct"}
    if rec.preset is not None:
        if rec.preset not in models.PRESETS:
            raise PublishedRunsError(f"{where}.preset: unknown model preset {rec.preset!r}; valid names: "
                                     f"{', '.join(models.PRESETS)}")
        base = models.PRESETS[rec.preset]
        for key, attr in fields.items():
            given = getattr(rec, key)
            if given is not None and given != getattr(base, attr):
                raise PublishedRunsError(f"{where}.{key}: {given!r} disagrees with preset {rec.preset!r} "
                                         f"({attr} = {getattr(base, attr)!r}); fix the shape or drop the preset")
        try:
            return base.replace(max_seq_len=table, dtype=dtype, param_dtype=dtype)
        except ValueError as e:
            raise PublishedRunsError(f"{where}: {e}") from None
    rotary = rec.rotary_pct if rec.rotary_pct is not None else (0.0 if rec.family == "gpt3" else 0.25)
    name = f"{rec.family}-h{rec.hidden}-l{rec.layers}"
    try:
        return ModelConfig(name=name, family=rec.family, vocab_size=rec.vocab, hidden_size=rec.hidden,
                           num_layers=rec.layers, num_heads=rec.heads, num_kv_heads=rec.kv_heads, ffn_size=rec.ffn,
                           max_seq_len=table, rotary_pct=rotary, dtype=dtype,
                           param_dtype=dtype)
    except ValueError as e:
        raise PublishedRunsError(f"{where}: {e}") from None


__all__ = ["FORMAT", "KINDS", "PRECISIONS", "HardwareRecord", "Measurement", "ModelRecord", "ParallelRecord",
           "PublishedRun", "PublishedRuns", "PublishedRunsError", "StageRecord", "load_published", "model_config",
           "parse_published"]
