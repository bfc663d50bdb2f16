"""Split the user's train step at `mistjax.value_and_grad` into per-stage update programs.

An MPMD plan cannot jit ``train_step(state, batch) -> (state, metrics)`` as one program: its state
lives in pieces on the stages' sub-meshes. `trace_step` traces the step abstractly with the gradient
call replaced by an opaque primitive (`pipeline_p`, run by the pipeline), and `propagate` gives every
value of the resulting jaxpr a *stage layout*:

* `Whole` (stages): the whole value is held, identically, by each of these (virtual) stages;
  ``ALL`` stages for small values, the batch, the step counter;
* `Rows` (dim): split along ``dim`` by the plan's layer ranges (stage k holds rows ``[a_k, b_k)``);
  stacked layer parameters, their gradients and optimizer state, and whatever is computed from them
  element by element;
* `Part` (op, stages): each of these stages holds a partial value, the value is their ``op``-reduction
  (``add`` for a sum over layers such as a squared gradient norm, ``max`` / ``min`` / ...).

Propagation is the TP analysis's idea (`mistjax.analysis.tp`: Shard / Partial / replicated) applied
to pipeline stages: elementwise ops keep a row split, a reduction over the layer dim becomes a
partial value, a partial value stays partial through linear ops (sums, scaling by a whole value) and
is *materialised* (each stage's partial is sent to every stage and reduced there) before anything
non-linear reads it. Only small values (`SMALL_ELEMENTS`) may be materialised; an update that needs
a large array from another stage, or mixes large arrays of different stages, is refused naming the
state leaves involved. The placement of optimizer state and other non-parameter leaves is inferred
by the same propagation (a leaf combined elementwise with a row-split gradient is row-split).

Each materialisation is a round boundary: round ``r`` of stage ``k`` is one jitted program computing,
from the stage's own inputs and the values materialised before it, the partial values the next round
needs and, in the last round, the stage's new state pieces and its share of the metrics. For
``optax.chain(clip_by_global_norm, adamw)`` that is two rounds: per-stage sums of squared gradients,
then the update with the global norm. Values needed by several rounds are recomputed, not carried.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex
from jax.tree_util import PyTreeDef

from mistjax.core.jaxpr import INLINABLE, Atom, Value, bind_equation, inline_calls, read, shaped
from mistjax.core.plan import PlanError
from mistjax.core.types import Batch, LossFn, PyTree, State, TrainStep
from mistjax.runtime.tracing import trace_train_step

# A value of at most this many elements may be sent between stages inside the update (a partial
# norm, a per-layer statistic, the loss); anything larger must be computed where it lives.
SMALL_ELEMENTS = 1 << 16

pipeline_p = jex.Primitive("mistjax_pipeline_value_and_grad")
pipeline_p.multiple_results = True
pipeline_p.def_abstract_eval(lambda *args, out_avals, **_: list(out_avals))


# ---------------------------------------------------------------------------------------------- tracing
@dataclass
class GradCall:
    """The step's `mistjax.value_and_grad` call, as recorded while tracing."""

    fun: LossFn  # the user's loss
    has_aux: bool  # the loss returns (loss, aux)
    args_tree: PyTreeDef  # treedef of the call's arguments (params first)
    num_params: int  # leaves of the differentiated first argument
    out_tree: PyTreeDef  # treedef of ((loss, aux), grads) / (loss, grads)
    num_aux: int  # aux leaves


class _Recorder:
    """Grad handler that turns the step's gradient call into one `pipeline_p` equation."""

    def __init__(self) -> None:
        self.calls: list[GradCall] = []

    def value_and_grad(self, fun: LossFn, has_aux: bool, args: tuple[PyTree, ...]) -> PyTree:
        leaves, tree = jax.tree.flatten(args)
        num_params = len(jax.tree.leaves(args[0]))
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)
        out = jax.eval_shape(jax.value_and_grad(fun, has_aux=has_aux), *abstract)
        out_leaves, out_tree = jax.tree.flatten(out)
        num_aux = len(jax.tree.leaves(out[0][1])) if has_aux else 0
        self.calls.append(GradCall(fun, has_aux, tree, num_params, out_tree, num_aux))
        avals = tuple(jax.core.ShapedArray(a.shape, a.dtype) for a in out_leaves)
        outs = pipeline_p.bind(*leaves, out_avals=avals, call=len(self.calls) - 1)
        return jax.tree.unflatten(out_tree, outs)


@dataclass
class TracedStep:
    """The train step as one flat jaxpr: (state leaves, batch leaves) -> (new state leaves, metric leaves)."""

    closed: jex.ClosedJaxpr  # calls inlined; one `pipeline_p` equation
    num_state: int  # the first invars are the state's leaves, then the batch's
    state_tree: PyTreeDef  # treedef of the state (and of the new state)
    metrics_tree: PyTreeDef  # treedef of the metrics
    call: GradCall  # the gradient call
    vg_index: int  # index of the `pipeline_p` equation

    @property
    def vg(self) -> jex.JaxprEqn:
        return self.closed.jaxpr.eqns[self.vg_index]

    @property
    def state_vars(self) -> list[jex.Var]:
        return self.closed.jaxpr.invars[: self.num_state]

    @property
    def batch_vars(self) -> list[jex.Var]:
        return self.closed.jaxpr.invars[self.num_state:]

    @property
    def new_state_vars(self) -> list[Atom]:
        return self.closed.jaxpr.outvars[: self.num_state]

    @property
    def metric_vars(self) -> list[Atom]:
        return self.closed.jaxpr.outvars[self.num_state:]

    def param_state_index(self) -> list[int]:
        """Per differentiated parameter leaf: the state leaf it is (raises if it is not one)."""
        where = {v: i for i, v in enumerate(self.state_vars)}
        out = []
        for v in self.vg.invars[: self.call.num_params]:
            if not isinstance(v, jex.Var) or v not in where:
                raise PlanError("mistjax.value_and_grad must differentiate the parameters as they come from the "
                                "train state (state.params), not a transformed copy")
            out.append(where[v])
        return out


