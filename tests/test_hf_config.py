"""Hugging Face config.json -> ModelConfig (models.hf), tied embeddings and RoPE settings in the zoo, and
`mistjax plan --model config.json`. Field values are those of the public checkpoints' configs."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from mistjax.cli import main
from mistjax.core.jaxpr import scan_counts
from models import HFConfigError, HFConfigWarning, from_hf_config
from models.layers import rotary_frequencies
from models.loss import make_loss_fn

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
LLAMA31_8B = {**LLAMA3_8B, "max_position_embeddings": 131072, "mlp_bias": False, "rope_scaling": LLAMA31_ROPE}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}
QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 131072, "max_window_layers": 24, "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
GPT2 = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new", "attn_pdrop": 0.1,
    "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
    "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
    "summary_type": "cls_index", "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}, "vocab_size": 50257,
}
PYTHIA_160M = {
    "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "bos_token_id": 0, "eos_token_id": 0,
    "hidden_act": "gelu", "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072,
    "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "num_attention_heads": 12, "num_hidden_layers": 12,
    "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.24.0", "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304,
}
FALCON_7B = {
    "architectures": ["FalconForCausalLM"], "model_type": "falcon", "alibi": False,
    "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0, "bias": False, "bos_token_id": 11,
    "eos_token_id": 11, "hidden_dropout": 0.0, "hidden_size": 4544, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "multi_query": True, "new_decoder_architecture": False, "num_attention_heads": 71,
    "num_hidden_layers": 32, "parallel_attn": True, "torch_dtype": "bfloat16", "transformers_version": "4.27.4",
    "use_cache": True, "vocab_size": 65024,
}
# Test-sized configs of every model type (8 heads of 8 dims, 4 layers, vocab 256).
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128,
              "rope_theta": 500000.0, "tie_word_embeddings": True,
              "rope_scaling": {**LLAMA31_ROPE, "original_max_position_embeddings": 32}}
TINY = {
    "llama": TINY_LLAMA,
    "mistral": {**TINY_LLAMA, "model_type": "mistral", "sliding_window": 64, "rope_scaling": None},
    "qwen2": {**TINY_LLAMA, "model_type": "qwen2", "use_sliding_window": False, "rope_scaling": None},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 8, "n_positions": 128, "vocab_size": 256},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
                 "intermediate_size": 256, "vocab_size": 256, "max_position_embeddings": 128, "rotary_pct": 0.25},
    "falcon": {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
               "vocab_size": 256, "multi_query": True},
}


def mapped(doc: dict, **kwargs) -> tuple[models.ModelConfig, list[str]]:
    """The mapped config and the messages of the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = from_hf_config(doc, **kwargs)
    assert all(issubclass(w.category, HFConfigWarning) for w in caught), [str(w.message) for w in caught]
    return cfg, [str(w.message) for w in caught]


