"""ZeRO-3 collectives: the planner's flat ring against NCCL's ring, on a table it has never seen.

llm-foundry's "H100 80GB BF16" table (``ROWS``: 52 rows, 8 to 64 H100, every row Composer FSDP
``FULL_SHARD``, i.e. ZeRO-3; :data:`SOURCE`) is in no fit and no leave-one-source-out source
(``LF-H100`` is the same README's ">= 128 GPUs" table, chosen before any prediction). Each row is
predicted at its published layout three ways:

* ``shipped``: the planner as shipped, ZeRO-3 priced as DeepSpeed's 2021 flat ring (every byte
  over the GPU's own link, ``cluster.inter_bw`` once the group spans nodes; the overlap fitted on
  NAR table 2, ``timing.ZERO3_OVERLAP``);
* ``nccl_ring``: NCCL's own ring model instead (``ncclTopoTuneModel`` in NCCL's
  ``src/graph/tuning.cc``: bus bandwidth = channels x per-channel network bandwidth, the
  channels spread over the node's NICs, so a group with ``k`` ranks per node gets ``k`` links'
  bandwidth, at most the node's NVLink): ``Options.zero3_link_efficiency = k`` on multi-node
  rows (on H100, ``8 x 45 GB/s = 360 GB/s = intra_bw``);
* ``nccl_ring_exposed``: the same with no overlap (``zero3_overlap = 0``).

The JSON also scores the three on the FSDP sources of the held-out protocol (``fsdp_sources``:
LF-H100, LF-A100, TT), where the NCCL ring alone is worse than the flat ring.

The published throughput of a model and micro-batch is flat across the node boundary (13B, b = 2:
4792, 4767, 4811, 4800 tokens/s/GPU on 8, 16, 32, 64 GPUs); the flat ring makes it 2.7x slower
from 16 GPUs on, NCCL's ring keeps it flat (tests/planner/test_planner_fsdp_ring.py). Findings
and why the shipped model stays: docs/planner.md, "Why the worst rows miss", LF-H100.

    OMP_NUM_THREADS=1 python -m benchmarks.planner_fsdp_ring \
        > benchmarks/results/planner_fsdp_ring.json        # ~1 s
"""

from __future__ import annotations

import json
import statistics

from benchmarks.planner_sources import published as P
from loom.planner.layout import Options

SOURCE = dict(repo="mosaicml/llm-foundry", commit="8c8dd48f72168c5d51e2f7b151595892a8fba43d",
              path="scripts/train/benchmarking/README.md",
              table="'H100 80GB BF16' (8-64 GPUs), every row amp_bf16, FULL_SHARD")
