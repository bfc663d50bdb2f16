"""Read what a compiled program really does: its collectives (with loop trips) and its memory.

One reader for tests, benchmarks, the cost-model checks and the GPU-AOT verification. A collective
inside a ``while`` body runs once per iteration: `collectives` reports each instruction with the trips
of the loops around it (XLA's ``known_trip_count``; every branch of a conditional counted as if taken,
an upper bound), and `collective_bytes` sums them statically (each instruction once) or as executed.
"""

from __future__ import annotations

import enum
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:  # annotations only: reading HLO text needs no JAX
    from jax.stages import Compiled

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8}


class CollectiveOp(enum.StrEnum):
    """A collective by its HLO opcode. A `str` enum: equal to, hashed and formatted as its HLO spelling."""

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    COLLECTIVE_PERMUTE = "collective-permute"
    ALL_TO_ALL = "all-to-all"


OPS: tuple[str, ...] = tuple(op.value for op in CollectiveOp)  # the HLO spellings, in the enum's order
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s+(?P<op>" + "|".join(OPS) +
                    r")(?P<start>-start)?\((?P<rest>.*)$")
_TOKEN = re.compile(r"\(|\)|(pred|bf16|[subfc]\d+)\[([\d,]*)\](?:\{[^}]*\})?")
_COMMENT = re.compile(r"/\*.*?\*/")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# Replica groups as XLA prints them: explicit ``{{0,1},{2,3}}``, iota ``[2,2]<=[4]T(1,0)``, or (for
# collectives GSPMD/Shardy emit) mesh axes ``mesh['a'=2,'b'=4](, device_ids=(...))? {'b'}``.
_GROUPS = re.compile(r"replica_groups=(\{\{[\d,]*\}(?:,\{[\d,]*\})*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                     r"|mesh\[[^\]]*\](?:, device_ids=\([^)]*\))? \{[^}]*\})")
_MESH_AXIS = re.compile(r"'?([\w.\-]+?)'?=(\d+)")
_GROUP_AXIS = re.compile(r"'?([\w.\-]+?)'?(?::\((\d+)\)(\d+))?$")
_WHILE = re.compile(r"\swhile\(.*?body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
                       r"false_computation=%?([\w.\-]+))")
_CALLS = re.compile(r"\s(?:call|async-start)\(.*?to_apply=%?([\w.\-]+)")

# An HLO type: an array (dtype, bytes) or a tuple of types.
HloType: TypeAlias = "tuple[str, int] | list[HloType]"


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled HLO module."""

    op: CollectiveOp
    result_bytes: int  # bytes of its per-device result (a combined collective's results summed)
    dtype: str  # element type of the (last) result
    group_size: int  # devices per replica group (2 for a permute pair)
    groups: str  # the replica groups as printed ("" when none are printed)
    computation: str  # the HLO computation holding it
    trips: int = 1  # executions per step (product of the known trip counts of the loops around it)
    is_async: bool = False  # issued as a ``-start`` / ``-done`` pair (it may overlap compute)


def parse_type(text: str) -> HloType:
    """The type of an HLO value as nested lists of ``(dtype, bytes)`` arrays."""
    stack: list[list[HloType]] = [[]]
    for m in _TOKEN.finditer(_COMMENT.sub("", text)):
        if m.group(0) == "(":
            stack.append([])
        elif m.group(0) == ")":
            inner = stack.pop()
            stack[-1].append(inner)
        else:
            n = 1
            for d in filter(None, m.group(2).split(",")):
                n *= int(d)
            stack[-1].append((m.group(1), n * _DTYPE_BYTES.get(m.group(1), 4)))
    top = stack[0]
    return top[0] if len(top) == 1 else top


def _arrays(t: HloType) -> list[tuple[str, int]]:
    return [t] if isinstance(t, tuple) else [a for x in t for a in _arrays(x)]


def shape_bytes(text: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of every array type in an HLO type string (tuple types give several)."""
    return _arrays(parse_type(text))


def result_arrays(op: str, type_text: str, is_async: bool) -> list[tuple[str, int]]:
    """The arrays a collective produces: its whole type, or for an async ``-start`` what XLA:GPU prints
    as its results: an all-reduce-start is typed as its result(s); an all-gather / reduce-scatter /
    collective-permute start as ``(operand(s), result(s), ...)``, whose second entry is the result."""
    t = parse_type(type_text)
    if is_async and op != CollectiveOp.ALL_REDUCE and isinstance(t, list) and len(t) > 1:
        t = t[1]
    return _arrays(t)


