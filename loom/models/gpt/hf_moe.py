"""Hugging Face ``transformers`` mixture-of-experts models <-> loom's GPT family, both ways:
``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` (shared expert with a sigmoid gate, QKV
biases, top-k renormalization as ``norm_topk_prob`` says), at any TP / EP layout (full tensors
by loom name; :func:`~loom.interop.hf.load_full_state_dict` cuts each rank's shard, and an EP
rank loads only its experts).

Experts come in two spellings: checkpoints (what ``save_pretrained`` writes and the Hub holds)
keep one tensor per expert (Mixtral: ``block_sparse_moe.experts.<i>.w1`` gate / ``w3`` up /
``w2`` down; Qwen: ``mlp.experts.<i>.{gate,up,down}_proj``); ``transformers`` 5 holds them
stacked in memory (``mlp.experts.gate_up_proj [E, 2f, h]``: gate then up, like loom's fused
SwiGLU ``linear_fc1``; ``down_proj [E, h, f]``). Import reads either; export writes the
checkpoint spelling (``fused``: the in-memory one, for ``load_state_dict``).
"""

from __future__ import annotations

from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.gpt.hf_parts import (ROPE_SCALINGS, attention_to_hf, attention_to_loom,
                                      check_plain, hf_sliding_window, mistral_window,
                                      outer_to_hf, outer_to_loom, rope_fields, rope_to_hf,
                                      swiglu_to_hf, swiglu_to_loom)


def _common(hf_config) -> dict:
    return dict(num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
                num_attention_heads=hf_config.num_attention_heads,
                num_query_groups=hf_config.num_key_value_heads,
                kv_channels=getattr(hf_config, "head_dim", None),
                seq_length=hf_config.max_position_embeddings,
                max_position_embeddings=hf_config.max_position_embeddings,
                vocab_size=hf_config.vocab_size, norm_epsilon=hf_config.rms_norm_eps,
                **rope_fields(hf_config),
                untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings,
                hidden_dropout=0.0, attention_dropout=0.0, exclude_padded_vocab=True)


def mixtral_config(hf_config) -> ModelConfig:
    """loom's layout for a ``transformers.MixtralConfig`` (every layer MoE, softmax top-k; its
    ``sliding_window``, Mistral's: :func:`~loom.models.gpt.hf_parts.mistral_window`)."""
    return ModelConfig.llama(window_size=mistral_window(hf_config),
                             num_experts=hf_config.num_local_experts,
                             moe_router_topk=hf_config.num_experts_per_tok,
                             moe_ffn_hidden_size=hf_config.intermediate_size,
                             ffn_hidden_size=hf_config.intermediate_size, **_common(hf_config))


def qwen2_moe_config(hf_config) -> ModelConfig:
    """loom's layout for a ``transformers.Qwen2MoeConfig`` with every layer sparse
    (``decoder_sparse_step`` 1, no ``mlp_only_layers``). Raises ValueError otherwise."""
    if hf_config.decoder_sparse_step != 1 or hf_config.mlp_only_layers:
        raise ValueError("only Qwen2-MoE configs whose every layer is sparse are supported")
    if getattr(hf_config, "use_sliding_window", False):  # (as Qwen2's and Qwen3-MoE's)
        raise ValueError("Qwen2-MoE with use_sliding_window is not supported")
    return ModelConfig.llama(num_experts=hf_config.num_experts,
                             moe_router_topk=hf_config.num_experts_per_tok,
                             moe_ffn_hidden_size=hf_config.moe_intermediate_size,
                             ffn_hidden_size=hf_config.intermediate_size,
                             moe_shared_expert_intermediate_size=(
                                 hf_config.shared_expert_intermediate_size),
                             moe_shared_expert_gate=True, add_qkv_bias=True,
                             moe_router_pre_softmax=not hf_config.norm_topk_prob,
                             **_common(hf_config))


# Mixtral's checkpoint names of an expert's gate / up / down (Qwen's: gate_proj / ...)
MIXTRAL_EXPERT = ("w1", "w3", "w2")
QWEN_EXPERT = ("gate_proj", "up_proj", "down_proj")


