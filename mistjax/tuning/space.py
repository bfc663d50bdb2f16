"""The search space: Mist's knobs plus MiCS partition groups and named remat policies.

A `SearchSpace` is a frozen description of which values each knob may take; every dimension can be
switched off, which is how the baselines (Megatron-LM, ZeRO-3/FSDP, MiCS, Mist's own space) and the
ablation steps are expressed on the same tuner and cost model. The helpers below turn a space into
the concrete candidates of one outer key (TP degree, stage count, micro-batch size): the stage mesh,
the per-stage strategy grid (ZeRO level, MiCS group, offload ratios) and the remat options
(checkpointed-layer count, policy), all as flat NumPy arrays so the intra-stage tuner can evaluate
them in one vectorised call.

Values follow the Mist artifact (digest section 2): micro-batch {1, 2, 4}; TP {1, 2, 4, 8} up to
a node; ZeRO-1 always on, ZeRO-2/3 optional when dp > 1; weight / grad offload
{0, .25, .375, .5, .75, 1} without (wo > 0, go = 0) pairs; optimizer / activation offload in
eighths {0, .25, .375, ..., 1}; checkpointed layers 0..l; layers per stage round(L/S) +- 2.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from mistjax.core.context import CONTEXT_FORMS
from mistjax.core.plan import Plan, StagePlan
from mistjax.core.schedules import SCHEDULE_NAMES, V_SHAPED, ZERO_BUBBLE

__all__ = [
    "MIST_OFFLOAD",
    "MIST_OPT_OFFLOAD",
    "MIST_SPARSE_OFFLOAD",
    "OuterKey",
    "RematOptions",
    "SearchSpace",
    "StrategyGrid",
    "key_layer_options",
    "outer_keys",
    "remat_options",
    "schedule_variants",
    "shard_groups",
    "space_admits",
    "stage_mesh",
    "strategy_grid",
]

MIST_SPARSE_OFFLOAD = (0.0, 0.25, 0.375, 0.5, 0.75, 1.0)  # weights and grads (SPARSE_OFFLOADING_RATIO_CANDIDATES)
MIST_OFFLOAD = (0.0, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)  # optimizer state and activations
# Optimizer state: Mist's candidates and 0.125, which two of the artifact's tuned L4 GPT-3 7B plans use (the shared
# published runs; `space_admits` holds each measured run's plan to its own system's space).
MIST_OPT_OFFLOAD = (0.0, 0.125, *MIST_OFFLOAD[1:])
REMAT_MODES = ("tune", "all", "all_or_none", "none")


@dataclass(frozen=True)
class SearchSpace:
    """Which values each tuning knob may take. The default is mistjax's full space.

    Attributes:
        name: label used in reports.
        micro_batches: per-device micro-batch sizes b.
        tp_degrees: tensor-parallel degrees (capped at the devices of one node; must divide the heads).
        cp_degrees: context-parallel degrees (each sequence split over cp devices, on one stage or in every stage
            of a pipeline, with any TP degree; the sequence must split into 2 cp chunks, and each part tp ways).
        cp_forms: context-parallel attention forms tried for each cp > 1 (`core.context.ContextForm`): ``ring``
            (key / value shards passed around) and ``ulysses`` (all-to-all to a head split, where the heads
            split cp x tp ways).
        min_context_tokens: the fewest tokens of a sequence a device holds under context parallelism (cp > 1 is
            tried only where seq / cp is at least this): a bound on the space, as the degrees are. Below a
            thousand tokens a device's attention is a few key blocks, little work to hide its exchange behind,
            and every such key costs its bound: at 2,048 tokens on 3,072 GPUs, 4,200 pipelined CP keys, 12 s.
        pipeline: allow more than one pipeline stage.
        max_grad_accum: largest number of micro-batches per step (None: any; 1 for a step that
            computes gradients with plain ``jax.grad``, which the runtime cannot split).
        max_stages: largest stage count (None: up to the layer count).
        zero_levels: ZeRO levels tried when dp > 1 (1: optimizer state, 2: + gradients, 3: + weights).
            With dp == 1 there is nothing to shard and level 1 is used.
        mics: also try MiCS partition groups smaller than dp (powers of two with group x tp inside a
            node or on whole nodes: `shard_groups`); False shards over the whole data-parallel group (plain ZeRO).
        remat: ``tune`` (checkpoint any 0..l layers per stage), ``all`` (every layer, Megatron's full
            uniform recompute), ``all_or_none`` or ``none``.
        policies: remat policies to try (None: every policy the workload's profile knows except
            ``none``; ``("full",)`` is Mist's full-layer recompute).
        weight_offload / grad_offload / opt_offload / act_offload: offload ratios; ``(0.0,)`` turns a
            dimension off.
        weight_needs_grad_offload: Mist's rule dropping (wo > 0, go = 0) pairs.
        uniform_layers: every stage gets L/S layers (Megatron; S must divide L), and interleaving splits them
            into equal chunks only.
        layer_window: per-stage layer counts searched around round(L/S) (Mist: 2).
        pareto_k: Pareto points sampled per stage key for the MILP (Mist: 30; 1 = imbalance-unaware).
        schedules: pipeline schedules tried for S > 1. On the asynchronous MPMD executor classic 1F1B
            runs at the ideal pace and bounds the micro-batches in flight, so it is the default; GPipe and
            ``1f1b-eager`` run as fast and keep more (`mistjax.core.schedules`).
        zero_bubble: also search every pipelined key under ZB-H1 (each backward split into input- and
            weight-gradient programs, the latter deferred into the bubbles; the deferred passes' stash is more
            activation memory).
        interleave: chunks per device group searched as interleaved 1F1B keys (virtual stages: the bubble shrinks
            by the chunk count, each group holds more micro-batches' residuals and sends ``chunks`` times the
            activations) beside each 1F1B key whose micro-batches are a multiple of its stages; ``()`` turns it
            off. Every key of every schedule is searched or pruned by its bound, so a space with these contains
            the space without (`schedule_variants`).
        tp_overlap: the winner's tensor-parallel collectives may run as collective matmuls (`Plan.tp_overlap`),
            where collectives run asynchronously and the full prediction is faster (priced on the winner, not
            searched per key).
    """

    name: str = "mistjax"
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    tp_degrees: tuple[int, ...] = (1, 2, 4, 8)
    cp_degrees: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    cp_forms: tuple[str, ...] = CONTEXT_FORMS
    min_context_tokens: int = 1024
    pipeline: bool = True
    max_grad_accum: int | None = None
    max_stages: int | None = None
    zero_levels: tuple[int, ...] = (1, 2, 3)
    mics: bool = True
    remat: str = "tune"
    policies: tuple[str, ...] | None = None
    weight_offload: tuple[float, ...] = MIST_SPARSE_OFFLOAD
    grad_offload: tuple[float, ...] = MIST_SPARSE_OFFLOAD
    opt_offload: tuple[float, ...] = MIST_OPT_OFFLOAD
    act_offload: tuple[float, ...] = MIST_OFFLOAD
    weight_needs_grad_offload: bool = True
    uniform_layers: bool = False
    layer_window: int = 2
    pareto_k: int = 30
    schedules: tuple[str, ...] = ("1f1b",)
    zero_bubble: bool = True
    interleave: tuple[int, ...] = (2, 4)
    tp_overlap: bool = True

    def __post_init__(self) -> None:
        if self.remat not in REMAT_MODES:
            raise ValueError(f"SearchSpace.remat={self.remat!r}: use one of {REMAT_MODES}")
        for name in ("micro_batches", "tp_degrees", "cp_degrees"):
            vals = getattr(self, name)
            if not vals or any(int(v) != v or v < 1 for v in vals):
                raise ValueError(f"SearchSpace.{name}={vals!r}: need a non-empty tuple of positive integers")
        if isinstance(self.min_context_tokens, bool) or not isinstance(self.min_context_tokens, int) \
                or self.min_context_tokens < 1:
            raise ValueError(f"SearchSpace.min_context_tokens={self.min_context_tokens!r}: need a positive integer "
                             "(tokens of a sequence per device under context parallelism; 1 allows every cp)")
        if not self.cp_forms or any(f not in CONTEXT_FORMS for f in self.cp_forms):
            raise ValueError(f"SearchSpace.cp_forms={self.cp_forms!r}: need a non-empty tuple of {CONTEXT_FORMS}")
        if not self.zero_levels:
            raise ValueError("SearchSpace.zero_levels=(): need a non-empty tuple of ZeRO levels 0..3")
        if self.policies is not None and not self.policies:
            raise ValueError("SearchSpace.policies=(): name at least one remat policy, or None for every policy "
                             "the model offers (remat='none' turns checkpointing off)")
        if any(z not in (0, 1, 2, 3) for z in self.zero_levels):
            raise ValueError(f"SearchSpace.zero_levels={self.zero_levels!r}: ZeRO levels are 0..3")
        for name in ("weight_offload", "grad_offload", "opt_offload", "act_offload"):
            vals = getattr(self, name)
            if not vals or any(not 0.0 <= v <= 1.0 for v in vals):
                raise ValueError(f"SearchSpace.{name}={vals!r}: need a non-empty tuple of ratios in [0, 1]")
        searched = tuple(x for x in SCHEDULE_NAMES if x not in ZERO_BUBBLE)
        bad = [x for x in self.schedules if x not in searched]
        if not self.schedules or bad:
            hint = (" (zero-bubble keys are switched on by SearchSpace.zero_bubble=True)" if set(bad) & ZERO_BUBBLE
                    else "")
            raise ValueError(f"SearchSpace.schedules={self.schedules!r}: use a non-empty tuple of {searched}{hint}")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 2 for v in self.interleave):
            raise ValueError(f"SearchSpace.interleave={self.interleave!r}: chunks per device group are integers >= 2 "
                             "(() turns interleaving off)")
        if self.pareto_k < 1 or self.layer_window < 0:
            raise ValueError("SearchSpace: pareto_k must be >= 1 and layer_window >= 0")

    def replace(self, **changes: Any) -> SearchSpace:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---------------------------------------------------------------- named spaces
    @classmethod
    def full(cls) -> SearchSpace:
        """mistjax: Mist's space + MiCS partition groups + named remat policies."""
        return cls()

    @classmethod
    def mist(cls) -> SearchSpace:
        """Mist's own space, without our additions (no MiCS groups, full-layer recompute only)."""
        return cls(name="mist", cp_degrees=(1,), mics=False, policies=("full",), schedules=("1f1b",),
                   zero_bubble=False, interleave=(), tp_overlap=False)

    @classmethod
    def megatron(cls) -> SearchSpace:
        """Megatron-LM: pp any divisor of the layers (`uniform_layers`, as Megatron-LM requires without its
        uneven first / last stage option), dp whatever the devices leave, b in {1,2,4,8} (the artifact's best
        Megatron-LM configs at 1.3B run b 8), full recompute,
        distributed optimizer (the published runs: 530B tp 8, pp 35, dp 8; 1T tp 8, pp 64, dp 6; arXiv
        2104.04473 Table 1), and its interleaved 1F1B (``--num-layers-per-virtual-pipeline-stage``: 2 or 4
        equal chunks per stage)."""
        return cls(name="megatron", cp_degrees=(1,), zero_levels=(1,), mics=False, remat="all",
                   policies=("full",), weight_offload=(0.0,), grad_offload=(0.0,), opt_offload=(0.0,),
                   act_offload=(0.0,), uniform_layers=True, pareto_k=1, schedules=("1f1b",), zero_bubble=False,
                   tp_overlap=False)

    @classmethod
    def fsdp(cls) -> SearchSpace:
        """ZeRO-3 / FSDP over all devices with (or without) full activation checkpointing."""
        return cls(name="zero3-fsdp", tp_degrees=(1,), cp_degrees=(1,), pipeline=False, zero_levels=(3,), mics=False,
                   remat="all_or_none", policies=("full",), weight_offload=(0.0,), grad_offload=(0.0,),
                   opt_offload=(0.0,), act_offload=(0.0,), pareto_k=1)

    @classmethod
    def mics_only(cls) -> SearchSpace:
        """MiCS alone: ZeRO-3 within partition groups, replicated across them, with or without remat."""
        return cls.fsdp().replace(name="mics", mics=True)


@dataclass(frozen=True)
class OuterKey:
    """One outer-loop point: the values shared by every stage."""

    tp: int
    stages: int
    micro_batch: int
    dp: int
    grad_accum: int
    nodes: int  # nodes of one stage's mesh
    per_node: int  # devices of one stage on each of its nodes
    schedule: str = "1f1b"  # pipeline schedule (`core.schedules.SCHEDULE_NAMES`); "1f1b" when S == 1
    cp: int = 1  # context-parallel degree (every stage's)
    cp_form: str = "ring"  # how the context-parallel attention communicates (`core.context.CONTEXT_FORMS`)
    chunks: int = 1  # layer chunks per device group (interleaved 1F1B: `stages` counts device groups)
    tp_overlap: bool = False  # TP collectives as collective matmuls (`Plan.tp_overlap`)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def stage_mesh(num_devices: int, stages: int, nodes: int, per_node: int) -> tuple[int, int] | None:
    """Mist's uniform stage mesh: (1, m) with m a power of two <= a node, or (n, per_node) whole nodes."""
    if num_devices % stages:
        return None
    k = num_devices // stages
    if k <= per_node:
        return (1, k) if _pow2(k) or k == per_node else None
    if k % per_node or (k // per_node) > nodes:
        return None
    return (k // per_node, per_node)


def _cp_fits(cp: int, tp: int, per_node: int) -> bool:
    """A CP x TP group is part of a node or whole nodes (`runtime.mesh.build_plan_mesh`)."""
    ring = cp * tp
    return per_node % ring == 0 if ring <= per_node else ring % per_node == 0


def outer_keys(space: SearchSpace, num_layers: int, global_batch: int, nodes: int, per_node: int,
               supports_tp: Callable[[int], bool] = lambda tp: tp == 1,
               context_forms: Callable[[int, int], tuple[str, ...]] = lambda cp, tp: ("ring",) if cp == 1 else (),
               async_collectives: bool = False) -> list[OuterKey]:
    """Every (tp, cp, stages, micro-batch) point of the space on ``nodes x per_node`` devices.

    ``supports_tp(t)`` says whether the model splits ``t`` ways (`WorkloadLike.supports_tp`), ``context_forms(c, t)``
    which context-parallel forms split its sequence ``c`` ways with TP ``t`` (`WorkloadLike.context_forms`; each
    in ``space.cp_forms`` is a key), with any stage count and TP degree. With ``space.tp_overlap`` on a cluster
    whose collectives run asynchronously (``async_collectives``), every key with TP and no CP prices its TP
    collectives as collective matmuls (`Plan.tp_overlap`), so its bound and its plans are those of the overlapped
    layers (`tuner._overlap_or_not` checks the winner without them).

    Ordered by stage count first (one stage is evaluated without a MILP and gives an early incumbent
    for pruning), then TP, then micro-batch size.
    """
    num_devices = nodes * per_node
    max_s = num_layers if space.max_stages is None else min(space.max_stages, num_layers)
    if not space.pipeline:
        max_s = 1
    keys = []
    for S in range(1, max_s + 1):
        if space.uniform_layers and num_layers % S:
            continue
        mesh = stage_mesh(num_devices, S, nodes, per_node)
        if mesh is None:
            continue
        for tp in sorted(set(space.tp_degrees)):
            if tp > per_node or (num_devices // S) % tp or not supports_tp(tp):
                continue
            for cp in sorted(set(space.cp_degrees)):
                forms = [f for f in context_forms(cp, tp) if cp == 1 or f in space.cp_forms]
                if (num_devices // S) % (tp * cp) or not forms or (cp > 1 and not _cp_fits(cp, tp, per_node)):
                    continue
                dp = num_devices // S // tp // cp
                overlap = space.tp_overlap and async_collectives and tp > 1 and cp == 1
                for b in sorted(set(space.micro_batches)):
                    if global_batch % (b * dp):
                        continue
                    if space.max_grad_accum is not None and global_batch // (b * dp) > space.max_grad_accum:
                        continue
                    G = global_batch // (b * dp)
                    # Forms outer: a form's schedule siblings one after another share their prices (`ScheduleMemo`).
                    for form, (schedule, chunks) in itertools.product(forms,
                                                                      schedule_variants(space, num_layers, S, G)):
                        keys.append(OuterKey(tp, S, b, dp, G, *mesh, schedule=schedule, cp=cp, cp_form=form,
                                             chunks=chunks, tp_overlap=overlap))
    return keys


def schedule_variants(space: SearchSpace, num_layers: int, stages: int, grad_accum: int
                      ) -> list[tuple[str, int]]:
    """The (pipeline schedule, chunks per device group) pairs of one (stages, micro-batches) point: the space's
    ``schedules``; ZB-H1 and ZB-V (``zero_bubble``; ZB-V with two chunks per group); interleaved 1F1B with each of
    ``interleave``'s chunk counts that the point can run (micro-batches a multiple of the stages, every chunk a
    layer at least, equal chunks where the space's stages are uniform); ``("1f1b", 1)`` alone for one stage."""
    if stages == 1:
        return [("1f1b", 1)]
    out = [(schedule, 1) for schedule in space.schedules]
    most = max(layer_options(space, num_layers, stages, grad_accum))
    if space.zero_bubble:
        out += [(schedule, 1) for schedule in sorted(ZERO_BUBBLE - V_SHAPED)]
        out += [(schedule, 2) for schedule in sorted(V_SHAPED) if _chunks_fit(space, num_layers, stages, most, 2)]
    if "1f1b" in space.schedules and grad_accum % stages == 0:
        out += [("1f1b", v) for v in sorted(set(space.interleave)) if _chunks_fit(space, num_layers, stages, most, v)]
    return out


def _chunks_fit(space: SearchSpace, num_layers: int, stages: int, most: int, chunks: int) -> bool:
    """Whether ``stages`` device groups of at most ``most`` layers each can run ``chunks`` chunks of a layer at
    least (equal chunks where the space's stages are uniform)."""
    return (num_layers >= stages * chunks and most >= chunks
            and (not space.uniform_layers or (num_layers // stages) % chunks == 0))


def key_layer_options(space: SearchSpace, num_layers: int, key: OuterKey) -> tuple[int, ...]:
    """`layer_options` of ``key``'s device groups: those that give each of its chunks a layer at least."""
    opts = layer_options(space, num_layers, key.stages, key.grad_accum)
    return tuple(n for n in opts if n >= key.chunks)


def shard_groups(dp: int, tp: int, per_node: int, mics: bool, cross_node: bool = True) -> tuple[int, ...]:
    """MiCS partition-group sizes p for a stage: dp itself, plus (with ``mics``) every power of two that
    divides dp and keeps a group's p x tp devices inside one node (intra-node sharding collectives) or, with
    ``cross_node``, on whole nodes (a group spanning nodes gathers hierarchically, MiCS section 3: the scale-aware
    partition of a model whose states do not fit a node's memory, BloombergGPT's 128 of 512 GPUs).

    `strategy_grid` asks for whole-node groups under ZeRO-3 only: there the group sets the per-micro-batch
    gathers' scale and the weights' memory; under ZeRO-1/2 a group between one node and dp changes the optimizer
    state's memory and a once-per-step gather, and searching it doubled the families of a large-dp key (the
    runtime runs them all: tests/test_mics.py)."""
    groups = {dp}
    if mics:
        groups.update(p for p in (2**i for i in range(1, dp.bit_length()))
                      if dp % p == 0 and (p * tp <= per_node or (cross_node and p * tp % per_node == 0)))
    return tuple(sorted(groups))


@dataclass(frozen=True)
class StrategyGrid:
    """Flat arrays (length X) of the per-stage strategies of one outer key."""

    zero: np.ndarray
    shard_group: np.ndarray
    family: np.ndarray  # index of the (zero, shard_group) pair; strategies are family-major
    wo: np.ndarray
    go: np.ndarray
    oo: np.ndarray
    ao: np.ndarray

    def __len__(self) -> int:
        return int(self.zero.size)

    def take(self, index: slice | npt.ArrayLike) -> StrategyGrid:
        """The strategies at ``index`` (a numpy index: positions, a boolean mask or a slice)."""
        return StrategyGrid(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))


def strategy_grid(space: SearchSpace, dp: int, tp: int, per_node: int, pipelined: bool) -> StrategyGrid:
    """The ZeRO x MiCS x offload grid of one stage (every stage of a pipeline chooses its own)."""
    zero_groups = []
    for z in sorted(set(space.zero_levels)) if dp > 1 else [1]:
        for p in shard_groups(dp, tp, per_node, space.mics, cross_node=z >= 3) if z > 0 and dp > 1 else [dp]:
            zero_groups.append((z, p))
    go_vals = tuple(sorted(set(space.grad_offload)))
    ao_vals = tuple(sorted(set(space.act_offload)))
    wo_vals = tuple(sorted(set(space.weight_offload)))
    oo_vals = tuple(sorted(set(space.opt_offload)))
    wo, go = (a.ravel() for a in np.meshgrid(wo_vals, go_vals, indexing="ij"))
    if space.weight_needs_grad_offload:
        keep = ~((wo > 0) & (go == 0))
        wo, go = wo[keep], go[keep]
    zg = np.asarray(zero_groups, dtype=np.int64)
    # Cartesian product of (zero, group) x (wo, go) x oo x ao as flat index arrays.
    i_zg, i_wg, i_o, i_a = (a.ravel() for a in np.meshgrid(np.arange(len(zg)), np.arange(wo.size),
                                                            np.arange(len(oo_vals)), np.arange(len(ao_vals)),
                                                            indexing="ij"))
    return StrategyGrid(zg[i_zg, 0], zg[i_zg, 1], i_zg, wo[i_wg], go[i_wg], np.asarray(oo_vals)[i_o],
                        np.asarray(ao_vals)[i_a])


@dataclass(frozen=True)
class RematOptions:
    """Flat arrays (length R) of (checkpointed layers c, policy index) pairs, c = 0 listed once."""

    count: np.ndarray  # c
    policy: np.ndarray  # index into the workload's policy names
    names: tuple[str, ...]  # the workload's policy names


def space_policies(space: SearchSpace, workload_policies: tuple[str, ...]) -> list[int]:
    """Indices (into the workload's policies) of the remat policies the space tries."""
    names = list(workload_policies)
    wanted = [p for p in names if p != "none"] if space.policies is None else list(space.policies)
    missing = [p for p in wanted if p not in names]
    if missing:
        raise ValueError(f"remat policies {missing} are not in the workload's profile {names}")
    return [names.index(p) for p in wanted]


def remat_options(space: SearchSpace, max_layers: int, workload_policies: tuple[str, ...]) -> RematOptions:
    """All (c, policy) options for stages of up to ``max_layers`` layers; c <= l is checked later.

    With ``remat="all"`` the option c = max_layers stands for "every layer of the stage" and is
    mapped to each stage's own layer count by the intra-stage tuner (``count == -1`` marks it).
    """
    pols = space_policies(space, tuple(workload_policies)) if space.remat != "none" else []
    if space.remat == "tune":
        counts = [0] + [c for c in range(1, max_layers + 1) for _ in pols]
        policy = [pols[0]] + [p for _ in range(1, max_layers + 1) for p in pols]
    elif space.remat == "all":
        counts, policy = [-1] * len(pols), pols
    elif space.remat == "all_or_none":
        counts, policy = [0] + [-1] * len(pols), [pols[0], *pols]
    else:  # none
        counts, policy = [0], [pols[0] if pols else 0]
    return RematOptions(np.asarray(counts, np.int64), np.asarray(policy, np.int64), tuple(workload_policies))


def layer_options(space: SearchSpace, num_layers: int, stages: int, grad_accum: int) -> tuple[int, ...]:
    """Per-stage layer counts searched (Mist's window; exactly L/S for uniform spaces)."""
    if stages == 1:
        return (num_layers,)
    if space.uniform_layers:
        return (num_layers // stages,)
    mid = math.floor(num_layers / stages + 0.5)
    if grad_accum == 1:
        lo = hi = mid
    else:
        lo, hi = max(1, mid - space.layer_window), min(mid + space.layer_window, num_layers - stages + 1)
    opts = tuple(range(lo, hi + 1))
    # round(L/S) alone cannot always add up to L (e.g. L=4, S=3); widen to what can.
    if stages * max(opts) < num_layers or stages * min(opts) > num_layers:
        opts = tuple(range(max(1, num_layers // stages), -(-num_layers // stages) + 1))
    return opts


def space_admits(space: SearchSpace, plan: Plan, num_layers: int, nodes: int, per_node: int) -> list[str]:
    """Why ``space`` does not contain ``plan`` on ``nodes x per_node`` devices (empty: it does): its outer key is
    one of `outer_keys` (assuming the model splits any TP and CP way), each stage's layer count one of
    `layer_options`, and its ZeRO level, partition group, remat count and policy and offload ratios are values the
    space searches. A published run's plan in its own system's space is what makes that baseline honest."""
    why: list[str] = []
    batch = plan.micro_batch * plan.dp * plan.grad_accum
    groups = plan.device_stages
    key = (plan.tp, groups, plan.micro_batch, plan.dp, plan.grad_accum, plan.schedule, plan.cp, plan.virtual_stages)
    if plan.tp_overlap and not space.tp_overlap:
        why.append("tp_overlap: the space runs TP collectives serially")
    keys = {(k.tp, k.stages, k.micro_batch, k.dp, k.grad_accum, k.schedule, k.cp, k.chunks)
            for k in outer_keys(space, num_layers, batch, nodes, per_node, lambda tp: True,
                                lambda cp, tp: tuple(space.cp_forms) if cp > 1 else ("ring",))}
    if key not in keys:
        why.append(f"outer key (tp {plan.tp}, {groups} stages, micro-batch {plan.micro_batch}, dp {plan.dp}, "
                   f"G {plan.grad_accum}, {plan.schedule}, cp {plan.cp}, {plan.virtual_stages} chunks) is not one "
                   "of the space's")
    options = layer_options(space, num_layers, plan.num_stages, plan.grad_accum)
    zero_levels = set(space.zero_levels) if plan.dp > 1 else {1}
    z3 = any(st.zero_stage >= 3 for st in plan.stages)
    if plan.shard_group not in shard_groups(plan.dp, plan.tp, per_node, space.mics, cross_node=z3):
        why.append(f"partition group {plan.shard_group} is not one the space searches")
    for i, st in enumerate(plan.stages):
        why += [f"stage {i}: {w}" for w in _stage_outside(space, st, options, zero_levels)]
    return why


def _stage_outside(space: SearchSpace, st: StagePlan, options: tuple[int, ...], zero_levels: set[int]) -> list[str]:
    """Why one stage's knobs are not values ``space`` searches (empty: they are)."""
    why = []
    if st.num_layers not in options:
        why.append(f"{st.num_layers} layers (the space tries {options})")
    if st.zero_stage not in zero_levels:
        why.append(f"ZeRO-{st.zero_stage} (the space tries {sorted(zero_levels)})")
    remat_ok = {"tune": True, "all": st.remat_layers == st.num_layers, "none": st.remat_layers == 0,
                "all_or_none": st.remat_layers in (0, st.num_layers)}[space.remat]
    if not remat_ok:
        why.append(f"remat_layers {st.remat_layers} of {st.num_layers} (remat mode {space.remat!r})")
    if st.remat_layers and space.policies is not None and st.remat_policy not in space.policies:
        why.append(f"remat policy {st.remat_policy!r} (the space tries {space.policies})")
    for field, ratios in (("offload_weights", space.weight_offload), ("offload_grads", space.grad_offload),
                          ("offload_opt", space.opt_offload), ("offload_acts", space.act_offload)):
        if not any(math.isclose(getattr(st, field), r) for r in ratios):
            why.append(f"{field} {getattr(st, field):g} (the space tries {ratios})")
    return why
