"""Pipeline operation orders: what each device group runs, in which order, and one host issue order.

The MPMD executor (`mistjax.runtime.mpmd`) issues every operation of a step in one sequence and each
device group runs its own operations in that order; `list_schedule` merges the per-group orders by
simulated start time, so no device waits for anything but data. `simulated_time` replays an issue
order with per-stage costs (what the cost model prices). Operations: ``F(k, i)`` / ``B(k, i)`` forward /
backward of micro-batch ``i`` on virtual stage ``k``; ``FB`` on the last virtual stage runs both in one
program; under a zero-bubble schedule ``B`` is the input-gradient half of the backward and ``W(k, i)`` its
weight-gradient half, run later. The schedules and the reasoning: docs/pipelines.md.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, TypeAlias

import numpy as np
from numpy.typing import ArrayLike

from mistjax.core.schedules import SCHEDULE_NAMES as MPMD_SCHEDULES
from mistjax.core.schedules import V_SHAPED, ZERO_BUBBLE, ScheduleError, stage_groups


class OpKind(enum.StrEnum):
    """What a pipeline operation runs. A `str` enum: ``OpKind.F == "F"``, and it hashes as its value."""

    F = "F"  # forward of one micro-batch
    B = "B"  # backward of one micro-batch
    FB = "FB"  # the last virtual stage: forward and backward in one program
    W = "W"  # zero-bubble schedules: the weight-gradient half of a backward (B is then its input-gradient half)

    def __repr__(self) -> str:
        return repr(self.value)  # an `Op` prints as Op(kind='F', ...) in messages, as with plain strings


# Nominal costs of the list scheduler's simulation (backward = 2 x forward, as without remat); only
# the order of simulated start times matters, so any positive costs give a valid issue order.
NOMINAL_COST: dict[str, float] = {OpKind.F: 1.0, OpKind.B: 2.0, OpKind.FB: 3.0, OpKind.W: 1.0}

# Zero-bubble schedules split the backward in two halves of about a forward's work each (Qi et al., ICLR'24):
# the input gradient (B) and the weight gradients (W). The first stage has no input gradient to send: its B
# only receives the cotangent and its W runs the whole backward, deferrable into the bubbles.
ZB_NOMINAL_COST: dict[str, float] = {OpKind.F: 1.0, OpKind.B: 1.0, OpKind.FB: 2.0, OpKind.W: 1.0}

# ZB-V's order is built with the weight passes at a quarter of a micro-batch's time (B 1.25, W 0.75 against F 1):
# the share measured on the Mist grid and the large cells is 0.24-0.29 (`cost.model.StageCost.wgrad`, the
# weight-gradient GEMMs; attention's backward has none). Built with F = B = W instead, the order leaves each W
# a third of the time, and at a quarter its bubble is worse than ZB-H1's (docs/pipelines.md).
ZBV_NOMINAL_COST: dict[str, float] = {OpKind.F: 1.0, OpKind.B: 1.25, OpKind.FB: 2.25, OpKind.W: 0.75}


class Op(NamedTuple):
    """One pipeline operation: ``kind`` F / B / FB on virtual stage ``stage`` for micro-batch ``mb``."""

    kind: OpKind
    stage: int
    mb: int


OpCost: TypeAlias = ArrayLike | Callable[[Op], float]
"""Seconds of one kind of operation: a scalar, one per virtual stage, or ``cost(op) -> seconds``."""


def _check(num_groups: int, chunks: int, num_microbatches: int, schedule: str) -> None:
    if schedule not in MPMD_SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}: use one of {MPMD_SCHEDULES}")
    if num_groups < 1 or chunks < 1 or num_microbatches < 1:
        raise ScheduleError(f"need at least one device group, chunk and micro-batch, got S={num_groups}, "
                            f"v={chunks}, G={num_microbatches}")
    if schedule in V_SHAPED and (chunks != 2 or num_groups < 2):
        raise ScheduleError(f"{schedule} runs two chunks on each of at least two device groups, got S={num_groups}, "
                            f"v={chunks}: use virtual_stages=2 with it")
    if chunks > 1 and schedule in ZERO_BUBBLE - V_SHAPED:
        raise ScheduleError(f"{schedule} has no interleaved form here; use virtual_stages=1 with it, or zb-v")
    if chunks > 1 and schedule == "1f1b-eager":
        raise ScheduleError("1f1b-eager has no interleaved form; use schedule 1f1b (Megatron's interleaved "
                            "1F1B) or gpipe with virtual_stages > 1")
    if chunks > 1 and schedule == "1f1b" and num_microbatches < num_groups:
        raise ScheduleError(f"interleaved 1F1B advances micro-batches in groups of the {num_groups} device "
                            f"groups, so grad_accum={num_microbatches} must be at least {num_groups}")


def _classic(s: int, S: int, G: int) -> list[tuple[OpKind, int]]:
    warm = min(S - s - 1, G)
    ops = [(OpKind.F, i) for i in range(warm)]
    for k in range(G - warm):
        ops += [(OpKind.F, warm + k), (OpKind.B, k)]
    return ops + [(OpKind.B, i) for i in range(G - warm, G)]


def _eager(s: int, S: int, G: int) -> list[tuple[OpKind, int]]:
    # One forward and one backward per tick; forwards first within a tick.
    timed = [(i + s, 0, OpKind.F, i) for i in range(G)] + [(i + 2 * S - 2 - s, 1, OpKind.B, i) for i in range(G)]
    return [(kind, i) for _, _, kind, i in sorted(timed)]


def _interleaved_sequence(S: int, v: int, G: int) -> list[tuple[int, int]]:
    """The (chunk, micro-batch) pairs a device group runs forwards in: micro-batches in groups of ``S``, each group
    through every chunk in turn. Where ``S`` does not divide ``G`` the last group takes the remainder too (``S``
    to ``2S - 1`` micro-batches), as Megatron-Core's schedule table does (``get_schedule_table``)."""
    starts = list(range(0, G - G % S if G >= S else G, S)) or [0]
    seq: list[tuple[int, int]] = []
    for k, start in enumerate(starts):
        group = range(start, G if k == len(starts) - 1 else start + S)
        seq += [(c, i) for c in range(v) for i in group]
    return seq


