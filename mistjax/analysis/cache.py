"""On-disk cache of analysed profiles: the symbolic analysis of a loss runs once per model.

`analyze_model(..., cache=True)` looks a profile up by a key made of the loss's jaxpr (traced at the
first analysis point), the input shapes at every point, the analysis options and a hash of the
analysis's own source code (a changed analysis never serves an old profile). A hit skips the
analysis (seconds for a tiny model, minutes for a large one).

Profiles hold sympy expressions. They are stored as JSON trees of whitelisted node types (integers,
rationals, the symbols ``b, s, t``, ``Add``, ``Mul``, ``Pow``, ``Max``, ``Min``, ``Piecewise``,
``Eq``, ...) rebuilt by explicit constructors: no pickle, no ``eval`` / ``sympify`` of file contents.
A corrupt, foreign or other-version file is ignored with a warning (and replaced by the next write).

Directory: the ``cache`` argument (a path), else ``$MISTJAX_CACHE_DIR/profiles``, else
``$XDG_CACHE_HOME/mistjax/profiles`` (``~/.cache/mistjax/profiles``). ``MISTJAX_CACHE_DIR=off``
disables the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import TypeAlias, TypeVar

import sympy as sp

from mistjax.analysis.kernels import Gemm, PassKernels, UnitKernel
from mistjax.analysis.poly import B, Poly, S, T
from mistjax.analysis.profile import Collective, ModelProfile, PartProfile

FORMAT = "mistjax.profile"
# 2: a GEMM records whether its operands are fp8; 3: the fused-attention FLOPs and bytes are kept (before, a profile
# read from the cache had none, so context parallelism was priced as if the attention were not the ring kernel).
VERSION = 3
_SYMBOLS = {"b": B, "s": S, "t": T}
# Node types a profile may contain, rebuilt by these constructors (Max / Min unevaluated, as the analysis
# builds them: sympy would otherwise compare every pair symbolically).
_FUNCS: dict[str, Callable[..., sp.Expr]] = {
    "Add": sp.Add, "Mul": sp.Mul, "Pow": sp.Pow,
    "Max": lambda *a: sp.Max(*a, evaluate=False), "Min": lambda *a: sp.Min(*a, evaluate=False),
    "Eq": sp.Eq, "Ne": sp.Ne, "Lt": sp.Lt, "Le": sp.Le, "Gt": sp.Gt, "Ge": sp.Ge,
    "And": sp.And, "Or": sp.Or, "Not": sp.Not, "floor": sp.floor, "ceiling": sp.ceiling, "Mod": sp.Mod,
}

# sympy class names of the relations, by the constructor names used in the files.
_CLASS_NAMES = {"Equality": "Eq", "Unequality": "Ne", "StrictLessThan": "Lt", "LessThan": "Le",
                "StrictGreaterThan": "Gt", "GreaterThan": "Ge"}


JSON: TypeAlias = "dict[str, JSON] | list[JSON] | str | int | float | bool | None"
"""A document ``json.loads`` returns (and ``json.dumps`` takes)."""
Doc: TypeAlias = dict[str, JSON]  # one JSON object


class CacheFormatError(ValueError):
    """A cache file (or an expression in it) is not what this mistjax writes."""


# ------------------------------------------------------------------------------------ expressions
def expr_to_json(e: sp.Basic | int) -> Doc:
    """A sympy expression as a JSON tree (raises `CacheFormatError` for a node outside the whitelist)."""
    e = sp.sympify(e) if isinstance(e, int) else e
    if e is sp.true or e is sp.false:
        return {"bool": bool(e)}
    if isinstance(e, sp.Integer):
        return {"int": str(int(e))}
    if isinstance(e, sp.Rational):
        return {"rat": [str(e.p), str(e.q)]}
    if isinstance(e, sp.Symbol):
        if e.name not in _SYMBOLS or _SYMBOLS[e.name] != e:
            raise CacheFormatError(f"symbol {e!r} is not one of the profile's b, s, t")
        return {"sym": e.name}
    if isinstance(e, sp.Piecewise):
        return {"fn": "Piecewise", "args": [[expr_to_json(x), expr_to_json(c)] for x, c in e.args]}
    name = _CLASS_NAMES.get(type(e).__name__, type(e).__name__)
    if name not in _FUNCS:
        raise CacheFormatError(f"expression node {name} is not cacheable")
    return {"fn": name, "args": [expr_to_json(a) for a in e.args]}


def expr_from_json(doc: JSON) -> sp.Basic:
    """Rebuild an expression written by `expr_to_json` (explicit constructors only)."""
    if not isinstance(doc, dict) or len(doc) not in (1, 2):
        raise CacheFormatError(f"not an expression node: {str(doc)[:80]}")
    if "int" in doc:
        return sp.Integer(int(str(doc["int"])))
    if "rat" in doc:
        p, q = doc["rat"]
        return sp.Rational(int(str(p)), int(str(q)))
    if "sym" in doc:
        if doc["sym"] not in _SYMBOLS:
            raise CacheFormatError(f"unknown symbol {doc['sym']!r}")
        return _SYMBOLS[doc["sym"]]
    if "bool" in doc:
        return sp.true if doc["bool"] is True else sp.false
    fn, args = doc.get("fn"), doc.get("args")
    if not isinstance(args, list):
        raise CacheFormatError("an expression node's args must be a list")
    if fn == "Piecewise":
        return sp.Piecewise(*[(expr_from_json(x), expr_from_json(c)) for x, c in args])
    if fn not in _FUNCS:
        raise CacheFormatError(f"unknown expression node {fn!r}")
    return _FUNCS[fn](*[expr_from_json(a) for a in args])


# ------------------------------------------------------------------------------------ profiles
_SCALARS = ("fwd_flops", "bwd_flops", "fwd_matmul_flops", "bwd_matmul_flops", "weight_bytes", "weight_params",
            "output_bytes", "fused_flops", "fused_matmul_flops", "fused_bytes")
_MAPS = ("recompute_flops", "saved_bytes", "stash_bytes", "fwd_peak_bytes", "bwd_peak_bytes")
V = TypeVar("V")
R = TypeVar("R")


def _map(m: Mapping[str, V], f: Callable[[V], R]) -> dict[str, R]:
    return {str(k): f(v) for k, v in m.items()}


def poly_to_json(p: Poly) -> list[list[int | str]]:
    """``[[i, j, k, "coefficient"], ...]``: exact (a Fraction written as text)."""
    return [[*m, str(c)] for m, c in sorted(p.terms.items())]


def poly_from_json(doc: JSON) -> Poly:
    return Poly({(int(i), int(j), int(k)): Fraction(c) for i, j, k, c in doc})


def kernels_to_json(k: PassKernels) -> Doc:
    u = k.unit
    return {"gemms": [[*(poly_to_json(getattr(g, f)) for f in _GEMM), bool(g.fp8)] for g in k.gemms],
            "fusion_bytes": poly_to_json(k.fusion_bytes), "fusion_count": poly_to_json(k.fusion_count),
            "unit": {**{f: poly_to_json(getattr(u, f)) for f in _UNIT}, "head_dim": int(u.head_dim),
                     "causal": bool(u.causal)},
            "plain": None if k.plain is None else kernels_to_json(k.plain)}


def kernels_from_json(doc: Doc) -> PassKernels:
    u = doc["unit"]
    unit = UnitKernel(**{f: poly_from_json(u[f]) for f in _UNIT}, head_dim=int(u["head_dim"]),
                      causal=bool(u["causal"]))
    return PassKernels(gemms=tuple(Gemm(*(poly_from_json(x) for x in g[:len(_GEMM)]), fp8=bool(g[len(_GEMM)]))
                                   for g in doc["gemms"]),
                       fusion_bytes=poly_from_json(doc["fusion_bytes"]),
                       fusion_count=poly_from_json(doc["fusion_count"]), unit=unit,
                       plain=None if doc["plain"] is None else kernels_from_json(doc["plain"]))


_GEMM = ("batch", "m", "n", "k", "nbytes", "count")
_UNIT = ("count", "matmul_flops", "other_flops", "nbytes")


def part_to_json(p: PartProfile) -> Doc:
    doc: Doc = {"name": p.name, "notes": list(p.notes)}
    doc.update({k: expr_to_json(getattr(p, k)) for k in _SCALARS})
    doc.update({k: _map(getattr(p, k), expr_to_json) for k in _MAPS})
    doc["tp_collectives"] = [{"kind": c.kind, "phase": c.phase, "nbytes": expr_to_json(c.nbytes),
                              "count": expr_to_json(c.count), "dtype": c.dtype,
                              "shape": [expr_to_json(d) for d in c.shape], "where": c.where,
                              "summands": int(c.summands)} for c in p.tp_collectives]
    doc["tp_recompute"] = {k: _map(v, expr_to_json) for k, v in p.tp_recompute.items()}
    doc["tp_divisors"] = [expr_to_json(d) for d in p.tp_divisors]
    doc["kernels"] = {str(k): kernels_to_json(v) for k, v in p.kernels.items()}
    return doc


def part_from_json(doc: Doc) -> PartProfile:
    colls = tuple(Collective(kind=str(c["kind"]), phase=str(c["phase"]), nbytes=expr_from_json(c["nbytes"]),
                             count=expr_from_json(c["count"]), dtype=str(c["dtype"]),
                             shape=tuple(expr_from_json(d) for d in c["shape"]), where=str(c["where"]),
                             summands=int(c["summands"])) for c in doc["tp_collectives"])
    return PartProfile(
        name=str(doc["name"]), **{k: expr_from_json(doc[k]) for k in _SCALARS},
        **{k: _map(doc[k], expr_from_json) for k in _MAPS}, tp_collectives=colls,
        tp_recompute={str(k): _map(v, expr_from_json) for k, v in doc["tp_recompute"].items()},
        tp_divisors=tuple(expr_from_json(d) for d in doc["tp_divisors"]), notes=tuple(str(n) for n in doc["notes"]),
        kernels={str(k): kernels_from_json(v) for k, v in doc.get("kernels", {}).items()})


def profile_to_json(p: ModelProfile) -> Doc:
    return {"pre": part_to_json(p.pre), "block": part_to_json(p.block), "post": part_to_json(p.post),
            "num_layers": int(p.num_layers), "points": [list(x) for x in p.points],
            "sequence_parallel": bool(p.sequence_parallel), "tags": list(p.tags)}


def profile_from_json(doc: Doc) -> ModelProfile:
    return ModelProfile(pre=part_from_json(doc["pre"]), block=part_from_json(doc["block"]),
                        post=part_from_json(doc["post"]), num_layers=int(doc["num_layers"]),
                        points=tuple((int(b), int(s)) for b, s in doc["points"]),
                        sequence_parallel=bool(doc["sequence_parallel"]), tags=tuple(str(t) for t in doc["tags"]))


# ------------------------------------------------------------------------------------ the store
def cache_dir(cache: bool | str | Path | None) -> Path | None:
    """Where profiles live for an ``analyze_model(cache=...)`` argument (None: caching is off)."""
    if cache is None or cache is False:
        return None
    if cache is not True:
        return Path(cache)
    env = os.environ.get("MISTJAX_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env) / "profiles"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mistjax" / "profiles"


def _source_hash() -> str:
    """A hash of the analysis and trace source: a changed analysis never reads an old profile."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for d in ("analysis", "trace"):
        for f in sorted((root / d).glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


_SOURCE: list[str] = []


def profile_key(jaxpr_text: str, options: JSON) -> str:
    """The cache key of a loss traced to ``jaxpr_text`` and analysed with ``options`` (any JSON-able doc)."""
    if not _SOURCE:
        _SOURCE.append(_source_hash())
    doc = json.dumps({"v": VERSION, "src": _SOURCE[0], "options": options}, sort_keys=True, default=str)
    return hashlib.sha256((doc + "\n" + jaxpr_text).encode()).hexdigest()[:32]


def load_profile(directory: Path, key: str) -> ModelProfile | None:
    """The cached profile of ``key``, or None (a missing file; a bad one also warns)."""
    path = directory / f"{key}.json"
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise CacheFormatError(f"format {doc.get('format') if isinstance(doc, dict) else None!r} version "
                                   f"{doc.get('version') if isinstance(doc, dict) else None!r}, expected "
                                   f"{FORMAT!r} version {VERSION}")
        if doc.get("key") != key:
            raise CacheFormatError("the file holds another profile's key")
        return profile_from_json(doc["profile"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"ignoring unreadable profile cache file {str(path)!r} ({type(e).__name__}: {e}); analysing "
                      "again", RuntimeWarning, stacklevel=3)
        return None


def save_profile(directory: Path, key: str, profile: ModelProfile) -> None:
    """Store ``profile`` under ``key`` (atomically; an expression outside the whitelist skips the write)."""
    try:
        doc = {"format": FORMAT, "version": VERSION, "key": key, "profile": profile_to_json(profile)}
    except CacheFormatError as e:
        warnings.warn(f"profile not cached: {e}", RuntimeWarning, stacklevel=3)
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        tmp.replace(directory / f"{key}.json")
    except OSError as e:
        warnings.warn(f"cannot write the profile cache in {str(directory)!r} ({e}); set MISTJAX_CACHE_DIR to a "
                      "writable directory or pass cache=False", RuntimeWarning, stacklevel=3)


__all__ = ["CacheFormatError", "cache_dir", "expr_from_json", "expr_to_json", "load_profile", "profile_from_json",
           "profile_key", "profile_to_json", "save_profile"]
