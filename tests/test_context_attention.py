"""Context-parallel attention (mistjax/runtime/context_attention.py, issue #31) against a one-device reference."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mistjax.runtime.context_attention import ContextForm, context_attention, ring_schedule, ulysses_supported

Arrays = tuple[jax.Array, jax.Array, jax.Array]


def _mesh(shape: dict[str, int]) -> Mesh:
    n = int(np.prod(list(shape.values())))
    devices = np.array(jax.devices()[:n]).reshape(tuple(shape.values()))
    return Mesh(devices, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


def _inputs(b: int, s: int, heads: int, kv_heads: int, d: int = 16, seed: int = 0
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    draw = lambda h: rng.standard_normal((b, s, h, d)).astype(np.float32)
    return draw(heads), draw(kv_heads), draw(kv_heads), draw(heads)  # q, k, v, output cotangent w


def _reference(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True) -> jax.Array:
    """Naive float32 softmax attention on whole arrays (GQA by repeating the kv heads)."""
    g = q.shape[2] // k.shape[2]
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = jnp.einsum("bsnd,btnd->bnst", q, k) / np.sqrt(q.shape[-1])
    if causal:
        s = q.shape[1]
        logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -jnp.inf)
    return jnp.einsum("bnst,btnd->bsnd", jax.nn.softmax(logits, axis=-1), v)


def _out_and_grads(f: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array, w: jax.Array
                   ) -> tuple[jax.Array, Arrays]:
    """``f``'s output and the gradients of ``sum(f(q, k, v) * w)`` (one jitted program)."""
    def run(q: jax.Array, k: jax.Array, v: jax.Array, w: jax.Array) -> tuple[jax.Array, Arrays]:
        o, vjp = jax.vjp(f, q, k, v)
        return o, vjp(w.astype(o.dtype))
    return jax.jit(run)(q, k, v, w)


def _rel(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _compare(mesh: Mesh, specs: tuple[P, P], shape: tuple[int, ...], *, form: str = "ring", causal: bool = True,
             block_size: int = 16, dtype: jnp.dtype = jnp.float32) -> tuple[float, float, list[float]]:
    """(output, loss, [dq, dk, dv]) relative errors of the sharded kernel against `_reference`."""
    q, k, v, w = _inputs(*shape)
    if dtype != jnp.float32:
        q, k, v = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v))  # same rounded inputs
    f = lambda q, k, v: context_attention(q, k, v, form=form, causal=causal, block_size=block_size)
    with jax.set_mesh(mesh):
        put = lambda x, spec: jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, spec))
        o, grads = _out_and_grads(f, put(q, specs[0]), put(k, specs[1]), put(v, specs[1]), put(w, specs[0]))
    ro, rgrads = _out_and_grads(lambda q, k, v: _reference(q, k, v, causal), q, k, v, w)
    assert o.dtype == dtype and all(g.dtype == dtype for g in grads)
    loss, rloss = np.sum(np.asarray(o, np.float64) * w), np.sum(np.asarray(ro, np.float64) * w)
    return _rel(o, ro), abs(loss - rloss) / abs(rloss), [_rel(g, r) for g, r in zip(grads, rgrads)]


SEQ = P(None, "context")


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5, 8])
def test_ring_schedule_covers_causal_pairs_once_with_equal_work(cp: int) -> None:
    sched = ring_schedule(cp)
    pairs = Counter(p for step in sched for dev in step for p in dev)
    assert pairs == Counter((i, j) for i in range(2 * cp) for j in range(i + 1))  # each live pair exactly once
    per_device = {tuple(len(sched[t][d]) for t in range(cp)) for d in range(cp)}
    assert per_device == {(3,) + (2,) * (cp - 1)}  # the same work on every device at every step
    diagonal = {sum(q == kv for step in sched for q, kv in step[d]) for d in range(cp)}
    assert diagonal == {2}
    plain = ring_schedule(cp, causal=False)
    assert Counter(p for step in plain for dev in step for p in dev) == Counter(
        (i, j) for i in range(cp) for j in range(cp))


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_matches_reference(cp: int, heads: int, kv_heads: int) -> None:
    out, loss, grads = _compare(_mesh({"context": cp}), (SEQ, SEQ), (2, 128, heads, kv_heads))
    assert out < 1e-4 and loss < 1e-4 and max(grads) < 1e-3, (out, loss, grads)


