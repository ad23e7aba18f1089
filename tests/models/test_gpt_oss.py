"""gpt-oss's pieces in the GPT family (Megatron-LM's flags): quick-GEGLU with a linear offset and
clamping (``--quick-geglu``, ``--glu-linear-offset``, ``--activation-func-clamp-value``),
attention sinks (``--softmax-type``), sliding-window layers (``--window-size``,
``--window-attn-skip-freq``), ``--padded-vocab-size``, ``--enable-gpt-oss`` (YaRN RoPE) and the
``--export-force-local-attention`` switch; equal to transformers' gpt_oss functions, and a
TP=2 + SP parity row with sinks, windows and biased experts active."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from loom.config import LoomConfig, ModelConfig
from loom.config.flag_table import no_effect_report
from loom.errors import ConfigError
from loom.models.activation import gated_activation
from loom.models.attention import SinkWindowAttention, sink_softmax
from loom.models.gpt.gpt_oss_ops import gpt_oss_rope
from testkit import run_distributed
from testkit.numerics import rel_err
from testkit.config import PARITY_ADAM_EPS, tiny_config, tiny_model

transformers = pytest.importorskip("transformers")
hf_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

GPT_OSS = dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
               softmax_type="learnable", window_size="3,0", window_attn_skip_freq="2",
               padded_vocab_size=128, enable_gpt_oss=True)


def tiny(**kw) -> ModelConfig:
    return tiny_model("gpt", dict(num_layers=4, num_query_groups=2, kv_channels=8,
                                  ffn_hidden_size=48, normalization="RMSNorm",
                                  untie_embeddings_and_output_weights=True,
                                  rotary_base=150000.0), GPT_OSS, **kw)


def test_quick_geglu_matches_transformers_experts_gate():
    """--quick-geglu, --glu-linear-offset 1, --activation-func-clamp-value 7 on [gate; linear]
    equal HF GptOssExperts._apply_gate on the interleaved layout (alpha 1.702, limit 7)."""
    cfg = tiny()
    act = gated_activation(cfg)
    hf_cfg = transformers.GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2)
    experts = hf_oss.GptOssExperts(hf_cfg)
    y = torch.randn(5, 12, dtype=torch.float64) * 6  # beyond the clamp on purpose
    gate, linear = y[:, 0::2], y[:, 1::2]
    ours = act(torch.cat([gate, linear], dim=-1))
    torch.testing.assert_close(ours, experts._apply_gate(y), rtol=1e-12, atol=1e-12)
    # hand reference: quick_gelu(min(g, 7)) * (clamp(l, -7, 7) + 1)
    g, lin = gate.clamp(max=7), linear.clamp(-7, 7)
    torch.testing.assert_close(ours, g * torch.sigmoid(1.702 * g) * (lin + 1.0))
    assert gated_activation(ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                        swiglu=True)) is None  # plain SwiGLU keeps its path


def test_sink_softmax_hand_reference():
    z = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    sink = torch.randn(3, dtype=torch.float64)
    e = z.exp()
    want = e / (e.sum(-1, keepdim=True) + sink.exp().reshape(1, 3, 1, 1))
    torch.testing.assert_close(sink_softmax(z, sink), want)
    off_by_one = e / (e.sum(-1, keepdim=True) + 1)  # --softmax-type off-by-one: sink 0
    torch.testing.assert_close(sink_softmax(z, torch.zeros(3, dtype=torch.float64)), off_by_one)
    torch.testing.assert_close(sink_softmax(z, None), torch.softmax(z, -1))


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one", "vanilla"])
def test_sink_window_core_matches_transformers_eager(softmax_type):
    """The core with a window of LEFT=3 (Megatron) equals HF's eager gpt_oss attention with
    sliding_window 4 (HF counts the query itself) and the same sinks."""
    from transformers.masking_utils import sliding_window_causal_mask_function
    torch.manual_seed(0)
    a, g, s, d = 4, 2, 9, 8
    core = SinkWindowAttention(0.0, a, softmax_type, window=3).double()
    sinks = torch.zeros(a, dtype=torch.float64)
    if softmax_type == "learnable":
        with torch.no_grad():
            core.softmax_offset.normal_()
        sinks = core.softmax_offset.detach()
    q, k, v = (torch.randn(2, n, s, d, dtype=torch.float64) for n in (a, g, g))
    fn = sliding_window_causal_mask_function(4)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = fn(torch.tensor(0), torch.tensor(0), i, j).expand(s, s)
    mask = torch.zeros(s, s, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    if softmax_type == "vanilla":
        want = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(d)
                             + mask, -1) @ v.repeat_interleave(2, 1)
    else:
        module = SimpleNamespace(num_key_value_groups=a // g, sinks=sinks, training=False)
        want, _ = hf_oss.eager_attention_forward(module, q, k, v, mask, d ** -0.5)
        want = want.transpose(1, 2)
    torch.testing.assert_close(core(q, k, v), want, rtol=1e-10, atol=1e-12)


def test_window_layers_follow_megatron():
    """--window-attn-skip-freq N: 1-based layer numbers divisible by N are full attention
    (Megatron's is_layer_window_attention); a list marks window layers with 1."""
    assert [tiny().is_window_layer(i) for i in range(4)] == [True, False, True, False]
    assert [tiny(window_attn_skip_freq="[0,1]*2").is_window_layer(i)
            for i in range(4)] == [False, True, False, True]
    assert all(tiny(window_attn_skip_freq=None).is_window_layer(i) for i in range(4))
    assert not tiny(window_size=None).is_window_layer(0)
    assert tiny().window == (3, 0)


def _validate(model: ModelConfig, tp: int = 1, cp: int = 1):
    return tiny_config(model=model, mock_data=False, tensor_model_parallel_size=tp,
                       context_parallel_size=cp, micro_batch_size=1, global_batch_size=2,
                       train_iters=3, world=tp * cp)


def test_config_rules_and_switches():
    resolved = _validate(tiny()).model
    assert resolved.position_embedding_type == "rope"  # --enable-gpt-oss: YaRN on RoPE
    assert resolved.padded_vocab(2) == 128 and tiny(padded_vocab_size=None).padded_vocab(2) == 256
    for bad, word in ((dict(padded_vocab_size=64), "--padded-vocab-size"),
                      (dict(window_size="3,2"), "--window-size"),
                      (dict(window_attn_skip_freq="[1,0]"), "--window-attn-skip-freq"),
                      (dict(quick_geglu=False), "--glu-linear-offset"),
                      (dict(swiglu=True), "--quick-geglu")):
        with pytest.raises(ConfigError, match=word):
            _validate(tiny(**bad))
    with pytest.raises(ConfigError, match="--padded-vocab-size 128 is not divisible"):
        _validate(tiny(num_attention_heads=6, num_query_groups=3), tp=3)
    with pytest.raises(ConfigError, match="--context-parallel-size 1"):
        _validate(tiny(), cp=2)
    report = no_effect_report({"--export-force-local-attention": True})
    assert report and "--export-force-local-attention" in report


def test_gpt_oss_yarn_matches_transformers():
    """--enable-gpt-oss's RoPE (factor 32, original context 131072, beta 32 / 1, unrounded
    correction range) equals transformers' YaRN with those parameters."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    d, base = 64, 150000.0
    hf_cfg = transformers.GptOssConfig(head_dim=d, hidden_size=128, num_attention_heads=2,
                                       rope_parameters=dict(
                                           rope_type="yarn", rope_theta=base, factor=32.0,
                                           original_max_position_embeddings=131072,
                                           beta_fast=32.0, beta_slow=1.0, truncate=False))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    pos = torch.arange(50)
    freqs = torch.outer(pos.float(), inv_freq.float())
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = gpt_oss_rope(pos, d, base)
    torch.testing.assert_close(cos, emb.cos() * factor, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sin, emb.sin() * factor, rtol=1e-5, atol=1e-6)


# -- TP=2 + SP parity: loss and every gradient equal to one rank's -------------------------------
def _parity_cfg(tp: int) -> LoomConfig:
    return tiny_config(model=tiny(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2),
                       mock_data=False, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                       global_batch_size=4, train_iters=10, adam_eps=PARITY_ADAM_EPS,
                       log_interval=10**9, world=tp)


def parity_tp2() -> dict:
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.registry import local_shard
    from loom.training.trainer import Trainer
    par_cfg = _parity_cfg(2)
    mesh = ParallelMesh.build(tp=2, dp=1)
    par = Trainer(par_cfg, mesh=mesh)
    ref = Trainer(_parity_cfg(1), mesh=ParallelMesh.single())
    chunk = par.model_chunks[0]
    cores = [layer.self_attention.core_attention for layer in chunk.layers.values()]
    out = {"loss": 0.0, "grad": 0.0, "windows": [c.window for c in cores],
           "sink_shape": [tuple(c.softmax_offset.shape) for c in cores],
           "expert_bias": any(n.endswith("experts.0.linear_fc1.bias")
                              for n, _ in chunk.named_parameters())}
    for _ in range(3):
        lp = par.global_loss(par.forward_backward(par.batches(par.train_ds,
                                                              par.consumed_samples)))
        lr_ = float(ref.forward_backward(ref.batches(ref.train_ds, ref.consumed_samples)))
        out["loss"] = max(out["loss"], abs(lp - lr_) / abs(lr_))
        ref_params = dict(ref.model_chunks[0].named_parameters())
        for name, p in chunk.named_parameters():
            want = local_shard(ref_params[name].grad, par.registry[name], mesh.tp_rank, 2)
            got = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
            err = rel_err(got.reshape(-1), want.reshape(-1))
            out["grad"] = max(out["grad"], err)
            if name.endswith("softmax_offset"):  # the sinks learn
                out["sink_grad"] = max(out.get("sink_grad", 0.0), float(got.abs().max()))
        par.optimizer_step(), ref.optimizer_step()
        par.consumed_samples += par.global_batch
        ref.consumed_samples += ref.global_batch
    return out


def world_tp2() -> dict:
    """One spawned world of 2 ranks for both TP=2 checks (parity, HF import)."""
    return {**parity_tp2(), "hf": hf_logit_error(2)}


def test_tp2_sp_parity_with_sinks_windows_and_biased_experts():
    """TP=2 + SP: loss and every gradient equal to one rank's over 3 steps; the imported HF
    model's logits at TP=2 equal transformers' (sinks and experts sharded)."""
    for r in run_distributed(2, world_tp2):
        assert r["hf"] < 1e-5, r["hf"]
        assert r["windows"] == [3, None, 3, None]  # sliding layers active, skip freq 2
        assert r["sink_shape"] == [(2,)] * 4  # a/t learnable sinks per rank
        assert r["expert_bias"] and r["sink_grad"] > 0
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5, r


# -- HF GptOssForCausalLM import: logits equal to transformers' --------------------------------
def hf_model(original_max: int = 131072):
    """A tiny GptOssForCausalLM with YaRN (``original_max``: 131072 is --enable-gpt-oss's
    value, 4096 the published checkpoints')."""
    torch.manual_seed(0)
    yarn = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                beta_slow=1.0, original_max_position_embeddings=original_max, truncate=False)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=100, hidden_size=32, intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
        rope_parameters=yarn))
    with torch.no_grad():  # sinks, biases and routing away from their init
        for p in hf.parameters():
            p.normal_(0, 0.3)
    return hf.eval()


