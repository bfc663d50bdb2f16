"""The kernels XLA:GPU makes of one layer, compiled deviceless, next to the analysis's fusion model.

`xla_pass_kernels` compiles the forward and the backward of one part (``pre``, ``block``, ``post``) of a
loss under a remat policy, exactly the jaxprs the analysis prices (`mistjax.analysis.parts.vjp_jaxprs`),
for a GPU target on compile-only devices (`mistjax.validate.gpu_aot`), and reads the optimised HLO: every
top-level instruction of the entry computation is a kernel (fusions, cuBLAS / Triton GEMMs, cuDNN calls,
copies); its bytes are its operands plus its results, which is what XLA's HloCostAnalysis calls "bytes
accessed" (`kernel_table` checks the sum against it). `compare_layer` puts them next to
`mistjax.analysis.kernels.graph_kernels` evaluated at the same size.

Residuals computed from constants only (causal masks, iotas) are dropped from the compiled forward and
recomputed inside the compiled backward: the analysis treats them as free (XLA folds them into their
consumers in the training step), so compiling them as program outputs would count bytes no training step
moves.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

import numpy as np

from mistjax.core.hlo import HloInstruction, instructions, shape_bytes
from mistjax.core.types import LossFn, PyTree

if TYPE_CHECKING:
    import jax
    from jax.extend import core as jex

    from mistjax.analysis.parts import VjpTrace
    from mistjax.analysis.profile import ModelProfile

# Instructions that move no data of their own.
_NO_KERNEL = frozenset({"parameter", "bitcast", "get-tuple-element", "tuple", "constant", "after-all",
                        "partition-id", "replica-id", "opt-barrier"})
_GEMM_CALL = re.compile(r'custom_call_target="__cublas\$(?:lt\$)?(?:matmul|gemm)[^"]*"')
_ATTN_CALL = re.compile(r'custom_call_target="__cudnn\$fmha[^"]*"')


@dataclass(frozen=True)
class Kernel:
    """One kernel of a compiled program (a top-level instruction of the entry computation)."""

    name: str  # the HLO instruction name
    kind: str  # "gemm" (cuBLAS / Triton GEMM fusion), "attention" (cuDNN), "fusion" (everything else)
    read: int  # operand bytes
    written: int  # result bytes


@dataclass(frozen=True)
class KernelTable:
    """The kernels of one compiled program."""

    kernels: tuple[Kernel, ...]  # in program order
    bytes_accessed: float | None  # XLA's HloCostAnalysis total (None when the private call failed)
    flops: float | None  # XLA's HloCostAnalysis FLOPs

    def total(self, kind: str | None = None) -> int:
        """Bytes moved by the kernels of ``kind`` (all kernels when None)."""
        return sum(k.read + k.written for k in self.kernels if kind is None or k.kind == kind)

    def count(self, kind: str | None = None) -> int:
        return sum(1 for k in self.kernels if kind is None or k.kind == kind)


def _kind(name: str, opcode: str, attrs: str) -> str:
    if (opcode == "custom-call" and _GEMM_CALL.search(attrs)) or "gemm_fusion" in name or \
            '"kind":"__triton_gemm' in attrs:
        return "gemm"
    if opcode == "custom-call" and _ATTN_CALL.search(attrs):
        return "attention"
    return "fusion"


_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_PARAM = re.compile(r"^\s*%?([\w.\-]+)\s*=.*?\sparameter\((\d+)\)", re.M)
_PARTIAL_READS = frozenset({"slice", "dynamic-slice", "gather"})
# Where a residual of a traced forward comes from (`_residual_sources`).
ResidualSource: TypeAlias = int | Literal["const"] | None
# A traced pass as a function of abstract arguments (`pass_programs`).
PassFn: TypeAlias = Callable[..., list["jax.Array"]]


def _operand_reads(fusion: HloInstruction, ins: Mapping[str, HloInstruction],
                   users: Mapping[str, list[HloInstruction]], nbytes: Callable[[str], int],
                   param_index: Mapping[str, int]) -> int:
    """Bytes a fusion reads: an operand used only through slices / gathers is read as much as they keep."""
    m = _CALLS.search(fusion.attrs)
    params: dict[int, HloInstruction] = {}
    if m:
        for i in ins.values():
            if i.computation == m.group(1) and i.opcode == "parameter" and i.name in param_index:
                params[param_index[i.name]] = i
    total = 0
    for k, name in enumerate(dict.fromkeys(fusion.operands)):
        full = nbytes(name)
        p = params.get(k)
        if p is None:
            total += full
            continue
        frontier, reads, partial = [p], 0, True
        while frontier and partial:
            u = frontier.pop()
            for c in users.get(u.name, ()):
                if c.opcode == "bitcast":
                    frontier.append(c)
                elif c.opcode in _PARTIAL_READS and c.operands and c.operands[0] == u.name:
                    reads += nbytes(c.name)
                else:
                    partial = False
        total += min(reads, full) if partial and reads else full
    return total


def kernel_table(hlo_text: str, cost: dict[str, float] | None = None) -> KernelTable:
    """The kernels of an optimised HLO module (entry computation; loop bodies are not expanded).

    A kernel's bytes are its results plus its operands, an operand used only through slices or gathers
    counted as what they keep (as XLA's cost analysis reads a fusion's parameters).
    """
    ins = instructions(hlo_text)
    m = re.search(r"^ENTRY\s+%?([\w.\-]+)", hlo_text, re.M)
    entry = m.group(1) if m else ""
    param_index = {name: int(k) for name, k in _PARAM.findall(hlo_text)}
    users: dict[str, list[HloInstruction]] = {}
    for i in ins.values():
        for o in i.operands:
            users.setdefault(o, []).append(i)

    def nbytes(name: str) -> int:
        return sum(b for _, b in shape_bytes(ins[name].type)) if name in ins else 0

    out = []
    for i in ins.values():
        if i.computation != entry or i.opcode in _NO_KERNEL:
            continue
        if i.opcode in ("while", "conditional", "call"):
            raise ValueError(f"kernel_table reads straight-line programs; {i.name} is a {i.opcode}")
        read = _operand_reads(i, ins, users, nbytes, param_index) if i.opcode == "fusion" else \
            sum(nbytes(o) for o in dict.fromkeys(i.operands))
        out.append(Kernel(i.name, _kind(i.name, i.opcode, i.attrs), read, nbytes(i.name)))
    cost = cost or {}
    return KernelTable(tuple(out), cost.get("bytes accessed"), cost.get("flops"))


def _residual_sources(fwd: jex.ClosedJaxpr, num_outputs: int) -> list[ResidualSource]:
    """Per residual of a traced forward: ``"const"`` (computed from constants only), the index of the
    forward input it is (passed through), or None (computed: a program output)."""
    from mistjax.analysis.graph import build_graph
    from mistjax.analysis.memory import alias_roots

    g = build_graph(fwd)
    root = alias_roots(g)
    position = {v: i for i, v in enumerate(g.invars)}
    out: list[ResidualSource] = []
    for v in g.outvars[num_outputs:]:
        if not hasattr(v, "aval") or type(v).__name__ == "Literal" or root.get(v, v) is None:
            out.append("const")
        else:
            out.append(position.get(root.get(v, v), position.get(v)))
    return out


def pass_programs(trace: VjpTrace) -> tuple[PassFn, list[jax.ShapeDtypeStruct], PassFn, list[jax.ShapeDtypeStruct]]:
    """``(fwd, fwd_args, bwd, bwd_args)``: the traced passes as functions of abstract arguments.

    The forward returns the part's outputs and its computed residuals. The backward takes the forward's
    inputs too: residuals that are inputs (weights, the layer input under full remat) come from there, as in
    the training step, and constant ones are recomputed from them (XLA removes the rest of the forward).
    """
    import jax

    from mistjax.trace.split import eval_jaxpr

    fj, bj = trace.fwd, trace.bwd
    no = trace.num_outputs
    source = _residual_sources(fj, no)
    keep = [i for i, c in enumerate(source) if c is None]
    sds = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in fj.jaxpr.invars]
    res_sds = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in fj.jaxpr.outvars[no:]]
    ct_sds = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in fj.jaxpr.outvars[:no]]
    n_in = len(sds)

    def fwd(*args: jax.Array) -> list[jax.Array]:
        outs = eval_jaxpr(fj.jaxpr, fj.consts, args)
        return list(outs[:no]) + [outs[no + i] for i in keep]

    def bwd(*args: jax.Array) -> list[jax.Array]:
        inputs, rest = args[:n_in], args[n_in:]
        kept, cts = rest[:len(keep)], rest[len(keep):]
        every = eval_jaxpr(fj.jaxpr, fj.consts, inputs)[no:] if "const" in source else [None] * len(source)
        res = [inputs[c] if isinstance(c, int) else every[i] for i, c in enumerate(source)]
        for j, i in enumerate(keep):
            res[i] = kept[j]
        return list(eval_jaxpr(bj.jaxpr, bj.consts, [*res, *cts]))

    return fwd, sds, bwd, [*sds, *[res_sds[i] for i in keep], *ct_sds]


def compile_table(fn: Callable[..., object], args: Sequence[jax.ShapeDtypeStruct], device: jax.Device) -> KernelTable:
    """Compile ``fn(*args)`` (abstract args) for one compile-only device and read its kernels."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from mistjax.validate.gpu_aot import xla_cost_analysis

    sharding = NamedSharding(Mesh(np.array([device]), ("x",)), P())
    compiled = jax.jit(fn, in_shardings=[sharding] * len(args)).lower(*args).compile()
    return kernel_table(compiled.as_text(), xla_cost_analysis(compiled))


