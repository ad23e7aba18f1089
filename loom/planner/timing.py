"""Time per training iteration of a layout, term by term (seconds).

Model (per GPU, per micro-batch, per transformer layer; ``S = s b / c`` tokens per GPU):

* GEMMs: forward FLOPs of :mod:`loom.planner.flops` (QKV, projection, MLP: ``2 x params x
  tokens``) divided by ``t``, at the achievable rate ``peak x`` :func:`gemm_efficiency`
  of the GEMM's per-GPU width ``h/t`` and its token count ``S``. Attention scores
  (``4 s a d`` FLOPs per token, also divided by t) at the efficiency of width ``d`` (head dim)
  and token count ``s / c`` (one K/V block of the CP ring).
* Element-wise work (norms, activation functions, dropout, softmax, residuals): memory-bound;
  HBM traffic = ``mem_traffic x`` the activation bytes of the layer (KOR table 2, so sequence
  parallelism shortens it exactly where KOR table 4 measures it), at ``hbm_bw``.
* Gradient accumulation outside the weight-gradient GEMM (``Options.grad_accum_bytes`` per
  parameter of the stage, per micro-batch, at ``hbm_bw``; 0 for Megatron-Core's fused one).
* Backward = 2 x forward GEMMs and element-wise work; full recompute adds one forward,
  selective adds the attention scores and their element-wise work (NAR eq 3, KOR eq 8), or
  with torchtitan's op policy (``Options.selective_ac_op``) every second GEMM of the block and
  all its element-wise work.
* TP: 2 all-reduces of ``[s/c, b, h]`` (``2 S h`` bytes) per layer forward, 2 in backward
  (SHO sec 3), all-gather + reduce-scatter of the same volume with SP (KOR sec 4.2.2); full
  recompute repeats the forward two. Backward ones overlap the weight-gradient GEMMs (Megatron's
  asynchronous TP all-reduce), forward ones are exposed. On NVLink inside a node.
* CP: per ``Options.cp_comm_type`` (:mod:`loom.planner.context_parallel`); ``p2p``: ring of
  ``c - 1`` K/V exchanges (``4 S g d / t`` bytes each) per layer forward, twice in backward,
  overlapped with the attention-score compute; only the excess is exposed.
* PP: schedule ``(m + (p-1)/v) x`` the slowest stage's micro-batch time; the bubble is the
  ``(p-1)/v`` part (NAR sec 2.2). Point-to-point: ``2 v`` sends of ``2 S h / t`` bytes
  (scatter/gather, NAR sec 4.1) per micro-batch, plus ``2 (p-1)`` for fill and drain. Tied
  embeddings: one all-reduce of the word embedding's gradients (``V h / t`` elements) between
  the first and the last stage per iteration, exposed.
* DP: gradient all-reduce (ZeRO-1/2: reduce-scatter of the gradients + all-gather of the bf16
  weights; ZeRO-2 reduce-scatters every micro-batch's gradients, ``m`` times per iteration) of
  the largest stage's gradients over the ``d x c`` group, hierarchical: ring inside the node
  over the ``k`` members there, ring across nodes on ``1/k`` of the bytes; the reduction
  overlapped with the backward under the bucket schedule (:func:`exposed_grad_sync`) with
  ``--overlap-grad-reduce`` (``Options.overlap_grad_reduce``), the all-gather with the next
  forward with ``--overlap-param-gather`` (``Options.overlap_param_gather``); each exposed in
  full without its flag (Megatron's and loom train's defaults). Across nodes these
  collectives (ZeRO-3's ring too) get ``Cluster.dp_net_efficiency x inter_bw``
  (:func:`dp_network`; 1.0 unless ``--calibrate-from`` fitted it). ZeRO-3 gathers weights
  (forward and backward) and
  reduce-scatters gradients every micro-batch as a flat ring (each GPU's bytes cross its own NIC, ``(n-1)/n M`` at
  ``ZERO3_LINK_EFFICIENCY x inter_bw``: DeepSpeed's per-partition collectives do not get the
  node-aggregated bandwidth of a hierarchical ring), of which ``ZERO3_OVERLAP x`` the
  micro-batch's compute time is hidden. NAR table 2 shows why: ZeRO-3's cluster throughput stops
  growing from 768 to 1536 GPUs (175B) and from 1120 to 2240 (530B), i.e. a communication time
  that does not shrink with d, ~65 s per 1.4 TB (fp16 weights twice, fp32 gradients once).
* Optimizer step: memory-bound, ~30 bytes of HBM traffic per (sharded) parameter.

All collectives use the alpha-beta ring formulas of references.md (:func:`all_reduce_time`, in
:mod:`loom.planner.primitives` with :func:`gemm_efficiency`).
The constants of the compute model, ``GEMM_EFFICIENCY`` (large-GEMM fraction of peak),
``GEMM_HALF_DIM`` (GEMM dimension at which the efficiency halves), ``MEM_TRAFFIC`` and the
Hopper efficiency, are fitted once by least squares (:func:`benchmarks.planner_sources.fit.fit_compute`) to
NAR table 1, KOR tables 3 and 4 and Megatron-Core's H100 weak scaling together, never per row;
a cluster file may override them. Their out-of-sample errors (leave one source out):
:func:`benchmarks.planner_sources.fit.leave_one_source_out`, docs/planner.md.
"""

