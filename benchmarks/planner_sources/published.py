"""Published runs outside the 2019-2022 papers of :mod:`benchmarks.planner_sources.validation`: tables with
their provenance, the planner's predictions of them, and every published layout the planner
must be able to plan (:data:`PUBLISHED_LAYOUTS`).

Throughput sources (bf16 only; held out of every fit, :mod:`benchmarks.planner_sources.fit`):

* ``TT`` -- torchtitan, :data:`TORCHTITAN` (``benchmarks/llama3_h100_202412_torchtitan.md``,
  tables 1 and 3): Llama 3.1 8B, s = 8192, local batch 2, FSDP2 (ZeRO-3), selective activation
  checkpointing with torchtitan's default op policy (``Options.selective_ac_op``: every second
  matmul of the block and the element-wise work recomputed, the attention kept; its
  ``parallelize_llama.py`` at 6b03ffa32, 2024-12-26, the month of the tables), 8 and 128
  H100 (Grand Teton: HBM2e 96 GB at 2.4 TB/s, 500 W cap, 400 Gb/s per GPU); the
  ``FSDP + torch.compile`` rows (fused element-wise kernels, as the planner assumes), tokens/s
  per GPU. The Float8 rows (70B, 405B, CP) are layouts to plan only (FP8 is not modelled).
* ``LF-H100`` / ``LF-A100`` -- MosaicML llm-foundry, :data:`LLM_FOUNDRY`
  (``scripts/train/benchmarking/README.md``): MPT models (:data:`MPT_SHAPES`, GeLU MLP 4h, no
  biases, LayerNorm, learned positions (NumParams includes ``max_seq_len x d_model``), tied
  embeddings, V = 50,368, flash attention) under Composer's FSDP (``FULL_SHARD`` = ZeRO-3,
  ``SHARD_GRAD_OP`` = ZeRO-2), activation checkpointing = full recompute. ``LF-H100``: table
  "H100 80GB BF16 (Large Scale, >= 128 GPUs)" (18 rows); ``LF-A100``: table "A100 80GB with 1600
  Gbps node-node interconnect (RoCE)", its ``amp_bf16`` rows with s in 2048..8192 (25 rows; the
  selection made before any prediction). Quantity: tokens/s per GPU (``Throughput (T/s/GPU)``).

Layouts only (:data:`PUBLISHED_LAYOUTS`): the Llama 3 paper's 405B runs (arXiv 2407.21783 table
4), torchtitan's Float8 tables 4-6, Megatron-Bridge's DGX-H100 rows (``docs/performance-summary
-archive.md``, :data:`MEGATRON_BRIDGE`: FP8, plus the one BF16 H100 row, GPT-OSS 120B, an MoE).
"""

from __future__ import annotations

from dataclasses import replace

from loom.config import ModelConfig
from loom.planner.constants import Constants, fitted_cluster
from loom.planner.layout import Options
from benchmarks.planner_sources.software import source_options
from loom.planner.presets import get_preset, moe_llama
from loom.planner.search import enumerate_layouts, evaluate, record, search

TORCHTITAN = dict(repo="pytorch/torchtitan", commit="b5bcd76c66d0acb1a08b176d9639425bc55e0b2a",
                  path="benchmarks/llama3_h100_202412_torchtitan.md",
                  tables="1 (8 GPUs) and 3 (128 GPUs), rows 'FSDP + torch.compile'")
# GPUs, local batch, published tokens/s/GPU, published memory GiB (max over ranks)
TT_ROWS = ((8, 2, 6667, 77.0), (128, 2, 6514, 62.0))
# the eager rows of the same tables (not a source: the compile rows were chosen beforehand)
TT_EAGER_ROWS = ((8, 2, 5762, 82.4), (128, 2, 5605, 67.0))
# Grand Teton H100: HBM2e 96 GB, 2.4 TB/s (the peak FLOP/s is the SXM one, as torchtitan's MFU)
TT_GPU = dict(hbm_bytes=96 * 2**30, hbm_bw=2.4e12)