def _interleaved(d: int, S: int, v: int, G: int, extra: int = 0) -> list[tuple[OpKind, int, int]]:
    """Megatron's order for device group ``d``: (kind, chunk, micro-batch) triples; ``extra`` more warm-up
    forwards than Megatron's count (`_interleaved_orders`)."""
    seq = _interleaved_sequence(S, v, G)
    total = len(seq)
    fwd = [(OpKind.F, c, i) for c, i in seq]
    bwd = [(OpKind.B, v - 1 - c, i) for c, i in seq]
    warm = total if G == S else min((S - d - 1) * 2 + (v - 1) * S + extra, total)
    ops = fwd[:warm]
    for j in range(total - warm):
        ops += [fwd[warm + j], bwd[j]]
    return ops + bwd[total - warm:]


def device_orders(schedule: str, num_groups: int, num_microbatches: int, chunks: int = 1) -> list[list[Op]]:
    """Per device group, the operations it runs in order (the last virtual stage's F and B fused to FB).

    Args:
      schedule: one of `MPMD_SCHEDULES`.
      num_groups: device groups S (physical pipeline stages).
      num_microbatches: G.
      chunks: virtual stages per device group v; virtual stage ``c * S + d`` is chunk ``c`` of group ``d``.
    """
    S, v, G = num_groups, chunks, num_microbatches
    _check(S, v, G, schedule)
    if schedule in V_SHAPED:
        return zero_bubble_v_orders(S, G)
    if schedule in ZERO_BUBBLE:
        return zero_bubble_orders(S, G)
    if schedule == "1f1b" and v > 1:
        return _interleaved_orders(S, v, G)
    orders: list[list[Op]] = []
    for d in range(S):
        if schedule == "gpipe":
            raw = [(OpKind.F, c, i) for c in range(v) for i in range(G)]
            raw += [(OpKind.B, c, i) for c in reversed(range(v)) for i in range(G)]
        elif schedule == "1f1b-eager":
            raw = [(kind, 0, i) for kind, i in _eager(d, S, G)]
        else:
            raw = [(kind, 0, i) for kind, i in _classic(d, S, G)]
        orders.append(_placed(raw, d, S, v))
    return orders


def _placed(raw: Sequence[tuple[OpKind, int, int]], d: int, S: int, v: int) -> list[Op]:
    """Group ``d``'s (kind, chunk, micro-batch) triples as operations on virtual stages, the last virtual stage's
    F and B fused to one FB."""
    last = S * v - 1
    ops = []
    for kind, c, i in raw:
        k = c * S + d
        if k == last:
            if kind == OpKind.F:
                ops.append(Op(OpKind.FB, k, i))
            continue
        ops.append(Op(kind, k, i))
    return ops


def _interleaved_orders(S: int, v: int, G: int) -> list[list[Op]]:
    """Megatron's interleaved 1F1B orders. Where ``S`` does not divide ``G`` the last micro-batch group is longer
    (`_interleaved_sequence`) and Megatron's warm-up counts can leave a group waiting on a backward whose inputs
    need a forward it runs later, or idle: the groups then warm up by the extra forwards found by coordinate
    descent on the simulated time (nominal costs) from the fewest that run. Where ``S`` divides ``G``, Megatron's
    orders as they are."""
    extra = [0] * S
    while stuck := _stuck_groups(_extra_orders(S, v, G, extra), S * v):
        for d in stuck:
            extra[d] += 1
    if G % S == 0:
        return _extra_orders(S, v, G, extra)
    best = _nominal_time(_extra_orders(S, v, G, extra), S)
    for _ in range(2 * S):  # a bound on the rounds; each round that improves nothing ends the descent
        improved = False
        for d in range(S):
            trial = [e + (k == d) for k, e in enumerate(extra)]
            orders = _extra_orders(S, v, G, trial)
            t = math.inf if _stuck_groups(orders, S * v) else _nominal_time(orders, S)
            if t < best - 1e-9:
                extra, best, improved = trial, t, True
        if not improved:
            break
    return _extra_orders(S, v, G, extra)


def _extra_orders(S: int, v: int, G: int, extra: Sequence[int]) -> list[list[Op]]:
    return [_placed(_interleaved(d, S, v, G, extra[d]), d, S, v) for d in range(S)]


def _nominal_time(orders: Sequence[Sequence[Op]], S: int) -> float:
    return simulated_time(list_schedule(orders), S)


