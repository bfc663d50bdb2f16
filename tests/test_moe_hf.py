"""Hugging Face configs of the MoE families (issue #51, item 1): Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 (MLA
priced as GQA, said in a warning) and gpt-oss (its approximations warned), mapped onto `models.moe`."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import models
from models import HFConfigError, HFConfigWarning, from_hf_config

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
    "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936, "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
    "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False, "router_aux_loss_coef": 0.001}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088}


def mapped(doc: dict, **kwargs) -> tuple[models.ModelConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = from_hf_config(doc, **kwargs)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, HFConfigWarning)]


def _same_model(cfg: models.ModelConfig, preset: str) -> None:
    want = models.get_config(preset)
    fields = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "moe")
    assert {f: getattr(cfg, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert cfg.num_params() == want.num_params()


def test_mixtral_maps_onto_the_preset_without_warnings():
    cfg, notes = mapped(MIXTRAL_8X7B)
    _same_model(cfg, "mixtral-8x7b")
    assert notes == [] and cfg.num_params() == 46_702_792_704  # the checkpoint's count
    assert models.get_config("mixtral-8x7b").moe.aux_loss_coef == cfg.moe.aux_loss_coef == 0.02
    assert from_hf_config({k: v for k, v in MIXTRAL_8X7B.items() if k != "model_type"}).moe is not None


def test_qwen3_moe_keeps_head_dim_128_and_warns_the_qk_norms():
    cfg, notes = mapped(QWEN3_30B_A3B)
    _same_model(cfg, "qwen3-30b-a3b")
    assert cfg.attention_head_dim == 128 and cfg.head_dim == 128 and cfg.moe.normalize
    # the checkpoint's 30,532,122,624 parameters less its 48 x 2 x 128 q / k norm scales
    assert cfg.num_params() + 48 * 2 * 128 == 30_532_122_624
    assert len(notes) == 1 and "q / k RMSNorms" in notes[0]


def test_qwen2_moe_shared_expert_unnormalised_top_k_and_dense_first_layers():
    cfg, notes = mapped(QWEN15_MOE_A27B)
    assert cfg.moe.shared_ffn_size == 5632 and not cfg.moe.normalize and cfg.moe.num_experts == 60
    assert any("sigmoid gate" in n for n in notes) and any("q/k/v projections" in n for n in notes)
    assert cfg.num_params() == pytest.approx(14.3e9, rel=0.01)  # Qwen1.5-MoE-A2.7B: 14.3B
    dense, _ = mapped({**QWEN15_MOE_A27B, "mlp_only_layers": [0, 1], "decoder_sparse_step": 2})
    assert dense.moe.first_dense_layers == 2 and dense.moe.layer_freq == 2
    with pytest.raises(HFConfigError, match=r"mlp_only_layers=\[3\]: the zoo places dense layers first only"):
        from_hf_config({**QWEN15_MOE_A27B, "mlp_only_layers": [3]})


def test_deepseek_v3_maps_to_mla_and_671b():
    cfg, notes = mapped(DEEPSEEK_V3)
    _same_model(cfg, "deepseek-v3")
    assert cfg.mla == models.get_config("deepseek-v3").mla and cfg.mla.kv_rank == 512 and cfg.mla.q_rank == 1536
    assert cfg.num_params() == 671_026_404_352  # DeepSeek-V3's 671B without its multi-token-prediction module
    moe = cfg.moe
    assert (moe.scoring, moe.routed_scale, moe.expert_bias, moe.first_dense_layers) == ("sigmoid", 2.5, True, 3)
    assert moe.shared_ffn_size == 2048 and cfg.rotary_dims == 64
    text = " ".join(notes)
    for said in ("multi-token-prediction", "yarn"):
        assert said in text
    assert "MLA" not in text and "group" not in text
    assert (moe.num_groups, moe.top_groups) == (8, 4)
    with pytest.raises(HFConfigError, match="moe_layer_freq=2"):
        from_hf_config({**DEEPSEEK_V3, "moe_layer_freq": 2})


def test_gpt_oss_states_what_is_approximated():
    cfg, notes = mapped(GPT_OSS_120B)
    _same_model(cfg, "gpt-oss-120b")
    assert cfg.max_seq_len == 131072  # half the layers attend fully: no cap at the window
    text = " ".join(notes)
    for said in ("expert and router biases", "attention sinks", "sliding-window layers", "attention_bias=true",
                 "yarn"):
        assert said in text
    assert cfg.moe.swiglu_limit == 7.0 and "SwiGLU" not in text
    assert cfg.num_params() == pytest.approx(116.83e9, rel=2e-3)  # OpenAI's model card: 116.83B


def test_bad_moe_fields_name_the_field():
    with pytest.raises(HFConfigError, match="MoEConfig.top_k: 9 exceeds num_experts=8.*num_local_experts"):
        from_hf_config({**MIXTRAL_8X7B, "num_experts_per_tok": 9})
    with pytest.raises(HFConfigError, match="MoEConfig.scoring"):
        from_hf_config({**DEEPSEEK_V3, "scoring_func": "sinkhorn"})


@pytest.mark.parametrize("doc", [MIXTRAL_8X7B, QWEN3_30B_A3B, QWEN15_MOE_A27B, DEEPSEEK_V3, GPT_OSS_120B],
                         ids=["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_tiny_versions_build_and_run(doc):
    tiny = {**doc, "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 256, "intermediate_size": 64,
            "moe_intermediate_size": 32, "max_position_embeddings": 64, "shared_expert_intermediate_size": 32,
            "num_attention_heads": 8, "num_key_value_heads": 4}
    for key, value in (("num_local_experts", 8), ("num_experts", 8), ("n_routed_experts", 8), ("head_dim", 16),
                       ("v_head_dim", 16), ("qk_rope_head_dim", 8), ("qk_nope_head_dim", 16), ("kv_lora_rank", 16),
                       ("q_lora_rank", 24), ("first_k_dense_replace", 1), ("n_group", 4), ("topk_group", 2),
                       ("num_experts_per_tok", 2), ("experts_per_token", 2)):
        if key in doc:
            tiny[key] = value
    cfg, _ = mapped(tiny, dtype="float32")
    model = models.build(cfg, rngs=nnx.Rngs(0))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == cfg.num_params()
    logits = model(jax.random.randint(jax.random.key(1), (2, 16), 0, 256))
    assert logits.shape == (2, 16, 256) and bool(jnp.all(jnp.isfinite(logits)))


def test_cli_plan_of_an_moe_hf_config_stops_naming_moe(tmp_path, capsys):
    import json

    from mistjax.cli import main

    path = tmp_path / "Mixtral-8x7B-v0.1" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(MIXTRAL_8X7B))
    code = main(["plan", "--model", str(path), "--cluster", "dgx-h100:4x8", "--seq-len", "4096",
                 "--global-batch", "256", "--no-verify"])
    err = capsys.readouterr().err
    assert code != 0 and "Mixtral-8x7B-v0.1 has Mixture-of-Experts layers" in err and "Traceback" not in err
