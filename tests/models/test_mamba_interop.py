"""loom's pure Mamba-2 layout equals transformers' ``Mamba2ForCausalLM`` (built from a config
with random weights, its torch path on CPU): the logits over the true vocabulary agree (rel.
1e-5) on 1 rank and at TP=2, each rank cutting its shard of the Hugging Face tensors through
the parameter registry. HF names map one to one (``backbone.`` prefix, ``norm`` ->
``input_layernorm``, ``norm_f`` -> ``final_layernorm``, conv weight ``[c, 1, k]`` -> ``[c, k]``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.models import get_family
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import build_model
from loom.parallel.registry import local_shard
from testkit import run_distributed
from testkit.numerics import rel_err
from mamba_helpers import tiny

def hf_logits_case(tp: int, perturb: bool = False) -> dict:
    """A random ``Mamba2ForCausalLM`` (its torch path on CPU) and loom's pure Mamba-2 model with
    its weights (each TP rank cutting its shard from the full tensors by the registry): max
    |logits| difference over the true vocabulary, relative to max |logits|."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny(None, num_layers=2, norm_epsilon=1e-5, mamba_chunk_size=5)
    hf_cfg = transformers.Mamba2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_heads=cfg.mamba_expand * cfg.hidden_size // cfg.mamba_head_dim,
        head_dim=cfg.mamba_head_dim, state_size=cfg.mamba_state_dim, n_groups=cfg.mamba_num_groups,
        expand=cfg.mamba_expand, conv_kernel=cfg.mamba_d_conv, chunk_size=cfg.mamba_chunk_size,
        layer_norm_epsilon=cfg.norm_epsilon, use_bias=False, use_conv_bias=True,
        tie_word_embeddings=False, residual_in_fp32=True)
    torch.manual_seed(0)
    hf = transformers.Mamba2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # norm weights, D and conv bias start at 1 or 0: make every map count
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    mesh = ParallelMesh.build(tp=tp) if tp > 1 else ParallelMesh.single()
    model = build_model(get_family("mamba"), cfg, mesh, seed=None).eval()
    fixed = {"embedding.word_embeddings.weight": "backbone.embeddings.weight",
             "final_layernorm.weight": "backbone.norm_f.weight", "output_layer.weight": "lm_head.weight"}
    with torch.no_grad():
        for name, p in model.named_parameters():
            hf_name = fixed.get(name) or "backbone." + name.replace("input_layernorm", "norm")
            full = sd[hf_name][:, 0] if name.endswith("conv1d.weight") else sd[hf_name]  # [c, 1, k]
            p.copy_(local_shard(full, model.registry[name], mesh.tp_rank, mesh.tp_size, name))
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
        want = hf(ids).logits  # [b, s, V]
        got = model(input_ids=ids)  # [b, s, Vp/t]
        if perturb:  # the comparison must see a 1% change of one layer's decay rates
            model.layers["1"].mixer.A_log.mul_(1.01)
            got = model(input_ids=ids)
    Vp = got.shape[-1] * mesh.tp_size
    want_shard = F.pad(want, (0, Vp - cfg.vocab_size)).chunk(mesh.tp_size, -1)[mesh.tp_rank]
    return {"err": rel_err(got, want_shard, scale=want),
            "scale": float(want.abs().max())}


def test_matches_transformers_mamba2_single_rank():
    r = hf_logits_case(1)
    assert r["err"] < 1e-5 and r["scale"] > 1e-3, r
    assert hf_logits_case(1, perturb=True)["err"] > 1e-4


def _tp2() -> dict:
    return hf_logits_case(2)


def test_matches_transformers_mamba2_tp2():
    pytest.importorskip("transformers")
    for r in run_distributed(2, _tp2):
        assert r["err"] < 1e-5 and r["scale"] > 1e-3, r