def llama3_reference(inv_freq: np.ndarray, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """Llama 3.1's frequency rule written piecewise (keep short wavelengths, stretch long ones, blend between)."""
    out = []
    for f in inv_freq:
        wavelength = 2 * math.pi / f
        if wavelength < original / high:
            out.append(f)
        elif wavelength > original / low:
            out.append(f / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


# ------------------------------------------------------------------------------------------ published models
def test_llama3_8b_maps_every_field_and_counts_8_03b_parameters():
    cfg, notes = mapped(LLAMA3_8B)
    assert notes == []  # every field is known, nothing is priced differently
    assert (cfg.family, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_size,
            cfg.vocab_size, cfg.max_seq_len) == ("llama", 4096, 32, 32, 8, 14336, 128256, 8192)
    assert (cfg.rotary_pct, cfg.rope_base, cfg.rope_scaling, cfg.norm_eps) == (1.0, 500000.0, (), 1e-5)
    assert not cfg.tie_embeddings
    assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")  # bf16 compute, fp32 master weights
    assert cfg.num_params() == 8_030_261_248  # the published 8.03B
    assert from_hf_config(LLAMA3_8B, dtype="float32", name="l3").name == "l3"


def test_llama31_rope_scaling_is_kept_and_only_changes_the_frequencies():
    cfg, notes = mapped(LLAMA31_8B)
    assert notes == [] and cfg.max_seq_len == 131072
    assert cfg.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 8192)
    assert cfg.num_params() == from_hf_config(LLAMA3_8B).num_params()
    plain = np.asarray(rotary_frequencies(128, 500000.0))
    scaled = np.asarray(rotary_frequencies(128, 500000.0, cfg.rope_scaling))
    np.testing.assert_allclose(scaled, llama3_reference(plain, 8.0, 1.0, 4.0, 8192), rtol=1e-6)
    assert scaled[0] == plain[0] and scaled[-1] == pytest.approx(plain[-1] / 8)  # kept / stretched ends
    linear, _ = mapped({**LLAMA3_8B, "rope_scaling": {"type": "linear", "factor": 4.0}})
    np.testing.assert_allclose(rotary_frequencies(128, 500000.0, linear.rope_scaling), plain / 4, rtol=1e-6)


def test_mistral_sliding_window_caps_max_seq_len_with_a_warning():
    cfg, notes = mapped(MISTRAL_7B)
    assert cfg.max_seq_len == 4096 and cfg.num_params() == 7_241_732_096  # the published 7.24B
    assert len(notes) == 1
    assert re.search(r"sliding_window=4096: sliding-window attention is not implemented, so max_seq_len is capped "
                     r"at the window \(4096.*longer sequences are refused", notes[0])
    v02, notes = mapped({**MISTRAL_7B, "sliding_window": None})  # Mistral-7B-v0.2: full attention
    assert v02.max_seq_len == 32768 and notes == []


def test_qwen2_ties_embeddings_and_warns_its_qkv_biases():
    cfg, notes = mapped(QWEN2_05B)
    assert cfg.tie_embeddings and (cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size) == (14, 2, 896)
    assert cfg.head_params() == 896  # the final norm only: the head is the embedding
    biases = 24 * (896 + 2 * 2 * 64)
    assert cfg.num_params() + biases == 494_032_768  # the published Qwen2-0.5B count
    assert len(notes) == 1 and f"{biases:,} parameters, 0.006% of the model" in notes[0]
    assert cfg.max_seq_len == 131072  # use_sliding_window false: no window
    windowed, notes = mapped({**QWEN2_05B, "use_sliding_window": True, "sliding_window": 4096})
    assert windowed.max_seq_len == 4096 and any("sliding_window=4096" in n for n in notes)


def test_gpt2_small_is_124m_with_its_biases():
    cfg, notes = mapped(GPT2)
    assert (cfg.family, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.ffn_size, cfg.max_seq_len,
            cfg.vocab_size, cfg.rotary_pct) == ("gpt3", 768, 12, 12, 3072, 1024, 50257, 0.0)
    assert cfg.tie_embeddings and cfg.name == "gpt2"
    biases = 12 * 9 * 768  # qkv 3h + attention out h + MLP in 4h + out h per layer
    # The vocabulary (50257) is padded to 50304 (`ModelConfig.vocab_multiple`): the published figure has no pad rows.
    assert cfg.padded_vocab_size == 50304 and cfg.vocab_pad_params() == 47 * 768
    real = cfg.num_params() - cfg.vocab_pad_params()
    assert real == 124_356_864 and real + biases == 124_439_808  # GPT-2 small
    bias_note, dropout_note = notes
    assert "82,944 parameters, 0.067% of the model" in bias_note
    assert "resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1" in dropout_note
    with pytest.raises(HFConfigError, match="scale_attn_by_inverse_layer_idx=True"):
        from_hf_config({**GPT2, "scale_attn_by_inverse_layer_idx": True})


def test_gpt_neox_maps_to_the_falcon_block_and_warns_the_second_norm():
    cfg, notes = mapped(PYTHIA_160M)
    assert (cfg.family, cfg.rotary_pct, cfg.rotary_dims, cfg.num_kv_heads) == ("falcon", 0.25, 16, 12)
    assert not cfg.tie_embeddings and (cfg.dtype, cfg.param_dtype) == ("float16", "float32")
    biases, norms = 12 * (4 * 768 + 3072 + 768), 12 * 2 * 768
    assert cfg.num_params() + biases + norms == 162_322_944  # the published Pythia-160M count
    assert any(f"{norms:,} parameters" in n and "use_parallel_residual=true has two LayerNorms" in n for n in notes)
    with pytest.raises(HFConfigError, match=r"use_parallel_residual=False: a sequential LayerNorm/GELU block"):
        from_hf_config({**PYTHIA_160M, "use_parallel_residual": False})


def test_falcon_7b_multi_query_and_40b_new_architecture():
    cfg, notes = mapped(FALCON_7B)
    assert notes == []
    assert (cfg.family, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_size) == ("falcon", 71, 1, 64, 18176)
    assert cfg.tie_embeddings and cfg.rotary_pct == 1.0 and cfg.max_seq_len == 2048
    assert cfg.num_params() == 6_921_720_704  # Falcon-7B's 6.92B
    big, notes = mapped({**FALCON_7B, "hidden_size": 8192, "num_hidden_layers": 60, "num_attention_heads": 128,
                         "num_kv_heads": 8, "new_decoder_architecture": True})
    assert big.num_kv_heads == 8 and "new_decoder_architecture=true has two LayerNorms" in notes[0]
    with pytest.raises(HFConfigError, match="alibi=True: ALiBi attention biases are not in the zoo"):
        from_hf_config({**FALCON_7B, "alibi": True})


# ------------------------------------------------------------------------------------------ errors
def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(HFConfigError, match="model_type 'bert' is not supported; supported model types: llama, "
                                            "mistral, qwen2, gpt2, gpt_neox, falcon"):
        from_hf_config({"model_type": "bert", "hidden_size": 768})
    doc = {k: v for k, v in MISTRAL_7B.items() if k != "model_type"}  # architectures decides
    assert mapped(doc)[0].max_seq_len == 4096
    with pytest.raises(HFConfigError, match="no model_type and no supported architectures"):
        from_hf_config({"architectures": ["BertModel"]})


@pytest.mark.parametrize("changes,message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling=\{.*'yarn'.*\}: rope scaling 'yarn' is not implemented.*delete rope_scaling"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"llama3 scaling needs low_freq_factor"),
    ({"num_attention_heads": 30}, r"num_attention_heads=30 maps to ModelConfig.num_heads, which is invalid: 30 "
                                  r"does not divide hidden_size=4096"),
    ({"num_key_value_heads": 5}, r"num_key_value_heads=5 maps to ModelConfig.num_kv_heads"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu': the zoo's llama family computes SwiGLU with silu"),
    ({"head_dim": 64}, r"head_dim=64: differs from hidden_size / num_attention_heads = 128"),
    ({"intermediate_size": None}, r"intermediate_size=None maps to ModelConfig.ffn_size.*positive integer"),
    ({"rope_theta": -1.0}, r"rope_theta=-1.0 maps to ModelConfig.rope_base"),
    ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings='yes' maps to ModelConfig.tie_embeddings"),
])
def test_unmappable_values_name_the_hf_field(changes, message):
    with pytest.raises(HFConfigError, match=message):
        from_hf_config({**LLAMA3_8B, **changes})


