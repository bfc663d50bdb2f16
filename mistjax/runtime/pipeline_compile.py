"""A pipeline's programs lowered and compiled ahead of a step, and its residuals' bytes per stage.

`compile_stages` lowers (and compiles) every program of every stage this process runs, each at its own abstract
arguments, so each has its own ``memory_analysis()``: the stage's memory, not the largest stage's.
`ResidualBytes` accounts one micro-batch's residuals per stage: an upper bound from the forward's classified
residuals, then exact once a forward was compiled or ran (the shardings XLA gave its outputs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core.jaxpr import shaped
from mistjax.core.layout import DP_AXES
from mistjax.core.types import PyTree
from mistjax.runtime.mpmd_stage import Program, StagePrograms
from mistjax.runtime.pipeline_program import PipelineProgram

Compiled = dict[tuple[int, str], jax.stages.Compiled | jax.stages.Lowered]
AddProgram = Callable[[int, str, Callable[[], jax.stages.Lowered]], None]
BACKWARD_PHASES = frozenset({"backward", "input_grad", "weight_grad"})


class ResidualBytes:
    """Per stage: bytes per device of one micro-batch's residuals (see module docstring)."""

    def __init__(self, programs: Sequence[StagePrograms]) -> None:
        self.programs = programs
        # Per stage: device bytes under the shardings XLA gave the forward's outputs, once known (`note`).
        self.noted: dict[int, int] = {}

    def device(self) -> list[int]:
        """Per stage: bytes per device its forward keeps in device memory for one micro-batch (0 on the last
        stage); the part an offload policy moves to host is `host`.

        Once the stage's forward program was compiled (`compile_stages`) or ran, each residual's bytes are those
        of its piece under the sharding XLA gave it: a tensor-parallel residual is split over the tensor axis.
        Before, each residual is counted whole over that axis (its data-parallel piece), an upper bound."""
        K = len(self.programs)
        return [0 if k == K - 1 else self.noted.get(k, self.programs[k].classify().device_nbytes) for k in range(K)]

    def host(self) -> list[int]:
        """Per stage: bytes per device of one micro-batch's residuals kept in host memory (offloaded)."""
        K = len(self.programs)
        return [0 if k == K - 1 else self.programs[k].classify().host_nbytes for k in range(K)]

    def note(self, k: int, out_info: Sequence[jax.ShapeDtypeStruct], shardings: Sequence[jax.sharding.Sharding]
             ) -> None:
        """Record stage ``k``'s per-device residual bytes from its compiled forward's outputs."""
        stored = self.programs[k].classify().avals
        if len(stored) != len(out_info) or len(out_info) != len(shardings):
            return  # not the layout this accounting knows: keep the upper bound
        self.noted[k] = sum(int(np.prod(sh.shard_shape(tuple(info.shape)))) * np.dtype(info.dtype).itemsize
                            for (_, _, _, host), info, sh in zip(stored, out_info, shardings) if not host)


def _lowered(program: Callable[[], Program], *avals: PyTree) -> jax.stages.Lowered:
    """``program().lower(*avals)``: the program is built when its lowering is asked for."""
    return program().lower(*avals)


def _batch_avals(program: PipelineProgram, k: int) -> list[jax.ShapeDtypeStruct]:
    sh = NamedSharding(program.grid.meshes[k], P(DP_AXES))
    return [jax.ShapeDtypeStruct(shaped(v).shape, shaped(v).dtype, sharding=sh)
            for v, b in zip(program.rest_vars, program.info.is_batch) if b]


