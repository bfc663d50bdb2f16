"""The execution plan: what each stage of a `Plan` runs, decided once for the runtime, the cost model and
the report.

A `Plan` says what to do (ZeRO level, remat layers, offload ratios); how the code carries it out depends on
the platform (`Capabilities`: may a collective run under the next layer's compute?) and on the model's
parameter leaves (`StageLeaf`: which are stacked layer weights read only by the layer loop). `lower_stage`
combines the three into a `StageExecution`: the layer scans with their unroll, which leaves are fetched per
layer, which gradients are accumulated or synchronised inside the backward layer loop, and whether those
collectives are double-buffered or deferred. The runtime builds its layer loops and gradient sinks from it
(`runtime.grads`, `runtime.mpmd_stage`); the cost model prices the same rules over arrays of strategies
(`scan_unroll`, `scan_bodies`, `rows_synced_in_loop` accept numpy arrays); `report()` prints it.
docs/architecture.md lists where each rule lives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
from numpy.typing import ArrayLike

from mistjax.core.hlo import ASYNC_COLLECTIVE_PLATFORMS
from mistjax.core.layout import PARAM, LeafLayout, select_offload
from mistjax.core.pipeline_order import Op
from mistjax.core.stages import OFFLOAD, SegmentKind, layer_segments

_Flag = TypeVar("_Flag", bool, np.ndarray)


class Capabilities(NamedTuple):
    """What a step's program does with collectives and host copies: a plain value, read from the platform and
    the plan, never from process state.

    Attributes:
      async_collectives: XLA runs collectives and host copies asynchronously, next to compute (GPUs, TPUs);
        XLA:CPU runs them in line. Read from the mesh's devices by the runtime (a deviceless XLA:GPU compile
        runs in a CPU process and must build the GPU's program) and from `DeviceSpec.async_collectives` by
        the cost model.
      collective_matmul: the layer's tensor-parallel all-gathers / reduce-scatters run as rings of chunked
        matmuls and neighbour transfers (`runtime.collective_matmul`), each transfer beside a chunk's GEMM:
        the plan's ``tp_overlap`` (the tuner turns it on where the cost model predicts a gain). The runtime
        traces the rings and the cost model prices their exposed time (`cost.tp_rings`) by this one value
        (`collective_matmul_runs`).
    """

    async_collectives: bool
    collective_matmul: bool = False

    @classmethod
    def of_platform(cls, platform: str, collective_matmul: bool = False) -> Capabilities:
        """The capabilities of a JAX platform name (``"cpu"``, ``"gpu"``, ``"cuda"``, ``"tpu"`` ...) for a plan
        with ``tp_overlap`` = ``collective_matmul``."""
        return cls(platform in ASYNC_COLLECTIVE_PLATFORMS, collective_matmul)

    @property
    def double_buffers_fetches(self) -> bool:
        """Layer loops with per-layer fetches run two layers per iteration (layer i+1's ZeRO-3 gather or host
        copy under layer i's compute). On XLA:CPU the fetch is serial whatever the loop, and the second layer's
        weights and transients only cost memory (ZeRO-3 llama-tiny / -small: 18-20% of the compiled peak)."""
        return self.async_collectives

    @property
    def defers_row_sync(self) -> bool:
        """An in-loop gradient sync issues each layer's collective one backward iteration late, under the next
        layer's backward (`runtime.accumulate.sync_deferred`); in line it would only hold one more row."""
        return self.async_collectives


def collective_matmul_runs(enabled: ArrayLike, cp: ArrayLike) -> np.ndarray:
    """Whether a layer runs its tensor-parallel collectives as collective matmuls; vectorised over plans.

    Where the plan's ``tp_overlap`` (`Capabilities.collective_matmul`) enables them (``enabled``) and the
    sequence is split over ``tensor`` alone (``cp`` = 1): the rings chunk the sequence-split activation over
    ``tensor``, while under context parallelism it is split over ``(context, tensor)``, and its gathers and
    reduce-scatters stay GSPMD's."""
    return np.logical_and(np.asarray(enabled, bool), np.asarray(cp) == 1)


# ---------------------------------------------------------------------------------------------- layer scans
def double_buffered(async_collectives: ArrayLike, fetches_layer_weights: ArrayLike) -> np.ndarray:
    """Whether a stage's layer loops double-buffer their fetches (layer i+1's ZeRO-3 gather or host copy under layer
    i's compute), vectorised: where the platform runs collectives and host copies asynchronously
    (`Capabilities.double_buffers_fetches`) and the stage fetches stacked layer weights. The one rule the runtime
    (`lower_stage`) and the cost model (its buffers and XLA's FLOP count) read."""
    return np.asarray(async_collectives, bool) & np.asarray(fetches_layer_weights, bool)


def scan_unroll(num_layers: ArrayLike, offload: ArrayLike, double_buffer: ArrayLike) -> np.ndarray:
    """Layers per iteration of a segment's scan (1 or 2); vectorised over strategies.

    Two where fetches are double-buffered (`Capabilities.double_buffers_fetches` and the segment fetches), on a
    segment of more than three layers that does not offload activations. A two-layer segment stays a two-trip
    loop (one trip is inlined and XLA merges the backward's re-fetch with the forward's: the fetched weights would
    stay live); a three-layer one runs one layer per iteration (its split would leave such a one-trip loop);
    an offloading segment too (XLA:GPU, jaxlib 0.10.2, fails to compile host-placed residual stacks of an unrolled
    scan: an INTERNAL layout-assignment error).
    """
    n = np.asarray(num_layers)
    return np.where(np.asarray(double_buffer, bool) & ~np.asarray(offload, bool) & (n > 3), 2, 1)


def scan_bodies(num_layers: ArrayLike, offload: ArrayLike, double_buffer: ArrayLike) -> np.ndarray:
    """Layer bodies in a segment's compiled code (XLA's cost analysis counts a loop body once): the unrolled
    pair, plus the last layer's own scan for an odd double-buffered segment (see `layer_scans`)."""
    n = np.asarray(num_layers)
    u = scan_unroll(n, offload, double_buffer)
    return np.where(n <= 0, 0, np.where(u == 2, 2 + np.mod(n, 2), 1))


class LayerScan(NamedTuple):
    """One ``lax.scan`` of a stage's layer loop: layers ``[start, end)`` of one kind, ``unroll`` per iteration."""

    start: int
    end: int
    kind: SegmentKind
    unroll: int

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def layer_scans(num_layers: int, remat_layers: int, offload_layers: int, double_buffer: bool
                ) -> tuple[LayerScan, ...]:
    """A stage's layer loop as scans: its segments (`core.stages.layer_segments`), each with `scan_unroll`.

    An odd double-buffered segment runs its last layer as a scan of its own: ``lax.scan`` with an unroll that
    does not divide the length concatenates the remainder's outputs, residual stacks included, onto the loop's
    (a copy of every stacked residual: 15 GiB per device for a 31-layer Llama-3-8B segment at 16k tokens per
    micro-batch on XLA:GPU).
    """
    out: list[LayerScan] = []
    for start, end, kind in layer_segments(num_layers, remat_layers, offload_layers):
        unroll = int(scan_unroll(end - start, kind == OFFLOAD, double_buffer))
        if unroll == 2 and (end - start) % 2:
            out += [LayerScan(start, end - 1, kind, 2), LayerScan(end - 1, end, kind, 1)]
        else:
            out.append(LayerScan(start, end, kind, unroll))
    return tuple(out)


# ---------------------------------------------------------------------------------------- gradient rows
def rows_synced_in_loop(zero: ArrayLike, dp: ArrayLike, group: ArrayLike, grad_accum: ArrayLike,
                        pipelined: ArrayLike) -> np.ndarray:
    """Whether a stacked layer weight's gradient is synchronised row by row inside the backward layer loop
    (Megatron-LM's ``--overlap-grad-reduce``); vectorised over strategies.

    That is its end-of-step collective taken per layer: the ZeRO-0 all-reduce over ``dp`` devices, or the ZeRO-1
    reduce-scatter over a partition ``group`` of more than one device (ZeRO-2/3 rows are reduce-scattered every
    micro-batch anyway). Only with one micro-batch on a single stage: with G > 1 the last micro-batch would have
    to be peeled out of the scan (12-25% more memory on XLA:CPU, +37% temporaries on XLA:GPU), and a pipeline
    stage syncs in its own ``finish`` program. ``zero`` is the leaf's effective level (0 for a leaf with no dim
    to shard).
    """
    zero = np.asarray(zero)
    live = np.where(zero == 0, np.asarray(dp) > 1, (zero == 1) & (np.asarray(group) > 1))
    return live & (np.asarray(grad_accum) == 1) & ~np.asarray(pipelined, bool)


def host_accumulators(layouts: Sequence[LeafLayout], offload_grads: float) -> list[bool]:
    """Per parameter leaf of a stage: its gradient accumulator lives in host memory (gradient offload).

    Stacked (or one layer's, of an unrolled stack) weights only, chosen by `core.layout.select_offload` for the
    stage's ``offload_grads`` ratio, largest first; the embedding and head keep theirs on the device.
    """
    sizes = [lay.nbytes_elems if lay.stacked or lay.layer_slice else 0 for lay in layouts]
    return [h and n > 0 for h, n in zip(select_offload(sizes, offload_grads), sizes)]


def is_batch_leaf(shape: Sequence[int], global_batch: int) -> bool:
    """Whether a leaf of the loss's other arguments is batch data: its leading dim is the global batch (split
    over the data-parallel axes and into micro-batches); the others are passed whole to every device."""
    return len(shape) > 0 and shape[0] == global_batch


# -------------------------------------------------------------------------------------- the stage plan
class StageLeaf(NamedTuple):
    """One parameter leaf as a stage runs it: its layout, the stage's ZeRO level, what the traced loss says of it.

    Attributes:
      layout: its storage layout (`core.layout.plan_layouts`).
      zero: the ZeRO level of the stage holding it (0-3; a non-parameter leaf's is 0).
      loop_eligible: a stacked weight of a scanned layer stack, read by the layer loop only, of a float dtype:
        its gradient can be handled row by row inside the backward layer loop.
      in_stack: the layer loop scans it (a stacked layer weight, or one layer's leaf of an unrolled stack).
      host_accumulator: its gradient accumulator is kept in host memory (gradient offload).
    """

    layout: LeafLayout
    zero: int
    loop_eligible: bool = False
    in_stack: bool = False
    host_accumulator: bool = False

    @property
    def effective_zero(self) -> int:
        """The ZeRO level its gradient is reduced at: 0 for a leaf with no dim to shard."""
        return self.zero if self.layout.shard_dim is not None else 0

    @property
    def weights_sharded(self) -> bool:
        """ZeRO-3: a parameter stored sharded over its partition group (all-gathered per use)."""
        return self.layout.sharded and self.layout.role == PARAM

    @property
    def fetched(self) -> bool:
        """Its stored copy is not its compute copy: ZeRO-3-sharded (all-gathered per use) or host-resident
        (copied in per use)."""
        return self.layout.host or self.weights_sharded

    @property
    def scatter_each_microbatch(self) -> bool:
        """ZeRO-2 without ZeRO-3: each micro-batch's gradient is reduce-scattered (ZeRO-3's via autodiff)."""
        return self.zero == 2 and self.layout.shard_dim is not None

    @property
    def out_sharded(self) -> bool:
        """ZeRO >= 1: the step's gradient comes out split over the partition group."""
        return self.zero >= 1 and self.layout.shard_dim is not None


@dataclass(frozen=True)
class StageExecution:
    """How one stage runs (see module docstring); indices are positions in the stage's parameter leaves.

    Attributes:
      scans: the layer loop's scans, in layer order.
      fetched: leaves fetched per use (`StageLeaf.fetched`).
      in_loop: leaves whose gradient the backward layer loop adds into its accumulator (several micro-batches
        or a pipeline stage) or synchronises (`synced`).
      synced: leaves whose gradient rows the backward layer loop synchronises (`rows_synced_in_loop`).
      host_accumulators: leaves whose gradient accumulator lives in host memory.
      double_buffer: fetching scans run `scan_unroll` layers per iteration.
      defer_sync: the synced rows' collectives run one backward iteration late.
    """

    scans: tuple[LayerScan, ...]
    fetched: frozenset[int]
    in_loop: frozenset[int]
    synced: frozenset[int]
    host_accumulators: frozenset[int]
    double_buffer: bool
    defer_sync: bool

    def describe(self) -> list[str]:
        """One line per decision, for `report()` (layers numbered within the stage)."""
        scans = ", ".join(f"{s.kind} {s.start}-{s.end - 1}" + (" (2 per iteration)" if s.unroll == 2 else "")
                          for s in self.scans) or "none"
        return [f"layer scans (stage-local layers): {scans}",
                f"fetched per layer use: {_leaves(self.fetched)}"
                + (" (double-buffered)" if self.double_buffer and self.fetched else ""),
                f"gradients added inside the backward layer loop: {_leaves(self.in_loop)}",
                f"gradients synchronised per layer in the backward: {_leaves(self.synced)}"
                + (" (one layer late, under the next layer's backward)" if self.synced and self.defer_sync else ""),
                f"gradient accumulators on host: {_leaves(self.host_accumulators)}"]


def _leaves(indices: frozenset[int]) -> str:
    return f"{len(indices)} leaf" if len(indices) == 1 else f"{len(indices)} leaves"


@dataclass(frozen=True)
class ExecutionPlan:
    """How a whole plan runs: each (virtual) stage's `StageExecution`, the platform, the batch leaves, and for a
    pipeline the host's issue order of its stage programs (`core.pipeline_order.issue_order`, which the cost
    model's `predict` prices too).

    Attributes:
      stages: per (virtual) stage, in chunk order.
      capabilities: the platform's.
      batch_mask: per argument leaf of the loss besides the parameters: batch data (`is_batch_leaf`).
      issue: the pipeline's operations in host issue order (empty for one stage).
    """

    stages: tuple[StageExecution, ...]
    capabilities: Capabilities
    batch_mask: tuple[bool, ...]
    issue: tuple[Op, ...] = ()

    def describe(self) -> list[str]:
        """One line per stage decision, then the pipeline's order, for reports."""
        caps = self.capabilities
        lines = [f"platform: collectives {'asynchronous' if caps.async_collectives else 'in line'}"
                 f"{', TP collective matmuls' if caps.collective_matmul else ''}; "
                 f"{sum(self.batch_mask)} of {len(self.batch_mask)} loss arguments are batch data"]
        for k, st in enumerate(self.stages):
            lines += [f"stage {k}: {line}" for line in st.describe()]
        if self.issue:
            head = " ".join(f"{op.kind}{op.stage}.{op.mb}" for op in self.issue[:8])
            more = " ..." if len(self.issue) > 8 else ""
            lines.append(f"issue order: {len(self.issue)} stage programs ({head}{more})")
        return lines


def lower_stage(leaves: Sequence[StageLeaf], *, num_layers: int, remat_layers: int, offload_layers: int,
                grad_accum: int, dp: int, group: int, pipelined: bool, caps: Capabilities) -> StageExecution:
    """The `StageExecution` of one stage.

    Args:
      leaves: the stage's parameter leaves.
      num_layers, remat_layers, offload_layers: the stage's layers, the checkpointed ones, those that offload
        their activations (`core.stages.layer_segments` orders them).
      grad_accum: micro-batches per step (G).
      dp: data-parallel devices of the stage; group: devices of its ZeRO / MiCS partition group.
      pipelined: the stage is one of several (the MPMD executor's).
      caps: the platform's `Capabilities`.
    """
    fetched = frozenset(i for i, f in enumerate(leaves) if f.fetched)
    double_buffer = bool(double_buffered(caps.double_buffers_fetches, any(f.fetched and f.in_stack for f in leaves)))
    eligible = [i for i, f in enumerate(leaves) if f.loop_eligible and not f.host_accumulator]
    synced = frozenset(i for i in eligible
                       if rows_synced_in_loop(leaves[i].effective_zero, dp, group, grad_accum, pipelined))
    accumulates = grad_accum > 1 or pipelined
    in_loop = frozenset(eligible) if accumulates else synced
    return StageExecution(
        scans=layer_scans(num_layers, remat_layers, offload_layers, double_buffer), fetched=fetched,
        in_loop=in_loop, synced=synced,
        host_accumulators=frozenset(i for i, f in enumerate(leaves) if f.host_accumulator),
        double_buffer=double_buffer, defer_sync=bool(synced) and caps.defers_row_sync)


__all__ = ["Capabilities", "ExecutionPlan", "LayerScan", "StageExecution", "StageLeaf",
           "double_buffered", "host_accumulators", "is_batch_leaf",
           "layer_scans",
           "lower_stage", "rows_synced_in_loop", "scan_bodies", "scan_unroll"]
