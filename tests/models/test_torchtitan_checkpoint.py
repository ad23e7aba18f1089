"""``loom checkpoint convert --from-torchtitan FILE.toml STEP_DIR OUT`` (loom/checkpoint/
torchtitan.py): a torchtitan checkpoint (DCP, model-only or full) becomes a loom checkpoint of
the same function. Two references it did not write: loom's RoPE on adjacent pairs
(``--rotary-interleaved``, Megatron's; torchtitan's) fed torchtitan's weights as they are, and
``transformers``' Llama fed the converted (Hugging Face) ones."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from loom.checkpoint.torchtitan import from_torchtitan, torchtitan_to_hf
from loom.config import torchtitan_models as tt_config
from loom.config.torchtitan import read_torchtitan_config
from loom.errors import ConfigError
from testkit.numerics import rel_err

TOML = """[model]
name = "llama3"
flavor = "debugmodel"
[training]
seq_len = 64
"""


def torchtitan_state(fields: dict, seed: int = 0) -> dict:
    """Random weights under torchtitan's Llama names and shapes (``[out, in]``)."""
    g = torch.Generator().manual_seed(seed)
    h, f, L = fields["hidden_size"], fields["ffn_hidden_size"], fields["num_layers"]
    a, kv, V = fields["num_attention_heads"], fields["num_query_groups"], fields["vocab_size"]
    d = h // a

    def w(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std
    sd = {"tok_embeddings.weight": w(V, h, std=1.0), "norm.weight": 1 + w(h),
          "output.weight": w(V, h)}
    for i in range(L):
        p = f"layers.{i}."
        sd.update({p + "attention.wq.weight": w(a * d, h), p + "attention.wk.weight": w(kv * d, h),
                   p + "attention.wv.weight": w(kv * d, h), p + "attention.wo.weight": w(h, a * d),
                   p + "feed_forward.w1.weight": w(f, h), p + "feed_forward.w3.weight": w(f, h),
                   p + "feed_forward.w2.weight": w(h, f), p + "attention_norm.weight": 1 + w(h),
                   p + "ffn_norm.weight": 1 + w(h)})
    return sd


def _save(state: dict, path) -> str:
    with warnings.catch_warnings():  # no process group: DCP's single-process save
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))
    return str(path)


def _logits(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids)
    return out[0] if isinstance(out, tuple) else out


def test_a_torchtitan_checkpoint_converts_to_the_same_function(tmp_path):
    """Logits of the converted loom checkpoint equal (rel 1e-5) those of loom with RoPE on
    adjacent pairs fed torchtitan's weights as they are, and those of transformers' Llama fed
    the converted weights; a full checkpoint (model under ``model.``, optimizer and step
    beside it) converts to the same tensors as a model-only one."""
    from loom.checkpoint.io import latest_checkpoint, load_model_weights, open_checkpoint, \
        read_common
    from loom.config import LoomConfig
    from loom.interop.hf import load_full_state_dict
    from loom.models import FamilyRegistry, get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    import transformers
    toml = tmp_path / "debug.toml"
    toml.write_text(TOML)
    fields = read_torchtitan_config(str(toml))
    tt = torchtitan_state(fields)
    only = _save(tt, tmp_path / "step-10")
    adam = {f"state.{n}.{k}": torch.zeros_like(t) for n, t in tt.items()
            for k in ("exp_avg", "exp_avg_sq")}
    adam.update({f"state.{n}.step": torch.tensor(10.0) for n in tt})
    full = _save({"model": tt, "optimizer": adam, "train_state": {"step": torch.tensor(10)}},
                 tmp_path / "step-20")  # an older release's: the model under model.
    ck = from_torchtitan(only, str(tmp_path / "ck"), str(toml))
    ck2 = from_torchtitan(full, str(tmp_path / "ck2"), str(toml))
    mesh = ParallelMesh.single()

    assert str(ck2).endswith("iter_0000010")

    def loom_model(path):
        path = path if str(path).rstrip("/").split("/")[-1].startswith("iter_") else \
            latest_checkpoint(path)
        cfg = LoomConfig.from_flat(read_common(path)["config"]).model
        m = build_model(get_family(cfg.model_type), cfg, mesh, seed=None).eval()
        load_model_weights(open_checkpoint(path), [m], mesh)
        return m, cfg
    ids = torch.randint(0, fields["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    m, cfg = loom_model(ck)
    ours = _logits(m, ids)
    assert torch.equal(ours, _logits(loom_model(ck2)[0], ids))
    assert cfg.use_rope_scaling and not cfg.rotary_interleaved and cfg.num_layers == 6
    # torchtitan's RoPE: on adjacent pairs, its weights as they are
    family = FamilyRegistry().for_hf("llama")
    hf = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
          "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 16,
          "vocab_size": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "max_position_embeddings": 64, "tie_word_embeddings": False, "hidden_act": "silu",
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    pairs_cfg, pairs = family.hf.to_loom(hf, torchtitan_to_hf(tt, 16, 16, "t", halves=False), "t")
    pairs_cfg = replace(pairs_cfg, rotary_interleaved=True)
    pm = build_model(family, pairs_cfg, mesh, seed=None).eval()
    load_full_state_dict(pm, {n: pairs[n] for n, _ in pm.named_parameters()})
    assert rel_err(ours, _logits(pm, ids), floor=1.0) < 1e-5
    # ... and what the halves do wrong: the same weights without reordering differ
    plain = build_model(family, replace(pairs_cfg, rotary_interleaved=False), mesh,
                        seed=None).eval()
    load_full_state_dict(plain, {n: pairs[n] for n, _ in plain.named_parameters()})
    assert rel_err(ours, _logits(plain, ids), floor=1.0) > 1e-3
    # transformers' Llama on the converted weights
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in hf.items() if k != "model_type"})).eval()
    hf_model.load_state_dict(torchtitan_to_hf(tt, 16, 16, "t"), strict=False)
    with torch.no_grad():
        theirs = hf_model(ids).logits
    assert rel_err(ours, theirs, floor=1.0) < 1e-5


