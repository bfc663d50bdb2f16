"""Read a compiled HLO text the way the cost-model checks need it: collectives weighted by loop trips.

`mistjax.runtime.hlo.collectives` lists each collective instruction once. A collective inside a
``while`` body runs once per iteration, and XLA:CPU prints tuple types with ``/*index=5*/``
comments that a simple type regex misses (combined all-reduces of many gradients are such
tuples). This module parses computations, the ``while`` ops calling them (with XLA's
``known_trip_count``) and conditionals, and reports per-kind bytes both *static* (each
instruction once, what the HLO text shows) and *executed* (times the trip counts of the loops
around it; every branch of a conditional counted as if taken, an upper bound).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from mistjax.runtime.hlo import replica_group_size, shape_bytes

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+(" + "|".join(_OPS) +
                    r")(-start)?\(")
_WHILE = re.compile(r"\swhile\(.*?body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
                       r"false_computation=%?([\w.\-]+))")
_CALLS = re.compile(r"\s(?:call|async-start)\(.*?to_apply=%?([\w.\-]+)")


@dataclass(frozen=True)
class HloCollective:
    """One collective instruction with how often it runs per step."""

    op: str  # HLO opcode (all-gather, reduce-scatter, all-reduce, collective-permute, all-to-all)
    result_bytes: int  # bytes of its per-device result (tuple results summed)
    dtype: str  # element type of the (last) result
    group_size: int  # devices per replica group (2 for a permute)
    computation: str  # the computation that holds it
    trips: int  # executions per step (product of the known trip counts of the loops around it)


def computation_trips(hlo_text: str) -> dict[str, int]:
    """Executions per step of every computation reachable from the entry through while / call /
    conditional (fusions and reducers are not followed: they hold no collectives)."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    entry, comp = None, None
    for line in hlo_text.splitlines():
        h = _COMP_HEAD.match(line)
        if h and not line.startswith(" "):
            comp = h.group(2)
            if h.group(1):
                entry = comp
            continue
        if comp is None:
            continue
        w = _WHILE.search(line)
        if w:
            t = _TRIP.search(line)
            calls[comp].append((w.group(1), int(t.group(1)) if t else 1))
            continue
        b = _BRANCHES.search(line)
        if b and " conditional(" in line:
            names = [n.strip().lstrip("%") for n in (b.group(1) or "").split(",") if n.strip()]
            names += [n for n in (b.group(2), b.group(3)) if n]
            calls[comp].extend((n, 1) for n in names)
            continue
        c = _CALLS.search(line)
        if c:
            calls[comp].append((c.group(1), 1))
    trips: dict[str, int] = defaultdict(int)
    if entry is None:
        return {}

    def visit(name: str, mult: int, depth: int = 0) -> None:
        trips[name] += mult
        if depth < 64:
            for callee, n in calls.get(name, ()):
                visit(callee, mult * n, depth + 1)

    visit(entry, 1)
    return dict(trips)


def hlo_collectives(hlo_text: str) -> list[HloCollective]:
    """Every collective of a compiled HLO module, with its computation and trips per step."""
    trips = computation_trips(hlo_text)
    out, comp = [], ""
    for line in hlo_text.splitlines():
        h = _COMP_HEAD.match(line)
        if h and not line.startswith(" "):
            comp = h.group(2)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        shapes = shape_bytes(m.group(2))
        if not shapes:
            continue
        if m.group(4):  # async start: (operand, result, ...) tuple; the result is the second entry
            dtype, nbytes = shapes[1] if len(shapes) > 1 else shapes[0]
        else:
            dtype, nbytes = shapes[-1][0], sum(b for _, b in shapes)
        out.append(HloCollective(op=m.group(3), result_bytes=nbytes, dtype=dtype, group_size=replica_group_size(line),
                                 computation=comp, trips=trips.get(comp, 1)))
    return out


def collective_totals(hlo_text: str, *, executed: bool = True) -> dict[str, int]:
    """Per-kind result bytes per device: times loop trips (``executed``) or each instruction once."""
    totals: dict[str, int] = defaultdict(int)
    for c in hlo_collectives(hlo_text):
        totals[c.op] += c.result_bytes * (c.trips if executed else 1)
    return dict(totals)


__all__ = ["HloCollective", "collective_totals", "computation_trips", "hlo_collectives"]
