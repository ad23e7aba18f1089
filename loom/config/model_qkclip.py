"""QK-clip's fields of :class:`~loom.config.sections.ModelConfig` (Kimi K2's MuonClip: Kimi
Team 2025, "Kimi K2: Open Agentic Intelligence", sec. 2.1; Megatron-LM's
``TransformerConfig.qk_clip*`` flag names, meanings and defaults, ``arguments.py``'s checks) and
their checks (:func:`check_qk_clip`, part of the one validation pass).

``--qk-clip``: after each optimizer step, every standard attention layer whose largest scaled
attention logit of the step (``max q k^T * softmax_scale`` over the global batch, per head)
exceeds ``--qk-clip-threshold`` tau has, per query group with maximum ``m``,
``eta = min(tau / m, 1)``, its query rows of ``linear_qkv`` scaled by ``eta^alpha`` and its key
rows by ``eta^(1 - alpha)`` (``--qk-clip-alpha``), so the group's logits shrink by ``eta``.
``--log-max-attention-logit`` (a logging flag) records the same maxima and logs their maximum.
The math: :mod:`loom.training.qk_clip`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loom.config.fields import opt
from loom.errors import ConfigError


@dataclass
class QKClipFields:
    """QK-clip flags; a mixin of ModelConfig (off by default)."""

    qk_clip: bool = opt(False, "after each optimizer step, scale the query and key rows of "
                               "the attention layers whose largest attention logit of the "
                               "step exceeds --qk-clip-threshold (Kimi K2's MuonClip)")
    qk_clip_alpha: float = opt(0.5, "QK-clip: the query rows take eta^alpha, the key rows "
                                    "eta^(1 - alpha) (0 < alpha < 1)")
    qk_clip_threshold: float = opt(100, "QK-clip: the largest attention logit allowed (> 0)")


def check_qk_clip(cfg: Any, family_records: bool = True) -> None:
    """Refuse QK-clip and ``--log-max-attention-logit`` settings that do not fit: Megatron's
    bounds (``0 < --qk-clip-alpha < 1``, ``--qk-clip-threshold > 0``) and what loom lacks
    (MLA, context parallelism, a family whose attention records no logits,
    ``family_records`` False: ``ModelFamily.records_attention_logits``; the clip under FSDP).
    Raises ConfigError naming the flag and a fix."""
    m = cfg.model
    logs = bool(getattr(cfg.logging, "log_max_attention_logit", False))
    if not (m.qk_clip or logs):
        return
    what = "--qk-clip" if m.qk_clip else "--log-max-attention-logit"
    if m.qk_clip and not 0.0 < m.qk_clip_alpha < 1.0:
        raise ConfigError(f"--qk-clip-alpha {m.qk_clip_alpha} must lie strictly between 0 and "
                          f"1 (Megatron's check): e.g. 0.5")
    if m.qk_clip and not m.qk_clip_threshold > 0:
        raise ConfigError(f"--qk-clip-threshold {m.qk_clip_threshold} must be > 0: e.g. 100")
    if m.multi_latent_attention:
        raise ConfigError(f"{what} with --multi-latent-attention: loom records and clips the "
                          f"logits of standard attention layers only; drop one of them")
    if not family_records:
        raise ConfigError(f"{what} with --model-type {m.model_type}: loom records the logits of "
                          f"the gpt and mamba families' attention layers only; drop it")
    if cfg.parallel.context_parallel_size > 1:
        raise ConfigError(f"{what} with --context-parallel-size "
                          f"{cfg.parallel.context_parallel_size}: loom's context-parallel cores "
                          f"do not record the attention logits; use --context-parallel-size 1")
    t = cfg.training
    if m.qk_clip and (t.zero_stage == 3 or t.use_torch_fsdp2 or t.use_megatron_fsdp):
        raise ConfigError("--qk-clip under FSDP (ZeRO stage 3): loom clips whole weight "
                          "matrices; use --use-distributed-optimizer (ZeRO 1/2) instead")
