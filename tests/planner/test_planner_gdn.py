"""Qwen3-Next's layers in the planner (loom/planner/gdn.py): Gated DeltaNet layers and the
attention output gate are counted as loom builds them and as Megatron-LM counts their FLOPs;
a published config counts as published."""

from __future__ import annotations

import pytest
import torch

from loom.config import ModelConfig
from loom.planner.flops import forward_flops_per_token
from loom.planner.gdn import gdn_flops_per_token, gdn_params
from loom.planner.memory import total_params

QWEN3_NEXT = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  kv_channels=8, vocab_size=96, seq_length=16, ffn_hidden_size=40,
                  attention_output_gate=True, qk_layernorm=True, apply_layernorm_1p=True,
                  experimental_attention_variant="gdn", linear_attention_freq="[1, 0, 1, 0]",
                  linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
                  linear_num_key_heads=2, linear_num_value_heads=4)


def _count_built(cfg: ModelConfig) -> int:
    from loom.models import get_family
    from loom.models.family import StageSpec
    with torch.device("meta"):
        model = get_family("gpt").build(cfg, StageSpec(tuple(range(cfg.num_layers)), True, True,
                                                       cfg.vocab_size))
    return sum(p.numel() for n, p in model.named_parameters() if not n.endswith("expert_bias"))


@pytest.mark.parametrize("kw", [{}, dict(num_experts=4, moe_router_topk=2,
                                         moe_ffn_hidden_size=16,
                                         moe_shared_expert_intermediate_size=24,
                                         moe_shared_expert_gate=True),
                                dict(linear_attention_freq=None, experimental_attention_variant=None)])
def test_planner_counts_what_loom_builds(kw):
    """Gated DeltaNet layers (half of them), the output gate and the Q/K norms: the planner's
    parameter count is the built model's, with MoE and without Gated DeltaNet too."""
    cfg = ModelConfig.llama(**{**QWEN3_NEXT, **kw})
    assert total_params(cfg) == _count_built(cfg)


def test_gdn_flops_are_megatrons():
    """Megatron-LM d98e8a6 ``training.py``'s ``gdn_layer_flops`` per token, written out:
    ``2 (h (2 qk + 2 v + 2 nv) + K (2 qk + v) + 4 nv dv^2 + h v)``; the model's forward FLOPs
    weigh the two kinds of layer by their count (the gate's ``2 h a d`` on the standard ones)."""
    cfg = ModelConfig.llama(**QWEN3_NEXT)
    h, K, nk, dk, nv, dv = 32, 4, 2, 8, 4, 6
    qk, v = nk * dk, nv * dv
    gdn = 2 * (h * (2 * qk + 2 * v + 2 * nv) + K * (2 * qk + v) + 4 * nv * dv ** 2 + h * v)
    assert gdn_flops_per_token(cfg) == gdn
    a, g, d, s, f, V = 4, 2, 8, 16, 40, 96
    standard = 2 * h * (a * d + 2 * g * d) + 2 * a * d * h + 2 * h * a * d + 4 * s * a * d
    mlp = 6 * h * f
    assert forward_flops_per_token(cfg) == pytest.approx(
        2 * (gdn + mlp) + 2 * (standard + mlp) + 2 * h * V, rel=1e-12)


def test_gdn_projection_flops_are_what_torch_counts():
    """The projections' share of :func:`gdn_flops_per_token` equals ``torch.utils.flop_counter``'s
    count of loom's GatedDeltaNet forward (its ``mm``), and its convolution Megatron's
    ``2 K (2 qk + v)`` per token up to the ``K - 1`` padded positions; the delta rule's
    ``4 nv dv^2`` is Megatron's convention for the chunked kernel (loom's runs in float64
    ``bmm``s); the parameters are the layer's."""
    from torch.utils.flop_counter import FlopCounterMode
    from loom.models.gpt.gdn import GatedDeltaNet
    cfg = ModelConfig.llama(**QWEN3_NEXT)
    layer = GatedDeltaNet(cfg, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    s, b = 16, 2
    x = torch.randn(s, b, 32)
    with FlopCounterMode(display=False) as counter:
        layer(x)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    h, K, nk, dk, nv, dv = 32, 4, 2, 8, 4, 6
    qk, v = nk * dk, nv * dv
    assert counts["aten.mm"] == 2 * s * b * (h * (2 * qk + 2 * v + 2 * nv) + h * v)
    # the causal convolution runs over the s + K - 1 positions of its left-padded input
    assert counts["aten.convolution"] == 2 * b * (s + K - 1) * K * (2 * qk + v)
    sh, rep = gdn_params(cfg)
    assert sh + rep == sum(p.numel() for p in layer.parameters())


def test_qwen3_next_80b_counts_as_published():
    """Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults are its config.json): 80B
    total, 3B activated (Qwen's model card), counted from the config with no fit: within 1%
    (the MTP layer left out, as the import does), activated without the embedding and output
    layer within 10%."""
    transformers = pytest.importorskip("transformers")
    from loom.models.gpt.hf import read_config
    hf = transformers.Qwen3NextConfig().to_dict()
    cfg = read_config(hf, "config.json")
    assert total_params(cfg) == pytest.approx(80e9, rel=0.01)
    embeddings = 2 * hf["vocab_size"] * hf["hidden_size"]
    assert total_params(cfg, active=True) - embeddings == pytest.approx(3e9, rel=0.10)


@pytest.mark.parametrize("kw", [dict(), dict(gemma_qk_norm=False),
                                dict(gemma_qk_norm=False, gemma_post_norms=False)],
                         ids=["gemma3", "gemma2", "gemma1"])
def test_planner_counts_what_loom_builds_for_gemma(kw):
    """The gemma3 family (Gemma 3 / 2 / 1 layers): its GeGLU MLP is gated (it was counted as
    a plain one: Gemma 7B came out at 6.42B, not its 8.54B), its four norms a layer (two
    without post-norms) and Q/K norms counted as loom builds them."""
    from loom.models import get_family
    from loom.models.family import StageSpec
    from testkit.config import tiny_config
    cfg = tiny_config("gpt", model_type="gemma3", num_layers=2, hidden_size=32,
                      num_attention_heads=4, layer_types="GL", sliding_window=4,
                      num_query_groups=2, kv_channels=12, ffn_hidden_size=40, vocab_size=96,
                      seq_length=16, world=1, **kw).model  # the family fixes its layout
    with torch.device("meta"):
        model = get_family("gemma3").build(cfg, StageSpec((0, 1), True, True, cfg.vocab_size))
    assert total_params(cfg) == sum(p.numel() for p in model.parameters())