def hf_logit_error(tp: int = 1, generation: bool = False, original_max: int = 131072,
                   cfg_of=None) -> float:
    """Largest logit difference of the imported model to transformers' at TP ``tp``; with
    ``generation``: inf unless greedy KV-cached generation (past the window) picks
    transformers' tokens. ``cfg_of``: the loom config of the HF config (default: the reader)."""
    import torch.distributed as dist

    from loom.interop.hf import load_full_state_dict
    from loom.models import get_family
    from loom.models.gpt.hf_gpt_oss import gpt_oss_config, gpt_oss_to_loom
    from loom.parallel.mappings import gather_from_tensor_parallel_region
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    hf = hf_model(original_max)
    mesh = ParallelMesh.build(tp=tp) if dist.is_initialized() else ParallelMesh.single()
    cfg = (cfg_of or gpt_oss_config)(hf.config)
    model = build_model(get_family("gpt"), cfg, mesh, seed=None).eval()
    full = gpt_oss_to_loom(hf.state_dict(), cfg)
    load_full_state_dict(model, {n: full[n] for n, _ in model.named_parameters()})
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = gather_from_tensor_parallel_region(model(ids), mesh.groups["tp"])[..., :100]
        err = float((logits - hf(ids).logits).abs().max())
        if generation:
            from loom.inference.generate import SamplingConfig, generate
            want = hf.generate(ids[:1, :6], max_new_tokens=10, do_sample=False)[0, 6:].tolist()
            got = generate(model, ids[0, :6].tolist(), 10, SamplingConfig(greedy=True))
            err = err if got == want else float("inf")
        return err