def trace_step(train_step: TrainStep, state: State, batch: Batch) -> TracedStep:
    """Trace `train_step` abstractly (`runtime.tracing`) with its `mistjax.value_and_grad` call left opaque."""
    rec = _Recorder()
    trace = trace_train_step(train_step, state, batch, rec)
    # The update is never differentiated, so only the primal computation matters: every call (jit,
    # custom_jvp / custom_vjp, checkpoint) is inlined at any depth.
    closed = inline_calls(trace.closed, INLINABLE)
    if len(rec.calls) != 1:
        raise PlanError(f"a pipelined plan needs the step to call mistjax.value_and_grad exactly once, it calls "
                        f"it {len(rec.calls)} times")
    vg = [k for k, e in enumerate(closed.jaxpr.eqns) if e.primitive is pipeline_p]
    return TracedStep(closed, trace.state_tree.num_leaves, trace.state_tree, trace.metrics_tree, rec.calls[0], vg[0])


# ---------------------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Whole:
    """The whole value, held identically by each of `stages`."""

    stages: frozenset[int]


@dataclass(frozen=True)
class Rows:
    """Split along `dim` by the plan's layer ranges."""

    dim: int


@dataclass(frozen=True)
class Part:
    """Each of `stages` holds a partial value; the value is their `op`-reduction."""

    op: str  # add | max | min | mul | and | or
    stages: frozenset[int]


Layout: TypeAlias = Whole | Rows | Part
"""Where a value of the update lives across the stages."""


class Free(enum.Enum):
    """The placement of a state leaf (and of what is computed from it alone) still being inferred."""

    FREE = "free"


FREE = Free.FREE

Placement: TypeAlias = Layout | Free
"""A value's `Layout`, or `FREE` while propagation infers it (never after `Propagation.run`)."""

ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "nextafter", "and", "or",
                         "xor", "not", "neg", "sign", "floor", "ceil", "round", "is_finite", "exp", "exp2", "log",
                         "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "sinh",
                         "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "abs", "square", "integer_pow",
                         "erf", "erfc", "erf_inv", "lgamma", "digamma", "igamma", "eq", "ne", "lt", "le", "gt", "ge",
                         "select_n", "clamp", "convert_element_type", "reduce_precision", "copy", "copy_p", "real",
                         "imag", "conj", "shift_left", "shift_right_logical", "shift_right_arithmetic",
                         "population_count", "clz"})
IDENTITY = frozenset({"sharding_constraint", "device_put", "optimization_barrier", "pvary", "pcast"})
REDUCE_OPS = {"reduce_sum": "add", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "mul",
              "reduce_and": "and", "reduce_or": "or"}
# Elementwise ops through which a partial value (of `op`) stays partial when its other operands are
# whole: "once" = the whole operands are applied by one stage only (x + w summed over stages counts w
# once), "all" = every stage applies them (idempotent or unary), "scale" = every stage scales its part.
_PARTIAL_RULES = {("add", "add"): "once", ("add", "sub"): "once", ("add", "mul"): "scale", ("add", "div"): "scale",
                  ("add", "neg"): "all", ("mul", "mul"): "once", ("max", "max"): "all", ("min", "min"): "all",
                  ("and", "and"): "all", ("or", "or"): "all"}
for _op in ("add", "mul", "max", "min"):
    for _prim in ("convert_element_type", "copy", "copy_p", "reduce_precision"):
        _PARTIAL_RULES[(_op, _prim)] = "all"


def _size(v: Atom) -> int:
    return int(np.prod(shaped(v).shape)) if hasattr(v.aval, "shape") else 1


def _rows(lay: Placement) -> Rows:
    """``lay``, which the rule calling this knows to be split by rows."""
    assert isinstance(lay, Rows), lay
    return lay


def _part(lay: Placement) -> Part:
    """``lay``, which the rule calling this knows to be partial."""
    assert isinstance(lay, Part), lay
    return lay


def _stages(lay: Placement) -> frozenset[int]:
    """The stages holding ``lay``, which the rule calling this knows to be whole or partial."""
    assert isinstance(lay, Whole | Part), lay
    return lay.stages


def _describe(layout: Placement, num_stages: int) -> str:
    if isinstance(layout, Rows):
        return "split by layer ranges across stages"
    if isinstance(layout, Part):
        return f"a partial {layout.op} over stages {sorted(layout.stages)}"
    if isinstance(layout, Whole):
        if len(layout.stages) == num_stages:
            return "held by every stage"
        return f"held by stage{'s' if len(layout.stages) > 1 else ''} {', '.join(map(str, sorted(layout.stages)))}"
    return "not placed yet"


