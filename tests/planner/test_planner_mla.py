"""Planner terms of multi-latent attention and multi-token prediction (loom/planner/mla.py):
DeepSeek-V3's published parameter counts, the parameters of built loom models, FLOPs by hand,
the MTP modules on the last pipeline stage, MLA's activations and CP traffic."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loom.config import ModelConfig
from loom.planner import flops as F
from loom.planner.memory import activation_bytes_per_layer, stage_params, total_params
from loom.planner.mla import mla_attention_params
from loom.planner.presets import get_preset
from loom.planner.layout import make_layouts


def test_deepseek_v3_parameter_counts_match_published():
    """671B total, 37B activated (DeepSeek-V3 report, table 1 / sec 4.2); deepseek-ai/DeepSeek-V3
    README_WEIGHTS.md: 36.6B activated counting the output head but not the embedding lookup,
    the MTP module 11.5B unique parameters (embedding and head shared)."""
    m = get_preset("deepseek-v3")
    assert m.multi_latent_attention and m.q_lora_rank == 1536 and not m.mtp_num_layers
    assert mla_attention_params(m) == (128 * 192 * 1536 + 512 * 128 * 256 + 128 * 128 * 7168,
                                       7168 * 1536 + 1536 + 7168 * 576 + 512)  # 187.1M
    total, active = total_params(m), total_params(m, active=True)
    assert total == pytest.approx(671e9, rel=0.01)
    assert active - 129280 * 7168 == pytest.approx(36.6e9, rel=0.01)  # without the embedding
    assert active == pytest.approx(37e9, rel=0.02)
    mtp = dataclasses.replace(m, mtp_num_layers=1)
    assert total_params(mtp) - total == pytest.approx(11.5e9, rel=0.01)


def test_deepseek_v2_lite_parameter_counts_match_published():
    """15.7B total, 2.4B activated (DeepSeek-V2 report, appendix B)."""
    m = get_preset("deepseek-v2-lite")
    assert m.multi_latent_attention and m.q_lora_rank is None and not m.is_moe_layer(0)
    assert total_params(m) == pytest.approx(15.7e9, rel=0.01)
    assert total_params(m, active=True) - 102400 * 2048 == pytest.approx(2.4e9, rel=0.03)


def test_deepseek_v2_lite_preset_is_its_config_json():
    """The preset is what ``loom plan --from-hf`` reads from deepseek-ai/DeepSeek-V2-Lite's
    ``config.json`` (its fields as published), but for the 4096-token training length: the
    same shape, router (softmax over all experts, top 6 unnormalized, sequence-wise balance
    loss 0.001) and YaRN."""
    from loom.models.gpt.hf import read_config
    hf = {"architectures": ["DeepseekV2ForCausalLM"], "aux_loss_alpha": 0.001,
          "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
          "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
          "model_type": "deepseek_v2", "moe_intermediate_size": 1408, "moe_layer_freq": 1,
          "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
          "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
          "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                           "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                           "type": "yarn"},
          "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
          "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
          "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400}
    read, preset = read_config(hf, "config.json"), get_preset("deepseek-v2-lite")
    skip = {"seq_length", "max_position_embeddings", "num_query_groups",
            "exclude_padded_vocab", "yarn_beta_fast", "yarn_beta_slow"}  # (defaults alike)
    differ = {f.name: (getattr(preset, f.name), getattr(read, f.name))
              for f in dataclasses.fields(ModelConfig) if f.name not in skip
              and getattr(preset, f.name) != getattr(read, f.name)}
    assert not differ, differ
    assert total_params(read) == total_params(preset)


def _count_built(cfg: ModelConfig) -> int:
    from loom.models import get_family
    from loom.models.family import StageSpec
    with torch.device("meta"):
        model = get_family("gpt").build(cfg, StageSpec(tuple(range(cfg.num_layers)), True, True,
                                                       cfg.vocab_size))
    return sum(p.numel() for n, p in model.named_parameters() if not n.endswith("expert_bias"))


@pytest.mark.parametrize("kw", [dict(), dict(q_lora_rank=None, mtp_num_layers=2,
                                             qk_layernorm=True),
                                dict(num_experts=4, moe_ffn_hidden_size=16, mtp_num_layers=1,
                                     moe_shared_expert_intermediate_size=16,
                                     moe_layer_freq="([0]*1+[1]*2)"),
                                dict(experimental_attention_variant="dsa",  # + the indexer
                                     disable_bias_linear=True, dsa_indexer_n_heads=4,
                                     dsa_indexer_head_dim=8, dsa_indexer_topk=4)])
def test_planner_counts_what_loom_builds(kw):
    cfg = ModelConfig.llama(**{**dict(
        num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=96, seq_length=16,
        ffn_hidden_size=48, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12,
        qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6), **kw})
    assert total_params(cfg) == _count_built(cfg)


def test_mla_and_mtp_flops_by_hand():
    h, a, q, r, dn, dr, dv, f, V, s, L = 32, 4, 16, 12, 8, 4, 6, 48, 96, 16, 3
    cfg = ModelConfig.llama(num_layers=L, hidden_size=h, num_attention_heads=a, vocab_size=V,
                            seq_length=s, ffn_hidden_size=f, multi_latent_attention=True,
                            q_lora_rank=q, kv_lora_rank=r, qk_head_dim=dn,
                            qk_pos_emb_head_dim=dr, v_head_dim=dv)
    attn = 2 * (h * q + q * a * (dn + dr) + h * (r + dr) + r * a * (dn + dv) + a * dv * h) \
        + 2 * s * a * (dn + dr) + 2 * s * a * dv
    layer = attn + 6 * h * f
    assert F.forward_flops_per_token(cfg) == L * layer + 2 * h * V
    mtp = dataclasses.replace(cfg, mtp_num_layers=2)
    assert F.forward_flops_per_token(mtp) == (L + 2) * layer + 2 * h * V + 2 * (4 * h * h
                                                                              + 2 * h * V)
    sel = F.hardware_flops_per_iteration(cfg, 2, "selective") - F.model_flops_per_iteration(cfg, 2)
    assert sel == (2 * s * a * (dn + dr) + 2 * s * a * dv) * L * 2 * s


def test_mtp_sits_on_the_last_stage():
    ds = get_preset("deepseek-v3")
    lay = make_layouts(dict(pp=16, dp=8, ep=8, lf=2, ll=3))
    base = stage_params(ds, lay, 4096)
    mtp = stage_params(dataclasses.replace(ds, mtp_num_layers=1), lay, 4096)
    experts = 256 * 3 * 7168 * 2048 / 8
    assert float(mtp["first"][0]) == float(base["first"][0])
    assert float(mtp["expert_last"][0] - base["expert_last"][0]) == experts
    # the MTP layer, eh_proj, 3 norms and the embedding copy (untied) on the last stage
    extra = float(mtp["last"][0] - base["last"][0])
    assert extra > experts + 2 * 7168 ** 2 + 129280 * 7168


def test_mla_activations_and_model_with_mla_layers():
    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=96, seq_length=32,
              hidden_dropout=0.0, attention_dropout=0.0)
    mha = ModelConfig.llama(**kw)
    mla = ModelConfig.llama(multi_latent_attention=True, kv_lora_rank=8, qk_head_dim=16,
                            qk_pos_emb_head_dim=8, v_head_dim=16, **kw)
    lay = make_layouts(dict(tp=1, mbs=1))
    S = 32
    a_mha = activation_bytes_per_layer(mha, 32, lay)["none"]
    a_mla = activation_bytes_per_layer(mla, 32, lay)["none"]
    # MLA: Q and K of width 24 instead of 16, latents 2 S (2 r + dr) replicated
    diff = S * (2 * 4 * 24 * 2 + 2 * 4 * 16 * 2) - S * (2 * 64 + 4 * 64 + 2 * 64) \
        + 2 * S * (2 * 8 + 8)
    assert float(a_mla[0] - a_mha[0]) == pytest.approx(diff)
