"""Predictions for published runs (tables copied from the papers; sources below and in
:mod:`loom.planner.presets`). Every pipelined run here used 1F1B or the interleaved schedule
(they predate the zero-bubble schedules), so ``zb = 0`` is fixed. Every function takes ``constants`` (a
:class:`loom.planner.constants.Constants`; None = the shipped values), so that
:mod:`benchmarks.planner_sources.fit` can refit and hold sources out.

* :func:`nar_table1_points` -- NAR table 1 (hardware TFLOP/s per GPU at the published t, p, d,
  full recompute, the micro-batch, virtual stages and DDP of the authors' script
  (:data:`NAR_TABLE1_SCRIPT`), unfused attention, no SP, no distributed optimizer).
* :func:`kor_points` -- KOR table 3 (iteration seconds, full recompute and SP + selective) and
  KOR table 4 (:data:`KOR_TABLE4`: ms forward / backward of one 22B layer, t = 8, b = 4).
* :func:`mcore_h100_strong` -- Megatron-LM README strong scaling (:data:`MCORE_H100_STRONG`).
* :func:`nar_table2` -- NAR table 2 (PTD-P vs ZeRO-3 without model parallelism, A100-80GB,
  s = 2048, days for 300B tokens). Conventions as for NAR table 1: unfused attention, full
  recompute, hardware TFLOP/s (NAR eq 3); PTD-P at the published t = 8, p = 12 / 35, b = 1, no
  SP, no distributed optimizer, virtual stages the planner's best; ZeRO-3 at t = p = c = 1,
  d = n, the published b. Days = ``300e9 / tokens_per_s / 86400``.
* :func:`mcore_h100` -- Megatron-Core r0.8.0 weak scaling on H100 (NVIDIA/Megatron-LM
  README.md, "Weak Scaling Results", images/model_table.png): GPT models 1.7B-462B, s = 4096,
  V = 131,072 (untied), bf16, published t, p, d; per-GPU model TFLOP/s and MFU (989 TFLOP/s
  peak). The README lists the optimizations used: --overlap-grad-reduce,
  --overlap-param-gather (distributed optimizer: ZeRO-1 here), --tp-comm-overlap (sequence
  parallel). The planner picks b, v and recompute for the published t, p, d.
* :func:`bloom_176b` -- BLOOM 176B (BigScience, arXiv 2211.05100 sec 3.4; BigScience's model
  page: "training throughput: about 150 TFLOPs"): 70 layers, h = 14,336, 112 heads, s = 2048,
  V = 250,680, B = 2048, on 384 A100-80GB of Jean Zay (48 nodes, 4 x 100 Gb/s Omni-Path per
  node = 6.25 GB/s per GPU, achievable 92% as for the DGX A100 entry), t = 4, p = 12, d = 8,
  ZeRO-1, full recompute (Megatron-DeepSpeed counts recompute in its TFLOPs), unfused attention.
  The run's slurm script (bigscience-workshop/bigscience ``train/tr11-176B-ml/tr11-176B-ml.slurm``)
  sets ``ZERO_STAGE=0`` with bf16: DeepSpeed's BF16_Optimizer (the README names its
  ``olruwase/bf16-updates`` branch; read at its merge, DeepSpeed 56c522386, 2022-04-19, the first
  commit with BF16_Optimizer), whose pipeline engine all-reduces the tied embedding's fp32
  gradients between the first and the last stage, then all-reduces every fp32 gradient over
  DP in full before the partitioned step and the bf16 all-gather
  (``MEGATRON_DEEPSPEED_2022.zero1_all_reduce_grads``), and adds every micro-batch's bf16
  gradients into its fp32 accumulator (``grad_accum_bytes`` 18).
  70 layers on 12 stages only plan with an uneven split.
* :func:`opt_175b` -- OPT-175B (Zhang et al. 2022, arXiv 2205.01068 sec 2.4: "up to 147
  TFLOP/s per GPU" on 992 A100-80GB; the layout from facebookresearch/metaseq
  ``metaseq/launcher/opt_baselines.py`` and ``opt_job_constants.py`` at f7ffa5f: 96 layers,
  h = 12,288, 96 heads, s = 2048, V = 50,272, 2M-token batches = 8 sequences per DP rank, t = 8,
  FSDP ``--no-reshard-after-forward`` = ZeRO-2 over d = 124, ``--checkpoint-activations`` with
  ``--distribute-checkpointed-activations``, fp16 gradients, Megatron 2.4's synchronous TP
  layers, unfused attention). Hardware TFLOP/s (its 4.30e23 FLOPs for 300B tokens in
  ``projects/OPT/chronicles/final_update.md`` count the recompute). The nodes are taken as DGX
  A100 (200 Gb/s per GPU); the paper's "up to" makes it a best step, not a mean. The logbook PDF
  is not in the stored snapshot, so this is the source's only row.
* :func:`sho_weak_scaling` -- SHO table 1 / figure 1: GPT-2 shapes 1.2B-8.3B on V100-32GB
  (DGX-2H, 16 GPUs per node, s = 1024, V = 51200), model parallel alone and x 64-way data
  parallel; efficiency = per-GPU FLOP/s against the 1-GPU 1.2B run. The published numbers are
  ratios, so only the planner's ratios are compared (absolute V100 speed is not fitted).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from loom.config import ModelConfig
from loom.planner.constants import Constants, fitted_cluster
from loom.planner.layout import Options, make_layouts
from benchmarks.planner_sources.software import source_options
from loom.planner.presets import KOR_TABLE3, NAR_TABLE1, NAR_TABLE2, gpt
from loom.planner.search import evaluate, record, search
from loom.planner.timing import layer_times, recompute_work

# The Megatron-LM of NAR (release 50a4b5fa02, 2021-04-08; NAR's runs predate it): the local DDP
# all-reduces the gradients after the last micro-batch's backward (train_step ->
# allreduce_gradients; overlap came with --overlap-grad-reduce, 2d5220a424, 2023-08-16), in fp16
# for fp16 runs (fp32 only with --accumulate-allreduce-grads-in-fp32, which bf16 forces), and the
# backward TP all-reduces wait for their GEMMs (the asynchronous TP all-reduce is 16c90445e7,
# 2021-09-02); its fp16 gradients accumulate over the micro-batches in ``.grad`` (autograd's
# in-place add: NAR's scripts do not set --use-contiguous-buffers-in-ddp, a store_true at
# 6985e58938), ~6 bytes of HBM traffic per parameter and micro-batch (grad_accum_bytes). KOR
# (2022) has the asynchronous TP all-reduce and the gradient accumulation fused into the
# weight-gradient GEMM (slym/grad_accum_fusion, merged 2022-02-22, before sequence parallelism),
# still no DP overlap. BigScience's Megatron-DeepSpeed (BLOOM, bf16): TP layers from the 2021
# code (synchronous), DeepSpeed's pipeline engine reduces gradients (fp32, all-reduced in full:
# see bloom_176b) after the last micro-batch, and its BF16_Optimizer copies every micro-batch's
# bf16 gradients into the fp32 accumulator (18 bytes per parameter, Options.grad_accum_bytes).
MEGATRON_2021 = source_options(overlap_grad_reduce=False, overlap_tp_comm=False, grad_bytes=2,
                               grad_accum_bytes=6)
MEGATRON_2022 = source_options(overlap_grad_reduce=False)
MEGATRON_DEEPSPEED_2022 = source_options(overlap_grad_reduce=False, overlap_tp_comm=False,
                                         zero1_all_reduce_grads=True, grad_accum_bytes=18)

# DGX-2H: 8 x 100 Gb/s InfiniBand for 16 GPUs = 100 GB/s per node (SHO sec 5) = 6.25 GB/s per GPU.
DGX2H_INTER_BW = 6.25e9
# SHO table 1 (references.md): h, heads, L, params(B), MP, weak scaling MP alone, MP x 64 DP.
SHO_TABLE1 = [
    (1536, 16, 40, 1.2, 1, 1.00, 0.96),
    (1920, 20, 54, 2.5, 2, 0.95, 0.83),
    (2304, 24, 64, 4.2, 4, 0.82, 0.79),
    (3072, 32, 72, 8.3, 8, 0.77, 0.74),
]


# Megatron-Core r0.8.0 H100 weak scaling: params(B), heads, h, L, t, p, GPUs, B, TFLOP/s/GPU, MFU.
MCORE_H100 = [
    (1.7, 16, 2048, 24, 1, 1, 48, 192, 408.8, 0.41),
    (7.1, 32, 4096, 30, 2, 1, 96, 192, 465.9, 0.47),
    (16, 48, 6144, 32, 4, 1, 192, 192, 489.1, 0.49),
    (32, 56, 7168, 48, 8, 1, 384, 192, 459.6, 0.46),
    (70, 64, 8192, 84, 8, 2, 768, 384, 419.7, 0.42),
    (119, 80, 10240, 92, 8, 4, 1536, 768, 420.5, 0.43),
    (177, 96, 12288, 96, 8, 6, 2304, 1152, 432.8, 0.44),
    (314, 128, 16384, 96, 8, 8, 3072, 1536, 474.4, 0.48),
    (462, 144, 18432, 112, 8, 16, 6144, 3072, 459.9, 0.47),
]


# Megatron-LM README, strong scaling: GPT-3 177B (the weak-scaling table's 177B shape, t = 8,
# p = 6), B = 1152, s = 4096: GPUs, published MFU.
MCORE_H100_STRONG = ((96, 0.47), (4608, 0.42))

# KOR table 4 (one 22B layer, t = 8, b = 4): mode, recompute, SP, published fwd ms, bwd ms.
KOR_TABLE4 = (("baseline", "none", 0, 7.7, 11.9), ("sp", "none", 1, 7.2, 11.8),
              ("full", "full", 0, 7.7, 19.5), ("selective", "selective", 0, 7.7, 13.2),
              ("sel+sp", "selective", 1, 7.2, 13.1))


# The authors' own layouts of NAR table 1: Megatron-LM examples/academic_paper_scripts/sc21/
# run_table_1.sh (added as examples/sc21 in de7dc40f88 / 6985e58938, 2021-08, the commit its
# README names for reproducing the paper): per row (in NAR_TABLE1's order) the micro-batch size,
# --num-layers-per-virtual-pipeline-stage (0: not given, v = 1) and --DDP-impl ("torch":
# PyTorch DDP, whose bucketed all-reduce (25 MB buckets, fp16 gradients) overlaps the last
# micro-batch's backward, the others under no_sync; "local": Megatron's DDP, after the backward).
NAR_TABLE1_SCRIPT = ((16, 0, "torch"), (16, 0, "torch"), (16, 0, "torch"), (8, 0, "torch"),
                     (4, 0, "local"), (2, 5, "local"), (2, 5, "local"), (1, 3, "local"),
                     (1, 1, "local"), (1, 0, "local"))
TORCH_DDP_2021 = replace(MEGATRON_2021, overlap_grad_reduce=True, ddp_bucket_elems=25e6 / 2,
                         ddp_bucket_per_rank=0.0)  # fixed 25 MB buckets


def nar_table1_search(i: int, constants: Constants | None = None) -> dict:
    """The search (:func:`loom.planner.search.search` arrays) of NAR table 1's row ``i``
    restricted to its authors' layout (:data:`NAR_TABLE1_SCRIPT`): one layout, if it fits."""
    (P, a, h, nl, t, p, n, B, pub, _pct), (b, lpv, ddp) = NAR_TABLE1[i], NAR_TABLE1_SCRIPT[i]
    v = nl // p // lpv if lpv else 1
    return search(gpt(nl, h, a), fitted_cluster("A100-80GB", n, constants), B, 2048,
                  fixed=dict(tp=t, pp=p, cp=1, mbs=b, vp=v, recompute="full", sp=0, zero=0,
                             zb=0),
                  opts=TORCH_DDP_2021 if ddp == "torch" else MEGATRON_2021)


