"""Hugging Face ``Qwen3NextForCausalLM`` (Qwen3-Next-80B-A3B: ``model_type: qwen3_next``) <->
loom's GPT family with Megatron's Qwen3-Next layers (:mod:`loom.config.model_gdn`).

Qwen3-Next (Qwen Team 2025) is, per ``layer_types``, Gated DeltaNet layers
(``linear_attention``: ``--experimental-attention-variant gdn``, the list as
``--linear-attention-freq``) and gated attention (``full_attention``: ``--attention-output-gate``,
per-head Q/K norms, RoPE on ``partial_rotary_factor`` of each head), each followed by a
softmax-routed MoE with a sigmoid-gated shared expert (Qwen2-MoE's, ``mlp_only_layers`` /
``decoder_sparse_step`` as ``--moe-layer-freq``) or a dense SwiGLU MLP. Layouts handled here:

* norms: Qwen3-Next's RMSNorms scale by ``1 + w`` (Megatron's ``--apply-layernorm-1p``);
  loom's hold the gain ``1 + w`` itself: 1 is added on import and taken off on export (the
  layers' two norms, the final norm, Q/K norms). The Gated DeltaNet's output norm
  (``Qwen3NextRMSNormGated``) scales by ``w``: copied.
* gated attention: ``q_proj`` holds per head ``[q (d); gate (d)]`` rows; loom's
  ``linear_qkv`` holds ``[Q; G; K; V]`` blocks.
* Gated DeltaNet: ``in_proj_qkvz`` holds per key head j ``[q_j (dk); k_j (dk); v_j (r dv);
  z_j (r dv)]`` and ``in_proj_ba`` ``[b_j (r); a_j (r)]`` (r = nv / nk value heads per key
  head); loom's ``in_proj`` holds ``[Q; K; V; Z; beta; alpha]`` blocks with the same head
  order within each, so the rows are regrouped, the convolution, ``A_log``, ``dt_bias`` and
  ``out_proj`` copied.

Its multi-token prediction layers (``mtp.*``, which transformers does not run) are not
imported; a loom model with ``--mtp-num-layers`` does not export.

Qwen3.5 (``qwen3_5_text`` / ``qwen3_5_moe_text``, or the Hub's vision-language ``qwen3_5`` /
``qwen3_5_moe`` whose ``text_config`` and ``model.language_model.*`` tensors are the language
model; the vision tower is not imported) imports through the same layers: its Gated DeltaNet
projections are stored apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``: loom's
blocks as they are), its RoPE is multimodal (``mrope_section``), which on text (one position
per token, the same on its three axes) is the 1-D RoPE loom computes. A loom model exports as
Qwen3-Next, the same math.
"""

from __future__ import annotations

from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.gpt.hf_moe import experts_to_hf, experts_to_loom
from loom.models.gpt.hf_parts import (check_plain, llama_shape_to_hf, outer_to_hf,
                                      outer_to_loom, shape_from_hf, swiglu_to_hf,
                                      swiglu_to_loom)
from loom.models.gpt.hf_phi3 import partial_rotary

TITLE = "Qwen3-Next"
QWEN35_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
"""Qwen3.5's ``model_type`` values (text models, and the vision-language models' language
model)."""


def text_config(hf: dict) -> dict:
    """The language model's config of a ``config.json`` dict: Qwen3.5's vision-language
    ``text_config`` (its ``tie_word_embeddings`` from the top level when not its own), else
    the dict itself."""
    text = hf.get("text_config")
    if hf.get("model_type") not in ("qwen3_5", "qwen3_5_moe") or not isinstance(text, dict):
        return hf
    return {"tie_word_embeddings": hf.get("tie_word_embeddings", False), **text}


def text_tensors(sd: Mapping[str, torch.Tensor]) -> dict:
    """The language model's tensors of a Qwen3.5 vision-language state dict
    (``model.language_model.*`` as ``model.*``; the vision tower and MTP layers left out);
    another state dict as it is."""
    if not any(k.startswith("model.language_model.") for k in sd):
        return dict(sd)
    return {k.replace("model.language_model.", "model.", 1): v for k, v in sd.items()
            if k.startswith(("model.language_model.", "lm_head."))}