LLM_FOUNDRY = dict(repo="mosaicml/llm-foundry", commit="8c8dd48f72168c5d51e2f7b151595892a8fba43d",
                   path="scripts/train/benchmarking/README.md",
                   tables="'H100 80GB BF16 (Large Scale, >= 128 GPUs)'; 'A100 80GB with 1600 "
                          "Gbps node-node interconnect (RoCE)' amp_bf16 rows, s 2048-8192")
# scripts/train/yamls/pretrain/mpt-*.yaml: d_model, n_heads, n_layers (expansion_ratio 4)
MPT_SHAPES = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24),
              "1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32),
              "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
# GPU, model, s, GPUs, micro-batch, global batch (sequences), tokens/s/GPU, ZeRO stage, recompute
LF_ROWS = (
    ("H100", "70b", 2048, 512, 8, 4096, 1007, 3, "full"),
    ("H100", "70b", 2048, 256, 8, 2048, 1035, 3, "full"),
    ("H100", "70b", 2048, 128, 8, 1024, 1058, 3, "full"),
    ("H100", "30b", 2048, 512, 8, 4096, 2115, 3, "full"),
    ("H100", "30b", 2048, 256, 8, 2048, 2148, 3, "full"),
    ("H100", "30b", 2048, 128, 8, 1024, 2199, 3, "full"),
    ("H100", "13b", 2048, 512, 16, 8192, 4952, 3, "full"),
    ("H100", "13b", 2048, 256, 16, 4096, 4989, 3, "full"),
    ("H100", "13b", 2048, 128, 16, 2048, 5080, 3, "full"),
    ("H100", "7b", 2048, 512, 6, 3072, 9670, 3, "none"),
    ("H100", "7b", 2048, 256, 6, 1536, 10119, 3, "none"),
    ("H100", "7b", 2048, 128, 6, 768, 10475, 3, "none"),
    ("H100", "3b", 2048, 512, 8, 4096, 21664, 2, "none"),
    ("H100", "3b", 2048, 256, 8, 2048, 22772, 2, "none"),
    ("H100", "3b", 2048, 128, 8, 1024, 23422, 2, "none"),
    ("H100", "1b", 2048, 512, 12, 6144, 39837, 2, "none"),
    ("H100", "1b", 2048, 256, 12, 3072, 42555, 2, "none"),
    ("H100", "1b", 2048, 128, 12, 1536, 44123, 2, "none"),
    ("A100", "30b", 8192, 8, 1, 168, 574, 3, "full"),
    ("A100", "30b", 4096, 8, 1, 168, 814, 3, "full"),
    ("A100", "30b", 2048, 8, 3, 504, 916, 3, "full"),
    ("A100", "13b", 8192, 8, 5, 120, 1795, 3, "full"),
    ("A100", "13b", 4096, 8, 10, 240, 2060, 3, "full"),
    ("A100", "13b", 2048, 8, 2, 48, 2262, 3, "none"),
    ("A100", "7b", 8192, 8, 8, 128, 3206, 3, "full"),
    ("A100", "7b", 4096, 8, 16, 256, 3684, 3, "full"),
    ("A100", "7b", 2048, 8, 6, 96, 4641, 3, "none"),
    ("A100", "3b", 8192, 8, 3, 144, 7695, 3, "none"),
    ("A100", "3b", 4096, 8, 5, 240, 9457, 3, "none"),
    ("A100", "3b", 2048, 8, 10, 160, 10811, 3, "none"),
    ("A100", "1b", 8192, 8, 3, 96, 13814, 3, "none"),
    ("A100", "1b", 4096, 8, 7, 224, 17807, 3, "none"),
    ("A100", "1b", 2048, 8, 14, 448, 20513, 3, "none"),
    ("A100", "760m", 8192, 8, 6, 96, 20933, 3, "none"),
    ("A100", "760m", 4096, 8, 12, 192, 27351, 3, "none"),
    ("A100", "760m", 2048, 8, 24, 384, 32434, 3, "none"),
    ("A100", "350m", 8192, 8, 8, 128, 36569, 3, "none"),
    ("A100", "350m", 4096, 8, 16, 256, 49555, 3, "none"),
    ("A100", "350m", 2048, 8, 32, 512, 58782, 3, "none"),
    ("A100", "125m", 8192, 8, 8, 128, 90392, 3, "none"),
    ("A100", "125m", 4096, 8, 16, 256, 118396, 3, "none"),
    ("A100", "125m", 2048, 8, 40, 640, 142830, 3, "none"),
    ("A100", "125m", 2048, 8, 32, 512, 141737, 3, "none"),
)

