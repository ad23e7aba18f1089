"""NVIDIA's DGX Cloud benchmarking recipes on H100 (a held-out source, issue 47): step seconds
of NeMo 24.09 / 24.11 (Megatron-Core with Transformer Engine) at 8-2,304 H100, weak scaling, at
each recipe's own layout. In no fit set: every prediction here is out of sample.

Source: ``NVIDIA/dgxc-benchmarking`` at 35a9aecc8d (2025-06-09), the BF16 H100 tables of
``llama3.1/README_{8b,70b,405b}.md``, ``nemotron/README_{15b,340b}.md`` and
``nemo_megatron/README_175b.md`` ("Training step time (seconds per step)", the last step of a
50-100 step run), and each recipe's own files at that commit:

* the layout (t, p, c, v, b) from the table's header, the per-GPU-count global batch and, for
  Llama 3.1 405B's proxy rows under 576 GPUs, the layers and p from its table and
  ``llama3.1/configure.sh``;
* the model from the recipe's YAML (``llama3.1/llama3.1_*.yaml``,
  ``nemotron/nemotron4-*-synth.yaml``, ``nemo_megatron/gpt3_175b_hydra.yaml``): 405B with 16
  query groups as its YAML has them; Nemotron-4: squared ReLU, no biases, LayerNorm-1p, RoPE,
  untied, V 256,000; GPT-3: GeLU, biases, learned positions, tied, dropout 0.1, GPT-2 BPE;
* the software: ``distributed_fused_adam`` (sharded optimizer states: ZeRO-1) with
  ``grad_sync_dtype: bf16`` (2-byte gradient buffer and reduce-scatter), ``overlap_grad_sync``
  and ``overlap_param_sync``; no recompute except Nemotron-4 340B (``activations_checkpoint_
  granularity: selective``); sequence parallelism wherever t > 1; fused attention everywhere:
  cuDNN's (``NVTE_FUSED_ATTN=1``: Llama 3.1, Nemotron-4 15B) or the flash-attn package's
  (``NVTE_FUSED_ATTN=0``: Nemotron-4 340B, GPT-3 175B). NeMo 24.09 (Llama 3.1) ships
  Megatron-Core 0.9 (before !2117's interleaved warm-up change), 24.11 (Nemotron-4, GPT-3) 0.10;
  every interleaved row has m != p, where the two rules agree.

The 340B recipe's bf16 optimizer states (``optim.dtype: bf16``) are priced as Megatron's
precision-aware optimizer with bf16 moments (:func:`row_options`).

What the planner does not price here: TP communication overlapped with the GEMMs by userbuffers
(``ub_tp_comm_overlap``, on for the 405B, 70B, 15B and 175B recipes; the planner hides only the
backward's TP collectives), and the attention kernel's skipping of the masked half (the
``Options.causal_skip`` what-if).

    OMP_NUM_THREADS=1 python -m benchmarks.planner_sources.dgxc [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, replace

from loom.config import ModelConfig
from loom.planner.constants import Constants, fitted_cluster
from loom.planner.layout import make_layouts
from loom.planner.memory import precision_aware_bytes
from loom.planner.moe import MOE_LOAD_IMBALANCE, load_imbalance
from loom.planner.presets import gpt
from loom.planner.search import evaluate, record, search
from benchmarks.planner_sources.software import source_options

SOURCE = "DGX-C"
COMMIT = "35a9aecc8d"


def _llama31(L: int, h: int, a: int, g: int, ffn: int) -> ModelConfig:
    return ModelConfig.llama(num_layers=L, hidden_size=h, num_attention_heads=a,
                             num_query_groups=g, group_query_attention=True, ffn_hidden_size=ffn,
                             seq_length=8192, max_position_embeddings=8192, vocab_size=128256,
                             rotary_base=500000.0, hidden_dropout=0.0, attention_dropout=0.0)


def _nemotron4(L: int, h: int, a: int, g: int, ffn: int) -> ModelConfig:
    return ModelConfig.gpt2(num_layers=L, hidden_size=h, num_attention_heads=a,
                            num_query_groups=g, group_query_attention=True, ffn_hidden_size=ffn,
                            seq_length=4096, max_position_embeddings=4096, vocab_size=256000,
                            squared_relu=True, disable_bias_linear=True,
                            untie_embeddings_and_output_weights=True,
                            position_embedding_type="rope", apply_layernorm_1p=True,
                            hidden_dropout=0.0, attention_dropout=0.0)


@dataclass(frozen=True)
class Recipe:
    """One model's recipe: its model at full depth, layout and the software it ran."""

    model: ModelConfig
    tp: int
    pp: int
    cp: int
    vp: int
    mbs: int
    recompute: str
    nemo: str  # container version: 24.09 or 24.11
    cudnn_attention: bool  # NVTE_FUSED_ATTN=1 (else the flash-attn package)
    bf16_optimizer: bool = False  # optim.dtype: bf16 (Apex's DistributedFusedAdam)


