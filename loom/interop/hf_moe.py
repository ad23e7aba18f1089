"""Hugging Face ``transformers`` mixture-of-experts models -> loom: ``MixtralForCausalLM`` and
``Qwen2MoeForCausalLM`` (shared expert with a sigmoid gate, QKV biases, no top-k
renormalization), at any TP / EP layout (full tensors by loom name; :func:`~loom.interop.hf.
load_full_state_dict` cuts each rank's shard, and an EP rank loads only its experts).
"""

from __future__ import annotations

from typing import Mapping

import torch

from loom.config import ModelConfig


def _rope_theta(hf_config) -> float:
    theta = getattr(hf_config, "rope_theta", None)
    return theta or hf_config.rope_parameters["rope_theta"]


def _common(hf_config) -> dict:
    return dict(num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
                num_attention_heads=hf_config.num_attention_heads,
                num_query_groups=hf_config.num_key_value_heads,
                seq_length=hf_config.max_position_embeddings,
                max_position_embeddings=hf_config.max_position_embeddings,
                vocab_size=hf_config.vocab_size, norm_epsilon=hf_config.rms_norm_eps,
                rotary_base=_rope_theta(hf_config),
                untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings,
                hidden_dropout=0.0, attention_dropout=0.0, exclude_padded_vocab=True)


def mixtral_config(hf_config) -> ModelConfig:
    """loom's layout for a ``transformers.MixtralConfig`` (every layer MoE, softmax top-k)."""
    return ModelConfig.llama(num_experts=hf_config.num_local_experts,
                             moe_router_topk=hf_config.num_experts_per_tok,
                             moe_ffn_hidden_size=hf_config.intermediate_size,
                             ffn_hidden_size=hf_config.intermediate_size, **_common(hf_config))


def qwen2_moe_config(hf_config) -> ModelConfig:
    """loom's layout for a ``transformers.Qwen2MoeConfig`` with every layer sparse
    (``decoder_sparse_step`` 1, no ``mlp_only_layers``). Raises ValueError otherwise."""
    if hf_config.decoder_sparse_step != 1 or hf_config.mlp_only_layers:
        raise ValueError("only Qwen2-MoE configs whose every layer is sparse are supported")
    return ModelConfig.llama(num_experts=hf_config.num_experts,
                             moe_router_topk=hf_config.num_experts_per_tok,
                             moe_ffn_hidden_size=hf_config.moe_intermediate_size,
                             ffn_hidden_size=hf_config.intermediate_size,
                             moe_shared_expert_intermediate_size=(
                                 hf_config.shared_expert_intermediate_size),
                             moe_shared_expert_gate=True, add_qkv_bias=True,
                             moe_router_pre_softmax=not hf_config.norm_topk_prob,
                             **_common(hf_config))


def _attention(sd, h: str, l: str, bias: bool) -> dict:
    out = {l + "self_attention.linear_qkv.weight": torch.cat(
               [sd[h + f"self_attn.{x}_proj.weight"] for x in "qkv"], dim=0),
           l + "self_attention.linear_proj.weight": sd[h + "self_attn.o_proj.weight"],
           l + "input_layernorm.weight": sd[h + "input_layernorm.weight"],
           l + "pre_mlp_layernorm.weight": sd[h + "post_attention_layernorm.weight"]}
    if bias:
        out[l + "self_attention.linear_qkv.bias"] = torch.cat(
            [sd[h + f"self_attn.{x}_proj.bias"] for x in "qkv"], dim=0)
    return out


def _experts(sd, h: str, l: str, num_experts: int) -> dict:
    out = {l + "mlp.router.weight": sd[h + "mlp.gate.weight"]}
    gate_up, down = sd[h + "mlp.experts.gate_up_proj"], sd[h + "mlp.experts.down_proj"]
    for i in range(num_experts):  # gate_up is [gate; up] like loom's fused SwiGLU fc1
        out[l + f"mlp.experts.{i}.linear_fc1.weight"] = gate_up[i]
        out[l + f"mlp.experts.{i}.linear_fc2.weight"] = down[i]
    return out


def _outer(sd) -> dict:
    return {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
            "final_layernorm.weight": sd["model.norm.weight"],
            "output_layer.weight": sd.get("lm_head.weight", sd["model.embed_tokens.weight"])}


def mixtral_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """MixtralForCausalLM state dict -> loom names."""
    out = _outer(sd)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(_attention(sd, h, l, bias=False))
        out.update(_experts(sd, h, l, cfg.num_experts))
    return out


def qwen2_moe_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Qwen2MoeForCausalLM state dict -> loom names (shared expert: gate/up fused)."""
    out = _outer(sd)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(_attention(sd, h, l, bias=True))
        out.update(_experts(sd, h, l, cfg.num_experts))
        s = h + "mlp.shared_expert."
        out[l + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]], dim=0)
        out[l + "mlp.shared_experts.linear_fc2.weight"] = sd[s + "down_proj.weight"]
        out[l + "mlp.shared_expert_gate.weight"] = sd[h + "mlp.shared_expert_gate.weight"]
    return out