def _stuck_groups(orders: Sequence[Sequence[Op]], num_virtual: int) -> list[int]:
    """The groups whose next operation waits forever when every group runs its order as far as it can
    (none: the orders run); only groups held at a backward, the ones more warm-up forwards can free."""
    done: set[Op] = set()
    pos = [0] * len(orders)
    moved = True
    while moved:
        moved = False
        for g, ops in enumerate(orders):
            while pos[g] < len(ops) and all(dep in done for dep in dependencies(ops[pos[g]], num_virtual)):
                done.add(ops[pos[g]])
                pos[g] += 1
                moved = True
    return [g for g, ops in enumerate(orders) if pos[g] < len(ops) and ops[pos[g]].kind == OpKind.B]


def zero_bubble_orders(num_groups: int, num_microbatches: int) -> list[list[Op]]:
    """ZB-H1 (Qi et al., ICLR'24): 1F1B's forwards and input-gradient backwards (B), stage ``s`` running each
    weight-gradient pass (W) ``s`` micro-batches after its B, so every stage holds at most ``min(S, G)``
    micro-batches (1F1B's peak, its first stage's) from F to W.

    Stage ``s`` runs 1F1B's ``min(S - s - 1, G)`` warm-up forwards, then per micro-batch ``k`` its next forward,
    ``B(k)`` and ``W(k - s)``, then its ``s`` remaining W's. The lag lets the input gradients run down the
    pipeline without waiting for weight passes, and the W's the later stages hold back fill the drain: with
    ``G >= S`` the bubble is Qi et al.'s ``(S - 1)(F + B - W)`` for any costs with ``W <= F + B``, where
    deferring no W (1F1B) leaves ``(S - 1)(F + B + W)`` (tests/test_zero_bubble.py). A smaller lag on any stage
    gives a larger bubble. The last stage runs F and B as one program (FB) and lags its W's by ``S - 1``.
    """
    S, G = num_groups, num_microbatches
    orders: list[list[Op]] = []
    for s in range(S):
        warm, last = min(S - s - 1, G), s == S - 1
        ops = [Op(OpKind.F, s, i) for i in range(warm)]
        for k in range(G):
            if warm + k < G:
                ops.append(Op(OpKind.FB if last else OpKind.F, s, warm + k))
            if not last:
                ops.append(Op(OpKind.B, s, k))
            if k >= s:
                ops.append(Op(OpKind.W, s, k - s))
        orders.append(ops + [Op(OpKind.W, s, i) for i in range(max(G - s, 0), G)])
    return orders


def zero_bubble_v_orders(num_groups: int, num_microbatches: int) -> list[list[Op]]:
    """Per device group, its operations in ZB-V's order (`zero_bubble_v_issue` restricted to each group)."""
    return group_queues(zero_bubble_v_issue(num_groups, num_microbatches), num_groups, "zb-v")


def _zbv_cost(op: Op) -> float:
    """`ZBV_NOMINAL_COST` of ``op``; the first stage's B is free and its W carries the whole backward (its
    input gradient is never needed: nothing precedes stage 0)."""
    if op.stage == 0 and op.kind in (OpKind.B, OpKind.W):
        return 0.0 if op.kind == OpKind.B else ZBV_NOMINAL_COST[OpKind.B] + ZBV_NOMINAL_COST[OpKind.W]
    return ZBV_NOMINAL_COST[op.kind]


class ZbvRules(NamedTuple):
    """One rule set of ZB-V's simulation (`zero_bubble_v_issue`), on top of its fixed rules (a backward first, then
    a forward while the group holds fewer than ``2S`` chunk micro-batches, the chunk nearer the loss first).

    ``lead`` / ``lead_back``: at most ``lead S + slope (S - 1 - d)`` micro-batches of group ``d``'s first chunk
    (``0.5 d`` instead of the slope on its second) between their F and their B; None: only the ``2S`` cap. A
    group that runs every forward it can runs far ahead of the pipeline in its fill and then sits at the cap for
    the rest of the step, with no room left to defer W's into the drain. ``cheapest_w``: the cheapest pending W
    first (the first group's chunk-0 W, its whole backward, kept for the drain), else the oldest. ``patience``:
    with nothing ready, wait instead of starting a W when an input arrives within this share of the W's time.
    """

    lead: float | None = None
    slope: float = 1.0
    lead_back: float | None = None
    cheapest_w: bool = False
    patience: float = 0.0


# The rule sets `zero_bubble_v_issue` simulates, the first the plain greedy; each is the best on some shapes of a
# scan of S 4-16, G 2S-8S (W a quarter of a micro-batch), none on all (docs/schedules.md).
ZBV_RULES: tuple[ZbvRules, ...] = (
    ZbvRules(), ZbvRules(cheapest_w=True), ZbvRules(1.0, 1.0, 0.625, patience=0.5), ZbvRules(1.0, 0.5, 0.625),
    ZbvRules(1.0, 0.5, 0.5), ZbvRules(1.0, 0.5, None, cheapest_w=True, patience=0.5),
    ZbvRules(1.125, 0.5, None, cheapest_w=True))