from __future__ import annotations

import numpy as np

from loom.config import ModelConfig
from loom.planner.flops import op_sac_recompute_share
from loom.planner.dp_overlap import (bucket_elems, dp_network, exposed_grad_sync, fsdp_exposed,
                                     overlap_interference)
from loom.planner.hardware import Cluster
from loom.planner.layout import Options, num_microbatches, param_gather_overlapped
from loom.planner.memory import activation_bytes_per_layer, padded_vocab, slot_params
from loom.planner.mamba import KINDS, is_hybrid, kind_layer_times
from loom.planner.stage_table import stage_slots
from loom.planner.mla import attention_flops_per_token, mtp_depth
from loom.planner.context_parallel import cp_layer_cost_rows, row_comm_types
from loom.planner.moe import expert_dp, expert_shards, moe_fraction, moe_layer_times
from loom.planner.primitives import (A100_RIDGE, GEMM_EFFICIENCY, GEMM_HALF_DIM,  # noqa: F401
                                     all_gather_time, all_reduce_latency, all_reduce_time,
                                     attention_efficiency, gemm_efficiency,
                                     hierarchical_all_reduce_time,
                                     hierarchical_reduce_scatter_time, link, p2p_time,
                                     reduce_scatter_latency, reduce_scatter_time)
from loom.planner.layer_shape import gated_mlp

# Fitted jointly with GEMM_EFFICIENCY and GEMM_HALF_DIM on the same 37 rows (NAR table 1, KOR
# tables 3 and 4, Megatron-Core H100 weak scaling; see primitives.py, benchmarks.planner_sources.fit).
MEM_TRAFFIC = 2.49
# Fitted (minimax of the log error of the days for 300B tokens, benchmarks.planner_sources.fit.fit_zero3) to the
# six ZeRO-3 rows of NAR table 2: 174.6B on 384/768/1536 GPUs, 529.6B on 640/1120/2240 GPUs.
ZERO3_OVERLAP = 0.727
# Not fitted: an assumption (DeepSpeed's flat ring at the full per-GPU NIC bandwidth).
ZERO3_LINK_EFFICIENCY = 1.0


def straggler_factor(num_ranks, jitter: float):
    """Expected extra fraction of a synchronous step waiting for the slowest of ``N`` ranks
    whose speeds vary independently with relative standard deviation ``jitter``: the expected
    maximum of N normal variables, ``mu + sigma sqrt(2 ln N)`` (leading term of the Gumbel limit
    of normal order statistics, Cramer 1946 sec 28.6; an upper bound for every N, since
    ``E max <= sigma sqrt(2 ln N)`` for centred normals), as a fraction of ``mu``:
    ``jitter x sqrt(2 ln N)``. 0 for one rank or no jitter.

    Two uses in :func:`time_terms`: every GPU's own speed (``cluster.speed_sigma``, the hardware
    constant :data:`loom.planner.hardware.GPU_SPEED_SIGMA`, over the job's GPUs: TP, PP and DP
    synchronise every GPU with every other within a step, so the step runs at the slowest
    chip's pace: 3.3% at 256 GPUs, 4.3% at 12,288 with sigma = 1%; 0 by default, see
    hardware.py), and a node-level jitter the user states (``--straggler-jitter``, over the
    nodes; default 0)."""
    n = np.asarray(num_ranks, dtype=np.float64)
    return jitter * np.sqrt(2.0 * np.log(np.maximum(n, 1.0)))


