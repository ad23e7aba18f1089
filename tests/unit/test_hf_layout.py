"""A GPT model converts to Hugging Face only when the ``transformers`` class its layout picks
expresses every option it sets: a squared-ReLU, q/k-normed (dense), partial-RoPE, windowed or
MTP model is refused naming the flag, a model with gpt-oss's activation or sinks goes to
GptOssForCausalLM (refused there naming what it lacks), instead of being written as a plain
GPT-2 / LLaMA with other math."""

from __future__ import annotations

import pytest

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.gpt.hf import hf_config, layout_of
from loom.models.gpt.hf_parts import PLAIN_LAYOUT

GPT2 = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=50)
LLAMA = dict(GPT2, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             disable_bias_linear=True)
MOE = dict(LLAMA, num_experts=4, moe_router_topk=2)
NEMOTRON = dict(GPT2, apply_layernorm_1p=True, squared_relu=True, position_embedding_type="rope",
                rotary_percent=0.5, disable_bias_linear=True)


def test_each_layout_is_picked():
    assert layout_of(ModelConfig(**GPT2)) == "gpt2"
    assert layout_of(ModelConfig(**LLAMA, openai_gelu=False)) == "llama"
    assert layout_of(ModelConfig(**LLAMA, add_qkv_bias=True)) == "qwen2"
    assert layout_of(ModelConfig(**LLAMA, qk_layernorm=True)) == "qwen3"
    assert layout_of(ModelConfig(**LLAMA, window_size="5,0")) == "mistral"
    assert layout_of(ModelConfig(**LLAMA, rotary_percent=0.5)) == "phi3"
    assert layout_of(ModelConfig(**MOE)) == "mixtral"
    assert layout_of(ModelConfig(**MOE, qk_layernorm=True)) == "qwen3_moe"
    assert layout_of(ModelConfig(**MOE, moe_shared_expert_intermediate_size=8)) == "qwen2_moe"
    assert layout_of(ModelConfig(**{**MOE, "quick_geglu": True, "swiglu": False})) == "gpt_oss"
    assert layout_of(ModelConfig(**NEMOTRON)) == "nemotron"
    assert layout_of(ModelConfig(**MOE, moe_router_score_function="sigmoid")) == "glm4_moe"
    mla = dict(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=None, kv_lora_rank=8,
               qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    assert layout_of(ModelConfig(**MOE, **mla)) == "deepseek_v2"  # softmax routing
    assert layout_of(ModelConfig(**MOE, **mla, moe_router_score_function="sigmoid")) == \
        "deepseek_v3"
    assert layout_of(ModelConfig(**LLAMA, **mla)) == "deepseek_v3"


def test_nemotron_layout_refuses_what_its_class_lacks():
    """Nemotron-4's layout needs all of LayerNorm 1p, squared ReLU, RoPE and no biases (without
    the zero-centred gains it is refused as GPT-2 with squared ReLU), and has no window."""
    with pytest.raises(ConfigError, match="--squared-relu"):
        hf_config(ModelConfig(**{**NEMOTRON, "apply_layernorm_1p": False}))
    with pytest.raises(ConfigError, match="--window-size"):
        hf_config(ModelConfig(**NEMOTRON, window_size="4,0"))
    assert hf_config(ModelConfig(**NEMOTRON))["rope_parameters"]["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("name,value", [("squared_relu", True), ("qk_layernorm", True),
                                        ("rotary_percent", 0.5), ("window_size", "4,0"),
                                        ("mtp_num_layers", 1)])
def test_an_option_hf_cannot_express_is_refused_naming_it(name, value):
    """On GPT-2 (a window, partial RoPE: Mistral's and Phi-3's on the LLaMA layout) and on
    Qwen2 (Q/K norms: Qwen3's without its bias)."""
    assert name in dict(PLAIN_LAYOUT)
    base = dict(LLAMA, add_qkv_bias=True) if name == "qk_layernorm" else GPT2
    with pytest.raises(ConfigError, match="--" + name.replace("_", "-")):
        hf_config(ModelConfig(**base, **{name: value}))


@pytest.mark.parametrize("flags,needle", [
    (dict(quick_geglu=True), "gpt-oss export needs --glu-linear-offset 1"),
    (dict(softmax_type="learnable"), "gpt-oss export needs --quick-geglu"),
    (dict(num_experts=4, moe_router_pre_softmax=True), "Mixtral has no QKV bias"),
    (dict(num_experts=4, moe_shared_expert_intermediate_size=8), "Qwen2-MoE needs")])
def test_a_layout_refuses_what_its_class_lacks(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        hf_config(ModelConfig(**{**LLAMA, **flags}))


@pytest.mark.parametrize("flags,needle", [
    (dict(moe_latent_size=8), "--moe-latent-size: no Hugging Face MoE class"),
    (dict(moe_latent_size=8, multi_latent_attention=True), "--moe-latent-size"),
    (dict(moe_router_topk=1, moe_apply_probs_on_input=True), "--moe-apply-probs-on-input")])
def test_latent_moe_and_probs_on_input_are_refused(flags, needle):
    """No exported MoE class (Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss) has latent
    projections or scales the expert input: refused in one line, not written as another
    model."""
    with pytest.raises(ConfigError, match=needle):
        hf_config(ModelConfig(**{**MOE, **flags}))
