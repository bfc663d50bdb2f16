"""Mixture-of-Experts math shared by the zoo's MoE block and the expert-parallel runtime (issue #51).

The zoo (`models.moe`) routes tokens and calls `apply_experts`; the runtime (`mistjax.runtime.experts`) swaps in
an expert-parallel dispatcher for the same call through `experts_dispatch`, so the model never imports the
runtime (the layer rules of docs/architecture.md) and both run the one definition of routing, capacity and
dropping written here.

Dropping is defined per sequence (GShard's groups, one group per sequence): each expert takes at most
``capacity`` tokens of every sequence, the first choices of all tokens before any second choice, earlier
tokens first within a choice rank. A data-parallel split of the batch therefore drops exactly the tokens a
single device drops, whatever the number of ranks (docs/moe.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr

from mistjax.core.jaxpr import iter_eqns


class Scoring(enum.Enum):
    """How router logits become expert scores."""

    SOFTMAX = "softmax"  # Mixtral, Qwen-MoE, gpt-oss (softmax over the top-k = normalised top-k of softmax)
    SIGMOID = "sigmoid"  # DeepSeek-V3


class RouterSpec(NamedTuple):
    """The static hyper-parameters of one MoE layer's routing and dispatch.

    Attributes:
        num_experts: routed experts E.
        top_k: experts each token picks.
        scoring: softmax or sigmoid scores.
        normalize: renormalise the top-k scores to sum to 1 (``norm_topk_prob``).
        scale: multiplies the combine weights (DeepSeek-V3's ``routed_scaling_factor``).
        capacity_factor: None for dropless; else slots per expert per sequence are
            ``ceil(seq * top_k * capacity_factor / num_experts)`` (`capacity`).
        num_groups: group-limited routing (DeepSeek-V3's ``n_group``): the experts form this many equal groups ...
        top_groups: ... and each token chooses among the experts of its ``top_groups`` best groups only, a group
            scored by the sum of its two best (biased) scores (``topk_group``). 1 / 1: no grouping.
        swiglu_limit: None for SwiGLU; else gpt-oss's clamped form (`glu`).
    """

    num_experts: int
    top_k: int
    scoring: Scoring = Scoring.SOFTMAX
    normalize: bool = True
    scale: float = 1.0
    capacity_factor: float | None = None
    num_groups: int = 1
    top_groups: int = 1
    swiglu_limit: float | None = None


class Routing(NamedTuple):
    """One MoE layer's routing of ``N`` tokens (any leading shape ``[..., k]``)."""

    experts: jax.Array  # int32 [..., k]: chosen experts, best first
    weights: jax.Array  # float32 [..., k]: combine weights (scores of the chosen experts, normalised, scaled)
    probs: jax.Array  # float32 [..., E]: per-token score distribution the balancing loss reads


class ExpertWeights(NamedTuple):
    """SwiGLU experts stacked on a leading expert axis."""

    gate: jax.Array  # [E, h, f]
    up: jax.Array  # [E, h, f]
    down: jax.Array  # [E, f, h]


class LoadStats(NamedTuple):
    """Sums over tokens that the balancing loss and the bias update need (sum them over data shards)."""

    counts: jax.Array  # float32 [E]: routed (token, choice) pairs per expert, before any dropping
    prob_sums: jax.Array  # float32 [E]: sum over tokens of ``Routing.probs``
    tokens: jax.Array  # float32 []: tokens routed
    dropped: jax.Array  # float32 []: (token, choice) pairs past capacity (0 when dropless)


def route(logits: jax.Array, spec: RouterSpec, bias: jax.Array | None = None) -> Routing:
    """Top-k token-choice routing of float32 router ``logits [..., E]``.

    ``bias`` (the aux-loss-free expert bias, DeepSeek-V3) is added to the scores for the choice of experts only:
    the combine weights are the unbiased scores, and no gradient flows into the bias.
    """
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if spec.scoring is Scoring.SOFTMAX else jax.nn.sigmoid(logits)
    select = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    if spec.num_groups > 1:
        select = _limit_groups(select, spec.num_groups, spec.top_groups)
    _, experts = jax.lax.top_k(select, spec.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if spec.normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    probs = scores if spec.scoring is Scoring.SOFTMAX else scores / jnp.sum(scores, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), weights * spec.scale, probs)


def _limit_groups(select: jax.Array, groups: int, top_groups: int) -> jax.Array:
    """``select [..., E]`` with the experts outside each token's ``top_groups`` best groups set to -inf."""
    grouped = select.reshape(*select.shape[:-1], groups, select.shape[-1] // groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], axis=-1)  # [..., G]
    _, best = jax.lax.top_k(group_scores, top_groups)
    keep = jnp.sum(jax.nn.one_hot(best, groups, dtype=jnp.int32), axis=-2) > 0  # [..., G]
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(select.shape)


def load_stats(routing: Routing, spec: RouterSpec) -> LoadStats:
    """Per-expert routed counts and score sums over every token of ``routing`` (``[B, S, k]`` choices), and
    how many choices the capacity drops."""
    num_experts = spec.num_experts
    dropped = jnp.zeros((), jnp.float32)
    if spec.capacity_factor is not None:
        past = slot_positions(routing.experts, num_experts) >= capacity(routing.experts.shape[1], spec)
        dropped = jnp.sum(past, dtype=jnp.float32)
    counts = jnp.sum(jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32),
                     axis=tuple(range(routing.experts.ndim)))
    prob_sums = jnp.sum(routing.probs.reshape(-1, num_experts), axis=0)
    return LoadStats(counts, prob_sums, jnp.asarray(routing.probs.size // num_experts, jnp.float32), dropped)


def balancing_loss(stats: LoadStats, top_k: int) -> jax.Array:
    """Switch / GShard auxiliary loss ``E * sum_e f_e * P_e`` (1.0 when perfectly balanced).

    ``f_e`` is the fraction of the ``tokens * top_k`` choices that went to expert ``e``, ``P_e`` its mean score.
    Computed from global-batch sums, so a data-parallel run gives the single-device value.
    """
    num_experts = stats.counts.shape[-1]
    fraction = stats.counts / (stats.tokens * top_k)
    return num_experts * jnp.sum(fraction * stats.prob_sums / stats.tokens)


def update_expert_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts, lower the over-loaded.

    ``bias + rate * sign(mean(counts) - counts)``; applied outside the gradient, after each step.
    """
    return bias + rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts).astype(bias.dtype)


def capacity(seq: int, spec: RouterSpec) -> int:
    """Slots per expert per sequence: ``ceil(seq * k * factor / E)``, at most ``seq`` (a token picks an expert
    at most once, so ``seq`` slots never drop: the padded dropless buffer)."""
    if spec.capacity_factor is None:
        return seq
    return max(1, min(seq, math.ceil(seq * spec.top_k * spec.capacity_factor / spec.num_experts)))


def slot_positions(experts: jax.Array, num_experts: int) -> jax.Array:
    """Position of each (token, choice) in its expert's queue, per sequence: int32 ``[B, S, k]``.

    Priority: every token's first choice before any second choice, then earlier tokens first (deterministic).
    """
    b, s, k = experts.shape
    ranked = jnp.swapaxes(experts, 1, 2).reshape(b, k * s)  # (choice rank, token) order
    onehot = jax.nn.one_hot(ranked, num_experts, dtype=jnp.int32)
    queue = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)
    return jnp.swapaxes(queue.reshape(b, k, s), 1, 2)


def dispatch(x: jax.Array, experts: jax.Array, num_experts: int, slots: int
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Scatters tokens into padded per-sequence capacity buffers.

    Args:
        x: ``[B, S, h]`` tokens.
        experts: int32 ``[B, S, k]`` routing choices.
        num_experts: E.
        slots: capacity C per expert per sequence.

    Returns:
        ``(buffers [B, E*C, h], index [B, S, k], kept [B, S, k])``: a dropped choice has ``kept`` False and an
        ``index`` of E*C (past the buffer: the scatter drops it, the gather reads zeros).
    """
    position = slot_positions(experts, num_experts)
    kept = position < slots
    index = jnp.where(kept, experts * slots + position, num_experts * slots)
    b, s, k = experts.shape
    rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], (b, s, k))
    tokens = jnp.broadcast_to(x[:, :, None, :], (b, s, k, x.shape[-1]))
    buffers = jnp.zeros((b, num_experts * slots, x.shape[-1]), x.dtype).at[rows, index].add(tokens, mode="drop")
    return buffers, index, kept


def combine(outputs: jax.Array, index: jax.Array, kept: jax.Array, weights: jax.Array) -> jax.Array:
    """Gathers expert ``outputs [B, E*C, h]`` back to tokens, weighted by ``weights [B, S, k]``: ``[B, S, h]``."""
    b = outputs.shape[0]
    rows = jnp.arange(b)[:, None, None]
    picked = outputs.at[rows, index].get(mode="fill", fill_value=0)  # [B, S, k, h]
    w = jnp.where(kept, weights, 0.0).astype(outputs.dtype)
    return jnp.einsum("bskh,bsk->bsh", picked, w)


GPT_OSS_ALPHA = 1.702  # gpt-oss's sigmoid sharpness in its clamped SwiGLU


def glu(gate: jax.Array, up: jax.Array, limit: float | None = None) -> jax.Array:
    """``silu(gate) * up``; with ``limit``, gpt-oss's form: ``gate`` clamped above at ``limit``, ``up`` to
    ``[-limit, limit]``, then ``gate * sigmoid(1.702 * gate) * (up + 1)``."""
    if limit is None:
        return jax.nn.silu(gate) * up
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(GPT_OSS_ALPHA * gate) * (up + 1)


def swiglu_experts(x: jax.Array, w: ExpertWeights, limit: float | None = None) -> jax.Array:
    """Batched SwiGLU experts on ``x [E, n, h]`` -> ``[E, n, h]`` (expert ``e`` reads row ``e``; `glu`)."""
    dt = x.dtype
    gate = jnp.einsum("enh,ehf->enf", x, w.gate.astype(dt))
    up = jnp.einsum("enh,ehf->enf", x, w.up.astype(dt))
    return jnp.einsum("enf,efh->enh", glu(gate, up, limit), w.down.astype(dt))


def capacity_experts(x: jax.Array, routing: Routing, w: ExpertWeights, slots: int, limit: float | None = None
                     ) -> jax.Array:
    """The padded-buffer path on one device: dispatch, batched experts, combine. ``x [B, S, h]``."""
    num_experts = w.gate.shape[0]
    buffers, index, kept = dispatch(x, routing.experts, num_experts, slots)
    b, _, h = buffers.shape
    per_expert = jnp.swapaxes(buffers.reshape(b, num_experts, slots, h), 0, 1).reshape(num_experts, b * slots, h)
    out = swiglu_experts(per_expert, w, limit)
    out = jnp.swapaxes(out.reshape(num_experts, b, slots, h), 0, 1).reshape(b, num_experts * slots, h)
    return combine(out, index, kept, routing.weights)


def ragged_experts(x: jax.Array, routing: Routing, w: ExpertWeights, limit: float | None = None) -> jax.Array:
    """The dropless path: (token, choice) pairs sorted by expert, SwiGLU as three ``jax.lax.ragged_dot`` grouped
    GEMMs over the sorted rows (no padding, no dropping), then unsorted and combined. ``x [..., h]``."""
    h, k = x.shape[-1], routing.experts.shape[-1]
    flat = x.reshape(-1, h)
    choice = routing.experts.reshape(-1)
    order = jnp.argsort(choice, stable=True)
    rows = flat[order // k]
    sizes = jnp.bincount(choice, length=w.gate.shape[0]).astype(jnp.int32)
    dt = x.dtype
    gate = jax.lax.ragged_dot(rows, w.gate.astype(dt), sizes)
    up = jax.lax.ragged_dot(rows, w.up.astype(dt), sizes)
    out = jax.lax.ragged_dot(glu(gate, up, limit), w.down.astype(dt), sizes)
    unsorted = jnp.zeros_like(out).at[order].set(out)
    weights = routing.weights.reshape(-1, k).astype(dt)
    return jnp.einsum("nkh,nk->nh", unsorted.reshape(-1, k, h), weights).reshape(x.shape)


def local_experts(x: jax.Array, routing: Routing, w: ExpertWeights, spec: RouterSpec) -> jax.Array:
    """The single-device dispatcher: padded capacity buffers when ``spec`` drops, else the ragged path."""
    if spec.capacity_factor is None:
        return ragged_experts(x, routing, w, spec.swiglu_limit)
    return capacity_experts(x, routing, w, capacity(x.shape[1], spec), spec.swiglu_limit)


# (tokens [B, S, h], routing, expert weights, spec) -> [B, S, h]
ExpertDispatch = Callable[[jax.Array, Routing, ExpertWeights, RouterSpec], jax.Array]
_DISPATCH: contextvars.ContextVar[ExpertDispatch | None] = contextvars.ContextVar("moe_dispatch", default=None)


@contextlib.contextmanager
def experts_dispatch(fn: ExpertDispatch) -> Iterator[None]:
    """Routes every `apply_experts` call traced inside the ``with`` block through ``fn`` (e.g. the runtime's
    expert-parallel all-to-all dispatcher) instead of `local_experts`."""
    token = _DISPATCH.set(fn)
    try:
        yield
    finally:
        _DISPATCH.reset(token)


def apply_experts(x: jax.Array, routing: Routing, w: ExpertWeights, spec: RouterSpec) -> jax.Array:
    """Runs the routed experts on ``x [B, S, h]`` with the active dispatcher (default `local_experts`)."""
    fn = _DISPATCH.get()
    return (fn or local_experts)(x, routing, w, spec)


# The checkpoint names `models.moe` tags its router and expert outputs with; a user's own MoE is recognised by
# the names or by a grouped GEMM (``ragged_dot``).
MOE_NAMES = frozenset({"moe_router", "moe_out"})


class MoENotTunedError(ValueError):
    """The planner was given a step with Mixture-of-Experts layers, which it does not price yet (issue #51)."""


def moe_marker(jaxpr: ClosedJaxpr | Jaxpr) -> str | None:
    """What marks ``jaxpr`` as an MoE computation (a `MOE_NAMES` tag or a ``ragged_dot``), or None."""
    for eqn in iter_eqns(jaxpr, bodies=True):
        if eqn.primitive.name in ("ragged_dot_general", "ragged_dot"):
            return "a jax.lax.ragged_dot grouped GEMM"
        if eqn.primitive.name == "name" and eqn.params.get("name") in MOE_NAMES:
            return f"the MoE tag {eqn.params['name']!r} (models.moe)"
    return None


def refuse_moe(jaxpr: ClosedJaxpr | Jaxpr) -> None:
    """Raises `MoENotTunedError` when ``jaxpr`` holds MoE layers (the analysis and the tuner do not price them).

    Raises:
        MoENotTunedError: naming what was found and what to do.
    """
    found = moe_marker(jaxpr)
    if found is not None:
        raise MoENotTunedError(
            f"the step has Mixture-of-Experts layers ({found}), which the planner does not tune yet: the cost model "
            "has no router, all-to-all or expert-parallel terms (issue #51, items 4-5). Run it with a hand-set "
            "mesh and the expert-parallel runtime (mistjax.runtime.experts, docs/moe.md) under jax.jit")
