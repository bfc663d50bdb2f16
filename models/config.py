"""Model configuration shared by every family in the zoo, with analytic parameter counts.

The analytic counts mirror the modules in :mod:`models.layers` exactly, the vocabulary's pad rows included
(`ModelConfig.padded_vocab_size`; the tests check this), so the cost model can size parameters, gradients and
optimizer states without building a model.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable

from models.attention import DEFAULT_BLOCK_SIZE
from models.mla_config import MLAConfig
from models.moe_config import MoEConfig

FAMILIES = ("gpt3", "llama", "falcon")
DTYPES = ("float32", "bfloat16", "float16")
# "fused": cuDNN flash attention where the GPU takes it, else the blockwise kernel (models.attention);
# "blockwise" / "cudnn": one of them always; "xla" / "reference": unfused (probabilities saved, O(s^2)).
ATTENTIONS = ("fused", "blockwise", "cudnn", "xla", "reference")
# How the priced runtime executes the elementwise chains PyTorch has no single op for (RMSNorm, rotary, SwiGLU):
# "fused": as XLA (and Mist's CUDA / Triton kernels) does, one kernel per chain; "eager": one kernel per op,
# each reading its operands and writing its result, as Megatron-LM's PyTorch code runs them (models.layers).
ELEMENTWISE = ("fused", "eager")

# RoPE's base wavelength (theta) when a config names none; Llama-3 uses 500000 (`ModelConfig.rope_base`).
DEFAULT_ROPE_BASE = 10000.0
# `ModelConfig.rope_scaling` kinds -> their parameters after the kind, in order (all only change the rotary
# frequencies, not the FLOPs or bytes): "linear" divides every frequency by the factor (position
# interpolation); "llama3" divides the low frequencies by the factor and blends the middle band (Llama 3.1).
ROPE_SCALINGS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# Mist evaluation sizes (paper section 6.2): size -> (hidden, layers, heads). Vocab is 50304 everywhere.
MIST_SIZES: dict[str, tuple[int, int, int]] = {
    "1.3b": (2048, 24, 16),
    "2.7b": (2560, 32, 32),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "22b": (6144, 48, 64),
}
MIST_VOCAB = 50304
# Covers both paper settings (seq 2048 on L4, 4096 on A100); only GPT-3 pays for it (learned positions).
MIST_MAX_SEQ_LEN = 4096
# The embedding and LM head hold the vocabulary padded to a multiple of this (`ModelConfig.vocab_multiple`),
# Megatron-LM's ``make_vocab_size_divisible_by``. Megatron pads to 128 x tp; here the padded size depends on the
# config only (docs/internals.md, "Awkward shapes"): 128 = 2**7, so every power-of-two tp up to 128 splits it.
VOCAB_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder-only language model.

    Raises:
        ValueError: from ``__post_init__`` when a field is invalid; the message names the field and the fix.
    """

    name: str  # preset name, e.g. "llama-7b"; informational only
    family: str  # "gpt3" | "llama" | "falcon": selects block layout, norm and MLP kind
    vocab_size: int  # real tokens; the embedding and LM head hold `padded_vocab_size` rows / columns
    hidden_size: int  # model width h (the "embed" logical axis)
    num_layers: int  # transformer blocks, stacked along the leading "layers" axis
    num_heads: int  # query heads; must divide hidden_size
    # key/value heads (GQA when < num_heads, MQA at 1); must divide num_heads. Tensor parallelism splits them
    # when tp divides them, else keeps the k / v projections whole on every device (replicated).
    num_kv_heads: int
    ffn_size: int  # MLP inner width (the "mlp" logical axis)
    max_seq_len: int  # longest sequence accepted; sizes GPT-3's learned position table
    rotary_pct: float = 0.0  # fraction of head_dim rotated by RoPE; 0 for gpt3 (learned positions)
    norm_eps: float = 1e-5  # epsilon of LayerNorm / RMSNorm
    dtype: str = "float32"  # compute dtype name ("float32" | "bfloat16" | "float16")
    param_dtype: str = "float32"  # storage dtype of the master weights
    attention: str = "fused"  # one of ATTENTIONS: "fused" (default) | "blockwise" | "cudnn" | "xla" | "reference"
    loss_chunks: int = 8  # sequence slices the fused LM head + cross-entropy runs in (models.head_loss)
    attention_block: int = DEFAULT_BLOCK_SIZE  # keys per block of the blockwise kernel ("fused" / "blockwise")
    elementwise: str = "fused"  # one of ELEMENTWISE: "fused" (default) | "eager" (priced one kernel per op)
    # The LM head is the embedding matrix transposed (one parameter; its gradient sums both uses).
    tie_embeddings: bool = False
    rope_base: float = DEFAULT_ROPE_BASE  # RoPE base wavelength theta (Hugging Face's rope_theta)
    # () for none, else (kind, *parameters) of ROPE_SCALINGS, e.g. ("llama3", 8.0, 1.0, 4.0, 8192)
    rope_scaling: tuple = ()
    # Attention and MLP projections as FP8 GEMMs with dynamic tensorwise scales (`mistjax.core.fp8`, torchao's
    # Float8Linear recipe); the embedding, LM head and attention core stay in ``dtype``. Pays off on GPUs with
    # fp8 tensor cores (H100, H200, L4), where the cost model prices them at the fp8 peak.
    fp8: bool = False
    # The vocabulary is padded to a multiple of this (1: no padding); pad rows never score (`padded_vocab_size`).
    vocab_multiple: int = VOCAB_MULTIPLE
    # Width of one attention head when it is not hidden_size / num_heads (Qwen3, gpt-oss); None: derived.
    attention_head_dim: int | None = None
    # Mixture-of-Experts blocks (models.moe; issue #51); None: every block has the dense MLP.
    moe: MoEConfig | None = None
    # DeepSeek's multi-head latent attention in place of GQA (models.mla); only in MoE models (models.moe).
    mla: MLAConfig | None = None

    def __post_init__(self) -> None:
        def bad(field: str, msg: str) -> ValueError:
            return ValueError(f"ModelConfig({self.name!r}).{field}: {msg}")

        if self.family not in FAMILIES:
            raise bad("family", f"unknown family {self.family!r}; use one of {FAMILIES}")
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size",
                      "max_seq_len", "vocab_multiple"):
            value = getattr(self, field)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                raise bad(field, f"must be a positive integer, got {value!r}")
        self._check_moe(bad)
        if self.attention_head_dim is None and self.hidden_size % self.num_heads:
            raise bad("num_heads", f"{self.num_heads} does not divide hidden_size={self.hidden_size}; "
                                   "choose num_heads among the divisors of hidden_size")
        if self.num_heads % self.num_kv_heads:
            raise bad("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads}; "
                                      "choose num_kv_heads among the divisors of num_heads")
        if not 0.0 <= self.rotary_pct <= 1.0:
            raise bad("rotary_pct", f"{self.rotary_pct} is outside [0, 1]; it is a fraction of head_dim")
        rot = self.head_dim * self.rotary_pct
        if abs(rot - round(rot)) > 1e-9 or round(rot) % 2:
            raise bad("rotary_pct", f"head_dim*rotary_pct = {self.head_dim}*{self.rotary_pct} = {rot:g} "
                                    "must be an even integer (RoPE rotates pairs of dims); adjust rotary_pct")
        if self.family == "gpt3" and self.rotary_pct != 0.0:
            raise bad("rotary_pct", "gpt3 uses learned positions; set rotary_pct=0")
        if not self.norm_eps > 0:
            raise bad("norm_eps", f"must be positive, got {self.norm_eps!r}")
        for field in ("dtype", "param_dtype"):
            if getattr(self, field) not in DTYPES:
                raise bad(field, f"unknown dtype {getattr(self, field)!r}; use one of {DTYPES}")
        if self.attention not in ATTENTIONS:
            raise bad("attention", f"unknown attention {self.attention!r}; use one of {ATTENTIONS}")
        if self.elementwise not in ELEMENTWISE:
            raise bad("elementwise", f"unknown elementwise {self.elementwise!r}; use one of {ELEMENTWISE}")
        if not isinstance(self.loss_chunks, numbers.Integral) or isinstance(self.loss_chunks, bool) \
                or self.loss_chunks <= 0:
            raise bad("loss_chunks", f"must be a positive integer (sequence slices), got {self.loss_chunks!r}")
        if (not isinstance(self.attention_block, numbers.Integral) or isinstance(self.attention_block, bool)
                or self.attention_block <= 0):
            raise bad("attention_block", f"must be a positive integer (keys per block), got {self.attention_block!r}")
        if not isinstance(self.fp8, bool):
            raise bad("fp8", f"must be true or false, got {self.fp8!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise bad("tie_embeddings", f"must be true or false, got {self.tie_embeddings!r}")
        if (not isinstance(self.rope_base, numbers.Real) or isinstance(self.rope_base, bool)
                or not self.rope_base > 1):
            raise bad("rope_base", f"must be a number above 1 (RoPE's theta, e.g. 10000), got {self.rope_base!r}")
        self._check_rope_scaling(bad)

    def _check_moe(self, bad: Callable[[str, str], ValueError]) -> None:
        if isinstance(self.moe, dict):  # a JSON round trip turns the nested dataclass into a dict
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.moe is not None:
            if not isinstance(self.moe, MoEConfig):
                raise bad("moe", f"must be a models.MoEConfig or None, got {type(self.moe).__name__}")
            if self.family != "llama":
                raise bad("moe", f"MoE blocks are built on the llama family (RMSNorm, SwiGLU), not {self.family!r}")
            try:
                self.moe.check_layers(self.num_layers)
            except ValueError as e:
                raise bad("moe", str(e)) from None
        if isinstance(self.mla, dict):
            object.__setattr__(self, "mla", MLAConfig(**self.mla))
        if self.mla is not None and (not isinstance(self.mla, MLAConfig) or self.moe is None):
            raise bad("mla", "multi-head latent attention is built by the MoE models only (models.moe): give a "
                             "models.MLAConfig together with moe=MoEConfig(...), or None")
        dim = self.attention_head_dim
        if dim is not None and (not isinstance(dim, numbers.Integral) or isinstance(dim, bool) or dim <= 0):
            raise bad("attention_head_dim", f"must be a positive integer or None, got {dim!r}")

    def _check_rope_scaling(self, bad: Callable[[str, str], ValueError]) -> None:
        # A JSON round trip (asdict -> json -> ModelConfig(**doc)) turns the tuple into a list: take it back,
        # so that the config stays hashable (profiles are cached by config).
        scaling = self.rope_scaling
        if isinstance(scaling, list):
            scaling = tuple(scaling)
            object.__setattr__(self, "rope_scaling", scaling)
        if scaling == ():
            return
        if not isinstance(scaling, tuple) or not isinstance(scaling[0], str) or scaling[0] not in ROPE_SCALINGS:
            raise bad("rope_scaling", f"{scaling!r} is not () or (kind, *parameters) with kind one of "
                                      f"{tuple(ROPE_SCALINGS)}")
        names = ROPE_SCALINGS[scaling[0]]
        if len(scaling) != 1 + len(names):
            raise bad("rope_scaling", f"{scaling[0]!r} takes ({', '.join(names)}), got {scaling[1:]!r}")
        for name, value in zip(names, scaling[1:]):
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value > 0:
                raise bad("rope_scaling", f"{scaling[0]} {name} must be a positive number, got {value!r}")
        if scaling[0] == "llama3" and not scaling[3] > scaling[2]:
            raise bad("rope_scaling", f"llama3 high_freq_factor {scaling[3]} must exceed low_freq_factor {scaling[2]}")
        if self.rotary_dims == 0:
            raise bad("rope_scaling", f"{scaling!r} has no effect without RoPE (rotary_pct=0); drop it")

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``attention_head_dim``, else hidden_size // num_heads)."""
        return self.attention_head_dim or self.hidden_size // self.num_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and columns of the LM head: ``vocab_size`` rounded up to ``vocab_multiple``.

        The pad rows are never looked up (token ids are below ``vocab_size``) and their logits are masked out
        of the softmax (`models.layers.mask_pad_logits`), so they change neither the loss nor its gradient.
        """
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def rotary_dims(self) -> int:
        """Number of leading head dimensions rotated by RoPE (even; 0 disables RoPE)."""
        return round(self.head_dim * self.rotary_pct)

    def replace(self, **changes) -> ModelConfig:
        """Returns a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuses a tensor-parallel degree that cannot split this model, naming the field and the fix.

        Tensor parallelism splits the query heads, the MLP width and the padded vocabulary ``tp`` ways; the
        key / value heads are split when ``tp`` divides them and replicated otherwise, so they never refuse.

        Raises:
            ValueError: ``tp`` does not divide ``num_heads``, ``ffn_size`` or ``padded_vocab_size``.
        """
        if not isinstance(tp, numbers.Integral) or isinstance(tp, bool) or tp <= 0:
            raise ValueError(f"tensor parallelism must be a positive integer, got {tp!r}")
        # (field to change, the split size it sets, its name, the fix)
        checks = (("num_heads", self.num_heads, "num_heads", "choose tp among its divisors or change num_heads"),
                  ("ffn_size", self.ffn_size, "ffn_size", "choose tp among its divisors or change ffn_size"),
                  ("vocab_multiple", self.padded_vocab_size, "padded_vocab_size",
                   f"vocab_size={self.vocab_size} is padded to a multiple of vocab_multiple={self.vocab_multiple}; "
                   f"set vocab_multiple to a multiple of {tp} (Megatron-LM pads to 128 x tp = {128 * tp})"))
        for field, size, label, fix in checks:
            if size % tp:
                raise ValueError(f"ModelConfig({self.name!r}).{field}: tensor parallelism {tp} does not divide "
                                 f"{label}={size}; {fix}")

    # ---- analytic parameter counts (must match the modules in models.layers; pad rows included) ----

    def _norm_params(self) -> int:
        # LayerNorm has scale + bias; Llama's RMSNorm only a scale.
        return self.hidden_size if self.family == "llama" else 2 * self.hidden_size

    def attention_params(self) -> int:
        """Parameters of one attention sub-layer (q, k, v, out kernels; no biases; MLA's own when ``mla``)."""
        if self.mla is not None:
            return self.mla.params(self.hidden_size, self.num_heads)
        h, d = self.hidden_size, self.head_dim
        return 2 * h * self.num_heads * d + 2 * h * self.num_kv_heads * d

    def mlp_params(self) -> int:
        """Parameters of one MLP sub-layer (SwiGLU has gate, up and down kernels; GELU in and out)."""
        n_mats = 3 if self.family == "llama" else 2
        return n_mats * self.hidden_size * self.ffn_size

    def params_per_layer(self) -> int:
        """Parameters of one transformer block (Falcon's parallel block has a single norm)."""
        n_norms = 1 if self.family == "falcon" else 2
        return n_norms * self._norm_params() + self.attention_params() + self.mlp_params()

    def embedding_params(self) -> int:
        """Token embedding (its pad rows included: ``padded_vocab_size`` rows), plus GPT-3's position table."""
        positions = self.max_seq_len * self.hidden_size if self.family == "gpt3" else 0
        return self.padded_vocab_size * self.hidden_size + positions

    def head_params(self) -> int:
        """Final norm plus the LM head (``padded_vocab_size`` columns; none of its own when tied)."""
        return self._norm_params() + (0 if self.tie_embeddings else self.hidden_size * self.padded_vocab_size)

    def vocab_pad_params(self) -> int:
        """Parameters of the vocabulary's pad rows (embedding, and the untied head): ``num_params()`` minus
        this is the count with the real vocabulary, the figure model cards publish."""
        tables = 1 if self.tie_embeddings else 2
        return tables * (self.padded_vocab_size - self.vocab_size) * self.hidden_size

    def num_params(self) -> int:
        """Total parameter count of the model built from this config (the arrays it holds: pad rows included)."""
        if self.moe is not None:  # MoE blocks: the dense MLP replaced by router, experts and shared expert
            moe_layers = self.moe.moe_layers(self.num_layers)
            layers = (self.num_layers * self.params_per_layer()
                      + moe_layers * (self.moe.mlp_params(self.hidden_size) - self.mlp_params()))
            return self.embedding_params() + layers + self.head_params()
        return self.embedding_params() + self.num_layers * self.params_per_layer() + self.head_params()


def human_count(n: int) -> str:
    """Formats a parameter count, e.g. 1316110336 -> '1.32B', 204800 -> '204.8K'."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.{2 if suffix in 'TB' else 1}f}{suffix}"
    return str(n)


def tiny_and_small(family: str, *, tiny_ffn: int, small_ffn: int, kv_heads: int, rotary_pct: float
                   ) -> dict[str, ModelConfig]:
    """Test-sized presets; heads (8) and kv heads (4 or 8) divide TP degrees up to 8 and 4."""
    tiny = ModelConfig(name=f"{family}-tiny", family=family, vocab_size=256, hidden_size=64, num_layers=4,
                       num_heads=8, num_kv_heads=kv_heads, ffn_size=tiny_ffn, max_seq_len=64,
                       rotary_pct=rotary_pct)
    small = tiny.replace(name=f"{family}-small", vocab_size=2048, hidden_size=256, ffn_size=small_ffn,
                         max_seq_len=256)
    return {tiny.name: tiny, small.name: small}

