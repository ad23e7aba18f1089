"""Tokens/s and saved activation memory per token of a pure Mamba-2 stack vs a LLaMA-layout
transformer of about the same parameter count, 1 rank, fp32, at several sequence lengths.

Models (h 256, V 8192, untied): GPT 4 layers (4 heads, SwiGLU FFN 683); Mamba-2 8 layers
(expand 2, head dim 64 -> 8 heads, 1 group, N 64, chunk 128). Each point: forward + backward
of one sequence (b = 1), 1 warm-up + ``REPEATS`` measured, median. Activation memory = bytes of
the distinct non-parameter tensors autograd saves for backward (``saved_tensors_hooks``),
divided by s (SDPA's own internal buffers and the math path's are what PyTorch saves on CPU).

    OMP_NUM_THREADS=1 python -m benchmarks.mamba_vs_gpt [256 1024 4096]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from loom.config import LoomConfig, ModelConfig
from loom.models import get_family
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import build_model

REPEATS = 3


def configs(s: int) -> dict:
    common = dict(hidden_size=256, num_attention_heads=4, seq_length=s, vocab_size=8192,
                  hidden_dropout=0.0, attention_dropout=0.0)
    gpt = ModelConfig.llama(num_layers=4, ffn_hidden_size=683, **common)
    mamba = ModelConfig.llama(model_type="mamba", num_layers=8, mamba_state_dim=64,
                              mamba_head_dim=64, mamba_num_groups=1, mamba_expand=2,
                              mamba_chunk_size=128, **common)
    out = {}
    for name, m in (("gpt", gpt), ("mamba", mamba)):
        cfg = LoomConfig(model=m)
        cfg.training.micro_batch_size, cfg.training.lr, cfg.training.train_iters = 1, 3e-4, 1
        out[name] = cfg.validate(1).model  # the resolved model section
    return out


def measure(cfg: ModelConfig, s: int) -> dict:
    model = build_model(get_family(cfg.model_type), cfg, ParallelMesh.single())
    ids = torch.randint(0, cfg.vocab_size, (1, s), generator=torch.Generator().manual_seed(0))
    params = {p.data_ptr() for p in model.parameters()}
    saved: dict = {}

    def pack(t):
        if t.data_ptr() not in params:
            saved[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    times = []
    for i in range(REPEATS + 1):
        saved.clear()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).mean()
        loss.backward()
        if i:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    step = statistics.median(times)
    return {"model": cfg.model_type, "s": s, "params": sum(p.numel() for p in model.parameters()),
            "tokens_per_s": round(s / step), "step_ms": round(step * 1e3, 1),
            "saved_activation_kib_per_token": round(sum(saved.values()) / s / 1024, 1)}


def main(lengths: list[int]) -> None:
    torch.set_num_threads(1)
    for s in lengths:
        for cfg in configs(s).values():
            print(json.dumps(measure(cfg, s)), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [256, 1024, 4096])
