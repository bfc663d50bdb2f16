"""Checks of what a user hands a sharded step: the step's output structure, the batch's dtypes, token ids
against the embedding they index, and batches of other shapes than the plan was made for.

Each failure names what is wrong and the fix (docs/errors.md); they run before or outside the compiled
program, so a mistake costs no compile and never surfaces as a NaN loss or a deep XLA error.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.extend import core as jex
from jax.tree_util import PyTreeDef

from mistjax.core.jaxpr import shaped
from mistjax.core.types import Batch, PyTree
from mistjax.trace.source import exception_line
from mistjax.trace.split import TracedLoss


class StepError(ValueError):
    """The train step or its batch cannot run as given (the message says why and what to do)."""


def describe(tree: PyTree) -> str:
    """``['inputs'] int32[16,16], ['targets'] int32[16,16]``: a pytree's leaves by path, dtype and shape."""
    parts = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = ",".join(str(d) for d in np.shape(x))
        parts.append(f"{jax.tree_util.keystr(path) or 'batch'} {np.dtype(x.dtype).name}[{shape}]")
    return ", ".join(parts)


def trace_failure(error: Exception, batch: Batch) -> StepError:
    """The error to raise when tracing ``train_step(state, batch)`` fails, with the batch described."""
    floats = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]
              if jax.dtypes.issubdtype(x.dtype, np.floating)]
    hint = (f"; the batch holds floats in {', '.join(floats)}: token ids must be integers (e.g. "
            "batch['inputs'].astype(np.int32))" if floats and isinstance(error, TypeError | IndexError) else "")
    line = exception_line(error.__traceback__)
    where = f" at {line}" if line else ""  # the user's line, past JAX's and the model libraries' frames
    return StepError(f"the train step failed while mistjax traced it with this batch ({describe(batch)}){where}: "
                     f"{type(error).__name__}: {error}{hint}")


def check_output(out: object, state_tree: PyTreeDef) -> None:
    """Raise `StepError` unless ``out`` is ``(new_state, metrics)`` with the state's structure."""
    if not (isinstance(out, tuple) and len(out) == 2):
        kind = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise StepError(f"train_step must return (new_state, metrics), but it returned {kind}; end the step with "
                        "`return new_state, {'loss': loss}`")
    new_tree = jax.tree.structure(out[0])
    if new_tree != state_tree:
        raise StepError(
            "train_step returned a state of another structure than the one it was given (the state must keep its "
            # (jaxlib ships no stub for PyTreeDef: mypy sees an unresolved type without num_leaves)
            f"pytree structure, {state_tree.num_leaves} leaves, from step to step; got {new_tree.num_leaves} "  # type: ignore[attr-defined]
            "leaves); return the updated state itself, e.g. state.apply_gradients(grads) or "
            "{'params': new_params, 'opt': new_opt}")


@dataclass(frozen=True)
class TokenRange:
    """A batch leaf used as row indices into an embedding parameter."""

    leaf: int  # index into the step's batch leaves
    path: str  # its path in the batch, for messages
    rows: int  # rows of the embedding it indexes (the vocabulary size)


def token_ranges(traced: TracedLoss, rest_to_batch: Sequence[int | None], batch: Batch) -> list[TokenRange]:
    """Integer batch leaves the loss uses to index rows of a parameter (an embedding lookup).

    Args:
      traced: the loss.
      rest_to_batch: per non-parameter input of the loss, the step's batch leaf it is (None: other).
      batch: the step's batch (for paths).
    """
    jaxpr = traced.closed.jaxpr
    n = traced.num_param_leaves
    params = set(jaxpr.invars[:n])
    deps: dict[jex.Var, set[int]] = {}
    for k, v in enumerate(jaxpr.invars[n:]):
        b = rest_to_batch[k] if k < len(rest_to_batch) else None
        if b is not None and jax.dtypes.issubdtype(v.aval.dtype, np.integer):
            deps[v] = {b}
    found: dict[int, int] = {}
    for eqn in jaxpr.eqns:
        ins = set().union(*[deps.get(v, set()) for v in eqn.invars if isinstance(v, jex.Var)])
        if eqn.primitive.name == "gather" and isinstance(eqn.invars[0], jex.Var) and eqn.invars[0] in params:
            shape = shaped(eqn.invars[0]).shape
            rows = int(shape[0]) if shape else 0
            for b in deps.get(eqn.invars[1], set()) if isinstance(eqn.invars[1], jex.Var) else ():
                found[b] = min(found.get(b, rows), rows)
        if ins:
            for o in eqn.outvars:
                if jax.dtypes.issubdtype(o.aval.dtype, np.integer):
                    deps[o] = ins
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
    return [TokenRange(b, paths[b] if b < len(paths) else str(b), rows) for b, rows in sorted(found.items())]


def check_tokens(ranges: Sequence[TokenRange], batch: Batch, *, device_arrays: bool) -> None:
    """Raise `StepError` if a token id is outside ``[0, rows)`` of the embedding it indexes (JAX would fill
    the lookup with NaN); device arrays are read only when ``device_arrays`` (it costs a transfer)."""
    leaves = jax.tree.leaves(batch)
    for r in ranges:
        x = leaves[r.leaf]
        if isinstance(x, jax.Array) and not device_arrays:
            continue
        if not isinstance(x, np.ndarray | jax.Array) or not np.size(x):
            continue  # shapes only (`step.lower` with ShapeDtypeStructs), or empty
        hi, lo = int(np.max(x)), int(np.min(x))
        if hi >= r.rows or lo < 0:
            bad = hi if hi >= r.rows else lo
            raise StepError(f"batch{r.path} holds token id {bad}, but the embedding it indexes has {r.rows} rows "
                            f"(the vocabulary): ids must lie in [0, {r.rows}) (JAX would give a NaN loss); check "
                            "the tokenizer and the model's vocab_size")


def check_shapes(first: Sequence[tuple[int, ...]] | None, batch: Batch) -> list[tuple[int, ...]]:
    """Warn when ``batch`` has other shapes than the first batch (the plan was made for those)."""
    shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(batch)]
    if first is not None and list(first) != shapes:
        warnings.warn(f"this batch has shapes {shapes}, but the plan was made (and the step compiled) for "
                      f"{list(first)}: the step recompiles, and the plan's memory and time predictions are for "
                      "the first shapes; re-plan for the new shapes (autoshard without plan=, or a new plan)",
                      RuntimeWarning, stacklevel=3)
    return shapes


__all__ = ["StepError", "TokenRange", "check_output", "check_shapes", "check_tokens", "describe", "token_ranges",
           "trace_failure"]
