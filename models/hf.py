"""Hugging Face ``config.json`` -> `ModelConfig`: plan a published model without writing its sizes by hand.

`from_hf_config` reads the config of a Llama (2 / 3 / 3.1), Mistral, Qwen2, GPT-2, GPT-NeoX (Pythia) or
Falcon checkpoint, or of the Mixture-of-Experts Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and gpt-oss
(``ModelConfig.moe``, `models.moe`; the planner refuses them until it prices MoE, issue #51), and maps it onto the
zoo family that computes the same thing:

=========== ========= =============================================================================
model_type  family    notes
=========== ========= =============================================================================
llama       llama     GQA (``num_key_value_heads``), ``rope_theta``, ``rope_scaling`` linear / llama3
mistral     llama     ``sliding_window`` caps ``max_seq_len`` at the window (warning)
qwen2       llama     q/k/v biases (warning), tied embeddings, sliding window flags
gpt2        gpt3      learned positions, tied embeddings, biases (warning), dropout (warning)
gpt_neox    falcon    parallel residual with two norms -> the zoo's one-norm block (warning)
falcon      falcon    ``multi_query`` / ``num_kv_heads``; ``new_decoder_architecture`` two norms (warning)
mixtral     llama+moe routed SwiGLU experts; ``router_jitter_noise`` (warning)
qwen2_moe   llama+moe shared expert without its sigmoid gate, q/k/v biases (warnings); ``mlp_only_layers`` first
qwen3_moe   llama+moe ``head_dim`` kept (``attention_head_dim``); per-head q/k norms (warning)
deepseek_v3 llama+moe multi-head latent attention (`models.mla`), group-limited routing; MTP, YaRN (warnings)
gpt_oss     llama+moe clamped SwiGLU experts; expert / router / attention biases, sinks, sliding layers, YaRN (warnings)
=========== ========= =============================================================================

Every field is either mapped, accepted as informational (token ids, ``architectures``, ``use_cache``,
...), priced with a `HFConfigWarning` that says what the zoo model lacks (linear biases, a second
norm, dropout, a sliding window it replaces by a shorter ``max_seq_len``), or refused with an
`HFConfigError` naming the field, its value and what to do. Fields the mapping does not know are
listed in one warning. Both GELU forms (erf: ``gelu``; tanh: ``gelu_new``, ``gelu_pytorch_tanh``) map
to the zoo's tanh GELU: the same cost, outputs within about 1e-3 of each other.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from models.config import DEFAULT_ROPE_BASE, DTYPES, ROPE_SCALINGS, ModelConfig
from models.mla_config import MLAConfig
from models.moe_config import MoEConfig


class HFConfigError(ValueError):
    """A Hugging Face config that cannot be mapped onto the zoo; the message names the field and the fix."""


class HFConfigWarning(UserWarning):
    """Something the zoo model prices differently from the Hugging Face model (biases, norms, windows)."""


_REQUIRED = object()
_GELUS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                  "GPT2LMHeadModel": "gpt2", "GPTNeoXForCausalLM": "gpt_neox", "FalconForCausalLM": "falcon",
                  "RWForCausalLM": "falcon", "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                  "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3",
                  "GptOssForCausalLM": "gpt_oss"}
_MODEL_TYPE_ALIASES = {"RefinedWebModel": "falcon", "RefinedWeb": "falcon"}  # Falcon's first configs
# PretrainedConfig's own attributes (generation, labels, token ids, bookkeeping): none changes the network.
_INFORMATIONAL = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "_commit_hash", "auto_map",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache",
    "initializer_range", "tokenizer_class", "task_specific_params", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "is_decoder", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "prefix", "finetuning_task", "_attn_implementation", "use_return_dict", "chunk_size_feed_forward",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "temperature",
    "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "diversity_penalty",
    "tie_encoder_decoder", "pruned_heads", "tf_legacy_loss", "use_bfloat16",
})


class _Reader:
    """One HF config being mapped: the fields read so far, the ModelConfig fields made, and what to warn."""

    def __init__(self, doc: Mapping[str, Any], model_type: str) -> None:
        self.doc, self.model_type = doc, model_type
        self.source = f"Hugging Face config (model_type {model_type!r})"
        self.read: set[str] = set()
        self.fields: dict[str, Any] = {}
        self.origin: dict[str, str] = {}  # ModelConfig field -> the HF field it was mapped from
        self.biases: list[tuple[int, str]] = []  # (parameters per layer, which linear layers)
        self.norm_gap: tuple[int, str] | None = None  # (parameters per layer the zoo block lacks, why)
        self.window: int | None = None  # active sliding-window length
        self.dropout: dict[str, float] = {}
        self.notes: list[str] = []  # other warnings

    def value(self, *keys: str, default: Any = _REQUIRED) -> Any:
        """The first of ``keys`` (aliases of one field) in the config, even if null, else ``default``.

        Raises:
            HFConfigError: a required field is missing, or two aliases disagree.
        """
        self.read.update(keys)
        present = [k for k in keys if k in self.doc]
        given = [k for k in present if self.doc[k] is not None]
        if any(self.doc[k] != self.doc[given[0]] for k in given[1:]):
            shown = ", ".join(f"{k}={self.doc[k]!r}" for k in given)
            raise HFConfigError(f"{self.source}: {shown} disagree (they name the same setting); keep one")
        if present:
            return self.doc[(given or present)[0]]
        if default is _REQUIRED:
            raise HFConfigError(f"{self.source}: {keys[0]} is missing; add it to the config (the model's size "
                                "fields are required)")
        return default

    def set(self, field: str, *keys: str, default: Any = _REQUIRED, if_null: Any = None) -> Any:
        """Maps the HF field ``keys`` (with aliases) to ModelConfig ``field``; a null value reads ``if_null``."""
        value = self.value(*keys, default=default)
        self.fields[field] = if_null if value is None and if_null is not None else value
        self.origin[field] = next((k for k in keys if k in self.doc), keys[0])
        return self.fields[field]

    def error(self, key: str, why: str, fix: str) -> HFConfigError:
        """An error naming ``key`` and its value, why the zoo cannot take it and what the user can do."""
        return HFConfigError(f"{self.source}: {key}={self.doc.get(key)!r}: {why}; {fix}")

    def require(self, key: str, allowed: tuple, default: Any, why: str, fix: str) -> Any:
        """The value of ``key`` (``default`` when absent), refused unless it is one of ``allowed``."""
        value = self.value(key, default=default)
        if value not in allowed:
            raise self.error(key, why, fix)
        return value

    def drop(self, *keys: str, default: float = 0.0) -> None:
        """Records the dropout probabilities of ``keys`` (the zoo has no dropout: priced without, with a warning)."""
        for key in keys:
            p = self.value(key, default=default)
            if p:
                self.dropout[key] = p


# ------------------------------------------------------------------------------------------ shared pieces
def _activation(r: _Reader, key: str, allowed: tuple[str, ...], default: str, zoo: str) -> None:
    r.require(key, allowed, default, f"the zoo's {r.fields['family']} family computes {zoo}",
              "no zoo family has this activation; write a models.ModelConfig JSON for the nearest one instead")


def _head_dim(r: _Reader, explicit: bool = False) -> None:
    """Newer configs name head_dim; the zoo derives it as hidden_size / num_heads, or (``explicit``, the MoE
    families) keeps a different one as ``attention_head_dim``."""
    head_dim = r.value("head_dim", default=None)
    derived = r.fields["hidden_size"] // r.fields["num_heads"] if _ints(r, "hidden_size", "num_heads") else None
    if explicit and head_dim is not None and head_dim != derived:
        r.set("attention_head_dim", "head_dim")
    elif head_dim is not None and head_dim != derived:
        raise r.error("head_dim", f"differs from hidden_size / num_attention_heads = {derived}, the zoo's head width",
                      "the zoo cannot plan attention wider or narrower than the model")


def _ints(r: _Reader, *fields: str) -> bool:
    return all(isinstance(r.fields.get(f), int) and r.fields[f] > 0 for f in fields)


def _rope(r: _Reader, *theta_keys: str) -> None:
    """``rope_theta`` -> ``rope_base``, ``rope_scaling`` -> ``rope_scaling`` (or Transformers 5's rope_parameters)."""
    params = r.value("rope_parameters", default=None) or {}
    theta = r.value(*theta_keys, default=params.get("rope_theta", DEFAULT_ROPE_BASE))
    r.fields["rope_base"], r.origin["rope_base"] = theta, next((k for k in theta_keys if k in r.doc), theta_keys[0])
    scaling = r.value("rope_scaling", default=None)
    key = "rope_scaling"
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling, key = params, "rope_parameters"
    r.fields["rope_scaling"], r.origin["rope_scaling"] = _rope_scaling(r, key, scaling), key


def _rope_scaling(r: _Reader, key: str, scaling: Any) -> tuple:
    if scaling is None:
        return ()
    if not isinstance(scaling, Mapping):
        raise r.error(key, "is not an object", "give a JSON object with a rope_type, or null")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return ()
    if kind not in ROPE_SCALINGS:
        raise r.error(key, f"rope scaling {kind!r} is not implemented (the zoo has {', '.join(ROPE_SCALINGS)})",
                      "the plan's cost does not depend on the rotary frequencies: delete rope_scaling from the "
                      "config to plan the model with unscaled RoPE (training would then differ from the checkpoint)")
    missing = [name for name in ROPE_SCALINGS[kind] if name not in scaling]
    if missing:
        raise r.error(key, f"{kind} scaling needs {', '.join(missing)}", "add them (see the model's published config)")
    return (kind, *(scaling[name] for name in ROPE_SCALINGS[kind]))


def _tie(r: _Reader, default: bool) -> None:
    """``tie_word_embeddings`` (PretrainedConfig's default is True; Llama, Mistral, Qwen2, NeoX set False)."""
    r.set("tie_embeddings", "tie_word_embeddings", default=default)


# ------------------------------------------------------------------------------------------ families
def _llama_like(r: _Reader, moe: bool = False) -> None:
    """The fields Llama, Mistral, Qwen2 and the MoE families share: RMSNorm, SwiGLU, RoPE, GQA."""
    r.fields["family"] = "llama"
    r.set("vocab_size", "vocab_size")
    r.set("hidden_size", "hidden_size")
    r.set("num_layers", "num_hidden_layers")
    r.set("num_heads", "num_attention_heads")
    r.set("num_kv_heads", "num_key_value_heads", default=r.fields["num_heads"], if_null=r.fields["num_heads"])
    r.set("ffn_size", "intermediate_size")
    r.set("norm_eps", "rms_norm_eps", default=1e-6)
    r.set("rotary_pct", "partial_rotary_factor", default=1.0)
    _head_dim(r, explicit=moe)
    _activation(r, "hidden_act", ("silu", "swish"), "silu", "SwiGLU with silu")
    if moe:
        _moe_rope(r)
    else:
        _rope(r, "rope_theta")
    _tie(r, default=False)
    r.drop("attention_dropout")
    r.value("pretraining_tp", default=1)  # Llama-2's sliced matmuls: the same products, informational


def _kv_width(r: _Reader) -> int:
    """Output width of the k and v projections together (2 x kv_heads x head_dim)."""
    width = r.fields.get("attention_head_dim") or r.fields["hidden_size"] // r.fields["num_heads"]
    return 2 * r.fields["num_kv_heads"] * width


def _llama(r: _Reader) -> None:
    _llama_like(r)
    r.set("max_seq_len", "max_position_embeddings", default=2048)
    h = r.fields["hidden_size"]
    if r.value("attention_bias", default=False) and _ints(r, "hidden_size", "num_heads", "num_kv_heads"):
        r.biases.append((h + _kv_width(r) + h, "q/k/v/o projections (attention_bias=true)"))
    if r.value("mlp_bias", default=False) and _ints(r, "hidden_size", "ffn_size"):
        r.biases.append((2 * r.fields["ffn_size"] + h, "MLP projections (mlp_bias=true)"))


def _mistral(r: _Reader) -> None:
    _llama_like(r)
    r.set("max_seq_len", "max_position_embeddings", default=4096 * 32)
    r.window = r.value("sliding_window", default=4096)  # MistralConfig's default; null: full attention


def _qwen2(r: _Reader) -> None:
    _llama_like(r)
    r.set("max_seq_len", "max_position_embeddings", default=32768)
    if _ints(r, "hidden_size", "num_heads", "num_kv_heads"):
        r.biases.append((r.fields["hidden_size"] + _kv_width(r), "q/k/v projections (Qwen2 always has them)"))
    window = r.value("sliding_window", default=4096)
    layer_types = r.value("layer_types", default=None) or ()
    r.value("max_window_layers", default=28)  # which layers slide: moot once max_seq_len <= the window
    if r.value("use_sliding_window", default=False) or "sliding_attention" in layer_types:
        r.window = window


def _gpt2(r: _Reader) -> None:
    r.fields.update(family="gpt3", rotary_pct=0.0)
    r.set("vocab_size", "vocab_size")
    h = r.set("hidden_size", "n_embd", "hidden_size")
    r.set("num_layers", "n_layer", "num_hidden_layers")
    r.set("num_heads", "n_head", "num_attention_heads")
    r.fields["num_kv_heads"], r.origin["num_kv_heads"] = r.fields["num_heads"], r.origin["num_heads"]
    r.set("ffn_size", "n_inner", default=None, if_null=4 * h if isinstance(h, int) else None)
    r.set("max_seq_len", "n_positions", "max_position_embeddings", default=1024)
    r.value("n_ctx", default=None)  # the legacy alias of n_positions
    r.set("norm_eps", "layer_norm_epsilon", default=1e-5)
    _activation(r, "activation_function", _GELUS, "gelu_new", "GELU")
    r.require("scale_attn_weights", (True,), True, "unscaled attention scores are not in the zoo",
              "the zoo scales scores by 1/sqrt(head_dim); set it to true or write a ModelConfig JSON")
    r.require("scale_attn_by_inverse_layer_idx", (False,), False, "per-layer score scaling is not in the zoo",
              "set it to false to plan the model without it")
    r.require("add_cross_attention", (False,), False, "cross-attention layers are not in the zoo",
              "plan the decoder-only model (set it to false)")
    r.value("reorder_and_upcast_attn", default=False)  # fp32 scores: the zoo's softmax is fp32 anyway
    for key in ("summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
                "summary_first_dropout"):  # GPT2DoubleHeadsModel's classifier: not part of the LM
        r.value(key, default=None)
    _tie(r, default=True)
    r.drop("resid_pdrop", "embd_pdrop", "attn_pdrop", default=0.1)
    if _ints(r, "hidden_size", "ffn_size"):
        r.biases.append((3 * h + h + r.fields["ffn_size"] + h, "qkv, attention output and MLP projections"))


def _gpt_neox(r: _Reader) -> None:
    r.fields["family"] = "falcon"
    r.set("vocab_size", "vocab_size")
    h = r.set("hidden_size", "hidden_size")
    r.set("num_layers", "num_hidden_layers")
    r.set("num_heads", "num_attention_heads")
    r.fields["num_kv_heads"], r.origin["num_kv_heads"] = r.fields["num_heads"], r.origin["num_heads"]
    r.set("ffn_size", "intermediate_size")
    r.set("max_seq_len", "max_position_embeddings", default=2048)
    r.set("norm_eps", "layer_norm_eps", default=1e-5)
    r.set("rotary_pct", "rotary_pct", "partial_rotary_factor", default=0.25)
    _activation(r, "hidden_act", _GELUS, "gelu", "GELU")
    _rope(r, "rotary_emb_base", "rope_theta")
    _tie(r, default=False)
    r.drop("attention_dropout", "hidden_dropout")
    r.value("classifier_dropout", default=None)  # GPTNeoXForSequenceClassification's head only
    r.require("use_parallel_residual", (True,), True,
              "a sequential LayerNorm/GELU block with rotary positions is not in the zoo (gpt3 has learned "
              "positions, llama RMSNorm and SwiGLU)", "write a models.ModelConfig JSON for the nearest family")
    if isinstance(h, int):
        r.norm_gap = (2 * h, "use_parallel_residual=true has two LayerNorms per block (before attention and "
                             "before the MLP); the zoo's falcon block shares one")
        attention = 4 * h if r.value("attention_bias", default=True) else 0
        if _ints(r, "ffn_size"):
            r.biases.append((attention + r.fields["ffn_size"] + h, "qkv, attention output and MLP projections"))


def _falcon(r: _Reader) -> None:
    r.fields.update(family="falcon", rotary_pct=1.0)
    r.set("vocab_size", "vocab_size")
    h = r.set("hidden_size", "hidden_size")
    r.set("num_layers", "num_hidden_layers", "n_layer")
    heads = r.set("num_heads", "num_attention_heads", "n_head")
    r.set("max_seq_len", "max_position_embeddings", default=2048)
    r.set("norm_eps", "layer_norm_epsilon", default=1e-5)
    r.set("ffn_size", "ffn_hidden_size", default=None, if_null=4 * h if isinstance(h, int) else None)
    _activation(r, "activation", _GELUS, "gelu", "GELU")
    r.require("alibi", (False,), False, "ALiBi attention biases are not in the zoo (it uses RoPE)",
              "no zoo family has ALiBi; plan a RoPE model instead")
    r.require("parallel_attn", (True,), True, "a sequential LayerNorm/GELU block with rotary positions is not "
              "in the zoo", "write a models.ModelConfig JSON for the nearest family")
    r.require("apply_residual_connection_post_layernorm", (False,), False,
              "the zoo adds the residual before the norm", "no zoo family takes the residual after the norm")
    # Transformers' rule: the original (not new) architecture with multi_query has one kv head.
    new_arch = r.value("new_decoder_architecture", default=False)
    if r.value("multi_query", default=True) and not new_arch:
        r.value("num_kv_heads", "n_head_kv", default=None)
        r.fields["num_kv_heads"], r.origin["num_kv_heads"] = 1, "multi_query"
    else:
        r.set("num_kv_heads", "num_kv_heads", "n_head_kv", default=heads, if_null=heads)
    norms = r.value("num_ln_in_parallel_attn", default=None)
    if new_arch and norms in (None, 2) and isinstance(h, int):
        r.norm_gap = (2 * h, "new_decoder_architecture=true has two LayerNorms per block (ln_attn, ln_mlp); "
                             "the zoo's falcon block shares one")
    _rope(r, "rope_theta")
    _tie(r, default=True)
    r.drop("attention_dropout", "hidden_dropout")
    if r.value("bias", default=False) and _ints(r, "hidden_size", "num_heads", "num_kv_heads", "ffn_size"):
        r.biases.append((h + _kv_width(r) + h + r.fields["ffn_size"] + h,
                         "qkv, attention output and MLP projections (bias=true)"))


# ------------------------------------------------------------------------------------------ MoE families
def _moe_rope(r: _Reader) -> None:
    """`_rope`, except that YaRN scaling (DeepSeek-V3, gpt-oss) is priced as unscaled RoPE with a warning: it
    changes the rotary frequencies only, not the FLOPs or the bytes."""
    scaling = r.value("rope_scaling", default=None)
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else None
    if kind != "yarn":
        _rope(r, "rope_theta")
        return
    r.fields["rope_base"], r.origin["rope_base"] = r.value("rope_theta", default=DEFAULT_ROPE_BASE), "rope_theta"
    r.fields["rope_scaling"], r.origin["rope_scaling"] = (), "rope_scaling"
    r.notes.append("rope_scaling yarn is not implemented: RoPE unscaled (the same cost; training on long "
                   "sequences would differ from the checkpoint)")


def _moe_config(r: _Reader, key: str, **fields: Any) -> None:
    """``ModelConfig.moe`` from the mapped fields; an invalid value is told with the HF field ``key``."""
    try:
        r.fields["moe"], r.origin["moe"] = MoEConfig(**fields), key
    except ValueError as e:
        raise HFConfigError(f"{r.source}: {e} (from the config's MoE fields, e.g. {key})") from e


def _dense_first(r: _Reader, step: int) -> int:
    """Qwen-MoE's ``mlp_only_layers`` as the zoo's dense-first layers (a leading run of layers, or nothing)."""
    dense = list(r.value("mlp_only_layers", default=[]) or [])
    if dense != list(range(len(dense))) or (dense and len(dense) % step):
        raise r.error("mlp_only_layers", f"the zoo places dense layers first only (then one MoE layer every "
                      f"decoder_sparse_step={step})", "use a leading run of layers 0..k-1 (k a multiple of the step)")
    return len(dense)


def _mixtral(r: _Reader) -> None:
    _llama_like(r, moe=True)
    r.set("max_seq_len", "max_position_embeddings", default=4096 * 32)
    r.window = r.value("sliding_window", default=None)
    if r.value("router_jitter_noise", default=0.0):
        r.notes.append(f"router_jitter_noise={r.doc['router_jitter_noise']}: no router noise in the zoo")
    r.value("output_router_logits", default=False)
    _moe_config(r, "num_local_experts", num_experts=r.value("num_local_experts", default=8),
                top_k=r.value("num_experts_per_tok", default=2), expert_ffn_size=r.fields["ffn_size"],
                aux_loss_coef=r.value("router_aux_loss_coef", default=0.001))


def _qwen_moe(r: _Reader, shared: bool) -> None:
    """Qwen2-MoE (a gated shared expert, q/k/v biases) and Qwen3-MoE (q/k norms, no shared expert)."""
    _llama_like(r, moe=True)
    r.set("max_seq_len", "max_position_embeddings", default=32768)
    window = r.value("sliding_window", default=4096)
    r.value("max_window_layers", default=28)
    if r.value("use_sliding_window", default=False):
        r.window = window
    step = r.value("decoder_sparse_step", default=1)
    shared_ffn = r.value("shared_expert_intermediate_size", default=0) if shared else 0
    r.value("output_router_logits", default=False)
    _moe_config(r, "num_experts", num_experts=r.value("num_experts", default=60 if shared else 128),
                top_k=r.value("num_experts_per_tok", default=4 if shared else 8),
                expert_ffn_size=r.value("moe_intermediate_size", default=1408 if shared else 768),
                normalize=r.value("norm_topk_prob", default=not shared), shared_ffn_size=shared_ffn,
                aux_loss_coef=r.value("router_aux_loss_coef", default=0.001), layer_freq=step,
                first_dense_layers=_dense_first(r, step if isinstance(step, int) and step > 0 else 1))
    h = r.fields["hidden_size"]
    if shared and shared_ffn and isinstance(h, int):
        r.notes.append(f"the shared expert's sigmoid gate ({h:,} parameters per MoE layer) is not in the zoo: the "
                       "shared expert's output is added ungated")
    if shared and _ints(r, "hidden_size", "num_heads", "num_kv_heads"):
        r.biases.append((r.fields["num_heads"] * (r.fields.get("attention_head_dim") or h // r.fields["num_heads"])
                         + _kv_width(r), "q/k/v projections (Qwen2-MoE always has them)"))
    if not shared:
        if r.value("attention_bias", default=False):
            r.notes.append("attention_bias=true: the q/k/v/o biases are not in the zoo")
        r.notes.append("Qwen3-MoE's per-head q / k RMSNorms are not in the zoo (2 x head_dim parameters per layer)")


def _qwen2_moe(r: _Reader) -> None:
    _qwen_moe(r, shared=True)


def _qwen3_moe(r: _Reader) -> None:
    _qwen_moe(r, shared=False)


def _mla(r: _Reader) -> None:
    """DeepSeek's multi-head latent attention (`models.mla`): the head width is the query / key width."""
    try:
        mla = MLAConfig(kv_rank=r.value("kv_lora_rank", default=512), q_rank=r.value("q_lora_rank", default=1536),
                        nope_dim=r.value("qk_nope_head_dim", default=128),
                        rope_dim=r.value("qk_rope_head_dim", default=64), v_dim=r.value("v_head_dim", default=128))
    except ValueError as e:
        raise HFConfigError(f"{r.source}: {e} (from kv_lora_rank / q_lora_rank / qk_*_head_dim / v_head_dim)") from e
    r.fields["mla"], r.origin["mla"] = mla, "kv_lora_rank"
    r.fields["attention_head_dim"], r.origin["attention_head_dim"] = mla.qk_dim, "qk_nope_head_dim"
    r.fields["rotary_pct"], r.origin["rotary_pct"] = mla.rope_dim / mla.qk_dim, "qk_rope_head_dim"
    r.fields["num_kv_heads"] = r.fields["num_heads"]  # MLA's keys and values are per head (no GQA grouping)


def _deepseek_v3(r: _Reader) -> None:
    _llama_like(r, moe=True)
    r.set("max_seq_len", "max_position_embeddings", default=4096)
    _mla(r)
    method = r.value("topk_method", default="noaux_tc")
    groups, top_groups = r.value("n_group", default=1) or 1, r.value("topk_group", default=1) or 1
    if method == "group_limited_greedy":  # DeepSeek-V2 scores a group by its best expert, V3 by its two best
        r.notes.append("topk_method='group_limited_greedy' scores a group by its best expert; the zoo by its two "
                       "best (DeepSeek-V3's rule): the same cost, the choices may differ")
    freq = r.value("moe_layer_freq", default=1)
    if freq != 1:
        raise r.error("moe_layer_freq", "DeepSeek's pattern (layer i is MoE when i % freq == 0) differs from the "
                      "zoo's (the last layer of each period)", "set it to 1 or write a models.ModelConfig JSON")
    if r.value("num_nextn_predict_layers", default=0):
        r.notes.append("the multi-token-prediction layers (num_nextn_predict_layers) are not in the zoo")
    if r.value("seq_aux", default=True) and r.value("aux_loss_alpha", default=0.001):
        r.notes.append("the sequence-wise balancing loss (seq_aux) is computed over the global batch in the zoo")
    r.value("ep_size", default=1)  # the checkpoint's expert-parallel degree: a runtime setting, not the model
    r.value("rope_interleave", default=True)  # the rotary pairing: the same cost
    ffn = r.value("moe_intermediate_size", default=2048)
    _moe_config(r, "n_routed_experts", num_experts=r.value("n_routed_experts", default=256),
                top_k=r.value("num_experts_per_tok", default=8), expert_ffn_size=ffn,
                scoring=r.value("scoring_func", default="sigmoid"), normalize=r.value("norm_topk_prob", default=True),
                routed_scale=r.value("routed_scaling_factor", default=2.5), expert_bias=method == "noaux_tc",
                aux_loss_coef=r.value("aux_loss_alpha", default=0.001),
                shared_ffn_size=(r.value("n_shared_experts", default=1) or 0) * ffn,
                first_dense_layers=r.value("first_k_dense_replace", default=3), num_groups=groups,
                top_groups=top_groups)


def _gpt_oss(r: _Reader) -> None:
    _llama_like(r, moe=True)
    r.set("max_seq_len", "max_position_embeddings", default=131072)
    r.value("initial_context_length", default=4096)  # the pre-YaRN context: see the rope note
    r.value("output_router_logits", default=False)
    window = r.value("sliding_window", default=128)
    if "sliding_attention" in (r.value("layer_types", default=None) or ()):
        r.notes.append(f"the sliding-window layers (window {window}) run full causal attention in the zoo: their "
                       "attention is priced at the full sequence")
    experts = r.value("num_local_experts", default=128)
    top_k = r.value("num_experts_per_tok", "experts_per_token", default=4)
    ffn = r.fields["ffn_size"]
    if isinstance(experts, int) and isinstance(ffn, int) and _ints(r, "hidden_size", "num_heads"):
        h, n = r.fields["hidden_size"], r.fields["num_heads"]
        r.notes.append(f"gpt-oss's expert and router biases ({experts * (2 * ffn + h + 1):,} parameters per layer) "
                       f"and attention sinks ({n} per layer) are not in the zoo")
    if r.value("attention_bias", default=True):
        r.notes.append("attention_bias=true: the q/k/v/o biases are not in the zoo")
    _moe_config(r, "num_local_experts", num_experts=experts, top_k=top_k, expert_ffn_size=ffn,
                aux_loss_coef=r.value("router_aux_loss_coef", default=0.9),
                swiglu_limit=r.value("swiglu_limit", default=7.0))


_MAPPERS: dict[str, Callable[[_Reader], None]] = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2,
                                                  "gpt2": _gpt2, "gpt_neox": _gpt_neox, "falcon": _falcon,
                                                  "mixtral": _mixtral, "qwen2_moe": _qwen2_moe,
                                                  "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3,
                                                  "gpt_oss": _gpt_oss}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_MAPPERS)


