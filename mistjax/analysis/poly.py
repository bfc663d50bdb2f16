"""Exact polynomials in the micro-batch ``b``, the sequence length ``s`` and ``1/t``.

Every size the analysis handles (a dim, an element count, a byte count, a FLOP count) is a
polynomial in ``b`` and ``s`` with rational coefficients, divided by the tensor-parallel degree
``t`` where a tensor is split over the ``tensor`` axis. `Poly` is a tiny exact representation of
such expressions (monomials ``b^i s^j t^-k`` -> `Fraction`), far faster than sympy for the
thousands of additions liveness analysis performs, and comparable term by term: all three symbols
are >= 1 and positive, so a polynomial whose coefficients are all >= those of another dominates it
everywhere. sympy enters only at the end (`Poly.to_sympy`), and is imported only then: the runtime's
Megatron block reads polynomials (`mistjax.analysis.layout`) and never pays sympy's import.

`fit_dim` recovers a dim's polynomial from its values at several concrete ``(b, s)`` points (the
analysis traces the model at a handful of sizes; see `mistjax.analysis.graph`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sympy as sp


@cache
def symbols() -> tuple[sp.Symbol, sp.Symbol, sp.Symbol]:
    """The sympy symbols ``(b, s, t)`` (positive integers) every profile expression is written in."""
    import sympy as sp

    return sp.symbols("b s t", positive=True, integer=True)


def __getattr__(name: str) -> sp.Symbol | tuple[sp.Symbol, ...]:
    # B, S, T and SYMBOLS are made on first use, so that importing this module does not import sympy.
    if name == "SYMBOLS":
        return symbols()
    if name in ("B", "S", "T"):
        return symbols()["BST".index(name)]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


Mono = tuple[int, int, int]  # exponents of (b, s, 1/t)
Number = int | Fraction

# Fit basis: sizes are at most linear in b and quadratic in s (attention scores are b*h*s*s).
BASIS: tuple[Mono, ...] = ((0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 2, 0), (1, 2, 0))


class Poly:
    """An exact polynomial in ``b``, ``s`` and ``1/t`` (immutable)."""

    __slots__ = ("terms",)

    def __init__(self, terms: Mapping[Mono, Number] | None = None):
        self.terms: dict[Mono, Number] = {m: c for m, c in (terms or {}).items() if c != 0}

    # -- construction ---------------------------------------------------------------------------
    @staticmethod
    def const(c: Number) -> Poly:
        return Poly({(0, 0, 0): c})

    @staticmethod
    def of(x: Poly | Number) -> Poly:
        return x if isinstance(x, Poly) else Poly.const(x)

    # -- arithmetic -----------------------------------------------------------------------------
    def __add__(self, other: Poly | Number) -> Poly:
        other = Poly.of(other)
        out = dict(self.terms)
        for m, c in other.terms.items():
            out[m] = out.get(m, 0) + c
        return Poly(out)

    __radd__ = __add__

    def __neg__(self) -> Poly:
        return Poly({m: -c for m, c in self.terms.items()})

    def __sub__(self, other: Poly | Number) -> Poly:
        return self + (-Poly.of(other))

    def __rsub__(self, other: Poly | Number) -> Poly:
        return Poly.of(other) - self

    def __mul__(self, other: Poly | Number) -> Poly:
        if not isinstance(other, Poly):
            return Poly({m: c * other for m, c in self.terms.items()})
        out: dict[Mono, Number] = {}
        for (i1, j1, k1), c1 in self.terms.items():
            for (i2, j2, k2), c2 in other.terms.items():
                m = (i1 + i2, j1 + j2, k1 + k2)
                out[m] = out.get(m, 0) + c1 * c2
        return Poly(out)

    __rmul__ = __mul__

    def div_t(self, times: int = 1) -> Poly:
        """This polynomial divided by ``t**times`` (a tensor split ``times`` ways... of t)."""
        return Poly({(i, j, k + times): c for (i, j, k), c in self.terms.items()})

    # -- queries --------------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if isinstance(other, int | Fraction):
            other = Poly.const(other)
        return isinstance(other, Poly) and self.terms == other.terms

    def __hash__(self) -> int:
        return hash(frozenset(self.terms.items()))

    def __repr__(self) -> str:
        return f"Poly({self.to_sympy()})"

    @property
    def is_const(self) -> bool:
        return all(m == (0, 0, 0) for m in self.terms)

    @property
    def const_value(self) -> Number:
        return self.terms.get((0, 0, 0), 0)

    def dominates(self, other: Poly) -> bool:
        """True if ``self >= other`` for every ``b, s, t >= 1`` by a term-wise comparison.

        Term-wise domination is sufficient (not necessary): every monomial is positive. A term in
        ``1/t`` is at most the same term without it, so a deficit in ``x/t`` may be covered by a
        surplus in ``x`` (the sharded and replicated parts of the same tensor shape).
        """
        diff = (self - other).terms
        if all(c >= 0 for c in diff.values()):
            return True
        # Move negative 1/t^k coefficients onto the same (i, j) monomial with fewer 1/t factors.
        groups: dict[tuple[int, int], dict[int, Number]] = {}
        for (i, j, k), c in diff.items():
            groups.setdefault((i, j), {})[k] = c
        for ks in groups.values():
            surplus: Number = 0
            for k in sorted(ks):  # from no 1/t factor to the most: x >= x/t >= x/t^2
                surplus += ks[k]
                if surplus < 0:
                    return False
        return True

    def at_t1(self) -> Poly:
        """This polynomial with t = 1."""
        out: dict[Mono, Number] = {}
        for (i, j, _), c in self.terms.items():
            out[(i, j, 0)] = out.get((i, j, 0), 0) + c
        return Poly(out)

    def __call__(self, b: float, s: float, t: float = 1) -> float:
        return float(sum(c * b**i * s**j / t**k for (i, j, k), c in self.terms.items()))

    def exact(self, b: int, s: int, t: int = 1) -> Fraction:
        """Exact value at integer ``(b, s, t)``."""
        return sum(
            (Fraction(c) * b**i * s**j / Fraction(t) ** k for (i, j, k), c in self.terms.items()), Fraction(0)
        )

    def to_sympy(self) -> sp.Expr:
        import sympy as sp

        B, S, T = symbols()
        return sp.Add(
            *[
                sp.Rational(c.numerator, c.denominator) * B**i * S**j / T**k
                if isinstance(c, Fraction)
                else sp.Integer(c) * B**i * S**j / T**k
                for (i, j, k), c in sorted(self.terms.items())
            ]
        )


ZERO = Poly()
ONE = Poly.const(1)
PB = Poly({(1, 0, 0): 1})
PS = Poly({(0, 1, 0): 1})


def prod(xs: Iterable[Poly | Number]) -> Poly:
    out = ONE
    for x in xs:
        out = out * x
    return out


def total(xs: Iterable[Poly]) -> Poly:
    out: dict[Mono, Number] = {}
    for x in xs:
        for m, c in x.terms.items():
            out[m] = out.get(m, 0) + c
    return Poly(out)


def prune_dominated(cands: Sequence[Poly]) -> list[Poly]:
    """The candidates that no other candidate dominates (duplicates collapse to one)."""
    uniq = list(dict.fromkeys(cands))
    keep = []
    for i, c in enumerate(uniq):
        if not any(j != i and o.dominates(c) and not (c.dominates(o) and j > i) for j, o in enumerate(uniq)):
            keep.append(c)
    return keep


def max_expr(cands: Sequence[Poly]) -> sp.Expr:
    """sympy ``Max`` of the non-dominated candidates (0 if there are none)."""
    import sympy as sp

    keep = prune_dominated(cands)
    if not keep:
        return sp.Integer(0)
    # evaluate=False: sympy would compare every pair symbolically (slow) and the candidates are
    # already pruned.
    return sp.Max(*[c.to_sympy() for c in keep], evaluate=False) if len(keep) > 1 else keep[0].to_sympy()


class FitError(ValueError):
    """A traced size is not a polynomial of degree <= 1 in b and <= 2 in s."""


@cache
def _inverse(points: tuple[tuple[int, int], ...]) -> tuple[tuple[Fraction, ...], ...]:
    """Exact inverse of the design matrix of `BASIS` at ``points`` (Gauss-Jordan on Fractions)."""
    n = len(BASIS)
    if len(points) != n:
        raise ValueError(f"need exactly {n} fit points, got {len(points)}")
    a = [
        [Fraction(b**i * s**j) for (i, j, _) in BASIS] + [Fraction(int(r == c)) for c in range(n)]
        for r, (b, s) in enumerate(points)
    ]
    for col in range(n):
        piv = next((r for r in range(col, n) if a[r][col] != 0), None)
        if piv is None:
            raise ValueError(
                f"fit points {points} do not determine a polynomial of degree <=1 in b, "
                "<=2 in s; use two batch sizes times three sequence lengths"
            )
        a[col], a[piv] = a[piv], a[col]
        p = a[col][col]
        a[col] = [x / p for x in a[col]]
        for r in range(n):
            if r != col and a[r][col] != 0:
                f = a[r][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return tuple(tuple(row[n:]) for row in a)


def _fit_b(values: Sequence[int], points: Sequence[tuple[int, int]]) -> Poly:
    """The line in ``b`` through ``values`` at points of one sequence length (a loss that traces at no other:
    `mistjax.analysis.analyze.fixed_length_points`); the length's own terms fold into the coefficients."""
    b0 = points[0][0]
    j = next(k for k, (b, _) in enumerate(points) if b != b0)  # a second batch size
    slope = Fraction(values[j] - values[0], points[j][0] - b0)
    coefs = {(0, 0, 0): values[0] - slope * b0, (1, 0, 0): slope}
    poly = Poly({m: (int(c) if c.denominator == 1 else c) for m, c in coefs.items()})
    for v, (b, s) in zip(values, points):
        if poly.exact(b, s) != v:
            raise FitError(f"sizes {list(values)} at (b, s) = {list(points)} are not a polynomial of degree <= 1 in b")
    return poly


def fit_dim(values: Sequence[int], points: Sequence[tuple[int, int]]) -> Poly:
    """The polynomial in (b, s) through ``values`` at the first six ``points``.

    Fast paths cover the common dims (a constant, ``b`` or ``s``) without solving.
    """
    if all(v == values[0] for v in values):
        return Poly.const(int(values[0]))
    if all(v == b for v, (b, _) in zip(values, points)):
        return PB
    if all(v == s for v, (_, s) in zip(values, points)):
        return PS
    if len({s for _, s in points}) == 1:
        return _fit_b(values, points)
    inv = _inverse(tuple(points[: len(BASIS)]))
    coefs = [sum((inv[r][c] * values[c] for c in range(len(BASIS))), Fraction(0)) for r in range(len(BASIS))]
    poly = Poly({m: (int(c) if c.denominator == 1 else c) for m, c in zip(BASIS, coefs)})
    for v, (b, s) in zip(values, points):
        if poly.exact(b, s) != v:
            raise FitError(
                f"sizes {list(values)} at (b, s) = {list(points)} are not a polynomial of degree "
                "<= 1 in b and <= 2 in s"
            )
    return poly
