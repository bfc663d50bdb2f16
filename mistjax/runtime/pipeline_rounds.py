"""The update rounds of a pipeline, built once: each stage's jitted part of the step after the gradients.

Part of the pipeline's build step (`runtime.pipeline_program.build_pipeline`). The update's propagation
(`mpmd_update.Propagation`) says where every value of the step lives and in which round it is materialised;
`RoundBuilder` jits, per (stage, round), the evaluation of what the stage computes in that round from the input
groups it reads (`Round`), the prologue computing a stage's loss arguments from the step's inputs, and the
routes of the contributions each round sends to the stages that read them later (`TwinRoute`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

import jax
from jax.extend import core as jex
from jax.extend.core import Var
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core.jaxpr import Atom, Value, shaped
from mistjax.core.layout import PARAM
from mistjax.core.plan import Plan
from mistjax.runtime import xla_flags
from mistjax.runtime.grads import regather_updated_params
from mistjax.runtime.mesh import SHARD_AXES, batch_spec
from mistjax.runtime.mpmd_stage import Program, StagePrograms
from mistjax.runtime.mpmd_update import (
    EnvKey,
    InputGroup,
    Layout,
    Output,
    Propagation,
    Rows,
    Sink,
    Source,
    StageRows,
    Target,
    TracedStep,
    Whole,
    combine,
    contributors,
    stage_eval,
    twin_key,
)
from mistjax.runtime.pipeline_leaves import StageLeaves


@dataclass
class Round:
    """One update program of one stage (see `mpmd_update`)."""

    groups: list[InputGroup]  # the input groups it reads, in argument order
    outputs: list[Output]  # what each output is
    program: Program
    sizes: list[int]  # arrays per input group
    avals: list[jax.ShapeDtypeStruct]  # one aval per input array (abstract lowering)


class TwinRoute(NamedTuple):
    """The contributions to a value materialised in one update round, sent to a stage that reads it later."""

    stage: int  # the receiving (virtual) stage
    var: Var  # the materialised value (the step jaxpr's variable)
    sources: tuple[int, ...]  # the contributing stages, in `combine` order
    avals: tuple[jax.ShapeDtypeStruct, ...]  # per source: the contribution as received


def contrib_aval(leaves: StageLeaves, rows: StageRows, v: Var, lay: Layout, source: int, at: int
                 ) -> jax.ShapeDtypeStruct:
    """A contribution of `source` to materialised value `v`, as received on stage `at` (replicated)."""
    shape = list(shaped(v).shape)
    if isinstance(lay, Rows):
        shape[lay.dim] = rows.count(source)
    return jax.ShapeDtypeStruct(tuple(shape), shaped(v).dtype, sharding=NamedSharding(leaves.grid.meshes[at], P()))


def metric_sources(prop: Propagation, grid_groups: int, v: Atom) -> list[int]:
    """The stages (or, for a metric whole on every stage, the device groups) that compute metric value `v`."""
    lay = Whole(prop.ALL) if isinstance(v, jex.Literal) else prop.layout_of(v)
    if lay == Whole(prop.ALL):
        return list(range(grid_groups))  # each device group computes its own copy
    return contributors(lay, prop.K)


def metric_combine(ts: TracedStep, prop: Propagation) -> tuple[bool, ...]:
    """Which metrics need combining on the device groups after the last round."""
    out = []
    for v in ts.metric_vars:
        lay = None if isinstance(v, jex.Literal) else prop.layout_of(v)
        out.append(isinstance(lay, Rows) or (lay is not None and not isinstance(lay, Whole)))
    return tuple(out)


class RoundBuilder:
    """Builds the update rounds, prologues and twin routes of a pipeline (see module docstring)."""

    def __init__(self, ts: TracedStep, prop: Propagation, leaves: StageLeaves, programs: Sequence[StagePrograms],
                 plan: Plan, rows: StageRows, rest_vars: Sequence[Atom]) -> None:
        self.ts, self.prop, self.leaves, self.programs = ts, prop, leaves, programs
        self.plan, self.rows, self.rest_vars = plan, rows, rest_vars
        self.K = leaves.grid.K
        self._avals: dict[tuple[Var, int, int], jax.ShapeDtypeStruct] = {}

    def contrib_aval(self, v: Var, lay: Layout, source: int, at: int) -> jax.ShapeDtypeStruct:
        """`contrib_aval`, one object per (value, source, receiver)."""
        key = (v, source, at)
        if key not in self._avals:
            self._avals[key] = contrib_aval(self.leaves, self.rows, v, lay, source, at)
        return self._avals[key]

    def _inputs_of(self, k: int, r: int) -> list[InputGroup]:
        """Every input group stage `k` could read in round `r` (pruned to the used ones later)."""
        prop, ts, lv = self.prop, self.ts, self.leaves
        groups = [InputGroup(Source.STATE, i) for i in lv.held[k]]
        n_aux = ts.call.num_aux
        if k == self.K - 1:
            groups += [InputGroup(Source.LOSS)] + [InputGroup(Source.AUX, a) for a in range(n_aux)]
        groups += [InputGroup(Source.GRAD, j) for j, i in enumerate(lv.param_index) if i in lv.layouts[k]]
        groups += [InputGroup(Source.BATCH, b) for b in range(len(ts.batch_vars))]
        groups += [InputGroup(Source.TWIN, v) for v in prop.mat if prop.level[v] <= r - 2]
        return groups

    def _group_vars(self, g: InputGroup) -> jex.Var | tuple[Source, jex.Var]:
        """The step jaxpr's variable an input group binds in the update's environment (a twin: its own key)."""
        ts, n_aux = self.ts, self.ts.call.num_aux
        match g.source:
            case Source.STATE:
                return ts.state_vars[g.ref_index]
            case Source.LOSS:
                return ts.vg.outvars[0]
            case Source.AUX:
                return ts.vg.outvars[1 + g.ref_index]
            case Source.GRAD:
                return ts.vg.outvars[1 + n_aux + g.ref_index]
            case Source.BATCH:
                return ts.batch_vars[g.ref_index]
        return twin_key(g.ref_var)

    def _group_avals(self, k: int, g: InputGroup) -> list[jax.ShapeDtypeStruct]:
        """Avals (with shardings) of the arrays of input group `g` on stage `k`."""
        lv = self.leaves
        mesh = lv.grid.meshes[k]
        if g.source is Source.STATE:
            return [lv.piece_aval(g.ref_index, k)]
        if g.source in (Source.LOSS, Source.AUX):
            v = self._group_vars(g)
            assert isinstance(v, Var)  # the loss or an aux output: a variable of the step
            return [jax.ShapeDtypeStruct(shaped(v).shape, shaped(v).dtype, sharding=NamedSharding(mesh, P()))]
        if g.source is Source.GRAD:
            prog, info = self.programs[k], lv.infos[lv.param_index[g.ref_index]]
            jj = prog.spec.params.index(g.ref_index)
            piece = lv.piece_aval(lv.param_index[g.ref_index], k)
            sources = info.stages if not info.rows else (k,)
            return [jax.ShapeDtypeStruct(piece.shape, piece.dtype, sharding=prog.grad_shardings()[jj])] * len(sources)
        if g.source is Source.BATCH:
            v = self.ts.batch_vars[g.ref_index]
            spec = batch_spec(shaped(v).shape, self.plan.global_batch, self.plan.cp)
            return [jax.ShapeDtypeStruct(shaped(v).shape, shaped(v).dtype, sharding=NamedSharding(mesh, spec))]
        v = g.ref_var
        lay = self.prop.layout_of(v)
        return [self.contrib_aval(v, lay, s, k) for s in contributors(lay, self.K)]

    def _targets(self, k: int, r: int) -> list[tuple[Output, Target]]:
        """What stage `k` computes in round `r`: each `Output` with the step jaxpr's value it is."""
        prop, ts = self.prop, self.ts
        out: list[tuple[Output, Target]] = []
        for v in prop.mat:
            if prop.level[v] == r - 1 and k in contributors(prop.layout_of(v), self.K):
                out.append((Output(Sink.CONTRIB, v), v))
        if r == prop.num_rounds:
            for i in self.leaves.held[k]:
                nv = ts.new_state_vars[i]
                if nv is ts.state_vars[i]:
                    continue  # unchanged: the old piece is kept
                # (a leaf read from its materialised value is a variable: only variables are materialised)
                out.append((Output(Sink.STATE, i), twin_key(cast(Var, nv)) if i in prop.out_twin else nv))
            for m, mv in enumerate(ts.metric_vars):
                if k in metric_sources(prop, self.leaves.grid.S, mv):
                    out.append((Output(Sink.METRIC, m), mv))
        return out

    def _make_env_fn(self, k: int, groups: list[InputGroup], sizes: list[int],
                     targets: list[tuple[Output, Target]]) -> Callable[..., list[Value]]:
        prop, layouts = self.prop, self.leaves.layouts[k]

        def fn(*flat: jax.Array) -> list[Value]:
            env: dict[EnvKey, Value] = {}
            pos = 0
            for g, n in zip(groups, sizes):
                arrays = list(flat[pos: pos + n])
                pos += n
                if g.source is Source.STATE and layouts[g.ref_index].host:
                    arrays = [jax.device_put(a, jax.memory.Space.Device) for a in arrays]
                if g.source is Source.GRAD:
                    value = arrays[0] if n == 1 else sum(arrays[1:], arrays[0])  # a tied parameter's summands
                elif g.source is Source.TWIN:
                    value = combine(prop.layout_of(g.ref_var), arrays)
                else:
                    value = arrays[0]
                env[self._group_vars(g)] = value
            outs = stage_eval(prop, k, self.rows, env, [t for _, t in targets])
            return self._regather(k, targets, outs)

        return fn

    def _regather(self, k: int, targets: list[tuple[Output, Target]], outs: list[Value]) -> list[Value]:
        """Updated ZeRO-1/2 parameters re-gathered hierarchically when the partition group spans nodes."""
        lv = self.leaves
        if lv.grid.meshes[k].shape[SHARD_AXES[0]] == 1:
            return outs
        idx = [j for j, (key, _) in enumerate(targets) if key.sink is Sink.STATE and
               lv.layouts[k][key.ref_index].role == PARAM]
        if not idx:
            return outs
        lays = [lv.layouts[k][targets[j][0].ref_index] for j in idx]
        updated = [cast(jax.Array, outs[j]) for j in idx]  # traced arrays (the update program's values)
        new = regather_updated_params(updated, [None] * len(idx), lays, lv.one_stage_plans[k], lv.grid.meshes[k])
        outs = list(outs)
        for j, x in zip(idx, new):
            outs[j] = x
        return outs

    def _used_groups(self, k: int, groups: list[InputGroup], targets: list[tuple[Output, Target]]
                     ) -> list[InputGroup]:
        """The input groups whose arrays the evaluation of `targets` on stage `k` reads."""
        sizes = [len(self._group_avals(k, g)) for g in groups]
        avals = [a for g in groups for a in self._group_avals(k, g)]
        probe = jax.make_jaxpr(self._make_env_fn(k, groups, sizes, targets))(
            *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
        used_vars = {v for e in probe.jaxpr.eqns for v in e.invars if isinstance(v, jex.Var)}
        used_vars |= {v for v in probe.jaxpr.outvars if isinstance(v, jex.Var)}
        keep, pos = [], 0
        for g, n in zip(groups, sizes):
            if any(v in used_vars for v in probe.jaxpr.invars[pos: pos + n]):
                keep.append(g)
            pos += n
        return keep

    def _build_program(self, k: int, groups: list[InputGroup], targets: list[tuple[Output, Target]],
                       donate: frozenset[Source]) -> Round:
        """Jit stage `k`'s evaluation of `targets`, keeping only the input groups it reads."""
        keep = self._used_groups(k, groups, targets)
        sizes = [len(self._group_avals(k, g)) for g in keep]
        avals = [a for g in keep for a in self._group_avals(k, g)]
        fn = self._make_env_fn(k, keep, sizes, targets)
        mesh = self.leaves.grid.meshes[k]
        whole = NamedSharding(mesh, P())
        out_sh = [self.leaves.piece_sharding(key.ref_index, k) if key.sink is Sink.STATE else whole
                  for key, _ in targets]
        donated: list[int] = []
        pos = 0
        new_state = {key.ref_index for key, _ in targets if key.sink is Sink.STATE}
        for g, n in zip(keep, sizes):
            if g.source in donate and (g.source is not Source.STATE or g.ref_index in new_state):
                donated += range(pos, pos + n)
            pos += n
        prog = jax.jit(fn, out_shardings=out_sh, donate_argnums=tuple(donated),
                       compiler_options=xla_flags.compiler_options(mesh.devices.flat[0].platform))
        return Round(keep, [key for key, _ in targets], prog, sizes, avals)

    def round(self, k: int, r: int) -> Round:
        """Stage `k`'s program of update round `r` (the last one donates the state pieces it replaces)."""
        final = r == self.prop.num_rounds
        return self._build_program(k, self._inputs_of(k, r), self._targets(k, r),
                                   frozenset({Source.STATE}) if final else frozenset())

    def prologue(self, k: int) -> Round | None:
        """Stage `k`'s loss arguments computed from the step's inputs (None if they are all inputs)."""
        targets: list[tuple[Output, Target]] = []
        for r, v in enumerate(self.rest_vars):
            if isinstance(v, jex.Var) and v not in self.ts.batch_vars:
                targets.append((Output(Sink.REST, r), v))
        if not targets:
            return None
        groups = ([InputGroup(Source.STATE, i) for i in self.leaves.held[k]]
                  + [InputGroup(Source.BATCH, b) for b in range(len(self.ts.batch_vars))])
        return self._build_program(k, groups, targets, frozenset())

    def twin_routes(self, rounds: dict[tuple[int, int], Round]) -> dict[int, list[TwinRoute]]:
        """Per update round r, the contributions sent after it: each value materialised in round r that a
        later round of a stage reads, from every contributing stage to that stage (computed once)."""
        prop, R = self.prop, self.prop.num_rounds
        routes: dict[int, list[TwinRoute]] = {r: [] for r in range(1, R + 1)}
        for r in range(1, R + 1):
            seen: set[tuple[int, Var]] = set()
            for t in range(self.K):
                for r2 in range(r + 1, R + 1):
                    for g in rounds[(t, r2)].groups:
                        if g.source is not Source.TWIN or prop.level[g.ref_var] != r - 1 or (t, g.ref_var) in seen:
                            continue
                        seen.add((t, g.ref_var))
                        lay = prop.layout_of(g.ref_var)
                        srcs = tuple(contributors(lay, self.K))
                        routes[r].append(TwinRoute(t, g.ref_var, srcs, tuple(self.contrib_aval(g.ref_var, lay, s, t)
                                                                          for s in srcs)))
        return routes


__all__ = ["Round", "RoundBuilder", "TwinRoute", "contrib_aval", "metric_combine", "metric_sources"]
