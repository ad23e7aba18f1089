"""Qwen3-Next's attention in the GPT family (Megatron-LM's flags): the gated attention output
(``--attention-output-gate``) and Gated DeltaNet layers (``--experimental-attention-variant
gdn`` / ``gated_delta_net``, ``--linear-attention-freq``, ``--linear-*``). Equal to transformers'
Qwen3-Next modules with the same weights, the delta rule to its torch fallbacks; the TP=2 + SP
parity rows: tests/parallel/test_qwen3_next_parity.py."""

from __future__ import annotations

import pytest
import torch

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.attention import SelfAttention
from loom.models.gpt.gdn import GatedDeltaNet, gated_delta_rule, l2_normalize

hf_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig  # noqa: E402
from testkit.config import tiny_config, tiny_model

GDN = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq="2",
           linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=6,
           linear_num_key_heads=2, linear_num_value_heads=4)


def tiny(**kw) -> ModelConfig:
    return tiny_model("gpt", dict(
        num_layers=4, num_query_groups=2, group_query_attention=True, kv_channels=8,
        ffn_hidden_size=48, padded_vocab_size=128, normalization="RMSNorm", swiglu=True,
        disable_bias_linear=True, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, attention_output_gate=True), kw)


def hf_cfg(m: ModelConfig) -> Qwen3NextConfig:
    cfg = Qwen3NextConfig(
        hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_kv_groups, head_dim=m.head_dim, rms_norm_eps=m.norm_epsilon,
        linear_conv_kernel_dim=m.linear_conv_kernel_dim,
        linear_key_head_dim=m.linear_key_head_dim, linear_value_head_dim=m.linear_value_head_dim,
        linear_num_key_heads=m.linear_num_key_heads,
        linear_num_value_heads=m.linear_num_value_heads, num_hidden_layers=m.num_layers,
        rope_parameters=dict(rope_type="default", rope_theta=m.rotary_base,
                             partial_rotary_factor=1.0))
    cfg._attn_implementation = "sdpa"  # causal without a mask
    return cfg


def test_gated_attention_matches_transformers():
    """loom's SelfAttention with the output gate (and QK RMSNorm, as Qwen3-Next has) equals
    Qwen3NextAttention: HF's q_proj holds each head's query then gate rows, loom's fused
    projection ``[Q; G; K; V]``; HF's zero-centred norm weight w is loom's 1 + w."""
    torch.manual_seed(0)
    m = tiny(qk_layernorm=True)
    hf = hf_next.Qwen3NextAttention(hf_cfg(m), layer_idx=1).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    loom = SelfAttention(m, 1).eval()
    a, d = m.num_attention_heads, m.head_dim
    qg = hf.q_proj.weight.view(a, 2, d, -1)
    with torch.no_grad():
        loom.linear_qkv.weight.copy_(torch.cat([qg[:, 0].reshape(a * d, -1),
                                                qg[:, 1].reshape(a * d, -1),
                                                hf.k_proj.weight, hf.v_proj.weight]))
        loom.linear_proj.weight.copy_(hf.o_proj.weight)
        loom.q_layernorm.weight.copy_(1 + hf.q_norm.weight)
        loom.k_layernorm.weight.copy_(1 + hf.k_norm.weight)
    x = torch.randn(2, 7, m.hidden_size)
    pos = torch.arange(7)[None]
    cos, sin = hf_next.Qwen3NextRotaryEmbedding(hf_cfg(m))(x, pos)
    want, _ = hf(x, (cos, sin), None)
    got = loom(x.transpose(0, 1), (cos[0], sin[0])).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ungated = SelfAttention(tiny(qk_layernorm=True, attention_output_gate=False), 1)
    assert ungated.linear_qkv.weight.shape[0] == loom.linear_qkv.weight.shape[0] - a * d


def _token_by_token(q, k, v, g, beta):
    """The recurrence as written (the test's own reference)."""
    state = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(out, 1)