def test_missing_and_contradicting_fields():
    doc = {k: v for k, v in LLAMA3_8B.items() if k != "intermediate_size"}
    with pytest.raises(HFConfigError, match="intermediate_size is missing"):
        from_hf_config(doc)
    with pytest.raises(HFConfigError, match="rotary_pct=0.25, partial_rotary_factor=0.5 disagree"):
        from_hf_config({**PYTHIA_160M, "partial_rotary_factor": 0.5})
    # Configs saved by recent Transformers repeat a setting under both names: equal values are fine.
    assert mapped({**PYTHIA_160M, "partial_rotary_factor": 0.25, "rope_theta": 10000.0})[0].rotary_pct == 0.25


def test_unknown_fields_and_dtypes_warn():
    cfg, notes = mapped({**LLAMA3_8B, "quantization_config": {"bits": 4}, "torch_dtype": "float64"})
    assert cfg.dtype == "float32"
    assert any("torch_dtype='float64' is not a zoo dtype" in n for n in notes)
    assert any("fields not known to the mapping, not checked: quantization_config" in n for n in notes)


def test_a_config_file_is_read_and_named_after_its_folder(hf_config_file):
    path = hf_config_file(LLAMA3_8B, folder="Meta-Llama-3-8B")
    assert from_hf_config(path).name == "Meta-Llama-3-8B"
    assert from_hf_config(str(path), name="x").name == "x"
    path.write_text("{")
    with pytest.raises(HFConfigError, match="is not valid JSON"):
        from_hf_config(path)
    with pytest.raises(HFConfigError, match="cannot read Hugging Face config"):
        from_hf_config(path.parent / "missing.json")


