"""A pipelined step's update, run: tied gradients shared, the update rounds with their twin routes, the metrics.

After the pipeline's ``finish`` programs, each stage holds its parameters' synchronised gradients.
`UpdateRun` hands a tied parameter's holders every holder's summand, runs the update rounds a `PipelineProgram`
built (`pipeline_rounds`), each stage's input groups gathered from the state pieces, gradients, loss, aux
outputs, batch and the contributions earlier rounds sent (`TwinRoute`), and returns the new pieces and the
metrics as ordinary arrays replicated over the whole plan mesh.
"""

from __future__ import annotations

from typing import cast

import jax
from jax.extend import core as jex
from jax.extend.core import Var
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core.jaxpr import shaped
from mistjax.core.types import Metrics
from mistjax.runtime.mpmd_stage import Program
from mistjax.runtime.mpmd_update import Sink, Source, Whole, combine
from mistjax.runtime.pipeline_io import Held, StageIO, here
from mistjax.runtime.pipeline_program import PipelineProgram
from mistjax.runtime.pipeline_rounds import Round

Pieces = list[dict[int, Held]]  # per state leaf: its piece on each (virtual) stage holding it
GroupBatches = list[list[jax.Array]]  # per device group: the batch leaves placed on it
Twins = dict[tuple[int, Var], list[Held]]  # (stage, materialised var) -> the contributions it received
Grads = dict[tuple[int, int], list[Held]]  # (stage, parameter) -> the gradient summands it adds


