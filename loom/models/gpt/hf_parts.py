"""The pieces the GPT family's LLaMA-like Hugging Face layouts share (LLaMA, Qwen2, Mixtral,
Qwen2-MoE, Qwen3-MoE): embeddings / final norm / output layer, an attention block (q, k, v
separate in HF, fused ``[q; k; v]`` rows in loom's ``linear_qkv``; optional QKV biases and
per-head Q/K norms), a SwiGLU MLP (``gate_proj`` / ``up_proj`` in HF, ``[gate; up]`` rows in
loom's ``linear_fc1``), the RoPE base and ``rope_scaling`` (llama3, linear) both ways, and the
check that a model sets no option these classes lack. Each ``*_to_loom`` reads an HF state dict (prefix ``h``) into loom names (prefix ``l``);
each ``*_to_hf`` is its inverse on full loom tensors (vocabulary padding dropped).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping, Optional

import torch

from loom.config import ModelConfig
from loom.config.model_rope import LLAMA3_SCALING, rope_fields, rope_theta  # noqa: F401
from loom.errors import ConfigError

# Options no LLaMA-like HF class expresses: a model must have these values, unless the layout
# exporting it names the option as its own (``check_plain``'s ``allowed``).
PLAIN_LAYOUT = (("squared_relu", False), ("qk_layernorm", False), ("rotary_percent", 1.0),
                ("quick_geglu", False), ("softmax_type", "vanilla"), ("window_size", None),
                ("mtp_num_layers", None), ("rotary_scaling_factor", None),
                ("glu_linear_offset", 0.0), ("activation_func_clamp_value", None),
                ("enable_gpt_oss", False), ("multi_latent_attention", False),
                ("rotary_interleaved", False), ("use_mup", False), ("no_rope_freq", None),
                ("qk_l2_norm", False), ("qk_l2_norm_rope_layers_only", False),
                ("attention_chunk_size", None), ("attn_temperature_floor_scale", None),
                ("use_rope_scaling", False), ("rotary_seq_len_interpolation_factor", None))
ROPE_SCALINGS = ("use_rope_scaling", "rotary_seq_len_interpolation_factor")
"""The :data:`PLAIN_LAYOUT` options a LLaMA-like layout expresses by ``rope_scaling``
(:func:`rope_to_hf`): its ``check_plain``'s ``allowed``."""


def mistral_window(hf_config) -> Optional[str]:
    """``--window-size`` of a Mistral / Mixtral config's ``sliding_window`` W: ``W-1,0`` (the
    query at p sees the keys p - W < j <= p on every layer, transformers'
    ``sliding_window_causal_mask``; Jiang et al. 2023, "Mistral 7B", sec. 2), None without one
    or with one as wide as the context."""
    w = getattr(hf_config, "sliding_window", None)
    return None if w is None or w >= hf_config.max_position_embeddings else f"{w - 1},0"


def hf_sliding_window(cfg: ModelConfig, title: str) -> Optional[int]:
    """Mistral's / Mixtral's ``sliding_window`` of a loom model: LEFT + 1 of ``--window-size
    LEFT,0`` (None without a window). Raises ConfigError for a window the class does not
    express (looking ahead, or full layers between windowed ones)."""
    if cfg.window is None:
        return None
    if cfg.window[1] != 0 or cfg.window_attn_skip_freq is not None:
        raise ConfigError(f"--window-size {cfg.window_size} / --window-attn-skip-freq "
                          f"{cfg.window_attn_skip_freq}: {title}'s sliding window looks back on "
                          f"every layer (LEFT,0, no full layers); keep the checkpoint in loom or "
                          f"Megatron format")
    return cfg.window[0] + 1


def check_plain(cfg: ModelConfig, title: str, allowed: tuple = ()) -> None:
    """Raise ConfigError naming the first :data:`PLAIN_LAYOUT` option ``cfg`` sets that the
    ``title`` layout does not express (``allowed``: the options it does)."""
    for name, plain in PLAIN_LAYOUT:
        if name not in allowed and getattr(cfg, name) != plain:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)} has no Hugging "
                              f"Face {title} equivalent: this model does not convert to "
                              f"Hugging Face")


def rope_to_hf(cfg: ModelConfig) -> dict:
    """The inverse of :func:`rope_fields`: ``rope_theta``, and ``rope_scaling`` when a scaling
    is on. Raises ConfigError for both scalings at once (HF's config holds one)."""
    out: dict = {"rope_theta": cfg.rotary_base}
    interpolation = cfg.rotary_seq_len_interpolation_factor
    if cfg.use_rope_scaling and interpolation is not None:
        raise ConfigError("--use-rope-scaling with --rotary-seq-len-interpolation-factor: a "
                          "Hugging Face rope_scaling holds one of them: this model does not "
                          "convert to Hugging Face")
    if cfg.use_rope_scaling:
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_scaling_low_freq_factor,
            "high_freq_factor": cfg.rope_scaling_high_freq_factor,
            "original_max_position_embeddings":
                cfg.rope_scaling_original_max_position_embeddings}
    elif interpolation is not None:
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(interpolation)}
    return out


