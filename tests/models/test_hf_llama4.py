"""Hugging Face's Llama 4 text model (``Llama4ForCausalLM``, ``model_type: llama4_text``) into
loom (loom/models/gpt/hf_llama4.py, import only): a tiny random model saved by
``save_pretrained`` converts with ``loom checkpoint convert --from-hf`` and its logits equal
transformers' (MoE every second layer with a shared expert and top-1 sigmoid scores on the
input, dense layers of their own width, RoPE on adjacent pairs with Llama 4's bands, a NoPE
layer), and so do they with Meta's attention (the QK norm in the RoPE layers only, chunked
attention in them, the NoPE layers' temperature tuning, all acting within 40 positions); a
top-k above 1 is refused before any weight is read."""

from __future__ import annotations

import pytest
import torch

from loom.errors import ConfigError
from testkit.numerics import rel_err

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
              use_qk_norm=False, attn_temperature_tuning=False, attention_chunk_size=8192,
              max_position_embeddings=64, tie_word_embeddings=False,
              rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 1.0, "original_max_position_embeddings": 8192})


META = dict(use_qk_norm=True, attention_chunk_size=16, attn_temperature_tuning=True,
            floor_scale=8, attn_scale=0.3)
"""Meta's Llama 4 attention at a scale that acts within the test's 40 positions (the released
models: chunks of 8,192, floor_scale 8,192, attn_scale 0.1)."""


@pytest.mark.parametrize("meta", [False, True], ids=["torchtitan", "meta"])
def test_a_llama4_text_model_imports_with_its_logits(tmp_path, meta):
    import transformers

    from loom.checkpoint.convert import from_hf
    from loom.checkpoint.io import load_model_weights, open_checkpoint, read_common
    from loom.config import LoomConfig
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    torch.manual_seed(0)
    hf = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        **{**CONFIG, **(META if meta else {})})).eval()
    with torch.no_grad():  # norms and routing away from their initial values
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if "router" in name:
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path / "hf")
    ck = from_hf(str(tmp_path / "hf"), str(tmp_path / "ck"))
    cfg = LoomConfig.from_flat(read_common(ck)["config"]).model
    assert cfg.moe_apply_probs_on_input and cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)
    assert cfg.is_no_rope_layer(3) and not cfg.is_no_rope_layer(0)  # transformers' default
    assert cfg.ffn_size == 96 and cfg.moe_ffn_size == 32 and cfg.use_rope_scaling
    llama4 = (cfg.qk_l2_norm, cfg.qk_l2_norm_rope_layers_only, cfg.attention_chunk_size,
              cfg.attn_temperature_floor_scale, cfg.attn_temperature_scale)
    assert llama4 == ((True, True, 16, 8, 0.3) if meta else (False, False, None, None, 0.1))
    mesh = ParallelMesh.single()
    model = build_model(get_family(cfg.model_type), cfg, mesh, seed=None).eval()
    load_model_weights(open_checkpoint(ck), [model], mesh)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids)
        theirs = hf(ids).logits
    ours = (ours[0] if isinstance(ours, tuple) else ours)[..., :128]
    assert rel_err(ours, theirs, floor=1.0) < 1e-5
    if meta:  # decoding with the KV cache past two chunk ends: transformers' greedy tokens
        from loom.inference.generate import SamplingConfig, generate
        want = hf.generate(ids[:1, :10], max_new_tokens=30, do_sample=False)[0, 10:].tolist()
        assert generate(model, ids[0, :10].tolist(), 30, SamplingConfig(greedy=True)) == want


def test_a_top_k_above_one_is_refused():
    from loom.models.gpt.hf_llama4 import read_config
    with pytest.raises(ConfigError, match="top-1 only"):
        read_config({"model_type": "llama4_text", **CONFIG, "num_experts_per_tok": 2},
                    "config.json")
