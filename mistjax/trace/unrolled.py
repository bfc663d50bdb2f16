"""Unrolled layer stacks: a block repeated L times in the jaxpr, seen as a scan over stacked parameters.

Models written as a Python loop over their layers (Hugging Face's Flax models, an NNX ``nnx.List`` of
layers, linen ``Block_0 .. Block_{L-1}``) trace to L copies of the same equations, each reading its
own parameter subtree. `find_unrolled` recognises them in two steps:

1. *Candidates from the parameter paths*: leaves whose key paths differ in one index-like key
   (``layers/3/...``, ``h/3/...``, ``Block_3/...``) and whose subtrees have equal structure, shapes
   and dtypes form L groups; the candidate holding the most bytes is tried first. Subtrees that differ
   but repeat every ``p`` layers (dense / MoE-like blocks interleaved) form L/p groups of ``p`` layers.
2. *Proof from the jaxpr*: the equations from layer 0's first parameter use on must repeat with one
   period, every input of a layer must be a constant (the same value for all layers: rotary tables,
   masks), its own layer's parameter at the same place, a value of its own layer, or the *carry*
   (a value of the previous layer at a fixed place; for layer 0 a value of the pre part), and the
   rest of the program may read only the last layer's carry. The cut between layers is the one
   with the fewest carried values (the hidden state). A stack whose layers alternate kinds (GPT-Neo's
   global / local attention) repeats only every ``p`` layers: `periodic_groups` then offers blocks of
   ``p`` consecutive layers, the smallest period that proves first.

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
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex
from jax.tree_util import KeyPath

from mistjax.core.jaxpr import Shaped, Value, bind_equation, read, run_equations

_INDEXED = re.compile(r"^(.*?)_?(\d+)$")
Axes: TypeAlias = tuple[str | None, ...] | None


@dataclass(frozen=True)
class ParamGroups:
    """How the loss's real parameter leaves map to its virtual (stacked) ones.

    Attributes:
      num_real: number of real parameter leaves.
      virtual: per virtual leaf, the real leaf index it is (an int) or the L real leaves, layer by layer,
        it stacks (a tuple).
      period: model layers per stacked layer (`periodic_groups`: 2 for GPT-Neo's global / local pairs).
    """

    num_real: int
    virtual: tuple[int | tuple[int, ...], ...]
    period: int = 1

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

    def to_virtual(self, real: Sequence[Value], *, slices: bool = True) -> list[Value | LayerSlices]:
        """Virtual leaves from real ones: a stacked leaf as `LayerSlices` (or stacked, ``slices=False``)."""
        out: list[Value | LayerSlices] = []
        for v in self.virtual:
            if isinstance(v, int):
                out.append(real[v])
            else:
                ls = LayerSlices(tuple(real[r] for r in v))
                out.append(ls if slices else ls.stacked())
        return out

    def virtual_avals(self, real: Sequence[Shaped]) -> list[jax.ShapeDtypeStruct]:
        def sds(x: Shaped, lead: tuple[int, ...] = ()) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(lead + tuple(np.shape(x)), x.dtype)

        return [sds(real[v]) if isinstance(v, int) else sds(real[v[0]], (len(v),)) for v in self.virtual]

    def virtual_axes(self, real: Sequence[Axes]) -> list[Axes]:
        """Per virtual leaf, the logical axes (``("layers", *axes)`` for a stacked one; None stays None)."""
        out = []
        for v in self.virtual:
            ax = real[v] if isinstance(v, int) else real[v[0]]
            out.append(ax if isinstance(v, int) or ax is None else ("layers", *ax))
        return out

    def to_real(self, virtual: Sequence[Value | LayerSlices]) -> list[Value]:
        """Real leaves from virtual ones (a stacked leaf split into its L layers)."""
        out: list[Value] = [None] * self.num_real
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

    parts: tuple[jax.Array, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *np.shape(self.parts[0]))

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def stacked(self) -> jax.Array:
        return jnp.stack(self.parts)

    def __getitem__(self, index: int | slice) -> jax.Array | LayerSlices:
        if isinstance(index, slice):
            return LayerSlices(self.parts[index])
        return self.parts[index]


# ------------------------------------------------------------------------------------ candidates

def _token(key: Hashable) -> Hashable:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def _tokens(path: KeyPath) -> tuple[Hashable, ...]:
    toks = tuple(_token(k) for k in path)
    while toks and toks[-1] in ("value", "raw_value"):  # nnx.Variable / linen Partitioned boxes
        toks = toks[:-1]
    return toks


def _layer_index(tok: Hashable) -> tuple[str, int] | None:
    """``(stem, index)`` for an index-like key: 3, "3", "layers_3", "Block3"."""
    if isinstance(tok, int) and not isinstance(tok, bool):
        return "", tok
    if isinstance(tok, str):
        m = _INDEXED.match(tok)
        if m:
            return m.group(1), int(m.group(2))
    return None


class LayerCandidate(NamedTuple):
    """A candidate layer grouping: ``groups[layer][k]`` is the real leaf at place ``k`` of stacked layer
    ``layer``, which is ``period`` consecutive model layers (1 unless the layers' subtrees differ)."""

    groups: list[list[int]]
    period: int


def candidate_groups(paths: Sequence[KeyPath], avals: Sequence[Shaped]) -> list[LayerCandidate]:
    """Candidate layer groupings of the leaves, most bytes first (places sorted alike for every layer).

    Layers of different subtrees that repeat with a period ``p`` (dense / MoE-like blocks interleaved) are
    offered as blocks of ``p`` layers, whose places are those of its ``p`` layers in turn.
    """
    toks = [_tokens(p) for p in paths]
    cands: dict[tuple[Hashable, ...], dict[int, dict[tuple[Hashable, ...], int]]] = {}
    for i, t in enumerate(toks):
        for pos, tok in enumerate(t):
            idx = _layer_index(tok)
            if idx is None:
                continue
            key = (pos, t[:pos], idx[0])
            cands.setdefault(key, {}).setdefault(idx[1], {})[t[pos + 1:]] = i
    out = []
    for layers in cands.values():
        order = sorted(layers)
        if len(layers) < 2 or order != list(range(order[0], order[0] + len(order))):
            continue
        found = _periodic_layers([layers[k] for k in order], avals)
        if found is not None:
            out.append(found)
    size = lambda c: sum(int(np.prod(np.shape(avals[i]))) for layer in c.groups for i in layer)  # noqa: E731
    return sorted(out, key=size, reverse=True)


def _periodic_layers(layers: list[dict[tuple[Hashable, ...], int]], avals: Sequence[Shaped]
                     ) -> LayerCandidate | None:
    """The layers' leaves by place, as blocks of the smallest period ``p`` after which the layers' subtrees
    (places, shapes, dtypes) repeat (1: all alike), with at least two blocks; None when there is none."""
    def sig(layer: dict[tuple[Hashable, ...], int]) -> list[tuple[str, tuple[int, ...], str]]:
        return [(str(pl), tuple(np.shape(avals[i])), str(np.dtype(avals[i].dtype)))
                for pl, i in sorted(layer.items(), key=lambda kv: str(kv[0]))]

    sigs = [sig(layer) for layer in layers]
    n = len(layers)
    for p in range(1, n // 2 + 1):
        if n % p or any(sigs[k] != sigs[k % p] for k in range(n)):
            continue
        by_place = [[i for _, i in sorted(layer.items(), key=lambda kv: str(kv[0]))] for layer in layers]
        return LayerCandidate([[i for layer in by_place[g * p:(g + 1) * p] for i in layer] for g in range(n // p)], p)
    return None


def periodic_groups(layers: list[list[int]]) -> list[list[list[int]]]:
    """``layers`` as blocks of ``p`` consecutive layers, for each period ``p`` dividing L (1 first).

    A stack whose layers alternate kinds (GPT-Neo's global / local attention, dense / MoE interleaving)
    repeats only every ``p`` layers: one block of ``p`` layers is then the scan body, and its places are
    those of its ``p`` layers in turn. At least two blocks are needed to see the repetition.
    """
    n = len(layers)
    return [[[i for layer in layers[g * p:(g + 1) * p] for i in layer] for g in range(n // p)]
            for p in range(1, n // 2 + 1) if n % p == 0]


# ------------------------------------------------------------------------------------ proof in the jaxpr

class _Sig:
    """Equation signatures (primitive, params, operand types), sub-jaxprs printed once."""

    def __init__(self) -> None:
        self._memo: dict[int, str] = {}

    def param(self, v: object) -> str:
        if isinstance(v, jex.ClosedJaxpr | jex.Jaxpr):
            hit = self._memo.get(id(v))
            if hit is None:
                hit = self._memo[id(v)] = str(v)
            return hit
        if isinstance(v, tuple | list):
            return "(" + ",".join(self.param(x) for x in v) + ")"
        return repr(v)

    def __call__(self, eqn: jex.JaxprEqn) -> tuple[Hashable, ...]:
        ins = tuple(("lit", repr(v.val)) if isinstance(v, jex.Literal) else str(v.aval) for v in eqn.invars)
        params = tuple((k, self.param(v)) for k, v in sorted(eqn.params.items()))
        return eqn.primitive.name, params, ins, tuple(str(v.aval) for v in eqn.outvars)


Source: TypeAlias = tuple[str, int | tuple[int, int] | None]
"""How a layer's equation gets one operand: ``("lit", None)`` its literal, ``("x", place)`` its own layer's
parameter, ``("local", (offset, out))`` a value of its own layer, ``("const", k)`` constant ``k`` of the run,
``("carry", slot)`` the carry."""
_Kind: TypeAlias = tuple[str, int | tuple[int, int] | jex.Var | None]  # a Source, or ("outside", var)


@dataclass(frozen=True)
class _Run:
    """A proven repetition: L layers of P equations from ``start``."""

    start: int
    period: int
    num_layers: int
    sources: tuple[tuple[Source, ...], ...]  # per eqn of layer 0, per input: how to get it
    consts: tuple[jex.Var, ...]  # outside vars every layer reads
    carry_init: tuple[jex.Var, ...]  # per carry slot: the outside var layer 0 reads
    carry_slots: tuple[tuple[int, int], ...]  # per slot: (eqn offset, output index) producing it


def _const_aliases(closed: jex.ClosedJaxpr) -> dict[jex.Var, jex.Var]:
    """Constvar -> the first constvar of equal value: each layer of an unrolled model may capture its own
    copy of a constant (a rotary table built per attention module), which is one constant of the block."""
    seen: dict[tuple[tuple[int, ...], str, bytes], jex.Var] = {}
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


@dataclass(frozen=True)
class _Candidate:
    """A candidate run: L repeats of ``period`` equations from ``start``, and where each value is made."""

    jaxpr: jex.Jaxpr
    groups: list[list[int]]
    start: int
    period: int
    aliases: dict[jex.Var, jex.Var]
    invar_index: dict[jex.Var, int] = field(init=False)
    place: dict[int, tuple[int, int]] = field(init=False)  # real leaf -> (layer, place)
    producer: dict[jex.Var, tuple[int, int, int]] = field(init=False)  # var -> (layer, offset, out index)

    def __post_init__(self) -> None:
        eqns, end = self.jaxpr.eqns, self.start + len(self.groups) * self.period
        object.__setattr__(self, "invar_index", {v: i for i, v in enumerate(self.jaxpr.invars)})
        object.__setattr__(self, "place", {i: (layer, k) for layer, g in enumerate(self.groups)
                                           for k, i in enumerate(g)})
        object.__setattr__(self, "producer", {
            v: ((e - self.start) // self.period, (e - self.start) % self.period, q)
            for e in range(self.start, end) for q, v in enumerate(eqns[e].outvars)})

    def kind(self, layer: int, v: jex.Var | jex.Literal) -> _Kind | None:
        """Where ``layer``'s operand ``v`` comes from; None when it reads another layer's parameter or an
        older layer's value."""
        if isinstance(v, jex.Literal):
            return ("lit", None)
        if v in self.invar_index and self.invar_index[v] in self.place:
            pl, k = self.place[self.invar_index[v]]
            return ("x", k) if pl == layer else None
        if v in self.producer:
            pl, off, oq = self.producer[v]
            if pl == layer:
                return ("local", (off, oq))
            return ("carry", (off, oq)) if pl == layer - 1 else None
        return ("outside", self.aliases.get(v, v))

    def outside_reads_ok(self, carried: dict[tuple[int, int], int]) -> bool:
        """The rest of the program reads only the last layer's carry, and no layer parameter."""
        L, eqns = len(self.groups), self.jaxpr.eqns
        outside = [*eqns[: self.start], *eqns[self.start + L * self.period:]]
        for v in [*(v for e in outside for v in e.invars), *self.jaxpr.outvars]:
            if isinstance(v, jex.Var) and v in self.producer:
                layer, off, oq = self.producer[v]
                if layer != L - 1 or (off, oq) not in carried:
                    return False
        return not any(isinstance(v, jex.Var) and self.invar_index.get(v) in self.place
                       for e in outside for v in e.invars)


@dataclass
class _Inputs:
    """The run's inputs from outside as they are found: constants and carry slots."""

    consts: dict[jex.Var, int] = field(default_factory=dict)
    carry_of_slot: dict[tuple[int, int], int] = field(default_factory=dict)
    carry_init: list[jex.Var] = field(default_factory=list)

    def source(self, kinds: Sequence[_Kind]) -> Source | None:
        """The source of one operand from its kind in each layer; None when the layers disagree."""
        first, rest = kinds[0], kinds[1:]
        if first[0] in ("lit", "x", "local"):
            return first if all(k == first for k in rest) else None
        if first[0] != "outside":
            return None
        if all(k == first for k in rest):  # the same value for every layer: a constant
            return ("const", self.consts.setdefault(first[1], len(self.consts)))
        if not rest or any(k[0] != "carry" or k != rest[0] for k in rest):
            return None
        slot = rest[0][1]
        if slot not in self.carry_of_slot:
            self.carry_of_slot[slot] = len(self.carry_init)
            self.carry_init.append(first[1])
        elif self.carry_init[self.carry_of_slot[slot]] is not first[1]:
            return None
        return ("carry", self.carry_of_slot[slot])


def _prove(jaxpr: jex.Jaxpr, groups: list[list[int]], start: int, period: int,
           aliases: dict[jex.Var, jex.Var] | None = None) -> _Run | None:
    """Check that ``groups`` run as L repeats of ``period`` equations from ``start``; the run or None."""
    L, eqns = len(groups), jaxpr.eqns
    cand = _Candidate(jaxpr, groups, start, period, aliases or {})
    found = _Inputs()
    sources: list[tuple[Source, ...]] = []
    for j in range(period):
        row = []
        for q in range(len(eqns[start + j].invars)):
            kinds = [cand.kind(layer, eqns[start + layer * period + j].invars[q]) for layer in range(L)]
            src = None if any(k is None for k in kinds) else found.source(kinds)
            if src is None:
                return None
            row.append(src)
        sources.append(tuple(row))
    if not cand.outside_reads_ok(found.carry_of_slot):
        return None
    order = sorted(found.carry_of_slot, key=found.carry_of_slot.get)
    return _Run(start=start, period=period, num_layers=L, sources=tuple(sources),
                consts=tuple(sorted(found.consts, key=found.consts.get)), carry_init=tuple(found.carry_init),
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

def _virtual_fun(closed: jex.ClosedJaxpr, run: _Run, pg: ParamGroups) -> Callable[..., list[Value]]:
    """``f(*virtual_leaves, *rest_leaves)`` evaluating ``closed`` with its run as one ``lax.scan``."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    n_real = pg.num_real
    layer0 = eqns[run.start: run.start + run.period]
    last = run.start + (run.num_layers - 1) * run.period

    def body(consts: list[Value], carry: list[Value], xs: list[Value]) -> tuple[list[Value], list[Value]]:
        local: dict[tuple[int, int], Value] = {}
        for j, eqn in enumerate(layer0):
            args = []
            for v, (kind, what) in zip(eqn.invars, run.sources[j]):
                args.append(v.val if kind == "lit" else consts[what] if kind == "const" else
                            carry[what] if kind == "carry" else xs[what] if kind == "x" else local[what])
            for q, o in enumerate(bind_equation(eqn, args)):
                local[(j, q)] = o
        return [local[s] for s in run.carry_slots], []

    def fun(*leaves: Value) -> list[Value]:
        nv = len(pg.virtual)
        virtual, rest = leaves[:nv], leaves[nv:]
        env: dict[jex.Var, Value] = dict(zip(jaxpr.constvars, closed.consts))
        real = [None] * n_real
        for v, x in zip(pg.virtual, virtual):
            if isinstance(v, int):
                real[v] = x
        env.update({var: x for var, x in zip(jaxpr.invars[:n_real], real) if x is not None})
        env.update(zip(jaxpr.invars[n_real:], rest))
        run_equations(eqns[: run.start], env)
        consts = [read(env, v) for v in run.consts]
        carry = [read(env, v) for v in run.carry_init]
        xs = [x for v, x in zip(pg.virtual, virtual) if isinstance(v, tuple)]
        carry, _ = jax.lax.scan(lambda c, x: body(consts, c, x), carry, xs)
        for (off, q), c in zip(run.carry_slots, carry):
            env[eqns[last + off].outvars[q]] = c
        run_equations(eqns[run.start + run.num_layers * run.period:], env)
        return [read(env, v) for v in jaxpr.outvars]

    return fun


def find_unrolled(closed: jex.ClosedJaxpr, num_param_leaves: int, paths: Sequence[KeyPath]
                  ) -> tuple[jex.ClosedJaxpr, ParamGroups] | None:
    """Recognise an unrolled layer stack in ``closed``; the loss re-traced over virtual leaves, or None.

    Args:
      closed: the loss jaxpr over (param leaves..., other leaves...), top-level calls inlined.
      num_param_leaves: how many leading invars are parameter leaves.
      paths: the key path of each parameter leaf.
    Returns:
      ``(jaxpr over (virtual leaves..., other leaves...), ParamGroups)``; None when no repeated block
      over parameter subtrees of equal structure is found.
    """
    avals = [v.aval for v in closed.jaxpr.invars[:num_param_leaves]]
    for cand in candidate_groups(paths, avals):
        found = next(((g, r) for g in periodic_groups(cand.groups) if (r := _find_run(closed, g)) is not None),
                     None)
        if found is None:
            continue
        groups, run = found
        period = cand.period * len(cand.groups) // len(groups)
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
        pg = ParamGroups(num_real=num_param_leaves, virtual=tuple(virtual), period=period)
        fun = _virtual_fun(closed, run, pg)
        rest = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars[num_param_leaves:]]
        real = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        return jax.make_jaxpr(fun)(*pg.virtual_avals(real), *rest), pg
    return None


__all__ = ["LayerCandidate", "LayerSlices", "ParamGroups", "candidate_groups", "find_unrolled", "periodic_groups"]
