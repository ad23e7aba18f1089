"""Quantized Hugging Face checkpoints import at full precision (loom/interop/hf_quant.py):
tiny random models quantized here as the Hub ships them, then ``loom checkpoint convert
--from-hf``; the reference is ``transformers``' own dequantizing load (not loom's code):

* FP8 with block scales (DeepSeek-V3's ``weight_scale_inv``, ``weight_block_size``): loom's
  logits equal those of ``FineGrainedFP8Config(dequantize=True)`` (1e-5) and differ from the
  unquantized model's by the quantization error (so the scales were applied);
* MXFP4 (gpt-oss's ``*_blocks`` / ``*_scales`` experts): the same against
  ``Mxfp4Config(dequantize=True)``;
* a shape the block does not divide (DeepSeek-V3's 576-row ``kv_a_proj_with_mqa`` over blocks
  of 128) follows DeepSeek's definition element by element; other quantization methods, and
  fp8 weights without scales, are refused naming them."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_export_cases import V, _perturb, build  # noqa: E402
from loom.checkpoint.convert import from_hf  # noqa: E402
from loom.errors import ConfigError  # noqa: E402
from loom.interop.hf_quant import dequantize, fp8_dequantize  # noqa: E402
from test_hf_export import loom_logits  # noqa: E402
from testkit.numerics import rel_err  # noqa: E402

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def to_fp8(w: torch.Tensor, block: int) -> tuple:
    """``(W fp8, scale_inv)``: each ``block x block`` tile scaled so its largest value is 448
    (e4m3's largest), the ceil grid of scales (DeepSeek-V3's format)."""
    r, c = w.shape
    sr, sc = -(-r // block), -(-c // block)
    pad = torch.zeros(sr * block, sc * block)
    pad[:r, :c] = w
    scale = pad.view(sr, block, sc, block).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (pad.view(sr, block, sc, block) / scale[:, None, :, None]).view(pad.shape)[:r, :c]
    return q.to(torch.float8_e4m3fn), scale


def to_mxfp4(w: torch.Tensor) -> tuple:
    """``(blocks [E, r, G, 16] uint8, scales [E, r, G] uint8)`` of ``w [E, r, c]``: per 32
    values a power-of-two scale (e8m0, bias 127) and the nearest e2m1 value, two per byte (the
    even one in the low nibble; OCP MX format, as gpt-oss ships its experts)."""
    E, r, c = w.shape
    x = w.reshape(E, r, c // 32, 32)
    e = torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    idx = ((x / torch.exp2(e)[..., None])[..., None] - FP4).abs().argmin(-1).to(torch.uint8)
    return idx[..., 0::2] | (idx[..., 1::2] << 4), (e + 127).to(torch.uint8)


def save_quantized(model, path, quantize, quantization_config: dict) -> None:
    from safetensors.torch import load_file, save_file
    model.save_pretrained(path)
    out = {}
    for name, t in load_file(path / "model.safetensors").items():
        out.update(quantize(name, t) or {name: t})
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config,
                                                  "quantization_config": quantization_config}))


def check(tmp_path, model, reference_config) -> None:
    """loom's import of ``tmp_path / "src"`` against transformers' dequantizing load."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "src", quantization_config=reference_config, dtype=torch.float32).eval()
    from_hf(str(tmp_path / "src"), str(tmp_path / "ck"))
    ids = torch.randint(5, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs, unquantized = ref(ids).logits, model(ids).logits
    ours = loom_logits(str(tmp_path / "ck"), ids)
    assert rel_err(ours, theirs, floor=1.0) < 1e-5
    assert rel_err(ours, unquantized, floor=1.0) > 1e-4  # the quantized weights were read


def test_fp8_block_scaled_deepseek_v3_imports_as_transformers_dequantizes_it(tmp_path):
    model, _ = build("deepseek_v3")
    block = 4  # divides every shape of the tiny model (transformers derives it from the grid)

    def quantize(name, t):
        if name.endswith("proj.weight") or (".experts." in name and name.endswith(".weight")):
            q, scale = to_fp8(t, block)
            return {name: q, name + "_scale_inv": scale}
    save_quantized(model, tmp_path / "src", quantize,
                   {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": [block, block]})
    check(tmp_path, model, transformers.FineGrainedFP8Config(
        weight_block_size=[block, block], dequantize=True))


def test_mxfp4_gpt_oss_experts_import_as_transformers_dequantizes_them(tmp_path):
    torch.manual_seed(0)
    model = _perturb(transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}))).eval()

    def quantize(name, t):  # transformers holds [E, c, r]; the checkpoint [E, r, c / 32, 16]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = to_mxfp4(t.transpose(1, 2).contiguous())
            return {name + "_blocks": blocks, name + "_scales": scales}
    save_quantized(model, tmp_path / "src", quantize, {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]})
    check(tmp_path, model, transformers.Mxfp4Config(dequantize=True))


def test_a_block_grid_past_the_shape_is_deepseeks_definition():
    """DeepSeek-V3's ``weight_dequant``: element (i, j) times scale (i // 128, j // 128), the
    last blocks partial (576 rows = 4.5 blocks)."""
    torch.manual_seed(0)
    w = torch.randn(576, 200) * 3
    q, scale = to_fp8(w, 128)
    assert scale.shape == (5, 2)
    got = fp8_dequantize(q, scale, [128, 128], torch.float32)
    want = torch.empty(576, 200)
    for i in range(576):
        for jb in range(2):
            cols = slice(jb * 128, min(200, (jb + 1) * 128))
            want[i, cols] = q[i, cols].float() * scale[i // 128, jb]
    assert torch.equal(got, want)
    assert rel_err(got, w) < 0.07  # e4m3's 3 mantissa bits


def test_other_quantizations_and_unscaled_fp8_are_refused():
    sd = {"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}
    for qc, needle in (({"quant_method": "gptq"}, "'gptq'"),
                       ({"quant_method": "awq"}, "'awq'"),
                       ({"quant_method": "fp8", "weight_block_size": [2, 2]}, "fp8 without")):
        with pytest.raises(ConfigError, match=needle):
            dequantize({"quantization_config": qc}, sd, "--from-hf x")
    assert dequantize({}, sd, "x") is sd


def test_full_tensors_take_the_checkpoints_unquantized_dtype():
    """DeepSeek's checkpoints keep norms and embeddings in bf16 and scales in fp32: the
    dequantized weights are bf16."""
    q, scale = to_fp8(torch.randn(8, 8), 4)
    sd = {"a.weight_scale_inv": scale, "a.weight": q,
          "model.embed_tokens.weight": torch.zeros(10, 8, dtype=torch.bfloat16)}
    out = dequantize({"quantization_config": {"quant_method": "fp8",
                                              "weight_block_size": [4, 4]}}, sd, "x")
    assert out["a.weight"].dtype == torch.bfloat16 and "a.weight_scale_inv" not in out
