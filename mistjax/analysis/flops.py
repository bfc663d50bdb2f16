"""FLOP counting over analysed graphs, with XLA's conventions per primitive (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from jax.extend import core as jex

from mistjax.analysis.fused import CUDNN, cudnn_flops
from mistjax.analysis.graph import Graph, Node, build_graph, constant_nodes, names
from mistjax.analysis.poly import ZERO, Poly, prod

Shapes = tuple[list[tuple[Poly, ...]], list[tuple[Poly, ...]]]

FREE = names(
    "reshape broadcast_in_dim transpose slice dynamic_slice dynamic_update_slice concatenate pad "
    "gather iota squeeze expand_dims rev copy copy_p name reduce_precision stop_gradient split "
    "device_put optimization_barrier sharding_constraint bitcast_convert_type mesh_cast reshard pvary "
    "pcast random_bits random_wrap random_unwrap random_seed threefry2x32 psum all_gather "
    "psum_scatter ppermute all_to_all axis_index sort argsort top_k select_and_gather_add"
)
TRANSCENDENTAL = names(
    "exp exp2 log log1p expm1 tanh logistic sin cos tan asin acos atan atan2 sinh cosh asinh acosh "
    "atanh erf erfc erf_inv lgamma digamma rsqrt sqrt cbrt pow igamma igammac bessel_i0e bessel_i1e"
)
EXTRA_FLOPS = {"logistic": 3}  # XLA expands logistic into neg, add, divide around one exp
REDUCTIONS = names(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin "
    "cumsum cumprod cummax cummin cumlogsumexp"
)
SCATTERS = names(
    "scatter-add scatter_add scatter-mul scatter_mul scatter-min scatter-max scatter_min scatter_max"
)


Count: TypeAlias = Poly | int  # symbolic FLOPs, or a concrete jaxpr's as an int (`flop_count`)


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of a computation, split the way XLA's cost analysis reports them.

    Attributes:
      matmul: ``dot_general`` and convolution FLOPs.
      elementwise: other arithmetic FLOPs (elementwise ops, reductions, scatter-adds).
      transcendental: transcendental evaluations (XLA's ``transcendentals``).
    """

    matmul: Count
    elementwise: Count
    transcendental: Count

    @property
    def flops(self) -> Count:
        """What XLA calls ``flops``: matmul + elementwise."""
        return self.matmul + self.elementwise

    @property
    def total(self) -> Count:
        """All work counted as FLOPs, transcendentals at 1 each (what the analysis reports)."""
        return self.matmul + self.elementwise + self.transcendental

    def __add__(self, other: FlopCount) -> FlopCount:
        return FlopCount(
            self.matmul + other.matmul,
            self.elementwise + other.elementwise,
            self.transcendental + other.transcendental,
        )

    def __sub__(self, other: FlopCount) -> FlopCount:
        return FlopCount(
            self.matmul - other.matmul,
            self.elementwise - other.elementwise,
            self.transcendental - other.transcendental,
        )

    def scale(self, k: Count) -> FlopCount:
        return FlopCount(self.matmul * k, self.elementwise * k, self.transcendental * k)

    def map(self, f: Callable[[Count], Count]) -> FlopCount:
        return FlopCount(f(self.matmul), f(self.elementwise), f(self.transcendental))


ZERO_FLOPS = FlopCount(ZERO, ZERO, ZERO)


def _pow_multiplies(k: int) -> int:
    k = abs(int(k))
    return 0 if k <= 1 else k.bit_length() - 1 + bin(k).count("1") - 1


def node_flops(node: Node, shapes: Shapes) -> FlopCount:
    """FLOPs of one leaf node given its (per-device) operand and result shapes."""
    ins, outs = shapes
    p = node.prim
    out_elems = prod(outs[0]) if outs else ZERO
    if p == "dot_general":
        (lc, rc), (lb, rb) = node.params["dimension_numbers"]
        rhs_free = [d for i, d in enumerate(ins[1]) if i not in rc and i not in rb]
        return FlopCount(2 * prod(ins[0]) * prod(rhs_free), ZERO, ZERO)
    if p == "conv_general_dilated":
        out_dim = node.params["dimension_numbers"].rhs_spec[0]
        kernel = prod(d for i, d in enumerate(ins[1]) if i != out_dim)  # per output element
        return FlopCount(2 * out_elems * kernel, ZERO, ZERO)
    if p in FREE:
        return ZERO_FLOPS
    if p in CUDNN:
        return FlopCount(*cudnn_flops(p, node.params, ins, node.ins[0].aval.dtype.itemsize))
    if p in TRANSCENDENTAL:
        return FlopCount(ZERO, out_elems * EXTRA_FLOPS.get(p, 0), out_elems)
    if p in REDUCTIONS:
        if p.startswith("cum"):
            return FlopCount(ZERO, out_elems, ZERO)
        return FlopCount(ZERO, prod(ins[0]) - out_elems, ZERO)
    if p in SCATTERS:
        return FlopCount(ZERO, prod(ins[2]), ZERO)
    if p == "integer_pow":
        k = node.params["y"]
        return FlopCount(ZERO, out_elems * (_pow_multiplies(k) + (1 if k < 0 else 0)), ZERO)
    if p == "select_n":
        return FlopCount(ZERO, out_elems * max(1, len(ins) - 2), ZERO)
    # Everything else is treated as elementwise: one FLOP per output element.
    return FlopCount(ZERO, out_elems * len(outs), ZERO)


def default_shapes(graph: Graph) -> Callable[[Node], Shapes]:
    return lambda n: ([graph.shape(v) for v in n.ins], [graph.shape(v) for v in n.outs])


def count_graph(
    graph: Graph,
    shapes: Callable[[Node], Shapes] | None = None,
    *,
    fold_constants: bool = True,
    select: Callable[[Node], bool] | None = None,
) -> FlopCount:
    """FLOPs of a flattened graph (loops multiplied by their trip counts).

    ``select``: count only the top-level nodes it accepts (a loop it accepts is counted whole).
    """
    shapes = shapes or default_shapes(graph)
    skip = constant_nodes(graph) if fold_constants else set()
    acc = ZERO_FLOPS
    for n in graph.nodes:
        if n in skip or (select is not None and not select(n)):
            continue
        if n.prim in ("scan", "while"):
            acc = acc + count_graph(n.subs[0], shapes, fold_constants=fold_constants).scale(n.length)
        elif n.prim == "cond":
            branches = [count_graph(g, shapes, fold_constants=fold_constants) for g in n.subs]
            acc = acc + _termwise_max(branches)
        else:
            acc = acc + node_flops(n, shapes(n))
    return acc


def _termwise_max(counts: Sequence[FlopCount]) -> FlopCount:
    def mx(polys: Sequence[Poly]) -> Poly:
        keys = set().union(*[p.terms for p in polys])
        return Poly({k: max(p.terms.get(k, 0) for p in polys) for k in keys})

    return FlopCount(
        mx([c.matmul for c in counts]),
        mx([c.elementwise for c in counts]),
        mx([c.transcendental for c in counts]),
    )


def flop_count(closed: jex.ClosedJaxpr, *, fold_constants: bool = True) -> FlopCount:
    """FLOPs of a concrete jaxpr, as Python ints (see the module docstring for conventions).

    Example::

        fc = flop_count(jax.make_jaxpr(f)(x))
        fc.flops        # compare with jax.jit(f).lower(x).compile().cost_analysis()["flops"]
    """
    fc = count_graph(build_graph(closed), fold_constants=fold_constants)
    return fc.map(lambda p: int(p.const_value))
