"""The plan: the contract between the tuner and the runtime.

A `Plan` says how one training step runs: pipeline stages and their layer ranges, data / tensor
parallel degrees, the MiCS partition group, and per stage the ZeRO flags, remat and offload
choices. It is a frozen dataclass with a JSON form carrying a schema version, so a plan made by
`mistjax.tune` (or by hand) can be saved, inspected with `mistjax explain`, and re-applied.

The plan mesh has axes ``("stage", "replica", "shard", "context", "tensor")`` with extents
``(S, dp // shard_group, shard_group, cp, tp)``; ``tensor`` varies fastest over the user's devices,
then ``context``, so TP and CP groups land inside a node when the node holds ``cp * tp`` devices.
(The runtime splits ``shard`` into inter- and intra-node parts, `mistjax.runtime.mesh`; the plan
and its JSON keep the single axis.)
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mistjax.core.context import CONTEXT_FORMS, ContextForm
from mistjax.core.schedules import SCHEDULE_NAMES as SCHEDULES
from mistjax.core.schedules import V_SHAPED, ZERO_BUBBLE, stage_groups
from mistjax.core.stages import StageKind, offloaded_layers, stage_kind

if TYPE_CHECKING:
    from pydantic import TypeAdapter, ValidationError
    from pydantic_core import ErrorDetails

SCHEMA_VERSION = 1
PLAN_MESH_AXES = ("stage", "replica", "shard", "context", "tensor")
# Remat policies a stage may name; "names:a,b" saves only the listed checkpoint_name tags.
REMAT_POLICIES = ("full", "dots")
OFFLOAD_FIELDS = ("offload_weights", "offload_grads", "offload_opt", "offload_acts")
GRAD_DTYPES = ("float32", "bfloat16", "float16")


class PlanError(ValueError):
    """A plan is malformed or does not fit the model, mesh or batch it is applied to."""


class PlanDoesNotFit(PlanError):
    """The compiled plan needs more memory on a device than the device has free (checked before the first
    step runs, `mistjax.runtime.fit`).

    Attributes:
        stage: the pipeline stage that does not fit (0 for a plan with one stage).
        need: bytes per device the stage needs at its peak.
        available: bytes the device can still give it (its limit minus what other buffers hold).
        report: the whole check (`mistjax.runtime.fit.FitReport`), or None.
    """

    def __init__(self, message: str, *, stage: int = 0, need: float = 0.0, available: float = 0.0,
                 report: Any = None) -> None:
        super().__init__(message)
        self.stage, self.need, self.available, self.report = stage, float(need), float(available), report

    @property
    def gap(self) -> float:
        """Bytes per device missing: ``need - available``."""
        return self.need - self.available


def _check_remat_policy(policy: str) -> None:
    if policy in REMAT_POLICIES:
        return
    names = policy[len("names:"):] if isinstance(policy, str) and policy.startswith("names:") else ""
    if names and all(n.strip() for n in names.split(",")):
        return
    raise PlanError(
        f"unknown remat policy {policy!r}: use one of {', '.join(REMAT_POLICIES)} or "
        "'names:a,b' to save only the activations tagged with checkpoint_name a and b"
    )


def _is_bool(x: object) -> bool:
    return isinstance(x, bool) or type(x).__name__ == "bool_"  # NumPy's bool too


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not _is_bool(x)


# What from_dict's pydantic validation adds to the dataclasses below (read as ``__pydantic_config__``; a
# plain dict, so that importing this module does not import pydantic): fields it does not know are errors,
# and no value is coerced (a JSON "false" or 1 is not a boolean, "2" or 2.0 not a count).
_JSON_CONFIG = {"extra": "forbid", "strict": True}


@dataclass(frozen=True)
class StagePlan:
    """What one pipeline stage runs and how it saves memory."""

    __pydantic_config__ = _JSON_CONFIG

    layers: tuple[int, int]  # [start, end) of the layer stack this stage runs
    shard_weights: bool = False  # ZeRO-3: parameters stored sharded, gathered per layer
    shard_grads: bool = False  # ZeRO-2: gradients reduce-scattered, kept sharded
    shard_opt: bool = True  # ZeRO-1: optimizer state (and fp32 master) sharded
    remat_layers: int = 0  # the last `remat_layers` layers of the stage are checkpointed
    remat_policy: str = "full"  # what a checkpointed layer saves: full | dots | names:a,b
    offload_weights: float = 0.0  # fraction of the stage's layer weights kept in host memory
    offload_grads: float = 0.0  # fraction of the stage's gradient accumulators kept in host memory
    offload_opt: float = 0.0  # fraction of the stage's optimizer state kept in host memory
    offload_acts: float = 0.0  # fraction of the stage's layers whose saved activations go to host

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def validate(self, index: int = 0) -> None:
        """Raise `PlanError` if a field is out of range (a JSON plan's types are checked by `Plan.from_dict`)."""
        start, end = self.layers
        if not (_is_int(start) and _is_int(end)) or start < 0 or end <= start:
            raise PlanError(f"stage {index}: layer range {self.layers} is empty or negative; "
                            "give [start, end) with integers 0 <= start < end")
        if not (_is_int(self.remat_layers) and 0 <= self.remat_layers <= self.num_layers):
            raise PlanError(f"stage {index}: remat_layers={self.remat_layers!r} must be an integer in "
                            f"[0, {self.num_layers}] (the stage's layer count)")
        _check_remat_policy(self.remat_policy)
        for name in OFFLOAD_FIELDS:
            value = getattr(self, name)
            if _is_bool(value) or not (isinstance(value, numbers.Real) and 0.0 <= float(value) <= 1.0):
                raise PlanError(f"stage {index}: {name}={value!r} is outside [0, 1]; "
                                "offload ratios are fractions")
        if self.shard_grads and not self.shard_opt:
            raise PlanError(f"stage {index}: shard_grads (ZeRO-2) requires shard_opt (ZeRO-1)")
        if self.shard_weights and not self.shard_grads:
            raise PlanError(f"stage {index}: shard_weights (ZeRO-3) requires shard_grads (ZeRO-2)")

    @property
    def zero_stage(self) -> int:
        return 3 if self.shard_weights else 2 if self.shard_grads else 1 if self.shard_opt else 0

    @property
    def offloaded_layers(self) -> int:
        """Layers whose activations go to host (`mistjax.core.stages.offloaded_layers`)."""
        return int(offloaded_layers(self.num_layers, self.remat_layers, self.offload_acts))  # (scalars: an int)


STATE_CATEGORIES = ("params", "optimizer")  # memory categories that are the train state (XLA's arguments)


def guarded_peak(memory: Mapping[str, Any], margin: float) -> Any:
    """A peak with ``margin`` of its non-state part added (`DeviceSpec.memory_margin`): what a plan must
    keep within the budget. Works on floats and on the cost model's per-strategy arrays alike."""
    total = sum(memory.values())
    state = sum(memory.get(c, 0.0) for c in STATE_CATEGORIES)
    return total + margin * (total - state)


def _spread(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` counts within one of each other, the larger first."""
    return [total // parts + (i < total % parts) for i in range(parts)]


RETUNE_MARGIN = 0.03  # of a lowered budget, kept free for what the next plan's prediction may miss


def lowered_budget(budget: float, predicted: float, need: float, available: float) -> float:
    """The per-device budget to re-tune for after a plan predicted at ``predicted`` bytes needed ``need``
    where ``available`` were (compiled for the GPU, or measured free on it).

    From the predicted peak (or the budget, if lower), the gap is taken off twice over: as bytes (an
    error of the prediction that stays when the plan changes, e.g. a buffer it does not model) and in
    proportion (x available / need, an error that scales with the plan); the lower of the two, less
    `RETUNE_MARGIN`. Below the plan's own prediction, so a search cannot return that plan again.
    """
    base = min(budget, predicted) if predicted > 0 else budget
    return min(base - (need - available), base * max(available, 0.0) / max(need, 1.0)) * (1 - RETUNE_MARGIN)


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicted for a plan (seconds and bytes per device)."""

    __pydantic_config__ = _JSON_CONFIG

    step_time: float  # predicted seconds per optimizer step
    stage_stable: tuple[float, ...] = ()  # per stage: steady-state seconds per micro-batch
    stage_delta: tuple[float, ...] = ()  # per stage: extra seconds of first + last micro-batch
    stage_memory: tuple[dict[str, float], ...] = ()  # per stage: peak bytes by category
    tokens_per_s: float = 0.0  # global tokens per second at the predicted step time

    @property
    def peak_memory(self) -> float:
        return max((sum(m.values()) for m in self.stage_memory), default=0.0)

    def guarded_peak(self, margin: float) -> float:
        """The largest stage's `guarded_peak`."""
        return max((float(guarded_peak(m, margin)) for m in self.stage_memory), default=0.0)


@dataclass(frozen=True)
class SearchRecord:
    """How the search that chose a plan ended (`mistjax.tuning.SearchResult`): whether the plan is its space's best.

    Every count is deterministic for a search that was not stopped by the clock, so two machines that complete
    the same search record the same values.
    """

    __pydantic_config__ = _JSON_CONFIG

    complete: bool  # every outer key was searched or pruned by a sound bound: the plan is the space's best
    stopped_by: str = ""  # "" (complete), "work budget" (deterministic) or "time limit" (the clock)
    keys: int = 0  # outer keys in the space
    keys_pruned: int = 0  # keys whose lower bound proved they cannot beat the plan
    keys_cut: int = 0  # keys the budget or the time limit left unsearched or searched in part
    strategies_priced: int = 0  # stage strategies the cost model priced
    milps: int = 0  # inter-stage MILPs solved
    gap: float | None = 0.0  # proven bound on how much faster the space's best can be (None: unbounded)


@dataclass(frozen=True)
class Plan:
    """A complete distributed-training plan for one model on one mesh.

    DP, TP, the micro-batch size and the MiCS group are uniform across stages, as in Mist's
    MILP mode; everything that saves memory is chosen per stage.
    """

    __pydantic_config__ = _JSON_CONFIG

    stages: tuple[StagePlan, ...]  # pipeline stages in order; one stage = no pipelining
    micro_batch: int = 1  # b: sequences per data-parallel rank per micro-batch
    grad_accum: int = 1  # G: micro-batches per optimizer step (pipeline depth to fill)
    dp: int = 1  # data-parallel degree per stage (= replica * shard extents)
    tp: int = 1  # tensor-parallel degree (Megatron column/row split + sequence parallel)
    shard_group: int = 0  # MiCS partition group p (divides dp); 0 means dp (plain ZeRO)
    # Context-parallel degree: every sequence split over `cp` devices along its length (ring attention over
    # the `context` mesh axis; docs/context-parallel.md). Weights are replicated over it, gradients summed.
    cp: int = 1
    # How the sequence-split attention communicates (`core.context.ContextForm`): "ring" passes key / value
    # shards around the cp devices; "ulysses" exchanges the sequence split for a head split by all-to-all.
    cp_form: str = "ring"
    schedule: str = "1f1b"  # pipeline schedule when there are several stages
    # Chunks of layers per pipeline device group (Megatron's interleaved 1F1B when > 1; 2 under "zb-v"):
    # `stages` then lists len(stages) virtual stages in layer order, and virtual stage k runs on device group
    # k % (len(stages) // virtual_stages), or under "zb-v" in a V (`core.schedules.stage_groups`).
    virtual_stages: int = 1
    # dtype gradients are accumulated and reduced in (None: each parameter's own dtype; Megatron-LM
    # accumulates and reduces bf16 models' gradients in "float32", Mist keeps them in the 16-bit dtype)
    grad_dtype: str | None = None
    # Tensor-parallel collectives as collective matmuls: each layer's all-gathers / reduce-scatters run as rings of
    # chunked matmuls and neighbour transfers, each transfer beside a chunk's GEMM (`runtime.collective_matmul`;
    # Megatron-LM's --tp-comm-overlap, torchtitan's async TP). The tuner sets it where the cost model predicts a
    # gain; it applies to nothing at tp 1 or with context parallelism (the rings need the sequence split over
    # `tensor` alone).
    tp_overlap: bool = False
    prediction: Prediction | None = None  # the cost model's view when the plan was chosen
    fingerprints: dict[str, str] = field(default_factory=dict)  # model / mesh / hardware / batch
    # How the search that chose the plan ended (None: not tuned); metadata, so plans compare without it.
    search: SearchRecord | None = field(default=None, compare=False)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if self.shard_group == 0:
            object.__setattr__(self, "shard_group", self.dp)
        self.validate()

    # ---------------------------------------------------------------- derived sizes
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def device_stages(self) -> int:
        """Pipeline device groups (physical stages): ``num_stages / virtual_stages``."""
        return self.num_stages // self.virtual_stages

    @property
    def stage_groups(self) -> tuple[int, ...]:
        """The device group each (virtual) stage runs on (`core.schedules.stage_groups`)."""
        return tuple(int(g) for g in stage_groups(self.num_stages, self.device_stages, self.schedule))

    @property
    def num_devices(self) -> int:
        return self.device_stages * self.dp * self.cp * self.tp

    @property
    def replicas(self) -> int:
        return self.dp // self.shard_group

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.dp * self.grad_accum

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(zip(PLAN_MESH_AXES, (self.device_stages, self.replicas, self.shard_group, self.cp, self.tp)))

    def stage_kind(self, index: int) -> StageKind:
        """What makes stage ``index``'s code differ from the others' (`mistjax.core.stages`)."""
        s = self.stages[index]
        return stage_kind(index, self.num_stages, s.num_layers, s.remat_layers, s.remat_policy, s.offloaded_layers)

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check the plan on its own (no model or mesh needed); raise `PlanError`."""
        if self.schema_version != SCHEMA_VERSION:
            raise PlanError(f"plan schema version {self.schema_version} is not supported "
                            f"(this mistjax reads version {SCHEMA_VERSION}); re-run the tuner")
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        for name in ("micro_batch", "grad_accum", "dp", "tp", "cp", "shard_group", "virtual_stages"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise PlanError(f"{name}={value!r} must be a positive integer (a JSON number, not a string)")
        if self.dp % self.shard_group:
            raise PlanError(f"shard_group={self.shard_group} must divide dp={self.dp} "
                            "(MiCS partition groups tile the data-parallel ranks)")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r}: use one of {SCHEDULES}")
        if self.num_stages % self.virtual_stages:
            raise PlanError(f"virtual_stages={self.virtual_stages} must divide the {self.num_stages} stages: "
                            "list every chunk of every device group, in layer order")
        if self.virtual_stages > 1:
            groups = self.device_stages
            if groups < 2:
                raise PlanError(f"virtual_stages={self.virtual_stages} needs at least two device groups, "
                                f"but the {self.num_stages} stages make {groups}; use fewer virtual stages")
            if self.schedule == "1f1b-eager":
                raise PlanError("schedule 1f1b-eager has no interleaved form; use 1f1b (interleaved 1F1B) or "
                                "gpipe with virtual_stages > 1")
            if self.schedule in ZERO_BUBBLE - V_SHAPED:
                raise PlanError(f"schedule {self.schedule} runs one chunk per device group here; use "
                                "virtual_stages=1 with it, or schedule 1f1b (interleaved 1F1B) or zb-v")
            if self.schedule == "1f1b" and self.grad_accum < groups:
                raise PlanError(f"interleaved 1F1B runs micro-batches in groups of the {groups} device groups: "
                                f"grad_accum={self.grad_accum} must be at least {groups}")
        if self.schedule in V_SHAPED and self.num_stages > 1 and self.virtual_stages != 2:
            raise PlanError(f"schedule {self.schedule} runs two chunks per device group placed in a V: set "
                            f"virtual_stages=2 (this plan has {self.virtual_stages}), e.g. with Plan.v_shaped()")
        if self.cp_form not in CONTEXT_FORMS:
            raise PlanError(f"unknown cp_form {self.cp_form!r}: use one of {CONTEXT_FORMS}")
        if self.cp_form != ContextForm.RING and self.cp == 1:
            raise PlanError(f"cp_form={self.cp_form!r} applies only with context parallelism: set cp > 1, or leave "
                            "cp_form at 'ring'")
        if not _is_bool(self.tp_overlap):
            raise PlanError(f"tp_overlap={self.tp_overlap!r} must be true or false")
        if self.grad_dtype is not None and self.grad_dtype not in GRAD_DTYPES:
            raise PlanError(f"grad_dtype={self.grad_dtype!r} is not supported: use one of {GRAD_DTYPES} or null "
                            "(each parameter's own dtype)")
        for i, stage in enumerate(self.stages):
            stage.validate(i)
        if self.stages[0].layers[0] != 0:
            raise PlanError(f"stage 0 must start at layer 0, not {self.stages[0].layers[0]}")
        for i in range(1, self.num_stages):
            if self.stages[i].layers[0] != self.stages[i - 1].layers[1]:
                raise PlanError(f"stage {i} starts at layer {self.stages[i].layers[0]} but stage {i - 1} "
                                f"ends at {self.stages[i - 1].layers[1]}: stages must be contiguous")

    def check_devices(self, num_devices: int) -> None:
        """Raise `PlanError` unless the plan uses exactly `num_devices` devices."""
        if num_devices != self.num_devices:
            raise PlanError(
                f"the plan needs {self.num_devices} devices (stages {self.device_stages} x dp {self.dp} x "
                f"{f'cp {self.cp} x ' if self.cp > 1 else ''}tp {self.tp}) but the mesh has {num_devices}; "
                "tune for this mesh or pass a plan made "
                "for it")

    def check_batch(self, global_batch: int) -> None:
        """Raise `PlanError` unless micro-batch x DP x accumulation equals the global batch."""
        if global_batch != self.global_batch:
            raise PlanError(
                f"global batch {global_batch} != micro_batch {self.micro_batch} x dp {self.dp} x "
                f"grad_accum {self.grad_accum} = {self.global_batch}: the plan runs exactly {self.global_batch} "
                f"sequences per step; pass batches of {self.global_batch}, or re-plan for batch {global_batch} "
                "(autoshard without plan=, or a plan whose micro_batch x dp x grad_accum equals it)")

    def check_model(self, fingerprint: str) -> None:
        """Raise `PlanError` if the plan records a different model fingerprint."""
        made_for = self.fingerprints.get("model")
        if made_for and made_for != fingerprint:
            raise PlanError(f"the plan was made for another model (parameter fingerprint {made_for}, this model "
                            f"has {fingerprint}); re-run the tuner for this model or pass a plan made for it")

    def check_layers(self, num_layers: int) -> None:
        """Raise `PlanError` unless the stages cover exactly `num_layers` layers."""
        if self.num_layers != num_layers:
            raise PlanError(f"the plan's stages cover {self.num_layers} layers but the model has "
                            f"{num_layers}; the plan was made for another model")

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["stages"] = [dict(s, layers=list(s["layers"])) for s in out["stages"]]
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: object) -> Plan:
        """The plan a JSON object describes (`to_dict`'s form), checked by pydantic against these dataclasses'
        fields: unknown fields, missing ones and values of the wrong JSON type are a `PlanError` with one line
        per problem, each naming the field's path (``stages.1.shard_opt: ...``); then `validate`."""
        if not isinstance(data, dict):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:  # before the fields: another version's fields would be reported one by one
            raise PlanError(f"plan schema version {version!r} is not supported (this mistjax reads "
                            f"version {SCHEMA_VERSION}); re-run the tuner to make a new plan")
        from pydantic import ValidationError

        try:
            text = json.dumps(data, default=_json_scalar)
        except (TypeError, ValueError) as e:
            raise PlanError(f"malformed plan: {e}") from e
        try:
            # JSON mode: strict types as JSON has them (an array is a tuple, a whole number a float).
            return _json_adapter(cls).validate_json(text)
        except ValidationError as e:
            raise _plan_error(e, cls) from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file is not valid JSON ({e}); was it truncated? "
                            "re-save it with plan.save() or `mistjax plan --json`") from e
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON (atomically: a partial file never replaces a good one)."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"plan file {str(path)!r} does not exist")
        return cls.from_json(path.read_text())

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    def interleaved(self, chunks: int) -> Plan:
        """This one-chunk pipelined plan run as interleaved 1F1B: each device group's layers split into
        ``chunks`` virtual stages (sizes within one layer of each other, the larger first), its checkpointed
        layers spread the same way and every other knob kept; chunk ``c`` of group ``g`` is virtual stage
        ``c * groups + g``, and layers run in that order. The prediction is dropped.

        Raises:
            PlanError: ``chunks`` is not an integer >= 2; the plan is not a one-chunk 1F1B plan of several
                stages; a group has fewer layers than ``chunks``; or ``grad_accum`` is below the groups
                (interleaved 1F1B advances micro-batches in groups of them).
        """
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
            raise PlanError(f"interleaved({chunks!r}): chunks per device group must be an integer >= 2")
        if self.virtual_stages != 1 or self.num_stages < 2 or self.schedule != "1f1b":
            raise PlanError(f"interleaved({chunks}) needs a one-chunk 1f1b plan of several stages (this plan: "
                            f"{self.num_stages} stage(s) of {self.virtual_stages} chunk(s), schedule {self.schedule})")
        short = [i for i, st in enumerate(self.stages) if st.num_layers < chunks]
        if short:
            raise PlanError(f"interleaved({chunks}): stage(s) {short} hold fewer than {chunks} layers; use fewer "
                            "chunks")
        parts = [[dataclasses.replace(st, layers=(0, n), remat_layers=r)
                  for n, r in zip(_spread(st.num_layers, chunks), _spread(st.remat_layers, chunks))]
                 for st in self.stages]
        stages, start = [], 0
        for c in range(chunks):
            for g in range(self.num_stages):
                n = parts[g][c].num_layers
                stages.append(dataclasses.replace(parts[g][c], layers=(start, start + n)))
                start += n
        return self.replace(stages=tuple(stages), virtual_stages=chunks, schedule="1f1b", prediction=None)

    def v_shaped(self) -> Plan:
        """This one-chunk pipelined plan run as ZB-V: each device group's layers split into two virtual stages
        (the larger first) placed in a V, group ``g`` running virtual stages ``g`` and ``2S - 1 - g`` (so the
        first group also runs the head), its checkpointed layers spread the same way, every other knob kept.
        Layers run in virtual-stage order. The prediction is dropped.

        Raises:
            PlanError: the plan is not a one-chunk plan of several stages, or a group holds fewer than two
                layers.
        """
        if self.virtual_stages != 1 or self.num_stages < 2:
            raise PlanError(f"v_shaped() needs a one-chunk plan of several stages (this plan: {self.num_stages} "
                            f"stage(s) of {self.virtual_stages} chunk(s))")
        short = [i for i, st in enumerate(self.stages) if st.num_layers < 2]
        if short:
            raise PlanError(f"v_shaped(): stage(s) {short} hold fewer than 2 layers; ZB-V gives each device group "
                            "two chunks of at least one layer")
        S = self.num_stages
        parts = [[dataclasses.replace(st, layers=(0, n), remat_layers=r)
                  for n, r in zip(_spread(st.num_layers, 2), _spread(st.remat_layers, 2))]
                 for st in self.stages]
        stages, start = [], 0
        for k in range(2 * S):
            part = parts[k][0] if k < S else parts[2 * S - 1 - k][1]
            stages.append(dataclasses.replace(part, layers=(start, start + part.num_layers)))
            start += part.num_layers
        return self.replace(stages=tuple(stages), virtual_stages=2, schedule="zb-v", prediction=None)

    # ---------------------------------------------------------------- display
    def summary(self) -> str:
        """A human-readable description of the plan and its prediction."""
        groups = (f"{self.device_stages} stage(s) of {self.virtual_stages} "
                  f"{'V-shaped' if self.schedule in V_SHAPED else 'interleaved'} chunks"
                  if self.virtual_stages > 1 else f"{self.num_stages} stage(s)")
        lines = [
            f"Plan: {groups} x dp {self.dp} x {f'cp {self.cp} x ' if self.cp > 1 else ''}tp {self.tp} = "
            f"{self.num_devices} devices, "
            f"micro-batch {self.micro_batch}, {self.grad_accum} micro-batch(es)/step "
            f"(global batch {self.global_batch}), schedule {self.schedule if self.num_stages > 1 else '-'}",
        ]
        if self.shard_group != self.dp:
            lines.append(f"  MiCS: states sharded over groups of {self.shard_group}, "
                         f"{self.replicas} replicas (2-hop gradient sync)")
        if self.tp > 1:
            lines.append("  tensor parallel: Megatron column/row split with sequence parallelism")
        if self.cp > 1:
            how = ("ring attention" if self.cp_form == ContextForm.RING
                   else "Ulysses: all-to-all to a head split and back")
            lines.append(f"  context parallel: each sequence split over {self.cp} devices ({how} for the blockwise "
                         "kernel)" + ("; optimizer state sharded over the data x context group"
                                      if self.stages[0].shard_opt else ""))
        if self.schedule in V_SHAPED and self.virtual_stages > 1:
            lines.append(f"  V-shaped (zb-v): stage k below runs on device group k for k < {self.device_stages}, "
                         f"on {2 * self.device_stages - 1} - k after")
        elif self.virtual_stages > 1:
            lines.append(f"  interleaved: stage k below is chunk k // {self.device_stages} of device group "
                         f"k % {self.device_stages}")
        if self.grad_dtype is not None:
            lines.append(f"  gradients accumulated and reduced in {self.grad_dtype}")
        if self.tp_overlap:
            lines.append("  tensor-parallel collectives as collective matmuls (tp_overlap)"
                         + (": applies to nothing at tp 1 or with cp > 1" if self.tp == 1 or self.cp > 1 else ""))
        zero = max(s.zero_stage for s in self.stages)
        if zero and self.shard_group * (self.cp if self.cp > 1 and self.stages[0].shard_opt else 1) == 1:
            lines.append(f"  ZeRO: the stages' ZeRO-{zero} flags shard nothing: the partition group is 1 device "
                         f"(dp {self.dp}), so every device holds the whole state")
        hdr = f"  {'stage':>5} {'layers':>9} {'ZeRO':>4} {'remat':>12} {'off w/g/o/a':>19}"
        lines.append(hdr)
        for i, s in enumerate(self.stages):
            remat = f"{s.remat_layers}x{s.remat_policy}" if s.remat_layers else "-"
            off = "/".join(f"{getattr(s, n):.2f}".rstrip("0").rstrip(".") for n in OFFLOAD_FIELDS)
            lines.append(f"  {i:>5} {f'{s.layers[0]}-{s.layers[1]}':>9} {s.zero_stage:>4} {remat:>12} {off:>19}")
        p = self.prediction
        if p is not None:
            lines.append(f"  predicted: {p.step_time:.4g} s/step, {p.tokens_per_s:,.0f} tokens/s, "
                         f"peak {format_bytes(p.peak_memory)}/device")
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (e.g. ``3.25 GiB``, ``712 KiB``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _json_scalar(value: object) -> object:
    """``json.dumps``'s fallback: a NumPy scalar (a count or flag computed with NumPy) as its Python value."""
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():
        return item()
    raise TypeError(f"{value!r} ({type(value).__name__}) is not a JSON value")


_JSON_ADAPTERS: dict[type[Plan], TypeAdapter[Plan]] = {}


def _json_adapter(cls: type[Plan]) -> TypeAdapter[Plan]:
    """pydantic's validator of ``cls``'s JSON form (built once per class; pydantic is imported on first use)."""
    if cls not in _JSON_ADAPTERS:
        from pydantic import TypeAdapter

        _JSON_ADAPTERS[cls] = TypeAdapter(cls)
    return _JSON_ADAPTERS[cls]


# Per pydantic error type: what the value must be instead, in JSON's words.
_JSON_TYPE_FIXES = {
    "bool_type": "must be true or false (a JSON boolean, not a string or number)",
    "int_type": "must be an integer (a JSON number such as 2, not a string)",
    "float_type": "must be a number (a JSON number such as 0.5, not a string)",
    "string_type": "must be a string (in double quotes)",
    "tuple_type": "must be a JSON array",
    "list_type": "must be a JSON array",
    "dict_type": "must be a JSON object",
    "dataclass_type": "must be a JSON object",
}


def _field_owner(cls: type[Plan], loc: tuple[int | str, ...]) -> type:
    """The dataclass whose field ``loc`` (a pydantic error location) names."""
    owner: type = cls
    for part in loc[:-1]:
        if part == "stages":
            owner = StagePlan
        elif part == "prediction":
            owner = Prediction
    return owner


def _problem(cls: type[Plan], err: ErrorDetails) -> str:
    """One line for one pydantic error: the field's path, the value, what it must be."""
    import difflib

    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in loc) or "the plan"
    kind = err["type"]
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        owner = _field_owner(cls, loc)
        known = [f.name for f in dataclasses.fields(owner)]
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        what = {StagePlan: "a stage", Prediction: "a prediction"}.get(owner, "a plan")
        return f"{path}: unknown field{hint}; {what}'s fields are {', '.join(known)}"
    if kind in ("missing", "missing_keyword_argument"):
        return f"{path}: missing (a required field)"
    if loc and loc[-1] == "layers" and kind in ("too_long", "too_short", "tuple_type"):
        return f"{path}: {err['input']!r} must be two integers [start, end)"
    fix = _JSON_TYPE_FIXES.get(kind)
    if fix is not None:
        return f"{path}: {err['input']!r} {fix}"
    return f"{path}: {err['msg']}"


def _plan_error(error: ValidationError, cls: type[Plan]) -> PlanError:
    """pydantic's ``error`` as a `PlanError`: the plan's own check (`Plan.validate`, run as the dataclass is
    built) as it is, else one line per problem."""
    errors = error.errors()
    for err in errors:
        original = (err.get("ctx") or {}).get("error")
        if isinstance(original, PlanError):
            return original
    lines = [_problem(cls, err) for err in errors]
    if len(lines) == 1:
        return PlanError(f"malformed plan: {lines[0]}")
    return PlanError(f"malformed plan ({len(lines)} problems):\n  " + "\n  ".join(lines))


def params_fingerprint(params: Any) -> str:
    """A short hash of a parameter pytree's structure, shapes and dtypes (what a plan was made for)."""
    import hashlib

    import jax
    import numpy as np

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    text = ";".join(f"{jax.tree_util.keystr(p)}:{tuple(np.shape(x))}:{np.dtype(x.dtype).name}" for p, x in leaves)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def uniform_plan(num_layers: int, num_devices: int, *, stages: int = 1, tp: int = 1, cp: int = 1, micro_batch: int = 1,
                 grad_accum: int = 1, shard_group: int = 0, schedule: str = "1f1b", grad_dtype: str | None = None,
                 cp_form: str = "ring", **stage_fields: Any) -> Plan:
    """A plan with evenly split stages that all share ``stage_fields`` (handy for tests and baselines).

    Every knob is off unless asked for: one stage, no tensor or context parallelism, one micro-batch of one
    sequence per data-parallel rank, no ZeRO (``shard_opt``, ``shard_grads`` and ``shard_weights`` all False:
    pass ``shard_opt=True`` for ZeRO-1, ``shard_opt=True, shard_grads=True`` for ZeRO-2, all three for ZeRO-3),
    no remat, no offload. ``dp`` is what the devices leave: ``num_devices // (stages * cp * tp)``.

    Args:
        num_layers: layers of the model's layer stack, split into ``stages`` runs within one layer of each other.
        num_devices: devices the plan uses.
        stages: pipeline stages (default 1: no pipelining).
        tp: tensor-parallel degree (default 1).
        cp: context-parallel degree (default 1).
        micro_batch: sequences per data-parallel rank per micro-batch (default 1).
        grad_accum: micro-batches per step (default 1).
        shard_group: MiCS partition group (default 0: all of dp, plain ZeRO).
        schedule: pipeline schedule (default ``1f1b``).
        grad_dtype: dtype gradients are accumulated and reduced in (default None: each parameter's own).
        cp_form: how sequence-split attention communicates (default ``ring``).
        **stage_fields: `StagePlan` fields every stage gets (``remat_layers`` is capped at each stage's layers).

    Raises:
        PlanError: an unknown stage field, devices that do not split into ``stages x cp x tp``, or fewer layers
            than stages.
    """
    stage_fields.setdefault("shard_opt", False)  # StagePlan's own default is True (ZeRO-1): never turned on unasked
    known = {f.name for f in dataclasses.fields(StagePlan)} - {"layers"}
    for name in stage_fields:
        if name not in known:
            import difflib

            close = difflib.get_close_matches(name, sorted(known) + ["stages", "tp", "cp", "cp_form", "micro_batch",
                                                                     "grad_accum", "shard_group", "schedule"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PlanError(f"uniform_plan got an unknown keyword {name!r}{hint}; stage fields are "
                            f"{', '.join(sorted(known))}")
    if num_devices % (stages * tp * cp):
        raise PlanError(f"{num_devices} devices do not split into {stages} stages x cp {cp} x tp {tp}")
    dp = num_devices // (stages * tp * cp)
    bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
    if len(set(bounds)) != len(bounds):
        raise PlanError(f"cannot split {num_layers} layers into {stages} non-empty stages")
    stage_plans = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        fields = dict(stage_fields)
        if "remat_layers" in fields:
            fields["remat_layers"] = min(fields["remat_layers"], b - a)
        stage_plans.append(StagePlan(layers=(a, b), **fields))
    return Plan(stages=tuple(stage_plans), micro_batch=micro_batch, grad_accum=grad_accum, dp=dp, tp=tp, cp=cp,
                cp_form=cp_form, shard_group=shard_group, schedule=schedule, grad_dtype=grad_dtype)


__all__ = ["Plan", "StagePlan", "Prediction", "SearchRecord", "PlanError", "PlanDoesNotFit", "uniform_plan",
           "params_fingerprint",
           "guarded_peak", "lowered_budget", "RETUNE_MARGIN", "STATE_CATEGORIES",
           "PLAN_MESH_AXES", "SCHEMA_VERSION", "REMAT_POLICIES"]