def replica_group_size(text: str) -> int:
    """Devices per replica group of the collective whose operands/attributes are `text` (2 for a permute)."""
    g = _GROUPS.search(text)
    if not g:
        return 2
    groups = g.group(1)
    if groups.startswith("{{"):
        return len(groups[2:].split("}")[0].split(","))
    if groups.startswith("mesh"):
        return _mesh_group_size(groups)
    return int(groups[1:].split("]")[0].split(",")[-1])


def _mesh_group_size(groups: str) -> int:
    """Devices per group of a mesh-axes replica group: the product of the grouped axes' sizes
    (a sub-axis ``'a':(pre)size`` counts ``size``)."""
    mesh, grouped = groups[len("mesh["):].split("]", 1)
    sizes = {name: int(n) for name, n in _MESH_AXIS.findall(mesh)}
    total = 1
    for ref in filter(None, (a.strip() for a in grouped[grouped.rindex("{") + 1:].rstrip("}").split(","))):
        m = _GROUP_AXIS.match(ref)
        if m is None:
            raise ValueError(f"cannot read replica-group axis {ref!r} in {groups!r}")
        total *= int(m.group(3)) if m.group(3) else sizes[m.group(1)]
    return total


def _computation_head(line: str) -> re.Match[str] | None:
    return _COMP_HEAD.match(line) if not line.startswith(" ") else None


def computation_trips(hlo_text: str) -> dict[str, int]:
    """Executions per step of every computation reachable from the entry through while / call /
    conditional (fusions and reducers are not followed: they hold no collectives)."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    entry, comp = None, None
    for line in hlo_text.splitlines():
        h = _computation_head(line)
        if h:
            comp = h.group(2)
            entry = comp if h.group(1) else entry
            continue
        if comp is None:
            continue
        if w := _WHILE.search(line):
            t = _TRIP.search(line)
            calls[comp].append((w.group(1), int(t.group(1)) if t else 1))
        elif (b := _BRANCHES.search(line)) and " conditional(" in line:
            names = [n.strip().lstrip("%") for n in (b.group(1) or "").split(",") if n.strip()]
            calls[comp].extend((n, 1) for n in names + [n for n in (b.group(2), b.group(3)) if n])
        elif c := _CALLS.search(line):
            calls[comp].append((c.group(1), 1))
    if entry is None:
        return {}
    trips: dict[str, int] = defaultdict(int)

    def visit(name: str, mult: int, depth: int = 0) -> None:
        trips[name] += mult
        if depth < 64:
            for callee, n in calls.get(name, ()):
                visit(callee, mult * n, depth + 1)

    visit(entry, 1)
    return dict(trips)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled HLO text (``compiled.as_text()``), with its trips per step."""
    trips = computation_trips(hlo_text)
    out, comp = [], ""
    for line in hlo_text.splitlines():
        if h := _computation_head(line):
            comp = h.group(2)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        arrays = result_arrays(m["op"], m["type"], bool(m["start"]))
        if not arrays:
            continue
        g = _GROUPS.search(m["rest"])
        out.append(Collective(op=CollectiveOp(m["op"]), result_bytes=sum(b for _, b in arrays), dtype=arrays[-1][0],
                              group_size=replica_group_size(m["rest"]), groups=g.group(1) if g else "",
                              computation=comp, trips=trips.get(comp, 1), is_async=bool(m["start"])))
    return out


def collective_bytes(hlo_text: str, *, executed: bool = False) -> dict[str, int]:
    """Result bytes per device by collective kind: each instruction once, or times its loop trips."""
    totals: dict[str, int] = defaultdict(int)
    for c in collectives(hlo_text):
        totals[c.op] += c.result_bytes * (c.trips if executed else 1)
    return dict(totals)


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


@dataclass(frozen=True)
class AsyncCollective:
    """One async collective of a scheduled (GPU) HLO module: its ``-start`` and what runs before its ``-done``."""

    op: CollectiveOp
    name: str  # the -start instruction's name
    computation: str  # the computation holding the pair (a while body runs once per iteration)
    done: bool  # a matching -done was found in the same computation
    compute_between: int  # compute instructions (fusions, custom calls, dots, ...) scheduled between start and done
    matmuls_between: int = 0  # of those, matmuls (dots, Triton / cuBLAS GEMMs): another layer's backward, in a loop


# Device platforms (``jax.Device.platform``) whose XLA backend runs collectives asynchronously: ``-start`` /
# ``-done`` pairs that its latency-hiding scheduler moves other compute between (XLA:CPU runs them inline).
ASYNC_COLLECTIVE_PLATFORMS = frozenset({"gpu", "cuda", "rocm", "tpu"})

