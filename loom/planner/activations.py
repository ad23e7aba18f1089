"""Activation bytes of one transformer layer per micro-batch (KOR table 2, generalized), the
``--distribute-saved-activations`` variant, and the first stage's in-flight micro-batches of
the closed-form schedules; :mod:`loom.planner.memory` re-exports them. The per-rank held
micro-batches of every schedule and split are :mod:`loom.planner.stage_table`'s.
"""

from __future__ import annotations

import numpy as np

from loom.config import ModelConfig
from loom.planner.layout import Options
from loom.planner.mla import mla_activation_bytes
from loom.planner.moe import MOE_LOAD_IMBALANCE, expert_tp, moe_activation_bytes, moe_fraction
from loom.planner.layer_shape import gated_mlp


def layer_dims(model: ModelConfig, seq_length: int, L: dict) -> tuple:
    """``(h, a, g, d, f, t, c, sp, S, drop)``: the layer's widths, the row's TP / CP / SP, the
    tokens per GPU ``S = s b / c`` and 1 when the model has hidden dropout (else 0)."""
    h, a, g, d, f = (model.hidden_size, model.num_attention_heads, model.num_kv_groups,
                     model.head_dim, model.ffn_size)
    t, c, b, sp = L["tp"], L["cp"], L["mbs"], L["sp"]
    return h, a, g, d, f, t, c, sp, seq_length * b / c, 1.0 if model.hidden_dropout > 0 else 0.0


def activation_bytes_per_layer(model: ModelConfig, seq_length: int, L: dict, recompute=None,
                               flash_attention: bool = False,
                               moe_load_imbalance: float = MOE_LOAD_IMBALANCE,
                               moe_share: float | None = None) -> dict:
    """Activation bytes of one transformer layer for one micro-batch on one GPU (KOR table 2).

    With ``S = s b / c`` tokens per GPU, 16-bit activations:

    * replicated across TP ranks unless sequence parallel (KOR's ``10 s b h``): the two norm
      inputs ``4 S h``, the attention and MLP inputs ``2 S h`` each, two dropout masks ``S h``
      each (only with ``hidden_dropout > 0``);
    * split by TP (KOR's ``24 s b h``): Q ``2 S a d``, K and V ``2 S g d`` each, projection input
      ``2 S a d``, MLP ``4 S f`` (GeLU: fc1 output and activation) or ``6 S f`` (SwiGLU);
    * attention scores (KOR's ``5 a s^2 b``): softmax ``2``, dropout mask ``1``, dropout output
      ``2`` bytes per score, ``a (s/c) s b`` scores; with flash attention only the fp32 log-sum-exp
      ``4 a S``.

    Returns ``{"none", "selective", "full", "scores"}`` (arrays): full recompute keeps the layer
    input ``2 S h`` (divided by t with SP), selective drops the scores. For the GPT shape this
    reproduces KOR table 2 exactly: TP ``s b h (10 + 24/t + 5 a s/(h t))``, TP+SP
    ``s b h (34/t + 5 a s/(h t))``, selective ``s b h (10 + 24/t)``, full ``2 s b h``.
    MoE: in a share ``moe_share`` of the layers (1 = an MoE layer, 0 = a dense one; default the
    model's share :func:`loom.planner.moe.moe_fraction`) the MLP's ``(6|4) S f`` is replaced by
    :func:`loom.planner.moe.moe_activation_bytes` (``moe_load_imbalance``): its replicated
    part divided by t under SP as the dense layer's, the experts' gathered inputs never.
    """
    s = seq_length
    h, a, g, d, f, t, c, sp, S, drop = layer_dims(model, s, L)
    kept = 0.0
    repl = S * h * (4 + 2 + 2 + 2 * drop)
    split = S * (2 * a * d + 4 * g * d + 2 * a * d) + S * f * (6 if gated_mlp(model) else 4)
    if model.multi_latent_attention:  # loom.planner.mla: Q, K, V, latents
        mla_split, mla_repl = mla_activation_bytes(model, S)
        split = split - S * (2 * a * d + 4 * g * d + 2 * a * d) + mla_split
        repl = repl + mla_repl
    if model.num_experts:
        fm = moe_fraction(model) if moe_share is None else moe_share
        moe_split, moe_repl, gathered = moe_activation_bytes(model, S, moe_load_imbalance,
                                                             expert_tp(L) / t)
        split = split + fm * (moe_split - S * f * (6 if gated_mlp(model) else 4))
        repl = repl + fm * moe_repl
        kept = fm * gathered  # the experts' inputs: not divided by t, with or without SP
    if flash_attention:
        scores = 4.0 * a * S / t
    else:
        per_score = 2 + (3 if model.attention_dropout > 0 else 0)
        scores = per_score * a * S * s / t
    repl_t = np.where(sp > 0, repl / t, repl) + kept
    selective = repl_t + split / t + (scores if flash_attention else 0.0)
    none = repl_t + split / t + scores
    full = np.where(sp > 0, 2 * S * h / t, 2 * S * h)
    return {"none": none, "selective": selective, "full": full, "scores": scores}


def distribute_saved(act: dict, L: dict, opts: Options) -> dict:
    """``act`` (:func:`activation_bytes_per_layer`'s terms) with Megatron's
    ``--distribute-saved-activations``: the full-recompute input ``2 S h`` split over the TP
    ranks where SP does not split it already (``opts.distribute_saved_activations``)."""
    if not opts.distribute_saved_activations:
        return act
    return dict(act, full=np.where(L["sp"] > 0, act["full"], act["full"] / L["tp"]))


def inflight_microbatches(L: dict, m) -> np.ndarray:
    """Micro-batches of activations held by the first stage: 1 without PP, ``min(p, m)`` with
    1F1B, ``p (1 + (p-1)/(p v))`` with the interleaved schedule (KOR sec 4.2.3)."""
    p, v = L["pp"], L["vp"]
    one_f = np.minimum(p, m)
    inter = np.minimum(m, p) * (1 + (p - 1) / (p * v))
    # ZB-H1 and ZB-V keep 1F1B's peak (Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
    # sec 3 and 6: the deferred weight-gradient passes hold their inputs within that budget)
    zbv = L.get("zb", 0 * p) == 2
    gpipe = L.get("zb", 0 * p) == 3  # all m forwards before the first backward
    return np.where(p == 1, 1.0, np.where(gpipe, m, np.where((v > 1) & ~zbv, inter, one_f)))