class UpdateRun:
    """Runs a `PipelineProgram`'s update rounds (see module docstring)."""

    def __init__(self, program: PipelineProgram, io: StageIO) -> None:
        self.program, self.io = program, io
        self._combine_programs: dict[int, Program] = {}

    def share_tied_grads(self, grads: list[list[Held]]) -> Grads:
        """Per (stage, parameter): the gradient summands it adds (a tied parameter gets every holder's)."""
        pg, io, lv = self.program, self.io, self.program.leaves
        out: Grads = {}
        for k in range(pg.K):
            for jj, j in enumerate(pg.programs[k].spec.params):
                out[(k, j)] = [grads[k][jj]]
        for j, i in enumerate(lv.param_index):
            info = lv.infos[i]
            if info.rows or len(info.stages) < 2:
                continue
            for t in info.stages:
                tj = pg.programs[t].spec.params.index(j)
                dst = pg.programs[t].grad_shardings()[tj]
                parts = []
                for s in info.stages:
                    sj = pg.programs[s].spec.params.index(j)
                    x = grads[s][sj]
                    if s != t:
                        aval = jax.ShapeDtypeStruct(lv.layouts[s][i].shape, lv.state_avals[i].dtype)
                        if pg.grid.local(s) and x is not None and cast(NamedSharding, x.sharding).spec != dst.spec:
                            x = jax.device_put(x, NamedSharding(pg.grid.meshes[s], dst.spec))  # sender reshards first
                            io.stats.transfers += 1
                        x = io.transfer(x, dst, src_stage=s, dst_stage=t, aval=aval)
                    parts.append(x)
                out[(t, j)] = parts
        return out

    def gather_inputs(self, k: int, rnd: Round, pieces: Pieces, twins: Twins, grads: Grads | None, loss: Held,
                      aux: list[Held] | None, groups_batch: GroupBatches) -> list[Held]:
        """The arrays of round ``rnd``'s input groups on stage ``k``, in argument order."""
        args: list[Held] = []
        for g in rnd.groups:
            match g.source:
                case Source.STATE:
                    args.append(pieces[g.ref_index][k])
                case Source.LOSS:
                    args.append(loss)
                case Source.AUX:
                    # (None on a process without the last stage, as `loss` is: its programs do not run here)
                    args.append(aux[g.ref_index] if aux is not None else None)
                case Source.GRAD:
                    assert grads is not None  # (only the prologue has no gradients, and it reads none)
                    args.extend(grads[(k, g.ref_index)])
                case Source.BATCH:
                    args.append(groups_batch[self.program.grid.group[k]][g.ref_index])
                case _:
                    args.extend(twins[(k, g.ref_var)])
        return args

    def __call__(self, pieces: Pieces, grads: Grads, loss: Held, aux: list[Held] | None,
                 groups_batch: GroupBatches) -> tuple[Pieces, Metrics]:
        """Every update round on every stage: the new state pieces and the metrics."""
        pg = self.program
        R = pg.prop.num_rounds
        twins: Twins = {}
        new_pieces: Pieces = [{} for _ in pg.leaves.infos]
        metric_parts: dict[tuple[int, int], Held] = {}  # (metric, source stage) -> contribution
        for r in range(1, R + 1):
            contribs: dict[tuple[Var, int], Held] = {}
            for k in range(pg.K):
                rnd = pg.rounds[(k, r)]
                args = self.gather_inputs(k, rnd, pieces, twins, grads, loss, aux, groups_batch)
                outs = self.io.run(f"update{r}", k, rnd.program, *args)
                outs = outs if outs is not None else [None] * len(rnd.outputs)
                for key, o in zip(rnd.outputs, outs):
                    if key.sink is Sink.CONTRIB:
                        contribs[(key.ref_var, k)] = o
                    elif key.sink is Sink.STATE:
                        new_pieces[key.ref_index][k] = o
                    else:
                        metric_parts[(key.ref_index, k)] = o
            for route in pg.twin_routes[r]:
                dst = pg.grid.replicated[route.stage]
                twins[(route.stage, route.var)] = [
                    self.io.transfer(contribs[(route.var, s)], dst, src_stage=s, dst_stage=route.stage, aval=aval)
                    for s, aval in zip(route.sources, route.avals)]
        return new_pieces, self._metrics(metric_parts)

    def _received(self, parts: dict[tuple[int, int], Held]) -> tuple[list[list[Held]], list[list[list[Held]]]]:
        """Per device group: each metric's value there (None where it is still to be combined), and the parts
        to combine."""
        pg = self.program
        prop, S = pg.prop, pg.grid.S
        per_group: list[list[Held]] = [[] for _ in range(S)]
        combine_inputs: list[list[list[Held]]] = [[] for _ in range(S)]
        for m, v in enumerate(pg.ts.metric_vars):
            srcs = pg.metric_sources(v)
            lay = Whole(prop.ALL) if isinstance(v, jex.Literal) else prop.layout_of(v)
            for d in range(S):
                if lay == Whole(prop.ALL):
                    per_group[d].append(parts[(m, d)])
                    continue
                assert isinstance(v, Var)  # (a literal is whole on every group)
                recv = [self.io.transfer(parts[(m, s)], pg.grid.replicated[d], src_stage=s, dst_stage=d,
                                         aval=pg.contrib_aval(v, lay, s, d)) for s in srcs]
                if pg.metric_combine[m]:
                    combine_inputs[d].append(recv)
                    per_group[d].append(None)
                else:
                    per_group[d].append(recv[0])
        return per_group, combine_inputs

    def _metrics(self, parts: dict[tuple[int, int], Held]) -> Metrics:
        """Every metric as an ordinary array replicated over the whole plan mesh."""
        pg = self.program
        grid, ts, mc = pg.grid, pg.ts, pg.metric_combine
        per_group, combine_inputs = self._received(parts)
        if any(mc):
            for d in range(grid.S):
                outs = self.io.run("metrics", d, self._combine_program(d), combine_inputs[d])
                it = iter(outs if outs is not None else [None] * sum(mc))
                per_group[d] = [next(it) if c else x for x, c in zip(per_group[d], mc)]
        full = NamedSharding(grid.mesh, P())
        out = []
        for m, v in enumerate(ts.metric_vars):
            bufs = [s.data for d in range(grid.S) if grid.local(d) for s in here(per_group[d][m]).addressable_shards]
            aval = shaped(v)
            out.append(jax.make_array_from_single_device_arrays(aval.shape, full, bufs, dtype=aval.dtype))
        return jax.tree.unflatten(ts.metrics_tree, out)

    def _combine_program(self, d: int) -> Program:
        if d not in self._combine_programs:
            pg = self.program
            lays = [pg.prop.layout_of(v) for v, c in zip(pg.ts.metric_vars, pg.metric_combine) if c]
            sh = NamedSharding(pg.grid.group_meshes[d], P())
            self._combine_programs[d] = jax.jit(lambda groups: [combine(lay, g) for lay, g in zip(lays, groups)],
                                                out_shardings=[sh] * len(lays))
        return self._combine_programs[d]


__all__ = ["GroupBatches", "Grads", "Pieces", "Twins", "UpdateRun"]
