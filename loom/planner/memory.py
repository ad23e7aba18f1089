"""Memory per GPU of a layout, term by term (bytes).

Terms (all bytes, of the pipeline stage that needs the most):

* ``weights``, ``gradients``, ``optimizer``: model states (ZERO sec 3.1). Per parameter with
  mixed-precision Adam: 2 (bf16 weights) + ``grad_bytes`` (2 in the ZeRO paper, 4 for Megatron's
  fp32 ``main_grad``) + 12 (fp32 master weights, momentum, variance). ZeRO stage 1 (Megatron's
  distributed optimizer) divides the 12 by the data-parallel size (the ``dp x cp`` group), stage
  2 also the gradients, stage 3 also the weights: 16 -> 4 + 12/d, 2 + 14/d, 16/d (ZERO table 1),
  18 -> 6 + 12/d (Megatron distributed optimizer).
* ``activations``: per transformer layer and micro-batch, KOR table 2 (16-bit activations),
  generalized to grouped-query attention, SwiGLU and any FFN width (see
  :func:`activation_bytes_per_layer`), times the layers of the stage and the micro-batches in
  flight: 1F1B holds ``min(p, m)`` on the first stage, the interleaved schedule ``p`` times
  ``1 + (p-1)/(p v)`` (KOR sec 4.2.3), GPipe ``m``. Full and selective recompute add the working
  memory of one recomputed layer.
* ``embedding_output``: embedding dropout mask on the first stage (per in-flight micro-batch);
  final norm and output-layer input (2 s b h each) and what the loss keeps on the last stage:
  for ``Options.runtime = "loom"`` its fused cross-entropy's fp32 ``dL/dx``, ``dL/dw`` and
  log-sum-exp (``4 s b h + 4 V h / t + 4 s b``; the fp32 logits ``4 s b V / t``, KOR sec 4.3,
  when soft-capping unfuses it); each runtime's logits copies, extra saved tensors per layer and
  transients in :mod:`loom.planner.memory_runtime` (the stage with the output layer holds the
  larger of the loss's forward peak and the backward transient, in ``activations``).
* ``reserve``: ``reserve_bytes + reserve_fraction x`` the other terms (context, workspaces,
  fragmentation).
* mixture of experts (:mod:`loom.planner.moe`): expert weights, gradients and optimizer states
  are split over ``t x e`` GPUs and their ZeRO sharding runs over the expert-data-parallel group
  ``d c / e``; everything else as for a dense model. The MoE MLP's activations replace the dense
  MLP's (:func:`loom.planner.moe.moe_activation_bytes`).
  Dense and MoE layers are counted per stage (:func:`loom.planner.moe.stage_moe_layers`).
* Mamba-2 / hybrid stacks (:mod:`loom.planner.mamba`): parameters and activations per layer
  kind (Mamba, attention, MLP), each stage summing the kinds of its slice of the pattern
  (:func:`loom.planner.mamba.stage_kind_layers`).
"""

from __future__ import annotations

import numpy as np

from loom.config import ModelConfig
from loom.planner.context_parallel import cp_memory
from loom.planner.layout import Options, num_microbatches, stage_layers
from loom.planner.mamba import (KINDS, is_hybrid, kind_activation_bytes, kind_counts, kind_params,
                                stage_kind_layers)
from loom.planner.memory_runtime import (backward_working_bytes, layer_extra_bytes, logits_bytes,
                                        loss_transient_bytes)
from loom.planner.mla import (attention_params, mla_activation_bytes, mtp_params,
                              mtp_stage_params)
from loom.planner.moe import (MOE_LOAD_IMBALANCE, layer_param_totals, moe_activation_bytes,
                              moe_fraction, moe_layer_params, stage_moe_layers)


def padded_vocab(model: ModelConfig, tp):
    """V padded to a multiple of ``make_vocab_size_divisible_by x t`` (Megatron)."""
    mult = model.make_vocab_size_divisible_by * np.asarray(tp, dtype=np.float64)
    if model.padded_vocab_size is not None:  # --padded-vocab-size: the rows exactly
        return np.asarray(tp, dtype=np.float64) * 0 + model.padded_vocab_size
    return np.ceil((model.vocab_size or 0) / mult) * mult


