"""Third-party-style models for the "autoshard any step" tests (used through `conftest.py` fixtures).

Each family is built as its users write it, with random weights from a tiny config, and trained with a
plain optax state ``{"params", "opt"}``: Hugging Face's Flax Llama and GPT-2 (unrolled Python loops
over ``layers/0 .. layers/L-1``), a flax.linen ``nn.scan`` model with logical partitioning metadata,
an NNX model looping over an ``nnx.List`` of layers, an NNX model with ``nnx.scan``, and a pure
``lax.scan`` function model. None carries mistjax-specific code besides ``mistjax.value_and_grad``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mistjax

VOCAB, HIDDEN, FFN, HEADS, LAYERS = 64, 32, 64, 4, 2
BATCH, SEQ = 16, 16


@dataclass
class Family:
    """One model family: parameters, loss and a batch."""

    name: str
    params: Any  # the parameter pytree as the model's users hold it
    loss_fn: Callable[[Any, Any], jax.Array]  # loss_fn(params, batch) -> scalar
    batch: dict[str, np.ndarray]  # {"inputs", "targets"}: int32 [BATCH, SEQ]
    unrolled: bool  # the layers run as a Python loop (no scan)


def token_batch(seed: int = 0, batch: int = BATCH, seq: int = SEQ) -> dict[str, np.ndarray]:
    tok = np.random.default_rng(seed).integers(0, VOCAB, (batch, seq + 1)).astype(np.int32)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def xent(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


# ---------------------------------------------------------------------------------------------- Hugging Face
def hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def hf_llama(layers: int = LAYERS) -> Family:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                      num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64)
    model = FlaxLlamaForCausalLM(cfg, seed=0, dtype=jnp.float32)

    loss_fn = _hf_loss(model)
    return Family("hf-llama", model.params, loss_fn, token_batch(), unrolled=True)


def _hf_loss(model: Any) -> Any:
    """Next-token loss of a Hugging Face Flax causal LM (ids, all-ones attention mask, positions 0..s-1)."""

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        ids = batch["inputs"]
        pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        logits = model.module.apply({"params": params}, ids, jnp.ones_like(ids), pos).logits
        return xent(logits, batch["targets"])

    return loss_fn


def hf_gpt2(layers: int = LAYERS) -> Family:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=layers, n_head=HEADS, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = FlaxGPT2LMHeadModel(cfg, seed=0, dtype=jnp.float32)

    loss_fn = _hf_loss(model)
    return Family("hf-gpt2", model.params, loss_fn, token_batch(), unrolled=True)


def hf_gpt_neo(layers: int = 2 * LAYERS) -> Family:
    """Hugging Face's Flax GPT-Neo with its standard alternating global / local attention (period 2: the layers
    repeat only in pairs), a learned position table and biased projections named q/k/v/out_proj, c_fc/c_proj."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import FlaxGPTNeoForCausalLM, GPTNeoConfig

    cfg = GPTNeoConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=layers, num_heads=HEADS,
                       attention_types=[[["global", "local"], layers // 2]], window_size=4,
                       max_position_embeddings=64, intermediate_size=FFN, embed_dropout=0.0,
                       attention_dropout=0.0, resid_dropout=0.0)
    model = FlaxGPTNeoForCausalLM(cfg, seed=0, dtype=jnp.float32)
    return Family("hf-gpt-neo", model.params, _hf_loss(model), token_batch(), unrolled=True)


# ---------------------------------------------------------------------------------------------- flax.linen
def _part(names: tuple[str, ...]) -> Any:
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h: jax.Array, _: Any) -> tuple[jax.Array, None]:
        x = nn.LayerNorm(use_bias=False)(h)
        x = nn.Dense(FFN, use_bias=False, kernel_init=_part(("embed", "mlp")))(x)
        x = nn.Dense(HIDDEN, use_bias=False, kernel_init=_part(("mlp", "embed")))(jax.nn.gelu(x))
        return h + x, None


class LinenScanLM(nn.Module):
    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        emb = nn.Embed(VOCAB, HIDDEN, embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(0.02), ("vocab", "embed")))
        h = emb(ids)
        stack = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS,
                        metadata_params={nn.PARTITION_NAME: "layers"})
        h, _ = stack()(h, None)
        return emb.attend(nn.LayerNorm(use_bias=False)(h))


def linen_scan() -> Family:
    model = LinenScanLM()
    params = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        return xent(model.apply({"params": params}, batch["inputs"]), batch["targets"])

    return Family("linen-scan", params, loss_fn, token_batch(), unrolled=False)


