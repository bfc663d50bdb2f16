"""A pipeline stage's backward as two programs, for zero-bubble schedules (`core.pipeline_order.ZERO_BUBBLE`).

``input_grad`` (B) computes the cotangent the previous stage waits for and a stash; ``weight_grad`` (W), run
later, adds the weight gradients into the accumulators from the stash. The split is `backward_split`'s,
of the stage's own backward (`StagePrograms.backward_local` / ``last_local``), traced once per stage inside
its shard_map: nothing is computed twice. The first stage has no input gradient: its B is no program (the
executor keeps the cotangent) and its W is the whole `StagePrograms.backward`. On the last stage B is the
fused forward + loss + input gradient (``last_input``) and W its weight gradients (``last_weight``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.core.layout import DP_AXES
from mistjax.core.types import PyTree
from mistjax.runtime.backward_split import SplitBackward, SplitError, split_backward
from mistjax.runtime.mpmd_stage import Program, StagePrograms, _dp_global, _local_dp


class Groups(NamedTuple):
    """A program's argument lists by name and length, in order (the split function's flat arguments)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def slices(self) -> dict[str, slice]:
        out, at = {}, 0
        for name, n in zip(self.names, self.sizes):
            out[name] = slice(at, at + n)
            at += n
        return out


class StageSplit(NamedTuple):
    """One stage's split backward, with which arguments each half reads."""

    split: SplitBackward
    groups: Groups

    def reads(self, half: str, group: str) -> list[int]:
        """Indices within argument list `group` that `half` (``"b"`` / ``"w"``) reads."""
        flags = self.split.b_reads if half == "b" else self.split.w_reads
        sl = self.groups.slices()[group]
        return [j for j, r in enumerate(flags[sl]) if r]

    def stash_bytes(self) -> int:
        """Bytes of one micro-batch's stash per device."""
        return sum(int(a.size) * a.dtype.itemsize for a in self.split.stash)


def _stash_specs(split: SplitBackward) -> list[P]:
    return [P(DP_AXES)] * len(split.stash)


def _unstash(split: SplitBackward, stash: Sequence[jax.Array]) -> list[jax.Array]:
    return [s.reshape(a.shape) for s, a in zip(stash, split.stash)]


def _spread(values: Sequence[jax.Array], picked: Sequence[int], n: int) -> list[jax.Array | None]:
    """A list of length `n` with `values` at `picked` and None elsewhere (arguments a half does not read)."""
    out: list[jax.Array | None] = [None] * n
    for j, v in zip(picked, values):
        out[j] = v
    return out