class _ZbvSimulation:
    """The state of `zero_bubble_v_issue`'s simulation: per virtual stage, the next F and B and when each
    micro-batch's F (or FB) and B (or FB) finished; per device group, when it is free, how many chunk
    micro-batches' residuals it holds and its deferred W's (oldest first)."""

    def __init__(self, num_groups: int, num_microbatches: int, rules: ZbvRules) -> None:
        S = num_groups
        self.S, self.G, self.V, self.rules = S, num_microbatches, 2 * S, rules
        self.limit = 2 * S  # chunk micro-batches' residuals a group may hold: 1F1B's peak
        self.chunks = [(self.V - 1 - d, d) for d in range(S)]  # each group's stages, the one nearer the loss first
        self.ahead = [self._ahead(k) for k in range(self.V)]
        self.next_f, self.next_b = [0] * self.V, [0] * self.V
        self.done_f: list[list[float]] = [[] for _ in range(self.V)]
        self.done_b: list[list[float]] = [[] for _ in range(self.V)]
        self.free = [0.0] * S
        self.live = [0] * S
        self.pending: list[list[Op]] = [[] for _ in range(S)]

    def _ahead(self, k: int) -> int:
        """Most micro-batches of virtual stage ``k`` between their F and their B (`ZbvRules.lead`)."""
        r, S = self.rules, self.S
        share = r.lead if k < S else r.lead_back
        if share is None or k == self.V - 1:
            return self.G
        return max(1, int(share * S + (r.slope * (S - 1 - k) if k < S else 0.5 * (2 * S - 1 - k))))

    def arrival(self, op: Op) -> float | None:
        """When ``op``'s inputs (`dependencies`) are all computed, or None."""
        k, i = op.stage, op.mb
        if op.kind == OpKind.B:  # its own forward has run; the cotangent comes from stage k + 1
            return max(self.done_f[k][i], self.done_b[k + 1][i]) if len(self.done_b[k + 1]) > i else None
        if k == 0:
            return 0.0
        return self.done_f[k - 1][i] if len(self.done_f[k - 1]) > i else None

    def _ready(self, d: int) -> list[tuple[float, int, Op]]:
        """(start, rank: backward 0, forward 1, op) of every F / B group ``d`` could run."""
        ready: list[tuple[float, int, Op]] = []
        for k in self.chunks[d]:
            if k != self.V - 1 and self.next_b[k] < self.next_f[k]:
                op = Op(OpKind.B, k, self.next_b[k])
                if (t := self.arrival(op)) is not None:
                    ready.append((max(t, self.free[d]), 0, op))
            if (self.next_f[k] < self.G and self.live[d] < self.limit
                    and self.next_f[k] - self.next_b[k] < self.ahead[k]):
                op = Op(OpKind.FB if k == self.V - 1 else OpKind.F, k, self.next_f[k])
                if (t := self.arrival(op)) is not None:
                    ready.append((max(t, self.free[d]), 1, op))
        return ready

    def _weight_pass(self, d: int) -> Op:
        pending = self.pending[d]
        if not self.rules.cheapest_w:
            return pending[0]
        return min(pending, key=lambda op: (_zbv_cost(op), op.mb))  # stable: the oldest of equal ones

    def option(self, d: int) -> tuple[float, int, Op] | None:
        """(start, d, operation) group ``d`` runs next, or None while it waits for an input not yet computed."""
        ready, free = self._ready(d), self.free[d]
        now = [r for r in ready if r[0] <= free]
        if now:
            start, _, op = min(now, key=lambda r: r[:2])  # stable: the chunk nearer the loss wins ties
            return start, d, op
        if self.pending[d]:
            w = self._weight_pass(d)
            soon = min((r[0] for r in ready), default=math.inf)
            if not ready or soon - free >= self.rules.patience * _zbv_cost(w):
                return free, d, w
        if ready:
            start, _, op = min(ready, key=lambda r: r[:2])
            return start, d, op
        return (free, d, self._weight_pass(d)) if self.pending[d] else None

    def run(self, d: int, start: float, op: Op) -> None:
        """Group ``d`` runs ``op`` from ``start``: record its finish and what it leaves to do."""
        self.free[d] = start + _zbv_cost(op)
        if op.kind in (OpKind.F, OpKind.FB):
            self.done_f[op.stage].append(self.free[d])
        if op.kind in (OpKind.B, OpKind.FB):
            self.done_b[op.stage].append(self.free[d])
        if op.kind == OpKind.W:
            self.pending[d].remove(op)
            self.live[d] -= 1
            return
        if op.kind == OpKind.B:
            self.next_b[op.stage] += 1
            self.pending[d].append(Op(OpKind.W, op.stage, op.mb))
            return
        self.next_f[op.stage] += 1
        self.live[d] += 1
        if op.kind == OpKind.FB:
            self.next_b[op.stage] += 1
            self.pending[d].append(Op(OpKind.W, op.stage, op.mb))


def _zbv_simulate(num_groups: int, num_microbatches: int, rules: ZbvRules) -> tuple[list[Op], float]:
    """The start order of one ZB-V simulation under ``rules``, and its makespan at `ZBV_NOMINAL_COST` (the
    simulation's own clock: each group runs the order as soon as its inputs arrive, as `simulated_time` does).

    Raises:
      ScheduleError: the rules deadlock at this shape (every group waits).
    """
    sim = _ZbvSimulation(num_groups, num_microbatches, rules)
    S, V, G = sim.S, sim.V, sim.G
    options = [sim.option(d) for d in range(S)]
    issue: list[Op] = []
    for _ in range(3 * V * G - G):  # F, B and W per micro-batch and virtual stage; FB on the last
        ready = [o for o in options if o is not None]
        if not ready:
            raise ScheduleError(f"the ZB-V simulation deadlocked under {rules}")
        start, d, op = min(ready, key=lambda o: o[:2])
        sim.run(d, start, op)
        issue.append(op)
        for g in (d - 1, d, d + 1):  # only a neighbour's inputs can have arrived
            if 0 <= g < S:
                options[g] = sim.option(g)
    return issue, max(sim.free)


