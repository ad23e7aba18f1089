"""Issue 26 item 4: the memory of a named runtime (``Options.runtime``,
loom/planner/memory_runtime.py) against Megatron-LM PR 482's measured peaks, loom's own terms
left as they were, and the search never choosing full recompute where selective fits. ~2 s.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from loom.config import ModelConfig
from loom.parallel.cross_entropy_cost import saved_bytes
from loom.planner.hardware import make_cluster
from loom.planner.layout import Options, make_layouts
from loom.planner.memory import (activation_bytes_per_layer, memory_terms, padded_vocab,
                                 stage_memory_terms)
from loom.planner.memory_runtime import RUNTIMES, check_runtime, layer_extra_bytes
from loom.planner.presets import get_preset
from loom.planner.search import record, search

GIB = 2**30
# Megatron-LM PR 482 (tools/get_training_info/README.md): torch.cuda.max_memory_allocated (GiB)
# of a Llama-2-7B-shaped GPT on Megatron-LM's 2023 ParallelTransformerLayer (32 layers, h 4096,
# SwiGLU ffn 10880, biases, learned positions, GPT-2 vocabulary, s 2048, --use-flash-attn,
# --use-distributed-optimizer, bf16): MBS, GBS, DP, PP, TP, measured peak.
PR482 = ((2, 2048, 8, 1, 1, 69.1), (4, 512, 4, 1, 2, 55.7), (2, 2048, 4, 2, 1, 49.8),
         (4, 128, 1, 1, 8, 28.8))


def _pr482_model():
    return ModelConfig.gpt2(num_layers=32, hidden_size=4096, num_attention_heads=32,
                            ffn_hidden_size=10880, swiglu=True, seq_length=2048,
                            max_position_embeddings=2048, vocab_size=50257)


def _peak_gib(runtime, b, B, d, p, t):
    mt = memory_terms(_pr482_model(), make_layouts(dict(tp=t, pp=p, dp=d, mbs=b, zero=1)), B,
                      2048, Options(flash_attention=True, runtime=runtime))
    return float(mt["total"][0] - mt["reserve"][0]) / GIB


@pytest.mark.parametrize("row", PR482, ids=[f"b{r[0]}d{r[2]}p{r[3]}t{r[4]}" for r in PR482])
def test_megatron_legacy_runtime_within_1pct_of_pr482(row):
    """Counted from the code the PR ran (memory_runtime's docstring), not fitted: -0.1 to -0.6%.
    Without the backward transient (only the p = 2 row has no logits to dominate it) that row is
    -0.8%: the transient is a first-principles term, not needed for the 1%."""
    b, B, d, p, t, pub = row
    got = _peak_gib("megatron-legacy", b, B, d, p, t)
    assert abs(got / pub - 1) < 0.01, (row, got)
    assert _peak_gib("loom", b, B, d, p, t) / pub - 1 < -0.04  # KOR alone: 4.1-8.9% low


def test_legacy_layer_is_the_pr_estimators_count():
    """Per layer, 2023 Megatron-LM with flash attention and unfused SwiGLU keeps
    ``10 S h`` replicated + ``(10 S h + 8 S f) / t`` bytes: the count PR 482 derived from allocator
    traces (its ``(5 s h b + 4 s b f) / t + 5 s h b`` bf16 elements), here read off the code."""
    m = _pr482_model()
    S, h, f = 4 * 2048, 4096, 10880
    for t in (1, 2, 8):
        L = make_layouts(dict(tp=t, mbs=4))
        kor = activation_bytes_per_layer(m, 2048, L, flash_attention=True)["none"][0]
        kor -= 4.0 * 32 * S / t  # the flash log-sum-exp (fp32), which the PR leaves out
        legacy = kor + layer_extra_bytes(m, S, t, "megatron-legacy", True)
        assert legacy == pytest.approx(10 * S * h + (10 * S * h + 8 * S * f) / t, rel=1e-12)


def test_loom_runtime_is_the_default_and_holds_the_fused_loss():
    """``loom plan`` plans loom train runs: the default runtime adds nothing to KOR's layer count
    and its output stage holds what loom's fused cross-entropy keeps (fp32 dL/dx, dL/dw,
    log-sum-exp: cross_entropy_cost.saved_bytes, checked against autograd's saved tensors in
    tests/parallel/test_cross_entropy.py) beside the final norm's and output layer's 16-bit
    inputs, never the logits; a soft-capped model (unfused loss) holds the fp32 logits."""
    assert Options().runtime == "loom" and set(RUNTIMES) == {"loom", "megatron-core",
                                                             "megatron-legacy"}
    m = get_preset("llama3-8b")
    L = make_layouts([dict(tp=2, pp=2, dp=2, mbs=1, recompute=r, sp=1, zero=1)
                      for r in ("none", "selective", "full")])
    last = stage_memory_terms(m, L, 64, 8192, Options(flash_attention=True))["last"]
    S, h, v = 8192, m.hidden_size, float(padded_vocab(m, 2)) / 2
    inputs = 2 * 2 * S * h / 2  # [S/t, h] with SP
    assert np.allclose(last["embedding_output"], inputs + saved_bytes(S, h, v))
    assert np.all(last["embedding_output"] < 4 * S * v)  # less than the fp32 logits alone
    capped = replace(m, final_logit_softcapping=30.0)
    last_c = stage_memory_terms(capped, L, 64, 8192, Options(flash_attention=True))["last"]
    assert np.allclose(last_c["embedding_output"], inputs + 4 * S * v)
    core = memory_terms(m, L, 64, 8192, Options(flash_attention=True, runtime="megatron-core"))
    base = memory_terms(m, L, 64, 8192, Options(flash_attention=True))
    assert np.all(core["total"] > base["total"])  # logits copy and backward transient
    with pytest.raises(ValueError, match="megatron-core"):
        check_runtime("megatron")


def test_search_does_not_force_full_recompute_where_selective_fits():
    """GPT-3 175B on 512 A100-40GB (no flash attention, so no recompute needs the
    ``5 a s^2 b`` scores): at every layout where selective recompute fits, it is faster than full
    recompute, and the search's choice is selective, not full."""
    m, cl = get_preset("gpt3-175b"), make_cluster("A100-40GB", 512)
    res = search(m, cl, 512, 2048, dict(zb=0), Options(flash_attention=False))
    keys = ("tp", "pp", "dp", "cp", "vp", "mbs", "sp", "zero", "lf", "ll", "ep", "cpt")
    rows = np.stack([res[k] for k in keys], axis=1)
    _, group = np.unique(rows, axis=0, return_inverse=True)
    full = {g: i for i, g in enumerate(group.ravel())
            if res["recompute"][i] == 2 and res["rcl"][i] == 0}
    # (the search's refinement adds variants, e.g. ZeRO-2 with PP, only where they may rank)
    sel = [i for i in np.nonzero((res["recompute"] == 1) & res["fits"])[0]
           if group.ravel()[i] in full]
    assert len(sel) > 100
    for i in sel:
        j = full[group.ravel()[i]]
        assert res["time_iteration"][i] < res["time_iteration"][j]
    best = record(res, int(res["order"][0]))
    assert best["recompute"] == "selective"
    # and with no recompute not fitting at that layout, selective (not full) is what fits
    fixed = {k: best[k] for k in ("tp", "pp", "dp", "vp")} | dict(
        mbs=best["micro_batch_size"], zb=0, zero=best["zero"], sp=int(best["sequence_parallel"]))
    one = search(m, cl, 512, 2048, fixed, Options(flash_attention=False))
    assert record(one, int(one["order"][0]))["recompute"] == "selective"