def nar_table1_points(constants: Constants | None = None) -> list[tuple]:
    """``(name, predicted, published)`` hardware TFLOP/s per GPU of each NAR table 1 row, at
    the layout of the authors' script (:func:`nar_table1_search`)."""
    out = []
    for i, row in enumerate(NAR_TABLE1):
        res = nar_table1_search(i, constants)
        pred = record(res, res["order"][0])["hw_tflops_per_gpu"] if len(res["order"]) \
            else float("nan")
        out.append((f"NAR {row[0]}B hw TFLOP/s", pred, row[8]))
    return out


def layer_fwd_bwd(model: ModelConfig, seq_length: int, L: dict, cluster,
                  opts: Options | None = None) -> tuple:
    """Forward and backward time (seconds) of one transformer layer for one micro-batch, as KOR
    table 4 measures them (backward includes the recompute it triggers). Transformer layers
    only: a Mamba / hybrid model's kinds are in :func:`loom.planner.mamba.kind_layer_times`."""
    opts = opts or source_options()
    lt = layer_times(model, seq_length, L, cluster, opts)
    rc = L["recompute"]
    comp_f = lt["gemm"] + lt["attn"]
    fwd = comp_f + lt["elem"] + lt["tp_fwd"] + lt["cp_fwd"] + 2 * lt["a2a"]
    bwd = 2 * comp_f + 2 * lt["elem"] + lt["tp_bwd"] + lt["cp_bwd"] + 2 * lt["a2a"]
    rec, rec_elem = recompute_work(model, lt, rc, opts)
    # full recompute also repeats the forward's collectives
    bwd = bwd + rec + rec_elem + np.where(rc == 2, lt["tp_fwd"] + lt["cp_fwd"] + 2 * lt["a2a"],
                                          0.0)
    return fwd, bwd


