"""RoPE scaling and NoPE layers against their references:

* ``--use-rope-scaling`` / ``--rope-scaling-factor`` (Llama 3.1's frequency scaling) and
  ``--rotary-seq-len-interpolation-factor`` (linear position interpolation): the cos and sin a
  loom model builds from the flags equal Megatron-Core 0.16.1's
  ``RotaryEmbedding(rope_scaling=..., rope_scaling_factor=..., seq_len_interpolation_factor=...)``
  at positions up to 20000, with and without ``--rotary-percent``, and differ from plain RoPE;
* Hugging Face: a ``LlamaForCausalLM`` with ``rope_scaling`` llama3 or linear imports with the
  flags and gives its logits (Llama 4's llama3 scaling, high frequency factor 1, and another
  original context through loom's ``--rope-scaling-high-freq-factor`` /
  ``--rope-scaling-original-max-position-embeddings``); the exported ``config.json`` gives
  ``transformers`` the same ``rope_scaling``; other scalings are refused;
* generation: the KV-cached decode equals the full forward with every flag on.

Whole models with each flag (``--no-rope-freq`` too) against Megatron-Core's GPTModel:
tests/models/test_math_caps.py (its spawned world); the config refusals:
tests/unit/test_rope_flags.py.
"""

from __future__ import annotations

import pytest
import torch

from loom.config import LoomConfig, ModelConfig
from loom.errors import ConfigError
from loom.models import get_family
from loom.models.attention import rope_cos_sin
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import build_model
from testkit.config import tiny_config, tiny_model
from testkit.numerics import UNIT_ATOL


def llama(**kw) -> ModelConfig:
    return tiny_model("llama", dict(group_query_attention=True, ffn_hidden_size=64,
                                    vocab_size=256, num_layers=4, kv_channels=16,
                                    rotary_base=10000.0, seq_length=64), kw)


def validated(model: ModelConfig) -> LoomConfig:
    return tiny_config(model=model, world=1, mock_data=False, train_iters=10)


SCALINGS = {"llama3": dict(use_rope_scaling=True),
            "llama3-32-partial": dict(use_rope_scaling=True, rope_scaling_factor=32.0,
                                      rotary_percent=0.5),
            "interpolation": dict(rotary_seq_len_interpolation_factor=4),
            "both": dict(use_rope_scaling=True, rotary_seq_len_interpolation_factor=2)}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_cos_sin_match_megatron_core(monkeypatch, name):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    flags = SCALINGS[name]
    cfg = validated(llama(rotary_base=500000.0, **flags)).model
    ref = RotaryEmbedding(cfg.head_dim, cfg.rotary_percent, rotary_base=500000,
                          rope_scaling=cfg.use_rope_scaling,
                          rope_scaling_factor=cfg.rope_scaling_factor,
                          seq_len_interpolation_factor=cfg.rotary_seq_len_interpolation_factor,
                          use_cpu_initialization=True)
    model = build_model(get_family("gpt"), cfg, ParallelMesh.single())
    for offset in (0, 1000, 20000):
        positions = torch.arange(offset, offset + 64)
        cos, sin = model.layer_inputs(positions, None, {})[0]
        emb = ref.get_emb(64, offset)[:, 0, 0, :]
        torch.testing.assert_close(cos, emb.cos(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin, emb.sin(), rtol=1e-6, atol=1e-6)
        plain, _ = rope_cos_sin(positions, cfg.rotary_dim, cfg.rotary_base)
        if offset:  # the scaling is active (low frequencies: far positions)
            assert (plain - cos).abs().max() > 0.1, (name, offset)


def test_generation_with_the_kv_cache_equals_the_full_forward():
    """Decoding token by token (positions from the cache) gives the full sequence's logits
    with every flag on, NoPE layers included; ``generate`` runs."""
    from loom.inference.generate import generate
    cfg = validated(llama(use_rope_scaling=True, rotary_seq_len_interpolation_factor=2,
                          no_rope_freq="2")).model
    model = build_model(get_family("gpt"), cfg, ParallelMesh.single()).eval()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(input_ids=ids)
        cache = model.allocate_cache(1, 40)
        steps = [model(input_ids=ids[:, :30], cache=cache)]
        cache.length = 30
        for t in range(30, 40):
            steps.append(model(input_ids=ids[:, t:t + 1], cache=cache))
            cache.length += 1
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=UNIT_ATOL)
    assert len(generate(model, ids[0, :30].tolist(), 5)) == 5


# -- Hugging Face -----------------------------------------------------------------------------

HF_SCALINGS = {
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
               dict(use_rope_scaling=True, rope_scaling_factor=8.0)),
    # Llama 4's (Scout's config.json): no blended band, loom's own band flags
    "llama4": ({"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
               dict(use_rope_scaling=True, rope_scaling_factor=16.0,
                    rope_scaling_high_freq_factor=1.0)),
    "llama3-4096": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 4096},
                    dict(use_rope_scaling=True,
                         rope_scaling_original_max_position_embeddings=4096)),
    "linear": ({"rope_type": "linear", "factor": 4.0},
               dict(rotary_seq_len_interpolation_factor=4))}


def _hf_llama(rope_scaling):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=16384, rms_norm_eps=1e-6, tie_word_embeddings=False,
        initializer_range=0.15, rope_scaling=rope_scaling)).eval()
    return hf


@pytest.mark.parametrize("name", sorted(HF_SCALINGS))
def test_hf_llama_with_rope_scaling_imports_with_the_flags(name):
    from loom.interop.hf import load_full_state_dict
    from loom.models.gpt.hf import hf_config, llama_config, llama_to_loom
    transformers = pytest.importorskip("transformers")
    scaling, flags = HF_SCALINGS[name]
    hf = _hf_llama(scaling)
    cfg = llama_config(hf.config)
    assert {k: getattr(cfg, k) for k in flags} == flags
    ids = torch.randint(0, 300, (1, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        logits = {}
        for key, c in (("with", cfg), ("without", llama_config(_hf_llama(None).config))):
            model = build_model(get_family("gpt"), c, ParallelMesh.single()).eval()
            load_full_state_dict(model, llama_to_loom(hf.state_dict(), c))
            logits[key] = model(ids)[..., :300]
    assert float((logits["with"] - want).abs().max()) < UNIT_ATOL * max(1, want.abs().max())
    assert float((logits["without"] - want).abs().max()) > 1e-3  # the scaling matters here
    exported = transformers.LlamaConfig(**hf_config(cfg))
    got = exported.rope_parameters
    assert {k: got[k] for k in scaling} == scaling, got
    assert llama_config(exported) == cfg


@pytest.mark.parametrize("scaling, match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "type 'dynamic'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, "need 0 < low <= high"),
    ({"rope_type": "linear", "factor": 2.5}, "an int >= 1")])
def test_hf_llama_with_other_rope_scalings_is_refused(scaling, match):
    from loom.models.gpt.hf import llama_config
    with pytest.raises(ConfigError, match=match):
        llama_config(_hf_llama(scaling).config)


def test_export_refuses_what_hf_cannot_hold():
    from loom.models.gpt.hf import hf_config
    both = validated(llama(use_rope_scaling=True, rotary_seq_len_interpolation_factor=2)).model
    with pytest.raises(ConfigError, match="holds one of them"):
        hf_config(both)
    with pytest.raises(ConfigError, match="--no-rope-freq"):
        hf_config(validated(llama(no_rope_freq="2")).model)
