"""Interop: ``DeepseekV3ForCausalLM`` <-> loom (MLA with low-rank or full queries, YaRN, the
interleaved RoPE layout, sigmoid routing with the correction bias, group-limited top-k, routed
scaling factor, dense first layer, shared expert): random weights from small configs (no
download), logits within 1e-5 of ``transformers`` on one rank, at TP=2 and at EP=2, and greedy
generation caching the MLA latent picks ``transformers``' tokens there too; export
writes a checkpoint ``transformers`` loads to the same logits; MTP depths survive a round trip
in DeepSeek-V3's checkpoint layout."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loom.interop.hf import load_full_state_dict  # noqa: E402
from loom.models.gpt.hf_deepseek import (deepseek_v3_config, deepseek_v3_to_loom,  # noqa: E402
                                         hf_config, loom_to_deepseek_v3, to_loom)
from testkit import run_distributed  # noqa: E402
from testkit.numerics import UNIT_ATOL


def hf_models() -> dict:
    torch.manual_seed(0)
    common = dict(vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, n_shared_experts=1,
                  n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=12,
                  qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, n_group=4, topk_group=2,
                  num_experts_per_tok=4, first_k_dense_replace=1, max_position_embeddings=64)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
            "original_max_position_embeddings": 16, "beta_slow": 1.0, "mscale": 0.9,
            "mscale_all_dim": 0.9}
    out = {"yarn_q_lora": transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
               q_lora_rank=16, rope_parameters=yarn, **common)),
           "rope_full_q": transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
               q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
               tie_word_embeddings=True, **common))}
    with torch.no_grad():  # routing and bias away from their zero init
        for hf in out.values():
            for name, p in hf.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0, 0.5)
            for name, b in hf.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.1)
    return {k: v.eval() for k, v in out.items()}


def loom_model(hf, mesh):
    """The loom model imported from ``hf`` on ``mesh`` (eval mode)."""
    from loom.models import get_family
    from loom.parallel.parallelize import build_model
    cfg = deepseek_v3_config(hf.config)
    model = build_model(get_family("gpt"), cfg, mesh, seed=None).eval()
    full = deepseek_v3_to_loom(hf.state_dict(), cfg, hf.config.rope_interleave)
    load_full_state_dict(model, {n: full[n] for n, _ in model.named_parameters()})
    return model


def compare(tp: int = 1, ep: int = 1) -> dict:
    """Largest logit difference to ``transformers`` per model, at TP ``tp`` x EP ``ep``; and
    whether greedy generation with loom's latent cache picks ``transformers``' tokens."""
    import torch.distributed as dist

    from loom.inference.generate import SamplingConfig, generate
    from loom.parallel.mappings import gather_from_tensor_parallel_region
    from loom.parallel.mesh import ParallelMesh
    mesh = ParallelMesh.build(tp=tp, ep=ep) if dist.is_initialized() else ParallelMesh.single()
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, hf in hf_models().items():
        model = loom_model(hf, mesh)
        with torch.no_grad():
            logits = gather_from_tensor_parallel_region(model(ids), mesh.groups["tp"])[..., :100]
            out[name] = float((logits - hf(ids).logits).abs().max())
            want = hf.generate(ids[:1, :10], max_new_tokens=6, do_sample=False)[0, 10:].tolist()
        got = generate(model, ids[0, :10].tolist(), 6, SamplingConfig(greedy=True))
        out[name + " generation"] = 0.0 if got == want else float("inf")
    return out


def test_config_maps_deepseek_v3_onto_megatrons_flags():
    cfg = deepseek_v3_config(hf_models()["yarn_q_lora"].config)
    assert cfg.multi_latent_attention and cfg.effective_rope_type == "yarn"
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim,
            cfg.v_head_dim) == (16, 12, 8, 4, 6)
    assert (cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim,
            cfg.yarn_original_max_position_embeddings) == (4.0, 0.9, 0.9, 16)
    assert cfg.moe_layer_freq == "([0]*1+[1]*2)" and not cfg.is_moe_layer(0)
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk,
            cfg.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert cfg.moe_router_enable_expert_bias and cfg.moe_router_score_function == "sigmoid"


def parallel_cases() -> dict:
    return {"tp2": compare(tp=2), "ep2": compare(ep=2)}


@pytest.mark.parametrize("world", [1, 2])
def test_logits_match_transformers(world):
    """One rank, then TP=2 and EP=2 in one spawned 2-rank world."""
    ranks = [{"single": compare()}] if world == 1 else run_distributed(2, parallel_cases)
    bad = [(layout, name, err) for rank in ranks for layout, errs in rank.items()
           for name, err in errs.items() if not err < UNIT_ATOL]
    assert not bad, bad


def test_export_loads_into_transformers_and_mtp_round_trips():
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    hf = hf_models()["yarn_q_lora"]
    cfg = deepseek_v3_config(hf.config)
    cfg.mtp_num_layers = 1
    model = build_model(get_family("gpt"), cfg, ParallelMesh.single(), seed=7).eval()
    full = {n: p.detach() for n, p in model.named_parameters()}
    exported = loom_to_deepseek_v3(full, cfg, fused=True)
    config = hf_config(cfg)
    back = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{k: v for k, v in config.items() if k not in ("architectures", "model_type")})).eval()
    missing, unexpected = back.load_state_dict(exported, strict=False)
    assert not missing and all(k.startswith("model.layers.3.") for k in unexpected)
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert float((back(ids).logits - model(ids)[..., :100]).abs().max()) < UNIT_ATOL
    for fused in (True, False):  # in-memory and checkpoint (per-expert) layouts read back
        cfg2, full2 = to_loom(config, loom_to_deepseek_v3(full, cfg, fused), "export")
        assert cfg2.mtp_num_layers == 1 and set(full2) == set(full)
        for name, tensor in full2.items():
            assert torch.equal(tensor, full[name][:100] if "word_emb" in name or "output_layer"
                               in name else full[name]), name
