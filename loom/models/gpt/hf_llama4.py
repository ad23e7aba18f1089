"""Hugging Face ``Llama4ForCausalLM`` (Llama 4's text model, ``model_type: llama4_text``) ->
loom, import only, for the configs loom's attention computes exactly.

Llama 4 (Meta 2025; ``transformers.models.llama4``) is the LLaMA layout with MoE layers on
``moe_layers`` (every ``interleave_moe_layer_step``-th): a top-1 sigmoid router whose score
scales the expert's *input* (Megatron's ``--moe-apply-probs-on-input``), one shared expert of
the experts' width, dense layers of ``intermediate_size_mlp``; RoPE on adjacent pairs (Meta's
complex rotation: each head's query / key rows are reordered to loom's halves,
:func:`pairs_to_halves`) with Llama 3's frequency scaling, and no RoPE in the layers
``no_rope_layers`` marks 0 (``--no-rope-freq``).

What loom's attention does not compute is refused before any weight is read: ``use_qk_norm``
(Llama 4's L2 norm of queries and keys in its RoPE layers only; Megatron's and loom's
``--qk-l2-norm`` normalizes every layer), chunked attention shorter than the context
(``attention_chunk_size`` < ``max_position_embeddings``) and the NoPE layers' temperature
tuning where it acts (``attn_temperature_tuning`` with positions past ``floor_scale``: the
query scale ``log(floor((i + 1) / floor_scale) + 1) attn_scale + 1`` is 1 before them). These
are torchtitan's Llama 4 (no QK norm, no temperature tuning, causal attention within one
block: :mod:`loom.config.torchtitan`), whose checkpoints ``loom checkpoint convert
--from-torchtitan`` reads through this layout; Meta's released Llama 4 checkpoints use the QK
norm and are refused naming it.
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
    chunk = _get(hf, "attention_chunk_size", positions)
    refuse = [
        ("use_qk_norm true: the L2 norm of queries and keys in the RoPE layers only "
         "(loom's --qk-l2-norm, Megatron's, normalizes every layer)",
         bool(_get(hf, "use_qk_norm", True))),
        (f"attention_chunk_size {chunk} < max_position_embeddings {positions}: chunked "
         f"attention (loom's is causal over the whole sequence)", chunk < positions),
        (f"attn_temperature_tuning past floor_scale {_get(hf, 'floor_scale', 8192)} positions "
         f"(max_position_embeddings {positions})",
         bool(_get(hf, "attn_temperature_tuning", True)) and 0 in rope_layers(hf)
         and positions > _get(hf, "floor_scale", 8192)),
        (f"num_experts_per_tok {hf.get('num_experts_per_tok')}: Llama 4 scales the expert's "
         f"input by its score, which Megatron defines for top-1 only",
         _get(hf, "num_experts_per_tok", 1) != 1)]
    bad = [why for why, on in refuse if on]
    if bad:
        raise ConfigError(f"{where}: {TITLE} {bad[0]}; not supported by loom")
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
