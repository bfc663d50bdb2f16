"""Read what a compiled program really does: collectives in its HLO, its memory analysis.

Used by tests and benchmarks to verify that a plan took effect, and by the cost-model checks.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(_OPS) + r")(?P<start>-start)?\((?P<rest>.*)$", re.M)
_SHAPE = re.compile(r"\b(pred|bf16|[subf]\d+)\[([\d,]*)\]")  # bf16 needs its own branch: "f16" inside it has no \b
# Replica groups as XLA prints them: explicit ``{{0,1},{2,3}}``, iota ``[2,2]<=[4]T(1,0)``, or (for
# collectives GSPMD/Shardy emit) mesh axes ``mesh['a'=2,'b'=4](, device_ids=(...))? {'b'}``.
_GROUPS = re.compile(r"replica_groups=(\{\{[\d,]*\}(?:,\{[\d,]*\})*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                     r"|mesh\[[^\]]*\](?:, device_ids=\([^)]*\))? \{[^}]*\})")
_MESH_AXIS = re.compile(r"'?([\w.\-]+?)'?=(\d+)")
_GROUP_AXIS = re.compile(r"'?([\w.\-]+?)'?(?::\((\d+)\)(\d+))?$")
_COMMENT = re.compile(r"/\*.*?\*/")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", re.M)


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled HLO module."""

    op: str  # all-reduce | all-gather | reduce-scatter | collective-permute | all-to-all
    result_bytes: int  # bytes of the result on one device
    dtype: str  # element type of the result
    group_size: int  # devices per replica group (2 for a permute pair)
    groups: str  # the replica groups as printed
    computation: str  # the HLO computation holding it (a while body runs once per iteration)


def shape_bytes(text: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of every array type in an HLO type string (tuple types give several)."""
    out = []
    for dtype, dims in _SHAPE.findall(_COMMENT.sub("", text)):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append((dtype, n * _DTYPE_BYTES.get(dtype, 4)))
    return out


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


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled HLO text (``compiled.as_text()``)."""
    # Long tuple types carry `/*index=N*/` comments; drop them so a tuple type is one token.
    hlo_text = _COMMENT.sub("", hlo_text)
    # Map each instruction's offset to the computation it belongs to.
    comps = [(m.start(), m.group(1)) for m in _COMPUTATION.finditer(hlo_text)]
    out = []
    for m in _INSTR.finditer(hlo_text):
        shapes = shape_bytes(m["type"])
        if not shapes:
            continue
        dtype, nbytes = shapes[-1] if m["start"] else (shapes[0][0], sum(b for _, b in shapes))
        g = _GROUPS.search(m["rest"])
        groups = g.group(1) if g else ""
        comp = ""
        for start, name in comps:
            if start > m.start():
                break
            comp = name
        out.append(Collective(op=m["op"], result_bytes=nbytes, dtype=dtype, group_size=replica_group_size(m["rest"]),
                              groups=groups, computation=comp))
    return out


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Result bytes per device by collective kind (each instruction counted once)."""
    totals: dict[str, int] = defaultdict(int)
    for c in collectives(hlo_text):
        totals[c.op] += c.result_bytes
    return dict(totals)


def memory_stats(compiled: Any) -> dict[str, int]:
    """Per-device bytes from ``compiled.memory_analysis()``; ``peak`` = argument + output + temp - alias.

    (On CPU ``peak_memory_in_bytes`` leaves temporaries out, so the sum is the honest figure.)
    """
    m = compiled.memory_analysis()
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