@dataclass
class EqnPlan:
    """How one equation runs on each stage."""

    out: list[Placement]  # layout per output
    twins: set[int] = field(default_factory=set)  # operands read materialised (whole on every stage)
    slices: dict[int, int] = field(default_factory=dict)  # operand -> dim sliced to the stage's rows
    # operand -> the stages that use it; elsewhere it is zero (a summand counted once, or absent there)
    present: dict[int, frozenset[int]] = field(default_factory=dict)
    row_dim: int | None = None  # output dim split by layer ranges (shape params fixed per stage)


class UpdateError(PlanError):
    """The update cannot be split across pipeline stages."""


class Propagation:
    """Stage layouts of every value of a `TracedStep` (see module docstring)."""

    def __init__(self, step: TracedStep, *, num_stages: int, param_layouts: Sequence[Layout],
                 names: Sequence[str], batch_names: Sequence[str], num_layers: int):
        self.step, self.K, self.L = step, num_stages, num_layers
        self.ALL = frozenset(range(num_stages))
        self.param_index = step.param_state_index()
        self.state_layout: list[Placement] = [FREE] * step.num_state
        for i, lay in zip(self.param_index, param_layouts):
            self.state_layout[i] = lay
        self.names = {v: n for v, n in zip(step.state_vars, names)}
        self.names.update({v: n for v, n in zip(step.batch_vars, batch_names)})
        outs = step.vg.outvars
        self.names[outs[0]] = "the loss"
        n_aux = step.call.num_aux
        for v in outs[1: 1 + n_aux]:
            self.names[v] = "an auxiliary output of the loss"
        for v, i in zip(outs[1 + n_aux:], self.param_index):
            self.names[v] = f"the gradient of {names[i]}"
        self.param_layouts = list(param_layouts)
        self.run()

    # ------------------------------------------------------------------ driver
    def run(self) -> None:
        for _ in range(self.step.num_state + 2):
            self.assign: dict[int, Layout] = {}
            self._pass()
            for i, v in enumerate(self.step.new_state_vars):
                if self.state_layout[i] == FREE and isinstance(v, jex.Var):
                    lay = self.layout.get(v)
                    if isinstance(lay, Rows | Whole) and lay != Whole(self.ALL) and lay != FREE:
                        self.assign.setdefault(i, lay)
            if not self.assign:
                break
            for i, lay in self.assign.items():
                self.state_layout[i] = lay
        self.state_layout = [Whole(self.ALL) if lay == FREE else lay for lay in self.state_layout]
        self._pass()
        self._finish()

    def _pass(self) -> None:
        st = self.step
        self.layout: dict[jex.Var, Placement] = {}
        self.derived: dict[jex.Var, str] = {}
        self.origin: dict[jex.Var, set[int]] = {}  # free-derived value -> state leaves it is an elementwise image of
        self.plans: list[EqnPlan | None] = []
        self.mat: dict[jex.Var, str] = {}  # materialised value -> why
        for i, v in enumerate(st.state_vars):
            self.layout[v] = self.state_layout[i]
            if self.state_layout[i] == FREE:
                self.origin[v] = {i}
        for v in st.batch_vars:
            self.layout[v] = Whole(self.ALL)
        for k, eqn in enumerate(st.closed.jaxpr.eqns):
            if k == st.vg_index:
                self.plans.append(None)
                self._vg_outputs(eqn)
                continue
            plan = self._eqn(eqn)
            self.plans.append(plan)
            for v, lay in zip(eqn.outvars, plan.out):
                self.layout[v] = lay
            self._derive_name(eqn)

    def _vg_outputs(self, eqn: jex.JaxprEqn) -> None:
        n_aux = self.step.call.num_aux
        last = frozenset({self.K - 1})
        for v in eqn.invars[self.step.call.num_params:]:
            if isinstance(v, jex.Var) and self.layout[v] not in (Whole(self.ALL), FREE):
                raise UpdateError(f"the loss reads {self._name(v)}, which is {_describe(self.layout[v], self.K)}; "
                                  "the arguments of mistjax.value_and_grad besides the parameters must be "
                                  "available on every stage (the batch, small state leaves)")
        for v in eqn.outvars[: 1 + n_aux]:
            self.layout[v] = Whole(last)
        for v, lay in zip(eqn.outvars[1 + n_aux:], self.param_layouts):
            self.layout[v] = lay

    def _name(self, v: Atom) -> str:
        known = (self.names.get(v) or self.derived.get(v)) if isinstance(v, jex.Var) else None
        return known or "a value computed in the update"

    def _derive_name(self, eqn: jex.JaxprEqn) -> None:
        """Name an equation's outputs after the state leaf they come from (for error messages)."""
        srcs = [v for v in eqn.invars if isinstance(v, jex.Var) and (v in self.names or v in self.derived)]
        spread = [v for v in srcs if self.layout.get(v) != Whole(self.ALL)]
        if srcs:
            src = (spread or srcs)[0]
            base = self.names.get(src)
            name = f"a value computed from {base}" if base else self.derived[src]
            for v in eqn.outvars:
                self.derived.setdefault(v, name)

    def layout_of(self, v: Atom) -> Layout:
        """The layout of ``v`` after `run` (which resolves every free placement; a literal is whole everywhere)."""
        lay = self._lay(v)
        assert not isinstance(lay, Free), f"{v} is still free after the propagation"
        return lay

    def state_layout_of(self, i: int) -> Layout:
        """The layout of state leaf ``i`` after `run`."""
        lay = self.state_layout[i]
        assert not isinstance(lay, Free), f"state leaf {i} is still free after the propagation"
        return lay

    # ------------------------------------------------------------------ rules
    def _lay(self, v: Atom) -> Placement:
        return Whole(self.ALL) if isinstance(v, jex.Literal) else self.layout[v]

    def _materialize(self, eqn: jex.JaxprEqn, j: int, plan: EqnPlan, why: str) -> None:
        v = eqn.invars[j]
        if isinstance(v, jex.Literal) or self._lay(v) == Whole(self.ALL):
            return
        if _size(v) > SMALL_ELEMENTS:
            lay = self._lay(v)
            raise UpdateError(
                f"the update's `{eqn.primitive.name}` needs {self._name(v)} (shape {shaped(v).shape}, "
                f"{_describe(lay, self.K)}) on every stage ({why}); only values of at most {SMALL_ELEMENTS} "
                "elements move between stages in the update. Compute it per stage (elementwise over the "
                "stacked layers, or reduced to a small value first), or use a plan with one stage")
        self.mat[v] = why
        plan.twins.add(j)

    def _eqn(self, eqn: jex.JaxprEqn) -> EqnPlan:
        name = eqn.primitive.name
        ins = [self._lay(v) for v in eqn.invars]
        if any(lay == FREE for lay in ins):
            free_plan = self._free(eqn, ins)
            if free_plan is not None:
                return free_plan
            ins = [Whole(self.ALL) if lay == FREE else lay for lay in ins]
        plan = EqnPlan(out=[])
        for _ in range(4):  # a rule may ask for operands materialised (whole on every stage), then re-run
            n_twins = len(plan.twins)
            plan.slices, plan.present, plan.row_dim = {}, {}, None
            cur = [Whole(self.ALL) if j in plan.twins else lay for j, lay in enumerate(ins)]
            out = self._rule(eqn, cur, plan)
            if out is not None:
                plan.out = out
                return plan
            if len(plan.twins) == n_twins:
                break
        raise AssertionError(f"no stage layout for `{name}`")  # pragma: no cover

    def _free(self, eqn: jex.JaxprEqn, ins: list[Placement]) -> EqnPlan | None:
        """Free-derived operands: stay free among whole / free values; otherwise give their state leaves
        the partner's placement (when they are elementwise images of the same shape) and treat them as
        whole for this pass."""
        others = [lay for v, lay in zip(eqn.invars, ins) if lay != FREE and lay != Whole(self.ALL)]
        out_shape = shaped(eqn.outvars[0]).shape if eqn.outvars and hasattr(eqn.outvars[0].aval, "shape") else ()
        aligned = eqn.primitive.name in ELEMENTWISE | IDENTITY or eqn.primitive.name == "broadcast_in_dim"
        if not others:
            if not aligned:
                return None
            origin: set[int] = set()
            for v, lay in zip(eqn.invars, ins):
                if lay == FREE and isinstance(v, jex.Var) and shaped(v).shape == out_shape:  # (free: a variable)
                    origin |= self.origin.get(v, set())
            for v in eqn.outvars:
                self.origin[v] = origin
            return EqnPlan(out=[FREE] * len(eqn.outvars))
        partner: Layout | None = next((lay for lay in others if isinstance(lay, Rows)), None)
        if partner is None:
            big = [lay for v, lay in zip(eqn.invars, ins) if isinstance(lay, Whole) and lay != Whole(self.ALL)
                   and _size(v) > SMALL_ELEMENTS]
            partner = big[0] if big else None
        if partner is not None and aligned:
            for v, lay in zip(eqn.invars, ins):
                if lay == FREE and isinstance(v, jex.Var) and shaped(v).shape == out_shape:  # (free: a variable)
                    for i in self.origin.get(v, set()):
                        if shaped(self.step.state_vars[i]).shape == out_shape:
                            self.assign.setdefault(i, partner)
        return None

    def _rule(self, eqn: jex.JaxprEqn, ins: list[Placement], plan: EqnPlan) -> list[Placement] | None:
        name = eqn.primitive.name
        n_out = len(eqn.outvars)
        if name in ELEMENTWISE or name in IDENTITY:
            return self._elementwise(eqn, ins, plan)
        rows = [j for j, lay in enumerate(ins) if isinstance(lay, Rows)]
        parts = [j for j, lay in enumerate(ins) if isinstance(lay, Part)]
        if name == "broadcast_in_dim":
            lay = ins[0]
            if isinstance(lay, Rows):
                plan.row_dim = eqn.params["broadcast_dimensions"][lay.dim]
                return [Rows(plan.row_dim)]
            return [lay]
        if name == "transpose" and rows:
            return [Rows(eqn.params["permutation"].index(_rows(ins[0]).dim))]
        if name == "squeeze" and rows:
            d = _rows(ins[0]).dim
            dims = eqn.params["dimensions"]
            if d not in dims:
                return [Rows(d - sum(x < d for x in dims))]
        if name == "reshape" and rows:
            d, old, new = _rows(ins[0]).dim, shaped(eqn.invars[0]).shape, eqn.params["new_sizes"]
            if tuple(old[: d + 1]) == tuple(new[: d + 1]):
                plan.row_dim = d
                return [Rows(d)]
        if name in REDUCE_OPS or name in ("argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
                                          "cumlogsumexp"):
            return self._reduce(eqn, ins, plan)
        if name == "dot_general":
            return _dot(self, eqn, ins, plan)
        if name in ("concatenate", "pad", "rev", "slice") and rows:
            out = _along(self, eqn, ins, plan)
            if out is not None:
                return out
        if name in ("transpose", "squeeze", "reshape") and parts:
            return [ins[0]]  # linear: a partial value stays partial
        if rows or parts:
            for j in rows + parts:
                self._materialize(eqn, j, plan, f"`{name}` cannot run on pieces split across stages")
            return None
        return [self._whole_out(eqn, ins, plan)] * n_out

    def _whole_out(self, eqn: jex.JaxprEqn, ins: list[Placement], plan: EqnPlan) -> Whole:
        """Whole operands: the stages holding all of them; small ones are moved when they disagree."""
        sets = [lay.stages for v, lay in zip(eqn.invars, ins) if isinstance(lay, Whole) and isinstance(v, jex.Var)]
        common = frozenset.intersection(*sets) if sets else self.ALL
        if common:
            return Whole(common)
        large = [(j, lay) for j, (v, lay) in enumerate(zip(eqn.invars, ins))
                 if isinstance(v, jex.Var) and _size(v) > SMALL_ELEMENTS and lay != Whole(self.ALL)]
        if len(large) > 1 and not frozenset.intersection(*[_stages(lay) for _, lay in large]):
            a, b = large[0][0], large[1][0]
            raise UpdateError(
                f"the update's `{eqn.primitive.name}` mixes {self._name(eqn.invars[a])} "
                f"({_describe(ins[a], self.K)}) with {self._name(eqn.invars[b])} ({_describe(ins[b], self.K)}); "
                "large arrays of different stages cannot be combined. Keep such updates within one stage's "
                "leaves, or use a plan with one stage")
        keep = frozenset.intersection(*[_stages(lay) for _, lay in large]) if large else self.ALL
        for j, (v, lay) in enumerate(zip(eqn.invars, ins)):
            if isinstance(lay, Whole) and isinstance(v, jex.Var) and not keep <= lay.stages:
                self._materialize(eqn, j, plan, "its operands live on different stages")
        return Whole(keep)

    def _elementwise(self, eqn: jex.JaxprEqn, ins: list[Placement], plan: EqnPlan) -> list[Placement] | None:
        name = eqn.primitive.name
        out_shape = shaped(eqn.outvars[0]).shape
        n_out = len(eqn.outvars)
        rows = [j for j, lay in enumerate(ins) if isinstance(lay, Rows)]
        parts = [j for j, lay in enumerate(ins) if isinstance(lay, Part)]
        if rows:
            d = _rows(ins[rows[0]]).dim
            for j, (v, lay) in enumerate(zip(eqn.invars, ins)):
                if isinstance(lay, Rows) and lay.dim == d:
                    continue
                shape = tuple(getattr(v.aval, "shape", ()))
                same = shape == tuple(out_shape) and len(shape) > 0
                if lay == Whole(self.ALL):
                    if same and isinstance(v, jex.Var):
                        plan.slices[j] = d
                    continue
                if same and isinstance(lay, Whole) and _size(v) > SMALL_ELEMENTS:
                    raise UpdateError(
                        f"the update's `{name}` mixes {self._name(eqn.invars[rows[0]])} (split by layer ranges "
                        f"across stages) with {self._name(v)} ({_describe(lay, self.K)}); large arrays of "
                        "different stages cannot be combined. Keep such updates within one stage's leaves, "
                        "or use a plan with one stage")
                self._materialize(eqn, j, plan, "it meets a value split by layers")
                if same:
                    plan.slices[j] = d
            return [Rows(d)] * n_out
        if parts:
            p0 = _part(ins[parts[0]])
            kind = _PARTIAL_RULES.get((p0.op, name))
            same = all(ins[j] == p0 for j in parts)
            mixed = all(_part(ins[j]).op == p0.op for j in parts)  # (`parts` are the Part operands)
            if kind is None or not (same or (kind == "once" and mixed)) or \
                    (kind == "scale" and (len(parts) > 1 or (name == "div" and parts != [0]))):
                for j in parts:
                    self._materialize(eqn, j, plan, f"`{name}` is not linear in a partial {p0.op}")
                return None
            stages = frozenset().union(*(_part(ins[j]).stages for j in parts))
            small_parts = all(_size(eqn.invars[j]) <= SMALL_ELEMENTS for j in parts)
            for j, (v, lay) in enumerate(zip(eqn.invars, ins)):
                if not isinstance(lay, Whole) or not isinstance(v, jex.Var):
                    continue
                ok = bool(lay.stages & stages) if kind == "once" else stages <= lay.stages
                if not ok and _size(v) > SMALL_ELEMENTS and small_parts:
                    for p in parts:  # move the small partial value, not the large whole one
                        self._materialize(eqn, p, plan, f"it meets {self._name(v)}, held elsewhere")
                    return None
                if not ok:
                    self._materialize(eqn, j, plan, "it combines with a partial value on other stages")
            for j, (v, lay) in enumerate(zip(eqn.invars, ins)):
                if isinstance(lay, Part):
                    if lay.stages != stages:
                        plan.present[j] = lay.stages  # summands of a partial held by fewer stages
                elif kind == "once":  # a whole operand is added by one stage only: counted once
                    held = (self.ALL if j in plan.twins or not isinstance(v, jex.Var) else _stages(lay)) & stages
                    plan.present[j] = frozenset({min(held)})
            return [Part(p0.op, stages)] * n_out
        if name in ("add", "sub"):
            holders = [_stages(lay) for v, lay in zip(eqn.invars, ins) if isinstance(v, jex.Var)]
            small = all(_size(v) <= SMALL_ELEMENTS for v in eqn.invars if isinstance(v, jex.Var))
            if holders and small and not frozenset.intersection(*holders):
                # Small summands on different stages: each stage adds its own; the sum is partial.
                for j, (v, lay) in enumerate(zip(eqn.invars, ins)):
                    plan.present[j] = frozenset({min(_stages(lay) if isinstance(v, jex.Var) else holders[0])})
                return [Part("add", frozenset().union(*plan.present.values()))] * n_out
        return [self._whole_out(eqn, ins, plan)] * n_out

    def _reduce(self, eqn: jex.JaxprEqn, ins: list[Placement], plan: EqnPlan) -> list[Placement] | None:
        name, lay = eqn.primitive.name, ins[0]
        axes = eqn.params.get("axes", (eqn.params.get("axis"),))
        if isinstance(lay, Rows):
            d = lay.dim
            if d not in axes:
                keep = name.startswith("cum")
                return [Rows(d if keep else d - sum(a < d for a in axes))]
            if name in REDUCE_OPS:
                return [Part(REDUCE_OPS[name], self.ALL)]
            self._materialize(eqn, 0, plan, f"`{name}` over the layer dim needs all layers")
            return None
        if isinstance(lay, Part):
            if REDUCE_OPS.get(name) == lay.op:
                return [lay]
            self._materialize(eqn, 0, plan, f"`{name}` is not linear in a partial {lay.op}")
            return None
        return [self._whole_out(eqn, ins, plan)]

    # ------------------------------------------------------------------ outputs and rounds
    def _finish(self) -> None:
        st = self.step
        self.out_twin: set[int] = set()  # new state leaves read from their materialised value
        for i, (v, want) in enumerate(zip(st.new_state_vars, self.state_layout)):
            got = self._lay(v)
            if got == want or (isinstance(want, Whole) and isinstance(got, Whole) and want.stages <= got.stages):
                continue
            if isinstance(want, Rows) and got == Whole(self.ALL):
                continue  # each stage keeps its rows of a value every stage computes
            if isinstance(want, Whole) and isinstance(v, jex.Var) and _size(v) <= SMALL_ELEMENTS:
                self.mat[v] = "the new state keeps it on every stage"
                self.out_twin.add(i)
                continue
            raise UpdateError(f"the update returns {self.names.get(st.state_vars[i], 'a state leaf')} as a value "
                              f"{_describe(got, self.K)}, but the state holds it {_describe(want, self.K)}; a "
                              "pipelined plan keeps every state leaf where it was placed")
        self.level: dict[jex.Var, int] = {}
        for v in st.closed.jaxpr.invars:
            self.level[v] = 0
        for eqn, plan in zip(st.closed.jaxpr.eqns, self.plans):
            if plan is None:
                lv = 0
            else:
                lv = max([0, *(self.level[v] + (1 if j in plan.twins else 0) for j, v in enumerate(eqn.invars)
                               if isinstance(v, jex.Var))])
            for v in eqn.outvars:
                self.level[v] = lv
        for v in st.closed.jaxpr.eqns[st.vg_index].invars:
            if isinstance(v, jex.Var) and self.level[v] > 0:
                raise UpdateError("the loss's arguments depend on a value reduced across stages in the update; "
                                  "compute them from the batch and the state before the update")
        outs = [self.level[v] + (1 if i in self.out_twin else 0)
                for i, v in enumerate(st.new_state_vars) if isinstance(v, jex.Var)]
        outs += [self.level[v] for v in st.metric_vars if isinstance(v, jex.Var)]
        self.num_rounds = 1 + max(outs, default=0)

    def metric_layout(self, v: Atom) -> Placement:
        return self._lay(v)