def pipeline_bubble(L: dict, t_mb, w_mb, f_mb, m):
    """Idle time (s) of the pipeline schedule per iteration, from the slowest stage's time per
    micro-batch ``t_mb = F + B + W``, its forward ``f_mb`` (F) and weight-gradient part
    ``w_mb`` (W), and ``m`` micro-batches: the formulas of
    :mod:`loom.parallel.pipeline.bubble` (the schedules loom runs), vectorized:

    * 1F1B / interleaved (``zb`` 0): ``(p - 1) / v x t_mb`` (NAR sec 2.2), whatever the
      interleaved micro-batch group N (a no-latency simulation of loom's op list,
      tests/planner/test_planner_vp_group.py);
    * ZB-H1 (``zb`` 1, ``--pipeline-schedule zero-bubble``): ``(p - 1)(F + B - W)`` for
      ``m >= p`` (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec 3.1), else 1F1B's
      minus the ``m`` W passes that fill it;
    * ZB-V (``zb`` 2, two chunks in a V): ``(p - 1) F / 2`` for ``m >= 2p - 1`` (loom's op
      order, ~0 in the paper, sec 6), else ``(p - 1) t_mb / 2``.

    tests/planner/test_planner_layouts_v3.py checks them against the scalar functions."""
    p, v = L["pp"], L["vp"]
    zb = L.get("zb", 0 * p)
    classic = (p - 1) / v * t_mb
    h1 = np.where(m >= p, (p - 1) * np.maximum(0.0, t_mb - 2 * w_mb),
                  (p - 1) * t_mb - m * w_mb)
    zbv = np.where(m >= 2 * p - 1, (p - 1) * f_mb / 2, (p - 1) * t_mb / 2)
    return np.where(zb == 1, h1, np.where(zb == 2, zbv, classic))


def optimizer_traffic(state_bytes: float) -> float:
    """HBM bytes per parameter one optimizer step moves: the fp32 master copy read and written
    (8), the fp32 gradient read (4), the 16-bit weights written (2), and each state read and
    written (``2 x state_bytes``): 30 for Adam (its two fp32 moments), 22 for SGD with
    momentum, 14 without."""
    return 14.0 + 2.0 * state_bytes


# -- compute --------------------------------------------------------------------------------------

def _mem_traffic(cluster: Cluster) -> float:
    return cluster.mem_traffic if cluster.mem_traffic else MEM_TRAFFIC