def test_refusals(tmp_path):
    toml = tmp_path / "debug.toml"
    toml.write_text(TOML)
    with pytest.raises(ConfigError, match="no torch.distributed.checkpoint here"):
        from_torchtitan(str(tmp_path), str(tmp_path / "o1"), str(toml))
    bad = torchtitan_state(read_torchtitan_config(str(toml)))
    bad["layers.0.attention.wqkv.weight"] = bad.pop("layers.0.attention.wq.weight")
    with pytest.raises(ConfigError, match="'layers.0.attention.wqkv.weight' is not one of"):
        from_torchtitan(_save(bad, tmp_path / "s1"), str(tmp_path / "o2"), str(toml))
    short = torchtitan_state(read_torchtitan_config(str(toml)))
    short = {k: v for k, v in short.items() if not k.startswith("layers.5.")}
    with pytest.raises(ConfigError, match="another flavor"):
        from_torchtitan(_save(short, tmp_path / "s2"), str(tmp_path / "o3"), str(toml))
    llama4 = tmp_path / "llama4.toml"  # a Llama 3 checkpoint given as Llama 4's
    llama4.write_text('[model]\nname = "llama4"\nflavor = "debugmodel"\n')
    with pytest.raises(ConfigError, match="of the Llama 4 model of .*another flavor"):
        from_torchtitan(str(tmp_path / "s2"), str(tmp_path / "o5"), str(llama4))


