"""What is live at a compiled program's memory peak, read from XLA's buffer-assignment dumps.

With ``xla_dump_to`` set, XLA:GPU writes ``*-live-range.txt`` next to the optimised HLO: the buffer
live ranges and, under ``Live ranges at N (peak):``, every value live at the peak of the schedule with
its bytes. `peak_buffers` joins that list with the optimised HLO (`mistjax.core.hlo.instructions`)
so each value gets its shape, the JAX ``op_name`` that made it and a kind: an ``argument`` (an entry
parameter: a state leaf, named by its path, or the batch), a ``loop-carry`` (a ``while`` loop's state,
e.g. gradient accumulators or the stacked residuals of the layer scan; labelled with the value that
initialises it) or a ``temp`` (any other value).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mistjax.core.hlo import HloInstruction, instructions, shape_bytes, tuple_element

_PEAK_HEAD = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_PEAK_ROW = re.compile(r"^\s+([\w.\-]+)\{([\d,]*)\}: (\d+) bytes")
_LAYOUT = re.compile(r"\{[^{}]*\}")
_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.M)


@dataclass(frozen=True)
class LiveBuffer:
    """One value live at the program's memory peak (per device)."""

    value: str  # XLA's value name with its ShapeIndex, e.g. ``while.167{2}``
    nbytes: int  # bytes XLA assigns to it
    shape: str  # its array type without layout, e.g. ``bf16[24,8,2048,2048]``
    kind: str  # argument | loop-carry | temp
    op_name: str  # JAX op_name of the value (state path of an argument; init value of a loop carry)


def find_dump(dump_dir: str | Path, suffix: str) -> Path | None:
    """The (largest) file of ``dump_dir`` whose name ends with ``suffix`` (one module per compile)."""
    files = sorted(Path(dump_dir).glob(f"*{suffix}"), key=lambda p: p.stat().st_size)
    return files[-1] if files else None