# Rules of `Propagation._rule` for primitives that pair or keep dims (module functions: the class stays short).
def _dot(prop: Propagation, eqn: jex.JaxprEqn, ins: list[Placement], plan: EqnPlan) -> list[Placement] | None:
    """`Propagation`'s rule for ``dot_general``: a row split through a batch, free or contracting dim."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins
    lnd, rnd = len(shaped(eqn.invars[0]).shape), len(shaped(eqn.invars[1]).shape)
    lfree = [d for d in range(lnd) if d not in lc and d not in lb]
    rfree = [d for d in range(rnd) if d not in rc and d not in rb]
    if isinstance(lhs, Part) or isinstance(rhs, Part):
        p, w = (0, 1) if isinstance(lhs, Part) else (1, 0)
        if isinstance(ins[w], Part | Rows):
            for j in (0, 1):
                prop._materialize(eqn, j, plan, "a product of two distributed values")
            return None
        return [ins[p]]
    if not (isinstance(lhs, Rows) or isinstance(rhs, Rows)):
        return [prop._whole_out(eqn, ins, plan)]
    side, d = (0, lhs.dim) if isinstance(lhs, Rows) else (1, _rows(rhs).dim)
    other = 1 - side
    mine_c, their_c = (lc, rc) if side == 0 else (rc, lc)
    mine_b, their_b = (lb, rb) if side == 0 else (rb, lb)
    paired = None
    if d in mine_b:
        paired, kind = their_b[list(mine_b).index(d)], "batch"
    elif d in mine_c:
        paired, kind = their_c[list(mine_c).index(d)], "contract"
    else:
        kind = "free"
    olay = ins[other]
    if kind == "free":
        if isinstance(olay, Rows):
            for j in (0, 1):
                prop._materialize(eqn, j, plan, "both operands are split by layers on unrelated dims")
            return None
        if olay != Whole(prop.ALL):
            prop._materialize(eqn, other, plan, "it multiplies a value split by layers")
        pos = len(lb) + (lfree.index(d) if side == 0 else len(lfree) + rfree.index(d))
        return [Rows(pos)]
    assert paired is not None  # a batch or contracting dim: the other operand's dim paired with it
    if isinstance(olay, Rows) and olay.dim != paired:
        for j in (0, 1):
            prop._materialize(eqn, j, plan, "its operands are split along unrelated dims")
        return None
    if isinstance(olay, Whole):
        if olay != Whole(prop.ALL):
            prop._materialize(eqn, other, plan, "it multiplies a value split by layers")
        if isinstance(eqn.invars[other], jex.Var):
            plan.slices[other] = paired
    if kind == "batch":
        return [Rows(list(mine_b).index(d))]
    return [Part("add", prop.ALL)]

def _along(prop: Propagation, eqn: jex.JaxprEqn, ins: list[Placement], plan: EqnPlan) -> list[Placement] | None:
    """`Propagation`'s rule for concatenate / pad / rev / slice that leave the layer dim alone keep the row split."""
    name = eqn.primitive.name
    d = next(lay.dim for lay in ins if isinstance(lay, Rows))
    shape = shaped(eqn.invars[0]).shape
    if name == "concatenate" and eqn.params["dimension"] == d:
        return None
    if name == "pad" and tuple(eqn.params["padding_config"][d]) != (0, 0, 0):
        return None
    if name == "rev" and d in eqn.params["dimensions"]:
        return None
    if name == "slice":
        start, limit = eqn.params["start_indices"][d], eqn.params["limit_indices"][d]
        strides = eqn.params.get("strides") or [1] * len(shape)
        if (start, limit, strides[d]) != (0, shape[d], 1):
            return None
        plan.row_dim = d
    for j, (v, lay) in enumerate(zip(eqn.invars, ins)):
        if isinstance(lay, Rows) and lay.dim != d or isinstance(lay, Part):
            prop._materialize(eqn, j, plan, "its operands are distributed differently")
        elif isinstance(lay, Whole) and isinstance(v, jex.Var) and shaped(v).shape and \
                len(shaped(v).shape) > d and shaped(v).shape[d] == prop.L and (name != "pad" or j == 0):
            if lay != Whole(prop.ALL):
                prop._materialize(eqn, j, plan, "it meets a value split by layers")
            plan.slices[j] = d
    return [Rows(d)]