def test_ring_padded_key_blocks_and_non_causal() -> None:
    # seq 84 over cp 2: chunks of 21 positions, block 16 -> two blocks of 11 keys, the last padded
    out, loss, grads = _compare(_mesh({"context": 2}), (SEQ, SEQ), (2, 84, 4, 2))
    assert out < 1e-4 and loss < 1e-4 and max(grads) < 1e-3, (out, loss, grads)
    out, loss, grads = _compare(_mesh({"context": 4}), (SEQ, SEQ), (2, 64, 4, 2), causal=False)
    assert out < 1e-4 and loss < 1e-4 and max(grads) < 1e-3, (out, loss, grads)


@pytest.mark.parametrize("mesh,spec", [
    ({"data": 2, "context": 4}, P("data", "context")),
    ({"data": 2, "context": 2, "tensor": 2}, P("data", "context", "tensor")),
], ids=["data2xcontext4", "data2xcontext2xtensor2"])
def test_ring_on_a_multi_axis_mesh(mesh: dict[str, int], spec: P) -> None:
    out, loss, grads = _compare(_mesh(mesh), (spec, spec), (2, 64, 8, 2))
    assert out < 1e-4 and loss < 1e-4 and max(grads) < 1e-3, (out, loss, grads)


TENSOR3 = ({"data": 2, "context": 2, "tensor": 2}, P("data", "context", "tensor"))


@pytest.mark.parametrize("mesh,spec,kv_heads", [
    ({"context": 2}, SEQ, 2),  # kv heads split
    ({"context": 4}, SEQ, 2),  # kv heads repeated (2 < cp)
    ({"data": 2, "context": 4}, P("data", "context"), 2),  # the ppermute exchange (`_all_to_all`)
    (*TENSOR3, 4),  # heads split over tensor too
], ids=["cp2", "cp4", "data2xcontext4", "data2xcontext2xtensor2"])
def test_ulysses_matches_reference(mesh: dict[str, int], spec: P, kv_heads: int) -> None:
    out, loss, grads = _compare(_mesh(mesh), (spec, spec), (2, 64, 8, kv_heads), form="ulysses")
    assert out < 1e-4 and loss < 1e-4 and max(grads) < 1e-3, (out, loss, grads)


def test_ulysses_padded_blocks_and_non_causal() -> None:
    """Ulysses' causal kernel reads key blocks 0..i for query block i (the masked blocks skipped): at seq 86
    (6 blocks of 15, the last padded) and without the mask (every block)."""
    out, loss, grads = _compare(_mesh({"context": 2}), (SEQ, SEQ), (2, 86, 4, 2), form="ulysses")
    assert out < 1e-4 and loss < 1e-4 and max(grads) < 1e-3, (out, loss, grads)
    out, loss, grads = _compare(_mesh({"context": 4}), (SEQ, SEQ), (2, 64, 8, 4), form="ulysses", causal=False)
    assert out < 1e-4 and loss < 1e-4 and max(grads) < 1e-3, (out, loss, grads)


@pytest.mark.parametrize("mesh,spec,form,want", [
    ({"context": 4}, SEQ, "ulysses", "all-to-all"),
    ({"data": 2, "context": 4}, P("data", "context"), "ulysses", "collective-permute"),
    (*TENSOR3, "ulysses", "collective-permute"),
    (*TENSOR3, "ring", "collective-permute"),
], ids=["ulysses-context4", "ulysses-data2xcontext4", "ulysses-3d", "ring-3d"])
def test_collectives_keep_other_axes_split(mesh: dict[str, int], spec: P, form: str, want: str) -> None:
    """Only context-axis collectives in forward + backward: the batch stays split over ``data`` and the heads
    over ``tensor``. Ulysses uses one all-to-all per exchange on a context-only mesh, and ppermutes where
    another axis is left to GSPMD (which would all-gather that axis before an all-to-all)."""
    m = _mesh(mesh)
    shapes = [jax.ShapeDtypeStruct((2, 64, h, 16), jnp.float32, sharding=NamedSharding(m, spec)) for h in (8, 4, 4)]
    loss = lambda *a: jnp.sum(context_attention(*a, form=form))
    with jax.set_mesh(m):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shapes).compile()
    text = compiled.as_text()
    assert want + "(" in text and "all-gather(" not in text and "all-reduce(" not in text
    assert all(s.is_equivalent_to(NamedSharding(m, spec), 4) for s in compiled.output_shardings)