def _zbv_held(issue: Sequence[Op], num_groups: int) -> float:
    """The most a device group holds at once in an order, residuals and stashes alike in chunk micro-batches (a
    stash counted as one micro-batch's residuals, about its size: docs/pipelines.md), the first stage's none."""
    stash = np.where(np.arange(2 * num_groups) == 0, 0.0, 1.0)
    return float(group_residual_peaks(issue, num_groups, 1.0, stash, "zb-v").max())


@functools.lru_cache(maxsize=64)
def _zbv_rules(num_groups: int) -> ZbvRules:
    """The rule set of `ZBV_RULES` whose order has the smallest nominal makespan at ``S' = min(S, 8)`` groups and
    ``4 S'`` micro-batches (the first of equal ones), among those that do not deadlock there and hold no more
    (`_zbv_held`) than the plain greedy. Chosen once per S and at most 8 groups (rule sets scale with S), so that
    a step costs two simulations, not one per rule set."""
    s = min(num_groups, 8)
    plain, best = _zbv_simulate(s, 4 * s, ZBV_RULES[0]), (math.inf, 0)
    for j, rules in enumerate(ZBV_RULES):
        try:
            issue, makespan = _zbv_simulate(s, 4 * s, rules)
        except ScheduleError:
            continue
        if _zbv_held(issue, s) <= _zbv_held(plain[0], s):
            best = min(best, (makespan, j))
    return ZBV_RULES[best[1]]


def zero_bubble_v_issue(num_groups: int, num_microbatches: int) -> list[Op]:
    """ZB-V (Qi et al., ICLR'24): two chunks per device group placed in a V (group ``d`` runs virtual stages ``d``
    and ``2S - 1 - d``; `core.schedules.stage_groups`), every backward split into B and W, and each group holding
    at most ``2S`` chunk micro-batches' residuals, 1F1B's peak (its first stage's ``S`` whole micro-batches).

    Built by simulating every group with `ZBV_NOMINAL_COST` (the order, not the times, is the schedule): a free
    group runs, of the operations whose inputs have arrived, a backward first, then a forward while it holds
    fewer than ``2S`` chunk micro-batches' residuals, the chunk nearer the loss first in both, then a pending W;
    with nothing ready it waits for the earliest input. `ZbvRules` add limits and choices to that greedy: the
    rule set of `ZBV_RULES` best on a step of ``4 S'`` micro-batches (`_zbv_rules`) is simulated beside the plain
    greedy, and the order with the smaller nominal makespan is kept where it holds no more residuals and stashes
    at its peak (`_zbv_held`; deterministic, the first of equal ones; never slower than the plain greedy at these
    costs, nor larger). The last virtual stage (on the first group) runs F and B as
    one program and defers its W like the others. Returns the operations in the order the simulation starts them,
    the host's issue order (what `list_schedule` would make of the groups' orders).
    """
    plain, *others = _zbv_candidates(num_groups, num_microbatches)
    held = _zbv_held(plain[0], num_groups)
    return min([plain, *(c for c in others if _zbv_held(c[0], num_groups) <= held)], key=lambda c: c[1])[0]


def _zbv_candidates(num_groups: int, num_microbatches: int) -> list[tuple[list[Op], float]]:
    """ZB-V's orders at this shape with their nominal makespans: the plain greedy's (`ZBV_RULES[0]`), then, where
    `_zbv_rules` picks other rules and they run here, theirs."""
    out = [_zbv_simulate(num_groups, num_microbatches, ZBV_RULES[0])]
    rules = _zbv_rules(num_groups)
    if rules != ZBV_RULES[0]:
        with contextlib.suppress(ScheduleError):  # rules that run at 4 S' micro-batches may deadlock elsewhere
            out.append(_zbv_simulate(num_groups, num_microbatches, rules))
    return out


def dependencies(op: Op, num_virtual: int) -> list[Op]:
    """The operations whose outputs `op` reads (activation, cotangent, its own residuals)."""
    kind, k, i = op
    last = num_virtual - 1
    if kind == OpKind.W:
        return [Op(OpKind.FB if k == last else OpKind.B, k, i)]
    if kind == OpKind.F:
        return [Op(OpKind.F, k - 1, i)] if k > 0 else []
    if kind == OpKind.FB:
        return [Op(OpKind.F, k - 1, i)] if k > 0 else []
    return [Op(OpKind.F, k, i), Op(OpKind.FB if k + 1 == last else OpKind.B, k + 1, i)]


