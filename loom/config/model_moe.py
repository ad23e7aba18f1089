"""Mixture-of-experts fields of :class:`~loom.config.sections.ModelConfig` (Megatron's
``--moe-*`` flags and ``--num-experts``; Switch, Mixtral, DeepSeek-V3, Qwen2-MoE)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from loom.config.fields import opt

RouterScore = Literal["softmax", "sigmoid"]


@dataclass
class MoEFields:
    """The MoE flags (dense MLPs without ``--num-experts``); a mixin of ModelConfig."""

    # -- mixture of experts (Megatron's --moe-* flags; Switch, Mixtral, DeepSeek-V3) ----------
    num_experts: Optional[int] = opt(None, "E: experts per MoE layer (default: dense MLPs)", ge=1)
    moe_router_topk: int = opt(2, "k: experts each token is routed to", ge=1)
    moe_ffn_hidden_size: Optional[int] = opt(None, "hidden size of each expert's MLP (default: "
                                                   "--ffn-hidden-size)", ge=1)
    moe_shared_expert_intermediate_size: Optional[int] = opt(
        None, "hidden size of an always-on shared expert (DeepSeek, Qwen; default: none)", ge=1)
    moe_layer_freq: int = opt(1, "every N-th layer is MoE (layer i when i % N == 0), the rest "
                                 "dense", ge=1)
    moe_router_score_function: RouterScore = opt(
        "softmax", "router scores: softmax (Mixtral) or sigmoid with normalized top-k weights "
                   "(DeepSeek-V3)")
    moe_router_pre_softmax: bool = opt(False, "softmax over all experts, top-k weights not "
                                              "renormalized (Qwen2-MoE)")
    moe_aux_loss_coeff: float = opt(0.0, "coefficient of the Switch/GShard load-balancing loss",
                                    ge=0)
    moe_z_loss_coeff: float = opt(0.0, "coefficient of the router z-loss (ST-MoE)", ge=0)
    moe_expert_capacity_factor: Optional[float] = opt(
        None, "tokens per expert capped at factor x T k / E, the rest dropped (default: "
              "dropless)", gt=0)
    moe_shared_expert_gate: bool = opt(False, "scale the shared expert's output by "
                                              "sigmoid(x w) (Qwen2-MoE)")

    @property
    def moe_ffn_size(self) -> int:
        """Expert MLP hidden size: ``--moe-ffn-hidden-size`` or the dense one."""
        return self.moe_ffn_hidden_size or self.ffn_size

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (0-based) has an MoE instead of a dense MLP."""
        return bool(self.num_experts) and layer_number % self.moe_layer_freq == 0