def experts_to_loom(sd: Mapping, h: str, l: str, num_experts: int,
                    spelling=QWEN_EXPERT) -> dict:
    """Router and experts of HF layer prefix ``h`` (``h + "mlp."``) under loom prefix ``l``,
    from stacked (``transformers``' memory) or per-expert (checkpoint) tensors."""
    m = h + "mlp."
    out = {l + "mlp.router.weight": sd[m + "gate.weight"]}
    if m + "experts.gate_up_proj" in sd:
        gate_up, down = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
        for i in range(num_experts):
            out[l + f"mlp.experts.{i}.linear_fc1.weight"] = gate_up[i]
            out[l + f"mlp.experts.{i}.linear_fc2.weight"] = down[i]
        return out
    gate, up, down = spelling
    for i in range(num_experts):
        e = f"{m}experts.{i}."
        out[l + f"mlp.experts.{i}.linear_fc1.weight"] = torch.cat(
            [sd[e + f"{gate}.weight"], sd[e + f"{up}.weight"]], dim=0)
        out[l + f"mlp.experts.{i}.linear_fc2.weight"] = sd[e + f"{down}.weight"]
    return out


def experts_to_hf(full: Mapping, l: str, h: str, num_experts: int, fused: bool,
                  spelling=QWEN_EXPERT, block: str = "mlp.") -> dict:
    """The inverse of :func:`experts_to_loom` (HF module prefix ``h + block``)."""
    m = h + block
    out = {m + "gate.weight": full[l + "mlp.router.weight"]}
    fc1 = [full[l + f"mlp.experts.{i}.linear_fc1.weight"] for i in range(num_experts)]
    fc2 = [full[l + f"mlp.experts.{i}.linear_fc2.weight"] for i in range(num_experts)]
    if fused:
        out[m + "experts.gate_up_proj"] = torch.stack(fc1)
        out[m + "experts.down_proj"] = torch.stack(fc2)
        return out
    gate, up, down = spelling
    for i in range(num_experts):
        g, u = fc1[i].chunk(2, dim=0)
        out.update({f"{m}experts.{i}.{gate}.weight": g, f"{m}experts.{i}.{up}.weight": u,
                    f"{m}experts.{i}.{down}.weight": fc2[i]})
    return out


def _mixtral_names(sd: Mapping) -> dict:
    """Mixtral checkpoints' ``block_sparse_moe`` is ``transformers``' ``mlp``."""
    return {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in sd.items()}


def mixtral_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """MixtralForCausalLM state dict (either spelling) -> loom names."""
    sd = _mixtral_names(sd)
    out = outer_to_loom(sd)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(attention_to_loom(sd, h, l))
        out.update(experts_to_loom(sd, h, l, cfg.num_experts, MIXTRAL_EXPERT))
    return out


