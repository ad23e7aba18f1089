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
  :func:`activation_bytes_per_layer`), times the layer-micro-batches each pipeline rank holds
  at its peak: every rank's own layers (any split, :mod:`loom.planner.stage_table`) and its
  schedule's held micro-batches per chunk (1F1B ``min(p - r, m)`` on rank r, interleaved per
  Megatron's order, ZB-H1 ``min(p, m)``, ZB-V and GPipe; checked against loom's op lists). The
  memory of a layout is its neediest rank's. Full and selective recompute add the working
  memory of one recomputed layer.
* ``embedding_output``: embedding dropout mask on the first stage (per in-flight micro-batch);
  final norm and output-layer input (2 s b h each) and what the loss keeps on the last stage:
  for ``Options.runtime = "loom"`` its fused cross-entropy's fp32 ``dL/dx``, ``dL/dw`` and
  log-sum-exp (``4 s b h + 4 V h / t + 4 s b``; the fp32 logits ``4 s b V / t``, KOR sec 4.3,
  when soft-capping unfuses it); each runtime's logits copies, extra saved tensors per layer and
  transients in :mod:`loom.planner.memory_runtime` (the stage with the output layer holds the
  larger of the loss's forward peak and the backward phase, the backward transient plus one
  recomputed layer's working memory, in ``activations``: the two phases never meet).
* ``reserve``: ``reserve_bytes + reserve_fraction x`` the other terms (context, workspaces,
  fragmentation).
* mixture of experts (:mod:`loom.planner.moe`): expert weights, gradients and optimizer states
  are split over ``u x e`` GPUs (u the expert TP size, t by default) and their ZeRO sharding
  runs over the expert-data-parallel group ``t c d / (u e)`` (:func:`loom.planner.moe.expert_dp`;
  ``d c / e`` at u = t); everything else as for a dense model. The MoE MLP's activations replace the dense
  MLP's (:func:`loom.planner.moe.moe_activation_bytes`, Megatron-Core's layer; with
  ``layer_memory = "loom"`` loom's own, measured: :func:`loom.planner.memory_runtime.loom_moe_extra`).
  Dense and MoE layers are counted per stage (:func:`loom.planner.moe.stage_moe_layers`).
* Mamba-2 / hybrid stacks (:mod:`loom.planner.mamba`): parameters and activations per layer
  kind (Mamba, attention, MLP), each stage summing the kinds of its slice of the pattern
  (:func:`loom.planner.mamba.stage_kind_layers`).
"""

from __future__ import annotations

import numpy as np

from loom.config import ModelConfig
from loom.planner.context_parallel import cp_memory, row_comm_types
from loom.planner.layout import ADAM_STATE_BYTES, Options, num_microbatches
from loom.planner.mamba import KINDS, is_hybrid, kind_activation_bytes, kind_counts, kind_params
from loom.planner.activations import (activation_bytes_per_layer,  # noqa: F401 - re-exported
                                      distribute_saved, inflight_microbatches)
from loom.planner.memory_runtime import (backward_working_bytes, layer_extra_bytes, logits_bytes,
                                        loom_kind_extra, loom_layer_extra,
                                        loom_moe_extra, loss_transient_bytes)
from loom.planner.mla import attention_params, mtp_params, mtp_stage_params
from loom.planner.moe import (expert_dp, expert_params_per_gpu, expert_shards,
                              layer_param_totals, moe_layer_params)
from loom.planner.layer_shape import gated_mlp, layer_norm_params


def padded_vocab(model: ModelConfig, tp):
    """V padded to a multiple of ``make_vocab_size_divisible_by x t`` (Megatron)."""
    mult = model.make_vocab_size_divisible_by * np.asarray(tp, dtype=np.float64)
    if model.padded_vocab_size is not None:  # --padded-vocab-size: the rows exactly
        return np.asarray(tp, dtype=np.float64) * 0 + model.padded_vocab_size
    if model.no_pad_vocab_size:  # --no-pad-vocab-size: V itself
        return np.asarray(tp, dtype=np.float64) * 0 + (model.vocab_size or 0)
    return np.ceil((model.vocab_size or 0) / mult) * mult


def layer_params(model: ModelConfig) -> tuple[int, int]:
    """Parameters of one transformer layer: ``(tp_sharded, replicated)``.

    Sharded: QKV ``h (a d + 2 g d)``, output projection ``a d h``, MLP ``2 h f`` (``3 h f``
    with SwiGLU or GeGLU) and the column-parallel biases. Replicated across TP ranks: the two
    norms (``2h`` RMSNorm, ``4h`` LayerNorm; Gemma 2 / 3's sandwich four; Q/K norms: the
    family's ``layer_shape``) and the row-parallel biases. For a GPT with biases this
    totals ``12 h^2 + 13 h`` (NAR eq 2).
    """
    h, f = model.hidden_size, model.ffn_size
    mlp_in = 2 * f if gated_mlp(model) else f
    att_sh, att_rep = attention_params(model)  # MLA: loom.planner.mla
    sharded = att_sh + h * mlp_in + f * h
    replicated = layer_norm_params(model) + att_rep  # the family's norms (Gemma's sandwich)
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


def kind_layer_params(model: ModelConfig, L: dict) -> list[tuple]:
    """``(per_gpu, expert_per_gpu)`` parameters (count, arrays) of one layer of each kind of
    :func:`loom.planner.stage_table.layer_kinds`: sharded over ``t`` plus replicated; MoE
    experts over ``u x e`` (:func:`loom.planner.moe.moe_layer_params`,
    :func:`~loom.planner.moe.expert_params_per_gpu`); hybrid kinds
    (:func:`loom.planner.mamba.kind_params`)."""
    t = L["tp"]
    sh, rep = layer_params(model)
    zero = 0.0 * t
    if is_hybrid(model):
        kp = kind_params(model)
        return [(kp[k][0] / t + kp[k][1], zero) for k in KINDS]
    dense = (sh / t + rep, zero)
    if not model.num_experts:
        return [dense]
    sh_m, rep_m, _ = moe_layer_params(model, (sh, rep))
    expert = expert_params_per_gpu(model, L)
    return [dense, (sh_m / t + rep_m + expert, expert)]


def slot_params(model: ModelConfig, L: dict, seq_length: int, slots: dict) -> tuple:
    """Parameters per GPU (count, arrays ``(R, N)``) of every stage slot
    (:func:`loom.planner.stage_table.stage_slots`) and the expert part of them: its layers of
    each kind; the word embedding (``V_p h / t``, + learned positions) on the rank holding
    ``E``; the final norm and the output layer on the rank holding ``L`` (untied, or tied on
    another rank than ``E``'s: its copy); the MTP modules where ``m`` is (+ an embedding copy
    when untied and not on ``E``'s rank)."""
    t = L["tp"]
    h = model.hidden_size
    params = 0.0 * slots["emb"]
    expert = 0.0 * slots["emb"]
    for k, (per, x) in enumerate(kind_layer_params(model, L)):
        params = params + slots["layers"][k] * per
        expert = expert + slots["layers"][k] * x
    Vp = padded_vocab(model, t)
    emb = Vp * h / t
    if model.position_embedding_type == "learned_absolute":
        emb = emb + max(seq_length, model.max_positions) * h
    final_norm = (2 if model.normalization == "LayerNorm" else 1) * h
    untied = model.untie_embeddings_and_output_weights
    out_w = Vp * h / t * np.where(untied, 1.0, 1.0 - slots["emb"])
    params = params + slots["emb"] * emb + slots["out"] * (final_norm + out_w)
    if model.mtp_num_layers:
        # mtp_stage_params divides the experts by t x ep: ep' = u e / t gives u e
        w_mtp, x_mtp = mtp_stage_params(model, layer_params(model), t, expert_shards(L) / t)
        share = slots["mtp"] / model.mtp_num_layers
        mtp_emb = Vp * h / t * untied * (1.0 - slots["emb"])
        params = params + share * w_mtp + (slots["mtp"] > 0) * mtp_emb
        expert = expert + share * x_mtp
    return params, expert


def _stage_class(slots: dict, name: str) -> np.ndarray:
    """Mask ``(R, N)`` of the slots of rank class ``name``: the first rank, the last, or a
    middle one (``p > 2``)."""
    r, p = slots["rank"], slots["pp"]
    return {"first": r == 0, "last": r == p - 1, "middle": (r > 0) & (r < p - 1)}[name]


def _class_pick(value: np.ndarray, key: np.ndarray, mask: np.ndarray,
                fallback: np.ndarray | None = None) -> np.ndarray:
    """``value`` at the slot of largest ``key`` among ``mask`` (per row; ``fallback`` or 0
    where no slot is in the class)."""
    k = np.where(mask, key, -np.inf)
    i = np.argmax(k, axis=0)
    got = np.take_along_axis(value, i[None, :], axis=0)[0]
    has = mask.any(axis=0)
    return np.where(has, got, 0.0 if fallback is None else fallback)


def stage_params(model: ModelConfig, L: dict, seq_length: int, m=None) -> dict:
    """Parameters per GPU (count) of the first, the largest middle (``p > 2``, else 0) and the
    last pipeline stage (:func:`slot_params` of the layout's stages,
    :mod:`loom.planner.stage_table`), and their expert parameters (``expert_first``,
    ``expert_middle``, ``expert_last``; 0 for dense models, experts split over ``t x e``
    GPUs); ``stage_max`` / ``expert_max``: the stage with the most parameters (the DP
    reduction's). ``m`` (micro-batches) only selects slots; parameters do not depend on it."""
    from loom.planner.stage_table import stage_slots
    slots = stage_slots(model, L, 1.0 if m is None else m)
    P, X = slot_params(model, L, seq_length, slots)
    out = {}
    for name in ("first", "middle", "last"):
        mask = _stage_class(slots, name)
        out[name] = _class_pick(P, P, mask)
        out[f"expert_{name}"] = _class_pick(X, P, mask)
    i = np.argmax(P, axis=0)[None, :]
    out["stage_max"] = np.take_along_axis(P, i, axis=0)[0]
    out["expert_max"] = np.take_along_axis(X, i, axis=0)[0]
    return out


def optimizer_state_bytes(optimizer: str = "adam", sgd_momentum: float = 0.9) -> float | None:
    """Bytes per parameter an optimizer keeps beside the fp32 master copy: ``--optimizer adam``
    8 (fp32 ``exp_avg``, ``exp_avg_sq``; ZERO sec 3.1), ``sgd`` 4 (fp32 ``momentum_buffer``)
    with ``--sgd-momentum`` > 0, else 0 (``torch.optim.SGD`` keeps no state). None for Muon,
    whose states depend on the weight (a momentum for the 2-D weights it manages, Adam's two
    for the rest: ``Options.muon_ns_steps`` and :mod:`loom.planner.muon`)."""
    if optimizer == "adam":
        return ADAM_STATE_BYTES
    if optimizer == "sgd":
        return 4.0 if sgd_momentum else 0.0
    return None


STORED_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
"""Bytes per element of the precision-aware optimizer's storage dtypes (Megatron's names)."""


def precision_aware_bytes(exp_avg: str = "fp32", exp_avg_sq: str = "fp32",
                          main_params: str = "fp32", bf16: bool = True) -> dict:
    """``{"optimizer_state_bytes", "master_bytes"}`` per parameter under Megatron's
    ``--use-precision-aware-optimizer`` (Transformer Engine's FusedAdam storage,
    :mod:`loom.training.state_precision`): Adam's moments at their dtypes' sizes
    (:data:`STORED_BYTES`; the per-tensor fp32 scales of fp16/fp8 are negligible), the master
    copy 2 bytes as fp16 (``--main-params-dtype fp16``) or, under bf16, as the 16-bit remainder
    of the fp32 master (TE's ``store_param_remainders``, Megatron's default), else 4. E.g.
    bf16 with bf16 moments: 2 + 2 + 2 = 6 bytes beside the weights, against 12."""
    master = 2.0 if main_params != "fp32" or bf16 else 4.0
    return {"optimizer_state_bytes": STORED_BYTES[exp_avg] + STORED_BYTES[exp_avg_sq],
            "master_bytes": master}


def model_state_bytes_per_param(zero, dp, grad_bytes: int = 2, bf16: bool = True,
                                state_bytes: float = ADAM_STATE_BYTES,
                                master_bytes: float = 4.0) -> tuple:
    """Bytes per parameter ``(weights, gradients, optimizer)`` at ZeRO stage ``zero`` and
    data-parallel size ``dp`` (ZERO sec 3.1/5: 2 + 2 + 12 = 16 with fp16 gradients). ZeRO-3
    (``loom train --zero-stage 3``, FSDP2) with fp32 gradients: 18/d. ``bf16=False``: fp32
    training, the weights are the master copy: 4 + 4 + 8 (Adam's moments) = 16, 16/d at
    ZeRO-3 (what ``tests/parallel/test_fsdp.py`` measures on the trainer). ``state_bytes``:
    the optimizer's own states per parameter (:func:`optimizer_state_bytes`; Adam's 8);
    ``master_bytes``: the 16-bit run's master copy (4: fp32; 2 under
    :func:`precision_aware_bytes`)."""
    zero = np.asarray(zero, dtype=np.float64)
    dp = np.asarray(dp, dtype=np.float64)
    weight_bytes, grad_bytes, optim_bytes = ((2.0, grad_bytes, master_bytes + state_bytes) if bf16
                                             else (4.0, 4.0, state_bytes))
    w = weight_bytes / np.where(zero >= 3, dp, 1.0)
    g = grad_bytes / np.where(zero >= 2, dp, 1.0)
    o = optim_bytes / np.where(zero >= 1, dp, 1.0)
    return w, g, o


def memory_terms(model: ModelConfig, L: dict, global_batch_size: int, seq_length: int,
                 opts: Options | None = None, slots: dict | None = None) -> dict:
    """Memory per GPU, bytes, term by term, of the pipeline stage that needs the most (every
    rank's slots, :func:`slot_memory_terms`).

    Returns arrays ``weights, gradients, optimizer, activations, embedding_output, reserve,
    total`` and ``params_per_gpu`` (count), ``stage`` (0 first, 1 last, 2 middle), ``rank``
    (the pipeline rank), ``params_first_stage`` (count).
    """
    terms, slots = slot_memory_terms(model, L, global_batch_size, seq_length, opts, slots)
    i = np.argmax(terms["total"], axis=0)[None, :]
    res = {k: np.take_along_axis(v, i, axis=0)[0] for k, v in terms.items()}
    rank = np.take_along_axis(slots["rank"], i, axis=0)[0]
    p = slots["pp"]
    res["rank"] = rank
    res["stage"] = np.where(rank == 0, 0, np.where(rank == p - 1, 1, 2))
    res["params_first_stage"] = _class_pick(terms["params_per_gpu"], terms["params_per_gpu"],
                                            _stage_class(slots, "first"))
    return res


def stage_memory_terms(model: ModelConfig, L: dict, global_batch_size: int, seq_length: int,
                       opts: Options | None = None) -> dict:
    """:func:`memory_terms` of the first, the neediest middle and the last pipeline stage:
    ``{"first" | "middle" | "last": terms}`` (arrays, bytes; ``params_per_gpu`` a count). With
    ``p = 1`` all three describe the one stage; with ``p <= 2`` "middle" repeats "first"."""
    terms, slots = slot_memory_terms(model, L, global_batch_size, seq_length, opts)
    out = {}
    for name in ("first", "last", "middle"):
        mask = _stage_class(slots, name)
        out[name] = {k: _class_pick(v, terms["total"], mask,
                                    None if name != "middle" else out["first"][k])
                     for k, v in terms.items()}
    return out


def layer_activation_kinds(model: ModelConfig, seq_length: int, L: dict,
                           opts: Options) -> tuple:
    """Per layer kind (:func:`loom.planner.stage_table.layer_kinds`): the bytes one layer keeps
    per micro-batch when it is not fully recomputed (``base``: all of them, or selective's
    without the attention scores) and when it is (``full``: its input), and the working
    memory of one recomputed layer (``(base list, full list, working)``): full recompute's
    whole layer, selective's attention scores; the runtime's extra tensors
    (:mod:`loom.planner.memory_runtime`) for dense models."""
    s, rc = seq_length, L["recompute"]

    def base(a):
        return np.where(rc == 1, a["selective"], a["none"])

    def work(a):
        return np.where(rc == 2, a["none"], np.where(rc == 1, a["scores"], 0.0))
    if is_hybrid(model):
        kx = loom_kind_extra(model, s, L, opts)
        acts = [distribute_saved(kind_activation_bytes(model, s, L, k, opts.flash_attention),
                                 L, opts) for k in KINDS]
        extra = [np.where(rc == 1, kx[k]["selective"], kx[k]["none"]) for k in KINDS]
        n_kind = kind_counts(model)
        working = np.max([work(a) + np.where(rc == 2, kx[k]["none"], 0.0)
                          for k, a in zip(KINDS, acts) if n_kind[k]], axis=0)
        return [base(a) + x for a, x in zip(acts, extra)], [a["full"] for a in acts], working
    lx = loom_layer_extra(model, s, L, opts, mlp=not model.num_experts)
    if model.num_experts:  # loom's extra: the attention side, in dense and MoE layers alike
        acts = [distribute_saved(activation_bytes_per_layer(
            model, s, L, flash_attention=opts.flash_attention,
            moe_load_imbalance=opts.moe_load_imbalance, moe_share=share), L, opts)
            for share in (0.0, 1.0)]
        extra = np.where(rc == 1, lx["selective"], lx["none"])
        extras = [extra, extra]
        mx = loom_moe_extra(model, s, L, opts)  # loom's own dense and MoE layers (GQA)
        if mx is not None:
            extras = [np.where(rc == 1, mx[k]["selective"], mx[k]["none"])
                      for k in ("dense", "moe")]
        return ([base(a) + x for a, x in zip(acts, extras)], [a["full"] for a in acts],
                work(acts[1]) + np.where(rc == 2, extras[1], 0.0))
    act = distribute_saved(activation_bytes_per_layer(
        model, s, L, flash_attention=opts.flash_attention,
        moe_load_imbalance=opts.moe_load_imbalance), L, opts)
    extra = layer_extra_bytes(model, s * L["mbs"] / L["cp"], L["tp"], opts.runtime,
                              opts.flash_attention) + np.where(rc == 1, lx["selective"], lx["none"])
    return [base(act) + extra], [act["full"]], work(act) + np.where(rc == 2, extra, 0.0)


def slot_memory_terms(model: ModelConfig, L: dict, global_batch_size: int, seq_length: int,
                      opts: Options | None = None, slots: dict | None = None) -> tuple[dict, dict]:
    """Memory terms (bytes, arrays ``(R, N)``) of every stage slot of every row, and the slots
    (:func:`loom.planner.stage_table.stage_slots`, computed unless given). Per slot: model states of its parameters
    (:func:`slot_params`; experts' ZeRO over the expert-data-parallel group
    :func:`loom.planner.moe.expert_dp`); its
    held layer-micro-batches of each kind times that kind's bytes per layer
    (:func:`layer_activation_kinds`), one recomputed layer's working memory, the CP K/V
    transient and the runtime's backward transient; the embedding's dropout mask per held
    micro-batch of the chunk holding ``E``; the final norm / output-layer inputs and the loss's
    saved tensors per held micro-batch of the chunk holding ``L`` (the larger of the loss's
    forward peak and the backward transient once); MTP layers as layers of the last layer's
    kind plus their output layers."""
    from loom.planner.stage_table import stage_slots
    opts = opts or Options()
    s = seq_length
    h = model.hidden_size
    t, c, b, sp = L["tp"], L["cp"], L["mbs"], L["sp"]
    m = num_microbatches(L, global_batch_size)
    if slots is None:
        slots = stage_slots(model, L, m, opts.legacy_interleaved_warmup)
    P, X = slot_params(model, L, s, slots)
    k = opts.optimizer_state_bytes
    wb, gb, ob = model_state_bytes_per_param(L["zero"], L["dp"] * c, opts.grad_bytes,
                                             state_bytes=k, master_bytes=opts.master_bytes)
    xw, xg, xo = model_state_bytes_per_param(L["zero"], expert_dp(L), opts.grad_bytes,
                                             state_bytes=k, master_bytes=opts.master_bytes)
    base_k, full_k, working = layer_activation_kinds(model, s, L, opts)
    kv_w = (model.num_attention_heads * (model.q_head_dim + model.v_head_dim)
            if getattr(model, "multi_latent_attention", False)
            else 2 * model.num_kv_groups * model.head_dim)
    cp_extra = cp_memory(row_comm_types(L, opts.cp_comm_type), s * b / c, t, c,
                         model.num_attention_heads * model.head_dim, kv_w,
                         a2a_size=opts.cp_a2a_size)
    S = s * b / c
    drop = 1.0 if model.hidden_dropout > 0 else 0.0
    sp_div = np.where(sp > 0, t, 1.0)
    Vp = padded_vocab(model, t)
    logits = logits_bytes(model, S, Vp, t, opts.runtime)
    out_act = 2 * S * h / sp_div * 2 + logits
    bwd = backward_working_bytes(model, S, t, sp, opts.runtime)
    # the loss's forward peak: what it keeps + what its forward frees before returning
    loss_peak = logits + loss_transient_bytes(model, S, Vp, t, opts.runtime)
    n_layers = slots["layers"].sum(axis=0)
    # held layer-micro-batches of each kind: the recomputed ones keep their input, the others
    # all their activations (Megatron's block method recomputes the first N of every chunk)
    held = sum(slots["held_rc"][k] * full_k[k] + (slots["held"][k] - slots["held_rc"][k])
               * base_k[k] for k in range(len(base_k)))
    j = -1 if model.num_experts and model.is_moe_layer(model.num_layers - 1) else 0
    mtp_kind = np.where(slots["mtp_rc"] > 0, full_k[j], base_k[j])
    busy = (n_layers + slots["mtp"]) > 0
    # the loss's forward peak and a recomputed layer's working memory (backward) never meet:
    # the output stage holds the larger of the two phases, not their sum (the sum over-predicted
    # full recompute's peak by 12% on CPU, benchmarks/results/planner_vs_measured.json "DP4 b4
    # full-recompute", and by 6% on an H200 at Llama 3 8B's layer, gpu_check_h200_wide.json)
    out_phase = np.maximum(busy * working + bwd, loss_peak) - logits
    acts = (held + slots["mtp_held"] * mtp_kind + busy * cp_extra
            + np.where(slots["out"] > 0, out_phase, busy * (working + bwd)))
    emb_out = (slots["emb_held"] * drop * S * h / sp_div
               + (slots["out_held"] + slots["mtp_held"]) * out_act)
    terms = {"weights": (P - X) * wb + X * xw, "gradients": (P - X) * gb + X * xg,
             "optimizer": (P - X) * ob + X * xo, "activations": acts,
             "embedding_output": emb_out}
    if opts.muon_ns_steps:  # Muon's momentum instead of AdamW's moments on the layers' weights
        from loom.planner.muon import MUON_STATE_BYTES, kind_muon_params
        mw = [model_state_bytes_per_param(L["zero"], n, opts.grad_bytes,
                                          state_bytes=MUON_STATE_BYTES,
                                          master_bytes=opts.master_bytes)[2]
              for n in (L["dp"] * c, expert_dp(L))]
        for k, (dense, experts) in enumerate(kind_muon_params(model, L, opts.muon_split_qkv)):
            n = slots["layers"][k]
            terms["optimizer"] = (terms["optimizer"] - n * dense * (ob - mw[0])
                                  - n * experts * (xo - mw[1]))
    terms["optimizer"] = terms["optimizer"] * (1.0 - opts.optimizer_offload_fraction)
    base = sum(terms.values())
    terms["reserve"] = opts.reserve_bytes + opts.reserve_fraction * base
    terms["total"] = base + terms["reserve"]
    terms["params_per_gpu"] = P
    return terms, slots