def list_schedule(orders: Sequence[Sequence[Op]], cost: Mapping[str, float] | None = None) -> list[Op]:
    """Merge per-group orders into one issue order by simulated start time (see module docstring).

    Each step issues the ready head operation with the earliest simulated start (ties by group). Only the
    heads an issued operation can change are re-examined: its own group's and those of the neighbouring
    virtual stages (the only operations that read its outputs).

    Raises:
      ScheduleError: if the orders deadlock (an operation waits for one that its group runs later).
    """
    cost = cost or NOMINAL_COST
    num_virtual = 1 + max(op.stage for ops in orders for op in ops)
    group_of = {op: g for g, ops in enumerate(orders) for op in ops}
    for op in group_of:
        for dep in dependencies(op, num_virtual):
            if dep not in group_of:
                raise ScheduleError(f"{op} depends on {dep}, which no device group runs")
    finish: dict[Op, float] = {}
    free = [0.0] * len(orders)
    pos = [0] * len(orders)
    heads: list[tuple[float, int, Op] | None] = [None] * len(orders)

    def refresh(g: int) -> None:
        heads[g] = None
        if pos[g] < len(orders[g]):
            op = orders[g][pos[g]]
            deps = dependencies(op, num_virtual)
            if all(dep in finish for dep in deps):
                heads[g] = (max([free[g], *(finish[dep] for dep in deps)]), g, op)

    for g in range(len(orders)):
        refresh(g)
    issue: list[Op] = []
    total = sum(len(o) for o in orders)
    while len(issue) < total:
        ready = [h for h in heads if h is not None]
        if not ready:
            stuck = [orders[g][pos[g]] for g in range(len(orders)) if pos[g] < len(orders[g])]
            raise ScheduleError(f"the schedule deadlocks: every device group waits ({stuck})")
        start, g, op = min(ready)
        finish[op] = start + cost[op.kind]
        free[g] = finish[op]
        pos[g] += 1
        issue.append(op)
        for k in {g, *(group_of[o] for o in _readers(op, num_virtual) if o in group_of)}:
            refresh(k)
    return issue


def _readers(op: Op, num_virtual: int) -> list[Op]:
    """Operations that may read ``op``'s outputs (the inverse of `dependencies`)."""
    kind, k, i = op
    if kind == OpKind.W:
        return []
    if kind == OpKind.B:
        return [*([Op(OpKind.B, k - 1, i)] if k > 0 else []), Op(OpKind.W, k, i)]
    nxt = OpKind.FB if k + 2 == num_virtual else OpKind.F
    ahead = [Op(nxt, k + 1, i)] if k + 1 < num_virtual else []
    behind = [Op(OpKind.B, k - 1, i)] if kind == OpKind.FB and k > 0 else []
    return [*ahead, Op(OpKind.B, k, i), *behind]


def _groups(issue: Sequence[Op], num_groups: int, schedule: str) -> np.ndarray:
    """The device group of each virtual stage of ``issue`` (`core.schedules.stage_groups`)."""
    return stage_groups(1 + max(op.stage for op in issue), num_groups, schedule)


def group_queues(issue: Sequence[Op], num_groups: int, schedule: str = "1f1b") -> list[list[Op]]:
    """Each device group's queue: the issue order restricted to its operations (``schedule`` places them)."""
    group = _groups(issue, num_groups, schedule)
    queues: list[list[Op]] = [[] for _ in range(num_groups)]
    for op in issue:
        queues[group[op.stage]].append(op)
    return queues


def dependency_depth(issue: Sequence[Op], num_groups: int, schedule: str = "1f1b") -> dict[str, int]:
    """Longest chains of the issue order's dependency graph (data edges + each group's queue order).

    Returns ``{"forward": n, "backward": m}``: the most forward (F, FB) and backward (B, FB) operations
    on one chain. There are no other edges: no operation waits for a tick or a barrier.
    """
    num_virtual = 1 + max(op.stage for op in issue)
    prev: dict[Op, Op] = {}
    for queue in group_queues(issue, num_groups, schedule):
        for a, b in zip(queue, queue[1:]):
            prev[b] = a
    out = {}
    for name, kinds in (("forward", {OpKind.F, OpKind.FB}), ("backward", {OpKind.B, OpKind.FB})):
        depth: dict[Op, int] = {}
        for op in issue:
            preds = [*dependencies(op, num_virtual), *([prev[op]] if op in prev else [])]
            depth[op] = (op.kind in kinds) + max((depth[p] for p in preds), default=0)
        out[name] = max(depth.values())
    return out


def residuals_in_flight(issue: Sequence[Op]) -> np.ndarray:
    """Per virtual stage, the most micro-batches whose residuals are held at once (F issued, B not yet; under a
    zero-bubble schedule, W not yet: a micro-batch keeps what its weight gradients read until then)."""
    num_virtual = 1 + max(op.stage for op in issue)
    split = {op.stage for op in issue if op.kind == OpKind.W}
    live = np.zeros(num_virtual, np.int64)
    peak = np.zeros(num_virtual, np.int64)
    for op in issue:
        if op.kind == OpKind.F or (op.kind == OpKind.FB and op.stage in split):
            live[op.stage] += 1
            peak[op.stage] = max(peak[op.stage], live[op.stage])
        elif op.kind == (OpKind.W if op.stage in split else OpKind.B):
            live[op.stage] -= 1
    return peak


def deferred_in_flight(issue: Sequence[Op]) -> np.ndarray:
    """Per virtual stage, the most micro-batches whose weight-gradient pass (W) waits at once (B issued, W not):
    each holds its stash (zero without W operations)."""
    num_virtual = 1 + max(op.stage for op in issue)
    live = np.zeros(num_virtual, np.int64)
    peak = np.zeros(num_virtual, np.int64)
    split = {op.stage for op in issue if op.kind == OpKind.W}
    for op in issue:
        if op.stage not in split:
            continue
        if op.kind in (OpKind.B, OpKind.FB):
            live[op.stage] += 1
            peak[op.stage] = max(peak[op.stage], live[op.stage])
        elif op.kind == OpKind.W:
            live[op.stage] -= 1
    return peak


