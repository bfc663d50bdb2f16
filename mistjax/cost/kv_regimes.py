"""The compiled profile of a model whose key / value heads some tensor-parallel degrees split and others replicate.

The runtime splits a ``kv_heads`` dim over ``tensor`` when the degree ``t`` divides it and keeps it whole on
every device otherwise (`mistjax.analysis.tp_roles.kv_replicated_axes`). The symbolic analysis is exact in
``t`` for ONE set of split weights, so such a model has two analyses: the one with the key / value heads split
(for the degrees that divide them) and the one with them replicated (for the others: the k / v projections'
FLOPs, weights and gradients whole on each device, their gradients summed over the tensor group).
`KVRegimes` evaluates each strategy with the analysis of its degree, behind the interface of
`mistjax.analysis.CompiledProfile`, so the cost model reads it unchanged. The replicated analysis is built on
first use (a degree the kv heads do not divide), as most models and searches never need it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from mistjax.analysis.compiled import CompiledProfile, ProfileQueries, compile_profile
from mistjax.analysis.kernels import KernelArrays
from mistjax.analysis.profile import ModelProfile


@dataclass(frozen=True)
class KVRegimes(ProfileQueries):
    """A `CompiledProfile` per tensor-parallel regime of the key / value heads (see the module doc).

    Attributes:
      base: the analysis with the kv heads split (used where ``t`` divides every kv-head size, and at ``t == 1``).
      kv_sizes: the sizes of the dims named ``kv_heads``.
      build: the analysis with the kv heads replicated (called once, on first use).
    """

    base: CompiledProfile
    kv_sizes: tuple[int, ...]
    build: Callable[[], ModelProfile] = field(repr=False, compare=False)
    _replicated: list[CompiledProfile] = field(default_factory=list, repr=False, compare=False)
    # `ProfileQueries.names` is an attribute, so this is one too (the base analysis's names; both regimes share them).
    names: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", self.base.names)

    # ----------------------------------------------------------------------------- the regimes
    def replicated_at(self, t: ArrayLike) -> np.ndarray:
        """True where ``t``-way tensor parallelism replicates the kv heads (``t > 1`` not dividing one of them)."""
        t = np.asarray(t, dtype=np.float64)
        out = np.zeros(t.shape, dtype=bool)
        for size in self.kv_sizes:
            out |= np.mod(size, t) != 0
        return out & (t > 1)

    @property
    def replicated(self) -> CompiledProfile:
        """The compiled analysis with the kv heads replicated (built on first use)."""
        if not self._replicated:
            self._replicated.append(compile_profile(self.build()))
        return self._replicated[0]

    # ----------------------------------------------------------------------------- CompiledProfile's interface
    @property
    def profile(self) -> ModelProfile:
        return self.base.profile

    @property
    def kernels(self) -> _KernelRegimes | None:
        return None if self.base.kernels is None else _KernelRegimes(self)

    def _mask(self, b: ArrayLike, s: ArrayLike, t: ArrayLike) -> np.ndarray:
        shape = np.broadcast_shapes(np.shape(b), np.shape(s), np.shape(t))
        return np.broadcast_to(self.replicated_at(t), shape)

    def __call__(self, b: ArrayLike, s: ArrayLike, t: ArrayLike = 1) -> Mapping[str, np.ndarray]:
        """All quantities at ``(b, s, t)``, each strategy from its regime's analysis."""
        mask = self._mask(b, s, t)
        if not mask.any():
            return self.base(b, s, t)
        if mask.all():
            return self.replicated(b, s, t)
        return _Merged(mask, self.replicated(b, s, t), self.base(b, s, t))

    def feasible(self, b: ArrayLike, s: ArrayLike, t: ArrayLike) -> np.ndarray:
        """True where ``t`` divides every size its regime's analysis splits.

        Grouped kv heads that ``t`` does not divide (several kv heads) are never feasible: the fused and
        blockwise kernels group the query heads as ``[kv, group]``, so the runtime leaves such attention to
        GSPMD's default partitioning, which is not priced. That is decided here without building the replicated
        analysis (seconds), which only multi-query attention (one kv head) needs.
        """
        mask = self._mask(b, s, t)
        ok = self.base.feasible(b, s, t)
        if mask.any():
            ok = np.where(mask, max(self.kv_sizes) == 1 and self.replicated.feasible(b, s, t), ok)
        return ok


class _Merged(Mapping[str, np.ndarray]):
    """Quantities taken from ``a`` where ``mask`` holds and from ``b`` elsewhere (merged when read)."""

    def __init__(self, mask: np.ndarray, a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> None:
        self._mask, self._a, self._b = mask, a, b
        self._done: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._done:
            self._done[name] = np.where(self._mask, self._a[name], self._b[name])
        return self._done[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._b)

    def __len__(self) -> int:
        return len(self._b)


@dataclass(frozen=True)
class _KernelRegimes:
    """`CompiledKernels` of a `KVRegimes`: each point's kernel table from its regime's analysis."""

    regimes: KVRegimes

    def __call__(self, b: ArrayLike, s: ArrayLike, t: ArrayLike) -> dict[tuple[str, str], KernelArrays]:
        """``(part, pass key) -> KernelArrays`` at the 1-D arrays of points ``b, s, t``."""
        b, s, t = np.broadcast_arrays(*(np.atleast_1d(np.asarray(x, dtype=np.float64)) for x in (b, s, t)))
        mask = self.regimes.replicated_at(t)
        base = self.regimes.base.kernels
        assert base is not None  # a `_KernelRegimes` is made only for a base analysis with kernel tables
        if not mask.any():
            return base(b, s, t)
        rep = self.regimes.replicated.kernels
        assert rep is not None, "the replicated analysis has kernel tables where the split one has them"
        if mask.all():
            return rep(b, s, t)
        tables_r, tables_b = rep(b, s, t), base(b, s, t)
        return {key: _merge_kernels(mask, tables_r[key], tables_b[key]) for key in tables_b}


def _merge_kernels(mask: np.ndarray, a: KernelArrays, b: KernelArrays) -> KernelArrays:
    """One pass's kernels, ``a``'s at the points where ``mask`` holds and ``b``'s elsewhere.

    The two analyses may list different GEMMs: the table holds both lists side by side, each with a zero
    execution count at the other regime's points (a GEMM that runs zero times costs nothing).
    """
    def gemms(name: str) -> np.ndarray:
        return np.concatenate([getattr(a, name), getattr(b, name)], axis=-1)

    keep_a, keep_b = mask[:, None], ~mask[:, None]
    count = np.concatenate([np.where(keep_a, a.gemm_count, 0.0), np.where(keep_b, b.gemm_count, 0.0)], axis=-1)

    def pick(name: str) -> np.ndarray:
        return np.where(mask, getattr(a, name), getattr(b, name))

    return KernelArrays(gemms("gemm_batch"), gemms("gemm_m"), gemms("gemm_n"), gemms("gemm_k"), gemms("gemm_bytes"),
                        count, gemms("gemm_fp8"), pick("fusion_bytes"), pick("fusion_count"), pick("unit_count"),
                        pick("unit_matmul_flops"), pick("unit_other_flops"), pick("unit_bytes"),
                        head_dim=b.head_dim or a.head_dim, causal=b.causal or a.causal)


__all__ = ["KVRegimes"]
