"""Mamba-2 / hybrid-stack fields of :class:`~loom.config.sections.ModelConfig`
(``--model-type mamba``; Dao & Gu 2024; Megatron-LM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from loom.config.fields import opt


@dataclass
class MambaFields:
    """Mamba-2 / hybrid stacks' own flags; a mixin of ModelConfig."""

    # -- Mamba-2 / hybrid stacks (--model-type mamba; Dao & Gu 2024; Megatron-LM's names) ------
    hybrid_override_pattern: Optional[str] = opt(
        None, "layer kinds of a hybrid stack, one character per layer: M Mamba, * attention, "
              "- MLP (default: all M)")
    hybrid_attention_ratio: float = opt(
        0.0, "share of attention layers, placed evenly among the Mamba layers when "
             "--hybrid-override-pattern is not given (Megatron-LM <= core_v0.16)", ge=0.0,
        le=1.0)
    hybrid_mlp_ratio: float = opt(
        0.0, "share of MLP layers, placed as --hybrid-attention-ratio places attention "
             "(Megatron-LM <= core_v0.16)", ge=0.0, le=1.0)
    mamba_state_dim: int = opt(128, "N: SSM state size per head", ge=1)
    mamba_head_dim: int = opt(64, "P: channels per SSM head", ge=1)
    mamba_num_groups: int = opt(8, "G: groups sharing B and C (like GQA groups)", ge=1)
    mamba_expand: int = opt(2, "d_inner = expand x h (Mamba's expansion factor; unused with "
                               "--mamba-num-heads)", ge=1)
    mamba_num_heads: Optional[int] = opt(
        None, "H: Mamba-2 heads per layer; d_inner = H x --mamba-head-dim, whatever h is "
              "(Nemotron-H; default: --mamba-expand x h / --mamba-head-dim)", ge=1)
    mamba_d_conv: int = opt(4, "kernel size of the causal depthwise convolution", ge=1)
    mamba_chunk_size: int = opt(128, "SSD chunk length Q (exact for any value; a speed knob)",
                                ge=1)


    @property
    def mamba_d_inner(self) -> int:
        """d_inner, the Mamba-2 mixer's inner width: ``--mamba-num-heads x --mamba-head-dim``
        when the heads are given, else ``--mamba-expand x h`` (Megatron's ``MambaMixer``)."""
        if self.mamba_num_heads is not None:
            return self.mamba_num_heads * self.mamba_head_dim
        return self.mamba_expand * self.hidden_size