RECIPES = {
    "llama3.1-8b": Recipe(_llama31(32, 4096, 32, 8, 14336), 1, 1, 2, 1, 1, "none", "24.09", True),
    "llama3.1-70b": Recipe(_llama31(80, 8192, 64, 8, 28672), 4, 4, 2, 5, 1, "none", "24.09",
                           True),
    "llama3.1-405b": Recipe(_llama31(126, 16384, 128, 16, 53248), 8, 9, 2, 7, 1, "none", "24.09",
                            True),
    "nemotron4-15b": Recipe(_nemotron4(32, 6144, 48, 8, 24576), 4, 1, 1, 1, 4, "none", "24.11",
                            True),
    "nemotron4-340b": Recipe(_nemotron4(96, 18432, 96, 8, 73728), 8, 8, 1, 12, 1, "selective",
                             "24.11", False, bf16_optimizer=True),
    "gpt3-175b": Recipe(replace(gpt(96, 12288, 96, V=50257), hidden_dropout=0.1,
                                attention_dropout=0.1), 4, 8, 1, 12, 1, "none", "24.11", False),
}

# (recipe, GPUs, global batch, published seconds per step, layers, p): layers / p None = the
# recipe's. Llama 3.1 405B under 576 GPUs are the README's proxy configs (7 / 21 / 42 layers).
ROWS = (
    ("llama3.1-8b", 8, 128, 12.91, None, None),
    ("llama3.1-8b", 16, 256, 13.00, None, None),
    ("llama3.1-8b", 32, 512, 13.05, None, None),
    ("llama3.1-8b", 64, 1024, 13.08, None, None),
    ("llama3.1-8b", 128, 2048, 13.10, None, None),
    ("llama3.1-70b", 64, 128, 14.72, None, None),
    ("llama3.1-70b", 128, 256, 14.73, None, None),
    ("llama3.1-70b", 256, 512, 14.8, None, None),
    ("llama3.1-70b", 512, 1024, 14.89, None, None),
    ("llama3.1-70b", 1024, 2048, 14.92, None, None),
    ("llama3.1-70b", 2048, 4096, 14.98, None, None),
    ("llama3.1-405b", 32, 126, 8.85, 7, 1),
    ("llama3.1-405b", 96, 126, 8.75, 21, 3),  # the table prints "8.7  5"
    ("llama3.1-405b", 192, 252, 16.93, 42, 3),
    ("llama3.1-405b", 576, 252, 17.20, None, None),
    ("llama3.1-405b", 1152, 504, 17.52, None, None),
    ("llama3.1-405b", 2304, 1008, 17.62, None, None),
    ("nemotron4-15b", 16, 64, 2.83, None, None),
    ("nemotron4-15b", 32, 128, 2.86, None, None),
    ("nemotron4-15b", 64, 256, 2.86, None, None),
    ("nemotron4-15b", 128, 512, 2.89, None, None),
    ("nemotron4-15b", 256, 1024, 2.88, None, None),
    ("nemotron4-15b", 512, 2048, 2.92, None, None),
    ("nemotron4-15b", 1024, 4096, 2.92, None, None),
    ("nemotron4-15b", 2048, 8192, 2.96, None, None),
    ("nemotron4-340b", 128, 32, 4.61, None, None),
    ("nemotron4-340b", 256, 64, 4.67, None, None),
    ("nemotron4-340b", 512, 128, 4.7, None, None),
    ("nemotron4-340b", 1024, 256, 4.73, None, None),
    ("nemotron4-340b", 2048, 512, 4.84, None, None),
    ("gpt3-175b", 128, 256, 8.91, None, None),
    ("gpt3-175b", 256, 512, 8.95, None, None),
    ("gpt3-175b", 512, 1024, 9.09, None, None),
    ("gpt3-175b", 1024, 2048, 9.01, None, None),
    ("gpt3-175b", 2048, 4096, 9.02, None, None),
)


