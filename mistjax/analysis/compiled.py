"""Vectorised evaluation of a `ModelProfile` over arrays of strategies.

`compile_profile` lambdifies every expression once (``sympy.lambdify`` with common-subexpression
elimination, NumPy backend) into a single function of ``(b, s, t)``; calling it with NumPy
arrays evaluates all quantities for all strategies at once, broadcasting like NumPy. Evaluating
the ~100 expressions of a profile over 1e5 strategies takes a few milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

import numpy as np
import sympy as sp
from numpy.typing import ArrayLike

from mistjax.analysis.kernels import CompiledKernels, compile_kernels
from mistjax.analysis.poly import B, S, T
from mistjax.analysis.profile import ModelProfile, PartProfile

Lambdified: TypeAlias = Callable[[np.ndarray, np.ndarray, np.ndarray], list[np.ndarray | float]]
"""``sympy.lambdify`` of expressions in ``(b, s, t)``: one array (or a constant) per expression."""


class ProfileQueries:
    """`values` and `evaluate` of a profile that maps ``(b, s, t)`` to every quantity it names."""

    names: tuple[str, ...]

    def __call__(self, b: ArrayLike, s: ArrayLike, t: ArrayLike = 1) -> Mapping[str, np.ndarray]:
        raise NotImplementedError

    def values(self, b: ArrayLike, s: ArrayLike, t: ArrayLike = 1) -> ProfileValues:
        """All quantities at ``(b, s, t)`` with typed access per part (`ProfileValues`)."""
        v = self(b, s, t)
        return ProfileValues(PartValues(v, "pre"), PartValues(v, "block"), PartValues(v, "post"))

    def evaluate(self, name: str, b: ArrayLike, s: ArrayLike, t: ArrayLike = 1) -> np.ndarray:
        """One quantity (evaluates all of them; cheap, and it keeps one compiled function)."""
        if name not in self.names:
            raise KeyError(f"unknown quantity {name!r}; known: {', '.join(self.names[:8])}, ...")
        return self(b, s, t)[name]


@dataclass(frozen=True)
class CompiledProfile(ProfileQueries):
    """Every quantity of a profile as one vectorised NumPy function of ``(b, s, t)``.

    Keys are ``"<part>.<quantity>"`` as in `ModelProfile.expressions`, e.g. ``block.fwd_flops``,
    ``block.saved_bytes[full]``, ``block.tp.all-gather.fwd``, ``post.bwd_peak_bytes[none]``.

    Example::

        cp = compile_profile(profile)
        v = cp(b=np.array([1, 2, 4]), s=2048, t=np.array([1, 2, 4]))
        v["block.fwd_flops"]            # array of 3
        cp.feasible(b, s, t)            # t divides heads, kv heads, ffn, vocab and s
    """

    profile: ModelProfile
    names: tuple[str, ...]
    fn: Lambdified
    divisors: tuple[sp.Expr, ...]
    divisor_fn: Lambdified
    kernels: CompiledKernels | None = field(default=None, compare=False, repr=False)  # the parts' kernel tables
    # Scalar points already evaluated: the tuner asks for the same (b, s, t) of a key hundreds of times,
    # and one evaluation of every expression costs ~30 ms however small the arrays are.
    _scalar_cache: dict[tuple[float, float, float], dict[str, np.ndarray]] = field(
        default_factory=dict, compare=False, repr=False)

    def __call__(self, b: ArrayLike, s: ArrayLike, t: ArrayLike = 1) -> Mapping[str, np.ndarray]:
        """All quantities at ``(b, s, t)`` (broadcast together), as read-only float64 arrays."""
        b, s, t = (np.asarray(x, dtype=np.float64) for x in (b, s, t))
        shape = np.broadcast_shapes(b.shape, s.shape, t.shape)
        if all(x.size == 1 or x.min() == x.max() for x in (b, s, t)):  # one point, maybe broadcast
            key = (float(b.flat[0]), float(s.flat[0]), float(t.flat[0]))
            if key not in self._scalar_cache:
                one = np.ones(())
                self._scalar_cache[key] = dict(zip(self.names, (np.asarray(v, dtype=np.float64) for v in
                                                                self.fn(one * key[0], one * key[1], one * key[2]))))
            return {n: np.broadcast_to(v, shape) for n, v in self._scalar_cache[key].items()}
        if math.prod(shape) > 4096:  # many strategies, few distinct sizes: evaluate each size once, then gather
            cols = [np.broadcast_to(x, shape).ravel() for x in (b, s, t)]
            key = np.zeros(cols[0].shape, dtype=np.int64)
            for col in cols:
                u, inv = np.unique(col, return_inverse=True)
                key = key * len(u) + inv
            _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
            out = self.fn(*(c[first] for c in cols))
            return _Gathered(dict(zip(self.names, out)), inverse, shape)
        out = self.fn(b, s, t)
        return {n: np.broadcast_to(np.asarray(v, dtype=np.float64), shape) for n, v in zip(self.names, out)}

    def feasible(self, b: ArrayLike, s: ArrayLike, t: ArrayLike) -> np.ndarray:
        """True where ``t`` divides every tensor-split size (always true for ``t == 1``)."""
        b, s, t = (np.asarray(x) for x in (b, s, t))
        shape = np.broadcast_shapes(b.shape, s.shape, t.shape)
        ok = np.ones(shape, dtype=bool)
        for d in self.divisor_fn(b, s, t):
            ok &= np.mod(np.broadcast_to(d, shape), t) == 0
        return ok


class _Gathered(Mapping[str, np.ndarray]):
    """Quantities evaluated at distinct sizes, expanded to the strategies only when read (callers read a few)."""

    def __init__(self, rows: dict[str, np.ndarray | float], inverse: np.ndarray, shape: tuple[int, ...]) -> None:
        self._rows, self._inverse, self._shape = rows, inverse, shape
        self._done: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._done:
            v = np.asarray(self._rows[name], dtype=np.float64)
            self._done[name] = (v[self._inverse] if v.ndim else np.full(self._inverse.shape, float(v))).reshape(
                self._shape)
        return self._done[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


class PartValues:
    """One part's quantities (`PartProfile`) evaluated at strategies' ``(b, s, t)``: NumPy arrays.

    Per-policy quantities take a policy name, or (``*_at``) an array of indices into ``policies``
    that picks one policy per strategy.
    """

    def __init__(self, values: Mapping[str, np.ndarray], part: str) -> None:
        self._v, self.part = values, part

    def _get(self, quantity: str) -> np.ndarray:
        return self._v[f"{self.part}.{quantity}"]

    @property
    def fwd_flops(self) -> np.ndarray:
        return self._get("fwd_flops")

    @property
    def bwd_flops(self) -> np.ndarray:
        return self._get("bwd_flops")

    @property
    def fwd_matmul_flops(self) -> np.ndarray:
        return self._get("fwd_matmul_flops")

    @property
    def bwd_matmul_flops(self) -> np.ndarray:
        return self._get("bwd_matmul_flops")

    @property
    def weight_bytes(self) -> np.ndarray:
        return self._get("weight_bytes")

    @property
    def output_bytes(self) -> np.ndarray:
        return self._get("output_bytes")

    def saved_bytes(self, policy: str) -> np.ndarray:
        return self._get(f"saved_bytes[{policy}]")

    def stash_bytes(self, policy: str) -> np.ndarray:
        """What one deferred weight-gradient pass of a layer under `policy` holds (zero-bubble schedules)."""
        return self._get(f"stash_bytes[{policy}]")

    def fwd_peak_bytes(self, policy: str) -> np.ndarray:
        return self._get(f"fwd_peak_bytes[{policy}]")

    def bwd_peak_bytes(self, policy: str) -> np.ndarray:
        return self._get(f"bwd_peak_bytes[{policy}]")

    def recompute_flops(self, policy: str) -> np.ndarray:
        return self._get(f"recompute_flops[{policy}]")

    def tp(self, kind: str, phase: str) -> np.ndarray:
        """Tensor-parallel collective bytes of ``kind`` in ``phase`` (fwd | bwd), without remat."""
        return self._get(f"tp.{kind}.{phase}")

    def tp_calls(self, kind: str, phase: str) -> np.ndarray:
        """Tensor-parallel collectives of ``kind`` issued in ``phase`` (fwd | bwd), without remat."""
        return self._get(f"tp_calls.{kind}.{phase}")

    def tp_recompute(self, policy: str, kind: str) -> np.ndarray:
        """Extra tensor-parallel collective bytes a layer checkpointed with ``policy`` issues."""
        return self._get(f"tp_recompute[{policy}].{kind}")

    def pick(self, per_policy: Callable[[str], np.ndarray], policies: Sequence[str], index: ArrayLike) -> np.ndarray:
        """``per_policy(policies[index])`` with the policy chosen per strategy (vectorised)."""
        stack = np.stack([per_policy(p) for p in policies])
        idx = np.broadcast_to(np.asarray(index), stack.shape[1:]).astype(np.int64)
        return np.take_along_axis(stack, idx[None], axis=0)[0]


class ProfileValues(NamedTuple):
    """A `CompiledProfile` evaluated at strategies' ``(b, s, t)``, one `PartValues` per part."""

    pre: PartValues  # embedding (and anything before the layer stack)
    block: PartValues  # one layer
    post: PartValues  # final norm, head and loss


