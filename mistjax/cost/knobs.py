"""The cost model's intermediate records: strategies broadcast to one shape (`Knobs`), the layer kinds
they imply (`LayerKinds`) and the model-state bytes they store (`StateBytes`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from mistjax.core.strategies import StageStrategies


@dataclass(frozen=True)
class Knobs:
    """`StageStrategies` as float arrays of one broadcast shape (``inflight`` keeps its own axes), with the same
    field names.

    Only memory depends on the in-flight count, so extra leading axes of it (one per pipeline schedule,
    as the tuner passes) cost no time work.
    """

    b: np.ndarray  # micro-batch size per data-parallel rank
    tp: np.ndarray  # tensor-parallel degree
    cp: np.ndarray  # context-parallel degree (the sequence split)
    ulysses: np.ndarray  # bool: the context-parallel attention is Ulysses' all-to-all (else the ring)
    dp: np.ndarray  # data-parallel degree
    shard_group: np.ndarray  # MiCS partition group (the ZeRO group; dp for plain ZeRO)
    zero: np.ndarray  # ZeRO stage 0-3 (int)
    layers: np.ndarray  # layers of the stage
    remat: np.ndarray  # checkpointed layers (at most `layers`)
    policy: np.ndarray  # index into the workload's policies (int)
    wo: np.ndarray  # weight offload ratio
    go: np.ndarray  # gradient-accumulator offload ratio
    oo: np.ndarray  # optimizer-state offload ratio
    ao: np.ndarray  # activation offload ratio
    inflight: np.ndarray  # micro-batches in flight (its own broadcast axes)
    deferred: np.ndarray  # micro-batches whose weight-gradient stash is held (zero-bubble; inflight's axes)
    G: np.ndarray  # micro-batches per step
    stages: np.ndarray  # pipeline stages of the plan
    first: np.ndarray  # bool: runs the pre part
    last: np.ndarray  # bool: runs the post part
    nodes: np.ndarray  # nodes of the stage's mesh
    per_node: np.ndarray  # devices per node of the stage's mesh
    chunks: np.ndarray  # layer chunks the stage's device group runs (interleaved 1F1B)
    tp_overlap: np.ndarray  # bool: the TP collectives run as collective matmuls (`Plan.tp_overlap`)

    @property
    def pipelined(self) -> np.ndarray:
        return self.stages > 1

    @property
    def context_shards(self) -> np.ndarray:
        """The `context` devices the optimizer state is split over too (`core.layout.context_shards`): ``cp``
        with ZeRO >= 1, else 1."""
        return np.where((self.zero >= 1) & (self.cp > 1), self.cp, 1.0)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.b.shape

    @classmethod
    def of(cls, st: StageStrategies) -> Knobs:
        """Broadcast every field but ``inflight`` / ``deferred`` to one shape; float arrays except the index fields."""
        names = [f.name for f in fields(st) if f.name not in ("inflight", "deferred")]
        shape = np.broadcast_shapes(*(np.shape(getattr(st, n)) for n in names))
        a = {n: np.broadcast_to(np.asarray(getattr(st, n)), shape) for n in names}
        f = {n: a[n].astype(np.float64) for n in names}
        group = np.where(a["shard_group"] <= 0, a["dp"], a["shard_group"]).astype(np.float64)
        return cls(b=f["b"], tp=f["tp"], cp=f["cp"], ulysses=a["ulysses"].astype(bool), dp=f["dp"],
                   shard_group=group, zero=a["zero"].astype(np.int64),
                   layers=f["layers"], remat=np.minimum(f["remat"], f["layers"]), policy=a["policy"].astype(np.int64),
                   wo=f["wo"], go=f["go"], oo=f["oo"], ao=f["ao"], inflight=np.asarray(st.inflight),
                   deferred=np.asarray(st.deferred), G=f["G"],
                   stages=f["stages"], first=a["first"].astype(bool), last=a["last"].astype(bool), nodes=f["nodes"],
                   per_node=f["per_node"], chunks=f["chunks"], tp_overlap=a["tp_overlap"].astype(bool))


@dataclass(frozen=True)
class LayerKinds:
    """How many of a stage's layers run as each kind (`mistjax.core.stages`), and what each keeps."""

    n_off: np.ndarray  # leading layers that offload their tagged activations to host
    n_plain: np.ndarray  # layers that keep their activation-dependent residuals
    n_remat: np.ndarray  # trailing checkpointed layers
    saved_plain: np.ndarray  # residual bytes of a plain layer per micro-batch
    saved_remat: np.ndarray  # residual bytes of a checkpointed layer under its policy (0 without any)
    saved_off_host: np.ndarray  # bytes an activation-offloaded layer keeps in host memory per micro-batch
    offload_policy: str  # the analysed policy equal to what activation offload keeps
    stash: np.ndarray | float = 0.0  # bytes the stage's layers' deferred weight-gradient passes read (zero-bubble)


@dataclass(frozen=True)
class StateBytes:
    """Per-device bytes of the model states of a stage (parameters, optimizer state, gradients)."""

    params: np.ndarray  # stored parameters in device memory
    optimizer: np.ndarray  # optimizer state in device memory
    grads: np.ndarray  # gradient buffers (accumulators and one micro-batch's gradients)
    grads_floor: np.ndarray  # the least `grads` over every host / device placement of the layers' accumulators
    host: np.ndarray  # offloaded parameters, optimizer state and gradient accumulators in host memory
    grad_full: np.ndarray  # the stage's whole gradient (one copy, in the gradient dtype)
    grad_shard: np.ndarray  # the stage's gradient as reduce-scattered over the partition group
    param_full: np.ndarray  # the stage's whole parameters (one copy, in their storage dtype)
    host_state: np.ndarray  # offloaded parameters and optimizer state (what the update brings in and out)
    grad_tied: np.ndarray | float = 0.0  # the gradient of the leaves the first and last stage both hold


__all__ = ["Knobs", "LayerKinds", "StateBytes"]
