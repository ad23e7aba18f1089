"""muP (maximal update parametrization; Yang et al. 2022, "Tensor Programs V", table 8 with
Adam) fields of :class:`~loom.config.sections.ModelConfig`, Megatron-LM's ``--use-mup`` and its
companions (names, meanings and defaults of ``TransformerConfig``'s MuP block at d98e8a6), the
multipliers they resolve to. loom implements muP for the GPT family only (Megatron also for
BERT and, experimentally, hybrid stacks): another family refuses ``--use-mup``
(:mod:`loom.models.gpt.config`); its companions without ``--use-mup`` change nothing, as in
Megatron (which reads them only with it).

With ``--use-mup`` and width multiplier ``m = --hidden-size / --mup-base-hidden-size``
(Megatron's ``TransformerConfig.__post_init__``, ``get_mup_config_overrides``):

- initialization: hidden weights N(0, std^2 / m), output projections (``linear_proj``,
  ``linear_fc2``) N(0, std^2 / (2 L m)); embeddings and an untied output layer keep N(0, std^2);
- attention scores scaled by ``sqrt(--mup-base-head-dim or 1) / d^--mup-attn-scale-power``
  instead of ``1 / sqrt(d)`` (multi-latent attention keeps its own scale, as in Megatron);
- the embedding output times ``--mup-embedding-mult``; the logits times ``--mup-output-mult``,
  which left at 1 becomes ``1 / m``;
- the optimizer (:mod:`loom.training.param_groups`): Adam's hidden matrices (2-D or more, not
  an embedding or the output layer) at peak and minimum learning rate and epsilon divided by m;
  SGD's vector-like parameters (embeddings, output layer, 1-D) at learning rates times m; Muon's
  matrices keep theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from loom.config.fields import opt


@dataclass
class MupFields:
    """``--use-mup`` and its companions; a mixin of ModelConfig (off by default)."""

    use_mup: bool = opt(False, "muP (maximal update parametrization, Megatron's): width-scaled "
                               "initialization, 1/d attention, logit and embedding "
                               "multipliers, per-group learning rates and Adam epsilon, so "
                               "hyperparameters tuned at --mup-base-hidden-size transfer")
    mup_base_hidden_size: Optional[int] = opt(
        None, "muP: hidden size of the base (proxy) model the hyperparameters were tuned at; "
              "the width multiplier m is --hidden-size / this (default: --hidden-size, m = 1)",
        ge=1)
    mup_embedding_mult: float = opt(1.0, "muP: multiplier of the embedding output")
    mup_output_mult: float = opt(1.0, "muP: multiplier of the output logits (1: 1/m, "
                                      "Megatron's automatic value)")
    mup_base_head_dim: Optional[float] = opt(
        None, "muP: base head dimension d0; attention scores are scaled by sqrt(d0) / "
              "d^--mup-attn-scale-power (default d0 = 1: 1/d)", gt=0)
    mup_attn_scale_power: float = opt(1.0, "muP: power p of the attention scale 1/d^p (1: "
                                           "muP's 1/d; 0.5: the standard 1/sqrt(d))")

    @property
    def width_multiplier(self) -> float:
        """m: ``--hidden-size / --mup-base-hidden-size`` under ``--use-mup`` (1 without)."""
        if not self.use_mup:
            return 1.0
        return self.hidden_size / (self.mup_base_hidden_size or self.hidden_size)

    @property
    def attention_softmax_scale(self) -> Optional[float]:
        """The attention-score scale muP sets (``sqrt(d0) / d^p``), or None: the core's
        ``1 / sqrt(d)``."""
        if not self.use_mup:
            return None
        base = 1.0 if self.mup_base_head_dim is None else self.mup_base_head_dim ** 0.5
        return base / self.head_dim ** self.mup_attn_scale_power

    @property
    def logit_multiplier(self) -> float:
        """The output logits' multiplier: ``--mup-output-mult``, or 1/m when left at 1 (1
        without ``--use-mup``)."""
        if not self.use_mup:
            return 1.0
        m = self.width_multiplier
        return 1.0 / m if self.mup_output_mult == 1.0 and m != 1.0 else self.mup_output_mult

    @property
    def embedding_multiplier(self) -> float:
        """The embedding output's multiplier (1 without ``--use-mup``)."""
        return self.mup_embedding_mult if self.use_mup else 1.0