def test_hf_import_config():
    from loom.models.gpt.hf_gpt_oss import gpt_oss_config
    hf = hf_model().config
    cfg = gpt_oss_config(hf)
    assert (cfg.window_size, cfg.window_attn_skip_freq, cfg.softmax_type) == ("3,0", "2",
                                                                              "learnable")
    assert cfg.enable_gpt_oss and cfg.quick_geglu and cfg.activation_func_clamp_value == 7.0
    published = copy.deepcopy(hf)  # the released checkpoints' YaRN: original context 4096
    published.rope_parameters = {**hf.rope_parameters, "original_max_position_embeddings": 4096}
    yarn = gpt_oss_config(published)  # Megatron's generic YaRN flags, not --enable-gpt-oss
    assert not yarn.enable_gpt_oss and yarn.position_embedding_type == "yarn"
    assert yarn.yarn_args() == dict(factor=32.0, original_max=4096, beta_fast=32.0,
                                    beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0)
    assert not yarn.yarn_correction_range_round_to_int
    for bad in ({"attention_factor": 1.5}, {"truncate": True}, {"rope_type": "linear"}):
        other = copy.deepcopy(hf)
        other.rope_parameters = {**hf.rope_parameters, **bad}
        with pytest.raises(ConfigError, match="rope_parameters"):
            gpt_oss_config(other)


def test_hf_import_published_yarn_matches_transformers_and_exports_back():
    """The released checkpoints' YaRN (original context 4096, where Megatron-LM's
    --enable-gpt-oss sets 131072): imported as --position-embedding-type yarn with
    --yarn-original-max-position-embeddings 4096, logits equal to transformers'; read as
    --enable-gpt-oss instead they are not (the test can fail); exported back unchanged."""
    from dataclasses import replace

    from loom.models.gpt.hf_gpt_oss import gpt_oss_config, gpt_oss_hf_config
    assert hf_logit_error(original_max=4096) < 1e-5
    as_megatron = lambda hf: replace(gpt_oss_config(hf), enable_gpt_oss=True,  # noqa: E731
                                     position_embedding_type="rope", rotary_scaling_factor=None)
    assert hf_logit_error(original_max=4096, cfg_of=as_megatron) > 1e-3
    rope = gpt_oss_hf_config(gpt_oss_config(hf_model(4096).config))["rope_parameters"]
    assert rope == dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                        beta_slow=1.0, original_max_position_embeddings=4096, truncate=False)


def test_hf_import_logits_match_transformers():
    assert hf_logit_error(generation=True) < 1e-5