@pytest.mark.parametrize("chunk", [64, 4, 5])
def test_delta_rule_matches_transformers_fallbacks(chunk):
    """loom's chunked gated delta rule (one chunk, or several with padding) equals the
    token-by-token recurrence and transformers' recurrent and chunked torch fallbacks (GQA-style
    value heads, L2-normalized queries and keys), gradients included."""
    torch.manual_seed(1)
    b, s, h, dk, dv = 2, 11, 3, 5, 4
    q, k = (l2_normalize(torch.randn(b, s, h, dk)) for _ in "qk")
    v = torch.randn(b, s, h, dv)
    g = -torch.rand(b, s, h) * 2
    beta = torch.rand(b, s, h)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    got = gated_delta_rule(q * dk ** -0.5, k, v, g, beta, chunk_size=chunk)
    mine = _token_by_token(q * dk ** -0.5, k, v, g, beta)
    torch.testing.assert_close(got, mine, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), leaves)
    for want_g, got_g in zip(torch.autograd.grad(mine.square().sum(), leaves), grads):
        torch.testing.assert_close(got_g, want_g, rtol=1e-5, atol=1e-6)
    for ref in (hf_next.torch_recurrent_gated_delta_rule, hf_next.torch_chunk_gated_delta_rule):
        want, _ = ref(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=False,
                      **({"chunk_size": 4} if "chunk" in ref.__name__ else {}))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gated_delta_net_matches_transformers():
    """A whole Gated DeltaNet layer equals Qwen3NextGatedDeltaNet with the same weights: HF
    groups its projection rows per key head (``[q_j, k_j, v_j.., z_j..]`` and ``[b_j.., a_j..]``),
    loom (like Megatron) holds the blocks ``[Q; K; V; Z; beta; alpha]``."""
    torch.manual_seed(2)
    m = tiny(**GDN)
    hf = hf_next.Qwen3NextGatedDeltaNet(hf_cfg(m), layer_idx=0).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    loom = GatedDeltaNet(m, 0).eval()
    nk, nv, dk, dv = (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim,
                      m.linear_value_head_dim)
    r, h = nv // nk, m.hidden_size
    qkvz = hf.in_proj_qkvz.weight.view(nk, 2 * dk + 2 * r * dv, h)
    q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
    ba = hf.in_proj_ba.weight.view(nk, 2 * r, h)
    with torch.no_grad():
        loom.in_proj.weight.copy_(torch.cat([t.reshape(-1, h) for t in
                                             (q, k, v, z, ba[:, :r], ba[:, r:])]))
        loom.conv1d.weight.copy_(hf.conv1d.weight)
        loom.A_log.copy_(hf.A_log)
        loom.dt_bias.copy_(hf.dt_bias)
        loom.out_norm.weight.copy_(hf.norm.weight)
        loom.out_proj.weight.copy_(hf.out_proj.weight)
    x = torch.randn(2, 9, h)
    want = hf(x)
    got = loom(x.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _validate(model: ModelConfig, tp: int = 1, cp: int = 1):
    return tiny_config(model=model, mock_data=False, tensor_model_parallel_size=tp,
                       context_parallel_size=cp, micro_batch_size=1, global_batch_size=2,
                       train_iters=3, world=tp * cp)


def test_layer_pattern_and_config_rules():
    """Megatron's pattern (``--linear-attention-freq 3``: layers 1, 2 GDN, 3 attention, ...;
    a list: 1 for GDN) and the refusals, each naming its flag."""
    m = tiny(**{**GDN, "num_layers": 6, "linear_attention_freq": "3"})
    assert [m.is_gdn_layer(i) for i in range(6)] == [True, True, False, True, True, False]
    m = tiny(**{**GDN, "linear_attention_freq": "[0,1,1,0]"})
    assert [m.is_gdn_layer(i) for i in range(4)] == [False, True, True, False]
    assert not tiny().is_gdn_layer(0)
    _validate(tiny(**GDN), tp=2)
    for bad, word in ((dict(linear_attention_freq=None), "--linear-attention-freq"),
                      (dict(linear_attention_freq="[1,0]"), "--linear-attention-freq"),
                      (dict(linear_num_value_heads=3), "--linear-num-value-heads"),
                      (dict(swiglu=False), "--swiglu"),
                      (dict(experimental_attention_variant="gdn2"), "gdn2")):
        with pytest.raises(ConfigError, match=word):
            _validate(tiny(**{**GDN, **bad}))
    with pytest.raises(ConfigError, match="--linear-num-key-heads 2 must be a multiple"):
        _validate(tiny(**GDN, num_query_groups=4), tp=4)
    with pytest.raises(ConfigError, match="--context-parallel-size 1"):
        _validate(tiny(**GDN), cp=2)
    with pytest.raises(ConfigError, match="--apply-wd-to-qk-layernorm with --apply-layernorm-1p"):
        _validate(tiny(qk_layernorm=True, apply_wd_to_qk_layernorm=True, apply_layernorm_1p=True))
    with pytest.raises(ConfigError, match="--experimental-attention-variant gdn"):
        _validate(tiny(linear_attention_freq="2"))


def test_muon_splits_the_gated_qkv_in_four():
    """--optimizer muon (--muon-split-qkv): the gated fused projection is orthogonalized per
    block [Q; G; K; V], as Megatron's split shapes [q, gate, k, v] with the output gate."""
    from types import SimpleNamespace

    from loom.parallel.registry import ShardSpec
    from loom.training.muon import matrix_info
    segs = (32, 32, 16, 16)
    meta = SimpleNamespace(shard=ShardSpec(0, segs))
    assert matrix_info("layers.0.self_attention.linear_qkv.weight", meta, None).qkv == segs