def kor_points(constants: Constants | None = None) -> list[tuple]:
    """``(name, predicted, published)``: KOR table 3 iteration seconds (full recompute; SP +
    selective) and KOR table 4 per-layer ms (:data:`KOR_TABLE4`)."""
    opts = MEGATRON_2022
    out = []
    for (name, a, h, nl, t, p, n, B, b, tfull, tsel, _mfu, _hfu) in KOR_TABLE3:
        d = n // (t * p)
        L = make_layouts([dict(tp=t, pp=p, dp=d, mbs=b, recompute="full", sp=0, vp=1),
                          dict(tp=t, pp=p, dp=d, mbs=b, recompute="selective", sp=1, vp=1)])
        res = evaluate(gpt(nl, h, a), L, B, 2048, fitted_cluster("A100-80GB", n, constants),
                       opts)
        out.append((f"KOR {name} full s", float(res["time_iteration"][0]), tfull))
        out.append((f"KOR {name} sp+sel s", float(res["time_iteration"][1]), tsel))
    L = make_layouts([dict(tp=8, mbs=4, recompute=r, sp=sp) for (_, r, sp, _, _) in KOR_TABLE4])
    fwd, bwd = layer_fwd_bwd(gpt(48, 6144, 64), 2048, L,
                             fitted_cluster("A100-80GB", 8, constants), opts)
    for i, (name, _, _, f_ms, b_ms) in enumerate(KOR_TABLE4):
        out.append((f"KOR t4 {name} fwd ms", float(fwd[i] * 1e3), f_ms))
        out.append((f"KOR t4 {name} bwd ms", float(bwd[i] * 1e3), b_ms))
    return out


