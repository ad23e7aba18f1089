"""Interleaved RoPE and muP (issue 42, branch capsmath), RoPE scaling and NoPE layers, each
against a reference:

* ``--rotary-interleaved``: the rotation of q and k equals Megatron-Core 0.16.1's
  ``RotaryEmbedding(rotary_interleaved=True)`` applied by ``_apply_rotary_pos_emb_bshd`` (the
  same code as Megatron-LM d98e8a6), with and without ``--rotary-percent``; a whole model equals
  the halves-RoPE model whose query and key rows are permuted (even channels first: what the
  interleaving is); refused where Megatron refuses it.
* ``--use-mup``: Megatron-Core's GPTModel on the same weights (its ``softmax_scale`` at muP's
  1/d, the embedding and logit multipliers Megatron-LM d98e8a6 adds, as forward hooks on
  0.16.1, which predates muP) gives loom's logits, loss and every gradient within 1e-5 at TP=1
  and TP=2, and so does interleaved RoPE (one spawned 2-rank world); muP's initialization and
  optimizer groups are Megatron's rules (``TransformerConfig.__post_init__``,
  ``get_mup_config_overrides``), written out here.
* ``--use-rope-scaling``, ``--rotary-seq-len-interpolation-factor`` and ``--no-rope-freq`` (an
  int, which Megatron expands itself, and a list): Megatron-Core's GPTModel with the flag gives
  loom's logits on its weights at TP=2, in the same world, and the weights without the flag
  give others.

Parity rows (TP=2, PP=2, CP=2 against one rank): tests/parallel/test_math_caps_parity.py."""

from __future__ import annotations

import math
import os

import pytest
import torch

from loom.config import LoomConfig, ModelConfig
from loom.errors import ConfigError
from loom.models import get_family, resolve_config
from loom.models.attention import apply_rope, rope_cos_sin
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import build_model
from testkit import run_distributed
from testkit.numerics import PARITY_RTOL
from testkit.config import tiny_config, tiny_model


def llama(**kw) -> ModelConfig:
    return tiny_model("llama", dict(group_query_attention=True, ffn_hidden_size=64,
                                    vocab_size=256, max_position_embeddings=16), kw)


def validated(model: ModelConfig, world: int = 1, **training) -> LoomConfig:
    return tiny_config(model=model, world=world,
                       **{"mock_data": False, "train_iters": 10, **training})


# -- interleaved RoPE ---------------------------------------------------------------------------

@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_interleaved_rotation_matches_megatron_core(monkeypatch, percent):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    d, s = 16, 24
    ref = RotaryEmbedding(d, percent, rotary_interleaved=True, rotary_base=500,
                          use_cpu_initialization=True)
    x = torch.randn(s, 2, 3, d, generator=torch.Generator().manual_seed(0))
    want = rope_utils._apply_rotary_pos_emb_bshd(x, ref.get_emb(s), rotary_interleaved=True)
    cfg = validated(llama(kv_channels=d, rotary_base=500.0, rotary_percent=percent,
                          rotary_interleaved=True)).model
    model = build_model(get_family("gpt"), cfg, ParallelMesh.single())
    rope = model.layer_inputs(torch.arange(s), None, {})[0]
    assert len(rope) == 3 and rope[2] is True
    got = apply_rope(x, *rope)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    halves = apply_rope(x, *rope_cos_sin(torch.arange(s), int(d * percent), 500.0))
    assert (got - halves).abs().max() > 0.1  # another rotation than the default