def _layer_types(hf: dict) -> list:
    """``layer_types`` of a config dict (transformers' default when absent: every
    ``full_attention_interval``-th layer full attention, the rest linear)."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    n = hf.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % n == 0 else "linear_attention"
            for i in range(hf["num_hidden_layers"])]


def _moe_layers(hf: dict) -> list:
    """Whether each layer is MoE (transformers' ``Qwen3NextDecoderLayer``: not in
    ``mlp_only_layers``, experts > 0, ``(i + 1) % decoder_sparse_step == 0``)."""
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or ())
    return [i not in dense and (hf.get("num_experts") or 0) > 0 and (i + 1) % step == 0
            for i in range(hf["num_hidden_layers"])]


def read_config(hf: dict, where: str) -> ModelConfig:
    """loom's layout of a ``qwen3_next`` ``config.json`` dict (``where``: the source, for
    messages); ConfigError for attention biases (on ``o_proj`` too), an activation other than
    SiLU or a RoPE scaling loom does not compute."""
    hf = text_config(hf)
    if "intermediate_size" not in hf:  # Qwen3.5-MoE: no dense MLP, so no dense width
        hf = {**hf, "intermediate_size": hf["moe_intermediate_size"]}
    shape = shape_from_hf(hf, TITLE, where)
    types, moe_layers = _layer_types(hf), _moe_layers(hf)
    linear = [int(t == "linear_attention") for t in types]
    gdn = {} if not any(linear) else dict(
        experimental_attention_variant="gdn", linear_attention_freq=str(linear),
        linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
        linear_key_head_dim=hf["linear_key_head_dim"],
        linear_value_head_dim=hf["linear_value_head_dim"],
        linear_num_key_heads=hf["linear_num_key_heads"],
        linear_num_value_heads=hf["linear_num_value_heads"])
    moe = {} if not any(moe_layers) else dict(
        num_experts=hf["num_experts"], moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_layer_freq=str([int(x) for x in moe_layers]),
        moe_router_pre_softmax=not hf.get("norm_topk_prob", True),
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef") or 0.0),
        moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
        moe_shared_expert_gate=True)
    return ModelConfig.llama(
        norm_epsilon=hf.get("rms_norm_eps", 1e-6), apply_layernorm_1p=True, qk_layernorm=True,
        attention_output_gate=True, rotary_percent=partial_rotary(hf), **shape, **gdn, **moe)


# (HF name, loom name) of a layer's two norms (zero-centred in HF, the gain in loom)
_NORMS = (("input_layernorm", "input_layernorm"),
          ("post_attention_layernorm", "pre_mlp_layernorm"))


def _gated_attention(sd: Mapping, h: str, l: str, cfg: ModelConfig, to_loom: bool) -> dict:
    """Gated attention's tensors, HF prefix ``h`` <-> loom prefix ``l``."""
    a, g, d = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim
    hs, ls = h + "self_attn.", l + "self_attention."
    if to_loom:
        qg = sd[hs + "q_proj.weight"].view(a, 2, d, -1)
        return {ls + "linear_qkv.weight": torch.cat(
                    [qg[:, 0].reshape(a * d, -1), qg[:, 1].reshape(a * d, -1),
                     sd[hs + "k_proj.weight"], sd[hs + "v_proj.weight"]], dim=0),
                ls + "linear_proj.weight": sd[hs + "o_proj.weight"],
                ls + "q_layernorm.weight": sd[hs + "q_norm.weight"] + 1.0,
                ls + "k_layernorm.weight": sd[hs + "k_norm.weight"] + 1.0}
    q, gate, k, v = sd[ls + "linear_qkv.weight"].split([a * d, a * d, g * d, g * d], dim=0)
    return {hs + "q_proj.weight": torch.stack([q.view(a, d, -1), gate.view(a, d, -1)], dim=1)
            .reshape(2 * a * d, -1),
            hs + "k_proj.weight": k, hs + "v_proj.weight": v,
            hs + "o_proj.weight": sd[ls + "linear_proj.weight"],
            hs + "q_norm.weight": sd[ls + "q_layernorm.weight"] - 1.0,
            hs + "k_norm.weight": sd[ls + "k_layernorm.weight"] - 1.0}


