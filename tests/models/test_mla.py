"""Multi-latent attention, YaRN and multi-token prediction (issue 24 items 1-2), single process:
YaRN's frequencies and attention factor equal ``transformers``'; generation caching the MLA
latent equals recomputing every position; the MTP loss is the weighted mean of the shifted
predictions, trains the shared embedding and head, is logged apart and skipped in evaluation;
the flags parse from the command line and the layouts MLA / MTP cannot take are refused with
the flag named. Parallel parity: tests/parallel/test_deepseek_parity.py; HF parity:
tests/models/test_interop_deepseek.py."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from loom.config import LoomConfig, ModelConfig, add_config_arguments, config_from_args
from loom.errors import ConfigError
from loom.models import get_family, resolve_config
from loom.models.gpt.mla import MLASelfAttention, mla_softmax_scale
from loom.models.gpt.model import forward_step
from loom.models.mtp import roll_left
from loom.models.yarn import yarn_cos_sin, yarn_inv_freq
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import build_model
from testkit.config import tiny_model


def tiny(**kw) -> ModelConfig:
    return tiny_model("llama", dict(
        num_query_groups=None, multi_latent_attention=True, qk_layernorm=True, q_lora_rank=16,
        kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
        rotary_scaling_factor=4.0, mscale=0.8, mscale_all_dim=0.8,
        yarn_original_max_position_embeddings=8), kw)


@pytest.mark.parametrize("factor,mscale,all_dim,beta", [(4.0, 1.0, 1.0, (32.0, 1.0)),
                                                        (40.0, 0.707, 0.707, (16.0, 2.0))])
def test_yarn_matches_transformers(factor, mscale, all_dim, beta):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hc = transformers.DeepseekV3Config(
        qk_rope_head_dim=16, max_position_embeddings=4096 * int(factor),
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor,
                         "original_max_position_embeddings": 4096, "beta_fast": beta[0],
                         "beta_slow": beta[1], "mscale": mscale, "mscale_all_dim": all_dim})
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](hc)
    ours = yarn_inv_freq(16, 10000.0, factor, 4096, *beta)
    assert torch.allclose(ours, inv_freq, rtol=1e-6)
    cos, _ = yarn_cos_sin(torch.tensor([0]), 16, 10000.0, factor, 4096, *beta, mscale, all_dim)
    assert math.isclose(float(cos[0, 0]), attention, rel_tol=1e-6)
    cfg = tiny(rotary_scaling_factor=factor, mscale=mscale, mscale_all_dim=all_dim,
               qk_head_dim=112, qk_pos_emb_head_dim=16)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    assert math.isclose(mla_softmax_scale(cfg),
                        yarn_apply_mscale(hc.rope_parameters, 128 ** -0.5), rel_tol=1e-9)


def _model(cfg, seed=3):
    return build_model(get_family("gpt"), cfg, ParallelMesh.single(), seed=seed)


def test_generation_caches_the_latent_and_matches_recomputation():
    for cfg in (tiny(), tiny(q_lora_rank=None, rope_type="rope", qk_layernorm=False)):
        model = _model(cfg).eval()
        ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            full = model(input_ids=ids)
            cache = model.allocate_cache(2, 12)
            assert cache.keys[0].shape == (2, 1, 12, 12) and cache.values[0].shape == (2, 1, 12, 4)
            steps = [model(input_ids=ids[:, :7], cache=cache)]
            cache.length = 7
            for t in range(7, 12):
                steps.append(model(input_ids=ids[:, t:t + 1], cache=cache))
                cache.length += 1
        assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
        att = model.layers["0"].self_attention
        assert isinstance(att, MLASelfAttention)
        assert isinstance(att.kv_layernorm, torch.nn.RMSNorm) == cfg.qk_layernorm  # Megatron's


def test_mtp_loss_is_the_weighted_mean_of_shifted_predictions():
    cfg = tiny(mtp_num_layers=2, mtp_loss_scaling_factor=0.3, num_layers=1)
    model = _model(cfg)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = roll_left(ids)
    batch = {"tokens": ids, "labels": labels, "position_ids": torch.arange(16)}
    out, loss_fn = forward_step(model, batch)
    loss, metrics = loss_fn(out)
    # by hand: depth k predicts token t + 1 + k from h^{k-1} and the tokens shifted by k
    with torch.no_grad():
        x = model.final_layernorm(model.layers["0"](model.embedding(ids, torch.arange(16)),
                                                    *model.layer_inputs(torch.arange(16), None,
                                                                        {})))
        tok, lab, pos, want = ids, labels, torch.arange(16), []
        for k, layer in enumerate(model.mtp.layers):
            tok, lab, pos = roll_left(tok), roll_left(lab), roll_left(pos)
            x = layer(x, model.embedding(tok, pos), model.layer_inputs(torch.arange(16), None, {}))
            logits = F.linear(x, model.output_layer.weight).transpose(0, 1)  # [b, s, Vp]
            vp = logits.shape[-1]  # the padded columns are in the softmax (Megatron's default)
            ce = F.cross_entropy(logits[:, :15 - k].reshape(-1, vp), lab[:, :15 - k].reshape(-1))
            want.append(ce)
            assert math.isclose(float(metrics[f"mtp_{k + 1} loss"]), float(ce), rel_tol=1e-5)
    assert math.isclose(float(metrics["mtp loss"]), float(sum(want) / 2), rel_tol=1e-5)
    assert math.isclose(float(loss.detach()), float(metrics["lm loss"]) + 0.3 / 2 * float(sum(want)),
                        rel_tol=1e-5)
    loss.backward()
    assert model.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0
    model.eval()  # evaluation: the LM loss alone
    with torch.no_grad():
        out, loss_fn = forward_step(model, batch)
        ev, met = loss_fn(out)
    assert "mtp loss" not in met and math.isclose(float(ev), float(met["lm loss"]))


def test_mtp_loss_reaches_the_training_record():
    from loom.training.trainer import Trainer
    cfg = LoomConfig(model=tiny(mtp_num_layers=1))
    t = cfg.training
    t.micro_batch_size, t.lr, t.train_iters = 2, 1e-3, 2
    cfg.data.mock_data = True
    rec = Trainer(cfg.validate(1), mesh=ParallelMesh.single()).train_step()
    assert rec["mtp_loss"] > 0 and rec["loss"] > 0


def test_flags_parse_from_the_command_line():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --lr 1e-3 --train-iters 5 --position-embedding-type rope "
            "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 12 --qk-head-dim 8 "
            "--qk-pos-emb-head-dim 4 --v-head-dim 6 --rope-type yarn --rotary-scaling-factor 40 "
            "--mscale 0.9 --mscale-all-dim 0.9 --yarn-original-max-position-embeddings 8 "
            "--yarn-beta-fast 16 --yarn-beta-slow 2 --mtp-num-layers 1 "
            "--mtp-loss-scaling-factor 0.3").split()
    m = config_from_args(parser.parse_args(argv)).validate(1).model
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim,
            m.qk_pos_emb_head_dim, m.v_head_dim, m.rope_type, m.mscale, m.mscale_all_dim,
            m.yarn_original_max_position_embeddings, m.yarn_beta_fast, m.yarn_beta_slow,
            m.mtp_num_layers, m.mtp_loss_scaling_factor) == (
        True, 16, 12, 8, 4, 6, "yarn", 0.9, 0.9, 8, 16.0, 2.0, 1, 0.3)
    assert m.effective_rope_type == "yarn" and m.q_head_dim == 12
    assert tiny(rope_type=None).effective_rope_type == "yarn"  # Megatron: MLA takes yarn


def test_mla_head_dims_are_its_own():
    """h / a need not divide nor be even under MLA (its head dims are --qk-head-dim etc.)."""
    cfg = LoomConfig(model=tiny(hidden_size=36, num_attention_heads=8))
    cfg.training.micro_batch_size, cfg.training.lr, cfg.training.train_iters = 2, 1e-3, 2
    assert cfg.validate(1).model.hidden_size == 36


@pytest.mark.parametrize("change,world,flag", [
    (dict(multi_latent_attention=False, rope_type="yarn"), 1, "--rope-type yarn"),
    (dict(group_query_attention=True, num_query_groups=2), 1, "--group-query-attention"),
    (dict(position_embedding_type="yarn"), 1, "--position-embedding-type rope --rope-type yarn"),
    (dict(qk_pos_emb_head_dim=5), 1, "--qk-pos-emb-head-dim 5"),
    (dict(mtp_num_layers=1, pp=2, multi_latent_attention=False, rope_type=None,
          position_embedding_type="learned_absolute", rotary_scaling_factor=None), 2,
     "--mtp-num-layers on a later pipeline stage"),
    (dict(rope_type="rope", rotary_scaling_factor=2.0), 1,  # (without MLA: no effect, as
     "drop --rotary-scaling-factor"),                       # in Megatron)
])
def test_layouts_mla_and_mtp_cannot_take_are_refused(change, world, flag):
    change = dict(change)
    cp, pp = change.pop("cp", 1), change.pop("pp", 1)
    cfg = LoomConfig(model=tiny(**change))
    cfg.parallel.context_parallel_size, cfg.parallel.pipeline_model_parallel_size = cp, pp
    t = cfg.training
    t.micro_batch_size, t.lr, t.train_iters = 2, 1e-3, 2
    with pytest.raises(ConfigError, match=flag):
        resolve_config(cfg, world)
