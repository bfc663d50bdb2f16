"""One pipeline stage's programs for the MPMD executor: forward, backward, fused last stage, finish.

Each stage of an MPMD plan runs on its own sub-mesh ``(stage=1, replica, shard_node, shard_local,
tensor)`` with its own one-stage `Plan` (its layer count, ZeRO level, remat, offload). A stage's
programs are the unpipelined runtime's machinery (`mistjax.runtime.grads`) restricted to its layers:
one ``jax.shard_map`` manual over the data-parallel axes with ``tensor`` left to GSPMD; parameters
fetched as the stage's layouts say (`grads.make_fetch`: ZeRO-3 all-gathers, host->device copies); the
plan's layer loop (`remat.make_layer_loop`: checkpointed / activation-offloaded / plain layers, the
re-fetching custom VJP, the Megatron block of `runtime.tensor`); gradients reduce-scattered per
micro-batch under ZeRO-2 and synchronised once per step by `finish` (`grads.finish_grads`).

The stage function maps ``(held params, (activation in, micro-batch))`` to the activation out (or,
on the last stage, to the loss): the first stage runs the loss's pre part (embedding, `trace.split`),
the last its post part (head, loss); scan constants computed from the batch alone are recomputed on
every stage, those computed from parameters travel with the activation.

* ``forward``: ``jax.vjp`` of the stage function; it returns the activation and only the residual
  leaves that depend on the activation or the micro-batch (`residuals.classify`), so no weight, fetched
  weight or weight-derived value is kept between the programs. Plain layers run under the re-fetching
  VJP (`refetch_plain`), so a layer's weight-only residuals are dropped too.
* ``backward``: a fresh ``jax.vjp`` at a zero activation supplies the weight-only residuals (ZeRO-3 /
  offloaded weights are fetched again, as in the unpipelined runtime), the stored leaves go back in
  (`residuals.restore_vjp`), and the weight gradients are added into the donated accumulator.
* ``last``: forward, loss and backward of one micro-batch on the last stage in one program; it keeps
  no residuals and never the logits.
* ``finish``: the end-of-step gradient synchronisation over the stage's data-parallel devices, the
  ``1 / (dp G)`` scale, the loss, and zeroed accumulators for the next step (in the donated buffers).
* ``split``: the stage's batch leaves into ``G`` micro-batches without moving rows across devices.

Per-device values that live between programs (residuals, accumulators, loss sums) are global arrays
whose leading dim is split over the data-parallel axes (a scalar gets a leading dim of one first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from mistjax.core.execution import StageExecution, StageLeaf
from mistjax.core.jaxpr import Value
from mistjax.core.layout import DP_AXES, PARAM, LeafLayout, shard_split
from mistjax.core.plan import Plan
from mistjax.core.types import LossFn, PyTree
from mistjax.runtime import xla_flags
from mistjax.runtime.grads import (
    MANUAL_AXES,
    finish_grads,
    make_fetch,
    psum_live,
    scatter_grad,
    sequence_axes,
    split_microbatches,
    stage_execution,
    stage_layer_loop,
    to_device,
    to_host,
)
from mistjax.runtime.mesh import split_batch_spec
from mistjax.runtime.remat import LayerLoop, LoopSinks
from mistjax.runtime.residuals import Residuals, classify, restore_vjp
from mistjax.trace.split import (
    BlockFn,
    PartUsage,
    TracedLoss,
    post_part,
    pre_part,
    run_block,
    scan_operands,
)

Program: TypeAlias = jax.stages.Wrapped  # a stage program: a jitted function of the stage's arrays (pytrees in, out)


@dataclass
class LossInfo:
    """What every stage needs to know about the user's loss (shared by all stages of a plan)."""

    fun: LossFn  # the loss ``fun(params, *rest)``
    has_aux: bool  # fun returns (loss, aux)
    traced: TracedLoss  # fun traced at one device's micro-batch (global parameter shapes)
    usage: PartUsage  # which parameters the pre / post parts read
    is_batch: tuple[bool, ...]  # per rest leaf: split over DP and micro-batches
    mb_avals: tuple[jax.ShapeDtypeStruct, ...]  # per rest leaf: one device's micro-batch (non-batch: whole)
    h_avals: tuple[jax.ShapeDtypeStruct, ...]  # one device's activation: param-dependent consts, then carry
    aux_avals: tuple[jax.ShapeDtypeStruct, ...]  # per aux leaf of the loss
    grad_accum: int  # G
    dp: int  # data-parallel degree of every stage
    tp: int  # tensor-parallel degree of every stage
    cp: int = 1  # context-parallel degree of every stage
    tp_block: BlockFn | None = None  # the layer's block (`grads.layer_block`: Megatron TP, context attention)

    @property
    def num_params(self) -> int:
        """Parameter leaves of the loss as the step passes them (an unrolled stack's real ones)."""
        return self.traced.num_real_params

    @property
    def pconst_positions(self) -> list[int]:
        """Scan const operands computed from parameters (sent with the activation)."""
        return [j for j, dep in enumerate(self.usage.const_needs_params) if dep]

    @property
    def bconst_positions(self) -> list[int]:
        """Scan const operands computed from the batch alone (recomputed on every stage)."""
        return [j for j, dep in enumerate(self.usage.const_needs_params) if not dep]