def test_interleaved_rope_is_halves_rope_on_permuted_query_key_rows():
    """Interleaving pairs (2i, 2i+1) is halves-RoPE after the permutation that puts each head's
    even channels first: the same model with the query and key rows so permuted gives the same
    logits (q.k is unchanged by a common permutation)."""
    cfg = llama(rotary_percent=0.5)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    inter = build_model(get_family("gpt"), validated(llama(rotary_percent=0.5,
                                                          rotary_interleaved=True)).model,
                        ParallelMesh.single(), seed=4)
    halves = build_model(get_family("gpt"), validated(cfg).model, ParallelMesh.single(), seed=4)
    d, r, a, g = 8, 4, 4, 2
    order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, d)])
    with torch.no_grad():
        for layer in halves.layers.values():
            w = layer.self_attention.linear_qkv.weight
            heads = w[:(a + g) * d].view(a + g, d, -1)  # the query and key heads
            w[:(a + g) * d] = heads[:, order].reshape((a + g) * d, -1)
        got, want = halves(input_ids=ids), inter(input_ids=ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with torch.no_grad():
        plain = build_model(get_family("gpt"), validated(cfg).model, ParallelMesh.single(),
                            seed=4)(input_ids=ids)
    assert (plain - want).abs().max() > 1e-3


@pytest.mark.parametrize("changes,match", [
    (dict(multi_latent_attention=True, group_query_attention=False, num_query_groups=None,
          q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6),
     "does not work with --multi-latent-attention"),
    (dict(position_embedding_type="yarn"), "YaRN RoPE rotates halves"),
    (dict(enable_gpt_oss=True), "YaRN RoPE rotates halves"),
])
def test_interleaved_rope_refusals(changes, match):
    with pytest.raises(ConfigError, match=match):
        validated(llama(rotary_interleaved=True, **changes))


# -- muP ----------------------------------------------------------------------------------------

def test_mup_multipliers_are_megatrons():
    """Megatron's TransformerConfig.__post_init__ at d98e8a6: m = h / base; softmax scale
    sqrt(d0 or 1) / d^p; output multiplier 1/m when left at 1."""
    m = validated(llama(use_mup=True, mup_base_hidden_size=8)).model
    assert (m.width_multiplier, m.attention_softmax_scale, m.logit_multiplier) == (4.0, 1 / 8,
                                                                                  0.25)
    m = validated(llama(use_mup=True, mup_base_hidden_size=8, mup_output_mult=0.5,
                        mup_base_head_dim=4.0, mup_attn_scale_power=0.5)).model
    assert (m.attention_softmax_scale, m.logit_multiplier) == (2.0 / math.sqrt(8), 0.5)
    m = validated(llama(use_mup=True)).model  # base defaults to h: m = 1, output x 1
    assert (m.width_multiplier, m.logit_multiplier, m.embedding_multiplier) == (1.0, 1.0, 1.0)
    m = validated(llama(mup_base_hidden_size=8, mup_embedding_mult=3.0)).model  # no --use-mup
    assert (m.width_multiplier, m.attention_softmax_scale, m.embedding_multiplier) == (1.0, None,
                                                                                      1.0)


def test_mup_of_width_one_and_base_head_dim_d_is_the_standard_model():
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    out = [build_model(get_family("gpt"), validated(llama(**kw)).model, ParallelMesh.single(),
                       seed=2)(input_ids=ids)
           for kw in (dict(), dict(use_mup=True, mup_base_head_dim=8.0))]
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=1e-6)


def test_mup_initialization_is_megatrons():
    """init_method N(0, std^2 / m), output projections N(0, std^2 / (2 L m)), embeddings and the
    untied output layer N(0, std^2): each tensor equals the standard model's at the std Megatron
    gives it (weights are a function of (seed, name))."""
    mup = llama(use_mup=True, mup_base_hidden_size=8, untie_embeddings_and_output_weights=True,
                position_embedding_type="learned_absolute")
    std = llama(untie_embeddings_and_output_weights=True,
                position_embedding_type="learned_absolute")
    half = llama(untie_embeddings_and_output_weights=True,
                 position_embedding_type="learned_absolute", init_method_std=0.01)  # 0.02/sqrt(4)
    models = [dict(build_model(get_family("gpt"), validated(c).model, ParallelMesh.single(),
                               seed=7).named_parameters()) for c in (mup, std, half)]
    for name, p in models[0].items():
        kind = "embedding" in name or name == "output_layer.weight" or p.ndim < 2
        want = models[1 if kind else 2][name]
        assert torch.equal(p, want), name
    assert not torch.equal(models[0]["layers.0.mlp.linear_fc1.weight"],
                           models[1]["layers.0.mlp.linear_fc1.weight"])