@dataclass
class SplitPrograms:
    """The B and W programs of one stage (built on first use)."""

    pr: StagePrograms
    _cache: dict[str, Any] = field(default_factory=dict)  # lazily built values of several types, one per name

    # ------------------------------------------------------------------ the split, traced once
    def _stored_avals(self) -> list[jax.ShapeDtypeStruct]:
        sh = NamedSharding(self.pr.spec.mesh, P(DP_AXES))
        dp = self.pr.info.dp
        return [jax.ShapeDtypeStruct(_dp_global(shape if shape else (1,), dp), dtype, sharding=sh)
                for shape, dtype, *_ in self.pr.classify().avals]

    def _ct_avals(self) -> list[jax.ShapeDtypeStruct]:
        return [a for a, f in zip(self.pr.h_global_avals(), self.pr.h_float) if f]

    def _trace(self, name: str, fn: Callable[..., PyTree], groups: Groups, specs: Sequence[list[P]],
               avals: Sequence[list[jax.ShapeDtypeStruct]], is_b: list[bool]) -> StageSplit:
        if name in self._cache:
            return self._cache[name]
        box: list[SplitBackward] = []

        def body(*lists: list[jax.Array]) -> jax.Array:
            flat = [x for lst in lists for x in lst]

            def flat_fn(*a: jax.Array) -> list[jax.Array]:
                sl = groups.slices()
                outs = fn(*(list(a[sl[n]]) for n in groups.names))
                return [x for lst in outs for x in lst]

            box.append(split_backward(flat_fn, flat, is_b))
            return jnp.zeros(())

        run = self.pr._shard_map(body, tuple(specs), P())
        jax.eval_shape(run, *avals)
        out = StageSplit(box[0], groups)
        self._cache[name] = out
        return out

    def middle(self) -> StageSplit:
        """The split of a middle stage's backward ``(p, stored, ct, acc) -> (ct_in, acc)``."""
        pr = self.pr
        if pr.spec.first or pr.spec.last:
            raise ValueError("middle(): the first stage's backward is not split; the last stage uses last()")
        n_p, n_s, n_ct, n_acc = len(pr.spec.params), len(pr.classify().stored), sum(pr.h_float), len(pr.spec.params)
        groups = Groups(("p", "stored", "ct", "acc"), (n_p, n_s, n_ct, n_acc))
        specs = [pr._param_in_specs(), [P(DP_AXES)] * n_s, self._ct_specs(), [P(DP_AXES)] * n_acc]
        avals = [pr.param_avals(), self._stored_avals(), self._ct_avals(), pr.acc_avals()]
        is_b = [True] * n_ct + [False] * n_acc
        sp = self._trace("middle", lambda p, s, c, a: pr.backward_local(p, s, c, a), groups, specs, avals, is_b)
        _check_b(sp, "acc")
        return sp

    def last(self) -> StageSplit:
        """The split of the last stage's ``(p, h, mb, acc, lacc) -> (ct_in, acc, lacc)``: B gets ct_in and the
        loss sums, W the weight gradients."""
        pr = self.pr
        n_p, n_h, n_mb, n_acc = len(pr.spec.params), len(pr.info.h_avals), len(pr.mb_avals), len(pr.spec.params)
        n_l = len(pr.loss_acc_avals())
        groups = Groups(("p", "h", "mb", "acc", "lacc"), (n_p, n_h, n_mb, n_acc, n_l))
        specs = [pr._param_in_specs(), pr._h_in_specs(), pr._mb_specs(), [P(DP_AXES)] * n_acc, [P(DP_AXES)] * n_l]
        avals = [pr.param_avals(), pr.h_global_avals(), pr.mb_global_avals(), pr.acc_avals(), pr.loss_acc_avals()]
        is_b = [True] * sum(pr.h_float) + [False] * n_acc + [True] * n_l
        sp = self._trace("last", lambda p, h, mb, a, la: pr.last_local(p, h, mb, a, la), groups, specs, avals, is_b)
        _check_b(sp, "acc")
        return sp

    def _ct_specs(self) -> list[P]:
        return [P(DP_AXES) if a.shape else P() for a, f in zip(self.pr.info.h_avals, self.pr.h_float) if f]

    # ------------------------------------------------------------------ programs
    def input_grad(self) -> Program:
        """Middle stage B: ``(params, stored, ct_out) -> (ct_in, stash)``."""
        if "input_grad" in self._cache:
            return self._cache["input_grad"]
        pr, sp = self.pr, self.middle()
        n_acc = sp.groups.sizes[3]

        def body(p: list[jax.Array], stored: list[jax.Array], ct: list[jax.Array]) -> PyTree:
            outs, stash = sp.split.b(*p, *stored, *ct, *([None] * n_acc))
            return outs, [_local_dp(s) for s in stash]

        ct_specs = self._ct_specs()
        run = pr._shard_map(body, (pr._param_in_specs(), [P(DP_AXES)] * sp.groups.sizes[1], ct_specs),
                            (ct_specs, _stash_specs(sp.split)))
        h_sh = [s for s, f in zip(pr.h_shardings(), pr.h_float) if f]
        prog = pr._jit(run, out_shardings=(h_sh, [None] * len(sp.split.stash)))
        self._cache["input_grad"] = prog
        return prog

    def weight_grad(self) -> Program:
        """Middle stage W: ``(params, stored W reads, ct W reads, acc, stash) -> acc``."""
        return self._weight_program("weight_grad", self.middle(), ("stored", "ct"),
                                    ([P(DP_AXES)] * self.middle().groups.sizes[1], self._ct_specs()))

    def _weight_program(self, name: str, sp: StageSplit, groups: tuple[str, str], specs: tuple[list[P], list[P]]
                        ) -> Program:
        """A W program ``(params, groups[0] W reads, groups[1] W reads, acc, stash) -> acc``; `specs`: the two
        argument lists' whole in_specs (W gets the entries it reads)."""
        if name in self._cache:
            return self._cache[name]
        pr = self.pr
        sizes = dict(zip(sp.groups.names, sp.groups.sizes))
        picked = [sp.reads("w", g) for g in groups]
        tail = [None] * sum(n for g, n in sizes.items() if sp.groups.names.index(g) > sp.groups.names.index("acc"))

        def body(p: list[jax.Array], a: list[jax.Array], b: list[jax.Array], acc: list[jax.Array],
                 stash: list[jax.Array]) -> PyTree:
            flat = [*p, *_spread(a, picked[0], sizes[groups[0]]), *_spread(b, picked[1], sizes[groups[1]]), *acc,
                    *tail]
            return sp.split.w(*flat, *_unstash(sp.split, stash))

        acc_specs = [P(DP_AXES)] * sizes["acc"]
        run = pr._shard_map(body, (pr._param_in_specs(), [specs[0][j] for j in picked[0]],
                                   [specs[1][j] for j in picked[1]], acc_specs, _stash_specs(sp.split)), acc_specs)
        prog = pr._jit(run, out_shardings=[x.sharding for x in pr.acc_avals()], donate_argnums=(3,))
        self._cache[name] = prog
        return prog

    def last_input(self) -> Program:
        """Last stage B: ``(params, h, mb, loss_acc) -> (ct_in, loss_acc, stash)``."""
        if "last_input" in self._cache:
            return self._cache["last_input"]
        pr, sp = self.pr, self.last()
        n_p, n_h, n_mb, n_acc, n_l = sp.groups.sizes
        n_ct = sum(pr.h_float)

        def body(p: list[jax.Array], h: list[jax.Array], mb: list[jax.Array], lacc: list[jax.Array]) -> PyTree:
            outs, stash = sp.split.b(*p, *h, *mb, *([None] * n_acc), *lacc)
            return outs[:n_ct], outs[n_ct:], [_local_dp(s) for s in stash]

        ct_specs = self._ct_specs()
        l_specs = [P(DP_AXES)] * n_l
        run = pr._shard_map(body, (pr._param_in_specs(), pr._h_in_specs(), pr._mb_specs(), l_specs),
                            (ct_specs, l_specs, _stash_specs(sp.split)))
        h_sh = [s for s, f in zip(pr.h_shardings(), pr.h_float) if f]
        l_sh = [a.sharding for a in pr.loss_acc_avals()]
        prog = pr._jit(run, out_shardings=(h_sh, l_sh, [None] * len(sp.split.stash)), donate_argnums=(3,))
        self._cache["last_input"] = prog
        return prog

    def last_weight(self) -> Program:
        """Last stage W: ``(params, h W reads, mb W reads, acc, stash) -> acc``."""
        return self._weight_program("last_weight", self.last(), ("h", "mb"),
                                    (self.pr._h_in_specs(), self.pr._mb_specs()))


def _check_b(sp: StageSplit, group: str) -> None:
    if sp.reads("b", group):
        raise SplitError(f"the stage's input gradient reads its gradient accumulators ({group}): its backward "
                         "cannot be split for a zero-bubble schedule; use schedule='1f1b'")


__all__ = ["Groups", "SplitPrograms", "StageSplit"]