def _mcore_model(nl: int, h: int, a: int) -> ModelConfig:
    return ModelConfig.gpt2(num_layers=nl, hidden_size=h, num_attention_heads=a,
                            seq_length=4096, max_position_embeddings=4096, vocab_size=131072,
                            untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                            attention_dropout=0.0)


def mcore_h100(constants: Constants | None = None) -> list[dict]:
    """One dict per :data:`MCORE_H100` row: ``params_b, gpus, published_tflops, tflops`` (model
    TFLOP/s per GPU, KOR eq 7 = Megatron's count) and the chosen ``layout`` record."""
    out = []
    for P, a, h, nl, t, p, n, B, tflops, _mfu in MCORE_H100:
        model = _mcore_model(nl, h, a)
        cl = fitted_cluster("H100-80GB", n, constants)
        res = search(model, cl, B, 4096, opts=source_options(flash_attention=True),
                     fixed=dict(tp=t, pp=p, cp=1, zero=1 if n // (t * p) > 1 else 0,
                                sp=1 if t > 1 else 0, zb=0))
        r = record(res, int(res["order"][0])) if len(res["order"]) else None
        out.append(dict(params_b=P, gpus=n, published_tflops=tflops,
                        tflops=r["tflops_per_gpu"] if r else float("nan"), layout=r))
    return out


