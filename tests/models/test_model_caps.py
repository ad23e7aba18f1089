"""Issue 42's model capabilities, single process, each against a reference: YaRN as
``--position-embedding-type yarn`` of standard attention (Megatron-Core 0.16.1's
``YarnRotaryEmbedding`` and ``_apply_rotary_pos_emb_bshd``, the same code as Megatron-LM
d98e8a6), multi-latent attention with learned or no model-level positions (Megatron trains
it: its MLA keeps its own RoPE), and the refusals of what Megatron does not train. Parity rows
(TP=2, PP=2 against one rank): tests/parallel/test_model_caps_parity.py."""

from __future__ import annotations

import argparse

import pytest
import torch

from loom.config import LoomConfig, ModelConfig, add_config_arguments, config_from_args
from loom.errors import ConfigError
from loom.models import get_family, resolve_config
from loom.models.attention import apply_rope, rope_cos_sin
from loom.models.yarn import yarn_cos_sin
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import build_model
from testkit.config import tiny_config, tiny_model


def gpt(**kw) -> ModelConfig:
    return tiny_model("llama", dict(num_query_groups=None, vocab_size=128), kw)


def validated(model: ModelConfig, world: int = 1, **parallel) -> LoomConfig:
    return tiny_config(model=model, world=world,
                       **{"mock_data": False, "train_iters": 10, **parallel})


def _parse(argv: list) -> LoomConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters",
            "5", "--vocab-size", "128"]
    return config_from_args(parser.parse_args(base + argv)).validate(1)


# -- YaRN as a position-embedding type ------------------------------------------------------------

@pytest.mark.parametrize("round_to_int,factor,mscale,all_dim", [
    (True, 4.0, 1.0, 0.0), (False, 32.0, 1.0, 0.0), (True, 8.0, 0.9, 0.5)])
def test_yarn_rotation_matches_megatron_core(monkeypatch, round_to_int, factor, mscale,
                                             all_dim):
    """q, k rotated by loom's ``--position-embedding-type yarn`` equal Megatron-Core's
    GPTModel path: ``YarnRotaryEmbedding(kv_channels, ...)`` frequencies applied by
    ``_apply_rotary_pos_emb_bshd`` with the attention's concentration factor
    ``_yarn_get_concentration_factor(factor, mscale, mscale_all_dim)`` (its ``mscale``
    argument), over the whole head (YaRN ignores --rotary-percent)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as myarn
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    d, s, orig = 16, 40, 8
    ref = myarn.YarnRotaryEmbedding(d, rotary_base=500.0, use_cpu_initialization=True,
                                    scaling_factor=factor, original_max_position_embeddings=orig,
                                    beta_fast=16.0, beta_slow=2.0, mscale=mscale,
                                    mscale_all_dim=all_dim,
                                    correction_range_round_to_int=round_to_int)
    emb, m = ref.get_emb(s)
    assert m == myarn._yarn_get_concentration_factor(factor, mscale, all_dim)
    x = torch.randn(s, 2, 3, d, generator=torch.Generator().manual_seed(0))
    want = rope_utils._apply_rotary_pos_emb_bshd(x, emb, mscale=m)
    cfg = gpt(position_embedding_type="yarn", kv_channels=d, rotary_base=500.0,
              rotary_scaling_factor=factor, yarn_original_max_position_embeddings=orig,
              yarn_beta_fast=16.0, yarn_beta_slow=2.0, mscale=mscale, mscale_all_dim=all_dim,
              yarn_correction_range_round_to_int=round_to_int)
    model = build_model(get_family("gpt"), cfg, ParallelMesh.single())
    cos, sin = model.layer_inputs(torch.arange(s), None, {})[0]
    got = apply_rope(x, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    plain = apply_rope(x, *rope_cos_sin(torch.arange(s), d, 500.0))
    assert (got - plain).abs().max() > 1e-2  # YaRN changed the rotation


def test_yarn_of_factor_one_is_rope():
    """Factor 1 (Megatron's --rotary-scaling-factor default): no interpolation, attention
    factor 1: the same logits as --position-embedding-type rope."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    out = [build_model(get_family("gpt"), gpt(position_embedding_type=kind),
                       ParallelMesh.single(), seed=3)(input_ids=ids)
           for kind in ("rope", "yarn")]
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=1e-6)