@dataclass
class StageSpec:
    """One (virtual) pipeline stage: its layers, its own plan and sub-mesh, the parameters it holds."""

    index: int  # virtual stage k (chunk order)
    num_stages: int  # K virtual stages in the plan
    layers: tuple[int, int]  # [start, end) of the model's layer stack
    plan: Plan  # one-stage plan of this stage's layers and memory choices (layers (0, n))
    mesh: Mesh  # the stage's devices as the runtime mesh with a size-1 stage axis
    params: tuple[int, ...]  # flat loss-parameter indices held here, ascending
    layouts: tuple[LeafLayout, ...]  # per held parameter: its storage layout on this stage
    acc_host: tuple[bool, ...]  # per held parameter: gradient accumulator kept in host memory
    uses_batch: bool = True  # reads the loss's other arguments (first / last stage, batch-only consts)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


def activation_sharding(mesh: Mesh, aval: jax.ShapeDtypeStruct, tp: int, cp: int = 1) -> NamedSharding:
    """How an activation leaves one stage and enters the next: batch over DP, a hidden state's sequence over
    ``context`` and ``tensor`` as between the layers (`grads.sequence_axes`)."""
    if not aval.shape:
        return NamedSharding(mesh, P())
    if jnp.issubdtype(aval.dtype, jnp.inexact) and (axes := sequence_axes(aval.shape, tp, cp)) is not None:
        return NamedSharding(mesh, P(DP_AXES, axes, None))
    return NamedSharding(mesh, P(DP_AXES))


def _param_leaf(i: int | None) -> int:
    """A scanned operand's parameter leaf: a stage's layer loop scans only parameter stacks."""
    assert i is not None, "a stage's layer loop scans a value that is not a parameter"
    return i


def _traced(xs: list[Value]) -> list[jax.Array]:
    """A stage program's values as the arrays (tracers) they are (`trace.split` types them as jaxpr values)."""
    return cast(list[jax.Array], xs)


def _local_dp(x: Value) -> jax.Array:
    """A per-device value as the local block of a global array split over DP on a leading dim."""
    a = cast(jax.Array, x)  # a stage program's values are traced arrays
    return a[None] if a.ndim == 0 else a


def _acc_dtype(dtype: DTypeLike) -> np.dtype:
    return np.dtype(jnp.promote_types(dtype, jnp.float32)) if jnp.issubdtype(dtype, jnp.inexact) else np.dtype(dtype)


def _grad_acc_dtype(dtype: DTypeLike, plan: Plan) -> np.dtype:
    """A gradient accumulator's dtype: the plan's gradient dtype, else the parameter's (as `runtime.grads`)."""
    return np.dtype(plan.grad_dtype) if plan.grad_dtype is not None else np.dtype(dtype)