# Grok-1 314B on 512 H100 (``grok1/README.md`` at 1f6d9f40e4, 2025-09-04: BF16, 15.933 s per
# step; TP 4, PP 8, CP 2, EP 8, ETP 1, VP 8, b 1, B 1024, s 8192, 64 layers): one MoE row, not
# among :data:`ROWS`. Its software is NeMo's ``scripts/performance/llm/pretrain_grok1_314b.py``
# (read at NVIDIA/NeMo 01b83a7ce, not necessarily the benchmark's commit): MixtralConfig8x7B
# resized (h 6144, 48 heads, 8 query groups, expert FFN 32768, 8 experts, top-2), its
# MegatronTokenDropCallback (capacity factor 1.0, padded: every expert gets the same rows, load
# imbalance 1), the all-to-all dispatcher with grouped GEMM (NeMo's Mixtral), bf16 gradients
# (``grad_reduce_in_fp32 = False``), DP overlap, TP communication overlap (not priced).
GROK1 = dict(gpus=512, global_batch=1024, published_s=15.933)


def grok1_record(constants: Constants | None = None, dispatcher: str = "alltoall",
                 capacity: float | None = 1.0) -> dict:
    """The planner's record of the Grok-1 row (:data:`GROK1`) at its recipe's layout, the
    recipe's token dropping (``--moe-expert-capacity-factor`` 1.0) capping the load imbalance
    (:func:`loom.planner.moe.load_imbalance`); ``dispatcher`` / ``capacity``: what-ifs (loom's
    default all-gather dispatcher; dropless, the planner's default imbalance 1.1)."""
    model = ModelConfig.llama(num_layers=64, hidden_size=6144, num_attention_heads=48,
                              num_query_groups=8, group_query_attention=True,
                              ffn_hidden_size=32768, seq_length=8192,
                              max_position_embeddings=8192, vocab_size=131072, num_experts=8,
                              moe_router_topk=2, moe_token_dispatcher_type=dispatcher,
                              moe_grouped_gemm=True, moe_expert_capacity_factor=capacity,
                              hidden_dropout=0.0, attention_dropout=0.0)
    L = make_layouts(dict(tp=4, pp=8, cp=2, dp=8, ep=8, etp=1, mbs=1, vp=8, recompute="none",
                          sp=1, zero=1, zb=0))
    opts = source_options(flash_attention=True, grad_bytes=2,
                          moe_load_imbalance=load_imbalance(model, MOE_LOAD_IMBALANCE),
                          legacy_interleaved_warmup=False)
    res = evaluate(model, L, GROK1["global_batch"], 8192,
                   fitted_cluster("H100-80GB", GROK1["gpus"], constants), opts)
    return record(res, 0)


