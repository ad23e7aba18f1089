"""Multi-latent attention and multi-token prediction terms of the planner: parameters, FLOPs,
activations, communication (issue 24; the layer structure of ``loom/models/gpt/mla.py`` and
``loom/models/mtp.py``).

Symbols: h hidden, a heads, ``q`` = ``--q-lora-rank`` (0: a full query projection), ``r`` =
``--kv-lora-rank``, ``dn`` / ``dr`` / ``dv`` = ``--qk-head-dim`` / ``--qk-pos-emb-head-dim`` /
``--v-head-dim``, ``dq = dn + dr``, ``S`` tokens per GPU and micro-batch, s the sequence.

* MLA parameters (DeepSeek-V2 sec. 2.1): split over TP (column-parallel up projections,
  row-parallel output): ``q a dq`` (or ``h a dq``), ``r a (dn + dv)``, ``a dv h``; replicated
  (down projections and, with ``--qk-layernorm``, their norms): ``h q + q + h (r + dr) + r``.
  DeepSeek-V3: 187.1M per layer.
* MLA forward FLOPs per token (multiply-add = 2): ``2 (h q + q a dq | h a dq) + 2 h (r + dr)
  + 2 r a (dn + dv) + 2 a dv h`` plus the scores ``2 s a dq + 2 s a dv`` (QK^T and the
  value product, no causal discount, as the dense count).
* MLA activations (16-bit): split by TP: Q and K ``2 S a dq`` each, V ``2 S a dv``, the output
  projection input ``2 S a dv``; replicated (the down projections' outputs and norm inputs):
  ``2 S (2 q + 2 r + dr)`` (without SP: on every TP rank). What loom's own MLA layer saves,
  term by term and measured, is :func:`loom.planner.layer_bytes.mla_layer_terms` (within 0.2%
  of this count for DeepSeek-V3; ``--layer-memory loom``).
* MLA communication: as a dense layer's (2 all-reduces of ``[S, h]`` forward and backward; under
  SP the all-gathers carry the latents ``S (q + r + dr)`` instead of ``S h``, smaller for
  DeepSeek-V3) plus the gradient all-reduce of the shared RoPE key ``S dr`` without SP; CP
  gathers K ``a dq`` and V ``a dv`` per token (the expanded keys and values, not the latent).
* DSA (``--experimental-attention-variant dsa``, n = ``--dsa-indexer-n-heads``, d =
  ``--dsa-indexer-head-dim``): the lightning indexer, replicated over TP: ``(q | h) n d + h d +
  2 d + h n`` parameters, ``2 ((q | h) n d + h d + h n)`` GEMM FLOPs per token and ``2 s n d``
  for its scores; the attention itself is counted dense (loom masks it).
* MTP (DeepSeek-V3 sec. 2.2): D modules on the last pipeline stage, each ``3`` norms ``h``,
  ``eh_proj`` ``2 h^2`` (replicated over TP) and one transformer layer of the last layer's kind;
  per token the module's layer, ``2 (2 h) h`` and one more output layer ``2 h V``.
"""

from __future__ import annotations

from loom.config import ModelConfig
from loom.planner.gdn import gate_params, gdn_flops_per_token, gdn_params, gdn_share, layer_mix


def _dims(model: ModelConfig) -> tuple:
    return (model.hidden_size, model.num_attention_heads, model.q_lora_rank or 0,
            model.kv_lora_rank, model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim)


def mla_attention_params(model: ModelConfig) -> tuple[int, int]:
    """``(tp_sharded, replicated)`` parameters of one MLA attention (without the layer's
    input norm), biases of the output projection when the model has them (replicated)."""
    h, a, q, r, dn, dr, dv = _dims(model)
    dq = dn + dr
    sharded = (q * a * dq if q else h * a * dq) + r * a * (dn + dv) + a * dv * h
    norms = (q + r) if model.qk_layernorm else 0  # the latents' norms (--qk-layernorm)
    replicated = h * q + h * (r + dr) + norms
    if model.dsa:  # the lightning indexer: W_qb, W_k, k's LayerNorm, head weights
        n, d = model.dsa_indexer_n_heads, model.dsa_indexer_head_dim
        replicated += (q or h) * n * d + h * d + 2 * d + h * n
    if not model.disable_bias_linear:
        replicated += h
    return sharded, replicated


def mla_forward_flops_per_token(model: ModelConfig, seq_length: int) -> tuple[float, float]:
    """``(gemm, scores)`` forward FLOPs per token of one MLA attention (module docstring)."""
    h, a, q, r, dn, dr, dv = _dims(model)
    dq, s = dn + dr, seq_length
    q_flops = 2 * (h * q + q * a * dq) if q else 2 * h * a * dq
    gemm = q_flops + 2 * h * (r + dr) + 2 * r * a * (dn + dv) + 2 * a * dv * h
    scores = 2 * s * a * dq + 2 * s * a * dv
    if model.dsa:  # the indexer's projections and scores
        n, d = model.dsa_indexer_n_heads, model.dsa_indexer_head_dim
        gemm += 2 * ((q or h) * n * d + h * d + h * n)
        scores += 2 * s * n * d
    return float(gemm), float(scores)


