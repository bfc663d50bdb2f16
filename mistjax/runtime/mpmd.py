"""The MPMD pipeline executor: one program per (stage, phase) on each stage's own devices.

A plan with several stages runs here (`ShardedStep` delegates to `MpmdStep`). Each (virtual) stage
``k`` has its own sub-mesh (device group ``k % S`` of the plan mesh), its own one-stage plan (layer
count, ZeRO level, MiCS group, remat, offload ratios) and its own programs (`mpmd_stage`): forward
and backward per micro-batch (fused on the last stage), ``finish`` (the stage's gradient sync), and
the update rounds the step splits into (`mpmd_update`). Nothing is compiled for the largest stage:
every stage allocates only what its own programs need.

`MpmdStep` is the step's front: on the first call (or `place` / `compile_stages`) it builds the frozen
`PipelineProgram` once (`pipeline_program.build_pipeline`: the traced step, every stage's programs, the update
rounds, layouts and routes, and the `ExecutionPlan` with its issue order), and hands each step to an
`pipeline_exec.Executor`, which walks that issue order (`core.pipeline_order.issue_order`), one handler per
`OpKind`: each device group runs its queue in that order, and JAX's asynchronous dispatch lets the groups overlap.
Activations and cotangents move between stages with ``jax.device_put`` to the receiver's sharding
(the sender's program already produced that layout); accumulators and optimizer state are donated,
received buffers never are. In a multi-process run every process walks the same sequence, runs the
programs of the stages it holds devices of (`LocalStage`), and takes part in the transfers it sends or receives
(`RemoteStage`; JAX's cross-host transfers, `configure_cross_host_transfers`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from mistjax.core.axes import AxisRules
from mistjax.core.execution import ExecutionPlan
from mistjax.core.layout import LeafLayout
from mistjax.core.pipeline_order import Op
from mistjax.core.plan import Plan, PlanError
from mistjax.core.types import Batch, Metrics, PyTree, State, TrainStep
from mistjax.runtime.mesh import batch_shardings
from mistjax.runtime.mpmd_split import SplitPrograms
from mistjax.runtime.mpmd_stage import StagePrograms
from mistjax.runtime.mpmd_state import is_staged
from mistjax.runtime.mpmd_update import Propagation
from mistjax.runtime.pipeline_compile import ResidualBytes, compile_stages
from mistjax.runtime.pipeline_exec import Executor
from mistjax.runtime.pipeline_io import DispatchStats, Held, StageIO, gather
from mistjax.runtime.pipeline_leaves import LocalStage, RemoteStage, StageGrid
from mistjax.runtime.pipeline_program import PipelineProgram, build_pipeline
from mistjax.runtime.pipeline_rounds import Round
from mistjax.runtime.report import PipelineReport


def configure_cross_host_transfers(address: str) -> None:
    """Enable JAX's cross-process ``device_put`` (needed on CPU for pipelines spanning processes).

    Args:
      address: ``host:port`` this process listens on for transfers; one per process.
    """
    jax.config.update("jax_cross_host_transfer_socket_address", address)


def _abstract(tree: PyTree) -> PyTree:
    """Every leaf (a placed `StagedArray` too) as a ``jax.ShapeDtypeStruct`` of its global shape."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x)), np.dtype(x.dtype)), tree,
                        is_leaf=is_staged)