def test_a_torchtitan_qwen3_checkpoint_is_transformers_qwen3(tmp_path):
    """torchtitan's dense Qwen3 (debugmodel: QK norms, head dim 128 of h 256 / 16 heads, 8 KV
    groups, tied embeddings; RoPE on halves already, its rotate_half) converts by its names
    alone (its state_dict_adapter's table), and the loom checkpoint's logits equal
    transformers' Qwen3ForCausalLM fed the same weights under that table's names."""
    from loom.checkpoint.io import latest_checkpoint, load_model_weights, open_checkpoint, \
        read_common
    from loom.config import LoomConfig
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    import transformers
    toml = tmp_path / "qwen.toml"
    toml.write_text('[model]\nname = "qwen3"\nflavor = "debugmodel"\n[training]\nseq_len = 64\n')
    f = read_torchtitan_config(str(toml))
    g = torch.Generator().manual_seed(0)
    h, a, kv, d, ffn, V = 256, 16, 8, 128, f["ffn_hidden_size"], 2048

    def w(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std
    tt = {"tok_embeddings.weight": w(V, h, std=1.0), "norm.weight": 1 + w(h)}
    tt["output.weight"] = tt["tok_embeddings.weight"]  # tied: torchtitan holds one tensor
    for i in range(f["num_layers"]):
        p = f"layers.{i}."
        tt.update({p + "attention.wq.weight": w(a * d, h), p + "attention.wk.weight": w(kv * d, h),
                   p + "attention.wv.weight": w(kv * d, h), p + "attention.wo.weight": w(h, a * d),
                   p + "attention.q_norm.weight": 1 + w(d), p + "attention.k_norm.weight": 1 + w(d),
                   p + "feed_forward.w1.weight": w(ffn, h), p + "feed_forward.w3.weight": w(ffn, h),
                   p + "feed_forward.w2.weight": w(h, ffn), p + "attention_norm.weight": 1 + w(h),
                   p + "ffn_norm.weight": 1 + w(h)})
    ck = from_torchtitan(_save(dict(tt), tmp_path / "step-5"), str(tmp_path / "ck"), str(toml))
    path = latest_checkpoint(ck) if not str(ck).endswith("iter_0000000") else ck
    cfg = LoomConfig.from_flat(read_common(path)["config"]).model
    assert cfg.qk_layernorm and cfg.kv_channels == 128 and \
        not cfg.untie_embeddings_and_output_weights
    # the model loom train --config builds: torchtitan's init, no dropout
    assert cfg.torchtitan_init and cfg.hidden_dropout == cfg.attention_dropout == 0.0
    mesh = ParallelMesh.single()
    m = build_model(get_family(cfg.model_type), cfg, mesh, seed=None).eval()
    load_model_weights(open_checkpoint(path), [m], mesh)
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(3))
    ours = _logits(m, ids)
    table = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    hf_sd = {"model.embed_tokens.weight": tt["tok_embeddings.weight"],
             "model.norm.weight": tt["norm.weight"], "lm_head.weight": tt["output.weight"]}
    for name, t in tt.items():
        if name.startswith("layers."):
            _, i, *rest = name.split(".")
            hf_sd[f"model.layers.{i}.{table['.'.join(rest[:-1])]}.weight"] = t
    hf_model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=V, hidden_size=h, intermediate_size=ffn, num_hidden_layers=f["num_layers"],
        num_attention_heads=a, num_key_value_heads=kv, head_dim=d, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=64, tie_word_embeddings=True)).eval()
    hf_model.load_state_dict(hf_sd)
    with torch.no_grad():
        theirs = hf_model(ids).logits
    assert rel_err(ours, theirs, floor=1.0) < 1e-5


def test_a_torchtitan_checkpoint_given_to_load_or_inspect_names_the_conversion(tmp_path,
                                                                              capsys):
    """torchtitan's ``[checkpoint] folder`` (its ``step-N`` directories) given to ``loom train
    --load`` or ``loom checkpoint inspect``, or one step directory: one line naming
    ``--from-torchtitan`` and the newest step, exit status 2."""
    from loom.cli import main
    toml = tmp_path / "debug.toml"
    toml.write_text(TOML)
    state = torchtitan_state(read_torchtitan_config(str(toml)))
    root = tmp_path / "outputs" / "checkpoint"
    for step in (5, 10):
        _save(state, root / f"step-{step}")
    for argv in (["train", "--load", str(root), "--config", str(toml), "--mock-data",
                  "--dry-run"],
                 ["checkpoint", "inspect", str(root)],
                 ["checkpoint", "inspect", str(root / "step-5")]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        step = "step-5" if argv[-1].endswith("step-5") else "step-10"
        assert e.value.code == 2 and "--from-torchtitan JOB.toml" in err and \
            f"{root / step} is a torchtitan checkpoint" in err and err.count("\n") == 1, err


# torchtitan v0.2.x -> transformers' names within a layer (its state_dict_adapter.py files for
# qwen3 and deepseek_v3, written out here as the reference), and its GroupedExperts (stacked
# w1 / w3 [E, f, h], w2 [E, h, f]) as transformers 5 holds experts in memory
TT_TO_HF = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
            "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
            "attention.k_norm": "self_attn.k_norm", "attention.wq_a": "self_attn.q_a_proj",
            "attention.wq_b": "self_attn.q_b_proj", "attention.wkv_a": "self_attn.kv_a_proj_with_mqa",
            "attention.kv_norm": "self_attn.kv_a_layernorm", "attention.wkv_b": "self_attn.kv_b_proj",
            "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
            "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm", "moe.router.gate": "mlp.gate",
            "moe.shared_experts.w1": "mlp.shared_experts.gate_proj",
            "moe.shared_experts.w3": "mlp.shared_experts.up_proj",
            "moe.shared_experts.w2": "mlp.shared_experts.down_proj"}