def _groups(model_cfg, **training) -> dict:
    """``{parameter name: (max_lr, min_lr, eps, weight_decay)}`` of build_optimizer's groups."""
    from loom.training.optimizer import build_optimizer, build_scheduler
    cfg = validated(model_cfg, min_lr=1e-4, adam_eps=1e-6, weight_decay=0.1, **training)
    model = build_model(get_family("gpt"), cfg.model, ParallelMesh.single())
    opt = build_optimizer(model, cfg.training, model_cfg=cfg.model)
    build_scheduler(opt, cfg.training)
    out = {}
    for n, p in model.named_parameters():
        g = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
        out[n] = (g["max_lr"], g["min_lr"], g.get("eps"), g["weight_decay"])
    return out


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "muon"])
def test_mup_optimizer_groups_are_megatrons(optimizer):
    """get_mup_config_overrides at d98e8a6 with m = 4: Adam's hidden matrices (not vector-like:
    2-D and not in the embedding or the output layer) at lr / m, min_lr / m, eps / m; SGD's
    vector-like parameters at lr x m; Muon's matrices untouched (no other hidden matrix here);
    weight decay off for 1-D parameters as always."""
    got = _groups(llama(use_mup=True, mup_base_hidden_size=8,
                        untie_embeddings_and_output_weights=True), optimizer=optimizer)
    eps = 1e-6 if optimizer != "sgd" else None
    for name, (lr, low, e, wd) in got.items():
        vector = "embedding" in name or name == "output_layer.weight" or "norm" in name
        if optimizer == "adam" and not vector:
            want = (1e-3 / 4, 1e-4 / 4, eps / 4)
        elif optimizer == "sgd" and vector:
            want = (1e-3 * 4, 1e-4 * 4, None)
        else:
            want = (1e-3, 1e-4, eps)
        assert (lr, low) == pytest.approx(want[:2]) and (e is None or e == pytest.approx(want[2])), \
            (name, optimizer, (lr, low, e), want)
        assert wd == (0.0 if "norm" in name else 0.1), name


def test_mup_refused_for_other_families():
    with pytest.raises(ConfigError, match="loom implements muP for --model-type gpt"):
        validated(ModelConfig(model_type="bert", num_layers=2, hidden_size=32,
                              num_attention_heads=4, seq_length=16, vocab_size=256,
                              use_mup=True))


# -- Megatron-Core on the same weights ----------------------------------------------------------

CASES = [(kind, tp) for kind in ("interleaved", "mup") for tp in (1, 2)]


def _config(kind: str) -> ModelConfig:
    if kind == "interleaved":
        return validated(llama(rotary_interleaved=True, rotary_percent=0.5)).model
    return validated(llama(use_mup=True, mup_base_hidden_size=8, mup_embedding_mult=1.5,
                           untie_embeddings_and_output_weights=True)).model


def _case(kind: str, tp: int, tmp: str) -> dict:
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)

    from loom.checkpoint.reader import load_model_weights, open_checkpoint
    from loom.models.gpt.model import forward_step
    from loom.parallel.mappings import gather_from_tensor_parallel_region
    from testkit.megatron import (init_megatron_parallel, loom_full, megatron_full, megatron_gpt,
                                  save_megatron)
    from testkit.numerics import rel_err
    cfg = _config(kind)
    s = cfg.seq_length
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (2, s), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    init_megatron_parallel(tp=tp)
    extra = dict(softmax_scale=cfg.attention_softmax_scale) if kind == "mup" else {}
    ref = megatron_gpt(cfg, tp=tp, **extra)
    if kind == "mup":  # Megatron-LM d98e8a6's multipliers (0.16.1 has no muP)
        ref.embedding.register_forward_hook(lambda m, i, o: o * cfg.embedding_multiplier)
        ref.output_layer.register_forward_hook(
            lambda m, i, o: (o[0] * cfg.logit_multiplier, *o[1:]))
    ddp = DistributedDataParallel(ref.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), ref)
    path = os.path.join(tmp, f"{kind}_tp{tp}")
    save_megatron(ref, path)
    mesh = ParallelMesh.build(tp=tp)
    model = build_model(get_family("gpt"), cfg, mesh)
    load_model_weights(open_checkpoint(path, cfg), [model], mesh)
    group = mesh.groups["tp"]
    out = {}
    with torch.no_grad():
        want = gather_from_tensor_parallel_region(ref(tokens, torch.arange(s).expand(2, s), None),
                                                  group)
        out["logits"] = rel_err(gather_from_tensor_parallel_region(model(tokens), group), want)
        # the negative control: the same weights without the feature
        plain = dict(rotary_percent=0.5) if kind == "interleaved" else \
            dict(untie_embeddings_and_output_weights=True)
        other = build_model(get_family("gpt"), validated(llama(**plain)).model, mesh)
        load_model_weights(open_checkpoint(path, cfg), [other], mesh)
        out["without"] = rel_err(gather_from_tensor_parallel_region(other(tokens), group), want)
    ddp.zero_grad_buffer()
    ref_loss = ddp(tokens, torch.arange(s).expand(2, s), None, labels=labels).float().mean()
    ref_loss.backward()
    finalize_model_grads([ddp])
    batch = {"tokens": tokens, "labels": labels, "position_ids": torch.arange(s),
             "num_microbatches": 1}
    output, loss_fn = forward_step(model, batch)
    loss, _ = loss_fn(output)
    loss.backward()
    out["loss"] = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
    ours, theirs = loom_full(model, "grad"), megatron_full(ddp, cfg, "grad")
    out["grads"] = max(rel_err(ours[n], theirs[n]) for n in theirs)
    out["names"] = sorted(set(ours) ^ set(theirs))
    return out


