"""Hugging Face ``Gemma3ForCausalLM`` (``gemma3_text``) <-> loom's gemma3 family: the config
(:func:`gemma3_config`, :func:`hf_gemma3_config`) and the weights as full tensors by name
(:func:`gemma3_to_loom`, :func:`loom_to_gemma3`). Norm weights keep HF's convention (the gain
is ``1 + weight`` on both sides), so the tensors are copied unchanged; Q stays separate, K and V
are fused, gate and up are fused. Gemma 2 (``gemma2``) is the same layers without QK norm,
Gemma 1 (``gemma``) without QK norm and post-norms (its ``post_attention_layernorm`` is the
pre-MLP norm), every layer global, one RoPE base, no soft-capping.
"""

from __future__ import annotations

from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.family import HFConversion

GEMMA3_TYPES = ("gemma3_text", "gemma3", "gemma2", "gemma")
TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_tanh", "gelu_fast")


def text_config(hf: dict) -> dict:
    """The text part of a Gemma 3 ``config.json`` (multimodal ``gemma3`` keeps it in
    ``text_config``)."""
    return (hf.get("text_config") or hf) if hf.get("model_type") == "gemma3" else hf


def _rope(hf: dict, where: str) -> tuple[float, float, float]:
    """(global base, local base, global linear scaling factor) from either config format:
    ``rope_parameters`` per layer type (transformers 5) or ``rope_theta`` /
    ``rope_local_base_freq`` / ``rope_scaling``; Gemma 2's one base for both kinds of layer
    (default 10,000), unscaled."""
    params = hf.get("rope_parameters") or {}
    if hf.get("model_type") in ("gemma2", "gemma"):
        if params.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
            raise ConfigError(f"{where}: Gemma 1 / 2 with a RoPE scaling: loom converts its "
                              f"default RoPE")
        base = float(params.get("rope_theta") or hf.get("rope_theta") or 10_000.0)
        return base, base, 1.0
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    if hf.get("rope_scaling"):
        full.update(hf["rope_scaling"])
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    kinds = (full.get("rope_type", full.get("type", "default")),
             local.get("rope_type", local.get("type", "default")))
    if kinds[0] not in ("default", "linear") or kinds[1] != "default":
        raise ConfigError(f"{where}: RoPE types {kinds} (global, local); loom converts default "
                          f"and linear scaling of the global layers")
    factor = float(full.get("factor", 1.0)) if kinds[0] == "linear" else 1.0
    return float(full["rope_theta"]), float(local["rope_theta"]), factor


def gemma3_config(hf: dict, where: str = "config.json") -> ModelConfig:
    """loom's gemma3 layout for a Gemma 3 text config (a ``config.json`` dict; Gemma 2's
    ``gemma2``: the same layers without QK norm, ``--no-gemma-qk-norm``, local and global
    layers alternating, one RoPE base, soft-capped scores and logits: Gemma Team 2024,
    "Gemma 2", sec. 2). Raises ConfigError for a variant loom does not express (bidirectional
    attention, biases, an untied output layer, other RoPE types)."""
    hf = text_config(hf)
    for key, bad in (("use_bidirectional_attention", True), ("attention_bias", True),
                     ("tie_word_embeddings", False)):
        if hf.get(key, not bad) == bad:
            raise ConfigError(f"{where}: {key} = {bad} is not supported for Gemma 3")
    L, gemma1 = hf["num_hidden_layers"], hf.get("model_type") == "gemma"
    types = ["full_attention"] * L if gemma1 else hf.get("layer_types")
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    if not types:
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(L)]
    if set(types) - {"full_attention", "sliding_attention"}:
        raise ConfigError(f"{where}: layer_types {sorted(set(types))}: only sliding_attention "
                          f"and full_attention are known")
    base, local, factor = _rope(hf, where)
    heads = hf.get("num_attention_heads", 8)
    max_pos = hf.get("max_position_embeddings", 131_072)
    return ModelConfig(
        model_type="gemma3", num_layers=L, hidden_size=hf["hidden_size"],
        num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads", heads),
        kv_channels=hf.get("head_dim", 256), ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_length=max_pos, max_position_embeddings=max_pos,
        norm_epsilon=hf.get("rms_norm_eps", 1e-6), normalization="RMSNorm",
        position_embedding_type="rope", disable_bias_linear=True,
        openai_gelu=(hf.get("hidden_activation") or hf.get("hidden_act")
                     or "gelu_pytorch_tanh") in TANH_GELU,
        rotary_base=base, rotary_base_local=local,
        rotary_scaling_factor=factor if factor != 1.0 else None,
        sliding_window=hf.get("sliding_window"), sliding_window_pattern=pattern,
        layer_types="".join("G" if t == "full_attention" else "L" for t in types),
        query_pre_attn_scalar=hf.get("head_dim", 256) if gemma1 else
        hf.get("query_pre_attn_scalar", 256),
        attn_logit_softcapping=hf.get("attn_logit_softcapping"),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout") or 0.0),
        exclude_padded_vocab=True, gemma_qk_norm=hf.get("model_type") not in ("gemma2", "gemma"),
        gemma_post_norms=not gemma1)