# ------------------------------------------------------------------------------------------ the zoo side
def test_rope_and_tie_fields_validate_and_survive_json():
    base = models.get_config("llama-tiny")
    for changes, field in (({"rope_scaling": ("yarn", 2.0)}, "rope_scaling"),
                           ({"rope_scaling": ("linear",)}, "rope_scaling"),
                           ({"rope_scaling": ("llama3", 8.0, 4.0, 1.0, 8192)}, "rope_scaling"),
                           ({"rotary_pct": 0.0, "rope_scaling": ("linear", 2.0)}, "rope_scaling"),  # no RoPE
                           ({"rope_base": 0.5}, "rope_base"), ({"tie_embeddings": 1}, "tie_embeddings")):
        with pytest.raises(ValueError, match=rf"\.{field}: "):
            base.replace(**changes)
    cfg = base.replace(tie_embeddings=True, rope_base=500000.0, rope_scaling=("llama3", 8.0, 1.0, 4.0, 32))
    again = models.ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))  # as --verify ships it
    assert again == cfg and hash(again) == hash(cfg)


@pytest.mark.parametrize("model_type", list(TINY))
def test_tiny_mapped_configs_build_and_run(model_type):
    cfg, _ = mapped(TINY[model_type], dtype="float32")
    model = models.build(cfg, rngs=nnx.Rngs(0))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == cfg.num_params()
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    logits = model(tokens)
    assert logits.shape == (2, 16, cfg.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))
    assert (model.lm_head is None) == cfg.tie_embeddings
    if cfg.tie_embeddings:  # the head is the embedding transposed
        hidden = jax.random.normal(jax.random.key(2), (2, 16, cfg.hidden_size))
        want = model.final_norm(hidden) @ model.embed.embedding[...].T
        np.testing.assert_allclose(model.compute_logits(hidden), want, rtol=1e-5, atol=1e-5)


def test_rope_settings_change_the_output_but_not_the_parameters():
    cfg, _ = mapped(TINY_LLAMA, dtype="float32")
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab_size)
    variants = {"scaled": cfg, "plain": cfg.replace(rope_scaling=()), "base": cfg.replace(rope_base=10000.0)}
    outs = {key: models.build(c, rngs=nnx.Rngs(0))(tokens) for key, c in variants.items()}
    assert not np.allclose(outs["scaled"], outs["plain"]) and not np.allclose(outs["plain"], outs["base"])


def test_scaled_rope_and_tied_head_keep_the_one_scan_structure():
    """The runtime splits the model at its layer scan: llama3 frequencies add no scan consts (they are traced,
    not host constants), and the tied head reads the embedding after the scan."""
    cfg, _ = mapped(TINY_LLAMA, dtype="float32")
    graphdef, params = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jnp.zeros((2, 16), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens).jaxpr
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert scan_counts(scan.params)[:2] == (0, 1) and scan.params["length"] == cfg.num_layers
    leaves = jax.tree_util.tree_leaves_with_path(params)
    table = next(v for (path, _), v in zip(leaves, jaxpr.invars) if path[0].key == "embed")
    after = jaxpr.eqns[jaxpr.eqns.index(scan) + 1:]
    assert any(table in e.invars for e in after)  # the head