def qwen2_moe_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Qwen2MoeForCausalLM state dict (either spelling) -> loom names (shared expert: gate/up
    fused)."""
    out = outer_to_loom(sd)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(attention_to_loom(sd, h, l))
        out.update(experts_to_loom(sd, h, l, cfg.num_experts))
        out.update(swiglu_to_loom(sd, h + "mlp.shared_expert.", l + "mlp.shared_experts."))
        out[l + "mlp.shared_expert_gate.weight"] = sd[h + "mlp.shared_expert_gate.weight"]
    return out


def check_moe(cfg: ModelConfig, title: str, every_layer: bool = True) -> None:
    """Refuse router options a softmax top-k ``transformers`` MoE does not express."""
    if not (cfg.swiglu and cfg.normalization == "RMSNorm" and cfg.position_embedding_type == "rope"
            and cfg.disable_bias_linear):
        raise ConfigError(f"{title} export needs the LLaMA layout: --swiglu, RMSNorm, RoPE, "
                          f"--disable-bias-linear")
    bad = [flag for flag, on in (
        (f"--moe-router-score-function {cfg.moe_router_score_function}",
         cfg.moe_router_score_function != "softmax"),
        ("--moe-router-enable-expert-bias", cfg.moe_router_enable_expert_bias),
        ("--moe-router-group-topk", bool(cfg.moe_router_group_topk)),
        ("--moe-router-topk-scaling-factor", (cfg.moe_router_topk_scaling_factor or 1.0) != 1.0),
        ("--moe-layer-freq (dense layers)", every_layer and not all(
            cfg.is_moe_layer(i) for i in range(cfg.num_layers)))) if on]
    if bad:
        raise ConfigError(f"{bad[0]} has no {title} equivalent: this model does not convert "
                          f"to Hugging Face")


def _moe_fields(cfg: ModelConfig) -> dict:
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_kv_groups, "head_dim": cfg.head_dim,
            "num_experts_per_tok": cfg.moe_router_topk,
            "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_epsilon,
            **rope_to_hf(cfg), "hidden_act": "silu",
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "router_aux_loss_coef": cfg.moe_aux_loss_coeff}


def mixtral_hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of ``MixtralForCausalLM`` for a loom MoE model without a shared
    expert. Raises ConfigError for what Mixtral does not express."""
    check_plain(cfg, "Mixtral", allowed=ROPE_SCALINGS + ("window_size",))
    window = hf_sliding_window(cfg, "Mixtral")
    check_moe(cfg, "Mixtral")
    if cfg.add_qkv_bias or cfg.moe_shared_expert_intermediate_size or cfg.moe_router_pre_softmax:
        raise ConfigError("Mixtral has no QKV bias, no shared expert and renormalizes its top-k "
                          "(no --moe-router-pre-softmax): this model does not convert to "
                          "Hugging Face")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": cfg.moe_ffn_size, "num_local_experts": cfg.num_experts,
            "sliding_window": window, **_moe_fields(cfg)}


def qwen2_moe_hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of ``Qwen2MoeForCausalLM`` for a loom MoE model with a gated shared
    expert and QKV biases. Raises ConfigError for what Qwen2-MoE does not express."""
    check_plain(cfg, "Qwen2-MoE", allowed=ROPE_SCALINGS)
    check_moe(cfg, "Qwen2-MoE")
    if not (cfg.add_qkv_bias and cfg.moe_shared_expert_gate):
        raise ConfigError("Qwen2-MoE needs --add-qkv-bias and --moe-shared-expert-gate with "
                          "its shared expert")
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
            "intermediate_size": cfg.ffn_size, "moe_intermediate_size": cfg.moe_ffn_size,
            "shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
            "num_experts": cfg.num_experts, "norm_topk_prob": not cfg.moe_router_pre_softmax,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True,
            "use_sliding_window": False, **_moe_fields(cfg)}


def loom_to_mixtral(full: Mapping[str, torch.Tensor], cfg: ModelConfig,
                    fused: bool = False) -> dict[str, torch.Tensor]:
    """Full loom tensors -> the MixtralForCausalLM state dict (checkpoint spelling:
    ``block_sparse_moe.experts.<i>.w1/w3/w2``; ``fused``: ``transformers``' memory)."""
    out = outer_to_hf(full, cfg)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(attention_to_hf(full, l, h, cfg))
        out.update(experts_to_hf(full, l, h, cfg.num_experts, fused, MIXTRAL_EXPERT,
                                 "mlp." if fused else "block_sparse_moe."))
    return out


def loom_to_qwen2_moe(full: Mapping[str, torch.Tensor], cfg: ModelConfig,
                      fused: bool = False) -> dict[str, torch.Tensor]:
    """Full loom tensors -> the Qwen2MoeForCausalLM state dict (experts per expert, or
    ``fused``)."""
    out = outer_to_hf(full, cfg)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(attention_to_hf(full, l, h, cfg))
        out.update(experts_to_hf(full, l, h, cfg.num_experts, fused))
        out.update(swiglu_to_hf(full, l + "mlp.shared_experts.", h + "mlp.shared_expert."))
        out[h + "mlp.shared_expert_gate.weight"] = full[l + "mlp.shared_expert_gate.weight"]
    return out
