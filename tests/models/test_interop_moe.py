"""Interop: loom's MoE layouts compute what ``transformers`` computes: MixtralForCausalLM and
Qwen2MoeForCausalLM (shared expert + gate, QKV biases, no top-k renormalization), random
weights from a config (no download), logits to atol 1e-5, on one rank and at EP=2 and TP=2.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loom.interop.hf import load_full_state_dict  # noqa: E402
from loom.models.gpt.hf_moe import (mixtral_config, mixtral_to_loom,  # noqa: E402
                                    qwen2_moe_config, qwen2_moe_to_loom)
from testkit import run_distributed  # noqa: E402
from testkit.numerics import UNIT_ATOL


def hf_models():
    torch.manual_seed(0)
    common = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=2)
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=24, num_local_experts=4, **common)).eval()
    qwen = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=16,
        num_experts=4, **common)).eval()
    with torch.no_grad():  # Qwen2-MoE's router starts at zero: make routing non-trivial
        for layer in qwen.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return {"mixtral": (mixtral, mixtral_config, mixtral_to_loom),
            "qwen2_moe": (qwen, qwen2_moe_config, qwen2_moe_to_loom)}


def compare(tp: int = 1, ep: int = 1) -> dict:
    import torch.distributed as dist

    from loom.models import get_family
    from loom.parallel.mappings import gather_from_tensor_parallel_region
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    mesh = ParallelMesh.build(tp=tp, ep=ep) if dist.is_initialized() else ParallelMesh.single()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, (hf, to_cfg, convert) in hf_models().items():
        cfg = to_cfg(hf.config)
        model = build_model(get_family("gpt"), cfg, mesh, seed=None).eval()
        full = convert(hf.state_dict(), cfg)
        load_full_state_dict(model, {n: full[n] for n, _ in model.named_parameters()})
        with torch.no_grad():
            ref = hf(ids).logits
            logits = gather_from_tensor_parallel_region(model(ids), mesh.groups["tp"])[..., :100]
        out[name] = float((logits - ref).abs().max())
    return out


def test_qwen2_moe_import_sets_its_router_and_shared_expert_flags():
    """Qwen2-MoE's layout reaches loom as flags: softmax over all experts without top-k
    renormalization (norm_topk_prob false -> --moe-router-pre-softmax) and the sigmoid gate of
    its shared expert (--moe-shared-expert-gate); Mixtral sets neither."""
    models = hf_models()
    qwen, mixtral = (to_cfg(hf.config) for hf, to_cfg, _ in (models["qwen2_moe"],
                                                              models["mixtral"]))
    assert qwen.moe_router_pre_softmax and qwen.moe_shared_expert_gate
    assert not (mixtral.moe_router_pre_softmax or mixtral.moe_shared_expert_gate)


def test_moe_logits_match_transformers_single_process():
    for name, err in compare().items():
        assert err < UNIT_ATOL, (name, err)


def parallel_cases() -> dict:
    return {"ep2": compare(ep=2), "tp2": compare(tp=2)}


def test_moe_logits_match_transformers_ep2_tp2():
    for rank in run_distributed(2, parallel_cases):
        for layout, errs in rank.items():
            for name, err in errs.items():
                assert err < UNIT_ATOL, (layout, name, err)