def layer_times(model: ModelConfig, seq_length: int, L: dict, cluster: Cluster,
                opts: Options, moe_share: float | None = None) -> dict:
    """Per transformer layer, per micro-batch, one GPU (seconds): ``gemm`` and ``attn`` forward
    compute, ``elem`` forward element-wise time, ``scores_elem`` (the part of ``elem`` on attention
    scores), ``tp_fwd``/``tp_bwd`` collective times, ``cp_fwd``/``cp_bwd`` exposed ring time,
    ``a2a``: one EP all-to-all (0 for dense models). MoE models: in a share ``moe_share`` of the
    layer (1 = an MoE layer, 0 = a dense one; default the model's share of MoE layers) the dense
    MLP's GEMM time is replaced by :func:`moe_layer_times`' ``gemm``, the TP collectives grow
    by its ``tp_extra`` (forward) and ``tp_extra_bwd`` (backward, SP's gather) and the CP
    time by the router's statistics ``cp_extra``."""
    s = seq_length
    h, a, g, d, f = (model.hidden_size, model.num_attention_heads, model.num_kv_groups,
                     model.head_dim, model.ffn_size)
    t, c, b = L["tp"], L["cp"], L["mbs"]
    S = s * b / c
    att_gemm, att_scores = attention_flops_per_token(model, s)  # MLA: loom.planner.mla
    gemm_flops = (att_gemm + (6 if gated_mlp(model) else 4) * h * f) * S / t
    attn_flops = att_scores * S / t
    peak = cluster.peak_flops
    gemm = gemm_flops / (peak * gemm_efficiency(h / t, S, cluster))
    a2a = tp_extra = tp_extra_bwd = cp_extra = 0.0
    if model.num_experts:
        fm = moe_fraction(model) if moe_share is None else moe_share
        mo = moe_layer_times(model, S, L, cluster, opts.moe_load_imbalance)
        mlp_flops = (6 if gated_mlp(model) else 4) * h * f * S / t
        gemm = gemm + fm * (mo["gemm"] - mlp_flops / (peak * gemm_efficiency(h / t, S, cluster)))
        a2a, tp_extra = fm * mo["a2a"], fm * mo["tp_extra"]
        tp_extra_bwd, cp_extra = fm * mo["tp_extra_bwd"], fm * mo["cp_extra"]
    # per ring block with CP; Options.causal_skip: the fused kernel skips the masked half
    if opts.causal_skip and opts.flash_attention:
        attn_flops = attn_flops / 2
    attn = attn_flops / (peak * attention_efficiency(d, s / c, opts.flash_attention, cluster))
    act = activation_bytes_per_layer(model, s, L, flash_attention=opts.flash_attention,
                                     moe_load_imbalance=opts.moe_load_imbalance,
                                     moe_share=moe_share)
    k = _mem_traffic(cluster)
    elem = k * act["none"] / cluster.hbm_bw
    scores_elem = k * act["scores"] / cluster.hbm_bw
    tp_bw, tp_alpha = link(t > cluster.gpus_per_node, cluster)
    ar = all_reduce_time(t, 2 * S * h, tp_bw, tp_alpha)  # AG + RS with SP: same volume
    # --distribute-saved-activations (no SP): full recompute's saved input 2 S h was split over
    # the TP ranks; backward all-gathers it before the recompute, on the compute stream
    # (Megatron-LM mpu/random.py CheckpointFunction.backward, gather_split_1d_tensor; metaseq's
    # checkpoint_activations.py the same), one more exposed TP collective per layer
    saved_ag = (np.where(L["sp"] > 0, 0.0, all_gather_time(t, 2 * S * h, tp_bw, tp_alpha))
                if opts.distribute_saved_activations else 0.0 * ar)
    tp_fwd = 2 * ar + tp_extra
    # overlapped with the weight-gradient GEMMs (Megatron's asynchronous TP all-reduce, 2021+)
    tp_bwd = 2 * ar + tp_extra_bwd
    tp_bwd = np.maximum(0.0, tp_bwd - gemm) if opts.overlap_tp_comm else tp_bwd
    kv = (a * (model.q_head_dim + model.v_head_dim) if model.multi_latent_attention
          else 2 * g * d)  # K and V widths per token (MLA: the expanded heads)
    cpc = cp_layer_cost_rows(row_comm_types(L, opts.cp_comm_type), S, t, c, a * d, kv,
                             attn if opts.overlap_cp_comm else 0.0 * attn, cluster,
                             opts.cp_a2a_size)
    cp_fwd, cp_bwd = cpc["fwd"] + cp_extra, cpc["bwd"]
    return {"gemm": gemm, "attn": attn, "elem": elem, "scores_elem": scores_elem,
            "tp_fwd": tp_fwd, "tp_bwd": tp_bwd, "tp_ar": ar, "saved_ag": saved_ag,
            "cp_fwd": cp_fwd, "cp_bwd": cp_bwd,
            "a2a": a2a}