def hf_gemma3_config(cfg: ModelConfig) -> dict:
    """``config.json`` of ``Gemma3ForCausalLM`` for a loom gemma3 model (``Gemma2ForCausalLM``
    without QK norm; ConfigError when its RoPE has two bases or a scaling, which Gemma 2's
    does not express)."""
    full = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rotary_scaling_factor:
        full.update(rope_type="linear", factor=cfg.rotary_scaling_factor)
    out = _gemma3_config(cfg, full)
    if not cfg.gemma_post_norms:
        return _gemma1_config(cfg, out)
    if cfg.gemma_qk_norm:
        return out
    if cfg.rotary_scaling_factor or cfg.rotary_base_local != cfg.rotary_base:
        raise ConfigError("--no-gemma-qk-norm exports as Gemma 2, whose RoPE has one base and "
                          "no scaling: give --rotary-base-local equal to --rotary-base and no "
                          "--rotary-scaling-factor, or keep the checkpoint in loom's format")
    return {**out, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base}}


def _gemma1_config(cfg: ModelConfig, gemma3: dict) -> dict:
    """``GemmaForCausalLM``'s config of a loom model with ``--no-gemma-post-norms``;
    ConfigError for what Gemma 1 does not have (QK norm, local layers, soft-capping, another
    attention scale, two RoPE bases or a scaling)."""
    lacks = [flag for flag, on in (
        ("--gemma-qk-norm (give --no-gemma-qk-norm)", cfg.gemma_qk_norm),
        ("local layers (--layer-types with L)", "L" in cfg.attention_layer_types),
        ("--attn-logit-softcapping", cfg.attn_logit_softcapping),
        ("--final-logit-softcapping", cfg.final_logit_softcapping),
        ("--query-pre-attn-scalar other than the head dim",
         (cfg.query_pre_attn_scalar or cfg.head_dim) != cfg.head_dim),
        ("--rotary-scaling-factor", cfg.rotary_scaling_factor))
        if on]
    if lacks:
        raise ConfigError(f"--no-gemma-post-norms exports as Gemma 1, which has no "
                          f"{lacks[0]}: keep the checkpoint in loom's format")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "rms_norm_eps", "tie_word_embeddings", "attention_bias", "attention_dropout",
            "pad_token_id", "eos_token_id", "bos_token_id", "torch_dtype")
    return {"architectures": ["GemmaForCausalLM"], "model_type": "gemma",
            **{k: gemma3[k] for k in keep}, "hidden_act": gemma3["hidden_activation"],
            "hidden_activation": gemma3["hidden_activation"],
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base}}