def combine(layout: Layout, parts: Sequence[jax.Array]) -> jax.Array:
    """The whole value from its per-stage contributions (in stage order)."""
    if isinstance(layout, Whole):
        return parts[0]
    if isinstance(layout, Rows):
        return jnp.concatenate(parts, axis=layout.dim)
    reduce = {"add": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "mul": jnp.multiply,
              "and": jnp.logical_and, "or": jnp.logical_or}[layout.op]
    out = parts[0]
    for p in parts[1:]:
        out = reduce(out, p)
    return out


def contributors(layout: Layout, num_stages: int) -> list[int]:
    """The stages whose values make up a materialised value (`combine`'s order)."""
    if isinstance(layout, Whole):
        return [min(layout.stages)]
    if isinstance(layout, Part):
        return sorted(layout.stages)
    return list(range(num_stages))


# ---------------------------------------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class StageRows:
    """Which layer rows each stage holds: rows ``[start[k], end[k])`` of the layer stack."""

    start: tuple[int, ...]
    end: tuple[int, ...]

    def count(self, k: int) -> int:
        return self.end[k] - self.start[k]


def stage_eval(prop: Propagation, k: int, rows: StageRows, env: dict[EnvKey, Value],
               targets: Sequence[Target]) -> list[Value]:
    """Evaluate `targets` on stage `k` from `env` (input vars and `twin_key` entries).

    Runs only the equations the targets need, with stage-local values: row-split values hold the
    stage's rows (shape parameters adjusted), whole values are sliced to those rows where they meet a
    row split, partial values hold the stage's summand.
    """
    jaxpr = prop.step.closed.jaxpr
    needed: set[jex.Var] = {v for v in targets if isinstance(v, jex.Var)}
    chosen = []
    for idx in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[idx]
        if not any(v in needed and v not in env for v in eqn.outvars):
            continue
        if idx == prop.step.vg_index:
            missing = [v for v in eqn.outvars if v in needed and v not in env]
            raise RuntimeError(f"stage {k} needs pipeline outputs it was not given: {missing}")
        chosen.append(idx)
        plan = prop.plans[idx]
        assert plan is not None  # only the value_and_grad call has no plan, and it was refused above
        for j, v in enumerate(eqn.invars):
            if isinstance(v, jex.Var) and (j not in plan.present or k in plan.present[j]):
                if j in plan.twins:
                    if twin_key(v) not in env:
                        raise RuntimeError(f"stage {k} needs the materialised value of {prop._name(v)}")
                else:
                    needed.add(v)
    local: dict[EnvKey, Value] = dict(env)
    for v, c in zip(jaxpr.constvars, prop.step.closed.consts):
        local[v] = c
    a, b = rows.start[k], rows.end[k]

    for idx in reversed(chosen):
        eqn, plan = jaxpr.eqns[idx], prop.plans[idx]
        assert plan is not None  # (as above)
        vals: list[Value] = []
        for j, v in enumerate(eqn.invars):
            if j in plan.present and k not in plan.present[j]:
                vals.append(jnp.zeros(shaped(v).shape, shaped(v).dtype))  # a summand this stage does not add
                continue
            x = local[twin_key(cast(jex.Var, v))] if j in plan.twins else read(local, v)  # (twins: variables)
            if j in plan.slices:  # a variable met by a row split: a traced array
                x = lax.slice_in_dim(cast(jax.Array, x), a, b, axis=plan.slices[j])
            vals.append(x)
        outs = _bind_local(eqn, vals, plan, rows.count(k))
        local.update(zip(eqn.outvars, outs))
    return [v.val if isinstance(v, jex.Literal) else local[v] for v in targets]  # (`read`, for twin keys too)