def recompute_work(model: ModelConfig, lt: dict, rc, opts: Options) -> tuple:
    """Forward work that backward repeats, per layer and micro-batch (seconds): ``(compute,
    element-wise)`` from :func:`layer_times`' ``lt``, by recompute code ``rc``. Full: the whole
    forward; selective: Megatron's attention core (scores and their element-wise work), or with
    ``opts.selective_ac_op`` torchtitan's op policy (:func:`loom.planner.flops.
    op_sac_recompute_share` of the GEMMs and all the element-wise work); none: nothing."""
    if opts.selective_ac_op:
        sel, sel_elem = op_sac_recompute_share(model) * lt["gemm"], lt["elem"]
    else:
        sel, sel_elem = lt["attn"], lt["scores_elem"]
    return (np.where(rc == 2, lt["gemm"] + lt["attn"], np.where(rc == 1, sel, 0.0)),
            np.where(rc == 2, lt["elem"], np.where(rc == 1, sel_elem, 0.0)))


def time_terms(model: ModelConfig, L: dict, global_batch_size: int, seq_length: int,
               cluster: Cluster, opts: Options | None = None, slots: dict | None = None) -> dict:
    """Time of one iteration, seconds, term by term (arrays).

    Terms: ``compute`` (forward + backward GEMMs and attention of all micro-batches on the slowest
    stage), ``recompute``, ``elementwise``, ``tp_comm``, ``cp_comm``, ``ep_comm`` (MoE
    all-to-alls, :func:`loom.planner.moe.all_to_all_time`), ``pp_bubble``, ``pp_comm``,
    ``dp_comm`` (exposed), ``optimizer``, ``straggler`` (waiting for the slowest node,
    :func:`straggler_factor` x the rest); ``iteration`` is their sum. Also ``dp_comm_total``
    (before overlap) and ``microbatch_time`` (slowest stage, one micro-batch)."""
    opts = opts or Options()
    s = seq_length
    h = model.hidden_size
    t, p, c, v, b, d, sp = L["tp"], L["pp"], L["cp"], L["vp"], L["mbs"], L["dp"], L["sp"]
    m = num_microbatches(L, global_batch_size)
    S = s * b / c
    peak = cluster.peak_flops
    k = _mem_traffic(cluster)

    def one_layer(lt, rc):
        """Terms of one layer and micro-batch under recompute codes ``rc``; its backward (+
        recompute) and forward time."""
        full = rc == 2
        comp_f = lt["gemm"] + lt["attn"]
        rec, rec_elem = recompute_work(model, lt, rc, opts)
        layer = {
            "compute": 3 * comp_f,
            "recompute": rec,
            "elementwise": 3 * lt["elem"] + rec_elem,
            "tp_comm": (lt["tp_fwd"] + lt["tp_bwd"]
                        + np.where(full, lt["tp_fwd"] + lt.get("saved_ag", 0.0), 0.0)),
            "cp_comm": lt["cp_fwd"] + lt["cp_bwd"] + np.where(full, lt["cp_fwd"], 0.0),
            # EP: dispatch + combine forward and their transposes backward, exposed (loom does
            # not overlap them); full recompute repeats the forward two
            "ep_comm": 4 * lt["a2a"] + np.where(full, 2 * lt["a2a"], 0.0),
        }
        # last item: the weight-gradient GEMMs (W of the zero-bubble schedules: as many FLOPs as
        # the forward GEMMs; attention and element-wise backward are input-gradient work, B)
        return (layer, 2 * comp_f + rec + 2 * lt["elem"] + rec_elem, comp_f + lt["elem"],
                lt["gemm"])

    # a layer is fully recomputed or not (the block method recomputes the first N of every
    # chunk, stage_table.recomputed_per_chunk); not: the row's selective or none
    rc_base = np.where(L["recompute"] == 2, 0.0, L["recompute"])
    rc_full = 0.0 * rc_base + 2.0

    def per_layer(lt):
        return [one_layer(lt, rc_base), one_layer(lt, rc_full)]

    moe = bool(model.num_experts)
    hybrid = is_hybrid(model)
    # layer kinds (stage_table.layer_kinds): one dense kind; MoE: dense and MoE layers
    # (moe.py); hybrid: Mamba, attention, MLP (mamba.py); each slot holds its layers of each
    if hybrid:
        lts = kind_layer_times(model, s, L, cluster, opts.flash_attention, k,
                               opts.overlap_tp_comm)
        kinds = [per_layer(lts[kind]) for kind in KINDS]
        lt = lts["M"]
    else:
        lt = layer_times(model, s, L, cluster, opts, moe_share=0.0 if moe else None)
        kinds = [per_layer(lt)]
    if moe:
        kinds.append(per_layer(layer_times(model, s, L, cluster, opts, moe_share=1.0)))
    if slots is None:  # the stages of every row (stage_table.py)
        slots = stage_slots(model, L, m, opts.legacy_interleaved_warmup)
    D = 0 if hybrid else mtp_depth(model)  # MTP: D layers of the last one's kind with the loss
    j_mtp = 1 if moe and model.is_moe_layer(model.num_layers - 1) else 0
    # each kind twice: its layers not fully recomputed, then the recomputed ones
    counts = []
    for i in range(len(kinds)):
        mtp = slots["mtp"] if (D and i == j_mtp) else 0.0
        counts += [slots["layers"][i] - slots["layers_rc"][i] + mtp * (1 - slots["mtp_rc"]),
                   slots["layers_rc"][i] + mtp * slots["mtp_rc"]]
    kinds = [variant for kd in kinds for variant in kd]
    layer = kinds[0][0]

    def mix(cnt, j, key=None):
        """Sum over the kinds of ``cnt`` layers of each: item ``j`` of :func:`per_layer`."""
        return sum(n * (kd[j] if key is None else kd[j][key]) for n, kd in zip(cnt, kinds))
    # output layer + cross-entropy with the loss; embedding all-reduce with the embedding
    Vp = padded_vocab(model, t)
    out_flops = 2 * h * Vp * S / t * (1 + D)  # + the MTP modules' output layers
    out_comp = 3 * out_flops / (peak * gemm_efficiency(h, S, cluster))
    out_elem = 3 * k * 4 * S * Vp / t / cluster.hbm_bw
    emb_comm = lt["tp_ar"]
    # gradient accumulation outside the weight-gradient GEMM: every micro-batch's backward ends
    # with an element-wise pass over the stage's gradients (opts.grad_accum_bytes of HBM traffic
    # per parameter; 0 with Megatron-Core's fused accumulation), on the stage's critical path
    P_slot, X_slot = slot_params(model, L, s, slots)
    per_slot = {kk: mix(counts, 0, kk) for kk in layer}
    # TP: the vocab-parallel embedding's forward all-reduce (SP: reduce-scatter) on the rank
    # with E, the output layer's input all-reduce in backward (SP: its all-gather forward,
    # reduce-scatter backward) on the rank with L: one S h all-reduce each (SHO sec 3)
    per_slot["tp_comm"] = per_slot["tp_comm"] + (slots["emb"] + slots["out"]) * emb_comm
    per_slot["compute"] = per_slot["compute"] + slots["out"] * out_comp
    per_slot["elementwise"] = (per_slot["elementwise"] + slots["out"] * out_elem
                               + opts.grad_accum_bytes * P_slot / cluster.hbm_bw)
    t_slot = sum(per_slot.values())
    i_slow = np.argmax(t_slot, axis=0)[None, :]

    def at_slow(x):
        return np.take_along_axis(np.broadcast_to(x, t_slot.shape), i_slow, axis=0)[0]
    stage = {kk: at_slow(vv) for kk, vv in per_slot.items()}
    t_mb = at_slow(t_slot)
    slow = tuple(at_slow(cn) for cn in counts)
    # backward share of one micro-batch on the stage (for DP overlap): 2/3 of compute etc.
    t_bwd_mb = mix(slow, 1)

    terms = {kk: m * vv for kk, vv in stage.items()}
    terms["pp_bubble"] = np.where(p > 1, pipeline_bubble(L, t_mb, mix(slow, 3), mix(slow, 2),
                                                         m), 0.0)
    pp_bw, pp_alpha = link((t * c * d) >= cluster.gpus_per_node, cluster)
    send = p2p_time(2 * S * h / t, pp_bw, pp_alpha)
    terms["pp_comm"] = np.where(p > 1, (2 * v * m + 2 * (p - 1)) * send, 0.0)
    # tied word embeddings with PP: the first and the last stage each hold a copy, whose
    # gradients are all-reduced between the two after the backward, exposed, before the DP
    # reduction (Megatron-LM's embedding group, _allreduce_word_embedding_grads, in the main-grad
    # dtype; DeepSpeed's pipeline engine ReduceTiedGrads, fp32 under bf16)
    if not model.untie_embeddings_and_output_weights:
        tied = all_reduce_time(2.0, Vp * h / t * opts.grad_bytes,
                               *link((p - 1) * t * c * d >= cluster.gpus_per_node, cluster))
        terms["pp_comm"] = terms["pp_comm"] + np.where(p > 1, tied, 0.0)

    # data parallel (over the dp x cp group; ranks t apart, so gpus_per_node / t share a node)
    i_par = np.argmax(P_slot, axis=0)[None, :]
    params = np.take_along_axis(P_slot, i_par, axis=0)[0]
    n_dp = d * c
    per_node = np.where(t >= cluster.gpus_per_node, 1.0, np.floor(cluster.gpus_per_node / t))
    z = L["zero"]
    # MoE: expert parameters (ex of the stage) reduce over the expert-data-parallel group
    # n_x = t c d / (u e) (moe.expert_dp; n_dp / e at u = t), whose ranks are u e apart
    # (moe.expert_shards); the rest over the whole group as for a dense model
    n_x, ue = expert_dp(L), expert_shards(L)
    ex = 0.0
    if model.num_experts:
        ex = np.take_along_axis(X_slot, i_par, axis=0)[0]
    per_node_x = np.where(ue >= cluster.gpus_per_node, 1.0,
                          np.floor(cluster.gpus_per_node / ue))

    def dp_collective(fn, bytes_per_param):
        """``fn(ranks, ranks_per_node, bytes)`` over the DP group (+ the expert-DP group)."""
        out = fn(n_dp, per_node, (params - ex) * bytes_per_param)
        if model.num_experts:
            out = out + fn(n_x, per_node_x, ex * bytes_per_param)
        return out

    n_buckets = np.maximum(1.0, np.ceil(params / bucket_elems(n_dp, opts, params)))
    net = dp_network(cluster)  # the DP collectives' share of the inter-node bandwidth

    def hier(n, k_node, nbytes):
        # every bucket is its own collective and pays the latency once more (ring inside the
        # node, ring or tree across nodes: primitives.inter_node_latency)
        return (hierarchical_all_reduce_time(n, k_node, nbytes, net)
                + (n_buckets - 1) * all_reduce_latency(n, k_node, cluster))

    grad_sync = dp_collective(hier, opts.grad_bytes)
    # ZeRO-3: per micro-batch weight all-gathers (fwd + bwd) and gradient reduce-scatter, a flat
    # ring whose every byte crosses the GPU's own link; ZERO3_OVERLAP of the micro-batch's
    # compute hides it (both fitted to NAR table 2, see the module docstring)
    z_link_bw, z_alpha = link(n_dp * t > cluster.gpus_per_node, net)
    z_eff = ZERO3_LINK_EFFICIENCY if opts.zero3_link_efficiency is None \
        else opts.zero3_link_efficiency
    z_ov = ZERO3_OVERLAP if opts.zero3_overlap is None else opts.zero3_overlap
    z_bw = z_link_bw * z_eff
    ag_w = dp_collective(lambda n, _, nb: all_gather_time(n, nb, z_bw, z_alpha), 2)
    rs_g = dp_collective(lambda n, _, nb: reduce_scatter_time(n, nb, z_bw, z_alpha),
                         opts.grad_bytes)
    t_fwd_mb = mix(slow, 2)
    z3 = m * np.maximum(0.0, 2 * ag_w + rs_g - z_ov * (t_fwd_mb + t_bwd_mb))
    if opts.zero3_prefetch:  # PyTorch FSDP's per-layer prefetch instead of ZERO3_OVERLAP
        z3 = m * fsdp_exposed(ag_w, rs_g, t_fwd_mb, t_bwd_mb, np.maximum(1.0, sum(slow)))
    # ZeRO-1/2 (distributed optimizer): reduce-scatter of the gradients behind the backward
    # (--overlap-grad-reduce, opts.overlap_grad_reduce; else after it), then all-gather of the
    # bf16 weights behind the next iteration's first forward (--overlap-param-gather,
    # layout.param_gather_overlapped; else right after the optimizer step, exposed), each under
    # the bucket schedule (DeepSpeed's BF16_Optimizer, BLOOM's ZeRO-1: the full fp32 all-reduce
    # instead)
    def hier_rs(n, k_node, nbytes):
        # reduce-scatter / all-gather: ring only (primitives.hierarchical_reduce_scatter_time),
        # every bucket its own collective
        return (hierarchical_reduce_scatter_time(n, k_node, nbytes, net)
                + (n_buckets - 1) * reduce_scatter_latency(n, k_node, cluster))

    rs_h = grad_sync if opts.zero1_all_reduce_grads else dp_collective(hier_rs, opts.grad_bytes)
    ag_h = dp_collective(hier_rs, 2)
    # ZeRO-2 (loom's gradient buffer with shard_gradients, ZERO sec 5.2): every micro-batch's
    # gradients are reduce-scattered into the kept shard behind that micro-batch's backward
    n_rs = np.where(z == 2, m, 1.0)
    z12 = n_rs * exposed_grad_sync(rs_h, t_bwd_mb, params, opts, n_dp) + \
        exposed_grad_sync(ag_h, t_fwd_mb, params, opts, n_dp, param_gather_overlapped(opts))
    dp_exposed = np.where(z >= 3, z3, np.where(
        z >= 1, z12, exposed_grad_sync(grad_sync, t_bwd_mb, params, opts, n_dp)))
    terms["dp_comm_total"] = np.where(n_dp > 1, np.where(
        z >= 3, m * (2 * ag_w + rs_g), np.where(z >= 1, n_rs * rs_h + ag_h, grad_sync)), 0.0)
    # the hidden part is not free (Options.overlap_interference): while it runs, NCCL's CTAs hold
    # nccl_sm_fraction of the SMs that the overlapped compute would use
    terms["dp_interference"] = overlap_interference(
        terms["dp_comm_total"], np.where(n_dp > 1, dp_exposed, 0.0), cluster,
        opts.overlap_interference)
    terms["dp_comm"] = np.where(n_dp > 1, dp_exposed, 0.0) + terms["dp_interference"]
    shard = np.where(z >= 1, n_dp, 1.0)
    traffic = optimizer_traffic(opts.optimizer_state_bytes)
    terms["optimizer"] = traffic * params / shard / cluster.hbm_bw
    if model.num_experts:
        shard_x = np.where(z >= 1, n_x, 1.0)
        terms["optimizer"] = traffic * ((params - ex) / shard + ex / shard_x) / cluster.hbm_bw
    if opts.muon_ns_steps:  # Newton-Schulz on the slowest stage's whole matrices (muon.py)
        from loom.planner.muon import kind_ns_seconds
        ns = sum(slots["layers"][k] * sec for k, sec in enumerate(kind_ns_seconds(
            model, L, cluster, opts.muon_ns_steps, opts.muon_split_qkv, opts.muon_fp32,
            opts.muon_blockwise)))
        terms["optimizer"] = terms["optimizer"] + np.max(ns, axis=0)
    busy = (terms["compute"] + terms["recompute"] + terms["elementwise"]
            + terms["tp_comm"] + terms["cp_comm"] + terms["ep_comm"] + terms["pp_bubble"]
            + terms["pp_comm"] + terms["dp_comm"] + terms["optimizer"])
    nodes = np.maximum(1.0, np.ceil(t * p * c * d / cluster.gpus_per_node))
    # the slowest chip sets the pace of the GPU-bound terms (compute, element-wise, the bubble
    # they make, the optimizer step); communication runs at the network's pace
    gpu_bound = (terms["compute"] + terms["recompute"] + terms["elementwise"]
                 + terms["pp_bubble"] + terms["optimizer"])
    terms["straggler"] = (gpu_bound * straggler_factor(t * p * c * d,
                                                       getattr(cluster, "speed_sigma", 0.0))
                          + busy * straggler_factor(nodes, opts.straggler_jitter))
    terms["iteration"] = busy + terms["straggler"]
    terms["microbatch_time"] = t_mb
    return terms
