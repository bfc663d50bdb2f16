"""The kernels a GPU compiler makes of one traced pass: GEMMs by shape, fusions by the bytes they move.

Hardware-independent: a fusion model over the analysed graph (`Graph` with per-device dims), shaped after
XLA's GPU fusion (and checked against it: `mistjax.validate.kernels`). Rules (docs/cost_model.md,
"Kernels"):

* **GEMMs** (``dot_general``, convolutions) are kernels of their own; each is recorded by its per-device
  ``(batch, m, n, k)`` and the bytes of its operands and result. A ``convert_element_type`` that is a GEMM
  result's only consumer is its epilogue (the GEMM writes the converted dtype).
* **Fused attention** calls (`mistjax.analysis.fused`) are one kernel each.
* **Loops** outside fused attention contribute their body's kernels times the trip count.
* Every other operation is fusible. A value is **materialised** (written to memory once, read by each
  kernel that uses it) when it is a pass input or output (residuals included), the result of a GEMM, a
  reduction, a loop or a scatter / in-place update / sort, or an operand of a GEMM, a fused-attention
  call, a loop or one of those ops. Everything else lives in registers: an elementwise value is computed
  inside each kernel that consumes it (XLA duplicates cheap producers into their consumers).
* A **fusion kernel** computes one materialised value (or a reduction) from its cone of fusible producers;
  it moves its output plus its distinct materialised inputs (a slice, dynamic slice or gather reads only
  what it keeps). Kernels with the same inputs and the same number of output elements are one
  multi-output fusion (inputs read once). Values computed from constants only (masks, iotas) are free.
* **Eager kernels**: a value the model marks as written by an op-by-op runtime (``Graph.eager``, e.g.
  Megatron-LM's PyTorch RMSNorm, rotary and SwiGLU; `models.layers.eager_op`) is materialised as well, and
  its kernel is never merged with a sibling (an eager runtime launches one kernel per op, each reading its
  operands): the chain costs one kernel per op, each moving its operands and its result.

All sizes are exact `Poly` in ``(b, s, 1/t)`` (the graph's fitted dims with the tensor-parallel layouts).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeAlias

import numpy as np
import sympy as sp
from jax.extend import core as jex
from numpy.typing import ArrayLike

from mistjax.analysis.flops import REDUCTIONS, SCATTERS, count_graph
from mistjax.analysis.graph import Graph, Node, constant_nodes, names
from mistjax.analysis.poly import ONE, ZERO, Poly, prod
from mistjax.core.jaxpr import Atom, is_var

GEMM = frozenset({"dot_general", "conv_general_dilated"})
# Views: no data of their own (the value is its operand's buffer, or a broadcast computed in place).
VIEW = names("reshape squeeze expand_dims name copy copy_p optimization_barrier stop_gradient sharding_constraint "
             "mesh_cast reshard pvary pcast bitcast_convert_type reduce_precision device_put")
# Roots: ops XLA runs as kernels of their own whose result is always materialised.
ROOT = names("scatter scatter-add scatter_add scatter-mul scatter_mul scatter-min scatter-max scatter_min "
             "scatter_max dynamic_update_slice sort argsort top_k cumsum cumprod cummax cummin cumlogsumexp "
             "psum all_gather psum_scatter ppermute all_to_all reduce_window reduce_window_sum "
             "select_and_scatter_add select_and_gather_add custom_call") | SCATTERS
SLICING = names("slice dynamic_slice gather")
EPILOGUE = names("convert_element_type transpose reshape squeeze expand_dims copy copy_p")
LOOPS = frozenset({"scan", "while"})

SizeFn = Callable[[jex.Var], Poly]  # bytes of a var on one device
DimsFn = Callable[[Node], tuple[list[tuple[Poly, ...]], list[tuple[Poly, ...]]]]  # per-device (in, out) dims
KernelLog: TypeAlias = list[tuple[str, str, Poly, dict[jex.Var, Poly]]]
"""Fusion kernels as ``(root primitive, result aval, bytes written, {input var: bytes read})``."""


@dataclass(frozen=True)
class Gemm:
    """One matmul kernel (per device), repeated ``count`` times per pass."""

    batch: Poly  # product of the batch dims
    m: Poly  # rows of the result (product of the lhs free dims)
    n: Poly  # columns of the result (product of the rhs free dims)
    k: Poly  # contraction length
    nbytes: Poly  # operands read + result written
    count: Poly = ONE  # executions per pass (loop trips)
    fp8: bool = False  # both operands are 8-bit floats: an FP8 GEMM where the device has fp8 tensor cores

    @property
    def flops(self) -> Poly:
        return 2 * self.batch * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class UnitKernel:
    """The fused-attention calls of a pass, priced as single kernels."""

    count: Poly = ZERO  # calls per pass
    matmul_flops: Poly = ZERO  # their matmul FLOPs (the whole score matrix, masked or not)
    other_flops: Poly = ZERO  # their elementwise and transcendental FLOPs
    nbytes: Poly = ZERO  # q, k, v, o, lse (and dO, dq, dk, dv) read and written
    head_dim: int = 0  # contraction length of the score matmul (0: no unit)
    causal: bool = False  # a masked (causal) kernel: a GPU kernel skips the masked tiles


@dataclass(frozen=True)
class PassKernels:
    """The kernels of one pass (or of a sum of passes), per device, as exact polynomials."""

    gemms: tuple[Gemm, ...] = ()  # matmul kernels by shape
    fusion_bytes: Poly = ZERO  # bytes the fusion kernels read and write
    fusion_count: Poly = ZERO  # fusion kernels launched
    unit: UnitKernel = field(default_factory=UnitKernel)  # fused attention
    plain: PassKernels | None = None  # the same pass with fused attention run as its plain operations

    def as_code(self) -> PassKernels:
        """The pass with fused-attention calls priced as the operations they are made of."""
        return self if self.plain is None else self.plain

    def __add__(self, other: PassKernels) -> PassKernels:
        u, v = self.unit, other.unit
        unit = UnitKernel(u.count + v.count, u.matmul_flops + v.matmul_flops, u.other_flops + v.other_flops,
                          u.nbytes + v.nbytes, max(u.head_dim, v.head_dim), u.causal or v.causal)
        plain = self.as_code() + other.as_code() if self.plain is not None or other.plain is not None else None
        return PassKernels(merge_gemms(self.gemms + other.gemms), self.fusion_bytes + other.fusion_bytes,
                           self.fusion_count + other.fusion_count, unit, plain)

    def scale(self, k: Poly) -> PassKernels:
        u = self.unit
        return PassKernels(tuple(replace(g, count=g.count * k) for g in self.gemms),
                           self.fusion_bytes * k, self.fusion_count * k,
                           UnitKernel(u.count * k, u.matmul_flops * k, u.other_flops * k, u.nbytes * k, u.head_dim,
                                      u.causal), None if self.plain is None else self.plain.scale(k))

    @property
    def gemm_flops(self) -> Poly:
        return sum((g.flops for g in self.gemms), ZERO)

    @property
    def gemm_bytes(self) -> Poly:
        return sum((g.nbytes * g.count for g in self.gemms), ZERO)

    def expressions(self, prefix: str) -> dict[str, sp.Expr]:
        """Flat ``name -> sympy`` of every quantity (GEMMs indexed), for one lambdified function."""
        u = self.unit
        out = {f"{prefix}.fusion_bytes": self.fusion_bytes.to_sympy(), f"{prefix}.fusion_count":
               self.fusion_count.to_sympy(), f"{prefix}.unit_count": u.count.to_sympy(),
               f"{prefix}.unit_matmul_flops": u.matmul_flops.to_sympy(),
               f"{prefix}.unit_other_flops": u.other_flops.to_sympy(), f"{prefix}.unit_bytes": u.nbytes.to_sympy()}
        for i, g in enumerate(self.gemms):
            for name in ("batch", "m", "n", "k", "nbytes", "count"):
                out[f"{prefix}.gemm{i}.{name}"] = getattr(g, name).to_sympy()
            out[f"{prefix}.gemm{i}.fp8"] = sp.Integer(int(g.fp8))
        return out


def merge_gemms(gemms: Iterable[Gemm]) -> tuple[Gemm, ...]:
    """One entry per distinct (batch, m, n, k, bytes, fp8), counts added (order of first appearance)."""
    acc: dict[tuple[Poly | bool, ...], Poly] = {}
    for g in gemms:
        key = (g.batch, g.m, g.n, g.k, g.nbytes, g.fp8)
        acc[key] = acc.get(key, ZERO) + g.count
    return tuple(Gemm(*key[:5], count=c, fp8=key[5]) for key, c in acc.items() if c != ZERO)


def _gemm_dims(n: Node, ins: Sequence[tuple[Poly, ...]], outs: Sequence[tuple[Poly, ...]]
               ) -> tuple[Poly, Poly, Poly, Poly]:
    """(batch, m, n, k) of a dot_general / convolution from its per-device operand and result dims."""
    lhs, rhs = ins[0], ins[1]
    if n.prim == "dot_general":
        (lc, rc), (lb, rb) = n.params["dimension_numbers"]
        batch = prod(lhs[i] for i in lb)
        k = prod(lhs[i] for i in lc)
        m = prod(d for i, d in enumerate(lhs) if i not in lc and i not in lb)
        nn = prod(d for i, d in enumerate(rhs) if i not in rc and i not in rb)
        return batch, m, nn, k
    spec = n.params["dimension_numbers"]
    out_dim = spec.rhs_spec[0]
    k = prod(d for i, d in enumerate(rhs) if i != out_dim)
    nn = rhs[out_dim]
    m = prod(d for i, d in enumerate(outs[0]) if i != spec.out_spec[1])  # batch x output positions
    return ONE, m, nn, k


def _fp8_operands(n: Node) -> bool:
    """Both operands of a GEMM are 8-bit floats (`mistjax.core.fp8`)."""
    def fp8(v: Atom) -> bool:
        dtype = np.dtype(v.aval.dtype)
        return dtype.itemsize == 1 and dtype.name.startswith("float8")
    return all(fp8(v) for v in n.ins[:2])


class _Kernels:
    """Kernels of one graph (one level: loop bodies recurse)."""

    def __init__(self, g: Graph, size: SizeFn, dims: DimsFn, itemsize: Callable[[jex.Var], int],
                 log: KernelLog | None = None, units_as_code: bool = False):
        self.g, self.size, self.dims, self.itemsize, self.log = g, size, dims, itemsize, log
        self.units_as_code = units_as_code
        self.const = constant_nodes(g)
        self.producer: dict[jex.Var, Node] = {}
        self.users: dict[jex.Var, list[Node]] = {}
        for n in g.nodes:
            for v in n.outs:
                if is_var(v):
                    self.producer[v] = n
            for v in n.ins:
                if is_var(v):
                    self.users.setdefault(v, []).append(n)
        self.inputs = set(g.invars) | set(g.constvars)
        # GEMM epilogues: a chain of casts and layout changes, each the only consumer of the last, ends in
        # the value the GEMM writes (cuBLAS / Triton write the converted dtype in the layout asked for).
        self.epilogue: dict[jex.Var, Node] = {}  # epilogue value -> the GEMM it belongs to
        for n in g.nodes:
            if n.prim in GEMM and self._unit(n) is None and is_var(n.outs[0]):
                v = n.outs[0]
                while len(self.users.get(v, ())) == 1:
                    c = self.users[v][0]
                    if (self._unit(c) is not None or c.prim not in EPILOGUE or not is_var(c.outs[0])
                            or c.ins[0] is not v):
                        break
                    v = c.outs[0]
                    self.epilogue[v] = n

    # -- classification --------------------------------------------------------------------------
    def _unit(self, n: Node) -> str | None:
        return None if self.units_as_code else n.unit

    def _free(self, v: Atom) -> bool:
        """A literal or a value computed from constants only (folded / fused by XLA)."""
        if not is_var(v):
            return True
        p = self.producer.get(v)
        return p is not None and p in self.const

    def _root(self, v: Atom) -> Atom:
        """The var whose buffer ``v`` is (through views)."""
        seen = 0
        while is_var(v) and seen < 10_000:
            p = self.producer.get(v)
            if p is None or self._unit(p) is not None or p.prim not in VIEW or not p.ins or not is_var(p.ins[0]):
                return v
            v, seen = p.ins[0], seen + 1
        return v

    def _kind(self, n: Node) -> str:
        if self._unit(n) is not None:
            return "unit"
        if n.prim in GEMM:
            return "gemm"
        if n.prim in LOOPS or n.prim == "cond":
            return "loop"
        if n.prim in REDUCTIONS and not n.prim.startswith("cum"):
            return "reduce"
        if n.prim in ROOT or n.prim.startswith("cum"):
            return "root"
        if n.prim in VIEW:
            return "view"
        return "fusible"

    # -- the model -------------------------------------------------------------------------------
    def materialised(self) -> set[jex.Var]:
        """Values written to memory (see the module docstring)."""
        mat: set[jex.Var] = set()

        def need(v: Atom) -> None:
            r = self._root(v)
            if is_var(r) and r not in self.inputs and not self._free(r):
                mat.add(r)

        for n in self.g.nodes:
            if n in self.const:
                continue
            kind = self._kind(n)
            if kind in ("gemm", "unit", "loop", "root", "reduce"):
                mat.update(v for v in n.outs if is_var(v))
            if kind in ("gemm", "unit", "loop", "root"):
                for v in n.ins:
                    need(v)
        for v in self.g.outvars:
            need(v)
        for v in self.g.eager:  # written by an op-by-op runtime
            need(v)
        for gemm in {id(g): g for g in self.epilogue.values()}.values():  # the GEMM writes its epilogue's end
            chain = [v for v, gm in self.epilogue.items() if gm is gemm]
            if any(v in mat for v in chain):
                mat.difference_update([gemm.outs[0], *chain[:-1]])
                mat.add(chain[-1])
        return mat

    def cone_reads(self, roots: Sequence[Atom], mat: set[jex.Var]) -> dict[jex.Var, Poly]:
        """Materialised inputs (var -> bytes read) of the fusible cone computing ``roots``."""
        reads: dict[jex.Var, Poly] = {}
        stack: list[tuple[Atom, Poly | None]] = [(v, None) for v in roots]
        seen: set[tuple[jex.Var, Poly | None]] = set()
        while stack:
            v, cap = stack.pop()
            if not is_var(v) or (v, cap) in seen or self._free(v):
                continue
            seen.add((v, cap))
            p = self.producer.get(v)
            if v in mat or v in self.inputs or p is None:
                b = self.size(v) if cap is None else cap * self.itemsize(v)
                reads[v] = b if v not in reads else _bigger(reads[v], b)
                continue
            if p.prim in SLICING:
                _, outs = self.dims(p)
                elems = prod(outs[0])
                stack.append((p.ins[0], elems if cap is None else cap))
                stack.extend((u, cap) for u in p.ins[1:])
                continue
            stack.extend((u, cap) for u in p.ins)
        return reads

    def _relaid(self, n: Node) -> list[jex.Var]:
        """Operands of a dot_general that a GEMM library cannot read in place and no fusion writes for it.

        cuBLAS-style batched GEMMs want the batch dims leading and the free and contracting dims each
        contiguous; a fusion producing the operand writes any layout, but a GEMM result, a pass input or a
        fused-attention output keeps its own, so XLA adds a transpose kernel (read + write).
        """
        if n.prim != "dot_general":
            return []
        (lc, rc), (lb, rb) = n.params["dimension_numbers"]
        out = []
        for v, contract, batch in ((n.ins[0], lc, lb), (n.ins[1], rc, rb)):
            if not is_var(v) or self._free(v):
                continue
            rank = len(self.g.shape(v))
            free = [d for d in range(rank) if d not in contract and d not in batch]
            ok = list(batch) == list(range(len(batch))) and all(
                list(ds) == list(range(min(ds), max(ds) + 1)) for ds in (list(contract), free) if ds)
            if ok:
                continue
            r = self._root(v)
            p = self.producer.get(r)
            if r in self.inputs or p is None or self._unit(p) is not None or self._kind(p) in ("gemm", "loop", "root"):
                out.append(r)
        return out

    def kernels(self) -> PassKernels:
        mat = self.materialised()
        gemms: list[Gemm] = []
        fusions: list[_Fusion] = []
        relaid: set[jex.Var] = set()
        sub = PassKernels()
        for n in self.g.nodes:
            if n in self.const:
                continue
            kind = self._kind(n)
            if kind == "gemm":
                ins, outs = self.dims(n)
                out = n.outs[0]
                epi = next((v for v, gm in self.epilogue.items() if gm is n and v in mat), None)  # the chain's end
                written = self.size(epi) if epi is not None else self.size(out)
                read = sum((self.size(self._root(v)) for v in dict.fromkeys(n.ins) if not self._free(v)), ZERO)
                gemms.append(Gemm(*_gemm_dims(n, ins, outs), nbytes=read + written, fp8=_fp8_operands(n)))
                for v in self._relaid(n):  # a layout change XLA inserts before the GEMM
                    if v not in relaid:
                        relaid.add(v)
                        fusions.append(_Fusion({v: self.size(v)}, prod(self.g.shape(v)), self.size(v), (), False))
            elif kind == "loop" and n.subs:
                inner = [_Kernels(g, self.size, self.dims, self.itemsize, units_as_code=self.units_as_code).kernels()
                         for g in n.subs]
                body = inner[0] if n.prim != "cond" else _largest(inner)
                sub = sub + body.scale(n.length if n.length is not None and n.prim != "cond" else ONE)
            elif kind in ("reduce", "root"):
                outs = [v for v in n.outs if is_var(v)]
                reads = self.cone_reads([u for u in n.ins if is_var(u)], mat)
                out_b = sum((self.size(v) for v in outs), ZERO)
                if n.prim == "dynamic_update_slice":  # in place: writes the update only
                    out_b = self.size(n.ins[1]) if is_var(n.ins[1]) else ZERO
                    reads.pop(self._root(n.ins[0]), None)
                fusions.append(_Fusion(reads, prod(self.g.shape(outs[0])) if outs else ZERO, out_b, tuple(outs),
                                       kind == "reduce"))
                if self.log is not None:
                    self.log.append((n.prim, str(outs[0].aval) if outs else "", out_b, reads))
        for v in mat:
            p = self.producer.get(v)
            if p is None or p in self.const or self._kind(p) != "fusible" or v in self.inputs:
                continue
            if v in self.epilogue:
                continue
            reads = self.cone_reads(list(p.ins), mat)
            fusions.append(_Fusion(reads, prod(self.g.shape(v)), self.size(v), (v,), False, v in self.g.eager))
            if self.log is not None:
                self.log.append((p.prim, str(v.aval), self.size(v), reads))
        order = {v: i for i, v in enumerate(list(self.g.invars) + [u for n in self.g.nodes for u in n.outs])}
        return sub + PassKernels(merge_gemms(gemms), *_fusion_totals(fusions, order))


@dataclass
class _Fusion:
    """One fusion kernel before merging."""

    reads: dict[jex.Var, Poly]  # materialised input -> bytes read
    elems: Poly  # output elements (its loop size)
    written: Poly  # bytes written
    outs: tuple[jex.Var, ...]  # the values it writes
    reduce: bool  # a reduction kernel
    eager: bool = False  # writes a value an op-by-op runtime writes: a kernel of its own, never merged

    def absorb(self, other: _Fusion) -> None:
        for v, b in other.reads.items():
            if v not in self.outs:
                self.reads[v] = _bigger(self.reads[v], b) if v in self.reads else b
        self.written, self.outs = self.written + other.written, self.outs + other.outs


def _fusion_totals(fusions: Sequence[_Fusion], order: dict[jex.Var, int] | None = None) -> tuple[Poly, Poly]:
    """(bytes, count) of the fusion kernels after XLA-style merging: kernels reading the same largest input
    and writing as many elements are one multi-output fusion (sibling fusion), and an elementwise kernel
    that reads a reduction's input and its result joins the reduction (normalization / softmax fusion).
    Among inputs of the same size the largest is the first in ``order`` (the graph's), so that kernels
    reading the same equal-sized inputs (a softmax backward's probabilities and their gradient) agree."""
    groups: dict[tuple[Hashable, ...], _Fusion] = {}  # (largest input, elements, reduces) or a lone kernel
    for f in fusions:
        key = (_largest_input(f.reads, order or {}), f.elems, f.reduce) if f.reads and not f.eager else (object(),)
        if key in groups:
            groups[key].absorb(f)
        else:
            groups[key] = _Fusion(dict(f.reads), f.elems, f.written, f.outs, f.reduce)
    reductions = {k[0]: g for k, g in groups.items() if len(k) == 3 and k[2]}
    for key in [k for k in groups if len(k) == 3 and not k[2]]:
        r = reductions.get(key[0])
        if r is not None and any(v in groups[key].reads for v in r.outs):
            r.absorb(groups.pop(key))
    total = ZERO
    for g in groups.values():
        total = total + g.written + sum(g.reads.values(), ZERO)
    return total, Poly.const(len(groups))


def _largest_input(reads: dict[jex.Var, Poly], order: dict[jex.Var, int]) -> jex.Var | None:
    best, size = None, ZERO
    last = len(order)
    for v, b in reads.items():
        tie = b == size and order.get(v, last) < order.get(best, last)
        if best is None or tie or (b.dominates(size) and b != size) or (
                not size.dominates(b) and b(8, 4096) > size(8, 4096)):
            best, size = v, b
    return best


def _bigger(a: Poly, b: Poly) -> Poly:
    return a if a.dominates(b) else b


def _largest(options: Sequence[PassKernels]) -> PassKernels:
    """The branch of a conditional that moves the most bytes (compared term-wise)."""
    best = options[0]
    for o in options[1:]:
        if (o.fusion_bytes + o.gemm_bytes).dominates(best.fusion_bytes + best.gemm_bytes):
            best = o
    return best


def unit_kernel(g: Graph, dims: DimsFn, nbytes: Poly) -> UnitKernel:
    """The fused-attention calls of a graph as `UnitKernel` (FLOPs from the traced kernel)."""
    if not g.units:
        return UnitKernel()
    fl = count_graph(g, dims, select=lambda n: n.unit is not None)
    q = g.units[0].ins[0]
    head_dim = int(g.shape(q)[-1].const_value) if is_var(q) and g.shape(q)[-1].is_const else 0
    causal = any(n.prim == "select_n" or n.params.get("mask_type") not in (None, 0)
                 for n in g.walk() if n.unit is not None)
    return UnitKernel(Poly.const(len(g.units)), fl.matmul, fl.elementwise + fl.transcendental, nbytes, head_dim, causal)


def graph_kernels(g: Graph, size: SizeFn, dims: DimsFn, unit_bytes: Poly = ZERO, log: KernelLog | None = None
                  ) -> PassKernels:
    """The kernels of one analysed pass (see the module docstring).

    Args:
      g: the pass's graph.
      size: per-device bytes of a var (in the layout the pass computes it in).
      dims: per-device (operand dims, result dims) of a node.
      unit_bytes: bytes the pass's fused-attention calls move (`mistjax.analysis.fused.unit_bytes`).
      log: if given, every fusion kernel is appended as ``(root primitive, result aval, bytes written,
        {input var: bytes read})`` (for inspection).
    """
    itemsize = lambda v: int(np.dtype(v.aval.dtype).itemsize)  # noqa: E731
    k = _Kernels(g, size, dims, itemsize, log).kernels()
    plain = _Kernels(g, size, dims, itemsize, units_as_code=True).kernels() if g.units else None
    return PassKernels(k.gemms, k.fusion_bytes, k.fusion_count, unit_kernel(g, dims, unit_bytes), plain)


def pass_keys(policies: Sequence[str]) -> tuple[str, ...]:
    """Keys of a part's kernel table: ``fwd[policy]`` and ``bwd[policy]`` for every analysed policy."""
    return tuple(f"{ph}[{p}]" for p in policies for ph in ("fwd", "bwd"))


class KernelTables(Protocol):
    """What `kernel_values` and `compile_kernels` read of a part (a `mistjax.analysis.profile.PartProfile`):
    typed structurally so that this module, which the profile reads, does not import it back."""

    @property
    def name(self) -> str: ...

    @property
    def kernels(self) -> Mapping[str, PassKernels]: ...


def kernel_values(part: KernelTables, key: str, b: float, s: float, t: float = 1) -> dict[str, float]:
    """A part's kernel totals of one pass (``fwd[none]``, ``bwd[full]``, ...) at one size, as floats."""
    k: PassKernels = part.kernels[key]
    u = k.unit
    return {"gemm_count": float(sum(g.count(b, s, t) for g in k.gemms)), "gemm_flops": k.gemm_flops(b, s, t),
            "gemm_bytes": k.gemm_bytes(b, s, t), "fusion_bytes": k.fusion_bytes(b, s, t),
            "fusion_count": k.fusion_count(b, s, t), "unit_count": u.count(b, s, t),
            "unit_matmul_flops": u.matmul_flops(b, s, t), "unit_bytes": u.nbytes(b, s, t)}


@dataclass(frozen=True)
class KernelArrays:
    """One pass's kernels evaluated at arrays of ``(b, s, t)`` points (leading axis: the points)."""

    gemm_batch: np.ndarray  # [points, gemms]
    gemm_m: np.ndarray  # [points, gemms]
    gemm_n: np.ndarray  # [points, gemms]
    gemm_k: np.ndarray  # [points, gemms]
    gemm_bytes: np.ndarray  # [points, gemms] bytes of one execution
    gemm_count: np.ndarray  # [points, gemms] executions per pass
    gemm_fp8: np.ndarray  # [points, gemms] 1 where the GEMM's operands are fp8
    fusion_bytes: np.ndarray  # [points]
    fusion_count: np.ndarray  # [points]
    unit_count: np.ndarray  # [points]
    unit_matmul_flops: np.ndarray  # [points]
    unit_other_flops: np.ndarray  # [points]
    unit_bytes: np.ndarray  # [points]
    head_dim: int  # fused attention's head dim (0: none)
    causal: bool  # fused attention is masked


@dataclass(frozen=True)
class CompiledKernels:
    """Every part's kernel table as one vectorised NumPy function of ``(b, s, t)``."""

    keys: tuple[tuple[str, str, int, int, bool], ...]  # (part, pass key, number of GEMMs, head dim, causal)
    fn: Callable[[np.ndarray, np.ndarray, np.ndarray], list[np.ndarray | float]] = field(repr=False)

    def __call__(self, b: ArrayLike, s: ArrayLike, t: ArrayLike) -> dict[tuple[str, str], KernelArrays]:
        """``(part, pass key) -> KernelArrays`` at the 1-D arrays of points ``b, s, t`` (same length)."""
        b, s, t = np.broadcast_arrays(*(np.atleast_1d(np.asarray(x, dtype=np.float64)) for x in (b, s, t)))
        vals = iter(self.fn(b, s, t))
        out = {}
        for part, key, n_gemm, head_dim, causal in self.keys:
            scal = [np.broadcast_to(np.asarray(next(vals), dtype=np.float64), b.shape) for _ in range(6)]
            gem = [np.broadcast_to(np.asarray(next(vals), dtype=np.float64), b.shape) for _ in range(7 * n_gemm)]
            cols = [np.stack(gem[j::7], axis=-1) if n_gemm else np.zeros(b.shape + (0,)) for j in range(7)]
            out[(part, key)] = KernelArrays(*cols, *scal, head_dim=head_dim, causal=causal)
        return out


def compile_kernels(parts: Sequence[KernelTables]) -> CompiledKernels:
    """Lambdify the kernel tables of ``parts`` (`PartProfile`s) into one function (`CompiledKernels`)."""
    from mistjax.analysis.poly import B, S, T

    keys, exprs = [], []
    for part in parts:
        tables = dict(part.kernels)
        tables.update({f"{key}|plain": k.plain for key, k in part.kernels.items() if k.plain is not None})
        for key, k in tables.items():
            e = k.expressions("")
            exprs += [e[f".{n}"] for n in ("fusion_bytes", "fusion_count", "unit_count", "unit_matmul_flops",
                                            "unit_other_flops", "unit_bytes")]
            for i in range(len(k.gemms)):
                exprs += [e[f".gemm{i}.{n}"] for n in ("batch", "m", "n", "k", "nbytes", "count", "fp8")]
            keys.append((part.name, key, len(k.gemms), k.unit.head_dim, k.unit.causal))
    fn = sp.lambdify((B, S, T), exprs or [sp.Integer(0)], modules="numpy", cse=True)
    return CompiledKernels(tuple(keys), fn)


__all__ = ["GEMM", "CompiledKernels", "Gemm", "KernelArrays", "PassKernels", "UnitKernel", "compile_kernels",
           "graph_kernels", "kernel_values", "merge_gemms", "pass_keys"]