def _gated_delta_net(sd: Mapping, h: str, l: str, cfg: ModelConfig, to_loom: bool) -> dict:
    """A Gated DeltaNet layer's tensors, HF prefix ``h`` <-> loom prefix ``l``."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    hs, ls = h + "linear_attn.", l + "self_attention."
    same = (("conv1d.weight", "conv1d.weight"), ("A_log", "A_log"), ("dt_bias", "dt_bias"),
            ("norm.weight", "out_norm.weight"), ("out_proj.weight", "out_proj.weight"))
    if to_loom and hs + "in_proj_qkv.weight" in sd:  # Qwen3.5: loom's blocks, stored apart
        out = {ls + "in_proj.weight": torch.cat([sd[hs + f"in_proj_{x}.weight"]
                                                 for x in ("qkv", "z", "b", "a")])}
        return {**out, **{ls + b: sd[hs + a] for a, b in same}}
    if to_loom:
        qkvz = sd[hs + "in_proj_qkvz.weight"].view(nk, 2 * dk + 2 * r * dv, -1)
        ba = sd[hs + "in_proj_ba.weight"].view(nk, 2 * r, -1)
        blocks = [*qkvz.split([dk, dk, r * dv, r * dv], dim=1), *ba.split([r, r], dim=1)]
        out = {ls + "in_proj.weight": torch.cat([x.reshape(-1, x.shape[-1]) for x in blocks])}
        return {**out, **{ls + b: sd[hs + a] for a, b in same}}
    blocks = sd[ls + "in_proj.weight"].split([nk * dk, nk * dk, nv * dv, nv * dv, nv, nv])
    out = {hs + "in_proj_qkvz.weight": _per_key_head(blocks[:4], nk),
           hs + "in_proj_ba.weight": _per_key_head(blocks[4:], nk)}
    return {**out, **{hs + a: sd[ls + b] for a, b in same}}


def _per_key_head(blocks, nk: int) -> torch.Tensor:
    """Row blocks ``[X1; X2; ...]`` (each ``[nk n_i, h]``) regrouped per key head:
    ``[X1_0; X2_0; ...; X1_1; X2_1; ...]``."""
    return torch.cat([x.reshape(nk, -1, x.shape[-1]) for x in blocks], dim=1) \
        .reshape(-1, blocks[0].shape[-1])


def qwen3_next_to_loom(sd: Mapping[str, torch.Tensor],
                       cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``Qwen3NextForCausalLM`` state dict (experts either spelling) -> full loom tensors
    (MTP layers left out)."""
    out = outer_to_loom(sd)
    out["final_layernorm.weight"] = sd["model.norm.weight"] + 1.0
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        mixer = _gated_delta_net if cfg.is_gdn_layer(i) else _gated_attention
        out.update(mixer(sd, h, l, cfg, to_loom=True))
        out.update({l + b + ".weight": sd[h + a + ".weight"] + 1.0 for a, b in _NORMS})
        if cfg.is_moe_layer(i):
            out.update(experts_to_loom(sd, h, l, cfg.num_experts))
            out.update(swiglu_to_loom(sd, h + "mlp.shared_expert.", l + "mlp.shared_experts."))
            out[l + "mlp.shared_expert_gate.weight"] = sd[h + "mlp.shared_expert_gate.weight"]
        else:
            out.update(swiglu_to_loom(sd, h + "mlp.", l + "mlp."))
    return out


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of a ``qwen3_next`` or Qwen3.5 config and state
    dict."""
    cfg = read_config(hf, where)
    return cfg, qwen3_next_to_loom(text_tensors(sd), cfg)


def qwen3_next_hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of ``Qwen3NextForCausalLM`` for a loom model with Qwen3-Next's layers
    (``--attention-output-gate`` and ``--qk-layernorm`` on its attention layers, which
    Qwen3NextAttention always has). ConfigError for an option the class does not express (a
    router other than softmax top-k, an ungated or missing shared expert, MTP, biases)."""
    check_plain(cfg, TITLE, allowed=("rotary_percent", "qk_layernorm"))
    if not (cfg.attention_output_gate and cfg.qk_layernorm and cfg.swiglu
            and cfg.normalization == "RMSNorm" and cfg.disable_bias_linear
            and not cfg.add_qkv_bias and cfg.position_embedding_type == "rope"):
        raise ConfigError(f"{TITLE} export needs --attention-output-gate, --qk-layernorm, "
                          f"--swiglu, RMSNorm, RoPE and no linear biases")
    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    if any(moe) and (cfg.moe_router_score_function != "softmax" or cfg.moe_router_num_groups
                     or cfg.moe_router_enable_expert_bias
                     or (cfg.moe_router_topk_scaling_factor or 1.0) != 1.0
                     or not cfg.moe_shared_expert_intermediate_size
                     or not cfg.moe_shared_expert_gate):
        raise ConfigError(f"{TITLE}: its MoE layers route by softmax top-k (no groups, expert "
                          f"bias or scaling) and add a shared expert with a sigmoid gate "
                          f"(--moe-shared-expert-intermediate-size, --moe-shared-expert-gate)")
    gdn = cfg.gated_delta_net
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            **llama_shape_to_hf(cfg), "attention_bias": False,
            "layer_types": ["linear_attention" if cfg.is_gdn_layer(i) else "full_attention"
                            for i in range(cfg.num_layers)],
            "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim if gdn else 4,
            "linear_key_head_dim": cfg.linear_key_head_dim,
            "linear_value_head_dim": cfg.linear_value_head_dim,
            "linear_num_key_heads": cfg.linear_num_key_heads,
            "linear_num_value_heads": cfg.linear_num_value_heads,
            "num_experts": cfg.num_experts or 0, "num_experts_per_tok": cfg.moe_router_topk,
            "moe_intermediate_size": cfg.moe_ffn_size if cfg.num_experts else cfg.ffn_size,
            "shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size or 0,
            "norm_topk_prob": not cfg.moe_router_pre_softmax, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, m in enumerate(moe) if not m],
            "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base,
                                "partial_rotary_factor": cfg.rotary_percent}}


def loom_to_qwen3_next(full: Mapping[str, torch.Tensor],
                       cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full loom tensors -> the ``Qwen3NextForCausalLM`` state dict (the inverse of
    :func:`qwen3_next_to_loom`; experts per expert, vocabulary padding dropped)."""
    qwen3_next_hf_config(cfg)  # refuses what it cannot express
    out = outer_to_hf(full, cfg)
    out["model.norm.weight"] = full["final_layernorm.weight"] - 1.0
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        mixer = _gated_delta_net if cfg.is_gdn_layer(i) else _gated_attention
        out.update(mixer(full, h, l, cfg, to_loom=False))
        out.update({h + a + ".weight": full[l + b + ".weight"] - 1.0 for a, b in _NORMS})
        if cfg.is_moe_layer(i):
            out.update(experts_to_hf(full, l, h, cfg.num_experts, fused=False))
            out.update(swiglu_to_hf(full, l + "mlp.shared_experts.", h + "mlp.shared_expert."))
            out[h + "mlp.shared_expert_gate.weight"] = full[l + "mlp.shared_expert_gate.weight"]
        else:
            out.update(swiglu_to_hf(full, l + "mlp.", h + "mlp."))
    return {k: v.contiguous() for k, v in out.items()}
