"""``--use-rope-scaling``, ``--rope-scaling-factor``, ``--rotary-seq-len-interpolation-factor``
and ``--no-rope-freq`` as configuration: Megatron's spellings parse into the fields, the
combinations Megatron ignores or fails on are refused in one line naming the flag, the NoPE
layers are Megatron's pattern, and a Megatron checkpoint's ``args`` carry the flags both ways.
Their math against Megatron-Core and transformers: tests/models/test_rope_scaling.py and
tests/models/test_math_caps.py."""

from __future__ import annotations

import argparse

import pytest

from loom.config import add_config_arguments, config_from_args
from loom.errors import ConfigError
from testkit.config import tiny_config


def resolved(family: str = "llama", **flat):
    return tiny_config(family, world=1, **flat)


def test_megatron_spellings_parse_into_the_fields():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2",
            "--mock-data", "--vocab-size", "96", "--position-embedding-type", "rope",
            "--use-rope-scaling", "--rope-scaling-factor", "32",
            "--rotary-seq-len-interpolation-factor", "2", "--no-rope-freq", "([0]*3+[1])"]
    m = config_from_args(parser.parse_args(argv)).validate(1).model
    assert (m.use_rope_scaling, m.rope_scaling_factor, m.rotary_seq_len_interpolation_factor) \
        == (True, 32.0, 2)
    assert m.rope_scaling_args() == dict(interpolation=2, llama3_factor=32.0,
                                         llama3_bands=(1.0, 4.0, 8192))  # Megatron's fixed
    assert [m.is_no_rope_layer(i) for i in range(4)] == [False, False, False, True]


@pytest.mark.parametrize("freq, want", [("4", [0, 0, 0, 1, 0, 0, 0, 1]),
                                        ("1", [1] * 8), ("0", [0] * 8),
                                        ("[1]+[0]*7", [1] + [0] * 7)])
def test_no_rope_layers_are_megatrons_pattern(freq, want):
    """Megatron's ``TransformerConfig``: an int N expands to ``([0]*(N-1)+[1]) * (L/N)`` (1 =
    no RoPE; N = 0 is falsy: none); a list is taken as it is."""
    m = resolved(num_layers=8, no_rope_freq=freq).model
    assert [int(m.is_no_rope_layer(i)) for i in range(8)] == want


def test_a_nope_layer_does_not_rotate_in_gpt_and_hybrid_stacks():
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    gpt = build_model(get_family("gpt"), resolved(num_layers=4, no_rope_freq="2").model,
                      ParallelMesh.single())
    assert [gpt.layers[str(i)].self_attention.rotates for i in range(4)] == \
        [True, False, True, False]
    hybrid = resolved("mamba", hybrid_override_pattern="M*M*", position_embedding_type="rope",
                      no_rope_freq="[0,0,0,1]", rotary_seq_len_interpolation_factor=2).model
    model = build_model(get_family("mamba"), hybrid, ParallelMesh.single())
    assert [model.layers[str(i)].self_attention.rotates for i in (1, 3)] == [True, False]


@pytest.mark.parametrize("family, flat, match", [
    ("gpt", dict(use_rope_scaling=True), "--use-rope-scaling acts on RoPE: add "
                                         "--position-embedding-type rope"),
    ("llama", dict(position_embedding_type="yarn", rotary_seq_len_interpolation_factor=2),
     "--rotary-seq-len-interpolation-factor with YaRN"),
    ("llama", dict(enable_gpt_oss=True, use_rope_scaling=True), "--use-rope-scaling with YaRN"),
    ("llama", dict(multi_latent_attention=True, no_rope_freq="2", num_layers=2),
     "--no-rope-freq with --multi-latent-attention"),
    ("llama", dict(rope_scaling_factor=32.0), "--rope-scaling-factor 32 scales RoPE under "
                                              "--use-rope-scaling only"),
    ("llama", dict(rotary_seq_len_interpolation_factor=0),
     "--rotary-seq-len-interpolation-factor must be >= 1"),
    ("llama", dict(num_layers=4, no_rope_freq="3"), "--num-layers 4 must be a multiple"),
    ("llama", dict(num_layers=4, no_rope_freq="[1,0]"), "has 2 entries"),
    ("llama", dict(no_rope_freq="every"), "give an int N"),
    ("llama", dict(no_rope_freq="2", mtp_num_layers=1), "--no-rope-freq with --mtp-num-layers"),
    ("mamba", dict(hybrid_override_pattern="M*M*", position_embedding_type="rope",
                   use_rope_scaling=True), "Megatron's hybrid model"),
])
def test_refused_where_megatron_ignores_or_fails(family, flat, match):
    with pytest.raises(ConfigError, match=match) as e:
        resolved(family, **flat)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flat", [dict(use_rope_scaling=True),
                                  dict(rotary_seq_len_interpolation_factor=2),
                                  dict(no_rope_freq="2")])
def test_gemma3_keeps_its_own_rope(flat):
    from testkit.config import tiny_model
    model = tiny_model("llama", model_type="gemma3", swiglu=False,
                       untie_embeddings_and_output_weights=False, **flat)
    with pytest.raises(ConfigError, match="Gemma 3's own RoPE"):
        tiny_config(model=model, world=1)


@pytest.mark.parametrize("freq, saved", [("4", 4), ("[0,1,0,1]", [0, 1, 0, 1])])
def test_megatron_checkpoint_args_carry_the_flags(freq, saved):
    """``common.pt``'s ``args`` hold Megatron's types (``no_rope_freq`` an int or a list) and
    read back into the same fields."""
    from loom.checkpoint.megatron.args import model_fields, model_flags
    from loom.checkpoint.megatron.writer import megatron_args
    cfg = resolved(num_layers=4, use_rope_scaling=True, rope_scaling_factor=32.0,
                   rotary_seq_len_interpolation_factor=2, no_rope_freq=freq)
    args = megatron_args(cfg.model, cfg.to_flat(), 1, 0, 1, optimizer=False)
    assert (args.no_rope_freq, args.use_rope_scaling, args.rope_scaling_factor,
            args.rotary_seq_len_interpolation_factor) == (saved, True, 32.0, 2)
    flags = model_flags(args, model_fields(), hybrid=False)
    assert (flags["no_rope_freq"], flags["use_rope_scaling"], flags["rope_scaling_factor"],
            flags["rotary_seq_len_interpolation_factor"]) == (freq, True, 32.0, 2)


def test_the_llama3_bands_are_loom_own_and_refused_alone():
    """loom's --rope-scaling-low/high-freq-factor and --rope-scaling-original-max-position-
    embeddings (Megatron fixes 1, 4, 8192; Llama 4 has high 1) shape --use-rope-scaling only,
    with low <= high."""
    m = resolved(position_embedding_type="rope", use_rope_scaling=True,
                 rope_scaling_factor=16.0, rope_scaling_high_freq_factor=1.0).model
    assert m.rope_scaling_args()["llama3_bands"] == (1.0, 1.0, 8192)
    with pytest.raises(ConfigError, match="shape --use-rope-scaling: add it or drop them"):
        resolved(position_embedding_type="rope", rope_scaling_high_freq_factor=1.0)
    with pytest.raises(ConfigError, match="exceeds --rope-scaling-high-freq-factor"):
        resolved(position_embedding_type="rope", use_rope_scaling=True,
                 rope_scaling_low_freq_factor=4.0, rope_scaling_high_freq_factor=1.0)