# RoPE scaling and NoPE layers (tests/models/test_rope_scaling.py has their cos/sin): logits
ROPE = {"llama3": dict(use_rope_scaling=True, rope_scaling_factor=32.0),
        "interpolation": dict(rotary_seq_len_interpolation_factor=4),
        "no-rope-int": dict(no_rope_freq="2"),
        "no-rope-list": dict(no_rope_freq="[1,0,0,1]")}
ROPE_SHAPE = dict(num_layers=4, kv_channels=16, seq_length=64, max_position_embeddings=64)


def _rope_case(name: str) -> dict:
    """Megatron-Core's GPTModel with the flag (weights scaled up from the 0.02-std start:
    sharper attention, so positions matter more) against loom on its weights at TP=2, with
    and without the flag."""
    from loom.interop.hf import load_full_state_dict
    from loom.parallel.mappings import gather_from_tensor_parallel_region
    from testkit.megatron import init_megatron_parallel, megatron_full, megatron_gpt
    from testkit.numerics import rel_err
    cfg = validated(llama(**ROPE_SHAPE, **ROPE[name]), world=2,
                    tensor_model_parallel_size=2).model
    s = cfg.seq_length
    tokens = torch.randint(0, cfg.vocab_size, (2, s), generator=torch.Generator().manual_seed(3))
    init_megatron_parallel(tp=2)
    ref = megatron_gpt(cfg, tp=2).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(8.0 if p.dim() == 2 else 1.0)
    full = megatron_full(ref, cfg, "param")
    mesh = ParallelMesh.build(tp=2)
    group, out = mesh.groups["tp"], {}
    with torch.no_grad():
        want = gather_from_tensor_parallel_region(ref(tokens, torch.arange(s).expand(2, s),
                                                      None), group)
        plain = validated(llama(**ROPE_SHAPE), world=2, tensor_model_parallel_size=2).model
        for key, model_cfg in (("logits", cfg), ("without", plain)):
            model = build_model(get_family("gpt"), model_cfg, mesh).eval()
            load_full_state_dict(model, full)
            out[key] = rel_err(gather_from_tensor_parallel_region(model(tokens), group), want)
    return out


def world(tmp: str) -> dict:
    from testkit.megatron import megatron_on_cpu
    with megatron_on_cpu():
        out = {case: _case(*case, tmp) for case in CASES}
        out.update({("rope", name): _rope_case(name) for name in ROPE})
        return out


@pytest.fixture(scope="module")
def megatron_results(tmp_path_factory):
    pytest.importorskip("megatron.core")
    tmp = str(tmp_path_factory.mktemp("math_caps"))
    return run_distributed(2, world, tmp, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-tp{t}" for k, t in CASES])
def test_logits_loss_and_grads_match_megatron_core(megatron_results, case):
    for rank, res in enumerate(megatron_results):
        r = res[case]
        assert r["names"] == [], (rank, r)
        for what in ("logits", "loss", "grads"):
            assert r[what] < PARITY_RTOL, (rank, case, what, r)
        assert r["without"] > 100 * PARITY_RTOL, (rank, case, r)  # the comparison can fail


@pytest.mark.parametrize("name", sorted(ROPE))
def test_rope_scaling_and_nope_layers_match_megatron_core(megatron_results, name):
    for rank, res in enumerate(megatron_results):
        r = res[("rope", name)]
        assert r["logits"] < PARITY_RTOL, (rank, name, r)
        assert r["without"] > 100 * PARITY_RTOL, (rank, name, r)  # the flag changes the model