# Shape parameters sized by the layer dim, per primitive: a stage binds them at its own row count.
_ROW_PARAMS = {"broadcast_in_dim": "shape", "reshape": "new_sizes", "slice": "limit_indices"}


def _bind_local(eqn: jex.JaxprEqn, vals: list[Value], plan: EqnPlan, n_rows: int) -> list[Value]:
    name = eqn.primitive.name
    if name in IDENTITY:
        return list(vals[: len(eqn.outvars)])
    key, d = _ROW_PARAMS.get(name), plan.row_dim
    if key is not None and d is not None:
        sizes = list(eqn.params[key])
        sizes[d] = n_rows
        eqn = eqn.replace(params={**eqn.params, key: tuple(sizes)})
    return bind_equation(eqn, vals)


def state_names(state: State) -> list[str]:
    """Readable names of the state's leaves (``params/layers/mlp/wi``), for error messages."""
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        out.append(name[:-len("/value")] if name.endswith("/value") else name)
    return out


class Source(enum.StrEnum):
    """Where an update program's input group comes from."""

    STATE = "state"  # a piece of a state leaf held by the stage (ref: state index)
    LOSS = "loss"  # the step's loss (ref: unused)
    AUX = "aux"  # one aux output of the loss (ref: aux index)
    GRAD = "grad"  # a parameter's synchronised gradient, one array per contributing stage (ref: param index)
    BATCH = "batch"  # one batch leaf (ref: batch index)
    TWIN = "twin"  # the contributions to a value materialised in an earlier round (ref: its jaxpr var)
    REST = "rest"  # a loss argument computed from the step's inputs (prologue outputs only)