# ---------------------------------------------------------------------------------------------- NNX
class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm = nnx.RMSNorm(HIDDEN, rngs=rngs)
        self.up = nnx.Linear(HIDDEN, FFN, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(FFN, HIDDEN, use_bias=False, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.down(jax.nn.silu(self.up(self.norm(h))))


class NnxLoopLM(nnx.Module):
    """Layers as a Python list, run in a Python loop (unrolled)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
        self.layers = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(HIDDEN, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.embed.attend(self.norm(h))


class NnxScanLM(nnx.Module):
    """Layers created with nnx.vmap and run with nnx.scan (stacked parameters)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(r: nnx.Rngs) -> NnxBlock:
            return NnxBlock(r)

        self.layers = create(rngs)
        self.norm = nnx.RMSNorm(HIDDEN, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.embed(ids)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h: jax.Array, layer: NnxBlock) -> jax.Array:
            return layer(h)

        return self.embed.attend(self.norm(run(h, self.layers)))


def _nnx_family(name: str, cls: type, unrolled: bool) -> Family:
    graphdef, params = nnx.split(cls(nnx.Rngs(0)), nnx.Param)

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        return xent(nnx.merge(graphdef, params)(batch["inputs"]), batch["targets"])

    return Family(name, params, loss_fn, token_batch(), unrolled=unrolled)


def nnx_loop() -> Family:
    return _nnx_family("nnx-loop", NnxLoopLM, unrolled=True)


def nnx_scan() -> Family:
    return _nnx_family("nnx-scan", NnxScanLM, unrolled=False)


# ---------------------------------------------------------------------------------------------- lax.scan
def lax_scan() -> Family:
    k = iter(jax.random.split(jax.random.key(0), 4))
    params = {"embed": 0.02 * jax.random.normal(next(k), (VOCAB, HIDDEN)),
              "layers": {"w_in": jax.random.normal(next(k), (LAYERS, HIDDEN, FFN)) / np.sqrt(HIDDEN),
                         "w_out": jax.random.normal(next(k), (LAYERS, FFN, HIDDEN)) / np.sqrt(FFN)},
              "head": jax.random.normal(next(k), (HIDDEN, VOCAB)) / np.sqrt(HIDDEN)}

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        def layer(h: jax.Array, w: Any) -> tuple[jax.Array, None]:
            x = h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
            return h + jax.nn.gelu(x @ w["w_in"]) @ w["w_out"], None

        h, _ = jax.lax.scan(layer, params["embed"][batch["inputs"]], params["layers"])
        return xent(h @ params["head"], batch["targets"])

    return Family("lax-scan", params, loss_fn, token_batch(), unrolled=False)


FAMILIES: dict[str, Callable[[], Family]] = {"hf-llama": hf_llama, "hf-gpt2": hf_gpt2, "linen-scan": linen_scan,
                                             "nnx-loop": nnx_loop, "nnx-scan": nnx_scan, "lax-scan": lax_scan}
HF_FAMILIES = ("hf-llama", "hf-gpt2", "hf-gpt-neo")


# ---------------------------------------------------------------------------------------------- train steps
def optax_state(params: Any, tx: optax.GradientTransformation) -> dict[str, Any]:
    return {"params": params, "opt": tx.init(params)}


def optax_step(loss_fn: Callable[[Any, Any], jax.Array], tx: optax.GradientTransformation
               ) -> Callable[[Any, Any], tuple[Any, Any]]:
    """The plain train step: mistjax.value_and_grad, then optax on a ``{"params", "opt"}`` dict."""

    def train_step(state: Any, batch: Any) -> tuple[Any, Any]:
        loss, grads = mistjax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    return train_step


# ---------------------------------------------------------------------------------------------- NNX idioms
def nnx_optimizer_step(model: nnx.Module, lr: float = 1e-2) -> tuple[Callable[..., Any], Any, Any]:
    """An NNX step as NNX users write it (nnx.Optimizer, nnx.jit), with mistjax.nnx.value_and_grad in place of
    nnx.value_and_grad; returns ``(train_step, model, optimizer)``."""
    optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

    def loss_fn(model: Any, batch: Any) -> jax.Array:
        return xent(model(batch["inputs"]), batch["targets"])

    @nnx.jit
    def train_step(model: Any, optimizer: Any, batch: Any) -> dict[str, jax.Array]:
        loss, grads = mistjax.nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss}

    return train_step, model, optimizer


def no_pairs() -> Family:
    """A scanned model with no Megatron pair: each layer's single matmul feeds the residual directly."""
    k = iter(jax.random.split(jax.random.key(1), 3))
    params = {"embed": 0.02 * jax.random.normal(next(k), (VOCAB, HIDDEN)),
              "layers": jax.random.normal(next(k), (LAYERS, HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)}

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), params["embed"][batch["inputs"]],
                            params["layers"])
        return xent(h @ params["embed"].T, batch["targets"])

    return Family("no-pairs", params, loss_fn, token_batch(), unrolled=False)


class LinenLoopLM(nn.Module):
    """linen layers created in a Python loop: linen names them LinenLoopBlock_0 .. LinenLoopBlock_{L-1}."""

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        emb = nn.Embed(VOCAB, HIDDEN)
        h = emb(ids)
        for _ in range(LAYERS + 1):
            h = LinenLoopBlock()(h)
        return emb.attend(nn.LayerNorm(use_bias=False)(h))


class LinenLoopBlock(nn.Module):
    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        x = nn.Dense(FFN, use_bias=False)(nn.LayerNorm(use_bias=False)(h))
        return h + nn.Dense(HIDDEN, use_bias=False)(jax.nn.gelu(x))


def linen_loop() -> Family:
    model = LinenLoopLM()
    params = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        return xent(model.apply({"params": params}, batch["inputs"]), batch["targets"])

    return Family("linen-loop", params, loss_fn, token_batch(), unrolled=True)


FAMILIES["linen-loop"] = linen_loop
FAMILIES["hf-gpt-neo"] = hf_gpt_neo