MEGATRON_BRIDGE = dict(repo="NVIDIA-NeMo/Megatron-Bridge",
                       commit="4ab94dfad36641cabdeb96452b21bf676aac4772",
                       path="docs/performance-summary-archive.md",
                       tables="25.09 'System: DGX-H100'; 26.04 'GPT OSS 120B' DGX-H100 BF16 row")


def mpt(name: str, s: int) -> ModelConfig:
    """An MPT model of llm-foundry (:data:`MPT_SHAPES`; see the module docstring)."""
    h, a, nl = MPT_SHAPES[name]
    return ModelConfig.gpt2(num_layers=nl, hidden_size=h, num_attention_heads=a, seq_length=s,
                            max_position_embeddings=s, vocab_size=50368, disable_bias_linear=True,
                            hidden_dropout=0.0, attention_dropout=0.0)


def llama(name: str, s: int) -> ModelConfig:
    """A Llama 3 preset at sequence length ``s``."""
    return replace(get_preset(name), seq_length=s, max_position_embeddings=s)


def gpt_oss_120b(s: int = 4096) -> ModelConfig:
    """GPT-OSS 120B (OpenAI model card / HF ``config.json``: 36 layers, h 2880, 64 query heads
    of 64, 8 KV heads, 128 experts top-4 of width 2880, V 201,088), as a SwiGLU MoE in the LLaMA
    layout; its attention sinks and alternating sliding-window layers are not modelled."""
    return moe_llama(36, 2880, 64, 8, 2880, 201088, 128, 4, s=s, kv_channels=64,
                     moe_ffn_hidden_size=2880, disable_bias_linear=True)


def plan_fixed(model: ModelConfig, cluster, global_batch_size: int, seq_length: int,
               fixed: dict, opts: Options | None = None) -> dict | None:
    """The best layout satisfying ``fixed`` (a record of :func:`loom.planner.search.record`);
    when none fits in memory, the fastest of them anyway (``fits`` False: its ``memory_terms_gb``
    say what overflows). None only when no layout satisfies the divisibility rules."""
    res = search(model, cluster, global_batch_size, seq_length, fixed=fixed, opts=opts)
    if len(res["order"]):
        return record(res, int(res["order"][0]))
    if not len(res["tp"]):
        return None
    return record(res, int(res["time_iteration"].argmin()))


def _fsdp_options(c: Constants | None) -> Options:
    """Flash attention, and the ZeRO-3 overlap of the constants ``c`` (a refit's own, so that a
    held-out prediction uses no shipped value; None: the shipped one)."""
    return source_options(flash_attention=True, zero3_overlap=c.zero3_overlap if c else None)


def torchtitan_points(c: Constants | None = None, rows=TT_ROWS,
                      options=None) -> list[tuple]:
    """``(name, predicted, published)`` tokens/s/GPU of the torchtitan rows (module docstring).
    ``options``: ``num_gpus -> Options`` instead of the sources' own (a what-if; the op-policy
    selective recompute is kept)."""
    out = []
    for n, b, tps, _mem in rows:
        cl = fitted_cluster("H100-80GB", n, c, **TT_GPU)
        o = options(n) if options else _fsdp_options(c)
        r = plan_fixed(llama("llama3-8b", 8192), cl, b * n, 8192,
                       opts=replace(o, selective_ac_op=True),
                       fixed=dict(tp=1, pp=1, cp=1, mbs=b, zero=3, recompute="selective"))
        out.append((f"TT 8B {n} GPUs tok/s/GPU", r["tokens_per_s"] / n, tps))
    return out