# ------------------------------------------------------------------------------------------ entry point
def from_hf_config(config: Mapping[str, Any] | str | os.PathLike, *, name: str | None = None,
                   dtype: str | None = None, param_dtype: str | None = None) -> ModelConfig:
    """The zoo `ModelConfig` of a Hugging Face causal-LM ``config.json``.

    Args:
        config: the parsed config, or the path of a ``config.json``.
        name: the config's name (default: the last part of ``_name_or_path``, the folder of a
            ``config.json``, or the model_type).
        dtype: compute dtype (default: ``torch_dtype`` when it is 16-bit, else float32).
        param_dtype: weight storage dtype (default: float32, the master weights of mixed precision).

    Returns:
        A validated `ModelConfig` (``family``, sizes, ``tie_embeddings``, ``rope_base``, ``rope_scaling``).

    Raises:
        HFConfigError: the file cannot be read, the model_type is not supported, a field is missing, or a
            field's value changes the model in a way the zoo cannot compute; the message names the field,
            its value and what to do.

    Warns:
        HFConfigWarning: what the zoo model lacks and the plan therefore prices without (linear biases, the
            second norm of a parallel block, dropout), a sliding window replaced by a shorter
            ``max_seq_len``, and fields the mapping does not know.
    """
    doc, default_name = _load(config)
    model_type = _model_type(doc)
    r = _Reader(doc, model_type)
    _MAPPERS[model_type](r)
    _apply_window(r)
    _dtypes(r, dtype, param_dtype)
    cfg = _build(r, name or _name(doc, default_name, model_type))
    _warn(r, cfg)
    return cfg