def test_tied_embedding_gradient_sums_both_uses():
    """The fused head + cross-entropy with the transposed embedding gives the plain loss's gradients."""
    cfg, _ = mapped(TINY_LLAMA, dtype="float32")
    graphdef, params = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jax.random.randint(jax.random.key(3), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    fused = jax.jit(jax.grad(make_loss_fn(graphdef)))(params, batch)
    plain = jax.jit(jax.grad(make_loss_fn(graphdef, fused_head=False)))(params, batch)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


def test_tied_workload_prices_one_matrix_held_by_both_ends():
    # The config the CLI test plans (same name and dtypes): one analysis for both tests.
    cfg, _ = mapped(TINY["mistral"], name="tiny-mistral", dtype="float32")
    assert cfg.tie_embeddings
    wl = models.workload(cfg, 32, 16)
    assert sum(leaf.size for leaf in wl.leaves) == cfg.num_params()  # one vocab x embed matrix, not two
    table = [leaf for leaf in wl.leaves if leaf.shape == (cfg.vocab_size, cfg.hidden_size)]
    assert len(table) == 1 and table[0].parts == frozenset({"pre", "post"})  # first and last stage hold it
    assert not any(leaf.shape == (cfg.hidden_size, cfg.vocab_size) for leaf in wl.leaves)


# ------------------------------------------------------------------------------------------ the command line
PLAN_FLAGS = ["--cluster", "cpu:1x8", "--global-batch", "16", "--seq-len", "32", "--dtype", "float32",
              "--time-limit", "10", "--no-baselines", "--no-verify", "--progress", "off"]


def test_cli_plans_a_hugging_face_config(hf_config_file, capsys):
    path = hf_config_file(TINY["mistral"], folder="tiny-mistral")
    assert main(["plan", "--model", str(path), *PLAN_FLAGS]) == 0
    out, err = capsys.readouterr()
    assert "predicted:" in out
    warned = [line for line in err.splitlines() if "warning" in line]
    assert len(warned) == 1 and warned[0].startswith("mistjax plan: warning: Hugging Face config (model_type "
                                                     "'mistral'): sliding_window=64:")
    too_long = [flag if flag != "32" else "128" for flag in PLAN_FLAGS]  # --seq-len 128: beyond the window
    assert main(["plan", "--model", str(path), *too_long]) == 2
    assert "--seq-len 128 exceeds tiny-mistral's max_seq_len 64" in capsys.readouterr().err


def test_cli_model_file_errors_name_the_file_and_field(hf_config_file, tmp_path, capsys):
    bad = hf_config_file({**TINY_LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert main(["plan", "--model", str(bad), *PLAN_FLAGS]) == 2
    err = capsys.readouterr().err
    assert f"model config file '{bad}': Hugging Face config (model_type 'llama'): rope_scaling=" in err
    assert "Traceback" not in err
    zoo = tmp_path / "zoo.json"
    zoo.write_text(json.dumps({**dataclasses.asdict(models.get_config("llama-tiny")), "colour": "red"}))
    assert main(["plan", "--model", str(zoo), *PLAN_FLAGS]) == 2
    assert f"model config file '{zoo}': unknown field 'colour' of models.ModelConfig" in capsys.readouterr().err


@pytest.mark.slow
def test_llama3_8b_plans_on_a_dgx_h100_at_seq_8192(hf_config_file, capsys):
    path = hf_config_file(LLAMA3_8B, folder="Meta-Llama-3-8B")
    start = time.perf_counter()
    assert main(["plan", "--model", str(path), "--cluster", "dgx-h100:1x8", "--seq-len", "8192", "--global-batch",
                 "64", "--no-verify", "--progress", "off"]) == 0
    out = capsys.readouterr().out
    print(out, f"planned in {time.perf_counter() - start:.0f} s")
    assert "predicted:" in out and "tokens/s" in out
