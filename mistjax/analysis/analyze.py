"""`analyze_model`: trace a loss at seven sizes and derive its symbolic per-part profile (FLOPs,
residuals, liveness peaks, tensor-parallel collectives in b, s, t). How and what is exact: docs/internals.md.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import jax
import jax.numpy as jnp
import sympy as sp
from jax.extend import core as jex

from mistjax.analysis.block import activation_state, fit_points, weight_state
from mistjax.analysis.cache import cache_dir, load_profile, profile_key, save_profile
from mistjax.analysis.flops import FlopCount, count_graph
from mistjax.analysis.fused import BlockSizeError, check_blocks, unit_bytes
from mistjax.analysis.graph import Graph, Node, StructureError, build_graph
from mistjax.analysis.kernels import PassKernels, graph_kernels
from mistjax.analysis.memory import alias_roots, nbytes_fn, peak_candidates
from mistjax.analysis.parts import WEIGHT, PartFn, VjpTrace, split_parts, vjp_jaxprs
from mistjax.analysis.poly import ZERO, FitError, Poly, S, T, max_expr, prune_dominated, total
from mistjax.analysis.profile import Collective, ModelProfile, PartProfile
from mistjax.analysis.tp import REP, Shard, State, TPResult, propagate
from mistjax.core.axes import leaf_axes
from mistjax.core.jaxpr import Atom, iter_eqns
from mistjax.core.layout import TENSOR_AXES
from mistjax.core.moe import refuse_moe
from mistjax.core.types import LossFn, PyTree
from mistjax.trace.source import exception_line
from mistjax.trace.split import TracedLoss, trace_loss

DEFAULT_POINTS: tuple[tuple[int, int], ...] = ((2, 8), (3, 8), (2, 16), (3, 16), (2, 24), (3, 24), (4, 32))
BASE_POLICIES = ("none", "full", "dots")
Axes = tuple[str | None, ...] | None


def token_batch(b: int, s: int) -> tuple[dict[str, jax.ShapeDtypeStruct]]:
    """``(batch,)`` for `models.make_loss_fn`: int32 ``inputs`` / ``targets`` of ``[b, s]``."""
    tok = jax.ShapeDtypeStruct((b, s), jnp.int32)
    return ({"inputs": tok, "targets": tok},)


def _flat_axes(params: PyTree, param_axes: PyTree | None) -> list[Axes]:
    n = len(jax.tree.leaves(params))
    if param_axes is None:
        axes = leaf_axes(params)
    elif (
        isinstance(param_axes, list | tuple)
        and all(a is None or isinstance(a, tuple) for a in param_axes)
        and len(param_axes) == n
    ):
        axes = list(param_axes)
    else:
        axes = jax.tree.leaves(param_axes, is_leaf=lambda x: isinstance(x, tuple))
    if len(axes) != n:
        raise ValueError(f"param_axes has {len(axes)} entries for {n} parameter leaves")
    return list(axes)


class _Final(enum.Enum):
    FINAL = "final"  # "the layout a value ends in" (a partial output resolved), for local_bytes


_FINAL = _Final.FINAL


@dataclass(frozen=True)
class PassAnalysis:
    """One traced pass (forward or backward) of a part: the graph and its tensor-parallel layouts.

    Attributes:
      g: the flattened graph with fitted dims.
      res: the propagated layouts and collectives.
    """

    g: Graph
    res: TPResult

    @cached_property
    def final(self) -> dict[jex.Var, State]:
        """Layout of every value, outputs after their resolution (a partial output reduced)."""
        final = dict(self.res.states)
        final.update({v: s for v, s in zip(self.g.outvars, self.res.out_states) if isinstance(v, jex.Var)})
        return final

    def local_bytes(self, v: Atom, state: State | _Final = _FINAL) -> Poly:
        """Bytes of ``v`` on one device in layout ``state`` (default: its final layout)."""
        st = self.final.get(v, REP) if state is _FINAL else state
        return nbytes_fn(self.g, lambda u: self.res.local_dims(self.g, u, st))(v)

    def _shapes(self, n: Node) -> tuple[list[tuple[Poly, ...]], list[tuple[Poly, ...]]]:
        ins, outs = self.res.node_states[n]
        return (
            [self.res.local_dims(self.g, v, s) for v, s in zip(n.ins, ins)],
            [self.res.local_dims(self.g, v, s) for v, s in zip(n.outs, outs)],
        )

    def flops(self) -> FlopCount:
        return count_graph(self.g, self._shapes)

    def peak(self, exclude: Sequence[Atom] = ()) -> sp.Expr:
        """Transient peak bytes; with blockwise fused attention, ``Piecewise`` on ``s <= block``."""
        small = self._peak(exclude, large_blocks=False)
        blocks = [n.unit_block for n in self.g.walk() if n.unit_block and n.subs]
        if not blocks:
            return small
        large = self._peak(exclude, large_blocks=True)
        return small if large == small else sp.Piecewise((small, sp.Le(S, min(blocks))), (large, True))

    def _peak(self, exclude: Sequence[Atom], *, large_blocks: bool) -> sp.Expr:
        tp = peak_candidates(
            self.g,
            lambda v: self.local_bytes(v, self.res.states.get(v, REP)),
            exclude=exclude,
            extra=self.res.extra,
            large_blocks=large_blocks,
        )
        one = peak_candidates(self.g, nbytes_fn(self.g), exclude=exclude, large_blocks=large_blocks)
        if set(prune_dominated([c.at_t1() for c in tp])) == set(one):
            return max_expr(tp)
        return sp.Piecewise((max_expr(one), sp.Eq(T, 1)), (max_expr(tp), True))

    def fused_flops(self) -> FlopCount:
        """FLOPs inside fused-attention units (`mistjax.analysis.fused`)."""
        return count_graph(self.g, self._shapes, select=lambda n: n.unit is not None)

    def fused_bytes(self) -> Poly:
        """Bytes the fused-attention calls read and write on one device (one kernel's memory traffic)."""
        return unit_bytes(self.g.units, self.local_bytes)

    def kernels(self) -> PassKernels:
        """The kernels a GPU compiler makes of this pass (`mistjax.analysis.kernels`), per device."""
        return graph_kernels(self.g, lambda v: self.local_bytes(v, self.res.states.get(v, REP)), self._shapes,
                             self.fused_bytes())

    def collectives(self, phase: str) -> list[Collective]:
        return [
            Collective(
                kind=c.kind,
                phase=phase,
                nbytes=c.nbytes.to_sympy(),
                count=c.count.to_sympy(),
                dtype=c.dtype,
                shape=tuple(d.to_sympy() for d in c.shape),
                where=c.where,
                summands=c.summands,
            )
            for c in self.res.collectives
        ]


def _part_passes(
    traces: Sequence[VjpTrace],
    points: Sequence[tuple[int, int]],
    part: PartFn,
    axes: list[Axes],
    *,
    sp_on: bool,
    tensor_axes: Sequence[str],
    gather_out_cotangents: bool = False,
) -> tuple[PassAnalysis, PassAnalysis]:
    """The forward and backward of one part under tensor parallelism. ``gather_out_cotangents``: the
    part feeds the layer loop, whose entry all-gathers the cotangents of its split outputs once
    (`mistjax.runtime.grads._sequence_split`)."""
    fwd_g = build_graph(traces[0].fwd, [t.fwd for t in traces[1:]], points)
    bwd_g = build_graph(traces[0].bwd, [t.bwd for t in traces[1:]], points)
    nd, no = len(part.diff), part.num_outputs

    def act_state(g: Graph, v: Atom) -> State:
        return activation_state(g, v, sp_on)

    w_states = [
        weight_state(axes[i], len(a.shape), tensor_axes) if k == WEIGHT else None
        for a, k, i in zip(part.diff, part.diff_kind, part.diff_leaf)
    ]
    in_states: dict[jex.Var, State] = {}
    for v, k, ws in zip(fwd_g.invars[:nd], part.diff_kind, w_states):
        in_states[v] = ws if k == WEIGHT else act_state(fwd_g, v)
    model_sizes = [fwd_g.shape(v)[s.dim] for v, s in in_states.items() if isinstance(s, Shard) and not s.seq]
    weights = [v for v, k in zip(fwd_g.invars[:nd], part.diff_kind) if k == WEIGHT]
    out_targets: list[State | None] = [act_state(fwd_g, v) for v in fwd_g.outvars[:no]]
    out_targets += [None] * (len(fwd_g.outvars) - no)
    fres = propagate(
        fwd_g, in_states, out_targets, sequence_parallel=sp_on, param_vars=weights, model_sizes=model_sizes
    )
    fwd = PassAnalysis(fwd_g, fres)

    res_vars = fwd_g.outvars[no:]
    b_in: dict[jex.Var, State] = {}
    b_params = []
    for bv, fv in zip(bwd_g.invars, res_vars):
        b_in[bv] = REP if isinstance(fv, jex.Literal) else fwd.final.get(fv, REP)
        if isinstance(fv, jex.Var) and fv in fres.params:
            b_params.append(bv)
    entering = []
    for bv, st in zip(bwd_g.invars[len(res_vars) :], fres.out_states[:no]):
        b_in[bv] = st
        if gather_out_cotangents and isinstance(st, Shard) and st.seq:
            entering.append(bv)
    b_targets = [
        ws if k == WEIGHT else in_states[v] for v, k, ws in zip(fwd_g.invars[:nd], part.diff_kind, w_states)
    ]
    bres = propagate(
        bwd_g, b_in, b_targets, sequence_parallel=sp_on, param_vars=b_params, model_sizes=model_sizes,
        gathered=entering,
    )
    return fwd, PassAnalysis(bwd_g, bres)


def _depends_on(graph: Graph, seeds: set[jex.Var]) -> set[jex.Var]:
    """Every value of ``graph`` computed from one of ``seeds`` (loops and conds: all outputs, conservatively)."""
    dep = set(seeds)
    for n in graph.nodes:
        if any(isinstance(v, jex.Var) and v in dep for v in n.ins):
            dep.update(n.outs)
    return dep


def _saved(fwd: PassAnalysis, part: PartFn) -> Poly:
    """Residual bytes a part keeps per micro-batch: distinct buffers that depend on its activation or
    other non-weight inputs. Weight-only residuals (casts and views of the weights) are not kept: the
    runtime rebuilds them in the backward from the weights (`runtime.remat`'s re-fetching layer VJP)."""
    nd, no = len(part.diff), part.num_outputs
    weights = {v for v, k in zip(fwd.g.invars[:nd], part.diff_kind) if k == WEIGHT}
    skip = weights | set(fwd.g.invars[nd:]) | set(fwd.g.constvars)
    live = _depends_on(fwd.g, {v for v in fwd.g.invars if v not in weights})
    root = alias_roots(fwd.g)
    by_root: dict[jex.Var, jex.Var] = {}  # distinct buffers: aliases of one value are kept once
    for v in fwd.g.outvars[no:]:
        if isinstance(v, jex.Var) and root.get(v, v) is not None and v in live:  # None: a folded constant
            by_root.setdefault(root.get(v, v), v)
    return total(fwd.local_bytes(v) for r, v in by_root.items() if r not in skip)


def _stash(bwd: PassAnalysis, part: PartFn) -> Poly:
    """Bytes a zero-bubble schedule's deferred weight-gradient pass reads of its input-gradient pass (the
    stash, `runtime.mpmd_split`): values the input gradients' equations define that only the weight
    gradients' equations need (the gradients at the weight matmuls' outputs, what a policy recomputed)."""
    nd = len(part.diff)
    outs = list(zip(bwd.g.outvars[:nd], part.diff_kind))
    need_b = {v for v, k in outs if k != WEIGHT and isinstance(v, jex.Var)}
    in_b: set[int] = set()
    for i in reversed(range(len(bwd.g.nodes))):
        n = bwd.g.nodes[i]
        if any(o in need_b for o in n.outs):
            in_b.add(i)
            need_b.update(v for v in n.ins if isinstance(v, jex.Var))
    b_defined = {o for i in in_b for o in bwd.g.nodes[i].outs}
    need_w = {v for v, k in outs if k == WEIGHT and isinstance(v, jex.Var)}
    for i in reversed(range(len(bwd.g.nodes))):
        n = bwd.g.nodes[i]
        if i not in in_b and any(o in need_w for o in n.outs):
            need_w.update(v for v in n.ins if isinstance(v, jex.Var))
    return total(bwd.local_bytes(v) for v in need_w & b_defined)


def _analyze_part(
    name: str,
    parts: Sequence[PartFn],
    points: Sequence[tuple[int, int]],
    axes: list[Axes],
    policies: Sequence[str],
    *,
    sp_on: bool,
    tensor_axes: Sequence[str],
) -> tuple[PartProfile, dict[str, tuple[PassAnalysis, PassAnalysis]]]:
    part = parts[0]
    passes = {}
    for pol in policies:
        traces = [vjp_jaxprs(p, pol) for p in parts]
        passes[pol] = _part_passes(traces, points, part, axes, sp_on=sp_on, tensor_axes=tensor_axes,
                                   gather_out_cotangents=name == "pre")
    fwd0, bwd0 = passes["none"]
    f0, b0 = fwd0.flops(), bwd0.flops()
    nd, no = len(part.diff), part.num_outputs
    weights = [v for v, k in zip(fwd0.g.invars[:nd], part.diff_kind) if k == WEIGHT]
    w_bytes = total(fwd0.local_bytes(v) for v in weights)
    w_params = total(_elems(fwd0, v) for v in weights)
    base_coll = {}
    for c in fwd0.res.collectives + bwd0.res.collectives:
        base_coll[c.kind] = base_coll.get(c.kind, ZERO) + c.nbytes * c.count
    saved, fpk, bpk, recompute, tp_re, kernels, stash = {}, {}, {}, {}, {}, {}, {}
    for pol, (fp, bp) in passes.items():
        kernels[f"fwd[{pol}]"], kernels[f"bwd[{pol}]"] = fp.kernels(), bp.kernels()
        saved[pol] = _saved(fp, part).to_sympy()
        stash[pol] = _stash(bp, part).to_sympy()
        fpk[pol] = fp.peak()
        wg = [v for v, k in zip(bp.g.outvars, part.diff_kind) if k == WEIGHT]
        bpk[pol] = bp.peak(exclude=wg)
        fl = fp.flops() + bp.flops() - f0 - b0
        recompute[pol] = fl.total.to_sympy()
        kinds = {}
        for c in fp.res.collectives + bp.res.collectives:
            kinds[c.kind] = kinds.get(c.kind, ZERO) + c.nbytes * c.count
        tp_re[pol] = {
            k: (kinds.get(k, ZERO) - base_coll.get(k, ZERO)).to_sympy() for k in set(kinds) | set(base_coll)
        }
    out_bytes = total(fwd0.local_bytes(v) for v in fwd0.g.outvars[:no] if isinstance(v, jex.Var))
    divisors = set()
    notes: list[str] = []
    for fp, bp in passes.values():
        divisors |= fp.res.divisors | bp.res.divisors
        notes += [n for n in fp.res.notes + bp.res.notes if n not in notes]
    return PartProfile(
        name=name,
        fwd_flops=f0.total.to_sympy(),
        bwd_flops=b0.total.to_sympy(),
        fwd_matmul_flops=f0.matmul.to_sympy(),
        bwd_matmul_flops=b0.matmul.to_sympy(),
        recompute_flops=recompute,
        weight_bytes=w_bytes.to_sympy(),
        weight_params=w_params.to_sympy(),
        saved_bytes=saved,
        stash_bytes=stash,
        fwd_peak_bytes=fpk,
        bwd_peak_bytes=bpk,
        output_bytes=out_bytes.to_sympy(),
        tp_collectives=tuple(fwd0.collectives("fwd") + bwd0.collectives("bwd")),
        tp_recompute=tp_re,
        tp_divisors=tuple(sorted((d.to_sympy() for d in divisors if d != Poly.const(1)), key=str)),
        notes=tuple(notes),
        fused_flops=(fwd0.fused_flops() + bwd0.fused_flops()).total.to_sympy(),
        fused_matmul_flops=(fwd0.fused_flops() + bwd0.fused_flops()).matmul.to_sympy(),
        fused_bytes=(fwd0.fused_bytes() + bwd0.fused_bytes()).to_sympy(),
        kernels=kernels,
    ), passes


def _elems(p: PassAnalysis, v: jex.Var) -> Poly:
    n = Poly.const(1)
    for d in p.res.local_dims(p.g, v, p.final.get(v, REP)):
        n = n * d
    return n


def block_tags(part: PartFn) -> tuple[str, ...]:
    """The ``checkpoint_name`` tags used in a part, in order of first use."""
    closed = jax.make_jaxpr(lambda d, nd: part.fn(d, nd))(list(part.diff), list(part.nondiff))
    g = build_graph(closed)
    return tuple(dict.fromkeys(n.params["name"] for n in g.walk() if n.prim == "name"))


# Primitives whose cost depends on run-time values (data-dependent loops) or happens outside XLA (host
# callbacks): the symbolic analysis cannot price them, so a block using one is refused up front.
UNSUPPORTED_PRIMITIVES = {"while": "a data-dependent while loop (use lax.scan / fori_loop with static bounds)",
                          "pure_callback": "a host callback", "io_callback": "a host callback",
                          "debug_callback": "a host callback (jax.debug.print / callback)"}


class UnsupportedPrimitiveError(ValueError):
    """The layer block uses a primitive the cost model cannot price."""


def check_block_primitives(closed: jex.ClosedJaxpr) -> None:
    """Raise `UnsupportedPrimitiveError` if the block jaxpr (or a sub-jaxpr) uses an unpriceable primitive."""
    for eqn in iter_eqns(closed, bodies=True):
        why = UNSUPPORTED_PRIMITIVES.get(eqn.primitive.name)
        if why is not None:
            raise UnsupportedPrimitiveError(
                f"the layer block uses `{eqn.primitive.name}` ({why}), which mistjax's cost model cannot price; "
                "remove it from the block (e.g. move debug prints out of the model) or pass plan=... to "
                "autoshard to skip tuning")


def analysis_points(seq_len: int | None = None) -> list[tuple[tuple[int, int], ...]]:
    """The ``(b, s)`` point sets the analysis tries, in order, for a batch of ``seq_len`` tokens per sequence.

    The first set never traces a sequence longer than the batch's: code may not run there (a position
    table of exactly ``seq_len`` rows). `DEFAULT_POINTS` come first when they fit (their profiles are
    cached across batch shapes), then `block.fit_points` around the real length (``s, s/2, s/4`` and
    ``3s/4``, so the real size itself is traced and a length's divisibility is kept). Below 32 tokens the
    default points follow as a last resort (they trace up to 32).
    """
    if seq_len is None or seq_len < 4:
        return [DEFAULT_POINTS]
    own = tuple(fit_points(DEFAULT_POINTS[0][0], seq_len))
    if max(s for _, s in DEFAULT_POINTS) <= seq_len:
        return [DEFAULT_POINTS, own]
    # Shorter batches: their own lengths first; the default points (longer sequences) only when those fail,
    # e.g. a blockwise kernel's block divides the default lengths but not s/4 (`fused.check_blocks`).
    return [own, DEFAULT_POINTS]


def trace_point(fun: LossFn, params: PyTree, batch_fn: Callable[[int, int], tuple[PyTree, ...]],
                point: tuple[int, int], seq_len: int | None = None) -> TracedLoss:
    """``fun`` traced at one analysis point; a failure raises `StructureError` naming the user's line.

    Raises:
      StructureError: the loss does not trace at ``point`` (a size the batch does not have).
    """
    b, s = point
    try:
        return trace_loss(fun, params, *batch_fn(b, s))
    except StructureError:
        raise
    except (TypeError, ValueError, IndexError) as e:
        raise untraceable_error(e, point, seq_len) from None  # the message names the error and the user line


def untraceable_error(error: Exception, point: tuple[int, int], seq_len: int | None) -> StructureError:
    """The error for a loss that fails to trace at an analysis point: the size, the user's line and the fix."""
    where = exception_line(error.__traceback__)
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    upto = f" up to the {seq_len} tokens of the batch" if seq_len else ""
    return StructureError(
        f"the loss fails to trace at micro-batch {point[0]}, sequence length {point[1]}"
        f"{f' at {where}' if where else ''}: {type(error).__name__}: {first}. The step analysis traces the loss at "
        f"a few batch sizes and sequence lengths{upto} to learn how its cost grows with them; make that line work "
        "for any length up to the batch's (e.g. add a position table sliced to the sequence, "
        "pos[:ids.shape[1]], not the whole table), or pass plan=... (or workload=...) to autoshard to skip the "
        "analysis (docs/errors.md, StructureError)")


def first_trace(fun: LossFn, params: PyTree, batch_fn: Callable[[int, int], tuple[PyTree, ...]] = token_batch,
                seq_len: int | None = None) -> TracedLoss:
    """``fun`` traced at the first point of the first `analysis_points` set that traces (for the leaf table
    and the tensor-parallel roles, which need one trace).

    Raises:
      StructureError: the loss traces at none of the sets' first points (the first set's error).
    """
    errors: list[StructureError] = []
    for points in analysis_points(seq_len):
        try:
            return trace_point(fun, params, batch_fn, points[0], seq_len)
        except StructureError as e:
            errors.append(e)
    raise errors[0]


def analyze_model(
    fun: LossFn,
    params: PyTree,
    batch_fn: Callable[[int, int], tuple[PyTree, ...]] = token_batch,
    *,
    param_axes: PyTree | None = None,
    policies: Sequence[str] | None = None,
    points: Sequence[tuple[int, int]] | None = None,
    seq_len: int | None = None,
    sequence_parallel: bool = True,
    tensor_axes: Sequence[str] = TENSOR_AXES,
    cache: bool | str | Path | None = False,
) -> ModelProfile:
    """Symbolic per-device profile of the loss ``fun(params, *batch_fn(b, s))``.

    Args:
      fun: the loss, e.g. ``models.make_loss_fn(graphdef)``; its first output is
        differentiated. It must run its layers as a scan over stacked parameters.
      params: parameter pytree (arrays, ShapeDtypeStructs or an ``nnx.State``).
      batch_fn: ``(b, s) -> rest`` the other arguments of ``fun`` at micro-batch ``b`` and
        sequence length ``s`` (ShapeDtypeStructs are enough); default `token_batch`.
      param_axes: logical axis names per parameter leaf (a list aligned with the leaves, or a
        pytree of tuples such as ``models.logical_axes(model)``); default: read from
        ``nnx.Variable`` metadata in ``params``. Leaves without names stay replicated.
      policies: remat policies to analyse for the block (``none`` is always included); default
        ``none, full, dots``, one ``names:<tag>`` per checkpoint name in the block, and
        ``names:<all tags>``.
      points: seven ``(b, s)`` sizes: six to fit (two b values x three s values), one to check;
        default: the sets of `analysis_points` (``seq_len``), tried in turn until one analyses.
      seq_len: the batch's sequence length: the first default point set traces no longer sequence
        (`analysis_points`; None: `DEFAULT_POINTS` only).
      sequence_parallel: Megatron sequence parallelism for ``t > 1`` (the hidden state between
        layers split along the sequence).
      tensor_axes: logical axis names split over the ``tensor`` mesh axis.
      cache: look the profile up on disk and store it there (`mistjax.analysis.cache`): True for the
        default directory (``$MISTJAX_CACHE_DIR`` or the user's cache dir), a path, or False. A cached
        profile has no ``passes`` (the analysed graphs are not stored).

    Returns:
      A `ModelProfile`; `compile_profile` turns it into vectorised NumPy functions.

    Raises:
      StructureError: the loss fails to trace at a point, or its traces differ in structure, at every
        point set (the first set's error, naming the user's line and the fix), and with ``seq_len`` also
        at three batch sizes of that length alone (`fixed_length_points`; when those analyse, a
        `FixedLengthWarning` quotes the first error instead).
    """
    sets = [tuple(tuple(p) for p in points)] if points is not None else analysis_points(seq_len)
    axes = _flat_axes(params, param_axes)
    errors: list[ValueError] = []
    fixed = [fixed_length_points(seq_len)] if points is None and seq_len is not None else []
    for pts in [*sets, *fixed]:
        try:
            profile = _analyze_at(fun, params, batch_fn, pts, axes, policies, seq_len=seq_len,
                                  sequence_parallel=sequence_parallel, tensor_axes=tensor_axes, cache=cache)
        except FitError as e:
            errors.append(StructureError(f"{e}; the computation's shapes are not polynomials of the batch and "
                                         "sequence size there (docs/errors.md, StructureError)"))
            continue
        except (StructureError, BlockSizeError) as e:
            errors.append(e)
            continue
        if errors:  # only the batch's own length analysed: say why, and what the profile then holds for
            warnings.warn(f"{errors[0]} -- analysed at the batch's sequence length {seq_len} alone instead: the "
                          f"plan's time and memory predictions hold for {seq_len} tokens per sequence, and context "
                          "and sequence parallelism are not priced", FixedLengthWarning, stacklevel=2)
        return profile
    raise errors[0]  # the first set's: the one closest to what the user runs


class FixedLengthWarning(RuntimeWarning):
    """The loss was analysed at the batch's own sequence length only (it traces at no shorter one)."""


def fixed_length_points(seq_len: int) -> tuple[tuple[int, int], ...]:
    """The last resort of `analyze_model`: three batch sizes at the batch's own sequence length, for a loss
    that traces at no other length (the whole position table added to the tokens) or takes another path
    there. Sizes are then fitted in ``b`` alone (`poly.fit_dim`); the profile holds at ``seq_len``."""
    b = DEFAULT_POINTS[0][0]
    return ((b, seq_len), (b + 1, seq_len), (b + 2, seq_len))


def _analyze_at(fun: LossFn, params: PyTree, batch_fn: Callable[[int, int], tuple[PyTree, ...]],
                points: Sequence[tuple[int, int]], axes: list[Axes], policies: Sequence[str] | None, *,
                seq_len: int | None, sequence_parallel: bool, tensor_axes: Sequence[str],
                cache: bool | str | Path | None) -> ModelProfile:
    """`analyze_model` at one point set (the on-disk cache looked up and filled)."""
    points = [(int(b), int(s)) for b, s in points]
    first = trace_point(fun, params, batch_fn, points[0], seq_len)
    refuse_moe(first.closed)  # MoE layers are not priced yet (issue #51): a clear error, not a wrong profile
    directory = cache_dir(cache)
    key = ""
    if directory is not None:
        shapes = [[(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(batch_fn(b, s))] for b, s in points]
        options = {"points": points, "shapes": shapes, "axes": axes, "policies": policies,
                   "sp": sequence_parallel, "tensor_axes": list(tensor_axes)}
        key = profile_key(str(first.closed), options)
        hit = load_profile(directory, key)
        if hit is not None:
            return hit
    traced = [first] + [trace_point(fun, params, batch_fn, p, seq_len) for p in points[1:]]
    profile = _profile(traced, points, axes, policies, sequence_parallel=sequence_parallel, tensor_axes=tensor_axes)
    if directory is not None:
        save_profile(directory, key, profile)
    return profile


def _block_policies(tags: Sequence[str], policies: Sequence[str] | None) -> list[str]:
    """The remat policies analysed for the block: ``none`` first; by default the base policies, one per
    checkpoint name in the block and one for all of them."""
    if policies is None:
        policies = list(BASE_POLICIES) + [f"names:{t}" for t in tags]
        if len(tags) > 1:
            policies.append("names:" + ",".join(tags))
    return ["none"] + [p for p in dict.fromkeys(policies) if p != "none"]


def _profile(traced: Sequence[TracedLoss], points: Sequence[tuple[int, int]], axes: list[Axes],
             policies: Sequence[str] | None, *, sequence_parallel: bool, tensor_axes: Sequence[str]) -> ModelProfile:
    """`analyze_model` from the loss traced at each of ``points``."""
    if traced[0].groups is not None:  # an unrolled stack: the jaxprs read virtual (stacked) leaves
        axes = traced[0].groups.virtual_axes(axes)
    if traced[0].stack is not None:
        check_block_primitives(traced[0].stack.body)
        check_blocks(traced[0].stack.body, [s for _, s in points])
    parts = [split_parts(t) for t in traced]
    tags = block_tags(parts[0]["block"])
    policies = _block_policies(tags, policies)
    out, passes = {}, {}
    for name in ("pre", "block", "post"):
        out[name], passes[name] = _analyze_part(
            name, [p[name] for p in parts], points, axes, policies if name == "block" else ["none"],
            sp_on=sequence_parallel, tensor_axes=tensor_axes)
    return ModelProfile(pre=out["pre"], block=out["block"], post=out["post"], num_layers=traced[0].stack.num_layers,
                        points=tuple(points), sequence_parallel=sequence_parallel, tags=tags, passes=passes)
