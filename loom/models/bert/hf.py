"""Hugging Face ``transformers`` BERT (``BertForMaskedLM`` / ``BertForPreTraining``) -> loom's
post-LN BERT, at any tensor-parallel size.

``transformers``' BERT is the original post-LN order, so it maps onto ``--model-type bert
--post-layernorm``: embeddings (word, position, token type, LayerNorm), per layer the separate
query/key/value projections fused into loom's ``linear_qkv`` (``[q; k; v]`` rows), the
attention output dense + LayerNorm, the intermediate and output dense + LayerNorm, the
prediction-head transform (dense, LayerNorm) and the decoder bias; the decoder weight is tied to
the word embeddings. ``BertForPreTraining``'s pooler and NSP classifier map to the pooler and
binary head. Tensors come out full (unsharded); :func:`loom.interop.hf.load_full_state_dict`
cuts each rank's shard.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.models.family import HFConversion


def bert_config(hf_config, binary_head: bool = False) -> ModelConfig:
    """loom's post-LN BERT for a ``transformers.BertConfig`` (exact GeLU only)."""
    if getattr(hf_config, "hidden_act", "gelu") not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"hidden_act {hf_config.hidden_act!r}: loom's BERT has GeLU")
    if getattr(hf_config, "type_vocab_size", 2) != 2:
        raise ValueError(f"type_vocab_size {hf_config.type_vocab_size}: loom's BERT has 2")
    return ModelConfig(
        model_type="bert", post_layernorm=True, bert_binary_head=binary_head,
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        seq_length=hf_config.max_position_embeddings,
        max_position_embeddings=hf_config.max_position_embeddings,
        vocab_size=hf_config.vocab_size, norm_epsilon=hf_config.layer_norm_eps,
        openai_gelu=hf_config.hidden_act != "gelu", hidden_dropout=0.0, attention_dropout=0.0,
        exclude_padded_vocab=True)


def _ln(sd, src: str, dst: str) -> dict:
    return {f"{dst}.weight": sd[f"{src}.weight"], f"{dst}.bias": sd[f"{src}.bias"]}


def bert_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``BertForMaskedLM`` / ``BertForPreTraining`` state dict -> full tensors under loom's
    names. Raises KeyError naming a tensor the state dict lacks."""
    e = "bert.embeddings."
    out = {"embedding.word_embeddings.weight": sd[e + "word_embeddings.weight"],
           "embedding.position_embeddings.weight": sd[e + "position_embeddings.weight"],
           "embedding.tokentype_embeddings.weight": sd[e + "token_type_embeddings.weight"]}
    out.update(_ln(sd, e + "LayerNorm", "embedding.norm"))
    for i in range(cfg.num_layers):
        h, l = f"bert.encoder.layer.{i}.", f"layers.{i}."
        att = h + "attention.self."
        out[l + "self_attention.linear_qkv.weight"] = torch.cat(
            [sd[att + f"{x}.weight"] for x in ("query", "key", "value")], dim=0)
        out[l + "self_attention.linear_qkv.bias"] = torch.cat(
            [sd[att + f"{x}.bias"] for x in ("query", "key", "value")], dim=0)
        for src, dst in (("attention.output.dense", "self_attention.linear_proj"),
                         ("intermediate.dense", "mlp.linear_fc1"),
                         ("output.dense", "mlp.linear_fc2")):
            out[l + dst + ".weight"] = sd[h + src + ".weight"]
            out[l + dst + ".bias"] = sd[h + src + ".bias"]
        out.update(_ln(sd, h + "attention.output.LayerNorm", l + "post_self_attn_layernorm"))
        out.update(_ln(sd, h + "output.LayerNorm", l + "post_mlp_layernorm"))
    p = "cls.predictions."
    out["lm_head.dense.weight"] = sd[p + "transform.dense.weight"]
    out["lm_head.dense.bias"] = sd[p + "transform.dense.bias"]
    out.update(_ln(sd, p + "transform.LayerNorm", "lm_head.layer_norm"))
    out["output_layer.bias"] = sd.get(p + "bias", sd.get(p + "decoder.bias"))
    if cfg.bert_binary_head:
        out["pooler.dense.weight"] = sd["bert.pooler.dense.weight"]
        out["pooler.dense.bias"] = sd["bert.pooler.dense.bias"]
        out["binary_head.weight"] = sd["cls.seq_relationship.weight"]
        out["binary_head.bias"] = sd["cls.seq_relationship.bias"]
    return out


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of ``BertForMaskedLM`` / ``BertForPreTraining``
    (a pooler and NSP classifier in ``sd`` give the binary head) as post-LN loom BERT."""
    cfg = bert_config(SimpleNamespace(**hf), binary_head="cls.seq_relationship.weight" in sd)
    return cfg, bert_to_loom(sd, cfg)


HF = HFConversion(model_types=("bert",), to_loom=to_loom, title="BERT")