class Sink(enum.StrEnum):
    """What an update program's output is."""

    CONTRIB = "contrib"  # this stage's contribution to a materialised value (ref: its jaxpr var)
    STATE = "state"  # the stage's new piece of a state leaf (ref: state index)
    METRIC = "metric"  # this stage's part of a metric (ref: metric index)
    REST = "rest"  # a loss argument computed from the step's inputs (ref: rest index)


class InputGroup(NamedTuple):
    """One input group of an update program: its `Source` and which one (an index, or a jaxpr var)."""

    source: Source
    ref: int | jex.Var = -1

    @property
    def ref_index(self) -> int:
        """`ref` as the index it is for every source but `Source.TWIN`."""
        assert isinstance(self.ref, int), self
        return self.ref

    @property
    def ref_var(self) -> jex.Var:
        """`ref` as the jaxpr variable it is for `Source.TWIN`."""
        assert not isinstance(self.ref, int), self
        return self.ref


class Output(NamedTuple):
    """One output of an update program: its `Sink` and which one (an index, or a jaxpr var)."""

    sink: Sink
    ref: int | jex.Var

    @property
    def ref_index(self) -> int:
        """`ref` as the index it is for every sink but `Sink.CONTRIB`."""
        assert isinstance(self.ref, int), self
        return self.ref

    @property
    def ref_var(self) -> jex.Var:
        """`ref` as the jaxpr variable it is for `Sink.CONTRIB`."""
        assert not isinstance(self.ref, int), self
        return self.ref


EnvKey: TypeAlias = jex.Var | tuple[Source, jex.Var]
"""A key of `stage_eval`'s environment: a jaxpr variable, or `twin_key` of a materialised one."""


Target: TypeAlias = EnvKey | jex.Literal
"""What `stage_eval` evaluates: an environment key, or a literal (a constant output of the step)."""


def twin_key(v: jex.Var) -> tuple[Source, jex.Var]:
    """The update environment's key of the contributions to `v`, materialised in an earlier round."""
    return (Source.TWIN, v)


__all__ = ["FREE", "EnvKey", "Free", "GradCall", "InputGroup", "Layout", "Output", "Part", "Placement", "Propagation",
           "Rows", "SMALL_ELEMENTS", "Sink", "Source", "StageRows", "Target", "TracedStep", "UpdateError", "Whole",
           "combine", "contributors", "pipeline_p", "stage_eval", "state_names", "trace_step", "twin_key"]
