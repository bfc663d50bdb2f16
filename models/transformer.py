"""Decoder-only LM skeleton shared by the families: embedding -> scanned block stack -> final norm -> head.

The stack is ONE block module whose params carry a leading ``layers`` axis (built with ``nnx.split_rngs`` +
``nnx.vmap``), run with ``nnx.scan``. Traced through ``nnx.merge(graphdef, params)(tokens)`` the forward
contains exactly one top-level ``scan`` equation: no consts, one carry (the hidden state ``[B, T, h]`` in
the compute dtype), and as xs the stacked layer params, taken straight from the jaxpr inputs in the
flattening order of ``nnx.state(model.layers, nnx.Param)``. The runtime splits the model at that scan.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from models.config import ModelConfig
from models.layers import Embed, LMHead, Norm, mask_pad_logits, project_logits

BodyFn = Callable[[jax.Array, nnx.Module], jax.Array]


def make_layer_stack(factory: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
                     rngs: nnx.Rngs) -> nnx.Module:
    """Builds ``num_layers`` independent blocks as one module with stacked params.

    Args:
        factory: creates one block from an ``nnx.Rngs``.
        num_layers: length of the leading ``layers`` axis.
        rngs: split ``num_layers`` ways so every layer gets its own init.

    Returns:
        A block module whose every param has shape ``[num_layers, ...]`` and logical axes
        ``("layers", ...)``.
    """

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(layer_rngs: nnx.Rngs) -> nnx.Module:
        return factory(layer_rngs)

    return create(rngs)


class CausalLM(nnx.Module):
    """Base class of the family models. Subclasses set ``norm_kind`` and implement ``make_block``.

    Attributes:
        config: the ``ModelConfig`` (static).
        embed: token embedding.
        layers: the scanned block stack (params ``[num_layers, ...]``).
        final_norm: norm applied before the head.
        lm_head: untied output projection; None with ``config.tie_embeddings`` (the head is
            ``embed.embedding`` transposed, see `head_kernel`). Both hold the padded vocabulary
            (``config.padded_vocab_size``).
    """

    norm_kind: str = "layernorm"

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = Embed(config, rngs=rngs)
        self.layers = make_layer_stack(lambda r: self.make_block(config, r), config.num_layers, rngs)
        self.final_norm = Norm(config, self.norm_kind, rngs=rngs)
        self.lm_head = None if config.tie_embeddings else LMHead(config, rngs=rngs)

    @staticmethod
    def make_block(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        """Creates one (unstacked) transformer block."""
        raise NotImplementedError

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """``int32[B, T]`` -> hidden states ``[B, T, h]`` in the compute dtype."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be int[batch, seq], got shape {tokens.shape}")
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds "
                             f"max_seq_len={self.config.max_seq_len}; raise ModelConfig.max_seq_len")
        return self.embed(tokens)

    def run_layers(self, hidden: jax.Array, *, body_transform: Callable[[BodyFn], BodyFn] | None = None
                   ) -> jax.Array:
        """Runs the block stack with ``nnx.scan`` (carry = hidden state, xs = stacked layer params).

        Args:
            hidden: ``[B, T, h]`` in the compute dtype.
            body_transform: optional wrapper of the scan body ``(hidden, block) -> hidden``, e.g.
                ``lambda f: nnx.remat(f, policy=...)``. The model itself never applies remat.
        """

        def body(h: jax.Array, block: nnx.Module) -> jax.Array:
            return block(h)

        if body_transform is not None:
            body = body_transform(body)
        return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(hidden, self.layers)

    def head_kernel(self) -> jax.Array:
        """The LM head's ``[embed, padded_vocab]`` matrix: its own kernel, or the embedding transposed when tied.

        A tied model has one parameter read twice; autodiff sums the gradients of both uses into it.
        """
        if self.lm_head is None:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm + LM head; returns float32 ``[B, T, padded_vocab]``, the pad columns at float32's minimum
        (zero probability: `models.layers.mask_pad_logits`)."""
        logits = project_logits(self.final_norm(hidden), self.head_kernel())
        return mask_pad_logits(logits, self.config.vocab_size)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Forward pass: ``int32[B, T]`` -> float32 logits ``[B, T, padded_vocab]`` (pad columns masked).

        ``padded_vocab`` is ``config.padded_vocab_size``; it equals ``vocab_size`` unless the vocabulary is
        padded (`ModelConfig.vocab_multiple`). The columns are kept (not sliced off) so that a vocabulary split
        over ``tensor`` stays evenly split.
        """
        return self.compute_logits(self.run_layers(self.embed_tokens(tokens)))

    def forward_unrolled(self, tokens: jax.Array) -> jax.Array:
        """Same as ``__call__`` but a Python loop over layers indexing the stacked params (for testing)."""
        hidden = self.embed_tokens(tokens)
        graphdef, stacked = nnx.split(self.layers)
        for i in range(self.config.num_layers):
            block = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))
            hidden = block(hidden)
        return self.compute_logits(hidden)
