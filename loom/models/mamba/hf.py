"""Hugging Face ``transformers`` <-> loom's Mamba-2 / hybrid family, both ways: a pure Mamba
stack is ``Mamba2ForCausalLM``, a hybrid (``--hybrid-override-pattern`` with ``*`` attention
and ``-`` MLP layers, Megatron's layout) is ``NemotronHForCausalLM``, whose blocks are exactly
Megatron's: ``x + mixer(norm(x))`` with one RMSNorm per layer and the mixer a Mamba-2 layer, an
attention layer without positional encoding (NoPE: loom's ``--position-embedding-type none``)
or a two-matrix MLP (squared ReLU in Nemotron-H: ``--squared-relu``; GeLU also expressed).
(Zamba / Bamba / Jamba interleave differently: shared attention blocks, attention + MLP in one
layer, RoPE; they do not match loom's per-layer kinds.)

Names map one to one under ``backbone.layers.<i>``: ``norm`` is loom's ``input_layernorm``
(``pre_mlp_layernorm`` in an MLP layer), the Mamba mixer keeps its names (conv weight
``[c, 1, k]`` in HF, ``[c, k]`` in loom), attention's q / k / v are loom's fused ``linear_qkv``
rows, ``o_proj`` its ``linear_proj``, the MLP's ``up_proj`` / ``down_proj`` loom's
``linear_fc1`` / ``linear_fc2``. The output layer is always written (``tie_word_embeddings``
false: Nemotron-H does not tie); a tied loom model writes its embeddings there.
"""

from __future__ import annotations

from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.family import HFConversion

KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}  # Nemotron-H's names
MLP_ACTS = {"relu2": dict(squared_relu=True), "gelu": {},
            "gelu_pytorch_tanh": dict(openai_gelu=True)}


def _pattern(cfg: ModelConfig) -> str:
    return cfg.hybrid_override_pattern or "M" * cfg.num_layers


def hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of ``Mamba2ForCausalLM`` (all ``M``) or ``NemotronHForCausalLM``.
    Raises ConfigError for a layout neither expresses."""
    pat = _pattern(cfg)
    needs = [flag for flag, ok in (
        ("RMSNorm", cfg.normalization == "RMSNorm"),
        ("--disable-bias-linear", cfg.disable_bias_linear),
        ("--position-embedding-type none (Nemotron-H's attention has no positions; a pure "
         "Mamba stack none either)", cfg.position_embedding_type == "none" or (
             "*" not in pat and cfg.position_embedding_type == "rope")),
        ("an MLP without a gate (no --swiglu)", "-" not in pat or not cfg.swiglu),
        ("no --qk-layernorm", not cfg.qk_layernorm)) if not ok]
    if needs:
        raise ConfigError(f"Mamba / Nemotron-H export needs {needs[0]}: this model does not "
                          f"convert to Hugging Face")
    common = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "layer_norm_epsilon": cfg.norm_epsilon, "n_groups": cfg.mamba_num_groups,
              "conv_kernel": cfg.mamba_d_conv, "chunk_size": cfg.mamba_chunk_size,
              "use_bias": False, "use_conv_bias": True, "tie_word_embeddings": False,
              "expand": max(1, cfg.mamba_d_inner // cfg.hidden_size)}
    heads = cfg.mamba_d_inner // cfg.mamba_head_dim
    if "*" not in pat and "-" not in pat:
        if cfg.mamba_d_inner % cfg.hidden_size:  # Mamba2's mixer is expand x h wide
            raise ConfigError(f"Mamba-2 export needs d_inner = --mamba-num-heads x "
                              f"--mamba-head-dim ({cfg.mamba_d_inner}) a multiple of "
                              f"--hidden-size {cfg.hidden_size} (transformers' Mamba2 has "
                              f"expand x h channels): this model does not convert")
        return {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
                "num_hidden_layers": cfg.num_layers, "num_heads": heads,
                "head_dim": cfg.mamba_head_dim, "state_size": cfg.mamba_state_dim,
                "residual_in_fp32": True, **common}
    act = "relu2" if cfg.squared_relu else "gelu_pytorch_tanh" if cfg.openai_gelu else "gelu"
    return {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
            "layers_block_type": [KINDS[c] for c in pat], "mamba_num_heads": heads,
            "mamba_head_dim": cfg.mamba_head_dim, "ssm_state_size": cfg.mamba_state_dim,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_kv_groups, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.ffn_size, "mlp_hidden_act": act,
            "max_position_embeddings": cfg.max_positions, "attention_bias": False,
            "mlp_bias": False, "time_step_min": 0.0, **common}


def _layer_pairs(kind: str) -> tuple:
    """(HF name under ``backbone.layers.<i>.``, loom name under ``layers.<i>.``) of a layer
    kind, but the q/k/v split and the conv weight's shape."""
    if kind == "M":
        return (("norm.weight", "input_layernorm.weight"),) + tuple(
            (f"mixer.{n}", f"mixer.{n}") for n in (
                "in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                "norm.weight", "out_proj.weight"))
    if kind == "*":
        return (("norm.weight", "input_layernorm.weight"),
                ("mixer.o_proj.weight", "self_attention.linear_proj.weight"))
    return (("norm.weight", "pre_mlp_layernorm.weight"),
            ("mixer.up_proj.weight", "mlp.linear_fc1.weight"),
            ("mixer.down_proj.weight", "mlp.linear_fc2.weight"))


def loom_to_hf(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full loom tensors (vocabulary padding dropped) -> the Mamba2 / Nemotron-H state dict."""
    V, a, g, d = cfg.vocab_size, cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim
    embed = full["embedding.word_embeddings.weight"][:V]
    out = {"backbone.embeddings.weight": embed,
           "backbone.norm_f.weight": full["final_layernorm.weight"],
           "lm_head.weight": (full["output_layer.weight"][:V]
                              if cfg.untie_embeddings_and_output_weights else embed)}
    for i, kind in enumerate(_pattern(cfg)):
        h, l = f"backbone.layers.{i}.", f"layers.{i}."
        for hf_name, loom_name in _layer_pairs(kind):
            w = full[l + loom_name]
            out[h + hf_name] = w[:, None, :] if hf_name == "mixer.conv1d.weight" else w
        if kind == "*":
            q, k, v = full[l + "self_attention.linear_qkv.weight"].split([a * d, g * d, g * d])
            out.update({h + "mixer.q_proj.weight": q, h + "mixer.k_proj.weight": k,
                        h + "mixer.v_proj.weight": v})
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`loom_to_hf` (``model.`` spelled ``backbone.`` too)."""
    sd = {("backbone." + k[len("model."):] if k.startswith("model.") else k): v
          for k, v in sd.items()}
    out = {"embedding.word_embeddings.weight": sd["backbone.embeddings.weight"],
           "final_layernorm.weight": sd["backbone.norm_f.weight"],
           "output_layer.weight": sd.get("lm_head.weight", sd["backbone.embeddings.weight"])}
    for i, kind in enumerate(_pattern(cfg)):
        h, l = f"backbone.layers.{i}.", f"layers.{i}."
        for hf_name, loom_name in _layer_pairs(kind):
            w = sd[h + hf_name]
            out[l + loom_name] = w[:, 0] if hf_name == "mixer.conv1d.weight" else w
        if kind == "*":
            out[l + "self_attention.linear_qkv.weight"] = torch.cat(
                [sd[h + f"mixer.{x}_proj.weight"] for x in "qkv"], dim=0)
    return out


def mamba_config(hf: dict, where: str) -> ModelConfig:
    """loom's layout of a ``mamba2`` or ``nemotron_h`` ``config.json``. Raises ConfigError for
    what loom does not express (Nemotron-H's MoE layers, biases)."""
    nemotron = hf["model_type"] == "nemotron_h"
    h = hf["hidden_size"]
    heads, hd = (hf["mamba_num_heads"], hf["mamba_head_dim"]) if nemotron else \
        (hf["num_heads"], hf["head_dim"])
    names = {v: k for k, v in KINDS.items()}
    kinds = hf.get("layers_block_type") or ["linear_attention"] * hf.get("num_hidden_layers", 0)
    bad = [why for why, on in (
        ("MoE layers", any(k not in names for k in kinds)),
        ("use_bias / attention_bias / mlp_bias", any(hf.get(k) for k in (
            "use_bias", "attention_bias", "mlp_bias", "mamba_proj_bias"))),
        ("use_conv_bias false", hf.get("use_conv_bias") is False),
        (f"mlp_hidden_act {hf.get('mlp_hidden_act')!r}",
         nemotron and hf.get("mlp_hidden_act", "relu2") not in MLP_ACTS)) if on]
    if bad:
        raise ConfigError(f"{where}: {bad[0]} has no loom Mamba layout")
    pattern = "".join(names[k] for k in kinds)
    groups = hf.get("n_groups", 1)
    attention = dict(num_attention_heads=hf["num_attention_heads"],
                     num_query_groups=hf.get("num_key_value_heads"), kv_channels=hf.get("head_dim"),
                     ffn_hidden_size=hf.get("intermediate_size"),
                     **MLP_ACTS[hf.get("mlp_hidden_act", "relu2")]) if nemotron else \
        dict(num_attention_heads=groups, kv_channels=hd)  # no attention layer: placeholders
    max_pos = hf.get("max_position_embeddings", 4096)
    return ModelConfig(
        model_type="mamba", num_layers=len(pattern), hidden_size=h,
        hybrid_override_pattern=pattern if set(pattern) != {"M"} else None,
        mamba_state_dim=hf["ssm_state_size"] if nemotron else hf["state_size"],
        mamba_head_dim=hd, mamba_num_groups=groups, mamba_num_heads=heads,
        mamba_d_conv=hf.get("conv_kernel", 4), mamba_chunk_size=hf.get("chunk_size", 128),
        vocab_size=hf["vocab_size"], seq_length=max_pos, max_position_embeddings=max_pos,
        normalization="RMSNorm", norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        position_embedding_type="none", disable_bias_linear=True,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=0.0, exclude_padded_vocab=True, **attention)


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of a ``mamba2`` / ``nemotron_h`` directory."""
    cfg = mamba_config(hf, where)
    return cfg, hf_to_loom(sd, cfg)


HF = HFConversion(model_types=("mamba2", "nemotron_h"), to_loom=to_loom, export_config=hf_config,
                  from_loom=loom_to_hf, title="Mamba-2 / Nemotron-H", read_config=mamba_config)