@pytest.mark.parametrize("form", ["ring", "ulysses"])
def test_bf16_inputs(form: str) -> None:
    out, loss, grads = _compare(_mesh({"context": 4}), (SEQ, SEQ), (2, 64, 8, 2), form=form, dtype=jnp.bfloat16)
    assert out < 2e-2 and loss < 2e-2 and max(grads) < 2e-2, (out, loss, grads)


def test_ulysses_supported() -> None:
    assert ulysses_supported(8, 2, 2) is None and ulysses_supported(8, 2, 4) is None
    assert ulysses_supported(8, 8, 4) is None and ulysses_supported(16, 2, 8) is None
    assert "heads 6 is not divisible" in ulysses_supported(6, 6, 4)
    assert "do not divide one another" in ulysses_supported(12, 6, 4)
    q, k, _, _ = _inputs(1, 16, 6, 6)
    with jax.set_mesh(_mesh({"context": 4})), pytest.raises(ValueError, match="heads 6 is not divisible.*form='ring'"):
        context_attention(q, k, k, form=ContextForm.ULYSSES)


def test_bad_arguments_name_the_fix() -> None:
    q, k, _, _ = _inputs(1, 36, 4, 2)
    with jax.set_mesh(_mesh({"context": 4})):
        with pytest.raises(ValueError, match=r"36 must split into 2 \* cp chunks .* = 8.*pad the sequence"):
            context_attention(q, k, k)
        with pytest.raises(ValueError, match="34 must split into cp shards = 4"):
            context_attention(q[:, :34], k[:, :34], k[:, :34], form="ulysses")
        with pytest.raises(ValueError, match="form must be one of"):
            context_attention(q, k, k, form="stripes")
        with pytest.raises(ValueError, match="block_size must be a positive integer"):
            context_attention(q, k, k, block_size=0)
        with pytest.raises(ValueError, match=r"axis='seq' is not an axis of the current mesh.*\('context',\)"):
            context_attention(q, k, k, axis="seq")
    with pytest.raises(ValueError, match="no mesh is set.*jax.set_mesh"):
        context_attention(q, k, k)


def test_ring_is_a_ring_with_sharded_memory() -> None:
    """The compiled ring sends K/V with collective-permutes and needs a fraction of the one-device kernel's
    temporaries (forward and forward + backward) at seq 4096."""
    from models.attention import blockwise_attention

    b, s, heads, kv_heads, d, cp = 1, 4096, 4, 2, 16, 4
    mesh = _mesh({"context": cp})
    shapes = lambda sharding=None: [jax.ShapeDtypeStruct((b, s, h, d), jnp.float32, sharding=sharding)
                                    for h in (heads, kv_heads, kv_heads)]
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))
    ratios = []
    for wrap in (lambda f: f, grad):
        with jax.set_mesh(mesh):
            ring = jax.jit(wrap(context_attention)).lower(*shapes(NamedSharding(mesh, SEQ))).compile()
        one = jax.jit(wrap(blockwise_attention)).lower(*shapes()).compile()
        assert "collective-permute" in ring.as_text()
        ratios.append(ring.memory_analysis().temp_size_in_bytes / one.memory_analysis().temp_size_in_bytes)
    assert max(ratios) < 0.5, ratios  # measured 0.21 / 0.22 (ideal 1 / cp = 0.25 plus K/V buffers)


def test_kernels_are_named_units() -> None:
    q, k, _, _ = _inputs(1, 32, 4, 2)
    with jax.set_mesh(_mesh({"context": 4})):
        text = str(jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(context_attention(q, k, v, block_size=8))))(
            q, k, k))
        assert "context_attention_fwd_ring_cp4_b8" in text and "context_attention_bwd_ring_cp4_b8" in text
        text = str(jax.make_jaxpr(lambda q, k, v: context_attention(q, k, v, form="ulysses"))(q, k, k))
        assert "context_attention_fwd_ulysses_cp4_b128" in text