def test_yarn_flags_parse_from_megatrons_command_line():
    """The gpt-oss functional test's YaRN flags (Megatron-LM d98e8a6,
    tests/functional_tests/test_cases/moe/gpt_dynamic_inference_tp2_pp2_ep2_gptoss_20b_swa)."""
    cfg = _parse(["--position-embedding-type", "yarn", "--rotary-base", "150000",
                  "--rotary-percent", "1.0", "--rotary-scaling-factor", "32.0",
                  "--yarn-original-max-position-embeddings", "4096", "--yarn-beta-fast", "32.0",
                  "--yarn-beta-slow", "1.0", "--mscale", "1.0", "--mscale-all-dim", "0.0",
                  "--no-yarn-correction-range-round-to-int"]).model
    assert cfg.position_embedding_type == "yarn" and cfg.rotary
    assert cfg.yarn_correction_range_round_to_int is False
    assert cfg.yarn_args() == dict(factor=32.0, original_max=4096, beta_fast=32.0,
                                   beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0)
    assert _parse(["--position-embedding-type", "yarn"]).model.yarn_correction_range_round_to_int


@pytest.mark.parametrize("changes,match", [
    (dict(position_embedding_type="yarn", rotary_percent=0.5), "drop --rotary-percent"),
    (dict(position_embedding_type="yarn", multi_latent_attention=True),
     "--position-embedding-type rope --rope-type yarn"),
])
def test_yarn_refusals(changes, match):
    with pytest.raises(ConfigError, match=match):
        validated(gpt(**changes))


def test_rotary_scaling_factor_without_yarn_is_megatrons_no_effect():
    """Megatron-LM reads --rotary-scaling-factor for YaRN and MLA only: on RoPE it is dropped
    (tests/unit/test_compat_flags.py: said once); MLA without YaRN, whose softmax scale
    Megatron takes from it, is refused."""
    assert validated(gpt(rotary_scaling_factor=4.0)).model.rotary_scaling_factor is None
    with pytest.raises(ConfigError, match="drop --rotary-scaling-factor"):
        validated(mla(rope_type="rope", rotary_scaling_factor=4.0))


# -- multi-latent attention without model-level RoPE ---------------------------------------------

def mla(**kw) -> ModelConfig:
    return gpt(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
               qk_pos_emb_head_dim=4, v_head_dim=6, **kw)


