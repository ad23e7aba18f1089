"""loom -> Hugging Face: full tensors by loom name -> a ``transformers`` state dict and config
for the GPT-2 and LLaMA layouts (the inverse of :mod:`loom.interop.hf`), so a model trained in
loom leaves it as ``model.safetensors`` + ``config.json``.
"""

from __future__ import annotations

from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.errors import ConfigError


def layout_of(cfg: ModelConfig) -> str:
    """``gpt2`` or ``llama``; raises ConfigError for a model neither HF class expresses."""
    gpt2 = (cfg.normalization == "LayerNorm" and cfg.position_embedding_type == "learned_absolute"
            and not cfg.swiglu and not cfg.disable_bias_linear
            and not cfg.untie_embeddings_and_output_weights)
    llama = (cfg.normalization == "RMSNorm" and cfg.position_embedding_type == "rope"
             and cfg.swiglu and cfg.disable_bias_linear and not cfg.add_qkv_bias)
    if cfg.num_experts or cfg.model_type != "gpt" or not (gpt2 or llama):
        raise ConfigError("only the GPT-2 layout (LayerNorm, learned positions, GeLU, biases, "
                          "tied embeddings) and the LLaMA layout (RMSNorm, RoPE, SwiGLU, no "
                          "biases) convert to Hugging Face")
    return "gpt2" if gpt2 else "llama"


def hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of the matching ``transformers`` class."""
    if layout_of(cfg) == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "vocab_size": cfg.vocab_size, "n_positions": cfg.max_positions,
                "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
                "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_size,
                "activation_function": "gelu_new" if cfg.openai_gelu else "gelu",
                "layer_norm_epsilon": cfg.norm_epsilon, "tie_word_embeddings": True,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_kv_groups, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_epsilon,
            "rope_theta": cfg.rotary_base,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}


def loom_to_hf(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full loom tensors (vocabulary padding dropped here) -> the HF state dict."""
    V = cfg.vocab_size
    out: dict[str, torch.Tensor] = {}
    if layout_of(cfg) == "gpt2":
        p = "transformer."
        out.update({p + "wte.weight": full["embedding.word_embeddings.weight"][:V],
                    p + "wpe.weight": full["embedding.position_embeddings.weight"],
                    p + "ln_f.weight": full["final_norm.weight"],
                    p + "ln_f.bias": full["final_norm.bias"]})
        for i in range(cfg.num_layers):
            h, l = f"{p}h.{i}.", f"layers.{i}."
            for hf_name, loom_name, conv in (
                    ("ln_1", "input_norm", False), ("attn.c_attn", "self_attention.linear_qkv", True),
                    ("attn.c_proj", "self_attention.linear_proj", True),
                    ("ln_2", "pre_mlp_norm", False), ("mlp.c_fc", "mlp.linear_fc1", True),
                    ("mlp.c_proj", "mlp.linear_fc2", True)):
                w = full[l + loom_name + ".weight"]
                out[h + hf_name + ".weight"] = w.t().contiguous() if conv else w
                out[h + hf_name + ".bias"] = full[l + loom_name + ".bias"]
        out["lm_head.weight"] = out[p + "wte.weight"]
        return out
    a, g, d, f = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim, cfg.ffn_size
    out.update({"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:V],
                "model.norm.weight": full["final_norm.weight"]})
    out["lm_head.weight"] = (full["output_layer.weight"][:V]
                             if cfg.untie_embeddings_and_output_weights
                             else out["model.embed_tokens.weight"])
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = full[l + "self_attention.linear_qkv.weight"].split([a * d, g * d, g * d])
        gate, up = full[l + "mlp.linear_fc1.weight"].split([f, f])
        out.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
                    h + "self_attn.v_proj.weight": v,
                    h + "self_attn.o_proj.weight": full[l + "self_attention.linear_proj.weight"],
                    h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
                    h + "mlp.down_proj.weight": full[l + "mlp.linear_fc2.weight"],
                    h + "input_layernorm.weight": full[l + "input_norm.weight"],
                    h + "post_attention_layernorm.weight": full[l + "pre_mlp_norm.weight"]})
    return {k: v.contiguous() for k, v in out.items()}
