"""Layouts (vectorized) and the planner options shared by the memory and time models.

A *layout* is a dict of equal-length numpy arrays, one entry per candidate, with keys
``tp, pp, dp, cp, vp, mbs, recompute, sp, zero, lf, ll, ep`` (float64; ``recompute`` coded by
:data:`RECOMPUTE`: 0 none, 1 selective, 2 full; ``sp`` 0/1; ``zero`` the ZeRO stage 0-3, where
stage 1 is Megatron's distributed optimizer; ``lf`` / ``ll`` the transformer layers of the first
/ last pipeline stage, 0 = the even split ``L / p``, see :func:`loom.planner.stage_table.stage_layers`; ``ep`` the
expert-parallel size, part of ``dp``: 1 for dense models; a layout without it means 1; ``zb`` the
pipeline schedule, :data:`SCHEDULES`: 0 1F1B / interleaved, 1 ZB-H1 (``--pipeline-schedule
zero-bubble``), 2 ZB-V (``zbv``, two chunks per stage in a V); ``rcl`` with full recompute
the layers per chunk recomputed (``--recompute-method block --recompute-num-layers rcl``; 0 =
every layer, ``uniform 1``); ``cpt`` the CP communication type, an index into
:data:`loom.planner.context_parallel.CP_COMM_TYPES` (-1 = ``Options.cp_comm_type``, p2p when
that is None)). An optional ``split`` entry
(object array) holds a row's :class:`~loom.config.pipeline_layout.PipelineLayout` (Megatron's
``--pipeline-model-parallel-layout``: any layers on any virtual stage; None = derived from
``pp, vp, lf, ll, zb``, :func:`loom.planner.stage_table.row_layout`). Every model
function takes such a dict and returns
arrays, so the search evaluates tens of thousands of layouts in one numpy pass and
:func:`loom.planner.predict.predict_layout` evaluates one layout with the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loom.planner.moe import MOE_LOAD_IMBALANCE

RECOMPUTE = ("none", "selective", "full")
KEYS = ("tp", "pp", "dp", "cp", "vp", "mbs", "recompute", "sp", "zero", "lf", "ll", "ep", "zb",
        "rcl", "cpt", "etp", "disp")
# ``disp``: the MoE token dispatcher, an index of loom.planner.moe.DISPATCHERS (allgather,
# alltoall, flex; ``--moe-token-dispatcher-type``); -1 or absent = the model's own
# ``etp``: the expert TP size u (``--expert-tensor-parallel-size``; 0 or absent = t, Megatron-
# Core's default; dense models 0): loom.planner.moe.expert_tp
# pipeline schedule code ``zb``: 0 1F1B (interleaved when vp > 1), 1 ZB-H1, 2 ZB-V (vp = 2),
# 3 GPipe (evaluated when given, never searched: 1F1B's time at m micro-batches of memory)
SCHEDULES = ("1f1b", "zero-bubble", "zbv", "gpipe")

# The memory a training process holds beyond its tensors, as the planner's ``reserve`` term
# (``Options.reserve_bytes + Options.reserve_fraction`` x the counted terms), named:
#
# WORKSPACE_BYTES, fixed per GPU: the CUDA context and the libraries' module images; the
#   cuBLAS / cuBLASLt workspaces, 32 MiB per handle and stream on Hopper and 4 MiB on the
#   others (PyTorch aten/src/ATen/cuda/CUDABlas.cpp since PR 120925, after the cuBLAS guide's
#   cublasSetWorkspace recommendation); NCCL's buffers, NCCL_BUFFSIZE (4 MiB by default, NCCL
#   environment-variable docs) per channel and peer of every communicator a rank joins (TP, CP,
#   DP, PP, EP groups). Their sum depends on the driver, the libraries and the groups; 2 GB is
#   the planner's assumption (not a measurement here: no GPU), which `loom plan
#   --calibrate-from` refits from a user's measured peaks (calibrate_runs.py).
# FRAGMENTATION_FRACTION of the counted terms: what PyTorch's caching allocator reserves but
#   cannot hand out (blocks rounded to 512 B / 2 MiB, split blocks that no later request
#   fits; ZeRO, Rajbhandari et al. 2020, sec 3.2 and 6.3, names it as a cause of running out of
#   memory with memory still free, which ZeRO-R's contiguous buffers and Megatron's contiguous
#   gradient buffer reduce). 5% is the planner's assumption for such a run.
# loom train's gradient buckets without --ddp-bucket-size (loom/parallel/grad_buffer.py
# default_bucket_size: TARGET_BUCKETS, MIN_BUCKET_PER_RANK, MAX_BUCKET; the planner stays
# torch-free, a test checks they agree) as Options fields
LOOM_BUCKETS = dict(ddp_bucket_count=4, ddp_bucket_per_rank=250_000, ddp_bucket_elems=40e6)


def given_buckets(ddp_bucket_size) -> dict:
    """The :class:`Options` bucket fields of ``--ddp-bucket-size N`` (N elements per bucket,
    whatever the DP size), or ``{}`` when not given."""
    return {"ddp_bucket_elems": float(ddp_bucket_size), "ddp_bucket_per_rank": 0.0} \
        if ddp_bucket_size else {}
WORKSPACE_BYTES = 2e9
ADAM_STATE_BYTES = 8.0  # Adam's fp32 exp_avg and exp_avg_sq per parameter (ZERO sec 3.1: K = 12
# with the fp32 master copy)
FRAGMENTATION_FRACTION = 0.05


@dataclass
class Options:
    """Modelling choices that are not layout dimensions.

    ``flash_attention``: fused attention (no ``5 a s^2 b`` score activations, KOR table 2 then
    loses its ``5as/h`` term); the paper runs (NAR, KOR) predate it.
    ``grad_bytes``: bytes per gradient element (4: Megatron's fp32 ``main_grad`` -> 18 bytes per
    parameter; 2: the ZeRO paper's fp16 gradients -> 16 bytes per parameter).
    ``overlap_grad_reduce``: DP gradient reduction (all-reduce; ZeRO-1/2 reduce-scatter)
    overlapped with the last micro-batch's backward under the bucket schedule (Megatron-Core
    ``--overlap-grad-reduce``: ``DistributedDataParallel``'s backward hooks launch each bucket
    when its last gradient is ready; loom's ``GradBuffer`` with ``overlap``, loom/parallel/
    grad_buffer.py); False: every bucket is reduced after the backward, exposed (both
    trainers' default). ZeRO-3 does not read it (FSDP prefetches by design: ``zero3_overlap``).
    ``overlap_param_gather``: ZeRO-1/2's all-gather of the updated 16-bit weights overlapped
    with the next iteration's first forward under the bucket schedule (Megatron-Core
    ``--overlap-param-gather``: ``DistributedOptimizer.zero_grad`` launches the first bucket's
    gather, each forward pre-hook waits for its bucket and launches the next; loom's
    ``ParamGather``: every bucket launched after the step in the forward's order, each waited
    for by the pre-hook of its first module, loom/training/distributed_optimizer.py); False:
    all-gathered right after the optimizer step, exposed (both trainers' default). None
    (default): as ``overlap_grad_reduce`` (on unless a source says its software reduced after
    the backward: the DP overlap of a published source is stated once; ``loom plan --dp-overlap``
    and :func:`loom.planner.predict.predict_layout` set both).
    ``ddp_bucket_elems``: gradient bucket size, elements (loom / Megatron default 40M), for the
    bucket schedule of the overlapped DP reduction (:func:`loom.planner.dp_overlap.exposed_grad_sync`).
    ``ddp_bucket_per_rank``: the bucket grows to at least this many elements per DP rank:
    Megatron-Core's default ``max(40M, 1M x dp_size)`` (``distributed_data_parallel.py``, commit
    0fda386c04, 2024-04, "Tune DDP bucket size to improve speed at large DP counts": a ring's
    per-hop latency is paid ``d - 1`` times per bucket); 0: the fixed ``ddp_bucket_elems``.
    ``ddp_bucket_count``: 0 (default) the rule above; ``n`` > 0: loom train's default without
    ``--ddp-bucket-size``, ``clamp(ceil(P / n), ddp_bucket_per_rank x d, ddp_bucket_elems)`` for
    the stage's P parameters (loom/parallel/grad_buffer.py ``default_bucket_size``: n 4, 250k,
    40M; :data:`LOOM_BUCKETS`).
    ``uneven_interleaved``: also search virtual stages with uneven stages (what Megatron-Core
    and Llama 3 run; ``loom train`` runs them from a ``--pipeline-model-parallel-layout``).
    ``straggler_jitter``: relative std. dev. of a node's step time; adds the expected wait for
    the slowest node (:func:`loom.planner.timing.straggler_factor`); 0 = none.
    ``overlap_tp_comm``: backward TP all-reduces overlapped with the weight-gradient GEMMs
    (Megatron's asynchronous TP communication; off for Megatron-LM 2019, SHO).
    ``overlap_cp_comm``: the p2p ring's K/V exchanges overlapped with the attention blocks
    (:func:`loom.planner.context_parallel.cp_layer_cost`); off where no engine progresses
    them beside the compute (CPU ranks without a spare core, host_sharing.host_overlap_options).
    ``reserve_bytes`` + ``reserve_fraction`` x (all other terms): CUDA context, NCCL and cuBLAS
    workspaces, allocator fragmentation (bytes; the named constants and their sources:
    :data:`WORKSPACE_BYTES`, :data:`FRAGMENTATION_FRACTION`).
    ``allow_tp_across_nodes``: let TP groups span nodes (loom train refuses it by default).
    ``max_zero_stage``: highest ZeRO stage searched (``loom train`` runs 0, 1, the
    distributed optimizer, and 3, FSDP2; 2 is a what-if analysis).
    ``zero3_overlap`` / ``zero3_link_efficiency``: override the ZeRO-3 constants of
    :mod:`loom.planner.timing` (the first fitted, used by the fit itself; the second assumed).
    ``cp_comm_type``: Megatron-Core's ``--cp-comm-type`` (p2p, allgather, a2a, a2a+p2p), the
    CP communication and K/V memory of :mod:`loom.planner.context_parallel`; None: every type
    is searched (rows carry ``cpt``; a row without one is p2p).
    ``cp_a2a_size``: a2a+p2p's all-to-all group A (``--hierarchical-context-parallel-sizes A
    B``); 0: the CP ranks of a node, ``min(c, gpus_per_node / t)``.
    ``moe_load_imbalance``: busiest EP rank's expert tokens over the mean (>= 1), applied to the
    expert compute and activations (:data:`loom.planner.moe.MOE_LOAD_IMBALANCE`).
    ``runtime``: whose layer and loss the activation memory counts
    (:mod:`loom.planner.memory_runtime`): ``"loom"`` (KOR table 2, what ``loom plan`` plans:
    ``loom train`` runs), ``"megatron-core"`` or ``"megatron-legacy"`` (Megatron-LM 2023, what
    Megatron-LM PR 482 measured): the extra saved tensors, the loss's logits copies and the
    backward transient of each.
    ``layer_memory``: ``"kor"`` (default) counts a layer's activations as KOR table 2 (what the
    layer needs; Megatron-Core keeps about that: the layer of the published sources); ``"loom"``
    (``loom plan``'s default, and the trainer's prediction) what loom's own layer saves, measured
    (:func:`loom.planner.memory_runtime.loom_layer_extra`; with ``runtime = "loom"`` and fused
    attention).
    ``distribute_saved_activations``: Megatron's ``--distribute-saved-activations`` (default
    off): with full recompute and no SP, each layer's saved input ``2 S h`` is split over the TP
    ranks (``2 S h / t``), as OPT-175B trained (metaseq ``--distribute-checkpointed-
    activations``). Planner only: ``loom train`` does not implement it; its time is one
    all-gather of the saved input per layer in backward (:func:`loom.planner.timing.layer_times`).
    ``optimizer_state_bytes``: the optimizer's states per parameter beside the fp32 master
    copy (:func:`loom.planner.memory.optimizer_state_bytes`: Adam 8, SGD 4 with momentum, 0
    without; as stored under ``--use-precision-aware-optimizer``,
    :func:`loom.planner.memory.precision_aware_bytes`).
    ``master_bytes``: the master copy of a 16-bit run's parameters, per parameter: 4 (fp32), 2
    under ``--use-precision-aware-optimizer`` (:func:`loom.planner.memory.precision_aware_bytes`).
    ``muon_ns_steps``: ``--optimizer muon``'s Newton-Schulz iterations (0: not Muon): the
    layers' weights keep Muon's 4-byte momentum instead of ``optimizer_state_bytes`` (AdamW's,
    kept for the embeddings, output layer and vectors), and the step adds the iterations'
    FLOPs (:mod:`loom.planner.muon`); ``muon_split_qkv`` (``--muon-split-qkv``), ``muon_fp32``
    (``--muon-fp32-matmul-prec`` high or low: fp32 iterations at half the rate),
    ``muon_blockwise`` (``--muon-tp-mode blockwise``: each TP shard on its own).
    ``optimizer_offload_fraction``: ``--optimizer-cpu-offload``'s share of the optimizer's
    masters and states kept in host memory (0: none), off the GPU's optimizer term; the host
    step and its copies are not priced.
    ``zero1_all_reduce_grads``: ZeRO-1 all-reduces the gradients in full instead of
    reduce-scattering them, then all-gathers the updated weights (DeepSpeed's 2022
    BF16_Optimizer, BLOOM's optimizer; Megatron's distributed optimizer reduce-scatters).
    Planner only.
    ``grad_accum_bytes``: HBM bytes per parameter that each micro-batch's gradient
    accumulation moves outside the weight-gradient GEMM (an unfused ``acc += grad``): 0 for
    Megatron-Core's ``--gradient-accumulation-fusion`` (its default since Megatron-LM's
    2022-02 merge of it; loom's own runs are calibrated), ~6 for fp16 gradients accumulated by
    autograd's in-place ``.grad += g`` (read, read, write 2 bytes: Megatron-LM 2021 without
    contiguous buffers, NAR's scripts, or PyTorch DDP under ``no_sync``; the first
    micro-batch's missing add stands for the per-iteration gradient copies), 18 for DeepSpeed's
    2022 BF16_Optimizer (``hp_grad.add_(lp_grad.to(fp32))`` after every micro-batch: a 4-byte
    copy of the 2-byte gradient, then read, read, write 4 bytes).
    ``legacy_interleaved_warmup``: the interleaved schedule of Megatron-LM before 2024-11 (merge
    request !2117, commit 4295be1a6c, dropped the rule): at ``m = p`` every rank runs all its
    ``m v`` forwards before the first backward, so it holds them all. Megatron-Core since, and
    ``loom train``, warm up ``2 (p - r - 1) + (v - 1) p`` (:mod:`loom.planner.stage_table`).
    The published runs' software (benchmarks/planner_sources) ran the old rule. Planner only.
    ``selective_ac_op``: selective recompute is torchtitan's op-level policy
    (``selective_ac_option = 'op'``) instead of Megatron's attention-core recompute: backward
    recomputes every second GEMM of the block and all its element-wise work, not the attention
    (:func:`loom.planner.flops.op_sac_recompute_share`). Time only: the memory stays the
    selective one of :mod:`loom.planner.memory`, and ``hw_tflops_per_gpu`` keeps KOR eq 8's
    selective count. Planner only.
    ``overlap_interference``: a DP collective hidden behind compute slows that compute: NCCL's
    CTAs (one per channel, :data:`loom.planner.dp_overlap.NCCL_CHANNELS`) hold their SMs while it
    runs, so ``dp_comm`` gains the hidden DP time x
    :func:`loom.planner.dp_overlap.nccl_sm_fraction` (term ``dp_interference``; HBM contention is
    not priced). Planner only.
    ``zero3_prefetch``: ZeRO-3 exposes what PyTorch FSDP's per-layer prefetch cannot hide
    (:func:`loom.planner.dp_overlap.fsdp_exposed`: the first all-gather, the last reduce-scatter,
    and per layer the excess of communication over compute) instead of the
    ``ZERO3_OVERLAP`` fitted on DeepSpeed (NAR table 2). Planner only.
    ``causal_skip``: fused attention under a causal mask computes only the key blocks on and
    below the diagonal, about half the score FLOPs (Dao 2023, FlashAttention-2, sec. 3.1.1,
    "Causal masking"; cuDNN's fused attention the same), where the default counts them all, as
    Megatron-LM's FLOP count and the fitted constants do. ``loom plan --attention cudnn``; a
    what-if for the held-out NeMo rows (:mod:`benchmarks.planner_sources.dgxc`), off by default:
    turned on for every source it moves torchtitan's rows 13-17% too fast (docs/planner.md). Time only; needs ``flash_attention``;
    a statement about a causal (decoder) model's run, for its caller to make (a bidirectional
    encoder computes every block).
    Planner only.
    """

    flash_attention: bool = False
    grad_bytes: int = 4
    optimizer_state_bytes: float = ADAM_STATE_BYTES
    master_bytes: float = 4.0
    muon_ns_steps: int = 0
    muon_split_qkv: bool = True
    muon_fp32: bool = False
    muon_blockwise: bool = False
    optimizer_offload_fraction: float = 0.0
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool | None = None  # None: as overlap_grad_reduce
    overlap_tp_comm: bool = True
    overlap_cp_comm: bool = True
    uneven_interleaved: bool = True
    straggler_jitter: float = 0.0
    ddp_bucket_elems: float = 40e6
    ddp_bucket_per_rank: float = 1e6
    ddp_bucket_count: int = 0
    reserve_bytes: float = WORKSPACE_BYTES
    reserve_fraction: float = FRAGMENTATION_FRACTION
    allow_tp_across_nodes: bool = False
    max_zero_stage: int = 3
    zero3_overlap: float | None = None  # None = timing.ZERO3_OVERLAP (fitted)
    zero3_link_efficiency: float | None = None  # None = timing.ZERO3_LINK_EFFICIENCY (assumed)
    moe_load_imbalance: float = MOE_LOAD_IMBALANCE
    cp_comm_type: str | None = None
    cp_a2a_size: int = 0
    runtime: str = "loom"
    layer_memory: str = "kor"
    distribute_saved_activations: bool = False
    zero1_all_reduce_grads: bool = False
    grad_accum_bytes: float = 0.0
    selective_ac_op: bool = False
    legacy_interleaved_warmup: bool = False
    overlap_interference: bool = False
    zero3_prefetch: bool = False
    causal_skip: bool = False


def param_gather_overlapped(opts: Options) -> bool:
    """Whether the ZeRO-1/2 weight all-gather is overlapped: ``opts.overlap_param_gather``, or
    ``opts.overlap_grad_reduce`` when that is None (:class:`Options`)."""
    return opts.overlap_grad_reduce if opts.overlap_param_gather is None \
        else bool(opts.overlap_param_gather)


def make_layouts(rows: list[dict] | dict) -> dict:
    """Layout arrays from a list of dicts (or one dict) with keys :data:`KEYS`; ``recompute``
    may be given by name. Missing keys default to 1 (sizes) or 0 (options)."""
    if isinstance(rows, dict):
        rows = [rows]
    out = {}
    if any(r.get("split") is not None for r in rows):  # a --pipeline-model-parallel-layout
        rows = [_with_split(r) for r in rows]
        out["split"] = np.array([r.get("split") for r in rows] + [None], dtype=object)[:-1]
    for k in KEYS:
        vals = []
        for r in rows:
            v = r.get(k, 1 if k in ("tp", "pp", "dp", "cp", "vp", "mbs", "ep") else
                      -1 if k in ("cpt", "disp") else 0)
            if k == "recompute":
                v = RECOMPUTE.index(v or "none") if not isinstance(v, (int, float)) else v
            if k == "cpt" and isinstance(v, str):
                from loom.planner.context_parallel import CP_COMM_TYPES
                v = CP_COMM_TYPES.index(v)
            if k == "disp" and isinstance(v, str):
                from loom.planner.moe import DISPATCHERS
                v = DISPATCHERS.index(v)
            vals.append(float(v))
        out[k] = np.asarray(vals, dtype=np.float64)
    return out


def _with_split(row: dict) -> dict:
    """``row`` with its ``split`` as a PipelineLayout (a string is parsed at the row's ``pp``)
    and ``pp``, ``vp``, ``lf``, ``ll`` read from it."""
    from loom.config.pipeline_layout import parse_layout
    lay = row.get("split")
    if lay is None:
        return row
    if isinstance(lay, str):
        lay = parse_layout(lay, int(row.get("pp", 1)))
    c = lay.rank_layer_counts()
    return dict(row, split=lay, pp=lay.pp, vp=lay.vp, lf=c[0], ll=c[-1])


def num_microbatches(L: dict, global_batch_size: int) -> np.ndarray:
    """m = B / (b d) micro-batches per iteration (per pipeline)."""
    return global_batch_size / (L["mbs"] * L["dp"])
