"""Model FLOPs of a decoder-only transformer (forward, backward, recompute).

The count generalizes Korthikanti et al. 2022 eq. 7 (``72 B s L h^2 (1 + s/(6h) + V/(12 h L))``
model FLOPs per iteration) to grouped-query attention, SwiGLU and any FFN size; for a GPT with
``ffn = 4h`` and ``g = a`` it reduces to that formula exactly. Attention scores are counted
without a causal discount, as Megatron-LM and the papers do.

Mixture of experts: an MoE layer's MLP costs what its *active* parameters cost, ``k`` experts plus
the shared expert plus the router (:func:`loom.planner.moe.moe_mlp_flops_per_token`), so model
FLOPs, TFLOP/s and MFU count active parameters (as Megatron-Core's MoE throughput and the
DeepSeek-V3 / Mixtral papers do); dense layers as above.

Mamba-2 and hybrid stacks: each layer of the pattern counts its own kind
(:func:`loom.planner.mamba.kind_flops_per_token`: Mamba-2 projections, conv and the chunked SSD
scan; attention layers the QKV / projection / scores terms above; MLP layers the MLP term);
selective recompute repeats the scores of the attention layers only.

Multi-latent attention and multi-token prediction (``--multi-latent-attention``,
``--mtp-num-layers``): their terms are :mod:`loom.planner.mla`'s.
"""

from __future__ import annotations

import numpy as np

from loom.config import ModelConfig
from loom.planner.mamba import is_hybrid, kind_counts, layers_forward_flops_per_token
from loom.planner.mla import attention_flops_per_token, mtp_depth, mtp_extra_flops_per_token
from loom.planner.moe import moe_mlp_flops_per_token, num_moe_layers
from loom.planner.layer_shape import gated_mlp


def forward_flops_per_token(cfg: ModelConfig, seq_length: int | None = None,
                            vocab_size: int | None = None) -> float:
    """Forward FLOPs per token (multiply-add = 2 FLOPs), all layers plus the output layer."""
    s = seq_length or cfg.seq_length
    V = vocab_size or cfg.vocab_size or 0
    h, f = cfg.hidden_size, cfg.ffn_size
    gemm, scores = attention_flops_per_token(cfg, s)  # QKV + projection; QK^T and x V (MLA too)
    attention = gemm + scores
    mlp = (6 if gated_mlp(cfg) else 4) * h * f
    if is_hybrid(cfg):
        return layers_forward_flops_per_token(cfg, s) + 2 * h * V
    D = mtp_depth(cfg)  # MTP modules: one layer of the last layer's kind each, + eh_proj, head
    mtp = D * (attention + mtp_extra_flops_per_token(cfg, V))
    if cfg.num_experts:
        n_moe = num_moe_layers(cfg)
        moe = moe_mlp_flops_per_token(cfg)
        mtp += D * (moe if cfg.is_moe_layer(cfg.num_layers - 1) else mlp)
        return (cfg.num_layers * attention + (cfg.num_layers - n_moe) * mlp
                + n_moe * moe + 2 * h * V + mtp)
    return cfg.num_layers * (attention + mlp) + 2 * h * V + D * mlp + mtp