def peak_rows(live_range_text: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(instruction, ShapeIndex, bytes) of every value XLA lists as live at the peak."""
    rows, inside = [], False
    for line in live_range_text.splitlines():
        if _PEAK_HEAD.match(line):
            inside = True
            continue
        if inside:
            m = _PEAK_ROW.match(line)
            if not m:
                break
            index = tuple(int(i) for i in m.group(2).split(",") if i)
            rows.append((m.group(1), index, int(m.group(3))))
    return rows


_ALLOCATION = re.compile(r"^allocation (\d+): size \d+")
_VALUE = re.compile(r"^\s*value: <\d+ ([\w.\-]+)(\{[\d,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)")


def buffer_slices(buffer_assignment_text: str) -> dict[str, tuple[int, int]]:
    """Value name (``while.167{2}``) -> (allocation, offset) from XLA's ``*-buffer-assignment.txt``.

    Values that share a slice (a loop's init, its body parameter and its result) are one buffer."""
    out: dict[str, tuple[int, int]] = {}
    alloc = -1
    for line in buffer_assignment_text.splitlines():
        a = _ALLOCATION.match(line)
        if a:
            alloc = int(a.group(1))
            continue
        v = _VALUE.match(line)
        if v and alloc >= 0:
            out.setdefault(f"{v.group(1)}{v.group(2) or '{}'}", (alloc, int(v.group(4))))
    return out


def _callers(table: dict[str, HloInstruction]) -> dict[str, tuple[HloInstruction, int]]:
    """Computation -> (the while / conditional that runs it, which operand feeds its parameter)."""
    out: dict[str, tuple[HloInstruction, int]] = {}
    for ins in table.values():
        if ins.opcode == "while":
            m = re.search(r"body=%?([\w.\-]+)", ins.attrs)
            if m:
                out[m.group(1)] = (ins, 0)
        elif ins.opcode == "conditional":
            m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
            names = [n.strip().lstrip("%") for n in m.group(1).split(",")] if m else re.findall(
                r"(?:true|false)_computation=%?([\w.\-]+)", ins.attrs)
            for i, name in enumerate(names):
                out[name] = (ins, i + 1)  # operand 0 is the predicate / branch index
    return out


def _origin(name: str, index: tuple[int, ...], table: dict[str, HloInstruction],
            callers: dict[str, HloInstruction], depth: int = 0) -> HloInstruction | None:
    """The instruction that produces element ``index`` of ``name``, looking through tuples, while
    loops (to their initial value) and loop-body parameters."""
    ins = table.get(name)
    if ins is None or depth > 32:
        return ins
    if ins.opcode == "tuple" and index:
        if index[0] < len(ins.operands):
            return _origin(ins.operands[index[0]], index[1:], table, callers, depth + 1)
        return ins
    if ins.opcode == "get-tuple-element":
        m = re.search(r"index=(\d+)", ins.attrs)
        if m and ins.operands:
            return _origin(ins.operands[0], (int(m.group(1)), *index), table, callers, depth + 1)
    if ins.opcode == "while" and ins.operands:
        return _origin(ins.operands[0], index, table, callers, depth + 1)
    if ins.opcode == "parameter" and ins.computation in callers:
        caller, operand = callers[ins.computation]
        if operand < len(caller.operands):
            return _origin(caller.operands[operand], index, table, callers, depth + 1)
    return ins


def _strip_layout(type_text: str) -> str:
    return _LAYOUT.sub("", type_text).strip()


def peak_buffers(live_range_text: str, hlo_text: str, buffer_assignment_text: str = "") -> list[LiveBuffer]:
    """Every buffer live at the peak, largest first, with its shape, kind and JAX op_name.

    With the buffer assignment, values sharing one slice are reported once (the most telling of them:
    an argument, else a loop carry, else the first), so the sizes add up to XLA's peak."""
    table = instructions(hlo_text)
    callers = _callers(table)
    entry = _ENTRY.search(hlo_text)
    entry_name = entry.group(1) if entry else None
    entry_params = {n for n, i in table.items() if i.opcode == "parameter" and i.computation == entry_name}
    out = []
    for name, index, nbytes in peak_rows(live_range_text):
        ins = table.get(name)
        shape = _strip_layout(tuple_element(ins.type, index)) if ins else ""
        if ins is not None and ins.opcode == "parameter" and name in entry_params:
            kind, op_name = "argument", ins.op_name
        elif ins is not None and (ins.opcode == "while" or (ins.opcode == "parameter" and ins.computation in callers)):
            origin = _origin(name, index, table, callers)
            kind = "loop-carry"
            if origin is not None and origin.opcode == "parameter" and origin.name in entry_params:
                kind = "argument"  # a state leaf threaded through the loop
            op_name = origin.op_name if origin is not None else ins.op_name
        else:
            kind, op_name = "temp", ins.op_name if ins else ""
        # XLA escapes the quotes of state paths (``state.params[\\'embed\\']``) in op_name metadata.
        out.append(LiveBuffer(f"{name}{{{','.join(map(str, index))}}}", nbytes, shape, kind,
                              op_name.replace("\\'", "'")))
    if buffer_assignment_text:
        out = _one_per_slice(out, buffer_slices(buffer_assignment_text))
    return sorted(out, key=lambda b: -b.nbytes)


def _one_per_slice(bufs: list[LiveBuffer], slices: dict[str, tuple[int, int]]) -> list[LiveBuffer]:
    rank = {"argument": 0, "loop-carry": 1, "temp": 2}
    best: dict[str | tuple[int, int], LiveBuffer] = {}  # by buffer slice, else by value name
    for b in bufs:
        key = slices.get(b.value, b.value)
        if key not in best or (rank[b.kind], not b.op_name) < (rank[best[key].kind], not best[key].op_name):
            best[key] = b
    return list(best.values())


def peak_from_dump(dump_dir: str | Path) -> list[LiveBuffer]:
    """`peak_buffers` of an XLA:GPU or XLA:CPU dump in ``dump_dir`` (empty if XLA wrote no live-range file)."""
    live = find_dump(dump_dir, "after_optimizations-live-range.txt")
    hlo = find_dump(dump_dir, "pu_after_optimizations.txt")  # gpu_ or cpu_; not the -live-range / -buffer files
    assignment = find_dump(dump_dir, "after_optimizations-buffer-assignment.txt")
    if live is None or hlo is None:
        return []
    return peak_buffers(live.read_text(), hlo.read_text(), assignment.read_text() if assignment else "")


def buffer_nbytes(shape: str) -> int:
    """Bytes of an array type string (for checks; XLA's own sizes are in `LiveBuffer.nbytes`)."""
    return sum(b for _, b in shape_bytes(shape))


__all__ = ["LiveBuffer", "buffer_nbytes", "buffer_slices", "find_dump", "peak_buffers", "peak_from_dump",
           "peak_rows"]