def layer_params(model: ModelConfig) -> tuple[int, int]:
    """Parameters of one transformer layer: ``(tp_sharded, replicated)``.

    Sharded: QKV ``h (a d + 2 g d)``, output projection ``a d h``, MLP ``2 h f`` (``3 h f``
    with SwiGLU) and the column-parallel biases. Replicated across TP ranks: the two norms
    (``2h`` RMSNorm, ``4h`` LayerNorm) and the row-parallel biases. For a GPT with biases this
    totals ``12 h^2 + 13 h`` (NAR eq 2).
    """
    h, f = model.hidden_size, model.ffn_size
    mlp_in = 2 * f if model.gated_linear_unit else f
    att_sh, att_rep = attention_params(model)  # MLA: loom.planner.mla
    sharded = att_sh + h * mlp_in + f * h
    replicated = (4 if model.normalization == "LayerNorm" else 2) * h + att_rep
    if not model.disable_bias_linear:
        sharded += mlp_in
        replicated += 2 * h
    return sharded, replicated


def total_params(model: ModelConfig, seq_length: int | None = None,
                 active: bool = False) -> float:
    """All parameters (count) with the unpadded vocabulary: layers, embeddings (+ learned
    positions), final norm, untied output layer. Equals NAR eq 2 for a GPT. MoE: every expert
    counted, or with ``active`` only the k routed per token (the shared expert and the router
    always; :func:`loom.planner.moe.layer_param_totals`)."""
    s = seq_length or model.seq_length
    sh, rep = layer_params(model)
    h, V = model.hidden_size, model.vocab_size or 0
    if is_hybrid(model):
        kp = kind_params(model)
        n = sum(cnt * sum(kp[k]) for k, cnt in kind_counts(model).items()) + V * h
    elif model.num_experts:
        n = layer_param_totals(model, (sh, rep))[1 if active else 0] + V * h
    else:
        n = model.num_layers * (sh + rep) + V * h
    n += (2 if model.normalization == "LayerNorm" else 1) * h
    n += mtp_params(model, (sh, rep), active)  # --mtp-num-layers (loom.planner.mla)
    if model.position_embedding_type == "learned_absolute":
        n += max(s, model.max_positions) * h
    if model.untie_embeddings_and_output_weights:
        n += V * h
    return float(n)


def stage_params(model: ModelConfig, L: dict, seq_length: int) -> dict:
    """Parameters per GPU (count) of the first, a middle (``p > 2``, else 0) and the last
    pipeline stage, with the layers of :func:`loom.planner.layout.stage_layers`; of which
    expert parameters (``expert_first``, ``expert_middle``, ``expert_last``; 0 for dense models,
    experts split over ``t x e`` GPUs; MoE layers per stage from
    :func:`loom.planner.moe.stage_moe_layers`)."""
    t, p = L["tp"], L["pp"]
    sh, rep = layer_params(model)
    h = model.hidden_size
    per_layer = sh / t + rep
    lf, lm, ll = stage_layers(model.num_layers, L)
    w_first, w_mid, w_last = lf * per_layer, lm * per_layer, ll * per_layer
    x_first = x_mid = x_last = 0.0
    if is_hybrid(model):
        kp, cnt = kind_params(model), stage_kind_layers(model, L, lf, lm, ll)
        w_first, w_mid, w_last = (sum(cnt[k][i] * (kp[k][0] / t + kp[k][1]) for k in KINDS)
                                  for i in range(3))
    if model.num_experts:
        sh_m, rep_m, ex = moe_layer_params(model, (sh, rep))
        expert_layer = ex / (t * L.get("ep", 1.0))
        moe_layer = sh_m / t + rep_m + expert_layer
        nf, nm, nl = stage_moe_layers(model, L, lf, lm, ll)
        w_first = (lf - nf) * per_layer + nf * moe_layer
        w_mid = (lm - nm) * per_layer + nm * moe_layer
        w_last = (ll - nl) * per_layer + nl * moe_layer
        x_first, x_mid, x_last = nf * expert_layer, nm * expert_layer, nl * expert_layer
    Vp = padded_vocab(model, t)
    emb = Vp * h / t
    if model.position_embedding_type == "learned_absolute":
        emb = emb + max(seq_length, model.max_positions) * h
    final_norm = (2 if model.normalization == "LayerNorm" else 1) * h
    untied = model.untie_embeddings_and_output_weights
    out = Vp * h / t * (1.0 if untied else (p > 1))  # tied: a copy on the last stage when p > 1
    single = p == 1
    # MTP modules on the last stage (+ their embedding copy when untied and p > 1)
    w_mtp, x_mtp = mtp_stage_params(model, (sh, rep), t, L.get("ep", 1.0))
    mtp_emb = Vp * h / t * (bool(model.mtp_num_layers) and untied) * (p > 1)
    first = w_first + emb + np.where(single, final_norm + out + w_mtp, 0.0)
    last = np.where(single, first, w_last + final_norm + out + w_mtp + mtp_emb)
    middle = np.where(p > 2, w_mid, 0.0)
    x_first = x_first + np.where(single, x_mtp, 0.0)
    return {"first": first, "middle": middle, "last": last,
            "expert_first": x_first + 0 * first, "expert_last": x_last + x_mtp + 0 * last,
            "expert_middle": np.where(p > 2, x_mid, 0.0)}