def mcore_h100_strong(constants: Constants | None = None) -> list[dict]:
    """One dict per :data:`MCORE_H100_STRONG` row: ``gpus, published_mfu, mfu`` (GPT-3 177B,
    B = 1152, t = 8, p = 6, ZeRO-1, SP; the planner picks b, v, recompute)."""
    out = []
    for n, pub in MCORE_H100_STRONG:
        res = search(_mcore_model(96, 12288, 96), fitted_cluster("H100-80GB", n, constants),
                     1152, 4096, opts=source_options(flash_attention=True),
                     fixed=dict(tp=8, pp=6, cp=1, zero=1, sp=1, zb=0))
        mfu = record(res, int(res["order"][0]))["mfu"] if len(res["order"]) else float("nan")
        out.append(dict(gpus=n, published_mfu=pub, mfu=mfu))
    return out


def nar_table2(constants: Constants | None = None, schemes=("ZeRO-3", "PTD-P"),
               zero3_link_efficiency: float | None = None) -> list[dict]:
    """One dict per NAR table 2 row of ``schemes``: ``scheme, params_b, gpus, b,
    published_tflops, published_days, tflops, days`` (predicted hardware TFLOP/s per GPU and
    days)."""
    opts = source_options(flash_attention=False, max_zero_stage=3,
                          zero3_overlap=constants.zero3_overlap if constants else None,
                          zero3_link_efficiency=zero3_link_efficiency)
    out = []
    for scheme, P, mp, B, n, b, tflops, days in NAR_TABLE2:
        if scheme not in schemes:
            continue
        model = gpt(96, 12288, 96) if P < 200 else gpt(105, 20480, 128)
        if scheme == "ZeRO-3":
            fixed = dict(tp=1, pp=1, cp=1, zero=3, mbs=b, recompute="full")
        else:
            fixed = dict(tp=8, pp=mp // 8, cp=1, zero=0, mbs=1, recompute="full", sp=0, zb=0)
        res = search(model, fitted_cluster("A100-80GB", n, constants), B, 2048, fixed=fixed,
                     opts=opts if scheme == "ZeRO-3" else replace(MEGATRON_2021,
                                                                  max_zero_stage=3))
        row = dict(scheme=scheme, params_b=P, gpus=n, b=b, published_tflops=tflops,
                   published_days=days, tflops=float("nan"), days=float("nan"))
        if len(res["order"]):
            r = record(res, int(res["order"][0]))
            row.update(tflops=r["hw_tflops_per_gpu"], days=3e11 / r["tokens_per_s"] / 86400)
        out.append(row)
    return out


def bloom_176b(constants: Constants | None = None) -> dict:
    """The BLOOM 176B run (module docstring): ``published_tflops`` (about 150), predicted
    ``hw_tflops`` and the chosen ``layout`` record (its ``pipeline_split``)."""
    model = gpt(70, 14336, 112, V=250680)
    cl = fitted_cluster("A100-80GB", 384, constants, inter_bw=0.92 * 6.25e9)
    res = search(model, cl, 2048, 2048, opts=MEGATRON_DEEPSPEED_2022,
                 fixed=dict(tp=4, pp=12, cp=1, mbs=2, vp=1, recompute="full", zero=1, sp=0,
                            zb=0))  # vp 1: DeepSpeed's pipeline engine has no interleaving
    r = record(res, int(res["order"][0])) if len(res["order"]) else None
    return dict(published_tflops=150.0, hw_tflops=r["hw_tflops_per_gpu"] if r else float("nan"),
                layout=r)


def opt_175b(constants: Constants | None = None, distribute_saved: bool = True,
             dp_overlap: bool = True) -> dict:
    """The OPT-175B run (module docstring): ``published_tflops`` (up to 147), predicted
    ``hw_tflops`` and the layout record (time and memory at the published layout, fitting or
    not). What-ifs: ``distribute_saved=False``, the same run without its
    ``--distribute-checkpointed-activations``; ``dp_overlap=False``, FSDP's weight all-gathers
    and gradient reduce-scatters not hidden behind the compute (fairscale overlaps both by
    design: its ``all_gather`` and ``post_backward`` streams)."""
    model = gpt(96, 12288, 96, V=50272)
    opts = source_options(overlap_tp_comm=False, grad_bytes=2, max_zero_stage=3,
                          distribute_saved_activations=distribute_saved,
                          overlap_grad_reduce=dp_overlap)
    L = make_layouts(dict(tp=8, pp=1, cp=1, dp=124, mbs=8, zero=2, recompute="full"))
    res = evaluate(model, L, 992, 2048, fitted_cluster("A100-80GB", 992, constants), opts)
    r = record(res, 0)
    return dict(published_tflops=147.0, hw_tflops=r["hw_tflops_per_gpu"], layout=r)


def sho_weak_scaling(recompute: str = "full", overlap: bool = True,
                     constants: Constants | None = None) -> list[dict]:
    """One dict per SHO table 1 row: ``params_b, mp, published_mp, published_mp_dp`` and the
    predicted ``mp``, ``mp_dp`` efficiencies (per-GPU model FLOP/s over the 1-GPU 1.2B run's),
    V100-32GB, 16 GPUs per node, s = 1024, unfused attention, no recompute, b = 8 (SHO sec 5:
    batch 8 per model-parallel group... per GPU global 512 at 64-way DP)."""
    opts = source_options(flash_attention=False, max_zero_stage=0, overlap_grad_reduce=overlap,
                          overlap_tp_comm=False, grad_bytes=2)
    base = None
    out = []
    for h, a, nl, P, mp, pub_mp, pub_dp in SHO_TABLE1:
        model = gpt(nl, h, a, s=1024)
        got = {}
        for key, d in (("mp", 1), ("mp_dp", 64)):
            cl = fitted_cluster("V100-32GB", mp * d, constants, 16, inter_bw=DGX2H_INTER_BW)
            res = search(model, cl, 8 * d, 1024, opts=opts,
                         fixed=dict(tp=mp, pp=1, cp=1, dp=d, mbs=8, zero=0, sp=0,
                                    recompute=recompute))
            got[key] = record(res, int(res["order"][0]))["tflops_per_gpu"]
        if base is None:
            base = got["mp"]
        out.append(dict(params_b=P, mp=mp, published_mp=pub_mp, published_mp_dp=pub_dp,
                        pred_mp=got["mp"] / base, pred_mp_dp=got["mp_dp"] / base))
    return out


def validation_points(cluster_kw: dict | None = None):
    """``(name, predicted, published)`` for NAR table 1, KOR table 3 and KOR table 4 (the rows
    the compute constants are fitted on; :func:`nar_table1_points` and
    :func:`kor_points`), with the compute constants of ``cluster_kw``
    (``gemm_efficiency``, ``gemm_half_dim``, ``mem_traffic``; missing = shipped). The fit itself
    and its leave-one-source-out check are in :mod:`benchmarks.planner_sources.fit`."""
    from dataclasses import replace

    from loom.planner.constants import SHIPPED

    c = replace(SHIPPED, **(cluster_kw or {})) if cluster_kw else None
    return nar_table1_points(c) + kor_points(c)
