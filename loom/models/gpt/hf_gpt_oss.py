"""Hugging Face ``GptOssForCausalLM`` <-> loom's GPT family with gpt-oss's flags
(``--quick-geglu``, ``--glu-linear-offset 1``, ``--activation-func-clamp-value``,
``--softmax-type learnable``, ``--window-size``, ``--window-attn-skip-freq``, biased experts and
router): full tensors by loom name (:func:`loom.interop.hf.load_full_state_dict` cuts each
rank's TP / EP shard).

Layout differences handled here:

* Experts: ``transformers`` stacks them, ``gate_up_proj [E, h, 2f]`` with gate and linear
  columns interleaved (gate at even indices) and ``down_proj [E, f, h]`` (both ``x @ W``);
  loom's ``linear_fc1`` holds ``[gate; linear]`` rows ``[2f, h]`` and ``linear_fc2`` ``[h, f]``.
* Sliding windows: HF's ``sliding_window`` W counts the query itself; Megatron's
  ``--window-size`` counts the keys before it: ``W - 1,0``. HF's ``layer_types`` become a
  ``--window-attn-skip-freq`` list (1 = sliding).
* RoPE: the default RoPE, or YaRN with exactly ``--enable-gpt-oss``'s values
  (:data:`~loom.config.model_gptoss.GPT_OSS_YARN`, unrounded correction range); other YaRN
  parameters (the published checkpoints' original context 4096) have no loom flag and are
  refused.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.config.model_gptoss import GPT_OSS_YARN
from loom.errors import ConfigError
from loom.models.gpt.hf_parts import check_plain, outer_to_hf

TITLE = "gpt-oss"


def _rope_fields(hf, where: str) -> dict:
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
                  or {})
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(rotary_base=float(theta))
    y = GPT_OSS_YARN
    same = (kind == "yarn" and params.get("truncate", True) is False
            and float(params.get("factor", 0)) == y["factor"]
            and int(params.get("original_max_position_embeddings", 0)) == y["original_max"]
            and float(params.get("beta_fast", 32.0)) == y["beta_fast"]
            and float(params.get("beta_slow", 1.0)) == y["beta_slow"]
            and params.get("attention_factor") is None)
    if not same:
        raise ConfigError(f"{where}: {TITLE} rope_parameters {params}: loom has the default RoPE "
                          f"and --enable-gpt-oss's YaRN (factor {y['factor']:g}, original "
                          f"context {y['original_max']}, beta {y['beta_fast']:g}/"
                          f"{y['beta_slow']:g}, truncate false) only")
    return dict(rotary_base=float(theta), enable_gpt_oss=True)


def gpt_oss_config(hf, where: str = "config.json") -> ModelConfig:
    """loom's flags for a ``transformers.GptOssConfig`` (or its ``config.json`` as a
    namespace). Raises ConfigError for what loom does not express."""
    if abs(getattr(hf, "swiglu_alpha", 1.702) - 1.702) > 1e-12:
        raise ConfigError(f"{where}: swiglu_alpha {hf.swiglu_alpha}: --quick-geglu is "
                          f"x sigmoid(1.702 x)")
    if not getattr(hf, "attention_bias", True):
        raise ConfigError(f"{where}: attention_bias false: loom's gpt-oss has linear biases "
                          f"everywhere")
    L = hf.num_hidden_layers
    types = list(getattr(hf, "layer_types", None) or
                 ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)])
    window = {}
    if hf.sliding_window and "sliding_attention" in types:
        pattern = [int(t == "sliding_attention") for t in types]
        freq = "2" if pattern == [int((i + 1) % 2 != 0) for i in range(L)] else str(pattern)
        window = dict(window_size=f"{hf.sliding_window - 1},0", window_attn_skip_freq=freq)
    return ModelConfig(
        num_layers=L, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
        group_query_attention=True, num_query_groups=hf.num_key_value_heads,
        kv_channels=hf.head_dim, ffn_hidden_size=hf.intermediate_size,
        num_experts=hf.num_local_experts, moe_ffn_hidden_size=hf.intermediate_size,
        moe_router_topk=hf.num_experts_per_tok, normalization="RMSNorm",
        norm_epsilon=hf.rms_norm_eps, position_embedding_type="rope",
        seq_length=hf.max_position_embeddings, max_position_embeddings=hf.max_position_embeddings,
        vocab_size=hf.vocab_size,
        untie_embeddings_and_output_weights=not getattr(hf, "tie_word_embeddings", False),
        quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=hf.swiglu_limit,
        softmax_type="learnable", hidden_dropout=0.0, attention_dropout=0.0,
        exclude_padded_vocab=True,
        **window, **_rope_fields(hf, where))


def gpt_oss_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``GptOssForCausalLM`` state dict -> loom names (q, k, v fused; experts unstacked, the
    interleaved gate / linear columns split into loom's halves)."""
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "final_layernorm.weight": sd["model.norm.weight"]}
    out["output_layer.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        at = h + "self_attn."
        out.update({
            l + "input_layernorm.weight": sd[h + "input_layernorm.weight"],
            l + "pre_mlp_layernorm.weight": sd[h + "post_attention_layernorm.weight"],
            l + "self_attention.linear_qkv.weight": torch.cat(
                [sd[at + f"{x}_proj.weight"] for x in "qkv"], dim=0),
            l + "self_attention.linear_qkv.bias": torch.cat(
                [sd[at + f"{x}_proj.bias"] for x in "qkv"], dim=0),
            l + "self_attention.linear_proj.weight": sd[at + "o_proj.weight"],
            l + "self_attention.linear_proj.bias": sd[at + "o_proj.bias"],
            l + "self_attention.core_attention.softmax_offset": sd[at + "sinks"],
            l + "mlp.router.weight": sd[h + "mlp.router.weight"],
            l + "mlp.router.bias": sd[h + "mlp.router.bias"],
        })
        gu, gub = sd[h + "mlp.experts.gate_up_proj"], sd[h + "mlp.experts.gate_up_proj_bias"]
        down, downb = sd[h + "mlp.experts.down_proj"], sd[h + "mlp.experts.down_proj_bias"]
        for e in range(cfg.num_experts):
            w = gu[e].t()  # [2f, h], rows gate, linear, gate, linear, ...
            x = f"{l}mlp.experts.{e}."
            out.update({x + "linear_fc1.weight": torch.cat([w[0::2], w[1::2]], dim=0),
                        x + "linear_fc1.bias": torch.cat([gub[e][0::2], gub[e][1::2]]),
                        x + "linear_fc2.weight": down[e].t(),
                        x + "linear_fc2.bias": downb[e]})
    return {k: v.contiguous() for k, v in out.items()}


def read_config(hf: dict, where: str) -> ModelConfig:
    """loom's flags of a gpt_oss ``config.json`` dict (its keys' defaults where absent)."""
    ns = SimpleNamespace(**{"tie_word_embeddings": False, "layer_types": None,
                            "swiglu_alpha": 1.702, "attention_bias": True, **hf})
    return gpt_oss_config(ns, where)


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of a gpt_oss ``config.json`` dict and state dict."""
    cfg = read_config(hf, where)
    return cfg, gpt_oss_to_loom(sd, cfg)


def gpt_oss_hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of ``GptOssForCausalLM`` for a loom model with gpt-oss's flags. Raises
    ConfigError for what it does not express."""
    check_plain(cfg, TITLE, allowed=("quick_geglu", "softmax_type", "window_size",
                                     "glu_linear_offset", "activation_func_clamp_value",
                                     "enable_gpt_oss"))
    needs = [flag for flag, ok in (
        ("--quick-geglu", cfg.quick_geglu), ("--glu-linear-offset 1", cfg.glu_linear_offset == 1.0),
        ("--activation-func-clamp-value", cfg.activation_func_clamp_value is not None),
        ("--softmax-type learnable", cfg.softmax_type == "learnable"),
        ("biases (no --disable-bias-linear)", not cfg.disable_bias_linear),
        ("RMSNorm", cfg.normalization == "RMSNorm"),
        ("--position-embedding-type rope", cfg.position_embedding_type == "rope"),
        ("--num-experts with every layer MoE", bool(cfg.num_experts) and all(
            cfg.is_moe_layer(i) for i in range(cfg.num_layers))),
        ("a softmax top-k router renormalized over k (no --moe-router-pre-softmax, no expert "
         "bias, groups or scaling)", cfg.moe_router_score_function == "softmax"
         and not (cfg.moe_router_pre_softmax or cfg.moe_router_enable_expert_bias
                  or cfg.moe_router_group_topk)
         and (cfg.moe_router_topk_scaling_factor or 1.0) == 1.0)) if not ok]
    if needs:
        raise ConfigError(f"{TITLE} export needs {needs[0]}: this model does not convert to "
                          f"Hugging Face")
    y = GPT_OSS_YARN
    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.enable_gpt_oss:
        rope.update(rope_type="yarn", factor=y["factor"],
                    original_max_position_embeddings=y["original_max"],
                    beta_fast=y["beta_fast"], beta_slow=y["beta_slow"], truncate=False)
    window = cfg.window
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.moe_ffn_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_kv_groups, "head_dim": cfg.head_dim,
            "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
            "rms_norm_eps": cfg.norm_epsilon, "max_position_embeddings": cfg.max_positions,
            "sliding_window": window[0] + 1 if window else None,
            "layer_types": ["sliding_attention" if cfg.is_window_layer(i) else "full_attention"
                            for i in range(cfg.num_layers)],
            "rope_parameters": rope, "swiglu_limit": cfg.activation_func_clamp_value,
            "attention_bias": True, "hidden_act": "silu",
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "router_aux_loss_coef": cfg.moe_aux_loss_coeff}