def _to_transformers(tt: dict, mla: bool, llama4: bool = False) -> dict:
    sd = {"model.embed_tokens.weight": tt["tok_embeddings.weight"],
          "model.norm.weight": tt["norm.weight"], "lm_head.weight": tt["output.weight"]}
    for name, t in tt.items():
        if not name.startswith("layers."):
            continue
        _, i, *rest = name.split(".")
        inner, pre = ".".join(rest[:-1]), f"model.layers.{i}."
        if llama4 and (inner.startswith(("moe", "feed_forward"))):  # Llama4ForCausalLM's
            ff = pre + "feed_forward."
            if inner == "moe.experts" and rest[-1] == "w1":
                sd[ff + "experts.gate_up_proj"] = torch.cat(
                    [t, tt[f"layers.{i}.moe.experts.w3"]], dim=1).transpose(1, 2)
            elif inner == "moe.experts" and rest[-1] == "w2":
                sd[ff + "experts.down_proj"] = t.transpose(1, 2)
            elif inner in ("moe.router.gate",):
                sd[ff + "router.weight"] = t
            elif inner.startswith(("moe.shared_experts.", "feed_forward.")):
                sub = "shared_expert." if inner.startswith("moe.") else ""
                proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[inner[-2:]]
                sd[f"{ff}{sub}{proj}.weight"] = t
            continue
        if inner == "moe.experts":
            if rest[-1] == "w1":
                sd[pre + "mlp.experts.gate_up_proj"] = torch.cat(
                    [tt[f"layers.{i}.moe.experts.w1"], tt[f"layers.{i}.moe.experts.w3"]], dim=1)
            elif rest[-1] == "w2":
                sd[pre + "mlp.experts.down_proj"] = t
        elif rest[-1] == "expert_bias":
            if mla:
                sd[pre + "mlp.gate.e_score_correction_bias"] = t
        elif inner == "attention.q_norm":
            sd[pre + ("self_attn.q_a_layernorm" if mla else "self_attn.q_norm") + ".weight"] = t
        else:
            sd[pre + TT_TO_HF[inner] + ".weight"] = t
    return sd