# Instructions that only move or name data; everything else between a start and its done is compute.
_NON_COMPUTE = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-start", "copy-done",
                "opt-barrier", "after-all", "partition-id", "replica-id")
_ANY_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_DONE_OPERAND = re.compile(r"^%?([\w.\-]+)")
# A GEMM fusion's backend kind (__triton_gemm, __triton_nested_gemm_fusion, __cublas...) or a cuBLAS /
# cuDNN custom call's target: in the instruction's own attributes, never in an operand's name.
_MATMUL = re.compile(r'"kind":"__(?:triton\w*gemm|cublas)|custom_call_target="__(?:cublas|cudnn\$conv)')


def _is_matmul(opcode: str, line: str) -> bool:
    return opcode in ("dot", "convolution") or (opcode in ("fusion", "custom-call") and bool(_MATMUL.search(line)))


def async_collectives(hlo_text: str) -> list[AsyncCollective]:
    """Every async collective (``-start`` / ``-done`` pair) of a scheduled HLO module, in schedule order.

    XLA:GPU splits collectives into ``-start`` / ``-done``; the latency-hiding scheduler places compute
    between them when it can overlap. ``compute_between == 0`` means the pair runs as if synchronous.
    """
    out: list[AsyncCollective] = []
    comp = ""
    open_: dict[str, tuple[str, int]] = {}  # start name -> (op, index into `out`)
    seq: list[tuple[str, bool]] = []  # (opcode, is a matmul) of the current computation, in order
    starts_at: dict[str, int] = {}
    for line in hlo_text.splitlines():
        h = _computation_head(line)
        if h:
            comp, seq, open_, starts_at = h.group(2), [], {}, {}
            continue
        m = _ANY_INSTR.match(line)
        if not m:
            continue
        name, opcode, rest = m.group(1), m.group(3), m.group(4)
        base = opcode.removesuffix("-start").removesuffix("-done")
        if opcode.endswith("-start") and base in OPS:
            open_[name] = (base, len(out))
            starts_at[name] = len(seq)
            out.append(AsyncCollective(CollectiveOp(base), name, comp, False, 0))
        elif opcode.endswith("-done") and base in OPS:
            d = _DONE_OPERAND.match(rest)
            start = d.group(1) if d else ""
            if start in open_:
                _, i = open_.pop(start)
                between = [mm for op, mm in seq[starts_at[start] + 1:] if op not in _NON_COMPUTE
                           and not op.endswith(("-start", "-done"))]
                out[i] = AsyncCollective(out[i].op, start, comp, True, len(between), sum(between))
        seq.append((opcode, _is_matmul(opcode, line)))
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
        h = _computation_head(line)
        if h:
            comp = h.group(2)
            continue
        m = _ANY_INSTR.match(line)
        if not m:
            continue
        rest = m.group(4)
        close = rest.find(")")
        args, attrs = (rest[:close], rest[close + 1:]) if close >= 0 else (rest, "")
        op = _OP_NAME.search(attrs)
        out[m.group(1)] = HloInstruction(m.group(1), _COMMENT.sub("", m.group(2)), m.group(3), comp,
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


def memory_stats(compiled: Compiled) -> dict[str, int]:
    """Per-device bytes from ``compiled.memory_analysis()``; ``peak`` = argument + output + temp - alias.

    (On CPU ``peak_memory_in_bytes`` leaves temporaries out, so the sum is the honest figure.)
    """
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError("memory_stats: this backend's compiled executable has no memory analysis; "
                           "run on XLA:CPU or XLA:GPU")
    stats = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
             "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes}
    stats["peak"] = stats["argument"] + stats["output"] + stats["temp"] - stats["alias"]
    return stats


def host_placed_params(hlo_text: str) -> int:
    """How many entry parameters the compiled program keeps in host memory (layout ``S(5)``)."""
    header = hlo_text.splitlines()[0] if hlo_text else ""
    start = header.find("entry_computation_layout={(")
    if start < 0:
        return 0
    inputs = header[start: header.find(")->", start)]
    return inputs.count("S(5)")


__all__ = ["ASYNC_COLLECTIVE_PLATFORMS", "OPS", "AsyncCollective", "Collective", "CollectiveOp", "HloInstruction",
           "async_collectives", "collective_bytes", "collectives", "computation_trips", "host_placed_params",
           "instructions", "memory_stats", "parse_type", "replica_group_size", "result_arrays", "shape_bytes",
           "tuple_element"]