def _load(config: Mapping[str, Any] | str | os.PathLike) -> tuple[Mapping[str, Any], str | None]:
    if isinstance(config, Mapping):
        return config, None
    path = Path(config)
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise HFConfigError(f"cannot read Hugging Face config {str(path)!r}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise HFConfigError(f"Hugging Face config {str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise HFConfigError(f"Hugging Face config {str(path)!r} holds a JSON {type(doc).__name__}, not an object")
    return doc, path.parent.name if path.stem == "config" and path.parent.name else path.stem


def _model_type(doc: Mapping[str, Any]) -> str:
    """``model_type``, else the first known entry of ``architectures``."""
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    model_type = doc.get("model_type")
    if model_type is not None:
        model_type = _MODEL_TYPE_ALIASES.get(model_type, model_type)
        if model_type not in _MAPPERS:
            raise HFConfigError(f"Hugging Face model_type {model_type!r} is not supported; supported model types: "
                                f"{supported} (for another architecture write a models.ModelConfig JSON)")
        return model_type
    architectures = doc.get("architectures") or []
    for arch in architectures:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise HFConfigError(f"Hugging Face config has no model_type and no supported architectures entry "
                        f"(architectures={architectures!r}); supported model types: {supported}")


def _name(doc: Mapping[str, Any], default_name: str | None, model_type: str) -> str:
    path = str(doc.get("_name_or_path") or "").rstrip("/")
    return path.rsplit("/", 1)[-1] if path else default_name or model_type


def _apply_window(r: _Reader) -> None:
    """A sliding window the zoo cannot compute: causal attention equals it on sequences up to the window."""
    if r.window is None:
        return
    if isinstance(r.window, bool) or not isinstance(r.window, int) or r.window <= 0:
        raise r.error("sliding_window", "must be a positive integer or null", "fix the value")
    if isinstance(r.fields["max_seq_len"], int) and r.window < r.fields["max_seq_len"]:
        r.fields["max_seq_len"], r.origin["max_seq_len"] = r.window, "sliding_window"
    else:
        r.window = None  # no sequence the model accepts is longer than the window: nothing changes


def _dtypes(r: _Reader, dtype: str | None, param_dtype: str | None) -> None:
    """Compute in a 16-bit ``torch_dtype`` with float32 master weights, as mixed-precision training does."""
    saved = r.value("torch_dtype", "dtype", default=None)
    if dtype is None:
        dtype = saved if saved in ("bfloat16", "float16") else "float32"
        if saved not in (None, "auto", *DTYPES):
            r.notes.append(f"torch_dtype={saved!r} is not a zoo dtype ({', '.join(DTYPES)}); computing in float32 "
                           "(pass dtype=... or --dtype)")
    r.fields["dtype"], r.fields["param_dtype"] = dtype, param_dtype or "float32"


_FIELD_OF_ERROR = re.compile(r"^ModelConfig\(.*?\)\.(\w+): (.*)$", re.DOTALL)


def _build(r: _Reader, name: str) -> ModelConfig:
    """`ModelConfig` of the mapped fields; its field-named errors are told in the HF config's terms."""
    try:
        return ModelConfig(name=name, **r.fields)
    except ValueError as e:
        match = _FIELD_OF_ERROR.match(str(e))
        if match is None:
            raise HFConfigError(f"{r.source}: {e}") from e
        field, why = match.groups()
        key = r.origin.get(field)
        given = f"{key}={r.doc.get(key)!r}" if key in r.doc else f"{key} (default)" if key else "the mapping"
        raise HFConfigError(f"{r.source}: {given} maps to ModelConfig.{field}, which is invalid: {why}") from e


def _share(count: int, cfg: ModelConfig) -> str:
    return f"{count:,} parameters, {count / (cfg.num_params() + count):.3%} of the model"


def _warn(r: _Reader, cfg: ModelConfig) -> None:
    """The `HFConfigWarning`s: one line per thing the zoo model prices differently."""
    notes = list(r.notes)
    if r.biases:
        count = cfg.num_layers * sum(n for n, _ in r.biases)
        what = "; ".join(w for _, w in r.biases)
        notes.append(f"the linear layers' biases ({what}) are not in the zoo: {_share(count, cfg)}, priced "
                     "without them")
    if r.norm_gap is not None:
        count = cfg.num_layers * r.norm_gap[0]
        notes.append(f"{r.norm_gap[1]}: mapped to the zoo's falcon family with one LayerNorm less per layer "
                     f"({_share(count, cfg)}, priced without it)")
    if r.window is not None:
        notes.append(f"sliding_window={r.window}: sliding-window attention is not implemented, so max_seq_len is "
                     f"capped at the window ({cfg.max_seq_len}, where causal attention computes the same) and "
                     "longer sequences are refused")
    if r.dropout:
        shown = ", ".join(f"{k}={v}" for k, v in r.dropout.items())
        notes.append(f"dropout ({shown}) is not in the zoo: priced without its masks")
    unknown = sorted(set(r.doc) - r.read - _INFORMATIONAL)
    if unknown:
        notes.append(f"fields not known to the mapping, not checked: {', '.join(unknown)}; if one changes the "
                     "architecture the plan does not reflect it")
    for note in notes:
        warnings.warn(f"{r.source}: {note}", HFConfigWarning, stacklevel=3)


__all__ = ["SUPPORTED_MODEL_TYPES", "HFConfigError", "HFConfigWarning", "from_hf_config"]
