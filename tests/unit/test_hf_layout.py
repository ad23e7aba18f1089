"""A GPT model converts to Hugging Face only when GPT2LMHeadModel or LlamaForCausalLM expresses
every option it sets: a squared-ReLU, q/k-normed, partial-RoPE, gpt-oss or MTP model is refused
naming the flag, instead of being written as a plain GPT-2 / LLaMA with other math."""

from __future__ import annotations

import pytest

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.gpt.hf import PLAIN_LAYOUT, layout_of

GPT2 = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=50)
LLAMA = dict(GPT2, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             disable_bias_linear=True)


def test_plain_layouts_convert():
    assert layout_of(ModelConfig(**GPT2)) == "gpt2"
    assert layout_of(ModelConfig(**LLAMA, openai_gelu=False)) == "llama"


@pytest.mark.parametrize("name,value", [("squared_relu", True), ("qk_layernorm", True),
                                        ("rotary_percent", 0.5), ("quick_geglu", True),
                                        ("softmax_type", "learnable"), ("window_size", "4,0"),
                                        ("mtp_num_layers", 1)])
def test_an_option_hf_cannot_express_is_refused_naming_it(name, value):
    assert name in dict(PLAIN_LAYOUT)
    base = LLAMA if name in ("rotary_percent", "qk_layernorm") else GPT2
    with pytest.raises(ConfigError, match="--" + name.replace("_", "-")):
        layout_of(ModelConfig(**base, **{name: value}))
