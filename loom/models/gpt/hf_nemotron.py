"""Hugging Face ``NemotronForCausalLM`` (Nemotron-4, Minitron, Mistral-NeMo-Minitron:
``model_type: nemotron``) <-> loom's GPT family.

Nemotron-4 (Parmar et al. 2024, "Nemotron-4 15B Technical Report", sec. 2; trained with
Megatron-LM) is Megatron's GPT with ``--normalization LayerNorm --apply-layernorm-1p`` (the
LayerNorm's weight zero-centred: it scales by ``1 + w``, transformers' ``NemotronLayerNorm1P``,
biases kept; loom's norms hold the gain ``1 + w`` itself, so 1 is added on import and taken
off on export), ``--squared-relu`` in an ungated MLP (``up_proj`` / ``down_proj``),
``--disable-bias-linear``, grouped-query attention and RoPE on the first ``partial_rotary_factor``
of each head (0.5: ``--rotary-percent``; transformers' ``apply_rotary_pos_emb`` rotates halves
of that part, as loom), untied embeddings. The tensors are renamed (q, k, v fused into loom's
``linear_qkv``), not reshaped. Refused naming the key: linear biases and RoPE scalings loom
does not compute.
"""

from __future__ import annotations

from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.gpt.hf_parts import (attention_to_hf, attention_to_loom, check_plain,
                                      llama_shape_to_hf, outer_to_hf, outer_to_loom,
                                      shape_from_hf)
from loom.models.gpt.hf_phi3 import partial_rotary

TITLE = "Nemotron"


def read_config(hf: dict, where: str) -> ModelConfig:
    """loom's layout of a ``nemotron`` ``config.json`` dict; ConfigError naming ``where`` for
    linear biases, an activation other than ``relu2`` or a RoPE scaling loom does not
    compute."""
    return ModelConfig(
        normalization="LayerNorm", apply_layernorm_1p=True, norm_epsilon=hf.get("norm_eps", 1e-5),
        position_embedding_type="rope", rotary_percent=partial_rotary(hf), squared_relu=True,
        swiglu=False, disable_bias_linear=True, **shape_from_hf(hf, TITLE, where, "relu2"))


def _norms(src: Mapping, pairs, gain: float) -> dict:
    """Each ``(a, b)`` LayerNorm's weight (plus ``gain``) and bias under ``a`` in ``src``,
    renamed ``b``."""
    out = {}
    for a, b in pairs:
        out[b + ".weight"] = src[a + ".weight"] + gain
        out[b + ".bias"] = src[a + ".bias"]
    return out


def nemotron_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``NemotronForCausalLM`` state dict -> loom names (LayerNorm biases included)."""
    out = {**outer_to_loom(sd), **_norms(sd, (("model.norm", "final_layernorm"),), 1.0)}
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(attention_to_loom(sd, h, l))
        out.update(_norms(sd, ((h + "input_layernorm", l + "input_layernorm"),
                               (h + "post_attention_layernorm", l + "pre_mlp_layernorm")), 1.0))
        out[l + "mlp.linear_fc1.weight"] = sd[h + "mlp.up_proj.weight"]
        out[l + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"]
    return out


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of a ``nemotron`` config and state dict."""
    cfg = read_config(hf, where)
    return cfg, nemotron_to_loom(sd, cfg)


def is_nemotron(cfg: ModelConfig) -> bool:
    """Whether a dense loom model is in Nemotron's layout (LayerNorm 1p, squared ReLU, RoPE,
    no linear biases)."""
    return (cfg.normalization == "LayerNorm" and cfg.apply_layernorm_1p and cfg.squared_relu
            and not cfg.swiglu and cfg.position_embedding_type == "rope"
            and cfg.disable_bias_linear and not cfg.add_qkv_bias)


def nemotron_hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of ``NemotronForCausalLM`` for a loom model in its layout
    (:func:`is_nemotron`); ConfigError for an option it does not express."""
    if not is_nemotron(cfg):
        raise ConfigError(f"{TITLE} export needs --normalization LayerNorm --apply-layernorm-1p "
                          f"--squared-relu --disable-bias-linear and RoPE")
    check_plain(cfg, TITLE, allowed=("squared_relu", "rotary_percent"))
    shape = {k: v for k, v in llama_shape_to_hf(cfg).items() if k != "rms_norm_eps"}
    return {"architectures": ["NemotronForCausalLM"], "model_type": "nemotron", **shape,
            "norm_eps": cfg.norm_epsilon, "hidden_act": "relu2", "attention_bias": False,
            "mlp_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base,
                                "partial_rotary_factor": cfg.rotary_percent}}


def loom_to_nemotron(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full loom tensors -> the ``NemotronForCausalLM`` state dict (the inverse of
    :func:`nemotron_to_loom`; vocabulary padding dropped)."""
    nemotron_hf_config(cfg)  # refuses what it cannot express
    out = {**outer_to_hf(full, cfg), **_norms(full, (("final_layernorm", "model.norm"),), -1.0)}
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        out.update(attention_to_hf(full, l, h, cfg))
        out.update(_norms(full, ((l + "input_layernorm", h + "input_layernorm"),
                                 (l + "pre_mlp_layernorm", h + "post_attention_layernorm")),
                          -1.0))
        out[h + "mlp.up_proj.weight"] = full[l + "mlp.linear_fc1.weight"]
        out[h + "mlp.down_proj.weight"] = full[l + "mlp.linear_fc2.weight"]
    return {k: v.contiguous() for k, v in out.items()}
