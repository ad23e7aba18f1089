"""Hugging Face ``Glm4MoeForCausalLM`` (GLM-4.5, GLM-4.5-Air, GLM-4.6: ``model_type:
glm4_moe``) <-> loom's GPT family.

GLM-4.5 (GLM-4.5 Team 2025, "GLM-4.5: Agentic, Reasoning, and Coding (ARC) Foundation Models",
arXiv 2508.06471, sec. 2.1) is grouped-query attention with QKV biases (``--add-qkv-bias``),
optional per-head Q/K RMSNorm before RoPE (``use_qk_norm``: ``--qk-layernorm``, as Qwen3) and
RoPE on the first ``partial_rotary_factor`` of each head (0.5: ``--rotary-percent``; halves
rotated, as loom), then DeepSeek-V3's MoE: sigmoid scores with the aux-loss-free expert bias,
top-k normalized and scaled, groups scored by their top 2 experts, shared experts, dense
first layers (:func:`~loom.models.gpt.hf_deepseek.sigmoid_routing`,
:func:`~loom.models.gpt.hf_deepseek.mlp_tensors`). Its multi-token prediction layers
(``model.layers.<L>``, which transformers does not run) are not imported; a loom model with
``--mtp-num-layers`` does not export.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.gpt.hf_deepseek import first_dense, mlp_tensors, sigmoid_routing
from loom.models.gpt.hf_parts import (attention_to_hf, attention_to_loom, check_plain,
                                      llama_shape_to_hf, outer_to_hf, outer_to_loom,
                                      shape_from_hf)
from loom.models.gpt.hf_phi3 import partial_rotary

TITLE = "GLM-4.5"


def read_config(hf: dict, where: str, exact: bool = False) -> ModelConfig:
    """loom's layout of a ``glm4_moe`` ``config.json`` dict (``where``: the source, for
    messages); ConfigError for what loom does not express (``exact``: also a group score
    Megatron computes otherwise, as the weights' import needs; the planner reads it as
    Megatron's)."""
    ns = SimpleNamespace(**hf)
    L, k = hf["num_hidden_layers"], hf["num_experts_per_tok"]
    dense = min(hf.get("first_k_dense_replace", 0) or 0, L)
    # its attention_bias is on q, k, v only (--add-qkv-bias)
    shape = shape_from_hf({**hf, "attention_bias": False}, TITLE, where)
    try:
        moe = {} if dense >= L else dict(
            num_experts=hf["n_routed_experts"], moe_router_topk=k,
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_layer_freq=f"([0]*{dense}+[1]*{L - dense})",
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            **sigmoid_routing(ns, k, exact, TITLE))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if moe and hf.get("n_shared_experts"):
        moe["moe_shared_expert_intermediate_size"] = \
            hf["n_shared_experts"] * hf["moe_intermediate_size"]
    return ModelConfig.llama(
        norm_epsilon=hf.get("rms_norm_eps", 1e-5), add_qkv_bias=bool(hf.get("attention_bias")),
        qk_layernorm=bool(hf.get("use_qk_norm")), rotary_percent=partial_rotary(hf), **shape,
        **moe)


def glm4_moe_to_loom(sd: Mapping[str, torch.Tensor],
                     cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``Glm4MoeForCausalLM`` state dict -> full loom tensors (MTP layers left out)."""
    out = outer_to_loom(sd)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(attention_to_loom(sd, h, l))
        out.update(mlp_tensors(sd, h, l, cfg, cfg.is_moe_layer(i), to_loom=True))
    return out


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of a ``glm4_moe`` config and state dict."""
    cfg = read_config(hf, where, exact=True)
    return cfg, glm4_moe_to_loom(sd, cfg)


def is_glm4_moe(cfg: ModelConfig) -> bool:
    """Whether a loom MoE model (not MLA) exports as GLM-4.5: its experts route by sigmoid
    scores (DeepSeek-V3's router on grouped-query attention)."""
    return bool(cfg.num_experts) and cfg.moe_router_score_function == "sigmoid"


def glm4_moe_hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of ``Glm4MoeForCausalLM`` for a loom model :func:`is_glm4_moe` picks;
    ConfigError for an option it does not express (a window, MTP, a group score transformers
    computes otherwise, dense layers after MoE ones, a gated shared expert)."""
    check_plain(cfg, TITLE, allowed=("rotary_percent", "qk_layernorm"))
    if not (cfg.swiglu and cfg.normalization == "RMSNorm" and cfg.disable_bias_linear
            and cfg.position_embedding_type == "rope"):
        raise ConfigError(f"{TITLE} export needs RMSNorm, RoPE, --swiglu and "
                          f"--disable-bias-linear (--add-qkv-bias allowed)")
    k, f_moe = cfg.moe_router_topk, cfg.moe_ffn_size
    groups, gk = cfg.moe_router_num_groups or 1, cfg.moe_router_group_topk or 1
    if groups > 1 and k // gk != 2:
        raise ConfigError(f"{TITLE}: --moe-router-group-topk {gk} with --moe-router-topk {k}: "
                          f"transformers scores a group by its top 2 experts, loom by the sum "
                          f"of its top k / group_topk; they agree when that is 2")
    shared = cfg.moe_shared_expert_intermediate_size or 0
    if shared % f_moe or cfg.moe_shared_expert_gate:
        raise ConfigError(f"{TITLE}: --moe-shared-expert-intermediate-size {shared} must be a "
                          f"multiple of --moe-ffn-hidden-size {f_moe} (n_shared_experts), "
                          f"without --moe-shared-expert-gate")
    return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
            **llama_shape_to_hf(cfg), "attention_bias": cfg.add_qkv_bias,
            "use_qk_norm": cfg.qk_layernorm, "moe_intermediate_size": f_moe,
            "n_routed_experts": cfg.num_experts, "num_experts_per_tok": k,
            "n_shared_experts": shared // f_moe, "n_group": groups, "topk_group": gk,
            "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
            "norm_topk_prob": True, "first_k_dense_replace": first_dense(cfg, TITLE),
            "num_nextn_predict_layers": 0,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base,
                                "partial_rotary_factor": cfg.rotary_percent}}


def loom_to_glm4_moe(full: Mapping[str, torch.Tensor],
                     cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full loom tensors -> the ``Glm4MoeForCausalLM`` state dict (experts per expert as its
    checkpoints store them; a zero ``e_score_correction_bias`` for a router without
    ``--moe-router-enable-expert-bias``, the same routing; vocabulary padding dropped)."""
    glm4_moe_hf_config(cfg)  # refuses what it cannot express
    out = outer_to_hf(full, cfg)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(attention_to_hf(full, l, h, cfg))
        out.update(mlp_tensors(full, h, l, cfg, cfg.is_moe_layer(i), to_loom=False))
        if cfg.is_moe_layer(i) and h + "mlp.gate.e_score_correction_bias" not in out:
            out[h + "mlp.gate.e_score_correction_bias"] = torch.zeros(cfg.num_experts)
    return {k: v.contiguous() for k, v in out.items()}
