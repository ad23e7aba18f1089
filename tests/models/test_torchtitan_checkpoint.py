"""``loom checkpoint convert --from-torchtitan FILE.toml STEP_DIR OUT`` (loom/checkpoint/
convert.py): a torchtitan Llama checkpoint (DCP, model-only or full) becomes a loom checkpoint of
the same function. Two references it did not write: loom's RoPE on adjacent pairs
(``--rotary-interleaved``, Megatron's; torchtitan's) fed torchtitan's weights as they are, and
``transformers``' Llama fed the converted (Hugging Face) ones."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from loom.checkpoint.convert import from_torchtitan, torchtitan_to_hf
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
    full = _save({"model": tt, "optimizer": {"state.0.exp_avg": torch.zeros(3)},
                  "train_state": {"step": torch.tensor(10)}}, tmp_path / "step-20")
    ck = from_torchtitan(only, str(tmp_path / "ck"), str(toml))
    ck2 = from_torchtitan(full, str(tmp_path / "ck2"), str(toml))
    mesh = ParallelMesh.single()

    def loom_model(path):
        path = latest_checkpoint(path) if not str(path).endswith("iter_0000000") else path
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
    for name, flavor, what in (("qwen3", "debugmodel_moe", "Qwen3-MoE"),
                               ("deepseek_v3", "debugmodel", "DeepSeek-V3"),
                               ("llama4", "debugmodel", "Llama 4")):
        moe = tmp_path / f"{name}.toml"
        moe.write_text(f'[model]\nname = "{name}"\nflavor = "{flavor}"\n')
        with pytest.raises(ConfigError, match=f"a {what} checkpoint"):
            from_torchtitan(str(tmp_path / "s2"), str(tmp_path / "o5"), str(moe))


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