class MpmdStep:
    """A train step run as an MPMD pipeline (see module docstring); used through `ShardedStep`.

    Before the first `place`, `compile_stages` or call only the stages (`grid`, `meshes`, `group`) exist; after,
    `program` holds everything built, and the executor the step's runtime state (accumulators, `stats`).
    """

    def __init__(self, train_step: TrainStep, mesh: Mesh | Sequence[jax.Device] | None, plan: Plan,
                 axis_rules: AxisRules | None = None) -> None:
        if plan.num_stages < 2:
            raise PlanError("the MPMD executor runs plans with several stages")
        self.train_step, self.plan, self.axis_rules = train_step, plan, axis_rules
        self.grid = StageGrid.of(mesh, plan)
        self._program: PipelineProgram | None = None
        self._executor: Executor | None = None
        self._stats = DispatchStats()  # (before the first step)

    # ================================================================== build
    def _setup(self, state: State, batch: Batch) -> None:
        """Build the `PipelineProgram` for the state's and batch's shapes and an executor for it."""
        self._program = build_pipeline(self.train_step, self.plan, _abstract(state), _abstract(batch),
                                       grid=self.grid, axis_rules=self.axis_rules)
        self._executor = Executor(self._program, ResidualBytes(self._program.programs))

    def _ready(self, state: State, batch: Batch) -> Executor:
        if self._executor is None:
            self._setup(state, batch)
        assert self._executor is not None
        return self._executor

    @property
    def program(self) -> PipelineProgram:
        """What the step runs (built by the first `place`, `compile_stages` or call)."""
        if self._program is None:
            raise PlanError("the pipeline is built by the first place(), compile_stages() or step call; "
                            "call one of them first")
        return self._program

    @property
    def executor(self) -> Executor:
        """The executor of `program`."""
        if self._executor is None:
            raise PlanError("the pipeline is built by the first place(), compile_stages() or step call; "
                            "call one of them first")
        return self._executor

    # ================================================================== the step
    def place(self, state: State, batch: Batch) -> State:
        """The state as `StagedArray` leaves with each piece on its stage (see `mpmd_state`)."""
        return self._ready(state, batch).placement.place(state)

    def gather(self, state: State) -> State:
        """The user's structure with whole host arrays (every piece brought to this process)."""
        io = self._executor.io if self._executor is not None else StageIO(self.grid)
        return gather(state, self.grid, io)

    def batch_shardings(self, batch: Batch) -> PyTree:
        """The batch over the whole plan mesh: split over DP, replicated over the stages."""
        return batch_shardings(self.grid.mesh, batch, self.plan.global_batch)

    def __call__(self, state: State, batch: Batch) -> tuple[State, Metrics]:
        self.plan.check_batch(_leading_dim(batch))  # the programs are compiled for this batch size
        return self._ready(state, batch)(state, batch)

    def compile_stages(self, state: State, batch: Batch, phases: Sequence[str] | None = None, *,
                       compile: bool = True) -> dict[tuple[int, str], jax.stages.Compiled | jax.stages.Lowered]:
        """Every program of every local stage: ``{(stage, phase): jax.stages.Compiled}`` (or ``Lowered``
        with ``compile=False``).

        Phases: ``forward`` / ``backward`` (stages before the last), ``last``, ``finish``, ``split``
        (stages reading the batch), ``update1`` ... (the update rounds); `phases` picks some. Each has its
        own ``memory_analysis()``: the stage's memory, not the largest stage's.
        """
        ex = self._ready(state, batch)
        return compile_stages(ex.program, ex.residuals, phases, compile=compile)

    # ================================================================== inspection
    def residual_bytes(self) -> list[int]:
        """Per stage: bytes per device its forward keeps in device memory for one micro-batch (0 on the last
        stage); the part an offload policy moves to host is `residual_host_bytes` (see `ResidualBytes.device`)."""
        return self.executor.residuals.device()

    def residual_host_bytes(self) -> list[int]:
        """Per stage: bytes per device of one micro-batch's residuals kept in host memory (offloaded)."""
        return self.executor.residuals.host()

    def stage_summary(self) -> list[dict[str, object]]:
        """Per stage: layers, what it holds (embedding / head), its pieces' memory kinds."""
        lv = self.program.leaves
        out = []
        for k in range(self.K):
            kinds: dict[str, int] = {}
            for i in lv.held[k]:
                lay = lv.layouts[k][i]
                key = lay.role + ("@host" if lay.host else "")
                kinds[key] = kinds.get(key, 0) + lay.nbytes_elems
            out.append({"stage": k, "group": self.group[k], "layers": self.plan.stages[k].layers,
                        "leaves": [lv.infos[i] for i in lv.held[k]], "elements": kinds})
        return out

    @property
    def stats(self) -> DispatchStats:
        """What the host did in the last step (for the cost model and `scripts/bench_mpmd.py`)."""
        return self._executor.stats if self._executor is not None else self._stats

    @property
    def applied(self) -> PipelineReport | None:
        """What each stage's knobs did, once set up."""
        return self._program.applied if self._program is not None else None

    @property
    def execution(self) -> ExecutionPlan | None:
        """How the plan runs (`core.execution`), once set up."""
        return self._program.execution if self._program is not None else None

    # The stages and what the program built, by the names the memory accounting, the fit check and tests read.
    @property
    def mesh(self) -> Mesh:
        return self.grid.mesh

    @property
    def group_meshes(self) -> tuple[Mesh, ...]:
        return self.grid.group_meshes

    @property
    def meshes(self) -> tuple[Mesh, ...]:
        return self.grid.meshes

    @property
    def group(self) -> tuple[int, ...]:
        return self.grid.group

    @property
    def stages(self) -> tuple[LocalStage | RemoteStage, ...]:
        return self.grid.stages

    @property
    def K(self) -> int:
        return self.grid.K

    @property
    def S(self) -> int:
        return self.grid.S

    @property
    def issue(self) -> tuple[Op, ...]:
        return self.program.issue

    @property
    def programs(self) -> tuple[StagePrograms, ...]:
        return self.program.programs

    @property
    def split_programs(self) -> Mapping[int, SplitPrograms]:
        return self.program.split_programs

    @property
    def rounds(self) -> Mapping[tuple[int, int], Round]:
        return self.program.rounds

    @property
    def prop(self) -> Propagation:
        return self.program.prop

    @property
    def param_index(self) -> tuple[int, ...]:
        return self.program.leaves.param_index

    @property
    def held(self) -> tuple[list[int], ...]:
        return self.program.leaves.held

    @property
    def layouts(self) -> tuple[dict[int, LeafLayout], ...]:
        return self.program.leaves.layouts

    @property
    def _accs(self) -> dict[int, tuple[PyTree, PyTree]]:
        return self.executor.accs


def _leading_dim(batch: Batch) -> int:
    dims = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)}
    if not dims:
        raise PlanError("the batch has no array with a leading batch dimension")
    return max(dims)


__all__ = ["DispatchStats", "Held", "MpmdStep", "configure_cross_host_transfers"]