@pytest.mark.parametrize("positions", ["learned_absolute", "none"])
def test_mla_without_rope_keeps_its_own_rope(positions):
    """--multi-latent-attention with --position-embedding-type learned_absolute (Megatron's
    default, its gpt3_mcore_te_tp2_pp2_mla functional test) or none: Megatron-Core's GPTModel
    builds no model-level rotary embedding under MLA and the MLA layer applies its own
    (--rope-type, default yarn) to the decoupled key; learned_absolute adds the position table
    to the embedding as well. So: none gives the logits of rope; learned_absolute those of
    rope plus the table (zeroing the table gives rope's again)."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    cfg = validated(mla(position_embedding_type=positions)).model
    model = build_model(get_family("gpt"), cfg, ParallelMesh.single(), seed=5)
    rope = build_model(get_family("gpt"), validated(mla(position_embedding_type="rope")).model,
                       ParallelMesh.single(), seed=5)
    table = model.embedding.position_embeddings
    assert (table is not None) == (positions == "learned_absolute")
    assert model.layer_inputs(torch.arange(16), None, {})[0] is not None  # MLA's own RoPE
    with torch.no_grad():
        got, want = model(input_ids=ids), rope(input_ids=ids)
        if table is not None:
            assert (got - want).abs().max() > 1e-3  # the table is added
            table.weight.zero_()
            got = model(input_ids=ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- padded vocabulary in the softmax ------------------------------------------------------------

def test_padded_vocab_loss_follows_megatron_core():
    """V 250 padded to 256 (--make-vocab-size-divisible-by 128 at t 1): by default the loss
    (and its gradient) is the cross-entropy over all 256 columns, Megatron-Core's
    ``VocabParallelCrossEntropy`` arithmetic on the padded output layer (megatron-core 0.16.1:
    no column mask); ``--exclude-padded-vocab`` (loom's own flag) leaves the 6 padded columns
    out. The padded rows get a gradient only by default. The issue's numbers: 5.7224 (Megatron)
    vs 5.7009 (loom's exclusion) on its model; here the same gap on random weights."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as MCE

    from loom.models.chunk import LMHead
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 32, generator=g) * 0.5  # Megatron initializes the padded rows too
    x = torch.randn(8, 2, 32, generator=g)
    labels = torch.randint(0, 250, (2, 8), generator=g)
    logits = torch.nn.functional.linear(x, w).transpose(0, 1)  # [b, s, Vp]
    lg, mx = MCE.calculate_logits_max(logits.contiguous().clone())
    _, _, pred, sum_exp, exp = MCE.calculate_predicted_logits(lg, labels, mx, 0, 256)
    softmax, want = MCE.calculate_cross_entropy_loss(exp, pred, sum_exp)
    losses = {}
    for exclude in (False, True):
        cfg = gpt(vocab_size=250, exclude_padded_vocab=exclude)
        assert cfg.padded_vocab(1) == 256
        wg = w.clone().requires_grad_(True)
        loss = LMHead(cfg.softmax_vocab_size)(x, wg, labels)  # [b, s]
        loss.sum().backward()
        losses[exclude] = loss
        assert (wg.grad[250:].abs().sum() > 0) != exclude
        if not exclude:  # d loss / d logits = softmax - onehot over all 256 columns
            onehot = torch.nn.functional.one_hot(labels, 256).float()
            want_gw = torch.einsum("bsv,sbh->vh", softmax - onehot, x)
            torch.testing.assert_close(wg.grad, want_gw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses[False], want, rtol=1e-6, atol=1e-6)
    ce_v = torch.nn.functional.cross_entropy(logits[..., :250].reshape(-1, 250),
                                             labels.reshape(-1), reduction="none").view(2, 8)
    torch.testing.assert_close(losses[True], ce_v, rtol=1e-6, atol=1e-6)
    assert float(losses[False].detach().mean()) > float(losses[True].detach().mean()) + 1e-3


def test_padded_vocab_in_the_model_loss_evaluation_and_generation():
    """The built model's loss is the cross-entropy over its Vp logits (default) or the first V
    (--exclude-padded-vocab); generation never samples a padded id, even when the padded
    logits dominate."""
    from loom.inference.generate import SamplingConfig, generate
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    labels = torch.roll(ids, -1, 1)
    for exclude in (False, True):
        cfg = validated(gpt(vocab_size=100, make_vocab_size_divisible_by=64,
                            exclude_padded_vocab=exclude)).model
        model = build_model(get_family("gpt"), cfg, ParallelMesh.single(), seed=4)
        with torch.no_grad():
            model.output_layer.weight[100:] = model.output_layer.weight[:28] * 3  # trained-like
            logits = model(input_ids=ids)
            assert logits.shape[-1] == 128
            cols = 100 if exclude else 128
            want = torch.nn.functional.cross_entropy(
                logits[..., :cols].reshape(-1, cols), labels.reshape(-1), reduction="none")
            torch.testing.assert_close(model(input_ids=ids, labels=labels).reshape(-1), want,
                                       rtol=1e-5, atol=1e-5)
            model.output_layer.weight[100:] = 50.0 * model.final_layernorm.weight.sign()
            assert int(model(input_ids=ids)[0, -1].argmax()) >= 100  # a padded column wins
        out = generate(model, ids[0, :4].tolist(), 5, SamplingConfig(greedy=True))
        assert len(out) == 5 and max(out) < 100


# -- --apply-query-key-layer-scaling: what it changes, and why loom's attention needs none --------

def _megatron_attention(monkeypatch, flag: bool, dtype, q, k, v, layer: int = 5):
    """Megatron-Core's local ``DotProductAttention`` (layer ``layer``, causal, no dropout) on
    ``q, k, v [s, b, n, d]`` -> ``[s, b, n d]`` (its CPU path: the unfused torch softmax)."""
    import contextlib
    from types import SimpleNamespace

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker",
                        lambda: SimpleNamespace(fork=contextlib.nullcontext))
    monkeypatch.setattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    parallel_state._set_global_memory_buffer()
    cfg = TransformerConfig(num_layers=8, hidden_size=q.shape[2] * q.shape[3],
                            num_attention_heads=q.shape[2], use_cpu_initialization=True,
                            apply_query_key_layer_scaling=flag, attention_dropout=0.0,
                            masked_softmax_fusion=False, fp16=dtype == torch.float16,
                            params_dtype=dtype)
    tp = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1, rank=lambda: 0))
    att = DotProductAttention(cfg, layer, AttnMaskType.causal, "self", pg_collection=tp)
    s = q.shape[0]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]  # True: masked
    return att(q, k, v, mask), att