def _outer(cfg, seed: int):
    """``(w, state)``: a seeded draw ``w(*shape, std=0.05)`` and torchtitan's embedding, final
    norm and output tensors for ``cfg`` drawn with it."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std
    h, V = cfg.hidden_size, cfg.vocab_size
    return w, {"tok_embeddings.weight": w(V, h, std=1.0), "norm.weight": 1 + w(h),
               "output.weight": w(V, h)}


def moe_state(cfg, seed: int = 0, bias_std: float = 0.05) -> dict:
    """Random weights under torchtitan v0.2.x's Qwen3-MoE / DeepSeek-V3 names and shapes for
    the loom model ``cfg`` read from a torchtitan config (stacked experts, the load-balancing
    ``moe.expert_bias`` of each MoE layer)."""
    h, E, fe = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_size
    w, sd = _outer(cfg, seed)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        sd.update({p + "attention_norm.weight": 1 + w(h), p + "ffn_norm.weight": 1 + w(h)})
        if cfg.multi_latent_attention:
            a, dq = cfg.num_attention_heads, cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
            r, rq = cfg.kv_lora_rank, cfg.q_lora_rank
            sd.update({p + "attention.wq_a.weight": w(rq, h), p + "attention.q_norm.weight":
                       1 + w(rq), p + "attention.wq_b.weight": w(a * dq, rq)} if rq else
                      {p + "attention.wq.weight": w(a * dq, h)})
            sd.update({p + "attention.wkv_a.weight": w(r + cfg.qk_pos_emb_head_dim, h),
                       p + "attention.kv_norm.weight": 1 + w(r),
                       p + "attention.wkv_b.weight": w(a * (cfg.qk_head_dim + cfg.v_head_dim), r),
                       p + "attention.wo.weight": w(h, a * cfg.v_head_dim)})
        else:
            a, kv, d = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim
            sd.update({p + "attention.wq.weight": w(a * d, h),
                       p + "attention.wk.weight": w(kv * d, h),
                       p + "attention.wv.weight": w(kv * d, h),
                       p + "attention.wo.weight": w(h, a * d)})
            if cfg.qk_layernorm:  # Qwen3's
                sd.update({p + "attention.q_norm.weight": 1 + w(d),
                           p + "attention.k_norm.weight": 1 + w(d)})
        if not cfg.is_moe_layer(i):
            f = cfg.ffn_size
            sd.update({p + "feed_forward.w1.weight": w(f, h), p + "feed_forward.w3.weight":
                       w(f, h), p + "feed_forward.w2.weight": w(h, f)})
            continue
        sd.update({p + "moe.router.gate.weight": w(E, h, std=0.3),
                   p + "moe.experts.w1": w(E, fe, h), p + "moe.experts.w3": w(E, fe, h),
                   p + "moe.experts.w2": w(E, h, fe),
                   p + "moe.expert_bias": w(E, std=bias_std)})
        fs = cfg.moe_shared_expert_intermediate_size
        if fs:
            sd.update({p + "moe.shared_experts.w1.weight": w(fs, h),
                       p + "moe.shared_experts.w3.weight": w(fs, h),
                       p + "moe.shared_experts.w2.weight": w(h, fs)})
    return sd


def _converted(ck):
    from loom.checkpoint.io import latest_checkpoint, load_model_weights, open_checkpoint, \
        read_common
    from loom.config import LoomConfig
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    path = ck if str(ck).rstrip("/").split("/")[-1].startswith("iter_") else \
        latest_checkpoint(ck)
    cfg = LoomConfig.from_flat(read_common(path)["config"]).model
    mesh = ParallelMesh.single()
    m = build_model(get_family(cfg.model_type), cfg, mesh, seed=None).eval()
    load_model_weights(open_checkpoint(path), [m], mesh)
    return cfg, m


def _bias_is_carried(biased: dict, toml, tmp_path):
    """Convert torchtitan state ``biased``; every MoE layer's ``moe.expert_bias`` is loom's
    ``router.expert_bias`` bit for bit (a copy). Returns the converted model."""
    ck = from_torchtitan(_save(dict(biased), tmp_path / "step-biased"),
                         str(tmp_path / "ck-biased"), str(toml))
    _, model = _converted(ck)
    params = dict(model.named_parameters())
    layers = [k.split(".")[1] for k in biased if k.endswith(".moe.expert_bias")]
    assert layers
    for i in layers:
        assert torch.equal(params[f"layers.{i}.mlp.router.expert_bias"],
                           biased[f"layers.{i}.moe.expert_bias"])
    return model


def _toml_model(path):
    from loom.checkpoint.torchtitan import _toml_model as read
    return read(str(path))


def test_a_torchtitan_qwen3_moe_checkpoint_is_transformers_qwen3_moe(tmp_path, monkeypatch):
    """torchtitan's Qwen3-MoE (a flavor of its debug model's kind, shrunk: 16 experts top-8
    softmax renormalized, head dim 128, 2 KV groups) converts by its names: its stacked experts
    split per expert, the load-balancing bias to loom's router. The loom checkpoint is the model
    ``loom train --config`` builds from the same TOML (torchtitan's router and bias), its logits
    equal transformers' Qwen3MoeForCausalLM on the same weights (no bias: transformers has
    none), and with a bias the checkpoint carries it bit for bit and the choice moves."""
    import transformers
    monkeypatch.setitem(tt_config.FLAVORS["qwen3"], "tiny_moe",
                        tt_config.qwen3_moe(64, 2, 4, 2, 96, 16, 32, vocab=128))
    toml = tmp_path / "qwen_moe.toml"
    toml.write_text('[model]\nname = "qwen3"\nflavor = "tiny_moe"\n[training]\nseq_len = 32\n')
    cfg = _toml_model(toml)
    assert cfg.num_experts == 16 and cfg.moe_router_topk == 8 and \
        cfg.moe_router_enable_expert_bias and not cfg.moe_router_pre_softmax
    tt = moe_state(cfg, bias_std=0.0)
    ck = from_torchtitan(_save(dict(tt), tmp_path / "step-1"), str(tmp_path / "ck"), str(toml))
    got, m = _converted(ck)
    assert (got.num_experts, got.moe_router_topk, got.kv_channels) == (16, 8, 128)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    hf_model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        num_experts=16, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=32, tie_word_embeddings=False)).eval()
    hf_model.load_state_dict(_to_transformers(tt, mla=False))
    with torch.no_grad():
        theirs = hf_model(ids).logits
    assert rel_err(_logits(m, ids), theirs, floor=1.0) < 1e-5
    # a trained bias (torchtitan updates it) lands in loom's router and changes the choice
    m2 = _bias_is_carried(moe_state(cfg, bias_std=0.5), toml, tmp_path)
    assert rel_err(_logits(m2, ids), theirs, floor=1.0) > 1e-3


def test_a_torchtitan_deepseek_v3_checkpoint_is_transformers_deepseek_v3(tmp_path, monkeypatch):
    """torchtitan's DeepSeek-V3 with its 671B flavor's router (sigmoid, renormalized, route
    scale 2.5, node-limited groups, the load-balancing bias) on a tiny shape (query compression,
    one dense layer first, a shared expert) converts by its names: MLA's RoPE rows stay in
    adjacent pairs as DeepSeek's (transformers' ``rope_interleave``), experts split, the bias
    to loom's router. Its logits equal transformers' DeepseekV3ForCausalLM on the same weights,
    bias included (DeepseekV3's ``e_score_correction_bias`` is the same choice-only bias)."""
    import transformers
    monkeypatch.setitem(tt_config.FLAVORS["deepseek_v3"], "tiny", tt_config.deepseek(
        128, 64, 96, 32, 3, 1, 4, tt_config.moe(16, 4, 32, shared=1, score="sigmoid",
                                                 route_norm=True, route_scale=2.5, groups=4,
                                                 limited=2), q_lora_rank=32))
    toml = tmp_path / "dsv3.toml"
    toml.write_text('[model]\nname = "deepseek_v3"\nflavor = "tiny"\n[training]\nseq_len = 32\n')
    cfg = _toml_model(toml)
    tt = moe_state(cfg, bias_std=0.3)
    ck = from_torchtitan(_save({f"model.{k}": v for k, v in tt.items()}, tmp_path / "step-3"),
                         str(tmp_path / "ck"), str(toml))  # a full checkpoint: model.*
    got, m = _converted(ck)
    assert got.multi_latent_attention and got.q_lora_rank == 32 and got.num_experts == 16
    hf_model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=16, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=32,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=4, topk_group=2,
        num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=True, rms_norm_eps=1e-5,
        max_position_embeddings=32, tie_word_embeddings=False, rope_interleave=True)).eval()
    hf_model.load_state_dict(_to_transformers(tt, mla=True))
    for layer in hf_model.model.layers:  # transformers fixes the latent norms' eps at 1e-6,
        layer.self_attn.kv_a_layernorm.variance_epsilon = 1e-5  # torchtitan's are norm_eps
        layer.self_attn.q_a_layernorm.variance_epsilon = 1e-5
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf_model(ids).logits
    assert rel_err(_logits(m, ids), theirs, floor=1.0) < 1e-5


