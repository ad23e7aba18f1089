"""Gemma 3 fields of :class:`~loom.config.sections.ModelConfig` (``--model-type gemma3``;
HF Gemma3TextConfig's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from loom.config.fields import opt


@dataclass
class Gemma3Fields:
    """Gemma 3's own flags; a mixin of ModelConfig."""

    # -- Gemma 3 (--model-type gemma3; HF Gemma3TextConfig's names) -----------------------------
    sliding_window: Optional[int] = opt(None, "gemma3: keys a local layer's query sees (itself "
                                              "and the W-1 before it; default: all)", ge=1)
    gemma_qk_norm: bool = opt(True, "gemma3: RMSNorm (1 + w) of each query and key head "
                                    "before RoPE (Gemma 3's); --no-gemma-qk-norm: none, "
                                    "Gemma 2's layers (loom's own flag)")
    gemma_post_norms: bool = opt(True, "gemma3: RMSNorm (1 + w) of the attention and MLP "
                                       "outputs before each residual add (Gemma 2 and 3's "
                                       "sandwich); --no-gemma-post-norms: none, Gemma 1's "
                                       "layers (loom's own flag)")
    sliding_window_pattern: int = opt(6, "gemma3: every N-th layer is global, the rest local "
                                         "(5 local : 1 global)", ge=1)
    layer_types: Optional[str] = opt(None, "gemma3: one character per layer, L local (sliding "
                                           "window) or G global (default: from the pattern)")
    rotary_base_local: float = opt(10000.0, "gemma3: RoPE base of the local layers (the global "
                                            "ones use --rotary-base)", gt=0)
    rotary_scaling_factor: Optional[float] = opt(
        None, "gemma3: linear RoPE scaling of the global layers (positions / factor); with "
              "--position-embedding-type yarn or --multi-latent-attention: YaRN's scaling "
              "factor s; otherwise no effect, as in Megatron-LM (Llama 3's is "
              "--rope-scaling-factor)", gt=0)
    query_pre_attn_scalar: Optional[float] = opt(None, "gemma3: attention scores scaled by "
                                                       "1/sqrt(this) (default: head dim)", gt=0)
    attn_logit_softcapping: Optional[float] = opt(None, "gemma3: cap * tanh(scores / cap) on "
                                                        "attention scores", gt=0)
    final_logit_softcapping: Optional[float] = opt(None, "gemma3: cap * tanh(logits / cap) on "
                                                         "the output logits", gt=0)

    @property
    def attention_layer_types(self) -> str:
        """gemma3: ``L`` (local, sliding window) or ``G`` (global) per layer."""
        n = self.sliding_window_pattern
        return self.layer_types or "".join("G" if (i + 1) % n == 0 else "L"
                                           for i in range(self.num_layers))
