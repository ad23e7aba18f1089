"""MegaScale's Megatron-LM baseline (Jiang et al., "MegaScale: Scaling Large Language Model
Training to More Than 10,000 GPUs", NSDI 2024, arXiv 2402.15627 v1): the strong-scaling rows of
table 2, 175B on 256 to 12,288 A100, through the planner at their published layout. A held-out
source: no constant is fitted on it (:mod:`benchmarks.planner_sources.fit` lists it in
``SOURCES`` but in no ``FIT_SETS`` group).

What the paper states (sec 6.1 and table 1):

* model: 96 layers, h = 12,288, 128 heads (head dim 96), s = 2,048, V = 64,000; the GPT of
  table 1 (biases, LayerNorm, GeLU MLP of 4h, tied embeddings: Megatron-LM's GPT);
* layout: TP 8, PP 8, the interleaved schedule with six model chunks per stage (v = 6, two
  layers a chunk), global batch 768 on 256-1,024 GPUs and 6,144 on 3,072-12,288 (table 2's
  caption); the data-parallel size is what is left, ``GPUs / 64``;
* software: Megatron-LM at commit 285068c8 (2023-01-11, the merge of FlashAttention support);
  hardware: "more than 10,000 NVIDIA Ampere GPUs", eight 200 Gb/s NICs per server on eight rails
  (sec 3.6): the DGX A100 entry of :mod:`loom.planner.hardware` (A100-80GB);
* MFU: table 2's column, model FLOPs (KOR eq 7 with V = 64,000 reproduces it: 39.3k tokens/s on
  256 GPUs -> 53.0%) over 312 TFLOP/s.

What Megatron-LM at 285068c8 does, read from its source (``git show 285068c8:megatron/...``), as
:data:`MEGATRON_LM_2023` options:

* the gradient reduction waits for the last micro-batch's backward: no ``--overlap-grad-reduce``
  (it came 2023-08); the distributed optimizer (``--use-distributed-optimizer``) reduce-scatters
  each model chunk's whole fp32 gradient buffer in one call and all-gathers the parameters the
  same way (``optimizer/distrib_optimizer.py``: ``reduce_model_grads``, ``gather_model_params``),
  so the DP collectives are ``v`` per iteration, not 40M-element buckets (``ddp_bucket_elems``
  = one chunk's parameters); fp32 gradients (bf16 forces ``accumulate_allreduce_grads_in_fp32``);
* the backward TP collectives overlap the weight-gradient GEMMs (the asynchronous TP
  all-reduce, 2021) and gradient accumulation is fused (2022): ``overlap_tp_comm`` True,
  ``grad_accum_bytes`` 0;
* the pipeline's send/receive pairs are blocking (``p2p_communication._communicate``:
  ``batch_isend_irecv``, ``wait``, ``torch.cuda.synchronize``): every transfer is on the critical
  path, as the planner's ``pp_comm`` counts them;
* attention: ``--use-flash-attn`` is opt-in at that commit and MegaScale counts
  FlashAttention-2 among its own "efficient operators" (sec 3.3, table 3 row 6), so the
  baseline's attention is Megatron's unfused softmax (``flash_attention`` False).

Not stated by the paper, taken from Megatron-LM at 285068c8 itself: micro-batch 1 (its GPT-3
175B example script) and selective recompute (its README's default); left to the planner: ZeRO 0
or 1 (the distributed optimizer). Reproduce::

    OMP_NUM_THREADS=1 python -m benchmarks.planner_sources.megascale
"""

from __future__ import annotations

import json

from loom.planner.constants import Constants, fitted_cluster
from loom.planner.layout import Options
from loom.planner.presets import gpt
from loom.planner.search import record, search

