"""The pipeline executor: one step of a `PipelineProgram`, its issue order run one handler per `OpKind`.

`Executor` splits the batch into micro-batches on the stages that read it, walks the program's
`ExecutionPlan.issue` (the host's order of the stage programs), handing each operation to its handler, runs each
stage's ``finish`` (gradient sync) and then the update (`pipeline_update.UpdateRun`). A stage running a
zero-bubble schedule's split backward (it has W operations) reads its B and FB operations as input-gradient
passes: its handler table is `SPLIT_HANDLERS`, the others' `HANDLERS`. A new schedule is its order
(`core.pipeline_order.issue_order`) plus, where it introduces a new kind of operation, a handler.

Between stages, activations and cotangents move with ``jax.device_put`` to the receiver's sharding
(`pipeline_io.StageIO`); accumulators are donated, received buffers never are. On a process that does not run a
stage (`RemoteStage`) its programs are not dispatched and their outputs are None (`pipeline_io.Held`); the process
still takes part in the transfers it sends or receives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.extend import core as jex
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core.jaxpr import shaped
from mistjax.core.pipeline_order import OpKind
from mistjax.core.types import Batch, Metrics, PyTree, State
from mistjax.runtime.mpmd_state import StagedArray, is_staged
from mistjax.runtime.pipeline_compile import ResidualBytes
from mistjax.runtime.pipeline_io import DispatchStats, Held, Placement, StageIO
from mistjax.runtime.pipeline_program import PipelineProgram
from mistjax.runtime.pipeline_update import GroupBatches, Pieces, UpdateRun

Microbatches = list[list[list[Held]]]  # per stage and micro-batch: the loss's rest leaves


@dataclass
class _Queues:
    """What one step's operations hand each other (keyed by (stage, micro-batch))."""

    params: list[list[Held]]  # per stage: its parameter pieces, in its programs' order
    mbs: Microbatches
    live: list[int]  # per stage: micro-batches whose residuals it holds
    # Arrays are None on a process that does not run the stage holding them (`Held`).
    h_recv: dict[tuple[int, int], list[Held]] = field(default_factory=dict)  # activations received
    ct_recv: dict[tuple[int, int], list[Held]] = field(default_factory=dict)  # cotangents received
    res: dict[tuple[int, int], PyTree] = field(default_factory=dict)  # residuals of forwards
    wres: dict[tuple[int, int], tuple[PyTree, ...]] = field(default_factory=dict)  # what a W reads


Handler = Callable[["Executor", _Queues, int, int], None]  # (executor, queues, stage, micro-batch)


