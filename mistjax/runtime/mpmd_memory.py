"""What lives on a pipeline stage's devices between its programs, and the stage's peak.

An MPMD plan (`mistjax.runtime.mpmd`) runs one program per (stage, phase); XLA's ``memory_analysis``
of each sees only its own arguments, outputs and temporaries. A stage's peak adds what lives on its
devices between programs and is not an argument of the program running:

    peak(stage) = max over its programs p of [ argument(p) + output(p) + temp(p) - alias(p) + resident(p) ]

``resident(p)``: the stage's state pieces that ``p`` does not take, the gradient accumulators and loss
sums where ``p`` does not take them, and the residuals of the *other* micro-batches in flight (from the
schedule's issue order), and under a zero-bubble schedule the stash of the weight-gradient passes waiting
(`mpmd_split`); with virtual stages, the device group's other chunks add their state,
accumulators and most residuals held (an upper bound). Not counted: activations and cotangents received
and queued for a later program, allocator and library overheads.

The deviceless verifier (`mistjax.validate.gpu_aot_pipeline`) and the runtime's memory check before the
first step (`mistjax.runtime.fit`) both count a stage's peak this way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np

from mistjax.core.hlo import memory_stats
from mistjax.core.pipeline_order import deferred_in_flight, residuals_in_flight
from mistjax.runtime.mpmd_update import Source

if TYPE_CHECKING:  # annotations only: the pipeline imports this module
    from mistjax.runtime.mpmd import MpmdStep


def shard_bytes(aval: jax.ShapeDtypeStruct) -> int:
    """Bytes per device of an abstract array with a sharding."""
    return int(np.prod(aval.sharding.shard_shape(tuple(aval.shape)))) * np.dtype(aval.dtype).itemsize


def program_peak(compiled: jax.stages.Compiled) -> int:
    """Device bytes one compiled program needs: argument + output + temp - alias (``memory_analysis``)."""
    return int(memory_stats(compiled)["peak"])


def residuals_beside(ex: MpmdStep) -> dict[tuple[int, str], int]:
    """Per (stage, F | B | W | FB): the most residual bytes its device group holds beside that program while it
    runs: every micro-batch in flight on each of the group's chunks, the program's own until the program that
    releases it (B; W under a zero-bubble schedule). Per (stage, ``"rest"``): the most the group's other chunks
    hold at once (beside the stage's once-per-step programs). Sums along the group's operations, so chunks
    whose peaks do not coincide are not charged both (`core.pipeline_order.group_residual_peaks`)."""
    res = ex.residual_bytes()
    chunk = [0] * ex.K
    split = {op.stage for op in ex.issue if op.kind == "W"}
    out: dict[tuple[int, str], int] = {}
    for op in ex.issue:
        k = op.stage
        peers = [j for j in range(ex.K) if ex.group[j] == ex.group[k]]
        held = sum(chunk[j] for j in peers)
        if op.kind == "FB":  # the last stage's fused program: its own residuals are its temporaries
            out[(k, "FB")] = max(out.get((k, "FB"), 0), held)
            continue
        releases = op.kind == ("W" if k in split else "B")
        out[(k, op.kind)] = max(out.get((k, op.kind), 0), held - (res[k] if releases else 0))
        chunk[k] += res[k] if op.kind == "F" else -res[k] if releases else 0
        for j in peers:
            out[(j, "rest")] = max(out.get((j, "rest"), 0), sum(chunk[i] for i in peers if i != j))
    return out


def most_in_flight(ex: MpmdStep) -> list[int]:
    """Per stage: the most micro-batches whose residuals it holds at once."""
    return [int(n) for n in residuals_in_flight(ex.issue)]


@dataclass(frozen=True)
class Persistent:
    """What lives on one stage between programs, per device."""

    state: dict[int, int]  # state leaf -> device bytes of its piece (device-placed pieces)
    host: dict[int, int]  # state leaf -> bytes of its host-placed piece
    acc: int  # gradient accumulators + loss sums
    residual: int  # one micro-batch's residuals
    most_in_flight: int
    stash: int = 0  # one deferred weight-gradient pass's stash (zero-bubble schedules)
    most_deferred: int = 0  # the most such passes waiting at once


def persistent(ex: MpmdStep, k: int, in_flight: int) -> Persistent:
    """Stage ``k``'s persistent bytes; host placement from the plan's layouts (not the shardings, which
    compile-only devices drop ``pinned_host`` from)."""
    pr = ex.programs[k]
    pieces = {i: shard_bytes(ex.program.leaves.piece_aval(i, k)) for i in ex.held[k]}
    host = {i for i in pieces if ex.layouts[k][i].host}
    acc = sum(shard_bytes(a) for a, h in zip(pr.acc_avals(), pr.spec.acc_host) if not h)
    acc += sum(shard_bytes(a) for a in (pr.loss_acc_avals() if k == ex.K - 1 else []))
    stash, deferred = 0, 0
    if k in ex.split_programs and k > 0:
        sp = ex.split_programs[k]
        stash = (sp.last() if k == ex.K - 1 else sp.middle()).stash_bytes()
        deferred = int(deferred_in_flight(ex.issue)[k])
    return Persistent({i: b for i, b in pieces.items() if i not in host}, {i: pieces[i] for i in host}, acc,
                      ex.residual_bytes()[k], in_flight, stash, deferred)


def takes(ex: MpmdStep, k: int, phase: str) -> tuple[set[int], bool]:
    """(state leaves the program takes as arguments, whether it takes the accumulators)."""
    params = {ex.param_index[j] for j in ex.programs[k].spec.params}
    if phase in ("forward",):
        return params, False
    if phase in ("backward", "last", "weight_grad", "last_weight"):
        return params, True
    if phase in ("input_grad", "last_input"):
        return params, False
    if phase == "finish":
        return set(), True
    if phase.startswith("update"):
        rnd = ex.rounds[(k, int(phase[len("update"):]))]
        return {g.ref_index for g in rnd.groups if g.source is Source.STATE}, False
    return set(), False  # split, metrics


PIPELINE_PHASES = frozenset({"forward", "backward", "input_grad", "weight_grad", "last_input", "last_weight"})


def resident_parts(ex: MpmdStep, k: int, phase: str, mine: Persistent, others: list[Persistent],
                   flight: dict[tuple[int, str], int]) -> dict[str, int]:
    """Device bytes live on stage ``k``'s devices while ``phase`` runs that are not its arguments."""
    state_in, acc_in = takes(ex, k, phase)
    kind = {"forward": "F", "backward": "B", "input_grad": "B", "weight_grad": "W", "last": "FB"}.get(phase, "rest")
    residuals = max(flight.get((k, kind), 0), flight.get((k, "W"), 0) if phase == "backward" else 0)
    parts = {"state": sum(b for i, b in mine.state.items() if i not in state_in),
             "accumulators": 0 if acc_in else mine.acc, "residuals": residuals,
             # other deferred weight passes' stash while the pipeline runs (an upper bound: W reads its own)
             "stash": mine.most_deferred * mine.stash if phase in PIPELINE_PHASES else 0}
    for o in others:  # the device group's other chunks (virtual stages); their residuals are in ``flight``
        parts["state"] += sum(o.state.values())
        parts["accumulators"] += o.acc
    return parts


def group_peers(ex: MpmdStep, k: int, pers: list[Persistent]) -> list[Persistent]:
    """The persistent bytes of the other chunks on stage ``k``'s device group (virtual stages)."""
    return [pers[j] for j in range(ex.K) if j != k and ex.group[j] == ex.group[k]]


def stage_peaks(ex: MpmdStep, compiled: dict[tuple[int, str], jax.stages.Compiled]) -> dict[int, tuple[int, str]]:
    """Per stage with compiled programs: (its peak bytes per device, the phase at the peak)."""
    flight, most = residuals_beside(ex), most_in_flight(ex)
    pers = [persistent(ex, k, most[k]) for k in range(ex.K)]
    out: dict[int, tuple[int, str]] = {}
    for (k, phase), c in sorted(compiled.items()):
        parts = resident_parts(ex, k, phase, pers[k], group_peers(ex, k, pers), flight)
        peak = program_peak(c) + sum(parts.values())
        if k not in out or peak > out[k][0]:
            out[k] = (peak, phase)
    return out


__all__ = ["Persistent", "group_peers", "most_in_flight", "persistent", "program_peak",
           "resident_parts", "residuals_beside", "shard_bytes", "stage_peaks", "takes"]
