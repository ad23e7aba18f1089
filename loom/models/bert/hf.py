"""Hugging Face ``transformers`` BERT (``BertForMaskedLM`` / ``BertForPreTraining``) <-> loom's
post-LN BERT, at any tensor-parallel size, both ways.

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
from loom.errors import ConfigError
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


def _pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(HF name, loom name) of every tensor copied unchanged: all but the fused QKV and the
    (vocabulary-padded) output bias."""
    e = "bert.embeddings."
    pairs = [(e + "word_embeddings.weight", "embedding.word_embeddings.weight"),
             (e + "position_embeddings.weight", "embedding.position_embeddings.weight"),
             (e + "token_type_embeddings.weight", "embedding.tokentype_embeddings.weight"),
             (e + "LayerNorm", "embedding.norm"),
             ("cls.predictions.transform.dense", "lm_head.dense"),
             ("cls.predictions.transform.LayerNorm", "lm_head.layer_norm")]
    for i in range(cfg.num_layers):
        h, l = f"bert.encoder.layer.{i}.", f"layers.{i}."
        pairs += [(h + a, l + b) for a, b in (
            ("attention.output.dense", "self_attention.linear_proj"),
            ("intermediate.dense", "mlp.linear_fc1"), ("output.dense", "mlp.linear_fc2"),
            ("attention.output.LayerNorm", "post_self_attn_layernorm"),
            ("output.LayerNorm", "post_mlp_layernorm"))]
    if cfg.bert_binary_head:
        pairs += [("bert.pooler.dense", "pooler.dense"), ("cls.seq_relationship", "binary_head")]
    out = []
    for a, b in pairs:  # a module: its weight and bias
        out += [(a, b)] if a.endswith(".weight") else [(a + ".weight", b + ".weight"),
                                                        (a + ".bias", b + ".bias")]
    return out


def _qkv(layer: int) -> tuple[str, str]:
    return f"bert.encoder.layer.{layer}.attention.self.", f"layers.{layer}.self_attention."


def bert_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``BertForMaskedLM`` / ``BertForPreTraining`` state dict -> full tensors under loom's
    names. Raises KeyError naming a tensor the state dict lacks."""
    out = {loom: sd[hf] for hf, loom in _pairs(cfg)}
    for i in range(cfg.num_layers):
        att, s = _qkv(i)
        for kind in ("weight", "bias"):
            out[s + f"linear_qkv.{kind}"] = torch.cat(
                [sd[att + f"{x}.{kind}"] for x in ("query", "key", "value")], dim=0)
    p = "cls.predictions."
    out["output_layer.bias"] = sd.get(p + "bias", sd.get(p + "decoder.bias"))
    return out


def bert_hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of ``BertForMaskedLM`` (``BertForPreTraining`` with the binary head)
    for a post-LN loom BERT. Raises ConfigError for pre-LN (no HF class computes it)."""
    if not cfg.post_layernorm:
        raise ConfigError("transformers' BERT is post-LN: only a --post-layernorm BERT converts "
                          "to Hugging Face")
    if cfg.num_kv_groups != cfg.num_attention_heads or cfg.head_dim * cfg.num_attention_heads \
            != cfg.hidden_size:
        raise ConfigError("transformers' BERT has h / a channels per head and no GQA: this "
                          "model does not convert to Hugging Face")
    return {"architectures": ["BertForPreTraining" if cfg.bert_binary_head else
                              "BertForMaskedLM"], "model_type": "bert",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "intermediate_size": cfg.ffn_size,
            "hidden_act": "gelu_pytorch_tanh" if cfg.openai_gelu else "gelu",
            "max_position_embeddings": cfg.max_positions, "type_vocab_size": 2,
            "layer_norm_eps": cfg.norm_epsilon, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0, "tie_word_embeddings": True}


def loom_to_bert(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full loom tensors (vocabulary padding dropped) -> the ``BertForMaskedLM`` /
    ``BertForPreTraining`` state dict (the decoder weight tied: not written); the inverse of
    :func:`bert_to_loom`."""
    V, h = cfg.vocab_size, cfg.hidden_size
    out = {hf: full[loom] for hf, loom in _pairs(cfg)}
    out["bert.embeddings.word_embeddings.weight"] = full["embedding.word_embeddings.weight"][:V]
    for i in range(cfg.num_layers):
        att, s = _qkv(i)
        for kind in ("weight", "bias"):
            for x, part in zip(("query", "key", "value"),
                               full[s + f"linear_qkv.{kind}"].split([h, h, h])):
                out[att + f"{x}.{kind}"] = part
    out["cls.predictions.bias"] = full["output_layer.bias"][:V]
    return {k: v.contiguous() for k, v in out.items()}


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of ``BertForMaskedLM`` / ``BertForPreTraining``
    (a pooler and NSP classifier in ``sd`` give the binary head) as post-LN loom BERT."""
    cfg = bert_config(SimpleNamespace(**hf), binary_head="cls.seq_relationship.weight" in sd)
    return cfg, bert_to_loom(sd, cfg)


def read_config(hf: dict, where: str) -> ModelConfig:
    """loom's BERT of a ``config.json`` dict, the binary head where its architecture is
    ``BertForPreTraining`` (the NSP classifier)."""
    try:
        return bert_config(SimpleNamespace(**hf), binary_head="BertForPreTraining" in
                           (hf.get("architectures") or []))
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


HF = HFConversion(model_types=("bert",), to_loom=to_loom, export_config=bert_hf_config,
                  from_loom=loom_to_bert, title="BERT", read_config=read_config)