def _loom_attention(q, k, v):
    from loom.models.attention import DotProductAttention
    s, b = q.shape[:2]
    out = DotProductAttention()(*(x.permute(1, 2, 0, 3) for x in (q, k, v)))
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def test_query_key_layer_scaling_changes_nothing_loom_computes(monkeypatch):
    """Megatron-LM d98e8a6's --apply-query-key-layer-scaling (its local DotProductAttention):
    the fp16 score matrix ``q k^T / (sqrt(d) L)`` (L the layer number), then, in fp32 (the flag
    forces attention_softmax_in_fp32), times L, masked softmax. (s/L) L = s: in fp32 its output
    equals the unflagged one and loom's to rounding. Its purpose is fp16: scores past 65504
    overflow the unflagged score matrix (non-finite output); the flag keeps them finite but
    rounds them to fp16. loom's attention (torch SDPA) computes scores and softmax in fp32
    inside the kernel, so it is finite and exact to fp32 there: nothing for the flag to do,
    hence a no-effect switch (as in Megatron's fused / flash attention)."""
    g = torch.Generator().manual_seed(0)
    s, b, n, d = 8, 1, 2, 64
    q, k, v = (torch.randn(s, b, n, d, generator=g) for _ in range(3))
    flagged, att = _megatron_attention(monkeypatch, True, torch.float32, q, k, v)
    plain, _ = _megatron_attention(monkeypatch, False, torch.float32, q, k, v)
    assert att.scale_mask_softmax.scale == 5 and att.scale_mask_softmax.softmax_in_fp32
    assert abs(att.softmax_scale - 1 / (8 * 5)) < 1e-12
    torch.testing.assert_close(flagged, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_loom_attention(q, k, v), flagged, rtol=1e-6, atol=1e-6)
    q16, k16, v16 = (x.half() for x in (q * 250, k * 250, v))  # |scores| ~ 1e5 > 65504
    exact = _loom_attention(*(x.float() for x in (q16, k16, v16)))
    unflagged, _ = _megatron_attention(monkeypatch, False, torch.float16, q16, k16, v16)
    flagged, _ = _megatron_attention(monkeypatch, True, torch.float16, q16, k16, v16)
    ours = _loom_attention(q16, k16, v16)
    assert not torch.isfinite(unflagged).all() and torch.isfinite(flagged).all()
    assert torch.isfinite(ours).all()
    err = float((ours.float() - exact).abs().max())
    assert err <= float((flagged.float() - exact).abs().max()) and err < 1e-2, err


def test_query_key_layer_scaling_is_reported_as_no_effect():
    """A no-effect row of the flag table: accepted, named once at start, never stored."""
    from loom.config.flag_table import no_effect_report
    cfg = _parse(["--apply-query-key-layer-scaling"])
    assert cfg.megatron_no_effect == {"--apply-query-key-layer-scaling": True}
    assert "--apply-query-key-layer-scaling" in no_effect_report(cfg.megatron_no_effect)
    assert "apply_query_key_layer_scaling" not in cfg.to_flat()


