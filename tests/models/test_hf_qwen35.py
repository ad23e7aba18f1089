"""Qwen3.5 imports (``loom checkpoint convert --from-hf``): the text models (dense and MoE)
and the Hub's vision-language model, whose language model is taken (``text_config``,
``model.language_model.*``; the vision tower left out). Tiny random ``transformers`` models,
built from configs (no download): loom's logits equal the source's on text (its multimodal
RoPE is the 1-D one there), at fp32 (1e-5); an imported model exports as Qwen3-Next, whose
``transformers`` logits equal the source's too."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_export_cases import V, _perturb  # noqa: E402
from loom.checkpoint.convert import from_hf, to_hf  # noqa: E402
from test_hf_export import hf_model, loom_logits  # noqa: E402
from testkit.numerics import rel_err  # noqa: E402

TEXT = dict(vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, intermediate_size=40,
            head_dim=8, layer_types=["linear_attention", "full_attention", "linear_attention",
                                     "full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
            linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                             "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0],
                             "mrope_interleaved": True})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24)


def build(kind: str):
    T = transformers
    torch.manual_seed(0)
    if kind == "moe_text":
        m = T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**TEXT, **MOE))
    elif kind == "dense_text":
        m = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**TEXT))
    else:  # the Hub's checkpoints: vision-language, the language model nested
        m = T.Qwen3_5MoeForConditionalGeneration(T.Qwen3_5MoeConfig(
            text_config=dict(**TEXT, **MOE),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                               out_hidden_size=32, patch_size=4, temporal_patch_size=1,
                               spatial_merge_size=1)))
    with torch.no_grad():  # the Gated DeltaNet's decays away from their initial values
        for name, p in m.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.normal_(0.0, 0.5)
    return _perturb(m).eval()


@pytest.mark.parametrize("kind", ["moe_text", "dense_text", "moe_vl"])
def test_qwen35_imports_as_transformers_computes_it(tmp_path, kind):
    hf = build(kind)
    hf.save_pretrained(tmp_path / "src")
    from_hf(str(tmp_path / "src"), str(tmp_path / "ck"))
    ids = torch.randint(5, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        source = hf(input_ids=ids).logits
    assert float(source.abs().max()) > 0.1
    assert rel_err(loom_logits(str(tmp_path / "ck"), ids), source, floor=1.0) < 1e-5
    if kind != "moe_text":
        return
    to_hf(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == \
        "qwen3_next"
    with torch.no_grad():
        exported = hf_model(str(tmp_path / "out"), "qwen3_next")(ids).logits
    assert rel_err(exported, source, floor=1.0) < 1e-5


def test_the_hubs_qwen35_moe_config_reads_and_counts_as_published():
    """The Hub's Qwen3.5-35B-A3B ``config.json`` (transformers' Qwen3_5MoeConfig defaults: the
    vision-language model, its text config without a dense ``intermediate_size``, every layer
    MoE) reads into loom's model (``loom plan --from-hf``, the import): 256 experts on 40 layers,
    3 of 4 Gated DeltaNet, and the language model counts 35B within 2% (the vision tower is not
    imported)."""
    from loom.models.gpt.hf import read_config
    from loom.planner.memory import total_params
    hf = transformers.Qwen3_5MoeConfig().to_dict()
    assert "intermediate_size" not in hf["text_config"]
    cfg = read_config(hf, "config.json")
    assert (cfg.num_experts, cfg.num_layers, sum(map(cfg.is_gdn_layer, range(40)))) == \
        (256, 40, 30)
    assert total_params(cfg) == pytest.approx(35e9, rel=0.02)