# benchmarks.planner_sources.published.LF_ROWS' format: GPU, model, s, GPUs, micro-batch, global batch
# (sequences), tokens/s/GPU, ZeRO stage (FULL_SHARD: 3), recompute (activation checkpointing)
ROWS = (
    ("H100", "70b", 2048, 64, 8, 2048, 1039, 3, "full"),
    ("H100", "70b", 2048, 32, 2, 1024, 882, 3, "full"),
    ("H100", "30b", 8192, 8, 1, 168, 1384, 3, "full"),
    ("H100", "30b", 4096, 8, 1, 168, 1802, 3, "full"),
    ("H100", "30b", 2048, 32, 14, 1344, 2308, 3, "full"),
    ("H100", "30b", 2048, 16, 10, 480, 2263, 3, "full"),
    ("H100", "30b", 2048, 8, 3, 504, 2002, 3, "full"),
    ("H100", "30b", 1024, 8, 6, 1008, 2084, 3, "full"),
    ("H100", "13b", 32768, 8, 1, 24, 1976, 3, "full"),
    ("H100", "13b", 16384, 8, 3, 72, 2985, 3, "full"),
    ("H100", "13b", 4096, 8, 10, 240, 4717, 3, "full"),
    ("H100", "13b", 2048, 64, 2, 128, 4800, 3, "none"),
    ("H100", "13b", 2048, 32, 2, 64, 4811, 3, "none"),
    ("H100", "13b", 2048, 16, 2, 32, 4767, 3, "none"),
    ("H100", "13b", 2048, 8, 2, 16, 4792, 3, "none"),
    ("H100", "13b", 1024, 8, 40, 960, 5502, 3, "full"),
    ("H100", "7b", 65536, 8, 1, 16, 1956, 3, "full"),
    ("H100", "7b", 32768, 8, 2, 32, 3318, 3, "full"),
    ("H100", "7b", 8192, 8, 8, 128, 6935, 3, "full"),
    ("H100", "7b", 4096, 8, 16, 256, 8611, 3, "full"),
    ("H100", "7b", 2048, 8, 6, 48, 10643, 3, "none"),
    ("H100", "7b", 1024, 8, 64, 1024, 10203, 3, "full"),
    ("H100", "3b", 65536, 8, 1, 16, 3262, 3, "full"),
    ("H100", "3b", 32768, 8, 3, 144, 5873, 3, "full"),
    ("H100", "3b", 16384, 8, 1, 48, 11152, 3, "none"),
    ("H100", "3b", 8192, 8, 3, 144, 16578, 3, "none"),
    ("H100", "3b", 4096, 8, 5, 240, 20964, 3, "none"),
    ("H100", "3b", 2048, 64, 6, 1152, 22525, 3, "none"),
    ("H100", "3b", 2048, 32, 6, 576, 23021, 3, "none"),
    ("H100", "3b", 2048, 16, 10, 480, 24142, 3, "none"),
    ("H100", "3b", 1024, 8, 20, 960, 27046, 3, "none"),
    ("H100", "3b", 512, 8, 40, 1920, 27965, 3, "none"),
    ("H100", "1b", 65536, 8, 1, 16, 5506, 3, "full"),
    ("H100", "1b", 32768, 8, 1, 32, 12025, 3, "none"),
    ("H100", "1b", 16384, 8, 2, 64, 19649, 3, "none"),
    ("H100", "1b", 8192, 8, 3, 96, 29157, 3, "none"),
    ("H100", "1b", 4096, 8, 7, 224, 38535, 3, "none"),
    ("H100", "1b", 2048, 64, 20, 1280, 44402, 3, "none"),
    ("H100", "1b", 2048, 32, 20, 640, 45130, 3, "none"),
    ("H100", "1b", 2048, 16, 20, 320, 46037, 3, "none"),
    ("H100", "1b", 2048, 8, 14, 112, 45455, 3, "none"),
    ("H100", "1b", 1024, 8, 18, 576, 48910, 3, "none"),
    ("H100", "1b", 512, 8, 56, 1792, 52275, 3, "none"),
    ("H100", "760m", 32768, 8, 1, 16, 16291, 3, "none"),
    ("H100", "760m", 16384, 8, 3, 48, 27815, 3, "none"),
    ("H100", "760m", 8192, 8, 6, 96, 41825, 3, "none"),
    ("H100", "760m", 4096, 8, 12, 192, 55459, 3, "none"),
    ("H100", "760m", 2048, 32, 24, 768, 67971, 3, "none"),
    ("H100", "760m", 2048, 16, 24, 384, 68551, 3, "none"),
    ("H100", "760m", 2048, 8, 24, 384, 63147, 3, "none"),
    ("H100", "760m", 1024, 8, 48, 768, 78581, 3, "none"),
    ("H100", "760m", 512, 8, 96, 1536, 83749, 3, "none"),
)
VARIANTS = ("shipped", "nccl_ring", "nccl_ring_exposed")


def options(variant: str, num_gpus: int, gpus_per_node: int = 8) -> Options:
    """The planner options of ``variant`` (module docstring) for a ``num_gpus`` FSDP group."""
    if variant == "shipped":
        return Options(flash_attention=True)
    k = gpus_per_node if num_gpus > gpus_per_node else 1
    return Options(flash_attention=True, zero3_link_efficiency=float(k),
                   zero3_overlap=0.0 if variant == "nccl_ring_exposed" else None)


def _errors(points) -> list[dict]:
    return [dict(row=name, published=pub, predicted=round(pred, 1),
                 error=round(pred / pub - 1, 4)) for name, pred, pub in points]


def predict(variant: str) -> list[dict]:
    """Per row of :data:`ROWS` (``row``: its name in
    :func:`benchmarks.planner_sources.published.llm_foundry_points`): published and predicted tokens/s/GPU
    and the error ``predicted / published - 1`` under ``variant``."""
    return _errors(P.llm_foundry_points("H100", rows=ROWS,
                                        options=lambda n: options(variant, n)))


def llm_foundry_and_torchtitan(variant: str) -> dict:
    """``variant`` on the FSDP sources of the leave-one-source-out protocol (in no fit, so the
    shipped constants make these held-out errors): LF-H100, LF-A100 and TT, per-row errors."""
    def opts(n):
        return options(variant, n)
    return {"LF-H100": _errors(P.llm_foundry_points("H100", options=opts)),
            "LF-A100": _errors(P.llm_foundry_points("A100", options=opts)),
            "TT": _errors(P.torchtitan_points(options=opts))}


def summary(rows: list[dict]) -> dict:
    """Median and worst absolute error of ``rows``."""
    a = [abs(r["error"]) for r in rows]
    return dict(n=len(a), median=round(statistics.median(a), 4), worst=round(max(a), 4))


if __name__ == "__main__":
    res = {v: predict(v) for v in VARIANTS}
    loso = {v: {k: summary(r) for k, r in llm_foundry_and_torchtitan(v).items()}
            for v in VARIANTS}
    print(json.dumps(dict(source=SOURCE, summary={v: summary(r) for v, r in res.items()},
                          fsdp_sources=loso, rows=res), indent=1))
