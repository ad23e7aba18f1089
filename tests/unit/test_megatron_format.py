"""loom's reading and writing of Megatron's checkpoint layout, without Megatron-Core (the
reference tests are tests/models/test_megatron_reference.py and
tests/integration/test_megatron_checkpoint.py): the QKV interleave in Megatron-Core's order,
loom -> Megatron ``torch_dist`` -> loom bit-equal for the families Megatron-Core cannot build on
this CPU (MLA with the local spec of 0.16.1, Mamba / hybrid without ``mamba_ssm``) and MoE with
dense layers, under Megatron-Core's key names; zero-centred norm gains; which directory is
Megatron's; Megatron's pickles read without Megatron."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import sys
import types

import pytest
import torch

from loom.checkpoint.megatron import layout
from loom.checkpoint.megatron.locate import diagnose, locate
from loom.config import ModelConfig
from loom.errors import ConfigError

TINY = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
            vocab_size=128, seq_length=8, max_position_embeddings=8, hidden_dropout=0.0,
            attention_dropout=0.0)
FAMILIES = {
    "mla": ("gpt", ModelConfig.llama(**TINY, multi_latent_attention=True, q_lora_rank=16,
                                     kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
                                     v_head_dim=8, qk_layernorm=True),
            ["decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight",
             "decoder.layers.self_attention.q_layernorm.weight",  # the local spec's spelling
             "decoder.layers.self_attention.linear_kv_down_proj.weight",
             "decoder.layers.input_layernorm.weight"]),
    "dsa": ("gpt", ModelConfig.llama(**TINY, multi_latent_attention=True, q_lora_rank=16,
                                     kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
                                     v_head_dim=8, qk_layernorm=True, disable_bias_linear=True,
                                     experimental_attention_variant="dsa",
                                     dsa_indexer_n_heads=2, dsa_indexer_head_dim=8,
                                     dsa_indexer_topk=4),
            # Megatron-Core's DSAttention is MLA's core_attention; its DSAIndexer's modules
            ["decoder.layers.self_attention.core_attention.indexer.linear_wq_b.weight",
             "decoder.layers.self_attention.core_attention.indexer.linear_wk.weight",
             "decoder.layers.self_attention.core_attention.indexer.k_norm.weight",
             "decoder.layers.self_attention.core_attention.indexer.k_norm.bias",
             "decoder.layers.self_attention.core_attention.indexer.linear_weights_proj.weight",
             "decoder.layers.self_attention.q_layernorm.weight"]),
    "moe": ("gpt", ModelConfig.llama(**TINY, num_query_groups=2, num_experts=4,
                                     moe_router_topk=2, moe_layer_freq="[0,1,1,1]",
                                     moe_shared_expert_intermediate_size=32,
                                     moe_router_enable_expert_bias=True,
                                     moe_router_score_function="sigmoid"),
            # a list --moe-layer-freq makes Megatron-Core's TransformerBlock key every layer on
            # its own (non_homogeneous_layers), dense and MoE alike; experts [E, ...] per layer
            # (Megatron-Core 0.16.1's own keys: tests/models/test_megatron_reference.py)
            ["decoder.layers.1.mlp.experts.experts.linear_fc1.weight",
             "decoder.layers.1.mlp.router.expert_bias", "decoder.layers.1.pre_mlp_layernorm.weight",
             "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
             "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
             "decoder.layers.0.self_attention.linear_qkv.weight",
             "decoder.layers.3.mlp.shared_experts.linear_fc2.weight",
             "decoder.final_layernorm.weight"]),
    "gdn": ("gpt", ModelConfig.llama(**TINY, num_query_groups=2, attention_output_gate=True,
                                     experimental_attention_variant="gated_delta_net",
                                     linear_attention_freq="2", linear_key_head_dim=8,
                                     linear_value_head_dim=4, linear_num_key_heads=2,
                                     linear_num_value_heads=4),
            ["decoder.layers.0.self_attention.in_proj.weight.alpha",  # per layer (non-
             "decoder.layers.0.self_attention.in_proj.layer_norm_weight",  # homogeneous)
             "decoder.layers.0.self_attention.conv1d.weight.value",
             "decoder.layers.0.self_attention.A_log", "decoder.layers.0.self_attention.out_norm.weight",
             "decoder.layers.1.self_attention.linear_qkv.weight",
             "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
             "decoder.final_layernorm.weight"]),  # a GPT stack's name, though per layer
    "hybrid": ("mamba", ModelConfig.llama(**{**TINY, "num_layers": 4}, model_type="mamba",
                                          num_query_groups=2, hybrid_override_pattern="M*-M",
                                          mamba_state_dim=8, mamba_head_dim=8,
                                          mamba_num_groups=2, mamba_expand=2, mamba_d_conv=4,
                                          make_vocab_size_divisible_by=8),
               ["decoder.layers.0.mixer.in_proj.weight.z", "decoder.layers.0.mixer.conv1d.weight.B",
                "decoder.layers.0.mixer.in_proj.layer_norm_weight",
                "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
                "decoder.layers.2.mlp.linear_fc1.layer_norm_weight", "decoder.final_norm.weight"]),
}


def test_qkv_interleave_is_megatron_cores_order():
    """a 4 heads in g 2 groups, d 1: loom ``[q0 q1 q2 q3 k0 k1 v0 v1]``; Megatron-Core's
    ``get_query_key_value_tensors`` reads ``[q0 q1 k0 v0 | q2 q3 k1 v1]``."""
    loom = torch.arange(8.0)
    meg = layout.qkv_to_megatron(loom, 4, 2)
    assert meg.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert torch.equal(layout.qkv_to_loom(meg, 4, 2), loom)
    assert layout.qkv_to_megatron(torch.arange(6.0), 2, 2).tolist() == [0, 2, 4, 1, 3, 5]
    # --attention-output-gate: loom [q0 q1 q2 q3 g0 g1 g2 g3 k0 k1 v0 v1], Megatron per group
    # [q0 q1 g0 g1 k0 v0 | q2 q3 g2 g3 k1 v1] (get_query_key_value_tensors(output_gate=True))
    gated = layout.qkv_to_megatron(torch.arange(12.0), 4, 2, gated=True)
    assert gated.tolist() == [0, 1, 4, 5, 8, 10, 2, 3, 6, 7, 9, 11]
    assert torch.equal(layout.qkv_to_loom(gated, 4, 2, gated=True), torch.arange(12.0))


def _loom_checkpoint(path: str, family: str, cfg: ModelConfig) -> dict:
    from loom.checkpoint.io import save_checkpoint
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    from loom.parallel.random import RNGTracker
    mesh = ParallelMesh.single()
    tracker = RNGTracker(mesh.device)
    tracker.seed(0)
    model = build_model(get_family(family), cfg, mesh, tracker, seed=3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    save_checkpoint(path, 4, [model], torch.optim.AdamW(model.parameters()), None, mesh,
                    tracker, consumed_samples=16, config=dataclasses.asdict(cfg))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_loom_to_megatron_to_loom_is_bit_equal(name, tmp_path):
    from loom.checkpoint.io import open_checkpoint, read_common
    from loom.checkpoint.megatron.convert import from_megatron, to_megatron
    from loom.checkpoint.megatron.stores import DistStore
    family, cfg, keys = FAMILIES[name]
    want = _loom_checkpoint(str(tmp_path / "loom"), family, cfg)
    meg = to_megatron(str(tmp_path / "loom"), str(tmp_path / "meg"))
    assert set(keys) <= set(DistStore(meg).tensors), sorted(DistStore(meg).tensors)
    back = from_megatron(str(tmp_path / "meg"), str(tmp_path / "back"), {})
    assert read_common(back)["iteration"] == 4 and read_common(back)["consumed_samples"] == 16
    index = open_checkpoint(back)
    got, _, _ = index.load(index.names)
    assert set(got) == set(want)
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_zero_centred_gains_read_as_one_plus_w(tmp_path):
    """A checkpoint trained with ``--apply-layernorm-1p`` stores gain - 1."""
    from loom.checkpoint.io import open_checkpoint
    from loom.checkpoint.megatron.convert import to_megatron
    _, cfg, _ = FAMILIES["moe"]
    want = _loom_checkpoint(str(tmp_path / "loom"), "gpt", cfg)
    meg = to_megatron(str(tmp_path / "loom"), str(tmp_path / "meg"))
    common = torch.load(os.path.join(meg, "common.pt"), weights_only=False)
    common["args"].apply_layernorm_1p = True
    torch.save(common, os.path.join(meg, "common.pt"))
    got, _, _ = open_checkpoint(meg).load(["final_layernorm.weight", "layers.0.mlp.linear_fc1.weight"])
    assert torch.equal(got["final_layernorm.weight"], want["final_layernorm.weight"] + 1)
    assert torch.equal(got["layers.0.mlp.linear_fc1.weight"], want["layers.0.mlp.linear_fc1.weight"])


def _dist_dir(path, iteration=None) -> None:
    os.makedirs(path)
    with open(os.path.join(path, "metadata.json"), "w") as fh:
        fh.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')


def test_which_directory_is_megatrons(tmp_path):
    root = tmp_path / "root"
    _dist_dir(root / "release")
    (root / "latest_checkpointed_iteration.txt").write_text("release")
    found = locate(str(root))
    assert found.path.endswith("release") and found.iteration is None
    _dist_dir(root / "iter_0000007")
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    assert locate(str(root)).iteration == 7 and locate(str(root), 7).format == "torch_dist"
    with pytest.raises(ConfigError, match="--ckpt-step 8"):
        locate(str(root), 8)
    (root / "latest_checkpointed_iteration.txt").write_text("9")
    with pytest.raises(ConfigError, match="names '9'"):
        locate(str(root))
    assert locate(str(root / "iter_0000007")).iteration == 7  # one iteration directory
    (tmp_path / "loom").mkdir()
    (tmp_path / "loom" / "metadata.json").write_text('{"format": "loom-checkpoint-v2"}')
    assert locate(str(tmp_path / "loom")) is None and diagnose(str(tmp_path / "loom")) is None
    assert "missing .metadata, common.pt" in diagnose(str(root / "iter_0000007"))
    (tmp_path / "mp" / "mp_rank_00").mkdir(parents=True)
    assert "mp_rank_00 without model_optim_rng.pt" in diagnose(str(tmp_path / "mp"))


def test_megatrons_pickles_read_without_megatron(tmp_path, monkeypatch):
    """Megatron's own classes inside ``args`` (enums, ...) become inert stand-ins; nothing of
    the module they name is imported."""
    from loom.checkpoint.megatron.args import Foreign, load_pickle, model_flags, model_fields
    mod = types.ModuleType("megatron_lookalike")

    class Backend:
        def __init__(self, v):
            self.v = v

        def __reduce__(self):
            return (Backend, (self.v,))
    Backend.__module__ = mod.__name__
    Backend.__qualname__ = "Backend"
    mod.Backend = Backend
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    args = argparse.Namespace(num_layers=3, add_bias_linear=False, attention_backend=Backend(5),
                              group_query_attention=False, num_query_groups=1)
    torch.save({"args": args, "iteration": 2}, tmp_path / "common.pt")
    monkeypatch.delitem(sys.modules, mod.__name__)
    loaded = load_pickle(str(tmp_path / "common.pt"))
    assert isinstance(loaded["args"].attention_backend, Foreign)
    assert loaded["args"].attention_backend.args == (5,)
    flags = model_flags(loaded["args"], model_fields(), hybrid=False)
    assert flags["disable_bias_linear"] is True and flags["num_query_groups"] is None
    assert flags["num_layers"] == 3 and "attention_backend" not in flags
    with open(tmp_path / "bad.pt", "wb") as fh:
        pickle.dump("x", fh)
        fh.write(b"\x00garbage")
    with pytest.raises(ConfigError, match="unreadable"):
        load_pickle(str(tmp_path / "bad.pt"))


def test_from_megatron_cuts_a_tp2_runs_optimizer_states_like_the_weights(tmp_path):
    """A loom ``torch_dist`` save of a TP=2 16-bit run pads the embedding, its Adam states and
    its fp32 main weights to Vp(t=2) = 256 rows (V 128, divisible by 128 x t);
    ``--from-megatron`` reads at t=1 (Vp 128) and cuts the states as it cuts the weights."""
    from loom.checkpoint.io import open_checkpoint
    from loom.checkpoint.megatron.convert import from_megatron, write_megatron_checkpoint
    from loom.checkpoint.megatron.stores import DistStore
    cfg = ModelConfig.llama(**TINY, num_query_groups=2)
    full = _loom_checkpoint(str(tmp_path / "loom"), "gpt", cfg)
    g = torch.Generator().manual_seed(0)
    states = {n: {"exp_avg": torch.randn(t.shape, generator=g),
                  "exp_avg_sq": torch.rand(t.shape, generator=g),
                  "master_param": t + torch.randn(t.shape, generator=g) * 1e-3,
                  "step": torch.tensor(3.0)} for n, t in full.items()}
    meg = write_megatron_checkpoint(str(tmp_path / "meg"), 5, {n: t.bfloat16() for n, t in
                                                                full.items()},
                                    states, cfg, dataclasses.asdict(cfg), 20, target_tp=2)
    emb = "embedding.word_embeddings.weight"
    for key in (emb, f"optimizer.state.exp_avg.{emb}", f"optimizer.state.fp32_param.{emb}"):
        assert DistStore(meg).shape(key) == (256, 32), key
    back = from_megatron(str(tmp_path / "meg"), str(tmp_path / "back"), {})
    index = open_checkpoint(back)
    got, optim, _ = index.load(index.names, index.names)
    for n in (emb, "output_layer.weight", "layers.0.mlp.linear_fc1.weight"):
        assert torch.equal(got[n], states[n]["master_param"]), n  # the fp32 main weights
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim[n][k], states[n][k]), (n, k)


def test_apply_layernorm_1p_writes_gain_minus_one_and_reads_it_back(tmp_path):
    """``--apply-layernorm-1p``: Megatron's norm weight is w with gain 1 + w (Transformer
    Engine's ``zero_centered_gamma``; Megatron-Core's local spec refuses it, torch_norm.py, so
    no CPU reference builds one), loom's norm holds the gain g. A ``torch_dist`` write stores
    g - 1 for every norm gain (the weights and the fp32 main weights; Adam's moments as they are,
    since the gradient by w is the gradient by g) with the flag in the args, which Megatron-LM
    reads back as gain 1 + (g - 1) = g; ``--from-megatron`` reads w + 1; loom's own format
    keeps g. Other weights are untouched."""
    from loom.checkpoint.io import open_checkpoint
    from loom.checkpoint.megatron.convert import from_megatron, write_megatron_checkpoint
    from loom.checkpoint.megatron.stores import DistStore
    cfg = ModelConfig.llama(**TINY, num_query_groups=2, qk_layernorm=True, apply_layernorm_1p=True)
    full = _loom_checkpoint(str(tmp_path / "loom"), "gpt", cfg)
    own, _, _ = open_checkpoint(str(tmp_path / "loom" / "iter_0000004")).load(
        ["final_layernorm.weight"])
    assert torch.equal(own["final_layernorm.weight"], full["final_layernorm.weight"])  # g
    g = torch.Generator().manual_seed(1)
    states = {n: {"exp_avg": torch.randn(t.shape, generator=g),
                  "exp_avg_sq": torch.rand(t.shape, generator=g),
                  "master_param": t + torch.randn(t.shape, generator=g) * 1e-3,
                  "step": torch.tensor(2.0)} for n, t in full.items()}
    meg = write_megatron_checkpoint(str(tmp_path / "meg"), 4, full, states, cfg,
                                    dataclasses.asdict(cfg), 16)
    store = DistStore(meg)
    gains = {"decoder.final_layernorm.weight": ((), "final_layernorm.weight"),
             "decoder.layers.self_attention.linear_qkv.layer_norm_weight":
                 ((1,), "layers.1.input_layernorm.weight"),
             "decoder.layers.mlp.linear_fc1.layer_norm_weight":
                 ((0,), "layers.0.pre_mlp_layernorm.weight"),
             "decoder.layers.self_attention.q_layernorm.weight":
                 ((2,), "layers.2.self_attention.q_layernorm.weight")}
    wanted = [(k, i) for k, (i, _) in gains.items()] + [
        (f"optimizer.state.{s}.{k}", i) for s in ("fp32_param", "exp_avg") for k, (i, _) in
        gains.items()] + [("decoder.layers.mlp.linear_fc2.weight", (0,))]
    got = store.read(wanted)
    for key, (index, name) in gains.items():
        assert torch.equal(got[(key, index)], full[name] - 1), key
        assert torch.equal(got[(f"optimizer.state.fp32_param.{key}", index)],
                           states[name]["master_param"] - 1), key
        assert torch.equal(got[(f"optimizer.state.exp_avg.{key}", index)],
                           states[name]["exp_avg"]), key
    assert torch.equal(got[("decoder.layers.mlp.linear_fc2.weight", (0,))],
                       full["layers.0.mlp.linear_fc2.weight"])
    args = torch.load(os.path.join(meg, "common.pt"), weights_only=False)["args"]
    assert args.layernorm_zero_centered_gamma and args.apply_layernorm_1p
    back = from_megatron(str(tmp_path / "meg"), str(tmp_path / "back"), {})
    index = open_checkpoint(back)
    loaded, _, _ = index.load(index.names)
    for n in full:  # (g - 1) + 1 is g up to one rounding of g - 1
        torch.testing.assert_close(loaded[n], states[n]["master_param"], rtol=0, atol=1e-6)


def test_a_legacy_model_checkpoint_is_refused_naming_the_conversion(tmp_path):
    """Megatron-LM's legacy models (``--use-legacy-models``, accepted without effect for
    training) save ``language_model.*`` nested dicts (megatron/legacy/model/language_model.py
    ``state_dict_for_save_checkpoint`` at core_v0.12.0); loom reads Megatron-Core's names, and
    says which of Megatron's tools converts."""
    from loom.checkpoint.megatron.stores import open_store
    rank = tmp_path / "iter_0000003" / "mp_rank_00"
    rank.mkdir(parents=True)
    w = torch.zeros(4, 2)
    torch.save({"iteration": 3, "checkpoint_version": 3.0, "model": {"language_model": {
        "embedding": {"word_embeddings": {"weight": w}},
        "encoder": {"layers.0.self_attention.query_key_value.weight": w},
        "output_layer": {"weight": w}}}}, rank / "model_optim_rng.pt")
    with pytest.raises(ConfigError, match=r"legacy model \(--use-legacy-models: language_model"
                                          r"\.\* keys\).*--loader legacy --saver core"):
        open_store(str(tmp_path / "iter_0000003"), "torch")
