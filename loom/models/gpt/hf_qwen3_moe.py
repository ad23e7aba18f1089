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
from loom.errors import ConfigError
from loom.models.gpt.hf_moe import _common, check_moe, experts_to_hf, experts_to_loom
from loom.models.gpt.hf_parts import (ROPE_SCALINGS, attention_to_hf, attention_to_loom,
                                      check_plain, outer_to_hf, outer_to_loom, rope_to_hf,
                                      swiglu_to_hf, swiglu_to_loom)


def _experts(hf_config) -> int:
    """``num_experts`` (transformers 5 writes it as ``num_local_experts``)."""
    return getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0)


def _sparse(hf_config, i: int) -> bool:
    return (i not in (hf_config.mlp_only_layers or []) and _experts(hf_config) > 0
            and (i + 1) % hf_config.decoder_sparse_step == 0)


def qwen3_moe_config(hf_config) -> ModelConfig:
    """loom's layout for a ``transformers.Qwen3MoeConfig``."""
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("Qwen3-MoE with use_sliding_window is not supported")
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("Qwen3-MoE with attention_bias (o_proj biased too) is not supported")
    freq = [int(_sparse(hf_config, i)) for i in range(hf_config.num_hidden_layers)]
    return ModelConfig.llama(num_experts=_experts(hf_config),
                             moe_router_topk=hf_config.num_experts_per_tok,
                             moe_ffn_hidden_size=hf_config.moe_intermediate_size,
                             ffn_hidden_size=hf_config.intermediate_size,
                             qk_layernorm=True,
                             moe_router_pre_softmax=not hf_config.norm_topk_prob,
                             moe_layer_freq="1" if all(freq) else str(freq).replace(" ", ""),
                             **_common(hf_config))


def qwen3_moe_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig
                      ) -> dict[str, torch.Tensor]:
    """Qwen3MoeForCausalLM state dict (experts stacked or per expert) -> loom names (dense
    layers: gate/up fused)."""
    out = outer_to_loom(sd)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(attention_to_loom(sd, h, l))
        if cfg.is_moe_layer(i):
            out.update(experts_to_loom(sd, h, l, cfg.num_experts))
        else:
            out.update(swiglu_to_loom(sd, h + "mlp.", l + "mlp."))
    return out


def qwen3_moe_hf_config(cfg: ModelConfig) -> dict:
    """The ``config.json`` fields of the ``Qwen3MoeConfig`` that :func:`loom_to_qwen3_moe`'s
    tensors load into. Raises ConfigError for a loom model Qwen3-MoE cannot express."""
    check_plain(cfg, "Qwen3-MoE", allowed=("qk_layernorm", *ROPE_SCALINGS))
    check_moe(cfg, "Qwen3-MoE", every_layer=False)
    if not cfg.qk_layernorm or cfg.moe_shared_expert_intermediate_size or cfg.add_qkv_bias:
        raise ConfigError("Qwen3-MoE export needs --qk-layernorm, no shared expert and no "
                          "--add-qkv-bias (its attention_bias biases o_proj too)")
    freq = [int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size, "moe_intermediate_size": cfg.moe_ffn_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_kv_groups, "head_dim": cfg.head_dim,
            "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
            "norm_topk_prob": not cfg.moe_router_pre_softmax, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, f in enumerate(freq) if not f],
            "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_epsilon,
            **rope_to_hf(cfg), "attention_bias": False,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "hidden_act": "silu", "router_aux_loss_coef": cfg.moe_aux_loss_coeff}


def loom_to_qwen3_moe(full: Mapping[str, torch.Tensor], cfg: ModelConfig, fused: bool = False
                      ) -> dict[str, torch.Tensor]:
    """Full loom tensors (vocabulary padding dropped here) -> the Qwen3MoeForCausalLM state
    dict: experts per expert as checkpoints store them, or with ``fused`` stacked as
    ``transformers`` holds them (``gate_up_proj [E, 2 I, h]`` / ``down_proj [E, h, I]``)."""
    out = outer_to_hf(full, cfg)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(attention_to_hf(full, l, h, cfg))
        if cfg.is_moe_layer(i):
            out.update(experts_to_hf(full, l, h, cfg.num_experts, fused))
        else:
            out.update(swiglu_to_hf(full, l + "mlp.", h + "mlp."))
    return out