def test_moe_refusals(tmp_path, monkeypatch):
    """A MoE checkpoint of another flavor (its expert count, a layer beyond the config's) or
    without the load-balancing bias torchtitan's router keeps: one line naming the tensor."""
    monkeypatch.setitem(tt_config.FLAVORS["qwen3"], "tiny_moe",
                        tt_config.qwen3_moe(64, 2, 4, 2, 96, 16, 32, vocab=128))
    toml = tmp_path / "qwen_moe.toml"
    toml.write_text('[model]\nname = "qwen3"\nflavor = "tiny_moe"\n')
    cfg = _toml_model(toml)
    good = moe_state(cfg)
    cases = {"layers.1.moe.experts.w1": ({**good, "layers.1.moe.experts.w1":
                                          good["layers.1.moe.experts.w1"][:8]}, "16 experts"),
             "layers.2.": ({**good, **{k.replace("layers.1.", "layers.2."): v for k, v in
                                       good.items() if k.startswith("layers.1.")}},
                           "another flavor"),
             "expert_bias": ({k: v for k, v in good.items() if k != "layers.0.moe.expert_bias"},
                             "layers.0.moe.expert_bias missing")}
    for n, (state, match) in enumerate(cases.values()):
        with pytest.raises(ConfigError, match=match):
            from_torchtitan(_save(state, tmp_path / f"s{n}"), str(tmp_path / f"o{n}"),
                            str(toml))


def gpt_oss_state(cfg, seed: int = 0, bias_std: float = 0.05) -> dict:
    """Random weights under torchtitan v0.2.x's gpt-oss names and shapes
    (torchtitan/models/gpt_oss/model/: linear biases, sinks, the router's bias, experts'
    ``mlp1 [E, 2f, h]`` with gate / linear rows interleaved, ``mlp2 [E, h, f]``)."""
    h, E, f = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_kv_groups * cfg.head_dim
    w, sd = _outer(cfg, seed)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        sd.update({p + "attention_norm.weight": 1 + w(h), p + "ffn_norm.weight": 1 + w(h),
                   p + "attention.sinks": w(cfg.num_attention_heads, std=1.0),
                   p + "attention.wq.weight": w(q, h), p + "attention.wq.bias": w(q),
                   p + "attention.wk.weight": w(kv, h), p + "attention.wk.bias": w(kv),
                   p + "attention.wv.weight": w(kv, h), p + "attention.wv.bias": w(kv),
                   p + "attention.wo.weight": w(h, q), p + "attention.wo.bias": w(h),
                   p + "moe.router.gate.weight": w(E, h, std=0.3),
                   p + "moe.router.gate.bias": w(E, std=0.3),
                   p + "moe.expert_bias": w(E, std=bias_std),
                   p + "moe.experts.mlp1_weight": w(E, 2 * f, h, std=0.2),
                   p + "moe.experts.mlp1_bias": w(E, 2 * f, std=0.2),
                   p + "moe.experts.mlp2_weight": w(E, h, f), p + "moe.experts.mlp2_bias": w(E, h)})
    return sd


