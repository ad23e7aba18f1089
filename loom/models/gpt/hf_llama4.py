"""Hugging Face ``Llama4ForCausalLM`` (Llama 4's text model, ``model_type: llama4_text``) ->
loom, import only, for the configs loom's attention computes exactly.

Llama 4 (Meta 2025; ``transformers.models.llama4``) is the LLaMA layout with MoE layers on
``moe_layers`` (every ``interleave_moe_layer_step``-th): a top-1 sigmoid router whose score
scales the expert's *input* (Megatron's ``--moe-apply-probs-on-input``), one shared expert of
the experts' width, dense layers of ``intermediate_size_mlp``; RoPE on adjacent pairs (Meta's
complex rotation: each head's query / key rows are reordered to loom's halves,
:func:`pairs_to_halves`) with Llama 3's frequency scaling, and no RoPE in the layers
``no_rope_layers`` marks 0 (``--no-rope-freq``).

Llama 4's own attention maps to loom's flags of it (:mod:`loom.config.model_llama4`):
``use_qk_norm`` to ``--qk-l2-norm`` (with ``--qk-l2-norm-rope-layers-only`` when there are
NoPE layers: Llama 4 normalizes in its RoPE layers only), ``attention_chunk_size`` shorter
than the context to ``--attention-chunk-size`` (its RoPE layers attend within chunks), and
``attn_temperature_tuning`` to ``--attn-temperature-floor-scale floor_scale``
``--attn-temperature-scale attn_scale`` (its NoPE layers' query scale by position). So Meta's
released checkpoints (Scout, Maverick) and torchtitan's (no QK norm, no temperature tuning:
``loom checkpoint convert --from-torchtitan`` reads them through this layout) both import.
Refused before any weight is read: ``num_experts_per_tok`` above 1 (Llama 4 scales the expert's
input by its score, which Megatron defines for top-1).
"""

from __future__ import annotations

from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.gpt.hf_parts import attention_to_loom, outer_to_loom, swiglu_to_loom
from loom.config.model_rope import rope_fields

TITLE = "Llama 4"


def pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Query / key rows ``[heads * d, h]`` from RoPE on adjacent pairs (Meta's, torchtitan's,
    Llama 4's) to RoPE on halves (loom's, Hugging Face Llama's): within each head, rows
    ``0, 2, 4, ...`` then ``1, 3, 5, ...`` (the permutation transformers'
    convert_llama_weights_to_hf applies)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _get(hf: dict, key: str, default):
    value = hf.get(key)
    return default if value is None else value


def moe_layers(hf: dict) -> list[int]:
    """The MoE layers of a ``llama4_text`` config: ``moe_layers``, else every
    ``interleave_moe_layer_step``-th (transformers' default)."""
    L, step = hf["num_hidden_layers"], _get(hf, "interleave_moe_layer_step", 1)
    return list(_get(hf, "moe_layers", list(range(step - 1, L, step))))


def rope_layers(hf: dict) -> list[int]:
    """1 for each layer with RoPE, 0 without (``no_rope_layers``; transformers' default: every
    4th layer without)."""
    L = hf["num_hidden_layers"]
    return list(_get(hf, "no_rope_layers",
                     [int((i + 1) % _get(hf, "no_rope_layer_interval", 4) != 0)
                      for i in range(L)]))


def read_config(hf: dict, where: str) -> ModelConfig:
    """loom's layout of a ``llama4_text`` ``config.json`` dict. Raises ConfigError naming
    ``where`` for what loom's attention does not compute (module docstring)."""
    positions = hf["max_position_embeddings"]
    if _get(hf, "num_experts_per_tok", 1) != 1:
        raise ConfigError(f"{where}: {TITLE} num_experts_per_tok {hf.get('num_experts_per_tok')}"
                          f": Llama 4 scales the expert's input by its score, which Megatron "
                          f"defines for top-1 only; not supported by loom")
    L = hf["num_hidden_layers"]
    moe = set(moe_layers(hf))
    rope = rope_layers(hf)
    freq = [int(i in moe) for i in range(L)]
    hidden = hf["intermediate_size"]
    ns = type("HF", (), {"model_type": "llama4_text", **hf})
    fields = dict(
        num_layers=L, hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"], group_query_attention=True,
        kv_channels=hf.get("head_dim"), seq_length=positions, max_position_embeddings=positions,
        vocab_size=hf["vocab_size"], norm_epsilon=_get(hf, "rms_norm_eps", 1e-5),
        untie_embeddings_and_output_weights=not _get(hf, "tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=0.0, exclude_padded_vocab=True,
        ffn_hidden_size=_get(hf, "intermediate_size_mlp", hidden), **rope_fields(ns, TITLE))
    if any(freq):
        fields.update(num_experts=hf["num_local_experts"], moe_router_topk=1,
                      moe_ffn_hidden_size=hidden, moe_shared_expert_intermediate_size=hidden,
                      moe_router_score_function="sigmoid", moe_apply_probs_on_input=True,
                      moe_layer_freq="1" if all(freq) else str(freq).replace(" ", ""))
    if 0 in rope:
        fields["no_rope_freq"] = str([1 - r for r in rope]).replace(" ", "")
        if _get(hf, "attn_temperature_tuning", True):
            fields.update(attn_temperature_floor_scale=int(_get(hf, "floor_scale", 8192)),
                          attn_temperature_scale=float(_get(hf, "attn_scale", 0.1)))
    if _get(hf, "use_qk_norm", True):  # transformers: in the RoPE layers only
        fields.update(qk_l2_norm=True, qk_l2_norm_rope_layers_only=0 in rope)
    chunk = hf.get("attention_chunk_size")
    if chunk is not None and chunk < positions and 1 in rope:
        fields["attention_chunk_size"] = int(chunk)
    return ModelConfig.llama(**fields)


def llama4_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``Llama4ForCausalLM`` state dict (experts as transformers holds them: ``gate_up_proj
    [E, h, 2f]``, gate columns first, ``down_proj [E, f, h]``) -> loom names."""
    out = outer_to_loom(sd)
    heads, groups = cfg.num_attention_heads, cfg.num_kv_groups
    for i in range(cfg.num_layers):
        h, l = f"model.layers.{i}.", f"layers.{i}."
        a = h + "self_attn."
        attn = {k: sd[k] for k in (a + "v_proj.weight", a + "o_proj.weight",
                                   h + "input_layernorm.weight",
                                   h + "post_attention_layernorm.weight")}
        attn[a + "q_proj.weight"] = pairs_to_halves(sd[a + "q_proj.weight"], heads)
        attn[a + "k_proj.weight"] = pairs_to_halves(sd[a + "k_proj.weight"], groups)
        out.update(attention_to_loom(attn, h, l))
        f = h + "feed_forward."
        if not cfg.is_moe_layer(i):
            out.update(swiglu_to_loom(sd, f, l + "mlp."))
            continue
        out[l + "mlp.router.weight"] = sd[f + "router.weight"]
        gate_up, down = sd[f + "experts.gate_up_proj"], sd[f + "experts.down_proj"]
        for e in range(cfg.num_experts):
            out[l + f"mlp.experts.{e}.linear_fc1.weight"] = gate_up[e].t()
            out[l + f"mlp.experts.{e}.linear_fc2.weight"] = down[e].t()
        out.update(swiglu_to_loom(sd, f + "shared_expert.", l + "mlp.shared_experts."))
    return {k: v.contiguous() for k, v in out.items()}


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of a ``llama4_text`` ``config.json`` dict and state
    dict."""
    cfg = read_config(hf, where)
    return cfg, llama4_to_loom(sd, cfg)