def llama_shape_to_hf(cfg: ModelConfig) -> dict:
    """The ``config.json`` sizes every LLaMA-like class names alike (vocabulary, widths, layers,
    heads, key/value heads, head dim, positions, RMSNorm epsilon, SiLU, tied embeddings)."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_kv_groups, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_epsilon,
            "hidden_act": "silu",
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights}


def shape_from_hf(hf: dict, title: str, where: str, act: str = "silu") -> dict:
    """loom's shape and RoPE fields of a LLaMA-like ``config.json`` dict (layers, widths,
    heads, key/value heads, head dim, positions, vocabulary, untied output layer, the RoPE
    base and scaling; no dropout, vocabulary padding outside the softmax) for
    ``ModelConfig(**...)``. ConfigError naming ``where`` and ``title`` for attention or MLP
    biases, an activation other than ``act`` and a RoPE scaling loom does not compute
    (:func:`rope_fields`)."""
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError(f"{where}: {title} with attention_bias / mlp_bias (biases on every "
                          f"projection) has no loom layout")
    if hf.get("hidden_act", act) != act:
        raise ConfigError(f"{where}: {title} with hidden_act {hf['hidden_act']!r}: loom "
                          f"converts {act}")
    ns = SimpleNamespace(**{"tie_word_embeddings": False, **hf})
    try:
        rope = rope_fields(ns, title)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    positions = hf["max_position_embeddings"]
    return dict(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                num_attention_heads=hf["num_attention_heads"],
                num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                kv_channels=hf.get("head_dim"), ffn_hidden_size=hf["intermediate_size"],
                seq_length=positions, max_position_embeddings=positions,
                vocab_size=hf["vocab_size"],
                untie_embeddings_and_output_weights=not ns.tie_word_embeddings, **rope,
                hidden_dropout=0.0, attention_dropout=0.0, exclude_padded_vocab=True)


def outer_to_loom(sd: Mapping) -> dict:
    """Embeddings, final norm and output layer (the embeddings when tied)."""
    return {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
            "final_layernorm.weight": sd["model.norm.weight"],
            "output_layer.weight": sd.get("lm_head.weight", sd["model.embed_tokens.weight"])}


def outer_to_hf(full: Mapping, cfg: ModelConfig) -> dict:
    """The inverse of :func:`outer_to_loom` (``lm_head`` is the embeddings when tied)."""
    V = cfg.vocab_size
    out = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:V],
           "model.norm.weight": full["final_layernorm.weight"]}
    out["lm_head.weight"] = (full["output_layer.weight"][:V]
                             if cfg.untie_embeddings_and_output_weights
                             else out["model.embed_tokens.weight"])
    return out


def attention_to_loom(sd: Mapping, h: str, l: str) -> dict:
    """Self-attention and the two norms of HF layer ``h`` (biases and Q/K norms if present)."""
    a = h + "self_attn."
    out = {l + "self_attention.linear_qkv.weight": torch.cat(
               [sd[a + f"{x}_proj.weight"] for x in "qkv"], dim=0),
           l + "self_attention.linear_proj.weight": sd[a + "o_proj.weight"],
           l + "input_layernorm.weight": sd[h + "input_layernorm.weight"],
           l + "pre_mlp_layernorm.weight": sd[h + "post_attention_layernorm.weight"]}
    if a + "q_proj.bias" in sd:
        out[l + "self_attention.linear_qkv.bias"] = torch.cat(
            [sd[a + f"{x}_proj.bias"] for x in "qkv"], dim=0)
    if a + "q_norm.weight" in sd:
        out[l + "self_attention.q_layernorm.weight"] = sd[a + "q_norm.weight"]
        out[l + "self_attention.k_layernorm.weight"] = sd[a + "k_norm.weight"]
    return out


def attention_to_hf(full: Mapping, l: str, h: str, cfg: ModelConfig) -> dict:
    """The inverse of :func:`attention_to_loom` (biases with ``--add-qkv-bias``, Q/K norms
    with ``--qk-layernorm``)."""
    a, g, d = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim
    s = l + "self_attention."
    out = {}
    for kind in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
        q, k, v = full[s + f"linear_qkv.{kind}"].split([a * d, g * d, g * d], dim=0)
        out.update({h + f"self_attn.q_proj.{kind}": q, h + f"self_attn.k_proj.{kind}": k,
                    h + f"self_attn.v_proj.{kind}": v})
    out.update({h + "self_attn.o_proj.weight": full[s + "linear_proj.weight"],
                h + "input_layernorm.weight": full[l + "input_layernorm.weight"],
                h + "post_attention_layernorm.weight": full[l + "pre_mlp_layernorm.weight"]})
    if cfg.qk_layernorm:
        out[h + "self_attn.q_norm.weight"] = full[s + "q_layernorm.weight"]
        out[h + "self_attn.k_norm.weight"] = full[s + "k_layernorm.weight"]
    return out


def swiglu_to_loom(sd: Mapping, src: str, dst: str) -> dict:
    """HF ``gate_proj`` / ``up_proj`` / ``down_proj`` under ``src`` -> loom ``linear_fc1``
    (``[gate; up]``) / ``linear_fc2`` under ``dst``."""
    return {dst + "linear_fc1.weight": torch.cat([sd[src + "gate_proj.weight"],
                                                  sd[src + "up_proj.weight"]], dim=0),
            dst + "linear_fc2.weight": sd[src + "down_proj.weight"]}


def swiglu_to_hf(full: Mapping, src: str, dst: str) -> dict:
    """The inverse of :func:`swiglu_to_loom` (loom prefix ``src``, HF prefix ``dst``)."""
    gate, up = full[src + "linear_fc1.weight"].chunk(2, dim=0)
    return {dst + "gate_proj.weight": gate, dst + "up_proj.weight": up,
            dst + "down_proj.weight": full[src + "linear_fc2.weight"]}
