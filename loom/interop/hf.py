"""Hugging Face ``transformers`` GPT-2 / LLaMA weights -> loom, at any tensor-parallel size.

Conversions produce *full* (unsharded) tensors under loom's parameter names;
:func:`load_full_state_dict` then cuts each rank's shard with the same
:func:`~loom.parallel.registry.local_shard` that initialization and checkpoints use.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from loom.config import ModelConfig
from loom.parallel.registry import local_shard


def gpt2_config(hf_config) -> ModelConfig:
    """loom's GPT-2 layout for a ``transformers.GPT2Config``."""
    return ModelConfig.gpt2(
        num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
        num_attention_heads=hf_config.n_head, ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
        seq_length=hf_config.n_positions, max_position_embeddings=hf_config.n_positions,
        vocab_size=hf_config.vocab_size, norm_epsilon=hf_config.layer_norm_epsilon,
        openai_gelu=hf_config.activation_function in ("gelu_new", "gelu_pytorch_tanh"),
        hidden_dropout=0.0, attention_dropout=0.0)


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
        hidden_dropout=0.0, attention_dropout=0.0)


def gpt2_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel state dict -> loom names. Conv1D weights are ``[in, out]``: transposed."""
    p = "transformer."
    out = {"embedding.word_embeddings.weight": sd[p + "wte.weight"],
           "embedding.position_embeddings.weight": sd[p + "wpe.weight"],
           "final_norm.weight": sd[p + "ln_f.weight"], "final_norm.bias": sd[p + "ln_f.bias"]}
    for i in range(cfg.num_layers):
        h, l = f"{p}h.{i}.", f"layers.{i}."
        out.update({
            l + "input_norm.weight": sd[h + "ln_1.weight"], l + "input_norm.bias": sd[h + "ln_1.bias"],
            l + "self_attention.linear_qkv.weight": sd[h + "attn.c_attn.weight"].t(),
            l + "self_attention.linear_qkv.bias": sd[h + "attn.c_attn.bias"],
            l + "self_attention.linear_proj.weight": sd[h + "attn.c_proj.weight"].t(),
            l + "self_attention.linear_proj.bias": sd[h + "attn.c_proj.bias"],
            l + "pre_mlp_norm.weight": sd[h + "ln_2.weight"], l + "pre_mlp_norm.bias": sd[h + "ln_2.bias"],
            l + "mlp.linear_fc1.weight": sd[h + "mlp.c_fc.weight"].t(),
            l + "mlp.linear_fc1.bias": sd[h + "mlp.c_fc.bias"],
            l + "mlp.linear_fc2.weight": sd[h + "mlp.c_proj.weight"].t(),
            l + "mlp.linear_fc2.bias": sd[h + "mlp.c_proj.bias"],
        })
    return out


def llama_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state dict -> loom names (q, k, v fused; gate, up fused)."""
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "final_norm.weight": sd["model.norm.weight"]}
    out["output_layer.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update({
            l + "input_norm.weight": sd[h + "input_layernorm.weight"],
            l + "self_attention.linear_qkv.weight": torch.cat(
                [sd[h + f"self_attn.{x}_proj.weight"] for x in "qkv"], dim=0),
            l + "self_attention.linear_proj.weight": sd[h + "self_attn.o_proj.weight"],
            l + "pre_mlp_norm.weight": sd[h + "post_attention_layernorm.weight"],
            l + "mlp.linear_fc1.weight": torch.cat(
                [sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]], dim=0),
            l + "mlp.linear_fc2.weight": sd[h + "mlp.down_proj.weight"],
        })
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors into a (possibly TP-sharded, pipeline-partial) loom model by name.

    Raises KeyError naming any parameter of the model missing from ``full``.
    """
    mesh = model.mesh
    for name, p in model.named_parameters():
        if name not in full:
            raise KeyError(f"{name} missing from the converted state dict")
        p.copy_(local_shard(full[name].float(), model.registry[name], mesh.tp_rank, mesh.tp_size,
                            name))