def row_options(recipe: Recipe, causal_skip: bool = False):
    """The planner Options of a recipe (module docstring): fused attention, 2-byte gradients,
    DP overlap on; bf16 optimizer states where the recipe keeps them (``optim.dtype: bf16``:
    Apex's DistributedFusedAdam holds exp_avg, exp_avg_sq and its parameter copy in bf16, 6
    bytes per parameter, priced as Megatron's ``--use-precision-aware-optimizer --exp-avg-dtype
    bf16 --exp-avg-sq-dtype bf16``, whose master is the same 2 bytes:
    :func:`loom.planner.memory.precision_aware_bytes`); ``causal_skip`` the what-if
    (:class:`loom.planner.layout.Options`)."""
    states = precision_aware_bytes("bf16", "bf16") if recipe.bf16_optimizer else {}
    return source_options(flash_attention=True, grad_bytes=2, causal_skip=causal_skip,
                          legacy_interleaved_warmup=recipe.nemo == "24.09", **states)


def row_record(i: int, constants: Constants | None = None, causal_skip: bool = False) -> dict:
    """The planner's record (:func:`loom.planner.search.record`) of :data:`ROWS` row ``i`` at its
    recipe's layout, fitting in 80 GB or not."""
    name, n, B, _pub, layers, pp = ROWS[i]
    r = RECIPES[name]
    model = replace(r.model, num_layers=layers) if layers else r.model
    p = pp or r.pp
    v = r.vp if p > 1 else 1
    d = n // (r.tp * p * r.cp)
    L = make_layouts(dict(tp=r.tp, pp=p, cp=r.cp, dp=d, mbs=r.mbs, vp=v, recompute=r.recompute,
                          sp=int(r.tp > 1), zero=1 if d > 1 else 0, zb=0))
    res = evaluate(model, L, B, model.seq_length, fitted_cluster("H100-80GB", n, constants),
                   row_options(r, causal_skip))
    return record(res, 0)


def dgxc_points(constants: Constants | None = None,
                causal_skip: bool = False) -> list[tuple]:
    """``(name, predicted, published)`` seconds per step of every :data:`ROWS` row."""
    return [(f"{SOURCE} {row[0]} {row[1]} GPUs s/step",
             row_record(i, constants, causal_skip)["iteration_time_s"], row[3])
            for i, row in enumerate(ROWS)]


def trends(constants: Constants | None = None) -> dict:
    """Per recipe, the weak-scaling trend: step seconds on the most GPUs over the fewest (full-
    depth rows only), published and predicted."""
    out = {}
    for name in RECIPES:
        idx = [i for i, r in enumerate(ROWS) if r[0] == name and r[4] is None]
        lo, hi = idx[0], idx[-1]
        pub = ROWS[hi][3] / ROWS[lo][3]
        pred = (row_record(hi, constants)["iteration_time_s"]
                / row_record(lo, constants)["iteration_time_s"])
        out[name] = dict(gpus=(ROWS[lo][1], ROWS[hi][1]), published=round(pub, 4),
                         predicted=round(pred, 4), error=round(pred / pub - 1, 4))
    return out


