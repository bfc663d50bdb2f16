"""The contract between the tuner and the cost model: candidate stage strategies in, their costs out.

The tuner prices arrays of `StageStrategies` (one candidate per element, NumPy-broadcast) through a
`CostModel`: a pair of pure functions in the style of optax's ``GradientTransformation``. The
project's model is `mistjax.cost.COST_MODEL`; tests implement the same interface with a stub.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Generic, NamedTuple, Protocol, TypeVar

import numpy as np

from mistjax.core.plan import Plan, Prediction


@dataclass(frozen=True)
class StageStrategies:
    """Arrays (broadcastable to one shape) describing candidate stage strategies, one per element."""

    b: np.ndarray  # micro-batch size per data-parallel rank
    dp: np.ndarray  # data-parallel degree (replica x shard)
    tp: np.ndarray  # tensor-parallel degree
    shard_group: np.ndarray  # MiCS partition group p (= dp for plain ZeRO)
    zero: np.ndarray  # ZeRO stage 0-3
    layers: np.ndarray  # l: layers of the stage
    remat: np.ndarray  # c: checkpointed layers (the last c of the stage)
    policy: np.ndarray  # index into workload.policies of the checkpointed layers' policy
    wo: np.ndarray  # weight offload ratio
    go: np.ndarray  # gradient-accumulator offload ratio
    oo: np.ndarray  # optimizer-state offload ratio
    ao: np.ndarray  # activation offload ratio (of the non-checkpointed layers)
    inflight: np.ndarray  # micro-batches whose activations the stage holds at its peak
    G: np.ndarray  # micro-batches per step
    first: np.ndarray  # bool: the stage runs pre (embedding)
    last: np.ndarray  # bool: the stage runs post (head + loss)
    stages: np.ndarray  # S: pipeline stages of the plan
    nodes: np.ndarray  # nodes of the stage's device mesh
    per_node: np.ndarray  # devices per node of the stage's mesh
    cp: np.ndarray | int = 1  # context-parallel degree: each sequence split over cp devices (single stage)
    ulysses: np.ndarray | int = 0  # bool: the context-parallel attention is Ulysses' all-to-all (else the ring)
    deferred: np.ndarray | int = 0  # micro-batches whose weight-gradient stash the stage holds (zero-bubble)
    chunks: np.ndarray | int = 1  # layer chunks the stage's device group runs (interleaved 1F1B): each sends
    tp_overlap: np.ndarray | int = 0  # bool: the TP collectives run as collective matmuls (`Plan.tp_overlap`)

    @property
    def shape(self) -> tuple[int, ...]:
        return np.broadcast_shapes(*(np.shape(getattr(self, f.name)) for f in fields(self)))

    @classmethod
    def make(cls, **kw: object) -> StageStrategies:
        """Build with defaults for omitted fields (single stage, no offload, no remat)."""
        d: dict[str, object] = dict(
            b=1, dp=1, tp=1, cp=1, ulysses=0, shard_group=0, zero=0, layers=1, remat=0, policy=0, wo=0.0, go=0.0,
            oo=0.0, ao=0.0, inflight=1, deferred=0, chunks=1, G=1, first=True, last=True, stages=1, nodes=1, per_node=0,
            tp_overlap=0)
        d.update(kw)
        arr = {k: np.asarray(v) for k, v in d.items()}
        arr["shard_group"] = np.where(arr["shard_group"] <= 0, arr["dp"], arr["shard_group"])
        arr["per_node"] = np.where(arr["per_node"] <= 0, arr["dp"] * arr["cp"] * arr["tp"], arr["per_node"])
        return cls(**arr)


class StageCostLike(Protocol):
    """What the tuner reads of a cost-model answer (arrays of the strategies' broadcast shape; read-only, so a
    frozen dataclass provides them)."""

    @property
    def stable(self) -> np.ndarray: ...  # seconds of one steady micro-batch (forward + backward)

    @property
    def delta(self) -> np.ndarray: ...  # extra seconds of the first + last micro-batch incl. once-per-step work

    @property
    def fwd(self) -> np.ndarray: ...  # forward part of `stable`

    @property
    def bwd(self) -> np.ndarray: ...  # backward part of `stable`

    @property
    def wgrad(self) -> np.ndarray: ...  # weight-gradient part of `bwd` (a zero-bubble schedule defers it)

    @property
    def memory(self) -> dict[str, np.ndarray]: ...  # per-device bytes by category

    @property
    def peak(self) -> np.ndarray: ...  # per-device peak bytes

    @property
    def feasible(self) -> np.ndarray: ...  # fits the memory budget and the tensor-parallel degree divides the model

    @property
    def host(self) -> np.ndarray: ...  # host bytes per device (offloaded states and activations)

    # A lower bound of the guarded peak at smaller offload ratios (all else equal), compared with the cluster's
    # memory budget: above it, no strategy that offloads less fits.
    @property
    def offload_floor(self) -> np.ndarray: ...


class WorkloadLike(Protocol):
    """What the tuner reads of a workload (the cost model's description of one training job)."""

    @property
    def num_layers(self) -> int: ...  # layers of the model's stack

    @property
    def global_batch(self) -> int: ...  # sequences per optimizer step

    @property
    def seq_len(self) -> int: ...  # tokens per sequence

    @property
    def policies(self) -> tuple[str, ...]: ...  # remat policy names `StageStrategies.policy` indexes

    @property
    def grad_dtype(self) -> str | None: ...  # dtype gradients are accumulated and reduced in (plans carry it)

    def fingerprint(self) -> str: ...  # short stable hash of model, sizes, batch and optimizer

    def supports_tp(self, tp: int) -> bool: ...  # whether tensor parallelism of degree tp applies

    def supports_cp(self, cp: int, tp: int = 1) -> bool: ...  # whether context parallelism of degree cp applies

    # The context-parallel forms (`core.context.CONTEXT_FORMS`) that apply at (cp, tp); () where none does.
    def context_forms(self, cp: int, tp: int = 1) -> tuple[str, ...]: ...


# A cost model is written for its own workload and cluster types (the project's: `mistjax.cost.Workload` and
# `mistjax.hardware.ClusterSpec`, which this layer cannot import; the tests' stub has its own workload), so the
# function protocols take them as type parameters; contravariant, as argument types are.
W_contra = TypeVar("W_contra", bound=WorkloadLike, contravariant=True)
C_contra = TypeVar("C_contra", contravariant=True)
W = TypeVar("W", bound=WorkloadLike)
C = TypeVar("C")


class StageCostFn(Protocol[W_contra, C_contra]):
    """Prices every strategy of a `StageStrategies` on a cluster (vectorised)."""

    def __call__(self, workload: W_contra, cluster: C_contra, strategies: StageStrategies, /) -> StageCostLike: ...


class PredictFn(Protocol[W_contra, C_contra]):
    """The full prediction of one `Plan` on a cluster."""

    def __call__(self, workload: W_contra, plan: Plan, cluster: C_contra) -> Prediction: ...


class StageMemoryLike(Protocol):
    """The part of a `StageCostLike` that says whether strategies fit (no times)."""

    @property
    def feasible(self) -> np.ndarray: ...

    @property
    def offload_floor(self) -> np.ndarray: ...


class StageMemoryFn(Protocol[W_contra, C_contra]):
    """Says whether every strategy of a `StageStrategies` fits (vectorised; cheaper than pricing it)."""

    def __call__(self, workload: W_contra, cluster: C_contra, strategies: StageStrategies, /) -> StageMemoryLike: ...


class CostModel(NamedTuple, Generic[W, C]):
    """A cost model as the tuner uses it, for workloads of type ``W`` on clusters of type ``C``.

    Attributes:
        stage_cost: prices every strategy of a `StageStrategies` on a cluster (vectorised).
        predict: the full prediction of one `Plan` (the runtime's view: what the plan will cost).
        stage_memory: ``stage_cost``'s ``feasible`` and ``offload_floor`` alone, where a cost model can answer
            them for less (None: the tuner calls ``stage_cost``).
    """

    stage_cost: StageCostFn[W, C]
    predict: PredictFn[W, C]
    stage_memory: StageMemoryFn[W, C] | None = None


__all__ = ["CostModel", "PredictFn", "StageCostFn", "StageCostLike", "StageMemoryFn", "StageMemoryLike",
           "StageStrategies", "WorkloadLike"]
