"""The config side of ``--embedding-init-method-std``, ``--init-method-xavier-uniform``,
``--apply-residual-connection-post-layernorm``, ``--fp32-residual-connection`` and
``--qk-l2-norm``
(:mod:`loom.config.model_variants`): Megatron's command line parses into the fields, and what
loom does not build is refused before any process group starts, in one line naming the flag
and the fix. The model math: tests/models/test_layer_variants.py and
tests/models/test_init_variants.py."""

from __future__ import annotations

import argparse

import pytest

from loom.config import add_config_arguments, config_from_args
from loom.errors import ConfigError
from loom.models import resolve_config
from loom.models.gpt.hf import hf_config
from testkit.config import tiny_config, tiny_model


def test_megatron_command_line_parses():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters",
            "5", "--vocab-size", "128", "--bf16", "--embedding-init-method-std", "0.5",
            "--init-method-xavier-uniform", "--apply-residual-connection-post-layernorm",
            "--fp32-residual-connection"]
    m = resolve_config(config_from_args(parser.parse_args(argv)), 1).model
    assert m.embedding_init_method_std == 0.5 and m.init_method_xavier_uniform
    assert m.apply_residual_connection_post_layernorm and m.fp32_residual_connection
    assert m.embedding_std == 0.5  # a std other than --init-method-std: normal, not Xavier


@pytest.mark.parametrize("family,flags,match", [
    ("gpt", dict(fp32_residual_connection=True), "add --bf16 or --fp16"),
    ("gpt", dict(fp32_residual_connection=True, bf16=True, use_torch_fsdp2=True),
     "--fp32-residual-connection with ZeRO-3"),
    ("gpt", dict(init_method_xavier_uniform=True, softmax_type="learnable"),
     "1-D attention sinks"),
    ("moe", dict(init_method_xavier_uniform=True, disable_bias_linear=False),
     "add --disable-bias-linear"),
    ("mamba", dict(apply_residual_connection_post_layernorm=True),
     "--model-type mamba does not have: drop --apply-residual-connection-post-layernorm"),
    ("mamba", dict(fp32_residual_connection=True, bf16=True),
     "--model-type mamba does not have: drop --fp32-residual-connection"),
    ("gpt", dict(model_type="bert", apply_residual_connection_post_layernorm=True),
     "its --post-layernorm is the original post-LN BERT"),
    ("gpt", dict(model_type="gemma3", fp32_residual_connection=True, bf16=True),
     "--model-type gemma3 does not have"),
    ("gpt", dict(embedding_init_method_std=0.0), "--embedding-init-method-std"),
    ("llama", dict(qk_l2_norm=True, qk_layernorm=True), "give one"),
    ("llama", dict(qk_l2_norm=True, multi_latent_attention=True), "--multi-latent-attention"),
    ("mamba", dict(qk_l2_norm=True), "drop --qk-l2-norm"),
])
def test_refusals_are_one_line(family, flags, match):
    with pytest.raises(ConfigError, match=match) as e:
        tiny_config(family, world=1, **flags)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flags", [dict(fp32_residual_connection=True, bf16=True),
                                   dict(fp32_residual_connection=True, fp16=True),
                                   dict(init_method_xavier_uniform=True),
                                   dict(apply_residual_connection_post_layernorm=True),
                                   dict(qk_l2_norm=True)])
def test_gpt_accepts(flags):
    tiny_config("moe", world=1, **flags)


def test_hf_export_refuses_the_post_layernorm_residual():
    assert hf_config(tiny_model("llama"))["model_type"] == "llama"
    with pytest.raises(ConfigError, match="no Hugging Face layout") as e:
        hf_config(tiny_model("llama", apply_residual_connection_post_layernorm=True))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--qk-l2-norm True has no Hugging Face"):
        hf_config(tiny_model("llama", qk_l2_norm=True))
    assert hf_config(tiny_model("llama", init_method_xavier_uniform=True,
                                embedding_init_method_std=1.0))["model_type"] == "llama"


def test_megatron_args_carry_no_residual_variant():
    """A Megatron-LM checkpoint's saved args: Megatron-Core trained the plain pre-LN residual
    whatever ``apply_residual_connection_post_layernorm`` says, and fp32 residuals are the
    saving run's precision, so neither reaches loom's model; the init flags copy across."""
    from loom.checkpoint.megatron.args import model_fields, model_flags
    args = argparse.Namespace(num_layers=3, apply_residual_connection_post_layernorm=True,
                              fp32_residual_connection=True, embedding_init_method_std=0.5,
                              init_method_xavier_uniform=True)
    flags = model_flags(args, model_fields(), hybrid=False)
    assert flags["num_layers"] == 3 and flags["embedding_init_method_std"] == 0.5
    assert flags["init_method_xavier_uniform"] is True
    assert "apply_residual_connection_post_layernorm" not in flags
    assert "fp32_residual_connection" not in flags