def published_rank(constants: Constants | None = None) -> dict:
    """Per recipe, at its fewest GPUs: the planner's own search with nothing fixed (the recipe's
    software, :func:`row_options`) against the published layout (t, p, c, v, b): the best
    layout and its seconds, the published layout's rank among the fitting ones (its fastest
    recompute and ZeRO setting; None when none fits) and its seconds over the best's."""
    out = {}
    for name, r in RECIPES.items():
        _, n, B, _pub, _layers, _pp = next(row for row in ROWS if row[0] == name and not row[4])
        res = search(r.model, fitted_cluster("H100-80GB", n, constants), B, r.model.seq_length,
                     fixed={}, opts=row_options(r))
        order = [int(j) for j in res["order"]]
        want = (r.tp, r.pp, r.cp, r.vp if r.pp > 1 else 1, r.mbs)
        ranks = [k for k, j in enumerate(order)
                 if tuple(int(res[key][j]) for key in ("tp", "pp", "cp", "vp", "mbs")) == want]
        best = record(res, order[0])
        row = dict(gpus=n, layouts=len(order), best_s=round(best["iteration_time_s"], 3),
                   best=f"tp{best['tp']} pp{best['pp']} cp{best['cp']} vp{best['vp']} "
                        f"b{best['micro_batch_size']} {best['recompute']} z{best['zero']}",
                   rank=None, published_s=None, over_best=None)
        if ranks:
            pub = record(res, order[ranks[0]])
            row.update(rank=ranks[0] + 1, published_s=round(pub["iteration_time_s"], 3),
                       published_recompute=pub["recompute"],
                       over_best=round(pub["iteration_time_s"] / best["iteration_time_s"] - 1, 4))
        out[name] = row
    return out


def table(constants: Constants | None = None) -> list[dict]:
    """Every row: published and predicted seconds (as shipped, and with the causal what-if),
    the predicted memory (GB) and whether it fits in 80 GB."""
    out = []
    for i, (name, n, B, pub, layers, pp) in enumerate(ROWS):
        rec = row_record(i, constants)
        skip = row_record(i, constants, causal_skip=True)["iteration_time_s"]
        out.append(dict(recipe=name, gpus=n, global_batch=B, layers=layers, published_s=pub,
                        predicted_s=round(rec["iteration_time_s"], 3),
                        error=round(rec["iteration_time_s"] / pub - 1, 4),
                        causal_skip_s=round(skip, 3), causal_skip_error=round(skip / pub - 1, 4),
                        memory_gb=round(rec["memory_gb"], 1), fits=rec["fits"],
                        cudnn_attention=RECIPES[name].cudnn_attention))
    return out


def summary(rows: list[dict]) -> dict:
    """Median and worst |error| over ``rows`` (of :func:`table`), as shipped and with the
    causal what-if, overall and per attention kernel."""
    def stats(sel, key):
        errs = sorted(abs(r[key]) for r in sel)
        return dict(n=len(errs), median=round(statistics.median(errs), 4),
                    worst=round(errs[-1], 4)) if errs else None
    groups = {"all": rows, "cuDNN attention": [r for r in rows if r["cudnn_attention"]],
              "flash-attn": [r for r in rows if not r["cudnn_attention"]]}
    return {g: dict(shipped=stats(sel, "error"), causal_skip=stats(sel, "causal_skip_error"))
            for g, sel in groups.items()}


def markdown(rows: list[dict]) -> str:
    lines = ["| recipe | GPUs | B | published s | predicted | error | causal half skipped | "
             "memory GB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["recipe"] + (f" ({r['layers']} layers)" if r["layers"] else "")
        name += " (cuDNN)" if r["cudnn_attention"] else " (flash-attn)"
        fit = "" if r["fits"] else " (over 80)"
        lines.append(f"| {name} | {r['gpus']} | {r['global_batch']} | {r['published_s']} | "
                     f"{r['predicted_s']:.2f} | {r['error']:+.1%} | {r['causal_skip_error']:+.1%}"
                     f" | {r['memory_gb']:.1f}{fit} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print the docs table")
    args = ap.parse_args(argv)
    rows = table()
    grok = grok1_record()
    out = dict(source=SOURCE, commit=COMMIT, summary=summary(rows), trends=trends(),
               published_rank=published_rank(), rows=rows,
               grok1=dict(published_s=GROK1["published_s"],
                          predicted_s=round(grok["iteration_time_s"], 3),
                          error=round(grok["iteration_time_s"] / GROK1["published_s"] - 1, 4),
                          time_terms_s={k: round(v, 3) for k, v in grok["time_terms_s"].items()
                                        if v}))
    print(markdown(rows) if args.markdown else json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