def test_a_torchtitan_gpt_oss_checkpoint_is_transformers_gpt_oss(tmp_path, monkeypatch):
    """torchtitan's gpt-oss (its 20b / 120b layout on a tiny shape: 64 heads of 64, 8 KV
    groups, sinks, biases, a 128-position window on even layers, YaRN, the clamped SwiGLU of
    8 experts) converts by its names; the loom checkpoint's logits equal transformers'
    GptOssForCausalLM on the same weights (s 160: past the window; no load-balancing bias,
    which transformers lacks), and a trained bias is carried bit for bit."""
    import transformers
    monkeypatch.setitem(tt_config.FLAVORS["gpt_oss"], "tiny",
                        tt_config.gpt_oss(2, 8, dim=64, inter=32, vocab=128))
    toml = tmp_path / "gpt_oss.toml"
    toml.write_text('[model]\nname = "gpt_oss"\nflavor = "tiny"\n[training]\nseq_len = 160\n')
    cfg = _toml_model(toml)
    assert cfg.softmax_type == "learnable" and cfg.is_window_layer(0) and \
        not cfg.is_window_layer(1)
    tt = gpt_oss_state(cfg, bias_std=0.0)
    ck = from_torchtitan(_save(dict(tt), tmp_path / "step-1"), str(tmp_path / "ck"), str(toml))
    _, m = _converted(ck)
    hf_sd = {"model.embed_tokens.weight": tt["tok_embeddings.weight"],
             "model.norm.weight": tt["norm.weight"], "lm_head.weight": tt["output.weight"]}
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "moe.router.gate": "mlp.router"}
    for name, t in tt.items():
        if not name.startswith("layers.") or name.endswith("expert_bias"):
            continue
        _, i, *rest = name.split(".")
        pre, inner = f"model.layers.{i}.", ".".join(rest[:-1])
        if inner == "moe.experts":
            hf = {"mlp1_weight": "gate_up_proj", "mlp1_bias": "gate_up_proj_bias",
                  "mlp2_weight": "down_proj", "mlp2_bias": "down_proj_bias"}[rest[-1]]
            hf_sd[pre + "mlp.experts." + hf] = t.transpose(1, 2) if t.dim() == 3 else t
        elif rest == ["attention", "sinks"]:
            hf_sd[pre + "self_attn.sinks"] = t
        else:
            hf_sd[f"{pre}{names[inner]}.{rest[-1]}"] = t
    hf_cfg = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=8,
        num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
        tie_word_embeddings=False)
    hf_cfg._attn_implementation = "eager"
    hf_model = transformers.GptOssForCausalLM(hf_cfg).eval()
    hf_model.load_state_dict(hf_sd)
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf_model(ids).logits
    assert rel_err(_logits(m, ids), theirs, floor=1.0) < 1e-5
    _bias_is_carried(gpt_oss_state(cfg, bias_std=0.5), toml, tmp_path)