def model_state_bytes_per_param(zero, dp, grad_bytes: int = 2, bf16: bool = True) -> tuple:
    """Bytes per parameter ``(weights, gradients, optimizer)`` at ZeRO stage ``zero`` and
    data-parallel size ``dp`` (ZERO sec 3.1/5: 2 + 2 + 12 = 16 with fp16 gradients). ZeRO-3
    (``loom train --zero-stage 3``, FSDP2) with fp32 gradients: 18/d. ``bf16=False``: fp32
    training, the weights are the master copy: 4 + 4 + 8 (Adam's moments) = 16, 16/d at
    ZeRO-3 (what ``tests/parallel/test_fsdp.py`` measures on the trainer)."""
    zero = np.asarray(zero, dtype=np.float64)
    dp = np.asarray(dp, dtype=np.float64)
    weight_bytes, grad_bytes, optim_bytes = (2.0, grad_bytes, 12.0) if bf16 else (4.0, 4.0, 8.0)
    w = weight_bytes / np.where(zero >= 3, dp, 1.0)
    g = grad_bytes / np.where(zero >= 2, dp, 1.0)
    o = optim_bytes / np.where(zero >= 1, dp, 1.0)
    return w, g, o


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
    :func:`loom.planner.moe.moe_activation_bytes` (``moe_load_imbalance``).
    """
    s = seq_length
    h, a, g, d, f = (model.hidden_size, model.num_attention_heads, model.num_kv_groups,
                     model.head_dim, model.ffn_size)
    t, c, b, sp = L["tp"], L["cp"], L["mbs"], L["sp"]
    S = s * b / c
    drop = 1.0 if model.hidden_dropout > 0 else 0.0
    repl = S * h * (4 + 2 + 2 + 2 * drop)
    split = S * (2 * a * d + 4 * g * d + 2 * a * d) + S * f * (6 if model.gated_linear_unit else 4)
    if model.multi_latent_attention:  # loom.planner.mla: Q, K, V, latents
        mla_split, mla_repl = mla_activation_bytes(model, S)
        split = split - S * (2 * a * d + 4 * g * d + 2 * a * d) + mla_split
        repl = repl + mla_repl
    if model.num_experts:
        fm = moe_fraction(model) if moe_share is None else moe_share
        moe_split, moe_repl = moe_activation_bytes(model, S, moe_load_imbalance)
        split = split + fm * (moe_split - S * f * (6 if model.gated_linear_unit else 4))
        repl = repl + fm * moe_repl
    if flash_attention:
        scores = 4.0 * a * S / t
    else:
        per_score = 2 + (3 if model.attention_dropout > 0 else 0)
        scores = per_score * a * (s / c) * s * b / t
    repl_t = np.where(sp > 0, repl / t, repl)
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


def memory_terms(model: ModelConfig, L: dict, global_batch_size: int, seq_length: int,
                 opts: Options | None = None) -> dict:
    """Memory per GPU, bytes, term by term, of the stage that needs the most: the first, the
    second (the middle stage holding the most micro-batches, ``min(p-1, m)`` with 1F1B; only
    with ``p > 2``) or the last (:func:`stage_memory_terms`).

    Returns arrays ``weights, gradients, optimizer, activations, embedding_output, reserve,
    total`` and ``params_per_gpu`` (count), ``stage`` (0 first, 1 last, 2 middle).
    """
    out = stage_memory_terms(model, L, global_batch_size, seq_length, opts)
    p = L["pp"]
    has_mid = p > 2
    mid_total = np.where(has_mid, out["middle"]["total"], -np.inf)
    first_worse = (out["first"]["total"] >= out["last"]["total"]) & \
        (out["first"]["total"] >= mid_total)
    mid_worse = ~first_worse & (mid_total > out["last"]["total"])
    res = {k: np.where(first_worse, out["first"][k],
                       np.where(mid_worse, out["middle"][k], out["last"][k])) for k in out["first"]}
    res["stage"] = np.where(first_worse, 0, np.where(mid_worse, 2, 1))
    res["params_first_stage"] = out["first"]["params_per_gpu"]
    return res


def stage_memory_terms(model: ModelConfig, L: dict, global_batch_size: int, seq_length: int,
                       opts: Options | None = None) -> dict:
    """:func:`memory_terms` of every pipeline stage: ``{"first" | "middle" | "last": terms}``
    (arrays, bytes; ``params_per_gpu`` a count). With ``p = 1`` all three describe the one
    stage, "first" and "last" both holding the embedding and the output layer; with ``p = 2``
    "middle" is not a real stage (:func:`memory_terms` ignores it)."""
    opts = opts or Options()
    s = seq_length
    h = model.hidden_size
    t, p, c, b, sp = L["tp"], L["pp"], L["cp"], L["mbs"], L["sp"]
    m = num_microbatches(L, global_batch_size)
    P = stage_params(model, L, s)
    wb, gb, ob = model_state_bytes_per_param(L["zero"], L["dp"] * c, opts.grad_bytes)
    # expert parameters: ZeRO over the expert-data-parallel group d c / e
    xw, xg, xo = model_state_bytes_per_param(L["zero"], L["dp"] * c / L.get("ep", 1.0),
                                             opts.grad_bytes)
    act = distribute_saved(activation_bytes_per_layer(
        model, s, L, flash_attention=opts.flash_attention,
        moe_load_imbalance=opts.moe_load_imbalance), L, opts)
    rc = L["recompute"]
    per_layer = np.where(rc == 2, act["full"], np.where(rc == 1, act["selective"], act["none"]))
    working = np.where(rc == 2, act["none"], np.where(rc == 1, act["scores"], 0.0))
    # CP: the K/V blocks of one layer in flight (ring) or gathered (allgather), per comm type
    kv_w = (model.num_attention_heads * (model.q_head_dim + model.v_head_dim)
            if getattr(model, "multi_latent_attention", False)
            else 2 * model.num_kv_groups * model.head_dim)
    cp_extra = cp_memory(opts.cp_comm_type, s * b / c, t, c,
                         model.num_attention_heads * model.head_dim, kv_w)
    # the runtime's tensors beyond KOR (loom.planner.memory_runtime; 0 for "loom")
    extra = layer_extra_bytes(model, s * b / c, t, opts.runtime, opts.flash_attention)
    per_layer = per_layer + np.where(rc == 2, 0.0, extra)
    working = working + np.where(rc == 2, extra, 0.0)
    lf, lm, ll = stage_layers(model.num_layers, L)
    n_moe = {"first": 0.0, "middle": 0.0, "last": 0.0}
    per_moe = per_layer
    if model.num_experts:  # dense and MoE layers separately, per stage
        act_d, act_m = (distribute_saved(activation_bytes_per_layer(
            model, s, L, flash_attention=opts.flash_attention,
            moe_load_imbalance=opts.moe_load_imbalance, moe_share=share), L, opts)
            for share in (0.0, 1.0))
        per_layer, per_moe = (np.where(rc == 2, a["full"], np.where(rc == 1, a["selective"],
                                                                    a["none"]))
                              for a in (act_d, act_m))
        working = np.where(rc == 2, act_m["none"], np.where(rc == 1, act_m["scores"], 0.0))
        n_moe = dict(zip(("first", "middle", "last"), stage_moe_layers(model, L, lf, lm, ll)))
    hybrid = is_hybrid(model)
    if hybrid:  # per layer kind (mamba.py), summed over each stage's slice of the pattern
        acts_k = {k: distribute_saved(kind_activation_bytes(model, s, L, k, opts.flash_attention),
                                      L, opts) for k in KINDS}
        per_kind = {k: np.where(rc == 2, a["full"], np.where(rc == 1, a["selective"], a["none"]))
                    for k, a in acts_k.items()}
        n_kind = kind_counts(model)
        working = np.max([np.where(rc == 2, a["none"], np.where(rc == 1, a["scores"], 0.0))
                          for k, a in acts_k.items() if n_kind[k]], axis=0)
        cnt = stage_kind_layers(model, L, lf, lm, ll)
    inflight = inflight_microbatches(L, m)
    zb = L.get("zb", 0 * p)
    inflight_mid = np.where(((L["vp"] > 1) & (zb != 2)) | (zb == 3), inflight,
                            np.minimum(p - 1, m))
    S = s * b / c
    drop = 1.0 if model.hidden_dropout > 0 else 0.0
    sp_div = np.where(sp > 0, t, 1.0)
    Vp = padded_vocab(model, t)
    emb_act_first = drop * S * h / sp_div * inflight
    logits = logits_bytes(model, S, Vp, t, opts.runtime)
    out_act = 2 * S * h / sp_div * 2 + logits
    bwd = backward_working_bytes(model, S, t, sp, opts.runtime)
    # the output stage holds the larger of the loss's forward peak (what it keeps + what its
    # forward frees before returning) and the backward transient
    loss_peak = logits + loss_transient_bytes(model, S, Vp, t, opts.runtime)
    bwd_out = np.maximum(bwd, loss_peak) - logits
    # the last stage holds one micro-batch with 1F1B; with GPipe all m forwards (and their
    # loss's saved tensors) precede the first backward (GPipe, Huang et al. 2019 sec 2.2)
    inflight_last = np.where((zb == 3) & (p > 1), m, 1.0)
    out = {}
    for name, n_layers, stage_inflight, params, emb_act in (
            ("first", lf, inflight, P["first"], emb_act_first + np.where(p == 1, out_act, 0.0)),
            ("last", ll, inflight_last, P["last"],
             np.where(p == 1, emb_act_first + out_act, inflight_last * out_act)),
            ("middle", lm, inflight_mid, P["middle"], 0.0)):
        terms = {
            "weights": params * wb,
            "gradients": params * gb,
            "optimizer": params * ob,
        }
        if model.num_experts:
            ex = P[f"expert_{name}"]
            terms = {"weights": (params - ex) * wb + ex * xw,
                     "gradients": (params - ex) * gb + ex * xg,
                     "optimizer": (params - ex) * ob + ex * xo}
        holds_output = (name == "last") | ((name == "first") & (p == 1))
        acts = n_layers * stage_inflight * per_layer + working + cp_extra
        if hybrid:
            i = ("first", "middle", "last").index(name)
            acts = stage_inflight * sum(cnt[k][i] * per_kind[k] for k in KINDS) + working
        if model.num_experts:
            acts = stage_inflight * ((n_layers - n_moe[name]) * per_layer
                                     + n_moe[name] * per_moe) + working
        if model.mtp_num_layers and name != "middle":  # MTP on the last stage
            here = 1.0 if name == "last" else np.where(p == 1, 1.0, 0.0)
            last_moe = model.num_experts and model.is_moe_layer(model.num_layers - 1)
            acts = acts + here * model.mtp_num_layers * stage_inflight * (
                per_moe if last_moe else per_layer)
            emb_act = emb_act + here * model.mtp_num_layers * out_act
        acts = acts + np.where(holds_output, bwd_out, bwd) * (n_layers > 0)
        terms.update({
            "activations": acts,
            "embedding_output": emb_act,
        })
        base = sum(terms.values())
        terms["reserve"] = opts.reserve_bytes + opts.reserve_fraction * base
        terms["total"] = base + terms["reserve"]
        terms["params_per_gpu"] = params
        out[name] = terms
    return out