def _add_split_programs(program: PipelineProgram, k: int, add: AddProgram, avals: list[list[jax.ShapeDtypeStruct]],
                        want: set[str] | None) -> None:
    """A zero-bubble stage's B and W programs (`mpmd_split`): ``avals`` are the unsplit backward's (middle
    stage: params, stored, ct, acc) or the fused last program's (params, h, mb, acc, loss_acc)."""
    sp = program.split_programs[k]
    last = k == program.K - 1
    b_name, w_name = ("last_input", "last_weight") if last else ("input_grad", "weight_grad")
    if want is not None and not {b_name, w_name} & want:
        return
    b_prog = sp.last_input() if last else sp.input_grad()
    b_args = [avals[0], avals[1], avals[2], avals[4]] if last else avals[:3]
    low = b_prog.lower(*b_args)
    comp = low.compile()  # its output shardings are the stash's, which W reads
    add(k, b_name, lambda: low)
    stash = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
             for a, s in zip(low.out_info[-1], comp.output_shardings[-1])]
    split = sp.last() if last else sp.middle()
    g1, g2 = ("h", "mb") if last else ("stored", "ct")
    w_args = [avals[0], [avals[1][j] for j in split.reads("w", g1)], [avals[2][j] for j in split.reads("w", g2)],
              avals[3], stash]
    w_prog = sp.last_weight() if last else sp.weight_grad()
    add(k, w_name, lambda: w_prog.lower(*w_args))


def _add_pipeline_programs(program: PipelineProgram, residuals: ResidualBytes, k: int, add: AddProgram,
                           out: Compiled, want: set[str] | None, compile: bool) -> None:
    """Stage ``k``'s forward and backward programs (or the last stage's fused one), split where zero-bubble."""
    pr = program.programs[k]
    params = pr.param_avals()
    acc, lacc = pr.acc_avals(), pr.loss_acc_avals()
    mb, h = pr.mb_global_avals(), pr.h_global_avals()
    hf = [a for a, f in zip(h, pr.h_float) if f]
    if k == program.K - 1:
        if k in program.split_programs:
            _add_split_programs(program, k, add, [params, h, mb, acc, lacc], want)
        else:
            add(k, "last", functools.partial(_lowered, pr.last, params, h, mb, acc, lacc))
        return
    if want is not None and not ({"forward"} | BACKWARD_PHASES) & want:
        return
    fwd = pr.forward().lower(params, mb) if k == 0 else pr.forward().lower(params, h, mb)
    needs_res = want is None or bool(BACKWARD_PHASES & want)
    fwd_c = fwd.compile() if compile or needs_res else None
    if want is None or "forward" in want:
        out[(k, "forward")] = fwd_c if compile and fwd_c is not None else fwd  # (compile: built)
    res = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
           for a, s in zip(fwd.out_info[1], fwd_c.output_shardings[1])] if fwd_c is not None else []
    if fwd_c is not None:
        residuals.note(k, fwd.out_info[1], fwd_c.output_shardings[1])
    if k in program.split_programs and k > 0:  # a zero-bubble stage runs its split backward instead
        _add_split_programs(program, k, add, [params, res, hf, acc], want)
    elif want is None or "backward" in want:
        add(k, "backward", functools.partial(_lowered, pr.backward, params, res, hf, acc))


def compile_stages(program: PipelineProgram, residuals: ResidualBytes, phases: Sequence[str] | None = None, *,
                   compile: bool = True) -> Compiled:
    """Every program of every local stage: ``{(stage, phase): jax.stages.Compiled}`` (or ``Lowered`` with
    ``compile=False``); see `MpmdStep.compile_stages`."""
    want = set(phases) if phases is not None else None
    out: Compiled = {}

    def add(k: int, phase: str, lower: Callable[[], jax.stages.Lowered]) -> None:
        if want is None or phase in want:
            low = lower()
            out[(k, phase)] = low.compile() if compile else low

    for k, pr in enumerate(program.programs):
        if not program.grid.local(k):
            continue
        _add_pipeline_programs(program, residuals, k, add, out, want, compile)
        lacc = pr.loss_acc_avals() if k == program.K - 1 else []
        add(k, "finish", functools.partial(_lowered, pr.finish, pr.acc_avals(), lacc))
        if pr.spec.uses_batch:
            add(k, "split", functools.partial(_lowered, pr.split, _batch_avals(program, k)))
        for r in range(1, program.prop.num_rounds + 1):
            rnd = program.rounds[(k, r)]
            add(k, f"update{r}", functools.partial(rnd.program.lower, *rnd.avals))
    return out


__all__ = ["ResidualBytes", "compile_stages"]