def test_a_full_torchtitan_checkpoint_resumes_in_loom(tmp_path, capsys):
    """torchtitan's full checkpoint (v0.2.x CheckpointManager: the model's tensors flattened at
    the top, its flattened AdamW state under ``optimizer``, ``train_state``; written here by one
    rank) converts to a loom checkpoint at torchtitan's step, its samples consumed step x the
    local batch x the one data-parallel rank that wrote it, every trained parameter's AdamW
    moments mapped as its weights are (each moment equals the weight conversion applied to
    that moment) and its step count; ``loom train --load`` continues the schedule there
    (torchtitan's warm-up: iteration 5's learning rate, not iteration 1's). Differing step
    counts are refused. ``benchmarks/torchtitan_parity.py resume`` takes one more step in
    torchtitan and in loom from such a checkpoint: the same weights (docs/benchmarks.md)."""
    from loom.checkpoint.io import open_checkpoint
    from loom.cli import main
    toml = tmp_path / "job.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n[training]\n'
                    'seq_len = 32\nlocal_batch_size = 2\nsteps = 10\n')
    fields = read_torchtitan_config(str(toml))
    weights = torchtitan_state(fields, seed=0)
    moments = {"exp_avg": torchtitan_state(fields, seed=1),
               "exp_avg_sq": {k: v.abs() for k, v in torchtitan_state(fields, seed=2).items()}}
    optimizer = {f"state.{fqn}.{key}": t for key, sd in moments.items() for fqn, t in sd.items()}
    optimizer.update({f"state.{fqn}.step": torch.tensor(3.0) for fqn in weights})
    full = {**weights, "optimizer": optimizer, "train_state": {"step": 3, "ntokens_seen": 192}}
    ck = from_torchtitan(_save(full, tmp_path / "step-3"), str(tmp_path / "ck"), str(toml))
    assert str(ck).endswith("iter_0000003")
    index = open_checkpoint(str(ck))
    expect = {}
    for key, sd in moments.items():  # the reference: each moment converted as weights
        out = from_torchtitan(_save(dict(sd), tmp_path / f"m-{key}"), str(tmp_path / key),
                              str(toml))
        expect[key] = open_checkpoint(str(out))
    names = [n for n, _ in _converted(ck)[1].named_parameters()]
    _, states, _ = index.load(names, names)
    refs = {key: ix.load(names)[0] for key, ix in expect.items()}
    for n in names:
        assert float(states[n]["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(states[n][key], refs[key][n], rtol=0, atol=0, msg=n)
    from loom.checkpoint.io import read_common
    assert read_common(str(ck))["consumed_samples"] == 6
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(toml), "--load", str(tmp_path / "ck"), "--mock-data",
              "--train-iters", "5", "--global-batch-size", "2"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert "starting at iteration 3" in out and "optimizer and RNG restored" in out, out
    line = next(ln for ln in out.splitlines() if "iteration      5" in ln)
    assert "lr 4.000e-04" in line, line  # 8e-4 x 5 / 10: torchtitan's warm-up at step 5
    from loom.checkpoint.torchtitan import _resume_state  # no rank files: B is unknown
    with pytest.raises(ConfigError, match="written by 0 ranks"):
        _resume_state({"exp_avg": {}, "exp_avg_sq": {}, "step": {"a": torch.tensor(3.0)}},
                      dict, {}, read_torchtitan_config(str(toml)), str(tmp_path), "where")
    optimizer["state.norm.weight.step"] = torch.tensor(2.0)
    with pytest.raises(ConfigError, match=r"taken \[2.0, 3.0\] steps"):
        from_torchtitan(_save(full, tmp_path / "step-bad"), str(tmp_path / "ck2"), str(toml))


def test_a_torchtitan_llama4_checkpoint_is_transformers_llama4(tmp_path, monkeypatch):
    """torchtitan's Llama 4 (a tiny flavor of its kind: MoE every second layer, 4 experts of
    top-1 sigmoid applied to the input, a shared expert, dense layers of Llama's width, its
    RoPE bands, iRoPE: no RoPE in layers 0, 4, ..., the others within fixed blocks of 16 of
    the 48 positions) converts by
    its names through transformers' Llama4ForCausalLM layout (experts fused and transposed,
    RoPE rows kept in pairs: the import reorders them); the loom checkpoint's logits equal
    transformers' Llama4ForCausalLM on the same weights (its chunked attention of 16 positions
    in the RoPE layers; no QK norm, no temperature tuning, as torchtitan's; no load-balancing
    bias, which transformers lacks)."""
    import transformers
    monkeypatch.setitem(tt_config.FLAVORS["llama4"], "tiny",
                        tt_config.llama4(64, 4, 4, 2, multiple_of=32, experts=4, vocab=128,
                                          nope_every=4, block=16))
    toml = tmp_path / "llama4.toml"
    toml.write_text('[model]\nname = "llama4"\nflavor = "tiny"\n[training]\nseq_len = 48\n')
    cfg = _toml_model(toml)
    assert cfg.moe_apply_probs_on_input and cfg.is_moe_layer(1) and not cfg.is_moe_layer(0) \
        and cfg.is_no_rope_layer(0) and not cfg.is_no_rope_layer(3) \
        and cfg.is_chunked_layer(1) and cfg.attention_chunk_size == 16
    tt = moe_state(cfg, bias_std=0.0)
    ck = from_torchtitan(_save(dict(tt), tmp_path / "step-1"), str(tmp_path / "ck"), str(toml))
    _, m = _converted(ck)
    hf_model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=cfg.moe_ffn_size,
        intermediate_size_mlp=cfg.ffn_size, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, no_rope_layers=[0, 1, 1, 1], use_qk_norm=False,
        attn_temperature_tuning=False, attention_chunk_size=16, max_position_embeddings=48,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 1.0, "original_max_position_embeddings": 8192})).eval()
    hf_model.load_state_dict(_to_transformers(tt, mla=False, llama4=True))
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf_model(ids).logits
    assert rel_err(_logits(m, ids), theirs, floor=1.0) < 1e-5
