"""Initialization, residual-stream and QK-norm variants of :class:`~loom.config.sections.
ModelConfig`: Megatron-LM's ``--embedding-init-method-std``, ``--init-method-xavier-uniform``,
``--apply-residual-connection-post-layernorm``, ``--fp32-residual-connection`` and
``--qk-l2-norm`` (names,
meanings and defaults of Megatron-LM d98e8a6: ``TransformerConfig`` and
``megatron/training/argument_utils.py``), and the rules that refuse the combinations loom does
not build (:func:`check_layer_variants`).

- ``--embedding-init-method-std S``: the word (and learned position) embeddings drawn from
  N(0, S^2); every other weight keeps ``--init-method-std`` (an untied output layer too: it is
  Megatron's ``init_method``; under ``--use-mup`` it follows the embeddings). Unset: the
  embeddings use ``--init-method-std`` (``TransformerConfig.__post_init__``). Megatron's
  docstring also promises no weight decay on the embeddings; its optimizer does not implement
  that at d98e8a6 (the rule is commented out), and neither does loom.
- ``--init-method-xavier-uniform``: every linear weight ``U(-a, a)``, ``a = sqrt(6 / (fan_in +
  fan_out))`` (Glorot & Bengio 2010; ``torch.nn.init.xavier_uniform_``), output projections
  included (Megatron-LM sets ``init_method`` and ``scaled_init_method`` both to Xavier; the
  second name is no ``TransformerConfig`` field at d98e8a6, so Megatron-LM itself stops there
  with a TypeError). The embeddings too, unless ``--embedding-init-method-std`` gives them
  another std (Megatron's ``embedding_init_method`` falls back to ``init_method``). The fans
  are the full matrix's (loom initializes unsharded tensors, so every layout starts from the
  same weights): Megatron's default GPU initialization draws each TP shard with the shard's
  fans, its ``--use-cpu-initialization`` the full one, as loom.
- ``--apply-residual-connection-post-layernorm``: the pre-LN layer's residual taken from the
  norm's output, ``y = LN(x) + f(LN(x))`` for attention and MLP alike (Megatron's legacy
  ``ParallelTransformerLayer``; BLOOM's ``apply_residual_connection_post_layernorm``).
  Megatron-Core 0.16 declares the field but its ``TransformerLayer`` never reads it.
- ``--fp32-residual-connection`` (with ``--bf16`` / ``--fp16``, as Megatron requires): the
  residual stream in fp32: the embedding output cast to fp32, each block's 16-bit output
  added to it in fp32 (Megatron-LM d98e8a6's bias-dropout-add), norms computed in fp32 with
  16-bit outputs, hidden states between pipeline stages in fp32.
- ``--torchtitan-init`` (loom's own; a torchtitan ``--config`` sets it): torchtitan v0.2.2's
  ``init_weights`` of its Llama 3 / Qwen3 / DeepSeek-V3 / Llama 4 models and MoE layers
  (:func:`loom.models.init.torchtitan_init`): word embeddings N(0, 1); query, key, value (MLA's
  down and up projections too) and the MLP's gate N(0, 0.02^2); layer l's attention output,
  the MLP's up and down projections (dense, routed and shared experts) and the router N(0,
  s_l^2) with s_l = 0.02 / sqrt(2 (l + 1)) (its ``depth_init``); norms one; the output layer
  (and a tied embedding) N(0, 1 / h) cut at 3 std; the normal draws cut at +-2 (absolute), as
  torchtitan's ``trunc_normal_``; gpt-oss (learnable sinks) draws every tensor of layer l from
  N(0, s_l^2), biases and sinks included, but the norms (one) and the router's bias (zero:
  torchtitan leaves it as built). The gpt family only.
- ``--qk-l2-norm`` (Llama 4): each query and key head scaled to unit mean square,
  ``x / sqrt(mean(x^2) + eps)`` with ``eps`` = ``--norm-epsilon``, in fp32, no parameters
  (Megatron-Core's ``L2Norm`` in the ``q_layernorm`` / ``k_layernorm`` slots, so before RoPE,
  which preserves the norm; Llama 4 applies it after). Standard attention of the gpt family
  only; Megatron refuses it with multi-latent attention; loom also with ``--qk-layernorm``
  (Megatron's spec then silently builds the L2 norm alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from loom.config.fields import opt
from loom.errors import ConfigError


@dataclass
class LayerVariantFields:
    """The flags of the module docstring; a mixin of ModelConfig (all off by default)."""

    embedding_init_method_std: Optional[float] = opt(
        None, "standard deviation of the word and position embeddings' normal initialization "
              "(default: --init-method-std; other weights keep --init-method-std)", gt=0)
    init_method_xavier_uniform: bool = opt(
        False, "Xavier-uniform initialization U(+-sqrt(6 / (fan_in + fan_out))) of every linear "
               "weight (output projections included) and of the embeddings unless "
               "--embedding-init-method-std is given; fans of the full matrix")
    apply_residual_connection_post_layernorm: bool = opt(
        False, "take each block's residual from the LayerNorm output, LN(x) + f(LN(x)), "
               "instead of its input (legacy Megatron / BLOOM; gpt family)")
    fp32_residual_connection: bool = opt(
        False, "keep the residual stream in fp32 under --bf16 / --fp16: embeddings and block "
               "outputs added in fp32, norms computed in fp32 (gpt family)")
    qk_l2_norm: bool = opt(False, "Llama 4's L2 normalization of each query and key head "
                                  "(unit mean square, no weights; gpt family)")
    torchtitan_init: bool = opt(
        False, "initialize as torchtitan's models do (loom's own flag; set by a torchtitan "
               "--config): word embeddings N(0, 1), query / key / value and MLP gate "
               "projections N(0, 0.02^2), layer l's attention output, MLP up and down "
               "projections and router N(0, 0.02^2 / (2 (l + 1))), the output layer N(0, 1/h) "
               "cut at 3 std (gpt family)")

    @property
    def embedding_std(self) -> Optional[float]:
        """The embeddings' normal std, or None when they take Xavier (``--init-method-xavier-
        uniform`` without another ``--embedding-init-method-std``; Megatron's fallback to
        ``init_method`` when the stds are equal)."""
        std = self.embedding_init_method_std
        if self.init_method_xavier_uniform and (std is None or std == self.init_method_std):
            return None
        return self.init_method_std if std is None else std


def check_layer_variants(cfg: Any) -> None:
    """Refuse what loom does not build with these flags (``cfg``: the LoomConfig being
    validated, after ``--zero-stage`` is resolved). Raises a one-line ConfigError naming the
    flag and a fix."""
    m, t = cfg.model, cfg.training
    if m.fp32_residual_connection:
        if not (t.bf16 or t.fp16):  # Megatron-LM arguments.py:1374
            raise ConfigError("--fp32-residual-connection keeps the residual stream of --bf16 / "
                              "--fp16 training in fp32: add --bf16 or --fp16 (fp32 training "
                              "has it already), or drop it")
        if t.zero_stage == 3 or t.use_torch_fsdp2:
            raise ConfigError("--fp32-residual-connection with ZeRO-3 / --use-torch-fsdp2: "
                              "FSDP's mixed precision casts each layer's input to 16 bits; "
                              "drop one of them")
    if m.qk_l2_norm:
        if m.multi_latent_attention:  # Megatron's gpt_layer_specs asserts the same
            raise ConfigError("--qk-l2-norm is not supported with --multi-latent-attention "
                              "(nor in Megatron): drop one of them")
        if m.qk_layernorm:
            raise ConfigError("--qk-l2-norm and --qk-layernorm both normalize queries and keys "
                              "(Megatron's layer spec keeps the L2 norm alone): give one")
    if m.torchtitan_init:
        other = [f for f, on in (("--init-method-xavier-uniform", m.init_method_xavier_uniform),
                                 ("--use-mup", m.use_mup),
                                 ("--embedding-init-method-std",
                                  m.embedding_init_method_std is not None),
                                 ("--mtp-num-layers", bool(m.mtp_num_layers)),
                                 ("--hybrid-override-pattern",
                                  getattr(m, "hybrid_override_pattern", None) is not None),
                                 ("Gated DeltaNet layers", bool(getattr(m, "gated_delta_net",
                                                                        False))))
                 if on]
        if other:  # another family: its refuse_own_flags (loom/models/gpt/config.py)
            raise ConfigError(f"--torchtitan-init is torchtitan's initialization of its Llama, "
                              f"Qwen3, DeepSeek-V3, Llama 4 and gpt-oss models; with {other[0]} "
                              f"it has no rule: drop one of them")
    if t.weight_decay_norms_and_biases and m.apply_layernorm_1p:
        raise ConfigError("--weight-decay-norms-and-biases with --apply-layernorm-1p: Megatron's "
                          "norms hold w of the gain 1 + w, loom's the gain itself, whose decay "
                          "is not w's: drop one of them")
    if m.init_method_xavier_uniform:
        if m.softmax_type == "learnable":
            raise ConfigError("--init-method-xavier-uniform with --softmax-type learnable: the "
                              "1-D attention sinks have no fans (Megatron's init_method fails "
                              "on them too): drop one of them")
        if m.num_experts and not m.disable_bias_linear:
            raise ConfigError("--init-method-xavier-uniform on a MoE model with biases: the "
                              "router's 1-D bias has no fans (Megatron's init_method fails on "
                              "it too): add --disable-bias-linear or drop the flag")
