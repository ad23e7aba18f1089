"""The residual-stream and QK-norm variants of the GPT layer (:mod:`loom.config.model_variants`).

``--apply-residual-connection-post-layernorm`` against ``transformers``' ``BloomBlock`` (BLOOM
was trained with Megatron-DeepSpeed's flag of the same name and keeps it in its config): the
same weights, ALiBi zeroed (its only difference from loom's GPT-2 layer with the tanh GeLU),
two stacked layers, outputs and every gradient equal, with the flag and without it (the
control), and the flag changes both. Megatron-Core (0.16.1, the suite's usual reference)
declares the field but its ``TransformerLayer`` never reads it, which the last test pins.

``--fp32-residual-connection`` under bf16: Megatron-Core 0.16.1's local layers cannot run it on
CPU (torch's CPU LayerNorm refuses an fp32 input with bf16 weights, and its bias-dropout-add
casts the residual back to 16 bits, which Megatron-LM d98e8a6 fixed); the reference is the
layer's wiring spelled out on loom's own blocks: the residual and the upcast block outputs
added in fp32, the norms computed in fp32 and returned in bf16.

``--qk-l2-norm``: active here; equal to Megatron-Core's model in
tests/models/test_megatron_reference.py's ``qk_l2`` row.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

from loom.models import get_family
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import build_model
from loom.parallel.pipeline.schedules import p2p_dtype
from loom.training.precision import precision_forward_step
from testkit.config import tiny_config, tiny_model
from testkit.numerics import PARITY_RTOL, rel_err

S, B, H, A = 8, 2, 32, 4


def _bloom_stack(post_ln: bool):
    from transformers import BloomConfig
    from transformers.models.bloom.modeling_bloom import BloomBlock
    cfg = BloomConfig(hidden_size=H, n_head=A, layer_norm_epsilon=1e-5, hidden_dropout=0.0,
                      attention_dropout=0.0, apply_residual_connection_post_layernorm=post_ln)
    return [BloomBlock(cfg, layer_idx=i) for i in range(2)]


def _load_bloom(block, layer) -> None:
    """loom's layer weights into a ``BloomBlock``: QKV rows from loom's ``[Q; K; V]`` blocks to
    BLOOM's per-head ``[q, k, v]``."""
    d = H // A

    def per_head(t):
        q, k, v = (x.reshape(A, d, *t.shape[1:]) for x in t.chunk(3))
        return torch.stack([q, k, v], dim=1).reshape(t.shape)
    att, mlp = layer.self_attention, layer.mlp
    pairs = [(block.input_layernorm, layer.input_layernorm),
             (block.post_attention_layernorm, layer.pre_mlp_layernorm),
             (block.self_attention.dense, att.linear_proj),
             (block.mlp.dense_h_to_4h, mlp.linear_fc1), (block.mlp.dense_4h_to_h, mlp.linear_fc2)]
    with torch.no_grad():
        for theirs, ours in pairs:
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias)
        block.self_attention.query_key_value.weight.copy_(per_head(att.linear_qkv.weight))
        block.self_attention.query_key_value.bias.copy_(per_head(att.linear_qkv.bias))


def _run_loom(post_ln: bool, x: torch.Tensor):
    cfg = tiny_model("gpt", openai_gelu=True, seq_length=S,
                     apply_residual_connection_post_layernorm=post_ln)
    model = build_model(get_family("gpt"), cfg, ParallelMesh.single(), seed=7)
    x = x.clone().requires_grad_(True)
    y = x
    for i in ("0", "1"):
        y = model.layers[i](y, None, torch.arange(S))
    (y * torch.linspace(-1, 1, H)).sum().backward()
    return model, y, x.grad


def _run_bloom(post_ln: bool, model, x: torch.Tensor):
    blocks = _bloom_stack(post_ln)
    for i, block in enumerate(blocks):
        _load_bloom(block, model.layers[str(i)])
    x = x.transpose(0, 1).clone().requires_grad_(True)  # [b, s, h]
    alibi = torch.zeros(B * A, 1, S)
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    y = x
    for block in blocks:
        y = block(y, alibi, mask)[0]
    (y * torch.linspace(-1, 1, H)).sum().backward()
    return blocks, y.transpose(0, 1), x.grad.transpose(0, 1)


@pytest.mark.parametrize("post_ln", [False, True])
def test_post_layernorm_residual_matches_bloom(post_ln):
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    model, ours, dx = _run_loom(post_ln, x)
    blocks, theirs, dx_ref = _run_bloom(post_ln, model, x)
    assert rel_err(ours, theirs) < PARITY_RTOL
    assert rel_err(dx, dx_ref) < PARITY_RTOL
    for i, block in enumerate(blocks):
        layer = model.layers[str(i)]
        assert rel_err(layer.mlp.linear_fc1.weight.grad, block.mlp.dense_h_to_4h.weight.grad) \
            < PARITY_RTOL
        assert rel_err(layer.input_layernorm.weight.grad, block.input_layernorm.weight.grad) \
            < PARITY_RTOL
        assert rel_err(layer.self_attention.linear_proj.weight.grad,
                       block.self_attention.dense.weight.grad) < PARITY_RTOL
    _, other, other_dx = _run_loom(not post_ln, x)  # the flag changes output and gradient
    assert rel_err(other, ours) > 1e-2 and rel_err(other_dx, dx) > 1e-2