def op_sac_recompute_share(cfg: ModelConfig) -> float:
    """Share of a dense layer's forward GEMM FLOPs that torchtitan's op-level selective
    activation checkpointing recomputes in backward (``[activation_checkpoint] mode =
    'selective'``, ``selective_ac_option = 'op'``, torchtitan's default: its
    ``parallelize_llama.py`` policy saves the output of every op in its save list (``aten.mm``,
    the SDPA kernels) "except every second mm" of the block, counted in execution order, and
    recomputes everything else). The block's mms run ``wq, wk, wv, wo`` then ``w1, w3, w2``
    (SwiGLU, ``w2(silu(w1 x) * w3 x)``) or ``fc1, fc2``, so ``wk``, ``wo`` and ``w3`` (or
    ``fc2``) are recomputed; attention is not (its output is saved).

    Raises:
        ValueError: for multi-latent attention, MoE and hybrid stacks (other block orders)."""
    if cfg.multi_latent_attention or cfg.num_experts or is_hybrid(cfg):
        raise ValueError("op-level selective recompute (Options.selective_ac_op) is modelled "
                         "for dense GQA/MHA blocks only")
    h, a, g, d, f = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_groups,
                     cfg.head_dim, cfg.ffn_size)
    mms = [h * a * d, h * g * d, h * g * d, a * d * h]
    mms += [h * f, h * f, f * h] if gated_mlp(cfg) else [h * f, f * h]
    return float(sum(mms[1::2])) / float(sum(mms))


def model_flops_per_iteration(cfg: ModelConfig, global_batch_size: int,
                              seq_length: int | None = None, vocab_size: int | None = None) -> float:
    """Model FLOPs of one training iteration: forward + backward (2x forward), no recompute.

    This is the numerator of MFU (KOR eq. 7). Unit: FLOPs.
    """
    s = seq_length or cfg.seq_length
    return 3.0 * forward_flops_per_token(cfg, s, vocab_size) * global_batch_size * s


def hardware_flops_per_iteration(cfg: ModelConfig, global_batch_size: int, recompute: str | None,
                                 seq_length: int | None = None, vocab_size: int | None = None) -> float:
    """Hardware FLOPs: model FLOPs plus recomputation.

    ``full``: one more forward of every layer (NAR eq. 3, factor 96 instead of 72).
    ``selective``: the attention-score part recomputed (KOR eq. 8: ``s/(6h)`` becomes ``s/(3h)``).
    """
    s = seq_length or cfg.seq_length
    tokens = global_batch_size * s
    base = model_flops_per_iteration(cfg, global_batch_size, s, vocab_size)
    V = vocab_size or cfg.vocab_size or 0
    layers_fwd = forward_flops_per_token(cfg, s, V) - 2 * cfg.hidden_size * V
    if recompute == "full":
        return base + layers_fwd * tokens
    if recompute == "selective":
        n_attn = kind_counts(cfg)["*"] if is_hybrid(cfg) else cfg.num_layers + mtp_depth(cfg)
        return base + n_attn * attention_flops_per_token(cfg, s)[1] * tokens
    return base


def throughput(model: ModelConfig, L: dict, global_batch_size: int, seq_length: int,
               cluster, iteration_s, recompute_share=None) -> dict:
    """Tokens/s, model TFLOP/s per GPU (KOR eq 7 convention, MFU numerator), hardware TFLOP/s
    per GPU (with recompute, NAR eq 3 / KOR eq 8 convention) and MFU (model FLOPs / (time x
    GPUs x peak)). ``recompute_share``: the share of layers fully recomputed under full
    recompute (block method; default all)."""
    n = L["tp"] * L["pp"] * L["dp"] * L["cp"]
    model_f = model_flops_per_iteration(model, global_batch_size, seq_length)
    rc = L["recompute"]
    hw = {name: hardware_flops_per_iteration(model, global_batch_size, name, seq_length)
          for name in ("none", "selective", "full")}
    share = 1.0 if recompute_share is None else recompute_share
    hw_f = np.where(rc == 2, hw["none"] + share * (hw["full"] - hw["none"]),
                    np.where(rc == 1, hw["selective"], hw["none"]))
    it = np.asarray(iteration_s, dtype=np.float64)
    return {
        "tokens_per_s": global_batch_size * seq_length / it,
        "tflops_per_gpu": model_f / (it * n) / 1e12,
        "hw_tflops_per_gpu": hw_f / (it * n) / 1e12,
        "mfu": model_f / (it * n * cluster.peak_flops),
        "model_flops": model_f + 0 * it,
        "hardware_flops": hw_f + 0 * it,
    }
