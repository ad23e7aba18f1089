"""Interop: loom's GPT-2 and LLaMA layouts compute what `transformers` computes.

Random weights from a config (no download) are converted into loom by name; logits must match
GPT2LMHeadModel / LlamaForCausalLM to atol 1e-5, unsharded and under TP=2.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loom.interop.hf import load_full_state_dict  # noqa: E402
from loom.models.gpt.hf import gpt2_config, gpt2_to_loom, llama_config, llama_to_loom  # noqa: E402
from loom.models import get_family  # noqa: E402
from loom.parallel.mappings import gather_from_tensor_parallel_region  # noqa: E402
from loom.parallel.mesh import ParallelMesh  # noqa: E402
from loom.parallel.parallelize import build_model  # noqa: E402
from testkit import run_distributed  # noqa: E402
from testkit.numerics import UNIT_ATOL


def hf_models():
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=300, n_positions=32, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-6, tie_word_embeddings=False)).eval()
    return {"gpt2": (gpt, gpt2_config, gpt2_to_loom), "llama": (llama, llama_config, llama_to_loom)}


def compare(mesh: ParallelMesh) -> dict:
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, (hf, to_cfg, convert) in hf_models().items():
        cfg = to_cfg(hf.config)
        model = build_model(get_family("gpt"), cfg, mesh).eval()
        load_full_state_dict(model, convert(hf.state_dict(), cfg))
        with torch.no_grad():
            ref = hf(ids).logits
            logits = gather_from_tensor_parallel_region(model(ids), mesh.groups["tp"])[..., :cfg.vocab_size]
        out[name] = float((logits - ref).abs().max())
    return out


def compare_tp2() -> dict:
    return compare(ParallelMesh.build(tp=2))


def test_logits_match_transformers_single_process():
    for name, err in compare(ParallelMesh.single()).items():
        assert err < UNIT_ATOL, (name, err)


def test_logits_match_transformers_tp2():
    for rank in run_distributed(2, compare_tp2):
        for name, err in rank.items():
            assert err < UNIT_ATOL, (name, err)