@dataclass(frozen=True)
class PassComparison:
    """One pass of one part: XLA:GPU's kernels against the fusion model (bytes per device)."""

    part: str  # pre | block | post
    policy: str  # remat policy
    phase: str  # fwd | bwd
    xla_gemm_bytes: int  # bytes of XLA's GEMM kernels
    xla_other_bytes: int  # bytes of every other kernel (fusions, copies, attention)
    xla_kernels: int  # kernels XLA launches
    model_gemm_bytes: float  # the fusion model's GEMM bytes
    model_other_bytes: float  # its fusion + fused-attention bytes
    model_kernels: float  # its kernel count

    @property
    def other_ratio(self) -> float:
        """Model / XLA bytes of the non-GEMM kernels."""
        return self.model_other_bytes / max(self.xla_other_bytes, 1)

    @property
    def total_ratio(self) -> float:
        return (self.model_gemm_bytes + self.model_other_bytes) / max(self.xla_gemm_bytes + self.xla_other_bytes, 1)


def compare_layer(loss_fn: LossFn, params: PyTree, b: int, s: int, target: str = "l4", *,
                  policies: Sequence[str] = ("none",), parts: Sequence[str] = ("block",),
                  batch_fn: Callable[[int, int], tuple[PyTree, ...]] | None = None, profile: ModelProfile | None = None
                  ) -> list[PassComparison]:
    """XLA:GPU's kernels of ``parts`` of ``loss_fn`` at ``(b, s)`` next to the analysis's fusion model.

    Args:
      loss_fn: the loss, ``loss_fn(params, *batch_fn(b, s))``.
      params: its parameters (abstract is enough).
      b, s: micro-batch and sequence length to compile and evaluate at.
      target: a GPU target preset (`mistjax.validate.gpu_aot.TARGET_SPECS`).
      policies: remat policies of the block to compare (pre / post always run ``none``).
      parts: which parts.
      batch_fn: ``(b, s) -> batch args`` (default: token batches).
      profile: an analysed `ModelProfile` of the loss with those policies (default: analysed here).
    Raises:
      GpuAotUnavailable: without the CUDA plugin or outside a ``JAX_PLATFORMS=cpu`` process.
    """
    from mistjax.analysis.analyze import analyze_model, token_batch
    from mistjax.analysis.kernels import kernel_values
    from mistjax.analysis.parts import split_parts, vjp_jaxprs
    from mistjax.trace.split import trace_loss
    from mistjax.validate.gpu_aot import compile_only_devices, load_target

    batch_fn = batch_fn or token_batch
    device = compile_only_devices(load_target(target), 1, 1)[0]
    traced = split_parts(trace_loss(loss_fn, params, *batch_fn(b, s)))
    if profile is None:
        profile = analyze_model(loss_fn, params, batch_fn, policies=[p for p in policies if p != "none"] or ["full"])
    out = []
    for part in parts:
        for pol in (policies if part == "block" else ("none",)):
            fwd, fargs, bwd, bargs = pass_programs(vjp_jaxprs(traced[part], pol))
            tables = {"fwd": compile_table(fwd, fargs, device), "bwd": compile_table(bwd, bargs, device)}
            for phase, table in tables.items():
                mv = kernel_values(getattr(profile, part), f"{phase}[{pol}]", b, s, 1)
                out.append(PassComparison(part, pol, phase, table.total("gemm"), table.total() - table.total("gemm"),
                                          table.count(), mv["gemm_bytes"], mv["fusion_bytes"] + mv["unit_bytes"],
                                          mv["fusion_count"] + mv["unit_count"] + mv["gemm_count"]))
    return out


__all__ = ["Kernel", "KernelTable", "PassComparison", "compare_layer", "compile_table", "kernel_table",
           "pass_programs"]