@dataclass
class StageArrays:
    """One stage's arrays: the layouts, shardings and avals of what its programs take and return (its
    programs: `StagePrograms`)."""

    spec: StageSpec
    info: LossInfo
    _cache: dict[str, Any] = field(default_factory=dict)  # lazily built values of several types, one per name

    def __post_init__(self) -> None:
        sp = self.spec
        zero = sp.plan.stages[0].zero_stage
        self.grad_specs = [StageLeaf(lay, zero if lay.role == PARAM else 0) for lay in sp.layouts]
        self.pos = {i: j for j, i in enumerate(sp.params)}
        self.num_h = len(self.info.h_avals)
        self.h_float = [bool(jnp.issubdtype(a.dtype, jnp.inexact)) for a in self.info.h_avals]

    def _param_in_specs(self) -> list[P]:
        return [g.layout.manual_spec(sharded=g.weights_sharded) for g in self.grad_specs]

    @property
    def mb_avals(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """One device's micro-batch of the loss's other arguments (none if the stage does not read them)."""
        return self.info.mb_avals if self.spec.uses_batch else ()

    def _mb_specs(self) -> list[P]:
        return [P(DP_AXES) if b else P() for b in self.info.is_batch] if self.spec.uses_batch else []

    def h_shardings(self) -> list[NamedSharding]:
        if "h_shardings" not in self._cache:  # looked up per dispatched op: computed once
            self._cache["h_shardings"] = [activation_sharding(self.spec.mesh, a, self.info.tp, self.info.cp)
                                          for a in self.info.h_avals]
        return self._cache["h_shardings"]

    def ct_shardings(self) -> list[NamedSharding]:
        """Shardings of the cotangents this stage receives (its activation's float leaves)."""
        return [s for s, f in zip(self.h_shardings(), self.h_float) if f]

    def grad_local_shape(self, j: int) -> tuple[int, ...]:
        """One device's gradient of held parameter `j` (split over the partition group under ZeRO-2/3)."""
        g = self.grad_specs[j]
        shape = list(g.layout.shape)
        if (g.weights_sharded or g.scatter_each_microbatch) and g.layout.shard_dim is not None:
            shape[g.layout.shard_dim] //= self.spec.plan.shard_group
        return tuple(shape)

    def acc_avals(self) -> list[jax.ShapeDtypeStruct]:
        if "acc_avals" in self._cache:
            return self._cache["acc_avals"]
        dp = self.info.dp
        out = []
        for j in range(len(self.grad_specs)):
            shape = (dp, *self.grad_local_shape(j))
            dtype = _grad_acc_dtype(self._param_dtype(j), self.spec.plan)
            out.append(jax.ShapeDtypeStruct(shape, dtype, sharding=self._acc_sharding(j)))
        self._cache["acc_avals"] = out
        return out

    def _param_dtype(self, j: int) -> np.dtype:
        return np.dtype(self.info.traced.param_aval(self.spec.params[j]).dtype)

    def _acc_sharding(self, j: int) -> NamedSharding:
        lay = self.grad_specs[j].layout
        entries = ["tensor" if d in lay.tensor_dims else None for d in range(len(lay.shape))]
        return NamedSharding(self.spec.mesh, P(DP_AXES, *entries),
                             memory_kind="pinned_host" if self.spec.acc_host[j] else None)

    def loss_acc_avals(self) -> list[jax.ShapeDtypeStruct]:
        """Per-device sums of the loss and of every aux leaf over the step's micro-batches."""
        dp = self.info.dp
        sh = NamedSharding(self.spec.mesh, P(DP_AXES))
        return [jax.ShapeDtypeStruct((dp, *a.shape), _acc_dtype(a.dtype), sharding=sh)
                for a in (jax.ShapeDtypeStruct((), np.float32), *self.info.aux_avals)]

    def grad_shardings(self) -> list[NamedSharding]:
        """Where `finish` leaves each gradient: the ZeRO >= 1 split over the partition group (and over ``context``
        where the optimizer state is: `_grad_layout`), TP dims."""
        if "grad_shardings" not in self._cache:
            self._cache["grad_shardings"] = [NamedSharding(self.spec.mesh, self._grad_layout(g).spec())
                                             for g in self.grad_specs]
        return self._cache["grad_shardings"]

    def _grad_layout(self, g: StageLeaf) -> LeafLayout:
        """Where `finish` leaves one gradient: split over the partition group under ZeRO >= 1 and, where the
        optimizer state is split over ``context`` too (`core.layout.shard_split`), over ``context`` as well: the
        update reads only its slice (each context device holds the whole reduced gradient, so the slice moves
        nothing), not the whole gradient beside the state."""
        lay = dataclasses.replace(g.layout, sharded=g.out_sharded, host=False, stage_split=False)
        if lay.role != PARAM or g.zero < 1 or not lay.shape or int(np.prod(lay.shape)) <= 1:
            return lay
        dim, context_split = shard_split(lay.shape, lay.axes, lay.tensor_dims, lay.stacked, self.spec.plan)
        return dataclasses.replace(lay, shard_dim=dim, sharded=True, context_split=True) if context_split else lay

    def _shard_map(self, body: Callable[..., PyTree], in_specs: PyTree, out_specs: PyTree) -> Callable[..., PyTree]:
        return jax.shard_map(body, mesh=self.spec.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=MANUAL_AXES, check_vma=False)

    def _jit(self, fn: Callable[..., PyTree], **kwargs: Any) -> Program:
        """``jax.jit`` with the XLA settings of the stage's platform, as the one-stage step compiles
        (`xla_flags.compiler_options`)."""
        return jax.jit(fn, compiler_options=xla_flags.compiler_options(self.spec.mesh.devices.flat[0].platform),
                       **kwargs)

    def param_avals(self) -> list[jax.ShapeDtypeStruct]:
        """The held parameters as stored on this stage (global piece shapes, storage shardings)."""
        out = []
        for j, g in enumerate(self.grad_specs):
            lay = g.layout
            sh = NamedSharding(self.spec.mesh, lay.spec(), memory_kind="pinned_host" if lay.host else None)
            out.append(jax.ShapeDtypeStruct(lay.shape, self._param_dtype(j), sharding=sh))
        return out

    def h_global_avals(self) -> list[jax.ShapeDtypeStruct]:
        """The activation entering this stage as global arrays (one device's block x DP on dim 0)."""
        return [jax.ShapeDtypeStruct(_dp_global(a.shape, self.info.dp), a.dtype, sharding=s)
                for a, s in zip(self.info.h_avals, self.h_shardings())]

    def mb_global_avals(self) -> list[jax.ShapeDtypeStruct]:
        """One micro-batch's rest leaves as global arrays on this stage."""
        return [jax.ShapeDtypeStruct(_dp_global(a.shape, self.info.dp) if b else a.shape, a.dtype,
                                     sharding=self._mb_sharding(a) if b else NamedSharding(self.spec.mesh, P()))
                for a, b in zip(self.mb_avals, self.info.is_batch)]

    def _mb_sharding(self, aval: jax.ShapeDtypeStruct) -> NamedSharding:
        """A micro-batch's batch leaf: rows over DP, its sequence over ``context`` (`mesh.split_batch_spec`)."""
        return NamedSharding(self.spec.mesh, split_batch_spec(aval.shape, self.info.cp))

    def _h_in_specs(self) -> list[P]:
        return [P(DP_AXES) if a.shape else P() for a in self.info.h_avals] if not self.spec.first else []


@dataclass
class StagePrograms(StageArrays):
    """The jitted programs of one stage (built on first use; see module docstring)."""

    # ------------------------------------------------------------------ the stage function
    @property
    def execution(self) -> StageExecution:
        """How this stage runs (`core.execution`): its layer scans, fetches and in-loop accumulation."""
        if "execution" not in self._cache:
            self._cache["execution"] = stage_execution(
                self.info.traced, self.grad_specs, self.spec.acc_host, self.pos.get, stage=self.spec.plan.stages[0],
                grad_accum=self.info.grad_accum, mesh=self.spec.mesh, pipelined=True)
        return self._cache["execution"]

    def _layer_loop(self) -> LayerLoop:
        traced = self.info.traced
        return stage_layer_loop(traced, self.execution, self.spec.plan.stages[0], self.grad_specs,
                                lambda i: self.pos[traced.real_index(i)], self.spec.plan)

    @property
    def in_loop(self) -> tuple[int, ...]:
        """Held parameters whose gradients the backward adds into the accumulator inside the layer loop
        (`runtime.accumulate`): stacked weights read by the layer loop only, with device accumulators."""
        return tuple(sorted(self.execution.in_loop))

    def sink_fn(self, p: list[jax.Array]
                ) -> Callable[[tuple[list[jax.Array | None], list[jax.Array]], PyTree], PyTree]:
        """The stage function differentiated with in-loop accumulation.

        ``fn((rest, sink), hx) -> (outs, sink)``: `rest` are the held parameters without the `in_loop`
        ones (None there; those are read from `p` and not differentiated), `sink` their accumulators
        (one device's, without the DP dim), passed through unchanged; seeding the cotangent of the
        output `sink` with the accumulator makes its cotangent the accumulated gradient.
        """
        fn, in_loop = self.stage_fn(), self.in_loop

        def run(w: tuple[list[jax.Array | None], list[jax.Array]], hx: PyTree) -> PyTree:
            rest, sink = w
            full = [p[j] if j in in_loop else v for j, v in enumerate(rest)]
            return fn(full, hx, dict(zip(in_loop, sink)))

        return run

    def split_params(self, p: list[jax.Array]) -> list[jax.Array | None]:
        """The held parameters with the `in_loop` ones left out (see `sink_fn`)."""
        return [None if j in self.in_loop else v for j, v in enumerate(p)]

    def zero_sink(self) -> list[jax.Array]:
        """Placeholder accumulators for the forward program (passed through unused: dead code for XLA)."""
        avals = self.acc_avals()
        return [jnp.zeros(avals[j].shape[1:], avals[j].dtype) for j in self.in_loop]

    def stage_fn(self) -> Callable[..., PyTree]:
        """``fn(held params, (activation, micro-batch)[, sink])`` -> activation out, or ``[loss, *aux]`` (last);
        with ``sink`` (in-loop accumulators by held position), ``(outs, the accumulators after the loop)``."""
        sp, info = self.spec, self.info
        traced, st = info.traced, info.traced.require_stack()
        loop = self._layer_loop()
        pconst, bconst = info.pconst_positions, info.bconst_positions
        nc = st.num_consts
        in_stack = traced.layer_leaves()

        def fn(p_held: list[jax.Array], hx: tuple[list[jax.Array], list[jax.Array]],
               sink: dict[int, jax.Array] | None = None) -> PyTree:
            h, mb = hx
            # Per parameter leaf / loop constant: its traced array, None where this stage holds none (the stage's
            # traced parts read only what it holds); `trace.split` types these as values of a jaxpr evaluation.
            leaves: list[Any] = [None] * info.num_params
            consts: list[Any]
            carry: list[Any]
            for j, i in enumerate(sp.params):
                f = None if i in in_stack else make_fetch(self.grad_specs[j], False)
                leaves[i] = p_held[j] if f is None else f(p_held[j])
            if sp.first:
                pre_consts, pre_carry = pre_part(traced, leaves, mb)
                consts, carry = list(pre_consts), list(pre_carry)
            else:
                carry = list(h[len(pconst):])
                consts = [None] * nc
                for j, v in zip(pconst, h[: len(pconst)]):
                    consts[j] = v
                for j, x in zip(bconst, scan_operands(traced, leaves, mb, bconst)):
                    consts[j] = x
            # The layer loop's operands: a scanned stack's row pieces, or LayerSlices of an unrolled stack's
            # per-layer leaves (this stage's layers: `TracedLoss.for_layers`), fetched per layer by the loop.
            held: list[Any] = [None] * info.num_params
            for j, i in enumerate(sp.params):
                held[i] = p_held[j]
            virtual = traced.virtual(held)
            xs: list[Any] = [virtual[_param_leaf(i)] for i in st.xs_leaf]  # arrays, or an unrolled stack's slices

            def body(c: list[jax.Array], car: list[jax.Array], x: list[jax.Array]
                     ) -> tuple[list[jax.Array], list[jax.Array]]:
                out, ys = run_block(st, c, car, x, info.tp_block)
                return _traced(out), _traced(ys)
            by_pos: dict[int, jax.Array] = {}
            if not sink:  # no in-loop accumulation (always so for an unrolled stack)
                carry, _ = loop(body, list(consts), list(carry), xs)
            else:
                leaf_pos = [self.pos[_param_leaf(i)] for i in st.xs_leaf]
                out = loop.run(body, list(consts), list(carry), xs, LoopSinks([sink.get(p) for p in leaf_pos]))
                carry = out.carry
                assert out.accs is not None  # the loop feeds the sinks it was given
                by_pos = {p: a for p, a in zip(leaf_pos, out.accs) if a is not None}
            outs = post_part(traced, leaves, mb, carry) if sp.last else [*(consts[j] for j in pconst), *carry]
            return outs if sink is None else (outs, [by_pos[j] for j in sorted(sink)])

        return fn

    def _zero_hx(self) -> tuple[list[jax.Array], list[jax.Array]]:
        h = [jnp.zeros(a.shape, a.dtype) for a in self.info.h_avals] if not self.spec.first else []
        return h, [jnp.zeros(a.shape, a.dtype) for a in self.mb_avals]

    def _add_grads(self, acc: list[jax.Array], g: list[jax.Array], g_sink: list[jax.Array]) -> list[jax.Array]:
        """The accumulators after one micro-batch: the `in_loop` ones are `g_sink` (already summed inside
        the backward), the others take this micro-batch's gradient `g`."""
        out, sunk = [], dict(zip(self.in_loop, g_sink))
        for j, (a, gi, spec, host) in enumerate(zip(acc, g, self.grad_specs, self.spec.acc_host)):
            if j in sunk:
                out.append(sunk[j].reshape(a.shape))
                continue
            gi = to_device(gi, spec.layout.host)  # a host-streamed weight's gradient arrives in host memory
            if spec.scatter_each_microbatch:
                gi = scatter_grad(gi, spec)
            a = to_device(a, host)
            out.append(to_host(a + gi[None].astype(a.dtype), host))
        return out

    def _sink_seed(self, acc: list[jax.Array]) -> list[jax.Array]:
        """One device's accumulators of the `in_loop` parameters (the DP dim of one dropped: a bitcast)."""
        return [acc[j].reshape(acc[j].shape[1:]) for j in self.in_loop]

    def classify(self) -> Residuals:
        """Which of the stage's vjp residual leaves `forward` keeps (traced abstractly inside the
        stage's shard_map, whose fetches and collectives need the manual axes)."""
        if "residuals" not in self._cache:
            box: list[Residuals] = []

            def body(p: list[jax.Array], h: list[jax.Array], mb: list[jax.Array]) -> jax.Array:
                box.append(classify(self.sink_fn(p), (self.split_params(p), self.zero_sink()), (h, mb)))
                return jnp.zeros(())

            run = self._shard_map(body, (self._param_in_specs(), self._h_in_specs(), self._mb_specs()), P())
            jax.eval_shape(run, self.param_avals(), self.h_global_avals() if not self.spec.first else [],
                           self.mb_global_avals())
            self._cache["residuals"] = box[0]
        return self._cache["residuals"]

    # ------------------------------------------------------------------ programs
    def forward(self) -> Program:
        """``(params, h, mb) -> (h_out, stored residuals)``; the first stage takes no ``h``."""
        if "forward" in self._cache:
            return self._cache["forward"]
        first = self.spec.first

        def body(p: list[jax.Array], h: list[jax.Array], mb: list[jax.Array]) -> PyTree:
            # The backward's function (with placeholder accumulators), so the residuals line up.
            fn, w = self.sink_fn(p), (self.split_params(p), self.zero_sink())
            res = classify(fn, w, (h, mb))
            if len(res.stored) != n_res:
                raise RuntimeError("the stage's residuals changed between two traces of the same program")
            (out, _), vjp = jax.vjp(fn, w, (h, mb))
            return out, [_local_dp(r) for r in res.take(vjp)]

        n_res = len(self.classify().stored)
        run = self._shard_map(body, (self._param_in_specs(), self._h_in_specs(), self._mb_specs()),
                              ([P(DP_AXES) if a.shape else P() for a in self.info.h_avals], [P(DP_AXES)] * n_res))
        out_sh = (self.h_shardings(), [None] * n_res)
        if first:
            prog = self._jit(lambda p, mb: run(p, [], mb), out_shardings=out_sh)
        else:
            prog = self._jit(run, out_shardings=out_sh)
        self._cache["forward"] = prog
        return prog

    def backward_local(self, p: list[jax.Array], stored: list[jax.Array], ct: list[jax.Array], acc: list[jax.Array]
                       ) -> tuple[list[jax.Array], list[jax.Array]]:
        """One device's backward of one micro-batch: ``(ct_in, acc)`` (inside the stage's shard_map)."""
        res = self.classify()
        stored = [s.reshape(shape) for s, (shape, *_) in zip(stored, res.avals)]
        zero, seed = self._zero_hx(), self._sink_seed(acc)
        fn, w = self.sink_fn(p), (self.split_params(p), seed)
        live = classify(fn, w, zero)
        fresh = jax.vjp(fn, w, zero)[1]
        ct_full = [c if f else np.zeros(a.shape, jax.dtypes.float0)
                   for c, f, a in zip(ct, self.h_float, self.info.h_avals)]
        (g_p, g_sink), (g_h, _) = restore_vjp(fresh, live, stored)((ct_full, seed))
        acc = self._add_grads(acc, list(g_p), list(g_sink))
        return [g for g, f in zip(g_h, self.h_float) if f], acc

    def backward(self) -> Program:
        """``(params, stored, ct_out, acc) -> (ct_in, acc)``; the first stage returns only ``acc``."""
        if "backward" in self._cache:
            return self._cache["backward"]
        first, res = self.spec.first, self.classify()

        def body(p: list[jax.Array], stored: list[jax.Array], ct: list[jax.Array], acc: list[jax.Array]) -> PyTree:
            g_h, acc = self.backward_local(p, stored, ct, acc)
            return (acc,) if first else (g_h, acc)

        h_float_specs = [P(DP_AXES) if a.shape else P() for a, f in zip(self.info.h_avals, self.h_float) if f]
        acc_specs = [P(DP_AXES)] * len(self.spec.params)
        outs = (acc_specs,) if first else (h_float_specs, acc_specs)
        run = self._shard_map(body, (self._param_in_specs(), [P(DP_AXES)] * len(res.stored), h_float_specs,
                                     acc_specs), outs)
        acc_sh = [a.sharding for a in self.acc_avals()]
        h_sh = [s for s, f in zip(self.h_shardings(), self.h_float) if f]
        prog = self._jit(run, out_shardings=(acc_sh,) if first else (h_sh, acc_sh), donate_argnums=(3,))
        self._cache["backward"] = prog
        return prog

    def last_local(self, p: list[jax.Array], h: list[jax.Array], mb: list[jax.Array], acc: list[jax.Array],
                   lacc: list[jax.Array]) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
        """One device's forward, loss and backward of one micro-batch on the last stage: ``(ct_in, acc, lacc)``."""
        h_int = [x for x, f in zip(h, self.h_float) if not f]
        fn, seed = self.sink_fn(p), self._sink_seed(acc)

        def loss(w: PyTree, hf: list[jax.Array]) -> PyTree:
            fi, ii = iter(hf), iter(h_int)
            full = [next(fi) if f else next(ii) for f in self.h_float]
            outs, sink = fn(w, (full, mb))
            return (outs[0], sink), outs[1:]

        hf = [x for x, f in zip(h, self.h_float) if f]
        (value, _), vjp, aux = jax.vjp(loss, (self.split_params(p), seed), hf, has_aux=True)
        (g_p, g_sink), g_h = vjp((jnp.ones_like(value), seed))
        acc = self._add_grads(acc, list(g_p), list(g_sink))
        sums = [value, *aux]
        lacc = [a + jnp.asarray(v, a.dtype)[None] for a, v in zip(lacc, sums)]
        return list(g_h), acc, lacc

    def last(self) -> Program:
        """``(params, h, mb, acc, loss_acc) -> (ct_in, acc, loss_acc)`` on the last stage."""
        if "last" in self._cache:
            return self._cache["last"]
        first = self.spec.first
        n_aux = len(self.info.aux_avals)

        def body(p: list[jax.Array], h: list[jax.Array], mb: list[jax.Array], acc: list[jax.Array],
                 lacc: list[jax.Array]) -> PyTree:
            g_h, acc, lacc = self.last_local(p, h, mb, acc, lacc)
            return (acc, lacc) if first else (g_h, acc, lacc)

        h_specs = [P(DP_AXES) if a.shape else P() for a in self.info.h_avals]
        h_float_specs = [s for s, f in zip(h_specs, self.h_float) if f]
        acc_specs = [P(DP_AXES)] * len(self.spec.params)
        l_specs = [P(DP_AXES)] * (1 + n_aux)
        outs = (acc_specs, l_specs) if first else (h_float_specs, acc_specs, l_specs)
        run = self._shard_map(body, (self._param_in_specs(), self._h_in_specs(), self._mb_specs(),
                                     acc_specs, l_specs), outs)
        acc_sh = [a.sharding for a in self.acc_avals()]
        l_sh = [a.sharding for a in self.loss_acc_avals()]
        h_sh = [s for s, f in zip(self.h_shardings(), self.h_float) if f]
        out_sh = (acc_sh, l_sh) if first else (h_sh, acc_sh, l_sh)
        if first:
            prog = self._jit(lambda p, mb, acc, lacc: run(p, [], mb, acc, lacc), out_shardings=out_sh,
                           donate_argnums=(2, 3))
        else:
            prog = self._jit(run, out_shardings=out_sh, donate_argnums=(3, 4))
        self._cache["last"] = prog
        return prog

    def finish(self) -> Program:
        """``(acc, loss_acc) -> (grads, [loss, *aux], zeroed acc, zeroed loss_acc)`` (the sums are None
        on stages other than the last)."""
        if "finish" in self._cache:
            return self._cache["finish"]
        info, sp = self.info, self.spec
        scale = 1.0 / (info.dp * info.grad_accum)
        n_l = 1 + len(info.aux_avals) if sp.last else 0

        def body(acc: list[jax.Array], lacc: list[jax.Array]) -> PyTree:
            local = [to_device(a, h)[0] for a, h in zip(acc, sp.acc_host)]
            grads = finish_grads(local, self.grad_specs, sp.plan, sp.mesh)
            grads = [(g * jnp.asarray(scale, g.dtype)).astype(self._param_dtype(j)) for j, g in enumerate(grads)]
            sums = []
            for k, a in enumerate(lacc):
                total = psum_live(a[0], DP_AXES, sp.mesh)
                sums.append(total * scale if k == 0 or jnp.issubdtype(a.dtype, jnp.inexact) else total)
            zeros = [to_host(jnp.zeros_like(to_device(a, h)), h) for a, h in zip(acc, sp.acc_host)]
            return grads, sums, zeros, [jnp.zeros_like(a) for a in lacc]

        acc_specs = [P(DP_AXES)] * len(sp.params)
        g_specs = [g.layout.manual_spec(sharded=g.out_sharded) for g in self.grad_specs]
        run = self._shard_map(body, (acc_specs, [P(DP_AXES)] * n_l),
                              (g_specs, [P()] * n_l, acc_specs, [P(DP_AXES)] * n_l))
        acc_sh = [a.sharding for a in self.acc_avals()]
        l_sh = [a.sharding for a in self.loss_acc_avals()][:n_l]
        prog = self._jit(run, out_shardings=(self.grad_shardings(), [NamedSharding(sp.mesh, P())] * n_l, acc_sh, l_sh),
                       donate_argnums=(0, 1))
        self._cache["finish"] = prog
        return prog

    def init_accumulators(self) -> tuple[list[jax.Array], list[jax.Array]]:
        """Zero gradient accumulators (and loss sums on the last stage) in their shardings."""
        avals = self.acc_avals()
        lavals = self.loss_acc_avals() if self.spec.last else []
        make = self._jit(lambda: ([jnp.zeros(a.shape, a.dtype) for a in avals],
                                [jnp.zeros(a.shape, a.dtype) for a in lavals]),
                       out_shardings=([a.sharding for a in avals], [a.sharding for a in lavals]))
        return make()

    def split(self) -> Program:
        """``(batch leaves) -> [G][batch leaves]``: each device's rows into ``G`` micro-batches."""
        if "split" in self._cache:
            return self._cache["split"]
        G = self.info.grad_accum

        def body(xs: list[jax.Array]) -> PyTree:
            parts = [split_microbatches(x, G) for x in xs]
            return [[p[i] for p in parts] for i in range(G)]

        avals = [a for a, b in zip(self.info.mb_avals, self.info.is_batch) if b]
        n = len(avals)
        run = self._shard_map(body, ([P(DP_AXES)] * n,), [[P(DP_AXES)] * n] * G)
        prog = self._jit(run, out_shardings=[[self._mb_sharding(a) for a in avals]] * G)
        self._cache["split"] = prog
        return prog


def _dp_global(local: tuple[int, ...], dp: int) -> tuple[int, ...]:
    """The global shape of per-device blocks stacked over the DP axes on dim 0."""
    return (local[0] * dp, *local[1:]) if local else local


__all__ = ["LossInfo", "StagePrograms", "StageSpec", "activation_sharding"]