def issue_order(schedule: str, num_groups: int, num_microbatches: int, chunks: int = 1) -> list[Op]:
    """The host's issue order for one step of `schedule` (`device_orders` merged by `list_schedule`)."""
    return list(_issue_order(schedule, num_groups, num_microbatches, chunks))


@functools.lru_cache(maxsize=256)
def _issue_order(schedule: str, num_groups: int, num_microbatches: int, chunks: int) -> tuple[Op, ...]:
    # Cached: the cost model asks for the same order several times per plan (time, memory, the explanation).
    if schedule in V_SHAPED:  # its simulation's own start order (`list_schedule` of its orders, computed once)
        _check(num_groups, chunks, num_microbatches, schedule)
        return tuple(zero_bubble_v_issue(num_groups, num_microbatches))
    cost = ZB_NOMINAL_COST if schedule in ZERO_BUBBLE else None
    return tuple(list_schedule(device_orders(schedule, num_groups, num_microbatches, chunks), cost))


def group_residual_peaks(issue: Sequence[Op], num_groups: int, per_microbatch: ArrayLike = 1.0,
                         stash: ArrayLike = 0.0, schedule: str = "1f1b") -> np.ndarray:
    """Per device group, the most residuals its chunks hold at once along its operations: the micro-batches
    each chunk holds (as `residuals_in_flight` counts them) times ``per_microbatch[chunk]`` (one micro-batch's
    residuals of each virtual stage), summed over the group's chunks, with a fused forward + backward's own
    transient residuals while it runs. Under a zero-bubble schedule a micro-batch also holds ``stash[chunk]``
    from its B (or fused FB) to its W. With one chunk per group and no stash, `residuals_in_flight` (at least 1)
    times ``per_microbatch``; with several, at most the sum of the chunks' peaks, which need not coincide."""
    num_virtual = 1 + max(op.stage for op in issue)
    size = np.broadcast_to(np.asarray(per_microbatch, np.float64), (num_virtual,))
    kept = np.broadcast_to(np.asarray(stash, np.float64), (num_virtual,))
    split = {op.stage for op in issue if op.kind == OpKind.W}
    group = _groups(issue, num_groups, schedule)
    held = np.zeros(num_groups)
    peak = np.zeros(num_groups)
    for op in issue:
        k, g = op.stage, group[op.stage]
        if op.kind == OpKind.FB:  # its residuals are the fused program's own; it keeps the stash for W
            peak[g] = max(peak[g], held[g] + size[k])
            held[g] += kept[k] if k in split else 0.0
        elif op.kind == OpKind.F:
            held[g] += size[k]
            peak[g] = max(peak[g], held[g])
        elif op.kind == OpKind.B and k in split:
            held[g] += kept[k]
            peak[g] = max(peak[g], held[g])
        elif op.kind == (OpKind.W if k in split else OpKind.B):
            held[g] -= (0.0 if k == num_virtual - 1 else size[k]) + (kept[k] if k in split else 0.0)
    return peak


@functools.lru_cache(maxsize=256)
def charged_in_flight(schedule: str, num_groups: int, num_microbatches: int, chunks: int = 1) -> np.ndarray:
    """Per virtual stage, the micro-batches of residuals it holds at its peak in the issue order
    (`residuals_in_flight`), at least one; the last stage's fused forward + backward holds one, transiently
    (under a zero-bubble schedule its deferred weight passes hold their stash, not the residuals:
    `deferred_in_flight`). Read-only (cached)."""
    out = np.maximum(residuals_in_flight(issue_order(schedule, num_groups, num_microbatches, chunks)), 1)
    out[-1] = 1
    out.flags.writeable = False
    return out


def _key_view_microbatches(schedule: str, num_groups: int, num_microbatches: int) -> int:
    """Micro-batches whose order gives the tuner's per-group view: ZB-V's peaks are its first ``4 S`` micro-batches'
    (its residuals in flight are ``S`` whole micro-batches per group from ``G = 2 S`` on; its stashes peak there on
    the most-loaded group, within one micro-batch's on the first groups: `tests/test_zero_bubble.py`), so longer
    steps are not simulated for each key; `predict` runs the whole order."""
    return min(num_microbatches, 4 * num_groups) if schedule in V_SHAPED else num_microbatches


@functools.lru_cache(maxsize=256)
def group_in_flight(schedule: str, num_groups: int, num_microbatches: int, chunks: int = 1) -> np.ndarray:
    """Per device group, whole-group micro-batches of residuals held at its peak when each of its ``chunks``
    chunks holds an equal share of the group's layers (`group_residual_peaks` / ``chunks``; the tuner's view of
    an interleaved key): `charged_in_flight` with one chunk. Read-only (cached)."""
    peaks = [group_residual_peaks(issue, num_groups, schedule=schedule) / chunks
             for issue in _view_issues(schedule, num_groups, num_microbatches, chunks)]
    out = np.max(peaks, axis=0)
    out.flags.writeable = False
    return out


def _view_issues(schedule: str, num_groups: int, num_microbatches: int, chunks: int) -> list[list[Op]]:
    """The orders whose peaks give the tuner's view of a key: the issue order of its first
    `_key_view_microbatches`; for a longer ZB-V step each order it may run (`_zbv_candidates`: which one runs
    depends on the step's length), so that the view charges the larger of their peaks."""
    view = _key_view_microbatches(schedule, num_groups, num_microbatches)
    if schedule in V_SHAPED and view < num_microbatches:
        return [issue for issue, _ in _zbv_candidates(num_groups, view)]
    return [issue_order(schedule, num_groups, view, chunks)]