def _gemma3_config(cfg: ModelConfig, full: dict) -> dict:
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_kv_groups, "head_dim": cfg.head_dim,
            "hidden_activation": "gelu_pytorch_tanh" if cfg.openai_gelu else "gelu",
            "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_epsilon,
            "rope_parameters": {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": cfg.rotary_base_local}},
            "sliding_window": cfg.sliding_window or cfg.max_positions,
            "layer_types": ["full_attention" if k == "G" else "sliding_attention"
                            for k in cfg.attention_layer_types],
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
            "attn_logit_softcapping": cfg.attn_logit_softcapping,
            "final_logit_softcapping": cfg.final_logit_softcapping,
            "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
            "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "torch_dtype": "float32"}


_NORMS = (("input_layernorm", "input_layernorm"),
          ("post_attention_layernorm", "post_self_attn_layernorm"),
          ("pre_feedforward_layernorm", "pre_mlp_layernorm"),
          ("post_feedforward_layernorm", "post_mlp_layernorm"),
          ("self_attn.q_norm", "self_attention.q_layernorm"),
          ("self_attn.k_norm", "self_attention.k_layernorm"))


def _norms(cfg: ModelConfig) -> tuple:
    """The layer's norms of :data:`_NORMS` (Gemma 2: without the QK norms; Gemma 1: the input
    norm and the pre-MLP norm, which it names ``post_attention_layernorm``)."""
    if not cfg.gemma_post_norms:
        return (_NORMS[0], ("post_attention_layernorm", "pre_mlp_layernorm")) + \
            (_NORMS[4:] if cfg.gemma_qk_norm else ())
    return _NORMS if cfg.gemma_qk_norm else _NORMS[:4]


def gemma3_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Gemma3ForCausalLM state dict (``model.*``; ``model.language_model.*`` of the multimodal
    class too) -> loom names. Raises ConfigError naming a missing tensor."""
    sd = {k.replace("model.language_model.", "model."): v for k, v in sd.items()}

    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise ConfigError(f"Gemma 3 weights: {name} missing")
        return sd[name]
    out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight"),
           "final_layernorm.weight": get("model.norm.weight")}
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update({
            l + "self_attention.linear_q.weight": get(h + "self_attn.q_proj.weight"),
            l + "self_attention.linear_kv.weight": torch.cat(
                [get(h + "self_attn.k_proj.weight"), get(h + "self_attn.v_proj.weight")]),
            l + "self_attention.linear_proj.weight": get(h + "self_attn.o_proj.weight"),
            l + "mlp.linear_fc1.weight": torch.cat(
                [get(h + "mlp.gate_proj.weight"), get(h + "mlp.up_proj.weight")]),
            l + "mlp.linear_fc2.weight": get(h + "mlp.down_proj.weight")})
        for hf_name, loom_name in _norms(cfg):
            out[l + loom_name + ".weight"] = get(h + hf_name + ".weight")
    return out


def loom_to_gemma3(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full loom tensors (vocabulary padding dropped) -> the Gemma3ForCausalLM state dict
    (tied: no ``lm_head.weight``)."""
    out = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:cfg.vocab_size],
           "model.norm.weight": full["final_layernorm.weight"]}
    f = cfg.ffn_size
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        k, v = full[l + "self_attention.linear_kv.weight"].chunk(2)
        gate, up = full[l + "mlp.linear_fc1.weight"].split([f, f])
        out.update({h + "self_attn.q_proj.weight": full[l + "self_attention.linear_q.weight"],
                    h + "self_attn.k_proj.weight": k, h + "self_attn.v_proj.weight": v,
                    h + "self_attn.o_proj.weight": full[l + "self_attention.linear_proj.weight"],
                    h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
                    h + "mlp.down_proj.weight": full[l + "mlp.linear_fc2.weight"]})
        for hf_name, loom_name in _norms(cfg):
            out[h + hf_name + ".weight"] = full[l + loom_name + ".weight"]
    return {k: v.contiguous() for k, v in out.items()}


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of a Gemma 3 ``config.json`` dict and state dict;
    raises ConfigError naming ``where`` for a variant loom does not express."""
    cfg = gemma3_config(hf, where)
    return cfg, gemma3_to_loom(sd, cfg)


HF = HFConversion(model_types=GEMMA3_TYPES, to_loom=to_loom, export_config=hf_gemma3_config,
                  from_loom=loom_to_gemma3, gguf_architectures=("gemma3",),
                  title="Gemma 3 / Gemma 2 / Gemma 1",
                  read_config=gemma3_config)