def _divisors(profile: ModelProfile) -> tuple[sp.Expr, ...]:
    seen: dict[str, sp.Expr] = {}
    for part in profile.parts.values():
        for d in part.tp_divisors:
            seen.setdefault(str(d), d)
    # Sizes whose gcd is known only need the gcd checked: t | a and t | b  <=>  t | gcd(a, b).
    consts = [int(d) for d in seen.values() if d.is_Integer]
    rest = [d for d in seen.values() if not d.is_Integer]
    return ((sp.Integer(math.gcd(*consts)),) if consts else ()) + tuple(rest)


def compile_profile(profile: ModelProfile) -> CompiledProfile:
    """Lambdify every expression of ``profile`` into one NumPy function of ``(b, s, t)``."""
    exprs = profile.expressions()
    names = tuple(exprs)
    fn = sp.lambdify((B, S, T), [exprs[n] for n in names], modules="numpy", cse=True)
    divs = _divisors(profile)
    divisor_fn = sp.lambdify((B, S, T), list(divs) or [sp.Integer(0)], modules="numpy")
    parts = [p for p in profile.parts.values() if p.kernels]
    kernels = compile_kernels(parts) if len(parts) == len(profile.parts) else None
    return CompiledProfile(profile=profile, names=names, fn=fn, divisors=divs, divisor_fn=divisor_fn, kernels=kernels)


def part_values(values: Mapping[str, np.ndarray], part: PartProfile | str) -> dict[str, np.ndarray]:
    """The entries of one part, without the ``"<part>."`` prefix."""
    name = part if isinstance(part, str) else part.name
    return {k[len(name) + 1 :]: v for k, v in values.items() if k.startswith(name + ".")}
