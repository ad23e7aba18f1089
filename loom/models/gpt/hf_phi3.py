"""Hugging Face ``Phi3ForCausalLM`` (Phi-3, Phi-3.5, Phi-4, Phi-4-mini: ``model_type: phi3``)
<-> loom's GPT family.

Phi-3 (Abdin et al. 2024, "Phi-3 Technical Report") is the LLaMA layout with its projections
fused as loom fuses them: ``qkv_proj`` holds ``[Q; K; V]`` rows (loom's ``linear_qkv``) and
``gate_up_proj`` ``[gate; up]`` (loom's ``linear_fc1``), so the tensors are renamed, not
reshaped. Its RoPE may rotate only the first ``partial_rotary_factor`` of each head's
channels (Phi-4-mini's 0.75: ``--rotary-percent``, GPT-NeoX's layout, as transformers'
``apply_rotary_pos_emb`` cuts it); ``sliding_window`` is Mistral's
(:func:`~loom.models.gpt.hf_parts.mistral_window`). Refused naming the key: ``longrope`` and
other RoPE scalings loom does not compute (:func:`~loom.config.model_rope.rope_fields`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.models.gpt.hf_parts import (check_plain, hf_sliding_window, llama_shape_to_hf,
                                      mistral_window, outer_to_hf, outer_to_loom, shape_from_hf)

TITLE = "Phi-3"
NAMES = (("self_attn.qkv_proj", "self_attention.linear_qkv"),
         ("self_attn.o_proj", "self_attention.linear_proj"),
         ("input_layernorm", "input_layernorm"),
         ("post_attention_layernorm", "pre_mlp_layernorm"),
         ("mlp.gate_up_proj", "mlp.linear_fc1"), ("mlp.down_proj", "mlp.linear_fc2"))
"""A layer's ``(Phi-3 name, loom name)`` of each weight (the same tensor on both sides)."""


def partial_rotary(hf: dict) -> float:
    """``partial_rotary_factor`` of a ``config.json`` dict (transformers 5 keeps it in
    ``rope_parameters``), 1.0 without one."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))


def read_config(hf: dict, where: str) -> ModelConfig:
    """loom's layout of a ``phi3`` ``config.json`` dict; ConfigError naming ``where`` for a
    RoPE scaling loom does not compute or biases (none of the released models has them)."""
    ns = SimpleNamespace(**hf)
    return ModelConfig.llama(norm_epsilon=hf.get("rms_norm_eps", 1e-5),
                             rotary_percent=partial_rotary(hf), window_size=mistral_window(ns),
                             **shape_from_hf(hf, TITLE, where))


def phi3_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``Phi3ForCausalLM`` state dict -> loom names (the fused projections renamed)."""
    out = outer_to_loom(sd)
    for i in range(cfg.num_layers):
        out.update({f"layers.{i}.{ours}.weight": sd[f"model.layers.{i}.{theirs}.weight"]
                    for theirs, ours in NAMES})
    return out


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of a ``phi3`` config and state dict."""
    cfg = read_config(hf, where)
    return cfg, phi3_to_loom(sd, cfg)


def phi3_hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of ``Phi3ForCausalLM`` for a LLaMA-layout loom model whose RoPE rotates
    part of each head (``--rotary-percent`` < 1: what LlamaForCausalLM does not express);
    Phi-3's RoPE has no scaling loom computes (its ``longrope`` is not loom's), so a scaled one
    is refused (check_plain)."""
    check_plain(cfg, TITLE, allowed=("rotary_percent", "window_size"))
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
            **llama_shape_to_hf(cfg),
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base,
                                "partial_rotary_factor": cfg.rotary_percent},
            "sliding_window": hf_sliding_window(cfg, TITLE)}


def loom_to_phi3(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full loom tensors -> the ``Phi3ForCausalLM`` state dict (the inverse of
    :func:`phi3_to_loom`; vocabulary padding dropped)."""
    out = outer_to_hf(full, cfg)
    for i in range(cfg.num_layers):
        out.update({f"model.layers.{i}.{theirs}.weight": full[f"layers.{i}.{ours}.weight"]
                    for theirs, ours in NAMES})
    return {k: v.contiguous() for k, v in out.items()}
