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
_COMMENT_RE = re.compile(r"/\*.*?\*/")
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
        if m.group(4):
            dtype, nbytes = _async_result(m.group(3), m.group(2), shapes)
        else:
            dtype, nbytes = shapes[-1][0], sum(b for _, b in shapes)
        out.append(HloCollective(op=m.group(3), result_bytes=nbytes, dtype=dtype, group_size=replica_group_size(line),
                                 computation=comp, trips=trips.get(comp, 1)))
    return out


def _top_level(type_text: str) -> list[str]:
    """The top-level elements of an HLO tuple type ``(a, (b, c), d)``; a non-tuple type is one element."""
    text = type_text.strip()
    if not text.startswith("("):
        return [text]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                out.append(text[start:i])
        elif ch == "," and depth == 1:
            out.append(text[start:i])
            start = i + 1
    return [e.strip() for e in out if e.strip()]


def _async_result(op: str, type_text: str, shapes: list[tuple[str, int]]) -> tuple[str, int]:
    """(dtype, result bytes) of an async ``-start``, whose type XLA:GPU prints per kind as:
    all-reduce ``result`` or ``(results...)``; all-gather / reduce-scatter ``(operand, result)`` or, combined,
    ``((operands...), (results...))``; collective-permute ``(operand, result, u32[], u32[])``."""
    if op == "all-reduce":
        return shapes[-1][0], sum(b for _, b in shapes)
    parts = _top_level(type_text)
    if len(parts) < 2:
        return shapes[0]
    results = shape_bytes(parts[1])
    return (results[-1][0], sum(b for _, b in results)) if results else shapes[0]


@dataclass(frozen=True)
class AsyncCollective:
    """One async collective of a scheduled (GPU) HLO module: its ``-start`` and what runs before its ``-done``."""

    op: str  # all-reduce | all-gather | reduce-scatter | collective-permute | all-to-all
    name: str  # the -start instruction's name
    computation: str  # the computation holding the pair (a while body runs once per iteration)
    done: bool  # a matching -done was found in the same computation
    compute_between: int  # compute instructions (fusions, custom calls, dots, ...) scheduled between start and done


# Instructions that only move or name data; everything else between a start and its done is compute.
_NON_COMPUTE = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-start", "copy-done",
                "opt-barrier", "after-all", "partition-id", "replica-id")
_ANY_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_DONE_OPERAND = re.compile(r"^%?([\w.\-]+)")


def async_collectives(hlo_text: str) -> list[AsyncCollective]:
    """Every async collective (``-start`` / ``-done`` pair) of a scheduled HLO module, in schedule order.

    XLA:GPU splits collectives into ``-start`` / ``-done``; the latency-hiding scheduler places compute
    between them when it can overlap. ``compute_between == 0`` means the pair runs as if synchronous.
    """
    out: list[AsyncCollective] = []
    comp = ""
    open_: dict[str, tuple[str, int]] = {}  # start name -> (op, index into `out`)
    seq: list[str] = []  # opcodes of the current computation, in order
    starts_at: dict[str, int] = {}
    for line in hlo_text.splitlines():
        h = _COMP_HEAD.match(line)
        if h and not line.startswith(" "):
            comp, seq, open_, starts_at = h.group(2), [], {}, {}
            continue
        m = _ANY_INSTR.match(line)
        if not m:
            continue
        name, opcode, rest = m.group(1), m.group(3), m.group(4)
        base = opcode.removesuffix("-start").removesuffix("-done")
        if opcode.endswith("-start") and base in _OPS:
            open_[name] = (base, len(out))
            starts_at[name] = len(seq)
            out.append(AsyncCollective(base, name, comp, False, 0))
        elif opcode.endswith("-done") and base in _OPS:
            d = _DONE_OPERAND.match(rest)
            start = d.group(1) if d else ""
            if start in open_:
                _, i = open_.pop(start)
                between = sum(1 for op in seq[starts_at[start] + 1:] if op not in _NON_COMPUTE
                              and not op.endswith(("-start", "-done")))
                out[i] = AsyncCollective(out[i].op, start, comp, True, between)
        seq.append(opcode)
    return out


@dataclass(frozen=True)
class HloInstruction:
    """One instruction of an HLO module text, as much as memory reports need."""

    name: str  # instruction name without the leading %
    type: str  # its HLO type, e.g. ``bf16[8,2048]{1,0}`` or a tuple type
    opcode: str  # fusion, parameter, while, tuple, ...
    computation: str  # the computation holding it
    operands: tuple[str, ...]  # operand instruction names, in order
    op_name: str  # the JAX op_name metadata ("" if none); a state path for entry parameters
    attrs: str  # the rest of the line after the operands (body=, calls=, metadata, ...)


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def instructions(hlo_text: str) -> dict[str, HloInstruction]:
    """Every instruction of an HLO module text by name (names are unique within a module)."""
    out: dict[str, HloInstruction] = {}
    comp = ""
    for line in hlo_text.splitlines():
        h = _COMP_HEAD.match(line)
        if h and not line.startswith(" "):
            comp = h.group(2)
            continue
        m = _ANY_INSTR.match(line)
        if not m:
            continue
        rest = m.group(4)
        close = rest.find(")")
        args, attrs = (rest[:close], rest[close + 1:]) if close >= 0 else (rest, "")
        op = _OP_NAME.search(attrs)
        out[m.group(1)] = HloInstruction(m.group(1), _COMMENT_RE.sub("", m.group(2)), m.group(3), comp,
                                         tuple(re.findall(r"%([\w.\-]+)", args)), op.group(1) if op else "", attrs)
    return out


def tuple_element(type_text: str, index: tuple[int, ...]) -> str:
    """The element at ShapeIndex ``index`` of an HLO (tuple) type (``()`` is the type itself)."""
    for i in index:
        parts = _top_level(type_text)
        if i >= len(parts):
            return ""
        type_text = parts[i]
    return type_text


def collective_totals(hlo_text: str, *, executed: bool = True) -> dict[str, int]:
    """Per-kind result bytes per device: times loop trips (``executed``) or each instruction once."""
    totals: dict[str, int] = defaultdict(int)
    for c in hlo_collectives(hlo_text):
        totals[c.op] += c.result_bytes * (c.trips if executed else 1)
    return dict(totals)


__all__ = ["AsyncCollective", "HloCollective", "HloInstruction", "async_collectives", "collective_totals",
           "computation_trips", "hlo_collectives", "instructions", "tuple_element"]
