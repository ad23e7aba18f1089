"""Hugging Face ``Qwen3MoeForCausalLM`` <-> loom, both ways, at any TP / EP layout (full tensors
by loom name; :func:`~loom.interop.hf.load_full_state_dict` cuts each rank's shard).

Qwen3-MoE (Qwen Team 2025, arXiv 2505.09388 sec. 2) is the LLaMA layout with per-head RMSNorm
on queries and keys before RoPE (``--qk-layernorm``), a head dimension of its own
(``head_dim`` -> ``--kv-channels``), softmax top-k routing renormalized over the k choices
(``norm_topk_prob``; false -> ``--moe-router-pre-softmax``), no shared expert, and dense MLP
layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say (-> a ``--moe-layer-freq`` list).
"""

from __future__ import annotations

from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.interop.hf_moe import _attention, _common, _experts, _outer


def _sparse(hf_config, i: int) -> bool:
    return (i not in (hf_config.mlp_only_layers or []) and hf_config.num_experts > 0
            and (i + 1) % hf_config.decoder_sparse_step == 0)


def qwen3_moe_config(hf_config) -> ModelConfig:
    """loom's layout for a ``transformers.Qwen3MoeConfig``."""
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("Qwen3-MoE with use_sliding_window is not supported")
    freq = [int(_sparse(hf_config, i)) for i in range(hf_config.num_hidden_layers)]
    return ModelConfig.llama(num_experts=hf_config.num_experts,
                             moe_router_topk=hf_config.num_experts_per_tok,
                             moe_ffn_hidden_size=hf_config.moe_intermediate_size,
                             ffn_hidden_size=hf_config.intermediate_size,
                             kv_channels=hf_config.head_dim, qk_layernorm=True,
                             add_qkv_bias=bool(hf_config.attention_bias),
                             moe_router_pre_softmax=not hf_config.norm_topk_prob,
                             moe_layer_freq="1" if all(freq) else str(freq).replace(" ", ""),
                             **_common(hf_config))


def qwen3_moe_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig
                      ) -> dict[str, torch.Tensor]:
    """Qwen3MoeForCausalLM state dict -> loom names (dense layers: gate/up fused)."""
    out = _outer(sd)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(_attention(sd, h, l, bias=cfg.add_qkv_bias))
        out[l + "self_attention.q_layernorm.weight"] = sd[h + "self_attn.q_norm.weight"]
        out[l + "self_attention.k_layernorm.weight"] = sd[h + "self_attn.k_norm.weight"]
        if cfg.is_moe_layer(i):
            out.update(_experts(sd, h, l, cfg.num_experts))
        else:
            out[l + "mlp.linear_fc1.weight"] = torch.cat(
                [sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]], dim=0)
            out[l + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"]
    return out


def qwen3_moe_hf_config(cfg: ModelConfig) -> dict:
    """The ``config.json`` fields of the ``Qwen3MoeConfig`` that :func:`loom_to_qwen3_moe`'s
    tensors load into. Raises ValueError for a loom model Qwen3-MoE cannot express."""
    freq = [int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]
    if not (cfg.num_experts and cfg.qk_layernorm and cfg.swiglu and cfg.normalization == "RMSNorm"
            and cfg.disable_bias_linear and not cfg.moe_shared_expert_intermediate_size
            and cfg.moe_router_score_function == "softmax"
            and not cfg.moe_router_enable_expert_bias and not cfg.moe_router_group_topk):
        raise ValueError("only Qwen3-MoE's layout (RMSNorm, SwiGLU, --qk-layernorm, softmax "
                         "router, no shared expert, no biases) exports to Qwen3MoeForCausalLM")
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size, "moe_intermediate_size": cfg.moe_ffn_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_kv_groups, "head_dim": cfg.head_dim,
            "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
            "norm_topk_prob": not cfg.moe_router_pre_softmax, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, f in enumerate(freq) if not f],
            "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_epsilon,
            "rope_theta": cfg.rotary_base, "attention_bias": cfg.add_qkv_bias,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "hidden_act": "silu", "router_aux_loss_coef": cfg.moe_aux_loss_coeff}


def loom_to_qwen3_moe(full: Mapping[str, torch.Tensor], cfg: ModelConfig
                      ) -> dict[str, torch.Tensor]:
    """Full loom tensors (vocabulary padding dropped here) -> the Qwen3MoeForCausalLM state
    dict (experts stacked into ``gate_up_proj [E, 2 I, h]`` / ``down_proj [E, h, I]``)."""
    V, a, g, d = cfg.vocab_size, cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim
    out = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:V],
           "model.norm.weight": full["final_layernorm.weight"]}
    out["lm_head.weight"] = (full["output_layer.weight"][:V]
                             if cfg.untie_embeddings_and_output_weights
                             else out["model.embed_tokens.weight"])
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
            q, k, v = full[l + f"self_attention.linear_qkv.{kind}"].split(
                [a * d, g * d, g * d], dim=0)
            out.update({h + f"self_attn.q_proj.{kind}": q, h + f"self_attn.k_proj.{kind}": k,
                        h + f"self_attn.v_proj.{kind}": v})
        out.update({h + "self_attn.o_proj.weight": full[l + "self_attention.linear_proj.weight"],
                    h + "self_attn.q_norm.weight": full[l + "self_attention.q_layernorm.weight"],
                    h + "self_attn.k_norm.weight": full[l + "self_attention.k_layernorm.weight"],
                    h + "input_layernorm.weight": full[l + "input_layernorm.weight"],
                    h + "post_attention_layernorm.weight": full[l + "pre_mlp_layernorm.weight"]})
        if cfg.is_moe_layer(i):
            e = [f"{l}mlp.experts.{j}." for j in range(cfg.num_experts)]
            out[h + "mlp.gate.weight"] = full[l + "mlp.router.weight"]
            out[h + "mlp.experts.gate_up_proj"] = torch.stack(
                [full[x + "linear_fc1.weight"] for x in e])
            out[h + "mlp.experts.down_proj"] = torch.stack([full[x + "linear_fc2.weight"]
                                                            for x in e])
        else:
            gate, up = full[l + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out.update({h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
                        h + "mlp.down_proj.weight": full[l + "mlp.linear_fc2.weight"]})
    return out