def llm_foundry_points(gpu: str, c: Constants | None = None, rows=LF_ROWS,
                       options=None) -> list[tuple]:
    """``(name, predicted, published)`` tokens/s/GPU of the llm-foundry ``rows`` (the format of
    :data:`LF_ROWS`) on ``gpu`` (``"H100"`` or ``"A100"``). ``options``: ``num_gpus ->
    Options`` instead of the sources' own (a what-if)."""
    out = []
    for g, name, s, n, b, B, tps, z, rc in rows:
        if g != gpu:
            continue
        cl = fitted_cluster(f"{g}-80GB", n, c)
        r = plan_fixed(mpt(name, s), cl, B, s,
                       opts=options(n) if options else _fsdp_options(c),
                       fixed=dict(tp=1, pp=1, cp=1, mbs=b, zero=z, recompute=rc))
        out.append((f"LF {g} {name} s{s} {n} GPUs b{b} tok/s/GPU", r["tokens_per_s"] / n, tps))
    return out


# Published layouts the planner must plan at exactly that layout: name, model factory, GPU,
# (torchtitan's FSDP with PP is modelled as ZeRO-1: ZeRO-3 is not combined with PP here;
# Megatron-Bridge recipes use the distributed optimizer, ZeRO-1, also with EP)
# GPUs, global batch (sequences), s, fixed layout, options (uneven interleaved allowed: Llama 3
# and Megatron-Bridge run it). Throughput is not compared (FP8, or not published per layout).
# Llama 3: sec 3.3.2, interleaved 1F1B with one layer less on the first and the last stage,
# "without activation checkpointing" (recompute none), batch 16M tokens (2048 x 8K, 128 x 128K);
# its CP "all-gathers the key (K) and value (V) tensors" (cp_comm_type allgather).
PUBLISHED_LAYOUTS = (
    ("Llama 3 405B 8K GPUs (arXiv 2407.21783 t4)", lambda: llama("llama3-405b", 8192),
     "H100-80GB", 8192, 2048, 8192, dict(tp=8, pp=16, cp=1, dp=64, sp=1, zero=1, mbs=1,
                                         recompute="none", first_layers=7, last_layers=7)),
    ("Llama 3 405B 16K GPUs", lambda: llama("llama3-405b", 8192),
     "H100-80GB", 16384, 2048, 8192, dict(tp=8, pp=16, cp=1, dp=128, sp=1, zero=1, mbs=1,
                                          recompute="none", first_layers=7, last_layers=7)),
    ("Llama 3 405B 16K GPUs 128K", lambda: llama("llama3-405b", 131072),
     "H100-80GB", 16384, 128, 131072, dict(tp=8, pp=16, cp=16, dp=8, sp=1, zero=1, mbs=1,
                                           recompute="none", first_layers=7, last_layers=7,
                                           cp_comm_type="allgather")),
    ("torchtitan 70B FSDP32 TP8 (t4)", lambda: llama("llama3-70b", 8192),
     "H100-80GB", 256, 512, 8192, dict(tp=8, pp=1, cp=1, dp=32, mbs=16, zero=3,
                                        recompute="full")),
    ("torchtitan 405B FSDP8 TP8 PP8 1F1B (t5)", lambda: llama("llama3-405b", 8192),
     "H100-80GB", 512, 256, 8192, dict(tp=8, pp=8, cp=1, dp=8, vp=1, recompute="full", zero=1)),
    ("torchtitan 405B FSDP8 TP8 PP8 interleaved (t5)", lambda: llama("llama3-405b", 8192),
     "H100-80GB", 512, 256, 8192, dict(tp=8, pp=8, cp=1, dp=8, recompute="full", zero=1)),
) + tuple(
    (f"torchtitan 405B CP{c} s{s // 1024}K (t6)", (lambda s=s: llama("llama3-405b", s)),
     "H100-80GB", 512, 8 * (8 // c), s, dict(tp=8, pp=8, cp=c, dp=8 // c, recompute="full",
                                             zero=1))
    for c, s in ((1, 32768), (2, 65536), (4, 131072), (8, 262144))
) + (
    ("Megatron-Bridge 25.09 H100 Llama3 8B FSDP8", lambda: llama("llama3-8b", 8192),
     "H100-80GB", 8, 128, 8192, dict(tp=1, pp=1, cp=1, dp=8, mbs=1, zero=3)),
    ("Megatron-Bridge 25.09 H100 Llama3 70B TP4 PP8 VP5", lambda: llama("llama3-70b", 8192),
     "H100-80GB", 64, 128, 8192, dict(tp=4, pp=8, cp=1, dp=2, vp=5, mbs=1, sp=1, zero=1)),
    ("Megatron-Bridge 25.09 H100 Llama3.1 405B TP8 PP8 CP2 VP8",
     lambda: llama("llama3-405b", 8192), "H100-80GB", 1024, 512, 8192,
     dict(tp=8, pp=8, cp=2, dp=8, vp=8, mbs=1, sp=1, zero=1, account_embedding=True,
          account_loss=True)),
    # the recipe's dispatcher: moe_token_dispatcher_type alltoall (its H100 config,
    # scripts/performance/dryrun_configs/gpt_oss/gpt_oss_120b_pretrain_h100_*.yaml)
    ("Megatron-Bridge 26.04 H100 GPT-OSS 120B PP4 EP8 (BF16)", gpt_oss_120b,
     "H100-80GB", 64, 1280, 4096, dict(tp=1, pp=4, cp=1, dp=16, ep=8, mbs=1, zero=1,
                                       disp="alltoall")),
)


