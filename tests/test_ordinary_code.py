"""autoshard without a plan on model code as users write it (issue #55): a from-scratch NNX GPT whose learned
position table is sliced to the sequence, Hugging Face's GPT-Neo with its alternating global / local attention,
a step that runs at its batch's sequence length only (analysed there, with a warning naming the user's line),
and one clear error naming the user's line when a step truly cannot be analysed.

Each run is compared with `jax.jit` of the same step: the losses and the parameters after two optimizer steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mistjax
from mistjax.analysis import DEFAULT_POINTS, FixedLengthWarning, StructureError, analysis_points, analyze_model
from mistjax.plan import uniform_plan
from mistjax.trace.split import trace_loss

VOCAB, HIDDEN, HEADS, SEQ, BATCH = 64, 32, 4, 16, 16
STEPS = 2
TX = optax.sgd(0.1, momentum=0.9)  # linear in the gradients: the parameters compare at float precision


def _line(marker: str) -> int:
    """The line of this file holding ``marker`` (what an error must name)."""
    return next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if marker in text and "_line(" not in text)


class Block(nnx.Module):
    """Pre-norm attention + MLP; ``window`` > 0 makes the attention local (GPT-Neo's alternate layers)."""

    def __init__(self, rngs: nnx.Rngs, window: int = 0) -> None:
        self.ln1, self.ln2 = nnx.LayerNorm(HIDDEN, rngs=rngs), nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.qkv = nnx.Linear(HIDDEN, 3 * HIDDEN, rngs=rngs)
        self.proj = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
        self.fc, self.out = nnx.Linear(HIDDEN, 4 * HIDDEN, rngs=rngs), nnx.Linear(4 * HIDDEN, HIDDEN, rngs=rngs)
        self.window = window

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, HEADS, HIDDEN // HEADS) for t in jnp.split(self.qkv(self.ln1(x)), 3, axis=-1))
        mask = jnp.tril(jnp.ones((s, s), bool))
        if self.window:
            mask = mask & ~jnp.tril(mask, -self.window)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HIDDEN // HEADS)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        x = x + self.proj(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, HIDDEN))
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class MoeBlock(nnx.Module):
    """A mixture-of-experts-like MLP: a softmax router weighs every expert's output (dense, no dispatch)."""

    def __init__(self, rngs: nnx.Rngs, experts: int = 2) -> None:
        self.ln = nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.router = nnx.Linear(HIDDEN, experts, use_bias=False, rngs=rngs)
        self.w_in = nnx.Param(jax.random.normal(rngs.params(), (experts, HIDDEN, 2 * HIDDEN)) / np.sqrt(HIDDEN))
        self.w_out = nnx.Param(jax.random.normal(rngs.params(), (experts, 2 * HIDDEN, HIDDEN)) / np.sqrt(HIDDEN))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.ln(x)
        gate = jax.nn.softmax(self.router(h), axis=-1)
        y = jax.nn.gelu(jnp.einsum("bsd,edf->bsef", h, self.w_in[...]))
        return x + jnp.einsum("bsef,efd,bse->bsd", y, self.w_out[...], gate)


class GPT(nnx.Module):
    """A GPT as written from scratch: a learned position table of ``positions`` rows added to the tokens.
    ``alternate``: every other layer's attention is local; ``moe``: every other layer is a `MoeBlock`."""

    def __init__(self, rngs: nnx.Rngs, *, positions: int = SEQ, layers: int = 2, alternate: bool = False,
                 moe: bool = False, whole_table: bool = False) -> None:
        self.wte = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
        self.wpe = nnx.Param(0.02 * jax.random.normal(rngs.params(), (positions, HIDDEN)))
        odd = [i % 2 == 1 for i in range(layers)]
        self.blocks = nnx.List([MoeBlock(rngs) if moe and o else Block(rngs, window=4 if alternate and o else 0)
                                for o in odd])
        self.ln = nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.whole_table = whole_table

    def __call__(self, ids: jax.Array) -> jax.Array:
        if self.whole_table:
            x = self.wte(ids) + self.wpe[...]  # <- the whole table: only runs at sequences of its length
        else:
            x = self.wte(ids) + self.wpe[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.wte.attend(self.ln(x))


def gpt(**kw: Any) -> tuple[Any, Any]:
    """``(loss_fn, params)`` of a `GPT`."""
    graphdef, params = nnx.split(GPT(nnx.Rngs(0), **kw), nnx.Param)

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        logits = nnx.merge(graphdef, params)(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return loss_fn, params


def batch_of(seq: int = SEQ) -> dict[str, np.ndarray]:
    tok = np.random.default_rng(0).integers(0, VOCAB, (BATCH, seq + 1)).astype(np.int32)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def train(step: Any, state: Any, batch: Any) -> tuple[list[float], Any]:
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state


def assert_matches_jit(loss_fn: Any, params: Any, batch: Any, zoo3p: Any, **autoshard: Any) -> Any:
    """Train ``STEPS`` steps with `jax.jit` and with `mistjax.autoshard` on the 8 devices; compare losses and
    parameters. Returns the sharded step."""
    train_step = zoo3p.optax_step(loss_fn, TX)
    ref_losses, ref_state = train(jax.jit(train_step), zoo3p.optax_state(params, TX), batch)
    step = mistjax.autoshard(train_step, jax.devices(), time_limit=20, **autoshard)
    state = step.place(zoo3p.optax_state(jax.tree.map(jnp.copy, params), TX), batch)
    losses, state = train(step, state, batch)
    state = step.gather(state)  # a pipelined plan holds each stage's layers apart
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    return step


# ---------------------------------------------------------------------------------------------- the points
def test_analysis_first_traces_no_longer_sequence_than_the_batch() -> None:
    for seq in (4, 16, 24, 32, 2048):
        sets = analysis_points(seq)
        assert all(s <= seq for _, s in sets[0]), (seq, sets)
        assert (DEFAULT_POINTS[0][0], seq) in sets[0 if seq < 32 else 1], sets  # the batch's own length
        if seq >= 32:  # the default points fit: no set traces longer sequences
            assert sets[0] == DEFAULT_POINTS and all(s <= seq for points in sets for _, s in points)
    assert analysis_points(None) == [DEFAULT_POINTS]


def test_a_table_sliced_to_its_full_length_analyses_at_the_default_points() -> None:
    """At s = 32 ``pos[:32]`` of a 32-row table traces no slice (nor its transpose, a pad), at s < 32 it does:
    the traces still align, and the hidden state entering the layers is fitted as b * s * hidden floats."""
    loss_fn, params = gpt(positions=32)
    prof = analyze_model(loss_fn, params, lambda b, s: (jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((b, s), jnp.int32), batch_of(s)),), points=DEFAULT_POINTS)
    from mistjax.analysis.poly import B, S, T

    assert prof.pre.output_bytes.subs(T, 1) == 4 * B * S * HIDDEN
    assert prof.num_layers == 2


# ---------------------------------------------------------------------------------------------- end to end
def test_nnx_gpt_with_a_sliced_position_table_autoshards_without_a_plan(zoo3p: Any, capsys: Any) -> None:
    """The table has exactly as many rows as the batch's sequence: no longer sequence can be traced, and at the
    real length the slice vanishes from the trace."""
    loss_fn, params = gpt(positions=SEQ)
    step = assert_matches_jit(loss_fn, params, batch_of(), zoo3p)
    assert "tuning a plan for 8 x" in capsys.readouterr().err
    assert step.plan.prediction is not None


def test_alternating_layers_are_one_stack_of_layer_pairs() -> None:
    """Local attention every other layer: the layers repeat only in pairs, so the stack is 2 blocks of 2."""
    loss_fn, params = gpt(layers=4, alternate=True)
    traced = trace_loss(loss_fn, params, batch_of())
    assert traced.stack is not None and traced.groups is not None
    assert traced.stack.num_layers == 2 and traced.groups.period == 2
    assert len(traced.layer_leaves()) == 4 * len(jax.tree.leaves(nnx.state(Block(nnx.Rngs(0)), nnx.Param)))


def test_interleaved_dense_and_moe_like_layers_autoshard_without_a_plan(zoo3p: Any) -> None:
    """Dense and MoE-like layers alternate: the layers' parameter subtrees differ but repeat in pairs."""
    loss_fn, params = gpt(layers=4, moe=True)
    traced = trace_loss(loss_fn, params, batch_of())
    assert traced.stack is not None and traced.stack.num_layers == 2 and traced.groups.period == 2
    assert_matches_jit(loss_fn, params, batch_of(), zoo3p)


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt_neo_with_alternating_attention_autoshards(tp: int, family: Any, zoo3p: Any) -> None:
    """tp 1: no plan (the tuner's choice); tp 2: an explicit plan, whose Megatron splits are inferred from
    GPT-Neo's dataflow (q/k/v_proj and c_fc split on their outputs, out_proj and c_proj on their inputs)."""
    fam = family("hf-gpt-neo")
    traced = trace_loss(fam.loss_fn, fam.params, fam.batch)
    assert traced.stack is not None and traced.stack.num_layers == 2  # 4 layers, global / local pairs
    plan = {} if tp == 1 else {"plan": uniform_plan(2, 8, tp=2, micro_batch=4, shard_opt=False)}
    step = assert_matches_jit(fam.loss_fn, fam.params, fam.batch, zoo3p, **plan)
    if tp == 2:
        state = step.place(zoo3p.optax_state(fam.params, TX), fam.batch)
        flat = jax.tree_util.tree_flatten_with_path(state["params"])[0]
        split = {jax.tree_util.keystr(p).split("'")[-4] for p, x in flat if "tensor" in str(x.sharding.spec)}
        assert {"q_proj", "k_proj", "v_proj", "out_proj", "c_fc", "c_proj"} <= split, split


# ---------------------------------------------------------------------------------------------- clear messages
def test_a_step_that_only_runs_at_its_own_length_is_analysed_there(zoo3p: Any, tmp_path: Path) -> None:
    """The whole position table added to the tokens: the step runs at no shorter sequence, so it is analysed at
    the batch's length alone, with a warning naming this file's line and the fix. (A cache of its own: at the
    batch's length the program is the sliced model's, whose profile an earlier test may have cached.)"""
    loss_fn, params = gpt(positions=SEQ, whole_table=True)
    with pytest.warns(FixedLengthWarning) as record:
        step = assert_matches_jit(loss_fn, params, batch_of(), zoo3p, cache_dir=tmp_path)
    message = str(next(w.message for w in record if isinstance(w.message, FixedLengthWarning)))
    assert f"{__file__}:{_line('# <- the whole table')}" in message, message
    assert "pos[:ids.shape[1]]" in message and f"sequence length {SEQ} alone" in message
    assert step.plan.cp == 1


def branching_loss(zoo3p: Any, dim: int, above: int) -> Any:
    """A lax.scan model that takes another path where its batch's dim ``dim`` (0: batch, 1: sequence) is above
    ``above``."""

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        h = params["embed"][batch["inputs"]]
        if batch["inputs"].shape[dim] > above:
            h = jnp.tanh(h)  # <- another path at some sizes
        h, _ = jax.lax.scan(lambda h, w: (h + jax.nn.gelu(h @ w["w_in"]) @ w["w_out"], None), h, params["layers"])
        return zoo3p.xent(h @ params["head"], batch["targets"])

    return loss_fn


def test_a_step_branching_on_the_sequence_length_is_analysed_at_its_own(zoo3p: Any) -> None:
    fam = zoo3p.lax_scan()
    with pytest.warns(FixedLengthWarning) as record:
        assert_matches_jit(branching_loss(zoo3p, dim=1, above=12), fam.params, batch_of(), zoo3p)
    message = str(next(w.message for w in record if isinstance(w.message, FixedLengthWarning)))
    assert f"`tanh` (made at {__file__}:{_line('# <- another path at some sizes')}" in message, message
    assert "branches on the batch or sequence size" in message


def test_a_step_branching_on_the_batch_size_is_one_clear_error(zoo3p: Any) -> None:
    """Another path at micro-batches above 3: no size set analyses (each varies the batch)."""
    fam = zoo3p.lax_scan()
    step = mistjax.autoshard(zoo3p.optax_step(branching_loss(zoo3p, dim=0, above=3), TX), jax.devices(), verbose=False)
    with pytest.raises(StructureError) as err:
        step(zoo3p.optax_state(fam.params, TX), batch_of())
    message = str(err.value)
    assert f"`tanh` (made at {__file__}:{_line('# <- another path at some sizes')}" in message, message
    assert "branches on the batch or sequence size" in message and "plan=" in message
    assert "docs/errors.md" in message


def test_a_step_failing_at_its_own_shapes_names_the_line(zoo3p: Any) -> None:
    fam = zoo3p.lax_scan()

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        h = params["embed"][batch["inputs"]]
        return (h @ params["head"].T).mean()  # <- a shape bug: head is [hidden, vocab]

    step = mistjax.autoshard(zoo3p.optax_step(loss_fn, TX), jax.devices(), verbose=False)
    with pytest.raises(mistjax.StepError) as err:
        step(zoo3p.optax_state(fam.params, TX), batch_of())
    assert f" at {__file__}:{_line('# <- a shape bug')} (in loss_fn): TypeError" in str(err.value), str(err.value)