class Executor:
    """Runs steps of one `PipelineProgram` (see module docstring)."""

    def __init__(self, program: PipelineProgram, residuals: ResidualBytes) -> None:
        self.program, self.residuals = program, residuals
        self.io = StageIO(program.grid)
        self.placement = Placement(program.leaves, program.plan.global_batch)
        self.update = UpdateRun(program, self.io)
        self.accs: dict[int, tuple[PyTree, PyTree]] = {}  # per stage: (accumulators, loss accumulators)

    @property
    def stats(self) -> DispatchStats:
        """What the host did in the last step."""
        return self.io.stats

    def __call__(self, state: State, batch: Batch) -> tuple[State, Metrics]:
        """One step: the state placed (if it is not), the pipeline, the update."""
        pg = self.program
        t0 = time.perf_counter()
        self.io.stats = DispatchStats()
        state = self.placement.place(state)
        leaves = jax.tree.leaves(state, is_leaf=is_staged)
        self.placement.check_staged(leaves)
        pieces = [dict(zip(x.info.stages, x.pieces)) for x in leaves]
        groups_batch = self.placement.stage_batch(batch)
        mbs = self._microbatches(pieces, groups_batch)
        grads, loss, aux = self._pipeline(pieces, mbs)
        tied = self.update.share_tied_grads(grads)
        new_pieces, metrics = self.update(pieces, tied, loss, aux, groups_batch)
        new_leaves = []
        for i, inf in enumerate(pg.leaves.infos):
            new_leaves.append(StagedArray([self.placement.piece_or_handle(i, k, new_pieces[i].get(k, pieces[i][k]))
                                           for k in inf.stages], inf))
        self.io.stats.host_s = time.perf_counter() - t0
        return jax.tree.unflatten(pg.leaves.state_tree, new_leaves), metrics

    # ================================================================== micro-batches
    def _rest_leaves(self, k: int, pieces: Pieces, groups_batch: GroupBatches) -> list[Held]:
        """The loss's non-parameter arguments on stage `k` (whole batch leaves, before splitting)."""
        pg = self.program
        batch_pos = {v: b for b, v in enumerate(pg.ts.batch_vars)}
        state_pos = {v: i for i, v in enumerate(pg.ts.state_vars)}
        prologue = pg.prologue.get(k)
        computed: dict[int, Held] = {}
        if prologue is not None:
            args = self.update.gather_inputs(k, prologue, pieces, {}, None, None, None, groups_batch)
            outs = self.io.run("prologue", k, prologue.program, *args)
            computed = {key.ref_index: o for key, o in zip(prologue.outputs, outs or [None] * len(prologue.outputs))}
        out: list[Held] = []
        for r, v in enumerate(pg.rest_vars):
            if isinstance(v, jex.Literal):
                out.append(jax.device_put(jnp.asarray(v.val, shaped(v).dtype), NamedSharding(pg.grid.meshes[k], P()))
                           if pg.grid.local(k) else None)
            elif v in batch_pos:
                out.append(groups_batch[pg.grid.group[k]][batch_pos[v]])
            elif r in computed:
                out.append(computed[r])
            else:
                out.append(pieces[state_pos[v]][k])
        return out

    def _microbatches(self, pieces: Pieces, groups_batch: GroupBatches) -> Microbatches:
        """Per stage and micro-batch, the loss's rest leaves (batch leaves split; the others whole)."""
        pg = self.program
        G = pg.plan.grad_accum
        is_batch = pg.info.is_batch
        out: Microbatches = []
        per_group: dict[int, list[list[Held]]] = {}
        for k in range(pg.K):
            if not pg.uses_batch(k):
                out.append([[] for _ in range(G)])
                continue
            d = pg.grid.group[k]
            if d not in per_group:
                rest = self._rest_leaves(k, pieces, groups_batch)
                split = self.io.run("split", k, pg.programs[k].split(), [x for x, b in zip(rest, is_batch) if b])
                per_mb = []
                for i in range(G):
                    it = iter(split[i]) if split is not None else iter([None] * sum(is_batch))
                    per_mb.append([next(it) if b else x for x, b in zip(rest, is_batch)])
                per_group[d] = per_mb
            out.append(per_group[d])
        return out

    # ================================================================== the schedule
    def _pipeline(self, pieces: Pieces, mbs: Microbatches) -> tuple[list[list[Held]], Held, list[Held] | None]:
        """Run the issue order; returns per stage its finished gradients, and the loss and aux sums."""
        pg = self.program
        K = pg.K
        params = [[pieces[pg.leaves.param_index[j]][k] for j in pg.programs[k].spec.params] for k in range(K)]
        for k in range(K):
            if k not in self.accs and pg.grid.local(k):
                self.accs[k] = pg.programs[k].init_accumulators()
        q = _Queues(params, mbs, live=[0] * K)
        self.stats.residuals_in_flight = [0] * K
        for op in pg.execution.issue:
            table = SPLIT_HANDLERS if op.stage in pg.split_programs else HANDLERS
            table[op.kind](self, q, op.stage, op.mb)
        self.stats.residual_bytes = [n * b for n, b in zip(self.stats.residuals_in_flight, self.residuals.device())]
        return self._finish()

    def _finish(self) -> tuple[list[list[Held]], Held, list[Held] | None]:
        """Each stage's ``finish``: its synchronised gradients; the loss and aux sums from the last stage."""
        pg = self.program
        K = pg.K
        grads: list[list[Held]] = []
        loss = aux = None
        for k in range(K):
            acc, lacc = self.accs.get(k, (None, None))
            out = self.io.run("finish", k, pg.programs[k].finish(), acc, lacc if k == K - 1 else [])
            if out is None:
                grads.append([None] * len(pg.programs[k].spec.params))
                continue
            g, sums, acc, lacc_new = out
            self.accs[k] = (acc, lacc_new if k == K - 1 else lacc)
            grads.append(list(g))
            if k == K - 1:
                loss, aux = sums[0], list(sums[1:])
        return grads, loss, aux

    def _hold(self, q: _Queues, k: int) -> None:
        """Stage `k` keeps one more micro-batch's residuals."""
        q.live[k] += 1
        self.stats.residuals_in_flight[k] = max(self.stats.residuals_in_flight[k], q.live[k])

    def _send_ct(self, ct_in: list[Held] | None, k: int, i: int, q: _Queues) -> None:
        pg = self.program
        h_float = [a for a, f in zip(pg.programs[0].h_global_avals(), pg.programs[0].h_float) if f]
        q.ct_recv[(k - 1, i)] = self.io.send(list(ct_in) if ct_in is not None else [None] * len(h_float), h_float,
                                             pg.programs[k - 1].ct_shardings(), k, k - 1)

    def _set_acc(self, k: int, acc: list[Held] | None, lacc: list[Held] | None) -> None:
        if self.program.grid.local(k):
            self.accs[k] = (acc, lacc)

    # ================================================================== handlers, one per OpKind
    def forward(self, q: _Queues, k: int, i: int) -> None:
        """F: stage `k`'s forward of micro-batch `i`; its activation sent to stage k + 1."""
        pg = self.program
        h_avals = pg.programs[0].h_global_avals()
        args = (q.params[k], q.mbs[k][i]) if k == 0 else (q.params[k], q.h_recv.pop((k, i)), q.mbs[k][i])
        out = self.io.run("forward", k, pg.programs[k].forward(), *args)
        h, r = out if out is not None else (None, None)
        if r is not None and k not in self.residuals.noted:  # the residuals as placed: per-device bytes
            self.residuals.note(k, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in r], [x.sharding for x in r])
        q.res[(k, i)] = r
        self._hold(q, k)
        q.h_recv[(k + 1, i)] = self.io.send(list(h) if h is not None else [None] * len(h_avals), h_avals,
                                            pg.programs[k + 1].h_shardings(), k, k + 1)

    def backward(self, q: _Queues, k: int, i: int) -> None:
        """B: stage `k`'s whole backward of micro-batch `i`; its input gradient sent to stage k - 1."""
        acc, lacc = self.accs.get(k, (None, None))
        out = self.io.run("backward", k, self.program.programs[k].backward(), q.params[k], q.res.pop((k, i)),
                          q.ct_recv.pop((k, i)), acc)
        if k == 0:
            acc = out[0] if out is not None else None
        else:
            ct_in, acc = out if out is not None else (None, None)
            self._send_ct(ct_in, k, i, q)
        self._set_acc(k, acc, lacc)
        q.live[k] -= 1

    def last(self, q: _Queues, k: int, i: int) -> None:
        """FB: the last stage's forward, loss and backward of micro-batch `i` in one program."""
        acc, lacc = self.accs.get(k, (None, None))
        out = self.io.run("last", k, self.program.programs[k].last(), q.params[k], q.h_recv.pop((k, i)),
                          q.mbs[k][i], acc, lacc)
        ct_in, acc, lacc = out if out is not None else (None, None, None)
        self._set_acc(k, acc, lacc)
        self._send_ct(ct_in, k, i, q)

    def input_grad(self, q: _Queues, k: int, i: int) -> None:
        """A zero-bubble schedule's B (or the last stage's FB): the input gradient now, the rest kept for W."""
        sp = self.program.split_programs[k]
        if k == 0:  # no input gradient: W runs the whole backward
            q.wres[(k, i)] = (q.res.pop((k, i)), q.ct_recv.pop((k, i)))
            return
        if k == self.program.K - 1:
            self._hold(q, k)
            acc, lacc = self.accs.get(k, (None, None))
            h, mb = q.h_recv.pop((k, i)), q.mbs[k][i]
            out = self.io.run("last_input", k, sp.last_input(), q.params[k], h, mb, lacc)
            ct_in, lacc, stash = out if out is not None else (None, None, None)
            self._set_acc(k, acc, lacc)
            split = sp.last()
            q.wres[(k, i)] = ([h[j] for j in split.reads("w", "h")] if h is not None else None,
                              [mb[j] for j in split.reads("w", "mb")], stash)
        else:
            stored, ct = q.res.pop((k, i)), q.ct_recv.pop((k, i))
            out = self.io.run("input_grad", k, sp.input_grad(), q.params[k], stored, ct)
            ct_in, stash = out if out is not None else (None, None)
            split = sp.middle()
            q.wres[(k, i)] = ([stored[j] for j in split.reads("w", "stored")] if stored is not None else None,
                              [ct[j] for j in split.reads("w", "ct")] if ct is not None else None, stash)
        self._send_ct(ct_in, k, i, q)

    def weight_grad(self, q: _Queues, k: int, i: int) -> None:
        """A zero-bubble schedule's W: the weight gradients of micro-batch `i` into the accumulators."""
        acc, lacc = self.accs.get(k, (None, None))
        if k == 0:
            stored, ct = q.wres.pop((k, i))
            out = self.io.run("backward", k, self.program.programs[k].backward(), q.params[k], stored, ct, acc)
            acc = out[0] if out is not None else None
        else:
            sp = self.program.split_programs[k]
            a, b, stash = q.wres.pop((k, i))
            prog = sp.last_weight() if k == self.program.K - 1 else sp.weight_grad()
            acc = self.io.run("weight_grad", k, prog, q.params[k], a, b, acc, stash)
        self._set_acc(k, acc, lacc)
        q.live[k] -= 1


# The handler of each operation kind: on a stage with a whole backward, and on one whose backward is split
# into B and W (a zero-bubble schedule; there B and the last stage's FB are input-gradient passes).
HANDLERS: dict[OpKind, Handler] = {OpKind.F: Executor.forward, OpKind.B: Executor.backward,
                                   OpKind.FB: Executor.last, OpKind.W: Executor.weight_grad}
SPLIT_HANDLERS: dict[OpKind, Handler] = {OpKind.F: Executor.forward, OpKind.B: Executor.input_grad,
                                         OpKind.FB: Executor.input_grad, OpKind.W: Executor.weight_grad}


__all__ = ["HANDLERS", "SPLIT_HANDLERS", "Executor", "Handler"]
