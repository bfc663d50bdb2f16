"""Host-side pipeline schedules for the MPMD executor: per-device op orders and one issue order.

The MPMD executor (`mistjax.runtime.mpmd`) runs one program per (stage, phase) on each stage's own
devices and relies on JAX's asynchronous dispatch: the host issues every operation of a step in one
sequence, and each device group executes its own operations in that sequence's order. So the issue
order must (a) list each device group's operations in the order the schedule gives that group, and
(b) put an operation after the operations it reads from; then no device waits for anything but real
data. Issuing stage by stage satisfies (b) but serialises the pipeline (stage 1's first forward would
sit behind all of stage 0's work in the host's queue). `list_schedule` merges the per-group orders by
simulating the pipeline with nominal op costs and issuing operations in order of simulated start time
(a list scheduler): a topological order of the dependency graph that mirrors how the devices run.

Operations (`Op`): ``F(k, i)`` forward of micro-batch ``i`` on virtual stage ``k`` (input activation ->
output activation + saved residuals), ``B(k, i)`` its backward (output cotangent -> input cotangent,
weight gradients added into the stage's accumulator), and ``FB(K-1, i)`` on the last virtual stage,
which runs forward, loss and backward of a micro-batch in one program (its backward needs nothing but
its own forward, so it never keeps residuals or the head's logits).

Schedules (`device_orders`):

* ``gpipe``: every forward, then every backward.
* ``1f1b`` with one chunk per device group: classic 1F1B (PipeDream-flush): group ``s`` runs
  ``min(S - s - 1, G)`` warm-up forwards, then one forward / one backward, then cools down; at most
  ``min(S - s, G)`` micro-batches in flight.
* ``1f1b`` with ``v > 1`` chunks per device group: Megatron-LM's interleaved 1F1B. Virtual stage ``k``
  lives on group ``k % S``; warm-up ``2 (S - s - 1) + (v - 1) S`` forwards; micro-batches advance in
  groups of ``S`` per chunk (so ``G`` must be a multiple of ``S``).
* ``1f1b-eager``: each group's order from the eager table of `mistjax.core.schedules` (forward
  ``i`` at tick ``i + s``, backward at ``i + 2S - 2 - s``); up to ``2 (S - s) - 1`` in flight.

Nothing here waits on a tick: the only edges are data dependencies and each group's own order
(`dependency_depth` measures the longest chains; classic 1F1B has ``G + S - 1`` forward and ``G + S - 1``
backward operations on its longest chains, where a lock-step executor adds a barrier every tick).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

MPMD_SCHEDULES = ("1f1b", "gpipe", "1f1b-eager")
# Nominal costs of the list scheduler's simulation (backward = 2 x forward, as without remat); only
# the order of simulated start times matters, so any positive costs give a valid issue order.
NOMINAL_COST = {"F": 1.0, "B": 2.0, "FB": 3.0}


class ScheduleError(ValueError):
    """A schedule cannot run: unknown name, bad sizes, or an order that deadlocks."""


class Op(NamedTuple):
    """One pipeline operation: ``kind`` F / B / FB on virtual stage ``stage`` for micro-batch ``mb``."""

    kind: str
    stage: int
    mb: int


def _check(num_groups: int, chunks: int, num_microbatches: int, schedule: str) -> None:
    if schedule not in MPMD_SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}: use one of {MPMD_SCHEDULES}")
    if num_groups < 1 or chunks < 1 or num_microbatches < 1:
        raise ScheduleError(f"need at least one device group, chunk and micro-batch, got S={num_groups}, "
                            f"v={chunks}, G={num_microbatches}")
    if chunks > 1 and schedule == "1f1b-eager":
        raise ScheduleError("1f1b-eager has no interleaved form; use schedule 1f1b (Megatron's interleaved "
                            "1F1B) or gpipe with virtual_stages > 1")
    if chunks > 1 and schedule == "1f1b" and num_microbatches % num_groups:
        raise ScheduleError(f"interleaved 1F1B advances micro-batches in groups of the {num_groups} device "
                            f"groups, so grad_accum={num_microbatches} must be a multiple of {num_groups}")


def _classic(s: int, S: int, G: int) -> list[tuple[str, int]]:
    warm = min(S - s - 1, G)
    ops = [("F", i) for i in range(warm)]
    for k in range(G - warm):
        ops += [("F", warm + k), ("B", k)]
    return ops + [("B", i) for i in range(G - warm, G)]


def _eager(s: int, S: int, G: int) -> list[tuple[str, int]]:
    # One forward and one backward per tick; forwards first within a tick.
    timed = [(i + s, 0, "F", i) for i in range(G)] + [(i + 2 * S - 2 - s, 1, "B", i) for i in range(G)]
    return [(kind, i) for _, _, kind, i in sorted(timed)]


def _interleaved(d: int, S: int, v: int, G: int) -> list[tuple[str, int, int]]:
    """Megatron's order for device group ``d``: (kind, chunk, micro-batch) triples."""
    total = v * G

    def chunk(j: int, forward: bool) -> int:
        c = (j % (S * v)) // S
        return c if forward else v - 1 - c

    def mb(j: int) -> int:
        return (j // (S * v)) * S + j % S

    warm = total if G == S else min((S - d - 1) * 2 + (v - 1) * S, total)
    ops = [("F", chunk(j, True), mb(j)) for j in range(warm)]
    for j in range(total - warm):
        ops += [("F", chunk(warm + j, True), mb(warm + j)), ("B", chunk(j, False), mb(j))]
    return ops + [("B", chunk(j, False), mb(j)) for j in range(total - warm, total)]


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
    last = S * v - 1
    orders: list[list[Op]] = []
    for d in range(S):
        if schedule == "gpipe":
            raw = [("F", c, i) for c in range(v) for i in range(G)]
            raw += [("B", c, i) for c in reversed(range(v)) for i in range(G)]
        elif schedule == "1f1b-eager":
            raw = [(kind, 0, i) for kind, i in _eager(d, S, G)]
        elif v == 1:
            raw = [(kind, 0, i) for kind, i in _classic(d, S, G)]
        else:
            raw = _interleaved(d, S, v, G)
        ops = []
        for kind, c, i in raw:
            k = c * S + d
            if k == last:
                if kind == "F":
                    ops.append(Op("FB", k, i))
                continue
            ops.append(Op(kind, k, i))
        orders.append(ops)
    return orders


def dependencies(op: Op, num_virtual: int) -> list[Op]:
    """The operations whose outputs `op` reads (activation, cotangent, its own residuals)."""
    kind, k, i = op
    last = num_virtual - 1
    if kind == "F":
        return [Op("F", k - 1, i)] if k > 0 else []
    if kind == "FB":
        return [Op("F", k - 1, i)] if k > 0 else []
    return [Op("F", k, i), Op("FB" if k + 1 == last else "B", k + 1, i)]


def list_schedule(orders: Sequence[Sequence[Op]], cost: dict[str, float] | None = None) -> list[Op]:
    """Merge per-group orders into one issue order by simulated start time (see module docstring).

    Raises:
      ScheduleError: if the orders deadlock (an operation waits for one that its group runs later).
    """
    cost = cost or NOMINAL_COST
    num_virtual = 1 + max(op.stage for ops in orders for op in ops)
    group_of = {op: g for g, ops in enumerate(orders) for op in ops}
    finish: dict[Op, float] = {}
    free = [0.0] * len(orders)
    pos = [0] * len(orders)
    issue: list[Op] = []
    total = sum(len(o) for o in orders)
    while len(issue) < total:
        ready = []
        for g, ops in enumerate(orders):
            if pos[g] == len(ops):
                continue
            op = ops[pos[g]]
            deps = dependencies(op, num_virtual)
            for dep in deps:
                if dep not in group_of:
                    raise ScheduleError(f"{op} depends on {dep}, which no device group runs")
            if all(dep in finish for dep in deps):
                ready.append((max([free[g], *(finish[dep] for dep in deps)]), g, op))
        if not ready:
            stuck = [orders[g][pos[g]] for g in range(len(orders)) if pos[g] < len(orders[g])]
            raise ScheduleError(f"the schedule deadlocks: every device group waits ({stuck})")
        start, g, op = min(ready)
        finish[op] = start + cost[op.kind]
        free[g] = finish[op]
        pos[g] += 1
        issue.append(op)
    return issue


def group_queues(issue: Sequence[Op], num_groups: int) -> list[list[Op]]:
    """Each device group's queue: the issue order restricted to its operations."""
    queues: list[list[Op]] = [[] for _ in range(num_groups)]
    for op in issue:
        queues[op.stage % num_groups].append(op)
    return queues


def dependency_depth(issue: Sequence[Op], num_groups: int) -> dict[str, int]:
    """Longest chains of the issue order's dependency graph (data edges + each group's queue order).

    Returns ``{"forward": n, "backward": m}``: the most forward (F, FB) and backward (B, FB) operations
    on one chain. There are no other edges: no operation waits for a tick or a barrier.
    """
    num_virtual = 1 + max(op.stage for op in issue)
    prev: dict[Op, Op] = {}
    for queue in group_queues(issue, num_groups):
        for a, b in zip(queue, queue[1:]):
            prev[b] = a
    out = {}
    for name, kinds in (("forward", {"F", "FB"}), ("backward", {"B", "FB"})):
        depth: dict[Op, int] = {}
        for op in issue:
            preds = [*dependencies(op, num_virtual), *([prev[op]] if op in prev else [])]
            depth[op] = (op.kind in kinds) + max((depth[p] for p in preds), default=0)
        out[name] = max(depth.values())
    return out


def residuals_in_flight(issue: Sequence[Op]) -> np.ndarray:
    """Per virtual stage, the most micro-batches whose residuals are held at once (F issued, B not yet)."""
    num_virtual = 1 + max(op.stage for op in issue)
    live = np.zeros(num_virtual, np.int64)
    peak = np.zeros(num_virtual, np.int64)
    for op in issue:
        if op.kind == "F":
            live[op.stage] += 1
            peak[op.stage] = max(peak[op.stage], live[op.stage])
        elif op.kind == "B":
            live[op.stage] -= 1
    return peak


def issue_order(schedule: str, num_groups: int, num_microbatches: int, chunks: int = 1) -> list[Op]:
    """The host's issue order for one step of `schedule` (`device_orders` merged by `list_schedule`)."""
    return list_schedule(device_orders(schedule, num_groups, num_microbatches, chunks))


def simulated_time(issue: Sequence[Op], num_groups: int, cost: dict[str, float] | None = None) -> float:
    """Makespan of the issue order when every group runs its queue as soon as data arrives."""
    cost = cost or NOMINAL_COST
    num_virtual = 1 + max(op.stage for op in issue)
    finish: dict[Op, float] = {}
    free = [0.0] * num_groups
    for op in issue:
        g = op.stage % num_groups
        start = max([free[g], *(finish[d] for d in dependencies(op, num_virtual))])
        finish[op] = free[g] = start + cost[op.kind]
    return max(finish.values())


__all__ = ["MPMD_SCHEDULES", "Op", "ScheduleError", "dependencies", "dependency_depth", "device_orders",
           "group_queues", "issue_order", "list_schedule", "residuals_in_flight", "simulated_time"]
