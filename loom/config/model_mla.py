"""Multi-latent attention, YaRN RoPE scaling and multi-token prediction fields of
:class:`~loom.config.sections.ModelConfig` (DeepSeek-V2/V3; Megatron-LM's flag names, meanings
and defaults: ``megatron/training/arguments.py`` ``_add_mla_args`` and ``TransformerConfig``),
and their checks (:func:`check_mla`, part of the one validation pass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from loom.config.fields import opt
from loom.errors import ConfigError

RopeType = Literal["rope", "yarn"]


@dataclass
class MLAFields:
    """MLA / YaRN / MTP flags; a mixin of ModelConfig (off by default: standard attention,
    no extra prediction depth)."""

    # -- multi-latent attention (DeepSeek-V2 sec. 2.1; Megatron's --multi-latent-attention) ----
    multi_latent_attention: bool = opt(False, "multi-latent attention (DeepSeek-V2/V3): "
                                              "low-rank joint key/value compression, decoupled "
                                              "RoPE key shared by the heads")
    q_lora_rank: Optional[int] = opt(None, "MLA: rank of the low-rank query compression "
                                           "(with its RMSNorm; default: a full query "
                                           "projection)", ge=1)
    kv_lora_rank: int = opt(32, "MLA: rank of the joint key/value compression (the latent "
                                "that generation caches)", ge=1)
    qk_head_dim: int = opt(128, "MLA: per-head query/key dimension without the positional "
                                "part (q head dim = this + --qk-pos-emb-head-dim)", ge=1)
    qk_pos_emb_head_dim: int = opt(64, "MLA: dimension of the decoupled RoPE part of queries "
                                       "and of the key shared across heads", ge=2)
    v_head_dim: int = opt(128, "MLA: per-head value dimension", ge=1)
    rope_type: Optional[RopeType] = opt(
        None, "RoPE variant of MLA: rope or yarn (default: yarn with "
              "--multi-latent-attention, else rope; standard attention takes rope only)")
    mscale: float = opt(1.0, "YaRN: mscale of the RoPE attention factor "
                             "(0.1 mscale ln(factor) + 1)", ge=0)
    mscale_all_dim: float = opt(0.0, "YaRN: mscale of the softmax-scale factor applied to all "
                                     "dimensions (0: none)", ge=0)
    yarn_original_max_position_embeddings: Optional[int] = opt(
        None, "YaRN: context length of the original (pre-extension) model (default 4096)", ge=1)
    yarn_beta_fast: Optional[float] = opt(None, "YaRN: beta fast of the frequency correction "
                                                "range (default 32)", gt=0)
    yarn_beta_slow: Optional[float] = opt(None, "YaRN: beta slow of the frequency correction "
                                                "range (default 1)", gt=0)
    yarn_correction_range_round_to_int: bool = opt(
        True, "YaRN of --position-embedding-type yarn: the correction range's bounds rounded "
              "to whole dimensions (multi-latent attention always rounds, as Megatron's)")
    # -- multi-token prediction (DeepSeek-V3 sec. 2.2; Megatron's --mtp-*) ---------------------
    mtp_num_layers: Optional[int] = opt(None, "multi-token prediction depth D: D sequential "
                                              "modules on the last pipeline stage predict "
                                              "tokens t+2 .. t+1+D (default and 0: "
                                              "none)", ge=1, zero_is_off=True)
    mtp_loss_scaling_factor: float = opt(0.1, "weight of the multi-token prediction loss (the "
                                              "mean over the D depths times this)", ge=0)

    @property
    def effective_rope_type(self) -> str:
        """``rope`` or ``yarn``: ``--rope-type``, or Megatron's default (yarn for MLA)."""
        return self.rope_type or ("yarn" if self.multi_latent_attention else "rope")

    def yarn_args(self) -> dict:
        """The YaRN keywords of :func:`loom.models.yarn.yarn_cos_sin` these flags give:
        ``factor`` (``--rotary-scaling-factor``, default 1), ``original_max`` (default 4096),
        ``beta_fast`` (32), ``beta_slow`` (1), ``mscale``, ``mscale_all_dim`` (Megatron's
        ``_apply_yarn_config_from_args`` defaults)."""
        return dict(factor=self.rotary_scaling_factor or 1.0,
                    original_max=self.yarn_original_max_position_embeddings or 4096,
                    beta_fast=self.yarn_beta_fast or 32.0, beta_slow=self.yarn_beta_slow or 1.0,
                    mscale=self.mscale, mscale_all_dim=self.mscale_all_dim)

    @property
    def q_head_dim(self) -> int:
        """MLA's per-head query/key width: ``--qk-head-dim + --qk-pos-emb-head-dim``."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim


def check_mla(m: Any, tp: int, cp: int, pp: int) -> None:
    """Refuse MLA / YaRN / MTP flags that do not fit: MLA with grouped-query attention
    (Megatron's rule) or with --position-embedding-type yarn (Megatron asserts that no
    model-level rotary embedding reaches MLA), --rope-type yarn without MLA, YaRN with a
    partial rotary percent, --mtp-num-layers with learned positions under pipelining (``tp``,
    ``cp``, ``pp``: the parallel sizes). Raises ConfigError naming the flag and a fix for this
    model.

    MLA applies its own RoPE (``--rope-type``) to the decoupled key whatever
    ``--position-embedding-type`` is: ``rope`` and ``none`` add nothing else, and
    ``learned_absolute`` (Megatron's default, e.g. its ``gpt3_mcore_te_tp2_pp2_mla`` functional
    test) adds the learned position table to the embedding as well (Megatron-Core's GPTModel
    builds no model-level rotary embedding under MLA, and its ``LanguageModelEmbedding`` adds
    the table for ``learned_absolute``)."""
    if m.rope_type == "yarn" and not m.multi_latent_attention:
        raise ConfigError("--rope-type yarn: loom (like Megatron) applies YaRN only in "
                          "multi-latent attention; add --multi-latent-attention or drop "
                          "--rope-type")
    if m.multi_latent_attention:  # another family refuses it (loom.models.gpt.config)
        if m.group_query_attention:
            raise ConfigError("--group-query-attention excludes --multi-latent-attention (the "
                              "latent is shared by every head already): drop "
                              "--group-query-attention")
        if m.position_embedding_type == "yarn":
            raise ConfigError("--position-embedding-type yarn with --multi-latent-attention: "
                              "MLA applies its own YaRN to the decoupled key (Megatron asserts "
                              "no other rotary embedding reaches it): give "
                              "--position-embedding-type rope --rope-type yarn")
        if m.qk_pos_emb_head_dim % 2:
            raise ConfigError(f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim}: RoPE needs an "
                              f"even dimension; use {m.qk_pos_emb_head_dim + 1}")
    if m.position_embedding_type == "yarn" and m.rotary_percent < 1:
        raise ConfigError(f"--position-embedding-type yarn rotates every channel of a head "
                          f"(Megatron's YarnRotaryEmbedding ignores --rotary-percent "
                          f"{m.rotary_percent}): drop --rotary-percent")
    if m.mtp_num_layers:  # another family refuses it (loom.models.gpt.config)
        if pp > 1 and m.position_embedding_type == "learned_absolute":
            raise ConfigError("--mtp-num-layers on a later pipeline stage has no learned "
                              "position table: use --position-embedding-type rope or "
                              "--pipeline-model-parallel-size 1")