def _interleave(gate: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """Rows ``gate[0], linear[0], gate[1], ...`` (HF's gate / linear column order)."""
    return torch.stack([gate, linear], dim=1).reshape(-1, *gate.shape[1:])


def loom_to_gpt_oss(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full loom tensors -> the ``GptOssForCausalLM`` state dict (the inverse of
    :func:`gpt_oss_to_loom`: q, k, v split; experts stacked, gate / linear interleaved)."""
    a, g, d, f = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim, cfg.moe_ffn_size
    out = outer_to_hf(full, cfg)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        at, s = h + "self_attn.", l + "self_attention."
        out.update({h + "input_layernorm.weight": full[l + "input_layernorm.weight"],
                    h + "post_attention_layernorm.weight": full[l + "pre_mlp_layernorm.weight"],
                    at + "o_proj.weight": full[s + "linear_proj.weight"],
                    at + "o_proj.bias": full[s + "linear_proj.bias"],
                    at + "sinks": full[s + "core_attention.softmax_offset"],
                    h + "mlp.router.weight": full[l + "mlp.router.weight"],
                    h + "mlp.router.bias": full[l + "mlp.router.bias"]})
        for kind in ("weight", "bias"):
            q, k, v = full[s + f"linear_qkv.{kind}"].split([a * d, g * d, g * d], dim=0)
            out.update({at + f"q_proj.{kind}": q, at + f"k_proj.{kind}": k,
                        at + f"v_proj.{kind}": v})
        e = [f"{l}mlp.experts.{j}." for j in range(cfg.num_experts)]
        fc1 = [full[x + "linear_fc1.weight"].split([f, f]) for x in e]
        fc1b = [full[x + "linear_fc1.bias"].split([f, f]) for x in e]
        x = h + "mlp.experts."
        out[x + "gate_up_proj"] = torch.stack([_interleave(*w).t() for w in fc1])
        out[x + "gate_up_proj_bias"] = torch.stack([_interleave(*b) for b in fc1b])
        out[x + "down_proj"] = torch.stack([full[y + "linear_fc2.weight"].t() for y in e])
        out[x + "down_proj_bias"] = torch.stack([full[y + "linear_fc2.bias"] for y in e])
    return {k: v.contiguous() for k, v in out.items()}
