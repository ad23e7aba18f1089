"""GPT's config rules (its ``refuse_own_flags`` hook, :mod:`loom.models.family`): the features
only the GPT family builds (multi-latent attention, multi-token prediction, muP, gpt-oss's
sliding-window / sink attention, Qwen3-Next's attention output gate and Gated DeltaNet, the
post-LayerNorm and fp32 residual connections, QK L2 norms) refused in another family's config
with "drop it". The rules of the features themselves stay with their flags in
:mod:`loom.config` (``model_mla``, ``model_mup``, ``model_gptoss``, ``model_variants``): a GPT
config has no further family rule."""

from __future__ import annotations

from typing import Any

from loom.config.model_llama4 import LLAMA4_FLAGS
from loom.errors import ConfigError
from loom.models.family import other_family_flag, transformer_layers

layer_kinds = transformer_layers  # what the planner prices: transformer layers


def check(cfg: Any, world_size: int) -> None:
    """The GPT family's own resolution: ``--rotary-scaling-factor`` without YaRN or
    multi-latent attention has no effect, as in Megatron-LM (which reads it for those only,
    ``argument_utils._apply_yarn_config_from_args``; scripts give it beside
    ``--use-rope-scaling``, whose factor is ``--rope-scaling-factor``): dropped from the
    resolved config, said once by :mod:`loom.training.script_checks`."""
    m = cfg.model
    if m.rotary_scaling_factor is not None and m.position_embedding_type != "yarn" and \
            not m.multi_latent_attention:
        m.rotary_scaling_factor = None


def refuse_own_flags(m: Any) -> None:
    """GPT's own features in another family's model config ``m``: refused, "drop it"."""
    if m.multi_latent_attention:
        raise other_family_flag("multi_latent_attention", "an attention of --model-type gpt",
                                m.model_type)
    if m.mtp_num_layers:
        raise other_family_flag("mtp_num_layers", "multi-token prediction of --model-type gpt",
                                m.model_type)
    if m.window is not None or m.softmax_type != "vanilla":
        raise ConfigError("--window-size / --softmax-type apply to --model-type gpt's standard "
                          "attention: drop them (gemma3: --sliding-window)")
    if m.use_mup:
        raise ConfigError(f"--use-mup: loom implements muP for --model-type gpt (Megatron's "
                          f"GPTModel), not --model-type {m.model_type}: drop --use-mup")
    if m.attention_output_gate:
        raise ConfigError(f"--attention-output-gate: loom gates the attention of --model-type "
                          f"gpt only, not {m.model_type}: drop it")
    for name, what in (("apply_residual_connection_post_layernorm",
                        "the residual taken after the LayerNorm"),
                       ("fp32_residual_connection", "an fp32 residual stream"),
                       ("qk_l2_norm", "the L2-normalized queries and keys"),
                       ("torchtitan_init", "torchtitan's initialization"), *LLAMA4_FLAGS):
        if getattr(m, name):
            hint = " (its --post-layernorm is the original post-LN BERT)" \
                if m.model_type == "bert" and name.startswith("apply") else ""
            raise other_family_flag(name, f"{what} of --model-type gpt's layers{hint}",
                                    m.model_type)
    if m.gated_delta_net:
        raise ConfigError(f"--experimental-attention-variant "
                          f"{m.experimental_attention_variant} builds GPT layers; --model-type "
                          f"{m.model_type} has none: use --model-type gpt")