@functools.lru_cache(maxsize=256)
def charged_deferred(schedule: str, num_groups: int, num_microbatches: int, chunks: int = 1) -> np.ndarray:
    """Per virtual stage, the deferred weight passes whose stash it holds at its peak (`deferred_in_flight`),
    none on the first stage, whose W is its whole backward (its residuals stay counted in flight until then, and
    it keeps no stash); zero outside zero-bubble schedules. Read-only (cached)."""
    if schedule not in ZERO_BUBBLE:
        out = np.zeros(num_groups * chunks, np.int64)
    else:
        out = deferred_in_flight(issue_order(schedule, num_groups, num_microbatches, chunks))
        out[0] = 0
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=256)
def group_deferred(schedule: str, num_groups: int, num_microbatches: int, chunks: int = 1) -> np.ndarray:
    """Per device group, whole-group weight-pass stashes held at its peak when each chunk's stash is an equal
    share of the group's (the tuner's view of a key, as `group_in_flight` for residuals): `charged_deferred`
    with one chunk. Read-only (cached)."""
    if chunks == 1:
        return charged_deferred(schedule, num_groups, num_microbatches)
    stash = np.where(np.arange(num_groups * chunks) == 0, 0.0, 1.0 / chunks)
    out = np.max([group_residual_peaks(issue, num_groups, 0.0, stash, schedule)
                  for issue in _view_issues(schedule, num_groups, num_microbatches, chunks)], axis=0)
    out.flags.writeable = False
    return out


def op_costs(schedule: str, fwd: ArrayLike, bwd: ArrayLike, wgrad: ArrayLike = 0.0) -> dict[str, np.ndarray]:
    """Seconds of each kind of operation per virtual stage, from each stage's forward / backward seconds of one
    micro-batch. Under a zero-bubble schedule B is the backward less its weight-gradient part ``wgrad`` and W
    that part; the first stage's B only receives the cotangent (its W runs the whole backward)."""
    fwd = np.atleast_1d(np.asarray(fwd, np.float64))
    bwd = np.broadcast_to(np.asarray(bwd, np.float64), fwd.shape)
    if schedule not in ZERO_BUBBLE:
        return {OpKind.F: fwd, OpKind.B: bwd, OpKind.FB: fwd + bwd}
    w = np.minimum(np.broadcast_to(np.asarray(wgrad, np.float64), fwd.shape), bwd)
    w = np.where(np.arange(fwd.size) == 0, bwd, w)
    return {OpKind.F: fwd, OpKind.B: bwd - w, OpKind.FB: fwd + bwd - w, OpKind.W: w}


def op_spans(issue: Sequence[Op], num_groups: int, cost: Mapping[str, OpCost] | None = None,
             schedule: str = "1f1b") -> dict[Op, tuple[float, float]]:
    """(start, end) seconds of every operation, each device group running its operations in issue order
    as soon as its inputs arrive. ``cost[kind]`` is a scalar or a per-virtual-stage sequence of seconds,
    or a callable ``cost[kind](op) -> seconds``; ``schedule`` places the virtual stages on the groups."""
    cost = cost or NOMINAL_COST
    num_virtual = 1 + max(op.stage for op in issue)
    per_stage = {kind: c if callable(c) else np.broadcast_to(np.asarray(c, dtype=np.float64), (num_virtual,))
                 for kind, c in cost.items()}
    spans: dict[Op, tuple[float, float]] = {}
    free = [0.0] * num_groups
    group = _groups(issue, num_groups, schedule)
    for op in issue:
        g = group[op.stage]
        start = max([free[g], *(spans[d][1] for d in dependencies(op, num_virtual))])
        c = per_stage[op.kind]
        free[g] = start + float(c(op) if callable(c) else c[op.stage])
        spans[op] = (start, free[g])
    return spans


def group_finish_times(issue: Sequence[Op], num_groups: int, cost: Mapping[str, OpCost] | None = None,
                       schedule: str = "1f1b") -> np.ndarray:
    """When each device group finishes its last operation (`op_spans`)."""
    finish = np.zeros(num_groups)
    group = _groups(issue, num_groups, schedule)
    for op, (_, end) in op_spans(issue, num_groups, cost, schedule).items():
        finish[group[op.stage]] = max(finish[group[op.stage]], end)
    return finish


def simulated_time(issue: Sequence[Op], num_groups: int, cost: Mapping[str, OpCost] | None = None,
                   schedule: str = "1f1b") -> float:
    """Makespan of the issue order (`group_finish_times`)."""
    return float(group_finish_times(issue, num_groups, cost, schedule).max())


__all__ = ["MPMD_SCHEDULES", "Op", "OpCost", "OpKind", "ScheduleError", "ZERO_BUBBLE", "charged_deferred",
           "charged_in_flight", "group_deferred",
           "deferred_in_flight", "dependencies", "dependency_depth", "device_orders", "group_finish_times",
           "group_in_flight", "group_queues", "group_residual_peaks", "issue_order", "list_schedule", "op_costs",
           "op_spans", "residuals_in_flight", "simulated_time", "zero_bubble_orders", "zero_bubble_v_issue",
           "zero_bubble_v_orders"]
