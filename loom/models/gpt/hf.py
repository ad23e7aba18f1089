"""Hugging Face ``transformers`` GPT-2 / LLaMA <-> loom for the GPT family: full (unsharded)
tensors under loom's parameter names, both ways (``loom checkpoint convert``; resharding to a
layout is :func:`loom.interop.hf.load_full_state_dict`), and the ``config.json`` of the
matching ``transformers`` class.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.family import HFConversion
from loom.models.gpt import hf_deepseek, hf_gpt_oss


def gpt2_config(hf_config) -> ModelConfig:
    """loom's GPT-2 layout for a ``transformers.GPT2Config``."""
    return ModelConfig.gpt2(
        num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
        num_attention_heads=hf_config.n_head, ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
        seq_length=hf_config.n_positions, max_position_embeddings=hf_config.n_positions,
        vocab_size=hf_config.vocab_size, norm_epsilon=hf_config.layer_norm_epsilon,
        openai_gelu=hf_config.activation_function in ("gelu_new", "gelu_pytorch_tanh"),
        hidden_dropout=0.0, attention_dropout=0.0, exclude_padded_vocab=True)


def llama_config(hf_config) -> ModelConfig:
    """loom's LLaMA layout for a ``transformers.LlamaConfig``."""
    return ModelConfig.llama(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        seq_length=hf_config.max_position_embeddings,
        max_position_embeddings=hf_config.max_position_embeddings,
        vocab_size=hf_config.vocab_size, norm_epsilon=hf_config.rms_norm_eps,
        rotary_base=getattr(hf_config, "rope_theta", None) or hf_config.rope_parameters["rope_theta"],
        untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings,
        hidden_dropout=0.0, attention_dropout=0.0, exclude_padded_vocab=True)


def gpt2_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel state dict -> loom names. Conv1D weights are ``[in, out]``: transposed."""
    p = "transformer."
    out = {"embedding.word_embeddings.weight": sd[p + "wte.weight"],
           "embedding.position_embeddings.weight": sd[p + "wpe.weight"],
           "final_layernorm.weight": sd[p + "ln_f.weight"],
           "final_layernorm.bias": sd[p + "ln_f.bias"]}
    for i in range(cfg.num_layers):
        h, l = f"{p}h.{i}.", f"layers.{i}."
        out.update({
            l + "input_layernorm.weight": sd[h + "ln_1.weight"],
            l + "input_layernorm.bias": sd[h + "ln_1.bias"],
            l + "self_attention.linear_qkv.weight": sd[h + "attn.c_attn.weight"].t(),
            l + "self_attention.linear_qkv.bias": sd[h + "attn.c_attn.bias"],
            l + "self_attention.linear_proj.weight": sd[h + "attn.c_proj.weight"].t(),
            l + "self_attention.linear_proj.bias": sd[h + "attn.c_proj.bias"],
            l + "pre_mlp_layernorm.weight": sd[h + "ln_2.weight"],
            l + "pre_mlp_layernorm.bias": sd[h + "ln_2.bias"],
            l + "mlp.linear_fc1.weight": sd[h + "mlp.c_fc.weight"].t(),
            l + "mlp.linear_fc1.bias": sd[h + "mlp.c_fc.bias"],
            l + "mlp.linear_fc2.weight": sd[h + "mlp.c_proj.weight"].t(),
            l + "mlp.linear_fc2.bias": sd[h + "mlp.c_proj.bias"],
        })
    return out


def llama_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state dict -> loom names (q, k, v fused; gate, up fused)."""
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "final_layernorm.weight": sd["model.norm.weight"]}
    out["output_layer.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update({
            l + "input_layernorm.weight": sd[h + "input_layernorm.weight"],
            l + "self_attention.linear_qkv.weight": torch.cat(
                [sd[h + f"self_attn.{x}_proj.weight"] for x in "qkv"], dim=0),
            l + "self_attention.linear_proj.weight": sd[h + "self_attn.o_proj.weight"],
            l + "pre_mlp_layernorm.weight": sd[h + "post_attention_layernorm.weight"],
            l + "mlp.linear_fc1.weight": torch.cat(
                [sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]], dim=0),
            l + "mlp.linear_fc2.weight": sd[h + "mlp.down_proj.weight"],
        })
    return out


# Options neither GPT2LMHeadModel nor LlamaForCausalLM expresses: at these values or refused.
PLAIN_LAYOUT = (("squared_relu", False), ("qk_layernorm", False), ("rotary_percent", 1.0),
                ("quick_geglu", False), ("softmax_type", "vanilla"), ("window_size", None),
                ("mtp_num_layers", None))