def test_megatron_core_layer_does_not_read_the_post_layernorm_flag():
    """Why BLOOM is the reference: Megatron-Core 0.16.1 declares
    ``apply_residual_connection_post_layernorm`` but no layer reads it. If a release starts to,
    this fails: then compare loom against it."""
    spec = importlib.util.find_spec("megatron")  # the sources, read without importing them
    if spec is None:
        pytest.skip("megatron-core is not installed")
    root = pathlib.Path(spec.submodule_search_locations[0]) / "core" / "transformer"
    name = "apply_residual_connection_post_layernorm"
    assert name in (root / "transformer_config.py").read_text()
    assert name not in (root / "transformer_layer.py").read_text()


def _reference_layer(layer, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The fp32 residual spelled out: norms in fp32 (weights upcast) returned in bf16, the
    bf16 block outputs upcast and added to the fp32 residual."""
    def norm(m, t):
        return F.layer_norm(t.float(), m.normalized_shape, m.weight.float(), m.bias.float(),
                            m.eps).to(torch.bfloat16)
    h = norm(layer.input_layernorm, x)
    x = x.float() + layer.self_attention(h, None, positions).float()
    return x + layer.mlp(norm(layer.pre_mlp_layernorm, x)).float()


def _bf16_model(fp32_residual: bool):
    cfg = tiny_config("gpt", bf16=True, fp32_residual_connection=fp32_residual, world=1).model
    model = build_model(get_family("gpt"), cfg, ParallelMesh.single(), seed=3)
    return model.to(torch.bfloat16)


def test_fp32_residual_stream_under_bf16():
    ids = torch.randint(0, 100, (B, 16), generator=torch.Generator().manual_seed(5))
    model = _bf16_model(True)
    seen = []
    hooks = [m.register_forward_hook(lambda mod, a, out: seen.append(out.dtype))
             for m in (model.embedding, *model.layers.values(), model.final_layernorm)]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=torch.roll(ids, -1, 1))
        x = model.embedding(ids, torch.arange(16))
        want = x
        for layer in model.layers.values():
            want = _reference_layer(layer, want, torch.arange(16))
        got = model.layers["1"](model.layers["0"](x, None, torch.arange(16)), None,
                                torch.arange(16))
    for h in hooks:
        h.remove()
    assert seen[:4] == [torch.float32] * 3 + [torch.bfloat16]  # embedding, layers; final norm
    assert torch.equal(got, want)  # the same ops in the same order
    plain = _bf16_model(False)
    with torch.no_grad():
        y = plain.embedding(ids, torch.arange(16))
        assert y.dtype == torch.bfloat16
        for layer in plain.layers.values():
            y = layer(y, None, torch.arange(16))
        other = plain(input_ids=ids, labels=torch.roll(ids, -1, 1))
    assert y.dtype == torch.bfloat16 and rel_err(y, got) > 1e-4  # the flag changed the sums
    assert torch.isfinite(loss).all() and not torch.equal(loss, other)


def test_fp32_residual_travels_in_fp32_between_stages():
    """Megatron overrides ``pipeline_dtype`` to fp32 with the flag: loom's p2p buffers are fp32
    and a received fp32 hidden state is not rounded to bf16 on arrival."""
    assert p2p_dtype([_bf16_model(True)]) == torch.float32
    assert p2p_dtype([_bf16_model(False)]) == torch.bfloat16
    got = []
    for keep in (True, False):
        step = precision_forward_step(lambda chunk, batch, h: (got.append(h.dtype), None),
                                      torch.bfloat16, None, fp32_residual=keep)
        step(None, {}, torch.ones(2, dtype=torch.float32))
    assert got == [torch.float32, torch.bfloat16]


def test_qk_l2_norm_is_active():
    """Unit mean square per head, in the input's dtype; parameterless norms in the QK slots
    change the model's output (its parity with Megatron-Core: the reference test's row)."""
    from loom.models.attention import L2Norm
    x = torch.randn(S, B, A, 8, generator=torch.Generator().manual_seed(2)) * 3
    got = L2Norm(1e-5)(x)
    assert rel_err(got.pow(2).mean(-1), torch.ones(S, B, A)) < 1e-5
    assert L2Norm(1e-5)(x.bfloat16()).dtype == torch.bfloat16
    out = {}
    for flag in (False, True):
        cfg = tiny_model("llama", qk_l2_norm=flag, seq_length=S)
        model = build_model(get_family("gpt"), cfg, ParallelMesh.single(), seed=7)
        attn = model.layers["0"].self_attention
        assert (attn.q_layernorm is not None) == flag and not list(attn.q_layernorm.parameters()
                                                                    if flag else [])
        with torch.no_grad():
            out[flag] = model(input_ids=torch.arange(2 * S).view(2, S) % 100)
    assert rel_err(out[True], out[False]) > 1e-3
