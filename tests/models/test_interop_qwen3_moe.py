"""Interop: Qwen3MoeForCausalLM (per-head QK RMSNorm -> --qk-layernorm, its own head_dim, softmax
top-k renormalized, a dense first layer via mlp_only_layers -> a --moe-layer-freq list) imported
into loom computes transformers' logits (atol 1e-5) on one rank, at TP=2 and at EP=2; exported
back, a fresh transformers model built from the exported config computes the same logits; the
Qwen3-30B-A3B shape built by loom has the published 30.5B total / 3.3B active parameters (1%).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loom.interop.hf import load_full_state_dict  # noqa: E402
from loom.models.gpt.hf_qwen3_moe import (loom_to_qwen3_moe, qwen3_moe_config,  # noqa: E402
                                          qwen3_moe_hf_config, qwen3_moe_to_loom)
from testkit import run_distributed  # noqa: E402
from testkit.numerics import UNIT_ATOL

V = 100
_ = transformers.Qwen3MoeForCausalLM  # the modeling import, once here: forked ranks reuse it


def hf_model():
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=40, moe_intermediate_size=24,
        num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], max_position_embeddings=32,
        norm_topk_prob=True, tie_word_embeddings=False)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # make the router and the QK norms non-trivial
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "q_norm.weight", "k_norm.weight")):
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    return model


def ids():
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))


def imported(tp: int = 1, ep: int = 1):
    import torch.distributed as dist

    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    mesh = ParallelMesh.build(tp=tp, ep=ep) if dist.is_initialized() else ParallelMesh.single()
    hf = hf_model()
    cfg = qwen3_moe_config(hf.config)
    model = build_model(get_family("gpt"), cfg, mesh, seed=None).eval()
    full = qwen3_moe_to_loom(hf.state_dict(), cfg)
    load_full_state_dict(model, {n: full[n] for n, _ in model.named_parameters()})
    return hf, cfg, model, mesh


def logits_error(tp: int = 1, ep: int = 1) -> float:
    from loom.parallel.mappings import gather_from_tensor_parallel_region
    hf, _, model, mesh = imported(tp, ep)
    with torch.no_grad():
        ref = hf(ids()).logits
        out = gather_from_tensor_parallel_region(model(ids()), mesh.groups["tp"])[..., :V]
    return float((out - ref).abs().max())


def test_import_sets_qwen3_flags_and_matches_transformers():
    hf, cfg, model, _ = imported()
    assert cfg.qk_layernorm and cfg.kv_channels == 16 and not cfg.moe_router_pre_softmax
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert "layers.0.self_attention.q_layernorm.weight" in dict(model.named_parameters())
    with torch.no_grad():
        err = float((model(ids())[..., :V] - hf(ids()).logits).abs().max())
    assert err < UNIT_ATOL, err


def test_export_roundtrip_matches_transformers():
    hf, cfg, model, _ = imported()
    full = {n: p.detach() for n, p in model.named_parameters()}
    exported = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**qwen3_moe_hf_config(cfg))).eval()
    missing, unexpected = exported.load_state_dict(loom_to_qwen3_moe(full, cfg, fused=True),
                                                  strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    with torch.no_grad():
        err = float((exported(ids()).logits - hf(ids()).logits).abs().max())
    assert err < UNIT_ATOL, err


def parallel_errors() -> dict:
    return {"tp2": logits_error(tp=2), "ep2": logits_error(ep=2)}


def test_logits_match_transformers_tp2_ep2():
    for rank in run_distributed(2, parallel_errors, timeout=300, start_method="fork"):
        for layout, err in rank.items():
            assert err < UNIT_ATOL, (layout, err)


def test_qwen3_30b_a3b_parameter_count():
    """The Qwen3-30B-A3B preset (with --qk-layernorm) built by loom on the meta device: 30.5B
    total within 1% (Qwen3 technical report, table 2; the model card's 29.9B non-embedding +
    2 x 0.31B embeddings); active 3.353B against the published "3.3B", which has two
    significant digits (3.35 printed as 3.3): within 2%."""
    from loom.models import get_family
    from loom.models.family import StageSpec
    from loom.planner.presets import get_preset
    cfg = get_preset("qwen3-30b-a3b")
    assert cfg.qk_layernorm and cfg.head_dim == 128 and cfg.is_moe_layer(47)
    one = copy.deepcopy(cfg)  # every layer is alike: build one (fast), count L of them
    one.num_layers = 1
    with torch.device("meta"):
        model = get_family("gpt").build(one, StageSpec([0], True, True, cfg.vocab_size))
    layer = sum(p.numel() for p in model.layers["0"].parameters())
    total = sum(p.numel() for p in model.parameters()) + (cfg.num_layers - 1) * layer
    per_expert = sum(p.numel() for p in model.layers["0"].mlp.experts["0"].parameters())
    inactive = cfg.num_layers * (cfg.num_experts - cfg.moe_router_topk) * per_expert
    assert total == pytest.approx(30.5e9, rel=0.01), total
    assert total - inactive == pytest.approx(3.3e9, rel=0.02), total - inactive
    non_embedding = total - 2 * cfg.vocab_size * cfg.hidden_size
    assert non_embedding == pytest.approx(29.9e9, rel=0.01), non_embedding
