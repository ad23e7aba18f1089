"""Hugging Face ``transformers`` <-> loom for the GPT family: full (unsharded) tensors under
loom's parameter names, both ways (``loom checkpoint convert``; resharding to a layout is
:func:`loom.interop.hf.load_full_state_dict`), and the ``config.json`` of the matching
``transformers`` class. The dense layouts live here (GPT2LMHeadModel, LlamaForCausalLM,
Qwen2ForCausalLM: LLaMA with QKV biases, Qwen3ForCausalLM: LLaMA with Q/K norms,
MistralForCausalLM: LLaMA with a sliding window); :func:`layout_of` picks the class a model
exports to, :data:`IMPORTS` the reader of a ``model_type``: Phi-3 (:mod:`.hf_phi3`), Nemotron-4
(:mod:`.hf_nemotron`), GLM-4.5 (:mod:`.hf_glm4_moe`), Qwen3-Next (:mod:`.hf_qwen3_next`), Mixtral /
Qwen2-MoE (:mod:`.hf_moe`), Qwen3-MoE (:mod:`.hf_qwen3_moe`), DeepSeek-V2 / V3
(:mod:`.hf_deepseek`), gpt-oss (:mod:`.hf_gpt_oss`), Llama 4's text model (:mod:`.hf_llama4`, import only), the
shared pieces in :mod:`.hf_parts`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.family import HFConversion
from loom.models.gpt import (hf_deepseek, hf_glm4_moe, hf_gpt_oss, hf_llama4, hf_moe,
                             hf_nemotron, hf_phi3, hf_qwen3_moe, hf_qwen3_next)
from loom.models.gpt.hf_parts import (ROPE_SCALINGS, attention_to_hf, attention_to_loom,
                                      check_plain, hf_sliding_window, llama_shape_to_hf,
                                      mistral_window, outer_to_hf, outer_to_loom, rope_fields,
                                      rope_to_hf, swiglu_to_hf, swiglu_to_loom)


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
    """loom's LLaMA layout for a ``transformers.LlamaConfig`` (``Qwen2Config``: with
    ``--add-qkv-bias``; ``Qwen3Config``: with ``--qk-layernorm``, per-head RMSNorm on queries
    and keys before RoPE, Qwen Team 2025, arXiv 2505.09388 sec. 2, and its own ``head_dim``;
    ``MistralConfig``: its ``sliding_window`` W as ``--window-size W-1,0``, every layer: the
    query at p sees the keys p - W < j <= p, transformers' ``sliding_window_causal_mask``;
    Jiang et al. 2023, "Mistral 7B", sec. 2)."""
    kind = getattr(hf_config, "model_type", "llama")
    qwen2, qwen3 = kind == "qwen2", kind == "qwen3"
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ConfigError("LLaMA with attention_bias / mlp_bias (o_proj or MLP biases) has no "
                          "loom layout")
    if (qwen2 or qwen3) and getattr(hf_config, "use_sliding_window", False):
        raise ConfigError(f"{'Qwen2' if qwen2 else 'Qwen3'} with use_sliding_window is not "
                          f"supported")
    title = "Qwen2" if qwen2 else "Qwen3" if qwen3 else "Mistral" if kind == "mistral" else \
        "LLaMA"
    return ModelConfig.llama(
        window_size=mistral_window(hf_config) if kind == "mistral" else None,
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None),
        ffn_hidden_size=hf_config.intermediate_size,
        seq_length=hf_config.max_position_embeddings,
        max_position_embeddings=hf_config.max_position_embeddings,
        vocab_size=hf_config.vocab_size, norm_epsilon=hf_config.rms_norm_eps,
        add_qkv_bias=qwen2, qk_layernorm=qwen3, **rope_fields(hf_config, title),
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
    """LlamaForCausalLM / Qwen2ForCausalLM state dict -> loom names (q, k, v fused with their
    biases if any; gate, up fused)."""
    out = outer_to_loom(sd)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(attention_to_loom(sd, h, l))
        out.update(swiglu_to_loom(sd, h + "mlp.", l + "mlp."))
    return out


def dense_layout(cfg: ModelConfig) -> str:
    """``gpt2``, ``llama``, ``qwen2`` (LLaMA with QKV biases), ``qwen3`` (LLaMA with Q/K
    norms) or ``mistral`` (LLaMA with a sliding window on every layer); raises ConfigError for
    a dense model none of those HF classes expresses (naming the first option in
    :data:`~loom.models.gpt.hf_parts.PLAIN_LAYOUT` it sets)."""
    gpt2 = (cfg.normalization == "LayerNorm" and cfg.position_embedding_type == "learned_absolute"
            and not cfg.swiglu and not cfg.disable_bias_linear
            and not cfg.untie_embeddings_and_output_weights)
    llama = (cfg.normalization == "RMSNorm" and cfg.position_embedding_type == "rope"
             and cfg.swiglu and cfg.disable_bias_linear)
    windowed = cfg.window is not None and llama and not cfg.add_qkv_bias and \
        not cfg.qk_layernorm  # Mistral: LLaMA with a window (Qwen2/3's window is refused)
    if windowed:
        hf_sliding_window(cfg, "Mistral")
    check_plain(cfg, "GPT-2 or LLaMA", allowed=ROPE_SCALINGS + (
        ("qk_layernorm",) if not cfg.add_qkv_bias and cfg.normalization == "RMSNorm" else ())
        + (("window_size",) if windowed else ()))
    if not (gpt2 or llama):
        raise ConfigError("only the GPT-2 layout (LayerNorm, learned positions, GeLU, biases, "
                          "tied embeddings) and the LLaMA / Qwen2 layout (RMSNorm, RoPE, "
                          "SwiGLU, no biases but --add-qkv-bias) convert to Hugging Face")
    return "gpt2" if gpt2 else "qwen2" if cfg.add_qkv_bias else \
        "qwen3" if cfg.qk_layernorm else "mistral" if windowed else "llama"


def layout_of(cfg: ModelConfig) -> str:
    """The ``transformers`` class family a GPT-family model exports to (a key of
    :data:`LAYOUTS`): DeepSeek-V2 for MLA with softmax-routed experts, DeepSeek-V3 for other
    MLA, gpt-oss for its flags, GLM-4.5 for sigmoid-routed MoE, Qwen3-MoE / Qwen2-MoE / Mixtral
    for other MoE models (Q/K norms / a shared expert / neither), Nemotron-4 for LayerNorm 1p with squared ReLU, Phi-3 for the
    LLaMA layout with partial RoPE, else the dense ones.
    Qwen3-Next for gated attention or Gated DeltaNet layers.
    Raises ConfigError for a model none expresses (a latent MoE, probabilities on the expert
    input, DSA's layers)."""
    if cfg.apply_residual_connection_post_layernorm:
        raise ConfigError("--apply-residual-connection-post-layernorm has no Hugging Face "
                          "layout loom exports to (their layers add the residual before the "
                          "LayerNorm): keep the checkpoint in loom's or Megatron's format")
    if cfg.dsa:
        raise ConfigError("DeepSeek sparse attention (--experimental-attention-variant dsa) "
                          "has no Hugging Face export in loom yet (DeepseekV32's indexer)")
    if cfg.num_experts and cfg.moe_latent_size:
        raise ConfigError("--moe-latent-size: no Hugging Face MoE class loom exports to has the "
                          "latent MoE's projections (fc1/fc2_latent_proj); keep the model in "
                          "loom or Megatron format")
    if cfg.num_experts and cfg.moe_apply_probs_on_input:
        raise ConfigError("--moe-apply-probs-on-input: the Hugging Face MoE classes weigh the "
                          "expert outputs, not their inputs; keep the model in loom or "
                          "Megatron format")
    if cfg.attention_output_gate or cfg.gated_delta_net:
        return "qwen3_next"
    if cfg.multi_latent_attention:
        return "deepseek_v2" if hf_deepseek.is_v2(cfg) else "deepseek_v3"
    if cfg.quick_geglu or cfg.softmax_type != "vanilla" or cfg.enable_gpt_oss:
        return "gpt_oss"
    if hf_glm4_moe.is_glm4_moe(cfg):
        return "glm4_moe"
    if cfg.num_experts:
        return "qwen3_moe" if cfg.qk_layernorm else \
            "qwen2_moe" if cfg.moe_shared_expert_intermediate_size else "mixtral"
    if hf_nemotron.is_nemotron(cfg):
        return "nemotron"
    if cfg.rotary_percent < 1 and cfg.position_embedding_type == "rope" and \
            cfg.normalization == "RMSNorm" and cfg.swiglu and not cfg.add_qkv_bias:
        return "phi3"  # LLaMA whose RoPE rotates part of each head
    return dense_layout(cfg)


def dense_hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM,
    Qwen3ForCausalLM or MistralForCausalLM."""
    layout = dense_layout(cfg)
    if layout == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "vocab_size": cfg.vocab_size, "n_positions": cfg.max_positions,
                "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
                "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_size,
                "activation_function": "gelu_new" if cfg.openai_gelu else "gelu",
                "layer_norm_epsilon": cfg.norm_epsilon, "tie_word_embeddings": True,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    common = {**llama_shape_to_hf(cfg), **rope_to_hf(cfg)}
    if layout == "qwen2":
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "use_sliding_window": False, **common}
    if layout == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "use_sliding_window": False, "attention_bias": False, **common}
    if layout == "mistral":
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "sliding_window": hf_sliding_window(cfg, "Mistral"), **common}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "attention_bias": False, "mlp_bias": False, **common}


def loom_to_dense(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full loom tensors (vocabulary padding dropped here) -> the GPT-2 / LLaMA / Qwen2 state
    dict."""
    V = cfg.vocab_size
    out: dict[str, torch.Tensor] = {}
    if dense_layout(cfg) == "gpt2":
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
    out = outer_to_hf(full, cfg)
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(attention_to_hf(full, l, h, cfg))
        out.update(swiglu_to_hf(full, l + "mlp.", h + "mlp."))
    return {k: v.contiguous() for k, v in out.items()}


# layout -> (config.json of the transformers class, full loom tensors -> its state dict)
LAYOUTS = {
    "gpt2": (dense_hf_config, loom_to_dense), "llama": (dense_hf_config, loom_to_dense),
    "qwen2": (dense_hf_config, loom_to_dense), "qwen3": (dense_hf_config, loom_to_dense),
    "mistral": (dense_hf_config, loom_to_dense),
    "phi3": (hf_phi3.phi3_hf_config, hf_phi3.loom_to_phi3),
    "nemotron": (hf_nemotron.nemotron_hf_config, hf_nemotron.loom_to_nemotron),
    "glm4_moe": (hf_glm4_moe.glm4_moe_hf_config, hf_glm4_moe.loom_to_glm4_moe),
    "qwen3_next": (hf_qwen3_next.qwen3_next_hf_config, hf_qwen3_next.loom_to_qwen3_next),
    "mixtral": (hf_moe.mixtral_hf_config, hf_moe.loom_to_mixtral),
    "qwen2_moe": (hf_moe.qwen2_moe_hf_config, hf_moe.loom_to_qwen2_moe),
    "qwen3_moe": (hf_qwen3_moe.qwen3_moe_hf_config, hf_qwen3_moe.loom_to_qwen3_moe),
    "deepseek_v2": (hf_deepseek.hf_config, hf_deepseek.loom_to_deepseek_v3),
    "deepseek_v3": (hf_deepseek.hf_config, hf_deepseek.loom_to_deepseek_v3),
    "gpt_oss": (hf_gpt_oss.gpt_oss_hf_config, hf_gpt_oss.loom_to_gpt_oss)}


def hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of the ``transformers`` class :func:`layout_of` picks. Raises
    ConfigError for a model it does not express."""
    return LAYOUTS[layout_of(cfg)][0](cfg)


def loom_to_hf(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full loom tensors (vocabulary padding dropped here) -> the state dict of the class
    :func:`layout_of` picks, as its checkpoints store it."""
    return LAYOUTS[layout_of(cfg)][1](full, cfg)


def _moe_config(to_cfg):
    def read(hf: dict, where: str) -> ModelConfig:
        try:
            return to_cfg(SimpleNamespace(**{"tie_word_embeddings": False, **hf}))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    return read


def _moe_import(read, convert):
    def imports(hf: dict, sd: Mapping, where: str) -> tuple:
        cfg = read(hf, where)
        return cfg, convert(sd, cfg)
    return imports


# config.json model_type -> the module reading it (its read_config and to_loom); Kimi K2 is
# DeepSeek-V3's architecture under its own model_type (Moonshot's config.json)
MODULES = {"deepseek_v2": hf_deepseek, "deepseek_v3": hf_deepseek, "kimi_k2": hf_deepseek,
           "gpt_oss": hf_gpt_oss, "llama4_text": hf_llama4, "phi3": hf_phi3,
           "nemotron": hf_nemotron, "glm4_moe": hf_glm4_moe,
           **{kind: hf_qwen3_next for kind in ("qwen3_next",) + hf_qwen3_next.QWEN35_TYPES}}
_MOE = {"mixtral": (hf_moe.mixtral_config, hf_moe.mixtral_to_loom),
        "qwen2_moe": (hf_moe.qwen2_moe_config, hf_moe.qwen2_moe_to_loom),
        "qwen3_moe": (hf_qwen3_moe.qwen3_moe_config, hf_qwen3_moe.qwen3_moe_to_loom)}
# config.json model_type -> (hf config dict, where) -> ModelConfig, for the types imported
# by their own readers (the rest: GPT-2 or LLaMA, :func:`read_config`)
CONFIGS = {**{kind: m.read_config for kind, m in MODULES.items()},
           **{kind: _moe_config(read) for kind, (read, _) in _MOE.items()}}
# config.json model_type -> (hf config dict, state dict, where) -> (ModelConfig, full tensors)
IMPORTS = {**{kind: m.to_loom for kind, m in MODULES.items()},
           **{kind: _moe_import(CONFIGS[kind], convert) for kind, (_, convert) in _MOE.items()}}


def read_config(hf: dict, where: str) -> ModelConfig:
    """The :class:`ModelConfig` of a ``config.json`` dict of any ``model_type`` in :data:`HF`,
    without weights (``loom plan --from-hf``; DeepSeek-V3 with the MTP depth the file
    declares, which :func:`to_loom` imports when the weights hold it). ConfigError naming
    ``where`` for what loom does not express."""
    kind = hf.get("model_type")
    if kind in CONFIGS:
        cfg = CONFIGS[kind](hf, where)
        if kind in ("deepseek_v3", "kimi_k2") and hf_deepseek.mtp_depth(hf):
            cfg.mtp_num_layers = hf_deepseek.mtp_depth(hf)
        return cfg
    gpt2 = kind == "gpt2"
    ns = SimpleNamespace(**{"n_inner": None, "tie_word_embeddings": gpt2, **hf})
    try:
        return gpt2_config(ns) if gpt2 else llama_config(ns)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of a ``config.json`` dict and state dict of any
    ``model_type`` in :data:`HF` (``where``: the source, for messages)."""
    if hf.get("model_type") in IMPORTS:
        return IMPORTS[hf["model_type"]](hf, sd, where)
    cfg = read_config(hf, where)
    return cfg, (gpt2_to_loom if hf.get("model_type") == "gpt2" else llama_to_loom)(sd, cfg)


HF = HFConversion(model_types=("gpt2", "llama", "qwen2", "qwen3", "mistral", "phi3", "nemotron",
                               "mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next",
                               *hf_qwen3_next.QWEN35_TYPES, "glm4_moe", "deepseek_v2",
                               "deepseek_v3", "kimi_k2", "gpt_oss", "llama4_text"),
                  to_loom=to_loom, export_config=hf_config, from_loom=loom_to_hf,
                  read_config=read_config,
                  title="GPT-2 / LLaMA / Qwen2 / Qwen3 / Mistral / Phi-3 / Nemotron / Mixtral / "
                        "Qwen2-MoE / Qwen3-Next / Qwen3.5 (import) / GLM-4.5 "
                        "/ Qwen3-MoE / DeepSeek-V2 / DeepSeek-V3 / gpt-oss / Llama 4 (import)")
