"""Unrolled layer stacks: a block repeated L times in the jaxpr, seen as a scan over stacked parameters.

Models written as a Python loop over their layers (Hugging Face's Flax models, an NNX ``nnx.List`` of
layers, linen ``Block_0 .. Block_{L-1}``) trace to L copies of the same equations, each reading its
own parameter subtree. `find_unrolled` recognises them in two steps:

1. *Candidates from the parameter paths*: leaves whose key paths differ in one index-like key
   (``layers/3/...``, ``h/3/...``, ``Block_3/...``) and whose subtrees have equal structure, shapes
   and dtypes form L groups; the candidate holding the most bytes is tried first.
2. *Proof from the jaxpr*: the equations from layer 0's first parameter use on must repeat with one
   period, every input of a layer must be a constant (the same value for all layers: rotary tables,
   masks), its own layer's parameter at the same place, a value of its own layer, or the *carry*
   (a value of the previous layer at a fixed place; for layer 0 a value of the pre part), and the
   rest of the program may read only the last layer's carry. The cut between layers is the one
   with the fewest carried values (the hidden state).

The loss is then re-traced as a function of *virtual* parameters (`ParamGroups`): the non-layer
leaves as they are and, per place in the layer subtree, one leaf stacked over the L layers; the
L copies are replaced by one ``scan`` over those, so the rest of mistjax (analysis, cost model,
runtime layer loop) handles the model exactly as a scanned one. The train state stays unstacked:
`ParamGroups.to_virtual` presents the L real leaves as a `LayerSlices` (the runtime's layer loop
then indexes the real leaves per layer, with no stacked copy) or stacks them where a caller needs
an array.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

_INDEXED = re.compile(r"^(.*?)_?(\d+)$")


@dataclass(frozen=True)
class ParamGroups:
    """How the loss's real parameter leaves map to its virtual (stacked) ones.

    Attributes:
      num_real: number of real parameter leaves.
      virtual: per virtual leaf, the real leaf index it is (an int) or the L real leaves, layer by layer,
        it stacks (a tuple).
    """

    num_real: int
    virtual: tuple[int | tuple[int, ...], ...]

    @property
    def num_layers(self) -> int:
        return next(len(v) for v in self.virtual if isinstance(v, tuple))

    def members(self) -> dict[int, tuple[int, int]]:
        """Real leaf index -> (virtual leaf, layer) for every layer leaf."""
        return {r: (k, layer) for k, v in enumerate(self.virtual) if isinstance(v, tuple)
                for layer, r in enumerate(v)}

    def real_index(self, k: int) -> int:
        """The real leaf of a non-stacked virtual leaf ``k`` (layer 0's leaf for a stacked one)."""
        v = self.virtual[k]
        return v if isinstance(v, int) else v[0]

    def to_virtual(self, real: Sequence[Any], *, slices: bool = True) -> list[Any]:
        """Virtual leaves from real ones: a stacked leaf as `LayerSlices` (or stacked, ``slices=False``)."""
        out: list[Any] = []
        for v in self.virtual:
            if isinstance(v, int):
                out.append(real[v])
            else:
                ls = LayerSlices(tuple(real[r] for r in v))
                out.append(ls if slices else ls.stacked())
        return out

    def virtual_avals(self, real: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
        def sds(x: Any, lead: tuple[int, ...] = ()) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(lead + tuple(np.shape(x)), x.dtype)

        return [sds(real[v]) if isinstance(v, int) else sds(real[v[0]], (len(v),)) for v in self.virtual]

    def virtual_axes(self, real: Sequence[Any]) -> list[Any]:
        """Per virtual leaf, the logical axes (``("layers", *axes)`` for a stacked one; None stays None)."""
        out = []
        for v in self.virtual:
            ax = real[v] if isinstance(v, int) else real[v[0]]
            out.append(ax if isinstance(v, int) or ax is None else ("layers", *ax))
        return out

    def to_real(self, virtual: Sequence[Any]) -> list[Any]:
        """Real leaves from virtual ones (a stacked leaf split into its L layers)."""
        out: list[Any] = [None] * self.num_real
        for v, x in zip(self.virtual, virtual):
            if isinstance(v, int):
                out[v] = x
            else:
                parts = x.parts if isinstance(x, LayerSlices) else [x[i] for i in range(len(v))]
                for r, p in zip(v, parts):
                    out[r] = p
        return out


@dataclass(frozen=True)
class LayerSlices:
    """One virtual stacked leaf as its L real per-layer arrays (no stacked copy is made)."""

    parts: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *np.shape(self.parts[0]))

    @property
    def dtype(self) -> Any:
        return self.parts[0].dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def stacked(self) -> jax.Array:
        return jnp.stack(self.parts)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return LayerSlices(self.parts[index])
        return self.parts[index]


# ------------------------------------------------------------------------------------ candidates

def _token(key: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def _tokens(path: Any) -> tuple[Any, ...]:
    toks = tuple(_token(k) for k in path)
    while toks and toks[-1] in ("value", "raw_value"):  # nnx.Variable / linen Partitioned boxes
        toks = toks[:-1]
    return toks


def _layer_index(tok: Any) -> tuple[str, int] | None:
    """``(stem, index)`` for an index-like key: 3, "3", "layers_3", "Block3"."""
    if isinstance(tok, int) and not isinstance(tok, bool):
        return "", tok
    if isinstance(tok, str):
        m = _INDEXED.match(tok)
        if m:
            return m.group(1), int(m.group(2))
    return None


def candidate_groups(paths: Sequence[Any], avals: Sequence[Any]) -> list[list[list[int]]]:
    """Candidate layer groupings of the leaves, most bytes first: each ``groups[layer][k]`` is the real
    leaf at place ``k`` of layer ``layer``'s subtree (places sorted alike for every layer)."""
    toks = [_tokens(p) for p in paths]
    cands: dict[tuple[Any, ...], dict[int, dict[tuple[Any, ...], int]]] = {}
    for i, t in enumerate(toks):
        for pos, tok in enumerate(t):
            idx = _layer_index(tok)
            if idx is None:
                continue
            key = (pos, t[:pos], idx[0])
            cands.setdefault(key, {}).setdefault(idx[1], {})[t[pos + 1:]] = i
    out = []
    for layers in cands.values():
        if len(layers) < 2:
            continue
        order = sorted(layers)
        if order != list(range(order[0], order[0] + len(order))):
            continue
        places = sorted(layers[order[0]], key=str)
        if any(sorted(layers[k], key=str) != places for k in order):
            continue

        def sig(i: int) -> tuple[Any, ...]:
            return tuple(np.shape(avals[i])), str(np.dtype(avals[i].dtype))

        groups = [[layers[k][p] for p in places] for k in order]
        if any([sig(i) for i in g] != [sig(i) for i in groups[0]] for g in groups):
            continue
        out.append(groups)
    size = lambda g: sum(int(np.prod(np.shape(avals[i]))) for layer in g for i in layer)  # noqa: E731
    return sorted(out, key=size, reverse=True)


# ------------------------------------------------------------------------------------ proof in the jaxpr

class _Sig:
    """Equation signatures (primitive, params, operand types), sub-jaxprs printed once."""

    def __init__(self) -> None:
        self._memo: dict[int, str] = {}

    def param(self, v: Any) -> str:
        if isinstance(v, jex.ClosedJaxpr | jex.Jaxpr):
            hit = self._memo.get(id(v))
            if hit is None:
                hit = self._memo[id(v)] = str(v)
            return hit
        if isinstance(v, tuple | list):
            return "(" + ",".join(self.param(x) for x in v) + ")"
        return repr(v)

    def __call__(self, eqn: Any) -> tuple[Any, ...]:
        ins = tuple(("lit", repr(v.val)) if isinstance(v, jex.Literal) else str(v.aval) for v in eqn.invars)
        params = tuple((k, self.param(v)) for k, v in sorted(eqn.params.items()))
        return eqn.primitive.name, params, ins, tuple(str(v.aval) for v in eqn.outvars)


@dataclass(frozen=True)
class _Run:
    """A proven repetition: L layers of P equations from ``start``."""

    start: int
    period: int
    num_layers: int
    sources: tuple[tuple[tuple[str, Any], ...], ...]  # per eqn of layer 0, per input: how to get it
    consts: tuple[Any, ...]  # outside vars every layer reads
    carry_init: tuple[Any, ...]  # per carry slot: the outside var layer 0 reads
    carry_slots: tuple[tuple[int, int], ...]  # per slot: (eqn offset, output index) producing it


def _const_aliases(closed: jex.ClosedJaxpr) -> dict[Any, Any]:
    """Constvar -> the first constvar of equal value: each layer of an unrolled model may capture its own
    copy of a constant (a rotary table built per attention module), which is one constant of the block."""
    seen: dict[tuple[Any, ...], Any] = {}
    out = {}
    for v, c in zip(closed.jaxpr.constvars, closed.consts):
        try:
            arr = np.asarray(c)
        except Exception:  # noqa: BLE001 -- an opaque constant (e.g. a PRNG key) is only itself
            out[v] = v
            continue
        key = (arr.shape, str(arr.dtype), arr.tobytes())
        out[v] = seen.setdefault(key, v)
    return out


def _prove(jaxpr: Any, groups: list[list[int]], start: int, period: int,
           aliases: dict[Any, Any] | None = None) -> _Run | None:
    """Check that ``groups`` run as L repeats of ``period`` equations from ``start``; the run or None."""
    L, eqns = len(groups), jaxpr.eqns
    aliases = aliases or {}
    invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
    place = {}
    for layer, g in enumerate(groups):
        for k, i in enumerate(g):
            place[i] = (layer, k)
    producer: dict[Any, tuple[int, int, int]] = {}  # var -> (layer, offset, out index) inside the run
    end = start + L * period
    for e in range(start, end):
        for q, v in enumerate(eqns[e].outvars):
            producer[v] = ((e - start) // period, (e - start) % period, q)
    consts: dict[Any, int] = {}
    carry_of_slot: dict[tuple[int, int], int] = {}
    carry_init: list[Any] = []
    sources: list[list[tuple[str, Any]]] = [[None] * len(eqns[start + j].invars) for j in range(period)]
    for j in range(period):
        for q in range(len(eqns[start + j].invars)):
            kinds = []
            for layer in range(L):
                v = eqns[start + layer * period + j].invars[q]
                if isinstance(v, jex.Literal):
                    kinds.append(("lit", None))
                elif v in invar_index and invar_index[v] in place:
                    pl, k = place[invar_index[v]]
                    if pl != layer:
                        return None
                    kinds.append(("x", k))
                elif v in producer:
                    pl, off, oq = producer[v]
                    if pl == layer:
                        kinds.append(("local", (off, oq)))
                    elif pl == layer - 1:
                        kinds.append(("carry", (off, oq)))
                    else:
                        return None
                else:
                    kinds.append(("outside", aliases.get(v, v)))
            first, rest = kinds[0], kinds[1:]
            if first[0] in ("lit", "x", "local"):
                if any(k != first for k in rest):
                    return None
                sources[j][q] = first
            elif first[0] == "outside":
                if all(k == first for k in rest):  # the same value for every layer: a constant
                    sources[j][q] = ("const", consts.setdefault(first[1], len(consts)))
                elif rest and all(k[0] == "carry" and k == rest[0] for k in rest):
                    slot = rest[0][1]
                    if slot not in carry_of_slot:
                        carry_of_slot[slot] = len(carry_init)
                        carry_init.append(first[1])
                    elif carry_init[carry_of_slot[slot]] is not first[1]:
                        return None
                    sources[j][q] = ("carry", carry_of_slot[slot])
                else:
                    return None
            else:
                return None
    # The rest of the program may read only the last layer's carry (and nothing of earlier layers).
    slots = producer
    for e in [*range(start), *range(end, len(eqns))]:
        for v in eqns[e].invars:
            if isinstance(v, jex.Var) and v in slots:
                layer, off, oq = slots[v]
                if layer != L - 1 or (off, oq) not in carry_of_slot:
                    return None
    for v in jaxpr.outvars:
        if isinstance(v, jex.Var) and v in slots:
            layer, off, oq = slots[v]
            if layer != L - 1 or (off, oq) not in carry_of_slot:
                return None
    # Layer parameters are read only inside the run.
    for e in [*range(start), *range(end, len(eqns))]:
        if any(isinstance(v, jex.Var) and invar_index.get(v) in place for v in eqns[e].invars):
            return None
    order = sorted(carry_of_slot, key=carry_of_slot.get)
    return _Run(start=start, period=period, num_layers=L, sources=tuple(tuple(s) for s in sources),
                consts=tuple(sorted(consts, key=consts.get)), carry_init=tuple(carry_init),
                carry_slots=tuple(order))


def _find_run(closed: jex.ClosedJaxpr, groups: list[list[int]]) -> _Run | None:
    """The repetition of ``groups`` in ``closed`` with the fewest carried values, or None."""
    jaxpr = closed.jaxpr
    inv = {v: i for i, v in enumerate(jaxpr.invars)}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for e, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jex.Var) and v in inv:
                first.setdefault(inv[v], e)
                last[inv[v]] = e
    if any(i not in first for g in groups for i in g):
        return None
    f = [min(first[i] for i in g) for g in groups]
    g_last = [max(last[i] for i in g) for g in groups]
    period = f[1] - f[0]
    if period <= 0 or any(f[k + 1] - f[k] != period for k in range(len(f) - 1)):
        return None
    if any(g_last[k] >= f[k + 1] for k in range(len(f) - 1)):
        return None
    sig = _Sig()
    sigs = [sig(e) for e in jaxpr.eqns]
    L = len(groups)
    aliases = _const_aliases(closed)
    best: _Run | None = None
    for delta in range(period):
        start = f[0] - delta
        if start < 0:
            break
        if start + L * period > len(sigs) or g_last[-1] >= start + L * period:
            continue  # the last layer would run past the program: cut earlier
        if any(sigs[start + layer * period + j] != sigs[start + j] for layer in range(1, L) for j in range(period)):
            continue
        run = _prove(jaxpr, groups, start, period, aliases)
        if run is not None and (best is None or len(run.carry_slots) < len(best.carry_slots)):
            best = run
    return best


# ------------------------------------------------------------------------------------ rewrite

def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if isinstance(v, jex.Literal) else env[v]


def _virtual_fun(closed: jex.ClosedJaxpr, run: _Run, pg: ParamGroups, bind: Any) -> Any:
    """``f(*virtual_leaves, *rest_leaves)`` evaluating ``closed`` with its run as one ``lax.scan``."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    n_real = pg.num_real
    layer0 = eqns[run.start: run.start + run.period]
    last = run.start + (run.num_layers - 1) * run.period

    def body(consts: list[Any], carry: list[Any], xs: list[Any]) -> tuple[list[Any], list[Any]]:
        local: dict[tuple[int, int], Any] = {}
        for j, eqn in enumerate(layer0):
            args = []
            for v, (kind, what) in zip(eqn.invars, run.sources[j]):
                args.append(v.val if kind == "lit" else consts[what] if kind == "const" else
                            carry[what] if kind == "carry" else xs[what] if kind == "x" else local[what])
            for q, o in enumerate(bind(eqn, args)):
                local[(j, q)] = o
        return [local[s] for s in run.carry_slots], []

    def fun(*leaves: Any) -> list[Any]:
        nv = len(pg.virtual)
        virtual, rest = leaves[:nv], leaves[nv:]
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))
        real = [None] * n_real
        for v, x in zip(pg.virtual, virtual):
            if isinstance(v, int):
                real[v] = x
        env.update({var: x for var, x in zip(jaxpr.invars[:n_real], real) if x is not None})
        env.update(zip(jaxpr.invars[n_real:], rest))
        for eqn in eqns[: run.start]:
            env.update(zip(eqn.outvars, bind(eqn, [_read(env, v) for v in eqn.invars])))
        consts = [_read(env, v) for v in run.consts]
        carry = [_read(env, v) for v in run.carry_init]
        xs = [x for v, x in zip(pg.virtual, virtual) if isinstance(v, tuple)]
        carry, _ = jax.lax.scan(lambda c, x: body(consts, c, x), carry, xs)
        for (off, q), c in zip(run.carry_slots, carry):
            env[eqns[last + off].outvars[q]] = c
        for eqn in eqns[run.start + run.num_layers * run.period:]:
            env.update(zip(eqn.outvars, bind(eqn, [_read(env, v) for v in eqn.invars])))
        return [_read(env, v) for v in jaxpr.outvars]

    return fun


def find_unrolled(closed: jex.ClosedJaxpr, num_param_leaves: int, paths: Sequence[Any], bind: Any
                  ) -> tuple[jex.ClosedJaxpr, ParamGroups] | None:
    """Recognise an unrolled layer stack in ``closed``; the loss re-traced over virtual leaves, or None.

    Args:
      closed: the loss jaxpr over (param leaves..., other leaves...), top-level calls inlined.
      num_param_leaves: how many leading invars are parameter leaves.
      paths: the key path of each parameter leaf.
      bind: the project's equation interpreter (`mistjax.trace.split.bind_equation`).
    Returns:
      ``(jaxpr over (virtual leaves..., other leaves...), ParamGroups)``; None when no repeated block
      over parameter subtrees of equal structure is found.
    """
    avals = [v.aval for v in closed.jaxpr.invars[:num_param_leaves]]
    for groups in candidate_groups(paths, avals):
        run = _find_run(closed, groups)
        if run is None:
            continue
        members = {i for g in groups for i in g}
        virtual: list[int | tuple[int, ...]] = []
        for i in range(num_param_leaves):
            if i not in members:
                virtual.append(i)
            elif i in groups[0]:
                virtual.append(tuple(g[groups[0].index(i)] for g in groups))
        # Order the stacked leaves by place (the body's x operands are places 0..K-1).
        places = [v for v in virtual if isinstance(v, tuple)]
        by_place = sorted(places, key=lambda v: groups[0].index(v[0]))
        it = iter(by_place)
        virtual = [next(it) if isinstance(v, tuple) else v for v in virtual]
        pg = ParamGroups(num_real=num_param_leaves, virtual=tuple(virtual))
        fun = _virtual_fun(closed, run, pg, bind)
        rest = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars[num_param_leaves:]]
        real = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        return jax.make_jaxpr(fun)(*pg.virtual_avals(real), *rest), pg
    return None


__all__ = ["LayerSlices", "ParamGroups", "candidate_groups", "find_unrolled"]