PAPER = "Jiang et al., MegaScale, NSDI 2024 (arXiv 2402.15627 v1), table 2, Megatron-LM rows"
# table 2, Megatron-LM: global batch, GPUs, iteration s, published MFU
MEGASCALE_ROWS = (
    (768, 256, 40.0, 0.530), (768, 512, 21.2, 0.499), (768, 768, 15.2, 0.467),
    (768, 1024, 11.9, 0.447),
    (6144, 3072, 29.02, 0.487), (6144, 6144, 14.78, 0.478), (6144, 8192, 12.24, 0.433),
    (6144, 12288, 8.57, 0.412),
)
TP, PP, VP, SEQ = 8, 8, 6, 2048
# Megatron-LM at 285068c8: its GPT-3 175B example (examples/pretrain_gpt3_175B.sh) runs
# --micro-batch-size 1; its README: "Selective recomputation is the default and recommended in
# almost all cases" (--recompute-activations). Chosen from the code before any prediction of
# these rows was compared; the planner's own pick (no recompute, b = 1-3: it fits in its memory
# model) is in the note, not the source.
MBS, RECOMPUTE = 1, "selective"


def megascale_model():
    """The 175B GPT of MegaScale table 1 (s = 2,048, V = 64,000)."""
    return gpt(96, 12288, 128, s=SEQ, V=64000)


def megatron_lm_2023(model=None) -> Options:
    """:data:`MEGATRON_LM_2023` for ``model``: one DP collective per model chunk."""
    model = model or megascale_model()
    h, L = model.hidden_size, model.num_layers
    chunk_params = 12 * h * h * (L // (PP * VP)) / TP  # a chunk's transformer weights per GPU
    return Options(flash_attention=False, overlap_grad_reduce=False, overlap_tp_comm=True,
                   grad_bytes=4, grad_accum_bytes=0.0, max_zero_stage=1, runtime="megatron-legacy",
                   ddp_bucket_elems=chunk_params)


MEGATRON_LM_2023 = megatron_lm_2023()


def megascale_rows(c: Constants | None = None) -> list[dict]:
    """One dict per :data:`MEGASCALE_ROWS` row: ``gpus, global_batch, published_mfu, mfu,
    iteration_s, published_iteration_s`` and the chosen ``layout`` record (its ``time_terms_s``
    say which term costs what)."""
    model = megascale_model()
    out = []
    for B, n, it, pub in MEGASCALE_ROWS:
        res = search(model, fitted_cluster("A100-80GB", n, c), B, SEQ, opts=MEGATRON_LM_2023,
                     fixed=dict(tp=TP, pp=PP, vp=VP, cp=1, sp=1, zb=0, mbs=MBS,
                                recompute=RECOMPUTE))
        r = record(res, int(res["order"][0])) if len(res["order"]) else None
        out.append(dict(gpus=n, global_batch=B, published_mfu=pub, published_iteration_s=it,
                        mfu=r["mfu"] if r else float("nan"),
                        iteration_s=r["iteration_time_s"] if r else float("nan"), layout=r))
    return out


def megascale_points(c: Constants | None = None) -> list[tuple]:
    """``(name, predicted, published)`` MFU of every row (:func:`megascale_rows`)."""
    return [(f"MegaScale 175B {r['gpus']} GPUs MFU", r["mfu"], r["published_mfu"])
            for r in megascale_rows(c)]


def trend(rows) -> dict:
    """MFU at the fewest GPUs over MFU at the most, published and predicted, and the ratio's
    error."""
    lo, hi = rows[0], rows[-1]
    pub, pred = lo["published_mfu"] / hi["published_mfu"], lo["mfu"] / hi["mfu"]
    return dict(published=pub, predicted=pred, error=pred / pub - 1)


if __name__ == "__main__":
    rows = megascale_rows()
    for r in rows:
        lay, err = r["layout"], 100 * (r["mfu"] / r["published_mfu"] - 1)
        print(f"{r['gpus']:6d} GPUs B={r['global_batch']}: MFU {100 * r['published_mfu']:.1f}% "
              f"published, {100 * r['mfu']:.1f}% predicted ({err:+.1f}%); "
              f"iteration {r['published_iteration_s']} s vs {r['iteration_s']:.2f} s; "
              f"b={lay['micro_batch_size']} {lay['recompute']} zero={lay['zero']}")
    print(json.dumps({"trend_256_over_12288": trend(rows)}))