def layout_of(cfg: ModelConfig) -> str:
    """``gpt2`` or ``llama``; raises ConfigError for a model neither HF class expresses
    (naming the first option in :data:`PLAIN_LAYOUT` the model sets)."""
    for name, plain in PLAIN_LAYOUT:
        if getattr(cfg, name) != plain:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)} has no "
                              f"Hugging Face GPT-2 or LLaMA equivalent: this model does not "
                              f"convert to Hugging Face")
    gpt2 = (cfg.normalization == "LayerNorm" and cfg.position_embedding_type == "learned_absolute"
            and not cfg.swiglu and not cfg.disable_bias_linear
            and not cfg.untie_embeddings_and_output_weights)
    llama = (cfg.normalization == "RMSNorm" and cfg.position_embedding_type == "rope"
             and cfg.swiglu and cfg.disable_bias_linear and not cfg.add_qkv_bias)
    if cfg.num_experts or not (gpt2 or llama):
        raise ConfigError("only the GPT-2 layout (LayerNorm, learned positions, GeLU, biases, "
                          "tied embeddings) and the LLaMA layout (RMSNorm, RoPE, SwiGLU, no "
                          "biases) convert to Hugging Face")
    return "gpt2" if gpt2 else "llama"


def hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of the matching ``transformers`` class (MLA: DeepseekV3ForCausalLM)."""
    if cfg.multi_latent_attention:
        return hf_deepseek.hf_config(cfg)
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
    if cfg.multi_latent_attention:
        return hf_deepseek.loom_to_deepseek_v3(full, cfg)
    V = cfg.vocab_size
    out: dict[str, torch.Tensor] = {}
    if layout_of(cfg) == "gpt2":
        p = "transformer."
        out.update({p + "wte.weight": full["embedding.word_embeddings.weight"][:V],
                    p + "wpe.weight": full["embedding.position_embeddings.weight"],
                    p + "ln_f.weight": full["final_layernorm.weight"],
                    p + "ln_f.bias": full["final_layernorm.bias"]})
        for i in range(cfg.num_layers):
            h, l = f"{p}h.{i}.", f"layers.{i}."
            for hf_name, loom_name, conv in (
                    ("ln_1", "input_layernorm", False),
                    ("attn.c_attn", "self_attention.linear_qkv", True),
                    ("attn.c_proj", "self_attention.linear_proj", True),
                    ("ln_2", "pre_mlp_layernorm", False), ("mlp.c_fc", "mlp.linear_fc1", True),
                    ("mlp.c_proj", "mlp.linear_fc2", True)):
                w = full[l + loom_name + ".weight"]
                out[h + hf_name + ".weight"] = w.t().contiguous() if conv else w
                out[h + hf_name + ".bias"] = full[l + loom_name + ".bias"]
        out["lm_head.weight"] = out[p + "wte.weight"]
        return out
    a, g, d, f = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim, cfg.ffn_size
    out.update({"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:V],
                "model.norm.weight": full["final_layernorm.weight"]})
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
                    h + "input_layernorm.weight": full[l + "input_layernorm.weight"],
                    h + "post_attention_layernorm.weight": full[l + "pre_mlp_layernorm.weight"]})
    return {k: v.contiguous() for k, v in out.items()}


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of a GPT-2 or LLaMA ``config.json`` dict and state
    dict (``where``: the source, for messages; the layouts need no refusal beyond
    ``model_types``); ``deepseek_v3``: :mod:`loom.models.gpt.hf_deepseek`."""
    if hf.get("model_type") == "deepseek_v3":
        return hf_deepseek.to_loom(hf, sd, where)
    if hf.get("model_type") == "gpt_oss":  # import only (loom/models/gpt/hf_gpt_oss.py)
        return hf_gpt_oss.to_loom(hf, sd, where)
    gpt2 = hf.get("model_type") == "gpt2"
    ns = SimpleNamespace(**{"n_inner": None, "tie_word_embeddings": gpt2, **hf})
    cfg = gpt2_config(ns) if gpt2 else llama_config(ns)
    return cfg, (gpt2_to_loom if gpt2 else llama_to_loom)(sd, cfg)


HF = HFConversion(model_types=("gpt2", "llama", "deepseek_v3", "gpt_oss"), to_loom=to_loom,
                  export_config=hf_config, from_loom=loom_to_hf,
                  title="GPT-2 / LLaMA / DeepSeek-V3")