# -- --moe-per-layer-logging ----------------------------------------------------------------------

def _per_layer_record(balancing: str) -> dict:
    from loom.training.trainer import Trainer
    model = gpt(num_layers=3, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                moe_layer_freq="[0,1,1]", moe_router_load_balancing_type=balancing,
                moe_aux_loss_coeff=0.0 if balancing == "sinkhorn" else 0.01,
                moe_z_loss_coeff=1e-3)
    cfg = tiny_config(model=model, global_batch_size=4, train_iters=2,
                      moe_per_layer_logging=True, world=1)
    tr = Trainer(cfg, mesh=ParallelMesh.single())
    return tr.train_step()


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss", "sinkhorn"])
def test_moe_per_layer_logging_records_each_layers_losses(balancing):
    """--moe-per-layer-logging: the step's record (the JSON log, TensorBoard ``train/<key>``,
    W&B) holds Megatron's ``moe/<loss>_layer_<i>`` for each MoE layer i (layers 1 and 2 here;
    the dense layer 0 has none): the loss without its coefficient, mean over the step's 2
    micro-batches. Times the coefficients and summed over the layers they are the record's
    ``moe_aux_loss`` / ``moe_z_loss`` (loom's totals); sinkhorn has no load-balancing loss."""
    rec = _per_layer_record(balancing)
    name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
    names = ([name[balancing]] if balancing in name else []) + ["z_loss"]
    keys = {f"moe/{n}_layer_{i}" for n in names for i in (1, 2)}
    assert keys == {k for k in rec if k.startswith("moe/")}, rec
    z = sum(rec[f"moe/z_loss_layer_{i}"] for i in (1, 2))
    assert z > 0 and abs(z * 1e-3 - rec["moe_z_loss"]) < 1e-6 * rec["moe_z_loss"]
    if balancing in name:
        aux = sum(rec[f"moe/{name[balancing]}_layer_{i}"] for i in (1, 2))
        assert abs(aux * 0.01 - rec["moe_aux_loss"]) < 1e-6 * rec["moe_aux_loss"]
        assert 1.0 <= rec[f"moe/{name[balancing]}_layer_1"] <= 4.0  # E sum f_i P_i in [1, E]


def test_moe_per_layer_logging_refused_without_experts():
    with pytest.raises(ConfigError, match="--moe-per-layer-logging"):
        _parse(["--moe-per-layer-logging"])


@pytest.mark.parametrize("changes,parallel,match", [
    (dict(qk_l2_norm_rope_layers_only=True, no_rope_freq="[0,1]"), {},
     "give --qk-l2-norm and NoPE layers"),
    (dict(qk_l2_norm=True, qk_l2_norm_rope_layers_only=True), {}, "give --qk-l2-norm and NoPE"),
    (dict(attn_temperature_floor_scale=8), {}, "this model has none"),
    (dict(attention_chunk_size=4, window_size="3,0"), {}, "not with --window-size"),
    (dict(attention_chunk_size=4, softmax_type="off-by-one"), {}, "not with --softmax-type"),
    (dict(attention_chunk_size=4), dict(context_parallel_size=2, world=2),
     "does not mask by chunk"),
])
def test_llama4_attention_refusals(changes, parallel, match):
    """What loom does not build with Llama 4's attention flags (loom/config/model_llama4.py),
    refused in one line before anything starts."""
    parallel = dict(parallel)
    world = parallel.pop("world", 1)
    with pytest.raises(ConfigError, match=match):
        validated(gpt(**changes), world, **parallel)


def test_llama4_attention_in_mla_and_other_families_is_refused():
    with pytest.raises(ConfigError, match="not with --multi-latent-attention"):
        validated(mla(attention_chunk_size=4))
    gemma = ModelConfig(model_type="gemma3", num_layers=2, hidden_size=32,
                        num_attention_heads=4, vocab_size=128, seq_length=16,
                        attention_chunk_size=4)
    with pytest.raises(ConfigError, match="--model-type gemma3 does not have: drop "
                                          "--attention-chunk-size"):
        resolve_config(tiny_config(model=gemma, train_iters=2), 1)