def plan_published(entry, constants: Constants | None = None) -> dict | None:
    """:func:`plan_fixed` of one :data:`PUBLISHED_LAYOUTS` entry (uneven interleaved
    splits allowed, flash attention)."""
    name, factory, gpu, n, B, s, fixed = entry
    model = factory()  # every published schedule here is 1F1B or interleaved: zb = 0
    fixed = dict(fixed, zb=0)
    cp_type = fixed.pop("cp_comm_type", "p2p")  # the source's CP method where it names one
    return plan_fixed(model, fitted_cluster(gpu, n, constants), B, s, fixed,
                      Options(flash_attention=True, uneven_interleaved=True,
                              cp_comm_type=cp_type))


# Llama 3 paper (arXiv 2407.21783) table 4: model TFLOP/s per GPU (BF16 MFU 43/41/38%) of the
# first three PUBLISHED_LAYOUTS entries (t 8, p 16, c 1/1/16, d 64/128/8; 126 layers, 7+14x8+7).
LLAMA3_T4_TFLOPS = (430.0, 400.0, 380.0)


def llama3_points(c: Constants | None = None) -> list[tuple]:
    """``(name, predicted, published)`` model TFLOP/s per GPU of Llama 3 405B table 4."""
    out = []
    for entry, pub in zip(PUBLISHED_LAYOUTS[:3], LLAMA3_T4_TFLOPS):
        r = plan_published(entry, c)
        out.append((f"{entry[0]} TFLOP/s", r["tflops_per_gpu"], pub))
    return out


def evaluate_exact(model: ModelConfig, cluster, global_batch_size: int, seq_length: int,
                   fixed: dict, opts: Options | None = None) -> dict:
    """Every layout satisfying ``fixed`` evaluated, fitting or not (arrays)."""
    L = enumerate_layouts(model, cluster, global_batch_size, seq_length, fixed, opts)
    return evaluate(model, L, global_batch_size, seq_length, cluster, opts)