def mla_activation_bytes(model: ModelConfig, S) -> tuple:
    """``(tp_split, replicated)`` activation bytes of one MLA attention for ``S`` tokens."""
    h, a, q, r, dn, dr, dv = _dims(model)
    split = S * (2 * a * (dn + dr) * 2 + 2 * a * dv * 2)
    replicated = 2 * S * (2 * q + 2 * r + dr)
    return split, replicated


def attention_params(model: ModelConfig) -> tuple[int, int]:
    """``(tp_sharded, replicated)`` attention parameters of one layer without its input norm:
    MLA's, or QKV ``h (a d + 2 g d)`` + output ``a d h`` (+ the QKV bias, sharded; the output
    gate's ``h a d``); with Gated DeltaNet layers the per-layer mean (:mod:`loom.planner.gdn`).
    The Q/K norms are :func:`loom.planner.layer_shape.layer_norm_params`'."""
    if model.multi_latent_attention:
        sh, rep = mla_attention_params(model)
        return sh, rep - (0 if model.disable_bias_linear else model.hidden_size)
    h, a, g, d = (model.hidden_size, model.num_attention_heads, model.num_kv_groups,
                  model.head_dim)
    sharded = h * (a * d + 2 * g * d) + a * d * h + gate_params(model)
    if not model.disable_bias_linear:
        sharded += a * d + 2 * g * d
    if model.softmax_type == "learnable":  # attention sinks: one logit per head (gpt-oss)
        sharded += a
    return layer_mix((sharded, 0), gdn_params(model), gdn_share(model))


def attention_flops_per_token(model: ModelConfig, seq_length: int) -> tuple[float, float]:
    """``(gemm, scores)`` forward FLOPs per token of one layer's attention (MLA or GQA; the
    output gate's projection in ``gemm``; Gated DeltaNet layers, all token-linear, in
    ``gemm``: the per-layer mean, :mod:`loom.planner.gdn`)."""
    if model.multi_latent_attention:
        return mla_forward_flops_per_token(model, seq_length)
    h, a, g, d = (model.hidden_size, model.num_attention_heads, model.num_kv_groups,
                  model.head_dim)
    standard = (float(2 * h * (a * d + 2 * g * d) + 2 * a * d * h + 2 * gate_params(model)),
                float(4 * seq_length * a * d))
    return layer_mix(standard, (gdn_flops_per_token(model), 0.0), gdn_share(model))


def mtp_depth(model: ModelConfig) -> int:
    """D: ``--mtp-num-layers`` (0 without MTP)."""
    return model.mtp_num_layers or 0


def mtp_extra_params(model: ModelConfig) -> int:
    """Parameters of one MTP module besides its transformer layer: 3 norms, ``eh_proj``."""
    h = model.hidden_size
    return (3 * (2 if model.normalization == "LayerNorm" else 1) * h) + 2 * h * h


def mtp_extra_flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    """Forward FLOPs per token of one MTP module besides its layer: ``eh_proj`` and the shared
    output layer ``2 h V``."""
    h = model.hidden_size
    return float(2 * 2 * h * h + 2 * h * vocab_size)


def _mtp_layer(model: ModelConfig, dense_layer: tuple[int, int]) -> tuple[float, float, float]:
    """``(tp_sharded, replicated, expert)`` parameters of an MTP module's transformer layer (the
    last decoder layer's kind)."""
    from loom.planner.moe import moe_layer_params
    if model.num_experts and model.is_moe_layer(model.num_layers - 1):
        return tuple(float(x) for x in moe_layer_params(model, dense_layer))
    return float(dense_layer[0]), float(dense_layer[1]), 0.0


def mtp_params(model: ModelConfig, dense_layer: tuple[int, int], active: bool = False) -> float:
    """Parameters of the D MTP modules (count); ``active``: k of the E experts. ``dense_layer``:
    :func:`loom.planner.memory.layer_params`. The embedding and output layer are shared."""
    D = mtp_depth(model)
    if not D:
        return 0.0
    sh, rep, ex = _mtp_layer(model, dense_layer)
    if active and ex:
        ex = ex * model.moe_router_topk / model.num_experts
    return D * (sh + rep + ex + mtp_extra_params(model))


def mtp_stage_params(model: ModelConfig, dense_layer: tuple[int, int], t, ep) -> tuple:
    """``(per_gpu, expert_per_gpu)`` parameters the D MTP modules add to the last pipeline
    stage (TP ``t``, EP ``ep``; ``eh_proj`` and the norms replicated)."""
    D = mtp_depth(model)
    if not D:
        return 0.0, 0.0
    sh, rep, ex = _mtp_layer(model, dense_layer)
    expert = ex / (t * ep)
    return D * (sh / t + rep + expert + mtp_extra_params(model)), D * expert
